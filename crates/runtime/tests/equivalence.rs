//! The batching runtime computes what the reference interpreter computes: every zoo model (scaled
//! down so debug builds stay fast), mini-batch sizes 1, 7 and 64, every scheduler, with and without
//! grain coarsening; the same for each model's plain form (`models/plain/`: no `Primitive=1`), which
//! must also compute what its annotated twin computes.

mod common;

use common::{
    check_all_ways, check_batched, compile, compile_natives, expected, load_text, rng, root,
    run_once, same, same_within, Expected,
};
use tumble_interp::Value;
use tumble_io::main_signature;
use tumble_runtime::{run_batch, Options, Scheduler};
use tumble_tensor::Rng;

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
    /// `models/plain/<model>.rly` exists: the model written without `Primitive=1`.
    plain: bool,
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
            plain: true,
        },
        Case {
            model: "mvrnn_small",
            map: &[("64", "4"), ("128", "8")],
            inputs: example("mvrnn.jsonl"),
            plain: true,
        },
        Case {
            model: "birnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: example("birnn.jsonl"),
            plain: true,
        },
        Case {
            model: "nestedrnn_small",
            map: &[("256", "8"), ("768", "24")],
            inputs: example("nestedrnn.jsonl"),
            plain: true,
        },
        Case {
            model: "drnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: drnn_inputs(8),
            plain: true,
        },
        Case {
            model: "stackrnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: example("stackrnn.jsonl"),
            plain: true,
        },
        Case {
            model: "berxit_small",
            map: &[("768", "24"), ("64", "2"), ("3072", "48")],
            // Thresholds 0 and 2: one instance exits at the first layer, the other runs every layer.
            inputs: berxit_inputs(),
            plain: true,
        },
        // ACROBAT's forms: decisions drawn by `random.db_uniform` with run-time bounds.
        Case {
            model: "acrobat/drnn_small",
            map: &[("256", "8"), ("512", "16")],
            inputs: drnn_inputs(8),
            plain: false,
        },
        Case {
            model: "acrobat/berxit_small",
            map: &[("768", "24"), ("64", "2"), ("3072", "48")],
            // Threshold 2 (never confident): ACROBAT's purely random exits, a draw whose bound
            // is computed from the exit classifier; threshold 0: a certain exit at layer 1.
            inputs: acrobat_berxit_inputs(),
            plain: false,
        },
    ]
}

