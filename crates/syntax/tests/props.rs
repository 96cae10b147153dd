//! Property tests: arbitrary input never panics, and well-formed trees survive print → parse.

mod common;

use proptest::prelude::*;
use tumble_ir::attrs::Attr;
use tumble_ir::visit::erase_spans_and_types;
use tumble_ir::*;
use tumble_syntax::{parse_expr, parse_module, print_module};

fn pick(names: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::sample::select(names).prop_map(String::from)
}

fn sp() -> Span {
    Span::default()
}

fn finite() -> impl Strategy<Value = f64> {
    prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL | prop::num::f64::ZERO
}

fn ident(names: &'static [&'static str]) -> impl Strategy<Value = Ident> {
    pick(names).prop_map(|n| Ident::new(n, sp()))
}

fn dim() -> impl Strategy<Value = Dim> {
    prop_oneof![(0i64..100_000).prop_map(Dim::Known), Just(Dim::Any)]
}

fn ty() -> impl Strategy<Value = TypeExpr> {
    let leaf = prop_oneof![
        (
            prop::collection::vec(dim(), 0..3),
            prop::sample::select(&DType::ALL[..])
        )
            .prop_map(|(shape, dtype)| TypeExprKind::Tensor { shape, dtype }),
        pick(&["A", "B", "List"]).prop_map(|name| TypeExprKind::Named {
            name,
            args: Vec::new()
        }),
        Just(TypeExprKind::Hole),
    ]
    .prop_map(|kind| TypeExpr { kind, span: sp() });
    leaf.prop_recursive(4, 24, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(TypeExprKind::Tuple),
            (prop::collection::vec(inner.clone(), 0..3), inner.clone()).prop_map(
                |(params, ret)| TypeExprKind::Func {
                    params,
                    ret: Box::new(ret)
                }
            ),
            (
                pick(&["List", "Tree", "Option"]),
                prop::collection::vec(inner, 1..3)
            )
                .prop_map(|(name, args)| TypeExprKind::Named { name, args }),
        ]
        .prop_map(|kind| TypeExpr { kind, span: sp() })
    })
}

const LOCALS: &[&str] = &["x", "y", "0", "a_1", "h2"];

fn param() -> impl Strategy<Value = Param> {
    (ident(LOCALS), prop::option::of(ty())).prop_map(|(name, ann)| Param {
        name,
        ann,
        ty: None,
    })
}

fn attr_value() -> impl Strategy<Value = AttrValue> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(AttrValue::Int),
        finite().prop_map(AttrValue::Float),
        any::<bool>().prop_map(AttrValue::Bool),
        any::<String>().prop_map(AttrValue::Str),
        Just(AttrValue::None),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop::collection::vec(inner, 0..3).prop_map(AttrValue::List)
    })
}

fn attrs() -> impl Strategy<Value = Attrs> {
    prop::collection::vec(
        (pick(&["units", "axis", "Primitive", "dtype"]), attr_value()),
        0..3,
    )
    .prop_map(|v| {
        // Distinct names: a name given twice is a parse error.
        let mut seen = Vec::new();
        Attrs(
            v.into_iter()
                .filter(|(name, _)| {
                    let fresh = !seen.contains(name);
                    seen.push(name.clone());
                    fresh
                })
                .map(|(name, value)| Attr {
                    name,
                    value,
                    span: sp(),
                })
                .collect(),
        )
    })
}

fn pattern() -> impl Strategy<Value = Pattern> {
    let pat = |kind| Pattern {
        kind,
        span: sp(),
        ty: None,
    };
    let leaf = prop_oneof![
        Just(PatternKind::Wildcard),
        param().prop_map(PatternKind::Var),
        ident(&["Nil", "None"]).prop_map(|name| PatternKind::Ctor {
            name,
            args: Vec::new()
        }),
    ]
    .prop_map(pat);
    leaf.prop_recursive(3, 12, 3, move |inner| {
        prop_oneof![
            (
                ident(&["Cons", "Some", "Rose"]),
                prop::collection::vec(inner.clone(), 1..3)
            )
                .prop_map(|(name, args)| PatternKind::Ctor { name, args }),
            prop::collection::vec(inner, 0..3).prop_map(PatternKind::Tuple),
        ]
        .prop_map(pat)
    })
}

