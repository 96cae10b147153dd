//! Batched execution of one static block for B invocations at once (the simple path: contiguous
//! stacked inputs and the reference kernels on the stacked batch).
//!
//! Each operator of the block runs once on the whole batch when a batching rule says how: the batch is
//! a new leading axis, so axis attributes shift by one, broadcasting operands are padded to the same
//! per-instance rank, and operands shared by every invocation (weights) stay unbatched. Operators or
//! operand mixes without a rule run once per invocation (correct, just not batched). Operands shared by
//! every invocation make shared results, computed once.

use tumble_compile::{BArg, BVal, Block, BlockNode};
use tumble_ir::{AttrValue, Attrs, DType};
use tumble_ops::{FusionClass, OpCtx, OpDef, OpValue};
use tumble_tensor::Tensor;

/// A value inside a batched launch.
#[derive(Clone, Debug)]
pub enum BV {
    /// The same for every invocation.
    Shared(OpValue),
    /// Stacked along a leading batch axis (a tensor, or a tuple of such tensors).
    Batched(OpValue),
    /// One tensor per invocation, left where earlier launches put it (gather fusion): GEMM
    /// stages and row programs read the rows in place; anything else stacks them first
    /// ([`BV::materialized`]).
    Rows(RowRefs),
}

impl BV {
    /// Field `f` of a tuple value (shared or batched), `None` for anything else.
    pub(crate) fn field(&self, f: u32) -> Option<BV> {
        match self {
            BV::Shared(OpValue::Tuple(ts)) => ts
                .get(f as usize)
                .map(|t| BV::Shared(OpValue::Tensor(t.clone()))),
            BV::Batched(OpValue::Tuple(ts)) => ts
                .get(f as usize)
                .map(|t| BV::Batched(OpValue::Tensor(t.clone()))),
            _ => None,
        }
    }
}

/// Per invocation, a whole tensor or row `r` of a batched tensor; all of shape `shape` and one
/// dtype (checked when made). The distinct tensors are held once (`tensors`) and each
/// invocation names one of them and its row: a launch of a thousand rows of a few earlier
/// launches' outputs holds a few tensors, not a thousand reference-counted clones.
#[derive(Clone, Debug)]
pub struct RowRefs {
    tensors: Vec<Tensor>,
    /// Per tensor: its parts are rows of it (else it is one part, whole).
    by_rows: Vec<bool>,
    /// Per invocation: the index in `tensors` and the row ([`WHOLE`]: the whole tensor).
    rows: Vec<(u32, u32)>,
    shape: Vec<usize>,
    dtype: DType,
}

/// [`RowRefs::rows`]' mark for a whole tensor.
const WHOLE: u32 = u32::MAX;

/// Builds a [`RowRefs`] from references, cloning a tensor once per run of parts that read it.
pub struct RowRefsBuilder {
    refs: RowRefs,
    ok: bool,
}

impl RowRefsBuilder {
    pub fn with_capacity(n: usize) -> Self {
        RowRefsBuilder {
            refs: RowRefs {
                tensors: Vec::new(),
                by_rows: Vec::new(),
                rows: Vec::with_capacity(n),
                shape: Vec::new(),
                dtype: DType::Float32,
            },
            ok: true,
        }
    }

    /// The next invocation's part: `t` whole, or its row `row`.
    pub fn push(&mut self, t: &Tensor, row: Option<usize>) {
        if !self.ok {
            return;
        }
        let r = &mut self.refs;
        // Runs of rows of one tensor are the common case (an embedding table, a launch's output
        // read in order); a tensor seen earlier but not last is held again, which costs what a
        // part of its own did before.
        let found = r.tensors.last().and_then(|u| {
            let i = r.tensors.len() - 1;
            (u.same_tensor(t) && r.by_rows[i] == row.is_some()).then_some(i)
        });
        let index = match found {
            Some(i) => i,
            None => {
                let part_shape = match row {
                    None => Some(t.shape()),
                    Some(_) => t.shape().get(1..),
                };
                let Some(part_shape) = part_shape else {
                    self.ok = false;
                    return;
                };
                if r.tensors.is_empty() {
                    r.shape = part_shape.to_vec();
                    r.dtype = t.dtype();
                } else if t.dtype() != r.dtype || part_shape != r.shape.as_slice() {
                    self.ok = false;
                    return;
                }
                r.tensors.push(t.clone());
                r.by_rows.push(row.is_some());
                r.tensors.len() - 1
            }
        };
        let rows_in = t.shape().first().copied().unwrap_or(0);
        let at = match row {
            None => WHOLE,
            Some(x) if x < rows_in && x < WHOLE as usize => x as u32,
            Some(_) => {
                self.ok = false;
                return;
            }
        };
        r.rows.push((index as u32, at));
    }

    /// `None` unless every part had the same per-invocation shape and dtype, its rows existed,
    /// and there was at least one part.
    pub fn finish(self) -> Option<RowRefs> {
        (self.ok && !self.refs.rows.is_empty()).then_some(self.refs)
    }
}

