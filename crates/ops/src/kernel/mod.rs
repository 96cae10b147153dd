//! Reference kernels, grouped like the relations in [`crate::rel`] (same module and function
//! names), and the helpers they share.
//!
//! These kernels are the oracle every optimized kernel is tested against, so they favour clarity:
//! plain loops over flat, contiguous data; data movement as an index map plus
//! [`Tensor::take`]; no cleverness. Conventions:
//!
//! - **Arithmetic domains.** Elementwise and reduction kernels compute floats in `f64` and
//!   integers in `i64` ([`Values`]), then round once to the output dtype. For `+ - * /` on
//!   float32 this gives exactly float32 arithmetic (f64 is wide enough that double rounding is
//!   harmless); sums, dot products, means, variances and softmax denominators are accumulated in
//!   f64, so they are *more* accurate than a float32 loop. Integer arithmetic wraps (two's
//!   complement, like numpy): computed modulo 2^64 in i64 and truncated to int32, which is the
//!   same as wrapping int32 arithmetic.
//! - **Integer division** (`divide` on ints) truncates toward zero (C / TVM `truncdiv`, not
//!   numpy's floor division): `-7 / 2 = -3`. Division by zero is a [`KernelError`];
//!   `MIN / -1` wraps to `MIN`. Float division is IEEE (`1/0 = inf`, `0/0 = NaN`).
//! - **`power` on ints** is repeated multiplication, wrapping on overflow; `x ** 0 = 1` (also for
//!   `x = 0`); a negative exponent is a [`KernelError`] (as in numpy: "integers to negative
//!   integer powers are not allowed"). On floats it is `f64::powf`.
//! - **NaN** propagates through `maximum`, `minimum`, `max`, `min`, `clip` and `nn.relu` (numpy's
//!   behaviour); `argmax`/`argmin` treat NaN as the extreme value (the first NaN wins, as numpy).
//! - **Empty reductions**: `sum` of nothing is 0, `mean` of nothing is NaN for floats and an error
//!   for ints (division by zero), `max`/`min`/`argmax`/`argmin` of nothing are errors.
//! - **Shapes come from the relations.** Kernels whose output shape needs attribute logic
//!   (`reshape` with 0/-1/-2/-3/-4, `squeeze`, `expand_dims`, `split`, reductions with
//!   `keepdims`/`exclude`, creation ops) compute it by calling the operator's relation on the
//!   concrete argument types, and parse attributes with the relation's own helpers
//!   (`slice_spec`, `take_spec`, `transpose_perm`, `reduce_axes`), so the two cannot drift.
//! - **No panics on user data.** Arguments are re-checked (a kernel may be called without
//!   [`crate::eval`]), slices are read with `get`/iterators, and every failure is a
//!   [`KernelError`] whose message starts with the operator name.

pub mod broadcast;
pub mod create;
pub mod gemm;
pub mod layout;
pub mod nn;
pub mod reduce;
pub mod unary;

use crate::rel::Call;
use crate::{ty_of, KernelError, OpValue, Relation};
use tumble_ir::{Attrs, DType, Ty};
use tumble_tensor::shape::{increment_index, num_elements};
use tumble_tensor::{Tensor, TensorError};

/// One kernel call: the operator name (for messages), the arguments, their types (for the
/// relation helpers) and the attributes.
pub(crate) struct KCall<'a> {
    pub op: &'static str,
    pub args: &'a [OpValue],
    pub attrs: &'a Attrs,
    tys: Vec<Ty>,
}

impl<'a> KCall<'a> {
    /// Starts a call of `op`, which takes `arity` arguments.
    pub fn new(
        op: &'static str,
        args: &'a [OpValue],
        attrs: &'a Attrs,
        arity: usize,
    ) -> Result<Self, KernelError> {
        if args.len() != arity {
            return Err(KernelError::new(format!(
                "{op}: expected {arity} argument{}, found {}",
                if arity == 1 { "" } else { "s" },
                args.len()
            )));
        }
        Ok(KCall {
            op,
            args,
            attrs,
            tys: args.iter().map(ty_of).collect(),
        })
    }

    /// An error; `msg` follows the operator name.
    pub fn err(&self, msg: impl std::fmt::Display) -> KernelError {
        KernelError::new(format!("{}: {msg}", self.op))
    }

