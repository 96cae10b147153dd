//! The CUDA implementation of [`crate::Gpu`]: a context, a stream, the fixed kernels, pinned
//! staging buffers and the generated kernels so far.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use crate::{
    driver, ptx_of, Arg, Batch, Block, DevBuf, Fetch, GemmKernel, GpuError, Kernel, Mat, Mem,
    Staging, FIXED_SOURCE,
};

/// One GPU: its context, the job's stream, the fixed kernels and the generated kernels so far.
pub(crate) struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _fixed: Arc<CudaModule>,
    gemm: CudaFunction,
    gemm_plain: CudaFunction,
    gemm_part: CudaFunction,
    sum_parts: CudaFunction,
    copy: CudaFunction,
    gather: CudaFunction,
    /// Multiprocessors: a product of fewer tiles than this splits its depth.
    sms: usize,
    /// [`GemmKernel`], switchable per device (the benchmark compares them in one process).
    gemm_kernel: std::sync::atomic::AtomicU8,
    /// cuBLAS on the job's stream, where the library is found (`None`: the own kernels run); a
    /// handle is not for two threads at once.
    blas: Option<Mutex<CudaBlas>>,
    generated: Mutex<HashMap<String, Kernel>>,
    /// Uploads staged so far, and the buffer downloads land in: separate locks, so that one
    /// worker's wait for its downloads does not hold up another's uploads.
    up: Mutex<UpStaging>,
    down: Mutex<Option<Pinned>>,
    /// [`Staging`], switchable per device (the tests take every path).
    staging_mode: std::sync::atomic::AtomicU8,
    name: String,
    arch: String,
}

/// Page-locked host memory, so copies between it and the device are asynchronous.
struct Pinned {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through the device's
// `up` and `down` mutexes.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &CudaContext, len: usize) -> Result<Pinned, GpuError> {
        ctx.bind_to_thread().map_err(driver)?;
        let bytes = len.max(1) * std::mem::size_of::<f32>();
        // SAFETY: a fresh page-locked allocation of `bytes`; freed once, in `drop`.
        let ptr: *mut f32 = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }
            .map_err(driver)?
            .cast();
        // SAFETY: `ptr` holds `bytes` fresh bytes; zeroed once here, so `slice_mut` never makes a
        // slice over uninitialized memory (all-zero bytes are 0.0).
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        Ok(Pinned {
            ptr,
            len: len.max(1),
        })
    }

    fn slice_mut(&mut self, at: usize, len: usize) -> &mut [f32] {
        let len = len.min(self.len.saturating_sub(at));
        // SAFETY: `ptr` holds `self.len` initialized floats (zeroed when made) and the range was
        // clamped to them; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at.min(self.len)), len) }
    }
}

impl Drop for CudaDevice {
    /// Waits for the stream before the staging buffers go: an upload queued from one may still
    /// be reading it, and freeing page-locked memory is not promised to wait for that.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed only here.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// Uploads staged in page-locked memory: at `used..` of `buf` until a wait shows the copies done
/// (several workers share the stream, so a wait proves done only what was queued before it:
/// `staged` counts the uploads, and a wait resets `used` only if none was staged since it was
/// queued).
struct UpStaging {
    buf: Option<Pinned>,
    used: usize,
    staged: u64,
}

/// How copies are staged unless a test or benchmark says otherwise (`TUMBLE_STAGING=pageable|
/// pinned|mixed`, default mixed). Measured on an H200 (`cuda_bench`, bench/RESULTS.md): a download
/// through page-locked memory is as fast as a pageable one for one range and waits once for
/// several (two ranges of 256 floats 9.9 µs against 17.0); an upload through it returns sooner up
/// to a few hundred KiB (16,384 floats 10.6 µs against 18.1) and later above (262,144: 99 against
/// 73). So mixed: downloads pinned, uploads pinned up to [`PINNED_UPLOAD_FLOATS`].
fn default_staging() -> Staging {
    match std::env::var("TUMBLE_STAGING").as_deref() {
        Ok("pageable") => Staging::Pageable,
        Ok("pinned") => Staging::Pinned,
        _ => Staging::Mixed,
    }
}

/// Uploads up to this many floats go through pinned memory under [`Staging::Mixed`] (256 KiB).
const PINNED_UPLOAD_FLOATS: usize = 1 << 16;

/// Floats staged for uploads before a grow (4 MiB).
const STAGING_FLOATS: usize = 1 << 20;

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gpu({}, {})", self.name, self.arch)
    }
}

