//! Ragged batching (dynamic shapes): which blocks can run instances of different `?` lengths in
//! one launch, and how.
//!
//! A block whose inputs have an unknown leading dimension (`Tensor[(?, 768), float32]`: the tokens
//! of a sentence) is, for most of its operators, a function of each row alone: a dense layer, a
//! bias, an activation, a layer norm over the last axis. Such operators give the same rows whether
//! they run on one instance's rows or on the rows of every instance of a launch concatenated, so
//! instances of any lengths can share one GEMM over all their tokens, without padding. Operators
//! that mix the rows of one instance (attention's batched products, a softmax or a sum over the
//! sequence axis) cannot; they run once per group of instances of equal length.
//!
//! The analysis follows a symbolic shape per value (BladeDISC's shape constraints in their
//! simplest form): every input's leading `?` is the same unknown length `L` — the runtime checks
//! that, per invocation, before it groups invocations this way —, known dims stay known, and
//! operators carry `L` through where it provably stays the row count (transposes, reshapes with
//! `-1`, batched products), so rows mixed by attention come back as rows of length `L`. Each
//! operator is then one of:
//! - *fixed*: reads nothing that differs between the instances of a launch (weights, literals);
//! - *row-wise*: varying operands have `L` as their leading dim and nowhere else, and the
//!   operator keeps axis 0 a row index (`tumble_ops::StageRule` row-wise rules on other axes,
//!   `nn.dense`, `take` from a table, reshapes and transposes that leave axis 0 alone);
//! - *mixing*: anything else that reads a varying value.
//!
//! The block's operators are assigned to the fewest alternating segments (row-wise, mixing,
//! row-wise, ...) that keep dependencies in order — fixed operators join their latest producer's
//! segment —, and each segment becomes a block of its own for the kernel planner
//! ([`crate::plan`]). A block with no row-wise work is not ragged: grouping by exact shapes does
//! as well.

use std::collections::HashMap;
use std::fmt;

use tumble_ir::{Dim, Ty};
use tumble_ops::StageRule;

use crate::blocks::{same_value, BArg, BVal, Block, BlockInput, BlockNode, OutputShape};

/// How a block runs a launch of instances of different lengths.
#[derive(Debug, Clone)]
pub struct RaggedBlock {
    /// Per block input: what it is in a ragged launch.
    pub inputs: Vec<RaggedInput>,
    /// The block's operators in dependency order, cut where they alternate between row-wise and
    /// mixing work.
    pub segments: Vec<Segment>,
    /// Bytes of every node's result per row of `L` (unknown dims counted as 1): a launch of `N`
    /// rows in all reserves about `N` times this before it allocates.
    pub bytes_per_row: usize,
    /// Per block input: a row input that only [`MixingKernel::Gather`] segments read (a node's
    /// neighbour list beside its graph's states: two lengths), so its length need not be the
    /// invocation's `L` — invocations whose lengths differ there still launch together.
    pub free_length: Vec<bool>,
}

/// A block input in a ragged launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RaggedInput {
    /// Its leading dim is the instance's length `L`: rows.
    Rows,
    /// Differs per instance, but not in shape (a threshold, a counter).
    PerInstance,
    /// The same tensor for every instance of the launch (a weight).
    Shared,
}

/// A run of a block's operators, as a block of its own.
#[derive(Debug, Clone)]
pub struct Segment {
    /// True: runs once over the concatenated rows of every instance of the launch. False: runs
    /// once per group of instances whose inputs to it have equal shapes (of equal length for
    /// mixing work, all of them for work on values of static shape).
    pub row_wise: bool,
    pub block: Block,
    /// Per input of `block`: the value of the parent block it reads (an input, or a node or
    /// field an earlier segment defines).
    pub reads: Vec<BVal>,
    /// Per output of `block`: the value of the parent block it is (a node or a field).
    pub defines: Vec<BVal>,
    /// Per output: its symbolic shape per instance.
    pub shapes: Vec<Vec<SymDim>>,
    /// Bytes of every node's result per row of `L` (unknown dims counted as 1).
    pub bytes_per_row: usize,
    /// A mixing segment an executor may run over every instance's rows where they lie, whatever
    /// their lengths, instead of once per group of equal length.
    pub kernel: Option<MixingKernel>,
}

/// Mixing work with a form that needs no grouping by length ([`Segment::kernel`]).
#[derive(Debug, Clone, PartialEq)]
pub enum MixingKernel {
    /// Scaled dot-product attention ([`crate::attention`]).
    Attention(crate::attention::Attention),
    /// A `strided_slice` of whole rows of block input `input` (a sequence's first token): each
    /// instance's result is a range of its rows ([`tumble_ops::leading_rows`]), taken where
    /// they lie.
    RowSlice { input: u32 },
    /// Rows of a per-instance table (`take(%M, %i, axis=0)` of an instance's memory or node
    /// states), each alone or summed over the rows taken (`sum(take(%S, %neighbours), axis=[0])`:
    /// a node's messages): each instance's rows are read where its table lies — no table
    /// stacked per group of equal lengths — into results of static shape; one [`Gathered`] per
    /// output of the segment.
    Gather(Vec<Gathered>),
    /// A query against each instance's rows: attention's weighted rows, or the best row's index
    /// ([`crate::query`]).
    Query(crate::query::Query),
}

