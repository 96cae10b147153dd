//! The recorded forward of training: a launch evaluated operator by operator with every value the
//! backward differentiates kept ([`Kept`]: the launch's inputs, each operator's operands and
//! result), instead of the fused plans of an inference run.
//!
//! Each kept value is written once by the forward and read back by the backward from beyond the
//! caches (TreeLSTM training keeps ~24 MiB a mini-batch), so what costs is bytes, not
//! instructions. Two fusions write fewer of them where no vjp reads a value:
//! - a product's bias added in its GEMM epilogue ([`bias_epilogues`]; `nn.bias_add`, or a vector
//!   added with `add`): `nn.dense`'s vjp reads its operands and the addition's only shapes, so
//!   the product itself is never written — nor the
//!   sum, when one `sigmoid`, `tanh`, `exp` or `negative` reads it (a gate) and the f32 vjps,
//!   which read that operator's result, differentiate the launch: the epilogue applies it too;
//! - a `split` whose every part feeds one `sigmoid`, `tanh`, `exp` or `negative`
//!   ([`split_unaries`]): each part's operator reads its columns of the split's operand in place,
//!   so the parts are never copied out — with the f32 vjps only, which read those operators'
//!   results (the reference rules read their operands).
//!
//! Both give the same bits as the operators apart; `TUMBLE_NO_KEPT_FUSION=1` turns them off.

use tumble_compile::{BArg, BVal, Block, BlockNode};
use tumble_ir::Ty;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

use crate::backward::fast::{unary_into, RESULT_ONLY_VJP_UNARIES};
use crate::batched::{batched_op, lookup, operands, LaunchOps, BV};
use crate::{fastmath, simd};

/// A launch evaluated operator by operator with every value kept: what the backward pass
/// differentiates (the launch's inputs, each operator's operands and result).
pub(crate) struct Kept {
    pub inputs: Vec<BV>,
    pub results: Vec<BV>,
    pub args: Vec<Vec<BV>>,
}

impl Kept {
    /// The block's outputs.
    pub fn outputs(&self, block: &Block) -> Result<Vec<BV>, String> {
        block
            .outputs
            .iter()
            .map(|v| lookup(v, &self.inputs, &self.results))
            .collect()
    }
}

/// How a forward recorded for a backward runs its launches: `eval`, the fast paths tried before
/// each reference kernel, and whether the backward takes the f32 vjps (`GradOptions::fast`),
/// which read a unary operator's result only — not its operand.
#[derive(Clone, Copy)]
pub(crate) struct KeptMode {
    pub eval: crate::batched::FastEval,
    pub fast_vjps: bool,
}

/// Runs `block` for `b` invocations like [`crate::batched::run_block`], keeping everything
/// ([`Kept`]), computing together what `fusions` says (the block's for the backward's vjps,
/// [`BlockFusions::for_vjps`]; `None`, or `TUMBLE_NO_KEPT_FUSION=1`: every operator alone).
pub(crate) fn run_block_kept(
    block: &Block,
    inputs: Vec<BV>,
    b: usize,
    ops: &mut LaunchOps,
    memo: Option<&mut SharedMemo>,
    fusions: Option<&Fusions>,
) -> Result<Kept, String> {
    let none = Fusions::default();
    let fusions = fusions.filter(|_| kept_fusion_enabled()).unwrap_or(&none);
    run_kept(block, inputs, b, ops, memo, fusions)
}

/// A block's [`Fusions`] for each kind of vjp, found once per job (`Executable::kept_fusions`).
pub(crate) struct BlockFusions {
    fast: Fusions,
    reference: Fusions,
}

impl BlockFusions {
    pub(crate) fn of(block: &Block) -> BlockFusions {
        let fast = Fusions::of(block, true);
        BlockFusions {
            reference: fast.for_reference_vjps(),
            fast,
        }
    }

    /// The fusions for a backward with the f32 vjps (`fast_vjps`, [`KeptMode::fast_vjps`]) or
    /// the reference rules.
    pub(crate) fn for_vjps(&self, fast_vjps: bool) -> &Fusions {
        match fast_vjps {
            true => &self.fast,
            false => &self.reference,
        }
    }
}

