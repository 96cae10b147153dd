//! Fibers within an instance: when a concurrent element (of `db.concurrent`, a concurrent `let`
//! the compiler found, or a `@map` run as a loop) stops for a value a launch has yet to compute —
//! an `if` on a computed tensor, most often — the rest of that element is split off as a fiber
//! and the elements after it go on at once, from the depth they would have started at. Without
//! this, one element's `if` held every later element of the instance until the next flush: a
//! mixture of experts routing each token by its own gate advanced one token per flush, and a
//! tree whose leaves each test a computed value one leaf per flush.
//!
//! A fiber is an evaluation state of its own — the continuations above the concurrent one, the
//! frame, the step to resume with and the inline depth — and the element's value goes to the
//! concurrent's [`JoinCell`]. The join waits for its fibers: where the evaluation reaches it with
//! fibers still out, it stops there (and may itself be split off at a concurrent further down).
//! After each flush the machine resumes every fiber in the order they were made; a fiber that
//! ends hands its value to its join, and the one waiting there goes on once it has them all.
//!
//! The elements run in the same frame (a loop's element code reuses its slots), so the fiber
//! takes a copy of that frame. Values are the same as evaluating the elements in order; the order
//! of the operators' recording differs, which only changes how they batch. An instance with one
//! failing element fails with its error; with several, the one reported may be a later element's
//! (the first to fail in the order the fibers ran).
//! Random draws come in the instance's program order, so a program that draws on the host runs
//! without fibers (as with `--no-fibers`, the runtime's `Options::fibers`).

use std::cell::RefCell;
use std::rc::Rc;

use super::{Frame, Kont, Machine, RunError, Step};
use crate::value::Value;
use tumble_compile::{Code, Program};

/// Where the values of a concurrent's split-off elements go (shared by the concurrent's
/// continuation, through [`Machine::cells`], and the fibers).
#[derive(Default)]
pub(super) struct JoinCell {
    /// `(element index, value)` of the fibers done so far.
    results: Vec<(u32, Value)>,
    /// Fibers not done yet.
    outstanding: u32,
    /// The deepest inline depth a finished fiber reached.
    max: u32,
    /// The fiber stopped at this join, if the evaluation reached it before its fibers were done.
    waiter: Option<usize>,
}

pub(super) type Cell = Rc<RefCell<JoinCell>>;

/// A suspended evaluation state of an instance (the running one lives in the machine's fields).
pub(super) struct Fiber<'p> {
    frame: Frame,
    stack: Vec<Kont<'p>>,
    pending: Option<Step<'p>>,
    depth: u32,
    /// The join cells of this fiber's concurrent continuations, by stack index.
    cells: Vec<(u32, Cell)>,
    /// The join its value goes to, and its element index there; `None` for the main line.
    target: Option<(Cell, u32)>,
    /// The call trace below its own stack, for errors.
    trace_below: Rc<[tumble_ir::Span]>,
}

/// The fibers of one machine.
#[derive(Default)]
pub(super) struct Fibers<'p> {
    /// By id; `None` once resumed (its id is then free for the next one).
    slab: Vec<Option<Fiber<'p>>>,
    free: Vec<usize>,
    /// Fibers to resume now, in order.
    ready: std::collections::VecDeque<usize>,
    /// Fibers stopped for a value not yet computed: ready again after the next flush.
    blocked: Vec<usize>,
}

impl<'p> Fibers<'p> {
    fn store(&mut self, f: Fiber<'p>) -> usize {
        match self.free.pop() {
            Some(id) => {
                if let Some(s) = self.slab.get_mut(id) {
                    *s = Some(f);
                }
                id
            }
            None => {
                self.slab.push(Some(f));
                self.slab.len() - 1
            }
        }
    }

    fn take(&mut self, id: usize) -> Option<Fiber<'p>> {
        let f = self.slab.get_mut(id).and_then(Option::take);
        if f.is_some() {
            self.free.push(id);
        }
        f
    }

    /// Whether any fiber is suspended (ready, blocked or waiting at a join).
    pub(super) fn any(&self) -> bool {
        self.slab.len() > self.free.len()
    }

    /// Every value the suspended fibers hold.
    pub(super) fn visit_values(&self, f: &mut dyn FnMut(&Value)) {
        for fiber in self.slab.iter().flatten() {
            super::visit_frame(&fiber.frame, f);
            super::visit_stack(&fiber.stack, f);
            super::visit_step(fiber.pending.as_ref(), f);
            visit_cells(&fiber.cells, f);
        }
    }
}

pub(super) fn visit_cells(cells: &[(u32, Cell)], f: &mut dyn FnMut(&Value)) {
    for (_, c) in cells {
        c.borrow().results.iter().for_each(|(_, v)| f(v));
    }
}

/// Whether `program` draws random numbers on the host (`random.*` outside blocks), whose order
/// fibers would change.
pub fn draws_on_host(program: &Program) -> bool {
    let mut draws = false;
    for l in &program.lambdas {
        l.body.visit(&mut |c| {
            if let Code::CallOp { op, .. } = c {
                draws |= op.name.starts_with("random.");
            }
        });
    }
    draws
}

