//! Programs the checker must accept, with the types it must infer.

use tumble_check::{display_sig, load, LoadOptions, TypedModule};
use tumble_ir::{visit, SourceMap, Ty};

fn check(src: &str) -> TypedModule {
    let mut sources = SourceMap::new();
    match load(&mut sources, "t.rly", src, LoadOptions::default()) {
        Ok(m) => m,
        Err(ds) => panic!("{}", tumble_ir::diag::render(&ds, &sources, false)),
    }
}

fn sig(m: &TypedModule, name: &str) -> String {
    m.globals
        .get(name)
        .map(display_sig)
        .unwrap_or_else(|| format!("no global @{name}"))
}

/// Every type slot of a checked module is filled and free of inference variables.
fn assert_fully_typed(m: &TypedModule) {
    let mut module = m.module.clone();
    let mut bad = 0;
    visit::walk_types_mut(&mut module, &mut |t: &mut Ty| {
        if !t.is_resolved() {
            bad += 1;
        }
    });
    assert_eq!(bad, 0, "unresolved types remain");
    visit::walk_exprs_mut(&mut module, &mut |e| {
        assert!(e.ty.is_some(), "untyped {e:?}")
    });
}

/// A module's own definitions replace the prelude's of their names, and the prelude's items
/// that depend on a replaced one go with it: TVM prints every definition of a module that
/// imported its Prelude, and its examples define `List` and `@length` themselves (both were
/// "defined twice").
#[test]
fn a_module_s_definitions_replace_the_prelude_s() {
    let m = check(
        "def @length(%l: List[int32]) -> int32 {\n  match (%l) { Cons(_, %r) => 1 + @length(%r), Nil => 0 }\n}",
    );
    assert_eq!(
        sig(&m, "length"),
        "fn (List[Tensor[(), int32]]) -> Tensor[(), int32]"
    );
    assert_eq!(sig(&m, "map"), "fn [A, B](fn (A) -> B, List[A]) -> List[B]");
    let m = check(
        "type List[A] { Cons(A, List[A]), Nil, Snoc(List[A], A) }\n\
         def @f(%x: int32) -> List[int32] { Snoc(Nil, %x) }",
    );
    assert_eq!(
        sig(&m, "f"),
        "fn (Tensor[(), int32]) -> List[Tensor[(), int32]]"
    );
    // The prelude's `@map` was written for its own `List`: gone with it; `Option` stays.
    assert_eq!(sig(&m, "map"), "no global @map");
    assert!(m.module.type_defs().any(|t| t.name.name == "Option"));
    assert_fully_typed(&m);
}

/// What the replacement of prelude items leaves a reader: an unknown global the prelude left out
/// says why, and a constructor that takes an operator's name over is warned of.
#[test]
fn replaced_prelude_items_and_shadowed_operators_are_explained() {
    let mut sources = SourceMap::new();
    let src = "def @map(%f: fn (int32) -> int32, %x: int32) -> int32 { %f(%x) }\n\
               def @main(%l: List[int32]) -> int32 { @size(%l) }";
    let Err(ds) = load(&mut sources, "t.rly", src, LoadOptions::default()) else {
        panic!("@size was not left out");
    };
    let text = tumble_ir::diag::render(&ds, &sources, false);
    assert!(
        text.contains("unknown global `@size`")
            && text.contains("the prelude's `@size` was left out: it depends on `@map`"),
        "{text}"
    );
    let Err(ds) = load(
        &mut sources,
        "r.rly",
        "def @f(%x: int32) { ref(%x) }",
        LoadOptions::default(),
    ) else {
        panic!("ref was taken");
    };
    let text = tumble_ir::diag::render(&ds, &sources, false);
    assert!(
        text.contains("mutable references are not supported"),
        "{text}"
    );
    let m = check("type shape_t { tanh(Tensor[(2), float32]), nothing }\ndef @f(%x: Tensor[(2), float32]) { tanh(%x) }");
    assert_eq!(sig(&m, "f"), "fn (Tensor[(2), float32]) -> shape_t");
    assert!(
        m.warnings.iter().any(|w| w
            .message
            .contains("constructor `tanh` has an operator's name")),
        "{:?}",
        m.warnings
    );
}

