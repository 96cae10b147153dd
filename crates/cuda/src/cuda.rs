//! The CUDA implementation of [`crate::Gpu`]: a context, a stream, the fixed kernels, pinned
//! staging buffers and the generated kernels so far.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use crate::{driver, ptx_of, Arg, DevBuf, Fetch, GpuError, Kernel, Mat, Mem, FIXED_SOURCE};

/// One GPU: its context, the job's stream, the fixed kernels and the generated kernels so far.
pub(crate) struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _fixed: Arc<CudaModule>,
    gemm: CudaFunction,
    copy: CudaFunction,
    generated: Mutex<HashMap<String, Kernel>>,
    staging: Mutex<Staging>,
    /// [`pinned_staging`], switchable per device (the tests take both paths).
    pinned: std::sync::atomic::AtomicBool,
    name: String,
    arch: String,
}

/// Page-locked host memory, so copies between it and the device are asynchronous.
struct Pinned {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through `Gpu::staging`'s
// mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &CudaContext, len: usize) -> Result<Pinned, GpuError> {
        ctx.bind_to_thread().map_err(driver)?;
        let bytes = len.max(1) * std::mem::size_of::<f32>();
        // SAFETY: a fresh page-locked allocation of `bytes`; freed once, in `drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.map_err(driver)?;
        Ok(Pinned {
            ptr: ptr.cast(),
            len: len.max(1),
        })
    }

    fn slice_mut(&mut self, at: usize, len: usize) -> &mut [f32] {
        let len = len.min(self.len.saturating_sub(at));
        // SAFETY: `ptr` holds `self.len` floats (f32 has no invalid bit patterns) and the range
        // was clamped to them; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at.min(self.len)), len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed only here.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// The pinned buffers of a stream's copies: uploads are staged at `up_used..` until the next
/// synchronization (the copies may still be reading them), downloads land in `down`.
struct Staging {
    up: Option<Pinned>,
    up_used: usize,
    down: Option<Pinned>,
}

/// `TUMBLE_PINNED_STAGING=1`: uploads staged in page-locked memory (asynchronous) and a launch's
/// downloads through it with one wait. Off by default: on an H100 it measured no faster than
/// pageable copies over the suite (geometric mean of warm times 4% slower, points from 0.6x to
/// 1.6x; bench/RESULTS.md, "CUDA backend") and its first allocation costs a cold run tens of ms.
fn pinned_staging() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TUMBLE_PINNED_STAGING").is_some())
}

/// Floats staged for uploads before a grow (4 MiB).
const STAGING_FLOATS: usize = 1 << 20;

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gpu({}, {})", self.name, self.arch)
    }
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
        Ok(CudaDevice {
            gemm: load("gemm_nt")?,
            copy: load("copy_rows")?,
            _fixed: fixed,
            ctx,
            stream,
            generated: Mutex::default(),
            staging: Mutex::new(Staging {
                up: None,
                up_used: 0,
                down: None,
            }),
            pinned: pinned_staging().into(),
            name,
            arch,
        })
    }

    fn pinned(&self) -> bool {
        self.pinned.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies through page-locked staging buffers (`true`) or from and to pageable memory.
    pub(crate) fn set_pinned_staging(&self, on: bool) {
        self.pinned.store(on, std::sync::atomic::Ordering::Relaxed);
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
        if !self.pinned() {
            let slice = self.stream.clone_htod(data).map_err(driver)?;
            return Ok(DevBuf {
                mem: Mem::Cuda(slice),
            });
        }
        let mut dst = self.uninit(data.len())?;
        let mut st = self
            .staging
            .lock()
            .map_err(|_| GpuError::Driver("staging lock poisoned".into()))?;
        let cap = st.up.as_ref().map_or(0, |p| p.len);
        if st.up_used + data.len() > cap {
            // Earlier uploads may still read the staging buffer: wait for them first.
            self.stream.synchronize().map_err(driver)?;
            st.up_used = 0;
            if data.len() > cap {
                st.up = None;
                st.up = Some(Pinned::new(&self.ctx, data.len().max(STAGING_FLOATS))?);
            }
        }
        let at = st.up_used;
        let Some(pinned) = st.up.as_mut() else {
            return Err(GpuError::Driver("no staging buffer".into()));
        };
        let staged = pinned.slice_mut(at, data.len());
        staged.copy_from_slice(data);
        {
            let (dptr, _sync) =
                cudarc::driver::DevicePtrMut::device_ptr_mut(dst.cuda_mut()?, &self.stream);
            // SAFETY: `dst` holds `data.len()` floats; the staged range stays untouched until
            // the next synchronization of the stream (`up_used` only grows until then), after
            // this copy.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dptr, staged, self.stream.cu_stream())
            }
            .map_err(driver)?;
        }
        st.up_used = at + data.len();
        Ok(dst)
    }

    /// Several ranges copied back with one wait for the stream.
    pub(crate) fn download_many(&self, fetches: &[Fetch]) -> Result<Vec<Vec<f32>>, GpuError> {
        let total: usize = fetches.iter().map(|f| f.len).sum();
        if total == 0 {
            return Ok(fetches.iter().map(|_| Vec::new()).collect());
        }
        if !self.pinned() {
            return fetches
                .iter()
                .map(|f| {
                    let range = f.buf.cuda()?.slice(f.off..f.off + f.len);
                    self.stream.clone_dtoh(&range).map_err(driver)
                })
                .collect();
        }
        let mut st = self
            .staging
            .lock()
            .map_err(|_| GpuError::Driver("staging lock poisoned".into()))?;
        if st.down.as_ref().map_or(0, |p| p.len) < total {
            st.down = None;
            st.down = Some(Pinned::new(&self.ctx, total.max(STAGING_FLOATS))?);
        }
        let Some(down) = st.down.as_mut() else {
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
            // memory of `f.len` floats that nothing reads until the stream is synchronized below.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                .map_err(driver)?;
            at += f.len;
        }
        self.stream.synchronize().map_err(driver)?;
        let mut out = Vec::with_capacity(fetches.len());
        let mut at = 0;
        for f in fetches {
            out.push(down.slice_mut(at, f.len).to_vec());
            at += f.len;
        }
        // Synchronized: every staged upload is done.
        st.up_used = 0;
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
        let (m, k, n) = (a.rows, a.cols, w.rows);
        let (pa, pw, pc) = (self.ptr(a)?, self.ptr(w)?, self.ptr(c)?);
        let args = [
            Arg::Ptr(pa),
            Arg::I32(to_i32(a.ld, "stride")?),
            Arg::Ptr(pw),
            Arg::I32(to_i32(w.ld, "stride")?),
            Arg::Ptr(pc),
            Arg::I32(to_i32(c.ld, "stride")?),
            Arg::I32(to_i32(m, "rows")?),
            Arg::I32(to_i32(n, "columns")?),
            Arg::I32(to_i32(k, "depth")?),
            Arg::I32(accumulate as i32),
        ];
        let grid = (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1);
        // SAFETY: the three views were checked against their buffers and the kernel reads and
        // writes only rows < M, columns < N / K of them.
        unsafe { self.launch_fn(&self.gemm, grid, 256, 0, &args) }
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
            };
        }
        // SAFETY: the caller's contract.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver)
    }

    /// Waits for everything queued so far.
    pub(crate) fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver)?;
        if let Ok(mut st) = self.staging.lock() {
            st.up_used = 0;
        }
        Ok(())
    }
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
