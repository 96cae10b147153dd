//! Kernels of the operators in [`crate::rel::nn`]: `nn.dropout` and `nn.batch_norm` with
//! inference semantics (dropout is the identity, batch norm uses the moving statistics), the
//! `*_like` operators, `sequence_mask`, `nn.prelu`, `nn.l2_normalize` and `nn.pad`.

use super::{KCall, Values};
use crate::rel::nn::{dropout_rate, l2_axes, pad_spec, sequence_axis, PadMode};
use crate::{rel, KernelError, OpCtx, OpValue};
use tumble_ir::Attrs;
use tumble_tensor::shape::{broadcast_index, increment_index};
use tumble_tensor::Tensor;

/// `nn.dropout(data, rate)`: `(data, ones)`. Dropout is not applied: tumble runs Relay programs
/// as TVM's inference build does (SimplifyInference removes it); a training program that wants
/// dropout draws its mask with `random.db_uniform`.
pub fn dropout(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.dropout", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    dropout_rate(&k.rel())?;
    let ones = k.t(Tensor::full_f64(x.shape().to_vec(), x.dtype(), 1.0))?;
    Ok(OpValue::Tuple(vec![x.clone(), ones]))
}

/// `full_like(data, fill_value)`: the fill value, cast to the input's dtype, everywhere.
pub fn full_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("full_like", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let v = k.tensor(1, "fill_value")?;
    if v.len() != 1 {
        return Err(k.err(format!(
            "fill_value must be a scalar, found shape {:?}",
            v.shape()
        )));
    }
    let scalar = k.t(v.cast(x.dtype()).reshape([]))?;
    Ok(k.t(scalar.broadcast_to(x.shape().to_vec()))?.into())
}

/// `reshape_like(data, shape_like)`: the same elements in the relation's shape.
pub fn reshape_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("reshape_like", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let (shape, _) = k.out_tensor(rel::nn::reshape_like)?;
    Ok(k.t(x.reshape(shape))?.into())
}

/// `broadcast_to_like(data, broadcast_type)`: numpy's broadcast to the second argument's shape.
pub fn broadcast_to_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("broadcast_to_like", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let (shape, _) = k.out_tensor(rel::nn::broadcast_to_like)?;
    Ok(k.t(x.broadcast_to(shape))?.into())
}

/// `collapse_sum_like(data, collapse_type)`: each output element the sum of the input elements
/// that broadcasting it would have filled (f64 or wrapping i64 sums, rounded once).
pub fn collapse_sum_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("collapse_sum_like", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let (to, dtype) = k.out_tensor(rel::nn::collapse_sum_like)?;
    let n = k.t(super::product(&to))?;
    let from = x.shape();
    let slots = |f: &mut dyn FnMut(usize, usize)| {
        if x.is_empty() {
            return;
        }
        let mut idx = vec![0; from.len()];
        let mut i = 0;
        loop {
            f(i, broadcast_index(&idx, &to));
            i += 1;
            if !increment_index(&mut idx, from) {
                break;
            }
        }
    };
    let out = match Values::of(x) {
        Values::F(v) => {
            let mut acc = vec![0.0; n];
            slots(&mut |i, o| {
                if let (Some(a), Some(x)) = (acc.get_mut(o), v.get(i)) {
                    *a += x;
                }
            });
            Values::F(acc)
        }
        Values::I(v) => {
            let mut acc = vec![0i64; n];
            slots(&mut |i, o| {
                if let (Some(a), Some(x)) = (acc.get_mut(o), v.get(i)) {
                    *a = a.wrapping_add(*x);
                }
            });
            Values::I(acc)
        }
        Values::B(_) => return Err(k.err("input must be numeric, found bool")),
    };
    Ok(k.t(out.into_tensor(&to, dtype))?.into())
}

/// For each element of `data` (shape `shape`) of `sequence_mask` along `axis`, whether it is
/// kept: its position along `axis` is below its sequence's `valid_length` (a negative length
/// keeps nothing).
pub(crate) fn sequence_kept(shape: &[usize], axis: usize, lengths: &[i64]) -> Vec<bool> {
    let (d0, d1) = (
        shape.first().copied().unwrap_or(0),
        shape.get(1).copied().unwrap_or(0),
    );
    let rest: usize = shape.get(2..).unwrap_or_default().iter().product();
    let n = d0 * d1 * rest;
    (0..n)
        .map(|f| {
            let i0 = f / (d1 * rest).max(1);
            let i1 = (f / rest.max(1)) % d1.max(1);
            let (pos, b) = if axis == 0 { (i0, i1) } else { (i1, i0) };
            lengths
                .get(b)
                .is_some_and(|&l| i64::try_from(pos).is_ok_and(|p| p < l))
        })
        .collect()
}

