//! Gather stages: embedding lookups as row copies, or as references to the table's rows
//! (gather views).

use tumble_compile::BArg;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

use super::Exec;
use crate::batched::BV;

/// The operands of embedding lookup `i` that the fast paths take: a shared f32 table of `rows`
/// rows, batched int ids, clip mode (which clamps, like the reference kernel); `None` otherwise
/// (other modes fall back).
pub(super) fn lookup_operands(
    ex: &Exec,
    i: usize,
) -> Result<Option<(Tensor, Tensor, usize)>, String> {
    let node = ex.block.nodes.get(i).ok_or("internal: node")?;
    let (Some(BArg::One(tv)), Some(BArg::One(iv))) = (node.args.first(), node.args.get(1)) else {
        return Ok(None);
    };
    let (BV::Shared(OpValue::Tensor(table)), BV::Batched(OpValue::Tensor(ids))) =
        (ex.get(tv)?, ex.get(iv)?)
    else {
        return Ok(None);
    };
    let mode = node.attrs.str("mode").ok().flatten().unwrap_or("clip");
    let (Some(_), Some(&rows)) = (table.as_f32(), table.shape().first()) else {
        return Ok(None);
    };
    if mode != "clip" || rows == 0 {
        return Ok(None);
    }
    Ok(Some((table, ids, rows)))
}

/// Embedding lookup: rows of a shared f32 table selected by batched int ids (clip mode clamps,
/// like the reference kernel; other modes fall back).
pub(super) fn gather_stage(ex: &Exec, i: usize) -> Result<Option<BV>, String> {
    let Some((table, ids, rows)) = lookup_operands(ex, i)? else {
        return Ok(None);
    };
    let idx = ids.to_i64_vec();
    let b = ids.shape().first().copied().unwrap_or(0);
    if ex.gather_views && b > 0 && idx.len() == b {
        // One index per invocation: references to the table's rows, viewed with the output's
        // per-invocation shape (the index's own dims, then a row's).
        let mut view_shape = vec![rows];
        view_shape.extend_from_slice(ids.shape().get(1..).unwrap_or(&[]));
        view_shape.extend_from_slice(&table.shape()[1..]);
        let view = table.reshape(view_shape).map_err(|e| e.to_string())?;
        let mut parts = crate::batched::RowRefsBuilder::with_capacity(idx.len());
        for &j in &idx {
            parts.push(&view, Some(j.clamp(0, rows as i64 - 1) as usize));
        }
        if let Some(r) = parts.finish() {
            return Ok(Some(BV::Rows(r)));
        }
    }
    crate::fastops::take_rows_f32(&table, &ids)
        .map(|t| Some(BV::Batched(OpValue::Tensor(t))))
        .ok_or_else(|| "internal: embedding lookup".to_string())
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Row programs
