//! `tumble serve`: an HTTP inference server for one model, speaking the TF-Serving / KServe v1
//! REST convention, with continuous (cellular) batching across requests.
//!
//! ```text
//!  client ─▶ axum handler ─(parse body: tumble-io, on a blocking thread)─▶ channel ─▶ batch threads
//!     ▲                                                                                 │ a Session each:
//!     └──── oneshot (JSON lines or a located error) ◀── answered per request ◀──────────┘ admit, step
//! ```
//!
//! Interpreter values are `Rc`, so each batch thread (with the CLI's big stack) owns its
//! [`tumble_api::Session`]: it decodes instances, runs its batch and encodes results; HTTP
//! handlers only parse JSON and wait on a oneshot channel. A handler that goes away (client
//! disconnect, timeout) drops its receiver, and the worker cancels that request's instances.
//!
//! With several batch threads (`workers`), each takes whole requests from the one channel: an
//! idle thread waits on it holding its lock, so a request goes to an idle thread first, and a
//! busy one takes what is waiting between its steps. On a CPU a batch of a few instances does
//! not keep two cores busy with split products, so two batches side by side, one core each, both
//! answer sooner and carry more (bench/RESULTS.md).
//!
//! Policies ([`Policy`]): `continuous` admits waiting instances into the running batch before
//! every step (every flush), up to `max_batch` in flight, and answers a request as soon as its
//! instances are done; `static` waits up to `max_wait` for `max_batch` instances, runs them to
//! completion and only then takes the next batch (a dynamic batcher like Triton's); `single`
//! runs one instance at a time.

mod http;
mod metrics;
mod parse_errors;
mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tumble_api::Model;

pub use metrics::Metrics;

/// How instances are grouped into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Instances join the running batch at its next flush and leave it when done.
    Continuous,
    /// Wait up to `max_wait` for `max_batch` instances, run them to completion.
    Static,
    /// One instance at a time (per batch thread).
    Single,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Continuous => "continuous",
            Policy::Static => "static",
            Policy::Single => "single",
        }
    }
}

/// Server settings (the `tumble serve` options).
#[derive(Debug, Clone)]
pub struct Config {
    /// The `{name}` of `/v1/models/{name}`.
    pub name: String,
    pub host: String,
    /// 0: any free port (see [`Server::addr`]).
    pub port: u16,
    /// Kernel threads, shared among the batch threads.
    pub threads: usize,
    /// Batch threads, each with its own session and an equal share of the kernel threads (at
    /// least one); requests are spread among them whole.
    pub workers: usize,
    /// Most instances in one batch (in flight at once).
    pub max_batch: usize,
    /// Most instances accepted and not yet answered; a request that would pass it gets 503.
    pub max_queue: usize,
    pub policy: Policy,
    /// `static`: how long the first waiting instance waits for the batch to fill.
    pub max_wait: Duration,
    /// Per request, from its headers: past it the request gets 504 and its instances are
    /// dropped (408, if its body has not arrived by then).
    pub timeout: Duration,
    /// How long a connection may take to send a request's headers, and how long an idle
    /// keep-alive connection stays open: past it the connection is closed.
    pub header_timeout: Duration,
    /// Seed of `random.db_uniform` draws (instance i of a request draws like instance i of
    /// `tumble run --seed S`).
    pub seed: u64,
    /// Honor `db.phase_change()` in the batch (see `tumble_runtime::session`); off by default:
    /// an instance then finishes in the flush that computes its last phase's work, instead of
    /// waiting one more step with whatever joined meanwhile.
    pub phases: bool,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// `continuous`: depth levels launched per step, between which new instances join (see
    /// `tumble_runtime::session`); `None`: a step runs every pending node.
    pub cell_levels: Option<usize>,
    /// Keep the results of pure invocations of host values for later requests
    /// (`tumble_runtime::Options::job_memo`).
    pub job_memo: bool,
}