/// `sequence_mask(data, valid_length, mask_value, axis)`.
pub fn sequence_mask(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("sequence_mask", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let len = k.tensor(1, "valid_length")?;
    let (shape, dtype) = k.out_tensor(rel::nn::sequence_mask)?;
    let c = k.rel();
    let axis = sequence_axis(&c)?;
    let mask = c.opt_float("mask_value")?.unwrap_or(0.0);
    let kept = sequence_kept(x.shape(), axis, &len.to_i64_vec());
    let out = match Values::of(x) {
        Values::F(v) => Values::F(
            v.iter()
                .zip(&kept)
                .map(|(x, k)| if *k { *x } else { mask })
                .collect(),
        ),
        Values::I(v) => Values::I(
            v.iter()
                .zip(&kept)
                .map(|(x, k)| if *k { *x } else { mask as i64 })
                .collect(),
        ),
        Values::B(_) => return Err(k.err("input must be numeric, found bool")),
    };
    Ok(k.t(out.into_tensor(&shape, dtype))?.into())
}

/// For each element of a tensor of `shape`, its index along `axis`.
pub(crate) fn channel_of_each(shape: &[usize], axis: usize) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let c = shape.get(axis).copied().unwrap_or(1).max(1);
    let inner: usize = shape
        .get(axis + 1..)
        .unwrap_or_default()
        .iter()
        .product::<usize>()
        .max(1);
    (0..n).map(|f| (f / inner) % c).collect()
}

/// `nn.prelu(data, alpha, axis)`: `x` where positive, else `alpha[c] · x`.
pub fn prelu(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.prelu", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let alpha = k.tensor(1, "alpha")?;
    let (shape, dtype) = k.out_tensor(rel::nn::prelu)?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 1)?, x.rank())?;
    let a = alpha.to_f64_vec();
    let out: Vec<f64> = x
        .to_f64_vec()
        .iter()
        .zip(channel_of_each(x.shape(), axis))
        .map(|(&v, ch)| {
            if v > 0.0 {
                v
            } else {
                a.get(ch).copied().unwrap_or(f64::NAN) * v
            }
        })
        .collect();
    Ok(k.t(Values::F(out).into_tensor(&shape, dtype))?.into())
}

/// For each element of a tensor of `shape`, its group when the axes `summed` are reduced, and
/// the number of groups.
pub(crate) fn groups(shape: &[usize], summed: &[bool]) -> (Vec<usize>, usize) {
    let n: usize = shape.iter().product();
    let count: usize = shape
        .iter()
        .zip(summed)
        .filter(|(_, s)| !**s)
        .map(|(d, _)| *d)
        .product();
    let mut out = Vec::with_capacity(n);
    if n > 0 {
        let mut idx = vec![0; shape.len()];
        loop {
            let g = idx
                .iter()
                .zip(shape)
                .zip(summed)
                .filter(|(_, s)| !**s)
                .fold(0, |acc, ((i, d), _)| acc * d + i);
            out.push(g);
            if !increment_index(&mut idx, shape) {
                break;
            }
        }
    }
    (out, count)
}

/// `nn.l2_normalize(data, eps, axis)`: `x / sqrt(max(Σ x², eps))` per group of the summed axes.
pub fn l2_normalize(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.l2_normalize", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (shape, dtype) = k.out_tensor(rel::nn::l2_normalize)?;
    let c = k.rel();
    let eps = c.req_float("eps")?;
    let (group, count) = groups(x.shape(), &l2_axes(&c, x.rank())?);
    let v = x.to_f64_vec();
    let mut sums = vec![0.0; count];
    for (x, g) in v.iter().zip(&group) {
        if let Some(s) = sums.get_mut(*g) {
            *s += x * x;
        }
    }
    let out: Vec<f64> = v
        .iter()
        .zip(&group)
        .map(|(x, g)| x / sums.get(*g).copied().unwrap_or(0.0).max(eps).sqrt())
        .collect();
    Ok(k.t(Values::F(out).into_tensor(&shape, dtype))?.into())
}

