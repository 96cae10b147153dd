//! Portable micro-kernel: plain Rust on fixed-size arrays, written so LLVM vectorizes the inner
//! loop over the 16 columns for whatever the target offers. The reference for the SIMD kernels
//! and the engine on non-x86 machines.

use super::{Kernel, TileFn};
use crate::pack::NR;

pub(crate) const MR: usize = 4;
const W: usize = 16;

pub(crate) const KERNEL: Kernel = Kernel {
    mr: MR,
    width: W,
    tile: tile as TileFn,
    direct: None,
    kc: 256,
    mc: 16 * MR,
    small_m: 4,
    pack_panel: None,
    prefetches_c: false,
    wide: None,
    multi: None,
    rolled: None,
};

/// See [`TileFn`] for the contract.
///
/// # Safety
/// The [`TileFn`] contract.
pub(crate) unsafe fn tile(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    _prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    m: usize,
    n: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 || m > MR || n > W {
        return;
    }
    let (a, b) = if kc == 0 {
        (&[][..], &[][..])
    } else {
        // SAFETY: the contract guarantees these read ranges for `kc > 0`.
        unsafe {
            (
                std::slice::from_raw_parts(a, (kc - 1) * lda + m),
                std::slice::from_raw_parts(b, (kc - 1) * NR + W),
            )
        }
    };
    // Accumulating, each element carries on from C (the earlier K blocks' sums), so its bits do
    // not depend on where K was blocked.
    let mut acc = [[0.0f32; W]; MR];
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate().take(m) {
            // SAFETY: the contract makes row `i` of `c` valid for `n` floats, unaliased.
            let crow = unsafe { std::slice::from_raw_parts(c.add(i * ldc), n) };
            row[..n].copy_from_slice(crow);
        }
    }
    tile_slices(kc, a, lda, b, m, &mut acc);
    for (i, row) in acc.iter().enumerate().take(m) {
        // SAFETY: the contract makes row `i` of `c` valid for `n` floats, unaliased.
        let crow = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), n) };
        crow.copy_from_slice(&row[..n]);
    }
}

/// The safe core: `m` rows × 16 columns accumulated over `kc` into `acc`.
fn tile_slices(kc: usize, a: &[f32], lda: usize, b: &[f32], m: usize, acc: &mut [[f32; W]; MR]) {
    for p in 0..kc {
        let brow: &[f32; W] = match b[p * NR..].first_chunk() {
            Some(r) => r,
            None => break,
        };
        let arow = &a[p * lda..p * lda + m];
        for (acc_i, &ai) in acc.iter_mut().zip(arow) {
            for (x, &bj) in acc_i.iter_mut().zip(brow) {
                *x += ai * bj;
            }
        }
    }
}
