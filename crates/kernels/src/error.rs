//! The one error type of this crate: every size mismatch is reported, never panicked on.

use std::fmt;

/// What went wrong in a kernel call. Returned (never panicked) for every invalid input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A buffer's length does not match the sizes it must have.
    Length {
        /// Which operand (e.g. `"w"`, `"c"`, `"a row 3"`).
        what: String,
        /// The length (or minimum length) it must have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// Two operands disagree on a dimension (e.g. `K` of `A` vs `K` of `W`).
    Shape(String),
    /// `rows × cols` does not fit in `usize`.
    Overflow,
    /// The requested micro-kernel is not supported by this CPU.
    Unsupported(&'static str),
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::Length {
                what,
                expected,
                actual,
            } => write!(f, "{what}: expected length {expected}, got {actual}"),
            KernelError::Shape(msg) => write!(f, "shape mismatch: {msg}"),
            KernelError::Overflow => write!(f, "size overflows usize"),
            KernelError::Unsupported(k) => {
                write!(f, "micro-kernel `{k}` is not supported by this CPU")
            }
        }
    }
}

impl std::error::Error for KernelError {}