impl RowRefs {
    /// `None` unless every part has the same per-invocation shape and dtype, and rows exist.
    pub fn new(parts: Vec<(Tensor, Option<usize>)>) -> Option<RowRefs> {
        let mut b = RowRefsBuilder::with_capacity(parts.len());
        for (t, r) in &parts {
            b.push(t, *r);
        }
        b.finish()
    }

    /// The same rows under per-invocation shape `shape` (same element count): each distinct
    /// tensor reshaped once, sharing its buffer. `None` if the counts differ.
    pub fn reshaped(&self, shape: &[usize]) -> Option<RowRefs> {
        if shape.iter().product::<usize>() != self.shape.iter().product::<usize>() {
            return None;
        }
        let tensors = self
            .tensors
            .iter()
            .zip(&self.by_rows)
            .map(|(t, &by_rows)| {
                let mut s = Vec::with_capacity(shape.len() + 1);
                if by_rows {
                    s.push(*t.shape().first()?);
                }
                s.extend_from_slice(shape);
                t.reshape(s).ok()
            })
            .collect::<Option<Vec<_>>>()?;
        Some(RowRefs {
            tensors,
            by_rows: self.by_rows.clone(),
            rows: self.rows.clone(),
            shape: shape.to_vec(),
            dtype: self.dtype,
        })
    }

    /// Invocation `i`'s tensor and row, as stored (no copy).
    pub fn part_ref(&self, i: usize) -> Option<(&Tensor, Option<usize>)> {
        let &(t, at) = self.rows.get(i)?;
        let row = (at != WHOLE).then_some(at as usize);
        self.tensors.get(t as usize).map(|t| (t, row))
    }

    /// The distinct tensors the parts read (a run of rows of one tensor is one entry), and per
    /// invocation the index of its tensor here and its row (`None`: the whole tensor): what a
    /// reader that resolves each tensor once (the device's copies) walks.
    pub fn by_tensor(&self) -> (&[Tensor], impl Iterator<Item = (usize, Option<usize>)> + '_) {
        let rows = self
            .rows
            .iter()
            .map(|&(t, at)| (t as usize, (at != WHOLE).then_some(at as usize)));
        (&self.tensors, rows)
    }

    /// The per-invocation shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of invocations.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Each invocation's f32 data, in place (`None` for other dtypes).
    pub fn f32_parts(&self) -> Option<Vec<&[f32]>> {
        let len: usize = self.shape.iter().product();
        let data: Vec<&[f32]> = self
            .tensors
            .iter()
            .map(Tensor::as_f32)
            .collect::<Option<_>>()?;
        self.rows
            .iter()
            .map(|&(t, at)| {
                let d = data.get(t as usize)?;
                let at = if at == WHOLE { 0 } else { at as usize * len };
                d.get(at..at + len)
            })
            .collect()
    }

    /// Invocation `i`'s tensor (a copy for a row of a batched tensor).
    pub fn part(&self, i: usize) -> Result<Tensor, String> {
        match self.part_ref(i) {
            Some((t, None)) => Ok(t.clone()),
            Some((t, Some(r))) => t.row(r).map_err(|e| e.to_string()),
            None => Err("internal: row index out of range".into()),
        }
    }

    /// The parts stacked along a new leading axis.
    pub fn stack(&self) -> Result<Tensor, String> {
        let mut shape = vec![self.rows.len()];
        shape.extend_from_slice(&self.shape);
        // A copy of every row (a weight read per invocation is megabytes a row): within the
        // memory budget, checked before it is made.
        let bytes = shape
            .iter()
            .fold(self.dtype().size(), |n, &d| n.saturating_mul(d));
        if bytes >= tumble_ops::RESERVE_ABOVE {
            tumble_limits::reserve(bytes).map_err(|stop| {
                format!(
                    "rows of {} invocations stacked ({}): {stop}",
                    self.rows.len(),
                    tumble_limits::bytes_text(bytes)
                )
            })?;
        }
        if let Some(parts) = self.f32_parts() {
            let mut data = tumble_tensor::pool::with_capacity_f32(shape.iter().product());
            parts.iter().for_each(|p| data.extend_from_slice(p));
            return Tensor::from_f32(shape, data).map_err(|e| e.to_string());
        }
        let ts = (0..self.rows.len())
            .map(|i| self.part(i))
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&Tensor> = ts.iter().collect();
        Tensor::stack(&refs).map_err(|e| e.to_string())
    }
}

impl BV {
    /// The value with row lists stacked into a batched tensor (others unchanged).
    pub fn materialized(&self) -> Result<BV, String> {
        match self {
            BV::Rows(r) => r.stack().map(|t| BV::Batched(OpValue::Tensor(t))),
            other => Ok(other.clone()),
        }
    }
}

