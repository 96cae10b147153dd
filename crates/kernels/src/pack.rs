//! Packing: the weight into NR-wide, K-major column panels (once, at load time), and blocks of the
//! A operand into MR-row, K-major micro-panels (per call). Packing A reads the rows wherever they
//! live — contiguous or scattered through a pointer list — which is the fused gather: no gathered
//! copy of the batch ever exists besides the cache-sized packed block the micro-kernel streams.

use crate::error::KernelError;

/// Width of every weight panel: 32 columns = two zmm / four ymm registers. The AVX2 and portable
/// micro-kernels use the same panels (the AVX2 one in two 16-column halves), so a packed weight is
/// independent of the micro-kernel that consumes it.
pub(crate) const NR: usize = 32;

/// Alignment (in f32s) of packed buffers: 64 bytes, one cache line, so a 16-float zmm load never
/// splits a line.
const ALIGN: usize = 16;

/// Buffers of at least this many bytes are aligned to, and advised as, 2 MiB huge pages.
const HUGE_MIN_BYTES: usize = 4 << 20;
/// 2 MiB in f32s.
const HUGE_ALIGN: usize = (2 << 20) / std::mem::size_of::<f32>();

/// Floats to skip from `p` to the next multiple of `align` floats.
fn aligned_offset(p: *const f32, align: usize) -> usize {
    let mis = (p as usize / std::mem::size_of::<f32>()) % align;
    if mis == 0 {
        0
    } else {
        align - mis
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(region: &[f32]) {
    let bytes = std::mem::size_of_val(region) & !((2 << 20) - 1);
    if bytes == 0 {
        return;
    }
    // SAFETY: `region` is a live allocation owned by the caller's Vec and at least `bytes` long;
    // madvise only changes how the kernel backs these pages (no memory is read, written or
    // unmapped), and its failure (e.g. THP disabled) is harmless, so the result is ignored.
    unsafe {
        libc::madvise(
            region.as_ptr() as *mut libc::c_void,
            bytes,
            libc::MADV_HUGEPAGE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_region: &[f32]) {}

/// A `Vec<f32>` whose used part starts on a 64-byte boundary (2 MiB for large buffers).
#[derive(Default)]
pub(crate) struct AlignedBuf {
    raw: Vec<f32>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    /// Make room for `len` floats (contents unspecified but initialized), keeping the allocation
    /// when it is already big enough.
    pub(crate) fn ensure(&mut self, len: usize) {
        let huge = len * std::mem::size_of::<f32>() >= HUGE_MIN_BYTES;
        let align = if huge { HUGE_ALIGN } else { ALIGN };
        if self.raw.len() < len + align {
            // Zeroed allocations this large are fresh, untouched mappings: advising huge pages
            // before the first write makes it fault 2 MiB at a time instead of 4 KiB (packing
            // Berxit's 85M weights spent more time in page faults than in copying).
            self.raw = vec![0.0; len + align];
            self.off = aligned_offset(self.raw.as_ptr(), align);
            if huge {
                advise_huge_pages(&self.raw[self.off..]);
            }
        } else {
            self.off = aligned_offset(self.raw.as_ptr(), align);
        }
        self.len = len;
    }

    pub(crate) fn as_slice(&self) -> &[f32] {
        // (`ensure` keeps `off + len <= raw.len()`.)
        &self.raw[self.off..self.off + self.len]
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.raw[self.off..self.off + self.len]
    }
}

impl Clone for AlignedBuf {
    /// A fresh allocation has its own alignment, so re-align rather than copy `off`.
    fn clone(&self) -> Self {
        let mut b = AlignedBuf::default();
        b.ensure(self.len);
        b.as_mut_slice().copy_from_slice(self.as_slice());
        b
    }
}

/// A weight `W` of shape `(N, K)`, row-major (PyTorch `Linear` layout), packed once for reuse
/// across launches (weights are constants of the program).
///
/// Layout: `ceil(N / 32)` panels of 32 output columns; panel `p` holds `W[p*32 + j][kk]` at
/// `kk * 32 + j` (K-major, so the micro-kernel reads one 32-float row of the panel per step of K).
/// Columns past `N` in the last panel are zero.
#[derive(Clone)]
pub struct PackedWeight {
    n: usize,
    k: usize,
    panels: AlignedBuf,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("n", &self.n)
            .field("k", &self.k)
            .finish_non_exhaustive()
    }
}

impl PackedWeight {
    /// Pack `w`, an `(n, k)` row-major matrix (`w.len() == n * k`). The product `A · Wᵀ` then has
    /// `n` output columns and contracts over `k`.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Result<PackedWeight, KernelError> {
        let expected = n.checked_mul(k).ok_or(KernelError::Overflow)?;
        if w.len() != expected {
            return Err(KernelError::Length {
                what: "w (N×K)".into(),
                expected,
                actual: w.len(),
            });
        }
        let panels = n.div_ceil(NR);
        let total = panels
            .checked_mul(k)
            .and_then(|x| x.checked_mul(NR))
            .ok_or(KernelError::Overflow)?;
        let mut buf = AlignedBuf::default();
        buf.ensure(total);
        let dst = buf.as_mut_slice();
        // Tiles of 32 columns × 8 steps of K: 32 short sequential reads, 8 whole panel rows written
        // while they are in L1. (Row by row, every float of a row lands in a different cache line
        // of a panel larger than L1: packing Berxit's weights took half as long as using them.)
        const KT: usize = 8;
        for (p, panel) in dst.chunks_exact_mut((k * NR).max(1)).enumerate() {
            let cols = NR.min(n - p * NR);
            for k0 in (0..k).step_by(KT) {
                let kc = KT.min(k - k0);
                for j in 0..cols {
                    let row = (p * NR + j) * k + k0;
                    for (t, &v) in w[row..row + kc].iter().enumerate() {
                        panel[(k0 + t) * NR + j] = v;
                    }
                }
                for t in 0..kc {
                    panel[(k0 + t) * NR + cols..(k0 + t + 1) * NR].fill(0.0);
                }
            }
        }
        Ok(PackedWeight { n, k, panels: buf })
    }

    /// Number of output columns `N` (rows of the unpacked `W`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Contraction length `K` (columns of the unpacked `W`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Panel `p`, rows `k0..k0 + kc` of K: `kc * NR` floats.
    pub(crate) fn panel(&self, p: usize, k0: usize, kc: usize) -> &[f32] {
        let base = p * self.k * NR + k0 * NR;
        &self.panels.as_slice()[base..base + kc * NR]
    }
}

/// The A operand after validation: `m` rows of exactly `k` floats each.
#[derive(Clone, Copy)]
pub(crate) enum RowSource<'a> {
    Contiguous { data: &'a [f32], stride: usize },
    Gathered(&'a [&'a [f32]]),
}

impl<'a> RowSource<'a> {
    /// Row `i`, columns `k0..k0 + kc`. Validation guarantees these are in bounds.
    #[inline]
    pub(crate) fn row(&self, i: usize, k0: usize, kc: usize) -> &'a [f32] {
        match *self {
            RowSource::Contiguous { data, stride } => &data[i * stride + k0..i * stride + k0 + kc],
            RowSource::Gathered(rows) => &rows[i][k0..k0 + kc],
        }
    }
}

