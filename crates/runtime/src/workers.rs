//! Mini-batches in parallel: a job of many instances is cut into mini-batches of `batch`, and
//! `workers` threads take them in turn, each running its mini-batch with `threads / workers` kernel
//! threads. A mini-batch is still the unit of batching (the same launches as when run alone); what
//! runs concurrently is the host side of one mini-batch (executors, graph building, scheduling)
//! with the kernels of another, and small launches on whole cores instead of split across them.
//!
//! Why: measured on TreeLSTM-large (512 SST trees, batch 64, 2 vCPUs), a mini-batch's launches
//! have 50–300 rows, which two threads split at ~1.2× of one, and its ~30% host time is serial;
//! two single-threaded processes on halves of the file finished in 0.79–0.87 s where one process
//! with two kernel threads took 1.23–1.37 s.
//!
//! Results do not depend on the number of workers: each mini-batch gives the same bits whatever
//! its kernel thread count, and results and errors are reported in instance order (the error of
//! the first failing instance, as a serial run would stop at).
//!
//! Values are reference counted per thread (`Rc`), so a worker builds its instances' arguments
//! itself (`load`) and turns results into something it can hand back (`finish`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tumble_compile::Program;
use tumble_interp::{RunError, Value};
use tumble_tensor::Rng;

use crate::{run_batch_lent, Executable, InstanceError, Options, Profile, Reuse};

/// Instances per mini-batch where the caller gives no size. Past ~128 instances a launch's GEMM
/// has rows enough to run at the tile's peak, and a larger mini-batch only grows the instances'
/// states, the graph and the activations past the caches: 1,024 instances at one thread in
/// mini-batches of 128 against 512 (warm, ms): BiRNN-large 387 / 451, StackRNN-small 362 / 410,
/// MV-RNN-small 354 / 378, TreeLSTM-small 269 / 286, MV-RNN-large 1,983 / 2,058; none faster at
/// 512 (one-token sentences: 66 / 73). The host program's time per step doubles at 512
/// (StackRNN-small: 65 → 125 ms over the same steps). `tumble grad` uses it too.
pub const DEFAULT_BATCH: usize = 128;

/// The fewest instances a mini-batch gets when a job is split to give every worker one: below
/// it, launches are narrow enough that splitting them costs more than the second worker's host
/// program gains (and block merging stops paying).
pub const SPLIT_MIN_BATCH: usize = tumble_compile::merge::MERGE_MIN_BATCH;

/// The mini-batch size of a job of `instances` instances on `workers` workers where the caller
/// gives none: the job in equal mini-batches of at most [`DEFAULT_BATCH`] and, with `split`, as
/// many as a whole number per worker where each gets at least [`SPLIT_MIN_BATCH`] instances. One
/// mini-batch leaves every worker but one idle, and small models' launches are too narrow to
/// split across threads: 64 sentences of NestedRNN-small at two threads took 33 ms as one
/// mini-batch and 20 ms as two side by side, MV-RNN-large's 64 trees 186 and 68 ms.
pub fn default_batch(instances: usize, workers: usize, split: bool) -> usize {
    let n = instances.max(1);
    let mut count = n.div_ceil(DEFAULT_BATCH);
    if split && workers > 1 && n >= workers.saturating_mul(SPLIT_MIN_BATCH) {
        count = count.div_ceil(workers) * workers;
    }
    n.div_ceil(count).max(1)
}

/// A job of `instances` instances run as mini-batches of `batch` on `workers` threads.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    pub program: &'a Program,
    pub reuse: &'a Reuse,
    pub entry: &'a str,
    /// `opts.threads` is the job's whole thread budget, shared among the workers.
    pub opts: Options,
    pub instances: usize,
    pub batch: usize,
    /// At most this many mini-batches at once (1: one after another, each with every thread).
    pub workers: usize,
    /// The program planned for these options ([`Executable::new`]); `None`: planned once for
    /// this job. Give one to share plans, compiled row programs and packed weights across jobs
    /// of the same program (`tumble run --repeat`, a loaded model).
    pub exec: Option<&'a Arc<Executable>>,
    /// Stack of each worker thread besides the calling one, which is a worker too: give it the
    /// caller's, so that `load`, `finish` and the run recurse as deep on every worker.
    pub worker_stack: usize,
}

impl Job<'_> {
    /// Workers actually used: no more than the mini-batches or the threads.
    pub fn worker_count(&self) -> usize {
        let batches = self.instances.div_ceil(self.batch.max(1));
        self.workers.min(batches).min(self.opts.threads).max(1)
    }
}

/// Why a job stopped: an instance's own failure (from `load`, a run, or `finish`).
pub enum JobError<E> {
    /// `load` or `finish` of this instance failed.
    Instance(usize, E),
    /// Running the mini-batch failed; `instance` is the job-wide index (the mini-batch's first
    /// instance when the failure is not attributable to one).
    Run { instance: usize, error: RunError },
}

impl<E> JobError<E> {
    fn instance(&self) -> usize {
        match self {
            JobError::Instance(i, _) => *i,
            JobError::Run { instance, .. } => *instance,
        }
    }
}

