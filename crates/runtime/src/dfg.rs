//! The lazy backend: instance executors record block invocations as dataflow-graph nodes instead of
//! computing them; [`Dfg::flush`] evaluates all pending nodes in batched launches.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use tumble_compile::{Block, OutputShape, Program};
use tumble_interp::reference::block_value;
use tumble_interp::{Backend, InstanceCtx, LazyRef, RunError, Value};
use tumble_ir::{Attrs, Span, Ty};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::{Rng, Tensor};

use crate::batched::{run_block, RowRefs, BV};
use std::sync::Arc;

use crate::executable::Executable;
use crate::intern::Interner;
use crate::profile::Profile;
use crate::reuse::Reuse;
use crate::workers::Lending;
use crate::{Options, Scheduler};

/// A block argument as recorded.
#[derive(Clone)]
pub(crate) enum Arg {
    Lazy(LazyRef),
    Val(Tensor),
}

/// A computed output: a whole tensor, or row `row` of a launch's batched output.
#[derive(Clone)]
struct Slot {
    tensor: Tensor,
    row: Option<u32>,
}

impl Slot {
    fn value(&self) -> Result<Tensor, String> {
        match self.row {
            None => Ok(self.tensor.clone()),
            Some(r) => self.tensor.row(r as usize).map_err(|e| e.to_string()),
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
    out_shapes: std::rc::Rc<Vec<Vec<usize>>>,
    out: Option<Vec<Slot>>,
    pub(crate) span: Span,
    /// A deferred sum (sum fusion): never launched; `args` are its terms (none of them a deferred
    /// sum), added in order when a launch first reads it ([`Dfg::materialize_sums`]).
    sum: bool,
    /// The instance (index in the mini-batch) that recorded it, to name in errors.
    pub(crate) instance: u32,
}

pub struct Dfg<'p> {
    program: &'p Program,
    reuse: &'p Reuse,
    opts: Options,
    nodes: Vec<Node>,
    pending: Vec<u32>,
    /// Ids of (block, input shapes): the shape cache's index.
    shape_keys: Interner,
    /// Ids of (shape key, shared weights read): the launch-grouping key under code duplication.
    dup_keys: Interner,
    /// The words of the key being built (kept to reuse its allocation).
    key_words: Vec<u64>,
    /// Output shapes per shape-key id.
    shape_cache: Vec<Option<std::rc::Rc<Vec<Vec<usize>>>>>,
    /// Draws for operators run inside launches (none are random: those run on the host).
    launch_rng: Rng,
    /// What the job computed once for the program: per-block facts and kernel plans.
    exec: Arc<Executable>,
    /// The instance whose invocation made the last failed launch fail (see [`Dfg::launch`]).
    pub failed_instance: Option<u32>,
    /// Threads lent by workers that have finished (a share is added to `opts.threads` at each
    /// launch).
    lent: Option<&'p Lending>,
    pub profile: Profile,
    /// Recording for the backward pass ([`Dfg::record_for_backward`]): the launches in order.
    launch_log: Option<Vec<Vec<u32>>>,
}

/// Output shapes of a block from its inputs' shapes, by its operators' relations (Nimble's shape
/// functions), so launches can be grouped before anything is computed.
fn infer_shapes(block: &Block, inputs: &[Vec<usize>]) -> Result<Vec<Vec<usize>>, String> {
    let to_ty = |s: &[usize], d| Ty::tensor_of(&s.iter().map(|&x| x as i64).collect::<Vec<_>>(), d);
    let mut node_tys: Vec<Ty> = Vec::with_capacity(block.nodes.len());
    let ty_of = |v: &tumble_compile::BVal, node_tys: &[Ty]| -> Result<Ty, String> {
        use tumble_compile::BVal;
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
    };
    for node in &block.nodes {
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
            .collect::<Result<Vec<_>, _>>()?;
        let t = (node.op.relation)(&args, &node.attrs).map_err(|e| e.message)?;
        node_tys.push(t);
    }
    block
        .outputs
        .iter()
        .map(|v| {
            let t = ty_of(v, &node_tys)?;
            t.as_tensor()
                .and_then(|(dims, _)| {
                    dims.iter()
                        .map(|d| d.known().map(|x| x as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| "internal: output shape unknown".to_string())
        })
        .collect()
}

/// The most terms one deferred sum holds. Flattening copies the inner sum's terms, so a fold over
/// a long list would copy O(n²) terms (and keep every partial sum's list alive); past this many,
/// the `add` is recorded as an ordinary invocation whose launch materializes the inner sum.
const MAX_SUM_TERMS: usize = 32;

/// True for a small f32 tensor of zeros (a fold's initial `zeros(..)`): adding it changes nothing.
fn is_zero_term(t: &Tensor) -> bool {
    t.len() <= 1 << 16
        && t.as_slice::<f32>()
            .is_some_and(|v| v.iter().all(|&x| x == 0.0))
}

impl<'p> Dfg<'p> {
    pub fn new(
        program: &'p Program,
        reuse: &'p Reuse,
        exec: Arc<Executable>,
        opts: Options,
    ) -> Self {
        Dfg {
            program,
            reuse,
            opts,
            nodes: Vec::new(),
            pending: Vec::new(),
            shape_keys: Interner::default(),
            dup_keys: Interner::default(),
            key_words: Vec::new(),
            shape_cache: Vec::new(),
            launch_rng: Rng::new(0),
            exec,
            lent: None,
            failed_instance: None,
            profile: Profile::default(),
            launch_log: None,
        }
    }

    /// Records for the backward pass ([`crate::backward`]): every launch's nodes in order, and
    /// node arguments kept after their launch. Every float value must stay on the graph for
    /// the backward to see it, so nothing is computed off it: no host scalars, no deferred
    /// sums, and a computed input stays a reference to its node instead of becoming a value.
    pub fn record_for_backward(&mut self) {
        self.launch_log = Some(Vec::new());
    }

    /// The launches so far, in order (empty unless recording for the backward).
    pub(crate) fn launch_log(&self) -> &[Vec<u32>] {
        self.launch_log.as_deref().unwrap_or_default()
    }

    pub(crate) fn program(&self) -> &'p Program {
        self.program
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
                if slot.row.is_none() || row_len(&slot.tensor) <= 1 {
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

    /// A deferred sum whose terms are all computed, added on the host (it is read outside any
    /// launch: a result, a condition, an operator outside a block).
    fn sum_on_host(&self, node: &Node) -> Result<Option<Tensor>, RunError> {
        if !node.args.iter().all(|a| self.arg_ready(a)) {
            return Ok(None);
        }
        let shape = node.out_shapes.first().cloned().unwrap_or_default();
        let mut acc = vec![0f32; shape.iter().product()];
        for a in &node.args {
            self.add_term(&mut acc, a)?;
        }
        Tensor::from_vec(shape, acc)
            .map(Some)
            .map_err(|e| RunError::new(format!("internal: sum: {e}")))
    }

    /// Adds one term of a deferred sum to `acc` (same length).
    fn add_term(&self, acc: &mut [f32], a: &Arg) -> Result<(), RunError> {
        let (t, row) = match a {
            Arg::Val(t) => (t, None),
            Arg::Lazy(r) => {
                let s = self.slot(r)?;
                (&s.tensor, s.row)
            }
        };
        let n = acc.len();
        let all = t
            .as_slice::<f32>()
            .ok_or_else(|| RunError::new("internal: sum term is not f32"))?;
        let src = match row {
            None => all.get(..n),
            Some(r) => all.get(r as usize * n..(r as usize + 1) * n),
        }
        .filter(|s| s.len() == n)
        .ok_or_else(|| RunError::new("internal: sum term has another shape"))?;
        for (d, s) in acc.iter_mut().zip(src) {
            *d += *s;
        }
        Ok(())
    }

    /// Computes the deferred sums that input `i` of a launch over `ids` reads (each
    /// once) into one batch, row by row, so that the launch finds ordinary rows of an earlier
    /// output (contiguous when it reads them in this order: no copy at all).
    fn materialize_sums(&mut self, i: usize, ids: &[u32]) -> Result<(), RunError> {
        let unmaterialized = |dfg: &Self, id: u32| match dfg.nodes.get(id as usize)?.args.get(i)? {
            Arg::Lazy(r) => dfg
                .nodes
                .get(r.node as usize)
                .is_some_and(|n| n.sum && n.out.is_none())
                .then_some(r.node),
            Arg::Val(_) => None,
        };
        if !ids.iter().any(|&id| unmaterialized(self, id).is_some()) {
            return Ok(());
        }
        let mut seen = std::collections::HashSet::new();
        let todo: Vec<u32> = ids
            .iter()
            .filter_map(|&id| unmaterialized(self, id))
            .filter(|&s| seen.insert(s))
            .collect();
        let Some(&first) = todo.first() else {
            return Ok(());
        };
        let shape = self
            .nodes
            .get(first as usize)
            .and_then(|n| n.out_shapes.first().cloned())
            .unwrap_or_default();
        let len: usize = shape.iter().product();
        let mut data = tumble_tensor::pool::zeroed_f32(todo.len() * len);
        let mut terms = 0;
        for (k, &id) in todo.iter().enumerate() {
            let node = self
                .nodes
                .get(id as usize)
                .ok_or_else(|| RunError::new("internal: unknown sum"))?;
            if node.out_shapes.first() != Some(&shape) {
                return Err(RunError::new(
                    "internal: sums of different shapes in one input",
                ));
            }
            for a in &node.args {
                self.add_term(&mut data[k * len..(k + 1) * len], a)?;
            }
            terms += node.args.len() as u64;
        }
        let mut batch_shape = Vec::with_capacity(shape.len() + 1);
        batch_shape.push(todo.len());
        batch_shape.extend_from_slice(&shape);
        let batch = Tensor::from_vec(batch_shape, data)
            .map_err(|e| RunError::new(format!("internal: sum: {e}")))?;
        for (k, &id) in todo.iter().enumerate() {
            if let Some(n) = self.nodes.get_mut(id as usize) {
                n.out = Some(vec![Slot {
                    tensor: batch.clone(),
                    row: Some(k as u32),
                }]);
                n.args = Vec::new();
            }
        }
        self.profile.sum_terms += terms;
        Ok(())
    }

    /// Sum fusion: the value of `add(a, b)` as a deferred sum, or `None` to record it normally
    /// (no uncomputed term, or shapes that would broadcast).
    fn try_sum(
        &mut self,
        block_id: u32,
        args: &[Arg],
        span: Span,
        ctx: &InstanceCtx,
    ) -> Result<Option<Value>, RunError> {
        let instance = ctx.instance;
        if !args.iter().any(|a| matches!(a, Arg::Lazy(_))) {
            return Ok(None);
        }
        let shape = self.arg_shape(&args[0])?.to_vec();
        for a in &args[1..] {
            if self.arg_shape(a)? != shape.as_slice() {
                return Ok(None);
            }
        }
        let mut terms = Vec::with_capacity(args.len());
        for a in args {
            match a {
                Arg::Val(t) if is_zero_term(t) => {}
                Arg::Lazy(r) => match self.nodes.get(r.node as usize) {
                    Some(n) if n.sum && n.out.is_none() => terms.extend(n.args.iter().cloned()),
                    _ => terms.push(a.clone()),
                },
                Arg::Val(_) => terms.push(a.clone()),
            }
        }
        if terms.len() > MAX_SUM_TERMS {
            return Ok(None);
        }
        self.profile.sums += 1;
        if let [Arg::Lazy(r)] = terms[..] {
            // `x + 0`: the value is `x` itself.
            return Ok(Some(Value::Lazy(r)));
        }
        let depth = terms
            .iter()
            .map(|a| self.arg_depth(a))
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        let id = self.reserve_node(ctx.pending)?;
        self.nodes.push(Node {
            block: block_id,
            args: terms,
            depth,
            key: 0,
            out_shapes: std::rc::Rc::new(vec![shape]),
            out: None,
            span,
            sum: true,
            instance,
        });
        Ok(Some(Value::Lazy(LazyRef {
            node: id,
            output: 0,
        })))
    }

    /// The id of the next node. When the node table is full, its growth (a reallocation that
    /// doubles it: gigabytes for a runaway recursion) is checked against the memory budget before
    /// it happens; `pending` is the recording instance's pending evaluations, for the message.
    fn reserve_node(&mut self, pending: usize) -> Result<u32, RunError> {
        if self.nodes.len() == self.nodes.capacity() {
            let more = self.nodes.capacity().max(4) * std::mem::size_of::<Node>();
            if let Err(stop) = tumble_limits::reserve(more) {
                let held = vec![
                    format!(
                        "{} pending evaluations in this instance",
                        tumble_limits::count_text(pending)
                    ),
                    self.growth(),
                ];
                return Err(tumble_interp::machine::limit_error(stop, held, ""));
            }
        }
        Ok(self.nodes.len() as u32)
    }

    fn lazy_value(&self, block: &Block, node: u32) -> Value {
        let n = block.outputs.len() as u32;
        match (block.output_shape, n) {
            (OutputShape::Single, 1) => Value::Lazy(LazyRef { node, output: 0 }),
            _ => Value::tuple(
                (0..n)
                    .map(|output| Value::Lazy(LazyRef { node, output }))
                    .collect(),
            ),
        }
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Nodes recorded so far, run or not: what a long-lived [`crate::session::BatchSession`]
    /// bounds, since nodes (and their outputs) are only freed with the whole graph.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Evaluates every pending node, in batched launches chosen by the scheduler.
    pub fn flush(&mut self) -> Result<(), RunError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.profile.flushes += 1;
        let pending = std::mem::take(&mut self.pending);
        match self.opts.scheduler {
            Scheduler::Agenda => self.flush_agenda(pending),
            _ => self.flush_by_depth(pending, usize::MAX),
        }
    }

    /// [`Dfg::flush`] that stops once `levels` depth levels have launched, leaving the deeper
    /// nodes pending (the inline and dataflow-depth schedulers; the agenda flushes everything).
    /// A continuous-batching session flushes this way so that instances arriving meanwhile join
    /// the level the running ones have reached instead of waiting for their whole trees.
    pub fn flush_levels(&mut self, levels: usize) -> Result<(), RunError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.profile.flushes += 1;
        let pending = std::mem::take(&mut self.pending);
        match self.opts.scheduler {
            Scheduler::Agenda => self.flush_agenda(pending),
            _ => self.flush_by_depth(pending, levels.max(1)),
        }
    }

    /// The shallowest depth among the nodes not yet run (`None` when none is pending).
    pub fn frontier_depth(&self) -> Option<u32> {
        self.pending
            .iter()
            .filter_map(|&id| self.nodes.get(id as usize).map(|n| n.depth))
            .min()
    }

    /// Whether every lazy tensor inside `v` has been computed (iterative: results can be long
    /// lists).
    pub fn is_computed(&self, v: &Value) -> bool {
        let mut stack = vec![v];
        while let Some(v) = stack.pop() {
            match v {
                Value::Lazy(r) if !self.lazy_ready(*r) => return false,
                Value::Tuple(t) => stack.extend(t.0.iter()),
                Value::Adt(a) => stack.extend(a.fields.iter()),
                _ => {}
            }
        }
        true
    }

    /// Inline-depth and dataflow-depth scheduling: all nodes of one (depth, block, shapes) launch
    /// together, depths in increasing order.
    fn flush_by_depth(&mut self, pending: Vec<u32>, max_levels: usize) -> Result<(), RunError> {
        let t0 = Instant::now();
        let mut levels: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for id in pending {
            if let Some(n) = self.nodes.get(id as usize) {
                levels.entry(n.depth).or_default().push(id);
            }
        }
        // Pending invocations per launch key, for deferring small launches while more of the
        // same key are still to come.
        let deferring = self.exec.defer_below.iter().any(|&d| d > 1);
        let mut remaining: HashMap<(u32, u64), usize> = HashMap::new();
        if deferring {
            for ids in levels.values() {
                for &id in ids {
                    if let Some(n) = self.nodes.get(id as usize) {
                        if self
                            .exec
                            .defer_below
                            .get(n.block as usize)
                            .is_some_and(|&d| d > 1)
                        {
                            *remaining.entry((n.block, n.key)).or_default() += 1;
                        }
                    }
                }
            }
        }
        // Nodes waiting for an input, by the node that computes it: released to the level after
        // the one that launches it, instead of being looked at again at every level between
        // (NestedRNN's chains behind deferred launches made that quadratic).
        let mut waiting_on: HashMap<u32, Vec<u32>> = HashMap::new();
        self.profile.time_schedule += t0.elapsed();
        let mut launched_levels = 0;
        while let Some((depth, ids)) = levels.pop_first() {
            if launched_levels == max_levels {
                // Out of levels: everything not launched stays pending for the next flush.
                self.pending.extend(ids);
                self.pending.extend(levels.into_values().flatten());
                self.pending.extend(waiting_on.into_values().flatten());
                return Ok(());
            }
            let t0 = Instant::now();
            let mut groups: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
            let mut later = Vec::new();
            for id in ids {
                match self.blocking_input(id) {
                    None => {
                        if let Some(n) = self.nodes.get(id as usize) {
                            groups.entry((n.block, n.key)).or_default().push(id);
                        }
                    }
                    Some(Some(p)) => waiting_on.entry(p).or_default().push(id),
                    Some(None) => later.push(id),
                }
            }
            if deferring {
                // A small group of a weight-bound block waits one level when more invocations
                // of its key are pending and another group launches at this level (so every
                // level makes progress and the flush ends).
                let defer = |k: &(u32, u64), n: usize| {
                    n < self
                        .exec
                        .defer_below
                        .get(k.0 as usize)
                        .copied()
                        .unwrap_or(0)
                        && remaining.get(k).is_some_and(|&r| r > n)
                };
                let mut waiting: Vec<(u32, u64)> = groups
                    .iter()
                    .filter(|(k, ids)| defer(k, ids.len()))
                    .map(|(k, _)| *k)
                    .collect();
                if waiting.len() == groups.len() {
                    // Every group could wait: the fullest (relative to its threshold) launches.
                    let fill = |k: &(u32, u64)| {
                        let below = self
                            .exec
                            .defer_below
                            .get(k.0 as usize)
                            .copied()
                            .unwrap_or(1);
                        groups.get(k).map_or(0, Vec::len) as f64 / below.max(1) as f64
                    };
                    if let Some(i) = (0..waiting.len())
                        .max_by(|&a, &b| fill(&waiting[a]).total_cmp(&fill(&waiting[b])))
                    {
                        waiting.swap_remove(i);
                    }
                }
                for k in waiting {
                    if let Some(ids) = groups.remove(&k) {
                        self.profile.deferred += ids.len() as u64;
                        later.extend(ids);
                    }
                }
                for (k, ids) in &groups {
                    if let Some(r) = remaining.get_mut(k) {
                        *r = r.saturating_sub(ids.len());
                    }
                }
            }
            if !later.is_empty() {
                levels.entry(depth + 1).or_default().extend(later);
            }
            if groups.is_empty() && levels.is_empty() && !waiting_on.is_empty() {
                return Err(RunError::new("internal: dataflow graph has a cycle"));
            }
            self.profile.time_schedule += t0.elapsed();
            if !groups.is_empty() {
                launched_levels += 1;
            }
            for ((block, _), ids) in groups {
                self.launch(block, &ids)?;
                for id in ids {
                    if let Some(ws) = waiting_on.remove(&id) {
                        levels.entry(depth + 1).or_default().extend(ws);
                    }
                }
            }
        }
        if !waiting_on.is_empty() {
            return Err(RunError::new(
                "internal: a node waits for an input no launch computes",
            ));
        }
        Ok(())
    }

    /// `None` when every input of node `id` is computed; else `Some` of a recorded node not run
    /// yet that computes one of them (a deferred sum's term rather than the sum), or `Some(None)`
    /// if there is none to wait for.
    fn blocking_input(&self, id: u32) -> Option<Option<u32>> {
        let n = self.nodes.get(id as usize)?;
        for a in &n.args {
            let Arg::Lazy(r) = a else {
                continue;
            };
            let Some(m) = self.nodes.get(r.node as usize) else {
                return Some(None);
            };
            if m.out.is_some() {
                continue;
            }
            if !m.sum {
                return Some(Some(r.node));
            }
            for t in &m.args {
                if let Arg::Lazy(q) = t {
                    if !self.lazy_ready(*q) {
                        return Some(Some(q.node));
                    }
                }
            }
        }
        None
    }

    /// DyNet's agenda: repeatedly launch the group of ready nodes with the same signature whose
    /// shallowest node is shallowest (larger group on ties).
    fn flush_agenda(&mut self, pending: Vec<u32>) -> Result<(), RunError> {
        let t0 = Instant::now();
        let pending_set: std::collections::HashSet<u32> = pending.iter().copied().collect();
        let mut waiting: HashMap<u32, usize> = HashMap::new();
        let mut consumers: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut ready: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
        for &id in &pending {
            let Some(n) = self.nodes.get(id as usize) else {
                continue;
            };
            let mut count = 0;
            let mut deps = Vec::new();
            for a in &n.args {
                self.arg_deps(a, &mut deps);
            }
            for dep in deps {
                if pending_set.contains(&dep) {
                    count += 1;
                    consumers.entry(dep).or_default().push(id);
                }
            }
            if count == 0 {
                ready.entry((n.block, n.key)).or_default().push(id);
            } else {
                waiting.insert(id, count);
            }
        }
        self.profile.time_schedule += t0.elapsed();
        loop {
            let t0 = Instant::now();
            let pick = ready
                .iter()
                .map(|(k, ids)| {
                    let d = ids
                        .iter()
                        .filter_map(|&i| self.nodes.get(i as usize).map(|n| n.depth))
                        .min()
                        .unwrap_or(0);
                    (d, std::cmp::Reverse(ids.len()), *k)
                })
                .min()
                .map(|(_, _, k)| k);
            let Some(k) = pick else { break };
            let ids = ready.remove(&k).unwrap_or_default();
            self.profile.time_schedule += t0.elapsed();
            self.launch(k.0, &ids)?;
            let t0 = Instant::now();
            for id in ids {
                for c in consumers.remove(&id).unwrap_or_default() {
                    if let Some(w) = waiting.get_mut(&c) {
                        *w -= 1;
                        if *w == 0 {
                            waiting.remove(&c);
                            if let Some(n) = self.nodes.get(c as usize) {
                                ready.entry((n.block, n.key)).or_default().push(c);
                            }
                        }
                    }
                }
            }
            self.profile.time_schedule += t0.elapsed();
        }
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(RunError::new("internal: dataflow graph has a cycle"))
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

    fn slot(&self, r: &LazyRef) -> Result<&Slot, RunError> {
        self.nodes
            .get(r.node as usize)
            .and_then(|n| n.out.as_ref())
            .and_then(|o| o.get(r.output as usize))
            .ok_or_else(|| RunError::new("internal: input not computed"))
    }

    /// Runs `block` for the nodes `ids`: one batched call, or for a block with per-invocation
    /// weights, calls over chunks whose per-instance inputs fit in cache.
    fn launch(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        let chunk = self
            .exec
            .chunk_sizes
            .get(block_id as usize)
            .copied()
            .unwrap_or(usize::MAX);
        for part in ids.chunks(chunk) {
            self.launch_attributed(block_id, part)?;
        }
        Ok(())
    }

    /// [`Dfg::launch_batch`]; when a launch of several invocations fails, each runs alone so that
    /// the error is the first failing invocation's own and names its instance
    /// (`failed_instance`) instead of the whole mini-batch. Launches compute and store values
    /// only, so running the others alone changes nothing but the time of a run that fails anyway.
    fn launch_attributed(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        let Err(batch_error) = self.launch_batch(block_id, ids) else {
            return Ok(());
        };
        let instance_of = |dfg: &Self, id: u32| dfg.nodes.get(id as usize).map(|n| n.instance);
        if ids.len() > 1 {
            for &id in ids {
                if let Err(e) = self.launch_batch(block_id, &[id]) {
                    self.failed_instance = instance_of(self, id);
                    return Err(e);
                }
            }
        }
        self.failed_instance = ids.first().and_then(|&id| instance_of(self, id));
        Err(batch_error)
    }

    /// Runs `block` for the nodes `ids` as one batched call.
    fn launch_batch(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        let block = self.block(block_id)?;
        let b = ids.len();
        let first_span = ids
            .first()
            .and_then(|&i| self.nodes.get(i as usize))
            .map(|n| n.span)
            .unwrap_or_default();
        if let Err(stop) = tumble_limits::poll() {
            let mut e = tumble_interp::machine::limit_error(stop, vec![self.growth()], "");
            e.span = Some(first_span);
            return Err(e);
        }
        // Before the launch allocates: at most every node's result for every row (an upper bound:
        // row programs keep fewer), which must fit in what is left of the memory budget.
        let launch_bytes = self
            .exec
            .row_bytes
            .get(block_id as usize)
            .map_or(0, |r| r.saturating_mul(b));
        if launch_bytes >= tumble_ops::RESERVE_ABOVE {
            if let Err(stop) = tumble_limits::reserve(launch_bytes) {
                return Err(RunError::at(
                    first_span,
                    format!("in block {} ({b} invocations): {stop}", block.name),
                ));
            }
        }
        let t0 = Instant::now();
        let mut inputs = Vec::with_capacity(block.inputs.len());
        for i in 0..block.inputs.len() {
            inputs.push(self.gather(block_id, i, ids)?);
        }
        self.profile.time_gather += t0.elapsed();
        let t1 = Instant::now();
        let mut octx = OpCtx {
            rng: &mut self.launch_rng,
        };
        let outs = match self.exec.plans.get(block_id as usize) {
            Some(plan) => crate::fused::run_planned(
                block,
                plan,
                &inputs,
                b,
                &mut octx,
                &mut self.profile.ops,
                &mut self.profile.fused,
                self.opts.threads + self.lent.map_or(0, Lending::share),
            ),
            None => run_block(block, &inputs, b, &mut octx, &mut self.profile.ops),
        }
        .map_err(|m| RunError::at(first_span, format!("in block {}: {m}", block.name)))?;
        let kernel_time = t1.elapsed();
        self.profile.time_kernels += kernel_time;
        self.profile.launches += 1;
        let st = self
            .profile
            .per_block
            .entry(block.name.clone())
            .or_default();
        st.launches += 1;
        st.invocations += b as u64;
        st.max_batch = st.max_batch.max(b as u64);
        st.kernels += kernel_time;
        for o in &outs {
            if let BV::Batched(OpValue::Tensor(t)) = o {
                self.profile.activation_bytes += (t.len() * t.dtype().size()) as u64;
            }
        }
        for (row, &id) in ids.iter().enumerate() {
            let slots = outs
                .iter()
                .map(|o| match o {
                    BV::Shared(OpValue::Tensor(t)) => Ok(Slot {
                        tensor: t.clone(),
                        row: None,
                    }),
                    BV::Batched(OpValue::Tensor(t)) => Ok(Slot {
                        tensor: t.clone(),
                        row: Some(row as u32),
                    }),
                    // Gather views: the invocation's own row of the table, where it lies.
                    BV::Rows(r) => match r.part_ref(row) {
                        Some((t, at)) => Ok(Slot {
                            tensor: t.clone(),
                            row: at.map(|a| a as u32),
                        }),
                        None => Err(RunError::new("internal: block output has too few rows")),
                    },
                    _ => Err(RunError::new("internal: block output is not a tensor")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(n) = self.nodes.get_mut(id as usize) {
                n.out = Some(slots);
                // The arguments are no longer needed (but by the backward pass); drop them so
                // memory follows liveness.
                if self.launch_log.is_none() {
                    n.args = Vec::new();
                }
            }
        }
        if let Some(log) = &mut self.launch_log {
            log.push(ids.to_vec());
        }
        Ok(())
    }

    /// Input `i` of a launch: passed once if the same for every node, the producer's batch itself
    /// if it is exactly these rows in order, else a list of the rows where they lie (gather
    /// fusion) or stacked.
    fn gather(&mut self, block: u32, i: usize, ids: &[u32]) -> Result<BV, RunError> {
        if self.opts.sum_fusion {
            self.materialize_sums(i, ids)?;
        }
        let args: Vec<&Arg> = ids
            .iter()
            .filter_map(|&id| self.nodes.get(id as usize).and_then(|n| n.args.get(i)))
            .collect();
        let shared_expected = self.reuse.is_shared(block, i);
        // Same concrete tensor everywhere (a weight): pass it once. A launch of one invocation
        // trivially passes "the same" tensor everywhere; a per-instance input there is still a
        // batch of one (else the plan's dense and row stages, which want batched activations,
        // would fall back to the reference kernels: Berxit under `--scheduler eager`).
        let per_instance = matches!(
            self.reuse.inputs.get(block as usize).and_then(|v| v.get(i)),
            Some(crate::reuse::InputReuse::PerInstance)
        );
        if let Some(Arg::Val(first)) = args.first().filter(|_| args.len() > 1 || !per_instance) {
            if args.iter().all(|a| matches!(a, Arg::Val(t) if t.shares_buffer(first) && t.shape() == first.shape())) {
                self.profile.shared_inputs += 1;
                return Ok(BV::Shared(OpValue::Tensor(first.clone())));
            }
        }
        if shared_expected {
            self.profile.reuse_misses += 1;
        }
        // Exactly rows 0..b of one earlier launch's output: no copy.
        let mut same_batch: Option<Tensor> = None;
        let mut contiguous = true;
        for (k, a) in args.iter().enumerate() {
            match a {
                Arg::Lazy(r) => {
                    let s = self.slot(r)?;
                    match (&same_batch, s.row) {
                        (None, Some(0)) if k == 0 => same_batch = Some(s.tensor.clone()),
                        (Some(t), Some(row)) if row as usize == k && t.shares_buffer(&s.tensor) => {
                        }
                        _ => {
                            contiguous = false;
                            break;
                        }
                    }
                }
                Arg::Val(_) => {
                    contiguous = false;
                    break;
                }
            }
        }
        if contiguous {
            if let Some(t) = same_batch {
                if t.shape().first() == Some(&args.len()) {
                    self.profile.zero_copy_inputs += 1;
                    return Ok(BV::Batched(OpValue::Tensor(t)));
                }
            }
        }
        // Rows of earlier outputs (or whole computed tensors) for the plan to read in place: the
        // gather is fused into the kernels (GEMM packing, row programs) instead of copied here.
        if self.opts.gather_fusion && !self.exec.plans.is_empty() {
            let parts = args
                .iter()
                .map(|a| match a {
                    Arg::Val(t) => Ok((t.clone(), None)),
                    Arg::Lazy(r) => self
                        .slot(r)
                        .map(|s| (s.tensor.clone(), s.row.map(|x| x as usize))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(rows) = RowRefs::new(parts) {
                self.profile.row_list_inputs += 1;
                return Ok(BV::Rows(rows));
            }
        }
        self.profile.gathered_inputs += 1;
        let rows = args
            .iter()
            .map(|a| match a {
                Arg::Val(t) => Ok(t.clone()),
                Arg::Lazy(r) => self.slot(r)?.value().map_err(RunError::new),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&Tensor> = rows.iter().collect();
        Tensor::stack(&refs)
            .map(|t| BV::Batched(OpValue::Tensor(t)))
            .map_err(|e| RunError::new(format!("internal: gather: {e}")))
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
        args: Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        let t0 = Instant::now();
        let block = self.block(block_id)?;
        let mut recorded = Vec::with_capacity(args.len());
        for a in args {
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
        if self.opts.host_scalars
            && !for_backward
            && self.opts.scheduler != Scheduler::Eager
            && recorded
                .iter()
                .all(|a| matches!(a, Arg::Val(t) if t.len() <= 1))
            && self.exec.scalar_blocks.get(block_id as usize) == Some(&true)
        {
            let inputs: Vec<Tensor> = recorded
                .into_iter()
                .filter_map(|a| match a {
                    Arg::Val(t) => Some(t),
                    Arg::Lazy(_) => None,
                })
                .collect();
            let mut octx = OpCtx { rng: &mut ctx.rng };
            let outs = block
                .eval(&inputs, &mut octx)
                .map_err(|m| RunError::at(span, m))?;
            self.profile.host_invocations += 1;
            self.profile.time_dfg += t0.elapsed();
            return Ok(block_value(block, outs));
        }
        if self.opts.sum_fusion
            && !for_backward
            && self.opts.scheduler != Scheduler::Eager
            && self.exec.sum_blocks.get(block_id as usize) == Some(&true)
        {
            if let Some(v) = self.try_sum(block_id, &recorded, span, ctx)? {
                self.profile.time_dfg += t0.elapsed();
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
        // Dynamic code duplication (ACROBAT §5.1): invocations passing different weights to the
        // same block (BiRNN's forward and backward `@rnn`) launch separately, each with its weights
        // shared, instead of together with the weights gathered per invocation.
        let key = if self.opts.dup {
            words.clear();
            words.push(u64::from(shape_key));
            for (i, a) in recorded.iter().enumerate() {
                if let Arg::Val(t) = a {
                    if !matches!(
                        self.reuse
                            .inputs
                            .get(block_id as usize)
                            .and_then(|v| v.get(i)),
                        Some(crate::reuse::InputReuse::PerInstance) | None
                    ) {
                        words.push(i as u64);
                        words.push(t.buffer_id() as u64);
                    }
                }
            }
            u64::from(self.dup_keys.id(&words))
        } else {
            u64::from(shape_key)
        };
        self.key_words = words;
        let cached = self
            .shape_cache
            .get(shape_key as usize)
            .and_then(Option::clone);
        let out_shapes = match cached {
            Some(s) => s,
            None => {
                let shapes = recorded
                    .iter()
                    .map(|a| self.arg_shape(a).map(<[usize]>::to_vec))
                    .collect::<Result<Vec<_>, _>>()?;
                let s = std::rc::Rc::new(
                    infer_shapes(block, &shapes).map_err(|m| RunError::at(span, m))?,
                );
                let i = shape_key as usize;
                if self.shape_cache.len() <= i {
                    self.shape_cache.resize(i + 1, None);
                }
                self.shape_cache[i] = Some(s.clone());
                s
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
            Scheduler::Inline if self.opts.hoist && statically_hoisted => dataflow,
            // Nothing it reads is pending: it can run at depth 0 with every other such invocation
            // (dynamic hoisting).
            Scheduler::Inline if self.opts.hoist && dataflow == 0 => 0,
            Scheduler::Inline => {
                let d = ctx.depth.max(dataflow);
                ctx.depth = d + 1;
                d
            }
            _ => dataflow,
        };
        let id = self.reserve_node(ctx.pending)?;
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
        });
        self.profile.nodes += 1;
        self.profile.time_dfg += t0.elapsed();
        if self.opts.scheduler == Scheduler::Eager {
            // No batching: every invocation is its own launch, at once.
            self.launch(block_id, &[id])?;
        } else {
            self.pending.push(id);
        }
        Ok(self.lazy_value(block, id))
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
            tumble_limits::count_text(self.pending.len())
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
