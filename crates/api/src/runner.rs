//! Run threads kept between calls: a library face (Python) runs each job on a thread with the
//! CLI's big stack, and a thread kept alive keeps what the runtime caches per thread — its
//! recycled activation buffers and GEMM scratch — so a second call does not page-fault them in
//! again. A fresh thread per call cost TreeLSTM-small b64 about 2 ms of its ~60 ms in kernels
//! (bench/RESULTS.md, "Python package").

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, sync_channel, RecvTimeoutError, Sender};
use std::sync::Mutex;

use crate::{Error, WORK_STACK_BYTES};

type Job = Box<dyn FnOnce() + Send>;

/// Idle run threads, each waiting on its job channel, with the process they were started in.
/// Concurrent calls take one each (or start one), so they run in parallel as before.
static IDLE: Mutex<Idle> = Mutex::new(Idle {
    pid: 0,
    threads: Vec::new(),
});

struct Idle {
    pid: u32,
    threads: Vec<Sender<Job>>,
}

impl Idle {
    /// The idle threads of this process. A child made by `fork` (Python's multiprocessing, a
    /// preloading server) inherits the list but not the threads: a job sent to one waited
    /// forever. The child drops the list (its copy of the channels) and starts its own threads.
    fn here(&mut self) -> &mut Vec<Sender<Job>> {
        let pid = std::process::id();
        if self.pid != pid {
            self.threads.clear();
            self.pid = pid;
        }
        &mut self.threads
    }
}

/// Threads kept idle at most; more (after a burst of concurrent calls) end.
const MAX_IDLE: usize = 8;

fn start_thread() -> Result<Sender<Job>, Error> {
    let (tx, rx) = channel::<Job>();
    std::thread::Builder::new()
        .name("tumble-run".into())
        .stack_size(WORK_STACK_BYTES)
        .spawn(move || {
            // Ends when its sender is dropped.
            for job in rx {
                job();
            }
        })
        .map_err(|e| Error::Usage {
            message: format!("cannot start a thread for the run: {e}"),
        })?;
    Ok(tx)
}

/// A caught panic as an error (the message it carried, if any).
pub(crate) fn panic_error(p: Box<dyn std::any::Any + Send>) -> Error {
    let what = p
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    Error::Run {
        instance: 0,
        message: format!("internal error (please report it): {what}"),
    }
}

/// Runs `f` on a kept run thread with [`WORK_STACK_BYTES`] of stack and waits for it (see the
/// module docs). A panic in `f` comes back as an error, and the thread stays usable.
pub fn on_run_thread<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    on_run_thread_watched(f, tumble_limits::RunStop::new(None), || false)
}

/// How often [`on_run_thread_watched`] asks its caller whether to stop the run.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// [`on_run_thread`] under `run` (the call's own stop: its deadline, if any, stops it at a safe
/// point past it), asking `stop` every 50 ms while it waits (Python's pending Ctrl-C). Once
/// `stop` says yes, `run` is cancelled: this call's computation stops at its next safe point —
/// other calls running in the process go on, as Python raises `KeyboardInterrupt` in one
/// thread — and the call returns.
pub fn on_run_thread_watched<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
    run: tumble_limits::RunStop,
    mut stop: impl FnMut() -> bool,
) -> Result<T, Error> {
    let (done_tx, done_rx) = sync_channel(1);
    let cancel = run.clone();
    let job: Job = Box::new(move || {
        let r = tumble_limits::with_run_stop(Some(run), || catch_unwind(AssertUnwindSafe(f)));
        let _ = done_tx.send(r);
    });
    let kept = IDLE.lock().unwrap_or_else(|p| p.into_inner()).here().pop();
    let thread = match kept {
        Some(t) => t,
        None => start_thread()?,
    };
    // A kept thread cannot have ended (it only ends when its sender drops), so the send
    // succeeds; were it refused, the job comes back and runs on a fresh thread.
    let thread = match thread.send(job) {
        Ok(()) => thread,
        Err(refused) => {
            let fresh = start_thread()?;
            fresh.send(refused.0).map_err(|_| Error::Usage {
                message: "cannot hand the run to its thread".into(),
            })?;
            fresh
        }
    };
    let mut interrupted = false;
    let result = loop {
        match done_rx.recv_timeout(WATCH_EVERY) {
            Ok(r) => break r,
            Err(RecvTimeoutError::Timeout) => {
                if !interrupted && stop() {
                    interrupted = true;
                    cancel.cancel();
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Error::Usage {
                    message: "the run's thread ended without a result".into(),
                });
            }
        }
    };
    let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
    let threads = idle.here();
    if threads.len() < MAX_IDLE {
        threads.push(thread);
    }
    drop(idle);
    result.map_err(panic_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_thread_is_reused_and_survives_a_panic() {
        let id = || std::thread::current().id();
        let first = on_run_thread(id).unwrap();
        let e = on_run_thread(|| -> u32 { panic!("boom") }).unwrap_err();
        assert!(e.to_string().contains("boom"), "{e}");
        // Another test running at the same time may take the idle thread now and then, but five
        // calls in a row cannot all have started threads of their own.
        let mut ids = std::collections::HashSet::new();
        ids.insert(first);
        for _ in 0..4 {
            ids.insert(on_run_thread(id).unwrap());
        }
        assert!(ids.len() < 5, "no run thread was kept: {ids:?}");
        assert!(!ids.contains(&std::thread::current().id()));
    }

    #[test]
    fn the_run_thread_has_a_big_stack() {
        fn depth(n: u64) -> u64 {
            let pad = [n; 64];
            if n == 0 {
                0
            } else {
                std::hint::black_box(pad)[0] - n + 1 + depth(n - 1)
            }
        }
        // ~600 bytes a frame x 100k frames: far past a default 8 MiB stack.
        assert_eq!(on_run_thread(|| depth(100_000)).unwrap(), 100_000);
    }
}
