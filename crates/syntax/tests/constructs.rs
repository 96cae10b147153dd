//! One or more tests per construct of the grammar, comparing against hand-built trees.

mod common;

use common::{erased, expr, kind, module};
use tumble_ir::attrs::Attr;
use tumble_ir::*;

fn e(kind: ExprKind) -> Expr {
    Expr::new(kind, Span::default())
}
fn local(n: &str) -> Expr {
    e(ExprKind::Local(n.into()))
}
fn global(n: &str) -> Expr {
    e(ExprKind::Global(n.into()))
}
fn op(n: &str) -> Expr {
    e(ExprKind::Op(n.into()))
}
fn ctor(n: &str) -> Expr {
    e(ExprKind::Ctor(n.into()))
}
fn int(v: i64) -> Expr {
    e(ExprKind::Lit(Literal::Int(v, DType::Int32)))
}
fn f32(v: f64) -> Expr {
    e(ExprKind::Lit(Literal::Float(v, DType::Float32)))
}
fn call(callee: Expr, args: Vec<Expr>) -> Expr {
    call_with(callee, args, Vec::new())
}
fn call_with(callee: Expr, args: Vec<Expr>, attrs: Vec<(&str, AttrValue)>) -> Expr {
    e(ExprKind::Call(Call {
        callee: Box::new(callee),
        args,
        attrs: Attrs(
            attrs
                .into_iter()
                .map(|(name, value)| Attr {
                    name: name.into(),
                    value,
                    span: Span::default(),
                })
                .collect(),
        ),
    }))
}
fn binop(name: &str, a: Expr, b: Expr) -> Expr {
    call(op(name), vec![a, b])
}
fn param(n: &str, ann: Option<TypeExpr>) -> Param {
    Param {
        name: Ident::new(n, Span::default()),
        ann,
        ty: None,
    }
}
fn t(kind: TypeExprKind) -> TypeExpr {
    TypeExpr {
        kind,
        span: Span::default(),
    }
}
fn tensor(shape: &[Dim], dtype: DType) -> TypeExpr {
    t(TypeExprKind::Tensor {
        shape: shape.to_vec(),
        dtype,
    })
}
fn named(n: &str, args: Vec<TypeExpr>) -> TypeExpr {
    t(TypeExprKind::Named {
        name: n.into(),
        args,
    })
}
fn pat(kind: PatternKind) -> Pattern {
    Pattern {
        kind,
        span: Span::default(),
        ty: None,
    }
}
fn let_(bs: Vec<(&str, Option<TypeExpr>, Expr)>, body: Expr) -> Expr {
    e(ExprKind::Let(
        bs.into_iter()
            .map(|(n, ann, value)| LetBinding {
                var: param(n, ann),
                value,
                span: Span::default(),
            })
            .collect(),
        Box::new(body),
    ))
}
/// The type of `%x` in `def @main(%x: <text>) { %x }`.
fn ty_of(text: &str) -> TypeExpr {
    let m = erased(&format!("def @main(%x: {text}) {{ %x }}"));
    let ann = m
        .defs()
        .next()
        .and_then(|d| d.func.params.first())
        .and_then(|p| p.ann.clone());
    ann.expect("annotation")
}
/// The pattern of the first arm of `match (%x) { <text> => 0 }`.
fn pat_of(text: &str) -> Pattern {
    match kind(&format!("match (%x) {{ {text} => 0 }}")) {
        ExprKind::Match { arms, .. } => arms.into_iter().next().expect("arm").pattern,
        k => panic!("{k:?}"),
    }
}

// ---- module structure ----------------------------------------------------------------------------

#[test]
fn version_header_is_stored() {
    let m = module("#[version = \"0.0.5\"]\ndef @main() { 1 }");
    assert_eq!(m.version.as_deref(), Some("0.0.5"));
    assert_eq!(module("def @main() { 1 }").version, None);
}

#[test]
fn comments_are_ignored() {
    let m =
        module("// line\n/* block /* nested */ still */ def @main() { /* here */ 1 // there\n }");
    assert_eq!(m.defs().count(), 1);
}

