//! Helpers shared by the `tumble` binary's end-to-end tests (each test file includes this module
//! and uses a part of it).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// Float tolerance of output comparisons: `ATOL + RTOL·|expected|`.
pub const ATOL: f64 = 1e-4;
pub const RTOL: f64 = 1e-4;

/// Runs the binary with `args` (and `--color=never`).
pub fn tumble(args: &[&str]) -> Output {
    match Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(args)
        .arg("--color=never")
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("cannot run tumble: {e}"),
    }
}

/// [`tumble`] with the environment variables `env` set (switches such as `TUMBLE_NO_MEMO`).
pub fn tumble_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    match Command::new(env!("CARGO_BIN_EXE_tumble"))
        .args(args)
        .arg("--color=never")
        .envs(env.iter().copied())
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("cannot run tumble: {e}"),
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

pub fn parse_lines(what: &str, text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| match serde_json::from_str(l) {
            Ok(v) => v,
            Err(e) => panic!("{what}: line {}: not JSON ({e}): {l}", i + 1),
        })
        .collect()
}

/// Compares `got` with `want` at `path`, pushing a description of each mismatch onto `errs`:
/// floats within `ATOL + RTOL·|want|`, integers exactly, the structure (array lengths, object
/// keys) exactly.
pub fn compare(got: &Value, want: &Value, path: &str, errs: &mut Vec<String>) {
    match (got, want) {
        (Value::Array(g), Value::Array(w)) => {
            if g.len() != w.len() {
                errs.push(format!(
                    "{path}: array of {} items, expected {}",
                    g.len(),
                    w.len()
                ));
                return;
            }
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                compare(g, w, &format!("{path}[{i}]"), errs);
            }
        }
        (Value::Object(g), Value::Object(w)) => {
            let gk: Vec<&String> = g.keys().collect();
            let wk: Vec<&String> = w.keys().collect();
            if gk != wk {
                errs.push(format!("{path}: keys {gk:?}, expected {wk:?}"));
                return;
            }
            for (k, w) in w {
                compare(&g[k], w, &format!("{path}.{k}"), errs);
            }
        }
        (Value::Number(g), Value::Number(w)) => {
            if w.is_i64() || w.is_u64() {
                // An integer in the golden output (a class id) must be the same integer.
                if g != w {
                    errs.push(format!("{path}: {g}, expected the integer {w}"));
                }
            } else {
                let (Some(a), Some(b)) = (g.as_f64(), w.as_f64()) else {
                    errs.push(format!("{path}: {g} vs {w}: not comparable"));
                    return;
                };
                if (a - b).abs() > ATOL + RTOL * b.abs() || a.is_nan() {
                    errs.push(format!(
                        "{path}: {a}, expected {b} (|diff| {:.3e})",
                        (a - b).abs()
                    ));
                }
            }
        }
        _ => {
            if got != want {
                errs.push(format!("{path}: {got}, expected {want}"));
            }
        }
    }
}

/// This test process's scratch folder `<temp>/<prefix>-<pid>` (created). Folders of earlier
/// runs with the same prefix, untouched for an hour, are removed first: a run's compiled models
/// are hundreds of megabytes, and a test cannot remove a folder its siblings still write to.
#[allow(dead_code)]
pub fn scratch_dir(prefix: &str) -> PathBuf {
    let tmp = std::env::temp_dir();
    let mine = format!("{prefix}-{}", std::process::id());
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 3600);
            if name.starts_with(&format!("{prefix}-")) && name != mine && stale {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = tmp.join(mine);
    let _ = std::fs::create_dir_all(&dir);
    dir
}
