//! Vector-Jacobian products: for each operator, the gradients of `<dy, op(args)>` with respect
//! to its float arguments, next to the reference kernels (same conventions: plain loops, floats
//! in f64, rounded once to the argument's dtype, no panics on user data).
//!
//! Data-movement operators (`reshape`, `transpose`, `concatenate`, `split`, `take`,
//! `strided_slice`, `reverse`, `tile`, `repeat`, `gather`, `gather_nd`, `reshape_like`, ...)
//! share one rule: the forward kernel run on an iota (each element holds its
//! own flat index) gives the index map output → input, and the gradient scatter-adds `dy` back
//! along it. So a layout kernel and its gradient cannot disagree on which element went where.
//!
//! Operators whose results are integers or bools (`argmax`, comparisons, logical operators) have
//! no gradient: [`vjp`] says so when asked ([`no_gradient`]). The executors never ask in practice,
//! because they only propagate gradients into float values.

use crate::kernel::{inverse, permute};
use crate::rel::reduce::reduce_axes;
use crate::rel::Call;
use crate::{ty_of, KernelError, OpCtx, OpDef, OpValue};
use tumble_ir::{Attrs, DType};
use tumble_tensor::shape::{broadcast_index, increment_index};
use tumble_tensor::Tensor;

/// Why `op` has no gradient, or `None` if it has one (possibly zero, e.g. `zeros_like`).
pub fn no_gradient(op: &OpDef) -> Option<&'static str> {
    match op.name {
        "equal" | "not_equal" | "less" | "greater" | "less_equal" | "greater_equal"
        | "logical_and" | "logical_or" | "logical_xor" | "logical_not" | "isnan" | "isinf"
        | "isfinite" => {
            Some("its result is a bool tensor (a comparison, logical operator or test)")
        }
        "argmax" | "argmin" => Some("its result is an integer index"),
        "shape_of" | "ndarray_size" => Some("its result is an integer size"),
        "all" | "any" => Some("its input and result are bool tensors"),
        "random.db_uniform" => Some("it is a random draw"),
        _ => None,
    }
}

