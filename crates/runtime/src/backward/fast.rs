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

/// The unary operators whose f32 vjp ([`vjp`]) reads their result only, never their operand:
/// the kept forward may keep their result in its place ([`crate::kept`]).
pub(crate) const RESULT_ONLY_VJP_UNARIES: [&str; 4] = ["sigmoid", "tanh", "exp", "negative"];

/// Unary `op` (`sigmoid`, `tanh`, `exp`, `negative`, `nn.relu`) of `x` into `out`, on the row
/// programs' SIMD functions: what [`eval`] computes, for callers with their own buffers (the kept
/// forward's split parts); `None` for another operator.
pub(crate) fn unary_into(op: &str, out: &mut [f32], x: &[f32]) -> Option<()> {
    match op {
        "sigmoid" => simd::unary(out, x, fastmath::sigmoid),
        "tanh" => simd::unary(out, x, fastmath::tanh),
        "exp" => simd::unary(out, x, fastmath::exp),
        "negative" => simd::unary(out, x, |v| -v),
        // NaN stays NaN, as in the reference (`max(0.0)` would make it 0).
        "nn.relu" => simd::unary(out, x, |v| if v < 0.0 { 0.0 } else { v }),
        _ => return None,
    }
    Some(())
}

/// The f32 vjp of a unary operator of [`RESULT_ONLY_VJP_UNARIES`] into `dx`, from its output
/// gradient `g` and its result `y` alone; `None` for another operator.
fn result_only_vjp_into(op: &str, dx: &mut [f32], g: &[f32], y: &[f32]) -> Option<()> {
    match op {
        "sigmoid" => simd::binary(dx, g, y, |d, o| d * (o * (1.0 - o))),
        "tanh" => simd::binary(dx, g, y, |d, o| d * (1.0 - o * o)),
        "exp" => simd::binary(dx, g, y, |d, o| d * o),
        "negative" => simd::unary(dx, g, |d| -d),
        _ => return None,
    }
    Some(())
}

/// One part of a split read by a unary operator, for [`split_unaries_vjp`]: the operator, the
/// part's width, the operator's result and its output gradient (`None`: none reached it).
pub(crate) struct SplitPart<'a> {
    pub op: &'static str,
    pub width: usize,
    pub y: &'a [f32],
    pub dy: Option<&'a [f32]>,
}

