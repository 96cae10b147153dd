//! `tumble run`: load a model, bind its weights, decode instances, evaluate each, write results.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use tumble_check::LoadOptions;
use tumble_compile::{CompileOptions, Compiled};
use tumble_interp::Value;
use tumble_io::{
    bind_params, encode_json, load_params_on, main_signature, read_instances_file, stage_jsonl,
    stage_params, summarize, IoError, TypeEnv,
};
use tumble_ir::{diag, Diagnostic, SourceMap};
use tumble_tensor::{Rng, Tensor};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The model, in the Relay text format.
    pub model: PathBuf,
    /// Instances: JSON Lines (one per line) or a JSON array, keyed by `@main` argument name.
    #[arg(long, short)]
    pub inputs: PathBuf,
    /// Weights: a safetensors file, a `.npy` file or a directory of `.npy` files. `@main` arguments
    /// named like a tensor in it are parameters shared by every instance.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Fill parameters missing from `--params` with seeded random values (normal, 1/sqrt(fan-in)).
    #[arg(long, value_name = "SEED")]
    pub random_params: Option<u64>,
    /// Write every parameter used (loaded or generated) to this safetensors file.
    #[arg(long, value_name = "FILE")]
    pub save_params: Option<PathBuf>,
    /// Seed of `random.db_uniform`; instance i draws from its own stream, so results do not depend
    /// on how instances are grouped.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write results (JSON Lines, one per instance, in input order); default (or `-`)
    /// stdout. Written atomically; through a symlink, the link's target is written.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// `json`: one JSON value per instance; `summary`: shapes and a few values, for reading.
    #[arg(long, value_enum, default_value_t = Format::Json)]
    pub format: Format,
    /// Which engine evaluates the model.
    #[arg(long, value_enum, default_value_t = Engine::Batched)]
    pub engine: Engine,
    /// Where the batched engine runs its kernel plans: `cuda` runs GEMM stages and row programs
    /// on the first NVIDIA GPU (kernels compiled at run time by NVRTC; gathers and other operators
    /// stay on the host), 2 mini-batches at once by default (`--workers`: one's host work
    /// overlaps the other's kernels). An error where no GPU, driver or NVRTC is found.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Instances per mini-batch (batched engine); default: all instances in equal mini-batches of
    /// at most 128, one or more per worker when each gets at least 32 (results do not depend on
    /// it).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub batch: Option<usize>,
    /// How the batched engine orders block invocations into launches.
    #[arg(long, value_enum, default_value_t = SchedulerArg::Inline)]
    pub scheduler: SchedulerArg,
    /// Print what the batched engine did (nodes, launches, batch sizes, time split) to stderr.
    #[arg(long)]
    pub profile: bool,
    /// Run the whole job N times in this process (batched engine) and keep the last run's outputs
    /// and profile: the warm figure of a long-lived process (caches, packed weights and allocator
    /// memory in place). Every run's outputs must be identical; `--profile` lists each run's time.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub repeat: u32,
    /// Do not run small scalar work on the host immediately (record it in the graph instead).
    #[arg(long)]
    pub no_host_scalars: bool,
    /// The compiler's switches (`--no-coarsen`, `--no-hoist`, ...).
    #[command(flatten)]
    pub compile: crate::switches::CompileSwitches,
    /// Interpret the prelude's `@hd`, `@tl`, `@zip`, `@rev` and `@concat` instead of running
    /// them as one native step each, and take the evaluator's other shortcuts step by step too
    /// (`@map`'s step as one constructor; block invocations of variables done where they are
    /// read).
    #[arg(long)]
    pub no_native_prelude: bool,
    /// No sum fusion: every `add` of two tensors in its own block (a child sum) is launched,
    /// instead of its rows being summed where a launch reads them.
    #[arg(long)]
    pub no_sum_fusion: bool,
    /// No early release: keep every launch's outputs until the mini-batch ends, instead of
    /// freeing each as soon as nothing reads or names it.
    #[arg(long)]
    pub no_early_release: bool,
    /// Early release scans the instances' values before a flush once N bytes of outputs were
    /// recorded since the last scan, and at least 512 per value the last scan walked (default
    /// 1048576). 0: before every flush, whatever the instances hold — a long loop that keeps its
    /// states then walks all of them at every flush, quadratic in its length. Results do not
    /// depend on it.
    #[arg(long, value_name = "N")]
    pub release_scan_bytes: Option<usize>,
    /// No locality chunks: launch every invocation of a block with per-invocation matrix weights
    /// at once instead of in chunks that fit in cache.
    #[arg(long)]
    pub no_locality_chunks: bool,
    /// No weight groups: invocations of a block whose matrix weight the program chose per
    /// instance (`if (..) { %Wa } else { %Wb }`) run as per-invocation weights (gathered, or in
    /// locality chunks) instead of in groups by the weight they pass, that weight passed once.
    #[arg(long)]
    pub no_weight_groups: bool,
    /// No weight slices: a slice of a model weight at an index every instance passes alike (a
    /// stacked model's `take(%Ws, %l)`) is computed per invocation, a copy each, instead of once
    /// per weight and index and then shared as a model weight.
    #[arg(long)]
    pub no_weight_slices: bool,
    /// No deferred launches: launch every group of ready invocations at its depth, even a
    /// handful that streams large shared weights for few rows.
    #[arg(long)]
    pub no_defer: bool,
    /// No direct products: multiply by a transposed concatenation of per-invocation matrices
    /// (MV-RNN's `W_M · [A; B]`) by concatenating, transposing and transposing back, instead of
    /// packing the matrices' rows straight into the GEMM.
    #[arg(long)]
    pub no_direct_matmul: bool,
    /// No gather views: an embedding lookup copies the rows it reads into a new batch instead of
    /// referring to them where they lie in the table.
    #[arg(long)]
    pub no_gather_views: bool,
    /// No sums of products as one GEMM: `dense(x, W) + dense(h, U)` runs as two products and a
    /// sum, `dense(concatenate((a, b)), W)` copies the concatenation first, instead of one
    /// product over the parts' rows where they lie.
    #[arg(long)]
    pub no_dense_sums: bool,
    /// No ragged batching: invocations of a block launch together only when their inputs have
    /// equal shapes, instead of whatever their leading `?` lengths (sentences of different
    /// lengths then batch only with sentences of their own length).
    #[arg(long)]
    pub no_ragged: bool,
    /// Compute every launch's invocations, instead of taking the results an earlier launch of
    /// the job computed for an invocation of the same block on the same host values (a leaf on a
    /// word seen before; see `tumble_runtime::Options::job_memo`).
    #[arg(long)]
    pub no_job_memo: bool,
    /// Keep a concurrent element (of a `@map`, `db.concurrent` or independent calls) whole when
    /// it waits for a computed value, instead of going on with the elements after it while it
    /// waits (results are the same).
    #[arg(long)]
    pub no_fibers: bool,
    /// Rows per chunk of a ragged launch's row-wise segments (default: about 16 MiB of each
    /// segment's results, at least 256 rows). Results do not depend on it.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub ragged_chunk_rows: Option<u32>,
    /// The padding baseline of ragged batching (what a hand-batched PyTorch program does): a
    /// ragged launch's row-wise segments (its GEMMs and row programs over tokens) run over every
    /// invocation padded to the launch's longest, instead of over the real rows only. Results do
    /// not change (padding rows are computed and dropped); the time shows what padding costs.
    /// Segments that mix rows run per group of equal length either way.
    #[arg(long, conflicts_with = "no_ragged")]
    pub ragged_padding: bool,
    /// Run every mixing segment of a ragged launch once per group of invocations of equal
    /// length, instead of attention as one kernel over every invocation's rows and a slice of
    /// whole rows (a sequence's first token) as ranges of rows where they lie.
    #[arg(long)]
    pub no_mixing_kernels: bool,
    /// Threads in all (default: $TUMBLE_NUM_THREADS, else the number of cores).
    #[arg(long, value_name = "N", value_parser = thread_arg)]
    pub threads: Option<usize>,
    /// Mini-batches run at once, sharing the threads (default: one per thread, as many as there
    /// are mini-batches; 1: one mini-batch after another, each with every thread). Results do not
    /// depend on it.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub workers: Option<usize>,
    /// Without `--batch`, keep a job of up to 128 instances in one mini-batch instead of
    /// splitting it into one per worker (each of at least 32 instances).
    #[arg(long)]
    pub no_split_batches: bool,
    /// No kernel plans: run every operator of a block through the batching rules and the reference
    /// kernels (no fused GEMM stages or row programs).
    #[arg(long)]
    pub no_fusion: bool,
    /// Compile fused row programs at every launch instead of once per block, stage and shapes.
    #[arg(long)]
    pub no_row_cache: bool,
    /// No horizontal fusion: denses that read the same rows with different weights (Q/K/V, gates)
    /// run as separate GEMMs instead of one over the concatenated weights.
    #[arg(long)]
    pub no_hfuse: bool,
    /// No gather fusion: stack launch inputs made of rows of earlier results into a new tensor
    /// instead of letting GEMMs and row programs read the rows where they lie.
    #[arg(long)]
    pub no_gather_fusion: bool,
    /// No epilogue fusion: store each GEMM's product whole, then run the row program that follows
    /// it as a separate pass (instead of on each block of rows inside the GEMM).
    #[arg(long)]
    pub no_epilogue: bool,
    /// No buffer pool: free each launch's outputs to the allocator instead of keeping large ones
    /// for the next launches of the same thread.
    #[arg(long)]
    pub no_buffer_pool: bool,
    /// Products with at most 8 output columns (classifiers) on the blocked GEMM too, instead of
    /// as dot products per output (also: TUMBLE_NO_NARROW_GEMM=1).
    #[arg(long)]
    pub no_narrow_gemm: bool,
    /// Products whose weight is used once (per-invocation weights, `nn.batch_matmul`:
    /// attention's Q·Kᵀ and P·V) as dot products even with 8 rows or more, instead of packing
    /// the weight for the GEMM kernel (also: TUMBLE_NO_SMALL_PRODUCT_GEMM=1).
    #[arg(long)]
    pub no_small_product_gemm: bool,
    /// Pack each GEMM weight at its first launch instead of before the run (start-up).
    #[arg(long)]
    pub no_prepack: bool,
    /// With several workers, a worker out of mini-batches keeps its threads to itself instead of
    /// lending them to the launches of the mini-batches still running.
    #[arg(long)]
    pub no_lend_threads: bool,
    /// The entry function (`@name` or `name`), bound to the same weights by argument name.
    /// Default: `@main`, or for a compiled model the entry it was compiled for.
    #[arg(long, value_parser = entry_arg)]
    pub entry: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Json,
    Summary,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Engine {
    /// The auto-batching runtime: a mini-batch of instances at once, static blocks batched.
    Batched,
    /// The reference interpreter: one instance at a time, plain-loop kernels (the oracle).
    Reference,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// This machine's processors.
    Cpu,
    /// The first NVIDIA GPU, through the CUDA driver and NVRTC (loaded at run time).
    Cuda,
    /// The GPU executor on a device emulated in host memory (slow): which stages a GPU would run
    /// and what they copy, on a machine without one (developers' profiles and tests).
    #[value(hide = true)]
    Emulated,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SchedulerArg {
    /// ACROBAT's inline depth (program order + `db.concurrent` fork/join).
    Inline,
    /// Dataflow depth: 1 + the deepest input.
    Depth,
    /// DyNet's agenda-based scheduling.
    Agenda,
    /// No batching: one launch per block invocation.
    Eager,
}

impl From<SchedulerArg> for tumble_runtime::Scheduler {
    fn from(s: SchedulerArg) -> Self {
        match s {
            SchedulerArg::Inline => tumble_runtime::Scheduler::Inline,
            SchedulerArg::Depth => tumble_runtime::Scheduler::Depth,
            SchedulerArg::Agenda => tumble_runtime::Scheduler::Agenda,
            SchedulerArg::Eager => tumble_runtime::Scheduler::Eager,
        }
    }
}

/// `--entry @name` (and `compile --entry`, `train --eval`): the global's name without `@`.
pub(crate) fn entry_arg(s: &str) -> Result<String, String> {
    let name = s.strip_prefix('@').unwrap_or(s);
    if name.is_empty() {
        return Err("an entry function name, e.g. `@main`".into());
    }
    Ok(name.to_string())
}

/// Mini-batches run at once on a GPU unless `--workers` says otherwise. On an H200 four workers
/// were 0.95x the time of one over the GPU suite (geometric mean) but slower at mini-batches of 8
/// (StackRNN 1.35x, NestedRNN 1.22x: four workers' launches wait on each other in one stream),
/// and two is what mini-batches of 64 used there (128 instances): bench/RESULTS.md.
const DEVICE_WORKERS: usize = 2;

/// A count that must be positive (`--workers`).
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// A thread count: at least 1, at most [`tumble_runtime::MAX_THREADS`] (`--threads`, and
/// `TUMBLE_NUM_THREADS`).
pub(crate) fn thread_arg(s: &str) -> Result<usize, String> {
    let n = at_least_one(s)?;
    if n > tumble_runtime::MAX_THREADS {
        return Err(format!(
            "{n} threads is more than the {} tumble can use",
            tumble_runtime::MAX_THREADS
        ));
    }
    Ok(n)
}

/// `--threads`, else `TUMBLE_NUM_THREADS` (a positive count, else an error), else the machine's
/// parallelism.
pub(crate) fn thread_count(flag: Option<usize>) -> Result<usize, Failure> {
    if let Some(n) = flag {
        return Ok(n);
    }
    if let Some(v) = std::env::var_os("TUMBLE_NUM_THREADS") {
        let text = v.to_string_lossy();
        return thread_arg(text.trim()).map_err(|e| {
            Failure::Message(format!(
                "TUMBLE_NUM_THREADS={}: {e} (unset it to use every core, or give --threads N)",
                tumble_io::echo(&text)
            ))
        });
    }
    Ok(std::thread::available_parallelism().map_or(1, usize::from))
}

/// The mini-batch size of a job of `instances` instances run by `workers` workers: `--batch`,
/// else [`tumble_runtime::default_batch`] (`--no-split-batches`: one mini-batch per 128
/// instances, not one per worker).
fn mini_batch(args: &RunArgs, instances: usize, workers: usize) -> usize {
    match args.batch {
        Some(b) => b.min(instances).max(1),
        None => tumble_runtime::default_batch(instances, workers, !args.no_split_batches),
    }
}

/// The static optimizations the switches leave on, for a job of `instances` instances.
fn static_options(
    args: &RunArgs,
    instances: usize,
    workers: usize,
) -> tumble_compile::StaticOptions {
    args.compile.statics(mini_batch(args, instances, workers))
}

/// Mini-batches run at once: `--workers`, else one per thread (on a GPU at most
/// [`DEVICE_WORKERS`]).
fn worker_count(args: &RunArgs, threads: usize) -> usize {
    match args.device {
        DeviceArg::Cuda | DeviceArg::Emulated => {
            args.workers.unwrap_or(threads.min(DEVICE_WORKERS))
        }
        DeviceArg::Cpu => args.workers.unwrap_or(threads),
    }
}

/// The runtime's switches from the flags.
fn runtime_options(args: &RunArgs, threads: usize) -> tumble_runtime::Options {
    tumble_runtime::Options {
        scheduler: args.scheduler.into(),
        host_scalars: !args.no_host_scalars,
        fusion: !args.no_fusion,
        row_cache: !args.no_row_cache,
        hfuse: !args.no_hfuse,
        gather_fusion: !args.no_gather_fusion,
        epilogue: !args.no_epilogue,
        lend_threads: !args.no_lend_threads,
        sum_fusion: !args.no_sum_fusion,
        early_release: !args.no_early_release,
        release_scan_bytes: args
            .release_scan_bytes
            .unwrap_or(tumble_runtime::RELEASE_SCAN_BYTES),
        locality_chunks: !args.no_locality_chunks,
        weight_groups: !args.no_weight_groups,
        weight_slices: !args.no_weight_slices,
        defer: !args.no_defer,
        direct_matmul: !args.no_direct_matmul,
        gather_views: !args.no_gather_views,
        dense_sums: !args.no_dense_sums,
        ragged: !args.no_ragged,
        ragged_chunk_rows: args.ragged_chunk_rows.map_or(0, |n| n as usize),
        ragged_padding: args.ragged_padding,
        mixing_kernels: !args.no_mixing_kernels,
        job_memo: !args.no_job_memo,
        fibers: !args.no_fibers,
        // `--device cuda` attaches a real GPU to the executable instead.
        emulated_device: false,
        phases: !args.compile.no_phases,
        hoist: !args.compile.no_hoist,
        ghosts: !args.compile.no_ghosts,
        dup: !args.compile.no_dup,
        threads,
    }
}

/// A stream of `random.db_uniform` draws for instance `i`, independent of batching.
impl RunArgs {
    /// The entry asked for: `--entry`, else `main`.
    pub fn entry(&self) -> &str {
        self.entry.as_deref().unwrap_or("main")
    }
}

pub fn instance_rng(seed: u64, i: usize) -> Rng {
    Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

pub fn run(args: &RunArgs, color: bool) -> ExitCode {
    let mut sources = SourceMap::new();
    match run_inner(args, &mut sources) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => report(f, &sources, color),
    }
}

pub(crate) fn report(f: Failure, sources: &SourceMap, color: bool) -> ExitCode {
    match f {
        Failure::Diags(ds) => {
            eprint!("{}", diag::render(&ds, sources, color));
            ExitCode::FAILURE
        }
        Failure::Message(m) => {
            eprintln!("error: {m}");
            ExitCode::FAILURE
        }
        Failure::Bug(inner) => {
            report(*inner, sources, color);
            eprintln!("note: {}", tumble_interp::RunError::BUG_NOTE);
            ExitCode::from(BUG_STATUS)
        }
    }
}

/// Where the program comes from: source text (checked, then compiled here) or a compiled model.
enum Front {
    Source(Box<tumble_check::TypedModule>),
    Compiled(Box<tumble_io::artifact::Loaded>),
}

/// An instance's output line, and a warning to print with it.
type Finished = (String, Option<String>);

pub(crate) enum Failure {
    Diags(Vec<Diagnostic>),
    Message(String),
    /// A bug in tumble (a broken internal invariant): reported as such, exit status 70.
    Bug(Box<Failure>),
}

/// The exit status of a bug in tumble (`EX_SOFTWARE`): scripts can tell it from a bad model or
/// bad input (status 1).
const BUG_STATUS: u8 = 70;

impl From<IoError> for Failure {
    fn from(e: IoError) -> Self {
        Failure::Message(e.to_string())
    }
}

fn run_inner(args: &RunArgs, sources: &mut SourceMap) -> Result<(), Failure> {
    // Refuse, before anything runs, an output that would replace one of the run's own files.
    let output = crate::files::output_path(args.output.as_deref());
    let mut reads: Vec<(&str, &std::path::Path)> = vec![
        ("the model", &args.model),
        ("the --inputs file", &args.inputs),
    ];
    if let Some(p) = &args.params {
        reads.push(("the --params file", p));
    }
    let mut writes: Vec<(&str, &std::path::Path)> = Vec::new();
    if let Some(p) = output {
        writes.push(("the output (-o)", p));
    }
    if let Some(p) = &args.save_params {
        writes.push(("the --save-params file", p));
    }
    crate::files::refuse_overwrites(&reads, &writes).map_err(Failure::Message)?;
    let t_start = std::time::Instant::now();
    let model = tumble_io::artifact::open_model(&args.model)
        .map_err(|e| Failure::Message(format!("cannot read {}: {e}", args.model.display())))?;
    let bytes = match model {
        tumble_io::artifact::ModelFile::Compiled => None,
        tumble_io::artifact::ModelFile::Bytes(b) => Some(b),
    };
    let front = if bytes
        .as_deref()
        .is_none_or(tumble_io::artifact::is_artifact)
    {
        Front::Compiled(Box::new(crate::compiled::load_for_run(
            args,
            bytes.as_deref(),
            sources,
        )?))
    } else {
        let bytes = bytes.unwrap_or_default();
        let text = crate::files::source_text(&args.model, bytes).map_err(Failure::Message)?;
        let name = args.model.display().to_string();
        let typed = tumble_check::load(sources, &name, &text, LoadOptions::default())
            .map_err(Failure::Diags)?;
        for w in &typed.warnings {
            eprint!("{}", diag::render(std::slice::from_ref(w), sources, false));
        }
        Front::Source(Box::new(typed))
    };
    let t_model = t_start.elapsed();
    let from_compiled = matches!(front, Front::Compiled(_));
    // A compiled model runs the entry it was compiled for (`--entry`, if given, must name it).
    let entry: String = match &front {
        Front::Compiled(c) => c.artifact.entry.clone(),
        Front::Source(_) => args.entry().to_string(),
    };
    let (main_params, ret_ty) = match &front {
        Front::Source(typed) => {
            let (params, ret) = main_signature(typed, &entry)?;
            tumble_io::returns_data(typed, &entry, &ret)?;
            (params, ret)
        }
        Front::Compiled(c) => (c.artifact.params.clone(), c.artifact.ret.clone()),
    };

    let raw = read_instances_file(&args.inputs)?;
    if raw.items.is_empty() {
        return Err(Failure::Message(format!(
            "{}: no instances (the file is empty, `[]`, or only blank lines): nothing to run; \
             give one JSON object per line, keyed by @{}'s arguments",
            args.inputs.display(),
            entry
        )));
    }
    if let Some(item) = raw.items.iter().find(|it| it.is_null()) {
        return Err(Failure::Message(format!(
            "instance at {} is `null`, not an instance: each instance is a JSON object keyed by \
             @{}'s arguments (remove the line if it is not meant as one)",
            item.location, entry
        )));
    }
    let threads = thread_count(args.threads)?;
    let file = match (&args.params, &front) {
        (None, Front::Compiled(c)) => c.weights.clone(),
        (Some(p), _) => {
            // A large file's tensors decoded on the run's threads.
            let loaded = load_params_on(p, threads)?;
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            loaded.tensors
        }
        (None, Front::Source(_)) => BTreeMap::new(),
    };
    let t_inputs = t_start.elapsed();
    let provided = raw.provided_args(&main_params, &file);
    let bound = bind_params(&main_params, &provided, &file, args.random_params)?;
    for w in &bound.warnings {
        eprintln!("warning: {w}");
    }
    // Written only once the run has succeeded and its output is written: a run that fails (bad
    // instances, the memory budget, an unwritable output, Ctrl-C) leaves no weights file behind.
    let saved_params: Option<(&std::path::Path, BTreeMap<String, Tensor>)> = args
        .save_params
        .as_deref()
        .map(|path| (path, bound.weight_tensors()));
    // Which @main arguments are model weights (the same for every instance).
    let weights: Vec<bool> = bound.weights_mask();
    let workers = worker_count(args, threads);
    let mut opts = runtime_options(args, threads);
    if let Front::Compiled(c) = &front {
        // The switches the file was compiled with hold for its runs: its plan switches, and the
        // runtime halves of the static optimizations it was compiled without; this run's
        // switches can only turn more off.
        let with = &c.artifact.compiled_with;
        opts = opts.within_compiled(&with.statics, with.plans);
    }
    let (program, reuse, plans, tables) = match front {
        Front::Source(typed) => {
            let compile_opts = match args.engine {
                Engine::Batched => CompileOptions {
                    lower: args.compile.lower(!args.no_native_prelude),
                    statics: Some(static_options(args, raw.items.len(), workers)),
                    plans: opts.plan_options(),
                },
                Engine::Reference => CompileOptions::reference(),
            };
            let Compiled {
                program,
                reuse,
                plans,
                ..
            } = tumble_compile::compile(&typed, &entry, &weights, compile_opts)
                .map_err(|e| Failure::Diags(vec![Diagnostic::error(e.span, e.message)]))?;
            (program, reuse, plans, typed.tables)
        }
        Front::Compiled(c) => {
            let c = *c;
            c.artifact
                .check_binding(&weights)
                .map_err(Failure::Message)?;
            let mut a = c.artifact;
            // Mini-batches too small for block merging run the program compiled without it, as
            // a run of the source would.
            let merge = static_options(args, raw.items.len(), workers).merge;
            if let (false, Some(u)) = (merge, a.unmerged.take()) {
                a.compiled = *u;
            }
            // The stored plans were made for the switches it was compiled with; other plan
            // switches on this run plan again (cheap: no parsing, checking or passes).
            let c = a.compiled;
            let plans = if opts.plan_options() == a.compiled_with.plans {
                c.plans
            } else {
                opts.plan_options()
                    .map(|p| tumble_compile::plan_program(&c.program, p))
                    .unwrap_or_default()
            };
            (c.program, c.reuse, plans, a.tables)
        }
    };
    let env = TypeEnv::from_parts(&tables, &program);
    let t_ready = t_start.elapsed();
    let instance_args = bound.instance_args();
    let location = |i: usize| {
        raw.items.get(i).map_or_else(
            || format!("instance {i}"),
            |it| format!("instance at {}", it.location),
        )
    };
    let run_error = |i: usize, e: tumble_interp::RunError| {
        let message = format!("{}: {}", location(i), e.message);
        let internal = e.internal;
        let failure = match e.span {
            Some(span) => {
                let mut d = Diagnostic::error(span, message);
                for (k, site) in e.trace.iter().enumerate().filter(|(_, s)| **s != span) {
                    d = d.with_secondary(*site, format!("called from here ({})", k + 1));
                }
                if e.trace.len() == tumble_interp::machine::MAX_TRACE {
                    d = d.with_note(format!(
                        "only the {} innermost calls are shown",
                        tumble_interp::machine::MAX_TRACE
                    ));
                }
                Failure::Diags(vec![d])
            }
            None => Failure::Message(message),
        };
        if internal {
            Failure::Bug(Box::new(failure))
        } else {
            failure
        }
    };
    let load = |i: usize| -> Result<Vec<Value>, Failure> {
        Ok(bound.assemble(raw.decode_one(i, &env, &instance_args)?)?)
    };
    // One output line per instance, and a warning to print with it.
    let finish = |i: usize, result: Value| -> Result<Finished, Failure> {
        Ok(match args.format {
            Format::Json => {
                let enc = encode_json(&result, &ret_ty, &env)?;
                let warning = enc.warning().map(|w| format!("{}: {w}", location(i)));
                (enc.json, warning)
            }
            Format::Summary => (
                format!("{}: {}", location(i), summarize(&result, &ret_ty, &env)),
                None,
            ),
        })
    };
    let n = raw.items.len();
    if matches!(args.engine, Engine::Reference) && args.device != DeviceArg::Cpu {
        return Err(Failure::Message(
            "--device cuda runs the batched engine; the reference engine runs on the CPU only"
                .into(),
        ));
    }
    let finished: Vec<Finished> = match args.engine {
        Engine::Reference => {
            // The reference engine runs each instance once and alone: the batched engine's
            // options have nothing to act on (said, not ignored silently).
            let unused: Vec<&str> = [
                (args.profile, "--profile"),
                (args.repeat > 1, "--repeat"),
                (args.batch.is_some(), "--batch"),
                (args.workers.is_some(), "--workers"),
            ]
            .into_iter()
            .filter_map(|(given, flag)| given.then_some(flag))
            .collect();
            if !unused.is_empty() {
                let verb = if unused.len() == 1 { "acts" } else { "act" };
                eprintln!(
                    "warning: {} {verb} on the batched engine only; --engine reference runs each \
                     instance once, alone",
                    unused.join(", ")
                );
            }
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                let mut rng = instance_rng(args.seed, i);
                let result = tumble_interp::run(&program, &entry, load(i)?, &mut rng)
                    .map_err(|e| run_error(i, e))?;
                out.push(finish(i, result)?);
            }
            out
        }
        Engine::Batched => {
            tumble_tensor::pool::set_enabled(!args.no_buffer_pool);
            if args.no_narrow_gemm {
                tumble_runtime::set_narrow_products(false);
            }
            if args.no_small_product_gemm {
                tumble_runtime::set_small_product_gemm(false);
            }
            // Planned once for every repeat: the warm runs reuse plans, compiled row programs
            // and packed weights, as a long-lived process would.
            let mut exec = tumble_runtime::Executable::with_plans(&program, &reuse, plans, &opts);
            if args.device != DeviceArg::Cpu {
                let gpu = match args.device {
                    DeviceArg::Emulated => tumble_cuda::Gpu::emulated(),
                    _ => tumble_cuda::Gpu::open(0)
                        .map_err(|e| Failure::Message(format!("--device cuda: {e}")))?,
                };
                if args.profile {
                    eprintln!("device: {}", gpu.describe());
                }
                exec = exec.with_device(gpu);
            }
            let exec = std::sync::Arc::new(exec);
            // Weights are constants of the program: packed for the GEMM before the first run,
            // as part of start-up.
            let t_pack = std::time::Instant::now();
            let prepacked = match args.no_prepack {
                true => 0,
                false => exec.prepack_weights(&program, &bound.entry_params(), threads),
            };
            let t_pack = t_pack.elapsed();
            let job = tumble_runtime::Job {
                program: &program,
                reuse: &reuse,
                entry: &entry,
                opts,
                instances: n,
                batch: mini_batch(args, n, workers),
                // A GPU's workers queue their launches on one stream: a few overlap one
                // mini-batch's host work (its program, gathers, waits) with another's kernels;
                // more would wait on each other.
                workers,
                exec: Some(&exec),
                worker_stack: crate::WORK_STACK_BYTES,
            };
            let mut walls = Vec::with_capacity(args.repeat as usize);
            let mut computes = Vec::with_capacity(args.repeat as usize);
            let mut last: Option<(Vec<Finished>, tumble_runtime::Profile)> = None;
            // The first run's parts beside the last's: a process's first run pays what later ones
            // find in place (fresh pages for its activations, the buffer pool filling).
            let mut first_split: Option<String> = None;
            for _ in 0..args.repeat {
                // Each run is the whole job again: plans and packed weights stay, as in a
                // long-lived process, but no results kept by the run before (a warm run would
                // otherwise take every leaf's results from it).
                exec.forget_kept_results();
                let (out, profile) =
                    tumble_runtime::run_batches(&job, load, |i| instance_rng(args.seed, i), finish)
                        .map_err(|e| match e {
                            tumble_runtime::JobError::Instance(_, f) => f,
                            tumble_runtime::JobError::Run { instance, error } => {
                                run_error(instance, error)
                            }
                        })?;
                walls.push(profile.wall().as_secs_f64() * 1e3);
                if let ([first], true) = (walls.as_slice(), args.profile && args.repeat > 1) {
                    first_split = Some(format!("total {first:.3} = {}", profile.run_split()));
                }
                // The run without decoding its instances (JSON values into tumble values), as the
                // benchmark peers are timed: workers decode their shares at once, so their
                // summed decoding time is spread over them.
                let decode =
                    profile.time_decode.as_secs_f64() * 1e3 / profile.workers.max(1) as f64;
                computes.push((walls.last().copied().unwrap_or(0.0) - decode).max(0.0));
                if let Some((prev, _)) = &last {
                    if prev != &out {
                        return Err(Failure::Message(format!(
                            "--repeat: run {} gave other outputs than run {} (nondeterminism; please report it)",
                            walls.len(),
                            walls.len() - 1
                        )));
                    }
                }
                last = Some((out, profile));
            }
            let Some((out, profile)) = last else {
                return Err(Failure::Message("--repeat: no run".into()));
            };
            if args.profile {
                eprintln!(
                    "start-up: model {} {:.1} ms, inputs and weights read {:.1} ms, bound and \
                     compiled {:.1} ms, {prepacked} weights packed {:.1} ms (ready after {:.1} ms)",
                    if from_compiled {
                        "read"
                    } else {
                        "parsed and checked"
                    },
                    t_model.as_secs_f64() * 1e3,
                    (t_inputs - t_model).as_secs_f64() * 1e3,
                    (t_ready - t_inputs).as_secs_f64() * 1e3,
                    t_pack.as_secs_f64() * 1e3,
                    (t_ready + t_pack).as_secs_f64() * 1e3
                );
                eprint!("{profile}");
                if let Some(first) = &first_split {
                    eprintln!("first run (ms; the profile above is the last run's): {first}");
                }
                if walls.len() > 1 {
                    for (what, runs) in [("", &walls), (" without decoding inputs", &computes)] {
                        let list: Vec<String> = runs.iter().map(|w| format!("{w:.3}")).collect();
                        let mut warm = runs[1..].to_vec();
                        warm.sort_by(f64::total_cmp);
                        eprintln!(
                            "repeats{what} (ms per run): {}; warm median {:.3}",
                            list.join(" "),
                            warm[warm.len() / 2]
                        );
                    }
                }
            }
            out
        }
    };
    let mut lines = Vec::with_capacity(finished.len());
    for (line, warning) in finished {
        if let Some(w) = warning {
            eprintln!("warning: {w}");
        }
        lines.push(line);
    }
    // Both files are written in full before either is moved into place: a failure writing the
    // second (a full disk) leaves neither.
    let params_file = match &saved_params {
        Some((params, all)) => Some(stage_params(params, all)?),
        None => None,
    };
    match output {
        Some(path) => {
            let (results_file, _) =
                stage_jsonl(path, lines.into_iter().map(Ok::<String, IoError>))?;
            results_file.commit()?;
        }
        None => {
            let mut out = std::io::stdout().lock();
            let written = lines
                .iter()
                .try_for_each(|l| writeln!(out, "{l}"))
                .and_then(|()| out.flush());
            match written {
                // A closed pipe (e.g. `| head`) is not an error worth reporting.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(Failure::Message(format!(
                        "cannot write the results to standard output: {e}"
                    )));
                }
                _ => {}
            }
        }
    }
    if let Some(f) = params_file {
        f.commit()?;
    }
    Ok(())
}