impl MixingKernel {
    /// The form of a mixing segment's block, if it has one of these.
    pub fn find(block: &Block) -> Option<MixingKernel> {
        if let Some(a) = crate::attention::find(block) {
            return Some(MixingKernel::Attention(a));
        }
        if let Some(g) = gather(block) {
            return Some(MixingKernel::Gather(g));
        }
        if let Some(q) = crate::query::find(block) {
            return Some(MixingKernel::Query(q));
        }
        let ([node], [BVal::Node(0)]) = (block.nodes.as_slice(), block.outputs.as_slice()) else {
            return None;
        };
        let [BArg::One(BVal::Input(input))] = node.args.as_slice() else {
            return None;
        };
        if node.op.name != "strided_slice" {
            return None;
        }
        // Whole rows whatever the length: the inner axes (known) kept whole for a long input.
        let (dims, _) = block.inputs.get(*input as usize)?.ty.as_tensor()?;
        let mut shape = vec![1usize << 20];
        for d in dims.get(1..)? {
            shape.push(usize::try_from(d.known()?).ok()?);
        }
        tumble_ops::leading_rows(&node.attrs, &shape)?;
        Some(MixingKernel::RowSlice { input: *input })
    }
}

/// One output of a [`MixingKernel::Gather`] segment: the rows of block input `table` that block
/// input `index` selects (every row, in order, without one), alone or reduced over them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gathered {
    pub table: u32,
    pub index: Option<u32>,
    /// `None`: the rows themselves; else their sum, mean, maximum or minimum.
    pub reduce: Option<RowReduce>,
}

/// How a [`Gathered`] output reduces the rows it gathers (over axis 0, as the reference does:
/// in f64, in index order) — the runtime's fast reductions fold by the same four
/// (`fastops::fold_columns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowReduce {
    Sum,
    Mean,
    Max,
    Min,
}

/// `block`'s [`MixingKernel::Gather`] form: every node an f32 `take` along axis 0 in clip mode
/// of two block inputs ([`tumble_ops::takes_rows`]), or a `sum` or `mean` over axis 0 of such a
/// take that nothing else reads; every output a node of static shape. (Whether the table is a
/// per-instance value the executor sees per launch.)
pub fn gather(block: &Block) -> Option<Vec<Gathered>> {
    let take = |k: usize| -> Option<(u32, u32)> {
        let n = block.nodes.get(k)?;
        let f32s = matches!(n.ty.as_tensor(), Some((_, tumble_ir::DType::Float32)));
        match n.args.as_slice() {
            [BArg::One(BVal::Input(t)), BArg::One(BVal::Input(i))]
                if n.op.name == "take" && tumble_ops::takes_rows(&n.attrs) && f32s =>
            {
                Some((*t, *i))
            }
            _ => None,
        }
    };
    let readers = |k: usize| {
        let in_nodes = block
            .nodes
            .iter()
            .flat_map(|n| n.args.iter().flat_map(BArg::values))
            .filter(|v| v.node() == Some(k))
            .count();
        in_nodes + block.outputs.iter().filter(|v| v.node() == Some(k)).count()
    };
    // A node as a gather: a take, a sum or mean of a take only it reads, or a reduction of
    // every row of an f32 block input (a set's mean pooling, the maximum a convergence test
    // compares).
    let gathered = |k: usize| -> Option<Gathered> {
        if let Some((table, index)) = take(k) {
            return Some(Gathered {
                table,
                index: Some(index),
                reduce: None,
            });
        }
        let n = block.nodes.get(k)?;
        let reduce = match n.op.name {
            "sum" => RowReduce::Sum,
            "mean" => RowReduce::Mean,
            "max" => RowReduce::Max,
            "min" => RowReduce::Min,
            _ => return None,
        };
        if n.attrs.bool("exclude").ok()?.unwrap_or(false) {
            return None;
        }
        let axis = n.attrs.ints("axis").ok()?;
        match n.args.as_slice() {
            [BArg::One(BVal::Node(t))]
                if matches!(reduce, RowReduce::Sum | RowReduce::Mean)
                    && matches!(axis.as_deref(), Some([0])) =>
            {
                let (table, index) = take(*t as usize)?;
                (readers(*t as usize) == 1).then_some(Gathered {
                    table,
                    index: Some(index),
                    reduce: Some(reduce),
                })
            }
            [BArg::One(BVal::Input(t))] => {
                let (dims, dtype) = block.inputs.get(*t as usize)?.ty.as_tensor()?;
                // Over axis 0 (or every axis of a vector).
                let rows_axis = match axis.as_deref() {
                    Some([0]) => true,
                    None | Some([-1]) => dims.len() == 1,
                    _ => false,
                };
                (rows_axis && dtype == tumble_ir::DType::Float32).then_some(Gathered {
                    table: *t,
                    index: None,
                    reduce: Some(reduce),
                })
            }
            _ => None,
        }
    };
    let static_shape = |v: &BVal| matches!(block.val_ty(v).as_tensor(), Some((dims, _)) if dims.iter().all(|d| d.known().is_some()));
    if block.nodes.is_empty() || (0..block.nodes.len()).any(|k| gathered(k).is_none()) {
        return None;
    }
    block
        .outputs
        .iter()
        .map(|v| gathered(v.node()?).filter(|_| static_shape(v)))
        .collect()
}

