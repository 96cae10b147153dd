#!/usr/bin/env python3
"""Writes cases.json: golden input/output cases for tumble's reference kernels, computed by numpy.

Run once and commit the output together with this script (the Rust test `tests/golden.rs` reads
cases.json; it never runs Python):

    python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install numpy
    /tmp/golden-venv/bin/python crates/ops/tests/golden/gen_golden.py

Format: a JSON list of cases
    {"op": "nn.softmax", "note": "...", "attrs": {"axis": 1},
     "inputs": [VALUE, ...], "expected": VALUE}
where VALUE is a tensor {"shape": [2, 3], "dtype": "float32", "data": [... row-major ...]} or a
tuple {"tuple": [TENSOR, ...]}. Attribute names and values are Relay's (ints, floats, bools,
strings, lists of ints). Float data that is not finite is written as the strings "nan", "inf",
"-inf".

Conventions:
- Inputs are random (fixed seed) but dyadic (multiples of 1/64), so they print short and exact.
- Float results are computed in float64 from the (exact) inputs and rounded once to the output
  dtype: that is the exact answer to within one rounding, which the Rust kernels (f64
  accumulation) must match within rtol 1e-5 / atol 1e-6 for float32.
- Where Relay/TVM semantics differ from numpy's defaults, the script spells out Relay's: integer
  `divide` truncates toward zero; `take` with batch_dims is written as loops; `argmax` over
  several axes flattens the reduced axes; `select_last_index` picks the last tie.
"""

import json
import os

import numpy as np

rng = np.random.default_rng(20240611)
cases = []

F32, F64, I32, I64, BOOL = np.float32, np.float64, np.int32, np.int64, np.bool_


# ---- input makers -------------------------------------------------------------------------------

def fr(*shape, dtype=F32, lo=-4.0, hi=4.0):
    """Random dyadic floats (multiples of 1/64) in [lo, hi]."""
    k = rng.integers(int(lo * 64), int(hi * 64) + 1, size=shape)
    return (k / 64.0).astype(dtype)


def ir(*shape, dtype=I32, lo=-9, hi=9):
    return rng.integers(lo, hi + 1, size=shape).astype(dtype)


def br(*shape):
    return rng.integers(0, 2, size=shape).astype(BOOL)


def ties(*shape, dtype=F32):
    """Small integers as floats: many equal values (ties for argmax, equality for comparisons)."""
    return rng.integers(0, 4, size=shape).astype(dtype)


# ---- encoding -----------------------------------------------------------------------------------

def num(x, dtype):
    x = float(x)
    if np.isnan(x):
        return "nan"
    if np.isinf(x):
        return "inf" if x > 0 else "-inf"
    if dtype == "float32":
        # The shortest decimal that reads back as this float32.
        return float(str(np.float32(x)))
    return x


def enc(a):
    if isinstance(a, tuple):
        return {"tuple": [enc(t) for t in a]}
    a = np.asarray(a)
    dt = str(a.dtype)
    flat = a.ravel()
    if dt in ("float32", "float64"):
        data = [num(x, dt) for x in flat]
    elif dt in ("int32", "int64"):
        data = [int(x) for x in flat]
    elif dt == "bool":
        data = [bool(x) for x in flat]
    else:
        raise ValueError(dt)
    return {"shape": list(a.shape), "dtype": dt, "data": data}


def case(op, inputs, expected, note="", **attrs):
    cases.append({
        "op": op,
        "note": note,
        "attrs": attrs,
        "inputs": [enc(x) for x in inputs],
        "expected": enc(expected),
    })


def f64(a):
    return np.asarray(a).astype(F64)


def like(result64, x):
    """A float64 result rounded to x's dtype."""
    return np.asarray(result64).astype(x.dtype)


# ---- GEMM ---------------------------------------------------------------------------------------

x, w = fr(3, 5), fr(4, 5)
case("nn.dense", [x, w], like(f64(x) @ f64(w).T, x), "2-D")
x, w = fr(2, 3, 5), fr(4, 5)
case("nn.dense", [x, w], like(f64(x) @ f64(w).T, x), "leading batch dims, units", units=4)
x, w = fr(4, dtype=F64), fr(3, 4, dtype=F64)
case("nn.dense", [x, w], f64(x) @ f64(w).T, "1-D input, float64")
x, w = fr(2, 3), fr(2, 3)
case("nn.dense", [x, w], f64(x) @ f64(w).T, "out_dtype float64", out_dtype="float64")

x, y = fr(2, 3, 4), fr(2, 5, 4)
case("nn.batch_matmul", [x, y], like(f64(x) @ f64(y).transpose(0, 2, 1), x), "default transpose_b")
x, y = fr(2, 4, 3), fr(2, 4, 5)
case("nn.batch_matmul", [x, y], like(f64(x).transpose(0, 2, 1) @ f64(y), x),
     "transpose_a, not transpose_b", transpose_a=True, transpose_b=False)
x, y = fr(1, 3, 4), fr(3, 5, 4)
case("nn.batch_matmul", [x, y], like(f64(x) @ f64(y).transpose(0, 2, 1), x), "lhs batch 1 broadcasts")
x, y = fr(2, 2, 3), fr(1, 3, 4)
case("nn.batch_matmul", [x, y], like(f64(x) @ f64(y), x), "rhs batch 1 broadcasts, transpose_b=False",
     transpose_b=False)
x, y = ir(2, 3, 4), ir(2, 2, 4)
case("nn.batch_matmul", [x, y], (x.astype(I64) @ y.astype(I64).transpose(0, 2, 1)).astype(I32), "int32")

# ---- broadcasting binary ------------------------------------------------------------------------

def trunc_div(a, b):
    q = np.abs(a.astype(I64)) // np.abs(b.astype(I64))
    return (q * np.sign(a) * np.sign(b)).astype(a.dtype)


arith = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "maximum": np.maximum,
    "minimum": np.minimum,
}
for op, f in arith.items():
    a, b = fr(3, 1, 4), fr(2, 4)
    case(op, [a, b], like(f(f64(a), f64(b)), a), "float32, (3,1,4) with (2,4)")
    a, b = ir(2, 3, dtype=I64), ir(3, dtype=I64)
    case(op, [a, b], f(a, b), "int64, (2,3) with (3,)")
