//! Static blocks (grain coarsening, ACROBAT §4.1): control-flow-free dataflow graphs of operators.
//! A block is the unit the batching runtime schedules and the unit a kernel executes.
//!
//! Blocks come from `Primitive=1` functions and, automatically, from maximal runs of pure operator
//! expressions in ordinary code (see `program.rs`). Inside a block there are only operator nodes,
//! constants and projections; everything else a block needs arrives as an input.

use std::fmt;
use tumble_ir::{Attrs, Span, Ty};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::Tensor;

/// A tensor value inside a block.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum BVal {
    /// The block's `i`-th input.
    Input(u32),
    /// The (tensor) result of node `n`.
    Node(u32),
    /// Field `i` of the tuple result of node `n` (e.g. a piece of `split`).
    Field(u32, u32),
    /// A literal.
    Const(Tensor),
}

impl BVal {
    /// The block node the value reads (`%n`, or a field of it).
    pub fn node(&self) -> Option<usize> {
        match self {
            BVal::Node(k) | BVal::Field(k, _) => Some(*k as usize),
            _ => None,
        }
    }
}

/// An operator argument: a tensor, or a tuple of tensors (`concatenate`'s input).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum BArg {
    One(BVal),
    Tuple(Vec<BVal>),
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BlockNode {
    #[serde(with = "tumble_ops::by_name")]
    pub op: &'static OpDef,
    pub args: Vec<BArg>,
    pub attrs: Attrs,
    /// The node's result type as the checker inferred it (a tensor or a tuple of tensors).
    pub ty: Ty,
    /// The operator call in the source (inside the function the block was inlined from, for
    /// an inlined helper's operators): where a run-time failure of this operator points, the
    /// block's invocation being the call that led there. Nodes the compiler makes (a canonical
    /// product's reshape) carry the span of the node they replace.
    pub span: Span,
    /// For an operator of an inlined function: the calls through which it was inlined,
    /// innermost first (the call of its function, then that call's caller's, ...), so a failure
    /// lists them as the reference engine's trace does.
    pub calls: Vec<Span>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BlockInput {
    /// What the input is in the source, for `explain` (a variable name or an expression kind).
    pub name: String,
    pub ty: Ty,
}

impl BlockInput {
    /// Why a value of per-invocation `shape` cannot be this input (or its field typed `ty`):
    /// it contradicts a size `ty` declares. The checker lets a value with `?` sizes reach a
    /// parameter that declares them, and a block computes with the declaration (a `reshape`'s
    /// `0` and `-1`, its outputs' shapes), so a value of another size is refused, not computed
    /// with.
    #[inline]
    pub fn undeclared_shape(&self, ty: &Ty, shape: &[usize]) -> Option<String> {
        let (dims, _) = ty.as_tensor()?;
        let fits = dims.len() == shape.len()
            && dims.iter().zip(shape).all(|(d, &s)| match d {
                tumble_ir::Dim::Known(k) => *k as u64 == s as u64,
                _ => true,
            });
        if fits {
            None
        } else {
            self.undeclared(ty, shape)
        }
    }

    #[cold]
    fn undeclared(&self, ty: &Ty, shape: &[usize]) -> Option<String> {
        let shown: Vec<String> = shape.iter().map(usize::to_string).collect();
        Some(format!(
            "{} has shape ({}) where the function it was passed to declares {ty}: a value with \
             `?` sizes was given a size other than the declared one",
            self.name,
            shown.join(", ")
        ))
    }
}

/// How a block's flat outputs are returned: one tensor, or a tuple of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum OutputShape {
    Single,
    Tuple,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Block {
    pub name: String,
    pub inputs: Vec<BlockInput>,
    /// In dependency order: a node only refers to earlier nodes.
    pub nodes: Vec<BlockNode>,
    pub outputs: Vec<BVal>,
    pub output_shape: OutputShape,
    /// True when the block came from a `Primitive=1` function (false: found automatically).
    pub primitive: bool,
    pub span: Span,
}

impl Block {
    /// Every output is a rank-0 tensor: with scalar inputs, the batching runtime evaluates such a
    /// block on the host at once instead of recording it (its "host scalars" rule), so it neither
    /// launches nor advances the inline depth.
    pub fn returns_only_scalars(&self) -> bool {
        self.outputs
            .iter()
            .all(|v| matches!(self.val_ty(v).as_tensor(), Some((d, _)) if d.is_empty()))
    }

    /// Every output an integer or boolean tensor ([`integral`]): no adjoint, so host work while
    /// recording for a backward too.
    pub fn returns_only_integers(&self) -> bool {
        self.output_tys().iter().all(integral)
    }

    /// Per input: every node reading it reads only its shape (`shape_of`, `ndarray_size`), and
    /// no output is it — a value whose size, not contents, the block needs (a counted loop's
    /// bound `take(shape_of(%x), 0)` over an instance's rows).
    pub fn shape_only_inputs(&self) -> Vec<bool> {
        let mut only = vec![true; self.inputs.len()];
        let mut read = vec![false; self.inputs.len()];
        let mut note = |v: &BVal, shape: bool| {
            if let BVal::Input(i) = v {
                if let Some(r) = read.get_mut(*i as usize) {
                    *r = true;
                }
                if !shape {
                    if let Some(o) = only.get_mut(*i as usize) {
                        *o = false;
                    }
                }
            }
        };
        for n in &self.nodes {
            let shape = tumble_ops::SHAPE_READERS.contains(&n.op.name);
            n.args
                .iter()
                .flat_map(BArg::values)
                .for_each(|v| note(v, shape));
        }
        self.outputs.iter().for_each(|v| note(v, false));
        only.iter().zip(&read).map(|(&o, &r)| o && r).collect()
    }

    /// Runs the nodes in order on one invocation's inputs with the reference kernels; returns the
    /// flat outputs.
    pub fn eval(&self, inputs: &[Tensor], octx: &mut OpCtx) -> Result<Vec<Tensor>, String> {
        self.eval_values(inputs, self.nodes.len(), &self.outputs, octx)
    }

    /// Runs the first `upto` nodes in order on one invocation's inputs with the reference
    /// kernels; returns the values `wanted` (of those nodes, inputs or literals).
    pub fn eval_values(
        &self,
        inputs: &[Tensor],
        upto: usize,
        wanted: &[BVal],
        octx: &mut OpCtx,
    ) -> Result<Vec<Tensor>, String> {
        if inputs.len() == self.inputs.len() {
            for (input, t) in self.inputs.iter().zip(inputs) {
                if let Some(m) = input.undeclared_shape(&input.ty, t.shape()) {
                    return Err(m);
                }
            }
        }
        let mut results: Vec<OpValue> = Vec::with_capacity(upto);
        for node in self.nodes.iter().take(upto) {
            let args = node
                .args
                .iter()
                .map(|a| match a {
                    BArg::One(v) => eval_val(v, inputs, &results).map(OpValue::Tensor),
                    BArg::Tuple(vs) => vs
                        .iter()
                        .map(|v| eval_val(v, inputs, &results))
                        .collect::<Result<Vec<_>, _>>()
                        .map(OpValue::Tuple),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let out = tumble_ops::eval(node.op, &args, &node.attrs, octx).map_err(|e| e.message)?;
            results.push(out);
        }
        wanted
            .iter()
            .map(|v| eval_val(v, inputs, &results))
            .collect()
    }

    /// Exactly `add(in0, in1)` of two f32 tensors of one type (a child sum's step): the batching
    /// runtime defers its invocations and merges chains of them into n-ary sums, added in order
    /// (so a left fold stays bit-exact) where a launch reads them.
    pub fn is_sum(&self) -> bool {
        let f32_ty = |t: &Ty| matches!(t.as_tensor(), Some((_, tumble_ir::DType::Float32)));
        match (&self.nodes[..], &self.inputs[..], &self.outputs[..]) {
            ([node], [a, b], [BVal::Node(0)]) => {
                node.op.name == "add"
                    && self.output_shape == OutputShape::Single
                    && matches!(
                        &node.args[..],
                        [BArg::One(BVal::Input(0)), BArg::One(BVal::Input(1))]
                    )
                    && f32_ty(&a.ty)
                    && a.ty == b.ty
                    && node.ty == a.ty
            }
            _ => false,
        }
    }

    pub fn output_tys(&self) -> Vec<Ty> {
        self.outputs.iter().map(|v| self.val_ty(v)).collect()
    }

    pub fn val_ty(&self, v: &BVal) -> Ty {
        value_ty(&self.inputs, &self.nodes, v)
    }

    /// Removes the nodes `removable` accepts whose results no output depends on (and the nodes
    /// only those read), renumbering the rest.
    pub fn drop_dead_nodes(&mut self, removable: impl Fn(&BlockNode) -> bool) {
        let n = self.nodes.len();
        let mut live = vec![false; n];
        let mark = |v: &BVal, live: &mut Vec<bool>| {
            if let BVal::Node(m) | BVal::Field(m, _) = v {
                if let Some(l) = live.get_mut(*m as usize) {
                    *l = true;
                }
            }
        };
        for v in &self.outputs {
            mark(v, &mut live);
        }
        for i in (0..n).rev() {
            let node = &self.nodes[i];
            live[i] |= !removable(node);
            if live[i] {
                for v in node.args.iter().flat_map(BArg::values) {
                    mark(v, &mut live);
                }
            }
        }
        if live.iter().all(|&l| l) {
            return;
        }
        let mut map: Vec<BVal> = Vec::with_capacity(n);
        let mut kept = Vec::with_capacity(n);
        for (i, node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            // A dead node's entry is never read.
            map.push(BVal::Node(kept.len() as u32));
            if live[i] {
                kept.push(node.renumbered(&map));
            }
        }
        self.outputs = self.outputs.iter().map(|v| renumbered(v, &map)).collect();
        self.nodes = kept;
    }
}

/// The type of value `v` of a block with these inputs and nodes (also for a node list being
/// rebuilt by a pass).
pub fn value_ty(inputs: &[BlockInput], nodes: &[BlockNode], v: &BVal) -> Ty {
    match v {
        BVal::Input(i) => inputs
            .get(*i as usize)
            .map_or_else(Ty::unit, |x| x.ty.clone()),
        BVal::Node(n) => nodes
            .get(*n as usize)
            .map_or_else(Ty::unit, |x| x.ty.clone()),
        BVal::Field(n, f) => match nodes.get(*n as usize).map(|x| &x.ty) {
            Some(Ty::Tuple(ts)) => ts.get(*f as usize).cloned().unwrap_or_else(Ty::unit),
            _ => Ty::unit(),
        },
        BVal::Const(t) => Ty::tensor_of(
            &t.shape().iter().map(|&d| d as i64).collect::<Vec<_>>(),
            t.dtype(),
        ),
    }
}

/// `v` with its node reference renumbered by `map` (old node index → the node's value in a
/// rebuilt list; a tuple node's fields follow its node, so only tensor-valued nodes may become
/// other values).
pub fn renumbered(v: &BVal, map: &[BVal]) -> BVal {
    match v {
        BVal::Node(n) => map.get(*n as usize).cloned().unwrap_or(BVal::Node(*n)),
        BVal::Field(n, f) => match map.get(*n as usize) {
            Some(BVal::Node(m)) => BVal::Field(*m, *f),
            _ => BVal::Field(*n, *f),
        },
        other => other.clone(),
    }
}

impl BlockNode {
    /// The node with its operands renumbered by `map` ([`renumbered`]).
    pub fn renumbered(self, map: &[BVal]) -> BlockNode {
        let args = self
            .args
            .iter()
            .map(|a| a.map(|v| renumbered(v, map)))
            .collect();
        BlockNode { args, ..self }
    }
}

impl BArg {
    /// The same argument with every value replaced by `f` of it.
    pub fn map(&self, mut f: impl FnMut(&BVal) -> BVal) -> BArg {
        match self {
            BArg::One(v) => BArg::One(f(v)),
            BArg::Tuple(vs) => BArg::Tuple(vs.iter().map(f).collect()),
        }
    }

    /// Every value the argument reads.
    pub fn values(&self) -> &[BVal] {
        match self {
            BArg::One(v) => std::slice::from_ref(v),
            BArg::Tuple(vs) => vs,
        }
    }
}

fn eval_val(v: &BVal, inputs: &[Tensor], results: &[OpValue]) -> Result<Tensor, String> {
    let missing = || format!("internal: block value {v} is not available");
    match v {
        BVal::Input(i) => inputs.get(*i as usize).cloned().ok_or_else(missing),
        BVal::Node(n) => results
            .get(*n as usize)
            .and_then(OpValue::as_tensor)
            .cloned()
            .ok_or_else(missing),
        BVal::Field(n, f) => results
            .get(*n as usize)
            .and_then(OpValue::as_tuple)
            .and_then(|ts| ts.get(*f as usize))
            .cloned()
            .ok_or_else(missing),
        BVal::Const(t) => Ok(t.clone()),
    }
}

impl fmt::Display for BVal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BVal::Input(i) => write!(f, "in{i}"),
            BVal::Node(n) => write!(f, "%{n}"),
            BVal::Field(n, i) => write!(f, "%{n}.{i}"),
            BVal::Const(t) => match t.len() {
                1 => write!(f, "{}", t.get_f64(0).unwrap_or(f64::NAN)),
                _ => write!(f, "const{:?}", t.shape()),
            },
        }
    }
}

