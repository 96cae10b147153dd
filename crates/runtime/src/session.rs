//! Continuous (cellular) batching: a long-lived mini-batch that instances join and leave between
//! flushes (BatchMaker, Gao et al., EuroSys 2018).
//!
//! [`crate::run_batch`] starts every machine at once and returns when the last one is done; a
//! server using it makes every request wait for the slowest instance of its batch. A
//! [`BatchSession`] keeps the machines and their dataflow graph between calls instead: each
//! [`BatchSession::step`] runs the machines in flight to their next suspension, flushes the graph
//! once, and hands back the instances that finished, results materialized. Instances admitted in
//! the meantime join at the next step, so a flush is the "cell" boundary of cellular batching.
//!
//! - **Cells.** By default a step flushes every pending node, so an instance that never waits
//!   on a value (TreeLSTM: the tree's shape is known up front) runs whole in one step. With
//!   [`BatchSession::levels_per_step`] a step launches only that many depth levels, and an
//!   instance admitted meanwhile starts at the depth the graph has reached: its leaves launch
//!   with the running trees' next level, and a small tree leaves while a deep one still runs.
//! - **Graph growth.** Nodes (and the tensors they computed) are freed only with the whole graph,
//!   so a session starts a fresh [`Dfg`] whenever nothing is in flight, and stops letting
//!   admitted instances join once the graph holds [`BatchSession::max_nodes`] nodes until the
//!   ones in flight drain.
//! - **Phases.** An instance at a `db.phase_change()` (with [`Options::phases`]) waits for the
//!   flush that computes what its earlier phase recorded and resumes, at inline depth 0, in the
//!   next step, together with whatever else reached a boundary or joined then. It does not wait
//!   for every instance in flight: in a session new ones keep arriving, and waiting for all of
//!   them could starve it.
//! - **Failures.** An instance whose machine fails is answered with its error. A flush that fails
//!   names the instance whose invocation failed ([`Dfg::failed_instance`]); that one is answered
//!   with the error and every other instance in flight is restarted from its arguments and
//!   random stream in a fresh graph (their results do not depend on what they were batched
//!   with), so one bad instance never fails the others.

use std::collections::VecDeque;
use std::sync::Arc;

use tumble_compile::Program;
use tumble_interp::{InstanceCtx, LazyRef, Machine, Outcome, RunError, StopWhen, Value};
use tumble_tensor::Rng;

use crate::dfg::Dfg;
use crate::{materialize, Executable, Options, Reuse};

/// Names an admitted instance in [`BatchSession::step`]'s results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// What a session has done so far (for metrics).
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionStats {
    /// Steps that ran at least one instance.
    pub steps: u64,
    /// Batched launches, over every graph the session has used.
    pub launches: u64,
    /// Fresh graphs started (the first one included).
    pub graphs: u64,
    /// Flushes that failed, each restarting the instances in flight but the failing one.
    pub restarts: u64,
    /// Flushes stopped between launches for one instance (its request timed out or its client
    /// left): that one was answered, the others went on without restarting.
    pub stops_survived: u64,
    /// Instances that ran in a step, summed over steps (÷ `steps`: the mean batch).
    pub instance_steps: u64,
}

enum State<'p> {
    /// Admitted, to join at the next step (or restarted after a failed flush).
    Queued,
    Running(Machine<'p>),
    Blocked(Machine<'p>),
    Parked(Machine<'p>),
    /// Finished; its lazy tensors are computed by the next flush (or, after a flush of a few
    /// levels, by a later one: the second field lists those not computed yet, once looked for).
    Done(Value, Option<Vec<LazyRef>>),
}

struct Slot<'p> {
    ticket: Ticket,
    /// Kept to restart the instance in a fresh graph after a failed flush (values are `Rc`, so
    /// this costs no copy).
    args: Vec<Value>,
    rng: Rng,
    /// The instance number its machine reports to the graph (`InstanceCtx::instance`).
    instance: u32,
    /// When it is no longer wanted (see [`BatchSession::admit_until`]).
    stop: StopWhen,
    state: State<'p>,
}

/// The result of one admitted instance.
pub type Finished = (Ticket, Result<Value, RunError>);

/// A mini-batch that instances join and leave between flushes (see the module docs).
pub struct BatchSession<'p> {
    program: &'p Program,
    reuse: &'p Reuse,
    entry: u32,
    opts: Options,
    /// Graph size from which admitted instances wait for those in flight to drain.
    pub max_nodes: usize,
    /// Depth levels launched per step (see [`Dfg::flush_levels`]); `None`: every pending node
    /// (a step then lasts until each instance in flight finishes or blocks on a value).
    pub levels_per_step: Option<usize>,
    /// How long an instance's machine runs in one step before it gives way
    /// ([`Machine::set_time_slice`]); `None`: until it finishes or suspends. An instance that
    /// never suspends (a recursion without a base case) then delays the others by a slice per
    /// step, not by its whole `--timeout-ms`.
    pub time_slice: Option<std::time::Duration>,
    /// The program planned for `opts` (kept for the fresh graphs).
    exec: Arc<Executable>,
    /// Machines split off concurrent elements that wait ([`crate::fibers_for`]).
    fibers: bool,
    dfg: Dfg<'p>,
    /// Threads other sessions lend while idle (a server's batch threads), added to this one's
    /// launches ([`BatchSession::lend_threads`]).
    lent: Option<&'p crate::Lending>,
    queued: VecDeque<Slot<'p>>,
    active: Vec<Slot<'p>>,
    next_ticket: u64,
    next_instance: u32,
    stats: SessionStats,
}