/// A dimension as the analysis knows it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SymDim {
    Known(i64),
    /// The instance's length (every row input's leading `?`).
    Len,
    /// Anything else not known statically.
    Other,
}

impl fmt::Display for SymDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SymDim::Known(n) => write!(f, "{n}"),
            SymDim::Len => write!(f, "L"),
            SymDim::Other => write!(f, "?"),
        }
    }
}

/// `(L, 768)`.
fn shape_text(shape: &[SymDim]) -> String {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    }
}

impl fmt::Display for RaggedBlock {
    /// For `tumble explain`: the inputs' roles and the segments with their operators and the
    /// symbolic shapes of what they hand on.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roles: Vec<String> = self
            .inputs
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let k = match k {
                    RaggedInput::Rows if self.free_length.get(i) == Some(&true) => {
                        "rows of any length"
                    }
                    RaggedInput::Rows => "rows",
                    RaggedInput::PerInstance => "per instance",
                    RaggedInput::Shared => "shared",
                };
                format!("in{i} {k}")
            })
            .collect();
        writeln!(f, "    inputs: {}", roles.join(", "))?;
        for seg in &self.segments {
            let how = match (seg.row_wise, &seg.kernel) {
                (true, _) => "row-wise, once over all rows of the launch",
                (false, Some(MixingKernel::Attention(_))) => {
                    "attention, one kernel over every instance's rows"
                }
                (false, Some(MixingKernel::RowSlice { .. })) => {
                    "whole rows, taken where they lie for every instance"
                }
                (false, Some(MixingKernel::Gather(_))) => {
                    "rows of every instance's table, read where it lies"
                }
                (false, Some(MixingKernel::Query(q))) => match q.then {
                    crate::query::Then::Attend => {
                        "a query attending over every instance's rows where they lie"
                    }
                    crate::query::Then::Argmax => {
                        "a query choosing among every instance's rows where they lie"
                    }
                },
                (false, None) => "once per group of equal shapes",
            };
            let ops: Vec<&str> = seg.block.nodes.iter().map(|n| n.op.name).collect();
            let hands: Vec<String> = seg
                .defines
                .iter()
                .zip(&seg.shapes)
                .map(|(d, s)| {
                    let v = match d {
                        BVal::Node(n) => format!("%{n}"),
                        BVal::Field(n, i) => format!("%{n}.{i}"),
                        BVal::Input(i) => format!("in{i}"),
                        BVal::Const(_) => "const".into(),
                    };
                    format!("{v} {}", shape_text(s))
                })
                .collect();
            writeln!(
                f,
                "    {} ({how}): {} -> {}",
                seg.block.name,
                ops.join(", "),
                hands.join(", ")
            )?;
        }
        Ok(())
    }
}

type SDim = SymDim;
type SShape = Vec<SDim>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Fixed,
    RowWise,
    Mixing,
    /// Reads varying values, all of static shape (after a mixing operator took the first row):
    /// every instance of the launch runs it together.
    Uniform,
}

impl Class {
    /// Segments cycle through row-wise, mixing and uniform work: `segment % 3` is its kind.
    fn cycle(self) -> Option<usize> {
        match self {
            Class::Fixed => None,
            Class::RowWise => Some(0),
            Class::Mixing => Some(1),
            Class::Uniform => Some(2),
        }
    }
}

/// What the analysis knows of a value: its symbolic shape, and whether it can differ between
/// the instances of a ragged launch.
#[derive(Clone, Debug)]
struct Fact {
    shape: SShape,
    varies: bool,
}

/// A parent value as a map key (`BVal` holds tensors and has no `Eq`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Key {
    Input(u32),
    Node(u32),
    Field(u32, u32),
}

fn key_of(v: &BVal) -> Option<Key> {
    match v {
        BVal::Input(i) => Some(Key::Input(*i)),
        BVal::Node(n) => Some(Key::Node(*n)),
        BVal::Field(n, f) => Some(Key::Field(*n, *f)),
        BVal::Const(_) => None,
    }
}

fn bval_of(k: Key) -> BVal {
    match k {
        Key::Input(i) => BVal::Input(i),
        Key::Node(n) => BVal::Node(n),
        Key::Field(n, f) => BVal::Field(n, f),
    }
}