/// The gradients of `sum(dy * op(args))` with respect to each argument: `None` for arguments
/// that are not float tensors (indices, conditions) or that the result does not depend on
/// smoothly. `out` is the forward result (some rules use it: `tanh`, `softmax`); `dy` has its
/// type (a tuple for `split`). A tuple argument's gradient is a tuple.
pub fn vjp(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    out: &OpValue,
    dy: &OpValue,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let name = op.name;
    let err = |m: String| KernelError::new(format!("{name}: gradient: {m}"));
    if let Some(why) = no_gradient(op) {
        return Err(err(format!("no gradient: {why}")));
    }
    if ty_of(out) != ty_of(dy) {
        return Err(err(format!(
            "the output gradient has type {} but the result has {}",
            ty_of(dy),
            ty_of(out)
        )));
    }
    let t = |i: usize| -> Result<&Tensor, KernelError> {
        match args.get(i) {
            Some(OpValue::Tensor(t)) => Ok(t),
            _ => Err(err(format!("argument {i} must be a tensor"))),
        }
    };
    let float = |i: usize| {
        args.get(i)
            .and_then(OpValue::as_tensor)
            .is_some_and(|t| t.dtype().is_float())
    };
    let (Some(y), Some(g)) = (out.as_tensor(), dy.as_tensor()) else {
        return match name {
            "split" => layout(op, args, attrs, dy),
            // The output is the input (inference semantics); the mask is constant.
            "nn.dropout" => {
                let x = t(0)?;
                match dy.as_tuple() {
                    Some([d, _]) if float(0) => Ok(vec![Some(OpValue::Tensor(d.cast(x.dtype())))]),
                    Some([_, _]) => Ok(vec![None]),
                    _ => Err(err("the output gradient must be a pair".into())),
                }
            }
            "nn.batch_norm" => batch_norm(args, attrs, dy),
            _ => Err(err("unexpected tuple result".into())),
        };
    };
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    let one = |v: Option<Tensor>| vec![v.map(OpValue::Tensor)];
    match name {
        "add" | "subtract" | "multiply" | "divide" | "power" | "maximum" | "minimum" | "mod"
        | "floor_mod" => {
            let (a, b) = (t(0)?, t(1)?);
            if !(float(0) && float(1)) {
                return Ok(vec![None, None]);
            }
            let shape = y.shape();
            // Operands of the result's shape need no broadcast copy.
            let full = |t: &Tensor| -> Result<Vec<f64>, KernelError> {
                if t.shape() == shape {
                    Ok(t.to_f64_vec())
                } else {
                    Ok(te(t.broadcast_to(shape))?.to_f64_vec())
                }
            };
            let av = full(a)?;
            let bv = full(b)?;
            let yv = y.to_f64_vec();
            let gv = g.to_f64_vec();
            let n = gv.len();
            let (mut ga, mut gb) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for i in 0..n {
                let (x1, x2, o, d) = (av[i], bv[i], yv[i], gv[i]);
                let (p, q) = match name {
                    "add" => (d, d),
                    "subtract" => (d, -d),
                    "multiply" => (d * x2, d * x1),
                    "divide" => (d / x2, -d * x1 / (x2 * x2)),
                    // a - q·b with q = trunc(a / b) or floor(a / b), constant between jumps.
                    "mod" => (d, -d * (x1 / x2).trunc()),
                    "floor_mod" => (d, -d * (x1 / x2).floor()),
                    "power" => (
                        d * x2 * x1.powf(x2 - 1.0),
                        if x1 > 0.0 { d * o * x1.ln() } else { 0.0 },
                    ),
                    // Ties go to the first operand, as the kernel's choice does.
                    "maximum" => {
                        if x1 >= x2 {
                            (d, 0.0)
                        } else {
                            (0.0, d)
                        }
                    }
                    _ => {
                        if x1 <= x2 {
                            (d, 0.0)
                        } else {
                            (0.0, d)
                        }
                    }
                };
                ga.push(p);
                gb.push(q);
            }
            Ok(vec![
                Some(OpValue::Tensor(te(unbroadcast(
                    &ga,
                    shape,
                    a.shape(),
                    a.dtype(),
                ))?)),
                Some(OpValue::Tensor(te(unbroadcast(
                    &gb,
                    shape,
                    b.shape(),
                    b.dtype(),
                ))?)),
            ])
        }
        "where" => {
            let (c, a, b) = (t(0)?, t(1)?, t(2)?);
            let shape = y.shape();
            let cv = te(c.broadcast_to(shape))?.to_f64_vec();
            let gv = g.to_f64_vec();
            let ga: Vec<f64> = gv
                .iter()
                .zip(&cv)
                .map(|(d, c)| if *c != 0.0 { *d } else { 0.0 })
                .collect();
            let gb: Vec<f64> = gv
                .iter()
                .zip(&cv)
                .map(|(d, c)| if *c != 0.0 { 0.0 } else { *d })
                .collect();
            Ok(vec![
                None,
                float(1)
                    .then(|| te(unbroadcast(&ga, shape, a.shape(), a.dtype())))
                    .transpose()?
                    .map(OpValue::Tensor),
                float(2)
                    .then(|| te(unbroadcast(&gb, shape, b.shape(), b.dtype())))
                    .transpose()?
                    .map(OpValue::Tensor),
            ])
        }
        "nn.bias_add" => {
            let (x, b) = (t(0)?, t(1)?);
            if !float(0) {
                return Ok(vec![None, None]);
            }
            let axis = attrs.int("axis").map_err(err)?.unwrap_or(1);
            let rank = x.rank() as i64;
            let axis = if axis < 0 { axis + rank } else { axis };
            let axis = usize::try_from(axis).map_err(|_| err("axis out of range".into()))?;
            let mut target = vec![1; x.rank()];
            if let Some(s) = target.get_mut(axis) {
                *s = b.len();
            }
            let gb = te(unbroadcast(&g.to_f64_vec(), y.shape(), &target, b.dtype()))?;
            Ok(vec![
                Some(OpValue::Tensor(g.cast(x.dtype()))),
                Some(OpValue::Tensor(te(gb.reshape(b.shape().to_vec()))?)),
            ])
        }
        "negative" | "sigmoid" | "tanh" | "exp" | "log" | "sqrt" | "rsqrt" | "abs" | "nn.relu"
        | "copy" | "clip" | "erf" | "sin" | "cos" | "tan" | "asin" | "acos" | "atan" | "sinh"
        | "cosh" | "asinh" | "acosh" | "atanh" | "log2" | "log10" | "nn.leaky_relu" => {
            let x = t(0)?;
            if !float(0) {
                return Ok(vec![None]);
            }
            let (lo, hi) = match name {
                "nn.leaky_relu" => (attrs.float("alpha").map_err(err)?.unwrap_or(0.01), 0.0),
                "clip" => (
                    attrs
                        .float("a_min")
                        .map_err(err)?
                        .unwrap_or(f64::NEG_INFINITY),
                    attrs.float("a_max").map_err(err)?.unwrap_or(f64::INFINITY),
                ),
                _ => (0.0, 0.0),
            };
            let xv = x.to_f64_vec();
            let yv = y.to_f64_vec();
            let gv = g.to_f64_vec();
            let dx: Vec<f64> = (0..gv.len())
                .map(|i| {
                    let (x, o, d) = (xv[i], yv[i], gv[i]);
                    match name {
                        "negative" => -d,
                        "sigmoid" => d * o * (1.0 - o),
                        "tanh" => d * (1.0 - o * o),
                        "exp" => d * o,
                        "log" => d / x,
                        "sqrt" => d * 0.5 / o,
                        "rsqrt" => d * -0.5 * o * o * o,
                        "erf" => d * std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp(),
                        "sin" => d * x.cos(),
                        "tan" => d * (1.0 + o * o),
                        "asin" => d / (1.0 - x * x).sqrt(),
                        "acos" => -d / (1.0 - x * x).sqrt(),
                        "atan" => d / (1.0 + x * x),
                        "sinh" => d * x.cosh(),
                        "cosh" => d * x.sinh(),
                        "asinh" => d / (x * x + 1.0).sqrt(),
                        "acosh" => d / (x * x - 1.0).sqrt(),
                        "atanh" => d / (1.0 - x * x),
                        "log2" => d / (x * std::f64::consts::LN_2),
                        "log10" => d / (x * std::f64::consts::LN_10),
                        // `lo` holds alpha here.
                        "nn.leaky_relu" => {
                            if x > 0.0 {
                                d
                            } else {
                                lo * d
                            }
                        }
                        "cos" => -d * x.sin(),
                        "abs" => {
                            d * if x > 0.0 {
                                1.0
                            } else if x < 0.0 {
                                -1.0
                            } else {
                                0.0
                            }
                        }
                        "nn.relu" => {
                            if x > 0.0 {
                                d
                            } else {
                                0.0
                            }
                        }
                        "clip" => {
                            if x >= lo && x <= hi {
                                d
                            } else {
                                0.0
                            }
                        }
                        _ => d,
                    }
                })
                .collect();
            Ok(one(Some(te(make(x.shape(), dx, x.dtype()))?)))
        }
        "cast" => {
            let x = t(0)?;
            Ok(one(
                (float(0) && y.dtype().is_float()).then(|| g.cast(x.dtype()))
            ))
        }
        // Piecewise constant: zero wherever the gradient exists (as PyTorch and TensorFlow).
        "zeros_like" | "ones_like" | "floor" | "ceil" | "round" | "trunc" | "sign" => {
            Ok(vec![None])
        }
        "floor_divide" => Ok(vec![None, None]),
        "full" => {
            if !float(0) {
                return Ok(vec![None]);
            }
            let x = t(0)?;
            let s: f64 = g.to_f64_vec().iter().sum();
            Ok(one(Some(te(make(x.shape(), vec![s; x.len()], x.dtype()))?)))
        }
        "nn.softmax" | "nn.log_softmax" | "nn.layer_norm" => normalize(name, args, attrs, y, g),
        "sum" | "prod" | "mean" | "max" | "min" => reduction(op, args, attrs, y, g),
        "variance" => variance(op, args, attrs, g),
        "nn.dense" => dense(args, g).map_err(err),
        "nn.batch_matmul" => batch_matmul(args, attrs, y, g).map_err(err),
        "nn.matmul" => matmul(args, attrs, g).map_err(err),
        // The result does not depend on the data's values (its gradient is zero), the fill
        // value's is the sum of dy.
        "full_like" => {
            let (x, v) = (t(0)?, t(1)?);
            let zero = float(0)
                .then(|| te(Tensor::zeros(x.shape().to_vec(), x.dtype())))
                .transpose()?;
            let s: f64 = g.to_f64_vec().iter().sum();
            let fill = float(1)
                .then(|| te(make(v.shape(), vec![s; v.len()], v.dtype())))
                .transpose()?;
            Ok(vec![zero.map(OpValue::Tensor), fill.map(OpValue::Tensor)])
        }
        // The second argument gives a shape only: a zero gradient. A broadcast's gradient sums
        // dy over the broadcast axes.
        "reshape_like" | "broadcast_to_like" => {
            let mut out = if name == "broadcast_to_like" {
                let x = t(0)?;
                vec![
                    float(0)
                        .then(|| {
                            te(unbroadcast(
                                &g.to_f64_vec(),
                                y.shape(),
                                x.shape(),
                                x.dtype(),
                            ))
                        })
                        .transpose()?
                        .map(OpValue::Tensor),
                    None,
                ]
            } else {
                layout(op, args, attrs, dy)?
            };
            if let (Some(slot), true) = (out.get_mut(1), float(1)) {
                let like = t(1)?;
                *slot = Some(OpValue::Tensor(te(Tensor::zeros(
                    like.shape().to_vec(),
                    like.dtype(),
                ))?));
            }
            Ok(out)
        }
        // The gradient of a sum over broadcast axes is dy broadcast back.
        "collapse_sum_like" => {
            let (x, like) = (t(0)?, t(1)?);
            let dx = float(0)
                .then(|| te(g.cast(x.dtype()).broadcast_to(x.shape().to_vec())))
                .transpose()?;
            let dl = float(1)
                .then(|| te(Tensor::zeros(like.shape().to_vec(), like.dtype())))
                .transpose()?;
            Ok(vec![dx.map(OpValue::Tensor), dl.map(OpValue::Tensor)])
        }
        // dy where the element was kept, 0 where masked: the kernel itself with mask_value 0.
        "sequence_mask" => {
            if !float(0) {
                return Ok(vec![None, None]);
            }
            let kept = crate::kernel::nn::sequence_kept(
                t(0)?.shape(),
                attrs.int("axis").map_err(err)?.unwrap_or(0).clamp(0, 1) as usize,
                &t(1)?.to_i64_vec(),
            );
            let dx: Vec<f64> = g
                .to_f64_vec()
                .iter()
                .zip(&kept)
                .map(|(d, k)| if *k { *d } else { 0.0 })
                .collect();
            Ok(vec![
                Some(OpValue::Tensor(te(make(g.shape(), dx, t(0)?.dtype()))?)),
                None,
            ])
        }
        "nn.prelu" => prelu(args, attrs, g),
        "nn.l2_normalize" => l2_normalize(args, attrs, g),
        "nn.pad" => pad(args, attrs, g),
        "take" if float(0) => match take_rows(args, attrs, g)? {
            Some(dx) => Ok(vec![Some(OpValue::Tensor(dx)), None]),
            None => layout(op, args, attrs, dy),
        },
        "concatenate" | "stack" | "broadcast_to" | "reshape" | "transpose" | "expand_dims"
        | "squeeze" | "take" | "strided_slice" | "reverse" | "tile" | "repeat"
        | "nn.batch_flatten" | "gather" | "gather_nd" => layout(op, args, attrs, dy),
        "cumsum" | "cumprod" => scan(op, args, attrs, y, g),
        // d/dstart of start + i·step is 1 per element, d/dstep is i; the length is piecewise
        // constant in stop, so stop's gradient is 0 (as TVM's `arange_grad`).
        "arange" => {
            if !y.dtype().is_float() {
                return Ok(vec![None; 3]);
            }
            let gv = g.to_f64_vec();
            let sums = [
                gv.iter().sum::<f64>(),
                0.0,
                gv.iter().enumerate().map(|(i, d)| i as f64 * d).sum(),
            ];
            let mut out = Vec::with_capacity(3);
            for (i, s) in sums.into_iter().enumerate() {
                out.push(if float(i) {
                    let a = t(i)?;
                    Some(OpValue::Tensor(te(make(a.shape(), vec![s], a.dtype()))?))
                } else {
                    None
                });
            }
            Ok(out)
        }
        "zeros" | "ones" | "db.phase_change" | "db.concurrent" => Ok(vec![None; args.len()]),
        // The on value's gradient is the sum of dy where it was placed, the off value's the rest.
        "one_hot" => {
            if !(float(1) && float(2)) {
                return Ok(vec![None; 3]);
            }
            let ones = OpValue::Tensor(te(make(&[], vec![1.0], y.dtype()))?);
            let zeros = OpValue::Tensor(te(make(&[], vec![0.0], y.dtype()))?);
            let hot = crate::eval(
                op,
                &[args[0].clone(), ones, zeros],
                attrs,
                &mut OpCtx {
                    rng: &mut tumble_tensor::Rng::new(0),
                },
            )?;
            let hot = hot
                .as_tensor()
                .ok_or_else(|| err("one_hot gave no tensor".into()))?
                .to_f64_vec();
            let gv = g.to_f64_vec();
            let on: f64 = gv.iter().zip(&hot).map(|(d, h)| d * h).sum();
            let off: f64 = gv.iter().zip(&hot).map(|(d, h)| d * (1.0 - h)).sum();
            Ok(vec![
                None,
                Some(OpValue::Tensor(te(make(&[], vec![on], y.dtype()))?)),
                Some(OpValue::Tensor(te(make(&[], vec![off], y.dtype()))?)),
            ])
        }
        _ => Err(err("this operator has no gradient rule".into())),
    }
}

