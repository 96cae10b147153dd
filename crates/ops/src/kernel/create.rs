//! Creation and conversion kernels (`zeros`, `ones`, `full`, `zeros_like`, `ones_like`, `cast`,
//! `one_hot`, `arange`), `shape_of` and `ndarray_size`, and the ACROBAT intrinsics `db.phase_change` and `random.db_uniform`.
//! Result shapes and dtypes come from the relations (`arange`'s length, which its relation
//! leaves `?`, from its operands).

use super::{product, KCall, Values};
use crate::{rel, KernelError, OpCtx, OpValue};
use tumble_ir::{Attrs, DType};
use tumble_tensor::{Element, Tensor};

/// A tensor of the relation's type filled with `value`.
fn filled(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    arity: usize,
    relation: crate::Relation,
    value: f64,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, arity)?;
    let (shape, dtype) = k.out_tensor(relation)?;
    Ok(k.t(Tensor::full_f64(shape, dtype, value))?.into())
}

pub fn zeros(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    filled("zeros", args, attrs, 0, rel::create::zeros, 0.0)
}

pub fn ones(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    filled("ones", args, attrs, 0, rel::create::ones, 1.0)
}

pub fn zeros_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    filled("zeros_like", args, attrs, 1, rel::create::zeros_like, 0.0)
}

pub fn ones_like(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    filled("ones_like", args, attrs, 1, rel::create::ones_like, 1.0)
}

/// `full(fill_value, shape, dtype=None)`: the scalar `fill_value` cast to the dtype (exactly,
/// with the tensor crate's cast rules: int64 values are not rounded through f64), repeated.
pub fn full(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("full", args, attrs, 1)?;
    let v = k.tensor(0, "fill_value")?;
    let (shape, dtype) = k.out_tensor(rel::create::full)?;
    if v.len() != 1 {
        return Err(k.err(format!(
            "fill_value must be a scalar, found shape {:?}",
            v.shape()
        )));
    }
    let scalar = k.t(v.cast(dtype).reshape([]))?;
    Ok(k.t(scalar.broadcast_to(shape))?.into())
}

/// `one_hot(indices, on, off, depth, axis)`: an index outside `0..depth` (negative included)
/// has no position on, as in TVM's and numpy's comparison form.
pub fn one_hot(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("one_hot", args, attrs, 3)?;
    let idx = k.tensor(0, "indices")?;
    let on = k.tensor(1, "on_value")?;
    let off = k.tensor(2, "off_value")?;
    let (shape, _) = k.out_tensor(rel::create::one_hot)?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", -1)?, shape.len())?;
    let depth = shape.get(axis).copied().unwrap_or(0);
    // Output position (outer, d, inner) reads index (outer, inner).
    let outer: usize = shape.get(..axis).unwrap_or_default().iter().product();
    let inner: usize = shape.get(axis + 1..).unwrap_or_default().iter().product();
    let ids = idx.to_i64_vec();
    let mut positions = Vec::with_capacity(k.t(product(&shape))?);
    for o in 0..outer {
        for d in 0..depth {
            for i in 0..inner {
                let hot = ids.get(o * inner + i).copied() == Some(d as i64);
                positions.push(usize::from(!hot));
            }
        }
    }
    // Gathered from [on, off].
    let pair = k.t(Tensor::stack(&[on, off]))?;
    let pair = k.t(pair.reshape([2]))?;
    Ok(k.t(pair.take(shape, &positions))?.into())
}

