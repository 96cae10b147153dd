//! Every gradient rule against central finite differences in f64.

use super::*;
use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Span};

struct Gen(u64);

impl Gen {
    /// Uniform in [lo, hi), deterministic.
    fn next(&mut self, lo: f64, hi: f64) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (hi - lo) * ((self.0 >> 11) as f64 / (1u64 << 53) as f64)
    }

    fn tensor(&mut self, shape: &[usize], lo: f64, hi: f64) -> OpValue {
        let n = shape.iter().product();
        let v = (0..n).map(|_| self.next(lo, hi)).collect::<Vec<f64>>();
        OpValue::Tensor(Tensor::from_vec(shape.to_vec(), v).unwrap())
    }
}

fn attrs(list: &[(&str, AttrValue)]) -> Attrs {
    Attrs(
        list.iter()
            .map(|(n, v)| Attr {
                name: n.to_string(),
                value: v.clone(),
                span: Span::default(),
            })
            .collect(),
    )
}

fn ints(v: &[i64]) -> AttrValue {
    AttrValue::List(v.iter().map(|&x| AttrValue::Int(x)).collect())
}

fn run(name: &str, args: &[OpValue], at: &Attrs) -> OpValue {
    let op = crate::lookup(name).unwrap();
    let mut rng = tumble_tensor::Rng::new(0);
    crate::eval(op, args, at, &mut OpCtx { rng: &mut rng }).unwrap()
}

fn flat(v: &OpValue) -> Vec<f64> {
    match v {
        OpValue::Tensor(t) => t.to_f64_vec(),
        OpValue::Tuple(ts) => ts.iter().flat_map(Tensor::to_f64_vec).collect(),
    }
}

/// A value of `like`'s type from flat values.
fn unflat(like: &OpValue, v: &[f64]) -> OpValue {
    let mk = |t: &Tensor, s: &[f64]| {
        Tensor::from_vec(t.shape().to_vec(), s.to_vec())
            .unwrap()
            .cast(t.dtype())
    };
    match like {
        OpValue::Tensor(t) => OpValue::Tensor(mk(t, v)),
        OpValue::Tuple(ts) => {
            let mut at = 0;
            OpValue::Tuple(
                ts.iter()
                    .map(|t| {
                        let p = mk(t, &v[at..at + t.len()]);
                        at += t.len();
                        p
                    })
                    .collect(),
            )
        }
    }
}

fn is_float(v: &OpValue) -> bool {
    match v {
        OpValue::Tensor(t) => t.dtype().is_float(),
        OpValue::Tuple(ts) => ts.iter().all(|t| t.dtype().is_float()),
    }
}

