//! tumble's CUDA device layer: what the runtime's device executor (`tumble_runtime::fused::device`)
//! needs of a GPU, and nothing of tumble's plans.
//!
//! The CUDA driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so.13`) are loaded when a device is
//! opened, not linked: the workspace builds and its tests run on machines without CUDA, and
//! [`Gpu::open`] says which library is missing where none is found. One [`Gpu`] is one context
//! and one stream: every copy and kernel of a job is ordered on it, so a buffer dropped after a
//! kernel that reads it is freed after that kernel (stream-ordered allocation).
//!
//! The fixed kernels (`kernels.cu`: the product `X · Wᵀ` of `nn.dense`, strided row copies and
//! row sums) are compiled once when the device opens; generated kernels (the runtime's row
//! programs) with [`Gpu::compile`], cached by their source text.
//!
//! [`Gpu::emulated`] is a device in host memory: buffers are vectors and the fixed kernels plain
//! loops (`host.rs`). It runs no generated kernels; the runtime runs their row programs on the
//! host instead. It exists so that the runtime's device executor — which stages go to the device,
//! the views, strides and copies between them — is checked by the CPU test suites, on every
//! machine, against the reference engine.

use std::fmt;
use std::sync::RwLock;

use cudarc::driver::{CudaFunction, CudaSlice};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

mod cuda;
mod host;

use cuda::CudaDevice;

const FIXED_SOURCE: &str = include_str!("kernels.cu");

/// Why the device could not be used.
#[derive(Debug, Clone)]
pub enum GpuError {
    /// `libcuda.so` (the NVIDIA driver) is not installed.
    NoDriver,
    /// NVRTC (`libnvrtc.so.13`) is not on the library path.
    NoNvrtc,
    /// A driver call failed.
    Driver(String),
    /// NVRTC rejected a kernel: its name and the compiler's log.
    Compile { kernel: String, log: String },
    /// A buffer view that does not fit its buffer, or arguments that do not fit a kernel.
    Bounds(String),
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::NoDriver => write!(
                f,
                "no CUDA driver found (libcuda.so): `--device cuda` needs an NVIDIA GPU with its \
                 driver installed; use `--device cpu` (the default) on this machine"
            ),
            GpuError::NoNvrtc => write!(
                f,
                "the CUDA driver is present but NVRTC (libnvrtc.so.13, CUDA 13's run-time \
                 compiler) is not on the library path: install the CUDA toolkit or the \
                 `nvidia-cuda-nvrtc` package and add its lib folder to LD_LIBRARY_PATH"
            ),
            GpuError::Driver(m) => write!(f, "CUDA: {m}"),
            GpuError::Compile { kernel, log } => {
                write!(
                    f,
                    "internal: NVRTC could not compile kernel `{kernel}`:\n{log}"
                )
            }
            GpuError::Bounds(m) => write!(f, "internal: device buffer bounds: {m}"),
        }
    }
}

impl std::error::Error for GpuError {}

fn driver(e: cudarc::driver::DriverError) -> GpuError {
    GpuError::Driver(e.to_string())
}

/// An f32 buffer in device memory (or, on an emulated device, in host memory).
pub struct DevBuf {
    mem: Mem,
}

enum Mem {
    Cuda(CudaSlice<f32>),
    Host(RwLock<Vec<f32>>),
}

