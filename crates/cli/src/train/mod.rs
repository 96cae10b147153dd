//! `tumble grad` and `tumble train`: the batched backward pass ([`tumble_runtime::backward`])
//! from the command line — the gradient of the sum of `@main`'s outputs over a file of
//! instances, and mini-batch training of the float parameters on it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use tumble_check::{LoadOptions, TypedModule};
use tumble_compile::{LowerOptions, Program, ReuseAnalysis};
use tumble_interp::Value;
use tumble_io::{
    bind_params, load_params, main_signature, read_instances_file, save_params, Binding,
    BoundParams, RawInstances, TypeEnv,
};
use tumble_ir::{diag, Diagnostic, SourceMap, Ty};
use tumble_runtime::backward::{GradOptions, ParamGrad};
use tumble_runtime::optim::{self, Step};
use tumble_runtime::trace::TraceCache;
use tumble_runtime::Options;
use tumble_tensor::{Rng, Tensor};

use crate::run::{instance_rng, Failure};

mod workers;

/// Where the model's weights come from (shared by `grad` and `train`).
#[derive(clap::Args, Clone)]
pub struct Weights {
    /// Weights: a safetensors file, a `.npy` file or a directory of `.npy` files.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Fill parameters missing from `--params` with seeded random values.
    #[arg(long, value_name = "SEED")]
    pub random_params: Option<u64>,
    /// Threads for kernels (default: $TUMBLE_NUM_THREADS, else the number of cores).
    #[arg(long, value_name = "N", value_parser = crate::run::thread_arg)]
    pub threads: Option<usize>,
    /// Threads each mini-batch's instances are split among, each differentiating its part with
    /// `threads / workers` kernel threads; the parts' gradients are summed (the same gradient,
    /// its float sums in another order: the last bits depend on the count, not on the run).
    /// Default: one per thread, at most one per instance of a mini-batch.
    #[arg(long, value_name = "N", value_parser = crate::run::at_least_one)]
    pub workers: Option<usize>,
    /// Seed of `random.db_uniform` (instance i draws from its own stream) and, in `train`, of
    /// the shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compute f32 `nn.dense` gradients with the operator's reference vjp (plain loops) instead
    /// of the SIMD GEMM.
    #[arg(long)]
    pub no_backward_gemm: bool,
    /// Run the backward's recomputed operators and elementwise/layout gradients with the
    /// operator table's reference rules (f64) instead of the f32 SIMD fast paths.
    #[arg(long)]
    pub no_backward_fast: bool,
    /// Run the forward's fused kernel plans and recompute each launch's operators in the
    /// backward, instead of running the forward operator by operator and keeping its values.
    #[arg(long)]
    pub no_backward_keep: bool,
    /// Sum each parameter's `nn.dense` gradient launch by launch (one GEMM and one add of the
    /// whole weight-sized gradient per launch) instead of by one GEMM over every launch's rows
    /// when the backward pass ends.
    #[arg(long)]
    pub no_deferred_weight_grads: bool,
    /// Record every `add` of two computed tensors as a launch of its own, forward and backward,
    /// instead of keeping it a deferred sum (added where a launch reads it) whose gradient goes
    /// to its terms.
    #[arg(long)]
    pub no_backward_sums: bool,
}

#[derive(clap::Args)]
pub struct GradArgs {
    /// The model, in the Relay text format; `@main` must return a float scalar.
    pub model: PathBuf,
    #[command(flatten)]
    pub weights: Weights,
    /// Instances: JSON Lines, keyed by `@main` argument name.
    #[arg(long, short)]
    pub inputs: PathBuf,
    /// Instances per mini-batch; default: all at once. The gradient does not depend on it.
    #[arg(long, value_name = "N", value_parser = crate::run::at_least_one)]
    pub batch: Option<usize>,
    /// The gradients: a safetensors file, one tensor per float parameter (its name, dtype and
    /// shape). Written atomically.
    #[arg(long, short)]
    pub output: PathBuf,
    /// Use the reference engine (a tape per instance) instead of the batched backward.
    #[arg(long)]
    pub reference: bool,
    /// Print the backward's counters and time split to stderr.
    #[arg(long)]
    pub profile: bool,
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq, Debug)]
pub enum Optimizer {
    Sgd,
    Adagrad,
    Adam,
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The model; `@main` returns each instance's loss (a float scalar).
    pub model: PathBuf,
    #[command(flatten)]
    pub weights: Weights,
    /// Training instances (JSON Lines).
    #[arg(long)]
    pub train: PathBuf,
    /// Development instances: after each epoch their mean loss (and `--eval`) is reported and
    /// the best weights on them are kept.
    #[arg(long)]
    pub dev: Option<PathBuf>,
    #[arg(long, default_value_t = 1, value_parser = crate::run::at_least_one)]
    pub epochs: usize,
    /// Instances per mini-batch (one optimizer step each).
    #[arg(long, default_value_t = 20, value_parser = crate::run::at_least_one)]
    pub batch: usize,
    #[arg(long, value_enum, default_value_t = Optimizer::Adagrad)]
    pub optimizer: Optimizer,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,
    /// L2 weight decay, added to each gradient as `decay * w`.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// A global with `@main`'s parameters returning a float scalar per instance (e.g.
    /// `@accuracy`): its mean on dev is reported after each epoch and picks the best weights
    /// (higher is better); without it the lowest dev loss does.
    #[arg(long, value_name = "@NAME")]
    pub eval: Option<String>,
    /// Where the (best) weights are written, atomically, after every epoch that improves them:
    /// an interrupted run leaves the last complete checkpoint.
    #[arg(long, short)]
    pub output: PathBuf,
    /// No progress bar (one line per epoch only).
    #[arg(long)]
    pub quiet: bool,
    /// Interpret every instance's program at every epoch, instead of replaying the block
    /// invocations its first run recorded (instances whose control flow depends only on their
    /// own data: the same graph, the same bits, without the host program's steps).
    #[arg(long)]
    pub no_trace_replay: bool,
}