/// Default [`BatchSession::max_nodes`]: a few hundred SST trees' worth of TreeLSTM nodes; the
/// table of a graph that size is tens of MiB.
pub const DEFAULT_MAX_NODES: usize = 1 << 20;

/// Default [`BatchSession::time_slice`]: far above any zoo model's host program per instance and
/// step (TreeLSTM-large's deepest SST tree takes well under a millisecond), so only a runaway
/// reaches it.
pub const DEFAULT_TIME_SLICE: std::time::Duration = std::time::Duration::from_millis(10);

impl<'p> BatchSession<'p> {
    /// A session running global `entry` of `program`.
    pub fn new(
        program: &'p Program,
        reuse: &'p Reuse,
        exec: Arc<Executable>,
        entry: &str,
        opts: Options,
    ) -> Result<Self, RunError> {
        let entry = *program
            .global_index
            .get(entry)
            .ok_or_else(|| RunError::new(format!("the module has no global `@{entry}`")))?;
        Ok(BatchSession {
            program,
            reuse,
            entry,
            opts,
            max_nodes: DEFAULT_MAX_NODES,
            levels_per_step: None,
            time_slice: Some(DEFAULT_TIME_SLICE),
            fibers: crate::fibers_for(&exec, &opts),
            dfg: Dfg::new(program, reuse, exec.clone(), opts),
            exec,
            lent: None,
            queued: VecDeque::new(),
            active: Vec::new(),
            next_ticket: 0,
            next_instance: 0,
            stats: SessionStats {
                graphs: 1,
                ..SessionStats::default()
            },
        })
    }

    /// Admits an instance (`@main`'s arguments, and its stream of `random.db_uniform` draws); it
    /// joins the instances in flight at the next [`BatchSession::step`].
    pub fn admit(&mut self, args: Vec<Value>, rng: Rng) -> Ticket {
        self.admit_until(args, rng, StopWhen::default())
    }