/// An operator passed as a value (Relay allows it) is a function of its positional arguments,
/// typed by its use.
/// A generic global without a written return type (TVM's prelude writes `@compose` so) gets
/// the type its body has, in terms of its type parameters, before any use: each use
/// instantiates it afresh (one variable shared by every use typed `@d(@d(%x))` as `(A, A)`).
#[test]
fn a_generic_return_type_is_inferred_from_the_body() {
    let m = check(
        "def @d[A](%x: A) { (%x, %x) }\n\
         def @compose[A, B, C](%f: fn(B) -> C, %g: fn(A) -> B) { fn (%x: A) -> C { %f(%g(%x)) } }\n\
         def @main(%x: Tensor[(), int32], %y: Tensor[(2), float32]) {\n\
           let %inc = fn (%v: Tensor[(2), float32]) { %v + 1f };\n\
           (@d(@d(%x)), @d(%y), @compose(%inc, %inc)(%y))\n\
         }",
    );
    assert_eq!(sig(&m, "d"), "fn [A](A) -> (A, A)");
    assert_eq!(
        sig(&m, "compose"),
        "fn [A, B, C](fn (B) -> C, fn (A) -> B) -> fn (A) -> C"
    );
    assert_eq!(
        sig(&m, "main"),
        "fn (Tensor[(), int32], Tensor[(2), float32]) -> (((Tensor[(), int32], Tensor[(), int32]), \
         (Tensor[(), int32], Tensor[(), int32])), (Tensor[(2), float32], Tensor[(2), float32]), \
         Tensor[(2), float32])"
    );
    assert_fully_typed(&m);
}

/// TVM's generic closure `fn [A](%y: A) -> A`: its type parameters are its own inference
/// variables (one type per closure, which its uses determine), seen by the closures inside it.
#[test]
fn a_closure_s_type_parameters_are_inferred() {
    let m = check(
        "def @main(%x: Tensor[(3), float32]) {\n\
           %0 = fn [A](%y: A) -> (A, A) { (%y, %y) };\n\
           let %f = fn [B](%l: List[B]) -> List[B] { @map(fn (%e: B) -> B { %e }, %l) };\n\
           (%0(%x), %f(Cons(%x, Nil)))\n\
         }",
    );
    assert_eq!(
        sig(&m, "main"),
        "fn (Tensor[(3), float32]) -> ((Tensor[(3), float32], Tensor[(3), float32]), \
         List[Tensor[(3), float32]])"
    );
    assert_fully_typed(&m);
}

#[test]
fn operators_passed_as_values_are_functions() {
    let m = check(
        "def @f(%xs: List[Tensor[(2), float32]]) { @map(sigmoid, %xs) }\n\
         def @g(%x: Tensor[(2), float32], %xs: List[Tensor[(2), float32]]) { @foldl(add, %x, %xs) }",
    );
    assert_eq!(
        sig(&m, "f"),
        "fn (List[Tensor[(2), float32]]) -> List[Tensor[(2), float32]]"
    );
    assert_eq!(
        sig(&m, "g"),
        "fn (Tensor[(2), float32], List[Tensor[(2), float32]]) -> Tensor[(2), float32]"
    );
    assert_fully_typed(&m);
}

#[test]
fn the_prelude_checks_on_its_own() {
    let m = check("");
    assert_eq!(sig(&m, "map"), "fn [A, B](fn (A) -> B, List[A]) -> List[B]");
    assert_fully_typed(&m);
}

#[test]
fn dense_and_bias_shapes_flow_through_lets() {
    let m = check(
        "def @cell(%x: Tensor[(1, 256), float32], %w: Tensor[(512, 256), float32], %b: Tensor[(512), float32]) {
           let %h = nn.dense(%x, %w);
           let %y = nn.bias_add(%h, %b);
           tanh(%y)
         }",
    );
    assert_eq!(
        sig(&m, "cell"),
        "fn (Tensor[(1, 256), float32], Tensor[(512, 256), float32], Tensor[(512), float32]) -> Tensor[(1, 512), float32]"
    );
    assert_fully_typed(&m);
}

