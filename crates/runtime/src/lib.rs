//! The auto-batching runtime (ACROBAT §3–4): runs a mini-batch of instances of a program together.
//!
//! Each instance's control flow runs on the host in its own suspendable executor
//! ([`tumble_interp::Machine`]); block invocations are recorded as dataflow-graph nodes ([`dfg`])
//! instead of being computed. When every executor is done or waiting for a tensor value (an `if` on
//! a computed condition), the pending graph is evaluated in batched launches — all ready nodes of the
//! same (depth, block, shapes) at once ([`batched`]) — and the waiting executors resume.

pub mod backward;
pub mod batched;
pub mod dfg;
mod executable;
mod fastmath;
mod fastops;
pub mod fused;
mod gemm;
mod host_scalars;
mod intern;
mod kept;
mod memo;
pub mod optim;
pub mod profile;
pub mod reuse;
pub mod session;
mod simd;
pub mod trace;
mod weight_slices;
pub mod workers;

use std::time::Instant;

use tumble_compile::Program;
use tumble_interp::{InstanceCtx, Machine, Outcome, RunError, Value};
use tumble_tensor::Rng;

pub use dfg::RELEASE_SCAN_BYTES;
pub use executable::Executable;
/// Products with few output columns as dot products, or on the blocked GEMM (process-wide).
pub use gemm::{set_small_product_gemm, uncached_packs};
pub use profile::Profile;
pub use reuse::Reuse;
pub use tumble_kernels::{set_narrow_products, MAX_THREADS};
pub use workers::{default_batch, run_batches, Job, JobError, Lending, DEFAULT_BATCH};

