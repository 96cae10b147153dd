//! Block kernel plans (kernels issue, item 1): how a static block runs for a launch.
//!
//! A plan splits the block's operators into stages: **dense** stages (`nn.dense` with a shared
//! weight: one matrix product over every invocation's rows), **row programs** (maximal runs of
//! elementwise / broadcast / bias / activation / split / concatenate / softmax / layer-norm operators
//! along the last axis, stitched into one pass per output row: intermediates live in a per-row
//! scratch buffer and are never materialized for the batch), and **other** operators, which run
//! through the batching rules of [`crate::batched`] on whole batched tensors. Plans are made once per
//! block; whether a stage's fast path applies (f32, shapes that line up, shared weights) is checked
//! at each launch, falling back to the batching rules, so a plan never changes results beyond float
//! rounding. `--no-fusion` turns plans off.
//!
//! This is ACROBAT's kernel generation for whole static blocks (seed 000 §5; the fusion of
//! elementwise tails follows BladeDISC/TAO's fusion stitching, seeds 004/001).
//!
//! Three refinements, each with its own switch ([`PlanOptions`], `Options`): denses that read the
//! same rows with different shared weights form one **horizontally fused** GEMM stage
//! (`--no-hfuse`; ACROBAT appendix B.1, Fig. 9: LSTM gates, Q/K/V); row programs
//! are **compiled once** per stage and operand signature and cached in the plan
//! (`--no-row-cache`); and batched inputs may arrive as **row lists** ([`BV::Rows`], gather fusion,
//! ACROBAT §5.2, `--no-gather-fusion`), which GEMM stages and row programs read in place while any
//! other stage gets them stacked (`Exec::get` vs `Exec::get_raw`).

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use tumble_compile::{BArg, BVal, Block, BlockNode};
use tumble_ir::{AttrValue, DType, Ty};
use tumble_ops::{OpCtx, OpValue};
use tumble_tensor::pool::{scratch_f32, with_capacity_f32, zeroed_f32};
use tumble_tensor::Tensor;

use tumble_kernels::Rows;

use crate::batched::{batched_op, tuple_of, OpStats, BV};
use crate::fastmath;

#[derive(Debug, Clone)]
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
    Rows(Vec<usize>),
    Other(usize),
}

/// Switches of the plan-level optimizations (each can be turned off; results do not change).
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// Compile each row program once per operand signature and reuse it (off: at every launch).
    pub row_cache: bool,
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
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            row_cache: true,
            hfuse: true,
            epilogue: true,
            direct_matmul: true,
            gather_views: true,
        }
    }
}

#[derive(Debug)]
pub struct BlockPlan {
    pub stages: Vec<Stage>,
    /// Nodes whose value is read after their stage (by a later stage or as a block output).
    live_out: Vec<bool>,
    /// Per stage, the external operands of its row program (empty for other stages).
    row_ops: Vec<RowOperands>,
    /// Compiled row programs (`None` when caching is off).
    row_cache: Option<Mutex<RowCache>>,
    /// Per stage: a GEMM stage whose results only the next stage, a row program, reads; that row
    /// program runs as its epilogue.
    epilogue: Vec<bool>,
    /// [`PlanOptions::gather_views`].
    gather_views: bool,
}

impl Clone for BlockPlan {
    fn clone(&self) -> Self {
        // The cache is only an accelerator: a copy starts empty and fills on use.
        BlockPlan {
            stages: self.stages.clone(),
            live_out: self.live_out.clone(),
            row_ops: self.row_ops.clone(),
            row_cache: self.row_cache.as_ref().map(|_| Mutex::default()),
            epilogue: self.epilogue.clone(),
            gather_views: self.gather_views,
        }
    }
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
    match node.op.name {
        "sigmoid" | "tanh" | "exp" | "log" | "sqrt" | "rsqrt" | "abs" | "negative" | "nn.relu"
        | "copy" | "add" | "subtract" | "multiply" | "divide" | "maximum" | "minimum" | "clip" => {
            r >= 1
        }
        "nn.bias_add" => r >= 1 && last_axis(node, 1, r),
        "split" | "concatenate" => r >= 1 && last_axis(node, 0, r),
        "nn.softmax" | "nn.log_softmax" | "nn.layer_norm" => r >= 1 && last_axis(node, -1, r),
        _ => false,
    }
}

/// Groups of two or more f32 `nn.dense` nodes with the same first operand and a weight that is a
/// block input or a constant (so it is ready wherever the group runs), in node order.
fn hfuse_groups(block: &Block) -> Vec<Vec<usize>> {
    let mut groups: Vec<(ValKey, Vec<usize>)> = Vec::new();
    for (i, node) in block.nodes.iter().enumerate() {
        if node.op.name != "nn.dense" || !is_f32(&node.ty) {
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
        if node.op.name != "nn.dense" || !is_f32(&node.ty) || rank(&node.ty) != Some(2) {
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

/// Makes the plan of a block, with every plan-level optimization on.
pub fn plan(block: &Block) -> BlockPlan {
    plan_with(block, PlanOptions::default())
}

/// Makes the plan of a block.
pub fn plan_with(block: &Block, opts: PlanOptions) -> BlockPlan {
    let n = block.nodes.len();
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
        } else if node.op.name == "nn.dense" && is_f32(&node.ty) {
            stages.push(Stage::Dense(i));
        } else if node.op.name == "take"
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
    // Which stage computes each node, then which nodes are read outside their own stage.
    let mut stage_of = vec![0usize; n];
    for (s, st) in stages.iter().enumerate() {
        match st {
            Stage::Dense(i) | Stage::Gather(i) | Stage::Other(i) => stage_of[*i] = s,
            Stage::Rows(ns) | Stage::HDense(ns) => ns.iter().for_each(|&i| stage_of[i] = s),
            Stage::MatMul {
                dense,
                transpose,
                concat,
            } => {
                for i in [Some(*dense), Some(*transpose), *concat]
                    .into_iter()
                    .flatten()
                {
                    stage_of[i] = s;
                }
            }
        }
    }
    let mut live_out = vec![false; n];
    // Per node, the other stages that read it (`usize::MAX` for "a block output").
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    let node_of = |v: &BVal| match v {
        BVal::Node(k) | BVal::Field(k, _) => Some(*k as usize),
        _ => None,
    };
    for (i, node) in block.nodes.iter().enumerate() {
        for a in &node.args {
            let vals: Vec<&BVal> = match a {
                BArg::One(v) => vec![v],
                BArg::Tuple(vs) => vs.iter().collect(),
            };
            for v in vals {
                if let Some(k) = node_of(v) {
                    if stage_of.get(k) != stage_of.get(i) {
                        if let Some(l) = live_out.get_mut(k) {
                            *l = true;
                        }
                        if let (Some(r), Some(&si)) = (readers.get_mut(k), stage_of.get(i)) {
                            r.push(si);
                        }
                    }
                }
            }
        }
    }
    for v in &block.outputs {
        if let Some(k) = node_of(v) {
            if let Some(l) = live_out.get_mut(k) {
                *l = true;
            }
            if let Some(r) = readers.get_mut(k) {
                r.push(usize::MAX);
            }
        }
    }
    let epilogue = (0..stages.len())
        .map(|s| {
            let members: &[usize] = match stages.get(s) {
                Some(Stage::Dense(i)) => std::slice::from_ref(i),
                Some(Stage::HDense(ns)) => ns,
                _ => return false,
            };
            opts.epilogue
                && matches!(stages.get(s + 1), Some(Stage::Rows(_)))
                && members.iter().all(|&k| {
                    let r = readers.get(k).map_or(&[][..], Vec::as_slice);
                    !r.is_empty() && r.iter().all(|&si| si == s + 1)
                })
        })
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
        row_cache: opts.row_cache.then(Mutex::default),
        epilogue,
        gather_views: opts.gather_views,
    }
}

struct Exec<'a> {
    block: &'a Block,
    inputs: &'a [BV],
    /// [`PlanOptions::gather_views`].
    gather_views: bool,
    /// Inputs passed as row lists, stacked on first use by a stage that needs a contiguous batch
    /// (so at most once per launch).
    stacked: RefCell<Vec<Option<BV>>>,
    /// The same for node values that are row references (gather views).
    stacked_nodes: RefCell<Vec<Option<BV>>>,
    stacks: Cell<u64>,
    /// Row programs whose rows this launch split across threads.
    row_splits: Cell<u64>,
    vals: Vec<Option<BV>>,
    b: usize,
    threads: usize,
}

impl Exec<'_> {
    /// A value as a contiguous batch or shared value (row lists stacked).
    fn get(&self, v: &BVal) -> Result<BV, String> {
        match v {
            BVal::Input(i) => match self.inputs.get(*i as usize) {
                Some(BV::Rows(r)) => self.stacked_once(&self.stacked, *i as usize, r),
                _ => self.get_raw(v),
            },
            BVal::Node(n) => match self.vals.get(*n as usize) {
                Some(Some(BV::Rows(r))) => self.stacked_once(&self.stacked_nodes, *n as usize, r),
                _ => self.get_raw(v),
            },
            _ => self.get_raw(v),
        }
    }

    /// Row references `r` (value `i` of `cache`'s kind) stacked into a batch, at most once per
    /// launch.
    fn stacked_once(
        &self,
        cache: &RefCell<Vec<Option<BV>>>,
        i: usize,
        r: &crate::batched::RowRefs,
    ) -> Result<BV, String> {
        if let Some(Some(done)) = cache.borrow().get(i) {
            return Ok(done.clone());
        }
        let t = BV::Batched(OpValue::Tensor(r.stack()?));
        self.stacks.set(self.stacks.get() + 1);
        if let Some(slot) = cache.borrow_mut().get_mut(i) {
            *slot = Some(t.clone());
        }
        Ok(t)
    }

    /// A value as it is, row lists included (for the stages that read rows in place).
    fn get_raw(&self, v: &BVal) -> Result<BV, String> {
        let missing = || format!("internal: block value {v} is not available");
        match v {
            BVal::Input(i) => self.inputs.get(*i as usize).cloned().ok_or_else(missing),
            BVal::Node(n) => self
                .vals
                .get(*n as usize)
                .cloned()
                .flatten()
                .ok_or_else(missing),
            BVal::Field(n, f) => match self.vals.get(*n as usize).and_then(Option::as_ref) {
                Some(BV::Shared(OpValue::Tuple(ts))) => ts
                    .get(*f as usize)
                    .map(|t| BV::Shared(OpValue::Tensor(t.clone())))
                    .ok_or_else(missing),
                Some(BV::Batched(OpValue::Tuple(ts))) => ts
                    .get(*f as usize)
                    .map(|t| BV::Batched(OpValue::Tensor(t.clone())))
                    .ok_or_else(missing),
                _ => Err(missing()),
            },
            BVal::Const(t) => Ok(BV::Shared(OpValue::Tensor(t.clone()))),
        }
    }

    fn arg(&self, a: &BArg) -> Result<BV, String> {
        match a {
            BArg::One(v) => self.get(v),
            BArg::Tuple(vs) => {
                let items = vs
                    .iter()
                    .map(|v| self.get(v))
                    .collect::<Result<Vec<_>, _>>()?;
                tuple_of(items, self.b)
            }
        }
    }

    fn run_node(&mut self, i: usize, octx: &mut OpCtx, stats: &mut OpStats) -> Result<(), String> {
        let node = self.block.nodes.get(i).ok_or("internal: node")?;
        // A reshape of row references (a gather view) is a view too: same rows, new shape.
        if node.op.name == "reshape" {
            if let Some(BArg::One(BVal::Node(src))) = node.args.first() {
                if let Some(Some(BV::Rows(r))) = self.vals.get(*src as usize) {
                    let dims: Option<Vec<usize>> = node.ty.as_tensor().and_then(|(d, _)| {
                        d.iter()
                            .map(|x| x.known().and_then(|k| usize::try_from(k).ok()))
                            .collect()
                    });
                    if let Some(v) = dims.and_then(|d| r.reshaped(&d)) {
                        stats.batched += 1;
                        self.vals[i] = Some(BV::Rows(v));
                        return Ok(());
                    }
                }
            }
        }
        let args = node
            .args
            .iter()
            .map(|a| self.arg(a))
            .collect::<Result<Vec<_>, _>>()?;
        let v = batched_op(node.op, &node.attrs, args, self.b, octx, stats)?;
        if let Some(slot) = self.vals.get_mut(i) {
            *slot = Some(v);
        }
        Ok(())
    }
}