/// `cast(x, dtype)`: numpy `astype` (float → int truncates toward zero, saturating, NaN → 0;
/// int → narrower int wraps; → bool is `!= 0`).
pub fn cast(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("cast", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (_, dtype) = k.out_tensor(rel::create::cast)?;
    Ok(x.cast(dtype).into())
}

/// `db.phase_change()`: a scheduling marker; as a value it is unit `()`.
pub fn phase_change(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    KCall::new("db.phase_change", args, attrs, 0)?;
    Ok(OpValue::unit())
}

/// `db.concurrent(t)` is the identity (only the lowering gives it meaning).
pub fn concurrent(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    KCall::new("db.concurrent", args, attrs, 1)?;
    args.first()
        .cloned()
        .ok_or_else(|| KernelError::new("db.concurrent: expected 1 argument"))
}

/// The largest float of `dtype` below `x` (for keeping float draws strictly below `high`).
fn next_below(x: f64, dtype: DType) -> f64 {
    fn down32(x: f32) -> f32 {
        if x.is_nan() || x == f32::NEG_INFINITY {
            x
        } else if x == 0.0 {
            -f32::from_bits(1)
        } else if x > 0.0 {
            f32::from_bits(x.to_bits() - 1)
        } else {
            f32::from_bits(x.to_bits() + 1)
        }
    }
    fn down64(x: f64) -> f64 {
        if x.is_nan() || x == f64::NEG_INFINITY {
            x
        } else if x == 0.0 {
            -f64::from_bits(1)
        } else if x > 0.0 {
            f64::from_bits(x.to_bits() - 1)
        } else {
            f64::from_bits(x.to_bits() + 1)
        }
    }
    match dtype {
        DType::Float32 => f64::from(down32(x.to_f32())),
        _ => down64(x),
    }
}

/// `random.db_uniform(low, high, out_shape, out_dtype="int32")`: one draw per element, in
/// row-major order, from `ctx.rng`. The bounds are the two scalar tensor arguments (ACROBAT's
/// form, read as numbers here) or, with no arguments, the `low`/`high` attributes.
///
/// - Integer dtypes: uniform over the integers in `[low, high)`, i.e. `rng.int_range(ceil(low),
///   ceil(high))` (for integral bounds, `int_range(low, high)`). An empty integer range is an
///   error, except `low == high` integral, which fills with `low` (and draws nothing). Bounds
///   outside the dtype's range are errors.
/// - Float dtypes: `low + (high - low) * rng.uniform_f64()` in f64, rounded to the dtype; a value
///   that rounding pushed up to `high` becomes the largest value of the dtype below `high` (but
///   not below `low`), so the result stays in `[low, high)` when `low < high`. `low == high`
///   gives `low`.
pub fn db_uniform(
    args: &[OpValue],
    attrs: &Attrs,
    ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    // The relation has accepted the argument count (0 or 2) before the kernel runs.
    let k = KCall::new("random.db_uniform", args, attrs, args.len().min(2))?;
    let (shape, dtype) = k.out_tensor(rel::create::db_uniform)?;
    let (low, high) = if args.is_empty() {
        let c = k.rel();
        (c.req_float("low")?, c.req_float("high")?)
    } else {
        let bound = |i: usize, role: &str| -> Result<f64, KernelError> {
            let t = k.tensor(i, role)?;
            match (t.len(), t.get_f64(0)) {
                (1, Some(v)) => Ok(v),
                _ => Err(k.err(format!(
                    "{role} must be a scalar, found shape {:?}",
                    t.shape()
                ))),
            }
        };
        let (low, high) = (bound(0, "low")?, bound(1, "high")?);
        // Bounds computed at run time: say which values made the range invalid.
        if !(low.is_finite() && high.is_finite()) || low > high {
            return Err(k.err(format!(
                "the bounds computed at run time are low = {}, high = {}; low must be a finite \
                 number not above high",
                num(low),
                num(high)
            )));
        }
        (low, high)
    };
    let n = k.t(super::product(&shape))?;
    let values = match dtype {
        DType::Int32 | DType::Int64 => {
            let (lo, hi) = (low.ceil(), high.ceil());
            let (min, max) = match dtype {
                DType::Int32 => (f64::from(i32::MIN), f64::from(i32::MAX) + 1.0),
                _ => (i64::MIN as f64, i64::MAX as f64),
            };
            if !(lo >= min && hi <= max) {
                return Err(k.err(format!(
                    "[{}, {}) does not fit in {dtype}",
                    num(low),
                    num(high)
                )));
            }
            let (lo, hi) = (lo as i64, hi as i64);
            if lo >= hi && !(low == high && low.fract() == 0.0) {
                return Err(k.err(format!(
                    "[{}, {}) contains no integer to draw",
                    num(low),
                    num(high)
                )));
            }
            Values::I((0..n).map(|_| ctx.rng.int_range(lo, hi)).collect())
        }
        DType::Float32 | DType::Float64 => {
            let draw = |u: f64| {
                let v = low + (high - low) * u;
                let v = if dtype == DType::Float32 {
                    f64::from(v.to_f32())
                } else {
                    v
                };
                if v >= high && high > low {
                    next_below(high, dtype).max(low)
                } else {
                    v
                }
            };
            Values::F((0..n).map(|_| draw(ctx.rng.uniform_f64())).collect())
        }
        DType::Bool => return Err(k.err("out_dtype must be numeric, found bool")),
    };
    Ok(k.t(values.into_tensor(&shape, dtype))?.into())
}

/// A bound for messages: integral values without a fraction (`3`, not `3.0`).
fn num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x:?}")
    }
}

