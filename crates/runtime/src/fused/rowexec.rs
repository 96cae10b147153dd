//! Running row programs: binding a launch's operands (row pointers, shared vectors, scalars),
//! the per-row interpreter, and splitting rows across threads.

use std::borrow::Cow;
use std::sync::Arc;

use tumble_compile::plan::RowOperands;
use tumble_ops::OpValue;
use tumble_tensor::pool::{scratch_f32, with_capacity_f32};
use tumble_tensor::Tensor;

use super::rowprog::*;
use super::{Exec, FusedStats, RunPlan};
use crate::batched::BV;
use crate::fastmath;

/// An operand's rows for one launch, each `width` floats (`None` if it is not batched f32 rows).
pub(super) fn row_ptrs(v: &BV, width: usize) -> Option<Vec<&[f32]>> {
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

/// `rows` row views of width `width` that go through the rows of `data` again and again; `None`
/// unless `data` is a whole number of rows that divides `rows`.
fn repeated_rows(data: Option<&[f32]>, width: usize, rows: usize) -> Option<Vec<&[f32]>> {
    let data = data?;
    if width == 0 || data.is_empty() || data.len() % width != 0 {
        return None;
    }
    let own: Vec<&[f32]> = data.chunks_exact(width).collect();
    if rows % own.len() != 0 {
        return None;
    }
    Some(own.iter().copied().cycle().take(rows).collect())
}

/// The operands of one launch of a row program.
pub(super) struct Bound<'a, 'b> {
    pub(super) ext: Vec<Vec<&'a [f32]>>,
    /// Borrowed by the per-block and per-thread views of a launch's binding (only `ext` differs
    /// between them), owned by the binding itself.
    pub(super) shared: Cow<'b, [&'a [f32]]>,
    pub(super) scalars: Cow<'b, [f32]>,
}

/// Runs the row program of stage `s` (nodes `ns`), compiling it on first use of its operands'
/// signature; `None` when the fast path does not apply.
pub(super) fn row_program(
    ex: &Exec,
    rp: &RunPlan,
    s: usize,
    ns: &[usize],
    fstats: &mut FusedStats,
) -> Result<Option<Vec<(usize, BV)>>, String> {
    let empty = RowOperands::default();
    let ops = rp.plan.row_ops.get(s).unwrap_or(&empty);
    let vals = ops
        .vals
        .iter()
        .map(|v| ex.get_raw(v))
        .collect::<Result<Vec<_>, _>>()?;
    let sig: Vec<OpSig> = vals.iter().map(|v| sig_of(v)).collect();
    let prog = compiled_rows(ex, rp, s, ns, sig, fstats);
    match prog {
        Some(p) => run_rows(ex, &p, &vals),
        None => Ok(None),
    }
}

