//! Ragged launches: invocations of one block whose row inputs have different leading lengths
//! (sentences of different lengths), run together by the block's segments
//! ([`tumble_compile::ragged`]). A row-wise segment runs once over the rows of every invocation
//! (a batch of `N` rows, each a length-1 instance: the GEMMs see all tokens of all sentences, no
//! padding); a mixing segment runs once per group of invocations of equal length — but for
//! the forms that need no grouping ([`MixingKernel`], `Options::mixing_kernels`): attention, one
//! kernel over every invocation's rows ([`crate::fused::attention`]), and a slice of whole rows,
//! ranges of the rows where they lie. Each invocation's result is where it lies: its rows of a
//! segment's output ([`At::Rows`]), or its row of a group's batched output.

use std::collections::HashMap;

use super::*;
use crate::batched::RowRefsBuilder;
use crate::fastops::fold_columns;
use tumble_compile::ragged::{MixingKernel, RaggedInput};

/// A value of the parent block during a ragged launch.
enum RVal {
    /// The same tensor for every invocation (a weight, a literal, a result computed from them).
    Shared(Tensor),
    /// One slot per invocation, in launch order.
    Each(Vec<Slot>),
}

/// A parent block value as a map key (`BVal` holds tensors).
fn key_of(v: &tumble_compile::BVal) -> Option<(u8, u32, u32)> {
    use tumble_compile::BVal;
    match v {
        BVal::Input(i) => Some((0, *i, 0)),
        BVal::Node(n) => Some((1, *n, 0)),
        BVal::Field(n, f) => Some((2, *n, *f)),
        BVal::Const(_) => None,
    }
}

/// The first of an invocation's `len` rows among the leading rows of its slot's tensor (an
/// `At::Row` of a batch `(B, L, ...)` counted among its `B·L` rows).
fn first_row(at: At, len: usize) -> usize {
    match at {
        At::Whole => 0,
        At::Rows { start, .. } => start as usize,
        At::Row(r) => r as usize * len,
    }
}

/// Where an invocation's rows lie, as a tensor viewed as `(rows, 1, row shape...)` and the range
/// of its rows there: the per-row view a row-wise segment reads through row pointers.
fn row_view(slot: &Slot, len: usize) -> Result<(Tensor, usize), String> {
    let t = &slot.tensor;
    let lead = t.shape().first().copied().unwrap_or(0);
    let (rows_in, row_shape) = match slot.at {
        At::Row(_) => (lead * len, t.shape().get(2..)),
        At::Whole | At::Rows { .. } => (lead, t.shape().get(1..)),
    };
    let row_shape = row_shape.ok_or("internal: ragged rows of a scalar")?;
    let mut view = Vec::with_capacity(row_shape.len() + 2);
    view.push(rows_in);
    view.push(1);
    view.extend_from_slice(row_shape);
    let v = t
        .reshape(view)
        .map_err(|e| format!("internal: ragged rows: {e}"))?;
    Ok((v, first_row(slot.at, len)))
}

/// The `len` rows of `row` floats an invocation's slot holds, when it holds exactly that: an
/// `(len, heads, width)` f32 value (attention's operands, read where they lie).
fn rows_of(slot: &Slot, len: usize, row: usize, (heads, width): (usize, usize)) -> Option<&[f32]> {
    if slot_shape(slot) != [len, heads, width] {
        return None;
    }
    let first = first_row(slot.at, len);
    slot.tensor.as_f32()?.get(first * row..(first + len) * row)
}

/// Each invocation's Q, K and V rows for the attention kernel, read where they lie; `None` (the
/// segment then runs grouped) when any is not `(L, heads, width)` f32 rows.
fn attention_operands<'a>(
    [q, k, v]: [&'a [Slot]; 3],
    lens: &[usize],
    att: tumble_compile::attention::Attention,
) -> Option<Vec<crate::fused::attention::Qkv<'a>>> {
    let (row, dims) = (att.heads * att.width, (att.heads, att.width));
    lens.iter()
        .enumerate()
        .map(|(j, &l)| {
            Some((
                rows_of(q.get(j)?, l, row, dims)?,
                rows_of(k.get(j)?, l, row, dims)?,
                rows_of(v.get(j)?, l, row, dims)?,
            ))
        })
        .collect()
}

