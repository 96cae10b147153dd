//! The reference gradient: one instance at a time, every operator application recorded on a tape
//! (Wengert list), then walked backwards with the operators' vector-Jacobian products
//! ([`tumble_ops::vjp`]). It is the oracle the batched backward (`tumble-runtime`'s `backward`)
//! is tested against, so it is written for obviousness: f64-free bookkeeping, no batching.
//!
//! Every tensor the tape backend returns is a [`Value::Lazy`] naming its tape entry, so the
//! machine's values carry their lineage wherever control flow moves them (tuples, ADTs,
//! closures, `Code::Param` reads); nothing is computed outside the tape. Control flow
//! (recursion, `match`, `if` on tensors) is differentiated as traced: the tape holds only what
//! this instance ran.

use std::collections::HashMap;

use crate::machine::{Backend, InstanceCtx, Machine, Outcome, RunError};
use crate::value::{LazyRef, Value};
use tumble_compile::{BArg, BVal, OutputShape, Program};
use tumble_ir::{Attrs, Span};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::{Rng, Tensor};

/// Where an operator argument came from: a tape entry's field, or a constant (literal, input).
#[derive(Clone)]
enum Src {
    Const,
    Ref(LazyRef),
}

enum ArgSrc {
    One(Src),
    Tuple(Vec<Src>),
}

enum Entry {
    /// Differentiable argument `k` of the entry function.
    Param(usize, Tensor),
    Op {
        op: &'static OpDef,
        attrs: Attrs,
        args: Vec<OpValue>,
        srcs: Vec<ArgSrc>,
        out: OpValue,
        span: Span,
        /// Depends on a parameter (only those are walked backwards).
        active: bool,
    },
}

struct TapeBackend<'p> {
    program: &'p Program,
    entries: Vec<Entry>,
}

impl TapeBackend<'_> {
    fn field(&self, r: LazyRef) -> Result<Tensor, RunError> {
        let missing = || RunError::new("internal: tape reference to nothing");
        match self.entries.get(r.node as usize).ok_or_else(missing)? {
            Entry::Param(_, t) => Ok(t.clone()),
            Entry::Op { out, .. } => match out {
                OpValue::Tensor(t) if r.output == 0 => Ok(t.clone()),
                OpValue::Tuple(ts) => ts.get(r.output as usize).cloned().ok_or_else(missing),
                OpValue::Tensor(_) => Err(missing()),
            },
        }
    }

    fn is_active(&self, s: &Src) -> bool {
        match s {
            Src::Const => false,
            Src::Ref(r) => match self.entries.get(r.node as usize) {
                Some(Entry::Param(..)) => true,
                Some(Entry::Op { active, .. }) => *active,
                None => false,
            },
        }
    }

    fn resolve(&self, v: &Value) -> Result<(Tensor, Src), String> {
        match v {
            Value::Tensor(t) => Ok((t.clone(), Src::Const)),
            Value::Lazy(r) => self
                .field(*r)
                .map(|t| (t, Src::Ref(*r)))
                .map_err(|e| e.into_info().message),
            other => Err(format!("expected a tensor, found {}", other.kind())),
        }
    }

    fn arg(&self, v: &Value) -> Result<(OpValue, ArgSrc), String> {
        match v {
            Value::Tuple(t) => {
                let mut ts = Vec::with_capacity(t.0.len());
                let mut ss = Vec::with_capacity(t.0.len());
                for f in &t.0 {
                    let (t, s) = self.resolve(f)?;
                    ts.push(t);
                    ss.push(s);
                }
                Ok((OpValue::Tuple(ts), ArgSrc::Tuple(ss)))
            }
            other => {
                let (t, s) = self.resolve(other)?;
                Ok((OpValue::Tensor(t), ArgSrc::One(s)))
            }
        }
    }

    /// Runs `op` and records it; returns the result as lazy references to the new entry.
    fn record(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<OpValue>,
        srcs: Vec<ArgSrc>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        let mut octx = OpCtx { rng: &mut ctx.rng };
        let out = tumble_ops::eval(op, &args, attrs, &mut octx)
            .map_err(|e| RunError::at(span, e.message))?;
        let active = srcs.iter().any(|s| match s {
            ArgSrc::One(s) => self.is_active(s),
            ArgSrc::Tuple(ss) => ss.iter().any(|s| self.is_active(s)),
        });
        let node = u32::try_from(self.entries.len())
            .map_err(|_| RunError::at(span, "the gradient tape is full"))?;
        let value = match &out {
            OpValue::Tensor(_) => Value::Lazy(LazyRef { node, output: 0 }),
            OpValue::Tuple(ts) => Value::tuple(
                (0..ts.len() as u32)
                    .map(|output| Value::Lazy(LazyRef { node, output }))
                    .collect::<crate::Fields>(),
            ),
        };
        self.entries.push(Entry::Op {
            op,
            attrs: attrs.clone(),
            args,
            srcs,
            out,
            span,
            active,
        });
        Ok(value)
    }
}