/// Counts of how the operators of launches ran, for the profile.
#[derive(Default, Debug, Clone, Copy)]
pub struct OpStats {
    /// Operator applications that ran once for the whole batch.
    pub batched: u64,
    /// Operator applications run once per invocation (no batching rule applied).
    pub looped: u64,
    /// Operator applications on shared operands only (computed once).
    pub shared: u64,
}

/// An f32 fast path tried before an operator's reference kernel (`None`: not handled); the last
/// argument is the threads the launch may use.
pub(crate) type FastEval = fn(&str, &[OpValue], &Attrs, usize) -> Option<OpValue>;

/// How a launch runs the operators it evaluates one at a time: its random stream and counters,
/// the fast paths tried before each reference kernel, and the threads it may use.
pub(crate) struct LaunchOps<'a, 'r> {
    pub octx: &'a mut OpCtx<'r>,
    pub stats: &'a mut OpStats,
    pub fast: FastEval,
    pub threads: usize,
}

impl<'a, 'r> LaunchOps<'a, 'r> {
    /// A launch's operators on the forward's f32 fast paths ([`crate::fastops::try_eval`]).
    pub(crate) fn new(octx: &'a mut OpCtx<'r>, stats: &'a mut OpStats, threads: usize) -> Self {
        LaunchOps {
            octx,
            stats,
            fast: crate::fastops::try_eval,
            threads,
        }
    }
}

/// Runs `block` for `b` invocations by the batching rules (the f32 fast paths first, one
/// thread); `inputs[i]` is the block's i-th input for all of them.
pub fn run_block(
    block: &Block,
    inputs: &[BV],
    b: usize,
    octx: &mut OpCtx,
    stats: &mut OpStats,
) -> Result<Vec<BV>, String> {
    run_block_with(block, inputs, b, &mut LaunchOps::new(octx, stats, 1))
}

/// [`run_block`] as launch `ops` runs operators.
pub(crate) fn run_block_with(
    block: &Block,
    inputs: &[BV],
    b: usize,
    ops: &mut LaunchOps,
) -> Result<Vec<BV>, String> {
    let inputs = inputs
        .iter()
        .map(BV::materialized)
        .collect::<Result<Vec<_>, _>>()?;
    let inputs = inputs.as_slice();
    let mut results: Vec<BV> = Vec::with_capacity(block.nodes.len());
    for node in &block.nodes {
        let args = operands(node, inputs, &results, b)?;
        results.push(batched_op(node.op, &node.attrs, args, b, ops)?);
    }
    block
        .outputs
        .iter()
        .map(|v| lookup(v, inputs, &results))
        .collect()
}

/// The first node of `block` whose operator fails on these `b` invocations, with its message,
/// running the nodes one by one by the batching rules ([`run_block_with`]'s way): a failed
/// launch is located after the fact, so no launch path carries bookkeeping for it. `None` when
/// every operator succeeds this way (the failure was not one operator's).
pub(crate) fn failing_node(
    block: &Block,
    inputs: &[BV],
    b: usize,
    ops: &mut LaunchOps,
) -> Option<(usize, String)> {
    let inputs = inputs
        .iter()
        .map(BV::materialized)
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let mut results: Vec<BV> = Vec::with_capacity(block.nodes.len());
    for (i, node) in block.nodes.iter().enumerate() {
        let args = operands(node, &inputs, &results, b).ok()?;
        match batched_op(node.op, &node.attrs, args, b, ops) {
            Ok(v) => results.push(v),
            Err(m) => return Some((i, m)),
        }
    }
    None
}

/// The operands of block node `node` from the block's inputs and the results so far.
pub(crate) fn operands(
    node: &BlockNode,
    inputs: &[BV],
    results: &[BV],
    b: usize,
) -> Result<Vec<BV>, String> {
    node.args
        .iter()
        .map(|a| match a {
            BArg::One(v) => lookup(v, inputs, results),
            BArg::Tuple(vs) => {
                let items = vs
                    .iter()
                    .map(|v| lookup(v, inputs, results))
                    .collect::<Result<Vec<_>, _>>()?;
                tuple_of(items, b)
            }
        })
        .collect()
}

pub(crate) fn lookup(v: &BVal, inputs: &[BV], results: &[BV]) -> Result<BV, String> {
    let missing = || format!("internal: block value {v} is not available");
    match v {
        BVal::Input(i) => inputs.get(*i as usize).cloned().ok_or_else(missing),
        BVal::Node(n) => results.get(*n as usize).cloned().ok_or_else(missing),
        BVal::Field(n, f) => results
            .get(*n as usize)
            .and_then(|v| v.field(*f))
            .ok_or_else(missing),
        BVal::Const(t) => Ok(BV::Shared(OpValue::Tensor(t.clone()))),
    }
}

