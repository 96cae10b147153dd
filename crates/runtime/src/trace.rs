//! Instance traces: the block invocations one run of an instance's program made, replayed
//! into a later mini-batch's graph instead of interpreting the program again.
//!
//! An instance whose control flow depends only on its own inputs — it never chose a branch by
//! a computed value, never called an operator outside a block, never waited for a value —
//! makes the same invocations every time it runs, with the same arguments up to the weights and
//! the invocations' own results. `tumble train` runs every training instance once per epoch:
//! the first run records what the program asked of the graph ([`Recorder`]), the later ones
//! replay it ([`replay`]) — the same calls in the same order at the same inline depths, so the
//! same nodes, launches and bits, without the host program's evaluation steps (about a tenth of
//! a TreeLSTM's training step). ACROBAT moves such input-determined work out of the run with
//! its ahead-of-time compilation; a trace is the same idea for a program whose structure is
//! only known per instance.
//!
//! A recorded argument is a weight (by position among the entry's arguments: a step's weights
//! are new tensors), a constant (the instance's own data, a literal: kept by the trace) or a
//! leaf of an earlier invocation's result (whatever node it is this time). Anything else — a
//! lazy value the trace did not make, a closure in the result — leaves the instance untraced,
//! and it is interpreted every time, as before.
//!
//! A run that stops at program phase boundaries (its loss after its tree, batched across the
//! mini-batch) is recorded across them: the trace keeps where each stop came, and a replay
//! stops there too ([`Replaying::resume`]), so the barriers fall where the interpreted run's
//! would.

use std::sync::OnceLock;

use tumble_interp::machine::{Backend, InstanceCtx};
use tumble_interp::{LazyRef, RunError, Value};
use tumble_ir::{Attrs, Span};
use tumble_ops::OpDef;
use tumble_tensor::Tensor;

/// One argument of a recorded invocation, or one leaf of the recorded result.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Leaf {
    /// Entry argument `k` (a weight: bound anew at every step).
    Param(u32),
    /// A tensor the trace keeps (the instance's own data, a literal).
    Const(u32),
    /// Leaf `k` of the results so far, in the order [`leaves`] walks them.
    Out(u32),
}

/// A [`Leaf`] in 4 bytes (a trace holds one per argument of every invocation): the kind in the
/// top two bits.
#[derive(Clone, Copy, Debug)]
struct PackedLeaf(u32);

impl PackedLeaf {
    const INDEX: u32 = (1 << 30) - 1;

    fn new(leaf: Leaf) -> Option<Self> {
        let (kind, k) = match leaf {
            Leaf::Param(k) => (0, k),
            Leaf::Const(k) => (1, k),
            Leaf::Out(k) => (2, k),
        };
        (k <= Self::INDEX).then_some(PackedLeaf(kind << 30 | k))
    }

    fn leaf(self) -> Leaf {
        let k = self.0 & Self::INDEX;
        match self.0 >> 30 {
            0 => Leaf::Param(k),
            1 => Leaf::Const(k),
            _ => Leaf::Out(k),
        }
    }
}

/// The shape of the instance's result around its leaves.
#[derive(Debug)]
enum Shape {
    Leaf(Leaf),
    Tuple(Vec<Shape>),
    Adt(u32, Vec<Shape>),
}

/// 32 bytes (a trace holds one per invocation: ~200 for an SST tree with a loss per node).
#[derive(Debug)]
struct Call {
    block: u32,
    site: u32,
    /// The instance's inline depth and phase when it made the call (the machine's bookkeeping:
    /// concurrent elements start at one depth, their join takes the deepest).
    depth: u32,
    span: Span,
    /// Its arguments: `args[first..first + count]` of the trace.
    first: u32,
    phase: u16,
    count: u8,
    /// Leaves of its result (a block's outputs).
    leaves: u8,
}

/// What one instance's run asked of the graph (see the module's documentation).
#[derive(Debug)]
pub struct InstanceTrace {
    calls: Vec<Call>,
    args: Vec<PackedLeaf>,
    consts: Vec<Tensor>,
    result: Shape,
    /// Leaves of every call's result together.
    outs: u32,
    /// Where the run stopped at a phase boundary: before call `stops[j]` (one entry per stop,
    /// so a phase without calls is a stop too).
    stops: Vec<u32>,
}

