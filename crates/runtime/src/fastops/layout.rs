//! Layout operators on f32 tensors — `split`, `take` of rows, `strided_slice`, `concatenate`,
//! `transpose` — as copies of runs instead of the reference's index per element.

use super::*;

/// The axis `a` (negative from the end) of a rank-`r` tensor.
pub(crate) fn axis_of(a: i64, r: usize) -> Option<usize> {
    usize::try_from(if a < 0 { a + r as i64 } else { a })
        .ok()
        .filter(|&a| a < r)
}

/// The sizes of `split`'s pieces along an axis of extent `d` (`indices_or_sections`: a count of
/// equal pieces, or the cut points).
pub(crate) fn split_sizes(attrs: &Attrs, d: usize) -> Option<Vec<usize>> {
    if let Ok(Some(k)) = attrs.int("indices_or_sections") {
        let k = usize::try_from(k).ok().filter(|&k| k > 0 && d % k == 0)?;
        return Some(vec![d / k; k]);
    }
    let cuts = attrs.ints("indices_or_sections").ok()??;
    let mut sizes = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0usize;
    for c in cuts {
        let c = usize::try_from(c).ok().filter(|&c| c >= at && c <= d)?;
        sizes.push(c - at);
        at = c;
    }
    sizes.push(d - at);
    Some(sizes)
}

