//! Flat, dtype-tagged element storage and the [`Element`] trait tying Rust types to [`DType`]s.

use std::fmt;

use tumble_ir::DType;

use crate::TensorError;

/// The elements of a tensor, flat in row-major order, one variant per [`DType`].
///
/// Kernels `match` on it to get a typed `Vec`/slice; dtype-generic code uses [`Element`] or the
/// f64 accessors instead.
#[derive(Clone, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

/// Large `f32` buffers go back to the freeing thread's pool for the next launch's outputs.
impl Drop for Buffer {
    fn drop(&mut self) {
        if let Buffer::F32(v) = self {
            crate::pool::recycle(std::mem::take(v));
        }
    }
}

/// Mutable access to a [`Buffer`]'s elements as slices: values can change, the length and dtype
/// (and so the tensor's shape invariant) cannot. Returned by [`crate::Tensor::make_mut`].
#[derive(Debug, PartialEq)]
pub enum BufferMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    I32(&'a mut [i32]),
    I64(&'a mut [i64]),
    Bool(&'a mut [bool]),
}

/// Runs `$body` with `$v` bound to the buffer's `Vec`, whatever its element type.
macro_rules! with_vec {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            Buffer::F32($v) => $body,
            Buffer::F64($v) => $body,
            Buffer::I32($v) => $body,
            Buffer::I64($v) => $body,
            Buffer::Bool($v) => $body,
        }
    };
}
pub(crate) use with_vec;

mod sealed {
    pub trait Sealed {}
}

/// A Rust element type of a tensor: exactly `f32`, `f64`, `i32`, `i64` and `bool` (sealed).
///
/// The `to_*` conversions are the cast semantics of the whole crate (numpy `astype`):
/// float → int truncates toward zero (Rust `as`: saturating at the integer bounds, NaN → 0, where
/// numpy's result is platform-defined); int → narrower int wraps; anything → bool is `!= 0`
/// (NaN → true); bool → number is 0 or 1.
pub trait Element: Copy + PartialEq + fmt::Debug + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: DType;
    fn into_buffer(values: Vec<Self>) -> Buffer;
    fn slice(buffer: &Buffer) -> Option<&[Self]>;
    fn slice_mut(buffer: &mut Buffer) -> Option<&mut [Self]>;
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn to_i32(self) -> i32;
    fn to_i64(self) -> i64;
    fn to_bool(self) -> bool;
}

