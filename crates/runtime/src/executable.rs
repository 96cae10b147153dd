//! What a job computes once for a program before its mini-batches run (Nimble's "executable"
//! in the runtime's terms): the kernel plan of every block, made by the compiler's planner, with
//! its row-program cache; the packed weights of its GEMMs; and the per-block facts the scheduler
//! reads at every invocation. Every mini-batch and worker of the job shares one `Executable`
//! (it is `Sync`), so nothing here is recomputed per mini-batch, and the packed weights and
//! compiled row programs are released with it instead of living as long as the process.

use std::sync::Arc;

use tumble_compile::{Block, Program, ReuseAnalysis as Reuse};
use tumble_ir::Ty;

use tumble_compile::BlockPlan;

use tumble_interp::machine::RunError;
use tumble_tensor::Tensor;

use crate::fused::RunPlan;
use crate::gemm::WeightCache;
use crate::Options;

pub struct Executable {
    /// The program draws random numbers on the host (`tumble_interp::draws_on_host`): its
    /// machines run without fibers ([`crate::fibers_for`]). Found once per job.
    pub(crate) draws_on_host: bool,
    /// Per block: `Block::returns_only_scalars` (computed once, read per invocation).
    pub(crate) scalar_blocks: Vec<bool>,
    /// Per block and input: only its shape is read ([`Block::shape_only_inputs`]): any host value
    /// there may be an input of a block run on the host.
    pub(crate) shape_only_inputs: Vec<Vec<bool>>,
    /// Per block: some output is an input passed through (a weight-take split's consumer
    /// returning the slice): such outputs are the values passed, found per invocation only here.
    pub(crate) passes_inputs: Vec<bool>,
    /// Per block: every output an integer or boolean (no adjoint): host scalars while recording
    /// for the backward too.
    pub(crate) integral_blocks: Vec<bool>,
    /// Per block: it only takes slices of its inputs by its other inputs, every one the same for
    /// all instances by the reuse analysis, or one take of a weight's matrix by an index it
    /// computes from integers ([`crate::weight_slices::slice_block`]): run once per weight and
    /// index for the job.
    pub(crate) weight_slice_blocks: Vec<Option<crate::weight_slices::SliceBlock>>,
    /// The weight slices computed so far ([`crate::weight_slices`]).
    pub(crate) weight_slices: crate::weight_slices::SliceCache,
    /// Per block: it only adds its two f32 inputs (see [`Block::is_sum`]).
    pub(crate) sum_blocks: Vec<bool>,
    /// Per block: it draws no random numbers, so invocations on the same inputs compute the
    /// same results (a launch runs each such group once: `Dfg::identical_invocations`).
    pub(crate) pure_blocks: Vec<bool>,
    /// Per block: the most invocations one launch runs ([`locality_chunk`]; `usize::MAX` for
    /// all of them), for a launch on one kernel thread and on more: a job's workers split its
    /// threads and lend them to each other as they finish, so the launch, not the job, knows
    /// how many it has ([`Executable::chunk_size`]).
    pub(crate) chunk_sizes: ChunkSizes,
    /// Per block: the per-instance inputs read as an `nn.dense` weight ([`tumble_compile::ReuseAnalysis::chosen_weights`];
    /// empty without weight groups): a launch groups its invocations by the tensors they pass
    /// there.
    pub(crate) chosen_weights: Vec<Vec<u32>>,
    /// Per block: what its launches recorded for a backward compute together, for either kind
    /// of vjp ([`crate::kept::BlockFusions`]), found once per job.
    pub(crate) kept_fusions: Vec<crate::kept::BlockFusions>,
    /// Per block: the bytes every node's result takes for one invocation (from the static node
    /// types), the bound a launch checks against the memory budget before it allocates.
    pub(crate) row_bytes: Vec<usize>,
    /// Per block: some operator's type has a `?` size, which `row_bytes` counts as 0, so a
    /// launch sizes its invocations from their actual shapes (`dfg::Shapes::op_bytes`).
    pub(crate) dynamic_bytes: Vec<bool>,
    /// Values the job's last early-release scan walked (see `dfg/release.rs`): the next scan, in
    /// this mini-batch or the next, must be able to free bytes in proportion. Shared by workers;
    /// a hint, so relaxed.
    pub(crate) last_scan_visits: std::sync::atomic::AtomicU64,
    /// Per block: launches of fewer invocations wait for more under depth scheduling
    /// ([`defer_below`]; 0: never).
    pub(crate) defer_below: Vec<usize>,
    /// Kernel plan per block (empty when fusion is off).
    pub(crate) plans: Vec<RunPlan>,
    /// Packed GEMM weights, by weight buffer (see [`crate::gemm`]).
    pub(crate) weights: Arc<WeightCache>,
    /// Results of pure invocations of host values, kept for the job's later launches.
    pub(crate) memo: crate::memo::JobMemo,
    /// Per block: pure, and computing a product — worth keeping results for (a lookup alone is
    /// a view of its table already: copying its rows into the memo would cost, not save).
    pub(crate) memo_blocks: Vec<bool>,
    /// Per block: how a launch of invocations of different `?` lengths runs it (`None`: not
    /// ragged, or ragged batching is off).
    pub(crate) ragged: Vec<Option<RaggedRun>>,
    /// The program's derived parameters (weight transforms, [`tumble_compile::derived`]) for the
    /// weights they were last computed from: once per job, so their packed copies are made once
    /// and every launch reads the same tensors.
    derived: std::sync::Mutex<Option<DerivedValues>>,
    /// The GPU that runs the kernel plans' launches (`tumble run --device cuda`); `None`: the CPU.
    pub(crate) device: Option<Arc<crate::fused::device::DeviceRun>>,
}