a, b = fr(2, 3, dtype=F64), fr(dtype=F64)
case("add", [a, b], a + b, "float64 with a scalar")
a, b = ir(4, dtype=I32), ir(4, dtype=I32)
case("multiply", [a, b], a * b, "int32")

a = fr(2, 3, 4)
b = fr(3, 1, lo=0.25, hi=4.0) * np.where(br(3, 1), 1, -1).astype(F32)
case("divide", [a, b], like(f64(a) / f64(b), a), "float32 broadcast, nonzero divisors")
a = ir(3, 4, lo=-20, hi=20)
b = np.array([3, -3, 7, -1], dtype=I32)
case("divide", [a, b], trunc_div(a, b), "int32 truncates toward zero (C/TVM), not floor")
a, b = np.array([7, -7, 7, -7, 0], dtype=I64), np.array([2, 2, -2, -2, 5], dtype=I64)
case("divide", [a, b], trunc_div(a, b), "int64 signs: 7/2=3, -7/2=-3")

a, b = fr(2, 3, lo=0.25, hi=3.0), fr(3, lo=-2.0, hi=2.0)
case("power", [a, b], like(f64(a) ** f64(b), a), "float32 positive base, any exponent")
a, b = ir(2, 4, lo=-5, hi=5), ir(4, lo=0, hi=5)
case("power", [a, b], a ** b, "int32, exponents >= 0 (0**0 = 1)")

cmps = {
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "greater": np.greater,
    "less_equal": np.less_equal,
    "greater_equal": np.greater_equal,
}
for op, f in cmps.items():
    a, b = ties(2, 1, 3), ties(4, 3)
    case(op, [a, b], f(a, b), "float32 with ties, (2,1,3) with (4,3)")
    a, b = ir(3, 2, lo=-2, hi=2, dtype=I64), ir(2, lo=-2, hi=2, dtype=I64)
    case(op, [a, b], f(a, b), "int64")
a, b = br(2, 3), br(3)
case("equal", [a, b], a == b, "bool operands")
case("not_equal", [a, b], a != b, "bool operands")

for op, f in {"logical_and": np.logical_and, "logical_or": np.logical_or}.items():
    a, b = br(2, 1, 3), br(4, 3)
    case(op, [a, b], f(a, b), "(2,1,3) with (4,3)")

x, bias = fr(2, 3, 4), fr(3)
case("nn.bias_add", [x, bias], like(f64(x) + f64(bias)[:, None], x), "default axis=1")
x, bias = fr(2, 3, 4), fr(4)
case("nn.bias_add", [x, bias], like(f64(x) + f64(bias), x), "axis=-1", axis=-1)
x, bias = ir(3, 2), ir(3)
case("nn.bias_add", [x, bias], x + bias[:, None], "int32 axis=0", axis=0)

c, x, y = br(2, 1, 4), fr(3, 4), fr()
case("where", [c, x, y], np.where(c, x, y), "(2,1,4) cond, (3,4) x, scalar y")
c, x, y = br(3), ir(2, 3, dtype=I64), ir(2, 1, dtype=I64)
case("where", [c, x, y], np.where(c, x, y), "int64")

x = fr(3, 4)
case("clip", [x], np.clip(x, -1.5, 2.0), "float32", a_min=-1.5, a_max=2.0)
x = ir(2, 5)
case("clip", [x], np.clip(x, -2, 3), "int32 integral bounds", a_min=-2, a_max=3)
case("clip", [x], np.trunc(np.clip(x.astype(F64), -2.5, 3.7)).astype(I32),
     "int32 fractional bounds: clip in reals, then truncate", a_min=-2.5, a_max=3.7)

# ---- unary elementwise --------------------------------------------------------------------------

x = br(2, 3)
case("logical_not", [x], ~x)
x = fr(2, 3)
case("negative", [x], -x, "float32")
x = ir(5, dtype=I64)
case("negative", [x], -x, "int64")
x = np.concatenate([fr(8, lo=-8.0, hi=8.0), np.array([-40.0, 40.0, 0.0, -90.0], dtype=F32)])
case("sigmoid", [x], like(1 / (1 + np.exp(-f64(x))), x), "incl. large magnitudes")
case("tanh", [x], like(np.tanh(f64(x)), x))
x = fr(2, 4)
case("exp", [x], like(np.exp(f64(x)), x))
x = fr(2, 4, lo=0.25, hi=8.0)
case("log", [x], like(np.log(f64(x)), x))
case("sqrt", [x], like(np.sqrt(f64(x)), x))
case("rsqrt", [x], like(1 / np.sqrt(f64(x)), x))
x = fr(3, dtype=F64)
case("log", [x * x + 1], np.log(x * x + 1), "float64")
x = fr(2, 3)
case("abs", [x], np.abs(x), "float32")
x = ir(6, dtype=I64)
case("abs", [x], np.abs(x), "int64")
x = fr(2, 4)
case("nn.relu", [x], np.maximum(x, 0), "float32")
x = ir(6)
case("nn.relu", [x], np.maximum(x, 0), "int32")
x = fr(2, 2)
case("copy", [x], x.copy(), "float32")
x = br(3)
case("copy", [x], x.copy(), "bool")

# ---- reductions and normalizations --------------------------------------------------------------

def softmax64(x, axis):
    x = f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax64(x, axis):
    x = f64(x)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


for op, f in {"nn.softmax": softmax64, "nn.log_softmax": log_softmax64}.items():
    x = fr(3, 5)
    case(op, [x], like(f(x, -1), x), "default axis=-1")
    x = fr(2, 3, 4)
    case(op, [x], like(f(x, 1), x), "axis=1", axis=1)
    x = fr(3, 2)
    case(op, [x], like(f(x, 0), x), "axis=-2", axis=-2)
    x = (fr(2, 6) + np.float32(1e4)).astype(F32)
    case(op, [x], like(f(x, -1), x), "stability: values ~1e4")
    x = np.array([[1e4, -1e4, 0.0, 9999.0]], dtype=F32)
    case(op, [x], like(f(x, -1), x), "stability: spread of 2e4")
    x = fr(2, 3, dtype=F64)
    case(op, [x], f(x, -1), "float64")