/// Why the run loop stopped (the machine's own view; [`super::Outcome`] is the caller's).
pub(super) enum Stop {
    Done(Value),
    Blocked,
    /// At a join whose fibers are not all done ([`Step::AwaitJoin`]).
    AwaitJoin,
    Phase,
    Yielded,
}

/// What the outer run loop does after a stop of the running fiber.
pub(super) enum Next {
    /// Go on running (another fiber, or the same one after a split).
    Run,
    /// Nothing can run before the next flush.
    Blocked,
}

impl<'p> Machine<'p> {
    /// The join cell of the concurrent continuation at stack index `k` of the running fiber.
    fn cell_at(&self, k: usize) -> Option<&Cell> {
        match self.cells.last() {
            Some((i, c)) if *i as usize == k => Some(c),
            _ => None,
        }
    }

    /// At the join of the concurrent continuation that was at the stack's top (now popped, so
    /// at index `stack.len()`): whether its fibers are all done. If so, their values go into
    /// `vals` (where the split elements' placeholders are) and their depths into `max`, and the
    /// cell is dropped; if not, the caller pushes the continuation back and stops at the join.
    pub(super) fn join_fibers(&mut self, vals: &mut [Value], max: &mut u32) -> bool {
        let Some(cell) = self.cell_at(self.stack.len()) else {
            return true;
        };
        let mut c = cell.borrow_mut();
        if c.outstanding > 0 {
            return false;
        }
        for (i, v) in c.results.drain(..) {
            if let Some(slot) = vals.get_mut(i as usize) {
                *slot = v;
            }
        }
        *max = (*max).max(c.max);
        drop(c);
        self.cells.pop();
        true
    }

    /// Whether the join on the stack's top still waits for fibers.
    pub(super) fn join_waits(&self) -> bool {
        self.stack
            .len()
            .checked_sub(1)
            .and_then(|k| self.cell_at(k))
            .is_some_and(|c| c.borrow().outstanding > 0)
    }

