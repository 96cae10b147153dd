//! AVX-512F micro-kernel: a 14 × 32 tile in 28 zmm accumulators; per step of K two zmm loads of
//! the weight panel and 14 FMAs per load with A broadcast straight from memory (`{1to16}`).
//! Edge tiles: fewer rows use the same code instantiated for `M < 14` rows; fewer columns use
//! masked loads/stores, so there is no scalar tail and no temporary.

use super::{
    DirectTile, DirectTileFn, InPlace, Kernel, MultiA, MultiOut, MultiTile, MultiTileFn, Packed,
    TileA, TileFn, DIRECT_MAX_ROWS,
};
use crate::pack::{PanelPackFn, NR};
use std::arch::x86_64::*;

pub(crate) const MR: usize = 14;

/// Blocking measured on the development machine (Sapphire Rapids class Xeon, 48 KiB L1d, 2 MiB L2
/// per core; GFLOP/s, 1 thread, min of runs while other jobs shared the machine, so ±10%):
/// KC × MC ∈ {128, 192, 256, 384} × {56, 112, 224} on 2048×1024×1024 / 512×256×768 / 512×768×3072
/// / 512×512×1536: KC=256 MC=56 gave 112/122/103/116, KC=256 MC=112 111/122/92/105, KC=384 MC=56
/// 117/121/71/89, KC=128 MC=112 77/109/87/79. A KC=256 weight panel (32 KiB) stays in L1 while
/// four 14-row micro-panels stream past it; MC=56 also keeps the epilogue's block small and hot.
///
/// Small-M path (`m <= small_m`: K unblocked, one row block; min µs, blocked vs small path):
/// B=2 256×768 11.8 vs 10.3; B=3 256×768 17.6 vs 15.0; B=4 256×768 18.3 vs 15.7; B=4 768×3072
/// 510 vs 447; B=3 512×1536 166 vs 145; B=8 256×768 30.5 vs 29.5 (equal: one row block either
/// way). Above 4 rows the two coincide, so the threshold is 4.
pub(crate) const KERNEL: Kernel = Kernel {
    mr: MR,
    width: 32,
    tile: tile as TileFn,
    direct: Some(DirectTile {
        tile: tile_direct as DirectTileFn,
        rows: DIRECT_MAX_ROWS,
    }),
    kc: 256,
    mc: 4 * MR,
    small_m: 4,
    pack_panel: Some(crate::pack::pack_panel_avx512 as PanelPackFn),
    prefetches_c: true,
    wide: None,
    multi: Some(MultiTile {
        tile: multi_tile as MultiTileFn,
        rows: MULTI_ROWS,
        panels: MULTI_PANELS,
    }),
    rolled: None,
};

/// Rows a multi-panel tile takes at most: with 1–3 rows the one-panel tile has 2–6 accumulators,
/// and an FMA's result is ready 4 cycles after it issues with two issuing a cycle (Zen 5, and
/// Intel's server cores), so it waits on latency for most of each K step. Over 4 panels the same
/// rows have 8–24 (3 rows × 4 panels: 24 accumulators, 2 weight vectors: within the 32 zmm).
pub(crate) const MULTI_ROWS: usize = 3;

/// Panels a multi-panel tile takes at most (see [`MULTI_ROWS`]).
pub(crate) const MULTI_PANELS: usize = 4;

/// Dispatch on the number of rows; see [`TileFn`] for the contract.
///
/// # Safety
/// The [`TileFn`] contract; in particular the CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tile(
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
    // SAFETY: forwarded contract; each arm is instantiated for exactly the `m` rows it touches.
    unsafe {
        match m {
            1 => small::<1, 1>(kc, a, lda, b, c, ldc, n, accumulate),
            2 => small::<2, 1>(kc, a, lda, b, c, ldc, n, accumulate),
            3 => small::<3, 1>(kc, a, lda, b, c, ldc, n, accumulate),
            4 => rows::<4, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            5 => rows::<5, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            6 => rows::<6, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            7 => rows::<7, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            8 => rows::<8, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            9 => rows::<9, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            10 => rows::<10, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            11 => rows::<11, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            12 => rows::<12, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            13 => rows::<13, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            14 => rows::<14, _>(kc, Packed { a, lda }, b, prefetch, c, ldc, n, accumulate),
            _ => {}
        }
    }
}

