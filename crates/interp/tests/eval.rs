//! The reference interpreter on small programs with known results, and on deep recursion.

use tumble_check::{load, LoadOptions};
use tumble_interp::{run, Program, Value};
use tumble_ir::SourceMap;
use tumble_tensor::{Rng, Tensor};

fn program(src: &str) -> Program {
    let mut sources = SourceMap::new();
    let typed = match load(&mut sources, "t.rly", src, LoadOptions::default()) {
        Ok(t) => t,
        Err(ds) => panic!("{}", tumble_ir::diag::render(&ds, &sources, false)),
    };
    match Program::lower(&typed) {
        Ok(p) => p,
        Err(e) => panic!("lowering failed: {}", e.message),
    }
}

fn eval(src: &str, args: Vec<Value>) -> Value {
    let p = program(src);
    let mut rng = Rng::new(7);
    match run(&p, "main", args, &mut rng) {
        Ok(v) => v,
        Err(e) => panic!("run failed: {}", e.message),
    }
}

fn tensor(v: &Value) -> &Tensor {
    match v {
        Value::Tensor(t) => t,
        other => panic!("expected a tensor, got {other:?}"),
    }
}

fn scalar_i64(v: &Value) -> i64 {
    match tensor(v).scalar_as_i64() {
        Ok(x) => x,
        Err(e) => panic!("{e}"),
    }
}

fn f32s(v: &Value) -> Vec<f32> {
    tensor(v).as_f32().map(<[f32]>::to_vec).unwrap_or_default()
}

/// Builds `Cons(x0, Cons(x1, ... Nil))` from the end, as a caller decoding JSON would.
fn int_list(p: &Program, n: usize) -> Value {
    let (cons, nil) = (p.ctor_index["Cons"], p.ctor_index["Nil"]);
    let mut list = Value::adt(nil, Vec::new());
    for i in (0..n).rev() {
        list = Value::adt(
            cons,
            vec![Value::Tensor(Tensor::scalar_i32(i as i32)), list],
        );
    }
    list
}

#[test]
fn arithmetic_lets_and_tuples() {
    let v = eval(
        "def @main() { let %a = 2; let %b = %a * 3 + 1; (%b, %b - 10) }",
        Vec::new(),
    );
    let Value::Tuple(t) = v else {
        panic!("not a tuple")
    };
    assert_eq!(scalar_i64(&t.0[0]), 7);
    assert_eq!(scalar_i64(&t.0[1]), -3);
}

#[test]
fn dense_bias_and_activation_match_hand_computation() {
    let x = Tensor::from_f32([1, 2], vec![1.0, 2.0]).unwrap();
    let w = Tensor::from_f32([2, 2], vec![1.0, 0.0, 0.5, -1.0]).unwrap();
    let v = eval(
        "def @main(%x: Tensor[(1, 2), float32], %w: Tensor[(2, 2), float32]) {
           nn.relu(nn.dense(%x, %w))
         }",
        vec![Value::Tensor(x), Value::Tensor(w)],
    );
    // rows of w: [1, 0] · [1, 2] = 1; [0.5, -1] · [1, 2] = -1.5 → relu → 0
    assert_eq!(f32s(&v), vec![1.0, 0.0]);
}

#[test]
fn closures_capture_and_let_bound_functions_recurse() {
    let v = eval(
        "def @main() {
           let %k = 10;
           let %add_k = fn (%x: Tensor[(), int32]) { %x + %k };
           let %count = fn (%n: Tensor[(), int32]) -> Tensor[(), int32] {
             if (%n == 0) { 0 } else { %add_k(%count(%n - 1)) }
           };
           %count(5)
         }",
        Vec::new(),
    );
    assert_eq!(scalar_i64(&v), 50);
}

#[test]
fn prelude_map_and_foldl() {
    let src = "def @main(%xs: List[Tensor[(), int32]]) {
                 @foldl(fn (%acc, %x) { %acc + %x }, 0, @map(fn (%x) { %x * 2 }, %xs))
               }";
    let p = program(src);
    let mut rng = Rng::new(0);
    let v = run(&p, "main", vec![int_list(&p, 10)], &mut rng).unwrap();
    assert_eq!(scalar_i64(&v), 90);
}

