//! Host scalars on the fast path: a block of integer and boolean scalar arithmetic and
//! comparisons (a loop counter's `%n == 0` and `%n - 1`, a bound's `less(%i, %n)`) computed on
//! the invocation's values directly, instead of through the reference kernels' general
//! evaluation (operand checks, broadcasting, shape relations, allocations: ~0.6 µs for a scalar
//! `equal`, which made a counted loop's recording 4× what it launches). The results are the
//! reference's exactly: integers wrap as its `i64` arithmetic does once narrowed, comparisons
//! are exact. An element of an integer vector input (`take(%toks, %k)`) or of an input's shape
//! (`take(shape_of(%x), 0)`), and `ndarray_size(%x)`, are read directly too. Anything else
//! (floats' arithmetic, other shapes than `()`, operators not listed, mixed dtypes) returns
//! `None`, and the caller runs the reference.

use std::borrow::Borrow;

use tumble_compile::{BArg, BVal, Block};
use tumble_ir::DType;
use tumble_tensor::Tensor;

#[derive(Clone, Copy, PartialEq)]
enum S {
    I32(i32),
    I64(i64),
    F32(f32),
    Bool(bool),
}

impl S {
    fn of(t: &Tensor) -> Option<S> {
        if t.rank() != 0 {
            return None;
        }
        Some(match t.dtype() {
            DType::Int32 => S::I32(*t.as_slice::<i32>()?.first()?),
            DType::Int64 => S::I64(*t.as_slice::<i64>()?.first()?),
            DType::Float32 => S::F32(*t.as_slice::<f32>()?.first()?),
            DType::Bool => S::Bool(*t.as_slice::<bool>()?.first()?),
            _ => return None,
        })
    }

    fn dtype(self) -> DType {
        match self {
            S::I32(_) => DType::Int32,
            S::I64(_) => DType::Int64,
            S::F32(_) => DType::Float32,
            S::Bool(_) => DType::Bool,
        }
    }

    fn tensor(self) -> Tensor {
        match self {
            S::I32(x) => Tensor::scalar_i32(x),
            S::I64(x) => Tensor::scalar_i64(x),
            S::F32(x) => Tensor::scalar_f32(x),
            S::Bool(x) => Tensor::scalar_bool(x),
        }
    }
}

/// A block's outputs computed on the host (most have one).
pub(crate) type HostOuts = smallvec::SmallVec<[Tensor; 2]>;

/// The most elements of an integer input a host block may read (an instance's token ids, an
/// edge list): beyond that a block is launched like any other.
pub(crate) const HOST_VECTOR_ELEMENTS: usize = 4096;

/// Whether `t` may be an input of a block run on the host: a value of at most one element, or a
/// rank-1 integer or boolean vector of at most [`HOST_VECTOR_ELEMENTS`].
pub(crate) fn host_input(t: &Tensor) -> bool {
    t.len() <= 1
        || (t.rank() == 1
            && (t.dtype().is_int() || t.dtype() == DType::Bool)
            && t.len() <= HOST_VECTOR_ELEMENTS)
}

/// Element `k` of the integer vector `v`, `k` clipped into range (`take`'s default mode); `None`
/// for an empty vector or one not of int32 or int64.
pub(crate) fn clipped_element(v: &Tensor, k: i64) -> Option<i64> {
    let i = k.clamp(0, (v.len() as i64).checked_sub(1)?) as usize;
    match v.dtype() {
        DType::Int32 => v.as_slice::<i32>()?.get(i).map(|&x| i64::from(x)),
        DType::Int64 => v.as_slice::<i64>()?.get(i).copied(),
        _ => None,
    }
}