    /// Converts a tensor-library error, prefixing the operator name.
    pub fn t<T>(&self, r: Result<T, TensorError>) -> Result<T, KernelError> {
        r.map_err(|e| self.err(e))
    }

    /// Argument `i` as a tensor; `role` names it in messages.
    pub fn tensor(&self, i: usize, role: &str) -> Result<&'a Tensor, KernelError> {
        match self.args.get(i) {
            Some(OpValue::Tensor(t)) => Ok(t),
            Some(OpValue::Tuple(_)) => {
                Err(self.err(format!("{role} must be a tensor, found a tuple")))
            }
            None => Err(self.err(format!("missing argument {i} ({role})"))),
        }
    }

    /// Argument `i` as a tuple of tensors.
    pub fn tuple(&self, i: usize, role: &str) -> Result<&'a [Tensor], KernelError> {
        match self.args.get(i) {
            Some(OpValue::Tuple(ts)) => Ok(ts),
            Some(OpValue::Tensor(_)) => {
                Err(self.err(format!("{role} must be a tuple of tensors, found a tensor")))
            }
            None => Err(self.err(format!("missing argument {i} ({role})"))),
        }
    }

    /// The relation helpers' view of this call (attribute readers, axis normalization).
    pub fn rel(&self) -> Call<'_> {
        Call {
            op: self.op,
            args: &self.tys,
            attrs: self.attrs,
        }
    }

    /// The result type by `relation` on the concrete argument types.
    pub fn out_ty(&self, relation: Relation) -> Result<Ty, KernelError> {
        Ok(relation(&self.tys, self.attrs)?)
    }

    /// The result by `relation`, which must be a tensor type: its (concrete) shape and dtype.
    pub fn out_tensor(&self, relation: Relation) -> Result<(Vec<usize>, DType), KernelError> {
        let ty = self.out_ty(relation)?;
        tensor_shape(&ty).ok_or_else(|| {
            self.err(format!(
                "internal error: result type {ty} is not a concrete tensor type"
            ))
        })
    }
}

/// The concrete shape and dtype of a fully known tensor type.
pub(crate) fn tensor_shape(ty: &Ty) -> Option<(Vec<usize>, DType)> {
    let (dims, dtype) = ty.as_tensor()?;
    let shape = dims
        .iter()
        .map(|d| d.known().and_then(|n| usize::try_from(n).ok()))
        .collect::<Option<Vec<usize>>>()?;
    Some((shape, dtype))
}

/// Elements in the arithmetic domain of their dtype: floats as f64, ints as i64, bools as bool.
/// Converting a tensor to `Values` and back to its dtype is lossless.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Values {
    F(Vec<f64>),
    I(Vec<i64>),
    B(Vec<bool>),
}

impl Values {
    pub fn of(t: &Tensor) -> Values {
        match t.dtype() {
            DType::Float32 | DType::Float64 => Values::F(t.to_f64_vec()),
            DType::Int32 | DType::Int64 => Values::I(t.to_i64_vec()),
            DType::Bool => Values::B(t.to_i64_vec().into_iter().map(|v| v != 0).collect()),
        }
    }

    /// A tensor of `shape` and `dtype` from these values, rounded (floats), wrapped (ints) or
    /// converted by the tensor crate's cast rules.
    pub fn into_tensor(self, shape: &[usize], dtype: DType) -> Result<Tensor, TensorError> {
        let t = match self {
            Values::F(v) => Tensor::from_f64(shape, v)?,
            Values::I(v) => Tensor::from_i64(shape, v)?,
            Values::B(v) => Tensor::from_bool(shape, v)?,
        };
        Ok(t.cast(dtype))
    }
}

/// Row `r` of `data` viewed as rows of `len` elements (empty when `len` is 0 or out of range).
pub(crate) fn row<T>(data: &[T], r: usize, len: usize) -> &[T] {
    r.checked_mul(len)
        .and_then(|start| data.get(start..start.checked_add(len)?))
        .unwrap_or_default()
}

/// Product of `dims` (1 for none), checked.
pub(crate) fn product(dims: &[usize]) -> Result<usize, TensorError> {
    num_elements(dims)
}

