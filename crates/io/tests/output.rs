//! Results out: JSON encoding by type, summaries, atomic JSON Lines files.

mod common;

use common::module;
use tumble_interp::{Closure, Value};
use tumble_io::{encode_json, read_instances, summarize, write_jsonl_atomically, IoError};
use tumble_ir::{DType, Ty};
use tumble_tensor::Tensor;

const SRC: &str = r#"
type Pair {
  MkPair(Tensor[(2), float32], Tensor[(), int32]),
}

def @main(%r: (Tree[Tensor[(1), int32]], List[Option[Pair]], Tensor[(2, 2), bool], Tensor[(), float64]))
    -> (Tree[Tensor[(1), int32]], List[Option[Pair]], Tensor[(2, 2), bool], Tensor[(), float64]) {
  %r
}
"#;

fn t(v: Tensor) -> Value {
    Value::Tensor(v)
}

#[test]
fn nested_adts_and_tuples() {
    let m = module(SRC);
    let (params, ret) = m.main();
    let (rose, cons, nil) = (m.ctor("Rose"), m.ctor("Cons"), m.ctor("Nil"));
    let (some, none, pair) = (m.ctor("Some"), m.ctor("None"), m.ctor("MkPair"));
    let leaf = |x: i32| {
        Value::adt(
            rose,
            vec![
                t(Tensor::from_i32([1], vec![x]).unwrap()),
                Value::adt(nil, vec![]),
            ],
        )
    };
    let tree = Value::adt(
        rose,
        vec![
            t(Tensor::from_i32([1], vec![1]).unwrap()),
            Value::adt(
                cons,
                vec![
                    leaf(2),
                    Value::adt(cons, vec![leaf(3), Value::adt(nil, vec![])]),
                ],
            ),
        ],
    );
    let p = Value::adt(
        pair,
        vec![
            t(Tensor::from_f32([2], vec![0.1, 1.0]).unwrap()),
            t(Tensor::scalar_i32(-7)),
        ],
    );
    let opts = Value::adt(
        cons,
        vec![
            Value::adt(some, vec![p]),
            Value::adt(
                cons,
                vec![Value::adt(none, vec![]), Value::adt(nil, vec![])],
            ),
        ],
    );
    let v = Value::tuple(vec![
        tree,
        opts,
        t(Tensor::from_bool([2, 2], vec![true, false, false, true]).unwrap()),
        t(Tensor::scalar_f64(1e-7)),
    ]);
    let enc = encode_json(&v, &ret, &m.env()).unwrap();
    assert_eq!(
        enc.json,
        r#"[{"Rose":[[1],[{"Rose":[[2],[]]},{"Rose":[[3],[]]}]]},[{"Some":[{"MkPair":[[0.1,1.0],-7]}]},{"None":[]}],[[true,false],[false,true]],1e-7]"#
    );
    assert_eq!(enc.non_finite, 0);
    assert_eq!(enc.warning(), None);

    // What is written reads back as the same value (the instance format is the output format).
    let line = format!("{{\"r\": {}}}", enc.json);
    let raw = read_instances(line.as_bytes(), "out.jsonl").unwrap();
    let back = raw.decode(&m.env(), &params).unwrap();
    assert_eq!(encode_json(&back[0][0], &ret, &m.env()).unwrap(), enc);

    let s = summarize(&v, &ret, &m.env());
    assert_eq!(
        s,
        "(Rose(int32 (1,) [1], list of 2 [Rose(int32 (1,) [2], list of 0 []), Rose(int32 (1,) [3], \
         list of 0 [])]), list of 2 [Some(MkPair(float32 (2,) [0.1000, 1.0000], int32 () -7)), \
         None], bool (2, 2) [true, false, false, true], float64 () 0.0000)"
    );
}