/// Prints a block in a Relay-like form for `tumble explain`.
impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.primitive { "primitive" } else { "auto" };
        writeln!(f, "block {} ({kind}, {} ops)", self.name, self.nodes.len())?;
        for (i, inp) in self.inputs.iter().enumerate() {
            writeln!(f, "  in{i}: {}  ({})", inp.ty, inp.name)?;
        }
        for (n, node) in self.nodes.iter().enumerate() {
            let args: Vec<String> = node
                .args
                .iter()
                .map(|a| match a {
                    BArg::One(v) => v.to_string(),
                    BArg::Tuple(vs) => format!(
                        "({})",
                        vs.iter()
                            .map(|v| v.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })
                .chain(node.attrs.iter().map(|a| format!("{}={}", a.name, a.value)))
                .collect();
            writeln!(
                f,
                "  %{n} = {}({})  : {}",
                node.op.name,
                args.join(", "),
                node.ty
            )?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|v| v.to_string()).collect();
        match self.output_shape {
            OutputShape::Single => writeln!(f, "  return {}", outs.join(", ")),
            OutputShape::Tuple => writeln!(f, "  return ({})", outs.join(", ")),
        }
    }
}

/// The same block value: one input, node or field of a node (literals never are).
pub(crate) fn same_value(a: &BVal, b: &BVal) -> bool {
    match (a, b) {
        (BVal::Node(x), BVal::Node(y)) => x == y,
        (BVal::Field(x, f), BVal::Field(y, g)) => x == y && f == g,
        (BVal::Input(x), BVal::Input(y)) => x == y,
        _ => false,
    }
}

