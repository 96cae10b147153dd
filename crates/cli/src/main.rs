//! `tumble`: the command-line face of the compiler.

use clap::{Parser, Subcommand, ValueEnum};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

// The runtime allocates a tensor per launch output and many small host values per instance;
// mimalloc keeps freed memory for reuse instead of returning large blocks to the OS and
// page-faulting them back in at the next launch (measured in bench/RESULTS.md). It is built with
// `no_thp` (Cargo.toml): it does not advise its arenas as transparent huge pages, whose first
// touches zeroed ~500 MB of 2 MiB pages per run and, when the kernel had to compact memory for
// them, stalled the first run of a process by 100-350 ms of system time (the suite's bimodal
// samples). Packed GEMM weights still ask for huge pages themselves (`tumble_kernels::pack`).
//
// It is asked for plain blocks where their alignment suffices (`alloc::MiMallocPlain`: the
// aligned entry point serves only blocks up to 1 KiB quickly).
//
// Around it, `CountingAlloc` keeps the live heap bytes for the memory budget (`--max-memory`):
// a thread-local counter per allocation, shared every 256 KiB.
#[global_allocator]
static GLOBAL: tumble_limits::CountingAlloc<alloc::MiMallocPlain> =
    tumble_limits::CountingAlloc(alloc::MiMallocPlain);

/// `eprintln!` / `eprint!` that never panic (std's panic when stderr cannot be written): stderr
/// carries progress and diagnostics, and a reader that went away (`2>&1 | head -1`, a dead log
/// collector) must neither stop a command — `train` stopped after the epoch whose line failed,
/// its checkpoint that epoch's — nor, being caught as `| head` closing stdout is, turn it into a
/// success with status 0. Defined before the modules, so every one of them uses these.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

macro_rules! eprint {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

/// Stack of the threads that do the work (the main work thread and `run`'s mini-batch workers).
pub(crate) const WORK_STACK_BYTES: usize = 256 << 20;

mod alloc;
mod commands;
mod compiled;
mod explain;
mod files;
mod run;
mod serve;
mod switches;
mod train;

#[derive(Parser)]
#[command(
    name = "tumble",
    version,
    about = "Compile and run dynamic deep-learning models written in the Relay text format",
    long_about = "tumble runs dynamic models (trees, variable-length sequences, recursion, early exit) \
written once, unbatched, in the Relay text format, and batches a mini-batch of instances automatically."
)]
struct Cli {
    /// When to color diagnostics.
    #[arg(long, value_enum, default_value_t = Color::Auto, global = true)]
    color: Color,
    /// Memory budget of the command: tensors, the dataflow graph, pending evaluations and decoded
    /// input count against it, and a run that would exceed it stops with an error naming what
    /// grew. A size with an optional unit K, M, G or T (powers of 1024), or `none`. Default: half
    /// of the machine's memory (or of the container's limit).
    #[arg(long, global = true, value_name = "SIZE")]
    max_memory: Option<String>,
    /// Time limit of the command: past it, the command stops at its next safe point with an
    /// error and status 124, as on Ctrl-C (a run writes nothing; `train` keeps its last complete
    /// checkpoint) — a recursion without a base case in constant memory, which no memory budget
    /// stops, included. Seconds, or a number with a unit `ms`, `s`, `m` or `h` (`30`, `1.5s`,
    /// `10m`). Default: none. (`tumble serve` bounds each request instead: `--timeout-ms`.)
    #[arg(long, global = true, value_name = "DURATION")]
    timeout: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

#[derive(Subcommand)]
enum Command {
    /// Type-check model files and print each global's inferred type.
    Check {
        /// Files in the Relay text format (`.rly`).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print nothing on success; only diagnostics.
        #[arg(short, long)]
        quiet: bool,
        /// Do not load the built-in prelude (List, Option, Tree, map, foldl, ...).
        #[arg(long)]
        no_prelude: bool,
    },
    /// Print a model file in canonical form (comments are not kept: a warning counts them).
    Fmt {
        file: PathBuf,
        /// Print no text; exit with status 1, naming the file on stderr, if it is not already in
        /// canonical form.
        #[arg(long)]
        check: bool,
    },
    /// Run a model on a file of instances and write one result per instance.
    Run(run::RunArgs),
    /// Compile a model (and optionally its weights) into a `.tumble` file that `tumble run` starts
    /// from without parsing, type checking or compiling.
    Compile(compiled::CompileArgs),
    /// Serve a model over HTTP (TF-Serving / KServe v1 REST) with continuous batching.
    Serve(serve::ServeArgs),
    /// The gradient of the sum of `@main`'s outputs (a float scalar per instance) with respect
    /// to every float parameter, by the batched backward pass; written as safetensors.
    Grad(train::GradArgs),
    /// Train the float parameters: minimize the mean of `@main`'s output over mini-batches.
    Train(train::TrainArgs),
    /// Show the static blocks the compiler found and its parameter-reuse decisions.
    Explain(explain::ExplainArgs),
    /// Make instance files: SST trees and sentences, generated inputs for the zoo models.
    Data(tumble_data::cli::DataArgs),
    /// List the operators tumble knows, with their attributes.
    Ops,
    /// Print the built-in prelude.
    Prelude,
}

/// The message of a panic that is `print!`'s (or `eprint!`'s) failing to write: `Some(message)`.
fn print_failure(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    let msg = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))?;
    (msg.contains("failed printing to stdout") || msg.contains("failed printing to stderr"))
        .then_some(msg)
}

