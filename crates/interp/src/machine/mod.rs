//! The evaluator: an explicit-continuation machine that runs one instance's control flow. Program
//! calls push a `Return` continuation on a heap-allocated stack instead of recursing in Rust, so a
//! 100,000-deep recursion in the user's program costs memory, not native stack; calls in tail position
//! reuse the caller's continuation.
//!
//! Tensor work goes through a [`Backend`]: the reference backend computes eagerly; the batching
//! runtime records dataflow nodes instead. Because all state is explicit, a machine can stop when an
//! `if` needs a tensor that is not computed yet ([`Outcome::Blocked`]) and resume later (ACROBAT
//! §4.2's fibers without threads). The machine also keeps the instance's inline depth (§4.1).
//!
//! This file holds the machine, its continuations and the run loop (evaluate, resume, call); the
//! rest is split by what it is for:
//! - `backend`: the interface to tensor work ([`Backend`], [`InstanceCtx`], [`Outcome`]);
//! - `error`: [`RunError`], and the messages of runs stopped at their limits;
//! - `fibers`: a concurrent element that waits split off, so the elements after it go on;
//! - `limits`: when the run loop looks at the run limits (memory budget, Ctrl-C, deadline);
//! - `at_once`: code taken without a step of its own (fewer continuation pushes and pops);
//! - `calls`: applying a function value (global, closure, constructor, native) to its operands;
//! - `loops`: functions run as loops over their list (`@map`'s, `@foldl`'s and a scan's shape);
//! - `reuse`: values made once per machine and vectors kept for the next call;
//! - `values`: what is done to values alone (list cells, fields, patterns, operator values).

mod at_once;
mod backend;
mod calls;
mod error;
mod fibers;
mod limits;
mod loops;
mod reuse;
mod values;

pub use backend::{Backend, InstanceCtx, Outcome};
pub use error::{limit_error, runaway_hint, RunError, RunErrorInfo, MAX_TRACE};
pub use fibers::draws_on_host;
pub use limits::{StopWhen, Unwanted, MAX_PENDING};
pub use values::{from_op_value, to_op_value};

use crate::value::{Closure, Value};
use limits::POLL_EVERY;
use loops::LoopCode;
use reuse::SharedValues;
use smallvec::smallvec;
use std::rc::Rc;
use tumble_compile::{
    dropped_after, CaptureFrom, Code, FoldLoop, Lambda, MapLoop, Native, Pat, Program, ScanLoop,
};
use tumble_ir::Span;
use values::{describe, list_items, list_of, matches, project};

#[derive(Clone)]
struct Frame {
    slots: Vec<Option<Value>>,
    /// The closure being run, for `SelfRef`.
    this: Option<Value>,
    /// The call that entered this frame, for the call trace of an error.
    call_site: Option<Span>,
    /// When this frame was entered by a tail call (which replaced its caller's frame), the call
    /// that began the chain of tail calls: the trace shows where a self-recursive function was
    /// called from, not only its own recursive call.
    tail_from: Option<Span>,
}

impl Frame {
    fn empty() -> Frame {
        Frame {
            slots: Vec::new(),
            this: None,
            call_site: None,
            tail_from: None,
        }
    }
}

enum Kont<'p> {
    /// Evaluating the operands of a call; `vals` holds those done so far.
    Operands {
        call: &'p Code,
        operands: &'p [Code],
        vals: Vec<Value>,
    },
    Tuple {
        elems: &'p [Code],
        vals: Vec<Value>,
    },
    Proj(u32, Span),
    Let {
        binds: &'p [(u32, Code)],
        idx: usize,
        body: &'p Code,
        drops: &'p [(u32, u32)],
    },
    If(&'p Code, &'p Code),
    Match {
        arms: &'p [(Pat, Code)],
        span: Span,
    },
    /// Evaluating independent elements: each starts at depth `start`; the join takes `max`
    /// and makes `join` of the values. `waits` is the instance's count of stops
    /// ([`Machine::waits`]) when the element now evaluated began.
    Concurrent {
        join: Join,
        elems: &'p [Code],
        vals: Vec<Value>,
        start: u32,
        max: u32,
        waits: u32,
    },
    /// A function run as a loop over a list ([`Machine::map_next`]): the elements not yet
    /// done (last first), the values so far, the depth each element starts from and the deepest
    /// reached.
    MapLoop {
        ml: MapLoop,
        elem: &'p Code,
        items: Vec<Value>,
        vals: Vec<Value>,
        start: u32,
        max: u32,
    },
    /// A function run as a left fold over a list ([`Machine::fold_next`]): the elements not yet
    /// done, last first; the accumulator is the frame's slot `fl.acc`.
    FoldLoop {
        fl: FoldLoop,
        step: &'p Code,
        items: Vec<Value>,
    },
    /// A function run as a scan over a list ([`Machine::scan_next`]), waiting for binding
    /// `idx` of its step: the elements not yet done, last first, and the outputs so far; the
    /// state is the frame's slot `sl.acc`.
    ScanLoop {
        // By reference, and `idx` a u32: every continuation is as large as the largest kind,
        // and each push and pop moves it (80 bytes, where a copied `ScanLoop` made 136).
        sl: &'p ScanLoop,
        binds: &'p [(u32, Code)],
        idx: u32,
        items: Vec<Value>,
        vals: Vec<Value>,
    },
    Return(Frame),
}

