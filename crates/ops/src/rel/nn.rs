//! Operators TVM's importers and passes write that the other groups lack: `nn.dropout`,
//! `full_like`, `reshape_like`, `broadcast_to_like`, `collapse_sum_like` (what TVM's gradients
//! emit), `sequence_mask`, `nn.prelu`, `nn.l2_normalize`, `nn.pad` and `nn.batch_norm`.

use super::{dims_match, fmt_dims, known_product, meet, Call, Tensor};
use crate::RelError;
use tumble_ir::{AttrValue, Attrs, Dim, Ty};

/// `nn.dropout(data, rate=0.5)`: Relay's tuple `(output, mask)`, both of the input's type.
/// tumble computes inference semantics (TVM's SimplifyInference): the output is the input, the
/// mask all ones.
pub fn dropout(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.dropout", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    dropout_rate(&c)?;
    Ok(Ty::Tuple(vec![x.ty.clone(), x.ty.clone()]))
}

/// `rate` in [0, 1) (TVM divides by 1 - rate when training).
pub(crate) fn dropout_rate(c: &Call) -> Result<f64, RelError> {
    let rate = c.opt_float("rate")?.unwrap_or(0.5);
    if !(0.0..1.0).contains(&rate) {
        return Err(c.err(format!("rate must be in [0, 1), found {rate}")));
    }
    Ok(rate)
}