/// A fold whose accumulator starts `(1, 1)` and grows by a closure returning `(1, ?)` has type
/// `(1, ?)`: typed by its first value, the compiler trusted a width of 1 (a transpose of it was
/// dropped, silently: a wrong value and a wrong gradient; found by an audit).
#[test]
fn a_variable_that_meets_an_unknown_dim_is_widened_to_it() {
    let m = check(
        "def @grow(%xs: List[Tensor[(1, 1), float32]]) {
           @foldl(fn (%acc: Tensor[(1, ?), float32], %s: Tensor[(1, 1), float32]) -> Tensor[(1, ?), float32] {
             concatenate((%acc, %s), axis=1)
           }, @hd(%xs), @tl(%xs))
         }
         def @start(%x: Tensor[(1, 1), float32], %xs: List[Tensor[(1, ?), float32]]) {
           (@foldl(fn (%acc, %s) { %s }, %x, %xs), %x)
         }",
    );
    assert_eq!(
        sig(&m, "grow"),
        "fn (List[Tensor[(1, 1), float32]]) -> Tensor[(1, ?), float32]"
    );
    // The start value keeps its own type; only what flows through the fold widens.
    assert_eq!(
        sig(&m, "start"),
        "fn (Tensor[(1, 1), float32], List[Tensor[(1, ?), float32]]) -> (Tensor[(1, ?), float32], Tensor[(1, 1), float32])"
    );
    assert_fully_typed(&m);
}

#[test]
fn unknown_dims_stay_unknown() {
    let m = check(
        "def @f(%x: Tensor[(?, 256), float32], %w: Tensor[(64, 256), float32]) { nn.dense(%x, %w) }",
    );
    assert_eq!(
        sig(&m, "f"),
        "fn (Tensor[(?, 256), float32], Tensor[(64, 256), float32]) -> Tensor[(?, 64), float32]"
    );
}

#[test]
fn unannotated_lambdas_passed_to_foldl_are_inferred() {
    let m = check(
        "def @total(%xs: List[Tensor[(1, 4), float32]]) {
           @foldl(fn (%acc, %x) { add(%acc, %x) }, zeros(shape=[1, 4], dtype=\"float32\"), %xs)
         }",
    );
    assert_eq!(
        sig(&m, "total"),
        "fn (List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32]"
    );
    assert_fully_typed(&m);
}

#[test]
fn lambdas_whose_types_arrive_later_are_solved_by_deferral() {
    // The lambda is bound before anything says what its parameter is.
    let m = check(
        "def @f(%xs: List[Tensor[(3), float32]]) {
           let %g = fn (%x) { sigmoid(%x) };
           @map(%g, %xs)
         }",
    );
    assert_eq!(
        sig(&m, "f"),
        "fn (List[Tensor[(3), float32]]) -> List[Tensor[(3), float32]]"
    );
    assert_fully_typed(&m);
}

#[test]
fn unannotated_globals_are_inferred_from_their_bodies_and_uses() {
    let m = check(
        "def @double(%x) { add(%x, %x) }
         def @main(%y: Tensor[(2, 2), float64]) { @double(%y) }",
    );
    assert_eq!(
        sig(&m, "double"),
        "fn (Tensor[(2, 2), float64]) -> Tensor[(2, 2), float64]"
    );
}

#[test]
fn recursion_over_lists_and_trees_with_match() {
    let m = check(
        "def @rnn(%xs: List[Tensor[(1, 8), float32]], %h: Tensor[(1, 8), float32], %w: Tensor[(8, 8), float32]) -> List[Tensor[(1, 8), float32]] {
           match (%xs) {
             Cons(%x, %rest) => {
               let %h2 = tanh(add(nn.dense(%x, %w), nn.dense(%h, %w)));
               Cons(%h2, @rnn(%rest, %h2, %w))
             },
             Nil => Nil,
           }
         }
         def @leaves(%t: Tree[Tensor[(1), int32]]) -> Tensor[(), int32] {
           match (%t) {
             Rose(_, Nil) => 1,
             Rose(_, %kids) => @foldl(fn (%n: Tensor[(), int32], %k: Tree[Tensor[(1), int32]]) { %n + @leaves(%k) }, 0, %kids),
           }
         }",
    );
    assert_fully_typed(&m);
    assert_eq!(
        sig(&m, "leaves"),
        "fn (Tree[Tensor[(1), int32]]) -> Tensor[(), int32]"
    );
}

#[test]
fn let_bound_functions_may_recurse() {
    let m = check(
        "def @count(%xs: List[Tensor[(), int32]]) {
           let %go = fn (%l: List[Tensor[(), int32]], %n: Tensor[(), int32]) -> Tensor[(), int32] {
             match (%l) { Cons(_, %t) => %go(%t, %n + 1), Nil => %n }
           };
           %go(%xs, 0)
         }",
    );
    assert_eq!(
        sig(&m, "count"),
        "fn (List[Tensor[(), int32]]) -> Tensor[(), int32]"
    );
}

