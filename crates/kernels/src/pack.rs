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
/// Bytes of panels [`PackedWeight::pack`] faults in and packs at a time: well inside L2, so the
/// pages the kernel zeroes are still in cache when the panels are written into them.
const PREFAULT_GROUP_BYTES: usize = 512 << 10;
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

/// Whether large packed buffers are advised as transparent huge pages: only with
/// `TUMBLE_HUGE_WEIGHTS=1`. Advising them made each first touch fault 2 MiB at a time instead of
/// 4 KiB (packing Berxit's 85M weights spent more time in 4 KiB page faults than in copying, on an
/// earlier machine); on the 2-vCPU VMs the suite runs on, a huge page is a block of guest memory
/// the host may have taken back (free page reporting hands back free blocks of that size), and
/// Berxit-small's 72 weights packed in 1.4–2.9 s with the advice against 0.25–0.31 s without,
/// the runs after it no faster either way (sixtieth session, `bench/RESULTS.md`).
fn huge_pages_advised() -> bool {
    tumble_limits::switch_on!("TUMBLE_HUGE_WEIGHTS")
}

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
            if let Some(raw) = recycled(len + align) {
                give_back(std::mem::replace(&mut self.raw, raw));
                self.off = aligned_offset(self.raw.as_ptr(), align);
                self.len = len;
                return;
            }
            // Zeroed allocations this large are fresh, untouched mappings: advised as huge
            // pages before the first write ([`huge_pages_advised`]), they fault 2 MiB at a time.
            give_back(std::mem::replace(&mut self.raw, vec![0.0; len + align]));
            self.off = aligned_offset(self.raw.as_ptr(), align);
            if huge && huge_pages_advised() {
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

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.raw));
    }
}

/// Buffers of dropped [`AlignedBuf`]s kept for the next ones on this thread: training packs
/// every weight afresh per mini-batch (the weights change) and the backward packs `dY` as a
/// weight per product, so without reuse each pack paid an allocation, zeroing it (`memset`,
/// or the kernel's page faults and clearing for large ones): 2.5% of a TreeLSTM training step.
/// At most [`RECYCLE_MAX_BUFS`] buffers and [`RECYCLE_MAX_BYTES`] per thread: live bytes the
/// memory budget's allocator counts, but neither reserved by a launch nor given back under
/// pressure (like the packing scratch), hence the bound; `TUMBLE_NO_PACK_RECYCLE=1` turns it off.
const RECYCLE_MAX_BUFS: usize = 32;
const RECYCLE_MAX_BYTES: usize = 64 << 20;

thread_local! {
    static RECYCLED: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn recycle_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_PACK_RECYCLE")
}

/// The smallest recycled buffer of at least `len` floats (its contents stale but initialized).
fn recycled(len: usize) -> Option<Vec<f32>> {
    if !recycle_enabled() {
        return None;
    }
    RECYCLED
        .try_with(|r| {
            let mut r = r.try_borrow_mut().ok()?;
            let best = r
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i)?;
            Some(r.swap_remove(best))
        })
        .ok()
        .flatten()
}

/// Keeps `raw` for a later [`recycled`] while the thread's pool has room (dropped otherwise).
fn give_back(raw: Vec<f32>) {
    if raw.is_empty() || !recycle_enabled() {
        return;
    }
    let bytes = |v: &Vec<f32>| v.len() * std::mem::size_of::<f32>();
    // (Outside a thread's lifetime, or while its pool is borrowed, the buffer is just freed.)
    let _ = RECYCLED.try_with(|r| {
        if let Ok(mut r) = r.try_borrow_mut() {
            let held: usize = r.iter().map(bytes).sum();
            if r.len() < RECYCLE_MAX_BUFS && held + bytes(&raw) <= RECYCLE_MAX_BYTES {
                r.push(raw);
            }
        }
    });
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
    /// `W` itself (N × K, row-major) when it has at most [`crate::narrow::MAX_N`] rows: narrow
    /// products read it as dot products instead of the panels.
    rows: Option<Vec<f32>>,
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
        // A few panels at a time, their pages faulted in by one call just before they are
        // written ([`tumble_limits::prefault`]; the panels are independent: the same bits as
        // packing them all at once). A new buffer of a large weight is fresh memory, and faulting
        // it page by page was half of packing Berxit's weights; populated whole up front, it was
        // zeroed from beyond the caches and then written again (slower than the faults).
        let group = (PREFAULT_GROUP_BYTES / (4 * k * NR).max(1)).max(1);
        for (g, dst) in dst.chunks_mut((group * k * NR).max(1)).enumerate() {
            let r0 = g * group * NR;
            let r1 = (r0 + group * NR).min(n);
            if r1 <= r0 {
                break;
            }
            tumble_limits::prefault(&mut *dst);
            pack_panels(&w[r0 * k..r1 * k], r1 - r0, k, dst);
        }
        let rows = (n <= crate::narrow::MAX_N).then(|| w.to_vec());
        Ok(PackedWeight {
            n,
            k,
            panels: buf,
            rows,
        })
    }
}

/// [`PackedWeight::pack`]'s panels of `w` (`n × k`, row-major) into `dst` (`ceil(n / 32)`
/// panels of `k × 32` floats, columns past `n` zero): tiles of 32 columns × 8 steps of K, 32
/// short sequential reads and 8 whole panel rows written while they are in L1. (Row by row,
/// every float of a row lands in a different cache line of a panel larger than L1: packing
/// Berxit's weights took half as long as using them.)
fn pack_panels_portable(w: &[f32], n: usize, k: usize, dst: &mut [f32]) {
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
}