def layer_norm64(x, g, b, axis=-1, eps=1e-5, center=True, scale=True):
    x = f64(x)
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axis, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    if scale:
        y = y * f64(g).reshape(shape)
    if center:
        y = y + f64(b).reshape(shape)
    return y


x, g, b = fr(3, 8), fr(8), fr(8)
case("nn.layer_norm", [x, g, b], like(layer_norm64(x, g, b), x), "default axis=-1")
x, g, b = fr(2, 4, 3), fr(4), fr(4)
case("nn.layer_norm", [x, g, b], like(layer_norm64(x, g, b, axis=1, eps=1e-3), x), "axis=1, epsilon",
     axis=1, epsilon=1e-3)
x, g, b = (fr(2, 16) + np.float32(1e4)).astype(F32), fr(16), fr(16)
case("nn.layer_norm", [x, g, b], like(layer_norm64(x, g, b), x), "stability: values ~1e4 (two-pass variance)")
x, g, b = fr(3, 4), fr(4), fr(4)
case("nn.layer_norm", [x, g, b], like(layer_norm64(x, g, b, center=False), x), "center=False", center=False)
case("nn.layer_norm", [x, g, b], like(layer_norm64(x, g, b, scale=False), x), "scale=False", scale=False)
x, g, b = fr(2, 5, dtype=F64), fr(5, dtype=F64), fr(5, dtype=F64)
case("nn.layer_norm", [x, g, b], layer_norm64(x, g, b), "float64")


def red_axes(rank, axis, exclude):
    if axis is None or axis == []:
        axes = list(range(rank))
        return axes
    axes = [a % rank for a in (axis if isinstance(axis, list) else [axis])]
    if exclude:
        axes = [a for a in range(rank) if a not in axes]
    return axes


def reduce_case(op, f, x, note, axis=None, keepdims=False, exclude=False, out=None, **extra):
    axes = tuple(red_axes(x.ndim, axis, exclude))
    y = f(x, axes, keepdims)
    if out is not None:
        y = out(y)
    attrs = dict(extra)
    if axis is not None:
        attrs["axis"] = axis
    if keepdims:
        attrs["keepdims"] = True
    if exclude:
        attrs["exclude"] = True
    case(op, [x], y, note, **attrs)


def fsum(x, axes, keepdims):
    if np.issubdtype(x.dtype, np.floating):
        return like(f64(x).sum(axis=axes, keepdims=keepdims), x)
    return x.sum(axis=axes, keepdims=keepdims, dtype=I64).astype(x.dtype)


