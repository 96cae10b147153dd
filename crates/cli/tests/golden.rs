//! Golden tests: `tumble run` on the bundled samples with `--random-params 0` must reproduce the
//! outputs of an independent numpy implementation of each model (`bench/golden/reference.py`,
//! written from the models' documented equations). The golden files are
//! `bench/golden/<model>_<size>.jsonl`, one JSON line per instance; regenerate them with
//! `bench/golden/make_golden.py` (see `bench/golden/README.md`). No Python is needed here.
//!
//! Floats are compared within `1e-4 + 1e-4·|golden|`, integers exactly, and the JSON structure
//! (array lengths, object keys) exactly.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{compare, parse_lines, root};
use serde_json::Value;

fn read(path: &PathBuf) -> String {
    match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) => panic!("cannot read {}: {e}", path.display()),
    }
}

/// Runs `models/<model>.rly` on `examples/<sample>.jsonl` with seed-0 random weights and checks
/// every result against `bench/golden/<model>.jsonl`.
fn golden(model: &str, sample: &str) {
    let root = root();
    let rly = format!("models/{model}.rly");
    let inputs = format!("examples/{sample}.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_tumble"))
        .current_dir(&root)
        .args([
            "run",
            &rly,
            "--inputs",
            &inputs,
            "--random-params",
            "0",
            "--color=never",
        ])
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => panic!("{model}: cannot run tumble: {e}"),
    };
    assert!(
        out.status.success(),
        "{model}: tumble run failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let got = parse_lines(
        &format!("{model}: tumble output"),
        &String::from_utf8_lossy(&out.stdout),
    );
    let golden_path = root.join("bench/golden").join(format!("{model}.jsonl"));
    let want = parse_lines(&golden_path.display().to_string(), &read(&golden_path));
    let n_inputs = parse_lines(&inputs, &read(&root.join(&inputs))).len();
    assert_eq!(
        want.len(),
        n_inputs,
        "{model}: golden has {} lines for {n_inputs} instances",
        want.len()
    );
    assert_eq!(
        got.len(),
        want.len(),
        "{model}: tumble wrote {} results, golden has {}",
        got.len(),
        want.len()
    );

    let mut errs = Vec::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        compare(
            g,
            w,
            &format!("{model}: {inputs} line {}: $", i + 1),
            &mut errs,
        );
    }
    let shown = errs.iter().take(20).cloned().collect::<Vec<_>>().join("\n");
    assert!(
        errs.is_empty(),
        "{} mismatches with the numpy golden output:\n{shown}",
        errs.len()
    );
}

#[test]
fn treelstm_small_matches_numpy() {
    golden("treelstm_small", "treelstm");
}

#[test]
fn treelstm_large_matches_numpy() {
    golden("treelstm_large", "treelstm");
}

#[test]
fn birnn_small_matches_numpy() {
    golden("birnn_small", "birnn");
}

#[test]
fn birnn_large_matches_numpy() {
    golden("birnn_large", "birnn");
}

#[test]
fn mvrnn_small_matches_numpy() {
    golden("mvrnn_small", "mvrnn");
}

#[test]
fn mvrnn_large_matches_numpy() {
    golden("mvrnn_large", "mvrnn");
}

#[test]
fn comparison_catches_differences() {
    let parse = |s: &str| -> Value {
        match serde_json::from_str(s) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    };
    let mut errs = Vec::new();
    compare(
        &parse("[[1.00005, 2.0]]"),
        &parse("[[1.0, 2.0]]"),
        "$",
        &mut errs,
    );
    compare(&parse("[[3], [1]]"), &parse("[[3], [1]]"), "$", &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    compare(
        &parse("[[1.001, 2.0]]"),
        &parse("[[1.0, 2.0]]"),
        "$",
        &mut errs,
    );
    compare(&parse("[[3], [2]]"), &parse("[[3], [1]]"), "$", &mut errs);
    compare(&parse("[[3]]"), &parse("[[3], [1]]"), "$", &mut errs);
    compare(&parse("[[3.0]]"), &parse("[[3]]"), "$", &mut errs);
    assert_eq!(errs.len(), 4, "{errs:?}");
    assert!(errs[0].starts_with("$[0][0]:"), "{}", errs[0]);
}