/// Checks the rule for `name` at `args` against central differences of `sum(r * op(args))`.
fn check(name: &str, args: Vec<OpValue>, at: Attrs) {
    let op = crate::lookup(name).unwrap();
    let out = run(name, &args, &at);
    let mut g = Gen(99);
    let r: Vec<f64> = flat(&out).iter().map(|_| g.next(-1.0, 1.0)).collect();
    let dy = unflat(&out, &r);
    let grads = vjp(op, &args, &at, &out, &dy).unwrap();
    assert_eq!(grads.len(), args.len(), "{name}: one gradient per argument");
    let f = |args: &[OpValue]| -> f64 {
        flat(&run(name, args, &at))
            .iter()
            .zip(&r)
            .map(|(a, b)| a * b)
            .sum()
    };
    let mut checked = 0;
    for (i, a) in args.iter().enumerate() {
        if !is_float(a) {
            assert!(
                grads[i].is_none(),
                "{name}: argument {i} is not float but has a gradient"
            );
            continue;
        }
        let Some(gi) = &grads[i] else {
            panic!("{name}: no gradient for float argument {i}")
        };
        let analytic = flat(gi);
        let base = flat(a);
        assert_eq!(
            analytic.len(),
            base.len(),
            "{name}: gradient {i} has the argument's size"
        );
        for j in 0..base.len() {
            let eps = 1e-6;
            let mut p = base.clone();
            p[j] += eps;
            let mut m = base.clone();
            m[j] -= eps;
            let mut ap = args.clone();
            ap[i] = unflat(a, &p);
            let mut am = args.clone();
            am[i] = unflat(a, &m);
            let numeric = (f(&ap) - f(&am)) / (2.0 * eps);
            let err = (numeric - analytic[j]).abs();
            assert!(
                err <= 1e-6 * numeric.abs().max(1.0),
                "{name}: d/d arg{i}[{j}]: analytic {} numeric {numeric}",
                analytic[j]
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "{name}: nothing checked");
}

#[test]
fn broadcasting_binary() {
    let mut g = Gen(1);
    check(
        "add",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[3], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "subtract",
        vec![
            g.tensor(&[2, 1, 3], -1.0, 1.0),
            g.tensor(&[4, 1], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "multiply",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[2, 3], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "divide",
        vec![g.tensor(&[3], -1.0, 1.0), g.tensor(&[2, 3], 0.5, 2.0)],
        Attrs::default(),
    );
    check(
        "power",
        vec![g.tensor(&[2, 3], 0.5, 2.0), g.tensor(&[3], -1.0, 2.0)],
        Attrs::default(),
    );
    check(
        "maximum",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[3], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "minimum",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[2, 3], -1.0, 1.0)],
        Attrs::default(),
    );
    // Quotients clear of integers, where the remainders are smooth: a - trunc(a/b)·b and
    // a - floor(a/b)·b (which differ for the negative dividends).
    for name in ["mod", "floor_mod"] {
        for (lo, hi) in [(2.3, 3.7), (-3.7, -2.3)] {
            check(
                name,
                vec![g.tensor(&[2, 3], lo, hi), g.tensor(&[3], 1.1, 1.4)],
                Attrs::default(),
            );
        }
    }
    let cond = OpValue::Tensor(
        Tensor::from_vec(vec![2, 3], vec![true, false, true, false, false, true]).unwrap(),
    );
    check(
        "where",
        vec![
            cond,
            g.tensor(&[2, 3], -1.0, 1.0),
            g.tensor(&[3], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "nn.bias_add",
        vec![g.tensor(&[2, 3, 4], -1.0, 1.0), g.tensor(&[3], -1.0, 1.0)],
        attrs(&[("axis", AttrValue::Int(1))]),
    );
    check(
        "nn.bias_add",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[3], -1.0, 1.0)],
        Attrs::default(),
    );
}

#[test]
fn unary() {
    let mut g = Gen(2);
    for name in [
        "negative", "sigmoid", "tanh", "exp", "copy", "erf", "sin", "cos", "atan", "sinh", "cosh",
        "asinh",
    ] {
        check(name, vec![g.tensor(&[2, 3], -2.0, 2.0)], Attrs::default());
    }
    // Inside their domains, away from the poles.
    for name in ["tan", "asin", "acos", "atanh"] {
        check(name, vec![g.tensor(&[2, 3], -0.8, 0.8)], Attrs::default());
    }
    for name in ["log2", "log10"] {
        check(name, vec![g.tensor(&[2, 3], 0.2, 2.0)], Attrs::default());
    }
    check("acosh", vec![g.tensor(&[2, 3], 1.2, 3.0)], Attrs::default());
    check(
        "nn.leaky_relu",
        vec![g.tensor(&[2, 3], -2.0, 2.0)],
        attrs(&[("alpha", AttrValue::Float(0.3))]),
    );
    for name in ["log", "sqrt", "rsqrt", "abs", "nn.relu"] {
        check(name, vec![g.tensor(&[2, 3], 0.2, 2.0)], Attrs::default());
    }
    check("abs", vec![g.tensor(&[4], -2.0, -0.1)], Attrs::default());
    check(
        "nn.relu",
        vec![g.tensor(&[4], -2.0, -0.1)],
        Attrs::default(),
    );
    // Values clear of the bounds: the kink is not differentiable.
    let x = OpValue::Tensor(Tensor::from_vec(vec![4], vec![-0.9, -0.2, 0.3, 0.8]).unwrap());
    check(
        "clip",
        vec![x],
        attrs(&[
            ("a_min", AttrValue::Float(-0.5)),
            ("a_max", AttrValue::Float(0.5)),
        ]),
    );
    check(
        "cast",
        vec![g.tensor(&[3], -1.0, 1.0)],
        attrs(&[("dtype", AttrValue::Str("float64".into()))]),
    );
    check(
        "full",
        vec![g.tensor(&[], -1.0, 1.0)],
        attrs(&[
            ("shape", ints(&[2, 3])),
            ("dtype", AttrValue::Str("float64".into())),
        ]),
    );
}

#[test]
fn normalizations_and_reductions() {
    let mut g = Gen(3);
    check(
        "nn.softmax",
        vec![g.tensor(&[2, 3, 4], -2.0, 2.0)],
        attrs(&[("axis", AttrValue::Int(1))]),
    );
    check(
        "nn.softmax",
        vec![g.tensor(&[5], -2.0, 2.0)],
        Attrs::default(),
    );
    check(
        "nn.log_softmax",
        vec![g.tensor(&[2, 5], -2.0, 2.0)],
        Attrs::default(),
    );
    check(
        "nn.log_softmax",
        vec![g.tensor(&[3, 2], -2.0, 2.0)],
        attrs(&[("axis", AttrValue::Int(0))]),
    );
    check(
        "nn.layer_norm",
        vec![
            g.tensor(&[3, 5], -2.0, 2.0),
            g.tensor(&[5], 0.5, 1.5),
            g.tensor(&[5], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "nn.layer_norm",
        vec![
            g.tensor(&[4, 3], -2.0, 2.0),
            g.tensor(&[4], 0.5, 1.5),
            g.tensor(&[4], -1.0, 1.0),
        ],
        attrs(&[("axis", AttrValue::Int(0))]),
    );
    check(
        "sum",
        vec![g.tensor(&[2, 3, 4], -1.0, 1.0)],
        attrs(&[("axis", ints(&[1]))]),
    );
    check("prod", vec![g.tensor(&[2, 3], 0.5, 1.5)], Attrs::default());
    // One zero in the first row, two in the second: the product is linear in each element, so
    // the differences are exact there too.
    let zeros = Tensor::from_vec(vec![2, 3], vec![0.0f64, 2.0, 3.0, 0.0, 0.0, 5.0]).unwrap();
    check(
        "prod",
        vec![OpValue::Tensor(zeros)],
        attrs(&[("axis", ints(&[1]))]),
    );
    check(
        "prod",
        vec![g.tensor(&[2, 3, 2], -1.5, 1.5)],
        attrs(&[("axis", ints(&[0, 2]))]),
    );
    check("sum", vec![g.tensor(&[2, 3], -1.0, 1.0)], Attrs::default());
    // The mean given with keepdims, as `relay.variance` passes it, and one of another value.
    check(
        "variance",
        vec![g.tensor(&[3, 4], -1.0, 1.0), g.tensor(&[3, 1], -0.5, 0.5)],
        attrs(&[("axis", ints(&[1]))]),
    );
    check(
        "variance",
        vec![
            g.tensor(&[2, 3, 2], -1.0, 1.0),
            g.tensor(&[1, 3, 1], -0.5, 0.5),
        ],
        attrs(&[
            ("axis", ints(&[0, 2])),
            ("keepdims", AttrValue::Bool(true)),
            ("unbiased", AttrValue::Bool(true)),
        ]),
    );
    check(
        "mean",
        vec![g.tensor(&[2, 3, 4], -1.0, 1.0)],
        attrs(&[("axis", ints(&[0, 2])), ("keepdims", AttrValue::Bool(true))]),
    );
    check(
        "mean",
        vec![g.tensor(&[2, 3, 4], -1.0, 1.0)],
        attrs(&[("axis", ints(&[1])), ("exclude", AttrValue::Bool(true))]),
    );
    check(
        "max",
        vec![g.tensor(&[3, 4], -1.0, 1.0)],
        attrs(&[("axis", ints(&[1]))]),
    );
    check("min", vec![g.tensor(&[3, 4], -1.0, 1.0)], Attrs::default());
}

#[test]
fn products() {
    let mut g = Gen(4);
    check(
        "nn.dense",
        vec![
            g.tensor(&[2, 3, 4], -1.0, 1.0),
            g.tensor(&[5, 4], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "nn.dense",
        vec![g.tensor(&[4], -1.0, 1.0), g.tensor(&[2, 4], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "nn.batch_matmul",
        vec![
            g.tensor(&[2, 3, 4], -1.0, 1.0),
            g.tensor(&[2, 5, 4], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "nn.batch_matmul",
        vec![
            g.tensor(&[1, 4, 3], -1.0, 1.0),
            g.tensor(&[2, 4, 5], -1.0, 1.0),
        ],
        attrs(&[
            ("transpose_a", AttrValue::Bool(true)),
            ("transpose_b", AttrValue::Bool(false)),
        ]),
    );
}

#[test]
fn layout() {
    let mut g = Gen(5);
    let pair = OpValue::Tuple(vec![
        g.tensor(&[2, 3], -1.0, 1.0).as_tensor().unwrap().clone(),
        g.tensor(&[2, 2], -1.0, 1.0).as_tensor().unwrap().clone(),
    ]);
    check(
        "concatenate",
        vec![pair],
        attrs(&[("axis", AttrValue::Int(1))]),
    );
    check(
        "split",
        vec![g.tensor(&[2, 6], -1.0, 1.0)],
        attrs(&[
            ("indices_or_sections", AttrValue::Int(3)),
            ("axis", AttrValue::Int(1)),
        ]),
    );
    check(
        "split",
        vec![g.tensor(&[5, 2], -1.0, 1.0)],
        attrs(&[("indices_or_sections", ints(&[1, 3]))]),
    );
    check(
        "reshape",
        vec![g.tensor(&[2, 6], -1.0, 1.0)],
        attrs(&[("newshape", ints(&[3, -1]))]),
    );
    check(
        "transpose",
        vec![g.tensor(&[2, 3, 4], -1.0, 1.0)],
        attrs(&[("axes", ints(&[1, 0, 2]))]),
    );
    check(
        "transpose",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "expand_dims",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        attrs(&[("axis", AttrValue::Int(1))]),
    );
    let pair = OpValue::Tuple(vec![
        g.tensor(&[2, 3], -1.0, 1.0).as_tensor().unwrap().clone(),
        g.tensor(&[2, 3], -1.0, 1.0).as_tensor().unwrap().clone(),
    ]);
    check("stack", vec![pair], attrs(&[("axis", AttrValue::Int(1))]));
    let idx = OpValue::Tensor(Tensor::from_vec(vec![3], vec![1i32, 0, 5]).unwrap());
    check(
        "one_hot",
        vec![idx, g.tensor(&[], 0.5, 1.0), g.tensor(&[], -1.0, -0.5)],
        attrs(&[("depth", AttrValue::Int(4))]),
    );
    check(
        "broadcast_to",
        vec![g.tensor(&[3, 1], -1.0, 1.0)],
        attrs(&[("shape", ints(&[2, 3, 4]))]),
    );
    check(
        "squeeze",
        vec![g.tensor(&[2, 1, 3], -1.0, 1.0)],
        Attrs::default(),
    );
    // An embedding lookup with a repeated index: both rows' gradients land in one table row.
    let idx = OpValue::Tensor(Tensor::from_vec(vec![3], vec![4i32, 1, 4]).unwrap());
    check(
        "take",
        vec![g.tensor(&[5, 3], -1.0, 1.0), idx],
        attrs(&[("axis", AttrValue::Int(0))]),
    );
    let idx = OpValue::Tensor(Tensor::from_vec(vec![], vec![2i32]).unwrap());
    check(
        "take",
        vec![g.tensor(&[5], -1.0, 1.0), idx],
        attrs(&[("axis", AttrValue::Int(0))]),
    );
    check(
        "strided_slice",
        vec![g.tensor(&[4, 5], -1.0, 1.0)],
        attrs(&[
            ("begin", ints(&[1, 0])),
            ("end", ints(&[4, 5])),
            ("strides", ints(&[2, 2])),
        ]),
    );
}

#[test]
fn no_gradient_is_said() {
    let mut g = Gen(6);
    let x = g.tensor(&[2, 3], -1.0, 1.0);
    let at = attrs(&[("axis", AttrValue::Int(1))]);
    let out = run("argmax", std::slice::from_ref(&x), &at);
    let op = crate::lookup("argmax").unwrap();
    let e = vjp(op, &[x], &at, &out, &out).unwrap_err();
    assert!(
        e.message.contains("argmax: gradient: no gradient"),
        "{}",
        e.message
    );
    assert!(no_gradient(crate::lookup("greater").unwrap()).is_some());
    assert!(no_gradient(crate::lookup("tanh").unwrap()).is_none());
}

#[test]
fn scans_and_index_maps() {
    let mut g = Gen(7);
    for op in ["cumsum", "cumprod"] {
        check(
            op,
            vec![g.tensor(&[2, 4, 3], -1.5, 1.5)],
            attrs(&[("axis", AttrValue::Int(1))]),
        );
        check(
            op,
            vec![g.tensor(&[3, 4], -1.5, 1.5)],
            attrs(&[
                ("axis", AttrValue::Int(-1)),
                ("exclusive", AttrValue::Bool(true)),
            ]),
        );
        check(op, vec![g.tensor(&[2, 3], -1.5, 1.5)], Attrs::default());
    }
    // A zero in a product: the gradient of the other prefixes through it is not a division.
    let x = OpValue::Tensor(Tensor::from_vec(vec![4], vec![0.5, 0.0, -2.0, 1.5]).unwrap());
    check("cumprod", vec![x], Attrs::default());
    check(
        "reverse",
        vec![g.tensor(&[3, 4], -1.0, 1.0)],
        attrs(&[("axis", AttrValue::Int(-1))]),
    );
    check(
        "tile",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        attrs(&[("reps", ints(&[2, 1, 2]))]),
    );
    check(
        "repeat",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        attrs(&[("repeats", AttrValue::Int(2)), ("axis", AttrValue::Int(0))]),
    );
    check(
        "nn.batch_flatten",
        vec![g.tensor(&[2, 3, 2], -1.0, 1.0)],
        Attrs::default(),
    );
    // Index 2 read twice along axis 1: both gradients land in one element.
    let idx = OpValue::Tensor(Tensor::from_vec(vec![2, 2], vec![2i64, 0, 2, 2]).unwrap());
    check(
        "gather",
        vec![g.tensor(&[2, 3], -1.0, 1.0), idx],
        attrs(&[("axis", AttrValue::Int(1))]),
    );
    let idx = OpValue::Tensor(Tensor::from_vec(vec![2, 3], vec![1i32, 0, 1, 2, 2, 0]).unwrap());
    check(
        "gather_nd",
        vec![g.tensor(&[2, 3, 2], -1.0, 1.0), idx],
        Attrs::default(),
    );
    // Away from the points where the length jumps (here 4 elements).
    let s = |v: f64| OpValue::Tensor(Tensor::scalar_f64(v));
    check(
        "arange",
        vec![s(0.5), s(3.7), s(0.9)],
        attrs(&[("dtype", AttrValue::Str("float64".into()))]),
    );
}

#[test]
fn graph_operators() {
    let mut g = Gen(11);
    check(
        "nn.dropout",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        attrs(&[("rate", AttrValue::Float(0.3))]),
    );
    check(
        "nn.matmul",
        vec![
            g.tensor(&[2, 3, 4], -1.0, 1.0),
            g.tensor(&[4, 5], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "nn.matmul",
        vec![g.tensor(&[4, 3], -1.0, 1.0), g.tensor(&[5, 4], -1.0, 1.0)],
        attrs(&[
            ("transpose_a", AttrValue::Bool(true)),
            ("transpose_b", AttrValue::Bool(true)),
        ]),
    );
    check(
        "nn.matmul",
        vec![
            g.tensor(&[2, 4, 3], -1.0, 1.0),
            g.tensor(&[4, 5], -1.0, 1.0),
        ],
        attrs(&[("transpose_a", AttrValue::Bool(true))]),
    );
    check(
        "full_like",
        vec![g.tensor(&[2, 3], -1.0, 1.0), g.tensor(&[], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "reshape_like",
        vec![g.tensor(&[2, 6], -1.0, 1.0), g.tensor(&[3, 4], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "broadcast_to_like",
        vec![
            g.tensor(&[3, 1], -1.0, 1.0),
            g.tensor(&[2, 3, 4], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    check(
        "collapse_sum_like",
        vec![
            g.tensor(&[2, 3, 4], -1.0, 1.0),
            g.tensor(&[3, 1], -1.0, 1.0),
        ],
        Attrs::default(),
    );
    let lens = OpValue::Tensor(Tensor::from_vec(vec![3], vec![2i32, 0, 4]).unwrap());
    check(
        "sequence_mask",
        vec![g.tensor(&[4, 3, 2], -1.0, 1.0), lens.clone()],
        Attrs::default(),
    );
    check(
        "sequence_mask",
        vec![g.tensor(&[3, 5], -1.0, 1.0), lens],
        attrs(&[
            ("axis", AttrValue::Int(1)),
            ("mask_value", AttrValue::Float(-2.0)),
        ]),
    );
    check(
        "nn.prelu",
        vec![g.tensor(&[2, 3, 2], -1.0, 1.0), g.tensor(&[3], -1.0, 1.0)],
        Attrs::default(),
    );
    check(
        "nn.l2_normalize",
        vec![g.tensor(&[2, 3, 2], -1.0, 1.0)],
        attrs(&[("eps", AttrValue::Float(1e-12)), ("axis", ints(&[1]))]),
    );
    check(
        "nn.l2_normalize",
        vec![g.tensor(&[2, 3], -1.0, 1.0)],
        attrs(&[("eps", AttrValue::Float(1e-12))]),
    );
    // eps above every row's sum of squares: a constant divisor.
    check(
        "nn.l2_normalize",
        vec![g.tensor(&[2, 3], -0.1, 0.1)],
        attrs(&[("eps", AttrValue::Float(1.0)), ("axis", ints(&[1]))]),
    );
    let pw = |v: &[[i64; 2]]| AttrValue::List(v.iter().map(|p| ints(p)).collect());
    for mode in ["constant", "edge", "reflect"] {
        check(
            "nn.pad",
            vec![g.tensor(&[3, 4], -1.0, 1.0), g.tensor(&[], -1.0, 1.0)],
            attrs(&[
                ("pad_width", pw(&[[1, 2], [2, 1]])),
                ("pad_mode", AttrValue::Str(mode.into())),
            ]),
        );
    }
    check(
        "nn.pad",
        vec![g.tensor(&[3], -1.0, 1.0)],
        attrs(&[
            ("pad_width", pw(&[[1, 0]])),
            ("pad_value", AttrValue::Float(2.0)),
        ]),
    );
    for (center, scale) in [(true, true), (false, true), (true, false)] {
        check(
            "nn.batch_norm",
            vec![
                g.tensor(&[2, 3, 2], -1.0, 1.0),
                g.tensor(&[3], -1.0, 1.0),
                g.tensor(&[3], -1.0, 1.0),
                g.tensor(&[3], -1.0, 1.0),
                g.tensor(&[3], 0.5, 2.0),
            ],
            attrs(&[
                ("center", AttrValue::Bool(center)),
                ("scale", AttrValue::Bool(scale)),
            ]),
        );
    }
}