/// [`PackedWeight::pack`]'s panels: by register transposes where [`simd_weight_pack`] allows,
/// else by the portable tiles (the same bits).
fn pack_panels(w: &[f32], n: usize, k: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match simd_weight_pack() {
        // SAFETY: `simd_weight_pack` checked AVX-512F; `w` is `n × k`, `dst` the panels'
        // `ceil(n / 32) * k * 32` floats.
        Some(WeightPack::Avx512) => unsafe { pack_panels_avx512(w, n, k, dst) },
        // SAFETY: `simd_weight_pack` checked AVX2; the same sizes.
        Some(WeightPack::Avx2) => unsafe { pack_panels_avx2(w, n, k, dst) },
        None => pack_panels_portable(w, n, k, dst),
    }
    #[cfg(not(target_arch = "x86_64"))]
    pack_panels_portable(w, n, k, dst);
}

/// [`pack_panels_portable`] by 8 × 8 register transposes, for CPUs with AVX2 but not AVX-512
/// (training packs its weights anew after every update: a third of the portable tiles'
/// instructions, bench/RESULTS.md, fifty-fifth session): each panel is four groups of 8 rows of
/// `w` ([`transpose_rows_avx2`], runs 32 floats apart). The same bits.
///
/// # Safety
/// AVX2 is available; `w` holds `n * k` floats and `dst` `ceil(n / 32) * k * 32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_panels_avx2(w: &[f32], n: usize, k: usize, dst: &mut [f32]) {
    if k == 0 {
        return;
    }
    let mut rows: Vec<&[f32]> = Vec::with_capacity(8);
    for (p, panel) in dst.chunks_exact_mut(k * NR).enumerate() {
        let cols = NR.min(n - p * NR);
        for g in 0..NR / 8 {
            rows.clear();
            let first = p * NR + 8 * g;
            rows.extend(
                (first..first + 8.min(cols.saturating_sub(8 * g))).map(|j| &w[j * k..(j + 1) * k]),
            );
            // SAFETY: AVX2 (the caller); each row holds `k` floats; group `g`'s runs of 8 at
            // `c * 32 + 8g` lie in the panel's `k * 32` floats (`(k - 1) * 32 + 8g + 8 <=
            // k * 32`); missing rows are written as zeros.
            unsafe { transpose_rows_avx2(&rows, k, NR, &mut panel[8 * g..]) };
        }
    }
}

/// [`pack_panels_portable`] by 16 × 16 register transposes: each panel is two halves of 16 rows
/// of `w` ([`transpose_rows_avx512`], runs 32 floats apart). The same bits. Against the portable
/// tiles: see `bench/RESULTS.md` (twenty-sixth session).
///
/// # Safety
/// AVX-512F is available; `w` holds `n * k` floats and `dst` `ceil(n / 32) * k * 32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panels_avx512(w: &[f32], n: usize, k: usize, dst: &mut [f32]) {
    if k == 0 {
        return;
    }
    let mut rows: Vec<&[f32]> = Vec::with_capacity(NR);
    for (p, panel) in dst.chunks_exact_mut(k * NR).enumerate() {
        let cols = NR.min(n - p * NR);
        rows.clear();
        rows.extend((0..cols).map(|j| &w[(p * NR + j) * k..(p * NR + j + 1) * k]));
        let (lo, hi) = rows.split_at(cols.min(16));
        // SAFETY: AVX-512F (the caller); each row holds `k` floats; the low half's runs of 16 at
        // `c * 32` lie in the panel's `k * 32` floats, the high half's in the panel from float 16
        // (`(k - 1) * 32 + 16 <= k * 32 - 16`); missing rows are written as zeros.
        unsafe {
            transpose_rows_avx512(lo, k, 16, NR, panel);
            transpose_rows_avx512(hi, k, 16, NR, &mut panel[16..]);
        }
    }
}

