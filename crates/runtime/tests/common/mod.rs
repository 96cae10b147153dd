//! Differential testing against the reference interpreter, shared by the runtime's test files:
//! load a program from text, decode instances, run the reference engine and the batching runtime
//! under every scheduler, batch size and optimization switch, and compare outputs.
#![allow(dead_code)] // each test file uses a part

use std::collections::BTreeMap;
use std::path::PathBuf;

use tumble_check::{load, LoadOptions, TypedModule};
use tumble_compile::{LowerOptions, Program};
use tumble_interp::{RunError, Value};
use tumble_io::{bind_params, main_signature, read_instances, TypeEnv};
use tumble_ir::SourceMap;
use tumble_runtime::{run_batch, Options, Scheduler};
use tumble_tensor::Rng;

pub fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

pub struct Loaded {
    pub typed: TypedModule,
    pub sources: SourceMap,
}

/// Parses and checks `text`; a program that does not check panics with the rendered diagnostics.
pub fn load_text(name: &str, text: &str) -> Loaded {
    try_load_text(name, text).unwrap_or_else(|d| panic!("{d}"))
}

/// [`load_text`], the rendered diagnostics as the error.
pub fn try_load_text(name: &str, text: &str) -> Result<Loaded, String> {
    let mut sources = SourceMap::new();
    match load(&mut sources, name, text, LoadOptions::default()) {
        Ok(typed) => Ok(Loaded { typed, sources }),
        Err(ds) => Err(tumble_ir::diag::render(&ds, &sources, false)),
    }
}