/// How block invocations are ordered into launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduler {
    /// ACROBAT's inline depth: depths assigned from program order as the graph is built, with
    /// `db.concurrent` (e.g. inside `@map`) forking and joining depths.
    Inline,
    /// Dataflow depth: 1 + the maximum depth of a node's inputs.
    Depth,
    /// DyNet's agenda: repeatedly launch the ready group whose shallowest node is shallowest.
    Agenda,
    /// No batching: every invocation is its own launch, at once (the PyTorch-like baseline).
    Eager,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub scheduler: Scheduler,
    /// Run block invocations whose inputs are known scalars on the host at once.
    pub host_scalars: bool,
    /// Honor `db.phase_change()`: hold every instance at a phase boundary until all instances are
    /// there, so the next phase (e.g. an output layer) batches across all of them (ACROBAT §4.1).
    pub phases: bool,
    /// Hoisting (ACROBAT §4.1): invocations the taint analysis found independent of recursive state
    /// (static, `Site::hoisted`) get their dataflow depth, and invocations with no uncomputed input
    /// get depth 0 (dynamic), instead of the instance's inline depth: an RNN's input transform runs
    /// for all positions of all instances at once instead of step by step.
    pub hoist: bool,
    /// Honor ghost operators (`Code::Ghost`, ACROBAT Fig. 3): advance the inline depth in the
    /// shorter arms of conditionals so that what follows lines up across instances.
    pub ghosts: bool,
    /// Launch invocations that pass different parameter tensors to a block separately (dynamic code
    /// duplication), so each launch has its weights shared.
    pub dup: bool,
    /// Threads for kernels (dense stages); 1 keeps everything on the calling thread.
    pub threads: usize,
    /// Run blocks by their kernel plans (dense stages + fused row programs); off: every operator
    /// through the batching rules and reference kernels.
    pub fusion: bool,
    /// Compile each fused row program once per (block, stage, operand shapes) and reuse it; off:
    /// compile it at every launch.
    pub row_cache: bool,
    /// Horizontal fusion: denses in a block that read the same rows with different shared weights
    /// (LSTM gates, Q/K/V projections) run as one GEMM over the concatenated weights.
    pub hfuse: bool,
    /// Gather fusion: a launch input made of rows of earlier outputs is passed as a list of row
    /// pointers (GEMM packing and row programs read them in place) instead of being stacked
    /// into a new tensor first. Needs `fusion`.
    pub gather_fusion: bool,
    /// Epilogue fusion: a row program fed only by a GEMM stage runs inside the GEMM, on each block
    /// of output rows while it is in cache, writing the block's outputs in place; the product
    /// itself lives in reused scratch. Needs `fusion`.
    pub epilogue: bool,
    /// With several workers, one that runs out of mini-batches lends its kernel threads to the
    /// launches of those still running (see [`workers`]).
    pub lend_threads: bool,
    /// Sum fusion: an invocation of a block that only adds two same-shaped f32 tensors (a child
    /// sum written as `@foldl(add, ..)`) is not launched; the terms are kept, chains of adds
    /// flatten into one n-ary sum, zero literals drop out, and the rows are summed where a launch
    /// reads them.
    pub sum_fusion: bool,
    /// Early release: a computed node's outputs are freed as soon as every node reading them has
    /// launched and no host value names them (found by a scan of the instances' values before a
    /// flush), instead of with the whole graph at the end of the mini-batch, so the buffer pool
    /// hands them to later launches of the same run (fewer fresh pages, a lower peak). Off while
    /// recording for the backward, which reads every output; the eager scheduler never scans.
    pub early_release: bool,
    /// A flush scans the host's values for early release once this many output bytes were
    /// recorded since the last scan (default [`RELEASE_SCAN_BYTES`]; 0: before every flush, as
    /// the tests run it). Results never depend on it.
    pub release_scan_bytes: usize,
    /// Locality chunks: a block whose matrix products have per-invocation weights (MV-RNN's word
    /// matrices) is launched over chunks of invocations whose inputs fit in cache, instead of all
    /// at once (batching such products reuses no weight; it only streams them through memory).
    pub locality_chunks: bool,
    /// Weight groups: a launch of a block whose matrix product reads a weight the program chose
    /// per instance (`let %W = if (..) { %Wa } else { %Wb }`) runs each group of invocations
    /// passing the same weight tensor together, that weight passed once, instead of gathering
    /// (or, in locality chunks, running one by one) what are a few model weights.
    pub weight_groups: bool,
    /// Weight slices: a block that only takes slices of model weights at indices the same for
    /// every instance (a stacked model's layer `take(%Ws, %l)`) runs on the host once per
    /// weight and index for the whole mini-batch, its result a model weight of its own (so the
    /// products that read it share it, group by it and key by it) instead of a copy of the
    /// slice per invocation.
    pub weight_slices: bool,
    /// Deferred small launches: under depth scheduling, a group of invocations too small to
    /// amortize streaming its block's large shared weights (fewer rows than
    /// [`DEFER_BELOW_ROWS`]) waits for later invocations of the same block and shapes while other
    /// groups launch (NestedRNN's GRU cell: instances reach it at different depths, and launching
    /// each handful reads 6 MB of weights). When every group at a level could wait, the fullest
    /// launches.
    pub defer: bool,
    /// Products by a transposed concatenation of per-invocation matrices (MV-RNN's
    /// `W_M · [A; B]`) pack the matrices' rows straight into the GEMM instead of concatenating,
    /// transposing, multiplying and transposing back. Needs `fusion`.
    pub direct_matmul: bool,
    /// Gather views: an embedding lookup with one index per invocation yields references to the
    /// table's rows instead of a gathered copy (MV-RNN's per-word matrices: 64 KiB each). Needs
    /// `fusion` and `gather_fusion`.
    pub gather_views: bool,
    /// Sums of products (`dense(x, W) + dense(h, U)`) and products over a concatenation as one
    /// GEMM over the parts' rows where they lie ([`tumble_compile::Stage::DenseSum`]); off: each
    /// product alone, the concatenation copied, the sum a row program. Needs `fusion`.
    pub dense_sums: bool,
    /// Ragged batching: invocations of a block whose inputs differ only in their leading `?`
    /// length (sentences of different lengths) launch together; the block's row-wise segments
    /// run once over the rows of all of them, its mixing segments (attention, reductions over
    /// the rows) once per group of equal length (see [`tumble_compile::ragged`]). Off: only
    /// invocations of equal shapes launch together.
    pub ragged: bool,
    /// Rows per chunk of a ragged launch's row-wise segments (0: chosen per segment from its
    /// bytes per row, see `dfg/ragged.rs`). Chunks never change results, only cache use.
    pub ragged_chunk_rows: usize,
    /// The padding baseline: a ragged launch's row-wise segments run over every invocation padded
    /// to the launch's longest (the padding rows repeat an invocation's last row and are dropped),
    /// as a padded batch would; results do not change.
    pub ragged_padding: bool,
    /// Mixing segments of a form that needs no grouping by length (`ragged::MixingKernel`:
    /// attention, whole-row slices) run once over every invocation of a ragged launch instead of
    /// once per group of equal length; results agree within rounding (attention's sums run in
    /// another order).
    pub mixing_kernels: bool,
    /// Run the kernel plans' launches through the GPU executor on a device emulated in host memory
    /// (`tumble_cuda::Gpu::emulated`: its fixed kernels as loops, row programs on the host): the
    /// executor's stage choices, views, strides and copies checked by the CPU test suites.
    /// Results equal the CPU path's within rounding. Tests only; `tumble run --device cuda` takes
    /// a real GPU instead.
    pub emulated_device: bool,
    /// Keep the results of pure invocations of host values (a leaf on a token) for the job's later
    /// launches ([`memo`]): later mini-batches, and a serving session's later steps, take them
    /// instead of computing them again.
    pub job_memo: bool,
    /// Split off a concurrent element that waits for a computed value as a fiber, so the
    /// elements after it go on before the flush (`tumble_interp`'s machine `fibers`): a `@map`
    /// whose element tests a computed value (a mixture of experts routing each token) no
    /// longer advances one element per flush. Off where the program draws random numbers on
    /// the host (their order would change). Values are the same either way; an instance with
    /// several failing concurrent elements may report a later one's error than without.
    pub fibers: bool,
}

