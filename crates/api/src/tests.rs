use super::*;
use serde_json::json;

/// Sums a list of rows through a weight: lists, tuples, ADTs and parameters in one small model.
const SRC: &str = r#"
def @main(%xs: List[Tensor[(1, 2), float32]], %w: Tensor[(2, 2), float32])
    -> (Tensor[(1, 2), float32], Option[Tensor[(1, 2), float32]]) {
  let %s = @foldl(fn (%acc: Tensor[(1, 2), float32], %x: Tensor[(1, 2), float32]) {
    add(%acc, nn.dense(%x, %w))
  }, zeros(shape=[1, 2], dtype="float32"), %xs);
  let %h = match (%xs) {
    Cons(%x, _) => Some(%x),
    Nil => None,
  };
  (%s, %h)
}
"#;

fn identity() -> Tensor {
    Tensor::from_vec(vec![2, 2], vec![1.0f32, 0.0, 0.0, 1.0]).unwrap()
}

fn model() -> Model {
    let params = Params {
        tensors: [("w".to_string(), identity())].into_iter().collect(),
        ..Params::default()
    };
    Model::load(
        Source::Text {
            name: "sum.rly",
            text: SRC,
        },
        &params,
        &LoadOptions::default(),
    )
    .unwrap()
}

fn opts() -> RunOptions {
    RunOptions {
        threads: Some(1),
        ..RunOptions::default()
    }
}

fn f32s(t: &OutTree) -> Vec<f32> {
    match t {
        OutTree::Tensor(t) => t.as_slice::<f32>().unwrap().to_vec(),
        other => panic!("not a tensor: {other:?}"),
    }
}

#[test]
fn runs_json_and_attached_tensors_alike() {
    let m = model();
    assert_eq!(m.inputs().len(), 1);
    assert_eq!(m.parameters()[0].name, "w");
    let json = instances_from_json(
        "test",
        vec![
            json!({"xs": [[[1.0, 2.0]], [[3.0, 4.0]]]}),
            json!({"xs": []}),
        ],
    );
    let row = Tensor::from_vec(vec![1, 2], vec![1.0f32, 2.0]).unwrap();
    let row2 = Tensor::from_vec(vec![1, 2], vec![3.0f32, 4.0]).unwrap();
    let attached = RawInstances {
        source_name: "test".into(),
        items: vec![RawInstance::with_tensors(
            Location::Index(0),
            json!({"xs": [{ATTACHED_TENSOR_KEY: 0}, {ATTACHED_TENSOR_KEY: 1}]}),
            vec![row, row2],
        )],
    };
    let (a, _) = m.run(&json, &opts()).unwrap();
    let (b, _) = m.run(&attached, &opts()).unwrap();
    assert_eq!(a[0], b[0]);
    let OutTree::Tuple(fields) = &a[0] else {
        panic!("not a tuple: {:?}", a[0]);
    };
    assert_eq!(f32s(&fields[0]), vec![4.0, 6.0]);
    assert!(matches!(&fields[1], OutTree::Ctor { name, .. } if name == "Some"));
    let OutTree::Tuple(empty) = &a[1] else {
        panic!("not a tuple");
    };
    assert!(
        matches!(&empty[1], OutTree::Ctor { name, fields } if name == "None" && fields.is_empty())
    );
}

#[test]
fn bad_instances_are_located() {
    let m = model();
    let bad = instances_from_json(
        "test",
        vec![json!({"xs": []}), json!({"xs": [[[1.0, "a"]]]})],
    );
    let e = m.run(&bad, &opts()).unwrap_err();
    assert_eq!(e.instance(), Some(1));
    assert!(matches!(e, Error::Input { .. }));
    assert!(e.message().contains("index 1: .xs[0][0][1]"), "{e}");
    let wrong_dtype = RawInstances {
        source_name: "test".into(),
        items: vec![RawInstance::with_tensors(
            Location::Index(0),
            json!({"xs": [{ATTACHED_TENSOR_KEY: 0}]}),
            vec![Tensor::from_vec(vec![1, 2], vec![1.0f64, 2.0]).unwrap()],
        )],
    };
    let e = m.run(&wrong_dtype, &opts()).unwrap_err();
    assert!(e.message().contains("float64 array of shape (1, 2)"), "{e}");
    assert!(e.message().contains(".astype(numpy.float32)"), "{e}");
    let missing_ref = RawInstances {
        source_name: "test".into(),
        items: vec![RawInstance::with_tensors(
            Location::Index(0),
            json!({"xs": [{ATTACHED_TENSOR_KEY: 3}]}),
            Vec::new(),
        )],
    };
    let e = m.run(&missing_ref, &opts()).unwrap_err();
    assert!(e.message().contains("does not have"), "{e}");
}

#[test]
fn load_errors_say_what_is_wrong() {
    let e = Model::load(
        Source::Text {
            name: "bad.rly",
            text: "def @main(%x: Tensor[(1), float32]) -> Tensor[(2), float32] { %x }",
        },
        &Params::default(),
        &LoadOptions::default(),
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::Check { .. }), "{e:?}");
    assert!(e.message().contains("bad.rly"), "{e}");
    let e = Model::load(
        Source::Text {
            name: "sum.rly",
            text: SRC,
        },
        &Params::default(),
        &LoadOptions {
            inputs: Some(vec!["xs".into()]),
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::Param { .. }), "{e:?}");
    assert!(e.message().contains("%w"), "{e}");
    let wrong_shape = Params {
        tensors: [(
            "w".to_string(),
            Tensor::from_vec(vec![3], vec![1.0f32, 2.0, 3.0]).unwrap(),
        )]
        .into_iter()
        .collect(),
        ..Params::default()
    };
    let e = Model::load(
        Source::Text {
            name: "sum.rly",
            text: SRC,
        },
        &wrong_shape,
        &LoadOptions::default(),
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::Param { .. }), "{e:?}");
}