/// `nn.matmul(a, b)` as `Y = A · B` with `A = a` (or `a` with its last two axes swapped) and `B = b` (or `bᵀ`):
/// `dA = dY · Bᵀ`, `dB = Aᵀ · dY` over all leading rows, transposed back where the flags flipped.
fn matmul(args: &[OpValue], attrs: &Attrs, g: &Tensor) -> Result<Vec<Option<OpValue>>, String> {
    let (Some(OpValue::Tensor(a)), Some(OpValue::Tensor(b))) = (args.first(), args.get(1)) else {
        return Err("operands must be tensors".into());
    };
    if !(a.dtype().is_float() && b.dtype().is_float()) {
        return Ok(vec![None, None]);
    }
    let ta = attrs.bool("transpose_a")?.unwrap_or(false);
    let tb = attrs.bool("transpose_b")?.unwrap_or(false);
    let swap = crate::kernel::gemm::swap_last(a.rank());
    let am = if ta { permute(a, &swap)? } else { a.clone() };
    let bm = if tb { permute(b, &[1, 0])? } else { b.clone() };
    let (Some(&k), &[bk, n]) = (am.shape().last(), bm.shape()) else {
        return Err("rhs must be 2-D".into());
    };
    if k != bk {
        return Err(format!("inner dimensions {k} and {bk} differ"));
    }
    let rows = am.len() / k.max(1);
    let (av, bv, gv) = (am.to_f64_vec(), bm.to_f64_vec(), g.to_f64_vec());
    if gv.len() != rows * n {
        return Err("the output gradient does not match the result".into());
    }
    let mut da = vec![0.0; rows * k];
    let mut db = vec![0.0; k * n];
    for r in 0..rows {
        for j in 0..n {
            let d = gv[r * n + j];
            for i in 0..k {
                da[r * k + i] += d * bv[i * n + j];
                db[i * n + j] += av[r * k + i] * d;
            }
        }
    }
    let da = make(am.shape(), da, a.dtype()).map_err(|e| e.to_string())?;
    let db = make(bm.shape(), db, b.dtype()).map_err(|e| e.to_string())?;
    let da = if ta { permute(&da, &swap)? } else { da };
    let db = if tb { permute(&db, &[1, 0])? } else { db };
    Ok(vec![Some(OpValue::Tensor(da)), Some(OpValue::Tensor(db))])
}