/// Rows below which a launch of a weight-bound block waits for more: with f32 weights a row costs
/// 2 FLOPs per 4 weight bytes, so a core doing ~100-200 GFLOP/s over weights streamed from L3 at
/// ~20-40 GB/s needs some 10-40 rows before arithmetic, not the weights, bounds the launch. Of 16
/// and 32, 32 was faster on NestedRNN (`bench/RESULTS.md`).
pub const DEFER_BELOW_ROWS: usize = 32;

/// Shared weight bytes (of a block's matrix products) from which a small launch is treated as
/// weight-bound. Measured on NestedRNN (`bench/RESULTS.md`): at 1.5 MiB (small) and 6 MiB (large)
/// of GRU weights, waiting for more invocations saved 15-27% of the run; no other zoo model's
/// launches changed.
pub const DEFER_WEIGHT_BYTES: usize = 256 << 10;

impl Options {
    /// The plan-level switches for the compiler's planner (`None`: no plans, `fusion` off).
    pub fn plan_options(&self) -> Option<tumble_compile::PlanOptions> {
        self.fusion.then_some(tumble_compile::PlanOptions {
            hfuse: self.hfuse,
            epilogue: self.epilogue,
            direct_matmul: self.direct_matmul,
            gather_views: self.gather_views && self.gather_fusion,
            dense_sums: self.dense_sums,
        })
    }

    /// These switches, less what a program compiled with `statics` and `plans` (`None`: no
    /// kernel plans) was made without: a model compiled without hoisting (`compile
    /// --no-statics`) runs with no hoisting at all, as `run --no-hoist` on its source does, not
    /// only without the static half; likewise phases, ghosts, duplication and each plan switch.
    /// A run's own switches can only turn more off.
    pub fn within_compiled(
        mut self,
        statics: &tumble_compile::StaticOptions,
        plans: Option<tumble_compile::PlanOptions>,
    ) -> Options {
        self.hoist &= statics.hoist;
        self.phases &= statics.phases;
        self.ghosts &= statics.ghosts;
        self.dup &= statics.dup;
        match plans {
            None => self.fusion = false,
            Some(p) => {
                self.hfuse &= p.hfuse;
                self.epilogue &= p.epilogue;
                self.direct_matmul &= p.direct_matmul;
                self.dense_sums &= p.dense_sums;
                self.gather_views &= p.gather_views;
            }
        }
        self
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scheduler: Scheduler::Inline,
            host_scalars: true,
            phases: true,
            hoist: true,
            ghosts: true,
            dup: true,
            fusion: true,
            row_cache: true,
            hfuse: true,
            gather_fusion: true,
            epilogue: true,
            lend_threads: true,
            sum_fusion: true,
            early_release: true,
            release_scan_bytes: RELEASE_SCAN_BYTES,
            locality_chunks: true,
            weight_groups: true,
            weight_slices: true,
            defer: true,
            direct_matmul: true,
            gather_views: true,
            dense_sums: true,
            ragged: true,
            ragged_chunk_rows: 0,
            ragged_padding: false,
            mixing_kernels: true,
            emulated_device: false,
            job_memo: true,
            fibers: true,
            threads: 1,
        }
    }
}

