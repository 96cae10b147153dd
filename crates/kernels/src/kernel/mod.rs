//! Micro-kernels and their selection.
//!
//! A micro-kernel computes one register tile `C[0..m, 0..n] (+)= Ã · B̃` over `kc` steps of K, where
//! `Ã` is a packed A micro-panel (element `(i, p)` at `a[p * lda + i]`) and `B̃` a slice of a
//! 32-wide weight panel (element `(p, j)` at `b[p * 32 + j]`). Three implementations:
//!
//! | kind       | tile (MR × width) | registers                                 |
//! |------------|-------------------|-------------------------------------------|
//! | `avx512`   | 14 × 32           | 28 zmm accumulators, A broadcast from memory |
//! | `avx2+fma` | 6 × 16            | 12 ymm accumulators (the classic BLIS tile)  |
//! | `portable` | 4 × 16            | plain Rust, auto-vectorized for the target   |
//!
//! Selected at run time with `is_x86_feature_detected!`; `TUMBLE_GEMM_KERNEL=avx512|avx2|portable`
//! overrides the choice (when the CPU supports it).

// The micro-kernel signature mirrors BLIS's (sizes, three operands with strides, flags): grouping
// them into a struct would only add loads in the hottest call of the crate.
#![allow(clippy::too_many_arguments)]

use crate::error::KernelError;
use crate::pack::PanelPackFn;
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod portable;

/// A register-tile micro-kernel.
///
/// # Safety (contract every caller upholds)
/// - the CPU supports the kernel's instruction set (guaranteed: a [`Kernel`] is only built for a
///   [`KernelKind`] that [`KernelKind::is_available`]);
/// - `1 <= m <= mr`, `1 <= n <= width`, `lda >= m`;
/// - if `kc > 0`: `a` is valid for reads of `(kc - 1) * lda + m` floats and `b` for reads of
///   `(kc - 1) * 32 + width` floats;
/// - `c` is valid for reads and writes of the `m` rows `c[i * ldc .. i * ldc + n]`, and nothing else
///   accesses those elements during the call.
///
/// `prefetch` is null or the weight slice the next tiles will read (same layout as `b`, valid for
/// the same reads): a kernel may prefetch it into L2 while it computes; it is a hint only.
///
/// With `accumulate` the tile is added to `C`, otherwise it overwrites `C` (`C` is never read).
pub(crate) type TileFn = unsafe fn(
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
);

/// Rows a [`DirectTileFn`] reads where they lie, at most.
pub(crate) const DIRECT_MAX_ROWS: usize = 8;

/// A [`TileFn`] reading A's rows where they lie instead of from a packed micro-panel: row `i`
/// of the tile is `rows[i]`, its K floats contiguous. For launches of a few rows, where packing
/// (register transposes for 16 rows, most of them zeros) costs a tenth of the product.
///
/// # Safety (contract every caller upholds)
/// As [`TileFn`]'s, with `1 <= m <=` the kernel's [`DirectTile::rows`] and, instead of
/// `a`/`lda`: if `kc > 0`, `rows[i]` for `i < m` is valid for reads of `kc` floats.
pub(crate) type DirectTileFn = unsafe fn(
    kc: usize,
    rows: &[*const f32; DIRECT_MAX_ROWS],
    b: *const f32,
    prefetch: *const f32,
    c: *mut f32,
    ldc: usize,
    m: usize,
    n: usize,
    accumulate: bool,
);

/// Where a multi-panel tile's A comes from: a packed micro-panel of `lda` floats a K step (as a
/// [`TileFn`] reads it), or rows where they lie (as a [`DirectTileFn`] does).
#[derive(Clone, Copy)]
pub(crate) enum MultiA<'a> {
    Packed { a: *const f32, lda: usize },
    Rows(&'a [*const f32; DIRECT_MAX_ROWS]),
}

/// A multi-panel tile's weight panels (`b`, the first; `pstride` floats to the next panel's same
/// K step) and its C block (`c`, row stride `ldc`, `n` columns from the first panel's first;
/// `accumulate`: add to C instead of storing).
#[derive(Clone, Copy)]
pub(crate) struct MultiOut {
    pub(crate) b: *const f32,
    pub(crate) pstride: usize,
    pub(crate) c: *mut f32,
    pub(crate) ldc: usize,
    pub(crate) n: usize,
    pub(crate) accumulate: bool,
}