/// `arange(start, stop, step, dtype="float32")`: the operands cast to `dtype` first (as Relay's
/// `arange` builds them), then `start + i * step` for `i < ceil((stop - start) / step)` (none
/// when that is not positive). Floats are computed in f64 and rounded once; ints exactly, the
/// length by integer ceiling division. A zero step, or a length that is not finite, is an error.
pub fn arange(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("arange", args, attrs, 3)?;
    let (_, dtype) = k
        .out_ty(rel::create::arange)?
        .as_tensor()
        .map(|(d, t)| (d.len(), t))
        .ok_or_else(|| k.err("internal error: arange's result is not a tensor"))?;
    let operand = |i: usize, role: &str| -> Result<Tensor, KernelError> {
        let t = k.tensor(i, role)?;
        if t.len() != 1 {
            return Err(k.err(format!(
                "{role} must be a scalar, found shape {:?}",
                t.shape()
            )));
        }
        Ok(t.cast(dtype))
    };
    let (start, stop, step) = (
        operand(0, "start")?,
        operand(1, "stop")?,
        operand(2, "step")?,
    );
    let values = if dtype.is_int() {
        let (a, b, s) = (
            start.to_i64_vec().first().copied().unwrap_or(0),
            stop.to_i64_vec().first().copied().unwrap_or(0),
            step.to_i64_vec().first().copied().unwrap_or(0),
        );
        if s == 0 {
            return Err(k.err(format!("step is 0 (start {a}, stop {b})")));
        }
        let span = i128::from(b) - i128::from(a);
        let s128 = i128::from(s);
        // Ceiling division, for either sign of the step.
        let len = (span + s128 - s128.signum()) / s128;
        let len = usize::try_from(len.max(0)).map_err(|_| k.err("the length overflows"))?;
        reserve(&k, len, dtype)?;
        Values::I(
            (0..len)
                .map(|i| a.wrapping_add((i as i64).wrapping_mul(s)))
                .collect(),
        )
    } else {
        let (a, b, s) = (
            start.get_f64(0).unwrap_or(0.0),
            stop.get_f64(0).unwrap_or(0.0),
            step.get_f64(0).unwrap_or(0.0),
        );
        if s == 0.0 {
            return Err(k.err(format!("step is 0 (start {a:?}, stop {b:?})")));
        }
        let len = ((b - a) / s).ceil();
        if !len.is_finite() {
            return Err(k.err(format!(
                "the length of [{a:?}, {b:?}) in steps of {s:?} is not a finite number"
            )));
        }
        let len = if len <= 0.0 { 0 } else { len as usize };
        reserve(&k, len, dtype)?;
        Values::F((0..len).map(|i| a + i as f64 * s).collect())
    };
    let len = match &values {
        Values::I(v) => v.len(),
        Values::F(v) => v.len(),
        Values::B(v) => v.len(),
    };
    Ok(k.t(values.into_tensor(&[len], dtype))?.into())
}

/// A result of `len` elements of `dtype` checked against the memory budget: the relation could
/// not size it (its length is `?`), so `eval` did not.
fn reserve(k: &KCall, len: usize, dtype: DType) -> Result<(), KernelError> {
    let bytes = len.saturating_mul(dtype.size());
    if bytes > isize::MAX as usize {
        return Err(k.err(format!("a result of {len} elements is too large")));
    }
    if bytes >= crate::RESERVE_ABOVE {
        tumble_limits::reserve(bytes).map_err(|stop| k.err(stop))?;
    }
    Ok(())
}

/// `shape_of(data)`: the run-time shape, in the relation's dtype.
pub fn shape_of(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("shape_of", args, attrs, 1)?;
    let (_, dtype) = k.out_tensor(rel::create::shape_of)?;
    let dims: Vec<i64> = k
        .tensor(0, "data")?
        .shape()
        .iter()
        .map(|&d| d as i64)
        .collect();
    let n = dims.len();
    Ok(k.t(Tensor::from_vec(vec![n], dims))?.cast(dtype).into())
}

/// `ndarray_size(data)`: the run-time number of elements, in the relation's dtype.
pub fn ndarray_size(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("ndarray_size", args, attrs, 1)?;
    let (_, dtype) = k.out_tensor(rel::create::ndarray_size)?;
    let n = k.tensor(0, "data")?.len() as i64;
    Ok(Tensor::scalar_i64(n).cast(dtype).into())
}
