//! Arbitrary UTF-8 must never crash the parser; whatever parses must print and parse back to the
//! same tree.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tumble_ir::visit::erase_spans_and_types;
use tumble_ir::SourceId;
use tumble_syntax::{parse_expr, parse_module, print_module};

fuzz_target!(|text: &str| {
    let _ = parse_expr(text, SourceId(0));
    let Ok(mut module) = parse_module(text, SourceId(0)) else {
        return;
    };
    let printed = print_module(&module);
    let mut back = match parse_module(&printed, SourceId(0)) {
        Ok(back) => back,
        Err(diags) => panic!("printed form does not parse: {diags:?}\n{printed}"),
    };
    erase_spans_and_types(&mut module);
    erase_spans_and_types(&mut back);
    assert!(module == back, "round trip changed the tree:\n{printed}");
    assert_eq!(print_module(&back), printed, "printing is not a fixed point");
});
