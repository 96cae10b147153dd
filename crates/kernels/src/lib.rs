//! tumble's CPU kernels: f32 GEMM for batched `nn.dense`, with the gather of scattered inputs fused
//! into packing and the elementwise tail fused into the store (ACROBAT §5.2, DESIGN.md §2–3).
//!
//! The batching runtime runs `nn.dense(x, W) = x · Wᵀ` for a launch of `B` invocations. Each row of
//! `x` is one invocation's input and lives wherever an earlier launch put it; `W` is a constant
//! `(N, K)` weight. [`dense`] reads the rows through [`Rows::Gathered`] directly while packing
//! (no gather copy), multiplies with a [`PackedWeight`] prepared once, and hands each finished
//! block of output rows to an [`Epilogue`] (bias, activations, a whole fused row program) while it
//! is still in cache. [`dense_accumulate`] does the same for a dense over a concatenation without
//! materializing the concatenation.
//!
//! Engine: GotoBLAS/BLIS-style blocking over run-time-selected micro-kernels (AVX-512 14×32,
//! AVX2+FMA 6×16, portable 4×16; see [`cpu_features`] and [`KernelKind`]), a small-M variant
//! for GEMV-like launches, and a rayon split over rows or weight columns. Every input is
//! validated first; size mismatches are returned as [`KernelError`], never panicked on.
//!
//! ```
//! use tumble_kernels::{dense, NoEpilogue, PackedWeight, Rows};
//! let w = PackedWeight::pack(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3, 2).unwrap(); // W: 3×2
//! let (r0, r1) = ([1.0f32, 1.0], [0.0f32, 2.0]);
//! let rows: [&[f32]; 2] = [&r1, &r0]; // scattered rows, any order
//! let mut c = vec![0.0; 2 * 3];
//! dense(&Rows::Gathered(&rows), &w, &mut c, &NoEpilogue, 1).unwrap();
//! assert_eq!(c, [4.0, 8.0, 12.0, 3.0, 7.0, 11.0]);
//! ```

mod act;
mod driver;
mod error;
mod kernel;
mod narrow;
mod pack;

pub use act::{sigmoid_in_place, tanh_in_place, Activation, BiasActivation};
pub use driver::{run_tasks, set_tuning, tuning, Tuning};
pub use error::KernelError;
pub use kernel::KernelKind;
pub use narrow::{dot_rows, set_narrow_products};
pub use pack::{PackedRows, PackedWeight};

use driver::Part;
use pack::RowSource;
use std::ops::Range;

/// The A operand: `M` rows of `K` floats.
///
/// `M` is the number of output rows: for [`Rows::Gathered`] it is the number of row slices (and
/// must equal `c.len() / N`); for [`Rows::Contiguous`] it is taken from `c.len() / N`.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// Row `i` is `data[i * stride .. i * stride + K]`. Requires `stride >= K` and
    /// `data.len() >= (M - 1) * stride + K`.
    Contiguous {
        /// The rows, `stride` floats apart.
        data: &'a [f32],
        /// Distance between row starts, in floats.
        stride: usize,
    },
    /// Row `i` is `rows[i]`, which must have exactly `K` floats. Rows may live anywhere, in any
    /// order, and may alias (the same slice used for several rows).
    Gathered(&'a [&'a [f32]]),
    /// A's columns: `cols[p]` is column `p` (exactly `M` floats), so row `i` is `(cols[0][i],
    /// .., cols[K-1][i])` — the transpose of row-major data without transposing it (`dW = dYᵀ·X`
    /// reads the rows of dY as the columns of dYᵀ). Each step of K packs one run of a column.
    /// Not taken by the narrow-product path (it reads whole rows).
    Columns(&'a [&'a [f32]]),
    /// A packed once for many products ([`PackedRows::pack`]): its `M` rows of `K` floats, whose
    /// micro-panels the products read where they lie instead of packing A at every call (the
    /// same bits as [`Rows::Contiguous`] over the data it was packed from).
    Packed(&'a PackedRows),
}