/// `nn.prelu`: `dx = dy` where `x > 0`, else `alpha[c] · dy`; `dalpha[c] = Σ dy · x` over the
/// non-positive elements of channel `c`.
fn prelu(args: &[OpValue], attrs: &Attrs, g: &Tensor) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("nn.prelu: gradient: {m}"));
    let (Some(OpValue::Tensor(x)), Some(OpValue::Tensor(alpha))) = (args.first(), args.get(1))
    else {
        return Err(err("operands must be tensors".into()));
    };
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new("nn.prelu", &tys, attrs, 2)?;
    let axis = c.axis(c.int_or("axis", 1)?, x.rank())?;
    let av = alpha.to_f64_vec();
    let (xv, gv) = (x.to_f64_vec(), g.to_f64_vec());
    let mut dx = Vec::with_capacity(xv.len());
    let mut da = vec![0.0; av.len()];
    for ((x, d), ch) in xv
        .iter()
        .zip(&gv)
        .zip(crate::kernel::nn::channel_of_each(x.shape(), axis))
    {
        if *x > 0.0 {
            dx.push(*d);
        } else {
            dx.push(av.get(ch).copied().unwrap_or(0.0) * d);
            if let Some(s) = da.get_mut(ch) {
                *s += d * x;
            }
        }
    }
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    Ok(vec![
        Some(OpValue::Tensor(te(make(x.shape(), dx, x.dtype()))?)),
        Some(OpValue::Tensor(te(make(alpha.shape(), da, alpha.dtype()))?)),
    ])
}

/// `nn.l2_normalize`: per group with `s = Σ x²` and `n = sqrt(max(s, eps))`: where `s > eps`,
/// `dx = dy / n - x · Σ(dy · x) / n³`; else `n` is constant and `dx = dy / n`.
fn l2_normalize(
    args: &[OpValue],
    attrs: &Attrs,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let Some(OpValue::Tensor(x)) = args.first() else {
        return Err(KernelError::new(
            "nn.l2_normalize: gradient: input must be a tensor",
        ));
    };
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new("nn.l2_normalize", &tys, attrs, 1)?;
    let eps = c.req_float("eps")?;
    let (group, count) =
        crate::kernel::nn::groups(x.shape(), &crate::rel::nn::l2_axes(&c, x.rank())?);
    let (xv, gv) = (x.to_f64_vec(), g.to_f64_vec());
    let mut sums = vec![0.0; count];
    let mut dots = vec![0.0; count];
    for ((x, d), k) in xv.iter().zip(&gv).zip(&group) {
        if let (Some(s), Some(p)) = (sums.get_mut(*k), dots.get_mut(*k)) {
            *s += x * x;
            *p += d * x;
        }
    }
    let dx: Vec<f64> = xv
        .iter()
        .zip(&gv)
        .zip(&group)
        .map(|((x, d), k)| {
            let s = sums.get(*k).copied().unwrap_or(0.0);
            let n = s.max(eps).sqrt();
            if s > eps {
                d / n - x * dots.get(*k).copied().unwrap_or(0.0) / (n * n * n)
            } else {
                d / n
            }
        })
        .collect();
    let dx = make(x.shape(), dx, x.dtype())
        .map_err(|e| KernelError::new(format!("nn.l2_normalize: gradient: {e}")))?;
    Ok(vec![Some(OpValue::Tensor(dx))])
}

/// `nn.pad`: `dy` added back to the element each output copied; the pad value operand's
/// gradient is the sum of `dy` where it was placed.
fn pad(args: &[OpValue], attrs: &Attrs, g: &Tensor) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("nn.pad: gradient: {m}"));
    let Some(OpValue::Tensor(x)) = args.first() else {
        return Err(err("input must be a tensor".into()));
    };
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new("nn.pad", &tys, attrs, args.len())?;
    let (pads, mode) = crate::rel::nn::pad_spec(&c, x.rank())?;
    if !x.dtype().is_float() {
        return Ok(vec![None; args.len()]);
    }
    let map = crate::kernel::nn::pad_map(x.shape(), g.shape(), &pads, mode);
    let mut dx = vec![0.0; x.len()];
    let mut dv = 0.0;
    for (m, d) in map.iter().zip(g.to_f64_vec()) {
        match m.and_then(|i| dx.get_mut(i)) {
            Some(slot) => *slot += d,
            None => dv += d,
        }
    }
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    let mut out = vec![Some(OpValue::Tensor(te(make(x.shape(), dx, x.dtype()))?))];
    if let Some(OpValue::Tensor(v)) = args.get(1) {
        out.push(
            v.dtype()
                .is_float()
                .then(|| te(make(v.shape(), vec![dv; v.len()], v.dtype())))
                .transpose()?
                .map(OpValue::Tensor),
        );
    }
    Ok(out)
}