def fmean(x, axes, keepdims):
    if np.issubdtype(x.dtype, np.floating):
        return like(f64(x).mean(axis=axes, keepdims=keepdims), x)
    s = x.sum(axis=axes, keepdims=keepdims, dtype=I64)
    n = int(np.prod([x.shape[a] for a in axes]))
    return (np.sign(s) * (np.abs(s) // n)).astype(x.dtype)  # truncating division


def fmax(x, axes, keepdims):
    return np.max(x, axis=axes, keepdims=keepdims)


def fmin(x, axes, keepdims):
    return np.min(x, axis=axes, keepdims=keepdims)


for op, f in {"sum": fsum, "mean": fmean, "max": fmax, "min": fmin}.items():
    x = fr(2, 3, 4)
    reduce_case(op, f, x, "axis=None (all)")
    reduce_case(op, f, x, "axis=1", axis=1)
    reduce_case(op, f, x, "axis=[0, 2], keepdims", axis=[0, 2], keepdims=True)
    reduce_case(op, f, x, "axis=-1, exclude (reduces axes 0 and 1)", axis=-1, exclude=True)
    reduce_case(op, f, x, "axis=None, keepdims", keepdims=True)
    reduce_case(op, f, x, "axis=[] means all axes", axis=[])
    x = ir(3, 5, lo=-20, hi=20)
    reduce_case(op, f, x, "int32 axis=-1", axis=-1)
    x = fr(4, 2, dtype=F64)
    reduce_case(op, f, x, "float64 axis=0, keepdims", axis=0, keepdims=True)
x = (fr(4, 8) + np.float32(1e4)).astype(F32)
reduce_case("sum", fsum, x, "large values, f64 accumulation", axis=1)
reduce_case("mean", fmean, x, "large values, f64 accumulation", axis=1)


def argred(find_max):
    def f(x, axes, keepdims, last=False):
        kept = [a for a in range(x.ndim) if a not in axes]
        moved = np.transpose(x, kept + list(axes))
        flat = moved.reshape([x.shape[a] for a in kept] + [-1])
        if last:
            rev = flat[..., ::-1]
            idx = flat.shape[-1] - 1 - (np.argmax(rev, axis=-1) if find_max else np.argmin(rev, axis=-1))
        else:
            idx = np.argmax(flat, axis=-1) if find_max else np.argmin(flat, axis=-1)
        idx = np.asarray(idx).astype(I32)
        if keepdims:
            shape = [1 if a in axes else x.shape[a] for a in range(x.ndim)]
            idx = idx.reshape(shape)
        return idx
    return f


for op, find_max in {"argmax": True, "argmin": False}.items():
    f = argred(find_max)
    x = ties(3, 5)
    reduce_case(op, f, x, "ties: first occurrence, axis=1", axis=1)
    reduce_case(op, f, x, "axis=None: flat index", None)
    reduce_case(op, lambda x, a, k: f(x, a, k, last=True), x, "select_last_index", axis=1,
                select_last_index=True)
    x = ties(2, 3, 4)
    reduce_case(op, f, x, "axis=-1, keepdims", axis=-1, keepdims=True)
    reduce_case(op, f, x, "axis=[1, 2]: index over the flattened reduced axes", axis=[1, 2])
    reduce_case(op, f, x, "axis=0, exclude (reduces axes 1 and 2)", axis=0, exclude=True)
    x = ir(4, 3, lo=-3, hi=3)
    reduce_case(op, f, x, "int32 axis=0", axis=0)
    x = fr(6, dtype=F64)
    reduce_case(op, f, x, "float64 1-D", axis=0)

# ---- layout -------------------------------------------------------------------------------------

a, b = fr(2, 3), fr(1, 3)
case("concatenate", [(a, b)], np.concatenate([a, b], 0), "default axis=0")
a, b, c = fr(2, 1, 2), fr(2, 3, 2), fr(2, 2, 2)
case("concatenate", [(a, b, c)], np.concatenate([a, b, c], 1), "three parts, axis=1", axis=1)
a, b = ir(2, 2, dtype=I64), ir(2, 3, dtype=I64)
case("concatenate", [(a, b)], np.concatenate([a, b], -1), "int64 axis=-1", axis=-1)
a = br(3)
case("concatenate", [(a,)], a, "one part, bool")

x = fr(6, 2)
case("split", [x], tuple(np.split(x, 3, 0)), "3 sections along axis 0", indices_or_sections=3)
x = fr(2, 3, 4)
case("split", [x], tuple(np.split(x, 2, -1)), "2 sections along axis -1", indices_or_sections=2, axis=-1)
x = fr(2, 5)
case("split", [x], tuple(np.split(x, [1, 3], 1)), "at indices [1, 3] along axis 1",
     indices_or_sections=[1, 3], axis=1)
x = ir(4, dtype=I64)
case("split", [x], tuple(np.split(x, [2], 0)), "int64 at index [2]", indices_or_sections=[2])
x = fr(3)
case("split", [x], tuple(np.split(x, 1, 0)), "1 section", indices_or_sections=1)

x = fr(2, 3, 4)
case("reshape", [x], x.reshape(2, 12), "[0, -1]: copy dim 0, infer", newshape=[0, -1])
case("reshape", [x], x.reshape(24), "[-1]: flatten", newshape=[-1])
case("reshape", [x], x.reshape(4, 3, 2), "plain sizes", newshape=[4, 3, 2])
case("reshape", [x], x.reshape(2, 3, 2, 2), "[0, 0, 2, -1]", newshape=[0, 0, 2, -1])
case("reshape", [x], x.reshape(6, 4), "[-3, 0]: merge, then copy", newshape=[-3, 0])
case("reshape", [x], x.reshape(2, 3, 4), "[-2]: copy all", newshape=[-2])
case("reshape", [x], x.reshape(6, 4), "[-3, -2]: merge, then copy the rest", newshape=[-3, -2])
x = ir(6, 4)
case("reshape", [x], x.reshape(2, 3, 4), "[-4, 2, -1, 0]: split dim 0 into 2 x 3", newshape=[-4, 2, -1, 0])
x = fr(1, 1)
case("reshape", [x], x.reshape(()), "to a scalar", newshape=[])

x = fr(2, 3, 4)
case("transpose", [x], x.transpose(), "axes=None reverses")
case("transpose", [x], x.transpose(1, 0, 2), "axes [1, 0, 2]", axes=[1, 0, 2])
case("transpose", [x], x.transpose(2, 0, 1), "negative axes [-1, 0, 1]", axes=[-1, 0, 1])
x = br(2, 3)
case("transpose", [x], x.T, "bool 2-D", axes=[1, 0])

x = fr(2, 3)
case("expand_dims", [x], x[:, None, :], "axis=1", axis=1)
case("expand_dims", [x], x[:, :, None, None], "axis=-1, num_newaxis=2", axis=-1, num_newaxis=2)
case("expand_dims", [x], x, "num_newaxis=0", axis=0, num_newaxis=0)
x = ir()
case("expand_dims", [x], x.reshape(1), "scalar, axis=0", axis=0)

x = fr(1, 3, 1, 2)
case("squeeze", [x], x.reshape(3, 2), "axis=None: all size-1 axes")
case("squeeze", [x], x.reshape(3, 1, 2), "axis=[0]", axis=[0])
case("squeeze", [x], x.reshape(1, 3, 2), "axis=[-2]", axis=[-2])

x = fr(3, 4)
idx = np.array([[0, 5], [11, 20], [-3, 7]], dtype=I32)
case("take", [x, idx], np.take(x, idx, mode="clip"), "axis=None: flat, clip (out of range clamps)")
idx = np.array([2, -1, 0, 7, 1], dtype=I64)
case("take", [x, idx], np.take(x, idx, axis=0, mode="clip"), "axis=0, clip, int64 indices", axis=0)
idx = np.array([[5, -1], [-6, 3]], dtype=I32)
case("take", [x, idx], np.take(x, idx, axis=1, mode="wrap"), "axis=1, wrap (Python modulo)",
     axis=1, mode="wrap")
idx = np.array([3, 0, -1, -4], dtype=I32)
case("take", [x, idx], np.take(x, idx, axis=-1), "axis=-1, fast: in range, negative counts from the end",
     axis=-1, mode="fast")
x3 = ir(2, 3, 4)
idx = np.array([[0, 2, 2], [1, 0, 5]], dtype=I32)
exp = np.empty((2, 3, 3), dtype=I32)
for bb in range(2):
    for jj in range(3):
        exp[bb, :, jj] = x3[bb, :, min(idx[bb, jj], 3)]
case("take", [x3, idx], exp, "batch_dims=1, axis=2: out[b, p, j] = x[b, p, idx[b, j]] (clip)",
     axis=2, batch_dims=1)
x = br(5)
case("take", [x, np.array([4, 0], dtype=I32)], x[[4, 0]], "bool data", axis=0)

x = fr(4, 5)
case("strided_slice", [x], x[1:3, 0:5:2], "begin/end/strides", begin=[1, 0], end=[3, 5], strides=[1, 2])
case("strided_slice", [x], x[::-1], "negative stride reverses axis 0 (end beyond the start clamps)",
     begin=[-1], end=[-100], strides=[-1])
case("strided_slice", [x], x[3:0:-2, 4:0:-3], "negative strides on both axes",
     begin=[3, 4], end=[0, 0], strides=[-2, -3])
case("strided_slice", [x], x[:, -4:-1], "axes=[1], negative bounds", begin=[-4], end=[-1], axes=[1])
case("strided_slice", [x], x[-10:10], "out-of-range bounds clamp", begin=[-10], end=[10])
case("strided_slice", [x], x[1:3, 2:5], "slice_mode=size (size -1: to the end)",
     begin=[1, 2], end=[2, -1], slice_mode="size")
case("strided_slice", [x], x[0:4:2, 1:5], "fewer strides than axes: the rest are 1 (Relay pads them)",
     begin=[0, 1], end=[4, 5], strides=[2])
case("strided_slice", [x], x[3:1], "empty result", begin=[3], end=[1])
x = ir(2, 3, 4, dtype=I64)
case("strided_slice", [x], x[:, ::-1, 1:3], "int64, axes=[1, 2] with a negative stride",
     begin=[2, 1], end=[-5, 3], strides=[-1, 1], axes=[1, 2])

# ---- creation and conversion --------------------------------------------------------------------

x = fr(2, 4, lo=-3.0, hi=3.0)
case("cast", [x], x.astype(I32), "float32 -> int32 truncates toward zero", dtype="int32")
case("cast", [x], x.astype(BOOL), "float32 -> bool is != 0", dtype="bool")
case("cast", [x], x.astype(F64), "float32 -> float64", dtype="float64")
x = ir(5)
case("cast", [x], x.astype(F32), "int32 -> float32", dtype="float32")
x = np.array([3_000_000_000, -1, 5], dtype=I64)
case("cast", [x], x.astype(I32), "int64 -> int32 wraps", dtype="int32")
x = br(4)
case("cast", [x], x.astype(I64), "bool -> int64", dtype="int64")
x = np.array([0.1, 1e-3, 3.0], dtype=F64)
case("cast", [x], x.astype(F32), "float64 -> float32 rounds", dtype="float32")

x = fr(2, 3)
case("zeros_like", [x], np.zeros_like(x), "float32")
case("ones_like", [x], np.ones_like(x), "float32")
x = ir(4, dtype=I64)
case("zeros_like", [x], np.zeros_like(x), "int64")
case("ones_like", [x], np.ones_like(x), "int64")
x = br(2)
case("ones_like", [x], np.ones_like(x), "bool")

case("zeros", [], np.zeros((2, 3), dtype=F32), "default dtype float32", shape=[2, 3])
case("zeros", [], np.zeros((4,), dtype=I64), "int64", shape=[4], dtype="int64")
case("ones", [], np.ones((3, 1), dtype=F32), "default dtype", shape=[3, 1])
case("ones", [], np.ones((2,), dtype=BOOL), "bool", shape=[2], dtype="bool")
case("ones", [], np.ones((), dtype=I32), "scalar shape []", shape=[], dtype="int32")

v = np.array(3.75, dtype=F32)
case("full", [v], np.full((2, 2), 3.75, dtype=F32), "dtype from fill_value", shape=[2, 2])
case("full", [v], np.full((3,), 3, dtype=I32), "float fill cast to int32 truncates", shape=[3], dtype="int32")
v = np.array(2**40 + 1, dtype=I64)
case("full", [v], np.full((2,), 2**40 + 1, dtype=I64), "int64 fill exact", shape=[2])

# ---- added later (drawn after the others, so the earlier cases' inputs stay as they were) ----
import math

x = np.concatenate([fr(6, lo=-3.0, hi=3.0), np.array([0.0, -6.0, 6.0], dtype=F32)])
case("erf", [x], like(np.vectorize(math.erf)(f64(x)), x), "incl. 0 and the saturated tails")
case("sin", [x], like(np.sin(f64(x)), x))
case("cos", [x], like(np.cos(f64(x)), x))
x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -1.25, 1.75, 3.0], dtype=F32)
case("floor", [x], np.floor(x), "halves and integers")
case("ceil", [x], np.ceil(x), "halves and integers")
case("round", [x], np.round(x), "halves go to even (numpy, TVM nearbyint)")
case("trunc", [x], np.trunc(x), "toward zero")
x = fr(2, 3, dtype=F64)
case("floor", [x], np.floor(x), "float64")
x = np.array([-3.5, 0.0, 2.0, -0.25], dtype=F32)
case("sign", [x], np.sign(x), "float32")
x = np.array([-7, 0, 5], dtype=I32)
case("sign", [x], np.sign(x), "int32")
a = np.array([7, -7, 7, -7, 0, 6], dtype=I32)
b = np.array([2, 2, -2, -2, 5, 3], dtype=I32)
case("mod", [a, b], np.fmod(a, b), "int32 truncated: the dividend's sign (C %, TVM truncmod)")
case("floor_mod", [a, b], np.mod(a, b), "int32 floored: the divisor's sign (Python %)")
case("floor_divide", [a, b], np.floor_divide(a, b), "int32 rounded toward -inf (Python //)")
a = fr(2, 3, lo=-6.0, hi=6.0)
b = np.array([1.5, -2.25, 0.75], dtype=F32)
case("mod", [a, b], like(np.fmod(f64(a), f64(b)), a), "float32 broadcast")
case("floor_mod", [a, b], like(np.mod(f64(a), f64(b)), a), "float32 broadcast")
case("floor_divide", [a, b], like(np.floor_divide(f64(a), f64(b)), a), "float32 broadcast")
a, b, c = fr(2, 3), fr(2, 3), fr(2, 3)
case("stack", [(a, b, c)], np.stack([a, b, c], axis=0), "axis 0")
case("stack", [(a, b)], np.stack([a, b], axis=1), "axis 1", axis=1)
case("stack", [(a, b, c)], np.stack([a, b, c], axis=-1), "axis -1: a new last axis", axis=-1)
x = ir(4, dtype=I64)
case("stack", [(x,)], np.stack([x], axis=1), "int64, one field", axis=1)
x = np.concatenate([fr(5), np.array([0.0, -2.0], dtype=F32)])
case("nn.leaky_relu", [x], like(np.where(f64(x) > 0, f64(x), 0.2 * f64(x)), x), "alpha=0.2", alpha=0.2)
case("nn.leaky_relu", [x], like(np.where(f64(x) > 0, f64(x), 0.01 * f64(x)), x), "default alpha")
x = fr(3, 1)
case("broadcast_to", [x], np.broadcast_to(x, (2, 3, 4)).copy(), "(3, 1) to (2, 3, 4)", shape=[2, 3, 4])
x = ir(4, dtype=I32)
case("broadcast_to", [x], np.broadcast_to(x, (3, 4)).copy(), "int32 (4,) to (3, 4)", shape=[3, 4])
a = np.array([7.0, -0.0, -7.5, 7.5, 1e300, -3.0, 0.0, 5.0, 4503599627370495.5], dtype=F64)
b = np.array([0.1, 5.0, 2.0, -2.0, 1e-300, np.inf, -3.0, 0.0, -1.5], dtype=F64)
case("floor_divide", [a, b], np.floor_divide(a, b), "float64 as Python's //: 7.0 // 0.1 is 69, infinities, zeros")
case("floor_mod", [a, b], np.mod(a, b), "float64 as Python's %: the divisor's sign, infinities, zeros")
idx = np.array([[0, 3, -1], [2, 5, 1]], dtype=I32)
on, off = np.array(1.5, dtype=F32), np.array(-0.5, dtype=F32)
hot = (idx[..., None] == np.arange(4)).astype(F32)
case("one_hot", [idx, on, off], np.where(hot > 0, on, off).astype(F32),
     "depth 4, last axis; -1 and 5 are nowhere on", depth=4)