/// Six Berxit instances from the two examples, most with threshold 2 (random exits only).
fn acrobat_berxit_inputs() -> String {
    let lines: Vec<String> = example("berxit.jsonl")
        .lines()
        .map(str::to_string)
        .collect();
    (0..6)
        .filter_map(|i| {
            let l = lines.get(i % lines.len().max(1))?;
            let at = l.find("\"threshold\"")?;
            let t = if i == 2 { "0.0" } else { "2.0" };
            Some(format!("{}\"threshold\": {t}}}", &l[..at]))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A zoo model scaled down, its instances and the reference interpreter's outputs for them.
fn zoo(case: &Case) -> Expected {
    load_scaled(case, &root().join("models"), case.model)
}

/// The plain form of a zoo model (`models/plain/`), scaled down like the annotated one.
fn zoo_plain(case: &Case) -> Expected {
    assert!(case.plain, "{} has no plain form", case.model);
    let name = format!("plain/{}", case.model);
    load_scaled(case, &root().join("models").join("plain"), &name)
}

fn load_scaled(case: &Case, dir: &std::path::Path, name: &str) -> Expected {
    let path = dir.join(format!("{}.rly", case.model));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let l = load_text(name, &scale(&text, case.map));
    expected(name, l, &case.inputs, INSTANCE_ARGS)
}

fn check_case(case: &Case) {
    check_all_ways(&zoo(case));
}

fn check_plain_case(case: &Case) {
    check_all_ways(&zoo_plain(case));
}

/// On the emulated device the GPU executor takes the stages a GPU would (the products and row
/// programs of every zoo model run there, gathers and other operators on the host), and the
/// results are the CPU path's (`check_all_ways` compares them with the reference).
#[test]
fn the_emulated_device_runs_the_products_and_row_programs() {
    for case in cases() {
        let x = zoo(&case);
        let opts = Options {
            emulated_device: true,
            ..Options::default()
        };
        let p = common::batch_profile(&x, opts);
        assert!(
            p.fused.device_stages > 0 && p.fused.dense_stages > 0,
            "{}: {} stages on the device, {} on the host",
            case.model,
            p.fused.device_stages,
            p.fused.host_stages
        );
        // The products with a weight per invocation and the direct products (MV-RNN) and the
        // embedding lookups (BiRNN's, merged into its step) run there too; what stays on the
        // host is a launch's first step (a shared zero state) and its classifier's argmax.
        if case.model == "mvrnn_small" {
            assert!(p.fused.direct_matmuls > 0, "{}", case.model);
        }
        if case.model == "birnn_small" {
            assert!(
                20 * p.fused.host_stages < p.fused.device_stages,
                "{}: {} stages on the device, {} on the host",
                case.model,
                p.fused.device_stages,
                p.fused.host_stages
            );
        }
        // Without it, nothing is counted as a device stage.
        let cpu = common::batch_profile(&x, Options::default());
        assert_eq!(cpu.fused.device_stages + cpu.fused.host_stages, 0);
    }
}

#[test]
fn treelstm() {
    check_case(&cases()[0]);
}

/// The native fast paths (list functions, `@map`'s step as one constructor, block invocations
/// of immediate operands done without a step) change how many evaluation steps the host program
/// takes, not what it records: the same nodes at the same inline depths, so the same launches,
/// on every zoo model.
#[test]
fn native_fast_paths_record_the_same_graph() {
    for case in &cases() {
        let x = zoo(case);
        let go = |natives: bool| {
            let (program, reuse) =
                compile_natives(&x, true, tumble_compile::StaticOptions::all(), natives);
            let (out, profile) = run_once(&x, &program, &reuse, Options::default());
            (format!("{out:?}"), profile)
        };
        let ((out_on, on), (out_off, off)) = (go(true), go(false));
        assert_eq!(out_on, out_off, "{}", x.name);
        assert_eq!(
            (on.nodes, on.launches),
            (off.nodes, off.launches),
            "{}",
            x.name
        );
        assert!(
            on.host_steps < off.host_steps,
            "{}: {} steps with natives, {} without",
            x.name,
            on.host_steps,
            off.host_steps
        );
    }
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
fn plain_treelstm() {
    check_plain_case(&cases()[0]);
}

#[test]
fn plain_mvrnn() {
    check_plain_case(&cases()[1]);
}

#[test]
fn plain_birnn() {
    check_plain_case(&cases()[2]);
}

#[test]
fn plain_nestedrnn() {
    check_plain_case(&cases()[3]);
}

#[test]
fn plain_drnn() {
    check_plain_case(&cases()[4]);
}

#[test]
fn plain_stackrnn() {
    check_plain_case(&cases()[5]);
}

#[test]
fn plain_berxit() {
    check_plain_case(&cases()[6]);
}

/// Every plain model computes its annotated twin's function (reference engine, scaled down): same
/// `@main` parameters, so the same random weights (drawn per name, checked here), the same
/// instances, the same outputs up to float rounding.
#[test]
fn plain_forms_match_their_annotated_twins() {
    let mut checked = 0;
    for case in cases().iter().filter(|c| c.plain) {
        let annotated = zoo(case);
        let plain = zoo_plain(case);
        let (params_a, _) =
            main_signature(&annotated.l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
        let (params_p, _) =
            main_signature(&plain.l.typed, "main").unwrap_or_else(|e| panic!("{e}"));
        let sig = |ps: &[(String, tumble_ir::Ty)]| -> Vec<String> {
            ps.iter().map(|(n, t)| format!("{n}: {t}")).collect()
        };
        assert_eq!(
            sig(&params_a),
            sig(&params_p),
            "{}: @main signatures differ",
            case.model
        );
        assert_eq!(annotated.args.len(), plain.args.len());
        for (i, (a, p)) in annotated.args.iter().zip(&plain.args).enumerate() {
            for (k, (x, y)) in a.iter().zip(p).enumerate() {
                // Weights (random, by name) and instance inputs must be bit-identical.
                if let Err(m) = identical(x, y) {
                    panic!(
                        "{}: instance {i}, argument {}: {m}",
                        case.model, params_a[k].0
                    );
                }
            }
        }
        for (i, (a, p)) in annotated.outputs.iter().zip(&plain.outputs).enumerate() {
            if let Err(m) = same(p, a, "") {
                panic!("{}: plain vs annotated, instance {i}: {m}", case.model);
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 7);
}

/// The large plain files are the small ones at the large sizes, number for number (Berxit's large
/// form has more layers: the CLI comparison in models/plain/README.md covers it).
#[test]
fn plain_large_files_are_the_small_ones_resized() {
    let resized: &[(&str, &[(&str, &str)])] = &[
        ("treelstm", &[("512", "256"), ("1536", "768")]),
        ("mvrnn", &[("128", "64"), ("256", "128")]),
        ("birnn", &[("512", "256"), ("1024", "512")]),
        ("nestedrnn", &[("512", "256"), ("1536", "768")]),
        ("drnn", &[("512", "256"), ("1024", "512")]),
        ("stackrnn", &[("512", "256"), ("1024", "512")]),
    ];
    let dir = root().join("models").join("plain");
    let read = |name: String| {
        std::fs::read_to_string(dir.join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    for (model, map) in resized {
        let large = read(format!("{model}_large.rly")).replace("large", "small");
        let small = read(format!("{model}_small.rly"));
        assert!(
            scale(&large, map) == small,
            "{model}: the large plain form is not the small one resized"
        );
    }
}

/// Both values hold exactly the same tensors (no tolerance).
fn identical(a: &Value, b: &Value) -> Result<(), String> {
    match (a, b) {
        (Value::Tensor(x), Value::Tensor(y)) => {
            if x.shape() == y.shape() && x.dtype() == y.dtype() && x.allclose(y, 0.0, 0.0) {
                Ok(())
            } else {
                Err(format!("{x} vs {y}"))
            }
        }
        _ => same(a, b, ""),
    }
}

#[test]
fn acrobat_drnn() {
    check_case(&cases()[7]);
}

#[test]
fn acrobat_berxit() {
    let case = &cases()[8];
    let x = zoo(case);
    // The draws make the exits differ: not every instance stops at the same layer.
    let exits: std::collections::BTreeSet<String> = x
        .outputs
        .iter()
        .map(|o| match o {
            tumble_interp::Value::Tuple(t) => format!("{:?}", t.0.get(1)),
            other => format!("{other:?}"),
        })
        .collect();
    assert!(
        exits.len() > 1,
        "every instance exits at the same layer: {exits:?}"
    );
    check_all_ways(&x);
}

/// `random.db_uniform` with bounds that are run-time tensors: a counter (a host scalar) and a
/// value computed by a block from the instance's data (lazy in the batched engine, so the draw
/// waits for it), inside a recursion whose length the draws decide. Every engine, scheduler and
/// batch size draws the same numbers, because each instance draws from its own stream in its
/// program order.
#[test]
fn random_bounds_computed_at_run_time() {
    let program = r#"
def @walk(%x: Tensor[(1, 4), float32], %left: Tensor[(), int32], %w: Tensor[(4, 4), float32])
    -> List[Tensor[(), int32]] {
  let %h = tanh(nn.dense(%x, %w));
  // 1 + (number of positive entries of h): computed by a block.
  let %bound = add(sum(cast(greater(%h, 0f), dtype="int32")), 1);
  let %d = random.db_uniform(0, %bound, out_shape=[], out_dtype="int32");
  let %f = random.db_uniform(0f, %bound, out_shape=[2], out_dtype="float32");
  let %stop = random.db_uniform(0, %left, out_shape=[], out_dtype="int32");
  if (%stop == 0) {
    Cons(%d, Nil)
  } else {
    Cons(%d + cast(sum(%f), dtype="int32"), @walk(%h, %left - 1, %w))
  }
}

def @main(%x: Tensor[(1, 4), float32], %n: Tensor[(), int32], %w: Tensor[(4, 4), float32])
    -> List[Tensor[(), int32]] {
  @walk(%x, %n, %w)
}
"#;
    let inputs: Vec<String> = (0..20)
        .map(|i| {
            let v = |k: usize| ((i * 7 + k * 3) % 11) as f32 / 5.0 - 1.0;
            format!(
                "{{\"x\": [[{}, {}, {}, {}]], \"n\": {}}}",
                v(0),
                v(1),
                v(2),
                v(3),
                1 + i % 6
            )
        })
        .collect();
    let l = load_text("random_bounds", program);
    let x = expected("random_bounds", l, &inputs.join("\n"), &["x", "n"]);
    check_all_ways(&x);
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
        plain: false,
    };
    let sentences = Case {
        model: "birnn_small",
        map: &[("256", "8"), ("512", "16")],
        inputs: "{\"tokens\": []}\n{\"tokens\": [[5], [6], [7]]}\n{\"tokens\": []}".to_string(),
        plain: false,
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
        let x = zoo(case);
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
                "{} coarsen={coarsen} fusion={fusion} phases={phases} hoist={hoist} ghosts={ghosts} dup={dup} params={} leaf_inline={} specialize={} \
                 hfuse={hfuse} gather_fusion={gather_fusion} row_cache={row_cache} epilogue={epilogue} sum_fusion={}",
                case.model,
                hoist != dup,
                ghosts != dup,
                phases != dup,
                phases != hoist
            );
            let statics = tumble_compile::StaticOptions {
                dup,
                hoist,
                ghosts,
                phases,
                // Entry arguments as constants, on in half the combinations without doubling them.
                params: hoist != dup,
                leaf_inline: ghosts != dup,
                specialize: phases != dup,
                merge: ghosts == phases,
                derive: hoist == phases,
                canon: dup == phases,
                cse: hoist != phases,
                concurrency: ghosts != hoist,
                split: hoist && ghosts == dup,
                weight_takes: ghosts == hoist,
                index_split: dup == hoist,
                for_gradients: false,
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
                // Not a switch of its own (that would double the combinations): on in half of them.
                sum_fusion: phases != hoist,
                early_release: dup != hoist,
                release_scan_bytes: 0,
                locality_chunks: phases == hoist,
                weight_groups: dup,
                weight_slices: phases != dup,
                defer: phases == hoist,
                direct_matmul: epilogue,
                gather_views: row_cache,
                dense_sums: row_cache != epilogue,
                ragged: hfuse,
                ragged_chunk_rows: 0,
                ragged_padding: hfuse && !gather_fusion,
                mixing_kernels: !hfuse || gather_fusion,
                emulated_device: false,
                job_memo: !hfuse || gather_fusion,
                fibers: hfuse,
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
    let x = zoo(&cases()[0]);
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

/// A block output no node reads and no host value names is freed while another output of the
/// same invocation is still held: a decoder that keeps each step's state in a list and branches
/// on a wide projection of it (one block returning both) held every step's projection with the
/// state it kept — the peak grew by the projection's bytes per step (an audit's find). Equal
/// results with and without early release; the peak now follows what the list keeps.
#[test]
fn an_unnamed_output_is_freed_while_its_sibling_is_kept() {
    let src = r#"
def @gen(%n: Tensor[(), int32], %x: Tensor[(1, 32), float32], %W: Tensor[(32, 32), float32],
         %W2: Tensor[(2048, 32), float32], %acc: List[Tensor[(1, 32), float32]])
    -> List[Tensor[(1, 32), float32]] {
  if (%n == 0) {
    %acc
  } else {
    let %y = tanh(nn.dense(%x, %W));
    let %z = nn.dense(%y, %W2);
    if (sum(%z) > 1000000f) { %acc } else { @gen(%n - 1, %y, %W, %W2, Cons(%y, %acc)) }
  }
}
def @main(%n: Tensor[(), int32], %x: Tensor[(1, 32), float32], %W: Tensor[(32, 32), float32],
          %W2: Tensor[(2048, 32), float32]) -> Tensor[(1, 32), float32] {
  @hd(@gen(%n, %x, %W, %W2, Nil))
}
"#;
    let steps = 400;
    let inputs: Vec<String> = (0..4)
        .map(|i| {
            let x: Vec<String> = (0..32)
                .map(|c| format!("{:.3}", ((i * 7 + c * 3) % 11) as f64 / 20.0 - 0.25))
                .collect();
            format!("{{\"n\": {steps}, \"x\": [[{}]]}}", x.join(", "))
        })
        .collect();
    let x = common::expected(
        "gen",
        load_text("gen", src),
        &inputs.join("\n"),
        &["n", "x"],
    );
    let on = released_as_kept(&x);
    // What the lists keep: each step's (1, 32) state of 4 instances; each step's projection is
    // 4 × 2048 floats, 32 KiB. Scans run once 1 MiB of outputs was recorded since the last one
    // (`RELEASE_SCAN_BYTES`), so up to about that much waits for the next.
    let kept = (steps * 4 * 32 * 4) as u64;
    let projections = (steps * 4 * 2048 * 4) as u64;
    assert!(
        on.activation_bytes < kept + (2 << 20) && projections > 4 * (kept + (2 << 20)),
        "peak {} with early release; the lists keep {kept}, the projections were {projections}",
        on.activation_bytes
    );
}

/// A frame that lives through many flushes drops each value after its last read: an early-exit
/// stack of layers in one `@main` (each layer's output bound by a `let`, the next layer in the
/// `else` arm, Berxit's shape) held every layer's output to the end, all of it named by the
/// host, so early release freed none (`TUMBLE_NO_SLOT_DROPS=1` brings that back: 12 MiB here).
/// With the drops, a layer's output goes once the next layer has read it; the outputs equal
/// the reference engine's.
#[test]
fn a_long_frame_drops_each_layer_after_its_last_reader() {
    let layer = |k: usize, x: &str| {
        format!("let %x{k} = @layer({x}, %W);\n  if (max(%x{k}) > 100f) {{ sum(%x{k}) }} else {{\n")
    };
    let mut main = String::new();
    for k in 1..=6 {
        main.push_str(&layer(
            k,
            &if k == 1 {
                "%x".to_string()
            } else {
                format!("%x{}", k - 1)
            },
        ));
    }
    main.push_str("  sum(%x6)\n");
    main.push_str(&"}\n".repeat(6));
    let src = format!(
        r#"
def @layer(%x: Tensor[(64, 256), float32], %W: Tensor[(256, 256), float32], Primitive=1)
    -> Tensor[(64, 256), float32] {{
  tanh(nn.dense(%x, %W))
}}
def @main(%x: Tensor[(64, 256), float32], %W: Tensor[(256, 256), float32]) -> Tensor[(), float32] {{
  {main}}}
"#
    );
    let inputs: Vec<String> = (0..32)
        .map(|i| format!("{{\"x\": {}}}", common::matrix(i, 64, 256)))
        .collect();
    let x = expected(
        "layers",
        load_text("layers", &src),
        &inputs.join("\n"),
        &["x"],
    );
    let (program, reuse) = compile(&x, true, tumble_compile::StaticOptions::all());
    let (got, profile) = run_once(&x, &program, &reuse, Options::default());
    for (i, (g, e)) in got.iter().zip(&x.outputs).enumerate() {
        if let Err(m) = same_within(g, e, &format!("instance {i}"), 1e-3) {
            panic!("{m}");
        }
    }
    // A layer's outputs: 32 instances × 64 × 256 floats, 2 MiB; six of them were held.
    let layer_bytes = 32 * 64 * 256 * 4;
    assert!(
        profile.activation_bytes < 3 * layer_bytes + (1 << 20),
        "peak {} with the drops; one layer's outputs are {layer_bytes}",
        profile.activation_bytes
    );
}

/// Early release frees outputs before the mini-batch ends, never before their last reader: on
/// every zoo model and scheduler the outputs are bit for bit those with it off, the peak of live
/// launch outputs never higher, and lower on the tree models, whose graphs hold every subtree's
/// state until the end without it (MV-RNN's per-node matrices, TreeLSTM's states).
#[test]
fn early_release_lowers_the_peak_not_the_outputs() {
    for case in &cases() {
        let x = zoo(case);
        let (program, reuse) = compile(&x, true, tumble_compile::StaticOptions::all());
        for scheduler in [
            Scheduler::Inline,
            Scheduler::Depth,
            Scheduler::Agenda,
            Scheduler::Eager,
        ] {
            let go = |early_release| {
                let opts = Options {
                    scheduler,
                    early_release,
                    release_scan_bytes: 0,
                    ..Options::default()
                };
                run_once(&x, &program, &reuse, opts)
            };
            let ((out_on, on), (out_off, off)) = (go(true), go(false));
            let label = format!("{} {scheduler:?}", x.name);
            for (i, (a, b)) in out_on.iter().zip(&out_off).enumerate() {
                if let Err(e) = same_within(a, b, &format!("{label} instance {i}"), 0.0) {
                    panic!("{e}");
                }
            }
            assert!(
                on.activation_bytes <= off.activation_bytes,
                "{label}: peak {} with early release, {} without",
                on.activation_bytes,
                off.activation_bytes
            );
            if matches!(case.model, "treelstm_small" | "mvrnn_small")
                && scheduler != Scheduler::Eager
            {
                assert!(
                    on.activation_bytes < off.activation_bytes,
                    "{label}: peak {} with early release, {} without",
                    on.activation_bytes,
                    off.activation_bytes
                );
            }
        }
    }
}

/// A list of rows stacked back into a matrix by a `concatenate` recursion, twice: each
/// instance's stacked matrix is computed in the same launch as other instances' partial stacks.
/// The host holds it past the launch, so it is copied out of the launch's output — which else
/// stayed alive, its other rows released, for as long as the host held that one result: every
/// launch's output kept, quadratic in the lists' lengths. Results with and without early release
/// the same; the peak follows what the host keeps.
#[test]
fn a_kept_result_does_not_keep_its_launch_s_other_rows() {
    let src = r#"
def @stack(%xs: List[Tensor[(1, 256), float32]]) -> Tensor[(?, 256), float32] {
  match? (%xs) {
    Cons(%x, Nil) => %x,
    Cons(%x, %rest) => concatenate((%x, @stack(%rest)), axis=0),
  }
}
def @rows(%m: Tensor[(?, 256), float32], %ids: List[Tensor[(1), int32]]) -> List[Tensor[(1, 256), float32]] {
  match (%ids) {
    Nil => Nil,
    Cons(%i, %rest) => Cons(tanh(take(%m, %i, axis=0)), @rows(%m, %rest)),
  }
}
def @main(%m: Tensor[(?, 256), float32], %ids: List[Tensor[(1), int32]]) -> Tensor[(1, 256), float32] {
  let %a = @stack(@rows(%m, %ids));
  let %b = @stack(@rows(%a, %ids));
  mean(%b, axis=[0], keepdims=True)
}
"#;
    let inputs: Vec<String> = (0..40)
        .map(|i| {
            let n = 11 + i;
            let row = |r: usize| {
                let v: Vec<String> = (0..256)
                    .map(|c| format!("{:.2}", ((i * 3 + r * 5 + c * 7) % 17) as f64 / 17.0 - 0.5))
                    .collect();
                format!("[{}]", v.join(","))
            };
            let m: Vec<String> = (0..n).map(row).collect();
            let ids: Vec<String> = (0..n).map(|r| format!("[{}]", (r * 3) % n)).collect();
            format!("{{\"m\": [{}], \"ids\": [{}]}}", m.join(","), ids.join(","))
        })
        .collect();
    let x = common::expected(
        "restack",
        load_text("restack", src),
        &inputs.join("\n"),
        &["m", "ids"],
    );
    let on = released_as_kept(&x);
    // Every launch's partial stacks: Σ n²/2 rows over the instances, ~38 MB; the host keeps
    // one stack per instance (Σ n rows, 1.2 MB) and a launch holds at most about as much.
    let rows = |f: fn(usize) -> usize| (0..40).map(|i| f(11 + i)).sum::<usize>() as u64;
    let partial = rows(|n| n * n / 2) * 256 * 4;
    let kept = rows(|n| n) * 256 * 4;
    assert!(
        on.activation_bytes < 4 * kept + (2 << 20) && on.activation_bytes < partial / 3,
        "peak {} with early release; the stacks kept {kept}, every partial stack {partial}",
        on.activation_bytes
    );
}

/// A loop whose state the host holds from one step to the next (a fixed-point iteration): each
/// step's output was counted as live until its node was released, and a node the host still
/// held at release time never stopped counting, so the reported peak grew with the steps (a
/// 10-step loop over 512 sets: 597 MB at 87 MB of RSS). The peak of 24 steps is now about that of
/// 3, the outputs the same as without early release.
#[test]
fn the_peak_of_a_loop_does_not_grow_with_its_steps() {
    let src = |steps: usize| {
        format!(
            r#"
def @iter(%k: Tensor[(), int32], %h: Tensor[(?, 64), float32], %W: Tensor[(64, 64), float32]) -> Tensor[(?, 64), float32] {{
  if (%k == 0) {{ %h }} else {{
    let %h2 = tanh(add(nn.dense(%h, %W), nn.dense(mean(%h, axis=[0], keepdims=True), %W)));
    // Never true, but a computed condition: every step waits for a flush.
    if (max(abs(subtract(%h2, %h))) < -1f) {{ %h2 }} else {{ @iter(%k - 1, %h2, %W) }}
  }}
}}
def @main(%x: Tensor[(?, 64), float32], %W: Tensor[(64, 64), float32]) -> Tensor[(1, 64), float32] {{
  mean(@iter({steps}, %x, %W), axis=[0], keepdims=True)
}}
"#
        )
    };
    let inputs: Vec<String> = (0..24)
        .map(|i| {
            let rows: Vec<String> = (0..(20 + i * 7) % 50 + 1)
                .map(|r| {
                    let v: Vec<String> = (0..64)
                        .map(|c| format!("{:.2}", ((i + r * 5 + c * 3) % 11) as f64 / 11.0 - 0.5))
                        .collect();
                    format!("[{}]", v.join(","))
                })
                .collect();
            format!("{{\"x\": [{}]}}", rows.join(","))
        })
        .collect();
    let peak = |steps: usize| {
        let name = format!("loop_peak_{steps}");
        let x = common::expected(
            &name,
            load_text(&name, &src(steps)),
            &inputs.join("\n"),
            &["x"],
        );
        released_as_kept(&x).activation_bytes
    };
    let (short, long) = (peak(3), peak(24));
    assert!(
        long < short * 2,
        "peak {long} after 24 steps, {short} after 3"
    );
}

/// `x` run with early release and without: the same results, bit for bit; the profile with it.
fn released_as_kept(x: &common::Expected) -> tumble_runtime::Profile {
    let (program, reuse) = compile(x, true, tumble_compile::StaticOptions::all());
    let go = |early_release| {
        let opts = Options {
            early_release,
            ..Options::default()
        };
        run_once(x, &program, &reuse, opts)
    };
    let ((out_on, on), (out_off, _)) = (go(true), go(false));
    for (i, (a, b)) in out_on.iter().zip(&out_off).enumerate() {
        if let Err(e) = same_within(a, b, &format!("instance {i}"), 0.0) {
            panic!("{e}");
        }
    }
    on
}