    /// The step of a join reached again once its fibers are done: the continuation on the
    /// stack's top goes on from its last element.
    pub(super) fn resume_join(
        &mut self,
        backend: &mut dyn super::Backend,
    ) -> Result<Step<'p>, RunError> {
        let kont = self
            .stack
            .pop()
            .ok_or_else(|| RunError::new("internal: a join without its continuation"))?;
        self.go_on(kont, None, backend)
    }

    /// Concurrent continuation `kont` (popped) goes on with its next element, `done` (a split
    /// element's placeholder) first added to its values; or with its join, when it has them all.
    fn go_on(
        &mut self,
        kont: Kont<'p>,
        done: Option<Value>,
        backend: &mut dyn super::Backend,
    ) -> Result<Step<'p>, RunError> {
        match kont {
            Kont::Concurrent {
                join,
                elems,
                mut vals,
                start,
                max,
                ..
            } => {
                vals.extend(done);
                self.concurrent_from(join, elems, vals, start, max, backend)
            }
            Kont::MapLoop {
                ml,
                elem,
                items,
                mut vals,
                start,
                max,
            } => {
                vals.extend(done);
                self.map_next(ml, elem, items, vals, start, max, backend)
            }
            _ => Err(RunError::new(
                "internal: a join at a continuation not concurrent",
            )),
        }
    }

    /// The running fiber stopped (`stop`: blocked or at a join): split off the rest of the
    /// innermost concurrent element that has elements after it, and go on with those; else
    /// suspend the running fiber and switch to a ready one.
    pub(super) fn after_stop(
        &mut self,
        waiting_join: bool,
        backend: &mut dyn super::Backend,
    ) -> Result<Next, RunError> {
        if self.fibers_on && self.split(waiting_join, backend)? {
            return Ok(Next::Run);
        }
        if !self.fibers.any() && !waiting_join {
            // The common case: nothing split off, the instance waits as a whole.
            return Ok(Next::Blocked);
        }
        let fiber = self.suspend();
        let id = self.fibers.store(fiber);
        self.park(id, waiting_join);
        Ok(self.switch_to_ready())
    }

    /// Parks fiber `id`: at the join on its stack's top, or blocked until the next flush.
    fn park(&mut self, id: usize, waiting_join: bool) {
        if waiting_join {
            let cell = self
                .fibers
                .slab
                .get(id)
                .and_then(Option::as_ref)
                .and_then(|f| {
                    let k = f.stack.len().checked_sub(1)?;
                    match f.cells.last() {
                        Some((i, c)) if *i as usize == k => Some(c.clone()),
                        _ => None,
                    }
                });
            if let Some(c) = cell {
                c.borrow_mut().waiter = Some(id);
                return;
            }
        }
        self.fibers.blocked.push(id);
    }

    /// The running fiber finished with `v`: hand it to its join (waking the fiber waiting
    /// there when it was the last), then switch to a ready fiber. `None`: it was the main
    /// line, and `v` is the instance's result.
    pub(super) fn finish_fiber(&mut self, v: Value) -> Option<Next> {
        let (cell, index) = self.target.take()?;
        {
            let mut c = cell.borrow_mut();
            c.results.push((index, v));
            c.max = c.max.max(self.ctx.depth);
            c.outstanding = c.outstanding.saturating_sub(1);
            if c.outstanding == 0 {
                if let Some(w) = c.waiter.take() {
                    self.fibers.ready.push_back(w);
                }
            }
        }
        let done = std::mem::replace(&mut self.frame, Frame::empty());
        self.recycle(done);
        self.stack.clear();
        self.cells.clear();
        Some(self.switch_to_ready())
    }

    /// After a flush: every blocked fiber may go on.
    pub(super) fn wake_blocked(&mut self) {
        let blocked = std::mem::take(&mut self.fibers.blocked);
        self.fibers.ready.extend(blocked);
    }

    /// Makes the next ready fiber the running one; `Next::Blocked` if none is ready (the running
    /// state is then empty: [`Machine::run`] switches before running again).
    pub(super) fn switch_to_ready(&mut self) -> Next {
        while let Some(id) = self.fibers.ready.pop_front() {
            if let Some(f) = self.fibers.take(id) {
                self.resume_fiber(f);
                return Next::Run;
            }
        }
        Next::Blocked
    }

    /// The running state taken out of the machine, as a fiber.
    fn suspend(&mut self) -> Fiber<'p> {
        Fiber {
            frame: std::mem::replace(&mut self.frame, Frame::empty()),
            stack: std::mem::take(&mut self.stack),
            pending: self.pending.take(),
            depth: self.ctx.depth,
            cells: std::mem::take(&mut self.cells),
            target: self.target.take(),
            trace_below: std::mem::replace(&mut self.trace_below, Rc::from(Vec::new())),
        }
    }

    fn resume_fiber(&mut self, f: Fiber<'p>) {
        self.frame = f.frame;
        self.stack = f.stack;
        self.pending = f.pending;
        self.ctx.depth = f.depth;
        self.cells = f.cells;
        self.target = f.target;
        self.trace_below = f.trace_below;
    }

    /// Splits the running fiber at the innermost concurrent continuation whose element being
    /// evaluated has others after it: the continuations above it, the frame and the pending step
    /// become a fiber whose value is that element's; the running fiber goes on with the next
    /// element. `false` where there is no such continuation.
    fn split(
        &mut self,
        waiting_join: bool,
        backend: &mut dyn super::Backend,
    ) -> Result<bool, RunError> {
        let found = self.stack.iter().rposition(|k| match k {
            Kont::Concurrent { elems, vals, .. } => vals.len() + 1 < elems.len(),
            Kont::MapLoop { items, .. } => !items.is_empty(),
            _ => false,
        });
        let Some(k) = found else {
            return Ok(false);
        };
        let mut segment = self.stack.split_off(k + 1);
        let pos = self.cells.partition_point(|(i, _)| (*i as usize) <= k);
        let mut cells = self.cells.split_off(pos);
        let base = (k + 1) as u32;
        for (i, _) in &mut cells {
            *i -= base;
        }
        // The frame the element started in: held by the first call it made (to return to), or
        // the current one if it made none. The fiber keeps it; the running fiber a copy.
        let start_frame = match segment.iter_mut().find_map(|kont| match kont {
            Kont::Return(f) => Some(f),
            _ => None,
        }) {
            Some(f) => f.clone(),
            None => self.frame.clone(),
        };
        let frame = std::mem::replace(&mut self.frame, start_frame);
        let cell = match self.cell_at(k) {
            Some(c) => c.clone(),
            None => {
                let c = Cell::default();
                self.cells.push((k as u32, c.clone()));
                c
            }
        };
        let Some(kont) = self.stack.pop() else {
            return Err(RunError::new("internal: split without its continuation"));
        };
        let index = match &kont {
            Kont::Concurrent { vals, .. } | Kont::MapLoop { vals, .. } => vals.len() as u32,
            _ => {
                return Err(RunError::new(
                    "internal: split at a continuation not concurrent",
                ))
            }
        };
        cell.borrow_mut().outstanding += 1;
        // The calls below the concurrent (its own frame is in the segment or is the fiber's).
        let mut below = super::frames_trace(None, &self.stack);
        below.extend(self.trace_below.iter().copied());
        below.truncate(super::MAX_TRACE);
        let fiber = Fiber {
            frame,
            stack: segment,
            pending: self.pending.take(),
            depth: self.ctx.depth,
            cells,
            target: Some((cell, index)),
            trace_below: Rc::from(below),
        };
        let id = self.fibers.store(fiber);
        self.park(id, waiting_join);
        // The elements after it, each from the depth they start at.
        let placeholder = self.shared.unit();
        let step = self.go_on(kont, Some(placeholder), backend)?;
        self.pending = Some(step);
        Ok(true)
    }
}
