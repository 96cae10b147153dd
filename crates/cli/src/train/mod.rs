//! `tumble grad` and `tumble train`: the batched backward pass ([`tumble_runtime::backward`])
//! from the command line — the gradient of the sum of `@main`'s outputs over a file of
//! instances, and mini-batch training of the float parameters on it.
//!
//! This file holds the arguments and the training loop; `entry` compiles the entry and computes a
//! mini-batch's gradients, `grad` is `tumble grad`, `optimizer` the optimizers' state and step,
//! `workers` the threads that share a mini-batch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use tumble_check::{LoadOptions, TypedModule};
use tumble_compile::{LowerOptions, Program, ReuseAnalysis};
use tumble_interp::Value;
use tumble_io::{
    bind_params, load_params_on, main_signature, read_instances_file, save_params, Binding,
    BoundParams, RawInstances, TypeEnv,
};
use tumble_ir::{diag, Diagnostic, SourceMap, Ty};
use tumble_runtime::backward::{GradOptions, ParamGrad};
use tumble_runtime::trace::TraceCache;
use tumble_runtime::Options;
use tumble_tensor::{Rng, Tensor};

use crate::run::{instance_rng, Failure};

mod entry;
mod grad;
mod optimizer;
mod workers;

use entry::{check_scalar, compile, compile_bound, entry_name, load_typed, Compiled};
pub use grad::grad;
use grad::non_finite_param;
use optimizer::{step, Slot, StepSettings};

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
    /// Default: one per thread. Never more than the threads or the instances of a mini-batch
    /// (a larger count is reduced, with a warning).
    #[arg(long, value_name = "N", value_parser = crate::run::at_least_one)]
    pub workers: Option<usize>,
    /// Seed of `random.db_uniform` (instance i draws from its own stream; in `train` each epoch
    /// draws anew, the first as `grad` and `run` do) and, in `train`, of the shuffle.
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
    /// Instances per mini-batch; default: equal mini-batches of at most 128. The gradient does
    /// not depend on it (but for the order of its float sums).
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
    // A negative value is read as a value (and refused as one), not as an unknown flag `-0`.
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub lr: f64,
    /// L2 weight decay, added to each gradient as `decay * w`.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// A global with `@main`'s parameters returning a float scalar per instance (e.g.
    /// `@accuracy`): its mean on dev is reported after each epoch and picks the best weights
    /// (higher is better); without it the lowest dev loss does.
    #[arg(long, value_name = "@NAME", value_parser = crate::run::entry_arg)]
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
    /// own data: the same graph, the same bits, without the host program's steps). A run of one
    /// epoch records nothing either way.
    #[arg(long)]
    pub no_trace_replay: bool,
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
    let n = w.workers.unwrap_or(threads).min(threads).min(batch).max(1);
    if let Some(asked) = w.workers.filter(|&a| a > n) {
        eprintln!(
            "warning: --workers {asked}: running {n} (a worker needs a thread of its own, and at \
             least one instance of each mini-batch: --threads {threads}, --batch {batch})"
        );
    }
    n
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

