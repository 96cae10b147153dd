//! tumble as a library: the sequence of `tumble run` (parse and check → lower → bind parameters
//! → static optimizations and reuse analysis → decode instances → run mini-batches → results)
//! as one type, [`Model`], loaded once and run any number of times, from any number of threads.
//!
//! Faces (the Python package, a server) build on this crate; the CLI keeps its own copy of the
//! sequence for its extra switches (reference engine, `--repeat`, summaries) and its output files.
//!
//! Instances come in as [`RawInstance`]s: JSON in the CLI's encoding, plus tensors the caller
//! built already ([`RawInstance::with_tensors`]), so the located messages of the JSON decoder
//! ("instance at index 3: .tree.Rose[1][0]: expected ...") are the same for every face. Results
//! go out as [`OutTree`]s, owned trees of tensors that can cross threads.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tumble_check::{display_sig, LoadOptions as CheckOptions};
use tumble_compile::{
    CompileOptions, Compiled, InputReuse, LowerOptions, StaticOptions, StaticReport,
};
use tumble_interp::{Program, RunError};
use tumble_io::{
    bind_params, load_params_on, main_signature, to_tree, Binding, BoundParams, TypeEnv,
};
use tumble_ir::{diag, DType, Diagnostic, SourceMap, Ty};
use tumble_runtime::{Executable, Options, Profile, Reuse, Scheduler};
use tumble_tensor::{Rng, Tensor};

pub use tumble_io::decode::shorten;
pub use tumble_io::{
    Doc, Kind, Location, Num, OutTree, RawInstance, RawInstances, ATTACHED_TENSOR_KEY,
};

/// The deepest nesting of an instance read (JSON arrays/objects, or a face's own values).
pub const MAX_INPUT_DEPTH: usize = tumble_io::MAX_DEPTH;

/// Stack of the thread a run (and the decoding of deep instances) happens on: the CLI's.
pub const WORK_STACK_BYTES: usize = 256 << 20;

/// Why loading or running a model failed. Every message names the place: the source line for
/// check errors, the instance and the path inside it for bad instances, the tensor for weights.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The model does not parse or type-check (rendered diagnostics), or cannot be read.
    Check { message: String },
    /// Weights: a file that cannot be read, a missing, mistyped or ambiguous parameter.
    Param { message: String },
    /// Instance `instance` (0-based) does not match `@main`'s argument types.
    Input { instance: usize, message: String },
    /// Running instance `instance` failed (shape error at run time, memory budget, ...).
    Run { instance: usize, message: String },
    /// The result of `instance` has no data form (e.g. a function).
    Output { instance: usize, message: String },
    /// A bad option (`batch=0`, an unknown scheduler, ...).
    Usage { message: String },
}

impl Error {
    pub fn message(&self) -> &str {
        match self {
            Error::Check { message }
            | Error::Param { message }
            | Error::Input { message, .. }
            | Error::Run { message, .. }
            | Error::Output { message, .. }
            | Error::Usage { message } => message,
        }
    }

    /// The instance at fault, for the kinds that have one.
    pub fn instance(&self) -> Option<usize> {
        match self {
            Error::Input { instance, .. }
            | Error::Run { instance, .. }
            | Error::Output { instance, .. } => Some(*instance),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message().trim_end())
    }
}

impl std::error::Error for Error {}

/// Where the model's text comes from.
pub enum Source<'a> {
    File(&'a Path),
    /// Text, with the name messages show for it.
    Text {
        name: &'a str,
        text: &'a str,
    },
}

/// Where the parameters (`@main` arguments shared by every instance) come from.
#[derive(Default, Clone)]
pub struct Params {
    /// A safetensors file, a `.npy` file or a directory of `.npy` files.
    pub file: Option<PathBuf>,
    /// Tensors by argument name (may add to the file's; a name in both is an error).
    pub tensors: BTreeMap<String, Tensor>,
    /// Fill the parameters neither gives with seeded random values (normal, 1/sqrt(fan-in)).
    pub random_seed: Option<u64>,
}

