//! The batched backward pass: reverse-mode autodiff over the recorded dataflow graph.
//!
//! The forward runs as usual with the graph recording for the backward
//! ([`Dfg::record_for_backward`]): every launch's nodes, and every node's arguments. The
//! backward walks the launches in reverse and differentiates each one **as one batched launch
//! again**: the launch's inputs are gathered as in the forward (a weight passed once, per-instance
//! values stacked), the block's operators are recomputed batched (activations inside a block are
//! not kept: recomputing them is one more forward launch, and memory follows only the block
//! boundaries), then each operator's vector-Jacobian product runs on the whole batch through the
//! forward's own batching rules ([`batched::rule`]): the batched operator is a plain operator on
//! padded or folded operands, so its vjp is the plain vjp on those operands. A weight shared by
//! the launch is one operand, so its gradient comes out already summed over the launch's rows —
//! `nn.dense`'s `dW = dYᵀ·X` is one product over all rows, an embedding's gradient one
//! scatter-add — never accumulated instance by instance. Operators without a batching rule fall
//! back to a vjp per row (like the forward's per-invocation fallback).
//!
//! Control flow needs nothing here: the graph holds exactly what each instance ran.

use std::sync::Arc;
use std::time::Instant;

use tumble_compile::{BArg, BVal, Program};
use tumble_interp::tape::{accumulate, scalar_loss};
use tumble_interp::{LazyRef, RunError, Value};
use tumble_ops::{OpCtx, OpValue};
use tumble_tensor::{Rng, Tensor};

use crate::batched::{self, OpStats, BV};
use crate::dfg::{Arg, Dfg, Twins};
use crate::kept::Kept;
use crate::{Executable, InstanceError, Options, Reuse};

mod adjoints;
mod dense_grads;
pub(crate) mod fast;
mod param_grad;

use adjoints::Adjoints;

use param_grad::add_dense;
pub use param_grad::{ParamGrad, RowGrad};

/// Switches of the backward pass.
#[derive(Debug, Clone, Copy)]
pub struct GradOptions {
    /// `nn.dense` gradients of f32 operands on the SIMD GEMM of `tumble-kernels` (`dX = dY·W`,
    /// `dW = dYᵀ·X`, each one GEMM over the launch's rows); off: the operator's reference vjp
    /// (plain loops in f64).
    pub gemm: bool,
    /// The f32 fast paths ([`fast`]): the recomputed forward operators and the elementwise and
    /// layout vjps on SIMD loops (off: the operator table's reference rules, in f64).
    pub fast: bool,
    /// The forward keeps every value of its launches (running them operator by operator
    /// instead of the fused plans) and the backward differentiates from those; off: the
    /// forward runs its fused plans and the backward recomputes each launch's operators.
    pub keep: bool,
    /// A parameter's `nn.dense` gradient `dW` summed by one GEMM over the rows of every launch
    /// that read it, when the backward pass ends ([`dense_grads`]); off: one GEMM per launch,
    /// added up launch by launch. Needs `gemm`.
    pub defer_dense: bool,
    /// The forward keeps `add`s of computed tensors as deferred sums (the runtime's sum fusion,
    /// when its option is on): no launch of their own forward or backward; a sum's adjoint goes
    /// to each of its terms. Off: every such `add` is a launch, differentiated as one.
    pub sums: bool,
}

impl Default for GradOptions {
    fn default() -> Self {
        GradOptions {
            gemm: true,
            fast: true,
            keep: true,
            defer_dense: true,
            sums: true,
        }
    }
}

impl GradOptions {
    /// How the forward recorded for this backward runs its launches.
    fn kept_mode(self) -> crate::kept::KeptMode {
        crate::kept::KeptMode {
            eval: self.fast_eval(),
            fast_vjps: self.fast,
        }
    }

    /// The f32 fast path the recomputed (or kept) forward operators try first.
    fn fast_eval(self) -> batched::FastEval {
        match self.fast {
            true => fast::eval,
            false => crate::fastops::try_eval,
        }
    }
}

/// An operator's vjp on plain operands: the GEMM path for f32 `nn.dense`, else the operator
/// table's rule.
fn plain_vjp(
    op: &'static tumble_ops::OpDef,
    args: &[OpValue],
    attrs: &tumble_ir::Attrs,
    out: &OpValue,
    dy: &OpValue,
    gopts: GradOptions,
    threads: usize,
) -> Result<Vec<Option<OpValue>>, RunError> {
    if gopts.gemm && op.name == "nn.dense" {
        if let (Some(OpValue::Tensor(x)), Some(OpValue::Tensor(w)), OpValue::Tensor(g)) =
            (args.first(), args.get(1), dy)
        {
            if let Some(r) = dense_grads::dense_vjp_gemm(x, w, g, threads) {
                let (dx, dw) = r?;
                return Ok(vec![Some(OpValue::Tensor(dx)), Some(OpValue::Tensor(dw))]);
            }
        }
    }
    if gopts.fast {
        if let Some(gs) = fast::vjp(op.name, args, attrs, out, dy) {
            return Ok(gs);
        }
    }
    tumble_ops::vjp::vjp(op, args, attrs, out, dy).map_err(|e| RunError::new(e.message))
}