/// An entry function compiled for the batched runtime with the weights bound.
#[derive(Clone)]
struct Compiled {
    entry: String,
    program: std::sync::Arc<Program>,
    reuse: std::sync::Arc<ReuseAnalysis>,
    bound: BoundParams,
}

fn load_typed(path: &Path, sources: &mut SourceMap) -> Result<TypedModule, Failure> {
    let text = crate::files::read_source(path).map_err(Failure::Message)?;
    let name = path.display().to_string();
    let typed = tumble_check::load(sources, &name, &text, LoadOptions::default())
        .map_err(Failure::Diags)?;
    for w in &typed.warnings {
        eprint!("{}", diag::render(std::slice::from_ref(w), sources, false));
    }
    Ok(typed)
}

/// `@entry` must return a float scalar: shape `()` or one element.
fn check_scalar(typed: &TypedModule, entry: &str, ret: &Ty, why: &str) -> Result<(), Failure> {
    let ok = match ret.as_tensor() {
        Some((dims, dtype)) => {
            dtype.is_float() && dims.iter().all(|d| d.known().is_some_and(|n| n == 1))
        }
        None => false,
    };
    if ok {
        return Ok(());
    }
    let message = format!(
        "{why} needs `@{entry}` to return a float scalar (shape () or one element), but it returns {ret}"
    );
    match typed.module.defs().find(|d| d.name.name == entry) {
        Some(def) => Err(Failure::Diags(vec![Diagnostic::error(
            def.name.span,
            message,
        )
        .with_note(
            "wrap the model's output in a loss, e.g. `sum(...)` or a cross-entropy",
        )])),
        None => Err(Failure::Message(message)),
    }
}

fn entry_name(s: &str) -> &str {
    s.strip_prefix('@').unwrap_or(s)
}

/// Compiles `entry` with the parameters in `file` (plus random ones from `random`) bound; the
/// instances `raw` provide the other arguments.
fn compile(
    typed: &TypedModule,
    entry: &str,
    raw: &RawInstances,
    file: &BTreeMap<String, Tensor>,
    random: Option<u64>,
) -> Result<Compiled, Failure> {
    let (params, _) = main_signature(typed, entry)?;
    let provided = raw.provided_args(&params, file);
    let bound = bind_params(&params, &provided, file, random)?;
    for w in &bound.warnings {
        if !w.contains("not an argument") {
            eprintln!("warning: {w}");
        }
    }
    let weights: Vec<bool> = bound.weights_mask();
    // The one pipeline, as `run` compiles; the backward plans per mini-batch itself.
    let compiled = tumble_compile::compile(
        typed,
        entry,
        &weights,
        tumble_compile::CompileOptions {
            plans: None,
            // Gradients do not flow through weight transforms computed once per run.
            statics: Some(tumble_compile::StaticOptions {
                derive: false,
                ..tumble_compile::StaticOptions::all()
            }),
            ..tumble_compile::CompileOptions::batched()
        },
    )
    .map_err(|e| Failure::Diags(vec![Diagnostic::error(e.span, e.message)]))?;
    let (program, reuse) = (compiled.program, compiled.reuse);
    Ok(Compiled {
        entry: entry.to_string(),
        program: std::sync::Arc::new(program),
        reuse: std::sync::Arc::new(reuse),
        bound,
    })
}

impl Compiled {
    /// The float parameters: (name, tensor), in argument order.
    fn float_params(&self) -> Vec<(String, Tensor)> {
        self.bound
            .args
            .iter()
            .filter_map(|a| match &a.binding {
                Binding::Param(t) if t.dtype().is_float() => Some((a.name.clone(), t.clone())),
                _ => None,
            })
            .collect()
    }

    /// Every parameter, by name.
    fn all_params(&self) -> BTreeMap<String, Tensor> {
        self.bound.weight_tensors()
    }