#[test]
fn random_params_fill_tensor_arguments() {
    let m = Model::load(
        Source::Text {
            name: "sum.rly",
            text: SRC,
        },
        &Params {
            random_seed: Some(0),
            ..Params::default()
        },
        &LoadOptions::default(),
    )
    .unwrap();
    let p = m.parameters();
    assert_eq!(p.len(), 1);
    assert!(p[0].generated);
    assert_eq!(p[0].shape, vec![2, 2]);
    assert!(m.check().contains("@main:"));
    assert!(m.explain().contains("kernel plan"));
}

#[test]
fn models_are_shared_between_threads() {
    fn shared<T: Send + Sync>(_: &T) {}
    let m = model();
    shared(&m);
    let inst = instances_from_json("test", vec![json!({"xs": [[[1.0, 2.0]]]}); 8]);
    let outs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| m.run(&inst, &opts()).unwrap().0))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0].len(), 8);
}

#[test]
fn bad_options_are_errors() {
    let m = model();
    let inst = instances_from_json("test", vec![json!({"xs": []})]);
    for o in [
        RunOptions {
            batch: Some(0),
            ..opts()
        },
        RunOptions {
            threads: Some(0),
            ..opts()
        },
        RunOptions {
            workers: Some(0),
            ..opts()
        },
    ] {
        assert!(matches!(m.run(&inst, &o), Err(Error::Usage { .. })));
    }
    assert!(scheduler("depth").is_ok());
    assert!(scheduler("fifo").is_err());
}

/// A continuous-batching session's launches read the job's packed weights: none packs a weight
/// outside the job's cache (before the twenty-eighth session every launch of a session packed
/// its weights again — serving's GEMMs repacked a 3 MB weight per launch).
#[test]
fn session_launches_use_the_jobs_packed_weights() {
    let m = model();
    let json = instances_from_json(
        "test",
        vec![
            json!({"xs": [[[1.0, 2.0]], [[3.0, 4.0]]]}),
            json!({"xs": [[[5.0, 6.0]]]}),
        ],
    );
    let (want, _) = m.run(&json, &opts()).unwrap();
    let mut s = m.session(&opts()).unwrap();
    for i in 0..2 {
        s.admit(&json, i).unwrap();
    }
    let before = tumble_runtime::uncached_packs();
    let mut got = Vec::new();
    for _ in 0..100 {
        got.extend(s.step());
        if s.is_idle() {
            break;
        }
    }
    assert_eq!(tumble_runtime::uncached_packs(), before);
    assert_eq!(got.len(), 2);
    let first = got
        .iter()
        .find(|(t, _)| t.0 == 0)
        .map(|(_, r)| r.as_ref().unwrap().clone());
    assert!(first.is_some_and(|line| line.contains("4")), "{got:?}");
    assert_eq!(want.len(), 2);
}

/// A weights file large enough to be read on several threads (16 MiB and more) loads the same
/// tensors on one thread and on three: the model gives the same bits either way.
#[test]
fn weights_read_on_threads_give_the_same_model() {
    const SRC_BIG: &str = r#"
def @main(%tok: Tensor[(1), int32], %emb: Tensor[(1048576, 4), float32],
          %w: Tensor[(3, 4), float32], %b: Tensor[(3), float32]) -> Tensor[(1, 3), float32] {
  nn.bias_add(nn.dense(take(%emb, %tok, axis=0), %w), %b)
}
"#;
    let emb: Vec<f32> = (0..1_048_576usize * 4)
        .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let tensors: BTreeMap<String, Tensor> = [
        ("emb", Tensor::from_vec(vec![1_048_576, 4], emb).unwrap()),
        (
            "w",
            Tensor::from_vec(vec![3, 4], (0..12).map(|i| i as f32 * 0.5).collect()).unwrap(),
        ),
        (
            "b",
            Tensor::from_vec(vec![3], vec![0.25f32, -1.0, 2.0]).unwrap(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let dir = std::env::temp_dir().join(format!("tumble_api_threads_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.safetensors");
    tumble_io::save_params(&path, &tensors).unwrap();
    assert!(std::fs::metadata(&path).unwrap().len() >= 16 << 20);
    let instances = instances_from_json(
        "test",
        vec![
            json!({"tok": [0]}),
            json!({"tok": [777_777]}),
            json!({"tok": [1_048_575]}),
        ],
    );
    let outputs = |threads| {
        let params = Params {
            file: Some(path.clone()),
            ..Params::default()
        };
        let m = Model::load(
            Source::Text {
                name: "big.rly",
                text: SRC_BIG,
            },
            &params,
            &LoadOptions {
                threads: Some(threads),
                ..LoadOptions::default()
            },
        )
        .unwrap();
        m.run(&instances, &opts()).unwrap().0
    };
    let one = outputs(1);
    assert_eq!(one, outputs(3));
    // The rows the instances picked, through the weights: what both must have read.
    let emb_row = |r: usize| -> Vec<f32> {
        (0..4)
            .map(|j| (((r * 4 + j) * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect()
    };
    let expect: Vec<f32> = (0..3)
        .map(|o| {
            let x = emb_row(777_777);
            [0.25f32, -1.0, 2.0][o] + (0..4).map(|j| x[j] * (o * 4 + j) as f32 * 0.5).sum::<f32>()
        })
        .collect();
    let got = f32s(&one[1]);
    for (g, e) in got.iter().zip(&expect) {
        assert!(
            (g - e).abs() <= 1e-4 * e.abs().max(1.0),
            "{got:?} against {expect:?}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