type Chunk<T> = (usize, Vec<T>, Profile);

/// Threads that workers out of work lend to the launches of the workers still running. Each
/// running worker may add an equal share of them, so the job never uses more threads than its
/// budget. A job's workers lend for good once out of mini-batches; a server's batch threads lend
/// while idle and take their threads back when a request comes ([`Lending::lend`],
/// [`Lending::reclaim`]; [`crate::session::BatchSession::lend_threads`]).
pub struct Lending {
    lent: AtomicUsize,
    running: AtomicUsize,
}

impl Lending {
    /// `workers` workers, all running, none lending.
    pub fn new(workers: usize) -> Lending {
        Lending {
            lent: AtomicUsize::new(0),
            running: AtomicUsize::new(workers),
        }
    }

    /// A running worker goes idle (or, in a job, runs out of mini-batches for good): its
    /// `threads` go to the others until it [reclaims](Lending::reclaim) them.
    pub fn lend(&self, threads: usize) {
        // Lent first, then one fewer running: a share read in between is the smaller one.
        self.lent.fetch_add(threads, Ordering::Relaxed);
        let _ = self
            .running
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1));
    }

    /// An idle worker that lent `threads` runs again: one more running first, then the threads
    /// taken back, so a share read in between is the smaller one. (A launch of another worker
    /// already under way keeps the threads it started with until it ends.)
    pub fn reclaim(&self, threads: usize) {
        self.running.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .lent
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some(l.saturating_sub(threads))
            });
    }

    /// Threads one running worker's launch may add to its own now.
    pub fn share(&self) -> usize {
        self.lent.load(Ordering::Relaxed) / self.running.load(Ordering::Relaxed).max(1)
    }
}

/// Instances between two safe points of a job's decoding, driving and encoding loops: a job of
/// many small instances (thousands of 7-step programs) never reached the evaluator's own, so a
/// call's timeout or Ctrl-C waited for the whole job.
pub(crate) const SAFE_POINT_EVERY: usize = 64;

/// Polls the run's limits ([`tumble_limits::poll`]) at the `k`-th instance of a loop, every
/// [`SAFE_POINT_EVERY`] from the first.
pub(crate) fn safe_point(k: usize) -> Result<(), RunError> {
    if k % SAFE_POINT_EVERY != 0 {
        return Ok(());
    }
    tumble_limits::poll().map_err(|stop| tumble_interp::machine::limit_error(stop, Vec::new(), ""))
}

/// [`safe_point`] in a job's loop, at job-wide instance `i`.
fn job_safe_point<E>(k: usize, i: usize) -> Result<(), JobError<E>> {
    safe_point(k).map_err(|error| JobError::Run { instance: i, error })
}