impl InstanceTrace {
    /// Bytes the trace holds besides its constants' buffers (shared with the instance's data).
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.calls.capacity() * std::mem::size_of::<Call>()
            + self.args.capacity() * std::mem::size_of::<PackedLeaf>()
            + self.consts.capacity() * std::mem::size_of::<Tensor>()
            + self.stops.capacity() * std::mem::size_of::<u32>()
    }
}

/// Results computed on the host at once (scalar blocks outside a backward's recording) a traced
/// run may have.
const TENSOR_OUTS_MAX: usize = 256;

/// Values (tensors, tuples, constructor cells) a traced result may have: a training loss has
/// one.
const RESULT_MAX_VALUES: usize = 1024;

/// One slot per instance of a job (a training set): empty until the instance first runs, then
/// its trace, or `None` for an instance that cannot be traced (it is never recorded again).
pub struct TraceCache {
    slots: Vec<OnceLock<Option<InstanceTrace>>>,
}

impl TraceCache {
    pub fn new(instances: usize) -> Self {
        TraceCache {
            slots: (0..instances).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The slots of the instances `which` (indices into the job), in that order.
    pub fn slots(&self, which: &[usize]) -> Vec<Option<&TraceSlot>> {
        which.iter().map(|&i| self.slots.get(i)).collect()
    }

    /// Instances traced so far, and the bytes their traces hold.
    pub fn traced(&self) -> (usize, usize) {
        self.slots
            .iter()
            .filter_map(|s| s.get().and_then(Option::as_ref))
            .fold((0, 0), |(n, b), t| (n + 1, b + t.bytes()))
    }
}

pub type TraceSlot = OnceLock<Option<InstanceTrace>>;

/// Whether instance traces are recorded and replayed (`TUMBLE_NO_TRACE_REPLAY=1`: never; the
/// CLI's `train --no-trace-replay` passes no cache instead).
pub fn replay_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_TRACE_REPLAY")
}

/// What an instance's first run has recorded so far, kept across the phase boundaries it stops
/// at ([`Recorder`] records through a graph for one stretch of the run).
pub struct Recording {
    /// The run's entry arguments (a tensor among them is named by its position).
    params: Vec<Value>,
    building: Option<Building>,
}

impl Recording {
    /// Recording of a run started on entry arguments `params`.
    pub fn new(params: Vec<Value>) -> Self {
        let building = Building {
            // A TreeLSTM tree of SST's: ~120 invocations, ~200 result leaves.
            calls: Vec::with_capacity(128),
            args: Vec::with_capacity(512),
            by_node: Vec::with_capacity(256),
            ..Building::default()
        };
        Recording {
            params,
            building: Some(building),
        }
    }

    /// Notes that the run stopped at a phase boundary (it goes on after the barrier).
    pub fn phase_stop(&mut self) {
        if let Some(b) = &mut self.building {
            match u32::try_from(b.calls.len()) {
                Ok(at) => b.stops.push(at),
                Err(_) => self.building = None,
            }
        }
    }

    /// The trace, if the run finished with `result` and stayed traceable.
    pub fn finish(self, result: &Value) -> Option<InstanceTrace> {
        let mut b = self.building?;
        let result = b.shape_of(&self.params, result, &mut { RESULT_MAX_VALUES })?;
        // Kept for the whole job: no room to spare.
        b.calls.shrink_to_fit();
        b.args.shrink_to_fit();
        b.consts.shrink_to_fit();
        b.stops.shrink_to_fit();
        Some(InstanceTrace {
            calls: b.calls,
            args: b.args,
            consts: b.consts,
            result,
            outs: b.n_outs,
            stops: b.stops,
        })
    }
}

/// A [`Backend`] in front of another that records the invocations made through it into a
/// [`Recording`], until something makes the run untraceable (then it only forwards).
pub struct Recorder<'r> {
    inner: &'r mut dyn Backend,
    rec: &'r mut Recording,
}