/// Set by SIGTERM (as well as the interrupt flag): the exit status is then 143, not 130.
static TERMINATED: std::sync::OnceLock<std::sync::Arc<std::sync::atomic::AtomicBool>> =
    std::sync::OnceLock::new();

/// Ctrl-C (SIGINT) or SIGTERM (`kill`, `timeout`) asks the running command to stop at its next
/// safe point (a run, a `tumble data` write), which then removes what it had half-written; a
/// second signal ends the process at once.
fn watch_interrupts() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let flag = Arc::new(AtomicBool::new(false));
    let term = Arc::new(AtomicBool::new(false));
    // Registered first, so the first signal finds the flag still clear and does not exit.
    let registered =
        signal_hook::flag::register_conditional_shutdown(SIGINT, 130, Arc::clone(&flag))
            .and_then(|_| {
                signal_hook::flag::register_conditional_shutdown(SIGTERM, 143, Arc::clone(&flag))
            })
            .and_then(|_| signal_hook::flag::register(SIGINT, Arc::clone(&flag)))
            .and_then(|_| signal_hook::flag::register(SIGTERM, Arc::clone(&term)))
            .and_then(|_| signal_hook::flag::register(SIGTERM, Arc::clone(&flag)));
    if registered.is_ok() {
        let _ = TERMINATED.set(Arc::clone(&term));
        tumble_limits::watch_interrupt(Arc::clone(&flag));
        // Work that never reaches a safe point (type checking, compiling) would otherwise
        // outlive the signal: `timeout` sends SIGTERM once. A grace period after the first
        // signal, then the process ends as the default action would have ended it.
        let _ = std::thread::Builder::new()
            .name("tumble-signals".into())
            .spawn(move || loop {
                std::thread::sleep(std::time::Duration::from_millis(50));
                if flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(SIGNAL_GRACE);
                    let _ = writeln!(std::io::stderr(), "error: interrupted");
                    std::process::exit(if term.load(std::sync::atomic::Ordering::Relaxed) {
                        143
                    } else {
                        130
                    });
                }
                // Past `--timeout` the same grace, for work that never polls.
                if let Some(limit) = tumble_limits::timed_out() {
                    std::thread::sleep(SIGNAL_GRACE);
                    let _ = writeln!(
                        std::io::stderr(),
                        "error: {}",
                        tumble_limits::Stop::TimedOut { limit }
                    );
                    std::process::exit(TIMED_OUT_STATUS);
                }
            });
    }
}

/// The status of a command stopped by `--timeout` (coreutils `timeout`'s).
const TIMED_OUT_STATUS: i32 = 124;

/// How long a command may take after SIGINT or SIGTERM to stop at a safe point (removing what it
/// had half-written) before the process ends anyway.
const SIGNAL_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

