//! The checker never panics, whatever it is given: random token soup, and the zoo models and prelude
//! with random edits (deleted ranges, swapped lines, replaced tokens), which reach deep into inference
//! with almost-right programs.

use proptest::prelude::*;
use tumble_check::{load, LoadOptions, PRELUDE};
use tumble_ir::SourceMap;

const TOKENS: &[&str] = &[
    "def",
    "@f",
    "@main",
    "@map",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    ";",
    ":",
    "=",
    "=>",
    "->",
    "let",
    "%x",
    "%y",
    "fn",
    "if",
    "else",
    "match",
    "match?",
    "Cons",
    "Nil",
    "Some",
    "None",
    "Rose",
    "_",
    "Tensor[(1, 4), float32]",
    "Tensor[(?, 4), float32]",
    "Tensor[(), bool]",
    "List[",
    "Tree[",
    "type",
    "A",
    "1",
    "2.5f",
    "True",
    "add",
    "nn.dense",
    "split",
    "concatenate",
    "%x.0",
    ".1",
    "+",
    "==",
    "<",
    "-",
    "sigmoid",
    "axis=1",
    "indices_or_sections=2",
    "Primitive=1",
];

fn zoo() -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "rly"))
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    files.push(PRELUDE.to_string());
    files
}

fn check_no_panic(src: &str) {
    let mut sources = SourceMap::new();
    let _ = load(&mut sources, "t.rly", src, LoadOptions::default());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn token_soup_never_panics(idx in prop::collection::vec(0..TOKENS.len(), 0..80)) {
        let src: Vec<&str> = idx.iter().map(|&i| TOKENS[i]).collect();
        check_no_panic(&src.join(" "));
    }

    #[test]
    fn edited_zoo_models_never_panic(
        file in 0usize..64,
        edits in prop::collection::vec((0u8..3, 0.0f64..1.0, 0.0f64..1.0, 0..TOKENS.len()), 1..4),
    ) {
        let files = zoo();
        let mut src = files[file % files.len()].clone();
        for (kind, a, b, tok) in edits {
            let lines: Vec<&str> = src.lines().collect();
            if lines.is_empty() {
                break;
            }
            let i = ((a * lines.len() as f64) as usize).min(lines.len() - 1);
            let j = ((b * lines.len() as f64) as usize).min(lines.len() - 1);
            let mut out: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
            match kind {
                0 => { out.remove(i); }
                1 => out.swap(i, j),
                _ => {
                    // Replace one whitespace-separated word of line i with a random token.
                    let words: Vec<&str> = lines[i].split(' ').collect();
                    let w = j % words.len().max(1);
                    let mut ws: Vec<String> = words.iter().map(|s| s.to_string()).collect();
                    if let Some(slot) = ws.get_mut(w) {
                        *slot = TOKENS[tok].to_string();
                    }
                    out[i] = ws.join(" ");
                }
            }
            src = out.join("\n");
        }
        check_no_panic(&src);
    }
}

#[test]
fn unedited_zoo_models_check() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|x| x != "rly") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let mut sources = SourceMap::new();
        if let Err(ds) = load(
            &mut sources,
            &path.display().to_string(),
            &text,
            LoadOptions::default(),
        ) {
            panic!("{}", tumble_ir::diag::render(&ds, &sources, false));
        }
        n += 1;
    }
    assert!(n >= 14, "expected the 14 zoo models, found {n}");
}

#[test]
fn a_100000_deep_expression_is_a_located_error() {
    let src = format!(
        "def @f() {{ {}1{} }}",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    let mut sources = SourceMap::new();
    let errs = load(&mut sources, "t.rly", &src, LoadOptions::default()).err();
    let first = errs.and_then(|ds| ds.first().map(|d| d.short(&sources)));
    assert!(
        first
            .as_deref()
            .is_some_and(|m| m.starts_with("t.rly:1:") && m.contains("nested deeper than")),
        "{first:?}"
    );
}

#[test]
fn the_deepest_accepted_nesting_checks_on_an_ordinary_thread() {
    // Just under the parser's limit; the checker must not overflow the 2 MiB test-thread stack.
    let depth = tumble_syntax::MAX_NESTING - 4;
    let src = format!(
        "def @f(%x: Tensor[(2), float32]) {{ {}%x{} }}",
        "sigmoid(".repeat(depth),
        ")".repeat(depth)
    );
    let mut sources = SourceMap::new();
    assert!(load(&mut sources, "t.rly", &src, LoadOptions::default()).is_ok());
}
