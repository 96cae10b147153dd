//! Shape and index arithmetic on plain `&[usize]` shapes (row-major, last axis fastest).
//!
//! Kernels compute in flat indices and use these to move between flat and multi-dimensional form.
//! Index arguments are preconditions (an index produced from the same shape); the helpers never
//! panic on shapes alone, whatever their contents.

use crate::TensorError;

/// Number of elements of `shape` (1 for rank 0), or [`TensorError::ShapeOverflow`] when the
/// product does not fit in `usize`. A shape containing a 0 dim has 0 elements even if the other
/// dims would overflow.
pub fn num_elements(shape: &[usize]) -> Result<usize, TensorError> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| TensorError::ShapeOverflow {
            shape: shape.to_vec(),
        })
}

/// Row-major strides in elements: `strides[i]` = product of `shape[i+1..]`.
///
/// Saturates instead of overflowing: that can only happen in a shape with 0 elements (e.g.
/// `[0, huge, huge]`), whose strides are never used to address anything.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    let mut acc = 1usize;
    for (s, &d) in out.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d);
    }
    out
}

/// Flat (row-major) position of the multi-index `index` in `shape`.
///
/// Precondition: `index.len() == shape.len()` and `index[i] < shape[i]` (checked in debug builds).
/// Then the result is below the element count, so the arithmetic cannot overflow.
pub fn ravel(index: &[usize], shape: &[usize]) -> usize {
    debug_assert_eq!(index.len(), shape.len(), "ravel: rank mismatch");
    debug_assert!(
        index.iter().zip(shape).all(|(i, d)| i < d),
        "ravel: index {index:?} out of bounds for shape {shape:?}"
    );
    index.iter().zip(shape).fold(0usize, |flat, (&i, &d)| {
        flat.wrapping_mul(d).wrapping_add(i)
    })
}

/// Multi-index of the flat position `flat` in `shape`; the inverse of [`ravel`].
///
/// Precondition: `flat < num_elements(shape)`. (A 0 dim has no valid index; it yields 0 there
/// rather than dividing by zero.)
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (slot, &d) in index.iter_mut().zip(shape).rev() {
        *slot = flat.checked_rem(d).unwrap_or(0);
        flat = flat.checked_div(d).unwrap_or(0);
    }
    index
}

/// Advances `index` to the next multi-index of `shape` in row-major order (an odometer), returning
/// `false` (and leaving `index` all zeros) after the last one. Lets kernels walk a shape without a
/// division per element:
///
/// ```
/// # use tumble_tensor::shape::increment_index;
/// let shape = [2, 2];
/// let mut idx = vec![0; 2];
/// let mut seen = vec![idx.clone()];
/// while increment_index(&mut idx, &shape) {
///     seen.push(idx.clone());
/// }
/// assert_eq!(seen, [[0, 0], [0, 1], [1, 0], [1, 1]]);
/// ```
pub fn increment_index(index: &mut [usize], shape: &[usize]) -> bool {
    for (i, &d) in index.iter_mut().zip(shape).rev() {
        *i += 1;
        if *i < d {
            return true;
        }
        *i = 0;
    }
    false
}

/// The numpy broadcast of two shapes: right-aligned; per axis the sizes must be equal or one of
/// them 1, and the result takes the other (so `1` with `0` gives `0`; `0` with `3` is an error).
/// Rank 0 broadcasts with anything.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, TensorError> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for (back, slot) in out.iter_mut().rev().enumerate() {
        // Missing leading dims count as 1.
        let da = if back < a.len() {
            a[a.len() - 1 - back]
        } else {
            1
        };
        let db = if back < b.len() {
            b[b.len() - 1 - back]
        } else {
            1
        };
        *slot = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(TensorError::Broadcast {
                a: a.to_vec(),
                b: b.to_vec(),
                // back < rank <= isize::MAX (a Vec length), so the cast is exact.
                axis: -(back as isize) - 1,
            });
        };
    }
    Ok(out)
}

/// Flat index into an input of shape `in_shape` for the output multi-index `out_index`, where the
/// input is broadcast (numpy rules, right-aligned) to the output shape: size-1 input axes read
/// position 0, missing leading axes are ignored.
///
/// Precondition: `in_shape` broadcasts to the output shape `out_index` indexes (so
/// `in_shape.len() <= out_index.len()`); an input of higher rank only uses its trailing axes.
pub fn broadcast_index(out_index: &[usize], in_shape: &[usize]) -> usize {
    let skip_out = out_index.len().saturating_sub(in_shape.len());
    let skip_in = in_shape.len().saturating_sub(out_index.len());
    out_index[skip_out..]
        .iter()
        .zip(&in_shape[skip_in..])
        .fold(0usize, |flat, (&i, &d)| {
            let i = if d == 1 { 0 } else { i };
            flat.wrapping_mul(d).wrapping_add(i)
        })
}

