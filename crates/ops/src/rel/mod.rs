//! Shape relations, grouped by fusion class, and the helpers they share: argument extraction with
//! messages, attribute reading with defaults, axis normalization and shape broadcasting.
//!
//! Message conventions (every relation follows them):
//! - a message starts with the operator name and a colon: `nn.softmax: ...`;
//! - it says what was expected and what was found, naming arguments by role (`input`, `weight`,
//!   `bias`, `indices`, `lhs`/`rhs`, ...) and types in Relay syntax (`Tensor[(3, 4), float32]`);
//! - when one argument alone is to blame (wrong rank, wrong dtype kind, not a tensor) the error is
//!   [`RelError::at`] that argument; when two arguments disagree with each other (broadcast conflict,
//!   dtype mismatch, inner dimensions differ) or an attribute is wrong, no argument is blamed.

pub mod broadcast;
pub mod create;
pub mod gemm;
pub mod layout;
pub mod nn;
pub mod reduce;
pub mod unary;

use crate::RelError;
use tumble_ir::{AttrValue, Attrs, DType, Dim, Ty};

/// A tensor argument, borrowed from its type.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tensor<'a> {
    /// The whole type, for messages.
    pub ty: &'a Ty,
    pub shape: &'a [Dim],
    pub dtype: DType,
}

impl Tensor<'_> {
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// Writes the tensor's type in Relay syntax.
impl std::fmt::Display for Tensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.ty.fmt(f)
    }
}

/// One call being checked: the operator name (for messages), its arguments and attributes.
pub(crate) struct Call<'a> {
    pub op: &'static str,
    pub args: &'a [Ty],
    pub attrs: &'a Attrs,
}

impl<'a> Call<'a> {
    /// Starts checking a call of `op`, which takes `arity` positional arguments.
    pub fn new(
        op: &'static str,
        args: &'a [Ty],
        attrs: &'a Attrs,
        arity: usize,
    ) -> Result<Self, RelError> {
        if args.len() != arity {
            return Err(RelError::new(format!(
                "{op}: expected {arity} argument{}, found {}",
                if arity == 1 { "" } else { "s" },
                args.len()
            )));
        }
        Ok(Call { op, args, attrs })
    }

    /// An error not blamed on one argument; `msg` follows the operator name.
    pub fn err(&self, msg: impl std::fmt::Display) -> RelError {
        RelError::new(format!("{}: {msg}", self.op))
    }

    /// An error blamed on argument `i`.
    pub fn err_at(&self, i: usize, msg: impl std::fmt::Display) -> RelError {
        RelError::at(i, format!("{}: {msg}", self.op))
    }