impl DevBuf {
    /// Length in floats.
    pub fn len(&self) -> usize {
        match &self.mem {
            Mem::Cuda(s) => s.len(),
            Mem::Host(v) => v.read().map_or(0, |v| v.len()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn cuda(&self) -> Result<&CudaSlice<f32>, GpuError> {
        match &self.mem {
            Mem::Cuda(s) => Ok(s),
            Mem::Host(_) => Err(GpuError::Bounds("an emulated buffer on the GPU".into())),
        }
    }

    fn cuda_mut(&mut self) -> Result<&mut CudaSlice<f32>, GpuError> {
        match &mut self.mem {
            Mem::Cuda(s) => Ok(s),
            Mem::Host(_) => Err(GpuError::Bounds("an emulated buffer on the GPU".into())),
        }
    }

    fn host(&self) -> Result<&RwLock<Vec<f32>>, GpuError> {
        match &self.mem {
            Mem::Host(v) => Ok(v),
            Mem::Cuda(_) => Err(GpuError::Bounds(
                "a GPU buffer on the emulated device".into(),
            )),
        }
    }
}

impl fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevBuf({} floats)", self.len())
    }
}

/// A row-major matrix inside a device buffer: `rows` rows of `cols` floats, row `r` starting at
/// `off + r · ld`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub buf: &'a DevBuf,
    pub off: usize,
    pub ld: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Mat<'_> {
    /// The floats the view spans, checked against its buffer.
    fn extent(&self) -> Result<(), GpuError> {
        let end = match self.rows {
            0 => self.off,
            r => (r - 1)
                .checked_mul(self.ld)
                .and_then(|x| x.checked_add(self.off))
                .and_then(|x| x.checked_add(self.cols))
                .ok_or_else(|| GpuError::Bounds("view size overflows".into()))?,
        };
        if end > self.buf.len() || (self.rows > 1 && self.ld < self.cols) {
            return Err(GpuError::Bounds(format!(
                "{} x {} at {} (row stride {}) in a buffer of {} floats",
                self.rows,
                self.cols,
                self.off,
                self.ld,
                self.buf.len()
            )));
        }
        Ok(())
    }
}

/// A generated kernel, compiled.
#[derive(Clone)]
pub struct Kernel {
    func: CudaFunction,
}

/// A kernel argument: a device address (checked views only, see [`Gpu::ptr`]), an int, a float.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// One GPU (or its emulation in host memory, [`Gpu::emulated`]).
pub struct Gpu {
    imp: Imp,
}

enum Imp {
    Cuda(Box<CudaDevice>),
    Host,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.imp {
            Imp::Cuda(d) => d.fmt(f),
            Imp::Host => write!(f, "Gpu(emulated)"),
        }
    }
}

/// Generated kernels do not run on an emulated device.
fn no_kernels() -> GpuError {
    GpuError::Bounds("an emulated device runs no generated kernels".into())
}

