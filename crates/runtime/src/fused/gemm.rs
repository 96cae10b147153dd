//! GEMM stages: dense, horizontally fused dense, direct products (`X · [A; B]`), and GEMMs
//! whose following row program runs as their epilogue.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;

use tumble_compile::plan::{RowOperands, ValKey};
use tumble_compile::{BArg, BVal, Block};
use tumble_ops::OpValue;
use tumble_tensor::pool::{scratch_f32, with_capacity_f32, zeroed_f32};
use tumble_tensor::Tensor;

use std::sync::Arc;

use tumble_kernels::{PackedWeight, Rows};

use super::rowexec::*;
use super::rowprog::*;
use super::{Exec, FusedStats, RunPlan};
use crate::batched::{LaunchOps, BV};

/// Dense node `i` as a dense stage, or through the batching rules when the launch's operands do
/// not fit one (counted as a fallback).
pub(super) fn run_dense(
    ex: &mut Exec,
    i: usize,
    ops: &mut LaunchOps,
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
            ex.run_node(i, ops)
        }
    }
}

/// `nn.dense` of batched f32 rows with a shared f32 weight: one product for the whole launch.
pub(super) fn dense_stage(ex: &Exec, i: usize) -> Result<Option<(BV, u64)>, String> {
    let node = ex.block.nodes.get(i).ok_or("internal: node")?;
    let (Some(BArg::One(av)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1)) else {
        return Ok(None);
    };
    // As it lies: per-invocation weights are read in place, not stacked (MV-RNN's word matrices).
    let w = ex.get_raw(wv)?;
    if let BV::Shared(OpValue::Tensor(w)) = &*w {
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
    // One product per invocation against its own weight (`gemm::small_product`: the GEMM
    // kernel for attention's Q·Kᵀ written as a dense, dot products for MV-RNN's single rows).
    let mut c = zeroed_f32(b * m * n);
    crate::gemm::small_products(b, m * n, m * n * k, ex.threads, &mut c, |inst, ci| {
        let xo = if x_batched { inst * m * k } else { 0 };
        let (Some(xi), Some(wi)) = (xd.get(xo..xo + m * k), w_inst.get(inst)) else {
            return Err("internal: per-invocation product operand too short".into());
        };
        crate::gemm::small_product(xi, m, k, wi, n, true, ci)
    })?;
    let t = Tensor::from_f32(vec![b, m, n], c).map_err(|e| e.to_string())?;
    Ok(Some((
        BV::Batched(OpValue::Tensor(t)),
        2 * (b * m * n * k) as u64,
    )))
}

/// Each of `b` invocations' f32 data of value `v`, in place, with the per-invocation shape: a
/// shared tensor (the same slice for all), a batch (its rows) or row references. `None` for other
/// dtypes or a batch of another size.
pub(super) fn invocation_parts(v: &BV, b: usize) -> Option<(&[usize], Vec<&[f32]>)> {
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
pub(super) fn matmul_stage(
    ex: &Exec,
    dense: usize,
    transpose: usize,
    concat: Option<usize>,
) -> Result<Option<(BV, u64)>, String> {
    let node = ex.block.nodes.get(dense).ok_or("internal: node")?;
    let Some(BArg::One(xv)) = node.args.first() else {
        return Ok(None);
    };
    let x = match &*ex.get_raw(xv)? {
        BV::Shared(OpValue::Tensor(x)) => x.clone(),
        _ => return Ok(None),
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
    let vals: Vec<Cow<BV>> = part_vals
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
    // Each invocation's block is overwritten whole by its GEMM.
    let mut c = scratch_f32(b * m * n);
    // X is the same for every invocation and every launch: packed as A once per job.
    let x_packed = match crate::gemm::prepacked_a_enabled() {
        true => Some(crate::gemm::packed_rows(&x, m, k)?),
        false => None,
    };
    let a = match &x_packed {
        Some(p) => tumble_kernels::Rows::Packed(p),
        None => tumble_kernels::Rows::Contiguous {
            data: xd,
            stride: k,
        },
    };
    let mut y_rows: Vec<&[f32]> = Vec::with_capacity(k);
    // The panels of the last such product on this thread, packed over again rather than allocated
    // and zeroed anew: MV-RNN runs one launch per node, each packing a 256 × 128 weight.
    let mut packed = MATMUL_PACK.with(|p| p.take());
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
    // (Not kept past 4 MiB: the memory budget does not see this buffer.)
    let packed = packed.filter(|w| w.n() * w.k() <= 1 << 20);
    MATMUL_PACK.with(|p| p.set(packed));
    let t = Tensor::from_f32(vec![b, m, n], c).map_err(|e| e.to_string())?;
    Ok(Some((
        BV::Batched(OpValue::Tensor(t)),
        2 * (b * m * n * k) as u64,
    )))
}

thread_local! {
    /// The packed per-invocation weight `matmul_stage` last used on this thread (see there).
    static MATMUL_PACK: std::cell::Cell<Option<tumble_kernels::PackedWeight>> =
        const { std::cell::Cell::new(None) };
}

/// Rows of a shared left operand from which swapping the operands of a per-invocation-weight dense
/// into one GEMM pays (below, the products are matrix-vector and dot products are as good).
pub(super) const SWAP_MIN_ROWS: usize = 8;

/// A GEMM's rows operand as it lies (borrowed from the launch) and its shared weights.
type SharedWeightOperands<'e> = (Cow<'e, BV>, Vec<Tensor>);

/// The members of a GEMM over denses `ns` (one, or a horizontally fused group): the rows value
/// they all read and each one's weight value, from the block alone. `None` when some member
/// reads other rows.
pub(super) fn product_members<'b>(
    block: &'b Block,
    ns: &[usize],
) -> Result<Option<(&'b BVal, Vec<&'b BVal>)>, String> {
    let mut a_val: Option<&BVal> = None;
    let mut ws = Vec::with_capacity(ns.len());
    for &i in ns {
        let node = block.nodes.get(i).ok_or("internal: node")?;
        let (Some(BArg::One(av)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1))
        else {
            return Ok(None);
        };
        match a_val {
            None => a_val = Some(av),
            Some(prev) if ValKey::of(prev) == ValKey::of(av) => {}
            Some(_) => return Ok(None),
        }
        ws.push(wv);
    }
    Ok(a_val.map(|a| (a, ws)))
}

/// The operands of a GEMM over denses `ns` that all read the same rows with shared f32 weights
/// `(N_i, K)`: the rows value as it lies (row lists included), and the weights. `None` when some
/// member reads other rows or has a weight that is not shared.
pub(super) fn shared_weight_operands<'e>(
    ex: &'e Exec,
    ns: &[usize],
) -> Result<Option<SharedWeightOperands<'e>>, String> {
    let Some((av, wvs)) = product_members(ex.block, ns)? else {
        return Ok(None);
    };
    let mut ws: Vec<Tensor> = Vec::with_capacity(wvs.len());
    for wv in wvs {
        // As it lies: a per-invocation weight (row references into a stack of experts' weights,
        // `take(%Ws, %e)`) is not one, and stacking its rows only to find that out copied every
        // invocation's matrix (a mixture of experts: 1 GB per launch).
        match &*ex.get_raw(wv)? {
            BV::Shared(OpValue::Tensor(w)) if w.as_f32().is_some() && w.rank() == 2 => {
                ws.push(w.clone())
            }
            _ => return Ok(None),
        }
    }
    Ok(Some((ex.get_raw(av)?, ws)))
}

