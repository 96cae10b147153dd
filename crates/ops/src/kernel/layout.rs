//! Data-movement kernels: `concatenate`, `split`, `reshape`, `transpose`, `expand_dims`,
//! `squeeze`, `take`, `strided_slice`, `reverse`, `tile`, `repeat`, `nn.batch_flatten`, `gather`,
//! `gather_nd`. Each but `concatenate` (block copies) builds an index map
//! (output flat position → input flat position) and gathers with [`Tensor::take`], which works
//! for every dtype and checks bounds. Output shapes come from the relations; attribute parsing
//! from the relations' helpers.

use super::{permute, product, with_dtype, KCall};
use crate::rel::layout::{slice_range, slice_spec, take_spec, transpose_perm, TakeMode};
use crate::{rel, KernelError, OpCtx, OpValue};
use tumble_ir::{Attrs, Ty};
use tumble_tensor::shape::increment_index;
use tumble_tensor::{Element, Tensor};

/// `(outer, inner)`: the products of the dims before and after `axis`.
fn outer_inner(k: &KCall, shape: &[usize], axis: usize) -> Result<(usize, usize), KernelError> {
    let outer = k.t(product(shape.get(..axis).unwrap_or_default()))?;
    let inner = k.t(product(shape.get(axis + 1..).unwrap_or_default()))?;
    Ok((outer, inner))
}

/// `concatenate((a, b, ...), axis=0)`: for every outer position (the dims before `axis`), the
/// blocks `a[o, :, ...]`, `b[o, :, ...]`, ... one after another. Copied block by block into the
/// output, the one allocation the memory budget was asked for (a flat copy of the parts and an
/// index per element came first, 2.6–3.6× the output).
pub fn concatenate(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("concatenate", args, attrs, 1)?;
    let parts = k.tuple(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::concatenate)?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 0)?, out_shape.len())?;
    let (outer, _) = outer_inner(&k, &out_shape, axis)?;
    // Each part contributes blocks of (its size along axis) × inner elements per outer position.
    let mut blocks = Vec::with_capacity(parts.len());
    for p in parts {
        let (_, inner) = outer_inner(&k, p.shape(), axis)?;
        blocks.push(p.shape().get(axis).copied().unwrap_or(0) * inner);
    }
    let Some(first) = parts.first() else {
        return Err(k.err("input must be a non-empty tuple of tensors, found ()"));
    };
    let total = k.t(product(&out_shape))?;
    with_dtype!(first.dtype(), T => {
        let out = interleave::<T>(parts, &blocks, outer, total)
            .ok_or_else(|| k.err("all fields must have one dtype"))?;
        Ok(k.t(Tensor::from_vec(out_shape, out))?.into())
    })
}

/// For every outer position `o`, block `o` of each part in turn (part `p`'s blocks being
/// `blocks[p]` elements long): a concatenation's or a stack's copy.
fn interleave<T: Element>(
    parts: &[Tensor],
    blocks: &[usize],
    outer: usize,
    total: usize,
) -> Option<Vec<T>> {
    let slices: Vec<&[T]> = parts
        .iter()
        .map(|p| p.as_slice::<T>())
        .collect::<Option<_>>()?;
    let mut out = Vec::with_capacity(total);
    for o in 0..outer {
        for (s, &b) in slices.iter().zip(blocks) {
            out.extend_from_slice(s.get(o * b..(o + 1) * b)?);
        }
    }
    Some(out)
}