case("one_hot", [idx, on, off], np.moveaxis(np.where(hot > 0, on, off).astype(F32), -1, 0),
     "axis 0", depth=4, axis=0)

# ---- added in the forty-fifth session (drawn after the others) ----
x = fr(7, lo=-1.3, hi=1.3)
case("tan", [x], like(np.tan(f64(x)), x))
case("atan", [x], like(np.arctan(f64(x)), x))
case("sinh", [x], like(np.sinh(f64(x)), x))
case("cosh", [x], like(np.cosh(f64(x)), x))
case("asinh", [x], like(np.arcsinh(f64(x)), x))
x = np.concatenate([fr(6, lo=-0.99, hi=0.99), np.array([1.0, -1.0, 1.5], dtype=F32)])
with np.errstate(invalid="ignore", divide="ignore"):
    case("asin", [x], like(np.arcsin(f64(x)), x), "NaN outside [-1, 1]")
    case("acos", [x], like(np.arccos(f64(x)), x), "NaN outside [-1, 1]")
    case("atanh", [x], like(np.arctanh(f64(x)), x), "±inf at ±1, NaN outside")
x = np.concatenate([fr(5, lo=1.0, hi=9.0), np.array([1.0, 0.5], dtype=F32)])
with np.errstate(invalid="ignore"):
    case("acosh", [x], like(np.arccosh(f64(x)), x), "0 at 1, NaN below")
