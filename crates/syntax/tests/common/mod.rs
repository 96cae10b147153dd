//! Helpers shared by the integration tests.
#![allow(dead_code)]

use tumble_ir::visit::erase_spans_and_types;
use tumble_ir::{Expr, ExprKind, Module, SourceId, SourceMap};
use tumble_syntax::{parse_expr, parse_module, print_module};

/// Parses a module that must be valid, with diagnostics in the panic message otherwise.
pub fn module(text: &str) -> Module {
    let mut sm = SourceMap::new();
    let id = sm.add("t.rly", text);
    match parse_module(text, id) {
        Ok(m) => m,
        Err(ds) => panic!("{}", shorts(&ds, &sm).join("\n")),
    }
}

/// Parses a module and erases spans, for structural comparison.
pub fn erased(text: &str) -> Module {
    let mut m = module(text);
    erase_spans_and_types(&mut m);
    m
}

/// Parses an expression that must be valid, spans erased.
pub fn expr(text: &str) -> Expr {
    let wrapped = format!("def @main() {{\n{text}\n}}\n");
    let m = erased(&wrapped);
    let def = m.items.into_iter().next().and_then(|i| match i {
        tumble_ir::Item::Def(d) => Some(d),
        tumble_ir::Item::Type(_) => None,
    });
    match def {
        Some(d) => *d.func.body,
        None => panic!("no def"),
    }
}

pub fn kind(text: &str) -> ExprKind {
    expr(text).kind
}

/// The one-line form of every error for a module source named `t.rly`.
pub fn module_errors(text: &str) -> Vec<String> {
    let mut sm = SourceMap::new();
    let id = sm.add("t.rly", text);
    match parse_module(text, id) {
        Ok(_) => Vec::new(),
        Err(ds) => shorts(&ds, &sm),
    }
}

pub fn expr_errors(text: &str) -> Vec<String> {
    let mut sm = SourceMap::new();
    let id = sm.add("t.rly", text);
    match parse_expr(text, id) {
        Ok(_) => Vec::new(),
        Err(ds) => shorts(&ds, &sm),
    }
}

fn shorts(ds: &[tumble_ir::Diagnostic], sm: &SourceMap) -> Vec<String> {
    ds.iter().map(|d| d.short(sm)).collect()
}

/// print → parse gives the same tree; returns the printed text.
pub fn assert_round_trip(m: &Module) -> String {
    let printed = print_module(m);
    let mut back = match parse_module(&printed, SourceId(0)) {
        Ok(b) => b,
        Err(ds) => panic!(
            "printed module does not parse: {:?}\n--- printed:\n{printed}",
            ds.iter().map(|d| d.message.clone()).collect::<Vec<_>>()
        ),
    };
    let mut orig = m.clone();
    erase_spans_and_types(&mut orig);
    erase_spans_and_types(&mut back);
    assert!(
        orig == back,
        "round trip changed the tree\n--- printed:\n{printed}"
    );
    printed
}

/// Parses `text`, then checks print → parse gives the same tree and that printing is idempotent.
pub fn round_trip_text(text: &str) -> String {
    let m = module(text);
    let printed = assert_round_trip(&m);
    let again = print_module(&module(&printed));
    assert_eq!(printed, again, "printing is not idempotent");
    printed
}

/// Runs `f` on a thread with the 2 MiB stack that test threads get, so stack use is tested as such.
pub fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let handle = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(f)
        .expect("spawn");
    handle.join().expect("thread panicked")
}
