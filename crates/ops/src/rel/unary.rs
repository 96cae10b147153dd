//! One-input elementwise operators: activations, math functions, `copy`, `logical_not`, `clip`.

use super::{relations, Call};
use crate::RelError;
use tumble_ir::{Attrs, Ty};

/// Which input dtypes a unary operator accepts. The result has the input's type.
#[derive(Clone, Copy)]
pub(crate) enum Unary {
    /// float32/float64 only (`sigmoid`, `exp`, ...).
    Float,
    /// Ints or floats, not bool (`negative`, `abs`, `nn.relu`).
    Numeric,
    /// bool only (`logical_not`).
    Bool,
    /// Anything (`copy`).
    Any,
}

relations! {
    negative => unary("negative", Unary::Numeric);
    sigmoid => unary("sigmoid", Unary::Float);
    tanh => unary("tanh", Unary::Float);
    exp => unary("exp", Unary::Float);
    log => unary("log", Unary::Float);
    sqrt => unary("sqrt", Unary::Float);
    rsqrt => unary("rsqrt", Unary::Float);
    abs => unary("abs", Unary::Numeric);
    relu => unary("nn.relu", Unary::Numeric);
    erf => unary("erf", Unary::Float);
    sin => unary("sin", Unary::Float);
    cos => unary("cos", Unary::Float);
    tan => unary("tan", Unary::Float);
    asin => unary("asin", Unary::Float);
    acos => unary("acos", Unary::Float);
    atan => unary("atan", Unary::Float);
    sinh => unary("sinh", Unary::Float);
    cosh => unary("cosh", Unary::Float);
    asinh => unary("asinh", Unary::Float);
    acosh => unary("acosh", Unary::Float);
    atanh => unary("atanh", Unary::Float);
    log2 => unary("log2", Unary::Float);
    log10 => unary("log10", Unary::Float);
    isnan => predicate("isnan");
    isinf => predicate("isinf");
    isfinite => predicate("isfinite");
    floor => unary("floor", Unary::Float);
    ceil => unary("ceil", Unary::Float);
    round => unary("round", Unary::Float);
    trunc => unary("trunc", Unary::Float);
    sign => unary("sign", Unary::Numeric);
    copy => unary("copy", Unary::Any);
    logical_not => unary("logical_not", Unary::Bool);
}

fn unary(op: &'static str, args: &[Ty], attrs: &Attrs, kind: Unary) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    match kind {
        Unary::Float => c.want_float(0, "input", x)?,
        Unary::Numeric => c.want_numeric(0, "input", x)?,
        Unary::Bool => c.want_bool(0, "input", x)?,
        Unary::Any => {}
    }
    Ok(x.ty.clone())
}

/// `isnan`, `isinf`, `isfinite`: a float input, a bool result of its shape.
fn predicate(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    Ok(Ty::tensor(x.shape.to_vec(), tumble_ir::DType::Bool))
}

/// `nn.leaky_relu(data, alpha=0.01)`: `x` where positive, else `alpha * x` (float).
pub fn leaky_relu(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.leaky_relu", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    if let Some(a) = c.opt_float("alpha")? {
        if !a.is_finite() {
            return Err(c.err(format!("alpha must be a finite number, found {a:?}")));
        }
    }
    Ok(x.ty.clone())
}

/// `clip(data, a_min, a_max)`: clamps every element into `[a_min, a_max]`.
pub fn clip(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("clip", args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_numeric(0, "input", x)?;
    let lo = c.req_float("a_min")?;
    let hi = c.req_float("a_max")?;
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(c.err(format!("a_min ({lo:?}) must not exceed a_max ({hi:?})")));
    }
    Ok(x.ty.clone())
}