/// Called once per block of finished output rows, while they are hot in cache: `rows` is the range
/// of output row indices, `out` the `rows.len() × N` slice (row-major, stride `N`) — e.g. add bias,
/// apply tanh, or a whole fused row program.
///
/// Every output row is passed exactly once per call of [`dense`]/[`dense_accumulate`], in blocks
/// whose size and order are unspecified (blocks may be processed concurrently on several
/// threads, hence `Sync`). Closures `Fn(Range<usize>, &mut [f32]) + Sync` are epilogues.
pub trait Epilogue: Sync {
    /// Post-process output rows `rows` (held in `out`, `rows.len() * N` floats).
    fn rows(&self, rows: Range<usize>, out: &mut [f32]);
}

impl<F: Fn(Range<usize>, &mut [f32]) + Sync> Epilogue for F {
    fn rows(&self, rows: Range<usize>, out: &mut [f32]) {
        self(rows, out)
    }
}

/// An epilogue that also writes outputs of its own: for each block of finished rows it gets the
/// block of C and, for every output given to [`dense_into`], that output's rows of the block
/// (`rows.len() × width` floats each, in the order the outputs were given). A fused row program
/// reads C while it is in cache and writes the block's results straight to their final place, so
/// C itself can be scratch.
///
/// The same guarantees as [`Epilogue`]: every row exactly once, blocks in unspecified order,
/// possibly concurrently.
pub trait EpilogueInto: Sync {
    /// Post-process output rows `rows`: `c` holds them (`rows.len() * N` floats), `outputs[i]`
    /// is output `i`'s part for them.
    fn rows(&self, rows: Range<usize>, c: &mut [f32], outputs: &mut [&mut [f32]]);
}

impl<F: Fn(Range<usize>, &mut [f32], &mut [&mut [f32]]) + Sync> EpilogueInto for F {
    fn rows(&self, rows: Range<usize>, c: &mut [f32], outputs: &mut [&mut [f32]]) {
        self(rows, c, outputs)
    }
}

/// A plain [`Epilogue`] seen as an [`EpilogueInto`] without outputs.
struct Plain<'a>(&'a dyn Epilogue);

impl EpilogueInto for Plain<'_> {
    fn rows(&self, rows: Range<usize>, c: &mut [f32], _outputs: &mut [&mut [f32]]) {
        self.0.rows(rows, c)
    }
}

/// An output written by an [`EpilogueInto`]: `M` rows of `width` floats.
#[derive(Debug)]
pub struct Output<'a> {
    /// The rows, contiguous (`M * width` floats).
    pub data: &'a mut [f32],
    /// Floats per row.
    pub width: usize,
}

/// The epilogue that leaves the product as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEpilogue;

impl Epilogue for NoEpilogue {
    fn rows(&self, _rows: Range<usize>, _out: &mut [f32]) {}
}

/// `C (M, N)` row-major `= A · Wᵀ`, then `epilogue` on every block of finished rows.
/// `c.len()` must be `M * N`; `threads` is the most threads to use (0 is taken as 1; small launches
/// use one). Errors (not panics) on any size mismatch.
pub fn dense(
    a: &Rows,
    w: &PackedWeight,
    c: &mut [f32],
    epilogue: &dyn Epilogue,
    threads: usize,
) -> Result<(), KernelError> {
    dense_accumulate_with(KernelKind::selected(), &[(a, w)], c, epilogue, threads)
}

/// [`dense`] for a dense over a concatenation: `C = Σ_i A_i · W_iᵀ`, where the `W_i` are column
/// blocks of one weight — so `dense(concat(x1, x2), W)` never materializes the concatenation. The
/// parts are accumulated into `c`, which is overwritten (its previous contents are ignored), then
/// the epilogue runs once per row. All parts must share `N` and `M`; each has its own `K_i`.
pub fn dense_accumulate(
    parts: &[(&Rows, &PackedWeight)],
    c: &mut [f32],
    epilogue: &dyn Epilogue,
    threads: usize,
) -> Result<(), KernelError> {
    dense_accumulate_with(KernelKind::selected(), parts, c, epilogue, threads)
}

