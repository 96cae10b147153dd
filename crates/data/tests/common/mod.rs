//! Helpers shared by the output tests (each test file is its own process: the interrupt flag and
//! the memory budget are process-wide).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Parser;
use tumble_data::cli::{run, DataArgs};

#[derive(Parser)]
#[command(name = "tumble data")]
struct Data {
    #[command(flatten)]
    args: DataArgs,
}

/// `tumble data ARGS` in this process.
pub fn run_args(args: &[&str]) -> Result<(), String> {
    let data = Data::try_parse_from(std::iter::once("tumble data").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    run(&data.args)
}

/// A fresh, empty directory for one test, `tag` naming the test file.
pub fn scratch(tag: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble-data-{tag}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The names in `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