/// Counters of one backward pass.
#[derive(Debug, Default, Clone)]
pub struct BackwardStats {
    /// Launches differentiated (each one batched backward launch).
    pub launches: u64,
    /// Launches skipped: nothing they computed reaches the output.
    pub skipped: u64,
    /// Operator vjps run once for the whole launch / once per row (no batching rule).
    pub batched_vjps: u64,
    /// Splits whose vjp ran with their parts' unary operators' in one pass
    /// (`split_vjp_fusions`).
    pub split_vjps_fused: u64,
    pub looped_vjps: u64,
    /// Weight gradients produced as one sum over a launch's rows.
    pub shared_grads: u64,
    /// `nn.dense` parameter gradients deferred to one product per parameter at the pass's end
    /// ([`GradOptions::defer_dense`]).
    pub deferred_dense: u64,
    /// Invocations that took the results of an identical one of their launch (differentiated
    /// once, their output gradients summed).
    pub memoized: u64,
    /// The most heap bytes live at once beyond those live when the mini-batch started (sampled
    /// after the forward and after each backward launch; counted by `tumble_limits`' allocator
    /// where the binary installs it, else 0).
    pub peak_bytes: usize,
    pub time_forward: std::time::Duration,
    pub time_backward: std::time::Duration,
    /// The recorded forward's own split (host program, graph, launches): the batched engine's
    /// profile of the mini-batch's forward.
    pub forward: crate::Profile,
}

impl BackwardStats {
    /// Adds the counters of another pass (peak bytes: the larger).
    pub fn add(&mut self, o: &BackwardStats) {
        self.launches += o.launches;
        self.skipped += o.skipped;
        self.batched_vjps += o.batched_vjps;
        self.split_vjps_fused += o.split_vjps_fused;
        self.looped_vjps += o.looped_vjps;
        self.shared_grads += o.shared_grads;
        self.deferred_dense += o.deferred_dense;
        self.memoized += o.memoized;
        self.peak_bytes = self.peak_bytes.max(o.peak_bytes);
        self.time_forward += o.time_forward;
        self.time_backward += o.time_backward;
        self.forward.add(&o.forward);
    }
}

/// The result of [`grad_batch`]: each instance's output (the loss) and, per differentiable
/// parameter, the gradient of the sum of the outputs (`None`: no output depends on it).
pub struct BatchGrad {
    pub losses: Vec<f64>,
    pub grads: Vec<Option<ParamGrad>>,
    pub stats: BackwardStats,
}

fn internal(m: impl std::fmt::Display) -> RunError {
    RunError::new(format!("internal: backward: {m}"))
}

fn at_instance(instance: Option<usize>) -> impl Fn(RunError) -> InstanceError {
    move |error| InstanceError { instance, error }
}

/// Runs global `entry` for every instance as one mini-batch (like [`crate::run_batch`]) and
/// differentiates the sum of the instances' outputs (float scalars) with respect to `params`:
/// tensors passed among the instances' arguments (the bound weights), recognized by identity.
#[allow(clippy::too_many_arguments)]
pub fn grad_batch(
    program: &Program,
    reuse: &Reuse,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    gopts: GradOptions,
    params: &[Tensor],
) -> Result<BatchGrad, InstanceError> {
    grad_batch_traced(program, reuse, entry, args, rngs, opts, gopts, params, None)
}

/// [`grad_batch`] with a trace slot per instance (`traces[i]` for `args[i]`; see
/// [`crate::trace`]): an instance whose slot holds a trace is replayed instead of interpreted,
/// one whose slot is empty is recorded. The same graph either way, so the same gradient bits.
#[allow(clippy::too_many_arguments)]
pub fn grad_batch_traced(
    program: &Program,
    reuse: &Reuse,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    gopts: GradOptions,
    params: &[Tensor],
    traces: Option<&[Option<&crate::trace::TraceSlot>]>,
) -> Result<BatchGrad, InstanceError> {
    let exec = Arc::new(Executable::new(program, reuse, &opts));
    grad_batch_in(
        &exec, program, reuse, entry, args, rngs, opts, gopts, params, traces,
    )
}

