//! Kernels that reduce along axes: normalizations (`nn.softmax`, `nn.log_softmax`,
//! `nn.layer_norm`), reductions (`sum`, `mean`, `max`, `min`), `argmax`/`argmin`, and the scans
//! `cumsum`/`cumprod`.
//!
//! Each moves the axes it works on to the end ([`permute`]), so that every output element (or
//! every normalized row) is one contiguous row of the moved input; rows are processed in f64
//! (floats) or i64 (ints), and the result is rounded once to the output dtype. Softmax and
//! log-softmax subtract the row maximum first; layer norm computes the mean, then the variance of
//! the centered values (two passes), so large offsets (values ~1e4) lose no precision.

use super::{inverse, kernels, permute, product, row, KCall, Values};
use crate::{rel, KernelError, OpCtx, OpValue};
use std::cmp::Ordering;
use tumble_ir::Attrs;
use tumble_tensor::Tensor;

/// Which reduction `reduction` computes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Prod,
    Mean,
    Max,
    Min,
    ArgMax,
    ArgMin,
    /// Bool in, bool out.
    All,
    Any,
}

kernels! {
    softmax => normalize("nn.softmax", false);
    log_softmax => normalize("nn.log_softmax", true);
    sum => reduction("sum", Reduce::Sum, rel::reduce::sum);
    prod => reduction("prod", Reduce::Prod, rel::reduce::prod);
    all => reduction("all", Reduce::All, rel::reduce::all);
    any => reduction("any", Reduce::Any, rel::reduce::any);
    mean => reduction("mean", Reduce::Mean, rel::reduce::mean);
    max => reduction("max", Reduce::Max, rel::reduce::max);
    min => reduction("min", Reduce::Min, rel::reduce::min);
    argmax => reduction("argmax", Reduce::ArgMax, rel::reduce::argmax);
    argmin => reduction("argmin", Reduce::ArgMin, rel::reduce::argmin);
}

/// Applies `f` to every 1-D row of `x` along `axis` (in f64) and puts the results back in place;
/// the result has `x`'s shape and dtype.
fn along_axis(
    k: &KCall,
    x: &Tensor,
    axis: usize,
    mut f: impl FnMut(&[f64], &mut Vec<f64>),
) -> Result<Tensor, KernelError> {
    let rank = x.rank();
    let mut perm: Vec<usize> = (0..rank).filter(|&a| a != axis).collect();
    perm.push(axis);
    let moved = permute(x, &perm).map_err(|m| k.err(m))?;
    let len = x.shape().get(axis).copied().unwrap_or(0);
    let rows = k.t(product(moved.shape()))?.checked_div(len).unwrap_or(0);
    let v = moved.to_f64_vec();
    let mut out = Vec::with_capacity(v.len());
    for r in 0..rows {
        f(row(&v, r, len), &mut out);
    }
    let moved_out = k.t(Values::F(out).into_tensor(moved.shape(), x.dtype()))?;
    permute(&moved_out, &inverse(&perm)).map_err(|m| k.err(m))
}

/// `ln(Σ exp(x - m))` for a row whose maximum is `m`: the sum is `1 + s` with `s` the sum over
/// every element but one maximum, so `ln_1p(s)` — `ln` of the whole sum loses `s` below the
/// sum's last bit (log-softmax of `[0, -40, ...]` was 0 at the top instead of -3e-17). With no
/// element equal to `m` (a row of NaNs) the row's result is NaN either way.
pub fn log_sum_after_max(row: impl Iterator<Item = f64>, m: f64) -> f64 {
    let mut skipped = false;
    let mut s = 0.0;
    for v in row {
        if !skipped && v == m {
            skipped = true;
        } else {
            s += (v - m).exp();
        }
    }
    if skipped {
        s.ln_1p()
    } else {
        s.ln()
    }
}

/// `nn.softmax(x, axis=-1)` and `nn.log_softmax`, stabilized by subtracting the row maximum.
fn normalize(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    log: bool,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    if !x.dtype().is_float() {
        return Err(k.err(format!(
            "input must have a float dtype, found {}",
            x.dtype()
        )));
    }
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", -1)?, x.rank())?;
    let out = along_axis(&k, x, axis, |r, out| {
        let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if log {
            let log_sum = log_sum_after_max(r.iter().copied(), m);
            out.extend(r.iter().map(|v| v - m - log_sum));
        } else {
            let sum: f64 = r.iter().map(|v| (v - m).exp()).sum();
            out.extend(r.iter().map(|v| (v - m).exp() / sum));
        }
    })?;
    Ok(out.into())
}

