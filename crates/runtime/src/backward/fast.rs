//! f32 fast paths of the batched backward: the operators a backward launch recomputes, and the
//! vector-Jacobian products of the elementwise and layout operators, on contiguous f32 tensors
//! with the runtime's SIMD loops — instead of the operator table's reference rules, which work in
//! f64 through generic broadcasting and cost TreeLSTM's training most of its backward (its
//! `sigmoid`, `tanh`, `bias_add`, `split`, `multiply` and `take`). Each returns `None` where it
//! does not apply (another dtype, a broadcast it does not handle, an index out of range), and the
//! caller falls back to the reference rule, which also reports any error. The results equal the
//! reference rules' to f32 rounding (the SIMD `sigmoid`/`tanh` are the row programs' own); the
//! switch `GradOptions::fast` turns these paths off.

use tumble_ir::Attrs;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

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

fn unary(x: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    simd::unary(&mut out, x, f);
    out
}

fn binary(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    simd::binary(&mut out, x, y, f);
    out
}

/// The axis `a` (negative from the end) of a rank-`r` tensor.
fn axis_of(a: i64, r: usize) -> Option<usize> {
    usize::try_from(if a < 0 { a + r as i64 } else { a })
        .ok()
        .filter(|&a| a < r)
}

/// The sizes of `split`'s pieces along an axis of extent `d`.
fn split_sizes(attrs: &Attrs, d: usize) -> Option<Vec<usize>> {
    if let Ok(Some(k)) = attrs.int("indices_or_sections") {
        let k = usize::try_from(k).ok().filter(|&k| k > 0 && d % k == 0)?;
        return Some(vec![d / k; k]);
    }
    let cuts = attrs.ints("indices_or_sections").ok()??;
    let mut sizes = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0usize;
    for c in cuts {
        let c = usize::try_from(c).ok().filter(|&c| c >= at && c <= d)?;
        sizes.push(c - at);
        at = c;
    }
    sizes.push(d - at);
    Some(sizes)
}

/// `(outer, extent, inner)` of `shape` around `axis`.
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape.get(..axis).unwrap_or_default().iter().product();
    let inner = shape.get(axis + 1..).unwrap_or_default().iter().product();
    (outer, shape.get(axis).copied().unwrap_or(0), inner)
}

/// `nn.bias_add`'s bias runs along the last axis (the only form handled here).
fn bias_on_last_axis(x: &Tensor, b: &Tensor, attrs: &Attrs) -> bool {
    let r = x.rank();
    let axis = attrs.int("axis").ok().flatten().unwrap_or(1);
    r >= 1 && axis_of(axis, r) == Some(r - 1) && b.rank() == 1 && x.shape().last() == Some(&b.len())
}

/// Forward operator `op` for the backward's recompute.
pub(super) fn eval(op: &str, args: &[OpValue], attrs: &Attrs) -> Option<OpValue> {
    match op {
        "sigmoid" | "tanh" | "exp" | "negative" | "nn.relu" => {
            let (t, x) = f32_of(args.first()?)?;
            let out = match op {
                "sigmoid" => unary(x, fastmath::sigmoid),
                "tanh" => unary(x, fastmath::tanh),
                "exp" => unary(x, fastmath::exp),
                "negative" => unary(x, |v| -v),
                _ => unary(x, |v| v.max(0.0)),
            };
            tensor(t.shape(), out)
        }
        "nn.bias_add" => {
            let ((t, x), (bt, b)) = (f32_of(args.first()?)?, f32_of(args.get(1)?)?);
            if !bias_on_last_axis(t, bt, attrs) || b.is_empty() {
                return None;
            }
            let mut out = vec![0f32; x.len()];
            for (o, row) in out.chunks_exact_mut(b.len()).zip(x.chunks_exact(b.len())) {
                simd::binary(o, row, b, |p, q| p + q);
            }
            tensor(t.shape(), out)
        }
        "split" => {
            let (t, x) = f32_of(args.first()?)?;
            let axis = axis_of(attrs.int("axis").ok().flatten().unwrap_or(0), t.rank())?;
            let (outer, d, inner) = around(t.shape(), axis);
            let sizes = split_sizes(attrs, d)?;
            let mut pieces = Vec::with_capacity(sizes.len());
            let mut begin = 0;
            for len in sizes {
                let mut data = Vec::with_capacity(outer * len * inner);
                for o in 0..outer {
                    let base = (o * d + begin) * inner;
                    data.extend_from_slice(x.get(base..base + len * inner)?);
                }
                let mut shape = t.shape().to_vec();
                shape[axis] = len;
                pieces.push(Tensor::from_vec(shape, data).ok()?);
                begin += len;
            }
            Some(OpValue::Tuple(pieces))
        }
        "take" => {
            // An embedding lookup: rows of an f32 table by in-range integer ids, axis 0.
            let (t, table) = f32_of(args.first()?)?;
            let idx = args.get(1)?.as_tensor()?;
            if attrs.int("axis").ok().flatten() != Some(0) || t.rank() != 2 || !idx.dtype().is_int()
            {
                return None;
            }
            let (n, d) = (t.shape()[0], t.shape()[1]);
            let ids = idx.to_i64_vec();
            let mut data = Vec::with_capacity(ids.len() * d);
            for i in ids {
                let i = usize::try_from(i).ok().filter(|&i| i < n)?;
                data.extend_from_slice(table.get(i * d..(i + 1) * d)?);
            }
            let mut shape = idx.shape().to_vec();
            shape.push(d);
            tensor(&shape, data)
        }
        _ => crate::fastops::try_eval(op, args, attrs),
    }
}