#[test]
fn tensors_floats_and_non_finite() {
    let m = module(SRC);
    let env = m.env();
    let ty = Ty::tensor_of(&[2, 3], DType::Float32);
    let x = Tensor::from_f32([2, 3], vec![0.1, f32::NAN, 3.0, 1e30, f32::INFINITY, -0.0]).unwrap();
    let enc = encode_json(&t(x), &ty, &env).unwrap();
    assert_eq!(enc.json, "[[0.1,null,3.0],[1e30,null,-0.0]]");
    assert_eq!(enc.non_finite, 2);
    assert_eq!(
        enc.warning().unwrap(),
        "the result has 2 NaN or infinite values, written as null"
    );
    // f32 shortest round trip: 0.1f32 is printed as 0.1, not 0.10000000149011612.
    let enc = encode_json(
        &t(Tensor::scalar_f32(0.1)),
        &Ty::scalar(DType::Float32),
        &env,
    )
    .unwrap();
    assert_eq!(enc.json, "0.1");
    // Empty tensors keep their nesting.
    let e = Tensor::from_i64([2, 0], vec![]).unwrap();
    let enc = encode_json(&t(e), &Ty::tensor_of(&[2, 0], DType::Int64), &env).unwrap();
    assert_eq!(enc.json, "[[],[]]");
    let e = Tensor::from_i64([0, 3], vec![]).unwrap();
    let enc = encode_json(&t(e), &Ty::tensor_of(&[0, 3], DType::Int64), &env).unwrap();
    assert_eq!(enc.json, "[]");
    // Brackets over every rank, each element type written row by row.
    let cases: [(Tensor, &str); 5] = [
        (
            Tensor::from_f32([2, 2, 2], vec![1.5, -2.0, 0.25, 1e-5, 3.0, 4.0, 5.0, 6.0]).unwrap(),
            "[[[1.5,-2.0],[0.25,1e-5]],[[3.0,4.0],[5.0,6.0]]]",
        ),
        (
            Tensor::from_i32([2, 1, 3], vec![1, -2, 3, 4, 5, -6]).unwrap(),
            "[[[1,-2,3]],[[4,5,-6]]]",
        ),
        (
            Tensor::from_bool([3, 1], vec![true, false, true]).unwrap(),
            "[[true],[false],[true]]",
        ),
        (Tensor::from_i64([1], vec![-9]).unwrap(), "[-9]"),
        (
            Tensor::from_f32([1, 1, 1, 2], vec![0.33333334, f32::NEG_INFINITY]).unwrap(),
            "[[[[0.33333334,null]]]]",
        ),
    ];
    for (x, want) in cases {
        let dims: Vec<i64> = x.shape().iter().map(|&d| d as i64).collect();
        let ty = Ty::tensor_of(&dims, x.dtype());
        assert_eq!(encode_json(&t(x), &ty, &env).unwrap().json, want);
    }
    // Long tensors summarize with a count.
    let big = Tensor::from_i32([10], (0..10).collect()).unwrap();
    assert_eq!(
        summarize(&t(big), &Ty::tensor_of(&[10], DType::Int32), &env),
        "int32 (10,) [0, 1, 2, 3, 4, 5, … (10 values)]"
    );
}

#[test]
fn closures_cannot_be_encoded() {
    let m = module(SRC);
    let f = Value::Closure(std::rc::Rc::new(Closure::Global(0)));
    let ty = Ty::Func(vec![], Box::new(Ty::unit()));
    let e = encode_json(&f, &ty, &m.env()).unwrap_err().to_string();
    assert_eq!(
        e,
        "cannot write the result: it contains a function (fn () -> ()), which has no JSON form; \
         return data (tensors, tuples, lists, constructors) from @main"
    );
    // A value that does not match its type is reported, not a panic.
    let e = encode_json(&Value::unit(), &Ty::scalar(DType::Int32), &m.env()).unwrap_err();
    assert!(
        e.to_string().contains("holds a tuple where its type says"),
        "{e}"
    );
}

