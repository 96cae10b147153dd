//! Executing block kernel plans: how a static block runs for one launch.
//!
//! The plan itself — stages, liveness, horizontal-fusion groups, epilogue choices, row-program
//! operands — is made once per program by the compiler ([`tumble_compile::plan`]). This module
//! runs it: GEMM stages on `tumble-kernels` ([`gemm`]), embedding gathers ([`gather`]), fused f32
//! row programs ([`rowprog`] compiles them per operand signature, [`rowexec`] binds and runs
//! them), and every other operator through the batching rules of [`crate::batched`]. Whether a
//! stage's fast path applies (f32, shapes that line up, shared weights) is checked at each launch,
//! falling back to the batching rules, so a plan never changes results beyond float rounding.
//! `--no-fusion` turns plans off.
//!
//! Batched inputs may arrive as **row lists** ([`BV::Rows`], gather fusion, ACROBAT §5.2,
//! `--no-gather-fusion`), which GEMM stages and row programs read in place while any other stage
//! gets them stacked (`Exec::get` vs `Exec::get_raw`). Row programs are **compiled once** per stage
//! and operand signature and cached in the [`RunPlan`], which lives as long as the job's
//! [`crate::Executable`] (`--no-row-cache` compiles at every launch).

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::sync::Mutex;

use tumble_compile::plan::BlockPlan;
use tumble_compile::{BArg, BVal, Block, PlanOptions, Stage};
use tumble_ops::{OpCtx, OpValue};

use crate::batched::{batched_op, tuple_of, LaunchOps, OpStats, BV};

pub(crate) mod attention;
mod dense_sum;
pub mod device;
mod gather;
mod gemm;
mod rowcuda;
pub(crate) mod rowexec;
pub(crate) use rowexec::unary_f32;
mod rowprog;

use dense_sum::{sum_operands, sum_stage};
use gather::gather_stage;
pub(crate) use gemm::dot;
use gemm::{dense_operands, gemm_with_epilogue, hdense_stage, matmul_stage, run_dense};
use rowexec::row_program;
pub(crate) use rowexec::softmax_row;
use rowprog::RowCache;

/// A block's plan as a job runs it: the compiler's static plan and the row programs compiled for
/// it so far, shared by every mini-batch and worker of the job.
#[derive(Debug)]
pub struct RunPlan {
    pub plan: BlockPlan,
    /// Compiled row programs (`None` when caching is off).
    row_cache: Option<Mutex<RowCache>>,
    /// Per stage, the values a launch drops once the stage has run ([`BlockPlan::dead_after`]):
    /// a launch held every intermediate to its end (Berxit's layer: ~55 MB for 8 sentences, a
    /// first run's fresh pages; the buffer pool now hands them to the same launch's next stages).
    dead_after: Vec<Vec<usize>>,
}

impl RunPlan {
    pub fn new(block: &Block, plan: BlockPlan, row_cache: bool) -> RunPlan {
        let dead_after = match keep_launch_values() {
            true => Vec::new(),
            false => plan.dead_after(block),
        };
        RunPlan {
            plan,
            row_cache: row_cache.then(Mutex::default),
            dead_after,
        }
    }
}

/// `TUMBLE_KEEP_LAUNCH_VALUES=1`: a launch keeps every intermediate value to its end (the A/B
/// baseline of [`RunPlan::dead_after`]).
fn keep_launch_values() -> bool {
    tumble_limits::switch_on!("TUMBLE_KEEP_LAUNCH_VALUES")
}

impl fmt::Display for RunPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.plan.fmt(f)
    }
}

/// The plan of a block, with every plan-level optimization and the row-program cache on.
pub fn plan(block: &Block) -> RunPlan {
    plan_with(block, PlanOptions::default(), true)
}

/// The compiler's plan of a block for `opts`, with a row-program cache when `row_cache`.
pub fn plan_with(block: &Block, opts: PlanOptions, row_cache: bool) -> RunPlan {
    RunPlan::new(
        block,
        tumble_compile::plan::plan_with(block, opts),
        row_cache,
    )
}

pub(super) struct Exec<'a> {
    block: &'a Block,
    inputs: &'a [BV],
    /// `PlanOptions::gather_views` of the plan.
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