/// Derived parameters and the weight tensors they were computed from.
struct DerivedValues {
    sources: Vec<Option<Tensor>>,
    values: Vec<Tensor>,
}

/// A block's ragged form ([`tumble_compile::ragged`]) with a kernel plan per segment.
pub(crate) struct RaggedRun {
    /// Per block input: rows, per instance, or shared.
    pub(crate) inputs: Vec<tumble_compile::ragged::RaggedInput>,
    pub(crate) segments: Vec<(tumble_compile::ragged::Segment, Option<RunPlan>)>,
    pub(crate) bytes_per_row: usize,
    /// Per block input: rows only gathers read, of any length (all false without mixing
    /// kernels, whose gathers then run grouped by shape).
    pub(crate) free_length: Vec<bool>,
}

impl RaggedRun {
    /// The ragged form of block `b`, if it has one: inputs the reuse analysis found to be one
    /// value per mini-batch (weights) are passed once, the others per invocation.
    fn new(block: &Block, reuse: &Reuse, b: usize, opts: &Options) -> Option<RaggedRun> {
        let r = tumble_compile::ragged::analyze(block, &reuse.varying_inputs(b))?;
        let segments = r
            .segments
            .into_iter()
            .map(|s| {
                let plan = opts
                    .plan_options()
                    .map(|p| crate::fused::plan_with(&s.block, p, opts.row_cache));
                (s, plan)
            })
            .collect();
        let free_length = match opts.mixing_kernels {
            true => r.free_length,
            false => vec![false; r.inputs.len()],
        };
        Some(RaggedRun {
            inputs: r.inputs,
            segments,
            bytes_per_row: r.bytes_per_row,
            free_length,
        })
    }
}

impl Executable {
    /// Forgets the results kept for later launches ([`crate::memo`]): the next run computes
    /// every invocation again (`tumble run --repeat`'s runs each do one job's work, not take
    /// what the run before computed).
    pub fn forget_kept_results(&self) {
        self.memo.clear();
    }

    /// Forgets everything computed from the weights' values — packed GEMM weights, weight
    /// slices, derived parameters, kept results — and lets go of the weights held for their
    /// keys: a trainer calls it before it updates the weights in place, so that the next
    /// mini-batch's launches see the new values (the caches key weights by their buffers, which
    /// an in-place update keeps) and the update finds each buffer its own (no copy). The plans
    /// and the per-block facts stay: the job goes on with them.
    pub fn forget_weight_values(&self) {
        self.weights.clear();
        self.weight_slices.clear();
        self.memo.clear();
        if let Ok(mut d) = self.derived.lock() {
            *d = None;
        }
    }