#[test]
fn def_with_type_params_annotations_and_trailing_comma() {
    let m = erased("def @f[A, B](%x: A, %y, ) -> A { %x }");
    let d = m.def("f").expect("def");
    assert_eq!(
        d.type_params
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>(),
        ["A", "B"]
    );
    assert_eq!(
        d.func.params,
        vec![param("x", Some(named("A", vec![]))), param("y", None)]
    );
    assert_eq!(d.func.ret, Some(named("A", vec![])));
    assert_eq!(*d.func.body, local("x"));
}

#[test]
fn def_params_may_carry_attributes() {
    let m = erased("def @f(%x, Primitive=1) { %x }");
    let d = m.def("f").expect("def");
    assert!(d.func.attrs.is_primitive());
    assert_eq!(d.func.params.len(), 1);
}

#[test]
fn type_definitions_with_and_without_trailing_comma() {
    for text in [
        "type List[A] { Cons(A, List[A]), Nil, }",
        "type List[A] { Cons(A, List[A]), Nil }",
    ] {
        let m = erased(text);
        let td = m.type_def("List").expect("type");
        assert_eq!(td.params.len(), 1);
        assert_eq!(td.ctors.len(), 2);
        assert_eq!(
            td.ctors.first().map(|c| c.fields.clone()),
            Some(vec![
                named("A", vec![]),
                named("List", vec![named("A", vec![])])
            ])
        );
        assert_eq!(td.ctors.get(1).map(|c| c.fields.len()), Some(0));
    }
}

#[test]
fn spans_are_byte_offsets_into_the_source() {
    let text = "def @main() {\n  add(%a, %b)\n}";
    let m = module(text);
    let d = m.def("main").expect("def");
    let body = &d.func.body;
    assert_eq!(text.get(body.span.range()), Some("add(%a, %b)"));
    assert_eq!(text.get(d.span.range()), Some(text));
    assert_eq!(text.get(d.name.span.range()), Some("@main"));
}

#[test]
fn infix_call_span_covers_the_whole_expression() {
    let text = "def @main() { %a + %b * %c }";
    let m = module(text);
    let body = &m.def("main").expect("def").func.body;
    assert_eq!(text.get(body.span.range()), Some("%a + %b * %c"));
}

// ---- bindings ------------------------------------------------------------------------------------

#[test]
fn sequential_lets_are_one_node() {
    assert_eq!(
        expr("let %a = 1; let %b: int32 = %a; %b"),
        let_(
            vec![
                ("a", None, int(1)),
                ("b", Some(tensor(&[], DType::Int32)), local("a"))
            ],
            local("b")
        )
    );
}

#[test]
fn graph_form_bindings_mix_with_lets() {
    assert_eq!(
        expr("%0 = f(%x); let %1 = g(%0); %2 = h(%1); %2"),
        let_(
            vec![
                ("0", None, call(op("f"), vec![local("x")])),
                ("1", None, call(op("g"), vec![local("0")])),
                ("2", None, call(op("h"), vec![local("1")])),
            ],
            local("2")
        )
    );
}

#[test]
fn a_let_in_a_block_body_stays_nested() {
    assert_eq!(
        expr("let %a = 1; { let %b = 2; %b }"),
        let_(
            vec![("a", None, int(1))],
            let_(vec![("b", None, int(2))], local("b"))
        )
    );
}

// ---- functions, calls, attributes ----------------------------------------------------------------

#[test]
fn fn_expressions_with_attrs_and_return_type() {
    let k = kind("fn (%a: float32, %b, Primitive=1) -> float32 { add(%a, %b) }");
    let ExprKind::Fn(f) = k else { panic!("{k:?}") };
    assert_eq!(
        f.params,
        vec![
            param("a", Some(tensor(&[], DType::Float32))),
            param("b", None)
        ]
    );
    assert!(f.attrs.is_primitive());
    assert_eq!(f.ret, Some(tensor(&[], DType::Float32)));
    assert_eq!(*f.body, call(op("add"), vec![local("a"), local("b")]));
}

