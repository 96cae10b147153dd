//! Running a block's kernel plan on a GPU (`tumble run --device cuda`).
//!
//! The same plan the CPU runs, stage by stage: GEMM stages (one product, horizontally fused
//! products, sums of products) run as `tumble_cuda`'s `X · Wᵀ` kernel, row programs as CUDA kernels
//! generated from the same compiled [`RowProg`] the CPU interprets ([`super::rowcuda`]), reshapes
//! as views. A stage the device does not run (embedding gathers, per-invocation weights, other
//! operators, other dtypes) runs on the host exactly as on the CPU path, its operands copied back
//! first; its results go to the device when a later device stage reads them. Results never depend
//! on where a stage ran beyond float rounding.
//!
//! What lives on the device: the weights (uploaded once per job and kept, with the
//! concatenations the fused products read, in [`DeviceRun`]) and a launch's intermediate values.
//! A launch's batched inputs are uploaded at its start and its outputs copied back at its end, so
//! values cross the bus once per launch, not once per stage; the host keeps driving control flow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tumble_compile::plan::{RowOperands, ValKey};
use tumble_compile::{BArg, BVal, Block, Stage};
use tumble_cuda::{Arg, DevBuf, Fetch, Gpu, GpuError, Kernel, Mat};
use tumble_ir::DType;
use tumble_ops::{OpCtx, OpValue};
use tumble_tensor::Tensor;

use super::rowcuda::row_kernel;
use super::rowexec::compiled_rows;
use super::rowprog::{OpSig, RowProg, Src};
use super::{run_stage, Exec, FusedStats, RunPlan};
use crate::batched::{OpStats, BV};

/// A job's GPU: the device and the weights uploaded so far (by tensor identity, each kept alive
/// so its address is never reused while it is cached).
pub struct DeviceRun {
    pub gpu: Gpu,
    weights: Mutex<HashMap<WeightKey, Arc<DevWeight>>>,
    /// Compiled row-program kernels by program (the row cache's `Arc`, kept so its address is
    /// not reused): a launch neither writes the source again nor hashes it.
    kernels: Mutex<HashMap<usize, KernelEntry>>,
}

/// A compiled row program and the program it was made from.
type KernelEntry = (Arc<RowProg>, Arc<RowLaunch>);

/// A row program's kernel and how to launch it.
struct RowLaunch {
    kernel: Kernel,
    threads: u32,
    shared_bytes: u32,
    global_scratch: bool,
}

/// Tensors by identity (buffer and shape), and how they are laid side by side.
type WeightKey = Vec<(usize, Vec<usize>)>;

impl std::fmt::Debug for DeviceRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceRun({:?})", self.gpu)
    }
}

struct DevWeight {
    _keep: Vec<Tensor>,
    buf: Arc<DevBuf>,
}

/// Cached device copies of shared values beyond this many are dropped (and made again on use):
/// shared values that are not weights (a launch's own scalars) would otherwise accumulate.
const MAX_CACHED: usize = 4096;

fn gpu_err(e: GpuError) -> String {
    e.to_string()
}