    /// Runs the kernel plans' launches on `gpu` (stages the device does not run, and blocks
    /// without a plan, stay on the host). Several workers may drive it: their launches queue on
    /// its one stream.
    ///
    /// Locality chunks are a cache idea of the CPU (a launch's per-invocation weights kept within
    /// L2): on a device every launch costs copies and a wait, so a block launches whole.
    pub fn with_device(mut self, gpu: tumble_cuda::Gpu) -> Executable {
        self.device = Some(Arc::new(crate::fused::device::DeviceRun::new(gpu)));
        self.chunk_sizes.one_thread.fill(usize::MAX);
        self.chunk_sizes.more_threads.fill(usize::MAX);
        self
    }

    /// Plans `program` (with its reuse analysis) for runs with `opts`: [`Executable::with_plans`]
    /// with the plans the compiler's planner makes for `opts` ([`Options::plan_options`]).
    pub fn new(program: &Program, reuse: &Reuse, opts: &Options) -> Executable {
        let plans = match opts.plan_options() {
            Some(p) => tumble_compile::plan_program(program, p),
            None => Vec::new(),
        };
        Executable::with_plans(program, reuse, plans, opts)
    }

    /// `program` (with its reuse analysis) and its kernel plans (from
    /// [`tumble_compile::compile`], made with `opts.plan_options()`; empty: no plans) ready for
    /// runs with `opts`. The switches that shape per-block facts (`locality_chunks`, `defer`) and
    /// the row-program cache (`row_cache`) are read here; runs must use the same ones.
    pub fn with_plans(
        program: &Program,
        reuse: &Reuse,
        plans: Vec<BlockPlan>,
        opts: &Options,
    ) -> Executable {
        let blocks = &program.blocks;
        let pure_blocks: Vec<bool> = blocks
            .iter()
            .map(|b| !b.nodes.iter().any(|n| n.op.name.starts_with("random.")))
            .collect();
        let memo_blocks = blocks
            .iter()
            .zip(&pure_blocks)
            .map(|(b, &pure)| {
                pure && b
                    .nodes
                    .iter()
                    .any(|n| matches!(n.op.name, "nn.dense" | "nn.batch_matmul" | "nn.matmul"))
            })
            .collect();
        let exec = Executable {
            draws_on_host: tumble_interp::draws_on_host(program),
            scalar_blocks: blocks.iter().map(Block::returns_only_scalars).collect(),
            shape_only_inputs: blocks.iter().map(Block::shape_only_inputs).collect(),
            passes_inputs: blocks
                .iter()
                .map(|b| {
                    b.outputs
                        .iter()
                        .any(|v| matches!(v, tumble_compile::BVal::Input(_)))
                })
                .collect(),
            integral_blocks: blocks.iter().map(Block::returns_only_integers).collect(),
            weight_slice_blocks: blocks
                .iter()
                .enumerate()
                .map(|(i, b)| match opts.weight_slices {
                    true => crate::weight_slices::slice_block(b, reuse, i),
                    false => None,
                })
                .collect(),
            weight_slices: Default::default(),
            sum_blocks: blocks.iter().map(Block::is_sum).collect(),
            pure_blocks,
            chunk_sizes: {
                let sizes = |threads: usize| -> Vec<usize> {
                    blocks
                        .iter()
                        .enumerate()
                        .map(|(i, b)| match opts.locality_chunks {
                            true => locality_chunk(b, reuse, i, threads),
                            false => usize::MAX,
                        })
                        .collect()
                };
                ChunkSizes {
                    one_thread: sizes(1),
                    more_threads: sizes(2),
                }
            },
            chosen_weights: blocks
                .iter()
                .enumerate()
                .map(|(i, b)| match opts.weight_groups {
                    true => reuse.chosen_weights(b, i),
                    false => Vec::new(),
                })
                .collect(),
            last_scan_visits: Default::default(),
            dynamic_bytes: blocks
                .iter()
                .map(|b| {
                    let unknown = |t: &tumble_ir::Ty| match t.as_tensor() {
                        Some((dims, _)) => dims.iter().any(|d| d.known().is_none()),
                        None => false,
                    };
                    b.nodes.iter().any(|n| match &n.ty {
                        tumble_ir::Ty::Tuple(ts) => ts.iter().any(unknown),
                        t => unknown(t),
                    })
                })
                .collect(),
            kept_fusions: blocks.iter().map(crate::kept::BlockFusions::of).collect(),
            row_bytes: blocks
                .iter()
                .map(|b| {
                    b.nodes
                        .iter()
                        .map(|n| tumble_ops::value_bytes(&n.ty))
                        .fold(0, usize::saturating_add)
                })
                .collect(),
            defer_below: blocks
                .iter()
                .enumerate()
                .map(|(i, b)| match opts.defer {
                    true => defer_below(b, reuse, i),
                    false => 0,
                })
                .collect(),
            plans: plans
                .into_iter()
                .zip(blocks.iter())
                .map(|(p, b)| RunPlan::new(b, p, opts.row_cache))
                .collect(),
            weights: Arc::default(),
            memo: Default::default(),
            memo_blocks,
            ragged: blocks
                .iter()
                .enumerate()
                .map(|(i, b)| match opts.ragged {
                    true => RaggedRun::new(b, reuse, i, opts),
                    false => None,
                })
                .collect(),
            derived: std::sync::Mutex::new(None),
            device: None,
        };
        match opts.emulated_device {
            true => exec.with_device(tumble_cuda::Gpu::emulated()),
            false => exec,
        }
    }

