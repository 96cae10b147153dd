//! Fast f32 paths for layout, batched-matrix and broadcasting arithmetic operators inside launches
//! (transpose, concatenate, split, take of rows, batch_matmul, add/subtract/multiply/divide and
//! bias_add along the last axis), used by the batching rules
//! instead of the generic reference kernels when the operands are f32. Results are identical in
//! layout; sums are f32 in a fixed order; the arithmetic is bit-identical to the reference's (which
//! computes in f64 and rounds: for one +, -, * or / of two f32 values that double rounding is
//! innocuous, since f64 has more than 2·24 + 2 significand bits).

mod bmm;
mod elementwise;
mod layout;
mod reduce;

pub use bmm::bmm_f32;
pub(crate) use elementwise::Broadcast;
pub(crate) use layout::{axis_of, split_sizes, transpose_axes};
pub use layout::{concat_f32, permute_f32, split_f32, take_rows_f32, transpose_2d};
pub(crate) use reduce::{best_index, fold_columns};

use elementwise::{binary_f32, compare_f32, row_unary, where_f32};
use layout::slice_f32;
use reduce::{arg_f32, reduce_f32, variance_f32};

use crate::simd;
use tumble_compile::ragged::RowReduce;
use tumble_ir::Attrs;
use tumble_ops::OpValue;
use tumble_tensor::pool::zeroed_f32;
use tumble_tensor::Tensor;

/// Runs `op` on f32 operands through a fast path if there is one (`None`: use the reference
/// kernel), on at most `threads` threads (the launch's budget).
pub fn try_eval(op: &str, args: &[OpValue], attrs: &Attrs, threads: usize) -> Option<OpValue> {
    match op {
        "transpose" => {
            let t = args.first()?.as_tensor()?;
            permute_f32(t, &transpose_axes(attrs, t.rank())?).map(OpValue::Tensor)
        }
        "concatenate" => {
            let OpValue::Tuple(parts) = args.first()? else {
                return None;
            };
            let r = parts.first()?.rank() as i64;
            let axis = attrs.int("axis").ok()?.unwrap_or(0);
            let axis = usize::try_from(if axis < 0 { axis + r } else { axis }).ok()?;
            concat_f32(parts, axis).map(OpValue::Tensor)
        }
        "nn.batch_matmul" => {
            let (x, y) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            let ta = attrs.bool("transpose_a").ok()?.unwrap_or(false);
            let tb = attrs.bool("transpose_b").ok()?.unwrap_or(true);
            // The f32 kernel computes and returns f32: another `out_dtype` is the reference's.
            let out_f32 = matches!(
                attrs.str("out_dtype").ok()?,
                None | Some("") | Some("float32")
            );
            if ta || !out_f32 {
                return None;
            }
            bmm_f32(x, y, tb, threads).map(OpValue::Tensor)
        }
        // Outside a planned GEMM stage (e.g. computed once for a launch whose operands are all
        // shared): the f32 kernels, as planned stages use, instead of the f64 reference loops.
        "nn.dense" if attrs.0.is_empty() => {
            let (x, w) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            dense_f32(x, w, None).map(OpValue::Tensor)
        }
        "split" => {
            let t = args.first()?.as_tensor()?;
            let axis = axis_of(attrs.int("axis").ok()?.unwrap_or(0), t.rank())?;
            let sizes = split_sizes(attrs, *t.shape().get(axis)?)?;
            split_f32(t, axis, &sizes).map(OpValue::Tuple)
        }
        "take" if tumble_ops::takes_rows(attrs) => {
            let (table, ids) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            take_rows_f32(table, ids).map(OpValue::Tensor)
        }
        // A bias along the last axis is numpy broadcasting's own trailing-axis add.
        "nn.bias_add" => {
            let (x, b) = (args.first()?.as_tensor()?, args.get(1)?.as_tensor()?);
            let r = x.rank();
            let axis = axis_of(attrs.int("axis").ok()?.unwrap_or(1), r)?;
            if axis + 1 != r || b.rank() != 1 || x.shape().last() != Some(&b.len()) {
                return None;
            }
            binary_f32(args, |a, b| a + b)
        }
        "sum" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Sum).map(OpValue::Tensor),
        "mean" if fast_reductions() => {
            reduce_f32(args, attrs, RowReduce::Mean).map(OpValue::Tensor)
        }
        "max" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Max).map(OpValue::Tensor),
        "min" if fast_reductions() => reduce_f32(args, attrs, RowReduce::Min).map(OpValue::Tensor),
        "variance" if fast_reductions() => variance_f32(args, attrs).map(OpValue::Tensor),
        "argmax" if fast_reductions() => arg_f32(args, attrs, true).map(OpValue::Tensor),
        "argmin" if fast_reductions() => arg_f32(args, attrs, false).map(OpValue::Tensor),
        "equal" if fast_selections() => compare_f32(args, |a, b| a == b),
        "not_equal" if fast_selections() => compare_f32(args, |a, b| a != b),
        "less" if fast_selections() => compare_f32(args, |a, b| a < b),
        "greater" if fast_selections() => compare_f32(args, |a, b| a > b),
        "less_equal" if fast_selections() => compare_f32(args, |a, b| a <= b),
        "greater_equal" if fast_selections() => compare_f32(args, |a, b| a >= b),
        "where" if fast_selections() => where_f32(args),
        // The reference's `sign` (through f64: ±0 and NaN are themselves) on f32 directly.
        "sign" if fast_selections() => {
            let t = args.first()?.as_tensor()?;
            let x = t.as_f32()?;
            let mut out = tumble_tensor::pool::scratch_f32(x.len());
            simd::unary(&mut out, x, |v| {
                if v > 0.0 {
                    1.0
                } else if v < 0.0 {
                    -1.0
                } else {
                    v
                }
            });
            Tensor::from_vec(t.shape().to_vec(), out)
                .ok()
                .map(OpValue::Tensor)
        }
        "strided_slice" if fast_selections() => {
            let t = args.first()?.as_tensor()?;
            let plan = tumble_ops::slice_plan(attrs, t.shape())?;
            slice_f32(t, &plan).map(OpValue::Tensor)
        }
        "add" => binary_f32(args, |a, b| a + b),
        "subtract" => binary_f32(args, |a, b| a - b),
        "multiply" => binary_f32(args, |a, b| a * b),
        "divide" => binary_f32(args, |a, b| a / b),
        // The row programs' own functions (fastmath: a few ulp from the f64 reference), so an
        // operator a launch runs outside a row program rounds as the fused stage does in a
        // launch of another size.
        name if attrs.0.is_empty() => row_unary(name, args),
        _ => None,
    }
}