x = np.concatenate([fr(5, lo=0.01, hi=100.0), np.array([1.0, 8.0, 1000.0, 0.0], dtype=F32)])
with np.errstate(divide="ignore"):
    case("log2", [x], like(np.log2(f64(x)), x), "exact powers; -inf at 0")
    case("log10", [x], like(np.log10(f64(x)), x), "exact powers; -inf at 0")
x = fr(2, 3, dtype=F64)
case("tan", [x], np.tan(x), "float64")
x = np.array([0.0, -1.5, np.inf, -np.inf, np.nan, 3e38], dtype=F32)
case("isnan", [x], np.isnan(x), "")
case("isinf", [x], np.isinf(x), "")
case("isfinite", [x], np.isfinite(x), "")
a, b = br(2, 1, 3), br(4, 3)
case("logical_xor", [a, b], np.logical_xor(a, b), "(2,1,3) with (4,3)")


def fprod(x, axes, keepdims):
    if np.issubdtype(x.dtype, np.floating):
        return like(f64(x).prod(axis=axes, keepdims=keepdims), x)
    return x.prod(axis=axes, keepdims=keepdims, dtype=I64).astype(x.dtype)


x = fr(2, 3, 4, lo=0.5, hi=1.5)
reduce_case("prod", fprod, x, "axis=None (all)")
reduce_case("prod", fprod, x, "axis=[0, 2], keepdims", axis=[0, 2], keepdims=True)
reduce_case("prod", fprod, x, "axis=-1, exclude", axis=-1, exclude=True)
x = ir(3, 4, lo=-3, hi=3)
reduce_case("prod", fprod, x, "int32 axis=1 (zeros, signs)", axis=1)
for op, f in {"all": np.all, "any": np.any}.items():
    x = br(3, 4)
    reduce_case(op, lambda x, axes, keepdims, f=f: f(x, axis=axes, keepdims=keepdims), x, "axis=None")
    reduce_case(op, lambda x, axes, keepdims, f=f: f(x, axis=axes, keepdims=keepdims), x, "axis=1", axis=1)
    reduce_case(op, lambda x, axes, keepdims, f=f: f(x, axis=axes, keepdims=keepdims), x,
                "axis=0, keepdims", axis=0, keepdims=True)
x = fr(3, 5)
m = like(f64(x).mean(axis=1, keepdims=True), x)
case("variance", [x, m], like(((f64(x) - f64(m)) ** 2).mean(axis=1), x), "axis=1, the keepdims mean", axis=[1])
case("variance", [x, m], like(((f64(x) - f64(m)) ** 2).sum(axis=1, keepdims=True) / 4.0, x),
     "unbiased, keepdims", axis=[1], keepdims=True, unbiased=True)
x = fr(2, 3, 4, dtype=F64)
m = np.full((1, 3, 1), 0.25, dtype=F64)
case("variance", [x, m], ((x - m) ** 2).mean(axis=(0, 2)), "float64, a given mean, axis=[0, 2]", axis=[0, 2])

# ---- scans, index maps and arange (appended: the cases above keep their random inputs) ----------


def scan(f, x, axis=None, exclusive=False, dtype=None):
    """Relay's cumsum/cumprod: in `dtype` (default x's), floats from float64 rounded once."""
    out = np.dtype(dtype or x.dtype)
    a = x.astype(out)
    if axis is None:
        a, axis = a.ravel(), 0
    if out.kind == "f":
        y = f(a.astype(F64), axis=axis)
    else:
        y = f(a.astype(I64), axis=axis)
    if exclusive:
        ident = 1 if f is np.cumprod else 0
        y = np.concatenate([np.full_like(np.take(y, [0], axis=axis), ident),
                            np.delete(y, -1, axis=axis)], axis=axis)
    return y.astype(out)