/// `nn.layer_norm(x, gamma, beta, axis=-1, epsilon=1e-5, center=True, scale=True)`:
/// `(x - mean) / sqrt(var + epsilon) * gamma + beta` along `axis`, with the biased variance
/// (divided by n); `gamma` is skipped when `scale=False`, `beta` when `center=False`.
pub fn layer_norm(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.layer_norm", args, attrs, 3)?;
    let x = k.tensor(0, "input")?;
    let gamma = k.tensor(1, "gamma")?;
    let beta = k.tensor(2, "beta")?;
    if !x.dtype().is_float() {
        return Err(k.err(format!(
            "input must have a float dtype, found {}",
            x.dtype()
        )));
    }
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", -1)?, x.rank())?;
    let eps = c.opt_float("epsilon")?.unwrap_or(1e-5);
    let center = c.bool_or("center", true)?;
    let scale = c.bool_or("scale", true)?;
    let len = x.shape().get(axis).copied().unwrap_or(0);
    for (t, role) in [(gamma, "gamma"), (beta, "beta")] {
        if t.shape() != [len] {
            return Err(k.err(format!(
                "{role} has shape {:?} but input has {len} along axis {axis}",
                t.shape()
            )));
        }
    }
    let g = gamma.to_f64_vec();
    let b = beta.to_f64_vec();
    let n = len as f64;
    let out = along_axis(&k, x, axis, |r, out| {
        let mean = r.iter().sum::<f64>() / n;
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, gi), bi) in r.iter().zip(&g).zip(&b) {
            let mut y = (v - mean) * inv;
            if scale {
                y *= gi;
            }
            if center {
                y += bi;
            }
            out.push(y);
        }
    })?;
    Ok(out.into())
}

/// Orders floats with NaN above everything (`nan_high`) or below everything, NaN equal to NaN:
/// the order under which `argmax`/`argmin` pick the first NaN, as numpy does.
fn nan_cmp(a: f64, b: f64, nan_high: bool) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) if nan_high => Ordering::Greater,
        (true, false) => Ordering::Less,
        (false, true) if nan_high => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// The position of the extreme element of `r` under `cmp`: `Greater` means "better". Ties go to
/// the first occurrence, or the last with `last`. `None` for an empty row.
fn arg_best<T: Copy>(r: &[T], last: bool, cmp: impl Fn(T, T) -> Ordering) -> Option<usize> {
    let mut it = r.iter().copied().enumerate();
    let (mut bi, mut bv) = it.next()?;
    for (i, v) in it {
        match cmp(v, bv) {
            Ordering::Greater => (bi, bv) = (i, v),
            Ordering::Equal if last => (bi, bv) = (i, v),
            _ => {}
        }
    }
    Some(bi)
}

/// `sum`/`mean`/`max`/`min`/`argmax`/`argmin(x, axis=None, keepdims=False, exclude=False)`.
/// The reduced axes are moved to the end; each output element reduces one contiguous row of
/// `row_len` = (product of reduced dims) elements. `argmax`/`argmin` return the position within
/// that row, i.e. the row-major flat index over the reduced axes.
/// `all`/`any` of a numeric tensor (the relation refuses it; a direct kernel call gets this).
fn bool_only(k: &KCall, x: &Tensor) -> KernelError {
    k.err(format!("input must have dtype bool, found {}", x.dtype()))
}