/// Counts of fused execution, for the profile.
#[derive(Default, Debug, Clone, Copy)]
pub struct FusedStats {
    pub dense_stages: u64,
    /// Multiply-add work of dense stages: 2·rows·K·N each.
    pub dense_flops: u64,
    pub dense_time: std::time::Duration,
    /// Dense stages that ran several denses as one GEMM (horizontal fusion), and those denses.
    pub hfused_stages: u64,
    pub hfused_denses: u64,
    pub row_programs: u64,
    pub row_program_ops: u64,
    /// Row programs run as their GEMM's epilogue (counted in `row_programs` too; their time is in
    /// `dense_time`, not `row_time`).
    pub epilogues: u64,
    /// Row programs compiled (once per stage and operand signature with the cache on).
    pub row_compiles: u64,
    /// Time in row-program stages, compiling included.
    pub row_time: std::time::Duration,
    /// The part of `row_time` spent compiling row programs.
    pub row_compile_time: std::time::Duration,
    /// Row programs (separate passes) whose rows were split across threads.
    pub row_splits: u64,
    /// Row-list inputs (gather fusion) stacked because a stage needed a contiguous batch.
    pub row_lists_stacked: u64,
    pub fallbacks: u64,
    /// Dense stages run as [`Stage::MatMul`] (counted in `dense_stages` too).
    pub direct_matmuls: u64,
    /// Embedding lookups that referred to the table's rows instead of copying them.
    pub gather_views: u64,
}

/// Runs `block` for `b` invocations following `plan`.
// The launch context is passed piecewise because the caller lends disjoint fields of its profile.
#[allow(clippy::too_many_arguments)]
pub fn run_planned(
    block: &Block,
    plan: &BlockPlan,
    inputs: &[BV],
    b: usize,
    octx: &mut OpCtx,
    stats: &mut OpStats,
    fstats: &mut FusedStats,
    threads: usize,
) -> Result<Vec<BV>, String> {
    let mut ex = Exec {
        block,
        inputs,
        gather_views: plan.gather_views,
        stacked: RefCell::new(vec![None; inputs.len()]),
        stacked_nodes: RefCell::new(vec![None; block.nodes.len()]),
        stacks: Cell::new(0),
        row_splits: Cell::new(0),
        vals: vec![None; block.nodes.len()],
        b,
        threads,
    };
    // A row-program stage already run as the previous GEMM's epilogue.
    let mut done_as_epilogue = None;
    for (s, stage) in plan.stages.iter().enumerate() {
        if done_as_epilogue == Some(s) {
            continue;
        }
        if plan.epilogue.get(s).copied().unwrap_or(false) {
            let dense: &[usize] = match stage {
                Stage::Dense(i) => std::slice::from_ref(i),
                Stage::HDense(ns) => ns,
                _ => &[],
            };
            if let Some(Stage::Rows(ns)) = plan.stages.get(s + 1) {
                let t0 = std::time::Instant::now();
                let r = gemm_with_epilogue(&ex, plan, dense, s + 1, ns, fstats)?;
                if let Some((outs, flops)) = r {
                    fstats.dense_time += t0.elapsed();
                    fstats.dense_stages += 1;
                    fstats.dense_flops += flops;
                    if dense.len() > 1 {
                        fstats.hfused_stages += 1;
                        fstats.hfused_denses += dense.len() as u64;
                    }
                    fstats.row_programs += 1;
                    fstats.row_program_ops += ns.len() as u64;
                    fstats.epilogues += 1;
                    for (k, v) in outs {
                        if let Some(slot) = ex.vals.get_mut(k) {
                            *slot = Some(v);
                        }
                    }
                    done_as_epilogue = Some(s + 1);
                    continue;
                }
            }
        }
        match stage {
            Stage::Dense(i) => run_dense(&mut ex, *i, octx, stats, fstats)?,
            Stage::HDense(ns) => {
                let t0 = std::time::Instant::now();
                let r = hdense_stage(&ex, ns)?;
                fstats.dense_time += t0.elapsed();
                match r {
                    Some((outs, flops)) => {
                        fstats.dense_stages += 1;
                        fstats.hfused_stages += 1;
                        fstats.hfused_denses += ns.len() as u64;
                        fstats.dense_flops += flops;
                        for (i, v) in ns.iter().zip(outs) {
                            if let Some(slot) = ex.vals.get_mut(*i) {
                                *slot = Some(v);
                            }
                        }
                    }
                    // Not every weight is shared in this launch: one dense stage per member.
                    None => {
                        for &i in ns {
                            run_dense(&mut ex, i, octx, stats, fstats)?;
                        }
                    }
                }
            }
            Stage::MatMul {
                dense,
                transpose,
                concat,
            } => {
                let t0 = std::time::Instant::now();
                let r = matmul_stage(&ex, *dense, *transpose, *concat)?;
                fstats.dense_time += t0.elapsed();
                match r {
                    Some((v, flops)) => {
                        fstats.dense_stages += 1;
                        fstats.direct_matmuls += 1;
                        fstats.dense_flops += flops;
                        ex.vals[*dense] = Some(v);
                    }
                    // Not this launch's operands (a per-invocation X, another dtype): the
                    // nodes one by one.
                    None => {
                        fstats.fallbacks += 1;
                        for i in [*concat, Some(*transpose)].into_iter().flatten() {
                            ex.run_node(i, octx, stats)?;
                        }
                        run_dense(&mut ex, *dense, octx, stats, fstats)?;
                    }
                }
            }
            Stage::Gather(i) => match gather_stage(&ex, *i)? {
                Some(v) => {
                    if matches!(v, BV::Rows(_)) {
                        fstats.gather_views += 1;
                    }
                    ex.vals[*i] = Some(v);
                }
                None => {
                    fstats.fallbacks += 1;
                    ex.run_node(*i, octx, stats)?;
                }
            },
            Stage::Rows(ns) => {
                let t0 = std::time::Instant::now();
                let r = row_program(&ex, plan, s, ns, fstats)?;
                fstats.row_time += t0.elapsed();
                match r {
                    Some(outs) => {
                        fstats.row_programs += 1;
                        fstats.row_program_ops += ns.len() as u64;
                        for (k, v) in outs {
                            ex.vals[k] = Some(v);
                        }
                    }
                    None => {
                        fstats.fallbacks += 1;
                        for &i in ns {
                            ex.run_node(i, octx, stats)?;
                        }
                    }
                }
            }
            Stage::Other(i) => ex.run_node(*i, octx, stats)?,
        }
    }
    // As they lie: row references (gather views) become the launch's output slots.
    let outs = block
        .outputs
        .iter()
        .map(|v| match v {
            BVal::Node(_) => ex.get_raw(v),
            _ => ex.get(v),
        })
        .collect();
    fstats.row_lists_stacked += ex.stacks.get();
    fstats.row_splits += ex.row_splits.get();
    outs
}

