//! One-input elementwise kernels: activations, math functions, `copy`, `logical_not`, `clip`.
//! Floats are computed in f64 and rounded once to the input dtype; ints in i64 with wrapping
//! (`negative`/`abs` of the smallest int wrap to itself, as in numpy).

use super::{kernels, KCall, Values};
use crate::{KernelError, OpCtx, OpValue};
use tumble_ir::{Attrs, DType};
use tumble_tensor::{Element, Tensor};

/// Which domains a unary operator is defined on; the result has the input's dtype.
#[derive(Clone, Copy)]
pub(crate) enum UnaryFn {
    /// float32/float64 only.
    Float(fn(f64) -> f64),
    /// Ints and floats.
    Numeric(fn(f64) -> f64, fn(i64) -> i64),
}

kernels! {
    negative => unary("negative", UnaryFn::Numeric(|x| -x, i64::wrapping_neg));
    sigmoid => unary("sigmoid", UnaryFn::Float(sigmoid_f64));
    tanh => unary("tanh", UnaryFn::Float(f64::tanh));
    exp => unary("exp", UnaryFn::Float(f64::exp));
    log => unary("log", UnaryFn::Float(f64::ln));
    sqrt => unary("sqrt", UnaryFn::Float(f64::sqrt));
    rsqrt => unary("rsqrt", UnaryFn::Float(|x| 1.0 / x.sqrt()));
    abs => unary("abs", UnaryFn::Numeric(f64::abs, i64::wrapping_abs));
    // `x < 0 ? 0 : x` keeps NaN (numpy `maximum(x, 0)`).
    relu => unary("nn.relu", UnaryFn::Numeric(|x| if x < 0.0 { 0.0 } else { x }, |x| x.max(0)));
    erf => unary("erf", UnaryFn::Float(libm::erf));
    sin => unary("sin", UnaryFn::Float(f64::sin));
    cos => unary("cos", UnaryFn::Float(f64::cos));
    tan => unary("tan", UnaryFn::Float(f64::tan));
    asin => unary("asin", UnaryFn::Float(f64::asin));
    acos => unary("acos", UnaryFn::Float(f64::acos));
    atan => unary("atan", UnaryFn::Float(f64::atan));
    sinh => unary("sinh", UnaryFn::Float(f64::sinh));
    cosh => unary("cosh", UnaryFn::Float(f64::cosh));
    asinh => unary("asinh", UnaryFn::Float(f64::asinh));
    acosh => unary("acosh", UnaryFn::Float(f64::acosh));
    atanh => unary("atanh", UnaryFn::Float(f64::atanh));
    log2 => unary("log2", UnaryFn::Float(f64::log2));
    log10 => unary("log10", UnaryFn::Float(f64::log10));
    floor => unary("floor", UnaryFn::Float(f64::floor));
    ceil => unary("ceil", UnaryFn::Float(f64::ceil));
    // Halves to even, as numpy's `round` and TVM's (`nearbyint`) do.
    round => unary("round", UnaryFn::Float(f64::round_ties_even));
    trunc => unary("trunc", UnaryFn::Float(f64::trunc));
    // 0 for 0, NaN for NaN (numpy `sign`).
    sign => unary("sign", UnaryFn::Numeric(sign_f64, i64::signum));
}

/// `-1`, `0` or `1` by the sign of `x` (`0` for both zeros, NaN for NaN).
fn sign_f64(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

/// `1 / (1 + e^-x)`, written so that neither branch overflows: for negative `x`, `e^x / (1 + e^x)`.
fn sigmoid_f64(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn unary(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    f: UnaryFn,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (float, int) = match f {
        UnaryFn::Float(g) => (g, None),
        UnaryFn::Numeric(g, h) => (g, Some(h)),
    };
    map_elements(&k, x, float, int)
}

/// `float` of every element of a float `x` (in f64, rounded once to its dtype), `int` of every
/// element of an int one; an error for a dtype without a function.
fn map_elements(
    k: &KCall,
    x: &Tensor,
    float: impl Fn(f64) -> f64,
    int: Option<fn(i64) -> i64>,
) -> Result<OpValue, KernelError> {
    let out = match (Values::of(x), int) {
        (Values::F(v), _) => Values::F(v.into_iter().map(float).collect()),
        (Values::I(v), Some(g)) => Values::I(v.into_iter().map(g).collect()),
        _ => return Err(k.err(format!("unsupported input dtype {}", x.dtype()))),
    };
    Ok(k.t(out.into_tensor(x.shape(), x.dtype()))?.into())
}

/// `logical_not(x)` on a bool tensor.
pub fn logical_not(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("logical_not", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let Some(v) = x.as_bool() else {
        return Err(k.err(format!("input must have dtype bool, found {}", x.dtype())));
    };
    Ok(
        k.t(Tensor::from_bool(x.shape(), v.iter().map(|b| !b).collect()))?
            .into(),
    )
}

kernels! {
    isnan => predicate("isnan", f64::is_nan);
    isinf => predicate("isinf", f64::is_infinite);
    isfinite => predicate("isfinite", f64::is_finite);
}

/// `isnan(x)`, `isinf(x)`, `isfinite(x)`: a bool tensor of `test` on each element of a float `x`.
fn predicate(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    test: fn(f64) -> bool,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let Values::F(v) = Values::of(x) else {
        return Err(k.err(format!(
            "input must have a float dtype, found {}",
            x.dtype()
        )));
    };
    Ok(k.t(Tensor::from_bool(
        x.shape(),
        v.into_iter().map(test).collect(),
    ))?
    .into())
}

/// `copy(x)`: a tensor with its own buffer, equal to `x`.
pub fn copy(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("copy", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    Ok(k.t(Tensor::new(x.shape(), x.buffer().clone()))?.into())
}

/// `nn.leaky_relu(x, alpha)`: `x` where `x > 0`, else `alpha * x` (NaN stays NaN).
pub fn leaky_relu(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.leaky_relu", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    k.out_tensor(crate::rel::unary::leaky_relu)?;
    let alpha = k.rel().opt_float("alpha")?.unwrap_or(0.01);
    map_elements(&k, x, |x| if x > 0.0 { x } else { alpha * x }, None)
}

/// `clip(x, a_min, a_max)`. Floats: `a_min` if `x < a_min`, `a_max` if `x > a_max`, else `x`
/// (NaN stays NaN). Ints: the bounds are first converted to the dtype (truncating toward zero,
/// saturating at its limits), then the value is clamped; since truncation is monotone this equals
/// clipping in real numbers and casting the result back (`clip([-1, 5], -0.5, 2.7)` on int32 is
/// `[0, 2]`).
pub fn clip(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("clip", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let c = k.rel();
    let lo = c.req_float("a_min")?;
    let hi = c.req_float("a_max")?;
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(k.err(format!("a_min ({lo:?}) must not exceed a_max ({hi:?})")));
    }
    let out = match Values::of(x) {
        Values::F(v) => Values::F(
            v.into_iter()
                .map(|x| {
                    if x < lo {
                        lo
                    } else if x > hi {
                        hi
                    } else {
                        x
                    }
                })
                .collect(),
        ),
        Values::I(v) => {
            let (lo, hi) = match x.dtype() {
                DType::Int32 => (i64::from(lo.to_i32()), i64::from(hi.to_i32())),
                _ => (lo.to_i64(), hi.to_i64()),
            };
            Values::I(v.into_iter().map(|x| x.max(lo).min(hi)).collect())
        }
        Values::B(_) => return Err(k.err("input must have a numeric dtype, found bool")),
    };
    Ok(k.t(out.into_tensor(x.shape(), x.dtype()))?.into())
}
