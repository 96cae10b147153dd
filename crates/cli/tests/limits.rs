//! The memory budget (`--max-memory`) and Ctrl-C, end to end (issue 25, section 1): each way a
//! run can grow — the dataflow graph, pending evaluations, a tensor the program builds, decoded
//! input, a file or stream read whole — stops with an error naming the instance and what grew,
//! and nothing is written.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn tumble(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(args)
        .arg("--color=never")
        .output()
        .unwrap_or_else(|e| panic!("cannot run tumble: {e}"))
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble-limits-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {dir:?}: {e}"));
    dir
}

fn write(dir: &std::path::Path, name: &str, body: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap_or_else(|e| panic!("cannot write {p:?}: {e}"));
    p.display().to_string()
}

/// The names of the files in `dir` (a stopped run must leave no output or temp file there).
fn files_in(dir: &std::path::Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default()
}

const X: &str = "{\"x\": [[1, 2, 3, 4]]}\n";

/// Tail recursion without a base case: the batched engine records a node per call and never
/// flushes, so the dataflow graph is what grows.
const TAIL: &str = "#[version = \"0.0.5\"]
def @f(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  @f(negative(%x))
}
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  @f(%x)
}
";

/// Non-tail recursion without a base case: pending evaluations grow in every engine.
const NON_TAIL: &str = "#[version = \"0.0.5\"]
def @f(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  add(@f(negative(%x)), %x)
}
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  @f(%x)
}
";

fn assert_stopped_without_output(out: &Output, output_file: &std::path::Path, wants: &[&str]) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for w in wants {
        assert!(err.contains(w), "wanted {w:?} in: {err}");
    }
    assert!(!output_file.exists(), "{output_file:?} was written");
    assert_eq!(text(&out.stdout), "");
}

#[test]
fn a_runaway_recursion_stops_at_the_budget_and_says_what_grew() {
    let dir = scratch("runaway");
    let x = write(&dir, "x.jsonl", X);
    let o = dir.join("out.jsonl");
    let o_arg = o.display().to_string();
    let tail = write(&dir, "tail.rly", TAIL);
    let non_tail = write(&dir, "non_tail.rly", NON_TAIL);
    let cases = [
        (&tail, "batched", "dataflow nodes recorded"),
        (&non_tail, "batched", "a recursion without a base case?"),
        (&non_tail, "reference", "a recursion without a base case?"),
    ];
    for (model, engine, grew) in cases {
        let out = tumble(&[
            "run",
            model,
            "--inputs",
            &x,
            "--engine",
            engine,
            "--max-memory",
            "200M",
            "-o",
            &o_arg,
        ]);
        assert_stopped_without_output(
            &out,
            &o,
            &[
                "instance at line 1",
                "memory budget exceeded",
                "pending evaluations in this instance",
                grew,
                "--max-memory",
            ],
        );
    }
}