/// How a model is compiled.
#[derive(Clone)]
pub struct LoadOptions {
    /// The entry function (`name` or `@name`). For a compiled model, the default `main` means
    /// the entry it was compiled for; another name must be that one.
    pub entry: String,
    /// The `@main` arguments each instance gives. Default: every argument the parameters do not
    /// give; with a random seed, every argument that is not a tensor (tensors are then weights,
    /// generated when missing) — name the inputs here when an instance gives a tensor.
    pub inputs: Option<Vec<String>>,
    pub lower: LowerOptions,
    pub statics: StaticOptions,
    /// Threads that read a large weights file (the same tensors on any count); `None`:
    /// `$TUMBLE_NUM_THREADS`, else the machine's cores — what a run defaults to.
    pub threads: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            entry: "main".into(),
            inputs: None,
            threads: None,
            lower: LowerOptions::batched(),
            statics: StaticOptions::all(),
        }
    }
}

/// How a job runs.
#[derive(Clone, Copy, Default)]
pub struct RunOptions {
    /// Instances per mini-batch; `None`: [`tumble_runtime::default_batch`] (equal mini-batches
    /// of at most 128, one or more per worker when each gets at least 32).
    pub batch: Option<usize>,
    /// Threads in all; `None`: `$TUMBLE_NUM_THREADS`, else the machine's cores.
    pub threads: Option<usize>,
    /// Mini-batches run at once; `None`: one per thread.
    pub workers: Option<usize>,
    /// Seed of `random.db_uniform` draws (instance i draws from its own stream).
    pub seed: u64,
    /// The runtime's switches (`threads` in it is ignored: see [`RunOptions::threads`]).
    pub runtime: Options,
}

/// A scheduler by its CLI name (`inline`, `depth`, `agenda`, `eager`).
pub fn scheduler(name: &str) -> Result<Scheduler, Error> {
    match name {
        "inline" => Ok(Scheduler::Inline),
        "depth" => Ok(Scheduler::Depth),
        "agenda" => Ok(Scheduler::Agenda),
        "eager" => Ok(Scheduler::Eager),
        other => Err(Error::Usage {
            message: format!(
                "unknown scheduler `{}`; expected one of: inline, depth, agenda, eager",
                tumble_io::echo(other)
            ),
        }),
    }
}

/// A stream of `random.db_uniform` draws for instance `i`, independent of batching (the CLI's).
pub fn instance_rng(seed: u64, i: usize) -> Rng {
    Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// One parameter: name, shape, dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Generated from the random seed (not given by the caller).
    pub generated: bool,
}

/// A checked, lowered, optimized model with its parameters bound: ready to run instances.
pub struct Model {
    name: String,
    sources: SourceMap,
    typed: tumble_check::TypedModule,
    program: Program,
    reuse: Reuse,
    entry: String,
    bound: BoundParams,
    instance_args: Vec<(String, Ty)>,
    ret_ty: Ty,
    report: Option<StaticReport>,
    warnings: Vec<String>,
    /// Per program (the one compiled at load, then the small-batch one): the executable
    /// planned for the runtime switches of its last run (plans, compiled row programs, packed
    /// weights), reused while they stay the same — one each, so runs alternating between small
    /// and large mini-batches do not plan and pack again every time.
    executable: Mutex<[Option<Planned>; 2]>,
    /// The model compiled again without block merging, for jobs of mini-batches under
    /// `MERGE_MIN_BATCH` instances, as `tumble run` compiles for them (merging pays only for
    /// larger ones, and the two programs' sums differ in their last bits): a compiled model's
    /// own unmerged program, if it keeps one; `None` for a model loaded without merging or
    /// whose merging changed nothing.
    small_batches: Option<SmallBatches>,
    /// For a model compiled by `tumble compile`, the static optimizations and kernel plans it
    /// was compiled with: its runs leave off the runtime halves of what it was compiled without
    /// ([`Options::within_compiled`]), as `tumble run` does.
    compiled_with: Option<(StaticOptions, Option<tumble_compile::PlanOptions>)>,
}

/// An executable and the runtime switches (threads aside) it was planned for.
type Planned = (Options, Arc<Executable>);

/// See [`Model::small_batches`]: what compiling the model again needs, and the program, compiled
/// on first use.
struct SmallBatches {
    /// What compiling the model again needs: the weights mask and the options (`None`: the
    /// program came compiled, in a compiled model's file).
    recompile: Option<(Vec<bool>, LowerOptions, StaticOptions)>,
    compiled: std::sync::OnceLock<Result<(Program, Reuse), String>>,
}

fn param_error(e: tumble_io::IoError) -> Error {
    Error::Param {
        message: e.to_string(),
    }
}