/// Dense node `i` as a dense stage, or through the batching rules when the launch's operands do
/// not fit one (counted as a fallback).
fn run_dense(
    ex: &mut Exec,
    i: usize,
    octx: &mut OpCtx,
    stats: &mut OpStats,
    fstats: &mut FusedStats,
) -> Result<(), String> {
    let t0 = std::time::Instant::now();
    let r = dense_stage(ex, i)?;
    fstats.dense_time += t0.elapsed();
    match r {
        Some((v, flops)) => {
            fstats.dense_stages += 1;
            fstats.dense_flops += flops;
            if let Some(slot) = ex.vals.get_mut(i) {
                *slot = Some(v);
            }
            Ok(())
        }
        None => {
            fstats.fallbacks += 1;
            ex.run_node(i, octx, stats)
        }
    }
}

/// `nn.dense` of batched f32 rows with a shared f32 weight: one product for the whole launch.
fn dense_stage(ex: &Exec, i: usize) -> Result<Option<(BV, u64)>, String> {
    let node = ex.block.nodes.get(i).ok_or("internal: node")?;
    let (Some(BArg::One(av)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1)) else {
        return Ok(None);
    };
    // As it lies: per-invocation weights are read in place, not stacked (MV-RNN's word matrices).
    let w = ex.get_raw(wv)?;
    if let BV::Shared(OpValue::Tensor(w)) = &w {
        // Shared weight: one matrix product over every invocation's rows, read in place.
        let a = ex.get_raw(av)?;
        let (Some((a_rows, k, mut shape)), [n, wk]) = (gemm_rows(&a), w.shape()) else {
            return Ok(None);
        };
        if *wk != k || w.as_f32().is_none() {
            return Ok(None);
        }
        let rows: usize = shape.iter().product();
        // Overwritten whole by the GEMM.
        let mut c = scratch_f32(rows * n);
        crate::gemm::dense(&a_rows.rows(k), k, w, *n, &mut c, ex.threads)?;
        shape.push(*n);
        let t = Tensor::from_f32(shape, c).map_err(|e| e.to_string())?;
        return Ok(Some((
            BV::Batched(OpValue::Tensor(t)),
            2 * (rows * k * n) as u64,
        )));
    }
    // Per-invocation weights (MV-RNN's word matrices): a small product per invocation, each
    // weight read where it lies.
    let b = ex.b;
    let Some((&[n, k], w_inst)) = invocation_parts(&w, b) else {
        return Ok(None);
    };
    if n * k == 0 {
        return Ok(None);
    }
    let x = ex.get(av)?;
    let (x_t, x_batched) = match &x {
        BV::Batched(OpValue::Tensor(t)) => (t, true),
        BV::Shared(OpValue::Tensor(t)) => (t, false),
        _ => return Ok(None),
    };
    let Some(xd) = x_t.as_f32() else {
        return Ok(None);
    };
    let xs = x_t.shape();
    let x_inst = if x_batched {
        xs.get(1..).unwrap_or(&[])
    } else {
        xs
    };
    let (Some(&xk), true) = (x_inst.last(), x_inst.len() == 2) else {
        return Ok(None);
    };
    if xk != k || (x_batched && xs.first() != Some(&b)) {
        return Ok(None);
    }
    let m = x_inst.first().copied().unwrap_or(1);
    if !x_batched && m >= SWAP_MIN_ROWS {
        // A shared left operand (`W_M · [A; B]` without direct products): out_i = X·W_iᵀ =
        // (W_i·Xᵀ)ᵀ, so every invocation's W_i rows go through one GEMM against X as the
        // (packed, cached) weight, and each (n × m) result is transposed back.
        let mut ct = scratch_f32(b * n * m);
        let rows: Vec<&[f32]> = w_inst.iter().flat_map(|p| p.chunks_exact(k)).collect();
        crate::gemm::dense(
            &tumble_kernels::Rows::Gathered(&rows),
            k,
            x_t,
            m,
            &mut ct,
            ex.threads,
        )?;
        let mut c = zeroed_f32(b * m * n);
        for inst in 0..b {
            let src = &ct[inst * n * m..(inst + 1) * n * m];
            let dst = &mut c[inst * m * n..(inst + 1) * m * n];
            crate::fastops::transpose_2d(src, n, m, dst);
        }
        tumble_tensor::pool::recycle(ct);
        let t = Tensor::from_f32(vec![b, m, n], c).map_err(|e| e.to_string())?;
        return Ok(Some((
            BV::Batched(OpValue::Tensor(t)),
            2 * (b * m * n * k) as u64,
        )));
    }
    let mut c = zeroed_f32(b * m * n);
    for (inst, wi) in w_inst.iter().enumerate() {
        let xo = if x_batched { inst * m * k } else { 0 };
        for r in 0..m {
            let xr = &xd[xo + r * k..xo + (r + 1) * k];
            for j in 0..n {
                c[(inst * m + r) * n + j] = dot(xr, &wi[j * k..(j + 1) * k]);
            }
        }
    }
    let t = Tensor::from_f32(vec![b, m, n], c).map_err(|e| e.to_string())?;
    Ok(Some((
        BV::Batched(OpValue::Tensor(t)),
        2 * (b * m * n * k) as u64,
    )))
}

/// Each of `b` invocations' f32 data of value `v`, in place, with the per-invocation shape: a
/// shared tensor (the same slice for all), a batch (its rows) or row references. `None` for other
/// dtypes or a batch of another size.
fn invocation_parts(v: &BV, b: usize) -> Option<(&[usize], Vec<&[f32]>)> {
    let (shape, parts): (&[usize], Vec<&[f32]>) = match v {
        BV::Shared(OpValue::Tensor(t)) => (t.shape(), vec![t.as_f32()?; b]),
        BV::Batched(OpValue::Tensor(t)) => {
            let (&tb, rest) = t.shape().split_first()?;
            let len: usize = rest.iter().product();
            if tb != b || len == 0 {
                return None;
            }
            (rest, t.as_f32()?.chunks_exact(len).collect())
        }
        BV::Rows(r) => (r.shape(), r.f32_parts()?),
        _ => return None,
    };
    (parts.len() == b).then_some((shape, parts))
}

/// [`Stage::MatMul`]: `X · [Y_1; ..]` per invocation with `X` shared, each invocation's `Y` rows
/// packed where they lie as the GEMM's weight. `None` when the operands are not of that form.
fn matmul_stage(
    ex: &Exec,
    dense: usize,
    transpose: usize,
    concat: Option<usize>,
) -> Result<Option<(BV, u64)>, String> {
    let node = ex.block.nodes.get(dense).ok_or("internal: node")?;
    let Some(BArg::One(xv)) = node.args.first() else {
        return Ok(None);
    };
    let BV::Shared(OpValue::Tensor(x)) = ex.get(xv)? else {
        return Ok(None);
    };
    let (Some(xd), &[m, k]) = (x.as_f32(), x.shape()) else {
        return Ok(None);
    };
    let part_vals: Vec<BVal> = match concat {
        Some(c) => match ex.block.nodes.get(c).and_then(|n| n.args.first()) {
            Some(BArg::Tuple(vs)) => vs.clone(),
            _ => return Ok(None),
        },
        None => match ex.block.nodes.get(transpose).and_then(|n| n.args.first()) {
            Some(BArg::One(v)) => vec![v.clone()],
            _ => return Ok(None),
        },
    };
    let b = ex.b;
    // Per part: its rows-by-`n` shape per invocation and each invocation's data.
    let vals: Vec<BV> = part_vals
        .iter()
        .map(|v| ex.get_raw(v))
        .collect::<Result<_, _>>()?;
    let mut n = None;
    let mut parts: Vec<Vec<&[f32]>> = Vec::with_capacity(vals.len());
    let mut rows_total = 0usize;
    for v in &vals {
        let Some((&[rows, cols], per_inst)) = invocation_parts(v, b) else {
            return Ok(None);
        };
        if n.is_some_and(|n| n != cols) {
            return Ok(None);
        }
        n = Some(cols);
        rows_total += rows;
        parts.push(per_inst);
    }
    let Some(n) = n else {
        return Ok(None);
    };
    if rows_total != k || n == 0 || k == 0 {
        return Ok(None);
    }
    let mut c = scratch_f32(b * m * n); // each invocation's block is overwritten whole by its GEMM
    let a = tumble_kernels::Rows::Contiguous {
        data: xd,
        stride: k,
    };
    let mut y_rows: Vec<&[f32]> = Vec::with_capacity(k);
    let mut packed: Option<tumble_kernels::PackedWeight> = None;
    for inst in 0..b {
        y_rows.clear();
        for p in &parts {
            let d = p.get(inst).ok_or("internal: matmul part")?;
            y_rows.extend(d.chunks_exact(n));
        }
        match packed.as_mut() {
            Some(w) => w.repack_rows_kn(&y_rows, n),
            None => tumble_kernels::PackedWeight::from_rows_kn(&y_rows, n).map(|w| {
                packed = Some(w);
            }),
        }
        .map_err(|e| e.to_string())?;
        let w = packed.as_ref().ok_or("internal: matmul weight")?;
        let out = c
            .get_mut(inst * m * n..(inst + 1) * m * n)
            .ok_or("internal: matmul output")?;
        tumble_kernels::dense(&a, w, out, &tumble_kernels::NoEpilogue, ex.threads)
            .map_err(|e| e.to_string())?;
    }
    let t = Tensor::from_f32(vec![b, m, n], c).map_err(|e| e.to_string())?;
    Ok(Some((
        BV::Batched(OpValue::Tensor(t)),
        2 * (b * m * n * k) as u64,
    )))
}

/// Rows of a shared left operand from which swapping the operands of a per-invocation-weight dense
/// into one GEMM pays (below, the products are matrix-vector and dot products are as good).
const SWAP_MIN_ROWS: usize = 8;

