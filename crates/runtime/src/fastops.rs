//! Fast f32 paths for layout, batched-matrix and broadcasting arithmetic operators inside launches
//! (transpose, concatenate, split, take of rows, batch_matmul, add/subtract/multiply/divide and
//! bias_add along the last axis), used by the batching rules
//! instead of the generic reference kernels when the operands are f32. Results are identical in
//! layout; sums are f32 in a fixed order; the arithmetic is bit-identical to the reference's (which
//! computes in f64 and rounds: for one +, -, * or / of two f32 values that double rounding is
//! innocuous, since f64 has more than 2·24 + 2 significand bits).

use crate::simd;
use tumble_compile::ragged::RowReduce;
use tumble_ir::Attrs;
use tumble_ops::OpValue;
use tumble_tensor::pool::zeroed_f32;
use tumble_tensor::Tensor;

/// Runs `op` on f32 operands through a fast path if there is one (`None`: use the reference
/// kernel), on at most `threads` threads (the launch's budget).
pub fn try_eval(op: &str, args: &[OpValue], attrs: &Attrs, threads: usize) -> Option<OpValue> {
    match op {
        "transpose" => {
            let t = args.first()?.as_tensor()?;
            permute_f32(t, &transpose_axes(attrs, t.rank())?).map(OpValue::Tensor)
        }
        "concatenate" => {
            let OpValue::Tuple(parts) = args.first()? else {
                return None;
            };
            let r = parts.first()?.rank() as i64;
            let axis = attrs.int("axis").ok()?.unwrap_or(0);
            let axis = usize::try_from(if axis < 0 { axis + r } else { axis }).ok()?;
            concat_f32(parts, axis).map(OpValue::Tensor)
        }
        "nn.batch_matmul" => {
            let (x, y) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            let ta = attrs.bool("transpose_a").ok()?.unwrap_or(false);
            let tb = attrs.bool("transpose_b").ok()?.unwrap_or(true);
            // The f32 kernel computes and returns f32: another `out_dtype` is the reference's.
            let out_f32 = matches!(
                attrs.str("out_dtype").ok()?,
                None | Some("") | Some("float32")
            );
            if ta || !out_f32 {
                return None;
            }
            bmm_f32(x, y, tb, threads).map(OpValue::Tensor)
        }
        // Outside a planned GEMM stage (e.g. computed once for a launch whose operands are all
        // shared): the f32 kernels, as planned stages use, instead of the f64 reference loops.
        "nn.dense" if attrs.0.is_empty() => {
            let (x, w) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            dense_f32(x, w, None).map(OpValue::Tensor)
        }
        "split" => {
            let t = args.first()?.as_tensor()?;
            let axis = axis_of(attrs.int("axis").ok()?.unwrap_or(0), t.rank())?;
            let sizes = split_sizes(attrs, *t.shape().get(axis)?)?;
            split_f32(t, axis, &sizes).map(OpValue::Tuple)
        }
        "take" if tumble_ops::takes_rows(attrs) => {
            let (table, ids) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            take_rows_f32(table, ids).map(OpValue::Tensor)
        }
        // A bias along the last axis is numpy broadcasting's own trailing-axis add.
        "nn.bias_add" => {
            let (x, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            let r = x.rank();
            let axis = axis_of(attrs.int("axis").ok()?.unwrap_or(1), r)?;
            if axis + 1 != r || b.rank() != 1 || x.shape().last() != Some(&b.len()) {
                return None;
            }
            binary_f32(args, |a, b| a + b)
        }
        "sum" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Sum).map(OpValue::Tensor),
        "mean" if fast_reductions() => {
            reduce_f32(args, attrs, RowReduce::Mean).map(OpValue::Tensor)
        }
        "max" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Max).map(OpValue::Tensor),
        "min" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Min).map(OpValue::Tensor),
        "variance" if fast_reductions() => variance_f32(args, attrs).map(OpValue::Tensor),
        "argmax" if fast_reductions() => arg_f32(args, attrs, true).map(OpValue::Tensor),
        "argmin" if fast_reductions() => arg_f32(args, attrs, false).map(OpValue::Tensor),
        "equal" if fast_selections() => compare_f32(args, |a, b| a == b),
        "not_equal" if fast_selections() => compare_f32(args, |a, b| a != b),
        "less" if fast_selections() => compare_f32(args, |a, b| a < b),
        "greater" if fast_selections() => compare_f32(args, |a, b| a > b),
        "less_equal" if fast_selections() => compare_f32(args, |a, b| a <= b),
        "greater_equal" if fast_selections() => compare_f32(args, |a, b| a >= b),
        "where" if fast_selections() => where_f32(args),
        // The reference's `sign` (through f64: ±0 and NaN are themselves) on f32 directly.
        "sign" if fast_selections() => {
            let t = args.first()?.as_tensor()?;
            let x = t.as_f32()?;
            let mut out = tumble_tensor::pool::scratch_f32(x.len());
            simd::unary(&mut out, x, |v| {
                if v > 0.0 {
                    1.0
                } else if v < 0.0 {
                    -1.0
                } else {
                    v
                }
            });
            Tensor::from_vec(t.shape().to_vec(), out)
                .ok()
                .map(OpValue::Tensor)
        }
        "strided_slice" if fast_selections() => {
            let t = args.first()?.as_tensor()?;
            let plan = tumble_ops::slice_plan(attrs, t.shape())?;
            slice_f32(t, &plan).map(OpValue::Tensor)
        }
        "add" => binary_f32(args, |a, b| a + b),
        "subtract" => binary_f32(args, |a, b| a - b),
        "multiply" => binary_f32(args, |a, b| a * b),
        "divide" => binary_f32(args, |a, b| a / b),
        // The row programs' own functions (fastmath: a few ulp from the f64 reference), so an
        // operator a launch runs outside a row program rounds as the fused stage does in a
        // launch of another size.
        name if attrs.0.is_empty() => row_unary(name, args),
        _ => None,
    }
}

/// Work on one f32 row in place (a product's epilogue, [`dense_f32`]).
pub(crate) type RowFn<'a> = dyn Fn(&mut [f32]) + Sync + 'a;

/// `nn.dense(x, w)` on f32 operands on the GEMM kernel (a weight `(n, k)`, `x`'s last axis `k`,
/// any leading axes), `row_epilogue` run on each output row (`n` floats) while its block is in
/// cache: the training forward's bias and activation after a product, without writing the
/// product and reading it back into another buffer ([`crate::kept`]). `None` where it does not
/// apply.
pub(crate) fn dense_f32(
    x: &Tensor,
    w: &Tensor,
    row_epilogue: Option<&RowFn<'_>>,
) -> Option<Tensor> {
    let (&k, &[n, wk]) = (x.shape().last()?, w.shape()) else {
        return None;
    };
    let data = x.as_f32()?;
    if k != wk || k == 0 || w.as_f32().is_none() {
        return None;
    }
    let rows = data.len() / k;
    // The kernel overwrites C (the training forward's products: a zero fill per launch
    // was 1.2% of a step's instructions).
    let mut c = tumble_tensor::pool::scratch_f32(rows * n);
    let a = tumble_kernels::Rows::Contiguous { data, stride: k };
    match row_epilogue {
        Some(f) => {
            let each_row = |_rows: std::ops::Range<usize>, out: &mut [f32]| {
                out.chunks_exact_mut(n).for_each(f);
            };
            crate::gemm::dense_with(&a, k, w, n, &mut c, &each_row, 1).ok()?;
        }
        None => crate::gemm::dense(&a, k, w, n, &mut c, 1).ok()?,
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut()? = n;
    Tensor::from_vec(shape, c).ok()
}

/// `TUMBLE_NO_FAST_REDUCTIONS=1`: `sum` and `mean` by the reference kernel (the A/B switch of
/// [`reduce_f32`]; the results are the same bits either way).
fn fast_reductions() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_REDUCTIONS")
}