/// Pack rows `r0..r0 + mc`, columns `k0..k0 + kc` of `a` into `dst` as micro-panels of `mr` rows:
/// micro-panel `q` starts at `q * mr * kc`, element `(i, p)` of it at `p * mr + i`. Rows past
/// `mc` in the last micro-panel are left as they are (the micro-kernels never read them).
pub(crate) fn pack_a(
    a: &RowSource<'_>,
    r0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    dst: &mut [f32],
) {
    for q in 0..mc.div_ceil(mr) {
        let rows = mr.min(mc - q * mr);
        let panel = &mut dst[q * mr * kc..(q + 1) * mr * kc];
        if rows == mr && mr <= 16 {
            pack_panel_full(a, r0 + q * mr, k0, kc, mr, panel);
        } else {
            for i in 0..rows {
                let src = a.row(r0 + q * mr + i, k0, kc);
                for (p, &v) in src.iter().enumerate() {
                    panel[p * mr + i] = v;
                }
            }
        }
    }
}

/// A full micro-panel: read the `mr` rows in lock step, 8 columns at a time, so each store run
/// `panel[p*mr .. p*mr + mr]` is written whole (the scattered reads are 8 sequential streams).
fn pack_panel_full(
    a: &RowSource<'_>,
    r: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    panel: &mut [f32],
) {
    let mut srcs: [&[f32]; 16] = [&[]; 16];
    for (i, s) in srcs.iter_mut().enumerate().take(mr) {
        *s = a.row(r + i, k0, kc);
    }
    let srcs = &srcs[..mr];
    for (p, out) in panel.chunks_exact_mut(mr).enumerate().take(kc) {
        for (o, s) in out.iter_mut().zip(srcs) {
            *o = s[p];
        }
    }
}