/// A tuple operand (concatenate's input): shared if every field is, else every field batched.
pub(crate) fn tuple_of(items: Vec<BV>, b: usize) -> Result<BV, String> {
    if items
        .iter()
        .all(|x| matches!(x, BV::Shared(OpValue::Tensor(_))))
    {
        let ts = items
            .into_iter()
            .filter_map(|x| match x {
                BV::Shared(OpValue::Tensor(t)) => Some(t),
                _ => None,
            })
            .collect();
        return Ok(BV::Shared(OpValue::Tuple(ts)));
    }
    let ts = items
        .into_iter()
        .map(|x| match x {
            BV::Batched(OpValue::Tensor(t)) => Ok(t),
            BV::Shared(OpValue::Tensor(t)) => broadcast_batch(&t, b),
            _ => Err("internal: nested tuple in a block".to_string()),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(BV::Batched(OpValue::Tuple(ts)))
}

/// `t` repeated `b` times along a new leading axis.
pub fn broadcast_batch(t: &Tensor, b: usize) -> Result<Tensor, String> {
    let parts: Vec<&Tensor> = std::iter::repeat_n(t, b).collect();
    Tensor::stack(&parts).map_err(|e| e.to_string())
}

fn per_instance_rank(v: &BV) -> usize {
    match v {
        BV::Shared(OpValue::Tensor(t)) => t.rank(),
        BV::Batched(OpValue::Tensor(t)) => t.rank().saturating_sub(1),
        _ => 0,
    }
}

fn batched_tensor(v: &BV) -> Option<&Tensor> {
    match v {
        BV::Batched(OpValue::Tensor(t)) => Some(t),
        _ => None,
    }
}

fn eval(op: &OpDef, args: &[OpValue], attrs: &Attrs, octx: &mut OpCtx) -> Result<OpValue, String> {
    tumble_ops::eval(op, args, attrs, octx).map_err(|e| e.message)
}

fn with_attr(attrs: &Attrs, name: &str, value: AttrValue) -> Attrs {
    let mut out = attrs.clone();
    match out.0.iter_mut().find(|a| a.name == name) {
        Some(a) => a.value = value,
        None => out.0.push(tumble_ir::attrs::Attr {
            name: name.to_string(),
            value,
            span: tumble_ir::Span::default(),
        }),
    }
    out
}

/// A per-instance axis (possibly negative) as a non-negative axis of the batched tensor.
fn shift_axis(axis: i64, rank: usize) -> Option<i64> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a + 1)
}

fn ints(v: &[i64]) -> AttrValue {
    AttrValue::List(v.iter().map(|&x| AttrValue::Int(x)).collect())
}

/// One operator on batched/shared operands.
pub(crate) fn batched_op(
    op: &'static OpDef,
    attrs: &Attrs,
    args: Vec<BV>,
    b: usize,
    ops: &mut LaunchOps,
) -> Result<BV, String> {
    let args = if args.iter().any(|a| matches!(a, BV::Rows(_))) {
        args.iter()
            .map(BV::materialized)
            .collect::<Result<Vec<_>, _>>()?
    } else {
        args
    };
    if args.iter().all(|a| matches!(a, BV::Shared(_))) {
        ops.stats.shared += 1;
        let plain: Vec<OpValue> = args
            .into_iter()
            .filter_map(|a| match a {
                BV::Shared(v) => Some(v),
                BV::Batched(_) | BV::Rows(_) => None,
            })
            .collect();
        return match (ops.fast)(op.name, &plain, attrs, ops.threads) {
            Some(v) => Ok(BV::Shared(v)),
            None => eval(op, &plain, attrs, ops.octx).map(BV::Shared),
        };
    }
    if op.name == "nn.batch_matmul" {
        if let Some(out) = batch_matmul_by_group(op, attrs, &args, ops) {
            ops.stats.batched += 1;
            return out;
        }
    }
    match rule(op, attrs, &args, b) {
        Some((plain, attrs)) => {
            ops.stats.batched += 1;
            let out = match (ops.fast)(op.name, &plain, &attrs, ops.threads) {
                Some(v) => v,
                None => eval(op, &plain, &attrs, ops.octx)?,
            };
            // batch_norm returns the shared statistics as they are: every instance's fields.
            if op.name == "nn.batch_norm" {
                if let OpValue::Tuple(ts) = &out {
                    let mut fields = ts.clone();
                    for f in fields.iter_mut().skip(1) {
                        *f = broadcast_batch(f, b)?;
                    }
                    return Ok(BV::Batched(OpValue::Tuple(fields)));
                }
            }
            // batch_matmul ran on (B·G, M, N): put the instance axis back in front.
            if op.name == "nn.batch_matmul" {
                if let OpValue::Tensor(t) = &out {
                    if let [bg, m, n] = t.shape() {
                        let g = bg / b.max(1);
                        return t
                            .reshape(vec![b, g, *m, *n])
                            .map(|t| BV::Batched(OpValue::Tensor(t)))
                            .map_err(|e| e.to_string());
                    }
                }
            }
            Ok(BV::Batched(out))
        }
        None => {
            ops.stats.looped += 1;
            per_invocation(op, attrs, &args, b, ops.octx)
        }
    }
}

