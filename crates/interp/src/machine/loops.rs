//! Functions run as loops over their list: a call of a function with `@map`'s, `@foldl`'s or a
//! scan's shape ([`tumble_compile::map_loop`]) runs its per-element code once per element in one
//! frame, instead of one interpreted recursive call per element, with the same depths and
//! invocations.

use super::values::{list_items_into, list_of_drained, project};
use super::{Backend, Kont, Machine, RunError, Step};
use crate::value::Value;
use tumble_compile::{Code, FoldLoop, Lambda, MapLoop, ScanLoop};
use tumble_ir::Span;

/// How a function runs as a loop over a list, and the code it runs per element
/// ([`Machine::loop_code`]).
#[derive(Clone, Copy)]
pub(super) enum LoopCode<'p> {
    Map(MapLoop, &'p Code),
    Fold(FoldLoop, &'p Code),
    Scan(&'p ScanLoop, &'p [(u32, Code)]),
}

impl LoopCode<'_> {
    /// The parameter holding the list.
    pub(super) fn list(self) -> u32 {
        match self {
            LoopCode::Map(ml, _) => ml.list,
            LoopCode::Fold(fl, _) => fl.list,
            LoopCode::Scan(sl, _) => sl.list,
        }
    }
}

impl<'p> Machine<'p> {
    /// How global `global` (whose body is `lambda`'s) runs as a loop over its list, if it does
    /// and its switch is on: the step path's calls and [`Machine::loop_at_once`] both ask here.
    pub(super) fn loop_code(&self, global: u32, lambda: &'p Lambda) -> Option<LoopCode<'p>> {
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

    /// A call of a function with `@map`'s shape ([`tumble_compile::map_loop`]) as a loop: its
    /// frame is made as for any call, then the element code runs once per element with the
    /// element bound, each from the call's inline depth. A list argument that is not a list
    /// (which the type checker rules out) takes the ordinary call, and its error.
    pub(super) fn map_loop(
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
    pub(super) fn map_next(
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
        // The step the continuation waits on: an element that needs steps, or its join's fibers.
        let waiting = loop {
            match items.pop() {
                Some(x) => {
                    // An element done at once takes no step of the run loop, and a list is as
                    // long as the data: each counts as one, so the run limits are still looked
                    // at (Ctrl-C, the memory budget) however long the list.
                    self.tick(backend)?;
                    self.ctx.depth = start;
                    self.set_slot(ml.elem_slot, x);
                    match self.at_once(elem, backend) {
                        Some(v) => {
                            vals.push(v?);
                            max = max.max(self.ctx.depth);
                        }
                        None => break Some(Step::Eval(elem)),
                    }
                }
                None if self.join_fibers(&mut vals, &mut max) => break None,
                None => break Some(Step::AwaitJoin),
            }
        };
        if let Some(step) = waiting {
            self.push(Kont::MapLoop {
                ml,
                elem,
                items,
                vals,
                start,
                max,
            })?;
            return Ok(step);
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
    pub(super) fn fold_loop(
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
    pub(super) fn fold_next(
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
    pub(super) fn scan_loop(
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
    pub(super) fn scan_next(
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
}