/// What a kept launch of a block computes together (node indices).
#[derive(Default, Debug, PartialEq)]
pub(crate) struct Fusions {
    /// Products whose bias their one reader adds ([`bias_epilogues`]).
    biased: Vec<Biased>,
    /// Splits whose parts' unary operators read them in place ([`split_unaries`]).
    split_unaries: Vec<SplitUnaries>,
}

impl Fusions {
    /// `block`'s fusions, with `fast_vjps` those the f32 vjps allow too.
    pub(crate) fn of(block: &Block, fast_vjps: bool) -> Fusions {
        Fusions {
            biased: bias_epilogues(block, fast_vjps),
            split_unaries: match fast_vjps {
                true => split_unaries(block),
                false => Vec::new(),
            },
        }
    }

    /// The splits whose parts' unary operators read them in place: the backward runs those
    /// operators' vjps with the split's (`backward::split_vjp_fusions`).
    pub(crate) fn split_unaries(&self) -> &[SplitUnaries] {
        &self.split_unaries
    }

    /// These fusions less those whose kept operands only the f32 vjps can read (an activation in
    /// an epilogue, a split's parts): what `Fusions::of(block, false)` finds.
    fn for_reference_vjps(&self) -> Fusions {
        Fusions {
            biased: self
                .biased
                .iter()
                .map(|bd| Biased {
                    activation: None,
                    ..*bd
                })
                .collect(),
            split_unaries: Vec::new(),
        }
    }
}

/// A product whose bias its one reader adds, and the one node reading that sum when it is a unary
/// operator of [`RESULT_ONLY_VJP_UNARIES`] the epilogue applies too.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Biased {
    product: usize,
    /// The product's one reader: an `nn.bias_add` of it, or an `add` of it and a vector.
    bias: usize,
    activation: Option<usize>,
}

/// A `split` node and, per part, the one node reading it: a unary operator.
#[derive(Debug, PartialEq)]
pub(crate) struct SplitUnaries {
    pub(crate) split: usize,
    pub(crate) readers: Vec<usize>,
}

/// How `su`'s split cuts its operand `x` (batched f32 rows, split along the instance's last
/// axis): the rows, the operand's row length and each part's width; `None` for any other split.
pub(crate) fn split_layout(
    block: &Block,
    su: &SplitUnaries,
    x: &Tensor,
) -> Option<(usize, usize, Vec<usize>)> {
    let split = block.nodes.get(su.split)?;
    let axis = last_axis(x, split.attrs.int("axis").ok()?.unwrap_or(0))?;
    let d = *x.shape().get(axis)?;
    let sizes = crate::fastops::split_sizes(&split.attrs, d)?;
    if sizes.len() != su.readers.len() || d == 0 {
        return None;
    }
    Some((x.as_f32()?.len() / d, d, sizes))
}

fn run_kept(
    block: &Block,
    inputs: Vec<BV>,
    b: usize,
    ops: &mut LaunchOps,
    mut memo: Option<&mut SharedMemo>,
    fusions: &Fusions,
) -> Result<Kept, String> {
    let n = block.nodes.len();
    let mut results: Vec<BV> = Vec::with_capacity(n);
    let mut kept_args: Vec<Vec<BV>> = Vec::with_capacity(n);
    // Results computed ahead by a fusion, for the nodes that come later.
    let mut ahead: Vec<Option<BV>> = Vec::new();
    for (i, node) in block.nodes.iter().enumerate() {
        let args = operands(node, &inputs, &results, b)?;
        if let Some(r) = ahead.get_mut(i).and_then(Option::take) {
            ops.stats.batched += 1;
            ops.stats.kept_fused += 1;
            kept_args.push(args);
            results.push(r);
            continue;
        }
        if let Some(r) = fused(block, i, &args, &inputs, &results, fusions, &mut ahead) {
            ops.stats.batched += 1;
            kept_args.push(args);
            results.push(r);
            continue;
        }
        let key = memo.as_ref().and_then(|_| SharedMemo::key(node, &args));
        let known = match (&memo, &key) {
            (Some(m), Some((k, _))) => m.0.get(k).map(|(_, v)| v.clone()),
            _ => None,
        };
        let r = match known {
            Some(v) => v,
            None => {
                let r = batched_op(node.op, &node.attrs, args.clone(), b, ops)?;
                if let (Some(m), Some((k, sources))) = (memo.as_deref_mut(), key) {
                    m.0.insert(k, (sources, r.clone()));
                }
                r
            }
        };
        kept_args.push(args);
        results.push(r);
    }
    Ok(Kept {
        inputs,
        results,
        args: kept_args,
    })
}