/// The output widths `N_i` of weights `ws`, when every one has `K = k` columns.
pub(super) fn weight_widths(ws: &[Tensor], k: usize) -> Option<Vec<usize>> {
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
pub(super) fn hdense_stage(ex: &Exec, ns: &[usize]) -> Result<Option<(Vec<BV>, u64)>, String> {
    let Some(ops) = dense_operands(ex, ns)? else {
        return Ok(None);
    };
    let Some((c, lead, flops)) = product(ex, &ops)? else {
        return Ok(None);
    };
    let (n, rows) = (ops.n, lead.iter().product::<usize>());
    let mut outs = Vec::with_capacity(ops.outs.len());
    for &(_, col, w) in &ops.outs {
        let mut part = with_capacity_f32(rows * w);
        for r in 0..rows {
            part.extend_from_slice(
                c.get(r * n + col..r * n + col + w)
                    .ok_or("internal: split")?,
            );
        }
        let mut shape = lead.clone();
        shape.push(w);
        outs.push(BV::Batched(OpValue::Tensor(
            Tensor::from_f32(shape, part).map_err(|e| e.to_string())?,
        )));
    }
    // The stacked product was split into the parts: its buffer serves a later launch.
    tumble_tensor::pool::recycle(c);
    Ok(Some((outs, flops)))
}

/// A product's C, its rows' leading shape and its flops (see [`product`]).
pub(super) type Product = (Vec<f32>, Vec<usize>, u64);

/// `C = Σ_i A_i · W_iᵀ` of `ops` over the launch's rows, its addends added: C (rows × N, row
/// major), the rows' leading shape and the product's flops. `None`, having computed nothing,
/// when the operands do not fit.
pub(super) fn product(ex: &Exec, ops: &GemmOperands) -> Result<Option<Product>, String> {
    let Some((a_rows, lead)) = part_rows(ops) else {
        return Ok(None);
    };
    let n = ops.n;
    let rows: usize = lead.iter().product();
    let Some(addends) = ops.bind_addends(rows) else {
        return Ok(None);
    };
    // Overwritten whole by the GEMM.
    let mut c = scratch_f32(rows * n);
    with_parts(&a_rows, ops, 0..rows, |parts| {
        tumble_kernels::dense_accumulate(parts, &mut c, &tumble_kernels::NoEpilogue, ex.threads)
    })
    .map_err(|e| e.to_string())?;
    add_addends(&mut c, n, 0, &addends);
    let k_total: usize = ops.w.iter().map(|(k, _)| k).sum();
    Ok(Some((c, lead, 2 * (rows * k_total * n) as u64)))
}

/// Values of block nodes, by node index.
pub(super) type NodeValues = Vec<(usize, BV)>;

thread_local! {
    /// The product of a GEMM stage with a fused epilogue: scratch, reused by every such launch on
    /// this thread (grown, never shrunk), so it is neither allocated nor zeroed per launch.
    static EPILOGUE_C: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A GEMM stage's operands for one launch: `C = Σ_i A_i · W_iᵀ` over parts (each part's rows
/// as they lie, its `K`, its packed weight `N × K`), which node's value is which columns of `C`
/// (one part and several values for horizontal fusion; several parts and one value for a sum
/// of products), and the addends of a sum that are not products (added to `C`'s rows).
pub(super) struct GemmOperands<'e> {
    pub(super) a: Vec<Cow<'e, BV>>,
    pub(super) w: Vec<(usize, Arc<PackedWeight>)>,
    pub(super) n: usize,
    /// Node, first column, width.
    pub(super) outs: Vec<(usize, usize, usize)>,
    pub(super) addends: Vec<Cow<'e, BV>>,
}

impl GemmOperands<'_> {
    /// The addends bound for a launch of `rows` rows (`None`: one does not fit).
    pub(super) fn bind_addends(&self, rows: usize) -> Option<Vec<Addend<'_>>> {
        self.addends
            .iter()
            .map(|v| Addend::bind(v, self.n, rows))
            .collect()
    }
}

