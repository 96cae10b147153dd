//! [`Tensor`]: a shape plus a shared, contiguous row-major [`Buffer`].

use std::fmt;
use std::sync::Arc;

use tumble_ir::DType;

use crate::buffer::{with_vec, Buffer, BufferMut, Element};
use crate::shape::{self, format_shape, num_elements};
use crate::TensorError;

/// An owned n-d tensor: always contiguous and row-major, its elements in an `Arc`-shared buffer.
///
/// Invariant: `data.len() == num_elements(shape)` (checked by every constructor, and kept by the
/// mutable accessors, which hand out slices, never the `Vec`). A tensor is one pointer to its
/// [`Inner`] (shape and buffer): cloning is one reference-count increment and allocates nothing
/// (the interpreter clones weights at every call and block invocation, and every value it moves
/// is a pointer wide), reshapes and same-dtype casts share the buffer under a new `Inner`, and
/// [`Tensor::make_mut`] copies the buffer on write when it is shared.
///
/// `PartialEq` is exact (same shape, dtype and elements; NaN != NaN); use [`Tensor::allclose`] for
/// numeric comparison.
#[derive(Clone, PartialEq)]
pub struct Tensor(Arc<Inner>);

/// What a tensor points to: its shape (inline up to rank 4, the zoo's ranks) and its buffer,
/// which reshapes share.
#[derive(Clone, PartialEq)]
struct Inner {
    shape: Shape,
    data: Arc<Buffer>,
}

type Shape = smallvec::SmallVec<[usize; 4]>;

impl Tensor {
    fn of(shape: Shape, data: Arc<Buffer>) -> Tensor {
        Tensor(Arc::new(Inner { shape, data }))
    }

    fn data(&self) -> &Arc<Buffer> {
        &self.0.data
    }

    /// The buffer to write, copied first where either level is shared.
    fn buffer_mut(&mut self) -> &mut Buffer {
        Arc::make_mut(&mut Arc::make_mut(&mut self.0).data)
    }
}

macro_rules! typed_ctor {
    ($name:ident, $t:ty) => {
        #[doc = concat!("[`Tensor::from_vec`] for `", stringify!($t), "` (pins the element type of literals).")]
        pub fn $name(shape: impl Into<Vec<usize>>, values: Vec<$t>) -> Result<Tensor, TensorError> {
            Tensor::from_vec(shape, values)
        }
    };
}

macro_rules! typed_view {
    ($name:ident, $t:ty) => {
        #[doc = concat!("The elements as `&[", stringify!($t), "]` if that is the dtype.")]
        pub fn $name(&self) -> Option<&[$t]> {
            self.data().as_slice()
        }
    };
}

impl Tensor {
    /// Pairs a shape with a buffer, checking that the element counts agree (and that the shape's
    /// element count does not overflow).
    pub fn new(shape: impl Into<Vec<usize>>, data: Buffer) -> Result<Tensor, TensorError> {
        Tensor::checked(Shape::from_vec(shape.into()), data)
    }

    /// [`Tensor::new`] from a borrowed shape: no allocation for the shape up to rank 4 (decoding
    /// makes a small tensor per tree node).
    pub fn with_shape(shape: &[usize], data: Buffer) -> Result<Tensor, TensorError> {
        Tensor::checked(Shape::from_slice(shape), data)
    }

    fn checked(shape: Shape, data: Buffer) -> Result<Tensor, TensorError> {
        let expected = num_elements(&shape)?;
        if data.len() != expected {
            return Err(TensorError::ElementCount {
                shape: shape.to_vec(),
                expected,
                got: data.len(),
            });
        }
        Ok(Tensor::of(shape, Arc::new(data)))
    }

    /// [`Tensor::new`] from a typed `Vec`; the dtype follows `T`.
    pub fn from_vec<T: Element>(
        shape: impl Into<Vec<usize>>,
        values: Vec<T>,
    ) -> Result<Tensor, TensorError> {
        Tensor::new(shape, T::into_buffer(values))
    }

    typed_ctor!(from_f32, f32);
    typed_ctor!(from_f64, f64);
    typed_ctor!(from_i32, i32);
    typed_ctor!(from_i64, i64);
    typed_ctor!(from_bool, bool);

    /// A tensor of zeros (false for bool).
    pub fn zeros(shape: impl Into<Vec<usize>>, dtype: DType) -> Result<Tensor, TensorError> {
        Tensor::full_f64(shape, dtype, 0.0)
    }

