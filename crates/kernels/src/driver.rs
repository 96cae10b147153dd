//! The blocked GEMM driver: cache blocking, the small-M variant, and the thread split.
//!
//! Loop nest for one group of output rows (GotoBLAS/BLIS order, weight pre-packed):
//!
//! ```text
//! for each part (A_i, W_i) of the (possibly concatenated) contraction:
//!   for each K block [k0, k0 + kc):
//!     pack A rows [ic, ic + group) × [k0, k0 + kc) into MR-row micro-panels ← the fused gather
//!     for each chunk of weight panels (nc columns × kc, stays in L2):        ← L2 blocking only
//!       for each block of mc rows of the group:
//!         for each 32-wide weight panel jp of the chunk (kc × 32 floats, stays in L1):
//!           for each micro-panel q of the block (MR × kc, streamed from L2):
//!             micro-kernel: C[q-tile, jp] (+)= Ã_q · B̃_jp
//! epilogue(each block of mc rows of the group, its C block)                 ← the fused tail
//! ```
//!
//! Normally a group is one `mc` block and the only chunk is the whole weight: each row block
//! streams the weight once and its epilogue runs on the `mc × N` block while it is still in L2.
//! When the weight is much larger than L2 ([`L2_BLOCK_MIN_WEIGHT_BYTES`]) and a task has several
//! row blocks, a group holds up to [`L2_GROUP_MC`] blocks and the weight is walked in chunks of
//! [`L2_CHUNK_BYTES`], so each chunk is loaded into L2 once per group instead of once per block;
//! the group's epilogues then run after its last chunk of its last K block (each row still once,
//! after all of its columns and all of K are final).
//!
//! The first K block of the first part overwrites C (so C is never zeroed or read first), later
//! blocks accumulate: their tiles start each element's multiply-add chain from C, so an element
//! is one chain over all of K whatever the blocking — and the small-M path, which does not block
//! K, computes the same bits as the blocked one (a row's result does not depend on its launch).
//!
//! Tiles of a few rows (a launch of 1–3 rows, the last rows of a launch) take several weight
//! panels per call on a kernel with a multi-panel tile (AVX-512: [`Tuning::multi_panel_tiles`]):
//! the panels of the walk are taken in groups from its first, the group's first panel making one
//! call over the group and the others nothing; each element's multiply-adds are unchanged.

use crate::kernel::{DirectTile, Kernel, MultiA, MultiOut, MultiTile, WideTile, DIRECT_MAX_ROWS};
use crate::pack::{pack_a, AlignedBuf, PackedWeight, RowSource, NR};
use crate::EpilogueInto;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

/// One operand pair of `C = Σ_i A_i · W_iᵀ`, validated: `a` has the launch's `m` rows of
/// `w.k()` floats.
pub(crate) struct Part<'a> {
    pub(crate) a: RowSource<'a>,
    pub(crate) w: &'a PackedWeight,
}

// Thresholds, measured on the development machine (Intel Xeon, Sapphire Rapids class, 2 cores,
// AVX-512; see the numbers in the comments of `plan`).

/// Below this many flops (2·M·N·K) a launch stays on one thread (unless its weight is big, below):
/// waking a rayon worker and joining costs ~5–10 µs, and on this 2-core machine the second core is
/// often busy. Measured (threads 1 vs 2, AVX-512, min of runs): B=8 256×768 (3.1 MFLOP) 24.6 µs
/// vs 41.8 µs; B=16 256×768 (6.3 MFLOP) 53.6 vs 73.9 µs; B=64 256×768 (25 MFLOP) 211 vs 126 µs.
const MIN_PARALLEL_FLOPS: usize = 8 << 20;

/// ... but a launch whose weight does not fit one core's L2 (2 MiB) is memory-bound, and splitting
/// the weight's columns lets each core stream (and keep in its own L2) half of it: B=1 512×1536
/// (1.5 MFLOP, 3 MiB weight) 115 µs on one thread vs 28 µs on two; B=1 768×3072: 387 vs 191 µs.
const MIN_PARALLEL_WEIGHT_BYTES: usize = 1 << 20;

/// L2 blocking of the weight's columns (a BLIS `nc` loop) is used when the launch's weight is at
/// least this big. Without it every `mc` block of rows streams the whole weight again; that costs
/// little while the weight streams from L3, but this machine's L3 is shared with other tenants and
/// once the weight is ≳ 7 MiB it comes from memory. Measured (1 thread, GFLOP/s, best of 5–8
/// interleaved runs, contiguous A, before vs blocked; ±20% noise): 512×768×3072 (9 MiB) 59–85 vs
/// 84–97; 2048×768×3072 60–66 vs 74–88; 512×1024×3072 (12 MiB) 65 vs 88; 512×2048×1024 (8 MiB) 66
/// vs 86; 512×1536×1536 (9 MiB) 67 vs 74–82; 512×4096×768 (12 MiB) 63 vs 80 — but 512×768×2304
/// (6.75 MiB) 85 vs 83; 512×1024×1536 (6 MiB) 99 vs 90–97; 512×1024×1024 (4 MiB) 109 vs 103;
/// 512×512×1536 and 2048×512×1536 (3 MiB) 108/104 vs 95–104: no gain below ~7 MiB, so none taken.
const L2_BLOCK_MIN_WEIGHT_BYTES: usize = 7 << 20;

/// Weight bytes per column chunk (`kc × nc` floats: 32 panels at kc = 256): half of L2, leaving
/// room for the packed rows of a group (`L2_GROUP_MC × mc × kc`, 224 KiB) and the C tiles.
/// Measured (1 thread, best of 8): 512 KiB chunks 85 vs 89 GFLOP/s for 1 MiB on 512×768×3072, 82
/// vs 88 on 2048×768×3072; 1.5 MiB chunks (with groups of 8 blocks) 95 vs 85 and 77 vs 85 for
/// 1 MiB with the same groups: within the noise, and 1 MiB leaves more room in L2.
const L2_CHUNK_BYTES: usize = 1 << 20;