/// One operator on scalar operands, as the reference computes it; `None`: not on this path.
fn apply(op: &str, args: &[S]) -> Option<S> {
    use S::*;
    let int = |f: fn(i64, i64) -> i64| -> Option<S> {
        match *args {
            [I32(a), I32(b)] => Some(I32(f(i64::from(a), i64::from(b)) as i32)),
            [I64(a), I64(b)] => Some(I64(f(a, b))),
            _ => None,
        }
    };
    let cmp = |f: fn(std::cmp::Ordering) -> bool| -> Option<S> {
        let o = match *args {
            [I32(a), I32(b)] => a.cmp(&b),
            [I64(a), I64(b)] => a.cmp(&b),
            // (NaN compares false every way but `!=`: not on this path.)
            [F32(a), F32(b)] => a.partial_cmp(&b)?,
            _ => return None,
        };
        Some(Bool(f(o)))
    };
    // Division and remainders of integers by the reference's own rules (`tumble_ops::int_div`
    // …), `None` for a zero divisor: the reference kernel then reports it.
    let div = |f: fn(i64, i64) -> Result<i64, &'static str>| -> Option<S> {
        match *args {
            [I32(a), I32(b)] => Some(I32(f(i64::from(a), i64::from(b)).ok()? as i32)),
            [I64(a), I64(b)] => Some(I64(f(a, b).ok()?)),
            _ => None,
        }
    };
    let logic = |f: fn(bool, bool) -> bool| -> Option<S> {
        match *args {
            [Bool(a), Bool(b)] => Some(Bool(f(a, b))),
            _ => None,
        }
    };
    match op {
        "add" => int(i64::wrapping_add),
        "subtract" => int(i64::wrapping_sub),
        "multiply" => int(i64::wrapping_mul),
        // A loop counter's period test, `floor_mod(%t, %p) == 0` (a clockwork RNN's modules): the
        // reference kernels took 6,500 instructions an evaluation.
        "divide" => div(tumble_ops::int_div),
        "mod" => div(tumble_ops::int_mod),
        "floor_divide" => div(tumble_ops::int_floor_div),
        "floor_mod" => div(tumble_ops::int_floor_mod),
        "equal" => cmp(|o| o.is_eq()),
        "not_equal" => cmp(|o| o.is_ne()),
        "less" => cmp(|o| o.is_lt()),
        "greater" => cmp(|o| o.is_gt()),
        "less_equal" => cmp(|o| o.is_le()),
        "greater_equal" => cmp(|o| o.is_ge()),
        "logical_and" => logic(|a, b| a && b),
        "logical_or" => logic(|a, b| a || b),
        "logical_xor" => logic(|a, b| a != b),
        "logical_not" => match *args {
            [Bool(a)] => Some(Bool(!a)),
            _ => None,
        },
        _ => None,
    }
}