/// Node `i`'s result when a fusion computes it (with the results of the later nodes it
/// computes too, in `ahead`); `None`: node `i` runs alone.
fn fused(
    block: &Block,
    i: usize,
    args: &[BV],
    inputs: &[BV],
    results: &[BV],
    fusions: &Fusions,
    ahead: &mut Vec<Option<BV>>,
) -> Option<BV> {
    let mut later = |j: usize, r: BV| {
        if ahead.len() <= j {
            ahead.resize(j + 1, None);
        }
        ahead[j] = Some(r);
    };
    if let Some(bd) = fusions.biased.iter().find(|bd| bd.product == i) {
        let r = dense_with_bias(block, bd, args, inputs, results)?;
        later(bd.bias, r.clone());
        // The activation's operand and result: its f32 vjp reads the result only, and no other
        // node reads the sum.
        if let Some(j) = bd.activation {
            later(j, r.clone());
        }
        return Some(r);
    }
    let su = fusions.split_unaries.iter().find(|s| s.split == i)?;
    let parts = split_unary_parts(block, su, args)?;
    for (&reader, part) in su.readers.iter().zip(&parts) {
        later(reader, BV::Batched(OpValue::Tensor(part.clone())));
    }
    // The split's own result: the parts' shapes are all the backward reads of it (`split`'s vjp
    // concatenates its parts' gradients), and its readers' operands are their results, which the
    // f32 vjps of these operators read instead.
    Some(BV::Batched(OpValue::Tuple(parts)))
}

/// Whether the kept forward fuses ([`Fusions`]); `TUMBLE_NO_KEPT_FUSION=1` runs every operator
/// alone (the same bits).
fn kept_fusion_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_KEPT_FUSION")
}

/// Whether `v` reads node `j` (whole or a field).
fn reads(j: usize, v: &BVal) -> bool {
    matches!(v, BVal::Node(n) | BVal::Field(n, _) if *n as usize == j)
}

fn arg_reads(j: usize, a: &BArg) -> bool {
    match a {
        BArg::One(v) => reads(j, v),
        BArg::Tuple(vs) => vs.iter().any(|v| reads(j, v)),
    }
}

/// How many operands of `block`'s nodes read node `j`, and whether an output returns it.
fn readers_of(block: &Block, j: usize) -> (usize, bool) {
    let operands = block
        .nodes
        .iter()
        .map(|n| n.args.iter().filter(|a| arg_reads(j, a)).count())
        .sum();
    (operands, block.outputs.iter().any(|v| reads(j, v)))
}

/// The nodes of `block` that are an `nn.dense` read only by one node adding a bias to it — an
/// `nn.bias_add`, or an `add` of it and another value (a plainly written `dense(x, W) + b`; the
/// value is checked to be a vector along the rows at run time) — neither returned by an output:
/// the kept forward adds the bias in the product's epilogue and keeps the sum as both nodes'
/// result. The product's own value is then never written — no vjp reads it: `nn.dense`'s reads
/// its operands, `nn.bias_add`'s and `add`'s only shapes — one pass over the launch's widest rows
/// (TreeLSTM's 768 gate columns) and its buffer fewer. With `fast_vjps`, a `sigmoid`, `tanh`,
/// `exp` or `negative` that is the sum's one reader (a gate) is applied in the epilogue too, and
/// its result kept for all three nodes: its f32 vjp reads its result only, so neither the
/// product nor the sum is written.
fn bias_epilogues(block: &Block, fast_vjps: bool) -> Vec<Biased> {
    let one_reader = |j: usize| -> Option<usize> {
        if readers_of(block, j) != (1, false) {
            return None;
        }
        let reads_j = |n: &BlockNode| n.args.iter().any(|a| arg_reads(j, a));
        block.nodes.iter().position(reads_j)
    };
    let is = |j: usize, v: &BArg| matches!(v, BArg::One(BVal::Node(n)) if *n as usize == j);
    let mut found = Vec::new();
    for (i, dense) in block.nodes.iter().enumerate() {
        if dense.op.name != "nn.dense" || !dense.attrs.0.is_empty() {
            continue;
        }
        let Some(bias) = one_reader(i) else { continue };
        let Some(adds) = block.nodes.get(bias) else {
            continue;
        };
        let adds_a_bias = match (adds.op.name, adds.args.as_slice()) {
            ("nn.bias_add", [x, b]) => is(i, x) && !arg_reads(i, b),
            ("add", [x, y]) => (is(i, x) && !arg_reads(i, y)) || (is(i, y) && !arg_reads(i, x)),
            _ => false,
        };
        if !adds_a_bias {
            continue;
        }
        let activation = one_reader(bias).filter(|&j| {
            block.nodes.get(j).is_some_and(|n| {
                fast_vjps
                    && RESULT_ONLY_VJP_UNARIES.contains(&n.op.name)
                    && matches!(n.args.as_slice(), [a] if is(bias, a))
            })
        });
        found.push(Biased {
            product: i,
            bias,
            activation,
        });
    }
    found
}

