//! End-to-end tests of the `tumble` binary: exit statuses, what goes to stdout and stderr.

mod common;

use common::{root, text, tumble};

use std::path::PathBuf;
use std::process::{Command, Output};

/// The path of zoo model `models/NAME.rly`.
fn zoo_model(name: &str) -> String {
    root()
        .join(format!("models/{name}.rly"))
        .display()
        .to_string()
}

/// The path of the bundled instances `examples/NAME.jsonl`.
fn example(name: &str) -> String {
    root()
        .join(format!("examples/{name}.jsonl"))
        .display()
        .to_string()
}

/// The count a `--profile` line starting with `prefix` begins with (0 when there is no such
/// line: the profile leaves out counts of nothing).
fn profile_count(stderr: &[u8], prefix: &str) -> u64 {
    text(stderr)
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|l| l.split_whitespace().next())
        .map_or(0, |n| n.parse::<u64>().unwrap_or(0))
}

/// `tumble run MODEL --inputs INPUTS --random-params 0 EXTRA...`.
fn run_random(model: &str, inputs: &str, extra: &[&str]) -> Output {
    let base = ["run", model, "--inputs", inputs, "--random-params", "0"];
    tumble(&[&base[..], extra].concat())
}

/// A path `name` in this test run's scratch folder (created), where nothing is written yet.
fn temp_path(name: &str) -> PathBuf {
    let path = common::scratch_dir("tumble-cli-test").join(name);
    let _ = std::fs::remove_file(&path);
    path
}

fn temp_file(name: &str, contents: &str) -> PathBuf {
    let path = temp_path(name);
    if let Err(e) = std::fs::write(&path, contents) {
        panic!("cannot write {}: {e}", path.display());
    }
    path
}

