//! The server over loopback: predictions equal `Model::run`'s under every policy and with
//! concurrent clients, and every error case answers as documented without touching the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tumble_api::{LoadOptions, Model, OutTree, Params, RunOptions, Source};
use tumble_serve::{Config, Policy, Server};

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// TreeLSTM-small with random weights, loaded once for every test.
fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        let params = Params {
            random_seed: Some(0),
            ..Params::default()
        };
        let src = repo().join("models/treelstm_small.rly");
        Arc::new(Model::load(Source::File(&src), &params, &LoadOptions::default()).unwrap())
    }))
}

/// The bundled trees, as JSON values.
fn trees() -> Vec<Value> {
    std::fs::read_to_string(repo().join("examples/treelstm.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `Model::run`'s results for the bundled trees, as numbers.
fn expected() -> Vec<Vec<f32>> {
    let items = trees();
    let instances = tumble_api::instances_from_json("test", items);
    let opts = RunOptions {
        threads: Some(1),
        ..RunOptions::default()
    };
    let (out, _) = model().run(&instances, &opts).unwrap();
    out.iter()
        .map(|t| match t {
            OutTree::Tensor(t) => t.as_slice::<f32>().unwrap().to_vec(),
            other => panic!("not a tensor: {other:?}"),
        })
        .collect()
}

fn numbers(v: &Value) -> Vec<f32> {
    fn walk(v: &Value, out: &mut Vec<f32>) {
        match v {
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            Value::Number(n) => out.push(n.as_f64().unwrap() as f32),
            other => panic!("unexpected {other}"),
        }
    }
    let mut out = Vec::new();
    walk(v, &mut out);
    out
}

fn start(policy: Policy, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut c = Config::new("treelstm_small");
    c.policy = policy;
    c.max_batch = 4;
    c.max_wait = Duration::from_millis(5);
    tweak(&mut c);
    Server::start(model(), c).unwrap()
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) = http_full(addr, method, path, body);
    (status, body)
}

/// [`http`] with the response's head (status line and headers, lowercased).
fn http_full(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_lowercase(), body.to_string())
}

fn predict(addr: SocketAddr, instances: &[Value]) -> (u16, Value) {
    let body = json!({ "instances": instances }).to_string();
    let (status, text) = http(
        addr,
        "POST",
        "/v1/models/treelstm_small:predict",
        body.as_bytes(),
    );
    (status, serde_json::from_str(&text).unwrap())
}

fn assert_predictions(got: &Value, want: &[Vec<f32>]) {
    let preds = got["predictions"].as_array().unwrap();
    assert_eq!(preds.len(), want.len());
    for (p, w) in preds.iter().zip(want) {
        assert_eq!(&numbers(p), w);
    }
}

/// Polls `cond` for up to 10 s.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn every_policy_with_concurrent_clients_predicts_what_run_does() {
    let trees = trees();
    let want = expected();
    let variants = [Policy::Continuous, Policy::Static, Policy::Single]
        .into_iter()
        .flat_map(|p| [(p, 1), (p, 3)]);
    for (policy, workers) in variants {
        let server = start(policy, |c| {
            c.workers = workers;
            c.threads = workers;
        });
        let addr = server.addr();
        // Eight clients at once, each sending a different slice (1-3 trees) twice.
        std::thread::scope(|sc| {
            for c in 0..8 {
                let (trees, want) = (&trees, &want);
                sc.spawn(move || {
                    for round in 0..2 {
                        let lo = (c + round) % trees.len();
                        let hi = (lo + 1 + c % 3).min(trees.len());
                        let (status, got) = predict(addr, &trees[lo..hi]);
                        assert_eq!(status, 200, "{policy:?} x{workers}: {got}");
                        assert_predictions(&got, &want[lo..hi]);
                    }
                });
            }
        });
        assert_eq!(server.metrics().responses(200), 16);
        // The batch threads' shares of the gauges add up to the server's (published after the
        // step that answered).
        for line in ["tumble_queue_depth 0", "tumble_in_flight 0"] {
            eventually(line, || {
                let text = http(addr, "GET", "/metrics", b"").1;
                text.lines().any(|l| l == line)
            });
        }
        server.shutdown().unwrap();
    }
}