/// For each element of `nn.pad`'s output (shape `out`), the flat input element it copies, or
/// `None` where the pad value goes (constant mode).
pub(crate) fn pad_map(
    input: &[usize],
    out: &[usize],
    pads: &[(usize, usize)],
    mode: PadMode,
) -> Vec<Option<usize>> {
    let n: usize = out.iter().product();
    let mut map = Vec::with_capacity(n);
    if n == 0 {
        return map;
    }
    let mut idx = vec![0; out.len()];
    loop {
        let mut flat = Some(0usize);
        for ((&i, &d), &(before, _)) in idx.iter().zip(input).zip(pads) {
            let j = i as i64 - before as i64;
            let d64 = d as i64;
            let src = if (0..d64).contains(&j) {
                Some(j)
            } else {
                match mode {
                    PadMode::Constant => None,
                    PadMode::Edge => Some(j.clamp(0, d64 - 1)),
                    PadMode::Reflect if d64 > 1 => {
                        Some(if j < 0 { -j } else { 2 * (d64 - 1) - j }.clamp(0, d64 - 1))
                    }
                    PadMode::Reflect => Some(0),
                }
            };
            flat = match (flat, src.and_then(|s| usize::try_from(s).ok())) {
                (Some(f), Some(s)) => Some(f * d + s),
                _ => None,
            };
        }
        map.push(flat);
        if !increment_index(&mut idx, out) {
            break;
        }
    }
    map
}

/// `nn.pad(data, pad_value, pad_width, pad_mode)`, or with the attribute `pad_value`.
pub fn pad(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let arity = if args.len() == 1 { 1 } else { 2 };
    let k = KCall::new("nn.pad", args, attrs, arity)?;
    let x = k.tensor(0, "input")?;
    let (shape, dtype) = k.out_tensor(rel::nn::pad)?;
    let c = k.rel();
    let (pads, mode) = pad_spec(&c, x.rank())?;
    let value = if arity == 2 {
        k.tensor(1, "pad_value")?.cast(x.dtype())
    } else {
        Tensor::scalar_f64(c.opt_float("pad_value")?.unwrap_or(0.0)).cast(x.dtype())
    };
    let map = pad_map(x.shape(), &shape, &pads, mode);
    let pick = |v: &[f64], p: f64| -> Vec<f64> {
        map.iter()
            .map(|m| m.and_then(|i| v.get(i).copied()).unwrap_or(p))
            .collect()
    };
    let out = match (Values::of(x), Values::of(&value)) {
        (Values::F(v), Values::F(p)) => Values::F(pick(&v, p.first().copied().unwrap_or(0.0))),
        (Values::I(v), Values::I(p)) => {
            let p = p.first().copied().unwrap_or(0);
            Values::I(
                map.iter()
                    .map(|m| m.and_then(|i| v.get(i).copied()).unwrap_or(p))
                    .collect(),
            )
        }
        _ => return Err(k.err(format!("unsupported input dtype {}", x.dtype()))),
    };
    Ok(k.t(out.into_tensor(&shape, dtype))?.into())
}

/// `nn.batch_norm(data, gamma, beta, mean, var)`, inference semantics:
/// `(x - mean[c]) / sqrt(var[c] + epsilon) · gamma[c] + beta[c]` (gamma 1 unless `scale`, beta 0
/// unless `center`), and the moving statistics returned as given.
pub fn batch_norm(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.batch_norm", args, attrs, 5)?;
    let x = k.tensor(0, "input")?;
    let (gamma, beta) = (k.tensor(1, "gamma")?, k.tensor(2, "beta")?);
    let (mean, var) = (k.tensor(3, "moving_mean")?, k.tensor(4, "moving_var")?);
    k.out_ty(rel::nn::batch_norm)?;
    let p = BatchNorm::of(&k)?;
    let (g, b, m, v) = (
        gamma.to_f64_vec(),
        beta.to_f64_vec(),
        mean.to_f64_vec(),
        var.to_f64_vec(),
    );
    let at = |s: &[f64], c: usize| s.get(c).copied().unwrap_or(f64::NAN);
    let out: Vec<f64> = x
        .to_f64_vec()
        .iter()
        .zip(channel_of_each(x.shape(), p.axis))
        .map(|(&xv, c)| {
            let mut y = (xv - at(&m, c)) / (at(&v, c) + p.eps).sqrt();
            if p.scale {
                y *= at(&g, c);
            }
            if p.center {
                y += at(&b, c);
            }
            y
        })
        .collect();
    let out = k.t(Values::F(out).into_tensor(x.shape(), x.dtype()))?;
    Ok(OpValue::Tuple(vec![out, mean.clone(), var.clone()]))
}

/// `nn.batch_norm`'s attributes, read once.
pub(crate) struct BatchNorm {
    pub axis: usize,
    pub eps: f64,
    pub center: bool,
    pub scale: bool,
}

impl BatchNorm {
    pub(crate) fn of(k: &KCall) -> Result<BatchNorm, KernelError> {
        let c = k.rel();
        let x = k.tensor(0, "input")?;
        Ok(BatchNorm {
            axis: c.axis(c.int_or("axis", 1)?, x.rank())?,
            eps: c.opt_float("epsilon")?.unwrap_or(1e-5),
            center: c.bool_or("center", true)?,
            scale: c.bool_or("scale", true)?,
        })
    }
}