enum Step<'p> {
    Eval(&'p Code),
    Apply(Value),
    /// An operator call outside a block whose operands are evaluated; kept as a step so that the
    /// machine can suspend before it when an operand is not computed yet.
    CallOp(&'p Code, Vec<Value>),
    /// At the join of the concurrent continuation on the stack's top, whose split-off elements
    /// ([`fibers`]) are not all done: goes on once they are.
    AwaitJoin,
}

pub struct Machine<'p> {
    program: &'p Program,
    frame: Frame,
    stack: Vec<Kont<'p>>,
    /// Where to continue when `run` is called (set by `start` and by suspension).
    pending: Option<Step<'p>>,
    /// Stopped at a phase boundary (the next `run` passes it).
    at_phase: bool,
    /// Cleared slot vectors of finished frames, reused by the next calls.
    slot_pool: Vec<Vec<Option<Value>>>,
    /// Emptied argument vectors, reused for the next calls' operands.
    vals_pool: Vec<Vec<Value>>,
    /// A match's bindings while its arms are tried (kept to reuse the allocation).
    binds: Vec<(u32, Value)>,
    /// Steps until the next look at the run limits.
    poll_in: u32,
    /// When the run stops with an error (looked at with the run limits): past a served request's
    /// `--timeout-ms`, so that an instance that never suspends (a recursion without a base case
    /// in constant memory) cannot hold the batch thread forever, or once its client went away,
    /// so a long step stops too.
    stop: StopWhen,
    /// How long one `run` may go before it yields ([`Outcome::Yielded`]), looked at with the
    /// run limits; `None` (the default): until it finishes or suspends. A serving session sets
    /// it, so that an instance that never suspends holds the batch thread for a slice, not until
    /// its deadline: the other requests' instances flush and are answered meanwhile.
    slice: Option<std::time::Duration>,
    /// When the current `run` began (with a time slice only).
    slice_began: Option<std::time::Instant>,
    /// The slice is spent: the run loop yields before its next step.
    yield_due: bool,
    /// Steps of the poll windows completed so far; the current window's are
    /// `POLL_EVERY - poll_in` (see [`Machine::steps`]).
    steps_before: u64,
    /// The arguments the entry was started with, read by `Code::Param`.
    params: Vec<Value>,
    /// Values that are the same every time the program makes them, made once per machine.
    shared: SharedValues,
    /// Functions of `@foldl`'s shape run as loops ([`Machine::fold_loop`]);
    /// `TUMBLE_NO_FOLD_LOOPS=1` interprets them (the A/B switch; the program is the same).
    fold_loops: bool,
    /// Functions of a scan's shape run as loops ([`Machine::scan_loop`]);
    /// `TUMBLE_NO_SCAN_LOOPS=1` interprets them (the A/B switch; the program is the same).
    scan_loops: bool,
    /// Calls whose chosen arm completes at once are taken at once ([`Machine::call_at_once`]);
    /// `TUMBLE_NO_CALLS_AT_ONCE=1` takes steps for them (the A/B switch; the recorded graph is
    /// the same).
    calls_at_once: bool,
    /// More code taken at once ([`Machine::at_once`]): loops whose element code is
    /// ([`Machine::loop_at_once`]), constructors and tuples of immediate operands, conditionals
    /// and matches on immediate values, and an `if` on a computed immediate condition goes
    /// straight to its arm. `TUMBLE_NO_WIDER_AT_ONCE=1` takes steps for them (the A/B switch;
    /// the recorded graph is the same).
    wider_at_once: bool,
    /// Slots a `let` drops are cleared after their last read ([`Code::Let`]'s `drops`,
    /// [`tumble_compile::drops`]); `TUMBLE_NO_SLOT_DROPS=1` keeps every slot until its frame
    /// ends (the A/B switch; the values and the recorded graph are the same, only what the
    /// host holds between flushes differs).
    slot_drops: bool,
    /// How many times this instance stopped for a value not yet computed or at a phase
    /// boundary (wrapping). A concurrent element that stopped was recorded in pieces between
    /// flushes: the elements after it start where it ended, as written, not beside it
    /// ([`Machine::concurrent_from`]).
    waits: u32,
    /// Concurrent elements that wait are split off as fibers ([`fibers`]); off by default (an
    /// eager backend never waits), set by the batching runtime ([`Machine::set_fibers`]).
    fibers_on: bool,
    /// The suspended fibers.
    fibers: fibers::Fibers<'p>,
    /// The running fiber's join cells, by the stack index of their concurrent continuation.
    cells: Vec<(u32, fibers::Cell)>,
    /// Where the running fiber's value goes (`None`: the main line).
    target: Option<(fibers::Cell, u32)>,
    /// The call trace below the running fiber's own stack (empty for the main line).
    trace_below: Rc<[Span]>,
    pub ctx: InstanceCtx,
}

