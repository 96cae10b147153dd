//! Reference kernels through `eval`: the hand-computed cases (`common/hand.rs`), the run-time
//! re-check of shapes that `?` dims postponed, determinism of the random intrinsic, and a
//! no-panic sweep that calls every kernel directly with ill-fitting arguments.

mod common;

use common::hand::{hand_cases, Expect};
use common::*;
use tumble_ir::AttrValue::{self, Bool as B, Float as F, Int as I, Str as S};
use tumble_ir::{Dim, Ty};
use tumble_ops::{eval, lookup, ty_of, OpCtx, OpValue};
use tumble_tensor::{DType, Rng, Tensor};

#[test]
fn hand_cases_hold() {
    let cases = hand_cases();
    let mut failures = Vec::new();
    for c in &cases {
        let result = run(c.op, &c.args, &c.attrs);
        let outcome = match (&c.expect, result) {
            (Expect::Value(want), Ok(got)) => compare(&got, want),
            (Expect::Check(f), Ok(got)) => f(&got),
            (Expect::Err(msg), Err(e)) if e.message.contains(msg) => Ok(()),
            (Expect::Err(msg), Err(e)) => Err(format!("error `{e}` does not mention `{msg}`")),
            (Expect::Err(msg), Ok(got)) => {
                Err(format!("expected an error mentioning `{msg}`, got {got:?}"))
            }
            (_, Err(e)) => Err(format!("unexpected error: {e}")),
        };
        if let Err(m) = outcome {
            failures.push(format!("{} ({}): {m}", c.op, c.note));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} hand cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A product over an empty inner dimension is +0.0, as numpy's and BLAS's: it was -0.0 (a sum
/// started from -0.0), so `1 / x` was -inf, and the batched engine's f32 `batch_matmul` said +0.0.
#[test]
fn products_over_an_empty_inner_dimension_are_positive_zero() {
    let empty = |shape: &[usize]| OpValue::Tensor(Tensor::zeros(shape, DType::Float32).unwrap());
    let dense = run("nn.dense", &[empty(&[2, 0]), empty(&[3, 0])], &attrs(&[])).unwrap();
    let bmm = run(
        "nn.batch_matmul",
        &[empty(&[1, 2, 0]), empty(&[1, 3, 0])],
        &attrs(&[]),
    )
    .unwrap();
    for (name, v) in [("nn.dense", dense), ("nn.batch_matmul", bmm)] {
        let t = v.as_tensor().unwrap();
        let data = t.to_f64_vec();
        assert_eq!(data.len(), 6, "{name}");
        assert!(
            data.iter().all(|x| *x == 0.0 && x.is_sign_positive()),
            "{name}: {data:?}"
        );
    }
}

/// The checker accepts `nn.dense(x: Tensor[(?, ?)], w: Tensor[(256, ?)])`; at run time the
/// actual shapes disagree and `eval` reports it with the relation's message.
#[test]
fn eval_rechecks_postponed_shapes() {
    let dense = lookup("nn.dense").unwrap();
    let none = attrs(&[]);
    let x_ty = Ty::tensor(vec![Dim::Any, Dim::Any], DType::Float32);
    let w_ty = Ty::tensor(vec![Dim::Known(256), Dim::Any], DType::Float32);
    assert!((dense.relation)(&[x_ty, w_ty], &none).is_ok());

    let x = OpValue::Tensor(Tensor::zeros([2, 512], DType::Float32).unwrap());
    let w = OpValue::Tensor(Tensor::zeros([256, 256], DType::Float32).unwrap());
    let err = run("nn.dense", &[x.clone(), w], &none).unwrap_err();
    assert_eq!(
        err.message,
        "nn.dense: input has 512 columns but weight expects 256"
    );
    assert_eq!(err.to_string(), err.message);

    // The fitting shapes run, and the result has the relation's type.
    let w = OpValue::Tensor(Tensor::zeros([256, 512], DType::Float32).unwrap());
    let out = run("nn.dense", &[x, w], &none).unwrap();
    assert_eq!(ty_of(&out), Ty::tensor_of(&[2, 256], DType::Float32));
}

#[test]
fn eval_checks_arity_and_attributes() {
    let none = attrs(&[]);
    let e = run("add", &[f32s(&[1], &[1.])], &none).unwrap_err();
    assert!(
        e.message.contains("add: expected 2 arguments, found 1"),
        "{e}"
    );
    let e = run("nn.relu", &[f32s(&[1], &[1.])], &attrs(&[("axis", I(0))])).unwrap_err();
    assert!(e.message.contains("unknown attribute `axis`"), "{e}");
    let e = run("sum", &[tup(vec![f32s(&[1], &[1.])])], &none).unwrap_err();
    assert!(e.message.contains("sum: input must be a tensor"), "{e}");
}

#[test]
fn db_uniform_is_deterministic_per_seed() {
    let op = lookup("random.db_uniform").unwrap();
    let a = attrs(&[
        ("low", I(0)),
        ("high", I(100)),
        ("out_shape", ints(&[4, 4])),
    ]);
    let draw = |seed| {
        let mut rng = Rng::new(seed);
        let mut ctx = OpCtx { rng: &mut rng };
        let first = eval(op, &[], &a, &mut ctx).unwrap();
        let second = eval(op, &[], &a, &mut ctx).unwrap();
        (first, second)
    };
    let (x1, x2) = draw(11);
    let (y1, _) = draw(11);
    let (z1, _) = draw(12);
    assert_eq!(x1, y1, "same seed, same draw");
    assert_ne!(x1, x2, "the generator advances between calls");
    assert_ne!(x1, z1, "another seed, another draw");
    // The draw is int_range(low, high) per element, in row-major order.
    let mut rng = Rng::new(11);
    let want: Vec<i32> = (0..16).map(|_| rng.int_range(0, 100) as i32).collect();
    assert_eq!(x1.as_tensor().unwrap().as_i32().unwrap(), &want[..]);
}

/// ACROBAT's form draws exactly what the attribute form draws for the same bounds and stream;
/// bounds that make no range are located errors naming the values.
#[test]
fn db_uniform_with_tensor_bounds() {
    let op = lookup("random.db_uniform").unwrap();
    let by_attrs = attrs(&[("low", I(2)), ("high", I(9)), ("out_shape", ints(&[5]))]);
    let shape = attrs(&[("out_shape", ints(&[5]))]);
    let bounds = |lo: i32, hi: i32| {
        vec![
            OpValue::Tensor(Tensor::scalar_i32(lo)),
            OpValue::Tensor(Tensor::scalar_i32(hi)),
        ]
    };
    let draw = |args: &[OpValue], a: &tumble_ir::Attrs| {
        let mut rng = Rng::new(5);
        let mut ctx = OpCtx { rng: &mut rng };
        eval(op, args, a, &mut ctx)
    };
    assert_eq!(draw(&bounds(2, 9), &shape), draw(&[], &by_attrs));
    let floats = vec![
        OpValue::Tensor(Tensor::scalar_f32(-1.0)),
        OpValue::Tensor(Tensor::scalar_f32(1.0)),
    ];
    let fa = attrs(&[
        ("out_shape", ints(&[64])),
        ("out_dtype", S("float32".into())),
    ]);
    let t = draw(&floats, &fa).unwrap();
    let xs = t.as_tensor().and_then(|t| t.as_f32()).unwrap();
    assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)), "{xs:?}");
    let e = draw(&bounds(0, -2), &shape).unwrap_err();
    assert_eq!(
        e.message,
        "random.db_uniform: the bounds computed at run time are low = 0, high = -2; low must be a \
         finite number not above high"
    );
    assert_eq!(
        draw(&bounds(3, 3), &shape).unwrap(),
        OpValue::Tensor(Tensor::from_i32([5], vec![3; 5]).unwrap())
    );
}