/// A failure of one instance of a mini-batch.
#[derive(Debug, Clone)]
pub struct InstanceError {
    /// Index of the instance within the mini-batch (`None` when not attributable).
    pub instance: Option<usize>,
    pub error: RunError,
}

/// Runs global `entry` for every instance (`args[i]`, drawing `random.db_uniform` from `rngs[i]`)
/// as one mini-batch. Returns the results in order, with lazy tensors materialized.
pub fn run_batch(
    program: &Program,
    reuse: &Reuse,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
) -> Result<(Vec<Value>, Profile), InstanceError> {
    let exec = std::sync::Arc::new(Executable::new(program, reuse, &opts));
    run_batch_on(program, reuse, &exec, entry, args, rngs, opts)
}

/// [`run_batch`] on a program already planned (`exec`, made by [`Executable::new`] with the same
/// switches as `opts`): several mini-batches of one job share its packed weights and kept
/// results ([`memo`]).
pub fn run_batch_on(
    program: &Program,
    reuse: &Reuse,
    exec: &std::sync::Arc<Executable>,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
) -> Result<(Vec<Value>, Profile), InstanceError> {
    run_batch_lent(program, reuse, exec, entry, args, rngs, opts, None, None)
}

/// [`run_batch_on`] with a trace slot per instance (`traces[i]` for `args[i]`; see [`trace`]):
/// an instance whose slot holds a trace is replayed instead of interpreted, one whose slot is
/// empty is recorded.
#[allow(clippy::too_many_arguments)]
pub fn run_batch_traced(
    program: &Program,
    reuse: &Reuse,
    exec: &std::sync::Arc<Executable>,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    traces: &[Option<&trace::TraceSlot>],
) -> Result<(Vec<Value>, Profile), InstanceError> {
    run_batch_lent(
        program,
        reuse,
        exec,
        entry,
        args,
        rngs,
        opts,
        None,
        Some(traces),
    )
}

/// [`run_batch`] on a program already planned (`exec`, made with the same switches as `opts`),
/// whose launches also use the threads that finished workers lend to the ones still running
/// (`lent`, read at each launch; see [`workers`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_batch_lent(
    program: &Program,
    reuse: &Reuse,
    exec: &std::sync::Arc<Executable>,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    lent: Option<&workers::Lending>,
    traces: Option<&[Option<&trace::TraceSlot>]>,
) -> Result<(Vec<Value>, Profile), InstanceError> {
    let t_start = Instant::now();
    let index = *program
        .global_index
        .get(entry)
        .ok_or_else(|| InstanceError {
            instance: None,
            error: RunError::new(format!("the module has no global `@{entry}`")),
        })?;
    let pool_hits = tumble_tensor::pool::hits();
    let _weights = gemm::WeightCache::enter(&exec.weights);
    let mut dfg = dfg::Dfg::new(program, reuse, exec.clone(), opts);
    dfg.lend_threads(lent);
    let n = args.len();
    let results = drive(program, index, args, rngs, opts, &mut dfg, traces)?;
    let mut out = Vec::with_capacity(n);
    for (i, r) in results.into_iter().enumerate() {
        let v = r.ok_or_else(|| InstanceError {
            instance: Some(i),
            error: RunError::new("internal: instance produced no result"),
        })?;
        out.push(materialize(v, &dfg).map_err(|error| InstanceError {
            instance: Some(i),
            error,
        })?);
    }
    dfg.profile.instances = n as u64;
    dfg.profile.mini_batches = 1;
    dfg.profile.time_total = t_start.elapsed();
    // Launches run on this thread (split parts aside, whose outputs the caller allocates).
    dfg.profile.pooled_outputs = tumble_tensor::pool::hits() - pool_hits;
    Ok((out, dfg.profile))
}