    /// [`Executable::derived_params`] for an instance's entry arguments, as the values a machine
    /// starts with ([`tumble_interp::Machine::start_derived`]).
    pub fn derived_args(
        &self,
        program: &Program,
        args: &[tumble_interp::Value],
    ) -> Result<Vec<tumble_interp::Value>, RunError> {
        let weight = |k: u32| {
            args.get(k as usize)
                .and_then(tumble_interp::Value::as_tensor)
                .cloned()
        };
        Ok(self
            .derived_params(program, weight)?
            .into_iter()
            .map(tumble_interp::Value::Tensor)
            .collect())
    }

    /// The program's derived parameters for a run whose entry argument `k` is `param(k)`,
    /// computed once for the same weight tensors and then shared (by every mini-batch and worker
    /// of the job, by a serving session's instances, and by the weights packed at start-up).
    pub fn derived_params(
        &self,
        program: &Program,
        param: impl Fn(u32) -> Option<Tensor>,
    ) -> Result<Vec<Tensor>, RunError> {
        if program.derived.is_empty() {
            return Ok(Vec::new());
        }
        let sources: Vec<Option<Tensor>> = program
            .derived
            .iter()
            .flat_map(|d| d.params.iter().map(|&k| param(k)))
            .collect();
        let mut cached = self
            .derived
            .lock()
            .map_err(|_| RunError::new("internal: derived parameters poisoned"))?;
        if let Some(c) = cached.as_ref() {
            let same = c.sources.len() == sources.len()
                && c.sources.iter().zip(&sources).all(|(a, b)| match (a, b) {
                    (Some(a), Some(b)) => a.same_tensor(b),
                    _ => false,
                });
            if same {
                return Ok(c.values.clone());
            }
        }
        let values = program
            .derived_values(param)
            .map_err(|e| RunError::at(e.span, e.message))?;
        *cached = Some(DerivedValues {
            sources,
            values: values.clone(),
        });
        Ok(values)
    }
}

/// Bytes of one invocation's per-instance inputs that a launch of a per-invocation-weight block
/// may hold per chunk: a quarter of a core's L2 (1 MiB here), leaving room for the intermediates.
const CHUNK_INPUT_BYTES: usize = 256 << 10;

/// Per block, the most invocations a launch runs at once ([`locality_chunk`]), by the kernel
/// threads the launch has: only [`product_chunk`] depends on them.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChunkSizes {
    pub(crate) one_thread: Vec<usize>,
    pub(crate) more_threads: Vec<usize>,
}

