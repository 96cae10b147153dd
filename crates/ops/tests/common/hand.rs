//! Hand-computed cases: small inputs whose expected results are worked out by hand (in the
//! comments where not obvious), plus the error cases. Run by `tests/kernels.rs`; the coverage test
//! in `tests/golden.rs` requires every operator to appear here.

use super::*;
use tumble_ir::AttrValue::{Bool as B, Float as F, Int as I, Str as S};

/// What a hand case expects.
pub enum Expect {
    /// This value ([`compare`]: exact for ints/bools, tolerances for floats).
    Value(OpValue),
    /// An error whose message contains this text.
    Err(&'static str),
    /// A property of the result (for random draws).
    Check(fn(&OpValue) -> Result<(), String>),
}

pub struct Hand {
    pub op: &'static str,
    pub note: &'static str,
    pub attrs: Attrs,
    pub args: Vec<OpValue>,
    pub expect: Expect,
}

fn ok(
    op: &'static str,
    note: &'static str,
    kv: &[(&str, AttrValue)],
    args: Vec<OpValue>,
    want: OpValue,
) -> Hand {
    Hand {
        op,
        note,
        attrs: attrs(kv),
        args,
        expect: Expect::Value(want),
    }
}

fn err(
    op: &'static str,
    note: &'static str,
    kv: &[(&str, AttrValue)],
    args: Vec<OpValue>,
    msg: &'static str,
) -> Hand {
    Hand {
        op,
        note,
        attrs: attrs(kv),
        args,
        expect: Expect::Err(msg),
    }
}

fn check(
    op: &'static str,
    note: &'static str,
    kv: &[(&str, AttrValue)],
    f: fn(&OpValue) -> Result<(), String>,
) -> Hand {
    Hand {
        op,
        note,
        attrs: attrs(kv),
        args: vec![],
        expect: Expect::Check(f),
    }
}

fn tensor(v: &OpValue) -> Result<&Tensor, String> {
    v.as_tensor().ok_or_else(|| format!("not a tensor: {v:?}"))
}

const NAN: f32 = f32::NAN;
const INF: f32 = f32::INFINITY;

pub fn hand_cases() -> Vec<Hand> {
    let none: &[(&str, AttrValue)] = &[];
    vec![
        // ---- GEMM ----
        ok(
            "nn.dense",
            "[[1,2],[3,4]] · [[1,0],[0,1],[1,1]]ᵀ",
            none,
            vec![
                f32s(&[2, 2], &[1., 2., 3., 4.]),
                f32s(&[3, 2], &[1., 0., 0., 1., 1., 1.]),
            ],
            f32s(&[2, 3], &[1., 2., 3., 3., 4., 7.]),
        ),
        ok(
            "nn.dense",
            "zero inner dimension gives zeros",
            none,
            vec![f32s(&[2, 0], &[]), f32s(&[3, 0], &[])],
            f32s(&[2, 3], &[0.; 6]),
        ),
        err(
            "nn.dense",
            "columns mismatch",
            none,
            vec![f32s(&[1, 3], &[1., 2., 3.]), f32s(&[2, 2], &[0.; 4])],
            "nn.dense: input has 3 columns but weight expects 2",
        ),
        // x @ yᵀ: [[1·5+2·6, 1·7+2·8], [3·5+4·6, 3·7+4·8]]
        ok(
            "nn.batch_matmul",
            "transpose_b default",
            none,
            vec![
                f32s(&[1, 2, 2], &[1., 2., 3., 4.]),
                f32s(&[1, 2, 2], &[5., 6., 7., 8.]),
            ],
            f32s(&[1, 2, 2], &[17., 23., 39., 53.]),
        ),
        ok(
            "nn.batch_matmul",
            "int32, transpose_b=False: x @ y",
            &[("transpose_b", B(false))],
            vec![
                i32s(&[1, 2, 2], &[1, 2, 3, 4]),
                i32s(&[1, 2, 2], &[5, 6, 7, 8]),
            ],
            i32s(&[1, 2, 2], &[19, 22, 43, 50]),
        ),
        ok(
            "nn.batch_matmul",
            "transpose_a: xᵀ @ yᵀ",
            &[("transpose_a", B(true))],
            vec![f64s(&[1, 2, 1], &[1., 2.]), f64s(&[1, 1, 2], &[3., 4.])],
            f64s(&[1, 1, 1], &[11.]),
        ),
        err(
            "nn.batch_matmul",
            "batch mismatch",
            none,
            vec![f32s(&[2, 1, 1], &[1., 2.]), f32s(&[3, 1, 1], &[1., 2., 3.])],
            "batch dimensions 2 and 3",
        ),
        // ---- broadcasting binary ----
        ok(
            "add",
            "(2,1) + (3,)",
            none,
            vec![f32s(&[2, 1], &[1., 2.]), f32s(&[3], &[10., 20., 30.])],
            f32s(&[2, 3], &[11., 21., 31., 12., 22., 32.]),
        ),
        ok(
            "add",
            "int32 wraps",
            none,
            vec![i32s(&[1], &[i32::MAX]), i32s(&[], &[1])],
            i32s(&[1], &[i32::MIN]),
        ),
        err(
            "add",
            "shapes that do not broadcast",
            none,
            vec![f32s(&[2], &[1., 2.]), f32s(&[3], &[1., 2., 3.])],
            "add: cannot broadcast",
        ),
        err(
            "add",
            "dtype mismatch",
            none,
            vec![f32s(&[1], &[1.]), f64s(&[1], &[1.])],
            "dtype mismatch",
        ),
        ok(
            "subtract",
            "int64 minus scalar",
            none,
            vec![i64s(&[2], &[5, 3]), i64s(&[], &[1])],
            i64s(&[2], &[4, 2]),
        ),
        ok(
            "multiply",
            "float64",
            none,
            vec![f64s(&[2], &[1.5, -2.]), f64s(&[1], &[2.])],
            f64s(&[2], &[3., -4.]),
        ),
        ok(
            "divide",
            "int32 truncates toward zero",
            none,
            vec![i32s(&[4], &[7, -7, 7, -7]), i32s(&[4], &[2, 2, -2, -2])],
            i32s(&[4], &[3, -3, -3, 3]),
        ),
        ok(
            "divide",
            "int32 MIN / -1 wraps",
            none,
            vec![i32s(&[1], &[i32::MIN]), i32s(&[1], &[-1])],
            i32s(&[1], &[i32::MIN]),
        ),
        ok(
            "divide",
            "float division by zero is IEEE",
            none,
            vec![f32s(&[3], &[1., -1., 0.]), f32s(&[1], &[0.])],
            f32s(&[3], &[INF, -INF, NAN]),
        ),
        err(
            "divide",
            "integer division by zero",
            none,
            vec![i64s(&[2], &[1, 2]), i64s(&[2], &[1, 0])],
            "divide: integer division by zero",
        ),
        ok(
            "power",
            "ints: repeated multiplication, 0**0 = 1",
            none,
            vec![i64s(&[4], &[2, 3, -2, 0]), i64s(&[4], &[10, 0, 3, 0])],
            i64s(&[4], &[1024, 1, -8, 1]),
        ),
        ok(
            "power",
            "int32 wraps: 2**31",
            none,
            vec![i32s(&[1], &[2]), i32s(&[1], &[31])],
            i32s(&[1], &[i32::MIN]),
        ),
        ok(
            "power",
            "floats",
            none,
            vec![f32s(&[2], &[4., 2.]), f32s(&[2], &[0.5, -1.])],
            f32s(&[2], &[2., 0.5]),
        ),
        err(
            "power",
            "negative integer exponent",
            none,
            vec![i32s(&[1], &[2]), i32s(&[1], &[-1])],
            "power: integers to negative integer powers are not allowed",
        ),
        ok(
            "maximum",
            "NaN propagates",
            none,
            vec![f32s(&[3], &[1., NAN, 3.]), f32s(&[3], &[2., 0., NAN])],
            f32s(&[3], &[2., NAN, NAN]),
        ),
        ok(
            "maximum",
            "int32",
            none,
            vec![i32s(&[2], &[1, 5]), i32s(&[2], &[3, 2])],
            i32s(&[2], &[3, 5]),
        ),
        ok(
            "minimum",
            "NaN propagates",
            none,
            vec![f32s(&[3], &[1., NAN, 3.]), f32s(&[3], &[2., 0., NAN])],
            f32s(&[3], &[1., NAN, NAN]),
        ),
        ok(
            "minimum",
            "int64",
            none,
            vec![i64s(&[2], &[1, 5]), i64s(&[2], &[3, 2])],
            i64s(&[2], &[1, 2]),
        ),
        ok(
            "equal",
            "float with broadcast scalar",
            none,
            vec![f32s(&[3], &[1., 2., NAN]), f32s(&[], &[1.])],
            bools(&[3], &[true, false, false]),
        ),
        ok(
            "not_equal",
            "bools",
            none,
            vec![bools(&[2], &[true, false]), bools(&[2], &[true, true])],
            bools(&[2], &[false, true]),
        ),
        ok(
            "less",
            "int64",
            none,
            vec![i64s(&[3], &[1, 2, 3]), i64s(&[1], &[2])],
            bools(&[3], &[true, false, false]),
        ),
        ok(
            "less",
            "NaN compares false",
            none,
            vec![f32s(&[1], &[NAN]), f32s(&[1], &[1.])],
            bools(&[1], &[false]),
        ),
        ok(
            "greater",
            "int64",
            none,
            vec![i64s(&[3], &[1, 2, 3]), i64s(&[1], &[2])],
            bools(&[3], &[false, false, true]),
        ),
        ok(
            "less_equal",
            "int64",
            none,
            vec![i64s(&[3], &[1, 2, 3]), i64s(&[1], &[2])],
            bools(&[3], &[true, true, false]),
        ),
        ok(
            "greater_equal",
            "int64",
            none,
            vec![i64s(&[3], &[1, 2, 3]), i64s(&[1], &[2])],
            bools(&[3], &[false, true, true]),
        ),
        ok(
            "logical_and",
            "truth table",
            none,
            vec![
                bools(&[4], &[true, true, false, false]),
                bools(&[4], &[true, false, true, false]),
            ],
            bools(&[4], &[true, false, false, false]),
        ),
        ok(
            "logical_or",
            "truth table",
            none,
            vec![
                bools(&[4], &[true, true, false, false]),
                bools(&[4], &[true, false, true, false]),
            ],
            bools(&[4], &[true, true, true, false]),
        ),
        ok(
            "nn.bias_add",
            "axis=1",
            none,
            vec![f32s(&[2, 2], &[1., 2., 3., 4.]), f32s(&[2], &[10., 20.])],
            f32s(&[2, 2], &[11., 22., 13., 24.]),
        ),
        ok(
            "nn.bias_add",
            "axis=0",
            &[("axis", I(0))],
            vec![i32s(&[2, 2], &[1, 2, 3, 4]), i32s(&[2], &[10, 20])],
            i32s(&[2, 2], &[11, 12, 23, 24]),
        ),
        err(
            "nn.bias_add",
            "wrong bias length",
            none,
            vec![f32s(&[2, 2], &[0.; 4]), f32s(&[3], &[0.; 3])],
            "bias has length 3 but input has 2",
        ),
        ok(
            "where",
            "scalar y",
            none,
            vec![
                bools(&[3], &[true, false, true]),
                i32s(&[3], &[1, 2, 3]),
                i32s(&[], &[0]),
            ],
            i32s(&[3], &[1, 0, 3]),
        ),
        ok(
            "where",
            "condition broadcasts over rows",
            none,
            vec![
                bools(&[2, 1], &[true, false]),
                f32s(&[2], &[1., 2.]),
                f32s(&[2], &[8., 9.]),
            ],
            f32s(&[2, 2], &[1., 2., 8., 9.]),
        ),
        ok(
            "clip",
            "float, NaN kept",
            &[("a_min", F(-1.)), ("a_max", I(1))],
            vec![f32s(&[4], &[-2., 0.5, 3., NAN])],
            f32s(&[4], &[-1., 0.5, 1., NAN]),
        ),
        ok(
            "clip",
            "int32 fractional bounds: trunc(clip(x))",
            &[("a_min", F(-0.5)), ("a_max", F(2.7))],
            vec![i32s(&[3], &[-5, 0, 5])],
            i32s(&[3], &[0, 0, 2]),
        ),
        err(
            "clip",
            "a_min above a_max",
            &[("a_min", F(2.)), ("a_max", F(1.))],
            vec![f32s(&[1], &[0.])],
            "must not exceed",
        ),
        // ---- unary ----
        ok(
            "logical_not",
            "",
            none,
            vec![bools(&[2], &[true, false])],
            bools(&[2], &[false, true]),
        ),
        ok(
            "negative",
            "int32 MIN wraps",
            none,
            vec![i32s(&[3], &[1, -2, i32::MIN])],
            i32s(&[3], &[-1, 2, i32::MIN]),
        ),
        ok(
            "negative",
            "float",
            none,
            vec![f64s(&[2], &[1.5, -0.])],
            f64s(&[2], &[-1.5, 0.]),
        ),
        ok(
            "sigmoid",
            "0 and large magnitudes, no overflow",
            none,
            vec![f32s(&[3], &[0., -1000., 1000.])],
            f32s(&[3], &[0.5, 0., 1.]),
        ),
        ok(
            "sigmoid",
            "±ln 3: 1/4 and 3/4",
            none,
            vec![f64s(&[2], &[-(3f64.ln()), 3f64.ln()])],
            f64s(&[2], &[0.25, 0.75]),
        ),
        ok(
            "tanh",
            "",
            none,
            vec![f64s(&[3], &[0., 1000., -1000.])],
            f64s(&[3], &[0., 1., -1.]),
        ),
        ok(
            "exp",
            "",
            none,
            vec![f64s(&[2], &[0., 1.])],
            f64s(&[2], &[1., std::f64::consts::E]),
        ),
        ok(
            "log",
            "log 0 = -inf, log -1 = NaN",
            none,
            vec![f32s(&[4], &[1., std::f32::consts::E, 0., -1.])],
            f32s(&[4], &[0., 1., -INF, NAN]),
        ),
        ok(
            "sqrt",
            "",
            none,
            vec![f32s(&[2], &[4., 9.])],
            f32s(&[2], &[2., 3.]),
        ),
        ok(
            "rsqrt",
            "",
            none,
            vec![f32s(&[3], &[4., 0.25, 0.])],
            f32s(&[3], &[0.5, 2., INF]),
        ),
        ok(
            "erf",
            "odd, saturating, NaN kept",
            none,
            vec![f64s(&[4], &[0., 40., -40., f64::NAN])],
            f64s(&[4], &[0., 1., -1., f64::NAN]),
        ),
        ok(
            "sin",
            "",
            none,
            vec![f64s(&[2], &[0., std::f64::consts::FRAC_PI_2])],
            f64s(&[2], &[0., 1.]),
        ),
        ok(
            "cos",
            "",
            none,
            vec![f64s(&[2], &[0., std::f64::consts::PI])],
            f64s(&[2], &[1., -1.]),
        ),
        ok(
            "floor",
            "",
            none,
            vec![f32s(&[3], &[-0.5, 0.5, INF])],
            f32s(&[3], &[-1., 0., INF]),
        ),
        ok(
            "ceil",
            "",
            none,
            vec![f32s(&[3], &[-0.5, 0.5, -INF])],
            f32s(&[3], &[0., 1., -INF]),
        ),
        ok(
            "round",
            "halves to even",
            none,
            vec![f32s(&[4], &[0.5, 1.5, 2.5, -0.5])],
            f32s(&[4], &[0., 2., 2., 0.]),
        ),
        ok(
            "trunc",
            "",
            none,
            vec![f32s(&[2], &[-1.75, 1.75])],
            f32s(&[2], &[-1., 1.]),
        ),
        ok(
            "sign",
            "int64",
            none,
            vec![i64s(&[3], &[-9, 0, 4])],
            i64s(&[3], &[-1, 0, 1]),
        ),
        ok(
            "mod",
            "int32 truncated: MIN % -1 is 0",
            none,
            vec![i32s(&[3], &[-7, 7, i32::MIN]), i32s(&[3], &[2, -2, -1])],
            i32s(&[3], &[-1, 1, 0]),
        ),
        err(
            "mod",
            "integer modulo by zero",
            none,
            vec![i32s(&[1], &[1]), i32s(&[1], &[0])],
            "mod: integer modulo by zero",
        ),
        ok(
            "floor_mod",
            "int32 floored",
            none,
            vec![i32s(&[3], &[-7, 7, i32::MIN]), i32s(&[3], &[2, -2, -1])],
            i32s(&[3], &[1, -1, 0]),
        ),
        Hand {
            op: "floor_mod",
            note: "a zero takes the divisor's sign (-0.0 % 5.0 is 0.0), as Python's %",
            attrs: attrs(none),
            args: vec![f64s(&[2], &[-0.0, 0.0]), f64s(&[2], &[5.0, -3.0])],
            expect: Expect::Check(|v| {
                let got = v.as_tensor().map(|t| t.to_f64_vec()).unwrap_or_default();
                match got[..] {
                    [a, b]
                        if a == 0.0 && a.is_sign_positive() && b == 0.0 && b.is_sign_negative() =>
                    {
                        Ok(())
                    }
                    _ => Err(format!("got {got:?}, want [0.0, -0.0]")),
                }
            }),
        },
        ok(
            "floor_divide",
            "float64 7.0 // 0.1 is 69 (the remainder's quotient), not floor(70.0)",
            none,
            vec![f64s(&[1], &[7.0]), f64s(&[1], &[0.1])],
            f64s(&[1], &[69.0]),
        ),
        ok(
            "floor_divide",
            "int32 toward -inf; MIN // -1 wraps",
            none,
            vec![i32s(&[3], &[-7, 7, i32::MIN]), i32s(&[3], &[2, -2, -1])],
            i32s(&[3], &[-4, -4, i32::MIN]),
        ),
        err(
            "floor_divide",
            "integer division by zero",
            none,
            vec![i64s(&[1], &[1]), i64s(&[1], &[0])],
            "floor_divide: integer division by zero",
        ),
        ok(
            "abs",
            "int32 MIN wraps",
            none,
            vec![i32s(&[2], &[i32::MIN, -3])],
            i32s(&[2], &[i32::MIN, 3]),
        ),
        ok(
            "abs",
            "float",
            none,
            vec![f32s(&[2], &[-1.5, 2.])],
            f32s(&[2], &[1.5, 2.]),
        ),
        ok(
            "nn.relu",
            "NaN kept",
            none,
            vec![f32s(&[4], &[-1., 0., 2., NAN])],
            f32s(&[4], &[0., 0., 2., NAN]),
        ),
        ok(
            "nn.relu",
            "int64",
            none,
            vec![i64s(&[2], &[-3, 4])],
            i64s(&[2], &[0, 4]),
        ),
        ok(
            "copy",
            "bool",
            none,
            vec![bools(&[2], &[true, false])],
            bools(&[2], &[true, false]),
        ),
        // ---- reductions and normalizations ----
        ok(
            "nn.softmax",
            "[0, ln 2] -> [1/3, 2/3]",
            none,
            vec![f64s(&[2], &[0., 2f64.ln()])],
            f64s(&[2], &[1. / 3., 2. / 3.]),
        ),
        ok(
            "nn.softmax",
            "large equal values",
            none,
            vec![f32s(&[2], &[1000., 1000.])],
            f32s(&[2], &[0.5, 0.5]),
        ),
        ok(
            "nn.softmax",
            "axis=0",
            &[("axis", I(0))],
            vec![f32s(&[2, 1], &[0., 0.])],
            f32s(&[2, 1], &[0.5, 0.5]),
        ),
        err(
            "nn.softmax",
            "int input",
            none,
            vec![i32s(&[2], &[1, 2])],
            "float dtype",
        ),
        ok(
            "nn.log_softmax",
            "[0, 0] -> -ln 2",
            none,
            vec![f64s(&[2], &[0., 0.])],
            f64s(&[2], &[-(2f64.ln()), -(2f64.ln())]),
        ),
        ok(
            "nn.log_softmax",
            "[1000, 0]: no overflow",
            none,
            vec![f32s(&[2], &[1000., 0.])],
            f32s(&[2], &[0., -1000.]),
        ),
        // mean 2.5, variance 1.25: (x - 2.5) / sqrt(1.25) = ±1.3416407865, ±0.4472135955
        ok(
            "nn.layer_norm",
            "epsilon 0",
            &[("epsilon", F(0.))],
            vec![
                f64s(&[4], &[1., 2., 3., 4.]),
                f64s(&[4], &[1.; 4]),
                f64s(&[4], &[0.; 4]),
            ],
            f64s(
                &[4],
                &[
                    -1.3416407864998738,
                    -0.4472135954999579,
                    0.4472135954999579,
                    1.3416407864998738,
                ],
            ),
        ),
        ok(
            "nn.layer_norm",
            "gamma 2, beta 1, rows of a matrix",
            &[("epsilon", F(0.))],
            vec![
                f32s(&[2, 2], &[1., 3., 5., 5.5]),
                f32s(&[2], &[2., 2.]),
                f32s(&[2], &[1., 1.]),
            ],
            f32s(&[2, 2], &[-1., 3., -1., 3.]),
        ),
        ok(
            "nn.layer_norm",
            "constant row: 0 (epsilon keeps it finite)",
            none,
            vec![
                f32s(&[3], &[7., 7., 7.]),
                f32s(&[3], &[1.; 3]),
                f32s(&[3], &[0.; 3]),
            ],
            f32s(&[3], &[0.; 3]),
        ),
        ok(
            "sum",
            "int32 axis=0",
            &[("axis", I(0))],
            vec![i32s(&[2, 2], &[1, 2, 3, 4])],
            i32s(&[2], &[4, 6]),
        ),
        ok(
            "sum",
            "keepdims",
            &[("axis", I(1)), ("keepdims", B(true))],
            vec![f32s(&[2, 2], &[1., 2., 3., 4.])],
            f32s(&[2, 1], &[3., 7.]),
        ),
        ok(
            "sum",
            "empty sum is 0",
            none,
            vec![f32s(&[0], &[])],
            f32s(&[], &[0.]),
        ),
        ok(
            "mean",
            "int32 truncates",
            &[("axis", I(1))],
            vec![i32s(&[3, 2], &[1, 2, 3, 5, -3, 0])],
            i32s(&[3], &[1, 4, -1]),
        ),
        ok(
            "mean",
            "float",
            none,
            vec![f32s(&[4], &[1., 2., 3., 4.])],
            f32s(&[], &[2.5]),
        ),
        ok(
            "mean",
            "empty float mean is NaN",
            none,
            vec![f32s(&[0], &[])],
            f32s(&[], &[NAN]),
        ),
        err(
            "mean",
            "empty int mean",
            none,
            vec![i32s(&[0], &[])],
            "division by zero",
        ),
        ok(
            "mean",
            "int mean over an empty axis with no outputs is empty",
            &[("axis", I(1))],
            vec![i32s(&[0, 0], &[])],
            i32s(&[0], &[]),
        ),
        ok(
            "max",
            "no outputs: nothing to reduce, no error",
            &[("axis", I(0))],
            vec![f32s(&[0, 0], &[])],
            f32s(&[0], &[]),
        ),
        ok(
            "max",
            "axis=1",
            &[("axis", I(1))],
            vec![f32s(&[2, 2], &[1., 5., 7., 2.])],
            f32s(&[2], &[5., 7.]),
        ),
        ok(
            "max",
            "NaN propagates",
            none,
            vec![f32s(&[3], &[1., NAN, 5.])],
            f32s(&[], &[NAN]),
        ),
        err("max", "empty", none, vec![f32s(&[2, 0], &[])], "empty axis"),
        ok(
            "min",
            "int32 exclude axis 0 -> reduces axis 1",
            &[("axis", I(0)), ("exclude", B(true))],
            vec![i32s(&[2, 3], &[4, -1, 2, 0, 9, 3])],
            i32s(&[2], &[-1, 0]),
        ),
        ok(
            "argmax",
            "ties: first",
            none,
            vec![f32s(&[4], &[1., 3., 3., 2.])],
            i32s(&[], &[1]),
        ),
        ok(
            "argmax",
            "ties: last",
            &[("select_last_index", B(true))],
            vec![f32s(&[4], &[1., 3., 3., 2.])],
            i32s(&[], &[2]),
        ),
        ok(
            "argmax",
            "NaN wins (first)",
            none,
            vec![f32s(&[4], &[1., NAN, 5., NAN])],
            i32s(&[], &[1]),
        ),
        ok(
            "argmax",
            "int64 rows",
            &[("axis", I(-1))],
            vec![i64s(&[2, 2], &[1, 2, 4, 3])],
            i32s(&[2], &[1, 0]),
        ),
        err("argmax", "empty", none, vec![f32s(&[0], &[])], "empty axis"),
        ok(
            "argmin",
            "ties: first",
            none,
            vec![i32s(&[3], &[2, 1, 1])],
            i32s(&[], &[1]),
        ),
        ok(
            "argmin",
            "ties: last",
            &[("select_last_index", B(true))],
            vec![i32s(&[3], &[2, 1, 1])],
            i32s(&[], &[2]),
        ),
        // ---- layout ----
        ok(
            "one_hot",
            "int32 values, depth 3",
            &[("depth", I(3))],
            vec![i32s(&[2], &[2, 0]), i32s(&[], &[7]), i32s(&[], &[0])],
            i32s(&[2, 3], &[0, 0, 7, 7, 0, 0]),
        ),
        err(
            "one_hot",
            "on and off differ in dtype",
            &[("depth", I(3))],
            vec![i32s(&[1], &[0]), f32s(&[], &[1.]), i32s(&[], &[0])],
            "dtype mismatch",
        ),
        ok(
            "broadcast_to",
            "(2, 1) to (2, 3)",
            &[("shape", AttrValue::List(vec![I(2), I(3)]))],
            vec![i32s(&[2, 1], &[1, 2])],
            i32s(&[2, 3], &[1, 1, 1, 2, 2, 2]),
        ),
        err(
            "broadcast_to",
            "an axis neither equal nor 1",
            &[("shape", AttrValue::List(vec![I(3)]))],
            vec![i32s(&[2], &[1, 2])],
            "cannot broadcast",
        ),
        ok(
            "nn.leaky_relu",
            "",
            &[("alpha", F(0.5))],
            vec![f32s(&[3], &[-2., 0., 3.])],
            f32s(&[3], &[-1., 0., 3.]),
        ),
        ok(
            "stack",
            "axis=1 of two (2,)",
            &[("axis", I(1))],
            vec![tup(vec![i32s(&[2], &[1, 2]), i32s(&[2], &[3, 4])])],
            i32s(&[2, 2], &[1, 3, 2, 4]),
        ),
        err(
            "stack",
            "shapes differ",
            none,
            vec![tup(vec![f32s(&[2], &[1., 2.]), f32s(&[1], &[3.])])],
            "all fields must have one shape",
        ),
        err(
            "stack",
            "axis past rank + 1",
            &[("axis", I(2))],
            vec![tup(vec![f32s(&[2], &[1., 2.])])],
            "out of range",
        ),
        ok(
            "concatenate",
            "1-D",
            none,
            vec![tup(vec![f32s(&[2], &[1., 2.]), f32s(&[1], &[3.])])],
            f32s(&[3], &[1., 2., 3.]),
        ),
        ok(
            "concatenate",
            "axis=1 of (2,1) and (2,2)",
            &[("axis", I(1))],
            vec![tup(vec![
                i32s(&[2, 1], &[1, 2]),
                i32s(&[2, 2], &[3, 4, 5, 6]),
            ])],
            i32s(&[2, 3], &[1, 3, 4, 2, 5, 6]),
        ),
        err(
            "concatenate",
            "dtype mismatch",
            none,
            vec![tup(vec![f32s(&[1], &[1.]), i32s(&[1], &[1])])],
            "dtype mismatch",
        ),
        err(
            "concatenate",
            "empty tuple",
            none,
            vec![tup(vec![])],
            "non-empty tuple",
        ),
        ok(
            "split",
            "2 sections",
            &[("indices_or_sections", I(2))],
            vec![i32s(&[4], &[1, 2, 3, 4])],
            tup(vec![i32s(&[2], &[1, 2]), i32s(&[2], &[3, 4])]),
        ),
        ok(
            "split",
            "indices [1, 3]",
            &[("indices_or_sections", ints(&[1, 3]))],
            vec![i32s(&[4], &[1, 2, 3, 4])],
            tup(vec![
                i32s(&[1], &[1]),
                i32s(&[2], &[2, 3]),
                i32s(&[1], &[4]),
            ]),
        ),
        ok(
            "split",
            "axis=1",
            &[("indices_or_sections", I(2)), ("axis", I(1))],
            vec![f32s(&[2, 2], &[1., 2., 3., 4.])],
            tup(vec![f32s(&[2, 1], &[1., 3.]), f32s(&[2, 1], &[2., 4.])]),
        ),
        err(
            "split",
            "uneven sections",
            &[("indices_or_sections", I(3))],
            vec![i32s(&[4], &[0; 4])],
            "cannot split dimension 4",
        ),
        ok(
            "reshape",
            "[-1, 2]",
            &[("newshape", ints(&[-1, 2]))],
            vec![i32s(&[2, 3], &[1, 2, 3, 4, 5, 6])],
            i32s(&[3, 2], &[1, 2, 3, 4, 5, 6]),
        ),
        ok(
            "reshape",
            "[-4, 1, 2, -2]: split dim 0, copy the rest",
            &[("newshape", ints(&[-4, 1, 2, -2]))],
            vec![i32s(&[2, 3], &[1, 2, 3, 4, 5, 6])],
            i32s(&[1, 2, 3], &[1, 2, 3, 4, 5, 6]),
        ),
        ok(
            "reshape",
            "[-3]: merge",
            &[("newshape", ints(&[-3]))],
            vec![bools(&[1, 2], &[true, false])],
            bools(&[2], &[true, false]),
        ),
        err(
            "reshape",
            "element counts differ",
            &[("newshape", ints(&[4]))],
            vec![i32s(&[2, 3], &[0; 6])],
            "cannot reshape",
        ),
        ok(
            "transpose",
            "2-D",
            none,
            vec![i32s(&[2, 3], &[1, 2, 3, 4, 5, 6])],
            i32s(&[3, 2], &[1, 4, 2, 5, 3, 6]),
        ),
        ok(
            "transpose",
            "3-D axes [2, 0, 1]",
            &[("axes", ints(&[2, 0, 1]))],
            vec![i32s(&[1, 2, 2], &[1, 2, 3, 4])],
            i32s(&[2, 1, 2], &[1, 3, 2, 4]),
        ),
        err(
            "transpose",
            "not a permutation",
            &[("axes", ints(&[0, 0]))],
            vec![i32s(&[1, 1], &[0])],
            "not a permutation",
        ),
        ok(
            "expand_dims",
            "axis=0",
            &[("axis", I(0))],
            vec![f32s(&[2], &[1., 2.])],
            f32s(&[1, 2], &[1., 2.]),
        ),
        ok(
            "squeeze",
            "all",
            none,
            vec![f32s(&[1, 2, 1], &[1., 2.])],
            f32s(&[2], &[1., 2.]),
        ),
        ok(
            "squeeze",
            "axis=[2]",
            &[("axis", ints(&[2]))],
            vec![f32s(&[1, 2, 1], &[1., 2.])],
            f32s(&[1, 2], &[1., 2.]),
        ),
        err(
            "squeeze",
            "axis of size 2",
            &[("axis", ints(&[1]))],
            vec![f32s(&[1, 2], &[1., 2.])],
            "its size is 2",
        ),
        ok(
            "take",
            "clip (default)",
            none,
            vec![i32s(&[3], &[10, 20, 30]), i32s(&[4], &[0, 2, 5, -1])],
            i32s(&[4], &[10, 30, 30, 10]),
        ),
        ok(
            "take",
            "wrap",
            &[("mode", S("wrap".into()))],
            vec![i32s(&[3], &[10, 20, 30]), i32s(&[4], &[0, 2, 5, -1])],
            i32s(&[4], &[10, 30, 30, 30]),
        ),
        ok(
            "take",
            "fast, negative counts from the end",
            &[("mode", S("fast".into())), ("axis", I(0))],
            vec![i32s(&[3], &[10, 20, 30]), i64s(&[2], &[0, -1])],
            i32s(&[2], &[10, 30]),
        ),
        err(
            "take",
            "fast, out of range",
            &[("mode", S("fast".into()))],
            vec![i32s(&[3], &[10, 20, 30]), i64s(&[1], &[3])],
            "index 3 is out of range",
        ),
        err(
            "take",
            "from an empty axis",
            &[("axis", I(0))],
            vec![f32s(&[0], &[]), i32s(&[1], &[0])],
            "the axis has length 0",
        ),
        ok(
            "take",
            "empty indices from an empty axis",
            &[("axis", I(0))],
            vec![f32s(&[0], &[]), i32s(&[0], &[])],
            f32s(&[0], &[]),
        ),
        ok(
            "take",
            "axis=1, batch_dims=1: out[b, j] = x[b, idx[b, j]]",
            &[("axis", I(1)), ("batch_dims", I(1))],
            vec![i32s(&[2, 3], &[1, 2, 3, 4, 5, 6]), i32s(&[2, 1], &[2, 0])],
            i32s(&[2, 1], &[3, 4]),
        ),
        ok(
            "take",
            "axis=0 of a matrix: rows",
            &[("axis", I(0))],
            vec![i32s(&[2, 2], &[1, 2, 3, 4]), i32s(&[3], &[1, 1, 0])],
            i32s(&[3, 2], &[3, 4, 3, 4, 1, 2]),
        ),
        ok(
            "strided_slice",
            "negative stride -2",
            &[
                ("begin", ints(&[5])),
                ("end", ints(&[0])),
                ("strides", ints(&[-2])),
            ],
            vec![i32s(&[6], &[0, 1, 2, 3, 4, 5])],
            i32s(&[3], &[5, 3, 1]),
        ),
        ok(
            "strided_slice",
            "2-D, second axis reversed",
            &[
                ("begin", ints(&[0, -1])),
                ("end", ints(&[2, -4])),
                ("strides", ints(&[1, -1])),
            ],
            vec![i32s(&[2, 3], &[1, 2, 3, 4, 5, 6])],
            i32s(&[2, 3], &[3, 2, 1, 6, 5, 4]),
        ),
        err(
            "strided_slice",
            "stride 0",
            &[
                ("begin", ints(&[0])),
                ("end", ints(&[1])),
                ("strides", ints(&[0])),
            ],
            vec![i32s(&[2], &[0, 0])],
            "stride along axis 0 is 0",
        ),
        // ---- creation and conversion ----
        ok(
            "cast",
            "float -> int truncates",
            &[("dtype", S("int32".into()))],
            vec![f32s(&[3], &[-1.7, 2.9, NAN])],
            i32s(&[3], &[-1, 2, 0]),
        ),
        ok(
            "cast",
            "int -> bool",
            &[("dtype", S("bool".into()))],
            vec![i64s(&[2], &[0, -3])],
            bools(&[2], &[false, true]),
        ),
        ok(
            "zeros_like",
            "int32",
            none,
            vec![i32s(&[2], &[5, 6])],
            i32s(&[2], &[0, 0]),
        ),
        ok(
            "ones_like",
            "bool",
            none,
            vec![bools(&[1], &[false])],
            bools(&[1], &[true]),
        ),
        ok(
            "zeros",
            "default float32",
            &[("shape", ints(&[2]))],
            vec![],
            f32s(&[2], &[0., 0.]),
        ),
        ok(
            "zeros",
            "empty shape",
            &[("shape", ints(&[0, 3]))],
            vec![],
            f32s(&[0, 3], &[]),
        ),
        ok(
            "ones",
            "int64 scalar",
            &[("shape", ints(&[])), ("dtype", S("int64".into()))],
            vec![],
            i64s(&[], &[1]),
        ),
        ok(
            "full",
            "int fill to float64",
            &[("shape", ints(&[2, 2])), ("dtype", S("float64".into()))],
            vec![i32s(&[], &[7])],
            f64s(&[2, 2], &[7.; 4]),
        ),
        err(
            "full",
            "fill_value not a scalar",
            &[("shape", ints(&[2]))],
            vec![f32s(&[2], &[1., 2.])],
            "fill_value must be a scalar",
        ),
        ok("db.phase_change", "unit", none, vec![], OpValue::unit()),
        ok(
            "db.concurrent",
            "identity on a tuple",
            none,
            vec![OpValue::Tuple(vec![
                Tensor::from_f32([2], vec![1.0, 2.0]).expect("t")
            ])],
            OpValue::Tuple(vec![Tensor::from_f32([2], vec![1.0, 2.0]).expect("t")]),
        ),
        check(
            "random.db_uniform",
            "int32 in [0, 3), every value drawn",
            &[("low", I(0)), ("high", I(3)), ("out_shape", ints(&[1000]))],
            |v| {
                let t = tensor(v)?;
                let xs = t.as_i32().ok_or("not int32")?;
                if t.shape() != [1000] || !xs.iter().all(|x| (0..3).contains(x)) {
                    return Err(format!("out of range: {t}"));
                }
                if !(0..3).all(|k| xs.contains(&k)) {
                    return Err(format!("not every value drawn: {t}"));
                }
                Ok(())
            },
        ),
        check(
            "random.db_uniform",
            "int64 fractional bounds [0.5, 2.5) -> {1, 2}",
            &[
                ("low", F(0.5)),
                ("high", F(2.5)),
                ("out_shape", ints(&[200])),
                ("out_dtype", S("int64".into())),
            ],
            |v| {
                let xs = tensor(v)?.as_i64().ok_or("not int64")?.to_vec();
                if xs.iter().all(|x| *x == 1 || *x == 2) && xs.contains(&1) && xs.contains(&2) {
                    Ok(())
                } else {
                    Err(format!("{xs:?}"))
                }
            },
        ),
        check(
            "random.db_uniform",
            "float32 in [-1, 1), mean near 0",
            &[
                ("low", I(-1)),
                ("high", I(1)),
                ("out_shape", ints(&[50, 40])),
                ("out_dtype", S("float32".into())),
            ],
            |v| {
                let t = tensor(v)?;
                let xs = t.as_f32().ok_or("not float32")?;
                if t.shape() != [50, 40] || !xs.iter().all(|x| (-1.0..1.0).contains(x)) {
                    return Err(format!("out of range: {t}"));
                }
                let mean = xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64;
                if mean.abs() > 0.05 {
                    return Err(format!("mean {mean}"));
                }
                Ok(())
            },
        ),
        check(
            "random.db_uniform",
            "low == high integral: constant",
            &[("low", I(2)), ("high", I(2)), ("out_shape", ints(&[3]))],
            |v| match tensor(v)?.as_i32() {
                Some([2, 2, 2]) => Ok(()),
                other => Err(format!("{other:?}")),
            },
        ),
        err(
            "random.db_uniform",
            "no integer in the range",
            &[("low", F(0.2)), ("high", F(0.8)), ("out_shape", ints(&[1]))],
            vec![],
            "contains no integer",
        ),
        err(
            "random.db_uniform",
            "does not fit int32",
            &[("low", F(0.)), ("high", F(1e10)), ("out_shape", ints(&[1]))],
            vec![],
            "does not fit in int32",
        ),
        ok(
            "logical_xor",
            "truth table",
            none,
            vec![
                bools(&[4], &[true, true, false, false]),
                bools(&[4], &[true, false, true, false]),
            ],
            bools(&[4], &[false, true, true, false]),
        ),
        ok(
            "tan",
            "0 and pi/4",
            none,
            vec![f64s(&[2], &[0., std::f64::consts::FRAC_PI_4])],
            f64s(&[2], &[0., std::f64::consts::FRAC_PI_4.tan()]),
        ),
        ok(
            "asin",
            "NaN outside [-1, 1]",
            none,
            vec![f32s(&[3], &[1., 0., 2.])],
            f32s(&[3], &[std::f32::consts::FRAC_PI_2, 0., NAN]),
        ),
        ok(
            "acos",
            "0 at 1",
            none,
            vec![f32s(&[2], &[1., -2.])],
            f32s(&[2], &[0., NAN]),
        ),
        ok(
            "atan",
            "limits",
            none,
            vec![f32s(&[3], &[0., INF, -INF])],
            f32s(
                &[3],
                &[
                    0.,
                    std::f32::consts::FRAC_PI_2,
                    -std::f32::consts::FRAC_PI_2,
                ],
            ),
        ),
        ok(
            "sinh",
            "odd",
            none,
            vec![f32s(&[3], &[0., INF, -INF])],
            f32s(&[3], &[0., INF, -INF]),
        ),
        ok(
            "cosh",
            "even",
            none,
            vec![f32s(&[3], &[0., INF, -INF])],
            f32s(&[3], &[1., INF, INF]),
        ),
        ok(
            "asinh",
            "odd",
            none,
            vec![f32s(&[2], &[0., -INF])],
            f32s(&[2], &[0., -INF]),
        ),
        ok(
            "acosh",
            "0 at 1, NaN below",
            none,
            vec![f32s(&[2], &[1., 0.5])],
            f32s(&[2], &[0., NAN]),
        ),
        ok(
            "atanh",
            "±inf at ±1",
            none,
            vec![f32s(&[3], &[0., 1., -1.])],
            f32s(&[3], &[0., INF, -INF]),
        ),
        ok(
            "log2",
            "exact powers",
            none,
            vec![f32s(&[3], &[1., 1024., 0.])],
            f32s(&[3], &[0., 10., -INF]),
        ),
        ok(
            "log10",
            "exact powers",
            none,
            vec![f64s(&[2], &[1000., 0.01])],
            f64s(&[2], &[3., -2.]),
        ),
        ok(
            "isnan",
            "",
            none,
            vec![f32s(&[3], &[NAN, INF, 1.])],
            bools(&[3], &[true, false, false]),
        ),
        ok(
            "isinf",
            "",
            none,
            vec![f32s(&[3], &[NAN, -INF, 1.])],
            bools(&[3], &[false, true, false]),
        ),
        ok(
            "isfinite",
            "",
            none,
            vec![f32s(&[3], &[NAN, INF, -0.])],
            bools(&[3], &[false, false, true]),
        ),
        err(
            "isnan",
            "a float input",
            none,
            vec![i32s(&[1], &[1])],
            "float",
        ),
        ok(
            "prod",
            "empty product is 1",
            none,
            vec![f32s(&[0], &[])],
            f32s(&[], &[1.]),
        ),
        ok(
            "prod",
            "int32 axis=1 wraps",
            &[("axis", I(1))],
            vec![i32s(&[2, 2], &[65536, 65536, -3, 4])],
            i32s(&[2], &[0, -12]),
        ),
        ok(
            "all",
            "axis=1",
            &[("axis", I(1))],
            vec![bools(&[2, 2], &[true, false, true, true])],
            bools(&[2], &[false, true]),
        ),
        ok(
            "any",
            "axis=0",
            &[("axis", I(0))],
            vec![bools(&[2, 2], &[true, false, false, false])],
            bools(&[2], &[true, false]),
        ),
        err(
            "all",
            "a bool input",
            none,
            vec![f32s(&[2], &[1., 0.])],
            "bool",
        ),
        ok(
            "variance",
            "the keepdims mean; unbiased",
            &[("axis", ints(&[1])), ("unbiased", B(true))],
            vec![
                f32s(&[2, 3], &[1., 2., 3., 4., 4., 4.]),
                f32s(&[2, 1], &[2., 4.]),
            ],
            f32s(&[2], &[1., 0.]),
        ),
        err(
            "variance",
            "a mean that does not broadcast",
            &[("axis", ints(&[1]))],
            vec![f32s(&[2, 3], &[0.; 6]), f32s(&[2, 2], &[0.; 4])],
            "keepdims=True",
        ),
        err(
            "variance",
            "a mean without keepdims (it would broadcast along the wrong axis)",
            &[("axis", ints(&[1]))],
            vec![f32s(&[3, 3], &[0.; 9]), f32s(&[3], &[0.; 3])],
            "keepdims=True",
        ),
        err(
            "variance",
            "a mean varying along the reduced axis",
            &[("axis", ints(&[0]))],
            vec![f32s(&[3, 4], &[0.; 12]), f32s(&[3, 1], &[0.; 3])],
            "keepdims=True",
        ),
        ok(
            "variance",
            "an empty axis, unbiased: NaN (numpy's ddof=1)",
            &[("axis", ints(&[1])), ("unbiased", B(true))],
            vec![f32s(&[2, 0], &[]), f32s(&[2, 1], &[0., 0.])],
            f32s(&[2], &[NAN, NAN]),
        ),
    ]
}
