//! Deep inputs: nesting past the limit is a located error, never a stack overflow; long binding
//! chains are flat. Everything runs on a 2 MiB stack, like a test thread.

mod common;

use common::{assert_round_trip, module_errors, on_small_stack};
use tumble_ir::visit::erase_spans_and_types;
use tumble_ir::{ExprKind, SourceId};
use tumble_syntax::{parse_module, print_module, MAX_NESTING};

const DEEP: usize = 100_000;

fn wrap(body: &str) -> String {
    format!("def @main(%x, %c) {{\n{body}\n}}\n")
}

/// The errors for `text`, which must be exactly one nesting error of the given noun.
fn assert_too_deep(text: String, noun: &'static str) {
    let errs = on_small_stack(move || module_errors(&text));
    let want = format!("{noun} nested deeper than 256 levels");
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs.iter().all(|e| e.contains(&want)),
        "{errs:?} should say {want}"
    );
}

#[test]
fn deep_parentheses() {
    assert_too_deep(
        wrap(&format!("{}1{}", "(".repeat(DEEP), ")".repeat(DEEP))),
        "expression",
    );
}

#[test]
fn deep_unary_minus_with_parentheses() {
    assert_too_deep(
        wrap(&format!("{}%x{}", "-(".repeat(DEEP), ")".repeat(DEEP))),
        "expression",
    );
}

#[test]
fn deep_prefix_minus_chain() {
    assert_too_deep(wrap(&format!("{}%x", "- ".repeat(DEEP))), "expression");
}

#[test]
fn deep_calls() {
    assert_too_deep(
        wrap(&format!("{}%x{}", "f(".repeat(DEEP), ")".repeat(DEEP))),
        "expression",
    );
}

#[test]
fn deep_constructor_lists() {
    assert_too_deep(
        wrap(&format!(
            "{}Nil{}",
            "Cons(1, ".repeat(DEEP),
            ")".repeat(DEEP)
        )),
        "expression",
    );
}

#[test]
fn deep_blocks_ifs_fns_and_matches() {
    assert_too_deep(
        wrap(&format!("{}1{}", "{".repeat(DEEP), "}".repeat(DEEP))),
        "expression",
    );
    assert_too_deep(
        wrap(&format!(
            "{}1{}",
            "if (%c) { ".repeat(DEEP),
            " } else { 2 }".repeat(DEEP)
        )),
        "expression",
    );
    assert_too_deep(
        wrap(&format!(
            "{}1{}",
            "fn () { ".repeat(DEEP),
            " }".repeat(DEEP)
        )),
        "expression",
    );
    assert_too_deep(
        wrap(&format!(
            "{}1{}",
            "match (%x) { _ => ".repeat(DEEP),
            " }".repeat(DEEP)
        )),
        "expression",
    );
    assert_too_deep(
        wrap(&format!(
            "{}1{}",
            "let %y = ".repeat(DEEP),
            "; %y".repeat(DEEP)
        )),
        "expression",
    );
}

#[test]
fn long_else_if_chain() {
    assert_too_deep(
        wrap(&format!("{}3", "if (%c) { 1 } else ".repeat(DEEP))),
        "expression",
    );
}

#[test]
fn iteratively_parsed_chains_are_bounded_by_height() {
    assert_too_deep(wrap(&format!("%x{}", ".0".repeat(DEEP))), "expression");
    assert_too_deep(wrap(&format!("f{}", "(1)".repeat(DEEP))), "expression");
    assert_too_deep(wrap(&format!("1{}", " + 1".repeat(DEEP))), "expression");
    assert_too_deep(wrap(&format!("1{}", " * 1 - 1".repeat(DEEP))), "expression");
}

#[test]
fn deep_types() {
    let ty = format!("{}A{}", "List[".repeat(DEEP), "]".repeat(DEEP));
    assert_too_deep(format!("def @f(%x: {ty}) {{ %x }}"), "type");
    let ty = format!("{}A{}", "(".repeat(DEEP), ",)".repeat(DEEP));
    assert_too_deep(format!("def @f(%x: {ty}) {{ %x }}"), "type");
    let ty = format!("{}A", "fn () -> ".repeat(DEEP));
    assert_too_deep(format!("def @f(%x: {ty}) {{ %x }}"), "type");
    let ty = format!("{}A{}", "Tree[".repeat(DEEP), "]".repeat(DEEP));
    assert_too_deep(format!("type T {{ C({ty}) }}"), "type");
}