/// The gradient of a split's operand (`rows` rows of `d` floats) whose every part one
/// result-only unary operator reads, with those operators' vjps: each part's columns written in
/// place by its operator's f32 vjp ([`result_only_vjp_into`], zeros where no gradient reached
/// it). The same bits as those vjps and the split's concatenation of their results, without a
/// part's gradient written apart and copied. `None` if a part does not fit.
pub(crate) fn split_unaries_vjp(rows: usize, d: usize, parts: &[SplitPart]) -> Option<Vec<f32>> {
    let mut dx = tumble_tensor::pool::scratch_f32(rows.checked_mul(d)?);
    let mut begin = 0;
    for p in parts {
        let w = p.width;
        let end = begin + w;
        if end > d || p.y.len() != rows * w || p.dy.is_some_and(|g| g.len() != rows * w) {
            return None;
        }
        if w > 0 {
            for (r, row) in dx.chunks_exact_mut(d).enumerate() {
                let out = row.get_mut(begin..end)?;
                match p.dy {
                    None => out.fill(0.0),
                    Some(g) => {
                        let (g, y) = (g.get(r * w..(r + 1) * w)?, p.y.get(r * w..(r + 1) * w)?);
                        result_only_vjp_into(p.op, out, g, y)?;
                    }
                }
            }
        }
        begin = end;
    }
    (begin == d).then_some(dx)
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
pub(crate) fn eval(op: &str, args: &[OpValue], attrs: &Attrs, threads: usize) -> Option<OpValue> {
    match op {
        "sigmoid" | "tanh" | "exp" | "negative" | "nn.relu" => {
            let (t, x) = f32_of(args.first()?)?;
            let mut out = tumble_tensor::pool::scratch_f32(x.len());
            unary_into(op, &mut out, x)?;
            tensor(t.shape(), out)
        }
        "nn.softmax" | "nn.log_softmax" => {
            let (t, x) = f32_of(args.first()?)?;
            let w = last_axis_width(t, attrs)?;
            let mut out = tumble_tensor::pool::scratch_f32(x.len());
            for (o, r) in out.chunks_exact_mut(w).zip(x.chunks_exact(w)) {
                crate::fused::softmax_row(o, r, op == "nn.log_softmax");
            }
            tensor(t.shape(), out)
        }
        "reshape" => {
            let t = args.first()?.as_tensor()?;
            let shape = plain_newshape(attrs, t.len())?;
            t.reshape(shape).ok().map(OpValue::Tensor)
        }
        "take" if attrs.int("batch_dims").ok().flatten() == Some(1) => {
            let (t, x) = f32_of(args.first()?)?;
            let (c, picks) = row_picks(t, args.get(1)?.as_tensor()?, attrs)?;
            let out = picks
                .iter()
                .enumerate()
                .map(|(r, &i)| x.get(r * c + i).copied())
                .collect::<Option<Vec<f32>>>()?;
            tensor(&[picks.len()], out)
        }
        _ => crate::fastops::try_eval(op, args, attrs, threads),
    }
}

/// The width of the rows `nn.softmax`/`nn.log_softmax` normalize when `attrs`' axis is `t`'s
/// last (the only form handled here), else `None`.
fn last_axis_width(t: &Tensor, attrs: &Attrs) -> Option<usize> {
    let r = t.rank();
    let axis = attrs.int("axis").ok().flatten().unwrap_or(-1);
    let w = *t.shape().last()?;
    (r >= 1 && axis_of(axis, r) == Some(r - 1) && w > 0 && t.len() % w == 0).then_some(w)
}

/// `reshape`'s `newshape` when every entry is a plain dimension (none of Relay's special
/// values 0, -1, -2, -3, -4) and they hold `len` elements.
fn plain_newshape(attrs: &Attrs, len: usize) -> Option<Vec<usize>> {
    let s = attrs.ints("newshape").ok()??;
    let dims = s
        .iter()
        .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
        .collect::<Option<Vec<usize>>>()?;
    (dims.iter().product::<usize>() == len).then_some(dims)
}

/// `take(x, idx, axis=1, batch_dims=1)` on a `(rows, c)` table with one index per row (the
/// batched form of a loss's `take(log_probs, %label)`): `c` and each row's column, when every
/// index is in range (out-of-range ones, which the modes treat differently, go to the
/// reference rule).
fn row_picks(x: &Tensor, idx: &Tensor, attrs: &Attrs) -> Option<(usize, Vec<usize>)> {
    let &[rows, c] = x.shape() else { return None };
    if !idx.dtype().is_int() || idx.shape() != [rows] || attrs.int("axis").ok().flatten() != Some(1)
    {
        return None;
    }
    let picks = idx
        .to_i64_vec()
        .into_iter()
        .map(|i| usize::try_from(i).ok().filter(|&i| i < c))
        .collect::<Option<Vec<usize>>>()?;
    Some((c, picks))
}

/// Per axis of `full`, the step of an operand of shape `t` broadcast to it (the forward's
/// [`crate::fastops::Broadcast`]); `None` where `t` does not broadcast to `full`.
fn broadcast_steps(t: &[usize], full: &[usize]) -> Option<Vec<usize>> {
    let b = crate::fastops::Broadcast::new(&[t, full])?;
    (b.shape == full).then(|| b.strides.into_iter().next())?
}

/// Calls `f(row, base)` for each row (last axis) of a tensor of shape `full`, in order, with
/// the offset in an operand of steps `steps` where that row's elements start.
fn each_row(full: &[usize], steps: &[usize], mut f: impl FnMut(usize, usize)) {
    let Some((_, outer)) = full.split_last() else {
        f(0, 0);
        return;
    };
    let rows: usize = outer.iter().product();
    let mut index = vec![0usize; outer.len()];
    let mut base = 0usize;
    for r in 0..rows {
        f(r, base);
        for ax in (0..outer.len()).rev() {
            index[ax] += 1;
            base += steps[ax];
            if index[ax] < outer[ax] {
                break;
            }
            base -= steps[ax] * outer[ax];
            index[ax] = 0;
        }
    }
}

/// `g` (of shape `full`) summed down to the shape of `to`, an operand broadcast to `full` (any
/// of its axes, not only leading ones: a `(B, 1, H)` against `(B, T, H)`), in f32, each of its
/// elements summing its rows in order.
fn reduce_to(g: &[f32], full: &[usize], to: &Tensor) -> Option<Tensor> {
    if to.shape() == full {
        return Tensor::from_vec(full.to_vec(), g.to_vec()).ok();
    }
    let steps = broadcast_steps(to.shape(), full)?;
    let width = full.last().copied().unwrap_or(1);
    if g.len() != full.iter().product::<usize>() || width == 0 {
        return None;
    }
    let last = steps.last().copied().unwrap_or(0);
    let mut acc = vec![0f32; to.len()];
    let mut ok = true;
    each_row(full, &steps, |r, base| {
        let row = &g[r * width..(r + 1) * width];
        match (
            last,
            acc.get_mut(base..base + if last == 0 { 1 } else { width }),
        ) {
            (0, Some([a])) => *a += row.iter().sum::<f32>(),
            (_, Some(a)) => a.iter_mut().zip(row).for_each(|(a, v)| *a += v),
            (_, None) => ok = false,
        }
    });
    ok.then(|| Tensor::from_vec(to.shape().to_vec(), acc).ok())?
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

/// `v` (an operand of shape `t`'s elements) broadcast to `full` (`len` elements); `v` itself
/// when it is not broadcast.
fn broadcast_to<'v>(
    v: &'v [f32],
    t: &Tensor,
    full: &[usize],
    len: usize,
) -> Option<std::borrow::Cow<'v, [f32]>> {
    if t.shape() == full {
        return Some(std::borrow::Cow::Borrowed(v));
    }
    let steps = broadcast_steps(t.shape(), full)?;
    let width = full.last().copied().unwrap_or(1);
    if len != full.iter().product::<usize>() || width == 0 || v.len() != t.len() {
        return None;
    }
    let last = steps.last().copied().unwrap_or(0);
    let mut out = tumble_tensor::pool::scratch_f32(len);
    let mut ok = true;
    each_row(full, &steps, |r, base| {
        let dst = &mut out[r * width..(r + 1) * width];
        match (last, v.get(base..base + if last == 0 { 1 } else { width })) {
            (0, Some(&[x])) => dst.fill(x),
            (_, Some(src)) if src.len() == width => dst.copy_from_slice(src),
            _ => ok = false,
        }
    });
    ok.then_some(std::borrow::Cow::Owned(out))
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
                "nn.relu" => binary(g, x, |d, v| if v > 0.0 { d } else { 0.0 }),
                _ => {
                    let mut dx = tumble_tensor::pool::scratch_f32(g.len());
                    result_only_vjp_into(op, &mut dx, g, y)?;
                    dx
                }
            };
            Some(vec![t(Tensor::from_vec(tx.shape().to_vec(), dx).ok()?)])
        }
        "nn.softmax" | "nn.log_softmax" => {
            let (tx, _) = f32_of(args.first()?)?;
            let w = last_axis_width(tx, attrs)?;
            let (_, y) = f32_of(out)?;
            let (_, g) = f32_of(dy)?;
            if g.len() != tx.len() || y.len() != tx.len() {
                return None;
            }
            // The reference rules, row by row, with the row's sum in f64 as they take it.
            let mut dx = tumble_tensor::pool::scratch_f32(g.len());
            for ((d, ys), gs) in dx
                .chunks_exact_mut(w)
                .zip(y.chunks_exact(w))
                .zip(g.chunks_exact(w))
            {
                if op == "nn.log_softmax" {
                    let s: f64 = gs.iter().map(|&v| f64::from(v)).sum();
                    for ((o, &yv), &gv) in d.iter_mut().zip(ys).zip(gs) {
                        *o = (f64::from(gv) - f64::from(yv).exp() * s) as f32;
                    }
                } else {
                    let dot: f64 = ys
                        .iter()
                        .zip(gs)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    for ((o, &yv), &gv) in d.iter_mut().zip(ys).zip(gs) {
                        *o = (f64::from(yv) * (f64::from(gv) - dot)) as f32;
                    }
                }
            }
            Some(vec![t(Tensor::from_vec(tx.shape().to_vec(), dx).ok()?)])
        }
        "reshape" => {
            let (tx, _) = f32_of(args.first()?)?;
            let (tg, _) = f32_of(dy)?;
            Some(vec![t(tg.reshape(tx.shape().to_vec()).ok()?)])
        }
        "take" if attrs.int("batch_dims").ok().flatten() == Some(1) => {
            let (tx, _) = f32_of(args.first()?)?;
            let (c, picks) = row_picks(tx, args.get(1)?.as_tensor()?, attrs)?;
            let (_, g) = f32_of(dy)?;
            if g.len() != picks.len() {
                return None;
            }
            let mut dx = vec![0f32; tx.len()];
            for (r, (&i, &gv)) in picks.iter().zip(g).enumerate() {
                *dx.get_mut(r * c + i)? += gv;
            }
            Some(vec![
                t(Tensor::from_vec(tx.shape().to_vec(), dx).ok()?),
                None,
            ])
        }
        "transpose" => {
            // The output gradient permuted back (the reference rule scatters through an f64
            // index map: the per-step `transpose(%M)` of a decoder's attention spent 15% of its
            // gradient there).
            let (tx, _) = f32_of(args.first()?)?;
            let (tg, _) = f32_of(dy)?;
            let perm = crate::fastops::transpose_axes(attrs, tx.rank())?;
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                *inverse.get_mut(p)? = i;
            }
            let dx = crate::fastops::permute_f32(tg, &inverse)?;
            (dx.shape() == tx.shape()).then(|| vec![t(dx)])
        }
        "concatenate" => {
            // The output gradient cut back into the parts' widths along the axis (the reference
            // rule goes through f64 index maps: a window of three tokens concatenated per step
            // spent its backward there, with temporaries the profile did not count).
            let OpValue::Tuple(parts) = args.first()? else {
                return None;
            };
            let (tg, g) = f32_of(dy)?;
            let rank = tg.rank();
            let axis = axis_of(attrs.int("axis").ok().flatten().unwrap_or(0), rank)?;
            let outer: usize = tg.shape().get(..axis)?.iter().product();
            let inner: usize = tg.shape().get(axis + 1..)?.iter().product();
            let total = *tg.shape().get(axis)?;
            let mut widths = Vec::with_capacity(parts.len());
            for p in parts {
                let tp = p;
                tp.as_f32()?;
                let mut same = tp.rank() == rank;
                for (d, (&a, &b)) in tp.shape().iter().zip(tg.shape()).enumerate() {
                    same &= d == axis || a == b;
                }
                if !same {
                    return None;
                }
                widths.push(*tp.shape().get(axis)?);
            }
            if widths.iter().sum::<usize>() != total || g.len() != outer * total * inner {
                return None;
            }
            let mut grads = Vec::with_capacity(parts.len());
            let mut start = 0;
            for (p, &w) in parts.iter().zip(&widths) {
                let run = w * inner;
                let mut d = tumble_tensor::pool::scratch_f32(outer * run);
                for (o, dst) in d.chunks_exact_mut(run.max(1)).take(outer).enumerate() {
                    let at = o * total * inner + start * inner;
                    dst.copy_from_slice(g.get(at..at + run)?);
                }
                grads.push(Tensor::from_vec(p.shape().to_vec(), d).ok()?);
                start += w;
            }
            Some(vec![Some(OpValue::Tuple(grads))])
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fastops::tests::{attrs, rand, reference};
    use tumble_ir::AttrValue;
    use tumble_tensor::Rng;

    fn def(op: &str) -> &'static tumble_ops::OpDef {
        tumble_ops::lookup(op).unwrap_or_else(|| panic!("no {op}"))
    }

    fn reference_eval(op: &str, args: &[OpValue], a: &Attrs) -> OpValue {
        OpValue::Tensor(reference(op, args, a))
    }

    fn f32s(v: &OpValue) -> Vec<f32> {
        v.as_tensor()
            .and_then(Tensor::as_f32)
            .unwrap_or_else(|| panic!("not f32: {v:?}"))
            .to_vec()
    }

    /// Largest difference relative to the reference's largest entry (at least 1).
    fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        got.iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale
    }

    /// A split's gradient written part by part by its readers' vjps is, bit for bit, each
    /// reader's vjp apart and their concatenation (zeros for a part no gradient reached), at odd
    /// row counts and part widths around the vector width.
    #[test]
    fn split_unaries_vjp_is_the_vjps_concatenated_bit_for_bit() {
        let mut rng = Rng::new(11);
        let ops = ["sigmoid", "tanh", "exp", "negative"];
        for rows in [1usize, 3, 17] {
            for widths in [
                vec![5usize, 13, 1, 16],
                vec![17, 0, 33, 2],
                vec![32, 32, 32, 32],
            ] {
                let d: usize = widths.iter().sum();
                let ys: Vec<Tensor> = widths.iter().map(|&w| rand(&[rows, w], &mut rng)).collect();
                let dys: Vec<Option<Tensor>> = widths
                    .iter()
                    .enumerate()
                    .map(|(i, &w)| (i != 1).then(|| rand(&[rows, w], &mut rng)))
                    .collect();
                let parts: Vec<SplitPart> = (0..4)
                    .map(|i| SplitPart {
                        op: ops[i],
                        width: widths[i],
                        y: ys[i].as_f32().expect("f32"),
                        dy: dys[i].as_ref().map(|t| t.as_f32().expect("f32")),
                    })
                    .collect();
                let got = split_unaries_vjp(rows, d, &parts).expect("fused vjp");
                let mut want = vec![0f32; rows * d];
                let mut begin = 0;
                for i in 0..4 {
                    let w = widths[i];
                    if let Some(dy) = &dys[i] {
                        let y = OpValue::Tensor(ys[i].clone());
                        let g = vjp(
                            ops[i],
                            std::slice::from_ref(&y),
                            &Attrs::default(),
                            &y,
                            &OpValue::Tensor(dy.clone()),
                        )
                        .expect("vjp");
                        let g = f32s(g[0].as_ref().expect("dx"));
                        for r in 0..rows {
                            want[r * d + begin..r * d + begin + w]
                                .copy_from_slice(&g[r * w..(r + 1) * w]);
                        }
                    }
                    begin += w;
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "rows {rows} widths {widths:?}");
            }
        }
        // Parts that do not cover the operand's row, or a result of another length: no vjp.
        let y = [0.5f32; 3];
        let part = |width| SplitPart {
            op: "tanh",
            width,
            y: &y,
            dy: None,
        };
        assert!(split_unaries_vjp(1, 4, &[part(3)]).is_none());
        assert!(split_unaries_vjp(1, 2, &[part(2)]).is_none());
        assert!(split_unaries_vjp(
            1,
            3,
            &[SplitPart {
                op: "nn.relu",
                width: 3,
                y: &y,
                dy: Some(&y)
            }]
        )
        .is_none());
    }

    /// The fast softmax paths (recompute and vjp) agree with the operator table's f64 rules at
    /// row widths around the vector width, on the last axis given as 1, -1 or 2.
    #[test]
    fn softmax_paths_agree_with_the_reference() {
        let mut rng = Rng::new(3);
        for op in ["nn.softmax", "nn.log_softmax"] {
            for w in [1usize, 5, 16, 17, 33] {
                for (shape, axis) in [(vec![7, w], 1i64), (vec![7, w], -1), (vec![3, 1, w], 2)] {
                    let a = attrs(&[("axis", AttrValue::Int(axis))]);
                    let x = OpValue::Tensor(rand(&shape, &mut rng));
                    let y = eval(op, std::slice::from_ref(&x), &a, 1)
                        .unwrap_or_else(|| panic!("{op} w {w}: no fast path"));
                    let want = reference_eval(op, std::slice::from_ref(&x), &a);
                    assert!(rel_diff(&f32s(&y), &f32s(&want)) < 1e-6, "{op} w {w}");
                    let dy = OpValue::Tensor(rand(&shape, &mut rng));
                    let got = vjp(op, std::slice::from_ref(&x), &a, &y, &dy).expect("fast vjp");
                    let want = tumble_ops::vjp::vjp(def(op), std::slice::from_ref(&x), &a, &y, &dy)
                        .unwrap_or_else(|e| panic!("{e:?}"));
                    let (g, r) = (got[0].as_ref().expect("dx"), want[0].as_ref().expect("dx"));
                    assert!(
                        rel_diff(&f32s(g), &f32s(r)) < 1e-5,
                        "{op} w {w} axis {axis}"
                    );
                }
            }
        }
        // Another axis is left to the reference.
        let a = attrs(&[("axis", AttrValue::Int(0))]);
        let x = OpValue::Tensor(rand(&[4, 3], &mut rng));
        assert!(eval("nn.softmax", std::slice::from_ref(&x), &a, 1).is_none());
    }

    /// `add`, `subtract` and `multiply` with an operand broadcast along any of its axes (a
    /// `(B, 1, H)` against `(B, T, H)`, leading ones, a column, a scalar-like `(1, 1, 1)`, both
    /// ways round): gradients as the reference's rules give them.
    #[test]
    fn broadcast_arithmetic_gradients_agree_with_the_reference() {
        let mut rng = Rng::new(9);
        let pairs: [(&[usize], &[usize]); 6] = [
            (&[4, 5, 7], &[4, 1, 7]),
            (&[4, 5, 7], &[7]),
            (&[4, 5, 7], &[5, 1]),
            (&[4, 1, 7], &[1, 5, 7]),
            (&[3, 6], &[1, 1]),
            (&[2, 3, 1], &[2, 3, 9]),
        ];
        for op in ["add", "subtract", "multiply"] {
            for (sa, sb) in pairs {
                for (sa, sb) in [(sa, sb), (sb, sa)] {
                    let args = [
                        OpValue::Tensor(rand(sa, &mut rng)),
                        OpValue::Tensor(rand(sb, &mut rng)),
                    ];
                    let a = attrs(&[]);
                    let y = reference_eval(op, &args, &a);
                    let shape = y
                        .as_tensor()
                        .map(|t| t.shape().to_vec())
                        .unwrap_or_default();
                    let dy = OpValue::Tensor(rand(&shape, &mut rng));
                    let got = vjp(op, &args, &a, &y, &dy)
                        .unwrap_or_else(|| panic!("{op} {sa:?} {sb:?}: no fast vjp"));
                    let want = tumble_ops::vjp::vjp(def(op), &args, &a, &y, &dy)
                        .unwrap_or_else(|e| panic!("{e:?}"));
                    for k in 0..2 {
                        let (g, r) = (
                            got[k].as_ref().expect("grad"),
                            want[k].as_ref().expect("grad"),
                        );
                        let gs = g.as_tensor().map(|t| t.shape().to_vec());
                        assert_eq!(gs, r.as_tensor().map(|t| t.shape().to_vec()), "{op} {k}");
                        assert!(
                            rel_diff(&f32s(g), &f32s(r)) < 1e-5,
                            "{op} {sa:?} {sb:?} operand {k}"
                        );
                    }
                }
            }
        }
    }

    /// A loss's per-row `take(log_probs, %label)` (batch_dims=1) and the `reshape` before it:
    /// values and gradients equal the reference's; an index out of range is left to the
    /// reference (whose modes clip, wrap or fail).
    /// A transpose's gradient permuted back, for permutations of ranks 2 and 3.
    #[test]
    fn transpose_gradients_agree_with_the_reference() {
        let mut rng = Rng::new(11);
        for (shape, axes) in [
            (vec![3, 5], None),
            (vec![1, 7], Some(vec![1, 0])),
            (vec![2, 3, 4], Some(vec![2, 0, 1])),
            (vec![2, 3, 4], Some(vec![0, -1, 1])),
        ] {
            let a = match &axes {
                None => attrs(&[]),
                Some(v) => attrs(&[(
                    "axes",
                    AttrValue::List(v.iter().map(|&i| AttrValue::Int(i)).collect()),
                )]),
            };
            let x = OpValue::Tensor(rand(&shape, &mut rng));
            let y = reference_eval("transpose", std::slice::from_ref(&x), &a);
            let dy = OpValue::Tensor(rand(y.as_tensor().expect("y").shape(), &mut rng));
            let got = vjp("transpose", std::slice::from_ref(&x), &a, &y, &dy).expect("fast vjp");
            let want =
                tumble_ops::vjp::vjp(def("transpose"), std::slice::from_ref(&x), &a, &y, &dy)
                    .unwrap_or_else(|e| panic!("{e:?}"));
            let (g, r) = (got[0].as_ref().expect("dx"), want[0].as_ref().expect("dx"));
            assert_eq!(
                g.as_tensor().map(Tensor::shape),
                r.as_tensor().map(Tensor::shape)
            );
            assert_eq!(f32s(g), f32s(r), "{shape:?} {axes:?}");
        }
    }

    /// The concatenation's gradient cut back into its parts, on every axis, with an empty part.
    #[test]
    fn concatenate_gradients_agree_with_the_reference() {
        let mut rng = Rng::new(9);
        for (shapes, axis) in [
            (vec![vec![1, 3], vec![1, 5], vec![1, 1]], 1i64),
            (vec![vec![2, 3, 4], vec![2, 1, 4]], 1),
            (vec![vec![2, 3, 4], vec![2, 3, 2]], -1),
            (vec![vec![3, 2], vec![1, 2], vec![4, 2]], 0),
            (vec![vec![0, 2], vec![2, 2]], 0),
        ] {
            let parts: Vec<Tensor> = shapes.iter().map(|s| rand(s, &mut rng)).collect();
            let args = [OpValue::Tuple(parts)];
            let a = attrs(&[("axis", AttrValue::Int(axis))]);
            let y = reference_eval("concatenate", &args, &a);
            let dy = OpValue::Tensor(rand(y.as_tensor().expect("y").shape(), &mut rng));
            let got = vjp("concatenate", &args, &a, &y, &dy).expect("fast vjp");
            let want = tumble_ops::vjp::vjp(def("concatenate"), &args, &a, &y, &dy)
                .unwrap_or_else(|e| panic!("{e:?}"));
            let (Some(OpValue::Tuple(g)), Some(OpValue::Tuple(r))) = (&got[0], &want[0]) else {
                panic!("{shapes:?}: tuple gradients expected")
            };
            assert_eq!(g.len(), r.len());
            for (g, r) in g.iter().zip(r) {
                assert_eq!(g.shape(), r.shape(), "{shapes:?} axis {axis}");
                assert_eq!(g.as_f32(), r.as_f32(), "{shapes:?} axis {axis}");
            }
        }
    }

    #[test]
    fn per_row_take_and_reshape_agree_with_the_reference() {
        let mut rng = Rng::new(5);
        let x = OpValue::Tensor(rand(&[9, 5], &mut rng));
        let ids: Vec<i32> = (0..9).map(|i| i * 3 % 5).collect();
        let idx = OpValue::Tensor(Tensor::from_i32([9], ids).unwrap_or_else(|e| panic!("{e}")));
        let a = attrs(&[
            ("axis", AttrValue::Int(1)),
            ("batch_dims", AttrValue::Int(1)),
        ]);
        let args = [x.clone(), idx];
        let y = eval("take", &args, &a, 1).expect("fast take");
        let want = reference_eval("take", &args, &a);
        assert_eq!(f32s(&y), f32s(&want));
        let dy = OpValue::Tensor(rand(&[9], &mut rng));
        let got = vjp("take", &args, &a, &y, &dy).expect("fast vjp");
        let want = tumble_ops::vjp::vjp(def("take"), &args, &a, &y, &dy)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            f32s(got[0].as_ref().expect("dx")),
            f32s(want[0].as_ref().expect("dx"))
        );
        assert!(got[1].is_none());

        let far =
            OpValue::Tensor(Tensor::from_i32([9], vec![7; 9]).unwrap_or_else(|e| panic!("{e}")));
        assert!(eval("take", &[x.clone(), far], &a, 1).is_none());

        let r = attrs(&[("newshape", AttrValue::List(vec![AttrValue::Int(45)]))]);
        let flat = eval("reshape", std::slice::from_ref(&x), &r, 1).expect("fast reshape");
        assert_eq!(f32s(&flat), f32s(&x));
        let dflat = OpValue::Tensor(rand(&[45], &mut rng));
        let back = vjp("reshape", std::slice::from_ref(&x), &r, &flat, &dflat).expect("vjp");
        let back = back[0].as_ref().expect("dx").as_tensor().expect("tensor");
        assert_eq!(back.shape(), &[9, 5]);
        // Relay's special dimensions go to the reference.
        let infer = attrs(&[("newshape", AttrValue::List(vec![AttrValue::Int(-1)]))]);
        assert!(eval("reshape", std::slice::from_ref(&x), &infer, 1).is_none());
    }
}