impl<'a> Exec<'a> {
    fn new(
        block: &'a Block,
        inputs: &'a [BV],
        gather_views: bool,
        b: usize,
        threads: usize,
    ) -> Exec<'a> {
        Exec {
            block,
            inputs,
            gather_views,
            stacked: RefCell::new(vec![None; inputs.len()]),
            stacked_nodes: RefCell::new(vec![None; block.nodes.len()]),
            stacks: Cell::new(0),
            row_splits: Cell::new(0),
            vals: vec![None; block.nodes.len()],
            b,
            threads,
        }
    }

    /// Drops the values of nodes `dead` (and their stacked copies): their buffers go back to the
    /// pool for the launch's later stages.
    fn drop_values(&mut self, dead: &[usize]) {
        let stacked = self.stacked_nodes.get_mut();
        for &k in dead {
            if let Some(v) = self.vals.get_mut(k) {
                *v = None;
            }
            if let Some(v) = stacked.get_mut(k) {
                *v = None;
            }
        }
    }

    /// A value as a contiguous batch or shared value (row lists stacked).
    fn get(&self, v: &BVal) -> Result<BV, String> {
        match v {
            BVal::Input(i) => match self.inputs.get(*i as usize) {
                Some(BV::Rows(r)) => self.stacked_once(&self.stacked, *i as usize, r),
                _ => self.get_raw(v).map(Cow::into_owned),
            },
            BVal::Node(n) => match self.vals.get(*n as usize) {
                Some(Some(BV::Rows(r))) => self.stacked_once(&self.stacked_nodes, *n as usize, r),
                _ => self.get_raw(v).map(Cow::into_owned),
            },
            _ => self.get_raw(v).map(Cow::into_owned),
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

    /// Block output `v` as it lies: row references (gather views) become the launch's output
    /// slots; inputs and constants as a batch or a shared value.
    fn output(&self, v: &BVal) -> Result<BV, String> {
        match v {
            BVal::Node(_) => self.get_raw(v).map(Cow::into_owned),
            _ => self.get(v),
        }
    }

    /// A value as it is, row lists included (for the stages that read rows in place).
    ///
    /// Borrowed where the value is held whole: a launch's row lists have a tensor per row, so a
    /// copy would cost a reference-count update per row at every read.
    fn get_raw(&self, v: &BVal) -> Result<Cow<'_, BV>, String> {
        let missing = || format!("internal: block value {v} is not available");
        match v {
            BVal::Input(i) => self
                .inputs
                .get(*i as usize)
                .map(Cow::Borrowed)
                .ok_or_else(missing),
            BVal::Node(n) => self
                .vals
                .get(*n as usize)
                .and_then(Option::as_ref)
                .map(Cow::Borrowed)
                .ok_or_else(missing),
            BVal::Field(n, f) => self
                .vals
                .get(*n as usize)
                .and_then(Option::as_ref)
                .and_then(|v| v.field(*f))
                .map(Cow::Owned)
                .ok_or_else(missing),
            BVal::Const(t) => Ok(Cow::Owned(BV::Shared(OpValue::Tensor(t.clone())))),
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

    fn run_node(&mut self, i: usize, ops: &mut LaunchOps) -> Result<(), String> {
        let node = self.block.nodes.get(i).ok_or("internal: node")?;
        // A reshape (or a squeeze, an expand_dims) of one instance's elements, its result type
        // known: the same elements under another shape. Of row references (a gather view, or an
        // input passed as rows where they lie: a column-vector state entering a canonical
        // product) a view of the same rows; of a batch, the batch under the new shape — neither
        // copies, and neither takes the batching rule's way through the relation.
        if matches!(node.op.name, "reshape" | "squeeze" | "expand_dims") {
            if let Some(BArg::One(src @ (BVal::Node(_) | BVal::Input(_)))) = node.args.first() {
                let dims: Option<Vec<usize>> = node.ty.as_tensor().and_then(|(d, _)| {
                    d.iter()
                        .map(|x| x.known().and_then(|k| usize::try_from(k).ok()))
                        .collect()
                });
                let viewed = match (self.get_raw(src), dims) {
                    (Ok(Cow::Borrowed(BV::Rows(r))), Some(d)) => r.reshaped(&d).map(BV::Rows),
                    (Ok(Cow::Borrowed(BV::Batched(OpValue::Tensor(t)))), Some(d)) => {
                        let mut shape = Vec::with_capacity(d.len() + 1);
                        shape.push(self.b);
                        shape.extend_from_slice(&d);
                        t.reshape(shape)
                            .ok()
                            .map(|t| BV::Batched(OpValue::Tensor(t)))
                    }
                    _ => None,
                };
                if let Some(v) = viewed {
                    ops.stats.batched += 1;
                    self.vals[i] = Some(v);
                    return Ok(());
                }
            }
        }
        let args = node
            .args
            .iter()
            .map(|a| self.arg(a))
            .collect::<Result<Vec<_>, _>>()?;
        let v = batched_op(node.op, &node.attrs, args, self.b, ops)?;
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
    /// Dense stages run as [`Stage::DenseSum`] (counted in `dense_stages` too).
    pub dense_sums: u64,
    /// With a GPU (`--device cuda`): stages that ran on the device, and stages of device
    /// launches that ran on the host (gathers, other operators, operands the device does not
    /// take).
    pub device_stages: u64,
    pub host_stages: u64,
    /// Time queuing device stages and copying launch outputs back (kernels run asynchronously:
    /// their time shows up in the copies).
    pub device_time: std::time::Duration,
    /// Of which: host values copied to the device (count, bytes, time of the calls), downloads
    /// (each one wait for the stream: count, time), and the host stages of device launches.
    pub device_uploads: u64,
    pub device_upload_bytes: u64,
    pub device_upload_time: std::time::Duration,
    pub device_waits: u64,
    pub device_wait_time: std::time::Duration,
    pub device_host_stage_time: std::time::Duration,
    /// Row-list inputs gathered on the device from copies it holds (instead of stacked on the
    /// host and uploaded).
    pub device_gathers: u64,
    /// Batched inputs that were an earlier launch's output, read where the device holds it.
    pub device_in_place: u64,
}

/// What a planned launch runs with: what its operators need outside the plan's fast paths
/// (the batching rules' [`LaunchOps`]: the random stream, their counters, the launch's share of
/// threads) and the counters of the fused stages. The parts are separate borrows, so a caller can
/// lend disjoint parts of its profile.
pub struct LaunchCtx<'a, 'r> {
    pub(crate) ops: LaunchOps<'a, 'r>,
    pub fstats: &'a mut FusedStats,
}

impl<'a, 'r> LaunchCtx<'a, 'r> {
    /// A launch on `threads` threads whose operators run on the forward's f32 fast paths.
    pub fn new(
        octx: &'a mut OpCtx<'r>,
        stats: &'a mut OpStats,
        fstats: &'a mut FusedStats,
        threads: usize,
    ) -> Self {
        LaunchCtx {
            ops: LaunchOps::new(octx, stats, threads),
            fstats,
        }
    }
}

/// Runs `block` for `b` invocations following `plan`, on the host.
pub fn run_planned(
    block: &Block,
    run_plan: &RunPlan,
    inputs: &[BV],
    b: usize,
    cx: &mut LaunchCtx,
) -> Result<Vec<BV>, String> {
    run_planned_on(None, block, run_plan, inputs, b, cx)
}

/// Runs `f` on each of `parts` on up to `threads` threads (the kernels' helper threads,
/// [`tumble_kernels::run_parallel`]). The error reported is the first part's in order, whichever
/// finished first, and a part that panics is an error naming `what`, as when each part had a
/// thread of its own.
pub(super) fn split_parts<T: Send>(
    threads: usize,
    parts: Vec<T>,
    what: &str,
    f: impl Fn(T) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let failure: std::sync::Mutex<Option<(usize, String)>> = std::sync::Mutex::new(None);
    let indexed: Vec<(usize, T)> = parts.into_iter().enumerate().collect();
    tumble_kernels::run_parallel(threads, indexed, |(i, part)| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(part)))
            .unwrap_or_else(|_| Err(format!("internal: a {what} thread panicked")));
        if let Err(e) = r {
            let mut first = failure.lock().unwrap_or_else(|p| p.into_inner());
            if first.as_ref().is_none_or(|(j, _)| i < *j) {
                *first = Some((i, e));
            }
        }
    });
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// [`run_planned`], on `device` when one is given: the stages it takes run there
/// ([`device::run_stages`]), the others on the host.
pub(crate) fn run_planned_on(
    device: Option<&device::DeviceRun>,
    block: &Block,
    run_plan: &RunPlan,
    inputs: &[BV],
    b: usize,
    cx: &mut LaunchCtx,
) -> Result<Vec<BV>, String> {
    let mut ex = Exec::new(block, inputs, run_plan.plan.gather_views, b, cx.ops.threads);
    let outs = match device {
        Some(d) => device::run_stages(d, &mut ex, run_plan, cx),
        None => run_stages_on_host(&mut ex, run_plan, cx)
            .and_then(|()| block.outputs.iter().map(|v| ex.output(v)).collect()),
    };
    cx.fstats.row_lists_stacked += ex.stacks.get();
    cx.fstats.row_splits += ex.row_splits.get();
    outs
}

/// Every stage of the plan on the host, GEMM stages with their epilogues.
fn run_stages_on_host(ex: &mut Exec, run_plan: &RunPlan, cx: &mut LaunchCtx) -> Result<(), String> {
    let fstats = &mut *cx.fstats;
    let plan = &run_plan.plan;
    // A row-program stage already run as the previous GEMM's epilogue.
    let mut done_as_epilogue = None;
    for (s, stage) in plan.stages.iter().enumerate() {
        // Values nothing after the last stage run reads (a stage run as an epilogue included).
        if let Some(dead) = s.checked_sub(1).and_then(|d| run_plan.dead_after.get(d)) {
            ex.drop_values(dead);
        }
        if done_as_epilogue == Some(s) {
            continue;
        }
        if plan.epilogue.get(s).copied().unwrap_or(false) {
            if let Some(Stage::Rows(ns)) = plan.stages.get(s + 1) {
                let t0 = std::time::Instant::now();
                let ops = match stage {
                    Stage::Dense(i) => dense_operands(ex, std::slice::from_ref(i))?,
                    Stage::HDense(ds) => dense_operands(ex, ds)?,
                    Stage::DenseSum {
                        denses,
                        parts,
                        addends,
                        ..
                    } => match stage.result() {
                        Some(r) => sum_operands(ex, denses, parts, addends, r)?,
                        None => None,
                    },
                    _ => None,
                };
                let r = match &ops {
                    Some(ops) => gemm_with_epilogue(ex, run_plan, ops, s + 1, ns, fstats)?,
                    None => None,
                };
                if let (Some((outs, flops)), Some(ops)) = (r, &ops) {
                    fstats.dense_time += t0.elapsed();
                    fstats.dense_stages += 1;
                    fstats.dense_flops += flops;
                    if matches!(stage, Stage::HDense(_)) {
                        fstats.hfused_stages += 1;
                        fstats.hfused_denses += ops.outs.len() as u64;
                    }
                    if matches!(stage, Stage::DenseSum { .. }) {
                        fstats.dense_sums += 1;
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
        run_stage(ex, run_plan, s, stage, &mut cx.ops, fstats)?;
    }
    Ok(())
}

/// Runs stage `s` of the plan on its own (not as an epilogue): its fast path where this launch's
/// operands allow it, else its nodes one by one through the batching rules.
pub(super) fn run_stage(
    ex: &mut Exec,
    run_plan: &RunPlan,
    s: usize,
    stage: &Stage,
    ops: &mut LaunchOps,
    fstats: &mut FusedStats,
) -> Result<(), String> {
    match stage {
        Stage::Dense(i) => run_dense(ex, *i, ops, fstats)?,
        Stage::HDense(ns) => {
            let t0 = std::time::Instant::now();
            let r = hdense_stage(ex, ns)?;
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
                        run_dense(ex, i, ops, fstats)?;
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
            let r = matmul_stage(ex, *dense, *transpose, *concat)?;
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
                        ex.run_node(i, ops)?;
                    }
                    run_dense(ex, *dense, ops, fstats)?;
                }
            }
        }
        Stage::DenseSum {
            denses,
            parts,
            addends,
            ..
        } => {
            let t0 = std::time::Instant::now();
            let r = match stage.result() {
                Some(res) => match sum_operands(ex, denses, parts, addends, res)? {
                    Some(ops) => sum_stage(ex, &ops)?.map(|v| (res, v)),
                    None => None,
                },
                None => None,
            };
            fstats.dense_time += t0.elapsed();
            match r {
                Some((res, (v, flops))) => {
                    fstats.dense_stages += 1;
                    fstats.dense_sums += 1;
                    fstats.dense_flops += flops;
                    if let Some(slot) = ex.vals.get_mut(res) {
                        *slot = Some(v);
                    }
                }
                // Not this launch's operands: the concatenations, products and sums one by
                // one, in node order; a product still as a dense stage where it can be one (a
                // weight per invocation: a small product each, not the reference kernel).
                None => {
                    fstats.fallbacks += 1;
                    for i in stage.nodes() {
                        match ex.block.nodes.get(i) {
                            Some(n) if n.op.name == "nn.dense" => run_dense(ex, i, ops, fstats)?,
                            _ => ex.run_node(i, ops)?,
                        }
                    }
                }
            }
        }
        Stage::Gather(i) => match gather_stage(ex, *i)? {
            Some(v) => {
                if matches!(v, BV::Rows(_)) {
                    fstats.gather_views += 1;
                }
                ex.vals[*i] = Some(v);
            }
            None => {
                fstats.fallbacks += 1;
                ex.run_node(*i, ops)?;
            }
        },
        Stage::Rows(ns) => {
            let t0 = std::time::Instant::now();
            let r = row_program(ex, run_plan, s, ns, fstats)?;
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
                        ex.run_node(i, ops)?;
                    }
                }
            }
        }
        Stage::Other(i) => ex.run_node(*i, ops)?,
    }
    Ok(())
}