/// `TUMBLE_NO_FAST_SELECTIONS=1`: comparisons, `where`, `sign` and `strided_slice` by the
/// reference kernels (the A/B switch of [`compare_f32`], [`where_f32`], the `sign` loop and
/// [`slice_f32`]; the same results either way).
fn fast_selections() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_SELECTIONS")
}

/// One step of a fold over an axis as the reference takes it, in f64: a sum adds; a maximum or
/// minimum is NaN if either is (the reference's `nan_max`).
fn fold_step(fold: RowReduce, a: f64, x: f64) -> f64 {
    match fold {
        RowReduce::Sum | RowReduce::Mean => a + x,
        _ if a.is_nan() || x.is_nan() => f64::NAN,
        RowReduce::Max => a.max(x),
        RowReduce::Min => a.min(x),
    }
}

/// `sum`, `mean`, `max` or `min` of an f32 tensor over one axis as the reference computes it —
/// each output element folded in f64 over the reduced axis in index order (a sum from 0.0, an
/// extreme from the first element), then rounded — without moving the axis last first: the
/// reference's generic permute and f64 copy of the whole tensor made a batched attention written
/// as `sum(multiply(%q, %M), axis=[1])` 16 ns an element, and a CRF's log-sum-exp over the
/// previous tags' axis 12. The reduced rows are folded into a row of f64 accumulators, so every
/// element sees the same steps in the same order: the reference's bits.
/// The one axis a reduction's `attrs` reduce an f32 tensor of `shape` over, if that is what they
/// say (`axis=[a]`, no `exclude`) and it is not empty: the axis, its extent, and the extents of
/// the axes before and after it; with the result's shape (`keepdims` keeping the axis as 1).
fn one_axis(shape: &[usize], attrs: &Attrs) -> Option<(usize, usize, usize, usize, Vec<usize>)> {
    if attrs.bool("exclude").ok()?.unwrap_or(false) {
        return None;
    }
    let axis = match attrs.ints("axis").ok()?.as_deref() {
        Some(&[a]) => axis_of(a, shape.len())?,
        _ => return None,
    };
    let n = *shape.get(axis)?;
    let outer: usize = shape.get(..axis)?.iter().product();
    let inner: usize = shape.get(axis + 1..)?.iter().product();
    let mut out_shape = shape.to_vec();
    match attrs.bool("keepdims").ok()?.unwrap_or(false) {
        true => *out_shape.get_mut(axis)? = 1,
        false => {
            out_shape.remove(axis);
        }
    }
    (n > 0).then_some((axis, n, outer, inner, out_shape))
}

fn reduce_f32(args: &[OpValue], attrs: &Attrs, fold: RowReduce) -> Option<Tensor> {
    let t = args.first()?.as_tensor()?;
    let data = t.as_f32()?;
    let (_, n, outer, inner, out_shape) = one_axis(t.shape(), attrs)?;
    let round = |a: f64| match fold {
        RowReduce::Mean => (a / n as f64) as f32,
        _ => a as f32,
    };
    let sums = matches!(fold, RowReduce::Sum | RowReduce::Mean);
    let mut out = Vec::with_capacity(outer * inner);
    if inner == 1 {
        // Over the last axis: one chain per row.
        out.extend(data.chunks_exact(n).take(outer).map(|row| {
            let extreme = match fold {
                RowReduce::Max => row_extreme(row, true),
                RowReduce::Min => row_extreme(row, false),
                RowReduce::Sum | RowReduce::Mean => None,
            };
            if let Some(e) = extreme {
                return e;
            }
            let (start, rest) = match sums {
                true => (0.0, row),
                false => (
                    f64::from(*row.first().unwrap_or(&0.0)),
                    row.get(1..).unwrap_or(&[]),
                ),
            };
            round(
                rest.iter()
                    .fold(start, |a, &x| fold_step(fold, a, f64::from(x))),
            )
        }));
    } else {
        let mut acc = Vec::new();
        for block in data.chunks_exact(n * inner.max(1)).take(outer) {
            fold_columns(
                fold,
                block.chunks_exact(inner.max(1)),
                n,
                &mut acc,
                &mut out,
            )?;
        }
    }
    Tensor::from_f32(out_shape, out).ok()
}

/// The `n` rows of `rows` folded column by column as the reference folds an axis — in f64, in
/// index order, a sum from 0.0 and an extreme from the first row — each column's result rounded
/// to f32 onto `out` (`acc`: scratch). `None` without rows.
pub(crate) fn fold_columns<'a>(
    fold: RowReduce,
    mut rows: impl Iterator<Item = &'a [f32]>,
    n: usize,
    acc: &mut Vec<f64>,
    out: &mut Vec<f32>,
) -> Option<()> {
    let first = rows.next()?;
    acc.clear();
    match fold {
        RowReduce::Sum | RowReduce::Mean => {
            acc.resize(first.len(), 0.0);
            fold_rows(acc, std::iter::once(first), |a, x| {
                fold_step(RowReduce::Sum, a, x)
            });
        }
        RowReduce::Max | RowReduce::Min => acc.extend(first.iter().map(|&x| f64::from(x))),
    }
    // One loop per fold, the choice made outside it (so it vectorizes).
    match fold {
        RowReduce::Sum | RowReduce::Mean => {
            fold_rows(acc, rows, |a, x| fold_step(RowReduce::Sum, a, x))
        }
        RowReduce::Max => fold_rows(acc, rows, |a, x| fold_step(RowReduce::Max, a, x)),
        RowReduce::Min => fold_rows(acc, rows, |a, x| fold_step(RowReduce::Min, a, x)),
    }
    out.extend(acc.iter().map(|&a| match fold {
        RowReduce::Mean => (a / n as f64) as f32,
        _ => a as f32,
    }));
    Some(())
}

/// `variance(x, m)` over one axis of an f32 tensor with its keepdims mean (each reduced row's
/// own, the shape `x`'s with the axis 1): the squares of `x - m` summed in f64 in the axis'
/// order and divided once, as the reference does after its permute and f64 copy of both
/// operands (a layer norm written by hand: 25 ns an element there).
fn variance_f32(args: &[OpValue], attrs: &Attrs) -> Option<Tensor> {
    let (t, m) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
    let (x, mean) = (t.as_f32()?, m.as_f32()?);
    let (axis, n, outer, inner, out_shape) = one_axis(t.shape(), attrs)?;
    let per_row = m.rank() == t.rank()
        && m.shape()
            .iter()
            .zip(t.shape())
            .enumerate()
            .all(|(i, (&a, &b))| match i == axis {
                true => a == 1,
                false => a == b,
            });
    if !per_row {
        return None;
    }
    let unbiased = attrs.bool("unbiased").ok()?.unwrap_or(false);
    let reduced: Vec<bool> = (0..t.rank()).map(|i| i == axis).collect();
    let count = tumble_ops::variance_divisor(t.shape(), &reduced, unbiased);
    let inner = inner.max(1);
    let mut out = Vec::with_capacity(outer * inner);
    for (o, block) in x.chunks_exact(n * inner).take(outer).enumerate() {
        let mus = mean.get(o * inner..(o + 1) * inner)?;
        for (j, &mu) in mus.iter().enumerate() {
            let mu = f64::from(mu);
            let sq: f64 = block
                .iter()
                .skip(j)
                .step_by(inner)
                .map(|&v| (f64::from(v) - mu) * (f64::from(v) - mu))
                .sum();
            out.push((sq / count) as f32);
        }
    }
    Tensor::from_f32(out_shape, out).ok()
}

