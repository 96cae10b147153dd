//! `nn.dense`'s gradients on the GEMM kernels: `dX = dY · W` and `dW = dYᵀ · X`, where X's
//! leading axes (a launch's rows) are all rows of one product.
//!
//! A weight's gradient is the sum of `dYᵀ · X` over every launch that read it. Computed per
//! launch, each product contracts over that launch's rows only (tens, in a TreeLSTM trained in
//! mini-batches of 20) but writes and then adds a whole `N × K` matrix: for a 768 × 256 weight,
//! 786 KB per launch for a contraction of ~30. When the weight is a parameter (read whole by
//! every row), its launches' `(X, dY)` pairs are kept instead ([`DeferredDense`]) and summed by
//! one product over all of their rows when the backward pass ends: the same sum, one `N × K`
//! write per parameter per mini-batch.

use std::collections::BTreeMap;

use tumble_interp::RunError;
use tumble_kernels::{NoEpilogue, PackedWeight, Rows};
use tumble_tensor::Tensor;

use super::internal;
use super::param_grad::{add_dense, ParamGrad};

/// The `(rows, width)` view of an f32 tensor whose last axis is `width`: its leading axes are
/// rows. `None` for another dtype or a length that is not a whole number of rows.
fn rows_of(t: &Tensor, width: usize) -> Option<(&[f32], usize)> {
    let data = t.as_f32()?;
    if width == 0 || data.len() % width != 0 || t.shape().last() != Some(&width) {
        return None;
    }
    Some((data, data.len() / width))
}

/// `dX (M, K) = dY (M, N) · W (N, K)`, with Wᵀ packed once per mini-batch (the job's cache).
fn dx_gemm(
    gs: &[f32],
    m: usize,
    w: &Tensor,
    n: usize,
    k: usize,
    threads: usize,
) -> Result<Vec<f32>, RunError> {
    let pw = crate::gemm::packed_transposed(w, n, k).map_err(internal)?;
    let mut dx = tumble_tensor::pool::scratch_f32(m * k);
    let a = Rows::Contiguous {
        data: gs,
        stride: n,
    };
    tumble_kernels::dense(&a, &pw, &mut dx, &NoEpilogue, threads).map_err(internal)?;
    Ok(dx)
}

/// `dW (N, K) = Σ dYᵢᵀ · Xᵢ` over pairs of `(X rows (mᵢ, K), dY rows (mᵢ, N))`: one product
/// contracting over all of their rows. dYᵀ is read by columns (dY's rows, wherever each launch
/// left them: `Rows::Columns`), X's rows are packed as the product's weight; nothing is
/// transposed or copied first.
fn dw_gemm(
    pairs: &[(&[f32], &[f32])],
    n: usize,
    k: usize,
    threads: usize,
) -> Result<Vec<f32>, RunError> {
    let dy_cols: Vec<&[f32]> = pairs.iter().flat_map(|(_, g)| g.chunks_exact(n)).collect();
    let x_rows: Vec<&[f32]> = pairs.iter().flat_map(|(x, _)| x.chunks_exact(k)).collect();
    let px = PackedWeight::from_rows_kn(&x_rows, k).map_err(internal)?;
    let mut dw = tumble_tensor::pool::scratch_f32(n * k);
    tumble_kernels::dense(&Rows::Columns(&dy_cols), &px, &mut dw, &NoEpilogue, threads)
        .map_err(internal)?;
    Ok(dw)
}

/// `nn.dense(x, w)`'s operands and output gradient as the GEMMs read them.
struct DenseOperands<'t> {
    /// `w`'s (N, K) and the rows M of `x` and `dy`.
    n: usize,
    k: usize,
    m: usize,
    x: &'t [f32],
    dy: &'t [f32],
}

/// [`DenseOperands`] where they fit the GEMM: f32, `w` of shape (N, K), `x` and `dy` with the
/// same (nonzero) number of rows.
fn dense_operands<'t>(x: &'t Tensor, w: &Tensor, dy: &'t Tensor) -> Option<DenseOperands<'t>> {
    let &[n, k] = w.shape() else { return None };
    w.as_f32()?;
    let (x, m) = rows_of(x, k)?;
    let (dy, mg) = rows_of(dy, n)?;
    (m > 0 && mg == m).then_some(DenseOperands { n, k, m, x, dy })
}