/// TVM's generic closure: `fn [A, B](..)`, printed back the same way.
#[test]
fn fn_expressions_with_type_parameters() {
    let k = kind("fn [A, B](%a: A, %f: fn (A) -> B) -> B { %f(%a) }");
    let ExprKind::Fn(f) = k else { panic!("{k:?}") };
    let names: Vec<&str> = f.type_params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["A", "B"]);
    assert_eq!(f.params.len(), 2);
    let text = "def @main() { fn [A](%y: A) -> A { %y } }";
    let printed = tumble_syntax::print_module(&module(text));
    assert!(printed.contains("fn [A](%y: A) -> A {"), "{printed}");
    common::assert_round_trip(&module(text));
}

#[test]
fn calls_with_keyword_attributes_of_every_kind() {
    let got = expr(
        "nn.dense(%x, %w, units=256, eps=1e-5, flag=True, off=False, dtype=\"float32\", axes=[1, -2, [3]], pad=None, neg=-7, f=-2.5)",
    );
    let want = call_with(
        op("nn.dense"),
        vec![local("x"), local("w")],
        vec![
            ("units", AttrValue::Int(256)),
            ("eps", AttrValue::Float(1e-5)),
            ("flag", AttrValue::Bool(true)),
            ("off", AttrValue::Bool(false)),
            ("dtype", AttrValue::Str("float32".into())),
            (
                "axes",
                AttrValue::List(vec![
                    AttrValue::Int(1),
                    AttrValue::Int(-2),
                    AttrValue::List(vec![AttrValue::Int(3)]),
                ]),
            ),
            ("pad", AttrValue::None),
            ("neg", AttrValue::Int(-7)),
            ("f", AttrValue::Float(-2.5)),
        ],
    );
    assert_eq!(got, want);
}

#[test]
fn callees_can_be_any_postfix_expression() {
    assert_eq!(expr("@f(1)"), call(global("f"), vec![int(1)]));
    assert_eq!(expr("%g(1)"), call(local("g"), vec![int(1)]));
    assert_eq!(
        expr("random.db_uniform()"),
        call(op("random.db_uniform"), vec![])
    );
    assert_eq!(
        expr("db.phase_change()"),
        call(op("db.phase_change"), vec![])
    );
    assert_eq!(
        expr("@f(1)(2)"),
        call(call(global("f"), vec![int(1)]), vec![int(2)])
    );
    let k = kind("(fn (%x) { %x })(1)");
    let ExprKind::Call(c) = k else {
        panic!("{k:?}")
    };
    assert!(matches!(c.callee.kind, ExprKind::Fn(_)));
}

#[test]
fn constructors_are_capitalized_names() {
    assert_eq!(expr("Nil"), ctor("Nil"));
    assert_eq!(
        expr("Cons(1, Nil)"),
        call(ctor("Cons"), vec![int(1), ctor("Nil")])
    );
    assert_eq!(expr("Some(%x)"), call(ctor("Some"), vec![local("x")]));
    assert_eq!(
        expr("Rose(%v, %kids)"),
        call(ctor("Rose"), vec![local("v"), local("kids")])
    );
}

/// A constructor declared with a lowercase name (TVM's own tests and its tensor-array types have
/// them) is a constructor wherever the file uses it, not an operator; other lowercase names stay
/// operators.
#[test]
fn lowercase_constructors_declared_in_the_file() {
    let m = erased(
        "type Box[T] { box(T), empty }\n\
         def @f(%x) { match (box(%x)) { box(%v) => %v, empty => add(%x, %x) } }",
    );
    let d = m.def("f").expect("def");
    let ExprKind::Match {
        scrutinee, arms, ..
    } = &d.func.body.kind
    else {
        panic!("not a match");
    };
    assert_eq!(**scrutinee, call(ctor("box"), vec![local("x")]));
    let names: Vec<&str> = arms
        .iter()
        .map(|a| match &a.pattern.kind {
            PatternKind::Ctor { name, .. } => name.name.as_str(),
            _ => "?",
        })
        .collect();
    assert_eq!(names, ["box", "empty"]);
    assert_eq!(arms[1].body, call(op("add"), vec![local("x"), local("x")]));
}

