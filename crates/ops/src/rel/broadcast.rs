//! Elementwise operators with numpy broadcasting: arithmetic, comparisons, logical connectives,
//! `nn.bias_add` and `where`.

use super::{broadcast_shapes, dims_match, relations, Call, Tensor};
use crate::RelError;
use tumble_ir::{Attrs, DType, Ty};

/// Which operand dtypes a binary operator accepts and what it returns.
#[derive(Clone, Copy)]
pub(crate) enum Binary {
    /// Numeric operands, same dtype out (`add`, `maximum`, ...).
    Arith,
    /// Any dtype (bool included), bool out (`equal`, `not_equal`).
    Equality,
    /// Numeric operands, bool out (`less`, ...).
    Order,
    /// Bool operands, bool out (`logical_and`, `logical_or`).
    Logical,
}

relations! {
    add => binary("add", Binary::Arith);
    subtract => binary("subtract", Binary::Arith);
    multiply => binary("multiply", Binary::Arith);
    divide => binary("divide", Binary::Arith);
    power => binary("power", Binary::Arith);
    maximum => binary("maximum", Binary::Arith);
    mod_ => binary("mod", Binary::Arith);
    floor_mod => binary("floor_mod", Binary::Arith);
    floor_divide => binary("floor_divide", Binary::Arith);
    minimum => binary("minimum", Binary::Arith);
    equal => binary("equal", Binary::Equality);
    not_equal => binary("not_equal", Binary::Equality);
    less => binary("less", Binary::Order);
    greater => binary("greater", Binary::Order);
    less_equal => binary("less_equal", Binary::Order);
    greater_equal => binary("greater_equal", Binary::Order);
    logical_and => binary("logical_and", Binary::Logical);
    logical_or => binary("logical_or", Binary::Logical);
    logical_xor => binary("logical_xor", Binary::Logical);
}

/// The broadcast shape of `a` and `b`, or `op: cannot broadcast A with B (dimension x vs y)`.
pub(crate) fn broadcast(c: &Call, a: Tensor, b: Tensor) -> Result<Vec<tumble_ir::Dim>, RelError> {
    broadcast_shapes(a.shape, b.shape).map_err(|(x, y)| {
        c.err(format!(
            "cannot broadcast {a} with {b} (dimension {x} vs {y})"
        ))
    })
}

fn binary(op: &'static str, args: &[Ty], attrs: &Attrs, kind: Binary) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 2)?;
    let a = c.tensor(0, "lhs")?;
    let b = c.tensor(1, "rhs")?;
    match kind {
        Binary::Arith | Binary::Order => {
            c.want_numeric(0, "lhs", a)?;
            c.want_numeric(1, "rhs", b)?;
        }
        Binary::Equality => {}
        Binary::Logical => {
            c.want_bool(0, "lhs", a)?;
            c.want_bool(1, "rhs", b)?;
        }
    }
    c.same_dtype(a, b)?;
    let shape = broadcast(&c, a, b)?;
    let dtype = match kind {
        Binary::Arith => a.dtype,
        Binary::Equality | Binary::Order | Binary::Logical => DType::Bool,
    };
    Ok(Ty::tensor(shape, dtype))
}

/// `nn.bias_add(data, bias, axis=1)`: adds a 1-D bias along `axis`.
pub fn bias_add(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.bias_add", args, attrs, 2)?;
    let data = c.tensor(0, "input")?;
    let bias = c.tensor(1, "bias")?;
    c.want_numeric(0, "input", data)?;
    c.same_dtype(data, bias)?;
    let axis = c.axis(c.int_or("axis", 1)?, data.rank())?;
    let [len] = *bias.shape else {
        return Err(c.err_at(
            1,
            format!("bias must be 1-D, found rank {} in {bias}", bias.rank()),
        ));
    };
    let want = data.shape.get(axis).copied().unwrap_or(tumble_ir::Dim::Any);
    if !dims_match(len, want) {
        return Err(c.err(format!(
            "bias has length {len} but input has {want} along axis {axis}"
        )));
    }
    Ok(data.ty.clone())
}

/// `where(condition, x, y)`: picks from `x` where `condition` holds, else from `y`; all three
/// broadcast together.
pub fn where_(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("where", args, attrs, 3)?;
    let cond = c.tensor(0, "condition")?;
    let x = c.tensor(1, "x")?;
    let y = c.tensor(2, "y")?;
    c.want_bool(0, "condition", cond)?;
    c.same_dtype(x, y)?;
    let xy = broadcast(&c, x, y)?;
    let shape = broadcast_shapes(cond.shape, &xy).map_err(|(p, q)| {
        c.err(format!(
            "cannot broadcast condition {cond} with the branches' shape {} (dimension {p} vs {q})",
            super::fmt_dims(&xy)
        ))
    })?;
    Ok(Ty::tensor(shape, x.dtype))
}