/// What the values of a concurrent evaluation become.
#[derive(Clone, Copy)]
enum Join {
    /// `db.concurrent((..))`'s tuple.
    Tuple,
    /// The fields of constructor `ctor` (`@map`'s step: [`tumble_compile::Natives::fast_steps`]).
    Ctor(u32),
}

fn operands_of(code: &Code) -> &[Code] {
    match code {
        Code::CallOp { args, .. }
        | Code::CallCtor { args, .. }
        | Code::CallGlobal { args, .. }
        | Code::InvokeBlock { args, .. } => args,
        Code::Call { operands, .. } => operands,
        _ => &[],
    }
}

/// The call sites of `frame` (the running one, if any) and of the frames on `stack` waiting to
/// be returned to, innermost first, each followed by the call that began its chain of tail
/// calls, at most [`MAX_TRACE`] of them.
fn frames_trace(frame: Option<&Frame>, stack: &[Kont]) -> Vec<Span> {
    let waiting = stack.iter().rev().filter_map(|k| match k {
        Kont::Return(f) => Some(f),
        _ => None,
    });
    frame
        .into_iter()
        .chain(waiting)
        .flat_map(|f| {
            let origin = f.tail_from.filter(|o| Some(*o) != f.call_site);
            f.call_site.into_iter().chain(origin)
        })
        .take(MAX_TRACE)
        .collect()
}

fn visit_frame(fr: &Frame, f: &mut dyn FnMut(&Value)) {
    fr.slots.iter().flatten().for_each(&mut *f);
    fr.this.iter().for_each(&mut *f);
}

fn visit_stack(stack: &[Kont], f: &mut dyn FnMut(&Value)) {
    for k in stack {
        match k {
            Kont::Operands { vals, .. }
            | Kont::Tuple { vals, .. }
            | Kont::Concurrent { vals, .. } => vals.iter().for_each(&mut *f),
            Kont::MapLoop { items, vals, .. } => {
                items.iter().chain(vals).for_each(&mut *f);
            }
            Kont::FoldLoop { items, .. } => items.iter().for_each(&mut *f),
            Kont::ScanLoop { items, vals, .. } => items.iter().chain(vals).for_each(&mut *f),
            Kont::Return(fr) => visit_frame(fr, f),
            Kont::Proj(..) | Kont::Let { .. } | Kont::If(..) | Kont::Match { .. } => {}
        }
    }
}

fn visit_step(step: Option<&Step>, f: &mut dyn FnMut(&Value)) {
    match step {
        Some(Step::Apply(v)) => f(v),
        Some(Step::CallOp(_, vs)) => vs.iter().for_each(&mut *f),
        Some(Step::Eval(_)) | Some(Step::AwaitJoin) | None => {}
    }
}

impl<'p> Machine<'p> {
    pub fn new(program: &'p Program, ctx: InstanceCtx) -> Self {
        Machine {
            program,
            frame: Frame::empty(),
            stack: Vec::new(),
            pending: None,
            at_phase: false,
            slot_pool: Vec::new(),
            vals_pool: Vec::new(),
            binds: Vec::new(),
            poll_in: POLL_EVERY,
            stop: StopWhen::default(),
            slice: None,
            slice_began: None,
            yield_due: false,
            steps_before: 0,
            params: Vec::new(),
            waits: 0,
            fibers_on: false,
            fibers: fibers::Fibers::default(),
            cells: Vec::new(),
            target: None,
            trace_below: Rc::from(Vec::new()),
            shared: SharedValues::new(),
            fold_loops: !tumble_limits::switch_on!("TUMBLE_NO_FOLD_LOOPS"),
            scan_loops: !tumble_limits::switch_on!("TUMBLE_NO_SCAN_LOOPS"),
            calls_at_once: !tumble_limits::switch_on!("TUMBLE_NO_CALLS_AT_ONCE"),
            wider_at_once: !tumble_limits::switch_on!("TUMBLE_NO_WIDER_AT_ONCE"),
            slot_drops: !tumble_limits::switch_on!("TUMBLE_NO_SLOT_DROPS"),
            ctx,
        }
    }

    /// Prepares a call of global `index` on `args`; [`Machine::run`] then evaluates it.
    pub fn start(&mut self, index: u32, args: Vec<Value>) -> Result<(), RunError> {
        self.start_derived(index, args, None)
    }