/// A value on this path: a scalar, or integers of which a `take` reads one.
#[derive(Clone, Copy)]
enum HostVal<'a> {
    Scalar(S),
    /// A rank-1 integer input's elements (an instance's tokens).
    Elements(&'a Tensor),
    /// An input's shape (`shape_of(%x)`, whatever `%x`'s dtype and size).
    Shape(&'a [usize]),
}

/// Block value `v`: an input's (`ins`), a node's (`vals`) or a literal scalar.
fn host_value<'a>(
    v: &BVal,
    ins: &[Option<HostVal<'a>>],
    vals: &[HostVal<'a>],
) -> Option<HostVal<'a>> {
    match v {
        BVal::Input(i) => ins.get(*i as usize).copied().flatten(),
        BVal::Node(n) => vals.get(*n as usize).copied(),
        BVal::Const(t) => S::of(t).map(HostVal::Scalar),
        BVal::Field(..) => None,
    }
}

/// `n` as the scalar node `node` declares: int32 (when it fits) or int64.
fn declared_int(node: &tumble_compile::BlockNode, n: i64) -> Option<S> {
    match node.ty.as_tensor()? {
        ([], DType::Int32) => Some(S::I32(i32::try_from(n).ok()?)),
        ([], DType::Int64) => Some(S::I64(n)),
        _ => None,
    }
}

/// The most operators of a block this path evaluates.
const MAX_NODES: usize = 16;

/// The values of a block's first nodes computed on this path (see [`eval`]).
struct Evaluated<'a> {
    ins: smallvec::SmallVec<[Option<HostVal<'a>>; 8]>,
    vals: smallvec::SmallVec<[HostVal<'a>; MAX_NODES]>,
}

impl<'a> Evaluated<'a> {
    fn value(&self, v: &BVal) -> Option<HostVal<'a>> {
        host_value(v, &self.ins, &self.vals)
    }

    fn scalar(&self, v: &BVal) -> Option<S> {
        match self.value(v)? {
            HostVal::Scalar(s) => Some(s),
            _ => None,
        }
    }
}

/// The first `upto` nodes of `block` on `inputs` when each is a scalar this path computes (see
/// the module) — besides integer vectors and shapes that `take` reads one element of — `None`
/// otherwise. (Inputs by reference or owned: the weight slices pass the invocation's arguments
/// where they lie.)
fn run<'a, T: Borrow<Tensor>>(
    block: &Block,
    inputs: &'a [T],
    upto: usize,
) -> Option<Evaluated<'a>> {
    if inputs.len() != block.inputs.len() || upto > MAX_NODES {
        return None;
    }
    let mut e = Evaluated {
        ins: inputs
            .iter()
            .map(|t| {
                let t: &'a Tensor = t.borrow();
                match S::of(t) {
                    Some(s) => Some(HostVal::Scalar(s)),
                    None if t.rank() == 1 && t.dtype().is_int() => Some(HostVal::Elements(t)),
                    None => None,
                }
            })
            .collect(),
        vals: smallvec::SmallVec::new(),
    };
    let input = |i: &u32| {
        inputs
            .get(*i as usize)
            .map(|t| -> &'a Tensor { t.borrow() })
    };
    for node in block.nodes.get(..upto)? {
        let out = match (node.op.name, node.args.as_slice()) {
            ("shape_of", [BArg::One(BVal::Input(i))]) => HostVal::Shape(input(i)?.shape()),
            ("ndarray_size", [BArg::One(BVal::Input(i))]) => {
                HostVal::Scalar(declared_int(node, input(i)?.len() as i64)?)
            }
            // One element of a vector or shape, by a scalar (no attributes: the whole tensor
            // flattened, clip mode).
            ("take", [BArg::One(x), BArg::One(k)]) if node.attrs.is_empty() => {
                let k = match e.scalar(k)? {
                    S::I32(k) => i64::from(k),
                    S::I64(k) => k,
                    _ => return None,
                };
                let elem = match e.value(x)? {
                    HostVal::Elements(v) => clipped_element(v, k)?,
                    HostVal::Shape(dims) => {
                        let last = (dims.len() as i64).checked_sub(1)?;
                        *dims.get(k.clamp(0, last) as usize)? as i64
                    }
                    HostVal::Scalar(_) => return None,
                };
                HostVal::Scalar(declared_int(node, elem)?)
            }
            _ => {
                if !node.attrs.is_empty() || node.args.len() > 2 {
                    return None;
                }
                let mut args = [S::Bool(false); 2];
                for (slot, a) in args.iter_mut().zip(&node.args) {
                    let BArg::One(v) = a else { return None };
                    *slot = e.scalar(v)?;
                }
                let out = apply(node.op.name, args.get(..node.args.len())?)?;
                // The node's declared type: a rank-0 tensor of the dtype computed.
                match node.ty.as_tensor() {
                    Some((dims, dtype)) if dims.is_empty() && dtype == out.dtype() => {}
                    _ => return None,
                }
                HostVal::Scalar(out)
            }
        };
        e.vals.push(out);
    }
    Some(e)
}

