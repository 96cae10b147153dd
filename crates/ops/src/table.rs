//! The registry: one entry per operator, its relation (in [`crate::rel`]) and its reference kernel
//! (in [`crate::kernel`], same module and function names) side by side.
//!
//! Fusion-class choices beyond the obvious: `copy` is Layout (it moves data, like `reshape`);
//! `cast`, `zeros_like` and `ones_like` are Elementwise (one output element per input element, so
//! they fuse into elementwise stages); `zeros`, `ones` and `full` are Opaque (tensor creation from
//! attributes, as the [`FusionClass::Opaque`] doc says), as are `arange` (its length comes from its
//! operands' values) and the `db.*`/`random.*` intrinsics; `cumsum`/`cumprod` are Reduction (a
//! running reduction along an axis). `full_like` is Elementwise like `zeros_like`; `nn.dropout`
//! is Elementwise (its output is its input), `nn.prelu` and `sequence_mask` Broadcast (a per-channel
//! or per-sequence operand), `nn.l2_normalize`, `nn.batch_norm` and `collapse_sum_like` Reduction,
//! `reshape_like`, `broadcast_to_like` and `nn.pad` Layout.

use crate::kernel as k;
use crate::rel::{broadcast, create, gemm, layout, nn, reduce, unary};
use crate::AttrKind::{Any, Bool, DType, Float, Int, IntOrInts, Ints, Str};
use crate::FusionClass::{Broadcast, Elementwise, Gemm, Layout, Opaque, Reduction};
use crate::StageRule::{Gather, RowWise, RowWiseOnLastAxis};
use crate::{AttrSpec, FusionClass, Kernel, OpDef, Relation, StageRule};

const fn opt(name: &'static str, kind: crate::AttrKind, default: &'static str) -> AttrSpec {
    AttrSpec::opt(name, kind, default)
}

const fn req(name: &'static str, kind: crate::AttrKind) -> AttrSpec {
    AttrSpec::req(name, kind)
}

const fn op(
    name: &'static str,
    arity: usize,
    attrs: &'static [AttrSpec],
    relation: Relation,
    kernel: Kernel,
    class: FusionClass,
    doc: &'static str,
) -> OpDef {
    OpDef {
        name,
        arity,
        alt_arity: None,
        attrs,
        relation,
        kernel,
        class,
        stage: StageRule::Batched,
        doc,
        sized_by_values: false,
    }
}

const NONE: &[AttrSpec] = &[];
const REDUCE: &[AttrSpec] = &[
    opt("axis", IntOrInts, "None"),
    opt("keepdims", Bool, "False"),
    opt("exclude", Bool, "False"),
];
const ARG_REDUCE: &[AttrSpec] = &[
    opt("axis", IntOrInts, "None"),
    opt("keepdims", Bool, "False"),
    opt("exclude", Bool, "False"),
    opt("select_last_index", Bool, "False"),
];
const SOFTMAX: &[AttrSpec] = &[opt("axis", Int, "-1")];
const CREATE: &[AttrSpec] = &[req("shape", Ints), opt("dtype", DType, "\"float32\"")];

