//! Code taken at once: the value of code that needs no evaluation step of its own (a variable, a
//! native call of values at hand, a block invocation of immediate operands, a call whose chosen arm
//! completes at once) computed where it is read, without a continuation push and pop and a trip
//! through the run loop. Only code that cannot suspend is taken, so the recorded graph is the same
//! as the step path's.

use super::values::{list_items_into, project};
use super::{Backend, Frame, Kont, LoopCode, Machine, RunError, Step};
use crate::value::{Fields, Value};
use tumble_compile::{Code, Lambda};
use tumble_ir::Span;

impl<'p> Machine<'p> {
    /// The value of code that needs no evaluation step of its own — a variable, a literal, a
    /// global, a field of a variable — or `None`. Operands, tuple elements and `let` values are
    /// mostly such code: taking them at once saves a continuation push and pop and a trip through
    /// the run loop each (they have no effects, so the evaluation order is unchanged).
    pub(super) fn immediate(&mut self, code: &Code) -> Option<Result<Value, RunError>> {
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
    pub(super) fn immediates(&mut self, codes: &[Code]) -> Option<Result<Vec<Value>, RunError>> {
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
    pub(super) fn at_once(
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
            if !super::calls::native_ready(native, &vals) {
                return None;
            }
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
}