impl DeviceRun {
    /// The kernel of row program `prog`, generated and compiled on its first launch.
    fn row_launch(&self, prog: &Arc<RowProg>) -> Result<Arc<RowLaunch>, String> {
        let key = Arc::as_ptr(prog) as usize;
        if let Some((_, k)) = self.kernels.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(k);
        }
        let k = row_kernel(prog);
        let launch = Arc::new(RowLaunch {
            kernel: self.gpu.compile(&k.name, &k.source).map_err(gpu_err)?,
            threads: k.threads,
            shared_bytes: k.shared_bytes,
            global_scratch: k.global_scratch,
        });
        if let Ok(mut m) = self.kernels.lock() {
            if m.len() >= MAX_CACHED {
                m.clear();
            }
            m.insert(key, (prog.clone(), launch.clone()));
        }
        Ok(launch)
    }

    pub fn new(gpu: Gpu) -> DeviceRun {
        DeviceRun {
            gpu,
            weights: Mutex::default(),
            kernels: Mutex::default(),
        }
    }

    /// The device copy of `parts` laid side by side: `along_rows` stacks them (a fused product's
    /// weights `(N_i, K)` into `(Σ N_i, K)`), otherwise their rows are concatenated (a sum of
    /// products' weights `(N, K_i)` into `(N, Σ K_i)`). Made once per job.
    fn weight(&self, parts: &[Tensor], along_rows: bool) -> Result<Arc<DevBuf>, String> {
        let mut key: WeightKey = parts
            .iter()
            .map(|t| (t.buffer_id(), t.shape().to_vec()))
            .collect();
        // The two layouts of one list differ.
        key.push((along_rows as usize, Vec::new()));
        if let Some(w) = self.weights.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(w.buf.clone());
        }
        let datas = parts
            .iter()
            .map(|t| t.as_f32().ok_or("internal: device weight is not f32"))
            .collect::<Result<Vec<_>, _>>()?;
        let joined: Vec<f32> = if along_rows || parts.len() == 1 {
            datas.concat()
        } else {
            let rows = parts.first().and_then(|t| t.shape().first()).copied();
            let rows = rows.ok_or("internal: device weight without rows")?;
            let widths: Vec<usize> = datas.iter().map(|d| d.len() / rows.max(1)).collect();
            let mut out = Vec::with_capacity(datas.iter().map(|d| d.len()).sum());
            for r in 0..rows {
                for (d, &w) in datas.iter().zip(&widths) {
                    out.extend_from_slice(d.get(r * w..(r + 1) * w).unwrap_or(&[]));
                }
            }
            out
        };
        let buf = Arc::new(self.gpu.upload(&joined).map_err(gpu_err)?);
        if let Ok(mut m) = self.weights.lock() {
            if m.len() >= MAX_CACHED {
                m.clear();
            }
            m.insert(
                key,
                Arc::new(DevWeight {
                    _keep: parts.to_vec(),
                    buf: buf.clone(),
                }),
            );
        }
        Ok(buf)
    }
}

/// A value on the device: f32 rows, or a tuple of them.
#[derive(Clone, Debug)]
enum DVal {
    Rows(DRows),
    Tuple(Vec<DRows>),
}

/// `rows` rows of `width` floats, row `r` at `off + r · ld` of `buf`; `shape` is the value's
/// shape (the batch axis first unless `shared`).
#[derive(Clone, Debug)]
struct DRows {
    buf: Arc<DevBuf>,
    off: usize,
    ld: usize,
    rows: usize,
    width: usize,
    shape: Vec<usize>,
    shared: bool,
}

impl DRows {
    fn mat(&self) -> Mat<'_> {
        Mat {
            buf: &self.buf,
            off: self.off,
            ld: self.ld,
            rows: self.rows,
            cols: self.width,
        }
    }

    /// A fresh contiguous `rows × width` value of batched shape `shape`.
    fn fresh(gpu: &Gpu, shape: Vec<usize>, width: usize) -> Result<DRows, String> {
        let len: usize = shape.iter().product();
        let rows = len.checked_div(width).unwrap_or(0);
        Ok(DRows {
            buf: Arc::new(gpu.uninit(len).map_err(gpu_err)?),
            off: 0,
            ld: width,
            rows,
            width,
            shape,
            shared: false,
        })
    }
}

/// The rows and width of a value of shape `shape`: its last axis a row.
fn rows_of(shape: &[usize]) -> (usize, usize) {
    let width = match shape.len() {
        0 | 1 => 1,
        _ => shape.last().copied().unwrap_or(1),
    };
    let len: usize = shape.iter().product();
    (len.checked_div(width).unwrap_or(0), width)
}

/// The device side of one launch: values computed or uploaded so far.
struct DevExec<'r> {
    run: &'r DeviceRun,
    inputs: Vec<Option<DVal>>,
    vals: Vec<Option<DVal>>,
}

