//! Operators that move data without arithmetic: `concatenate`, `stack`, `split`, `reshape`,
//! `transpose`, `expand_dims`, `squeeze`, `take`, `strided_slice`, `broadcast_to`, `reverse`,
//! `tile`, `repeat`, `nn.batch_flatten`, `gather`, `gather_nd`.

use super::{dims_match, fmt_dims, fmt_ints, known_product, meet, Call, Tensor};
use crate::RelError;
use tumble_ir::{AttrValue, Attrs, Dim, Ty};

/// The tensors of the tuple that is argument 0 (`concatenate`'s and `stack`'s input).
fn tuple_parts<'a>(c: &Call<'a>) -> Result<Vec<Tensor<'a>>, RelError> {
    let fields = match c.arg(0)? {
        Ty::Tuple(fs) => fs,
        other => {
            return Err(c.err_at(
                0,
                format!("input must be a tuple of tensors, found {other}"),
            ))
        }
    };
    fields
        .iter()
        .enumerate()
        .map(|(k, f)| {
            c.as_tensor(f, &format!("field {k} of the input tuple"))
                .map_err(|m| c.err_at(0, m))
        })
        .collect()
}

/// `concatenate(data, axis=0)`: `data` is a tuple of tensors joined along `axis`.
pub fn concatenate(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("concatenate", args, attrs, 1)?;
    let parts = tuple_parts(&c)?;
    let Some(&first) = parts.first() else {
        return Err(c.err_at(0, "input must be a non-empty tuple of tensors, found ()"));
    };
    let rank = first.rank();
    let axis = c.axis(c.int_or("axis", 0)?, rank)?;
    let mut shape = first.shape.to_vec();
    let mut total = Some(0i64);
    for (k, t) in parts.iter().enumerate() {
        if t.rank() != rank {
            return Err(c.err_at(
                0,
                format!(
                    "all fields must have the same rank: field 0 is {first} (rank {rank}) but field {k} is {t} (rank {})",
                    t.rank()
                ),
            ));
        }
        if t.dtype != first.dtype {
            return Err(c.err_at(
                0,
                format!(
                    "dtype mismatch: field 0 is {} but field {k} is {}",
                    first.dtype, t.dtype
                ),
            ));
        }
        for (i, (slot, &d)) in shape.iter_mut().zip(t.shape).enumerate() {
            if i == axis {
                continue;
            }
            if !dims_match(*slot, d) {
                return Err(c.err_at(
                    0,
                    format!(
                        "field {k} is {t} but earlier fields have {} along axis {i} (only axis {axis} may differ)",
                        *slot
                    ),
                ));
            }
            *slot = meet(*slot, d);
        }
        let d = t.shape.get(axis).copied().unwrap_or(Dim::Any);
        total =
            match (total, d) {
                (Some(s), Dim::Known(n)) => Some(s.checked_add(n).ok_or_else(|| {
                    c.err(format!("the result's size along axis {axis} overflows"))
                })?),
                _ => None,
            };
    }
    if let Some(slot) = shape.get_mut(axis) {
        *slot = total.map_or(Dim::Any, Dim::Known);
    }
    Ok(Ty::tensor(shape, first.dtype))
}

/// `broadcast_to(data, shape)`: `data` repeated along its size-1 and missing leading axes to
/// `shape` (numpy's rule: aligned at the last axis, each axis equal or 1).
pub fn broadcast_to(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("broadcast_to", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let shape = c.req_ints("shape")?;
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(c.err(format!(
            "shape {} contains the negative size {d}",
            fmt_ints(&shape)
        )));
    }
    let fits = x.rank() <= shape.len()
        && x.shape
            .iter()
            .rev()
            .zip(shape.iter().rev())
            .all(|(d, &s)| match d {
                Dim::Known(n) => *n == s || *n == 1,
                Dim::Any => true,
            });
    if !fits {
        return Err(c.err(format!(
            "cannot broadcast {x} to shape {}: aligned at the last axis, each axis must equal \
             the target's or be 1",
            fmt_ints(&shape)
        )));
    }
    Ok(Ty::tensor_of(&shape, x.dtype))
}

/// `stack(data, axis=0)`: `data` is a non-empty tuple of tensors of one shape and dtype, joined
/// along a new axis `axis` (from `-(rank + 1)` to `rank`) of length the tuple's.
pub fn stack(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("stack", args, attrs, 1)?;
    let parts = tuple_parts(&c)?;
    let Some(&first) = parts.first() else {
        return Err(c.err_at(0, "input must be a non-empty tuple of tensors, found ()"));
    };
    let rank = first.rank();
    let mut shape = first.shape.to_vec();
    for (k, t) in parts.iter().enumerate() {
        if t.dtype != first.dtype {
            return Err(c.err_at(
                0,
                format!(
                    "dtype mismatch: field 0 is {} but field {k} is {}",
                    first.dtype, t.dtype
                ),
            ));
        }
        let same = t.rank() == rank && shape.iter().zip(t.shape).all(|(&a, &b)| dims_match(a, b));
        if !same {
            return Err(c.err_at(
                0,
                format!("all fields must have one shape: field 0 is {first} but field {k} is {t}"),
            ));
        }
        for (slot, &d) in shape.iter_mut().zip(t.shape) {
            *slot = meet(*slot, d);
        }
    }
    let axis = c.int_or("axis", 0)?;
    let at = super::normalize_axis(axis, rank + 1).ok_or_else(|| {
        c.err(format!(
            "axis {axis} is out of range for stacking tensors of rank {rank} (allowed: {}..={rank})",
            -(rank as i64) - 1
        ))
    })?;
    shape.insert(at, Dim::Known(parts.len() as i64));
    Ok(Ty::tensor(shape, first.dtype))
}

