//! `tumble compile`: a model compiled once into a `.tumble` file (program, reuse analysis, kernel
//! plans, optionally the weights), and what `tumble run` does with one: no parsing, checking or
//! static passes at start-up. The file format is `tumble_io::artifact`'s.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use tumble_check::LoadOptions;
use tumble_compile::{CompileOptions, Compiled, LowerOptions, PlanOptions, StaticOptions};
use tumble_io::artifact::{save_artifact, Artifact, CompiledProgram, CompiledWith, Loaded};
use tumble_io::{bind_params, load_params_on, main_signature, read_instances_file};
use tumble_ir::{diag, DType, Diagnostic, SourceMap, Ty};
use tumble_tensor::Tensor;

use crate::run::RunArgs;

#[derive(clap::Args)]
pub struct CompileArgs {
    /// The model, in the Relay text format.
    pub model: PathBuf,
    /// Where to write the compiled model (written atomically).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Weights to bind and store in the compiled model (safetensors, `.npy` or a directory of
    /// `.npy`); `@main` arguments named in it are weights.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Fill the weights `--params` does not give with seeded random values and store them.
    #[arg(long, value_name = "SEED")]
    pub random_params: Option<u64>,
    /// Do not store the weights: `tumble run` then binds them from its own `--params`.
    #[arg(long)]
    pub no_weights: bool,
    /// An instances file whose keys name the per-instance `@main` arguments (default: the
    /// arguments the weights do not give; without weights, every argument that is not a float
    /// tensor).
    #[arg(long, short)]
    pub inputs: Option<PathBuf>,
    /// The entry function (`@name` or `name`).
    #[arg(long, default_value = "main", value_parser = crate::run::entry_arg)]
    pub entry: String,
    /// No grain coarsening, constant folding or inlining (one block per operator call).
    #[arg(long)]
    pub no_coarsen: bool,
    /// Compile without the static optimizations (duplication, constants, specialization, leaf
    /// inlining, hoisting, ghosts, phases); the file's runs then also leave out the runtime's
    /// hoisting rule, phase boundaries, ghosts and duplication, as `run` with every static
    /// switch off does on the source.
    #[arg(long)]
    pub no_statics: bool,
    /// Compile without kernel plans (every operator through the batching rules at run time).
    #[arg(long)]
    pub no_fusion: bool,
}

pub fn compile(args: &CompileArgs, color: bool) -> ExitCode {
    let mut sources = SourceMap::new();
    match compile_inner(args, &mut sources) {
        Ok(summary) => {
            eprintln!("{summary}");
            ExitCode::SUCCESS
        }
        Err(Err(ds)) => {
            eprint!("{}", diag::render(&ds, &sources, color));
            ExitCode::FAILURE
        }
        Err(Ok(m)) => {
            eprintln!("error: {m}");
            ExitCode::FAILURE
        }
    }
}

/// A failure: a message (`Ok`) or located diagnostics (`Err`).
type Failed = Result<String, Vec<Diagnostic>>;