/// A tile over `panels` consecutive 32-wide weight panels at once (`2..=` the kernel's
/// [`MultiTile::panels`]) for `m` rows: more independent accumulators per row than one
/// panel's, so that a launch of 1–3 rows (or the last rows of a launch) does not wait on FMA
/// latency.
///
/// # Safety (contract every caller upholds)
/// As [`TileFn`]'s ([`MultiA::Packed`]) or [`DirectTileFn`]'s ([`MultiA::Rows`]), with
/// `1 <= m <=` the kernel's [`MultiTile::rows`] and, instead of one panel: `2 <= panels <=`
/// [`MultiTile::panels`], `(panels - 1) * 32 < out.n <= panels * 32`, and if `kc > 0`,
/// `out.b + j * out.pstride` valid for reads of `kc * 32` floats for every `j < panels`. Each
/// element's multiply-adds are those of the kernel's own tile in the same order (the same bits).
pub(crate) type MultiTileFn =
    unsafe fn(kc: usize, a: MultiA<'_>, m: usize, panels: usize, out: MultiOut);

/// A kernel's [`MultiTileFn`], for at most `rows` rows over at most `panels` panels.
#[derive(Clone, Copy)]
pub(crate) struct MultiTile {
    pub(crate) tile: MultiTileFn,
    pub(crate) rows: usize,
    pub(crate) panels: usize,
}

/// Which micro-kernel family computes the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// 14×32 tiles on zmm registers (AVX-512F).
    Avx512,
    /// 6×16 tiles on ymm registers (AVX2 + FMA).
    Avx2Fma,
    /// Plain Rust, auto-vectorized; runs everywhere.
    Portable,
}

impl KernelKind {
    /// All kinds, fastest first.
    pub const ALL: [KernelKind; 3] = [
        KernelKind::Avx512,
        KernelKind::Avx2Fma,
        KernelKind::Portable,
    ];

    /// The name [`crate::cpu_features`] reports: `"avx512"`, `"avx2+fma"` or `"portable"`.
    pub fn name(self) -> &'static str {
        match self {
            KernelKind::Avx512 => "avx512",
            KernelKind::Avx2Fma => "avx2+fma",
            KernelKind::Portable => "portable",
        }
    }

    /// Whether this CPU can run the kind.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            KernelKind::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The kind [`crate::dense`] uses: the fastest available one, unless the environment variable
    /// `TUMBLE_GEMM_KERNEL` names another available kind. Decided once per process.
    pub fn selected() -> KernelKind {
        static SELECTED: OnceLock<KernelKind> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            if let Ok(want) = std::env::var("TUMBLE_GEMM_KERNEL") {
                let want = want.trim().to_ascii_lowercase();
                for kind in KernelKind::ALL {
                    let short = kind.name().split('+').next().unwrap_or("");
                    if (want == kind.name() || want == short) && kind.is_available() {
                        return kind;
                    }
                }
            }
            KernelKind::ALL
                .into_iter()
                .find(|k| k.is_available())
                .unwrap_or(KernelKind::Portable)
        })
    }

    pub(crate) fn kernel(self) -> Result<Kernel, KernelError> {
        if !self.is_available() {
            return Err(KernelError::Unsupported(self.name()));
        }
        Ok(match self {
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx512 => avx512::KERNEL,
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx2Fma => avx2::KERNEL,
            _ => portable::KERNEL,
        })
    }
}

/// Where a tile's A elements come from, one K step at a time: the packed micro-panel, or the
/// rows where they lie (the direct tile). One tile body reads both, so the two compute the same
/// multiply-adds in the same order (the same bits).
pub(crate) trait TileA {
    /// Row `i`'s element at the current K step.
    ///
    /// # Safety
    /// `i` is below the tile's rows and the step below `kc` (the tile's contract).
    unsafe fn at(&self, i: usize) -> f32;
    /// On to the next K step.
    fn step(&mut self);
}

/// A packed micro-panel: step `p`'s elements at `a[p*lda ..]`.
pub(crate) struct Packed {
    pub(crate) a: *const f32,
    pub(crate) lda: usize,
}

impl TileA for Packed {
    #[inline(always)]
    unsafe fn at(&self, i: usize) -> f32 {
        // SAFETY: the caller's contract (the TileFn ranges).
        unsafe { *self.a.add(i) }
    }
    #[inline(always)]
    fn step(&mut self) {
        self.a = self.a.wrapping_add(self.lda);
    }
}