/// The operands of denses `dense` (one, or a horizontally fused group reading the same rows
/// with shared f32 weights): `None` when they are not of that form.
pub(super) fn dense_operands<'e>(
    ex: &'e Exec,
    dense: &[usize],
) -> Result<Option<GemmOperands<'e>>, String> {
    let Some((a, ws)) = shared_weight_operands(ex, dense)? else {
        return Ok(None);
    };
    let Some(k) = gemm_rows(&a).map(|(_, k, _)| k) else {
        return Ok(None);
    };
    let Some(widths) = weight_widths(&ws, k) else {
        return Ok(None);
    };
    let n: usize = widths.iter().sum();
    let pw = if let [w] = ws.as_slice() {
        crate::gemm::packed(w, n, k)?
    } else {
        crate::gemm::packed_concat(&ws, k)?
    };
    let mut outs = Vec::with_capacity(dense.len());
    let mut col = 0;
    for (&d, &w) in dense.iter().zip(&widths) {
        outs.push((d, col, w));
        col += w;
    }
    Ok(Some(GemmOperands {
        a: vec![a],
        w: vec![(k, pw)],
        n,
        outs,
        addends: Vec::new(),
    }))
}

/// An addend of a sum of products, bound for a launch: per-row values, or one vector (a bias)
/// or value added to every row.
pub(super) enum Addend<'a> {
    Rows(Vec<&'a [f32]>),
    Vector(&'a [f32]),
    Scalar(f32),
}

impl<'a> Addend<'a> {
    /// `v` as an addend of rows of width `n` (`rows` of them); `None` when it is not one.
    pub(super) fn bind(v: &'a BV, n: usize, rows: usize) -> Option<Addend<'a>> {
        match v {
            BV::Shared(OpValue::Tensor(t)) => match t.as_f32()? {
                [x] => Some(Addend::Scalar(*x)),
                d if d.len() == n => Some(Addend::Vector(d)),
                _ => None,
            },
            _ => row_ptrs(v, n).filter(|r| r.len() == rows).map(Addend::Rows),
        }
    }
}

/// Adds `addends` to the rows `first..` of a sum's product (`c`: whole rows of width `n`).
pub(super) fn add_addends(c: &mut [f32], n: usize, first: usize, addends: &[Addend]) {
    for (r, row) in c.chunks_exact_mut(n.max(1)).enumerate() {
        for a in addends {
            match a {
                Addend::Rows(rs) => {
                    if let Some(x) = rs.get(first + r) {
                        row.iter_mut().zip(x.iter()).for_each(|(c, x)| *c += *x);
                    }
                }
                Addend::Vector(v) => row.iter_mut().zip(v.iter()).for_each(|(c, x)| *c += *x),
                Addend::Scalar(x) => row.iter_mut().for_each(|c| *c += *x),
            }
        }
    }
}

/// Rows `range` of each part paired with its packed weight, as the kernels take them, for `f`.
fn with_parts<R>(
    a_rows: &[GemmRows],
    ops: &GemmOperands,
    range: Range<usize>,
    f: impl FnOnce(&[(&Rows, &PackedWeight)]) -> R,
) -> R {
    let rows: Vec<Rows> = a_rows
        .iter()
        .zip(&ops.w)
        .map(|(a, (k, _))| a.rows_in(*k, range.clone()))
        .collect();
    let parts: Vec<(&Rows, &PackedWeight)> = rows
        .iter()
        .zip(&ops.w)
        .map(|(a, (_, w))| (a, &**w))
        .collect();
    f(&parts)
}

/// Each part's rows, checked against its weight's `K`, and the rows' leading shape (the same
/// for every part); `None` when a part is not batched f32 rows of that width.
pub(super) fn part_rows<'a>(ops: &'a GemmOperands) -> Option<(Vec<GemmRows<'a>>, Vec<usize>)> {
    let mut lead: Option<Vec<usize>> = None;
    let mut rows = Vec::with_capacity(ops.a.len());
    for (a, (k, _)) in ops.a.iter().zip(&ops.w) {
        let (r, ka, l) = gemm_rows(a)?;
        if ka != *k || lead.as_ref().is_some_and(|prev| *prev != l) {
            return None;
        }
        lead = Some(l);
        rows.push(r);
    }
    Some((rows, lead?))
}

/// A GEMM stage (`ops`: one dense, a horizontally fused group reading the same rows, or a sum
/// of products) whose results only the row program of the next stage (`rows_stage`, nodes `ns`)
/// reads: the row program runs as the GEMM's epilogue on each block of output rows while the
/// block is in cache, and writes its live values straight into their tensors; the product
/// itself is scratch. Returns those values and the GEMM's flops; `None`, having computed
/// nothing, when the fast path does not apply (the caller then runs the two stages separately).
pub(super) fn gemm_with_epilogue(
    ex: &Exec,
    rp: &RunPlan,
    ops: &GemmOperands,
    rows_stage: usize,
    ns: &[usize],
    fstats: &mut FusedStats,
) -> Result<Option<(NodeValues, u64)>, String> {
    let Some((a_rows, lead)) = part_rows(ops) else {
        return Ok(None);
    };
    let n = ops.n;
    let rows: usize = lead.iter().product();
    if n == 0 || rows == 0 {
        return Ok(None);
    }
    let Some(addends) = ops.bind_addends(rows) else {
        return Ok(None);
    };
    // The row program's operands; the GEMM's results among them are bound block by block to
    // their columns of C.
    let empty = RowOperands::default();
    let row_ops = rp.plan.row_ops.get(rows_stage).unwrap_or(&empty);
    let mut vals: Vec<Option<Cow<BV>>> = Vec::with_capacity(row_ops.vals.len());
    let mut sig: Vec<OpSig> = Vec::with_capacity(row_ops.vals.len());
    let mut in_c: Vec<Option<(usize, usize)>> = Vec::with_capacity(row_ops.vals.len());
    for v in &row_ops.vals {
        let member = match v {
            BVal::Node(k) => ops.outs.iter().find(|(d, ..)| *d == *k as usize),
            _ => None,
        };
        match member {
            Some(&(_, col, w)) => {
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
    let Some(prog) = compiled_rows(ex, rp, rows_stage, ns, sig, fstats) else {
        return Ok(None);
    };
    let out_lead = row_lead(&prog, ex.b);
    if out_lead.iter().product::<usize>() != rows {
        return Ok(None);
    }
    let held: Vec<Option<&BV>> = vals.iter().map(|v| v.as_deref()).collect();
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
    let k_total: usize = ops.w.iter().map(|(k, _)| k).sum();
    let weight_bytes = ops
        .w
        .iter()
        .map(|(k, _)| n.saturating_mul(*k).saturating_mul(4))
        .sum();
    let mut bufs: Vec<Vec<f32>> = flat_outs(&prog)
        .map(|o| scratch_f32(rows * o.len))
        .collect();
    let widths_out: Vec<usize> = flat_outs(&prog).map(|o| o.len).collect();
    // The epilogue runs inside the kernel's row blocks (on its threads) and cannot return an
    // error: the first one is kept here and reported after the product.
    let epilogue_failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let unit = tumble_kernels::row_unit(weight_bytes);
    let chunks = epilogue_chunks(rows, n, unit);
    let chunk_max = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
    let mut c = EPILOGUE_C.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if c.len() < chunk_max * n {
        // The old scratch is freed first: growing it in place would copy it into the new one.
        // (Not `vec![0.0; _]` either: zeroed memory comes from fresh pages, not from those freed.)
        // Grown to a power of two up to the chunk bound: chunk sizes creep up launch by launch,
        // and each growth is fresh memory faulted in page by page (TreeLSTM-small's first run
        // grew it 1.8 MB, then 2 MB: 945 page faults, ~2.5 µs each on the benchmark VM, against
        // 512 for one 2 MB). Past the bound (a launch in chunks whose unit of rows is wider than
        // it), the largest chunk a launch of this width and unit can have: the next power of
        // two could be nearly twice that (Berxit's 224-row units of 3,072 columns, 2.75 MB, took
        // 8 MB), and exactly this chunk's would grow again at a slightly larger one.
        let need = chunk_max * n;
        let len = if need > EPILOGUE_C_CHUNK_FLOATS {
            need.max(epilogue_chunk_rows_max(n, unit).saturating_mul(n))
        } else {
            need.next_power_of_two()
                .min(EPILOGUE_C_CHUNK_FLOATS)
                .max(need)
        };
        c = Vec::new();
        c.resize(len, 0.0);
    }
    let mut done = Ok(());
    for chunk in chunks {
        let off = chunk.start;
        let mut outputs: Vec<tumble_kernels::Output> = bufs
            .iter_mut()
            .zip(&widths_out)
            .map(|(data, &w)| tumble_kernels::Output {
                data: &mut data[chunk.start * w..chunk.end * w],
                width: w,
            })
            .collect();
        // `r` is relative to the chunk; the program's other operands are indexed by the
        // launch's rows.
        let epilogue = |r: Range<usize>, cblk: &mut [f32], outs: &mut [&mut [f32]]| {
            add_addends(cblk, n, r.start + off, &addends);
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
                    None => full.get(r.start + off..r.end + off).unwrap_or(&[]).to_vec(),
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
        done = with_parts(&a_rows, ops, chunk.clone(), |parts| {
            tumble_kernels::dense_into(
                parts,
                &mut c[..chunk.len() * n],
                &mut outputs,
                &epilogue,
                ex.threads,
            )
        });
        if done.is_err() {
            break;
        }
    }
    EPILOGUE_C.with(|slot| *slot.borrow_mut() = c);
    done.map_err(|e| e.to_string())?;
    if let Some(e) = epilogue_failure
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
    {
        return Err(e);
    }
    let values = assemble(&prog, &out_lead, bufs)?;
    Ok(Some((values, 2 * (rows * k_total * n) as u64)))
}

/// The A operand of a GEMM stage, read where it lies.
pub(super) enum GemmRows<'a> {
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

    /// Rows `range` of the operand (an empty operand past the end).
    pub(super) fn rows_in(&self, k: usize, range: Range<usize>) -> Rows<'_> {
        match self {
            GemmRows::Contiguous(data) => Rows::Contiguous {
                data: data.get(range.start * k..range.end * k).unwrap_or(&[]),
                stride: k,
            },
            GemmRows::Gathered(rows) => Rows::Gathered(rows.get(range).unwrap_or(&[])),
        }
    }
}

/// Scratch floats of C above which a GEMM stage with a fused epilogue runs in chunks of rows.
/// C is only read by the epilogue, block by block, yet was sized for the whole launch: 9.7 MB
/// for NestedRNN-small's 9,538-row input launch, first-touched by a process's first run.
const EPILOGUE_C_CHUNK_FLOATS: usize = 1 << 18;

/// The row chunks of a launch of `rows` rows whose product has `n` columns: one chunk, unless C
/// would exceed [`EPILOGUE_C_CHUNK_FLOATS`]. Chunks are multiples of `unit` rows (the kernel's
/// [`tumble_kernels::row_unit`] for the launch's weight, at least 56: its blocked path, as the
/// whole launch; the last chunk absorbs a rest shorter than the unit), so the weight streams as
/// often as for the whole launch and every chunk computes the same bits. Before the unit,
/// chunking was kept to weights of at most 1 MiB, and TreeLSTM-large's 1,216-row leaf launch
/// first-touched a 7.5 MB C. The chunks are balanced (as few as fit, of equal size up to the
/// unit), not full ones and a rest: a last chunk absorbing a rest of up to a chunk made C nearly
/// twice the bound (TreeLSTM-small's 594-row leaf launch, one 1.8 MB chunk: 2 MB of scratch,
/// 511 first-run page faults, against 1 MB in two chunks).
fn epilogue_chunks(rows: usize, n: usize, unit: usize) -> Vec<Range<usize>> {
    if rows.saturating_mul(n) <= EPILOGUE_C_CHUNK_FLOATS || n == 0 || !chunks_enabled() {
        return std::iter::once(0..rows).collect();
    }
    let unit = unit.max(1);
    let per = epilogue_chunk_rows(n, unit);
    let size = rows.div_ceil(rows.div_ceil(per)).next_multiple_of(unit);
    let mut out = Vec::with_capacity(rows.div_ceil(size));
    let mut start = 0;
    while start < rows {
        // The last chunk takes a rest shorter than the unit (so it is never below it).
        let end = if rows - start < size + unit {
            rows
        } else {
            start + size
        };
        out.push(start..end);
        start = end;
    }
    out
}

/// The rows of a chunk of C within [`EPILOGUE_C_CHUNK_FLOATS`] for `n` columns, a whole number of
/// units (at least one).
fn epilogue_chunk_rows(n: usize, unit: usize) -> usize {
    let unit = unit.max(1);
    (EPILOGUE_C_CHUNK_FLOATS / n.max(1))
        .max(unit)
        .next_multiple_of(unit)
}

/// The most rows a chunk of [`epilogue_chunks`] can have for `n` columns and `unit` (in a launch
/// that is chunked at all): a balanced chunk is at most [`epilogue_chunk_rows`], and the last
/// absorbs less than a unit more.
fn epilogue_chunk_rows_max(n: usize, unit: usize) -> usize {
    epilogue_chunk_rows(n, unit) + unit.max(1) - 1
}

/// `TUMBLE_NO_EPILOGUE_CHUNKS=1`: every GEMM stage with a fused epilogue runs whole (one C for
/// the launch), the A/B baseline of the chunks.
fn chunks_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_EPILOGUE_CHUNKS")
}

/// Batched f32 rows of width K > 0: the rows, K, and the result's shape without its last axis.
pub(super) fn gemm_rows(v: &BV) -> Option<(GemmRows<'_>, usize, Vec<usize>)> {
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

#[cfg(test)]
mod chunk_tests {
    use super::*;

    /// Chunks tile the launch in order, every one a multiple of the unit (the last may absorb a
    /// rest shorter than the unit) and none shorter than it, none past the bound by a unit or
    /// more, and a launch whose C is small stays whole.
    #[test]
    fn epilogue_chunks_tile_the_rows() {
        for (rows, n, unit) in [
            (9538usize, 256usize, 56usize),
            (1363, 768, 56),
            (100_000, 7, 56),
            (2000, 300, 96),
            (1216, 2048, 224),
            (1024, 3072, 224),
            (594, 768, 56),
            (727, 768, 56),
            (1000, 1024, 224),
        ] {
            let chunks = epilogue_chunks(rows, n, unit);
            assert_eq!(chunks.first().map(|c| c.start), Some(0));
            assert_eq!(chunks.last().map(|c| c.end), Some(rows));
            for w in chunks.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let (last, rest) = chunks.split_last().expect("at least one chunk");
            assert!(
                rest.iter().all(|c| c.len() % unit == 0) && last.len() >= unit,
                "{rows} x {n}: {chunks:?}"
            );
            assert!(chunks.len() > 1, "{rows} x {n}");
            assert!(
                chunks
                    .iter()
                    .all(|c| c.len() <= epilogue_chunk_rows_max(n, unit)),
                "{rows} x {n}: {chunks:?}"
            );
        }
        // TreeLSTM-small's leaf launch: two balanced chunks within the bound, not one of 1.8 MB.
        let leaf = epilogue_chunks(594, 768, 56);
        assert_eq!(leaf, vec![0..336, 336..594]);
        assert!(leaf
            .iter()
            .all(|c| c.len() * 768 <= EPILOGUE_C_CHUNK_FLOATS));
        assert_eq!(epilogue_chunks(100, 256, 56), vec![0..100]);
        assert_eq!(epilogue_chunks(0, 256, 56), vec![0..0]);
    }
}
