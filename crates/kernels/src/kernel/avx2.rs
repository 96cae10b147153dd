//! AVX2 + FMA micro-kernel: the classic 6 × 16 tile (12 ymm accumulators, 2 for the weight row,
//! 1 broadcast). A 32-wide weight panel is consumed in two 16-column halves. Edge tiles: fewer
//! rows use the same code instantiated for `M < 6`; fewer columns use `vmaskmovps`.
//!
//! A tile of at most [`WIDE_ROWS`] rows takes the whole 32-wide panel instead ([`wide_rows`]):
//! an FMA's result is ready 4 cycles after it issues and the core issues two a cycle, so a K
//! step needs 8 independent accumulators to keep both FMA units busy. The 16-column tile has
//! only 2 per row: with 1 or 2 rows (a launch of a few rows, the last rows of a launch of
//! 6k + 1 or 6k + 2) each K step waits on the latency, 2 or 4 FMAs in 4 cycles. Across 32
//! columns the same rows have 4 accumulators each, twice the FMAs per step (measured with
//! `gemm_bench --ab wide_tiles=0`: 1.1–1.4× on 1 and 2 rows, 1.06–1.15× on 7 and 8).

use super::{
    DirectTile, DirectTileFn, InPlace, Kernel, Packed, TileA, TileFn, WideTile, DIRECT_MAX_ROWS,
};
use crate::pack::{PanelPackFn, NR};
use std::arch::x86_64::*;

pub(crate) const MR: usize = 6;

/// Blocking: the BLIS Haswell values scaled to a 32-wide panel (on the AVX-512 development
/// machine this kernel reaches ~75 GFLOP/s at 512×256×768; on an AVX2-only AMD EPYC 77-88 with
/// warm weights). The next weight panel is prefetched into L2 as in the AVX-512 kernel: with
/// weights streamed from memory (`gemm_bench --cold 8`, 5 alternated runs, medians) 53×512×1536
/// 52 -> 71 GFLOP/s, 105×512×512 70 -> 77, 315×512×1536 68 -> 78 (`TUMBLE_NO_PREFETCH=1` for
/// the other figure).
pub(crate) const KERNEL: Kernel = kernel::<UNROLL>(Some(&KERNEL_ROLLED));

/// [`KERNEL`] with its K loops not unrolled ([`crate::Tuning::unrolled_tiles`] off).
const KERNEL_ROLLED: Kernel = kernel::<1>(None);

/// The kernel whose tiles make `U` K steps a loop trip.
const fn kernel<const U: usize>(rolled: Option<&'static Kernel>) -> Kernel {
    Kernel {
        mr: MR,
        width: 16,
        tile: tile::<U, false> as TileFn,
        direct: Some(DirectTile {
            tile: tile_direct::<U, false> as DirectTileFn,
            rows: MR,
        }),
        kc: 256,
        mc: 16 * MR,
        small_m: 4,
        pack_panel: Some(crate::pack::pack_panel_avx2 as PanelPackFn),
        prefetches_c: false,
        wide: Some(WideTile {
            tile: tile::<U, true> as TileFn,
            direct: tile_direct::<U, true> as DirectTileFn,
            rows: WIDE_ROWS,
        }),
        multi: None,
        rolled,
    }
}

/// K steps per trip of a tile's loop. The loop's own instructions (the trip count, the test
/// for a prefetch, the pointer steps) are a fifth of a 6-row step's: unrolled 4 times they are a
/// twentieth, and the FMAs issue without waiting on the loop. Paired calls
/// (`gemm_bench --ab unrolled_tiles=0`) before/after: see `bench/RESULTS.md`.
const UNROLL: usize = 4;

/// Rows the 32-column tile takes at most: 2 rows × 4 accumulators, 4 weight vectors and a
/// broadcast use 13 of the 16 ymm registers. (3 rows would need 17: measured 0.72–0.75× the
/// speed of the 16-column tile on 3 × 256 × 256; loading the weight half a panel at a time to
/// stay within 15, 0.70–0.99×, and 0.83–0.87× on 9 × 512 × 512.)
pub(crate) const WIDE_ROWS: usize = 2;