fn main() -> ExitCode {
    alloc::keep_freed_memory_a_while();
    // A reader that stops early (`| head`) is not an error: the printing thread's panic is silent
    // and the command exits 0, as `run` does when its writes fail.
    let default_hook = std::panic::take_hook();
    // Any other failed print (`tumble prelude > /dev/full`) is reported as an error below, not as
    // a crash.
    std::panic::set_hook(Box::new(move |info| {
        if print_failure(info.payload()).is_none() {
            default_hook(info);
        }
    }));
    let cli = Cli::parse();
    match cli.max_memory.as_deref().map(tumble_limits::parse_size) {
        None => tumble_limits::set_limit(tumble_limits::default_limit()),
        Some(Ok(limit)) => tumble_limits::set_limit(limit),
        Some(Err(e)) => {
            eprintln!("error: --max-memory: {e}");
            return ExitCode::from(2);
        }
    }
    if let Some(text) = cli.timeout.as_deref() {
        if matches!(cli.command, Command::Serve(_)) {
            eprintln!(
                "error: --timeout: a server runs until stopped; bound each request with --timeout-ms"
            );
            return ExitCode::from(2);
        }
        match tumble_limits::parse_duration(text) {
            Ok(limit) => tumble_limits::set_time_limit(limit),
            Err(e) => {
                eprintln!("error: --timeout: {e}");
                return ExitCode::from(2);
            }
        }
    }
    // A server drains on Ctrl-C instead of stopping its runs at the next safe point.
    if !matches!(cli.command, Command::Serve(_)) {
        watch_interrupts();
    }
    let color = match cli.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    };
    // Deeply nested programs are bounded by the parser's nesting limit, but the checker and printer
    // still recurse per level: give them a stack that no accepted program can exhaust.
    let worker = std::thread::Builder::new()
        .name("tumble".into())
        .stack_size(WORK_STACK_BYTES)
        .spawn(move || match cli.command {
            Command::Check {
                files,
                quiet,
                no_prelude,
            } => commands::check(&files, quiet, !no_prelude, color),
            Command::Fmt { file, check } => commands::fmt(&file, check, color),
            Command::Run(args) => run::run(&args, color),
            Command::Serve(args) => serve::serve(&args),
            Command::Grad(args) => train::grad(&args, color),
            Command::Train(args) => train::train(&args, color),
            Command::Explain(args) => explain::explain(&args, color),
            Command::Compile(args) => compiled::compile(&args, color),
            Command::Data(args) => {
                // An output that would replace one of its inputs, refused as every command's is.
                let reads = args.files_read();
                let reads: Vec<(&str, &std::path::Path)> =
                    reads.iter().map(|(w, p)| (*w, p.as_path())).collect();
                let writes: Vec<(&str, &std::path::Path)> = args
                    .output()
                    .map(|o| ("the output (-o)", o))
                    .into_iter()
                    .collect();
                match files::refuse_overwrites(&reads, &writes)
                    .and_then(|()| tumble_data::cli::run(&args))
                {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("error: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Command::Ops => commands::ops(),
            Command::Prelude => {
                print!("{}", tumble_check::PRELUDE);
                ExitCode::SUCCESS
            }
        });
    let outcome = worker.map(|h| h.join());
    if tumble_limits::interrupted() {
        // The command has stopped at a safe point and written nothing; 128 + the signal, as a
        // shell reports a command ended by it.
        let term = TERMINATED
            .get()
            .is_some_and(|t| t.load(std::sync::atomic::Ordering::Relaxed));
        return ExitCode::from(if term { 143 } else { 130 });
    }
    if let (Some(tumble_limits::Stop::TimedOut { .. }), Ok(Ok(code))) =
        (tumble_limits::halt_seen(), &outcome)
    {
        // A safe point saw the time limit pass: the command stopped there and said so.
        if *code != ExitCode::SUCCESS {
            return ExitCode::from(TIMED_OUT_STATUS as u8);
        }
    }
    match outcome {
        Ok(Ok(code)) => code,
        Ok(Err(payload)) => match print_failure(payload.as_ref()) {
            // stdout's reader went away (`tumble run … | head`): the command ends quietly.
            Some(m) if m.contains("Broken pipe") && !m.contains("stderr") => ExitCode::SUCCESS,
            Some(m) => {
                let why = m.split_once(": ").map_or(m, |(_, e)| e);
                // stderr itself may be what failed: best effort.
                let _ = writeln!(std::io::stderr(), "error: cannot write the output: {why}");
                ExitCode::FAILURE
            }
            None => {
                eprintln!("error: tumble crashed; this is a bug, please report it with the input that caused it");
                ExitCode::from(101)
            }
        },
        Err(e) => {
            eprintln!("error: cannot start a worker thread: {e}");
            ExitCode::FAILURE
        }
    }
}
