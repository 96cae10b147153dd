//! Binding `@main`'s arguments: parameters from the file, instance arguments, random fills.

use std::collections::{BTreeMap, BTreeSet};

use tumble_io::{bind_params, random_param, Binding, BoundParams, IoError};
use tumble_ir::{DType, Dim, Ty};
use tumble_tensor::Tensor;

fn f32s(shape: &[i64]) -> Ty {
    Ty::tensor_of(shape, DType::Float32)
}

fn params() -> Vec<(String, Ty)> {
    vec![
        ("tree".into(), Ty::Adt("Tree".into(), vec![f32s(&[1])])),
        ("W_iou".into(), f32s(&[768, 256])),
        (
            "emb".into(),
            Ty::tensor(vec![Dim::Any, Dim::Known(4)], DType::Float32),
        ),
        ("b".into(), f32s(&[3])),
    ]
}

fn keys(ks: &[&str]) -> BTreeSet<String> {
    ks.iter().map(|s| s.to_string()).collect()
}

fn file(entries: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn err(r: Result<BoundParams, IoError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape.to_vec(), DType::Float32).unwrap()
}

#[test]
fn params_from_file_and_instances() {
    let f = file(vec![
        ("W_iou", zeros(&[768, 256])),
        ("emb", zeros(&[10, 4])),
        ("b", zeros(&[3])),
        ("unused", zeros(&[1])),
    ]);
    let bound = bind_params(&params(), &keys(&["tree"]), &f, None).unwrap();
    let kinds: Vec<(&str, bool)> = bound
        .args
        .iter()
        .map(|a| (a.name.as_str(), matches!(a.binding, Binding::Param(_))))
        .collect();
    assert_eq!(
        kinds,
        [("tree", false), ("W_iou", true), ("emb", true), ("b", true)]
    );
    assert_eq!(bound.instance_args().len(), 1);
    assert!(bound.generated.is_empty());
    assert_eq!(
        bound.warnings,
        ["the weights file has tensors that @main does not take: unused"]
    );
    let all = bound.assemble(vec![tumble_interp::Value::unit()]).unwrap();
    assert_eq!(all.len(), 4);
}

#[test]
fn shape_and_dtype_mismatch() {
    let f = file(vec![
        ("W_iou", zeros(&[768, 128])),
        ("emb", zeros(&[10, 4])),
        ("b", zeros(&[3])),
    ]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree"]), &f, None)),
        "parameter %W_iou: expected Tensor[(768, 256), float32], the file has Tensor[(768, 128), float32]"
    );
    let f = file(vec![
        ("W_iou", zeros(&[768, 256])),
        ("emb", Tensor::zeros([10, 4], DType::Float64).unwrap()),
        ("b", zeros(&[3])),
    ]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree"]), &f, None)),
        "parameter %emb: expected Tensor[(?, 4), float32], the file has Tensor[(10, 4), float64]"
    );
    // Rank mismatch is a shape mismatch too.
    let f = file(vec![
        ("W_iou", zeros(&[768, 256])),
        ("emb", zeros(&[4])),
        ("b", zeros(&[3])),
    ]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree"]), &f, None)),
        "parameter %emb: expected Tensor[(?, 4), float32], the file has Tensor[(4), float32]"
    );
}

#[test]
fn missing_parameter_lists_the_file() {
    let f = file(vec![
        ("W_iou", zeros(&[768, 256])),
        ("b", zeros(&[3])),
        ("Emb", zeros(&[2, 4])),
    ]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree"]), &f, None)),
        "missing parameter %emb: the weights file has: Emb, W_iou, b; did you mean `Emb` for \
         %emb? Or, for a per-instance input, add the key `emb` to every instance"
    );
    let f = file(vec![("W_iou", zeros(&[768, 256]))]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree"]), &f, None)),
        "missing parameters %emb, %b: the weights file has: W_iou; or, for per-instance \
         inputs, add the keys `emb`, `b` to every instance"
    );
    // `O` is %O's own tensor: no typo for %W or %U, however close the names.
    let wuo: Vec<(String, Ty)> = ["W", "U", "O"]
        .iter()
        .map(|n| (n.to_string(), f32s(&[3])))
        .collect();
    let f = file(vec![("O", zeros(&[3]))]);
    let msg = err(bind_params(&wuo, &keys(&[]), &f, None));
    assert!(msg.starts_with("missing parameters %W, %U"), "{msg}");
    assert!(!msg.contains("did you mean"), "{msg}");
    assert_eq!(
        err(bind_params(
            &params(),
            &keys(&["tree"]),
            &BTreeMap::new(),
            None
        )),
        "missing parameters %W_iou, %emb, %b (no weights: no weights file was given, or it \
         holds no tensors; pass --params FILE with these tensors, or --random-params SEED; or, \
         for per-instance inputs, add the keys `W_iou`, `emb`, `b` to every instance)"
    );
}