/// `t` cut along `axis` into pieces of `sizes` (summing to the axis's extent).
pub fn split_f32(t: &Tensor, axis: usize, sizes: &[usize]) -> Option<Vec<Tensor>> {
    let x = t.as_f32()?;
    let shape = t.shape();
    let d = *shape.get(axis)?;
    if sizes.iter().sum::<usize>() != d {
        return None;
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut pieces = Vec::with_capacity(sizes.len());
    let mut begin = 0;
    for &len in sizes {
        // A recycled buffer when one fits (the training forward splits every launch's gates).
        let mut data = tumble_tensor::pool::with_capacity_f32(outer * len * inner);
        for o in 0..outer {
            let base = (o * d + begin) * inner;
            data.extend_from_slice(x.get(base..base + len * inner)?);
        }
        let mut piece = shape.to_vec();
        piece[axis] = len;
        pieces.push(Tensor::from_vec(piece, data).ok()?);
        begin += len;
    }
    Some(pieces)
}

/// Rows of an f32 table (axis 0) by integer ids, out-of-range ids clipped to the first or last
/// row (`take`'s default mode): shape `ids.shape + table.shape[1..]`.
pub fn take_rows_f32(table: &Tensor, ids: &Tensor) -> Option<Tensor> {
    let data = table.as_f32()?;
    let (&rows, row_shape) = table.shape().split_first()?;
    if rows == 0 || !ids.dtype().is_int() {
        return None;
    }
    let width: usize = row_shape.iter().product();
    let idx = ids.to_i64_vec();
    let mut out = tumble_tensor::pool::with_capacity_f32(idx.len() * width);
    for &j in &idx {
        let j = j.clamp(0, rows as i64 - 1) as usize;
        out.extend_from_slice(data.get(j * width..(j + 1) * width)?);
    }
    let mut shape = ids.shape().to_vec();
    shape.extend_from_slice(row_shape);
    Tensor::from_vec(shape, out).ok()
}

/// `strided_slice` of an f32 tensor by its plan (per axis `(start, step, len)`,
/// [`tumble_ops::slice_plan`]): runs of the last axis copied as slices where its step is 1, and
/// axes copied whole below the last one sliced. The reference builds an index per element (a
/// text CNN's shifted windows of a sentence's rows: 15–35 ns an element).
pub(super) fn slice_f32(t: &Tensor, plan: &[(i64, i64, i64)]) -> Option<Tensor> {
    let data = t.as_f32()?;
    let shape = t.shape();
    let out_shape: Vec<usize> = plan
        .iter()
        .map(|&(_, _, len)| usize::try_from(len).ok())
        .collect::<Option<_>>()?;
    let total: usize = out_shape.iter().product();
    let mut out = tumble_tensor::pool::with_capacity_f32(total);
    if total > 0 {
        // Strides of the input; the innermost run: the trailing axes taken whole with step 1,
        // and the last axis before them if its step is 1.
        let r = shape.len();
        let mut strides = vec![1usize; r];
        for a in (0..r.saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * shape[a + 1];
        }
        let whole = |a: usize| plan[a] == (0, 1, shape[a] as i64);
        let mut inner = r;
        while inner > 0 && whole(inner - 1) {
            inner -= 1;
        }
        let mut run: usize = shape[inner..].iter().product();
        let mut outer = inner;
        if inner > 0 && plan[inner - 1].1 == 1 {
            outer = inner - 1;
            run *= out_shape[outer];
        }
        // Where the run of output index `idx` (over the axes before `outer`) starts: each axis
        // at its position, the axes from `outer` on at their starts.
        let tail: i64 = (outer..r).map(|a| plan[a].0 * strides[a] as i64).sum();
        let base = |idx: &[usize]| -> Option<usize> {
            let mut at = tail;
            for (a, &i) in idx.iter().enumerate() {
                let (start, step, _) = plan[a];
                at += (start + i as i64 * step) * strides[a] as i64;
            }
            usize::try_from(at).ok()
        };
        let mut idx = vec![0usize; outer];
        loop {
            let from = base(&idx)?;
            out.extend_from_slice(data.get(from..from + run)?);
            let mut a = outer;
            loop {
                if a == 0 {
                    return Tensor::from_vec(out_shape, out).ok();
                }
                a -= 1;
                idx[a] += 1;
                if idx[a] < out_shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    }
    Tensor::from_vec(out_shape, out).ok()
}

/// f32 tensors joined along `axis`: for every index of the axes before it, each part's contiguous
/// chunk in turn (the generic kernel goes element by element through index lists).
pub fn concat_f32(parts: &[Tensor], axis: usize) -> Option<Tensor> {
    let first = parts.first()?;
    let shape = first.shape();
    if axis >= shape.len() {
        return None;
    }
    let mut datas = Vec::with_capacity(parts.len());
    let mut along = 0;
    for p in parts {
        let s = p.shape();
        if s.len() != shape.len()
            || s[..axis] != shape[..axis]
            || s[axis + 1..] != shape[axis + 1..]
        {
            return None;
        }
        along += s[axis];
        datas.push((p.as_f32()?, s[axis..].iter().product::<usize>()));
    }
    let outer: usize = shape[..axis].iter().product();
    let total: usize = datas.iter().map(|(d, _)| d.len()).sum();
    let mut out = tumble_tensor::pool::with_capacity_f32(total);
    for o in 0..outer {
        for (d, chunk) in &datas {
            out.extend_from_slice(d.get(o * chunk..(o + 1) * chunk)?);
        }
    }
    let mut out_shape = shape.to_vec();
    out_shape[axis] = along;
    Tensor::from_f32(out_shape, out).ok()
}

/// `dst (cols × rows) = srcᵀ` for a row-major `src (rows × cols)`, in 8×8 tiles so both sides are
/// touched a cache line at a time.
pub fn transpose_2d(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const T: usize = 8;
    debug_assert!(src.len() >= rows * cols && dst.len() >= rows * cols);
    for i0 in (0..rows).step_by(T) {
        for j0 in (0..cols).step_by(T) {
            if i0 + T <= rows && j0 + T <= cols {
                // A whole tile: eight row loads, a register transpose, eight row stores.
                let mut tile = [[0f32; T]; T];
                for (r, t) in tile.iter_mut().enumerate() {
                    let at = (i0 + r) * cols + j0;
                    t.copy_from_slice(&src[at..at + T]);
                }
                let cols: [[f32; T]; T] =
                    std::array::from_fn(|c| std::array::from_fn(|r| tile[r][c]));
                for (c, col) in cols.iter().enumerate() {
                    let at = (j0 + c) * rows + i0;
                    dst[at..at + T].copy_from_slice(col);
                }
            } else {
                for i in i0..(i0 + T).min(rows) {
                    for j in j0..(j0 + T).min(cols) {
                        dst[j * rows + i] = src[i * cols + j];
                    }
                }
            }
        }
    }
}

/// `t` with its axes permuted (`out.shape[i] = t.shape[perm[i]]`).
/// The permutation `transpose(axes=..)` applies to a rank-`r` tensor (none given: reversed).
pub(crate) fn transpose_axes(attrs: &Attrs, r: usize) -> Option<Vec<usize>> {
    let r = r as i64;
    match attrs.ints("axes").ok()? {
        None => Some((0..r).rev().map(|a| a as usize).collect()),
        Some(v) if v.is_empty() => Some((0..r).rev().map(|a| a as usize).collect()),
        Some(v) => v
            .iter()
            .map(|&a| if a < 0 { a + r } else { a })
            .map(|a| usize::try_from(a).ok())
            .collect::<Option<Vec<_>>>(),
    }
}

pub fn permute_f32(t: &Tensor, perm: &[usize]) -> Option<Tensor> {
    let data = t.as_f32()?;
    let shape = t.shape();
    if perm.len() != shape.len() || perm.is_empty() {
        return None;
    }
    let mut seen = vec![false; perm.len()];
    for &p in perm {
        if *seen.get(p)? {
            return None;
        }
        seen[p] = true;
    }
    let strides = t.strides();
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let r = perm.len();
    if r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
    {
        // Matrices transposed in place of one another: tiled, not element-strided.
        let (rows, cols) = (shape[r - 2], shape[r - 1]);
        let mut out = zeroed_f32(data.len());
        if rows * cols > 0 {
            for (src, dst) in data
                .chunks_exact(rows * cols)
                .zip(out.chunks_exact_mut(rows * cols))
            {
                transpose_2d(src, rows, cols, dst);
            }
        }
        return Tensor::from_f32(out_shape, out).ok();
    }
    let in_stride: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let n = data.len();
    let mut out = tumble_tensor::pool::with_capacity_f32(n);
    if n > 0 {
        let last = out_shape.len() - 1;
        let (inner, inner_stride) = (out_shape[last], in_stride[last]);
        let outer: usize = out_shape[..last].iter().product();
        let mut idx = vec![0usize; last];
        for _ in 0..outer {
            let base: usize = idx.iter().zip(&in_stride).map(|(i, s)| i * s).sum();
            if inner_stride == 1 {
                out.extend_from_slice(&data[base..base + inner]);
            } else {
                out.extend((0..inner).map(|j| data[base + j * inner_stride]));
            }
            // Odometer over the outer output axes.
            for a in (0..last).rev() {
                idx[a] += 1;
                if idx[a] < out_shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    }
    Tensor::from_f32(out_shape, out).ok()
}
