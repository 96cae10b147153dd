//! The stages a GPU runs: products (single, horizontally fused, summed), row programs as
//! generated kernels, reshapes as views. Each returns `false`, having computed nothing, where this
//! launch's operands are not ones it takes, and the stage then runs on the host.

use std::borrow::Cow;

use tumble_compile::plan::RowOperands;
use tumble_compile::{BArg, BVal, Stage};
use tumble_cuda::{Arg, Batch, Block, Mat};
use tumble_ir::DType;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

use super::{gpu_err, rows_of, DRows, DVal, DevExec};
use crate::batched::BV;
use crate::fused::gather::lookup_operands;
use crate::fused::gemm::{product_members, weight_widths};
use crate::fused::rowexec::{compiled_rows, run_rows};
use crate::fused::rowprog::{OpSig, RowProg, Src};
use crate::fused::{Exec, FusedStats, RunPlan};

impl DevExec<'_> {
    /// Runs stage `s` on the device; `false` (having computed nothing) where it does not apply.
    pub(super) fn stage(
        &mut self,
        ex: &Exec,
        rp: &RunPlan,
        s: usize,
        stage: &Stage,
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        match stage {
            Stage::Dense(i) => match self.products(ex, std::slice::from_ref(i), fstats)? {
                true => Ok(true),
                false => self.own_weight_product(ex, *i, fstats),
            },
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
            Stage::MatMul {
                dense,
                transpose,
                concat,
            } => self.direct_product(ex, *dense, *transpose, *concat, fstats),
            Stage::Gather(i) => self.lookup(ex, *i),
        }
    }

    /// A shared f32 matrix `(N, K)` operand (a weight), on the host. A value the device computed
    /// is per invocation (the device computes no shared values): not a weight (a program
    /// generator's `nn.dense(W, nn.dense(x, U))` reads such a product as its second operand).
    fn weight_of(&self, ex: &Exec, v: &BVal) -> Result<Option<Tensor>, String> {
        if device_only(ex, v) {
            return Ok(None);
        }
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
        let Some((av, wvs)) = product_members(ex.block, ns)? else {
            return Ok(false);
        };
        let mut ws = Vec::with_capacity(wvs.len());
        for wv in wvs {
            match self.weight_of(ex, wv)? {
                Some(w) => ws.push(w),
                None => return Ok(false),
            }
        }
        let Some(a) = self.rows(ex, av)? else {
            return Ok(false);
        };
        let k = a.width;
        let Some(widths) = weight_widths(&ws, k) else {
            return Ok(false);
        };
        // A product over K = 0 (zeros) has rows a device matrix of no columns cannot say: the
        // CPU's stage takes it.
        if a.shared || a.shape.len() < 2 || k == 0 {
            return Ok(false);
        }
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

    /// An embedding lookup (`take(table, ids, axis=0)`, clip mode, a shared f32 table, ids on
    /// the host): the table's rows copied on the device from its copy there (made once per job).
    fn lookup(&mut self, ex: &Exec, i: usize) -> Result<bool, String> {
        let node = ex.block.nodes.get(i).ok_or("internal: node")?;
        let (Some(BArg::One(tv)), Some(BArg::One(iv))) = (node.args.first(), node.args.get(1))
        else {
            return Ok(false);
        };
        // Ids the device computed (none today: it computes floats only) stay off this path.
        if device_only(ex, tv) || device_only(ex, iv) {
            return Ok(false);
        }
        let Some((table, ids, rows)) = lookup_operands(ex, i)? else {
            return Ok(false);
        };
        let row_len: usize = table.shape()[1..].iter().product();
        // The table's copy made at start-up (or now, kept for the job).
        let w = self.run.weight(std::slice::from_ref(&table), true)?;
        let blocks: Vec<Block> = ids
            .to_i64_vec()
            .iter()
            .map(|&j| Block {
                buf: &w,
                off: j.clamp(0, rows as i64 - 1) as usize * row_len,
            })
            .collect();
        let mut shape = ids.shape().to_vec();
        shape.extend_from_slice(&table.shape()[1..]);
        let (_, width) = rows_of(&shape);
        let out = DRows::fresh(self.gpu(), shape, width)?;
        self.gpu()
            .gather(&blocks, row_len, &out.buf, 0, row_len)
            .map_err(gpu_err)?;
        if let Some(slot) = self.vals.get_mut(i) {
            *slot = Some(DVal::Rows(out));
        }
        Ok(true)
    }

    /// `nn.dense(X, W)` with a weight per invocation (MV-RNN's `a · Bᵀ`): one batched product,
    /// invocation `i`'s rows of `X` (or a shared `X`) by its `W_i` (N × K).
    fn own_weight_product(
        &mut self,
        ex: &Exec,
        i: usize,
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let node = ex.block.nodes.get(i).ok_or("internal: node")?;
        let (Some(BArg::One(xv)), Some(BArg::One(wv))) = (node.args.first(), node.args.get(1))
        else {
            return Ok(false);
        };
        if !self.gpu().batched_products() {
            return Ok(false);
        }
        let (Some(x), Some(w)) = (self.rows(ex, xv)?, self.rows(ex, wv)?) else {
            return Ok(false);
        };
        let b = ex.b;
        let k = x.width;
        // W: B contiguous N × K matrices.
        if w.shared || w.width != k || w.shape.len() != 3 || w.shape[0] != b || w.ld != k {
            return Ok(false);
        }
        let n = w.shape[1];
        let (Some(x), Some(dims)) = (per_invocation(&x, b), static_dims(&node.ty)) else {
            return Ok(false);
        };
        let m = x.mat.rows;
        let mut shape = vec![b];
        shape.extend_from_slice(&dims);
        if shape.iter().product::<usize>() != b * m * n {
            return Ok(false);
        }
        let c = DRows::fresh(self.gpu(), shape, n)?;
        self.gpu()
            .gemm_batched(&x, &w.matrices(n, k), true, &c.matrices(m, n), b, false)
            .map_err(gpu_err)?;
        if let Some(slot) = self.vals.get_mut(i) {
            *slot = Some(DVal::Rows(c));
        }
        fstats.dense_stages += 1;
        fstats.dense_flops += 2 * (b * m * k * n) as u64;
        Ok(true)
    }

    /// `nn.dense(X, transpose(concatenate((Y_1, ..))))` = `X · [Y_1; ..]` with `Y_p` per
    /// invocation (MV-RNN's `W_M · [A; B]`): per part one batched product of `X`'s column block
    /// by the invocations' `Y_p` (K_p × N), summed into the result; nothing is concatenated or
    /// transposed.
    fn direct_product(
        &mut self,
        ex: &Exec,
        dense: usize,
        transpose: usize,
        concat: Option<usize>,
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let nodes = &ex.block.nodes;
        let (Some(dn), Some(tn)) = (nodes.get(dense), nodes.get(transpose)) else {
            return Ok(false);
        };
        let (Some(BArg::One(xv)), Some(BArg::One(yv))) = (dn.args.first(), tn.args.first()) else {
            return Ok(false);
        };
        let parts: Vec<BVal> = match concat.and_then(|c| nodes.get(c)) {
            Some(cn) => match cn.args.first() {
                Some(BArg::Tuple(vs)) => vs.clone(),
                _ => return Ok(false),
            },
            None => vec![yv.clone()],
        };
        if !self.gpu().batched_products() {
            return Ok(false);
        }
        let b = ex.b;
        let Some(x) = self.rows(ex, xv)? else {
            return Ok(false);
        };
        let Some(x) = per_invocation(&x, b) else {
            return Ok(false);
        };
        let (m, k_all) = (x.mat.rows, x.mat.cols);
        let mut ys = Vec::with_capacity(parts.len());
        for p in &parts {
            // Y_p: B contiguous K_p × N matrices.
            match self.rows(ex, p)? {
                Some(y)
                    if !y.shared && y.shape.len() == 3 && y.shape[0] == b && y.ld == y.width =>
                {
                    ys.push(y)
                }
                _ => return Ok(false),
            }
        }
        let Some(n) = ys.first().map(|y| y.width) else {
            return Ok(false);
        };
        if ys.iter().any(|y| y.width != n) || ys.iter().map(|y| y.shape[1]).sum::<usize>() != k_all
        {
            return Ok(false);
        }
        let c = DRows::fresh(self.gpu(), vec![b, m, n], n)?;
        let cb = c.matrices(m, n);
        let mut k0 = 0;
        for (p, y) in ys.iter().enumerate() {
            let kp = y.shape[1];
            let xb = Batch {
                mat: Mat {
                    off: x.mat.off + k0,
                    cols: kp,
                    ..x.mat
                },
                stride: x.stride,
            };
            self.gpu()
                .gemm_batched(&xb, &y.matrices(kp, n), false, &cb, b, p > 0)
                .map_err(gpu_err)?;
            k0 += kp;
        }
        if let Some(slot) = self.vals.get_mut(dense) {
            *slot = Some(DVal::Rows(c));
        }
        fstats.dense_stages += 1;
        fstats.direct_matmuls += 1;
        fstats.dense_flops += 2 * (b * m * k_all * n) as u64;
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
            let Some(w) = self.weight_of(ex, wv)? else {
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
        if k_all == 0 {
            return Ok(false); // see `products`: the CPU's stage takes a product over K = 0
        }
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
        // Operands that fit the program (a launch's rows, the widths it reads), and the scalars,
        // which are launch constants read on the host.
        let mut scalars = Vec::new();
        for (h, (o, r)) in prog.held.iter().zip(&dvs).enumerate() {
            let fits = match o.src {
                Src::Ext(_) => r.rows == rows && r.width == o.len,
                Src::Shared(_) => r.rows * r.width == o.len,
                Src::Scalar(_) => {
                    let v = ops.vals.get(h).ok_or("internal: row operand")?;
                    let x = match &*ex.get_raw(v)? {
                        BV::Shared(OpValue::Tensor(t)) => {
                            t.as_f32().and_then(|d| d.first().copied())
                        }
                        _ => None,
                    };
                    scalars.extend(x);
                    x.is_some()
                }
                Src::Scratch => false,
            };
            if !fits {
                return Ok(false);
            }
        }
        if self.gpu().is_emulated() {
            return self.emulate_rows(ex, &prog, &dvs, ns, fstats);
        }
        let kernel = self.run.row_launch(&prog)?;
        let gpu = self.gpu();
        let mut args = Vec::with_capacity(2 * dvs.len() + prog.outs.len() + 2);
        let mut scalars = scalars.into_iter();
        for (o, r) in prog.held.iter().zip(&dvs) {
            match o.src {
                Src::Ext(_) => {
                    args.push(Arg::Ptr(gpu.ptr(&r.mat()).map_err(gpu_err)?));
                    args.push(Arg::I32(i32::try_from(r.ld).map_err(|e| e.to_string())?));
                }
                Src::Shared(_) => args.push(Arg::Ptr(gpu.ptr(&r.mat()).map_err(gpu_err)?)),
                Src::Scalar(_) => {
                    args.push(Arg::F32(scalars.next().ok_or("internal: row scalar")?));
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

    /// A row-program stage on an emulated device: its operands read back through the same views
    /// the kernel would get, the program run by the CPU's interpreter, its results put back.
    fn emulate_rows(
        &mut self,
        ex: &Exec,
        prog: &RowProg,
        dvs: &[DRows],
        ns: &[usize],
        fstats: &mut FusedStats,
    ) -> Result<bool, String> {
        let dvals: Vec<DVal> = dvs.iter().cloned().map(DVal::Rows).collect();
        let refs: Vec<&DVal> = dvals.iter().collect();
        let host = self.download_all(&refs)?;
        let cows: Vec<Cow<BV>> = host.iter().map(Cow::Borrowed).collect();
        let Some(outs) = run_rows(ex, prog, &cows)? else {
            return Ok(false);
        };
        for (node, v) in outs {
            let d = self
                .upload(&v)?
                .ok_or("internal: row program output not f32")?;
            if let Some(slot) = self.vals.get_mut(node) {
                *slot = Some(d);
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
        let (true, Some(dims)) = (on_device, static_dims(&node.ty)) else {
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

/// A value's rows as a batch of per-invocation matrices: a shared matrix repeated (stride 0), or
/// each of `b` invocations' equal share of the rows.
fn per_invocation(x: &DRows, b: usize) -> Option<Batch<'_>> {
    if x.shared {
        return Some(Batch {
            mat: x.mat(),
            stride: 0,
        });
    }
    if b == 0 || x.rows % b != 0 || x.shape.first() != Some(&b) {
        return None;
    }
    let m = x.rows / b;
    Some(Batch {
        mat: Mat { rows: m, ..x.mat() },
        stride: m * x.ld,
    })
}

/// A node's per-invocation shape where its type states every dimension.
fn static_dims(ty: &tumble_ir::Ty) -> Option<Vec<usize>> {
    ty.as_tensor().and_then(|(d, _)| {
        d.iter()
            .map(|x| x.known().and_then(|k| usize::try_from(k).ok()))
            .collect()
    })
}

/// Whether value `v` is only on the device (a node a device stage computed and the host has not
/// copied back).
fn device_only(ex: &Exec, v: &BVal) -> bool {
    v.node()
        .is_some_and(|k| matches!(ex.vals.get(k), Some(None)))
}