/// The weights `params` gives: its file's tensors and the tensors passed in (a name in both is
/// an error); the file's warnings go to `warnings`.
fn param_tensors(
    params: &Params,
    threads: Option<usize>,
    warnings: &mut Vec<String>,
) -> Result<BTreeMap<String, Tensor>, Error> {
    let mut tensors = match &params.file {
        Some(p) => {
            let threads = match threads {
                Some(t) => t.clamp(1, tumble_runtime::MAX_THREADS),
                None => default_threads()?,
            };
            let loaded = load_params_on(p, threads).map_err(param_error)?;
            warnings.extend(loaded.warnings);
            loaded.tensors
        }
        None => BTreeMap::new(),
    };
    for (k, t) in &params.tensors {
        if tensors.insert(k.clone(), t.clone()).is_some() {
            return Err(Error::Param {
                message: format!(
                    "parameter `{k}` is given twice: by the weights file and by the tensors \
                     passed in; remove one of them"
                ),
            });
        }
    }
    Ok(tensors)
}

impl Model {
    /// Parses, checks and compiles the model and binds its parameters. A file written by
    /// `tumble compile` (a `.tumble` artifact) is loaded as compiled: see
    /// [`Model::load_compiled`].
    pub fn load(source: Source, params: &Params, opts: &LoadOptions) -> Result<Model, Error> {
        let (name, text) = match source {
            Source::File(path) => {
                let model = tumble_io::artifact::open_model(path).map_err(|e| Error::Check {
                    message: format!("cannot read the model `{}`: {e}", path.display()),
                })?;
                let bytes = match model {
                    tumble_io::artifact::ModelFile::Compiled => {
                        let loaded =
                            tumble_io::artifact::read_artifact_file(path).map_err(param_error)?;
                        return Model::from_compiled(path, loaded, params, opts);
                    }
                    tumble_io::artifact::ModelFile::Bytes(b) => b,
                };
                if tumble_io::artifact::is_artifact(&bytes) {
                    return Model::load_compiled(path, &bytes, params, opts);
                }
                let text = String::from_utf8(bytes).map_err(|e| Error::Check {
                    message: format!(
                        "the model `{}` is not UTF-8 text (invalid byte at offset {})",
                        path.display(),
                        e.utf8_error().valid_up_to()
                    ),
                })?;
                (path.display().to_string(), text)
            }
            Source::Text { name, text } => (name.to_string(), text.to_string()),
        };
        let mut sources = SourceMap::new();
        let typed = tumble_check::load(&mut sources, &name, &text, CheckOptions::default())
            .map_err(|ds| Error::Check {
                message: diag::render(&ds, &sources, false),
            })?;
        let mut warnings: Vec<String> = typed
            .warnings
            .iter()
            .map(|w| diag::render(std::slice::from_ref(w), &sources, false))
            .collect();
        let entry = opts.entry.trim_start_matches('@').to_string();
        let (main_params, ret_ty) = main_signature(&typed, &entry).map_err(param_error)?;
        tumble_io::returns_data(&typed, &entry, &ret_ty).map_err(param_error)?;

        let tensors = param_tensors(params, opts.threads, &mut warnings)?;
        let names: Vec<&str> = main_params.iter().map(|(n, _)| n.as_str()).collect();
        let provided: BTreeSet<String> = match &opts.inputs {
            Some(inputs) => {
                for i in inputs {
                    if !names.contains(&i.as_str()) {
                        return Err(Error::Param {
                            message: format!(
                                "inputs: @{entry} has no argument `{}`; its arguments are: {}",
                                tumble_io::echo(i),
                                names.join(", ")
                            ),
                        });
                    }
                }
                inputs.iter().cloned().collect()
            }
            None => main_params
                .iter()
                .filter(|(n, ty)| {
                    !tensors.contains_key(n)
                        && (params.random_seed.is_none() || ty.as_tensor().is_none())
                })
                .map(|(n, _)| n.clone())
                .collect(),
        };
        let bound = bind_params(&main_params, &provided, &tensors, params.random_seed)
            .map_err(param_error)?;
        warnings.extend(bound.warnings.iter().cloned());
        let weights: Vec<bool> = bound.weights_mask();
        let compiled = tumble_compile::compile(
            &typed,
            &entry,
            &weights,
            CompileOptions {
                lower: opts.lower,
                statics: Some(opts.statics),
                plans: None,
            },
        )
        .map_err(|e| Error::Check {
            message: diag::render(&[Diagnostic::error(e.span, e.message)], &sources, false),
        })?;
        let Compiled {
            program,
            reuse,
            report,
            ..
        } = compiled;
        let instance_args = bound.instance_args();
        let small_batches = opts.statics.merge.then(|| SmallBatches {
            recompile: Some((
                weights,
                opts.lower,
                StaticOptions {
                    merge: false,
                    ..opts.statics
                },
            )),
            compiled: std::sync::OnceLock::new(),
        });
        Ok(Model {
            name,
            sources,
            typed,
            program,
            reuse,
            entry,
            bound,
            instance_args,
            ret_ty,
            report,
            warnings,
            executable: Mutex::new([None, None]),
            small_batches,
            compiled_with: None,
        })
    }

