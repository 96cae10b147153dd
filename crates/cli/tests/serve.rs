//! `tumble serve` as a process: its predictions are byte for byte `tumble run`'s lines under
//! every policy, and SIGTERM / SIGINT drain it to exit status 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn model() -> String {
    root()
        .join("models/treelstm_small.rly")
        .display()
        .to_string()
}

fn trees() -> String {
    root().join("examples/treelstm.jsonl").display().to_string()
}

/// Starts `tumble serve` on a free port; returns the child and its address.
fn serve(extra: &[&str]) -> (Child, String) {
    serve_model(&model(), &["--random-params", "0"], extra)
}

/// [`serve`] for `model` with weights from `params`.
fn serve_model(model: &str, params: &[&str], extra: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(["serve", model])
        .args(params)
        .args(["--port", "0", "--threads", "1"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("tumble serve printed its address")
            .unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    };
    // Keep reading stderr so the child never blocks on a full pipe; the last line is checked.
    std::thread::spawn(move || {
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let _ = std::fs::write(
            std::env::temp_dir().join(format!("tumble-serve-{}.err", std::process::id())),
            rest.join("\n"),
        );
    });
    (child, addr)
}

/// Sends `bytes` as they are on a new connection and reads until the server closes it (at most
/// 20 s): what came back and how long it took.
fn send_raw(addr: &str, bytes: &str) -> (String, Duration) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let t0 = Instant::now();
    s.write_all(bytes.as_bytes()).unwrap();
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    (String::from_utf8_lossy(&back).into_owned(), t0.elapsed())
}

/// The empty request, answered: the server still serves after a probe.
fn still_answers(addr: &str) {
    assert_eq!(
        post(addr, "{\"instances\": []}"),
        (200, "{\"predictions\":[]}".to_string())
    );
}

fn post(addr: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (
        head.split(' ').nth(1).unwrap().parse().unwrap(),
        body.to_string(),
    )
}