#[derive(Default)]
struct Building {
    calls: Vec<Call>,
    args: Vec<PackedLeaf>,
    consts: Vec<Tensor>,
    /// Lazy result leaves so far, by node: `by_node[node - base]` is (the leaf of output 0,
    /// outputs seen). The run's own nodes are numbered upwards from its first: no hashing.
    base: Option<u32>,
    by_node: Vec<(u32, u32)>,
    /// Tensor result leaves so far (a block run on the host at once): rare, scanned.
    tensor_outs: Vec<(Tensor, u32)>,
    n_outs: u32,
    stops: Vec<u32>,
}

/// The same buffer seen as the same shape (a view of another shape is another value).
#[inline]
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    // Element by element: shapes are a few dimensions, and slice equality calls `memcmp`.
    a.buffer_id() == b.buffer_id()
        && a.shape().len() == b.shape().len()
        && a.shape().iter().zip(b.shape()).all(|(x, y)| x == y)
}

impl<'r> Recorder<'r> {
    /// Records into `rec` the calls made through `inner`.
    pub fn new(inner: &'r mut dyn Backend, rec: &'r mut Recording) -> Self {
        Recorder { inner, rec }
    }

    fn give_up(&mut self) {
        self.rec.building = None;
    }
}

impl Building {
    /// How a recorded run passed tensor value `v`; `None` when it is nothing the trace can name.
    fn leaf_of(&mut self, params: &[Value], v: &Value) -> Option<Leaf> {
        match v {
            Value::Lazy(r) => self.lazy_leaf(*r).map(Leaf::Out),
            Value::Tensor(t) => {
                if let Some((_, k)) = self.tensor_outs.iter().find(|(o, _)| same_tensor(o, t)) {
                    return Some(Leaf::Out(*k));
                }
                let param = params
                    .iter()
                    .position(|p| matches!(p, Value::Tensor(p) if same_tensor(p, t)));
                if let Some(k) = param {
                    return Some(Leaf::Param(k as u32));
                }
                self.consts.push(t.clone());
                Some(Leaf::Const(self.consts.len() as u32 - 1))
            }
            _ => None,
        }
    }

    /// The result leaf that is lazy value `r`, if a call returned it.
    fn lazy_leaf(&self, r: LazyRef) -> Option<u32> {
        let i = r.node.checked_sub(self.base?)?;
        let &(first, outputs) = self.by_node.get(i as usize)?;
        (r.output < outputs).then_some(first + r.output)
    }

    /// Notes that result leaf `k` is lazy value `r`; false where the numbering cannot say it
    /// (a node older than the run's first, a node's outputs not as consecutive leaves from its
    /// output 0).
    fn note_lazy(&mut self, r: LazyRef, k: u32) -> bool {
        let base = *self.base.get_or_insert(r.node);
        let Some(i) = r.node.checked_sub(base).map(|i| i as usize) else {
            return false;
        };
        if self.by_node.len() <= i {
            self.by_node.resize(i + 1, (0, 0));
        }
        let Some(entry) = self.by_node.get_mut(i) else {
            return false;
        };
        match *entry {
            (_, 0) if r.output == 0 => {
                *entry = (k, 1);
                true
            }
            (first, seen) if first + r.output == k && r.output == seen => {
                entry.1 = seen + 1;
                true
            }
            // A value an earlier call returned (`add(%l, 0f)` returns `%l`): this leaf repeats
            // it, and arguments naming it keep naming the first.
            (_, seen) if r.output < seen => true,
            _ => false,
        }
    }

    /// Numbers the leaves of a call's result, in [`leaves`]' order; `None` for a result the trace
    /// cannot rebuild.
    fn note_result(&mut self, v: &Value) -> Option<u32> {
        let mut n = 0;
        let mut ok = true;
        leaves(v, &mut |leaf| {
            let k = self.n_outs + n;
            match leaf {
                Value::Lazy(r) => ok &= self.note_lazy(*r, k),
                // (Scanned per tensor argument: past a few hundred, not traced.)
                Value::Tensor(_) if self.tensor_outs.len() >= TENSOR_OUTS_MAX => ok = false,
                Value::Tensor(t) => self.tensor_outs.push((t.clone(), k)),
                _ => ok = false,
            }
            n += 1;
        });
        self.n_outs += n;
        ok.then_some(n)
    }

    /// Whether `t` is a result leaf or an entry argument: a value the next run may not have.
    fn varies(&self, params: &[Value], t: &Tensor) -> bool {
        self.tensor_outs
            .iter()
            .any(|(o, _)| o.buffer_id() == t.buffer_id())
            || params
                .iter()
                .any(|p| matches!(p, Value::Tensor(p) if p.buffer_id() == t.buffer_id()))
    }