/// The operands of a GEMM over denses `ns` (one, or a horizontally fused group) that all read the
/// same rows with shared f32 weights `(N_i, K)`: the rows value as it lies (row lists included),
/// and the weights. `None` when some member reads other rows or has a weight that is not shared.
fn shared_weight_operands(ex: &Exec, ns: &[usize]) -> Result<Option<(BV, Vec<Tensor>)>, String> {
    let mut a_val: Option<&BVal> = None;
    let mut ws: Vec<Tensor> = Vec::with_capacity(ns.len());
    for &i in ns {
        let node = ex.block.nodes.get(i).ok_or("internal: node")?;
        let (Some(BArg::One(av)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1))
        else {
            return Ok(None);
        };
        match a_val {
            None => a_val = Some(av),
            Some(prev) if ValKey::of(prev) == ValKey::of(av) => {}
            Some(_) => return Ok(None),
        }
        match ex.get(wv)? {
            BV::Shared(OpValue::Tensor(w)) if w.as_f32().is_some() && w.rank() == 2 => ws.push(w),
            _ => return Ok(None),
        }
    }
    match a_val {
        Some(av) => Ok(Some((ex.get_raw(av)?, ws))),
        None => Ok(None),
    }
}

/// The output widths `N_i` of weights `ws`, when every one has `K = k` columns.
fn weight_widths(ws: &[Tensor], k: usize) -> Option<Vec<usize>> {
    ws.iter()
        .map(|w| match w.shape() {
            [n, wk] if *wk == k => Some(*n),
            _ => None,
        })
        .collect()
}

/// Horizontally fused denses `ns` (same rows A, shared f32 weights W_i of shapes (N_i, K)): one
/// GEMM against the weights stacked along N, its columns split back into each node's value.
/// `None` when some weight is not shared f32 or the rows are not batched f32.
fn hdense_stage(ex: &Exec, ns: &[usize]) -> Result<Option<(Vec<BV>, u64)>, String> {
    let Some((a, ws)) = shared_weight_operands(ex, ns)? else {
        return Ok(None);
    };
    let Some((a_rows, k, lead)) = gemm_rows(&a) else {
        return Ok(None);
    };
    let Some(widths) = weight_widths(&ws, k) else {
        return Ok(None);
    };
    let n: usize = widths.iter().sum();
    let rows: usize = lead.iter().product();
    let mut c = scratch_f32(rows * n);
    crate::gemm::dense_concat(&a_rows.rows(k), k, &ws, &mut c, ex.threads)?;
    let mut outs = Vec::with_capacity(ns.len());
    let mut col = 0;
    for &w in &widths {
        let mut part = with_capacity_f32(rows * w);
        for r in 0..rows {
            part.extend_from_slice(
                c.get(r * n + col..r * n + col + w)
                    .ok_or("internal: split")?,
            );
        }
        col += w;
        let mut shape = lead.clone();
        shape.push(w);
        outs.push(BV::Batched(OpValue::Tensor(
            Tensor::from_f32(shape, part).map_err(|e| e.to_string())?,
        )));
    }
    // The stacked product was split into the parts: its buffer serves a later launch.
    tumble_tensor::pool::recycle(c);
    Ok(Some((outs, 2 * (rows * k * n) as u64)))
}

/// Values of block nodes, by node index.
type NodeValues = Vec<(usize, BV)>;

thread_local! {
    /// The product of a GEMM stage with a fused epilogue: scratch, reused by every such launch on
    /// this thread (grown, never shrunk), so it is neither allocated nor zeroed per launch.
    static EPILOGUE_C: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A GEMM stage (nodes `dense`: one dense, or a horizontally fused group reading the same rows)
/// whose results only the row program of the next stage (`rows_stage`, nodes `ns`) reads: the
/// row program runs as the GEMM's epilogue on each block of output rows while the block is in
/// cache, and writes its live values straight into their tensors; the product itself is scratch.
/// Returns those values and the GEMM's flops; `None`, having computed nothing, when the fast path
/// does not apply (the caller then runs the two stages separately).
fn gemm_with_epilogue(
    ex: &Exec,
    plan: &BlockPlan,
    dense: &[usize],
    rows_stage: usize,
    ns: &[usize],
    fstats: &mut FusedStats,
) -> Result<Option<(NodeValues, u64)>, String> {
    let Some((a, ws)) = shared_weight_operands(ex, dense)? else {
        return Ok(None);
    };
    let Some((a_rows, k, lead)) = gemm_rows(&a) else {
        return Ok(None);
    };
    let Some(widths) = weight_widths(&ws, k) else {
        return Ok(None);
    };
    let n: usize = widths.iter().sum();
    let rows: usize = lead.iter().product();
    if n == 0 || rows == 0 {
        return Ok(None);
    }
    // The row program's operands; the GEMM's results among them are bound block by block to
    // their columns of C.
    let empty = RowOperands::default();
    let ops = plan.row_ops.get(rows_stage).unwrap_or(&empty);
    let mut vals: Vec<Option<BV>> = Vec::with_capacity(ops.vals.len());
    let mut sig: Vec<OpSig> = Vec::with_capacity(ops.vals.len());
    let mut in_c: Vec<Option<(usize, usize)>> = Vec::with_capacity(ops.vals.len());
    for v in &ops.vals {
        let member = match v {
            BVal::Node(k) => dense.iter().position(|&d| d == *k as usize),
            _ => None,
        };
        match member {
            Some(j) => {
                let col: usize = widths.iter().take(j).sum();
                let w = widths.get(j).copied().unwrap_or(0);
                let mut shape = lead.get(1..).unwrap_or(&[]).to_vec();
                shape.push(w);
                sig.push(OpSig::Batched(shape));
                vals.push(None);
                in_c.push(Some((col, w)));
            }
            None => {
                let x = ex.get_raw(v)?;
                sig.push(sig_of(&x));
                vals.push(Some(x));
                in_c.push(None);
            }
        }
    }
    let Some(prog) = compiled_rows(ex, plan, rows_stage, ns, sig, fstats) else {
        return Ok(None);
    };
    let out_lead = row_lead(&prog, ex.b);
    if out_lead.iter().product::<usize>() != rows {
        return Ok(None);
    }
    let held: Vec<Option<&BV>> = vals.iter().map(Option::as_ref).collect();
    let Some(bound) = bind(&prog, &held, rows) else {
        return Ok(None);
    };
    // Per batched operand of the program (`Src::Ext` order): its columns of C, if it is one of
    // the GEMM's results.
    let ext_in_c: Vec<Option<(usize, usize)>> = prog
        .held
        .iter()
        .zip(&in_c)
        .filter(|(o, _)| matches!(o.src, Src::Ext(_)))
        .map(|(_, c)| *c)
        .collect();
    let pw = if let [w] = ws.as_slice() {
        crate::gemm::packed(w, n, k)?
    } else {
        crate::gemm::packed_concat(&ws, k)?
    };
    let mut bufs: Vec<Vec<f32>> = flat_outs(&prog)
        .map(|o| scratch_f32(rows * o.len))
        .collect();
    let mut outputs: Vec<tumble_kernels::Output> = bufs
        .iter_mut()
        .zip(flat_outs(&prog))
        .map(|(data, o)| tumble_kernels::Output {
            data: data.as_mut_slice(),
            width: o.len,
        })
        .collect();
    // The epilogue runs inside the kernel's row blocks (on its threads) and cannot return an
    // error: the first one is kept here and reported after the product.
    let epilogue_failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let epilogue = |r: Range<usize>, cblk: &mut [f32], outs: &mut [&mut [f32]]| {
        let cblk: &[f32] = cblk;
        let ext = bound
            .ext
            .iter()
            .zip(&ext_in_c)
            .map(|(full, c)| match *c {
                Some((col, w)) => cblk
                    .chunks_exact(n)
                    .map(|row| row.get(col..col + w).unwrap_or(&[]))
                    .collect(),
                None => full.get(r.clone()).unwrap_or(&[]).to_vec(),
            })
            .collect();
        let block = Bound {
            ext,
            shared: Cow::Borrowed(&bound.shared),
            scalars: Cow::Borrowed(&bound.scalars),
        };
        if let Err(e) = run_row_block(&prog, &block, r.len(), outs) {
            if let Ok(mut f) = epilogue_failure.lock() {
                f.get_or_insert(e);
            }
        }
    };
    let mut c = EPILOGUE_C.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if c.len() < rows * n {
        c.resize(rows * n, 0.0);
    }
    let done = tumble_kernels::dense_into(
        &[(&a_rows.rows(k), &pw)],
        &mut c[..rows * n],
        &mut outputs,
        &epilogue,
        ex.threads,
    );
    EPILOGUE_C.with(|slot| *slot.borrow_mut() = c);
    done.map_err(|e| e.to_string())?;
    if let Some(e) = epilogue_failure
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
    {
        return Err(e);
    }
    drop(outputs);
    let values = assemble(&prog, &out_lead, bufs)?;
    Ok(Some((values, 2 * (rows * k * n) as u64)))
}

/// The A operand of a GEMM stage, read where it lies.
enum GemmRows<'a> {
    Contiguous(&'a [f32]),
    /// Rows of earlier launches' outputs (gather fusion): the kernel packs them directly.
    Gathered(Vec<&'a [f32]>),
}

impl GemmRows<'_> {
    fn rows(&self, k: usize) -> Rows<'_> {
        match self {
            GemmRows::Contiguous(data) => Rows::Contiguous { data, stride: k },
            GemmRows::Gathered(rows) => Rows::Gathered(rows),
        }
    }
}