/// Each invocation's result of a segment that is one `strided_slice` of whole rows
/// ([`MixingKernel::RowSlice`]): the range of its rows the slice selects, in the tensor they lie
/// in. `None` (the segment then runs grouped) when any invocation's slice is not such a range.
fn row_slices(slots: &[Slot], block: &tumble_compile::Block) -> Option<Vec<Slot>> {
    let attrs = &block.nodes.first()?.attrs;
    slots
        .iter()
        .map(|s| {
            let shape = slot_shape(s);
            let (start, len) = tumble_ops::leading_rows(attrs, &shape)?;
            let l = *shape.first()?;
            let tensor = match s.at {
                At::Whole | At::Rows { .. } => s.tensor.clone(),
                // A row of a batch of (B, L, ...): its L rows among B·L.
                At::Row(_) => {
                    let mut flat = vec![s.tensor.shape().first()? * l];
                    flat.extend_from_slice(shape.get(1..)?);
                    s.tensor.reshape(flat).ok()?
                }
            };
            Some(Slot {
                tensor,
                at: At::Rows {
                    start: u32::try_from(first_row(s.at, l) + start).ok()?,
                    len: u32::try_from(len).ok()?,
                },
            })
        })
        .collect()
}

/// The elements of the value a slot holds, in its tensor's buffer, and its leading extent (its
/// rows; 1 for a scalar). No allocation: a gather launch asks this of every invocation.
fn slot_range(s: &Slot) -> Option<(std::ops::Range<usize>, usize)> {
    let shape = s.tensor.shape();
    let (lead, start, n) = match s.at {
        At::Whole => (shape.first().copied().unwrap_or(1), 0, s.tensor.len()),
        At::Row(r) => {
            let inner: usize = shape.get(1..)?.iter().product();
            (
                shape.get(1).copied().unwrap_or(1),
                r as usize * inner,
                inner,
            )
        }
        At::Rows { start, len } => {
            let row: usize = shape.get(1..)?.iter().product();
            (len as usize, start as usize * row, len as usize * row)
        }
    };
    Some((start..start + n, lead))
}

/// An index operand's values where they lie.
enum Ints<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Ints<'_> {
    fn of(t: &Tensor, range: std::ops::Range<usize>) -> Option<Ints<'_>> {
        match t.dtype() {
            tumble_ir::DType::Int32 => Some(Ints::I32(t.as_slice::<i32>()?.get(range)?)),
            tumble_ir::DType::Int64 => Some(Ints::I64(t.as_slice::<i64>()?.get(range)?)),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            Ints::I32(x) => x.len(),
            Ints::I64(x) => x.len(),
        }
    }

    fn get(&self, j: usize) -> i64 {
        match self {
            Ints::I32(x) => x.get(j).map_or(0, |&v| i64::from(v)),
            Ints::I64(x) => x.get(j).copied().unwrap_or(0),
        }
    }
}

/// Invocation `k`'s value of segment input `i` (a value of the launch, or one for all): its
/// tensor, the range of its elements there, and its leading extent.
fn operand<'a>(
    inputs: &[&'a RVal],
    i: u32,
    k: usize,
) -> Option<(&'a Tensor, std::ops::Range<usize>, usize)> {
    match inputs.get(i as usize)? {
        RVal::Shared(t) => Some((t, 0..t.len(), t.shape().first().copied().unwrap_or(1))),
        RVal::Each(slots) => {
            let s = slots.get(k)?;
            let (range, lead) = slot_range(s)?;
            Some((&s.tensor, range, lead))
        }
    }
}