x = fr(2, 3, 4)
case("cumsum", [x], scan(np.cumsum, x), "axis=None: flattened")
case("cumsum", [x], scan(np.cumsum, x, axis=1), "axis=1", axis=1)
case("cumsum", [x], scan(np.cumsum, x, axis=-1, exclusive=True), "axis=-1, exclusive", axis=-1, exclusive=True)
x = ir(3, 4)
case("cumsum", [x], scan(np.cumsum, x, axis=0, dtype="int64"), "int32 -> int64", axis=0, dtype="int64")
x = fr(3, 4, lo=0.5, hi=1.5)
case("cumprod", [x], scan(np.cumprod, x, axis=1), "axis=1", axis=1)
case("cumprod", [x], scan(np.cumprod, x, axis=0, exclusive=True), "axis=0, exclusive", axis=0, exclusive=True)
x = ir(5, lo=-3, hi=3)
case("cumprod", [x], scan(np.cumprod, x), "int32, axis=None")

x = fr(2, 3, 4)
case("reverse", [x], np.flip(x, axis=1), "axis=1", axis=1)
case("reverse", [x], np.flip(x, axis=-1), "axis=-1", axis=-1)
x = ir(3, dtype=I64)
case("reverse", [x], x[::-1], "int64 1-D", axis=0)

x = fr(2, 3)
case("tile", [x], np.tile(x, (2, 3)), "reps=[2, 3]", reps=[2, 3])
case("tile", [x], np.tile(x, (2, 1, 2)), "reps longer than the rank", reps=[2, 1, 2])
x = ir(2, 1, 2)
case("tile", [x], np.tile(x, (3,)), "reps shorter than the rank", reps=[3])

x = fr(2, 3)
case("repeat", [x], np.repeat(x, 2, axis=1), "repeats=2, axis=1", repeats=2, axis=1)
x = br(2, 2)
case("repeat", [x], np.repeat(x, 3, axis=-2), "bool, repeats=3, axis=-2", repeats=3, axis=-2)

x = fr(2, 3, 4)
case("nn.batch_flatten", [x], x.reshape(2, 12), "(2, 3, 4)")
x = ir(3, 1, 2, 2)
case("nn.batch_flatten", [x], x.reshape(3, 4), "int32 rank 4")

x = fr(3, 4)
idx = rng.integers(0, 4, size=(3, 5)).astype(I64)
case("gather", [x, idx], np.take_along_axis(x, idx, axis=1), "axis=1, indices longer along axis", axis=1)
idx = rng.integers(0, 3, size=(2, 4)).astype(I32)
case("gather", [x, idx], np.take_along_axis(x[:, :4], idx, axis=0), "axis=0, fewer rows", axis=0)
x = ir(2, 3, 4)
idx = rng.integers(-4, 4, size=(2, 3, 2)).astype(I32)
case("gather", [x, idx], np.take_along_axis(x[:, :, :], idx % 4, axis=-1), "axis=-1, negative indices count from the end",
     axis=-1)

x = fr(3, 4, 2)
idx = np.array([[2, 0, 1], [3, 0, 1]], dtype=I32)
case("gather_nd", [x, idx], x[tuple(idx)], "M=2: blocks of the last axis")
idx = np.array([[[1, 0], [2, 2]]], dtype=I64)
case("gather_nd", [x, idx], x[tuple(idx)], "M=1, index shape (1, 2, 2)")
x = ir(2, 3, 4)
idx = np.array([[1, 2], [0, 3]], dtype=I32)
exp = np.stack([x[b, idx[0, b], idx[1, b]] for b in range(2)])
case("gather_nd", [x, idx], exp, "batch_dims=1, M=2", batch_dims=1)

case("arange", [np.array(-1.5, dtype=F32), np.array(2.0, dtype=F32), np.array(0.25, dtype=F32)],
     np.arange(-1.5, 2.0, 0.25, dtype=F32), "float32")
case("arange", [np.array(10, dtype=I32), np.array(-3, dtype=I32), np.array(-4, dtype=I32)],
     np.arange(10, -3, -4, dtype=I32), "int32, negative step", dtype="int32")
case("arange", [np.array(0.0, dtype=F64), np.array(1.0, dtype=F64), np.array(0.125, dtype=F64)],
     np.arange(0.0, 1.0, 0.125, dtype=F64), "float64", dtype="float64")

# ---- TVM graph operators: dropout, matmul, the *_like family, sequence_mask, prelu, -----------
# ---- l2_normalize, pad, batch_norm (inference semantics) ----------------------------------------

x = fr(2, 3)
case("nn.dropout", [x], (x, np.ones_like(x)), "inference: the input and a mask of ones", rate=0.25)
x = fr(4, dtype=F64)
case("nn.dropout", [x], (x, np.ones_like(x)), "float64, default rate")

a, b = fr(3, 4), fr(4, 5)
case("nn.matmul", [a, b], like(f64(a) @ f64(b), a), "2-D")
a, b = fr(2, 3, 4), fr(5, 4)
case("nn.matmul", [a, b], like(f64(a) @ f64(b).T, a), "leading dims, transpose_b", transpose_b=True)
a, b = fr(4, 3, dtype=F64), fr(5, 4, dtype=F64)
case("nn.matmul", [a, b], f64(a).T @ f64(b).T, "float64, both transposed", transpose_a=True, transpose_b=True)
a, b = fr(2, 4, 3), fr(4, 5)
case("nn.matmul", [a, b], like(np.swapaxes(f64(a), -1, -2) @ f64(b), a), "transpose_a of a 3-D lhs: its last two axes",
     transpose_a=True)

x = fr(2, 3)
case("full_like", [x, np.array(1.5, dtype=F32)], np.full_like(x, 1.5), "float32")
x = ir(3, 2, dtype=I64)
case("full_like", [x, np.array(-2.75, dtype=F32)], np.full_like(x, -2), "int64 from a float fill (truncated)")

x = fr(2, 6)
case("reshape_like", [x, fr(3, 4)], x.reshape(3, 4), "the whole shape")
x = ir(2, 6)
case("reshape_like", [x, fr(5, 3, 2, 7)], x.reshape(2, 3, 2), "rhs axes 1..3 for lhs axis 1",
     lhs_begin=1, rhs_begin=1, rhs_end=3)