    /// The bound tensor of parameter `name` (the optimizer updates it in place).
    fn param_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        self.bound
            .args
            .iter_mut()
            .find(|a| a.name == name)
            .and_then(|a| match &mut a.binding {
                Binding::Param(t) => Some(t),
                _ => None,
            })
    }

    /// Rebinds the parameters named in `w` to its tensors.
    fn rebind(&mut self, w: &BTreeMap<String, Tensor>) {
        for a in &mut self.bound.args {
            if let (Binding::Param(t), Some(new)) = (&mut a.binding, w.get(&a.name)) {
                *t = new.clone();
            }
        }
    }

    /// Lets go of the bound tensors of parameters `names` (a training worker between steps: the
    /// optimizer updates weights in place only where it holds the one reference).
    fn release(&mut self, names: &[String]) {
        for a in &mut self.bound.args {
            if let Binding::Param(t) = &mut a.binding {
                if names.contains(&a.name) {
                    *t = Tensor::scalar_f32(0.0);
                }
            }
        }
    }

    /// The instance arguments of every instance of `raw`, decoded once.
    fn decode(&self, typed: &TypedModule, raw: &RawInstances) -> Result<Vec<Vec<Value>>, Failure> {
        let env = TypeEnv::new(typed, &self.program);
        let args = self.bound.instance_args();
        (0..raw.items.len())
            .map(|i| raw.decode_one(i, &env, &args).map_err(Failure::from))
            .collect()
    }

    /// Decodes the instances `which` of `raw` not decoded yet into `cache` (indexed like `raw`;
    /// `done` says which are): a training worker decodes only the instances its parts bring.
    fn decode_some(
        &self,
        typed: &TypedModule,
        raw: &RawInstances,
        which: &[usize],
        cache: &mut [Vec<Value>],
        done: &mut [bool],
    ) -> Result<(), Failure> {
        if which.iter().all(|&i| done.get(i) == Some(&true)) {
            return Ok(());
        }
        let env = TypeEnv::new(typed, &self.program);
        let args = self.bound.instance_args();
        for &i in which {
            if let (Some(slot), Some(d)) = (cache.get_mut(i), done.get_mut(i)) {
                if !*d {
                    *slot = raw.decode_one(i, &env, &args).map_err(Failure::from)?;
                    *d = true;
                }
            }
        }
        Ok(())
    }

    /// Where instance `i` is: its file (`--train` or `--dev` can fail alike) and line.
    fn location(raw: &RawInstances, i: usize) -> String {
        raw.items.get(i).map_or_else(
            || format!("{}: instance {i}", raw.source_name),
            |it| format!("{}: instance at {}", raw.source_name, it.location),
        )
    }

    fn run_error(raw: &RawInstances, i: usize, e: tumble_interp::RunError) -> Failure {
        let message = format!("{}: {}", Self::location(raw, i), e.message);
        match e.span {
            Some(span) => Failure::Diags(vec![Diagnostic::error(span, message)]),
            None => Failure::Message(message),
        }
    }

    /// Each instance's output of the entry (a float scalar), in mini-batches of `batch`; with
    /// `traces` (one slot per instance of `decoded`), each instance's first run is recorded and
    /// the later ones replay it (the dev set, evaluated after every epoch).
    fn outputs(
        &self,
        raw: &RawInstances,
        decoded: &[Vec<Value>],
        batch: usize,
        opts: Options,
        seed: u64,
        traces: Option<&TraceCache>,
    ) -> Result<Vec<f64>, Failure> {
        let mut out = Vec::with_capacity(decoded.len());
        for (c, chunk) in decoded.chunks(batch.max(1)).enumerate() {
            let base = c * batch.max(1);
            let args = chunk
                .iter()
                .map(|a| self.bound.assemble(a.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            let rngs = (0..chunk.len())
                .map(|k| instance_rng(seed, base + k))
                .collect();
            // Without a cache every slot is absent: nothing is recorded or replayed.
            let which: Vec<usize> = (base..base + chunk.len()).collect();
            let slots = traces.map_or_else(|| vec![None; chunk.len()], |c| c.slots(&which));
            let exec = std::sync::Arc::new(tumble_runtime::Executable::new(
                &self.program,
                &self.reuse,
                &opts,
            ));
            let ran = tumble_runtime::run_batch_traced(
                &self.program,
                &self.reuse,
                &exec,
                &self.entry,
                args,
                rngs,
                opts,
                &slots,
            );
            let (vals, _) =
                ran.map_err(|e| Self::run_error(raw, base + e.instance.unwrap_or(0), e.error))?;
            for (k, v) in vals.iter().enumerate() {
                let t = v.as_tensor().ok_or_else(|| {
                    Failure::Message(format!(
                        "{}: @{} returned {}, not a float scalar",
                        Self::location(raw, base + k),
                        self.entry,
                        v.kind()
                    ))
                })?;
                out.push(tumble_interp::tape::scalar_loss(t).map_err(|m| {
                    Failure::Message(format!("{}: {m}", Self::location(raw, base + k)))
                })?);
            }
        }
        Ok(out)
    }

    /// The gradient of the sum of the outputs of instances `which` (indices into `decoded`),
    /// one mini-batch; returns the outputs and one gradient per float parameter (`params`).
    #[allow(clippy::too_many_arguments)]
    fn grad(
        &self,
        raw: &RawInstances,
        decoded: &[Vec<Value>],
        which: &[usize],
        params: &[Tensor],
        opts: Options,
        gopts: GradOptions,
        seed: u64,
        traces: Option<&TraceCache>,
        stats: &mut tumble_runtime::backward::BackwardStats,
    ) -> Result<(Vec<f64>, Vec<Option<ParamGrad>>), Failure> {
        let mut args = Vec::with_capacity(which.len());
        for &i in which {
            let inst = decoded
                .get(i)
                .ok_or_else(|| Failure::Message(format!("internal: no instance {i}")))?;
            args.push(self.bound.assemble(inst.clone())?);
        }
        let rngs = which.iter().map(|&i| instance_rng(seed, i)).collect();
        let slots = traces.map(|c| c.slots(which));
        let g = tumble_runtime::backward::grad_batch_traced(
            &self.program,
            &self.reuse,
            &self.entry,
            args,
            rngs,
            opts,
            gopts,
            params,
            slots.as_deref(),
        )
        .map_err(|e| {
            let i = e.instance.and_then(|k| which.get(k)).copied().unwrap_or(0);
            Self::run_error(raw, i, e.error)
        })?;
        stats.add(&g.stats);
        Ok((g.losses, g.grads))
    }
}

fn report(result: Result<(), Failure>, sources: &SourceMap, color: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => crate::run::report(f, sources, color),
    }
}

fn options(threads: Option<usize>) -> Result<Options, Failure> {
    Ok(Options {
        threads: crate::run::thread_count(threads)?,
        ..Options::default()
    })
}

/// Workers each mini-batch of `batch` is split among (see `workers`): `--workers`, else one per
/// thread, never more than the threads or the instances of a mini-batch.
fn worker_count(w: &Weights, threads: usize, batch: usize) -> usize {
    w.workers.unwrap_or(threads).min(threads).min(batch).max(1)
}

fn gopts(w: &Weights) -> GradOptions {
    GradOptions {
        gemm: !w.no_backward_gemm,
        fast: !w.no_backward_fast,
        keep: !w.no_backward_keep,
        defer_dense: !w.no_deferred_weight_grads,
        sums: !w.no_backward_sums,
    }
}

fn read_weights(w: &Weights) -> Result<BTreeMap<String, Tensor>, Failure> {
    match &w.params {
        Some(p) => {
            let loaded = load_params(p)?;
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            Ok(loaded.tensors)
        }
        None => Ok(BTreeMap::new()),
    }
}