/// `block`'s outputs on `inputs` when every value is a scalar this path computes (see the
/// module) — besides integer vectors and shapes that `take` reads one element of, and
/// `ndarray_size` — `None` otherwise.
pub(crate) fn eval(block: &Block, inputs: &[Tensor]) -> Option<HostOuts> {
    let e = run(block, inputs, block.nodes.len())?;
    block
        .outputs
        .iter()
        .map(|v| e.scalar(v).map(S::tensor))
        .collect()
}

/// The integer `index` of `block` — an input of one element, or a value its first `upto` nodes
/// compute on this path (a typed edge's `take(%types, %k)`) — on the invocation's `inputs`;
/// `None` where this path does not compute it (the caller runs the reference kernels).
pub(crate) fn integer<T: Borrow<Tensor>>(
    block: &Block,
    inputs: &[T],
    upto: usize,
    index: &BVal,
) -> Option<i64> {
    let e = run(block, inputs, upto)?;
    match e.value(index)? {
        HostVal::Scalar(S::I32(i)) => Some(i64::from(i)),
        HostVal::Scalar(S::I64(i)) => Some(i),
        // A `(1)` index (a token) is read as its element.
        HostVal::Elements(v) if v.len() == 1 => clipped_element(v, 0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operator of the path against the reference kernel, on values at the types' edges
    /// (wrapping, signs, NaN refused).
    #[test]
    fn scalars_as_the_reference_computes_them() {
        let ops = [
            "add",
            "subtract",
            "multiply",
            "divide",
            "mod",
            "floor_divide",
            "floor_mod",
            "equal",
            "not_equal",
            "less",
            "greater",
            "less_equal",
            "greater_equal",
            "logical_and",
            "logical_or",
            "logical_xor",
        ];
        let i32s = [i32::MIN, -7, -1, 0, 1, 3, i32::MAX];
        let i64s = [i64::MIN, -5, 0, 2, i64::MAX];
        let f32s = [f32::NEG_INFINITY, -1.5, -0.0, 0.0, 2.25, f32::NAN];
        let bools = [false, true];
        let mut pairs: Vec<(Tensor, Tensor)> = Vec::new();
        for &a in &i32s {
            for &b in &i32s {
                pairs.push((Tensor::scalar_i32(a), Tensor::scalar_i32(b)));
            }
        }
        for &a in &i64s {
            for &b in &i64s {
                pairs.push((Tensor::scalar_i64(a), Tensor::scalar_i64(b)));
            }
        }
        for &a in &f32s {
            for &b in &f32s {
                pairs.push((Tensor::scalar_f32(a), Tensor::scalar_f32(b)));
            }
        }
        for &a in &bools {
            for &b in &bools {
                pairs.push((Tensor::scalar_bool(a), Tensor::scalar_bool(b)));
            }
        }
        let mut checked = 0;
        for op in ops {
            let Some(def) = tumble_ops::lookup(op) else {
                panic!("{op}")
            };
            for (a, b) in &pairs {
                let (Some(x), Some(y)) = (S::of(a), S::of(b)) else {
                    panic!("scalars")
                };
                let Some(fast) = apply(op, &[x, y]) else {
                    continue;
                };
                let args = [
                    tumble_ops::OpValue::Tensor(a.clone()),
                    tumble_ops::OpValue::Tensor(b.clone()),
                ];
                let mut rng = tumble_tensor::Rng::new(0);
                let mut octx = tumble_ops::OpCtx { rng: &mut rng };
                let reference =
                    tumble_ops::eval(def, &args, &tumble_ir::Attrs::default(), &mut octx)
                        .unwrap_or_else(|e| panic!("{op}: {}", e.message));
                let tumble_ops::OpValue::Tensor(r) = reference else {
                    panic!("{op}: not a tensor")
                };
                assert!(
                    S::of(&r) == Some(fast) && r.dtype() == fast.tensor().dtype(),
                    "{op} on {a:?}, {b:?}"
                );
                checked += 1;
            }
        }
        assert!(checked > 500, "{checked}");
    }
}