#[rustfmt::skip]
static OPS: &[OpDef] = &[
    // ---- GEMM ----
    op("nn.dense", 2, &[opt("units", Int, "None"), opt("out_dtype", Str, "\"\"")],
        gemm::dense, k::gemm::dense, Gemm, "data (…, K) times weight (N, K) transposed: (…, N)").in_stage(StageRule::Gemm),
    op("nn.matmul", 2,
        &[opt("transpose_a", Bool, "False"), opt("transpose_b", Bool, "False"), opt("units", Int, "None"), opt("out_dtype", Str, "\"\"")],
        gemm::matmul, k::gemm::matmul, Gemm, "a (…, K) times b (K, N): (…, N); transpose_a (a as (…, K, M)) and transpose_b (b as nn.dense's (N, K)) flip them first"),
    op("nn.batch_matmul", 2,
        &[opt("transpose_a", Bool, "False"), opt("transpose_b", Bool, "True"), opt("out_dtype", Str, "\"\"")],
        gemm::batch_matmul, k::gemm::batch_matmul, Gemm, "batched matrix product (B, M, K) × (B, N, K) → (B, M, N); batch 1 broadcasts"),
    // ---- broadcasting binary ----
    op("add", 2, NONE, broadcast::add, k::broadcast::add, Broadcast, "elementwise a + b with numpy broadcasting").in_stage(RowWise),
    op("subtract", 2, NONE, broadcast::subtract, k::broadcast::subtract, Broadcast, "elementwise a - b with numpy broadcasting").in_stage(RowWise),
    op("multiply", 2, NONE, broadcast::multiply, k::broadcast::multiply, Broadcast, "elementwise a * b with numpy broadcasting").in_stage(RowWise),
    op("divide", 2, NONE, broadcast::divide, k::broadcast::divide, Broadcast, "elementwise a / b with numpy broadcasting").in_stage(RowWise),
    op("power", 2, NONE, broadcast::power, k::broadcast::power, Broadcast, "elementwise a ** b with numpy broadcasting").in_stage(RowWise),
    op("maximum", 2, NONE, broadcast::maximum, k::broadcast::maximum, Broadcast, "elementwise max(a, b) with numpy broadcasting").in_stage(RowWise),
    op("minimum", 2, NONE, broadcast::minimum, k::broadcast::minimum, Broadcast, "elementwise min(a, b) with numpy broadcasting").in_stage(RowWise),
    op("mod", 2, NONE, broadcast::mod_, k::broadcast::mod_, Broadcast, "elementwise remainder of a / b truncated toward zero (C fmod, TVM truncmod), with broadcasting"),
    op("floor_mod", 2, NONE, broadcast::floor_mod, k::broadcast::floor_mod, Broadcast, "elementwise remainder with the divisor's sign (Python %), with broadcasting"),
    op("floor_divide", 2, NONE, broadcast::floor_divide, k::broadcast::floor_divide, Broadcast, "elementwise a / b rounded toward -inf (Python //), with broadcasting"),
    op("equal", 2, NONE, broadcast::equal, k::broadcast::equal, Broadcast, "elementwise a == b (bool) with numpy broadcasting"),
    op("not_equal", 2, NONE, broadcast::not_equal, k::broadcast::not_equal, Broadcast, "elementwise a != b (bool) with numpy broadcasting"),
    op("less", 2, NONE, broadcast::less, k::broadcast::less, Broadcast, "elementwise a < b (bool) with numpy broadcasting"),
    op("greater", 2, NONE, broadcast::greater, k::broadcast::greater, Broadcast, "elementwise a > b (bool) with numpy broadcasting"),
    op("less_equal", 2, NONE, broadcast::less_equal, k::broadcast::less_equal, Broadcast, "elementwise a <= b (bool) with numpy broadcasting"),
    op("greater_equal", 2, NONE, broadcast::greater_equal, k::broadcast::greater_equal, Broadcast, "elementwise a >= b (bool) with numpy broadcasting"),
    op("logical_and", 2, NONE, broadcast::logical_and, k::broadcast::logical_and, Broadcast, "elementwise a and b on bool tensors, with broadcasting"),
    op("logical_or", 2, NONE, broadcast::logical_or, k::broadcast::logical_or, Broadcast, "elementwise a or b on bool tensors, with broadcasting"),
    op("logical_xor", 2, NONE, broadcast::logical_xor, k::broadcast::logical_xor, Broadcast, "elementwise a xor b on bool tensors, with broadcasting"),
    op("nn.bias_add", 2, &[opt("axis", Int, "1")], broadcast::bias_add, k::broadcast::bias_add, Broadcast,
        "adds a 1-D bias along `axis` of data").in_stage(RowWiseOnLastAxis { default_axis: 1 }),
    op("where", 3, NONE, broadcast::where_, k::broadcast::where_, Broadcast,
        "x where condition holds, else y; all three broadcast"),
    op("clip", 1, &[req("a_min", Float), req("a_max", Float)], unary::clip, k::unary::clip, Broadcast,
        "clamps every element into [a_min, a_max]").in_stage(RowWise),
    // ---- unary elementwise ----
    op("logical_not", 1, NONE, unary::logical_not, k::unary::logical_not, Elementwise, "elementwise not on a bool tensor"),
    op("negative", 1, NONE, unary::negative, k::unary::negative, Elementwise, "elementwise -x").in_stage(RowWise),
    op("sigmoid", 1, NONE, unary::sigmoid, k::unary::sigmoid, Elementwise, "elementwise 1 / (1 + exp(-x)) (float)").in_stage(RowWise),
    op("tanh", 1, NONE, unary::tanh, k::unary::tanh, Elementwise, "elementwise hyperbolic tangent (float)").in_stage(RowWise),
    op("exp", 1, NONE, unary::exp, k::unary::exp, Elementwise, "elementwise e^x (float)").in_stage(RowWise),
    op("log", 1, NONE, unary::log, k::unary::log, Elementwise, "elementwise natural logarithm (float)").in_stage(RowWise),
    op("sqrt", 1, NONE, unary::sqrt, k::unary::sqrt, Elementwise, "elementwise square root (float)").in_stage(RowWise),
    op("rsqrt", 1, NONE, unary::rsqrt, k::unary::rsqrt, Elementwise, "elementwise 1 / sqrt(x) (float)").in_stage(RowWise),
    op("abs", 1, NONE, unary::abs, k::unary::abs, Elementwise, "elementwise |x|").in_stage(RowWise),
    op("nn.relu", 1, NONE, unary::relu, k::unary::relu, Elementwise, "elementwise max(x, 0)").in_stage(RowWise),
    op("nn.leaky_relu", 1, &[opt("alpha", Float, "0.01")], unary::leaky_relu, k::unary::leaky_relu, Elementwise, "elementwise x where positive, else alpha * x (float)"),
    op("erf", 1, NONE, unary::erf, k::unary::erf, Elementwise, "elementwise Gauss error function (float; GELU is 0.5 x (1 + erf(x / sqrt 2)))").in_stage(RowWise),
    op("sin", 1, NONE, unary::sin, k::unary::sin, Elementwise, "elementwise sine (float)"),
    op("cos", 1, NONE, unary::cos, k::unary::cos, Elementwise, "elementwise cosine (float)"),
    op("tan", 1, NONE, unary::tan, k::unary::tan, Elementwise, "elementwise tangent (float)"),
    op("asin", 1, NONE, unary::asin, k::unary::asin, Elementwise, "elementwise arcsine (float; NaN outside [-1, 1])"),
    op("acos", 1, NONE, unary::acos, k::unary::acos, Elementwise, "elementwise arccosine (float; NaN outside [-1, 1])"),
    op("atan", 1, NONE, unary::atan, k::unary::atan, Elementwise, "elementwise arctangent (float)"),
    op("sinh", 1, NONE, unary::sinh, k::unary::sinh, Elementwise, "elementwise hyperbolic sine (float)"),
    op("cosh", 1, NONE, unary::cosh, k::unary::cosh, Elementwise, "elementwise hyperbolic cosine (float)"),
    op("asinh", 1, NONE, unary::asinh, k::unary::asinh, Elementwise, "elementwise inverse hyperbolic sine (float)"),
    op("acosh", 1, NONE, unary::acosh, k::unary::acosh, Elementwise, "elementwise inverse hyperbolic cosine (float; NaN below 1)"),
    op("atanh", 1, NONE, unary::atanh, k::unary::atanh, Elementwise, "elementwise inverse hyperbolic tangent (float; ±inf at ±1)"),
    op("log2", 1, NONE, unary::log2, k::unary::log2, Elementwise, "elementwise base-2 logarithm (float)"),
    op("log10", 1, NONE, unary::log10, k::unary::log10, Elementwise, "elementwise base-10 logarithm (float)"),
    op("isnan", 1, NONE, unary::isnan, k::unary::isnan, Elementwise, "elementwise x is NaN (float in, bool out)"),
    op("isinf", 1, NONE, unary::isinf, k::unary::isinf, Elementwise, "elementwise x is ±inf (float in, bool out)"),
    op("isfinite", 1, NONE, unary::isfinite, k::unary::isfinite, Elementwise, "elementwise x is neither NaN nor ±inf (float in, bool out)"),
    op("floor", 1, NONE, unary::floor, k::unary::floor, Elementwise, "elementwise largest integer <= x (float)"),
    op("ceil", 1, NONE, unary::ceil, k::unary::ceil, Elementwise, "elementwise smallest integer >= x (float)"),
    op("round", 1, NONE, unary::round, k::unary::round, Elementwise, "elementwise nearest integer, halves to even (float)"),
    op("trunc", 1, NONE, unary::trunc, k::unary::trunc, Elementwise, "elementwise integer part, toward zero (float)"),
    op("sign", 1, NONE, unary::sign, k::unary::sign, Elementwise, "elementwise -1, 0 or 1 by the sign of x"),
    op("nn.prelu", 2, &[opt("axis", Int, "1")], nn::prelu, k::nn::prelu, Broadcast,
        "elementwise x where positive, else alpha[c] * x with c the index along `axis` (float)"),
    op("nn.dropout", 1, &[opt("rate", Float, "0.5")], nn::dropout, k::nn::dropout, Elementwise,
        "the tuple (data, mask of ones): inference semantics, dropout is not applied"),
    op("sequence_mask", 2, &[opt("mask_value", Float, "0.0"), opt("axis", Int, "0")], nn::sequence_mask, k::nn::sequence_mask, Broadcast,
        "mask_value at positions along `axis` (0 or 1) at or past each sequence's valid_length"),
    op("copy", 1, NONE, unary::copy, k::unary::copy, Layout, "a fresh copy of the tensor").in_stage(RowWise),
    // ---- reductions and normalizations ----
    op("nn.softmax", 1, SOFTMAX, reduce::softmax, k::reduce::softmax, Reduction, "softmax along `axis`").in_stage(RowWiseOnLastAxis { default_axis: -1 }),
    op("nn.log_softmax", 1, SOFTMAX, reduce::log_softmax, k::reduce::log_softmax, Reduction, "log of softmax along `axis`").in_stage(RowWiseOnLastAxis { default_axis: -1 }),
    op("nn.layer_norm", 3,
        &[opt("axis", Int, "-1"), opt("epsilon", Float, "1e-05"), opt("center", Bool, "True"), opt("scale", Bool, "True")],
        reduce::layer_norm, k::reduce::layer_norm, Reduction, "layer normalization along `axis`, scaled by gamma and shifted by beta").in_stage(RowWiseOnLastAxis { default_axis: -1 }),
    op("nn.l2_normalize", 1, &[req("eps", Float), opt("axis", Ints, "None")], nn::l2_normalize, k::nn::l2_normalize, Reduction,
        "x / sqrt(max(sum of x² over `axis`, eps)) (None: every axis)"),
    op("nn.batch_norm", 5,
        &[opt("axis", Int, "1"), opt("epsilon", Float, "1e-05"), opt("center", Bool, "True"), opt("scale", Bool, "True")],
        nn::batch_norm, k::nn::batch_norm, Reduction,
        "inference batch normalization by the moving statistics along `axis`; the tuple (out, moving_mean, moving_var)"),
    op("collapse_sum_like", 2, NONE, nn::collapse_sum_like, k::nn::collapse_sum_like, Reduction,
        "data summed over the axes along which the second argument's shape broadcasts to it"),
    op("sum", 1, REDUCE, reduce::sum, k::reduce::sum, Reduction, "sum over `axis` (None: all axes)"),
    op("prod", 1, REDUCE, reduce::prod, k::reduce::prod, Reduction, "product over `axis` (None: all axes)"),
    op("mean", 1, REDUCE, reduce::mean, k::reduce::mean, Reduction, "mean over `axis` (None: all axes)"),
    op("variance", 2, &[opt("axis", IntOrInts, "None"), opt("keepdims", Bool, "False"), opt("exclude", Bool, "False"), opt("unbiased", Bool, "False")],
        reduce::variance, k::reduce::variance, Reduction,
        "mean of (data - mean)² over `axis`, over N - 1 when `unbiased` (Relay's; `mean` with keepdims)"),
    op("all", 1, REDUCE, reduce::all, k::reduce::all, Reduction, "true where every element over `axis` is (bool; None: all axes)"),
    op("any", 1, REDUCE, reduce::any, k::reduce::any, Reduction, "true where some element over `axis` is (bool; None: all axes)"),
    op("max", 1, REDUCE, reduce::max, k::reduce::max, Reduction, "maximum over `axis` (None: all axes)"),
    op("min", 1, REDUCE, reduce::min, k::reduce::min, Reduction, "minimum over `axis` (None: all axes)"),
    op("argmax", 1, ARG_REDUCE, reduce::argmax, k::reduce::argmax, Reduction, "int32 index of the maximum over `axis`"),
    op("argmin", 1, ARG_REDUCE, reduce::argmin, k::reduce::argmin, Reduction, "int32 index of the minimum over `axis`"),
    op("cumsum", 1, &[opt("axis", Int, "None"), opt("dtype", DType, "None"), opt("exclusive", Bool, "None")],
        reduce::cumsum, k::reduce::cumsum, Reduction, "running sums along `axis` (None: over the flattened input), in `dtype`"),
    op("cumprod", 1, &[opt("axis", Int, "None"), opt("dtype", DType, "None"), opt("exclusive", Bool, "None")],
        reduce::cumprod, k::reduce::cumprod, Reduction, "running products along `axis` (None: over the flattened input), in `dtype`"),
    // ---- layout ----
    op("concatenate", 1, &[opt("axis", Int, "0")], layout::concatenate, k::layout::concatenate, Layout,
        "joins a tuple of tensors along `axis`").in_stage(RowWiseOnLastAxis { default_axis: 0 }),
    op("broadcast_to", 1, &[req("shape", Ints)], layout::broadcast_to, k::layout::broadcast_to, Layout,
        "the input repeated along its size-1 and missing leading axes to `shape` (numpy rules)"),
    op("stack", 1, &[opt("axis", Int, "0")], layout::stack, k::layout::stack, Layout,
        "the tuple's tensors (one shape) joined along a new axis `axis`"),
    op("split", 1, &[req("indices_or_sections", IntOrInts), opt("axis", Int, "0")], layout::split, k::layout::split, Layout,
        "cuts along `axis` into N equal sections or at the listed indices; a tuple").in_stage(RowWiseOnLastAxis { default_axis: 0 }),
    op("reshape", 1, &[req("newshape", Ints), opt("allowzero", Bool, "False")], layout::reshape, k::layout::reshape, Layout,
        "same elements, new shape (0 copies, -1 infers, -2 copies the rest, -3 merges, -4 splits)"),
    op("transpose", 1, &[opt("axes", Ints, "None")], layout::transpose, k::layout::transpose, Layout,
        "permutes axes (None: reverses them)"),
    op("expand_dims", 1, &[req("axis", Int), opt("num_newaxis", Int, "1")], layout::expand_dims, k::layout::expand_dims, Layout,
        "inserts `num_newaxis` size-1 axes at `axis`"),
    op("squeeze", 1, &[opt("axis", Ints, "None")], layout::squeeze, k::layout::squeeze, Layout,
        "removes size-1 axes (None: all of them)"),
    op("take", 2,
        &[opt("axis", Int, "None"), opt("batch_dims", Int, "0"), opt("mode", Str, "\"clip\"")],
        layout::take, k::layout::take, Layout, "gathers entries of data at integer indices along `axis`").in_stage(Gather),
    op("strided_slice", 1,
        &[req("begin", Ints), req("end", Ints), opt("strides", Ints, "None"), opt("axes", Ints, "None"),
          opt("slice_mode", Str, "\"end\"")],
        layout::strided_slice, k::layout::strided_slice, Layout, "python-style slice begin:end:stride per axis"),
    op("reverse", 1, &[req("axis", Int)], layout::reverse, k::layout::reverse, Layout,
        "the elements in reverse order along `axis`"),
    op("tile", 1, &[req("reps", Ints)], layout::tile, k::layout::tile, Layout,
        "the input repeated `reps` times per axis (numpy tile: the shorter of shape and reps padded with leading 1s)"),
    op("repeat", 1, &[req("repeats", Int), req("axis", Int)], layout::repeat, k::layout::repeat, Layout,
        "each element repeated `repeats` times along `axis`, consecutively"),
    op("nn.batch_flatten", 1, NONE, layout::batch_flatten, k::layout::batch_flatten, Layout,
        "reshaped to (d0, product of the other dims)"),
    op("gather", 2, &[req("axis", Int)], layout::gather, k::layout::gather, Layout,
        "out[c] = data[c with c[axis] = indices[c]]; indices of the input's rank (PyTorch's gather)"),
    op("gather_nd", 2, &[opt("batch_dims", Int, "0"), opt("index_rank", Int, "None")], layout::gather_nd, k::layout::gather_nd, Layout,
        "blocks of data at the coordinates listed along axis 0 of indices (after `batch_dims` shared axes)"),
    op("reshape_like", 2,
        &[opt("lhs_begin", Int, "0"), opt("lhs_end", Int, "None"), opt("rhs_begin", Int, "0"), opt("rhs_end", Int, "None")],
        nn::reshape_like, k::nn::reshape_like, Layout, "data reshaped to the second argument's shape (axes lhs_begin..lhs_end replaced by its rhs_begin..rhs_end)"),
    op("broadcast_to_like", 2, NONE, nn::broadcast_to_like, k::nn::broadcast_to_like, Layout,
        "data broadcast (numpy rules) to the second argument's shape"),
    op("nn.pad", 2, &[req("pad_width", Any), opt("pad_value", Float, "0"), opt("pad_mode", Str, "\"constant\"")],
        nn::pad, k::nn::pad, Layout,
        "pads each axis by its [before, after] with the scalar pad_value operand (or attribute), or by edge/reflect").or_arity(1),
    // ---- creation and conversion ----
    op("cast", 1, &[req("dtype", DType)], create::cast, k::create::cast, Elementwise, "converts elements to `dtype`"),
    op("zeros_like", 1, NONE, create::zeros_like, k::create::zeros_like, Elementwise, "zeros of the input's type"),
    op("ones_like", 1, NONE, create::ones_like, k::create::ones_like, Elementwise, "ones of the input's type"),
    op("zeros", 0, CREATE, create::zeros, k::create::zeros, Opaque, "a tensor of zeros of `shape` and `dtype`"),
    op("ones", 0, CREATE, create::ones, k::create::ones, Opaque, "a tensor of ones of `shape` and `dtype`"),
    op("shape_of", 1, &[opt("dtype", DType, "\"int32\"")], create::shape_of, k::create::shape_of, Opaque,
        "data's shape as a 1-D integer tensor of its rank's length (dtype int32 by default)"),
    op("ndarray_size", 1, &[opt("dtype", DType, "\"int32\"")], create::ndarray_size, k::create::ndarray_size, Opaque,
        "data's number of elements as an integer scalar (dtype int32 by default)"),
    op("one_hot", 3, &[req("depth", Int), opt("axis", Int, "-1"), opt("dtype", DType, "None")], create::one_hot, k::create::one_hot, Opaque,
        "on_value where the position along a new axis of length `depth` is the index, else off_value"),
    op("full_like", 2, NONE, nn::full_like, k::nn::full_like, Elementwise, "the input's type filled with the scalar fill_value"),
    op("full", 1, &[req("shape", Ints), opt("dtype", DType, "None")], create::full, k::create::full, Opaque,
        "a tensor of `shape` filled with the scalar fill_value"),
    op("arange", 3, &[opt("dtype", DType, "\"float32\"")], create::arange, k::create::arange, Opaque,
        "start, start + step, ... up to stop (scalar operands); the length, ceil((stop - start) / step), is known at run time")
        .sized_at_run_time(),
    // ---- ACROBAT intrinsics ----
    op("db.phase_change", 0, NONE, create::phase_change, k::create::phase_change, Opaque,
        "phase boundary: ops after it run in the next program phase; returns ()"),
    op("db.concurrent", 1, NONE, create::concurrent, k::create::concurrent, Opaque,
        "marks the elements of a literal tuple as independent (same inline depth); returns the tuple"),
    // ACROBAT's form passes the bounds as scalar tensors (`random.db_uniform(0, %n, out_shape=[])`);
    // the attribute form (`low=`, `high=`, no arguments) is kept.
    op("random.db_uniform", 2,
        &[opt("low", Float, "None"), opt("high", Float, "None"), req("out_shape", Ints), opt("out_dtype", DType, "\"int32\"")],
        create::db_uniform, k::create::db_uniform, Opaque,
        "seeded uniform random draw in [low, high) of `out_shape`; bounds as 2 scalar tensor arguments, or as attributes with no arguments")
        .or_arity(0),
];

/// Every operator, in table order.
pub fn all() -> &'static [OpDef] {
    OPS
}