impl DevExec<'_> {
    fn gpu(&self) -> &Gpu {
        &self.run.gpu
    }

    /// A host value on the device (`None`: not f32, or not a shape the device runs).
    fn upload(&self, v: &BV) -> Result<Option<DVal>, String> {
        let rows = |t: &Tensor, shared: bool| -> Result<Option<DRows>, String> {
            if t.dtype() != DType::Float32 {
                return Ok(None);
            }
            let buf = match shared {
                true => self.run.weight(std::slice::from_ref(t), true)?,
                false => {
                    let d = t.as_f32().ok_or("internal: f32 tensor without f32 data")?;
                    Arc::new(self.gpu().upload(d).map_err(gpu_err)?)
                }
            };
            let (r, width) = rows_of(t.shape());
            Ok(Some(DRows {
                buf,
                off: 0,
                ld: width,
                rows: r,
                width,
                shape: t.shape().to_vec(),
                shared,
            }))
        };
        Ok(match v {
            BV::Batched(OpValue::Tensor(t)) => rows(t, false)?.map(DVal::Rows),
            BV::Shared(OpValue::Tensor(t)) => rows(t, true)?.map(DVal::Rows),
            BV::Rows(r) if r.dtype() == DType::Float32 => rows(&r.stack()?, false)?.map(DVal::Rows),
            BV::Batched(OpValue::Tuple(ts)) => ts
                .iter()
                .map(|t| rows(t, false))
                .collect::<Result<Option<Vec<_>>, _>>()?
                .map(DVal::Tuple),
            _ => None,
        })
    }

    /// Value `v` on the device, uploaded on first use.
    fn get(&mut self, ex: &Exec, v: &BVal) -> Result<Option<DVal>, String> {
        match v {
            BVal::Input(i) => {
                let i = *i as usize;
                if let Some(Some(d)) = self.inputs.get(i) {
                    return Ok(Some(d.clone()));
                }
                let host = ex.inputs.get(i).ok_or("internal: launch input")?;
                let d = self.upload(host)?;
                if let (Some(slot), Some(d)) = (self.inputs.get_mut(i), &d) {
                    *slot = Some(d.clone());
                }
                Ok(d)
            }
            BVal::Node(n) | BVal::Field(n, _) => {
                let n = *n as usize;
                let whole = match self.vals.get(n) {
                    Some(Some(d)) => Some(d.clone()),
                    _ => match ex.vals.get(n) {
                        Some(Some(host)) => {
                            let d = self.upload(host)?;
                            if let (Some(slot), Some(d)) = (self.vals.get_mut(n), &d) {
                                *slot = Some(d.clone());
                            }
                            d
                        }
                        _ => return Err(format!("internal: block value {v} is not available")),
                    },
                };
                Ok(match (v, whole) {
                    (BVal::Field(_, f), Some(DVal::Tuple(fs))) => {
                        fs.get(*f as usize).cloned().map(DVal::Rows)
                    }
                    (BVal::Field(..), _) => None,
                    (_, d) => d,
                })
            }
            BVal::Const(t) => self.upload(&BV::Shared(OpValue::Tensor(t.clone()))),
        }
    }

    /// Value `v` as f32 rows on the device.
    fn rows(&mut self, ex: &Exec, v: &BVal) -> Result<Option<DRows>, String> {
        Ok(match self.get(ex, v)? {
            Some(DVal::Rows(r)) => Some(r),
            _ => None,
        })
    }

    /// Copies back the device-only values that stage `stage` reads, so the host can run it.
    fn to_host(&self, ex: &mut Exec, stage: &Stage) -> Result<(), String> {
        for n in stage.nodes() {
            let Some(node) = ex.block.nodes.get(n) else {
                continue;
            };
            for a in &node.args {
                for v in a.values() {
                    if let BVal::Node(k) | BVal::Field(k, _) = v {
                        let k = *k as usize;
                        if matches!(ex.vals.get(k), Some(None)) {
                            if let Some(Some(d)) = self.vals.get(k) {
                                let host = self.download(d)?;
                                if let Some(slot) = ex.vals.get_mut(k) {
                                    *slot = Some(host);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Device values copied back, with one wait for the device.
    fn download_all(&self, ds: &[&DVal]) -> Result<Vec<BV>, String> {
        let rows_of = |d: &DVal| -> Vec<DRows> {
            match d {
                DVal::Rows(r) => vec![r.clone()],
                DVal::Tuple(fs) => fs.clone(),
            }
        };
        let all: Vec<Vec<DRows>> = ds.iter().map(|d| rows_of(d)).collect();
        // A strided view comes back as the span of its rows, then compacted.
        let span = |r: &DRows| match r.rows {
            0 => 0,
            n if r.ld == r.width => n * r.width,
            n => (n - 1) * r.ld + r.width,
        };
        let fetches: Vec<Fetch> = all
            .iter()
            .flatten()
            .map(|r| Fetch {
                buf: &r.buf,
                off: r.off,
                len: span(r),
            })
            .collect();
        let mut datas = self
            .gpu()
            .download_many(&fetches)
            .map_err(gpu_err)?
            .into_iter();
        let mut tensor = |r: &DRows| -> Result<Tensor, String> {
            let data = datas.next().ok_or("internal: device download")?;
            let data = match r.ld == r.width || r.rows <= 1 {
                true => data,
                false => {
                    let mut out = Vec::with_capacity(r.rows * r.width);
                    for row in 0..r.rows {
                        out.extend_from_slice(
                            data.get(row * r.ld..row * r.ld + r.width)
                                .ok_or("internal: device row")?,
                        );
                    }
                    out
                }
            };
            Tensor::from_f32(r.shape.clone(), data).map_err(|e| e.to_string())
        };
        let mut out = Vec::with_capacity(ds.len());
        for (d, rows) in ds.iter().zip(&all) {
            out.push(match d {
                DVal::Rows(r) if r.shared => BV::Shared(OpValue::Tensor(tensor(r)?)),
                DVal::Rows(r) => BV::Batched(OpValue::Tensor(tensor(r)?)),
                DVal::Tuple(_) => BV::Batched(OpValue::Tuple(
                    rows.iter().map(&mut tensor).collect::<Result<_, _>>()?,
                )),
            });
        }
        Ok(out)
    }

    fn download(&self, d: &DVal) -> Result<BV, String> {
        self.download_all(&[d])?
            .pop()
            .ok_or_else(|| "internal: device download".to_string())
    }

    /// Runs stage `s` on the device; `false` (having computed nothing) where it does not apply.
    fn stage(
        &mut self,
        ex: &Exec,
        rp: &RunPlan,
        s: usize,
        stage: &Stage,
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        match stage {
            Stage::Dense(i) => self.products(ex, std::slice::from_ref(i), fstats),
            Stage::HDense(ns) => self.products(ex, ns, fstats),
            Stage::DenseSum {
                denses,
                parts,
                addends,
                ..
            } => match stage.result() {
                Some(res) => self.sum(ex, denses, parts, addends, res, fstats),
                None => Ok(false),
            },
            Stage::Rows(ns) => self.row_program(ex, rp, s, ns, fstats),
            Stage::Other(i) => self.view(ex, *i),
            Stage::Gather(_) | Stage::MatMul { .. } => Ok(false),
        }
    }

    /// A shared f32 matrix `(N, K)` operand (a weight), on the host.
    fn weight_of(ex: &Exec, v: &BVal) -> Result<Option<Tensor>, String> {
        Ok(match &*ex.get_raw(v)? {
            BV::Shared(OpValue::Tensor(w)) if w.dtype() == DType::Float32 && w.rank() == 2 => {
                Some(w.clone())
            }
            _ => None,
        })
    }

    /// Denses `ns` reading the same rows with shared weights: one product against the weights
    /// stacked along N, each node's value a column block of it.
    fn products(
        &mut self,
        ex: &Exec,
        ns: &[usize],
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let mut a_val: Option<&BVal> = None;
        let mut ws = Vec::with_capacity(ns.len());
        for &i in ns {
            let node = ex.block.nodes.get(i).ok_or("internal: node")?;
            let (Some(BArg::One(av)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1))
            else {
                return Ok(false);
            };
            match a_val {
                None => a_val = Some(av),
                Some(prev) if ValKey::of(prev) == ValKey::of(av) => {}
                Some(_) => return Ok(false),
            }
            match Self::weight_of(ex, wv)? {
                Some(w) => ws.push(w),
                None => return Ok(false),
            }
        }
        let Some(av) = a_val else {
            return Ok(false);
        };
        let Some(a) = self.rows(ex, av)? else {
            return Ok(false);
        };
        let k = a.width;
        if a.shared || a.shape.len() < 2 || ws.iter().any(|w| w.shape().get(1) != Some(&k)) {
            return Ok(false);
        }
        let widths: Vec<usize> = ws.iter().map(|w| w.shape()[0]).collect();
        let n_all: usize = widths.iter().sum();
        let w = self.run.weight(&ws, true)?;
        let mut shape = a.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = n_all;
        }
        let c = DRows::fresh(self.gpu(), shape, n_all)?;
        let wmat = Mat {
            buf: &w,
            off: 0,
            ld: k,
            rows: n_all,
            cols: k,
        };
        self.gpu()
            .gemm_nt(&a.mat(), &wmat, &c.mat(), false)
            .map_err(gpu_err)?;
        let mut col = 0;
        for (&i, &n) in ns.iter().zip(&widths) {
            let mut shape = c.shape.clone();
            if let Some(last) = shape.last_mut() {
                *last = n;
            }
            let v = DRows {
                off: col,
                width: n,
                shape,
                ..c.clone()
            };
            col += n;
            if let Some(slot) = self.vals.get_mut(i) {
                *slot = Some(DVal::Rows(v));
            }
        }
        fstats.dense_stages += 1;
        fstats.dense_flops += 2 * (a.rows * k * n_all) as u64;
        Ok(true)
    }

    /// A sum of products (`Stage::DenseSum`): the products' row parts copied side by side into
    /// one `(M, Σ K)` operand, one product against the weights joined along K, then the addends.
    fn sum(
        &mut self,
        ex: &Exec,
        denses: &[usize],
        parts: &[Vec<BVal>],
        addends: &[BVal],
        res: usize,
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let mut ws = Vec::with_capacity(denses.len());
        let mut row_parts: Vec<DRows> = Vec::new();
        for (&d, ps) in denses.iter().zip(parts) {
            let node = ex.block.nodes.get(d).ok_or("internal: node")?;
            let Some(BArg::One(wv)) = node.args.get(1) else {
                return Ok(false);
            };
            let Some(w) = Self::weight_of(ex, wv)? else {
                return Ok(false);
            };
            let mut k = 0;
            for p in ps {
                match self.rows(ex, p)? {
                    Some(r) if !r.shared && r.shape.len() >= 2 => {
                        k += r.width;
                        row_parts.push(r);
                    }
                    _ => return Ok(false),
                }
            }
            if w.shape().get(1) != Some(&k) {
                return Ok(false);
            }
            ws.push(w);
        }
        let (Some(first), Some(n)) = (row_parts.first(), ws.first().map(|w| w.shape()[0])) else {
            return Ok(false);
        };
        let m = first.rows;
        if row_parts.iter().any(|r| r.rows != m) || ws.iter().any(|w| w.shape()[0] != n) {
            return Ok(false);
        }
        let mut adds = Vec::with_capacity(addends.len());
        for v in addends {
            match self.rows(ex, v)? {
                Some(r) if r.shared && r.rows * r.width == n => adds.push(DRows {
                    rows: 1,
                    width: n,
                    ld: 0,
                    ..r
                }),
                Some(r) if !r.shared && r.rows == m && r.width == n => adds.push(r),
                _ => return Ok(false),
            }
        }
        let k_all: usize = row_parts.iter().map(|r| r.width).sum();
        let gpu = self.gpu();
        // One part read where it lies; several copied side by side.
        let a = match row_parts.as_slice() {
            [one] => one.clone(),
            _ => {
                let a = DRows::fresh(gpu, vec![m, k_all], k_all)?;
                let mut col = 0;
                for r in &row_parts {
                    let dst = Mat {
                        off: col,
                        cols: r.width,
                        ..a.mat()
                    };
                    gpu.copy_rows(&r.mat(), &dst, false).map_err(gpu_err)?;
                    col += r.width;
                }
                a
            }
        };
        let w = self.run.weight(&ws, false)?;
        let mut shape = first.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        let c = DRows::fresh(gpu, shape, n)?;
        let wmat = Mat {
            buf: &w,
            off: 0,
            ld: k_all,
            rows: n,
            cols: k_all,
        };
        gpu.gemm_nt(&a.mat(), &wmat, &c.mat(), false)
            .map_err(gpu_err)?;
        for add in &adds {
            gpu.copy_rows(&add.mat(), &c.mat(), true).map_err(gpu_err)?;
        }
        if let Some(slot) = self.vals.get_mut(res) {
            *slot = Some(DVal::Rows(c));
        }
        fstats.dense_stages += 1;
        fstats.dense_sums += 1;
        fstats.dense_flops += 2 * (m * k_all * n) as u64;
        Ok(true)
    }

    /// A row-program stage as a generated kernel: one thread block per row.
    fn row_program(
        &mut self,
        ex: &Exec,
        rp: &RunPlan,
        s: usize,
        ns: &[usize],
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let empty = RowOperands::default();
        let ops = rp.plan.row_ops.get(s).unwrap_or(&empty);
        let mut dvs = Vec::with_capacity(ops.vals.len());
        for v in &ops.vals {
            match self.rows(ex, v)? {
                Some(r) => dvs.push(r),
                None => return Ok(false),
            }
        }
        let sig: Vec<OpSig> = dvs
            .iter()
            .map(|r| match r.shared {
                true => OpSig::Shared(r.shape.clone()),
                false => OpSig::Batched(r.shape.get(1..).unwrap_or(&[]).to_vec()),
            })
            .collect();
        let Some(prog) = compiled_rows(ex, rp, s, ns, sig, fstats) else {
            return Ok(false);
        };
        let mut lead = vec![ex.b];
        lead.extend_from_slice(&prog.lead_tail);
        let rows: usize = lead.iter().product();
        let kernel = self.run.row_launch(&prog)?;
        let gpu = self.gpu();
        let mut args = Vec::with_capacity(2 * dvs.len() + prog.outs.len() + 2);
        for (h, (o, r)) in prog.held.iter().zip(&dvs).enumerate() {
            match o.src {
                Src::Ext(_) => {
                    if r.rows != rows || r.width != o.len {
                        return Ok(false);
                    }
                    args.push(Arg::Ptr(gpu.ptr(&r.mat()).map_err(gpu_err)?));
                    args.push(Arg::I32(i32::try_from(r.ld).map_err(|e| e.to_string())?));
                }
                Src::Shared(_) => {
                    if r.rows * r.width != o.len {
                        return Ok(false);
                    }
                    args.push(Arg::Ptr(gpu.ptr(&r.mat()).map_err(gpu_err)?));
                }
                // A shared scalar is a launch constant: passed by value, read on the host.
                Src::Scalar(_) => {
                    let v = ops.vals.get(h).ok_or("internal: row operand")?;
                    let x = match &*ex.get_raw(v)? {
                        BV::Shared(OpValue::Tensor(t)) => {
                            t.as_f32().and_then(|d| d.first().copied())
                        }
                        _ => None,
                    };
                    match x {
                        Some(x) => args.push(Arg::F32(x)),
                        None => return Ok(false),
                    }
                }
                Src::Scratch => return Ok(false),
            }
        }
        let mut outs = Vec::new();
        for o in prog.outs.iter().flat_map(|(_, os, _)| os.iter()) {
            let mut shape = lead.clone();
            shape.push(o.len);
            let r = DRows::fresh(gpu, shape, o.len)?;
            args.push(Arg::Ptr(gpu.ptr(&r.mat()).map_err(gpu_err)?));
            outs.push(r);
        }
        args.push(Arg::I32(i32::try_from(rows).map_err(|e| e.to_string())?));
        let scratch = match kernel.global_scratch {
            true => {
                let g = gpu.uninit(rows * prog.scratch_len).map_err(gpu_err)?;
                let m = Mat {
                    buf: &g,
                    off: 0,
                    ld: prog.scratch_len,
                    rows,
                    cols: prog.scratch_len,
                };
                args.push(Arg::Ptr(gpu.ptr(&m).map_err(gpu_err)?));
                Some(g)
            }
            false => None,
        };
        let grid = (u32::try_from(rows).map_err(|e| e.to_string())?, 1, 1);
        // SAFETY: the kernel was generated from `prog`, whose operands were checked above to
        // have `rows` rows of the widths it reads (shared ones their whole length), its outputs
        // were allocated `rows × len`, and its global scratch `rows × scratch_len`; the
        // arguments follow the generated parameter list in order (`rowcuda`).
        unsafe {
            gpu.launch(
                &kernel.kernel,
                grid,
                kernel.threads,
                kernel.shared_bytes,
                &args,
            )
            .map_err(gpu_err)?
        };
        // Stream-ordered: freed after the kernel.
        drop(scratch);
        let mut outs = outs.into_iter();
        for (node, os, tuple) in &prog.outs {
            let fields: Vec<DRows> = outs.by_ref().take(os.len()).collect();
            let v = match (tuple, fields.as_slice()) {
                (false, [one]) => DVal::Rows(one.clone()),
                _ => DVal::Tuple(fields),
            };
            if let Some(slot) = self.vals.get_mut(*node) {
                *slot = Some(v);
            }
        }
        fstats.row_programs += 1;
        fstats.row_program_ops += ns.len() as u64;
        Ok(true)
    }

    /// A reshape of a contiguous device value: the same rows under another shape.
    fn view(&mut self, ex: &Exec, i: usize) -> Result<bool, String> {
        let node = ex.block.nodes.get(i).ok_or("internal: node")?;
        if !matches!(node.op.name, "reshape" | "squeeze" | "expand_dims") {
            return Ok(false);
        }
        let Some(BArg::One(src @ (BVal::Node(_) | BVal::Input(_)))) = node.args.first() else {
            return Ok(false);
        };
        // Only values already on the device: a host value stays on the host.
        let on_device = match src {
            BVal::Node(n) => matches!(self.vals.get(*n as usize), Some(Some(_))),
            _ => false,
        };
        let dims: Option<Vec<usize>> = node.ty.as_tensor().and_then(|(d, _)| {
            d.iter()
                .map(|x| x.known().and_then(|k| usize::try_from(k).ok()))
                .collect()
        });
        let (true, Some(dims)) = (on_device, dims) else {
            return Ok(false);
        };
        let Some(r) = self.rows(ex, src)? else {
            return Ok(false);
        };
        let mut shape = vec![ex.b];
        shape.extend_from_slice(&dims);
        if r.shared
            || (r.ld != r.width && r.rows > 1)
            || shape.iter().product::<usize>() != r.rows * r.width
        {
            return Ok(false);
        }
        let (rows, width) = rows_of(&shape);
        let v = DRows {
            rows,
            width,
            ld: width,
            shape,
            ..r
        };
        if let Some(slot) = self.vals.get_mut(i) {
            *slot = Some(DVal::Rows(v));
        }
        Ok(true)
    }
}

/// Runs `block` for `b` invocations following `plan`, its stages on `run`'s GPU where they
/// apply and on the host otherwise ([`super::run_planned`]'s contract).
#[allow(clippy::too_many_arguments)]
pub fn run_planned_on_device(
    run: &DeviceRun,
    block: &Block,
    run_plan: &RunPlan,
    inputs: &[BV],
    b: usize,
    octx: &mut OpCtx,
    stats: &mut OpStats,
    fstats: &mut FusedStats,
    threads: usize,
) -> Result<Vec<BV>, String> {
    let plan = &run_plan.plan;
    let mut ex = Exec::new(block, inputs, plan.gather_views, b, threads);
    let mut dx = DevExec {
        run,
        inputs: vec![None; inputs.len()],
        vals: vec![None; block.nodes.len()],
    };
    for (s, stage) in plan.stages.iter().enumerate() {
        if let Some(dead) = s.checked_sub(1).and_then(|d| run_plan.dead_after.get(d)) {
            ex.drop_values(dead);
            for &k in dead {
                if let Some(v) = dx.vals.get_mut(k) {
                    *v = None;
                }
            }
        }
        let t0 = std::time::Instant::now();
        if dx.stage(&ex, run_plan, s, stage, fstats)? {
            fstats.device_stages += 1;
            fstats.device_time += t0.elapsed();
            continue;
        }
        dx.to_host(&mut ex, stage)?;
        run_stage(&mut ex, run_plan, s, stage, octx, stats, fstats)?;
        fstats.host_stages += 1;
    }
    let t0 = std::time::Instant::now();
    // Outputs computed on the device only come back together, with one wait.
    let on_device: Vec<Option<DVal>> = block
        .outputs
        .iter()
        .map(|v| match v {
            BVal::Node(n) | BVal::Field(n, _) => match ex.vals.get(*n as usize) {
                Some(Some(_)) => None,
                _ => dx.vals.get(*n as usize).cloned().flatten(),
            },
            _ => None,
        })
        .collect();
    let wanted: Vec<&DVal> = on_device.iter().flatten().collect();
    let mut fetched = dx.download_all(&wanted)?.into_iter();
    let mut outs = Vec::with_capacity(block.outputs.len());
    for (v, d) in block.outputs.iter().zip(&on_device) {
        let out = match (d, v) {
            (Some(_), BVal::Field(_, f)) => fetched
                .next()
                .and_then(|whole| whole.field(*f))
                .ok_or("internal: device output is not a tuple")?,
            (Some(_), _) => fetched.next().ok_or("internal: device output")?,
            (None, BVal::Node(_)) => ex.get_raw(v)?.into_owned(),
            (None, _) => ex.get(v)?,
        };
        outs.push(out);
    }
    fstats.device_time += t0.elapsed();
    fstats.row_lists_stacked += ex.stacks.get();
    Ok(outs)
}