impl Backend for TapeBackend<'_> {
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        let mut vals = Vec::with_capacity(args.len());
        let mut srcs = Vec::with_capacity(args.len());
        for a in &args {
            let (v, s) = self
                .arg(a)
                .map_err(|m| RunError::at(span, format!("{}: {m}", op.name)))?;
            vals.push(v);
            srcs.push(s);
        }
        self.record(ctx, op, vals, srcs, attrs, span)
    }

    /// A static block is recorded operator by operator (the reference lowering has none, but a
    /// blocked program differentiates the same way).
    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        _site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        let program = self.program;
        let b = program
            .blocks
            .get(block as usize)
            .ok_or_else(|| RunError::new(format!("internal: no block {block}")))?;
        let mut results: Vec<Value> = Vec::with_capacity(b.nodes.len());
        let lookup = |v: &BVal, results: &[Value]| -> Result<Value, RunError> {
            let missing = || RunError::at(span, format!("internal: block {}: bad value", b.name));
            match v {
                BVal::Input(i) => args.get(*i as usize).cloned().ok_or_else(missing),
                BVal::Node(n) => results.get(*n as usize).cloned().ok_or_else(missing),
                BVal::Field(n, f) => match results.get(*n as usize) {
                    Some(Value::Tuple(t)) => t.0.get(*f as usize).cloned().ok_or_else(missing),
                    _ => Err(missing()),
                },
                BVal::Const(t) => Ok(Value::Tensor(t.clone())),
            }
        };
        for node in &b.nodes {
            let mut vals = Vec::with_capacity(node.args.len());
            for a in &node.args {
                vals.push(match a {
                    BArg::One(v) => lookup(v, &results)?,
                    BArg::Tuple(vs) => Value::tuple(
                        vs.iter()
                            .map(|v| lookup(v, &results))
                            .collect::<Result<Vec<_>, _>>()?,
                    ),
                });
            }
            let r = self.call_op(ctx, node.op, vals, &node.attrs, span)?;
            results.push(r);
        }
        let outs = b
            .outputs
            .iter()
            .map(|v| lookup(v, &results))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(match (b.output_shape, outs.len()) {
            (OutputShape::Single, 1) => outs.into_iter().next().unwrap_or_else(Value::unit),
            _ => Value::tuple(outs),
        })
    }

    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError> {
        let (t, _) = self.resolve(v).map_err(RunError::new)?;
        t.scalar_as_bool()
            .map(Some)
            .map_err(|e| RunError::new(format!("`if` condition: {e}")))
    }
}

/// `dst += g`, elementwise in f64, keeping `dst`'s dtype.
pub fn accumulate(dst: &mut Option<Tensor>, g: Tensor) -> Result<(), String> {
    match dst {
        None => *dst = Some(g),
        Some(d) => {
            if d.shape() != g.shape() {
                return Err(format!(
                    "internal: gradient of shape {:?} added to one of shape {:?}",
                    g.shape(),
                    d.shape()
                ));
            }
            if let (Some(a), Some(b)) = (d.make_mut_slice::<f32>(), g.as_slice::<f32>()) {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                return Ok(());
            }
            let v: Vec<f64> = d
                .to_f64_vec()
                .iter()
                .zip(g.to_f64_vec())
                .map(|(a, b)| a + b)
                .collect();
            *d = Tensor::from_vec(d.shape().to_vec(), v)
                .map_err(|e| e.to_string())?
                .cast(d.dtype());
        }
    }
    Ok(())
}

/// The entry's output as a float scalar (shape `()` or one element), or why it is not one.
pub fn scalar_loss(t: &Tensor) -> Result<f64, String> {
    if !t.dtype().is_float() || t.len() != 1 {
        return Err(format!(
            "the gradient needs `@main` to return a float scalar (shape () or one element), \
             but it returned a {} tensor of shape {:?}",
            t.dtype(),
            t.shape()
        ));
    }
    t.scalar_as_f64()
        .or_else(|_| t.get_f64(0).ok_or(()))
        .map_err(|_| "internal: scalar unreadable".to_string())
}

/// What one instance's gradient run gives: the entry's output and, per differentiable
/// argument, `∂ output / ∂ argument` (`None`: the output does not depend on it).
pub struct InstanceGrad {
    pub loss: f64,
    pub grads: Vec<Option<Tensor>>,
}