/// [`tile`] on rows of A read where they lie: row `i` is `rows[i]` (its K floats contiguous),
/// no packed micro-panel; see [`DirectTileFn`] for the contract. The same multiply-adds in the
/// same order as [`tile`] on the packed rows, so the bits are the same.
///
/// # Safety
/// The [`DirectTileFn`] contract; in particular the CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tile_direct(
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
    let src = InPlace { rows, p: 0 };
    // SAFETY: forwarded contract; each arm reads exactly the `m` rows it is instantiated for.
    unsafe {
        match m {
            1 => self::rows::<1, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            2 => self::rows::<2, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            3 => self::rows::<3, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            4 => self::rows::<4, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            5 => self::rows::<5, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            6 => self::rows::<6, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            7 => self::rows::<7, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            8 => self::rows::<8, _>(kc, src, b, prefetch, c, ldc, n, accumulate),
            _ => {}
        }
    }
}

/// Lane masks for columns `0..16` and `16..32` given `n <= 32` valid columns.
#[inline]
fn masks(n: usize) -> (__mmask16, __mmask16) {
    let lo = if n >= 16 {
        0xFFFF
    } else {
        (1u32 << n) as u16 - 1
    };
    let hi = if n >= 32 {
        0xFFFF
    } else if n > 16 {
        (1u32 << (n - 16)) as u16 - 1
    } else {
        0
    };
    (lo, hi)
}

/// Stores one row of the tile: its first `n` columns.
///
/// # Safety
/// `cp` valid for writes of `n` floats; AVX-512F available.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_row(cp: *mut f32, n: usize, v0: __m512, v1: __m512) {
    // SAFETY: the masks limit every access to the first `n` floats of `cp`.
    unsafe {
        if n == NR {
            _mm512_storeu_ps(cp, v0);
            _mm512_storeu_ps(cp.add(16), v1);
        } else {
            let (m0, m1) = masks(n);
            _mm512_mask_storeu_ps(cp, m0, v0);
            _mm512_mask_storeu_ps(cp.add(16), m1, v1);
        }
    }
}

/// The accumulators of one row of a tile before its K loop: C's first `n` columns when the tile
/// accumulates (a later K block or part carries on the earlier ones' multiply-adds: each element
/// is one chain over all of K, so its bits do not depend on where K was blocked, and so not on
/// how many rows its launch had), else zeros.
///
/// # Safety
/// With `accumulate`, `cp` valid for reads of `n` floats; AVX-512F available.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn start_row(cp: *const f32, n: usize, accumulate: bool) -> (__m512, __m512) {
    if !accumulate {
        return (_mm512_setzero_ps(), _mm512_setzero_ps());
    }
    // SAFETY: the masks limit every access to the first `n` floats of `cp`.
    unsafe {
        if n == NR {
            (_mm512_loadu_ps(cp), _mm512_loadu_ps(cp.add(16)))
        } else {
            let (m0, m1) = masks(n);
            (
                _mm512_maskz_loadu_ps(m0, cp),
                _mm512_maskz_loadu_ps(m1, cp.add(16)),
            )
        }
    }
}