/// A shape written like a Python tuple: `()`, `(4,)`, `(2, 3)`. Used in every error message.
pub fn format_shape(shape: &[usize]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => {
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            format!("({})", dims.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts() {
        assert_eq!(num_elements(&[]), Ok(1));
        assert_eq!(num_elements(&[2, 3, 4]), Ok(24));
        assert_eq!(num_elements(&[2, 0, 4]), Ok(0));
        assert!(matches!(
            num_elements(&[usize::MAX, 2]),
            Err(TensorError::ShapeOverflow { .. })
        ));
        // A 0 dim wins over an overflowing product, in any position.
        assert_eq!(num_elements(&[usize::MAX, usize::MAX, 0]), Ok(0));
    }

    #[test]
    fn strides_row_major() {
        assert_eq!(strides(&[]), Vec::<usize>::new());
        assert_eq!(strides(&[5]), vec![1]);
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[2, 0, 4]), vec![0, 4, 1]);
        // Empty tensor with huge trailing dims: saturates, does not panic.
        assert_eq!(
            strides(&[0, usize::MAX, usize::MAX]),
            vec![usize::MAX, usize::MAX, 1]
        );
    }

    #[test]
    fn ravel_unravel_round_trip() {
        for shape in [vec![], vec![7], vec![2, 3, 4], vec![1, 5, 1, 2]] {
            let n = num_elements(&shape).unwrap();
            let st = strides(&shape);
            for flat in 0..n {
                let idx = unravel(flat, &shape);
                assert_eq!(idx.len(), shape.len());
                assert_eq!(ravel(&idx, &shape), flat);
                let via_strides: usize = idx.iter().zip(&st).map(|(i, s)| i * s).sum();
                assert_eq!(via_strides, flat);
            }
        }
        assert_eq!(unravel(23, &[2, 3, 4]), vec![1, 2, 3]);
        assert_eq!(unravel(0, &[]), Vec::<usize>::new());
        // Out of precondition (0 dim): no division by zero.
        assert_eq!(unravel(5, &[2, 0]), vec![0, 0]);
    }

    #[test]
    fn odometer_matches_unravel() {
        let shape = [2, 1, 3];
        let mut idx = vec![0; 3];
        let mut flat = 0;
        loop {
            assert_eq!(idx, unravel(flat, &shape));
            flat += 1;
            if !increment_index(&mut idx, &shape) {
                break;
            }
        }
        assert_eq!(flat, 6);
        assert!(!increment_index(&mut [], &[]));
    }

    #[test]
    fn broadcast_shape_rules() {
        let ok = |a: &[usize], b: &[usize]| broadcast_shapes(a, b).unwrap();
        assert_eq!(ok(&[2, 3], &[2, 3]), vec![2, 3]);
        assert_eq!(ok(&[2, 3], &[3]), vec![2, 3]);
        assert_eq!(ok(&[3], &[2, 3]), vec![2, 3]);
        assert_eq!(ok(&[4, 1, 3], &[5, 1]), vec![4, 5, 3]);
        assert_eq!(ok(&[], &[2, 3]), vec![2, 3]);
        assert_eq!(ok(&[2, 3], &[]), vec![2, 3]);
        assert_eq!(ok(&[], &[]), Vec::<usize>::new());
        // 0-size dims: 0 with 1 gives 0, 0 with 0 gives 0.
        assert_eq!(ok(&[0, 3], &[1, 3]), vec![0, 3]);
        assert_eq!(ok(&[1], &[0]), vec![0]);
        assert_eq!(ok(&[0], &[0]), vec![0]);
        assert_eq!(ok(&[], &[0]), vec![0]);

        let err = broadcast_shapes(&[0], &[3]).unwrap_err();
        assert_eq!(
            err,
            TensorError::Broadcast {
                a: vec![0],
                b: vec![3],
                axis: -1
            }
        );
        let err = broadcast_shapes(&[2, 3], &[4, 3]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "shapes (2, 3) and (4, 3) do not broadcast: axis -2 has sizes 2 and 4 \
             (sizes must be equal or one of them 1)"
        );
    }

    #[test]
    fn broadcast_index_reads_right_elements() {
        // in (3, 1) broadcast to out (2, 3, 4): element [k, i, j] reads in[i, 0].
        let in_shape = [3, 1];
        let out_shape = [2, 3, 4];
        let mut idx = vec![0; 3];
        loop {
            assert_eq!(broadcast_index(&idx, &in_shape), idx[1]);
            if !increment_index(&mut idx, &out_shape) {
                break;
            }
        }
        assert_eq!(broadcast_index(&[1, 2], &[]), 0);
        assert_eq!(broadcast_index(&[1, 2], &[2, 3]), 5);
    }

    #[test]
    fn shapes_print_like_tuples() {
        assert_eq!(format_shape(&[]), "()");
        assert_eq!(format_shape(&[4]), "(4,)");
        assert_eq!(format_shape(&[2, 3]), "(2, 3)");
    }
}