/// [`grad_batch_traced`] on `exec`, the job's executable (made for `program` with `opts`): its
/// plans and per-block facts serve every mini-batch of the job, and what it caches from the
/// weights' values (packed products) the next mini-batch too — a caller that changes the
/// weights in place between mini-batches (a trainer) calls [`Executable::forget_weight_values`]
/// first.
#[allow(clippy::too_many_arguments)]
pub fn grad_batch_in(
    exec: &Arc<Executable>,
    program: &Program,
    reuse: &Reuse,
    entry: &str,
    args: Vec<Vec<Value>>,
    rngs: Vec<Rng>,
    opts: Options,
    gopts: GradOptions,
    params: &[Tensor],
    traces: Option<&[Option<&crate::trace::TraceSlot>]>,
) -> Result<BatchGrad, InstanceError> {
    let t0 = Instant::now();
    // The mini-batch's own bytes: what was live before it (weights, the job's decoded
    // instances, other workers' state) is not its peak.
    let base_bytes = tumble_limits::in_use();
    let own_bytes = || tumble_limits::in_use().saturating_sub(base_bytes);
    let index = *program
        .global_index
        .get(entry)
        .ok_or_else(|| RunError::new(format!("the module has no global `@{entry}`")))
        .map_err(at_instance(None))?;
    if !program.derived.is_empty() {
        // Their values are computed outside the recorded graph: no gradient would reach the
        // weights they read.
        return Err(at_instance(None)(RunError::new(
            "internal: gradients of a program compiled with derived parameters \
             (compile it with `StaticOptions::derive` off)",
        )));
    }
    let _weights = crate::gemm::WeightCache::enter(&exec.weights);
    let mut dfg = Dfg::new(program, reuse, exec.clone(), opts);
    dfg.record_for_backward(gopts.keep.then_some(gopts.kept_mode()), gopts.sums);
    let n = args.len();
    let results = crate::drive(program, index, args, rngs, opts, &mut dfg, traces)?;
    let mut stats = BackwardStats {
        time_forward: t0.elapsed(),
        peak_bytes: own_bytes(),
        ..BackwardStats::default()
    };
    stats.forward.add(&dfg.profile);
    let t1 = Instant::now();
    let mut grads: Vec<Option<ParamGrad>> = vec![None; params.len()];
    let crate::dfg::BackwardRecord {
        log,
        mut kept,
        twins,
    } = dfg.take_backward_record();
    stats.memoized = twins.aliases().count() as u64;
    let active = activity(&dfg, &log, &twins, params);
    let mut adj = Adjoints::new(dfg.node_count(), &log, twins);
    let mut losses = Vec::with_capacity(n);
    for (i, r) in results.into_iter().enumerate() {
        let fail = at_instance(Some(i));
        let v = r
            .ok_or_else(|| internal("instance produced no result"))
            .map_err(&fail)?;
        let (t, root) = match &v {
            Value::Tensor(t) => (t.clone(), None),
            Value::Lazy(r) => (
                dfg.concrete(*r)
                    .map_err(&fail)?
                    .ok_or_else(|| internal("result not computed"))
                    .map_err(&fail)?,
                Some(*r),
            ),
            other => {
                return Err(fail(RunError::new(format!(
                    "the gradient needs `@{entry}` to return a float scalar (shape () or one \
                     element), but it returned {}",
                    other.kind()
                ))))
            }
        };
        losses.push(scalar_loss(&t).map_err(|m| fail(RunError::new(m)))?);
        let one =
            Tensor::full_f64(t.shape().to_vec(), t.dtype(), 1.0).map_err(|e| fail(internal(e)))?;
        match root {
            Some(r) => adj.add(&dfg, r, one).map_err(&fail)?,
            None => {
                if let Some(k) = param_of(params, &t) {
                    if let Some(slot) = grads.get_mut(k) {
                        add_dense(slot, one).map_err(|m| fail(internal(m)))?;
                    }
                }
            }
        }
    }
    hand_value_grads(&mut adj, params, &mut grads).map_err(at_instance(None))?;
    let mut rng = Rng::new(0);
    let mut deferred = dense_grads::DeferredDense::default();
    for (l, ids) in log.iter().enumerate().rev() {
        let instance = ids
            .first()
            .and_then(|&id| dfg.node(id))
            .map(|n| n.instance as usize);
        let span = ids.first().and_then(|&id| dfg.node(id)).map(|n| n.span);
        backward_launch(
            &dfg,
            l,
            ids,
            kept.get_mut(l).and_then(Option::take),
            params,
            &active,
            &mut adj,
            &mut grads,
            &mut deferred,
            &mut stats,
            &mut rng,
            gopts,
            opts.threads,
        )
        .and_then(|()| hand_value_grads(&mut adj, params, &mut grads))
        .map_err(|mut e| {
            if e.span.is_none() {
                e.span = span;
            }
            InstanceError { instance, error: e }
        })?;
        stats.peak_bytes = stats.peak_bytes.max(own_bytes());
        if let Err(stop) = tumble_limits::poll() {
            return Err(InstanceError {
                instance,
                error: RunError::new(format!("in the backward pass: {stop}")),
            });
        }
    }
    deferred
        .finish(&mut grads, opts.threads)
        .map_err(at_instance(None))?;
    stats.time_backward = t1.elapsed();
    Ok(BatchGrad {
        losses,
        grads,
        stats,
    })
}

/// Which parameter `t` is (the same buffer and shape), if any.
fn param_of(params: &[Tensor], t: &Tensor) -> Option<usize> {
    params
        .iter()
        .position(|p| p.shares_buffer(t) && p.shape() == t.shape())
}

/// The gradients the adjoints collected for value terms of deferred sums, added to the
/// parameters they are (a literal term's is dropped).
fn hand_value_grads(
    adj: &mut Adjoints,
    params: &[Tensor],
    grads: &mut [Option<ParamGrad>],
) -> Result<(), RunError> {
    for (v, g) in adj.take_value_grads() {
        if let Some(slot) = param_of(params, &v).and_then(|k| grads.get_mut(k)) {
            add_dense(slot, g).map_err(internal)?;
        }
    }
    Ok(())
}

/// Per node id: whether it depends on a parameter (others are skipped by the backward).
/// Launches (`log`) are in dependency order, so one forward pass over them decides it; an input
/// computed by an invocation that took a twin's results is the twin's (`twins`), which the log
/// lists.
fn activity(dfg: &Dfg, log: &[Vec<u32>], twins: &Twins, params: &[Tensor]) -> Vec<bool> {
    let mut active = vec![false; dfg.node_count()];
    // A deferred sum (never launched) depends on a parameter where one of its terms does.
    fn arg_active(dfg: &Dfg, active: &[bool], twins: &Twins, params: &[Tensor], a: &Arg) -> bool {
        match a {
            Arg::Val(t) => t.dtype().is_float() && param_of(params, t).is_some(),
            Arg::Lazy(r) => match dfg.sum_terms(r.node) {
                Some(terms) => terms
                    .iter()
                    .any(|t| arg_active(dfg, active, twins, params, t)),
                None => active
                    .get(twins.canonical(r.node) as usize)
                    .copied()
                    .unwrap_or(false),
            },
        }
    }
    for &id in log.iter().flatten() {
        let a = dfg.node(id).is_some_and(|n| {
            n.args
                .iter()
                .any(|a| arg_active(dfg, &active, twins, params, a))
        });
        if let Some(slot) = active.get_mut(id as usize) {
            *slot = a;
        }
    }
    active
}