/// Decodes `inputs` (JSON Lines) against `@main`; parameters the instances do not provide are
/// drawn at random (seed 0).
pub fn instances(l: &Loaded, program: &Program, inputs: &str) -> Vec<Vec<Value>> {
    let (params, _) = main_signature(&l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
    let raw = read_instances(inputs.as_bytes(), "inputs").unwrap_or_else(|e| panic!("{e}"));
    let file = BTreeMap::new();
    let provided = raw.provided_args(&params, &file);
    let bound = bind_params(&params, &provided, &file, Some(0)).unwrap_or_else(|e| panic!("{e}"));
    let env = TypeEnv::new(&l.typed, program);
    let decoded = raw
        .decode(&env, &bound.instance_args())
        .unwrap_or_else(|e| panic!("{e}"));
    decoded
        .into_iter()
        .map(|v| bound.assemble(v).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Instance `i`'s random stream: the same in every engine and at every batch size.
/// The static optimizations `tumble grad` and `tumble train` compile with: all but derived
/// parameters (weight transforms computed once per run, outside the graph no gradient or
/// trace sees).
pub fn training_statics() -> tumble_compile::StaticOptions {
    tumble_compile::StaticOptions {
        derive: false,
        for_gradients: true,
        ..tumble_compile::StaticOptions::all()
    }
}

pub fn rng(i: usize) -> Rng {
    Rng::new(1000 + i as u64)
}

/// The float weights of `x`: indices into `@main`'s arguments (what gradients are taken of).
pub fn float_weights(x: &Expected) -> Vec<usize> {
    x.weights
        .iter()
        .enumerate()
        .filter(|(i, w)| {
            **w && matches!(x.args[0].get(*i), Some(Value::Tensor(t)) if t.dtype().is_float())
        })
        .map(|(i, _)| i)
        .collect()
}

/// A check run under `catch_unwind`: its own error, or a panic as `panicked: MESSAGE`.
pub fn caught<T>(outcome: std::thread::Result<Result<T, String>>) -> Result<T, String> {
    outcome.unwrap_or_else(|p| {
        let m = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("panicked: {m}"))
    })
}

/// A `u64` from the environment (the long runs' seeds and counts), else `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Panics with every failing seed and the first failure's report, if any.
pub fn assert_no_failing_seeds(failures: &[(u64, String)]) {
    if let Some((_, first)) = failures.first() {
        let seeds: Vec<u64> = failures.iter().map(|(s, _)| *s).collect();
        panic!(
            "{} failing seeds {seeds:?}; the first:\n{first}",
            seeds.len()
        );
    }
}

/// The tensors of weights `wrt` (indices into `@main`'s arguments), what gradients are taken of.
pub fn weight_tensors(x: &Expected, wrt: &[usize]) -> Vec<tumble_tensor::Tensor> {
    wrt.iter()
        .filter_map(|&i| x.args.first()?.get(i)?.as_tensor().cloned())
        .collect()
}

/// The largest absolute entry of `t`.
pub fn max_abs(t: &tumble_tensor::Tensor) -> f64 {
    t.to_f64_vec().iter().fold(0f64, |m, v| m.max(v.abs()))
}

/// The reference gradient of `main` with respect to weights `wrt`: the reference engine's tape,
/// instance by instance (instance `i` drawing from [`rng`]`(i)`), summed; `Err` with the tape's
/// first error.
pub fn reference_gradient(
    x: &Expected,
    wrt: &[usize],
) -> Result<Vec<Option<tumble_tensor::Tensor>>, String> {
    let program =
        Program::lower_with(&x.l.typed, LowerOptions::reference()).map_err(|e| e.message)?;
    let mut total: Vec<Option<tumble_tensor::Tensor>> = vec![None; wrt.len()];
    for (i, a) in x.args.iter().enumerate() {
        let mut r = rng(i);
        let g = tumble_interp::tape::grad(&program, "main", a.clone(), wrt, &mut r)
            .map_err(|e| e.message.clone())?;
        for (slot, g) in total.iter_mut().zip(g.grads) {
            if let Some(g) = g {
                tumble_interp::tape::accumulate(slot, g).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(total)
}

/// The batched gradient of `main` with respect to weights `wrt` over `x`'s instances in
/// mini-batches of `batch`, summed (instance `i` draws from [`rng`]`(i)`), with how many
/// invocations took an identical one's results and how many launches the backward
/// differentiated; `Err` with the first mini-batch's error.
#[allow(clippy::too_many_arguments)]
pub fn gradients_in_chunks(
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    x: &Expected,
    wrt: &[usize],
    batch: usize,
    opts: Options,
    gopts: tumble_runtime::backward::GradOptions,
) -> Result<(Vec<Option<tumble_tensor::Tensor>>, u64, u64), String> {
    let params = weight_tensors(x, wrt);
    let mut total: Vec<Option<tumble_tensor::Tensor>> = vec![None; wrt.len()];
    let (mut memoized, mut launches) = (0, 0);
    for (c, chunk) in x.args.chunks(batch).enumerate() {
        let rngs = (0..chunk.len()).map(|k| rng(c * batch + k)).collect();
        let g = tumble_runtime::backward::grad_batch(
            program,
            reuse,
            "main",
            chunk.to_vec(),
            rngs,
            opts,
            gopts,
            &params,
        )
        .map_err(|e| e.error.message.clone())?;
        memoized += g.stats.memoized;
        launches += g.stats.launches;
        for (slot, g) in total.iter_mut().zip(g.grads) {
            if let Some(g) = g {
                g.add_into(slot).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok((total, memoized, launches))
}

/// Structural equality with float tolerance.
pub fn same(a: &Value, b: &Value, path: &str) -> Result<(), String> {
    same_within(a, b, path, 1e-6)
}

/// Equal within the usual tolerance, except that an f32 result within a factor 4 of the largest
/// float may stand against an infinity of the same sign: one engine's intermediate crossed
/// `f32::MAX` where another's, summing or rounding in another order, stayed just below it
/// (generated programs square and exponentiate recursively; seed 3992 ends at 1.65e38 against
/// `inf`). Any other difference still fails.
fn same_but_overflow(x: &tumble_tensor::Tensor, y: &tumble_tensor::Tensor, atol: f64) -> bool {
    let (a, b) = (x.to_f64_vec(), y.to_f64_vec());
    let near_max = f64::from(f32::MAX) / 4.0;
    a.len() == b.len()
        && a.iter()
            .zip(&b)
            .any(|(p, q)| p.is_infinite() != q.is_infinite())
        && a.iter().zip(&b).all(|(&p, &q)| {
            let one = |p: f64, q: f64| {
                p.is_infinite() && q.is_finite() && q.abs() >= near_max && p.signum() == q.signum()
            };
            let close = (p.is_nan() && q.is_nan())
                || p == q
                || (p.is_finite() && q.is_finite() && (p - q).abs() <= atol + 1e-5 * q.abs());
            close || one(p, q) || one(q, p)
        })
}

/// Equal within the usual tolerance plus a millionth of the tensor's largest magnitude: an f32
/// element computed by summing terms of the tensor's scale carries rounding errors of that
/// scale, however small the element itself ends (a cancellation). Seed 3,300,587 of the
/// generated programs: an element -0.110733 against -0.110716 in a (4, 2) result whose largest
/// is 228.6 — 1.7e-5 apart, where the per-element bound allowed 2.1e-6. A wrong value is
/// still far outside this.
fn same_at_scale(x: &tumble_tensor::Tensor, y: &tumble_tensor::Tensor, atol: f64) -> bool {
    let (a, b) = (x.to_f64_vec(), y.to_f64_vec());
    let scale = b
        .iter()
        .fold(0f64, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
    a.len() == b.len()
        && a.iter().zip(&b).all(|(&p, &q)| {
            (p.is_nan() && q.is_nan())
                || p == q
                || (p.is_finite()
                    && q.is_finite()
                    && (p - q).abs() <= atol + 1e-5 * q.abs() + 1e-6 * scale)
        })
}

/// [`same`] with absolute tolerance `atol` (and relative tolerance 1e-5).
pub fn same_within(a: &Value, b: &Value, path: &str, atol: f64) -> Result<(), String> {
    let same = |a: &Value, b: &Value, path: &str| same_within(a, b, path, atol);
    match (a, b) {
        (Value::Tensor(x), Value::Tensor(y)) => {
            if x.shape() != y.shape() || x.dtype() != y.dtype() {
                return Err(format!("{path}: {x} vs {y}"));
            }
            if x.allclose(y, 1e-5, atol)
                || same_at_scale(x, y, atol)
                || same_but_overflow(x, y, atol)
            {
                Ok(())
            } else {
                Err(format!("{path}: values differ: {x} vs {y}"))
            }
        }
        (Value::Tuple(x), Value::Tuple(y)) if x.0.len() == y.0.len() => {
            for (i, (p, q)) in x.0.iter().zip(&y.0).enumerate() {
                same(p, q, &format!("{path}.{i}"))?;
            }
            Ok(())
        }
        (Value::Adt(x), Value::Adt(y)) if x.ctor == y.ctor && x.fields.len() == y.fields.len() => {
            for (i, (p, q)) in x.fields.iter().zip(&y.fields).enumerate() {
                same(p, q, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        _ => Err(format!("{path}: different structure: {a:?} vs {b:?}")),
    }
}

/// A program loaded, with its instances and the reference interpreter's outputs for them.
pub struct Expected {
    pub name: String,
    pub l: Loaded,
    pub args: Vec<Vec<Value>>,
    pub outputs: Vec<Value>,
    /// Per `@main` parameter: a model weight (not per-instance).
    pub weights: Vec<bool>,
    /// Absolute tolerance of the comparison with the reference (relative: 1e-5).
    pub atol: f64,
}

/// Runs the reference engine on `inputs`; `@main` arguments named in `instance_args` are
/// per-instance, every other one is a weight.
pub fn expected(name: &str, l: Loaded, inputs: &str, instance_args: &[&str]) -> Expected {
    let (mut x, results) = reference_outcomes(name, l, inputs, instance_args);
    x.outputs = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{name} reference: {}", e.message)))
        .collect();
    x
}

/// The reference engine's output or error for every instance, and the rest of [`Expected`]
/// (whose `outputs` are left empty: see [`check_outcomes`]).
pub fn reference_outcomes(
    name: &str,
    l: Loaded,
    inputs: &str,
    instance_args: &[&str],
) -> (Expected, Vec<Result<Value, RunError>>) {
    let reference = Program::lower_with(&l.typed, LowerOptions::reference())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let args = instances(&l, &reference, inputs);
    assert!(!args.is_empty(), "{name}: no instances");
    let results: Vec<Result<Value, RunError>> = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut r = rng(i);
            tumble_interp::run(&reference, "main", a.clone(), &mut r)
        })
        .collect();
    let (params, _) = main_signature(&l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
    let weights = params
        .iter()
        .map(|(n, _)| !instance_args.contains(&n.as_str()))
        .collect();
    let x = Expected {
        name: name.to_string(),
        l,
        args,
        outputs: Vec::new(),
        weights,
        atol: 1e-6,
    };
    (x, results)
}

/// Where an error points, for messages: `file:line:col`, or `no span`.
pub fn span_text(l: &Loaded, e: &RunError) -> String {
    match e.span {
        None => "no span".to_string(),
        Some(sp) => match l.sources.get(sp.src) {
            Some(f) => {
                let (line, col) = f.line_col(sp.lo as usize);
                format!("{}:{line}:{col}", f.name)
            }
            None => format!("{sp:?}"),
        },
    }
}

/// The batched engine's error `got` is the reference's `want`: the same message, pointing at
/// the same place of the program. An error in a batched launch names the block
/// ("in block NAME: ...") and points at the failing operator, as the reference does.
pub fn same_error(got: &RunError, want: &RunError) -> bool {
    // `@hd`/`@tl` of `Nil` run natively fail at the user's call; interpreted (the reference),
    // in the prelude's `match?`, whose innermost caller is that same call.
    let native_empty = ["`@hd` of an empty list", "`@tl` of an empty list"]
        .iter()
        .any(|m| got.message.starts_with(m));
    if native_empty {
        return want
            .message
            .starts_with("no arm of this `match?` covers the value (`Nil")
            && got.span.is_some()
            && want.trace.first() == got.span.as_ref();
    }
    let message = got.message == want.message
        || got
            .message
            .strip_prefix("in block ")
            .and_then(|m| m.split_once(": "))
            .is_some_and(|(_, m)| m == want.message);
    message && got.span == want.span
}

/// Every instance of `x` run in mini-batches of `batch` (instance `i` drawing from [`rng`]`(i)`),
/// the results in order; the first failing mini-batch's error.
pub fn run_in_batches(
    x: &Expected,
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    batch: usize,
    opts: Options,
) -> Result<Vec<Value>, RunError> {
    let mut all = Vec::with_capacity(x.args.len());
    for (c, chunk) in x.args.chunks(batch).enumerate() {
        let rngs = (0..chunk.len()).map(|k| rng(c * batch + k)).collect();
        let (vals, _) =
            run_batch(program, reuse, "main", chunk.to_vec(), rngs, opts).map_err(|e| e.error)?;
        all.extend(vals);
    }
    Ok(all)
}

/// [`check_batched`] against per-instance reference outcomes that may be errors: a mini-batch
/// holding an instance the reference fails on must fail, with that instance's error (see
/// [`same_error`]); any other mini-batch must give the reference's outputs.
pub fn check_outcomes(
    x: &Expected,
    results: &[Result<Value, RunError>],
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    batch: usize,
    opts: Options,
) -> Result<(), String> {
    for (c, chunk) in x.args.chunks(batch).enumerate() {
        let base = c * batch;
        let want = &results[base..base + chunk.len()];
        let rngs = (0..chunk.len()).map(|k| rng(base + k)).collect();
        let got = run_batch(program, reuse, "main", chunk.to_vec(), rngs, opts);
        match got {
            Ok((vals, _)) => {
                for (k, (g, w)) in vals.iter().zip(want).enumerate() {
                    match w {
                        // Generated programs subtract values of size about 1 from one another:
                        // differences in the last bits of f32 (the kernels sum in other orders)
                        // then reach 1e-6 and more, absolute, on results near 0.
                        Ok(w) => same_within(g, w, "", 1e-5)
                            .map_err(|m| format!("instance {}: {m}", base + k))?,
                        Err(e) => {
                            return Err(format!(
                                "instance {}: the reference fails ({}: {}), the batched engine \
                                 gives {g:?}",
                                base + k,
                                span_text(&x.l, e),
                                e.message
                            ))
                        }
                    }
                }
            }
            Err(ie) => {
                let got = format!("{}: {}", span_text(&x.l, &ie.error), ie.error.message);
                // The failing instance, where the engine names it; else any failing one.
                let at = ie
                    .instance
                    .map(|i| vec![i])
                    .unwrap_or_else(|| (0..chunk.len()).collect());
                let matches = at
                    .iter()
                    .any(|&i| matches!(want.get(i), Some(Err(e)) if same_error(&ie.error, e)));
                if !matches {
                    let wants: Vec<String> = want
                        .iter()
                        .enumerate()
                        .map(|(k, w)| match w {
                            Ok(_) => format!("  instance {}: ok", base + k),
                            Err(e) => format!(
                                "  instance {}: {}: {}",
                                base + k,
                                span_text(&x.l, e),
                                e.message
                            ),
                        })
                        .collect();
                    return Err(format!(
                        "batched engine fails on instance {:?} of mini-batch {c} ({got}); \
                         the reference:\n{}",
                        ie.instance.map(|i| base + i),
                        wants.join("\n")
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The batched program with the given coarsening and static optimizations, and its reuse analysis.
pub fn compile(
    x: &Expected,
    coarsen: bool,
    statics: tumble_compile::StaticOptions,
) -> (Program, tumble_compile::ReuseAnalysis) {
    compile_natives(x, coarsen, statics, true)
}

/// [`compile`] with the prelude's native forms on or off (`LowerOptions::natives`).
pub fn compile_natives(
    x: &Expected,
    coarsen: bool,
    statics: tumble_compile::StaticOptions,
    natives: bool,
) -> (Program, tumble_compile::ReuseAnalysis) {
    // The faces' pipeline; plans are made per run by `run_batch`, for each switch set.
    let compiled = tumble_compile::compile(
        &x.l.typed,
        "main",
        &x.weights,
        tumble_compile::CompileOptions {
            lower: LowerOptions {
                blocks: true,
                coarsen,
                fold: coarsen,
                inline: coarsen,
                natives,
            },
            statics: Some(statics),
            plans: None,
        },
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    (compiled.program, compiled.reuse)
}

/// The profile of one batched run of `x`'s instances as one mini-batch (coarsened, all static
/// optimizations on) under `opts`.
pub fn batch_profile(x: &Expected, opts: Options) -> tumble_runtime::Profile {
    let (program, reuse) = compile(x, true, tumble_compile::StaticOptions::all());
    run_once(x, &program, &reuse, opts).1
}

/// `program` run on all of `x`'s instances as one mini-batch under `opts`: the results and the
/// profile.
pub fn run_once(
    x: &Expected,
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    opts: Options,
) -> (Vec<tumble_interp::Value>, tumble_runtime::Profile) {
    let rngs = (0..x.args.len()).map(rng).collect();
    run_batch(program, reuse, "main", x.args.clone(), rngs, opts)
        .unwrap_or_else(|e| panic!("{}: {}", x.name, e.error.message))
}

/// Runs every instance in mini-batches of `batch` and checks each output against the reference.
/// `x`'s instances run as mini-batches of `batch` of one job (later ones take the results
/// earlier ones kept): the results, and the mini-batches' profiles added up.
pub fn run_in_mini_batches(
    x: &Expected,
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    batch: usize,
    opts: Options,
    label: &str,
) -> (Vec<Value>, tumble_runtime::Profile) {
    let exec = std::sync::Arc::new(tumble_runtime::Executable::new(program, reuse, &opts));
    let mut got = Vec::new();
    let mut profile = tumble_runtime::Profile::default();
    for (c, chunk) in x.args.chunks(batch).enumerate() {
        let rngs = (0..chunk.len()).map(|k| rng(c * batch + k)).collect();
        let (vals, p) =
            tumble_runtime::run_batch_on(program, reuse, &exec, "main", chunk.to_vec(), rngs, opts)
                .unwrap_or_else(|e| panic!("{label}: {}", e.error.message));
        got.extend(vals);
        profile.add(&p);
    }
    (got, profile)
}

pub fn check_batched(
    x: &Expected,
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    batch: usize,
    opts: Options,
    label: &str,
) {
    // Outputs the kernels claim to overwrite whole start as NaN here: anything they leave
    // unwritten shows up as a mismatch.
    tumble_tensor::pool::set_poison_scratch(true);
    let (got, _) = run_in_mini_batches(x, program, reuse, batch, opts, label);
    assert_eq!(got.len(), x.outputs.len());
    for (i, (g, e)) in got.iter().zip(&x.outputs).enumerate() {
        if let Err(m) = same_within(g, e, "", x.atol) {
            panic!("{label}, instance {i}: {m}");
        }
    }
}

/// The batched engine agrees with the reference under every scheduler, at mini-batch sizes
/// 1, 7 and 64, with grain coarsening, kernel plans and the plan-level optimizations on and off.
pub fn check_all_ways(x: &Expected) {
    // (grain coarsening, kernel plans, the plan-level optimizations — row-program cache,
    // horizontal fusion): the default, those off, plans off, and operator-level blocks.
    for (coarsen, fusion, planopt) in [
        (true, true, true),
        (true, true, false),
        (true, false, false),
        (false, true, true),
    ] {
        // The static optimizations go with the kernel plans: all on, or all off.
        let statics = if fusion {
            tumble_compile::StaticOptions::all()
        } else {
            tumble_compile::StaticOptions::none()
        };
        let (program, reuse) = compile(x, coarsen, statics);
        for scheduler in [
            Scheduler::Inline,
            Scheduler::Depth,
            Scheduler::Agenda,
            Scheduler::Eager,
        ] {
            for batch in [1usize, 7, 64] {
                let opts = Options {
                    scheduler,
                    host_scalars: true,
                    fusion,
                    row_cache: planopt,
                    hfuse: planopt,
                    gather_fusion: planopt,
                    epilogue: planopt,
                    phases: fusion,
                    hoist: fusion,
                    ghosts: fusion,
                    dup: fusion,
                    lend_threads: fusion,
                    sum_fusion: fusion,
                    // Off at one configuration: outputs are kept to the end there.
                    early_release: planopt || batch == 7,
                    // A scan before every flush (the zoo's outputs are small once scaled down).
                    release_scan_bytes: 0,
                    locality_chunks: fusion,
                    // Off at one batch size: weights chosen per instance are gathered there.
                    weight_groups: fusion && batch != 7,
                    // Off at one batch size: slices of weights are taken per invocation there.
                    weight_slices: fusion && batch != 64,
                    defer: fusion,
                    direct_matmul: planopt,
                    gather_views: planopt,
                    dense_sums: planopt,
                    ragged: fusion,
                    // Tiny chunks at one batch size: chunking must not change results.
                    ragged_chunk_rows: if batch == 7 { 3 } else { 0 },
                    // The padding baseline at one configuration: it must not change results.
                    ragged_padding: batch == 64 && !planopt,
                    // Off at one configuration: the grouped mixing segments stay checked.
                    mixing_kernels: batch != 7,
                    emulated_device: false,
                    // Off at one configuration: the launches computing everything stay checked.
                    job_memo: batch != 64 || planopt,
                    // Off at one batch size: concurrent elements that wait stay whole there.
                    fibers: batch != 7,
                    threads: if batch == 7 { 2 } else { 1 },
                };
                let label = format!(
                    "{} {scheduler:?} batch {batch} coarsen {coarsen} fusion {fusion} planopt {planopt}",
                    x.name
                );
                check_batched(x, &program, &reuse, batch, opts, &label);
            }
        }
        // The GPU executor (on a device emulated in host memory), with every plan on: what goes
        // to the device, its views, strides and copies, against the reference.
        if fusion && planopt {
            for batch in [7usize, 64] {
                let opts = Options {
                    emulated_device: true,
                    release_scan_bytes: 0,
                    ..Options::default()
                };
                let label = format!("{} emulated device batch {batch} coarsen {coarsen}", x.name);
                check_batched(x, &program, &reuse, batch, opts, &label);
            }
        }
    }
}

/// A list of `n` rows `[[..]]` of `width` values for instance `i`, all different: the JSON of a
/// `List[Tensor[(1, width), float32]]` argument.
pub fn row_list(i: usize, n: usize, width: usize) -> String {
    let steps: Vec<String> = (0..n)
        .map(|t| {
            let v: Vec<String> = (0..width)
                .map(|j| format!("{:.3}", ((i * 5 + t * 3 + j) % 11) as f64 / 5.0 - 1.0))
                .collect();
            format!("[[{}]]", v.join(", "))
        })
        .collect();
    format!("[{}]", steps.join(", "))
}

/// A `(rows, width)` matrix `[[..], ..]` for instance `i`, its rows all different: the JSON of a
/// `Tensor[(rows, width), float32]` argument.
pub fn matrix(i: usize, rows: usize, width: usize) -> String {
    let rows: Vec<String> = (0..rows)
        .map(|r| {
            let v: Vec<String> = (0..width)
                .map(|j| format!("{:.3}", ((i * 5 + r * 7 + j * 3) % 13) as f64 / 4.0 - 1.5))
                .collect();
            format!("[{}]", v.join(", "))
        })
        .collect();
    format!("[{}]", rows.join(", "))
}

/// `count` instances of `x: (len_i, w)` floats, `len_i` cycling through `lens`.
pub fn var_rows(count: usize, w: usize, lens: &[usize]) -> String {
    (0..count)
        .map(|i| {
            let n = lens[i % lens.len()];
            let rows: Vec<String> = (0..n)
                .map(|r| {
                    let row: Vec<String> = (0..w)
                        .map(|j| {
                            format!("{:.3}", ((i * 7 + r * 5 + j * 3) % 13) as f64 / 6.0 - 1.0)
                        })
                        .collect();
                    format!("[{}]", row.join(", "))
                })
                .collect();
            format!("{{\"x\": [{}]}}", rows.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// 24 typed-edge graphs (`{"feat": [...], "nodes": [...]}`): graph g has 2 + g % 5 nodes; node v
/// has 1 + (v + g) % 3 incoming edges, edge j from node (v + j + 1) % n of type (g + v + j) % 3 —
/// or, now and then, 5 or -1 (clipped to 2 and 0).
pub fn typed_edge_graphs() -> Vec<String> {
    (0..24)
        .map(|g| {
            let n = 2 + g % 5;
            let feat: Vec<String> = (0..n).map(|v| ((g * 3 + v) % 10).to_string()).collect();
            let nodes: Vec<String> = (0..n)
                .map(|v| {
                    let e = 1 + (v + g) % 3;
                    let src: Vec<String> = (0..e).map(|j| ((v + j + 1) % n).to_string()).collect();
                    let typ: Vec<String> = (0..e)
                        .map(|j| match (g + 2 * v + j) % 11 {
                            0 => "5".to_string(),
                            1 => "-1".to_string(),
                            _ => ((g + v + j) % 3).to_string(),
                        })
                        .collect();
                    format!("[[{v}], [{}], [{}], {e}]", src.join(", "), typ.join(", "))
                })
                .collect();
            format!(
                "{{\"feat\": [{}], \"nodes\": [{}]}}",
                feat.join(", "),
                nodes.join(", ")
            )
        })
        .collect()
}

/// A typed-edge graph network's rounds (`@edges`, `@node`, `@round`), for a `@main` to call
/// over [`typed_edge_graphs`]: a node sums its incoming edges' messages, each the neighbour's row
/// times the matrix its edge type picks out of a stacked weight, `take(%Ws, take(%types, %k))`.
pub const TYPED_EDGE_ROUNDS: &str = r#"
def @edges(%S: Tensor[(?, 8), float32], %src: Tensor[(?), int32], %typ: Tensor[(?), int32], %n: Tensor[(), int32],
           %k: Tensor[(), int32], %acc: Tensor[(1, 8), float32], %Ws: Tensor[(3, 8, 8), float32]) -> Tensor[(1, 8), float32] {
  if (less(%k, %n)) {
    let %h = take(%S, expand_dims(take(%src, %k), axis=0), axis=0);
    let %W = take(%Ws, take(%typ, %k), axis=0);
    @edges(%S, %src, %typ, %n, add(%k, 1), add(%acc, nn.dense(%h, %W)), %Ws)
  } else {
    %acc
  }
}
def @node(%S: Tensor[(?, 8), float32], %i: Tensor[(1), int32], %src: Tensor[(?), int32], %typ: Tensor[(?), int32],
          %n: Tensor[(), int32], %Ws: Tensor[(3, 8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  let %m = @edges(%S, %src, %typ, %n, 0, zeros(shape=[1, 8], dtype="float32"), %Ws);
  tanh(add(nn.dense(take(%S, %i, axis=0), %U), %m))
}
def @round(%S: Tensor[(?, 8), float32], %nodes: List[(Tensor[(1), int32], Tensor[(?), int32], Tensor[(?), int32], Tensor[(), int32])],
           %Ws: Tensor[(3, 8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(?, 8), float32] {
  match? (%nodes) {
    Cons(%nd, Nil) => @node(%S, %nd.0, %nd.1, %nd.2, %nd.3, %Ws, %U),
    Cons(%nd, %rest) => concatenate((@node(%S, %nd.0, %nd.1, %nd.2, %nd.3, %Ws, %U), @round(%S, %rest, %Ws, %U)), axis=0),
  }
}
"#;
