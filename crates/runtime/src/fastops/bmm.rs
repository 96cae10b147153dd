//! `nn.batch_matmul` of f32 operands on the GEMM kernel.

use super::*;

/// Batched matrix product of 3-D f32 tensors: `x (G, M, K)` times `y (G, N, K)ᵀ` (`tb`) or
/// `y (G, K, N)`; a batch dimension of 1 on either side broadcasts.
pub fn bmm_f32(x: &Tensor, y: &Tensor, tb: bool, threads: usize) -> Option<Tensor> {
    let (xd, yd) = (x.as_f32()?, y.as_f32()?);
    let ([gx, m, k], ys) = (x.shape(), y.shape()) else {
        return None;
    };
    let [gy, a, bdim] = ys else { return None };
    let (n, ky) = if tb { (*a, *bdim) } else { (*bdim, *a) };
    if ky != *k || (*gx != *gy && *gx != 1 && *gy != 1) {
        return None;
    }
    let g = (*gx).max(*gy);
    let (m, k) = (*m, *k);
    let mut out = zeroed_f32(g * m * n);
    // One product per batch element (`gemm::small_product`: the GEMM kernel for a row per
    // token against a head's keys or values, dot products for a few rows).
    crate::gemm::small_products(g, m * n, m * n * k, threads, &mut out, |gi, o| {
        let xo = if *gx == 1 { 0 } else { gi * m * k };
        let yo = if *gy == 1 { 0 } else { gi * n * k };
        let (Some(xi), Some(yi)) = (xd.get(xo..xo + m * k), yd.get(yo..yo + n * k)) else {
            return Err("internal: batch_matmul operand too short".into());
        };
        crate::gemm::small_product(xi, m, k, yi, n, tb, o)
    })
    .ok()?;
    Tensor::from_f32(vec![g, m, n], out).ok()
}