impl Gpu {
    /// Opens GPU `ordinal`: loads the driver and NVRTC, makes a context and a stream, and compiles
    /// the fixed kernels for the device's architecture.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        Ok(Gpu {
            imp: Imp::Cuda(Box::new(CudaDevice::open(ordinal)?)),
        })
    }

    /// A device emulated in host memory (tests; see the crate's documentation).
    pub fn emulated() -> Gpu {
        Gpu { imp: Imp::Host }
    }

    /// Whether this is [`Gpu::emulated`].
    pub fn is_emulated(&self) -> bool {
        matches!(self.imp, Imp::Host)
    }

    /// The device's name and architecture, for profiles and results.
    pub fn describe(&self) -> String {
        match &self.imp {
            Imp::Cuda(d) => d.describe(),
            Imp::Host => "a GPU emulated in host memory".into(),
        }
    }

    /// How copies are staged from now on (the tests take every path).
    pub fn set_staging(&self, s: Staging) {
        if let Imp::Cuda(d) = &self.imp {
            d.set_staging(s);
        }
    }

    /// Whether products can run on cuBLAS ([`GemmKernel::Blas`]; the emulated device has none).
    pub fn has_blas(&self) -> bool {
        match &self.imp {
            Imp::Cuda(d) => d.has_blas(),
            Imp::Host => false,
        }
    }

    /// Runs products with kernel `k` from now on (the benchmark's comparisons; the emulated
    /// device has one): [`GemmKernel::Blas`] without cuBLAS is [`GemmKernel::Split`].
    pub fn set_gemm_kernel(&self, k: GemmKernel) {
        if let Imp::Cuda(d) = &self.imp {
            d.set_gemm_kernel(k);
        }
    }

    /// A buffer of `len` zeros.
    pub fn zeros(&self, len: usize) -> Result<DevBuf, GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.zeros(len),
            Imp::Host => Ok(host::buffer(vec![0.0; len.max(1)])),
        }
    }

    /// A buffer of `len` floats whose contents are undefined until a kernel writes them (NaN on
    /// an emulated device, so that reading them shows).
    pub fn uninit(&self, len: usize) -> Result<DevBuf, GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.uninit(len),
            Imp::Host => Ok(host::buffer(vec![f32::NAN; len.max(1)])),
        }
    }

    /// A copy of `data` on the device, queued on the stream.
    pub fn upload(&self, data: &[f32]) -> Result<DevBuf, GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.upload(data),
            Imp::Host if data.is_empty() => self.zeros(1),
            Imp::Host => Ok(host::buffer(data.to_vec())),
        }
    }

    /// `len` floats of `buf` from `off`, copied back (waits for the stream).
    pub fn download(&self, buf: &DevBuf, off: usize, len: usize) -> Result<Vec<f32>, GpuError> {
        let mut all = self.download_many(&[Fetch { buf, off, len }])?;
        Ok(all.pop().unwrap_or_default())
    }

    /// Several ranges copied back with one wait for the stream.
    pub fn download_many(&self, fetches: &[Fetch]) -> Result<Vec<Vec<f32>>, GpuError> {
        for f in fetches {
            if f.off.checked_add(f.len).is_none_or(|e| e > f.buf.len()) {
                return Err(GpuError::Bounds(format!(
                    "download {}+{} of {}",
                    f.off,
                    f.len,
                    f.buf.len()
                )));
            }
        }
        match &self.imp {
            Imp::Cuda(d) => d.download_many(fetches),
            Imp::Host => host::download_many(fetches),
        }
    }

    /// The device address of a view's first float, after checking the view against its buffer.
    pub fn ptr(&self, m: &Mat) -> Result<u64, GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.ptr(m),
            Imp::Host => Err(no_kernels()),
        }
    }

    /// `c (+)= a · wᵀ`: `a` is M × K, `w` N × K (nn.dense's weight as stored), `c` M × N.
    pub fn gemm_nt(&self, a: &Mat, w: &Mat, c: &Mat, accumulate: bool) -> Result<(), GpuError> {
        let (m, k, n) = (a.rows, a.cols, w.rows);
        if w.cols != k || c.rows != m || c.cols != n {
            return Err(GpuError::Bounds(format!(
                "gemm of {m}x{k} by ({}x{})ᵀ into {}x{}",
                w.rows, w.cols, c.rows, c.cols
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        match &self.imp {
            Imp::Cuda(d) => d.gemm_nt(a, w, c, accumulate),
            Imp::Host => host::gemm_nt(a, w, c, accumulate),
        }
    }

    /// `dst = src` (`add`: `dst += src`), both `rows × cols`; a `src` of one row with `ld` 0 is
    /// broadcast to every row (only with `add`).
    pub fn copy_rows(&self, src: &Mat, dst: &Mat, add: bool) -> Result<(), GpuError> {
        let broadcast = add && src.rows == 1 && src.ld == 0;
        if src.cols != dst.cols || (src.rows != dst.rows && !broadcast) {
            return Err(GpuError::Bounds(format!(
                "copy of {}x{} into {}x{}",
                src.rows, src.cols, dst.rows, dst.cols
            )));
        }
        if dst.rows * dst.cols == 0 {
            return Ok(());
        }
        match &self.imp {
            Imp::Cuda(d) => d.copy_rows(src, dst, add),
            Imp::Host => host::copy_rows(src, dst, add, broadcast),
        }
    }

    /// Copies `len` floats from each block of `srcs` to `dst`: block `i` to
    /// `dst_off + i · stride`.
    pub fn gather(
        &self,
        srcs: &[Block],
        len: usize,
        dst: &DevBuf,
        dst_off: usize,
        stride: usize,
    ) -> Result<(), GpuError> {
        for b in srcs {
            if b.off.checked_add(len).is_none_or(|e| e > b.buf.len()) {
                return Err(GpuError::Bounds(format!(
                    "gather of {len} floats at {} of {}",
                    b.off,
                    b.buf.len()
                )));
            }
        }
        let n = srcs.len();
        let end = n
            .checked_sub(1)
            .and_then(|l| l.checked_mul(stride))
            .and_then(|x| x.checked_add(dst_off))
            .and_then(|x| x.checked_add(len));
        if n > 0 && (stride < len || end.is_none_or(|e| e > dst.len())) {
            return Err(GpuError::Bounds(format!(
                "gather of {n} x {len} floats into {} at {dst_off} (stride {stride})",
                dst.len()
            )));
        }
        if n == 0 || len == 0 {
            return Ok(());
        }
        match &self.imp {
            Imp::Cuda(d) => d.gather(srcs, len, dst, dst_off, stride),
            Imp::Host => host::gather(srcs, len, dst, dst_off, stride),
        }
    }

    /// Whether [`Gpu::gemm_batched`] runs here (cuBLAS found, or the emulated device).
    pub fn batched_products(&self) -> bool {
        match &self.imp {
            Imp::Cuda(d) => d.has_blas(),
            Imp::Host => true,
        }
    }

    /// `C_i (+)= A_i · op(B_i)` for `i < count`, `op(B) = Bᵀ` (`B_i` N × K, as `nn.dense` stores a
    /// weight) if `b_transposed`, else `B` (K × N).
    pub fn gemm_batched(
        &self,
        a: &Batch,
        b: &Batch,
        b_transposed: bool,
        c: &Batch,
        count: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let (m, k) = (a.mat.rows, a.mat.cols);
        let (bk, n) = match b_transposed {
            true => (b.mat.cols, b.mat.rows),
            false => (b.mat.rows, b.mat.cols),
        };
        if bk != k || c.mat.rows != m || c.mat.cols != n {
            return Err(GpuError::Bounds(format!(
                "batched gemm of {m}x{k} by {}x{} (transposed: {b_transposed}) into {}x{}",
                b.mat.rows, b.mat.cols, c.mat.rows, c.mat.cols
            )));
        }
        if count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        for x in [a, b, c] {
            x.extent(count)?;
        }
        if c.stride < c.mat.rows.saturating_sub(1) * c.mat.ld + c.mat.cols && count > 1 {
            return Err(GpuError::Bounds("batched gemm outputs overlap".into()));
        }
        match &self.imp {
            Imp::Cuda(d) => d.blas_product(a, b, b_transposed, c, count, accumulate),
            Imp::Host => host::gemm_batched(a, b, b_transposed, c, count, accumulate),
        }
    }

    /// A generated kernel `name` from CUDA source `src`, compiled once per distinct source.
    pub fn compile(&self, name: &str, src: &str) -> Result<Kernel, GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.compile(name, src),
            Imp::Host => Err(no_kernels()),
        }
    }

    /// Generated kernels compiled so far.
    pub fn compiled(&self) -> usize {
        match &self.imp {
            Imp::Cuda(d) => d.compiled(),
            Imp::Host => 0,
        }
    }

    /// Launches `k` on `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// Every `Arg::Ptr` must come from [`Gpu::ptr`] of a view the kernel stays inside, and the
    /// arguments must match the kernel's parameters in number and type.
    pub unsafe fn launch(
        &self,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        match &self.imp {
            // SAFETY: the caller's contract is this function's.
            Imp::Cuda(d) => unsafe { d.launch_fn(&k.func, grid, block, smem, args) },
            Imp::Host => Err(no_kernels()),
        }
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        match &self.imp {
            Imp::Cuda(d) => d.synchronize(),
            Imp::Host => Ok(()),
        }
    }
}

/// Which GEMM kernel a device runs (`TUMBLE_GPU_GEMM=plain|pipelined|split|cublas`; default
/// `cublas` where the library is found, else `split`): the first tile kernel; the tile loading its
/// next depth slice while it multiplies the current one; that, with the depth of a product too
/// small to fill the GPU split across blocks; cuBLAS's `sgemm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    Plain = 0,
    Pipelined = 1,
    Split = 2,
    Blas = 3,
}