/// `broadcast_to(x, shape)`: numpy's `broadcast_to`, copied out.
pub fn broadcast_to(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("broadcast_to", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (shape, _) = k.out_tensor(rel::layout::broadcast_to)?;
    Ok(k.t(x.broadcast_to(shape))?.into())
}

/// `stack((a, b, ...), axis)`: for every outer position (the dims before `axis`), the parts' blocks
/// of the dims from `axis` on, one after another — a concatenation along a new axis.
pub fn stack(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("stack", args, attrs, 1)?;
    let parts = k.tuple(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::stack)?;
    let Some(first) = parts.first() else {
        return Err(k.err("input must be a non-empty tuple of tensors, found ()"));
    };
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 0)?, out_shape.len())?;
    // The parts' own shape split at `axis`: the outer positions and each block's length.
    let (outer, inner) = outer_inner(&k, first.shape(), axis)?;
    let inner = inner * first.shape().get(axis).copied().unwrap_or(1);
    let blocks = vec![inner; parts.len()];
    let total = k.t(product(&out_shape))?;
    with_dtype!(first.dtype(), T => {
        let out = interleave::<T>(parts, &blocks, outer, total)
            .ok_or_else(|| k.err("all fields must have one dtype"))?;
        Ok(k.t(Tensor::from_vec(out_shape, out))?.into())
    })
}

/// `split(x, indices_or_sections, axis=0)`: the pieces' shapes come from the relation; piece `p`
/// covers `[begin_p, begin_p + len_p)` along `axis`, where `begin_p` sums the earlier lengths.
pub fn split(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("split", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let Ty::Tuple(pieces) = k.out_ty(rel::layout::split)? else {
        return Err(k.err("internal error: split's relation did not return a tuple"));
    };
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 0)?, x.rank())?;
    let d = x.shape().get(axis).copied().unwrap_or(0);
    let (outer, inner) = outer_inner(&k, x.shape(), axis)?;
    let mut out = Vec::with_capacity(pieces.len());
    let mut begin = 0usize;
    for ty in &pieces {
        let (shape, _) = super::tensor_shape(ty)
            .ok_or_else(|| k.err(format!("internal error: piece type {ty}")))?;
        let len = shape.get(axis).copied().unwrap_or(0);
        if begin + len > d {
            return Err(k.err(format!("internal error: pieces exceed dimension {d}")));
        }
        let mut indices = Vec::new();
        for o in 0..outer {
            let base = (o * d + begin) * inner;
            indices.extend(base..base + len * inner);
        }
        out.push(k.t(x.take(shape, &indices))?);
        begin += len;
    }
    Ok(OpValue::Tuple(out))
}