/// The largest (`high`) or smallest element of a row as the reference's fold in f64 finds it,
/// by eight independent lanes: NaN if any element is NaN; `None` for an empty row or a zero
/// extreme (whose sign the fold's order decides: the caller folds in order).
fn row_extreme(row: &[f32], high: bool) -> Option<f32> {
    let first = *row.first()?;
    let mut lanes = [first; 8];
    let mut nan = false;
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            let better = if high { x > *l } else { x < *l };
            *l = if better { x } else { *l };
            nan |= x.is_nan();
        }
    }
    let mut e = first;
    for &x in lanes.iter().chain(chunks.remainder()) {
        nan |= x.is_nan();
        let better = if high { x > e } else { x < e };
        e = if better { x } else { e };
    }
    match () {
        _ if nan => Some(f32::NAN),
        _ if e == 0.0 => None,
        _ => Some(e),
    }
}

/// Every row folded into the accumulators, element by element.
#[inline(always)]
fn fold_rows<'a>(
    acc: &mut [f64],
    rows: impl Iterator<Item = &'a [f32]>,
    step: impl Fn(f64, f64) -> f64,
) {
    for row in rows {
        acc.iter_mut()
            .zip(row)
            .for_each(|(a, &x)| *a = step(*a, f64::from(x)));
    }
}

/// `argmax` (`high`) or `argmin` of an f32 tensor over one axis as the reference computes it:
/// int32 positions, ties to the first (the last with `select_last_index`), NaN taken as the
/// best, the first one (numpy's). A beam search's repeated argmax over 4,000 scores was
/// 5 ns an element through the reference's permute and f64 copy.
fn arg_f32(args: &[OpValue], attrs: &Attrs, high: bool) -> Option<Tensor> {
    let t = args.first()?.as_tensor()?;
    let data = t.as_f32()?;
    let last = attrs.bool("select_last_index").ok()?.unwrap_or(false);
    let (_, n, outer, inner, out_shape) = one_axis(t.shape(), attrs)?;
    if n > i32::MAX as usize {
        return None;
    }
    let inner = inner.max(1);
    let mut out: Vec<i32> = Vec::with_capacity(outer * inner);
    if inner == 1 {
        for row in data.chunks_exact(n).take(outer) {
            // The extreme first, then where it is (two passes the compiler vectorizes, where
            // the walk is a chain of branches): the first element equal to it (the last with
            // `last`), ±0 equal as they are to the walk; a row holding NaN is walked.
            let at = match row_extreme(row, high) {
                Some(e) if !e.is_nan() => match last {
                    false => row.iter().position(|&x| x == e),
                    true => row.iter().rposition(|&x| x == e),
                },
                _ => None,
            };
            let at = at.unwrap_or_else(|| best_index(row, 1, high, last));
            out.push(i32::try_from(at).ok()?);
        }
        return Tensor::from_vec(out_shape, out).ok();
    }
    // Over an inner axis: the rows in order, each column's best so far updated by the same rule
    // as `best_index` walks a column with (a column at a time strided through the whole block:
    // a Viterbi step's argmax over a (128, 128) score matrix was 4 ns an element).
    let mut best = vec![0f32; inner];
    let mut at = vec![0i32; inner];
    for block in data.chunks_exact(n * inner).take(outer) {
        let mut rows = block.chunks_exact(inner);
        best.copy_from_slice(rows.next()?);
        at.iter_mut().for_each(|a| *a = 0);
        for (r, row) in rows.enumerate() {
            let r = i32::try_from(r + 1).ok()?;
            // `beats` without branches (selects the compiler vectorizes), one loop per rule.
            match (high, last) {
                (true, false) => update_best(&mut best, &mut at, row, r, |x, b| {
                    (x > b) | (x.is_nan() & !b.is_nan())
                }),
                (false, false) => update_best(&mut best, &mut at, row, r, |x, b| {
                    (x < b) | (x.is_nan() & !b.is_nan())
                }),
                (true, true) => update_best(&mut best, &mut at, row, r, |x, b| {
                    x.is_nan() | (!b.is_nan() & (x >= b))
                }),
                (false, true) => update_best(&mut best, &mut at, row, r, |x, b| {
                    x.is_nan() | (!b.is_nan() & (x <= b))
                }),
            }
        }
        out.extend_from_slice(&at);
    }
    Tensor::from_vec(out_shape, out).ok()
}

/// Each column's best so far and its row, updated by row `r` where `better(x, best)`.
#[inline(always)]
fn update_best(
    best: &mut [f32],
    at: &mut [i32],
    row: &[f32],
    r: i32,
    better: impl Fn(f32, f32) -> bool,
) {
    for ((b, a), &x) in best.iter_mut().zip(at.iter_mut()).zip(row) {
        let m = better(x, *b);
        *b = if m { x } else { *b };
        *a = if m { r } else { *a };
    }
}

/// Does `x` replace `b` as the best so far of an `argmax` (`high`) or `argmin`, as the
/// reference picks: NaN beats any number, an equal one only with `last`.
#[inline]
fn beats(x: f32, b: f32, high: bool, last: bool) -> bool {
    match (x.is_nan(), b.is_nan()) {
        (true, true) => last,
        (true, false) => true,
        (false, true) => false,
        _ if x == b => last,
        _ => (x > b) == high,
    }
}

/// The position (counted in elements `step` apart, from `values[0]`) of the largest element of
/// `values[0], values[step], ..` (`high`) or the smallest, as the reference's `argmax`/`argmin`
/// picks it: NaN beats any number, the first of equals wins (the last with `last`).
pub(crate) fn best_index(values: &[f32], step: usize, high: bool, last: bool) -> usize {
    let mut best = (0usize, f32::NAN);
    for (i, &x) in values.iter().step_by(step.max(1)).enumerate() {
        if i == 0 || beats(x, best.1, high, last) {
            best = (i, x);
        }
    }
    best.0
}

/// The axis `a` (negative from the end) of a rank-`r` tensor.
pub(crate) fn axis_of(a: i64, r: usize) -> Option<usize> {
    usize::try_from(if a < 0 { a + r as i64 } else { a })
        .ok()
        .filter(|&a| a < r)
}