impl GemmKernel {
    fn from_u8(x: u8) -> GemmKernel {
        match x {
            0 => GemmKernel::Plain,
            1 => GemmKernel::Pipelined,
            2 => GemmKernel::Split,
            _ => GemmKernel::Blas,
        }
    }

    /// The kernel `name` names (`plain`, `pipelined`, `split`, `cublas`).
    pub fn parse(name: &str) -> Option<GemmKernel> {
        match name {
            "plain" => Some(GemmKernel::Plain),
            "pipelined" => Some(GemmKernel::Pipelined),
            "split" => Some(GemmKernel::Split),
            "cublas" => Some(GemmKernel::Blas),
            _ => None,
        }
    }

    fn from_env() -> Option<GemmKernel> {
        std::env::var("TUMBLE_GPU_GEMM")
            .ok()
            .and_then(|v| GemmKernel::parse(&v))
    }
}

/// How copies between host and device are staged: from and to pageable memory (each download
/// waits for the stream), through page-locked buffers (uploads return at once, several downloads
/// wait once), or downloads and small uploads through them (the default; `TUMBLE_STAGING`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    Pageable = 0,
    Pinned = 1,
    Mixed = 2,
}

impl Staging {
    fn from_u8(x: u8) -> Staging {
        match x {
            0 => Staging::Pageable,
            1 => Staging::Pinned,
            _ => Staging::Mixed,
        }
    }
}