/// The ragged form of `block`, whose inputs flagged in `per_instance` differ between instances
/// (the others are one tensor per mini-batch: weights); `None` when it has no input with a
/// leading `?`, an input with `?` elsewhere, or no work that batches better this way (row-wise,
/// or on values of static shape).
pub fn analyze(block: &Block, per_instance: &[bool]) -> Option<RaggedBlock> {
    let mut kinds = Vec::with_capacity(block.inputs.len());
    let mut input_facts = Vec::with_capacity(block.inputs.len());
    for input in &block.inputs {
        let (dims, _) = input.ty.as_tensor()?;
        let mut shape = Vec::with_capacity(dims.len());
        for (axis, d) in dims.iter().enumerate() {
            shape.push(match (d, axis) {
                (Dim::Known(n), _) => SDim::Known(*n),
                (Dim::Any, 0) => SDim::Len,
                (Dim::Any, _) => return None,
            });
        }
        let is_rowed = shape.first() == Some(&SDim::Len);
        let varies = per_instance.get(kinds.len()).copied().unwrap_or(true);
        kinds.push(match (is_rowed, varies) {
            (true, _) => RaggedInput::Rows,
            (false, true) => RaggedInput::PerInstance,
            (false, false) => RaggedInput::Shared,
        });
        input_facts.push(Fact {
            shape,
            varies: is_rowed || varies,
        });
    }
    if !kinds.contains(&RaggedInput::Rows) {
        return None;
    }

    // Facts per node: one per field for a tuple-valued node.
    let mut node_facts: Vec<Vec<Fact>> = Vec::with_capacity(block.nodes.len());
    let mut classes = Vec::with_capacity(block.nodes.len());
    for node in &block.nodes {
        let fact = |v: &BVal| -> Option<Fact> {
            match v {
                BVal::Input(i) => input_facts.get(*i as usize).cloned(),
                BVal::Node(n) => node_facts.get(*n as usize)?.first().cloned(),
                BVal::Field(n, f) => node_facts.get(*n as usize)?.get(*f as usize).cloned(),
                BVal::Const(t) => Some(Fact {
                    shape: t.shape().iter().map(|&d| SDim::Known(d as i64)).collect(),
                    varies: false,
                }),
            }
        };
        let mut args = Vec::with_capacity(node.args.len());
        for a in &node.args {
            args.push(match a {
                BArg::One(v) => vec![fact(v)?],
                BArg::Tuple(vs) => vs.iter().map(fact).collect::<Option<Vec<_>>>()?,
            });
        }
        let concrete = concrete_result(block, node, &args);
        let (class, facts) = classify(node, &args, concrete);
        classes.push(class);
        node_facts.push(facts);
    }
    if !classes.contains(&Class::RowWise) && !classes.contains(&Class::Uniform) {
        return None;
    }

    // Segments: each node in the first one of its kind at or after its producers' (fixed
    // nodes: at its producers').
    let producers = |node: &BlockNode| -> Vec<u32> {
        let mut ps = Vec::new();
        for a in &node.args {
            let vs: &[BVal] = match a {
                BArg::One(v) => std::slice::from_ref(v),
                BArg::Tuple(vs) => vs,
            };
            for v in vs {
                if let BVal::Node(n) | BVal::Field(n, _) = v {
                    ps.push(*n);
                }
            }
        }
        ps
    };
    let mut seg_of: Vec<usize> = Vec::with_capacity(block.nodes.len());
    for (node, class) in block.nodes.iter().zip(&classes) {
        let at_least = producers(node)
            .iter()
            .filter_map(|&p| seg_of.get(p as usize).copied())
            .max()
            .unwrap_or(0);
        seg_of.push(match class.cycle() {
            None => at_least,
            Some(kind) => at_least + (kind + 3 - at_least % 3) % 3,
        });
    }

    // A mixing layout node read only by later mixing segments moves to the first of them (last
    // node first, so a chain moves whole): a layout of an instance's rows that reads only the
    // block's inputs (`transpose(%M)` of a decoder's memory) stays beside the attention that
    // reads it, where a query computed in the block (`h2` of this step, not the step's input)
    // had put the attention in a later mixing segment than its keys — the query form was not
    // found and every launch ran once per group of equal lengths (a Luong decoder 1.37× its
    // Bahdanau form). Segments of a kind keep their grouping, so a moved node computes the
    // same.
    sink_mixing(block, &classes, &mut seg_of, &producers);

    // Where each value is read: by which segments, and by the block's outputs.
    let n_segs = seg_of.iter().copied().max().unwrap_or(0) + 1;
    let mut last_use: HashMap<Key, usize> = HashMap::new();
    for (i, node) in block.nodes.iter().enumerate() {
        for a in &node.args {
            let vs: &[BVal] = match a {
                BArg::One(v) => std::slice::from_ref(v),
                BArg::Tuple(vs) => vs,
            };
            for v in vs {
                if let Some(k) = key_of(v) {
                    let e = last_use.entry(k).or_insert(0);
                    *e = (*e).max(seg_of[i]);
                }
            }
        }
    }
    for v in &block.outputs {
        if let Some(k) = key_of(v) {
            last_use.insert(k, n_segs);
        }
    }

    let mut segments = Vec::new();
    for s in 0..n_segs {
        let members: Vec<usize> = (0..block.nodes.len()).filter(|&i| seg_of[i] == s).collect();
        if members.is_empty() {
            continue;
        }
        segments.push(segment(
            block,
            s,
            &members,
            &seg_of,
            &last_use,
            &node_facts,
        )?);
    }
    let bytes_per_row = block
        .nodes
        .iter()
        .map(|n| tumble_ops::value_bytes_with(&n.ty, 1))
        .fold(0, usize::saturating_add);
    let free_length = kinds
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let input = BVal::Input(i as u32);
            k == RaggedInput::Rows
                && segments.iter().all(|s| {
                    matches!(s.kernel, Some(MixingKernel::Gather(_)))
                        || !s.reads.iter().any(|r| same_value(r, &input))
                })
        })
        .collect();
    Some(RaggedBlock {
        inputs: kinds,
        segments,
        bytes_per_row,
        free_length,
    })
}