impl PackedWeight {
    /// Pack `W = Yᵀ` from the `k` rows of `Y` (`k × n`, each row `n` floats, wherever they lie):
    /// the product `A · Wᵀ` is then `A · Y`. Each panel row is a contiguous run of a `Y` row, so
    /// this costs one copy of `Y` and no transpose (MV-RNN's `W_M · [A; B]` packs `[A; B]` this
    /// way, straight from the two matrices). Reuses this weight's allocation when it is big
    /// enough, so one `PackedWeight` serves a launch's invocations in turn.
    pub fn repack_rows_kn(&mut self, rows: &[&[f32]], n: usize) -> Result<(), KernelError> {
        let k = rows.len();
        for r in rows {
            if r.len() != n {
                return Err(KernelError::Length {
                    what: "a row of Y (K×N)".into(),
                    expected: n,
                    actual: r.len(),
                });
            }
        }
        let panels = n.div_ceil(NR);
        let total = panels
            .checked_mul(k)
            .and_then(|x| x.checked_mul(NR))
            .ok_or(KernelError::Overflow)?;
        self.panels.ensure(total);
        let dst = self.panels.as_mut_slice();
        for (p, panel) in dst.chunks_exact_mut((k * NR).max(1)).enumerate() {
            let c0 = p * NR;
            let cols = NR.min(n - c0);
            if cols == NR {
                // A whole panel: fixed-size copies the compiler inlines as vector moves, where a
                // `copy_from_slice` of run-time length calls `memcpy` per 128 bytes (MV-RNN's
                // products repack a 256 × 128 weight per invocation: 7% of its time in calls).
                for (out, r) in panel.chunks_exact_mut(NR).zip(rows) {
                    if let (Ok(out), Ok(src)) = (
                        <&mut [f32; NR]>::try_from(out),
                        <&[f32; NR]>::try_from(&r[c0..c0 + NR]),
                    ) {
                        *out = *src;
                    }
                }
                continue;
            }
            for (kk, r) in rows.iter().enumerate() {
                let out = &mut panel[kk * NR..(kk + 1) * NR];
                out[..cols].copy_from_slice(&r[c0..c0 + cols]);
                out[cols..].fill(0.0);
            }
        }
        self.n = n;
        self.k = k;
        // W = Yᵀ: row j of W is column j of Y.
        self.rows = (n <= crate::narrow::MAX_N).then(|| {
            let mut w = vec![0f32; n * k];
            for (kk, r) in rows.iter().enumerate() {
                for (j, v) in r.iter().enumerate() {
                    w[j * k + kk] = *v;
                }
            }
            w
        });
        Ok(())
    }

    /// A new weight packed by [`PackedWeight::repack_rows_kn`].
    pub fn from_rows_kn(rows: &[&[f32]], n: usize) -> Result<PackedWeight, KernelError> {
        let mut w = PackedWeight {
            n: 0,
            k: 0,
            panels: AlignedBuf::default(),
            rows: None,
        };
        w.repack_rows_kn(rows, n)?;
        Ok(w)
    }

    /// Number of output columns `N` (rows of the unpacked `W`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Contraction length `K` (columns of the unpacked `W`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// `W` (N × K, row-major) when it is narrow enough to be kept (see [`crate::narrow`]).
    pub(crate) fn rows(&self) -> Option<&[f32]> {
        self.rows.as_deref()
    }

    /// Panel `p`, rows `k0..k0 + kc` of K: `kc * NR` floats.
    pub(crate) fn panel(&self, p: usize, k0: usize, kc: usize) -> &[f32] {
        self.panel_run(p, 1, k0, kc)
    }

    /// Panels `p..p + count`, rows `k0..k0 + kc` of K of each: from panel `p`'s first such row to
    /// panel `p + count - 1`'s last, panel `p + j`'s rows starting `j * k * NR` floats in (the
    /// stride [`PackedWeight::panel_stride`]). `count >= 1`, `p + count` at most the panels.
    pub(crate) fn panel_run(&self, p: usize, count: usize, k0: usize, kc: usize) -> &[f32] {
        let base = p * self.k * NR + k0 * NR;
        let end = (p + count - 1) * self.k * NR + (k0 + kc) * NR;
        &self.panels.as_slice()[base..end]
    }

    /// Floats from one panel's row of K to the next panel's same row.
    pub(crate) fn panel_stride(&self) -> usize {
        self.k * NR
    }
}

/// A left operand `A` (M × K) packed once for every product that reads it
/// ([`crate::Rows::Packed`]): the micro-panels the driver would otherwise pack at every call, for
/// every K block and all M rows, and A's rows as they are (for the paths that read rows where
/// they lie). A shared left operand of many products — MV-RNN's `W_M` in `W_M · [A; B]`, one
/// product per tree node — is packed once per job instead of once per product, and the products
/// run on the packed tiles. The panels are those of the kernel family selected when packing
/// (`KernelKind::selected`); a product whose blocking differs packs from the rows as usual.
pub struct PackedRows {
    m: usize,
    k: usize,
    rows: Vec<f32>,
    mr: usize,
    panels: AlignedBuf,
    /// Per K block: its `(k0, kc)` and where its micro-panels start in `panels`.
    blocks: Vec<(usize, usize, usize)>,
}

impl std::fmt::Debug for PackedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedRows({} × {}, micro-panels of {})",
            self.m, self.k, self.mr
        )
    }
}

impl PackedRows {
    /// Packs `data`, `m` rows of `k` floats (row-major), as the selected kernel's driver packs
    /// the A of a product of `m` rows: the same micro-panels, so the same bits.
    pub fn pack(data: &[f32], m: usize, k: usize) -> Result<PackedRows, KernelError> {
        let len = m.checked_mul(k).ok_or(KernelError::Overflow)?;
        if data.len() != len {
            return Err(KernelError::Length {
                what: "A (M × K)".into(),
                expected: len,
                actual: data.len(),
            });
        }
        let kernel = crate::KernelKind::selected().kernel()?;
        let mr = kernel.mr;
        let kc_max = crate::driver::kc_max(&kernel, m);
        let mpad = m.div_ceil(mr) * mr;
        let mut panels = AlignedBuf::default();
        panels.ensure(mpad.checked_mul(k).ok_or(KernelError::Overflow)?);
        let mut blocks = Vec::new();
        if m > 0 && k > 0 {
            let src = RowSource::Contiguous { data, stride: k };
            let transposer = kernel
                .pack_panel
                .filter(|_| crate::driver::simd_pack_enabled());
            let mut off = 0;
            for (k0, kc) in crate::driver::k_blocks(k, kc_max) {
                let dst = &mut panels.as_mut_slice()[off..off + mpad * kc];
                pack_a(&src, 0, m, k0, kc, mr, transposer, dst);
                blocks.push((k0, kc, off));
                off += mpad * kc;
            }
        }
        Ok(PackedRows {
            m,
            k,
            rows: data.to_vec(),
            mr,
            panels,
            blocks,
        })
    }