/// Batched f32 rows of width K > 0: the rows, K, and the result's shape without its last axis.
fn gemm_rows(v: &BV) -> Option<(GemmRows<'_>, usize, Vec<usize>)> {
    match v {
        BV::Batched(OpValue::Tensor(a)) if a.rank() >= 2 => {
            let (data, &k) = (a.as_f32()?, a.shape().last()?);
            let lead = a.shape().get(..a.rank() - 1)?.to_vec();
            (k > 0).then_some((GemmRows::Contiguous(data), k, lead))
        }
        BV::Rows(r) if !r.shape().is_empty() => {
            let k = *r.shape().last()?;
            if k == 0 {
                return None;
            }
            let parts = r.f32_parts()?;
            let mut lead = vec![r.len()];
            lead.extend_from_slice(r.shape().get(..r.shape().len() - 1)?);
            let rows = parts.iter().flat_map(|p| p.chunks_exact(k)).collect();
            Some((GemmRows::Gathered(rows), k, lead))
        }
        _ => None,
    }
}

/// f32 dot product with eight independent accumulators (vectorizes).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for j in chunks * 8..a.len().min(b.len()) {
        s += a[j] * b[j];
    }
    s
}

/// Embedding lookup: rows of a shared f32 table selected by batched int ids (clip mode clamps,
/// like the reference kernel; other modes fall back).
fn gather_stage(ex: &Exec, i: usize) -> Result<Option<BV>, String> {
    let node = ex.block.nodes.get(i).ok_or("internal: node")?;
    let (Some(BArg::One(tv)), Some(BArg::One(iv))) = (node.args.first(), node.args.get(1)) else {
        return Ok(None);
    };
    let (BV::Shared(OpValue::Tensor(table)), BV::Batched(OpValue::Tensor(ids))) =
        (ex.get(tv)?, ex.get(iv)?)
    else {
        return Ok(None);
    };
    let mode = node.attrs.str("mode").ok().flatten().unwrap_or("clip");
    let (Some(data), Some(&rows)) = (table.as_f32(), table.shape().first()) else {
        return Ok(None);
    };
    if mode != "clip" || rows == 0 {
        return Ok(None);
    }
    let width = table.len() / rows;
    let idx = ids.to_i64_vec();
    let b = ids.shape().first().copied().unwrap_or(0);
    if ex.gather_views && b > 0 && idx.len() == b {
        // One index per invocation: references to the table's rows, viewed with the output's
        // per-invocation shape (the index's own dims, then a row's).
        let mut view_shape = vec![rows];
        view_shape.extend_from_slice(ids.shape().get(1..).unwrap_or(&[]));
        view_shape.extend_from_slice(&table.shape()[1..]);
        let view = table.reshape(view_shape).map_err(|e| e.to_string())?;
        let parts = idx
            .iter()
            .map(|&j| (view.clone(), Some(j.clamp(0, rows as i64 - 1) as usize)))
            .collect();
        if let Some(r) = crate::batched::RowRefs::new(parts) {
            return Ok(Some(BV::Rows(r)));
        }
    }
    let mut out = with_capacity_f32(idx.len() * width);
    for &j in &idx {
        let j = j.clamp(0, rows as i64 - 1) as usize;
        out.extend_from_slice(&data[j * width..(j + 1) * width]);
    }
    let mut shape = ids.shape().to_vec();
    shape.extend_from_slice(&table.shape()[1..]);
    Tensor::from_f32(shape, out)
        .map(|t| Some(BV::Batched(OpValue::Tensor(t))))
        .map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Row programs
//
// A row program is compiled from the block, the stage and its operands' signatures (batched or
// shared, per-instance shape) — never from their values — so it is compiled once per signature and
// reused by every later launch (`PlanOptions::row_cache`); each launch only binds the operands'
// row pointers and runs it.

#[derive(Clone, Copy, Debug)]
enum Src {
    /// A batched operand: row r is `ext[e][r][off..]`.
    Ext(usize),
    /// A shared vector, the same for every row.
    Shared(usize),
    /// The per-row scratch buffer.
    Scratch,
    /// A shared single value, broadcast (bound per launch: an input may differ between launches).
    Scalar(usize),
}

#[derive(Clone, Copy, Debug)]
struct Opd {
    src: Src,
    off: usize,
    len: usize,
}

#[derive(Clone, Copy, Debug)]
enum Un {
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Abs,
    Neg,
    Relu,
    Copy,
}

#[derive(Clone, Copy, Debug)]
enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

#[derive(Debug)]
enum Instr {
    Unary(Un, usize, Opd),
    Binary(Bin, usize, Opd, Opd),
    Clip(usize, Opd, f32, f32),
    Concat(usize, Vec<Opd>),
    Softmax(usize, Opd, bool),
    LayerNorm(usize, Opd, Option<Opd>, Option<Opd>, f32),
}

/// A value inside a row program: a view of an operand (splits are views, not copies).
#[derive(Clone, Debug)]
enum RVal {
    One(Opd),
    Tuple(Vec<Opd>),
}

/// What a row program knows of one external operand.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
enum OpSig {
    /// Batched f32, with its per-instance shape.
    Batched(Vec<usize>),
    /// Shared f32, with its shape.
    Shared(Vec<usize>),
    /// Anything else (another dtype, a tuple): no row program.
    Other,
}

fn sig_of(v: &BV) -> OpSig {
    match v {
        BV::Batched(OpValue::Tensor(t)) if t.dtype() == DType::Float32 => {
            OpSig::Batched(t.shape().get(1..).unwrap_or(&[]).to_vec())
        }
        BV::Rows(r) if r.dtype() == DType::Float32 => OpSig::Batched(r.shape().to_vec()),
        BV::Shared(OpValue::Tensor(t)) if t.dtype() == DType::Float32 => {
            OpSig::Shared(t.shape().to_vec())
        }
        _ => OpSig::Other,
    }
}

/// The external operands of a row-program stage, in first-use order, computed once per plan.
#[derive(Clone, Debug, Default)]
struct RowOperands {
    vals: Vec<BVal>,
    keys: Vec<ValKey>,
}

fn row_operands(block: &Block, ns: &[usize]) -> RowOperands {
    let mut ops = RowOperands::default();
    let in_segment =
        |v: &BVal| matches!(v, BVal::Node(k) | BVal::Field(k, _) if ns.contains(&(*k as usize)));
    for &i in ns {
        let Some(node) = block.nodes.get(i) else {
            continue;
        };
        for a in &node.args {
            let vs: Vec<&BVal> = match a {
                BArg::One(v) => vec![v],
                BArg::Tuple(vs) => vs.iter().collect(),
            };
            for v in vs {
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

/// A compiled row program.
#[derive(Debug)]
pub struct RowProg {
    /// Per external operand, where it is bound (`Ext`, `Shared` or `Scalar`, with its width).
    held: Vec<Opd>,
    /// Per-instance leading dims of the rows (the batch axis excluded).
    lead_tail: Vec<usize>,
    scratch_len: usize,
    instrs: Vec<Instr>,
    /// Live values copied out: node, its fields' operands, whether it is a tuple.
    outs: Vec<(usize, Vec<Opd>, bool)>,
}

/// Row programs compiled so far, per (stage, operand signatures); `None` records that the
/// signature has no row program, so it is not retried at every launch.
type RowCache = HashMap<(usize, Vec<OpSig>), Option<Arc<RowProg>>>;

/// Compiles the row program of nodes `ns` for operands of signature `sig`.
/// Leading dims without the size-1 ones: per-instance dims of size 1 broadcast, so `(B, 1, n)` and
/// `(B, n)` describe the same rows.
fn strip(lead: &[usize]) -> Vec<usize> {
    lead.iter().copied().filter(|&d| d != 1).collect()
}

fn compile_rows(
    block: &Block,
    ns: &[usize],
    ops: &RowOperands,
    sig: &[OpSig],
    live_out: &[bool],
) -> Option<RowProg> {
    let mut held_opd: Vec<Opd> = Vec::with_capacity(sig.len());
    let (mut n_ext, mut n_shared, mut n_scalar) = (0, 0, 0);
    let mut lead_tail: Option<Vec<usize>> = None;
    for s in sig {
        match s {
            OpSig::Other => return bail(1),
            OpSig::Batched(p) => {
                let (Some(&w), Some(tail)) = (p.last(), p.get(..p.len().saturating_sub(1))) else {
                    return bail(5);
                };
                if w == 0 {
                    return bail(4);
                }
                // Leading dims must describe the same rows; size-1 per-instance dims broadcast, so
                // (B, 1, n) and (B, n) line up. Results take the longest lead.
                match &lead_tail {
                    None => lead_tail = Some(tail.to_vec()),
                    Some(l) if strip(l) == strip(tail) => {
                        if tail.len() > l.len() {
                            lead_tail = Some(tail.to_vec());
                        }
                    }
                    Some(_) => return bail(6),
                }
                held_opd.push(Opd {
                    src: Src::Ext(n_ext),
                    off: 0,
                    len: w,
                });
                n_ext += 1;
            }
            OpSig::Shared(shape) => {
                let len: usize = shape.iter().product();
                if len == 1 {
                    held_opd.push(Opd {
                        src: Src::Scalar(n_scalar),
                        off: 0,
                        len: 1,
                    });
                    n_scalar += 1;
                } else if shape.iter().rev().skip(1).all(|&d| d == 1) {
                    // A shared row vector (n) or (1, n): broadcast to every row.
                    held_opd.push(Opd {
                        src: Src::Shared(n_shared),
                        off: 0,
                        len,
                    });
                    n_shared += 1;
                } else {
                    return bail(7);
                }
            }
        }
    }
    let Some(lead_tail) = lead_tail else {
        // Nothing batched: not a row program (the batching rules compute shared values once).
        return bail(8);
    };
    // Every result must describe the same rows: a node that reads only shared operands (a
    // weight's `divide`) next to per-instance work of another row shape would be computed once
    // per row and come out with the rows of the other operands (found by the program generator,
    // seed 17871: a (1, 2) result returned as (4, 2)).
    let lead = strip(&lead_tail);
    for &n in ns {
        let Some((dims, _)) = block.nodes.get(n).and_then(|node| node.ty.as_tensor()) else {
            continue; // tuple results (split) are checked through the fields that are used
        };
        let known: Option<Vec<usize>> =
            dims.iter().map(|d| d.known().map(|x| x as usize)).collect();
        match known {
            Some(d) if strip(d.get(..d.len().saturating_sub(1)).unwrap_or(&[])) == lead => {}
            Some(_) => return bail(9),
            None => {}
        }
    }
    let mut bld = Builder {
        scratch_len: 0,
        instrs: Vec::new(),
    };
    let mut env: Vec<(usize, RVal)> = Vec::new();
    let lookup = |v: &BVal, env: &[(usize, RVal)]| -> Option<Opd> {
        let inside = match v {
            BVal::Node(k) => env
                .iter()
                .find(|(n, _)| *n == *k as usize)
                .map(|(_, r)| match r {
                    RVal::One(o) => Some(*o),
                    RVal::Tuple(_) => None,
                }),
            BVal::Field(k, f) => {
                env.iter()
                    .find(|(n, _)| *n == *k as usize)
                    .map(|(_, r)| match r {
                        RVal::Tuple(os) => os.get(*f as usize).copied(),
                        RVal::One(_) => None,
                    })
            }
            _ => None,
        };
        match inside {
            Some(found) => found,
            None => {
                let key = ValKey::of(v);
                ops.keys
                    .iter()
                    .position(|k| *k == key)
                    .and_then(|h| held_opd.get(h).copied())
            }
        }
    };
    for &i in ns {
        let node = block.nodes.get(i)?;
        let one = |j: usize, env: &[(usize, RVal)]| -> Option<Opd> {
            match node.args.get(j) {
                Some(BArg::One(v)) => lookup(v, env),
                _ => None,
            }
        };
        let alloc = |len: usize, bld: &mut Builder| {
            let off = bld.scratch_len;
            bld.scratch_len += len;
            Opd {
                src: Src::Scratch,
                off,
                len,
            }
        };
        let un = |name: &str| match name {
            "sigmoid" => Some(Un::Sigmoid),
            "tanh" => Some(Un::Tanh),
            "exp" => Some(Un::Exp),
            "log" => Some(Un::Log),
            "sqrt" => Some(Un::Sqrt),
            "rsqrt" => Some(Un::Rsqrt),
            "abs" => Some(Un::Abs),
            "negative" => Some(Un::Neg),
            "nn.relu" => Some(Un::Relu),
            "copy" => Some(Un::Copy),
            _ => None,
        };
        let bin = |name: &str| match name {
            "add" | "nn.bias_add" => Some(Bin::Add),
            "subtract" => Some(Bin::Sub),
            "multiply" => Some(Bin::Mul),
            "divide" => Some(Bin::Div),
            "maximum" => Some(Bin::Max),
            "minimum" => Some(Bin::Min),
            _ => None,
        };
        let name = node.op.name;
        let result = if let Some(u) = un(name) {
            let Some(a) = one(0, &env) else {
                return bail(9);
            };
            let d = alloc(a.len, &mut bld);
            bld.instrs.push(Instr::Unary(u, d.off, a));
            RVal::One(d)
        } else if let Some(op) = bin(name) {
            let (Some(a), Some(b)) = (one(0, &env), one(1, &env)) else {
                return bail(10);
            };
            let len = a.len.max(b.len);
            if (a.len != len && a.len != 1) || (b.len != len && b.len != 1) {
                return bail(11);
            }
            let d = alloc(len, &mut bld);
            bld.instrs.push(Instr::Binary(op, d.off, a, b));
            RVal::One(d)
        } else {
            match name {
                "clip" => {
                    let Some(a) = one(0, &env) else {
                        return bail(12);
                    };
                    let lo = node
                        .attrs
                        .float("a_min")
                        .ok()
                        .flatten()
                        .unwrap_or(f64::NEG_INFINITY) as f32;
                    let hi = node
                        .attrs
                        .float("a_max")
                        .ok()
                        .flatten()
                        .unwrap_or(f64::INFINITY) as f32;
                    let d = alloc(a.len, &mut bld);
                    bld.instrs.push(Instr::Clip(d.off, a, lo, hi));
                    RVal::One(d)
                }
                "split" => {
                    let Some(a) = one(0, &env) else {
                        return bail(13);
                    };
                    let bounds: Vec<usize> = match node.attrs.get("indices_or_sections") {
                        Some(AttrValue::Int(s)) if *s > 0 && a.len % (*s as usize) == 0 => {
                            let w = a.len / *s as usize;
                            (0..=*s as usize).map(|k| k * w).collect()
                        }
                        Some(AttrValue::List(is)) => {
                            let mut v = vec![0];
                            for x in is {
                                match x {
                                    AttrValue::Int(k) if *k >= 0 && (*k as usize) <= a.len => {
                                        v.push(*k as usize)
                                    }
                                    _ => return bail(14),
                                }
                            }
                            v.push(a.len);
                            v
                        }
                        _ => return bail(15),
                    };
                    if bounds.windows(2).any(|w| w[1] < w[0]) {
                        return bail(16);
                    }
                    RVal::Tuple(
                        bounds
                            .windows(2)
                            .map(|w| Opd {
                                src: a.src,
                                off: a.off + w[0],
                                len: w[1] - w[0],
                            })
                            .collect(),
                    )
                }
                "concatenate" => {
                    let Some(BArg::Tuple(vs)) = node.args.first() else {
                        return bail(17);
                    };
                    let parts = vs
                        .iter()
                        .map(|v| lookup(v, &env))
                        .collect::<Option<Vec<_>>>();
                    let Some(parts) = parts else {
                        return bail(18);
                    };
                    if parts.iter().any(|p| matches!(p.src, Src::Scalar(_))) {
                        return bail(19);
                    }
                    let d = alloc(parts.iter().map(|p| p.len).sum(), &mut bld);
                    bld.instrs.push(Instr::Concat(d.off, parts));
                    RVal::One(d)
                }
                "nn.softmax" | "nn.log_softmax" => {
                    let Some(a) = one(0, &env) else {
                        return bail(20);
                    };
                    let d = alloc(a.len, &mut bld);
                    bld.instrs
                        .push(Instr::Softmax(d.off, a, name == "nn.log_softmax"));
                    RVal::One(d)
                }
                "nn.layer_norm" => {
                    let (Some(a), Some(g), Some(be)) = (one(0, &env), one(1, &env), one(2, &env))
                    else {
                        return bail(21);
                    };
                    if g.len != a.len || be.len != a.len {
                        return bail(22);
                    }
                    let eps = node.attrs.float("epsilon").ok().flatten().unwrap_or(1e-5) as f32;
                    let center = node.attrs.bool("center").ok().flatten().unwrap_or(true);
                    let scale = node.attrs.bool("scale").ok().flatten().unwrap_or(true);
                    let d = alloc(a.len, &mut bld);
                    bld.instrs.push(Instr::LayerNorm(
                        d.off,
                        a,
                        scale.then_some(g),
                        center.then_some(be),
                        eps,
                    ));
                    RVal::One(d)
                }
                _ => return bail(23),
            }
        };
        // The node's static type must agree with the row layout (per-instance rank = lead rank).
        let expect_rank = 1 + lead_tail.len(); // batched rank = lead + 1 = per-instance rank + 1
        let node_rank = match &node.ty {
            Ty::Tuple(ts) => ts.first().and_then(rank),
            t => rank(t),
        };
        if node_rank != Some(expect_rank) {
            return bail(24);
        }
        env.push((i, result));
    }
    let outs: Vec<(usize, Vec<Opd>, bool)> = ns
        .iter()
        .filter(|&&i| live_out.get(i).copied().unwrap_or(false))
        .filter_map(|&i| {
            env.iter().find(|(n, _)| *n == i).map(|(_, r)| match r {
                RVal::One(o) => (i, vec![*o], false),
                RVal::Tuple(os) => (i, os.clone(), true),
            })
        })
        .collect();
    Some(RowProg {
        held: held_opd,
        lead_tail,
        scratch_len: bld.scratch_len,
        instrs: bld.instrs,
        outs,
    })
}

struct Builder {
    scratch_len: usize,
    instrs: Vec<Instr>,
}

/// An operand's rows for one launch, each `width` floats (`None` if it is not batched f32 rows).
fn row_ptrs(v: &BV, width: usize) -> Option<Vec<&[f32]>> {
    if width == 0 {
        return None;
    }
    match v {
        BV::Batched(OpValue::Tensor(t)) => t.as_f32().map(|d| d.chunks_exact(width).collect()),
        BV::Rows(r) => {
            let parts = r.f32_parts()?;
            Some(parts.iter().flat_map(|p| p.chunks_exact(width)).collect())
        }
        _ => None,
    }
}

/// The operands of one launch of a row program.
struct Bound<'a, 'b> {
    ext: Vec<Vec<&'a [f32]>>,
    /// Borrowed by the per-block and per-thread views of a launch's binding (only `ext` differs
    /// between them), owned by the binding itself.
    shared: Cow<'b, [&'a [f32]]>,
    scalars: Cow<'b, [f32]>,
}

/// Runs the row program of stage `s` (nodes `ns`), compiling it on first use of its operands'
/// signature; `None` when the fast path does not apply.
fn row_program(
    ex: &Exec,
    plan: &BlockPlan,
    s: usize,
    ns: &[usize],
    fstats: &mut FusedStats,
) -> Result<Option<Vec<(usize, BV)>>, String> {
    let empty = RowOperands::default();
    let ops = plan.row_ops.get(s).unwrap_or(&empty);
    let vals = ops
        .vals
        .iter()
        .map(|v| ex.get_raw(v))
        .collect::<Result<Vec<_>, _>>()?;
    let sig: Vec<OpSig> = vals.iter().map(sig_of).collect();
    let prog = compiled_rows(ex, plan, s, ns, sig, fstats);
    match prog {
        Some(p) => run_rows(ex, &p, &vals),
        None => Ok(None),
    }
}

/// Binds a row program's operands for a launch of `rows` rows. `None` entries of `vals` are
/// operands bound later, block by block (a GEMM's output read in its epilogue): their row lists are
/// left empty. `None` when an operand does not fit the program (the stage falls back).
fn bind<'v>(prog: &RowProg, vals: &[Option<&'v BV>], rows: usize) -> Option<Bound<'v, 'v>> {
    let mut ext = Vec::new();
    let mut shared = Vec::new();
    let mut scalars = Vec::new();
    for (o, v) in prog.held.iter().zip(vals) {
        match (o.src, v) {
            (Src::Ext(_), None) => ext.push(Vec::new()),
            (Src::Ext(_), Some(v)) => match row_ptrs(v, o.len) {
                Some(r) if r.len() == rows => ext.push(r),
                _ => return bail(3),
            },
            (Src::Shared(_), Some(BV::Shared(OpValue::Tensor(t)))) => match t.as_f32() {
                Some(d) if d.len() == o.len => shared.push(d),
                _ => return bail(3),
            },
            (Src::Scalar(_), Some(BV::Shared(OpValue::Tensor(t)))) => {
                match t.as_f32().and_then(|d| d.first()) {
                    Some(&x) => scalars.push(x),
                    None => return bail(3),
                }
            }
            _ => return bail(3),
        }
    }
    Some(Bound {
        ext,
        shared: Cow::Owned(shared),
        scalars: Cow::Owned(scalars),
    })
}

/// The row program's live values, one operand per (value, field), in `prog.outs` order: the
/// layout of the flat output buffers.
fn flat_outs(prog: &RowProg) -> impl Iterator<Item = &Opd> {
    prog.outs.iter().flat_map(|(_, os, _)| os.iter())
}

/// The rows of a row program's launch: the batch, then the per-instance leading dims.
fn row_lead(prog: &RowProg, b: usize) -> Vec<usize> {
    let mut lead = vec![b];
    lead.extend_from_slice(&prog.lead_tail);
    lead
}

/// The row program of stage `s` (nodes `ns`) for operands of signature `sig`: from the plan's
/// cache, or compiled now (and cached). `None` when these operands have no row program.
fn compiled_rows(
    ex: &Exec,
    plan: &BlockPlan,
    s: usize,
    ns: &[usize],
    sig: Vec<OpSig>,
    fstats: &mut FusedStats,
) -> Option<Arc<RowProg>> {
    let empty = RowOperands::default();
    let ops = plan.row_ops.get(s).unwrap_or(&empty);
    let compile = |sig: &[OpSig], fstats: &mut FusedStats| {
        let t0 = std::time::Instant::now();
        let p = compile_rows(ex.block, ns, ops, sig, &plan.live_out).map(Arc::new);
        fstats.row_compiles += 1;
        fstats.row_compile_time += t0.elapsed();
        p
    };
    match &plan.row_cache {
        Some(cache) => {
            let key = (s, sig);
            let hit = cache.lock().ok().and_then(|c| c.get(&key).cloned());
            match hit {
                Some(p) => p,
                None => {
                    let p = compile(&key.1, fstats);
                    if let Ok(mut c) = cache.lock() {
                        c.insert(key, p.clone());
                    }
                    p
                }
            }
        }
        None => compile(&sig, fstats),
    }
}

fn run_rows(ex: &Exec, prog: &RowProg, vals: &[BV]) -> Result<Option<Vec<(usize, BV)>>, String> {
    let lead = row_lead(prog, ex.b);
    let rows: usize = lead.iter().product();
    let vals: Vec<Option<&BV>> = vals.iter().map(Some).collect();
    let Some(bound) = bind(prog, &vals, rows) else {
        return Ok(None);
    };
    // Rows are independent: large programs split them across threads, each with its own scratch.
    // Only very large ones: on the 2-vCPU development machine (two hyperthreads of one core) a
    // split at 64 Ki scratch floats made TreeLSTM-large's row programs slower (265 vs 234 ms over
    // 512 trees), at 1 Mi it is neutral (247 ms) and the whole run faster (1016-1060 vs 1098 ms).
    let threads = if rows * prog.scratch_len.max(1) >= 1 << 20 {
        ex.threads.clamp(1, rows.max(1))
    } else {
        1
    };
    let bufs = if threads == 1 {
        run_rows_in_order(prog, &bound, rows)
    } else {
        ex.row_splits.set(ex.row_splits.get() + 1);
        run_rows_split(prog, &bound, rows, threads)?
    };
    assemble(prog, &lead, bufs).map(Some)
}

/// The result values of a row program from its flat output buffers.
fn assemble(
    prog: &RowProg,
    lead: &[usize],
    bufs: Vec<Vec<f32>>,
) -> Result<Vec<(usize, BV)>, String> {
    let mut bufs = bufs.into_iter();
    let mut result = Vec::with_capacity(prog.outs.len());
    for &(i, ref os, tuple) in &prog.outs {
        let mut tensors = Vec::with_capacity(os.len());
        for o in os {
            let buf = bufs.next().ok_or("internal: row program output missing")?;
            let mut shape = lead.to_vec();
            shape.push(o.len);
            tensors.push(Tensor::from_f32(shape, buf).map_err(|e| e.to_string())?);
        }
        let v = if tuple {
            BV::Batched(OpValue::Tuple(tensors))
        } else {
            match tensors.pop() {
                Some(t) => BV::Batched(OpValue::Tensor(t)),
                None => return Err("internal: empty row output".into()),
            }
        };
        result.push((i, v));
    }
    Ok(result)
}

/// One thread: rows in order, each live value appended to its output (no zero-filled buffers).
fn run_rows_in_order(prog: &RowProg, bound: &Bound, rows: usize) -> Vec<Vec<f32>> {
    let outs: Vec<&Opd> = flat_outs(prog).collect();
    let mut bufs: Vec<Vec<f32>> = outs
        .iter()
        .map(|o| with_capacity_f32(rows * o.len))
        .collect();
    let mut scratch = vec![0f32; prog.scratch_len];
    for r in 0..rows {
        for ins in &prog.instrs {
            exec(ins, r, bound, &mut scratch);
        }
        for (o, buf) in outs.iter().zip(bufs.iter_mut()) {
            match o.src {
                Src::Scalar(sc) => {
                    let x = bound.scalars.get(sc).copied().unwrap_or(0.0);
                    buf.resize(buf.len() + o.len, x);
                }
                _ => buf.extend_from_slice(slice(o, r, bound, &scratch)),
            }
        }
    }
    bufs
}

/// Runs rows `0..rows` of `bound` into `outs` (the flat outputs' slices for those rows). Errors,
/// before computing anything, when an output slice is too short for `rows` rows (a bug of the
/// caller's split, reported rather than leaving rows unwritten).
fn run_row_block(
    prog: &RowProg,
    bound: &Bound,
    rows: usize,
    outs: &mut [&mut [f32]],
) -> Result<(), String> {
    for (i, (o, out)) in flat_outs(prog).zip(outs.iter()).enumerate() {
        if out.len() < rows * o.len {
            return Err(format!(
                "internal: row program output {i} holds {} floats, {rows} rows of {} need {}",
                out.len(),
                o.len,
                rows * o.len
            ));
        }
    }
    let mut scratch = vec![0f32; prog.scratch_len];
    for r in 0..rows {
        for ins in &prog.instrs {
            exec(ins, r, bound, &mut scratch);
        }
        for (o, out) in flat_outs(prog).zip(outs.iter_mut()) {
            let at = r * o.len;
            if let Some(dst) = out.get_mut(at..at + o.len) {
                read(o, r, bound, &scratch, dst);
            }
        }
    }
    Ok(())
}

/// Several threads: each runs a contiguous range of rows into its part of zero-filled outputs.
fn run_rows_split(
    prog: &RowProg,
    bound: &Bound,
    rows: usize,
    threads: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let widths: Vec<usize> = flat_outs(prog).map(|o| o.len).collect();
    let mut bufs: Vec<Vec<f32>> = widths.iter().map(|w| zeroed_f32(rows * w)).collect();
    let chunk = rows.div_ceil(threads).max(1);
    let mut rest: Vec<&mut [f32]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let mut parts = Vec::with_capacity(threads);
    for start in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - start);
        let mine: Vec<&mut [f32]> = rest
            .iter_mut()
            .zip(&widths)
            .map(|(r, w)| {
                // The length is read before `take` empties `r`.
                let at = (n * w).min(r.len());
                let (head, tail) = std::mem::take(r).split_at_mut(at);
                *r = tail;
                head
            })
            .collect();
        parts.push((start, n, mine));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|(start, n, mut mine)| {
                let block = Bound {
                    ext: bound
                        .ext
                        .iter()
                        .map(|e| e.get(start..start + n).unwrap_or(&[]).to_vec())
                        .collect(),
                    shared: Cow::Borrowed(&bound.shared),
                    scalars: Cow::Borrowed(&bound.scalars),
                };
                s.spawn(move || run_row_block(prog, &block, n, &mut mine))
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| "internal: a row-program thread panicked".to_string())??;
        }
        Ok::<(), String>(())
    })?;
    Ok(bufs)
}