/// Row blocks per group: each chunk of the weight is loaded once per group and reused by this many
/// `mc` blocks. 4 vs 6 vs 9 blocks (GFLOP/s, 1 thread): 512×768×3072 96/97/83, 2048×768×3072
/// 74/87/94, 512×1024×3072 88/76/–: no clear winner beyond 4, and larger groups leave C (the
/// group's rows × N, read again by the epilogue) further from the core.
const L2_GROUP_MC: usize = 4;

/// With L2 blocking and several threads, row tasks of at least this many `mc` blocks (instead of
/// one), so each task has more than one block to reuse its weight chunks across. 2 threads, best
/// of 6 (tasks of ≥ 1 / 2 / 4 blocks vs before): 2048×768×3072 157/145/149 vs 135; 512×2048×1024
/// 137/172/160 vs 142; 512×768×3072 152/176/179 vs 168 (noise ±25%). 2 keeps several tasks per
/// thread for the dynamic balance.
const L2_TASK_MIN_MC: usize = 2;

/// The driver prefetches C for tiles only in products whose row block of C (`mc` rows × N) is at
/// least this big, half of this EPYC's 512 KiB L2: there the block, the packed A and the weight
/// panels streaming past no longer all stay in L2 between a tile's visits to its C (paired calls,
/// off / on: 1024×768×3072 1.09–1.19, 1024×3072×768 1.03–1.13, 300×512×1536 1.06, 1024×768×768
/// 1.00–1.06); below it the prefetches only cost their issue (53×256×768, 88×256×256: 0.986–0.992
/// with them, 1.000 without).
const PREFETCH_C_MIN_BLOCK_BYTES: usize = 256 << 10;