#[test]
fn non_tensor_arguments() {
    // Not in the instances and not a tensor: cannot be a parameter.
    assert_eq!(
        err(bind_params(
            &params(),
            &keys(&["x"]),
            &BTreeMap::new(),
            Some(1)
        )),
        "argument %tree: Tree[Tensor[(1), float32]] is not provided by the instances (they \
         provide: x); only tensors can come from a weights file, so every instance must have a \
         key `tree`"
    );
    let f = file(vec![("tree", zeros(&[1]))]);
    assert!(err(bind_params(&params(), &keys(&[]), &f, None))
        .contains("only tensor-typed arguments can be parameters"));
    // In both the file and the instances.
    let f = file(vec![("b", zeros(&[3]))]);
    assert_eq!(
        err(bind_params(&params(), &keys(&["tree", "b"]), &f, Some(0))),
        "argument %b is given twice: the weights file has a tensor `b` and the instances have a \
         key `b`; remove one of them"
    );
}

#[test]
fn random_params_are_deterministic_and_well_formed() {
    let ps = vec![
        ("tree".into(), Ty::Adt("Tree".into(), vec![f32s(&[1])])),
        ("W".into(), f32s(&[64, 256])),
        ("b".into(), Ty::tensor_of(&[5], DType::Float64)),
        ("s".into(), f32s(&[])),
        ("k".into(), Ty::tensor_of(&[2, 2], DType::Int32)),
    ];
    let a = bind_params(&ps, &keys(&["tree"]), &BTreeMap::new(), Some(42)).unwrap();
    let b = bind_params(&ps, &keys(&["tree"]), &BTreeMap::new(), Some(42)).unwrap();
    let c = bind_params(&ps, &keys(&["tree"]), &BTreeMap::new(), Some(43)).unwrap();
    assert_eq!(a.generated, b.generated);
    assert_ne!(a.generated["W"], c.generated["W"]);
    let names: Vec<&str> = a.generated.keys().map(String::as_str).collect();
    assert_eq!(names, ["W", "b", "k", "s"]);
    let w = &a.generated["W"];
    assert_eq!(
        (w.shape(), w.dtype()),
        (&[64usize, 256][..], DType::Float32)
    );
    // normal(0, 1) / sqrt(256): standard deviation about 1/16.
    let v = w.to_f64_vec();
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!(
        mean.abs() < 0.01 && (std - 1.0 / 16.0).abs() < 0.005,
        "{mean} {std}"
    );
    assert_eq!(a.generated["b"].dtype(), DType::Float64);
    assert_eq!(a.generated["s"].shape(), &[] as &[usize]);
    assert_eq!(
        a.generated["k"],
        Tensor::zeros([2, 2], DType::Int32).unwrap()
    );
    // A parameter's values do not depend on which others are generated.
    let f = file(vec![("b", Tensor::zeros([5], DType::Float64).unwrap())]);
    let d = bind_params(&ps, &keys(&["tree"]), &f, Some(42)).unwrap();
    assert_eq!(d.generated["W"], a.generated["W"]);
    assert!(!d.generated.contains_key("b"));
    match &d.args[1].binding {
        Binding::Param(t) => assert_eq!(t, &a.generated["W"]),
        Binding::Instance => panic!("W should be a parameter"),
    }
}

#[test]
fn random_param_needs_known_dims() {
    let e = random_param(
        "emb",
        &Ty::tensor(vec![Dim::Any, Dim::Known(4)], DType::Float32),
        1,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "parameter %emb: cannot generate random values for Tensor[(?, 4), float32]: dimension 0 \
         is `?`; give its size in @main's type of %emb, or provide the tensor in the weights file"
    );
    let e = random_param("huge", &f32s(&[1 << 20, 1 << 20]), 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("tumble generates at most"), "{e}");
}

/// `--random-params` makes up weights, not per-instance inputs: an integer argument missing from
/// the instances is bound to zeros with a warning (a label every instance lacked trained toward
/// class 0 silently), and one whose name is a typo of an instance key is an error naming both.
#[test]
fn random_params_warn_of_integer_fills_and_refuse_typos_of_instance_keys() {
    let ps = vec![
        ("x".to_string(), f32s(&[1, 4])),
        ("label".to_string(), Ty::tensor_of(&[], DType::Int32)),
        ("W".to_string(), f32s(&[3, 4])),
    ];
    let none = BTreeMap::new();
    let bound = bind_params(&ps, &keys(&["x"]), &none, Some(0)).unwrap();
    assert_eq!(bound.warnings.len(), 1, "{:?}", bound.warnings);
    assert!(
        bound.warnings[0].contains("%label") && bound.warnings[0].contains("add a key `label`"),
        "{}",
        bound.warnings[0]
    );
    let e = err(bind_params(&ps, &keys(&["x", "lable"]), &none, Some(0)));
    assert!(
        e.contains("`lable`") && e.contains("did you mean `label`"),
        "{e}"
    );
    // Float weights made up quietly, as before.
    let bound = bind_params(&ps, &keys(&["x", "label"]), &none, Some(0)).unwrap();
    assert!(bound.warnings.is_empty(), "{:?}", bound.warnings);
    // A float scalar is more likely a regression target than a weight: made up, with a warning.
    let ps = vec![
        ("x".to_string(), f32s(&[1, 4])),
        ("y".to_string(), f32s(&[])),
        ("W".to_string(), f32s(&[3, 4])),
    ];
    let bound = bind_params(&ps, &keys(&["x"]), &none, Some(0)).unwrap();
    assert_eq!(bound.warnings.len(), 1, "{:?}", bound.warnings);
    assert!(
        bound.warnings[0].contains("%y") && bound.warnings[0].contains("add a key `y`"),
        "{}",
        bound.warnings[0]
    );
}
