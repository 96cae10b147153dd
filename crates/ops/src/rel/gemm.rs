//! Matrix products: `nn.dense`, `nn.matmul`, `nn.batch_matmul` (GEMM stages under fusion).

use super::{broadcast_dim, dims_match, Call};
use crate::RelError;
use tumble_ir::{Attrs, Dim, Ty};

/// `nn.dense(data, weight, units=None)`: data (…, K) × weight (N, K)ᵀ → (…, N).
pub fn dense(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.dense", args, attrs, 2)?;
    let data = c.tensor(0, "input")?;
    let weight = c.tensor(1, "weight")?;
    c.want_float(0, "input", data)?;
    c.want_float(1, "weight", weight)?;
    c.same_dtype(data, weight)?;
    let Some((&k, batch)) = data.shape.split_last() else {
        return Err(c.err_at(0, "input must have rank at least 1, found a scalar"));
    };
    let [n, wk] = *weight.shape else {
        return Err(c.err_at(
            1,
            format!(
                "weight must be 2-D (units, in_features), found rank {} in {}",
                weight.rank(),
                weight
            ),
        ));
    };
    if !dims_match(k, wk) {
        return Err(c.err(format!("input has {k} columns but weight expects {wk}")));
    }
    let mut n = n;
    if let Some(units) = c.opt_int("units")? {
        if units < 0 {
            return Err(c.err(format!("units must be non-negative, found {units}")));
        }
        if !dims_match(n, Dim::Known(units)) {
            return Err(c.err(format!("units={units} but weight has {n} rows")));
        }
        n = Dim::Known(units);
    }
    let dtype = c.opt_dtype("out_dtype")?.unwrap_or(data.dtype);
    let mut shape = batch.to_vec();
    shape.push(n);
    Ok(Ty::tensor(shape, dtype))
}

/// `nn.matmul(a, b, transpose_a=False, transpose_b=False, units=None)`: `a (…, K)` (or
/// `(…, K, M)` with `transpose_a`: its last two axes swapped) times `b (K, N)` (or `(N, K)` with `transpose_b`, which is
/// `nn.dense`): `(…, N)`.
pub fn matmul(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.matmul", args, attrs, 2)?;
    let a = c.tensor(0, "lhs")?;
    let b = c.tensor(1, "rhs")?;
    c.want_float(0, "lhs", a)?;
    c.want_float(1, "rhs", b)?;
    c.same_dtype(a, b)?;
    let ta = c.bool_or("transpose_a", false)?;
    let tb = c.bool_or("transpose_b", false)?;
    let (batch, k) = if ta {
        let [lead @ .., k, m] = a.shape else {
            return Err(c.err_at(
                0,
                format!("lhs must have rank at least 2 (…, K, M) with transpose_a=True, found {a}"),
            ));
        };
        let mut batch = lead.to_vec();
        batch.push(*m);
        (batch, *k)
    } else {
        let Some((&k, batch)) = a.shape.split_last() else {
            return Err(c.err_at(0, "lhs must have rank at least 1, found a scalar"));
        };
        (batch.to_vec(), k)
    };
    let [b0, b1] = *b.shape else {
        return Err(c.err_at(
            1,
            format!(
                "rhs must be 2-D ({}), found rank {} in {b}",
                if tb { "N, K" } else { "K, N" },
                b.rank()
            ),
        ));
    };
    let (bk, mut n) = if tb { (b1, b0) } else { (b0, b1) };
    if !dims_match(k, bk) {
        return Err(c.err(format!(
            "lhs has inner dimension {k} but rhs expects {bk} (transpose_a={}, transpose_b={})",
            py_bool(ta),
            py_bool(tb)
        )));
    }
    if let Some(units) = c.opt_int("units")? {
        if units < 0 {
            return Err(c.err(format!("units must be non-negative, found {units}")));
        }
        if !dims_match(n, Dim::Known(units)) {
            return Err(c.err(format!("units={units} but rhs has {n} output columns")));
        }
        n = Dim::Known(units);
    }
    let dtype = c.opt_dtype("out_dtype")?.unwrap_or(a.dtype);
    let mut shape = batch;
    shape.push(n);
    Ok(Ty::tensor(shape, dtype))
}

/// `nn.batch_matmul(x, y, transpose_a=False, transpose_b=True)`: (B, M, K) × (B, N, K) → (B, M, N);
/// a batch dim of 1 broadcasts.
pub fn batch_matmul(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.batch_matmul", args, attrs, 2)?;
    let x = c.tensor(0, "lhs")?;
    let y = c.tensor(1, "rhs")?;
    c.want_numeric(0, "lhs", x)?;
    c.want_numeric(1, "rhs", y)?;
    c.same_dtype(x, y)?;
    let ta = c.bool_or("transpose_a", false)?;
    let tb = c.bool_or("transpose_b", true)?;
    let [xb, x1, x2] = *x.shape else {
        return Err(c.err_at(
            0,
            format!(
                "lhs must be 3-D (batch, M, K), found rank {} in {}",
                x.rank(),
                x
            ),
        ));
    };
    let [yb, y1, y2] = *y.shape else {
        return Err(c.err_at(
            1,
            format!(
                "rhs must be 3-D (batch, {}), found rank {} in {}",
                if tb { "N, K" } else { "K, N" },
                y.rank(),
                y
            ),
        ));
    };
    let (m, xk) = if ta { (x2, x1) } else { (x1, x2) };
    let (n, yk) = if tb { (y1, y2) } else { (y2, y1) };
    if !dims_match(xk, yk) {
        return Err(c.err(format!(
            "lhs has inner dimension {xk} but rhs expects {yk} (transpose_a={}, transpose_b={})",
            py_bool(ta),
            py_bool(tb)
        )));
    }
    let b = broadcast_dim(xb, yb).map_err(|(a, b)| {
        c.err(format!(
            "batch dimensions {a} and {b} differ and neither is 1"
        ))
    })?;
    let dtype = c.opt_dtype("out_dtype")?.unwrap_or(x.dtype);
    Ok(Ty::tensor(vec![b, m, n], dtype))
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}