/// Runs global `entry` on `args` recording a tape, then differentiates its output (a float
/// scalar) with respect to the arguments listed in `wrt` (float tensors: the parameters).
pub fn grad(
    program: &Program,
    entry: &str,
    mut args: Vec<Value>,
    wrt: &[usize],
    rng: &mut Rng,
) -> Result<InstanceGrad, RunError> {
    let index = *program
        .global_index
        .get(entry)
        .ok_or_else(|| RunError::new(format!("the module has no global `@{entry}`")))?;
    let mut backend = TapeBackend {
        program,
        entries: Vec::new(),
    };
    for (k, &i) in wrt.iter().enumerate() {
        let Some(slot) = args.get_mut(i) else {
            return Err(RunError::new(format!("internal: no argument {i}")));
        };
        let Value::Tensor(t) = slot else {
            return Err(RunError::new(format!(
                "argument {i} is {}, not a tensor to differentiate",
                slot.kind()
            )));
        };
        backend.entries.push(Entry::Param(k, t.clone()));
        *slot = Value::Lazy(LazyRef {
            node: k as u32,
            output: 0,
        });
    }
    let ctx = InstanceCtx {
        rng: rng.clone(),
        depth: 0,
        floor: 0,
        instance: 0,
        phase: 0,
        pending: 0,
    };
    let mut machine = Machine::new(program, ctx);
    machine.start(index, args)?;
    let out = loop {
        match machine.run(&mut backend)? {
            Outcome::Done(v) => break v,
            Outcome::Phase | Outcome::Yielded => continue,
            Outcome::Blocked => return Err(RunError::new("internal: the tape never blocks")),
        }
    };
    *rng = machine.ctx.rng.clone();
    let (t, src) = backend.resolve(&out).map_err(|m| {
        RunError::new(format!(
            "the gradient needs `@main` to return a float scalar: {m}"
        ))
    })?;
    let loss = scalar_loss(&t).map_err(RunError::new)?;
    let mut grads: Vec<Option<Tensor>> = vec![None; wrt.len()];
    let Src::Ref(root) = src else {
        return Ok(InstanceGrad { loss, grads });
    };
    let one = Tensor::full_f64(t.shape().to_vec(), t.dtype(), 1.0)
        .map_err(|e| RunError::new(e.to_string()))?;
    let mut adj: HashMap<LazyRef, Tensor> = HashMap::new();
    adj.insert(root, one);
    for (node, e) in backend.entries.iter().enumerate().rev() {
        let node = node as u32;
        match e {
            Entry::Param(k, _) => {
                if let (Some(g), Some(slot)) =
                    (adj.remove(&LazyRef { node, output: 0 }), grads.get_mut(*k))
                {
                    accumulate(slot, g).map_err(RunError::new)?;
                }
            }
            Entry::Op {
                op,
                attrs,
                args,
                srcs,
                out,
                span,
                active,
            } => {
                if !active {
                    continue;
                }
                let dy = match out {
                    OpValue::Tensor(_) => match adj.remove(&LazyRef { node, output: 0 }) {
                        Some(g) => OpValue::Tensor(g),
                        None => continue,
                    },
                    OpValue::Tuple(ts) => {
                        let mut any = false;
                        let mut fields = Vec::with_capacity(ts.len());
                        for (i, t) in ts.iter().enumerate() {
                            match adj.remove(&LazyRef {
                                node,
                                output: i as u32,
                            }) {
                                Some(g) => {
                                    any = true;
                                    fields.push(g);
                                }
                                None => fields.push(
                                    Tensor::zeros(t.shape().to_vec(), t.dtype())
                                        .map_err(|e| RunError::new(e.to_string()))?,
                                ),
                            }
                        }
                        if !any {
                            continue;
                        }
                        OpValue::Tuple(fields)
                    }
                };
                let gs = tumble_ops::vjp::vjp(op, args, attrs, out, &dy)
                    .map_err(|e| RunError::at(*span, e.message))?;
                for (g, s) in gs.into_iter().zip(srcs) {
                    match (g, s) {
                        (Some(OpValue::Tensor(g)), ArgSrc::One(Src::Ref(r))) => {
                            let mut slot = adj.remove(r);
                            accumulate(&mut slot, g).map_err(RunError::new)?;
                            if let Some(v) = slot {
                                adj.insert(*r, v);
                            }
                        }
                        (Some(OpValue::Tuple(gs)), ArgSrc::Tuple(ss)) => {
                            for (g, s) in gs.into_iter().zip(ss) {
                                if let Src::Ref(r) = s {
                                    let mut slot = adj.remove(r);
                                    accumulate(&mut slot, g).map_err(RunError::new)?;
                                    if let Some(v) = slot {
                                        adj.insert(*r, v);
                                    }
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(InstanceGrad { loss, grads })
}
