//! Elementwise kernels with numpy broadcasting: arithmetic, comparisons, logical connectives,
//! `nn.bias_add` and `where`. Both operands are broadcast to the result shape (materialized with
//! [`Tensor::broadcast_to`]), then combined element by element in their arithmetic domain
//! ([`Values`]): floats in f64, ints in i64 with wrapping, then rounded to the output dtype.

use super::{kernels, KCall, Values};
use crate::{KernelError, OpValue};
use tumble_ir::{Attrs, DType};
use tumble_tensor::{broadcast_shapes, Tensor};

/// A numeric binary operator in both domains. The int function returns `Err(message)` for
/// inputs it cannot handle (division by zero, negative exponent).
#[derive(Clone, Copy)]
pub(crate) struct Arith {
    float: fn(f64, f64) -> f64,
    int: fn(i64, i64) -> Result<i64, &'static str>,
}

/// A comparison in both domains (bool operands compare as 0/1 in the int domain).
#[derive(Clone, Copy)]
pub(crate) struct Compare {
    float: fn(f64, f64) -> bool,
    int: fn(i64, i64) -> bool,
}

/// The same comparison expression in both domains.
macro_rules! compare {
    (|$a:ident, $b:ident| $e:expr) => {
        Compare {
            float: |$a: f64, $b: f64| $e,
            int: |$a: i64, $b: i64| $e,
        }
    };
}

kernels! {
    add => arith("add", Arith { float: |a, b| a + b, int: |a, b| Ok(a.wrapping_add(b)) });
    subtract => arith("subtract", Arith { float: |a, b| a - b, int: |a, b| Ok(a.wrapping_sub(b)) });
    multiply => arith("multiply", Arith { float: |a, b| a * b, int: |a, b| Ok(a.wrapping_mul(b)) });
    divide => arith("divide", Arith { float: |a, b| a / b, int: int_div });
    power => arith("power", Arith { float: f64::powf, int: int_pow });
    maximum => arith("maximum", Arith { float: nan_max, int: |a, b| Ok(a.max(b)) });
    minimum => arith("minimum", Arith { float: nan_min, int: |a, b| Ok(a.min(b)) });
    // Remainders and quotients: `mod` truncates (C's `fmod`, TVM's `truncmod`), the `floor_`
    // forms round toward -inf (Python's `%` and `//`, numpy's `mod` and `floor_divide`).
    mod_ => arith("mod", Arith { float: |a, b| a % b, int: int_mod });
    floor_mod => arith("floor_mod", Arith { float: float_floor_mod, int: int_floor_mod });
    floor_divide => arith("floor_divide", Arith { float: float_floor_div, int: int_floor_div });
    equal => compare("equal", compare!(|a, b| a == b));
    not_equal => compare("not_equal", compare!(|a, b| a != b));
    less => compare("less", compare!(|a, b| a < b));
    greater => compare("greater", compare!(|a, b| a > b));
    less_equal => compare("less_equal", compare!(|a, b| a <= b));
    greater_equal => compare("greater_equal", compare!(|a, b| a >= b));
    logical_and => logical("logical_and", |a, b| a && b);
    logical_or => logical("logical_or", |a, b| a || b);
    logical_xor => logical("logical_xor", |a, b| a != b);
}

/// Integer division truncating toward zero (C semantics, TVM's `truncdiv`); `MIN / -1` wraps.
pub fn int_div(a: i64, b: i64) -> Result<i64, &'static str> {
    if b == 0 {
        Err("integer division by zero")
    } else {
        Ok(a.wrapping_div(b))
    }
}

/// The remainder of [`int_div`] (sign of the dividend); `MIN % -1` is 0.
pub fn int_mod(a: i64, b: i64) -> Result<i64, &'static str> {
    if b == 0 {
        Err("integer modulo by zero")
    } else {
        Ok(a.wrapping_rem(b))
    }
}

/// The quotient rounded toward -inf; `MIN // -1` wraps.
pub fn int_floor_div(a: i64, b: i64) -> Result<i64, &'static str> {
    if b == 0 {
        return Err("integer division by zero");
    }
    let q = a.wrapping_div(b);
    Ok(if a.wrapping_rem(b) != 0 && ((a < 0) != (b < 0)) {
        q.wrapping_sub(1)
    } else {
        q
    })
}

