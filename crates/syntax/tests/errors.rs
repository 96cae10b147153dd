//! Syntax errors: the exact one-line form of every diagnostic (`file:line:col: error: message`).

mod common;

use common::{expr_errors, module_errors};

/// (source, expected errors in order)
const CASES: &[(&str, &[&str])] = &[
    // TVM's printed forms tumble does not read, with what to write instead.
    (
        "free_var %x: Tensor[(2), float32];\ndef @main() { 1 }",
        &["t.rly:1:1: error: `free_var` declares an input of a bare TVM expression; tumble reads modules: make it a parameter of `def @main(...)` and put the expression in its body"],
    ),
    (
        "def @main(%x: Tensor[(2), float32]) {\n  add(%x, meta[relay.Constant][0])\n}",
        &["t.rly:2:11: error: `meta[...]` refers to a constant in TVM's `#[metadata]` section, which tumble does not read; pass the constant as a parameter of `@main` (a weight, bound by name from --params) or write it as a literal"],
    ),
    (
        "def @main() {\n  f(%x;\n}",
        &["t.rly:2:7: error: expected `)` to close this call, found `;`"],
    ),
    (
        "def @main() {\n  let %x = 1\n  %x\n}",
        &["t.rly:3:3: error: expected `;` after this binding, found `%x`"],
    ),
    (
        "def @main() {\n  if (%c) { 1 }\n}",
        &["t.rly:3:1: error: expected `else` after the `if` branch, found `}`"],
    ),
    (
        "def @main() {\n  match (%x) {}\n}",
        &["t.rly:2:15: error: expected at least one match arm, found `}`"],
    ),
    (
        "def @main(%x: Tensor[(1, 2), float16]) { %x }",
        &["t.rly:1:30: error: expected a dtype (float32, float64, int32, int64 or bool), found `float16`"],
    ),
    (
        "def @main(%x: uint8) { %x }",
        &["t.rly:1:15: error: expected a dtype (float32, float64, int32, int64 or bool), found `uint8`"],
    ),
    (
        "def @main(%x: Tensor[(1, 2.5), float32]) { %x }",
        &["t.rly:1:26: error: expected a dimension (an integer or `?`), found `2.5`"],
    ),
    (
        "def @main(%x: Tensor[(1, -1), float32]) { %x }",
        &["t.rly:1:26: error: expected a dimension (an integer or `?`), found `-`"],
    ),
    (
        "def @main(%x: Tensor[1, float32]) { %x }",
        &["t.rly:1:22: error: expected a tensor shape `(d0, d1, ...)`, found `1`"],
    ),
    (
        "def @main() { 3000000000i32 }",
        &["t.rly:1:15: error: expected an integer that fits in int32, found `3000000000i32`"],
    ),
    (
        "def @main() { -2147483649i32 }",
        &["t.rly:1:15: error: expected an integer that fits in int32, found `-2147483649i32`"],
    ),
    (
        "def @main() { 99999999999999999999i64 }",
        &["t.rly:1:15: error: expected an integer that fits in int64, found `99999999999999999999i64`"],
    ),
    (
        "def @main() { 1 }\nextern type T[A]\n",
        &["t.rly:2:1: error: `extern type` declares a type without constructors, which tumble does not support: every type a model uses needs its constructors"],
    ),
    (
        "def @main() { meta[relay.Constant][0] }\n#[metadata]\n{\"root\": 1}\n",
        &["t.rly:1:15: error: `meta[...]` refers to a constant in TVM's `#[metadata]` section, which tumble does not read; pass the constant as a parameter of `@main` (a weight, bound by name from --params) or write it as a literal"],
    ),
    // Without a `meta[...]` reference the section (TVM prints one for its attributes) is skipped.
    ("def @main() { 1 }\n#[metadata]\n{\"root\": 1, \"nodes\": [{\"type_key\": \"\"}]}\n", &[]),
    (
        "def @main(%x: float32) {\n  free_var %y: float32;\n  %x\n}\n",
        &["t.rly:2:3: error: `free_var` declares an input of a bare TVM expression, which tumble does not read: make the variable a parameter of the function"],
    ),
    (
        "def @main() { 1 }\n}\n",
        &["t.rly:2:1: error: expected `def` or `type` at top level, found `}`"],
    ),
    (
        "def @main() { 1 } 42",
        &["t.rly:1:19: error: expected `def` or `type` at top level, found `42`"],
    ),
    (
        "/* never closed\ndef @main() { 1 }",
        &["t.rly:1:1: error: expected `*/` to close this block comment, found end of file"],
    ),
    (
        "def @main() { f(s=\"abc) }",
        &["t.rly:1:19: error: expected `\"` to close this string, found end of file"],
    ),
    (
        "def @main() { f(s=\"abc) }\ndef @g() { 1 }",
        &["t.rly:1:19: error: expected `\"` to close this string, found end of line"],
    ),
    (
        "def @main() { f(s=\"\\q\") }",
        &["t.rly:1:20: error: expected an escape (`\\n`, `\\t`, `\\r`, `\\0`, `\\\\`, `\\\"` or `\\u{...}`), found `\\q`"],
    ),
    (
        "def @main() { $ }",
        &["t.rly:1:15: error: expected a token, found unknown character `$`"],
    ),
    (
        "def @main() { 1u8 }",
        &["t.rly:1:16: error: expected a literal suffix (`i32`, `i64`, `f`, `f32` or `f64`), found `u8`"],
    ),
    (
        "def @main() { 1.5i64 }",
        &["t.rly:1:18: error: expected a float suffix (`f`, `f32` or `f64`), found `i64`"],
    ),
    (
        "def @main() { 1e999 }",
        &["t.rly:1:15: error: expected a finite float literal, found `1e999`"],
    ),
    (
        "def @main() { 1e40f }",
        &["t.rly:1:15: error: expected a float literal within float32's range (±3.4028235e38), found `1e40` (write it with `f64` for a float64)"],
    ),
    (
        "def @main() { (1, 2 }",
        &["t.rly:1:21: error: expected `)` to close this tuple, found `}`"],
    ),
    (
        "def @main() { %x.y }",
        &["t.rly:1:18: error: expected a tuple index after `.`, found `y`"],
    ),
    (
        "def @main() {\n  f(1, a=2, 3)\n}",
        &["t.rly:2:13: error: expected a keyword attribute `name=value` (positional arguments come first), found `3`"],
    ),
    (
        "def @main() { f(x=) }",
        &["t.rly:1:19: error: expected an attribute value (a number, `True`, `False`, a string, a list or `None`), found `)`"],
    ),
    (
        "def @main() { match (%x) { Nil -> 1 } }",
        &["t.rly:1:32: error: expected `=>` after the pattern, found `->`"],
    ),
    (
        "def @main() { match (%x) { foo => 1 } }",
        &["t.rly:1:28: error: expected a pattern (`_`, `%name`, a constructor or a tuple pattern), found `foo`"],
    ),
    (
        "def main() { 1 }",
        &["t.rly:1:5: error: expected a global name `@name` after `def`, found `main`"],
    ),
    (
        "type list { let(int32) }",
        &["t.rly:1:13: error: expected a constructor name, found `let`"],
    ),
    (
        "def @main() { let x = 1; x }",
        &["t.rly:1:19: error: expected a variable `%name` after `let`, found `x`"],
    ),
    (
        "def @main() { fn (%x { %x } }",
        &["t.rly:1:22: error: expected `)` to close the parameter list, found `{`"],
    ),
    (
        "def @main() { if %c { 1 } else { 2 } }",
        &["t.rly:1:18: error: expected `(` after `if`, found `%c`"],
    ),
    (
        "def @main() {\n  1 +\n}",
        &["t.rly:3:1: error: expected an expression, found `}`"],
    ),
    (
        "def @main() { \"s\" }",
        &["t.rly:1:15: error: expected an expression, found `\"s\"`: a string is an attribute's value, written with its name (`dtype=\"s\"`)"],
    ),
    (
        "#[version = 5]\ndef @main() { 1 }",
        &["t.rly:1:13: error: expected a version string such as `\"0.0.5\"`, found `5`"],
    ),
    (
        "def @main() {\n  1\n",
        &["t.rly:3:1: error: expected `}` to close the function body, found end of file"],
    ),
    // Several broken items: every one is reported, lexical and syntactic errors in source order.
    (
        "def @f() { 1 }\ndef @g() { ( }\ndef @h() { 2 }\ndef @i() { ] }\ntype T { C(float16) }\ndef @j() { 1 # }\n",
        &[
            "t.rly:2:14: error: expected an expression, found `}`",
            "t.rly:4:12: error: expected an expression, found `]`",
            "t.rly:5:12: error: expected a dtype (float32, float64, int32, int64 or bool), found `float16`",
            "t.rly:6:14: error: expected `}` to close the function body, found `#`",
        ],
    ),
    (
        "def @f() { $ }\ndef @g() { f(; }\n",
        &[
            "t.rly:1:12: error: expected a token, found unknown character `$`",
            "t.rly:2:14: error: expected an expression, found `;`",
        ],
    ),
];

