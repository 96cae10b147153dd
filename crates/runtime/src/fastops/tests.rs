use super::*;
use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Span};
use tumble_ops::OpCtx;
use tumble_tensor::Rng;

/// An f32 tensor of `shape` with N(0, 1) values.
pub(crate) fn rand(shape: &[usize], rng: &mut Rng) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32(
        shape.to_vec(),
        (0..n).map(|_| rng.normal_f64() as f32).collect(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

pub(crate) fn attrs(kv: &[(&str, AttrValue)]) -> Attrs {
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

/// `op` on `args` by the operator table's reference rule.
pub(crate) fn reference(op: &str, args: &[OpValue], a: &Attrs) -> Tensor {
    let def = tumble_ops::lookup(op).unwrap_or_else(|| panic!("no {op}"));
    let mut rng = Rng::new(0);
    let mut ctx = OpCtx { rng: &mut rng };
    match tumble_ops::eval(def, args, a, &mut ctx) {
        Ok(OpValue::Tensor(t)) => t,
        other => panic!("{other:?}"),
    }
}

/// `strided_slice` of f32 tensors — begin/end of every sign, strides 1, 2 and -1, listed
/// `axes` (negative too), size mode, whole and partial inner axes, empty results — the
/// reference's values and shape.
#[test]
fn slices_are_the_references() {
    let mut rng = Rng::new(3);
    let ints = |v: &[i64]| AttrValue::List(v.iter().map(|&x| AttrValue::Int(x)).collect());
    type Case<'a> = (&'a [usize], Vec<(&'a str, AttrValue)>);
    let cases: Vec<Case> = vec![
        (
            &[7, 3],
            vec![
                ("begin", ints(&[1])),
                ("end", ints(&[i64::from(i32::MAX)])),
                ("axes", ints(&[0])),
            ],
        ),
        (
            &[7, 3],
            vec![("begin", ints(&[1, 0])), ("end", ints(&[6, 3]))],
        ),
        (
            &[7, 3],
            vec![("begin", ints(&[0, 1])), ("end", ints(&[-1, 3]))],
        ),
        (
            &[7, 4],
            vec![
                ("begin", ints(&[0, 0])),
                ("end", ints(&[7, 4])),
                ("strides", ints(&[2, 1])),
            ],
        ),
        (
            &[7, 4],
            vec![
                ("begin", ints(&[-1, 3])),
                ("end", ints(&[-8, -5])),
                ("strides", ints(&[-1, -1])),
            ],
        ),
        (
            &[5, 2, 6],
            vec![
                ("begin", ints(&[1, 2])),
                ("end", ints(&[3, 4])),
                ("axes", ints(&[0, -1])),
            ],
        ),
        (
            &[5, 2, 6],
            vec![
                ("begin", ints(&[2, 0, 1])),
                ("end", ints(&[2, -1, 5])),
                ("slice_mode", AttrValue::Str("size".into())),
            ],
        ),
        (&[5, 2, 6], vec![("begin", ints(&[4])), ("end", ints(&[2]))]),
        (
            &[6],
            vec![
                ("begin", ints(&[1])),
                ("end", ints(&[6])),
                ("strides", ints(&[3])),
            ],
        ),
    ];
    for (shape, kv) in cases {
        let t = rand(shape, &mut rng);
        let a = attrs(&kv);
        let args = [OpValue::Tensor(t)];
        let Some(OpValue::Tensor(fast)) = try_eval("strided_slice", &args, &a, 1) else {
            panic!("{shape:?} {kv:?}: no fast path")
        };
        let want = reference("strided_slice", &args, &a);
        assert_eq!(fast.shape(), want.shape(), "{shape:?} {kv:?}");
        assert_eq!(fast.as_f32(), want.as_f32(), "{shape:?} {kv:?}");
    }
}

/// Comparisons, `where` and `sign` of f32 tensors broadcast against each other in every
/// way the shapes allow (a scalar, a row, a column, equal shapes), with equal values,
/// signed zeros and NaN among them: the reference's values, dtype and shape.
#[test]
fn comparisons_selections_and_signs_are_the_references() {
    let mut rng = Rng::new(5);
    let special = |t: Tensor| {
        let mut v = t.as_f32().unwrap_or_default().to_vec();
        for (i, x) in v.iter_mut().enumerate() {
            match i % 7 {
                1 => *x = 0.0,
                3 => *x = -0.0,
                5 => *x = f32::NAN,
                6 => *x = 0.25,
                _ => {}
            }
        }
        Tensor::from_f32(t.shape().to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
    };
    let shapes: [&[usize]; 5] = [&[], &[5], &[3, 1], &[3, 5], &[2, 3, 5]];
    let none = attrs(&[]);
    let same = |fast: &Tensor, want: &Tensor, what: &str| {
        assert_eq!(fast.shape(), want.shape(), "{what}");
        assert_eq!(fast.dtype(), want.dtype(), "{what}");
        let (a, b) = (fast.to_f64_vec(), want.to_f64_vec());
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x == y || (x.is_nan() && y.is_nan()),
                "{what}: {a:?} vs {b:?}"
            );
            assert_eq!(x.is_sign_negative(), y.is_sign_negative(), "{what}");
        }
    };
    let mut checked = 0;
    for sa in shapes {
        let a = special(rand(sa, &mut rng));
        let args = [OpValue::Tensor(a.clone())];
        let Some(OpValue::Tensor(fast)) = try_eval("sign", &args, &none, 1) else {
            panic!("sign {sa:?}: no fast path")
        };
        same(
            &fast,
            &reference("sign", &args, &none),
            &format!("sign {sa:?}"),
        );
        for sb in shapes {
            let b = special(rand(sb, &mut rng));
            if tumble_tensor::broadcast_shapes(sa, sb).is_err() {
                continue;
            }
            let pair = [OpValue::Tensor(a.clone()), OpValue::Tensor(b.clone())];
            for op in [
                "equal",
                "not_equal",
                "less",
                "greater",
                "less_equal",
                "greater_equal",
            ] {
                let Some(OpValue::Tensor(fast)) = try_eval(op, &pair, &none, 1) else {
                    panic!("{op} {sa:?} {sb:?}: no fast path")
                };
                same(
                    &fast,
                    &reference(op, &pair, &none),
                    &format!("{op} {sa:?} {sb:?}"),
                );
                checked += 1;
            }
            let cond = reference("greater", &pair, &none);
            for sc in shapes {
                let c = match tumble_tensor::broadcast_shapes(cond.shape(), sc) {
                    Ok(s) if s == cond.shape() => cond.clone(),
                    _ => continue,
                };
                let three = [
                    OpValue::Tensor(c),
                    OpValue::Tensor(a.clone()),
                    OpValue::Tensor(special(rand(sc, &mut rng))),
                ];
                let Some(OpValue::Tensor(fast)) = try_eval("where", &three, &none, 1) else {
                    panic!("where {sa:?} {sb:?} {sc:?}: no fast path")
                };
                same(
                    &fast,
                    &reference("where", &three, &none),
                    &format!("where {sc:?}"),
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

/// Sums and means over one axis, every axis of odd shapes, with and without keepdims, with
/// signed zeros and NaN: the reference's bits.
#[test]
fn reductions_over_one_axis_are_the_references() {
    let mut rng = Rng::new(11);
    let shapes: [&[usize]; 6] = [
        &[7],
        &[3, 5],
        &[1, 9],
        &[4, 1, 3],
        &[2, 3, 17],
        &[5, 2, 1, 3],
    ];
    let mut checked = 0;
    for shape in shapes {
        let mut t = rand(shape, &mut rng);
        if shape.len() == 3 {
            // A signed zero and a NaN among the values.
            let mut v = t.as_f32().unwrap_or_default().to_vec();
            v[0] = -0.0;
            if v.len() > 5 {
                v[5] = f32::NAN;
            }
            // Ties, for the argmax's first and last picks.
            for i in (2..v.len()).step_by(4) {
                v[i] = v[1];
            }
            t = Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"));
        }
        let r = shape.len() as i64;
        for op in ["sum", "mean", "max", "min", "argmax", "argmin"] {
            for axis in -r..r {
                for (keep, last) in [(false, false), (true, false), (false, true)] {
                    let mut kv = vec![
                        ("axis", AttrValue::List(vec![AttrValue::Int(axis)])),
                        ("keepdims", AttrValue::Bool(keep)),
                    ];
                    if last {
                        if !op.starts_with("arg") {
                            continue;
                        }
                        kv.push(("select_last_index", AttrValue::Bool(true)));
                    }
                    let a = attrs(&kv);
                    let args = [OpValue::Tensor(t.clone())];
                    let Some(OpValue::Tensor(fast)) = try_eval(op, &args, &a, 1) else {
                        panic!("{op} {shape:?} axis {axis}: no fast path")
                    };
                    let want = reference(op, &args, &a);
                    assert_eq!(fast.shape(), want.shape(), "{op} {shape:?} {axis}");
                    let bits = |x: &Tensor| -> Vec<u64> {
                        match x.as_f32() {
                            Some(v) => v.iter().map(|v| u64::from(v.to_bits())).collect(),
                            None => x.to_i64_vec().iter().map(|&i| i as u64).collect(),
                        }
                    };
                    assert_eq!(bits(&fast), bits(&want), "{op} {shape:?} axis {axis}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 180, "{checked}");
}

/// Extremes and their positions over long last axes (eight lanes and a remainder): a zero
/// extreme of either sign among zeros of both, NaN first, late and twice, ties early and
/// late, all equal: the reference's bits and positions.
#[test]
fn extremes_of_long_rows_are_the_references() {
    let n = 43;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base: Vec<f32> = (0..n).map(|i| -1.0 - (i * 7 % 13) as f32).collect();
    let with = |at: &[(usize, f32)]| {
        let mut r = base.clone();
        for &(i, v) in at {
            r[i] = v;
        }
        r
    };
    rows.push(with(&[(3, -0.0), (20, 0.0)]));
    rows.push(with(&[(3, 0.0), (20, -0.0), (41, 0.0)]));
    rows.push(with(&[(0, f32::NAN)]));
    rows.push(with(&[(37, f32::NAN), (40, f32::NAN)]));
    rows.push(with(&[(2, 5.0), (9, 5.0), (42, 5.0)]));
    rows.push(vec![2.5; n]);
    rows.push(base.iter().map(|x| -x).collect());
    let t = Tensor::from_f32(vec![rows.len(), n], rows.concat()).unwrap_or_else(|e| panic!("{e}"));
    for op in ["max", "min", "argmax", "argmin"] {
        for last in [false, true] {
            if last && !op.starts_with("arg") {
                continue;
            }
            let mut kv = vec![("axis", AttrValue::List(vec![AttrValue::Int(1)]))];
            if last {
                kv.push(("select_last_index", AttrValue::Bool(true)));
            }
            let a = attrs(&kv);
            let args = [OpValue::Tensor(t.clone())];
            let Some(OpValue::Tensor(fast)) = try_eval(op, &args, &a, 1) else {
                panic!("{op}: no fast path")
            };
            let want = reference(op, &args, &a);
            let bits = |x: &Tensor| -> Vec<u64> {
                match x.as_f32() {
                    Some(v) => v.iter().map(|v| u64::from(v.to_bits())).collect(),
                    None => x.to_i64_vec().iter().map(|&i| i as u64).collect(),
                }
            };
            assert_eq!(bits(&fast), bits(&want), "{op} last={last}");
        }
    }
}

/// `variance` against its keepdims mean over each axis of odd shapes, biased and unbiased,
/// with and without keepdims: the reference's bits; a mean of another shape is left to it.
#[test]
fn variance_over_one_axis_is_the_references() {
    let mut rng = Rng::new(5);
    let shapes: [&[usize]; 5] = [&[7], &[3, 5], &[1, 9], &[4, 1, 3], &[2, 3, 17]];
    let mut checked = 0;
    for shape in shapes {
        let t = rand(shape, &mut rng);
        let r = shape.len() as i64;
        for axis in -r..r {
            let mut mshape = shape.to_vec();
            mshape[axis.rem_euclid(r) as usize] = 1;
            let m = rand(&mshape, &mut rng);
            for (keep, unbiased) in [(false, false), (true, false), (true, true)] {
                let a = attrs(&[
                    ("axis", AttrValue::List(vec![AttrValue::Int(axis)])),
                    ("keepdims", AttrValue::Bool(keep)),
                    ("unbiased", AttrValue::Bool(unbiased)),
                ]);
                let args = [OpValue::Tensor(t.clone()), OpValue::Tensor(m.clone())];
                let Some(OpValue::Tensor(fast)) = try_eval("variance", &args, &a, 1) else {
                    panic!("{shape:?} axis {axis}: no fast path")
                };
                let want = reference("variance", &args, &a);
                assert_eq!(fast.shape(), want.shape(), "{shape:?} {axis}");
                let bits = |x: &Tensor| -> Vec<u32> {
                    x.as_f32()
                        .unwrap_or_default()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                };
                assert_eq!(bits(&fast), bits(&want), "{shape:?} axis {axis} {unbiased}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 33, "{checked}");
    // One mean for the whole tensor: not a row's own, the reference's.
    let t = rand(&[3, 5], &mut rng);
    let one = rand(&[1, 1], &mut rng);
    let a = attrs(&[("axis", AttrValue::List(vec![AttrValue::Int(1)]))]);
    let args = [OpValue::Tensor(t), OpValue::Tensor(one)];
    assert!(try_eval("variance", &args, &a, 1).is_none());
}

#[test]
fn broadcast_arithmetic_is_bit_identical_to_the_reference() {
    let mut rng = Rng::new(7);
    let pairs: [(&[usize], &[usize]); 9] = [
        (&[5, 1], &[64]),
        (&[3, 1, 7], &[1, 4, 7]),
        (&[], &[2, 3]),
        (&[2, 3], &[]),
        (&[4, 33], &[4, 33]),
        (&[1], &[1]),
        (&[6, 1, 1], &[5, 1]),
        (&[0, 3], &[3]),
        (&[2, 1, 3, 1], &[5, 1, 4]),
    ];
    for (sa, sb) in pairs {
        let a = rand(sa, &mut rng);
        let b = rand(sb, &mut rng);
        let args = [OpValue::Tensor(a), OpValue::Tensor(b)];
        for op in ["add", "subtract", "multiply", "divide"] {
            let fast = match try_eval(op, &args, &Attrs::default(), 1) {
                Some(OpValue::Tensor(t)) => t,
                other => panic!("{op} {sa:?} {sb:?}: {other:?}"),
            };
            let want = reference(op, &args, &Attrs::default());
            assert_eq!(fast.shape(), want.shape(), "{op} {sa:?} {sb:?}");
            let (f, w) = (fast.as_f32().unwrap_or(&[]), want.as_f32().unwrap_or(&[]));
            assert!(
                f.iter().zip(w).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{op} {sa:?} {sb:?}: {f:?} vs {w:?}"
            );
        }
    }
    // Shapes that do not broadcast and other dtypes are left to the reference kernel.
    let bad = [
        OpValue::Tensor(rand(&[3], &mut rng)),
        OpValue::Tensor(rand(&[4], &mut rng)),
    ];
    assert!(try_eval("add", &bad, &Attrs::default(), 1).is_none());
    let ints = Tensor::from_vec(vec![2], vec![1i32, 2]).unwrap_or_else(|e| panic!("{e}"));
    let mixed = [OpValue::Tensor(ints.clone()), OpValue::Tensor(ints)];
    assert!(try_eval("multiply", &mixed, &Attrs::default(), 1).is_none());
}

#[test]
fn permute_matches_the_reference_at_odd_shapes() {
    let mut rng = Rng::new(1);
    for shape in [vec![1, 7, 3], vec![7, 1, 33], vec![3, 5, 2, 7]] {
        let t = rand(&shape, &mut rng);
        let r = shape.len();
        let perms: Vec<Vec<i64>> = if r == 3 {
            vec![vec![1, 0, 2], vec![2, 0, 1], vec![0, 2, 1]]
        } else {
            vec![vec![0, 2, 1, 3], vec![3, 2, 1, 0]]
        };
        for p in perms {
            let a = attrs(&[(
                "axes",
                AttrValue::List(p.iter().map(|&x| AttrValue::Int(x)).collect()),
            )]);
            let args = [OpValue::Tensor(t.clone())];
            let fast = try_eval("transpose", &args, &a, 1).and_then(|v| v.as_tensor().cloned());
            assert_eq!(
                fast,
                Some(reference("transpose", &args, &a)),
                "{shape:?} {p:?}"
            );
        }
    }
}

#[test]
fn concatenate_matches_the_reference_on_every_axis() {
    let mut rng = Rng::new(3);
    for (shape, axis) in [
        (vec![1, 1], 0i64),
        (vec![3, 7, 5], 0),
        (vec![3, 7, 5], 1),
        (vec![3, 7, 5], 2),
        (vec![2, 33, 1], -1),
    ] {
        let mut other = shape.clone();
        let ax = if axis < 0 {
            shape.len() as i64 + axis
        } else {
            axis
        } as usize;
        other[ax] = 2;
        let parts = vec![
            rand(&shape, &mut rng),
            rand(&other, &mut rng),
            rand(&shape, &mut rng),
        ];
        let a = attrs(&[("axis", AttrValue::Int(axis))]);
        let args = [OpValue::Tuple(parts)];
        let fast = try_eval("concatenate", &args, &a, 1).and_then(|v| v.as_tensor().cloned());
        assert_eq!(
            fast,
            Some(reference("concatenate", &args, &a)),
            "{shape:?} {axis}"
        );
    }
}

#[test]
fn batch_matmul_matches_the_reference_with_and_without_transpose() {
    let mut rng = Rng::new(2);
    let check = |x: Tensor, y: Tensor, tb: bool, what: &str| {
        let a = attrs(&[("transpose_b", AttrValue::Bool(tb))]);
        let args = [OpValue::Tensor(x), OpValue::Tensor(y)];
        let fast = try_eval("nn.batch_matmul", &args, &a, 2)
            .and_then(|v| v.as_tensor().cloned())
            .unwrap_or_else(|| panic!("no fast path"));
        let want = reference("nn.batch_matmul", &args, &a);
        assert!(fast.allclose(&want, 1e-5, 1e-5), "{what} {tb}");
    };
    // m ≥ 8: the GEMM kernel (`gemm::small_product`); below, dot products.
    for (g, m, n, k) in [
        (1, 1, 1, 1),
        (3, 7, 5, 33),
        (2, 1, 9, 8),
        (3, 8, 5, 3),
        (2, 19, 33, 65),
        (1, 130, 17, 64),
    ] {
        for tb in [true, false] {
            let x = rand(&[g, m, k], &mut rng);
            let y = if tb {
                rand(&[g, n, k], &mut rng)
            } else {
                rand(&[g, k, n], &mut rng)
            };
            check(x, y, tb, &format!("{g} {m} {n} {k}"));
        }
    }
    // One side shared by every batch element (broadcast over g).
    for tb in [true, false] {
        let x = rand(&[1, 12, 20], &mut rng);
        let y = rand(&[3, 20, 20], &mut rng);
        check(x, y, tb, "broadcast");
    }
}
