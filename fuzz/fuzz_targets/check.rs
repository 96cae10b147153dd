//! Arbitrary UTF-8 must never crash the type checker (with the prelude loaded, so inference over
//! ADTs, generics and deferred operator relations is reachable from short inputs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tumble_check::{load, LoadOptions};
use tumble_ir::SourceMap;

fuzz_target!(|text: &str| {
    let mut sources = SourceMap::new();
    if let Ok(typed) = load(&mut sources, "fuzz.rly", text, LoadOptions::default()) {
        // A module that checks has no inference variable left anywhere.
        let mut module = typed.module;
        tumble_ir::visit::walk_types_mut(&mut module, &mut |t| assert!(t.is_resolved()));
    }
});
