//! The one error type of this crate.

use std::fmt;

use tumble_ir::DType;

use crate::shape::format_shape;

/// Everything that can go wrong building or reshaping a tensor. Shapes and values often come from
/// user files, so every message names the shapes involved and what would have been valid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorError {
    /// A buffer's length does not match the element count of the shape it is paired with.
    ElementCount {
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    /// The product of the dims does not fit in `usize`.
    ShapeOverflow { shape: Vec<usize> },
    /// `reshape` to a shape with a different element count.
    Reshape { from: Vec<usize>, to: Vec<usize> },
    /// Two shapes that numpy broadcasting cannot combine; `axis` counts from the right (-1 is last).
    Broadcast {
        a: Vec<usize>,
        b: Vec<usize>,
        axis: isize,
    },
    /// `broadcast_to` a shape that the tensor's shape does not broadcast to (in that direction).
    BroadcastTo { from: Vec<usize>, to: Vec<usize> },
    /// A scalar was required but the tensor has zero or several elements.
    NotScalar { shape: Vec<usize> },
    /// A flat index past the end of a buffer.
    IndexOutOfBounds { index: usize, len: usize },
    /// Two tensors compared element by element differ in shape or dtype.
    Mismatch {
        a_shape: Vec<usize>,
        a_dtype: DType,
        b_shape: Vec<usize>,
        b_dtype: DType,
    },
}

impl fmt::Display for TensorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorError::ElementCount {
                shape,
                expected,
                got,
            } => write!(
                f,
                "shape {} needs {expected} elements, got {got}",
                format_shape(shape)
            ),
            TensorError::ShapeOverflow { shape } => write!(
                f,
                "shape {} has too many elements (the element count overflows usize)",
                format_shape(shape)
            ),
            TensorError::Reshape { from, to } => {
                let count = |s: &[usize]| match crate::shape::num_elements(s) {
                    Ok(n) => n.to_string(),
                    Err(_) => "too many".to_string(),
                };
                write!(
                    f,
                    "cannot reshape a tensor of shape {} ({} elements) to shape {} ({} elements)",
                    format_shape(from),
                    count(from),
                    format_shape(to),
                    count(to)
                )
            }
            TensorError::Broadcast { a, b, axis } => {
                // `axis` is negative, counted from the right; both shapes are right-aligned there.
                let dim = |s: &[usize]| {
                    // Right-aligned: axis -k is s[len - k]; a missing leading axis counts as 1.
                    s.len()
                        .checked_sub(axis.unsigned_abs())
                        .and_then(|i| s.get(i))
                        .map_or_else(|| "1".to_string(), |d| d.to_string())
                };
                write!(
                    f,
                    "shapes {} and {} do not broadcast: axis {axis} has sizes {} and {} \
                     (sizes must be equal or one of them 1)",
                    format_shape(a),
                    format_shape(b),
                    dim(a),
                    dim(b)
                )
            }
            TensorError::BroadcastTo { from, to } => write!(
                f,
                "cannot broadcast shape {} to shape {} (each dim must equal the target's or be 1, \
                 and the target rank must be at least the source rank)",
                format_shape(from),
                format_shape(to)
            ),
            TensorError::NotScalar { shape } => {
                let count = crate::shape::num_elements(shape)
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "too many".to_string());
                write!(
                    f,
                    "expected a scalar (a tensor with exactly one element), got shape {} with {count} elements",
                    format_shape(shape)
                )
            }
            TensorError::IndexOutOfBounds { index, len } => write!(
                f,
                "flat index {index} is out of bounds for a tensor with {len} elements"
            ),
            TensorError::Mismatch {
                a_shape,
                a_dtype,
                b_shape,
                b_dtype,
            } => write!(
                f,
                "cannot compare tensors of different shape or dtype: {} {a_dtype} vs {} {b_dtype}",
                format_shape(a_shape),
                format_shape(b_shape)
            ),
        }
    }
}

impl std::error::Error for TensorError {}