/// Dispatch on the number of rows; see [`TileFn`] for the contract. `WIDE`: the whole-panel
/// tile ([`WideTile`]: at most [`WIDE_ROWS`] rows, 32 columns); `U`: K steps a loop trip.
///
/// # Safety
/// The [`TileFn`] contract (with `WIDE`, [`WideTile`]'s); the CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn tile<const U: usize, const WIDE: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    m: usize,
    n: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded contract (`m <= MR` rows of a packed micro-panel).
    unsafe {
        by_rows::<Packed, U, WIDE>(kc, Packed { a, lda }, b, prefetch, c, ldc, m, n, accumulate)
    }
}

/// [`tile`] on rows of A read where they lie (at most [`MR`] of them): row `i` is `rows[i]`, no
/// packed micro-panel; see [`DirectTileFn`] for the contract. The same multiply-adds in the same
/// order as [`tile`] on the packed rows, so the bits are the same.
///
/// # Safety
/// The [`DirectTileFn`] contract with `m <= MR` (with `WIDE`, [`WideTile`]'s); the CPU supports
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn tile_direct<const U: usize, const WIDE: bool>(
    kc: usize,
    rows: &[*const f32; DIRECT_MAX_ROWS],
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    m: usize,
    n: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded contract (`m <= MR` rows read where they lie).
    unsafe {
        by_rows::<InPlace<'_>, U, WIDE>(
            kc,
            InPlace { rows, p: 0 },
            b,
            prefetch,
            c,
            ldc,
            m,
            n,
            accumulate,
        )
    }
}

/// [`rows`] (or with `WIDE`, [`wide_rows`]) instantiated for the tile's `m` rows (1..=[`MR`],
/// or 1..=[`WIDE_ROWS`]; anything else computes nothing).
///
/// # Safety
/// The contract of [`rows`] or [`wide_rows`] with `M == m`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn by_rows<A: TileA, const U: usize, const WIDE: bool>(
    kc: usize,
    a: A,
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    m: usize,
    n: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded contract; each arm is instantiated for exactly the `m` rows it touches.
    unsafe {
        match (WIDE, m) {
            (true, 1) => wide_rows::<1, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (true, 2) => wide_rows::<2, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (true, _) => {}
            (false, 1) => rows::<1, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, 2) => rows::<2, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, 3) => rows::<3, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, 4) => rows::<4, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, 5) => rows::<5, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, 6) => rows::<6, A, U>(kc, a, b, prefetch, c, ldc, n, accumulate),
            (false, _) => {}
        }
    }
}

/// `M` rows × 16 columns, A read through `a`.
///
/// # Safety
/// [`TileFn`] contract with `m == M`, `n <= 16` (for [`Packed`]), or [`DirectTileFn`]'s (for
/// [`InPlace`]).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn rows<const M: usize, A: TileA, const U: usize>(
    kc: usize,
    mut a: A,
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    n: usize,
    accumulate: bool,
) {
    let mut c0 = [_mm256_setzero_ps(); M];
    let mut c1 = [_mm256_setzero_ps(); M];
    // SAFETY: step `p < kc` reads `b[p*32 .. p*32 + 16]` and A's `M` elements of step `p` (inside
    // the contract's ranges); the loads and stores are limited to `n` columns of `M` rows by the
    // lane masks. Prefetches are hints: `prefetch` is null or valid for the same `kc * 32` floats
    // as a panel.
    unsafe {
        for i in 0..M {
            let mut v = [_mm256_setzero_ps(); 2];
            start_row(c.add(i * ldc), &mut v, n, accumulate);
            [c0[i], c1[i]] = v;
        }
        // Step `p`'s pointer is made from `p`, never stepped past the last step: a tile over a
        // panel's second half starts 16 floats in, so a pointer stepped once more would lie past
        // the weight buffer, where `add` is undefined even unread (and `wrapping_add` cost 2–3%
        // on tiles of 3–13 rows).
        let mut p = 0;
        let mut step = || {
            let bp = b.add(p * NR);
            let b0 = _mm256_loadu_ps(bp);
            let b1 = _mm256_loadu_ps(bp.add(8));
            for i in 0..M {
                let ai = _mm256_set1_ps(a.at(i));
                c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
                c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
            }
            a.step();
            p += 1;
        };
        k_loop::<U>(kc, prefetch, &mut step);
        for i in 0..M {
            store_row(c.add(i * ldc), &[c0[i], c1[i]], n);
        }
    }
}