/// The driver's blocking choices that depend on the memory system, which a benchmark may change
/// at run time to compare two of them in one process, call by call (`gemm_bench --ab`): on a
/// shared VM whose speed drifts by 20–50% between runs, only comparisons that close together
/// resolve a 10% difference. Everything else leaves the defaults (the constants above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Weights of at least this many bytes (all parts together) are L2-blocked.
    pub l2_block_min_weight_bytes: usize,
    /// Weight bytes per column chunk of the L2 blocking.
    pub l2_chunk_bytes: usize,
    /// `mc` row blocks per group of the L2 blocking (at least 1).
    pub l2_group_mc: usize,
    /// With several threads, split a weight of at least this many bytes whose N is at least twice
    /// its K by columns even when the rows would give every thread a block: each thread streams
    /// only its share of the weight, at the price of packing A once per column task. `usize::MAX`
    /// (the default): never — on the AVX2 EPYC (2 threads, paired calls) a 4 MiB threshold was
    /// neutral (0.95–1.08) on every shape but those whose row tasks did not divide among the
    /// threads, which the whole row tasks fix.
    pub wide_column_split_min_weight_bytes: usize,
    /// Fewer than 3 row tasks per thread are rounded down to a whole number per thread: 3 equal
    /// tasks on 2 threads leave one idle for the last third, 5 for the last fifth (from 3 per
    /// thread on, taking the next task dynamically balances well enough, and the finer tasks
    /// absorb a core that another process holds). Measured on the AVX2 EPYC, 2 threads, paired
    /// calls (`gemm_bench --threads 2 --ab whole_row_tasks=…`, median ratio of times, rounded
    /// / not): 640×768×3072 (3 tasks → 2) 0.92–0.99, 1024×768×3072 (5 → 4) 0.88–0.92,
    /// 640×3072×768 0.93–0.97, 250×256×768 (3 → 2) 0.93–0.95, 200×512×1536 0.96; 896×768×3072
    /// (4 tasks) 1.00; but 640×768×2304 (7 → 6) 1.03–1.06, hence only below 3 per thread. The
    /// rule as it stands against none (`--ab whole_row_tasks=0`, ratio none / rounded): 1.04–1.19
    /// on those shapes, 1.00 on 640×768×2304 (unchanged). `TUMBLE_NO_WHOLE_ROW_TASKS=1` turns it
    /// off (the default's value).
    pub whole_row_tasks_per_thread: bool,
    /// Before each tile call the driver prefetches the tile's C rows into L1, for the kernels
    /// whose tile does not do so itself (AVX2, portable; the AVX-512 tile always has), in
    /// products whose row block of C is at least 256 KiB (`PREFETCH_C_MIN_BLOCK_BYTES`). A tile
    /// reads C (K blocks after the first) or writes it (the first) only after its whole K loop,
    /// when the out-of-order window cannot reach ahead to it: where the row block's C does not
    /// fit L2 (an `mc` block of 96 rows × N ≥ 1,366 columns on a 512 KiB L2), those accesses wait
    /// on L3. `TUMBLE_NO_PREFETCH_C=1` turns it off; it moves no bits either way. Measured with
    /// `gemm_bench --ab prefetch_c=0` (the figures at `PREFETCH_C_MIN_BLOCK_BYTES` and in
    /// `bench/RESULTS.md`, twenty-second session).
    pub prefetch_c: bool,
    /// Tiles of at most 2 rows take a whole 32-wide weight panel in one call on kernels that have
    /// such a tile (AVX2; see `kernel::avx2`): a launch of a few rows, and the last rows of any
    /// launch. The same multiply-adds in the same order: the bits do not change.
    /// `TUMBLE_NO_WIDE_TILES=1` turns it off.
    pub wide_tiles: bool,
    /// Tiles run their K loop unrolled 4 times (AVX2; see `kernel::avx2`); off, one K step a
    /// trip (the test for a prefetch stays outside the loop either way). The same multiply-adds
    /// in the same order: the bits do not change. `TUMBLE_NO_UNROLLED_TILES=1` turns it off.
    pub unrolled_tiles: bool,
    /// Tiles of 1–3 rows take up to 4 weight panels in one call on kernels that have such a tile
    /// (AVX-512; see `kernel::avx512::MULTI_ROWS`): a launch of a few rows, and the last rows of
    /// any launch. The same multiply-adds in the same order: the bits do not change.
    /// `TUMBLE_NO_MULTI_PANEL_TILES=1` turns it off.
    pub multi_panel_tiles: bool,
    /// Row blocks of more rows than the packed micro-tile's (`Kernel::mr`, 14 on AVX-512) and at
    /// most this many are read where they lie by the kernel's direct tile, in tiles of its
    /// `DirectTile::rows` (blocks of at most that many always are), instead of packed: no A
    /// packing, and no last micro-panel of a few rows costing nearly a whole tile — training's
    /// products have 15 rows at the median (a tree level of a mini-batch of 20). Between the
    /// direct tile's rows and `mr` one packed tile beats two direct ones. Measured on the AVX-512
    /// Xeon (`gemm_bench --ab direct_group_rows=0`, K × N of 256 × 768, 768 × 256, 256 × 256,
    /// ratio of times on / off): 15–16 rows 0.86–0.94, 17–48 rows 0.91–1.04 (median ~0.96), more
    /// rows 0.95–1.01; 9–14 rows (where it does not apply) would be 1.02–1.21. The same
    /// multiply-adds in the same order either way: the bits do not change. 0 turns it off, as
    /// does `TUMBLE_NO_DIRECT_GROUPS=1`.
    pub direct_group_rows: usize,
    /// Micro-panels per `mc` row block (a weight panel loaded into L1 serves this many tiles
    /// before the next panel); 0: the kernel's own (`Kernel::mc`, 4 on AVX-512). Measured on the
    /// AVX-512 Ice Lake Xeon, 1 thread (`gemm_bench --ab row_block_tiles=T`, ratio of times T / 4):
    /// 2048×1024×1024 2: 1.17, 3: 1.17, 6: 1.02, 8: 1.07–1.11; 896×768×3072 2: 1.04, 3: 1.07, 6:
    /// 0.97, 8: 1.02 — the default stays. Row tasks across threads, and the runtime's row unit
    /// (`row_unit`), are still cut by the kernel's own `mc`. The same multiply-adds in the same
    /// order: the bits do not change.
    pub row_block_tiles: usize,
    /// Largest K block (`kc`: a weight panel of `kc × 32` floats is what a row block's tiles
    /// read from L1); 0: the kernel's own (`Kernel::kc`, 256). Measured on the AVX-512 Ice Lake
    /// Xeon, 1 thread (`gemm_bench --ab k_block=KC`, ratio of times KC / 256) on 2048×1024×1024,
    /// 896×768×3072, 896×3072×768, 896×768×2304: 128 → 1.06 / 1.08 / 1.03 / 1.02, 192 → 0.92 /
    /// 1.04 / 0.99 / 1.01, 384 → 1.02 / 1.02 / 1.01 / 1.03 — 256 stays. A later K block's tiles
    /// carry on from C, so the bits do not change; a `PackedRows` made under another `kc` is
    /// packed again from its rows.
    pub k_block: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            l2_block_min_weight_bytes: L2_BLOCK_MIN_WEIGHT_BYTES,
            l2_chunk_bytes: L2_CHUNK_BYTES,
            l2_group_mc: L2_GROUP_MC,
            wide_column_split_min_weight_bytes: usize::MAX,
            whole_row_tasks_per_thread: !tumble_limits::env_flag("TUMBLE_NO_WHOLE_ROW_TASKS"),
            prefetch_c: !tumble_limits::env_flag("TUMBLE_NO_PREFETCH_C"),
            wide_tiles: !tumble_limits::env_flag("TUMBLE_NO_WIDE_TILES"),
            unrolled_tiles: !tumble_limits::env_flag("TUMBLE_NO_UNROLLED_TILES"),
            multi_panel_tiles: !tumble_limits::env_flag("TUMBLE_NO_MULTI_PANEL_TILES"),
            direct_group_rows: if tumble_limits::env_flag("TUMBLE_NO_DIRECT_GROUPS") {
                0
            } else {
                DIRECT_GROUP_ROWS
            },
            row_block_tiles: 0,
            k_block: 0,
        }
    }
}

/// The current tuning: the defaults (environment included) until [`set_tuning`]. Read once per
/// product, so a lock costs nothing against the microseconds of the product itself.
fn tuning_cell() -> &'static RwLock<Tuning> {
    static CELL: OnceLock<RwLock<Tuning>> = OnceLock::new();
    CELL.get_or_init(|| RwLock::new(Tuning::default()))
}

/// Replaces the driver's [`Tuning`] for every later product, on every thread (a product already
/// running keeps the one it read when it started). Outputs do not change: every choice here only
/// reorders the same tiles, each element's K sum staying in one order.
pub fn set_tuning(t: Tuning) {
    let mut cur = tuning_cell().write().unwrap_or_else(|e| e.into_inner());
    *cur = Tuning {
        l2_chunk_bytes: t.l2_chunk_bytes.max(1),
        l2_group_mc: t.l2_group_mc.max(1),
        ..t
    };
}

/// The driver's current [`Tuning`].
pub fn tuning() -> Tuning {
    *tuning_cell().read().unwrap_or_else(|e| e.into_inner())
}

/// Rows after which the driver's blocking of a launch starts afresh: one `mc` block, or one
/// group of them when a weight of `weight_bytes` is L2-blocked. A launch cut into row chunks
/// that are multiples of this streams its weight as often as the whole launch does.
pub(crate) fn row_unit(kernel: &Kernel, weight_bytes: usize) -> usize {
    let tune = tuning();
    if weight_bytes >= tune.l2_block_min_weight_bytes {
        tune.l2_group_mc * kernel.mc
    } else {
        kernel.mc
    }
}

/// Row blocks of a few rows read where they lie (`Kernel::direct`); `TUMBLE_NO_DIRECT_A=1`
/// packs them as any other.
fn direct_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_DIRECT_A")
}