/// A block of floats on the device: `buf` from `off` (a source of [`Gpu::gather`]).
#[derive(Clone, Copy, Debug)]
pub struct Block<'a> {
    pub buf: &'a DevBuf,
    pub off: usize,
}

/// Instance `i` of a batch of equally shaped matrices: `mat` moved `i · stride` floats on
/// ([`Gpu::gemm_batched`]; a stride of 0 repeats one matrix).
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub mat: Mat<'a>,
    pub stride: usize,
}

impl Batch<'_> {
    /// Whether all `count` instances lie in the buffer.
    fn extent(&self, count: usize) -> Result<(), GpuError> {
        let last = count
            .checked_sub(1)
            .and_then(|c| c.checked_mul(self.stride))
            .and_then(|x| x.checked_add(self.mat.off))
            .ok_or_else(|| GpuError::Bounds("batch size overflows".into()))?;
        Mat {
            off: last,
            ..self.mat
        }
        .extent()?;
        self.mat.extent()
    }
}

/// A download: `len` floats of a buffer from `off`.
pub struct Fetch<'a> {
    pub buf: &'a DevBuf,
    pub off: usize,
    pub len: usize,
}

/// Whether NVRTC can be loaded here (a machine without a GPU may still have it: then generated
/// kernels can be compiled, though not run).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `src` with NVRTC for `arch` (e.g. `sm_90`) without loading it: the check the tests
/// run on machines with NVRTC and no GPU.
pub fn check_source(name: &str, src: &str, arch: &str) -> Result<(), GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    ptx_of(name, src, arch).map(|_| ())
}