#[test]
fn tuples_split_and_projection_chains() {
    let m = check(
        "def @gates(%x: Tensor[(1, 12), float32]) {
           let %s = split(%x, indices_or_sections=3, axis=1);
           let %pair = ((%s.0, %s.1), %s.2);
           sigmoid(%pair.0.1)
         }",
    );
    assert_eq!(
        sig(&m, "gates"),
        "fn (Tensor[(1, 12), float32]) -> Tensor[(1, 4), float32]"
    );
}

#[test]
fn generic_definitions_are_instantiated_per_use() {
    let m = check(
        "def @twice[A](%f: fn (A) -> A, %x: A) -> A { %f(%f(%x)) }
         def @main(%v: Tensor[(3), float32], %n: Tensor[(), int32]) {
           (@twice(fn (%y) { tanh(%y) }, %v), @twice(fn (%k) { %k + 1 }, %n))
         }",
    );
    assert_eq!(
        sig(&m, "main"),
        "fn (Tensor[(3), float32], Tensor[(), int32]) -> (Tensor[(3), float32], Tensor[(), int32])"
    );
}

#[test]
fn tensor_dependent_if_and_infix_comparisons() {
    let m = check(
        "def @exit(%logits: Tensor[(1, 5), float32], %t: Tensor[(), float32]) {
           let %p = max(nn.softmax(%logits));
           if (%p > %t) { Some(argmax(%logits, axis=[1])) } else { None }
         }",
    );
    assert_eq!(
        sig(&m, "exit"),
        "fn (Tensor[(1, 5), float32], Tensor[(), float32]) -> Option[Tensor[(1), int32]]"
    );
}

#[test]
fn nested_and_partial_patterns() {
    let m = check(
        "def @first2(%xs: List[(Tensor[(), int32], Tensor[(), float32])]) {
           match? (%xs) {
             Cons((%a, _), Cons((_, %b), _)) => (%a, %b),
           }
         }
         def @opt(%o: Option[List[Tensor[(), bool]]]) -> Tensor[(), bool] {
           match (%o) {
             Some(Cons(%b, _)) => %b,
             Some(Nil) => False,
             None => True,
           }
         }",
    );
    assert_eq!(
        sig(&m, "first2"),
        "fn (List[(Tensor[(), int32], Tensor[(), float32])]) -> (Tensor[(), int32], Tensor[(), float32])"
    );
}

#[test]
fn intrinsics_type_check() {
    let m = check(
        "def @gen() {
           let %u = db.phase_change();
           random.db_uniform(low=0, high=3, out_shape=[], out_dtype=\"int32\")
         }",
    );
    assert_eq!(sig(&m, "gen"), "fn () -> Tensor[(), int32]");
}

/// ACROBAT's `random.db_uniform(low, high, out_shape=[], out_dtype="int32")`: the bounds are scalar
/// tensors known at run time (a literal, a counter, a value computed from tensors).
#[test]
fn db_uniform_with_run_time_bounds() {
    let m = check(
        "def @gen(%depth: Tensor[(), int32], %x: Tensor[(1, 4), float32]) {
           let %a = random.db_uniform(0, 3 - %depth, out_shape=[], out_dtype=\"int32\");
           let %hi = sum(sigmoid(%x));
           let %b = random.db_uniform(0f, %hi, out_shape=[2, 2], out_dtype=\"float32\");
           (%a, %b)
         }",
    );
    assert_eq!(
        sig(&m, "gen"),
        "fn (Tensor[(), int32], Tensor[(1, 4), float32]) -> (Tensor[(), int32], Tensor[(2, 2), float32])"
    );
}

/// A chain of unannotated functions, each calling the previous one: each leaves an operator
/// waiting for its parameter's type, which only its caller's check gives. Every function's
/// check retried every waiting constraint (resolving and moving each), so 10,000 of them took
/// 8.9 s; now a constraint is retried once the variable it waits on is bound (0.36 s), and
/// 20,000 check in bounded time with every type inferred.
#[test]
fn a_long_chain_of_unannotated_functions_is_checked_in_bounded_time() {
    let start = std::time::Instant::now();
    let n = 20_000;
    let mut src = String::from("def @f0(%x) { %x }\n");
    for i in 1..n {
        src.push_str(&format!("def @f{i}(%x) {{ @f{}(add(%x, 1f)) }}\n", i - 1));
    }
    src.push_str(&format!(
        "def @main(%x: Tensor[(2), float32]) -> Tensor[(2), float32] {{ @f{}(%x) }}\n",
        n - 1
    ));
    let m = check(&src);
    assert_fully_typed(&m);
    assert_eq!(sig(&m, "f0"), sig(&m, &format!("f{}", n / 2)));
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}