#[test]
fn deep_values_encode_without_recursion() {
    // 200,000 levels of tree and a 200,000-element list, on the default test thread stack.
    let m = module(SRC);
    let (rose, cons, nil) = (m.ctor("Rose"), m.ctor("Cons"), m.ctor("Nil"));
    let n = 200_000;
    let mut tree = Value::adt(
        rose,
        vec![
            t(Tensor::from_i32([1], vec![0]).unwrap()),
            Value::adt(nil, vec![]),
        ],
    );
    for _ in 0..n {
        let kids = Value::adt(cons, vec![tree, Value::adt(nil, vec![])]);
        tree = Value::adt(rose, vec![t(Tensor::from_i32([1], vec![1]).unwrap()), kids]);
    }
    let ty = Ty::Adt("Tree".into(), vec![Ty::tensor_of(&[1], DType::Int32)]);
    let enc = encode_json(&tree, &ty, &m.env()).unwrap();
    assert_eq!(enc.json.matches("Rose").count(), n + 1);
    let s = summarize(&tree, &ty, &m.env());
    assert!(s.len() < 1000 && s.contains('…'), "{s}");
    drop(tree);

    let mut list = Value::adt(nil, vec![]);
    for i in 0..n {
        list = Value::adt(cons, vec![t(Tensor::scalar_i32(i as i32)), list]);
    }
    let ty = Ty::Adt("List".into(), vec![Ty::scalar(DType::Int32)]);
    let enc = encode_json(&list, &ty, &m.env()).unwrap();
    assert!(enc.json.starts_with(&format!("[{},{}", n - 1, n - 2)));
    assert!(enc.json.ends_with(",1,0]"));
    assert!(summarize(&list, &ty, &m.env()).starts_with("list of 200000 [int32 () 199999,"));
}

fn dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tumble-io-out-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn files_in(d: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn atomic_jsonl() {
    let d = dir("atomic");
    let path = d.join("out.jsonl");
    let n = write_jsonl_atomically(&path, ["[1]", "[2]"].map(Ok::<_, IoError>)).unwrap();
    assert_eq!(n, 2);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "[1]\n[2]\n");

    // An error half-way: the old file is untouched and no temp file is left behind.
    let lines = vec![
        Ok("[3]".to_string()),
        Err(IoError::Output {
            message: "instance 2 failed".into(),
        }),
        Ok("[4]".to_string()),
    ];
    let e = write_jsonl_atomically(&path, lines).unwrap_err();
    assert_eq!(e.to_string(), "cannot write the result: instance 2 failed");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "[1]\n[2]\n");
    assert_eq!(files_in(&d), ["out.jsonl"]);

    // A new file that fails: nothing at all is created.
    let fresh = d.join("fresh.jsonl");
    let lines = vec![
        Ok("[1]".to_string()),
        Err(IoError::Output {
            message: "x".into(),
        }),
    ];
    assert!(write_jsonl_atomically(&fresh, lines).is_err());
    assert!(!fresh.exists());
    assert_eq!(files_in(&d), ["out.jsonl"]);

    // A line with a newline would corrupt JSON Lines.
    assert!(write_jsonl_atomically(&fresh, [Ok::<_, IoError>("1\n2")]).is_err());
    assert!(!fresh.exists());

    // A directory that does not exist: an error naming the path.
    let e = write_jsonl_atomically(&d.join("no/out.jsonl"), [Ok::<_, IoError>("1")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no/out.jsonl"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A tensor of another dtype or rank than the declared result is an error in both encoders (a
/// compiled file altered to return another node printed floats where `@main` says int32); under
/// gradual shapes a size may differ, and is written as computed.
#[test]
fn results_of_another_dtype_or_rank_are_refused_not_written() {
    let m = module(SRC);
    let env = m.env();
    let int1 = Ty::tensor_of(&[1], DType::Int32);
    let floats = t(Tensor::from_f32([1, 5], vec![0.5; 5]).unwrap());
    for (v, what) in [
        (floats, "a tensor of dtype float32 and shape [1, 5]"),
        (
            t(Tensor::from_i32([1, 1], vec![3]).unwrap()),
            "a tensor of dtype int32 and shape [1, 1]",
        ),
    ] {
        let e = encode_json(&v, &int1, &env).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("Tensor[(1), int32]"), "{e}");
        let e = tumble_io::to_tree(&v, &int1, &env).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
    let other_size = t(Tensor::from_i32([4], vec![1, 2, 3, 4]).unwrap());
    assert_eq!(
        encode_json(&other_size, &int1, &env).unwrap().json,
        "[1,2,3,4]"
    );
}