/// Where one row's block input came from.
#[derive(Clone, Copy)]
enum Source {
    Node(LazyRef),
    Param(usize),
    Const,
}

/// `t` (of shape `(b, s...)`) summed over its leading axis.
fn sum_rows(t: &Tensor) -> Result<Tensor, RunError> {
    let shape = t.shape().get(1..).unwrap_or_default().to_vec();
    let b = t.shape().first().copied().unwrap_or(0);
    let len: usize = shape.iter().product();
    if let Some(v) = t.as_slice::<f32>() {
        let mut acc = vec![0f32; len];
        for r in 0..b {
            for (a, x) in acc.iter_mut().zip(&v[r * len..(r + 1) * len]) {
                *a += x;
            }
        }
        return Tensor::from_vec(shape, acc).map_err(internal);
    }
    let v = t.to_f64_vec();
    let mut acc = vec![0f64; len];
    for r in 0..b {
        for (a, x) in acc.iter_mut().zip(&v[r * len..(r + 1) * len]) {
            *a += x;
        }
    }
    Ok(Tensor::from_vec(shape, acc)
        .map_err(internal)?
        .cast(t.dtype()))
}

/// The gradient `g` of a value `like` in `like`'s form: a shared value's gradient is the sum
/// over the rows (a batched gradient is summed), a batched value's is per row.
fn conform(g: BV, like: &BV, b: usize) -> Result<BV, RunError> {
    match (g, like) {
        (BV::Batched(OpValue::Tensor(g)), BV::Shared(OpValue::Tensor(_))) => {
            Ok(BV::Shared(OpValue::Tensor(sum_rows(&g)?)))
        }
        (BV::Batched(OpValue::Tuple(gs)), BV::Shared(OpValue::Tuple(_))) => Ok(BV::Shared(
            OpValue::Tuple(gs.iter().map(sum_rows).collect::<Result<_, _>>()?),
        )),
        (BV::Shared(OpValue::Tensor(g)), BV::Batched(OpValue::Tensor(_))) => Ok(BV::Batched(
            OpValue::Tensor(batched::broadcast_batch(&g, b).map_err(internal)?),
        )),
        (g, _) => Ok(g),
    }
}

fn add_bv(slot: &mut Option<BV>, g: BV) -> Result<(), RunError> {
    let merged = match (slot.take(), g) {
        (None, g) => g,
        (Some(BV::Shared(OpValue::Tensor(a))), BV::Shared(OpValue::Tensor(b))) => {
            let mut s = Some(a);
            accumulate(&mut s, b).map_err(internal)?;
            BV::Shared(OpValue::Tensor(s.ok_or_else(|| internal("empty sum"))?))
        }
        (Some(BV::Batched(OpValue::Tensor(a))), BV::Batched(OpValue::Tensor(b))) => {
            let mut s = Some(a);
            accumulate(&mut s, b).map_err(internal)?;
            BV::Batched(OpValue::Tensor(s.ok_or_else(|| internal("empty sum"))?))
        }
        _ => return Err(internal("gradients of different forms added")),
    };
    *slot = Some(merged);
    Ok(())
}

/// Adds gradient `g` to the block value `v` (per node result: one slot per tuple field).
fn route(
    v: &BVal,
    g: BV,
    b: usize,
    inputs: &[BV],
    results: &[BV],
    in_adj: &mut [Option<BV>],
    node_adj: &mut [Vec<Option<BV>>],
) -> Result<(), RunError> {
    match v {
        BVal::Const(_) => Ok(()),
        BVal::Input(i) => {
            let i = *i as usize;
            let like = inputs.get(i).ok_or_else(|| internal("no input"))?;
            let g = conform(g, like, b)?;
            add_bv(in_adj.get_mut(i).ok_or_else(|| internal("no input"))?, g)
        }
        BVal::Node(n) | BVal::Field(n, _) => {
            let f = match v {
                BVal::Field(_, f) => *f as usize,
                _ => 0,
            };
            let n = *n as usize;
            let like = match (results.get(n), v) {
                (Some(BV::Shared(OpValue::Tuple(ts))), BVal::Field(..)) => BV::Shared(
                    OpValue::Tensor(ts.get(f).cloned().ok_or_else(|| internal("field"))?),
                ),
                (Some(BV::Batched(OpValue::Tuple(ts))), BVal::Field(..)) => BV::Batched(
                    OpValue::Tensor(ts.get(f).cloned().ok_or_else(|| internal("field"))?),
                ),
                (Some(r), _) => r.clone(),
                (None, _) => return Err(internal("no node")),
            };
            let g = conform(g, &like, b)?;
            let slots = node_adj.get_mut(n).ok_or_else(|| internal("no node"))?;
            if slots.len() <= f {
                slots.resize(f + 1, None);
            }
            add_bv(&mut slots[f], g)
        }
    }
}

/// A batched operand's gradient from the plain operator's: back to the operand's own shape
/// (rules only pad or fold batched operands), summed over the batch for a shared operand the
/// rule broadcast.
fn unplain(g: OpValue, arg: &BV, b: usize) -> Result<BV, RunError> {
    match (g, arg) {
        (OpValue::Tensor(g), BV::Shared(OpValue::Tensor(t))) => {
            if g.shape() == t.shape() {
                Ok(BV::Shared(OpValue::Tensor(g)))
            } else {
                let mut s = vec![b];
                s.extend_from_slice(t.shape());
                Ok(BV::Shared(OpValue::Tensor(sum_rows(
                    &g.reshape(s).map_err(internal)?,
                )?)))
            }
        }
        (OpValue::Tensor(g), BV::Batched(OpValue::Tensor(t))) => Ok(BV::Batched(OpValue::Tensor(
            g.reshape(t.shape().to_vec()).map_err(internal)?,
        ))),
        (OpValue::Tuple(gs), BV::Batched(OpValue::Tuple(ts))) => Ok(BV::Batched(OpValue::Tuple(
            gs.into_iter()
                .zip(ts)
                .map(|(g, t)| g.reshape(t.shape().to_vec()).map_err(internal))
                .collect::<Result<_, _>>()?,
        ))),
        (OpValue::Tuple(gs), BV::Shared(OpValue::Tuple(_))) => Ok(BV::Shared(OpValue::Tuple(gs))),
        _ => Err(internal("gradient form does not match its operand")),
    }
}