/// Weights of at most this many panels (N ≤ 128) read every row block where it lies, in blocks
/// of the direct tile's rows, instead of packing it: A is used against so few panels that packing
/// it costs about what the products do (MV-RNN's `W_M · [A; B]`, M = 128, K = 256, N = 128, per
/// node: a tenth of the run packing the same `W_M`). `TUMBLE_NO_DIRECT_NARROW_W=1` packs.
const DIRECT_MAX_PANELS: usize = 4;

/// [`Tuning::direct_group_rows`]'s default.
pub const DIRECT_GROUP_ROWS: usize = 48;

fn direct_narrow_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_DIRECT_NARROW_W")
}

/// A micro-panels packed with register transposes (`Kernel::pack_panel`); `TUMBLE_NO_SIMD_PACK=1`
/// packs them element by element (the same bits).
pub(crate) fn simd_pack_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_SIMD_PACK")
}

fn prefetch_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_PREFETCH")
}

thread_local! {
    /// Per-thread scratch for packed A blocks (grown, never shrunk; taken out while in use so a
    /// nested call from inside an epilogue gets its own).
    static SCRATCH: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::default());
}

/// Where a task writes its output.
enum Out<'c> {
    /// The task's own rows `r0..r1`, all `n` columns (row split): plain `&mut`.
    Rows(&'c mut [f32]),
    /// The whole C shared by tasks that own disjoint column ranges (column split).
    Shared(SharedC),
}

/// A raw pointer to the whole of C, shared between tasks that write disjoint column ranges.
#[derive(Clone, Copy)]
struct SharedC(*mut f32);
// SAFETY: tasks holding a `SharedC` write pairwise disjoint element sets (distinct column ranges)
// and the owning `&mut [f32]` is not used until all of them have been joined.
unsafe impl Send for SharedC {}
// SAFETY: as above.
unsafe impl Sync for SharedC {}

/// The epilogue's outputs (each `rows × width` floats, `width` second) for a range of rows.
pub(crate) type Outs<'o> = Vec<(&'o mut [f32], usize)>;

/// Split the first `rows` rows off every output (which start at the same row).
pub(crate) fn split_front<'o>(outs: &mut Outs<'o>, rows: usize) -> Outs<'o> {
    outs.iter_mut()
        .map(|(data, w)| {
            let at = (rows * *w).min(data.len());
            let (head, tail) = std::mem::take(data).split_at_mut(at);
            *data = tail;
            (head, *w)
        })
        .collect()
}

/// Call the epilogue on rows `rows` with their block of C and of every output.
pub(crate) fn finish(
    epilogue: &dyn EpilogueInto,
    rows: std::ops::Range<usize>,
    c: &mut [f32],
    outs: Outs,
) {
    let mut blocks: Vec<&mut [f32]> = outs.into_iter().map(|(d, _)| d).collect();
    epilogue.rows(rows, c, &mut blocks);
}

/// Run `C (m × n) = Σ parts` with the epilogue, on up to `threads` threads. `outs` are the
/// epilogue's own outputs, `m` rows each (lengths checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    kernel: &Kernel,
    parts: &[Part<'_>],
    m: usize,
    n: usize,
    c: &mut [f32],
    outs: &mut [(&mut [f32], usize)],
    epilogue: &dyn EpilogueInto,
    threads: usize,
) {
    debug_assert_eq!(c.len(), m * n);
    // A count no machine has (`--threads 9223372036854775808` reached here) would overflow the
    // task arithmetic below; the callers validate theirs, this keeps the kernels total.
    let threads = threads.clamp(1, crate::MAX_THREADS);
    // One read per product: its tasks all block alike even if the tuning changes meanwhile.
    let tune = tuning();
    let kernel = match kernel.rolled {
        Some(rolled) if !tune.unrolled_tiles => rolled,
        _ => kernel,
    };
    let mut outs: Outs = outs.iter_mut().map(|(d, w)| (&mut **d, *w)).collect();
    if m == 0 {
        return;
    }
    if n == 0 {
        finish(epilogue, 0..m, c, outs);
        return;
    }
    let k_total: usize = parts.iter().map(|p| p.w.k()).sum();
    if k_total == 0 {
        c.fill(0.0);
        finish(epilogue, 0..m, c, outs);
        return;
    }
    let small = m <= kernel.small_m;
    let panels = n.div_ceil(NR);
    let flops = 2usize
        .saturating_mul(m)
        .saturating_mul(n)
        .saturating_mul(k_total);
    let mut t = threads.max(1);
    let w_bytes = parts.iter().fold(0usize, |acc, p| {
        acc.saturating_add(p.w.k().saturating_mul(n).saturating_mul(4))
    });
    let l2 = (!small && w_bytes >= tune.l2_block_min_weight_bytes).then_some(&tune);
    let walk = Walk {
        small,
        l2,
        prefetch_c: tune.prefetch_c
            && !kernel.prefetches_c
            && m.min(kernel.mc).saturating_mul(n).saturating_mul(4) >= PREFETCH_C_MIN_BLOCK_BYTES,
        wide: kernel.wide.filter(|_| tune.wide_tiles),
        multi: kernel.multi.filter(|_| tune.multi_panel_tiles),
        direct_group_rows: tune.direct_group_rows,
        mc: match tune.row_block_tiles {
            0 => kernel.mc,
            tiles => tiles * kernel.mr,
        },
        kc: k_block(kernel, &tune),
    };
    if flops < MIN_PARALLEL_FLOPS && w_bytes < MIN_PARALLEL_WEIGHT_BYTES {
        t = 1;
    }
    if t == 1 {
        block_rows(
            kernel,
            parts,
            0,
            m,
            0,
            panels,
            n,
            walk,
            Out::Rows(c),
            Some((epilogue, outs)),
        );
        return;
    }
    let wide_columns = w_bytes >= tune.wide_column_split_min_weight_bytes && n >= 2 * k_total;
    if split_rows(kernel, m, panels, t) && !wide_columns {
        let chunk = m
            .div_ceil(row_task_count(kernel, m, t, l2.is_some(), &tune))
            .next_multiple_of(kernel.mr);
        let tasks = row_tasks(c, n, chunk, &mut outs);
        run_tasks(t, tasks, |(r0, s, o)| {
            let r1 = r0 + s.len() / n;
            block_rows(
                kernel,
                parts,
                r0,
                r1,
                0,
                panels,
                n,
                walk,
                Out::Rows(s),
                Some((epilogue, o)),
            );
        });
    } else {
        // Two chunks per thread: each chunk packs all of A again, so fewer than row chunks.
        let per = panels.div_ceil(2 * t);
        let shared = SharedC(c.as_mut_ptr());
        let tasks: Vec<usize> = (0..panels).step_by(per).collect();
        run_tasks(t, tasks, |p0| {
            let p1 = (p0 + per).min(panels);
            block_rows(
                kernel,
                parts,
                0,
                m,
                p0,
                p1,
                n,
                walk,
                Out::Shared(shared),
                None,
            );
        });
        // All column tasks joined: C is exclusively ours again. The epilogue runs per row chunk.
        let chunk = m.div_ceil(2 * t).max(1);
        let tasks = row_tasks(c, n, chunk, &mut outs);
        run_tasks(t, tasks, |(r0, s, o)| {
            finish(epilogue, r0..r0 + s.len() / n, s, o)
        });
    }
}

