//! Tensor creation and dtype conversion (`zeros`, `ones`, `full`, `zeros_like`, `ones_like`,
//! `cast`, `one_hot`, `arange`), a tensor's shape as a value (`shape_of`, `ndarray_size`) and the
//! ACROBAT intrinsics `db.phase_change` and `random.db_uniform`.

use super::{fmt_ints, relations, Call};
use crate::RelError;
use tumble_ir::{Attrs, DType, Ty};

relations! {
    zeros => from_attrs("zeros");
    ones => from_attrs("ones");
    zeros_like => like("zeros_like");
    ones_like => like("ones_like");
}

/// A shape attribute: non-negative sizes.
fn shape_attr(c: &Call, name: &str) -> Result<Vec<i64>, RelError> {
    let shape = c.req_ints(name)?;
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(c.err(format!(
            "{name} {} contains the negative size {d}",
            fmt_ints(&shape)
        )));
    }
    Ok(shape)
}

/// `zeros(shape, dtype="float32")`, `ones(...)`: no arguments, all attributes.
fn from_attrs(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 0)?;
    let shape = shape_attr(&c, "shape")?;
    let dtype = c.opt_dtype("dtype")?.unwrap_or(DType::Float32);
    Ok(Ty::tensor_of(&shape, dtype))
}

/// `zeros_like(data)`, `ones_like(data)`: the input's type.
fn like(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    Ok(c.tensor(0, "input")?.ty.clone())
}

/// `full(fill_value, shape, dtype=None)`: `fill_value` is a scalar tensor; dtype defaults to its.
pub fn full(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("full", args, attrs, 1)?;
    let v = c.tensor(0, "fill_value")?;
    if v.rank() != 0 {
        return Err(c.err_at(0, format!("fill_value must be a scalar tensor, found {v}")));
    }
    let shape = shape_attr(&c, "shape")?;
    let dtype = c.opt_dtype("dtype")?.unwrap_or(v.dtype);
    Ok(Ty::tensor_of(&shape, dtype))
}

/// `one_hot(indices, on_value, off_value, depth, axis=-1, dtype)`: `on_value` where the position
/// along the new axis `axis` (of length `depth`) is the index, else `off_value` (both scalars of
/// `dtype`, which they set when it is not given).
pub fn one_hot(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("one_hot", args, attrs, 3)?;
    let idx = c.tensor(0, "indices")?;
    c.want_index(0, "indices", idx)?;
    let on = c.tensor(1, "on_value")?;
    let off = c.tensor(2, "off_value")?;
    for (k, role, t) in [(1, "on_value", on), (2, "off_value", off)] {
        if t.rank() != 0 {
            return Err(c.err_at(k, format!("{role} must be a scalar tensor, found {t}")));
        }
    }
    c.same_dtype(on, off)?;
    let depth = c
        .opt_int("depth")?
        .ok_or_else(|| c.err("missing required attribute `depth`"))?;
    if depth < 0 {
        return Err(c.err(format!("depth must not be negative, found {depth}")));
    }
    let dtype = c.opt_dtype("dtype")?.unwrap_or(on.dtype);
    if dtype != on.dtype {
        return Err(c.err(format!(
            "dtype {dtype} differs from on_value's and off_value's {}",
            on.dtype
        )));
    }
    let axis = c.int_or("axis", -1)?;
    let rank = idx.rank();
    let at = super::normalize_axis(axis, rank + 1).ok_or_else(|| {
        c.err(format!(
            "axis {axis} is out of range for a result of rank {} (allowed: {}..={rank})",
            rank + 1,
            -(rank as i64) - 1
        ))
    })?;
    let mut shape = idx.shape.to_vec();
    shape.insert(at, tumble_ir::Dim::Known(depth));
    Ok(Ty::tensor(shape, dtype))
}