fn compile_inner(args: &CompileArgs, sources: &mut SourceMap) -> Result<String, Failed> {
    let mut reads: Vec<(&str, &std::path::Path)> = vec![("the model", &args.model)];
    if let Some(p) = &args.params {
        reads.push(("the --params file", p));
    }
    if let Some(p) = &args.inputs {
        reads.push(("the --inputs file", p));
    }
    crate::files::refuse_overwrites(&reads, &[("the output (-o)", &args.output)]).map_err(Ok)?;
    let text = crate::files::read_source(&args.model).map_err(Ok)?;
    let name = args.model.display().to_string();
    let typed = tumble_check::load(sources, &name, &text, LoadOptions::default()).map_err(Err)?;
    for w in &typed.warnings {
        eprint!("{}", diag::render(std::slice::from_ref(w), sources, false));
    }
    let msg = |e: tumble_io::IoError| Ok(e.to_string());
    let (params, ret) = main_signature(&typed, &args.entry).map_err(msg)?;
    tumble_io::returns_data(&typed, &args.entry, &ret).map_err(msg)?;
    let file = match &args.params {
        Some(p) => {
            // Read on the threads a run would default to (the same tensors on any count).
            let threads = match crate::run::thread_count(None) {
                Ok(t) => t,
                Err(crate::run::Failure::Message(m)) => return Err(Ok(m)),
                Err(_) => return Err(Ok("TUMBLE_NUM_THREADS: not a thread count".into())),
            };
            let loaded = load_params_on(p, threads).map_err(msg)?;
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            loaded.tensors
        }
        None => BTreeMap::new(),
    };
    // A weights file that names none of @main's arguments (empty, or another model's) would make
    // every argument an instance input without a word; `--random-params` fills them instead.
    if let Some(p) = &args.params {
        if args.random_params.is_none() && !params.iter().any(|(n, _)| file.contains_key(n)) {
            let mut have: Vec<&str> = file.keys().map(String::as_str).take(8).collect();
            if file.len() > have.len() {
                have.push("…");
            }
            return Err(Ok(format!(
                "the weights file {} gives none of @{}'s arguments ({}); it holds {}",
                p.display(),
                args.entry.trim_start_matches('@'),
                params
                    .iter()
                    .map(|(n, _)| format!("%{n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if have.is_empty() {
                    "no tensors".to_string()
                } else {
                    format!("tensors {}", have.join(", "))
                }
            )));
        }
    }
    let provided: std::collections::BTreeSet<String> = match &args.inputs {
        Some(p) => read_instances_file(p)
            .map_err(msg)?
            .provided_args(&params, &file),
        None => params
            .iter()
            .filter(|(n, ty)| {
                let float = matches!(ty.as_tensor(),
                    Some((_, d)) if d == DType::Float32 || d == DType::Float64);
                let weights_given = args.params.is_some() || args.random_params.is_some();
                if weights_given {
                    !file.contains_key(n) && (args.random_params.is_none() || !float)
                } else {
                    !float
                }
            })
            .map(|(n, _)| n.clone())
            .collect(),
    };
    let weights: Vec<bool> = params.iter().map(|(n, _)| !provided.contains(n)).collect();
    // A file no run could use is refused now.
    refuse_unbindable(&args.entry, &params, &weights).map_err(Ok)?;
    // Bound only to check and store them: a run of the file binds again, from the file's weights
    // or its own `--params`.
    let stored: BTreeMap<String, Tensor> =
        if args.no_weights || (args.params.is_none() && args.random_params.is_none()) {
            BTreeMap::new()
        } else {
            let bound = bind_params(&params, &provided, &file, args.random_params).map_err(msg)?;
            for w in &bound.warnings {
                eprintln!("warning: {w}");
            }
            bound.weight_tensors()
        };
    let lower = LowerOptions {
        blocks: true,
        coarsen: !args.no_coarsen,
        fold: !args.no_coarsen,
        inline: !args.no_coarsen,
        natives: true,
    };
    let statics = if args.no_statics {
        StaticOptions::none()
    } else {
        StaticOptions::all()
    };
    let plans = (!args.no_fusion).then(PlanOptions::default);
    let compile_with = |statics: StaticOptions| {
        tumble_compile::compile(
            &typed,
            &args.entry,
            &weights,
            CompileOptions {
                lower,
                statics: Some(statics),
                plans,
            },
        )
        .map_err(|e| Err(vec![Diagnostic::error(e.span, e.message)]))
    };
    let Compiled {
        program,
        reuse,
        plans: block_plans,
        report,
    } = compile_with(statics)?;
    // `tumble run` merges blocks only for mini-batches large enough: the file keeps the
    // program without merging too, when merging changed anything, for the smaller ones.
    let merged = report.is_some_and(|r| !r.merged.is_empty());
    let unmerged = if merged {
        let c = compile_with(StaticOptions {
            merge: false,
            ..statics
        })?;
        Some(Box::new(CompiledProgram {
            program: c.program,
            reuse: c.reuse,
            plans: c.plans,
        }))
    } else {
        None
    };
    let artifact = Artifact {
        written_by: format!("tumble {}", env!("CARGO_PKG_VERSION")),
        sources: sources
            .files()
            .iter()
            .map(|f| (f.name.clone(), f.text.clone()))
            .collect(),
        tables: typed.tables.clone(),
        entry: args.entry.clone(),
        params: params.clone(),
        ret,
        weights: weights.clone(),
        compiled_with: CompiledWith {
            coarsen: lower.coarsen,
            fold: lower.fold,
            inline: lower.inline,
            statics,
            plans,
        },
        compiled: CompiledProgram {
            program,
            reuse,
            plans: block_plans,
        },
        unmerged,
    };
    save_artifact(&args.output, &artifact, &stored).map_err(msg)?;
    let inputs: Vec<&str> = params
        .iter()
        .zip(&weights)
        .filter(|(_, w)| !**w)
        .map(|((n, _), _)| n.as_str())
        .collect();
    Ok(format!(
        "compiled {} to {}: {} blocks, per-instance arguments: {}; weights {}",
        args.model.display(),
        args.output.display(),
        artifact.compiled.program.blocks.len(),
        if inputs.is_empty() {
            "(none)".to_string()
        } else {
            inputs.join(", ")
        },
        if !artifact.weights.iter().any(|&w| w) {
            "none (the model takes none)".to_string()
        } else if stored.is_empty() {
            "not stored (give --params when running it)".to_string()
        } else {
            format!("stored ({} tensors)", stored.len())
        }
    ))
}

/// The flags of `tumble run` that change how a model is compiled, set in `args`.
/// (`--no-block-merge` is not one: a compiled model keeps its program without merging whenever
/// merging changed it, for runs of small mini-batches, and a run asking for no merging takes it.)
fn compile_time_flags(args: &RunArgs) -> Vec<&'static str> {
    let mut flags = args.compile.compile_time_flags();
    if args.no_native_prelude {
        flags.push("--no-native-prelude");
    }
    flags
}