fn reduction(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    kind: Reduce,
    relation: crate::Relation,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, out_dtype) = k.out_tensor(relation)?;
    let c = k.rel();
    let reduced = rel::reduce::reduce_axes(&c, c.tensor(0, "input")?)?;
    let (moved, rows, len) = reduced_rows(&k, x, &reduced)?;
    let empty = || k.err("cannot reduce an empty axis (the reduction has no identity)");
    let select_last = kind == Reduce::ArgMax || kind == Reduce::ArgMin;
    let select_last = select_last && c.bool_or("select_last_index", false)?;
    let arg_index = |i: Option<usize>| -> Result<i64, KernelError> {
        let i = i.ok_or_else(empty)?;
        i32::try_from(i)
            .map(i64::from)
            .map_err(|_| k.err(format!("index {i} does not fit in int32")))
    };
    let out = match Values::of(&moved) {
        Values::F(v) => {
            let rows_iter = (0..rows).map(|r| row(&v, r, len));
            match kind {
                // From +0.0, as numpy's: Rust's `Sum` starts from -0.0, so a sum over no
                // elements came out -0.0.
                Reduce::Sum => Values::F(
                    rows_iter
                        .map(|r| r.iter().fold(0.0, |a, b| a + b))
                        .collect(),
                ),
                Reduce::Prod => Values::F(
                    rows_iter
                        .map(|r| r.iter().fold(1.0, |a, b| a * b))
                        .collect(),
                ),
                Reduce::Mean => Values::F(
                    rows_iter
                        .map(|r| r.iter().fold(0.0, |a, b| a + b) / len as f64)
                        .collect(),
                ),
                Reduce::All | Reduce::Any => return Err(bool_only(&k, x)),
                Reduce::Max | Reduce::Min => {
                    let f = if kind == Reduce::Max {
                        super::broadcast::nan_max
                    } else {
                        super::broadcast::nan_min
                    };
                    Values::F(
                        rows_iter
                            .map(|r| r.iter().copied().reduce(f).ok_or_else(empty))
                            .collect::<Result<_, _>>()?,
                    )
                }
                Reduce::ArgMax | Reduce::ArgMin => {
                    let high = kind == Reduce::ArgMax;
                    Values::I(
                        rows_iter
                            .map(|r| {
                                arg_index(arg_best(r, select_last, |a, b| {
                                    let o = nan_cmp(a, b, high);
                                    if high {
                                        o
                                    } else {
                                        o.reverse()
                                    }
                                }))
                            })
                            .collect::<Result<_, _>>()?,
                    )
                }
            }
        }
        Values::I(v) => {
            let rows_iter = (0..rows).map(|r| row(&v, r, len));
            let wrapping_sum = |r: &[i64]| r.iter().fold(0i64, |a, &b| a.wrapping_add(b));
            match kind {
                Reduce::Sum => Values::I(rows_iter.map(wrapping_sum).collect()),
                Reduce::Prod => Values::I(
                    rows_iter
                        .map(|r| r.iter().fold(1i64, |a, &b| a.wrapping_mul(b)))
                        .collect(),
                ),
                Reduce::All | Reduce::Any => return Err(bool_only(&k, x)),
                Reduce::Mean => {
                    // The exact sum (in i128: a sum of i64s wrapped, so the mean of large values
                    // came out far outside them), divided truncating like integer `divide`. A
                    // mean lies between the row's least and greatest values, so it fits.
                    let n = i128::try_from(len).map_err(|_| k.err("too many elements"))?;
                    if n == 0 && rows > 0 {
                        return Err(
                            k.err("mean of an empty axis of an integer tensor (division by zero)")
                        );
                    }
                    let mean = |r: &[i64]| {
                        let s = r.iter().fold(0i128, |a, &b| a + i128::from(b));
                        i64::try_from(s / n).unwrap_or(0)
                    };
                    Values::I(rows_iter.map(mean).collect())
                }
                Reduce::Max => Values::I(
                    rows_iter
                        .map(|r| r.iter().copied().max().ok_or_else(empty))
                        .collect::<Result<_, _>>()?,
                ),
                Reduce::Min => Values::I(
                    rows_iter
                        .map(|r| r.iter().copied().min().ok_or_else(empty))
                        .collect::<Result<_, _>>()?,
                ),
                Reduce::ArgMax => Values::I(
                    rows_iter
                        .map(|r| arg_index(arg_best(r, select_last, |a: i64, b| a.cmp(&b))))
                        .collect::<Result<_, _>>()?,
                ),
                Reduce::ArgMin => Values::I(
                    rows_iter
                        .map(|r| arg_index(arg_best(r, select_last, |a: i64, b| b.cmp(&a))))
                        .collect::<Result<_, _>>()?,
                ),
            }
        }
        Values::B(v) => {
            let rows_iter = (0..rows).map(|r| row(&v, r, len));
            match kind {
                // An empty axis: `all` is true and `any` false, as numpy's.
                Reduce::All => Values::B(rows_iter.map(|r| r.iter().all(|&b| b)).collect()),
                Reduce::Any => Values::B(rows_iter.map(|r| r.iter().any(|&b| b)).collect()),
                _ => return Err(k.err("input must have a numeric dtype, found bool")),
            }
        }
    };
    Ok(k.t(out.into_tensor(&out_shape, out_dtype))?.into())
}

/// `x` with the axes `reduced` moved to the end, so each output element of the reduction is one
/// contiguous row: (the moved tensor, rows, row length).
fn reduced_rows(
    k: &KCall,
    x: &Tensor,
    reduced: &[bool],
) -> Result<(Tensor, usize, usize), KernelError> {
    let (mut perm, red): (Vec<usize>, Vec<usize>) =
        (0..x.rank()).partition(|&a| !reduced.get(a).copied().unwrap_or(false));
    let dims = |axes: &[usize]| -> Vec<usize> {
        axes.iter()
            .filter_map(|&a| x.shape().get(a).copied())
            .collect()
    };
    let (rows, len) = (k.t(product(&dims(&perm)))?, k.t(product(&dims(&red)))?);
    perm.extend(red);
    Ok((permute(x, &perm).map_err(|m| k.err(m))?, rows, len))
}