/// The remainder of [`int_floor_div`] (sign of the divisor).
pub fn int_floor_mod(a: i64, b: i64) -> Result<i64, &'static str> {
    if b == 0 {
        return Err("integer modulo by zero");
    }
    let r = a.wrapping_rem(b);
    Ok(if r != 0 && ((r < 0) != (b < 0)) {
        r.wrapping_add(b)
    } else {
        r
    })
}

/// The remainder with the divisor's sign, as Python's `%` and numpy's `mod` compute it: `fmod`,
/// moved by `b` when the signs differ; a zero takes the divisor's sign (`-0.0 % 5.0` is `0.0`).
fn float_floor_mod(a: f64, b: f64) -> f64 {
    let r = a % b;
    if r == 0.0 {
        0.0f64.copysign(b)
    } else if (r < 0.0) != (b < 0.0) {
        r + b
    } else {
        r
    }
}

/// The quotient rounded toward -inf, as Python's `//` and numpy's `floor_divide` compute it: from
/// the exact remainder, so that `q * b + r == a` with `r` [`float_floor_mod`]'s (`7.0 // 0.1` is
/// `69.0`; `floor(7.0 / 0.1)` is `70.0`, the division having rounded up to 70).
fn float_floor_div(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        return a / b;
    }
    let m = a % b;
    let mut div = (a - m) / b;
    if m != 0.0 && ((b < 0.0) != (m < 0.0)) {
        div -= 1.0;
    }
    if div == 0.0 {
        return 0.0f64.copysign(a / b);
    }
    let q = div.floor();
    if div - q > 0.5 {
        q + 1.0
    } else {
        q
    }
}

/// Integer power by repeated squaring, wrapping; negative exponents are errors.
fn int_pow(base: i64, exp: i64) -> Result<i64, &'static str> {
    if exp < 0 {
        return Err("integers to negative integer powers are not allowed");
    }
    let (mut acc, mut b, mut e) = (1i64, base, exp);
    while e > 0 {
        if e & 1 == 1 {
            acc = acc.wrapping_mul(b);
        }
        b = b.wrapping_mul(b);
        e >>= 1;
    }
    Ok(acc)
}

/// `max` that propagates NaN (numpy `maximum`).
pub(crate) fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// `min` that propagates NaN (numpy `minimum`).
pub(crate) fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// Both operands broadcast to their common shape.
fn broadcast_pair(
    k: &KCall,
    a: &Tensor,
    b: &Tensor,
) -> Result<(Vec<usize>, Tensor, Tensor), KernelError> {
    let shape = k.t(broadcast_shapes(a.shape(), b.shape()))?;
    let a = k.t(a.broadcast_to(shape.clone()))?;
    let b = k.t(b.broadcast_to(shape.clone()))?;
    Ok((shape, a, b))
}

/// `a op b` elementwise on broadcast operands of one numeric dtype; the result has that dtype.
pub(crate) fn arith_tensors(
    k: &KCall,
    a: &Tensor,
    b: &Tensor,
    f: Arith,
) -> Result<Tensor, KernelError> {
    if a.dtype() != b.dtype() || a.dtype() == DType::Bool {
        return Err(k.err(format!(
            "operands must have one numeric dtype, found {} and {}",
            a.dtype(),
            b.dtype()
        )));
    }
    let dtype = a.dtype();
    let (shape, a, b) = broadcast_pair(k, a, b)?;
    let out = match (Values::of(&a), Values::of(&b)) {
        (Values::F(x), Values::F(y)) => {
            Values::F(x.iter().zip(&y).map(|(&p, &q)| (f.float)(p, q)).collect())
        }
        (Values::I(x), Values::I(y)) => Values::I(
            x.iter()
                .zip(&y)
                .map(|(&p, &q)| (f.int)(p, q).map_err(|m| k.err(m)))
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err(k.err(format!("unsupported dtype {dtype}"))),
    };
    k.t(out.into_tensor(&shape, dtype))
}

fn arith(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    f: Arith,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 2)?;
    let a = k.tensor(0, "lhs")?;
    let b = k.tensor(1, "rhs")?;
    Ok(arith_tensors(&k, a, b, f)?.into())
}