impl Config {
    pub fn new(name: impl Into<String>) -> Config {
        Config {
            name: name.into(),
            host: "127.0.0.1".into(),
            port: 0,
            threads: 1,
            workers: 1,
            max_batch: 64,
            max_queue: 1024,
            policy: Policy::Continuous,
            max_wait: Duration::from_millis(10),
            timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            seed: 0,
            phases: false,
            max_body_bytes: 64 << 20,
            cell_levels: None,
            job_memo: true,
        }
    }
}

/// Default [`Config::cell_levels`] (0: none, every step flushes everything). Measured on
/// TreeLSTM-large (bench/RESULTS.md): launching a few levels per step let newcomers join
/// mid-tree but cut the launches' width and the throughput, so whole flushes are the default.
pub const DEFAULT_CELL_LEVELS: usize = 0;

/// State the HTTP handlers share.
pub(crate) struct Shared {
    pub model: Arc<Model>,
    pub config: Config,
    pub metrics: Metrics,
    /// Instances accepted and not yet answered (what `max_queue` bounds).
    pub outstanding: AtomicUsize,
    /// Predict requests whose body is being parsed (not yet counted in `outstanding`): shutdown
    /// waits for them too, so each gets an answer.
    pub parsing: AtomicUsize,
    /// Set when shutdown begins: `/readyz` answers 503.
    pub stopping: AtomicBool,
    /// Notified when shutdown begins: a request whose body is still arriving is answered 503
    /// then, rather than cut off when the drain ends.
    pub stop_notice: tokio::sync::Notify,
    pub jobs: std::sync::mpsc::Sender<worker::Job>,
    /// Batch threads still running: the last one to stop answers what is left in the channel.
    pub workers_running: AtomicUsize,
    /// Kernel threads idle batch threads lend to the busy ones' launches: a lone request runs
    /// on every core, as with one batch thread.
    pub lending: tumble_api::Lending,
    /// Held while a large request body is parsed: they parse one at a time (see `http::answer`).
    pub large_parse: std::sync::Mutex<()>,
}

/// A running server (see [`Server::start`]).
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<std::thread::JoinHandle<Result<(), String>>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

/// Stack of the worker thread (instances are decoded, and results encoded, by native recursion
/// per JSON level): the CLI's.
const WORKER_STACK_BYTES: usize = tumble_api::WORK_STACK_BYTES;
/// Stack of the HTTP runtime's threads, where request bodies are parsed (tumble-io asks for 64 MiB
/// at its deepest accepted nesting).
const HTTP_STACK_BYTES: usize = 64 << 20;