#[test]
fn deep_patterns() {
    let p = format!("{}_{}", "Cons(".repeat(DEEP), ")".repeat(DEEP));
    assert_too_deep(wrap(&format!("match (%x) {{ {p} => 1 }}")), "pattern");
    let p = format!("{}_{}", "(".repeat(DEEP), ",)".repeat(DEEP));
    assert_too_deep(wrap(&format!("match (%x) {{ {p} => 1 }}")), "pattern");
}

#[test]
fn deep_attribute_lists() {
    let v = format!("{}1{}", "[".repeat(DEEP), "]".repeat(DEEP));
    assert_too_deep(wrap(&format!("f(%x, a={v})")), "attribute list");
}

#[test]
fn a_long_let_chain_parses_prints_and_round_trips() {
    on_small_stack(|| {
        let mut body = String::new();
        for i in 0..DEEP {
            body.push_str(&format!("let %v{i} = add(%x, 1);\n"));
        }
        body.push_str("%x");
        let m = common::module(&wrap(&body));
        let d = m.def("main").expect("def");
        let ExprKind::Let(bs, _) = &d.func.body.kind else {
            panic!("not a let")
        };
        assert_eq!(bs.len(), DEEP);
        assert_round_trip(&m);
    });
}

#[test]
fn a_long_sequence_parses_prints_and_round_trips() {
    on_small_stack(|| {
        let mut body = String::new();
        for _ in 0..DEEP {
            body.push_str("add(%x, 1);\n");
        }
        body.push_str("%x");
        let m = common::module(&wrap(&body));
        let d = m.def("main").expect("def");
        let ExprKind::Let(bs, _) = &d.func.body.kind else {
            panic!("not a let")
        };
        assert_eq!(bs.len(), DEEP);
        assert_round_trip(&m);
    });
}

#[test]
fn a_long_graph_form_chain_parses() {
    on_small_stack(|| {
        let mut body = String::from("%0 = %x;\n");
        for i in 1..DEEP {
            body.push_str(&format!("%{i} = multiply(%{}, %x);\n", i - 1));
        }
        body.push_str(&format!("%{}", DEEP - 1));
        let m = common::module(&wrap(&body));
        let ExprKind::Let(bs, _) = &m.def("main").expect("def").func.body.kind else {
            panic!("not a let")
        };
        assert_eq!(bs.len(), DEEP);
        assert_round_trip(&m);
    });
}

/// Just under the limit, parsing, printing, re-parsing and comparing must all fit on the stack.
#[test]
fn inputs_just_under_the_limit_round_trip_on_a_small_stack() {
    let n = MAX_NESTING - 6;
    let bodies = [
        format!("{}%x{}", "f(".repeat(n), ")".repeat(n)),
        format!("{}%x{}", "-(".repeat(n / 2), ")".repeat(n / 2)),
        format!("{}1{}", "(".repeat(n), ",)".repeat(n)),
        format!("{}1{}", "fn () { ".repeat(n), " }".repeat(n)),
        format!("{}1{}", "if (%c) { ".repeat(n), " } else { 2 }".repeat(n)),
        format!("{}1{}", "match (%x) { _ => ".repeat(n), " }".repeat(n)),
        format!("{}1{}", "let %y = ".repeat(n), "; %y".repeat(n)),
        format!("%x{}", ".0".repeat(n)),
        format!("1{}", " + 1".repeat(n)),
        // Deep in all three kinds at once: expression, then pattern, then type.
        format!(
            "{}match (%x) {{ {}%y: {}A{}{} => 1 }}{}",
            "f(".repeat(n),
            "Cons(".repeat(n),
            "List[".repeat(n),
            "]".repeat(n),
            ")".repeat(n),
            ")".repeat(n)
        ),
    ];
    for body in bodies {
        on_small_stack(move || {
            let text = wrap(&body);
            let mut m = match parse_module(&text, SourceId(0)) {
                Ok(m) => m,
                Err(ds) => panic!("{:?}", ds.first().map(|d| d.message.clone())),
            };
            let printed = print_module(&m);
            let mut back = parse_module(&printed, SourceId(0))
                .unwrap_or_else(|ds| panic!("{:?}", ds.first().map(|d| d.message.clone())));
            erase_spans_and_types(&mut m);
            erase_spans_and_types(&mut back);
            assert!(m == back, "round trip changed the tree");
        });
    }
}