impl Executable {
    /// The most invocations of `block` one launch on `threads` kernel threads runs
    /// (`usize::MAX`: all).
    pub(crate) fn chunk_size(&self, block: u32, threads: usize) -> usize {
        let sizes = match threads <= 1 {
            true => &self.chunk_sizes.one_thread,
            false => &self.chunk_sizes.more_threads,
        };
        sizes.get(block as usize).copied().unwrap_or(usize::MAX)
    }
}

/// A block with an `nn.dense` whose weight (second operand) is not one shared tensor: MV-RNN's
/// per-word matrices, `W_M · [A; B]`. Batching such products reuses no weight, and a launch of
/// every invocation at once streams all their matrices through memory stage by stage (stacking,
/// concatenation, transposes, products) where launches of a few at a time keep them in cache:
/// measured, MV-RNN-large b64 batched ran slower than one invocation per launch.
/// Such a block launches at most as many invocations as fit their per-instance inputs (the inputs
/// the reuse analysis found to differ per invocation, sized by their static types) in
/// [`CHUNK_INPUT_BYTES`]; every other block, or one whose input shapes are not static, launches
/// all of its invocations at once (`usize::MAX`). Computed once per block, not per launch.
fn locality_chunk(block: &Block, reuse: &Reuse, b: usize, threads: usize) -> usize {
    use tumble_compile::{BArg, BVal, InputReuse};
    let per_instance = |i: usize| {
        matches!(
            reuse.inputs.get(b).and_then(|v| v.get(i)),
            Some(InputReuse::PerInstance)
        )
    };
    let per_invocation_weight = block.nodes.iter().any(|n| {
        n.op.name == "nn.dense"
            && match n.args.get(1) {
                Some(BArg::One(BVal::Input(i))) => per_instance(*i as usize),
                Some(BArg::One(BVal::Node(_) | BVal::Field(..))) => true,
                _ => false,
            }
    });
    if !per_invocation_weight {
        return intermediate_chunk(block, threads);
    }
    let bytes: Option<usize> = block
        .inputs
        .iter()
        .enumerate()
        .filter(|(i, _)| per_instance(*i))
        .map(|(_, input)| static_bytes(&input.ty))
        .sum();
    match bytes {
        Some(bytes) => (CHUNK_INPUT_BYTES / bytes.max(1)).max(1),
        None => usize::MAX,
    }
}

/// Bytes of a tensor of type `ty`, if its shape is static.
fn static_bytes(ty: &tumble_ir::Ty) -> Option<usize> {
    let (dims, dtype) = ty.as_tensor()?;
    let elems = dims.iter().try_fold(1usize, |e, d| {
        e.checked_mul(usize::try_from(d.known()?).ok()?)
    })?;
    elems.checked_mul(dtype.size())
}

/// Bytes of one intermediate of a launch of a block whose every invocation makes a large one
/// (below): about an L2's worth.
const CHUNK_INTERMEDIATE_BYTES: usize = 1 << 20;

/// One invocation's intermediate at least this large makes its block launch in chunks.
const LARGE_INTERMEDIATE_BYTES: usize = 16 << 10;

/// A block without products whose invocations each make a large intermediate and reduce it (a
/// Viterbi step's
/// `(T, 1) + (T, T)` scores, reduced by `max` and `argmax` over an axis): launched all at once,
/// every intermediate is a fresh tensor of all of them (134 MB for 2,048 steps at T = 128: first
/// touches of fresh pages and passes over main memory, 1.2× the time of one invocation per
/// launch); in chunks of about [`CHUNK_INTERMEDIATE_BYTES`] each, the pool hands every chunk
/// the previous one's buffers, in cache. A block with products is chunked only for its
/// largest intermediates ([`product_chunk`]): its products gain from every row.
fn intermediate_chunk(block: &Block, threads: usize) -> usize {
    let largest = block
        .nodes
        .iter()
        .filter_map(|n| static_bytes(&n.ty))
        .max()
        .unwrap_or(0);
    if block.nodes.iter().any(|n| {
        matches!(
            n.op.name,
            "nn.dense" | "nn.batch_matmul" | "nn.matmul" | "nn.conv1d" | "nn.conv2d"
        )
    }) {
        return product_chunk(largest, threads);
    }
    // The block reduces what it makes: its outputs, kept however the launch is cut, are a small
    // part of it (a leaf's looked-up matrix is its output, and chunks would only split its
    // launch and its memo).
    let kept: Option<usize> = block.output_tys().iter().map(static_bytes).sum();
    if kept.is_none_or(|k| k.saturating_mul(8) > largest) {
        return usize::MAX;
    }
    match largest >= LARGE_INTERMEDIATE_BYTES {
        true => (CHUNK_INTERMEDIATE_BYTES / largest).max(1),
        false => usize::MAX,
    }
}