fn poisoned() -> GpuError {
    GpuError::Driver("a staging lock was poisoned".into())
}

fn to_i32(x: usize, what: &str) -> Result<i32, GpuError> {
    i32::try_from(x).map_err(|_| GpuError::Bounds(format!("{what} {x} exceeds a kernel's int")))
}

impl CudaDevice {
    /// Opens GPU `ordinal`: loads the driver and NVRTC, makes a context and a stream, and compiles
    /// the fixed kernels for the device's architecture.
    pub(crate) fn open(ordinal: usize) -> Result<CudaDevice, GpuError> {
        // SAFETY: `is_culib_present` only tries to dlopen the library by its usual names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc);
        }
        // cudarc panics where a driver lacks a symbol its bindings name: an error here, not a
        // crash.
        std::panic::catch_unwind(|| CudaDevice::open_present(ordinal)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the CUDA libraries could not be used".into());
            Err(GpuError::Driver(msg))
        })
    }

    fn open_present(ordinal: usize) -> Result<CudaDevice, GpuError> {
        let count = CudaContext::device_count().map_err(driver)?;
        if count <= 0 || ordinal >= count as usize {
            return Err(GpuError::Driver(format!(
                "no GPU {ordinal}: the driver reports {count} device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        // One stream orders everything, so cudarc's per-buffer events are not needed (they cost
        // an event record per use).
        // SAFETY: every buffer and kernel of this context goes through `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver)?;
        let name = ctx.name().map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        let arch = format!("sm_{major}{minor}");
        let fixed = compile(&ctx, "tumble_fixed", FIXED_SOURCE, &arch)?;
        let load = |f: &str| fixed.load_function(f).map_err(driver);
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(driver)?;
        let blas = open_blas(&stream)?;
        let device = CudaDevice {
            blas,
            gemm: load("gemm_nt")?,
            gemm_plain: load("gemm_nt_plain")?,
            gemm_part: load("gemm_nt_part")?,
            sum_parts: load("sum_parts")?,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            gemm_kernel: (GemmKernel::Blas as u8).into(),
            copy: load("copy_rows")?,
            gather: load("gather_blocks")?,
            _fixed: fixed,
            ctx,
            stream,
            generated: Mutex::default(),
            up: Mutex::new(UpStaging {
                buf: None,
                used: 0,
                staged: 0,
            }),
            down: Mutex::new(None),
            staging_mode: (default_staging() as u8).into(),
            name,
            arch,
        };
        device.set_gemm_kernel(GemmKernel::from_env().unwrap_or(GemmKernel::Blas));
        Ok(device)
    }

    fn staging(&self) -> Staging {
        Staging::from_u8(self.staging_mode.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether an upload of `len` floats goes through pinned memory.
    fn pinned_up(&self, len: usize) -> bool {
        match self.staging() {
            Staging::Pageable => false,
            Staging::Pinned => true,
            Staging::Mixed => len <= PINNED_UPLOAD_FLOATS,
        }
    }

    pub(crate) fn set_staging(&self, s: Staging) {
        self.staging_mode
            .store(s as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// The device's name and architecture, for profiles and results.
    pub(crate) fn describe(&self) -> String {
        format!("{} ({})", self.name, self.arch)
    }

    /// A buffer of `len` zeros.
    pub(crate) fn zeros(&self, len: usize) -> Result<DevBuf, GpuError> {
        let slice = self.stream.alloc_zeros::<f32>(len.max(1)).map_err(driver)?;
        Ok(DevBuf {
            mem: Mem::Cuda(slice),
        })
    }

    /// A buffer of `len` floats whose contents are undefined until a kernel writes them.
    pub(crate) fn uninit(&self, len: usize) -> Result<DevBuf, GpuError> {
        // SAFETY: f32 has no invalid bit patterns; callers overwrite what they read.
        let slice = unsafe { self.stream.alloc::<f32>(len.max(1)) }.map_err(driver)?;
        Ok(DevBuf {
            mem: Mem::Cuda(slice),
        })
    }

    /// A copy of `data` on the device, queued on the stream: staged in pinned memory, so the
    /// call returns before the copy is done.
    pub(crate) fn upload(&self, data: &[f32]) -> Result<DevBuf, GpuError> {
        if data.is_empty() {
            return self.zeros(1);
        }
        if !self.pinned_up(data.len()) {
            let slice = self.stream.clone_htod(data).map_err(driver)?;
            return Ok(DevBuf {
                mem: Mem::Cuda(slice),
            });
        }
        let mut dst = self.uninit(data.len())?;
        let mut st = self.up.lock().map_err(|_| poisoned())?;
        let cap = st.buf.as_ref().map_or(0, |p| p.len);
        if st.used + data.len() > cap {
            // Earlier uploads may still read the staging buffer: wait for them first (the lock
            // is held, so nothing is staged meanwhile).
            self.stream.synchronize().map_err(driver)?;
            st.used = 0;
            if data.len() > cap {
                st.buf = None;
                st.buf = Some(Pinned::new(&self.ctx, data.len().max(STAGING_FLOATS))?);
            }
        }
        let at = st.used;
        let Some(pinned) = st.buf.as_mut() else {
            return Err(GpuError::Driver("no staging buffer".into()));
        };
        let staged = pinned.slice_mut(at, data.len());
        staged.copy_from_slice(data);
        {
            let (dptr, _sync) =
                cudarc::driver::DevicePtrMut::device_ptr_mut(dst.cuda_mut()?, &self.stream);
            // SAFETY: `dst` holds `data.len()` floats; the staged range stays untouched until a
            // wait shows this copy done (`used` only grows until then: `UpStaging`).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dptr, staged, self.stream.cu_stream())
            }
            .map_err(driver)?;
        }
        st.used = at + data.len();
        st.staged += 1;
        Ok(dst)
    }

    /// Several ranges copied back with one wait for the stream.
    pub(crate) fn download_many(&self, fetches: &[Fetch]) -> Result<Vec<Vec<f32>>, GpuError> {
        let total: usize = fetches.iter().map(|f| f.len).sum();
        if total == 0 {
            return Ok(fetches.iter().map(|_| Vec::new()).collect());
        }
        if self.staging() == Staging::Pageable {
            return fetches
                .iter()
                .map(|f| {
                    let range = f.buf.cuda()?.slice(f.off..f.off + f.len);
                    self.stream.clone_dtoh(&range).map_err(driver)
                })
                .collect();
        }
        self.ctx.bind_to_thread().map_err(driver)?;
        let mut down_buf = self.down.lock().map_err(|_| poisoned())?;
        if down_buf.as_ref().map_or(0, |p| p.len) < total {
            *down_buf = None;
            *down_buf = Some(Pinned::new(&self.ctx, total.max(STAGING_FLOATS))?);
        }
        let Some(down) = down_buf.as_mut() else {
            return Err(GpuError::Driver("no staging buffer".into()));
        };
        let mut at = 0;
        for f in fetches {
            if f.len == 0 {
                continue;
            }
            let (base, _sync) = f.buf.cuda()?.device_ptr(&self.stream);
            let src = base + (f.off * std::mem::size_of::<f32>()) as u64;
            let dst = down.slice_mut(at, f.len);
            // SAFETY: the source range was checked against its buffer above; `dst` is pinned
            // memory of `f.len` floats that nothing reads until the event below is reached.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                .map_err(driver)?;
            at += f.len;
        }
        // Wait for this worker's copies, not for what others queued after them.
        let staged_before = self.up.lock().map_err(|_| poisoned())?.staged;
        let done = self
            .stream
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(driver)?;
        done.synchronize().map_err(driver)?;
        let mut out = Vec::with_capacity(fetches.len());
        let mut at = 0;
        for f in fetches {
            out.push(down.slice_mut(at, f.len).to_vec());
            at += f.len;
        }
        drop(down_buf);
        // Every upload staged before the event is done; if none was staged since, the staging
        // buffer is free again.
        let mut st = self.up.lock().map_err(|_| poisoned())?;
        if st.staged == staged_before {
            st.used = 0;
        }
        Ok(out)
    }

    /// The device address of a view's first float, after checking the view against its buffer.
    pub(crate) fn ptr(&self, m: &Mat) -> Result<u64, GpuError> {
        m.extent()?;
        let (base, _sync) = m.buf.cuda()?.device_ptr(&self.stream);
        Ok(base + (m.off * std::mem::size_of::<f32>()) as u64)
    }

    /// `c (+)= a · wᵀ`: `a` is M × K, `w` N × K (nn.dense's weight as stored), `c` M × N.
    pub(crate) fn gemm_nt(
        &self,
        a: &Mat,
        w: &Mat,
        c: &Mat,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        // Shapes checked by `Gpu::gemm_nt`.
        let kernel = self.gemm_kernel();
        if kernel == GemmKernel::Blas {
            let [a, w, c] = [a, w, c].map(|&mat| Batch { mat, stride: 0 });
            return self.blas_product(&a, &w, true, &c, 1, accumulate);
        }
        let (m, k, n) = (a.rows, a.cols, w.rows);
        let (pa, pw, pc) = (self.ptr(a)?, self.ptr(w)?, self.ptr(c)?);
        let (lda, ldw) = (to_i32(a.ld, "stride")?, to_i32(w.ld, "stride")?);
        let (mi, ni, ki) = (
            to_i32(m, "rows")?,
            to_i32(n, "columns")?,
            to_i32(k, "depth")?,
        );
        let tiles = (n.div_ceil(64) as u32, m.div_ceil(64) as u32);
        if let (GemmKernel::Split, Some((parts, kc))) = (
            kernel,
            split_depth(m.div_ceil(64) * n.div_ceil(64), k, self.sms),
        ) {
            let p = self.uninit(parts * m * n)?;
            let pp = self.ptr(&Mat {
                buf: &p,
                off: 0,
                ld: n,
                rows: parts * m,
                cols: n,
            })?;
            let args = [
                Arg::Ptr(pa),
                Arg::I32(lda),
                Arg::Ptr(pw),
                Arg::I32(ldw),
                Arg::Ptr(pp),
                Arg::I32(mi),
                Arg::I32(ni),
                Arg::I32(ki),
                Arg::I32(to_i32(kc, "depth")?),
            ];
            // SAFETY: the views were checked against their buffers; block z reads depths
            // [z · kc, min(K, (z + 1) · kc)) of rows < M of `a` and < N of `w` and writes the
            // M × N part z of `p`, which holds `parts` of them.
            unsafe {
                self.launch_fn(
                    &self.gemm_part,
                    (tiles.0, tiles.1, parts as u32),
                    256,
                    0,
                    &args,
                )?
            };
            let args = [
                Arg::Ptr(pp),
                Arg::I32(to_i32(parts, "parts")?),
                Arg::Ptr(pc),
                Arg::I32(to_i32(c.ld, "stride")?),
                Arg::I32(mi),
                Arg::I32(ni),
                Arg::I32(accumulate as i32),
            ];
            let blocks = (m * n).div_ceil(256).min(4096) as u32;
            // SAFETY: `p` holds `parts` parts of M × N; `c` was checked as M × N with its stride.
            unsafe { self.launch_fn(&self.sum_parts, (blocks, 1, 1), 256, 0, &args)? };
            // Stream-ordered: freed after the kernels that read it.
            drop(p);
            return Ok(());
        }
        let args = [
            Arg::Ptr(pa),
            Arg::I32(lda),
            Arg::Ptr(pw),
            Arg::I32(ldw),
            Arg::Ptr(pc),
            Arg::I32(to_i32(c.ld, "stride")?),
            Arg::I32(mi),
            Arg::I32(ni),
            Arg::I32(ki),
            Arg::I32(accumulate as i32),
        ];
        let f = match kernel {
            GemmKernel::Plain => &self.gemm_plain,
            _ => &self.gemm,
        };
        // SAFETY: the three views were checked against their buffers and the kernel reads and
        // writes only rows < M, columns < N / K of them.
        unsafe { self.launch_fn(f, (tiles.0, tiles.1, 1), 256, 0, &args) }
    }

    fn gemm_kernel(&self) -> GemmKernel {
        GemmKernel::from_u8(self.gemm_kernel.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether cuBLAS was found (products can run as [`GemmKernel::Blas`]).
    pub(crate) fn has_blas(&self) -> bool {
        self.blas.is_some()
    }

    /// Products run with `k` from now on; [`GemmKernel::Blas`] without cuBLAS is
    /// [`GemmKernel::Split`].
    pub(crate) fn set_gemm_kernel(&self, k: GemmKernel) {
        let k = match (k, &self.blas) {
            (GemmKernel::Blas, None) => GemmKernel::Split,
            _ => k,
        };
        self.gemm_kernel
            .store(k as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// `dst = src` (`add`: `dst += src`), both `rows × cols`; a `src` of one row with `ld` 0 is
    /// broadcast to every row (only with `add`).
    pub(crate) fn copy_rows(&self, src: &Mat, dst: &Mat, add: bool) -> Result<(), GpuError> {
        // Shapes checked by `Gpu::copy_rows`.
        let total = dst.rows * dst.cols;
        let (ps, pd) = (self.ptr(src)?, self.ptr(dst)?);
        let args = [
            Arg::Ptr(ps),
            Arg::I32(to_i32(src.ld, "stride")?),
            Arg::Ptr(pd),
            Arg::I32(to_i32(dst.ld, "stride")?),
            Arg::I32(to_i32(dst.rows, "rows")?),
            Arg::I32(to_i32(dst.cols, "columns")?),
            Arg::I32(i32::from(add)),
        ];
        let blocks = total.div_ceil(256).min(4096) as u32;
        // SAFETY: both views were checked; the kernel touches rows < rows, columns < cols, and
        // a broadcast source's one row.
        unsafe { self.launch_fn(&self.copy, (blocks, 1, 1), 256, 0, &args) }
    }

    /// `srcs`' blocks side by side in `dst` (checked by `Gpu::gather`): their addresses go up as
    /// a table (two floats' bits each, read by the kernel as 64-bit addresses).
    pub(crate) fn gather(
        &self,
        srcs: &[Block],
        len: usize,
        dst: &DevBuf,
        dst_off: usize,
        stride: usize,
    ) -> Result<(), GpuError> {
        let mut table = Vec::with_capacity(2 * srcs.len());
        for b in srcs {
            let (base, _sync) = b.buf.cuda()?.device_ptr(&self.stream);
            let p = base + (b.off * std::mem::size_of::<f32>()) as u64;
            table.push(f32::from_bits(p as u32));
            table.push(f32::from_bits((p >> 32) as u32));
        }
        let table = self.upload(&table)?;
        let whole = |buf, len| Mat {
            buf,
            off: 0,
            ld: len,
            rows: 1,
            cols: len,
        };
        let pt = self.ptr(&whole(&table, 2 * srcs.len()))?;
        let pd = self.ptr(&Mat {
            off: dst_off,
            ..whole(dst, dst.len() - dst_off)
        })?;
        let args = [
            Arg::Ptr(pt),
            Arg::I32(to_i32(srcs.len(), "blocks")?),
            Arg::I32(to_i32(len, "block length")?),
            Arg::Ptr(pd),
            Arg::I64(i64::try_from(stride).map_err(|_| GpuError::Bounds("stride".into()))?),
        ];
        let threads = len.next_multiple_of(32).min(256) as u32;
        let blocks = srcs.len().min(65535) as u32;
        // SAFETY: every source block of `len` floats and the `n` destination blocks `stride`
        // apart were checked against their buffers; the table holds `n` addresses of them.
        unsafe { self.launch_fn(&self.gather, (blocks, 1, 1), threads, 0, &args)? };
        // Stream-ordered: freed after the kernel.
        drop(table);
        Ok(())
    }

    /// `C_i (+)= A_i · op(B_i)` on cuBLAS (checked by `Gpu::gemm_batched` or `Gpu::gemm_nt`):
    /// `sgemm` for one product, the strided batched product for several.
    pub(crate) fn blas_product(
        &self,
        a: &Batch,
        b: &Batch,
        b_transposed: bool,
        c: &Batch,
        count: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let Some(blas) = &self.blas else {
            return Err(GpuError::Driver(
                "batched products need cuBLAS, which was not found".into(),
            ));
        };
        let (m, k, n) = (a.mat.rows, a.mat.cols, c.mat.cols);
        let (pa, pb, pc) = (self.ptr(&a.mat)?, self.ptr(&b.mat)?, self.ptr(&c.mat)?);
        let int = |x: usize, what| to_i32(x, what);
        let long = |x: usize| i64::try_from(x).map_err(|_| GpuError::Bounds("stride".into()));
        // Row-major C = A · op(B) is column-major Cᵀ = op(B)ᵀ · Aᵀ: B's buffer read column-major
        // is Bᵀ, so op(B)ᵀ is it transposed when B is N × K and as it is when K × N; A's is Aᵀ.
        let (op_b, ldb) = match b_transposed {
            true => (blas_sys::cublasOperation_t::CUBLAS_OP_T, b.mat.ld.max(k)),
            false => (blas_sys::cublasOperation_t::CUBLAS_OP_N, b.mat.ld.max(n)),
        };
        let op_a = blas_sys::cublasOperation_t::CUBLAS_OP_N;
        let (mi, ni, ki) = (int(m, "rows")?, int(n, "columns")?, int(k, "depth")?);
        let ldb = int(ldb.max(1), "stride")?;
        let lda = int(a.mat.ld.max(k).max(1), "stride")?;
        let ldc = int(c.mat.ld.max(n).max(1), "stride")?;
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let blas = blas.lock().map_err(|_| poisoned())?;
        self.ctx.bind_to_thread().map_err(driver)?;
        let (pb, pa, pc) = (pb as *const f32, pa as *const f32, pc as *mut f32);
        // SAFETY: every instance's view of A (M × K), B and C (M × N) was checked against its
        // buffer (`Mat::extent`, `Batch::extent`), the outputs do not overlap, and cuBLAS runs
        // on the job's stream, ordered with every kernel and copy of it.
        let done = unsafe {
            match count {
                1 => cudarc::cublas::result::sgemm(
                    *blas.handle(),
                    op_b,
                    op_a,
                    ni,
                    mi,
                    ki,
                    &alpha,
                    pb,
                    ldb,
                    pa,
                    lda,
                    &beta,
                    pc,
                    ldc,
                ),
                _ => cudarc::cublas::result::sgemm_strided_batched(
                    *blas.handle(),
                    op_b,
                    op_a,
                    ni,
                    mi,
                    ki,
                    &alpha,
                    pb,
                    ldb,
                    long(b.stride)?,
                    pa,
                    lda,
                    long(a.stride)?,
                    &beta,
                    pc,
                    ldc,
                    long(c.stride)?,
                    int(count, "batch")?,
                ),
            }
        };
        done.map_err(|e| GpuError::Driver(format!("cuBLAS: {e:?}")))
    }

    /// A generated kernel `name` from CUDA source `src`, compiled once per distinct source.
    pub(crate) fn compile(&self, name: &str, src: &str) -> Result<Kernel, GpuError> {
        if let Some(k) = self.generated.lock().ok().and_then(|g| g.get(src).cloned()) {
            return Ok(k);
        }
        let module = compile(&self.ctx, name, src, &self.arch)?;
        let func = module.load_function(name).map_err(driver)?;
        let k = Kernel { func };
        if let Ok(mut g) = self.generated.lock() {
            g.insert(src.to_string(), k.clone());
        }
        Ok(k)
    }

    /// Kernels compiled so far (generated ones).
    pub(crate) fn compiled(&self) -> usize {
        self.generated.lock().map(|g| g.len()).unwrap_or(0)
    }

    /// # Safety
    /// As [`crate::Gpu::launch`].
    pub(crate) unsafe fn launch_fn(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
            };
        }
        // SAFETY: the caller's contract.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver)
    }

    /// Waits for everything queued so far.
    pub(crate) fn synchronize(&self) -> Result<(), GpuError> {
        // Uploads staged before the wait are done after it; if none was staged meanwhile (by
        // another worker), the staging buffer is free again.
        let before = self.up.lock().map_err(|_| poisoned())?.staged;
        self.stream.synchronize().map_err(driver)?;
        let mut st = self.up.lock().map_err(|_| poisoned())?;
        if st.staged == before {
            st.used = 0;
        }
        Ok(())
    }
}

/// cuBLAS on `stream` where `libcublas` is found: `None` otherwise (the own kernels run), or
/// where `TUMBLE_NO_CUBLAS` is set. `TUMBLE_GPU_TF32=1` lets it use TF32 tensor cores (10-bit
/// mantissas: results differ from f32 by about 1e-3, beyond the engines' 1e-4 agreement).
fn open_blas(stream: &Arc<CudaStream>) -> Result<Option<Mutex<CudaBlas>>, GpuError> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if tumble_limits::env_flag("TUMBLE_NO_CUBLAS") || !unsafe { blas_sys::is_culib_present() } {
        return Ok(None);
    }
    let blas = CudaBlas::new(stream.clone())
        .map_err(|e| GpuError::Driver(format!("cuBLAS could not start: {e:?}")))?;
    if tumble_limits::env_flag("TUMBLE_GPU_TF32") {
        // SAFETY: a live handle; the mode only changes which instructions its products use.
        unsafe {
            blas_sys::cublasSetMathMode(
                *blas.handle(),
                blas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            )
        }
        .result()
        .map_err(|e| GpuError::Driver(format!("cuBLAS: {e:?}")))?;
    }
    Ok(Some(Mutex::new(blas)))
}

/// How a product of `tiles` 64 × 64 tiles and depth `k` splits its depth on `sms`
/// multiprocessors: `(parts, depth per part)`, or `None` to run it whole. A product that fills the
/// GPU runs whole; otherwise enough parts to give every multiprocessor about two blocks, each
/// part at least 128 deep (eight of the tile's slices), so the sum of the parts stays cheap.
pub(crate) fn split_depth(tiles: usize, k: usize, sms: usize) -> Option<(usize, usize)> {
    if tiles == 0 || tiles >= sms {
        return None;
    }
    let parts = (2 * sms).div_ceil(tiles).min(k / 128);
    if parts < 2 {
        return None;
    }
    let kc = k.div_ceil(parts).next_multiple_of(16);
    Some((k.div_ceil(kc), kc))
}

fn compile(
    ctx: &Arc<CudaContext>,
    name: &str,
    src: &str,
    arch: &str,
) -> Result<Arc<CudaModule>, GpuError> {
    let ptx = ptx_of(name, src, arch)?;
    ctx.load_module(ptx).map_err(driver)
}
