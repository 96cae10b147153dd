//! Row programs as CUDA kernels: the same compiled [`RowProg`] the CPU interprets row by row,
//! written out as CUDA C++ for NVRTC.
//!
//! One thread block per row; the program's per-row scratch in shared memory (or, past
//! [`MAX_SHARED_SCRATCH`] floats, a global buffer of `rows × scratch_len`); each instruction a
//! loop over its elements strided by the block's threads, then a barrier; softmax and layer norm
//! reduce across the block with warp shuffles. The parameter list, in order: per operand of
//! `prog.held`, a batched operand's pointer and row stride (`const float*, int`), a shared
//! vector's pointer, a shared scalar by value; per flat output (`prog.outs`' fields in order) a
//! pointer to `rows × len` floats; the row count; then, with global scratch, its pointer.

use std::fmt::Write;

use super::rowprog::{Bin, Instr, Opd, RowProg, Src, Un};

/// Scratch floats kept in shared memory (48 KiB is every device's default limit per block; the
/// reductions take 33 floats more).
pub(super) const MAX_SHARED_SCRATCH: usize = 11 * 1024;

/// A generated row-program kernel and how to launch it.
pub(super) struct RowKernel {
    pub name: String,
    pub source: String,
    pub threads: u32,
    pub shared_bytes: u32,
    pub global_scratch: bool,
}

const PRELUDE: &str = r#"
__device__ __forceinline__ float tb_reduce(float v, float* red, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        v = l < nw ? red[l] : (is_max ? -__int_as_float(0x7f800000) : 0.f);
        for (int o = 16; o > 0; o >>= 1) {
            const float u = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? fmaxf(v, u) : v + u;
        }
        if (l == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];
}
"#;

/// An f32 constant as a CUDA expression that denotes exactly it.
fn lit(x: f32) -> String {
    if x.is_finite() {
        format!("{x:e}f")
    } else {
        format!("__int_as_float(0x{:08x})", x.to_bits())
    }
}

/// Names of a program's operands by their `Src` numbering.
struct Names {
    ext: Vec<usize>,
    shared: Vec<usize>,
    scalar: Vec<usize>,
}

impl Names {
    fn of(prog: &RowProg) -> Names {
        let mut n = Names {
            ext: Vec::new(),
            shared: Vec::new(),
            scalar: Vec::new(),
        };
        for (h, o) in prog.held.iter().enumerate() {
            let (list, k) = match o.src {
                Src::Ext(k) => (&mut n.ext, k),
                Src::Shared(k) => (&mut n.shared, k),
                Src::Scalar(k) => (&mut n.scalar, k),
                Src::Scratch => continue,
            };
            if list.len() <= k {
                list.resize(k + 1, usize::MAX);
            }
            list[k] = h;
        }
        n
    }

    /// Element `idx` (a C expression) of operand `o`; `idx` is ignored for a one-element operand
    /// (broadcast).
    fn read(&self, o: &Opd, idx: &str) -> String {
        let idx = if o.len == 1 { "0" } else { idx };
        let at = |k: usize, list: &[usize]| list.get(k).copied().unwrap_or(usize::MAX);
        match o.src {
            Src::Ext(k) => {
                let h = at(k, &self.ext);
                format!("x{h}[(size_t)row * ld{h} + {} + ({idx})]", o.off)
            }
            Src::Shared(k) => format!("x{}[{} + ({idx})]", at(k, &self.shared), o.off),
            Src::Scalar(k) => format!("x{}", at(k, &self.scalar)),
            Src::Scratch => format!("s[{} + ({idx})]", o.off),
        }
    }
}