/// The results of a [`MixingKernel::Gather`] segment for `n` invocations (`plan`: what each
/// output gathers), its inputs `inputs` (per segment input): each take's rows read where every
/// invocation's table lies, summed (or averaged) in f64 in index order as the reference does —
/// its bits. `None` (the segment then runs grouped) for a table that is not f32 rows, an empty
/// table, a mean over no rows, or results whose sizes differ between invocations.
fn gather_rows(
    block: &tumble_compile::Block,
    plan: &[tumble_compile::ragged::Gathered],
    inputs: &[&RVal],
    n: usize,
) -> Option<Vec<Tensor>> {
    let mut outs = Vec::with_capacity(plan.len());
    for (v, g) in block.outputs.iter().zip(plan) {
        // The output's own type: its size per invocation, and where `keepdims` keeps the
        // reduced axis.
        let ty = block.val_ty(v);
        let (dims, _) = ty.as_tensor()?;
        let mut shape = Vec::with_capacity(dims.len() + 1);
        shape.push(n);
        for d in dims {
            shape.push(usize::try_from(d.known()?).ok()?);
        }
        let per: usize = shape.iter().skip(1).product();
        let mut data: Vec<f32> = Vec::with_capacity(n * per);
        let mut acc: Vec<f64> = Vec::new();
        for k in 0..n {
            let (table, range, rows) = operand(inputs, g.table, k)?;
            let values = table.as_f32()?.get(range)?;
            let idx = match g.index {
                Some(i) => {
                    let (itensor, irange, _) = operand(inputs, i, k)?;
                    Some(Ints::of(itensor, irange)?)
                }
                None => None,
            };
            if rows == 0 || values.len() % rows != 0 {
                return None;
            }
            let width = values.len() / rows;
            let taken = idx.as_ref().map_or(rows, Ints::len);
            let row_at = |j: usize| {
                let r = match &idx {
                    Some(idx) => idx.get(j).clamp(0, rows as i64 - 1) as usize,
                    None => j,
                };
                values.get(r * width..(r + 1) * width)
            };
            let Some(reduce) = g.reduce else {
                if taken * width != per {
                    return None;
                }
                for j in 0..taken {
                    data.extend_from_slice(row_at(j)?);
                }
                continue;
            };
            if width != per {
                return None;
            }
            // (Every row taken lies in the table: indices are clipped to its `rows`, and the
            // table is `rows` rows of `width`.)
            fold_columns(
                reduce,
                (0..taken).filter_map(row_at),
                taken,
                &mut acc,
                &mut data,
            )?;
        }
        outs.push(Tensor::from_f32(shape, data).ok()?);
    }
    Some(outs)
}

/// The result of a [`MixingKernel::Query`] segment for `n` invocations, its inputs `inputs` (per
/// segment input): each invocation's query rows against its rows where they lie — the scores
/// by the dot-product kernels, the softmax by the row programs' — as attention's weighted rows
/// `(n, m, d)` or each query row's best index `(n, m)` (the first of equals; NaN above all, as
/// the reference's `argmax`). `None` (the segment then runs grouped) for an instance of no rows
/// or operands not of the form's shapes.
fn query_rows(
    block: &tumble_compile::Block,
    query: &tumble_compile::query::Query,
    inputs: &[&RVal],
    n: usize,
) -> Option<Tensor> {
    use tumble_compile::query::Then;
    let (qd, _) = block.inputs.get(query.q as usize)?.ty.as_tensor()?;
    let m = usize::try_from(qd.first()?.known()?).ok()?;
    let d = usize::try_from(qd.get(1)?.known()?).ok()?;
    let slot = |i: u32, k: usize| -> Option<(&[f32], usize)> {
        let (t, range, lead) = operand(inputs, i, k)?;
        Some((t.as_f32()?.get(range)?, lead))
    };
    let mut scores: Vec<f32> = Vec::new();
    let mut probs: Vec<f32> = Vec::new();
    let mut weighted: Vec<f32> = Vec::new();
    let mut columns: Vec<f32> = Vec::new();
    let mut best: Vec<i32> = Vec::new();
    for k in 0..n {
        let (q, _) = slot(query.q, k)?;
        let (rows, len) = slot(query.rows, k)?;
        if q.len() != m * d || len == 0 || rows.len() != len * d {
            return None;
        }
        scores.resize(len, 0.0);
        columns.clear();
        for qi in q.chunks_exact(d) {
            tumble_kernels::dot_rows(qi, rows, d, &mut scores);
            if query.scale != 1.0 {
                scores.iter_mut().for_each(|s| *s *= query.scale);
            }
            match query.then {
                Then::Argmax => {
                    let at = crate::fastops::best_index(&scores, 1, true, false);
                    best.push(i32::try_from(at).ok()?);
                }
                Then::Attend => {
                    probs.resize(len, 0.0);
                    crate::fused::rowexec::softmax_row(&mut probs, &scores, false);
                    // The weighted rows as the product with the rows' transpose, each column a
                    // dot product over the rows: the bits a group's small product gives.
                    if columns.is_empty() {
                        columns.resize(d * len, 0.0);
                        for (j, row) in rows.chunks_exact(d).enumerate() {
                            for (c, &x) in row.iter().enumerate() {
                                columns[c * len + j] = x;
                            }
                        }
                    }
                    let start = weighted.len();
                    weighted.resize(start + d, 0.0);
                    tumble_kernels::dot_rows(&probs, &columns, len, &mut weighted[start..]);
                }
            }
        }
    }
    match query.then {
        Then::Argmax => Tensor::from_vec(vec![n, m], best).ok(),
        Then::Attend => Tensor::from_f32(vec![n, m, d], weighted).ok(),
    }
}

