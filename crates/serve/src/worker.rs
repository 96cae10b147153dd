//! A batch thread: owns a [`Session`] of the model, takes requests from the server's channel,
//! admits their instances by the policy, steps the batch and answers each request when its last
//! instance is done. A server may run several, each taking whole requests (see the crate docs).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use tumble_api::{Error, RawInstances, RunOptions, Session, StopWhen, Ticket};

use crate::{Policy, Shared};

pub(crate) enum Job {
    Predict(Request),
    /// No more requests will come: answer those accepted, then stop.
    Finish,
}

pub(crate) struct Request {
    pub instances: RawInstances,
    pub reply: tokio::sync::oneshot::Sender<Reply>,
    /// Set by the handler when it goes away (the client disconnected, or it timed out): a
    /// running instance of the request stops at its next look at the run limits, even in the
    /// middle of a long step (the reply's closing is only seen between steps).
    pub cancelled: Arc<AtomicBool>,
}

pub(crate) enum Reply {
    /// One JSON text per instance, in order.
    Predictions(Vec<String>),
    Error {
        status: u16,
        message: String,
    },
}

/// A request being worked on.
struct Open {
    instances: RawInstances,
    reply: tokio::sync::oneshot::Sender<Reply>,
    cancelled: Arc<AtomicBool>,
    results: Vec<Option<String>>,
    left: usize,
    tickets: Vec<Ticket>,
    arrived: Instant,
}

/// How long a thread that has just run out of work waits before it lends its kernel threads.
const FIRST_IDLE_SLICE: Duration = Duration::from_millis(2);

/// How long the thread sleeps at most while instances wait (for `static`'s batch to fill), so
/// that requests whose clients went away are noticed.
const POLL: Duration = Duration::from_millis(20);

/// HTTP status and message of a failed instance: a bad instance is the client's (400); one that
/// decodes but cannot be computed (a shape error at run time, the memory budget alone) is 422;
/// one stopped by the memory budget while other requests' instances held memory too is 503 —
/// the same request may well fit once they are done (alone, it is the request's own: 422).
fn failure(e: &Error, others_held_memory: bool) -> (u16, String) {
    match e {
        Error::Input { .. } => (400, e.to_string()),
        _ if others_held_memory && tumble_limits::is_memory_message(e.message()) => (
            503,
            format!("{e}; other requests held memory then: retry once they are done"),
        ),
        _ => (422, e.to_string()),
    }
}

struct Worker<'m> {
    shared: &'m Shared,
    session: Session<'m>,
    open: HashMap<u64, Open>,
    next_id: u64,
    /// Instances not admitted yet, in arrival order: (request, index in it).
    waiting: VecDeque<(u64, usize)>,
    tickets: HashMap<Ticket, (u64, usize)>,
    finishing: bool,
    /// What this thread last added to the shared gauges and counters (see [`Worker::publish`]).
    published: Published,
    /// This thread's kernel threads, lent to the others while it waits for work.
    threads: usize,
    /// Slices of waiting for work in a row (the first [`FIRST_IDLE_SLICE`], then [`POLL`]).
    idle_slices: u32,
    /// Instances of the requests in `open` (what the server's queue depth does not count as in
    /// the channel).
    held: usize,
}

#[derive(Default, Clone, Copy)]
struct Published {
    waiting: u64,
    held: u64,
    in_flight: u64,
    steps: u64,
    launches: u64,
    restarts: u64,
}

/// The channel's receiver; a thread that panicked holding it left nothing half-done in it.
fn lock(jobs: &Mutex<Receiver<Job>>) -> MutexGuard<'_, Receiver<Job>> {
    jobs.lock().unwrap_or_else(|p| p.into_inner())
}

/// The receiver if no other thread holds it (an idle one waiting for work, which should get it).
fn try_lock(jobs: &Mutex<Receiver<Job>>) -> Option<MutexGuard<'_, Receiver<Job>>> {
    match jobs.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