    /// A model compiled by `tumble compile` (`bytes`, read from `path`): its program and reuse
    /// analysis are used as compiled (the compile options in `opts` do not apply); its sources
    /// are checked again for the typed module that decoding instances and `check` read (a few
    /// ms). Weights: those it stores, or, for one compiled with `--no-weights`, `params`'. The
    /// arguments bound as weights must be those it was compiled with.
    pub fn load_compiled(
        path: &Path,
        bytes: &[u8],
        params: &Params,
        opts: &LoadOptions,
    ) -> Result<Model, Error> {
        let loaded = tumble_io::artifact::read_artifact(path, bytes).map_err(param_error)?;
        Model::from_compiled(path, loaded, params, opts)
    }

    /// [`Model::load_compiled`] of a compiled model already read.
    fn from_compiled(
        path: &Path,
        loaded: tumble_io::artifact::Loaded,
        params: &Params,
        opts: &LoadOptions,
    ) -> Result<Model, Error> {
        let shown = path.display();
        let mut a = loaded.artifact;
        let unmerged = a.unmerged.take();
        let asked = opts.entry.trim_start_matches('@');
        if asked != "main" {
            a.check_entry(&shown.to_string(), asked)
                .map_err(|message| Error::Usage { message })?;
        }
        // The prelude first, the model last (`SourceMap` order at compile time).
        let Some((name, text)) = a.sources.last() else {
            return Err(Error::Check {
                message: format!("{shown}: the compiled model has no source"),
            });
        };
        let mut sources = SourceMap::new();
        let typed = tumble_check::load(&mut sources, name, text, CheckOptions::default()).map_err(
            |ds| Error::Check {
                message: diag::render(&ds, &sources, false),
            },
        )?;
        let same_sources = sources.files().len() == a.sources.len()
            && sources
                .files()
                .iter()
                .zip(&a.sources)
                .all(|(f, (n, t))| &f.name == n && &f.text == t);
        if !same_sources {
            return Err(Error::Check {
                message: format!(
                    "{shown} was compiled with another prelude (by {}): compile it again with \
                     this tumble",
                    a.written_by
                ),
            });
        }
        let mut warnings: Vec<String> = typed
            .warnings
            .iter()
            .map(|w| diag::render(std::slice::from_ref(w), &sources, false))
            .collect();
        let (main_params, ret_ty) = main_signature(&typed, &a.entry).map_err(param_error)?;
        tumble_io::returns_data(&typed, &a.entry, &ret_ty).map_err(param_error)?;
        let given =
            params.file.is_some() || !params.tensors.is_empty() || params.random_seed.is_some();
        let tensors = if loaded.weights.is_empty() {
            param_tensors(params, opts.threads, &mut warnings)?
        } else if given {
            return Err(Error::Param {
                message: format!(
                    "{shown} stores its weights; the parameters given would replace them: \
                     compile it with --no-weights to bind weights at load time"
                ),
            });
        } else {
            loaded.weights
        };
        let provided: BTreeSet<String> = main_params
            .iter()
            .zip(&a.weights)
            .filter(|(_, w)| !**w)
            .map(|((n, _), _)| n.clone())
            .collect();
        if let Some(inputs) = &opts.inputs {
            let named: BTreeSet<String> = inputs.iter().cloned().collect();
            if named != provided {
                let list = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
                return Err(Error::Param {
                    message: format!(
                        "inputs: {shown} was compiled with the per-instance arguments {}, not {}",
                        list(&provided),
                        list(&named)
                    ),
                });
            }
        }
        let bound = bind_params(&main_params, &provided, &tensors, params.random_seed)
            .map_err(param_error)?;
        a.check_binding(&bound.weights_mask())
            .map_err(|message| Error::Param {
                message: format!("{shown}: {message}"),
            })?;
        warnings.extend(bound.warnings.iter().cloned());
        let instance_args = bound.instance_args();
        Ok(Model {
            name: shown.to_string(),
            sources,
            typed,
            program: a.compiled.program,
            reuse: a.compiled.reuse,
            entry: a.entry,
            bound,
            instance_args,
            ret_ty,
            report: None,
            warnings,
            executable: Mutex::new([None, None]),
            small_batches: unmerged.map(|u| SmallBatches {
                recompile: None,
                compiled: std::sync::OnceLock::from(Ok((u.program, u.reuse))),
            }),
            compiled_with: Some((a.compiled_with.statics, a.compiled_with.plans)),
        })
    }