/// `nn.batch_matmul` of every instance's f32 `(G, M, K)` against one shared `(G, N, K)` (a
/// capsule layer's per-pair transforms): group `g` of every instance is one product of their
/// `b·M` rows against `y[g]`, so the rows are regrouped as `(G, b·M, K)`, multiplied once, and
/// the result put back as `(b, G, M, N)` — where the batching rule copied `y` once per instance
/// (42 MB for 256 capsule instances, to multiply 21 MFLOP).
fn batch_matmul_by_group(
    op: &OpDef,
    attrs: &Attrs,
    args: &[BV],
    ops: &mut LaunchOps,
) -> Option<Result<BV, String>> {
    let (BV::Batched(OpValue::Tensor(x)), BV::Shared(OpValue::Tensor(y))) =
        (args.first()?, args.get(1)?)
    else {
        return None;
    };
    if attrs.bool("transpose_a").ok()?.unwrap_or(false) {
        return None;
    }
    let (&[b, g, m, k], Some(&gy)) = (x.shape(), y.shape().first()) else {
        return None;
    };
    if g != gy || g < 2 || y.rank() != 3 {
        return None;
    }
    let xd = x.as_f32()?;
    let mut grouped = Vec::with_capacity(xd.len());
    for gi in 0..g {
        for bi in 0..b {
            let at = (bi * g + gi) * m * k;
            grouped.extend_from_slice(xd.get(at..at + m * k)?);
        }
    }
    let grouped = OpValue::Tensor(Tensor::from_f32(vec![g, b * m, k], grouped).ok()?);
    let plain = [grouped, OpValue::Tensor(y.clone())];
    let out = match (ops.fast)(op.name, &plain, attrs, ops.threads) {
        Some(v) => v,
        None => match eval(op, &plain, attrs, ops.octx) {
            Ok(v) => v,
            Err(e) => return Some(Err(e)),
        },
    };
    let OpValue::Tensor(out) = out else {
        return None;
    };
    let (&[_, _, n], Some(od)) = (out.shape(), out.as_f32()) else {
        return None;
    };
    let mut back = Vec::with_capacity(od.len());
    for bi in 0..b {
        for gi in 0..g {
            let at = (gi * b + bi) * m * n;
            back.extend_from_slice(od.get(at..at + m * n)?);
        }
    }
    Some(
        Tensor::from_f32(vec![b, g, m, n], back)
            .map(|t| BV::Batched(OpValue::Tensor(t)))
            .map_err(|e| e.to_string()),
    )
}