    /// The result's shape, if it has at most `budget` values: past that (a long list, a tree
    /// sharing subtrees, walked once per path) it is not traced, and the recursions here, in
    /// [`build`] and in `Shape`'s drop stay shallow.
    fn shape_of(&mut self, params: &[Value], v: &Value, budget: &mut usize) -> Option<Shape> {
        *budget = budget.checked_sub(1)?;
        Some(match v {
            Value::Tuple(t) => Shape::Tuple(
                t.0.iter()
                    .map(|f| self.shape_of(params, f, budget))
                    .collect::<Option<_>>()?,
            ),
            Value::Adt(a) => Shape::Adt(
                a.ctor,
                a.fields
                    .iter()
                    .map(|f| self.shape_of(params, f, budget))
                    .collect::<Option<_>>()?,
            ),
            Value::Closure(_) => return None,
            leaf => Shape::Leaf(self.leaf_of(params, leaf)?),
        })
    }
}

/// Calls `f` on every tensor and lazy leaf of `v`, depth first, fields in order (and on a
/// closure, which no trace holds).
fn leaves(v: &Value, f: &mut impl FnMut(&Value)) {
    match v {
        Value::Tuple(t) => t.0.iter().for_each(|x| leaves(x, f)),
        Value::Adt(a) => a.fields.iter().for_each(|x| leaves(x, f)),
        other => f(other),
    }
}

impl Backend for Recorder<'_> {
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        // Host work in the program's order (random draws): not replayed.
        self.give_up();
        self.inner.call_op(ctx, op, args, attrs, span)
    }

    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        let (depth, phase) = (ctx.depth, ctx.phase);
        let mut first = 0;
        let rec = &mut *self.rec;
        if let Some(b) = &mut rec.building {
            first = b.args.len() as u32;
            for a in args.iter() {
                match b.leaf_of(&rec.params, a).and_then(PackedLeaf::new) {
                    Some(l) => b.args.push(l),
                    None => {
                        rec.building = None;
                        break;
                    }
                }
            }
        }
        let count = u8::try_from(args.len());
        let v = self.inner.invoke_block(ctx, block, site, args, span)?;
        if let Some(b) = &mut self.rec.building {
            let leaves = b.note_result(&v).and_then(|n| u8::try_from(n).ok());
            match (leaves, count, u16::try_from(phase)) {
                (Some(leaves), Ok(count), Ok(phase)) => b.calls.push(Call {
                    block,
                    site,
                    depth,
                    span,
                    first,
                    phase,
                    count,
                    leaves,
                }),
                // (Hundreds of arguments or outputs, thousands of phases: not worth a wider call.)
                _ => self.rec.building = None,
            }
        }
        Ok(v)
    }

    fn ghost(&mut self, ctx: &mut InstanceCtx, n: u32) {
        // Only moves the depth, which each recorded call carries.
        self.inner.ghost(ctx, n);
    }

    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError> {
        // A branch on a computed value, a result's tensor or a weight may go the other way next
        // time; one on the instance's own data or a literal goes the same way.
        let fixed = match (v, &self.rec.building) {
            (Value::Tensor(t), Some(b)) => !b.varies(&self.rec.params, t),
            _ => false,
        };
        if !fixed {
            self.give_up();
        }
        self.inner.condition(v)
    }

    fn op_args_ready(&mut self, args: &[Value]) -> Result<bool, RunError> {
        self.inner.op_args_ready(args)
    }

    fn growth(&self) -> String {
        self.inner.growth()
    }
}

/// Where a replay of a trace has got to: [`Replaying::resume`] makes its invocations up to the
/// next phase stop or the end.
pub struct Replaying<'t> {
    trace: &'t InstanceTrace,
    /// The leaves of the results of the calls made so far.
    outs: Vec<Value>,
    next: usize,
    next_stop: usize,
}

/// How far a [`Replaying::resume`] went.
pub enum Replayed {
    /// To the end: the instance's result.
    Done(Value),
    /// To a phase boundary (the instance waits for the others there).
    Phase,
}