pub(crate) fn run(
    shared: Arc<Shared>,
    jobs: Arc<Mutex<Receiver<Job>>>,
    made: Sender<Result<(), String>>,
    index: usize,
) {
    serve_batches(&shared, &jobs, made, index);
    // The last thread to stop answers what reached the channel after the others had stopped
    // taking (a request that slipped in during shutdown), instead of dropping it unanswered.
    if shared.workers_running.fetch_sub(1, Ordering::SeqCst) == 1 {
        let rx = lock(&jobs);
        while let Ok(job) = rx.try_recv() {
            if let Job::Predict(r) = job {
                shared
                    .outstanding
                    .fetch_sub(r.instances.len(), Ordering::SeqCst);
                let _ = r.reply.send(Reply::Error {
                    status: 503,
                    message: "the server is shutting down".into(),
                });
            }
        }
    }
}

/// Kernel threads of batch thread `index`: an equal share, the first ones taking one more each
/// until the remainder is used.
fn kernel_threads(threads: usize, workers: usize, index: usize) -> usize {
    let workers = workers.max(1);
    (threads / workers + usize::from(index < threads % workers)).max(1)
}

fn serve_batches(
    shared: &Shared,
    jobs: &Mutex<Receiver<Job>>,
    made: Sender<Result<(), String>>,
    index: usize,
) {
    let cfg = &shared.config;
    let mut runtime = tumble_api::RunOptions::default().runtime;
    runtime.phases = cfg.phases;
    runtime.job_memo = cfg.job_memo;
    let threads = kernel_threads(cfg.threads, cfg.workers, index);
    let opts = RunOptions {
        threads: Some(threads),
        seed: cfg.seed,
        runtime,
        ..RunOptions::default()
    };
    let session = match shared.model.session(&opts) {
        Ok(mut s) => {
            if cfg.workers > 1 {
                s.lend_threads(&shared.lending);
            }
            // Partial flushes only help instances join a batch that is running; the other
            // policies run their batch to the end anyway.
            if cfg.policy == Policy::Continuous {
                s.set_levels_per_step(cfg.cell_levels);
            }
            s
        }
        Err(e) => {
            let _ = made.send(Err(e.to_string()));
            return;
        }
    };
    let _ = made.send(Ok(()));
    let mut w = Worker {
        shared,
        session,
        open: HashMap::new(),
        next_id: 0,
        waiting: VecDeque::new(),
        tickets: HashMap::new(),
        finishing: false,
        published: Published::default(),
        threads,
        idle_slices: 0,
        held: 0,
    };
    loop {
        if !w.receive(jobs) {
            break;
        }
        w.drop_abandoned();
        w.admit();
        // Before the step too: the gauges show the batch while it runs.
        w.publish();
        w.step();
        w.publish();
        // (Stopping is `receive`'s: once finishing, it ends the loop when nothing is left here
        // or in the channel.)
    }
    w.unpublish();
}