/// `variance(data, mean, axis, keepdims, exclude, unbiased)`, Relay's: the mean of
/// `(data - mean)²` over the reduced axes, divided by `N - 1` when `unbiased` (`mean` is the
/// keepdims mean TVM's `relay.variance` passes, broadcast back onto `data`). In f64, rounded
/// once.
pub fn variance(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("variance", args, attrs, 2)?;
    let x = k.tensor(0, "data")?;
    let m = k.tensor(1, "mean")?;
    let (out_shape, out_dtype) = k.out_tensor(rel::reduce::variance)?;
    let c = k.rel();
    let reduced = rel::reduce::reduce_axes(&c, c.tensor(0, "data")?)?;
    let mb = m
        .broadcast_to(x.shape().to_vec())
        .map_err(|e| k.err(format!("mean: {e}")))?;
    let count = variance_divisor(x.shape(), &reduced, c.bool_or("unbiased", false)?);
    let (xs, rows, len) = reduced_rows(&k, x, &reduced)?;
    let (ms, _, _) = reduced_rows(&k, &mb, &reduced)?;
    let (xv, mv) = (xs.to_f64_vec(), ms.to_f64_vec());
    let out = (0..rows).map(|r| {
        let sq: f64 = row(&xv, r, len)
            .iter()
            .zip(row(&mv, r, len))
            .map(|(v, mu)| (v - mu) * (v - mu))
            .sum();
        sq / count
    });
    let out = Values::F(out.collect());
    Ok(k.t(out.into_tensor(&out_shape, out_dtype))?.into())
}

/// Elements each reduction of `shape` over the axes `reduced` takes in.
pub(crate) fn reduced_count(shape: &[usize], reduced: &[bool]) -> usize {
    shape
        .iter()
        .zip(reduced)
        .filter(|(_, r)| **r)
        .map(|(d, _)| *d)
        .product()
}

/// What `variance` divides its sum of squares by: numpy's `max(N - ddof, 0)` (an empty axis, or
/// one element when unbiased, gives NaN or inf).
pub fn variance_divisor(shape: &[usize], reduced: &[bool], unbiased: bool) -> f64 {
    (reduced_count(shape, reduced) as f64 - if unbiased { 1.0 } else { 0.0 }).max(0.0)
}

kernels! {
    cumsum => scan("cumsum", rel::reduce::cumsum, false);
    cumprod => scan("cumprod", rel::reduce::cumprod, true);
}

/// `cumsum` / `cumprod(x, axis=None, dtype=None, exclusive=None)`: the input cast to the result
/// dtype, then running sums (products) along the axis: floats accumulated in f64 and each
/// prefix rounded once, ints wrapping (like the dtype's own arithmetic). `exclusive` leaves the
/// current element out (the first is 0, or 1 for products).
fn scan(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    relation: crate::Relation,
    prod: bool,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, dtype) = k.out_tensor(relation)?;
    let c = k.rel();
    let (axis, _, exclusive) = rel::reduce::scan_spec(&c, c.tensor(0, "input")?)?;
    // Without an axis the flattened input is one line.
    let (outer, n, inner) = match axis {
        Some(a) => {
            let s = x.shape();
            (
                k.t(product(s.get(..a).unwrap_or_default()))?,
                s.get(a).copied().unwrap_or(1),
                k.t(product(s.get(a + 1..).unwrap_or_default()))?,
            )
        }
        None => (1, x.len(), 1),
    };
    fn run<T: Copy>(
        v: &[T],
        (outer, n, inner): (usize, usize, usize),
        exclusive: bool,
        identity: T,
        step: impl Fn(T, T) -> T,
    ) -> Vec<T> {
        let mut out = vec![identity; v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = identity;
                for a in 0..n {
                    let at = (o * n + a) * inner + i;
                    let (Some(&e), Some(slot)) = (v.get(at), out.get_mut(at)) else {
                        continue;
                    };
                    if exclusive {
                        *slot = acc;
                        acc = step(acc, e);
                    } else {
                        acc = step(acc, e);
                        *slot = acc;
                    }
                }
            }
        }
        out
    }
    let dims = (outer, n, inner);
    let values = match Values::of(&x.cast(dtype)) {
        Values::F(v) if prod => Values::F(run(&v, dims, exclusive, 1.0, |a, b| a * b)),
        Values::F(v) => Values::F(run(&v, dims, exclusive, 0.0, |a, b| a + b)),
        Values::I(v) if prod => Values::I(run(&v, dims, exclusive, 1, i64::wrapping_mul)),
        Values::I(v) => Values::I(run(&v, dims, exclusive, 0, i64::wrapping_add)),
        Values::B(_) => return Err(k.err("the result dtype must be numeric, found bool")),
    };
    Ok(k.t(values.into_tensor(&out_shape, dtype))?.into())
}