/// Why a row program did not apply (printed with `TUMBLE_DEBUG_FUSION=1`, for development).
fn bail<T>(site: u32) -> Option<T> {
    // Read once: bailing happens per launch for shared-only segments.
    static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *DEBUG.get_or_init(|| std::env::var_os("TUMBLE_DEBUG_FUSION").is_some()) {
        eprintln!("row program fell back at check {site}");
    }
    None
}

/// Identity of a block value, to find an operand seen before (constants by their own identity:
/// two literals that print alike are still different values).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ValKey {
    Input(u32),
    Node(u32),
    Field(u32, u32),
    Const(usize),
}

impl ValKey {
    fn of(v: &BVal) -> ValKey {
        match v {
            BVal::Input(i) => ValKey::Input(*i),
            BVal::Node(n) => ValKey::Node(*n),
            BVal::Field(n, f) => ValKey::Field(*n, *f),
            BVal::Const(t) => ValKey::Const(t as *const Tensor as usize),
        }
    }
}

/// Copies operand `o` of row `r` into `dst` (broadcasting a scalar).
fn read(o: &Opd, r: usize, b: &Bound, scratch: &[f32], dst: &mut [f32]) {
    match o.src {
        Src::Scalar(s) => dst.fill(b.scalars.get(s).copied().unwrap_or(0.0)),
        _ => dst.copy_from_slice(slice(o, r, b, scratch)),
    }
}