/// Rows where they lie: step `p`'s element of row `i` at `rows[i][p]`.
pub(crate) struct InPlace<'r> {
    pub(crate) rows: &'r [*const f32; DIRECT_MAX_ROWS],
    pub(crate) p: usize,
}

impl TileA for InPlace<'_> {
    #[inline(always)]
    unsafe fn at(&self, i: usize) -> f32 {
        // SAFETY: the caller's contract (the DirectTileFn ranges).
        unsafe { *self.rows[i].add(self.p) }
    }
    #[inline(always)]
    fn step(&mut self) {
        self.p += 1;
    }
}

/// A micro-kernel plus the blocking parameters tuned for it.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    /// Rows of a register tile (and of a packed A micro-panel).
    pub(crate) mr: usize,
    /// Columns of a register tile: 32 (a whole panel) or 16 (half a panel).
    pub(crate) width: usize,
    /// The tile function. Only callable under the [`TileFn`] contract.
    pub(crate) tile: TileFn,
    /// The tile on rows where they lie (`None`: always pack). Only callable under its contract.
    pub(crate) direct: Option<DirectTile>,
    /// K block (rows of a weight panel kept in L1 while a row block streams past).
    pub(crate) kc: usize,
    /// M block (rows of A packed at once; `mc × kc` floats stay in L2). A multiple of `mr`.
    pub(crate) mc: usize,
    /// Launches with at most this many rows take the small-M path: A packed whole (tiny), no K
    /// blocking, threads split the weight's columns. Chosen by measurement (see `driver.rs`).
    pub(crate) small_m: usize,
    /// Packs A micro-panels with register transposes: 16×16 on AVX-512 (14-row panels), 8×8 on
    /// AVX2 (6-row panels); `None` for the portable kernel. The packed bits are the same either
    /// way. Only callable under the [`PanelPackFn`] contract (this kernel's `mr`).
    pub(crate) pack_panel: Option<PanelPackFn>,
    /// The tile prefetches its C rows itself (AVX-512); for the others the driver does, before
    /// each tile call ([`crate::Tuning::prefetch_c`]).
    pub(crate) prefetches_c: bool,
    /// For a kernel whose tile is half a panel wide: a tile of a few rows over the whole panel
    /// (AVX2: 1 or 2 rows, where the half-panel tile waits on FMA latency). `None`: none.
    pub(crate) wide: Option<WideTile>,
    /// Tiles of a few rows over several weight panels at once ([`crate::Tuning::multi_panel_tiles`];
    /// AVX-512, whose one-panel tile is already 32 columns wide). `None`: none.
    pub(crate) multi: Option<MultiTile>,
    /// The same kernel with its tiles' K loops not unrolled ([`crate::Tuning::unrolled_tiles`]
    /// off; the same bits); `None` where there is no other.
    pub(crate) rolled: Option<&'static Kernel>,
}

/// A kernel's tiles over a whole 32-wide panel for at most `rows` rows, packed ([`TileFn`]) and
/// in place ([`DirectTileFn`]); their contracts are those types' with width 32 and `m <= rows`.
/// They compute each element's multiply-adds in the same order as the kernel's own tiles, so
/// the driver may use either for any rows (the same bits).
#[derive(Clone, Copy)]
pub(crate) struct WideTile {
    pub(crate) tile: TileFn,
    pub(crate) direct: DirectTileFn,
    pub(crate) rows: usize,
}

/// A kernel's [`DirectTileFn`] and how many rows one call of it takes (`1..=DIRECT_MAX_ROWS`):
/// a launch's rows are read where they lie in blocks of that many (the AVX2 tile holds 6 rows
/// in registers, the AVX-512 one 8 of its 14).
#[derive(Clone, Copy)]
pub(crate) struct DirectTile {
    pub(crate) tile: DirectTileFn,
    pub(crate) rows: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver indexes row-pointer blocks by a direct tile's rows: every kernel's (available
    /// here or not) must lie in `1..=DIRECT_MAX_ROWS`, and within its register tile.
    #[test]
    fn direct_tiles_take_between_one_and_the_most_rows() {
        #[cfg(target_arch = "x86_64")]
        let kernels = [avx512::KERNEL, avx2::KERNEL, portable::KERNEL];
        #[cfg(not(target_arch = "x86_64"))]
        let kernels = [portable::KERNEL];
        for k in kernels {
            if let Some(d) = k.direct {
                assert!((1..=DIRECT_MAX_ROWS).contains(&d.rows) && d.rows <= k.mr);
            }
        }
    }
}
