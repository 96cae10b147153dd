//! Operators that reduce along axes: normalizations (`nn.softmax`, `nn.log_softmax`,
//! `nn.layer_norm`), reductions (`sum`, `mean`, `max`, `min`), `argmax`/`argmin`, and the scans
//! `cumsum`/`cumprod` (same shape, or flattened without an axis).

use super::{dims_match, relations, Call, Tensor};
use crate::RelError;
use tumble_ir::{Attrs, DType, Dim, Ty};

relations! {
    softmax => softmax_like("nn.softmax");
    log_softmax => softmax_like("nn.log_softmax");
    sum => reduction("sum", None);
    prod => reduction("prod", None);
    all => bool_reduction("all");
    any => bool_reduction("any");
    mean => reduction("mean", None);
    max => reduction("max", None);
    min => reduction("min", None);
    argmax => reduction("argmax", Some(DType::Int32));
    argmin => reduction("argmin", Some(DType::Int32));
}

/// `nn.softmax(data, axis=-1)` and `nn.log_softmax`: same type as the input.
fn softmax_like(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    c.axis(c.int_or("axis", -1)?, x.rank())?;
    Ok(x.ty.clone())
}

/// `nn.layer_norm(data, gamma, beta, axis=-1, epsilon=1e-5, center=True, scale=True)`.
pub fn layer_norm(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("nn.layer_norm", args, attrs, 3)?;
    let x = c.tensor(0, "input")?;
    c.want_float(0, "input", x)?;
    let axis = c.axis(c.int_or("axis", -1)?, x.rank())?;
    if let Some(eps) = c.opt_float("epsilon")? {
        if eps.is_nan() || eps < 0.0 {
            return Err(c.err(format!("epsilon must be non-negative, found {eps:?}")));
        }
    }
    c.bool_or("center", true)?;
    c.bool_or("scale", true)?;
    let want = x.shape.get(axis).copied().unwrap_or(Dim::Any);
    for (i, role) in [(1, "gamma"), (2, "beta")] {
        let p = c.tensor(i, role)?;
        c.same_dtype(x, p)?;
        let [len] = *p.shape else {
            return Err(c.err_at(
                i,
                format!("{role} must be 1-D, found rank {} in {p}", p.rank()),
            ));
        };
        if !dims_match(len, want) {
            return Err(c.err(format!(
                "{role} has length {len} but input has {want} along axis {axis}"
            )));
        }
    }
    Ok(x.ty.clone())
}

/// The axes a reduction reduces: `axis` (int, list or None = all), complemented when `exclude`.
/// An empty list means all axes, as in Relay.
pub(crate) fn reduce_axes(c: &Call, x: Tensor) -> Result<Vec<bool>, RelError> {
    let rank = x.rank();
    let exclude = c.bool_or("exclude", false)?;
    match c.opt_ints("axis")? {
        None => Ok(vec![true; rank]),
        Some(list) if list.is_empty() => Ok(vec![true; rank]),
        Some(list) => {
            let axes = c.axes(&list, rank)?;
            let mut reduced = vec![exclude; rank];
            for a in axes {
                if let Some(slot) = reduced.get_mut(a) {
                    *slot = !exclude;
                }
            }
            Ok(reduced)
        }
    }
}

/// `sum`/`mean`/`max`/`min(data, axis=None, keepdims=False, exclude=False)` keep the dtype;
/// `argmax`/`argmin` (also `select_last_index=False`) give int32.
fn reduction(
    op: &'static str,
    args: &[Ty],
    attrs: &Attrs,
    out: Option<DType>,
) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_numeric(0, "input", x)?;
    reduced_type(&c, x, out)
}