macro_rules! element {
    ($t:ty, $dtype:ident, $variant:ident, |$x:ident| $f32:expr, $f64:expr, $i32:expr, $i64:expr, $bool:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn into_buffer(values: Vec<Self>) -> Buffer {
                Buffer::$variant(values)
            }
            fn slice(buffer: &Buffer) -> Option<&[Self]> {
                match buffer {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(buffer: &mut Buffer) -> Option<&mut [Self]> {
                match buffer {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn to_f32(self) -> f32 {
                let $x = self;
                $f32
            }
            fn to_f64(self) -> f64 {
                let $x = self;
                $f64
            }
            fn to_i32(self) -> i32 {
                let $x = self;
                $i32
            }
            fn to_i64(self) -> i64 {
                let $x = self;
                $i64
            }
            fn to_bool(self) -> bool {
                let $x = self;
                $bool
            }
        }
    };
}

element!(
    f32,
    Float32,
    F32,
    |x| x,
    x as f64,
    x as i32,
    x as i64,
    x != 0.0
);
element!(
    f64,
    Float64,
    F64,
    |x| x as f32,
    x,
    x as i32,
    x as i64,
    x != 0.0
);
element!(i32, Int32, I32, |x| x as f32, x as f64, x, x as i64, x != 0);
element!(i64, Int64, I64, |x| x as f32, x as f64, x as i32, x, x != 0);
element!(
    bool,
    Bool,
    Bool,
    |x| u8::from(x) as f32,
    u8::from(x) as f64,
    i32::from(x),
    i64::from(x),
    x
);

impl<T: Element> From<Vec<T>> for Buffer {
    fn from(values: Vec<T>) -> Buffer {
        T::into_buffer(values)
    }
}

/// Converts every element of `src` to `dtype` with the [`Element`] cast semantics.
fn convert<S: Element>(src: &[S], dtype: DType) -> Buffer {
    match dtype {
        DType::Float32 => Buffer::F32(src.iter().map(|x| x.to_f32()).collect()),
        DType::Float64 => Buffer::F64(src.iter().map(|x| x.to_f64()).collect()),
        DType::Int32 => Buffer::I32(src.iter().map(|x| x.to_i32()).collect()),
        DType::Int64 => Buffer::I64(src.iter().map(|x| x.to_i64()).collect()),
        DType::Bool => Buffer::Bool(src.iter().map(|x| x.to_bool()).collect()),
    }
}

fn take_slice<T: Element>(src: &[T], indices: &[usize]) -> Result<Buffer, TensorError> {
    let values = indices
        .iter()
        .map(|&i| {
            // The error made only when it happens (`ok_or` built and dropped one per element:
            // 4% of a gradient whose transposes ran on the reference rule).
            match src.get(i) {
                Some(&v) => Ok(v),
                None => Err(TensorError::IndexOutOfBounds {
                    index: i,
                    len: src.len(),
                }),
            }
        })
        .collect::<Result<Vec<T>, _>>()?;
    Ok(T::into_buffer(values))
}

impl Buffer {
    /// An empty buffer of `dtype` with room for `capacity` elements (for buffers filled by
    /// appending).
    pub fn with_capacity(dtype: DType, capacity: usize) -> Buffer {
        match dtype {
            DType::Float32 => Buffer::F32(Vec::with_capacity(capacity)),
            DType::Float64 => Buffer::F64(Vec::with_capacity(capacity)),
            DType::Int32 => Buffer::I32(Vec::with_capacity(capacity)),
            DType::Int64 => Buffer::I64(Vec::with_capacity(capacity)),
            DType::Bool => Buffer::Bool(Vec::with_capacity(capacity)),
        }
    }

    /// `len` zeros (false for bool) of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        Buffer::full(dtype, len, 0.0)
    }

    /// `len` copies of `value` cast to `dtype` (see [`Element`] for the cast rules).
    pub fn full(dtype: DType, len: usize, value: f64) -> Buffer {
        match dtype {
            DType::Float32 => Buffer::F32(vec![value.to_f32(); len]),
            DType::Float64 => Buffer::F64(vec![value; len]),
            DType::Int32 => Buffer::I32(vec![value.to_i32(); len]),
            DType::Int64 => Buffer::I64(vec![value.to_i64(); len]),
            DType::Bool => Buffer::Bool(vec![value.to_bool(); len]),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::Float32,
            Buffer::F64(_) => DType::Float64,
            Buffer::I32(_) => DType::Int32,
            Buffer::I64(_) => DType::Int64,
            Buffer::Bool(_) => DType::Bool,
        }
    }

    /// Faults in the pages of the next `elements` of spare capacity before they are filled
    /// ([`tumble_limits::prefault`]: a weights file decoded into a new buffer, a chunk at a time,
    /// each chunk's pages populated just before it is written — the whole buffer at once would
    /// zero it all first and write it again from beyond the caches).
    pub fn prefault_spare(&mut self, elements: usize) {
        with_vec!(self, v => {
            let spare = v.spare_capacity_mut();
            let n = elements.min(spare.len());
            tumble_limits::prefault(&mut spare[..n]);
        })
    }

    pub fn len(&self) -> usize {
        with_vec!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `&[T]` when `T` is this buffer's element type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::slice(self)
    }

    /// The elements as `&mut [T]` when `T` is this buffer's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        T::slice_mut(self)
    }

    /// Mutable slice access to the elements, whatever the dtype.
    pub fn as_buffer_mut(&mut self) -> BufferMut<'_> {
        match self {
            Buffer::F32(v) => BufferMut::F32(v),
            Buffer::F64(v) => BufferMut::F64(v),
            Buffer::I32(v) => BufferMut::I32(v),
            Buffer::I64(v) => BufferMut::I64(v),
            Buffer::Bool(v) => BufferMut::Bool(v),
        }
    }

    /// A copy converted to `dtype` (a plain clone when it already is).
    pub fn cast(&self, dtype: DType) -> Buffer {
        if self.dtype() == dtype {
            return self.clone();
        }
        with_vec!(self, v => convert(v, dtype))
    }

    /// Element `index` as f64 (bool as 0/1; i64 beyond 2^53 rounds), `None` past the end.
    pub fn get_f64(&self, index: usize) -> Option<f64> {
        with_vec!(self, v => v.get(index).map(|x| x.to_f64()))
    }

    /// All elements as f64 (bool as 0/1; i64 beyond 2^53 rounds).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_vec!(self, v => v.iter().map(|x| x.to_f64()).collect())
    }

    /// All elements as i64 (floats truncate toward zero, saturating, NaN → 0; bool as 0/1):
    /// exact for every integer and bool buffer.
    pub fn to_i64_vec(&self) -> Vec<i64> {
        with_vec!(self, v => v.iter().map(|x| x.to_i64()).collect())
    }

    /// A new buffer whose element `i` is `self[indices[i]]`, or the first out-of-range index.
    pub fn take(&self, indices: &[usize]) -> Result<Buffer, TensorError> {
        with_vec!(self, v => take_slice(v, indices))
    }

    /// Writes the first `limit` elements as `a, b, c` (`, ...` after them if there are more).
    pub(crate) fn fmt_head(&self, f: &mut fmt::Formatter<'_>, limit: usize) -> fmt::Result {
        fn head<T: fmt::Debug>(v: &[T], f: &mut fmt::Formatter<'_>, limit: usize) -> fmt::Result {
            for (i, x) in v.iter().take(limit).enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{x:?}")?;
            }
            if v.len() > limit {
                f.write_str(", ...")?;
            }
            Ok(())
        }
        with_vec!(self, v => head(v, f, limit))
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer[{}; {}] [", self.dtype(), self.len())?;
        self.fmt_head(f, 8)?;
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_len() {
        let b = Buffer::from(vec![1i64, 2, 3]);
        assert_eq!(b.dtype(), DType::Int64);
        assert_eq!(b.len(), 3);
        assert!(!b.is_empty());
        assert!(Buffer::zeros(DType::Bool, 0).is_empty());
        for d in DType::ALL {
            assert_eq!(Buffer::zeros(d, 2).dtype(), d);
        }
    }

    #[test]
    fn typed_access() {
        let mut b = Buffer::from(vec![1.5f32, 2.5]);
        assert_eq!(b.as_slice::<f32>(), Some(&[1.5f32, 2.5][..]));
        assert_eq!(b.as_slice::<f64>(), None);
        if let Some(s) = b.as_mut_slice::<f32>() {
            s[0] = 9.0;
        }
        assert_eq!(b.get_f64(0), Some(9.0));
        assert_eq!(b.get_f64(2), None);
        match b.as_buffer_mut() {
            BufferMut::F32(s) => s[1] = -1.0,
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(b.to_f64_vec(), vec![9.0, -1.0]);
    }

    #[test]
    fn take_checks_bounds() {
        let b = Buffer::from(vec![10i32, 20, 30]);
        assert_eq!(b.take(&[2, 0, 0]), Ok(Buffer::I32(vec![30, 10, 10])));
        assert_eq!(
            b.take(&[1, 3]),
            Err(TensorError::IndexOutOfBounds { index: 3, len: 3 })
        );
    }

    #[test]
    fn debug_truncates() {
        let b = Buffer::from((0..10).collect::<Vec<i32>>());
        assert_eq!(
            format!("{b:?}"),
            "Buffer[int32; 10] [0, 1, 2, 3, 4, 5, 6, 7, ...]"
        );
    }
}