/// How many row tasks a launch of `m` rows is cut into for `t` threads: up to 4 per thread, each
/// at least one `mc` block, handed out dynamically (a thread whose core is busy with other work
/// takes fewer: this machine is shared); with L2 blocking (`l2`) tasks of at least
/// `L2_TASK_MIN_MC` row blocks, so that a chunk of the weight loaded into a core's L2 serves more
/// than one block of the task's rows; below 3 per thread a whole number per thread
/// ([`Tuning::whole_row_tasks_per_thread`]).
fn row_task_count(kernel: &Kernel, m: usize, t: usize, l2: bool, tune: &Tuning) -> usize {
    let blocks = match l2 {
        true => m / (L2_TASK_MIN_MC * kernel.mc),
        false => m.div_ceil(kernel.mc),
    };
    let chunks = blocks.clamp(t, 4 * t);
    match tune.whole_row_tasks_per_thread && chunks < 3 * t {
        true => (chunks / t).max(1) * t,
        false => chunks,
    }
}

/// C and the outputs cut into tasks of `chunk` rows: (first row, C rows, output rows).
fn row_tasks<'c, 'o>(
    c: &'c mut [f32],
    n: usize,
    chunk: usize,
    outs: &mut Outs<'o>,
) -> Vec<(usize, &'c mut [f32], Outs<'o>)> {
    c.chunks_mut(chunk * n)
        .enumerate()
        .map(|(i, s)| {
            let rows = s.len() / n;
            (i * chunk, s, split_front(outs, rows))
        })
        .collect()
}

/// Split rows (each thread packs its own rows and streams all of W) or weight columns (each thread
/// streams only its share of W but packs all rows)? Measured with 2 threads (GFLOP/s, rows vs
/// columns): B=64 256×768 175 vs 200; B=64 768×3072 90 vs 137; B=64 256×256 133 vs 77 (packing all
/// 64 rows twice costs ~25% when each thread gets only 128 columns); B=512 256×768 222 vs 178.
fn split_rows(kernel: &Kernel, m: usize, panels: usize, t: usize) -> bool {
    if m >= t * kernel.mc || panels < t {
        true // every thread gets at least one full row block
    } else if m < t * kernel.mr {
        false // not even one micro-panel of rows per thread
    } else {
        panels < 8 * t // narrow weight: duplicated packing would dominate a column split
    }
}

/// Run the tasks on `t` participants — the calling thread plus `t - 1` rayon jobs — each taking
/// the next task from a shared counter until none are left (dynamic balance: if another process
/// holds a core, the participants that do run pick up its share). Also the runtime's: it packs a
/// model's weights on the kernels' helper threads this way before the first run.
pub fn run_tasks<T: Send>(t: usize, tasks: Vec<T>, f: impl Fn(T) + Sync) {
    if tasks.len() <= 1 || t <= 1 {
        tasks.into_iter().for_each(f);
        return;
    }
    let helpers = (t - 1).min(tasks.len() - 1);
    let slots: Vec<Mutex<Option<T>>> = tasks.into_iter().map(|x| Mutex::new(Some(x))).collect();
    let next = AtomicUsize::new(0);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = slots.get(i) else { break };
        // Each index is handed out once, so the lock is uncontended; a poisoned lock (a panic
        // in another task's epilogue) still yields the task.
        let task = match slot.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(task) = task {
            f(task);
        }
    };
    let work = &work;
    let Some(pool) = helper_pool() else {
        // No pool could be started: the calling thread takes every task.
        work();
        return;
    };
    pool.in_place_scope(|s| {
        for _ in 0..helpers {
            s.spawn(move |_| work());
        }
        work();
    });
}

/// The pool the helpers of [`run_tasks`] run on: this crate's own, made again in a child made by
/// `fork` (Python's multiprocessing, a preloading server). rayon's global pool is built once per
/// process, and a forked child inherits it without its threads: a product there waited forever
/// for helpers that do not exist. `None` if no pool can be started.
fn helper_pool() -> Option<std::sync::Arc<rayon::ThreadPool>> {
    static POOL: Mutex<Option<(u32, std::sync::Arc<rayon::ThreadPool>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((p, kept)) = pool.as_ref() {
        if *p == pid {
            return Some(kept.clone());
        }
    }
    // The parent's pool, inherited: its threads are not in this process, so it is left as it is
    // (dropping it would signal them).
    if let Some(inherited) = pool.take() {
        std::mem::forget(inherited);
    }
    let fresh = std::sync::Arc::new(
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("tumble-gemm-{i}"))
            .build()
            .ok()?,
    );
    *pool = Some((pid, fresh.clone()));
    Some(fresh)
}