/// A compiled model for `tumble run` (from `bytes` when it was read whole, else from its file):
/// read, checked against the run's flags, its sources registered in `sources` (so run-time
/// errors point into them).
pub fn load_for_run(
    args: &RunArgs,
    bytes: Option<&[u8]>,
    sources: &mut SourceMap,
) -> Result<Loaded, crate::run::Failure> {
    use crate::run::Failure;
    let loaded = match bytes {
        Some(b) => tumble_io::artifact::read_artifact(&args.model, b)?,
        None => tumble_io::artifact::read_artifact_file(&args.model)?,
    };
    let a = &loaded.artifact;
    let shown = args.model.display();
    if matches!(args.engine, crate::run::Engine::Reference) {
        return Err(Failure::Message(format!(
            "{shown} is a compiled model: the reference engine runs from source (give the .rly \
             file)"
        )));
    }
    if let Some(entry) = &args.entry {
        a.check_entry(&shown.to_string(), entry)
            .map_err(Failure::Message)?;
    }
    let flags = compile_time_flags(args);
    if !flags.is_empty() {
        let (verb, them) = if flags.len() == 1 {
            ("changes", "it")
        } else {
            ("change", "them")
        };
        return Err(Failure::Message(format!(
            "{shown} is a compiled model: {} {verb} how a model is compiled, which its file \
             has fixed; run the .rly file with {them} (`tumble compile` takes --no-statics, \
             --no-coarsen and --no-fusion)",
            flags.join(", ")
        )));
    }
    if !loaded.weights.is_empty() {
        let flag = if args.params.is_some() {
            Some("--params")
        } else if args.random_params.is_some() {
            Some("--random-params")
        } else {
            None
        };
        if let Some(flag) = flag {
            return Err(Failure::Message(format!(
                "{shown} stores its weights; {flag} would replace them: compile it with \
                 --no-weights to bind weights at run time"
            )));
        }
    }
    for (name, text) in &a.sources {
        sources.add(name.clone(), text.clone());
    }
    Ok(loaded)
}

/// An error unless every argument of `entry` can be bound as `weights` says (true: a weight, from
/// the weights file; false: given by each instance): a weight is a tensor (a tree or a list comes
/// with each instance), and no instance can give a function.
pub(crate) fn refuse_unbindable(
    entry: &str,
    params: &[(String, Ty)],
    weights: &[bool],
) -> Result<(), String> {
    for ((name, ty), weight) in params.iter().zip(weights) {
        let problem = match ty {
            Ty::Tensor { .. } => None,
            Ty::Func(..) => Some("a function, which no instance can give"),
            _ if *weight => Some("not a tensor, so it cannot be a weight"),
            _ => None,
        };
        if let Some(problem) = problem {
            let fix = if *weight {
                format!(
                    "give --inputs a file whose instances have the key `{name}`, so it is \
                     compiled as a per-instance argument"
                )
            } else {
                format!("compile an entry without the argument %{name}")
            };
            return Err(format!(
                "@{entry}'s argument %{name}: {ty} is {problem}; {fix}"
            ));
        }
    }
    Ok(())
}