/// [`dense`] with an explicit micro-kernel family (for tests and benchmarks). Errors with
/// [`KernelError::Unsupported`] when the CPU cannot run it.
pub fn dense_with(
    kind: KernelKind,
    a: &Rows,
    w: &PackedWeight,
    c: &mut [f32],
    epilogue: &dyn Epilogue,
    threads: usize,
) -> Result<(), KernelError> {
    dense_accumulate_with(kind, &[(a, w)], c, epilogue, threads)
}

/// [`dense_accumulate`] with an explicit micro-kernel family.
pub fn dense_accumulate_with(
    kind: KernelKind,
    parts: &[(&Rows, &PackedWeight)],
    c: &mut [f32],
    epilogue: &dyn Epilogue,
    threads: usize,
) -> Result<(), KernelError> {
    dense_into_with(kind, parts, c, &mut [], &Plain(epilogue), threads)
}

/// [`dense_accumulate`] with an epilogue that writes `outputs` (each `M × width`, `M` the rows of
/// C) as it goes: `C = Σ_i A_i · W_iᵀ`, then for every block of rows
/// `epilogue(rows, C block, [output blocks])`. Errors when an output's length is not `M * width`.
pub fn dense_into(
    parts: &[(&Rows, &PackedWeight)],
    c: &mut [f32],
    outputs: &mut [Output<'_>],
    epilogue: &dyn EpilogueInto,
    threads: usize,
) -> Result<(), KernelError> {
    dense_into_with(KernelKind::selected(), parts, c, outputs, epilogue, threads)
}

/// [`dense_into`] with an explicit micro-kernel family.
pub fn dense_into_with(
    kind: KernelKind,
    parts: &[(&Rows, &PackedWeight)],
    c: &mut [f32],
    outputs: &mut [Output<'_>],
    epilogue: &dyn EpilogueInto,
    threads: usize,
) -> Result<(), KernelError> {
    let kernel = kind.kernel()?;
    let (m, n, parts) = validate(parts, c)?;
    for (i, o) in outputs.iter().enumerate() {
        let want = m.checked_mul(o.width).ok_or(KernelError::Overflow)?;
        if o.data.len() != want {
            return Err(KernelError::Length {
                what: format!("output {i} (M × width = {m} × {})", o.width),
                expected: want,
                actual: o.data.len(),
            });
        }
    }
    let mut outs: Vec<(&mut [f32], usize)> = outputs
        .iter_mut()
        .map(|o| (&mut *o.data, o.width))
        .collect();
    if m > 0 && narrow::applies(&parts, n) {
        narrow::run(kind, &parts, m, n, c, &mut outs, epilogue);
    } else {
        driver::run(&kernel, &parts, m, n, c, &mut outs, epilogue, threads);
    }
    Ok(())
}

/// The most threads a product is split over; counts above it are taken as it (the CLI and the
/// API refuse them with a message).
pub const MAX_THREADS: usize = 4096;

/// Rows after which [`dense_into`]'s blocking starts afresh for a weight of `weight_bytes` (on
/// this machine's kernel): a caller that runs a launch in row chunks (to keep its scratch C
/// small) and makes them multiples of this streams the weight no more often than one call would.
pub fn row_unit(weight_bytes: usize) -> usize {
    KernelKind::selected()
        .kernel()
        .map_or(64, |k| driver::row_unit(&k, weight_bytes))
}

/// Runs `tasks` on up to `threads` participants — the calling thread and the helper threads this
/// crate's products run on — each taking the next task until none are left. For a launch's other
/// work split across threads (row programs, attention, per-invocation products): a thread made
/// per launch cost its start and, in a process's first launches, the new thread's stack and
/// allocator pages faulted in.
pub fn run_parallel<T: Send>(threads: usize, tasks: Vec<T>, f: impl Fn(T) + Sync) {
    driver::run_tasks(threads, tasks, f);
}

/// Which micro-kernel [`dense`] uses on this machine: `"avx512"`, `"avx2+fma"` or `"portable"`.
pub fn cpu_features() -> &'static str {
    KernelKind::selected().name()
}

/// Check every length; return `(M, N, parts)`.
fn validate<'a>(
    parts: &[(&Rows<'a>, &'a PackedWeight)],
    c: &[f32],
) -> Result<(usize, usize, Vec<Part<'a>>), KernelError> {
    let Some(&(_, w0)) = parts.first() else {
        return Err(KernelError::Shape(
            "dense_accumulate needs at least one part".into(),
        ));
    };
    let n = w0.n();
    for (i, (_, w)) in parts.iter().enumerate() {
        if w.n() != n {
            return Err(KernelError::Shape(format!(
                "part {i} has N = {}, part 0 has N = {n}",
                w.n()
            )));
        }
    }
    let m = if n == 0 {
        if !c.is_empty() {
            return Err(KernelError::Length {
                what: "c (N = 0)".into(),
                expected: 0,
                actual: c.len(),
            });
        }
        // N = 0: nothing to compute; M only matters for gathered operands' consistency.
        parts
            .iter()
            .find_map(|(a, _)| match a {
                Rows::Gathered(r) => Some(r.len()),
                Rows::Columns(cols) => cols.first().map(|c| c.len()),
                Rows::Packed(p) => Some(p.m()),
                Rows::Contiguous { .. } => None,
            })
            .unwrap_or(0)
    } else {
        if !c.len().is_multiple_of(n) {
            return Err(KernelError::Length {
                what: format!("c (a multiple of N = {n})"),
                expected: c.len().next_multiple_of(n),
                actual: c.len(),
            });
        }
        c.len() / n
    };
    let mut out = Vec::with_capacity(parts.len());
    for (i, &(a, w)) in parts.iter().enumerate() {
        let k = w.k();
        let src = match *a {
            Rows::Gathered(rows) => {
                if rows.len() != m {
                    return Err(KernelError::Shape(format!(
                        "part {i}: {} gathered rows but c has {m} rows",
                        rows.len()
                    )));
                }
                for (r, row) in rows.iter().enumerate() {
                    if row.len() != k {
                        return Err(KernelError::Length {
                            what: format!("part {i}: gathered row {r} (K)"),
                            expected: k,
                            actual: row.len(),
                        });
                    }
                }
                RowSource::Gathered(rows)
            }
            Rows::Columns(cols) => {
                if cols.len() != k {
                    return Err(KernelError::Shape(format!(
                        "part {i}: {} columns but the weight has K = {k}",
                        cols.len()
                    )));
                }
                for (p, col) in cols.iter().enumerate() {
                    if col.len() != m {
                        return Err(KernelError::Length {
                            what: format!("part {i}: column {p} (M)"),
                            expected: m,
                            actual: col.len(),
                        });
                    }
                }
                RowSource::Columns(cols)
            }
            Rows::Packed(p) => {
                if p.m() != m || p.k() != k {
                    return Err(KernelError::Shape(format!(
                        "part {i}: A packed as {} × {} for a product of {m} rows and K = {k}",
                        p.m(),
                        p.k()
                    )));
                }
                RowSource::Packed(p)
            }
            Rows::Contiguous { data, stride } => {
                if stride < k {
                    return Err(KernelError::Shape(format!(
                        "part {i}: stride {stride} < K = {k}"
                    )));
                }
                let need = if m == 0 {
                    0
                } else {
                    (m - 1)
                        .checked_mul(stride)
                        .and_then(|x| x.checked_add(k))
                        .ok_or(KernelError::Overflow)?
                };
                if data.len() < need {
                    return Err(KernelError::Length {
                        what: format!("part {i}: contiguous A data (at least)"),
                        expected: need,
                        actual: data.len(),
                    });
                }
                RowSource::Contiguous { data, stride }
            }
        };
        out.push(Part { a: src, w });
    }
    Ok((m, n, out))
}