/// One invocation's intermediate at least this large makes a block with products launch in
/// chunks of about [`CHUNK_PRODUCT_BYTES`] (on one kernel thread).
const LARGE_PRODUCT_INTERMEDIATE_BYTES: usize = 1 << 20;

/// Bytes of the largest intermediate of one chunk of such a launch.
const CHUNK_PRODUCT_BYTES: usize = 4 << 20;

/// A block with products whose invocations each make an intermediate of a megabyte or more —
/// a transformer layer over a sentence, Berxit-large's `(128, 4096)` feed-forward activations,
/// 2 MiB an invocation — on one kernel thread launches about [`CHUNK_PRODUCT_BYTES`] of them at a
/// time (2 sentences: 256 rows a product, enough for its full speed). Launched whole, a launch of
/// 64 sentences made every intermediate a fresh 128 MiB tensor streamed through main memory by
/// each stage: Berxit-large at batch 64 ran 13–22% slower than `--scheduler eager` (one sentence
/// a launch); in chunks, as fast as eager (16.2–16.6 s against 17.6–17.9 whole, 16.5–16.8 eager),
/// Berxit-small at b64 3–6% faster, both at b8 unchanged, the same bytes. On two threads the
/// chunks' products split less well between them (Berxit-small b64 6–10% slower with chunks of
/// 4 MiB, mixed at 8 MiB), so there launches stay whole. Smaller intermediates leave the launch
/// whole: its products gain from every row. `--no-locality-chunks` turns it off.
fn product_chunk(largest: usize, threads: usize) -> usize {
    match threads <= 1 && largest >= LARGE_PRODUCT_INTERMEDIATE_BYTES {
        true => (CHUNK_PRODUCT_BYTES / largest).max(1),
        false => usize::MAX,
    }
}

/// Invocations below which a launch of `block` is deferred ([`crate::Options::defer`]): 0 unless
/// its matrix products read shared weights of at least [`crate::DEFER_WEIGHT_BYTES`] in all;
/// otherwise enough invocations for [`crate::DEFER_BELOW_ROWS`] rows of the smallest product.
fn defer_below(block: &Block, reuse: &Reuse, b: usize) -> usize {
    use tumble_compile::{BArg, BVal, InputReuse};
    let known_len = |ty: &Ty| -> Option<(usize, usize)> {
        let (dims, dtype) = ty.as_tensor()?;
        let dims: Vec<usize> = dims
            .iter()
            .map(|d| d.known().map(|x| x as usize))
            .collect::<Option<_>>()?;
        let len = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
        let rows = len / dims.last().copied().unwrap_or(1).max(1);
        Some((len.checked_mul(dtype.size())?, rows))
    };
    let mut weight_bytes = 0usize;
    let mut rows = usize::MAX;
    for n in block.nodes.iter().filter(|n| n.op.name == "nn.dense") {
        let (Some(BArg::One(data)), Some(BArg::One(BVal::Input(w)))) =
            (n.args.first(), n.args.get(1))
        else {
            continue;
        };
        let shared = matches!(
            reuse.inputs.get(b).and_then(|v| v.get(*w as usize)),
            Some(InputReuse::Shared | InputReuse::SharedPerCallSite)
        );
        let weight = block.inputs.get(*w as usize).and_then(|i| known_len(&i.ty));
        let data = known_len(&block.val_ty(data));
        if let (true, Some((bytes, _)), Some((_, r))) = (shared, weight, data) {
            weight_bytes = weight_bytes.saturating_add(bytes);
            rows = rows.min(r.max(1));
        }
    }
    if weight_bytes < crate::DEFER_WEIGHT_BYTES || rows == usize::MAX {
        return 0;
    }
    crate::DEFER_BELOW_ROWS.div_ceil(rows)
}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executable")
            .field("blocks", &self.row_bytes.len())
            .field("plans", &self.plans.len())
            .finish_non_exhaustive()
    }
}