/// The output gradient of a node result `out` from its per-field gradients (zeros where none).
fn dy_of(out: &BV, slots: &[Option<BV>]) -> Result<Option<BV>, RunError> {
    if slots.iter().all(Option::is_none) {
        return Ok(None);
    }
    let zeros = |t: &Tensor| Tensor::zeros(t.shape().to_vec(), t.dtype()).map_err(internal);
    let field = |i: usize| slots.get(i).and_then(Option::as_ref);
    Ok(Some(match out {
        BV::Shared(OpValue::Tensor(_)) | BV::Batched(OpValue::Tensor(_)) => {
            field(0).cloned().ok_or_else(|| internal("no gradient"))?
        }
        BV::Batched(OpValue::Tuple(ts)) | BV::Shared(OpValue::Tuple(ts)) => {
            let mut fs = Vec::with_capacity(ts.len());
            for (i, t) in ts.iter().enumerate() {
                fs.push(match field(i) {
                    Some(BV::Batched(OpValue::Tensor(g)) | BV::Shared(OpValue::Tensor(g))) => {
                        g.clone()
                    }
                    _ => zeros(t)?,
                });
            }
            match out {
                BV::Shared(_) => BV::Shared(OpValue::Tuple(fs)),
                _ => BV::Batched(OpValue::Tuple(fs)),
            }
        }
        BV::Rows(_) => return Err(internal("unexpected value form")),
    }))
}

fn plain_of(v: &BV) -> Result<OpValue, RunError> {
    match v {
        BV::Shared(x) | BV::Batched(x) => Ok(x.clone()),
        BV::Rows(r) => r.stack().map(OpValue::Tensor).map_err(internal),
    }
}

