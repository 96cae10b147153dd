//! `tumble explain`: what the compile step made of a model — its static blocks and, for every block
//! input, whether it is passed once per launch (parameter reuse) or gathered per invocation.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use tumble_check::LoadOptions;
use tumble_compile::ragged::RaggedInput;
use tumble_compile::{CompileOptions, Compiled, InputReuse, Program};
use tumble_ir::{diag, DType, Diagnostic, SourceMap};

#[derive(clap::Args)]
pub struct ExplainArgs {
    /// The model, in the Relay text format.
    pub model: PathBuf,
    /// Instances file: its keys name the per-instance `@main` arguments. Without it, float tensor
    /// arguments are taken to be model parameters and all others per-instance inputs.
    #[arg(long, short)]
    pub inputs: Option<PathBuf>,
    /// The compiler's switches, as `tumble run` takes them (`--no-coarsen`, `--no-hoist`, ...).
    #[command(flatten)]
    pub compile: crate::switches::CompileSwitches,
    /// Explain the program `tumble run --batch N` compiles: block merging is on from 32
    /// instances a mini-batch (default: as for 32 or more).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: Option<u64>,
    /// The entry function (`@name` or `name`).
    #[arg(long, default_value = "main", value_parser = crate::run::entry_arg)]
    pub entry: String,
    /// Also print the executable program the host evaluator runs: every function's code after
    /// the static passes, with its frame size (`slots`), block invocations and their sites.
    #[arg(long)]
    pub code: bool,
}

