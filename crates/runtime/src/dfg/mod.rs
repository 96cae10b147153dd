//! The lazy backend: instance executors record block invocations as dataflow-graph nodes instead of
//! computing them; [`Dfg::flush`] evaluates all pending nodes in batched launches. This module
//! holds the graph and the recording (the `Backend` implementation, launch-grouping keys, shape
//! inference); `schedule` decides launches, `launch` runs them, `sums` keeps deferred sums.

use std::collections::BTreeMap;
use std::time::Instant;

use tumble_compile::ragged::RaggedInput;
use tumble_compile::{Block, OutputShape, Program};
use tumble_interp::reference::block_value;
use tumble_interp::{Backend, InstanceCtx, LazyRef, RunError, Value};
use tumble_ir::{Attrs, Span, Ty};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::{Rng, Tensor};

use crate::batched::{run_block_with, LaunchOps, BV};
use crate::kept::{run_block_kept, Kept};
use std::sync::Arc;

use crate::executable::Executable;
use crate::intern::Interner;
use crate::profile::Profile;
use crate::reuse::Reuse;
use crate::workers::Lending;
use crate::{Options, Scheduler};

/// A node in no class of identical invocations ([`Dfg::memo_class`]).
const NO_CLASS: u32 = u32::MAX;

mod for_backward;
pub(crate) use for_backward::{BackwardRecord, Twins};
mod launch;
mod nodes;
mod ragged;
mod release;
use release::released_error;
pub use release::RELEASE_SCAN_BYTES;
mod schedule;
mod sums;

/// A block argument as recorded.
#[derive(Clone)]
pub(crate) enum Arg {
    Lazy(LazyRef),
    Val(Tensor),
}

/// A computed output: where in `tensor` it lies.
#[derive(Clone)]
struct Slot {
    tensor: Tensor,
    at: At,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum At {
    /// The whole tensor.
    Whole,
    /// Row `r` of a launch's batched output.
    Row(u32),
    /// Rows `start..start + len` of a ragged launch's output (one instance's rows of all the
    /// instances' concatenated rows).
    Rows { start: u32, len: u32 },
}

/// Where a [`Slot::released`] output lies: rows no tensor has.
const RELEASED_AT: At = At::Rows {
    start: u32::MAX,
    len: 0,
};

/// A node's computed outputs, where they lie: almost every block has one, kept inline (no
/// allocation per recorded node, no pointer to follow when a launch reads it).
#[derive(Clone)]
enum Outs {
    One(Slot),
    Many(Box<[Slot]>),
}

impl Outs {
    fn from_vec(mut slots: Vec<Slot>) -> Outs {
        if slots.len() == 1 {
            if let Some(s) = slots.pop() {
                return Outs::One(s);
            }
        }
        Outs::Many(slots.into_boxed_slice())
    }

    fn get(&self, i: usize) -> Option<&Slot> {
        match self {
            Outs::One(s) => (i == 0).then_some(s),
            Outs::Many(v) => v.get(i),
        }
    }
}

impl Slot {
    fn value(&self) -> Result<Tensor, String> {
        if self.is_released() {
            return Err(release::released_error().message.clone());
        }
        match self.at {
            At::Whole => Ok(self.tensor.clone()),
            At::Row(r) => self.tensor.row(r as usize).map_err(|e| e.to_string()),
            At::Rows { start, len } => self
                .tensor
                .rows(start as usize, len as usize)
                .map_err(|e| e.to_string()),
        }
    }

    /// The slot as a job-memo entry: with `share`, the launch's output and the row where it is
    /// one (not a copy); else, and for a range of rows, a copy of the value.
    fn kept(&self, share: bool) -> Result<crate::memo::KeptResult, String> {
        let (tensor, row) = match (share, self.at) {
            (true, At::Whole) => (self.tensor.clone(), None),
            (true, At::Row(r)) => (self.tensor.clone(), Some(r)),
            _ => (self.value()?, None),
        };
        Ok(crate::memo::KeptResult { tensor, row })
    }

    /// [`Slot::value`]'s f32 elements and shape where they lie, without the copy (`None` for
    /// another dtype, and for a range of rows, whose shape is its own).
    fn f32_view(&self) -> Option<(&[f32], &[usize])> {
        let (data, shape) = (self.tensor.as_f32()?, self.tensor.shape());
        let inner = shape.get(1..).unwrap_or_default();
        let len: usize = inner.iter().product();
        match self.at {
            At::Whole => Some((data, shape)),
            At::Row(i) => Some((data.get(i as usize * len..(i as usize + 1) * len)?, inner)),
            At::Rows { .. } => None,
        }
    }

    /// What an output freed on its own takes the place of ([`Dfg::try_release`]): reading it is
    /// an error, as reading a released node's outputs is.
    fn released() -> Slot {
        Slot {
            tensor: Tensor::scalar_f32(0.0),
            at: RELEASED_AT,
        }
    }

    fn is_released(&self) -> bool {
        self.at == RELEASED_AT
    }

    /// Bytes freed when this slot goes: its tensor's, if the slot is the tensor's last holder.
    fn freed_bytes(&self) -> u64 {
        if self.tensor.holders() == 1 {
            (self.tensor.len() * self.tensor.dtype().size()) as u64
        } else {
            0
        }
    }

