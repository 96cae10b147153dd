//! Running a block's kernel plan on a GPU (`tumble run --device cuda`).
//!
//! The same plan the CPU runs, stage by stage: GEMM stages (one product, horizontally fused
//! products, sums of products) run as `tumble_cuda`'s `X · Wᵀ` product, products with a weight
//! per invocation and direct products as batched products, embedding lookups as row gathers, row
//! programs as CUDA kernels generated from the same compiled [`RowProg`] the CPU interprets
//! ([`super::rowcuda`]), reshapes as views. A stage the device does not run (an argmax the host
//! branches on, other operators, other dtypes) runs on the host exactly as on the CPU path, its
//! operands copied back first; its results go to the device when a later device stage reads them.
//! Results never depend on where a stage ran beyond float rounding.
//!
//! What lives on the device: the weights (uploaded once per job and kept, with the
//! concatenations the fused products read, in [`DeviceRun`]), a launch's intermediate values, and
//! copies of the outputs launches copied back ([`Mirrors`]). A launch's inputs are gathered from
//! those copies where they lie there, else uploaded when a device stage first reads them; its
//! outputs are copied back together at its end (one wait), so values cross the bus at most once
//! per launch; the host keeps driving control flow. The stages themselves are in [`stages`].

use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tumble_compile::{BVal, Stage};
use tumble_cuda::{Batch, Block, DevBuf, Fetch, Gpu, GpuError, Kernel, Mat};
use tumble_ir::DType;
use tumble_ops::OpValue;
use tumble_tensor::{BufferWatch, Tensor};

mod stages;

use super::rowcuda::row_kernel;
use super::rowprog::RowProg;
use super::{run_stage, Exec, FusedStats, LaunchCtx, RunPlan};
use crate::batched::{RowRefs, BV};
use crate::intern::WordMap;

/// A job's GPU: the device, the weights uploaded so far (by tensor identity, each kept alive
/// so its address is never reused while it is cached), compiled row kernels, and the device's
/// copies of host tensors. Shared by the job's workers (their launches share the device's one
/// stream).
pub struct DeviceRun {
    pub gpu: Gpu,
    weights: Mutex<WordMap<WeightKey, Arc<DevWeight>>>,
    /// Compiled row-program kernels by program (the row cache's `Arc`, kept so its address is
    /// not reused): a launch neither writes the source again nor hashes it.
    kernels: Mutex<WordMap<usize, KernelEntry>>,
    /// Host tensors whose data is also on the device, by buffer: the job's weights (uploaded
    /// once) and the outputs launches copied back. A launch input made of their rows (a row
    /// list: children's states, a table's rows) is gathered on the device instead of stacked on
    /// the host and uploaded. An entry lives while its tensor does ([`BufferWatch`]).
    mirrors: Mutex<Mirrors>,
}

#[derive(Default)]
struct Mirrors {
    map: WordMap<usize, Mirror>,
    /// Entries after the last sweep of dead ones: the next sweep runs at twice as many.
    swept: usize,
}

/// A tensor's data on the device: `len` floats from `off` of `buf`, contiguous.
struct Mirror {
    watch: BufferWatch,
    buf: Arc<DevBuf>,
    off: usize,
    len: usize,
}

impl Mirrors {
    fn insert(&mut self, t: &Tensor, buf: Arc<DevBuf>, off: usize) {
        if self.map.len() >= self.swept.max(1024) {
            self.map.retain(|_, m| m.watch.alive());
            self.swept = 2 * self.map.len();
        }
        self.map.insert(
            t.buffer_id(),
            Mirror {
                watch: t.watch(),
                buf,
                off,
                len: t.len(),
            },
        );
    }