fn compare(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    f: Compare,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 2)?;
    let a = k.tensor(0, "lhs")?;
    let b = k.tensor(1, "rhs")?;
    if a.dtype() != b.dtype() {
        return Err(k.err(format!("dtype mismatch: {} vs {}", a.dtype(), b.dtype())));
    }
    let (shape, a, b) = broadcast_pair(&k, a, b)?;
    let out: Vec<bool> = if a.dtype().is_float() {
        a.to_f64_vec()
            .into_iter()
            .zip(b.to_f64_vec())
            .map(|(p, q)| (f.float)(p, q))
            .collect()
    } else {
        // ints exactly, bools as 0/1
        a.to_i64_vec()
            .into_iter()
            .zip(b.to_i64_vec())
            .map(|(p, q)| (f.int)(p, q))
            .collect()
    };
    Ok(k.t(Tensor::from_bool(shape, out))?.into())
}

fn logical(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    f: fn(bool, bool) -> bool,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 2)?;
    let a = k.tensor(0, "lhs")?;
    let b = k.tensor(1, "rhs")?;
    let (shape, a, b) = broadcast_pair(&k, a, b)?;
    let (Some(x), Some(y)) = (a.as_bool(), b.as_bool()) else {
        return Err(k.err(format!(
            "operands must have dtype bool, found {} and {}",
            a.dtype(),
            b.dtype()
        )));
    };
    let out = x.iter().zip(y).map(|(&p, &q)| f(p, q)).collect();
    Ok(k.t(Tensor::from_bool(shape, out))?.into())
}

/// `nn.bias_add(data, bias, axis=1)`: `bias` (length `data.shape[axis]`) reshaped to
/// `(n, 1, ..., 1)` so that it broadcasts along `axis`, then added.
pub fn bias_add(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut crate::OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.bias_add", args, attrs, 2)?;
    let data = k.tensor(0, "input")?;
    let bias = k.tensor(1, "bias")?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 1)?, data.rank())?;
    let len = data.shape().get(axis).copied().unwrap_or(0);
    if bias.shape() != [len] {
        return Err(k.err(format!(
            "bias has shape {:?} but input has {len} along axis {axis}",
            bias.shape()
        )));
    }
    let mut shape = vec![len];
    shape.extend(std::iter::repeat_n(1, data.rank() - axis - 1));
    let bias = k.t(bias.reshape(shape))?;
    let add = Arith {
        float: |a, b| a + b,
        int: |a, b| Ok(a.wrapping_add(b)),
    };
    Ok(arith_tensors(&k, data, &bias, add)?.into())
}

/// `where(condition, x, y)`: `x` where `condition` holds, else `y`; all three broadcast.
pub fn where_(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut crate::OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("where", args, attrs, 3)?;
    let cond = k.tensor(0, "condition")?;
    let x = k.tensor(1, "x")?;
    let y = k.tensor(2, "y")?;
    if x.dtype() != y.dtype() {
        return Err(k.err(format!("dtype mismatch: {} vs {}", x.dtype(), y.dtype())));
    }
    let xy = k.t(broadcast_shapes(x.shape(), y.shape()))?;
    let shape = k.t(broadcast_shapes(cond.shape(), &xy))?;
    let cond = k.t(cond.broadcast_to(shape.clone()))?;
    let Some(c) = cond.as_bool() else {
        return Err(k.err(format!(
            "condition must have dtype bool, found {}",
            cond.dtype()
        )));
    };
    let x = k.t(x.broadcast_to(shape.clone()))?;
    let y = k.t(y.broadcast_to(shape.clone()))?;
    fn pick<T: Copy>(c: &[bool], x: Vec<T>, y: Vec<T>) -> Vec<T> {
        c.iter()
            .zip(x.into_iter().zip(y))
            .map(|(&c, (x, y))| if c { x } else { y })
            .collect()
    }
    let out = match (Values::of(&x), Values::of(&y)) {
        (Values::F(a), Values::F(b)) => Values::F(pick(c, a, b)),
        (Values::I(a), Values::I(b)) => Values::I(pick(c, a, b)),
        (Values::B(a), Values::B(b)) => Values::B(pick(c, a, b)),
        _ => return Err(k.err("x and y must have one dtype")),
    };
    Ok(k.t(out.into_tensor(&shape, x.dtype()))?.into())
}