/// Per node of `block`: pure, and reading only inputs `input_ok` accepts, literals and other
/// such nodes (a block's weight transforms, or its part free of recursive state).
pub(crate) fn nodes_reading_only(block: &Block, input_ok: impl Fn(u32) -> bool) -> Vec<bool> {
    let mut out = vec![false; block.nodes.len()];
    for (k, node) in block.nodes.iter().enumerate() {
        out[k] = is_pure_op(node.op)
            && node.args.iter().flat_map(BArg::values).all(|v| match v {
                BVal::Input(i) => input_ok(*i),
                BVal::Node(m) | BVal::Field(m, _) => out.get(*m as usize).copied().unwrap_or(false),
                BVal::Const(_) => true,
            });
    }
    out
}

/// A tensor of integers or booleans: a value with no gradient that the host may compute (an
/// index, a count, a condition).
pub(crate) fn integral(t: &Ty) -> bool {
    matches!(t.as_tensor(), Some((_, dt)) if dt.is_int() || dt == tumble_ir::DType::Bool)
}

/// The backward closure of node `k` in `b`: the nodes its value depends on, `k` included.
pub(crate) fn needed_by(b: &Block, k: usize) -> Vec<bool> {
    closure(b, &[BVal::Node(k as u32)], None)
}

/// The nodes of `b` other than `k` that its outputs depend on when `k`'s value is read as an
/// input instead (the part of a block cut at `k` that stays).
pub(crate) fn live_without(b: &Block, k: usize) -> Vec<bool> {
    closure(b, &b.outputs, Some(k))
}

