//! Shape relations through the public interface: `lookup(name)`, `(op.relation)(args, attrs)`.

// `&[x.clone()]` reads better than `std::slice::from_ref(&x)` in a table of cases.
#![allow(clippy::cloned_ref_to_slice_refs)]

use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Attrs, DType, Dim, Span, Ty};
use tumble_ops::{check_attrs, lookup, RelError};

use AttrValue::{Bool as B, Float as F, Int as I, List as L, Str as S};
use DType::{Bool, Float32, Float64, Int32, Int64};

const A: i64 = -1; // stands for `?` in `t(...)`

/// A tensor type; `-1` entries are `?` dims.
fn t(shape: &[i64], dtype: DType) -> Ty {
    Ty::tensor(
        shape
            .iter()
            .map(|&d| if d == A { Dim::Any } else { Dim::Known(d) })
            .collect::<Vec<_>>(),
        dtype,
    )
}

fn f32t(shape: &[i64]) -> Ty {
    t(shape, Float32)
}

fn attrs(kv: &[(&str, AttrValue)]) -> Attrs {
    Attrs(
        kv.iter()
            .map(|(k, v)| Attr {
                name: k.to_string(),
                value: v.clone(),
                span: Span::default(),
            })
            .collect(),
    )
}

fn ints(v: &[i64]) -> AttrValue {
    L(v.iter().map(|&n| I(n)).collect())
}

fn run(op: &str, args: &[Ty], kv: &[(&str, AttrValue)]) -> Result<Ty, RelError> {
    let def = lookup(op).unwrap_or_else(|| panic!("no op {op}"));
    let a = attrs(kv);
    (def.relation)(args, &a)
}

#[track_caller]
fn ok(op: &str, args: &[Ty], kv: &[(&str, AttrValue)], want: Ty) {
    match run(op, args, kv) {
        Ok(got) => assert_eq!(got, want, "{op}: got {got}, want {want}"),
        Err(e) => panic!("{op}: unexpected error: {}", e.message),
    }
}

/// Expects an error whose message contains `msg`; returns it for further checks.
#[track_caller]
fn bad(op: &str, args: &[Ty], kv: &[(&str, AttrValue)], msg: &str) -> RelError {
    match run(op, args, kv) {
        Ok(got) => panic!("{op}: expected error containing {msg:?}, got {got}"),
        Err(e) => {
            assert!(
                e.message.contains(msg),
                "{op}: message {:?} does not contain {msg:?}",
                e.message
            );
            assert!(e.message.starts_with(&format!("{op}: ")), "{:?}", e.message);
            e
        }
    }
}

// ---------------------------------------------------------------- registry

#[test]
fn names_unique_and_lookup_finds_all() {
    let all = tumble_ops::all();
    let mut names: Vec<&str> = all.iter().map(|o| o.name).collect();
    names.sort();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "duplicate operator names");
    for op in all {
        assert_eq!(lookup(op.name).map(|o| o.name), Some(op.name));
        assert!(!op.doc.is_empty() && !op.doc.contains('\n'), "{}", op.name);
        let mut attr_names: Vec<&str> = op.attrs.iter().map(|a| a.name).collect();
        attr_names.sort();
        let k = attr_names.len();
        attr_names.dedup();
        assert_eq!(attr_names.len(), k, "{}: duplicate attribute", op.name);
        for a in op.attrs {
            assert_eq!(a.required, a.default.is_empty(), "{}.{}", op.name, a.name);
        }
    }
    assert!(lookup("nn.conv2d").is_none());
    assert!(n >= 56, "{n} ops");
}

#[test]
fn empty_attrs_pass_check_attrs_unless_required() {
    for op in tumble_ops::all() {
        let r = check_attrs(op, &Attrs::default());
        if op.attrs.iter().any(|a| a.required) {
            let (_, msg) = r.expect_err(op.name);
            assert!(msg.contains("missing required attribute"), "{msg}");
        } else {
            assert!(r.is_ok(), "{}: {r:?}", op.name);
        }
    }
}

#[test]
fn every_relation_names_its_op_and_checks_arity() {
    for op in tumble_ops::all() {
        let args = vec![f32t(&[2]); op.arity + 1];
        let e = (op.relation)(&args, &Attrs::default()).expect_err(op.name);
        assert!(
            e.message
                .starts_with(&format!("{}: expected {}", op.name, op.arity)),
            "{}",
            e.message
        );
    }
}

#[test]
fn relations_never_panic_on_odd_inputs() {
    let tys = [
        f32t(&[]),
        f32t(&[0]),
        f32t(&[1, A, 3]),
        t(&[i64::MAX, i64::MAX], Int64),
        t(&[A, A], Bool),
        f32t(&[-5]),
        Ty::Tuple(vec![f32t(&[2, 3]), t(&[2], Int32)]),
        Ty::Tuple(vec![]),
        Ty::Param("A".into()),
        Ty::Adt("List".into(), vec![f32t(&[2])]),
        Ty::Func(vec![], Box::new(f32t(&[]))),
    ];
    let vals = [
        I(0),
        I(-1),
        I(i64::MAX),
        I(i64::MIN),
        F(f64::NAN),
        B(true),
        S("x".into()),
        ints(&[]),
        ints(&[i64::MIN, i64::MAX, -4, -3, -2, -1, 0]),
        ints(&[-4, -1, -1]),
        AttrValue::None,
    ];
    for op in tumble_ops::all() {
        let names: Vec<&str> = op.attrs.iter().map(|a| a.name).collect();
        for (k, _) in tys.iter().enumerate() {
            let args: Vec<Ty> = (0..op.arity)
                .map(|i| tys[(k + i * 3) % tys.len()].clone())
                .collect();
            for v in &vals {
                let kv: Vec<(&str, AttrValue)> = names.iter().map(|&n| (n, v.clone())).collect();
                let _ = (op.relation)(&args, &attrs(&kv));
            }
        }
    }
}

// ---------------------------------------------------------------- gemm

#[test]
fn dense() {
    ok(
        "nn.dense",
        &[f32t(&[8, 256]), f32t(&[128, 256])],
        &[],
        f32t(&[8, 128]),
    );
    ok(
        "nn.dense",
        &[f32t(&[2, 3, 256]), f32t(&[128, 256])],
        &[("units", I(128))],
        f32t(&[2, 3, 128]),
    );
    ok(
        "nn.dense",
        &[f32t(&[A, 256]), f32t(&[A, A])],
        &[("units", I(64))],
        f32t(&[A, 64]),
    );
    ok(
        "nn.dense",
        &[f32t(&[4, A]), f32t(&[10, 7])],
        &[("units", AttrValue::None)],
        f32t(&[4, 10]),
    );
    bad(
        "nn.dense",
        &[f32t(&[8, 512]), f32t(&[128, 256])],
        &[],
        "nn.dense: input has 512 columns but weight expects 256",
    );
    bad(
        "nn.dense",
        &[f32t(&[8, 256]), f32t(&[128, 256])],
        &[("units", I(64))],
        "units=64 but weight has 128 rows",
    );
    let e = bad(
        "nn.dense",
        &[f32t(&[8, 4]), f32t(&[4])],
        &[],
        "weight must be 2-D",
    );
    assert_eq!(e.arg, Some(1));
    let e = bad(
        "nn.dense",
        &[t(&[8, 4], Int32), t(&[2, 4], Int32)],
        &[],
        "input must have a float dtype",
    );
    assert_eq!(e.arg, Some(0));
    bad(
        "nn.dense",
        &[f32t(&[8, 4]), t(&[2, 4], Float64)],
        &[],
        "dtype mismatch: float32 vs float64",
    );
    let e = bad(
        "nn.dense",
        &[Ty::Param("A".into()), f32t(&[2, 4])],
        &[],
        "input must be a tensor, found the type parameter `A`",
    );
    assert_eq!(e.arg, Some(0));
}