/// Moves each mixing layout node (a transpose, a reshape: cheap, and part of the attention and
/// query forms) whose readers are all nodes in later mixing segments into the first of those
/// (see [`analyze`]); a node read by the block's outputs stays. (Other operators stay where
/// they are: moved into a segment of a gather, they would keep it from being one.)
fn sink_mixing(
    block: &Block,
    classes: &[Class],
    seg_of: &mut [usize],
    producers: &dyn Fn(&BlockNode) -> Vec<u32>,
) {
    let n = block.nodes.len();
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in block.nodes.iter().enumerate() {
        for p in producers(node) {
            if let Some(r) = readers.get_mut(p as usize) {
                r.push(i);
            }
        }
    }
    let mut output = vec![false; n];
    for v in &block.outputs {
        if let BVal::Node(k) | BVal::Field(k, _) = v {
            if let Some(o) = output.get_mut(*k as usize) {
                *o = true;
            }
        }
    }
    for i in (0..n).rev() {
        let (Some(Class::Mixing), Some(false)) = (classes.get(i), output.get(i).copied()) else {
            continue;
        };
        let layout = block.nodes.get(i).is_some_and(|n| {
            matches!(
                n.op.name,
                "transpose" | "reshape" | "expand_dims" | "squeeze"
            )
        });
        if !layout {
            continue;
        }
        let Some(target) = readers[i]
            .iter()
            .filter_map(|&r| seg_of.get(r).copied())
            .min()
        else {
            continue;
        };
        if target > seg_of[i] && Class::Mixing.cycle() == Some(target % 3) {
            seg_of[i] = target;
        }
    }
}

/// Segment `s` of `block` (nodes `members`) as a block of its own. `None` when a value crossing
/// into or out of it is a whole tuple (only tensors cross).
fn segment(
    block: &Block,
    s: usize,
    members: &[usize],
    seg_of: &[usize],
    last_use: &HashMap<Key, usize>,
    node_facts: &[Vec<Fact>],
) -> Option<Segment> {
    let local: HashMap<usize, u32> = members
        .iter()
        .enumerate()
        .map(|(k, &n)| (n, k as u32))
        .collect();
    let mut reads: Vec<Key> = Vec::new();
    let mut inputs: Vec<BlockInput> = Vec::new();
    let map_val = |v: &BVal, reads: &mut Vec<Key>, inputs: &mut Vec<BlockInput>| {
        let here = |n: &u32| local.get(&(*n as usize)).copied();
        match v {
            BVal::Const(t) => Some(BVal::Const(t.clone())),
            BVal::Node(n) if here(n).is_some() => here(n).map(BVal::Node),
            BVal::Field(n, f) if here(n).is_some() => here(n).map(|m| BVal::Field(m, *f)),
            other => {
                let k = key_of(other)?;
                let ty = block.val_ty(other);
                ty.as_tensor()?;
                let at = match reads.iter().position(|r| *r == k) {
                    Some(at) => at,
                    None => {
                        reads.push(k);
                        inputs.push(BlockInput {
                            name: input_name(block, k),
                            ty,
                        });
                        reads.len() - 1
                    }
                };
                Some(BVal::Input(at as u32))
            }
        }
    };
    let mut nodes = Vec::with_capacity(members.len());
    for &n in members {
        let node = block.nodes.get(n)?;
        let mut args = Vec::with_capacity(node.args.len());
        for a in &node.args {
            args.push(match a {
                BArg::One(v) => BArg::One(map_val(v, &mut reads, &mut inputs)?),
                BArg::Tuple(vs) => BArg::Tuple(
                    vs.iter()
                        .map(|v| map_val(v, &mut reads, &mut inputs))
                        .collect::<Option<Vec<_>>>()?,
                ),
            });
        }
        nodes.push(BlockNode {
            op: node.op,
            args,
            attrs: node.attrs.clone(),
            ty: node.ty.clone(),
            span: node.span,
            calls: node.calls.clone(),
        });
    }
    // Outputs: every value defined here and read by a later segment or by the block's outputs.
    let mut defines = Vec::new();
    let mut outputs = Vec::new();
    let mut shapes = Vec::new();
    let mut keys: Vec<(&Key, &usize)> = last_use.iter().collect();
    keys.sort();
    for (k, &until) in keys {
        let (n, out) = match *k {
            Key::Node(n) => match local.get(&(n as usize)) {
                Some(&m) => (n, BVal::Node(m)),
                None => continue,
            },
            Key::Field(n, f) => match local.get(&(n as usize)) {
                Some(&m) => (n, BVal::Field(m, f)),
                None => continue,
            },
            Key::Input(_) => continue,
        };
        if seg_of.get(n as usize) != Some(&s) || until <= s {
            continue;
        }
        // A whole tuple does not cross (its fields do).
        block.val_ty(&bval_of(*k)).as_tensor()?;
        defines.push(bval_of(*k));
        outputs.push(out);
        let field = match *k {
            Key::Field(_, f) => f as usize,
            _ => 0,
        };
        shapes.push(
            node_facts
                .get(n as usize)
                .and_then(|fs| fs.get(field))
                .map(|f| f.shape.clone())
                .unwrap_or_default(),
        );
    }
    let output_shape = match outputs.len() {
        1 => OutputShape::Single,
        _ => OutputShape::Tuple,
    };
    let seg_block = Block {
        name: format!("{}/{}", block.name, s),
        inputs,
        nodes,
        outputs,
        output_shape,
        primitive: block.primitive,
        span: block.span,
    };
    let row_wise = s % 3 == 0;
    Some(Segment {
        row_wise,
        kernel: if row_wise {
            None
        } else {
            MixingKernel::find(&seg_block)
        },
        block: seg_block,
        reads: reads.into_iter().map(bval_of).collect(),
        defines,
        shapes,
        bytes_per_row: members
            .iter()
            .filter_map(|&n| block.nodes.get(n))
            .map(|n| tumble_ops::value_bytes_with(&n.ty, 1))
            .fold(0, usize::saturating_add),
    })
}