/// The vjp of one operator of a block over the whole launch.
#[allow(clippy::too_many_arguments)]
fn vjp_batched(
    op: &'static tumble_ops::OpDef,
    attrs: &tumble_ir::Attrs,
    args: &[BV],
    out: &BV,
    dy: BV,
    b: usize,
    stats: &mut BackwardStats,
    gopts: GradOptions,
    threads: usize,
) -> Result<Vec<Option<BV>>, RunError> {
    if args.iter().all(|a| matches!(a, BV::Shared(_))) {
        let plain = args.iter().map(plain_of).collect::<Result<Vec<_>, _>>()?;
        let dy = conform(dy, out, b)?;
        let gs = plain_vjp(
            op,
            &plain,
            attrs,
            &plain_of(out)?,
            &plain_of(&dy)?,
            gopts,
            threads,
        )?;
        return Ok(gs.into_iter().map(|g| g.map(BV::Shared)).collect());
    }
    let dy = conform(dy, out, b)?;
    if let Some((plain, pattrs)) = batched::rule(op, attrs, args, b) {
        let mut pout = plain_of(out)?;
        let mut pdy = plain_of(&dy)?;
        // batch_matmul's rule folds the batch into the operator's own batch axis.
        if op.name == "nn.batch_matmul" {
            for v in [&mut pout, &mut pdy] {
                if let OpValue::Tensor(t) = v {
                    if let [bb, g, m, n] = t.shape() {
                        *v = OpValue::Tensor(t.reshape(vec![bb * g, *m, *n]).map_err(internal)?);
                    }
                }
            }
        }
        // batch_norm's rule returns the shared statistics once per instance: the operator's own
        // are the first row, their gradients the sums over the batch.
        if op.name == "nn.batch_norm" {
            for (v, sum) in [(&mut pout, false), (&mut pdy, true)] {
                if let OpValue::Tuple(ts) = v {
                    for t in ts.iter_mut().skip(1) {
                        *t = if sum {
                            batch_sum(t, b)?
                        } else {
                            t.row(0).map_err(internal)?
                        };
                    }
                }
            }
        }
        stats.batched_vjps += 1;
        let gs = plain_vjp(op, &plain, &pattrs, &pout, &pdy, gopts, threads)?;
        let mut out = Vec::with_capacity(gs.len());
        for (g, a) in gs.into_iter().zip(args) {
            out.push(match g {
                None => None,
                Some(g) => {
                    if matches!(a, BV::Shared(_)) {
                        stats.shared_grads += 1;
                    }
                    Some(unplain(g, a, b)?)
                }
            });
        }
        return Ok(out);
    }
    stats.looped_vjps += 1;
    let mut per_arg: Vec<Vec<Option<OpValue>>> = vec![Vec::with_capacity(b); args.len()];
    for r in 0..b {
        let row_args = args
            .iter()
            .map(|a| batched::row_of(a, r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(internal)?;
        let row_out = batched::row_of(out, r).map_err(internal)?;
        let row_dy = batched::row_of(&dy, r).map_err(internal)?;
        let gs = plain_vjp(op, &row_args, attrs, &row_out, &row_dy, gopts, threads)?;
        for (slot, g) in per_arg.iter_mut().zip(gs) {
            slot.push(g);
        }
    }
    let mut grads = Vec::with_capacity(args.len());
    for (rows, a) in per_arg.into_iter().zip(args) {
        if rows.iter().any(Option::is_none) {
            grads.push(None);
            continue;
        }
        let rows: Vec<OpValue> = rows.into_iter().flatten().collect();
        let stacked = batched::stack_values(rows).map_err(internal)?;
        grads.push(Some(conform(stacked, a, b)?));
    }
    Ok(grads)
}

/// `t` (`b` rows of one shape) summed over its rows, in f64, in `t`'s dtype.
fn batch_sum(t: &Tensor, b: usize) -> Result<Tensor, RunError> {
    let shape = t.shape().get(1..).unwrap_or_default().to_vec();
    let n = t.len() / b.max(1);
    let mut acc = vec![0.0; n];
    for row in t.to_f64_vec().chunks(n.max(1)) {
        acc.iter_mut().zip(row).for_each(|(a, v)| *a += v);
    }
    Ok(Tensor::from_f64(shape, acc)
        .map_err(internal)?
        .cast(t.dtype()))
}

/// The parameter every row of input `i` is, if one is.
fn single_param(sources: &[Vec<Source>], i: usize) -> Option<usize> {
    match sources.get(i).map(Vec::as_slice) {
        Some([Source::Param(p), rest @ ..])
            if rest.iter().all(|s| matches!(s, Source::Param(q) if q == p)) =>
        {
            Some(*p)
        }
        _ => None,
    }
}

/// Node `j` of `block` when it is a `strided_slice` of a 2-D parameter that every row reads
/// whole (a block input), with unit steps: the parameter and the rows and columns it takes.
fn sliced_param(
    block: &tumble_compile::Block,
    j: usize,
    sources: &[Vec<Source>],
    inputs: &[BV],
) -> Option<(usize, dense_grads::Region)> {
    let node = block.nodes.get(j)?;
    if node.op.name != "strided_slice" {
        return None;
    }
    let [BArg::One(BVal::Input(i))] = node.args.as_slice() else {
        return None;
    };
    let p = single_param(sources, *i as usize)?;
    let Some(BV::Shared(OpValue::Tensor(w))) = inputs.get(*i as usize) else {
        return None;
    };
    let plan = tumble_ops::slice_plan(&node.attrs, w.shape())?;
    let [(r0, 1, rn), (c0, 1, cn)] = plan[..] else {
        return None;
    };
    let u = |v: i64| usize::try_from(v).ok();
    Some((
        p,
        dense_grads::Region {
            full: [*w.shape().first()?, *w.shape().get(1)?],
            rows: [u(r0)?, u(r0 + rn)?],
            cols: [u(c0)?, u(c0 + cn)?],
        },
    ))
}

/// A `split` of a launch whose vjp runs with its parts' unary operators' ([`split_vjp_fusions`]):
/// the kept forward's fusion record and how the split cuts its operand.
struct FusedSplit<'f> {
    su: &'f crate::kept::SplitUnaries,
    rows: usize,
    width: usize,
    sizes: Vec<usize>,
    shape: Vec<usize>,
}

/// Whether the backward runs a split's vjp with its readers' (`TUMBLE_NO_SPLIT_VJP_FUSION=1`:
/// each operator's vjp apart, then the split's concatenation; the same bits).
fn split_vjp_fusion_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_SPLIT_VJP_FUSION")
}

/// The splits of a launch of `block` (block number `index`) each of whose parts one result-only
/// unary operator reads — an LSTM cell's gates, the kept forward's [`crate::kept::SplitUnaries`]
/// —, with the f32 vjps and the launch's values in the forms [`fused_split_gradient`] takes: their
/// operand's gradient is then written in one pass, part by part in its columns, instead of each
/// operator's vjp writing its part's gradient and the split's vjp copying them together.
fn split_vjp_fusions<'f>(
    dfg: &'f Dfg,
    index: u32,
    block: &tumble_compile::Block,
    node_args: &[Vec<BV>],
    results: &[BV],
    gopts: GradOptions,
) -> Vec<FusedSplit<'f>> {
    if !gopts.fast || !split_vjp_fusion_enabled() {
        return Vec::new();
    }
    let Some(fusions) = dfg.exec.kept_fusions.get(index as usize) else {
        return Vec::new();
    };
    let batched_f32 = |v: Option<&BV>| match v {
        Some(BV::Batched(OpValue::Tensor(t))) if t.as_f32().is_some() => Some(t.clone()),
        _ => None,
    };
    let mut found = Vec::new();
    for su in fusions.for_vjps(true).split_unaries() {
        let Some(x) = batched_f32(node_args.get(su.split).and_then(|a| a.first())) else {
            continue;
        };
        let Some((rows, width, sizes)) = crate::kept::split_layout(block, su, &x) else {
            continue;
        };
        let results_fit = su
            .readers
            .iter()
            .zip(&sizes)
            .all(|(&r, &w)| batched_f32(results.get(r)).is_some_and(|y| y.len() == rows * w));
        if results_fit {
            found.push(FusedSplit {
                su,
                rows,
                width,
                sizes,
                shape: x.shape().to_vec(),
            });
        }
    }
    found
}

