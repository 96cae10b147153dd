//! Moving whole rows between tensors: stacking instances into a batch and reading one back. These
//! are the gather/scatter of the batching runtime's simple path (contiguous copies, one per row).

use crate::buffer::Buffer;
use crate::error::TensorError;
use crate::tensor::Tensor;

/// `$body(&mut v, parts, get)` into a vector `v` of `$first`'s element type with room for
/// `$len` elements: f32 from the thread's buffer pool (a batch stacked at every launch or step
/// comes back in a recycled buffer, and grows no vector by doubling), the others allocated.
macro_rules! per_dtype {
    ($first:expr, $parts:expr, $len:expr, $v:ident => $body:expr) => {
        match $first.buffer() {
            Buffer::F32(_) => {
                let mut $v: Vec<f32> = crate::pool::with_capacity_f32($len);
                $body(&mut $v, $parts, |t: &Tensor| t.as_f32())?;
                Buffer::F32($v)
            }
            Buffer::F64(_) => {
                let mut $v: Vec<f64> = Vec::with_capacity($len);
                $body(&mut $v, $parts, |t: &Tensor| t.as_f64())?;
                Buffer::F64($v)
            }
            Buffer::I32(_) => {
                let mut $v: Vec<i32> = Vec::with_capacity($len);
                $body(&mut $v, $parts, |t: &Tensor| t.as_i32())?;
                Buffer::I32($v)
            }
            Buffer::I64(_) => {
                let mut $v: Vec<i64> = Vec::with_capacity($len);
                $body(&mut $v, $parts, |t: &Tensor| t.as_i64())?;
                Buffer::I64($v)
            }
            Buffer::Bool(_) => {
                let mut $v: Vec<bool> = Vec::with_capacity($len);
                $body(&mut $v, $parts, |t: &Tensor| t.as_bool())?;
                Buffer::Bool($v)
            }
        }
    };
}

fn append_all<T: Copy>(
    out: &mut Vec<T>,
    parts: &[&Tensor],
    get: impl Fn(&Tensor) -> Option<&[T]>,
) -> Result<(), TensorError> {
    for p in parts {
        let s = get(p).ok_or_else(|| TensorError::Mismatch {
            a_shape: p.shape().to_vec(),
            a_dtype: p.dtype(),
            b_shape: p.shape().to_vec(),
            b_dtype: p.dtype(),
        })?;
        out.extend_from_slice(s);
    }
    Ok(())
}

impl Tensor {
    /// Stacks equally shaped tensors along a new leading axis: `n` tensors of shape `s` make one of
    /// shape `(n, s...)`. Errors if shapes or dtypes differ, or `parts` is empty.
    pub fn stack(parts: &[&Tensor]) -> Result<Tensor, TensorError> {
        let Some(first) = parts.first() else {
            return Err(TensorError::ElementCount {
                shape: vec![0],
                expected: 1,
                got: 0,
            });
        };
        for p in parts.iter().skip(1) {
            if p.shape() != first.shape() || p.dtype() != first.dtype() {
                return Err(TensorError::Mismatch {
                    a_shape: first.shape().to_vec(),
                    a_dtype: first.dtype(),
                    b_shape: p.shape().to_vec(),
                    b_dtype: p.dtype(),
                });
            }
        }
        let mut shape = Vec::with_capacity(first.rank() + 1);
        shape.push(parts.len());
        shape.extend_from_slice(first.shape());
        let buffer = per_dtype!(first, parts, parts.len() * first.len(), v => append_all);
        Tensor::new(shape, buffer)
    }

    /// Row `i` along the leading axis, copied out: shape `(n, s...)` gives shape `(s...)`.
    pub fn row(&self, i: usize) -> Result<Tensor, TensorError> {
        let n = self.shape().first().copied().unwrap_or(0);
        if i >= n {
            return Err(TensorError::IndexOutOfBounds { index: i, len: n });
        }
        let buffer = self.leading_range(i, 1);
        Tensor::new(self.shape()[1..].to_vec(), buffer)
    }

    /// Rows `start..start + len` along the leading axis, copied out: shape `(n, s...)` gives
    /// shape `(len, s...)`.
    pub fn rows(&self, start: usize, len: usize) -> Result<Tensor, TensorError> {
        let Some((&n, inner)) = self.shape().split_first() else {
            return Err(TensorError::IndexOutOfBounds {
                index: start,
                len: 0,
            });
        };
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(TensorError::IndexOutOfBounds {
                index: start.saturating_add(len),
                len: n,
            });
        }
        let mut shape = vec![len];
        shape.extend_from_slice(inner);
        Tensor::new(shape, self.leading_range(start, len))
    }

    /// The elements of rows `start..start + len` along the leading axis (in range: checked by
    /// the callers).
    fn leading_range(&self, start: usize, len: usize) -> Buffer {
        let row_len = self
            .shape()
            .get(1..)
            .unwrap_or_default()
            .iter()
            .product::<usize>();
        let range = start * row_len..(start + len) * row_len;
        match self.buffer() {
            Buffer::F32(v) => Buffer::F32(v[range].to_vec()),
            Buffer::F64(v) => Buffer::F64(v[range].to_vec()),
            Buffer::I32(v) => Buffer::I32(v[range].to_vec()),
            Buffer::I64(v) => Buffer::I64(v[range].to_vec()),
            Buffer::Bool(v) => Buffer::Bool(v[range].to_vec()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_then_row_round_trips_at_odd_sizes() {
        for n in [1usize, 7, 33] {
            let parts: Vec<Tensor> = (0..n)
                .map(|i| Tensor::from_f32([3], vec![i as f32, 1.0, 2.0]).unwrap())
                .collect();
            let refs: Vec<&Tensor> = parts.iter().collect();
            let s = Tensor::stack(&refs).unwrap();
            assert_eq!(s.shape(), &[n, 3]);
            for (i, p) in parts.iter().enumerate() {
                assert_eq!(&s.row(i).unwrap(), p);
            }
            assert!(s.row(n).is_err());
        }
    }

    #[test]
    fn stacking_mismatched_shapes_is_an_error() {
        let a = Tensor::from_i32([2], vec![1, 2]).unwrap();
        let b = Tensor::from_i32([3], vec![1, 2, 3]).unwrap();
        assert!(Tensor::stack(&[&a, &b]).is_err());
        assert!(Tensor::stack(&[]).is_err());
    }

    #[test]
    fn rows_cut_ranges_including_empty_ones() {
        let t = Tensor::from_i32([5, 2], (0..10).collect()).unwrap();
        assert_eq!(
            t.rows(1, 3).unwrap(),
            Tensor::from_i32([3, 2], (2..8).collect()).unwrap()
        );
        assert_eq!(t.rows(5, 0).unwrap().shape(), &[0, 2]);
        assert!(t.rows(4, 2).is_err());
        assert!(t.rows(usize::MAX, 2).is_err());
        // A scalar has no leading axis: an error, not a panic.
        assert!(Tensor::from_i32([], vec![7]).unwrap().rows(0, 0).is_err());
    }
}