#[test]
fn a_100000_element_list_does_not_overflow_the_stack() {
    let src = "def @len(%xs: List[Tensor[(), int32]]) -> Tensor[(), int32] {
                 match (%xs) { Cons(_, %t) => 1 + @len(%t), Nil => 0 }
               }
               def @main(%xs: List[Tensor[(), int32]]) {
                 let %m = @map(fn (%x) { %x + 1 }, %xs);
                 (@len(%m), @length(@rev(%m)))
               }";
    let p = program(src);
    let mut rng = Rng::new(0);
    let v = run(&p, "main", vec![int_list(&p, 100_000)], &mut rng).unwrap();
    let Value::Tuple(t) = v else {
        panic!("not a tuple")
    };
    assert_eq!(scalar_i64(&t.0[0]), 100_000);
    assert_eq!(scalar_i64(&t.0[1]), 100_000);
}

#[test]
fn a_100000_node_degenerate_tree_does_not_overflow_the_stack() {
    let src = "def @depth(%t: Tree[Tensor[(), int32]]) -> Tensor[(), int32] {
                 match (%t) {
                   Rose(_, Nil) => 1,
                   Rose(_, Cons(%k, _)) => 1 + @depth(%k),
                 }
               }
               def @main(%t: Tree[Tensor[(), int32]]) { (@depth(%t), @size(%t)) }";
    let p = program(src);
    let (rose, cons, nil) = (
        p.ctor_index["Rose"],
        p.ctor_index["Cons"],
        p.ctor_index["Nil"],
    );
    let mut tree = Value::adt(
        rose,
        vec![
            Value::Tensor(Tensor::scalar_i32(0)),
            Value::adt(nil, vec![]),
        ],
    );
    for i in 1..100_000 {
        let kids = Value::adt(cons, vec![tree, Value::adt(nil, vec![])]);
        tree = Value::adt(rose, vec![Value::Tensor(Tensor::scalar_i32(i)), kids]);
    }
    let mut rng = Rng::new(0);
    let v = run(&p, "main", vec![tree], &mut rng).unwrap();
    let Value::Tuple(t) = v else {
        panic!("not a tuple")
    };
    assert_eq!(scalar_i64(&t.0[0]), 100_000);
    assert_eq!(scalar_i64(&t.0[1]), 100_000);
}

#[test]
fn partial_match_failure_is_a_located_error() {
    let p = program("def @main(%xs: List[Tensor[(), int32]]) { @hd(%xs) }");
    let mut rng = Rng::new(0);
    let nil = Value::adt(p.ctor_index["Nil"], Vec::new());
    let err = run(&p, "main", vec![nil], &mut rng)
        .err()
        .map(|e| e.into_info().message);
    assert!(err.is_some_and(|m| m.contains("no arm")));
}

#[test]
fn run_time_shape_errors_from_unknown_dims_are_reported() {
    let p = program(
        "def @main(%x: Tensor[(1, ?), float32], %w: Tensor[(4, 3), float32]) { nn.dense(%x, %w) }",
    );
    let mut rng = Rng::new(0);
    let x = Tensor::from_f32([1, 5], vec![0.0; 5]).unwrap();
    let w = Tensor::from_f32([4, 3], vec![0.0; 12]).unwrap();
    let err = run(
        &p,
        "main",
        vec![Value::Tensor(x), Value::Tensor(w)],
        &mut rng,
    )
    .err()
    .map(|e| (e.message.clone(), e.span.is_some()));
    assert_eq!(
        err,
        Some((
            "nn.dense: input has 5 columns but weight expects 3".to_string(),
            true
        ))
    );
}

#[test]
fn random_draws_are_seeded() {
    let src =
        "def @main() { random.db_uniform(low=0, high=100, out_shape=[8], out_dtype=\"int32\") }";
    let p = program(src);
    let draw = |seed| {
        let mut rng = Rng::new(seed);
        run(&p, "main", Vec::new(), &mut rng)
            .map(|v| tensor(&v).to_f64_vec())
            .unwrap()
    };
    assert_eq!(draw(3), draw(3));
    assert_ne!(draw(3), draw(4));
    assert!(draw(3).iter().all(|&x| (0.0..100.0).contains(&x)));
}