    /// A tensor filled with `value` cast to `dtype` (see [`Element`] for the cast rules).
    pub fn full_f64(
        shape: impl Into<Vec<usize>>,
        dtype: DType,
        value: f64,
    ) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        let n = num_elements(&shape)?;
        Ok(Tensor::of(
            Shape::from_vec(shape),
            Arc::new(Buffer::full(dtype, n, value)),
        ))
    }

    /// A rank-0 tensor holding `value`.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor::of(Shape::new(), Arc::new(T::into_buffer(vec![value])))
    }

    pub fn scalar_f32(value: f32) -> Tensor {
        Tensor::scalar(value)
    }

    pub fn scalar_f64(value: f64) -> Tensor {
        Tensor::scalar(value)
    }

    pub fn scalar_i32(value: i32) -> Tensor {
        Tensor::scalar(value)
    }

    pub fn scalar_i64(value: i64) -> Tensor {
        Tensor::scalar(value)
    }

    pub fn scalar_bool(value: bool) -> Tensor {
        Tensor::scalar(value)
    }

    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    pub fn dtype(&self) -> DType {
        self.data().dtype()
    }

    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements (1 for rank 0).
    pub fn len(&self) -> usize {
        self.data().len()
    }

    pub fn is_empty(&self) -> bool {
        self.data().is_empty()
    }

    /// Row-major strides in elements (see [`shape::strides`]).
    pub fn strides(&self) -> Vec<usize> {
        shape::strides(self.shape())
    }

    pub fn buffer(&self) -> &Buffer {
        self.data()
    }

    /// Whether no element is NaN or infinite (always, for integer and boolean tensors).
    pub fn all_finite(&self) -> bool {
        match self.buffer() {
            Buffer::F32(v) => all_finite_f32(v),
            Buffer::F64(v) => none_in_chunks(v, non_finite64),
            _ => true,
        }
    }

    /// Sets every subnormal element to zero (float tensors; a copy first if the buffer is
    /// shared) and says how many there were. The scan for them is [`Tensor::all_finite`]'s, so
    /// a tensor without any (nearly every one) costs one vectorized read.
    pub fn flush_subnormals(&mut self) -> usize {
        let any = match self.buffer() {
            Buffer::F32(v) => !none_in_chunks(v, subnormal32),
            Buffer::F64(v) => !none_in_chunks(v, subnormal64),
            _ => false,
        };
        if !any {
            return 0;
        }
        fn zero<T: Copy + Default>(v: &mut [T], hit: impl Fn(T) -> bool) -> usize {
            let mut n = 0;
            for x in v.iter_mut().filter(|x| hit(**x)) {
                *x = T::default();
                n += 1;
            }
            n
        }
        if let Some(v) = self.make_mut_slice::<f32>() {
            zero(v, subnormal32)
        } else {
            self.make_mut_slice::<f64>()
                .map_or(0, |v| zero(v, subnormal64))
        }
    }

    /// The buffer, without copying when this tensor is its only owner.
    pub fn into_buffer(self) -> Buffer {
        Arc::unwrap_or_clone(Arc::unwrap_or_clone(self.0).data)
    }

    /// The elements as `&[T]` if `T` is the dtype.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        self.data().as_slice()
    }

    typed_view!(as_f32, f32);
    typed_view!(as_f64, f64);
    typed_view!(as_i32, i32);
    typed_view!(as_i64, i64);
    typed_view!(as_bool, bool);

    /// Mutable access to the elements, copying the buffer first if another tensor shares it.
    pub fn make_mut(&mut self) -> BufferMut<'_> {
        self.buffer_mut().as_buffer_mut()
    }

    /// [`Tensor::make_mut`] as `&mut [T]` if `T` is the dtype (no copy is made otherwise).
    pub fn make_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if self.dtype() != T::DTYPE {
            return None;
        }
        self.buffer_mut().as_mut_slice()
    }

    /// Whether `self` and `other` share one buffer (clones, reshapes and same-dtype casts do).
    pub fn shares_buffer(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(self.data(), other.data())
    }

    /// Whether `self` and `other` are the same tensor: one buffer and one shape (a clone shares
    /// the whole tensor, compared by pointer first; otherwise the shapes by value).
    pub fn same_tensor(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.shares_buffer(other) && self.0.shape == other.0.shape)
    }

    /// How many tensors share this one's buffer (itself included): exact when it is 1, a lower
    /// bound otherwise (clones share one `Inner`, reshapes one buffer).
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0) + Arc::strong_count(self.data()) - 1
    }

    /// An identity of the shared buffer: equal for tensors that [`Tensor::shares_buffer`], stable
    /// while any of them lives (used to key caches of packed weights and launch groups).
    pub fn buffer_id(&self) -> usize {
        Arc::as_ptr(self.data()) as usize
    }

    /// A handle that recognizes this tensor's buffer without keeping it alive: a cache keyed by
    /// [`Tensor::buffer_id`] can tell a live entry from a buffer that was freed and whose address
    /// came back (while the handle lives, the address is not reused).
    pub fn watch(&self) -> BufferWatch {
        BufferWatch(Arc::downgrade(self.data()))
    }

    /// All elements as f64 (bool as 0/1; i64 beyond 2^53 rounds).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.data().to_f64_vec()
    }

    /// All elements as i64 (exact for int and bool tensors; floats truncate toward zero,
    /// saturating, NaN → 0).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        self.data().to_i64_vec()
    }

    /// Element at a flat (row-major) position as f64, `None` past the end.
    pub fn get_f64(&self, flat: usize) -> Option<f64> {
        self.data().get_f64(flat)
    }

    /// The single element, for a tensor with exactly one element (rank 0 or all dims 1).
    fn single<R>(&self, f: impl FnOnce(&Buffer) -> Option<R>) -> Result<R, TensorError> {
        if self.len() == 1 {
            if let Some(r) = f(self.data()) {
                return Ok(r);
            }
        }
        Err(TensorError::NotScalar {
            shape: self.shape().to_vec(),
        })
    }

    /// The single element as f64 (bool as 0/1). Error unless the tensor has exactly one element.
    pub fn scalar_as_f64(&self) -> Result<f64, TensorError> {
        self.single(|b| b.get_f64(0))
    }

    /// The single element as i64, with the cast rules of [`Element`] (floats truncate toward
    /// zero). Error unless the tensor has exactly one element.
    pub fn scalar_as_i64(&self) -> Result<i64, TensorError> {
        self.single(|b| with_vec!(b, v => v.first().map(|x| x.to_i64())))
    }

    /// The single element as bool (nonzero is true). Error unless the tensor has exactly one
    /// element.
    pub fn scalar_as_bool(&self) -> Result<bool, TensorError> {
        self.single(|b| with_vec!(b, v => v.first().map(|x| x.to_bool())))
    }

    /// This tensor converted to `dtype` (numpy `astype`; rules at [`Element`]). Converting to the
    /// same dtype shares the buffer.
    pub fn cast(&self, dtype: DType) -> Tensor {
        if self.dtype() == dtype {
            return self.clone();
        }
        Tensor::of(self.0.shape.clone(), Arc::new(self.data().cast(dtype)))
    }

    /// The same elements under another shape with the same element count; shares the buffer.
    pub fn reshape(&self, shape: impl Into<Vec<usize>>) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        if num_elements(&shape)? != self.len() {
            return Err(TensorError::Reshape {
                from: self.shape().to_vec(),
                to: shape,
            });
        }
        Ok(Tensor::of(Shape::from_vec(shape), Arc::clone(self.data())))
    }

    /// The numpy `broadcast_to`: a tensor of `shape` whose elements repeat this one's along the
    /// broadcast axes (materialized; a plain clone when the shape is already `shape`).
    pub fn broadcast_to(&self, shape: impl Into<Vec<usize>>) -> Result<Tensor, TensorError> {
        let target = shape.into();
        if *target == *self.shape() {
            return Ok(self.clone());
        }
        let compatible = target.len() >= self.rank()
            && shape::broadcast_shapes(self.shape(), &target).is_ok_and(|s| s == target);
        if !compatible {
            return Err(TensorError::BroadcastTo {
                from: self.shape().to_vec(),
                to: target,
            });
        }
        let n = num_elements(&target)?;
        let mut indices = Vec::with_capacity(n);
        if n > 0 {
            let mut idx = vec![0; target.len()];
            loop {
                indices.push(shape::broadcast_index(&idx, self.shape()));
                if !shape::increment_index(&mut idx, &target) {
                    break;
                }
            }
        }
        self.take(target, &indices)
    }

    /// A new tensor of `shape` whose flat element `i` is this tensor's flat element `indices[i]`:
    /// the one dtype-generic data-movement primitive (transpose, slice, gather, tile, reverse
    /// and broadcast are all an index map plus `take`). Errors on a count mismatch or an index
    /// past the end.
    pub fn take(
        &self,
        shape: impl Into<Vec<usize>>,
        indices: &[usize],
    ) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        let expected = num_elements(&shape)?;
        if indices.len() != expected {
            return Err(TensorError::ElementCount {
                shape,
                expected,
                got: indices.len(),
            });
        }
        Ok(Tensor::of(
            Shape::from_vec(shape),
            Arc::new(self.data().take(indices)?),
        ))
    }

    fn check_comparable(&self, other: &Tensor) -> Result<(), TensorError> {
        if self.shape() == other.shape() && self.dtype() == other.dtype() {
            Ok(())
        } else {
            Err(TensorError::Mismatch {
                a_shape: self.shape().to_vec(),
                a_dtype: self.dtype(),
                b_shape: other.shape().to_vec(),
                b_dtype: other.dtype(),
            })
        }
    }

    /// numpy `allclose(self, other, rtol, atol, equal_nan=True)` without broadcasting: same shape
    /// and dtype (else `false`), and per element `|a - b| <= atol + rtol * |b|`, where NaN is
    /// close only to NaN, and an infinity only to the same infinity. Values compare as f64.
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> bool {
        if self.check_comparable(other).is_err() {
            return false;
        }
        let close = |a: f64, b: f64| {
            if a.is_nan() || b.is_nan() {
                a.is_nan() && b.is_nan()
            } else if a == b {
                true // also covers equal infinities, where a - b would be NaN
            } else if a.is_infinite() || b.is_infinite() {
                false // else `inf <= atol + rtol * inf` would hold for any other value
            } else {
                (a - b).abs() <= atol + rtol * b.abs()
            }
        };
        (0..self.len()).all(|i| match (self.get_f64(i), other.get_f64(i)) {
            (Some(a), Some(b)) => close(a, b),
            _ => false, // unreachable: same shape, so same length
        })
    }

    /// Largest `|a - b|` over all elements (0 for empty tensors), as f64. NaN against NaN and an
    /// infinity against the same infinity count as 0; NaN against a number, or an infinity
    /// against anything else, count as `+inf`. Errors if shapes or dtypes differ.
    pub fn max_abs_diff(&self, other: &Tensor) -> Result<f64, TensorError> {
        self.check_comparable(other)?;
        let diff = |a: f64, b: f64| {
            if (a.is_nan() && b.is_nan()) || a == b {
                0.0
            } else if a.is_nan() || b.is_nan() {
                f64::INFINITY
            } else {
                (a - b).abs() // inf - finite = inf; inf - (-inf) = inf
            }
        };
        let a = self.to_f64_vec();
        let b = other.to_f64_vec();
        Ok(a.iter()
            .zip(&b)
            .map(|(&x, &y)| diff(x, y))
            .fold(0.0, f64::max))
    }
}