impl Server {
    /// Binds `host:port`, starts the worker and the HTTP server, and returns once it accepts
    /// connections.
    pub fn start(model: Arc<Model>, config: Config) -> Result<Server, String> {
        if config.max_batch == 0
            || config.max_queue == 0
            || config.threads == 0
            || config.workers == 0
        {
            return Err(
                "--max-batch, --max-queue, --threads and --workers must be at least 1".into(),
            );
        }
        let workers = config.workers;
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel();
        let jobs_rx = Arc::new(std::sync::Mutex::new(jobs_rx));
        let shared = Arc::new(Shared {
            model,
            config,
            metrics: Metrics::default(),
            outstanding: AtomicUsize::new(0),
            parsing: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            stop_notice: tokio::sync::Notify::new(),
            jobs: jobs_tx,
            workers_running: AtomicUsize::new(workers),
            lending: tumble_api::Lending::new(workers),
            large_parse: std::sync::Mutex::new(()),
        });
        // Each session is made on its batch thread (it holds `Rc` values); a failure to make one
        // comes back here before anything listens.
        let (made_tx, made_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let mut handles = Vec::with_capacity(workers);
        for k in 0..workers {
            let worker_shared = Arc::clone(&shared);
            let rx = Arc::clone(&jobs_rx);
            let made = made_tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("tumble-serve-batch-{k}"))
                .stack_size(WORKER_STACK_BYTES)
                .spawn(move || worker::run(worker_shared, rx, made, k));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    stop_workers(&shared, handles);
                    return Err(format!("cannot start a batch thread: {e}"));
                }
            }
        }
        drop(made_tx);
        for _ in 0..workers {
            let failed = match made_rx.recv() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("a batch thread stopped while starting".into()),
            };
            if let Some(e) = failed {
                stop_workers(&shared, handles);
                return Err(e);
            }
        }
        let listen_error = |e: std::io::Error, shared: &Arc<Shared>, handles| {
            stop_workers(shared, handles);
            format!(
                "cannot listen on {}:{}: {e}",
                shared.config.host, shared.config.port
            )
        };

        let host = shared.config.host.clone();
        let port = shared.config.port;
        let listener = match std::net::TcpListener::bind((host.as_str(), port)) {
            Ok(l) => l,
            Err(e) => return Err(listen_error(e, &shared, handles)),
        };
        let addr = match listener
            .set_nonblocking(true)
            .and_then(|()| listener.local_addr())
        {
            Ok(a) => a,
            Err(e) => return Err(listen_error(e, &shared, handles)),
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let http_shared = Arc::clone(&shared);
        let http = match std::thread::Builder::new()
            .name("tumble-serve-http".into())
            .spawn(move || http::run(http_shared, listener, stop_rx))
        {
            Ok(h) => h,
            Err(e) => {
                stop_workers(&shared, handles);
                return Err(format!("cannot start the HTTP thread: {e}"));
            }
        };
        Ok(Server {
            addr,
            shared,
            stop: Some(stop_tx),
            http: Some(http),
            workers: handles,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Stops accepting connections, answers every request already accepted, and returns when
    /// the worker has finished.
    pub fn shutdown(mut self) -> Result<(), String> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), String> {
        // The worker first: it stops waiting for batches to fill and runs what it holds, which
        // the handlers the HTTP server waits for are waiting on. A request that slips in after
        // this is still taken while the worker runs, or answered 503 once it has exited.
        tell_workers_to_finish(&self.shared, self.shared.config.workers);
        self.shared.stop_notice.notify_waiters();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let http = match self.http.take() {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err("the HTTP thread panicked".into())),
            None => Ok(()),
        };
        let mut panicked = false;
        for w in self.workers.drain(..) {
            panicked |= w.join().is_err();
        }
        if panicked {
            return Err("a batch thread panicked".into());
        }
        http
    }
}

/// Marks the server stopping and wakes each of its `workers` batch threads with a `Finish` (each
/// would also see `stopping` within its poll interval).
fn tell_workers_to_finish(shared: &Shared, workers: usize) {
    shared.stopping.store(true, Ordering::SeqCst);
    for _ in 0..workers {
        let _ = shared.jobs.send(worker::Job::Finish);
    }
}

/// Stops the batch threads of a server that failed to start, and waits for them.
fn stop_workers(shared: &Shared, handles: Vec<std::thread::JoinHandle<()>>) {
    tell_workers_to_finish(shared, handles.len());
    for h in handles {
        let _ = h.join();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.http.is_some() {
            let _ = self.stop_and_join();
        }
    }
}

/// Runs a server until SIGTERM or Ctrl-C (SIGINT), then drains it: what the CLI calls.
/// `on_listening` is told the address once it accepts connections.
pub fn serve_until_signal(
    model: Arc<Model>,
    config: Config,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let server = Server::start(model, config)?;
    on_listening(server.addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| format!("cannot start the signal watcher: {e}"))?;
    rt.block_on(a_stop_signal());
    // The drain is bounded by the requests' own timeouts; a second signal meanwhile is an
    // operator who will not wait for it (tokio's handlers, once installed, keep the default
    // action from ending the process).
    std::thread::spawn(move || {
        rt.block_on(a_stop_signal());
        eprintln!("tumble serve: a second signal: stopping without draining");
        std::process::exit(130);
    });
    server.shutdown()
}

/// The next SIGTERM or Ctrl-C (SIGINT).
async fn a_stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