x = fr(3, 1)
case("broadcast_to_like", [x, fr(2, 3, 4)], np.broadcast_to(x, (2, 3, 4)), "(3, 1) to (2, 3, 4)")
x = ir(4)
case("broadcast_to_like", [x, ir(2, 4)], np.broadcast_to(x, (2, 4)), "int32")

x = fr(2, 3, 4)
case("collapse_sum_like", [x, fr(3, 1)], like(f64(x).sum(axis=(0, 2)).reshape(3, 1), x), "(2, 3, 4) to (3, 1)")
x = ir(2, 3)
case("collapse_sum_like", [x, ir(3)], x.sum(axis=0).astype(I32), "int32 to (3)")
x = fr(2, 2)
case("collapse_sum_like", [x, fr(2, 2)], x, "same shape")

def seqmask(x, lens, value, axis):
    out = x.copy()
    for b, n in enumerate(lens):
        if axis == 0:
            out[max(n, 0):, b] = value
        else:
            out[b, max(n, 0):] = value
    return out

x = fr(4, 3, 2)
lens = np.array([2, 0, 4], dtype=I32)
case("sequence_mask", [x, lens], seqmask(x, lens, 0.0, 0), "axis=0, default mask value")
x = fr(3, 5)
lens = np.array([1, 5, 3], dtype=I64)
case("sequence_mask", [x, lens], seqmask(x, lens, -1.0, 1), "axis=1, mask_value=-1", axis=1, mask_value=-1.0)

x, al = fr(2, 3, 2), fr(3)
case("nn.prelu", [x, al], like(np.where(x > 0, f64(x), f64(al)[None, :, None] * f64(x)), x), "axis=1 (default)")
x, al = fr(2, 4, dtype=F64), fr(4, dtype=F64)
case("nn.prelu", [x, al], np.where(x > 0, x, al * x), "float64, axis=-1", axis=-1)

def l2n(x, eps, axis):
    s = (f64(x) ** 2).sum(axis=axis, keepdims=True)
    return like(f64(x) / np.sqrt(np.maximum(s, eps)), x)

x = fr(2, 3)
case("nn.l2_normalize", [x], l2n(x, 1e-12, None), "axis=None: every axis", eps=1e-12)
x = fr(2, 3, 4)
case("nn.l2_normalize", [x], l2n(x, 1e-12, (1,)), "axis=[1]", eps=1e-12, axis=[1])
x = np.zeros((2, 2), dtype=F32)
x[0, 0] = 0.015625
case("nn.l2_normalize", [x], l2n(x, 0.5, (1,)), "eps above the sums", eps=0.5, axis=[1])

x = fr(2, 3)
case("nn.pad", [x, np.array(1.5, dtype=F32)], np.pad(x, ((0, 1), (2, 1)), constant_values=1.5),
     "pad value operand (TVM's printer)", pad_width=[[0, 1], [2, 1]])
x = ir(2, 3)
case("nn.pad", [x], np.pad(x, ((1, 1), (0, 0))), "int32, attribute form, pad value 0", pad_width=[[1, 1], [0, 0]])
x = fr(3, 4)
case("nn.pad", [x, np.array(0.0, dtype=F32)], np.pad(x, ((1, 2), (2, 1)), mode="edge"), "edge",
     pad_width=[[1, 2], [2, 1]], pad_mode="edge")
case("nn.pad", [x, np.array(0.0, dtype=F32)], np.pad(x, ((2, 1), (1, 3)), mode="reflect"), "reflect",
     pad_width=[[2, 1], [1, 3]], pad_mode="reflect")

def bn(x, g, b, m, v, axis=1, eps=1e-5, center=True, scale=True):
    shape = [1] * x.ndim
    shape[axis] = -1
    r = lambda t: f64(t).reshape(shape)
    y = (f64(x) - r(m)) / np.sqrt(r(v) + eps)
    if scale:
        y = y * r(g)
    if center:
        y = y + r(b)
    return (like(y, x), m, v)

x = fr(2, 3, 2)
g, b, m = fr(3), fr(3), fr(3)
v = fr(3, lo=0.25, hi=2.0)
case("nn.batch_norm", [x, g, b, m, v], bn(x, g, b, m, v), "axis=1 (default)")
x = fr(4, 2, dtype=F64)
g, b, m = fr(2, dtype=F64), fr(2, dtype=F64), fr(2, dtype=F64)
v = fr(2, dtype=F64, lo=0.25, hi=2.0)
case("nn.batch_norm", [x, g, b, m, v], bn(x, g, b, m, v, axis=-1, eps=1e-3, center=False),
     "float64, axis=-1, epsilon=1e-3, center=False", axis=-1, epsilon=1e-3, center=False)
case("nn.batch_norm", [x, g, b, m, v], bn(x, g, b, m, v, axis=1, scale=False), "scale=False", scale=False)

# ---- shapes as values (appended) ------------------------------------------------------------------

x = fr(2, 3, 4)
case("shape_of", [x], np.array(x.shape, dtype=I32), "rank 3, int32 (default)")
case("shape_of", [ir(5, dtype=I64)], np.array([5], dtype=I64), "int64", dtype="int64")
case("shape_of", [np.zeros((0, 3), dtype=F32)], np.array([0, 3], dtype=I32), "an empty axis")
case("shape_of", [np.array(1.5, dtype=F32)], np.zeros((0,), dtype=I32), "a scalar: rank 0")
case("ndarray_size", [x], np.array(x.size, dtype=I32), "24 elements")
case("ndarray_size", [np.zeros((0, 3), dtype=F32)], np.array(0, dtype=I64), "empty, int64", dtype="int64")

# ---- write --------------------------------------------------------------------------------------

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases.json")
with open(out, "w") as fh:
    # One case per line, so that a regenerated file diffs case by case.
    fh.write("[\n" + ",\n".join(json.dumps(c, separators=(",", ":")) for c in cases) + "\n]\n")
ops = sorted({c["op"] for c in cases})
print(f"wrote {len(cases)} cases for {len(ops)} operators to {out} ({os.path.getsize(out)} bytes)")