/// How one instance of a mini-batch runs in [`drive`]. (Unboxed: one per instance, in one
/// vector, most of them `Run`; a box would be one more allocation per instance.)
#[allow(clippy::large_enum_variant)]
enum Turn<'p, 't> {
    /// Replayed from its trace in its turns (up to each phase stop): its entry arguments, its
    /// context and how far the replay got.
    Replay(Vec<Value>, InstanceCtx, trace::Replaying<'t>),
    /// Replayed; its result is in.
    Replayed,
    /// On the evaluator, with what its first run recorded so far while it is being recorded.
    Run(Machine<'p>, Option<trace::Recording>),
}

impl<'p> Turn<'p, '_> {
    fn machine(&self) -> Option<&Machine<'p>> {
        match self {
            Turn::Run(m, _) => Some(m),
            _ => None,
        }
    }

    /// Hands over every value the instance holds between its turns (a machine's frames, a
    /// replay parked at a phase stop: its arguments and the results it has made so far).
    fn visit_values(&self, f: &mut dyn FnMut(&Value)) {
        match self {
            Turn::Run(m, _) => m.visit_values(f),
            Turn::Replay(args, _, replaying) => {
                args.iter().for_each(&mut *f);
                replaying.visit_values(f);
            }
            Turn::Replayed => {}
        }
    }
}

/// Whether machines split off concurrent elements that wait as fibers ([`Options::fibers`]):
/// unless the program draws random numbers on the host, whose order they would change.
pub(crate) fn fibers_for(exec: &Executable, opts: &Options) -> bool {
    opts.fibers && !exec.draws_on_host
}

