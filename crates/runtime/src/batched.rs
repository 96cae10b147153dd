//! Batched execution of one static block for B invocations at once (the simple path: contiguous
//! stacked inputs and the reference kernels on the stacked batch).
//!
//! Each operator of the block runs once on the whole batch when a batching rule says how: the batch is
//! a new leading axis, so axis attributes shift by one, broadcasting operands are padded to the same
//! per-instance rank, and operands shared by every invocation (weights) stay unbatched. Operators or
//! operand mixes without a rule run once per invocation (correct, just not batched). Operands shared by
//! every invocation make shared results, computed once.

use tumble_compile::{BArg, BVal, Block, BlockNode};
use tumble_ir::{Attrs, DType};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::Tensor;

mod rules;
pub(crate) use rules::rule;

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
    /// Operators a launch recorded for a backward computed inside another's kernel (a bias and
    /// a gate in a product's epilogue, a split's gates where its operand lies: `kept::Fusions`).
    pub kept_fused: u64,
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

fn eval(op: &OpDef, args: &[OpValue], attrs: &Attrs, octx: &mut OpCtx) -> Result<OpValue, String> {
    tumble_ops::eval(op, args, attrs, octx).map_err(|e| e.message)
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