fn read_raw(path: &Path, what: &str) -> Result<RawInstances, Failure> {
    let raw = read_instances_file(path)?;
    if raw.items.is_empty() {
        return Err(Failure::Message(format!(
            "{}: no instances in the {what} file",
            path.display()
        )));
    }
    Ok(raw)
}

pub fn grad(args: &GradArgs, color: bool) -> ExitCode {
    let mut sources = SourceMap::new();
    let r = grad_inner(args, &mut sources);
    if let Some(stop) = tumble_limits::halt_seen() {
        // The run stopped where it was (Ctrl-C, `--timeout`): no instance is to blame.
        eprintln!("{stop}: nothing was written to {}", args.output.display());
        return ExitCode::FAILURE;
    }
    report(r, &sources, color)
}

/// The first of `weights` that holds a NaN or an infinite value.
fn non_finite_param(weights: &BTreeMap<String, Tensor>) -> Option<&str> {
    weights
        .iter()
        .find(|(_, t)| {
            t.as_f32()
                .map(|v| v.iter().any(|x| !x.is_finite()))
                .or_else(|| {
                    t.as_slice::<f64>()
                        .map(|v| v.iter().any(|x| !x.is_finite()))
                })
                .unwrap_or(false)
        })
        .map(|(n, _)| n.as_str())
}

fn grad_inner(args: &GradArgs, sources: &mut SourceMap) -> Result<(), Failure> {
    let mut reads: Vec<(&str, &Path)> = vec![
        ("the model", &args.model),
        ("the --inputs file", &args.inputs),
    ];
    if let Some(p) = &args.weights.params {
        reads.push(("the --params file", p));
    }
    crate::files::refuse_overwrites(&reads, &[("the output (-o)", &args.output)])
        .map_err(Failure::Message)?;
    let typed = load_typed(&args.model, sources)?;
    let (_, ret) = main_signature(&typed, "main")?;
    check_scalar(&typed, "main", &ret, "`tumble grad`")?;
    let raw = read_raw(&args.inputs, "--inputs")?;
    let file = read_weights(&args.weights)?;
    let c = compile(&typed, "main", &raw, &file, args.weights.random_params)?;
    let decoded = c.decode(&typed, &raw)?;
    let params = c.float_params();
    if params.is_empty() {
        // Nothing to differentiate with respect to: an empty file would look like a result.
        return Err(Failure::Message(
            "the model has no float parameters (weights bound from --params or --random-params) \
             to take the gradient with respect to; nothing was written"
                .into(),
        ));
    }
    let mut total: Vec<Option<Tensor>> = vec![None; params.len()];
    let mut stats = tumble_runtime::backward::BackwardStats::default();
    let t0 = Instant::now();
    let mut loss = 0.0;
    let mut used_workers = 1;
    if args.reference {
        let program = Program::lower_with(&typed, LowerOptions::reference())
            .map_err(|e| Failure::Diags(vec![Diagnostic::error(e.span, e.message)]))?;
        let wrt: Vec<usize> = c
            .bound
            .args
            .iter()
            .enumerate()
            .filter(|(_, a)| matches!(&a.binding, Binding::Param(t) if t.dtype().is_float()))
            .map(|(i, _)| i)
            .collect();
        for (i, inst) in decoded.iter().enumerate() {
            let mut rng = instance_rng(args.weights.seed, i);
            let g = tumble_interp::tape::grad(
                &program,
                "main",
                c.bound.assemble(inst.clone())?,
                &wrt,
                &mut rng,
            )
            .map_err(|e| Compiled::run_error(&raw, i, e))?;
            loss += g.loss;
            for (slot, g) in total.iter_mut().zip(g.grads) {
                if let Some(g) = g {
                    tumble_interp::tape::accumulate(slot, g).map_err(Failure::Message)?;
                }
            }
        }
    } else {
        let opts = options(args.weights.threads)?;
        let n = decoded.len();
        let batch = args.batch.unwrap_or(n).max(1);
        let all: Vec<usize> = (0..n).collect();
        let workers = worker_count(&args.weights, opts.threads, batch);
        used_workers = workers;
        let names: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
        let by_name: BTreeMap<String, Tensor> = params.iter().cloned().collect();
        let setup = workers::Setup::new(
            &typed,
            &raw,
            &names,
            opts,
            workers,
            gopts(&args.weights),
            args.weights.seed,
        );
        std::thread::scope(|scope| -> Result<(), Failure> {
            let pool = workers::Workers::start(scope, workers, &c, &decoded, setup)?;
            for which in all.chunks(batch) {
                let (losses, gs) = pool.grad(&c, &decoded, which, &by_name, setup, &mut stats)?;
                loss += losses.iter().sum::<f64>();
                for (slot, g) in total.iter_mut().zip(gs) {
                    if let Some(g) = g {
                        g.add_into(slot).map_err(Failure::Message)?;
                    }
                }
                if let Some(stop) = tumble_limits::halted() {
                    return Err(Failure::Message(format!("{stop}; nothing written")));
                }
            }
            Ok(())
        })?;
    }
    let mut out = BTreeMap::new();
    for ((name, p), g) in params.iter().zip(total) {
        let g = match g {
            Some(g) => g,
            None => Tensor::zeros(p.shape().to_vec(), p.dtype())
                .map_err(|e| Failure::Message(e.to_string()))?,
        };
        out.insert(name.clone(), g);
    }
    save_params(&args.output, &out)?;
    if args.profile {
        eprintln!(
            "grad: {} instances, sum of @main {loss:.6}, {} parameters, {:.3} s \
             (forward {:.3} s, backward {:.3} s{}); backward launches {} (skipped {}), \
             vjps batched {} / per row {}, shared-weight gradients summed per launch {}, \
             dense parameter gradients deferred to one product per parameter {}, \
             invocations computed once for identical ones {}; peak heap per mini-batch {}\n\
             forward (ms): {}",
            decoded.len(),
            out.len(),
            t0.elapsed().as_secs_f64(),
            stats.time_forward.as_secs_f64(),
            stats.time_backward.as_secs_f64(),
            if used_workers > 1 {
                format!(", summed over {used_workers} workers")
            } else {
                String::new()
            },
            stats.launches,
            stats.skipped,
            stats.batched_vjps,
            stats.looped_vjps,
            stats.shared_grads,
            stats.deferred_dense,
            stats.memoized,
            tumble_limits::bytes_text(stats.peak_bytes),
            stats.forward.run_split()
        );
    }
    Ok(())
}

