//! Matrix-product kernels: `nn.dense`, `nn.matmul`, `nn.batch_matmul`. Dot products accumulate in f64 (floats)
//! or wrapping i64 (ints), in index order, and are rounded once to the output dtype (`out_dtype`,
//! else the input's).

use super::{permute, product, row, KCall, Values};
use crate::{rel, KernelError, OpCtx, OpValue};
use tumble_ir::Attrs;
use tumble_tensor::Tensor;

/// `nn.dense(data, weight)`: `out[..., n] = Σ_k data[..., k] · weight[n, k]`.
pub fn dense(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.dense", args, attrs, 2)?;
    let data = k.tensor(0, "input")?;
    let weight = k.tensor(1, "weight")?;
    let (out_shape, out_dtype) = k.out_tensor(rel::gemm::dense)?;
    let (Some((&kk, batch)), &[n, wk]) = (data.shape().split_last(), weight.shape()) else {
        return Err(k.err("input must have rank at least 1 and weight rank 2"));
    };
    if kk != wk {
        return Err(k.err(format!("input has {kk} columns but weight expects {wk}")));
    }
    if !(data.dtype().is_float() && weight.dtype().is_float()) {
        return Err(k.err("input and weight must have a float dtype"));
    }
    let rows = k.t(product(batch))?;
    let x = data.to_f64_vec();
    let w = weight.to_f64_vec();
    let mut out = Vec::new();
    for r in 0..rows {
        let xr = row(&x, r, kk);
        for j in 0..n {
            let wr = row(&w, j, kk);
            out.push(dot(xr, wr));
        }
    }
    Ok(k.t(Values::F(out).into_tensor(&out_shape, out_dtype))?
        .into())
}

/// The permutation swapping the last two of `rank` axes.
pub(crate) fn swap_last(rank: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..rank).collect();
    if rank >= 2 {
        p.swap(rank - 2, rank - 1);
    }
    p
}

/// `nn.matmul(a, b)`: `a` (its last two axes swapped first with `transpose_a`) times `b` (transposed first
/// without `transpose_b`, so that both are in `nn.dense`'s layout): `out[…, n] = Σ_k a[…, k] ·
/// b[k, n]`.
pub fn matmul(args: &[OpValue], attrs: &Attrs, _ctx: &mut OpCtx) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.matmul", args, attrs, 2)?;
    let a = k.tensor(0, "lhs")?;
    let b = k.tensor(1, "rhs")?;
    let (out_shape, out_dtype) = k.out_tensor(rel::gemm::matmul)?;
    let c = k.rel();
    let ta = c.bool_or("transpose_a", false)?;
    let tb = c.bool_or("transpose_b", false)?;
    if b.rank() != 2 || (ta && a.rank() < 2) {
        return Err(k.err("rhs must be 2-D, and lhs at least 2-D with transpose_a"));
    }
    let a = if ta {
        permute(a, &swap_last(a.rank())).map_err(|m| k.err(m))?
    } else {
        a.clone()
    };
    let w = if tb {
        b.clone()
    } else {
        permute(b, &[1, 0]).map_err(|m| k.err(m))?
    };
    let (Some(&kk), &[n, wk]) = (a.shape().last(), w.shape()) else {
        return Err(k.err("lhs must have rank at least 1"));
    };
    if kk != wk {
        return Err(k.err(format!("lhs has inner dimension {kk} but rhs expects {wk}")));
    }
    let rows = k.t(product(
        a.shape()
            .get(..a.rank().saturating_sub(1))
            .unwrap_or_default(),
    ))?;
    let x = a.to_f64_vec();
    let wv = w.to_f64_vec();
    let mut out = Vec::new();
    for r in 0..rows {
        let xr = row(&x, r, kk);
        for j in 0..n {
            out.push(dot(xr, row(&wv, j, kk)));
        }
    }
    Ok(k.t(Values::F(out).into_tensor(&out_shape, out_dtype))?
        .into())
}

/// `nn.batch_matmul(x, y, transpose_a=False, transpose_b=True)`: both operands are first brought
/// to the canonical layouts `x: (B, M, K)` and `y: (B, N, K)` (transposing as the flags say), then
/// `out[b, m, n] = Σ_k x[b, m, k] · y[b, n, k]`, where a batch of 1 on either side broadcasts.
pub fn batch_matmul(
    args: &[OpValue],
    attrs: &Attrs,
    _ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    let k = KCall::new("nn.batch_matmul", args, attrs, 2)?;
    let x = k.tensor(0, "lhs")?;
    let y = k.tensor(1, "rhs")?;
    let (out_shape, out_dtype) = k.out_tensor(rel::gemm::batch_matmul)?;
    let c = k.rel();
    let ta = c.bool_or("transpose_a", false)?;
    let tb = c.bool_or("transpose_b", true)?;
    let canon = |t: &Tensor, flip: bool| -> Result<Tensor, KernelError> {
        if t.rank() != 3 {
            return Err(k.err(format!("operands must be 3-D, found shape {:?}", t.shape())));
        }
        if flip {
            permute(t, &[0, 2, 1]).map_err(|m| k.err(m))
        } else {
            Ok(t.clone())
        }
    };
    let x = canon(x, ta)?;
    let y = canon(y, !tb)?;
    let (&[xb, m, kx], &[yb, n, ky]) = (x.shape(), y.shape()) else {
        return Err(k.err("operands must be 3-D"));
    };
    // Broadcast as numpy does: a batch of 1 takes the other's, even a batch of 0.
    let batch = if xb == 1 { yb } else { xb };
    if kx != ky || !(xb == yb || xb == 1 || yb == 1) {
        return Err(k.err(format!(
            "cannot multiply shapes {:?} and {:?} (after transposes)",
            x.shape(),
            y.shape()
        )));
    }
    // Row `r` of operand `t` (batch size `tb`, `rows` rows per batch) for output batch `b`.
    let pick = |b: usize, tb: usize, rows: usize, r: usize| if tb == 1 { r } else { b * rows + r };
    let out = match (Values::of(&x), Values::of(&y)) {
        (Values::F(xv), Values::F(yv)) => {
            let mut out = Vec::new();
            for b in 0..batch {
                for i in 0..m {
                    let xr = row(&xv, pick(b, xb, m, i), kx);
                    for j in 0..n {
                        let yr = row(&yv, pick(b, yb, n, j), kx);
                        out.push(dot(xr, yr));
                    }
                }
            }
            Values::F(out)
        }
        (Values::I(xv), Values::I(yv)) => {
            let mut out = Vec::new();
            for b in 0..batch {
                for i in 0..m {
                    let xr = row(&xv, pick(b, xb, m, i), kx);
                    for j in 0..n {
                        let yr = row(&yv, pick(b, yb, n, j), kx);
                        out.push(
                            xr.iter()
                                .zip(yr)
                                .fold(0i64, |acc, (p, q)| acc.wrapping_add(p.wrapping_mul(*q))),
                        );
                    }
                }
            }
            Values::I(out)
        }
        _ => {
            return Err(k.err(format!(
                "unsupported operand dtypes {} and {}",
                x.dtype(),
                y.dtype()
            )))
        }
    };
    Ok(k.t(out.into_tensor(&out_shape, out_dtype))?.into())
}

/// A dot product from +0.0, as BLAS and numpy start it (`Iterator::sum` starts from -0.0, so an
/// empty inner dimension gave -0.0 and `1 / x` -inf).
fn dot(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).fold(0.0, |s, (a, b)| s + a * b)
}
