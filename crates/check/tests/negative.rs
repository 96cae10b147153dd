//! Programs the checker must reject, each with the exact located message (`file:line:col: error: ...`).
//! One case per line of the table; every case is checked against the prelude-extended module.

use tumble_check::{load, LoadOptions};
use tumble_ir::SourceMap;

fn errors(src: &str) -> Vec<String> {
    let mut sources = SourceMap::new();
    match load(&mut sources, "t.rly", src, LoadOptions::default()) {
        Ok(_) => Vec::new(),
        Err(ds) => ds
            .iter()
            .filter(|d| d.is_error())
            .map(|d| d.short(&sources))
            .collect(),
    }
}

/// (name, source, expected first error)
const CASES: &[(&str, &str, &str)] = &[
    (
        "db_uniform_one_bound",
        "def @f(%n: Tensor[(), int32]) {\n  random.db_uniform(%n, out_shape=[])\n}",
        "t.rly:2:3: error: random.db_uniform: expected 2 arguments (low, high), or 0 with `low=`/`high=` attributes, found 1",
    ),
    (
        "db_uniform_vector_bound",
        "def @f(%n: Tensor[(2), int32]) {\n  random.db_uniform(0, %n, out_shape=[])\n}",
        "t.rly:2:24: error: random.db_uniform: high must be a scalar tensor, found Tensor[(2), int32]",
    ),
    (
        "db_uniform_bounds_twice",
        "def @f(%n: Tensor[(), int32]) {\n  random.db_uniform(0, %n, high=3, out_shape=[])\n}",
        "t.rly:2:3: error: random.db_uniform: the bounds are given as arguments; remove the attribute `high`",
    ),
    (
        "db_uniform_no_bounds",
        "def @f() {\n  random.db_uniform(out_shape=[])\n}",
        "t.rly:2:3: error: random.db_uniform: give the bounds as two arguments, `random.db_uniform(low, high, out_shape=[...])`, or as the attributes `low=` and `high=`",
    ),
    (
        "dense_columns",
        "def @f(%x: Tensor[(1, 512), float32], %w: Tensor[(256, 256), float32]) {\n  nn.dense(%x, %w)\n}",
        "t.rly:2:3: error: nn.dense: input has 512 columns but weight expects 256",
    ),
    (
        "alias_named_as_written",
        "def @f(%x: Tensor[(2), int32]) {\n  fast_exp(%x)\n}",
        "t.rly:2:12: error: fast_exp (an alias of `exp`): input must have a float dtype (float32 or float64), found int32",
    ),
    (
        "broadcast_conflict",
        "def @f(%a: Tensor[(3, 4), float32], %b: Tensor[(5), float32]) {\n  add(%a, %b)\n}",
        "t.rly:2:3: error: add: cannot broadcast Tensor[(3, 4), float32] with Tensor[(5), float32] (dimension 4 vs 5)",
    ),
    (
        "dtype_conflict",
        "def @f(%a: Tensor[(3), float32], %b: Tensor[(3), int32]) {\n  %a * %b\n}",
        "t.rly:2:3: error: multiply: dtype mismatch: float32 vs int32",
    ),
    (
        "unknown_op_suggests",
        "def @f(%x: Tensor[(1, 4), float32]) {\n  nn.dens(%x, %x)\n}",
        "t.rly:2:3: error: unknown operator `nn.dens`",
    ),
    (
        "unknown_var",
        "def @f(%input: Tensor[(1), float32]) {\n  sigmoid(%inptu)\n}",
        "t.rly:2:11: error: unknown variable `%inptu`",
    ),
    (
        "unknown_global",
        "def @main() {\n  @mian()\n}",
        "t.rly:2:3: error: unknown global `@mian`",
    ),
    (
        "unknown_ctor",
        "def @f() {\n  Cosn(1, Nil)\n}",
        "t.rly:2:3: error: unknown constructor `Cosn`",
    ),
    (
        "unknown_type",
        "def @f(%x: Lisst[Tensor[(), int32]]) {\n  %x\n}",
        "t.rly:1:12: error: unknown type `Lisst`",
    ),
    (
        "adt_arity",
        "def @f(%x: List[Tensor[(), int32], Tensor[(), int32]]) {\n  %x\n}",
        "t.rly:1:12: error: type `List` takes 1 type argument, found 2",
    ),
    (
        "ctor_field_count",
        "def @f() {\n  Cons(1)\n}",
        "t.rly:2:3: error: constructor `Cons` takes 2 fields, found 1",
    ),
    (
        "ctor_field_type",
        "def @f() -> List[Tensor[(), int32]] {\n  Cons(1f, Nil)\n}",
        "t.rly:2:8: error: the 1st field of `Cons` has the wrong type: expected Tensor[(), int32], found Tensor[(), float32]",
    ),
    (
        "call_arity",
        "def @g(%x: Tensor[(), int32]) { %x }\ndef @f() {\n  @g(1, 2)\n}",
        "t.rly:3:3: error: `@g` takes 1 argument, found 2",
    ),
    (
        "arg_type",
        "def @g(%x: Tensor[(2), float32]) { %x }\ndef @f(%y: Tensor[(3), float32]) {\n  @g(%y)\n}",
        "t.rly:3:6: error: the 1st argument of `@g` has the wrong type: expected Tensor[(2), float32], found Tensor[(3), float32]",
    ),
    (
        "return_type",
        "def @f(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 8), float32] {\n  let %y = tanh(%x);\n  %y\n}",
        "t.rly:3:3: error: the body of `@f` does not have its declared return type: expected Tensor[(1, 8), float32], found Tensor[(1, 4), float32]",
    ),
    (
        "if_cond_not_bool",
        "def @f(%x: Tensor[(), float32]) {\n  if (%x) { 1 } else { 2 }\n}",
        "t.rly:2:7: error: `if` condition must be a bool scalar Tensor[(), bool], found Tensor[(), float32]",
    ),
    (
        "if_cond_not_scalar",
        "def @f(%x: Tensor[(3), bool]) {\n  if (%x) { 1 } else { 2 }\n}",
        "t.rly:2:7: error: `if` condition must be a bool scalar Tensor[(), bool], found Tensor[(3), bool]",
    ),
    (
        "if_branches_differ",
        "def @f(%c: Tensor[(), bool]) {\n  if (%c) { 1 } else { 2f }\n}",
        "t.rly:2:24: error: `if` branches have different types: the then-branch has Tensor[(), int32], the else-branch Tensor[(), float32]",
    ),
    (
        "match_arms_differ",
        "def @f(%l: List[Tensor[(), int32]]) {\n  match (%l) {\n    Cons(%x, _) => %x,\n    Nil => 1f,\n  }\n}",
        "t.rly:4:12: error: match arms have different types: expected Tensor[(), int32], found Tensor[(), float32]",
    ),
    (
        "non_exhaustive",
        "def @f(%l: List[Tensor[(), int32]]) {\n  match (%l) {\n    Cons(%x, Nil) => %x,\n    Nil => 0,\n  }\n}",
        "t.rly:2:3: error: non-exhaustive match: `Cons(_, Cons(_, _))` is not covered",
    ),
    (
        "pattern_field_count",
        "def @f(%l: List[Tensor[(), int32]]) {\n  match? (%l) {\n    Cons(%x) => %x,\n  }\n}",
        "t.rly:3:5: error: constructor `Cons` has 2 fields, but the pattern has 1",
    ),
    (
        "pattern_wrong_adt",
        "def @f(%o: Option[Tensor[(), int32]]) {\n  match (%o) {\n    Cons(%x, _) => %x,\n    _ => 0,\n  }\n}",
        "t.rly:3:5: error: pattern `Cons` matches values of type List[_], but the value being matched has type Option[Tensor[(), int32]]",
    ),
    (
        "tuple_index_range",
        "def @f(%t: (Tensor[(), int32], Tensor[(), int32])) {\n  %t.2\n}",
        "t.rly:2:3: error: tuple index 2 is out of range: the tuple has 2 fields: (Tensor[(), int32], Tensor[(), int32])",
    ),
    (
        "project_non_tuple",
        "def @f(%x: Tensor[(2), int32]) {\n  %x.0\n}",
        "t.rly:2:3: error: cannot take field .0 of a value of type Tensor[(2), int32]: it is not a tuple",
    ),
    (
        "call_non_function",
        "def @f(%x: Tensor[(2), int32]) {\n  %x(1)\n}",
        "t.rly:2:3: error: cannot call `%x`: it has type Tensor[(2), int32], which is not a function",
    ),
    (
        "attrs_on_global_call",
        "def @g(%x: Tensor[(), int32]) { %x }\ndef @f() {\n  @g(1, axis=0)\n}",
        "t.rly:3:9: error: keyword attribute `axis` is only allowed on operator calls such as `nn.dense(..., units=4)`",
    ),
    (
        "unknown_attr",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  nn.softmax(%x, axes=1)\n}",
        "t.rly:2:18: error: nn.softmax: unknown attribute `axes` (it takes: axis)",
    ),
    (
        "attr_wrong_kind",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  nn.softmax(%x, axis=\"last\")\n}",
        "t.rly:2:18: error: nn.softmax: attribute `axis` must be an integer, found `\"last\"`",
    ),
    (
        "op_arity",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  sigmoid(%x, %x)\n}",
        "t.rly:2:3: error: `sigmoid` takes 1 argument, found 2",
    ),
    (
        "duplicate_global",
        "def @f() { 1 }\ndef @f() { 2 }",
        "t.rly:2:5: error: global `@f` is defined twice",
    ),
    (
        "duplicate_param",
        "def @f(%x: Tensor[(), int32], %x: Tensor[(), int32]) {\n  %x\n}",
        "t.rly:1:31: error: `%x` is declared twice",
    ),
    (
        "duplicate_ctor",
        "type A { X, Y }\ntype B { X }\ndef @f() { 1 }",
        "t.rly:2:10: error: constructor `X` is defined twice (also in type `A`)",
    ),
    (
        "duplicate_type",
        "type T[A] { MyNil }\ntype T { Other }\ndef @f() { 1 }",
        "t.rly:2:6: error: type `T` is defined twice",
    ),
    (
        "prelude_function_gone_with_its_type",
        "type List[A] { MyNil }\ndef @f() { @map(fn (%x: int32) { %x }, MyNil) }",
        "t.rly:2:12: error: unknown global `@map`",
    ),
    (
        "cannot_infer",
        "def @f(%x) {\n  sigmoid(%x)\n}",
        "t.rly:2:3: error: cannot infer the types of the arguments of `sigmoid` here",
    ),
    (
        "infinite_type",
        "def @f(%x) {\n  Cons(%x, %x)\n}",
        "t.rly:2:12: error: the 2nd field of `Cons` has the wrong type: the type would be infinite",
    ),
    (
        "let_annotation",
        "def @f() {\n  let %x: Tensor[(), float32] = 1;\n  %x\n}",
        "t.rly:2:33: error: the value bound to `%x` does not have its declared type: expected Tensor[(), float32], found Tensor[(), int32]",
    ),
    (
        "unknown_op_as_value",
        "def @f(%xs: List[Tensor[(2), float32]]) {\n  @map(sigmoidd, %xs)\n}",
        "t.rly:2:8: error: unknown operator `sigmoidd`",
    ),
    (
        "rigid_param_to_op",
        "def @f[A](%x: A) -> A {\n  sigmoid(%x)\n}",
        "t.rly:2:11: error: sigmoid: input must be a tensor, found the type parameter `A`",
    ),
    (
        "reshape_count",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  reshape(%x, newshape=[4, 2])\n}",
        "t.rly:2:3: error: reshape: cannot reshape Tensor[(2, 3), float32] (6 elements) to (4, 2) (8 elements)",
    ),
    (
        "reshape_count_overflows",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  reshape(%x, newshape=[4611686018427387904, 4])\n}",
        "t.rly:2:3: error: reshape: cannot reshape Tensor[(2, 3), float32] to (4611686018427387904, 4): that shape has more than 2^63 elements",
    ),
    (
        "attribute_given_twice",
        "def @f() {\n  zeros(shape=[2, 2], dtype=\"float32\", shape=[3])\n}",
        "t.rly:2:40: error: attribute `shape` is given twice",
    ),
    (
        "missing_required_attr",
        "def @f(%x: Tensor[(2, 3), float32]) {\n  reshape(%x)\n}",
        "t.rly:2:3: error: reshape: missing required attribute `newshape`",
    ),
    (
        "split_not_divisible",
        "def @f(%x: Tensor[(1, 10), float32]) {\n  split(%x, indices_or_sections=3, axis=1)\n}",
        "t.rly:2:3: error: split: cannot split dimension 10 (axis 1) into 3 equal sections",
    ),
    (
        "take_float_indices",
        "def @f(%e: Tensor[(10, 4), float32], %i: Tensor[(1), float32]) {\n  take(%e, %i, axis=0)\n}",
        "t.rly:2:12: error: take: indices must have dtype int32 or int64, found float32",
    ),
    (
        "concat_needs_tuple_match",
        "def @f(%a: Tensor[(1, 4), float32], %b: Tensor[(2, 4, 1), float32]) {\n  concatenate((%a, %b), axis=1)\n}",
        "t.rly:2:15: error: concatenate: all fields must have the same rank: field 0 is Tensor[(1, 4), float32] (rank 2) but field 1 is Tensor[(2, 4, 1), float32] (rank 3)",
    ),
    (
        "batch_matmul_inner",
        "def @f(%a: Tensor[(2, 3, 4), float32], %b: Tensor[(2, 5, 6), float32]) {\n  nn.batch_matmul(%a, %b)\n}",
        "t.rly:2:3: error: nn.batch_matmul: lhs has inner dimension 4 but rhs expects 6 (transpose_a=False, transpose_b=True)",
    ),
    (
        "bias_add_len",
        "def @f(%a: Tensor[(1, 4), float32], %b: Tensor[(5), float32]) {\n  nn.bias_add(%a, %b)\n}",
        "t.rly:2:3: error: nn.bias_add: bias has length 5 but input has 4 along axis 1",
    ),
    (
        "unknown_dtype_attr",
        "def @f(%a: Tensor[(1, 4), float32]) {\n  cast(%a, dtype=\"float16\")\n}",
        "t.rly:2:12: error: cast: attribute `dtype` must be a dtype name (float32, float64, int32, int64, bool), found `\"float16\"`",
    ),
    (
        // A parameter's type would be one variable shared by every use, and take `A` out to
        // the caller.
        "generic_param_not_written",
        "def @d[A](%x: A, %y) { (%x, %y) }\ndef @main(%x: Tensor[(), int32]) { @d(@d(%x, %x), %x) }",
        "t.rly:1:5: error: `@d` has type parameters, so its parameters' and return types must be written out: they are not inferred",
    ),
    (
        // A return type inferred from the body cannot be used by the body itself.
        "generic_recursive_return_not_written",
        "def @r[A](%x: A, %n: int32) { if (%n == 0) { %x } else { @r(%x, %n - 1) } }\ndef @main(%x: Tensor[(), int32]) { @r(%x, 2) }",
        "t.rly:1:58: error: `@r` has type parameters and calls itself, so its return type must be written out: it is not inferred",
    ),
    (
        // A closure's type parameters are inferred once: it has one type.
        "generic_closure_used_at_two_types",
        "def @main(%x: Tensor[(3), float32]) {\n  %0 = fn [A](%y: A) -> A { %y };\n  (%0(%x), %0(3))\n}",
        "t.rly:3:15: error: the 1st argument of `%0` has the wrong type: expected Tensor[(3), float32], found Tensor[(), int32]",
    ),
    (
        "generic_returns_not_written_call_each_other",
        "def @a[A](%x: A) { @b(%x) }\ndef @b[B](%x: B) { (%x, %x) }\ndef @main(%x: Tensor[(), int32]) { @a(%x) }",
        "t.rly:1:20: error: `@a` and `@b` have type parameters and no return type: write out the return type of `@b`, which `@a` uses",
    ),
    (
        "type_param_with_args",
        "def @f[A](%x: A[Tensor[(), int32]]) {\n  %x\n}",
        "t.rly:1:15: error: type parameter `A` takes no type arguments",
    ),
    (
        "tuple_pattern_on_tensor",
        "def @f(%x: Tensor[(), int32]) {\n  match (%x) {\n    (%a, %b) => %a,\n  }\n}",
        "t.rly:3:5: error: a tuple pattern with 2 fields cannot match a value of type Tensor[(), int32]",
    ),
    (
        "duplicate_pattern_var",
        "def @f(%l: List[Tensor[(), int32]]) {\n  match? (%l) {\n    Cons(%x, Cons(%x, _)) => %x,\n  }\n}",
        "t.rly:3:19: error: `%x` is declared twice",
    ),
    (
        "hole_in_type_def",
        "type Box { B(_) }\ndef @f() { 1 }",
        "t.rly:1:14: error: `_` is not allowed in a type definition; write the type",
    ),
];