#[test]
fn bad_requests_are_located_and_leave_the_others_alone() {
    let trees = trees();
    let want = expected();
    let server = start(Policy::Continuous, |_| {});
    let addr = server.addr();
    let path = "/v1/models/treelstm_small:predict";
    std::thread::scope(|sc| {
        let good = sc.spawn(|| predict(addr, &trees));
        let (status, body) = http(addr, "POST", path, b"{\"instances\": [1,");
        assert_eq!(status, 400);
        assert!(body.contains("line 1, column 17: not valid JSON"), "{body}");
        let (status, body) = http(addr, "POST", path, b"{\"inputs\": []}");
        assert_eq!(status, 400);
        assert!(body.contains("`instances`"), "{body}");
        let bad = vec![trees[0].clone(), json!({ "tree": { "Rose": [[0], 5] } })];
        let (status, body) = predict(addr, &bad);
        assert_eq!(status, 400);
        let msg = body["error"].as_str().unwrap();
        assert!(msg.contains("instance at index 1: .tree.Rose[1]"), "{msg}");
        let (status, got) = good.join().unwrap();
        assert_eq!(status, 200);
        assert_predictions(&got, &want);
    });
    let (status, _) = http(addr, "POST", "/v1/models/other:predict", b"{}");
    assert_eq!(status, 404);
    let (status, _) = http(addr, "POST", "/v1/models/treelstm_small:explain", b"{}");
    assert_eq!(status, 404);
    // Every predict answer is counted, 404s included (they were not).
    let (_, metrics) = http(addr, "GET", "/metrics", b"");
    assert!(
        metrics
            .lines()
            .any(|l| l == "tumble_requests_total{code=\"404\"} 2"),
        "{metrics}"
    );
    let (status, body) = predict(addr, &[]);
    assert_eq!((status, body), (200, json!({ "predictions": [] })));
    // Still serving after all that.
    let (status, got) = predict(addr, &trees[..2]);
    assert_eq!(status, 200);
    assert_predictions(&got, &want[..2]);
    server.shutdown().unwrap();
}

#[test]
fn status_health_and_metrics_endpoints() {
    let server = start(Policy::Continuous, |_| {});
    let addr = server.addr();
    let (status, body) = http(addr, "GET", "/v1/models/treelstm_small", b"");
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model_version_status"][0]["state"], "AVAILABLE");
    assert_eq!(v["inputs"][0]["name"], "tree");
    assert_eq!(v["output"], "Tensor[(1, 5), float32]");
    assert_eq!(http(addr, "GET", "/v1/models/nope", b"").0, 404);
    assert_eq!(http(addr, "GET", "/healthz", b""), (200, "ok\n".into()));
    assert_eq!(http(addr, "GET", "/readyz", b""), (200, "ready\n".into()));
    assert_eq!(predict(addr, &trees()[..3]).0, 200);
    let (status, text) = http(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    for line in [
        "tumble_requests_total{code=\"200\"} 1",
        "tumble_instances_total 3",
        "tumble_request_duration_seconds_count 1",
        "# TYPE tumble_batch_size histogram",
        "tumble_queue_depth 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
    }
    server.shutdown().unwrap();
}

/// `static` with a long wait holds instances in the queue: room for the queue, timeout and
/// disconnect cases.
fn holding(tweak: impl FnOnce(&mut Config)) -> Server {
    start(Policy::Static, |c| {
        c.max_batch = 100;
        c.max_wait = Duration::from_secs(60);
        tweak(c);
    })
}

#[test]
fn a_full_queue_refuses_and_shutdown_drains_what_was_accepted() {
    let trees = trees();
    let want = expected();
    let server = holding(|c| c.max_queue = 3);
    let addr = server.addr();
    std::thread::scope(|sc| {
        let held = sc.spawn(|| predict(addr, &trees[..2]));
        eventually("two instances queued", || {
            http(addr, "GET", "/metrics", b"")
                .1
                .contains("tumble_queue_depth 2")
        });
        let body = json!({ "instances": &trees[..2] }).to_string();
        let (status, head, body) = http_full(
            addr,
            "POST",
            "/v1/models/treelstm_small:predict",
            body.as_bytes(),
        );
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("queue is full"), "{body}");
        // A client told to come back is told when.
        assert!(head.contains("\r\nretry-after: 1"), "{head}");
        let (status, _) = predict(addr, &trees[..4]);
        assert_eq!(status, 413);
        // Shutdown runs the held batch at once instead of waiting out its minute.
        let t = Instant::now();
        server.shutdown().unwrap();
        let (status, got) = held.join().unwrap();
        assert_eq!(status, 200);
        assert_predictions(&got, &want[..2]);
        assert!(t.elapsed() < Duration::from_secs(30));
    });
}