impl Worker<'_> {
    /// Takes the jobs that arrived, waiting for one when there is nothing to do. False when the
    /// channel is gone and nothing is left.
    fn receive(&mut self, jobs: &Mutex<Receiver<Job>>) -> bool {
        if self.shared.stopping.load(Ordering::SeqCst) {
            self.finishing = true;
        }
        let first = if !self.session.is_idle() {
            None
        } else if self.waiting.is_empty() {
            if self.finishing {
                // Shutdown answers what was accepted: a thread with nothing left takes the next
                // request still in the channel, and stops once it is empty.
                match self.next_accepted(jobs) {
                    Some(j) => Some(j),
                    None => return false,
                }
            } else {
                // Idle: wait holding the receiver, so that a request goes to an idle thread
                // first, in slices (shutdown is seen even when another thread took every
                // wake-up). Its kernel threads go to the others once it has waited a first short
                // slice: under load a thread is idle for moments, and threads lent then
                // oversubscribe the cores when it wakes (TreeLSTM-large near capacity, lending at once: p99
                // 120 ms against 106 without lending, medians of five alternated runs).
                let lend = self.idle_slices > 0;
                let slice = if lend { POLL } else { FIRST_IDLE_SLICE };
                let got = self.idle(lend, || lock(jobs).recv_timeout(slice));
                match got {
                    Ok(j) => {
                        self.idle_slices = 0;
                        Some(j)
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        self.idle_slices += 1;
                        None
                    }
                    Err(RecvTimeoutError::Disconnected) => return false,
                }
            }
        } else {
            let wait = self.admission_wait();
            if wait.is_zero() {
                None
            } else {
                // Waiting for a static batch to fill: never blocked on the receiver's lock, which
                // an idle thread holds slice after slice (the lock is not fair: a lone request
                // waited seconds for its batch's deadline to be seen; a review's find). What
                // arrives meanwhile goes to that idle thread.
                let got = match try_lock(jobs) {
                    Some(rx) => rx.recv_timeout(wait.min(POLL)),
                    None => {
                        std::thread::sleep(wait.min(POLL));
                        Err(RecvTimeoutError::Timeout)
                    }
                };
                match got {
                    Ok(j) => Some(j),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => {
                        self.finishing = true;
                        None
                    }
                }
            }
        };
        if let Some(j) = first {
            self.take(j);
        }
        // More without waiting, while the batch has room for them (the rest stay in the channel
        // for another thread) and no idle thread is waiting on it.
        while self.has_room() {
            let Some(rx) = try_lock(jobs) else { break };
            let Ok(j) = rx.try_recv() else { break };
            drop(rx);
            self.take(j);
        }
        true
    }

    /// Runs `wait` (this thread waiting for work), with its kernel threads lent to the others'
    /// launches when `lend`, taken back after.
    fn idle<T>(&self, lend: bool, wait: impl FnOnce() -> T) -> T {
        let lend = lend && self.shared.config.workers > 1;
        let lending = &self.shared.lending;
        if lend {
            lending.lend(self.threads);
        }
        let r = wait();
        if lend {
            lending.reclaim(self.threads);
        }
        r
    }

    /// The next request left in the channel during shutdown (`None`: it is empty); the other
    /// threads' wake-ups are passed over.
    fn next_accepted(&self, jobs: &Mutex<Receiver<Job>>) -> Option<Job> {
        let rx = lock(jobs);
        loop {
            match rx.try_recv() {
                Ok(Job::Finish) => continue,
                Ok(j) => return Some(j),
                Err(_) => return None,
            }
        }
    }

    /// Whether this thread takes more requests now: fewer instances waiting or in its batch
    /// than the batch holds (`single`: than one).
    fn has_room(&self) -> bool {
        let cfg = &self.shared.config;
        let cap = match cfg.policy {
            Policy::Single => 1,
            _ => cfg.max_batch,
        };
        self.waiting.len() + self.session.in_flight() + self.session.queued() < cap
    }

    /// While idle with instances waiting: how long before the policy admits them.
    fn admission_wait(&self) -> Duration {
        let cfg = &self.shared.config;
        if cfg.policy != Policy::Static || self.finishing || self.waiting.len() >= cfg.max_batch {
            return Duration::ZERO;
        }
        let oldest = self
            .waiting
            .front()
            .and_then(|(r, _)| self.open.get(r))
            .map(|o| o.arrived);
        match oldest {
            Some(t) => cfg.max_wait.saturating_sub(t.elapsed()),
            None => Duration::ZERO,
        }
    }

    fn take(&mut self, job: Job) {
        match job {
            Job::Finish => self.finishing = true,
            Job::Predict(r) => {
                let id = self.next_id;
                self.next_id += 1;
                let n = r.instances.len();
                self.held += n;
                self.waiting.extend((0..n).map(|i| (id, i)));
                self.open.insert(
                    id,
                    Open {
                        instances: r.instances,
                        reply: r.reply,
                        cancelled: r.cancelled,
                        results: vec![None; n],
                        left: n,
                        tickets: Vec::new(),
                        arrived: Instant::now(),
                    },
                );
            }
        }
    }

    /// Requests whose handler is gone (client disconnected, or timed out and answered 504) are
    /// dropped with their instances.
    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, o)| o.reply.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.abandon(id);
        }
    }

    /// Drops request `id`, whose handler is gone, counting its unfinished instances as cancelled.
    fn abandon(&mut self, id: u64) {
        if let Some(o) = self.close(id) {
            self.shared
                .metrics
                .instances_cancelled
                .fetch_add(o.left as u64, Ordering::Relaxed);
        }
    }

    /// Removes request `id` and everything of it still waiting or in the batch.
    fn close(&mut self, id: u64) -> Option<Open> {
        let o = self.open.remove(&id)?;
        self.held -= o.results.len();
        self.waiting.retain(|(r, _)| *r != id);
        for t in &o.tickets {
            if self.tickets.remove(t).is_some() {
                self.session.cancel(*t);
            }
        }
        self.shared
            .outstanding
            .fetch_sub(o.results.len(), Ordering::SeqCst);
        Some(o)
    }

    fn fail(&mut self, id: u64, status: u16, message: String) {
        if let Some(o) = self.close(id) {
            self.shared
                .metrics
                .instances_failed
                .fetch_add(1, Ordering::Relaxed);
            let _ = o.reply.send(Reply::Error { status, message });
        }
    }

    /// Moves waiting instances into the batch as the policy says.
    fn admit(&mut self) {
        let cfg = &self.shared.config;
        let room = match cfg.policy {
            Policy::Continuous => {
                if !self.session.accepting() {
                    return;
                }
                cfg.max_batch
                    .saturating_sub(self.session.in_flight() + self.session.queued())
            }
            Policy::Static => {
                if !self.session.is_idle() || !self.admission_wait().is_zero() {
                    return;
                }
                cfg.max_batch
            }
            Policy::Single => {
                if !self.session.is_idle() {
                    return;
                }
                1
            }
        };
        let mut admitted = 0;
        while admitted < room {
            let Some((id, i)) = self.waiting.pop_front() else {
                break;
            };
            let Some(o) = self.open.get(&id) else {
                continue;
            };
            // Past the request's timeout its handler has answered 504; an instance still running
            // then (one that never suspends) stops, instead of holding this thread for good.
            let stop = StopWhen {
                deadline: o.arrived.checked_add(self.shared.config.timeout),
                cancelled: Some(o.cancelled.clone()),
            };
            match self.session.admit_until(&o.instances, i, stop) {
                Ok(t) => {
                    self.tickets.insert(t, (id, i));
                    if let Some(o) = self.open.get_mut(&id) {
                        o.tickets.push(t);
                    }
                    admitted += 1;
                }
                Err(e) => {
                    let (status, message) = failure(&e, self.open.len() > 1);
                    self.fail(id, status, message)
                }
            }
        }
    }

    fn step(&mut self) {
        if self.session.is_idle() {
            return;
        }
        let size = self.session.in_flight() + self.session.queued();
        let finished = self.session.step();
        self.shared.metrics.batch(size);
        for (t, result) in finished {
            let Some((id, i)) = self.tickets.remove(&t) else {
                continue;
            };
            match result {
                Ok(json) => {
                    self.shared
                        .metrics
                        .instances_done
                        .fetch_add(1, Ordering::Relaxed);
                    let complete = match self.open.get_mut(&id) {
                        Some(o) => {
                            if let Some(slot) = o.results.get_mut(i) {
                                if slot.replace(json).is_none() {
                                    o.left -= 1;
                                }
                            }
                            o.left == 0
                        }
                        None => false,
                    };
                    if complete {
                        if let Some(o) = self.close(id) {
                            let out = o.results.into_iter().map(Option::unwrap_or_default);
                            let _ = o.reply.send(Reply::Predictions(out.collect()));
                        }
                    }
                }
                Err(_) if self.open.get(&id).is_some_and(|o| o.reply.is_closed()) => {
                    // Stopped because its handler went away (the client disconnected).
                    self.abandon(id);
                }
                Err(e) => {
                    let timeout = self.shared.config.timeout;
                    let late = self
                        .open
                        .get(&id)
                        .is_some_and(|o| o.arrived.elapsed() >= timeout);
                    if late {
                        // Stopped at its deadline: the timeout's answer, whichever got there first.
                        self.fail(
                            id,
                            504,
                            format!(
                                "no answer within {} ms (--timeout-ms): {e}",
                                timeout.as_millis()
                            ),
                        );
                    } else {
                        let own = self.open.get(&id).map_or(0, |o| o.instances.len());
                        let (status, message) = failure(&e, size > own);
                        self.fail(id, status, message);
                    }
                }
            }
        }
    }

    /// Adds what changed since the last call to the server's gauges and counters (each thread
    /// adds its own share: the sums are the server's).
    fn publish(&mut self) {
        let s = self.session.stats();
        let now = Published {
            waiting: self.waiting.len() as u64,
            held: self.held as u64,
            in_flight: (self.session.in_flight() + self.session.queued()) as u64,
            steps: s.steps,
            launches: s.launches,
            restarts: s.restarts,
        };
        self.add(now);
    }

    /// Takes this thread's share out of the gauges when it stops (its counters stay).
    fn unpublish(&mut self) {
        let now = Published {
            waiting: 0,
            held: 0,
            in_flight: 0,
            ..self.published
        };
        self.add(now);
    }

    fn add(&mut self, now: Published) {
        let m = &self.shared.metrics;
        let was = self.published;
        // Wrapping: a gauge that fell adds the two's complement of the fall.
        let delta = |a: &std::sync::atomic::AtomicU64, new: u64, old: u64| {
            if new != old {
                a.fetch_add(new.wrapping_sub(old), Ordering::Relaxed);
            }
        };
        delta(&m.waiting, now.waiting, was.waiting);
        delta(&m.held, now.held, was.held);
        delta(&m.in_flight, now.in_flight, was.in_flight);
        delta(&m.steps, now.steps, was.steps);
        delta(&m.launches, now.launches, was.launches);
        delta(&m.restarts, now.restarts, was.restarts);
        self.published = now;
    }
}

