//! The batching runtime computes what the reference interpreter computes: every zoo model (scaled
//! down so debug builds stay fast), mini-batch sizes 1, 7 and 64, every scheduler, with and without
//! grain coarsening.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tumble_check::{load, LoadOptions, TypedModule};
use tumble_compile::{LowerOptions, Program};
use tumble_interp::Value;
use tumble_io::{bind_params, main_signature, read_instances, TypeEnv};
use tumble_ir::SourceMap;
use tumble_runtime::{run_batch, Options, Scheduler};

/// The zoo's per-instance `@main` arguments; every other argument is a model parameter.
const INSTANCE_ARGS: &[&str] = &[
    "tree",
    "tokens",
    "seqs",
    "latent",
    "max_depth",
    "max_width",
    "threshold",
];
use tumble_tensor::Rng;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// Replaces whole numbers (not digits inside names like `float32`) by their mapped values.
fn scale(text: &str, map: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let prev_word = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if c.is_ascii_digit() && !prev_word {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            let num = &text[start..i];
            let next_word = i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'.');
            match map.iter().find(|(from, _)| *from == num) {
                Some((_, to)) if !next_word => out.push_str(to),
                _ => out.push_str(num),
            }
        } else {
            let ch = text[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

struct Case {
    model: &'static str,
    map: &'static [(&'static str, &'static str)],
    inputs: String,
}

fn drnn_inputs(h: usize) -> String {
    let mut rng = Rng::new(11);
    (0..8)
        .map(|i| {
            let latent: Vec<String> = (0..h).map(|_| format!("{:.4}", rng.normal_f64())).collect();
            format!(
                "{{\"latent\": [[{}]], \"max_depth\": {}, \"max_width\": {}}}",
                latent.join(", "),
                1 + i % 4,
                1 + i % 3
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn berxit_inputs() -> String {
    example("berxit.jsonl")
        .lines()
        .enumerate()
        .map(|(i, l)| match l.find("\"threshold\"") {
            Some(at) => format!(
                "{}\"threshold\": {}}}",
                &l[..at],
                if i % 2 == 0 { "0.0" } else { "2.0" }
            ),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn example(name: &str) -> String {
    std::fs::read_to_string(root().join("examples").join(name)).unwrap_or_default()
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            model: "treelstm_small",
            map: &[("256", "8"), ("768", "24")],
            inputs: example("treelstm.jsonl"),
        },
        Case {
            model: "mvrnn_small",
            map: &[("64", "4"), ("128", "8")],
            inputs: example("mvrnn.jsonl"),
        },
        Case {
            model: "birnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: example("birnn.jsonl"),
        },
        Case {
            model: "nestedrnn_small",
            map: &[("256", "8"), ("768", "24")],
            inputs: example("nestedrnn.jsonl"),
        },
        Case {
            model: "drnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: drnn_inputs(8),
        },
        Case {
            model: "stackrnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: example("stackrnn.jsonl"),
        },
        Case {
            model: "berxit_small",
            map: &[("768", "24"), ("64", "2"), ("3072", "48")],
            // Thresholds 0 and 2: one instance exits at the first layer, the other runs every layer.
            inputs: berxit_inputs(),
        },
    ]
}

struct Loaded {
    typed: TypedModule,
    sources: SourceMap,
}

fn load_model(case: &Case) -> Loaded {
    let path = root().join("models").join(format!("{}.rly", case.model));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let scaled = scale(&text, case.map);
    let mut sources = SourceMap::new();
    match load(&mut sources, case.model, &scaled, LoadOptions::default()) {
        Ok(typed) => Loaded { typed, sources },
        Err(ds) => panic!("{}", tumble_ir::diag::render(&ds, &sources, false)),
    }
}

fn instances(l: &Loaded, program: &Program, inputs: &str) -> (Vec<Vec<Value>>, String) {
    let (params, _) = main_signature(&l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
    let raw = read_instances(inputs.as_bytes(), "inputs").unwrap_or_else(|e| panic!("{e}"));
    let file = BTreeMap::new();
    let provided = raw.provided_args(&params, &file);
    let bound = bind_params(&params, &provided, &file, Some(0)).unwrap_or_else(|e| panic!("{e}"));
    let env = TypeEnv::new(&l.typed, program);
    let decoded = raw
        .decode(&env, &bound.instance_args())
        .unwrap_or_else(|e| panic!("{e}"));
    let all = decoded
        .into_iter()
        .map(|v| bound.assemble(v).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    (all, String::new())
}

fn rng(i: usize) -> Rng {
    Rng::new(1000 + i as u64)
}

/// Structural equality with float tolerance.
fn same(a: &Value, b: &Value, path: &str) -> Result<(), String> {
    match (a, b) {
        (Value::Tensor(x), Value::Tensor(y)) => {
            if x.shape() != y.shape() || x.dtype() != y.dtype() {
                return Err(format!("{path}: {x} vs {y}"));
            }
            if x.allclose(y, 1e-5, 1e-6) {
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

/// A zoo case loaded, with its instances and the reference interpreter's outputs for them.
struct Expected {
    l: Loaded,
    args: Vec<Vec<Value>>,
    outputs: Vec<Value>,
    /// Per `@main` parameter: a model weight (not per-instance).
    weights: Vec<bool>,
}

fn expected(case: &Case) -> Expected {
    let l = load_model(case);
    let reference = Program::lower_with(&l.typed, LowerOptions::reference())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let (args, _) = instances(&l, &reference, &case.inputs);
    assert!(!args.is_empty(), "{}: no instances", case.model);
    let outputs: Vec<Value> = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut r = rng(i);
            tumble_interp::run(&reference, "main", a.clone(), &mut r)
                .unwrap_or_else(|e| panic!("{} reference: {}", case.model, e.message))
        })
        .collect();
    let (params, _) = main_signature(&l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
    let weights = params
        .iter()
        .map(|(n, _)| !INSTANCE_ARGS.contains(&n.as_str()))
        .collect();
    Expected {
        l,
        args,
        outputs,
        weights,
    }
}

/// The batched program with the given coarsening and static optimizations, and its reuse analysis.
fn compile(
    x: &Expected,
    coarsen: bool,
    statics: tumble_compile::StaticOptions,
) -> (Program, tumble_compile::ReuseAnalysis) {
    let mut program = Program::lower_with(
        &x.l.typed,
        LowerOptions {
            blocks: true,
            coarsen,
        },
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    tumble_compile::optimize(&mut program, "main", &x.weights, statics);
    let reuse = tumble_compile::analyze_reuse(&program, "main", &x.weights);
    (program, reuse)
}

/// Runs every instance in mini-batches of `batch` and checks each output against the reference.
fn check_batched(
    x: &Expected,
    program: &Program,
    reuse: &tumble_compile::ReuseAnalysis,
    batch: usize,
    opts: Options,
    label: &str,
) {
    let mut got = Vec::new();
    for (c, chunk) in x.args.chunks(batch).enumerate() {
        let rngs = (0..chunk.len()).map(|k| rng(c * batch + k)).collect();
        let (vals, _) = run_batch(program, reuse, "main", chunk.to_vec(), rngs, opts)
            .unwrap_or_else(|e| panic!("{label}: {}", e.error.message));
        got.extend(vals);
    }
    assert_eq!(got.len(), x.outputs.len());
    for (i, (g, e)) in got.iter().zip(&x.outputs).enumerate() {
        if let Err(m) = same(g, e, "") {
            panic!("{label}, instance {i}: {m}");
        }
    }
}

fn check_case(case: &Case) {
    let x = expected(case);
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
        let (program, reuse) = compile(&x, coarsen, statics);
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
                    threads: if batch == 7 { 2 } else { 1 },
                };
                let label = format!(
                    "{} {scheduler:?} batch {batch} coarsen {coarsen} fusion {fusion} planopt {planopt}",
                    case.model
                );
                check_batched(&x, &program, &reuse, batch, opts, &label);
            }
        }
    }
    let _ = &x.l.sources;
}

#[test]
fn treelstm() {
    check_case(&cases()[0]);
}

#[test]
fn mvrnn() {
    check_case(&cases()[1]);
}

#[test]
fn birnn() {
    check_case(&cases()[2]);
}

#[test]
fn nestedrnn() {
    check_case(&cases()[3]);
}

#[test]
fn drnn() {
    check_case(&cases()[4]);
}

#[test]
fn stackrnn() {
    check_case(&cases()[5]);
}

#[test]
fn berxit() {
    check_case(&cases()[6]);
}

#[test]
fn scaling_keeps_names_intact() {
    assert_eq!(
        scale("Tensor[(1, 256), float32] 256.5 x256", &[("256", "8")]),
        "Tensor[(1, 8), float32] 256.5 x256"
    );
}

/// A 1-node tree next to a 1,000-level degenerate tree and a small one; an empty sentence next to a
/// non-empty one: instances that differ wildly still batch and agree with the reference.
#[test]
fn wildly_different_instances() {
    let leaf = |i: usize| format!("{{\"Rose\": [[{i}], []]}}");
    let mut deep = leaf(5);
    for i in 0..1000 {
        deep = format!("{{\"Rose\": [[0], [{deep}, {}]]}}", leaf(7 + i % 50));
    }
    let trees = [
        leaf(3),
        deep,
        format!("{{\"Rose\": [[0], [{}, {}]]}}", leaf(4), leaf(9)),
    ]
    .iter()
    .map(|t| format!("{{\"tree\": {t}}}"))
    .collect::<Vec<_>>()
    .join("\n");
    let tree_case = Case {
        model: "treelstm_small",
        map: &[("256", "8"), ("768", "24")],
        inputs: trees,
    };
    let sentences = Case {
        model: "birnn_small",
        map: &[("256", "8"), ("512", "16")],
        inputs: "{\"tokens\": []}\n{\"tokens\": [[5], [6], [7]]}\n{\"tokens\": []}".to_string(),
    };
    // Decoding a 1,000-level tree recurses per JSON level: give it a big stack, like the CLI does.
    let worker = std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(move || {
            check_case(&tree_case);
            check_case(&sentences);
        });
    match worker.map(|h| h.join()) {
        Ok(Ok(())) => {}
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(e) => panic!("cannot start a thread: {e}"),
    }
}

/// Every combination of the optimization switches (ACROBAT's static optimizations and the
/// runtime's) gives the reference's outputs: TreeLSTM, BiRNN (duplication), StackRNN (ghosts),
/// DRNN, at an odd batch size, inline-depth scheduling.
#[test]
fn every_combination_of_switches() {
    const N_SWITCHES: u32 = 10;
    for case_index in [0usize, 2, 4, 5] {
        let case = &cases()[case_index];
        let x = expected(case);
        for mask in 0..(1u32 << N_SWITCHES) {
            let on = |bit: u32| mask & (1 << bit) != 0;
            let (coarsen, fusion, phases, hoist, ghosts, dup) =
                (on(0), on(1), on(2), on(3), on(4), on(5));
            let (hfuse, gather_fusion, row_cache, epilogue) = (on(6), on(7), on(8), on(9));
            // The plan-level switches only matter with plans on.
            if !fusion && (hfuse || gather_fusion || row_cache || epilogue) {
                continue;
            }
            let label = format!(
                "{} coarsen={coarsen} fusion={fusion} phases={phases} hoist={hoist} ghosts={ghosts} dup={dup} \
                 hfuse={hfuse} gather_fusion={gather_fusion} row_cache={row_cache} epilogue={epilogue}",
                case.model
            );
            let statics = tumble_compile::StaticOptions {
                dup,
                hoist,
                ghosts,
                phases,
            };
            let (program, reuse) = compile(&x, coarsen, statics);
            let opts = Options {
                scheduler: Scheduler::Inline,
                host_scalars: true,
                fusion,
                row_cache,
                hfuse,
                gather_fusion,
                epilogue,
                phases,
                hoist,
                ghosts,
                dup,
                lend_threads: true,
                threads: 1,
            };
            check_batched(&x, &program, &reuse, 7, opts, &label);
        }
    }
}

/// Launches of a single invocation (the eager scheduler, or a sequence's last steps) still run the
/// kernel plans: the per-instance inputs are a batch of one, not "shared" tensors, so no stage
/// falls back to the reference kernels.
#[test]
fn launches_of_one_invocation_use_the_kernel_plans() {
    let x = expected(&cases()[0]);
    let (program, reuse) = compile(&x, true, tumble_compile::StaticOptions::all());
    let opts = Options {
        scheduler: Scheduler::Eager,
        ..Options::default()
    };
    let rngs = (0..x.args.len()).map(rng).collect();
    let (_, profile) = run_batch(&program, &reuse, "main", x.args.clone(), rngs, opts)
        .unwrap_or_else(|e| panic!("{}", e.error.message));
    assert!(profile.fused.dense_stages > 0, "{:?}", profile.fused);
    assert_eq!(profile.fused.fallbacks, 0, "{:?}", profile.fused);
}