/// `nn.batch_norm` (inference): with `inv = 1 / sqrt(var + eps)`, `s = gamma` (1 unless
/// `scale`) and `xhat = (x - mean) · inv`: `dx = dy · s · inv`, `dgamma = Σ dy · xhat`,
/// `dbeta = Σ dy` (0 unless `center`/`scale`), `dmean = -Σ dy · s · inv`, `dvar = Σ dy · s ·
/// (x - mean) · (-½) inv³`, each per channel, plus the gradients of the returned mean and var.
fn batch_norm(
    args: &[OpValue],
    attrs: &Attrs,
    dy: &OpValue,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("nn.batch_norm: gradient: {m}"));
    let k = crate::kernel::KCall::new("nn.batch_norm", args, attrs, 5)?;
    let p = crate::kernel::nn::BatchNorm::of(&k)?;
    let x = k.tensor(0, "input")?;
    let vecs: Vec<Vec<f64>> = (1..5)
        .map(|i| k.tensor(i, "vector").map(Tensor::to_f64_vec))
        .collect::<Result<_, _>>()?;
    let [gamma, _, mean, var] = vecs.as_slice() else {
        return Err(err("expected four vectors".into()));
    };
    let Some([dout, dm, dv]) = dy.as_tuple() else {
        return Err(err("the output gradient must be a 3-tuple".into()));
    };
    if !x.dtype().is_float() {
        return Ok(vec![None; 5]);
    }
    let n = mean.len();
    let at = |s: &[f64], c: usize| s.get(c).copied().unwrap_or(0.0);
    let (mut dg, mut db) = (vec![0.0; n], vec![0.0; n]);
    let (mut dmean, mut dvar) = (dm.to_f64_vec(), dv.to_f64_vec());
    if dmean.len() != n || dvar.len() != n {
        return Err(err("the statistics' gradients do not match".into()));
    }
    let xv = x.to_f64_vec();
    let mut dx = Vec::with_capacity(xv.len());
    for ((xe, d), c) in xv
        .iter()
        .zip(dout.to_f64_vec())
        .zip(crate::kernel::nn::channel_of_each(x.shape(), p.axis))
    {
        let inv = 1.0 / (at(var, c) + p.eps).sqrt();
        let s = if p.scale { at(gamma, c) } else { 1.0 };
        let centered = xe - at(mean, c);
        dx.push(d * s * inv);
        if let (Some(g), Some(b), Some(m), Some(v)) = (
            dg.get_mut(c),
            db.get_mut(c),
            dmean.get_mut(c),
            dvar.get_mut(c),
        ) {
            *g += d * centered * inv;
            *b += d;
            *m -= d * s * inv;
            *v += d * s * centered * -0.5 * inv * inv * inv;
        }
    }
    if !p.scale {
        dg.iter_mut().for_each(|g| *g = 0.0);
    }
    if !p.center {
        db.iter_mut().for_each(|b| *b = 0.0);
    }
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    let mut out = vec![Some(OpValue::Tensor(te(make(x.shape(), dx, x.dtype()))?))];
    for (i, v) in [(1, dg), (2, db), (3, dmean), (4, dvar)] {
        let a = k.tensor(i, "vector")?;
        out.push(Some(OpValue::Tensor(te(make(a.shape(), v, a.dtype()))?)));
    }
    Ok(out)
}

/// `cumsum` / `cumprod` along a line `x_0 … x_{n-1}` (each line independently):
/// - sums: every `y_b` with `b ≥ a` (`b > a` when exclusive) holds `x_a` once, so `dx_a` is the
///   reversed running sum of `dy`;
/// - products: `dx_a = Σ_b dy_b · Π_{k ≤ b, k ≠ a} x_k` (`k < b` and `b > a` when exclusive),
///   computed by running products that skip `x_a`, so zeros in `x` need no division. O(n²)
///   per line, as the reference may be.
fn scan(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    y: &Tensor,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("{}: gradient: {m}", op.name));
    let Some(OpValue::Tensor(x)) = args.first() else {
        return Err(err("input must be a tensor".into()));
    };
    if !(x.dtype().is_float() && y.dtype().is_float()) {
        return Ok(vec![None]);
    }
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new(op.name, &tys, attrs, 1)?;
    let (axis, _, exclusive) = crate::rel::reduce::scan_spec(&c, c.tensor(0, "input")?)?;
    let (outer, n, inner) = match axis {
        Some(a) => {
            let s = x.shape();
            (
                s.get(..a).unwrap_or_default().iter().product(),
                s.get(a).copied().unwrap_or(1),
                s.get(a + 1..).unwrap_or_default().iter().product(),
            )
        }
        None => (1, x.len(), 1),
    };
    let xv = x.to_f64_vec();
    let gv = g.to_f64_vec();
    if xv.len() != gv.len() || xv.len() != outer * n * inner {
        return Err(err("the output gradient does not match the input".into()));
    }
    let mut dx = vec![0.0; xv.len()];
    let at = |o: usize, a: usize, i: usize| (o * n + a) * inner + i;
    for o in 0..outer {
        for i in 0..inner {
            if op.name == "cumsum" {
                let mut acc = 0.0;
                for a in (0..n).rev() {
                    let p = at(o, a, i);
                    if exclusive {
                        dx[p] = acc;
                        acc += gv[p];
                    } else {
                        acc += gv[p];
                        dx[p] = acc;
                    }
                }
                continue;
            }
            let mut before = 1.0;
            for a in 0..n {
                let mut run = before;
                let mut sum = 0.0;
                for b in a..n {
                    let p = at(o, b, i);
                    if exclusive {
                        if b > a {
                            sum += gv[p] * run;
                            run *= xv[p];
                        }
                    } else {
                        if b > a {
                            run *= xv[p];
                        }
                        sum += gv[p] * run;
                    }
                }
                let p = at(o, a, i);
                dx[p] = sum;
                before *= xv[p];
            }
        }
    }
    let dx = make(x.shape(), dx, x.dtype()).map_err(|e| err(e.to_string()))?;
    Ok(vec![Some(OpValue::Tensor(dx))])
}

/// A tensor of `shape` and `dtype` from f64 values.
fn make(shape: &[usize], v: Vec<f64>, dtype: DType) -> Result<Tensor, tumble_tensor::TensorError> {
    Ok(Tensor::from_vec(shape.to_vec(), v)?.cast(dtype))
}

/// `g` (of the broadcast shape `from`) summed over the axes along which `to` was broadcast.
fn unbroadcast(
    g: &[f64],
    from: &[usize],
    to: &[usize],
    dtype: DType,
) -> Result<Tensor, tumble_tensor::TensorError> {
    if from == to {
        return make(to, g.to_vec(), dtype);
    }
    let n: usize = to.iter().product();
    // A trailing-axes operand (a bias `(N)` against `(…, N)`): sum the rows, no index maths.
    let inner: usize = n.max(1);
    let core = &to[to.iter().take_while(|&&d| d == 1).count()..];
    if to.len() <= from.len() && from.ends_with(core) && g.len() % inner == 0 {
        let mut acc = vec![0.0; n];
        for row in g.chunks_exact(inner) {
            acc.iter_mut().zip(row).for_each(|(a, v)| *a += v);
        }
        return make(to, acc, dtype);
    }
    let mut acc = vec![0.0; n];
    if !g.is_empty() {
        let mut idx = vec![0; from.len()];
        let mut i = 0;
        loop {
            if let (Some(slot), Some(v)) = (acc.get_mut(broadcast_index(&idx, to)), g.get(i)) {
                *slot += v;
            }
            i += 1;
            if !increment_index(&mut idx, from) {
                break;
            }
        }
    }
    make(to, acc, dtype)
}

fn row_len_err(m: impl std::fmt::Display) -> KernelError {
    KernelError::new(m.to_string())
}

/// `x` with `axis` moved last, as f64 rows of its length; and the permutation used.
/// A tensor's values with one axis moved last: (values, moved shape, the permutation).
type Moved = (Vec<f64>, Vec<usize>, Vec<usize>);