/// How to run `op` once on the whole batch: the operands and attributes to pass, or `None`.
pub(crate) fn rule(
    op: &OpDef,
    attrs: &Attrs,
    args: &[BV],
    b: usize,
) -> Option<(Vec<OpValue>, Attrs)> {
    let rank = |i: usize| args.get(i).map_or(0, per_instance_rank);
    let name = op.name;
    match name {
        // Elementwise and broadcasting operators: pad batched operands to the result's per-instance
        // rank so numpy broadcasting lines the batch axis up; shared operands broadcast as they are.
        _ if matches!(op.class, FusionClass::Elementwise | FusionClass::Broadcast)
            && !matches!(
                name,
                "nn.bias_add" | "full" | "full_like" | "nn.prelu" | "sequence_mask"
            ) =>
        {
            let r = (0..args.len()).map(rank).max().unwrap_or(0);
            let plain = args
                .iter()
                .map(|a| match a {
                    BV::Shared(v) => Some(v.clone()),
                    BV::Batched(OpValue::Tensor(t)) => pad_batched(t, r).map(OpValue::Tensor),
                    // Materialized before rules are asked.
                    BV::Batched(_) | BV::Rows(_) => None,
                })
                .collect::<Option<Vec<_>>>()?;
            Some((plain, attrs.clone()))
        }
        "nn.bias_add" => {
            let data = batched_tensor(args.first()?)?;
            let BV::Shared(bias) = args.get(1)? else {
                return None;
            };
            let axis = attrs.int("axis").ok()?.unwrap_or(1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(data.clone()), bias.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's data filled with one shared value.
        "full_like" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(v) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), v.clone()], attrs.clone()))
        }
        // A shared alpha along the same axis one further in.
        "nn.prelu" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(alpha) = args.get(1)? else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(1), rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), alpha.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Shared statistics along the same axis one further in.
        "nn.batch_norm" => {
            let x = batched_tensor(args.first()?)?;
            let mut plain = vec![OpValue::Tensor(x.clone())];
            for a in args.get(1..5)? {
                let BV::Shared(v) = a else {
                    return None;
                };
                plain.push(v.clone());
            }
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(1), rank(0))?;
            Some((plain, with_attr(attrs, "axis", AttrValue::Int(axis))))
        }
        // The per-instance axes (all of them by default) one further in.
        "nn.l2_normalize" => {
            let x = batched_tensor(args.first()?)?;
            let axes = batched_axes(attrs, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", ints(&axes)),
            ))
        }
        // The batch axis not padded; a shared pad value.
        "nn.pad" => {
            let x = batched_tensor(args.first()?)?;
            let Some(AttrValue::List(rows)) = attrs.get("pad_width") else {
                return None;
            };
            let mut rows = rows.clone();
            rows.insert(0, ints(&[0, 0]));
            let mut plain = vec![OpValue::Tensor(x.clone())];
            if let Some(v) = args.get(1) {
                let BV::Shared(v) = v else {
                    return None;
                };
                plain.push(v.clone());
            }
            Some((plain, with_attr(attrs, "pad_width", AttrValue::List(rows))))
        }
        // Rows times a shared matrix, as nn.dense's rule (a 2-D lhs transposed is not rows).
        "nn.matmul" if !attrs.bool("transpose_a").ok()?.unwrap_or(false) => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(w) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), w.clone()], attrs.clone()))
        }
        "nn.dense" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(w) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), w.clone()], attrs.clone()))
        }
        "nn.softmax" | "nn.log_softmax" => {
            let x = batched_tensor(args.first()?)?;
            let axis = attrs.int("axis").ok()?.unwrap_or(-1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "nn.layer_norm" => {
            let x = batched_tensor(args.first()?)?;
            let (BV::Shared(g), BV::Shared(be)) = (args.get(1)?, args.get(2)?) else {
                return None;
            };
            let axis = attrs.int("axis").ok()?.unwrap_or(-1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), g.clone(), be.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "sum" | "prod" | "mean" | "max" | "min" | "all" | "any" | "argmax" | "argmin" => {
            let x = batched_tensor(args.first()?)?;
            let shifted = batched_axes(attrs, rank(0))?;
            if matches!(name, "argmax" | "argmin") && shifted.len() != 1 {
                return None;
            }
            let attrs = with_attr(attrs, "axis", ints(&shifted));
            let attrs = with_attr(&attrs, "exclude", AttrValue::Bool(false));
            Some((vec![OpValue::Tensor(x.clone())], attrs))
        }
        // A reduction of `(data - mean)²`: the mean (each instance's, or one for all) broadcast
        // onto the data with the batch axis lined up, the axes shifted past it.
        "variance" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0);
            // The mean keeps the data's rank (the relation's rule): a shared one (a weight's, a
            // few values) is repeated per instance, so that its gradient comes back as the
            // batch's rows, which the backward sums as any shared operand's.
            let m = match args.get(1)? {
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                BV::Batched(OpValue::Tensor(t)) => pad_batched(t, r)?,
                _ => return None,
            };
            let m = OpValue::Tensor(m);
            let shifted = batched_axes(attrs, r)?;
            let attrs = with_attr(attrs, "axis", ints(&shifted));
            let attrs = with_attr(&attrs, "exclude", AttrValue::Bool(false));
            Some((vec![OpValue::Tensor(x.clone()), m], attrs))
        }
        "concatenate" => {
            let BV::Batched(OpValue::Tuple(ts)) = args.first()? else {
                return None;
            };
            let r = ts.first().map_or(0, |t| t.rank().saturating_sub(1));
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), r)?;
            Some((
                vec![OpValue::Tuple(ts.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's value broadcast to the shape: the batch padded to that rank, then
        // broadcast with the batch axis in front.
        "broadcast_to" => {
            let x = batched_tensor(args.first()?)?;
            let shape = attrs.ints("shape").ok()??;
            let x = pad_batched(x, shape.len())?;
            let mut s = vec![b as i64];
            s.extend(shape);
            Some((
                vec![OpValue::Tensor(x)],
                with_attr(attrs, "shape", ints(&s)),
            ))
        }
        // Each instance's indices, the new axis among the per-instance ones; shared on and off
        // values.
        "one_hot" => {
            let idx = batched_tensor(args.first()?)?;
            let (BV::Shared(on), BV::Shared(off)) = (args.get(1)?, args.get(2)?) else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(-1), rank(0) + 1)?;
            Some((
                vec![OpValue::Tensor(idx.clone()), on.clone(), off.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "stack" => {
            let BV::Batched(OpValue::Tuple(ts)) = args.first()? else {
                return None;
            };
            // The new axis goes among the per-instance ones: rank + 1 places for it.
            let r = ts.first().map_or(0, |t| t.rank().saturating_sub(1));
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), r + 1)?;
            Some((
                vec![OpValue::Tuple(ts.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "split" => {
            let x = batched_tensor(args.first()?)?;
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "reshape" => {
            let x = batched_tensor(args.first()?)?;
            let newshape = attrs.ints("newshape").ok()??;
            let mut s = vec![b as i64];
            s.extend(newshape);
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "newshape", ints(&s)),
            ))
        }
        // Batched matrices (attention heads): fold the batch into batch_matmul's own batch axis.
        "nn.batch_matmul" => {
            let x = match args.first()? {
                BV::Batched(OpValue::Tensor(t)) => t.clone(),
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                _ => return None,
            };
            let y = match args.get(1)? {
                BV::Batched(OpValue::Tensor(t)) => t.clone(),
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                _ => return None,
            };
            let (xs, ys) = (x.shape().to_vec(), y.shape().to_vec());
            if xs.len() != 4 || ys.len() != 4 || xs[1] != ys[1] {
                return None;
            }
            let fold = |t: &Tensor, s: &[usize]| t.reshape(vec![s[0] * s[1], s[2], s[3]]).ok();
            Some((
                vec![
                    OpValue::Tensor(fold(&x, &xs)?),
                    OpValue::Tensor(fold(&y, &ys)?),
                ],
                attrs.clone(),
            ))
        }
        // Along an axis of each instance's value: the same axis one further in.
        "reverse" | "repeat" => {
            let x = batched_tensor(args.first()?)?;
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's own data by its own indices (both of the value's rank): one axis
        // further in.
        "gather" => {
            let (BV::Batched(OpValue::Tensor(x)), BV::Batched(OpValue::Tensor(idx))) =
                (args.first()?, args.get(1)?)
            else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), OpValue::Tensor(idx.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Scans along an axis; without one, over each instance's elements in order (its value
        // flattened: the batch's rows).
        "cumsum" | "cumprod" => {
            let x = batched_tensor(args.first()?)?;
            match attrs.int("axis").ok()? {
                Some(a) => {
                    let axis = shift_axis(a, rank(0))?;
                    Some((
                        vec![OpValue::Tensor(x.clone())],
                        with_attr(attrs, "axis", AttrValue::Int(axis)),
                    ))
                }
                None => {
                    let n: usize = x.shape().get(1..)?.iter().product();
                    let rows = x.reshape(vec![b, n]).ok()?;
                    Some((
                        vec![OpValue::Tensor(rows)],
                        with_attr(attrs, "axis", AttrValue::Int(1)),
                    ))
                }
            }
        }
        // Each instance tiled alike: the batch axis repeated once (reps no longer than the
        // value's rank, which would add axes in front of the batch's).
        "tile" => {
            let x = batched_tensor(args.first()?)?;
            let reps = attrs.ints("reps").ok()??;
            let r = rank(0);
            if reps.len() > r {
                return None;
            }
            let mut all = vec![1i64; 1 + r - reps.len()];
            all.extend(reps);
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "reps", ints(&all)),
            ))
        }
        "transpose" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let axes: Vec<i64> = match attrs.ints("axes").ok()? {
                None => (0..r).rev().collect(),
                Some(v) if v.is_empty() => (0..r).rev().collect(),
                Some(v) => v.iter().map(|&a| if a < 0 { a + r } else { a }).collect(),
            };
            let mut s = vec![0];
            s.extend(axes.iter().map(|a| a + 1));
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axes", ints(&s)),
            ))
        }
        // A slice of every instance's value: the same slice one axis further in, stated with
        // `axes` so the batch axis is taken whole and `begin`/`end`/`strides` keep their entries.
        // Without it each row was copied out whole to slice it (Berxit's exit head copied 384 KB
        // per instance per exit to read one row).
        "strided_slice" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let begin = attrs.ints("begin").ok()??;
            let end = attrs.ints("end").ok()??;
            if begin.len() != end.len() || begin.is_empty() {
                return None;
            }
            let axes: Vec<i64> = match attrs.ints("axes").ok()? {
                Some(listed) => listed
                    .iter()
                    .map(|&a| shift_axis(a, r as usize))
                    .collect::<Option<_>>()?,
                None if begin.len() as i64 <= r => (1..=begin.len() as i64).collect(),
                None => return None,
            };
            if axes.len() != begin.len() {
                return None;
            }
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axes", ints(&axes)),
            ))
        }
        "expand_dims" => {
            let x = batched_tensor(args.first()?)?;
            let axis = attrs.int("axis").ok()??;
            let axis = if axis >= 0 { axis + 1 } else { axis };
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "squeeze" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let axes: Vec<i64> = match attrs.ints("axis").ok()? {
                None => (0..r)
                    .filter(|&a| x.shape().get(a as usize + 1) == Some(&1))
                    .collect(),
                Some(v) => v.iter().map(|&a| if a < 0 { a + r } else { a }).collect(),
            };
            let s: Vec<i64> = axes.iter().map(|a| a + 1).collect();
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", ints(&s)),
            ))
        }
        // Lookups in per-invocation data, one axis further in: shared indices (`take(%p, 0,
        // axis=0)` of a batched vector) are the same lookup in every row; per-invocation ones (a
        // loss's `take(log_probs, %label)`) make the batch axis take's batch dimension, each row
        // looked up by its own indices.
        "take" if matches!(args.first(), Some(BV::Batched(_))) => {
            let x = batched_tensor(args.first()?)?;
            if attrs.int("batch_dims").ok()?.unwrap_or(0) != 0 {
                return None;
            }
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            let attrs = with_attr(attrs, "axis", AttrValue::Int(axis));
            match args.get(1)? {
                BV::Shared(idx) => Some((vec![OpValue::Tensor(x.clone()), idx.clone()], attrs)),
                BV::Batched(OpValue::Tensor(idx)) if idx.shape().first() == x.shape().first() => {
                    Some((
                        vec![OpValue::Tensor(x.clone()), OpValue::Tensor(idx.clone())],
                        with_attr(&attrs, "batch_dims", AttrValue::Int(1)),
                    ))
                }
                _ => None,
            }
        }
        "take" => {
            // An embedding lookup: shared table, per-invocation indices along axis 0.
            let BV::Shared(data) = args.first()? else {
                return None;
            };
            let idx = batched_tensor(args.get(1)?)?;
            let axis = attrs.int("axis").ok()??;
            let batch_dims = attrs.int("batch_dims").ok()?.unwrap_or(0);
            if axis != 0 || batch_dims != 0 {
                return None;
            }
            Some((
                vec![data.clone(), OpValue::Tensor(idx.clone())],
                attrs.clone(),
            ))
        }
        _ => None,
    }
}

