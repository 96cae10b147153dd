//! Calls with evaluated operands: operators (through the backend), blocks, globals, closures,
//! constructors and the prelude's list functions run natively; entering a function makes its frame
//! current, keeping the caller's only when the call is not in tail position.

use super::*;

impl<'p> Machine<'p> {
    /// A call whose operands are evaluated: operator calls go through [`Step::CallOp`] (which may
    /// suspend), every other call is performed at once.
    pub(super) fn call_step(
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
    pub(super) fn call(
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
                    if native_ready(native, &vals) {
                        return self.native(native, vals, *span);
                    }
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

    pub(super) fn lambda(&self, index: u32) -> Result<&'p Lambda, RunError> {
        self.program
            .lambdas
            .get(index as usize)
            .ok_or_else(|| RunError::new(format!("internal: no function {index}")))
    }

    pub(super) fn global(&self, g: u32) -> Result<&'p Lambda, RunError> {
        let index = self
            .program
            .globals
            .get(g as usize)
            .ok_or_else(|| RunError::new(format!("internal: no global {g}")))?;
        self.lambda(*index)
    }

    /// The number of fields of constructor `c`.
    pub(super) fn arity(&self, c: u32) -> usize {
        self.program.ctors.get(c as usize).map_or(0, |e| e.arity)
    }

    pub(super) fn apply(
        &mut self,
        callee: Value,
        args: Vec<Value>,
        span: Span,
    ) -> Result<Step<'p>, RunError> {
        let Value::Closure(c) = &callee else {
            return Err(RunError::at(span, format!("cannot call {}", callee.kind())));
        };
        match &**c {
            Closure::Global(g) => {
                if let Some(native) = self.program.natives.of(*g) {
                    if native_ready(native, &args) {
                        return self.native(native, args, span);
                    }
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
    pub(super) fn native(
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
            Native::Length => {
                let n = items(&xs)?.len();
                let n = i32::try_from(n).map_err(|_| {
                    RunError::at(span, format!("`@length`: {n} elements do not fit in int32"))
                })?;
                Value::Tensor(tumble_tensor::Tensor::scalar_i32(n))
            }
            Native::Nth | Native::Update => {
                let n = args.first().and_then(index_value).ok_or_else(|| {
                    RunError::at(span, "internal: a native index that is not at hand")
                })?;
                let mut items = items(&xs)?;
                // (`native_ready` checked that the index is inside the list.)
                let at = usize::try_from(n).ok().filter(|&i| i < items.len());
                let Some(at) = at else {
                    return Err(RunError::at(
                        span,
                        format!(
                            "internal: `@{}` at index {n} of a list of {} elements",
                            native.name(),
                            items.len()
                        ),
                    ));
                };
                match native {
                    Native::Nth => items.swap_remove(at),
                    _ => {
                        if let (Some(slot), Some(v)) = (items.get_mut(at), args.pop()) {
                            *slot = v;
                        }
                        build(items, self.shared.nullary(nil))
                    }
                }
            }
        };
        Ok(Step::Apply(v))
    }

    pub(super) fn enter(
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
    pub(super) fn install(
        &mut self,
        lambda: &Lambda,
        args: Vec<Value>,
        this: Option<Value>,
        captured: &[Value],
        call_site: Option<Span>,
    ) -> Result<(), RunError> {
        let mut frame = self.frame_for(lambda, args, this, captured, call_site)?;
        // In tail position the caller's frame is dead: don't stack another return.
        if matches!(self.stack.last(), Some(Kont::Return(_))) {
            frame.tail_from = self.frame.tail_from.or(self.frame.call_site);
            let caller = std::mem::replace(&mut self.frame, frame);
            self.recycle(caller);
        } else {
            let caller = std::mem::replace(&mut self.frame, frame);
            self.push(Kont::Return(caller))?;
        }
        Ok(())
    }

    /// A new frame for `lambda`: its parameters bound to `args`, its captures to `captured`.
    pub(super) fn frame_for(
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
            tail_from: None,
        })
    }
}

/// The value of an element index at hand: an integer tensor of one element.
fn index_value(v: &Value) -> Option<i64> {
    match v {
        Value::Tensor(t) if t.len() == 1 && t.dtype().is_int() => t.to_i64_vec().first().copied(),
        _ => None,
    }
}

/// Whether native `native` can run on `args` now: its index, if it has one, is at hand (a
/// value a launch has yet to compute leaves the call to the prelude's body, which waits for it)
/// and inside the list (past the end, the prelude's body fails as the reference engine's does,
/// at its `match?`).
pub(super) fn native_ready(native: Native, args: &[Value]) -> bool {
    let Some(i) = native.index_operand() else {
        return true;
    };
    let Some(n) = args.get(i).and_then(index_value) else {
        return false;
    };
    let Ok(n) = usize::try_from(n) else {
        return false;
    };
    // The list's cells up to the index: any constructor with a tail field counts, the native
    // step itself checks they are a list.
    // (Stops at the list's end: the cost is the list's, whatever the index.)
    let mut at = args.first();
    for _ in 0..n {
        at = match at {
            Some(Value::Adt(a)) => a.fields.get(1),
            _ => return false,
        };
    }
    matches!(at, Some(Value::Adt(a)) if a.fields.len() == 2)
}