    /// Rows (M).
    pub fn m(&self) -> usize {
        self.m
    }

    /// Columns (K).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The packed micro-panels of rows `r0..r0 + mc`, columns `k0..k0 + kc`, as [`pack_a`] would
    /// lay them out with micro-panels of `mr` rows; `None` when they were not packed that way.
    pub(crate) fn panels(
        &self,
        r0: usize,
        mc: usize,
        k0: usize,
        kc: usize,
        mr: usize,
    ) -> Option<&[f32]> {
        if mr != self.mr || !r0.is_multiple_of(mr) || r0 + mc > self.m {
            return None;
        }
        let &(_, _, off) = self.blocks.iter().find(|b| b.0 == k0 && b.1 == kc)?;
        // Micro-panel `r0 / mr` of the block starts `r0 * kc` floats in.
        let start = off + r0 * kc;
        self.panels
            .as_slice()
            .get(start..start + mc.div_ceil(mr) * mr * kc)
    }
}

/// The A operand after validation: `m` rows of exactly `k` floats each.
#[derive(Clone, Copy)]
pub(crate) enum RowSource<'a> {
    Contiguous {
        data: &'a [f32],
        stride: usize,
    },
    Gathered(&'a [&'a [f32]]),
    /// `k` columns of exactly `m` floats ([`crate::Rows::Columns`]).
    Columns(&'a [&'a [f32]]),
    /// Packed once ([`crate::Rows::Packed`]): its micro-panels where the blocking matches, else
    /// its rows.
    Packed(&'a PackedRows),
}

impl<'a> RowSource<'a> {
    /// Row `i`, columns `k0..k0 + kc`. Validation guarantees these are in bounds. A column
    /// source has no contiguous rows: [`pack_a`] packs it by columns and the narrow-product path
    /// does not take it, so nothing asks (an empty row would fail any indexing loudly).
    #[inline]
    pub(crate) fn row(&self, i: usize, k0: usize, kc: usize) -> &'a [f32] {
        match *self {
            RowSource::Contiguous { data, stride } => &data[i * stride + k0..i * stride + k0 + kc],
            RowSource::Gathered(rows) => &rows[i][k0..k0 + kc],
            RowSource::Columns(_) => &[],
            RowSource::Packed(p) => &p.rows[i * p.k + k0..i * p.k + k0 + kc],
        }
    }
}

/// Which registers [`PackedWeight::pack`] transposes with: AVX-512's, else AVX2's, when the A
/// packers' transposes are on (`TUMBLE_NO_SIMD_PACK`) and `TUMBLE_NO_SIMD_WEIGHT_PACK` is not
/// set; `None`: the portable tiles. The same bits either way.
#[cfg(target_arch = "x86_64")]
fn simd_weight_pack() -> Option<WeightPack> {
    static ON: std::sync::OnceLock<Option<WeightPack>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        if !crate::driver::simd_pack_enabled()
            || tumble_limits::env_flag("TUMBLE_NO_SIMD_WEIGHT_PACK")
        {
            None
        } else if crate::KernelKind::Avx512.is_available() {
            Some(WeightPack::Avx512)
        } else if std::arch::is_x86_feature_detected!("avx2") {
            Some(WeightPack::Avx2)
        } else {
            None
        }
    })
}

/// The register transposes [`PackedWeight::pack`] packs weight panels with.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WeightPack {
    Avx512,
    Avx2,
}

/// A micro-panel packer by register transposes (`pack_panel_avx512`, `pack_panel_avx2`): the
/// `srcs.len() <= mr` rows (`kc` floats each) into `panel` (`mr * kc` floats) as `pack_a` lays
/// them out, rows past `srcs.len()` zeroed; the same bits as the portable packer. A
/// [`crate::kernel::Kernel`] carries the one of its own instruction set.
///
/// # Safety (contract every caller upholds)
/// The CPU supports the packer's instruction set (guaranteed for a kernel's own packer: a kernel
/// is only built for an available kind); `mr` is at most the packer's rows (16 / 8: the kernel's
/// `mr` is); every `srcs[i]` holds at least `kc` floats; `panel` holds `mr * kc`.
pub(crate) type PanelPackFn = unsafe fn(srcs: &[&[f32]], kc: usize, mr: usize, panel: &mut [f32]);