#[test]
fn a_tensor_larger_than_the_budget_is_refused_before_it_is_allocated() {
    let dir = scratch("zeros");
    let x = write(&dir, "x.jsonl", X);
    let model = write(
        &dir,
        "zeros.rly",
        "#[version = \"0.0.5\"]
def @main(%x: Tensor[(1, 4), float32]) -> float32 {
  add(sum(zeros(shape=[100000, 100000], dtype=\"float32\")), sum(%x))
}
",
    );
    let o = dir.join("out.jsonl");
    for engine in ["batched", "reference"] {
        let t = Instant::now();
        // The default budget (half the machine) is far below 37 GiB too.
        let out = tumble(&[
            "run",
            &model,
            "--inputs",
            &x,
            "--engine",
            engine,
            "-o",
            &o.display().to_string(),
        ]);
        assert_stopped_without_output(
            &out,
            &o,
            &["instance at line 1", "needs 37.3 GiB more", "zeros.rly:3:"],
        );
        // Refused, not computed: a generous bound that only an allocation of 40 GB would break.
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    }
}

/// Intermediates whose sizes are `?` in the types (a product over a sequence's length) are sized
/// from the invocations' actual shapes before a launch allocates them: the batched engine
/// refused nothing here and the process aborted allocating 6.4 GB under a 1 GB budget. Random
/// weights are refused against the budget before they are generated, naming the parameter.
#[test]
fn dynamic_intermediates_and_random_weights_are_held_to_the_budget() {
    let dir = scratch("dynamic_bytes");
    let ids: Vec<String> = (0..40_000).map(|i| (i % 10).to_string()).collect();
    let t = write(
        &dir,
        "t.jsonl",
        &format!("{{\"t\": [{}]}}\n", ids.join(",")),
    );
    let model = write(
        &dir,
        "bmm.rly",
        "#[version = \"0.0.5\"]
def @main(%t: Tensor[(?), int32], %emb: Tensor[(10, 4), float32]) {
  let %x = expand_dims(take(%emb, %t, axis=0), axis=0);
  sum(nn.batch_matmul(%x, %x))
}
",
    );
    let o = dir.join("out.jsonl");
    let o_arg = o.display().to_string();
    // `tumble run MODEL --inputs INPUTS --random-params 0 --max-memory 1G [EXTRA] -o OUT`.
    let run_in_1g = |model: &str, inputs: &str, extra: &[&str]| {
        let base = [
            "run",
            model,
            "--inputs",
            inputs,
            "--random-params",
            "0",
            "--max-memory",
            "1G",
        ];
        tumble(&[&base[..], extra, &["-o", &o_arg]].concat())
    };
    for engine in ["batched", "reference"] {
        let out = run_in_1g(&model, &t, &["--engine", engine]);
        assert_stopped_without_output(&out, &o, &["instance at line 1", "needs 6.0 GiB more"]);
    }
    // Two lengths: one ragged launch, sized from each invocation's own shapes (kept with its
    // shape key when it was recorded).
    let rows = |n: usize| {
        (0..n)
            .map(|i| (i % 10).to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let two = write(
        &dir,
        "two.jsonl",
        &format!(
            "{{\"t\": [{}]}}\n{{\"t\": [{}]}}\n",
            rows(30_000),
            rows(20_000)
        ),
    );
    let out = run_in_1g(&model, &two, &[]);
    assert_stopped_without_output(&out, &o, &["30000 rows", "needs 3.4 GiB more"]);
    let big = write(
        &dir,
        "big.rly",
        "#[version = \"0.0.5\"]
def @main(%x: Tensor[(1, 4), float32], %W: Tensor[(30000, 30000), float32]) {
  sum(%x)
}
",
    );
    let x = write(&dir, "x.jsonl", X);
    let out = run_in_1g(&big, &x, &[]);
    assert_stopped_without_output(&out, &o, &["parameter %W", "needs 3.4 GiB more"]);
}

#[test]
fn input_too_large_for_the_budget_is_refused_while_it_is_read() {
    let dir = scratch("input");
    let model = write(
        &dir,
        "list.rly",
        "#[version = \"0.0.5\"]
def @main(%xs: List[Tensor[(), int32]]) -> int32 {
  @sum(%xs)
}
",
    );
    // 1,000,000 list elements: ~7 MB of text, several hundred MB of values.
    let mut line = String::from("{\"xs\": [");
    for i in 0..1_000_000 {
        if i > 0 {
            line.push(',');
        }
        line.push_str(&(i % 10).to_string());
    }
    line.push_str("]}\n");
    let big = write(&dir, "big.jsonl", &line);
    let o = dir.join("out.jsonl");
    let o_arg = o.display().to_string();
    // `tumble run MODEL --inputs X [--params W] --max-memory BUDGET -o out.jsonl`.
    let run = |model: &str, x: &str, params: Option<&str>, budget: &str| {
        let mut args = vec!["run", model, "--inputs", x];
        if let Some(w) = params {
            args.extend(["--params", w]);
        }
        args.extend(["--max-memory", budget, "-o", &o_arg]);
        tumble(&args)
    };
    let out = run(&model, &big, None, "64M");
    assert_stopped_without_output(
        &out,
        &o,
        &[
            "line 1",
            ".xs",
            "while decoding element",
            "memory budget exceeded",
        ],
    );

    // A line whose parsed form could not fit is refused before it is parsed (parsing builds the
    // whole document at once: a 120 MB line took 4.1 GB under a 300 MB budget).
    let huge_line = format!("{{\"xs\": [{}0]}}\n", "1,".repeat(4_000_000));
    let huge = write(&dir, "huge_line.jsonl", &huge_line);
    let out = run(&model, &huge, None, "64M");
    assert_stopped_without_output(
        &out,
        &o,
        &[
            "line 1",
            "of JSON would not fit once parsed",
            "memory budget exceeded",
        ],
    );

    // An endless stream as the weights, and as the model.
    let x = write(&dir, "x.jsonl", X);
    let tail = write(&dir, "tail.rly", TAIL);
    let out = run(&tail, &x, Some("/dev/zero"), "64M");
    assert_stopped_without_output(&out, &o, &["/dev/zero", "read: memory budget exceeded"]);
    let out = tumble(&["check", "/dev/zero", "--max-memory", "64M"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("read: memory budget exceeded"), "{err}");
    // It stopped within the budget: the buffer's growth is checked before it happens (it used to
    // double unchecked, to "4.0 GiB in use, the limit is 3.0 GiB").
    let in_use = err
        .split(" in use")
        .next()
        .and_then(|s| s.rsplit("with ").next())
        .unwrap_or_default();
    let mib = in_use
        .strip_suffix(" MiB")
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no \"with N MiB in use\" in: {err}"));
    assert!(mib <= 64.0, "{err}");

    // A regular file larger than the budget is refused by its size, before reading.
    let huge = write(&dir, "huge.rly", &" ".repeat(3 << 20));
    let out = tumble(&["check", &huge, "--max-memory", "2M"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("it is 3.0 MiB long"), "{err}");

    // A weights file (decoded tensor by tensor from the file) whose tensor does not fit.
    let header = r#"{"w":{"dtype":"F32","shape":[786432],"data_offsets":[0,3145728]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + (3 << 20), 0);
    let w = dir.join("w.safetensors");
    std::fs::write(&w, &bytes).unwrap_or_else(|e| panic!("cannot write {w:?}: {e}"));
    let w_arg = w.display().to_string();
    let out = run(&tail, &x, Some(&w_arg), "2M");
    assert_stopped_without_output(
        &out,
        &o,
        &[
            "w.safetensors",
            "memory budget exceeded",
            "while reading the weights",
        ],
    );
}

#[test]
fn max_memory_values_are_checked() {
    for bad in ["lots", "0", "-5G", "12 parsecs"] {
        let flag = format!("--max-memory={bad}");
        let out = tumble(&["check", &flag, "/nonexistent.rly"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--max-memory"), "{bad}: {err}");
    }
    let dir = scratch("sizes");
    let tail = write(&dir, "ok.rly", NON_TAIL);
    for good in ["1G", "512M", "1.5GiB", "none"] {
        let out = tumble(&["check", "--max-memory", good, &tail]);
        assert!(out.status.success(), "{good}: {}", text(&out.stderr));
    }
}

/// `--timeout`: a tail recursion without a base case runs forever in constant memory (no budget
/// stops it); past the time limit each engine stops it at a safe point with status 124, a message
/// naming the instance, and nothing written. Bad durations are refused; a run within its limit is
/// unaffected; a server is pointed to its per-request `--timeout-ms`.
#[test]
fn a_run_past_its_time_limit_stops_with_status_124_and_writes_nothing() {
    let dir = scratch("timeout");
    let x = write(&dir, "x.jsonl", X);
    let tail = write(&dir, "tail.rly", TAIL);
    let o = dir.join("out.jsonl");
    let out_path = o.display().to_string();
    // The reference engine in constant memory; the batched engine until its graph would grow
    // past a budget large enough not to be reached first.
    for engine in ["reference", "batched"] {
        let t = Instant::now();
        let out = tumble(&[
            "run",
            &tail,
            "--inputs",
            &x,
            "--engine",
            engine,
            "--timeout",
            "500ms",
            "--max-memory",
            "8G",
            "-o",
            &out_path,
        ]);
        let err = text(&out.stderr);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{engine}: {:?}",
            t.elapsed()
        );
        assert_eq!(out.status.code(), Some(124), "{engine}: {err}");
        assert!(err.contains("instance at line 1"), "{engine}: {err}");
        assert!(
            err.contains("the time limit of 500 ms passed (raise it with --timeout)"),
            "{engine}: {err}"
        );
        assert!(!o.exists(), "{engine}: {o:?} was written");
    }
    let leftovers = files_in(&dir);
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");
    for bad in ["0", "-1s", "soon", "3 days"] {
        let flag = format!("--timeout={bad}");
        let out = tumble(&["check", &flag, &tail]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--timeout"), "{bad}: {err}");
    }
    let ok = write(&dir, "ok.rly", NON_TAIL);
    let out = tumble(&["check", "--timeout", "10m", &ok]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = tumble(&["serve", &ok, "--port", "0", "--timeout", "10s"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--timeout-ms"));
}

#[test]
fn ctrl_c_stops_a_run_with_status_130_and_writes_nothing() {
    stopped_by_signal("INT", 130);
}

/// SIGTERM (`kill`, `timeout`) stops a run like Ctrl-C: status 143, nothing written and no temp
/// file left (it used to kill the process where it stood).
#[test]
fn sigterm_stops_a_run_with_status_143_and_writes_nothing() {
    stopped_by_signal("TERM", 143);
}

fn stopped_by_signal(signal: &str, status: i32) {
    let dir = scratch(&format!("sig{signal}"));
    let x = write(&dir, "x.jsonl", X);
    let tail = write(&dir, "tail.rly", TAIL);
    let o = dir.join("out.jsonl");
    // The reference engine runs the tail recursion forever in constant memory: only Ctrl-C ends it.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(["run", &tail, "--inputs", &x, "--engine", "reference", "-o"])
        .arg(&o)
        .arg("--color=never")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run tumble: {e}"));
    std::thread::sleep(Duration::from_millis(1500));
    let killed = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status();
    if !matches!(killed, Ok(s) if s.success()) {
        let _ = child.kill();
        panic!("cannot send SIG{signal}: {killed:?}");
    }
    let t = Instant::now();
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("cannot wait for tumble: {e}"));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(out.status.code(), Some(status), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("interrupted"));
    assert!(!o.exists());
    let leftovers = files_in(&dir);
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");
}

/// A result that shares a subtree (`Rose(x, [t, t])`, n levels deep: n nodes, 2^n paths) is
/// materialized once per node, so both engines give the same small results; a deep one, whose
/// JSON text is exponential, stops at the budget with a message (it was rebuilt per path and
/// grew until the allocator aborted the process, past `--max-memory`).
#[test]
fn a_shared_result_is_bounded_by_the_budget() {
    const DAG: &str = "def @b(%x: Tensor[(1), int32], %n: Tensor[(), int32]) -> Tree[Tensor[(1), int32]] {\n  if (greater(%n, 0)) {\n    let %t = @b(%x, subtract(%n, 1));\n    Rose(%x, Cons(%t, Cons(%t, Nil)))\n  } else {\n    Rose(%x, Nil)\n  }\n}\ndef @main(%x: Tensor[(1), int32], %n: Tensor[(), int32]) -> Tree[Tensor[(1), int32]] {\n  @b(%x, %n)\n}\n";
    let dir = scratch("dag");
    let model = write(&dir, "dag.rly", DAG);
    let small = write(
        &dir,
        "small.jsonl",
        "{\"x\": [1], \"n\": 3}\n{\"x\": [2], \"n\": 0}\n",
    );
    let batched = tumble(&["run", &model, "--inputs", &small]);
    let reference = tumble(&["run", &model, "--inputs", &small, "--engine", "reference"]);
    assert!(batched.status.success(), "{}", text(&batched.stderr));
    assert_eq!(text(&batched.stdout), text(&reference.stdout));
    assert_eq!(text(&batched.stdout).matches("Rose").count(), 15 + 1);
    let deep = write(&dir, "deep.jsonl", "{\"x\": [1], \"n\": 40}\n");
    let o = dir.join("out.jsonl");
    let t = Instant::now();
    let out = tumble(&[
        "--max-memory",
        "48M",
        "run",
        &model,
        "--inputs",
        &deep,
        "-o",
        &o.display().to_string(),
    ]);
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert_stopped_without_output(&out, &o, &["memory budget exceeded", "JSON"]);
}