    /// [`Machine::start`] with the program's derived parameters already computed for these
    /// weights ([`derived_params`]; the batching runtime computes them once per mini-batch
    /// instead of once per instance). `None`: computed here.
    pub fn start_derived(
        &mut self,
        index: u32,
        args: Vec<Value>,
        derived: Option<&[Value]>,
    ) -> Result<(), RunError> {
        let lambda = self.global(index)?;
        if self.program.params_of == Some(index) {
            self.params = args.clone();
            if !self.program.derived.is_empty() {
                match derived {
                    Some(d) => self.params.extend_from_slice(d),
                    None => {
                        let d = derived_params(self.program, &args)?;
                        self.params.extend(d);
                    }
                }
            }
        }
        let step = self.enter(lambda, args, None, &[], None)?;
        self.pending = Some(step);
        Ok(())
    }

    /// Runs until the call finishes or needs a tensor value the backend has not computed. An
    /// error carries the trace of the calls pending when it happened.
    pub fn run(&mut self, backend: &mut dyn Backend) -> Result<Outcome, RunError> {
        if self.slice.is_some() {
            self.slice_began = Some(std::time::Instant::now());
            self.yield_due = false;
        }
        self.run_fibers(backend).map_err(|mut e| {
            if e.trace.is_empty() {
                e.trace = self.call_trace();
            }
            e
        })
    }

    /// [`Machine::run`] over the instance's fibers: the running one until it stops, then the
    /// others that can go on.
    fn run_fibers(&mut self, backend: &mut dyn Backend) -> Result<Outcome, RunError> {
        self.wake_blocked();
        if self.pending.is_none() {
            if let fibers::Next::Blocked = self.switch_to_ready() {
                return Err(RunError::new("internal: nothing to run"));
            }
        }
        loop {
            let next = match self.run_steps(backend)? {
                fibers::Stop::Done(v) => match self.finish_fiber(v.clone()) {
                    None => return Ok(Outcome::Done(v)),
                    Some(next) => next,
                },
                fibers::Stop::Blocked => self.after_stop(false, backend)?,
                fibers::Stop::AwaitJoin => self.after_stop(true, backend)?,
                fibers::Stop::Phase => return Ok(Outcome::Phase),
                fibers::Stop::Yielded => return Ok(Outcome::Yielded),
            };
            if let fibers::Next::Blocked = next {
                return Ok(Outcome::Blocked);
            }
        }
    }

    /// Turns fibers on or off for this machine ([`fibers`]; off by default). The batching
    /// runtime turns them on unless the program draws random numbers on the host
    /// ([`draws_on_host`]) or its `Options::fibers` is off (`--no-fibers`).
    pub fn set_fibers(&mut self, on: bool) {
        self.fibers_on = on;
    }

    /// Calls `f` with every value this instance holds between two `run`s — its frames' slots and
    /// closures, the values its continuations have gathered, the step it resumes with — but for
    /// its entry arguments and the shared constants, which are never lazy (the batching runtime's
    /// early release: a recorded node none of these names can be freed once no node reads it).
    pub fn visit_values(&self, f: &mut dyn FnMut(&Value)) {
        visit_frame(&self.frame, f);
        self.binds.iter().for_each(|(_, v)| f(v));
        visit_stack(&self.stack, f);
        visit_step(self.pending.as_ref(), f);
        fibers::visit_cells(&self.cells, f);
        self.fibers.visit_values(f);
    }

    /// Turns the wider at-once evaluation on or off for this machine (see
    /// [`Machine::at_once`]; by default on, unless `TUMBLE_NO_WIDER_AT_ONCE` is set): the
    /// recorded graph is the same either way.
    pub fn set_wider_at_once(&mut self, on: bool) {
        self.wider_at_once = on;
    }

    /// The call sites of the current frame and of the frames waiting to be returned to,
    /// innermost first, each followed by the call that began its chain of tail calls, at most
    /// [`MAX_TRACE`] of them (a runaway recursion has millions).
    fn call_trace(&self) -> Vec<Span> {
        let mut trace = frames_trace(Some(&self.frame), &self.stack);
        // A fiber's own stack ends at its concurrent: the calls below it, as they were when it
        // was split off.
        trace.extend(self.trace_below.iter().copied());
        trace.truncate(MAX_TRACE);
        trace
    }