#[test]
fn a_request_past_its_timeout_gets_504_and_is_dropped() {
    let trees = trees();
    let server = holding(|c| c.timeout = Duration::from_millis(200));
    let addr = server.addr();
    let (status, body) = predict(addr, &trees[..1]);
    assert_eq!(status, 504, "{body}");
    eventually("the instance dropped", || server.metrics().cancelled() == 1);
    eventually("the queue empty", || {
        http(addr, "GET", "/metrics", b"")
            .1
            .contains("tumble_queue_depth 0")
    });
    server.shutdown().unwrap();
}

#[test]
fn a_client_that_disconnects_cancels_its_instances() {
    let trees = trees();
    let server = holding(|_| {});
    let addr = server.addr();
    let body = json!({ "instances": &trees[..3] }).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/models/treelstm_small:predict HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    eventually("three instances queued", || {
        http(addr, "GET", "/metrics", b"")
            .1
            .contains("tumble_queue_depth 3")
    });
    drop(s);
    eventually("the instances dropped", || {
        server.metrics().cancelled() == 3
    });
    server.shutdown().unwrap();
}

/// A countdown on the host, one evaluation step after another: it never suspends, so a step of
/// the batch runs it to its end.
const COUNTDOWN: &str = r#"
def @f(%x: Tensor[(), int32]) -> Tensor[(), int32] {
  if (less(%x, 1)) { %x } else { @f(subtract(%x, 1)) }
}
def @main(%x: Tensor[(), int32]) -> Tensor[(), int32] {
  @f(%x)
}
"#;