impl Executable {
    /// Packs, before any run, the GEMM weights that are model weights: for every block call site
    /// whose plan has a dense stage (or a horizontally fused group) with weights passed straight
    /// from entry arguments (`Code::Param`), packs them as a launch would, into this executable's
    /// cache. `params[k]` is the tensor bound to entry argument `k` (`None`: an instance input).
    /// The first run then finds them packed: packing is per-program work, and on small models it
    /// was most of a first run's extra time (DRNN-large b8: kernels 4.6 ms first, 1.3 ms after).
    /// The weights are packed on up to `threads` threads, the largest first (each weight is
    /// packed whole by one thread, to the same bits in the same cache: only start-up changes —
    /// Berxit-small's 72 weights in 94–101 ms at two threads against 175–196 on one,
    /// `bench/RESULTS.md`, sixty-fourth session).
    /// Returns how many weights (or fused groups) it packed. Weights reaching a block any other
    /// way are packed at their first launch, as before.
    pub fn prepack_weights(
        &self,
        program: &Program,
        params: &[Option<tumble_tensor::Tensor>],
        threads: usize,
    ) -> usize {
        let _cache = WeightCache::enter(&self.weights);
        // Weights reached through derived parameters are packed too: computed here once, the
        // runs then read the same tensors.
        let mut with_derived: Vec<Option<Tensor>> = params.to_vec();
        if !program.derived.is_empty() {
            let weight = |k: u32| params.get(k as usize).cloned().flatten();
            if let Ok(d) = self.derived_params(program, weight) {
                let n_entry = program.entry_lambda().map_or(0, |l| l.n_params as usize);
                with_derived.resize(n_entry, None);
                with_derived.extend(d.into_iter().map(Some));
            }
        }
        let params = with_derived.as_slice();
        for t in params.iter().flatten() {
            self.weights.note_weight(t);
        }
        if let Some(device) = &self.device {
            // A failure (device memory) only leaves those rows to be stacked and uploaded by
            // the launches that read them.
            let _ = device.mirror_weights(params);
        }
        let mut packed = std::collections::HashSet::new();
        let mut jobs: Vec<PackJob> = Vec::new();
        for lambda in &program.lambdas {
            lambda.body.visit(&mut |code| {
                let tumble_compile::Code::InvokeBlock { block, args, .. } = code else {
                    return;
                };
                let (Some(b), Some(rp)) = (
                    program.blocks.get(*block as usize),
                    self.plans.get(*block as usize),
                ) else {
                    return;
                };
                let weight = |node: usize| -> Option<tumble_tensor::Tensor> {
                    let n = b.nodes.get(node)?;
                    if n.op.name != "nn.dense" {
                        return None;
                    }
                    let tumble_compile::BArg::One(tumble_compile::BVal::Input(i)) =
                        n.args.get(1)?
                    else {
                        return None;
                    };
                    let tumble_compile::Code::Param(k) = args.get(*i as usize)? else {
                        return None;
                    };
                    let t = params.get(*k as usize)?.clone()?;
                    (t.as_f32().is_some() && t.rank() == 2).then_some(t)
                };
                for stage in &rp.plan.stages {
                    let nodes: Vec<usize> = match stage {
                        tumble_compile::Stage::Dense(d) => vec![*d],
                        tumble_compile::Stage::HDense(ns) => ns.clone(),
                        tumble_compile::Stage::DenseSum { denses, parts, .. } => {
                            for (&d, parts) in denses.iter().zip(parts) {
                                if let Some(w) = weight(d) {
                                    let widths = part_widths(b, parts);
                                    if packed.insert(vec![w.buffer_id(), widths.len()]) {
                                        jobs.push(PackJob::Columns { w, widths });
                                    }
                                }
                            }
                            continue;
                        }
                        _ => continue,
                    };
                    let Some(ws) = nodes.iter().map(|&d| weight(d)).collect::<Option<Vec<_>>>()
                    else {
                        continue;
                    };
                    let Some(k) = ws.first().and_then(|w| w.shape().get(1).copied()) else {
                        continue;
                    };
                    if ws.iter().any(|w| w.shape().get(1) != Some(&k)) {
                        continue;
                    }
                    let key: Vec<usize> = ws.iter().map(tumble_tensor::Tensor::buffer_id).collect();
                    if !packed.insert(key) {
                        continue;
                    }
                    jobs.push(PackJob::Dense { ws, k });
                }
            });
        }
        run_pack_jobs(&self.weights, jobs, threads);
        packed.len()
    }
}