/// The largest K block of a product of `m` rows on `kernel`: K unblocked for the small-M
/// variant (its packed A is only `m × K` floats), the kernel's `kc` otherwise.
pub(crate) fn kc_max(kernel: &Kernel, m: usize) -> usize {
    if m <= kernel.small_m {
        usize::MAX
    } else {
        k_block(kernel, &tuning())
    }
}

/// The largest K block of `kernel`'s row blocks under `tune` ([`Tuning::k_block`]).
fn k_block(kernel: &Kernel, tune: &Tuning) -> usize {
    match tune.k_block {
        0 => kernel.kc,
        kc => kc,
    }
}

/// K blocks of at most `kc_max`, balanced: `[k0, k0 + kc)` pairs.
pub(crate) fn k_blocks(k: usize, kc_max: usize) -> impl Iterator<Item = (usize, usize)> {
    let nb = k.div_ceil(kc_max.max(1)).max(1);
    let kc = k.div_ceil(nb).max(1);
    (0..k).step_by(kc).map(move |k0| (k0, kc.min(k - k0)))
}

/// How `block_rows` walks a task: rows in groups of `group` packed together per K block, weight
/// panels in chunks of `chunk` panels, and within a chunk the group's `mc`-row blocks one after
/// another. Without L2 blocking `group = mc` and the one chunk covers all panels (the loop nest
/// is then exactly the unblocked one).
#[derive(Clone, Copy)]
struct Blocking {
    group: usize,
    chunk: usize,
}

/// The blocking of a task of `rows` rows and `panels` weight panels (K blocks of at most
/// `kc_max`); `l2`: the product's tuning when its weight is big enough for L2 blocking to pay.
fn blocking(
    kernel: &Kernel,
    mc: usize,
    rows: usize,
    panels: usize,
    kc_max: usize,
    l2: Option<&Tuning>,
) -> Blocking {
    let plain = Blocking {
        group: mc,
        chunk: panels.max(1),
    };
    // A single row block streams the weight once either way.
    let Some(tune) = l2.filter(|_| rows > mc) else {
        return plain;
    };
    // Balanced groups of at most L2_GROUP_MC row blocks (rounded to whole micro-panels), so a
    // task of 2 × 224 + 14 rows is not cut into two full groups and a 14-row one.
    let groups = rows.div_ceil(tune.l2_group_mc * mc);
    let group = rows.div_ceil(groups).next_multiple_of(kernel.mr);
    let kc_bytes = kc_max
        .saturating_mul(NR * std::mem::size_of::<f32>())
        .max(1);
    Blocking {
        group,
        chunk: (tune.l2_chunk_bytes / kc_bytes).clamp(1, panels.max(1)),
    }
}

/// How every task of one product walks its part of C, decided once per product from its shape
/// and the [`Tuning`] read for it.
#[derive(Clone, Copy)]
struct Walk<'t> {
    /// The small-M variant: one row block, K unblocked.
    small: bool,
    /// The product's tuning when its weight is big enough for L2 blocking to pay.
    l2: Option<&'t Tuning>,
    /// The driver prefetches each tile's C rows ([`Tuning::prefetch_c`] for a kernel whose
    /// tile does not).
    prefetch_c: bool,
    /// The kernel's whole-panel tile for tiles of a few rows ([`Tuning::wide_tiles`]).
    wide: Option<WideTile>,
    /// The kernel's multi-panel tile for tiles of a few rows ([`Tuning::multi_panel_tiles`]).
    multi: Option<MultiTile>,
    /// Row blocks of more than `Kernel::mr` rows read where they lie up to this many
    /// ([`Tuning::direct_group_rows`]).
    direct_group_rows: usize,
    /// Rows per row block ([`Tuning::row_block_tiles`], else `Kernel::mc`).
    mc: usize,
    /// Largest K block ([`Tuning::k_block`], else `Kernel::kc`).
    kc: usize,
}

/// What a tile of `rows` rows does at panel `jp` of the panels `pc0..pc1` it walks, at column
/// offset `off` within the panel, given the multi-panel tile (if any).
enum MultiStep {
    /// One multi-panel call over this many panels from `jp`.
    Call(MultiTile, usize),
    /// An earlier call covered this panel.
    Covered,
    /// The kernel's own tile.
    No,
}

/// Panels `pc0..` are taken in groups of the multi tile's panels from `pc0`: the group's first
/// panel calls it over the group (when the group has 2 panels or more), the others are covered.
fn multi_panels(
    multi: Option<MultiTile>,
    rows: usize,
    off: usize,
    jp: usize,
    pc0: usize,
    pc1: usize,
) -> MultiStep {
    let Some(mt) = multi.filter(|mt| rows <= mt.rows) else {
        return MultiStep::No;
    };
    if off > 0 || !(jp - pc0).is_multiple_of(mt.panels) {
        return MultiStep::Covered;
    }
    match mt.panels.min(pc1 - jp) {
        panels if panels >= 2 => MultiStep::Call(mt, panels),
        _ => MultiStep::No,
    }
}