/// A client that disconnects while its instance runs in the middle of a step stops it there
/// (the reply's closing is only seen between steps; the instance held the batch thread for
/// half a minute and the next request waited for it).
#[test]
fn a_client_that_disconnects_stops_its_running_instance() {
    let src = Source::Text {
        name: "countdown.rly",
        text: COUNTDOWN,
    };
    let m = Arc::new(Model::load(src, &Params::default(), &LoadOptions::default()).unwrap());
    let server = Server::start(m, Config::new("countdown")).unwrap();
    let addr = server.addr();
    // About half a minute of evaluation steps.
    let body = json!({ "instances": [{ "x": 20_000_000 }] }).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/models/countdown:predict HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    // (The metrics are published between steps: none while it runs.)
    std::thread::sleep(Duration::from_millis(500));
    drop(s);
    eventually("the instance stopped", || server.metrics().cancelled() == 1);
    let t = Instant::now();
    let (status, text) = http(
        addr,
        "POST",
        "/v1/models/countdown:predict",
        json!({ "instances": [{ "x": 3 }] }).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    server.shutdown().unwrap();
}

/// An instance that never suspends holds the batch thread for a time slice per step, not until its
/// deadline: under the continuous policy a small request sent while it runs is answered at once
/// (it waited out the runaway's whole `--timeout-ms` and got a 504 of its own; an audit's find).
/// The static and single policies admit only into an idle batch, by definition: there the small
/// request waits for the runaway's timeout, as behind any long batch.
#[test]
fn a_runaway_instance_does_not_hold_up_the_others() {
    let src = Source::Text {
        name: "countdown.rly",
        text: COUNTDOWN,
    };
    let m = Arc::new(Model::load(src, &Params::default(), &LoadOptions::default()).unwrap());
    let mut c = Config::new("countdown");
    c.timeout = Duration::from_secs(3);
    let server = Server::start(m, c).unwrap();
    let addr = server.addr();
    let ask = move |x: i64| {
        let body = json!({ "instances": [{ "x": x }] }).to_string();
        http(
            addr,
            "POST",
            "/v1/models/countdown:predict",
            body.as_bytes(),
        )
    };
    // Minutes of evaluation steps: stopped by its 3 s timeout.
    let runaway = std::thread::spawn(move || ask(2_000_000_000).0);
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let (status, body) = ask(3);
    let waited = t.elapsed();
    assert_eq!((status, body.as_str()), (200, r#"{"predictions":[0]}"#));
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    assert_eq!(runaway.join().unwrap(), 504);
    server.shutdown().unwrap();
}

/// A recursion that records a chain of products without waiting on any (its condition is an
/// integer the host computes): the work is the flush, not the host program.
const SPIN: &str = r#"
def @spin(%h: Tensor[(1, 256), float32], %W: Tensor[(256, 256), float32], %n: Tensor[(), int32]) -> Tensor[(1, 256), float32] {
  if (%n <= 0) { %h } else { @spin(tanh(nn.dense(%h, %W)), %W, %n - 1) }
}
def @main(%n: Tensor[(), int32], %W: Tensor[(256, 256), float32]) -> Tensor[(), float32] {
  sum(@spin(ones(shape=[1, 256], dtype="float32"), %W, %n))
}
"#;

/// A request dropped while its recorded work is being flushed (timed out, 504) or while it is
/// still recording (client gone) stops that work: the next request is answered at once. (The
/// flush checked nothing between launches and ran its work to the end: the next request waited
/// 15–27 s; an audit's find.)
#[test]
fn dropped_requests_stop_their_recorded_work() {
    let m = spin_model();
    for policy in [Policy::Continuous, Policy::Static, Policy::Single] {
        let mut c = Config::new("spin");
        c.policy = policy;
        c.max_wait = Duration::from_millis(1);
        c.timeout = Duration::from_millis(400);
        let server = Server::start(m.clone(), c).unwrap();
        let addr = server.addr();
        let ask = |n: i64| {
            let body = json!({ "instances": [{ "n": n }] }).to_string();
            http(addr, "POST", "/v1/models/spin:predict", body.as_bytes())
        };
        // Minutes of products in one flush (recorded in well under the timeout).
        let (status, text) = ask(200_000);
        assert_eq!(status, 504, "{policy:?}: {text}");
        let t = Instant::now();
        let (status, text) = ask(3);
        assert_eq!(status, 200, "{policy:?}: {text}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{policy:?}: {:?}",
            t.elapsed()
        );
        server.shutdown().unwrap();
    }
}

fn spin_model() -> Arc<Model> {
    let src = Source::Text {
        name: "spin.rly",
        text: SPIN,
    };
    let params = Params {
        random_seed: Some(0),
        ..Params::default()
    };
    let options = LoadOptions {
        inputs: Some(vec!["n".to_string()]),
        ..LoadOptions::default()
    };
    Arc::new(Model::load(src, &params, &options).unwrap())
}

/// `n` steps of the spin model: (status, body).
fn spin(addr: SocketAddr, n: i64) -> (u16, String) {
    let body = json!({ "instances": [{ "n": n }] }).to_string();
    http(addr, "POST", "/v1/models/spin:predict", body.as_bytes())
}

/// With two batch threads a request goes to the idle one: it is answered while the other runs
/// a long flush, instead of after it (as with one thread).
#[test]
fn a_second_batch_thread_answers_while_the_first_is_busy() {
    let m = spin_model();
    for policy in [Policy::Continuous, Policy::Static, Policy::Single] {
        let mut c = Config::new("spin");
        c.policy = policy;
        c.max_wait = Duration::from_millis(1);
        c.workers = 2;
        c.threads = 2;
        c.timeout = Duration::from_secs(600);
        let server = Server::start(m.clone(), c).unwrap();
        let addr = server.addr();
        let long_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&long_done);
        // About a second of products in one flush on one thread (a few in a debug build, more
        // on a loaded machine).
        let n = if cfg!(debug_assertions) {
            10_000
        } else {
            150_000
        };
        let long = std::thread::spawn(move || {
            let r = spin(addr, n);
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            r
        });
        eventually("the long request running", || {
            http(addr, "GET", "/metrics", b"")
                .1
                .contains("tumble_in_flight 1")
        });
        let (status, text) = spin(addr, 3);
        assert_eq!(status, 200, "{policy:?}: {text}");
        assert!(
            !long_done.load(std::sync::atomic::Ordering::SeqCst),
            "{policy:?}: the short request was answered after the long one"
        );
        let (status, text) = long.join().unwrap();
        assert_eq!(status, 200, "{policy:?}: {text}");
        server.shutdown().unwrap();
    }
}

/// `static` with two batch threads: a lone request is admitted at its batch's deadline. The
/// thread holding it waited on the channel's lock, which the idle thread took again slice after
/// slice: answers took up to seconds, past their timeout (a review's find).
#[test]
fn a_lone_static_request_is_not_held_by_the_idle_thread() {
    let server = start(Policy::Static, |c| {
        c.workers = 2;
        c.threads = 2;
        c.max_wait = Duration::from_millis(10);
    });
    let addr = server.addr();
    let trees = trees();
    let want = expected();
    let mut slowest = Duration::ZERO;
    for k in 0..80 {
        let i = k % trees.len();
        let t = Instant::now();
        let (status, got) = predict(addr, &trees[i..=i]);
        slowest = slowest.max(t.elapsed());
        assert_eq!(status, 200, "{got}");
        assert_predictions(&got, &want[i..=i]);
        std::thread::sleep(Duration::from_millis(13));
    }
    assert!(slowest < Duration::from_millis(300), "{slowest:?}");
    server.shutdown().unwrap();
}

/// Shutdown answers every accepted request, also those still in the channel behind full
/// batches (they were answered 503; a review's find), with one batch thread and with two.
#[test]
fn shutdown_answers_what_waits_in_the_channel() {
    let m = spin_model();
    // Long enough that none is answered before all eight are accepted (an answered one leaves
    // the gauges, and with fewer counted one could still be on its way in: answered 503).
    let n = if cfg!(debug_assertions) {
        1_500
    } else {
        10_000
    };
    for workers in [1, 2] {
        let mut c = Config::new("spin");
        c.max_batch = 1;
        c.workers = workers;
        c.threads = workers;
        c.timeout = Duration::from_secs(600);
        let server = Server::start(m.clone(), c).unwrap();
        let addr = server.addr();
        std::thread::scope(|sc| {
            let asked: Vec<_> = (0..8).map(|_| sc.spawn(move || spin(addr, n))).collect();
            eventually("eight requests accepted", || {
                let text = http(addr, "GET", "/metrics", b"").1;
                let depth = text
                    .lines()
                    .find_map(|l| l.strip_prefix("tumble_queue_depth "))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                let running = text
                    .lines()
                    .find_map(|l| l.strip_prefix("tumble_in_flight "))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                depth + running >= 8
            });
            server.shutdown().unwrap();
            for a in asked {
                let (status, text) = a.join().unwrap();
                assert_eq!(status, 200, "x{workers}: {text}");
            }
        });
    }
}

/// Shutdown ends even while a client holds a request it never finishes sending (headers cut
/// short, or a body shorter than its Content-Length): the graceful wait for every connection to
/// close never ended (an audit's find).
#[test]
fn shutdown_ends_with_half_sent_requests_open() {
    let src = Source::Text {
        name: "countdown.rly",
        text: COUNTDOWN,
    };
    let m = Arc::new(Model::load(src, &Params::default(), &LoadOptions::default()).unwrap());
    for partial in [
        "POST /v1/models/countdown:predict HTTP/1.1\r\nHost: t\r\n".to_string(),
        "POST /v1/models/countdown:predict HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{\"inst".to_string(),
    ] {
        let server = Server::start(m.clone(), Config::new("countdown")).unwrap();
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.write_all(partial.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(server.shutdown());
        });
        let r = done_rx.recv_timeout(Duration::from_secs(20));
        assert!(
            matches!(r, Ok(Ok(()))),
            "{partial:?}: {r:?} after {:?}",
            t.elapsed()
        );
        if partial.contains("Content-Length") {
            // A body still arriving is answered 503 when shutdown begins (it was cut off with
            // no answer).
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            assert!(text.starts_with("HTTP/1.1 503"), "{text}");
            assert!(text.contains("shutting down"), "{text}");
        }
        drop(s);
    }
}

/// A GET of the predict verb is 405 (with `Allow: POST`), not 404; a body past `max_body_bytes`
/// is 413 in JSON like every other error, not axum's plain text (an audit's).
#[test]
fn wrong_method_and_oversized_bodies_are_json_4xx() {
    let src = Source::Text {
        name: "countdown.rly",
        text: COUNTDOWN,
    };
    let m = Arc::new(Model::load(src, &Params::default(), &LoadOptions::default()).unwrap());
    let mut c = Config::new("countdown");
    c.max_body_bytes = 64;
    let server = Server::start(m, c).unwrap();
    let addr = server.addr();
    let (status, text) = http(addr, "GET", "/v1/models/countdown:predict", b"");
    assert_eq!(status, 405, "{text}");
    assert!(text.contains("\"error\""), "{text}");
    // Methods no route takes, and a model path that is not UTF-8: JSON too (axum's own answers
    // were an empty 405 and a plain-text 400).
    // Each 405 names the methods its path takes (the prediction path said GET, HEAD and POST to
    // PUT but POST to GET; a POST to the model's status was a 404).
    for (method, path, want, allow) in [
        ("GET", "/v1/models/countdown:predict", 405, Some("post")),
        ("PUT", "/v1/models/countdown:predict", 405, Some("post")),
        ("DELETE", "/v1/models/countdown", 405, Some("get, head")),
        ("POST", "/v1/models/countdown", 405, Some("get, head")),
        ("POST", "/healthz", 405, Some("get, head")),
        ("DELETE", "/v1/models/other:predict", 404, None),
        ("POST", "/v1/models/countdown:classify", 404, None),
        ("POST", "/v1/models/%FF:predict", 400, None),
        ("GET", "/v1/models/%FF", 400, None),
    ] {
        let (status, head, text) = http_full(addr, method, path, b"{}");
        assert_eq!(status, want, "{method} {path}: {text}");
        if let Some(allow) = allow {
            assert!(
                head.contains(&format!("\r\nallow: {allow}\r\n")),
                "{method} {path}: {head}"
            );
        }
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{text}");
    }
    // TF-Serving's other request forms are refused by name: the columnar `inputs` (beside
    // `instances` it was dropped silently) and a signature the model does not have.
    for body in [
        json!({ "inputs": { "x": [3] } }),
        json!({ "instances": [{ "x": 3 }], "inputs": { "x": [4] } }),
        json!({ "instances": [{ "x": 3 }], "signature_name": "other" }),
    ] {
        let (status, text) = http(
            addr,
            "POST",
            "/v1/models/countdown:predict",
            body.to_string().as_bytes(),
        );
        assert_eq!(status, 400, "{body}: {text}");
    }
    let named = json!({ "instances": [{ "x": 3 }], "signature_name": "serving_default" });
    assert_eq!(
        http(
            addr,
            "POST",
            "/v1/models/countdown:predict",
            named.to_string().as_bytes()
        ),
        (200, r#"{"predictions":[0]}"#.to_string())
    );
    let big = json!({ "instances": vec![json!({ "x": 3 }); 20] }).to_string();
    let (status, text) = http(addr, "POST", "/v1/models/countdown:predict", big.as_bytes());
    assert_eq!(status, 413, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-body")),
        "{text}"
    );
    server.shutdown().unwrap();
}

/// Integer division in a block: a zero divisor fails inside a batched launch.
const DIV: &str = r#"
def @main(%x: Tensor[(1, 2), float32], %d: Tensor[(1, 2), int32], %w: Tensor[(2, 2), float32])
    -> Tensor[(1, 2), int32] {
  let %y = nn.dense(%x, %w);
  divide(cast(%y, dtype="int32"), %d)
}
"#;

#[test]
fn an_instance_failing_at_run_time_fails_only_its_request() {
    let w = tumble_tensor::Tensor::from_vec(vec![2, 2], vec![2.0f32, 0.0, 0.0, 2.0]).unwrap();
    let params = Params {
        tensors: [("w".to_string(), w)].into_iter().collect(),
        ..Params::default()
    };
    let src = Source::Text {
        name: "div.rly",
        text: DIV,
    };
    let m = Arc::new(Model::load(src, &params, &LoadOptions::default()).unwrap());
    let mut c = Config::new("div");
    // Everything sent below waits for one batch, so the bad instance shares its launch.
    c.policy = Policy::Static;
    c.max_batch = 3;
    c.max_wait = Duration::from_secs(5);
    let server = Server::start(m, c).unwrap();
    let addr = server.addr();
    let send = |x: f32, d: i32| {
        let body = json!({ "instances": [{ "x": [[x, x]], "d": [[d, d]] }] }).to_string();
        http(addr, "POST", "/v1/models/div:predict", body.as_bytes())
    };
    std::thread::scope(|sc| {
        let a = sc.spawn(|| send(1.0, 1));
        let b = sc.spawn(|| send(5.0, 0));
        let c = sc.spawn(|| send(7.0, 2));
        assert_eq!(
            a.join().unwrap(),
            (200, "{\"predictions\":[[[2,2]]]}".into())
        );
        assert_eq!(
            c.join().unwrap(),
            (200, "{\"predictions\":[[[7,7]]]}".into())
        );
        let (status, body) = b.join().unwrap();
        assert_eq!(status, 422, "{body}");
        assert!(
            body.contains("instance at index 0") && body.contains("division by zero"),
            "{body}"
        );
        // The located diagnostic's own `error: ` is not repeated under the `error` key.
        assert!(
            body.starts_with(r#"{"error":"instance at index 0"#),
            "{body}"
        );
    });
    server.shutdown().unwrap();
}