/// `(B, s...)` reshaped to `(B, 1, ..., 1, s...)` with per-instance rank `r`.
/// The axes a reduction of per-instance rank `r` reduces (its `axis` and `exclude`), as axes of
/// the batched tensor (past the batch axis); `None` where they are not all per-instance axes or
/// there is none (a scalar per instance: an empty list would mean every axis, the batch's too).
fn batched_axes(attrs: &Attrs, r: usize) -> Option<Vec<i64>> {
    let listed = attrs.ints("axis").ok()?;
    let exclude = attrs.bool("exclude").ok()?.unwrap_or(false);
    let mut axes: Vec<i64> = match &listed {
        None => (0..r as i64).collect(),
        Some(v) if v.is_empty() => (0..r as i64).collect(),
        Some(v) => v
            .iter()
            .map(|&a| if a < 0 { a + r as i64 } else { a })
            .collect(),
    };
    if exclude && listed.is_some_and(|v| !v.is_empty()) {
        axes = (0..r as i64).filter(|a| !axes.contains(a)).collect();
    }
    if axes.is_empty() || axes.iter().any(|&a| !(0..r as i64).contains(&a)) {
        return None;
    }
    Some(axes.iter().map(|a| a + 1).collect())
}

fn pad_batched(t: &Tensor, r: usize) -> Option<Tensor> {
    let own = t.rank().checked_sub(1)?;
    if own >= r {
        return Some(t.clone());
    }
    let mut shape = Vec::with_capacity(r + 1);
    shape.push(*t.shape().first()?);
    shape.extend(std::iter::repeat_n(1, r - own));
    shape.extend_from_slice(&t.shape()[1..]);
    t.reshape(shape).ok()
}