/// TVM's frontends name variables with `/` (`%MobilenetV2/input`); a `/` before a digit or a
/// sigil is still a division.
#[test]
fn local_names_may_hold_slashes() {
    assert_eq!(
        expr("%MobilenetV2/conv/input"),
        local("MobilenetV2/conv/input")
    );
    assert_eq!(expr("%x/2f"), binop("divide", local("x"), f32(2.0)));
    assert_eq!(expr("%a/%b"), binop("divide", local("a"), local("b")));
    assert_eq!(expr("%a / b"), binop("divide", local("a"), op("b")));
}

#[test]
fn operators_are_values_too() {
    assert_eq!(expr("add"), op("add"));
    assert_eq!(
        expr("map(nn.relu, %xs)"),
        call(op("map"), vec![op("nn.relu"), local("xs")])
    );
}

// ---- tuples, projections, grouping ---------------------------------------------------------------

#[test]
fn tuples_and_grouping() {
    assert_eq!(expr("()"), e(ExprKind::Tuple(vec![])));
    assert_eq!(expr("(1,)"), e(ExprKind::Tuple(vec![int(1)])));
    assert_eq!(expr("(1, 2,)"), e(ExprKind::Tuple(vec![int(1), int(2)])));
    assert_eq!(expr("(1)"), int(1));
    assert_eq!(expr("{ 1 }"), int(1));
    assert_eq!(expr("((%x))"), local("x"));
}

#[test]
fn projection_chains() {
    assert_eq!(
        expr("%x.0.1"),
        e(ExprKind::Proj(
            Box::new(e(ExprKind::Proj(Box::new(local("x")), 0))),
            1
        ))
    );
    assert_eq!(
        expr("f(%x).2"),
        e(ExprKind::Proj(Box::new(call(op("f"), vec![local("x")])), 2))
    );
    assert_eq!(
        expr("(1, 2).1"),
        e(ExprKind::Proj(
            Box::new(e(ExprKind::Tuple(vec![int(1), int(2)]))),
            1
        ))
    );
}

// ---- control flow --------------------------------------------------------------------------------

#[test]
fn if_else_and_else_if() {
    assert_eq!(
        expr("if (%c) { 1 } else { 2 }"),
        e(ExprKind::If(
            Box::new(local("c")),
            Box::new(int(1)),
            Box::new(int(2))
        ))
    );
    assert_eq!(
        expr("if (%c) { 1 } else if (%d) { 2 } else { 3 }"),
        e(ExprKind::If(
            Box::new(local("c")),
            Box::new(int(1)),
            Box::new(e(ExprKind::If(
                Box::new(local("d")),
                Box::new(int(2)),
                Box::new(int(3))
            )))
        ))
    );
}

#[test]
fn match_and_incomplete_match() {
    let k = kind("match (%l) { Cons(%h: float32, _) => %h, Nil => { 0f }, }");
    let ExprKind::Match {
        scrutinee,
        arms,
        complete,
    } = k
    else {
        panic!("{k:?}")
    };
    assert!(complete);
    assert_eq!(*scrutinee, local("l"));
    assert_eq!(arms.len(), 2);
    assert_eq!(arms.get(1).map(|a| a.body.clone()), Some(f32(0.0)));
    let k = kind("match? (%l) { Nil => 0 }");
    assert!(matches!(
        k,
        ExprKind::Match {
            complete: false,
            ..
        }
    ));
}

#[test]
fn match_on_a_tuple_needs_no_extra_parentheses() {
    let k = kind("match (%a, %b) { (Nil, _) => 1, _ => 2 }");
    let ExprKind::Match { scrutinee, .. } = k else {
        panic!("{k:?}")
    };
    assert_eq!(*scrutinee, e(ExprKind::Tuple(vec![local("a"), local("b")])));
    let printed = common::round_trip_text("def @main(%a, %b) { match (%a, %b) { _ => 1 } }");
    assert!(printed.contains("match (%a, %b) {"), "{printed}");
}