fn slice<'s>(o: &Opd, r: usize, b: &'s Bound, scratch: &'s [f32]) -> &'s [f32] {
    match o.src {
        Src::Ext(e) => &b.ext[e][r][o.off..o.off + o.len],
        Src::Shared(s) => &b.shared[s][o.off..o.off + o.len],
        Src::Scratch => &scratch[o.off..o.off + o.len],
        Src::Scalar(_) => &[],
    }
}

/// An operand's values in one row: a slice, or one value broadcast along the row.
enum Vals<'s> {
    Slice(&'s [f32]),
    Splat(f32),
}

impl Vals<'_> {
    #[inline(always)]
    fn at(&self, j: usize) -> f32 {
        match self {
            Vals::Slice(s) => s.get(j).copied().unwrap_or(0.0),
            Vals::Splat(x) => *x,
        }
    }
}

/// Operand `o` of row `r`; `src` is the scratch below the destination being written.
fn vals<'s>(o: &Opd, r: usize, b: &'s Bound, src: &'s [f32]) -> Vals<'s> {
    match o.src {
        Src::Scalar(s) => Vals::Splat(b.scalars.get(s).copied().unwrap_or(0.0)),
        _ if o.len == 1 => Vals::Splat(slice(o, r, b, src).first().copied().unwrap_or(0.0)),
        _ => Vals::Slice(slice(o, r, b, src)),
    }
}