fn zoo_files() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(root().join("models"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rly"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    files
}

#[test]
fn check_accepts_every_zoo_model_and_prints_main_types() {
    let files = zoo_files();
    assert!(files.len() >= 14);
    let mut args = vec!["check"];
    args.extend(files.iter().map(String::as_str));
    let out = tumble(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.matches("@main: fn (").count(),
        files.len(),
        "{stdout}"
    );
}

#[test]
fn check_quiet_prints_nothing_on_success() {
    let f = temp_file(
        "ok.rly",
        "def @main(%x: Tensor[(2), float32]) { sigmoid(%x) }\n",
    );
    let out = tumble(&["check", "--quiet", &f.display().to_string()]);
    assert!(out.status.success());
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
}

#[test]
fn check_reports_located_errors_with_source_excerpt_and_exits_1() {
    let f = temp_file(
        "bad.rly",
        "def @main(%x: Tensor[(1, 512), float32], %w: Tensor[(256, 256), float32]) {\n  nn.dense(%x, %w)\n}\n",
    );
    let out = tumble(&["check", &f.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("error: nn.dense: input has 512 columns but weight expects 256"),
        "{err}"
    );
    assert!(err.contains("bad.rly:2:3"), "{err}");
    assert!(err.contains("nn.dense(%x, %w)"), "{err}");
    assert!(err.contains("^^^^"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_missing_file_is_an_error_not_a_crash() {
    let out = tumble(&["check", "/definitely/not/here.rly"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot read /definitely/not/here.rly"));
}

#[test]
fn non_utf8_input_is_an_error() {
    let path = temp_path("bin.rly");
    let _ = std::fs::write(&path, [0x64, 0x65, 0x66, 0xff, 0xfe]);
    let out = tumble(&["check", &path.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not UTF-8"));
}

#[test]
fn deep_nesting_is_a_located_error_not_a_stack_overflow() {
    let src = format!(
        "def @f() {{ {}1{} }}",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    let f = temp_file("deep.rly", &src);
    let out = tumble(&["check", &f.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("nested deeper than"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn fmt_output_is_a_fixed_point_and_checks_the_same() {
    for file in zoo_files() {
        let once = tumble(&["fmt", &file]);
        assert!(once.status.success(), "{file}: {}", text(&once.stderr));
        let formatted = temp_file("fmt.rly", &text(&once.stdout));
        let f = formatted.display().to_string();
        let twice = tumble(&["fmt", &f]);
        assert_eq!(
            text(&once.stdout),
            text(&twice.stdout),
            "{file} is not a fixed point"
        );
        let check = tumble(&["fmt", "--check", &f]);
        assert!(check.status.success(), "{file}");
        let a = tumble(&["check", &file]);
        let b = tumble(&["check", &f]);
        assert_eq!(
            text(&a.stdout),
            text(&b.stdout).replace(&f, &file),
            "{file}"
        );
    }
}

#[test]
fn ops_lists_the_operator_table() {
    let out = tumble(&["ops"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for op in [
        "nn.dense",
        "nn.batch_matmul",
        "concatenate",
        "random.db_uniform",
        "db.phase_change",
    ] {
        assert!(s.contains(op), "{op} missing from `tumble ops`");
    }
}

/// A graph as TVM prints it (`nn.dropout`'s and `nn.batch_norm`'s tuples read by projection,
/// `nn.pad`'s pad value as an operand) checks, and both engines run it with inference
/// semantics: dropout is the identity, batch norm normalizes by the moving statistics.
#[test]
fn tvm_printed_dropout_batch_norm_and_pad_run() {
    let model = temp_file(
        "tvm_ops.relay",
        r#"
def @main(%x: Tensor[(1, 2), float32], %g: Tensor[(2), float32], %b: Tensor[(2), float32],
          %m: Tensor[(2), float32], %v: Tensor[(2), float32]) {
  %0 = nn.dropout(%x, rate=0.5f);
  %1 = nn.batch_norm(%0.0, %g, %b, %m, %v, axis=1, epsilon=0f);
  %2 = nn.pad(%1.0, 9f, pad_width=[[0, 0], [1, 0]]);
  (%2, %1.1, %0.1)
}
"#,
    );
    let model = model.to_string_lossy().to_string();
    let out = tumble(&["check", &model]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(
            "-> (Tensor[(1, 3), float32], Tensor[(2), float32], Tensor[(1, 2), float32])"
        ),
        "{}",
        text(&out.stdout)
    );
    let inputs = temp_file(
        "tvm_ops.jsonl",
        "{\"x\": [[3, 5]], \"g\": [2, 1], \"b\": [1, 0], \"m\": [1, 1], \"v\": [4, 16]}\n",
    );
    let inputs = inputs.to_string_lossy().to_string();
    for engine in ["batched", "reference"] {
        let out = tumble(&["run", &model, "--inputs", &inputs, "--engine", engine]);
        assert!(out.status.success(), "{engine}: {}", text(&out.stderr));
        assert_eq!(
            text(&out.stdout).trim(),
            "[[[9.0,3.0,1.0]],[1.0,1.0],[[1.0,1.0]]]",
            "{engine}"
        );
    }
    let ops = text(&tumble(&["ops"]).stdout);
    for op in [
        "nn.dropout",
        "nn.matmul",
        "full_like",
        "reshape_like",
        "broadcast_to_like",
        "collapse_sum_like",
        "sequence_mask",
        "nn.prelu",
        "nn.l2_normalize",
        "nn.pad",
        "nn.batch_norm",
    ] {
        assert!(ops.contains(op), "{op} missing from `tumble ops`");
    }
}

#[test]
fn usage_errors_exit_2_with_help() {
    let out = tumble(&["check"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("Usage"));
}

#[test]
fn run_errors_name_the_instance_and_leave_no_output_file() {
    let model = zoo_model("treelstm_small");
    let inputs = temp_file(
        "bad_instances.jsonl",
        "{\"tree\": {\"Rose\": [[0], []]}}\n{\"tree\": {\"Rose\": [[2.5], []]}}\n",
    );
    let out_path = temp_path("never.jsonl");
    let out = run_random(
        &model,
        &inputs.display().to_string(),
        &["--output", &out_path.display().to_string()],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains(".tree.Rose[0]"), "{err}");
    assert!(
        !out_path.exists(),
        "a failed run must not leave an output file"
    );
}

#[test]
fn run_without_weights_lists_what_is_missing() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let out = tumble(&["run", &model, "--inputs", &inputs]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("missing parameter"), "{err}");
    assert!(err.contains("--random-params"), "{err}");
}

#[test]
fn batched_and_reference_engines_agree_on_the_readme_command() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let batched = run_random(&model, &inputs, &["--batch", "3", "--profile"]);
    let reference = run_random(&model, &inputs, &["--engine", "reference"]);
    assert!(batched.status.success(), "{}", text(&batched.stderr));
    assert!(reference.status.success());
    // Fused kernels round differently from the f64 reference loops: equal within 1e-5.
    let parse = |o: &Output| -> Vec<f64> {
        text(&o.stdout)
            .lines()
            .flat_map(|l| {
                let v: serde_json::Value =
                    serde_json::from_str(l).unwrap_or(serde_json::Value::Null);
                let mut out = Vec::new();
                let mut stack = vec![v];
                while let Some(x) = stack.pop() {
                    match x {
                        serde_json::Value::Array(a) => stack.extend(a),
                        serde_json::Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN)),
                        _ => out.push(f64::NAN),
                    }
                }
                out
            })
            .collect()
    };
    let (b, r) = (parse(&batched), parse(&reference));
    assert_eq!(b.len(), r.len());
    assert_eq!(b.len(), 8 * 5);
    for (x, y) in b.iter().zip(&r) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
    }
    assert!(text(&batched.stderr).contains("batched launches"));
}

#[test]
fn explain_reports_what_each_static_optimization_found() {
    let birnn = tumble(&["explain", &zoo_model("birnn_small")]);
    assert!(birnn.status.success(), "{}", text(&birnn.stderr));
    let out = text(&birnn.stdout);
    for want in [
        "static optimizations:",
        "@rnn -> @rnn#2",
        "hoisting: independent of recursive state",
        "rnn_input at ",
        "phases: 1 boundaries in @main",
        // The classifier's `@map`, specialized on its closure, runs as a loop.
        "run as loops over their list (`@map`'s shape): @map[0=",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    // rnn_step carries the recurrent state: not hoisted.
    assert!(!out.contains("rnn_step at "), "{out}");
    let stack = text(&tumble(&["explain", &zoo_model("stackrnn_small")]).stdout);
    assert!(stack.contains("in @stackrnn: [0, 1]"), "{stack}");
    let berxit = text(&tumble(&["explain", &zoo_model("berxit_small")]).stdout);
    assert!(
        berxit.contains("(horizontally fused)"),
        "no fused Q/K/V group"
    );
    // `--code`: the program after the static passes, before the report; without it, none.
    let tree = tumble(&["explain", &zoo_model("treelstm_small"), "--code"]);
    assert!(tree.status.success(), "{}", text(&tree.stderr));
    let code = text(&tree.stdout);
    for want in [
        "fn @treelstm (lambda",
        "invoke treelstm_leaf#",
        "@map[0=fn#",
        "fn @main (lambda",
    ] {
        assert!(code.contains(want), "missing {want:?} in:\n{code}");
    }
    let (program, report) = code
        .split_once("model ")
        .unwrap_or_else(|| panic!("no report after the code:\n{code}"));
    assert!(program.contains("entry") && report.contains("static optimizations:"));
    assert!(!text(&tumble(&["explain", &zoo_model("treelstm_small")]).stdout).contains("fn @"));
    // The compiler's switches are `run`'s (the report names them), and `--batch` decides block
    // merging as `run --batch` does.
    let off = tumble(&[
        "explain",
        &zoo_model("birnn_small"),
        "--no-auto-concurrency",
        "--no-hoist",
        "--no-ghosts",
        "--no-dup",
    ]);
    assert!(off.status.success(), "{}", text(&off.stderr));
    assert!(
        !text(&off.stdout).contains("rnn_input at "),
        "{}",
        text(&off.stdout)
    );
    let merges = |extra: &[&str]| {
        let out = tumble(&[&["explain", &zoo_model("birnn_small")][..], extra].concat());
        text(&out.stdout).contains("hoisted blocks run inside the block that reads them")
    };
    assert!(merges(&[]) && merges(&["--batch", "64"]));
    assert!(!merges(&["--batch", "8"]) && !merges(&["--no-block-merge"]));
    // Instances files explain refuses, each with its reason: none (it blamed the model's `%tree`
    // for not being in it), a key @main does not have (named as `run` names it; another model's
    // instances too), and keys that leave the tree to the weights (as `compile` refuses them;
    // it was explained with every argument shared).
    let empty = temp_file("explain_empty.jsonl", "");
    let foo = temp_file("explain_foo.jsonl", "{\"foo\": 1}\n");
    let no_tree = temp_file("explain_no_tree.jsonl", "{\"b_out\": [0, 0, 0, 0, 0]}\n");
    let (empty, foo, no_tree) = (
        empty.display().to_string(),
        foo.display().to_string(),
        no_tree.display().to_string(),
    );
    for (file, wants) in [
        (empty, &["has no instances"][..]),
        (foo, &["`foo` is not an argument of @main"]),
        (example("birnn"), &["`tokens` is not an argument of @main"]),
        (no_tree, &["%tree", "cannot be a weight"]),
    ] {
        let out = tumble(&["explain", &zoo_model("treelstm_small"), "-i", &file]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{file}: {err}");
        for want in wants {
            assert!(err.contains(want), "{file}: {err}");
        }
    }
}

#[test]
fn every_optimization_switch_is_accepted_and_keeps_the_outputs() {
    let model = zoo_model("stackrnn_small");
    let inputs = example("stackrnn");
    let all = run_random(&model, &inputs, &[]);
    assert!(all.status.success(), "{}", text(&all.stderr));
    let switches = [
        "--no-coarsen",
        "--no-fusion",
        "--no-phases",
        "--no-hoist",
        "--no-ghosts",
        "--no-dup",
        "--no-hfuse",
        "--no-gather-fusion",
        "--no-row-cache",
        "--no-epilogue",
        "--no-buffer-pool",
        "--no-lend-threads",
        "--no-narrow-gemm",
        "--no-prepack",
    ];
    let none = run_random(&model, &inputs, &switches);
    assert!(none.status.success(), "{}", text(&none.stderr));
    // StackRNN's outputs are argmax decisions and logits; the decisions must match exactly.
    let actions = |o: &Output| -> Vec<String> {
        text(&o.stdout)
            .lines()
            .map(|l| l.rsplit_once("]],").map_or(l, |(_, a)| a).to_string())
            .collect()
    };
    assert_eq!(actions(&all), actions(&none));
    assert_eq!(
        text(&all.stdout).lines().count(),
        text(&none.stdout).lines().count()
    );
}

/// Launch outputs placed in recycled buffers give the bytes of freshly allocated ones: TreeLSTM-large
/// (outputs of rows × 512 floats, large enough to be pooled) on 64 trees in mini-batches of 8, so
/// later launches reuse the buffers that earlier ones freed.
#[test]
fn the_buffer_pool_does_not_change_the_outputs() {
    let model = zoo_model("treelstm_large");
    let trees = std::fs::read_to_string(example("treelstm")).unwrap();
    let inputs = temp_path("pool-trees.jsonl");
    std::fs::write(&inputs, trees.repeat(8)).unwrap();
    let inputs = inputs.display().to_string();
    let run = |extra: &[&str]| {
        let args = [&["--batch", "8", "--threads", "1", "--profile"][..], extra].concat();
        let out = run_random(&model, &inputs, &args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        out
    };
    let pooled = run(&[]);
    let fresh = run(&["--no-buffer-pool"]);
    assert_eq!(text(&pooled.stdout), text(&fresh.stdout));
    let recycled = |o: &Output| -> u64 {
        let err = text(&o.stderr);
        err.lines()
            .find_map(|l| l.strip_prefix("peak activation bytes "))
            .and_then(|l| l.split_once("; "))
            .and_then(|(_, r)| r.split_once(" outputs in recycled buffers"))
            .and_then(|(n, _)| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no recycled-buffer count in:\n{err}"))
    };
    assert!(recycled(&pooled) > 0, "{}", text(&pooled.stderr));
    assert_eq!(recycled(&fresh), 0);
}

/// Weights packed before the run (start-up) give the bytes of weights packed at their first
/// launch, and `--profile` counts them: TreeLSTM-small's four GEMM weights.
#[test]
fn prepacked_weights_do_not_change_the_outputs() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let run = |extra: &[&str]| {
        let args = [&["--batch", "3", "--threads", "1", "--profile"][..], extra].concat();
        let out = run_random(&model, &inputs, &args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        out
    };
    let packed = |o: &Output| -> u64 {
        let err = text(&o.stderr);
        err.lines()
            .find_map(|l| l.split_once(" weights packed "))
            .and_then(|(head, _)| head.rsplit_once(", "))
            .and_then(|(_, n)| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no packed-weight count in:\n{err}"))
    };
    let ahead = run(&[]);
    let lazily = run(&["--no-prepack"]);
    assert_eq!(text(&ahead.stdout), text(&lazily.stdout));
    assert_eq!(packed(&ahead), 4, "{}", text(&ahead.stderr));
    assert_eq!(packed(&lazily), 0);
    // Packed on three threads (one weight each, the largest first): the same weights packed,
    // the same bytes out as packing them on one thread or at the first launches.
    let three = |extra: &[&str], serial: bool| {
        let base = ["run", &model, "--inputs", &inputs, "--random-params", "0"];
        let args = [
            &base[..],
            &["--batch", "3", "--threads", "3", "--profile"],
            extra,
        ]
        .concat();
        let env: &[(&str, &str)] = match serial {
            true => &[("TUMBLE_SERIAL_PREPACK", "1")],
            false => &[],
        };
        let out = common::tumble_with_env(&args, env);
        assert!(out.status.success(), "{}", text(&out.stderr));
        out
    };
    let parallel = three(&[], false);
    let serial = three(&[], true);
    let lazily = three(&["--no-prepack"], false);
    assert_eq!(packed(&parallel), 4, "{}", text(&parallel.stderr));
    assert_eq!(packed(&serial), 4, "{}", text(&serial.stderr));
    assert_eq!(text(&parallel.stdout), text(&lazily.stdout));
    assert_eq!(text(&serial.stdout), text(&lazily.stdout));
}

/// Mini-batches run at once on several workers give the bytes of one mini-batch after another,
/// for any thread budget, and `--profile` says how the threads were shared.
#[test]
fn workers_do_not_change_the_outputs() {
    for (name, data) in [
        ("treelstm_small", "treelstm"),
        ("stackrnn_small", "stackrnn"),
    ] {
        let model = zoo_model(name);
        let inputs = example(data);
        let run = |extra: &[&str]| {
            let out = run_random(&model, &inputs, &[&["--batch", "3"], extra].concat());
            assert!(out.status.success(), "{}", text(&out.stderr));
            out
        };
        let serial = run(&["--threads", "1", "--workers", "1"]);
        for extra in [
            &["--threads", "2", "--workers", "2", "--profile"][..],
            &["--threads", "3", "--workers", "3"],
            &["--threads", "3", "--workers", "3", "--no-lend-threads"],
            &["--threads", "2", "--workers", "1"],
        ] {
            let got = run(extra);
            assert_eq!(text(&serial.stdout), text(&got.stdout), "{name} {extra:?}");
            if extra.contains(&"--profile") {
                let err = text(&got.stderr);
                assert!(err.contains("on 2 workers x 1 kernel threads"), "{err}");
            }
        }
    }
}

/// An instance's results do not depend on the mini-batch it ran in, the threads, the workers
/// sharing the job's kept results, or the scheduler: byte-identical output. TreeLSTM-large's
/// products have K = 512, two K blocks in launches of more than 4 rows and one in smaller ones;
/// the tiles of the second block carry on from C rather than adding their own sum to it (before,
/// batch 1, batch 64 and two workers at batch 1 printed three different last digits).
#[test]
fn results_do_not_depend_on_batching_threads_or_scheduler() {
    let model = zoo_model("treelstm_large");
    let inputs = example("treelstm");
    let run = |extra: &[&str]| {
        let out = run_random(&model, &inputs, extra);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let whole = run(&["--batch", "64", "--threads", "1"]);
    for extra in [
        &["--batch", "1", "--threads", "1"][..],
        &["--batch", "5", "--threads", "1"],
        &["--batch", "1", "--threads", "2", "--workers", "2"],
        &["--batch", "64", "--threads", "2"],
        &["--batch", "5", "--threads", "1", "--scheduler", "eager"],
    ] {
        assert_eq!(whole, run(extra), "{extra:?}");
    }
}

/// With several workers, the error reported is the first failing instance's, as in a serial run,
/// and no output file is left.
#[test]
fn workers_report_the_first_failing_instance() {
    let model = zoo_model("treelstm_small");
    let good = "{\"tree\": {\"Rose\": [[3], []]}}\n";
    let bad = |k: usize| format!("{{\"tree\": {{\"Rose\": [[{k}.5], []]}}}}\n");
    // Instances 4 and 9 are bad: mini-batches 1 and 4 of 2 instances fail.
    let lines: String = (0..12)
        .map(|i| {
            if i == 4 || i == 9 {
                bad(i)
            } else {
                good.to_string()
            }
        })
        .collect();
    let inputs = temp_file("two_bad.jsonl", &lines);
    let out_path = temp_path("never_workers.jsonl");
    for workers in ["1", "2", "4"] {
        let out = run_random(
            &model,
            &inputs.display().to_string(),
            &[
                "--batch",
                "2",
                "--threads",
                "4",
                "--workers",
                workers,
                "--output",
                &out_path.display().to_string(),
            ],
        );
        assert_eq!(out.status.code(), Some(1), "workers {workers}");
        let err = text(&out.stderr);
        assert!(err.contains("line 5"), "workers {workers}: {err}");
        assert!(!err.contains("line 10"), "workers {workers}: {err}");
        assert!(!out_path.exists(), "workers {workers}: output file left");
    }
    let zero = tumble(&["run", &model, "--inputs", "x", "--workers", "0"]);
    assert_eq!(zero.status.code(), Some(2));
}

/// A deep instance (a chain of 3000 internal nodes) decodes and runs on every worker, not only
/// on the main work thread: the workers get its stack.
#[test]
fn deep_instances_run_on_workers() {
    let model = zoo_model("treelstm_small");
    let mut tree = "{\"Rose\": [[5], []]}".to_string();
    for _ in 0..3000 {
        tree = format!("{{\"Rose\": [[0], [{tree}]]}}");
    }
    let line = format!("{{\"tree\": {tree}}}\n");
    let inputs = temp_file("deep_chain.jsonl", &line.repeat(2));
    let out = run_random(
        &model,
        &inputs.display().to_string(),
        &["--batch", "1", "--threads", "2", "--workers", "2"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0], lines[1]);
}

/// A program drawing with `random.db_uniform` (ACROBAT's form: bounds as run-time tensors, one
/// of them computed from the instance's data) prints the same draws whatever the mini-batch size
/// and engine: instance i draws from its own stream of `--seed`.
#[test]
fn random_draws_do_not_depend_on_batching_or_engine() {
    let model = temp_file(
        "draws.rly",
        r#"#[version = "0.0.5"]
def @main(%x: Tensor[(1, 4), float32], %n: Tensor[(), int32]) -> (Tensor[(), int32], Tensor[(3), float32]) {
  let %m = add(sum(cast(greater(tanh(%x), 0f), dtype="int32")), 2);
  let %a = random.db_uniform(0, %n, out_shape=[], out_dtype="int32");
  let %b = random.db_uniform(-1f, cast(%m, dtype="float32"), out_shape=[3], out_dtype="float32");
  (%a + random.db_uniform(0, %m, out_shape=[], out_dtype="int32"), %b)
}
"#,
    );
    let inputs: String = (0..7)
        .map(|i| {
            format!(
                "{{\"x\": [[0.{i}, -1.0, {i}.5, -0.{i}]], \"n\": {}}}\n",
                2 + i
            )
        })
        .collect();
    let inputs = temp_file("draws.jsonl", &inputs);
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    let run = |extra: &[&str]| {
        let out = tumble(&[&["run", &model, "--inputs", &inputs, "--seed", "9"], extra].concat());
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let one = run(&["--batch", "1"]);
    assert_eq!(one.lines().count(), 7);
    assert_eq!(one, run(&["--batch", "3"]), "--batch 3 drew differently");
    assert_eq!(
        one,
        run(&["--engine", "reference"]),
        "the reference engine drew differently"
    );
    assert_eq!(one, run(&["--batch", "3", "--scheduler", "eager"]));
    let other = tumble(&["run", &model, "--inputs", &inputs, "--seed", "10"]);
    assert_ne!(one, text(&other.stdout), "--seed does not change the draws");
}

/// The reference engine says which batched-engine options it has nothing to act on (they were
/// ignored silently: `--profile` printed nothing, `--repeat 3` ran once), and runs as without them.
#[test]
fn the_reference_engine_names_the_batched_options_it_ignores() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let plain = run_random(&model, &inputs, &["--engine", "reference"]);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(
        !text(&plain.stderr).contains("warning"),
        "{}",
        text(&plain.stderr)
    );
    let given = run_random(
        &model,
        &inputs,
        &[
            "--engine",
            "reference",
            "--profile",
            "--repeat",
            "3",
            "--batch",
            "2",
        ],
    );
    assert!(given.status.success(), "{}", text(&given.stderr));
    assert_eq!(text(&given.stdout), text(&plain.stdout));
    assert!(
        text(&given.stderr)
            .contains("warning: --profile, --repeat, --batch act on the batched engine only"),
        "{}",
        text(&given.stderr)
    );
}

/// The ACROBAT-form zoo models check, and ACROBAT's DRNN generates the same trees batched
/// (`--batch 1`, `--batch 3`) and in the reference engine.
#[test]
fn acrobat_form_models_check_and_agree_across_engines() {
    for m in ["drnn_small", "drnn_large", "berxit_small", "berxit_large"] {
        let out = tumble(&["check", "-q", &zoo_model(&format!("acrobat/{m}"))]);
        assert!(out.status.success(), "{m}: {}", text(&out.stderr));
    }
    let model = zoo_model("acrobat/drnn_small");
    let inputs = example("drnn_small");
    let run = |extra: &[&str]| {
        let out = run_random(&model, &inputs, &[&["--seed", "3"], extra].concat());
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let one = run(&["--batch", "1"]);
    assert_eq!(one.lines().count(), 4);
    assert_eq!(one, run(&["--batch", "3"]));
    assert_eq!(one, run(&["--engine", "reference"]));
}

/// Later mini-batches take the results earlier ones kept (a leaf on a word seen before), the
/// same outputs as with `--no-job-memo`; and every `--repeat` run does the whole job's work
/// again: its last run takes as many kept results as a single run (none from the run before).
#[test]
fn kept_results_are_per_run_and_change_no_output() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    // One thread: the mini-batches run one after another, so how many of them find a result
    // kept by an earlier one does not depend on how two workers interleave.
    let kept = |extra: &[&str]| {
        let out = run_random(
            &model,
            &inputs,
            &[&["--batch", "3", "--threads", "1", "--profile"], extra].concat(),
        );
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        (
            text(&out.stdout),
            profile_count(&out.stderr, "kept results: "),
        )
    };
    let (once, n) = kept(&[]);
    assert!(n > 0, "no leaf took a result an earlier mini-batch kept");
    assert_eq!(kept(&["--repeat", "3"]), (once.clone(), n));
    assert_eq!(kept(&["--no-job-memo"]), (once, 0));
}

/// An environment switch is on when set to anything but empty, `0`, `false`, `no` or `off`:
/// `TUMBLE_NO_MEMO=0` leaves a launch's identical invocations sharing their results (it turned
/// them off while any value did), `TUMBLE_NO_MEMO=1` or `yes` turns that off; the output is the
/// same bytes either way.
#[test]
fn environment_switches_read_zero_as_off() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let shared = |value: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tumble"));
        cmd.args(["run", &model, "--inputs", &inputs, "--random-params", "0"])
            .args([
                "--batch",
                "3",
                "--threads",
                "1",
                "--profile",
                "--color=never",
            ])
            .env_remove("TUMBLE_NO_MEMO");
        if let Some(v) = value {
            cmd.env("TUMBLE_NO_MEMO", v);
        }
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run tumble: {e}"));
        assert!(out.status.success(), "{value:?}: {}", text(&out.stderr));
        (
            text(&out.stdout),
            profile_count(&out.stderr, "identical invocations: "),
        )
    };
    let (bytes, n) = shared(None);
    assert!(
        n > 0,
        "no identical invocations shared results with the switch unset"
    );
    for off in ["0", "", "off", "False"] {
        assert_eq!(
            shared(Some(off)),
            (bytes.clone(), n),
            "TUMBLE_NO_MEMO={off:?}"
        );
    }
    for on in ["1", "yes"] {
        assert_eq!(
            shared(Some(on)),
            (bytes.clone(), 0),
            "TUMBLE_NO_MEMO={on:?}"
        );
    }
}

/// `--repeat N` runs the job N times in one process: the same outputs as one run, and the
/// profile lists every run's time.
#[test]
fn repeat_runs_the_job_again_with_the_same_outputs() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let once = run_random(&model, &inputs, &["--batch", "3"]);
    let thrice = run_random(
        &model,
        &inputs,
        &["--batch", "3", "--repeat", "3", "--profile"],
    );
    assert!(thrice.status.success(), "{}", text(&thrice.stderr));
    assert_eq!(text(&once.stdout), text(&thrice.stdout));
    let err = text(&thrice.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("repeats (ms per run):"))
        .unwrap_or_else(|| panic!("no repeats line in {err}"));
    assert_eq!(
        line.split(';').next().map(|l| l.split_whitespace().count()),
        Some(7)
    ); // "repeats (ms per run):" and 3 times
       // The same runs without decoding the instances: one figure per run, none above its wall time.
    let no_decode = err
        .lines()
        .find(|l| l.starts_with("repeats without decoding inputs (ms per run):"))
        .unwrap_or_else(|| panic!("no repeats-without-decoding line in {err}"));
    let times = |l: &str| -> Vec<f64> {
        l.split(';')
            .next()
            .and_then(|l| l.split("):").nth(1))
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let (walls, computes) = (times(line), times(no_decode));
    assert_eq!((walls.len(), computes.len()), (3, 3), "{err}");
    assert!(walls.iter().zip(&computes).all(|(w, c)| c <= w), "{err}");
    // The first run's parts, whose total is the first figure of the repeats line.
    let first = err
        .lines()
        .find_map(|l| l.strip_prefix("first run (ms; the profile above is the last run's): total "))
        .unwrap_or_else(|| panic!("no first-run line in {err}"));
    let total: f64 = first
        .split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no total in {first}"));
    assert!((total - walls[0]).abs() < 0.01, "{first} against {walls:?}");
    assert!(
        first.contains("program ") && first.contains("kernels "),
        "{first}"
    );
    let zero = run_random(&model, &inputs, &["--repeat", "0"]);
    assert_eq!(zero.status.code(), Some(2));
}

/// A launch that fails for one invocation of several names that invocation's instance (the
/// batched engine reran the launch's invocations one by one to find it), as the reference does.
#[test]
fn a_failing_launch_names_the_failing_instance() {
    let model = temp_file(
        "fail_one.rly",
        "def @main(%tok: Tensor[(1), int32], %emb: Tensor[(10, 4), float32]) -> Tensor[(1, 4), float32] {\n  tanh(take(%emb, %tok, axis=0, mode=\"fast\"))\n}\n",
    );
    let inputs = temp_file(
        "fail_one.jsonl",
        "{\"tok\": [1]}\n{\"tok\": [2]}\n{\"tok\": [3]}\n{\"tok\": [12]}\n{\"tok\": [4]}\n",
    );
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    for engine in ["batched", "reference"] {
        let out = run_random(&model, &inputs, &["--engine", engine]);
        assert_eq!(out.status.code(), Some(1), "{engine}");
        let err = text(&out.stderr);
        assert!(
            err.contains("instance at line 4") && err.contains("index 12 is out of range"),
            "{engine}: {err}"
        );
    }
}

/// Files and flags (hostile input): an output that would replace one of the run's own files is
/// refused before anything runs and the file is left as it was; `-o -` is standard output; a
/// symlink is written through (the link stays, its target gets the results).
#[test]
fn outputs_never_replace_inputs_and_follow_links() {
    let model = zoo_model("treelstm_small");
    let original = std::fs::read_to_string(example("treelstm"))
        .unwrap_or_else(|e| panic!("cannot read the example: {e}"));
    let inputs = temp_file("self.jsonl", &original);
    let inputs_s = inputs.display().to_string();
    // -o the inputs file, the model, and two outputs naming one file.
    let cases: [(&[&str], &str); 3] = [
        (&["-o", &inputs_s], "the --inputs file"),
        (&["-o", &model], "the model"),
        (
            &["-o", "same.jsonl", "--save-params", "./same.jsonl"],
            "the --save-params file",
        ),
    ];
    for (extra, what) in cases {
        let out = run_random(&model, &inputs_s, extra);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(
            err.contains("is the same file as") && err.contains(what),
            "{err}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(&inputs).unwrap_or_default(),
        original
    );
    assert!(!std::path::Path::new("same.jsonl").exists());
    // `-o -`: standard output, no file named `-`.
    let dash = run_random(&model, &inputs_s, &["-o", "-"]);
    assert!(dash.status.success(), "{}", text(&dash.stderr));
    assert_eq!(text(&dash.stdout).lines().count(), original.lines().count());
    assert!(!std::path::Path::new("-").exists());
    // Through a symlink to a file not written yet.
    let target = temp_path("target.jsonl");
    let link = temp_path("link.jsonl");
    #[cfg(unix)]
    {
        if let Err(e) = std::os::unix::fs::symlink(&target, &link) {
            panic!("cannot make a symlink: {e}");
        }
        let out = run_random(&model, &inputs_s, &["-o", &link.display().to_string()]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let meta = std::fs::symlink_metadata(&link).unwrap_or_else(|e| panic!("{e}"));
        assert!(meta.file_type().is_symlink(), "the link was replaced");
        assert_eq!(
            std::fs::read_to_string(&target)
                .unwrap_or_default()
                .lines()
                .count(),
            original.lines().count()
        );
    }
}

/// Counts that would silently mean something else are refused: `--batch 0`, `--threads 0`, and a
/// `TUMBLE_NUM_THREADS` that is not a positive count.
#[test]
fn zero_and_malformed_counts_are_refused() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    for flag in ["--batch", "--threads"] {
        let out = run_random(&model, &inputs, &[flag, "0"]);
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            text(&out.stderr).contains("must be at least 1"),
            "{}",
            text(&out.stderr)
        );
    }
    for bad in ["abc", "0", "-2"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tumble"))
            .args(["run", &model, "--inputs", &inputs, "--random-params", "0"])
            .env("TUMBLE_NUM_THREADS", bad)
            .output()
            .unwrap_or_else(|e| panic!("cannot run tumble: {e}"));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        assert!(err.contains(&format!("TUMBLE_NUM_THREADS={bad}")), "{err}");
    }
}

/// A reader that closes standard output early (`| head -1`) ends every subcommand quietly: exit
/// 0, nothing on stderr (they panicked with "Broken pipe ... this is a bug").
#[test]
fn a_closed_stdout_ends_every_subcommand_quietly() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let commands: [&[&str]; 7] = [
        &["data", "nested", "--count", "50", "--seed", "0"],
        &["explain", &model],
        &["check", &model],
        &["fmt", &model],
        &["ops"],
        &["prelude"],
        &["run", &model, "--inputs", &inputs, "--random-params", "0"],
    ];
    for args in commands {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tumble"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run tumble: {e}"));
        // Close the reading end before the command writes anything.
        drop(child.stdout.take());
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("cannot wait for tumble: {e}"));
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        // `fmt` says what the canonical form leaves out (the model's comments); nothing else.
        let stderr = text(&out.stderr);
        let noise: Vec<&str> = stderr
            .lines()
            .filter(|l| !(args[0] == "fmt" && l.contains("leaves out the file's")))
            .collect();
        assert!(noise.is_empty(), "{args:?}: {stderr}");
    }
}

/// Messages (hostile input): an instances file with no instances or a `null` line says so; a
/// source that is not UTF-8 names the line, column and byte offset; a byte-order mark opening a
/// file is accepted, and one inside it is named (U+FEFF).
#[test]
fn empty_inputs_bad_utf8_and_byte_order_marks_are_named() {
    let model = zoo_model("treelstm_small");
    for (name, body) in [
        ("none.jsonl", ""),
        ("brackets.json", "[]"),
        ("blank.jsonl", "\n\n"),
    ] {
        let f = temp_file(name, body);
        let out = run_random(&model, &f.display().to_string(), &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains("no instances"), "{name}: {err}");
    }
    let nulls = temp_file("null.jsonl", "null\n");
    let out = run_random(&model, &nulls.display().to_string(), &[]);
    assert!(
        text(&out.stderr).contains("is `null`, not an instance"),
        "{}",
        text(&out.stderr)
    );
    let src = "def @main(%x: Tensor[(1), float32]) -> Tensor[(1), float32] {\n  %x }\n";
    let mut bad = src.as_bytes().to_vec();
    bad.splice(66..66, [0xffu8]);
    let bad_path = temp_path("bad.rly");
    std::fs::write(&bad_path, &bad).unwrap_or_else(|e| panic!("{e}"));
    let column = 66 - src.find('\n').unwrap_or(0);
    let want = format!(
        "bad.rly:2:{column}: the file is not UTF-8 text: invalid byte 0xff at byte offset 66"
    );
    for cmd in ["check", "explain", "fmt"] {
        let out = tumble(&[cmd, &bad_path.display().to_string()]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cmd}: {err}");
        assert!(err.contains(&want), "{cmd}: {err}");
    }
    let bom = temp_file("bom.rly", &format!("\u{feff}{src}"));
    let out = tumble(&["check", &bom.display().to_string()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let inside = temp_file("bom2.rly", &src.replace("%x }", "\u{feff}%x }"));
    let out = tumble(&["check", &inside.display().to_string()]);
    assert!(
        text(&out.stderr).contains("U+FEFF"),
        "{}",
        text(&out.stderr)
    );
}

/// Echoes of user input in messages are cut: an unknown 200,000-character key is named by its
/// first 80 characters and its length.
#[test]
fn long_user_text_is_cut_in_messages() {
    let key = "k".repeat(200_000);
    let line = format!("{{\"{key}\": 1, \"tree\": {{\"Rose\": [[1], []]}}}}\n");
    let f = temp_file("bigkey.jsonl", &line);
    let out = run_random(&zoo_model("treelstm_small"), &f.display().to_string(), &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", err.len());
    assert!(
        err.len() < 1_000 && err.contains("(200000 bytes in all)"),
        "{}",
        err.len()
    );
}

/// Messages (hostile input): an error on a line of megabytes shows a window around the location,
/// not the line; `expand_dims` with a huge `num_newaxis` says what the bound is.
#[test]
fn long_source_lines_are_windowed_and_bad_attributes_say_their_bound() {
    let long = temp_file(
        "long_line.rly",
        &format!(
            "#[version = \"0.0.5\"]\ndef @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {{ {}%x $ }}\n",
            " ".repeat(2_600_000)
        ),
    );
    let out = tumble(&["check", &long.display().to_string()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", &err[..err.len().min(500)]);
    assert!(err.len() < 2_000, "{} bytes of stderr", err.len());
    assert!(err.contains("long_line.rly:2:2600072"), "{err}");
    assert!(err.contains("%x $ }"), "{err}");
    assert!(err.contains("line 2 is 2600075 bytes long"), "{err}");

    let expand = temp_file(
        "expand.rly",
        "#[version = \"0.0.5\"]\ndef @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {\n  let %y = expand_dims(%x, axis=0, num_newaxis=100000000);\n  %x\n}\n",
    );
    let out = tumble(&["check", &expand.display().to_string()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("num_newaxis must be between 0 and 65536"),
        "{err}"
    );
}

/// `tumble run MODEL --inputs INPUTS EXTRA..`, which must fail with status 1: its stderr.
fn failing_run(model: &str, inputs: &str, extra: &[&str]) -> String {
    let mut args = vec!["run", model, "--inputs", inputs];
    args.extend_from_slice(extra);
    let out = tumble(&args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
    err
}

/// Messages: a failure inside a prelude function names the calls that led there in the user's
/// program, innermost first, on both engines.
#[test]
fn a_failure_inside_the_prelude_names_the_users_calls() {
    let model = temp_file(
        "prelude_trace.rly",
        "#[version = \"0.0.5\"]
def @first(%l: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  let %h = @hd(%l);
  %h
}
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %y = @first(Nil);
  add(%y, %x)
}
",
    );
    let inputs = temp_file("prelude_trace.jsonl", "{\"x\": [[1, 2, 3, 4]]}\n");
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    for engine in ["batched", "reference"] {
        let err = failing_run(&model, &inputs, &["--engine", engine]);
        assert!(err.contains("prelude_trace.rly:3:12"), "{engine}: {err}");
        let first = err.find("let %h = @hd(%l);");
        let main = err.find("let %y = @first(Nil);");
        assert!(
            matches!((first, main), (Some(a), Some(b)) if a < b),
            "{engine}: {err}"
        );
        assert!(err.contains("called from here (1)"), "{engine}: {err}");
        if engine == "batched" {
            // `@hd` runs natively there: the failing call is the user's own, the innermost.
            assert!(err.contains("`@hd` of an empty list"), "{engine}: {err}");
            assert!(!err.contains("called from here (2)"), "{engine}: {err}");
        } else {
            // Interpreted, the failure is the prelude's `match?`, under both user calls.
            assert!(err.contains("<prelude>:"), "{engine}: {err}");
            assert!(err.contains("called from here (2)"), "{engine}: {err}");
        }
    }
}

/// Messages: a self-recursive prelude function (`@nth` calls itself in tail position, which
/// replaces its frame) failing deep in its recursion still names the user's call that began it,
/// and which of two such calls it was.
#[test]
fn a_tail_recursive_failure_names_the_call_that_began_it() {
    let model = temp_file(
        "tail_trace.rly",
        "#[version = \"0.0.5\"]
def @main(%xs: List[Tensor[(1, 4), float32]], %i: Tensor[(), int32], %j: Tensor[(), int32]) -> Tensor[(1, 4), float32] {
  let %a = @nth(%xs, %i);
  let %b = @nth(%xs, %j);
  add(%a, %b)
}
",
    );
    let (model, late) = (model.display().to_string(), "tail_trace.rly:4:12");
    for (i, j, at) in [(1, 5, "tail_trace.rly:4:12"), (5, 1, "tail_trace.rly:3:12")] {
        let inputs = temp_file(
            "tail_trace.jsonl",
            &format!("{{\"xs\": [[[1,2,3,4]], [[5,6,7,8]]], \"i\": {i}, \"j\": {j}}}\n"),
        );
        let inputs = inputs.display().to_string();
        for engine in ["batched", "reference"] {
            let err = failing_run(&model, &inputs, &["--engine", engine]);
            assert!(err.contains(at), "{engine} i={i} j={j}: {err}");
            assert_eq!(
                at == late,
                !err.contains("tail_trace.rly:3:12"),
                "{engine}: {err}"
            );
        }
    }
}

/// Messages: an operator failing inside a block launch points at that operator (here in a
/// helper inlined into the caller's block), with the block's invocation as the call that led
/// there, as the reference engine points — in a launch of one instance and in a launch of
/// several (located after the launch is split to find its failing instance), under the fused
/// plans and operator by operator (`--no-fusion`).
#[test]
fn a_failing_operator_in_a_block_is_pointed_at() {
    let model = temp_file(
        "block_error.rly",
        "#[version = \"0.0.5\"]
def @f(%x: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  let %a = add(%x, %y);
  let %b = divide(%a, %y);
  multiply(%b, %x)
}
def @main(%x: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  @f(%x, %y)
}
",
    );
    let inputs = temp_file(
        "block_error.jsonl",
        "{\"x\": [1, 2], \"y\": [1, 1]}\n{\"x\": [1, 2], \"y\": [1, 0]}\n{\"x\": [3, 4], \"y\": [2, 2]}\n",
    );
    let runs: [&[&str]; 4] = [
        &["--engine", "reference"],
        &["--batch", "1"],
        &["--batch", "3"],
        &["--batch", "3", "--no-fusion"],
    ];
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    for extra in runs {
        let err = failing_run(&model, &inputs, extra);
        assert!(err.contains("instance at line 2"), "{extra:?}: {err}");
        assert!(err.contains("integer division by zero"), "{extra:?}: {err}");
        // The divide's own line and column, then the call of @f from @main.
        assert!(err.contains("block_error.rly:4:12"), "{extra:?}: {err}");
        let op = err.find("let %b = divide(%a, %y);");
        let call = err.find("@f(%x, %y)\n");
        assert!(
            matches!((op, call), (Some(a), Some(b)) if a < b),
            "{extra:?}: {err}"
        );
        assert!(err.contains("called from here (1)"), "{extra:?}: {err}");
    }
}

/// An operator of a helper inlined into another inlined helper: the batched engine's trace lists
/// both calls, innermost first, as the reference's does — and nothing more (the block's own
/// extent is not a call); an operator directly in `@main`'s block has no trace on either engine.
#[test]
fn a_failure_in_nested_inlined_helpers_lists_their_calls() {
    let model = temp_file(
        "nested_error.rly",
        "#[version = \"0.0.5\"]
def @g(%a: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  divide(%a, %y)
}
def @f(%x: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  let %a = add(%x, %y);
  multiply(@g(%a, %y), %x)
}
def @main(%x: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  let %r = @f(%x, %y);
  add(%r, %x)
}
",
    );
    let direct = temp_file(
        "direct_error.rly",
        "#[version = \"0.0.5\"]
def @main(%x: Tensor[(2), int32], %y: Tensor[(2), int32]) -> Tensor[(2), int32] {
  let %a = add(%x, %y);
  let %b = divide(%a, %y);
  multiply(%b, %x)
}
",
    );
    let inputs = temp_file("nested_error.jsonl", "{\"x\": [1, 2], \"y\": [1, 0]}\n");
    let (model, direct, inputs) = (
        model.display().to_string(),
        direct.display().to_string(),
        inputs.display().to_string(),
    );
    for engine in ["batched", "reference"] {
        let err = failing_run(&model, &inputs, &["--engine", engine]);
        assert!(err.contains("nested_error.rly:3:3"), "{engine}: {err}");
        let g = err.find("multiply(@g(%a, %y), %x)");
        let f = err.find("let %r = @f(%x, %y);");
        assert!(
            matches!((g, f), (Some(a), Some(b)) if a < b),
            "{engine}: {err}"
        );
        assert!(err.contains("called from here (2)"), "{engine}: {err}");
        assert!(!err.contains("called from here (3)"), "{engine}: {err}");
        let err = failing_run(&direct, &inputs, &["--engine", engine]);
        assert!(err.contains("direct_error.rly:4:12"), "{engine}: {err}");
        assert!(!err.contains("called from here"), "{engine}: {err}");
    }
}

/// The same for a ragged launch (rows of every length batched together, `dfg/ragged.rs`): the
/// failing operator, not the invocation, with and without the ragged form.
#[test]
fn a_failing_operator_in_a_ragged_launch_is_pointed_at() {
    let model = temp_file(
        "ragged_error.rly",
        "#[version = \"0.0.5\"]
def @f(%x: Tensor[(?, 4), int32], %y: Tensor[(?, 4), int32]) -> Tensor[(?, 4), int32] {
  let %a = add(%x, %y);
  let %b = divide(%a, %y);
  multiply(%b, %x)
}
def @main(%x: Tensor[(?, 4), int32], %y: Tensor[(?, 4), int32]) -> Tensor[(?, 4), int32] {
  @f(%x, %y)
}
",
    );
    let inputs = temp_file(
        "ragged_error.jsonl",
        "{\"x\": [[1, 2, 3, 4]], \"y\": [[1, 1, 1, 1]]}\n\
         {\"x\": [[1, 2, 3, 4], [5, 6, 7, 8]], \"y\": [[1, 1, 1, 1], [1, 0, 1, 1]]}\n\
         {\"x\": [[3, 4, 5, 6]], \"y\": [[2, 2, 2, 2]]}\n",
    );
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    let runs: [&[&str]; 3] = [&["--engine", "reference"], &[], &["--no-ragged"]];
    for extra in runs {
        let err = failing_run(&model, &inputs, extra);
        assert!(err.contains("instance at line 2"), "{extra:?}: {err}");
        assert!(err.contains("ragged_error.rly:4:12"), "{extra:?}: {err}");
        assert!(err.contains("called from here (1)"), "{extra:?}: {err}");
    }
}

/// Block merging follows the job's mini-batch: BiRNN's input transform runs inside its step
/// (`rnn_input+rnn_step` in the profile) for mini-batches of at least 32 instances, in launches
/// of its own below that or with `--no-block-merge`, and the predicted classes are the same.
#[test]
fn block_merging_follows_the_mini_batch_size() {
    let model = zoo_model("birnn_small");
    let sentences = std::fs::read_to_string(example("birnn")).unwrap();
    let inputs = temp_path("merge-sentences.jsonl");
    std::fs::write(&inputs, sentences.repeat(4)).unwrap();
    let inputs = inputs.display().to_string();
    let run = |extra: &[&str]| {
        let args = [&["--threads", "1", "--profile"][..], extra].concat();
        let out = run_random(&model, &inputs, &args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        out
    };
    let merged_block = |o: &Output| text(&o.stderr).contains("rnn_input+rnn_step");
    let big = run(&["--batch", "32"]);
    let all = run(&[]);
    let small = run(&["--batch", "8"]);
    let off = run(&["--batch", "32", "--no-block-merge"]);
    assert!(merged_block(&big), "{}", text(&big.stderr));
    assert!(merged_block(&all), "{}", text(&all.stderr));
    assert!(!merged_block(&small), "{}", text(&small.stderr));
    assert!(!merged_block(&off), "{}", text(&off.stderr));
    assert_eq!(text(&big.stdout), text(&off.stdout));
    assert_eq!(text(&big.stdout), text(&small.stdout));
}

/// The evaluator's shared values (field-less constructors, `()`, globals as values made once per
/// instance) and its tuple-scrutinee `match` change no output: StackRNN matches
/// `(%buffer, %stack)` and makes `True`/`False`/`Nil` at every transition.
#[test]
fn shared_values_and_tuple_matches_change_no_output() {
    let model = zoo_model("stackrnn_small");
    let inputs = example("stackrnn");
    let run = |env_off: bool, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tumble"));
        cmd.args(["run", &model, "--inputs", &inputs, "--random-params", "0"])
            .args(extra)
            .arg("--color=never");
        if env_off {
            cmd.env("TUMBLE_NO_SHARED_VALUES", "1");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let on = run(false, &[]);
    assert!(!on.is_empty());
    assert_eq!(on, run(true, &[]));
    // Without the evaluator's shortcuts the tuple is made and matched as a value.
    assert_eq!(on, run(false, &["--no-native-prelude"]));
}

/// A plain BiRNN whose recurrent weights are laid out for `h · U` (`transpose(%W_h)`): the
/// transposes become derived parameters (`explain` lists them), computed once per run, and the
/// predictions are those of `--no-derived-params`.
#[test]
fn weight_transforms_become_derived_parameters() {
    let source = std::fs::read_to_string(root().join("models/plain/birnn_small.rly")).unwrap();
    assert!(source.contains("nn.dense(%h, %W_h)"));
    let source = source.replace("nn.dense(%h, %W_h)", "nn.dense(%h, transpose(%W_h))");
    let model = temp_file("birnn_transposed.rly", &source)
        .display()
        .to_string();
    let inputs = example("birnn");
    let explain = tumble(&["explain", &model]);
    assert!(explain.status.success(), "{}", text(&explain.stderr));
    let shown = text(&explain.stdout);
    assert!(shown.contains("derived parameters"), "{shown}");
    assert!(shown.contains("in rnn:x: transpose"), "{shown}");
    let on = run_random(&model, &inputs, &[]);
    let off = run_random(&model, &inputs, &["--no-derived-params"]);
    assert!(on.status.success(), "{}", text(&on.stderr));
    assert!(off.status.success(), "{}", text(&off.stderr));
    assert!(!on.stdout.is_empty());
    assert_eq!(text(&on.stdout), text(&off.stdout));
}

/// The plain BiRNN written with column vectors (`W · x`, states `(256, 1)`): `explain` reports
/// the canonical products, and the predictions equal the row-vector model's and
/// `--no-canonical-products`' (the same weights by name).
#[test]
fn column_vector_birnn_predicts_like_the_row_vector_one() {
    let row = std::fs::read_to_string(root().join("models/plain/birnn_small.rly")).unwrap();
    let mut col = row.clone();
    for (from, to) in [
        ("%h: Tensor[(1, 256), float32],\n  %emb", "%h: Tensor[(256, 1), float32],\n  %emb"),
        (") -> List[Tensor[(1, 256), float32]] {", ") -> List[Tensor[(256, 1), float32]] {"),
        (
            "let %x = take(%emb, %tok, axis=0);",
            "let %x = transpose(take(%emb, %tok, axis=0));",
        ),
        (
            "tanh(add(add(nn.dense(%x, %W_x), %b), nn.dense(%h, %W_h)))",
            "tanh(add(add(nn.dense(%W_x, transpose(%x)), reshape(%b, newshape=[256, 1])), nn.dense(%W_h, transpose(%h))))",
        ),
        (
            "zeros(shape=[1, 256], dtype=\"float32\")",
            "zeros(shape=[256, 1], dtype=\"float32\")",
        ),
        (
            "(%hh: (Tensor[(1, 256), float32], Tensor[(1, 256), float32]))",
            "(%hh: (Tensor[(256, 1), float32], Tensor[(256, 1), float32]))",
        ),
        (
            "nn.dense(concatenate((%hh.0, %hh.1), axis=1), %W_out)",
            "transpose(nn.dense(%W_out, transpose(concatenate((%hh.0, %hh.1), axis=0))))",
        ),
    ] {
        assert!(col.contains(from), "{from}");
        col = col.replace(from, to);
    }
    let row_model = temp_file("birnn_rows.rly", &row).display().to_string();
    let col_model = temp_file("birnn_columns.rly", &col).display().to_string();
    let explain = tumble(&["explain", &col_model]);
    assert!(explain.status.success(), "{}", text(&explain.stderr));
    assert!(text(&explain.stdout).contains("canonical products"));
    let inputs = example("birnn");
    let outs: Vec<String> = [
        (&row_model, &[][..]),
        (&col_model, &[][..]),
        (&col_model, &["--no-canonical-products"][..]),
    ]
    .iter()
    .map(|(m, extra)| {
        let o = run_random(m, &inputs, extra);
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
    })
    .collect();
    assert!(!outs[0].is_empty());
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[1], outs[2]);
}

/// `--save-params` is written only by a run that succeeds: a bad instance, or an output that
/// cannot be written, leaves no weights file, and a weights file that cannot be written leaves
/// no output.
#[test]
fn save_params_is_written_only_by_a_run_that_succeeds() {
    let model = zoo_model("treelstm_small");
    let good = std::fs::read_to_string(example("treelstm"))
        .unwrap_or_else(|e| panic!("cannot read the example: {e}"));
    let bad = temp_file("save_params_bad.jsonl", "{\"tree\": 1, \"extra\": 2}\n");
    let good = temp_file("save_params_good.jsonl", &good);
    let params = temp_path("save_params.safetensors");
    let _ = std::fs::remove_file(&params);
    let p = params.display().to_string();
    let out = run_random(&model, &bad.display().to_string(), &["--save-params", &p]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(!params.exists(), "a failed run wrote --save-params");
    let unwritable = temp_path("no_such_dir/out.jsonl").display().to_string();
    let out = run_random(
        &model,
        &good.display().to_string(),
        &["--save-params", &p, "-o", &unwritable],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        !params.exists(),
        "a run whose output failed wrote --save-params"
    );
    // Nor the other way round: a weights file that cannot be written leaves no results (both are
    // written in full before either is moved into place).
    if std::path::Path::new("/dev/full").exists() {
        let results = temp_path("save_params_results.jsonl");
        let out = run_random(
            &model,
            &good.display().to_string(),
            &[
                "--save-params",
                "/dev/full",
                "-o",
                &results.display().to_string(),
            ],
        );
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(
            !results.exists(),
            "a run whose --save-params failed wrote -o"
        );
    }
    let out = run_random(&model, &good.display().to_string(), &["--save-params", &p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(params.exists());
}

/// Subnormal weights are read as zero with a warning (they slow every product reading them
/// several times) and the outputs are the ones computed from them: their contributions are below
/// the results' rounding. `TUMBLE_KEEP_SUBNORMAL_WEIGHTS=1` keeps them, silently.
#[test]
fn subnormal_weights_are_read_as_zero_with_the_same_outputs() {
    let model = temp_file(
        "subnormal.rly",
        "def @main(%x: Tensor[(1, 4), float32], %W: Tensor[(3, 4), float32]) {\n  \
         tanh(nn.dense(%x, %W))\n}\n",
    );
    let inputs = temp_file(
        "subnormal.jsonl",
        "{\"x\": [[0.5, -1.0, 2.0, 0.25]]}\n{\"x\": [[1.0, 1.0, -3.0, 1e-3]]}\n",
    );
    let tiny = f32::MIN_POSITIVE / 16.0;
    let w = vec![
        0.3, tiny, -0.7, 0.1, -tiny, 0.2, tiny, -0.4, 0.9, -0.5, tiny, 0.05,
    ];
    let params = temp_path("subnormal.safetensors");
    let mut m = std::collections::BTreeMap::new();
    m.insert(
        "W".to_string(),
        tumble_tensor::Tensor::from_f32([3, 4], w).unwrap(),
    );
    tumble_io::save_params(&params, &m).unwrap();
    let run = |keep: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tumble"));
        cmd.args(["run", &model.display().to_string(), "--params"])
            .arg(&params)
            .args(["--inputs", &inputs.display().to_string(), "--color=never"]);
        if keep {
            cmd.env("TUMBLE_KEEP_SUBNORMAL_WEIGHTS", "1");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        out
    };
    let (flushed, kept) = (run(false), run(true));
    assert!(
        text(&flushed.stderr).contains("tensor `W` has 4 subnormal values (of 12), read as zero"),
        "{}",
        text(&flushed.stderr)
    );
    assert!(
        !text(&kept.stderr).contains("subnormal"),
        "{}",
        text(&kept.stderr)
    );
    assert_eq!(text(&flushed.stdout), text(&kept.stdout));
}

/// Standard output that cannot be written (a full device) is an error with status 1 and a
/// message, not a crash (status 101) and not a silent success with the output cut short; a
/// closed pipe stays a quiet success.
#[test]
fn an_unwritable_standard_output_is_an_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return;
    };
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tumble"))
            .args(args)
            .stdout(full.try_clone().unwrap_or_else(|e| panic!("{e}")))
            .output()
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    for args in [
        vec!["prelude"],
        vec!["ops"],
        vec!["run", &model, "--random-params", "0", "--inputs", &inputs],
    ] {
        let out = run(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("No space left"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A thread count no machine has is refused with a message (it overflowed the kernels' task
/// arithmetic and panicked), from the flag and from `TUMBLE_NUM_THREADS`.
#[test]
fn an_absurd_thread_count_is_refused() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let out = run_random(&model, &inputs, &["--threads", "9223372036854775808"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("more than the"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(["run", &model, "--random-params", "0", "--inputs", &inputs])
        .env("TUMBLE_NUM_THREADS", "18446744073709551615")
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("TUMBLE_NUM_THREADS"));
}

/// An output inside a weights folder read by `--params` (`.npy` files) is refused before
/// anything runs: it would change what the next run reads.
#[test]
fn an_output_inside_the_params_folder_is_refused() {
    let model = zoo_model("treelstm_small");
    let inputs = example("treelstm");
    let dir = temp_path("npy_params");
    let _ = std::fs::create_dir_all(&dir);
    let inside = dir.join("b_out.npy").display().to_string();
    let out = run_random(
        &model,
        &inputs,
        &["--params", &dir.display().to_string(), "-o", &inside],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is inside the --params file"), "{err}");
    assert!(!std::path::Path::new(&inside).exists());
}

/// A fresh folder `name` in the scratch folder holding an SST train, dev and test split with
/// these texts.
fn sst_folder(name: &str, [train, dev, test]: [&str; 3]) -> PathBuf {
    let dir = temp_path(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    for (split, text) in [("train", train), ("dev", dev), ("test", test)] {
        std::fs::write(dir.join(format!("{split}.txt")), text).unwrap_or_else(|e| panic!("{e}"));
    }
    dir
}

/// `tumble data`: an output that would replace what the command reads — its `--vocab` file, or
/// a split file of the SST folder — is refused and the file is left as it was (it was read
/// first, then replaced: a success that lost the input). Another file in the folder is fine.
#[test]
fn data_outputs_never_replace_the_inputs() {
    let dir = sst_folder(
        "data_self_overwrite",
        [
            "(3 (2 the) (3 good))\n(1 (2 the) (1 bad))\n",
            "(2 (2 the) (2 film))\n",
            "(3 (2 a) (3 b))\n",
        ],
    );
    let s = |p: &std::path::Path| p.display().to_string();
    let data = |args: &[&str]| {
        let out = common::tumble(&[&["data"][..], args].concat());
        (out.status.code(), text(&out.stderr))
    };
    let vocab = dir.join("vocab.txt");
    let (code, err) = data(&["vocab", "--data-dir", &s(&dir), "-o", &s(&vocab)]);
    assert_eq!(code, Some(0), "{err}");
    let before = std::fs::read_to_string(&vocab).unwrap_or_default();
    let (code, e) = data(&[
        "sst",
        "--data-dir",
        &s(&dir),
        "--vocab",
        &s(&vocab),
        "-o",
        &s(&vocab),
    ]);
    assert_eq!(code, Some(1), "{e}");
    assert!(e.contains("--vocab"), "{e}");
    assert_eq!(std::fs::read_to_string(&vocab).unwrap_or_default(), before);
    let test = dir.join("test.txt");
    let before = std::fs::read_to_string(&test).unwrap_or_default();
    for cmd in ["sst", "vocab", "berxit"] {
        let mut args = vec![cmd, "--data-dir"];
        let (d, t) = (s(&dir), s(&test));
        args.extend([d.as_str(), "-o", t.as_str()]);
        if cmd == "berxit" {
            // Its lengths from the training split: that split is read as well.
            args.extend(["--lengths", "sst", "--count", "1"]);
        }
        let (code, e) = data(&args);
        assert_eq!(code, Some(1), "{cmd}: {e}");
        assert!(e.contains("an SST file read"), "{cmd}: {e}");
        assert_eq!(
            std::fs::read_to_string(&test).unwrap_or_default(),
            before,
            "{cmd}"
        );
    }
    let (code, e) = data(&[
        "sst",
        "--data-dir",
        &s(&dir),
        "-o",
        &s(&dir.join("new.jsonl")),
    ]);
    assert_eq!(code, Some(0), "{e}");
    // An offset past the last tree writes nothing, and says so (it was silent).
    let (code, e) = data(&[
        "sst",
        "--data-dir",
        &s(&dir),
        "--offset",
        "1000",
        "-o",
        &s(&dir.join("none.jsonl")),
    ]);
    assert_eq!(code, Some(0), "{e}");
    assert!(e.contains("past the last tree"), "{e}");
    // A negative threshold is a value, not an unknown flag.
    let (code, e) = data(&["berxit", "--count", "1", "--threshold", "-1"]);
    assert_eq!(code, Some(0), "{e}");
}

/// `tumble data` says what it could not do well: a split file without trees (it wrote nothing,
/// silently), words a `--vocab` file lacks (written as `<unk>` without a word), and a length range
/// whose minimum is above its maximum (it blamed the bounds [1, 512]).
#[test]
fn data_warns_about_empty_splits_and_unknown_words() {
    let dir = sst_folder(
        "data_warnings",
        ["(3 (2 the) (3 good))\n", "(2 (2 the) (2 film))\n", ""],
    );
    let d = dir.display().to_string();
    let data = |args: &[&str]| {
        let out = common::tumble(&[&["data"][..], args].concat());
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, out, err) = data(&["sst", "--data-dir", &d]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("has no trees") && err.contains("2210"),
        "{err}"
    );
    let vocab = dir.join("small_vocab.txt");
    std::fs::write(&vocab, "<none>\n<unk>\nthe\n").unwrap_or_else(|e| panic!("{e}"));
    let v = vocab.display().to_string();
    let (code, out, err) = data(&["sst", "--data-dir", &d, "--split", "dev", "--vocab", &v]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(
        err.contains("1 of 2 words are not in the --vocab file"),
        "{err}"
    );
    // Every word known: no warning.
    let (_, _, err) = data(&["sst", "--data-dir", &d, "--split", "dev"]);
    assert!(!err.contains("warning"), "{err}");
    // A split that is a directory is named as one (it was "not found or incomplete").
    let broken = dir.join("broken");
    std::fs::create_dir_all(broken.join("test.txt")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(broken.join("train.txt"), "(2 (2 a) (2 b))\n").unwrap_or_else(|e| panic!("{e}"));
    let (code, _, err) = data(&["sst", "--data-dir", &broken.display().to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("test.txt is a directory") && err.contains("dev.txt is missing"),
        "{err}"
    );
    let (code, _, err) = data(&["berxit", "--count", "1", "--lengths", "uniform:5-2"]);
    assert!(matches!(code, Some(c) if c != 0), "{err}");
    assert!(
        err.contains("the minimum sequence length 5 is larger than the maximum 2"),
        "{err}"
    );
}

/// The compiler's analyses take each call of a function once per context: a chain of 40
/// functions that each call the next twice (2^40 calls if followed) compiles at once — it never
/// finished — and runs until its graph meets the memory budget (the work is the program's).
#[test]
fn a_chain_of_doubling_calls_compiles_at_once() {
    let mut src = String::new();
    for i in 0..40 {
        src.push_str(&format!(
            "def @f{i}(%x: Tensor[(2), float32]) -> Tensor[(2), float32] {{ add(@f{j}(%x), @f{j}(%x)) }}\n",
            j = i + 1
        ));
    }
    src.push_str("def @f40(%x: Tensor[(2), float32]) -> Tensor[(2), float32] { %x }\n");
    src.push_str("def @main(%x: Tensor[(2), float32]) -> Tensor[(2), float32] { @f0(%x) }\n");
    explains_within_a_minute(
        &temp_file("doubling_chain.rly", &src),
        "a 40-level doubling chain",
    );
}

/// The hoisting analysis evaluates a call in at most a few contexts (sets of functions active
/// around it) per round, then once as if every function were active: 13 mutually recursive
/// functions, each calling the next directly and the one after from inside an `@map` closure, took
/// 11 s to compile (×2.4 per function; an audit's find). 20 of them compile at once.
#[test]
fn a_cycle_of_functions_reaching_each_other_compiles_at_once() {
    const T: &str = "Tensor[(1, 8), float32]";
    const K: usize = 20;
    let mut src = String::new();
    for i in 0..K {
        let (j, k) = ((i + 1) % K, (i + 2) % K);
        src.push_str(&format!(
            "def @s{i}(%xs: List[{T}], %h: {T}, %W: Tensor[(8, 8), float32]) -> {T} {{
  match (%xs) {{
    Nil => %h,
    Cons(%x, %rest) => {{
      let %a = @s{j}(%rest, tanh(add(nn.dense(%h, %W), %x)), %W);
      let %b = @map(fn (%q: {T}) -> {T} {{ @s{k}(%rest, %q, %W) }}, %rest);
      @foldl(fn (%s: {T}, %t: {T}) -> {T} {{ add(%s, %t) }}, %a, %b)
    }},
  }}
}}
"
        ));
    }
    src.push_str(&format!(
        "def @main(%xs: List[{T}], %W: Tensor[(8, 8), float32]) -> {T} {{ @s0(%xs, zeros(shape=[1, 8], dtype=\"float32\"), %W) }}\n"
    ));
    explains_within_a_minute(
        &temp_file("cycle_of_20.rly", &src),
        "a cycle of 20 functions",
    );
}

/// Runs `tumble explain MODEL` (every compile-time analysis), failing if it takes over 60 s.
fn explains_within_a_minute(model: &std::path::Path, what: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(["explain", &model.display().to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start tumble: {e}"));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("{e}")) {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            panic!("`tumble explain` of {what} did not finish in 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

/// An entry whose results can hold a function is refused when the model is loaded, by `run` and
/// `compile`, before any instance runs — directly, or inside a constructor of a list.
#[test]
fn an_entry_returning_functions_is_refused_at_load() {
    let direct = temp_file(
        "returns_fn.rly",
        "def @main(%x: Tensor[(2), float32]) -> fn (Tensor[(2), float32]) -> Tensor[(2), float32] {\n  fn (%y: Tensor[(2), float32]) -> Tensor[(2), float32] { add(%x, %y) }\n}\n",
    );
    let nested = temp_file(
        "returns_boxed_fn.rly",
        "type Box[A] { Box(A, fn (A) -> A) }\ndef @main(%x: Tensor[(2), float32]) -> List[Box[Tensor[(2), float32]]] {\n  Cons(Box(%x, fn (%y: Tensor[(2), float32]) -> Tensor[(2), float32] { %y }), Nil)\n}\n",
    );
    let data = temp_file("returns_fn.jsonl", "{\"x\": [1, 2]}\n");
    let out_path = temp_path("returns_fn.out.jsonl");
    for (model, says) in [
        (
            &direct,
            "`@main` returns a function (fn (Tensor[(2), float32])",
        ),
        (
            &nested,
            "returns List[Box[Tensor[(2), float32]]], which can hold a function",
        ),
    ] {
        let m = model.display().to_string();
        let run = tumble(&[
            "run",
            &m,
            "-i",
            &data.display().to_string(),
            "-o",
            &out_path.display().to_string(),
        ]);
        assert_eq!(run.status.code(), Some(1), "{}", text(&run.stderr));
        let err = text(&run.stderr);
        assert!(err.contains(says) && err.contains("no JSON form"), "{err}");
        assert!(!out_path.exists(), "nothing is written");
        let artifact = temp_path("returns_fn.tumble");
        let compile = tumble(&["compile", &m, "-o", &artifact.display().to_string()]);
        assert_eq!(compile.status.code(), Some(1), "{}", text(&compile.stderr));
        assert!(text(&compile.stderr).contains(says));
        assert!(!artifact.exists());
    }
}

/// A value whose type has `?` sizes, passed to a function declaring other sizes, is refused
/// naming the argument and the declaration — not computed with the declared sizes (inlined, a
/// `reshape(%x, newshape=[0, -1])` of a (3, 4) input declared (2, 6) came out (2, 6)).
#[test]
fn a_value_of_another_size_than_declared_is_refused() {
    let inlined = temp_file(
        "narrowed_reshape.rly",
        "#[version = \"0.0.5\"]
def @f(%x: Tensor[(2, 6), float32]) -> Tensor[(2, 6), float32] {
  reshape(%x, newshape=[0, -1])
}
def @main(%x: Tensor[(?, ?), float32]) -> Tensor[(2, 6), float32] {
  @f(%x)
}
",
    );
    let called = temp_file(
        "narrowed_rows.rly",
        "#[version = \"0.0.5\"]
def @f(%x: Tensor[(3, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(12), float32] {
  reshape(tanh(nn.dense(%x, %w)), newshape=[-1])
}
def @main(%x: Tensor[(?, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(12), float32] {
  @f(%x, %w)
}
",
    );
    let fits = "{\"x\": [[1,2,3,4],[1,0,0,0],[0,1,0,0]]}\n";
    for (model, bad, declared) in [
        (
            &inlined,
            "{\"x\": [[1,2,3,4],[5,6,7,8],[9,10,11,12]]}\n",
            "Tensor[(2, 6), float32]",
        ),
        (
            &called,
            "{\"x\": [[1,2,3,4],[1,0,0,0]]}\n",
            "Tensor[(3, 4), float32]",
        ),
    ] {
        let m = model.display().to_string();
        for batch in ["1", "7"] {
            let inputs = temp_file("narrowed.jsonl", &format!("{fits}{bad}"));
            let run = tumble(&[
                "run",
                &m,
                "-i",
                &inputs.display().to_string(),
                "--random-params",
                "0",
                "--batch",
                batch,
            ]);
            let err = text(&run.stderr);
            if model == &inlined {
                // Its first instance does not fit either: (3, 4) is not (2, 6).
                assert!(err.contains("instance at line 1"), "{err}");
            } else {
                assert!(err.contains("instance at line 2"), "{err}");
            }
            assert_eq!(run.status.code(), Some(1), "{err}");
            assert!(
                err.contains("%x has shape") && err.contains(declared),
                "{err}"
            );
        }
    }
}

/// Messages: sizes that fail an operator's shape rule when the invocation is recorded (before
/// any launch) point at that operator on both engines, not at the whole block around it.
#[test]
fn a_shape_failure_found_when_recording_points_at_its_operator() {
    let model = temp_file(
        "record_shapes.rly",
        "#[version = \"0.0.5\"]
def @main(%x: Tensor[(?, 4), float32], %y: Tensor[(?, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(?, 4), float32] {
  let %a = tanh(nn.dense(%x, %w));
  let %b = sigmoid(nn.dense(%y, %w));
  let %ab = add(%a, %b);
  multiply(%ab, %a)
}
",
    );
    let inputs = temp_file(
        "record_shapes.jsonl",
        "{\"x\": [[1,2,3,4]], \"y\": [[1,2,3,4]]}\n{\"x\": [[1,2,3,4],[1,2,3,4],[1,2,3,4]], \"y\": [[1,2,3,4],[1,2,3,4]]}\n",
    );
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    for extra in [
        &["--engine", "reference"][..],
        &[],
        &["--no-fusion"],
        &["--batch", "1"],
    ] {
        let mut args = vec!["--random-params", "0"];
        args.extend_from_slice(extra);
        let err = failing_run(&model, &inputs, &args);
        assert!(
            err.contains("instance at line 2: add: cannot broadcast"),
            "{extra:?}: {err}"
        );
        assert!(err.contains("record_shapes.rly:5:13"), "{extra:?}: {err}");
        assert!(!err.contains("let %a = tanh"), "{extra:?}: {err}");
    }
}

/// A model without the entry asked for names what it does define (an empty file: nothing).
#[test]
fn a_missing_entry_names_the_functions_the_model_defines() {
    let dir = std::env::temp_dir().join(format!("tumble-entry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let empty = dir.join("empty.rly");
    std::fs::write(&empty, "").unwrap_or_else(|e| panic!("{e}"));
    let out = tumble(&[
        "run",
        &empty.display().to_string(),
        "-i",
        &example("treelstm"),
        "--random-params",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("it defines no functions"),
        "{}",
        text(&out.stderr)
    );
    let out = tumble(&[
        "run",
        &zoo_model("treelstm_small"),
        "-i",
        &example("treelstm"),
        "--random-params",
        "0",
        "--entry",
        "nope",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(
        e.contains("`@nope`") && e.contains("@treelstm_leaf") && e.contains("@main"),
        "{e}"
    );
    assert!(!e.contains("@hd"), "the prelude's are not listed: {e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `--batch`, a job of more instances than a default mini-batch holds runs in equal
/// mini-batches of at most 128 (the profile counts them), a whole number per worker when each
/// gets at least 32 instances, with the outputs of one mini-batch of all.
#[test]
fn run_splits_large_jobs_into_default_mini_batches() {
    let model = temp_file(
        "tiny_rows.rly",
        "def @main(%x: Tensor[(1, 3), float32], %w: Tensor[(3, 3), float32]) -> Tensor[(1, 3), float32] {\n  tanh(nn.dense(%x, %w))\n}\n",
    );
    let lines = |n: usize| -> String {
        (0..n)
            .map(|i| format!("{{\"x\": [[{}, 0.5, -1]]}}\n", i % 7))
            .collect()
    };
    let inputs = temp_file("tiny_rows.jsonl", &lines(1100));
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    let all = run_random(&model, &inputs, &["--batch", "1100"]);
    assert!(all.status.success());
    // (threads, extra flags, mini-batches): 1,100 instances are 9 of at most 128 for one worker,
    // 10 for two; 64 instances split in two only for two workers and without the switch.
    let small = temp_file("tiny_rows64.jsonl", &lines(64));
    let small = small.display().to_string();
    let small_all = run_random(&model, &small, &["--batch", "64"]);
    assert!(small_all.status.success());
    for (file, want, threads, extra, batches) in [
        (&inputs, &all.stdout, "1", None, 9),
        (&inputs, &all.stdout, "2", None, 10),
        (&small, &small_all.stdout, "1", None, 1),
        (&small, &small_all.stdout, "2", None, 2),
        (
            &small,
            &small_all.stdout,
            "2",
            Some("--no-split-batches"),
            1,
        ),
        (&small, &small_all.stdout, "3", None, 1),
    ] {
        let mut flags = vec!["--profile", "--threads", threads];
        flags.extend(extra);
        let out = run_random(&model, file, &flags);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("mini-batches {batches} ")),
            "{threads} threads {extra:?}: {stderr}"
        );
        assert_eq!(&out.stdout, want, "{threads} threads {extra:?}");
    }
}

/// Rows copied out of a launch's output at early release are copied once per row, however many
/// identical invocations hold them: the launches reading them (each token's expert after its
/// gate) still see identical tokens as identical, in every run of a `--repeat`. (Each holder
/// copied its own, and in runs where the job's scans fell before those launches every token
/// was computed again: 10,264 identical invocations instead of 15,396.)
#[test]
fn rows_detached_by_early_release_stay_identical() {
    let model = temp_file(
        "moe_detach.rly",
        r#"
def @route(%t: Tensor[(1), int32], %emb: Tensor[(1000, 512), float32], %wg: Tensor[(1, 512), float32],
           %w1: Tensor[(512, 512), float32], %w2: Tensor[(512, 512), float32]) -> Tensor[(1, 512), float32] {
  let %x = take(%emb, %t, axis=0);
  if (greater(sum(nn.dense(%x, %wg)), 0f)) { tanh(nn.dense(%x, %w1)) } else { sigmoid(nn.dense(%x, %w2)) }
}
def @main(%tokens: List[Tensor[(1), int32]], %emb: Tensor[(1000, 512), float32], %wg: Tensor[(1, 512), float32],
          %w1: Tensor[(512, 512), float32], %w2: Tensor[(512, 512), float32]) -> Tensor[(1, 512), float32] {
  let %ys = @map(fn (%t: Tensor[(1), int32]) -> Tensor[(1, 512), float32] { @route(%t, %emb, %wg, %w1, %w2) }, %tokens);
  @foldl(fn (%a: Tensor[(1, 512), float32], %y: Tensor[(1, 512), float32]) -> Tensor[(1, 512), float32] { add(%a, %y) },
         zeros(shape=[1, 512], dtype="float32"), %ys)
}
"#,
    );
    let lines: String = (0..256)
        .map(|i| {
            let toks: Vec<String> = (0..5 + (i * 7) % 36)
                .map(|r| format!("[{}]", (i * 31 + r * 17) % 600))
                .collect();
            format!("{{\"tokens\": [{}]}}\n", toks.join(", "))
        })
        .collect();
    let inputs = temp_file("moe_detach.jsonl", &lines);
    let (model, inputs) = (model.display().to_string(), inputs.display().to_string());
    let identical = |extra: &[&str]| -> String {
        let mut flags = vec!["--profile", "--threads", "1", "-o", "/dev/null"];
        flags.extend_from_slice(extra);
        let out = run_random(&model, &inputs, &flags);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        stderr
            .lines()
            .find(|l| l.starts_with("identical invocations:"))
            .unwrap_or("none")
            .to_string()
    };
    let want = identical(&["--no-early-release"]);
    for repeat in ["2", "3"] {
        assert_eq!(identical(&["--repeat", repeat]), want, "--repeat {repeat}");
    }
}