    /// The type of argument `i` (callers have checked arity; still never panics).
    pub fn arg(&self, i: usize) -> Result<&'a Ty, RelError> {
        self.args
            .get(i)
            .ok_or_else(|| self.err(format!("missing argument {i}")))
    }

    /// Argument `i` as a tensor; `role` names it in messages (`input`, `weight`, ...).
    pub fn tensor(&self, i: usize, role: &str) -> Result<Tensor<'a>, RelError> {
        let ty = self.arg(i)?;
        self.as_tensor(ty, role).map_err(|m| self.err_at(i, m))
    }

    /// `ty` as a tensor, or the message body (without the op prefix) saying why not.
    pub fn as_tensor<'t>(&self, ty: &'t Ty, role: &str) -> Result<Tensor<'t>, String> {
        match ty {
            Ty::Tensor { shape, dtype } => {
                if let Some(d) = shape.iter().filter_map(|d| d.known()).find(|&d| d < 0) {
                    return Err(format!(
                        "{role} has a negative dimension {d} in its type {ty}"
                    ));
                }
                Ok(Tensor {
                    ty,
                    shape,
                    dtype: *dtype,
                })
            }
            Ty::Tuple(_) => Err(format!("{role} must be a tensor, found the tuple {ty}")),
            Ty::Func(..) => Err(format!("{role} must be a tensor, found the function {ty}")),
            Ty::Param(p) => Err(format!(
                "{role} must be a tensor, found the type parameter `{p}`"
            )),
            Ty::Adt(..) => Err(format!("{role} must be a tensor, found {ty}")),
            Ty::Var(_) => Err(format!(
                "{role} must be a tensor, found the unresolved type {ty}"
            )),
        }
    }

    // ---- dtype checks (blamed on argument `i`) ----

    pub fn want_float(&self, i: usize, role: &str, t: Tensor) -> Result<(), RelError> {
        if t.dtype.is_float() {
            Ok(())
        } else {
            Err(self.err_at(
                i,
                format!(
                    "{role} must have a float dtype (float32 or float64), found {}",
                    t.dtype
                ),
            ))
        }
    }

    /// Ints or floats, not bool.
    pub fn want_numeric(&self, i: usize, role: &str, t: Tensor) -> Result<(), RelError> {
        if t.dtype == DType::Bool {
            Err(self.err_at(
                i,
                format!("{role} must have a numeric dtype, found {}", t.dtype),
            ))
        } else {
            Ok(())
        }
    }

    pub fn want_bool(&self, i: usize, role: &str, t: Tensor) -> Result<(), RelError> {
        if t.dtype == DType::Bool {
            Ok(())
        } else {
            Err(self.err_at(i, format!("{role} must have dtype bool, found {}", t.dtype)))
        }
    }

    pub fn want_index(&self, i: usize, role: &str, t: Tensor) -> Result<(), RelError> {
        if t.dtype.is_int() {
            Ok(())
        } else {
            Err(self.err_at(
                i,
                format!("{role} must have dtype int32 or int64, found {}", t.dtype),
            ))
        }
    }

    /// Two arguments whose dtypes must agree (not blamed on either).
    pub fn same_dtype(&self, a: Tensor, b: Tensor) -> Result<(), RelError> {
        if a.dtype == b.dtype {
            Ok(())
        } else {
            Err(self.err(format!("dtype mismatch: {} vs {}", a.dtype, b.dtype)))
        }
    }

    // ---- attributes ----

    fn attr_err(&self, m: String) -> RelError {
        self.err(m)
    }

    pub fn int_or(&self, name: &str, default: i64) -> Result<i64, RelError> {
        Ok(self
            .attrs
            .int(name)
            .map_err(|m| self.attr_err(m))?
            .unwrap_or(default))
    }

    pub fn opt_int(&self, name: &str) -> Result<Option<i64>, RelError> {
        self.attrs.int(name).map_err(|m| self.attr_err(m))
    }

    pub fn bool_or(&self, name: &str, default: bool) -> Result<bool, RelError> {
        Ok(self
            .attrs
            .bool(name)
            .map_err(|m| self.attr_err(m))?
            .unwrap_or(default))
    }

    pub fn opt_float(&self, name: &str) -> Result<Option<f64>, RelError> {
        self.attrs.float(name).map_err(|m| self.attr_err(m))
    }

    pub fn req_float(&self, name: &str) -> Result<f64, RelError> {
        self.opt_float(name)?
            .ok_or_else(|| self.err(format!("missing required attribute `{name}`")))
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, RelError> {
        self.attrs.str(name).map_err(|m| self.attr_err(m))
    }

    pub fn opt_ints(&self, name: &str) -> Result<Option<Vec<i64>>, RelError> {
        self.attrs.ints(name).map_err(|m| self.attr_err(m))
    }

    pub fn req_ints(&self, name: &str) -> Result<Vec<i64>, RelError> {
        self.opt_ints(name)?
            .ok_or_else(|| self.err(format!("missing required attribute `{name}`")))
    }

    /// A dtype attribute; `None` when absent, `None` or the empty string (Relay's "same as input").
    pub fn opt_dtype(&self, name: &str) -> Result<Option<DType>, RelError> {
        match self.opt_str(name)? {
            None | Some("") => Ok(None),
            Some(s) => DType::from_name(s).map(Some).ok_or_else(|| {
                self.err(format!(
                    "attribute `{name}` must name a dtype (float32, float64, int32, int64, bool), found \"{s}\""
                ))
            }),
        }
    }

    /// A raw attribute value (for attributes whose meaning depends on the value's kind).
    pub fn raw(&self, name: &str) -> Option<&'a AttrValue> {
        match self.attrs.get(name) {
            None | Some(AttrValue::None) => None,
            Some(v) => Some(v),
        }
    }

    /// Normalizes `axis` (negative counts from the end) for a tensor of rank `rank`.
    pub fn axis(&self, axis: i64, rank: usize) -> Result<usize, RelError> {
        normalize_axis(axis, rank).ok_or_else(|| {
            self.err(format!(
                "axis {axis} is out of range for a tensor of rank {rank}"
            ))
        })
    }

    /// Normalizes a list of axes, rejecting out-of-range and duplicate ones.
    pub fn axes(&self, axes: &[i64], rank: usize) -> Result<Vec<usize>, RelError> {
        let mut out = Vec::with_capacity(axes.len());
        for &a in axes {
            let n = self.axis(a, rank)?;
            if out.contains(&n) {
                return Err(self.err(format!(
                    "axis {a} is listed twice in {} (as axis {n})",
                    fmt_ints(axes)
                )));
            }
            out.push(n);
        }
        Ok(out)
    }
}