pub fn explain(args: &ExplainArgs, color: bool) -> ExitCode {
    let mut sources = SourceMap::new();
    let text = match crate::files::read_source(&args.model) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let name = args.model.display().to_string();
    let typed = match tumble_check::load(&mut sources, &name, &text, LoadOptions::default()) {
        Ok(t) => t,
        Err(ds) => {
            eprint!("{}", diag::render(&ds, &sources, color));
            return ExitCode::FAILURE;
        }
    };
    let (params, _) = match tumble_io::main_signature(&typed, &args.entry) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let instance_keys: Option<BTreeSet<String>> = match &args.inputs {
        Some(p) => match tumble_io::read_instances_file(p) {
            Ok(raw) if raw.is_empty() => {
                eprintln!(
                    "error: {} has no instances: explain reads the per-instance arguments from \
                     its instances' keys",
                    p.display()
                );
                return ExitCode::FAILURE;
            }
            Ok(raw) => {
                let keys = raw.provided_args(&params, &Default::default());
                let names: Vec<&str> = params
                    .iter()
                    .map(|(n, _)| n.trim_start_matches('%'))
                    .collect();
                if let Some(unknown) = keys.iter().find(|k| !names.contains(&k.as_str())) {
                    eprintln!(
                        "error: {}: `{unknown}` is not an argument of @{} (its arguments: {})",
                        p.display(),
                        args.entry,
                        names.join(", ")
                    );
                    return ExitCode::FAILURE;
                }
                Some(keys)
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let weights: Vec<bool> = params
        .iter()
        .map(|(n, ty)| match &instance_keys {
            Some(keys) => !keys.contains(n.as_str()),
            None => {
                matches!(ty.as_tensor(), Some((_, d)) if d == DType::Float32 || d == DType::Float64)
            }
        })
        .collect();
    // An instances file that leaves a tree or a list to the weights explains nothing a run
    // could do: refused as `compile` refuses it.
    if args.inputs.is_some() {
        if let Err(e) = crate::compiled::refuse_unbindable(&args.entry, &params, &weights) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let batch = args
        .batch
        .map_or(tumble_compile::merge::MERGE_MIN_BATCH, |b| {
            usize::try_from(b).unwrap_or(usize::MAX)
        });
    let opts = CompileOptions {
        lower: args.compile.lower(true),
        statics: Some(args.compile.statics(batch)),
        ..CompileOptions::batched()
    };
    let compiled = match tumble_compile::compile(&typed, &args.entry, &weights, opts) {
        Ok(c) => c,
        Err(e) => {
            eprint!(
                "{}",
                diag::render(&[Diagnostic::error(e.span, e.message)], &sources, color)
            );
            return ExitCode::FAILURE;
        }
    };
    let Compiled {
        program,
        reuse,
        report,
        plans,
    } = compiled;
    let report = report.unwrap_or_default();
    if args.code {
        print!("{program}");
        println!();
    }
    let per_instance: Vec<&str> = params
        .iter()
        .zip(&weights)
        .filter(|(_, w)| !**w)
        .map(|((n, _), _)| n.as_str())
        .collect();
    println!("model {name}");
    println!(
        "per-instance @{} arguments: {}",
        args.entry,
        if per_instance.is_empty() {
            "(none)".to_string()
        } else {
            per_instance.join(", ")
        }
    );
    println!(
        "{} static blocks ({} from Primitive=1 functions)\n",
        program.blocks.len(),
        program.blocks.iter().filter(|b| b.primitive).count()
    );
    print_static_report(&program, &report, &sources, &args.entry);
    if !program.inlined.is_empty() {
        let inlined: Vec<String> = program.inlined.iter().map(|n| format!("@{n}")).collect();
        println!(
            "inlining: calls of these straight-line functions join their caller's block: {}\n",
            inlined.join(", ")
        );
    }
    for (span, note) in &program.notes {
        eprint!(
            "{}",
            diag::render(&[Diagnostic::warning(*span, note.clone())], &sources, color)
        );
    }
    let reached = |bi: usize| {
        reuse
            .inputs
            .get(bi)
            .is_some_and(|v| v.is_empty() || v.iter().any(|d| !matches!(d, InputReuse::Unreached)))
    };
    let hidden = (0..program.blocks.len()).filter(|&b| !reached(b)).count();
    if hidden > 0 {
        println!(
            "({hidden} blocks not reached from @{} are not shown)\n",
            args.entry
        );
    }
    for (bi, block) in program.blocks.iter().enumerate() {
        if !reached(bi) {
            continue;
        }
        print!("{block}");
        println!("  kernel plan:");
        if let Some(plan) = plans.get(bi) {
            print!("{plan}");
        }
        if let Some(r) = tumble_compile::ragged::analyze(block, &reuse.varying_inputs(bi)) {
            println!("  ragged batching: invocations of different lengths L launch together");
            let tied = r
                .inputs
                .iter()
                .zip(&r.free_length)
                .filter(|(k, &free)| **k == RaggedInput::Rows && !free)
                .count();
            if tied > 1 {
                // The run-time condition the analysis cannot see: one L per invocation.
                println!(
                    "    (where an invocation's {tied} row inputs have one length L; one whose row inputs differ in length launches with those of its exact shapes)"
                );
            }
            print!("{r}");
        }
        let chosen = reuse.chosen_weights(block, bi);
        let decisions: Vec<String> = block
            .inputs
            .iter()
            .enumerate()
            .map(|(i, inp)| {
                let d = match reuse.inputs.get(bi).and_then(|v| v.get(i)) {
                    Some(InputReuse::Shared) => "shared (passed once per launch)",
                    Some(InputReuse::PerInstance) if chosen.contains(&(i as u32)) => {
                        "per-instance, a product's weight: where an invocation passes a model weight, grouped at launch by it; gathered otherwise"
                    }
                    Some(InputReuse::PerInstance) => "per-instance (gathered)",
                    Some(InputReuse::SharedPerCallSite) => {
                        "parameter-derived, but differs between call sites (duplicate the function to share it)"
                    }
                    Some(InputReuse::Unreached) | None => "never reached from the entry point",
                };
                format!("    in{i} {}: {d}", inp.name)
            })
            .collect();
        if !decisions.is_empty() {
            println!("  reuse:");
            for d in decisions {
                println!("{d}");
            }
        }
        println!();
    }
    ExitCode::SUCCESS
}

/// What the static optimizations (ACROBAT §4.1, §5.1) found.
fn print_static_report(
    program: &Program,
    report: &tumble_compile::StaticReport,
    sources: &SourceMap,
    entry: &str,
) {
    let at = |span: tumble_ir::Span| {
        sources.get(span.src).map_or_else(
            || "?".to_string(),
            |f| {
                let (line, col) = f.line_col(span.lo as usize);
                format!("{}:{line}:{col}", f.name)
            },
        )
    };
    println!("static optimizations:");
    if report.duplicated.is_empty() {
        println!("  duplication: every function sees one set of weights");
    } else {
        println!(
            "  duplication (functions cloned per call site so their blocks' weights are static):"
        );
        for d in &report.duplicated {
            println!(
                "    @{} -> @{} (blocks {})",
                d.function,
                d.clone,
                d.blocks.join(", ")
            );
        }
    }
    let consts = &report.params;
    if consts.reads == 0 {
        println!("  entry arguments: passed down as written");
    } else {
        let params = removed_params(&consts.params);
        println!(
            "  entry arguments read where used: {} reads, {} captures dropped, {} parameters removed{}",
            consts.reads,
            consts.captures,
            consts.params.len(),
            if params.is_empty() {
                String::new()
            } else {
                format!(" ({params})")
            }
        );
    }
    if !report.specialized.is_empty() {
        println!("  specialized on closures:");
        for s in &report.specialized {
            println!("    {}", s.name);
        }
    }
    if report.leaf_calls_inlined > 0 {
        println!(
            "  leaf functions: {} calls replaced by the callee's body",
            report.leaf_calls_inlined
        );
    }
    let natives = natives_reached(program, entry);
    if !natives.is_empty() {
        let names: Vec<String> = natives.iter().map(|n| format!("@{n}")).collect();
        println!(
            "  prelude list functions run natively (one step each): {}",
            names.join(", ")
        );
    }
    let loops = loops_reached(program, entry, |g| program.natives.is_map_loop(g));
    if !loops.is_empty() {
        println!(
            "  run as loops over their list (`@map`'s shape): {}",
            loops.join(", ")
        );
    }
    let folds = loops_reached(program, entry, |g| program.natives.fold_loop(g).is_some());
    if !folds.is_empty() {
        println!(
            "  run as left folds over their list (`@foldl`'s shape): {}",
            folds.join(", ")
        );
    }
    let scans = loops_reached(program, entry, |g| program.natives.scan_loop(g).is_some());
    if !scans.is_empty() {
        println!(
            "  run as scans over their list (a recursion returning the list of its states): {}",
            scans.join(", ")
        );
    }
    if report.hoisted.is_empty() {
        println!("  hoisting: no block invocation is independent of recursive state");
    } else {
        println!("  hoisting: independent of recursive state, scheduled by dataflow depth:");
        for &s in &report.hoisted {
            if let Some(site) = program.sites.get(s as usize) {
                let name = program
                    .blocks
                    .get(site.block as usize)
                    .map_or("?", |b| b.name.as_str());
                println!("    {name} at {}", at(site.span));
            }
        }
    }
    let cuts = [
        (
            &report.split,
            "hoisting splits (--no-hoist-split): the part of a block that reads no recursive state runs hoisted, apart from the rest:",
        ),
        (
            &report.weight_takes,
            "weight-take splits (--no-weight-take-split): a matrix taken out of a model weight by a computed index runs as a weight slice of its own:",
        ),
        (
            &report.index_splits,
            "index splits (--no-index-split): an integer computed from an instance's integer vector is computed on the host, apart from the rest:",
        ),
    ];
    for (splits, title) in cuts {
        if splits.is_empty() {
            continue;
        }
        println!("  {title}");
        for sp in splits {
            let sites = if sp.sites == 1 { "site" } else { "sites" };
            let ops = if sp.ops == 1 { "operator" } else { "operators" };
            println!(
                "    {}: {} {ops} as {}, the rest as {} ({} call {sites})",
                sp.block, sp.ops, sp.producer, sp.consumer, sp.sites
            );
        }
    }
    if !report.merged.is_empty() {
        println!(
            "  block merging (`run` merges for mini-batches of at least {} instances; --no-block-merge): hoisted blocks run inside the block that reads them:",
            tumble_compile::merge::MERGE_MIN_BATCH
        );
        for m in &report.merged {
            let sites = if m.sites == 1 { "site" } else { "sites" };
            println!(
                "    {} into {} ({} call {sites})",
                m.producer, m.consumer, m.sites
            );
        }
    }
    if !report.not_merged.is_empty() {
        println!(
            "  block merging: kept apart, the merged step would read more than {} KiB of product weights (half a core's L2) every launch:",
            tumble_compile::merge::MERGE_MAX_WEIGHT_BYTES >> 10
        );
        for m in &report.not_merged {
            println!(
                "    {} and {} ({} KiB)",
                m.producer,
                m.consumer,
                m.weight_bytes >> 10
            );
        }
    }
    if report.cse > 0 {
        println!(
            "  common subexpressions (--no-cse): {} repeated operators inside blocks computed once",
            report.cse
        );
    }
    if report.canonical > 0 {
        println!(
            "  canonical products (--no-canonical-products): {} column-vector products, transposes and reshapes rewritten onto the instances' rows",
            report.canonical
        );
    }
    if !report.derived.is_empty() {
        println!(
            "  derived parameters (--no-derived-params): weight-only operators computed once per run, read as weights:"
        );
        for d in &report.derived {
            let values = if d.values == 1 { "value" } else { "values" };
            println!(
                "    in {}: {} ({} {values})",
                d.from,
                d.ops.join(", "),
                d.values
            );
        }
    }
    if report.concurrent.is_empty() {
        println!("  concurrency: no independent calls written one after the other");
    } else {
        println!(
            "  concurrency (--no-auto-concurrency): independent calls run side by side, as db.concurrent would:"
        );
        for c in &report.concurrent {
            let runs: Vec<String> = c.calls.iter().map(|n| format!("{n} calls")).collect();
            println!("    in @{}: {}", c.function, runs.join(", "));
        }
    }
    if report.ghosts.is_empty() {
        println!("  ghosts: every conditional's arms advance the inline depth alike");
    } else {
        println!("  ghosts (ghost operators added per arm, in arm order):");
        for g in &report.ghosts {
            let arms: Vec<String> = g.per_arm.iter().map(u32::to_string).collect();
            println!("    in @{}: [{}]", g.function, arms.join(", "));
        }
    }
    if program.folded.is_empty() {
        println!("  constant folding: no input-less operator work");
    } else {
        let places: Vec<String> = program.folded.iter().map(|&s| at(s)).collect();
        println!(
            "  constant folding: computed at compile time at {}",
            places.join(", ")
        );
    }
    let sums: Vec<&str> = program
        .blocks
        .iter()
        .filter(|b| b.is_sum())
        .map(|b| b.name.as_str())
        .collect();
    if sums.is_empty() {
        println!("  sum fusion: no block only adds two tensors");
    } else {
        println!(
            "  sum fusion: invocations deferred into n-ary sums, summed where a launch reads them: {}",
            sums.join(", ")
        );
    }
    if report.slot_drops == 0 {
        println!("  slot drops: every value a frame binds is read to its end");
    } else {
        println!(
            "  slot drops: {} values let go after their last read (`explain --code` shows each `drop`)",
            report.slot_drops
        );
    }
    let explicit = program
        .global_index
        .get(entry)
        .and_then(|g| program.globals.get(*g as usize))
        .and_then(|l| program.lambdas.get(*l as usize))
        .map_or(0, |l| count_phases(&l.body));
    println!(
        "  phases: {} boundaries in @{entry} ({} automatic{})",
        explicit,
        report.phases.len(),
        if report.phases.is_empty() {
            String::new()
        } else {
            format!(
                ", before top-level element {}",
                report
                    .phases
                    .iter()
                    .map(|i| format!("#{i}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    println!();
}

fn count_phases(code: &tumble_compile::Code) -> usize {
    let mut n = 0;
    code.visit(&mut |c| {
        n += usize::from(matches!(c, tumble_compile::Code::Phase));
    });
    n
}

/// The functions reached from `entry` that the evaluator runs as loops
/// ([`tumble_compile::map_loop`]) of the kind `is_loop` picks, by name.
fn loops_reached(
    program: &tumble_compile::Program,
    entry: &str,
    is_loop: impl Fn(u32) -> bool,
) -> Vec<String> {
    let reached = program.reached_from(program.global_index.get(entry).copied(), |g| {
        program.natives.of(g).is_some()
    });
    let mut names: Vec<String> = (0..program.globals.len() as u32)
        .filter(|&g| is_loop(g))
        .filter_map(|g| {
            let l = *program.globals.get(g as usize)? as usize;
            (*reached.get(l)?).then(|| program.lambdas.get(l).map(|f| format!("@{}", f.name)))?
        })
        .collect();
    names.sort_unstable();
    names
}

/// The native prelude functions ([`tumble_compile::Native`]) the code reached from `@entry`
/// calls, by name, sorted (a native's own body is not followed: it does not run).
fn natives_reached(program: &tumble_compile::Program, entry: &str) -> Vec<&'static str> {
    use tumble_compile::Code;
    let native = |g: u32| program.natives.of(g);
    let reached = program.reached_from(program.global_index.get(entry).copied(), |g| {
        native(g).is_some()
    });
    let mut natives: Vec<&'static str> = Vec::new();
    for (lambda, _) in program.lambdas.iter().zip(&reached).filter(|(_, &r)| r) {
        lambda.body.visit(&mut |c| {
            if let Code::CallGlobal { global: g, .. } | Code::Global(g) = c {
                natives.extend(native(*g).map(|n| n.name()));
            }
        });
    }
    natives.sort_unstable();
    natives.dedup();
    natives
}

/// Functions whose removed parameters [`removed_params`] lists before it counts the rest.
const LISTED_FUNCTIONS: usize = 6;

/// The parameters the entry-argument pass removed, per function in name order, each function's
/// positions as ranges (`@layer#2 #1–#16`): a 12-layer model's clones otherwise made a line of
/// 258 entries. Past [`LISTED_FUNCTIONS`] functions, only how many more.
fn removed_params(params: &[(String, u32)]) -> String {
    let mut by_function: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for (f, p) in params {
        by_function.entry(f.as_str()).or_default().push(*p);
    }
    let more = by_function.len().saturating_sub(LISTED_FUNCTIONS);
    let mut parts: Vec<String> = by_function
        .into_iter()
        .take(LISTED_FUNCTIONS)
        .map(|(f, mut ps)| {
            ps.sort_unstable();
            ps.dedup();
            let mut runs: Vec<String> = Vec::new();
            let mut i = 0;
            while let Some(&start) = ps.get(i) {
                let mut end = start;
                while ps.get(i + 1) == Some(&(end + 1)) {
                    end += 1;
                    i += 1;
                }
                runs.push(match end > start {
                    true => format!("#{start}–#{end}"),
                    false => format!("#{start}"),
                });
                i += 1;
            }
            format!("@{f} {}", runs.join(" "))
        })
        .collect();
    if more > 0 {
        parts.push(format!("and {more} more functions"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod removed_params_tests {
    use super::removed_params;

    #[test]
    fn positions_become_ranges_and_long_lists_a_count() {
        let params: Vec<(String, u32)> = [("b", 3), ("a", 2), ("a", 1), ("a", 3), ("a", 5)]
            .iter()
            .map(|&(f, p)| (f.to_string(), p))
            .collect();
        assert_eq!(removed_params(&params), "@a #1–#3 #5, @b #3");
        let many: Vec<(String, u32)> = (0..9).map(|i| (format!("f{i}"), 0)).collect();
        assert_eq!(
            removed_params(&many),
            "@f0 #0, @f1 #0, @f2 #0, @f3 #0, @f4 #0, @f5 #0, and 3 more functions"
        );
    }
}