fn rows_of(x: &Tensor, axis: usize) -> Result<Moved, KernelError> {
    let mut perm: Vec<usize> = (0..x.rank()).filter(|&a| a != axis).collect();
    perm.push(axis);
    let moved = permute(x, &perm).map_err(row_len_err)?;
    Ok((moved.to_f64_vec(), moved.shape().to_vec(), perm))
}

fn normalize(
    name: &'static str,
    args: &[OpValue],
    attrs: &Attrs,
    y: &Tensor,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("{name}: gradient: {m}"));
    let Some(OpValue::Tensor(x)) = args.first() else {
        return Err(err("input must be a tensor".into()));
    };
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new(name, &tys, attrs, args.len())?;
    let axis = c.axis(c.int_or("axis", -1)?, x.rank())?;
    let len = x.shape().get(axis).copied().unwrap_or(0);
    let (xv, moved_shape, perm) = rows_of(x, axis)?;
    let (yv, _, _) = rows_of(y, axis)?;
    let (gv, _, _) = rows_of(g, axis)?;
    let rows = xv.len().checked_div(len).unwrap_or(0);
    let mut dx = Vec::with_capacity(xv.len());
    let back = |v: Vec<f64>, dtype: DType| -> Result<Tensor, KernelError> {
        let moved = make(&moved_shape, v, dtype).map_err(|e| err(e.to_string()))?;
        permute(&moved, &inverse(&perm)).map_err(err)
    };
    match name {
        "nn.softmax" | "nn.log_softmax" => {
            for r in 0..rows {
                let (ys, gs) = (&yv[r * len..(r + 1) * len], &gv[r * len..(r + 1) * len]);
                if name == "nn.softmax" {
                    let dot: f64 = ys.iter().zip(gs).map(|(a, b)| a * b).sum();
                    dx.extend(ys.iter().zip(gs).map(|(o, d)| o * (d - dot)));
                } else {
                    let s: f64 = gs.iter().sum();
                    dx.extend(ys.iter().zip(gs).map(|(o, d)| d - o.exp() * s));
                }
            }
            Ok(vec![Some(OpValue::Tensor(back(dx, x.dtype())?))])
        }
        _ => {
            let (Some(OpValue::Tensor(gamma)), Some(OpValue::Tensor(beta))) =
                (args.get(1), args.get(2))
            else {
                return Err(err("gamma and beta must be tensors".into()));
            };
            let eps = c.opt_float("epsilon")?.unwrap_or(1e-5);
            let center = c.bool_or("center", true)?;
            let scale = c.bool_or("scale", true)?;
            let gm = gamma.to_f64_vec();
            if gm.len() != len {
                return Err(err("gamma does not match the normalized axis".into()));
            }
            let n = len as f64;
            let mut dgamma = vec![0.0; len];
            let mut dbeta = vec![0.0; len];
            for r in 0..rows {
                let (xs, gs) = (&xv[r * len..(r + 1) * len], &gv[r * len..(r + 1) * len]);
                let mean = xs.iter().sum::<f64>() / n;
                let var = xs.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                let inv = 1.0 / (var + eps).sqrt();
                let xhat: Vec<f64> = xs.iter().map(|v| (v - mean) * inv).collect();
                let dxhat: Vec<f64> = gs
                    .iter()
                    .zip(&gm)
                    .map(|(d, w)| if scale { d * w } else { *d })
                    .collect();
                let m1 = dxhat.iter().sum::<f64>() / n;
                let m2 = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / n;
                for j in 0..len {
                    dx.push(inv * (dxhat[j] - m1 - xhat[j] * m2));
                    dgamma[j] += gs[j] * xhat[j];
                    dbeta[j] += gs[j];
                }
            }
            let te =
                |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
            Ok(vec![
                Some(OpValue::Tensor(back(dx, x.dtype())?)),
                scale
                    .then(|| te(make(gamma.shape(), dgamma, gamma.dtype())))
                    .transpose()?
                    .map(OpValue::Tensor),
                center
                    .then(|| te(make(beta.shape(), dbeta, beta.dtype())))
                    .transpose()?
                    .map(OpValue::Tensor),
            ])
        }
    }
}

fn reduction(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    y: &Tensor,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("{}: gradient: {m}", op.name));
    let Some(OpValue::Tensor(x)) = args.first() else {
        return Err(err("input must be a tensor".into()));
    };
    if !x.dtype().is_float() {
        return Ok(vec![None]);
    }
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new(op.name, &tys, attrs, 1)?;
    let reduced = reduce_axes(&c, c.tensor(0, "input")?)?;
    let kept = keepdims_shape(x.shape(), &reduced);
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    let gk = te(g.reshape(kept.clone()))?;
    let gb = te(gk.broadcast_to(x.shape().to_vec()))?.to_f64_vec();
    let dx: Vec<f64> = match op.name {
        "sum" => gb,
        "mean" => {
            let count = crate::kernel::reduce::reduced_count(x.shape(), &reduced);
            gb.iter().map(|v| v / count.max(1) as f64).collect()
        }
        "prod" => {
            // d/dx_i of a group's product is the product of the group's other elements: its
            // nonzero elements' product over x_i, or with one zero the others' product at the
            // zero (0 elsewhere), or 0 with two zeros or more.
            let xv = x.to_f64_vec();
            let group = group_of_each(x.shape(), &reduced);
            let n_groups = kept.iter().product::<usize>();
            let mut zeros = vec![0usize; n_groups];
            let mut nonzero = vec![1f64; n_groups];
            for (&v, &k) in xv.iter().zip(&group) {
                if v == 0.0 {
                    zeros[k] += 1;
                } else {
                    nonzero[k] *= v;
                }
            }
            xv.iter()
                .zip(&group)
                .zip(&gb)
                .map(|((&v, &k), &d)| match zeros[k] {
                    0 => d * (nonzero[k] / v),
                    1 if v == 0.0 => d * nonzero[k],
                    _ => 0.0,
                })
                .collect()
        }
        _ => {
            // max/min: the gradient is shared evenly by the elements that attain the extreme.
            let yb =
                te(te(y.reshape(kept.clone()))?.broadcast_to(x.shape().to_vec()))?.to_f64_vec();
            let xv = x.to_f64_vec();
            let hit: Vec<f64> = xv
                .iter()
                .zip(&yb)
                .map(|(a, b)| if a == b { 1.0 } else { 0.0 })
                .collect();
            let counts = te(unbroadcast(&hit, x.shape(), &kept, DType::Float64))?;
            let cb = te(counts.broadcast_to(x.shape().to_vec()))?.to_f64_vec();
            (0..xv.len())
                .map(|i| hit[i] * gb[i] / cb[i].max(1.0))
                .collect()
        }
    };
    Ok(vec![Some(OpValue::Tensor(te(make(
        x.shape(),
        dx,
        x.dtype(),
    ))?))])
}