    /// The row of a batched output, if that is what it is.
    fn row(&self) -> Option<u32> {
        match self.at {
            At::Row(r) => Some(r),
            _ => None,
        }
    }
}

pub(crate) struct Node {
    pub(crate) block: u32,
    pub(crate) args: Vec<Arg>,
    depth: u32,
    /// Launch-grouping key: the block and its inputs' per-instance shapes.
    key: u64,
    /// Output shapes, shared with the shape cache (recording a node allocates no shapes).
    out_shapes: std::rc::Rc<Shapes>,
    out: Option<Outs>,
    pub(crate) span: Span,
    /// A deferred sum (sum fusion): never launched; `args` are its terms (none of them a deferred
    /// sum), added in order when a launch first reads it ([`Dfg::materialize_sums`]).
    sum: bool,
    /// The instance (index in the mini-batch) that recorded it, to name in errors.
    pub(crate) instance: u32,
    /// Grouped by its ragged key (see [`Dfg::ragged_key`]): launched with [`Dfg::launch_ragged`].
    ragged: bool,
    /// Early release's facts about it (see `release`).
    life: release::Life,
}

/// A block's output shapes for one shape key, shared by the nodes recorded with it (a deferred
/// sum's: its first term's, or a list shared by sums of its shape).
#[derive(Debug, Default)]
pub(crate) struct Shapes {
    outs: Vec<Vec<usize>>,
    /// The bytes every operator of one invocation produces, by the operators' relations on the
    /// key's input shapes — for blocks whose types have `?` sizes
    /// ([`Executable::dynamic_bytes`]), whose launches reserve memory from it (their static
    /// estimate counts `?` as 0); 0 for the others. Kept here so that a launch sums it over its
    /// invocations instead of running the relations again.
    op_bytes: usize,
}

impl Shapes {
    fn of(outs: Vec<Vec<usize>>) -> Self {
        Shapes { outs, op_bytes: 0 }
    }
}

impl std::ops::Deref for Shapes {
    type Target = Vec<Vec<usize>>;
    fn deref(&self) -> &Self::Target {
        &self.outs
    }
}

/// [`Shapes`] of a shape key and their bytes (f32 assumed; early release's scan trigger).
type CachedShapes = (std::rc::Rc<Shapes>, u64);

/// One invocation in this many has its recording timed (see [`Dfg::invocations`]).
const DFG_TIME_SAMPLE: u32 = 16;

/// The value of a tensor of at most one element as a key word (its dtype is in the key's shape
/// words' company: the block's input types fix it); `None` for larger tensors and dtypes not
/// listed.
fn scalar_bits(t: &Tensor) -> Option<u64> {
    use tumble_ir::DType;
    if t.len() > 1 {
        return None;
    }
    Some(match t.dtype() {
        DType::Float32 => u64::from(t.as_f32()?.first().copied().unwrap_or(0.0).to_bits()),
        DType::Int32 | DType::Int64 => t.to_i64_vec().first().copied().unwrap_or(0) as u64,
        DType::Bool => u64::from(*t.as_slice::<bool>()?.first().unwrap_or(&false)),
        _ => return None,
    })
}

/// The time since `t0` for a sampled invocation, scaled to the invocations it stands for.
fn sampled(t0: Option<Instant>) -> std::time::Duration {
    t0.map_or(std::time::Duration::ZERO, |t| t.elapsed() * DFG_TIME_SAMPLE)
}

/// A weight-slice block's results, and the time computing them took when this invocation did.
type Sliced = (Vec<Tensor>, Option<std::time::Duration>);

pub struct Dfg<'p> {
    /// The model weights among the instances' arguments (and the derived parameters), by buffer,
    /// held so that no other tensor takes their addresses: a launch groups invocations by the
    /// weight they chose only where it is one of these ([`Dfg::note_weights`]).
    model_weights: std::collections::HashMap<usize, Tensor>,
    weights_noted: bool,
    /// Recording for the backward: the value of each slice of model weights recorded so far,
    /// by [`Dfg::backward_slice_key`], with the weights it names.
    backward_slices: std::collections::HashMap<Vec<u64>, (Vec<Tensor>, Value)>,
    /// The nodes computing those slices: launches of their readers are keyed by them (a
    /// layer's launches read its own slice whole). Other computed values in shared inputs are
    /// not keyed: each instance's copy of a weight derived in `@main` is a node of its own.
    backward_slice_nodes: std::collections::HashSet<u32>,
    /// Computed values passed whole to launches that all read one of them ([`Dfg::whole_value`]),
    /// by reference: one tensor each, so products find it packed from the first launch on.
    whole_values: std::cell::RefCell<std::collections::HashMap<LazyRef, Tensor>>,
    /// Recording for the backward with kept values: pure operators of shared operands computed
    /// once for the graph ([`crate::kept::SharedMemo`]).
    shared_memo: crate::kept::SharedMemo,
    /// Invocations recorded so far: the recording's time is sampled every
    /// [`DFG_TIME_SAMPLE`]-th one (two clock reads per invocation cost ~2% of a small model).
    invocations: u32,
    program: &'p Program,
    reuse: &'p Reuse,
    opts: Options,
    nodes: nodes::NodeTable,
    pending: Vec<u32>,
    /// Pending nodes a flush of a few levels (`flush_levels`) did not reach, already sorted by
    /// depth for the next one (see [`schedule::Held`]).
    held: schedule::Held,
    /// Ids of (block, input shapes): the shape cache's index.
    shape_keys: Interner,
    /// Ids of (shape key, shared weights read): the launch-grouping key under code duplication.
    dup_keys: Interner,
    /// The words of the key being built (kept to reuse its allocation).
    key_words: Vec<u64>,
    /// Output shapes per shape-key id.
    shape_cache: Vec<Option<CachedShapes>>,
    /// Output-shape lists of deferred sums whose first term has several outputs (`sums`).
    sum_shape_lists: Vec<std::rc::Rc<Shapes>>,
    /// Draws for operators run inside launches (none are random: those run on the host).
    launch_rng: Rng,
    /// What the job computed once for the program: per-block facts and kernel plans.
    pub(crate) exec: Arc<Executable>,
    /// The instance whose invocation made the last failed launch fail (see [`Dfg::launch`]).
    pub failed_instance: Option<u32>,
    /// The instance whose stop ended the last flush between two launches (set with
    /// `failed_instance`): nothing was half done, and every node not computed is pending again
    /// (`schedule::Dfg::hold_unlaunched`), so the other instances can go on.
    pub stop_fired: Option<u32>,
    /// Instances whose work is stopped between launches once their deadline passes or their
    /// flag is set (see [`Dfg::set_stops`]).
    stops: Vec<(u32, tumble_interp::StopWhen)>,
    /// Threads lent by workers that have finished (a share is added to `opts.threads` at each
    /// launch).
    lent: Option<&'p Lending>,
    pub profile: Profile,
    /// Recording for the backward pass ([`Dfg::record_for_backward`]): the launches in order.
    launch_log: Option<Vec<Vec<u32>>>,
    /// Launches run operator by operator keeping every value, with this fast path
    /// ([`Dfg::record_for_backward`]).
    keep: Option<crate::kept::KeptMode>,
    /// Recording for the backward pass with sum fusion: `add`s of two computed tensors become
    /// deferred sums, whose adjoints the backward hands to their terms ([`Dfg::sum_terms`]).
    backward_sums: bool,
    /// Per logged launch: what it kept (`None` where it did not keep).
    kept: Vec<Option<Kept>>,
    /// Per node id, for invocations that took an identical one's results and the ones they
    /// took them from: that one (`NO_CLASS` elsewhere; empty until a launch had any). The
    /// backward reads it too: a node whose entry is another node is not in the launch log, and
    /// its adjoint is that node's.
    memo_class: Vec<u32>,
    /// Computed nodes no recorded node reads any more that a host value might still name when
    /// they were last looked at: released after a scan finds the host has let go.
    watch: Vec<u32>,
    /// The current claims epoch (see [`Node::claimed`]); a scan of the host's values starts a new
    /// one.
    epoch: u32,
    /// Output bytes recorded since the last scan: a scan is worth its cost only when enough could
    /// be freed (see `release`).
    bytes_since_scan: u64,
    /// Bytes of launch outputs not yet released (an upper bound within a flush: a buffer also
    /// held elsewhere is counted until its last node is released); its maximum is the
    /// profile's peak.
    live_bytes: u64,
    /// Every launch output buffer counted in `live_bytes`, with its bytes: after each flush the
    /// ones no tensor holds any more are crossed off and `live_bytes` is their sum, so a buffer
    /// the host held when its nodes were released (a loop's state, dropped at the next step)
    /// stops counting once it is gone (a 10-step fixed-point loop over 512 sets reported 597 MB
    /// of activations at 87 MB of RSS).
    /// Keyed by buffer: a buffer a launch passes on as its output (an input's rows zero-copy, a
    /// view) counts once.
    counted: crate::intern::WordMap<usize, (tumble_tensor::BufferWatch, u64)>,
    /// Buffers added to `counted` since its dead ones were last crossed off.
    counted_since_settle: usize,
}