/// The nodes of `b` the values `roots` depend on (themselves included), never through node
/// `cut` (not marked, not followed).
fn closure(b: &Block, roots: &[BVal], cut: Option<usize>) -> Vec<bool> {
    let mut marked = vec![false; b.nodes.len()];
    let mark = |v: &BVal, marked: &mut Vec<bool>| {
        if let Some(m) = v.node().filter(|&m| Some(m) != cut) {
            if let Some(x) = marked.get_mut(m) {
                *x = true;
            }
        }
    };
    for v in roots {
        mark(v, &mut marked);
    }
    for j in (0..b.nodes.len()).rev() {
        if marked[j] {
            for v in b
                .nodes
                .get(j)
                .map_or(&[][..], |x| &x.args)
                .iter()
                .flat_map(BArg::values)
            {
                mark(v, &mut marked);
            }
        }
    }
    marked
}

/// The values of the nodes flagged in `inside` that the other nodes or the block's outputs read,
/// each once, in the order they are first read: where a block cut in two passes values from one
/// part to the other (derived parameters, hoisting splits).
pub(crate) fn frontier(b: &Block, inside: &[bool]) -> Vec<BVal> {
    let mut out: Vec<BVal> = Vec::new();
    let mut note = |v: &BVal| {
        if let BVal::Node(m) | BVal::Field(m, _) = v {
            if inside.get(*m as usize).copied().unwrap_or(false)
                && !out.iter().any(|o| same_value(o, v))
            {
                out.push(v.clone());
            }
        }
    };
    for (k, node) in b.nodes.iter().enumerate() {
        if !inside.get(k).copied().unwrap_or(false) {
            node.args.iter().flat_map(BArg::values).for_each(&mut note);
        }
    }
    b.outputs.iter().for_each(&mut note);
    out
}

