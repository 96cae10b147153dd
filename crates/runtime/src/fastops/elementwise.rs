//! Elementwise f32 operators over numpy-broadcast operands: row-program unaries, comparisons,
//! `where`, and the four arithmetic operators, innermost axis as a loop over slices.

use super::*;

/// Row-program unary operator `name` of the one f32 operand ([`crate::fused::unary_f32`]).
pub(super) fn row_unary(name: &str, args: &[OpValue]) -> Option<OpValue> {
    // `copy`'s reference shares the buffer, which a copied-out loop would not.
    let ([OpValue::Tensor(t)], false) = (args, name == "copy") else {
        return None;
    };
    let x = t.as_f32()?;
    let mut out = tumble_tensor::pool::scratch_f32(x.len());
    if !crate::fused::unary_f32(name, x, &mut out) {
        return None;
    }
    Tensor::from_vec(t.shape().to_vec(), out)
        .ok()
        .map(OpValue::Tensor)
}

/// Offsets of broadcast operands in their buffers, element by element of the output (numpy
/// broadcasting: an operand's axes aligned to the output's last ones, size-1 axes repeated).
pub(crate) struct Broadcast {
    pub(crate) shape: Vec<usize>,
    /// Per operand, per output axis: its step (0 along a repeated axis).
    pub(crate) strides: Vec<Vec<usize>>,
}

impl Broadcast {
    pub(crate) fn new(shapes: &[&[usize]]) -> Option<Broadcast> {
        let mut shape: Vec<usize> = Vec::new();
        for s in shapes {
            shape = tumble_tensor::broadcast_shapes(&shape, s).ok()?;
        }
        let strides = shapes
            .iter()
            .map(|s| {
                let mut out = vec![0; shape.len()];
                let mut acc = 1;
                for (i, &d) in s.iter().enumerate().rev() {
                    out[shape.len() - s.len() + i] = if d == 1 { 0 } else { acc };
                    acc *= d;
                }
                out
            })
            .collect();
        Some(Broadcast { shape, strides })
    }

    /// The length of a row along the innermost axis (1 for a scalar).
    fn inner(&self) -> usize {
        self.shape.last().copied().unwrap_or(1).max(1)
    }

    /// Operand `k`'s step along the innermost axis: 1 (its run is contiguous) or 0 (one value
    /// repeated along the row).
    fn step(&self, k: usize) -> usize {
        self.strides
            .get(k)
            .and_then(|s| s.last())
            .copied()
            .unwrap_or(1)
    }

    /// Calls `f` with each operand's offset of the first element of each row along the
    /// innermost axis, rows in order (an odometer over the axes before it); stops at the
    /// first `None`.
    fn each_row(&self, mut f: impl FnMut(&[usize]) -> Option<()>) -> Option<()> {
        let total: usize = self.shape.iter().product();
        let outer = self.shape.len().saturating_sub(1);
        let mut index = vec![0usize; outer];
        let mut at = vec![0usize; self.strides.len()];
        for _ in 0..total / self.inner() {
            f(&at)?;
            for ax in (0..outer).rev() {
                index[ax] += 1;
                for (o, s) in at.iter_mut().zip(&self.strides) {
                    *o += s[ax];
                }
                if index[ax] < self.shape[ax] {
                    break;
                }
                for (o, s) in at.iter_mut().zip(&self.strides) {
                    *o -= s[ax] * self.shape[ax];
                }
                index[ax] = 0;
            }
        }
        Some(())
    }

    /// Calls `f` with each operand's offset, output element by output element.
    fn each(&self, mut f: impl FnMut(&[usize])) {
        let inner = self.inner();
        let steps: Vec<usize> = (0..self.strides.len()).map(|k| self.step(k)).collect();
        let mut at = vec![0usize; steps.len()];
        self.each_row(|row| {
            for j in 0..inner {
                for ((o, &r), &s) in at.iter_mut().zip(row).zip(&steps) {
                    *o = r + j * s;
                }
                f(&at);
            }
            Some(())
        });
    }
}