/// One weight (or horizontally fused group) [`Executable::prepack_weights`] packs.
enum PackJob {
    /// `nn.dense` weights of one stage, K wide: one packed whole, several concatenated.
    Dense { ws: Vec<Tensor>, k: usize },
    /// A sum stage's weight, packed per part (`widths`, see [`prepack_columns`]).
    Columns { w: Tensor, widths: Vec<usize> },
}

impl PackJob {
    fn bytes(&self) -> usize {
        match self {
            PackJob::Dense { ws, .. } => ws.iter().map(Tensor::len).sum::<usize>() * 4,
            PackJob::Columns { w, .. } => w.len() * 4,
        }
    }

    /// Packs into the thread's current cache. A failure (not f32, odd shape) only leaves the
    /// packing to the first launch.
    fn run(&self) {
        match self {
            PackJob::Dense { ws, k } => {
                let _ = match ws.as_slice() {
                    [w] => {
                        let n = w.shape().first().copied().unwrap_or(0);
                        crate::gemm::packed(w, n, *k).map(drop)
                    }
                    _ => crate::gemm::packed_concat(ws, *k).map(drop),
                };
            }
            PackJob::Columns { w, widths } => prepack_columns(w, widths),
        }
    }
}

/// Runs `jobs` into `cache` on `threads` participants — the calling thread and the kernels' helper
/// threads ([`tumble_kernels::run_tasks`]) — each taking the next job, largest first.
/// `TUMBLE_SERIAL_PREPACK=1` packs on the calling thread alone.
fn run_pack_jobs(cache: &Arc<WeightCache>, mut jobs: Vec<PackJob>, threads: usize) {
    jobs.sort_by_key(|j| std::cmp::Reverse(j.bytes()));
    let threads = match tumble_limits::switch_on!("TUMBLE_SERIAL_PREPACK") {
        true => 1,
        false => threads.clamp(1, crate::MAX_THREADS),
    };
    tumble_kernels::run_tasks(threads, jobs, |job| {
        // The cache is the thread's own setting: entered on whichever thread takes the job.
        let _entered = WeightCache::enter(cache);
        job.run();
    });
}

/// The last-axis widths of a sum stage's product's `parts` (its K per part), from their static
/// types; empty when one is not known.
fn part_widths(block: &tumble_compile::Block, parts: &[tumble_compile::BVal]) -> Vec<usize> {
    parts
        .iter()
        .map(|v| {
            block
                .val_ty(v)
                .as_tensor()
                .and_then(|(dims, _)| dims.last().copied())
                .and_then(|d| d.known())
                .and_then(|d| usize::try_from(d).ok())
        })
        .collect::<Option<Vec<_>>>()
        .unwrap_or_default()
}

/// Packs weight `w` (N, K) as a sum stage's launches will: one column block per part (`widths`),
/// or whole when they are not known.
fn prepack_columns(w: &tumble_tensor::Tensor, widths: &[usize]) {
    let (Some(&n), Some(&k)) = (w.shape().first(), w.shape().get(1)) else {
        return;
    };
    // A failure only leaves the packing to the first launch.
    if widths.is_empty() || widths.iter().sum::<usize>() != k {
        let _ = crate::gemm::packed(w, n, k);
        return;
    }
    let mut k0 = 0;
    for &kp in widths {
        let _ = crate::gemm::packed_columns(w, n, k, k0, kp);
        k0 += kp;
    }
}