fn literal() -> impl Strategy<Value = Literal> {
    prop_oneof![
        any::<i32>().prop_map(|v| Literal::Int(i64::from(v), DType::Int32)),
        any::<i64>().prop_map(|v| Literal::Int(v, DType::Int64)),
        // A float32 literal is refused past f32's range (`1e40f` would be infinity).
        (prop::num::f32::NORMAL | prop::num::f32::SUBNORMAL | prop::num::f32::ZERO)
            .prop_map(|v| Literal::Float(f64::from(v), DType::Float32)),
        finite().prop_map(|v| Literal::Float(v, DType::Float64)),
        any::<bool>().prop_map(Literal::Bool),
    ]
}

fn function(body: BoxedStrategy<Expr>) -> impl Strategy<Value = Function> {
    (
        prop::collection::vec(param(), 0..3),
        attrs(),
        prop::option::of(ty()),
        body,
    )
        .prop_map(|(params, attrs, ret, body)| Function {
            type_params: Vec::new(),
            params,
            attrs,
            ret,
            body: Box::new(body),
            span: sp(),
        })
}

fn expr() -> impl Strategy<Value = Expr> {
    let e = |kind| Expr::new(kind, sp());
    let leaf = prop_oneof![
        pick(LOCALS).prop_map(ExprKind::Local),
        pick(&["main", "f", "g_1"]).prop_map(ExprKind::Global),
        pick(&["Nil", "Cons", "Some", "None"]).prop_map(ExprKind::Ctor),
        pick(&["add", "nn.dense", "negative", "db.phase_change", "_private"])
            .prop_map(ExprKind::Op),
        literal().prop_map(ExprKind::Lit),
    ]
    .prop_map(e);
    leaf.prop_recursive(5, 48, 3, move |inner| {
        let boxed = inner.clone().boxed();
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(ExprKind::Tuple),
            (inner.clone(), 0u32..3).prop_map(|(x, i)| ExprKind::Proj(Box::new(x), i)),
            (
                inner.clone(),
                prop::collection::vec(inner.clone(), 0..3),
                attrs()
            )
                .prop_map(|(callee, args, attrs)| ExprKind::Call(Call {
                    callee: Box::new(callee),
                    args,
                    attrs
                })),
            (
                prop::collection::vec((param(), inner.clone()), 1..4),
                inner.clone()
            )
                .prop_map(|(bs, body)| ExprKind::Let(
                    bs.into_iter()
                        .map(|(var, value)| LetBinding {
                            var,
                            value,
                            span: sp()
                        })
                        .collect(),
                    Box::new(body)
                )),
            function(boxed).prop_map(|f| ExprKind::Fn(Box::new(f))),
            (inner.clone(), inner.clone(), inner.clone()).prop_map(|(c, t, f)| ExprKind::If(
                Box::new(c),
                Box::new(t),
                Box::new(f)
            )),
            (
                inner.clone(),
                prop::collection::vec((pattern(), inner), 1..3),
                any::<bool>()
            )
                .prop_map(|(s, arms, complete)| ExprKind::Match {
                    scrutinee: Box::new(s),
                    arms: arms
                        .into_iter()
                        .map(|(pattern, body)| MatchArm {
                            pattern,
                            body,
                            span: sp()
                        })
                        .collect(),
                    complete
                }),
        ]
        .prop_map(e)
    })
}

