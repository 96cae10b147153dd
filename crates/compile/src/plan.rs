//! Block kernel plans: how a static block runs for a launch, decided once per program.
//!
//! A plan splits the block's operators into stages: **dense** stages (`nn.dense` with a shared
//! weight: one matrix product over every invocation's rows), **row programs** (maximal runs of
//! elementwise / broadcast / bias / activation / split / concatenate / softmax / layer-norm operators
//! along the last axis, stitched into one pass per output row), **gathers** (embedding lookups),
//! **direct products** and **other** operators, which run through the batching rules. Which stage
//! an operator can join is data in the operator table ([`tumble_ops::StageRule`]), not a list of
//! names here. The plan also records liveness (which values leave their stage), the row programs'
//! external operands, and which GEMM stages run the following row program as their epilogue.
//!
//! The plan is static: it depends on the block only, never on a launch's values. Whether a stage's
//! fast path applies (f32, shapes that line up, shared weights) is decided by the runtime at each
//! launch, which falls back to the batching rules, so a plan never changes results beyond float
//! rounding. The runtime executes plans (`tumble_runtime::fused`) and owns their caches.
//!
//! This is ACROBAT's kernel generation for whole static blocks (seed 000 §5; the fusion of
//! elementwise tails follows BladeDISC/TAO's fusion stitching, seeds 004/001; horizontal fusion
//! is ACROBAT appendix B.1, Fig. 9).

use std::fmt;

use tumble_ir::{DType, Ty};
use tumble_ops::StageRule;
use tumble_tensor::Tensor;

use crate::{BArg, BVal, Block, BlockNode, Program};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Stage {
    Dense(usize),
    /// Horizontal fusion: `nn.dense` nodes reading the same rows with different weights (LSTM
    /// gates, Q/K/V projections), run as one GEMM over their concatenated weights.
    HDense(Vec<usize>),
    /// `take(table, ids, axis=0)` of a shared table by batched ids: row copies.
    Gather(usize),
    /// `nn.dense(X, transpose(concatenate((Y_1, ..), axis=0)))` = `X · [Y_1; ..]` (MV-RNN's
    /// `W_M · [A; B]`) with a shared `X`: per invocation, the `Y` rows are packed straight into
    /// the GEMM's weight panels, so the concatenation and transpose (which nothing else reads)
    /// are never materialized. `concat` is `None` for `nn.dense(X, transpose(Y))`.
    MatMul {
        dense: usize,
        transpose: usize,
        concat: Option<usize>,
    },
    /// A sum of products as one GEMM: `add` (or last-axis `nn.bias_add`) nodes (`adds`; the
    /// last is the result, the others read only by the next) summing f32 `nn.dense` nodes (`denses`) whose weights are block
    /// inputs or constants, each dense read only by its `add`; a dense's rows may be a
    /// `concatenate` along the last axis (`concats`) that nothing else reads. One GEMM runs
    /// over the K-concatenation of every term's rows (each concatenation's parts read where
    /// they lie) against the weights' column blocks: neither the concatenation nor the terms
    /// are materialized. An RNN cell written plainly, `dense(x, W) + dense(h, U)` or
    /// `dense(concatenate((s, x)), W) + dense(h, U)`, is one product with `K = Σ K_i`. Without
    /// `adds`, one dense over a concatenation.
    DenseSum {
        denses: Vec<usize>,
        concats: Vec<usize>,
        adds: Vec<usize>,
        /// Per product (in `denses` order), its rows' parts: the one value it reads, or its
        /// concatenation's parts, in order (each a part of the GEMM's K).
        parts: Vec<Vec<BVal>>,
        /// The adds' operands that are neither products nor adds of the stage, added to the
        /// product's rows in this order.
        addends: Vec<BVal>,
    },
    Rows(Vec<usize>),
    Other(usize),
}

/// Switches of the plan-level optimizations (each can be turned off; results do not change).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PlanOptions {
    /// Horizontal fusion of denses that share their input rows (off: one GEMM per dense).
    pub hfuse: bool,
    /// Run a row program that only a GEMM stage feeds as that GEMM's epilogue, on each block of
    /// output rows while it is in cache (off: the product is stored whole, then the row program
    /// runs as a separate pass).
    pub epilogue: bool,
    /// Products by a transposed (concatenation of) per-invocation matrices pack those matrices'
    /// rows straight into the GEMM ([`Stage::MatMul`]; off: concatenate, transpose, multiply
    /// with swapped operands, transpose back).
    pub direct_matmul: bool,
    /// An embedding lookup with one index per invocation (`take(table, id, axis=0)`) yields
    /// references to the table's rows instead of a gathered copy; GEMMs, row programs, direct
    /// products, reshapes and the next launches read them in place ([`gather_stage`]).
    pub gather_views: bool,
    /// Sums of products (and products over a concatenation) as one GEMM ([`Stage::DenseSum`];
    /// off: each product on its own, the concatenation copied, the sum a row program).
    pub dense_sums: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            hfuse: true,
            epilogue: true,
            direct_matmul: true,
            gather_views: true,
            dense_sums: true,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BlockPlan {
    pub stages: Vec<Stage>,
    /// Nodes whose value is read after their stage (by a later stage or as a block output).
    pub live_out: Vec<bool>,
    /// Per stage, the external operands of its row program (empty for other stages).
    pub row_ops: Vec<RowOperands>,
    /// Per stage: a GEMM stage whose results only the next stage, a row program, reads; that row
    /// program runs as its epilogue.
    pub epilogue: Vec<bool>,
    /// [`PlanOptions::gather_views`].
    pub gather_views: bool,
}