/// One multi-panel tile call: `rows` rows of A over panels `jp..jp + panels` of `w`'s K block
/// `k0..k0 + kc`, into C at `c_tile` (row stride `n`, the tile's first column `col`).
///
/// # Safety
/// As for the kernel's own tile at panel `jp` ([`TileFn`] or [`DirectTileFn`]): the kernel is
/// available, `rows <=` the tile's rows (packed: `a`'s micro-panel holds `lda * kc` floats;
/// in place: each of the `rows` pointers is valid for `kc` floats), panels `jp..jp + panels`
/// exist, and C's rows `rows` × columns `col..min(n, col + panels * 32)` at `c_tile` lie in this
/// task's block.
#[allow(clippy::too_many_arguments)]
unsafe fn call_multi(
    mt: MultiTile,
    w: &PackedWeight,
    jp: usize,
    panels: usize,
    k0: usize,
    kc: usize,
    a: MultiA<'_>,
    c_tile: *mut f32,
    n: usize,
    col: usize,
    rows: usize,
    accumulate: bool,
) {
    let run = w.panel_run(jp, panels, k0, kc);
    let cols = (n - col).min(panels * NR);
    let out = MultiOut {
        b: run.as_ptr(),
        pstride: w.panel_stride(),
        c: c_tile,
        ldc: n,
        n: cols,
        accumulate,
    };
    // SAFETY: MultiTileFn contract — `2 <= panels <= mt.panels` (`multi_panels`), `rows <=
    // mt.rows`; the panels `jp..jp + panels` exist, so the last has a column below `n` and
    // `(panels - 1) * 32 < cols <= panels * 32`; `run` spans every panel's `kc * 32` floats at
    // the panel stride; A and C as the caller guarantees.
    unsafe { (mt.tile)(kc, a, rows, panels, out) }
}

