//! The evaluator: an explicit-continuation machine that runs one instance's control flow. Program
//! calls push a `Return` continuation on a heap-allocated stack instead of recursing in Rust, so a
//! 100,000-deep recursion in the user's program costs memory, not native stack; calls in tail position
//! reuse the caller's continuation.
//!
//! Tensor work goes through a [`Backend`]: the reference backend computes eagerly; the batching
//! runtime records dataflow nodes instead. Because all state is explicit, a machine can stop when an
//! `if` needs a tensor that is not computed yet ([`Outcome::Blocked`]) and resume later (ACROBAT
//! §4.2's fibers without threads). The machine also keeps the instance's inline depth (§4.1).

use crate::value::{Closure, Fields, Value};
use smallvec::smallvec;
use std::rc::Rc;
use tumble_compile::{
    CaptureFrom, Code, FoldLoop, Lambda, MapLoop, Native, Pat, Program, ScanLoop,
};
use tumble_ir::{Attrs, Span};
use tumble_ops::{OpDef, OpValue};
use tumble_tensor::{Rng, Tensor};

/// Per-instance state the backend may read and update.
pub struct InstanceCtx {
    /// Draws of `random.db_uniform`, in this instance's program order.
    pub rng: Rng,
    /// Inline depth (ACROBAT §4.1): the depth the next block invocation gets.
    pub depth: u32,
    /// Which instance of the mini-batch this is.
    pub instance: u32,
    /// Program phases passed so far (`db.phase_change`).
    pub phase: u32,
    /// The instance's pending evaluations when it last invoked a block, for the message of a
    /// backend that stops on the memory budget.
    pub pending: usize,
}

/// Where tensor work goes.
pub trait Backend {
    /// An operator called outside any static block.
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError>;

    /// A static block invoked on evaluated arguments, from invocation site `site` (an index into
    /// `Program::sites`). The backend takes the arguments out of `args`; the caller reuses the
    /// vector for the next invocation (one allocation fewer per invocation).
    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError>;

    /// `n` ghost operators (ACROBAT Fig. 3): scheduling-only, nothing is computed. Backends that
    /// schedule by inline depth advance it; others ignore them.
    fn ghost(&mut self, _ctx: &mut InstanceCtx, _n: u32) {}

    /// The truth value of an `if` condition, or `None` if it is not computed yet (the instance
    /// then suspends until the backend has computed it).
    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError>;

    /// Whether the arguments of an operator called outside a block are computed. Such operators
    /// (random draws) run on the host in the instance's program order, so an argument still
    /// pending in a lazy backend (`random.db_uniform(0, %n)` with `%n` from a block) suspends the
    /// instance, like an unready `if` condition, until the backend has computed it.
    fn op_args_ready(&mut self, _args: &[Value]) -> Result<bool, RunError> {
        Ok(true)
    }

    /// What this backend holds that grows with the run (e.g. "1,200,000 dataflow nodes not yet
    /// run"), for the message when a run exceeds its memory budget; empty if nothing.
    fn growth(&self) -> String {
        String::new()
    }
}

/// How a call to [`Machine::run`] ended.
pub enum Outcome {
    Done(Value),
    /// Waiting for a tensor value; call `run` again once the backend has computed it.
    Blocked,
    /// At a `db.phase_change()` boundary; calling `run` again passes it.
    Phase,
}

/// A run-time failure, located at the program point that failed where known. Boxed: every
/// evaluation step returns a `Result<_, RunError>`, and the failure is rare, so the success path
/// moves a value the size of a [`Value`] instead of one the size of the error's fields.
#[derive(Debug, Clone)]
pub struct RunError(Box<RunErrorInfo>);

/// What a [`RunError`] says (its fields, reached through it).
#[derive(Debug, Clone)]
pub struct RunErrorInfo {
    pub message: String,
    pub span: Option<Span>,
    /// The calls that led to the failure, innermost first (a failure inside a prelude function
    /// names the user's call of it); calls in tail position leave no frame and are not listed.
    pub trace: Vec<Span>,
    /// A broken invariant of tumble itself (a bug), not a problem with the user's program or
    /// data: the faces report it as a bug to report, with their own exit status.
    pub internal: bool,
}

/// What the runtime's own invariant checks put in their messages (`internal: ...`): a message
/// that carries it, however it was wrapped, makes an internal error.
const INTERNAL: &str = "internal:";

impl RunError {
    pub fn at(span: Span, message: impl Into<String>) -> Self {
        let message = message.into();
        RunError(Box::new(RunErrorInfo {
            internal: message.contains(INTERNAL),
            message,
            span: Some(span),
            trace: Vec::new(),
        }))
    }

    pub fn new(message: impl Into<String>) -> Self {
        let message = message.into();
        RunError(Box::new(RunErrorInfo {
            internal: message.contains(INTERNAL),
            message,
            span: None,
            trace: Vec::new(),
        }))
    }

    /// A broken invariant of tumble itself.
    pub fn internal(message: impl Into<String>) -> Self {
        RunError(Box::new(RunErrorInfo {
            message: format!("{INTERNAL} {}", message.into()),
            span: None,
            trace: Vec::new(),
            internal: true,
        }))
    }

    /// The error's fields, to take apart.
    pub fn into_info(self) -> RunErrorInfo {
        *self.0
    }

    /// The note the faces print under an internal error.
    pub const BUG_NOTE: &'static str = "this is a bug in tumble, not in the model or its inputs: \
        please report it with the model, the instances and the command line";
}

impl std::ops::Deref for RunError {
    type Target = RunErrorInfo;
    fn deref(&self) -> &RunErrorInfo {
        &self.0
    }
}

impl std::ops::DerefMut for RunError {
    fn deref_mut(&mut self) -> &mut RunErrorInfo {
        &mut self.0
    }
}

/// Emptied argument vectors the evaluator keeps for reuse, at most.
const VALS_POOL_MAX: usize = 256;

/// Pending calls beyond this are reported as runaway recursion instead of exhausting memory.
pub const MAX_PENDING: usize = 50_000_000;

/// The error for a run stopped by its limits: an interrupt says only that, a time limit that and
/// `hint`; a memory budget also says what the run holds (`held`, empty parts skipped) and `hint`.
pub fn limit_error(stop: tumble_limits::Stop, held: Vec<String>, hint: &str) -> RunError {
    match stop {
        tumble_limits::Stop::Interrupted => return RunError::new(stop.to_string()),
        tumble_limits::Stop::TimedOut { .. } => return RunError::new(format!("{stop}{hint}")),
        tumble_limits::Stop::Memory { .. } => {}
    }
    let held: Vec<String> = held.into_iter().filter(|h| !h.is_empty()).collect();
    if held.is_empty() {
        return RunError::new(format!("{stop}{hint}"));
    }
    RunError::new(format!(
        "{stop}; the run holds {}{hint}",
        held.join(" and ")
    ))
}

/// Calls listed in an error's trace, innermost first.
pub const MAX_TRACE: usize = 8;

/// What a run stopped at a limit adds to its message when one instance has this many
/// evaluations pending: deep pending work is what a recursion without a base case grows, whichever
/// allocation (the evaluator's stack, the graph's node table) crossed the budget first.
pub fn runaway_hint(pending: usize) -> &'static str {
    if pending >= 100_000 {
        " (a recursion without a base case?)"
    } else {
        ""
    }
}