#[cfg(test)]
mod tests {
    use super::{failure, kernel_threads, Error};

    #[test]
    fn kernel_threads_are_shared_out_whole() {
        assert_eq!(
            (0..2).map(|k| kernel_threads(3, 2, k)).collect::<Vec<_>>(),
            [2, 1]
        );
        assert_eq!(
            (0..2).map(|k| kernel_threads(4, 2, k)).collect::<Vec<_>>(),
            [2, 2]
        );
        assert_eq!(
            (0..3).map(|k| kernel_threads(2, 3, k)).collect::<Vec<_>>(),
            [1, 1, 1]
        );
    }

    /// The memory budget is the request's own fault only when it ran alone; with other requests
    /// holding memory the client is told to retry (503), and decoding errors stay 400.
    #[test]
    fn memory_failures_beside_other_requests_are_retryable() {
        let memory = Error::Run {
            instance: 0,
            message: format!(
                "instance at index 0: {}",
                tumble_limits::Stop::Memory {
                    in_use: 3 << 30,
                    more: 1 << 20,
                    limit: 1 << 30
                }
            ),
        };
        assert_eq!(failure(&memory, false).0, 422);
        let (status, message) = failure(&memory, true);
        assert_eq!(status, 503);
        assert!(message.contains("retry"), "{message}");
        let shape = Error::Run {
            instance: 0,
            message: "instance at index 0: shapes (2, 3) and (4) do not broadcast".into(),
        };
        assert_eq!(failure(&shape, true).0, 422);
        let input = Error::Input {
            instance: 1,
            message: "instance at index 1: expected a number".into(),
        };
        assert_eq!(failure(&input, true).0, 400);
    }
}