#[test]
fn match_arms_ending_in_a_block_need_no_comma() {
    let k = kind("match (%l) { Nil => { 0 } Cons(%a, %b) => { 1 } }");
    let ExprKind::Match { arms, .. } = k else {
        panic!("{k:?}")
    };
    assert_eq!(arms.len(), 2);
}

#[test]
fn patterns_of_every_kind() {
    assert_eq!(pat_of("_"), pat(PatternKind::Wildcard));
    assert_eq!(pat_of("%x"), pat(PatternKind::Var(param("x", None))));
    assert_eq!(
        pat_of("%x: int32"),
        pat(PatternKind::Var(param(
            "x",
            Some(tensor(&[], DType::Int32))
        )))
    );
    assert_eq!(
        pat_of("Nil"),
        pat(PatternKind::Ctor {
            name: Ident::new("Nil", Span::default()),
            args: vec![]
        })
    );
    assert_eq!(
        pat_of("(%a, _)"),
        pat(PatternKind::Tuple(vec![
            pat(PatternKind::Var(param("a", None))),
            pat(PatternKind::Wildcard)
        ]))
    );
    assert_eq!(
        pat_of("(%a,)"),
        pat(PatternKind::Tuple(vec![pat(PatternKind::Var(param(
            "a", None
        )))]))
    );
    assert_eq!(pat_of("(_)"), pat(PatternKind::Wildcard));
    assert_eq!(
        pat_of("Cons((%a, %b), Cons(_, Nil))"),
        pat(PatternKind::Ctor {
            name: Ident::new("Cons", Span::default()),
            args: vec![
                pat(PatternKind::Tuple(vec![
                    pat(PatternKind::Var(param("a", None))),
                    pat(PatternKind::Var(param("b", None)))
                ])),
                pat(PatternKind::Ctor {
                    name: Ident::new("Cons", Span::default()),
                    args: vec![
                        pat(PatternKind::Wildcard),
                        pat(PatternKind::Ctor {
                            name: Ident::new("Nil", Span::default()),
                            args: vec![]
                        })
                    ]
                })
            ]
        })
    );
}

// ---- literals ------------------------------------------------------------------------------------

#[test]
fn integer_literals() {
    assert_eq!(expr("1"), int(1));
    assert_eq!(expr("-1"), int(-1));
    assert_eq!(expr("- 1"), int(-1));
    assert_eq!(expr("-2147483648"), int(-2147483648));
    assert_eq!(
        expr("1i64"),
        e(ExprKind::Lit(Literal::Int(1, DType::Int64)))
    );
    assert_eq!(
        expr("-9223372036854775808i64"),
        e(ExprKind::Lit(Literal::Int(i64::MIN, DType::Int64)))
    );
    assert_eq!(expr("1i32"), int(1));
}

#[test]
fn float_literals() {
    assert_eq!(expr("2.5"), f32(2.5));
    assert_eq!(expr("1e-5"), f32(1e-5));
    assert_eq!(expr("1.5e3"), f32(1.5e3));
    assert_eq!(expr("1f"), f32(1.0));
    assert_eq!(expr("1f32"), f32(1.0));
    assert_eq!(expr("0f"), f32(0.0));
    assert_eq!(expr("-0.5f"), f32(-0.5));
    assert_eq!(
        expr("2.5f64"),
        e(ExprKind::Lit(Literal::Float(2.5, DType::Float64)))
    );
}

#[test]
fn bool_literals() {
    assert_eq!(expr("True"), e(ExprKind::Lit(Literal::Bool(true))));
    assert_eq!(expr("False"), e(ExprKind::Lit(Literal::Bool(false))));
}

#[test]
fn unary_minus_on_non_literals_is_negative() {
    assert_eq!(expr("-%x"), call(op("negative"), vec![local("x")]));
    assert_eq!(expr("-(1)"), call(op("negative"), vec![int(1)]));
    assert_eq!(expr("--1"), call(op("negative"), vec![int(-1)]));
    assert_eq!(
        expr("-%x.0"),
        call(
            op("negative"),
            vec![e(ExprKind::Proj(Box::new(local("x")), 0))]
        )
    );
}

