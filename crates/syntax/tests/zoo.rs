//! The bundled model zoo and the checker's prelude: real programs, written by hand, must parse and
//! survive print → parse.

mod common;

use std::path::{Path, PathBuf};
use tumble_ir::SourceMap;
use tumble_syntax::parse_module;

fn sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("models"))
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "rly"))
                .collect()
        })
        .unwrap_or_default();
    files.push(root.join("crates/check/src/prelude.rly"));
    files.retain(|p| p.exists());
    files.sort();
    files
}

#[test]
fn every_bundled_program_parses_and_round_trips() {
    for path in sources() {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let mut sm = SourceMap::new();
        let id = sm.add(path.display().to_string(), text.clone());
        match parse_module(&text, id) {
            Ok(m) => {
                common::assert_round_trip(&m);
            }
            Err(ds) => panic!(
                "{}",
                ds.iter()
                    .map(|d| d.short(&sm))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        }
    }
}
