//! [`Stage::DenseSum`](tumble_compile::Stage::DenseSum): a sum of products, and a product over
//! a concatenation, as one GEMM over the parts' rows where they lie (see the plan's docs).

use std::borrow::Cow;

use tumble_compile::{BArg, BVal};
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

use super::gemm::{gemm_rows, product, GemmOperands};
use super::Exec;
use crate::batched::BV;

/// The operands of a sum stage for this launch: every product's rows (each of its `parts`, the
/// plan's, a part of the GEMM against its weight's column block), the plan's other `addends`,
/// the result node `result`. `None` when a weight is not shared f32 or a part is not batched
/// f32 rows.
pub(super) fn sum_operands<'e>(
    ex: &'e Exec,
    denses: &[usize],
    parts: &[Vec<BVal>],
    addends: &[BVal],
    result: usize,
) -> Result<Option<GemmOperands<'e>>, String> {
    let mut ops = GemmOperands {
        a: Vec::new(),
        w: Vec::new(),
        n: 0,
        outs: Vec::new(),
        addends: Vec::new(),
    };
    let mut n: Option<usize> = None;
    for (&d, parts) in denses.iter().zip(parts) {
        let node = ex.block.nodes.get(d).ok_or("internal: node")?;
        let Some(BArg::One(wv)) = node.args.get(1) else {
            return Ok(None);
        };
        // As it lies (a per-invocation weight's rows are not stacked only to be refused).
        let w = match &*ex.get_raw(wv)? {
            BV::Shared(OpValue::Tensor(w)) => w.clone(),
            _ => return Ok(None),
        };
        let (&[wn, wk], Some(_)) = (w.shape(), w.as_f32()) else {
            return Ok(None);
        };
        if n.is_some_and(|n| n != wn) {
            return Ok(None);
        }
        n = Some(wn);
        let mut k0 = 0;
        for p in parts {
            let v = ex.get_raw(p)?;
            if let BV::Shared(OpValue::Tensor(t)) = &*v {
                // One row passed once for the whole launch (a `zeros` initial state): its
                // product is one row, computed here and added to every row as a vector.
                let (Some(x), Some(&k)) = (t.as_f32(), t.shape().last()) else {
                    return Ok(None);
                };
                if k == 0 || x.len() != k || k0 + k > wk {
                    return Ok(None);
                }
                let pw = crate::gemm::packed_columns(&w, wn, wk, k0, k)?;
                let mut y = vec![0f32; wn];
                let one = tumble_kernels::Rows::Contiguous { data: x, stride: k };
                tumble_kernels::dense(&one, &pw, &mut y, &tumble_kernels::NoEpilogue, 1)
                    .map_err(|e| e.to_string())?;
                let y = Tensor::from_f32(vec![wn], y).map_err(|e| e.to_string())?;
                ops.addends.push(Cow::Owned(BV::Shared(OpValue::Tensor(y))));
                k0 += k;
                continue;
            }
            let Some(k) = gemm_rows(&v).map(|(_, k, _)| k) else {
                return Ok(None);
            };
            if k0 + k > wk {
                return Ok(None);
            }
            ops.w
                .push((k, crate::gemm::packed_columns(&w, wn, wk, k0, k)?));
            ops.a.push(v);
            k0 += k;
        }
        if k0 != wk {
            return Ok(None);
        }
    }
    let Some(n) = n else {
        return Ok(None);
    };
    ops.n = n;
    ops.outs.push((result, 0, n));
    for v in addends {
        ops.addends.push(ex.get_raw(v)?);
    }
    Ok(Some(ops))
}

/// The sum stage without an epilogue: the product (and addends) stored as the result's batch.
/// `None`, having computed nothing, when the operands do not fit.
pub(super) fn sum_stage(ex: &Exec, ops: &GemmOperands) -> Result<Option<(BV, u64)>, String> {
    let Some((c, mut shape, flops)) = product(ex, ops)? else {
        return Ok(None);
    };
    shape.push(ops.n);
    let t = Tensor::from_f32(shape, c).map_err(|e| e.to_string())?;
    Ok(Some((BV::Batched(OpValue::Tensor(t)), flops)))
}