fn unary(u: Un, v: &str) -> String {
    match u {
        // As the CPU's: e^x / (1 + e^x) for negative x, where e^-x overflows from -88.7 on.
        Un::Sigmoid => {
            format!("(({v}) < 0.f ? expf({v}) / (1.f + expf({v})) : 1.f / (1.f + expf(-({v}))))")
        }
        Un::Tanh => format!("tanhf({v})"),
        Un::Exp => format!("expf({v})"),
        Un::Log => format!("logf({v})"),
        Un::Sqrt => format!("sqrtf({v})"),
        Un::Rsqrt => format!("rsqrtf({v})"),
        Un::Abs => format!("fabsf({v})"),
        Un::Neg => format!("-({v})"),
        // NaN stays NaN, as the reference's (fmaxf would drop it).
        Un::Relu => format!("(({v}) < 0.f ? 0.f : ({v}))"),
        Un::Copy => v.to_string(),
        Un::Erf => format!("erff({v})"),
    }
}

fn binary(op: Bin, a: &str, b: &str) -> String {
    match op {
        Bin::Add => format!("{a} + {b}"),
        Bin::Sub => format!("{a} - {b}"),
        Bin::Mul => format!("{a} * {b}"),
        Bin::Div => format!("{a} / {b}"),
        // NaN propagates and a tie gives the first operand, as the reference's (numpy's).
        Bin::Max => format!("((isnan({a}) || ({a}) >= ({b})) ? ({a}) : ({b}))"),
        Bin::Min => format!("((isnan({a}) || ({a}) <= ({b})) ? ({a}) : ({b}))"),
        Bin::Pow => format!("powf({a}, {b})"),
    }
}

/// `for` over `len` elements, strided by the block's threads.
fn each(out: &mut String, len: usize, body: &str) {
    let _ = writeln!(
        out,
        "    for (int j = threadIdx.x; j < {len}; j += blockDim.x) {{ {body} }}"
    );
}