#[test]
fn every_bad_program_gets_its_located_message() {
    let mut failures = Vec::new();
    for (name, src, want) in CASES {
        let got = errors(src);
        if got.first().map(String::as_str) != Some(*want) {
            failures.push(format!("{name}:\n  want {want}\n  got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn independent_errors_are_all_reported_in_one_run() {
    let got = errors(
        "def @a(%x: Tensor[(2), float32]) { sigmoid(%y) }\n\
         def @b() { Nope }\n\
         def @c(%x: Tensor[(2), int32]) { tanh(%x) }\n",
    );
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got[0].starts_with("t.rly:1:"), "{got:?}");
    assert!(got[1].starts_with("t.rly:2:"), "{got:?}");
    assert!(got[2].starts_with("t.rly:3:"), "{got:?}");
}

#[test]
fn an_error_does_not_cascade_into_cannot_infer_noise() {
    let got = errors("def @f() {\n  let %x = @nope();\n  sigmoid(%x)\n}");
    assert_eq!(
        got,
        vec!["t.rly:2:12: error: unknown global `@nope`".to_string()]
    );
}

/// Types that double at each step — a tuple of the previous line's value twice, or a
/// polymorphic `@dup` applied to its own result — are an error once they pass the checker's
/// size limit, found in bounded time and memory (80 lines took 2^80 of both).
#[test]
fn doubling_types_are_an_error_not_an_exhaustion() {
    let start = std::time::Instant::now();
    let mut tuples =
        String::from("def @main(%a0: Tensor[(1), float32]) -> Tensor[(1), float32] {\n");
    let mut dups = String::from(
        "def @dup[A](%x: A) -> (A, A) { (%x, %x) }\ndef @main(%a0: Tensor[(1), float32]) -> Tensor[(1), float32] {\n",
    );
    for i in 1..=80 {
        tuples.push_str(&format!("  let %a{i} = (%a{}, %a{});\n", i - 1, i - 1));
        dups.push_str(&format!("  let %a{i} = @dup(%a{});\n", i - 1));
    }
    for src in [&mut tuples, &mut dups] {
        src.push_str("  %a0\n}\n");
        let errs = errors(src);
        assert!(!errs.is_empty());
        assert!(errs.iter().all(|e| e.contains("parts")), "{errs:?}");
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
}

/// Ports from PyTorch and numpy write `variance(x)` and `-inf`: the errors say Relay's forms.
#[test]
fn ported_spellings_get_relays_form_in_a_note() {
    let mut sources = SourceMap::new();
    let src = "def @f(%x: Tensor[(2, 3), float32]) {\n  add(variance(%x, axis=[1]), -inf)\n}";
    let Err(ds) = load(&mut sources, "t.rly", src, LoadOptions::default()) else {
        panic!("accepted");
    };
    let notes: Vec<&str> = ds
        .iter()
        .flat_map(|d| d.notes.iter().map(String::as_str))
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("takes the mean as its second argument")),
        "{notes:?}"
    );
    assert!(notes.iter().any(|n| n.contains("`-inff`")), "{notes:?}");
}