fn input_name(block: &Block, k: Key) -> String {
    match k {
        Key::Input(i) => block
            .inputs
            .get(i as usize)
            .map_or_else(|| format!("input {i}"), |x| x.name.clone()),
        Key::Node(n) => format!("%{n}"),
        Key::Field(n, f) => format!("%{n}.{f}"),
    }
}

/// The node's result type by its operator's shape relation when every operand's shape is known
/// (after a constant slice, say, where the checker only knew `?`): Nimble's shape functions.
fn concrete_result(block: &Block, node: &BlockNode, args: &[Vec<Fact>]) -> Option<Ty> {
    let known = |f: &Fact| -> Option<Vec<i64>> {
        f.shape
            .iter()
            .map(|d| match d {
                SDim::Known(n) => Some(*n),
                _ => None,
            })
            .collect()
    };
    let mut tys = Vec::with_capacity(args.len());
    for (a, facts) in node.args.iter().zip(args) {
        let vals = a.values();
        let mut one = Vec::with_capacity(vals.len());
        for (v, f) in vals.iter().zip(facts) {
            let (_, dtype) = block.val_ty(v).as_tensor().map(|(d, t)| (d.len(), t))?;
            one.push(Ty::tensor_of(&known(f)?, dtype));
        }
        tys.push(match a {
            BArg::One(_) => one.pop()?,
            BArg::Tuple(_) => Ty::Tuple(one),
        });
    }
    (node.op.relation)(&tys, &node.attrs).ok()
}

/// The node's class and its result's facts (one per field of a tuple result); `concrete`: its
/// result type from known operand shapes.
fn classify(node: &BlockNode, args: &[Vec<Fact>], concrete: Option<Ty>) -> (Class, Vec<Fact>) {
    let node_ty = concrete.as_ref().unwrap_or(&node.ty);
    let varies = args.iter().flatten().any(|f| f.varies);
    let from_ty = |ty: &Ty, lead_len: bool| -> SShape {
        match ty.as_tensor() {
            Some((dims, _)) => dims
                .iter()
                .enumerate()
                .map(|(axis, d)| match d {
                    Dim::Known(n) => SDim::Known(*n),
                    Dim::Any if axis == 0 && lead_len => SDim::Len,
                    Dim::Any => SDim::Other,
                })
                .collect(),
            None => Vec::new(),
        }
    };
    let result = |lead_len: bool, tracked: Option<SShape>| -> Vec<Fact> {
        match node_ty {
            Ty::Tuple(ts) => ts
                .iter()
                .map(|t| Fact {
                    shape: from_ty(t, lead_len),
                    varies,
                })
                .collect(),
            ty => vec![Fact {
                shape: tracked.unwrap_or_else(|| from_ty(ty, lead_len)),
                varies,
            }],
        }
    };
    if !varies {
        return (Class::Fixed, result(false, None));
    }
    if row_wise(node, args) {
        let facts = result(true, None);
        // The result keeps `L` as its leading dim and knows every other one.
        let ok = facts.iter().all(|f| {
            f.shape.first() == Some(&SDim::Len) && f.shape[1..].iter().all(|d| *d != SDim::Other)
        });
        if ok {
            return (Class::RowWise, facts);
        }
    }
    let static_shapes = args
        .iter()
        .flatten()
        .all(|f| !f.varies || f.shape.iter().all(|d| matches!(d, SDim::Known(_))));
    let facts = result(false, track_mixing(node, args));
    let static_result = facts
        .iter()
        .all(|f| f.shape.iter().all(|d| matches!(d, SDim::Known(_))));
    match static_shapes && static_result {
        true => (Class::Uniform, facts),
        false => (Class::Mixing, facts),
    }
}

/// The single operand of `args` at `i`.
fn one(args: &[Vec<Fact>], i: usize) -> Option<&Fact> {
    match args.get(i).map(Vec::as_slice) {
        Some([f]) => Some(f),
        _ => None,
    }
}