/// The inputs of `b` that its nodes `nodes` or the values `extra` read, ascending.
pub(crate) fn inputs_read(b: &Block, nodes: &[usize], extra: &[BVal]) -> Vec<usize> {
    let mut used = vec![false; b.inputs.len()];
    let values = nodes
        .iter()
        .filter_map(|&k| b.nodes.get(k))
        .flat_map(|x| x.args.iter().flat_map(BArg::values))
        .chain(extra.iter());
    for v in values {
        if let BVal::Input(i) = v {
            if let Some(u) = used.get_mut(*i as usize) {
                *u = true;
            }
        }
    }
    (0..b.inputs.len()).filter(|&i| used[i]).collect()
}

/// What a part of a block is made of: its nodes, the inputs it keeps, the values it reads as new
/// inputs instead of computing them, and what it returns.
pub(crate) struct Part<'a> {
    /// Nodes of the block, in order.
    pub nodes: &'a [usize],
    /// Inputs of the block, renumbered in this order.
    pub inputs: &'a [usize],
    /// Values of the block read as the inputs after `inputs`, with those inputs' declarations.
    pub cut: Vec<(BVal, BlockInput)>,
    pub outputs: &'a [BVal],
    pub output_shape: OutputShape,
    pub primitive: bool,
    pub name: String,
}