/// An error of operator `node` (an index into `block`'s nodes) in an invocation at `site`:
/// located at that operator, with the calls it was inlined through, innermost first, and then
/// the invocation as the calls that led there — unless the invocation is the block's own extent
/// around the operator or around the outermost of those calls (an automatic block: no call of
/// its own to show). Without a located operator, at the invocation. Used for a failed launch
/// (`Dfg::launch_failure`) and for shapes that fail a relation when recorded.
pub(super) fn error_at_node(
    block: &Block,
    node: Option<usize>,
    site: Span,
    message: String,
) -> RunError {
    match node
        .and_then(|k| block.nodes.get(k))
        .filter(|n| n.span != Span::default() && n.span != site)
    {
        Some(n) => {
            let mut e = RunError::at(n.span, message);
            e.trace.extend(n.calls.iter().copied());
            let within = |s: &Span| s.src == site.src && site.lo <= s.lo && s.hi <= site.hi;
            if !within(e.trace.last().unwrap_or(&n.span)) {
                e.trace.push(site);
            }
            e.trace.truncate(tumble_interp::machine::MAX_TRACE);
            e
        }
        None => RunError::at(site, message),
    }
}

/// Output shapes of a block from its inputs' shapes, by its operators' relations (Nimble's shape
/// functions), so launches can be grouped before anything is computed.
fn infer_shapes(
    block: &Block,
    inputs: &[Vec<usize>],
    with_bytes: bool,
) -> Result<Shapes, (Option<usize>, String)> {
    let node_tys = node_types(block, inputs)?;
    let outs = block
        .outputs
        .iter()
        .map(|v| {
            let t = value_ty(block, inputs, &node_tys, v).map_err(|m| (None, m))?;
            t.as_tensor()
                .and_then(|(dims, _)| {
                    dims.iter()
                        .map(|d| d.known().map(|x| x as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| (None, "internal: output shape unknown".to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let op_bytes = match with_bytes {
        true => node_tys
            .iter()
            .map(tumble_ops::value_bytes)
            .fold(0, usize::saturating_add),
        false => 0,
    };
    Ok(Shapes { outs, op_bytes })
}

/// The type of block value `v` in one invocation on inputs of these shapes, given the types of
/// the nodes before it.
fn value_ty(
    block: &Block,
    inputs: &[Vec<usize>],
    node_tys: &[Ty],
    v: &tumble_compile::BVal,
) -> Result<Ty, String> {
    use tumble_compile::BVal;
    let to_ty = |s: &[usize], d| Ty::tensor_of(&s.iter().map(|&x| x as i64).collect::<Vec<_>>(), d);
    match v {
        BVal::Input(i) => {
            let shape = inputs.get(*i as usize).ok_or("internal: input")?;
            let dtype = block
                .inputs
                .get(*i as usize)
                .and_then(|x| x.ty.as_tensor().map(|(_, d)| d))
                .ok_or("internal: input type")?;
            Ok(to_ty(shape, dtype))
        }
        BVal::Node(n) => node_tys
            .get(*n as usize)
            .cloned()
            .ok_or_else(|| "internal: node".into()),
        BVal::Field(n, f) => match node_tys.get(*n as usize) {
            Some(Ty::Tuple(ts)) => ts
                .get(*f as usize)
                .cloned()
                .ok_or_else(|| "internal: field".into()),
            _ => Err("internal: field of a non-tuple".into()),
        },
        BVal::Const(t) => Ok(to_ty(t.shape(), t.dtype())),
    }
}

/// Each operator's type in one invocation of `block` on inputs of these shapes, by the
/// operators' relations (on failure, the failing operator's index where there is one).
fn node_types(block: &Block, inputs: &[Vec<usize>]) -> Result<Vec<Ty>, (Option<usize>, String)> {
    let mut node_tys: Vec<Ty> = Vec::with_capacity(block.nodes.len());
    let ty_of = |v: &tumble_compile::BVal, node_tys: &[Ty]| value_ty(block, inputs, node_tys, v);
    for (k, node) in block.nodes.iter().enumerate() {
        let args = node
            .args
            .iter()
            .map(|a| match a {
                tumble_compile::BArg::One(v) => ty_of(v, &node_tys),
                tumble_compile::BArg::Tuple(vs) => vs
                    .iter()
                    .map(|v| ty_of(v, &node_tys))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Ty::Tuple),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| (None, m))?;
        let t = (node.op.relation)(&args, &node.attrs).map_err(|e| (Some(k), e.message))?;
        node_tys.push(t);
    }
    Ok(node_tys)
}

/// `TUMBLE_NO_FAST_HOST_SCALARS=1`: host scalar blocks through the reference kernels only (the
/// A/B switch of [`crate::host_scalars`]).
fn fast_host_scalars() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_HOST_SCALARS")
}

impl<'p> Dfg<'p> {
    pub fn new(
        program: &'p Program,
        reuse: &'p Reuse,
        exec: Arc<Executable>,
        opts: Options,
    ) -> Self {
        Dfg {
            model_weights: Default::default(),
            backward_slices: Default::default(),
            backward_slice_nodes: Default::default(),
            whole_values: Default::default(),
            shared_memo: Default::default(),
            weights_noted: false,
            program,
            reuse,
            opts,
            nodes: nodes::NodeTable::default(),
            pending: Vec::new(),
            held: schedule::Held::default(),
            shape_keys: Interner::default(),
            dup_keys: Interner::default(),
            key_words: Vec::new(),
            invocations: 0,
            shape_cache: Vec::new(),
            sum_shape_lists: Vec::new(),
            launch_rng: Rng::new(0),
            exec,
            lent: None,
            failed_instance: None,
            stop_fired: None,
            stops: Vec::new(),
            profile: Profile::default(),
            launch_log: None,
            keep: None,
            backward_sums: false,
            kept: Vec::new(),
            memo_class: Vec::new(),
            watch: Vec::new(),
            epoch: 1,
            bytes_since_scan: 0,
            live_bytes: 0,
            counted_since_settle: 0,
            counted: Default::default(),
        }
    }

    pub(crate) fn program(&self) -> &'p Program {
        self.program
    }

    /// Learns the model weights from an instance's entry arguments `args` and the derived
    /// parameters `derived` (the same tensors for every instance of a job): those the reuse
    /// analysis knows to be bound to weights ([`Reuse::param_is_weight`]). Launches group
    /// invocations by a weight chosen per instance only when it is one of them, and key
    /// identical invocations by their identity.
    pub(crate) fn note_weights(&mut self, args: &[Value], derived: &[Value]) {
        // Once per graph: every instance of a job passes the same weights (a session calls
        // this per instance it admits).
        if self.weights_noted {
            return;
        }
        self.weights_noted = true;
        let weights = args.iter().chain(derived).zip(&self.reuse.param_is_weight);
        for (v, _) in weights.filter(|(_, &w)| w) {
            if let Value::Tensor(t) = v {
                self.exec.weights.note_weight(t);
                self.model_weights
                    .entry(t.buffer_id())
                    .or_insert_with(|| t.clone());
            }
        }
    }

    /// A weight-slice block's results for inputs `recorded` — model weights and host indices of
    /// one element, or (an indexed slice) a model weight and the host integers its index is
    /// computed from — from the job's cache ([`crate::weight_slices`]), each a model weight of
    /// this graph, with the time it took to compute them when this invocation did; `None` when
    /// the inputs are not of that kind (one computed, not a host value) or the job keeps no more
    /// slices.
    fn weight_slice(
        &mut self,
        block_id: u32,
        block: &Block,
        recorded: &[Arg],
        span: Span,
        ctx: &mut InstanceCtx,
    ) -> Result<Option<Sliced>, RunError> {
        use crate::weight_slices::{fast_slice, SliceBlock, SliceInput};
        let exec = Arc::clone(&self.exec);
        let Some(kind) = exec
            .weight_slice_blocks
            .get(block_id as usize)
            .and_then(Option::as_ref)
        else {
            return Ok(None);
        };
        // The invocation's arguments where they lie: copied (reference counts) only by an
        // invocation that computes its slice, once per weight and index for the job.
        let Some(inputs) = host_args(recorded) else {
            return Ok(None);
        };
        let owned = || inputs.iter().map(|&t| t.clone()).collect::<Vec<Tensor>>();
        let mut took = None;
        let slices = match kind {
            SliceBlock::Shared => {
                let Some(keys) = self.slice_inputs(block, recorded) else {
                    return Ok(None);
                };
                exec.weight_slices.get_or_compute(block_id, &keys, || {
                    let t0 = Instant::now();
                    let inputs = owned();
                    let outs = match fast_slice(block, &inputs) {
                        Some(outs) => outs,
                        None => block.eval(&inputs, &mut OpCtx { rng: &mut ctx.rng })?,
                    };
                    took = Some(t0.elapsed());
                    Ok(outs)
                })
            }
            SliceBlock::Indexed { weight, index } => {
                let Some((table, row)) =
                    self.indexed_slice_row(block, &inputs, *weight, index, span, ctx)?
                else {
                    return Ok(None);
                };
                let keys = [SliceInput::Weight(table), SliceInput::Index(row)];
                exec.weight_slices.get_or_compute(block_id, &keys, || {
                    let t0 = Instant::now();
                    // The row as an index of the take's own shape, `()` or `(1)`.
                    let ids = match block.val_ty(index).as_tensor().map(|(d, _)| d.len()) {
                        Some(0) => Tensor::scalar_i64(row),
                        _ => Tensor::from_vec(vec![1], vec![row]).map_err(|e| e.to_string())?,
                    };
                    let outs = match crate::fastops::take_rows_f32(table, &ids) {
                        Some(t) => vec![t],
                        None => block.eval(&owned(), &mut OpCtx { rng: &mut ctx.rng })?,
                    };
                    took = Some(t0.elapsed());
                    Ok(outs)
                })
            }
        }
        .map_err(|m| RunError::at(span, m))?;
        let Some(slices) = slices else {
            return Ok(None);
        };
        for t in &slices {
            self.exec.weights.note_weight(t);
            self.model_weights
                .entry(t.buffer_id())
                .or_insert_with(|| t.clone());
        }
        Ok(Some((slices, took)))
    }

    /// An indexed slice block's weight and the row it takes for `inputs`, the invocation's
    /// arguments: the index computed on the host from its integers (the take, the block's last
    /// node, left out), clipped to the weight's rows; `None` when the weight is not a model
    /// weight or the index not one integer.
    fn indexed_slice_row<'t>(
        &self,
        block: &Block,
        inputs: &[&'t Tensor],
        weight: u32,
        index: &tumble_compile::BVal,
        span: Span,
        ctx: &mut InstanceCtx,
    ) -> Result<Option<(&'t Tensor, i64)>, RunError> {
        let Some(&table) = inputs
            .get(weight as usize)
            .filter(|t| self.is_model_weight(t))
        else {
            return Ok(None);
        };
        let last = block.nodes.len().saturating_sub(1);
        let i = match crate::host_scalars::integer(block, inputs, last, index) {
            Some(i) => i,
            None => {
                let owned: Vec<Tensor> = inputs.iter().map(|&t| t.clone()).collect();
                let mut octx = OpCtx { rng: &mut ctx.rng };
                let index = block
                    .eval_values(&owned, last, std::slice::from_ref(index), &mut octx)
                    .map_err(|m| RunError::at(span, m))?;
                match index.first().map(Tensor::to_i64_vec).as_deref() {
                    Some([i]) => *i,
                    _ => return Ok(None),
                }
            }
        };
        let rows = table.shape().first().copied().unwrap_or(0);
        Ok(Some((table, crate::weight_slices::clipped_row(i, rows))))
    }

    /// The key of a slice block's invocation while recording for the backward: the block, its
    /// weights by buffer (returned too, held so no other tensor takes their addresses) and its
    /// integer indices by value; `None` unless every input is one of those and one is a weight.
    fn backward_slice_key(
        &self,
        block_id: u32,
        block: &Block,
        recorded: &[Arg],
    ) -> Option<SliceKey> {
        use crate::weight_slices::SliceInput;
        let mut key = vec![u64::from(block_id)];
        let mut sources = Vec::new();
        for input in self.slice_inputs(block, recorded)? {
            match input {
                SliceInput::Weight(t) => {
                    key.push(t.buffer_id() as u64);
                    sources.push(t.clone());
                }
                SliceInput::Index(i) => key.push(i as u64),
            }
        }
        Some((key, sources))
    }

    /// A slice block's inputs `recorded` as the slices' key: model weights by identity, integer
    /// indices of one element by the row they take (clipped); `None` unless every input is one
    /// of those and one is a weight.
    fn slice_inputs<'a>(
        &self,
        block: &Block,
        recorded: &'a [Arg],
    ) -> Option<Vec<crate::weight_slices::SliceInput<'a>>> {
        use crate::weight_slices::{row_taken, SliceInput};
        let rows = match recorded.first() {
            Some(Arg::Val(table)) => table.shape().first().copied().unwrap_or(0),
            _ => 0,
        };
        let mut keys = Vec::with_capacity(recorded.len());
        for a in recorded {
            let Arg::Val(t) = a else { return None };
            if self.is_model_weight(t) {
                keys.push(SliceInput::Weight(t));
            } else if t.len() == 1 && t.dtype().is_int() {
                let i = t.to_i64_vec().first().copied().unwrap_or(0);
                keys.push(SliceInput::Index(row_taken(block, i, rows)));
            } else {
                return None;
            }
        }
        keys.iter()
            .any(|k| matches!(k, SliceInput::Weight(_)))
            .then_some(keys)
    }

    /// The value of `r` as one tensor, the same one every time it is asked for (a row of an
    /// earlier launch is copied out once): a computed value every invocation of a launch reads
    /// (a slice of weights recorded once for the backward) is passed whole, and a product that
    /// takes it as its weight packs it once, not once per launch (a fresh copy per launch was a
    /// new weight to pack and keep each time: 5.4 GiB for a stacked LSTM's gradient).
    pub(super) fn whole_value(&self, r: LazyRef) -> Result<Tensor, RunError> {
        if let Some(t) = self.whole_values.borrow().get(&r) {
            return Ok(t.clone());
        }
        let t = self.slot(&r)?.value().map_err(RunError::new)?;
        self.whole_values.borrow_mut().insert(r, t.clone());
        Ok(t)
    }

    /// Whether `t` is one of the model weights [`Dfg::note_weights`] learned.
    pub(super) fn is_model_weight(&self, t: &Tensor) -> bool {
        self.model_weights
            .get(&t.buffer_id())
            .is_some_and(|w| w.same_tensor(t))
    }

    pub(crate) fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.get(id as usize)
    }

    /// Launches from now on also use a share of the threads in `lent`, which other workers add to
    /// when they run out of mini-batches.
    pub(crate) fn lend_threads(&mut self, lent: Option<&'p Lending>) {
        self.lent = lent;
    }

    fn block(&self, b: u32) -> Result<&'p Block, RunError> {
        self.program
            .blocks
            .get(b as usize)
            .ok_or_else(|| RunError::new(format!("internal: no block {b}")))
    }

    fn arg_shape<'s>(&'s self, a: &'s Arg) -> Result<&'s [usize], RunError> {
        match a {
            Arg::Val(t) => Ok(t.shape()),
            Arg::Lazy(r) => self
                .nodes
                .get(r.node as usize)
                .and_then(|n| n.out_shapes.get(r.output as usize))
                .map(Vec::as_slice)
                .ok_or_else(|| RunError::new("internal: unknown lazy value")),
        }
    }

    fn arg_depth(&self, a: &Arg) -> u32 {
        match a {
            Arg::Val(_) => 0,
            // Computed (in an earlier flush): as available as a value.
            Arg::Lazy(r) => self.nodes.get(r.node as usize).map_or(0, |n| {
                if n.out.is_some() {
                    0
                } else {
                    n.depth + 1
                }
            }),
        }
    }

    /// [`Dfg::concrete`] where that copies nothing: a computed whole tensor, a computed row of at
    /// most one element, or a deferred sum of computed terms (added up here). `None` for an
    /// uncomputed value and for a computed row of a batch (a copy the launch that reads it does
    /// not need).
    fn cheap_concrete(&self, r: LazyRef) -> Result<Option<Tensor>, RunError> {
        let node = self
            .nodes
            .get(r.node as usize)
            .ok_or_else(|| RunError::new("internal: unknown lazy value"))?;
        match &node.out {
            Some(slots) => {
                let slot = slots
                    .get(r.output as usize)
                    .ok_or_else(|| RunError::new("internal: unknown output"))?;
                let row_len = |t: &Tensor| t.shape().get(1..).map_or(0, |d| d.iter().product());
                let len = match slot.at {
                    At::Whole => 0,
                    At::Row(_) => row_len(&slot.tensor),
                    At::Rows { len, .. } => (len as usize).saturating_mul(row_len(&slot.tensor)),
                };
                if len <= 1 {
                    slot.value().map(Some).map_err(RunError::new)
                } else {
                    Ok(None)
                }
            }
            None => self.concrete(r),
        }
    }

    /// The tensor behind a value, if it is computed.
    pub fn concrete(&self, r: LazyRef) -> Result<Option<Tensor>, RunError> {
        let node = self
            .nodes
            .get(r.node as usize)
            .ok_or_else(|| RunError::new("internal: unknown lazy value"))?;
        match &node.out {
            None if node.life.released => Err(released_error()),
            None if node.sum => self.sum_on_host(node),
            None => Ok(None),
            Some(slots) => slots
                .get(r.output as usize)
                .ok_or_else(|| RunError::new("internal: unknown output"))?
                .value()
                .map(Some)
                .map_err(RunError::new),
        }
    }

    /// The f32 elements and shape of a computed value, where it lies (no copy): `None` for a
    /// value not computed, a deferred sum, or another dtype. The backward stacks a launch's
    /// inputs from these instead of copying each row out first.
    pub(crate) fn f32_view(&self, r: LazyRef) -> Option<(&[f32], &[usize])> {
        self.nodes
            .get(r.node as usize)?
            .out
            .as_ref()?
            .get(r.output as usize)?
            .f32_view()
    }

    /// The id of the next node. When the node table is full, its growth (a new segment) is
    /// checked against the memory budget before it happens; `pending` is the recording instance's pending evaluations, for the message.
    fn reserve_node(&mut self, pending: usize) -> Result<u32, RunError> {
        if self.nodes.len() == self.nodes.capacity() {
            if let Err(stop) = tumble_limits::reserve(nodes::SEGMENT_BYTES) {
                let held = vec![
                    format!(
                        "{} pending evaluations in this instance",
                        tumble_limits::count_text(pending)
                    ),
                    self.growth(),
                ];
                return Err(tumble_interp::machine::limit_error(
                    stop,
                    held,
                    tumble_interp::machine::runaway_hint(pending),
                ));
            }
        }
        Ok(self.nodes.len() as u32)
    }

    /// The lazy value of node `node` of `block`: its outputs, one or a tuple.
    fn lazy_value(&self, block: &Block, node: u32) -> Value {
        let n = block.outputs.len() as u32;
        match (block.output_shape, n) {
            (OutputShape::Single, 1) => Value::Lazy(LazyRef { node, output: 0 }),
            _ => Value::tuple(
                (0..n)
                    .map(|output| Value::Lazy(LazyRef { node, output }))
                    .collect::<tumble_interp::Fields>(),
            ),
        }
    }

    /// The argument is computed, or is a deferred sum of computed terms.
    fn arg_ready(&self, a: &Arg) -> bool {
        match a {
            Arg::Val(_) => true,
            Arg::Lazy(r) => self.lazy_ready(*r),
        }
    }

    /// The value is computed, or is a deferred sum whose terms are (its terms are never sums
    /// themselves, so this recurses once).
    fn lazy_ready(&self, r: LazyRef) -> bool {
        self.nodes
            .get(r.node as usize)
            .is_some_and(|m| m.out.is_some() || (m.sum && m.args.iter().all(|t| self.arg_ready(t))))
    }

    /// The recorded nodes an argument waits for: itself, or a deferred sum's terms.
    fn arg_deps(&self, a: &Arg, out: &mut Vec<u32>) {
        if let Arg::Lazy(r) = a {
            match self.nodes.get(r.node as usize) {
                Some(m) if m.sum && m.out.is_none() => {
                    for t in &m.args {
                        if let Arg::Lazy(q) = t {
                            out.push(q.node);
                        }
                    }
                }
                _ => out.push(r.node),
            }
        }
    }

    /// The launch-grouping key of an invocation of a ragged block (see
    /// [`tumble_compile::ragged`]) whatever its length: the block, the shapes of its row inputs
    /// but for their leading dim, and the other inputs' shapes and tensors (which the ragged
    /// launch passes once). `None` when the invocation cannot join a ragged launch: no ragged
    /// form, row inputs of different or zero lengths, or another input not a known tensor.
    fn ragged_key(&mut self, block_id: u32, args: &[Arg]) -> Result<Option<u64>, RunError> {
        let Some(Some(ragged)) = self.exec.ragged.get(block_id as usize) else {
            return Ok(None);
        };
        let mut words = std::mem::take(&mut self.key_words);
        words.clear();
        let joins = self.ragged_words(block_id, args, ragged, &mut words);
        // In the interner the exact keys of this run come from, so the two never share an id.
        let id = match joins {
            Ok(true) if self.opts.dup => Some(self.dup_keys.id(&words)),
            Ok(true) => Some(self.shape_keys.id(&words)),
            _ => None,
        };
        self.key_words = words;
        joins.map(|_| id.map(u64::from))
    }

    /// The words of [`Dfg::ragged_key`] into `words`; false when the invocation cannot join a
    /// ragged launch.
    fn ragged_words(
        &self,
        block_id: u32,
        args: &[Arg],
        ragged: &crate::executable::RaggedRun,
        words: &mut Vec<u64>,
    ) -> Result<bool, RunError> {
        // Above every block id, so that no exact key's words equal these.
        words.push(u64::MAX);
        words.push(u64::from(block_id));
        let mut len = None;
        for (i, (a, kind)) in args.iter().zip(&ragged.inputs).enumerate() {
            let shape = self.arg_shape(a)?;
            words.push(shape.len() as u64);
            match kind {
                RaggedInput::Rows => {
                    let Some((&l, rest)) = shape.split_first() else {
                        return Ok(false);
                    };
                    let free = ragged.free_length.get(i) == Some(&true);
                    if !free && (l == 0 || len.is_some_and(|m| m != l)) {
                        return Ok(false);
                    }
                    if !free {
                        len = Some(l);
                    }
                    words.extend(rest.iter().map(|&d| d as u64));
                }
                RaggedInput::PerInstance => words.extend(shape.iter().map(|&d| d as u64)),
                RaggedInput::Shared => {
                    let Arg::Val(t) = a else {
                        return Ok(false);
                    };
                    words.extend(shape.iter().map(|&d| d as u64));
                    // A scalar is keyed by its value: a counter computed on the host (from
                    // literals, so shared) is a fresh tensor in every instance, and keyed by
                    // its buffer every invocation would launch alone.
                    match scalar_bits(t) {
                        Some(bits) => {
                            words.push(u64::MAX);
                            words.push(bits);
                        }
                        None => words.push(t.buffer_id() as u64),
                    }
                }
            }
        }
        Ok(true)
    }

    fn slot(&self, r: &LazyRef) -> Result<&Slot, RunError> {
        let node = self.nodes.get(r.node as usize);
        if node.is_some_and(|n| n.life.released) {
            return Err(released_error());
        }
        node.and_then(|n| n.out.as_ref())
            .and_then(|o| o.get(r.output as usize))
            .ok_or_else(|| RunError::new("internal: input not computed"))
    }
}

impl Backend for Dfg<'_> {
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        // Operators outside blocks are the impure ones (random draws, intrinsics): they run on the
        // host, in the instance's program order, from its own random stream. The machine calls
        // them only once `op_args_ready` holds, so lazy arguments are computed by now.
        // A lazy argument, or lazy field of a tuple argument, becomes its computed tensor; the
        // value then converts like any other.
        let computed = |dfg: &Self, v: Value| -> Result<Value, RunError> {
            match v {
                Value::Lazy(r) => dfg.concrete(r)?.map(Value::Tensor).ok_or_else(|| {
                    RunError::at(
                        span,
                        format!(
                            "{}: input is not computed yet (operator outside a block)",
                            op.name
                        ),
                    )
                }),
                other => Ok(other),
            }
        };
        let mut plain = Vec::with_capacity(args.len());
        for a in args {
            let a = match a {
                Value::Tuple(t) if t.0.iter().any(|f| matches!(f, Value::Lazy(_))) => Value::tuple(
                    t.0.iter()
                        .map(|f| computed(self, f.clone()))
                        .collect::<Result<Vec<_>, _>>()?,
                ),
                other => computed(self, other)?,
            };
            plain.push(
                tumble_interp::machine::to_op_value(a)
                    .map_err(|m| RunError::at(span, format!("{}: {m}", op.name)))?,
            );
        }
        let mut octx = OpCtx { rng: &mut ctx.rng };
        let out = tumble_ops::eval(op, &plain, attrs, &mut octx)
            .map_err(|e| RunError::at(span, e.message))?;
        Ok(tumble_interp::machine::from_op_value(out))
    }

    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block_id: u32,
        site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        self.invocations = self.invocations.wrapping_add(1);
        let t0 = (self.invocations % DFG_TIME_SAMPLE == 0).then(Instant::now);
        let block = self.block(block_id)?;
        let mut recorded = Vec::with_capacity(args.len());
        for a in args.drain(..) {
            recorded.push(match a {
                Value::Tensor(t) => Arg::Val(t),
                Value::Lazy(r) if self.launch_log.is_some() => Arg::Lazy(r),
                Value::Lazy(r) => match self.cheap_concrete(r)? {
                    // Computed values are passed as values where that copies nothing, or they
                    // are scalars (host-side work can use them); a computed row of a batch stays
                    // a reference, which the launch reads in place.
                    Some(t) => Arg::Val(t),
                    None => Arg::Lazy(r),
                },
                other => {
                    return Err(RunError::at(
                        span,
                        format!(
                            "block {}: expected a tensor input, found {}",
                            block.name,
                            other.kind()
                        ),
                    ))
                }
            });
        }
        // Small work on known values runs on the host at once (ACROBAT lowers scalar arithmetic to
        // native code), keeping counters and conditions out of the graph.
        let for_backward = self.launch_log.is_some();
        // (Recording for the backward, only blocks of integer and boolean results: a float
        // must stay on the graph for its adjoint, a counter or a condition has none.)
        if self.opts.host_scalars
            && (!for_backward || self.exec.integral_blocks.get(block_id as usize) == Some(&true))
            && self.opts.scheduler != Scheduler::Eager
            && recorded.iter().enumerate().all(|(i, a)| match a {
                Arg::Val(t) => {
                    crate::host_scalars::host_input(t)
                        || self
                            .exec
                            .shape_only_inputs
                            .get(block_id as usize)
                            .and_then(|v| v.get(i))
                            == Some(&true)
                }
                Arg::Lazy(_) => false,
            })
            && self.exec.scalar_blocks.get(block_id as usize) == Some(&true)
        {
            let inputs: smallvec::SmallVec<[Tensor; 4]> = recorded
                .into_iter()
                .filter_map(|a| match a {
                    Arg::Val(t) => Some(t),
                    Arg::Lazy(_) => None,
                })
                .collect();
            let fast = match fast_host_scalars() {
                true => crate::host_scalars::eval(block, &inputs),
                false => None,
            };
            let value = match fast {
                Some(mut outs) if outs.len() == 1 && block.output_shape == OutputShape::Single => {
                    Value::Tensor(outs.swap_remove(0))
                }
                Some(outs) => block_value(block, outs.into_vec()),
                None => {
                    let mut octx = OpCtx { rng: &mut ctx.rng };
                    let outs = block
                        .eval(&inputs, &mut octx)
                        .map_err(|m| RunError::at(span, m))?;
                    block_value(block, outs)
                }
            };
            self.profile.host_invocations += 1;
            self.profile.time_dfg += sampled(t0);
            return Ok(value);
        }
        // Recording for the backward, a slice of model weights (a stacked model's layer
        // `take(%Ws, %l)`) is one node per weight and index for the mini-batch, read by every
        // later invocation: its adjoint is added up from all its readers, where a node per
        // invocation kept a copy of the slice each (a 3-layer LSTM's gradient ran out of memory
        // at 29 instances).
        let slice_kind = self
            .exec
            .weight_slice_blocks
            .get(block_id as usize)
            .and_then(Option::as_ref);
        let backward_slice = match (for_backward, slice_kind) {
            (true, Some(crate::weight_slices::SliceBlock::Shared)) => {
                self.backward_slice_key(block_id, block, &recorded)
            }
            _ => None,
        };
        if let Some((key, _)) = &backward_slice {
            if let Some((_, v)) = self.backward_slices.get(key) {
                self.profile.time_dfg += sampled(t0);
                return Ok(v.clone());
            }
        }
        // (Under the eager scheduler too: a slice taken on the host once is what an eager
        // framework's view of `W[l]` is; copied per invocation, every copy was packed anew.)
        if !for_backward && slice_kind.is_some() {
            if let Some((outs, computed)) =
                self.weight_slice(block_id, block, &recorded, span, ctx)?
            {
                self.profile.host_invocations += 1;
                // The one invocation that computes a slice, timed as itself: scaled as a
                // sample of the cheap ones it would count many times over.
                self.profile.time_dfg += computed.unwrap_or_else(|| sampled(t0));
                return Ok(block_value(block, outs));
            }
        }
        if self.records_sums()
            && self.opts.scheduler != Scheduler::Eager
            && self.exec.sum_blocks.get(block_id as usize) == Some(&true)
        {
            if let Some(v) = self.try_sum(block_id, &recorded, span, ctx)? {
                self.profile.time_dfg += sampled(t0);
                return Ok(v);
            }
        }
        // Exact keys (see `intern`): block and input shapes, rank first so that shapes of
        // different ranks cannot run together.
        let mut words = std::mem::take(&mut self.key_words);
        words.clear();
        words.push(u64::from(block_id));
        for a in &recorded {
            let shape = self.arg_shape(a)?;
            words.push(shape.len() as u64);
            words.extend(shape.iter().map(|&d| d as u64));
        }
        let shape_key = self.shape_keys.id(&words);
        self.key_words = words;
        // A ragged block's invocations are grouped by their ragged key (no exact key needed).
        let ragged_key = match for_backward || self.opts.scheduler == Scheduler::Eager {
            true => None,
            false => self.ragged_key(block_id, &recorded)?,
        };
        let ragged = ragged_key.is_some();
        let key = match ragged_key {
            Some(k) => k,
            // Dynamic code duplication (ACROBAT §5.1): invocations passing different weights to
            // the same block (BiRNN's forward and backward `@rnn`) launch separately, each with
            // its weights shared, instead of together with the weights gathered per invocation.
            None if self.opts.dup => {
                let mut words = std::mem::take(&mut self.key_words);
                words.clear();
                words.push(u64::from(shape_key));
                for (i, a) in recorded.iter().enumerate() {
                    let shared = !matches!(
                        self.reuse
                            .inputs
                            .get(block_id as usize)
                            .and_then(|v| v.get(i)),
                        Some(crate::reuse::InputReuse::PerInstance) | None
                    );
                    match a {
                        // Scalars are not weights: a counter or threshold computed on the host
                        // per instance (from literals, so "shared per call site") is a fresh
                        // tensor each time, and keying by it would launch every instance alone.
                        Arg::Val(t) if shared && t.len() > 1 => {
                            words.push(i as u64);
                            words.push(t.buffer_id() as u64);
                        }
                        // A computed value in a shared input (a slice of weights recorded once
                        // for the backward: each layer's own), by the node computing it.
                        // Recording for the backward, a slice of weights recorded once in a
                        // shared input (each layer's own), by the node computing it.
                        Arg::Lazy(r) if shared && self.backward_slice_nodes.contains(&r.node) => {
                            words.push(i as u64 | 1 << 32);
                            words.push(u64::from(r.node) << 32 | u64::from(r.output));
                        }
                        _ => {}
                    }
                }
                let id = self.dup_keys.id(&words);
                self.key_words = words;
                u64::from(id)
            }
            None => u64::from(shape_key),
        };
        let cached = self
            .shape_cache
            .get(shape_key as usize)
            .and_then(Option::clone);
        let (out_shapes, out_bytes) = match cached {
            Some(s) => s,
            None => {
                let shapes = recorded
                    .iter()
                    .map(|a| self.arg_shape(a).map(<[usize]>::to_vec))
                    .collect::<Result<Vec<_>, _>>()?;
                // Sizes contradicting the block's declared ones, checked once per shape key
                // (a key that fails is never cached, so every invocation with it fails too).
                for (input, shape) in block.inputs.iter().zip(&shapes) {
                    if let Some(m) = input.undeclared_shape(&input.ty, shape) {
                        return Err(RunError::at(span, format!("block {}: {m}", block.name)));
                    }
                }
                let dynamic = self.exec.dynamic_bytes.get(block_id as usize) == Some(&true);
                let s = std::rc::Rc::new(
                    infer_shapes(block, &shapes, dynamic)
                        .map_err(|(k, m)| error_at_node(block, k, span, m))?,
                );
                let bytes = release::output_bytes(&s);
                let entry = (s, bytes);
                let i = shape_key as usize;
                if self.shape_cache.len() <= i {
                    self.shape_cache.resize(i + 1, None);
                }
                self.shape_cache[i] = Some(entry.clone());
                entry
            }
        };
        let dataflow = recorded
            .iter()
            .map(|a| self.arg_depth(a))
            .max()
            .unwrap_or(0);
        let statically_hoisted = self
            .program
            .sites
            .get(site as usize)
            .is_some_and(|s| s.hoisted);
        let depth = match self.opts.scheduler {
            // The taint analysis found it independent of recursive state (static hoisting): its
            // dataflow depth, without moving the instance's own depth counter.
            // (Above the instance's floor: the level a running session had reached when it
            // joined, so that it launches with the others instead of ahead of them.)
            Scheduler::Inline if self.opts.hoist && statically_hoisted => dataflow.max(ctx.floor),
            // Nothing it reads is pending: it can run at depth 0 with every other such invocation
            // (dynamic hoisting).
            Scheduler::Inline if self.opts.hoist && dataflow == 0 => ctx.floor,
            Scheduler::Inline => {
                let d = ctx.depth.max(dataflow);
                ctx.depth = d + 1;
                d
            }
            _ => dataflow.max(ctx.floor),
        };
        // Outputs that are inputs passed through (a block split at a weight take returns the
        // slice it was given) are the values passed, not copies: a model weight stays one, and
        // the products reading it group by it.
        let passes = self.exec.passes_inputs.get(block_id as usize) == Some(&true);
        let passed: Vec<Option<Value>> = match passes && !for_backward {
            false => Vec::new(),
            true => block
                .outputs
                .iter()
                .map(|o| match o {
                    tumble_compile::BVal::Input(j) => recorded.get(*j as usize).map(|a| match a {
                        Arg::Val(t) => Value::Tensor(t.clone()),
                        Arg::Lazy(r) => Value::Lazy(*r),
                    }),
                    _ => None,
                })
                .collect(),
        };
        let id = self.reserve_node(ctx.pending)?;
        let life = self.recorded(&recorded, out_bytes);
        self.nodes.push(Node {
            block: block_id,
            args: recorded,
            depth,
            key,
            out_shapes,
            out: None,
            span,
            sum: false,
            instance: ctx.instance,
            ragged,
            life,
        });
        self.profile.nodes += 1;
        self.profile.time_dfg += sampled(t0);
        let value = passed_through(self.lazy_value(block, id), passed);
        if let Some((key, sources)) = backward_slice {
            self.backward_slices.insert(key, (sources, value.clone()));
            self.backward_slice_nodes.insert(id);
        }
        if self.opts.scheduler == Scheduler::Eager {
            // No batching: every invocation is its own launch, at once.
            self.launch(block_id, &[id])?;
        } else {
            self.pending.push(id);
        }
        Ok(value)
    }

    fn ghost(&mut self, ctx: &mut InstanceCtx, n: u32) {
        if self.opts.ghosts && self.opts.scheduler == Scheduler::Inline {
            ctx.depth += n;
        }
    }

    fn op_args_ready(&mut self, args: &[Value]) -> Result<bool, RunError> {
        // Every argument, and every field of a tuple argument, that is lazy is computed (checked
        // without computing it: a deferred sum is added up once, by `call_op`).
        let ready = |v: &Value| match v {
            Value::Lazy(r) => self.lazy_ready(*r),
            _ => true,
        };
        Ok(args.iter().all(|a| match a {
            Value::Tuple(t) => t.0.iter().all(ready),
            other => ready(other),
        }))
    }

    fn growth(&self) -> String {
        format!(
            "{} dataflow nodes recorded ({} not yet run)",
            tumble_limits::count_text(self.nodes.len()),
            tumble_limits::count_text(self.pending.len() + self.held.len())
        )
    }

    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError> {
        let t = match v {
            Value::Tensor(t) => Some(t.clone()),
            Value::Lazy(r) => self.concrete(*r)?,
            _ => return Err(RunError::new("`if` condition is not a bool scalar")),
        };
        match t {
            None => Ok(None),
            Some(t) => t
                .scalar_as_bool()
                .map(Some)
                .map_err(|e| RunError::new(format!("`if` condition: {e}"))),
        }
    }
}

/// `value` (a block's lazy outputs) with the outputs `passed` names replaced by the values the
/// block was given for them.
fn passed_through(value: Value, passed: Vec<Option<Value>>) -> Value {
    if passed.iter().all(Option::is_none) {
        return value;
    }
    match value {
        Value::Tuple(fields) => Value::tuple(
            fields
                .0
                .iter()
                .zip(passed.into_iter().chain(std::iter::repeat(None)))
                .map(|(v, p)| p.unwrap_or_else(|| v.clone()))
                .collect::<tumble_interp::Fields>(),
        ),
        single => passed.into_iter().next().flatten().unwrap_or(single),
    }
}

/// An invocation's arguments where they lie when the host holds every one (`None`: one is
/// computed).
fn host_args(recorded: &[Arg]) -> Option<smallvec::SmallVec<[&Tensor; 8]>> {
    recorded
        .iter()
        .map(|a| match a {
            Arg::Val(t) => Some(t),
            Arg::Lazy(_) => None,
        })
        .collect()
}

/// A weight slice's key while recording for a backward, and the weights it names (held so no
/// other tensor takes their addresses).
type SliceKey = (Vec<u64>, Vec<Tensor>);