#[test]
fn batch_matmul() {
    ok(
        "nn.batch_matmul",
        &[f32t(&[4, 2, 3]), f32t(&[4, 5, 3])],
        &[],
        f32t(&[4, 2, 5]),
    );
    ok(
        "nn.batch_matmul",
        &[f32t(&[1, 2, 3]), f32t(&[4, 5, 3])],
        &[],
        f32t(&[4, 2, 5]),
    );
    ok(
        "nn.batch_matmul",
        &[f32t(&[4, 3, 2]), f32t(&[4, 3, 5])],
        &[("transpose_a", B(true)), ("transpose_b", B(false))],
        f32t(&[4, 2, 5]),
    );
    ok(
        "nn.batch_matmul",
        &[f32t(&[A, 2, A]), f32t(&[4, A, 3])],
        &[],
        f32t(&[4, 2, A]),
    );
    bad(
        "nn.batch_matmul",
        &[f32t(&[4, 2, 3]), f32t(&[4, 5, 6])],
        &[],
        "lhs has inner dimension 3 but rhs expects 6",
    );
    bad(
        "nn.batch_matmul",
        &[f32t(&[4, 2, 3]), f32t(&[2, 5, 3])],
        &[],
        "batch dimensions 4 and 2 differ",
    );
    bad(
        "nn.batch_matmul",
        &[f32t(&[2, 3]), f32t(&[2, 5, 3])],
        &[],
        "lhs must be 3-D",
    );
}

// ---------------------------------------------------------------- broadcast

#[test]
fn broadcasting_binary() {
    for op in [
        "add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
    ] {
        ok(op, &[f32t(&[3, 4]), f32t(&[4])], &[], f32t(&[3, 4]));
    }
    ok(
        "add",
        &[f32t(&[2, 1, 4]), f32t(&[3, 1])],
        &[],
        f32t(&[2, 3, 4]),
    );
    ok("add", &[f32t(&[]), f32t(&[5])], &[], f32t(&[5]));
    ok("add", &[f32t(&[A, 4]), f32t(&[3, 1])], &[], f32t(&[3, 4]));
    ok("add", &[f32t(&[A, 1]), f32t(&[1, A])], &[], f32t(&[A, A]));
    ok("add", &[f32t(&[A]), f32t(&[1])], &[], f32t(&[A]));
    ok("add", &[f32t(&[0]), f32t(&[1])], &[], f32t(&[0]));
    ok(
        "add",
        &[t(&[2], Int64), t(&[2], Int64)],
        &[],
        t(&[2], Int64),
    );
    bad(
        "add",
        &[f32t(&[3, 4]), f32t(&[5])],
        &[],
        "add: cannot broadcast Tensor[(3, 4), float32] with Tensor[(5), float32] (dimension 4 vs 5)",
    );
    bad(
        "add",
        &[f32t(&[3]), t(&[3], Int32)],
        &[],
        "add: dtype mismatch: float32 vs int32",
    );
    bad(
        "add",
        &[t(&[3], Bool), t(&[3], Bool)],
        &[],
        "lhs must have a numeric dtype, found bool",
    );
    let e = bad(
        "multiply",
        &[f32t(&[3]), Ty::Tuple(vec![])],
        &[],
        "rhs must be a tensor, found the tuple ()",
    );
    assert_eq!(e.arg, Some(1));
}

#[test]
fn comparisons_and_logic() {
    for op in [
        "equal",
        "not_equal",
        "less",
        "greater",
        "less_equal",
        "greater_equal",
    ] {
        ok(op, &[f32t(&[3, 1]), f32t(&[1, 2])], &[], t(&[3, 2], Bool));
    }
    ok("equal", &[t(&[2], Bool), t(&[], Bool)], &[], t(&[2], Bool));
    bad(
        "less",
        &[t(&[2], Bool), t(&[2], Bool)],
        &[],
        "must have a numeric dtype",
    );
    bad(
        "greater",
        &[t(&[2], Int32), t(&[2], Int64)],
        &[],
        "dtype mismatch: int32 vs int64",
    );
    ok(
        "logical_and",
        &[t(&[2, A], Bool), t(&[3], Bool)],
        &[],
        t(&[2, 3], Bool),
    );
    ok(
        "logical_or",
        &[t(&[], Bool), t(&[4], Bool)],
        &[],
        t(&[4], Bool),
    );
    let e = bad(
        "logical_or",
        &[t(&[4], Bool), f32t(&[4])],
        &[],
        "rhs must have dtype bool, found float32",
    );
    assert_eq!(e.arg, Some(1));
    ok("logical_not", &[t(&[A, 2], Bool)], &[], t(&[A, 2], Bool));
    bad(
        "logical_not",
        &[f32t(&[2])],
        &[],
        "logical_not: input must have dtype bool, found float32",
    );
}

#[test]
fn bias_add() {
    ok(
        "nn.bias_add",
        &[f32t(&[8, 16]), f32t(&[16])],
        &[],
        f32t(&[8, 16]),
    );
    ok(
        "nn.bias_add",
        &[f32t(&[2, 3, 4]), f32t(&[4])],
        &[("axis", I(-1))],
        f32t(&[2, 3, 4]),
    );
    ok(
        "nn.bias_add",
        &[f32t(&[2, A]), f32t(&[7])],
        &[],
        f32t(&[2, A]),
    );
    bad(
        "nn.bias_add",
        &[f32t(&[8, 16]), f32t(&[15])],
        &[],
        "bias has length 15 but input has 16 along axis 1",
    );
    bad(
        "nn.bias_add",
        &[f32t(&[8, 16]), f32t(&[16])],
        &[("axis", I(2))],
        "axis 2 is out of range for a tensor of rank 2",
    );
    bad(
        "nn.bias_add",
        &[f32t(&[8, 16]), f32t(&[1, 16])],
        &[],
        "bias must be 1-D",
    );
}

#[test]
fn where_() {
    ok(
        "where",
        &[t(&[3, 1], Bool), f32t(&[4]), f32t(&[])],
        &[],
        f32t(&[3, 4]),
    );
    ok(
        "where",
        &[t(&[], Bool), t(&[A], Int32), t(&[5], Int32)],
        &[],
        t(&[5], Int32),
    );
    let e = bad(
        "where",
        &[f32t(&[3]), f32t(&[3]), f32t(&[3])],
        &[],
        "condition must have dtype bool, found float32",
    );
    assert_eq!(e.arg, Some(0));
    bad(
        "where",
        &[t(&[3], Bool), f32t(&[3]), t(&[3], Int32)],
        &[],
        "dtype mismatch: float32 vs int32",
    );
    bad(
        "where",
        &[t(&[2], Bool), f32t(&[3]), f32t(&[3])],
        &[],
        "cannot broadcast condition Tensor[(2), bool]",
    );
}