/// A varying operand is rows: `L` leads, and appears nowhere else, and no dim is unknown.
fn is_rows(f: &Fact) -> bool {
    f.shape.first() == Some(&SDim::Len) && f.shape[1..].iter().all(|d| matches!(d, SDim::Known(_)))
}

fn norm_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

/// Whether the node, whose varying operands are all rows (checked here), keeps axis 0 a row
/// index: its result's row `i` is a function of row `i` of its varying operands alone.
fn row_wise(node: &BlockNode, args: &[Vec<Fact>]) -> bool {
    if !args.iter().flatten().all(|f| !f.varies || is_rows(f)) {
        return false;
    }
    let out_rank = node.ty.as_tensor().map(|(d, _)| d.len());
    let attrs = &node.attrs;
    let axis_or = |default: i64| attrs.int("axis").ok().flatten().unwrap_or(default);
    match node.op.stage {
        StageRule::Gemm => {
            // nn.dense(rows, weight): a product per row.
            matches!((one(args, 0), one(args, 1)), (Some(x), Some(w)) if x.varies && !w.varies && x.shape.len() >= 2)
        }
        StageRule::RowWise => {
            // Elementwise with broadcasting: varying operands have the result's rank (so their
            // axis 0 is the result's), fixed ones a lower rank or a leading 1.
            let Some(r) = out_rank else { return false };
            args.iter().flatten().all(|f| {
                if f.varies {
                    f.shape.len() == r
                } else {
                    f.shape.len() < r || f.shape.first() == Some(&SDim::Known(1))
                }
            })
        }
        StageRule::RowWiseOnLastAxis { default_axis } => {
            let Some(x) = args.first().and_then(|a| a.first()) else {
                return false;
            };
            let axis_ok = norm_axis(axis_or(default_axis), x.shape.len()).is_some_and(|a| a != 0);
            match node.op.name {
                // Every piece joined or cut must be rows (a fixed piece has no `L` rows).
                "concatenate" | "split" => axis_ok && args.iter().flatten().all(|f| f.varies),
                // bias_add, softmax, log_softmax, layer_norm: only the data varies.
                _ => axis_ok && x.varies && args.iter().flatten().skip(1).all(|f| !f.varies),
            }
        }
        StageRule::Gather => {
            // take(table, rows of indices, axis=0): one table row per index.
            matches!((one(args, 0), one(args, 1)), (Some(t), Some(i)) if !t.varies && i.varies)
                && attrs.int("axis").ok().flatten() == Some(0)
                && attrs.int("batch_dims").ok().flatten().unwrap_or(0) == 0
        }
        StageRule::Batched => {
            let Some(x) = one(args, 0) else { return false };
            let rank = x.shape.len();
            match node.op.name {
                "cast" | "zeros_like" | "ones_like" => true,
                "transpose" => match attrs.ints("axes").ok().flatten() {
                    Some(axes) => axes.first().and_then(|&a| norm_axis(a, rank)) == Some(0),
                    None => rank == 1,
                },
                "reshape" => {
                    let Some(new) = attrs.ints("newshape").ok().flatten() else {
                        return false;
                    };
                    let known: i64 = x.shape[1..]
                        .iter()
                        .map(|d| match d {
                            SDim::Known(n) => *n,
                            _ => -1,
                        })
                        .product();
                    matches!(new.first(), Some(-1 | 0))
                        && new[1..].iter().all(|&d| d > 0)
                        && new[1..].iter().product::<i64>() == known
                }
                "expand_dims" => norm_axis(axis_or(0), rank + 1).is_some_and(|a| a != 0),
                // (`variance` with its mean: rows too, or shared; the reduced axes a row's.)
                "squeeze" | "sum" | "prod" | "mean" | "max" | "min" | "all" | "any" | "argmax"
                | "argmin" | "variance" => {
                    let Some(axes) = attrs.ints("axis").ok().flatten() else {
                        return false;
                    };
                    attrs.bool("exclude").ok().flatten() != Some(true)
                        && !axes.is_empty()
                        && axes
                            .iter()
                            .all(|&a| norm_axis(a, rank).is_some_and(|a| a != 0))
                }
                _ => false,
            }
        }
    }
}

