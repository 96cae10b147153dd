//! f32 fast paths of the batched backward: the operators a backward launch recomputes, and the
//! vector-Jacobian products of the elementwise and layout operators, on contiguous f32 tensors
//! with the runtime's SIMD loops — instead of the operator table's reference rules, which work in
//! f64 through generic broadcasting and cost TreeLSTM's training most of its backward (its
//! `sigmoid`, `tanh`, `bias_add`, `split`, `multiply` and `take`; the layout ones are
//! [`crate::fastops`]'s, shared with the forward's batching rules). Each returns `None` where it
//! does not apply (another dtype, a broadcast it does not handle, an index out of range), and the
//! caller falls back to the reference rule, which also reports any error. The results equal the
//! reference rules' to f32 rounding (the SIMD `sigmoid`/`tanh` are the row programs' own); the
//! switch `GradOptions::fast` turns these paths off.

use tumble_ir::Attrs;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

use super::param_grad::ParamGrad;
use crate::batched::BV;
use crate::fastmath;
use crate::simd;

fn f32_of(v: &OpValue) -> Option<(&Tensor, &[f32])> {
    let t = v.as_tensor()?;
    Some((t, t.as_f32()?))
}

fn tensor(shape: &[usize], data: Vec<f32>) -> Option<OpValue> {
    Tensor::from_vec(shape.to_vec(), data)
        .ok()
        .map(OpValue::Tensor)
}

// Outputs in recycled buffers (`pool::scratch_f32`, every element written): a fresh zeroed
// allocation per operator was a memset and, for a large launch, page faults.
fn unary(x: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
    let mut out = tumble_tensor::pool::scratch_f32(x.len());
    simd::unary(&mut out, x, f);
    out
}

fn binary(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    let mut out = tumble_tensor::pool::scratch_f32(x.len());
    simd::binary(&mut out, x, y, f);
    out
}

use crate::fastops::axis_of;

/// `nn.bias_add`'s bias runs along the last axis (the only form handled here).
fn bias_on_last_axis(x: &Tensor, b: &Tensor, attrs: &Attrs) -> bool {
    let r = x.rank();
    let axis = attrs.int("axis").ok().flatten().unwrap_or(1);
    r >= 1 && axis_of(axis, r) == Some(r - 1) && b.rank() == 1 && x.shape().last() == Some(&b.len())
}

/// Forward operator `op` for the backward's recompute: the row programs' SIMD `sigmoid`, `tanh`,
/// `exp` (not bit-identical to the reference), else the bit-identical [`crate::fastops`] on at
/// most `threads` threads.
pub(super) fn eval(op: &str, args: &[OpValue], attrs: &Attrs, threads: usize) -> Option<OpValue> {
    match op {
        "sigmoid" | "tanh" | "exp" | "negative" | "nn.relu" => {
            let (t, x) = f32_of(args.first()?)?;
            let out = match op {
                "sigmoid" => unary(x, fastmath::sigmoid),
                "tanh" => unary(x, fastmath::tanh),
                "exp" => unary(x, fastmath::exp),
                "negative" => unary(x, |v| -v),
                // NaN stays NaN, as in the reference (`max(0.0)` would make it 0).
                _ => unary(x, |v| if v < 0.0 { 0.0 } else { v }),
            };
            tensor(t.shape(), out)
        }
        _ => crate::fastops::try_eval(op, args, attrs, threads),
    }
}

/// `g` (of shape `full`) summed down to `to`, when `to` is `full`'s trailing axes (with leading
/// ones): a bias's gradient, rows added in order.
fn reduce_to(g: &[f32], full: &[usize], to: &Tensor) -> Option<Tensor> {
    if to.shape() == full {
        return Tensor::from_vec(full.to_vec(), g.to_vec()).ok();
    }
    let lead = to.shape().iter().take_while(|&&d| d == 1).count();
    let core = &to.shape()[lead..];
    if core.len() > full.len() || !full.ends_with(core) {
        return None;
    }
    let inner: usize = core.iter().product();
    if inner == 0 || g.len() % inner != 0 {
        return None;
    }
    let mut acc = vec![0f32; inner];
    for row in g.chunks_exact(inner) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += v;
        }
    }
    Tensor::from_vec(to.shape().to_vec(), acc).ok()
}

/// [`reduce_to`] of a gradient computed here: `g` itself, not a copy, when `to` is `full`.
fn sum_to(g: Vec<f32>, full: &[usize], to: &Tensor) -> Option<Tensor> {
    if to.shape() == full {
        return Tensor::from_vec(full.to_vec(), g).ok();
    }
    let out = reduce_to(&g, full, to);
    tumble_tensor::pool::recycle(g);
    out
}

/// The gradient `dy` (of shape `full`) passed to an operand of shape `to`: `dy` itself (shared,
/// not copied) when the operand is not broadcast, else summed down.
fn pass_to(dy: &Tensor, g: &[f32], full: &[usize], to: &Tensor) -> Option<Tensor> {
    if to.shape() == full {
        return Some(dy.clone());
    }
    reduce_to(g, full, to)
}