    /// The device copy of `t`'s data, if there is one.
    fn get(&self, t: &Tensor) -> Option<&Mirror> {
        self.map
            .get(&t.buffer_id())
            .filter(|m| m.watch.holds(t) && m.len == t.len())
    }
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
            mirrors: Mutex::default(),
        }
    }

    /// Puts the job's f32 weights on the device once (before the first run), so launches read
    /// their rows (embedding tables, per-word matrices) where they lie there.
    pub(crate) fn mirror_weights(&self, params: &[Option<Tensor>]) -> Result<(), String> {
        for t in params.iter().flatten() {
            let Some(d) = t.as_f32() else {
                continue;
            };
            let known = self
                .mirrors
                .lock()
                .map_err(|_| "internal: device mirrors poisoned")?
                .get(t)
                .is_some();
            if d.is_empty() || known {
                continue;
            }
            let buf = Arc::new(self.gpu.upload(d).map_err(gpu_err)?);
            if let Ok(mut m) = self.mirrors.lock() {
                m.insert(t, buf, 0);
            }
        }
        Ok(())
    }

    /// Remembers that `t`'s data is also at `r` on the device (if `r` is contiguous).
    fn mirror(&self, t: &Tensor, r: &DRows) {
        if r.ld == r.width || r.rows <= 1 {
            if let Ok(mut m) = self.mirrors.lock() {
                m.insert(t, r.buf.clone(), r.off);
            }
        }
    }

    /// Where `t`'s data lies on the device, if it does.
    fn mirror_of(&self, t: &Tensor) -> Option<(Arc<DevBuf>, usize)> {
        let m = self.mirrors.lock().ok()?;
        m.get(t).map(|m| (m.buf.clone(), m.off))
    }

    /// A row list gathered on the device from the mirrors of the tensors it reads (`None`
    /// where one has none: then it is stacked on the host).
    fn gather(&self, r: &RowRefs, b: usize) -> Result<Option<DRows>, String> {
        let len: usize = r.shape().iter().product();
        let (tensors, parts) = r.by_tensor();
        // Each tensor's copy looked up once: a launch's row list reads a few tensors' rows.
        let copies: Vec<(Arc<DevBuf>, usize, usize)> = {
            let mirrors = self
                .mirrors
                .lock()
                .map_err(|_| "internal: device mirrors poisoned")?;
            let found: Option<Vec<_>> = tensors
                .iter()
                .map(|t| mirrors.get(t).map(|m| (m.buf.clone(), m.off, m.len)))
                .collect();
            match found {
                Some(f) => f,
                None => return Ok(None),
            }
        };
        let mut blocks: Vec<Block> = Vec::with_capacity(r.len());
        for (t, row) in parts {
            let Some((buf, off, have)) = copies.get(t) else {
                return Ok(None);
            };
            let at = row.unwrap_or(0) * len;
            if at + len > *have {
                return Ok(None);
            }
            blocks.push(Block { buf, off: off + at });
        }
        let mut shape = vec![b];
        shape.extend_from_slice(r.shape());
        let (rows, width) = rows_of(&shape);
        let out = DRows::fresh(&self.gpu, shape, width)?;
        debug_assert_eq!(out.rows, rows);
        self.gpu
            .gather(&blocks, len, &out.buf, 0, len)
            .map_err(gpu_err)?;
        Ok(Some(out))
    }

    /// The device copy of `parts` laid side by side: `along_rows` stacks them (a fused product's
    /// weights `(N_i, K)` into `(Σ N_i, K)`), otherwise their rows are concatenated (a sum of
    /// products' weights `(N, K_i)` into `(N, Σ K_i)`). Made once per job.
    fn weight(&self, parts: &[Tensor], along_rows: bool) -> Result<Arc<DevBuf>, String> {
        let mut key: WeightKey = parts
            .iter()
            .map(|t| (t.buffer_id(), t.shape().to_vec()))
            .collect();
        // The two layouts of several tensors differ; of one tensor, both are the tensor.
        if parts.len() > 1 {
            key.push((usize::from(along_rows), Vec::new()));
        }
        if let Some(w) = self.weights.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(w.buf.clone());
        }
        // One tensor put on the device whole at start-up ([`DeviceRun::mirror_weights`]): that
        // copy, not a second.
        if let [t] = parts {
            if let Some((buf, 0)) = self.mirror_of(t) {
                if buf.len() == t.len() {
                    return Ok(buf);
                }
            }
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

    /// The value as matrices of `rows × cols` back to back (a batched value of contiguous
    /// per-invocation matrices), for batched products.
    fn matrices(&self, rows: usize, cols: usize) -> Batch<'_> {
        Batch {
            mat: Mat {
                buf: &self.buf,
                off: self.off,
                ld: cols,
                rows,
                cols,
            },
            stride: rows * cols,
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
    copies: Copies,
}

/// A launch's copies between host and device, for the profile.
#[derive(Default)]
struct Copies {
    uploads: Cell<u64>,
    upload_bytes: Cell<u64>,
    upload_time: Cell<Duration>,
    waits: Cell<u64>,
    wait_time: Cell<Duration>,
    /// Row lists gathered on the device from mirrors, and batched values read in place there.
    gathered: Cell<u64>,
    mirrored: Cell<u64>,
}

impl Copies {
    fn upload(&self, floats: usize, t0: Instant) {
        self.uploads.set(self.uploads.get() + 1);
        self.upload_bytes
            .set(self.upload_bytes.get() + 4 * floats as u64);
        self.upload_time.set(self.upload_time.get() + t0.elapsed());
    }

    fn wait(&self, t0: Instant) {
        self.waits.set(self.waits.get() + 1);
        self.wait_time.set(self.wait_time.get() + t0.elapsed());
    }

    fn add_to(&self, fstats: &mut FusedStats) {
        fstats.device_uploads += self.uploads.get();
        fstats.device_upload_bytes += self.upload_bytes.get();
        fstats.device_upload_time += self.upload_time.get();
        fstats.device_waits += self.waits.get();
        fstats.device_wait_time += self.wait_time.get();
        fstats.device_gathers += self.gathered.get();
        fstats.device_in_place += self.mirrored.get();
    }
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
            let (buf, off) = match shared {
                true => (self.run.weight(std::slice::from_ref(t), true)?, 0),
                false => match self.run.mirror_of(t) {
                    // An earlier launch's output, read where it lies on the device.
                    Some(at) => {
                        self.copies.mirrored.set(self.copies.mirrored.get() + 1);
                        at
                    }
                    None => {
                        let d = t.as_f32().ok_or("internal: f32 tensor without f32 data")?;
                        let t0 = Instant::now();
                        let buf = Arc::new(self.gpu().upload(d).map_err(gpu_err)?);
                        self.copies.upload(d.len(), t0);
                        (buf, 0)
                    }
                },
            };
            let (r, width) = rows_of(t.shape());
            Ok(Some(DRows {
                buf,
                off,
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
            BV::Rows(r) if r.dtype() == DType::Float32 => match self.run.gather(r, r.len())? {
                Some(d) => {
                    self.copies.gathered.set(self.copies.gathered.get() + 1);
                    Some(DVal::Rows(d))
                }
                None => rows(&r.stack()?, false)?.map(DVal::Rows),
            },
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
                if !matches!(self.vals.get(n), Some(Some(_))) {
                    let Some(Some(host)) = ex.vals.get(n) else {
                        return Err(format!("internal: block value {v} is not available"));
                    };
                    let d = self.upload(host)?;
                    if let Some(slot) = self.vals.get_mut(n) {
                        *slot = d;
                    }
                }
                Ok(self.field(v))
            }
            BVal::Const(t) => self.upload(&BV::Shared(OpValue::Tensor(t.clone()))),
        }
    }

    /// Value `v` if the device holds it (a tuple's field alone), without uploading anything.
    fn field(&self, v: &BVal) -> Option<DVal> {
        match (v, self.vals.get(v.node()?)?.as_ref()?) {
            (BVal::Field(_, f), DVal::Tuple(fs)) => fs.get(*f as usize).cloned().map(DVal::Rows),
            (BVal::Field(..), DVal::Rows(_)) => None,
            (_, d) => Some(d.clone()),
        }
    }

    /// Value `v` as f32 rows on the device.
    fn rows(&mut self, ex: &Exec, v: &BVal) -> Result<Option<DRows>, String> {
        Ok(match self.get(ex, v)? {
            Some(DVal::Rows(r)) => Some(r),
            _ => None,
        })
    }

    /// Copies back the device-only values that stage `stage` reads (with one wait), so the host
    /// can run it.
    fn to_host(&self, ex: &mut Exec, stage: &Stage) -> Result<(), String> {
        let mut wanted: Vec<usize> = Vec::new();
        for n in stage.nodes() {
            let Some(node) = ex.block.nodes.get(n) else {
                continue;
            };
            for k in node
                .args
                .iter()
                .flat_map(|a| a.values())
                .filter_map(BVal::node)
            {
                let device_only = matches!(ex.vals.get(k), Some(None))
                    && matches!(self.vals.get(k), Some(Some(_)));
                if device_only && !wanted.contains(&k) {
                    wanted.push(k);
                }
            }
        }
        let ds: Vec<&DVal> = wanted
            .iter()
            .filter_map(|&k| self.vals.get(k).and_then(Option::as_ref))
            .collect();
        for (k, host) in wanted.iter().zip(self.download_all(&ds)?) {
            if let Some(slot) = ex.vals.get_mut(*k) {
                *slot = Some(host);
            }
        }
        Ok(())
    }

    /// Device values copied back, with one wait for the device.
    fn download_all(&self, ds: &[&DVal]) -> Result<Vec<BV>, String> {
        let parts = |d: &DVal| -> Vec<DRows> {
            match d {
                DVal::Rows(r) => vec![r.clone()],
                DVal::Tuple(fs) => fs.clone(),
            }
        };
        let all: Vec<Vec<DRows>> = ds.iter().map(|d| parts(d)).collect();
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
        let t0 = Instant::now();
        let mut datas = self
            .gpu()
            .download_many(&fetches)
            .map_err(gpu_err)?
            .into_iter();
        if !fetches.is_empty() {
            self.copies.wait(t0);
        }
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
            let t = Tensor::from_f32(r.shape.clone(), data).map_err(|e| e.to_string())?;
            self.run.mirror(&t, r);
            Ok(t)
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
}

/// The stages of `run_plan` for launch `ex`: on `run`'s GPU where they apply, on the host
/// otherwise; the block's outputs, those the device computed copied back with one wait.
pub(super) fn run_stages(
    run: &DeviceRun,
    ex: &mut Exec,
    run_plan: &RunPlan,
    cx: &mut LaunchCtx,
) -> Result<Vec<BV>, String> {
    let fstats = &mut *cx.fstats;
    let block = ex.block;
    let mut dx = DevExec {
        run,
        inputs: vec![None; ex.inputs.len()],
        vals: vec![None; block.nodes.len()],
        copies: Copies::default(),
    };
    for (s, stage) in run_plan.plan.stages.iter().enumerate() {
        if let Some(dead) = s.checked_sub(1).and_then(|d| run_plan.dead_after.get(d)) {
            ex.drop_values(dead);
            for &k in dead {
                if let Some(v) = dx.vals.get_mut(k) {
                    *v = None;
                }
            }
        }
        let t0 = std::time::Instant::now();
        if dx.stage(ex, run_plan, s, stage, fstats)? {
            fstats.device_stages += 1;
            fstats.device_time += t0.elapsed();
            continue;
        }
        dx.to_host(ex, stage)?;
        let t1 = Instant::now();
        run_stage(ex, run_plan, s, stage, &mut cx.ops, fstats)?;
        fstats.device_host_stage_time += t1.elapsed();
        fstats.host_stages += 1;
    }
    let t0 = std::time::Instant::now();
    // The outputs only the device holds (a tuple's field alone), copied back together.
    let on_device: Vec<Option<DVal>> = block
        .outputs
        .iter()
        .map(|v| match v {
            BVal::Node(n) | BVal::Field(n, _)
                if ex.vals.get(*n as usize).is_some_and(Option::is_none) =>
            {
                dx.field(v)
            }
            _ => None,
        })
        .collect();
    let wanted: Vec<&DVal> = on_device.iter().flatten().collect();
    let mut fetched = dx.download_all(&wanted)?.into_iter();
    let outs = block
        .outputs
        .iter()
        .zip(&on_device)
        .map(|(v, d)| match d {
            Some(_) => fetched
                .next()
                .ok_or_else(|| "internal: device output".to_string()),
            None => ex.output(v),
        })
        .collect();
    fstats.device_time += t0.elapsed();
    dx.copies.add_to(fstats);
    outs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mirrors are found for the tensors they were made for, not for others, and entries of
    /// freed tensors are swept so the map (and the device memory it holds) stays bounded.
    #[test]
    fn mirrors_find_their_tensors_and_sweep_the_dead() {
        let run = DeviceRun::new(Gpu::emulated());
        let keep = Tensor::from_f32([2, 3], vec![1.0; 6]).unwrap_or_else(|e| panic!("{e}"));
        let dev = DRows::fresh(&run.gpu, vec![2, 3], 3).unwrap_or_else(|e| panic!("{e}"));
        run.mirror(&keep, &dev);
        assert!(run.mirror_of(&keep).is_some());
        assert!(run.mirror_of(&keep.clone()).is_some());
        let other = Tensor::from_f32([2, 3], vec![1.0; 6]).unwrap_or_else(|e| panic!("{e}"));
        assert!(run.mirror_of(&other).is_none());
        // A strided view (a column block) is not a tensor's contiguous copy: not remembered.
        let strided = DRows {
            ld: 6,
            rows: 2,
            width: 3,
            ..dev.clone()
        };
        run.mirror(&other, &strided);
        assert!(run.mirror_of(&other).is_none());
        for i in 0..5000 {
            let t = Tensor::from_f32([1], vec![i as f32]).unwrap_or_else(|e| panic!("{e}"));
            run.mirror(&t, &dev);
        }
        let len = run
            .mirrors
            .lock()
            .map(|m| m.map.len())
            .unwrap_or(usize::MAX);
        assert!(len <= 1025, "{len} mirrors kept");
        assert!(run.mirror_of(&keep).is_some());
    }
}
