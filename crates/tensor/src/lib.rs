//! tumble's owned n-d tensor: what the reference kernels, the reference interpreter, model I/O and
//! (later) the batching runtime pass around. Not a general array library: no views, no arithmetic,
//! no file formats; only construction, casts, reshape, broadcasting, index arithmetic and test
//! comparisons.
//!
//! # Design
//!
//! - [`Buffer`] holds the elements flat, one variant per [`DType`] (`f32`, `f64`, `i32`, `i64`,
//!   `bool`). Kernels `match` on it for typed loops; [`Element`] (sealed, implemented by exactly
//!   those five types) lets dtype-generic code get typed slices (`as_slice::<T>()`) and defines
//!   the one set of cast rules (numpy `astype`: float → int truncates toward zero, saturating,
//!   NaN → 0; int → narrower int wraps; → bool is `!= 0`; bool → number is 0/1).
//! - [`Tensor`] is a shape plus an `Arc<Buffer>`, always **contiguous row-major**. Strides are
//!   derived ([`Tensor::strides`]), never stored. Cloning shares the buffer, so the interpreter
//!   can pass tensors around freely; [`Tensor::make_mut`] copies on write when shared. `reshape`
//!   and same-dtype `cast` share the buffer too.
//! - **No views.** The reference path favours obviously-correct plain loops over flat,
//!   contiguous data; strided views would make every kernel handle arbitrary strides (or call a
//!   "make contiguous" step anyway). Data movement (transpose, slice, gather, tile, broadcast)
//!   is instead an index map plus [`Tensor::take`], which materializes a new tensor. The batching
//!   runtime can add its own arena-backed representation later without changing this one.
//! - Invariant: buffer length == element count of the shape. Every constructor checks it with
//!   checked multiplication (shapes come from user files: `[usize::MAX, 2]` is an error, not a
//!   panic); mutable access hands out slices ([`BufferMut`]), so it cannot be broken.
//!
//! # API
//!
//! - Construction: [`Tensor::new`]`(shape, Buffer)`, [`Tensor::from_vec`] and
//!   `from_f32/from_f64/from_i32/from_i64/from_bool`, [`Tensor::zeros`], [`Tensor::full_f64`]
//!   (casting), [`Tensor::scalar`] and `scalar_f32/…/scalar_bool`. Shapes are
//!   `impl Into<Vec<usize>>` (`[2, 3]`, `vec![..]`, `&[..]`).
//! - Access: `shape`, `dtype`, `rank`, `len`, `is_empty`, `strides`, `buffer`, `into_buffer`,
//!   `as_slice::<T>`, `as_f32/…/as_bool`, `to_f64_vec`, `to_i64_vec`, `get_f64(flat)`,
//!   `scalar_as_f64/scalar_as_i64/scalar_as_bool` (exactly one element, any rank),
//!   `make_mut` / `make_mut_slice::<T>` (copy-on-write), `shares_buffer`.
//! - Transformations: `cast`, `reshape`, `broadcast_to`, `take`.
//! - Tests: `allclose` (numpy semantics with `equal_nan`), `max_abs_diff`; `==` is exact.
//! - Index arithmetic in [`shape`]: `num_elements`, `strides`, `ravel`, `unravel`,
//!   `increment_index` (row-major odometer), `broadcast_shapes`, `broadcast_index`,
//!   `format_shape` (`(2, 3)`, `(4,)`, `()`).
//! - Errors: [`TensorError`], whose messages name the shapes involved.
//! - Randomness: [`Rng`], a seeded xoshiro256** generator (SplitMix64 seeding) with uniform,
//!   normal and integer-range draws, the same sequence on every platform.
//!
//! This crate depends on `tumble-ir` (for [`DType`]) and nothing else of tumble.

mod buffer;
mod error;
pub mod pool;
mod rng;
mod serial;
pub mod shape;
mod stack;
mod tensor;

pub use buffer::{Buffer, BufferMut, Element};
pub use error::TensorError;
pub use rng::Rng;
pub use shape::{broadcast_index, broadcast_shapes, ravel, unravel};
pub use tensor::{all_finite_f32, ordinary_elements, BufferWatch, Tensor};
pub use tumble_ir::DType;