    /// The model's name (its path, or the name given with its text).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Warnings of checking and binding (unused weights, NaN weights, ...).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The parameters, in `@main`'s order.
    pub fn parameters(&self) -> Vec<ParamInfo> {
        self.bound
            .args
            .iter()
            .filter_map(|a| match &a.binding {
                Binding::Param(t) => Some(ParamInfo {
                    name: a.name.clone(),
                    shape: t.shape().to_vec(),
                    dtype: t.dtype(),
                    generated: self.bound.generated.contains_key(&a.name),
                }),
                Binding::Instance => None,
            })
            .collect()
    }

    /// A parameter's tensor.
    pub fn parameter(&self, name: &str) -> Option<&Tensor> {
        self.bound.args.iter().find_map(|a| match &a.binding {
            Binding::Param(t) if a.name == name => Some(t),
            _ => None,
        })
    }

    /// The arguments each instance gives (name, declared type), in `@main`'s order.
    pub fn inputs(&self) -> &[(String, Ty)] {
        &self.instance_args
    }

    /// `@main`'s return type.
    pub fn output_type(&self) -> &Ty {
        &self.ret_ty
    }

    /// What `tumble check` prints: each user global with its inferred type.
    pub fn check(&self) -> String {
        let mut out = String::new();
        for (g, sig) in self.typed.user_globals() {
            out.push_str(&format!("@{g}: {}\n", display_sig(sig)));
        }
        out
    }