/// Pack rows `r0..r0 + mc`, columns `k0..k0 + kc` of `a` into `dst` as micro-panels of `mr` rows:
/// micro-panel `q` starts at `q * mr * kc`, element `(i, p)` of it at `p * mr + i`. Rows past
/// `mc` in the last micro-panel are left as they are or zeroed (the micro-kernels never read
/// them). `transposer`: the kernel's register-transposing packer, when it has one and it is on
/// (same bits).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_a(
    a: &RowSource<'_>,
    r0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    transposer: Option<PanelPackFn>,
    dst: &mut [f32],
) {
    if let RowSource::Columns(cols) = a {
        // Step p of K of a micro-panel is rows r..r + rows of column k0 + p: one copy each.
        for q in 0..mc.div_ceil(mr) {
            let (r, rows) = (r0 + q * mr, mr.min(mc - q * mr));
            let panel = &mut dst[q * mr * kc..(q + 1) * mr * kc];
            let cols = &cols[k0..k0 + kc];
            // A whole micro-panel of the kernels' row counts: fixed-size copies the compiler
            // inlines as vector moves, where a copy of run-time length calls `memcpy` per K step
            // (the backward's `dW = dYᵀ·X` packs every step of its contraction this way).
            use crate::kernel::portable;
            #[cfg(target_arch = "x86_64")]
            use crate::kernel::{avx2, avx512};
            match (mr, rows) {
                #[cfg(target_arch = "x86_64")]
                (avx512::MR, avx512::MR) => copy_runs::<{ avx512::MR }>(panel, cols, r),
                #[cfg(target_arch = "x86_64")]
                (avx2::MR, avx2::MR) => copy_runs::<{ avx2::MR }>(panel, cols, r),
                (portable::MR, portable::MR) => copy_runs::<{ portable::MR }>(panel, cols, r),
                _ => {
                    for (out, col) in panel.chunks_exact_mut(mr).zip(cols) {
                        out[..rows].copy_from_slice(&col[r..r + rows]);
                    }
                }
            }
        }
        return;
    }
    for q in 0..mc.div_ceil(mr) {
        let rows = mr.min(mc - q * mr);
        let panel = &mut dst[q * mr * kc..(q + 1) * mr * kc];
        if let Some(transpose) = transposer.filter(|_| mr <= 16) {
            let mut srcs: [&[f32]; 16] = [&[]; 16];
            for (i, s) in srcs.iter_mut().enumerate().take(rows) {
                *s = a.row(r0 + q * mr + i, k0, kc);
            }
            // SAFETY: PanelPackFn contract — the caller passes its kernel's own packer (an
            // available instruction set, `mr` within the packer's rows); `srcs[..rows]` are `kc`
            // floats each (`RowSource::row`), `rows <= mr`; `panel` is `mr * kc` floats.
            unsafe { transpose(&srcs[..rows], kc, mr, panel) };
            continue;
        }
        pack_panel_portable(a, r0 + q * mr, rows, k0, kc, mr, panel);
    }
}

/// [`pack_a`] from columns, a micro-panel of `R` rows (its `lda`): step `p`'s `R` floats are
/// `cols[p][r..r + R]`.
fn copy_runs<const R: usize>(panel: &mut [f32], cols: &[&[f32]], r: usize) {
    for (out, col) in panel.chunks_exact_mut(R).zip(cols) {
        if let (Ok(out), Some(Ok(src))) = (
            <&mut [f32; R]>::try_from(out),
            col.get(r..r + R).map(<&[f32; R]>::try_from),
        ) {
            *out = *src;
        }
    }
}

/// [`pack_a`]'s portable path for one micro-panel of `rows` rows starting at row `r`.
fn pack_panel_portable(
    a: &RowSource<'_>,
    r: usize,
    rows: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    panel: &mut [f32],
) {
    if rows == mr && mr <= 16 {
        pack_panel_full(a, r, k0, kc, mr, panel);
    } else {
        for i in 0..rows {
            let src = a.row(r + i, k0, kc);
            for (p, &v) in src.iter().enumerate() {
                panel[p * mr + i] = v;
            }
        }
    }
}

/// A micro-panel of `srcs.len() <= mr <= 16` rows (`kc` floats each) by 16×16 register
/// transposes: 16 columns of every row are loaded (missing rows as zeros), transposed, and written
/// as 16 runs of `mr` floats. Rows past `srcs.len()` get zeros (the micro-kernels never read them).
/// Measured with `gemm_bench --threads 1` at 2048×256×256: the scalar packing was 25% of the
/// samples (`perf record`).
///
/// # Safety
/// AVX-512F is available; every `srcs[i]` holds at least `kc` floats; `panel` holds `mr * kc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_panel_avx512(srcs: &[&[f32]], kc: usize, mr: usize, panel: &mut [f32]) {
    debug_assert!(srcs.len() <= mr && mr <= 16 && panel.len() >= mr * kc);
    debug_assert!(srcs.iter().all(|s| s.len() >= kc));
    // SAFETY: AVX-512F and the rows' lengths (the contract above); run `c`'s `mr` floats at
    // `c * mr` lie in `panel`'s `mr * kc`.
    unsafe { transpose_rows_avx512(srcs, kc, mr, mr, panel) }
}