#[test]
fn clip() {
    ok(
        "clip",
        &[f32t(&[2, A])],
        &[("a_min", F(-1.0)), ("a_max", I(1))],
        f32t(&[2, A]),
    );
    bad(
        "clip",
        &[f32t(&[2])],
        &[("a_min", F(1.0)), ("a_max", F(0.0))],
        "a_min (1.0) must not exceed a_max (0.0)",
    );
    bad(
        "clip",
        &[f32t(&[2])],
        &[("a_min", F(1.0))],
        "missing required attribute `a_max`",
    );
    bad(
        "clip",
        &[f32t(&[2])],
        &[("a_min", S("x".into())), ("a_max", F(0.0))],
        "clip: attribute `a_min` must be a number, found a string",
    );
}

// ---------------------------------------------------------------- unary

#[test]
fn unary() {
    for op in [
        "negative", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "nn.relu", "copy",
    ] {
        ok(op, &[f32t(&[A, 3])], &[], f32t(&[A, 3]));
        ok(op, &[t(&[2], Float64)], &[], t(&[2], Float64));
    }
    for op in ["negative", "abs", "nn.relu", "copy"] {
        ok(op, &[t(&[2], Int32)], &[], t(&[2], Int32));
    }
    ok("copy", &[t(&[2], Bool)], &[], t(&[2], Bool));
    for op in ["sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt"] {
        let e = bad(
            op,
            &[t(&[2], Int32)],
            &[],
            "input must have a float dtype (float32 or float64), found int32",
        );
        assert_eq!(e.arg, Some(0));
    }
    bad(
        "negative",
        &[t(&[2], Bool)],
        &[],
        "input must have a numeric dtype, found bool",
    );
    bad(
        "sigmoid",
        &[Ty::Adt("List".into(), vec![f32t(&[2])])],
        &[],
        "sigmoid: input must be a tensor, found List[Tensor[(2), float32]]",
    );
}

// ---------------------------------------------------------------- reductions

#[test]
fn softmax() {
    for op in ["nn.softmax", "nn.log_softmax"] {
        ok(op, &[f32t(&[2, A])], &[], f32t(&[2, A]));
        ok(op, &[f32t(&[2, 5])], &[("axis", I(0))], f32t(&[2, 5]));
        bad(
            op,
            &[f32t(&[2, 5])],
            &[("axis", I(2))],
            "axis 2 is out of range for a tensor of rank 2",
        );
        bad(
            op,
            &[f32t(&[2, 5])],
            &[("axis", I(-3))],
            "axis -3 is out of range for a tensor of rank 2",
        );
        bad(op, &[t(&[2], Int32)], &[], "float dtype");
    }
    bad(
        "nn.softmax",
        &[f32t(&[2, 5])],
        &[("axis", I(2))],
        "nn.softmax: axis 2 is out of range for a tensor of rank 2",
    );
}

#[test]
fn layer_norm() {
    ok(
        "nn.layer_norm",
        &[f32t(&[4, 8]), f32t(&[8]), f32t(&[8])],
        &[],
        f32t(&[4, 8]),
    );
    ok(
        "nn.layer_norm",
        &[f32t(&[4, A]), f32t(&[4]), f32t(&[A])],
        &[
            ("axis", I(0)),
            ("epsilon", F(1e-12)),
            ("center", B(false)),
            ("scale", I(0)),
        ],
        f32t(&[4, A]),
    );
    bad(
        "nn.layer_norm",
        &[f32t(&[4, 8]), f32t(&[8]), f32t(&[7])],
        &[],
        "beta has length 7 but input has 8 along axis 1",
    );
    let e = bad(
        "nn.layer_norm",
        &[f32t(&[4, 8]), f32t(&[1, 8]), f32t(&[8])],
        &[],
        "gamma must be 1-D",
    );
    assert_eq!(e.arg, Some(1));
    bad(
        "nn.layer_norm",
        &[f32t(&[4, 8]), f32t(&[8]), f32t(&[8])],
        &[("axis", I(5))],
        "axis 5 is out of range",
    );
}

#[test]
fn reductions() {
    let x = f32t(&[2, 3, 4]);
    for op in ["sum", "mean", "max", "min"] {
        ok(op, &[x.clone()], &[], f32t(&[]));
        ok(op, &[x.clone()], &[("axis", I(1))], f32t(&[2, 4]));
        ok(op, &[x.clone()], &[("axis", ints(&[0, -1]))], f32t(&[3]));
        ok(
            op,
            &[x.clone()],
            &[("axis", ints(&[1])), ("keepdims", B(true))],
            f32t(&[2, 1, 4]),
        );
        ok(
            op,
            &[x.clone()],
            &[("axis", ints(&[1])), ("exclude", B(true))],
            f32t(&[3]),
        );
        ok(op, &[x.clone()], &[("keepdims", I(1))], f32t(&[1, 1, 1]));
        bad(
            op,
            &[x.clone()],
            &[("axis", I(3))],
            "axis 3 is out of range for a tensor of rank 3",
        );
        bad(
            op,
            &[x.clone()],
            &[("axis", ints(&[0, -3]))],
            "axis -3 is listed twice in [0, -3] (as axis 0)",
        );
    }
    ok(
        "sum",
        &[t(&[A, 5], Int64)],
        &[("axis", I(-1))],
        t(&[A], Int64),
    );
    ok("sum", &[f32t(&[2, 3])], &[("axis", ints(&[]))], f32t(&[]));
    bad("mean", &[t(&[2], Bool)], &[], "numeric dtype");
    bad(
        "sum",
        &[f32t(&[2])],
        &[("axis", F(1.0))],
        "sum: attribute `axis` must be a list of integers, found a float",
    );
}

#[test]
fn argmax_argmin() {
    for op in ["argmax", "argmin"] {
        ok(op, &[f32t(&[A, 10])], &[("axis", I(1))], t(&[A], Int32));
        ok(op, &[f32t(&[3, 10])], &[], t(&[], Int32));
        ok(
            op,
            &[f32t(&[3, 10])],
            &[
                ("axis", ints(&[-1])),
                ("keepdims", B(true)),
                ("select_last_index", B(true)),
            ],
            t(&[3, 1], Int32),
        );
        ok(
            op,
            &[t(&[3, 10], Int64)],
            &[("axis", I(0)), ("exclude", B(true))],
            t(&[3], Int32),
        );
        bad(
            op,
            &[f32t(&[3])],
            &[("axis", I(1))],
            "axis 1 is out of range for a tensor of rank 1",
        );
    }
}

// ---------------------------------------------------------------- layout

fn tuple(ts: &[Ty]) -> Ty {
    Ty::Tuple(ts.to_vec())
}