/// `split(data, indices_or_sections, axis=0)`: an integer N cuts `axis` into N equal sections; a
/// list of strictly ascending indices cuts before each index. The result is a tuple.
pub fn split(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("split", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let axis = c.axis(c.int_or("axis", 0)?, x.rank())?;
    let d = x.shape.get(axis).copied().unwrap_or(Dim::Any);
    let piece = |len: Dim| {
        let mut s = x.shape.to_vec();
        if let Some(slot) = s.get_mut(axis) {
            *slot = len;
        }
        Ty::tensor(s, x.dtype)
    };
    let mut out = Vec::new();
    match c.raw("indices_or_sections") {
        None => {
            return Err(c.err("missing required attribute `indices_or_sections`"));
        }
        Some(AttrValue::Int(n)) => {
            let n = *n;
            if n <= 0 {
                return Err(c.err(format!(
                    "indices_or_sections must be a positive number of sections, found {n}"
                )));
            }
            if n > 1 << 20 {
                return Err(c.err(format!("{n} sections is too many")));
            }
            let len = match d {
                Dim::Known(len) => {
                    if len % n != 0 {
                        return Err(c.err(format!(
                            "cannot split dimension {len} (axis {axis}) into {n} equal sections"
                        )));
                    }
                    Dim::Known(len / n)
                }
                Dim::Any => Dim::Any,
            };
            out.extend((0..n).map(|_| piece(len)));
        }
        Some(AttrValue::List(_)) => {
            let idx = c.req_ints("indices_or_sections")?;
            let mut begin = 0i64;
            for &i in &idx {
                if i <= begin {
                    return Err(c.err(format!(
                        "indices_or_sections must be strictly ascending positive indices, found {}",
                        fmt_ints(&idx)
                    )));
                }
                if let Dim::Known(len) = d {
                    if i >= len {
                        return Err(c.err(format!(
                            "split index {i} is out of range for dimension {len} (axis {axis})"
                        )));
                    }
                }
                out.push(piece(Dim::Known(i - begin)));
                begin = i;
            }
            out.push(piece(match d {
                Dim::Known(len) => Dim::Known(len - begin),
                Dim::Any => Dim::Any,
            }));
        }
        Some(v) => {
            return Err(c.err(format!(
            "attribute `indices_or_sections` must be an integer or a list of integers, found {}",
            v.kind_name()
        )))
        }
    }
    Ok(Ty::Tuple(out))
}

/// `reshape(data, newshape, allowzero=False)` with Relay's special values: `0` copies the input dim
/// at that position, `-1` infers one dim, `-2` copies all remaining input dims, `-3` merges the next
/// two input dims, `-4` splits the next input dim into the two values that follow (one may be -1).
pub fn reshape(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("reshape", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let newshape = c.req_ints("newshape")?;
    let allowzero = c.bool_or("allowzero", false)?;
    let ns = fmt_ints(&newshape);
    let src_dim = |src: usize, what: &str| {
        x.shape.get(src).copied().ok_or_else(|| {
            c.err(format!(
                "{what} in newshape {ns} refers to input dimension {src}, but the input {x} has rank {}",
                x.rank()
            ))
        })
    };
    let mut out: Vec<Dim> = Vec::with_capacity(newshape.len());
    let mut infer: Option<usize> = None;
    let mut src = 0usize;
    let mut copied_any = 0usize;
    let mut it = newshape.iter().copied();
    while let Some(v) = it.next() {
        match v {
            v if v > 0 || (v == 0 && allowzero) => {
                out.push(Dim::Known(v));
                src += 1;
            }
            0 => {
                let d = src_dim(src, "0")?;
                copied_any += usize::from(d == Dim::Any);
                out.push(d);
                src += 1;
            }
            -1 => {
                if infer.is_some() {
                    return Err(c.err(format!(
                        "newshape {ns} has more than one -1 (only one dimension can be inferred)"
                    )));
                }
                infer = Some(out.len());
                out.push(Dim::Known(1));
                src += 1;
            }
            -2 => {
                let rest = x.shape.get(src..).unwrap_or_default();
                copied_any += rest.iter().filter(|d| **d == Dim::Any).count();
                out.extend(rest);
                src = src.max(x.rank());
            }
            -3 => {
                let a = src_dim(src, "-3")?;
                let b = src_dim(src + 1, "-3")?;
                out.push(match (a, b) {
                    (Dim::Known(p), Dim::Known(q)) => Dim::Known(
                        p.checked_mul(q)
                            .ok_or_else(|| c.err("the merged dimension overflows"))?,
                    ),
                    _ => Dim::Any,
                });
                src += 2;
            }
            -4 => {
                let d = src_dim(src, "-4")?;
                src += 1;
                let (Some(p), Some(q)) = (it.next(), it.next()) else {
                    return Err(c.err(format!(
                        "-4 in newshape {ns} must be followed by two values"
                    )));
                };
                let (p, q) = match (p, q, d) {
                    (-1, -1, _) => {
                        return Err(c.err(format!(
                            "-4 in newshape {ns} is followed by two -1s (only one can be inferred)"
                        )))
                    }
                    (a, b, _) if a < -1 || b < -1 || a == 0 || b == 0 => {
                        return Err(c.err(format!(
                            "-4 in newshape {ns} must be followed by positive values or one -1, found {a} and {b}"
                        )))
                    }
                    (-1, b, Dim::Known(n)) => (div_exact(&c, n, b, &ns)?, Dim::Known(b)),
                    (a, -1, Dim::Known(n)) => (Dim::Known(a), div_exact(&c, n, a, &ns)?),
                    (-1, b, Dim::Any) => (Dim::Any, Dim::Known(b)),
                    (a, -1, Dim::Any) => (Dim::Known(a), Dim::Any),
                    (a, b, d) => {
                        if let Dim::Known(n) = d {
                            if a.checked_mul(b) != Some(n) {
                                return Err(c.err(format!(
                                    "-4 in newshape {ns} splits dimension {n} into {a} × {b}"
                                )));
                            }
                        }
                        (Dim::Known(a), Dim::Known(b))
                    }
                };
                out.push(p);
                out.push(q);
            }
            v => {
                return Err(c.err(format!(
                    "newshape {ns} contains {v}; allowed are positive sizes, 0, -1, -2, -3 and -4"
                )))
            }
        }
    }
    // The `?` dims of the input that were copied verbatim (by 0 or -2) cancel against the same `?`
    // in the output; when that accounts for every `?` on both sides, the known parts must agree
    // exactly, and -1 can still be inferred.
    let any_in = x.shape.iter().filter(|d| **d == Dim::Any).count();
    let any_out = out.iter().filter(|d| **d == Dim::Any).count();
    let cancel = copied_any == any_in && any_out == copied_any;
    let what = |n: i64| {
        if any_in == 0 {
            format!("{n} elements")
        } else {
            format!("{n} elements besides its ? dims")
        }
    };
    if let Some(k) = infer {
        let inferred = match (cancel, partial_product(x.shape), partial_product(&out)) {
            (true, Some(total), Some(rest)) => {
                if rest == 0 {
                    return Err(c.err(format!(
                        "cannot infer the -1 in newshape {ns} for {x}: the other dimensions have 0 elements"
                    )));
                }
                if total % rest != 0 {
                    return Err(c.err(format!(
                        "cannot reshape {x} ({}) to newshape {ns}: {total} is not a multiple of {rest}",
                        what(total)
                    )));
                }
                Dim::Known(total / rest)
            }
            _ => Dim::Any,
        };
        if let Some(slot) = out.get_mut(k) {
            *slot = inferred;
        }
    }
    let (in_part, out_part) = (partial_product(x.shape), partial_product(&out));
    // No tensor has that many elements (and the checks below could not compare the counts).
    if in_part.is_some() && out_part.is_none() {
        return Err(c.err(format!(
            "cannot reshape {x} to {}: that shape has more than 2^63 elements",
            fmt_dims(&out)
        )));
    }
    // With cancelled `?` dims the known parts need not agree: a `?` may be 0 at run time, and then
    // both sides are empty. (Inferring -1 above is still exact: with a zero `?` the call fails.)
    if cancel && any_in == 0 {
        if let (Some(a), Some(b)) = (in_part, out_part) {
            if a != b {
                return Err(c.err(format!(
                    "cannot reshape {x} ({}) to {} ({})",
                    what(a),
                    fmt_dims(&out),
                    what(b)
                )));
            }
        }
    } else if !cancel {
        // With unmatched `?` dims, a fully known side must still be a multiple of the other's
        // known part.
        let check = match (known_product(x.shape), known_product(&out)) {
            (Some(total), None) => out_part.map(|p| (total, p)),
            (None, Some(total)) => in_part.map(|p| (total, p)),
            _ => None,
        };
        if let Some((total, p)) = check {
            if p != 0 && total % p != 0 {
                return Err(c.err(format!(
                    "cannot reshape {x} to {}: element counts cannot agree ({total} is not a multiple of {p})",
                    fmt_dims(&out)
                )));
            }
        }
    }
    Ok(Ty::tensor(out, x.dtype))
}

/// Product of the known dims (ignoring `?`), if it doesn't overflow.
fn partial_product(dims: &[Dim]) -> Option<i64> {
    dims.iter()
        .filter_map(|d| d.known())
        .try_fold(1i64, |acc, n| acc.checked_mul(n))
}

fn div_exact(c: &Call, n: i64, by: i64, ns: &str) -> Result<Dim, RelError> {
    if by > 0 && n % by == 0 {
        Ok(Dim::Known(n / by))
    } else {
        Err(c.err(format!(
            "-4 in newshape {ns} cannot split dimension {n} by {by}"
        )))
    }
}

/// `transpose(data, axes=None)`: permutes the axes; None reverses them.
pub fn transpose(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("transpose", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let perm = transpose_perm(&c, x)?;
    let shape = perm
        .iter()
        .map(|&i| x.shape.get(i).copied().unwrap_or(Dim::Any))
        .collect::<Vec<_>>();
    Ok(Ty::tensor(shape, x.dtype))
}

/// The permutation a `transpose` call applies: output axis `i` is input axis `perm[i]`.
pub(crate) fn transpose_perm(c: &Call, x: Tensor) -> Result<Vec<usize>, RelError> {
    let rank = x.rank();
    let perm: Vec<usize> = match c.opt_ints("axes")? {
        None => (0..rank).rev().collect(),
        Some(axes) if axes.is_empty() => (0..rank).rev().collect(),
        Some(axes) => {
            let not_perm = || {
                c.err(format!(
                    "axes {} is not a permutation of the {rank} axes of {x}",
                    fmt_ints(&axes)
                ))
            };
            if axes.len() != rank {
                return Err(not_perm());
            }
            let mut seen = vec![false; rank];
            let mut perm = Vec::with_capacity(rank);
            for &a in &axes {
                let n = super::normalize_axis(a, rank).ok_or_else(not_perm)?;
                match seen.get_mut(n) {
                    Some(s) if !*s => *s = true,
                    _ => return Err(not_perm()),
                }
                perm.push(n);
            }
            perm
        }
    };
    Ok(perm)
}

/// `expand_dims(data, axis, num_newaxis=1)`: inserts size-1 axes at `axis` (in `[-rank-1, rank]`).
pub fn expand_dims(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("expand_dims", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let axis = c
        .opt_int("axis")?
        .ok_or_else(|| c.err("missing required attribute `axis`"))?;
    let num = c.int_or("num_newaxis", 1)?;
    if !(0..=1 << 16).contains(&num) {
        return Err(c.err(format!(
            "num_newaxis must be between 0 and {} (the new axes of one call), found {num}",
            1 << 16
        )));
    }
    let at = super::normalize_axis(axis, x.rank() + 1).ok_or_else(|| {
        c.err(format!(
            "axis {axis} is out of range for inserting into a tensor of rank {} (allowed: {}..={})",
            x.rank(),
            -(x.rank() as i64) - 1,
            x.rank()
        ))
    })?;
    let mut shape = x.shape.to_vec();
    shape.splice(at..at, std::iter::repeat_n(Dim::Known(1), num as usize));
    Ok(Ty::tensor(shape, x.dtype))
}

/// `squeeze(data, axis=None)`: removes size-1 axes; None removes every size-1 axis (refused when
/// a size is `?`: the result's rank would depend on it), a list
/// removes exactly those (each must be 1 when known).
pub fn squeeze(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("squeeze", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let shape: Vec<Dim> = match c.opt_ints("axis")? {
        // Which axes go would depend on the `?` sizes at run time: the result's rank would not
        // be the checked type's (a `(?, 1)` of one row squeezes to a scalar, typed `(?)`).
        None if x.shape.iter().any(|d| d.known().is_none()) => {
            return Err(c.err(format!(
                "squeeze without `axis` of {x}: whether its `?` axes are removed depends on \
                 their sizes when the program runs; give the axes to remove, e.g. `axis=[{}]`",
                x.shape
                    .iter()
                    .enumerate()
                    .filter(|(_, &d)| d == Dim::Known(1))
                    .map(|(i, _)| i.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
        None => x
            .shape
            .iter()
            .copied()
            .filter(|&d| d != Dim::Known(1))
            .collect(),
        Some(list) => {
            let axes = c.axes(&list, x.rank())?;
            for &a in &axes {
                if let Some(Dim::Known(n)) = x.shape.get(a) {
                    if *n != 1 {
                        return Err(c.err(format!(
                            "cannot squeeze axis {a} of {x}: its size is {n}, not 1"
                        )));
                    }
                }
            }
            x.shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        }
    };
    Ok(Ty::tensor(shape, x.dtype))
}

/// `take(data, indices, axis=None, batch_dims=0, mode="clip")`: gathers along `axis` (None: from the
/// flattened data). Result shape: data.shape[:axis] + indices.shape[batch_dims:] + data.shape[axis+1:].
pub fn take(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("take", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let idx = c.tensor(1, "indices")?;
    let spec = take_spec(&c, x, idx)?;
    let Some((axis, bd)) = spec.axis else {
        return Ok(Ty::tensor(idx.shape.to_vec(), x.dtype));
    };
    for i in 0..bd {
        let (Some(&a), Some(&b)) = (x.shape.get(i), idx.shape.get(i)) else {
            break;
        };
        if !dims_match(a, b) {
            return Err(c.err(format!(
                "batch dimension {i} differs: input has {a} but indices have {b}"
            )));
        }
    }
    let mut shape = Vec::new();
    shape.extend(x.shape.iter().take(axis));
    shape.extend(idx.shape.iter().skip(bd));
    shape.extend(x.shape.iter().skip(axis + 1));
    Ok(Ty::tensor(shape, x.dtype))
}

/// How `take` treats indices outside `[0, n)` of the axis it gathers from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TakeMode {
    /// Clamp into `[0, n - 1]` (the default).
    Clip,
    /// Python modulo: `-1` is `n - 1`, `n` is `0`.
    Wrap,
    /// No adjustment: an index outside `[-n, n)` is an error at run time.
    Fast,
}

/// A `take` call's attributes, checked and resolved: the mode, and `Some((axis, batch_dims))`
/// (both normalized) when an axis is given (`None`: gather from the flattened input).
pub(crate) struct TakeSpec {
    pub mode: TakeMode,
    pub axis: Option<(usize, usize)>,
}

pub(crate) fn take_spec(c: &Call, x: Tensor, idx: Tensor) -> Result<TakeSpec, RelError> {
    c.want_index(1, "indices", idx)?;
    let mode = match c.opt_str("mode")? {
        None | Some("clip") => TakeMode::Clip,
        Some("wrap") => TakeMode::Wrap,
        Some("fast") => TakeMode::Fast,
        Some(m) => {
            return Err(c.err(format!(
                "mode must be \"clip\", \"wrap\" or \"fast\", found \"{m}\""
            )))
        }
    };
    let batch_dims = c.int_or("batch_dims", 0)?;
    let Some(axis) = c.opt_int("axis")? else {
        if batch_dims != 0 {
            return Err(c.err(format!(
                "batch_dims={batch_dims} needs an axis (without one, data is flattened)"
            )));
        }
        return Ok(TakeSpec { mode, axis: None });
    };
    let axis = c.axis(axis, x.rank())?;
    let bd = if batch_dims < 0 {
        super::normalize_axis(batch_dims, idx.rank())
    } else {
        usize::try_from(batch_dims)
            .ok()
            .filter(|&b| b <= idx.rank())
    }
    .ok_or_else(|| {
        c.err(format!(
            "batch_dims {batch_dims} is out of range for indices of rank {}",
            idx.rank()
        ))
    })?;
    if bd > axis {
        return Err(c.err(format!("batch_dims ({bd}) must not exceed axis ({axis})")));
    }
    Ok(TakeSpec {
        mode,
        axis: Some((axis, bd)),
    })
}

/// `strided_slice(data, begin, end, strides=None, axes=None, slice_mode="end")`: Python slice
/// semantics per axis (negative indices count from the end, out-of-range bounds clamp, negative
/// strides walk backwards). With `slice_mode="size"`, `end` holds sizes (-1: to the end) and strides
/// are ignored. Without `axes`, entries apply to the leading axes and the rest are kept whole.
pub fn strided_slice(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("strided_slice", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let spec = slice_spec(&c, x)?;
    let mut shape = x.shape.to_vec();
    for s in &spec.axes {
        let Some(slot) = shape.get_mut(s.axis) else {
            continue;
        };
        let Dim::Known(d) = *slot else {
            continue;
        };
        *slot = Dim::Known(slice_range(d, s.begin, s.end, s.stride, spec.size_mode).2);
    }
    Ok(Ty::tensor(shape, x.dtype))
}

/// One sliced axis of a `strided_slice` call, attributes resolved (`begin`/`end` are `None` when
/// the lists are too short: open bounds).
pub(crate) struct SliceAxis {
    pub axis: usize,
    pub begin: Option<i64>,
    pub end: Option<i64>,
    pub stride: i64,
}

/// A `strided_slice` call's attributes, checked and resolved per axis; shared by the relation and
/// the kernel so they cannot disagree.
pub(crate) struct SliceSpec {
    pub axes: Vec<SliceAxis>,
    /// `slice_mode="size"`: `end` holds sizes and strides are 1.
    pub size_mode: bool,
}

pub(crate) fn slice_spec(c: &Call, x: Tensor) -> Result<SliceSpec, RelError> {
    let rank = x.rank();
    let begin = c.req_ints("begin")?;
    let end = c.req_ints("end")?;
    let strides = c.opt_ints("strides")?.unwrap_or_default();
    let size_mode = match c.opt_str("slice_mode")? {
        None | Some("end") => false,
        Some("size") => true,
        Some(m) => {
            return Err(c.err(format!(
                "slice_mode must be \"end\" or \"size\", found \"{m}\""
            )))
        }
    };
    let axes: Vec<usize> = match c.opt_ints("axes")? {
        Some(list) => {
            let axes = c.axes(&list, rank)?;
            if begin.len() != axes.len() || end.len() != axes.len() {
                return Err(c.err(format!(
                    "begin {} and end {} must each have one entry per axis in axes {}",
                    fmt_ints(&begin),
                    fmt_ints(&end),
                    fmt_ints(&list)
                )));
            }
            axes
        }
        None => {
            let n = begin.len().max(end.len());
            if n > rank {
                return Err(c.err(format!(
                    "begin {} / end {} have more entries than the {rank} axes of {x}",
                    fmt_ints(&begin),
                    fmt_ints(&end)
                )));
            }
            (0..n).collect()
        }
    };
    if strides.len() > 1 && strides.len() > axes.len() {
        return Err(c.err(format!(
            "strides {} has more entries than the {} sliced axes",
            fmt_ints(&strides),
            axes.len()
        )));
    }
    let mut out = Vec::with_capacity(axes.len());
    for (k, &axis) in axes.iter().enumerate() {
        // Relay pads a short `strides` with 1 (`StridedSliceRel`): a one-entry list is the first
        // axis's stride, not every axis's.
        let stride = if size_mode {
            1
        } else {
            strides.get(k).copied().unwrap_or(1)
        };
        if stride == 0 {
            return Err(c.err(format!("stride along axis {axis} is 0")));
        }
        out.push(SliceAxis {
            axis,
            begin: begin.get(k).copied(),
            end: end.get(k).copied(),
            stride,
        });
    }
    Ok(SliceSpec {
        axes: out,
        size_mode,
    })
}

/// The rows `[start, start + len)` of a tensor of shape `shape` that `strided_slice` with `attrs`
/// selects, when it selects whole rows: step 1 along axis 0 and every other axis kept whole
/// (`strided_slice(%x, begin=[0, 0], end=[1, 768])`, a sequence's first token). `None` for any
/// other slice (axes listed, sizes, strides, a narrowed inner axis) and for attributes the
/// relation would refuse: the caller then runs the operator. The range is the relation's and the
/// kernel's (`slice_range`), so a result built from it is the operator's.
pub fn leading_rows(attrs: &Attrs, shape: &[usize]) -> Option<(usize, usize)> {
    let begin = attrs.ints("begin").ok()??;
    let end = attrs.ints("end").ok()??;
    let strides = attrs.ints("strides").ok()?.unwrap_or_default();
    if attrs.get("axes").is_some()
        || !matches!(attrs.str("slice_mode").ok()?, None | Some("end"))
        || strides.iter().any(|&s| s != 1)
        || begin.is_empty()
        || begin.len().max(end.len()) > shape.len()
    {
        return None;
    }
    for (axis, &d) in shape.iter().enumerate().skip(1) {
        let d = i64::try_from(d).ok()?;
        let (start, _, len) = slice_range(
            d,
            begin.get(axis).copied(),
            end.get(axis).copied(),
            1,
            false,
        );
        if start != 0 || len != d {
            return None;
        }
    }
    let d = i64::try_from(*shape.first()?).ok()?;
    let (start, _, len) = slice_range(d, begin.first().copied(), end.first().copied(), 1, false);
    Some((usize::try_from(start).ok()?, usize::try_from(len).ok()?))
}

/// Whether `take` with `attrs` takes whole rows: along axis 0, no batch dims, indices clipped to
/// the rows (`mode="clip"`, the default) — what executors copy rows by directly.
pub fn takes_rows(attrs: &Attrs) -> bool {
    attrs.int("axis").ok().flatten() == Some(0)
        && attrs.int("batch_dims").ok().flatten().unwrap_or(0) == 0
        && attrs.str("mode").ok().flatten().unwrap_or("clip") == "clip"
}

/// Per axis of a tensor of shape `shape`, the positions `strided_slice` with `attrs` selects, as
/// `(start, step, len)` (`slice_range`'s; an axis not sliced is `(0, 1, d)`): the kernel's and
/// the relation's selection, for executors that copy the slice their own way. `None` for
/// attributes the relation would refuse (the caller then runs the operator, which reports them).
pub fn slice_plan(attrs: &Attrs, shape: &[usize]) -> Option<Vec<(i64, i64, i64)>> {
    let rank = shape.len();
    let begin = attrs.ints("begin").ok()??;
    let end = attrs.ints("end").ok()??;
    let strides = attrs.ints("strides").ok()?.unwrap_or_default();
    let size_mode = match attrs.str("slice_mode").ok()? {
        None | Some("end") => false,
        Some("size") => true,
        Some(_) => return None,
    };
    let axes: Vec<usize> = match attrs.get("axes") {
        None | Some(tumble_ir::AttrValue::None) => (0..begin.len().max(end.len())).collect(),
        Some(_) => {
            let list = attrs.ints("axes").ok()??;
            let axes = list
                .iter()
                .map(|&a| {
                    let a = if a < 0 { a + rank as i64 } else { a };
                    usize::try_from(a).ok().filter(|&a| a < rank)
                })
                .collect::<Option<Vec<_>>>()?;
            if begin.len() != axes.len() || end.len() != axes.len() {
                return None;
            }
            axes
        }
    };
    if axes.len() > rank || (strides.len() > 1 && strides.len() > axes.len()) {
        return None;
    }
    let mut plan: Vec<(i64, i64, i64)> = shape
        .iter()
        .map(|&d| Some((0, 1, i64::try_from(d).ok()?)))
        .collect::<Option<_>>()?;
    for (k, &axis) in axes.iter().enumerate() {
        let stride = if size_mode {
            1
        } else {
            strides.get(k).copied().unwrap_or(1)
        };
        if stride == 0 {
            return None;
        }
        let d = i64::try_from(*shape.get(axis)?).ok()?;
        *plan.get_mut(axis)? = slice_range(
            d,
            begin.get(k).copied(),
            end.get(k).copied(),
            stride,
            size_mode,
        );
    }
    Some(plan)
}

/// `range(d)[begin:end:stride]` (Python semantics; `None` bounds are open) as `(start, step, len)`:
/// the selected positions are `start + i * step` for `i` in `0..len`. With `size_mode`, the range
/// is `[begin, begin + size)` clamped (size -1 or absent: to the end), step 1. When `len > 0`,
/// every selected position is in `[0, d)`.
pub(crate) fn slice_range(
    d: i64,
    begin: Option<i64>,
    end: Option<i64>,
    stride: i64,
    size_mode: bool,
) -> (i64, i64, i64) {
    let d = i128::from(d);
    let s = i128::from(stride);
    let norm = |v: i64| {
        let v = i128::from(v);
        if v < 0 {
            v + d
        } else {
            v
        }
    };
    let (start, step, len) = if size_mode {
        let b = begin.map_or(0, norm).clamp(0, d);
        let e = match end {
            Some(size) if size >= 0 => (b + i128::from(size)).min(d),
            _ => d,
        };
        (b, 1, (e - b).max(0))
    } else if s > 0 {
        let b = begin.map_or(0, norm).clamp(0, d);
        let e = end.map_or(d, norm).clamp(0, d);
        (b, s, if e > b { (e - b + s - 1) / s } else { 0 })
    } else {
        let b = begin.map_or(d - 1, norm).clamp(-1, d - 1);
        let e = end.map_or(-1, norm).clamp(-1, d - 1);
        let step = -s;
        (b, s, if b > e { (b - e + step - 1) / step } else { 0 })
    };
    let cvt = |v: i128| i64::try_from(v).unwrap_or(0);
    // An empty slice has no positions; report start 0 so callers never see -1.
    if len == 0 {
        (0, cvt(step), 0)
    } else {
        (cvt(start), cvt(step), cvt(len))
    }
}

/// `reverse(data, axis)`: the same type; `axis` must name one of its axes.
pub fn reverse(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("reverse", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let axis = c
        .opt_int("axis")?
        .ok_or_else(|| c.err("missing required attribute `axis`"))?;
    c.axis(axis, x.rank())?;
    Ok(x.ty.clone())
}

/// `tile(data, reps)`: numpy's `tile`. The shorter of the input's shape and `reps` is padded with
/// leading 1s; each axis is multiplied by its repetition, which must be positive (Relay's rule).
pub fn tile(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("tile", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let (shape, reps) = tile_plan(&c, x)?;
    let out = shape
        .iter()
        .zip(&reps)
        .map(|(&d, &r)| match d {
            Dim::Known(n) => n
                .checked_mul(r)
                .map(Dim::Known)
                .ok_or_else(|| c.err(format!("the result's dimension {n} × {r} overflows"))),
            Dim::Any => Ok(Dim::Any),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Ty::tensor(out, x.dtype))
}

/// The input's shape and `reps`, both padded with leading 1s to the result's rank.
pub(crate) fn tile_plan(c: &Call, x: Tensor) -> Result<(Vec<Dim>, Vec<i64>), RelError> {
    let reps = c.req_ints("reps")?;
    if let Some(r) = reps.iter().find(|&&r| r <= 0) {
        return Err(c.err(format!(
            "reps {} must be positive, found {r}",
            fmt_ints(&reps)
        )));
    }
    let rank = x.rank().max(reps.len());
    let mut shape = vec![Dim::Known(1); rank - x.rank()];
    shape.extend(x.shape.iter().copied());
    let mut padded = vec![1; rank - reps.len()];
    padded.extend(reps.iter().copied());
    Ok((shape, padded))
}

/// `repeat(data, repeats, axis)`: each element repeated `repeats` (at least 1) times along
/// `axis`, consecutively (numpy's `repeat` with one count).
pub fn repeat(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("repeat", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let (repeats, axis) = repeat_spec(&c, x)?;
    let mut shape = x.shape.to_vec();
    if let Some(slot) = shape.get_mut(axis) {
        if let Dim::Known(n) = *slot {
            *slot = Dim::Known(n.checked_mul(repeats).ok_or_else(|| {
                c.err(format!(
                    "the result's dimension {n} × {repeats} along axis {axis} overflows"
                ))
            })?);
        }
    }
    Ok(Ty::tensor(shape, x.dtype))
}

/// A `repeat` call's count and normalized axis.
pub(crate) fn repeat_spec(c: &Call, x: Tensor) -> Result<(i64, usize), RelError> {
    let repeats = c
        .opt_int("repeats")?
        .ok_or_else(|| c.err("missing required attribute `repeats`"))?;
    if repeats < 1 {
        return Err(c.err(format!("repeats must be at least 1, found {repeats}")));
    }
    let axis = c
        .opt_int("axis")?
        .ok_or_else(|| c.err("missing required attribute `axis`"))?;
    Ok((repeats, c.axis(axis, x.rank())?))
}

/// `nn.batch_flatten(data)`: `(d0, d1 × d2 × …)`; rank at least 1 (a rank-1 input gives
/// `(d0, 1)`); the product is `?` when any of its factors is.
pub fn batch_flatten(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.batch_flatten", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let Some((&first, rest)) = x.shape.split_first() else {
        return Err(c.err_at(0, format!("input must have rank 1 or more, found {x}")));
    };
    let rest = match known_product(rest) {
        Some(n) => Dim::Known(n),
        None if rest.iter().all(|d| d.known().is_some()) => {
            return Err(c.err(format!("the flattened size of {x} overflows")))
        }
        None => Dim::Any,
    };
    Ok(Ty::tensor(vec![first, rest], x.dtype))
}

/// `gather(data, indices, axis)`: Relay's (PyTorch's `gather`): `indices` has the input's rank and
/// gives the result's shape; `out[i, j, k] = data[i, indices[i, j, k], k]` for `axis=1`. Along
/// the other axes `indices` may be shorter than the input, not longer.
pub fn gather(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("gather", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let idx = c.tensor(1, "indices")?;
    c.want_index(1, "indices", idx)?;
    let axis = c
        .opt_int("axis")?
        .ok_or_else(|| c.err("missing required attribute `axis`"))?;
    let axis = c.axis(axis, x.rank())?;
    if idx.rank() != x.rank() {
        return Err(c.err(format!(
            "indices must have the input's rank: input is {x} (rank {}) but indices are {idx} \
             (rank {})",
            x.rank(),
            idx.rank()
        )));
    }
    for (i, (&a, &b)) in x.shape.iter().zip(idx.shape).enumerate() {
        if let (Dim::Known(n), Dim::Known(m), false) = (a, b, i == axis) {
            if m > n {
                return Err(c.err(format!(
                    "indices {idx} are longer than the input {x} along axis {i} ({m} > {n}); \
                     only axis {axis} may be"
                )));
            }
        }
    }
    Ok(Ty::tensor(idx.shape.to_vec(), x.dtype))
}

/// `gather_nd(data, indices, batch_dims=0, index_rank=None)`: `indices` has shape
/// `(M, B…, Y…)` — its first axis lists the coordinates into the `M` axes of `data` after its
/// `batch_dims` leading axes `B…`; the result is `(B…, Y…, rest of data)`. `M` must be known.
pub fn gather_nd(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("gather_nd", args, attrs, 2)?;
    let x = c.tensor(0, "input")?;
    let idx = c.tensor(1, "indices")?;
    let (bd, m) = gather_nd_spec(&c, x, idx)?;
    for i in 0..bd {
        let (Some(&a), Some(&b)) = (x.shape.get(i), idx.shape.get(i + 1)) else {
            break;
        };
        if !dims_match(a, b) {
            return Err(c.err(format!(
                "batch dimension {i} differs: input has {a} but indices have {b} (at axis {})",
                i + 1
            )));
        }
    }
    let mut shape: Vec<Dim> = Vec::new();
    shape.extend(idx.shape.iter().skip(1));
    shape.extend(x.shape.iter().skip(bd + m));
    Ok(Ty::tensor(shape, x.dtype))
}

/// A `gather_nd` call's batch dims and `M` (the coordinates per index), checked against the
/// shapes.
pub(crate) fn gather_nd_spec(c: &Call, x: Tensor, idx: Tensor) -> Result<(usize, usize), RelError> {
    c.want_index(1, "indices", idx)?;
    let Some(&m) = idx.shape.first() else {
        return Err(c.err_at(
            1,
            format!("indices must have rank 1 or more (coordinates along axis 0), found {idx}"),
        ));
    };
    let bd = c.int_or("batch_dims", 0)?;
    let bd = usize::try_from(bd)
        .ok()
        .filter(|&b| b < idx.rank() && b <= x.rank())
        .ok_or_else(|| {
            c.err(format!(
                "batch_dims must be between 0 and {} for input {x} and indices {idx}, found {bd}",
                (idx.rank() - 1).min(x.rank())
            ))
        })?;
    let m = match (m, c.opt_int("index_rank")?) {
        (Dim::Known(m), Some(r)) if r != m => {
            return Err(c.err(format!(
                "index_rank {r} differs from the {m} coordinates per index of {idx}"
            )))
        }
        (Dim::Known(m), _) => m,
        (Dim::Any, Some(r)) => r,
        (Dim::Any, None) => {
            return Err(c.err(format!(
                "the number of coordinates per index (axis 0 of {idx}) must be known, or given \
                 as index_rank"
            )))
        }
    };
    let m = usize::try_from(m)
        .ok()
        .filter(|&m| bd + m <= x.rank())
        .ok_or_else(|| {
            c.err(format!(
                "{m} coordinates per index do not fit the {} axes of {x} after {bd} batch dims",
                x.rank()
            ))
        })?;
    Ok((bd, m))
}