/// Sends `signal` and waits (at most 30 s) for the exit status.
fn stop(mut child: Child, signal: &str) -> Option<i32> {
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("tumble serve did not stop on SIG{signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A predict request of the bundled trees, and the response `tumble run` says it should get.
fn request_and_run_answer() -> (String, String) {
    let run = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args([
            "run",
            &model(),
            "--inputs",
            &trees(),
            "--random-params",
            "0",
        ])
        .output()
        .unwrap();
    assert!(run.status.success());
    let lines: Vec<String> = String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let want = format!("{{\"predictions\":[{}]}}", lines.join(","));
    let instances = std::fs::read_to_string(trees()).unwrap();
    let body = format!(
        "{{\"instances\": [{}]}}",
        instances.lines().collect::<Vec<_>>().join(",")
    );
    (body, want)
}

#[test]
fn predictions_are_tumble_runs_lines_and_signals_drain_to_status_0() {
    let (body, want) = request_and_run_answer();
    for (policy, signal) in [
        ("continuous", "TERM"),
        ("static", "INT"),
        ("single", "TERM"),
    ] {
        let (child, addr) = serve(&["--policy", policy, "--max-batch", "3"]);
        assert_eq!(post(&addr, &body), (200, want.clone()), "{policy}");
        assert_eq!(stop(child, signal), Some(0), "{policy}: SIG{signal}");
    }
}

#[test]
fn a_compiled_model_serves_what_its_source_runs() {
    // Named like the source: the server's model name is the file's stem.
    let dir = std::env::temp_dir().join(format!("tumble-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let compiled = dir.join("treelstm_small.tumble");
    let compiled_text = compiled.display().to_string();
    let made = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args([
            "compile",
            &model(),
            "--random-params",
            "0",
            "-o",
            &compiled_text,
        ])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let (body, want) = request_and_run_answer();
    let (child, addr) = serve_model(&compiled_text, &[], &[]);
    assert_eq!(post(&addr, &body), (200, want));
    assert_eq!(stop(child, "TERM"), Some(0));
    // Its weights are inside: a weights file would replace them, which is refused.
    let refused = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args([
            "serve",
            &compiled_text,
            "--params",
            &compiled_text,
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("stores its weights"), "{err}");
}

#[test]
fn a_model_that_does_not_load_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args([
            "serve",
            &model(),
            "--port",
            "0",
            "--params",
            "/nonexistent/w.safetensors",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("error:") && err.contains("/nonexistent/w.safetensors"),
        "{err}"
    );
    // A model that does not check: its diagnostics once, not under a second `error: `.
    let dir = tempfile_dir("serve_bad_model");
    let bad = dir.join("bad.rly");
    std::fs::write(
        &bad,
        "def @main(%x: Tensor[(2), float32]) { no_such_op(%x) }\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(["serve", bad.to_str().unwrap(), "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no_such_op") && !err.contains("error: error"),
        "{err}"
    );
    // A name that cannot be a path segment before `:predict`, or a metrics label.
    for name in ["", "a/b", "a:b", "line\nbreak"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tumble"))
            .args([
                "serve",
                &model(),
                "--port",
                "0",
                "--random-params",
                "0",
                "--name",
                name,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--name"), "{name:?}: {err}");
    }
}

fn tempfile_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble_{tag}_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An instance that never suspends (a recursion without a base case, in constant memory) is
/// answered 504 at the request's timeout and then stopped, so the server goes on serving and
/// still drains on SIGINT (the batch thread ran it forever: every later request got 504 and the
/// server had to be killed).
#[test]
fn a_request_that_never_ends_does_not_wedge_the_server() {
    let dir = std::env::temp_dir().join(format!("tumble-serve-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("loop.rly");
    std::fs::write(
        &model,
        "def @f(%n: Tensor[(), int32]) -> Tensor[(), int32] {\n  if (greater(%n, 0)) { @f(%n) } else { %n }\n}\n\
         def @main(%n: Tensor[(), int32]) -> Tensor[(), int32] {\n  @f(%n)\n}\n",
    )
    .unwrap();
    let (child, addr) = serve_model(
        &model.display().to_string(),
        &[],
        &["--timeout-ms", "500", "--name", "treelstm_small"],
    );
    let (status, _) = post(&addr, "{\"instances\": [{\"n\": 1}]}");
    assert_eq!(status, 504);
    let t = Instant::now();
    loop {
        let (status, body) = post(&addr, "{\"instances\": [{\"n\": 0}]}");
        if status == 200 {
            assert_eq!(body, "{\"predictions\":[0]}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "still {status} after the timeout"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(stop(child, "INT"), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A body whose parsed form would not fit in the memory budget is answered 413 before it is
/// parsed (four concurrent 63 MiB bodies took 14 GB under a 2 GiB budget), and the server
/// answers the next request.
#[test]
fn a_body_too_large_to_parse_within_the_budget_is_413() {
    let (body, want) = request_and_run_answer();
    let (child, addr) = serve(&["--max-memory", "256M"]);
    // 16 MB of JSON: 512 MiB once parsed, at 32 bytes per byte of text.
    let big = format!("{{\"instances\": [{}0]}}", "1,".repeat(8_000_000));
    // Declared so: refused before it is sent (each connection held up to --max-body of a body
    // the budget could never parse, outside the budget).
    let (text, _) = send_raw(
        &addr,
        &format!(
            "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: \
             {}\r\nConnection: close\r\n\r\n",
            big.len()
        ),
    );
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("--max-memory"), "{text}");
    // Chunked, its length unknown until read: refused once read, before it is parsed.
    let (text, _) = send_raw(
        &addr,
        &format!(
            "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: \
             chunked\r\nConnection: close\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        ),
    );
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("--max-memory"), "{text}");
    assert_eq!(post(&addr, &body), (200, want));
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// Bodies of unknown length (chunked) are held within the memory budget as they arrive: many
/// at once, each of which alone would fit, get 503 to retry once the budget has no room, where
/// each connection held up to `--max-body` outside it. The server answers afterwards.
#[test]
fn chunked_bodies_arriving_together_are_held_within_the_budget() {
    let (child, addr) = serve(&["--max-memory", "160M", "--timeout-ms", "3000"]);
    // 4 MB each (128 MiB once parsed: each alone fits), 64 of them: 256 MB if all were held.
    let piece = format!("{{\"instances\": [{}", "1,".repeat(2_000_000));
    let clients: Vec<_> = (0..64)
        .map(|_| {
            let (addr, piece) = (addr.clone(), piece.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                // The body never ends: every connection holds what it sent until answered.
                let head = format!(
                    "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\n\
                     Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{piece}\r\n",
                    piece.len()
                );
                let _ = s.write_all(head.as_bytes());
                let mut back = Vec::new();
                let _ = s.read_to_end(&mut back);
                String::from_utf8_lossy(&back).into_owned()
            })
        })
        .collect();
    let answers: Vec<String> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let refused = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 503") && a.contains("cannot be held now"))
        .count();
    assert!(
        refused > 0,
        "{:?}",
        answers.iter().map(|a| a.lines().next()).collect::<Vec<_>>()
    );
    for a in &answers {
        assert!(
            a.starts_with("HTTP/1.1 503") || a.starts_with("HTTP/1.1 408"),
            "{a}"
        );
    }
    still_answers(&addr);
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// A request whose `Content-Length` says it is past `--max-body` is answered 413 at once: the
/// server waited for its body's first byte (a client declaring a huge body and sending nothing
/// held its connection).
#[test]
fn a_body_declared_past_max_body_is_413_before_it_is_sent() {
    let (child, addr) = serve(&["--max-body", "100"]);
    let (text, _) = send_raw(
        &addr,
        "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: \
         99999999999\r\nConnection: close\r\n\r\n",
    );
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("--max-body"), "{text}");
    // A small body is still read and answered (an empty instance list).
    still_answers(&addr);
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// Requests hyper refuses before any route sees them — not HTTP, a bad `Content-Length`, a
/// target or header section too long — are answered with a JSON `error` saying what to fix, as
/// every other error is (hyper's own answers had empty bodies), and the server goes on serving.
#[test]
fn requests_that_are_not_http_get_a_json_error() {
    let (child, addr) = serve(&[]);
    let long_target = format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "a".repeat(70_000));
    let many_headers: String = (0..150).map(|i| format!("X-{i}: v\r\n")).collect();
    let cases = [
        ("GARBAGE\r\n\r\n".to_string(), "400", "not valid HTTP/1.1"),
        (
            "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: \
             abc\r\n\r\n"
                .to_string(),
            "400",
            "Content-Length",
        ),
        (long_target, "414", "too long"),
        (
            format!("GET /healthz HTTP/1.1\r\nHost: t\r\n{many_headers}\r\n"),
            "431",
            "100 headers",
        ),
    ];
    for (request, status, says) in cases {
        let (text, _) = send_raw(&addr, &request);
        assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["error"].as_str().unwrap().contains(says), "{body}");
    }
    still_answers(&addr);
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// A body that has not arrived within `--timeout-ms` of its headers is answered 408 and its
/// connection closed: a client that sent part of a body and stopped held its connection (and
/// what it had sent) for as long as it liked.
#[test]
fn a_body_that_stops_arriving_is_408_within_the_time_limit() {
    let (child, addr) = serve(&["--timeout-ms", "400"]);
    // Keep-alive was not refused by the client: the server closes the connection itself.
    let (text, took) = send_raw(
        &addr,
        "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: \
         100\r\n\r\n{\"instances\": [",
    );
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("--timeout-ms"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
    still_answers(&addr);
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// A connection that does not finish a request's headers within `--header-timeout-ms` is
/// closed (one that sent part of its headers and stopped was held open forever), and so is an
/// idle keep-alive connection; requests that do arrive are answered.
#[test]
fn a_connection_whose_headers_stop_arriving_is_closed() {
    let (child, addr) = serve(&["--header-timeout-ms", "300"]);
    for partial in [
        "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost",
        "",
    ] {
        // Closed by the server: the read ends (at once, not after the client's 20 s).
        let (_, took) = send_raw(&addr, partial);
        assert!(took < Duration::from_secs(10), "{partial:?}: {took:?}");
    }
    still_answers(&addr);
    assert_eq!(stop(child, "TERM"), Some(0));
}

/// `--inputs` names the arguments requests give: with `--random-params`, tensor arguments were
/// all taken for weights, so a model whose instances give tensors could not be served with random
/// weights (an audit's); the answer is `tumble run`'s line.
#[test]
fn inputs_name_the_tensor_arguments_requests_give() {
    let src = "def @main(%x: Tensor[(1, 4), float32], %k: Tensor[(), int32], %W: Tensor[(2, 4), float32]) \
               -> (Tensor[(1, 2), float32], Tensor[(), int32]) {\n  (nn.dense(%x, %W), add(%k, 1))\n}\n";
    let dir = std::env::temp_dir().join(format!("tumble-serve-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("xk.rly");
    std::fs::write(&model, src).unwrap();
    let instance = r#"{"x": [[1, -2, 0.5, 3]], "k": 5}"#;
    let inputs = dir.join("xk.jsonl");
    std::fs::write(&inputs, format!("{instance}\n")).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args([
            "run",
            &model.display().to_string(),
            "--random-params",
            "0",
            "--inputs",
        ])
        .arg(&inputs)
        .output()
        .unwrap();
    assert!(run.status.success());
    let line = String::from_utf8(run.stdout).unwrap();
    let (child, addr) = serve_model(
        &model.display().to_string(),
        &["--random-params", "0", "--inputs", "x,k"],
        &["--name", "treelstm_small"],
    );
    let (status, body) = post(&addr, &format!(r#"{{"instances": [{instance}]}}"#));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, format!("{{\"predictions\":[{}]}}", line.trim_end()));
    assert_eq!(stop(child, "TERM"), Some(0));
}