#[test]
fn concatenate() {
    ok(
        "concatenate",
        &[tuple(&[f32t(&[2, 3]), f32t(&[4, 3])])],
        &[],
        f32t(&[6, 3]),
    );
    ok(
        "concatenate",
        &[tuple(&[f32t(&[2, 3]), f32t(&[2, 5])])],
        &[("axis", I(-1))],
        f32t(&[2, 8]),
    );
    ok(
        "concatenate",
        &[tuple(&[f32t(&[2, A]), f32t(&[A, 3])])],
        &[],
        f32t(&[A, 3]),
    );
    ok(
        "concatenate",
        &[tuple(&[f32t(&[A, 3])])],
        &[("axis", I(1))],
        f32t(&[A, 3]),
    );
    let e = bad(
        "concatenate",
        &[tuple(&[f32t(&[2, 3]), f32t(&[2, 3, 1])])],
        &[],
        "all fields must have the same rank: field 0 is Tensor[(2, 3), float32] (rank 2) but field 1 is Tensor[(2, 3, 1), float32] (rank 3)",
    );
    assert_eq!(e.arg, Some(0));
    bad("concatenate", &[tuple(&[f32t(&[2, 3]), f32t(&[2, 4])])], &[], "field 1 is Tensor[(2, 4), float32] but earlier fields have 3 along axis 1 (only axis 0 may differ)");
    bad(
        "concatenate",
        &[tuple(&[f32t(&[2]), t(&[2], Int32)])],
        &[],
        "dtype mismatch: field 0 is float32 but field 1 is int32",
    );
    bad(
        "concatenate",
        &[f32t(&[2, 3])],
        &[],
        "input must be a tuple of tensors, found Tensor[(2, 3), float32]",
    );
    bad("concatenate", &[tuple(&[])], &[], "non-empty tuple");
    bad(
        "concatenate",
        &[tuple(&[f32t(&[2]), Ty::Param("T".into())])],
        &[],
        "field 1 of the input tuple must be a tensor",
    );
    bad(
        "concatenate",
        &[tuple(&[f32t(&[2])])],
        &[("axis", I(1))],
        "axis 1 is out of range for a tensor of rank 1",
    );
}

#[test]
fn split() {
    let x = f32t(&[6, 4]);
    ok(
        "split",
        &[x.clone()],
        &[("indices_or_sections", I(3))],
        tuple(&[f32t(&[2, 4]), f32t(&[2, 4]), f32t(&[2, 4])]),
    );
    ok(
        "split",
        &[x.clone()],
        &[("indices_or_sections", ints(&[1, 4])), ("axis", I(0))],
        tuple(&[f32t(&[1, 4]), f32t(&[3, 4]), f32t(&[2, 4])]),
    );
    ok(
        "split",
        &[x.clone()],
        &[("indices_or_sections", ints(&[1])), ("axis", I(-1))],
        tuple(&[f32t(&[6, 1]), f32t(&[6, 3])]),
    );
    ok(
        "split",
        &[f32t(&[A, 4])],
        &[("indices_or_sections", I(2))],
        tuple(&[f32t(&[A, 4]), f32t(&[A, 4])]),
    );
    ok(
        "split",
        &[f32t(&[A])],
        &[("indices_or_sections", ints(&[2, 5]))],
        tuple(&[f32t(&[2]), f32t(&[3]), f32t(&[A])]),
    );
    bad(
        "split",
        &[x.clone()],
        &[("indices_or_sections", I(4))],
        "split: cannot split dimension 6 (axis 0) into 4 equal sections",
    );
    bad(
        "split",
        &[x.clone()],
        &[("indices_or_sections", ints(&[3, 2]))],
        "strictly ascending",
    );
    bad(
        "split",
        &[x.clone()],
        &[("indices_or_sections", ints(&[2, 6]))],
        "split index 6 is out of range for dimension 6 (axis 0)",
    );
    bad(
        "split",
        &[x.clone()],
        &[("indices_or_sections", I(0))],
        "positive number of sections",
    );
    bad(
        "split",
        &[x.clone()],
        &[],
        "missing required attribute `indices_or_sections`",
    );
    bad(
        "split",
        &[x],
        &[("indices_or_sections", I(2)), ("axis", I(2))],
        "axis 2 is out of range",
    );
}

#[test]
fn reshape() {
    let x = f32t(&[2, 3, 4]);
    let rs = |ns: &[i64]| vec![("newshape", ints(ns))];
    ok("reshape", &[x.clone()], &rs(&[6, 4]), f32t(&[6, 4]));
    ok("reshape", &[x.clone()], &rs(&[-1]), f32t(&[24]));
    ok("reshape", &[x.clone()], &rs(&[0, -1]), f32t(&[2, 12]));
    ok("reshape", &[x.clone()], &rs(&[4, 0, -1]), f32t(&[4, 3, 2]));
    ok("reshape", &[x.clone()], &rs(&[2, -2]), f32t(&[2, 3, 4]));
    ok("reshape", &[x.clone()], &rs(&[-2]), f32t(&[2, 3, 4]));
    ok("reshape", &[x.clone()], &rs(&[-3, 4]), f32t(&[6, 4]));
    ok(
        "reshape",
        &[x.clone()],
        &rs(&[-4, 1, 2, -3]),
        f32t(&[1, 2, 12]),
    );
    ok(
        "reshape",
        &[x.clone()],
        &rs(&[-4, -1, 2, 0, 0]),
        f32t(&[1, 2, 3, 4]),
    );
    ok("reshape", &[f32t(&[])], &rs(&[1, 1]), f32t(&[1, 1]));
    ok("reshape", &[f32t(&[1, 1])], &rs(&[]), f32t(&[]));
    ok("reshape", &[f32t(&[5])], &[("newshape", I(5))], f32t(&[5]));
    // `?` dims: copy what can be copied, infer Any otherwise.
    ok(
        "reshape",
        &[f32t(&[A, 4])],
        &rs(&[0, 2, 2]),
        f32t(&[A, 2, 2]),
    );
    ok("reshape", &[f32t(&[A, 4])], &rs(&[-1, 2]), f32t(&[A, 2]));
    ok("reshape", &[f32t(&[A, 4])], &rs(&[-3]), f32t(&[A]));
    ok("reshape", &[f32t(&[A, 4])], &rs(&[8]), f32t(&[8]));
    ok(
        "reshape",
        &[f32t(&[0, 3, 4])],
        &[("newshape", ints(&[0, 0, 4])), ("allowzero", B(true))],
        f32t(&[0, 0, 4]),
    );
    ok(
        "reshape",
        &[f32t(&[0, 3, 4])],
        &rs(&[0, 0, 4]),
        f32t(&[0, 3, 4]),
    );
    ok(
        "reshape",
        &[f32t(&[A, 3, 4])],
        &rs(&[0, -1]),
        f32t(&[A, 12]),
    );
    ok(
        "reshape",
        &[f32t(&[A, 3, 4, A])],
        &rs(&[0, -3, -2]),
        f32t(&[A, 12, A]),
    );
    ok(
        "reshape",
        &[f32t(&[2, A, 6])],
        &rs(&[-1, 0, 3]),
        f32t(&[4, A, 3]),
    );

    // A `?` may be 0 at run time, so known parts that disagree are not an error by themselves.
    ok("reshape", &[f32t(&[A, 3, 4])], &rs(&[0, 5]), f32t(&[A, 5]));
    bad(
        "reshape",
        &[f32t(&[A, 3, 4])],
        &rs(&[0, 5, -1]),
        "12 is not a multiple of 5",
    );
    bad(
        "reshape",
        &[f32t(&[0, 3])],
        &rs(&[0, -1]),
        "cannot infer the -1",
    );
    bad(
        "reshape",
        &[x.clone()],
        &rs(&[5, 5]),
        "reshape: cannot reshape Tensor[(2, 3, 4), float32] (24 elements) to (5, 5) (25 elements)",
    );
    bad(
        "reshape",
        &[x.clone()],
        &rs(&[5, -1]),
        "24 is not a multiple of 5",
    );
    bad("reshape", &[x.clone()], &rs(&[-1, -1]), "more than one -1");
    bad("reshape", &[x.clone()], &rs(&[0, 0, 0, 0]), "0 in newshape [0, 0, 0, 0] refers to input dimension 3, but the input Tensor[(2, 3, 4), float32] has rank 3");
    bad("reshape", &[x.clone()], &rs(&[-5]), "contains -5");
    bad(
        "reshape",
        &[x.clone()],
        &rs(&[-4, 3, -1, 12]),
        "cannot split dimension 2 by 3",
    );
    bad(
        "reshape",
        &[f32t(&[A, 4])],
        &rs(&[6]),
        "6 is not a multiple of 4",
    );
    bad(
        "reshape",
        &[x],
        &[],
        "missing required attribute `newshape`",
    );
}