/// A comparison of two f32 tensors broadcast numpy-style, as the reference computes it (f32
/// values compare in f64 as they do in f32; NaN compares false but for `not_equal`): ~20 ns an
/// element through the reference's f64 copies, a beam search's masks a third of its time.
pub(super) fn compare_f32(args: &[OpValue], f: impl Fn(f32, f32) -> bool) -> Option<OpValue> {
    let (a, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let shape = Broadcast::new(&[a.shape(), b.shape()])?;
    let mut out: Vec<bool> = Vec::with_capacity(shape.shape.iter().product());
    let mut ok = true;
    shape.each(|at| match (x.get(at[0]), y.get(at[1])) {
        (Some(&p), Some(&q)) => out.push(f(p, q)),
        _ => ok = false,
    });
    ok.then_some(())?;
    Tensor::from_vec(shape.shape, out).ok().map(OpValue::Tensor)
}

/// `where(c, x, y)` of a bool condition and two f32 tensors, all three broadcast numpy-style.
pub(super) fn where_f32(args: &[OpValue]) -> Option<OpValue> {
    let [c, x, y] = args else { return None };
    let (c, x, y) = (c.as_tensor()?, x.as_tensor()?, y.as_tensor()?);
    let (cv, xv, yv) = (c.as_slice::<bool>()?, x.as_f32()?, y.as_f32()?);
    let bc = Broadcast::new(&[c.shape(), x.shape(), y.shape()])?;
    let total: usize = bc.shape.iter().product();
    // Row by row along the innermost axis, each operand's run contiguous or one value repeated
    // (an element-by-element walk of the broadcast cost 10-17 ns an element: a padded decoder's
    // masks ran 2.9x its arithmetic select).
    let mut out = tumble_tensor::pool::scratch_f32(total);
    let inner = bc.inner();
    let (ic, ix, iy) = (bc.step(0), bc.step(1), bc.step(2));
    let len = |i: usize| if i == 0 { 1 } else { inner };
    let mut rows = out.chunks_exact_mut(inner);
    bc.each_row(|at| {
        let dst = rows.next()?;
        let (cs, xs, ys) = (
            cv.get(at[0]..at[0] + len(ic))?,
            xv.get(at[1]..at[1] + len(ix))?,
            yv.get(at[2]..at[2] + len(iy))?,
        );
        match (ic, ix, iy) {
            (1, 1, 1) => {
                for (((d, &c), &p), &q) in dst.iter_mut().zip(cs).zip(xs).zip(ys) {
                    *d = if c { p } else { q };
                }
            }
            (0, ..) => match cs.first() {
                Some(true) if ix == 1 => dst.copy_from_slice(xs),
                Some(true) => dst.fill(*xs.first()?),
                Some(false) if iy == 1 => dst.copy_from_slice(ys),
                Some(false) => dst.fill(*ys.first()?),
                None => return None,
            },
            _ => {
                for (j, d) in dst.iter_mut().enumerate() {
                    let (c, p, q) = (cs.get(j * ic)?, xs.get(j * ix)?, ys.get(j * iy)?);
                    *d = if *c { *p } else { *q };
                }
            }
        }
        Some(())
    })?;
    Tensor::from_vec(bc.shape, out).ok().map(OpValue::Tensor)
}

/// `f(a, b)` elementwise over two f32 tensors broadcast numpy-style (`None` for other dtypes or
/// shapes that do not broadcast: the reference kernel then reports the error). The innermost
/// output axis runs as a loop over two slices, or a slice and a broadcast scalar, so batched rows
/// against a shared vector (a launch's `(B, 1) * (64)`) vectorize.
pub(super) fn binary_f32(args: &[OpValue], f: impl Fn(f32, f32) -> f32) -> Option<OpValue> {
    let (a, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let bc = Broadcast::new(&[a.shape(), b.shape()])?;
    let total: usize = bc.shape.iter().product();
    // Written row by row through the dispatched SIMD loops (an `extend` over a zip compiles for
    // the baseline ISA only: 2.3% of a training step in the kept forward's adds and products).
    let mut out = tumble_tensor::pool::scratch_f32(total);
    let (inner, ia, ib) = (bc.inner(), bc.step(0), bc.step(1));
    let mut rows = out.chunks_exact_mut(inner);
    bc.each_row(|at| {
        let (dst, oa, ob) = (rows.next()?, at[0], at[1]);
        match (ia, ib) {
            (1, 1) => simd::binary(dst, x.get(oa..oa + inner)?, y.get(ob..ob + inner)?, &f),
            (1, _) => {
                let q = *y.get(ob)?;
                simd::unary(dst, x.get(oa..oa + inner)?, |p| f(p, q));
            }
            (_, 1) => {
                let p = *x.get(oa)?;
                simd::unary(dst, y.get(ob..ob + inner)?, |q| f(p, q));
            }
            _ => dst.fill(f(*x.get(oa)?, *y.get(ob)?)),
        }
        Some(())
    })?;
    Tensor::from_vec(bc.shape, out).ok().map(OpValue::Tensor)
}
