//! `tumble serve`: load a model once and serve it over HTTP (see `tumble-serve`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tumble_api::{LoadOptions, Model, Params, Source};
use tumble_serve::{Config, Policy};

#[derive(clap::Args)]
#[command(after_help = "\
Endpoints (TF-Serving / KServe v1 REST):
  POST /v1/models/NAME:predict   {\"instances\": [...]} -> {\"predictions\": [...]}, one per
                                 instance, in order, in `tumble run`'s JSON encoding
  GET  /v1/models/NAME           status and signature (inputs, output type, parameters)
  GET  /healthz, /readyz         liveness; readiness (503 on connections already open while
                                 it drains after SIGTERM; new connections are refused then)
  GET  /metrics                  Prometheus text: requests by status, latency and batch-size
                                 histograms, queue depth, launches

Errors: 400 bad JSON or an instance that does not decode (the message names the instance and
the place in it; also TF-Serving's columnar `inputs` and a `signature_name` other than
\"serving_default\"), 422 an instance that fails at run time, 413 a request larger than
--max-queue or --max-body, or too large to parse within --max-memory, 503 queue full, shutting
down, or memory held by other requests now (their bodies as they arrive, chunked ones too, or
their batches), 504 past --timeout-ms (408 if the body has not
arrived by then), 405 with `Allow` for a method its path does not take. An instance that runs
on the host without suspending (a recursion without a base case) gives way to the others every
10 ms under the continuous policy, until its --timeout-ms stops it. A connection whose headers
take longer than --header-timeout-ms, or that leaves an answer unread for --timeout-ms, is
closed. SIGTERM or Ctrl-C stops accepting connections, answers the requests already accepted,
and exits 0; a second one during that drain exits at once (status 130). A 503 (queue full,
memory held by other requests) carries `Retry-After`.

Example:
  tumble serve models/treelstm_small.rly --random-params 0 --port 8080
  tumble serve treelstm.tumble --port 8080     # compiled by `tumble compile`, weights inside
  curl -s localhost:8080/v1/models/treelstm_small:predict \\
       -d '{\"instances\": [{\"tree\": {\"Rose\": [[0], []]}}]}'")]
pub struct ServeArgs {
    /// The model: a `.rly` file in the Relay text format, or a compiled model written by
    /// `tumble compile` (its program as compiled; its weights unless compiled with --no-weights).
    pub model: PathBuf,
    /// Weights: a safetensors file, a `.npy` file or a directory of `.npy` files.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Fill parameters missing from `--params` with seeded random values.
    #[arg(long, value_name = "SEED")]
    pub random_params: Option<u64>,
    /// The entry's arguments each request instance gives (comma-separated names). Default:
    /// every argument the weights do not give; with --random-params, every argument that is
    /// not a tensor — name the inputs here when instances give tensors.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub inputs: Option<Vec<String>>,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long)]
    pub port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The NAME in /v1/models/NAME; default: the model file's stem.
    #[arg(long)]
    pub name: Option<String>,
    /// Kernel threads, shared among the batch threads (`--workers`); default
    /// `$TUMBLE_NUM_THREADS`, else every core.
    #[arg(long, value_parser = crate::run::thread_arg)]
    pub threads: Option<usize>,
    /// Batch threads, each running its own batch on an equal share of the kernel threads and
    /// taking whole requests (an idle one first; `single` runs one instance per batch thread);
    /// an idle one lends its kernel threads to the others. Default: one per thread — on a CPU a
    /// batch of a few instances does not keep two cores busy, two batches side by side do.
    /// Never more than the threads (a larger count is reduced, with a warning)
    #[arg(long, value_parser = at_least_one)]
    pub workers: Option<usize>,
    /// Most instances in one batch.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    pub max_batch: usize,
    /// Most instances accepted and not yet answered (waiting or running); past it, 503.
    #[arg(long, default_value_t = 1024, value_parser = at_least_one)]
    pub max_queue: usize,
    /// continuous: instances join the running batch at its next flush and leave it when done;
    /// static: wait up to --max-wait-ms for --max-batch instances, run them to completion;
    /// single: one instance at a time.
    #[arg(long, value_enum, default_value_t = PolicyArg::Continuous)]
    pub policy: PolicyArg,
    /// static: how long the first waiting instance waits for the batch to fill.
    #[arg(long, default_value_t = 10, value_name = "T")]
    pub max_wait_ms: u64,
    /// Per request, from its headers: past this, 504 and its instances are dropped (408 if its
    /// body has not arrived by then); an answer the client leaves unread this long closes the
    /// connection.
    #[arg(long, default_value_t = 30_000, value_name = "T", value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
    /// Per connection: a request's headers must arrive within this (an idle keep-alive connection
    /// is closed after it too); past it, the connection is closed.
    #[arg(long, default_value_t = 30_000, value_name = "T", value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,
    /// Seed of `random.db_uniform` (instance i of a request draws like instance i of
    /// `tumble run --seed S`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Hold instances at `db.phase_change()` for one step so the next phase batches with others
    /// (off: an instance runs through its phases and leaves at the first flush it can).
    #[arg(long)]
    pub phases: bool,
    /// continuous: depth levels (cells) launched between two admissions; 0: run every pending
    /// node before admitting again. A few levels let requests join sooner, but each step
    /// launches every block any request has at its level; on a CPU whole flushes were faster.
    #[arg(long, default_value_t = tumble_serve::DEFAULT_CELL_LEVELS, value_name = "N")]
    pub cell_levels: usize,
    /// Compute every request's invocations, instead of taking the results the server computed
    /// for an earlier request's identical ones (a leaf on a word seen before; see `tumble run
    /// --no-job-memo`).
    #[arg(long)]
    pub no_job_memo: bool,
    /// Largest request body, in bytes. Bodies are held within --max-memory as they arrive.
    #[arg(long, default_value_t = 64 << 20, value_name = "BYTES")]
    pub max_body: usize,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PolicyArg {
    Continuous,
    Static,
    Single,
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a count of at least 1")),
    }
}

pub fn serve(args: &ServeArgs) -> ExitCode {
    let threads = match crate::run::thread_count(args.threads) {
        Ok(t) => t,
        Err(e) => return crate::run::report(e, &tumble_ir::SourceMap::new(), false),
    };
    let params = Params {
        file: args.params.clone(),
        random_seed: args.random_params,
        ..Params::default()
    };
    let options = LoadOptions {
        inputs: args.inputs.as_ref().map(|v| {
            v.iter()
                .map(|n| n.trim_start_matches('%').to_string())
                .collect()
        }),
        threads: Some(threads),
        ..LoadOptions::default()
    };
    let model = match Model::load(Source::File(&args.model), &params, &options) {
        Ok(m) => m,
        Err(e) => {
            // A model that does not check comes as rendered diagnostics, each `error: ...`.
            let text = e.to_string();
            match text.starts_with("error") {
                true => eprintln!("{}", text.trim_end()),
                false => eprintln!("error: {text}"),
            }
            return ExitCode::FAILURE;
        }
    };
    for w in model.warnings() {
        eprintln!("{}", w.trim_end());
    }
    let name = args.name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    if let Err(why) = model_name_problem(&name) {
        let whose = match args.name {
            Some(_) => "--name",
            None => "the model file's stem (the default --name)",
        };
        eprintln!(
            "error: {whose} {}: {why}; give a name of letters, digits, `.`, `_` or `-` with --name",
            tumble_limits::echo(&format!("{name:?}"))
        );
        return ExitCode::from(2);
    }
    if args.params.is_none() && args.random_params.is_none() {
        // Without weights every tensor argument is an instance input: right for a model whose
        // requests carry them, a surprise for one that forgot `--params`.
        let big: Vec<String> = model
            .inputs()
            .iter()
            .filter(|(_, ty)| ty.as_tensor().is_some_and(|(dims, _)| dims.len() >= 2))
            .map(|(n, _)| format!("%{}", n.trim_start_matches('%')))
            .collect();
        if !big.is_empty() {
            eprintln!(
                "warning: no weights given (--params FILE or --random-params SEED): every \
                 argument of @main is read from each instance, the weight-like {} included",
                big.join(", ")
            );
        }
    }
    let workers = match args.workers {
        Some(w) if w > threads => {
            eprintln!(
                "warning: --workers {w} is more than the {threads} thread(s): {threads} batch \
                 thread(s) instead"
            );
            threads
        }
        Some(w) => w,
        None => threads,
    };
    let config = Config {
        host: args.host.clone(),
        port: args.port,
        threads,
        workers,
        max_batch: args.max_batch,
        max_queue: args.max_queue,
        policy: match args.policy {
            PolicyArg::Continuous => Policy::Continuous,
            PolicyArg::Static => Policy::Static,
            PolicyArg::Single => Policy::Single,
        },
        max_wait: Duration::from_millis(args.max_wait_ms),
        timeout: Duration::from_millis(args.timeout_ms),
        header_timeout: Duration::from_millis(args.header_timeout_ms),
        seed: args.seed,
        phases: args.phases,
        max_body_bytes: args.max_body,
        cell_levels: (args.cell_levels > 0).then_some(args.cell_levels),
        job_memo: !args.no_job_memo,
        ..Config::new(name.clone())
    };
    let policy = config.policy.name();
    let result = tumble_serve::serve_until_signal(Arc::new(model), config, |addr| {
        eprintln!("tumble serve: {name} ({policy}) listening on http://{addr}/v1/models/{name}");
    });
    match result {
        Ok(()) => {
            eprintln!("tumble serve: stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Why `name` cannot name the model in `/v1/models/{name}` and in `/metrics`' labels: it must be
/// one path segment before `:predict`, printable.
fn model_name_problem(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("it is empty")
    } else if name.chars().any(char::is_control) {
        Err("it has control characters")
    } else if name.contains(['/', ':', '?', '#', '%']) {
        Err("`/`, `:`, `?`, `#` and `%` cannot be in a path segment before `:predict`")
    } else {
        Ok(())
    }
}