    /// What the compiler made of the model (a short form of `tumble explain`): the static
    /// optimizations, and each block reached from the entry with its kernel plan and which
    /// inputs are passed once per launch.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let per_instance: Vec<&str> = self.instance_args.iter().map(|(n, _)| n.as_str()).collect();
        out.push_str(&format!("model {}\n", self.name));
        out.push_str(&format!(
            "per-instance @{} arguments: {}\n",
            self.entry,
            if per_instance.is_empty() {
                "(none)".to_string()
            } else {
                per_instance.join(", ")
            }
        ));
        out.push_str(&format!(
            "{} static blocks ({} from Primitive=1 functions)\n",
            self.program.blocks.len(),
            self.program.blocks.iter().filter(|b| b.primitive).count()
        ));
        if let Some(r) = &self.report {
            out.push_str(&format!(
                "static optimizations: {} functions duplicated per call site, {} sites hoisted, \
                 {} conditionals padded with ghost operators, {} automatic phase boundaries\n",
                r.duplicated.len(),
                r.hoisted.len(),
                r.ghosts.len(),
                r.phases.len()
            ));
        }
        out.push('\n');
        for (bi, block) in self.program.blocks.iter().enumerate() {
            let decisions = self.reuse.inputs.get(bi);
            let reached = decisions.is_some_and(|v| {
                v.is_empty() || v.iter().any(|d| !matches!(d, InputReuse::Unreached))
            });
            if !reached {
                continue;
            }
            out.push_str(&block.to_string());
            out.push_str("  kernel plan:\n");
            out.push_str(
                &tumble_compile::plan::plan_with(block, tumble_compile::PlanOptions::default())
                    .to_string(),
            );
            for (i, inp) in block.inputs.iter().enumerate() {
                let d = match decisions.and_then(|v| v.get(i)) {
                    Some(InputReuse::Shared) => "shared (passed once per launch)",
                    Some(InputReuse::PerInstance) => "per-instance (gathered)",
                    Some(InputReuse::SharedPerCallSite) => {
                        "parameter-derived, differs per call site"
                    }
                    Some(InputReuse::Unreached) | None => "never reached from the entry point",
                };
                out.push_str(&format!("    in{i} {}: {d}\n", inp.name));
            }
            out.push('\n');
        }
        out
    }

    /// Runs every instance on a new thread with the CLI's stack (deep instances decode by native
    /// recursion) and returns the results in order, with the run's profile.
    pub fn run(
        &self,
        instances: &RawInstances,
        opts: &RunOptions,
    ) -> Result<(Vec<OutTree>, Profile), Error> {
        with_big_stack(|| self.run_here(instances, opts))?
    }

    /// The switches a run asking for `asked` gets: a compiled model's runs leave off what it
    /// was compiled without.
    pub(crate) fn runtime_options(&self, asked: Options) -> Options {
        match &self.compiled_with {
            Some((statics, plans)) => asked.within_compiled(statics, *plans),
            None => asked,
        }
    }

    /// The program planned for runs with `runtime` (threads aside): the one kept from the last
    /// run when its switches are the same, else planned now and kept.
    pub(crate) fn executable_for(&self, runtime: &Options) -> Arc<Executable> {
        self.executable_of(&self.program, &self.reuse, false, runtime)
    }

    /// [`Model::executable_for`] for `program` (`small`: the small-batch program).
    fn executable_of(
        &self,
        program: &Program,
        reuse: &Reuse,
        small: bool,
        runtime: &Options,
    ) -> Arc<Executable> {
        let key = Options {
            threads: 1,
            ..*runtime
        };
        let mut kept = self.executable.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut kept[usize::from(small)];
        if let Some((k, e)) = slot.as_ref() {
            if *k == key {
                return e.clone();
            }
        }
        let e = Arc::new(Executable::new(program, reuse, runtime));
        // The model's weights packed for the GEMM now, not in the first request's run.
        e.prepack_weights(program, &self.bound.entry_params(), runtime.threads);
        *slot = Some((key, e.clone()));
        e
    }

    /// The program for jobs of mini-batches of `batch` instances: without block merging under
    /// `MERGE_MIN_BATCH` (compiled on first use), else the one compiled at load.
    fn program_for(&self, batch: usize) -> Result<(&Program, &Reuse, bool), Error> {
        let small = match &self.small_batches {
            Some(s) if batch < tumble_compile::merge::MERGE_MIN_BATCH => s,
            _ => return Ok((&self.program, &self.reuse, false)),
        };
        let compiled = small.compiled.get_or_init(|| {
            let Some((weights, lower, statics)) = &small.recompile else {
                return Err("internal: no program for small mini-batches".into());
            };
            tumble_compile::compile(
                &self.typed,
                &self.entry,
                weights,
                CompileOptions {
                    lower: *lower,
                    statics: Some(*statics),
                    plans: None,
                },
            )
            .map(|c| (c.program, c.reuse))
            .map_err(|e| e.message)
        });
        match compiled {
            Ok((program, reuse)) => Ok((program, reuse, true)),
            Err(m) => Err(Error::Check {
                message: format!("compiling the model for small mini-batches: {m}"),
            }),
        }
    }

    /// [`Model::run`] on the calling thread, which must have a large stack (see
    /// [`with_big_stack`]) when instances or results nest deeply.
    pub fn run_here(
        &self,
        instances: &RawInstances,
        opts: &RunOptions,
    ) -> Result<(Vec<OutTree>, Profile), Error> {
        self.run_with(
            instances.len(),
            |i, decoding| decoding.decode_raw(instances, i),
            |i| {
                instances.items.get(i).map_or_else(
                    || format!("instance {i}"),
                    |it| format!("instance at {}", it.location),
                )
            },
            opts,
        )
    }

    /// Runs `n` instances that `load` decodes, each from the caller's own document (a
    /// [`tumble_io::Doc`]: the Python package reads its lists, dicts and numpy arrays directly,
    /// without a JSON copy) through the [`Decoding`] it is given. `load` is called on the thread
    /// that runs the instance's mini-batch, once per instance, when the mini-batch starts;
    /// `locate(i)` names instance `i` in run-time errors (`instance at index 3`).
    pub fn run_with<L, N>(
        &self,
        n: usize,
        load: L,
        locate: N,
        opts: &RunOptions,
    ) -> Result<(Vec<OutTree>, Profile), Error>
    where
        L: Fn(usize, &Decoding) -> Result<Vec<tumble_interp::Value>, Error> + Sync,
        N: Fn(usize) -> String,
    {
        if n == 0 {
            return Ok((Vec::new(), Profile::default()));
        }
        if !self.program.global_index.contains_key(&self.entry) {
            return Err(Error::Usage {
                message: format!("the module has no global `@{}`", self.entry),
            });
        }
        let threads = match opts.threads {
            Some(0) => {
                return Err(Error::Usage {
                    message: "threads must be at least 1".into(),
                })
            }
            Some(t) if t > tumble_runtime::MAX_THREADS => {
                return Err(Error::Usage {
                    message: format!(
                        "threads={t} is more than the {} tumble can use",
                        tumble_runtime::MAX_THREADS
                    ),
                })
            }
            Some(t) => t,
            None => default_threads()?,
        };
        let workers = match opts.workers {
            Some(0) => {
                return Err(Error::Usage {
                    message: "workers must be at least 1".into(),
                })
            }
            Some(w) => w,
            None => threads,
        };
        let batch = match opts.batch {
            Some(0) => {
                return Err(Error::Usage {
                    message: "batch must be at least 1".into(),
                })
            }
            Some(b) => b,
            None => tumble_runtime::default_batch(n, workers, true),
        };
        let mut runtime = self.runtime_options(opts.runtime);
        runtime.threads = threads;
        let (program, reuse, small) = self.program_for(batch.min(n))?;
        let exec = self.executable_of(program, reuse, small, &runtime);
        let env = TypeEnv::new(&self.typed, program);
        let job = tumble_runtime::Job {
            program,
            reuse,
            entry: &self.entry,
            opts: runtime,
            instances: n,
            batch,
            workers,
            exec: Some(&exec),
            worker_stack: WORK_STACK_BYTES,
        };
        let decoding = Decoding::new(self, env);
        let load = |i: usize| -> Result<Vec<tumble_interp::Value>, Error> {
            let values = load(i, &decoding)?;
            self.bound.assemble(values).map_err(|e| Error::Input {
                instance: i,
                message: e.to_string(),
            })
        };
        let finish = |i: usize, v: tumble_interp::Value| -> Result<OutTree, Error> {
            to_tree(&v, &self.ret_ty, &env).map_err(|e| Error::Output {
                instance: i,
                message: format!("instance {i}: {e}"),
            })
        };
        tumble_runtime::run_batches(&job, load, |i| instance_rng(opts.seed, i), finish).map_err(
            |e| match e {
                tumble_runtime::JobError::Instance(_, e) => e,
                tumble_runtime::JobError::Run { instance, error } => {
                    self.located_run_error(locate(instance), instance, error)
                }
            },
        )
    }

    /// When an instance has keys (`keys`) that name parameters: how to make them inputs (which
    /// @main arguments are inputs is decided at load, before any instance is seen).
    fn param_key_hint(&self, keys: &[String]) -> String {
        let params: Vec<&str> = keys
            .iter()
            .filter(|k| self.parameter(k).is_some())
            .map(String::as_str)
            .collect();
        if params.is_empty() {
            return String::new();
        }
        let mut inputs: Vec<&str> = self.instance_args.iter().map(|(n, _)| n.as_str()).collect();
        inputs.extend(&params);
        format!(
            " ({} {} bound as parameters of the model; to give {} per instance, load the model \
             with the inputs named: Python `inputs=[{}]`, `tumble serve --inputs {}`)",
            params.join(", "),
            if params.len() == 1 { "is" } else { "are" },
            if params.len() == 1 { "it" } else { "them" },
            inputs.join(", "),
            inputs.join(",")
        )
    }

    /// A run-time failure rendered like the CLI's (the message, the source line, the calls that
    /// led there), for an instance named by `location` (`instance at index 3`).
    fn located_run_error(&self, location: String, i: usize, e: RunError) -> Error {
        let message = format!("{location}: {}", e.message);
        let message = match e.span {
            Some(span) => {
                let mut d = Diagnostic::error(span, message);
                for (k, site) in e.trace.iter().enumerate().filter(|(_, s)| **s != span) {
                    d = d.with_secondary(*site, format!("called from here ({})", k + 1));
                }
                diag::render(&[d], &self.sources, false)
            }
            None => message,
        };
        let message = if e.internal {
            format!("{message}\nnote: {}", RunError::BUG_NOTE)
        } else {
            message
        };
        Error::Run {
            instance: i,
            message,
        }
    }
}