/// Optimizer state per parameter, in f32 (the parameters' usual dtype; others convert).
#[derive(Default)]
struct Slot {
    m: Vec<f32>,
    v: Vec<f32>,
    /// An f64 parameter's moments ([`step_f64`]).
    m64: Vec<f64>,
    v64: Vec<f64>,
}

/// What one optimizer step applies: the rule, the learning rate, the weight decay, the step
/// number `t` (1-based) and the gradient's scale (the mini-batch mean's `1 / b`).
#[derive(Clone, Copy, Debug)]
struct StepSettings {
    opt: Optimizer,
    lr: f64,
    decay: f64,
    t: u64,
    scale: f64,
}

/// One optimizer step on `w`, in place, with gradient `g * scale` (the mini-batch's mean) plus
/// `decay * w`. Moments are kept in f32, like PyTorch's optimizers (f64 for an f64 parameter).
fn step(h: StepSettings, w: &mut Tensor, g: &ParamGrad, s: &mut Slot) -> Result<(), String> {
    if w.dtype() == tumble_ir::DType::Float64 {
        return step_f64(h, w, g, s);
    }
    let (opt, decay) = (h.opt, h.decay);
    let n = w.len();
    moments(opt, n, &mut s.m, &mut s.v);
    let rule = Rule::new(h);
    // Rows whose gradient is all zero (an embedding's rows no instance of the mini-batch read)
    // keep their weights and state exactly under SGD and Adagrad without weight decay (each
    // element becomes `x - lr·0/…` = x), so they are skipped; Adam's moments move even at a
    // zero gradient, so it updates every row.
    let sparse = opt != Optimizer::Adam && decay == 0.0;
    // The last axis is a row (an embedding's row: skipped whole when its gradient is zero).
    let row = w
        .shape()
        .last()
        .copied()
        .filter(|&d| d > 0 && w.rank() >= 2)
        .unwrap_or(n.max(1));
    // Updated where it lies (a clone would make `make_mut_slice` copy the whole table); put
    // back whatever happens.
    let dtype = w.dtype();
    let mut w32 = std::mem::replace(w, Tensor::scalar_f32(0.0)).cast(tumble_ir::DType::Float32);
    let result = match w32.make_mut_slice::<f32>() {
        Some(wv) => update(wv, g, &rule, sparse, row, s),
        None => Err("internal: optimizer operands are not float".into()),
    };
    *w = w32.cast(dtype);
    result
}

/// [`step`]'s update of the f32 weights `wv` (rows of `row` elements).
fn update(
    wv: &mut [f32],
    g: &ParamGrad,
    rule: &Rule,
    sparse: bool,
    row: usize,
    s: &mut Slot,
) -> Result<(), String> {
    let n = wv.len();
    match g {
        ParamGrad::Rows(rows) if sparse => {
            let [_, d] = rows.shape();
            if rows.shape().iter().product::<usize>() != n {
                return Err("internal: gradient and parameter sizes differ".into());
            }
            for (r, gr) in rows.iter() {
                if gr.iter().all(|&v| v == 0.0) {
                    continue;
                }
                let at = r * d;
                if let Some(o) = wv.get_mut(at..at + d) {
                    rule.apply(o, gr, s, at);
                }
            }
        }
        _ => {
            let dense;
            let gt = match g {
                ParamGrad::Dense(t) => t,
                ParamGrad::Rows(r) => {
                    dense = r.to_dense()?;
                    &dense
                }
            };
            let g32 = gt.cast(tumble_ir::DType::Float32);
            let gv = g32
                .as_slice::<f32>()
                .ok_or("internal: optimizer operands are not float")?;
            if gv.len() != n {
                return Err("internal: gradient and parameter sizes differ".into());
            }
            for (r, (o, g)) in wv.chunks_mut(row).zip(gv.chunks(row)).enumerate() {
                if sparse && g.iter().all(|&v| v == 0.0) {
                    continue;
                }
                rule.apply(o, g, s, r * row);
            }
        }
    }
    Ok(())
}

/// The optimizer's moments for `n` weights, zero, made at the first step: the second moments
/// always, the first only for Adam (Adagrad's would be a second table the size of the
/// embedding's, never read).
fn moments<T: Clone + Default>(opt: Optimizer, n: usize, m: &mut Vec<T>, v: &mut Vec<T>) {
    // SGD keeps no state; Adagrad its sums of squares; Adam both moments.
    let (m_len, v_len) = match opt {
        Optimizer::Sgd => (0, 0),
        Optimizer::Adagrad => (0, n),
        Optimizer::Adam => (n, n),
    };
    if v.len() != v_len || m.len() != m_len {
        *m = written(m_len);
        *v = written(v_len);
    }
}

/// `n` default values, written now: `vec![0.0; n]` maps zero pages lazily, and a sparse update
/// would fault them in one by one during training.
fn written<T: Clone + Default>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, T::default());
    v
}

impl Slot {
    /// The state `opt` keeps for parameter `w`, made now (see `train`).
    fn prepare(&mut self, opt: Optimizer, w: &Tensor) {
        if w.dtype() == tumble_ir::DType::Float64 {
            moments(opt, w.len(), &mut self.m64, &mut self.v64);
        } else {
            moments(opt, w.len(), &mut self.m, &mut self.v);
        }
    }
}