// ---- infix ---------------------------------------------------------------------------------------

#[test]
fn infix_precedence_and_associativity() {
    assert_eq!(
        expr("%a + %b * %c"),
        binop("add", local("a"), binop("multiply", local("b"), local("c")))
    );
    assert_eq!(
        expr("%a - %b - %c"),
        binop(
            "subtract",
            binop("subtract", local("a"), local("b")),
            local("c")
        )
    );
    assert_eq!(
        expr("%a / %b * %c"),
        binop(
            "multiply",
            binop("divide", local("a"), local("b")),
            local("c")
        )
    );
    assert_eq!(
        expr("%a + 1 < %b * 2"),
        binop(
            "less",
            binop("add", local("a"), int(1)),
            binop("multiply", local("b"), int(2))
        )
    );
    assert_eq!(
        expr("(%a + %b) * %c"),
        binop("multiply", binop("add", local("a"), local("b")), local("c"))
    );
    // Equalities bind looser than orderings (TVM's `op_table.h`).
    assert_eq!(
        expr("%b == %x < %y"),
        binop("equal", local("b"), binop("less", local("x"), local("y")))
    );
    assert_eq!(
        expr("%x <= %y != %c"),
        binop(
            "not_equal",
            binop("less_equal", local("x"), local("y")),
            local("c")
        )
    );
    assert_eq!(expr("%a - -1"), binop("subtract", local("a"), int(-1)));
    assert_eq!(expr("%a -1"), binop("subtract", local("a"), int(1)));
    assert_eq!(
        expr("-%a * %b"),
        binop(
            "multiply",
            call(op("negative"), vec![local("a")]),
            local("b")
        )
    );
}

#[test]
fn every_comparison_operator() {
    for (text, name) in [
        ("==", "equal"),
        ("!=", "not_equal"),
        ("<", "less"),
        (">", "greater"),
        ("<=", "less_equal"),
        (">=", "greater_equal"),
    ] {
        assert_eq!(
            expr(&format!("%a {text} %b")),
            binop(name, local("a"), local("b")),
            "{text}"
        );
    }
}

/// Relay's `e1; e2` evaluates `e1` for nothing: a binding nobody can name, so it shadows no
/// variable; a binding's own `;` still ends the binding (`let %x = e1; e2` binds `e1`).
#[test]
fn sequenced_expressions_bind_unnamed_values() {
    let ExprKind::Let(bs, body) = kind("f(%a); let %x = g(%a); (); %x") else {
        panic!("not a let chain");
    };
    let names: Vec<&str> = bs.iter().map(|b| b.var.name.name.as_str()).collect();
    assert_eq!(names.len(), 3);
    assert!(
        names[0].contains('.') && names[2].contains('.'),
        "{names:?}"
    );
    assert_eq!(names[1], "x");
    assert_eq!(bs[0].value, call(op("f"), vec![local("a")]));
    assert_eq!(bs[1].value, call(op("g"), vec![local("a")]));
    assert_eq!(*body, local("x"));
}

/// TVM's literal forms: `inff` (a float32 infinity, as its printer writes `clip` bounds) and an
/// unsuffixed integer past int32's range, an int64.
#[test]
fn infinities_and_wide_integers_read_as_tvm_writes_them() {
    assert_eq!(
        kind("-inff"),
        ExprKind::Lit(Literal::Float(f64::NEG_INFINITY, DType::Float32))
    );
    assert_eq!(
        kind("2147483648"),
        ExprKind::Lit(Literal::Int(2_147_483_648, DType::Int64))
    );
    assert_eq!(
        kind("-2147483648"),
        ExprKind::Lit(Literal::Int(-2_147_483_648, DType::Int32))
    );
    let ExprKind::Call(c) = kind("clip(%x, a_min=-inff, a_max=inff)") else {
        panic!("not a call");
    };
    assert_eq!(
        c.attrs
            .0
            .iter()
            .map(|a| a.value.clone())
            .collect::<Vec<_>>(),
        vec![
            AttrValue::Float(f64::NEG_INFINITY),
            AttrValue::Float(f64::INFINITY)
        ]
    );
}