/// Runs global `index` for every instance of a mini-batch on `dfg`: each instance's program until
/// it finishes or waits for a value, then a flush, until all are done (instances stopped at a
/// program phase wait for the others and start the next phase together). Returns each
/// instance's result, which may hold lazy values of `dfg`.
pub(crate) fn drive(
    program: &Program,
    index: u32,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    dfg: &mut dfg::Dfg,
    traces: Option<&[Option<&trace::TraceSlot>]>,
) -> Result<Vec<Option<Value>>, InstanceError> {
    let n = args.len();
    // Weight transforms once for the mini-batch: every instance has the same weights.
    let derived = match (program.derived.is_empty(), args.first()) {
        (false, Some(a)) => {
            Some(
                dfg.exec
                    .derived_args(program, a)
                    .map_err(|error| InstanceError {
                        instance: Some(0),
                        error,
                    })?,
            )
        }
        _ => None,
    };
    if let Some(a) = args.first() {
        dfg.note_weights(a, derived.as_deref().unwrap_or_default());
    }
    let mut results: Vec<Option<Value>> = vec![None; n];
    let fibers = fibers_for(&dfg.exec, &opts);
    // An instance with a trace is replayed in its turns, where its interpreted run would have
    // made the same calls (it never waits for a value: its turns are the first round of each
    // phase): the same nodes in the same order as with every instance interpreted. The others
    // run on machines, recorded on their first run where a slot waits for a trace.
    let slot = |i: usize| traces.and_then(|t| t.get(i).copied().flatten());
    let mut turns: Vec<Turn> = Vec::with_capacity(n);
    for (i, (a, rng)) in args.into_iter().zip(rngs).enumerate() {
        let ctx = InstanceCtx {
            rng,
            depth: 0,
            floor: 0,
            instance: i as u32,
            phase: 0,
            pending: 0,
        };
        let empty = match slot(i).map(|s| s.get()) {
            Some(Some(Some(t))) => {
                turns.push(Turn::Replay(a, ctx, trace::Replaying::new(t)));
                continue;
            }
            Some(None) => true,
            // No slot, or one holding "cannot be traced".
            _ => false,
        };
        // Traces are a speed-up, not a need: none is recorded past half the memory budget.
        let room = || tumble_limits::reserve(tumble_limits::in_use()).is_ok();
        let record =
            (empty && derived.is_none() && room()).then(|| trace::Recording::new(a.clone()));
        let mut m = Machine::new(program, ctx);
        m.set_fibers(fibers);
        m.start_derived(index, a, derived.as_deref())
            .map_err(|error| InstanceError {
                instance: Some(i),
                error,
            })?;
        turns.push(Turn::Run(m, record));
    }
    let mut running: Vec<usize> = (0..n).collect();
    let mut parked: Vec<usize> = Vec::new();
    while !running.is_empty() {
        let t0 = Instant::now();
        // What the instances' steps spend recording nodes, and launching them at once (the
        // eager scheduler), is counted in those parts, not in the program's.
        let inner_before = dfg.profile.inner();
        let mut still = Vec::new();
        for (k, &i) in running.iter().enumerate() {
            // A safe point every few instances (a round of many short programs never reaches
            // the evaluator's own).
            workers::safe_point(k + 1).map_err(|error| InstanceError {
                instance: None,
                error,
            })?;
            let (m, record) = match turns.get_mut(i) {
                Some(Turn::Run(m, record)) => (m, record),
                Some(Turn::Replay(a, ctx, replaying)) => {
                    let done = replaying
                        .resume(a, ctx, dfg, opts.phases)
                        .map_err(|error| InstanceError {
                            instance: Some(i),
                            error,
                        })?;
                    match done {
                        trace::Replayed::Phase => parked.push(i),
                        trace::Replayed::Done(v) => {
                            if let Some(r) = results.get_mut(i) {
                                *r = Some(v);
                            }
                            if let Some(turn) = turns.get_mut(i) {
                                *turn = Turn::Replayed;
                            }
                        }
                    }
                    continue;
                }
                Some(Turn::Replayed) | None => continue,
            };
            loop {
                let outcome = match record.take() {
                    // Its first run, through a recorder: a trace if it finishes without waiting
                    // for a value (stopping at phase boundaries on the way).
                    Some(mut recording) => {
                        let outcome = m.run(&mut trace::Recorder::new(dfg, &mut recording));
                        match &outcome {
                            Ok(Outcome::Phase) => {
                                recording.phase_stop();
                                *record = Some(recording);
                            }
                            Ok(Outcome::Yielded) => *record = Some(recording),
                            Ok(Outcome::Done(v)) => {
                                if let Some(s) = slot(i) {
                                    let _ = s.set(recording.finish(v));
                                }
                            }
                            _ => {
                                if let Some(s) = slot(i) {
                                    let _ = s.set(None);
                                }
                            }
                        }
                        outcome
                    }
                    None => m.run(dfg),
                };
                match outcome.map_err(|error| InstanceError {
                    instance: Some(i),
                    error,
                })? {
                    Outcome::Done(v) => {
                        if let Some(r) = results.get_mut(i) {
                            *r = Some(v);
                        }
                    }
                    Outcome::Blocked => still.push(i),
                    Outcome::Phase if opts.phases => parked.push(i),
                    // (A batch run sets no time slice: a yield only hands the thread back.)
                    Outcome::Phase | Outcome::Yielded => continue,
                }
                break;
            }
        }
        dfg.profile.time_program += t0
            .elapsed()
            .saturating_sub(dfg.profile.inner() - inner_before);
        if !still.is_empty() && !dfg.has_pending() {
            return Err(InstanceError {
                instance: still.first().copied(),
                error: RunError::new(
                    "internal: an instance waits for a value nothing will compute",
                ),
            });
        }
        if dfg.wants_scan() {
            let t_scan = Instant::now();
            // Early release: what the instances still hold stays; the rest can go once read.
            dfg.scan_claims(|f| {
                turns.iter().for_each(|t| t.visit_values(f));
                results.iter().flatten().for_each(&mut *f);
            });
            dfg.profile.time_outputs += t_scan.elapsed();
        }
        if let Err(error) = dfg.flush() {
            return Err(InstanceError {
                instance: dfg.failed_instance.map(|i| i as usize),
                error,
            });
        }
        running = still;
        if running.is_empty() && !parked.is_empty() {
            // Every unfinished instance is at the phase boundary and the graph is evaluated: the
            // next phase starts, at inline depth 0 for all of them.
            for &i in &parked {
                if let Some(Turn::Run(m, _)) = turns.get_mut(i) {
                    m.ctx.depth = 0;
                }
            }
            running = std::mem::take(&mut parked);
        }
    }
    dfg.profile.host_steps += turns
        .iter()
        .filter_map(Turn::machine)
        .map(Machine::steps)
        .sum::<u64>();
    Ok(results)
}

