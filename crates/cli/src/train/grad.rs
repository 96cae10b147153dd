//! `tumble grad`: the gradient of the sum of `@main` over the instances, written as one tensor
//! per parameter.

use super::*;

/// Instances per mini-batch of `tumble grad` without `--batch`: `run`'s default size. The
/// backward keeps the forward's values, so a mini-batch's memory grows with it, and past ~128
/// instances the pages it faults in cost more than wider launches save (1,024 sentences of a
/// seq2seq: 1.94 s and 330 MB in mini-batches of 128, 2.43 s and 1.6 GB as one).
const GRAD_BATCH: usize = tumble_runtime::DEFAULT_BATCH;

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
pub(super) fn non_finite_param(weights: &BTreeMap<String, Tensor>) -> Option<&str> {
    weights
        .iter()
        .find(|(_, t)| !t.all_finite())
        .map(|(n, _)| n.as_str())
}

/// An instance whose loss is NaN or infinite makes every gradient of the sum so: refused, named.
fn not_finite(at: &str) -> Failure {
    Failure::Message(format!(
        "{at}, so the gradient of the sum is not finite either; nothing was written"
    ))
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
    let file = read_weights(
        &args.weights,
        crate::run::thread_count(args.weights.threads)?,
    )?;
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
            if let Some(at) = Compiled::non_finite_loss(&raw, &[i], &[g.loss]) {
                return Err(not_finite(&at));
            }
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
        let batch = args
            .batch
            .unwrap_or_else(|| n.div_ceil(n.div_ceil(GRAD_BATCH).max(1)))
            .max(1);
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
                if let Some(at) = Compiled::non_finite_loss(&raw, which, &losses) {
                    return Err(not_finite(&at));
                }
                // A finite loss whose derivative is not (`sqrt` or `log` at 0): named by its
                // instance, found by differentiating the mini-batch's instances one by one.
                if let Some(k) = gs
                    .iter()
                    .position(|g| g.as_ref().is_some_and(|g| !g.is_finite()))
                {
                    let name = names.get(k).map_or("?", String::as_str);
                    let at = pool.instance_with_non_finite_gradient(
                        &c, &decoded, which, &by_name, setup, &mut stats, k,
                    )?;
                    if let Some(i) = at {
                        return Err(Failure::Message(format!(
                            "{}: the gradient of @main's output with respect to %{name} is \
                             not finite though the output is (an operator's derivative is \
                             infinite there: a sqrt or log at 0?); nothing was written",
                            Compiled::location(&raw, i)
                        )));
                    }
                    return Err(Failure::Message(format!(
                        "the gradient with respect to %{name} is not finite though every \
                         output is; nothing was written"
                    )));
                }
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
             invocations computed once for identical ones {}, operators computed inside another's \
             kernel by the kept forward {}, splits differentiated with their gates in one pass {}; \
             peak heap per mini-batch {}\n\
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
            stats.forward.ops.kept_fused,
            stats.split_vjps_fused,
            tumble_limits::bytes_text(stats.peak_bytes),
            stats.forward.run_split()
        );
    }
    Ok(())
}
