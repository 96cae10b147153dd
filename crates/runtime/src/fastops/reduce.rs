//! Reductions over one axis of an f32 tensor (`sum`, `mean`, `max`, `min`, `variance`) and the
//! index of an extreme (`argmax`, `argmin`), each in the reference's order of steps: its bits.

use super::*;

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

/// `sum`, `mean`, `max` or `min` of an f32 tensor over one axis as the reference computes it —
/// each output element folded in f64 over the reduced axis in index order (a sum from 0.0, an
/// extreme from the first element), then rounded — without moving the axis last first: the
/// reference's generic permute and f64 copy of the whole tensor made a batched attention written
/// as `sum(multiply(%q, %M), axis=[1])` 16 ns an element, and a CRF's log-sum-exp over the
/// previous tags' axis 12. The reduced rows are folded into a row of f64 accumulators, so every
/// element sees the same steps in the same order: the reference's bits.
pub(super) fn reduce_f32(args: &[OpValue], attrs: &Attrs, fold: RowReduce) -> Option<Tensor> {
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
pub(super) fn variance_f32(args: &[OpValue], attrs: &Attrs) -> Option<Tensor> {
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
pub(super) fn arg_f32(args: &[OpValue], attrs: &Attrs, high: bool) -> Option<Tensor> {
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