/// `full_like(data, fill_value)`: the input's type, every element the scalar `fill_value`.
pub fn full_like(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("full_like", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let v = c.tensor(1, "fill_value")?;
    if v.rank() != 0 {
        return Err(c.err_at(1, format!("fill_value must be a scalar tensor, found {v}")));
    }
    Ok(x.ty.clone())
}

/// An attribute that indexes the axes of a rank-`rank` tensor as a slice bound: negative counts
/// from the end, `None` is `default`; in `0..=rank` after normalizing.
fn bound(c: &Call, name: &str, default: usize, rank: usize, role: &str) -> Result<usize, RelError> {
    let Some(v) = c.opt_int(name)? else {
        return Ok(default);
    };
    let r = i64::try_from(rank).unwrap_or(i64::MAX);
    let n = if v < 0 { v.saturating_add(r) } else { v };
    if !(0..=r).contains(&n) {
        return Err(c.err(format!(
            "{name}={v} is out of range for the {role} of rank {rank}"
        )));
    }
    usize::try_from(n).map_err(|_| c.err(format!("{name}={v} is out of range")))
}

/// `reshape_like(data, shape_like, lhs_begin=0, lhs_end=None, rhs_begin=0, rhs_end=None)`:
/// `data`'s axes `lhs_begin..lhs_end` replaced by `shape_like`'s axes `rhs_begin..rhs_end`
/// (the whole shapes by default); the element count must not change.
pub fn reshape_like(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("reshape_like", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let like = c.tensor(1, "shape_like")?;
    let lb = bound(&c, "lhs_begin", 0, x.rank(), "input")?;
    let le = bound(&c, "lhs_end", x.rank(), x.rank(), "input")?;
    let rb = bound(&c, "rhs_begin", 0, like.rank(), "shape_like")?;
    let re = bound(&c, "rhs_end", like.rank(), like.rank(), "shape_like")?;
    if lb > le || rb > re {
        return Err(c.err(format!(
            "empty or reversed axis ranges: lhs {lb}..{le}, rhs {rb}..{re}"
        )));
    }
    let mut shape: Vec<Dim> = x.shape.get(..lb).unwrap_or_default().to_vec();
    shape.extend_from_slice(like.shape.get(rb..re).unwrap_or_default());
    shape.extend_from_slice(x.shape.get(le..).unwrap_or_default());
    if let (Some(a), Some(b)) = (known_product(x.shape), known_product(&shape)) {
        if a != b {
            return Err(c.err(format!(
                "cannot reshape {x} ({a} elements) to {} ({b} elements)",
                fmt_dims(&shape)
            )));
        }
    }
    Ok(Ty::tensor(shape, x.dtype))
}

/// Whether `small` broadcasts to `big` (numpy's rule, aligned at the last axis; `?` may).
fn broadcasts(small: &[Dim], big: &[Dim]) -> bool {
    small.len() <= big.len()
        && small
            .iter()
            .rev()
            .zip(big.iter().rev())
            .all(|(s, b)| *s == Dim::Known(1) || dims_match(*s, *b))
}

/// `broadcast_to_like(data, broadcast_type)`: `data` broadcast (numpy's rule) to the second
/// argument's shape; as in TVM (`<A, B> -> B`) both have one dtype.
pub fn broadcast_to_like(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("broadcast_to_like", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let like = c.tensor(1, "broadcast_type")?;
    c.same_dtype(x, like)?;
    if !broadcasts(x.shape, like.shape) {
        return Err(c.err(format!(
            "cannot broadcast {x} to the shape of {like}: aligned at the last axis, each axis must \
             equal the target's or be 1"
        )));
    }
    Ok(Ty::tensor(like.shape.to_vec(), x.dtype))
}

/// `collapse_sum_like(data, collapse_type)`: `data` summed over the axes along which the second
/// argument's shape broadcasts to it (the gradient of a broadcast); as in TVM (`<A, B> -> B`)
/// both have one dtype.
pub fn collapse_sum_like(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("collapse_sum_like", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let like = c.tensor(1, "collapse_type")?;
    c.want_numeric(0, "input", x)?;
    c.same_dtype(x, like)?;
    if !broadcasts(like.shape, x.shape) {
        return Err(c.err(format!(
            "cannot collapse {x} to the shape of {like}: that shape must broadcast to the \
             input's (aligned at the last axis, each axis equal or 1)"
        )));
    }
    Ok(Ty::tensor(like.shape.to_vec(), x.dtype))
}

/// `sequence_mask(data, valid_length, mask_value=0, axis=0)`: `data` is `(L, B, …)` (axis 0) or
/// `(B, L, …)` (axis 1) and `valid_length` `(B)` integers; positions at or past a sequence's
/// length become `mask_value`.
pub fn sequence_mask(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("sequence_mask", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let len = c.tensor(1, "valid_length")?;
    c.want_numeric(0, "input", x)?;
    c.want_index(1, "valid_length", len)?;
    let axis = sequence_axis(&c)?;
    if x.rank() < 2 {
        return Err(c.err_at(
            0,
            format!("input must have rank at least 2 (length and batch axes), found {x}"),
        ));
    }
    c.opt_float("mask_value")?;
    let batch = x.shape.get(1 - axis).copied().unwrap_or(Dim::Any);
    let [b] = *len.shape else {
        return Err(c.err_at(1, format!("valid_length must be 1-D (batch), found {len}")));
    };
    if !dims_match(b, batch) {
        return Err(c.err(format!(
            "valid_length has {b} entries but the input's batch axis ({}) has {batch}",
            1 - axis
        )));
    }
    Ok(x.ty.clone())
}

/// `sequence_mask`'s `axis`: 0 or 1 (-1 is not accepted, as in TVM).
pub(crate) fn sequence_axis(c: &Call) -> Result<usize, RelError> {
    match c.int_or("axis", 0)? {
        0 => Ok(0),
        1 => Ok(1),
        a => Err(c.err(format!("axis must be 0 or 1, found {a}"))),
    }
}

/// A 1-D float argument of `n` entries and `x`'s dtype (prelu's alpha, batch_norm's vectors).
fn channel_vector(c: &Call, i: usize, role: &str, x: Tensor, n: Dim) -> Result<Dim, RelError> {
    let v = c.tensor(i, role)?;
    let [d] = *v.shape else {
        return Err(c.err_at(i, format!("{role} must be 1-D, found {v}")));
    };
    c.same_dtype(x, v)?;
    if !dims_match(d, n) {
        return Err(c.err(format!(
            "{role} has {d} entries but the input's axis has {n}"
        )));
    }
    Ok(meet(n, d))
}

/// `nn.prelu(data, alpha, axis=1)`: `x` where positive, else `alpha[c] · x` with `c` the index
/// along `axis`; `alpha` has one entry per position of that axis.
pub fn prelu(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.prelu", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    let axis = c.axis(c.int_or("axis", 1)?, x.rank())?;
    let n = x.shape.get(axis).copied().unwrap_or(Dim::Any);
    channel_vector(&c, 1, "alpha", x, n)?;
    Ok(x.ty.clone())
}

/// `nn.l2_normalize(data, eps, axis=None)`: `x / sqrt(max(Σ x², eps))`, the sum over `axis`
/// (None or an empty list: every axis).
pub fn l2_normalize(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.l2_normalize", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    l2_axes(&c, x.rank())?;
    let eps = c.req_float("eps")?;
    if eps.is_nan() || eps < 0.0 {
        return Err(c.err(format!("eps must be non-negative, found {eps}")));
    }
    Ok(x.ty.clone())
}

/// `l2_normalize`'s axes, normalized: which axes of a rank-`rank` input are summed.
pub(crate) fn l2_axes(c: &Call, rank: usize) -> Result<Vec<bool>, RelError> {
    let mut summed = vec![false; rank];
    match c.opt_ints("axis")? {
        Some(list) if !list.is_empty() => {
            for a in c.axes(&list, rank)? {
                if let Some(s) = summed.get_mut(a) {
                    *s = true;
                }
            }
        }
        _ => summed.iter_mut().for_each(|s| *s = true),
    }
    Ok(summed)
}

/// `nn.pad`'s padding mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PadMode {
    Constant,
    Edge,
    Reflect,
}

/// `nn.pad`'s `pad_width` (one `[before, after]` pair of non-negative ints per axis) and mode.
pub(crate) fn pad_spec(c: &Call, rank: usize) -> Result<(Vec<(usize, usize)>, PadMode), RelError> {
    let bad = || {
        c.err(
            "pad_width must list one [before, after] pair of non-negative integers per axis, \
             e.g. pad_width=[[0, 0], [1, 2]]",
        )
    };
    let Some(AttrValue::List(rows)) = c.raw("pad_width") else {
        return Err(match c.raw("pad_width") {
            None => c.err("missing required attribute `pad_width`"),
            Some(_) => bad(),
        });
    };
    let mut pads = Vec::with_capacity(rows.len());
    for r in rows {
        let AttrValue::List(pair) = r else {
            return Err(bad());
        };
        let [AttrValue::Int(b), AttrValue::Int(a)] = pair.as_slice() else {
            return Err(bad());
        };
        let (Ok(b), Ok(a)) = (usize::try_from(*b), usize::try_from(*a)) else {
            return Err(bad());
        };
        pads.push((b, a));
    }
    if pads.len() != rank {
        return Err(c.err(format!(
            "pad_width has {} pairs but the input has rank {rank}",
            pads.len()
        )));
    }
    let mode = match c.opt_str("pad_mode")?.unwrap_or("constant") {
        "constant" => PadMode::Constant,
        "edge" => PadMode::Edge,
        "reflect" => PadMode::Reflect,
        m => {
            return Err(c.err(format!(
                "pad_mode must be \"constant\", \"edge\" or \"reflect\", found \"{m}\""
            )))
        }
    };
    Ok((pads, mode))
}

/// `nn.pad(data, pad_value, pad_width, pad_mode="constant")` (TVM's printer writes the pad value
/// as a scalar operand; the older form gives it as the attribute `pad_value`, one argument):
/// each axis grows by its `[before, after]`; `edge` repeats the border element, `reflect`
/// mirrors without repeating it (its pads must be smaller than the axis).
pub fn pad(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let arity = if args.len() == 1 { 1 } else { 2 };
    let c = Call::new("nn.pad", args, attrs, arity)?;
    let x = c.tensor(0, "input")?;
    c.want_numeric(0, "input", x)?;
    if arity == 2 {
        let v = c.tensor(1, "pad_value")?;
        if v.rank() != 0 {
            return Err(c.err_at(1, format!("pad_value must be a scalar tensor, found {v}")));
        }
        if c.raw("pad_value").is_some() {
            return Err(c.err("the pad value is given twice: as an operand and as `pad_value`"));
        }
    } else {
        c.opt_float("pad_value")?;
    }
    let (pads, mode) = pad_spec(&c, x.rank())?;
    let mut shape = Vec::with_capacity(pads.len());
    for (axis, (d, &(b, a))) in x.shape.iter().zip(&pads).enumerate() {
        let (bi, ai) = (i64::try_from(b), i64::try_from(a));
        let (Ok(bi), Ok(ai)) = (bi, ai) else {
            return Err(c.err("pad_width is too large"));
        };
        shape.push(match d.known() {
            Some(n) => {
                if mode == PadMode::Reflect && (bi >= n || ai >= n) && (bi > 0 || ai > 0) {
                    return Err(c.err(format!(
                        "reflect pads of axis {axis} must be smaller than its size {n}, found [{b}, {a}]"
                    )));
                }
                if mode == PadMode::Edge && n == 0 && (bi > 0 || ai > 0) {
                    return Err(c.err(format!("edge padding of the empty axis {axis}")));
                }
                Dim::Known(
                    n.checked_add(bi)
                        .and_then(|s| s.checked_add(ai))
                        .ok_or_else(|| c.err("pad_width is too large"))?,
                )
            }
            None => Dim::Any,
        });
    }
    Ok(Ty::tensor(shape, x.dtype))
}

/// `nn.batch_norm(data, gamma, beta, moving_mean, moving_var, axis=1, epsilon=1e-5, center=True,
/// scale=True)`: Relay's 3-tuple `(output, mean, var)`; tumble computes inference semantics (the
/// moving statistics normalize; they are returned as given).
pub fn batch_norm(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.batch_norm", args, attrs, 5)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    let axis = c.axis(c.int_or("axis", 1)?, x.rank())?;
    let eps = c.opt_float("epsilon")?.unwrap_or(1e-5);
    if eps.is_nan() || eps < 0.0 {
        return Err(c.err(format!("epsilon must be non-negative, found {eps}")));
    }
    c.bool_or("center", true)?;
    c.bool_or("scale", true)?;
    let mut n = x.shape.get(axis).copied().unwrap_or(Dim::Any);
    for (i, role) in [
        (1, "gamma"),
        (2, "beta"),
        (3, "moving_mean"),
        (4, "moving_var"),
    ] {
        n = channel_vector(&c, i, role, x, n)?;
    }
    let v = Ty::tensor(vec![n], x.dtype);
    Ok(Ty::Tuple(vec![x.ty.clone(), v.clone(), v]))
}