#[test]
fn syntax_errors_have_exact_located_messages() {
    let mut failures = Vec::new();
    for (text, want) in CASES {
        let got = module_errors(text);
        if got != *want {
            failures.push(format!("{text:?}\n  got:  {got:?}\n  want: {want:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Chains that the later passes would walk too deep say how to rewrite them (issue 25).
#[test]
fn too_deep_chains_say_how_to_rewrite_them() {
    let terms = vec!["%x"; 300].join(" + ");
    let errs = module_errors(&format!("def @main(%x) {{ {terms} }}"));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].contains("each `+` of a chain adds a level; split the chain with `let`"),
        "{errs:?}"
    );
    let product = vec!["%x"; 300].join(" * ");
    let errs = module_errors(&format!("def @main(%x) {{ {product} }}"));
    assert!(errs[0].contains("each `*` of a chain"), "{errs:?}");
    let mut list = "Nil".to_string();
    for _ in 0..300 {
        list = format!("Cons(%x, {list})");
    }
    let errs = module_errors(&format!("def @main(%x) {{ {list} }}"));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("pass a long list as input"), "{errs:?}");
    // The advice works: the same 300 terms in `let` parts of 150 parse.
    let half = vec!["%x"; 150].join(" + ");
    let errs = module_errors(&format!(
        "def @main(%x) {{ let %a = {half}; let %b = {half}; %a + %b }}"
    ));
    assert!(errs.is_empty(), "{errs:?}");
}

#[test]
fn deep_nesting_is_a_located_error() {
    let text = format!(
        "def @main() {{ {}1{} }}",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    let errs = common::on_small_stack(move || module_errors(&text));
    assert_eq!(
        errs,
        ["t.rly:1:529: error: expression nested deeper than 256 levels"]
    );
    let text = format!("def @main() {{ %x{} }}", ".0".repeat(1000));
    assert_eq!(
        module_errors(&text),
        [
            "t.rly:1:527: error: expression nested deeper than 256 levels: bind inner parts with \
          `let`: a `let` chain of any length adds no levels"
        ]
    );
    let text = format!(
        "def @main(%x: {}A{}) {{ 1 }}",
        "List[".repeat(1000),
        "]".repeat(1000)
    );
    assert_eq!(
        module_errors(&text),
        ["t.rly:1:1295: error: type nested deeper than 256 levels"]
    );
}

#[test]
fn parse_expr_wants_exactly_one_expression() {
    assert_eq!(
        expr_errors("1 2"),
        ["t.rly:1:3: error: expected end of input, found `2`"]
    );
    assert_eq!(
        expr_errors(""),
        ["t.rly:1:1: error: expected an expression, found end of file"]
    );
    assert_eq!(expr_errors("add(1, 2)"), Vec::<String>::new());
}

#[test]
fn a_missing_close_points_back_at_the_opener() {
    let mut sm = tumble_ir::SourceMap::new();
    let text = "def @main() {\n  f(%x;\n}";
    let id = sm.add("t.rly", text);
    let errs = tumble_syntax::parse_module(text, id)
        .err()
        .unwrap_or_default();
    let labels: Vec<_> = errs
        .iter()
        .flat_map(|d| d.labels.iter())
        .filter(|l| !l.primary)
        .map(|l| text.get(l.span.range()))
        .collect();
    assert_eq!(labels, [Some("(")]);
}