#[test]
fn copy_owns_its_buffer() {
    let x = Tensor::from_f32([2], vec![1.0, 2.0]).unwrap();
    let out = run("copy", &[OpValue::Tensor(x.clone())], &attrs(&[])).unwrap();
    let y = out.as_tensor().unwrap();
    assert_eq!(y, &x);
    assert!(!y.shares_buffer(&x));
}

/// Calls every kernel directly (bypassing `eval`'s checks) and through `eval`, with every
/// combination of ill-fitting arguments from a pool and several attribute sets: no call may
/// panic, and whatever `eval` accepts must have the relation's type (which `eval` checks).
#[test]
fn kernels_never_panic_on_bad_input() {
    let pool: Vec<OpValue> = vec![
        f32s(&[], &[1.5]),
        f32s(&[0], &[]),
        f32s(&[2, 3], &[1., -2., 3., 0., 5., 6.]),
        f64s(&[2, 2, 2], &[0.5; 8]),
        i32s(&[3], &[2, -7, 9]),
        i64s(&[1, 3], &[0, 1, -1]),
        i32s(&[2, 0], &[]),
        bools(&[2], &[true, false]),
        tup(vec![f32s(&[2, 3], &[0.; 6]), f32s(&[1, 3], &[1.; 3])]),
        OpValue::unit(),
    ];
    let sets: Vec<Vec<(&str, AttrValue)>> = vec![
        vec![],
        vec![
            ("axis", I(1)),
            ("axes", ints(&[1, 0])),
            ("keepdims", B(true)),
            ("shape", ints(&[2, 2])),
            ("dtype", S("int32".into())),
            ("newshape", ints(&[-1])),
            ("indices_or_sections", I(2)),
            ("begin", ints(&[0, 1])),
            ("end", ints(&[5, -1])),
            ("strides", ints(&[-1])),
            ("a_min", F(-1.0)),
            ("a_max", F(1.0)),
            ("low", I(0)),
            ("high", I(2)),
            ("out_shape", ints(&[2])),
            ("mode", S("wrap".into())),
            ("units", I(3)),
            ("transpose_a", B(true)),
        ],
        vec![
            ("axis", I(-7)),
            ("axes", ints(&[5])),
            ("exclude", B(true)),
            ("shape", ints(&[-1])),
            ("dtype", S("bool".into())),
            ("newshape", ints(&[-4, -1, -1])),
            ("indices_or_sections", ints(&[2, 1])),
            ("begin", ints(&[9, 9, 9, 9])),
            ("end", ints(&[-9])),
            ("strides", ints(&[0])),
            ("a_min", F(1.0)),
            ("a_max", F(-1.0)),
            ("low", F(0.5)),
            ("high", F(0.6)),
            ("out_shape", ints(&[1 << 40, 1 << 40])),
            ("mode", S("fast".into())),
            ("batch_dims", I(5)),
            ("slice_mode", S("size".into())),
            ("num_newaxis", I(-1)),
            ("epsilon", F(-1.0)),
            ("select_last_index", B(true)),
        ],
        vec![
            ("axis", I(0)),
            ("indices_or_sections", I(0)),
            ("mode", S("clip".into())),
            ("batch_dims", I(-1)),
        ],
    ];
    let sets: Vec<_> = sets.iter().map(|kv| attrs(kv)).collect();
    let mut calls = 0usize;
    for op in tumble_ops::all() {
        // Every argument list of the operator's arity (and one too many).
        for n in [op.arity, op.arity + 1] {
            let mut combo = vec![0usize; n];
            loop {
                let args: Vec<OpValue> = combo.iter().map(|&i| pool[i].clone()).collect();
                for a in &sets {
                    let mut rng = Rng::new(1);
                    let mut ctx = OpCtx { rng: &mut rng };
                    let _ = (op.kernel)(&args, a, &mut ctx);
                    let _ = eval(op, &args, a, &mut ctx);
                    calls += 1;
                }
                // Next combination (odometer over the pool).
                let mut k = n;
                loop {
                    if k == 0 {
                        break;
                    }
                    k -= 1;
                    combo[k] += 1;
                    if combo[k] < pool.len() {
                        break;
                    }
                    combo[k] = 0;
                    if k == 0 {
                        k = usize::MAX;
                        break;
                    }
                }
                if n == 0 || k == usize::MAX {
                    break;
                }
            }
        }
    }
    assert!(calls > 10_000, "{calls}");
}