/// The gradient of fused split `f`'s operand from its readers' output gradients (`None`: none
/// reached any of them).
fn fused_split_gradient(
    f: &FusedSplit,
    block: &tumble_compile::Block,
    results: &[BV],
    node_adj: &[Vec<Option<BV>>],
) -> Result<Option<Tensor>, RunError> {
    let mut dys = Vec::with_capacity(f.su.readers.len());
    for &r in &f.su.readers {
        let (Some(out), Some(slots)) = (results.get(r), node_adj.get(r)) else {
            return Err(internal("split reader"));
        };
        dys.push(dy_of(out, slots)?);
    }
    if dys.iter().all(Option::is_none) {
        return Ok(None);
    }
    fn f32_of(v: Option<&BV>) -> Option<&[f32]> {
        match v {
            Some(BV::Batched(OpValue::Tensor(t))) => t.as_f32(),
            _ => None,
        }
    }
    let mut parts = Vec::with_capacity(dys.len());
    for ((&r, &width), dy) in f.su.readers.iter().zip(&f.sizes).zip(&dys) {
        let op = block
            .nodes
            .get(r)
            .ok_or_else(|| internal("split reader"))?
            .op
            .name;
        let y = f32_of(results.get(r)).ok_or_else(|| internal("split reader's result"))?;
        let dy = match dy {
            Some(g) => Some(f32_of(Some(g)).ok_or_else(|| internal("split reader's gradient"))?),
            None => None,
        };
        parts.push(fast::SplitPart { op, width, y, dy });
    }
    let dx = fast::split_unaries_vjp(f.rows, f.width, &parts)
        .ok_or_else(|| internal("split gradient"))?;
    Tensor::from_vec(f.shape.clone(), dx)
        .map(Some)
        .map_err(internal)
}