/// [`step`] for an f64 parameter: the same rules in f64 (`optim::update_f64`), with f64 moments
/// (through the f32 path every update rounded the weights to f32: an f64 model trained at f32
/// precision).
fn step_f64(h: StepSettings, w: &mut Tensor, g: &ParamGrad, s: &mut Slot) -> Result<(), String> {
    let n = w.len();
    moments(h.opt, n, &mut s.m64, &mut s.v64);
    let dense;
    let gt = match g {
        ParamGrad::Dense(t) => t,
        ParamGrad::Rows(r) => {
            dense = r.to_dense()?;
            &dense
        }
    };
    let gv = gt.to_f64_vec();
    let Some(wv) = w.make_mut_slice::<f64>() else {
        return Err("internal: an f64 parameter's values are not f64".into());
    };
    if gv.len() != n || wv.len() != n {
        return Err("internal: gradient and parameter sizes differ".into());
    }
    let rule = match h.opt {
        Optimizer::Sgd => optim::Rule::Sgd,
        Optimizer::Adagrad => optim::Rule::Adagrad,
        Optimizer::Adam => optim::Rule::Adam,
    };
    optim::update_f64(
        rule,
        wv,
        &gv,
        &mut s.m64,
        &mut s.v64,
        (h.lr, h.decay, h.scale),
        h.t,
    );
    Ok(())
}

/// One optimizer's update of a run of weights.
struct Rule {
    opt: Optimizer,
    step: Step,
    adam: optim::Adam,
}

impl Rule {
    fn new(h: StepSettings) -> Self {
        Rule {
            opt: h.opt,
            step: Step {
                lr: h.lr as f32,
                decay: h.decay as f32,
                scale: h.scale as f32,
            },
            adam: optim::Adam::at_step(h.t),
        }
    }

    /// Updates the weights `o` (elements `at..` of the parameter) by their gradient `g`.
    fn apply(&self, o: &mut [f32], g: &[f32], s: &mut Slot, at: usize) {
        let end = at + g.len();
        match self.opt {
            Optimizer::Sgd => optim::sgd(o, g, self.step),
            Optimizer::Adagrad => optim::adagrad(o, g, &mut s.v[at..end], self.step),
            Optimizer::Adam => optim::adam(
                o,
                g,
                &mut s.m[at..end],
                &mut s.v[at..end],
                self.step,
                self.adam,
            ),
        }
    }
}

/// `0..n` shuffled by `seed` (Fisher–Yates): the same order on every run.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

pub fn train(args: &TrainArgs, color: bool) -> ExitCode {
    let mut sources = SourceMap::new();
    let mut saved = false;
    let r = train_inner(args, &mut sources, &mut saved);
    if let Some(stop) = tumble_limits::halt_seen() {
        // The run stopped where it was (Ctrl-C, `--timeout`): no instance is to blame.
        if saved {
            eprintln!(
                "{stop}: {} holds the last complete checkpoint",
                args.output.display()
            );
        } else {
            eprintln!(
                "{stop} before a checkpoint was kept: nothing was written to {}",
                args.output.display()
            );
        }
        return ExitCode::FAILURE;
    }
    report(r, &sources, color)
}