/// Work on one f32 row in place (a product's epilogue, [`dense_f32`]).
pub(crate) type RowFn<'a> = dyn Fn(&mut [f32]) + Sync + 'a;

/// `nn.dense(x, w)` on f32 operands on the GEMM kernel (a weight `(n, k)`, `x`'s last axis `k`,
/// any leading axes), `row_epilogue` run on each output row (`n` floats) while its block is in
/// cache: the training forward's bias and activation after a product, without writing the
/// product and reading it back into another buffer ([`crate::kept`]). `None` where it does not
/// apply.
pub(crate) fn dense_f32(
    x: &Tensor,
    w: &Tensor,
    row_epilogue: Option<&RowFn<'_>>,
) -> Option<Tensor> {
    let (&k, &[n, wk]) = (x.shape().last()?, w.shape()) else {
        return None;
    };
    let data = x.as_f32()?;
    if k != wk || k == 0 || w.as_f32().is_none() {
        return None;
    }
    let rows = data.len() / k;
    // The kernel overwrites C (the training forward's products: a zero fill per launch
    // was 1.2% of a step's instructions).
    let mut c = tumble_tensor::pool::scratch_f32(rows * n);
    let a = tumble_kernels::Rows::Contiguous { data, stride: k };
    match row_epilogue {
        Some(f) => {
            let each_row = |_rows: std::ops::Range<usize>, out: &mut [f32]| {
                out.chunks_exact_mut(n).for_each(f);
            };
            crate::gemm::dense_with(&a, k, w, n, &mut c, &each_row, 1).ok()?;
        }
        None => crate::gemm::dense(&a, k, w, n, &mut c, 1).ok()?,
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut()? = n;
    Tensor::from_vec(shape, c).ok()
}

/// `TUMBLE_NO_FAST_REDUCTIONS=1`: `sum` and `mean` by the reference kernel (the A/B switch of
/// [`reduce_f32`]; the results are the same bits either way).
fn fast_reductions() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_REDUCTIONS")
}

/// `TUMBLE_NO_FAST_SELECTIONS=1`: comparisons, `where`, `sign` and `strided_slice` by the
/// reference kernels (the A/B switch of [`compare_f32`], [`where_f32`], the `sign` loop and
/// [`slice_f32`]; the same results either way).
fn fast_selections() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_SELECTIONS")
}

/// Also the helpers of the other fast paths' tests (`backward::fast`).
#[cfg(test)]
pub(crate) mod tests;