/// `leading_rows` (whole rows of a `strided_slice`, for callers that take them where they lie)
/// agrees with the operator: wherever it names a range, the kernel's result is exactly those
/// rows; for negative bounds, bounds past the end, empty inputs and empty ranges too. Where it
/// declines (a stride, a narrowed inner axis, listed axes, sizes), it says nothing.
#[test]
fn leading_rows_are_the_rows_strided_slice_selects() {
    let list = |v: &[i64]| AttrValue::List(v.iter().map(|&n| I(n)).collect());
    let mut named = 0;
    for rows in [0usize, 1, 5] {
        let x = Tensor::from_vec(
            vec![rows, 3],
            (0..rows * 3).map(|i| i as f32).collect::<Vec<f32>>(),
        )
        .unwrap();
        for (b, e) in [(0, 1), (1, 4), (-2, 100), (3, 1), (0, -1), (-9, 2), (4, 5)] {
            for extra in [
                vec![],
                vec![("strides", list(&[1, 1]))],
                vec![("strides", list(&[2, 1]))],
                vec![("slice_mode", S("size".into()))],
                vec![("axes", list(&[0, 1]))],
            ] {
                for inner in [(0, 3), (0, 100), (1, 3)] {
                    let mut a = vec![("begin", list(&[b, inner.0])), ("end", list(&[e, inner.1]))];
                    a.extend(extra.iter().cloned());
                    let a = attrs(&a);
                    let Some((start, len)) = tumble_ops::leading_rows(&a, x.shape()) else {
                        continue;
                    };
                    named += 1;
                    let got = run("strided_slice", &[OpValue::Tensor(x.clone())], &a).unwrap();
                    let want: Vec<f32> = (start * 3..(start + len) * 3).map(|i| i as f32).collect();
                    let OpValue::Tensor(got) = got else {
                        panic!("not a tensor")
                    };
                    assert_eq!(got.shape(), [len, 3], "rows {rows} begin {b} end {e} {a:?}");
                    assert_eq!(
                        got.to_f64_vec(),
                        want.iter().map(|&v| v as f64).collect::<Vec<_>>()
                    );
                    // Only step-1, whole-row slices are named.
                    assert!(inner.0 == 0 && inner.1 >= 3, "{a:?}");
                    assert!(!extra
                        .iter()
                        .any(|(k, v)| *k != "strides" || *v != list(&[1, 1])));
                }
            }
        }
    }
    assert!(named > 20, "{named}");
}