/// Both gradients of one launch's `nn.dense(x, w)` by two GEMMs. `None` when the operands are
/// not f32 of matching shapes (the operator's reference vjp then runs).
pub(super) fn dense_vjp_gemm(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    threads: usize,
) -> Option<Result<(Tensor, Tensor), RunError>> {
    let DenseOperands {
        n,
        k,
        m,
        x: xs,
        dy: gs,
    } = dense_operands(x, w, dy)?;
    let run = || -> Result<(Tensor, Tensor), RunError> {
        let dx = dx_gemm(gs, m, w, n, k, threads)?;
        let dw = dw_gemm(&[(xs, gs)], n, k, threads)?;
        Ok((
            Tensor::from_vec(x.shape().to_vec(), dx).map_err(internal)?,
            Tensor::from_vec(w.shape().to_vec(), dw).map_err(internal)?,
        ))
    };
    Some(run())
}

/// `dX` of one launch's `nn.dense(x, w)` now, its `dW` kept for [`DeferredDense::finish`]
/// under parameter `param`. `None` (nothing kept) when the operands do not fit the GEMM.
pub(super) fn dense_dx_deferring_dw(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    target: Target,
    deferred: &mut DeferredDense,
    threads: usize,
) -> Option<Result<Tensor, RunError>> {
    let DenseOperands {
        n, k, m, dy: gs, ..
    } = dense_operands(x, w, dy)?;
    if let Some(r) = &target.region {
        if r.shape() != [n, k] {
            return None;
        }
    }
    let dx = dx_gemm(gs, m, w, n, k, threads)
        .and_then(|dx| Tensor::from_vec(x.shape().to_vec(), dx).map_err(internal));
    if dx.is_ok() {
        let pending = deferred.by_param.entry(target).or_insert_with(|| Pending {
            shape: [n, k],
            pairs: Vec::new(),
        });
        if pending.shape != [n, k] {
            return Some(Err(internal("deferred dense gradient of another shape")));
        }
        pending.pairs.push((x.clone(), dy.clone()));
    }
    Some(dx)
}

/// Where a deferred `dW` goes: a parameter, or a block of its rows and columns.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Target {
    pub param: usize,
    pub region: Option<Region>,
}

impl Target {
    pub(super) fn whole(param: usize) -> Target {
        Target {
            param,
            region: None,
        }
    }
}

/// Rows and columns (`[start, end)` each) of a 2-D parameter of shape `full`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Region {
    pub full: [usize; 2],
    pub rows: [usize; 2],
    pub cols: [usize; 2],
}

impl Region {
    fn shape(&self) -> [usize; 2] {
        [
            self.rows[1].saturating_sub(self.rows[0]),
            self.cols[1].saturating_sub(self.cols[0]),
        ]
    }

    /// `dw` (this region's) placed in a zero gradient of the whole parameter.
    fn placed(&self, dw: &[f32]) -> Result<Tensor, RunError> {
        let [nr, nc] = self.full;
        let width = self.shape()[1];
        let mut full = vec![0f32; nr * nc];
        for (r, src) in (self.rows[0]..self.rows[1]).zip(dw.chunks_exact(width.max(1))) {
            let at = r * nc + self.cols[0];
            full.get_mut(at..at + width)
                .ok_or_else(|| internal("deferred dense gradient outside its parameter"))?
                .copy_from_slice(src);
        }
        Tensor::from_vec(vec![nr, nc], full).map_err(internal)
    }
}

/// The launches' `(X, dY)` pairs of each parameter (or block of one) whose `dW` waits for the
/// pass's end.
#[derive(Default)]
pub(super) struct DeferredDense {
    by_param: BTreeMap<Target, Pending>,
}

struct Pending {
    /// The weight's `(N, K)`.
    shape: [usize; 2],
    pairs: Vec<(Tensor, Tensor)>,
}

impl DeferredDense {
    /// Adds each parameter's `Σ dYᵀ · X` into its gradient (parameters in index order).
    pub(super) fn finish(
        self,
        grads: &mut [Option<ParamGrad>],
        threads: usize,
    ) -> Result<(), RunError> {
        for (target, pending) in self.by_param {
            let [n, k] = pending.shape;
            let pairs = pending
                .pairs
                .iter()
                .map(|(x, g)| Some((rows_of(x, k)?.0, rows_of(g, n)?.0)))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| internal("deferred dense gradient of another shape"))?;
            let dw = dw_gemm(&pairs, n, k, threads)?;
            let dw = match &target.region {
                None => Tensor::from_vec(vec![n, k], dw).map_err(internal)?,
                Some(region) => region.placed(&dw)?,
            };
            if let Some(slot) = grads.get_mut(target.param) {
                add_dense(slot, dw).map_err(internal)?;
            }
        }
        Ok(())
    }
}