/// `g` (of shape `full`) summed down to `to`, when `to` is `full`'s trailing axes (with leading
/// ones): a bias's gradient, rows added in order.
fn sum_to(g: &[f32], full: &[usize], to: &Tensor) -> Option<Tensor> {
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

/// `v` repeated to `len` elements when it is `full`'s trailing axes (a broadcast operand).
fn broadcast_to(v: &[f32], t: &Tensor, full: &[usize], len: usize) -> Option<Vec<f32>> {
    if t.shape() == full {
        return Some(v.to_vec());
    }
    let lead = t.shape().iter().take_while(|&&d| d == 1).count();
    if !full.ends_with(&t.shape()[lead..]) || v.is_empty() || len % v.len() != 0 {
        return None;
    }
    Some(v.iter().copied().cycle().take(len).collect())
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
            let (_, g) = f32_of(dy)?;
            let full = ty.shape();
            if g.len() != ty.len() {
                return None;
            }
            let (ga, gb) = match op {
                "add" => (g.to_vec(), g.to_vec()),
                "subtract" => (g.to_vec(), unary(g, |v| -v)),
                _ => {
                    let (af, bf) = (
                        broadcast_to(a, ta, full, g.len())?,
                        broadcast_to(b, tb, full, g.len())?,
                    );
                    (binary(g, &bf, |p, q| p * q), binary(g, &af, |p, q| p * q))
                }
            };
            Some(vec![t(sum_to(&ga, full, ta)?), t(sum_to(&gb, full, tb)?)])
        }
        "nn.bias_add" => {
            let ((tx, _), (tb, _)) = (f32_of(args.first()?)?, f32_of(args.get(1)?)?);
            let (tg, g) = f32_of(dy)?;
            if !bias_on_last_axis(tx, tb, attrs) || tg.shape() != tx.shape() {
                return None;
            }
            Some(vec![t(tg.clone()), t(sum_to(g, tg.shape(), tb)?)])
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
            let (outer, d, inner) = around(tx.shape(), axis);
            let pieces: Vec<&[f32]> = gs.iter().map(Tensor::as_f32).collect::<Option<_>>()?;
            let lens: Vec<usize> = gs
                .iter()
                .map(|g| g.shape().get(axis).copied())
                .collect::<Option<_>>()?;
            if lens.iter().sum::<usize>() != d {
                return None;
            }
            let mut dx = Vec::with_capacity(tx.len());
            for o in 0..outer {
                for (p, len) in pieces.iter().zip(&lens) {
                    dx.extend_from_slice(p.get(o * len * inner..(o + 1) * len * inner)?);
                }
            }
            Some(vec![t(Tensor::from_vec(tx.shape().to_vec(), dx).ok()?)])
        }
        _ => None,
    }
}

/// Adds the gradient `dy` of `take(table, idx, axis=0)` (an f32 table of rank 2, in-range
/// integer ids, batched or shared) into `slot`, the table's gradient, row by row — allocating
/// it (zeros) on first use. Returns false, having changed nothing, where this does not apply.
pub(super) fn scatter_rows_into(
    slot: &mut Option<Tensor>,
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
    let ids = ids.to_i64_vec();
    if gv.len() != ids.len() * d
        || ids
            .iter()
            .any(|&i| usize::try_from(i).map_or(true, |i| i >= n))
    {
        return false;
    }
    if slot
        .as_ref()
        .is_some_and(|t| t.shape() != table.shape() || t.as_f32().is_none())
    {
        return false;
    }
    if slot.is_none() {
        match Tensor::from_vec(vec![n, d], vec![0f32; n * d]) {
            Ok(zeros) => *slot = Some(zeros),
            Err(_) => return false,
        }
    }
    let Some(rows) = slot.as_mut().and_then(|t| t.make_mut_slice::<f32>()) else {
        return false;
    };
    for (&i, gr) in ids.iter().zip(gv.chunks_exact(d)) {
        let at = i as usize * d;
        if let Some(dst) = rows.get_mut(at..at + d) {
            for (a, v) in dst.iter_mut().zip(gr) {
                *a += v;
            }
        }
    }
    true
}