/// C's rows `rows` × `cols` floats from `c` (row stride `ldc`) into L1: the first and the last
/// element of each row, which cover a tile's row of at most 16 floats (two lines at most).
#[inline]
fn prefetch_rows(c: *const f32, ldc: usize, rows: usize, cols: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in 0..rows {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let row = c.wrapping_add(i * ldc);
        // SAFETY: SSE, the intrinsic's one feature, is part of every x86_64 CPU; a prefetch is
        // a hint that never faults or reads into the program, so the addresses need no validity
        // (they are inside C anyway; `wrapping_add` computes them without pointer arithmetic's
        // contract).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(row as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(cols.saturating_sub(1)) as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, ldc, rows, cols);
}

/// Compute rows `r0..r1`, weight panels `p0..p1` of C.
#[allow(clippy::too_many_arguments)]
fn block_rows(
    kernel: &Kernel,
    parts: &[Part<'_>],
    r0: usize,
    r1: usize,
    p0: usize,
    p1: usize,
    n: usize,
    walk: Walk<'_>,
    mut out: Out<'_>,
    mut epilogue: Option<(&dyn EpilogueInto, Outs)>,
) {
    let Walk {
        small, l2, mc, kc, ..
    } = walk;
    let mr = kernel.mr;
    // Small-M variant: one row block, K unblocked (the packed A is only m × K floats).
    let (mc_max, kc_max) = if small {
        (r1 - r0, usize::MAX)
    } else {
        (mc, kc)
    };
    let bl = blocking(kernel, mc, r1 - r0, p1 - p0, kc_max, l2);
    let group_max = if small { mc_max } else { bl.group };
    let sub = mc_max.div_ceil(mr).max(1); // micro-panels per mc sub-block
    let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    // Direct row blocks' row pointers, refilled per K block (one allocation per call).
    let mut row_ptrs: Vec<[*const f32; DIRECT_MAX_ROWS]> = Vec::new();
    let transposer = kernel.pack_panel.filter(|_| simd_pack_enabled());
    let mut ic = r0;
    while ic < r1 {
        let mg = group_max.min(r1 - ic);
        let cblock: *mut f32 = match &mut out {
            Out::Rows(s) => s[(ic - r0) * n..(ic - r0 + mg) * n].as_mut_ptr(),
            // SAFETY: `ic < m`, so the offset stays inside C (`m * n` floats).
            Out::Shared(SharedC(p)) => unsafe { p.add(ic * n) },
        };
        let micro = mg.div_ceil(mr);
        let mut first = true;
        for part in parts {
            // A block of a few rows is read where it lies (no packing) when the kernel can.
            let direct = kernel.direct.filter(|_| {
                (mg <= DIRECT_MAX_ROWS
                    || (mg > mr && mg <= walk.direct_group_rows)
                    || (part.w.n().div_ceil(NR) <= DIRECT_MAX_PANELS && direct_narrow_enabled()))
                    && direct_enabled()
                    && !matches!(part.a, RowSource::Columns(_) | RowSource::Packed(_))
            });
            for (k0, kc) in k_blocks(part.w.k(), kc_max) {
                // Row pointers of the group, in blocks of the direct tile's rows (the last may
                // be short).
                row_ptrs.clear();
                if let Some(DirectTile { rows: dr, .. }) = direct {
                    row_ptrs.resize(mg.div_ceil(dr), [std::ptr::null(); DIRECT_MAX_ROWS]);
                    for i in 0..mg {
                        row_ptrs[i / dr][i % dr] = part.a.row(ic + i, k0, kc).as_ptr();
                    }
                }
                // A packed once for every product (`Rows::Packed`, never direct) is read where
                // it lies.
                let prepacked = match part.a {
                    RowSource::Packed(p) => p.panels(ic, mg, k0, kc, mr),
                    _ => None,
                };
                if direct.is_none() && prepacked.is_none() {
                    scratch.ensure(micro * mr * kc);
                    pack_a(
                        &part.a,
                        ic,
                        mg,
                        k0,
                        kc,
                        mr,
                        transposer,
                        scratch.as_mut_slice(),
                    );
                }
                let apack = prepacked.unwrap_or(scratch.as_slice());
                let mut pc0 = p0;
                while pc0 < p1 {
                    let pc1 = (pc0 + bl.chunk).min(p1);
                    let mut q0 = 0;
                    while q0 < micro {
                        let q1 = (q0 + sub).min(micro);
                        for jp in pc0..pc1 {
                            let bpanel = part.w.panel(jp, k0, kc);
                            // The first micro-panel's tile prefetches the next weight panel
                            // into L2, so it is not fetched from L3 by demand misses.
                            let next = if jp + 1 < pc1 && prefetch_enabled() {
                                part.w.panel(jp + 1, k0, kc).as_ptr()
                            } else {
                                std::ptr::null()
                            };
                            let mut off = 0;
                            while off < NR && jp * NR + off < n {
                                let col = jp * NR + off;
                                let nn = kernel.width.min(n - col);
                                if let Some(DirectTile { tile, rows: dr }) = direct {
                                    for (blk, ptrs) in row_ptrs.iter().enumerate() {
                                        let r = blk * dr;
                                        let rows = dr.min(mg - r);
                                        let c_tile = cblock.wrapping_add(r * n + col);
                                        let a = MultiA::Rows(ptrs);
                                        match multi_panels(walk.multi, rows, off, jp, pc0, pc1) {
                                            MultiStep::Call(mt, panels) => {
                                                // SAFETY: as for the tiles below, over the
                                                // `panels` panels from `jp` (all below `pc1`).
                                                unsafe {
                                                    call_multi(
                                                        mt, part.w, jp, panels, k0, kc, a, c_tile,
                                                        n, col, rows, !first,
                                                    )
                                                };
                                                continue;
                                            }
                                            MultiStep::Covered => continue,
                                            MultiStep::No => {}
                                        }
                                        // A tile of a few rows takes the whole panel at
                                        // its first half (the kernel's wide tile), and nothing
                                        // at its second.
                                        let (f, cols) = match walk.wide {
                                            Some(w) if rows <= w.rows && off == 0 => {
                                                (w.direct, NR.min(n - col))
                                            }
                                            Some(w) if rows <= w.rows => continue,
                                            _ => (tile, nn),
                                        };
                                        if walk.prefetch_c {
                                            prefetch_rows(c_tile, n, rows, cols);
                                        }
                                        // SAFETY: DirectTileFn contract — the kernel was built
                                        // for an available KernelKind; 1 <= rows <= dr, the
                                        // tile's rows (<= w.rows for the wide tile); `ptrs[i]`
                                        // for i < rows is row `ic + r + i`'s `kc` floats from
                                        // `k0` (validated rows, `RowSource::row`); C rows
                                        // `ic + r .. + rows` (r + rows <= mg), columns
                                        // `col .. col + cols <= n` lie in this task's block, as
                                        // for the packed tile below; the wide tile reads the
                                        // panel's `kc * 32` floats from its start (off == 0).
                                        unsafe {
                                            f(
                                                kc,
                                                ptrs,
                                                bpanel.as_ptr().add(off),
                                                if off == 0 && blk == 0 {
                                                    next
                                                } else {
                                                    std::ptr::null()
                                                },
                                                c_tile,
                                                n,
                                                rows,
                                                cols,
                                                !first,
                                            );
                                        }
                                    }
                                    off += kernel.width;
                                    continue;
                                }
                                for q in q0..q1 {
                                    let rows = mr.min(mg - q * mr);
                                    let a_q = &apack[q * mr * kc..(q + 1) * mr * kc];
                                    let c_tile = cblock.wrapping_add(q * mr * n + col);
                                    let a = MultiA::Packed {
                                        a: a_q.as_ptr(),
                                        lda: mr,
                                    };
                                    match multi_panels(walk.multi, rows, off, jp, pc0, pc1) {
                                        MultiStep::Call(mt, panels) => {
                                            // SAFETY: as for the tile below, over the `panels`
                                            // panels from `jp` (all below `pc1`).
                                            unsafe {
                                                call_multi(
                                                    mt, part.w, jp, panels, k0, kc, a, c_tile, n,
                                                    col, rows, !first,
                                                )
                                            };
                                            continue;
                                        }
                                        MultiStep::Covered => continue,
                                        MultiStep::No => {}
                                    }
                                    let (f, cols) = match walk.wide {
                                        Some(w) if rows <= w.rows && off == 0 => {
                                            (w.tile, NR.min(n - col))
                                        }
                                        Some(w) if rows <= w.rows => continue,
                                        _ => (kernel.tile, nn),
                                    };
                                    if walk.prefetch_c {
                                        prefetch_rows(c_tile, n, rows, cols);
                                    }
                                    // SAFETY: TileFn contract —
                                    // - the kernel was built for an available KernelKind;
                                    // - 1 <= rows <= mr (<= w.rows for the wide tile),
                                    //   1 <= cols <= its width, lda = mr >= rows;
                                    // - `a_q` holds `mr * kc >= (kc-1)*mr + rows` floats;
                                    // - `bpanel` holds `kc * 32` floats and `off + width <= 32`
                                    //   (the wide tile: off == 0, width 32), so
                                    //   `off + (kc-1)*32 + width <= kc*32` are in bounds;
                                    // - C rows `ic + q*mr .. + rows`, columns
                                    //   `col .. col + cols <= n` lie in this task's block;
                                    //   `cblock` points at row `ic`, and no other task writes
                                    //   these elements (disjoint rows or panels).
                                    unsafe {
                                        f(
                                            kc,
                                            a_q.as_ptr(),
                                            mr,
                                            bpanel.as_ptr().add(off),
                                            if q == q0 && off == 0 {
                                                next
                                            } else {
                                                std::ptr::null()
                                            },
                                            c_tile,
                                            n,
                                            rows,
                                            cols,
                                            !first,
                                        );
                                    }
                                }
                                off += kernel.width;
                            }
                        }
                        q0 = q1;
                    }
                    pc0 = pc1;
                }
                first = false;
            }
        }
        if let (Some((epi, outs)), Out::Rows(s)) = (&mut epilogue, &mut out) {
            let mut r = ic;
            while r < ic + mg {
                let mc = mc_max.min(ic + mg - r);
                let block = split_front(outs, mc);
                finish(
                    *epi,
                    r..r + mc,
                    &mut s[(r - r0) * n..(r - r0 + mc) * n],
                    block,
                );
                r += mc;
            }
        }
        ic += mg;
    }
    SCRATCH.with(|s| *s.borrow_mut() = scratch);
}