/// `axis` in `[-rank, rank)` mapped to `[0, rank)`.
pub(crate) fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = i64::try_from(rank).ok()?;
    let a = if axis < 0 { axis.checked_add(r)? } else { axis };
    if (0..r).contains(&a) {
        usize::try_from(a).ok()
    } else {
        None
    }
}

/// Whether two dims may be equal (an Any dim matches anything).
pub(crate) fn dims_match(a: Dim, b: Dim) -> bool {
    match (a, b) {
        (Dim::Known(x), Dim::Known(y)) => x == y,
        _ => true,
    }
}

/// The more precise of two matching dims.
pub(crate) fn meet(a: Dim, b: Dim) -> Dim {
    match a {
        Dim::Known(_) => a,
        Dim::Any => b,
    }
}

/// Broadcasts two dims under numpy rules; `Err((a, b))` on a conflict of known dims.
pub(crate) fn broadcast_dim(a: Dim, b: Dim) -> Result<Dim, (Dim, Dim)> {
    match (a, b) {
        (Dim::Known(x), Dim::Known(y)) => {
            if x == y || y == 1 {
                Ok(a)
            } else if x == 1 {
                Ok(b)
            } else {
                Err((a, b))
            }
        }
        // `?` against 1 may be anything; against n it must be n or 1, so the result is n.
        (Dim::Known(1), Dim::Any) | (Dim::Any, Dim::Known(1)) => Ok(Dim::Any),
        (Dim::Known(_), Dim::Any) => Ok(a),
        (Dim::Any, _) => Ok(b),
    }
}

/// Broadcasts two shapes under numpy rules (aligned at the right).
pub(crate) fn broadcast_shapes(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, (Dim, Dim)> {
    let n = a.len().max(b.len());
    let mut out = vec![Dim::Any; n];
    for (k, slot) in out.iter_mut().enumerate() {
        // k counts from the left of the result; pick the dims aligned at the right.
        let from_right = n - 1 - k;
        let da = a
            .len()
            .checked_sub(from_right + 1)
            .and_then(|i| a.get(i))
            .copied()
            .unwrap_or(Dim::Known(1));
        let db = b
            .len()
            .checked_sub(from_right + 1)
            .and_then(|i| b.get(i))
            .copied()
            .unwrap_or(Dim::Known(1));
        *slot = broadcast_dim(da, db)?;
    }
    Ok(out)
}

/// Product of dims; `None` if any is Any or the product overflows.
pub(crate) fn known_product(dims: &[Dim]) -> Option<i64> {
    dims.iter()
        .try_fold(1i64, |acc, d| d.known().and_then(|n| acc.checked_mul(n)))
}

pub(crate) fn fmt_ints(v: &[i64]) -> String {
    let parts: Vec<String> = v.iter().map(|n| n.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

pub(crate) fn fmt_dims(v: &[Dim]) -> String {
    let parts: Vec<String> = v.iter().map(|n| n.to_string()).collect();
    format!("({})", parts.join(", "))
}

/// Defines relation functions `fn name(args, attrs)` that forward to a shared implementation with
/// the operator's name, e.g. `relations! { add => binary("add", Arith) }`.
macro_rules! relations {
    ($($fname:ident => $imp:ident($op:literal $(, $extra:expr)*));* $(;)?) => {
        $(
            pub fn $fname(
                args: &[tumble_ir::Ty],
                attrs: &tumble_ir::Attrs,
            ) -> Result<tumble_ir::Ty, $crate::RelError> {
                $imp($op, args, attrs $(, $extra)*)
            }
        )*
    };
}
pub(crate) use relations;