/// [`pack_panel_avx512`]'s transposes with the runs `stride` floats apart: column `c` of the
/// `srcs.len() <= mr <= 16` rows goes to `dst[c * stride ..][..mr]` (rows past `srcs.len()` as
/// zeros). A weight panel is two such halves of 16 rows, 32 floats apart.
///
/// # Safety
/// AVX-512F is available; every `srcs[i]` holds at least `kc` floats; `dst` holds
/// `(kc - 1) * stride + mr` floats when `kc > 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_rows_avx512(
    srcs: &[&[f32]],
    kc: usize,
    mr: usize,
    stride: usize,
    dst: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(srcs.len() <= mr && mr <= 16 && mr <= stride);
    debug_assert!(kc == 0 || dst.len() >= (kc - 1) * stride + mr);
    let mask: __mmask16 = ((1u32 << mr) - 1) as __mmask16;
    let at = dst.as_mut_ptr();
    let mut p = 0;
    while p + 16 <= kc {
        let mut r = [_mm512_setzero_ps(); 16];
        for (ri, s) in r.iter_mut().zip(srcs) {
            // SAFETY: `p + 16 <= kc <= s.len()`.
            *ri = unsafe { _mm512_loadu_ps(s.as_ptr().add(p)) };
        }
        // Pairs of rows interleaved per 128-bit lane, then pairs of pairs: u[4g + m] holds, in
        // lane L, column 4L + m of rows 4g..4g + 4.
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
            let t0 = _mm512_castps_pd(_mm512_unpacklo_ps(a, b));
            let t1 = _mm512_castps_pd(_mm512_unpackhi_ps(a, b));
            let t2 = _mm512_castps_pd(_mm512_unpacklo_ps(c, d));
            let t3 = _mm512_castps_pd(_mm512_unpackhi_ps(c, d));
            u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
            u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
            u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
            u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
        }
        // Column 4L + m = lane L of u[m], u[4 + m], u[8 + m], u[12 + m].
        for m in 0..4 {
            let lo01 = _mm512_shuffle_f32x4::<0x44>(u[m], u[4 + m]);
            let lo23 = _mm512_shuffle_f32x4::<0x44>(u[8 + m], u[12 + m]);
            let hi01 = _mm512_shuffle_f32x4::<0xEE>(u[m], u[4 + m]);
            let hi23 = _mm512_shuffle_f32x4::<0xEE>(u[8 + m], u[12 + m]);
            let cols = [
                _mm512_shuffle_f32x4::<0x88>(lo01, lo23),
                _mm512_shuffle_f32x4::<0xDD>(lo01, lo23),
                _mm512_shuffle_f32x4::<0x88>(hi01, hi23),
                _mm512_shuffle_f32x4::<0xDD>(hi01, hi23),
            ];
            for (l, v) in cols.into_iter().enumerate() {
                let c = p + 4 * l + m;
                // SAFETY: `c < kc`, so the `mr` floats at `c * stride` lie in `dst` (the
                // contract); the mask limits the store to `mr` lanes.
                unsafe { _mm512_mask_storeu_ps(at.add(c * stride), mask, v) };
            }
        }
        p += 16;
    }
    // The last `kc % 16` columns one by one.
    pack_columns(srcs, p..kc, mr, stride, dst);
}

/// Columns of 8 rows of 8 floats: `cols[c]` lane `i` is `r[i]` lane `c` (the AVX2 packers'
/// transpose). Pairs of rows interleaved, then pairs of pairs: `u[m]` holds column m (low half)
/// and column 4 + m (high half) of rows 0..4, `u[4 + m]` the same of rows 4..8; the lane
/// permutes put the halves together.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn transpose8x8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ]
}

/// Columns `p..p + 8` of the `srcs.len() <= 8` rows, each as a vector of its 8 rows (rows past
/// `srcs.len()` as zeros).
///
/// # Safety
/// AVX2 is available; every row holds at least `p + 8` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn columns8(srcs: &[&[f32]], p: usize) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let mut r = [_mm256_setzero_ps(); 8];
    for (ri, s) in r.iter_mut().zip(srcs) {
        // SAFETY: `p + 8 <= s.len()` (the contract).
        *ri = unsafe { _mm256_loadu_ps(s.as_ptr().add(p)) };
    }
    transpose8x8(r)
}

/// A micro-panel of `srcs.len() <= mr <= 8` rows (`kc` floats each) by 8×8 register transposes
/// (the AVX2 kernel's 6-row panels): 8 columns of every row are loaded (missing rows as zeros),
/// transposed, and written as 8 runs of `mr` floats. Each run is stored as 8 floats, whose last
/// `8 - mr` the next run overwrites, so only a store past the panel's end is masked.
///
/// # Safety
/// AVX2 is available; every `srcs[i]` holds at least `kc` floats; `panel` holds `mr * kc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pack_panel_avx2(srcs: &[&[f32]], kc: usize, mr: usize, panel: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(srcs.len() <= mr && mr <= 8 && panel.len() >= mr * kc);
    debug_assert!(srcs.iter().all(|s| s.len() >= kc));
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(mr as i32), lanes);
    let dst = panel.as_mut_ptr();
    let len = mr * kc;
    let mut p = 0;
    while p + 8 <= kc {
        // SAFETY: `p + 8 <= kc <= s.len()` for every row (the contract).
        let cols = unsafe { columns8(srcs, p) };
        // In ascending column order: each store's spill past its `mr` floats is overwritten by
        // the next column's store.
        for (l, v) in cols.into_iter().enumerate() {
            let at = (p + l) * mr;
            // SAFETY: `p + l < kc`, so `at + mr <= len`: the `mr` floats the column owns lie
            // inside `panel`; the unmasked store writes `8 - mr` more only where `at + 8 <= len`.
            unsafe {
                if at + 8 <= len {
                    _mm256_storeu_ps(dst.add(at), v);
                } else {
                    _mm256_maskstore_ps(dst.add(at), mask, v);
                }
            }
        }
        p += 8;
    }
    // The last `kc % 8` columns one by one.
    pack_columns(srcs, p..kc, mr, mr, panel);
}