/// The shape of reducing `shape` over the axes `reduced` with keepdims: reduced axes are 1, so
/// it broadcasts back onto `shape`.
fn keepdims_shape(shape: &[usize], reduced: &[bool]) -> Vec<usize> {
    shape
        .iter()
        .zip(reduced)
        .map(|(&d, &r)| if r { 1 } else { d })
        .collect()
}

/// For each element of a tensor of `shape` (row-major), the index of its group when the axes
/// `reduced` are reduced: its place in the keepdims result.
fn group_of_each(shape: &[usize], reduced: &[bool]) -> Vec<usize> {
    let total: usize = shape.iter().product();
    let mut out = Vec::with_capacity(total);
    let mut coord = vec![0usize; shape.len()];
    for _ in 0..total {
        let mut k = 0;
        for ((&c, &d), &r) in coord.iter().zip(shape).zip(reduced) {
            k = k * if r { 1 } else { d } + if r { 0 } else { c };
        }
        out.push(k);
        // The next coordinate, last axis fastest.
        for (c, &d) in coord.iter_mut().zip(shape).rev() {
            *c += 1;
            if *c < d {
                break;
            }
            *c = 0;
        }
    }
    out
}

/// `variance(x, m)` = `Σ (x - m)² / count` over the reduced axes: `dx = 2 (x - m) / count · dy`
/// (broadcast back), `dm` the negated sum of that onto `m`'s shape.
fn variance(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("{}: gradient: {m}", op.name));
    let (Some(OpValue::Tensor(x)), Some(OpValue::Tensor(m))) = (args.first(), args.get(1)) else {
        return Err(err("data and mean must be tensors".into()));
    };
    if !x.dtype().is_float() {
        return Ok(vec![None, None]);
    }
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new(op.name, &tys, attrs, 2)?;
    let reduced = reduce_axes(&c, c.tensor(0, "data")?)?;
    let unbiased = c.bool_or("unbiased", false)?;
    let kept = keepdims_shape(x.shape(), &reduced);
    let count = crate::kernel::reduce::variance_divisor(x.shape(), &reduced, unbiased);
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    let gb = te(te(g.reshape(kept))?.broadcast_to(x.shape().to_vec()))?.to_f64_vec();
    let mb = te(m.broadcast_to(x.shape().to_vec()))?.to_f64_vec();
    let dx: Vec<f64> = x
        .to_f64_vec()
        .iter()
        .zip(&mb)
        .zip(&gb)
        .map(|((&v, &mu), &d)| 2.0 * (v - mu) / count * d)
        .collect();
    let neg: Vec<f64> = dx.iter().map(|v| -v).collect();
    let dm = te(unbroadcast(&neg, x.shape(), m.shape(), m.dtype()))?;
    Ok(vec![
        Some(OpValue::Tensor(te(make(x.shape(), dx, x.dtype()))?)),
        Some(OpValue::Tensor(dm)),
    ])
}

/// `nn.dense(x (…, K), w (N, K))`: `dx = dy · w`, `dw = dyᵀ · x` over all leading rows.
fn dense(args: &[OpValue], g: &Tensor) -> Result<Vec<Option<OpValue>>, String> {
    let (Some(OpValue::Tensor(x)), Some(OpValue::Tensor(w))) = (args.first(), args.get(1)) else {
        return Err("arguments must be tensors".into());
    };
    let (&[n, k], Some(&kx)) = (w.shape(), x.shape().last()) else {
        return Err("weight must be a matrix".into());
    };
    if kx != k || !x.dtype().is_float() {
        return Err("shapes or dtypes do not match".into());
    }
    let m = x.len() / k.max(1);
    if g.len() != m * n {
        return Err("the output gradient does not match the product".into());
    }
    let (xv, wv, gv) = (x.to_f64_vec(), w.to_f64_vec(), g.to_f64_vec());
    let mut dx = vec![0.0; m * k];
    let mut dw = vec![0.0; n * k];
    for r in 0..m {
        for j in 0..n {
            let d = gv[r * n + j];
            if d == 0.0 {
                continue;
            }
            for c in 0..k {
                dx[r * k + c] += d * wv[j * k + c];
                dw[j * k + c] += d * xv[r * k + c];
            }
        }
    }
    let dx = make(x.shape(), dx, x.dtype()).map_err(|e| e.to_string())?;
    let dw = make(w.shape(), dw, w.dtype()).map_err(|e| e.to_string())?;
    Ok(vec![Some(OpValue::Tensor(dx)), Some(OpValue::Tensor(dw))])
}

/// `nn.batch_matmul(a, b)`: `y[i] = A[i] · B[i]` with `A = a` or `aᵀ`, `B = bᵀ` or `b` per the
/// transpose flags; a batch of 1 broadcasts (its gradient sums over the batch).
fn batch_matmul(
    args: &[OpValue],
    attrs: &Attrs,
    y: &Tensor,
    g: &Tensor,
) -> Result<Vec<Option<OpValue>>, String> {
    let (Some(OpValue::Tensor(a)), Some(OpValue::Tensor(b))) = (args.first(), args.get(1)) else {
        return Err("arguments must be tensors".into());
    };
    let ta = attrs.bool("transpose_a")?.unwrap_or(false);
    let tb = attrs.bool("transpose_b")?.unwrap_or(true);
    let (&[ba, a1, a2], &[bb, b1, b2], &[bt, m, n]) = (a.shape(), b.shape(), y.shape()) else {
        return Err("operands must be rank 3".into());
    };
    let kk = if ta { a1 } else { a2 };
    if (if tb { b2 } else { b1 }) != kk {
        return Err("inner dimensions differ".into());
    }
    let (av, bv, gv) = (a.to_f64_vec(), b.to_f64_vec(), g.to_f64_vec());
    let expect = |batch: usize, r: usize, c: usize| batch == 1 || batch == bt || r * c == 0;
    if gv.len() != bt * m * n
        || !expect(ba, a1, a2)
        || !expect(bb, b1, b2)
        || (if ta { a2 } else { a1 }) != m
        || (if tb { b1 } else { b2 }) != n
    {
        return Err("operand shapes do not match the result".into());
    }
    let mut da = vec![0.0; av.len()];
    let mut db = vec![0.0; bv.len()];
    for i in 0..bt {
        let ia = if ba == 1 { 0 } else { i };
        let ib = if bb == 1 { 0 } else { i };
        for r in 0..m {
            for c in 0..n {
                let d = gv[(i * m + r) * n + c];
                if d == 0.0 {
                    continue;
                }
                for q in 0..kk {
                    let pa = if ta {
                        (ia * a1 + q) * a2 + r
                    } else {
                        (ia * a1 + r) * a2 + q
                    };
                    let pb = if tb {
                        (ib * b1 + c) * b2 + q
                    } else {
                        (ib * b1 + q) * b2 + c
                    };
                    da[pa] += d * bv[pb];
                    db[pb] += d * av[pa];
                }
            }
        }
    }
    let f = |t: &Tensor, v: Vec<f64>| {
        (t.dtype().is_float())
            .then(|| make(t.shape(), v, t.dtype()).map(OpValue::Tensor))
            .transpose()
            .map_err(|e| e.to_string())
    };
    Ok(vec![f(a, da)?, f(b, db)?])
}