/// The fallback: run the operator once per invocation on that invocation's rows, then stack.
fn per_invocation(
    op: &OpDef,
    attrs: &Attrs,
    args: &[BV],
    b: usize,
    octx: &mut OpCtx,
) -> Result<BV, String> {
    let mut outs: Vec<OpValue> = Vec::with_capacity(b);
    for i in 0..b {
        let row_args = args
            .iter()
            .map(|a| row_of(a, i))
            .collect::<Result<Vec<_>, _>>()?;
        outs.push(eval(op, &row_args, attrs, octx)?);
    }
    stack_values(outs)
}

pub(crate) fn row_of(v: &BV, i: usize) -> Result<OpValue, String> {
    match v {
        BV::Shared(x) => Ok(x.clone()),
        BV::Batched(OpValue::Tensor(t)) => t.row(i).map(OpValue::Tensor).map_err(|e| e.to_string()),
        BV::Batched(OpValue::Tuple(ts)) => ts
            .iter()
            .map(|t| t.row(i).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()
            .map(OpValue::Tuple),
        BV::Rows(r) => r.part(i).map(OpValue::Tensor),
    }
}

pub(crate) fn stack_values(outs: Vec<OpValue>) -> Result<BV, String> {
    match outs.first() {
        Some(OpValue::Tensor(_)) => {
            let ts: Vec<&Tensor> = outs.iter().filter_map(OpValue::as_tensor).collect();
            Tensor::stack(&ts)
                .map(|t| BV::Batched(OpValue::Tensor(t)))
                .map_err(|e| e.to_string())
        }
        Some(OpValue::Tuple(first)) => {
            let n = first.len();
            let mut fields = Vec::with_capacity(n);
            for k in 0..n {
                let ts: Vec<&Tensor> = outs
                    .iter()
                    .filter_map(|o| o.as_tuple().and_then(|t| t.get(k)))
                    .collect();
                fields.push(Tensor::stack(&ts).map_err(|e| e.to_string())?);
            }
            Ok(BV::Batched(OpValue::Tuple(fields)))
        }
        None => Err("internal: empty batch".to_string()),
    }
}