/// The shape of the value a slot holds.
fn slot_shape(s: &Slot) -> Vec<usize> {
    let shape = s.tensor.shape();
    match s.at {
        At::Whole => shape.to_vec(),
        At::Row(_) => shape.get(1..).unwrap_or_default().to_vec(),
        At::Rows { len, .. } => {
            let mut v = shape.to_vec();
            if let Some(first) = v.first_mut() {
                *first = len as usize;
            }
            v
        }
    }
}

/// Bytes of a row-wise segment's results per chunk of rows. Why chunks at all: a launch over
/// every token of 64 sentences at once holds all their intermediate results (the feed-forward's
/// 3072 floats per token: tens of MB) where launches per length kept them in cache; and it bounds
/// a launch's memory. Measured on variable-length Berxit-small (64 sentences of 8-128 tokens,
/// b64): 128-1024 rows per chunk and none all within 3% (noise); chunks are kept for the bound.
const RAGGED_CHUNK_BYTES: usize = 16 << 20;
const RAGGED_CHUNK_MIN_ROWS: usize = 256;

impl Dfg<'_> {
    /// Runs the ragged invocations `ids` of `block_id` (grouped by [`Dfg::ragged_key`]).
    pub(super) fn launch_ragged(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        let exec = Arc::clone(&self.exec);
        let Some(Some(run)) = exec.ragged.get(block_id as usize) else {
            return Err(RunError::internal(format!(
                "block {block_id} launched ragged without a ragged form"
            )));
        };
        let block = self.block(block_id)?;
        let first_span = ids
            .first()
            .and_then(|&i| self.nodes.get(i as usize))
            .map(|n| n.span)
            .unwrap_or_default();
        let fail = |m: String| RunError::at(first_span, format!("in block {}: {m}", block.name));
        if let Err(stop) = tumble_limits::poll() {
            let mut e = tumble_interp::machine::limit_error(stop, vec![self.growth()], "");
            e.span = Some(first_span);
            return Err(e);
        }
        let t0 = Instant::now();
        // Every invocation's length: the leading dim of its row inputs (equal, by the key, but
        // for those only gathers read: any length).
        let rows_at = |free: bool| {
            (0..run.inputs.len()).find(|&i| {
                run.inputs.get(i) == Some(&RaggedInput::Rows)
                    && run.free_length.get(i).copied().unwrap_or(false) == free
            })
        };
        // With none of fixed length (only gathers read the rows), no segment runs over rows:
        // one row an invocation, for the profile and the memory bound.
        let row_input = rows_at(false);
        // A segment that mixes rows (a product over the ragged axis) makes more than its rows'
        // bytes: where the types have `?` sizes, each invocation's own shapes say what its
        // operators allocate.
        let dynamic = exec.dynamic_bytes.get(block_id as usize) == Some(&true);
        let mut dynamic_bytes = 0usize;
        let mut lens = Vec::with_capacity(ids.len());
        for &id in ids {
            let node = self
                .nodes
                .get(id as usize)
                .ok_or_else(|| RunError::internal("ragged launch of an unknown node"))?;
            lens.push(match row_input {
                Some(i) => {
                    let a = node
                        .args
                        .get(i)
                        .ok_or_else(|| RunError::internal("ragged launch: missing row input"))?;
                    self.arg_shape(a)?.first().copied().unwrap_or(0)
                }
                None => 1,
            });
            if dynamic {
                dynamic_bytes = dynamic_bytes.saturating_add(node.out_shapes.op_bytes);
            }
        }
        let total: usize = lens.iter().sum();
        // The padding baseline (`Options::ragged_padding`): rows per invocation in the row-wise
        // segments (0: each its own).
        let pad_to = match self.opts.ragged_padding {
            true => lens.iter().copied().max().unwrap_or(0),
            false => 0,
        };
        // What an invocation of no rows pads with: the first row of the first one that has rows
        // (there is one whenever `pad_to` > 0).
        let filler = lens.iter().position(|&l| l > 0).unwrap_or(0);
        let launch_bytes = run.bytes_per_row.saturating_mul(total).max(dynamic_bytes);
        if launch_bytes >= tumble_ops::RESERVE_ABOVE {
            if let Err(stop) = tumble_limits::reserve(launch_bytes) {
                return Err(fail(format!(
                    "{} invocations of {total} rows in all: {stop}",
                    ids.len()
                )));
            }
        }

        // The block's inputs: shared ones once, row inputs per invocation where they lie.
        let mut vals: HashMap<(u8, u32, u32), RVal> = HashMap::new();
        for (i, &kind) in run.inputs.iter().enumerate() {
            let rowed = kind == RaggedInput::Rows;
            if self.opts.sum_fusion {
                // Row inputs have different shapes: their deferred sums add up one by one.
                match rowed {
                    true => {
                        for id in ids {
                            self.materialize_sums(i, std::slice::from_ref(id))?;
                        }
                    }
                    false => self.materialize_sums(i, ids)?,
                }
            }
            let mut slots = Vec::with_capacity(ids.len());
            for &id in ids {
                let a = self
                    .nodes
                    .get(id as usize)
                    .and_then(|n| n.args.get(i))
                    .ok_or_else(|| RunError::internal("ragged launch: missing input"))?;
                slots.push(match a {
                    Arg::Val(t) => Slot {
                        tensor: t.clone(),
                        at: At::Whole,
                    },
                    Arg::Lazy(r) => self.slot(r)?.clone(),
                });
            }
            let v = match kind {
                RaggedInput::Rows | RaggedInput::PerInstance => RVal::Each(slots),
                RaggedInput::Shared => match slots.into_iter().next() {
                    Some(s) => RVal::Shared(s.value().map_err(fail)?),
                    None => return Err(RunError::internal("ragged launch of no invocations")),
                },
            };
            vals.insert((0, i as u32, 0), v);
        }
        self.profile.time_gather += t0.elapsed();

        let t1 = Instant::now();
        let threads = self.opts.threads + self.lent.map_or(0, Lending::share);
        let mut held: Vec<(tumble_tensor::BufferWatch, u64)> = Vec::new();
        for (seg, plan) in &run.segments {
            let lookup = |v: &tumble_compile::BVal| {
                key_of(v)
                    .and_then(|k| vals.get(&k))
                    .ok_or_else(|| fail("internal: ragged segment input missing".into()))
            };
            let run_seg = |dfg: &mut Self, inputs: &[BV], b: usize| -> Result<Vec<BV>, RunError> {
                let mut octx = OpCtx {
                    rng: &mut dfg.launch_rng,
                };
                match plan {
                    Some(p) => crate::fused::run_planned(
                        &seg.block,
                        p,
                        inputs,
                        b,
                        &mut crate::fused::LaunchCtx::new(
                            &mut octx,
                            &mut dfg.profile.ops,
                            &mut dfg.profile.fused,
                            threads,
                        ),
                    ),
                    None => run_block_with(
                        &seg.block,
                        inputs,
                        b,
                        &mut LaunchOps::new(&mut octx, &mut dfg.profile.ops, threads),
                    ),
                }
                .map_err(fail)
            };
            let mut outs: Vec<RVal> = Vec::with_capacity(seg.defines.len());
            let t_seg = Instant::now();
            if seg.row_wise {
                // Each row an instance of length 1, over chunks of whole invocations of about
                // `chunk_rows` rows (one chunk: every invocation of the launch). With the padding
                // baseline every invocation takes `pad_to` rows: its own, then its last again.
                let chunk_rows = self.ragged_chunk_rows(seg);
                let span = |l: usize| if pad_to > 0 { pad_to } else { l };
                let mut each: Vec<Vec<Slot>> =
                    vec![Vec::with_capacity(ids.len()); seg.defines.len()];
                let mut shared: Vec<Option<Tensor>> = vec![None; seg.defines.len()];
                let mut k0 = 0;
                while k0 < ids.len() {
                    let mut k1 = k0;
                    let mut rows = 0;
                    while k1 < ids.len() && (k1 == k0 || rows + span(lens[k1]) <= chunk_rows) {
                        rows += span(lens[k1]);
                        k1 += 1;
                    }
                    let mut inputs = Vec::with_capacity(seg.reads.len());
                    for r in &seg.reads {
                        inputs.push(match lookup(r)? {
                            RVal::Shared(t) => BV::Shared(OpValue::Tensor(t.clone())),
                            RVal::Each(slots) => {
                                let mut parts = RowRefsBuilder::with_capacity(rows);
                                for k in k0..k1 {
                                    let (s, l) = (&slots[k], lens[k]);
                                    let (view, first) = row_view(s, l).map_err(fail)?;
                                    for j in first..first + l {
                                        parts.push(&view, Some(j));
                                    }
                                    if pad_to > l {
                                        // Padding repeats the invocation's last row.
                                        let (pv, pj) = match l {
                                            0 => row_view(&slots[filler], lens[filler])
                                                .map_err(fail)?,
                                            _ => (view, first + l - 1),
                                        };
                                        for _ in l..pad_to {
                                            parts.push(&pv, Some(pj));
                                        }
                                    }
                                }
                                BV::Rows(parts.finish().ok_or_else(|| {
                                    fail("internal: ragged rows of different shapes".into())
                                })?)
                            }
                        });
                    }
                    let res = run_seg(self, &inputs, rows)?;
                    for (o, r) in res.into_iter().enumerate() {
                        let t = match r {
                            BV::Shared(OpValue::Tensor(t)) => {
                                shared[o] = Some(t);
                                continue;
                            }
                            BV::Batched(OpValue::Tensor(t)) => t,
                            BV::Rows(r) => r.stack().map_err(fail)?,
                            _ => return Err(fail("internal: ragged segment result".into())),
                        };
                        // (rows, 1, row shape...) → (rows, row shape...): each invocation's rows
                        // in place.
                        let t = match t.shape().get(2..).map(<[usize]>::to_vec) {
                            Some(rest) => t
                                .reshape([&[rows][..], &rest].concat())
                                .map_err(|e| fail(format!("internal: {e}")))?,
                            None => {
                                return Err(fail("internal: ragged segment result rank".into()))
                            }
                        };
                        held.push((t.watch(), (t.len() * t.dtype().size()) as u64));
                        let mut start = 0;
                        for &l in &lens[k0..k1] {
                            each[o].push(Slot {
                                tensor: t.clone(),
                                at: At::Rows {
                                    start: start as u32,
                                    len: l as u32,
                                },
                            });
                            start += span(l);
                        }
                    }
                    k0 = k1;
                }
                for (o, slots) in each.into_iter().enumerate() {
                    outs.push(match shared.get_mut(o).and_then(Option::take) {
                        Some(t) => RVal::Shared(t),
                        None if slots.len() == ids.len() => RVal::Each(slots),
                        None => return Err(fail("internal: ragged chunk results missing".into())),
                    });
                }
            } else if let Some(rows) = match &seg.kernel {
                Some(MixingKernel::RowSlice { input }) if self.opts.mixing_kernels => {
                    match seg.reads.get(*input as usize).map(lookup).transpose()? {
                        Some(RVal::Each(slots)) => row_slices(slots, &seg.block),
                        _ => None,
                    }
                }
                _ => None,
            } {
                // Whole rows of each invocation's input: ranges of its rows where they lie.
                outs.push(RVal::Each(rows));
                self.profile.ragged_row_slices += 1;
            } else if let Some((results, query)) = match &seg.kernel {
                Some(MixingKernel::Gather(plan)) if self.opts.mixing_kernels => {
                    let inputs: Vec<&RVal> =
                        seg.reads.iter().map(lookup).collect::<Result<_, _>>()?;
                    gather_rows(&seg.block, plan, &inputs, ids.len()).map(|r| (r, false))
                }
                Some(MixingKernel::Query(q)) if self.opts.mixing_kernels => {
                    let inputs: Vec<&RVal> =
                        seg.reads.iter().map(lookup).collect::<Result<_, _>>()?;
                    query_rows(&seg.block, q, &inputs, ids.len()).map(|t| (vec![t], true))
                }
                _ => None,
            } {
                // Rows of every invocation's table, or a query against them, read where they
                // lie: one batched result per output, a row each.
                for t in results {
                    held.push((t.watch(), (t.len() * t.dtype().size()) as u64));
                    let batched = BV::Batched(OpValue::Tensor(t));
                    let slots = (0..ids.len())
                        .map(|k| super::launch::slot_of(&batched, k))
                        .collect::<Result<Vec<_>, _>>()?;
                    outs.push(RVal::Each(slots));
                }
                match query {
                    true => self.profile.ragged_queries += 1,
                    false => self.profile.ragged_gathers += 1,
                }
            } else if let Some((att, parts)) = match seg.kernel.as_ref() {
                Some(&MixingKernel::Attention(att)) if self.opts.mixing_kernels => {
                    let each = |i: u32| match seg.reads.get(i as usize).map(lookup) {
                        Some(Ok(RVal::Each(slots))) if slots.len() == ids.len() => Some(slots),
                        _ => None,
                    };
                    match (each(att.q), each(att.k), each(att.v)) {
                        (Some(q), Some(k), Some(v)) => {
                            attention_operands([q, k, v], &lens, att).map(|p| (att, p))
                        }
                        _ => None,
                    }
                }
                _ => None,
            } {
                // Attention: one kernel over every invocation's rows where they lie.
                let row = att.heads * att.width;
                // Every element is written: each instance's rows, every head and column.
                let mut out = tumble_tensor::pool::scratch_f32(total * row);
                crate::fused::attention::attend_all(
                    &lens,
                    &parts,
                    &mut out,
                    (att.heads, att.width, att.scale),
                    threads,
                )
                .map_err(fail)?;
                drop(parts);
                let t = Tensor::from_vec(vec![total, att.heads, att.width], out)
                    .map_err(|e| fail(format!("internal: {e}")))?;
                held.push((t.watch(), (t.len() * t.dtype().size()) as u64));
                let mut slots = Vec::with_capacity(ids.len());
                let mut start = 0;
                for &l in &lens {
                    slots.push(Slot {
                        tensor: t.clone(),
                        at: At::Rows {
                            start: start as u32,
                            len: l as u32,
                        },
                    });
                    start += l;
                }
                outs.push(RVal::Each(slots));
                self.profile.ragged_attention += 1;
            } else {
                // Once per group of invocations whose inputs here have equal shapes, a batch of
                // whole invocations.
                let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
                for k in 0..ids.len() {
                    let mut shapes = Vec::new();
                    for r in &seg.reads {
                        if let RVal::Each(slots) = lookup(r)? {
                            let s = slots
                                .get(k)
                                .ok_or_else(|| fail("internal: ragged slot".into()))?;
                            shapes.extend(slot_shape(s));
                            shapes.push(usize::MAX);
                        }
                    }
                    match groups.iter_mut().find(|(sh, _)| *sh == shapes) {
                        Some((_, g)) => g.push(k),
                        None => groups.push((shapes, vec![k])),
                    }
                }
                let mut each: Vec<Vec<Option<Slot>>> =
                    vec![vec![None; ids.len()]; seg.defines.len()];
                let mut shared: Vec<Option<Tensor>> = vec![None; seg.defines.len()];
                for (_, members) in &groups {
                    let mut inputs = Vec::with_capacity(seg.reads.len());
                    for r in &seg.reads {
                        inputs.push(match lookup(r)? {
                            RVal::Shared(t) => BV::Shared(OpValue::Tensor(t.clone())),
                            RVal::Each(slots) => {
                                let mut parts = RowRefsBuilder::with_capacity(members.len());
                                for &k in members {
                                    let s = slots
                                        .get(k)
                                        .ok_or_else(|| fail("internal: ragged slot".into()))?;
                                    match s.at {
                                        At::Whole => parts.push(&s.tensor, None),
                                        At::Row(r) => parts.push(&s.tensor, Some(r as usize)),
                                        At::Rows { .. } => {
                                            parts.push(&s.value().map_err(fail)?, None)
                                        }
                                    }
                                }
                                BV::Rows(parts.finish().ok_or_else(|| {
                                    fail("internal: a length group of different shapes".into())
                                })?)
                            }
                        });
                    }
                    let res = run_seg(self, &inputs, members.len())?;
                    self.profile.ragged_groups += 1;
                    for (o, r) in res.into_iter().enumerate() {
                        match r {
                            BV::Shared(OpValue::Tensor(t)) => {
                                if let Some(s) = shared.get_mut(o) {
                                    *s = Some(t);
                                }
                            }
                            other => {
                                if let BV::Batched(OpValue::Tensor(t)) = &other {
                                    held.push((t.watch(), (t.len() * t.dtype().size()) as u64));
                                }
                                for (row, &k) in members.iter().enumerate() {
                                    each[o][k] = Some(super::launch::slot_of(&other, row)?);
                                }
                            }
                        }
                    }
                }
                for (o, slots) in each.into_iter().enumerate() {
                    outs.push(match shared.get_mut(o).and_then(Option::take) {
                        Some(t) => RVal::Shared(t),
                        None => {
                            RVal::Each(slots.into_iter().collect::<Option<Vec<_>>>().ok_or_else(
                                || fail("internal: ragged group result missing".into()),
                            )?)
                        }
                    });
                }
            }
            if !seg.row_wise {
                self.profile.time_ragged_mixing += t_seg.elapsed();
            }
            for (d, v) in seg.defines.iter().zip(outs) {
                if let Some(k) = key_of(d) {
                    vals.insert(k, v);
                }
            }
        }
        let kernel_time = t1.elapsed();

        // Each invocation's outputs.
        let mut per_node: Vec<Vec<Slot>> = vec![Vec::with_capacity(block.outputs.len()); ids.len()];
        for o in &block.outputs {
            let v = match o {
                tumble_compile::BVal::Const(t) => RVal::Shared(t.clone()),
                other => match key_of(other).and_then(|k| vals.remove(&k)) {
                    Some(v) => v,
                    None => return Err(fail("internal: ragged block output missing".into())),
                },
            };
            match &v {
                RVal::Shared(t) => {
                    for slots in &mut per_node {
                        slots.push(Slot {
                            tensor: t.clone(),
                            at: At::Whole,
                        });
                    }
                }
                RVal::Each(each) => {
                    for (slots, s) in per_node.iter_mut().zip(each) {
                        slots.push(s.clone());
                    }
                }
            }
            // An output read twice (the same value returned twice) is still there for the next.
            if let Some(k) = key_of(o) {
                vals.insert(k, v);
            }
        }
        // The launch's inputs and intermediates: the producers they reference may be released.
        drop(vals);
        self.store_outputs(ids, per_node.into_iter().map(Outs::from_vec));

        self.profile
            .record_launch(&block.name, ids.len(), kernel_time);
        self.profile.ragged_launches += 1;
        self.profile.ragged_rows += total as u64;
        self.profile.ragged_padding_rows += (pad_to * ids.len()).saturating_sub(total) as u64;
        let held_bytes: u64 = held.iter().map(|(_, b)| b).sum();
        self.profile.ragged_peak_bytes = self.profile.ragged_peak_bytes.max(held_bytes);
        for (watch, bytes) in held {
            self.produced_watched(watch, bytes);
        }
        Ok(())
    }

    /// Rows per chunk of a row-wise segment: [`RAGGED_CHUNK_BYTES`] of its results, and at
    /// least [`RAGGED_CHUNK_MIN_ROWS`] (GEMMs of fewer rows lose speed).
    /// `Options::ragged_chunk_rows` overrides it.
    fn ragged_chunk_rows(&self, seg: &tumble_compile::ragged::Segment) -> usize {
        match self.opts.ragged_chunk_rows {
            0 => (RAGGED_CHUNK_BYTES / seg.bytes_per_row.max(1)).max(RAGGED_CHUNK_MIN_ROWS),
            n => n,
        }
    }
}