fn item() -> impl Strategy<Value = Item> {
    let type_def = (
        ident(&["List", "Tree", "Opt"]),
        prop::collection::vec(ident(&["A", "B"]), 0..3),
        prop::collection::vec(
            (
                ident(&["Cons", "Nil", "Node"]),
                prop::collection::vec(ty(), 0..3),
            ),
            0..3,
        ),
    )
        .prop_map(|(name, params, ctors)| {
            Item::Type(TypeDef {
                name,
                params,
                ctors: ctors
                    .into_iter()
                    .map(|(name, fields)| CtorDef {
                        name,
                        fields,
                        span: sp(),
                    })
                    .collect(),
                span: sp(),
            })
        });
    let def = (
        ident(&["main", "f", "g_1"]),
        prop::collection::vec(ident(&["A", "B"]), 0..3),
        function(expr().boxed()),
    )
        .prop_map(|(name, type_params, func)| {
            Item::Def(GlobalDef {
                name,
                type_params,
                func,
                span: sp(),
            })
        });
    prop_oneof![1 => type_def, 3 => def]
}

fn module() -> impl Strategy<Value = Module> {
    (
        prop::option::of(Just("0.0.5".to_string())),
        prop::collection::vec(item(), 0..4),
    )
        .prop_map(|(version, items)| Module { version, items })
}

const SOUP: &[&str] = &[
    "def",
    "type",
    "let",
    "fn",
    "if",
    "else",
    "match",
    "match?",
    "True",
    "False",
    "None",
    "Tensor",
    "float32",
    "int64",
    "float16",
    "@f",
    "@main",
    "%x",
    "%0",
    "%",
    "@",
    "Cons",
    "Nil",
    "nn.dense",
    "add",
    "_",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ";",
    ":",
    ".",
    "=",
    "==",
    "!=",
    "<",
    ">",
    "<=",
    ">=",
    "+",
    "-",
    "*",
    "/",
    "->",
    "=>",
    "?",
    "#",
    "#[version = \"0.0.5\"]",
    "0",
    "1",
    "-1",
    "1i64",
    "2.5",
    "1e-5",
    "1f",
    "2.5f64",
    "99999999999999999999",
    "1u8",
    ".0",
    "\"s\"",
    "\"",
    "\"\\q\"",
    "/*",
    "*/",
    "//",
    "\n",
    "$",
    "é",
    "\u{0}",
    "units=2",
    "Primitive=1",
    "[1, 2]",
];

fn soup() -> impl Strategy<Value = String> {
    prop::collection::vec(
        (
            prop::sample::select(SOUP),
            prop::sample::select(&[" ", "", "\n"][..]),
        ),
        0..40,
    )
    .prop_map(|toks| toks.into_iter().flat_map(|(t, s)| [t, s]).collect())
}

/// If `text` parses, its printed form parses to the same tree.
fn check_reparse(text: &str) -> Result<(), TestCaseError> {
    if let Ok(mut m) = parse_module(text, SourceId(0)) {
        let printed = print_module(&m);
        let back = parse_module(&printed, SourceId(0));
        prop_assert!(back.is_ok(), "printed form fails to parse:\n{}", printed);
        if let Ok(mut back) = back {
            erase_spans_and_types(&mut m);
            erase_spans_and_types(&mut back);
            prop_assert!(m == back, "round trip changed the tree:\n{}", printed);
        }
    }
    let _ = parse_expr(text, SourceId(0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn token_soup_never_panics(text in soup()) {
        check_reparse(&text)?;
    }

    #[test]
    fn arbitrary_strings_never_panic(text in any::<String>()) {
        check_reparse(&text)?;
    }

    #[test]
    fn soup_inside_a_def_never_panics(text in soup()) {
        check_reparse(&format!("def @main(%x) {{ {text} }}"))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn generated_modules_round_trip(m in module()) {
        let printed = print_module(&m);
        let back = parse_module(&printed, SourceId(0));
        prop_assert!(back.is_ok(), "{:?}\n--- printed:\n{}", back.err().map(|ds| ds.into_iter().map(|d| d.message).collect::<Vec<_>>()), printed);
        if let Ok(mut back) = back {
            let mut orig = m.clone();
            erase_spans_and_types(&mut orig);
            erase_spans_and_types(&mut back);
            prop_assert!(orig == back, "--- printed:\n{}", printed);
            // Printing is a fixed point.
            prop_assert_eq!(print_module(&back), printed);
        }
    }
}