/// [`pack_panels_avx2`]'s transposes: column `c` of the `srcs.len() <= 8` rows goes to
/// `dst[c * stride..][..8]` (rows past `srcs.len()` as zeros), 8 columns a time by the same
/// unpack / shuffle / lane-permute network as [`pack_panel_avx2`].
///
/// # Safety
/// AVX2 is available; every `srcs[i]` holds at least `kc` floats; `stride >= 8`; `dst` holds
/// `(kc - 1) * stride + 8` floats when `kc > 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_rows_avx2(srcs: &[&[f32]], kc: usize, stride: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(srcs.len() <= 8 && stride >= 8);
    debug_assert!(kc == 0 || dst.len() >= (kc - 1) * stride + 8);
    debug_assert!(srcs.iter().all(|s| s.len() >= kc));
    let at = dst.as_mut_ptr();
    let mut p = 0;
    while p + 8 <= kc {
        // SAFETY: `p + 8 <= kc <= s.len()` for every row (the contract).
        let cols = unsafe { columns8(srcs, p) };
        for (l, v) in cols.into_iter().enumerate() {
            // SAFETY: `p + l < kc`, so the 8 floats at `(p + l) * stride` lie in `dst` (the
            // contract).
            unsafe { _mm256_storeu_ps(at.add((p + l) * stride), v) };
        }
        p += 8;
    }
    // The last `kc % 8` columns one by one.
    pack_columns(srcs, p..kc, 8, stride, dst);
}