impl fmt::Display for BlockPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, s) in self.stages.iter().enumerate() {
            let fused_tail = k > 0 && self.epilogue.get(k - 1).copied().unwrap_or(false);
            match s {
                Stage::Dense(n) => writeln!(f, "    gemm      %{n}")?,
                Stage::HDense(ns) => writeln!(
                    f,
                    "    gemm      {}  (horizontally fused)",
                    ns.iter()
                        .map(|n| format!("%{n}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                )?,
                Stage::Gather(n) => writeln!(f, "    gather    %{n}")?,
                Stage::MatMul {
                    dense,
                    transpose,
                    concat,
                } => writeln!(
                    f,
                    "    matmul    {}%{transpose} %{dense}  (rows packed in place: no concatenation or transpose)",
                    concat.map(|c| format!("%{c} ")).unwrap_or_default()
                )?,
                Stage::DenseSum {
                    denses,
                    concats,
                    adds,
                    ..
                } => {
                    let list = |ns: &[usize]| {
                        ns.iter()
                            .map(|n| format!("%{n}"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    };
                    write!(f, "    gemm      {}", list(denses))?;
                    if !adds.is_empty() {
                        write!(f, " summed by {}", list(adds))?;
                    }
                    if !concats.is_empty() {
                        write!(f, "  (rows of {} read in place)", list(concats))?;
                    }
                    writeln!(f)?
                }
                Stage::Rows(ns) => writeln!(
                    f,
                    "    {}  {}",
                    if fused_tail { "epilogue" } else { "row-prog" },
                    ns.iter()
                        .map(|n| format!("%{n}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                )?,
                Stage::Other(n) => writeln!(f, "    batched   %{n}")?,
            }
        }
        Ok(())
    }
}

fn rank(t: &Ty) -> Option<usize> {
    t.as_tensor().map(|(d, _)| d.len())
}

fn is_f32(t: &Ty) -> bool {
    match t {
        Ty::Tensor { dtype, .. } => *dtype == DType::Float32,
        Ty::Tuple(ts) => ts.iter().all(is_f32),
        _ => false,
    }
}

/// The axis attribute names the last axis of a rank-`r` tensor.
fn last_axis(node: &BlockNode, default: i64, r: usize) -> bool {
    let a = node.attrs.int("axis").ok().flatten().unwrap_or(default);
    a == -1 || (r > 0 && a == r as i64 - 1)
}

fn is_row_op(node: &BlockNode) -> bool {
    if !is_f32(&node.ty) {
        return false;
    }
    let r = match &node.ty {
        Ty::Tuple(ts) => ts.first().and_then(rank).unwrap_or(0),
        t => rank(t).unwrap_or(0),
    };
    match node.op.stage {
        StageRule::RowWise => r >= 1,
        StageRule::RowWiseOnLastAxis { default_axis } => r >= 1 && last_axis(node, default_axis, r),
        StageRule::Gemm | StageRule::Gather | StageRule::Batched => false,
    }
}

/// Groups of two or more f32 `nn.dense` nodes with the same first operand and a weight that is a
/// block input or a constant (so it is ready wherever the group runs), in node order.
fn hfuse_groups(block: &Block) -> Vec<Vec<usize>> {
    let mut groups: Vec<(ValKey, Vec<usize>)> = Vec::new();
    for (i, node) in block.nodes.iter().enumerate() {
        if node.op.stage != StageRule::Gemm || !is_f32(&node.ty) {
            continue;
        }
        let (Some(BArg::One(a)), Some(BArg::One(w)), 2) =
            (node.args.first(), node.args.get(1), node.args.len())
        else {
            continue;
        };
        if !matches!(w, BVal::Input(_) | BVal::Const(_)) {
            continue;
        }
        let key = ValKey::of(a);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    groups
        .into_iter()
        .map(|(_, g)| g)
        .filter(|g| g.len() >= 2)
        .collect()
}

/// The products [`Stage::MatMul`] runs: an f32 `nn.dense` whose weight is a 2-D `transpose`
/// (axes `[1, 0]`) of a value or of a `concatenate` along axis 0, each read by nothing else.
fn direct_matmuls(block: &Block) -> Vec<Stage> {
    let mut readers = vec![0usize; block.nodes.len()];
    let mut count = |v: &BVal| {
        if let BVal::Node(k) | BVal::Field(k, _) = v {
            if let Some(r) = readers.get_mut(*k as usize) {
                *r += 1;
            }
        }
    };
    for node in &block.nodes {
        for a in &node.args {
            match a {
                BArg::One(v) => count(v),
                BArg::Tuple(vs) => vs.iter().for_each(&mut count),
            }
        }
    }
    block.outputs.iter().for_each(&mut count);
    let only_reader = |k: u32| readers.get(k as usize) == Some(&1);
    let mut out = Vec::new();
    for (i, node) in block.nodes.iter().enumerate() {
        if node.op.stage != StageRule::Gemm || !is_f32(&node.ty) || rank(&node.ty) != Some(2) {
            continue;
        }
        let Some(BArg::One(BVal::Node(t))) = node.args.get(1) else {
            continue;
        };
        let Some(tn) = block.nodes.get(*t as usize) else {
            continue;
        };
        let swaps = match tn.attrs.ints("axes") {
            Ok(None) => true,
            Ok(Some(a)) => {
                a.is_empty() || a == [1, 0] || a == [-1, -2] || a == [1, -2] || a == [-1, 0]
            }
            Err(_) => false,
        };
        if tn.op.name != "transpose" || rank(&tn.ty) != Some(2) || !swaps || !only_reader(*t) {
            continue;
        }
        let Some(BArg::One(y)) = tn.args.first() else {
            continue;
        };
        let concat = match y {
            BVal::Node(c) => block.nodes.get(*c as usize).and_then(|cn| {
                let axis = cn.attrs.int("axis").ok().flatten().unwrap_or(0);
                (cn.op.name == "concatenate"
                    && (axis == 0 || axis == -2)
                    && rank(&cn.ty) == Some(2)
                    && only_reader(*c)
                    && matches!(cn.args.first(), Some(BArg::Tuple(_))))
                .then_some(*c as usize)
            }),
            _ => None,
        };
        out.push(Stage::MatMul {
            dense: i,
            transpose: *t as usize,
            concat,
        });
    }
    out
}

/// Per node, the nodes that read it, once per read (`usize::MAX` for a block output).
fn node_readers(block: &Block) -> Vec<Vec<usize>> {
    let mut readers = vec![Vec::new(); block.nodes.len()];
    let mut note = |v: &BVal, by: usize| {
        if let BVal::Node(k) | BVal::Field(k, _) = v {
            if let Some(r) = readers.get_mut(*k as usize) {
                r.push(by);
            }
        }
    };
    for (i, node) in block.nodes.iter().enumerate() {
        for a in &node.args {
            match a {
                BArg::One(v) => note(v, i),
                BArg::Tuple(vs) => vs.iter().for_each(|v| note(v, i)),
            }
        }
    }
    for v in &block.outputs {
        note(v, usize::MAX);
    }
    readers
}

/// The [`Stage::DenseSum`]s of a block: maximal trees of `add`s over at least two products (or
/// one product over a concatenation), other addends allowed (a bias, a row computed earlier:
/// added to the product's rows); `taken` are the denses other stages run (horizontal fusion).
fn dense_sums(block: &Block, taken: &[usize]) -> Vec<Stage> {
    let readers = node_readers(block);
    let only_reader = |k: usize, by: usize| readers.get(k).is_some_and(|r| r.as_slice() == [by]);
    let node = |k: usize| block.nodes.get(k);
    let rank2_f32 = |n: &BlockNode| is_f32(&n.ty) && rank(&n.ty) == Some(2);
    // A dense this stage can take (read only by `by`; `None`: the stage's result, whoever reads
    // it), and the concatenation of its rows if it reads one along the last axis that nothing
    // else reads.
    let product = |d: usize, by: Option<usize>| -> Option<Option<usize>> {
        let n = node(d)?;
        if n.op.stage != StageRule::Gemm
            || n.op.name != "nn.dense"
            || !rank2_f32(n)
            || taken.contains(&d)
            || by.is_some_and(|by| !only_reader(d, by))
        {
            return None;
        }
        let (Some(BArg::One(a)), Some(BArg::One(BVal::Input(_) | BVal::Const(_))), 2) =
            (n.args.first(), n.args.get(1), n.args.len())
        else {
            return None;
        };
        let concat = match a {
            BVal::Node(c) => node(*c as usize).and_then(|cn| {
                let r = rank(&cn.ty)?;
                (cn.op.name == "concatenate"
                    && rank2_f32(cn)
                    && last_axis(cn, 0, r)
                    && only_reader(*c as usize, d)
                    && matches!(cn.args.first(), Some(BArg::Tuple(vs)) if vs.len() >= 2))
                .then_some(*c as usize)
            }),
            _ => None,
        };
        Some(concat)
    };
    // `add`, or `nn.bias_add` along the last axis (its bias an addend like any other).
    let is_add = |n: &BlockNode| {
        rank2_f32(n)
            && n.args.len() == 2
            && (n.op.name == "add" || (n.op.name == "nn.bias_add" && last_axis(n, 1, 2)))
    };
    let mut stages = Vec::new();
    let mut absorbed = vec![false; block.nodes.len()];
    for root in (0..block.nodes.len()).rev() {
        let Some(rn) = node(root) else { continue };
        if absorbed.get(root).copied().unwrap_or(true) {
            continue;
        }
        let (mut denses, mut concats, mut adds) = (Vec::new(), Vec::new(), Vec::new());
        if is_add(rn) {
            // Walk the tree: an operand is a product, an inner add of the same type read only
            // here, or another addend (a bias, rows computed earlier), added to the product's
            // rows as it is.
            let mut work = vec![root];
            while let Some(a) = work.pop() {
                adds.push(a);
                let Some(an) = node(a) else { continue };
                for arg in &an.args {
                    let BArg::One(BVal::Node(k)) = arg else {
                        continue;
                    };
                    let k = *k as usize;
                    if let Some(c) = product(k, Some(a)) {
                        denses.push(k);
                        concats.extend(c);
                    } else if node(k).is_some_and(|kn| is_add(kn) && kn.ty == an.ty)
                        && only_reader(k, a)
                    {
                        work.push(k);
                    }
                }
            }
        } else if let Some(Some(c)) = product(root, None) {
            denses.push(root);
            concats.push(c);
        }
        if denses.len() < 2 && concats.is_empty() {
            // A walk from any add of this tree finds only some of these products, so fewer than
            // two as well: its adds are not walked again (a chain of n adds walked from each of
            // its adds in turn took n² steps).
            for &a in &adds {
                if let Some(slot) = absorbed.get_mut(a) {
                    *slot = true;
                }
            }
            continue;
        }
        denses.sort_unstable();
        concats.sort_unstable();
        adds.sort_unstable();
        let parts: Vec<Vec<BVal>> = denses
            .iter()
            .map(|&d| match node(d).and_then(|n| n.args.first()) {
                Some(BArg::One(BVal::Node(c))) if concats.contains(&(*c as usize)) => {
                    match node(*c as usize).and_then(|cn| cn.args.first()) {
                        Some(BArg::Tuple(vs)) => vs.clone(),
                        _ => Vec::new(),
                    }
                }
                Some(BArg::One(v)) => vec![v.clone()],
                _ => Vec::new(),
            })
            .collect();
        let inside = |v: &BVal| matches!(v, BVal::Node(k) if denses.contains(&(*k as usize)) || adds.contains(&(*k as usize)));
        let addends: Option<Vec<BVal>> = adds
            .iter()
            .filter_map(|&a| node(a))
            .flat_map(|an| an.args.iter())
            .filter_map(|arg| match arg {
                BArg::One(v) if inside(v) => None,
                BArg::One(v) => Some(Some(v.clone())),
                BArg::Tuple(_) => Some(None),
            })
            .collect();
        let (Some(addends), false) = (addends, parts.iter().any(Vec::is_empty)) else {
            continue;
        };
        for &k in denses.iter().chain(&concats).chain(&adds) {
            if let Some(slot) = absorbed.get_mut(k) {
                *slot = true;
            }
        }
        stages.push(Stage::DenseSum {
            denses,
            concats,
            adds,
            parts,
            addends,
        });
    }
    stages
}

/// The plan of every block of `program`, in block order. In debug builds each plan is checked
/// against its block ([`BlockPlan::verify`]); a broken one is a planner bug.
pub fn plan_program(program: &Program, opts: PlanOptions) -> Vec<BlockPlan> {
    let plans: Vec<BlockPlan> = program.blocks.iter().map(|b| plan_with(b, opts)).collect();
    if cfg!(debug_assertions) {
        for (block, plan) in program.blocks.iter().zip(&plans) {
            let errors = plan.verify(block);
            assert!(
                errors.is_empty(),
                "internal: the plan of block `{}` is inconsistent with it:\n{}",
                block.name,
                errors.join("\n")
            );
        }
    }
    plans
}

impl BlockPlan {
    /// A plan read back from a file, made whole for `block` (read back with it): the row
    /// programs' operand identities, which refer to where the block's constants lie.
    pub fn restore(&mut self, block: &Block) {
        for (st, ops) in self.stages.iter().zip(self.row_ops.iter_mut()) {
            if let Stage::Rows(ns) = st {
                *ops = row_operands(block, ns);
            }
        }
    }

    /// Every way the plan disagrees with `block` (empty: consistent): each node computed by
    /// exactly one stage; a stage reads only nodes of earlier stages or its own (so running the
    /// stages in order never reads a value not yet computed); the per-stage tables as long as
    /// the stages; every value read after its stage kept; an epilogue only where the planner
    /// would put one ([`can_run_as_epilogue`]).
    pub fn verify(&self, block: &Block) -> Vec<String> {
        let n = block.nodes.len();
        let mut errors = Vec::new();
        let mut stage_of: Vec<Option<usize>> = vec![None; n];
        for (s, st) in self.stages.iter().enumerate() {
            for i in st.nodes() {
                match stage_of.get_mut(i) {
                    None => errors.push(format!("stage {s} names node %{i} of {n}")),
                    Some(Some(t)) => {
                        errors.push(format!("node %{i} is computed by stages {t} and {s}"))
                    }
                    Some(slot) => *slot = Some(s),
                }
            }
        }
        for (i, st) in stage_of.iter().enumerate() {
            let Some(s) = st else {
                errors.push(format!("node %{i} is computed by no stage"));
                continue;
            };
            let Some(node) = block.nodes.get(i) else {
                continue;
            };
            for a in &node.args {
                for v in a.values() {
                    if let BVal::Node(k) | BVal::Field(k, _) = v {
                        if let Some(Some(t)) = stage_of.get(*k as usize) {
                            if t > s {
                                errors.push(format!(
                                    "node %{i} (stage {s}) reads %{k}, computed later by stage {t}"
                                ));
                            }
                        }
                    }
                }
            }
        }
        let stages = self.stages.len();
        if self.row_ops.len() != stages || self.epilogue.len() != stages || self.live_out.len() != n
        {
            errors.push(format!(
                "tables: {} row-operand lists and {} epilogue flags for {stages} stages, {} \
                 liveness flags for {n} nodes",
                self.row_ops.len(),
                self.epilogue.len(),
                self.live_out.len()
            ));
        }
        if !errors.is_empty() {
            return errors;
        }
        // What is read outside its stage must be kept past it, and an epilogue must be a GEMM
        // stage followed by a row program that alone reads its results (they are never
        // materialized): a plan read back from a file that says otherwise would stop a launch
        // on a value it did not keep.
        let (_, readers) = stage_readers(block, &self.stages);
        for (i, r) in readers.iter().enumerate() {
            if !r.is_empty() && !self.live_out.get(i).copied().unwrap_or(false) {
                errors.push(format!(
                    "node %{i} is read after its stage but not kept (liveness)"
                ));
            }
        }
        for (s, &e) in self.epilogue.iter().enumerate() {
            if e && !can_run_as_epilogue(&self.stages, &readers, s) {
                errors.push(format!(
                    "stage {s} runs as an epilogue, but its results are read elsewhere too or \
                     it is not a GEMM stage followed by a row program"
                ));
            }
        }
        errors
    }

    /// Per stage, the nodes whose values no later stage and no block output reads: an executor
    /// may drop them once the stage has run (a GEMM stage and the row program run as its
    /// epilogue count as one: the epilogue stage's list covers both). A pure function of the plan
    /// and its block, computed once per job by the runtime.
    pub fn dead_after(&self, block: &Block) -> Vec<Vec<usize>> {
        let (stage_of, readers) = stage_readers(block, &self.stages);
        let mut dead = vec![Vec::new(); self.stages.len()];
        for (k, (&own, r)) in stage_of.iter().zip(&readers).enumerate() {
            // A block output lives on; anything else after its last reader (its own stage when
            // nothing else reads it).
            if r.contains(&usize::MAX) {
                continue;
            }
            let last = r.iter().copied().fold(own, usize::max);
            // A GEMM stage's values are read by its epilogue, which runs with it.
            let last = last + usize::from(self.epilogue.get(last).copied().unwrap_or(false));
            if let Some(d) = dead.get_mut(last) {
                d.push(k);
            }
        }
        dead
    }
}

/// Whether GEMM stage `s` can run as the next stage's epilogue: the next stage is a row program
/// and it alone reads the GEMM's results (`readers` from [`stage_readers`]), which are then never
/// materialized. The planner's rule, and what the verifier holds a plan read back to.
fn can_run_as_epilogue(stages: &[Stage], readers: &[Vec<usize>], s: usize) -> bool {
    let root;
    let members: &[usize] = match stages.get(s) {
        Some(Stage::Dense(i)) => std::slice::from_ref(i),
        Some(Stage::HDense(ns)) => ns,
        Some(st @ Stage::DenseSum { .. }) => match st.result() {
            Some(r) => {
                root = r;
                std::slice::from_ref(&root)
            }
            None => return false,
        },
        _ => return false,
    };
    matches!(stages.get(s + 1), Some(Stage::Rows(_)))
        && members.iter().all(|&k| {
            let r = readers.get(k).map_or(&[][..], Vec::as_slice);
            !r.is_empty() && r.iter().all(|&si| si == s + 1)
        })
}

/// For `stages` of `block`: the stage that computes each node, and per node the other stages
/// that read it (`usize::MAX` for "a block output").
fn stage_readers(block: &Block, stages: &[Stage]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let n = block.nodes.len();
    let mut stage_of = vec![0usize; n];
    for (s, st) in stages.iter().enumerate() {
        for i in st.nodes() {
            if let Some(slot) = stage_of.get_mut(i) {
                *slot = s;
            }
        }
    }
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in block.nodes.iter().enumerate() {
        let Some(&si) = stage_of.get(i) else {
            continue;
        };
        for a in &node.args {
            let vals = match a {
                BArg::One(v) => std::slice::from_ref(v),
                BArg::Tuple(vs) => vs.as_slice(),
            };
            for k in vals.iter().filter_map(BVal::node) {
                if stage_of.get(k) != Some(&si) {
                    if let Some(r) = readers.get_mut(k) {
                        r.push(si);
                    }
                }
            }
        }
    }
    for k in block.outputs.iter().filter_map(BVal::node) {
        if let Some(r) = readers.get_mut(k) {
            r.push(usize::MAX);
        }
    }
    (stage_of, readers)
}

impl Stage {
    /// The node whose value a [`Stage::DenseSum`] yields: its last add, or its one product.
    pub fn result(&self) -> Option<usize> {
        match self {
            Stage::DenseSum { denses, adds, .. } => adds.last().or(denses.last()).copied(),
            _ => None,
        }
    }

    /// The block nodes this stage computes.
    pub fn nodes(&self) -> Vec<usize> {
        match self {
            Stage::Dense(i) | Stage::Gather(i) | Stage::Other(i) => vec![*i],
            Stage::HDense(ns) | Stage::Rows(ns) => ns.clone(),
            Stage::DenseSum {
                denses,
                concats,
                adds,
                ..
            } => {
                let mut all: Vec<usize> =
                    concats.iter().chain(denses).chain(adds).copied().collect();
                all.sort_unstable();
                all
            }
            Stage::MatMul {
                dense,
                transpose,
                concat,
            } => [*concat, Some(*transpose), Some(*dense)]
                .into_iter()
                .flatten()
                .collect(),
        }
    }
}

/// Makes the plan of a block, with every plan-level optimization on.
pub fn plan(block: &Block) -> BlockPlan {
    plan_with(block, PlanOptions::default())
}

/// Makes the plan of a block.
pub fn plan_with(block: &Block, opts: PlanOptions) -> BlockPlan {
    let groups = if opts.hfuse {
        hfuse_groups(block)
    } else {
        Vec::new()
    };
    let matmuls = if opts.direct_matmul {
        direct_matmuls(block)
    } else {
        Vec::new()
    };
    let sums = if opts.dense_sums {
        let fused: Vec<usize> = groups.iter().flatten().copied().collect();
        dense_sums(block, &fused)
    } else {
        Vec::new()
    };
    let absorbed = |i: usize| {
        matmuls.iter().any(|m| match m {
            Stage::MatMul {
                transpose, concat, ..
            } => *transpose == i || *concat == Some(i),
            _ => false,
        })
    };
    let mut stages: Vec<Stage> = Vec::new();
    for (i, node) in block.nodes.iter().enumerate() {
        if absorbed(i) {
            // Computed inside the product that alone reads it.
            continue;
        }
        if let Some(sum) = sums.iter().find(|st| st.nodes().contains(&i)) {
            // The sum runs where its result is computed: every operand of its members is
            // computed before that, and nothing but the sum reads its other members.
            if sum.result() == Some(i) {
                stages.push(sum.clone());
            }
            continue;
        }
        if let Some(m) = matmuls
            .iter()
            .find(|m| matches!(m, Stage::MatMul { dense, .. } if *dense == i))
        {
            stages.push(m.clone());
        } else if let Some(g) = groups.iter().find(|g| g.contains(&i)) {
            // The group runs where its first member was: its input rows are ready there and its
            // weights are block inputs or constants, ready from the start. Later members' results
            // are then ready before anything reads them.
            if g.first() == Some(&i) {
                stages.push(Stage::HDense(g.clone()));
            }
        } else if node.op.stage == StageRule::Gemm && is_f32(&node.ty) {
            stages.push(Stage::Dense(i));
        } else if node.op.stage == StageRule::Gather
            && node.attrs.int("axis").ok().flatten() == Some(0)
            && node.attrs.int("batch_dims").ok().flatten().unwrap_or(0) == 0
        {
            stages.push(Stage::Gather(i));
        } else if is_row_op(node) {
            match stages.last_mut() {
                Some(Stage::Rows(ns)) => ns.push(i),
                _ => stages.push(Stage::Rows(vec![i])),
            }
        } else {
            stages.push(Stage::Other(i));
        }
    }
    // Which nodes are read outside their own stage.
    let (_, readers) = stage_readers(block, &stages);
    let live_out: Vec<bool> = readers.iter().map(|r| !r.is_empty()).collect();
    let epilogue = (0..stages.len())
        .map(|s| opts.epilogue && can_run_as_epilogue(&stages, &readers, s))
        .collect();
    let row_ops = stages
        .iter()
        .map(|st| match st {
            Stage::Rows(ns) => row_operands(block, ns),
            _ => RowOperands::default(),
        })
        .collect();
    BlockPlan {
        stages,
        live_out,
        row_ops,
        epilogue,
        gather_views: opts.gather_views,
    }
}

/// The external operands of a row-program stage, in first-use order, computed once per plan.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RowOperands {
    pub vals: Vec<BVal>,
    /// Identities of `vals` in the block (constants by address): not written to files;
    /// [`BlockPlan::restore`] recomputes them for the block a plan is read back with.
    #[serde(skip)]
    pub keys: Vec<ValKey>,
}

pub fn row_operands(block: &Block, ns: &[usize]) -> RowOperands {
    let mut ops = RowOperands::default();
    // Membership by a set of the stage's own nodes (a search of `ns` per operand made a stage of n
    // operators cost n²; a flag per block node would cost the block's size per stage).
    let member: std::collections::HashSet<usize> = ns.iter().copied().collect();
    let in_segment = |v: &BVal| matches!(v, BVal::Node(k) | BVal::Field(k, _) if member.contains(&(*k as usize)));
    for &i in ns {
        let Some(node) = block.nodes.get(i) else {
            continue;
        };
        for a in &node.args {
            for v in a.values() {
                let key = ValKey::of(v);
                if in_segment(v) || ops.keys.contains(&key) {
                    continue;
                }
                ops.keys.push(key);
                ops.vals.push(v.clone());
            }
        }
    }
    ops
}

/// Identity of a block value, to find an operand seen before (constants by their own identity:
/// two literals that print alike are still different values).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ValKey {
    Input(u32),
    Node(u32),
    Field(u32, u32),
    Const(usize),
}

impl ValKey {
    pub fn of(v: &BVal) -> ValKey {
        match v {
            BVal::Input(i) => ValKey::Input(*i),
            BVal::Node(n) => ValKey::Node(*n),
            BVal::Field(n, f) => ValKey::Field(*n, *f),
            BVal::Const(t) => ValKey::Const(t as *const Tensor as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lower::LowerOptions;

    fn block_of(src: &str, name: &str) -> Block {
        let mut sources = tumble_ir::SourceMap::new();
        let typed = tumble_check::load(&mut sources, "t.rly", src, Default::default())
            .unwrap_or_else(|e| panic!("{e:?}"));
        let program = Program::lower_with(&typed, LowerOptions::batched())
            .unwrap_or_else(|e| panic!("{e:?}"));
        program
            .blocks
            .into_iter()
            .find(|b| b.name == name)
            .unwrap_or_else(|| panic!("no block {name}"))
    }

    const CELL: &str = "def @cell(%x: Tensor[(1, 4), float32], %w: Tensor[(3, 4), float32], \
                        %u: Tensor[(3, 4), float32], Primitive=1) {
                          let %a = nn.dense(%x, %w);
                          let %b = nn.dense(%x, %u);
                          nn.softmax(tanh(add(%a, %b)))
                        }
                        def @main(%x: Tensor[(1, 4), float32]) { %x }";

    #[test]
    fn stages_come_from_the_op_table_and_verify() {
        let block = block_of(CELL, "cell");
        let plan = plan_with(&block, PlanOptions::default());
        assert!(plan.verify(&block).is_empty(), "{:?}", plan.verify(&block));
        let shown = plan.to_string();
        assert!(shown.contains("horizontally fused"), "{shown}");
        assert!(shown.contains("epilogue"), "{shown}");
        let apart = plan_with(
            &block,
            PlanOptions {
                hfuse: false,
                epilogue: false,
                dense_sums: false,
                ..PlanOptions::default()
            },
        );
        assert!(apart.verify(&block).is_empty());
        assert_eq!(
            apart
                .stages
                .iter()
                .filter(|s| matches!(s, Stage::Dense(_)))
                .count(),
            2
        );
    }

    #[test]
    fn sums_of_products_are_found_only_where_nothing_else_reads_their_terms() {
        let src = "def @step(%x: Tensor[(1, 4), float32], %h: Tensor[(1, 4), float32], \
                   %w: Tensor[(3, 8), float32], %u: Tensor[(3, 4), float32], \
                   %v: Tensor[(3, 4), float32], Primitive=1) {
                     let %p = nn.dense(concatenate((%x, %h), axis=1), %w);
                     let %q = nn.dense(%h, %u);
                     let %r = nn.dense(%x, %v);
                     (tanh(add(add(%p, %q), %r)), add(%q, %r))
                   }
                   def @main(%x: Tensor[(1, 4), float32]) { %x }";
        let block = block_of(src, "step");
        let plan = plan_with(&block, PlanOptions::default());
        assert!(plan.verify(&block).is_empty(), "{:?}", plan.verify(&block));
        // %q and %r are read twice: the first sum takes them as addends (computed by stages
        // of their own), its one product is the one over the concatenation; the second add
        // sums two products read elsewhere too, so it is no sum stage.
        let sums: Vec<&Stage> = plan
            .stages
            .iter()
            .filter(|s| matches!(s, Stage::DenseSum { .. }))
            .collect();
        assert_eq!(sums.len(), 1, "{plan}");
        let Stage::DenseSum {
            denses,
            concats,
            adds,
            parts,
            addends,
        } = sums[0]
        else {
            unreachable!()
        };
        assert_eq!(
            (denses.len(), concats.len(), adds.len()),
            (1, 1, 2),
            "{plan}"
        );
        // The product's rows are the concatenation's two parts; %q and %r are the addends.
        assert_eq!(
            parts.iter().map(Vec::len).collect::<Vec<_>>(),
            [2],
            "{plan}"
        );
        assert_eq!(addends.len(), 2, "{plan}");
        let off = plan_with(
            &block,
            PlanOptions {
                dense_sums: false,
                ..PlanOptions::default()
            },
        );
        assert!(off.verify(&block).is_empty());
        assert!(!off.to_string().contains("read in place"), "{off}");
    }

    #[test]
    fn values_die_after_their_last_reader_and_outputs_never() {
        // %a feeds a later stage (after a batched transpose); %t is an output.
        let src =
            "def @blk(%x: Tensor[(2, 4), float32], %w: Tensor[(3, 4), float32], Primitive=1) {
                     let %a = nn.dense(%x, %w);
                     let %t = transpose(%a, axes=[1, 0]);
                     let %s = nn.softmax(%a);
                     (%t, sum(%s))
                   }
                   def @main(%x: Tensor[(2, 4), float32]) { %x }";
        let block = block_of(src, "blk");
        for opts in [
            PlanOptions::default(),
            PlanOptions {
                epilogue: false,
                ..PlanOptions::default()
            },
        ] {
            let plan = plan_with(&block, opts);
            let dead = plan.dead_after(&block);
            assert_eq!(dead.len(), plan.stages.len());
            let stage_of = |k: usize| plan.stages.iter().position(|st| st.nodes().contains(&k));
            let outputs: Vec<usize> = block
                .outputs
                .iter()
                .filter_map(|v| match v {
                    BVal::Node(k) | BVal::Field(k, _) => Some(*k as usize),
                    _ => None,
                })
                .collect();
            for (s, ks) in dead.iter().enumerate() {
                for &k in ks {
                    assert!(!outputs.contains(&k), "output %{k} dropped after stage {s}");
                    // Dead only after every stage that reads it.
                    for (i, node) in block.nodes.iter().enumerate() {
                        let reads = node.args.iter().any(|a| match a {
                            BArg::One(v) => matches!(v, BVal::Node(n) | BVal::Field(n, _) if *n as usize == k),
                            BArg::Tuple(vs) => vs.iter().any(|v| matches!(v, BVal::Node(n) | BVal::Field(n, _) if *n as usize == k)),
                        });
                        if reads {
                            let r = stage_of(i).expect("every node has a stage");
                            assert!(r <= s, "%{k} dropped after stage {s} but read by stage {r}");
                        }
                    }
                }
            }
            // The dense's value is read twice and dropped once.
            let a = block
                .nodes
                .iter()
                .position(|n| n.op.name == "nn.dense")
                .expect("a dense");
            assert_eq!(
                dead.iter().flatten().filter(|&&k| k == a).count(),
                1,
                "{dead:?}"
            );
        }
    }

    #[test]
    fn the_verifier_rejects_broken_plans() {
        let block = block_of(CELL, "cell");
        let good = plan_with(&block, PlanOptions::default());
        // A node left out.
        let mut missing = good.clone();
        missing.stages.pop();
        missing.row_ops.pop();
        missing.epilogue.pop();
        assert!(missing
            .verify(&block)
            .iter()
            .any(|e| e.contains("computed by no stage")));
        // Stages reversed: a stage reads what a later one computes.
        let mut reversed = good.clone();
        reversed.stages.reverse();
        reversed.epilogue = vec![false; reversed.stages.len()];
        assert!(reversed
            .verify(&block)
            .iter()
            .any(|e| e.contains("computed later")));
        // A node in two stages.
        let mut twice = good.clone();
        twice.stages.push(Stage::Other(0));
        twice.row_ops.push(RowOperands::default());
        twice.epilogue.push(false);
        assert!(twice.verify(&block).iter().any(|e| e.contains("stages")));
        // A value read after its stage not kept (an altered file: the launch stopped with
        // "block value %k is not available", exit 70).
        assert!(good.verify(&block).is_empty(), "{:?}", good.verify(&block));
        let kept = good
            .live_out
            .iter()
            .position(|&l| l)
            .expect("a value kept past its stage");
        let mut dropped = good.clone();
        dropped.live_out[kept] = false;
        assert!(
            dropped.verify(&block).iter().any(|e| e.contains(&format!(
                "node %{kept} is read after its stage but not kept"
            ))),
            "{:?}",
            dropped.verify(&block)
        );
        // An epilogue on a GEMM stage whose results a later stage or the outputs read too.
        {
            let s = good
                .epilogue
                .iter()
                .position(|&e| e)
                .expect("the cell's product runs as an epilogue");
            let mut block2 = block.clone();
            let member = match &good.stages[s] {
                Stage::Dense(i) => *i,
                Stage::HDense(ns) => ns[0],
                st => st.result().expect("a GEMM stage's result"),
            };
            block2.outputs.push(BVal::Node(member as u32));
            let mut wide = good.clone();
            wide.live_out[member] = true;
            assert!(
                wide.verify(&block2)
                    .iter()
                    .any(|e| e.contains("runs as an epilogue, but its results are read elsewhere")),
                "{:?}",
                wide.verify(&block2)
            );
        }
    }
}