/// Replaces every lazy tensor inside `v` by its computed value. Iterative (results can be lists of
/// 100,000 elements). A tuple or constructor reached more than once (a result that shares a
/// subtree, `Rose(x, [t, t])` n levels deep: 2^n paths over n nodes) is rebuilt once and shared
/// again in the result: rebuilt per path, it took memory exponential in the depth, past any
/// budget.
pub(crate) fn materialize(v: Value, dfg: &dfg::Dfg) -> Result<Value, RunError> {
    use std::collections::HashMap;
    use std::rc::Rc;
    use tumble_interp::{AdtValue, TupleValue};
    enum Job {
        Visit(Value),
        BuildTuple(Rc<TupleValue>),
        BuildAdt(Rc<AdtValue>),
    }
    // Shared composites already rebuilt, by address; the originals are held by the jobs or by
    // `v`'s owners until the end, so an address is not reused meanwhile.
    let mut rebuilt: HashMap<*const (), Value> = HashMap::new();
    let mut jobs = vec![Job::Visit(v)];
    let mut held: Vec<Value> = Vec::new();
    let mut done: Vec<Value> = Vec::new();
    while let Some(job) = jobs.pop() {
        match job {
            Job::Visit(Value::Lazy(r)) => done
                .push(Value::Tensor(dfg.concrete(r)?.ok_or_else(|| {
                    RunError::new("internal: result not computed")
                })?)),
            Job::Visit(Value::Tuple(t)) => {
                if let Some(v) = rebuilt.get(&Rc::as_ptr(&t).cast::<()>()) {
                    done.push(v.clone());
                    continue;
                }
                // The build below its fields' visits, which run first.
                jobs.extend(t.0.iter().rev().cloned().map(Job::Visit));
                jobs.insert(jobs.len() - t.0.len(), Job::BuildTuple(t));
            }
            Job::Visit(Value::Adt(a)) => {
                if let Some(v) = rebuilt.get(&Rc::as_ptr(&a).cast::<()>()) {
                    done.push(v.clone());
                    continue;
                }
                jobs.extend(a.fields.iter().rev().cloned().map(Job::Visit));
                jobs.insert(jobs.len() - a.fields.len(), Job::BuildAdt(a));
            }
            Job::Visit(other) => done.push(other),
            Job::BuildTuple(t) => {
                let fields = done.drain(done.len().saturating_sub(t.0.len())..).collect();
                let v = Value::Tuple(Rc::new(TupleValue(fields)));
                if Rc::strong_count(&t) > 1 {
                    rebuilt.insert(Rc::as_ptr(&t).cast::<()>(), v.clone());
                    held.push(Value::Tuple(t));
                }
                done.push(v);
            }
            Job::BuildAdt(a) => {
                let fields = done
                    .drain(done.len().saturating_sub(a.fields.len())..)
                    .collect();
                let v = Value::Adt(Rc::new(AdtValue {
                    ctor: a.ctor,
                    fields,
                }));
                if Rc::strong_count(&a) > 1 {
                    rebuilt.insert(Rc::as_ptr(&a).cast::<()>(), v.clone());
                    held.push(Value::Adt(a));
                }
                done.push(v);
            }
        }
    }
    drop(held);
    done.pop()
        .ok_or_else(|| RunError::new("internal: materialize produced nothing"))
}