#[test]
fn transpose() {
    let x = f32t(&[2, 3, A]);
    ok("transpose", &[x.clone()], &[], f32t(&[A, 3, 2]));
    ok(
        "transpose",
        &[x.clone()],
        &[("axes", ints(&[1, -1, 0]))],
        f32t(&[3, A, 2]),
    );
    ok("transpose", &[f32t(&[])], &[], f32t(&[]));
    bad("transpose", &[x.clone()], &[("axes", ints(&[0, 0, 1]))], "transpose: axes [0, 0, 1] is not a permutation of the 3 axes of Tensor[(2, 3, ?), float32]");
    bad(
        "transpose",
        &[x.clone()],
        &[("axes", ints(&[1, 0]))],
        "is not a permutation",
    );
    bad(
        "transpose",
        &[x],
        &[("axes", ints(&[0, 1, 3]))],
        "is not a permutation",
    );
}

#[test]
fn expand_dims_and_squeeze() {
    let x = f32t(&[2, 3]);
    ok(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(0))],
        f32t(&[1, 2, 3]),
    );
    ok(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(2))],
        f32t(&[2, 3, 1]),
    );
    ok(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(-1))],
        f32t(&[2, 3, 1]),
    );
    ok(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(-3)), ("num_newaxis", I(2))],
        f32t(&[1, 1, 2, 3]),
    );
    ok(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(1)), ("num_newaxis", I(0))],
        f32t(&[2, 3]),
    );
    bad(
        "expand_dims",
        &[x.clone()],
        &[("axis", I(3))],
        "axis 3 is out of range for inserting into a tensor of rank 2 (allowed: -3..=2)",
    );
    bad(
        "expand_dims",
        &[x.clone()],
        &[],
        "missing required attribute `axis`",
    );
    bad(
        "expand_dims",
        &[x],
        &[("axis", I(0)), ("num_newaxis", I(-1))],
        "num_newaxis must be between 0 and 65536",
    );

    let y = f32t(&[1, 3, 1, A]);
    // Without `axis`, a `?` size decides the rank: refused (the runtime removes it when it is 1).
    bad(
        "squeeze",
        &[y.clone()],
        &[],
        "squeeze: squeeze without `axis` of Tensor[(1, 3, 1, ?), float32]: whether its `?` axes \
         are removed depends on their sizes when the program runs; give the axes to remove, e.g. \
         `axis=[0, 2]`",
    );
    ok("squeeze", &[f32t(&[1, 3, 1, 4])], &[], f32t(&[3, 4]));
    ok(
        "squeeze",
        &[y.clone()],
        &[("axis", ints(&[0]))],
        f32t(&[3, 1, A]),
    );
    ok(
        "squeeze",
        &[y.clone()],
        &[("axis", ints(&[-1, 2]))],
        f32t(&[1, 3]),
    );
    bad(
        "squeeze",
        &[y.clone()],
        &[("axis", ints(&[1]))],
        "squeeze: cannot squeeze axis 1 of Tensor[(1, 3, 1, ?), float32]: its size is 3, not 1",
    );
    bad(
        "squeeze",
        &[y.clone()],
        &[("axis", ints(&[4]))],
        "axis 4 is out of range for a tensor of rank 4",
    );
    bad("squeeze", &[y], &[("axis", ints(&[0, 0]))], "listed twice");
}

#[test]
fn take() {
    let emb = f32t(&[100, 16]);
    ok(
        "take",
        &[emb.clone(), t(&[], Int32)],
        &[("axis", I(0))],
        f32t(&[16]),
    );
    ok(
        "take",
        &[emb.clone(), t(&[5, A], Int64)],
        &[("axis", I(0))],
        f32t(&[5, A, 16]),
    );
    ok(
        "take",
        &[emb.clone(), t(&[7], Int32)],
        &[("axis", I(-1)), ("mode", S("wrap".into()))],
        f32t(&[100, 7]),
    );
    ok(
        "take",
        &[emb.clone(), t(&[2, 3], Int32)],
        &[],
        f32t(&[2, 3]),
    );
    ok(
        "take",
        &[f32t(&[4, 10, 5]), t(&[4, 3], Int32)],
        &[("axis", I(1)), ("batch_dims", I(1))],
        f32t(&[4, 3, 5]),
    );
    let e = bad(
        "take",
        &[emb.clone(), f32t(&[3])],
        &[("axis", I(0))],
        "take: indices must have dtype int32 or int64, found float32",
    );
    assert_eq!(e.arg, Some(1));
    bad(
        "take",
        &[emb.clone(), t(&[3], Int32)],
        &[("axis", I(2))],
        "axis 2 is out of range for a tensor of rank 2",
    );
    bad(
        "take",
        &[emb.clone(), t(&[3], Int32)],
        &[("mode", S("raise".into()))],
        "mode must be \"clip\", \"wrap\" or \"fast\", found \"raise\"",
    );
    bad(
        "take",
        &[f32t(&[4, 10]), t(&[3, 2], Int32)],
        &[("axis", I(1)), ("batch_dims", I(1))],
        "batch dimension 0 differs: input has 4 but indices have 3",
    );
    bad(
        "take",
        &[f32t(&[4, 10]), t(&[4, 2], Int32)],
        &[("axis", I(0)), ("batch_dims", I(1))],
        "batch_dims (1) must not exceed axis (0)",
    );
}