/// A [`bias_epilogues`] product, the node adding its bias and its activation as one product with
/// the bias and the activation in its epilogue, on the f32 kernel: the launch's rows times a
/// shared weight plus a shared vector along the rows (`nn.bias_add` on the last axis, or an `add`
/// of `N` values broadcast along it); `None` (each computed alone) otherwise. The additions and
/// the activation are the operators' own on the same vector loops (`backward::fast::eval`'s;
/// `c + b` and `b + c` are the same sum), so the same bits.
fn dense_with_bias(
    block: &Block,
    bd: &Biased,
    args: &[BV],
    inputs: &[BV],
    results: &[BV],
) -> Option<BV> {
    let adds = block.nodes.get(bd.bias)?;
    let (Some(BV::Batched(OpValue::Tensor(x))), Some(BV::Shared(OpValue::Tensor(w)))) =
        (args.first(), args.get(1))
    else {
        return None;
    };
    let &[n, _] = w.shape() else { return None };
    let bias_at = adds.args.iter().find_map(|a| match a {
        BArg::One(v) if !reads(bd.product, v) => Some(v),
        _ => None,
    })?;
    let BV::Shared(OpValue::Tensor(bias)) = lookup(bias_at, inputs, results).ok()? else {
        return None;
    };
    let b = bias.as_f32()?;
    let along_rows = match adds.op.name {
        "nn.bias_add" => {
            last_axis(x, adds.attrs.int("axis").ok()?.unwrap_or(1)).is_some() && bias.rank() == 1
        }
        // Broadcast against one instance's rows (rank `x.rank() - 1`): `(N)`, `(1, N)`, ...
        _ => {
            bias.rank() < x.rank()
                && bias
                    .shape()
                    .split_last()
                    .is_some_and(|(&last, rest)| last == n && rest.iter().all(|&d| d == 1))
        }
    };
    if !along_rows || b.len() != n {
        return None;
    }
    let activation = match bd.activation {
        Some(j) => Some(block.nodes.get(j)?.op.name),
        None => None,
    };
    let add = |row: &mut [f32]| simd::update(row, b, |c, b| c + b);
    let sigmoid = |row: &mut [f32]| simd::update(row, b, |c, b| fastmath::sigmoid(c + b));
    let tanh = |row: &mut [f32]| simd::update(row, b, |c, b| fastmath::tanh(c + b));
    let exp = |row: &mut [f32]| simd::update(row, b, |c, b| fastmath::exp(c + b));
    let negative = |row: &mut [f32]| simd::update(row, b, |c, b| -(c + b));
    let epilogue: &crate::fastops::RowFn<'_> = match activation {
        None => &add,
        Some("sigmoid") => &sigmoid,
        Some("tanh") => &tanh,
        Some("exp") => &exp,
        Some("negative") => &negative,
        Some(_) => return None,
    };
    crate::fastops::dense_f32(x, w, Some(epilogue)).map(|t| BV::Batched(OpValue::Tensor(t)))
}

/// The batched tensor `x`'s last axis when `axis` (of one instance, negative from the end) is
/// the instance's last; `None` otherwise.
fn last_axis(x: &Tensor, axis: i64) -> Option<usize> {
    // The batched rows carry one more axis, in front.
    let rank = i64::try_from(x.rank()).ok()? - 1;
    let axis = if axis < 0 { axis + rank } else { axis };
    (rank > 0 && axis == rank - 1).then(|| x.rank() - 1)
}