impl<'t> Replaying<'t> {
    pub fn new(trace: &'t InstanceTrace) -> Self {
        Replaying {
            trace,
            outs: Vec::with_capacity(trace.outs as usize),
            next: 0,
            next_stop: 0,
        }
    }

    /// Hands over the values the replay holds between its turns (the results of the calls made
    /// so far, which the calls after a phase stop read), for early release's scans.
    pub fn visit_values(&self, f: &mut dyn FnMut(&Value)) {
        self.outs.iter().for_each(f);
    }

    /// Makes the trace's next invocations on `backend` for an instance started on entry
    /// arguments `params`: to its next phase stop when `phases` (the barriers are kept), else
    /// through it.
    pub fn resume(
        &mut self,
        params: &[Value],
        ctx: &mut InstanceCtx,
        backend: &mut dyn Backend,
        phases: bool,
    ) -> Result<Replayed, RunError> {
        let trace = self.trace;
        let missing = || RunError::internal("a replayed trace names a value it does not have");
        let value = |leaf: Leaf, outs: &[Value]| -> Result<Value, RunError> {
            match leaf {
                Leaf::Param(k) => params.get(k as usize).cloned().ok_or_else(missing),
                Leaf::Const(k) => trace
                    .consts
                    .get(k as usize)
                    .map(|t| Value::Tensor(t.clone()))
                    .ok_or_else(missing),
                Leaf::Out(k) => outs.get(k as usize).cloned().ok_or_else(missing),
            }
        };
        let mut args: Vec<Value> = Vec::new();
        let mut made = 0usize;
        loop {
            while trace.stops.get(self.next_stop).map(|&c| c as usize) == Some(self.next) {
                self.next_stop += 1;
                if phases {
                    return Ok(Replayed::Phase);
                }
            }
            let Some(call) = trace.calls.get(self.next) else {
                let outs = &self.outs;
                return build(&trace.result, &|leaf| value(leaf, outs)).map(Replayed::Done);
            };
            // As often as the machine looks at the run limits (Ctrl-C, --timeout, the budget).
            made += 1;
            if made % 4096 == 0 {
                if let Err(stop) = tumble_limits::poll() {
                    let held = vec![backend.growth()];
                    return Err(tumble_interp::machine::limit_error(stop, held, ""));
                }
            }
            args.clear();
            let range = call.first as usize..call.first as usize + usize::from(call.count);
            for leaf in trace.args.get(range).ok_or_else(missing)? {
                args.push(value(leaf.leaf(), &self.outs)?);
            }
            ctx.depth = call.depth;
            ctx.phase = u32::from(call.phase);
            let v = backend.invoke_block(ctx, call.block, call.site, &mut args, call.span)?;
            let before = self.outs.len();
            leaves(&v, &mut |l| self.outs.push(l.clone()));
            if self.outs.len() - before != usize::from(call.leaves) {
                return Err(RunError::internal(
                    "a replayed invocation returned another number of values than recorded",
                ));
            }
            self.next += 1;
        }
    }
}

fn build(
    shape: &Shape,
    value: &dyn Fn(Leaf) -> Result<Value, RunError>,
) -> Result<Value, RunError> {
    Ok(match shape {
        Shape::Leaf(l) => value(*l)?,
        Shape::Tuple(fs) => Value::tuple(
            fs.iter()
                .map(|f| build(f, value))
                .collect::<Result<tumble_interp::Fields, _>>()?,
        ),
        Shape::Adt(ctor, fs) => Value::adt(
            *ctor,
            fs.iter()
                .map(|f| build(f, value))
                .collect::<Result<tumble_interp::Fields, _>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::{Leaf, PackedLeaf};

    #[test]
    fn packed_leaves_keep_their_kind_and_index() {
        for leaf in [
            Leaf::Param(0),
            Leaf::Param(7),
            Leaf::Const(0),
            Leaf::Const(PackedLeaf::INDEX),
            Leaf::Out(3),
            Leaf::Out(PackedLeaf::INDEX),
        ] {
            assert_eq!(PackedLeaf::new(leaf).map(PackedLeaf::leaf), Some(leaf));
        }
        // An index that does not fit is refused (the instance is then not traced).
        assert!(PackedLeaf::new(Leaf::Out(PackedLeaf::INDEX + 1)).is_none());
    }
}