#[test]
fn strided_slice() {
    let x = f32t(&[10, 8, A]);
    let ss = |b: &[i64], e: &[i64], s: Option<&[i64]>| {
        let mut v = vec![("begin", ints(b)), ("end", ints(e))];
        if let Some(s) = s {
            v.push(("strides", ints(s)));
        }
        v
    };
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[2], &[5], None),
        f32t(&[3, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[0, 1], &[10, 8], Some(&[3, 2])),
        f32t(&[4, 4, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[-3], &[100], None),
        f32t(&[3, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[-100], &[-2], None),
        f32t(&[8, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[9], &[-11], Some(&[-1])),
        f32t(&[10, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[8], &[2], Some(&[-3])),
        f32t(&[2, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[5], &[2], None),
        f32t(&[0, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[0, 0, 0], &[1, 1, 1], None),
        f32t(&[1, 1, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[0], &[i64::MAX], Some(&[i64::MAX])),
        f32t(&[1, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &ss(&[i64::MIN], &[i64::MAX], Some(&[i64::MIN])),
        f32t(&[0, 8, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &[
            ("begin", ints(&[1])),
            ("end", ints(&[3])),
            ("axes", ints(&[1])),
        ],
        f32t(&[10, 2, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &[
            ("begin", ints(&[2, 1])),
            ("end", ints(&[3, -1])),
            ("slice_mode", S("size".into())),
        ],
        f32t(&[3, 7, A]),
    );
    ok(
        "strided_slice",
        &[x.clone()],
        &[
            ("begin", ints(&[-2])),
            ("end", ints(&[2])),
            ("slice_mode", S("size".into())),
        ],
        f32t(&[2, 8, A]),
    );
    bad(
        "strided_slice",
        &[x.clone()],
        &ss(&[0], &[1], Some(&[0])),
        "stride along axis 0 is 0",
    );
    bad(
        "strided_slice",
        &[x.clone()],
        &ss(&[0, 0, 0, 0], &[1], None),
        "have more entries than the 3 axes",
    );
    bad(
        "strided_slice",
        &[x.clone()],
        &[
            ("begin", ints(&[0])),
            ("end", ints(&[1])),
            ("slice_mode", S("stride".into())),
        ],
        "slice_mode must be \"end\" or \"size\"",
    );
    bad(
        "strided_slice",
        &[x.clone()],
        &[
            ("begin", ints(&[0])),
            ("end", ints(&[1])),
            ("axes", ints(&[3])),
        ],
        "axis 3 is out of range",
    );
    bad(
        "strided_slice",
        &[x],
        &[
            ("begin", ints(&[0, 1])),
            ("end", ints(&[1, 2])),
            ("axes", ints(&[1])),
        ],
        "one entry per axis",
    );
}

// ---------------------------------------------------------------- creation, intrinsics

#[test]
fn creation() {
    ok(
        "cast",
        &[f32t(&[A, 2])],
        &[("dtype", S("int64".into()))],
        t(&[A, 2], Int64),
    );
    bad(
        "cast",
        &[f32t(&[2])],
        &[("dtype", S("float16".into()))],
        "attribute `dtype` must name a dtype",
    );
    bad(
        "cast",
        &[f32t(&[2])],
        &[],
        "missing required attribute `dtype`",
    );
    ok("zeros", &[], &[("shape", ints(&[2, 3]))], f32t(&[2, 3]));
    ok(
        "ones",
        &[],
        &[("shape", ints(&[])), ("dtype", S("int32".into()))],
        t(&[], Int32),
    );
    bad(
        "zeros",
        &[],
        &[("shape", ints(&[2, -3]))],
        "zeros: shape [2, -3] contains the negative size -3",
    );
    bad(
        "ones",
        &[f32t(&[])],
        &[("shape", ints(&[2]))],
        "ones: expected 0 arguments, found 1",
    );
    ok(
        "full",
        &[t(&[], Int64)],
        &[("shape", ints(&[4]))],
        t(&[4], Int64),
    );
    ok(
        "full",
        &[t(&[], Int64)],
        &[("shape", ints(&[4])), ("dtype", S("float32".into()))],
        f32t(&[4]),
    );
    let e = bad(
        "full",
        &[f32t(&[1])],
        &[("shape", ints(&[4]))],
        "fill_value must be a scalar tensor, found Tensor[(1), float32]",
    );
    assert_eq!(e.arg, Some(0));
    ok("zeros_like", &[t(&[A, 3], Int32)], &[], t(&[A, 3], Int32));
    ok("ones_like", &[f32t(&[3])], &[], f32t(&[3]));
    bad(
        "ones_like",
        &[tuple(&[])],
        &[],
        "ones_like: input must be a tensor",
    );
}

#[test]
fn intrinsics() {
    ok("db.phase_change", &[], &[], Ty::unit());
    bad(
        "db.phase_change",
        &[f32t(&[])],
        &[],
        "db.phase_change: expected 0 arguments, found 1",
    );
    let kv = |dt: Option<&str>| {
        let mut v = vec![("low", I(0)), ("high", F(10.0)), ("out_shape", ints(&[1]))];
        if let Some(d) = dt {
            v.push(("out_dtype", S(d.into())));
        }
        v
    };
    ok("random.db_uniform", &[], &kv(None), t(&[1], Int32));
    ok("random.db_uniform", &[], &kv(Some("float32")), f32t(&[1]));
    bad(
        "random.db_uniform",
        &[],
        &kv(Some("bool")),
        "out_dtype must be numeric",
    );
    bad(
        "random.db_uniform",
        &[],
        &[("low", I(0)), ("high", I(1))],
        "missing required attribute `out_shape`",
    );
    bad(
        "random.db_uniform",
        &[],
        &[("low", I(5)), ("high", I(1)), ("out_shape", ints(&[]))],
        "low (5.0) must be a finite number not above high (1.0)",
    );
    // ACROBAT's form: the bounds are scalar tensors (values known at run time).
    let shape_only = |dt: &str| vec![("out_shape", ints(&[])), ("out_dtype", S(dt.into()))];
    let i32s = t(&[], Int32);
    ok(
        "random.db_uniform",
        &[i32s.clone(), i32s.clone()],
        &shape_only("int32"),
        t(&[], Int32),
    );
    ok(
        "random.db_uniform",
        &[f32t(&[]), i32s.clone()],
        &[
            ("out_shape", ints(&[3])),
            ("out_dtype", S("float32".into())),
        ],
        f32t(&[3]),
    );
    bad(
        "random.db_uniform",
        &[i32s.clone(), t(&[1], Int32)],
        &shape_only("int32"),
        "random.db_uniform: high must be a scalar tensor, found Tensor[(1), int32]",
    );
    bad(
        "random.db_uniform",
        &[t(&[], Bool), i32s.clone()],
        &shape_only("int32"),
        "random.db_uniform: low must have a numeric dtype, found bool",
    );
    bad(
        "random.db_uniform",
        &[i32s.clone(), i32s.clone()],
        &[("low", I(0)), ("out_shape", ints(&[]))],
        "remove the attribute `low`",
    );
    bad(
        "random.db_uniform",
        &[i32s],
        &shape_only("int32"),
        "random.db_uniform: expected 2 arguments (low, high), or 0 with `low=`/`high=` attributes, found 1",
    );
}

#[test]
fn fusion_classes() {
    use tumble_ops::FusionClass::*;
    let class = |n: &str| lookup(n).map(|o| o.class);
    assert_eq!(class("nn.dense"), Some(Gemm));
    assert_eq!(class("nn.batch_matmul"), Some(Gemm));
    assert_eq!(class("sigmoid"), Some(Elementwise));
    assert_eq!(class("add"), Some(Broadcast));
    assert_eq!(class("nn.bias_add"), Some(Broadcast));
    assert_eq!(class("sum"), Some(Reduction));
    assert_eq!(class("nn.layer_norm"), Some(Reduction));
    assert_eq!(class("take"), Some(Layout));
    assert_eq!(class("db.phase_change"), Some(Opaque));
    assert_eq!(class("random.db_uniform"), Some(Opaque));
}

// ---------------------------------------------------------------- scans, index maps, arange

#[test]
fn scans() {
    for op in ["cumsum", "cumprod"] {
        ok(op, &[f32t(&[2, A, 4])], &[("axis", I(1))], f32t(&[2, A, 4]));
        ok(op, &[f32t(&[2, 3])], &[], f32t(&[6]));
        ok(op, &[f32t(&[2, A])], &[], f32t(&[A]));
        ok(
            op,
            &[t(&[3], Int32)],
            &[("dtype", S("int64".into())), ("exclusive", B(true))],
            t(&[3], Int64),
        );
        ok(
            op,
            &[t(&[3], Bool)],
            &[
                ("dtype", S("float32".into())),
                ("exclusive", AttrValue::None),
            ],
            f32t(&[3]),
        );
        bad(op, &[t(&[3], Bool)], &[], "must be numeric, found bool");
        bad(
            op,
            &[f32t(&[3])],
            &[("axis", I(1))],
            "axis 1 is out of range",
        );
        bad(
            op,
            &[t(&[i64::MAX, 4], Int32)],
            &[],
            "the flattened size of Tensor",
        );
    }
}

#[test]
fn index_maps() {
    ok(
        "reverse",
        &[f32t(&[2, A])],
        &[("axis", I(-1))],
        f32t(&[2, A]),
    );
    bad("reverse", &[f32t(&[2])], &[("axis", I(1))], "out of range");
    bad(
        "reverse",
        &[f32t(&[2])],
        &[],
        "missing required attribute `axis`",
    );

    ok(
        "tile",
        &[f32t(&[2, A])],
        &[("reps", ints(&[3, 2]))],
        f32t(&[6, A]),
    );
    ok(
        "tile",
        &[f32t(&[2])],
        &[("reps", ints(&[3, 2]))],
        f32t(&[3, 4]),
    );
    ok(
        "tile",
        &[f32t(&[2, 3])],
        &[("reps", ints(&[2]))],
        f32t(&[2, 6]),
    );
    ok(
        "tile",
        &[f32t(&[2, 3])],
        &[("reps", ints(&[]))],
        f32t(&[2, 3]),
    );
    bad(
        "tile",
        &[f32t(&[2])],
        &[("reps", ints(&[-1]))],
        "must be positive",
    );
    bad(
        "tile",
        &[f32t(&[i64::MAX])],
        &[("reps", ints(&[2]))],
        "overflows",
    );

    ok(
        "repeat",
        &[t(&[2, 3], Int32)],
        &[("repeats", I(2)), ("axis", I(-1))],
        t(&[2, 6], Int32),
    );
    ok(
        "repeat",
        &[f32t(&[A, 3])],
        &[("repeats", I(2)), ("axis", I(0))],
        f32t(&[A, 3]),
    );
    bad(
        "repeat",
        &[f32t(&[2])],
        &[("repeats", I(0)), ("axis", I(0))],
        "at least 1",
    );
    bad(
        "repeat",
        &[f32t(&[2])],
        &[("repeats", I(2))],
        "missing required attribute `axis`",
    );

    ok("nn.batch_flatten", &[f32t(&[A, 3, 4])], &[], f32t(&[A, 12]));
    ok("nn.batch_flatten", &[f32t(&[2, A, 4])], &[], f32t(&[2, A]));
    ok(
        "nn.batch_flatten",
        &[t(&[5], Int64)],
        &[],
        t(&[5, 1], Int64),
    );
    let e = bad("nn.batch_flatten", &[f32t(&[])], &[], "rank 1 or more");
    assert_eq!(e.arg, Some(0));

    ok(
        "gather",
        &[f32t(&[3, 4]), t(&[2, 7], Int32)],
        &[("axis", I(1))],
        f32t(&[2, 7]),
    );
    ok(
        "gather",
        &[f32t(&[A, 4]), t(&[A, A], Int64)],
        &[("axis", I(0))],
        f32t(&[A, A]),
    );
    bad(
        "gather",
        &[f32t(&[3, 4]), t(&[3], Int32)],
        &[("axis", I(0))],
        "must have the input's rank",
    );
    bad(
        "gather",
        &[f32t(&[3, 4]), t(&[4, 2], Int32)],
        &[("axis", I(1))],
        "longer than the input",
    );
    let e = bad(
        "gather",
        &[f32t(&[3, 4]), f32t(&[3, 4])],
        &[("axis", I(1))],
        "int32 or int64",
    );
    assert_eq!(e.arg, Some(1));

    ok(
        "gather_nd",
        &[f32t(&[3, 4, 5]), t(&[2, 6], Int32)],
        &[],
        f32t(&[6, 5]),
    );
    ok(
        "gather_nd",
        &[f32t(&[3, 4, 5]), t(&[1, A, 2], Int32)],
        &[],
        f32t(&[A, 2, 4, 5]),
    );
    ok(
        "gather_nd",
        &[f32t(&[3, 4, 5]), t(&[2, 3], Int64)],
        &[("batch_dims", I(1))],
        f32t(&[3]),
    );
    ok(
        "gather_nd",
        &[f32t(&[3, 4]), t(&[A, 7], Int32)],
        &[("index_rank", I(2))],
        f32t(&[7]),
    );
    bad(
        "gather_nd",
        &[f32t(&[3, 4]), t(&[A, 7], Int32)],
        &[],
        "must be known",
    );
    bad(
        "gather_nd",
        &[f32t(&[3, 4]), t(&[3, 7], Int32)],
        &[],
        "do not fit",
    );
    bad(
        "gather_nd",
        &[f32t(&[3, 4, 5]), t(&[1, 2], Int64)],
        &[("batch_dims", I(1))],
        "batch dimension 0 differs",
    );
    bad(
        "gather_nd",
        &[f32t(&[3, 4]), t(&[2, 7], Int32)],
        &[("index_rank", I(1))],
        "index_rank 1 differs",
    );
}

#[test]
fn arange_length_is_dynamic() {
    let s = |d: DType| t(&[], d);
    ok(
        "arange",
        &[s(Float32), s(Float32), s(Float32)],
        &[],
        f32t(&[A]),
    );
    ok(
        "arange",
        &[s(Int32), s(Int64), s(Float64)],
        &[("dtype", S("int64".into()))],
        t(&[A], Int64),
    );
    let e = bad(
        "arange",
        &[s(Float32), f32t(&[2]), s(Float32)],
        &[],
        "stop must be a scalar tensor",
    );
    assert_eq!(e.arg, Some(1));
    bad(
        "arange",
        &[s(Float32), s(Bool), s(Float32)],
        &[],
        "numeric dtype",
    );
    bad(
        "arange",
        &[s(Float32), s(Float32), s(Float32)],
        &[("dtype", S("bool".into()))],
        "dtype must be numeric",
    );
}

/// Only `arange` is sized by its operands' values: every other relation gives concrete
/// results for concrete arguments, which the batched runtime relies on to size blocks.
#[test]
fn only_arange_is_sized_by_values() {
    let sized: Vec<&str> = tumble_ops::all()
        .iter()
        .filter(|o| o.sized_by_values)
        .map(|o| o.name)
        .collect();
    assert_eq!(sized, ["arange"]);
}

// ---------------------------------------------------------------- TVM graph operators

#[test]
fn graph_operators() {
    let pair = |ty: Ty| tuple(&[ty.clone(), ty]);
    ok(
        "nn.dropout",
        &[f32t(&[2, A])],
        &[("rate", F(0.1))],
        pair(f32t(&[2, A])),
    );
    bad(
        "nn.dropout",
        &[t(&[2], Int32)],
        &[],
        "must have a float dtype",
    );
    bad(
        "nn.dropout",
        &[f32t(&[2])],
        &[("rate", F(-0.5))],
        "rate must be in [0, 1)",
    );

    ok(
        "nn.matmul",
        &[f32t(&[2, A, 3]), f32t(&[3, 5])],
        &[],
        f32t(&[2, A, 5]),
    );
    ok(
        "nn.matmul",
        &[f32t(&[3, 4]), f32t(&[5, 3])],
        &[("transpose_a", B(true)), ("transpose_b", B(true))],
        f32t(&[4, 5]),
    );
    ok(
        "nn.matmul",
        &[f32t(&[2, 3, 4]), f32t(&[3, 5])],
        &[("transpose_a", B(true))],
        f32t(&[2, 4, 5]),
    );
    bad(
        "nn.matmul",
        &[f32t(&[3]), f32t(&[3, 5])],
        &[("transpose_a", B(true))],
        "lhs must have rank at least 2 (…, K, M) with transpose_a=True",
    );
    bad(
        "nn.matmul",
        &[f32t(&[2, 3]), f32t(&[4, 5])],
        &[],
        "inner dimension 3 but rhs expects 4",
    );
    bad(
        "nn.matmul",
        &[f32t(&[2, 3]), f32t(&[3, 5])],
        &[("units", I(4))],
        "units=4 but rhs has 5",
    );

    ok(
        "full_like",
        &[t(&[A, 3], Int64), f32t(&[])],
        &[],
        t(&[A, 3], Int64),
    );
    bad(
        "full_like",
        &[f32t(&[3]), f32t(&[1])],
        &[],
        "fill_value must be a scalar",
    );

    ok(
        "reshape_like",
        &[f32t(&[2, 6]), t(&[3, 4], Int32)],
        &[],
        f32t(&[3, 4]),
    );
    ok(
        "reshape_like",
        &[f32t(&[2, 6]), f32t(&[9, 2, 3])],
        &[("lhs_begin", I(-1)), ("rhs_begin", I(1))],
        f32t(&[2, 2, 3]),
    );
    ok(
        "reshape_like",
        &[f32t(&[A, 6]), f32t(&[3, 4])],
        &[],
        f32t(&[3, 4]),
    );
    bad(
        "reshape_like",
        &[f32t(&[2, 6]), f32t(&[5])],
        &[],
        "cannot reshape",
    );
    bad(
        "reshape_like",
        &[f32t(&[2, 6]), f32t(&[5])],
        &[("lhs_end", I(3))],
        "lhs_end=3 is out of range",
    );

    ok(
        "broadcast_to_like",
        &[t(&[3, 1], Int32), t(&[2, 3, 4], Int32)],
        &[],
        t(&[2, 3, 4], Int32),
    );
    bad(
        "broadcast_to_like",
        &[t(&[3, 1], Int32), f32t(&[2, 3, 4])],
        &[],
        "dtype mismatch",
    );
    ok(
        "broadcast_to_like",
        &[f32t(&[A]), f32t(&[2, 4])],
        &[],
        f32t(&[2, 4]),
    );
    bad(
        "broadcast_to_like",
        &[f32t(&[2, 3]), f32t(&[3])],
        &[],
        "cannot broadcast",
    );

    ok(
        "collapse_sum_like",
        &[f32t(&[2, 3, 4]), f32t(&[3, 1])],
        &[],
        f32t(&[3, 1]),
    );
    ok(
        "collapse_sum_like",
        &[f32t(&[2, A]), f32t(&[])],
        &[],
        f32t(&[]),
    );
    bad(
        "collapse_sum_like",
        &[f32t(&[2]), t(&[], Int32)],
        &[],
        "dtype mismatch",
    );
    bad(
        "collapse_sum_like",
        &[f32t(&[2, 3]), f32t(&[2])],
        &[],
        "cannot collapse",
    );
    bad(
        "collapse_sum_like",
        &[t(&[2], Bool), t(&[2], Bool)],
        &[],
        "must have a numeric dtype",
    );

    ok(
        "sequence_mask",
        &[f32t(&[5, 3, 2]), t(&[3], Int32)],
        &[],
        f32t(&[5, 3, 2]),
    );
    ok(
        "sequence_mask",
        &[f32t(&[3, A]), t(&[A], Int64)],
        &[("axis", I(1)), ("mask_value", F(-1.0))],
        f32t(&[3, A]),
    );
    bad(
        "sequence_mask",
        &[f32t(&[5, 3]), f32t(&[3])],
        &[],
        "valid_length must have dtype int32 or int64",
    );
    bad(
        "sequence_mask",
        &[f32t(&[5]), t(&[5], Int32)],
        &[],
        "rank at least 2",
    );

    ok(
        "nn.prelu",
        &[f32t(&[2, 3, 4]), f32t(&[3])],
        &[],
        f32t(&[2, 3, 4]),
    );
    ok(
        "nn.prelu",
        &[f32t(&[2, A]), f32t(&[4])],
        &[("axis", I(-1))],
        f32t(&[2, A]),
    );
    bad(
        "nn.prelu",
        &[f32t(&[2, 3]), f32t(&[2])],
        &[],
        "alpha has 2 entries",
    );
    bad(
        "nn.prelu",
        &[f32t(&[2, 3]), f32t(&[3, 1])],
        &[],
        "alpha must be 1-D",
    );

    ok(
        "nn.l2_normalize",
        &[f32t(&[2, 3])],
        &[("eps", F(1e-12))],
        f32t(&[2, 3]),
    );
    ok(
        "nn.l2_normalize",
        &[f32t(&[2, 3])],
        &[("eps", F(1e-12)), ("axis", ints(&[-1]))],
        f32t(&[2, 3]),
    );
    bad(
        "nn.l2_normalize",
        &[f32t(&[2, 3])],
        &[("eps", F(1e-12)), ("axis", ints(&[2]))],
        "out of range",
    );
    bad(
        "nn.l2_normalize",
        &[f32t(&[2])],
        &[("eps", F(-1.0))],
        "eps must be non-negative",
    );

    let pw = |v: &[[i64; 2]]| L(v.iter().map(|p| ints(p)).collect());
    ok(
        "nn.pad",
        &[f32t(&[2, A]), f32t(&[])],
        &[("pad_width", pw(&[[1, 2], [0, 1]]))],
        f32t(&[5, A]),
    );
    ok(
        "nn.pad",
        &[t(&[3], Int32)],
        &[("pad_width", pw(&[[1, 1]]))],
        t(&[5], Int32),
    );
    bad(
        "nn.pad",
        &[f32t(&[2]), f32t(&[])],
        &[("pad_width", ints(&[1, 1]))],
        "one [before, after] pair",
    );
    bad(
        "nn.pad",
        &[f32t(&[2]), f32t(&[])],
        &[("pad_width", pw(&[[-1, 1]]))],
        "non-negative",
    );
    bad(
        "nn.pad",
        &[f32t(&[2]), f32t(&[])],
        &[("pad_width", pw(&[[1, 1]])), ("pad_mode", S("wrap".into()))],
        "pad_mode must be",
    );
    bad(
        "nn.pad",
        &[f32t(&[2]), f32t(&[])],
        &[("pad_width", pw(&[[1, 1]])), ("pad_value", F(1.0))],
        "given twice",
    );
    bad(
        "nn.pad",
        &[f32t(&[2]), f32t(&[])],
        &[],
        "missing required attribute `pad_width`",
    );

    let v = |n: i64| f32t(&[n]);
    ok(
        "nn.batch_norm",
        &[f32t(&[2, 3, 4]), v(3), v(3), v(3), v(3)],
        &[],
        tuple(&[f32t(&[2, 3, 4]), v(3), v(3)]),
    );
    ok(
        "nn.batch_norm",
        &[f32t(&[2, A]), v(A), v(4), v(A), v(A)],
        &[("axis", I(-1))],
        tuple(&[f32t(&[2, A]), v(4), v(4)]),
    );
    bad(
        "nn.batch_norm",
        &[f32t(&[2, 3]), v(3), v(3), v(2), v(3)],
        &[],
        "moving_mean has 2 entries",
    );
    bad(
        "nn.batch_norm",
        &[f32t(&[2, 3]), v(3), v(3), v(3), t(&[3], Float64)],
        &[],
        "dtype mismatch",
    );
}