/// `M` rows × 32 columns, one accumulator pair per row, A read through `a`.
///
/// # Safety
/// [`TileFn`] contract with `m == M` (for [`Packed`]), or [`DirectTileFn`]'s (for [`InPlace`]).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows<const M: usize, A: TileA>(
    kc: usize,
    mut a: A,
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    n: usize,
    accumulate: bool,
) {
    let mut c0 = [_mm512_setzero_ps(); M];
    let mut c1 = [_mm512_setzero_ps(); M];
    // SAFETY: step `p < kc` reads `b[p*32 .. p*32 + 32]` and A's `M` elements of step `p`, inside
    // the ranges the contract guarantees; the loads and stores touch `M` rows of `n` columns of
    // `c`.
    unsafe {
        for i in 0..M {
            if accumulate {
                (c0[i], c1[i]) = start_row(c.add(i * ldc), n, accumulate);
                // The chains start from C, so C must be at hand when the tile starts: the
                // driver's next tile is usually the next `M` rows of these columns, whose C is
                // asked for now, a whole K loop ahead. (A prefetch never faults; past the
                // block's rows it only wastes a line.)
                let next = c.wrapping_add((M + i) * ldc);
                _mm_prefetch::<_MM_HINT_T0>(next as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(16) as *const i8);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
            }
        }
        let mut bp = b;
        let mut pf = prefetch;
        for _ in 0..kc {
            if !pf.is_null() {
                _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(pf.add(16) as *const i8);
                pf = pf.add(NR);
            }
            let b0 = _mm512_loadu_ps(bp);
            let b1 = _mm512_loadu_ps(bp.add(16));
            for i in 0..M {
                let ai = _mm512_set1_ps(a.at(i));
                c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
                c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
            }
            a.step();
            bp = bp.add(NR);
        }
        for i in 0..M {
            store_row(c.add(i * ldc), n, c0[i], c1[i]);
        }
    }
}

/// Few rows (`M <= 3`): K can be unrolled `U` times into independent accumulator sets (summed at
/// the end) to hide the FMA latency behind more than `2M` chains. `tile` uses `U = 1`: split
/// sums round differently from `rows`, so a row's result depended on how many rows its launch
/// had (a served instance differed from `tumble run` in the last bits), and at 1-3 rows the
/// kernel is bound by streaming the weights anyway: `gemm_bench --stat min`, B = 1/2/3, 256×768
/// and 512×1536, U = 4/2/2 against U = 1 within 3% either way.
///
/// # Safety
/// [`TileFn`] contract with `m == M`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn small<const M: usize, const U: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    n: usize,
    accumulate: bool,
) {
    let mut c0 = [[_mm512_setzero_ps(); M]; U];
    let mut c1 = [[_mm512_setzero_ps(); M]; U];
    // SAFETY: as in `rows`: every step `p < kc` reads inside the contract's ranges.
    unsafe {
        for i in 0..M {
            (c0[0][i], c1[0][i]) = start_row(c.add(i * ldc), n, accumulate);
        }
        let mut ap = a;
        let mut bp = b;
        let mut p = 0;
        while p + U <= kc {
            for u in 0..U {
                let b0 = _mm512_loadu_ps(bp.add(u * NR));
                let b1 = _mm512_loadu_ps(bp.add(u * NR + 16));
                for i in 0..M {
                    let ai = _mm512_set1_ps(*ap.add(u * lda + i));
                    c0[u][i] = _mm512_fmadd_ps(ai, b0, c0[u][i]);
                    c1[u][i] = _mm512_fmadd_ps(ai, b1, c1[u][i]);
                }
            }
            // Wrapping: after the last step `ap` may point past the rows the contract promises
            // (`(kc - 1) * lda + M` floats), where `add` would be undefined even unread.
            ap = ap.wrapping_add(U * lda);
            bp = bp.add(U * NR);
            p += U;
        }
        while p < kc {
            let b0 = _mm512_loadu_ps(bp);
            let b1 = _mm512_loadu_ps(bp.add(16));
            for i in 0..M {
                let ai = _mm512_set1_ps(*ap.add(i));
                c0[0][i] = _mm512_fmadd_ps(ai, b0, c0[0][i]);
                c1[0][i] = _mm512_fmadd_ps(ai, b1, c1[0][i]);
            }
            ap = ap.wrapping_add(lda);
            bp = bp.add(NR);
            p += 1;
        }
        for i in 0..M {
            let mut v0 = c0[0][i];
            let mut v1 = c1[0][i];
            for u in 1..U {
                v0 = _mm512_add_ps(v0, c0[u][i]);
                v1 = _mm512_add_ps(v1, c1[u][i]);
            }
            store_row(c.add(i * ldc), n, v0, v1);
        }
    }
}