    fn run_steps(&mut self, backend: &mut dyn Backend) -> Result<fibers::Stop, RunError> {
        let Some(mut step) = self.pending.take() else {
            return Err(RunError::new("internal: nothing to run"));
        };
        loop {
            self.tick(backend)?;
            if self.yield_due {
                self.yield_due = false;
                self.pending = Some(step);
                return Ok(fibers::Stop::Yielded);
            }
            step = match step {
                Step::Eval(Code::Phase) => {
                    if self.at_phase {
                        self.at_phase = false;
                        self.ctx.phase += 1;
                        Step::Apply(self.shared.unit())
                    } else {
                        self.at_phase = true;
                        self.pending = Some(step);
                        self.waits = self.waits.wrapping_add(1);
                        return Ok(fibers::Stop::Phase);
                    }
                }
                Step::Eval(code) => self.eval(code, backend)?,
                Step::AwaitJoin => {
                    if self.join_waits() {
                        self.pending = Some(Step::AwaitJoin);
                        return Ok(fibers::Stop::AwaitJoin);
                    }
                    self.resume_join(backend)?
                }
                Step::CallOp(code, vals) => {
                    if !backend.op_args_ready(&vals)? {
                        self.pending = Some(Step::CallOp(code, vals));
                        self.waits = self.waits.wrapping_add(1);
                        return Ok(fibers::Stop::Blocked);
                    }
                    self.call(code, vals, backend)?
                }
                Step::Apply(v) => match self.stack.pop() {
                    None => return Ok(fibers::Stop::Done(v)),
                    Some(Kont::If(t, f)) => match backend.condition(&v)? {
                        Some(c) => Step::Eval(if c { t } else { f }),
                        None => {
                            self.stack.push(Kont::If(t, f));
                            self.pending = Some(Step::Apply(v));
                            self.waits = self.waits.wrapping_add(1);
                            return Ok(fibers::Stop::Blocked);
                        }
                    },
                    Some(k) => self.resume(k, v, backend)?,
                },
            };
        }
    }

    fn push(&mut self, k: Kont<'p>) -> Result<(), RunError> {
        if self.stack.len() >= MAX_PENDING {
            return Err(RunError::new(format!(
                "recursion too deep: more than {MAX_PENDING} pending evaluations (runaway recursion?)"
            )));
        }
        if self.stack.len() == self.stack.capacity() {
            // The stack doubles: check that growth against the memory budget before it happens.
            // The new block is allocated while the old one is still held, so it counts whole.
            let more = 2 * self.stack.capacity().max(4) * std::mem::size_of::<Kont>();
            if let Err(stop) = tumble_limits::reserve(more) {
                let pending = format!(
                    "{} pending evaluations in this instance",
                    tumble_limits::count_text(self.stack.len())
                );
                return Err(limit_error(
                    stop,
                    vec![pending],
                    " (a recursion without a base case?)",
                ));
            }
        }
        self.stack.push(k);
        Ok(())
    }

    fn slot(&self, s: u32) -> Result<Value, RunError> {
        self.slot_ref(s).cloned()
    }

    /// Slot `s` where it lies (a projection reads one field without copying the tuple).
    fn slot_ref(&self, s: u32) -> Result<&Value, RunError> {
        self.frame
            .slots
            .get(s as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| RunError::new(format!("internal: slot {s} read before it was set")))
    }

    fn param(&self, k: u32) -> Result<Value, RunError> {
        self.param_ref(k).cloned()
    }

    fn param_ref(&self, k: u32) -> Result<&Value, RunError> {
        self.params.get(k as usize).ok_or_else(|| {
            RunError::new(format!(
                "internal: entry argument {k} read, but the run was started with {}",
                self.params.len()
            ))
        })
    }