/// `take` along an axis without batch dims (an embedding lookup): `dy`'s slices added to the
/// rows they were read from, directly. The general index-map rule would build an iota of the
/// whole table per lookup; this costs the table's zeroing and the lookup's own size. `None` for
/// other forms of `take`.
fn take_rows(args: &[OpValue], attrs: &Attrs, g: &Tensor) -> Result<Option<Tensor>, KernelError> {
    use crate::kernel::layout::resolve_index;
    use crate::rel::layout::take_spec;
    let (Some(OpValue::Tensor(x)), Some(OpValue::Tensor(idx))) = (args.first(), args.get(1)) else {
        return Ok(None);
    };
    let tys: Vec<_> = args.iter().map(ty_of).collect();
    let c = Call::new("take", &tys, attrs, 2)?;
    let spec = take_spec(&c, c.tensor(0, "input")?, c.tensor(1, "indices")?)?;
    let Some((axis, 0)) = spec.axis else {
        return Ok(None);
    };
    let err = |m: String| KernelError::new(format!("take: gradient: {m}"));
    let xs = x.shape();
    let n = xs.get(axis).copied().unwrap_or(0);
    let pre: usize = xs.get(..axis).unwrap_or_default().iter().product();
    let post: usize = xs.get(axis + 1..).unwrap_or_default().iter().product();
    let iv = idx.to_i64_vec();
    if g.len() != pre * iv.len() * post {
        return Err(err("the output gradient does not match the lookup".into()));
    }
    let mut rows = Vec::with_capacity(iv.len());
    for &i in &iv {
        rows.push(resolve_index(i, n, spec.mode).map_err(err)?);
    }
    // An f32 table's gradient is accumulated in f32: converting a whole embedding table from
    // f64 per lookup would cost more than the lookup.
    if let Some(gf) = g.as_slice::<f32>().filter(|_| x.dtype() == DType::Float32) {
        let mut acc = vec![0.0f32; x.len()];
        scatter_rows(&mut acc, gf, &rows, pre, n, post);
        return Tensor::from_vec(xs.to_vec(), acc)
            .map(Some)
            .map_err(|e| err(e.to_string()));
    }
    let gv = g.to_f64_vec();
    let mut acc = vec![0.0f64; x.len()];
    scatter_rows(&mut acc, &gv, &rows, pre, n, post);
    make(xs, acc, x.dtype())
        .map(Some)
        .map_err(|e| err(e.to_string()))
}

fn scatter_rows<T: Copy + std::ops::AddAssign>(
    acc: &mut [T],
    g: &[T],
    rows: &[usize],
    pre: usize,
    n: usize,
    post: usize,
) {
    let mut at = 0;
    for p in 0..pre {
        for &r in rows {
            let base = (p * n + r) * post;
            if let (Some(dst), Some(src)) = (acc.get_mut(base..base + post), g.get(at..at + post)) {
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s);
            }
            at += post;
        }
    }
}

/// Layout operators: the index map from running the kernel on iotas, `dy` scatter-added back.
fn layout(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    dy: &OpValue,
) -> Result<Vec<Option<OpValue>>, KernelError> {
    let err = |m: String| KernelError::new(format!("{}: gradient: {m}", op.name));
    let te = |r: Result<Tensor, tumble_tensor::TensorError>| r.map_err(|e| err(e.to_string()));
    // The data argument: the first (a tuple for concatenate); take's indices stay as they are.
    let data: Vec<&Tensor> = match args.first() {
        Some(OpValue::Tensor(t)) => vec![t],
        Some(OpValue::Tuple(ts)) => ts.iter().collect(),
        None => return Err(err("missing input".into())),
    };
    if data.iter().any(|t| !t.dtype().is_float()) {
        return Ok(vec![None; args.len()]);
    }
    let mut offset = 0i64;
    let mut iotas = Vec::with_capacity(data.len());
    for t in &data {
        let n = t.len() as i64;
        iotas.push(te(Tensor::from_vec(
            t.shape().to_vec(),
            (offset..offset + n).collect::<Vec<i64>>(),
        ))?);
        offset += n;
    }
    let mut iargs = args.to_vec();
    if let Some(first) = iargs.first_mut() {
        *first = match first {
            OpValue::Tensor(_) => OpValue::Tensor(iotas.remove(0)),
            OpValue::Tuple(_) => OpValue::Tuple(iotas),
        };
    }
    let mut rng = tumble_tensor::Rng::new(0);
    let map = crate::eval(op, &iargs, attrs, &mut OpCtx { rng: &mut rng })?;
    let (srcs, grads): (Vec<i64>, Vec<f64>) = match (&map, dy) {
        (OpValue::Tensor(m), OpValue::Tensor(d)) => (m.to_i64_vec(), d.to_f64_vec()),
        (OpValue::Tuple(ms), OpValue::Tuple(ds)) => (
            ms.iter().flat_map(Tensor::to_i64_vec).collect(),
            ds.iter().flat_map(Tensor::to_f64_vec).collect(),
        ),
        _ => return Err(err("output gradient does not match the result".into())),
    };
    let total = usize::try_from(offset).unwrap_or(0);
    let mut acc = vec![0.0; total];
    for (s, d) in srcs.iter().zip(&grads) {
        if let Some(slot) = usize::try_from(*s).ok().and_then(|s| acc.get_mut(s)) {
            *slot += d;
        }
    }
    let mut start = 0usize;
    let mut parts = Vec::with_capacity(data.len());
    for t in &data {
        let end = start + t.len();
        parts.push(te(make(
            t.shape(),
            acc.get(start..end).unwrap_or_default().to_vec(),
            t.dtype(),
        ))?);
        start = end;
    }
    let first = match args.first() {
        Some(OpValue::Tuple(_)) => OpValue::Tuple(parts),
        _ => OpValue::Tensor(parts.remove(0)),
    };
    let mut out = vec![None; args.len()];
    if let Some(slot) = out.first_mut() {
        *slot = Some(first);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