/// The `split` nodes of `block` each of whose parts is read by exactly one node, a unary operator
/// of [`RESULT_ONLY_VJP_UNARIES`] (an LSTM cell's gates after their product), and which no output
/// returns: the kept forward computes each part's operator on its columns of the split's operand
/// where they lie, and keeps the results only.
fn split_unaries(block: &Block) -> Vec<SplitUnaries> {
    let mut found = Vec::new();
    for (s, node) in block.nodes.iter().enumerate() {
        if node.op.name != "split" {
            continue;
        }
        let parts = match &node.ty {
            Ty::Tuple(fields) => fields.len(),
            _ => continue,
        };
        let mut readers = vec![None; parts];
        let mut ok = !readers_of(block, s).1;
        for (r, reader) in block.nodes.iter().enumerate() {
            for a in &reader.args {
                if !arg_reads(s, a) {
                    continue;
                }
                let field = match a {
                    BArg::One(BVal::Field(_, f)) => Some(*f as usize),
                    _ => None,
                };
                match field.and_then(|f| readers.get_mut(f)) {
                    Some(slot @ None)
                        if RESULT_ONLY_VJP_UNARIES.contains(&reader.op.name)
                            && reader.args.len() == 1 =>
                    {
                        *slot = Some(r)
                    }
                    _ => ok = false,
                }
            }
        }
        if let (true, Some(readers)) = (ok, readers.into_iter().collect::<Option<Vec<_>>>()) {
            found.push(SplitUnaries { split: s, readers });
        }
    }
    found
}

/// The results of `su`'s readers, each computed on its part of the split's operand (`args[0]`,
/// split along the instance's last axis), as the operators apart compute them; `None` where the
/// split is not one of f32 rows along its last axis.
fn split_unary_parts(block: &Block, su: &SplitUnaries, args: &[BV]) -> Option<Vec<Tensor>> {
    let Some(BV::Batched(OpValue::Tensor(x))) = args.first() else {
        return None;
    };
    let data = x.as_f32()?;
    let (rows, d, sizes) = split_layout(block, su, x)?;
    let axis = x.rank() - 1;
    let mut parts = Vec::with_capacity(sizes.len());
    let mut begin = 0;
    for (&len, &reader) in sizes.iter().zip(&su.readers) {
        let op = block.nodes.get(reader)?.op.name;
        let mut out = tumble_tensor::pool::scratch_f32(rows * len);
        if len > 0 {
            for (o, row) in out.chunks_exact_mut(len).zip(data.chunks_exact(d)) {
                unary_into(op, o, row.get(begin..begin + len)?)?;
            }
        }
        let mut shape = x.shape().to_vec();
        *shape.get_mut(axis)? = len;
        parts.push(Tensor::from_vec(shape, out).ok()?);
        begin += len;
    }
    Some(parts)
}

/// Values of pure operators on shared operands only (a hoisting split's columns of a weight,
/// `strided_slice(%W)`), kept for a graph by node and operand buffers: every launch of the block
/// reads the same tensor, which its products pack once and the backward keeps once, where a
/// copy per launch was a weight-sized value kept and packed per launch.
#[derive(Default)]
pub(crate) struct SharedMemo(std::collections::HashMap<Vec<u64>, (Vec<Tensor>, BV)>);

impl SharedMemo {
    /// The key of `node` on `args` (with the operand tensors, held so that no other tensor
    /// takes their addresses), or `None` unless it is pure and every operand a shared tensor.
    fn key(node: &BlockNode, args: &[BV]) -> Option<(Vec<u64>, Vec<Tensor>)> {
        // (Checked before anything is allocated: called per node of every kept launch.)
        if !tumble_compile::blocks::is_pure_op(node.op)
            || args.is_empty()
            || !args
                .iter()
                .all(|a| matches!(a, BV::Shared(OpValue::Tensor(_))))
        {
            return None;
        }
        let mut key = vec![std::ptr::from_ref(node) as u64];
        let mut sources = Vec::with_capacity(args.len());
        for a in args {
            let BV::Shared(OpValue::Tensor(t)) = a else {
                return None;
            };
            key.push(t.buffer_id() as u64);
            key.push(t.shape().len() as u64);
            key.extend(t.shape().iter().map(|&d| d as u64));
            sources.push(t.clone());
        }
        Some((key, sources))
    }
}

#[cfg(test)]
mod tests;