fn ptx_of(name: &str, src: &str, arch: &str) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| GpuError::Compile {
        kernel: name.to_string(),
        log: format!("{e:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed kernels at odd sizes (partial tiles) against the host, and the copies.
    fn check_fixed_kernels(gpu: &Gpu) {
        let (m, k, n) = (37, 29, 13);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 13) as f32 * 0.25).collect();
        let (da, dw) = (gpu.upload(&a).unwrap(), gpu.upload(&w).unwrap());
        let dc = gpu.zeros(m * n).unwrap();
        let mat = |buf, rows, cols| Mat {
            buf,
            off: 0,
            ld: cols,
            rows,
            cols,
        };
        gpu.gemm_nt(&mat(&da, m, k), &mat(&dw, n, k), &mat(&dc, m, n), false)
            .unwrap();
        let c = gpu.download(&dc, 0, m * n).unwrap();
        for r in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|x| a[r * k + x] * w[j * k + x]).sum();
                assert!((c[r * n + j] - want).abs() <= 1e-3 * want.abs().max(1.0));
            }
        }
        // Accumulating into a strided column block: C[:, 2..5] += A · W[0..3]ᵀ.
        let block = Mat {
            buf: &dc,
            off: 2,
            ld: n,
            rows: m,
            cols: 3,
        };
        gpu.gemm_nt(&mat(&da, m, k), &mat(&dw, 3, k), &block, true)
            .unwrap();
        let c2 = gpu.download(&dc, 0, m * n).unwrap();
        for r in 0..m {
            for j in 0..n {
                let extra: f32 = match j {
                    2..=4 => (0..k).map(|x| a[r * k + x] * w[(j - 2) * k + x]).sum(),
                    _ => 0.0,
                };
                let want = c[r * n + j] + extra;
                assert!((c2[r * n + j] - want).abs() <= 1e-3 * want.abs().max(1.0));
            }
        }
        // A row added to every row (a bias), then rows copied into a wider buffer's columns.
        let bias: Vec<f32> = (0..n).map(|j| j as f32).collect();
        let db = gpu.upload(&bias).unwrap();
        let one_row = Mat {
            buf: &db,
            off: 0,
            ld: 0,
            rows: 1,
            cols: n,
        };
        gpu.copy_rows(&one_row, &mat(&dc, m, n), true).unwrap();
        let wide = gpu.zeros(m * (n + 4)).unwrap();
        let cols = Mat {
            buf: &wide,
            off: 4,
            ld: n + 4,
            rows: m,
            cols: n,
        };
        gpu.copy_rows(&mat(&dc, m, n), &cols, false).unwrap();
        let back = gpu.download(&wide, 0, m * (n + 4)).unwrap();
        for r in 0..m {
            assert!(back[r * (n + 4)..r * (n + 4) + 4].iter().all(|&x| x == 0.0));
            for j in 0..n {
                assert_eq!(back[r * (n + 4) + 4 + j], c2[r * n + j] + j as f32);
            }
        }
        // Several ranges at once (and an empty one), both ways of copying.
        for staging in [Staging::Pageable, Staging::Pinned, Staging::Mixed] {
            gpu.set_staging(staging);
            let parts = gpu
                .download_many(&[
                    Fetch {
                        buf: &da,
                        off: 3,
                        len: 5,
                    },
                    Fetch {
                        buf: &dw,
                        off: 0,
                        len: 0,
                    },
                    Fetch {
                        buf: &dc,
                        off: n,
                        len: n,
                    },
                ])
                .unwrap();
            assert_eq!(parts[0], a[3..8].to_vec());
            assert!(parts[1].is_empty());
            assert_eq!(parts[2].len(), n);
            assert!(gpu.download_many(&[]).unwrap().is_empty());
            // More than a staging buffer holds: it grows after waiting for earlier copies.
            let big: Vec<f32> = (0..(1 << 20) + 7).map(|i| i as f32).collect();
            let dbig = gpu.upload(&big).unwrap();
            let tail = gpu.download(&dbig, 1 << 20, 7).unwrap();
            assert_eq!(tail, big[1 << 20..].to_vec());
        }
        // Views outside their buffer and mismatched shapes are errors, not reads out of bounds.
        let past = Mat {
            buf: &dc,
            off: 4,
            ld: n,
            rows: m,
            cols: n,
        };
        assert!(gpu
            .gemm_nt(&mat(&da, m, k), &mat(&dw, n, k), &past, false)
            .is_err());
        assert!(gpu
            .gemm_nt(&mat(&da, m, k), &mat(&dw, n, k - 1), &mat(&dc, m, n), false)
            .is_err());
        assert!(gpu.download(&dc, m * n - 1, 2).is_err());
    }

    #[test]
    fn the_emulated_device_computes_what_the_host_does() {
        let gpu = Gpu::emulated();
        check_fixed_kernels(&gpu);
        check_products(&gpu, GemmKernel::Split);
        check_gather_and_batches(&gpu);
        // No generated kernels there: an error, not a crash.
        assert!(gpu
            .compile("k", "extern \"C\" __global__ void k() {}")
            .is_err());
    }

    /// On a machine without CUDA, opening the device is an error that says what is missing (and
    /// never a panic); with one, the fixed kernels compute what the host does.
    #[test]
    fn open_reports_what_is_missing_or_computes() {
        match Gpu::open(0) {
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("libcuda") || m.contains("NVRTC") || m.contains("CUDA"),
                    "{m}"
                );
            }
            Ok(gpu) => {
                check_fixed_kernels(&gpu);
                for kernel in [
                    GemmKernel::Plain,
                    GemmKernel::Pipelined,
                    GemmKernel::Split,
                    GemmKernel::Blas,
                ] {
                    check_products(&gpu, kernel);
                }
                check_gather_and_batches(&gpu);
            }
        }
    }

    /// Products with strided operands, accumulating and not, at sizes that split their depth
    /// (few tiles, deep) and that do not, against the host in f64.
    fn check_products(gpu: &Gpu, kernel: GemmKernel) {
        gpu.set_gemm_kernel(kernel);
        for (m, k, n) in [(5, 1000, 70), (1, 4099, 64), (70, 333, 130), (129, 17, 65)] {
            let (lda, ldw, ldc) = (k + 3, k + 1, n + 2);
            let a: Vec<f32> = (0..m * lda).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let w: Vec<f32> = (0..n * ldw).map(|i| ((i * 5) % 13) as f32 * 0.25).collect();
            let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 3) as f32).collect();
            let (da, dw) = (gpu.upload(&a).unwrap(), gpu.upload(&w).unwrap());
            for accumulate in [false, true] {
                let dc = gpu.upload(&c0).unwrap();
                let view = |buf, ld, rows, cols| Mat {
                    buf,
                    off: 0,
                    ld,
                    rows,
                    cols,
                };
                gpu.gemm_nt(
                    &view(&da, lda, m, k),
                    &view(&dw, ldw, n, k),
                    &view(&dc, ldc, m, n),
                    accumulate,
                )
                .unwrap();
                let c = gpu.download(&dc, 0, m * ldc).unwrap();
                for r in 0..m {
                    for j in 0..ldc {
                        let got = c[r * ldc + j];
                        if j >= n {
                            assert_eq!(got, c0[r * ldc + j], "{kernel:?} wrote past column {n}");
                            continue;
                        }
                        let dot: f64 = (0..k)
                            .map(|x| f64::from(a[r * lda + x]) * f64::from(w[j * ldw + x]))
                            .sum();
                        let want = dot
                            + if accumulate {
                                f64::from(c0[r * ldc + j])
                            } else {
                                0.0
                            };
                        assert!(
                            (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{kernel:?} {m}x{k}x{n} acc {accumulate} [{r},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
        gpu.set_gemm_kernel(GemmKernel::Blas);
    }

    /// Gathers of blocks from anywhere, and batched products (shared and strided operands, both
    /// layouts of B, accumulating and not) against the host.
    fn check_gather_and_batches(gpu: &Gpu) {
        let src: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let ds = gpu.upload(&src).unwrap();
        let dst = gpu.zeros(2 + 3 * 9 + 7).unwrap();
        let blocks = [5, 50, 90].map(|off| Block { buf: &ds, off });
        gpu.gather(&blocks, 7, &dst, 2, 9).unwrap();
        let back = gpu.download(&dst, 0, dst.len()).unwrap();
        for (i, off) in [5, 50, 90].into_iter().enumerate() {
            assert_eq!(back[2 + 9 * i..2 + 9 * i + 7], src[off..off + 7]);
            assert!(back[2 + 9 * i + 7..2 + 9 * i + 9].iter().all(|&x| x == 0.0));
        }
        let past = [Block { buf: &ds, off: 95 }];
        assert!(gpu.gather(&past, 7, &dst, 0, 7).is_err());
        assert!(gpu.gather(&blocks, 7, &dst, 12, 9).is_err());
        assert!(gpu.gather(&blocks, 7, &dst, 0, 6).is_err());
        if !gpu.batched_products() {
            return;
        }
        let (count, m, k, n) = (3, 2, 5, 4);
        let a: Vec<f32> = (0..count * (m * k + 1))
            .map(|i| (i % 7) as f32 - 3.0)
            .collect();
        let b: Vec<f32> = (0..count * (n * k + 3))
            .map(|i| (i % 5) as f32 * 0.5)
            .collect();
        let (da, db) = (gpu.upload(&a).unwrap(), gpu.upload(&b).unwrap());
        for (b_transposed, b_stride) in [(true, n * k + 3), (false, n * k + 3), (true, 0)] {
            for accumulate in [false, true] {
                let c0: Vec<f32> = (0..count * (m * n + 2)).map(|i| (i % 3) as f32).collect();
                let dc = gpu.upload(&c0).unwrap();
                let batch = |buf, rows, cols, stride| Batch {
                    mat: Mat {
                        buf,
                        off: 1,
                        ld: cols,
                        rows,
                        cols,
                    },
                    stride,
                };
                let bb = match b_transposed {
                    true => batch(&db, n, k, b_stride),
                    false => batch(&db, k, n, b_stride),
                };
                gpu.gemm_batched(
                    &batch(&da, m, k, m * k + 1),
                    &bb,
                    b_transposed,
                    &batch(&dc, m, n, m * n + 2),
                    count,
                    accumulate,
                )
                .unwrap();
                let c = gpu.download(&dc, 0, c0.len()).unwrap();
                for i in 0..count {
                    for r in 0..m {
                        for j in 0..n {
                            let dot: f32 = (0..k)
                                .map(|x| {
                                    let y = match b_transposed {
                                        true => b[1 + i * b_stride + j * k + x],
                                        false => b[1 + i * b_stride + x * n + j],
                                    };
                                    a[1 + i * (m * k + 1) + r * k + x] * y
                                })
                                .sum();
                            let at = 1 + i * (m * n + 2) + r * n + j;
                            let want = dot + if accumulate { c0[at] } else { 0.0 };
                            assert!((c[at] - want).abs() <= 1e-4 * want.abs().max(1.0));
                        }
                    }
                }
            }
        }
    }

    /// Split depths cover the depth once, in parts of whole slices, none empty; a product that
    /// fills the GPU or is shallow is not split.
    #[test]
    fn split_depth_covers_the_depth() {
        assert_eq!(cuda::split_depth(132, 4096, 132), None);
        assert_eq!(cuda::split_depth(10, 200, 132), None);
        for tiles in [1, 2, 5, 40, 131] {
            for k in [256, 257, 333, 1000, 4099] {
                if let Some((parts, kc)) = cuda::split_depth(tiles, k, 132) {
                    assert!(parts >= 2 && kc % 16 == 0, "{tiles} {k}: {parts} x {kc}");
                    assert!(
                        (parts - 1) * kc < k && parts * kc >= k,
                        "{tiles} {k}: {parts} x {kc}"
                    );
                    assert!(tiles * parts <= 4 * 132);
                }
            }
        }
    }

    /// The fixed kernels compile wherever NVRTC is found (CI has none: then there is nothing to
    /// check here; the GPU machine's run checks them for real).
    #[test]
    fn fixed_kernels_compile() {
        if !nvrtc_present() {
            eprintln!("NVRTC not found: fixed kernels not compiled");
            return;
        }
        check_source("tumble_fixed", FIXED_SOURCE, "sm_90").unwrap();
        // A broken kernel is reported with the compiler's log, not a panic.
        let err = check_source("broken", "extern \"C\" __global__ void k() { x; }", "sm_90");
        assert!(matches!(err, Err(GpuError::Compile { .. })), "{err:?}");
    }
}