/// The symbolic result shape of a mixing operator where `L` provably survives it (so that rows
/// mixed by attention count as rows again); `None`: from the checker's type, `?` unknown.
fn track_mixing(node: &BlockNode, args: &[Vec<Fact>]) -> Option<SShape> {
    let x = one(args, 0)?;
    let rank = x.shape.len();
    match node.op.name {
        "transpose" => {
            let axes: Vec<usize> = match node.attrs.ints("axes").ok().flatten() {
                Some(axes) => axes
                    .iter()
                    .map(|&a| norm_axis(a, rank))
                    .collect::<Option<_>>()?,
                None => (0..rank).rev().collect(),
            };
            axes.iter().map(|&a| x.shape.get(a).copied()).collect()
        }
        "nn.batch_matmul" => {
            let y = one(args, 1)?;
            let ta = node
                .attrs
                .bool("transpose_a")
                .ok()
                .flatten()
                .unwrap_or(false);
            let tb = node
                .attrs
                .bool("transpose_b")
                .ok()
                .flatten()
                .unwrap_or(true);
            let (&[xb, x1, x2], &[yb, y1, y2]) = (x.shape.as_slice(), y.shape.as_slice()) else {
                return None;
            };
            let batch = if xb == SDim::Known(1) { yb } else { xb };
            Some(vec![
                batch,
                if ta { x2 } else { x1 },
                if tb { y1 } else { y2 },
            ])
        }
        "reshape" => {
            let new = node.attrs.ints("newshape").ok().flatten()?;
            let lens = x.shape.iter().filter(|d| **d == SDim::Len).count();
            let known: Option<i64> = x
                .shape
                .iter()
                .filter(|d| **d != SDim::Len)
                .map(|d| match d {
                    SDim::Known(n) => Some(*n),
                    _ => None,
                })
                .product();
            let rest: i64 = new.iter().filter(|&&d| d != -1).product();
            let ok = lens == 1
                && new.iter().filter(|&&d| d == -1).count() == 1
                && new.iter().all(|&d| d == -1 || d > 0)
                && Some(rest) == known;
            ok.then(|| {
                new.iter()
                    .map(|&d| if d == -1 { SDim::Len } else { SDim::Known(d) })
                    .collect()
            })
        }
        // `x · wᵀ`: x's leading dims, then w's rows — attention's `nn.dense(%p, transpose(%v))`
        // is the instance's rows again, so what follows it is row-wise work.
        "nn.dense" => {
            let w = one(args, 1)?;
            let (&n, _) = w.shape.split_first()?;
            let mut out = x.shape.get(..rank.checked_sub(1)?)?.to_vec();
            out.push(n);
            Some(out)
        }
        "expand_dims" => {
            let axis = norm_axis(node.attrs.int("axis").ok().flatten()?, rank + 1)?;
            let count = node.attrs.int("num_newaxis").ok().flatten().unwrap_or(1);
            let mut out = x.shape.clone();
            for _ in 0..count.max(0) {
                out.insert(axis, SDim::Known(1));
            }
            Some(out)
        }
        "squeeze" => {
            let axes: Vec<usize> = match node.attrs.ints("axis").ok().flatten() {
                Some(axes) => axes
                    .iter()
                    .map(|&a| norm_axis(a, rank))
                    .collect::<Option<_>>()?,
                None => (0..rank)
                    .filter(|&a| x.shape[a] == SDim::Known(1))
                    .collect(),
            };
            Some(
                x.shape
                    .iter()
                    .enumerate()
                    .filter(|(a, _)| !axes.contains(a))
                    .map(|(_, d)| *d)
                    .collect(),
            )
        }
        "strided_slice" => {
            // A constant slice of the rows (Berxit's [CLS] row): its length once every instance
            // has that many rows. Instances with fewer get another shape at run time, and the
            // runtime groups by actual shapes, so this only decides where work is placed.
            let a = &node.attrs;
            let plain = a
                .get("axes")
                .is_none_or(|v| matches!(v, tumble_ir::AttrValue::None))
                && a.str("slice_mode").ok().flatten().unwrap_or("end") == "end";
            let begin = a.ints("begin").ok().flatten()?;
            let end = a.ints("end").ok().flatten()?;
            let strides = a.ints("strides").ok().flatten().unwrap_or_default();
            let (dims, _) = node.ty.as_tensor()?;
            let mut out = Vec::with_capacity(dims.len());
            for (axis, d) in dims.iter().enumerate() {
                out.push(match (d, x.shape.get(axis)) {
                    (Dim::Known(n), _) => SDim::Known(*n),
                    (Dim::Any, Some(SDim::Len)) => {
                        let (b, e) = (begin.get(axis).copied()?, end.get(axis).copied()?);
                        let stride = strides.get(axis).copied().unwrap_or(1);
                        match plain && stride == 1 && b >= 0 && e > b {
                            true => SDim::Known(e - b),
                            false => SDim::Other,
                        }
                    }
                    (Dim::Any, _) => SDim::Other,
                });
            }
            Some(out)
        }
        _ => match node.op.stage {
            // Shape-preserving or broadcasting operators: the broadcast of the operands' shapes.
            StageRule::RowWise | StageRule::RowWiseOnLastAxis { .. }
                if !matches!(node.op.name, "concatenate" | "split") =>
            {
                let r = node.ty.as_tensor()?.0.len();
                let mut out = Vec::with_capacity(r);
                for k in 0..r {
                    let mut d = SDim::Known(1);
                    for f in args.iter().flatten() {
                        let Some(at) = (k + f.shape.len()).checked_sub(r) else {
                            continue;
                        };
                        d = match (d, f.shape[at]) {
                            (SDim::Other, _) | (_, SDim::Other) => SDim::Other,
                            (SDim::Known(1), e) | (e, SDim::Known(1)) => e,
                            (a, b) if a == b => a,
                            _ => SDim::Other,
                        };
                    }
                    out.push(d);
                }
                // Only the operands' own dims: the broadcast must agree with the checker's rank.
                (out.len() == r).then_some(out)
            }
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests;
