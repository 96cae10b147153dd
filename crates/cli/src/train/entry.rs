//! The entry function compiled for gradients: the model loaded and type-checked, the entry's
//! float parameters bound from the weights, its instances decoded, and its gradients over a
//! mini-batch by the batched backward (traced instances replayed).

use super::*;

/// An entry function compiled for the batched runtime with the weights bound.
pub(super) struct Compiled {
    entry: String,
    program: std::sync::Arc<Program>,
    reuse: std::sync::Arc<ReuseAnalysis>,
    pub(super) bound: BoundParams,
    /// The executable of this worker's gradients ([`Compiled::grad`]): planned at the first
    /// mini-batch, then kept for the job.
    exec: std::sync::OnceLock<std::sync::Arc<tumble_runtime::Executable>>,
}

impl Clone for Compiled {
    /// A copy for another worker, which plans its own executable.
    fn clone(&self) -> Self {
        Compiled {
            entry: self.entry.clone(),
            program: self.program.clone(),
            reuse: self.reuse.clone(),
            bound: self.bound.clone(),
            exec: std::sync::OnceLock::new(),
        }
    }
}

pub(super) fn load_typed(path: &Path, sources: &mut SourceMap) -> Result<TypedModule, Failure> {
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
pub(super) fn check_scalar(
    typed: &TypedModule,
    entry: &str,
    ret: &Ty,
    why: &str,
) -> Result<(), Failure> {
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

pub(super) fn entry_name(s: &str) -> &str {
    s.strip_prefix('@').unwrap_or(s)
}

/// Compiles `entry` with the parameters in `file` (plus random ones from `random`) bound; the
/// instances `raw` provide the other arguments.
pub(super) fn compile(
    typed: &TypedModule,
    entry: &str,
    raw: &RawInstances,
    file: &BTreeMap<String, Tensor>,
    random: Option<u64>,
) -> Result<Compiled, Failure> {
    let (c, warnings) = compile_bound(typed, entry, raw, file, random)?;
    for w in &warnings {
        if !w.contains("not an argument") {
            eprintln!("warning: {w}");
        }
    }
    Ok(c)
}

/// [`compile`], handing back the binding's warnings instead of printing them.
pub(super) fn compile_bound(
    typed: &TypedModule,
    entry: &str,
    raw: &RawInstances,
    file: &BTreeMap<String, Tensor>,
    random: Option<u64>,
) -> Result<(Compiled, Vec<String>), Failure> {
    let (params, _) = main_signature(typed, entry)?;
    let provided = raw.provided_args(&params, file);
    let bound = bind_params(&params, &provided, file, random)?;
    let warnings = bound.warnings.clone();
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
                for_gradients: true,
                ..tumble_compile::StaticOptions::all()
            }),
            ..tumble_compile::CompileOptions::batched()
        },
    )
    .map_err(|e| Failure::Diags(vec![Diagnostic::error(e.span, e.message)]))?;
    let (program, reuse) = (compiled.program, compiled.reuse);
    Ok((
        Compiled {
            entry: entry.to_string(),
            program: std::sync::Arc::new(program),
            reuse: std::sync::Arc::new(reuse),
            bound,
            exec: std::sync::OnceLock::new(),
        },
        warnings,
    ))
}

impl Compiled {
    /// The float parameters: (name, tensor), in argument order.
    pub(super) fn float_params(&self) -> Vec<(String, Tensor)> {
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
    pub(super) fn all_params(&self) -> BTreeMap<String, Tensor> {
        self.bound.weight_tensors()
    }

    /// The bound tensor of parameter `name` (the optimizer updates it in place).
    pub(super) fn param_mut(&mut self, name: &str) -> Option<&mut Tensor> {
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
    pub(super) fn rebind(&mut self, w: &BTreeMap<String, Tensor>) {
        for a in &mut self.bound.args {
            if let (Binding::Param(t), Some(new)) = (&mut a.binding, w.get(&a.name)) {
                *t = new.clone();
            }
        }
    }

    /// Lets go of the bound tensors of parameters `names` (a training worker between steps: the
    /// optimizer updates weights in place only where it holds the one reference).
    pub(super) fn release(&mut self, names: &[String]) {
        for a in &mut self.bound.args {
            if let Binding::Param(t) = &mut a.binding {
                if names.contains(&a.name) {
                    *t = Tensor::scalar_f32(0.0);
                }
            }
        }
    }

    /// The instance arguments of every instance of `raw`, decoded once.
    pub(super) fn decode(
        &self,
        typed: &TypedModule,
        raw: &RawInstances,
    ) -> Result<Vec<Vec<Value>>, Failure> {
        let env = TypeEnv::new(typed, &self.program);
        let args = self.bound.instance_args();
        (0..raw.items.len())
            .map(|i| raw.decode_one(i, &env, &args).map_err(Failure::from))
            .collect()
    }

    /// Decodes the instances `which` of `raw` not decoded yet into `cache` (indexed like `raw`;
    /// `done` says which are): a training worker decodes only the instances its parts bring.
    pub(super) fn decode_some(
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
    pub(super) fn location(raw: &RawInstances, i: usize) -> String {
        raw.items.get(i).map_or_else(
            || format!("{}: instance {i}", raw.source_name),
            |it| format!("{}: instance at {}", raw.source_name, it.location),
        )
    }

    /// The first instance of `which` (with its loss at the same place of `losses`) whose loss is
    /// NaN or infinite: where it is and the value.
    pub(super) fn non_finite_loss(
        raw: &RawInstances,
        which: &[usize],
        losses: &[f64],
    ) -> Option<String> {
        which
            .iter()
            .zip(losses)
            .find(|(_, l)| !l.is_finite())
            .map(|(&i, l)| format!("{}: @main's output is {l}", Self::location(raw, i)))
    }

    pub(super) fn run_error(raw: &RawInstances, i: usize, e: tumble_interp::RunError) -> Failure {
        let message = format!("{}: {}", Self::location(raw, i), e.message);
        match e.span {
            Some(span) => Failure::Diags(vec![Diagnostic::error(span, message)]),
            None => Failure::Message(message),
        }
    }

    /// Each instance's output of the entry (a float scalar), in mini-batches of `batch`; with
    /// `traces` (one slot per instance of `decoded`), each instance's first run is recorded and
    /// the later ones replay it (the dev set, evaluated after every epoch).
    pub(super) fn outputs(
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
    /// Every call runs on this worker's executable (its plans made once, with the first call's
    /// `opts`, the same for every call of a job); with `weights_change` (a trainer, about to
    /// update the weights in place) it forgets what it computed from their values when done.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grad(
        &self,
        raw: &RawInstances,
        decoded: &[Vec<Value>],
        which: &[usize],
        params: &[Tensor],
        opts: Options,
        gopts: GradOptions,
        seed: u64,
        traces: Option<&TraceCache>,
        weights_change: bool,
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
        let exec = self.exec.get_or_init(|| {
            std::sync::Arc::new(tumble_runtime::Executable::new(
                &self.program,
                &self.reuse,
                &opts,
            ))
        });
        let g = tumble_runtime::backward::grad_batch_in(
            exec,
            &self.program,
            &self.reuse,
            &self.entry,
            args,
            rngs,
            opts,
            gopts,
            params,
            slots.as_deref(),
        );
        if weights_change {
            exec.forget_weight_values();
        }
        let g = g.map_err(|e| {
            let i = e.instance.and_then(|k| which.get(k)).copied().unwrap_or(0);
            Self::run_error(raw, i, e.error)
        })?;
        stats.add(&g.stats);
        Ok((g.losses, g.grads))
    }
}