/// Runs the job: instance `i` gets the arguments `load(i)` and the random stream `rng(i)`, and its
/// result goes through `finish(i, value)`. Returns the finished results in instance order and the
/// profile of every mini-batch merged (`workers`, `threads` and the wall time set).
pub fn run_batches<T, E, L, R, F>(
    job: &Job,
    load: L,
    rng: R,
    finish: F,
) -> Result<(Vec<T>, Profile), JobError<E>>
where
    T: Send,
    E: Send,
    L: Fn(usize) -> Result<Vec<Value>, E> + Sync,
    R: Fn(usize) -> Rng + Sync,
    F: Fn(usize, Value) -> Result<T, E> + Sync,
{
    let t0 = Instant::now();
    let batch = job.batch.max(1);
    let chunks = job.instances.div_ceil(batch);
    let workers = job.worker_count();
    let mut opts = job.opts;
    opts.threads = (job.opts.threads / workers).max(1);
    // A worker that runs out of mini-batches lends its threads to the launches of those still
    // running, so the job's last mini-batch does not leave cores idle.
    let lending = Lending::new(workers);
    let planned;
    let exec = match job.exec {
        Some(e) => e,
        None => {
            planned = Arc::new(Executable::new(job.program, job.reuse, &job.opts));
            &planned
        }
    };
    let one = |c: usize| -> Result<Chunk<T>, JobError<E>> {
        let first = c * batch;
        let end = (first + batch).min(job.instances);
        let t_load = Instant::now();
        let mut args = Vec::with_capacity(end - first);
        for i in first..end {
            job_safe_point(i - first, i)?;
            args.push(load(i).map_err(|e| JobError::Instance(i, e))?);
        }
        let t_load = t_load.elapsed();
        // The decoded instances outlive the run and are freed after it, with the decoding's
        // time: the run then only drops its references (an instance's tree or list is freed
        // node by node, ~2.5% of TreeLSTM-small's run), as the peers keep their decoded inputs
        // outside their timed region.
        let inputs = args.clone();
        let rngs = (first..end).map(&rng).collect();
        let lent = (workers > 1 && opts.lend_threads).then_some(&lending);
        let (values, mut profile) = run_batch_lent(
            job.program,
            job.reuse,
            exec,
            job.entry,
            args,
            rngs,
            opts,
            lent,
            None,
        )
        .map_err(|InstanceError { instance, error }| JobError::Run {
            instance: first + instance.unwrap_or(0),
            error,
        })?;
        let t_finish = Instant::now();
        let mut out = Vec::with_capacity(values.len());
        for (k, v) in values.into_iter().enumerate() {
            job_safe_point(k, first + k)?;
            out.push(finish(first + k, v).map_err(|e| JobError::Instance(first + k, e))?);
        }
        profile.time_encode += t_finish.elapsed();
        let t_free = Instant::now();
        drop(inputs);
        profile.time_decode += t_load + t_free.elapsed();
        Ok((first, out, profile))
    };
    let done: Vec<Result<Chunk<T>, JobError<E>>> = if workers == 1 {
        let mut done = Vec::with_capacity(chunks);
        for c in 0..chunks {
            let r = one(c);
            let failed = r.is_err();
            done.push(r);
            if failed {
                break;
            }
        }
        done
    } else {
        let next = AtomicUsize::new(0);
        // The first failure stops new mini-batches from starting; ones already running finish
        // (an earlier one may fail too, and the earliest failure is the one reported).
        let failed = AtomicBool::new(false);
        let done = Mutex::new(Vec::with_capacity(chunks));
        let work = || loop {
            if failed.load(Ordering::Relaxed) {
                break;
            }
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= chunks {
                lending.lend(opts.threads);
                break;
            }
            let r = one(c);
            if r.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            done.lock().unwrap_or_else(|p| p.into_inner()).push(r);
        };
        // Workers stop with the calling thread's run (a library call's timeout or Ctrl-C).
        let stop = tumble_limits::run_stop();
        std::thread::scope(|s| {
            for _ in 1..workers {
                // A worker that cannot start leaves its mini-batches to the others (the calling
                // thread always takes part), so the job still completes.
                let stop = stop.clone();
                let _ = std::thread::Builder::new()
                    .name("tumble-worker".into())
                    .stack_size(job.worker_stack)
                    .spawn_scoped(s, move || tumble_limits::with_run_stop(stop, work));
            }
            work();
        });
        done.into_inner().unwrap_or_else(|p| p.into_inner())
    };
    let mut ok = Vec::with_capacity(done.len());
    let mut first_err: Option<JobError<E>> = None;
    for r in done {
        match r {
            Ok(c) => ok.push(c),
            Err(e) => {
                if first_err
                    .as_ref()
                    .is_none_or(|f| e.instance() < f.instance())
                {
                    first_err = Some(e);
                }
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    ok.sort_by_key(|c| c.0);
    let mut profile = Profile::default();
    let mut results = Vec::with_capacity(job.instances);
    for (_, out, p) in ok {
        profile.add(&p);
        results.extend(out);
    }
    profile.workers = workers as u64;
    profile.kernel_threads = opts.threads as u64;
    profile.time_wall = t0.elapsed();
    Ok((results, profile))
}

#[cfg(test)]
mod tests {
    use super::{default_batch, Lending};

    #[test]
    fn default_batches_are_equal_and_a_whole_number_per_worker() {
        // (instances, workers, split) → size
        for (n, w, split, size) in [
            (0, 1, true, 1),
            (1, 2, true, 1),
            (63, 2, true, 63),
            (64, 2, true, 32),
            (64, 2, false, 64),
            (64, 3, true, 64),
            (600, 1, true, 120),
            (600, 2, true, 100),
            (1100, 1, true, 123),
            (1100, 2, true, 110),
            (100_000, usize::MAX, true, 128),
        ] {
            assert_eq!(
                default_batch(n, w, split),
                size,
                "{n} on {w}, split {split}"
            );
        }
    }

    #[test]
    fn idle_threads_are_lent_and_taken_back() {
        // Two batch threads of one kernel thread: while one is idle the other runs on two.
        let two = Lending::new(2);
        two.lend(1);
        assert_eq!(two.share(), 1);
        two.reclaim(1);
        assert_eq!(two.share(), 0);
        // Both idle, then one busy again: it gets the other's thread, not its own twice.
        two.lend(1);
        two.lend(1);
        two.reclaim(1);
        assert_eq!(two.share(), 1);
        two.reclaim(1);
        assert_eq!(two.share(), 0);
    }

    #[test]
    fn lent_threads_are_shared_within_the_budget() {
        // Two workers of one thread each: the one left running gets the other's thread.
        let two = Lending::new(2);
        assert_eq!(two.share(), 0);
        two.lend(1);
        assert_eq!(two.share(), 1);
        // Three workers of one thread: one thread lent to two running workers is not handed to
        // both (that would be four threads on a budget of three); two lent to the last one are.
        let three = Lending::new(3);
        three.lend(1);
        assert_eq!(three.share(), 0);
        three.lend(1);
        assert_eq!(three.share(), 2);
        // Two workers of two threads, one retired: its two threads go to the other.
        let wide = Lending::new(2);
        wide.lend(2);
        assert_eq!(wide.share(), 2);
    }
}