/// How a [`Model::run_with`] loader decodes its instances: by the model's instance arguments
/// and type tables.
pub struct Decoding<'m> {
    model: &'m Model,
    env: TypeEnv<'m>,
}

impl<'m> Decoding<'m> {
    pub(crate) fn new(model: &'m Model, env: TypeEnv<'m>) -> Self {
        Decoding { model, env }
    }

    /// Instance `i` from `doc`, whose `{ATTACHED_TENSOR_KEY: k}` objects refer to `attached`;
    /// an error names it as `source` (`instances: instance at index 3`) and the path inside it.
    pub fn decode<D: tumble_io::Doc>(
        &self,
        i: usize,
        doc: &D,
        attached: &[Tensor],
        source: &str,
    ) -> Result<Vec<tumble_interp::Value>, Error> {
        tumble_io::decode_instance(doc, attached, &self.env, &self.model.instance_args).map_err(
            |e| {
                let mut message = format!("{source}: ");
                if !e.path.is_empty() {
                    message.push_str(&e.path);
                    message.push_str(": ");
                }
                message.push_str(&e.message);
                if doc.kind() == Ok(tumble_io::Kind::Object) {
                    message.push_str(&self.model.param_key_hint(&doc.keys()));
                }
                Error::Input {
                    instance: i,
                    message,
                }
            },
        )
    }