/// `variance(data, mean, axis=None, keepdims=False, exclude=False, unbiased=False)`: float data,
/// a mean of its dtype that broadcasts onto it (the keepdims mean `relay.variance` passes); the
/// reduced type.
pub fn variance(args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new("variance", args, attrs, 2)?;
    let x = c.tensor(0, "data")?;
    c.want_float(0, "data", x)?;
    let m = c.tensor(1, "mean")?;
    c.same_dtype(x, m)?;
    c.bool_or("unbiased", false)?;
    if x.rank() == 0 {
        return Err(c.err("data must have at least one axis".to_string()));
    }
    // As TVM's: the mean has the data's rank, 1 along each reduced axis (a mean without
    // keepdims broadcast onto the data would line up with the wrong axes: a wrong variance).
    let reduced = reduce_axes(&c, x)?;
    let fits = m.rank() == x.rank()
        && m.shape
            .iter()
            .zip(x.shape.iter())
            .zip(&reduced)
            .all(|((&a, &b), &r)| {
                matches!(a, Dim::Known(1) | Dim::Any) || (!r && dims_match(a, b))
            });
    if !fits {
        return Err(c.err(format!(
            "mean {m} is not data {x} reduced with keepdims=True (give the mean with keepdims=True)"
        )));
    }
    reduced_type(&c, x, None)
}

/// `all(data, axis, keepdims, exclude)` and `any`: a bool input, a bool result.
fn bool_reduction(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    c.want_bool(0, "input", x)?;
    reduced_type(&c, x, None)
}

/// The type of reducing `x` as `c`'s attributes say (`axis`, `keepdims`, `exclude`), of dtype
/// `out` (else `x`'s).
fn reduced_type(c: &Call, x: Tensor<'_>, out: Option<DType>) -> Result<Ty, RelError> {
    let keepdims = c.bool_or("keepdims", false)?;
    if out.is_some() {
        c.bool_or("select_last_index", false)?;
    }
    let reduced = reduce_axes(c, x)?;
    let mut shape = Vec::with_capacity(x.rank());
    for (&d, &r) in x.shape.iter().zip(&reduced) {
        if !r {
            shape.push(d);
        } else if keepdims {
            shape.push(Dim::Known(1));
        }
    }
    Ok(Ty::tensor(shape, out.unwrap_or(x.dtype)))
}

relations! {
    cumsum => scan("cumsum");
    cumprod => scan("cumprod");
}

/// `cumsum(data, axis=None, dtype=None, exclusive=None)` and `cumprod`: running sums (products)
/// along `axis`, in `dtype` (default the input's; numeric). Without an axis, over the flattened
/// input, giving a 1-D result.
fn scan(op: &'static str, args: &[Ty], attrs: &Attrs) -> Result<Ty, RelError> {
    let c = Call::new(op, args, attrs, 1)?;
    let x = c.tensor(0, "input")?;
    let (axis, dtype, _) = scan_spec(&c, x)?;
    if axis.is_some() {
        return Ok(Ty::tensor(x.shape.to_vec(), dtype));
    }
    let n = match super::known_product(x.shape) {
        Some(n) => Dim::Known(n),
        None if x.shape.iter().all(|d| d.known().is_some()) => {
            return Err(c.err(format!("the flattened size of {x} overflows")))
        }
        None => Dim::Any,
    };
    Ok(Ty::tensor(vec![n], dtype))
}

/// A scan's attributes, checked: the normalized axis (`None`: over the flattened input), the
/// result dtype and `exclusive`.
pub(crate) fn scan_spec(c: &Call, x: Tensor) -> Result<(Option<usize>, DType, bool), RelError> {
    let dtype = c.opt_dtype("dtype")?.unwrap_or(x.dtype);
    if dtype == DType::Bool {
        return Err(c.err(format!(
            "the result dtype must be numeric, found bool (for a count of a bool {x}, give \
             dtype=\"int32\")"
        )));
    }
    let axis = c
        .opt_int("axis")?
        .map(|a| c.axis(a, x.rank()))
        .transpose()?;
    Ok((axis, dtype, c.bool_or("exclusive", false)?))
}