/// The sizes of `split`'s pieces along an axis of extent `d` (`indices_or_sections`: a count of
/// equal pieces, or the cut points).
pub(crate) fn split_sizes(attrs: &Attrs, d: usize) -> Option<Vec<usize>> {
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

/// `t` cut along `axis` into pieces of `sizes` (summing to the axis's extent).
pub fn split_f32(t: &Tensor, axis: usize, sizes: &[usize]) -> Option<Vec<Tensor>> {
    let x = t.as_f32()?;
    let shape = t.shape();
    let d = *shape.get(axis)?;
    if sizes.iter().sum::<usize>() != d {
        return None;
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut pieces = Vec::with_capacity(sizes.len());
    let mut begin = 0;
    for &len in sizes {
        // A recycled buffer when one fits (the training forward splits every launch's gates).
        let mut data = tumble_tensor::pool::with_capacity_f32(outer * len * inner);
        for o in 0..outer {
            let base = (o * d + begin) * inner;
            data.extend_from_slice(x.get(base..base + len * inner)?);
        }
        let mut piece = shape.to_vec();
        piece[axis] = len;
        pieces.push(Tensor::from_vec(piece, data).ok()?);
        begin += len;
    }
    Some(pieces)
}

/// Rows of an f32 table (axis 0) by integer ids, out-of-range ids clipped to the first or last
/// row (`take`'s default mode): shape `ids.shape + table.shape[1..]`.
pub fn take_rows_f32(table: &Tensor, ids: &Tensor) -> Option<Tensor> {
    let data = table.as_f32()?;
    let (&rows, row_shape) = table.shape().split_first()?;
    if rows == 0 || !ids.dtype().is_int() {
        return None;
    }
    let width: usize = row_shape.iter().product();
    let idx = ids.to_i64_vec();
    let mut out = tumble_tensor::pool::with_capacity_f32(idx.len() * width);
    for &j in &idx {
        let j = j.clamp(0, rows as i64 - 1) as usize;
        out.extend_from_slice(data.get(j * width..(j + 1) * width)?);
    }
    let mut shape = ids.shape().to_vec();
    shape.extend_from_slice(row_shape);
    Tensor::from_vec(shape, out).ok()
}

/// `f(a, b)` elementwise over two f32 tensors broadcast numpy-style (`None` for other dtypes or
/// shapes that do not broadcast: the reference kernel then reports the error). The innermost
/// output axis runs as a loop over two slices, or a slice and a broadcast scalar, so batched rows
/// against a shared vector (a launch's `(B, 1) * (64)`) vectorize.
/// Row-program unary operator `name` of the one f32 operand ([`crate::fused::unary_f32`]).
fn row_unary(name: &str, args: &[OpValue]) -> Option<OpValue> {
    // `copy`'s reference shares the buffer, which a copied-out loop would not.
    let ([OpValue::Tensor(t)], false) = (args, name == "copy") else {
        return None;
    };
    let x = t.as_f32()?;
    let mut out = tumble_tensor::pool::scratch_f32(x.len());
    if !crate::fused::unary_f32(name, x, &mut out) {
        return None;
    }
    Tensor::from_vec(t.shape().to_vec(), out)
        .ok()
        .map(OpValue::Tensor)
}

/// `strided_slice` of an f32 tensor by its plan (per axis `(start, step, len)`,
/// [`tumble_ops::slice_plan`]): runs of the last axis copied as slices where its step is 1, and
/// axes copied whole below the last one sliced. The reference builds an index per element (a
/// text CNN's shifted windows of a sentence's rows: 15–35 ns an element).
fn slice_f32(t: &Tensor, plan: &[(i64, i64, i64)]) -> Option<Tensor> {
    let data = t.as_f32()?;
    let shape = t.shape();
    let out_shape: Vec<usize> = plan
        .iter()
        .map(|&(_, _, len)| usize::try_from(len).ok())
        .collect::<Option<_>>()?;
    let total: usize = out_shape.iter().product();
    let mut out = tumble_tensor::pool::with_capacity_f32(total);
    if total > 0 {
        // Strides of the input; the innermost run: the trailing axes taken whole with step 1,
        // and the last axis before them if its step is 1.
        let r = shape.len();
        let mut strides = vec![1usize; r];
        for a in (0..r.saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * shape[a + 1];
        }
        let whole = |a: usize| plan[a] == (0, 1, shape[a] as i64);
        let mut inner = r;
        while inner > 0 && whole(inner - 1) {
            inner -= 1;
        }
        let mut run: usize = shape[inner..].iter().product();
        let mut outer = inner;
        if inner > 0 && plan[inner - 1].1 == 1 {
            outer = inner - 1;
            run *= out_shape[outer];
        }
        // Where the run of output index `idx` (over the axes before `outer`) starts: each axis
        // at its position, the axes from `outer` on at their starts.
        let tail: i64 = (outer..r).map(|a| plan[a].0 * strides[a] as i64).sum();
        let base = |idx: &[usize]| -> Option<usize> {
            let mut at = tail;
            for (a, &i) in idx.iter().enumerate() {
                let (start, step, _) = plan[a];
                at += (start + i as i64 * step) * strides[a] as i64;
            }
            usize::try_from(at).ok()
        };
        let mut idx = vec![0usize; outer];
        loop {
            let from = base(&idx)?;
            out.extend_from_slice(data.get(from..from + run)?);
            let mut a = outer;
            loop {
                if a == 0 {
                    return Tensor::from_vec(out_shape, out).ok();
                }
                a -= 1;
                idx[a] += 1;
                if idx[a] < out_shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    }
    Tensor::from_vec(out_shape, out).ok()
}

/// Offsets of broadcast operands in their buffers, element by element of the output (numpy
/// broadcasting: an operand's axes aligned to the output's last ones, size-1 axes repeated).
pub(crate) struct Broadcast {
    pub(crate) shape: Vec<usize>,
    /// Per operand, per output axis: its step (0 along a repeated axis).
    pub(crate) strides: Vec<Vec<usize>>,
}

impl Broadcast {
    pub(crate) fn new(shapes: &[&[usize]]) -> Option<Broadcast> {
        let mut shape: Vec<usize> = Vec::new();
        for s in shapes {
            shape = tumble_tensor::broadcast_shapes(&shape, s).ok()?;
        }
        let strides = shapes
            .iter()
            .map(|s| {
                let mut out = vec![0; shape.len()];
                let mut acc = 1;
                for (i, &d) in s.iter().enumerate().rev() {
                    out[shape.len() - s.len() + i] = if d == 1 { 0 } else { acc };
                    acc *= d;
                }
                out
            })
            .collect();
        Some(Broadcast { shape, strides })
    }

    /// The length of a row along the innermost axis (1 for a scalar).
    fn inner(&self) -> usize {
        self.shape.last().copied().unwrap_or(1).max(1)
    }

    /// Operand `k`'s step along the innermost axis: 1 (its run is contiguous) or 0 (one value
    /// repeated along the row).
    fn step(&self, k: usize) -> usize {
        self.strides
            .get(k)
            .and_then(|s| s.last())
            .copied()
            .unwrap_or(1)
    }

    /// Calls `f` with each operand's offset of the first element of each row along the
    /// innermost axis, rows in order (an odometer over the axes before it); stops at the
    /// first `None`.
    fn each_row(&self, mut f: impl FnMut(&[usize]) -> Option<()>) -> Option<()> {
        let total: usize = self.shape.iter().product();
        let outer = self.shape.len().saturating_sub(1);
        let mut index = vec![0usize; outer];
        let mut at = vec![0usize; self.strides.len()];
        for _ in 0..total / self.inner() {
            f(&at)?;
            for ax in (0..outer).rev() {
                index[ax] += 1;
                for (o, s) in at.iter_mut().zip(&self.strides) {
                    *o += s[ax];
                }
                if index[ax] < self.shape[ax] {
                    break;
                }
                for (o, s) in at.iter_mut().zip(&self.strides) {
                    *o -= s[ax] * self.shape[ax];
                }
                index[ax] = 0;
            }
        }
        Some(())
    }

    /// Calls `f` with each operand's offset, output element by output element.
    fn each(&self, mut f: impl FnMut(&[usize])) {
        let inner = self.inner();
        let steps: Vec<usize> = (0..self.strides.len()).map(|k| self.step(k)).collect();
        let mut at = vec![0usize; steps.len()];
        self.each_row(|row| {
            for j in 0..inner {
                for ((o, &r), &s) in at.iter_mut().zip(row).zip(&steps) {
                    *o = r + j * s;
                }
                f(&at);
            }
            Some(())
        });
    }
}

/// A comparison of two f32 tensors broadcast numpy-style, as the reference computes it (f32
/// values compare in f64 as they do in f32; NaN compares false but for `not_equal`): ~20 ns an
/// element through the reference's f64 copies, a beam search's masks a third of its time.
fn compare_f32(args: &[OpValue], f: impl Fn(f32, f32) -> bool) -> Option<OpValue> {
    let (a, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let shape = Broadcast::new(&[a.shape(), b.shape()])?;
    let mut out: Vec<bool> = Vec::with_capacity(shape.shape.iter().product());
    let mut ok = true;
    shape.each(|at| match (x.get(at[0]), y.get(at[1])) {
        (Some(&p), Some(&q)) => out.push(f(p, q)),
        _ => ok = false,
    });
    ok.then_some(())?;
    Tensor::from_vec(shape.shape, out).ok().map(OpValue::Tensor)
}

/// `where(c, x, y)` of a bool condition and two f32 tensors, all three broadcast numpy-style.
fn where_f32(args: &[OpValue]) -> Option<OpValue> {
    let [c, x, y] = args else { return None };
    let (c, x, y) = (c.as_tensor()?, x.as_tensor()?, y.as_tensor()?);
    let (cv, xv, yv) = (c.as_slice::<bool>()?, x.as_f32()?, y.as_f32()?);
    let bc = Broadcast::new(&[c.shape(), x.shape(), y.shape()])?;
    let total: usize = bc.shape.iter().product();
    // Row by row along the innermost axis, each operand's run contiguous or one value repeated
    // (an element-by-element walk of the broadcast cost 10-17 ns an element: a padded decoder's
    // masks ran 2.9x its arithmetic select).
    let mut out = tumble_tensor::pool::scratch_f32(total);
    let inner = bc.inner();
    let (ic, ix, iy) = (bc.step(0), bc.step(1), bc.step(2));
    let len = |i: usize| if i == 0 { 1 } else { inner };
    let mut rows = out.chunks_exact_mut(inner);
    bc.each_row(|at| {
        let dst = rows.next()?;
        let (cs, xs, ys) = (
            cv.get(at[0]..at[0] + len(ic))?,
            xv.get(at[1]..at[1] + len(ix))?,
            yv.get(at[2]..at[2] + len(iy))?,
        );
        match (ic, ix, iy) {
            (1, 1, 1) => {
                for (((d, &c), &p), &q) in dst.iter_mut().zip(cs).zip(xs).zip(ys) {
                    *d = if c { p } else { q };
                }
            }
            (0, ..) => match cs.first() {
                Some(true) if ix == 1 => dst.copy_from_slice(xs),
                Some(true) => dst.fill(*xs.first()?),
                Some(false) if iy == 1 => dst.copy_from_slice(ys),
                Some(false) => dst.fill(*ys.first()?),
                None => return None,
            },
            _ => {
                for (j, d) in dst.iter_mut().enumerate() {
                    let (c, p, q) = (cs.get(j * ic)?, xs.get(j * ix)?, ys.get(j * iy)?);
                    *d = if *c { *p } else { *q };
                }
            }
        }
        Some(())
    })?;
    Tensor::from_vec(bc.shape, out).ok().map(OpValue::Tensor)
}

fn binary_f32(args: &[OpValue], f: impl Fn(f32, f32) -> f32) -> Option<OpValue> {
    let (a, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let bc = Broadcast::new(&[a.shape(), b.shape()])?;
    let total: usize = bc.shape.iter().product();
    // Written row by row through the dispatched SIMD loops (an `extend` over a zip compiles for
    // the baseline ISA only: 2.3% of a training step in the kept forward's adds and products).
    let mut out = tumble_tensor::pool::scratch_f32(total);
    let (inner, ia, ib) = (bc.inner(), bc.step(0), bc.step(1));
    let mut rows = out.chunks_exact_mut(inner);
    bc.each_row(|at| {
        let (dst, oa, ob) = (rows.next()?, at[0], at[1]);
        match (ia, ib) {
            (1, 1) => simd::binary(dst, x.get(oa..oa + inner)?, y.get(ob..ob + inner)?, &f),
            (1, _) => {
                let q = *y.get(ob)?;
                simd::unary(dst, x.get(oa..oa + inner)?, |p| f(p, q));
            }
            (_, 1) => {
                let p = *x.get(oa)?;
                simd::unary(dst, y.get(ob..ob + inner)?, |q| f(p, q));
            }
            _ => dst.fill(f(*x.get(oa)?, *y.get(ob)?)),
        }
        Some(())
    })?;
    Tensor::from_vec(bc.shape, out).ok().map(OpValue::Tensor)
}

/// f32 tensors joined along `axis`: for every index of the axes before it, each part's contiguous
/// chunk in turn (the generic kernel goes element by element through index lists).
pub fn concat_f32(parts: &[Tensor], axis: usize) -> Option<Tensor> {
    let first = parts.first()?;
    let shape = first.shape();
    if axis >= shape.len() {
        return None;
    }
    let mut datas = Vec::with_capacity(parts.len());
    let mut along = 0;
    for p in parts {
        let s = p.shape();
        if s.len() != shape.len()
            || s[..axis] != shape[..axis]
            || s[axis + 1..] != shape[axis + 1..]
        {
            return None;
        }
        along += s[axis];
        datas.push((p.as_f32()?, s[axis..].iter().product::<usize>()));
    }
    let outer: usize = shape[..axis].iter().product();
    let total: usize = datas.iter().map(|(d, _)| d.len()).sum();
    let mut out = tumble_tensor::pool::with_capacity_f32(total);
    for o in 0..outer {
        for (d, chunk) in &datas {
            out.extend_from_slice(d.get(o * chunk..(o + 1) * chunk)?);
        }
    }
    let mut out_shape = shape.to_vec();
    out_shape[axis] = along;
    Tensor::from_f32(out_shape, out).ok()
}

/// `dst (cols × rows) = srcᵀ` for a row-major `src (rows × cols)`, in 8×8 tiles so both sides are
/// touched a cache line at a time.
pub fn transpose_2d(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const T: usize = 8;
    debug_assert!(src.len() >= rows * cols && dst.len() >= rows * cols);
    for i0 in (0..rows).step_by(T) {
        for j0 in (0..cols).step_by(T) {
            if i0 + T <= rows && j0 + T <= cols {
                // A whole tile: eight row loads, a register transpose, eight row stores.
                let mut tile = [[0f32; T]; T];
                for (r, t) in tile.iter_mut().enumerate() {
                    let at = (i0 + r) * cols + j0;
                    t.copy_from_slice(&src[at..at + T]);
                }
                let cols: [[f32; T]; T] =
                    std::array::from_fn(|c| std::array::from_fn(|r| tile[r][c]));
                for (c, col) in cols.iter().enumerate() {
                    let at = (j0 + c) * rows + i0;
                    dst[at..at + T].copy_from_slice(col);
                }
            } else {
                for i in i0..(i0 + T).min(rows) {
                    for j in j0..(j0 + T).min(cols) {
                        dst[j * rows + i] = src[i * cols + j];
                    }
                }
            }
        }
    }
}

/// `t` with its axes permuted (`out.shape[i] = t.shape[perm[i]]`).
/// The permutation `transpose(axes=..)` applies to a rank-`r` tensor (none given: reversed).
pub(crate) fn transpose_axes(attrs: &Attrs, r: usize) -> Option<Vec<usize>> {
    let r = r as i64;
    match attrs.ints("axes").ok()? {
        None => Some((0..r).rev().map(|a| a as usize).collect()),
        Some(v) if v.is_empty() => Some((0..r).rev().map(|a| a as usize).collect()),
        Some(v) => v
            .iter()
            .map(|&a| if a < 0 { a + r } else { a })
            .map(|a| usize::try_from(a).ok())
            .collect::<Option<Vec<_>>>(),
    }
}

pub fn permute_f32(t: &Tensor, perm: &[usize]) -> Option<Tensor> {
    let data = t.as_f32()?;
    let shape = t.shape();
    if perm.len() != shape.len() || perm.is_empty() {
        return None;
    }
    let mut seen = vec![false; perm.len()];
    for &p in perm {
        if *seen.get(p)? {
            return None;
        }
        seen[p] = true;
    }
    let strides = t.strides();
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let r = perm.len();
    if r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
    {
        // Matrices transposed in place of one another: tiled, not element-strided.
        let (rows, cols) = (shape[r - 2], shape[r - 1]);
        let mut out = zeroed_f32(data.len());
        if rows * cols > 0 {
            for (src, dst) in data
                .chunks_exact(rows * cols)
                .zip(out.chunks_exact_mut(rows * cols))
            {
                transpose_2d(src, rows, cols, dst);
            }
        }
        return Tensor::from_f32(out_shape, out).ok();
    }
    let in_stride: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let n = data.len();
    let mut out = tumble_tensor::pool::with_capacity_f32(n);
    if n > 0 {
        let last = out_shape.len() - 1;
        let (inner, inner_stride) = (out_shape[last], in_stride[last]);
        let outer: usize = out_shape[..last].iter().product();
        let mut idx = vec![0usize; last];
        for _ in 0..outer {
            let base: usize = idx.iter().zip(&in_stride).map(|(i, s)| i * s).sum();
            if inner_stride == 1 {
                out.extend_from_slice(&data[base..base + inner]);
            } else {
                out.extend((0..inner).map(|j| data[base + j * inner_stride]));
            }
            // Odometer over the outer output axes.
            for a in (0..last).rev() {
                idx[a] += 1;
                if idx[a] < out_shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    }
    Tensor::from_f32(out_shape, out).ok()
}

/// Batched matrix product of 3-D f32 tensors: `x (G, M, K)` times `y (G, N, K)ᵀ` (`tb`) or
/// `y (G, K, N)`; a batch dimension of 1 on either side broadcasts.
pub fn bmm_f32(x: &Tensor, y: &Tensor, tb: bool, threads: usize) -> Option<Tensor> {
    let (xd, yd) = (x.as_f32()?, y.as_f32()?);
    let ([gx, m, k], ys) = (x.shape(), y.shape()) else {
        return None;
    };
    let [gy, a, bdim] = ys else { return None };
    let (n, ky) = if tb { (*a, *bdim) } else { (*bdim, *a) };
    if ky != *k || (*gx != *gy && *gx != 1 && *gy != 1) {
        return None;
    }
    let g = (*gx).max(*gy);
    let (m, k) = (*m, *k);
    let mut out = zeroed_f32(g * m * n);
    // One product per batch element (`gemm::small_product`: the GEMM kernel for a row per
    // token against a head's keys or values, dot products for a few rows).
    crate::gemm::small_products(g, m * n, m * n * k, threads, &mut out, |gi, o| {
        let xo = if *gx == 1 { 0 } else { gi * m * k };
        let yo = if *gy == 1 { 0 } else { gi * n * k };
        let (Some(xi), Some(yi)) = (xd.get(xo..xo + m * k), yd.get(yo..yo + n * k)) else {
            return Err("internal: batch_matmul operand too short".into());
        };
        crate::gemm::small_product(xi, m, k, yi, n, tb, o)
    })
    .ok()?;
    Tensor::from_f32(vec![g, m, n], out).ok()
}

/// Also the helpers of the other fast paths' tests (`backward::fast`).
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tumble_ir::attrs::Attr;
    use tumble_ir::{AttrValue, Span};
    use tumble_ops::OpCtx;
    use tumble_tensor::Rng;

    /// An f32 tensor of `shape` with N(0, 1) values.
    pub(crate) fn rand(shape: &[usize], rng: &mut Rng) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32(
            shape.to_vec(),
            (0..n).map(|_| rng.normal_f64() as f32).collect(),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    pub(crate) fn attrs(kv: &[(&str, AttrValue)]) -> Attrs {
        Attrs(
            kv.iter()
                .map(|(k, v)| Attr {
                    name: k.to_string(),
                    value: v.clone(),
                    span: Span::default(),
                })
                .collect(),
        )
    }

    /// `op` on `args` by the operator table's reference rule.
    pub(crate) fn reference(op: &str, args: &[OpValue], a: &Attrs) -> Tensor {
        let def = tumble_ops::lookup(op).unwrap_or_else(|| panic!("no {op}"));
        let mut rng = Rng::new(0);
        let mut ctx = OpCtx { rng: &mut rng };
        match tumble_ops::eval(def, args, a, &mut ctx) {
            Ok(OpValue::Tensor(t)) => t,
            other => panic!("{other:?}"),
        }
    }

    /// `strided_slice` of f32 tensors — begin/end of every sign, strides 1, 2 and -1, listed
    /// `axes` (negative too), size mode, whole and partial inner axes, empty results — the
    /// reference's values and shape.
    #[test]
    fn slices_are_the_references() {
        let mut rng = Rng::new(3);
        let ints = |v: &[i64]| AttrValue::List(v.iter().map(|&x| AttrValue::Int(x)).collect());
        type Case<'a> = (&'a [usize], Vec<(&'a str, AttrValue)>);
        let cases: Vec<Case> = vec![
            (
                &[7, 3],
                vec![
                    ("begin", ints(&[1])),
                    ("end", ints(&[i64::from(i32::MAX)])),
                    ("axes", ints(&[0])),
                ],
            ),
            (
                &[7, 3],
                vec![("begin", ints(&[1, 0])), ("end", ints(&[6, 3]))],
            ),
            (
                &[7, 3],
                vec![("begin", ints(&[0, 1])), ("end", ints(&[-1, 3]))],
            ),
            (
                &[7, 4],
                vec![
                    ("begin", ints(&[0, 0])),
                    ("end", ints(&[7, 4])),
                    ("strides", ints(&[2, 1])),
                ],
            ),
            (
                &[7, 4],
                vec![
                    ("begin", ints(&[-1, 3])),
                    ("end", ints(&[-8, -5])),
                    ("strides", ints(&[-1, -1])),
                ],
            ),
            (
                &[5, 2, 6],
                vec![
                    ("begin", ints(&[1, 2])),
                    ("end", ints(&[3, 4])),
                    ("axes", ints(&[0, -1])),
                ],
            ),
            (
                &[5, 2, 6],
                vec![
                    ("begin", ints(&[2, 0, 1])),
                    ("end", ints(&[2, -1, 5])),
                    ("slice_mode", AttrValue::Str("size".into())),
                ],
            ),
            (&[5, 2, 6], vec![("begin", ints(&[4])), ("end", ints(&[2]))]),
            (
                &[6],
                vec![
                    ("begin", ints(&[1])),
                    ("end", ints(&[6])),
                    ("strides", ints(&[3])),
                ],
            ),
        ];
        for (shape, kv) in cases {
            let t = rand(shape, &mut rng);
            let a = attrs(&kv);
            let args = [OpValue::Tensor(t)];
            let Some(OpValue::Tensor(fast)) = try_eval("strided_slice", &args, &a, 1) else {
                panic!("{shape:?} {kv:?}: no fast path")
            };
            let want = reference("strided_slice", &args, &a);
            assert_eq!(fast.shape(), want.shape(), "{shape:?} {kv:?}");
            assert_eq!(fast.as_f32(), want.as_f32(), "{shape:?} {kv:?}");
        }
    }

    /// Comparisons, `where` and `sign` of f32 tensors broadcast against each other in every
    /// way the shapes allow (a scalar, a row, a column, equal shapes), with equal values,
    /// signed zeros and NaN among them: the reference's values, dtype and shape.
    #[test]
    fn comparisons_selections_and_signs_are_the_references() {
        let mut rng = Rng::new(5);
        let special = |t: Tensor| {
            let mut v = t.as_f32().unwrap_or_default().to_vec();
            for (i, x) in v.iter_mut().enumerate() {
                match i % 7 {
                    1 => *x = 0.0,
                    3 => *x = -0.0,
                    5 => *x = f32::NAN,
                    6 => *x = 0.25,
                    _ => {}
                }
            }
            Tensor::from_f32(t.shape().to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
        };
        let shapes: [&[usize]; 5] = [&[], &[5], &[3, 1], &[3, 5], &[2, 3, 5]];
        let none = attrs(&[]);
        let same = |fast: &Tensor, want: &Tensor, what: &str| {
            assert_eq!(fast.shape(), want.shape(), "{what}");
            assert_eq!(fast.dtype(), want.dtype(), "{what}");
            let (a, b) = (fast.to_f64_vec(), want.to_f64_vec());
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    x == y || (x.is_nan() && y.is_nan()),
                    "{what}: {a:?} vs {b:?}"
                );
                assert_eq!(x.is_sign_negative(), y.is_sign_negative(), "{what}");
            }
        };
        let mut checked = 0;
        for sa in shapes {
            let a = special(rand(sa, &mut rng));
            let args = [OpValue::Tensor(a.clone())];
            let Some(OpValue::Tensor(fast)) = try_eval("sign", &args, &none, 1) else {
                panic!("sign {sa:?}: no fast path")
            };
            same(
                &fast,
                &reference("sign", &args, &none),
                &format!("sign {sa:?}"),
            );
            for sb in shapes {
                let b = special(rand(sb, &mut rng));
                if tumble_tensor::broadcast_shapes(sa, sb).is_err() {
                    continue;
                }
                let pair = [OpValue::Tensor(a.clone()), OpValue::Tensor(b.clone())];
                for op in [
                    "equal",
                    "not_equal",
                    "less",
                    "greater",
                    "less_equal",
                    "greater_equal",
                ] {
                    let Some(OpValue::Tensor(fast)) = try_eval(op, &pair, &none, 1) else {
                        panic!("{op} {sa:?} {sb:?}: no fast path")
                    };
                    same(
                        &fast,
                        &reference(op, &pair, &none),
                        &format!("{op} {sa:?} {sb:?}"),
                    );
                    checked += 1;
                }
                let cond = reference("greater", &pair, &none);
                for sc in shapes {
                    let c = match tumble_tensor::broadcast_shapes(cond.shape(), sc) {
                        Ok(s) if s == cond.shape() => cond.clone(),
                        _ => continue,
                    };
                    let three = [
                        OpValue::Tensor(c),
                        OpValue::Tensor(a.clone()),
                        OpValue::Tensor(special(rand(sc, &mut rng))),
                    ];
                    let Some(OpValue::Tensor(fast)) = try_eval("where", &three, &none, 1) else {
                        panic!("where {sa:?} {sb:?} {sc:?}: no fast path")
                    };
                    same(
                        &fast,
                        &reference("where", &three, &none),
                        &format!("where {sc:?}"),
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 100, "{checked}");
    }

    /// Sums and means over one axis, every axis of odd shapes, with and without keepdims, with
    /// signed zeros and NaN: the reference's bits.
    #[test]
    fn reductions_over_one_axis_are_the_references() {
        let mut rng = Rng::new(11);
        let shapes: [&[usize]; 6] = [
            &[7],
            &[3, 5],
            &[1, 9],
            &[4, 1, 3],
            &[2, 3, 17],
            &[5, 2, 1, 3],
        ];
        let mut checked = 0;
        for shape in shapes {
            let mut t = rand(shape, &mut rng);
            if shape.len() == 3 {
                // A signed zero and a NaN among the values.
                let mut v = t.as_f32().unwrap_or_default().to_vec();
                v[0] = -0.0;
                if v.len() > 5 {
                    v[5] = f32::NAN;
                }
                // Ties, for the argmax's first and last picks.
                for i in (2..v.len()).step_by(4) {
                    v[i] = v[1];
                }
                t = Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"));
            }
            let r = shape.len() as i64;
            for op in ["sum", "mean", "max", "min", "argmax", "argmin"] {
                for axis in -r..r {
                    for (keep, last) in [(false, false), (true, false), (false, true)] {
                        let mut kv = vec![
                            ("axis", AttrValue::List(vec![AttrValue::Int(axis)])),
                            ("keepdims", AttrValue::Bool(keep)),
                        ];
                        if last {
                            if !op.starts_with("arg") {
                                continue;
                            }
                            kv.push(("select_last_index", AttrValue::Bool(true)));
                        }
                        let a = attrs(&kv);
                        let args = [OpValue::Tensor(t.clone())];
                        let Some(OpValue::Tensor(fast)) = try_eval(op, &args, &a, 1) else {
                            panic!("{op} {shape:?} axis {axis}: no fast path")
                        };
                        let want = reference(op, &args, &a);
                        assert_eq!(fast.shape(), want.shape(), "{op} {shape:?} {axis}");
                        let bits = |x: &Tensor| -> Vec<u64> {
                            match x.as_f32() {
                                Some(v) => v.iter().map(|v| u64::from(v.to_bits())).collect(),
                                None => x.to_i64_vec().iter().map(|&i| i as u64).collect(),
                            }
                        };
                        assert_eq!(bits(&fast), bits(&want), "{op} {shape:?} axis {axis}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 180, "{checked}");
    }

    /// Extremes and their positions over long last axes (eight lanes and a remainder): a zero
    /// extreme of either sign among zeros of both, NaN first, late and twice, ties early and
    /// late, all equal: the reference's bits and positions.
    #[test]
    fn extremes_of_long_rows_are_the_references() {
        let n = 43;
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let base: Vec<f32> = (0..n).map(|i| -1.0 - (i * 7 % 13) as f32).collect();
        let with = |at: &[(usize, f32)]| {
            let mut r = base.clone();
            for &(i, v) in at {
                r[i] = v;
            }
            r
        };
        rows.push(with(&[(3, -0.0), (20, 0.0)]));
        rows.push(with(&[(3, 0.0), (20, -0.0), (41, 0.0)]));
        rows.push(with(&[(0, f32::NAN)]));
        rows.push(with(&[(37, f32::NAN), (40, f32::NAN)]));
        rows.push(with(&[(2, 5.0), (9, 5.0), (42, 5.0)]));
        rows.push(vec![2.5; n]);
        rows.push(base.iter().map(|x| -x).collect());
        let t =
            Tensor::from_f32(vec![rows.len(), n], rows.concat()).unwrap_or_else(|e| panic!("{e}"));
        for op in ["max", "min", "argmax", "argmin"] {
            for last in [false, true] {
                if last && !op.starts_with("arg") {
                    continue;
                }
                let mut kv = vec![("axis", AttrValue::List(vec![AttrValue::Int(1)]))];
                if last {
                    kv.push(("select_last_index", AttrValue::Bool(true)));
                }
                let a = attrs(&kv);
                let args = [OpValue::Tensor(t.clone())];
                let Some(OpValue::Tensor(fast)) = try_eval(op, &args, &a, 1) else {
                    panic!("{op}: no fast path")
                };
                let want = reference(op, &args, &a);
                let bits = |x: &Tensor| -> Vec<u64> {
                    match x.as_f32() {
                        Some(v) => v.iter().map(|v| u64::from(v.to_bits())).collect(),
                        None => x.to_i64_vec().iter().map(|&i| i as u64).collect(),
                    }
                };
                assert_eq!(bits(&fast), bits(&want), "{op} last={last}");
            }
        }
    }

    /// `variance` against its keepdims mean over each axis of odd shapes, biased and unbiased,
    /// with and without keepdims: the reference's bits; a mean of another shape is left to it.
    #[test]
    fn variance_over_one_axis_is_the_references() {
        let mut rng = Rng::new(5);
        let shapes: [&[usize]; 5] = [&[7], &[3, 5], &[1, 9], &[4, 1, 3], &[2, 3, 17]];
        let mut checked = 0;
        for shape in shapes {
            let t = rand(shape, &mut rng);
            let r = shape.len() as i64;
            for axis in -r..r {
                let mut mshape = shape.to_vec();
                mshape[axis.rem_euclid(r) as usize] = 1;
                let m = rand(&mshape, &mut rng);
                for (keep, unbiased) in [(false, false), (true, false), (true, true)] {
                    let a = attrs(&[
                        ("axis", AttrValue::List(vec![AttrValue::Int(axis)])),
                        ("keepdims", AttrValue::Bool(keep)),
                        ("unbiased", AttrValue::Bool(unbiased)),
                    ]);
                    let args = [OpValue::Tensor(t.clone()), OpValue::Tensor(m.clone())];
                    let Some(OpValue::Tensor(fast)) = try_eval("variance", &args, &a, 1) else {
                        panic!("{shape:?} axis {axis}: no fast path")
                    };
                    let want = reference("variance", &args, &a);
                    assert_eq!(fast.shape(), want.shape(), "{shape:?} {axis}");
                    let bits = |x: &Tensor| -> Vec<u32> {
                        x.as_f32()
                            .unwrap_or_default()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    };
                    assert_eq!(bits(&fast), bits(&want), "{shape:?} axis {axis} {unbiased}");
                    checked += 1;
                }
            }
        }
        assert!(checked >= 33, "{checked}");
        // One mean for the whole tensor: not a row's own, the reference's.
        let t = rand(&[3, 5], &mut rng);
        let one = rand(&[1, 1], &mut rng);
        let a = attrs(&[("axis", AttrValue::List(vec![AttrValue::Int(1)]))]);
        let args = [OpValue::Tensor(t), OpValue::Tensor(one)];
        assert!(try_eval("variance", &args, &a, 1).is_none());
    }

    #[test]
    fn broadcast_arithmetic_is_bit_identical_to_the_reference() {
        let mut rng = Rng::new(7);
        let pairs: [(&[usize], &[usize]); 9] = [
            (&[5, 1], &[64]),
            (&[3, 1, 7], &[1, 4, 7]),
            (&[], &[2, 3]),
            (&[2, 3], &[]),
            (&[4, 33], &[4, 33]),
            (&[1], &[1]),
            (&[6, 1, 1], &[5, 1]),
            (&[0, 3], &[3]),
            (&[2, 1, 3, 1], &[5, 1, 4]),
        ];
        for (sa, sb) in pairs {
            let a = rand(sa, &mut rng);
            let b = rand(sb, &mut rng);
            let args = [OpValue::Tensor(a), OpValue::Tensor(b)];
            for op in ["add", "subtract", "multiply", "divide"] {
                let fast = match try_eval(op, &args, &Attrs::default(), 1) {
                    Some(OpValue::Tensor(t)) => t,
                    other => panic!("{op} {sa:?} {sb:?}: {other:?}"),
                };
                let want = reference(op, &args, &Attrs::default());
                assert_eq!(fast.shape(), want.shape(), "{op} {sa:?} {sb:?}");
                let (f, w) = (fast.as_f32().unwrap_or(&[]), want.as_f32().unwrap_or(&[]));
                assert!(
                    f.iter().zip(w).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{op} {sa:?} {sb:?}: {f:?} vs {w:?}"
                );
            }
        }
        // Shapes that do not broadcast and other dtypes are left to the reference kernel.
        let bad = [
            OpValue::Tensor(rand(&[3], &mut rng)),
            OpValue::Tensor(rand(&[4], &mut rng)),
        ];
        assert!(try_eval("add", &bad, &Attrs::default(), 1).is_none());
        let ints = Tensor::from_vec(vec![2], vec![1i32, 2]).unwrap_or_else(|e| panic!("{e}"));
        let mixed = [OpValue::Tensor(ints.clone()), OpValue::Tensor(ints)];
        assert!(try_eval("multiply", &mixed, &Attrs::default(), 1).is_none());
    }

    #[test]
    fn permute_matches_the_reference_at_odd_shapes() {
        let mut rng = Rng::new(1);
        for shape in [vec![1, 7, 3], vec![7, 1, 33], vec![3, 5, 2, 7]] {
            let t = rand(&shape, &mut rng);
            let r = shape.len();
            let perms: Vec<Vec<i64>> = if r == 3 {
                vec![vec![1, 0, 2], vec![2, 0, 1], vec![0, 2, 1]]
            } else {
                vec![vec![0, 2, 1, 3], vec![3, 2, 1, 0]]
            };
            for p in perms {
                let a = attrs(&[(
                    "axes",
                    AttrValue::List(p.iter().map(|&x| AttrValue::Int(x)).collect()),
                )]);
                let args = [OpValue::Tensor(t.clone())];
                let fast = try_eval("transpose", &args, &a, 1).and_then(|v| v.as_tensor().cloned());
                assert_eq!(
                    fast,
                    Some(reference("transpose", &args, &a)),
                    "{shape:?} {p:?}"
                );
            }
        }
    }

    #[test]
    fn concatenate_matches_the_reference_on_every_axis() {
        let mut rng = Rng::new(3);
        for (shape, axis) in [
            (vec![1, 1], 0i64),
            (vec![3, 7, 5], 0),
            (vec![3, 7, 5], 1),
            (vec![3, 7, 5], 2),
            (vec![2, 33, 1], -1),
        ] {
            let mut other = shape.clone();
            let ax = if axis < 0 {
                shape.len() as i64 + axis
            } else {
                axis
            } as usize;
            other[ax] = 2;
            let parts = vec![
                rand(&shape, &mut rng),
                rand(&other, &mut rng),
                rand(&shape, &mut rng),
            ];
            let a = attrs(&[("axis", AttrValue::Int(axis))]);
            let args = [OpValue::Tuple(parts)];
            let fast = try_eval("concatenate", &args, &a, 1).and_then(|v| v.as_tensor().cloned());
            assert_eq!(
                fast,
                Some(reference("concatenate", &args, &a)),
                "{shape:?} {axis}"
            );
        }
    }

    #[test]
    fn batch_matmul_matches_the_reference_with_and_without_transpose() {
        let mut rng = Rng::new(2);
        let check = |x: Tensor, y: Tensor, tb: bool, what: &str| {
            let a = attrs(&[("transpose_b", AttrValue::Bool(tb))]);
            let args = [OpValue::Tensor(x), OpValue::Tensor(y)];
            let fast = try_eval("nn.batch_matmul", &args, &a, 2)
                .and_then(|v| v.as_tensor().cloned())
                .unwrap_or_else(|| panic!("no fast path"));
            let want = reference("nn.batch_matmul", &args, &a);
            assert!(fast.allclose(&want, 1e-5, 1e-5), "{what} {tb}");
        };
        // m ≥ 8: the GEMM kernel (`gemm::small_product`); below, dot products.
        for (g, m, n, k) in [
            (1, 1, 1, 1),
            (3, 7, 5, 33),
            (2, 1, 9, 8),
            (3, 8, 5, 3),
            (2, 19, 33, 65),
            (1, 130, 17, 64),
        ] {
            for tb in [true, false] {
                let x = rand(&[g, m, k], &mut rng);
                let y = if tb {
                    rand(&[g, n, k], &mut rng)
                } else {
                    rand(&[g, k, n], &mut rng)
                };
                check(x, y, tb, &format!("{g} {m} {n} {k}"));
            }
        }
        // One side shared by every batch element (broadcast over g).
        for tb in [true, false] {
            let x = rand(&[1, 12, 20], &mut rng);
            let y = rand(&[3, 20, 20], &mut rng);
            check(x, y, tb, "broadcast");
        }
    }
}