/// [`MultiTileFn`]: dispatch on the rows and panels; packed A, or rows where they lie.
///
/// # Safety
/// The [`MultiTileFn`] contract (`m <= MULTI_ROWS`, `panels <= MULTI_PANELS`); the CPU supports
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn multi_tile(kc: usize, a: MultiA<'_>, m: usize, panels: usize, out: MultiOut) {
    // SAFETY: forwarded contract.
    unsafe {
        match a {
            MultiA::Rows(rows) => multi_panels(kc, InPlace { rows, p: 0 }, m, panels, out),
            MultiA::Packed { a, lda } => multi_panels(kc, Packed { a, lda }, m, panels, out),
        }
    }
}

/// [`multi_rows`] instantiated for `m` rows and `panels` panels (anything outside
/// `1..=MULTI_ROWS` × `2..=MULTI_PANELS` computes nothing).
///
/// # Safety
/// [`multi_rows`]'s contract with `M == m`, `P == panels`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn multi_panels<A: TileA>(kc: usize, a: A, m: usize, panels: usize, out: MultiOut) {
    // SAFETY: forwarded contract; each arm is instantiated for exactly its rows and panels.
    unsafe {
        match (m, panels) {
            (1, 2) => multi_rows::<1, 2, A>(kc, a, out),
            (1, 3) => multi_rows::<1, 3, A>(kc, a, out),
            (1, 4) => multi_rows::<1, 4, A>(kc, a, out),
            (2, 2) => multi_rows::<2, 2, A>(kc, a, out),
            (2, 3) => multi_rows::<2, 3, A>(kc, a, out),
            (2, 4) => multi_rows::<2, 4, A>(kc, a, out),
            (3, 2) => multi_rows::<3, 2, A>(kc, a, out),
            (3, 3) => multi_rows::<3, 3, A>(kc, a, out),
            (3, 4) => multi_rows::<3, 4, A>(kc, a, out),
            _ => {}
        }
    }
}

/// `M` rows × `P` panels of 32 columns, A read through `a`: per element the multiply-adds of
/// [`small`] and [`rows`] in the same order (from zero, or from C when accumulating, K
/// ascending), so the same bits as the one-panel tiles.
///
/// # Safety
/// [`MultiTileFn`]'s contract with `m == M`, `panels == P`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn multi_rows<const M: usize, const P: usize, A: TileA>(kc: usize, mut a: A, out: MultiOut) {
    let MultiOut {
        b,
        pstride,
        c,
        ldc,
        n,
        accumulate,
    } = out;
    let mut acc = [[[_mm512_setzero_ps(); 2]; P]; M];
    // SAFETY: step `p < kc` reads `b[j * pstride + p*32 ..][..32]` for `j < P` and A's `M`
    // elements of step `p`, inside the contract's ranges; the loads and stores touch `M` rows of
    // the columns below `n` (each panel's share masked by `start_row` and `store_row`).
    unsafe {
        for (i, row) in acc.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                let col = j * NR;
                if col < n {
                    (v[0], v[1]) = start_row(c.add(i * ldc + col), (n - col).min(NR), accumulate);
                }
            }
        }
        let mut bp = b;
        for _ in 0..kc {
            for j in 0..P {
                let bj = bp.add(j * pstride);
                let b0 = _mm512_loadu_ps(bj);
                let b1 = _mm512_loadu_ps(bj.add(16));
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(a.at(i));
                    row[j][0] = _mm512_fmadd_ps(ai, b0, row[j][0]);
                    row[j][1] = _mm512_fmadd_ps(ai, b1, row[j][1]);
                }
            }
            a.step();
            bp = bp.add(NR);
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                let col = j * NR;
                if col < n {
                    store_row(c.add(i * ldc + col), (n - col).min(NR), v[0], v[1]);
                }
            }
        }
    }
}