/// `v` repeated to `len` elements when it is `full`'s trailing axes (a broadcast operand); `v`
/// itself when it is not broadcast.
fn broadcast_to<'v>(
    v: &'v [f32],
    t: &Tensor,
    full: &[usize],
    len: usize,
) -> Option<std::borrow::Cow<'v, [f32]>> {
    if t.shape() == full {
        return Some(std::borrow::Cow::Borrowed(v));
    }
    let lead = t.shape().iter().take_while(|&&d| d == 1).count();
    if !full.ends_with(&t.shape()[lead..]) || v.is_empty() || len % v.len() != 0 {
        return None;
    }
    Some(std::borrow::Cow::Owned(
        v.iter().copied().cycle().take(len).collect(),
    ))
}

/// The vjp of `op` (result `out`, output gradient `dy`), one entry per argument.
pub(super) fn vjp(
    op: &str,
    args: &[OpValue],
    attrs: &Attrs,
    out: &OpValue,
    dy: &OpValue,
) -> Option<Vec<Option<OpValue>>> {
    let t = |v: Tensor| Some(OpValue::Tensor(v));
    match op {
        "add" | "subtract" | "multiply" => {
            let ((ta, a), (tb, b)) = (f32_of(args.first()?)?, f32_of(args.get(1)?)?);
            let (ty, _) = f32_of(out)?;
            let (tg, g) = f32_of(dy)?;
            let full = ty.shape();
            if g.len() != ty.len() || tg.shape() != full {
                return None;
            }
            match op {
                "add" => Some(vec![
                    t(pass_to(tg, g, full, ta)?),
                    t(pass_to(tg, g, full, tb)?),
                ]),
                "subtract" => Some(vec![
                    t(pass_to(tg, g, full, ta)?),
                    t(sum_to(unary(g, |v| -v), full, tb)?),
                ]),
                _ => {
                    let (af, bf) = (
                        broadcast_to(a, ta, full, g.len())?,
                        broadcast_to(b, tb, full, g.len())?,
                    );
                    let (ga, gb) = (binary(g, &bf, |p, q| p * q), binary(g, &af, |p, q| p * q));
                    Some(vec![t(sum_to(ga, full, ta)?), t(sum_to(gb, full, tb)?)])
                }
            }
        }
        "nn.bias_add" => {
            let ((tx, _), (tb, _)) = (f32_of(args.first()?)?, f32_of(args.get(1)?)?);
            let (tg, g) = f32_of(dy)?;
            if !bias_on_last_axis(tx, tb, attrs) || tg.shape() != tx.shape() {
                return None;
            }
            Some(vec![t(tg.clone()), t(reduce_to(g, tg.shape(), tb)?)])
        }
        "sigmoid" | "tanh" | "exp" | "negative" | "nn.relu" => {
            let (tx, x) = f32_of(args.first()?)?;
            let (_, y) = f32_of(out)?;
            let (_, g) = f32_of(dy)?;
            if g.len() != x.len() || y.len() != x.len() {
                return None;
            }
            let dx = match op {
                "sigmoid" => binary(g, y, |d, o| d * (o * (1.0 - o))),
                "tanh" => binary(g, y, |d, o| d * (1.0 - o * o)),
                "exp" => binary(g, y, |d, o| d * o),
                "negative" => unary(g, |d| -d),
                _ => binary(g, x, |d, v| if v > 0.0 { d } else { 0.0 }),
            };
            Some(vec![t(Tensor::from_vec(tx.shape().to_vec(), dx).ok()?)])
        }
        "split" => {
            // The pieces' gradients put back side by side along the axis.
            let (tx, _) = f32_of(args.first()?)?;
            let OpValue::Tuple(gs) = dy else { return None };
            let axis = axis_of(attrs.int("axis").ok().flatten().unwrap_or(0), tx.rank())?;
            let dx = crate::fastops::concat_f32(gs, axis)?;
            (dx.shape() == tx.shape()).then(|| vec![t(dx)])
        }
        _ => None,
    }
}

/// Adds the gradient `dy` of `take(table, idx, axis=0)` (an f32 table of rank 2, in-range
/// integer ids, batched or shared) into `slot`, the table's gradient, row by row
/// ([`ParamGrad::add_rows`]). Returns false, having changed nothing, where this does not apply.
pub(super) fn scatter_rows_into(
    slot: &mut Option<ParamGrad>,
    table: &Tensor,
    idx: &BV,
    dy: &BV,
    attrs: &Attrs,
) -> bool {
    let (BV::Batched(OpValue::Tensor(ids)) | BV::Shared(OpValue::Tensor(ids))) = idx else {
        return false;
    };
    let (BV::Batched(OpValue::Tensor(g)) | BV::Shared(OpValue::Tensor(g))) = dy else {
        return false;
    };
    let [n, d] = *table.shape() else { return false };
    if attrs.int("axis").ok().flatten() != Some(0)
        || table.as_f32().is_none()
        || !ids.dtype().is_int()
        || d == 0
    {
        return false;
    }
    let Some(gv) = g.as_f32() else { return false };
    let Some(ids) = ids
        .to_i64_vec()
        .into_iter()
        .map(|i| usize::try_from(i).ok().filter(|&i| i < n))
        .collect::<Option<Vec<usize>>>()
    else {
        return false;
    };
    ParamGrad::add_rows(slot, [n, d], &ids, gv)
}