/// The weights file's tensors, a large file read on `threads` threads (the same tensors).
fn read_weights(w: &Weights, threads: usize) -> Result<BTreeMap<String, Tensor>, Failure> {
    match &w.params {
        Some(p) => {
            let loaded = load_params_on(p, threads)?;
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

/// The seed of epoch `epoch`'s random streams: `seed` itself for the first.
fn epoch_seed(seed: u64, epoch: usize) -> u64 {
    let later = (epoch.saturating_sub(1) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    seed ^ later.rotate_left(29)
}

/// What a stopped run leaves at `output`: the last checkpoint, or nothing.
fn kept_checkpoint(saved: bool, output: &std::path::Path) -> String {
    if saved {
        format!("{} keeps the last epoch saved before", output.display())
    } else {
        format!("nothing was written to {}", output.display())
    }
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
    // The updates run in float32: a rate that rounds to 0 there would train nothing, silently.
    let f32_positive = |x: f64| (x as f32) > 0.0 && (x as f32).is_finite();
    if !(args.lr.is_finite() && args.lr > 0.0 && f32_positive(args.lr)) {
        return Err(Failure::Message(format!(
            "--lr {}: must be a positive number within float32's range (1e-45 to 3e38)",
            args.lr
        )));
    }
    if !(args.weight_decay.is_finite()
        && args.weight_decay >= 0.0
        && (args.weight_decay == 0.0 || f32_positive(args.weight_decay)))
    {
        return Err(Failure::Message(format!(
            "--weight-decay {}: must be 0 or a positive number within float32's range",
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
        if e == "main" {
            // Higher is better for --eval: on the loss itself it keeps the worst weights.
            eprintln!(
                "warning: --eval @main: --eval keeps the weights with the highest mean, and @main \
                 is the loss being minimized — the best weights would be the worst; without \
                 --eval the lowest dev loss picks them"
            );
        }
    }
    let raw = read_raw(&args.train, "--train")?;
    let file = read_weights(
        &args.weights,
        crate::run::thread_count(args.weights.threads)?,
    )?;
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
    // Checked after every epoch too; found now, it is the starting point's fault, not the rate's.
    if let Some(p) = non_finite_param(&weights) {
        return Err(Failure::Message(format!(
            "%{p} has NaN or infinite values before training; training cannot start from them \
             (check the weights file, or use --random-params)"
        )));
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
                    // Errors say which entry they are about (not @main, not a weights file); a
                    // weight @e does not take is no news.
                    let in_eval = |f: Failure| match f {
                        Failure::Message(m) => Failure::Message(format!(
                            "--eval @{e}: {}",
                            m.replace("the file has", "@main's weight is")
                        )),
                        other => other,
                    };
                    let (mut c, warnings) =
                        compile_bound(&typed, e, &raw_dev, &weights, None).map_err(in_eval)?;
                    for w in warnings.iter().filter(|w| !w.contains("does not take")) {
                        eprintln!("warning: --eval @{e}: {w}");
                    }
                    // The dev instances are @main's: @e's per-instance arguments are taken from
                    // them by name (@e may take fewer, e.g. no label), else decoded for @e.
                    let main_args: Vec<String> = main
                        .bound
                        .instance_args()
                        .into_iter()
                        .map(|(n, _)| n)
                        .collect();
                    let picks: Option<Vec<usize>> = c
                        .bound
                        .instance_args()
                        .iter()
                        .map(|(n, _)| main_args.iter().position(|m| m == n))
                        .collect();
                    let d = match picks {
                        Some(picks) => decoded_dev
                            .iter()
                            .map(|vs| picks.iter().filter_map(|&k| vs.get(k).cloned()).collect())
                            .collect(),
                        None => c.decode(&typed, &raw_dev).map_err(in_eval)?,
                    };
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
                .prepare(args.optimizer, w)
                .map_err(|stop| {
                    Failure::Message(format!(
                        "the {} optimizer's state for %{name} ({} weights): {stop}",
                        clap::ValueEnum::to_possible_value(&args.optimizer)
                            .map_or_else(String::new, |v| v.get_name().to_string()),
                        w.len()
                    ))
                })?;
        }
    }
    let mut best: Option<f64> = None;
    let mut t: u64 = 0;
    let n = decoded.len();
    let mut stats = tumble_runtime::backward::BackwardStats::default();
    let workers = worker_count(&args.weights, opts.threads, args.batch);
    // Every epoch runs every training instance, and evaluates every dev instance: the first run
    // records, the later ones replay. One epoch has no later run: recording would only cost (its
    // first epoch 4-7% slower, its heap ~10 MB larger on 1,000 SST trees).
    let replay =
        args.epochs > 1 && !args.no_trace_replay && tumble_runtime::trace::replay_enabled();
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
        weights_change: true,
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
                // Each epoch draws anew (dropout masks differ from epoch to epoch); the first
                // draws what `run` and `grad` draw with the same --seed.
                let step_setup = workers::Setup {
                    seed: epoch_seed(args.weights.seed, epoch),
                    ..setup
                };
                let (losses, grads) =
                    pool.grad(&main, &decoded, which, &weights, step_setup, &mut stats)?;
                if let Some(at) = Compiled::non_finite_loss(&raw, which, &losses) {
                    // Stopped before the step: it would make every weight NaN.
                    bar.abandon();
                    let why = if t == 0 {
                        "at the starting weights: the model's loss is not finite on this \
                         instance (a log of 0, a division by 0?)"
                            .to_string()
                    } else {
                        format!(
                            "after {t} steps: the weights diverged (lower --lr, or add \
                             --weight-decay), or the model's loss is not finite on this instance"
                        )
                    };
                    return Err(Failure::Message(format!(
                        "{at} at epoch {epoch}, {why}; {}",
                        kept_checkpoint(*saved, &args.output)
                    )));
                }
                // A finite loss whose gradient is not (a derivative infinite at an instance, or
                // weights about to diverge): stopped before the step, as for a loss, naming the
                // instance — after the step the next mini-batch's loss took the blame.
                if let Some(k) = grads
                    .iter()
                    .position(|g| g.as_ref().is_some_and(|g| !g.is_finite()))
                {
                    bar.abandon();
                    let name = trainable.get(k).map_or("?", String::as_str);
                    let at = pool.instance_with_non_finite_gradient(
                        &main, &decoded, which, &weights, step_setup, &mut stats, k,
                    )?;
                    let whose = match at {
                        Some(i) => format!("{}: the", Compiled::location(&raw, i)),
                        None => "the".to_string(),
                    };
                    return Err(Failure::Message(format!(
                        "{whose} gradient of @main's output with respect to %{name} is not \
                         finite though the output is, at epoch {epoch} after {t} steps (an \
                         operator's derivative infinite there — a sqrt or log at 0? — or weights \
                         on their way to diverging: lower --lr, or add --weight-decay); {}",
                        kept_checkpoint(*saved, &args.output)
                    )));
                }
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
                     --weight-decay), or a gradient was not finite where the loss was (an \
                     operator's derivative infinite at an instance: a sqrt or log at 0? `tumble \
                     grad` on the training instances names it); {}",
                    kept_checkpoint(*saved, &args.output)
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