/// Part `part` of block `b` as a block of its own; `None` when a value it reads is in none of its
/// nodes, inputs and cut values.
pub(crate) fn part_of(b: &Block, part: Part) -> Option<Block> {
    let input_of: std::collections::HashMap<u32, u32> = part
        .inputs
        .iter()
        .enumerate()
        .map(|(new, &old)| (old as u32, new as u32))
        .collect();
    let node_of: std::collections::HashMap<u32, u32> = part
        .nodes
        .iter()
        .enumerate()
        .map(|(new, &old)| (old as u32, new as u32))
        .collect();
    let first_cut = part.inputs.len() as u32;
    let remap = |v: &BVal| -> Option<BVal> {
        if let Some(j) = part.cut.iter().position(|(c, _)| same_value(c, v)) {
            return Some(BVal::Input(first_cut + j as u32));
        }
        Some(match v {
            BVal::Input(i) => BVal::Input(*input_of.get(i)?),
            BVal::Node(m) => BVal::Node(*node_of.get(m)?),
            BVal::Field(m, f) => BVal::Field(*node_of.get(m)?, *f),
            BVal::Const(t) => BVal::Const(t.clone()),
        })
    };
    let remap_arg = |a: &BArg| -> Option<BArg> {
        Some(match a {
            BArg::One(v) => BArg::One(remap(v)?),
            BArg::Tuple(vs) => BArg::Tuple(vs.iter().map(remap).collect::<Option<_>>()?),
        })
    };
    let mut inputs: Vec<BlockInput> = part
        .inputs
        .iter()
        .filter_map(|&i| b.inputs.get(i).cloned())
        .collect();
    let nodes: Vec<BlockNode> = part
        .nodes
        .iter()
        .filter_map(|&k| b.nodes.get(k))
        .map(|x| {
            Some(BlockNode {
                args: x.args.iter().map(remap_arg).collect::<Option<_>>()?,
                ..x.clone()
            })
        })
        .collect::<Option<_>>()?;
    let outputs = part.outputs.iter().map(remap).collect::<Option<_>>()?;
    inputs.extend(part.cut.into_iter().map(|(_, input)| input));
    Some(Block {
        name: part.name,
        inputs,
        nodes,
        outputs,
        output_shape: part.output_shape,
        primitive: part.primitive,
        span: b.span,
    })
}

/// An attribute as the compiler writes it (no source span).
pub(crate) fn attr(name: &str, value: tumble_ir::AttrValue) -> tumble_ir::attrs::Attr {
    tumble_ir::attrs::Attr {
        name: name.into(),
        value,
        span: tumble_ir::Span::default(),
    }
}

/// Operators with effects the batcher must not reorder or merge across instances: seeded random
/// draws (each instance draws from its own stream, in program order), scheduling intrinsics.
pub fn is_pure_op(op: &OpDef) -> bool {
    !(op.name.starts_with("random.") || op.name.starts_with("db."))
}

/// Operators a block may hold: pure ones whose result shapes follow from their operands' shapes.
/// A block's result shapes are computed before it runs, to group its invocations; `arange`'s
/// length is known only from its operands' values, so it runs as an operator call of its own.
pub fn joins_blocks(op: &OpDef) -> bool {
    is_pure_op(op) && !op.sized_by_values
}