/// Differentiates one launch (nodes `ids` of one block), batched.
#[allow(clippy::too_many_arguments)]
fn backward_launch(
    dfg: &Dfg,
    launch: usize,
    ids: &[u32],
    kept: Option<Kept>,
    params: &[Tensor],
    active: &[bool],
    adj: &mut Adjoints,
    grads: &mut [Option<ParamGrad>],
    deferred: &mut dense_grads::DeferredDense,
    stats: &mut BackwardStats,
    rng: &mut Rng,
    gopts: GradOptions,
    threads: usize,
) -> Result<(), RunError> {
    let nodes = ids
        .iter()
        .map(|&id| dfg.node(id).ok_or_else(|| internal("unknown node")))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = nodes.first() else {
        return Ok(());
    };
    let block = dfg
        .program()
        .blocks
        .get(first.block as usize)
        .ok_or_else(|| internal("unknown block"))?;
    let b = ids.len();
    let n_out = block.outputs.len();
    // The output gradients, per output, stacked over the rows (zeros for rows without one).
    let mut any = false;
    let mut dys: Vec<Option<BV>> = Vec::with_capacity(n_out);
    let launch_active = ids.iter().any(|&id| active.get(id as usize) == Some(&true));
    for o in 0..n_out {
        let g = adj.take_output(dfg, launch, ids, o)?;
        match g {
            Some(g) if launch_active => {
                any = true;
                dys.push(Some(BV::Batched(OpValue::Tensor(g))));
            }
            _ => dys.push(None),
        }
    }
    if !any {
        stats.skipped += 1;
        return Ok(());
    }
    stats.launches += 1;
    // Where each row's inputs came from, to hand their gradients back.
    let mut sources: Vec<Vec<Source>> = Vec::with_capacity(block.inputs.len());
    for i in 0..block.inputs.len() {
        let mut row_sources = Vec::with_capacity(b);
        for n in &nodes {
            row_sources.push(match n.args.get(i) {
                Some(Arg::Lazy(r)) => Source::Node(*r),
                Some(Arg::Val(t)) if t.dtype().is_float() => {
                    param_of(params, t).map_or(Source::Const, Source::Param)
                }
                Some(Arg::Val(_)) => Source::Const,
                None => return Err(internal("missing argument")),
            });
        }
        sources.push(row_sources);
    }
    // The launch's values: kept by the forward, else its inputs stacked again (a tensor passed
    // to every row once) and its operators recomputed batched, keeping every result.
    let Kept {
        inputs,
        results,
        args: node_args,
    } = match kept {
        Some(k) => k,
        None => {
            let inputs = dfg.stacked_inputs(block.inputs.len(), ids, gopts.fast)?;
            let mut ostats = OpStats::default();
            let mut octx = OpCtx { rng };
            let mut ops = batched::LaunchOps {
                octx: &mut octx,
                stats: &mut ostats,
                fast: gopts.fast_eval(),
                threads,
            };
            let fusions = dfg.exec.kept_fusions.get(first.block as usize);
            let fusions = fusions.map(|f| f.for_vjps(gopts.fast));
            crate::kept::run_block_kept(block, inputs, b, &mut ops, None, fusions)
                .map_err(RunError::new)?
        }
    };
    let mut in_adj: Vec<Option<BV>> = vec![None; inputs.len()];
    let mut node_adj: Vec<Vec<Option<BV>>> = vec![Vec::new(); block.nodes.len()];
    for (o, dy) in dys.into_iter().enumerate() {
        if let (Some(dy), Some(v)) = (dy, block.outputs.get(o)) {
            route(v, dy, b, &inputs, &results, &mut in_adj, &mut node_adj)?;
        }
    }
    let fused_splits = split_vjp_fusions(dfg, first.block, block, &node_args, &results, gopts);
    for (k, node) in block.nodes.iter().enumerate().rev() {
        // A fused split's readers: their vjps run with the split's, below.
        if fused_splits.iter().any(|f| f.su.readers.contains(&k)) {
            continue;
        }
        if let Some(f) = fused_splits.iter().find(|f| f.su.split == k) {
            if let (Some(dx), Some(BArg::One(v))) = (
                fused_split_gradient(f, block, &results, &node_adj)?,
                node.args.first(),
            ) {
                stats.batched_vjps += f.su.readers.len() as u64 + 1;
                stats.split_vjps_fused += 1;
                let dx = BV::Batched(OpValue::Tensor(dx));
                route(v, dx, b, &inputs, &results, &mut in_adj, &mut node_adj)?;
            }
            continue;
        }
        let (Some(out), Some(args), Some(slots)) =
            (results.get(k), node_args.get(k), node_adj.get(k))
        else {
            continue;
        };
        let Some(dy) = dy_of(out, slots)? else {
            continue;
        };
        // A product with a parameter read whole by every row: `dX` now, `dW` with the other
        // launches' when the pass ends (`dense_grads`).
        // (Or with a block of a parameter's rows and columns: a hoisting split's `x` and `h`
        // columns of one weight, its `dW` kept for that block of the parameter.)
        if gopts.gemm && gopts.defer_dense && node.op.name == "nn.dense" {
            let target = match node.args.get(1) {
                Some(BArg::One(BVal::Input(i))) => single_param(&sources, *i as usize)
                    .map(|p| (dense_grads::Target::whole(p), inputs.get(*i as usize))),
                Some(BArg::One(BVal::Node(j))) => {
                    sliced_param(block, *j as usize, &sources, &inputs).map(|(p, region)| {
                        (
                            dense_grads::Target {
                                param: p,
                                region: Some(region),
                            },
                            results.get(*j as usize),
                        )
                    })
                }
                _ => None,
            };
            if let (Some(BArg::One(x_at)), Some((target, w))) = (node.args.first(), target) {
                if let (
                    Some(BV::Shared(OpValue::Tensor(w))),
                    Some(BV::Batched(OpValue::Tensor(x))),
                    BV::Batched(OpValue::Tensor(g)),
                ) = (w, args.first(), &dy)
                {
                    if let Some(dx) =
                        dense_grads::dense_dx_deferring_dw(x, w, g, target, deferred, threads)
                    {
                        let dx = BV::Batched(OpValue::Tensor(dx?));
                        stats.batched_vjps += 1;
                        stats.deferred_dense += 1;
                        route(x_at, dx, b, &inputs, &results, &mut in_adj, &mut node_adj)?;
                        continue;
                    }
                }
            }
        }
        // An embedding lookup of a model weight: its rows' gradients go straight into the
        // weight's gradient (no dense table-sized gradient per launch).
        if gopts.fast && node.op.name == "take" {
            if let (Some(BArg::One(BVal::Input(i))), Some(idx)) = (node.args.first(), args.get(1)) {
                let param = single_param(&sources, *i as usize);
                let table = inputs.get(*i as usize);
                if let (Some(p), Some(BV::Shared(OpValue::Tensor(table)))) = (param, table) {
                    if let Some(slot) = grads.get_mut(p) {
                        if fast::scatter_rows_into(slot, table, idx, &dy, &node.attrs) {
                            continue;
                        }
                    }
                }
            }
        }
        let gs = vjp_batched(
            node.op,
            &node.attrs,
            args,
            out,
            dy,
            b,
            stats,
            gopts,
            threads,
        )?;
        for (g, a) in gs.into_iter().zip(&node.args) {
            let Some(g) = g else { continue };
            match a {
                BArg::One(v) => route(v, g, b, &inputs, &results, &mut in_adj, &mut node_adj)?,
                BArg::Tuple(vs) => {
                    let (fields, shared) = match g {
                        BV::Batched(OpValue::Tuple(fs)) => (fs, false),
                        BV::Shared(OpValue::Tuple(fs)) => (fs, true),
                        _ => return Err(internal("tuple gradient expected")),
                    };
                    for (f, v) in fields.into_iter().zip(vs) {
                        let g = match shared {
                            true => BV::Shared(OpValue::Tensor(f)),
                            false => BV::Batched(OpValue::Tensor(f)),
                        };
                        route(v, g, b, &inputs, &results, &mut in_adj, &mut node_adj)?;
                    }
                }
            }
        }
    }
    // Hand the inputs' gradients back: a shared input's sum to its parameter, rows to the
    // nodes (or parameters) each row read.
    for (i, g) in in_adj.into_iter().enumerate() {
        let (Some(g), Some(srcs)) = (g, sources.get(i)) else {
            continue;
        };
        match g {
            BV::Shared(OpValue::Tensor(g)) => match srcs.first() {
                Some(Source::Param(k)) => {
                    if let Some(slot) = grads.get_mut(*k) {
                        add_dense(slot, g).map_err(internal)?;
                    }
                }
                // One computed value every row read (`Dfg::stacked_inputs`): the rows' sum.
                Some(Source::Node(lr)) => adj.add(dfg, *lr, g)?,
                Some(Source::Const) | None => {}
            },
            BV::Batched(OpValue::Tensor(g)) => {
                let row_shape = g.shape().get(1..).unwrap_or_default();
                let len = row_shape.iter().product::<usize>();
                for (r, s) in srcs.iter().enumerate() {
                    match s {
                        Source::Const => {}
                        Source::Node(lr) => {
                            // A row's gradient goes straight into its producer's buffer.
                            let row = g.as_f32().and_then(|v| v.get(r * len..(r + 1) * len));
                            if !row.is_some_and(|v| adj.add_f32(dfg, *lr, v, row_shape)) {
                                adj.add(dfg, *lr, g.row(r).map_err(internal)?)?;
                            }
                        }
                        Source::Param(k) => {
                            if let Some(slot) = grads.get_mut(*k) {
                                add_dense(slot, g.row(r).map_err(internal)?).map_err(internal)?;
                            }
                        }
                    }
                }
            }
            _ => return Err(internal("input gradient is not a tensor")),
        }
    }
    Ok(())
}