/// `cast(data, dtype)`: same shape, new dtype.
pub fn cast(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("cast", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let dtype = c
        .opt_dtype("dtype")?
        .ok_or_else(|| c.err("missing required attribute `dtype`"))?;
    Ok(Ty::tensor(x.shape.to_vec(), dtype))
}

/// `db.phase_change()`: ACROBAT's phase boundary; returns unit.
pub fn phase_change(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    Call::new("db.phase_change", args, attrs, 0)?;
    Ok(Ty::unit())
}

/// `db.concurrent(t)`: a scheduling annotation. The lowering turns `db.concurrent((e1, ..., en))`
/// into a fork–join of the elements' inline depths; as a value it is the identity on any type.
pub fn concurrent(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    Call::new("db.concurrent", args, attrs, 1)?;
    args.first()
        .cloned()
        .ok_or_else(|| RelError::new("db.concurrent: expected 1 argument, found 0"))
}

/// `random.db_uniform(low, high, out_shape, out_dtype="int32")`: a seeded uniform draw in
/// `[low, high)` of the given shape. Two call forms:
/// - ACROBAT's: `random.db_uniform(%low, %high, out_shape=[], out_dtype="int32")`, the bounds
///   scalar tensors (int or float) known only at run time, where the kernel checks them;
/// - tumble's attribute form: `random.db_uniform(low=0, high=10, out_shape=[4])`, no arguments,
///   the bounds checked here.
pub fn db_uniform(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    const OP: &str = "random.db_uniform";
    let c = Call {
        op: OP,
        args,
        attrs,
    };
    match args.len() {
        0 => {
            let (low, high) = (c.opt_float("low")?, c.opt_float("high")?);
            let (Some(low), Some(high)) = (low, high) else {
                return Err(c.err(
                    "give the bounds as two arguments, `random.db_uniform(low, high, out_shape=[...])`, \
                     or as the attributes `low=` and `high=`",
                ));
            };
            if !(low.is_finite() && high.is_finite() && low <= high) {
                return Err(c.err(format!(
                    "low ({low:?}) must be a finite number not above high ({high:?})"
                )));
            }
        }
        2 => {
            for name in ["low", "high"] {
                if c.raw(name).is_some() {
                    return Err(c.err(format!(
                        "the bounds are given as arguments; remove the attribute `{name}`"
                    )));
                }
            }
            for (i, role) in [(0, "low"), (1, "high")] {
                let b = c.tensor(i, role)?;
                if b.rank() != 0 {
                    return Err(c.err_at(i, format!("{role} must be a scalar tensor, found {b}")));
                }
                c.want_numeric(i, role, b)?;
            }
        }
        n => {
            return Err(c.err(format!(
                "expected 2 arguments (low, high), or 0 with `low=`/`high=` attributes, found {n}"
            )))
        }
    }
    let shape = shape_attr(&c, "out_shape")?;
    let dtype = c.opt_dtype("out_dtype")?.unwrap_or(DType::Int32);
    if dtype == DType::Bool {
        return Err(c.err("out_dtype must be numeric, found bool"));
    }
    Ok(Ty::tensor_of(&shape, dtype))
}

/// `arange(start, stop, step, dtype="float32")`: `start, start + step, …` below `stop` (above it
/// for a negative step). The operands are scalar tensors known only at run time, so the length is
/// `?`; the kernel computes it, `ceil((stop - start) / step)` (0 when negative), as Relay's.
pub fn arange(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("arange", args, attrs, 3)?;
    for (i, role) in [(0, "start"), (1, "stop"), (2, "step")] {
        let t = c.tensor(i, role)?;
        if t.rank() != 0 {
            return Err(c.err_at(i, format!("{role} must be a scalar tensor, found {t}")));
        }
        c.want_numeric(i, role, t)?;
    }
    let dtype = c.opt_dtype("dtype")?.unwrap_or(DType::Float32);
    if dtype == DType::Bool {
        return Err(c.err("dtype must be numeric, found bool"));
    }
    Ok(Ty::tensor(vec![tumble_ir::Dim::Any], dtype))
}

/// The integer dtype of `shape_of` and `ndarray_size` (`dtype`, default int32 as Relay's).
fn size_dtype(c: &Call) -> Result<DType, RelError> {
    let dtype = c.opt_dtype("dtype")?.unwrap_or(DType::Int32);
    if !dtype.is_int() {
        return Err(c.err(format!("dtype must be an integer type, found {dtype}")));
    }
    Ok(dtype)
}

/// `shape_of(data, dtype="int32")`: `data`'s shape as a vector of its rank's length.
pub fn shape_of(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("shape_of", args, attrs, 1)?;
    let t = c.tensor(0, "data")?;
    let dtype = size_dtype(&c)?;
    Ok(Ty::tensor_of(&[t.rank() as i64], dtype))
}

/// `ndarray_size(data, dtype="int32")`: `data`'s number of elements, a scalar.
pub fn ndarray_size(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("ndarray_size", args, attrs, 1)?;
    c.tensor(0, "data")?;
    let dtype = size_dtype(&c)?;
    Ok(Ty::tensor_of(&[], dtype))
}