    /// Instance `i` of `instances`.
    pub fn decode_raw(
        &self,
        instances: &RawInstances,
        i: usize,
    ) -> Result<Vec<tumble_interp::Value>, Error> {
        let item = instances.items.get(i);
        let doc = match item {
            Some(it) => it.doc().map_err(|message| Error::Input {
                instance: i,
                message,
            })?,
            None => tumble_io::InstanceDoc::null(),
        };
        let attached = item.map_or(&[][..], RawInstance::attached);
        let location = item.map_or(tumble_io::Location::Index(i), |it| it.location);
        let source = format!("{}: instance at {location}", instances.source_name);
        self.decode(i, &doc.root(), attached, &source)
    }
}

/// `$TUMBLE_NUM_THREADS` (a positive count), else the machine's parallelism.
fn default_threads() -> Result<usize, Error> {
    if let Some(v) = std::env::var_os("TUMBLE_NUM_THREADS") {
        let text = v.to_string_lossy();
        return match text.trim().parse::<usize>() {
            Ok(n) if n > 0 && n <= tumble_runtime::MAX_THREADS => Ok(n),
            _ => Err(Error::Usage {
                message: format!(
                    "TUMBLE_NUM_THREADS={}: not a positive count of at most {} (unset it to use \
                     every core, or pass threads=N)",
                    tumble_io::echo(&text),
                    tumble_runtime::MAX_THREADS,
                ),
            }),
        };
    }
    Ok(std::thread::available_parallelism().map_or(1, usize::from))
}

/// Runs `f` on a new thread with [`WORK_STACK_BYTES`] of stack and waits for it. A panic in `f`
/// comes back as an error rather than unwinding into the caller (a Python interpreter, say).
pub fn with_big_stack<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, Error> {
    // The run stops with its caller's (`tumble_limits::with_run_stop`).
    let stop = tumble_limits::run_stop();
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("tumble-run".into())
            .stack_size(WORK_STACK_BYTES)
            .spawn_scoped(s, move || tumble_limits::with_run_stop(stop, f))
            .map_err(|e| Error::Usage {
                message: format!("cannot start a thread for the run: {e}"),
            })?;
        handle.join().map_err(runner::panic_error)
    })
}

/// Instances from JSON values (one object per instance, keyed by `@main`'s argument names), as
/// a library caller builds them; `source_name` names them in messages.
pub fn instances_from_json(source_name: &str, items: Vec<serde_json::Value>) -> RawInstances {
    RawInstances {
        source_name: source_name.to_string(),
        items: items
            .into_iter()
            .enumerate()
            .map(|(i, j)| RawInstance::with_tensors(Location::Index(i), j, Vec::new()))
            .collect(),
    }
}

mod runner;
mod session;
pub use runner::{on_run_thread, on_run_thread_watched};
pub use session::{Session, Ticket};
pub use tumble_interp::StopWhen;
pub use tumble_runtime::Lending;

#[cfg(test)]
mod tests;