/// Steps between two looks at the run limits (memory budget, Ctrl-C): a step costs tens of
/// nanoseconds, so a runaway is noticed within a fraction of a millisecond of crossing a limit.
const POLL_EVERY: u32 = 4096;

struct Frame {
    slots: Vec<Option<Value>>,
    /// The closure being run, for `SelfRef`.
    this: Option<Value>,
    /// The call that entered this frame, for the call trace of an error.
    call_site: Option<Span>,
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
    },
    If(&'p Code, &'p Code),
    Match {
        arms: &'p [(Pat, Code)],
        span: Span,
    },
    /// Evaluating independent elements: each starts at depth `start`; the join takes `max`
    /// and makes `join` of the values.
    Concurrent {
        join: Join,
        elems: &'p [Code],
        vals: Vec<Value>,
        start: u32,
        max: u32,
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

/// How a function runs as a loop over a list, and the code it runs per element
/// ([`Machine::loop_code`]).
#[derive(Clone, Copy)]
enum LoopCode<'p> {
    Map(MapLoop, &'p Code),
    Fold(FoldLoop, &'p Code),
    Scan(&'p ScanLoop, &'p [(u32, Code)]),
}

impl LoopCode<'_> {
    /// The parameter holding the list.
    fn list(self) -> u32 {
        match self {
            LoopCode::Map(ml, _) => ml.list,
            LoopCode::Fold(fl, _) => fl.list,
            LoopCode::Scan(sl, _) => sl.list,
        }
    }
}

enum Step<'p> {
    Eval(&'p Code),
    Apply(Value),
    /// An operator call outside a block whose operands are evaluated; kept as a step so that the
    /// machine can suspend before it when an operand is not computed yet.
    CallOp(&'p Code, Vec<Value>),
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
    /// When set, the run stops with an error once this time has passed (looked at with the run
    /// limits): a served request's `--timeout-ms`, so that an instance that never suspends (a
    /// recursion without a base case in constant memory) cannot hold the batch thread forever.
    deadline: Option<std::time::Instant>,
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
    pub ctx: InstanceCtx,
}

/// Field-less constructor values (`Nil`, `True`), `()` and globals used as values, each made on
/// first use and then shared: values are immutable, so handing out one `Rc` for all uses is
/// unobservable, where making each afresh was an allocation and a free (a list's `Nil`, every
/// `if`'s `True`/`False`, every empty tuple). `TUMBLE_NO_SHARED_VALUES=1` makes each afresh.
struct SharedValues {
    on: bool,
    unit: Option<Value>,
    /// By constructor index; `None` until first made.
    nullary: Vec<Option<Value>>,
    /// By global index.
    globals: Vec<Option<Value>>,
}

impl SharedValues {
    fn new() -> Self {
        static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let off = *OFF.get_or_init(|| std::env::var_os("TUMBLE_NO_SHARED_VALUES").is_some());
        SharedValues {
            on: !off,
            unit: None,
            nullary: Vec::new(),
            globals: Vec::new(),
        }
    }

    fn unit(&mut self) -> Value {
        if !self.on {
            return Value::unit();
        }
        self.unit.get_or_insert_with(Value::unit).clone()
    }

    /// Field-less constructor `c`.
    fn nullary(&mut self, c: u32) -> Value {
        if !self.on {
            return Value::adt(c, Fields::new());
        }
        Self::cached(&mut self.nullary, c, || Value::adt(c, Fields::new()))
    }

    /// Global `g` as a function value.
    fn global(&mut self, g: u32) -> Value {
        if !self.on {
            return Value::Closure(Rc::new(Closure::Global(g)));
        }
        Self::cached(&mut self.globals, g, || {
            Value::Closure(Rc::new(Closure::Global(g)))
        })
    }

    fn cached(table: &mut Vec<Option<Value>>, i: u32, make: impl FnOnce() -> Value) -> Value {
        let i = i as usize;
        if table.len() <= i {
            table.resize(i + 1, None);
        }
        match table.get_mut(i) {
            Some(v) => v.get_or_insert_with(make).clone(),
            None => make(),
        }
    }
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

impl<'p> Machine<'p> {
    pub fn new(program: &'p Program, ctx: InstanceCtx) -> Self {
        Machine {
            program,
            frame: Frame {
                slots: Vec::new(),
                this: None,
                call_site: None,
            },
            stack: Vec::new(),
            pending: None,
            at_phase: false,
            slot_pool: Vec::new(),
            vals_pool: Vec::new(),
            binds: Vec::new(),
            poll_in: POLL_EVERY,
            deadline: None,
            steps_before: 0,
            params: Vec::new(),
            shared: SharedValues::new(),
            fold_loops: {
                static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                !*OFF.get_or_init(|| std::env::var_os("TUMBLE_NO_FOLD_LOOPS").is_some())
            },
            scan_loops: {
                static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                !*OFF.get_or_init(|| std::env::var_os("TUMBLE_NO_SCAN_LOOPS").is_some())
            },
            calls_at_once: {
                static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                !*OFF.get_or_init(|| std::env::var_os("TUMBLE_NO_CALLS_AT_ONCE").is_some())
            },
            wider_at_once: {
                static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                !*OFF.get_or_init(|| std::env::var_os("TUMBLE_NO_WIDER_AT_ONCE").is_some())
            },
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
        self.run_steps(backend).map_err(|mut e| {
            if e.trace.is_empty() {
                e.trace = self.call_trace();
            }
            e
        })
    }

    /// Calls `f` with every value this instance holds between two `run`s — its frames' slots and
    /// closures, the values its continuations have gathered, the step it resumes with — but for
    /// its entry arguments and the shared constants, which are never lazy (the batching runtime's
    /// early release: a recorded node none of these names can be freed once no node reads it).
    pub fn visit_values(&self, f: &mut dyn FnMut(&Value)) {
        let frame = |fr: &Frame, f: &mut dyn FnMut(&Value)| {
            fr.slots.iter().flatten().for_each(&mut *f);
            fr.this.iter().for_each(&mut *f);
        };
        frame(&self.frame, f);
        self.binds.iter().for_each(|(_, v)| f(v));
        for k in &self.stack {
            match k {
                Kont::Operands { vals, .. }
                | Kont::Tuple { vals, .. }
                | Kont::Concurrent { vals, .. } => vals.iter().for_each(&mut *f),
                Kont::MapLoop { items, vals, .. } => {
                    items.iter().chain(vals).for_each(&mut *f);
                }
                Kont::FoldLoop { items, .. } => items.iter().for_each(&mut *f),
                Kont::ScanLoop { items, vals, .. } => items.iter().chain(vals).for_each(&mut *f),
                Kont::Return(fr) => frame(fr, f),
                Kont::Proj(..) | Kont::Let { .. } | Kont::If(..) | Kont::Match { .. } => {}
            }
        }
        match &self.pending {
            Some(Step::Apply(v)) => f(v),
            Some(Step::CallOp(_, vs)) => vs.iter().for_each(&mut *f),
            Some(Step::Eval(_)) | None => {}
        }
    }

    /// Turns the wider at-once evaluation on or off for this machine (see
    /// [`Machine::at_once`]; by default on, unless `TUMBLE_NO_WIDER_AT_ONCE` is set): the
    /// recorded graph is the same either way.
    pub fn set_wider_at_once(&mut self, on: bool) {
        self.wider_at_once = on;
    }

    /// Evaluation steps taken so far (for the profile: the host program's cost per step).
    pub fn steps(&self) -> u64 {
        self.steps_before + u64::from(POLL_EVERY - self.poll_in)
    }

    /// The call sites of the current frame and of the frames waiting to be returned to,
    /// innermost first, at most [`MAX_TRACE`] of them (a runaway recursion has millions).
    fn call_trace(&self) -> Vec<Span> {
        let outer = self.stack.iter().rev().filter_map(|k| match k {
            Kont::Return(f) => f.call_site,
            _ => None,
        });
        self.frame
            .call_site
            .into_iter()
            .chain(outer)
            .take(MAX_TRACE)
            .collect()
    }

    fn run_steps(&mut self, backend: &mut dyn Backend) -> Result<Outcome, RunError> {
        let Some(mut step) = self.pending.take() else {
            return Err(RunError::new("internal: nothing to run"));
        };
        loop {
            self.tick(backend)?;
            step = match step {
                Step::Eval(Code::Phase) => {
                    if self.at_phase {
                        self.at_phase = false;
                        self.ctx.phase += 1;
                        Step::Apply(self.shared.unit())
                    } else {
                        self.at_phase = true;
                        self.pending = Some(step);
                        return Ok(Outcome::Phase);
                    }
                }
                Step::Eval(code) => self.eval(code, backend)?,
                Step::CallOp(code, vals) => {
                    if !backend.op_args_ready(&vals)? {
                        self.pending = Some(Step::CallOp(code, vals));
                        return Ok(Outcome::Blocked);
                    }
                    self.call(code, vals, backend)?
                }
                Step::Apply(v) => match self.stack.pop() {
                    None => return Ok(Outcome::Done(v)),
                    Some(Kont::If(t, f)) => match backend.condition(&v)? {
                        Some(c) => Step::Eval(if c { t } else { f }),
                        None => {
                            self.stack.push(Kont::If(t, f));
                            self.pending = Some(Step::Apply(v));
                            return Ok(Outcome::Blocked);
                        }
                    },
                    Some(k) => self.resume(k, v, backend)?,
                },
            };
        }
    }

    /// Counts one evaluation step, looking at the run limits every [`POLL_EVERY`] steps.
    fn tick(&mut self, backend: &dyn Backend) -> Result<(), RunError> {
        self.poll_in -= 1;
        if self.poll_in == 0 {
            self.poll_in = POLL_EVERY;
            self.steps_before += u64::from(POLL_EVERY);
            self.check_limits(backend)?;
        }
        Ok(())
    }

    /// Sets (or clears) the time after which the run stops with an error (see `deadline`).
    pub fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.deadline = deadline;
    }

    /// Stops the run when it was interrupted, is over its memory budget (saying what grew) or
    /// ran past its deadline.
    fn check_limits(&self, backend: &dyn Backend) -> Result<(), RunError> {
        if self
            .deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
        {
            return Err(RunError::new(format!(
                "stopped after {} evaluation steps: the instance ran past its deadline (a \
                 recursion without a base case?)",
                self.steps()
            )));
        }
        let Err(stop) = tumble_limits::poll() else {
            return Ok(());
        };
        let held = vec![
            format!(
                "{} pending evaluations in this instance",
                tumble_limits::count_text(self.stack.len())
            ),
            backend.growth(),
        ];
        Err(limit_error(stop, held, runaway_hint(self.stack.len())))
    }

    fn push(&mut self, k: Kont<'p>) -> Result<(), RunError> {
        if self.stack.len() >= MAX_PENDING {
            return Err(RunError::new(format!(
                "recursion too deep: more than {MAX_PENDING} pending evaluations (runaway recursion?)"
            )));
        }
        if self.stack.len() == self.stack.capacity() {
            // The stack doubles: check that growth against the memory budget before it happens.
            let more = self.stack.capacity().max(4) * std::mem::size_of::<Kont>();
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

    /// The value of code that needs no evaluation step of its own — a variable, a literal, a
    /// global, a field of a variable — or `None`. Operands, tuple elements and `let` values are
    /// mostly such code: taking them at once saves a continuation push and pop and a trip through
    /// the run loop each (they have no effects, so the evaluation order is unchanged).
    fn immediate(&mut self, code: &Code) -> Option<Result<Value, RunError>> {
        match code {
            Code::Slot(s) => Some(self.slot(*s)),
            Code::Param(k) => Some(self.param(*k)),
            Code::Lit(t) => Some(Ok(Value::Tensor(t.clone()))),
            Code::Global(g) => Some(Ok(self.shared.global(*g))),
            Code::Ctor(c) if self.shared.on && self.arity(*c) == 0 => {
                Some(Ok(self.shared.nullary(*c)))
            }
            // The field is taken where the tuple lies (no count up and down on the tuple).
            Code::Proj(inner, i, span) => match &**inner {
                Code::Slot(s) => Some(self.slot_ref(*s).and_then(|v| project(v, *i, *span))),
                Code::Param(k) => Some(self.param_ref(*k).and_then(|v| project(v, *i, *span))),
                _ => None,
            },
            _ => None,
        }
    }

    /// The values of `codes` when every one is immediate ([`Machine::immediate`]), in a vector
    /// from the pool; `None` at the first that is not. Immediate code has no effects: giving up
    /// there leaves nothing to undo but the values taken so far.
    fn immediates(&mut self, codes: &[Code]) -> Option<Result<Vec<Value>, RunError>> {
        let mut vals = self.pooled();
        for c in codes {
            match self.immediate(c) {
                Some(Ok(v)) => vals.push(v),
                Some(Err(e)) => return Some(Err(e)),
                None => {
                    self.give_back(vals);
                    return None;
                }
            }
        }
        Some(Ok(vals))
    }

    /// The value of `code` without a step of its own, when it has one: [`Machine::immediate`]
    /// code, or — with the native fast paths — a block invocation whose operands are all
    /// immediate. An invocation records a node (or runs on the host) and returns at once; it never
    /// suspends, so performing it here instead of in a step of its own changes nothing but the
    /// step count.
    fn at_once(
        &mut self,
        code: &'p Code,
        backend: &mut dyn Backend,
    ) -> Option<Result<Value, RunError>> {
        if let Some(v) = self.immediate(code) {
            return Some(v);
        }
        if !self.program.natives.fast_steps {
            return None;
        }
        // A native prelude function (`@hd`, `@tl`, ..) of immediate operands: a pure function
        // of values at hand, computed where it is read.
        if let Code::CallGlobal { global, args, span } = code {
            let Some(native) = self.program.natives.of(*global) else {
                // One look at the callee's shape: a loop's function is taken as a loop or not
                // at all (its body's arms would only be chosen to be declined).
                let lambda = self.global(*global).ok()?;
                return match self.loop_code(*global, lambda) {
                    Some(shape) => self.loop_at_once(shape, lambda, args, *span, backend),
                    None => self.call_at_once(lambda, args, *span, backend),
                };
            };
            let vals = match self.immediates(args)? {
                Ok(vals) => vals,
                Err(e) => return Some(Err(e)),
            };
            return Some(match self.native(native, vals, *span) {
                Ok(Step::Apply(v)) => Ok(v),
                Ok(_) => Err(RunError::new(
                    "internal: a native call did not return a value",
                )),
                Err(e) => Err(e),
            });
        }
        let Code::InvokeBlock { args, .. } = code else {
            return self.wider_at_once(code, backend);
        };
        let vals = match self.immediates(args)? {
            Ok(vals) => vals,
            Err(e) => return Some(Err(e)),
        };
        Some(match self.call(code, vals, backend) {
            Ok(Step::Apply(v)) => Ok(v),
            Ok(_) => Err(RunError::new(
                "internal: a block invocation did not return a value",
            )),
            Err(e) => Err(e),
        })
    }

    /// [`Machine::at_once`] for constructors and tuples of immediate operands (pure), and for
    /// code that chooses by values at hand: an `if` whose condition is immediate and computed,
    /// a `match` on an immediate value whose chosen arm is [`Machine::total_at_once`], ghost
    /// operators before such code. `None` leaves nothing done: a condition not computed yet,
    /// no arm matching (the step path reports it), or a form not taken — an arm's bindings and
    /// a ghost's depth are only made where what follows surely completes.
    fn wider_at_once(
        &mut self,
        code: &'p Code,
        backend: &mut dyn Backend,
    ) -> Option<Result<Value, RunError>> {
        if !self.wider_at_once {
            return None;
        }
        match code {
            Code::CallCtor { ctor, args } => {
                let vals = match self.immediates(args)? {
                    Ok(vals) => vals,
                    Err(e) => return Some(Err(e)),
                };
                if vals.is_empty() {
                    self.give_back(vals);
                    return Some(Ok(self.shared.nullary(*ctor)));
                }
                let fields = self.fields_of(vals);
                Some(Ok(Value::adt(*ctor, fields)))
            }
            Code::Tuple(elems) if elems.is_empty() => Some(Ok(self.shared.unit())),
            Code::Tuple(elems) => {
                let mut vals = Fields::new();
                for e in elems {
                    match self.immediate(e)? {
                        Ok(v) => vals.push(v),
                        Err(e) => return Some(Err(e)),
                    }
                }
                Some(Ok(Value::tuple(vals)))
            }
            Code::If(c, t, f) => {
                let v = match self.immediate(c)? {
                    Ok(v) => v,
                    Err(e) => return Some(Err(e)),
                };
                match backend.condition(&v) {
                    Ok(Some(b)) => self.at_once(if b { t } else { f }, backend),
                    Ok(None) => None,
                    Err(e) => Some(Err(e)),
                }
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                let v = match self.immediate(scrutinee)? {
                    Ok(v) => v,
                    Err(e) => return Some(Err(e)),
                };
                let body = self.choose_arm(arms, &v).filter(|b| self.total_at_once(b));
                match body {
                    Some(_) => self.bind_arm(),
                    None => self.binds.clear(),
                }
                self.at_once(body?, backend)
            }
            Code::Ghost(n, body) if self.total_at_once(body) => {
                backend.ghost(&mut self.ctx, *n);
                self.at_once(body, backend)
            }
            _ => None,
        }
    }

    /// Whether [`Machine::at_once`] surely takes `code` (it returns a value or an error, never
    /// `None`): immediate code, and natives, block invocations, constructors and tuples of
    /// immediate operands, maybe after ghost operators. (Conditionals and matches may find
    /// nothing to take, so they are not.)
    fn total_at_once(&self, code: &Code) -> bool {
        match code {
            Code::Ghost(_, body) => self.wider_at_once && self.total_at_once(body),
            Code::CallCtor { args, .. } => {
                self.wider_at_once
                    && self.program.natives.fast_steps
                    && args.iter().all(|a| self.is_immediate(a))
            }
            Code::Tuple(elems) => {
                self.wider_at_once
                    && self.program.natives.fast_steps
                    && elems.iter().all(|a| self.is_immediate(a))
            }
            _ => self.takes_at_once(code),
        }
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

    /// Whether [`Machine::immediate`] takes `code` (decided by its form alone).
    fn is_immediate(&self, code: &Code) -> bool {
        match code {
            Code::Slot(_) | Code::Param(_) | Code::Lit(_) | Code::Global(_) => true,
            Code::Ctor(c) => self.shared.on && self.arity(*c) == 0,
            Code::Proj(inner, ..) => matches!(**inner, Code::Slot(_) | Code::Param(_)),
            _ => false,
        }
    }

    /// Whether [`Machine::at_once`] takes `code` without a step and without effects (decided by
    /// its form alone: immediate code, or a native call of immediate operands).
    fn pure_at_once(&self, code: &Code) -> bool {
        self.is_immediate(code)
            || matches!(code, Code::CallGlobal { global, args, .. }
                if self.program.natives.fast_steps
                    && self.program.natives.of(*global).is_some()
                    && args.iter().all(|a| self.is_immediate(a)))
    }

    /// Whether [`Machine::at_once`] takes `code` without a step, other than as a loop (decided
    /// by its form alone: [`Machine::pure_at_once`] code, or a block invocation of immediate
    /// operands).
    fn takes_at_once(&self, code: &Code) -> bool {
        self.pure_at_once(code)
            || matches!(code, Code::InvokeBlock { args, .. }
                if self.program.natives.fast_steps && args.iter().all(|a| self.is_immediate(a)))
    }

    /// A call of a function run as a loop over its list (`@map`'s or `@foldl`'s shape) whose
    /// element code [`Machine::at_once`] takes, performed where it is read: the loop's frame is
    /// made and dropped here, and [`Machine::map_next`] or [`Machine::fold_next`] runs its
    /// elements — the step path's own loops, so the same depths and invocations —
    /// without the call's step, its return's, or the caller's continuation. (TreeLSTM: the maps
    /// over a node's child states and the folds summing them, 12 of the ~20 steps of an inner
    /// node.) `None`, nothing done, for any other call or operands that are not immediate.
    fn loop_at_once(
        &mut self,
        shape: LoopCode<'p>,
        lambda: &'p Lambda,
        args: &'p [Code],
        span: Span,
        backend: &mut dyn Backend,
    ) -> Option<Result<Value, RunError>> {
        if !self.program.natives.fast_steps || !self.wider_at_once {
            return None;
        }
        let natives = &self.program.natives;
        let list = shape.list();
        let at_once = match shape {
            LoopCode::Map(_, c) | LoopCode::Fold(_, c) => self.takes_at_once(c),
            LoopCode::Scan(_, binds) => binds.iter().all(|(_, c)| self.takes_at_once(c)),
        };
        if !at_once || !args.iter().all(|a| self.pure_at_once(a)) {
            return None;
        }
        // (`@foldl(%f, @hd(%xs), @tl(%xs))`: operands computed at once, without effects.)
        let mut vals = self.pooled();
        for a in args {
            match self.at_once(a, backend)? {
                Ok(v) => vals.push(v),
                Err(e) => return Some(Err(e)),
            }
        }
        let (cons, nil) = (natives.cons, natives.nil);
        // Not a list (which the type checker rules out): the ordinary call reports it.
        let pooled = self.pooled();
        let Some(Ok(items)) = vals
            .get(list as usize)
            .map(|v| list_items_into(v, cons, nil, pooled))
        else {
            self.give_back(vals);
            return None;
        };
        let frame = match self.frame_for(lambda, vals, None, &[], Some(span)) {
            Ok(frame) => frame,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = self.enter_at_once(frame) {
            return Some(Err(e));
        }
        // The loops the step path runs, from the last element (they pop); every element is
        // taken at once (checked above), so they finish without a continuation.
        let mut items = items;
        items.reverse();
        let start = self.ctx.depth;
        let step = match shape {
            LoopCode::Map(ml, elem) => {
                let vals = self.pooled();
                self.map_next(ml, elem, items, vals, start, start, backend)
            }
            LoopCode::Fold(fl, step) => self.fold_next(fl, step, items, backend),
            LoopCode::Scan(sl, binds) => {
                self.scan_next(sl, binds, None, items, Vec::new(), backend)
            }
        };
        let value = match step {
            Ok(Step::Apply(v)) => Ok(v),
            Ok(_) => Err(RunError::new(
                "internal: a loop's element code was not taken at once",
            )),
            Err(e) => Err(e),
        };
        if let Err(e) = self.leave_at_once() {
            return Some(Err(e));
        }
        Some(value)
    }

    /// How global `global` (whose body is `lambda`'s) runs as a loop over its list, if it does
    /// and its switch is on: the step path's calls and [`Machine::loop_at_once`] both ask here.
    fn loop_code(&self, global: u32, lambda: &'p Lambda) -> Option<LoopCode<'p>> {
        use tumble_compile::map_loop::{elem_of, fold_step_of, scan_binds_of};
        let natives = &self.program.natives;
        if let Some(ml) = natives.map_loop(global) {
            return Some(LoopCode::Map(ml, elem_of(&lambda.body)?));
        }
        if let Some(fl) = natives.fold_loop(global) {
            let step = fold_step_of(&lambda.body, fl).filter(|_| self.fold_loops)?;
            return Some(LoopCode::Fold(fl, step));
        }
        let sl = natives.scan_loop_ref(global).filter(|_| self.scan_loops)?;
        Some(LoopCode::Scan(sl, scan_binds_of(&lambda.body)?))
    }

    /// Makes `frame` current for code taken at once, the caller's frame waiting on the stack as
    /// in a call, so an error's call trace is the same.
    fn enter_at_once(&mut self, frame: Frame) -> Result<(), RunError> {
        let caller = std::mem::replace(&mut self.frame, frame);
        self.push(Kont::Return(caller))
    }

    /// Back to the caller's frame after [`Machine::enter_at_once`]; the finished frame's slots
    /// are kept for the next call.
    fn leave_at_once(&mut self) -> Result<(), RunError> {
        let Some(Kont::Return(caller)) = self.stack.pop() else {
            return Err(RunError::new(
                "internal: code taken at once lost its caller's frame",
            ));
        };
        let done = std::mem::replace(&mut self.frame, caller);
        self.recycle(done);
        Ok(())
    }

    /// A call of an ordinary global whose body is a `match` on one of its parameters, where the
    /// arm the argument chooses is [`Machine::total_at_once`] (TreeLSTM's leaf, `Rose(%tok, Nil)
    /// => @leaf(%tok, ..)`, half of a tree's calls): performed where it is read, in the callee's
    /// frame made and dropped here — the step path's call, match and arm without their steps, the
    /// return's, or the caller's continuation. The arm is chosen from the argument before
    /// anything is made, so `None` (an operand not immediate, no arm matching, an arm that may
    /// not complete at once: the recursive arms) leaves nothing done. Functions run as loops are
    /// [`Machine::loop_at_once`]'s.
    fn call_at_once(
        &mut self,
        lambda: &'p Lambda,
        args: &'p [Code],
        span: Span,
        backend: &mut dyn Backend,
    ) -> Option<Result<Value, RunError>> {
        if !self.wider_at_once || !self.calls_at_once {
            return None;
        }
        let Code::Match {
            scrutinee, arms, ..
        } = &lambda.body
        else {
            return None;
        };
        let Code::Slot(k) = **scrutinee else {
            return None;
        };
        if !lambda.captures.is_empty()
            || k >= lambda.n_params
            || args.len() != lambda.n_params as usize
            || !args.iter().all(|a| self.is_immediate(a))
        {
            return None;
        }
        let v = match self.immediate(args.get(k as usize)?)? {
            Ok(v) => v,
            Err(e) => return Some(Err(e)),
        };
        let Some(arm) = self.choose_arm(arms, &v).filter(|b| self.total_at_once(b)) else {
            self.binds.clear();
            return None;
        };
        // The arm's bindings wait here until the callee's frame is made (an error on the way
        // drops them, so none is left for the next match).
        let chosen = std::mem::take(&mut self.binds);
        let vals = match self.immediates(args)? {
            Ok(vals) => vals,
            Err(e) => return Some(Err(e)),
        };
        let frame = match self.frame_for(lambda, vals, None, &[], Some(span)) {
            Ok(frame) => frame,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = self.enter_at_once(frame) {
            return Some(Err(e));
        }
        self.binds = chosen;
        self.bind_arm();
        let value = match self.at_once(arm, backend) {
            Some(v) => v,
            None => Err(RunError::new(
                "internal: a call's arm was not taken at once",
            )),
        };
        if let Err(e) = self.leave_at_once() {
            return Some(Err(e));
        }
        Some(value)
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
        while let Some(next) = elems.get(vals.len()) {
            self.ctx.depth = start;
            match self.at_once(next, backend) {
                Some(v) => {
                    vals.push(v?);
                    // An invocation done at once advanced the depth like any other element.
                    max = max.max(self.ctx.depth);
                }
                None => {
                    self.push(Kont::Concurrent {
                        join,
                        elems,
                        vals,
                        start,
                        max,
                    })?;
                    return Ok(Step::Eval(next));
                }
            }
        }
        self.ctx.depth = max;
        Ok(Step::Apply(match join {
            Join::Tuple => Value::tuple(self.fields_of(vals)),
            Join::Ctor(ctor) => Value::adt(ctor, self.fields_of(vals)),
        }))
    }

    /// A `let` chain's bindings from `idx` on, immediate values (and block invocations of
    /// immediate operands) bound at once, then the body.
    fn let_from(
        &mut self,
        binds: &'p [(u32, Code)],
        mut idx: usize,
        body: &'p Code,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        while let Some((slot, code)) = binds.get(idx) {
            match self.at_once(code, backend) {
                Some(v) => {
                    let v = v?;
                    self.set_slot(*slot, v);
                    idx += 1;
                }
                None => {
                    self.push(Kont::Let { binds, idx, body })?;
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
            Code::Let { binds, body } => match self.concurrent_cell(binds, body) {
                Some((ctor, elems)) => {
                    let start = self.ctx.depth;
                    let vals = self.pooled();
                    self.concurrent_from(Join::Ctor(ctor), elems, vals, start, start, backend)?
                }
                None => self.let_from(binds, 0, body, backend)?,
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
            } => {
                vals.push(v);
                let max = max.max(self.ctx.depth);
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
            Kont::Let { binds, idx, body } => {
                if let Some((slot, _)) = binds.get(idx) {
                    self.set_slot(*slot, v);
                }
                self.let_from(binds, idx + 1, body, backend)?
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

    /// A call of a function with `@map`'s shape ([`tumble_compile::map_loop`]) as a loop: its
    /// frame is made as for any call, then the element code runs once per element with the
    /// element bound, each from the call's inline depth. A list argument that is not a list
    /// (which the type checker rules out) takes the ordinary call, and its error.
    fn map_loop(
        &mut self,
        lambda: &'p Lambda,
        ml: MapLoop,
        elem: &'p Code,
        args: Vec<Value>,
        span: Span,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        let items = match self.enter_list_loop(lambda, ml.list, args, span)? {
            Ok(items) => items,
            Err(interpreted) => return Ok(interpreted),
        };
        let start = self.ctx.depth;
        let vals = self.pooled();
        self.map_next(ml, elem, items, vals, start, start, backend)
    }

    /// The loop's elements from the last of `items` on (those [`Machine::at_once`] takes
    /// without a step of their own), then the list of `vals` at the deepest depth reached, the
    /// final `Nil`'s ghost operators counted as the interpreted recursion counts them.
    #[allow(clippy::too_many_arguments)]
    fn map_next(
        &mut self,
        ml: MapLoop,
        elem: &'p Code,
        mut items: Vec<Value>,
        mut vals: Vec<Value>,
        start: u32,
        max: u32,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        let mut max = max;
        while let Some(x) = items.pop() {
            // An element done at once takes no step of the run loop, and a list is as long as
            // the data: each counts as one, so the run limits are still looked at (Ctrl-C, the
            // memory budget) however long the list.
            self.tick(backend)?;
            self.ctx.depth = start;
            self.set_slot(ml.elem_slot, x);
            match self.at_once(elem, backend) {
                Some(v) => {
                    vals.push(v?);
                    max = max.max(self.ctx.depth);
                }
                None => {
                    self.push(Kont::MapLoop {
                        ml,
                        elem,
                        items,
                        vals,
                        start,
                        max,
                    })?;
                    return Ok(Step::Eval(elem));
                }
            }
        }
        self.ctx.depth = start;
        if ml.nil_ghosts > 0 {
            backend.ghost(&mut self.ctx, ml.nil_ghosts);
        }
        self.ctx.depth = max.max(self.ctx.depth);
        let (cons, nil) = (self.program.natives.cons, self.program.natives.nil);
        let tail = self.shared.nullary(nil);
        let list = list_of_drained(&mut vals, tail, cons);
        self.give_back(vals);
        self.give_back(items);
        Ok(Step::Apply(list))
    }

    /// The frame of a function run as a loop over the list in parameter `list`, made as for any
    /// call, and the list's elements, last first. A list argument that is not a list (which the
    /// type checker rules out) takes the ordinary call instead: `Err` holds its step.
    fn enter_list_loop(
        &mut self,
        lambda: &'p Lambda,
        list: u32,
        args: Vec<Value>,
        span: Span,
    ) -> Result<Result<Vec<Value>, Step<'p>>, RunError> {
        let (cons, nil) = (self.program.natives.cons, self.program.natives.nil);
        let pooled = self.pooled();
        let items = args
            .get(list as usize)
            .map(|v| list_items_into(v, cons, nil, pooled));
        let Some(Ok(mut items)) = items else {
            return self.enter(lambda, args, None, &[], Some(span)).map(Err);
        };
        items.reverse();
        self.install(lambda, args, None, &[], Some(span))?;
        Ok(Ok(items))
    }

    /// A call of a function with `@foldl`'s shape ([`tumble_compile::map_loop`]) as a loop: its
    /// frame is made as for any call, then the step code runs once per element with the element
    /// and the value so far bound, one after the other. A list argument that is not a list
    /// (which the type checker rules out) takes the ordinary call, and its error.
    fn fold_loop(
        &mut self,
        lambda: &'p Lambda,
        fl: FoldLoop,
        step: &'p Code,
        args: Vec<Value>,
        span: Span,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        match self.enter_list_loop(lambda, fl.list, args, span)? {
            Ok(items) => self.fold_next(fl, step, items, backend),
            Err(interpreted) => Ok(interpreted),
        }
    }

    /// The fold's elements from the last of `items` on (those [`Machine::at_once`] takes
    /// without a step of their own), each step's value the next one's accumulator, then the
    /// final `Nil`'s ghost operators and the accumulator, as the interpreted recursion ends.
    fn fold_next(
        &mut self,
        fl: FoldLoop,
        step: &'p Code,
        mut items: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        while let Some(x) = items.pop() {
            // One step per element, as in `map_next`: the run limits are looked at however
            // long the list.
            self.tick(backend)?;
            self.set_slot(fl.elem_slot, x);
            match self.at_once(step, backend) {
                Some(v) => self.set_slot(fl.acc, v?),
                None => {
                    self.push(Kont::FoldLoop { fl, step, items })?;
                    return Ok(Step::Eval(step));
                }
            }
        }
        if fl.nil_ghosts > 0 {
            backend.ghost(&mut self.ctx, fl.nil_ghosts);
        }
        self.give_back(items);
        Ok(Step::Apply(self.slot(fl.acc)?))
    }

    /// A call of a function with a scan's shape ([`tumble_compile::map_loop`]) as a loop: its
    /// frame is made as for any call, then the step's bindings run once per element with the
    /// element and the state so far bound, one element after the other. A list argument that
    /// is not a list (which the type checker rules out) takes the ordinary call, and its error.
    fn scan_loop(
        &mut self,
        lambda: &'p Lambda,
        sl: &'p ScanLoop,
        binds: &'p [(u32, Code)],
        args: Vec<Value>,
        span: Span,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        match self.enter_list_loop(lambda, sl.list, args, span)? {
            Ok(items) => {
                let vals = Vec::with_capacity(items.len());
                self.scan_next(sl, binds, None, items, vals, backend)
            }
            Err(interpreted) => Ok(interpreted),
        }
    }

    /// The scan from binding `at` of the current element's step on (`None`: no element
    /// begun), then the elements from the last of `items` on, each binding taken at once or in
    /// steps of its own; after an element's bindings, its output joins `vals` and the next state
    /// replaces the current one; at the end the final `Nil`'s ghost operators and the list of
    /// the outputs, as the interpreted recursion ends.
    fn scan_next(
        &mut self,
        sl: &'p ScanLoop,
        binds: &'p [(u32, Code)],
        mut at: Option<usize>,
        mut items: Vec<Value>,
        mut vals: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        loop {
            if let Some(mut idx) = at {
                while let Some((slot, code)) = binds.get(idx) {
                    match self.at_once(code, backend) {
                        Some(v) => self.set_slot(*slot, v?),
                        None => {
                            self.push(Kont::ScanLoop {
                                sl,
                                binds,
                                idx: idx as u32,
                                items,
                                vals,
                            })?;
                            return Ok(Step::Eval(code));
                        }
                    }
                    idx += 1;
                }
                // The recursion's `Cons(Y, @g(.., A, ..))`: reads of the bindings' slots.
                vals.push(self.bound_part(sl.head)?);
                let next = self.bound_part(sl.next)?;
                self.set_slot(sl.acc, next);
            }
            let Some(x) = items.pop() else { break };
            // One step per element, as in `map_next`: the run limits are looked at however
            // long the list.
            self.tick(backend)?;
            self.set_slot(sl.elem_slot, x);
            at = Some(0);
        }
        if sl.nil_ghosts > 0 {
            backend.ghost(&mut self.ctx, sl.nil_ghosts);
        }
        let (cons, nil) = (self.program.natives.cons, self.program.natives.nil);
        let tail = self.shared.nullary(nil);
        let list = list_of_drained(&mut vals, tail, cons);
        self.give_back(vals);
        self.give_back(items);
        Ok(Step::Apply(list))
    }

    /// Slot `slot`'s value, or its field `i`.
    fn bound_part(&self, (slot, field): (u32, Option<(u32, Span)>)) -> Result<Value, RunError> {
        match field {
            None => self.slot(slot),
            Some((i, span)) => project(self.slot_ref(slot)?, i, span),
        }
    }

    fn set_slot(&mut self, slot: u32, v: Value) {
        if let Some(s) = self.frame.slots.get_mut(slot as usize) {
            *s = Some(v);
        }
    }

    /// A call whose operands are evaluated: operator calls go through [`Step::CallOp`] (which may
    /// suspend), every other call is performed at once.
    fn call_step(
        &mut self,
        code: &'p Code,
        vals: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        match code {
            Code::CallOp { .. } => Ok(Step::CallOp(code, vals)),
            _ => self.call(code, vals, backend),
        }
    }

    /// Performs a call whose operands are evaluated.
    fn call(
        &mut self,
        code: &'p Code,
        mut vals: Vec<Value>,
        backend: &mut dyn Backend,
    ) -> Result<Step<'p>, RunError> {
        match code {
            Code::CallOp {
                op, attrs, span, ..
            } => Ok(Step::Apply(backend.call_op(
                &mut self.ctx,
                op,
                vals,
                attrs,
                *span,
            )?)),
            Code::InvokeBlock {
                block, site, span, ..
            } => Ok(Step::Apply({
                self.ctx.pending = self.stack.len();
                let mut vals = vals;
                let r = backend.invoke_block(&mut self.ctx, *block, *site, &mut vals, *span);
                self.give_back(vals);
                r.map_err(|mut e| {
                    // Copied from a callee's body: the call is the innermost frame.
                    let from = self.program.sites.get(*site as usize);
                    if let Some(call) = from.and_then(|s| s.inlined_from) {
                        if e.trace.is_empty() {
                            e.trace = self.call_trace();
                        }
                        e.trace.insert(0, call);
                        e.trace.truncate(MAX_TRACE);
                    }
                    e
                })?
            })),
            Code::CallCtor { ctor, .. } if vals.is_empty() => {
                self.give_back(vals);
                Ok(Step::Apply(self.shared.nullary(*ctor)))
            }
            Code::CallCtor { ctor, .. } => {
                let fields = self.fields_of(vals);
                Ok(Step::Apply(Value::adt(*ctor, fields)))
            }
            Code::CallGlobal { global, span, .. } => {
                if let Some(native) = self.program.natives.of(*global) {
                    return self.native(native, vals, *span);
                }
                let lambda = self.global(*global)?;
                match self.loop_code(*global, lambda) {
                    Some(LoopCode::Map(ml, elem)) => {
                        self.map_loop(lambda, ml, elem, vals, *span, backend)
                    }
                    Some(LoopCode::Fold(fl, step)) => {
                        self.fold_loop(lambda, fl, step, vals, *span, backend)
                    }
                    Some(LoopCode::Scan(sl, binds)) => {
                        self.scan_loop(lambda, sl, binds, vals, *span, backend)
                    }
                    None => self.enter(lambda, vals, None, &[], Some(*span)),
                }
            }
            Code::Call { span, .. } => {
                if vals.is_empty() {
                    return Err(RunError::at(*span, "internal: call without a callee"));
                }
                let callee = vals.remove(0);
                self.apply(callee, vals, *span)
            }
            _ => Err(RunError::new("internal: not a call")),
        }
    }

    fn lambda(&self, index: u32) -> Result<&'p Lambda, RunError> {
        self.program
            .lambdas
            .get(index as usize)
            .ok_or_else(|| RunError::new(format!("internal: no function {index}")))
    }

    fn global(&self, g: u32) -> Result<&'p Lambda, RunError> {
        let index = self
            .program
            .globals
            .get(g as usize)
            .ok_or_else(|| RunError::new(format!("internal: no global {g}")))?;
        self.lambda(*index)
    }

    /// The number of fields of constructor `c`.
    fn arity(&self, c: u32) -> usize {
        self.program.ctors.get(c as usize).map_or(0, |e| e.arity)
    }

    fn apply(&mut self, callee: Value, args: Vec<Value>, span: Span) -> Result<Step<'p>, RunError> {
        let Value::Closure(c) = &callee else {
            return Err(RunError::at(span, format!("cannot call {}", callee.kind())));
        };
        match &**c {
            Closure::Global(g) => {
                if let Some(native) = self.program.natives.of(*g) {
                    return self.native(native, args, span);
                }
                let lambda = self.global(*g)?;
                self.enter(lambda, args, None, &[], Some(span))
            }
            Closure::Ctor(ctor) => Ok(Step::Apply(Value::adt(*ctor, args))),
            Closure::Lambda { lambda, captured } => {
                let lambda = self.lambda(*lambda)?;
                // Installed straight from the closure: no copy of the captured list per call.
                self.install(lambda, args, Some(callee.clone()), captured, Some(span))?;
                Ok(Step::Eval(&lambda.body))
            }
        }
    }

    /// A prelude list function run as one step ([`Native`]): the same list the prelude's body
    /// builds, without interpreting it element by element.
    fn native(
        &mut self,
        native: Native,
        mut args: Vec<Value>,
        span: Span,
    ) -> Result<Step<'p>, RunError> {
        let (cons, nil) = (self.program.natives.cons, self.program.natives.nil);
        if args.len() != native.arity() {
            return Err(RunError::at(
                span,
                format!(
                    "internal: `@{}` takes {} arguments, got {}",
                    native.name(),
                    native.arity(),
                    args.len()
                ),
            ));
        }
        let items = |v: &Value| -> Result<Vec<Value>, RunError> {
            list_items(v, cons, nil).map_err(|kind| {
                RunError::at(
                    span,
                    format!("internal: `@{}` of {kind}, not a list", native.name()),
                )
            })
        };
        let build = |items: Vec<Value>, tail: Value| list_of(items, tail, cons);
        let first = |v: &Value, field: usize| -> Result<Value, RunError> {
            match v {
                Value::Adt(a) if a.ctor == cons => a
                    .fields
                    .get(field)
                    .cloned()
                    .ok_or_else(|| RunError::at(span, "internal: malformed list cell")),
                Value::Adt(a) if a.ctor == nil => Err(RunError::at(
                    span,
                    format!("`@{}` of an empty list (`Nil`)", native.name()),
                )),
                other => Err(RunError::at(
                    span,
                    format!(
                        "internal: `@{}` of {}, not a list",
                        native.name(),
                        other.kind()
                    ),
                )),
            }
        };
        let xs = args.remove(0);
        let v = match native {
            Native::Hd => first(&xs, 0)?,
            Native::Tl => first(&xs, 1)?,
            Native::Rev => items(&xs)?
                .into_iter()
                .fold(self.shared.nullary(nil), |rest, x| {
                    Value::adt(cons, smallvec![x, rest])
                }),
            Native::Zip => {
                let (a, b) = (items(&xs)?, items(&args.remove(0))?);
                let pairs = a
                    .into_iter()
                    .zip(b)
                    .map(|(x, y)| Value::tuple(smallvec![x, y]))
                    .collect();
                build(pairs, self.shared.nullary(nil))
            }
            Native::Concat => {
                let ys = args.remove(0);
                build(items(&xs)?, ys)
            }
        };
        Ok(Step::Apply(v))
    }

    fn enter(
        &mut self,
        lambda: &'p Lambda,
        args: Vec<Value>,
        this: Option<Value>,
        captured: &[Value],
        call_site: Option<Span>,
    ) -> Result<Step<'p>, RunError> {
        self.install(lambda, args, this, captured, call_site)?;
        Ok(Step::Eval(&lambda.body))
    }

    /// Makes a new frame for `lambda` current, saving the caller's unless this is a tail call.
    fn install(
        &mut self,
        lambda: &Lambda,
        args: Vec<Value>,
        this: Option<Value>,
        captured: &[Value],
        call_site: Option<Span>,
    ) -> Result<(), RunError> {
        let frame = self.frame_for(lambda, args, this, captured, call_site)?;
        let caller = std::mem::replace(&mut self.frame, frame);
        // In tail position the caller's frame is dead: don't stack another return.
        if !matches!(self.stack.last(), Some(Kont::Return(_))) {
            self.push(Kont::Return(caller))?;
        } else {
            self.recycle(caller);
        }
        Ok(())
    }

    /// A new frame for `lambda`: its parameters bound to `args`, its captures to `captured`.
    fn frame_for(
        &mut self,
        lambda: &Lambda,
        mut args: Vec<Value>,
        this: Option<Value>,
        captured: &[Value],
        call_site: Option<Span>,
    ) -> Result<Frame, RunError> {
        if args.len() != lambda.n_params as usize {
            return Err(RunError::new(format!(
                "`{}` takes {} arguments, got {}",
                lambda.name,
                lambda.n_params,
                args.len()
            )));
        }
        let mut slots: Vec<Option<Value>> = self.slot_pool.pop().unwrap_or_default();
        slots.reserve(lambda.n_slots as usize);
        slots.extend(args.drain(..).map(Some));
        self.give_back(args);
        slots.resize(lambda.n_slots as usize, None);
        for ((_, slot), v) in lambda.captures.iter().zip(captured) {
            if let Some(s) = slots.get_mut(*slot as usize) {
                *s = Some(v.clone());
            }
        }
        Ok(Frame {
            slots,
            this,
            call_site,
        })
    }

    /// An emptied vector from the pool (a new one when the pool is empty).
    #[inline]
    fn pooled(&mut self) -> Vec<Value> {
        self.vals_pool.pop().unwrap_or_default()
    }

    /// A vector back to the pool, emptied (up to the pool's bound).
    #[inline]
    fn give_back(&mut self, mut vals: Vec<Value>) {
        vals.clear();
        if self.vals_pool.len() < VALS_POOL_MAX {
            self.vals_pool.push(vals);
        }
    }

    /// A constructor's or tuple's fields from operand vector `vals`, which goes back to the pool.
    fn fields_of(&mut self, mut vals: Vec<Value>) -> Fields {
        let fields = vals.drain(..).collect();
        self.give_back(vals);
        fields
    }

    /// Keeps a finished frame's slot vector for the next call (calls are the machine's most frequent
    /// allocation).
    fn recycle(&mut self, frame: Frame) {
        let mut slots = frame.slots;
        slots.clear();
        if self.slot_pool.len() < 256 {
            self.slot_pool.push(slots);
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

/// The elements of list `v` (cells of constructor `cons`, ended by `nil`), first first; the kind
/// of the first value that is neither.
fn list_items(v: &Value, cons: u32, nil: u32) -> Result<Vec<Value>, &'static str> {
    list_items_into(v, cons, nil, Vec::new())
}

/// [`list_items`] appended to `out` (an emptied vector from the pool), the cells walked by
/// reference.
fn list_items_into(
    v: &Value,
    cons: u32,
    nil: u32,
    mut out: Vec<Value>,
) -> Result<Vec<Value>, &'static str> {
    let mut at = v;
    loop {
        match at {
            Value::Adt(a) if a.ctor == cons && a.fields.len() == 2 => {
                out.push(a.fields[0].clone());
                at = &a.fields[1];
            }
            Value::Adt(a) if a.ctor == nil => return Ok(out),
            other => return Err(other.kind()),
        }
    }
}

/// The list of `items` in order, ending in `tail`.
fn list_of(items: Vec<Value>, tail: Value, cons: u32) -> Value {
    let mut items = items;
    list_of_drained(&mut items, tail, cons)
}

/// [`list_of`] taking the items out of `items`, which is left empty (for the pool).
fn list_of_drained(items: &mut Vec<Value>, tail: Value, cons: u32) -> Value {
    items
        .drain(..)
        .rev()
        .fold(tail, |rest, x| Value::adt(cons, smallvec![x, rest]))
}

/// Field `i` of a tuple value.
fn project(v: &Value, i: u32, span: Span) -> Result<Value, RunError> {
    match v {
        Value::Tuple(t) => {
            t.0.get(i as usize)
                .cloned()
                .ok_or_else(|| RunError::at(span, format!("tuple has no field {i}")))
        }
        other => Err(RunError::at(
            span,
            format!("cannot project field {i} of {}", other.kind()),
        )),
    }
}

/// Tests `v` against `pat`, collecting the slots to bind. Pattern depth is bounded by the parser.
fn matches(pat: &Pat, v: &Value, binds: &mut Vec<(u32, Value)>) -> bool {
    match (pat, v) {
        (Pat::Wild, _) => true,
        (Pat::Bind(s), _) => {
            binds.push((*s, v.clone()));
            true
        }
        (Pat::Ctor(c, ps), Value::Adt(a)) => {
            a.ctor == *c
                && ps.len() == a.fields.len()
                && ps.iter().zip(&a.fields).all(|(p, f)| matches(p, f, binds))
        }
        (Pat::Tuple(ps), Value::Tuple(t)) => {
            ps.len() == t.0.len() && ps.iter().zip(&t.0).all(|(p, f)| matches(p, f, binds))
        }
        _ => false,
    }
}

/// A short description of a value for error messages: the constructor name, or the tensor's type.
fn describe(program: &Program, v: &Value) -> String {
    match v {
        Value::Adt(a) => program.ctors.get(a.ctor as usize).map_or_else(
            || "a constructor value".into(),
            |c| format!("`{}(..)`", c.name),
        ),
        Value::Tensor(t) => format!("{t}"),
        other => other.kind().to_string(),
    }
}

pub fn to_op_value(v: Value) -> Result<OpValue, String> {
    match v {
        Value::Tensor(t) => Ok(OpValue::Tensor(t)),
        Value::Tuple(t) => {
            t.0.iter()
                .map(|f| match f {
                    Value::Tensor(t) => Ok(t.clone()),
                    other => Err(format!(
                        "expected a tuple of tensors, found {} in it",
                        other.kind()
                    )),
                })
                .collect::<Result<Vec<Tensor>, String>>()
                .map(OpValue::Tuple)
        }
        other => Err(format!("expected a tensor, found {}", other.kind())),
    }
}

pub fn from_op_value(v: OpValue) -> Value {
    match v {
        OpValue::Tensor(t) => Value::Tensor(t),
        OpValue::Tuple(ts) => Value::tuple(ts.into_iter().map(Value::Tensor).collect::<Fields>()),
    }
}

#[cfg(test)]
mod error_tests {
    use super::RunError;

    #[test]
    fn broken_invariants_are_told_apart_from_user_errors() {
        assert!(RunError::internal("slot 3 is empty").internal);
        assert!(RunError::internal("x").message.starts_with("internal:"));
        // However the runtime wraps its own check's message, it stays a bug.
        assert!(RunError::new("in block cell: internal: node").internal);
        assert!(!RunError::new("nn.dense: input has 5 columns but weight expects 4").internal);
    }
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