/// `reshape`, `expand_dims`, `squeeze`: the same elements in the shape the relation computes
/// (so `reshape`'s 0/-1/-2/-3/-4 have exactly the relation's meaning).
fn same_elements(
    op: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    relation: crate::Relation,
) -> Result<OpValue, KernelError> {
    let k = KCall::new(op, args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (shape, _) = k.out_tensor(relation)?;
    Ok(k.t(x.reshape(shape))?.into())
}

super::kernels! {
    reshape => same_elements("reshape", rel::layout::reshape);
    expand_dims => same_elements("expand_dims", rel::layout::expand_dims);
    squeeze => same_elements("squeeze", rel::layout::squeeze);
}

/// `transpose(x, axes=None)`: output axis `i` is input axis `axes[i]` (None: reversed).
pub fn transpose(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("transpose", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let c = k.rel();
    let perm = transpose_perm(&c, c.tensor(0, "input")?)?;
    Ok(permute(x, &perm).map_err(|m| k.err(m))?.into())
}

/// An index into an axis of length `n` under `mode`, or the error message.
pub(crate) fn resolve_index(i: i64, n: usize, mode: TakeMode) -> Result<usize, String> {
    let n64 = i64::try_from(n).map_err(|_| "axis too long".to_string())?;
    if n64 == 0 {
        return Err(format!("index {i} is out of range: the axis has length 0"));
    }
    let r = match mode {
        TakeMode::Clip => i.clamp(0, n64 - 1),
        TakeMode::Wrap => i.rem_euclid(n64),
        TakeMode::Fast => {
            if (-n64..n64).contains(&i) {
                if i < 0 {
                    i + n64
                } else {
                    i
                }
            } else {
                return Err(format!(
                    "index {i} is out of range for an axis of length {n}: mode=\"fast\" takes \
                     {lo}..={hi} (a negative index counts from the end, as numpy's), and does \
                     not clip or wrap further",
                    lo = -n64,
                    hi = n64 - 1
                ));
            }
        }
    };
    usize::try_from(r).map_err(|_| format!("index {i} is out of range"))
}

/// `take(x, indices, axis=None, batch_dims=0, mode="clip")`. Without an axis, gathers from the
/// flattened `x`: `out[j...] = x.flat[indices[j...]]`. With one (and `bd` batch dims):
/// `out[b, pre, j, post] = x[b, pre, indices[b, j], post]` where `b` are the first `bd` axes
/// (shared by `x` and `indices`), `pre` the remaining axes before `axis`, `j` the remaining axes
/// of `indices`, `post` the axes after `axis`. Out-of-range indices: `clip` clamps into
/// `[0, n-1]`, `wrap` takes them modulo `n` (Python `%`), `fast` accepts `[-n, n)` (negative
/// counts from the end, as numpy's default) and is an error otherwise.
pub fn take(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("take", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let idx = k.tensor(1, "indices")?;
    let (out_shape, _) = k.out_tensor(rel::layout::take)?;
    let c = k.rel();
    let spec = take_spec(&c, c.tensor(0, "input")?, c.tensor(1, "indices")?)?;
    if !idx.dtype().is_int() {
        return Err(k.err(format!(
            "indices must have dtype int32 or int64, found {}",
            idx.dtype()
        )));
    }
    let iv = idx.to_i64_vec();
    let Some((axis, bd)) = spec.axis else {
        let indices = iv
            .iter()
            .map(|&i| resolve_index(i, x.len(), spec.mode))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| k.err(m))?;
        return Ok(k.t(x.take(out_shape, &indices))?.into());
    };
    let xs = x.shape();
    let n = xs.get(axis).copied().unwrap_or(0);
    let batch = k.t(product(xs.get(..bd).unwrap_or_default()))?;
    let pre = k.t(product(xs.get(bd..axis).unwrap_or_default()))?;
    let post = k.t(product(xs.get(axis + 1..).unwrap_or_default()))?;
    let per_batch = k.t(product(idx.shape().get(bd..).unwrap_or_default()))?;
    if xs.get(..bd) != idx.shape().get(..bd) {
        return Err(k.err("the batch dimensions of input and indices differ"));
    }
    let mut indices = Vec::with_capacity(k.t(product(&out_shape))?);
    for b in 0..batch {
        for p in 0..pre {
            for j in 0..per_batch {
                let raw = iv.get(b * per_batch + j).copied().unwrap_or(0);
                let i = resolve_index(raw, n, spec.mode).map_err(|m| k.err(m))?;
                let base = ((b * pre + p) * n + i) * post;
                indices.extend(base..base + post);
            }
        }
    }
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

/// `strided_slice(x, begin, end, strides=None, axes=None, slice_mode="end")`: along each sliced
/// axis the positions `start + i * step` (`i < len`), computed by the relation's `slice_range`
/// (Python slice semantics, negative strides walk backwards); other axes are kept whole.
pub fn strided_slice(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("strided_slice", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::strided_slice)?;
    let c = k.rel();
    let spec = slice_spec(&c, c.tensor(0, "input")?)?;
    // Per input axis: (start, step); whole axes are (0, 1).
    let mut plan: Vec<(i64, i64)> = vec![(0, 1); x.rank()];
    for s in &spec.axes {
        let d = x.shape().get(s.axis).copied().unwrap_or(0);
        let d = i64::try_from(d).map_err(|_| k.err("dimension too large"))?;
        let (start, step, _) = slice_range(d, s.begin, s.end, s.stride, spec.size_mode);
        if let Some(slot) = plan.get_mut(s.axis) {
            *slot = (start, step);
        }
    }
    let strides = x.strides();
    let n = k.t(product(&out_shape))?;
    let mut indices = Vec::with_capacity(n);
    if n > 0 {
        let mut idx = vec![0usize; out_shape.len()];
        loop {
            let mut flat = 0i64;
            for ((&i, &(start, step)), &st) in idx.iter().zip(&plan).zip(&strides) {
                // i < len, so start + i * step is a position inside the axis (slice_range).
                let pos = start + (i as i64) * step;
                flat += pos * st as i64;
            }
            indices.push(
                usize::try_from(flat).map_err(|_| k.err("internal error: negative position"))?,
            );
            if !increment_index(&mut idx, &out_shape) {
                break;
            }
        }
    }
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

/// The flat input position of every output position, row-major over `out_shape`: `at` maps an
/// output coordinate to its input position.
fn index_map(
    out_shape: &[usize],
    mut at: impl FnMut(&[usize]) -> Result<usize, KernelError>,
) -> Result<Vec<usize>, KernelError> {
    let n: usize = out_shape.iter().product();
    let mut indices = Vec::with_capacity(n);
    if n > 0 {
        let mut idx = vec![0usize; out_shape.len()];
        loop {
            indices.push(at(&idx)?);
            if !increment_index(&mut idx, out_shape) {
                break;
            }
        }
    }
    Ok(indices)
}

/// `reverse(x, axis)`: position `i` along `axis` reads position `d - 1 - i`.
pub fn reverse(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("reverse", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::reverse)?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 0)?, x.rank())?;
    let strides = x.strides();
    let d = x.shape().get(axis).copied().unwrap_or(0);
    let indices = index_map(&out_shape, |idx| {
        Ok(idx
            .iter()
            .zip(&strides)
            .enumerate()
            .map(|(a, (&i, &s))| if a == axis { (d - 1 - i) * s } else { i * s })
            .sum())
    })?;
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

/// `tile(x, reps)`: output coordinate `c` reads `c mod d` per axis of the input's shape padded
/// with leading 1s to the result's rank.
pub fn tile(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("tile", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::tile)?;
    let mut shape = vec![1usize; out_shape.len().saturating_sub(x.rank())];
    shape.extend_from_slice(x.shape());
    let mut strides = vec![0usize; shape.len()];
    let mut s = 1;
    for (slot, &d) in strides.iter_mut().zip(&shape).rev() {
        *slot = s;
        s *= d;
    }
    let indices = index_map(&out_shape, |idx| {
        Ok(idx
            .iter()
            .zip(&shape)
            .zip(&strides)
            .map(|((&i, &d), &st)| (i % d.max(1)) * st)
            .sum())
    })?;
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

/// `repeat(x, repeats, axis)`: position `i` along `axis` reads position `i / repeats`.
pub fn repeat(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("repeat", args, attrs, 1)?;
    let x = k.tensor(0, "input")?;
    let (out_shape, _) = k.out_tensor(rel::layout::repeat)?;
    let c = k.rel();
    let (repeats, axis) = rel::layout::repeat_spec(&c, c.tensor(0, "input")?)?;
    let repeats = usize::try_from(repeats).map_err(|_| k.err("repeats out of range"))?;
    let strides = x.strides();
    let indices = index_map(&out_shape, |idx| {
        Ok(idx
            .iter()
            .zip(&strides)
            .enumerate()
            .map(|(a, (&i, &s))| if a == axis { i / repeats * s } else { i * s })
            .sum())
    })?;
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

super::kernels! {
    batch_flatten => same_elements("nn.batch_flatten", rel::layout::batch_flatten);
}

/// `i` as a position along `axis` (of length `n`) for `gather` and `gather_nd`: in `[-n, n)`, a
/// negative one counting from the end.
fn coordinate(k: &KCall, i: i64, n: usize, axis: usize) -> Result<usize, KernelError> {
    let n64 = i64::try_from(n).map_err(|_| k.err("axis too long"))?;
    let r = if i < 0 { i.checked_add(n64) } else { Some(i) };
    r.filter(|&r| (0..n64).contains(&r))
        .and_then(|r| usize::try_from(r).ok())
        .ok_or_else(|| {
            k.err(format!(
                "index {i} is out of range for axis {axis} of the input, of length {n} \
                 (allowed: {}..={}, a negative index counting from the end)",
                -n64,
                n64 - 1
            ))
        })
}

/// `gather(x, indices, axis)`: `out[c] = x[c with c[axis] = indices[c]]`. An index outside
/// `[-n, n)` of the axis is an error; a negative one counts from the end (as numpy's
/// `take_along_axis`).
pub fn gather(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("gather", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let idx = k.tensor(1, "indices")?;
    let (out_shape, _) = k.out_tensor(rel::layout::gather)?;
    let c = k.rel();
    let axis = c.axis(c.int_or("axis", 0)?, x.rank())?;
    let n = x.shape().get(axis).copied().unwrap_or(0);
    let iv = idx.to_i64_vec();
    let strides = x.strides();
    let mut flat = 0usize;
    let indices = index_map(&out_shape, |coord| {
        let raw = iv.get(flat).copied().unwrap_or(0);
        flat += 1;
        let i = coordinate(&k, raw, n, axis)?;
        let mut pos = 0;
        for (a, ((&ci, &s), &d)) in coord.iter().zip(&strides).zip(x.shape()).enumerate() {
            let ci = if a == axis { i } else { ci };
            // The relation bounds the other axes when shapes are known; a kernel called directly
            // is checked here.
            if ci >= d {
                return Err(k.err(format!(
                    "indices {:?} are longer than the input {:?} along axis {a}",
                    idx.shape(),
                    x.shape()
                )));
            }
            pos += ci * s;
        }
        Ok(pos)
    })?;
    Ok(k.t(x.take(out_shape, &indices))?.into())
}

/// `gather_nd(x, indices, batch_dims=0)`: index tuple `t` (over the axes of `indices` after the
/// first, batch axes `b` first) reads the block `x[b, indices[0, t], …, indices[M-1, t], …]`.
/// A coordinate outside `[-n, n)` of its axis is an error; a negative one counts from the end.
pub fn gather_nd(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("gather_nd", args, attrs, 2)?;
    let x = k.tensor(0, "input")?;
    let idx = k.tensor(1, "indices")?;
    let (out_shape, _) = k.out_tensor(rel::layout::gather_nd)?;
    let c = k.rel();
    let (bd, m) = rel::layout::gather_nd_spec(&c, c.tensor(0, "input")?, c.tensor(1, "indices")?)?;
    let xs = x.shape();
    let is = idx.shape();
    // Tuples per batch entry, blocks per tuple and the elements of each block.
    let tuples = k.t(product(is.get(1..).unwrap_or_default()))?;
    let per_batch = k.t(product(is.get(1 + bd..).unwrap_or_default()))?;
    let block = k.t(product(xs.get(bd + m..).unwrap_or_default()))?;
    let gathered = xs.get(bd..bd + m).unwrap_or_default();
    let span = k.t(product(gathered))?;
    let iv = idx.to_i64_vec();
    let mut indices = Vec::with_capacity(k.t(product(&out_shape))?);
    for t in 0..tuples {
        let b = t / per_batch.max(1);
        let mut pos = 0usize;
        for (j, &d) in gathered.iter().enumerate() {
            let raw = iv.get(j * tuples + t).copied().unwrap_or(0);
            let i = coordinate(&k, raw, d, bd + j)?;
            pos = pos * d + i;
        }
        let base = (b * span + pos) * block;
        indices.extend(base..base + block);
    }
    Ok(k.t(x.take(out_shape, &indices))?.into())
}