/// A sum (and the sum inside a mean's numerator) over no elements is +0.0, as numpy's: Rust's
/// `Sum` for floats starts from -0.0, which the results printed.
#[test]
fn sums_over_no_elements_are_positive_zero() {
    let x = Tensor::from_vec(vec![0, 3], Vec::<f32>::new()).unwrap_or_else(|e| panic!("{e}"));
    let a = attrs(&[("axis", AttrValue::List(vec![I(0)]))]);
    let out = run("sum", &[OpValue::Tensor(x)], &a).unwrap_or_else(|e| panic!("{e}"));
    let OpValue::Tensor(t) = out else {
        panic!("not a tensor")
    };
    let v = t.as_f32().unwrap_or_else(|| panic!("not f32"));
    assert_eq!(v.len(), 3);
    assert!(v.iter().all(|z| *z == 0.0 && z.is_sign_positive()), "{v:?}");
}

/// The mean of integers is their exact sum divided (truncating): the sum of int64s wrapped,
/// so the mean of two values near `i64::MAX` came out negative.
#[test]
fn integer_means_do_not_wrap() {
    let big = i64::MAX - 1;
    let x = Tensor::from_vec(vec![3], vec![big, big, big - 3]).unwrap_or_else(|e| panic!("{e}"));
    let out = run("mean", &[OpValue::Tensor(x)], &attrs(&[])).unwrap_or_else(|e| panic!("{e}"));
    let OpValue::Tensor(t) = out else {
        panic!("not a tensor")
    };
    assert_eq!(t.as_slice::<i64>(), Some(&[big - 1][..]));
    let x =
        Tensor::from_vec(vec![2], vec![i32::MIN, i32::MIN + 1]).unwrap_or_else(|e| panic!("{e}"));
    let out = run("mean", &[OpValue::Tensor(x)], &attrs(&[])).unwrap_or_else(|e| panic!("{e}"));
    let OpValue::Tensor(t) = out else {
        panic!("not a tensor")
    };
    // -4294967295 / 2 truncates toward zero.
    assert_eq!(t.as_slice::<i32>(), Some(&[i32::MIN + 1][..]));
}