/// Columns `cols` of `srcs` into `panel` one by one, as runs of `mr` floats `stride` apart (rows
/// past `srcs.len()` zeroed): the transposing packers' last columns.
#[cfg(target_arch = "x86_64")]
fn pack_columns(
    srcs: &[&[f32]],
    cols: std::ops::Range<usize>,
    mr: usize,
    stride: usize,
    panel: &mut [f32],
) {
    for c in cols {
        let out = &mut panel[c * stride..c * stride + mr];
        for (i, o) in out.iter_mut().enumerate() {
            *o = srcs.get(i).map_or(0.0, |s| s[c]);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `pack`'s weight panels against the portable tiles', bit for bit, at every width `n` and
    /// depth `k` given.
    fn panels_match_the_portable_ones(
        pack: impl Fn(&[f32], usize, usize, &mut [f32]),
        ns: &[usize],
        ks: &[usize],
    ) {
        for &n in ns {
            for &k in ks {
                let w: Vec<f32> = (0..n * k).map(|i| (i as f32) * 0.25 - 3.0).collect();
                let len = n.div_ceil(NR) * k * NR;
                let mut want = vec![f32::NAN; len];
                pack_panels_portable(&w, n, k, &mut want);
                let mut got = vec![f32::NAN; len];
                pack(&w, n, k, &mut got);
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} k={k}"
                );
            }
        }
    }

    /// `PackedWeight::pack` packs a few panels at a time (a group of about
    /// `PREFAULT_GROUP_BYTES`): the panels of one pass, bit for bit, for weights of one group,
    /// of several with a partial last panel, and of a K so deep that a group is one panel.
    #[test]
    fn packing_by_groups_of_panels_is_packing_at_once() {
        for (n, k) in [
            (5usize, 3usize),
            (77, 300),
            (300, 1024),
            (97, 4500),
            (1000, 129),
        ] {
            let w: Vec<f32> = (0..n * k).map(|i| (i % 997) as f32 * 0.5 - 7.0).collect();
            let len = n.div_ceil(NR) * k * NR;
            let mut want = vec![f32::NAN; len];
            pack_panels(&w, n, k, &mut want);
            let got = PackedWeight::pack(&w, n, k).unwrap();
            let got = &got.panels.as_slice()[..len];
            assert!(
                want.iter()
                    .zip(got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n={n} k={k}"
            );
        }
    }

    /// Weight panels by AVX-512 register transposes are the portable tiles' bits: widths and
    /// depths around the transposes' 16 (partial panels of fewer and more than 16 columns, K
    /// tails).
    #[test]
    fn simd_weight_panels_match_the_portable_panels() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            panels_match_the_portable_ones(
                // SAFETY: AVX-512F was detected; the helper passes `w` of `n × k` floats and
                // panels of `ceil(n / 32) * k * 32`.
                |w, n, k, dst| unsafe { pack_panels_avx512(w, n, k, dst) },
                &[1, 5, 16, 17, 31, 32, 33, 77, 130],
                &[1, 7, 15, 16, 17, 40, 300],
            );
        }
    }

    /// The AVX2 weight panels are the portable tiles' bits: partial panels (groups of 8 rows
    /// whole, partial and missing), K tails around the transposes' 8.
    #[test]
    fn avx2_weight_panels_match_the_portable_panels() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            panels_match_the_portable_ones(
                // SAFETY: AVX2 was detected; the sizes as above.
                |w, n, k, dst| unsafe { pack_panels_avx2(w, n, k, dst) },
                &[1, 5, 8, 9, 16, 23, 31, 32, 33, 41, 77, 130],
                &[1, 7, 8, 9, 15, 16, 17, 40, 300],
            );
        }
    }

    /// The transposing path packs what the portable one does, at odd row counts, K offsets and
    /// widths (not multiples of 16), from contiguous and gathered rows.
    #[test]
    fn simd_packing_matches_the_portable_packing() {
        let (n_rows, width) = (40usize, 300usize);
        let data: Vec<f32> = (0..n_rows * width).map(|i| i as f32 * 0.5 - 7.0).collect();
        let rows: Vec<&[f32]> = (0..n_rows)
            .map(|i| &data[(n_rows - 1 - i) * width..(n_rows - i) * width])
            .collect();
        let sources = [
            RowSource::Contiguous {
                data: &data,
                stride: width,
            },
            RowSource::Gathered(&rows),
        ];
        // Each available kernel's own packer, at its `mr` and at the most rows the packer takes.
        let packers: Vec<(PanelPackFn, usize)> = [
            (crate::KernelKind::Avx2Fma, [6usize, 8]),
            (crate::KernelKind::Avx512, [14, 16]),
        ]
        .into_iter()
        .filter_map(|(kind, mrs)| Some((kind.kernel().ok()?.pack_panel?, mrs)))
        .flat_map(|(packer, mrs)| mrs.map(|mr| (packer, mr)))
        .collect();
        for a in &sources {
            for &(packer, mr) in &packers {
                for (k0, kc) in [
                    (0usize, 1usize),
                    (3, 7),
                    (0, 16),
                    (5, 17),
                    (1, 33),
                    (0, 256),
                    (7, 257),
                ] {
                    for (r0, mc) in [(0usize, 1usize), (2, 5), (0, mr), (1, mr + 1), (3, 29)] {
                        let mut got = vec![f32::NAN; mc.div_ceil(mr) * mr * kc];
                        pack_a(a, r0, mc, k0, kc, mr, Some(packer), &mut got);
                        let mut want = vec![f32::NAN; got.len()];
                        for q in 0..mc.div_ceil(mr) {
                            let rows = mr.min(mc - q * mr);
                            let panel = &mut want[q * mr * kc..(q + 1) * mr * kc];
                            pack_panel_portable(a, r0 + q * mr, rows, k0, kc, mr, panel);
                        }
                        for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                            let (q, i) = (idx / (mr * kc), idx % mr);
                            if q * mr + i < mc {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "mr {mr} k0 {k0} kc {kc} r0 {r0} mc {mc} at {idx}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A pack into a recycled buffer (stale contents of a dropped, larger weight) writes every
    /// float of its panels: the layout, and the zeros past N in the last panel, whatever was
    /// there before. At odd sizes, after weights of other shapes were dropped on this thread.
    #[test]
    fn packing_into_recycled_buffers_leaves_nothing_stale() {
        for (round, &(n, k)) in [(70usize, 37usize), (33, 5), (1, 1), (96, 64), (5, 300)]
            .iter()
            .enumerate()
        {
            // A larger weight full of NaNs, dropped: its buffer is what the next pack reuses.
            drop(PackedWeight::pack(&vec![f32::NAN; 130 * 301], 130, 301));
            let w: Vec<f32> = (0..n * k)
                .map(|i| (i as f32 * 0.61 + round as f32).cos())
                .collect();
            let got = PackedWeight::pack(&w, n, k).unwrap_or_else(|e| panic!("{e}"));
            let panels = got.panels.as_slice();
            assert_eq!(panels.len(), n.div_ceil(NR) * k * NR);
            for (idx, v) in panels.iter().enumerate() {
                let (p, kk, j) = (idx / (k * NR), (idx % (k * NR)) / NR, idx % NR);
                let col = p * NR + j;
                let want = if col < n { w[col * k + kk] } else { 0.0 };
                assert_eq!(v.to_bits(), want.to_bits(), "n {n} k {k} at {idx}");
            }
        }
    }

    /// Packing `Y` (`k × n`, by rows) as `W = Yᵀ` gives exactly the panels of packing `Yᵀ` the
    /// usual way, at odd sizes (partial last panel, K = 1), and a repack into a larger weight's
    /// buffer leaves nothing of the old contents.
    #[test]
    fn packing_rows_of_y_equals_packing_y_transposed() {
        let mut reused =
            PackedWeight::from_rows_kn(&[&[1.0; 70][..]; 9], 70).unwrap_or_else(|e| panic!("{e}"));
        for (k, n) in [(1usize, 1usize), (7, 33), (37, 64), (256, 128), (5, 70)] {
            let y: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.37).sin()).collect();
            let rows: Vec<&[f32]> = y.chunks_exact(n).collect();
            let mut yt = vec![0.0; n * k];
            for r in 0..k {
                for c in 0..n {
                    yt[c * k + r] = y[r * n + c];
                }
            }
            let want = PackedWeight::pack(&yt, n, k).unwrap_or_else(|e| panic!("{e}"));
            let got = PackedWeight::from_rows_kn(&rows, n).unwrap_or_else(|e| panic!("{e}"));
            reused
                .repack_rows_kn(&rows, n)
                .unwrap_or_else(|e| panic!("{e}"));
            for w in [&got, &reused] {
                assert_eq!((w.n(), w.k()), (n, k));
                let (a, b) = (w.panels.as_slice(), want.panels.as_slice());
                assert_eq!(a.len(), b.len(), "k {k} n {n}");
                assert!(
                    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "k {k} n {n}"
                );
            }
        }
        let short: [&[f32]; 2] = [&[1.0, 2.0], &[3.0]];
        assert!(PackedWeight::from_rows_kn(&short, 2).is_err());
    }
}
