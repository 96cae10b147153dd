//! The batch thread: owns the model's [`Session`], admits waiting instances by the policy, steps
//! the batch and answers each request when its last instance is done.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
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

/// How long the thread sleeps at most while instances wait (for `static`'s batch to fill), so
/// that requests whose clients went away are noticed.
const POLL: Duration = Duration::from_millis(20);

/// HTTP status of a failed instance: a bad instance is the client's (400); one that decodes but
/// cannot be computed (a shape error at run time, the memory budget) is 422.
fn status_of(e: &Error) -> u16 {
    match e {
        Error::Input { .. } => 400,
        _ => 422,
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
}

pub(crate) fn run(shared: Arc<Shared>, jobs: Receiver<Job>, made: Sender<Result<(), String>>) {
    let cfg = &shared.config;
    let mut runtime = tumble_api::RunOptions::default().runtime;
    runtime.phases = cfg.phases;
    runtime.job_memo = cfg.job_memo;
    let opts = RunOptions {
        threads: Some(cfg.threads),
        seed: cfg.seed,
        runtime,
        ..RunOptions::default()
    };
    let session = match shared.model.session(&opts) {
        Ok(mut s) => {
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
        shared: &shared,
        session,
        open: HashMap::new(),
        next_id: 0,
        waiting: VecDeque::new(),
        tickets: HashMap::new(),
        finishing: false,
    };
    loop {
        if !w.receive(&jobs) {
            break;
        }
        w.drop_abandoned();
        w.admit();
        w.step();
        w.publish();
        if w.finishing && w.open.is_empty() && w.session.is_idle() {
            break;
        }
    }
}

impl Worker<'_> {
    /// Takes the jobs that arrived, waiting for one when there is nothing to do. False when the
    /// channel is gone and nothing is left.
    fn receive(&mut self, jobs: &Receiver<Job>) -> bool {
        let first = if !self.session.is_idle() {
            None
        } else if self.waiting.is_empty() {
            if self.finishing {
                return false;
            }
            match jobs.recv() {
                Ok(j) => Some(j),
                Err(_) => return false,
            }
        } else {
            let wait = self.admission_wait();
            if wait.is_zero() {
                None
            } else {
                match jobs.recv_timeout(wait.min(POLL)) {
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
        while let Ok(j) = jobs.try_recv() {
            self.take(j);
        }
        true
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
                Err(e) => self.fail(id, status_of(&e), e.to_string()),
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
                        self.fail(id, status_of(&e), e.to_string());
                    }
                }
            }
        }
    }

    fn publish(&self) {
        let m = &self.shared.metrics;
        let s = self.session.stats();
        m.queue_depth
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        m.in_flight.store(
            (self.session.in_flight() + self.session.queued()) as u64,
            Ordering::Relaxed,
        );
        m.steps.store(s.steps, Ordering::Relaxed);
        m.launches.store(s.launches, Ordering::Relaxed);
        m.restarts.store(s.restarts, Ordering::Relaxed);
    }
}