/// Trains; `saved` is set once a checkpoint is written (what an interrupted run's message says).
fn train_inner(args: &TrainArgs, sources: &mut SourceMap, saved: &mut bool) -> Result<(), Failure> {
    let mut reads: Vec<(&str, &Path)> = vec![
        ("the model", &args.model),
        ("the --train file", &args.train),
    ];
    if let Some(p) = &args.dev {
        reads.push(("the --dev file", p));
    }
    if let Some(p) = &args.weights.params {
        reads.push(("the --params file", p));
    }
    crate::files::refuse_overwrites(&reads, &[("the output (-o)", &args.output)])
        .map_err(Failure::Message)?;
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Failure::Message(format!(
            "--lr {}: must be a positive number",
            args.lr
        )));
    }
    if !(args.weight_decay.is_finite() && args.weight_decay >= 0.0) {
        return Err(Failure::Message(format!(
            "--weight-decay {}: must be a non-negative number",
            args.weight_decay
        )));
    }
    let typed = load_typed(&args.model, sources)?;
    let (_, ret) = main_signature(&typed, "main")?;
    check_scalar(&typed, "main", &ret, "`tumble train`")?;
    let eval_entry = args.eval.as_deref().map(entry_name).map(str::to_string);
    if let Some(e) = &eval_entry {
        let (_, r) = main_signature(&typed, e)?;
        check_scalar(&typed, e, &r, "--eval")?;
        if args.dev.is_none() {
            return Err(Failure::Message(
                "--eval needs --dev (it is measured on the dev instances)".into(),
            ));
        }
    }
    let raw = read_raw(&args.train, "--train")?;
    let file = read_weights(&args.weights)?;
    let mut main = compile(&typed, "main", &raw, &file, args.weights.random_params)?;
    // The file's tensors are bound now; kept, they would make the first update of every weight
    // copy it (the embedding table: 22 MB and its page faults inside the first epoch).
    drop(file);
    let decoded = main.decode(&typed, &raw)?;
    let mut weights = main.all_params();
    let trainable: Vec<String> = main.float_params().into_iter().map(|(n, _)| n).collect();
    if trainable.is_empty() {
        return Err(Failure::Message(
            "the model has no float parameters to train".into(),
        ));
    }
    let mut dev = match &args.dev {
        Some(p) => {
            let raw_dev = read_raw(p, "--dev")?;
            let decoded_dev = main.decode(&typed, &raw_dev)?;
            let eval = match &eval_entry {
                Some(e) => {
                    // Bound from the model's weights, the ones training learns: a parameter
                    // @main lacks has none (and the binder would speak of a weights file).
                    let (eparams, _) = main_signature(&typed, e)?;
                    let provided = raw_dev.provided_args(&eparams, &weights);
                    let foreign: Vec<String> = eparams
                        .iter()
                        .filter(|(n, _)| !provided.contains(n) && !weights.contains_key(n))
                        .map(|(n, _)| format!("%{n}"))
                        .collect();
                    if !foreign.is_empty() {
                        return Err(Failure::Message(format!(
                            "--eval @{e}: {} is neither an argument of the dev instances nor a \
                             weight of @main; @{e}'s parameters must be @main's, the weights \
                             training learns",
                            foreign.join(", ")
                        )));
                    }
                    let mut c = compile(&typed, e, &raw_dev, &weights, None)?;
                    let d = c.decode(&typed, &raw_dev)?;
                    // Bound again for each evaluation: held between them, the weights would be
                    // copied whole by every update (the optimizer writes in place only where it
                    // holds the one reference).
                    c.release(&trainable);
                    Some((c, d))
                }
                None => None,
            };
            Some((raw_dev, decoded_dev, eval))
        }
        None => None,
    };
    let opts = options(args.weights.threads)?;
    // The optimizer's state is made (and written) before the first epoch, as the peers'
    // trainers make theirs when they are built: made lazily, a sparse update first touched an
    // embedding's accumulator page by page through the first epoch (page faults, 2.5 µs each on
    // a VM), and a memory budget too small for it fails here, not mid-epoch.
    let mut slots: BTreeMap<String, Slot> = BTreeMap::new();
    for name in &trainable {
        if let Some(w) = main.param_mut(name) {
            slots
                .entry(name.clone())
                .or_default()
                .prepare(args.optimizer, w);
        }
    }
    let mut best: Option<f64> = None;
    let mut t: u64 = 0;
    let n = decoded.len();
    let mut stats = tumble_runtime::backward::BackwardStats::default();
    let workers = worker_count(&args.weights, opts.threads, args.batch);
    // Every epoch runs every training instance, and evaluates every dev instance: the first run
    // records, the later ones replay.
    let replay = !args.no_trace_replay && tumble_runtime::trace::replay_enabled();
    let traces = replay.then(|| TraceCache::new(n));
    let dev_traces = match &dev {
        Some((_, d, _)) if replay => Some(TraceCache::new(d.len())),
        _ => None,
    };
    let eval_traces = match &dev {
        Some((_, _, Some((_, d)))) if replay => Some(TraceCache::new(d.len())),
        _ => None,
    };
    let setup = workers::Setup {
        traces: traces.as_ref(),
        ..workers::Setup::new(
            &typed,
            &raw,
            &trainable,
            opts,
            workers,
            gopts(&args.weights),
            args.weights.seed,
        )
    };
    std::thread::scope(|scope| -> Result<(), Failure> {
        let pool = workers::Workers::start(scope, workers, &main, &decoded, setup)?;
        for epoch in 1..=args.epochs {
            let order = shuffled(
                n,
                args.weights.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            let bar = if args.quiet {
                indicatif::ProgressBar::hidden()
            } else {
                let b = indicatif::ProgressBar::new(n as u64);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({per_sec}, eta {eta})",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> "),
                );
                b.set_prefix(format!("{epoch}/{}", args.epochs));
                b
            };
            let t_epoch = Instant::now();
            let mut loss_sum = 0.0;
            let mut seen = 0usize;
            for which in order.chunks(args.batch) {
                if let Some(stop) = tumble_limits::halted() {
                    bar.abandon();
                    return Err(Failure::Message(stop.to_string()));
                }
                let (losses, grads) =
                    pool.grad(&main, &decoded, which, &weights, setup, &mut stats)?;
                let b = which.len() as f64;
                loss_sum += losses.iter().sum::<f64>();
                seen += which.len();
                t += 1;
                // The mean loss of the mini-batch is minimized: its gradient is the sum's over b.
                // The weights are updated in place where the bound tensor is their only holder
                // (the map's reference is let go first; the step's were, in `grad`).
                for (name, g) in trainable.iter().zip(grads) {
                    let Some(w) = main.param_mut(name) else {
                        continue;
                    };
                    let g = match g {
                        Some(g) => g,
                        None if args.weight_decay > 0.0 => ParamGrad::Dense(
                            Tensor::zeros(w.shape().to_vec(), w.dtype())
                                .map_err(|e| Failure::Message(e.to_string()))?,
                        ),
                        None => continue,
                    };
                    let slot = slots.entry(name.clone()).or_default();
                    weights.remove(name);
                    let h = StepSettings {
                        opt: args.optimizer,
                        lr: args.lr,
                        decay: args.weight_decay,
                        t,
                        scale: 1.0 / b,
                    };
                    step(h, w, &g, slot).map_err(Failure::Message)?;
                    weights.insert(name.clone(), w.clone());
                }
                bar.inc(which.len() as u64);
                bar.set_message(format!("loss {:.4}", loss_sum / seen.max(1) as f64));
            }
            bar.finish_and_clear();
            let mut line = format!(
                "epoch {epoch}/{}: train loss {:.4} ({:.1} instances/s{}, peak heap {})",
                args.epochs,
                loss_sum / seen.max(1) as f64,
                seen as f64 / t_epoch.elapsed().as_secs_f64().max(1e-9),
                if workers > 1 {
                    format!(" on {workers} workers")
                } else {
                    String::new()
                },
                tumble_limits::bytes_text(stats.peak_bytes)
            );
            stats.peak_bytes = 0;
            if let (1, Some(c)) = (epoch, &traces) {
                // What the next epochs replay instead of interpreting.
                let (traced, bytes) = c.traced();
                line.push_str(&format!(
                    ", {traced} of {n} instances traced ({})",
                    tumble_limits::bytes_text(bytes)
                ));
            }
            let train_loss = loss_sum / seen.max(1) as f64;
            // The loss is measured before each step, so the last step's weights are looked at
            // too (a step can overflow them after a finite loss).
            let bad = non_finite_param(&weights);
            if !train_loss.is_finite() || bad.is_some() {
                // The weights are NaN or infinite from here on: another epoch cannot mend them,
                // and they are not saved over the last good ones.
                eprintln!("{line}");
                let what = match bad {
                    Some(p) if train_loss.is_finite() => format!("%{p} has NaN or infinite values"),
                    _ => format!("the training loss is {train_loss}"),
                };
                return Err(Failure::Message(format!(
                    "{what} at epoch {epoch}: the weights diverged (lower --lr, or add \
                     --weight-decay); {}",
                    if *saved {
                        format!(
                            "{} keeps the last epoch saved before",
                            args.output.display()
                        )
                    } else {
                        format!("nothing was written to {}", args.output.display())
                    }
                )));
            }
            let mut score: Option<f64> = None;
            if let Some((raw_dev, decoded_dev, eval)) = &mut dev {
                let losses = main.outputs(
                    raw_dev,
                    decoded_dev,
                    args.batch.max(64),
                    opts,
                    args.weights.seed,
                    dev_traces.as_ref(),
                )?;
                let dev_loss = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
                line.push_str(&format!(", dev loss {dev_loss:.4}"));
                if let (1, Some(c)) = (epoch, &dev_traces) {
                    let (traced, _) = c.traced();
                    line.push_str(&format!(" ({traced} of {} traced)", decoded_dev.len()));
                }
                score = Some(-dev_loss);
                if let (Some((c, d)), Some(e)) = (eval, &eval_entry) {
                    c.rebind(&weights);
                    let vals = c.outputs(
                        raw_dev,
                        d,
                        args.batch.max(64),
                        opts,
                        args.weights.seed,
                        eval_traces.as_ref(),
                    );
                    c.release(&trainable);
                    let vals = vals?;
                    let mean = vals.iter().sum::<f64>() / vals.len().max(1) as f64;
                    line.push_str(&format!(", dev @{e} {mean:.4}"));
                    score = Some(mean);
                }
            }
            // A dev score that is not finite (NaN: weights or dev instances that overflow) is
            // never the best: that epoch is not saved.
            let improved = match (score, best) {
                (None, _) => true,
                (Some(s), _) if !s.is_finite() => false,
                (Some(_), None) => true,
                (Some(s), Some(b)) => s > b,
            };
            if improved {
                if score.is_some_and(f64::is_finite) {
                    best = score;
                }
                save_params(&args.output, &weights)?;
                *saved = true;
                line.push_str(&format!(" -> saved {}", args.output.display()));
            } else if score.is_some_and(|s| !s.is_finite()) {
                line.push_str(" (not finite: not saved)");
            }
            eprintln!("{line}");
        }
        if !*saved {
            return Err(Failure::Message(format!(
                "no epoch had a finite dev score, so no weights were kept; nothing was written to \
                 {}",
                args.output.display()
            )));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tumble_runtime::backward::RowGrad;

    /// A row gradient updates only its rows, with exactly the dense update's bits, under every
    /// optimizer and with weight decay (where it updates every row through the dense path).
    #[test]
    fn a_row_gradient_steps_like_its_dense_form() {
        let (n, d) = (7, 5);
        let w0 = Tensor::from_vec(
            vec![n, d],
            (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect(),
        )
        .unwrap();
        let mut rows = RowGrad::new(n, d).unwrap();
        rows.add_row(5, &[0.5, -1.0, 0.25, 2.0, -0.125]);
        rows.add_row(2, &[0.0; 5]); // listed, but zero: skipped like a zero dense row
        rows.add_row(0, &[1.5, 1.0, -0.5, 0.75, 0.1]);
        let dense = ParamGrad::Dense(rows.to_dense().unwrap());
        let sparse = ParamGrad::Rows(rows);
        for opt in [Optimizer::Sgd, Optimizer::Adagrad, Optimizer::Adam] {
            for decay in [0.0, 0.01] {
                let (mut a, mut b) = (w0.clone(), w0.clone());
                let new_slot = Slot::default;
                let (mut sa, mut sb) = (new_slot(), new_slot());
                for t in 1..=3 {
                    let h = StepSettings {
                        opt,
                        lr: 0.1,
                        decay,
                        t,
                        scale: 0.5,
                    };
                    step(h, &mut a, &dense, &mut sa).unwrap();
                    step(h, &mut b, &sparse, &mut sb).unwrap();
                }
                assert_eq!(a.as_f32(), b.as_f32(), "{opt:?} decay {decay}");
                assert_eq!(sa.v, sb.v, "{opt:?} decay {decay}");
                let moved: Vec<usize> = (0..n)
                    .filter(|&r| a.row(r).unwrap().as_f32() != w0.row(r).unwrap().as_f32())
                    .collect();
                // (Adam's moments of a never-nonzero row stay 0: it does not move either.)
                if decay == 0.0 {
                    assert_eq!(moved, vec![0, 5], "{opt:?}: only the nonzero rows move");
                } else {
                    assert_eq!(moved.len(), n, "{opt:?} decay {decay}: every row moves");
                }
            }
        }
        // The step does not write through to another holder of the weights.
        let mut held = w0.clone();
        let mut s = Slot::default();
        let h = StepSettings {
            opt: Optimizer::Sgd,
            lr: 0.1,
            decay: 0.0,
            t: 1,
            scale: 1.0,
        };
        step(h, &mut held, &sparse, &mut s).unwrap();
        assert_ne!(held.as_f32(), w0.as_f32());
        assert_eq!(w0.as_f32().unwrap()[0], 0.0);
    }
}