fn map1(dst: &mut [f32], a: &Vals, f: impl Fn(f32) -> f32) {
    match a {
        Vals::Slice(s) => crate::simd::unary(dst, s, f),
        Vals::Splat(x) => dst.fill(f(*x)),
    }
}

fn map2(dst: &mut [f32], a: &Vals, b: &Vals, f: impl Fn(f32, f32) -> f32) {
    match (a, b) {
        (Vals::Slice(x), Vals::Slice(y)) => crate::simd::binary(dst, x, y, f),
        (Vals::Slice(x), Vals::Splat(q)) => crate::simd::unary(dst, x, |p| f(p, *q)),
        (Vals::Splat(p), Vals::Slice(y)) => crate::simd::unary(dst, y, |q| f(*p, q)),
        (Vals::Splat(p), Vals::Splat(q)) => dst.fill(f(*p, *q)),
    }
}

fn exec(ins: &Instr, r: usize, b: &Bound, scratch: &mut [f32]) {
    // Every instruction writes a fresh scratch range above all of its operands' ranges, so the
    // scratch splits into a read-only part (operands) and the destination.
    let (d, len) = match ins {
        Instr::Unary(_, d, a)
        | Instr::Clip(d, a, ..)
        | Instr::Softmax(d, a, _)
        | Instr::LayerNorm(d, a, ..) => (*d, a.len),
        Instr::Binary(_, d, a, bb) => (*d, a.len.max(bb.len)),
        Instr::Concat(d, parts) => (*d, parts.iter().map(|p| p.len).sum()),
    };
    let (src, rest) = scratch.split_at_mut(d);
    let Some(dst) = rest.get_mut(..len) else {
        return;
    };
    match ins {
        Instr::Unary(u, _, a) => {
            let av = vals(a, r, b, src);
            match u {
                Un::Sigmoid => map1(dst, &av, fastmath::sigmoid),
                Un::Tanh => map1(dst, &av, fastmath::tanh),
                Un::Exp => map1(dst, &av, fastmath::exp),
                Un::Log => map1(dst, &av, f32::ln),
                Un::Sqrt => map1(dst, &av, f32::sqrt),
                Un::Rsqrt => map1(dst, &av, |x| 1.0 / x.sqrt()),
                Un::Abs => map1(dst, &av, f32::abs),
                Un::Neg => map1(dst, &av, |x| -x),
                Un::Relu => map1(dst, &av, |x| x.max(0.0)),
                Un::Copy => map1(dst, &av, |x| x),
            }
        }
        Instr::Binary(op, _, a, bb) => {
            let (av, bv) = (vals(a, r, b, src), vals(bb, r, b, src));
            match op {
                Bin::Add => map2(dst, &av, &bv, |x, y| x + y),
                Bin::Sub => map2(dst, &av, &bv, |x, y| x - y),
                Bin::Mul => map2(dst, &av, &bv, |x, y| x * y),
                Bin::Div => map2(dst, &av, &bv, |x, y| x / y),
                Bin::Max => map2(
                    dst,
                    &av,
                    &bv,
                    |x, y| if x.is_nan() || x > y { x } else { y },
                ),
                Bin::Min => map2(
                    dst,
                    &av,
                    &bv,
                    |x, y| if x.is_nan() || x < y { x } else { y },
                ),
            }
        }
        Instr::Clip(_, a, lo, hi) => {
            let av = vals(a, r, b, src);
            map1(
                dst,
                &av,
                |x| if x.is_nan() { x } else { x.max(*lo).min(*hi) },
            );
        }
        Instr::Concat(_, parts) => {
            let mut off = 0;
            for p in parts {
                let v = vals(p, r, b, src);
                if let Some(seg) = dst.get_mut(off..off + p.len) {
                    map1(seg, &v, |x| x);
                }
                off += p.len;
            }
        }
        Instr::Softmax(_, a, log) => {
            let av = vals(a, r, b, src);
            let m = (0..len).map(|j| av.at(j)).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for (j, o) in dst.iter_mut().enumerate() {
                *o = fastmath::exp(av.at(j) - m);
                sum += *o as f64;
            }
            if *log {
                let ls = sum.ln() as f32;
                for (j, o) in dst.iter_mut().enumerate() {
                    *o = av.at(j) - m - ls;
                }
            } else {
                let inv = (1.0 / sum) as f32;
                dst.iter_mut().for_each(|o| *o *= inv);
            }
        }
        Instr::LayerNorm(_, a, g, be, eps) => {
            let av = vals(a, r, b, src);
            let n = len.max(1) as f64;
            let mean = (0..len).map(|j| av.at(j) as f64).sum::<f64>() / n;
            let var = (0..len)
                .map(|j| (av.at(j) as f64 - mean).powi(2))
                .sum::<f64>()
                / n;
            let inv = (1.0 / (var + *eps as f64).sqrt()) as f32;
            let mean = mean as f32;
            let gv = g.map(|g| vals(&g, r, b, src));
            let bv = be.map(|x| vals(&x, r, b, src));
            for (j, o) in dst.iter_mut().enumerate() {
                let mut y = (av.at(j) - mean) * inv;
                if let Some(g) = &gv {
                    y *= g.at(j);
                }
                if let Some(bb) = &bv {
                    y += bb.at(j);
                }
                *o = y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row program with no instructions that copies its one batched operand (width `w`) out.
    fn copy_program(w: usize) -> RowProg {
        let opd = Opd {
            src: Src::Ext(0),
            off: 0,
            len: w,
        };
        RowProg {
            held: vec![opd],
            lead_tail: Vec::new(),
            scratch_len: 0,
            instrs: Vec::new(),
            outs: vec![(0, vec![opd], false)],
        }
    }

    #[test]
    fn a_short_output_is_an_error_not_skipped_rows() {
        let prog = copy_program(3);
        let rows_data: Vec<Vec<f32>> = (0..7).map(|r| vec![r as f32; 3]).collect();
        let bound = Bound {
            ext: vec![rows_data.iter().map(Vec::as_slice).collect()],
            shared: Cow::Owned(Vec::new()),
            scalars: Cow::Owned(Vec::new()),
        };
        // Room for all 7 rows: every row is written.
        let mut full = vec![-1f32; 21];
        run_row_block(&prog, &bound, 7, &mut [full.as_mut_slice()]).unwrap();
        assert_eq!(full[18..], [6.0, 6.0, 6.0]);
        // Room for 6: an error naming the sizes, and nothing written.
        let mut short = vec![-1f32; 18];
        let err = run_row_block(&prog, &bound, 7, &mut [short.as_mut_slice()]).unwrap_err();
        assert!(
            err.contains("holds 18 floats") && err.contains("need 21"),
            "{err}"
        );
        assert!(short.iter().all(|&x| x == -1.0));
    }

    #[test]
    fn split_rows_match_rows_in_order_at_odd_sizes() {
        for (rows, threads) in [(1, 2), (7, 2), (33, 3), (33, 5)] {
            let prog = copy_program(5);
            let rows_data: Vec<Vec<f32>> = (0..rows)
                .map(|r| (0..5).map(|c| (r * 5 + c) as f32).collect())
                .collect();
            let bound = Bound {
                ext: vec![rows_data.iter().map(Vec::as_slice).collect()],
                shared: Cow::Owned(Vec::new()),
                scalars: Cow::Owned(Vec::new()),
            };
            let split = run_rows_split(&prog, &bound, rows, threads).unwrap();
            let in_order = run_rows_in_order(&prog, &bound, rows);
            assert_eq!(split, in_order, "rows {rows}, threads {threads}");
            assert_eq!(split[0].len(), rows * 5);
        }
    }
}