#[test]
fn comparison_in_call_args_is_not_an_attribute() {
    assert_eq!(
        expr("f(a == b)"),
        call(op("f"), vec![binop("equal", op("a"), op("b"))])
    );
}

// ---- types ---------------------------------------------------------------------------------------

#[test]
fn tensor_types() {
    use Dim::{Any, Known};
    assert_eq!(
        ty_of("Tensor[(1, 256), float32]"),
        tensor(&[Known(1), Known(256)], DType::Float32)
    );
    assert_eq!(
        ty_of("Tensor[(?, 3), \"int64\"]"),
        tensor(&[Any, Known(3)], DType::Int64)
    );
    assert_eq!(ty_of("Tensor[(), bool]"), tensor(&[], DType::Bool));
    assert_eq!(
        ty_of("Tensor[(768), float64]"),
        tensor(&[Known(768)], DType::Float64)
    );
    assert_eq!(
        ty_of("Tensor[(768,), float64]"),
        tensor(&[Known(768)], DType::Float64)
    );
    assert_eq!(ty_of("int32"), tensor(&[], DType::Int32));
}

#[test]
fn tuple_function_named_and_hole_types() {
    let f = || tensor(&[], DType::Float32);
    assert_eq!(
        ty_of("(float32, float32)"),
        t(TypeExprKind::Tuple(vec![f(), f()]))
    );
    assert_eq!(ty_of("(float32,)"), t(TypeExprKind::Tuple(vec![f()])));
    assert_eq!(ty_of("()"), t(TypeExprKind::Tuple(vec![])));
    assert_eq!(ty_of("(float32)"), f());
    assert_eq!(
        ty_of("fn (float32, A) -> float32"),
        t(TypeExprKind::Func {
            params: vec![f(), named("A", vec![])],
            ret: Box::new(f())
        })
    );
    assert_eq!(
        ty_of("List[(Tensor[(2), float32], Tensor[(2), float32])]"),
        named(
            "List",
            vec![t(TypeExprKind::Tuple(vec![
                tensor(&[Dim::Known(2)], DType::Float32),
                tensor(&[Dim::Known(2)], DType::Float32)
            ]))]
        )
    );
    assert_eq!(ty_of("Tree[A]"), named("Tree", vec![named("A", vec![])]));
    assert_eq!(
        ty_of("Option[B]"),
        named("Option", vec![named("B", vec![])])
    );
    assert_eq!(ty_of("_"), t(TypeExprKind::Hole));
}

/// ACROBAT's programs annotate host scalars `int32SS`; it reads as the plain dtype, so they parse
/// unchanged (and print back in the canonical form).
#[test]
fn acrobat_scalar_dtype_suffix_reads_as_the_dtype() {
    let acrobat = erased(
        "def @f(%d: Tensor[(), int32SS], %e: float32SS) -> (Tensor[(), int32SS], float32) { (%d, %e) }",
    );
    let plain = erased(
        "def @f(%d: Tensor[(), int32], %e: float32) -> (Tensor[(), int32], float32) { (%d, %e) }",
    );
    assert_eq!(acrobat, plain);
}

/// TVM's text format as ACROBAT's benchmark programs write it: trailing commas in parameter and
/// argument lists, `Primitive = 1` on a function literal, comments inside a tuple type, graph
/// bindings `%0 = ...;`, the two-argument `random.db_uniform`.
#[test]
fn acrobat_benchmark_style_parses() {
    let m = module(
        "#[version = \"0.0.5\"]\n\
         def @f(\n  %x: Tensor[(1, 4), float32],\n  %d: Tensor[(), int32SS],\n) -> (\n  \
         Tensor[(1, 4), float32], // 0\n  Tensor[(), int32SS] // 1\n) {\n  \
         let %g = fn(%a: Tensor[(1, 4), float32], Primitive = 1) { sigmoid(%a) };\n  \
         %0 = %g(%x,);\n  \
         (%0, random.db_uniform(0, 3 - %d, out_shape=[], out_dtype=\"int32\"))\n}\n",
    );
    assert_eq!(m.items.len(), 1);
}