/// `x` with its axes permuted: output axis `i` is input axis `perm[i]` (numpy `transpose`).
/// `perm` must be a permutation of `0..rank` (checked).
pub(crate) fn permute(x: &Tensor, perm: &[usize]) -> Result<Tensor, String> {
    let shape = x.shape();
    let mut seen = vec![false; shape.len()];
    let ok = perm.len() == shape.len()
        && perm
            .iter()
            .all(|&p| seen.get_mut(p).is_some_and(|s| !std::mem::replace(s, true)));
    if !ok {
        return Err(format!(
            "{perm:?} is not a permutation of the axes of shape {shape:?}"
        ));
    }
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(x.clone());
    }
    let in_strides = x.strides();
    let out_shape: Vec<usize> = perm.iter().filter_map(|&p| shape.get(p).copied()).collect();
    let out_strides: Vec<usize> = perm
        .iter()
        .filter_map(|&p| in_strides.get(p).copied())
        .collect();
    let n = x.len();
    let mut indices = Vec::with_capacity(n);
    if n > 0 {
        let mut idx = vec![0; out_shape.len()];
        loop {
            indices.push(idx.iter().zip(&out_strides).map(|(i, s)| i * s).sum());
            if !increment_index(&mut idx, &out_shape) {
                break;
            }
        }
    }
    x.take(out_shape, &indices).map_err(|e| e.to_string())
}

/// The inverse of a permutation: `inverse(p)[p[i]] = i`.
pub(crate) fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        if let Some(slot) = inv.get_mut(p) {
            *slot = i;
        }
    }
    inv
}

/// Runs `$body` with the type alias `$T` bound to the Rust element type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            tumble_ir::DType::Float32 => {
                type $T = f32;
                $body
            }
            tumble_ir::DType::Float64 => {
                type $T = f64;
                $body
            }
            tumble_ir::DType::Int32 => {
                type $T = i32;
                $body
            }
            tumble_ir::DType::Int64 => {
                type $T = i64;
                $body
            }
            tumble_ir::DType::Bool => {
                type $T = bool;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

/// Defines kernel functions `fn name(args, attrs, ctx)` that forward to a shared implementation
/// with the operator's name, like [`crate::rel::relations`].
macro_rules! kernels {
    ($($fname:ident => $imp:ident($op:literal $(, $extra:expr)*));* $(;)?) => {
        $(
            pub fn $fname(
                args: &[$crate::OpValue],
                attrs: &tumble_ir::Attrs,
                _ctx: &mut $crate::OpCtx,
            ) -> Result<$crate::OpValue, $crate::KernelError> {
                $imp($op, args, attrs $(, $extra)*)
            }
        )*
    };
}
pub(crate) use kernels;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_zero_length() {
        let d = [1, 2, 3, 4, 5, 6];
        assert_eq!(row(&d, 1, 3), &[4, 5, 6]);
        assert_eq!(row(&d, 2, 3), &[] as &[i32]);
        assert_eq!(row(&d, 5, 0), &[] as &[i32]);
    }

    #[test]
    fn permute_and_inverse() {
        let t = Tensor::from_i32([2, 3, 4], (0..24).collect()).unwrap();
        let p = permute(&t, &[2, 0, 1]).unwrap();
        assert_eq!(p.shape(), &[4, 2, 3]);
        // p[k, i, j] = t[i, j, k]
        assert_eq!(p.as_i32().unwrap()[..6], [0, 4, 8, 12, 16, 20]);
        let back = permute(&p, &inverse(&[2, 0, 1])).unwrap();
        assert_eq!(back, t);
        assert!(permute(&t, &[0, 0, 1]).is_err());
        assert!(permute(&t, &[0, 1]).is_err());
        let e = Tensor::zeros([0, 3], DType::Bool).unwrap();
        assert_eq!(permute(&e, &[1, 0]).unwrap().shape(), &[3, 0]);
    }

    #[test]
    fn values_round_trip() {
        for dtype in DType::ALL {
            let t = Tensor::from_i64([3], vec![1, 0, -5]).unwrap().cast(dtype);
            let back = Values::of(&t).into_tensor(&[3], dtype).unwrap();
            assert_eq!(back, t);
        }
    }
}