/// The CUDA kernel of `prog`.
pub(super) fn row_kernel(prog: &RowProg) -> RowKernel {
    let names = Names::of(prog);
    let global_scratch = prog.scratch_len > MAX_SHARED_SCRATCH;
    let mut params = Vec::new();
    for (h, o) in prog.held.iter().enumerate() {
        match o.src {
            Src::Ext(_) => {
                params.push(format!("const float* __restrict__ x{h}"));
                params.push(format!("int ld{h}"));
            }
            Src::Shared(_) => params.push(format!("const float* __restrict__ x{h}")),
            Src::Scalar(_) => params.push(format!("float x{h}")),
            Src::Scratch => {}
        }
    }
    let flat: Vec<&Opd> = prog.outs.iter().flat_map(|(_, os, _)| os.iter()).collect();
    for k in 0..flat.len() {
        params.push(format!("float* __restrict__ o{k}"));
    }
    params.push("int rows".into());
    if global_scratch {
        params.push("float* __restrict__ gs".into());
    }
    let mut body = String::new();
    for ins in &prog.instrs {
        match ins {
            Instr::Unary(u, d, a) => {
                let e = unary(*u, &names.read(a, "j"));
                each(&mut body, a.len, &format!("s[{d} + j] = {e};"));
            }
            Instr::Binary(op, d, a, b) => {
                let len = a.len.max(b.len);
                let e = binary(*op, &names.read(a, "j"), &names.read(b, "j"));
                each(&mut body, len, &format!("s[{d} + j] = {e};"));
            }
            Instr::Clip(d, a, lo, hi) => {
                let x = names.read(a, "j");
                let e = format!(
                    "(isnan({x}) ? ({x}) : fminf(fmaxf({x}, {}), {}))",
                    lit(*lo),
                    lit(*hi)
                );
                each(&mut body, a.len, &format!("s[{d} + j] = {e};"));
            }
            Instr::Concat(d, parts) => {
                let mut at = *d;
                for p in parts {
                    let e = names.read(p, "j");
                    each(&mut body, p.len, &format!("s[{at} + j] = {e};"));
                    at += p.len;
                }
            }
            Instr::Softmax(d, a, log) => {
                let x = names.read(a, "j");
                let _ = writeln!(body, "    {{");
                let _ = writeln!(body, "    float m = -__int_as_float(0x7f800000);");
                each(&mut body, a.len, &format!("m = fmaxf(m, {x});"));
                let _ = writeln!(body, "    m = tb_reduce(m, red, true);");
                let _ = writeln!(body, "    float t = 0.f;");
                each(&mut body, a.len, &format!("t += expf({x} - m);"));
                let _ = writeln!(body, "    t = tb_reduce(t, red, false);");
                let e = match log {
                    true => format!("{x} - m - logf(t)"),
                    false => format!("expf({x} - m) / t"),
                };
                each(&mut body, a.len, &format!("s[{d} + j] = {e};"));
                let _ = writeln!(body, "    }}");
            }
            Instr::LayerNorm(d, a, g, be, eps) => {
                let x = names.read(a, "j");
                let n = lit(a.len as f32);
                let _ = writeln!(body, "    {{");
                let _ = writeln!(body, "    float t = 0.f;");
                each(&mut body, a.len, &format!("t += {x};"));
                let _ = writeln!(
                    body,
                    "    const float mean = tb_reduce(t, red, false) / {n};"
                );
                let _ = writeln!(body, "    float q = 0.f;");
                each(
                    &mut body,
                    a.len,
                    &format!("const float c = {x} - mean; q += c * c;"),
                );
                let _ = writeln!(
                    body,
                    "    const float inv = 1.f / sqrtf(tb_reduce(q, red, false) / {n} + {});",
                    lit(*eps as f32)
                );
                let mut e = format!("({x} - mean) * inv");
                if let Some(g) = g {
                    e = format!("{e} * {}", names.read(g, "j"));
                }
                if let Some(be) = be {
                    e = format!("{e} + {}", names.read(be, "j"));
                }
                each(&mut body, a.len, &format!("s[{d} + j] = {e};"));
                let _ = writeln!(body, "    }}");
            }
        }
        let _ = writeln!(body, "    __syncthreads();");
    }
    for (k, o) in flat.iter().enumerate() {
        let e = names.read(o, "j");
        each(
            &mut body,
            o.len,
            &format!("o{k}[(size_t)row * {} + j] = {e};", o.len),
        );
    }
    let widest = prog
        .instrs
        .iter()
        .map(|i| i.dest().1)
        .chain(flat.iter().map(|o| o.len))
        .max()
        .unwrap_or(1);
    let threads = (widest.div_ceil(32) * 32).clamp(32, 256) as u32;
    let scratch = match global_scratch {
        true => format!("    float* s = gs + (size_t)row * {};\n", prog.scratch_len),
        false => "    extern __shared__ float s[];\n".to_string(),
    };
    let shared_bytes = match global_scratch {
        true => 0,
        false => (prog.scratch_len.max(1) * 4) as u32,
    };
    let mut source = String::from(PRELUDE);
    // The name is the program's own text: equal programs share one compiled kernel.
    let name = "tumble_rows";
    let _ = write!(
        source,
        "extern \"C\" __global__ void {name}({}) {{\n    const int row = blockIdx.x;\n    if (row >= rows) return;\n    __shared__ float red[33];\n{scratch}{body}}}\n",
        params.join(", ")
    );
    RowKernel {
        name: name.to_string(),
        source,
        threads,
        shared_bytes,
        global_scratch,
    }
}

/// `TUMBLE_CHECK_CUDA_ROWS=1` (development, on a machine with NVRTC and no GPU): every row program
/// the CPU compiles is also written as CUDA and compiled by NVRTC, and a kernel NVRTC rejects is
/// reported on stderr (`CUDA row kernel rejected`), so the test suites check the generator over
/// every program they run.
pub(super) fn check_if_asked(prog: &RowProg) {
    if !tumble_limits::switch_on!("TUMBLE_CHECK_CUDA_ROWS") {
        return;
    }
    let k = row_kernel(prog);
    match tumble_cuda::check_source(&k.name, &k.source, "sm_90") {
        Ok(()) => eprintln!("CUDA row kernel compiled"),
        Err(e) => eprintln!("CUDA row kernel rejected: {e}\n{}", k.source),
    }
}