/// How many elements `Display`/`Debug` print before `...`.
const SHOWN: usize = 8;

impl fmt::Display for Tensor {
    /// `Tensor[(2, 3), float32] [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]`, at most 8 values then `...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor[{}, {}] [",
            format_shape(self.shape()),
            self.dtype()
        )?;
        self.data().fmt_head(f, SHOWN)?;
        f.write_str("]")
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ordinary_elements` is false exactly where `all_finite` is false or `flush_subnormals`
    /// would flush something: NaN, ±inf and subnormals of either sign anywhere, from any start;
    /// zeros of either sign, the smallest normals and the largest finite values are ordinary.
    #[test]
    fn ordinary_elements_agree_with_the_two_scans() {
        for n in [
            1usize,
            7,
            FINITE_CHUNK - 1,
            FINITE_CHUNK + 1,
            2 * FINITE_CHUNK + 3,
        ] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
            v[0] = f32::MAX;
            v[n - 1] = -f32::MIN_POSITIVE;
            v[n / 2] = -0.0;
            assert!(ordinary_elements(&Buffer::F32(v.clone()), 0), "n {n}");
            let v64: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
            assert!(ordinary_elements(&Buffer::F64(v64.clone()), 0), "n {n} f64");
            for at in [0, n / 2, n - 1] {
                for bad in [
                    f32::NAN,
                    f32::NEG_INFINITY,
                    f32::MIN_POSITIVE / 2.0,
                    -f32::from_bits(1),
                ] {
                    let mut w = v.clone();
                    w[at] = bad;
                    let mut t = Tensor::from_vec(vec![n], w.clone()).unwrap();
                    let flagged = !t.all_finite() || t.flush_subnormals() > 0;
                    assert!(flagged, "n {n} at {at} {bad}");
                    assert!(
                        !ordinary_elements(&Buffer::F32(w.clone()), 0),
                        "n {n} at {at}"
                    );
                    // Scanned from past the odd element, the rest is ordinary.
                    assert!(
                        ordinary_elements(&Buffer::F32(w), at + 1),
                        "n {n} from {at}"
                    );
                }
                let mut w64 = v64.clone();
                w64[at] = f64::from_bits(1);
                assert!(
                    !ordinary_elements(&Buffer::F64(w64), 0),
                    "n {n} at {at} f64"
                );
            }
        }
        assert!(ordinary_elements(&Buffer::I32(vec![0, -1]), 0));
        assert!(ordinary_elements(&Buffer::F32(vec![1.0]), 5));
    }

    /// A NaN or an infinity anywhere — first, last, across a chunk boundary — is found; the
    /// largest finite values, subnormals and signed zeros are finite.
    #[test]
    fn non_finite_elements_are_found_wherever_they_are() {
        for n in [
            1usize,
            7,
            FINITE_CHUNK - 1,
            FINITE_CHUNK,
            FINITE_CHUNK + 1,
            3 * FINITE_CHUNK + 5,
        ] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
            v[0] = f32::MAX;
            v[n - 1] = -f32::MIN_POSITIVE / 2.0;
            let t = Tensor::from_vec(vec![n], v.clone()).unwrap();
            assert!(t.all_finite(), "n {n}");
            let d = Tensor::from_vec(vec![n], v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>())
                .unwrap();
            assert!(d.all_finite(), "n {n} f64");
            for at in [0, n / 2, n.saturating_sub(2), n - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
                    let mut w = v.clone();
                    w[at] = bad;
                    assert!(!all_finite_f32(&w), "n {n} at {at} {bad}");
                    let mut w64: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
                    w64[at] = f64::from(bad);
                    assert!(!Tensor::from_vec(vec![n], w64).unwrap().all_finite());
                }
            }
        }
        assert!(Tensor::from_vec(vec![2], vec![1i32, -5])
            .unwrap()
            .all_finite());
        assert!(Tensor::from_vec(vec![0], Vec::<f32>::new())
            .unwrap()
            .all_finite());
    }

    /// Subnormals anywhere — first, last, across a chunk boundary, of either sign — become zero
    /// and are counted; normals (the smallest included), zeros and non-finite values stay, and
    /// a buffer held elsewhere is copied first.
    #[test]
    fn subnormal_elements_are_flushed_wherever_they_are() {
        for n in [
            1usize,
            7,
            FINITE_CHUNK,
            FINITE_CHUNK + 1,
            3 * FINITE_CHUNK + 5,
        ] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut t = Tensor::from_vec(vec![n], v.clone()).unwrap();
            assert_eq!(t.flush_subnormals(), 0, "n {n}");
            for at in [0, n / 2, n - 1] {
                let mut w = v.clone();
                w[at] = -f32::MIN_POSITIVE / 3.0;
                w[n - 1 - at] = f32::MIN_POSITIVE / 7.0;
                let held = Tensor::from_vec(vec![n], w.clone()).unwrap();
                let mut t = held.clone();
                let want = if at == n - 1 - at { 1 } else { 2 };
                assert_eq!(t.flush_subnormals(), want, "n {n} at {at}");
                let got = t.as_f32().unwrap();
                assert_eq!((got[at], got[n - 1 - at]), (0.0, 0.0));
                assert_eq!(
                    held.as_f32().unwrap()[at],
                    w[at],
                    "the holder's copy is untouched"
                );
                let mut w64: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
                w64[at] = f64::MIN_POSITIVE / 3.0;
                let mut d = Tensor::from_vec(vec![n], w64).unwrap();
                assert_eq!(d.flush_subnormals(), 1, "n {n} at {at} f64");
                assert_eq!(d.to_f64_vec()[at], 0.0);
            }
        }
        let mut edge = t_f32(
            &[5],
            &[
                f32::MIN_POSITIVE,
                -0.0,
                f32::NAN,
                f32::INFINITY,
                -f32::MIN_POSITIVE,
            ],
        );
        assert_eq!(edge.flush_subnormals(), 0);
        let mut ints = Tensor::from_vec(vec![2], vec![1i32, 0]).unwrap();
        assert_eq!(ints.flush_subnormals(), 0);
    }

    fn t_f32(shape: &[usize], v: &[f32]) -> Tensor {
        Tensor::from_f32(shape, v.to_vec()).unwrap()
    }

    /// A watch recognizes its buffer through clones and reshapes, never a tensor written after
    /// it was taken (the write moves or copies the data), and says when the buffer is gone.
    #[test]
    fn buffer_watch_follows_the_buffer_not_the_address() {
        let t = t_f32(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let w = t.watch();
        let clone = t.clone();
        let flat = t.reshape(vec![4]).unwrap();
        assert!(w.holds(&t) && w.holds(&clone) && w.holds(&flat) && w.alive());
        assert!(!w.holds(&t_f32(&[2, 2], &[1.0, 2.0, 3.0, 4.0])));
        // Written while shared: a copy, which the watch does not hold.
        let mut shared = t.clone();
        shared.make_mut_slice::<f32>().unwrap()[0] = 9.0;
        assert!(!w.holds(&shared) && w.holds(&t));
        drop((clone, flat));
        // Written by its only holder: the data moves out of the watched allocation.
        let mut only = t;
        only.make_mut_slice::<f32>().unwrap()[0] = 7.0;
        assert!(!w.holds(&only));
        drop(only);
        assert!(!w.alive());
    }

    #[test]
    fn construction_checks_counts() {
        let t = Tensor::from_f32([2, 3], vec![0.0; 6]).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.dtype(), DType::Float32);
        assert_eq!((t.rank(), t.len(), t.is_empty()), (2, 6, false));
        assert_eq!(t.strides(), vec![3, 1]);

        let err = Tensor::from_f32([2, 3], vec![0.0; 5]).unwrap_err();
        assert_eq!(
            err,
            TensorError::ElementCount {
                shape: vec![2, 3],
                expected: 6,
                got: 5
            }
        );
        assert_eq!(err.to_string(), "shape (2, 3) needs 6 elements, got 5");

        // Rank 0 holds exactly one element.
        assert!(Tensor::from_i64(Vec::new(), vec![]).is_err());
        let s = Tensor::from_i64([], vec![7]).unwrap();
        assert_eq!((s.rank(), s.len()), (0, 1));
        // Zero-size dims hold none.
        let e = Tensor::from_bool([3, 0], vec![]).unwrap();
        assert!(e.is_empty());
        assert!(Tensor::new([0], Buffer::F64(vec![1.0])).is_err());
    }

    #[test]
    fn huge_shapes_are_errors_not_panics() {
        let err = Tensor::from_f32([usize::MAX, 2], vec![]).unwrap_err();
        assert!(matches!(err, TensorError::ShapeOverflow { .. }));
        assert!(err.to_string().contains("overflows"), "{err}");
        assert!(Tensor::zeros([usize::MAX, 2], DType::Bool).is_err());
        assert!(Tensor::full_f64([1 << 40, 1 << 40], DType::Int32, 1.0).is_err());
        let t = Tensor::scalar_f32(1.0);
        assert!(matches!(
            t.reshape([usize::MAX, usize::MAX]),
            Err(TensorError::ShapeOverflow { .. })
        ));
        assert!(t.broadcast_to([usize::MAX, 3]).is_err());
        // Zero elements despite huge other dims: fine, and strides do not overflow.
        let e = Tensor::zeros([0, usize::MAX, usize::MAX], DType::Float64).unwrap();
        assert_eq!(e.len(), 0);
        assert_eq!(e.strides().len(), 3);
    }

    #[test]
    fn fills_and_scalars() {
        let z = Tensor::zeros([2], DType::Int32).unwrap();
        assert_eq!(z.as_i32(), Some(&[0, 0][..]));
        let f = Tensor::full_f64([3], DType::Int64, -2.7).unwrap();
        assert_eq!(f.as_i64(), Some(&[-2, -2, -2][..]));
        let b = Tensor::full_f64([1], DType::Bool, 0.5).unwrap();
        assert_eq!(b.as_bool(), Some(&[true][..]));

        assert_eq!(Tensor::scalar_f32(1.5).scalar_as_f64(), Ok(1.5));
        assert_eq!(Tensor::scalar_i32(-3).scalar_as_i64(), Ok(-3));
        assert_eq!(Tensor::scalar_bool(true).scalar_as_f64(), Ok(1.0));
        assert_eq!(Tensor::scalar_f64(-0.0).scalar_as_bool(), Ok(false));
        assert_eq!(Tensor::scalar_f64(-2.9).scalar_as_i64(), Ok(-2));
        // One element in any rank counts as a scalar.
        assert_eq!(t_f32(&[1, 1], &[4.0]).scalar_as_i64(), Ok(4));

        let err = t_f32(&[2], &[1.0, 2.0]).scalar_as_f64().unwrap_err();
        assert_eq!(
            err.to_string(),
            "expected a scalar (a tensor with exactly one element), got shape (2,) with 2 elements"
        );
        assert!(Tensor::zeros([0], DType::Bool)
            .unwrap()
            .scalar_as_bool()
            .is_err());
    }

    #[test]
    fn cast_semantics() {
        let f =
            Tensor::from_f64([8], vec![1.9, -1.9, 0.0, -0.0, f64::NAN, 1e20, -1e20, 0.5]).unwrap();
        // float -> int truncates toward zero, saturates, NaN -> 0.
        assert_eq!(
            f.cast(DType::Int32).as_i32(),
            Some(&[1, -1, 0, 0, 0, i32::MAX, i32::MIN, 0][..])
        );
        // -> bool is "nonzero"; NaN is nonzero.
        assert_eq!(
            f.cast(DType::Bool).as_bool(),
            Some(&[true, true, false, false, true, true, true, true][..])
        );
        // bool -> numbers is 0/1.
        let b = Tensor::from_bool([2], vec![true, false]).unwrap();
        assert_eq!(b.cast(DType::Float32).as_f32(), Some(&[1.0, 0.0][..]));
        assert_eq!(b.cast(DType::Int64).as_i64(), Some(&[1, 0][..]));
        // int64 -> int32 wraps (numpy astype).
        let i = Tensor::from_i64([2], vec![1 << 32 | 5, -1]).unwrap();
        assert_eq!(i.cast(DType::Int32).as_i32(), Some(&[5, -1][..]));
        // int -> float, f64 -> f32 rounding.
        assert_eq!(
            i.cast(DType::Float64).as_f64(),
            Some(&[4294967301.0, -1.0][..])
        );
        let g = Tensor::from_f64([1], vec![0.1])
            .unwrap()
            .cast(DType::Float32);
        assert_eq!(g.as_f32(), Some(&[0.1f32][..]));
        // Every dtype to every dtype keeps the shape; same dtype shares the buffer.
        for from in DType::ALL {
            let t = Tensor::zeros([2, 1], from).unwrap();
            for to in DType::ALL {
                let c = t.cast(to);
                assert_eq!((c.shape(), c.dtype()), (&[2, 1][..], to));
                assert_eq!(c.shares_buffer(&t), from == to);
            }
        }
    }

    #[test]
    fn reshape_shares_the_buffer() {
        let t = Tensor::from_i32([2, 3], (0..6).collect()).unwrap();
        let r = t.reshape([3, 2]).unwrap();
        assert!(r.shares_buffer(&t));
        assert_eq!(r.shape(), &[3, 2]);
        assert_eq!(r.as_i32(), t.as_i32());
        assert!(t.reshape([6]).unwrap().shares_buffer(&t));
        let s = Tensor::scalar_f32(1.0).reshape([1, 1, 1]).unwrap();
        assert_eq!(s.reshape([]).unwrap().rank(), 0);

        let err = t.reshape([4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot reshape a tensor of shape (2, 3) (6 elements) to shape (4,) (4 elements)"
        );
    }

    #[test]
    fn copy_on_write() {
        let mut a = Tensor::from_f32([3], vec![1.0, 2.0, 3.0]).unwrap();
        let b = a.clone();
        assert!(a.shares_buffer(&b));
        // Shared: writing copies first, `b` is untouched.
        match a.make_mut() {
            BufferMut::F32(s) => s[0] = 10.0,
            other => panic!("unexpected {other:?}"),
        }
        assert!(!a.shares_buffer(&b));
        assert_eq!(a.as_f32(), Some(&[10.0, 2.0, 3.0][..]));
        assert_eq!(b.as_f32(), Some(&[1.0, 2.0, 3.0][..]));
        // Unique: writes in place (the buffer address does not change).
        let before = a.as_f32().map(<[f32]>::as_ptr);
        if let Some(s) = a.make_mut_slice::<f32>() {
            s[1] = 20.0;
        }
        assert_eq!(a.as_f32().map(<[f32]>::as_ptr), before);
        assert_eq!(a.as_f32(), Some(&[10.0, 20.0, 3.0][..]));
        // Wrong type: None, and no copy of a shared buffer.
        let c = a.clone();
        assert!(a.make_mut_slice::<i32>().is_none());
        assert!(a.shares_buffer(&c));
        // into_buffer of a unique tensor does not copy.
        let ptr = b.as_f32().map(<[f32]>::as_ptr);
        let buf = b.into_buffer();
        assert_eq!(buf.as_slice::<f32>().map(<[f32]>::as_ptr), ptr);
    }

    #[test]
    fn clones_and_reshapes_share_one_buffer_two_ways() {
        // A clone shares the tensor's `Inner`, a reshape only its buffer: both count as holders,
        // both are copied away from on write, and neither sees the other's writes.
        let mut a = Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(a.holders(), 1);
        let clone = a.clone();
        let view = a.reshape([4]).unwrap();
        assert!(a.holders() >= 2 && view.holders() >= 2);
        assert!(a.same_tensor(&clone) && !a.same_tensor(&view) && a.shares_buffer(&view));
        assert!(a.same_tensor(&view.reshape([2, 2]).unwrap()));
        if let Some(s) = a.make_mut_slice::<f32>() {
            s[0] = 9.0;
        }
        assert_eq!(a.as_f32(), Some(&[9.0, 2.0, 3.0, 4.0][..]));
        assert_eq!(clone.as_f32(), Some(&[1.0, 2.0, 3.0, 4.0][..]));
        assert_eq!(view.as_f32(), Some(&[1.0, 2.0, 3.0, 4.0][..]));
        assert_eq!(a.holders(), 1);
        // The reshape alone holds the first buffer once the clone is gone.
        drop(clone);
        assert_eq!(view.holders(), 1);
        let ptr = view.as_f32().map(<[f32]>::as_ptr);
        assert_eq!(
            view.into_buffer().as_slice::<f32>().map(<[f32]>::as_ptr),
            ptr
        );
        // A shared `Inner` is copied out of, not taken, by `into_buffer`.
        let b = a.clone();
        let buf = a.into_buffer();
        assert_eq!(buf.as_slice::<f32>(), b.as_f32());
        assert_ne!(
            buf.as_slice::<f32>().map(<[f32]>::as_ptr),
            b.as_f32().map(<[f32]>::as_ptr)
        );
        // A clone is one pointer: values holding tensors stay small.
        assert_eq!(std::mem::size_of::<Tensor>(), std::mem::size_of::<usize>());
    }

    #[test]
    fn accessors_in_f64() {
        let t = Tensor::from_bool([2], vec![false, true]).unwrap();
        assert_eq!(t.to_f64_vec(), vec![0.0, 1.0]);
        assert_eq!(t.to_i64_vec(), vec![0, 1]);
        let big = Tensor::from_i64([2], vec![i64::MAX, -7]).unwrap();
        assert_eq!(big.to_i64_vec(), vec![i64::MAX, -7]);
        let f = Tensor::from_f32([2], vec![-2.7, 1e30]).unwrap();
        assert_eq!(f.to_i64_vec(), vec![-2, i64::MAX]);
        assert_eq!(t.get_f64(1), Some(1.0));
        assert_eq!(t.get_f64(2), None);
        assert_eq!(t.as_f32(), None);
        assert_eq!(t.as_slice::<bool>(), Some(&[false, true][..]));
    }

    #[test]
    fn take_and_broadcast_to() {
        let t = Tensor::from_i32([2, 3], (0..6).collect()).unwrap();
        // Transpose as an index map.
        let idx: Vec<usize> = (0..6)
            .map(|f| {
                let o = shape::unravel(f, &[3, 2]);
                shape::ravel(&[o[1], o[0]], &[2, 3])
            })
            .collect();
        let tt = t.take([3, 2], &idx).unwrap();
        assert_eq!(tt.as_i32(), Some(&[0, 3, 1, 4, 2, 5][..]));
        assert!(matches!(
            t.take([2], &[0, 6]),
            Err(TensorError::IndexOutOfBounds { index: 6, len: 6 })
        ));
        assert!(matches!(
            t.take([3], &[0]),
            Err(TensorError::ElementCount { .. })
        ));

        let row = Tensor::from_f32([3], vec![1.0, 2.0, 3.0]).unwrap();
        let b = row.broadcast_to([2, 3]).unwrap();
        assert_eq!(b.as_f32(), Some(&[1.0, 2.0, 3.0, 1.0, 2.0, 3.0][..]));
        let col = Tensor::from_f32([2, 1], vec![1.0, 2.0]).unwrap();
        let b = col.broadcast_to([2, 2]).unwrap();
        assert_eq!(b.as_f32(), Some(&[1.0, 1.0, 2.0, 2.0][..]));
        let s = Tensor::scalar_bool(true).broadcast_to([0, 4]).unwrap();
        assert_eq!((s.shape(), s.len()), (&[0, 4][..], 0));
        assert!(row.broadcast_to([3]).unwrap().shares_buffer(&row));
        // Only towards the target: (3,) does not broadcast to (1,), nor (2, 3) to (3,).
        assert!(matches!(
            row.broadcast_to([1]),
            Err(TensorError::BroadcastTo { .. })
        ));
        assert!(t.broadcast_to([3]).is_err());
    }

    #[test]
    fn allclose_and_nan() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let a = t_f32(&[4], &[1.0, nan, inf, -inf]);
        let b = t_f32(&[4], &[1.0 + 1e-6, nan, inf, -inf]);
        assert!(a.allclose(&b, 1e-5, 1e-8));
        assert_eq!(a.max_abs_diff(&b).map(|d| d < 2e-6), Ok(true));
        // NaN against a number is never close, and counts as an infinite difference.
        let c = t_f32(&[4], &[1.0, 0.0, inf, -inf]);
        assert!(!a.allclose(&c, 1.0, 1.0));
        assert_eq!(a.max_abs_diff(&c), Ok(f64::INFINITY));
        // Opposite infinities are not close.
        let d = t_f32(&[4], &[1.0, nan, -inf, -inf]);
        assert!(!a.allclose(&d, 1.0, 1.0));
        assert_eq!(a.max_abs_diff(&d), Ok(f64::INFINITY));
        // An infinity is not close to any finite value, on either side.
        let big = t_f32(&[1], &[f32::MAX]);
        let top = t_f32(&[1], &[inf]);
        assert!(!big.allclose(&top, 1.0, 1.0));
        assert!(!top.allclose(&big, 1.0, 1.0));
        assert_eq!(big.max_abs_diff(&top), Ok(f64::INFINITY));
        // Tolerances: |a - b| <= atol + rtol * |b|.
        let x = t_f32(&[1], &[100.0]);
        let y = t_f32(&[1], &[101.0]);
        assert!(x.allclose(&y, 0.01, 0.0));
        assert!(!x.allclose(&y, 0.0, 0.5));
        assert!(x.allclose(&y, 0.0, 1.0));
        // Shape or dtype mismatch: not close, and an error for max_abs_diff.
        assert!(!x.allclose(&x.reshape([1, 1]).unwrap(), 1.0, 1.0));
        assert!(!x.allclose(&x.cast(DType::Float64), 1.0, 1.0));
        let err = x.max_abs_diff(&x.cast(DType::Int32)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot compare tensors of different shape or dtype: (1,) float32 vs (1,) int32"
        );
        // Empty tensors are trivially close.
        let e = Tensor::zeros([0, 3], DType::Float32).unwrap();
        assert!(e.allclose(&e.clone(), 0.0, 0.0));
        assert_eq!(e.max_abs_diff(&e), Ok(0.0));
        // Exact equality is PartialEq, where NaN != NaN.
        assert_ne!(a, a.clone());
        assert_eq!(x, x.clone());
    }

    #[test]
    fn display_shows_shape_dtype_and_head() {
        let t = t_f32(&[2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 1.0]);
        assert_eq!(
            t.to_string(),
            "Tensor[(2, 3), float32] [0.1, 0.2, 0.3, 0.4, 0.5, 1.0]"
        );
        let long = Tensor::from_i64([10], (0..10).collect()).unwrap();
        assert_eq!(
            format!("{long:?}"),
            "Tensor[(10,), int64] [0, 1, 2, 3, 4, 5, 6, 7, ...]"
        );
        assert_eq!(
            Tensor::scalar_bool(true).to_string(),
            "Tensor[(), bool] [true]"
        );
        assert_eq!(
            Tensor::zeros([0], DType::Float64).unwrap().to_string(),
            "Tensor[(0,), float64] []"
        );
    }
}

/// What [`Tensor::watch`] returns.
#[derive(Clone, Debug)]
pub struct BufferWatch(std::sync::Weak<Buffer>);

impl BufferWatch {
    /// Whether `t` holds the watched buffer (which is then alive and, being shared with `t`'s
    /// holders, unchanged: tensors copy a shared buffer before writing).
    pub fn holds(&self, t: &Tensor) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(t.data()))
    }

    /// Whether any tensor still holds the buffer.
    pub fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// The watched buffer's [`Tensor::buffer_id`] (no other buffer takes it while the watch
    /// lives).
    pub fn buffer_id(&self) -> usize {
        self.0.as_ptr() as usize
    }
}

/// Elements per chunk of [`Tensor::all_finite`]'s scan: it stops at the first chunk with a NaN or
/// an infinity, and within a chunk runs without a branch per element, so the compiler vectorizes
/// it (a short-circuiting `any(|x| !x.is_finite())` ran element by element: 5.6 M weights of the
/// SST model at ~4 instructions each, at load and after every training epoch).
const FINITE_CHUNK: usize = 4096;
const F32_EXPONENT: u32 = 0x7f80_0000;
const F64_EXPONENT: u64 = 0x7ff0_0000_0000_0000;

/// NaN or ±inf: every exponent bit set.
#[inline(always)]
fn non_finite32(x: f32) -> bool {
    x.to_bits() & F32_EXPONENT == F32_EXPONENT
}

#[inline(always)]
fn non_finite64(x: f64) -> bool {
    x.to_bits() & F64_EXPONENT == F64_EXPONENT
}

/// Subnormal: no exponent bit set, some mantissa bit set.
#[inline(always)]
fn subnormal32(x: f32) -> bool {
    x.to_bits() & F32_EXPONENT == 0 && x.to_bits() & 0x007f_ffff != 0
}

#[inline(always)]
fn subnormal64(x: f64) -> bool {
    x.to_bits() & F64_EXPONENT == 0 && x.to_bits() & 0x000f_ffff_ffff_ffff != 0
}

/// [`Tensor::all_finite`] of f32 elements: no element has every exponent bit set (NaN, ±inf).
pub fn all_finite_f32(v: &[f32]) -> bool {
    none_in_chunks(v, non_finite32)
}

/// Whether every element of `buffer` is an ordinary number: no float is NaN, infinite or
/// subnormal (integers and booleans always are). One vectorized read that answers both
/// [`Tensor::all_finite`] and [`Tensor::flush_subnormals`] for nearly every weight, so a loader
/// can scan each part of a tensor while it is still in cache and skip both passes over memory.
pub fn ordinary_elements(buffer: &Buffer, from: usize) -> bool {
    let odd32 = |x: f32| non_finite32(x) || subnormal32(x);
    let odd64 = |x: f64| non_finite64(x) || subnormal64(x);
    match buffer {
        Buffer::F32(v) => none_in_chunks(v.get(from..).unwrap_or_default(), odd32),
        Buffer::F64(v) => none_in_chunks(v.get(from..).unwrap_or_default(), odd64),
        _ => true,
    }
}

/// Whether `hit` holds for no element of `v`: chunk by chunk, without a branch per element.
#[inline(always)]
fn none_in_chunks<T: Copy>(v: &[T], hit: impl Fn(T) -> bool) -> bool {
    v.chunks(FINITE_CHUNK)
        .all(|c| c.iter().fold(0u32, |a, &x| a | u32::from(hit(x))) == 0)
}