    /// The first of `arms` whose pattern matches `v`, its bindings left in `self.binds` for
    /// [`Machine::bind_arm`] (cleared when no arm matches).
    fn choose_arm(&mut self, arms: &'p [(Pat, Code)], v: &Value) -> Option<&'p Code> {
        let mut binds = std::mem::take(&mut self.binds);
        let mut chosen = None;
        for (pat, body) in arms {
            binds.clear();
            if matches(pat, v, &mut binds) {
                chosen = Some(body);
                break;
            }
        }
        if chosen.is_none() {
            binds.clear();
        }
        self.binds = binds;
        chosen
    }

    /// Binds the variables of the arm [`Machine::choose_arm`] chose.
    fn bind_arm(&mut self) {
        let mut binds = std::mem::take(&mut self.binds);
        for (slot, val) in binds.drain(..) {
            self.set_slot(slot, val);
        }
        self.binds = binds;
    }

    /// Evaluates a call's operands from `vals.len()` on: immediate ones at once, then either
    /// the first that needs steps of its own or, when all are done, the call.
    fn operands_from(
        &mut self,
        call: &'p Code,
        operands: &'p [Code],
        mut vals: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        while let Some(next) = operands.get(vals.len()) {
            match self.at_once(next, backend) {
                Some(v) => vals.push(v?),
                None => {
                    self.push(Kont::Operands {
                        call,
                        operands,
                        vals,
                    })?;
                    return Ok(Step::Eval(next));
                }
            }
        }
        self.call_step(call, vals, backend)
    }

    /// A tuple's elements from `vals.len()` on, those [`Machine::at_once`] takes at once (in
    /// order, as the steps would: `(%r.0, Cons(1, %r.1))` makes its `Cons` without a step).
    fn tuple_from(
        &mut self,
        elems: &'p [Code],
        mut vals: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        while let Some(next) = elems.get(vals.len()) {
            let v = match self.wider_at_once {
                true => self.at_once(next, backend),
                false => self.immediate(next),
            };
            match v {
                Some(v) => vals.push(v?),
                None => {
                    self.push(Kont::Tuple { elems, vals })?;
                    return Ok(Step::Eval(next));
                }
            }
        }
        Ok(Step::Apply(Value::tuple(self.fields_of(vals))))
    }

    /// `let %r = db.concurrent((e1, .., en)); C(%r.0, .., %r.n-1)` with the fast path on: the
    /// constructor and the elements (see [`Join::Ctor`]). The tuple bound to `%r` is
    /// observable nowhere else (the body is exactly the constructor of its fields, in order), so
    /// building the cell from the elements directly gives the same value at the same depth.
    fn concurrent_cell(
        &self,
        binds: &'p [(u32, Code)],
        body: &'p Code,
    ) -> Option<(u32, &'p [Code])> {
        if !self.program.natives.fast_steps {
            return None;
        }
        let [(slot, Code::Concurrent(elems))] = binds else {
            return None;
        };
        let Code::CallCtor { ctor, args } = body else {
            return None;
        };
        let fields_in_order = !elems.is_empty()
            && args.len() == elems.len()
            && args.iter().enumerate().all(|(i, a)| {
                matches!(a, Code::Proj(inner, k, _)
                    if *k as usize == i && matches!(**inner, Code::Slot(s) if s == *slot))
            });
        fields_in_order.then_some((*ctor, elems.as_slice()))
    }

    /// Concurrent elements from `vals.len()` on, each from depth `start` (those
    /// [`Machine::at_once`] takes without a step of their own), then `join` of them at the
    /// deepest depth any element reached (`max`).
    fn concurrent_from(
        &mut self,
        join: Join,
        elems: &'p [Code],
        mut vals: Vec<Value>,
        start: u32,
        max: u32,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        let mut max = max;
        // The step the continuation waits on: an element that needs steps, or its join's fibers.
        let step = loop {
            match elems.get(vals.len()) {
                Some(next) => {
                    self.ctx.depth = start;
                    match self.at_once(next, backend) {
                        Some(v) => {
                            vals.push(v?);
                            // An invocation done at once advanced the depth like any other element.
                            max = max.max(self.ctx.depth);
                        }
                        None => break Step::Eval(next),
                    }
                }
                None if self.join_fibers(&mut vals, &mut max) => {
                    self.ctx.depth = max;
                    return Ok(Step::Apply(match join {
                        Join::Tuple => Value::tuple(self.fields_of(vals)),
                        Join::Ctor(ctor) => Value::adt(ctor, self.fields_of(vals)),
                    }));
                }
                None => break Step::AwaitJoin,
            }
        };
        self.push(Kont::Concurrent {
            join,
            elems,
            vals,
            start,
            max,
            waits: self.waits,
        })?;
        Ok(step)
    }

    /// A `let` chain's bindings from `idx` on, immediate values (and block invocations of
    /// immediate operands) bound at once, then the body.
    fn let_from(
        &mut self,
        binds: &'p [(u32, Code)],
        mut idx: usize,
        body: &'p Code,
        drops: &'p [(u32, u32)],
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        while let Some((slot, code)) = binds.get(idx) {
            match self.at_once(code, backend) {
                Some(v) => {
                    let v = v?;
                    self.set_slot(*slot, v);
                    self.drop_after(drops, idx);
                    idx += 1;
                }
                None => {
                    self.push(Kont::Let {
                        binds,
                        idx,
                        body,
                        drops,
                    })?;
                    return Ok(Step::Eval(code));
                }
            }
        }
        Ok(Step::Eval(body))
    }

    fn eval(&mut self, code: &'p Code, backend: &mut dyn Backend) -> Result<Step<'p>, RunError> {
        Ok(match code {
            Code::Slot(s) => Step::Apply(self.slot(*s)?),
            Code::Param(k) => Step::Apply(self.param(*k)?),
            Code::SelfRef => Step::Apply(
                self.frame
                    .this
                    .clone()
                    .ok_or_else(|| RunError::new("internal: self reference outside a closure"))?,
            ),
            Code::Global(g) => Step::Apply(self.shared.global(*g)),
            Code::Ctor(c) => {
                if self.arity(*c) == 0 {
                    Step::Apply(self.shared.nullary(*c))
                } else {
                    Step::Apply(Value::Closure(Rc::new(Closure::Ctor(*c))))
                }
            }
            Code::Lit(t) => Step::Apply(Value::Tensor(t.clone())),
            Code::Tuple(elems) => {
                if elems.is_empty() {
                    Step::Apply(self.shared.unit())
                } else {
                    let vals = self.pooled();
                    self.tuple_from(elems, vals, backend)?
                }
            }
            Code::Proj(inner, i, span) => match self.immediate(inner) {
                Some(v) => Step::Apply(project(&v?, *i, *span)?),
                None => {
                    self.push(Kont::Proj(*i, *span))?;
                    Step::Eval(inner)
                }
            },
            Code::CallOp { .. }
            | Code::CallCtor { .. }
            | Code::CallGlobal { .. }
            | Code::InvokeBlock { .. }
            | Code::Call { .. } => {
                let operands = operands_of(code);
                if operands.is_empty() {
                    self.call_step(code, Vec::new(), backend)?
                } else {
                    let mut vals = self.pooled();
                    vals.reserve(operands.len());
                    self.operands_from(code, operands, vals, backend)?
                }
            }
            Code::Let { binds, body, drops } => match self.concurrent_cell(binds, body) {
                Some((ctor, elems)) => {
                    let start = self.ctx.depth;
                    let vals = self.pooled();
                    self.concurrent_from(Join::Ctor(ctor), elems, vals, start, start, backend)?
                }
                None => self.let_from(binds, 0, body, drops, backend)?,
            },
            Code::MakeClosure(index) => {
                let lambda = self.lambda(*index)?;
                let mut captured = Vec::with_capacity(lambda.captures.len());
                for (from, _) in &lambda.captures {
                    captured.push(match from {
                        CaptureFrom::Slot(s) => self.slot(*s)?,
                        CaptureFrom::Param(k) => self.param(*k)?,
                        CaptureFrom::SelfRef => self.frame.this.clone().ok_or_else(|| {
                            RunError::new("internal: self capture outside a closure")
                        })?,
                    });
                }
                Step::Apply(Value::Closure(Rc::new(Closure::Lambda {
                    lambda: *index,
                    captured,
                })))
            }
            Code::If(c, t, f) => match self.immediate(c).filter(|_| self.wider_at_once) {
                // A computed condition at hand: straight to the arm.
                Some(v) => {
                    let v = v?;
                    match backend.condition(&v)? {
                        Some(b) => Step::Eval(if b { t } else { f }),
                        None => {
                            self.push(Kont::If(t, f))?;
                            Step::Apply(v)
                        }
                    }
                }
                None => {
                    self.push(Kont::If(t, f))?;
                    Step::Eval(c)
                }
            },
            Code::Phase => Step::Apply(self.shared.unit()),
            Code::Ghost(n, body) => {
                backend.ghost(&mut self.ctx, *n);
                Step::Eval(body)
            }
            Code::Concurrent(elems) => {
                let start = self.ctx.depth;
                let vals = self.pooled();
                self.concurrent_from(Join::Tuple, elems, vals, start, start, backend)?
            }
            Code::Match {
                scrutinee,
                arms,
                span,
            } => {
                let tuple = match &**scrutinee {
                    Code::Tuple(_) => self.match_tuple(scrutinee, arms),
                    _ => None,
                };
                match tuple {
                    Some(step) => step?,
                    None => match self.immediate(scrutinee) {
                        Some(v) => self.resume(Kont::Match { arms, span: *span }, v?, backend)?,
                        None => {
                            self.push(Kont::Match { arms, span: *span })?;
                            Step::Eval(scrutinee)
                        }
                    },
                }
            }
        })
    }

    /// `match (a, b) { (P, Q) => .., _ => .. }` with the evaluator's shortcuts on: a tuple of
    /// immediate elements matched element by element, without making the tuple. `None` (nothing
    /// done, nothing to undo: immediate code has no effects) where an element is not immediate,
    /// an arm binds the whole tuple, or no arm matches (the general path makes the value for
    /// the error).
    fn match_tuple(
        &mut self,
        scrutinee: &'p Code,
        arms: &'p [(Pat, Code)],
    ) -> Option<Result<Step<'p>, RunError>> {
        let Code::Tuple(elems) = scrutinee else {
            return None;
        };
        if !self.program.natives.fast_steps
            || elems.is_empty()
            || arms.iter().any(|(p, _)| matches!(p, Pat::Bind(_)))
        {
            return None;
        }
        let vals = match self.immediates(elems)? {
            Ok(vals) => vals,
            Err(e) => return Some(Err(e)),
        };
        let mut binds = std::mem::take(&mut self.binds);
        let mut chosen = None;
        for (pat, body) in arms {
            binds.clear();
            let hit = match pat {
                Pat::Wild => true,
                Pat::Tuple(ps) => {
                    ps.len() == vals.len()
                        && ps.iter().zip(&vals).all(|(p, v)| matches(p, v, &mut binds))
                }
                Pat::Bind(_) | Pat::Ctor(..) => false,
            };
            if hit {
                chosen = Some(body);
                break;
            }
        }
        if chosen.is_some() {
            for (slot, val) in binds.drain(..) {
                self.set_slot(slot, val);
            }
        }
        binds.clear();
        self.binds = binds;
        self.give_back(vals);
        chosen.map(|body| Ok(Step::Eval(body)))
    }

    fn resume(
        &mut self,
        k: Kont<'p>,
        v: Value,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        Ok(match k {
            Kont::Operands {
                call,
                operands,
                mut vals,
            } => {
                vals.push(v);
                self.operands_from(call, operands, vals, backend)?
            }
            Kont::Concurrent {
                join,
                elems,
                mut vals,
                start,
                max,
                waits,
            } => {
                vals.push(v);
                let max = max.max(self.ctx.depth);
                // An element that waited for flushes is followed as written: the elements after
                // it are recorded after those flushes, and starting them beside it would put
                // them at depths the other instances have left (DRNN: 46 launches became 49).
                let start = if waits != self.waits {
                    self.ctx.depth
                } else {
                    start
                };
                self.concurrent_from(join, elems, vals, start, max, backend)?
            }
            Kont::Tuple { elems, mut vals } => {
                vals.push(v);
                self.tuple_from(elems, vals, backend)?
            }
            Kont::MapLoop {
                ml,
                elem,
                items,
                mut vals,
                start,
                max,
            } => {
                vals.push(v);
                let max = max.max(self.ctx.depth);
                self.map_next(ml, elem, items, vals, start, max, backend)?
            }
            Kont::FoldLoop { fl, step, items } => {
                self.set_slot(fl.acc, v);
                self.fold_next(fl, step, items, backend)?
            }
            Kont::ScanLoop {
                sl,
                binds,
                idx,
                items,
                vals,
            } => {
                if let Some((slot, _)) = binds.get(idx as usize) {
                    self.set_slot(*slot, v);
                }
                self.scan_next(sl, binds, Some(idx as usize + 1), items, vals, backend)?
            }
            Kont::Proj(i, span) => Step::Apply(project(&v, i, span)?),
            Kont::Let {
                binds,
                idx,
                body,
                drops,
            } => {
                if let Some((slot, _)) = binds.get(idx) {
                    self.set_slot(*slot, v);
                    self.drop_after(drops, idx);
                }
                self.let_from(binds, idx + 1, body, drops, backend)?
            }
            Kont::If(t, f) => match backend.condition(&v)? {
                Some(c) => Step::Eval(if c { t } else { f }),
                None => return Err(RunError::new("internal: condition not ready after resume")),
            },
            Kont::Match { arms, span } => {
                if let Some(body) = self.choose_arm(arms, &v) {
                    self.bind_arm();
                    return Ok(Step::Eval(body));
                }
                return Err(RunError::at(
                    span,
                    format!(
                        "no arm of this `match?` covers the value ({})",
                        describe(self.program, &v)
                    ),
                ));
            }
            Kont::Return(frame) => {
                let done = std::mem::replace(&mut self.frame, frame);
                self.recycle(done);
                Step::Apply(v)
            }
        })
    }

    fn set_slot(&mut self, slot: u32, v: Value) {
        if let Some(s) = self.frame.slots.get_mut(slot as usize) {
            *s = Some(v);
        }
    }

    /// Clears the slots a `let` drops once its bind `idx` is made ([`Code::Let`]'s `drops`):
    /// the frame stops naming values nothing reads any more, so the batching runtime's early
    /// release can free the launch outputs behind them while the frame lives on.
    #[inline]
    fn drop_after(&mut self, drops: &[(u32, u32)], idx: usize) {
        if drops.is_empty() || !self.slot_drops {
            return;
        }
        for slot in dropped_after(drops, idx) {
            if let Some(s) = self.frame.slots.get_mut(slot as usize) {
                *s = None;
            }
        }
    }
}

/// The program's derived parameters ([`Program::derived`]: weight transforms moved out of
/// blocks) for a run whose entry arguments are `params`, in order: each derived block evaluated
/// once on the weights it reads.
pub fn derived_params(program: &Program, params: &[Value]) -> Result<Vec<Value>, RunError> {
    program
        .derived_values(|k| params.get(k as usize).and_then(Value::as_tensor).cloned())
        .map(|ts| ts.into_iter().map(Value::Tensor).collect())
        .map_err(|e| RunError::at(e.span, e.message))
}

#[cfg(test)]
mod size_tests {
    /// Every continuation is as large as the largest kind, and each push and pop moves one: a
    /// kind that grows them all shows here.
    #[test]
    fn continuations_stay_small() {
        assert!(std::mem::size_of::<super::Kont>() <= 80);
    }
}