/// `M` rows × 32 columns, A read through `a`: [`rows`] over a whole panel, the same
/// multiply-adds of each element in the same order (the same bits).
///
/// # Safety
/// [`WideTile`]'s contract with `m == M`: [`TileFn`]'s or [`DirectTileFn`]'s with width 32,
/// `b` valid for reads of `kc * 32` floats.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn wide_rows<const M: usize, A: TileA, const U: usize>(
    kc: usize,
    mut a: A,
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    n: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; M];
    // SAFETY: step `p < kc` reads `b[p*32 .. p*32 + 32]` and A's `M` elements of step `p` (inside
    // the contract's ranges); the loads and stores are limited to `n` columns of `M` rows by the
    // lane masks. Prefetches are hints: `prefetch` is null or valid for the same `kc * 32` floats
    // as a panel.
    unsafe {
        for (i, row) in acc.iter_mut().enumerate() {
            start_row(c.add(i * ldc), row, n, accumulate);
        }
        let mut bp = b;
        let mut step = || {
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_set1_ps(a.at(i));
                for (j, v) in row.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(ai, _mm256_loadu_ps(bp.add(8 * j)), *v);
                }
            }
            a.step();
            // After the last step one past the panel's end, which `add` allows.
            bp = bp.add(NR);
        };
        k_loop::<U>(kc, prefetch, &mut step);
        for (i, row) in acc.iter().enumerate() {
            store_row(c.add(i * ldc), row, n);
        }
    }
}

/// Writes one row of a tile, `vs` (8 columns a vector), at `cp`: its first `n` columns only
/// (lane masks past them).
///
/// # Safety
/// `cp` is valid for writes of `min(n, 8 * vs.len())` floats; the CPU supports AVX2.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store_row(cp: *mut f32, vs: &[__m256], n: usize) {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (j, &v) in vs.iter().enumerate() {
        // SAFETY: columns `8j ..` are inside the row's `n` (a full vector) or masked to them.
        unsafe {
            let at = cp.add(8 * j);
            if n >= 8 * j + 8 {
                _mm256_storeu_ps(at, v);
            } else if n > 8 * j {
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - 8 * j) as i32), lanes);
                _mm256_maskstore_ps(at, mask, v);
            }
        }
    }
}

/// The accumulators of one row of a tile before its K loop: C's first `n` columns when the tile
/// accumulates (a later K block or part carries on the earlier ones' multiply-adds, so an
/// element's bits do not depend on where K was blocked, nor on how many rows its launch had),
/// else zeros (lanes past `n` are zero either way).
///
/// # Safety
/// With `accumulate`, `cp` is valid for reads of `min(n, 8 * vs.len())` floats; the CPU supports
/// AVX2.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn start_row(cp: *const f32, vs: &mut [__m256], n: usize, accumulate: bool) {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (j, v) in vs.iter_mut().enumerate() {
        *v = _mm256_setzero_ps();
        if !accumulate {
            continue;
        }
        // SAFETY: columns `8j ..` are inside the row's `n` (a full vector) or masked to them.
        unsafe {
            let at = cp.add(8 * j);
            if n >= 8 * j + 8 {
                *v = _mm256_loadu_ps(at);
            } else if n > 8 * j {
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - 8 * j) as i32), lanes);
                *v = _mm256_maskload_ps(at, mask);
            }
        }
    }
}

/// Runs `step` `kc` times, `U` steps a trip. With a `prefetch` panel (not null) each step also
/// prefetches that panel's row of the same step into L2 (two lines): the next weight panel
/// arrives while this one computes, since a launch streams its weights from memory and demand
/// misses on them stall the FMAs. Two loops, so the steps of the common case (no prefetch)
/// test nothing.
///
/// # Safety
/// `prefetch` is null or valid for reads of `kc * 32` floats (prefetches are hints, but the
/// pointer arithmetic stays inside that panel); `step` is safe to call `kc` times.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn k_loop<const U: usize>(kc: usize, prefetch: *const f32, step: &mut impl FnMut()) {
    let trips = kc / U;
    let rest = kc % U;
    if prefetch.is_null() {
        for _ in 0..trips {
            for _ in 0..U {
                step();
            }
        }
        for _ in 0..rest {
            step();
        }
    } else {
        let mut pf = prefetch;
        let mut prefetched = || {
            // SAFETY: `pf` walks the prefetch panel one 32-float row per step, `kc` rows.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(pf.add(16) as *const i8);
                pf = pf.add(NR);
            }
            step();
        };
        for _ in 0..trips {
            for _ in 0..U {
                prefetched();
            }
        }
        // The last `kc % U` rows of the next panel too.
        for _ in 0..rest {
            prefetched();
        }
    }
}