    /// [`BatchSession::admit`] with when the instance is no longer wanted: past the deadline, or
    /// once the flag is set (by another thread: a served request whose client went away), its
    /// evaluation stops with an error at its next look at the run limits — so one that never
    /// suspends (and so never lets the step end) cannot hold the session forever — and a flush
    /// stops before its next launch.
    pub fn admit_until(&mut self, args: Vec<Value>, rng: Rng, stop: StopWhen) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        self.queued.push_back(Slot {
            ticket,
            args,
            rng,
            instance: 0,
            stop,
            state: State::Queued,
        });
        ticket
    }

    /// Drops an instance that is no longer wanted (its client went away). Work it recorded
    /// already stays in the graph and is computed with the rest; none is recorded for it after
    /// this. Returns whether the ticket was still admitted.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        let before = self.queued.len() + self.active.len();
        self.queued.retain(|s| s.ticket != ticket);
        self.active.retain(|s| s.ticket != ticket);
        self.queued.len() + self.active.len() != before
    }

    /// Instances admitted that have not joined yet.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Instances in flight (joined, not yet answered).
    pub fn in_flight(&self) -> usize {
        self.active.len()
    }

    /// Nothing admitted, nothing in flight.
    pub fn is_idle(&self) -> bool {
        self.queued.is_empty() && self.active.is_empty()
    }

    /// Whether instances admitted now would join at the next step (false while the graph is
    /// over [`BatchSession::max_nodes`] and draining).
    pub fn accepting(&self) -> bool {
        self.active.is_empty() || self.dfg.node_count() < self.max_nodes
    }

    /// Nodes in the current graph.
    pub fn graph_nodes(&self) -> usize {
        self.dfg.node_count()
    }

    pub fn stats(&self) -> SessionStats {
        let mut s = self.stats;
        s.launches += self.dfg.profile.launches;
        s
    }

    fn fresh_graph(&mut self) {
        self.stats.launches += self.dfg.profile.launches;
        self.stats.graphs += 1;
        self.dfg = Dfg::new(self.program, self.reuse, self.exec.clone(), self.opts);
        self.dfg.lend_threads(self.lent);
        self.next_instance = 0;
    }

    /// Launches from now on also use a share of the threads `lent` holds, which other sessions
    /// lend while they are idle ([`crate::Lending::lend`]).
    pub fn lend_threads(&mut self, lent: &'p crate::Lending) {
        self.lent = Some(lent);
        self.dfg.lend_threads(self.lent);
    }

    /// Runs the instances in flight (after letting the admitted ones join) to their next
    /// suspension, flushes the graph once, and returns the instances that finished or failed.
    /// Returns nothing when nothing is in flight.
    pub fn step(&mut self) -> Vec<Finished> {
        let mut finished = Vec::new();
        if self.active.is_empty() && self.dfg.node_count() > 0 {
            self.fresh_graph();
        }
        if self.accepting() {
            // One look at the graph for every newcomer of the step (nothing is recorded until
            // they run).
            let depth = self.start_depth();
            while let Some(slot) = self.queued.pop_front() {
                if let Some(done) = self.join(slot, depth) {
                    finished.push(done);
                }
            }
        }
        if self.active.is_empty() {
            return finished;
        }
        self.stats.steps += 1;
        self.stats.instance_steps += self.active.len() as u64;

        let mut kept = Vec::with_capacity(self.active.len());
        let mut failed = Vec::new();
        for mut slot in std::mem::take(&mut self.active) {
            let state = std::mem::replace(&mut slot.state, State::Queued);
            slot.state = match state {
                State::Running(mut m) => match run_machine(&mut m, &mut self.dfg, self.opts) {
                    Ok(Outcome::Done(v)) => State::Done(v, None),
                    Ok(Outcome::Blocked) => State::Blocked(m),
                    Ok(Outcome::Phase) => State::Parked(m),
                    // Past its slice: it goes on at the next step, after this one's flush has
                    // answered the others.
                    Ok(Outcome::Yielded) => State::Running(m),
                    Err(e) => {
                        finished.push((slot.ticket, Err(e)));
                        failed.push(slot.instance);
                        continue;
                    }
                },
                other => other,
            };
            kept.push(slot);
        }
        self.active = kept;
        // What a failed instance recorded would still be computed by the flush (a stopped
        // runaway's: seconds of work for nobody): it is forgotten, and the others go on (they
        // started again in a fresh graph, losing their progress).
        for &i in &failed {
            self.dfg.drop_pending_of(i);
        }

        if !self.dfg.has_pending() {
            // A blocked machine waits for a value no node will compute: a runtime bug, answered
            // as an error rather than a hang.
            self.active.retain_mut(|slot| {
                if matches!(slot.state, State::Blocked(_)) {
                    finished.push((
                        slot.ticket,
                        Err(RunError::new(
                            "internal: an instance waits for a value nothing will compute",
                        )),
                    ));
                    return false;
                }
                true
            });
        }

        if self.dfg.wants_scan() {
            // Early release: what the instances in flight hold stays (admitted ones hold only
            // their decoded inputs).
            let active = &self.active;
            self.dfg.scan_claims(|f| {
                for slot in active {
                    match &slot.state {
                        State::Running(m) | State::Blocked(m) | State::Parked(m) => {
                            m.visit_values(f)
                        }
                        State::Done(v, _) => f(v),
                        State::Queued => {}
                    }
                }
            });
        }
        let stops = self
            .active
            .iter()
            .filter(|s| s.stop.is_set())
            .map(|s| (s.instance, s.stop.clone()))
            .collect();
        self.dfg.set_stops(stops);
        self.dfg.stop_fired = None;
        let flushed = match self.levels_per_step {
            Some(k) => self.dfg.flush_levels(k),
            None => self.dfg.flush(),
        };
        match (flushed, self.dfg.stop_fired.take()) {
            (Ok(()), _) => {}
            // A stop between launches (a request timed out or its client left): that instance
            // is answered and forgotten, the others keep what they computed and go on at the
            // next step (they started again in a fresh graph, so under overload one timeout
            // made the others time out too).
            (Err(error), Some(stopped)) => {
                self.answer_failed(Some(stopped), &error, &mut finished);
                self.dfg.drop_pending_of(stopped);
                self.stats.stops_survived += 1;
            }
            (Err(error), None) => {
                self.recover(error, &mut finished);
                return finished;
            }
        }

        let mut kept = Vec::with_capacity(self.active.len());
        // Where the instances resuming after a phase boundary start, looked up once.
        let mut resume_depth = None;
        for mut slot in std::mem::take(&mut self.active) {
            let state = std::mem::replace(&mut slot.state, State::Queued);
            slot.state = match state {
                // After a partial flush a finished instance may still wait for its tensors:
                // the ones not computed are listed once, then crossed off as they are (a long
                // result looked at whole after every step made a long request quadratic).
                State::Done(v, waiting) => {
                    if self.dfg.has_pending() {
                        let mut waiting = waiting.unwrap_or_else(|| self.dfg.uncomputed(&v));
                        if self.dfg.still_uncomputed(&mut waiting) {
                            slot.state = State::Done(v, Some(waiting));
                            kept.push(slot);
                            continue;
                        }
                    }
                    finished.push((slot.ticket, materialize(v, &self.dfg)));
                    continue;
                }
                State::Blocked(m) => State::Running(m),
                State::Parked(mut m) => {
                    // The next phase starts with the others at a boundary.
                    let depth = *resume_depth.get_or_insert_with(|| self.start_depth());
                    m.ctx.depth = depth;
                    m.ctx.floor = depth;
                    State::Running(m)
                }
                other => other,
            };
            kept.push(slot);
        }
        self.active = kept;
        finished
    }

    /// The depth an instance starting now (joining, or resuming after a phase boundary) starts
    /// at, and below which none of its invocations go: with partial flushes, the level the graph
    /// has reached, so that its first invocations launch with the running instances' next ones
    /// (cell by cell) rather than as a level of their own below theirs; 0 with whole flushes.
    fn start_depth(&self) -> u32 {
        match self.levels_per_step {
            Some(_) => self.dfg.frontier_depth().unwrap_or(0),
            None => 0,
        }
    }

    /// Starts `slot`'s machine in the current graph at `depth` ([`BatchSession::start_depth`]);
    /// an instance that cannot start is answered.
    fn join(&mut self, mut slot: Slot<'p>, depth: u32) -> Option<Finished> {
        slot.instance = self.next_instance;
        self.next_instance = self.next_instance.wrapping_add(1);
        let mut m = Machine::new(
            self.program,
            InstanceCtx {
                rng: slot.rng.clone(),
                depth,
                floor: depth,
                instance: slot.instance,
                phase: 0,
                pending: 0,
            },
        );
        m.set_stop(slot.stop.clone());
        m.set_time_slice(self.time_slice);
        m.set_fibers(self.fibers);
        let derived = match self.exec.derived_args(self.program, &slot.args) {
            Ok(d) => d,
            Err(e) => return Some((slot.ticket, Err(e))),
        };
        self.dfg.note_weights(&slot.args, &derived);
        if let Err(e) = m.start_derived(self.entry, slot.args.clone(), Some(&derived)) {
            return Some((slot.ticket, Err(e)));
        }
        slot.state = State::Running(m);
        self.active.push(slot);
        None
    }

    /// Answers the instances in flight whose results are computed and puts the others back at
    /// the front of the queue, to start over in a fresh graph.
    fn restart_all(&mut self, finished: &mut Vec<Finished>) {
        self.stats.restarts += 1;
        let mut restart = Vec::new();
        for mut slot in std::mem::take(&mut self.active) {
            if let State::Done(v, _) = std::mem::replace(&mut slot.state, State::Queued) {
                if self.dfg.is_computed(&v) {
                    if let Ok(v) = materialize(v, &self.dfg) {
                        finished.push((slot.ticket, Ok(v)));
                        continue;
                    }
                }
            }
            restart.push(slot);
        }
        for slot in restart.into_iter().rev() {
            self.queued.push_front(slot);
        }
        self.fresh_graph();
    }

    /// After a failed flush: the failing instance gets the error, and the others are answered
    /// or restarted ([`BatchSession::restart_all`]).
    fn recover(&mut self, error: RunError, finished: &mut Vec<Finished>) {
        // Without a culprit no instance can be told apart: all of them get the error, rather
        // than being restarted into the same failure forever.
        self.answer_failed(self.dfg.failed_instance, &error, finished);
        self.restart_all(finished);
    }

    /// Answers `error` to the instance in flight `culprit` (to every one for `None`) and lets it
    /// go.
    fn answer_failed(
        &mut self,
        culprit: Option<u32>,
        error: &RunError,
        finished: &mut Vec<Finished>,
    ) {
        self.active.retain(|slot| {
            let failed = culprit.is_none_or(|c| c == slot.instance);
            if failed {
                finished.push((slot.ticket, Err(error.clone())));
            }
            !failed
        });
    }
}

/// Runs `m` until it finishes, blocks, or (with phases on) reaches a phase boundary.
fn run_machine(m: &mut Machine<'_>, dfg: &mut Dfg<'_>, opts: Options) -> Result<Outcome, RunError> {
    loop {
        match m.run(dfg)? {
            Outcome::Phase if !opts.phases => continue,
            other => return Ok(other),
        }
    }
}