/// Binds a row program's operands for a launch of `rows` rows. `None` entries of `vals` are
/// operands bound later, block by block (a GEMM's output read in its epilogue): their row lists are
/// left empty. `None` when an operand does not fit the program (the stage falls back).
pub(super) fn bind<'v>(
    prog: &RowProg,
    vals: &[Option<&'v BV>],
    rows: usize,
) -> Option<Bound<'v, 'v>> {
    let mut ext = Vec::new();
    let mut shared = Vec::new();
    let mut scalars = Vec::new();
    for (o, v) in prog.held.iter().zip(vals) {
        match (o.src, v) {
            (Src::Ext(_), None) => ext.push(Vec::new()),
            // A shared matrix read as rows ([`super::rowprog::shared_rows_width`]): its rows
            // again for every instance.
            (Src::Ext(_), Some(BV::Shared(OpValue::Tensor(t)))) => {
                match repeated_rows(t.as_f32(), o.len, rows) {
                    Some(r) => ext.push(r),
                    None => return bail(3),
                }
            }
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
pub(super) fn flat_outs(prog: &RowProg) -> impl Iterator<Item = &Opd> {
    prog.outs.iter().flat_map(|(_, os, _)| os.iter())
}

/// The rows of a row program's launch: the batch, then the per-instance leading dims.
pub(super) fn row_lead(prog: &RowProg, b: usize) -> Vec<usize> {
    let mut lead = vec![b];
    lead.extend_from_slice(&prog.lead_tail);
    lead
}

/// The row program of stage `s` (nodes `ns`) for operands of signature `sig`: from the plan's
/// cache, or compiled now (and cached). `None` when these operands have no row program.
pub(super) fn compiled_rows(
    ex: &Exec,
    rp: &RunPlan,
    s: usize,
    ns: &[usize],
    sig: Vec<OpSig>,
    fstats: &mut FusedStats,
) -> Option<Arc<RowProg>> {
    let empty = RowOperands::default();
    let ops = rp.plan.row_ops.get(s).unwrap_or(&empty);
    let compile = |sig: &[OpSig], fstats: &mut FusedStats| {
        let t0 = std::time::Instant::now();
        let p = compile_rows(ex.block, ns, ops, sig, &rp.plan.live_out).map(Arc::new);
        if let Some(p) = &p {
            super::rowcuda::check_if_asked(p);
        }
        fstats.row_compiles += 1;
        fstats.row_compile_time += t0.elapsed();
        p
    };
    match &rp.row_cache {
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

pub(super) fn run_rows(
    ex: &Exec,
    prog: &RowProg,
    vals: &[Cow<BV>],
) -> Result<Option<Vec<(usize, BV)>>, String> {
    let lead = row_lead(prog, ex.b);
    let rows: usize = lead.iter().product();
    let vals: Vec<Option<&BV>> = vals.iter().map(|v| Some(&**v)).collect();
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
pub(super) fn assemble(
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
pub(super) fn run_rows_in_order(prog: &RowProg, bound: &Bound, rows: usize) -> Vec<Vec<f32>> {
    let outs: Vec<&Opd> = flat_outs(prog).collect();
    let mut bufs: Vec<Vec<f32>> = outs
        .iter()
        .map(|o| with_capacity_f32(rows * o.len))
        .collect();
    let mut scratch = vec![0f32; prog.scratch_len];
    for r in 0..rows {
        prefetch_ahead(bound, r);
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
pub(super) fn run_row_block(
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
    // The output the last instruction computes straight into its row, skipping the scratch
    // and the copy out (`RowProg::last_into`).
    let direct = prog.last_into.filter(|_| direct_outputs_enabled());
    let (body, last) = match direct {
        Some(_) => prog.instrs.split_at(prog.instrs.len().saturating_sub(1)),
        None => (prog.instrs.as_slice(), &[][..]),
    };
    let mut scratch = vec![0f32; prog.scratch_len];
    for r in 0..rows {
        prefetch_ahead(bound, r);
        for ins in body {
            exec(ins, r, bound, &mut scratch);
        }
        for (k, (o, out)) in flat_outs(prog).zip(outs.iter_mut()).enumerate() {
            let at = r * o.len;
            let Some(dst) = out.get_mut(at..at + o.len) else {
                continue;
            };
            match last.first() {
                Some(ins) if Some(k) == direct => {
                    let (d, _) = ins.dest();
                    exec_to(ins, r, bound, scratch.get(..d).unwrap_or(&[]), dst);
                }
                _ => read(o, r, bound, &scratch, dst),
            }
        }
    }
    Ok(())
}

/// How many rows ahead a row program prefetches its external operands.
const PREFETCH_ROWS_AHEAD: usize = 2;

/// Asks for row `r + PREFETCH_ROWS_AHEAD` of every external operand (rows lie where earlier
/// launches left them, scattered over megabytes).
fn prefetch_ahead(bound: &Bound, r: usize) {
    for e in &bound.ext {
        if let Some(ahead) = e.get(r + PREFETCH_ROWS_AHEAD) {
            crate::simd::prefetch(ahead);
        }
    }
}

/// Several threads: each runs a contiguous range of rows into its part of the outputs (every row
/// of which `run_row_block` writes, so they are not zero-filled first), on the kernels' helper
/// threads.
pub(super) fn run_rows_split(
    prog: &RowProg,
    bound: &Bound,
    rows: usize,
    threads: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let widths: Vec<usize> = flat_outs(prog).map(|o| o.len).collect();
    let mut bufs: Vec<Vec<f32>> = widths.iter().map(|w| scratch_f32(rows * w)).collect();
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
    super::split_parts(threads, parts, "row-program", |(start, n, mut mine)| {
        let block = Bound {
            ext: bound
                .ext
                .iter()
                .map(|e| e.get(start..start + n).unwrap_or(&[]).to_vec())
                .collect(),
            shared: Cow::Borrowed(&bound.shared),
            scalars: Cow::Borrowed(&bound.scalars),
        };
        run_row_block(prog, &block, n, &mut mine)
    })?;
    Ok(bufs)
}

/// Copies operand `o` of row `r` into `dst` (broadcasting a scalar).
pub(super) fn read(o: &Opd, r: usize, b: &Bound, scratch: &[f32], dst: &mut [f32]) {
    match o.src {
        Src::Scalar(s) => dst.fill(b.scalars.get(s).copied().unwrap_or(0.0)),
        _ => dst.copy_from_slice(slice(o, r, b, scratch)),
    }
}

pub(super) fn slice<'s>(o: &Opd, r: usize, b: &'s Bound, scratch: &'s [f32]) -> &'s [f32] {
    match o.src {
        Src::Ext(e) => &b.ext[e][r][o.off..o.off + o.len],
        Src::Shared(s) => &b.shared[s][o.off..o.off + o.len],
        Src::Scratch => &scratch[o.off..o.off + o.len],
        Src::Scalar(_) => &[],
    }
}

/// An operand's values in one row: a slice, or one value broadcast along the row.
pub(super) enum Vals<'s> {
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
pub(super) fn vals<'s>(o: &Opd, r: usize, b: &'s Bound, src: &'s [f32]) -> Vals<'s> {
    match o.src {
        Src::Scalar(s) => Vals::Splat(b.scalars.get(s).copied().unwrap_or(0.0)),
        _ if o.len == 1 => Vals::Splat(slice(o, r, b, src).first().copied().unwrap_or(0.0)),
        _ => Vals::Slice(slice(o, r, b, src)),
    }
}

/// Unary instruction `u` of `a` into `dst`: the row programs' functions, which `fastops` also
/// runs for these operators outside a row program ([`unary_f32`]), so both round alike.
fn unary(u: Un, dst: &mut [f32], av: &Vals) {
    match u {
        Un::Sigmoid => map1(dst, av, fastmath::sigmoid),
        Un::Tanh => map1(dst, av, fastmath::tanh),
        Un::Exp => map1(dst, av, fastmath::exp),
        Un::Log => map1(dst, av, f32::ln),
        Un::Sqrt => map1(dst, av, f32::sqrt),
        Un::Rsqrt => map1(dst, av, |x| 1.0 / x.sqrt()),
        Un::Abs => map1(dst, av, f32::abs),
        Un::Neg => map1(dst, av, |x| -x),
        // Not `x.max(0.0)`: that maps NaN to 0, where the reference (and PyTorch) keep NaN.
        Un::Relu => map1(dst, av, |x| if x < 0.0 { 0.0 } else { x }),
        Un::Copy => map1(dst, av, |x| x),
        // The reference's own function (in f64, rounded once): GELU as PyTorch exports it.
        Un::Erf => map1(dst, av, |x| libm::erf(f64::from(x)) as f32),
    }
}

/// Operator `name` of `x` into `out` (as long) with the row programs' own function, if it is one
/// of their unary instructions: for an operator run outside a row program (a stage that fell
/// back, a launch whose operands are all shared), so it rounds as the fused stage of a launch of
/// another size does.
pub(crate) fn unary_f32(name: &str, x: &[f32], out: &mut [f32]) -> bool {
    match Un::of(name) {
        Some(u) => {
            unary(u, out, &Vals::Slice(x));
            true
        }
        None => false,
    }
}

pub(super) fn map1(dst: &mut [f32], a: &Vals, f: impl Fn(f32) -> f32) {
    match a {
        Vals::Slice(s) => crate::simd::unary(dst, s, f),
        Vals::Splat(x) => dst.fill(f(*x)),
    }
}

pub(super) fn map2(dst: &mut [f32], a: &Vals, b: &Vals, f: impl Fn(f32, f32) -> f32) {
    match (a, b) {
        (Vals::Slice(x), Vals::Slice(y)) => crate::simd::binary(dst, x, y, f),
        (Vals::Slice(x), Vals::Splat(q)) => crate::simd::unary(dst, x, |p| f(p, *q)),
        (Vals::Splat(p), Vals::Slice(y)) => crate::simd::unary(dst, y, |q| f(*p, q)),
        (Vals::Splat(p), Vals::Splat(q)) => dst.fill(f(*p, *q)),
    }
}

pub(super) fn exec(ins: &Instr, r: usize, b: &Bound, scratch: &mut [f32]) {
    // Every instruction writes a fresh scratch range above all of its operands' ranges, so the
    // scratch splits into a read-only part (operands) and the destination.
    let (d, len) = ins.dest();
    let (src, rest) = scratch.split_at_mut(d);
    let Some(dst) = rest.get_mut(..len) else {
        return;
    };
    exec_to(ins, r, b, src, dst);
}

/// `TUMBLE_NO_DIRECT_ROW_OUTPUT=1` computes every row-program output in the scratch and copies
/// it out (the same values: only where the last instruction writes changes).
fn direct_outputs_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_DIRECT_ROW_OUTPUT")
}

/// Instruction `ins` for row `r`: operands from `src` (the scratch below its destination) and
/// the bound operands, results into `dst` (its destination's length).
fn exec_to(ins: &Instr, r: usize, b: &Bound, src: &[f32], dst: &mut [f32]) {
    let len = dst.len();
    match ins {
        Instr::Unary(u, _, a) => unary(*u, dst, &vals(a, r, b, src)),
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
                    |x, y| if x.is_nan() || x >= y { x } else { y },
                ),
                Bin::Min => map2(
                    dst,
                    &av,
                    &bv,
                    |x, y| if x.is_nan() || x <= y { x } else { y },
                ),
                // As the reference: in f64, rounded once (`x ** 3` of a GELU written out); a
                // square or cube by products (exact in f64 for a square, the cube's one f64
                // rounding as `powf`'s, both then rounded to f32 alike).
                Bin::Pow => match bv {
                    Vals::Splat(2.0) => map1(dst, &av, |x| {
                        let d = f64::from(x);
                        (d * d) as f32
                    }),
                    Vals::Splat(3.0) => map1(dst, &av, |x| {
                        let d = f64::from(x);
                        (d * d * d) as f32
                    }),
                    _ => map2(dst, &av, &bv, |x, y| f64::from(x).powf(f64::from(y)) as f32),
                },
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
        Instr::Softmax(_, a, log) => match vals(a, r, b, src) {
            Vals::Slice(x) if vector_reductions() => softmax_row(dst, x, *log),
            av => softmax_scalar(dst, &av, *log),
        },
        Instr::LayerNorm(_, a, g, be, eps) => {
            let av = vals(a, r, b, src);
            let n = len.max(1) as f64;
            let (mean, var) = match &av {
                Vals::Slice(x) if vector_reductions() => {
                    let mean = crate::simd::sum_f64(x) / n;
                    (mean, crate::simd::sum_sq_dev_f64(x, mean) / n)
                }
                _ => {
                    let mean = (0..len).map(|j| av.at(j) as f64).sum::<f64>() / n;
                    let var = (0..len)
                        .map(|j| (av.at(j) as f64 - mean).powi(2))
                        .sum::<f64>()
                        / n;
                    (mean, var)
                }
            };
            let inv = 1.0 / (var + *eps).sqrt();
            // `(x - mean) * inv * g + b` in f64, rounded once, as the reference: in f32 the mean
            // rounded shifted a row of 1000 ± 0.01 by 0.4% of its spread, `x - mean` overflowed
            // on rows of ±3e38, `inv` did on rows of 1e-39 with a zero epsilon, and rounding
            // before `* g` and again before `+ b` left 0 where `y * g + b` nearly cancels
            // (audits' finds).
            let gv = g.as_ref().map(|g| vals(g, r, b, src));
            let bv = be.as_ref().map(|be| vals(be, r, b, src));
            match (&av, &gv, &bv) {
                (Vals::Slice(x), Some(Vals::Slice(gs)), Some(Vals::Slice(bs))) => {
                    crate::simd::norm_affine(dst, x, mean, inv, gs, bs);
                }
                _ => {
                    for (j, o) in dst.iter_mut().enumerate() {
                        let mut y = (av.at(j) as f64 - mean) * inv;
                        if let Some(g) = &gv {
                            y *= g.at(j) as f64;
                        }
                        if let Some(bb) = &bv {
                            y += bb.at(j) as f64;
                        }
                        *o = y as f32;
                    }
                }
            }
        }
    }
}

/// `TUMBLE_SCALAR_ROW_REDUCTIONS=1`: softmax and layer norm rows reduce element by element (the
/// loops before the vector ones, kept to compare: the outputs are the same on the zoo).
fn vector_reductions() -> bool {
    !tumble_limits::switch_on!("TUMBLE_SCALAR_ROW_REDUCTIONS")
}

/// A softmax (or log-softmax) over one row, element by element: the maximum, `exp(x - max)` and
/// their sum in f64, then the scale (or the log-sum subtracted).
fn softmax_scalar(dst: &mut [f32], av: &Vals, log: bool) {
    let len = dst.len();
    let m = (0..len).map(|j| av.at(j)).fold(f32::NEG_INFINITY, f32::max);
    for (j, o) in dst.iter_mut().enumerate() {
        *o = fastmath::exp(av.at(j) - m);
    }
    let sum = |e: &[f32]| e.iter().map(|&v| v as f64).sum::<f64>();
    if log {
        let ls = log_sum(dst, (0..len).position(|j| av.at(j) == m), sum);
        for (j, o) in dst.iter_mut().enumerate() {
            *o = av.at(j) - m - ls;
        }
    } else {
        let inv = (1.0 / sum(dst)) as f32;
        dst.iter_mut().for_each(|o| *o *= inv);
    }
}

/// `ln Σ exps` of a row whose maximum's `exp` (1) is at `top`: the sum is `1 + s`, `s` the
/// others' sum, so `ln_1p(s)` as the reference (`log_sum_after_max`) — `ln` of the whole sum
/// lost the top element's log-probability below the sum's last bit. `exps` is scratch after.
fn log_sum(exps: &mut [f32], top: Option<usize>, sum: impl Fn(&[f32]) -> f64) -> f32 {
    match top.and_then(|t| exps.get_mut(t)) {
        Some(t) => {
            *t = 0.0;
            sum(exps).ln_1p() as f32
        }
        None => sum(exps).ln() as f32,
    }
}

/// [`softmax_scalar`] on the vector loops (attention's scores: 12% of Berxit-small's time
/// element by element).
pub(crate) fn softmax_row(dst: &mut [f32], x: &[f32], log: bool) {
    let m = crate::simd::max(x);
    crate::simd::unary(dst, x, |v| fastmath::exp(v - m));
    if log {
        let ls = log_sum(dst, x.iter().position(|&v| v == m), crate::simd::sum_f64);
        crate::simd::unary(dst, x, |v| v - m - ls);
    } else {
        let sum = crate::simd::sum_f64(dst);
        crate::simd::scale(dst, (1.0 / sum) as f32);
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
            last_into: None,
        }
    }

    /// The vector softmax gives the element-by-element one's bits at odd row lengths, for wide
    /// and narrow value ranges, log or not.
    #[test]
    fn vector_softmax_equals_the_scalar_one() {
        for n in [1usize, 3, 15, 16, 17, 33, 128, 129, 1000] {
            for scale in [0.1f32, 4.0, 60.0] {
                let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.73).sin() * scale).collect();
                for log in [false, true] {
                    let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
                    softmax_row(&mut got, &x, log);
                    softmax_scalar(&mut want, &Vals::Slice(&x), log);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "n {n} scale {scale} log {log}");
                }
            }
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

    /// `tanh(x) + x` with `tanh(x)` live too when `both`: the sum is the last instruction's
    /// destination.
    fn tanh_plus_program(w: usize, both: bool) -> RowProg {
        let x = Opd {
            src: Src::Ext(0),
            off: 0,
            len: w,
        };
        let t = Opd {
            src: Src::Scratch,
            off: 0,
            len: w,
        };
        let sum = Opd {
            src: Src::Scratch,
            off: w,
            len: w,
        };
        let instrs = vec![
            Instr::Unary(Un::Tanh, 0, x),
            Instr::Binary(Bin::Add, w, t, x),
        ];
        let mut outs = vec![(1, vec![sum], false)];
        if both {
            outs.insert(0, (0, vec![t], false));
        }
        let last_into = last_into(&instrs, &outs);
        RowProg {
            held: vec![x],
            lead_tail: Vec::new(),
            scratch_len: 2 * w,
            instrs,
            outs,
            last_into,
        }
    }

    #[test]
    fn the_last_instruction_writes_its_output_in_place_with_the_same_values() {
        for (rows, w, both) in [(1, 1, false), (7, 5, false), (33, 17, true), (3, 40, true)] {
            let prog = tanh_plus_program(w, both);
            assert_eq!(prog.last_into, Some(usize::from(both)));
            let rows_data: Vec<Vec<f32>> = (0..rows)
                .map(|r| (0..w).map(|c| (r * w + c) as f32 * 0.01 - 0.3).collect())
                .collect();
            let bound = Bound {
                ext: vec![rows_data.iter().map(Vec::as_slice).collect()],
                shared: Cow::Owned(Vec::new()),
                scalars: Cow::Owned(Vec::new()),
            };
            let nouts = prog.outs.len();
            let mut direct = vec![vec![f32::NAN; rows * w]; nouts];
            let mut refs: Vec<&mut [f32]> = direct.iter_mut().map(Vec::as_mut_slice).collect();
            run_row_block(&prog, &bound, rows, &mut refs).unwrap();
            // Through the scratch: the same program without the in-place output.
            let copied = RowProg {
                last_into: None,
                ..tanh_plus_program(w, both)
            };
            let mut via = vec![vec![f32::NAN; rows * w]; nouts];
            let mut refs: Vec<&mut [f32]> = via.iter_mut().map(Vec::as_mut_slice).collect();
            run_row_block(&copied, &bound, rows, &mut refs).unwrap();
            assert_eq!(direct, via, "rows {rows}, width {w}");
            let in_order = run_rows_in_order(&prog, &bound, rows);
            assert_eq!(direct, in_order);
            let x = rows_data[rows - 1][w - 1];
            assert_eq!(direct[nouts - 1][rows * w - 1], fastmath::tanh(x) + x);
        }
    }

    #[test]
    fn an_output_overlapping_the_last_destination_keeps_the_copy() {
        let w = 4;
        let mut prog = tanh_plus_program(w, false);
        // A second output viewing half of the sum.
        prog.outs.push((
            2,
            vec![Opd {
                src: Src::Scratch,
                off: w + 2,
                len: 2,
            }],
            false,
        ));
        assert_eq!(last_into(&prog.instrs, &prog.outs), None);
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
