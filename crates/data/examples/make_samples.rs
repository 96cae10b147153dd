//! Regenerates the bundled samples in `<repo>/examples/` (see examples/README.md):
//!
//! ```text
//! cargo run -p tumble-data --example make_samples [-- --data-dir DIR]
//! ```
//!
//! It changes to the repository root and runs each `tumble data ...` command listed in
//! examples/README.md through `tumble_data::cli::run`, printing each one first. The SST files
//! are found as `tumble data` finds them (`../shared/data/sst` from the repository root) unless
//! `--data-dir DIR` is given.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use tumble_data::cli::{run, DataArgs};

/// Stands in for the `tumble` binary: `tumble data <ARGS>`.
#[derive(Parser)]
#[command(name = "tumble data")]
struct Data {
    #[command(flatten)]
    args: DataArgs,
}

/// The sample files and the commands that make them (paths relative to the repository root).
const COMMANDS: &[&str] = &[
    "vocab -o examples/sst_vocab.txt",
    "sst --split test --format tree --limit 8 -o examples/treelstm.jsonl",
    "sst --split test --format tree --limit 8 -o examples/mvrnn.jsonl",
    "sst --split test --format tokens --limit 8 -o examples/birnn.jsonl",
    "sst --split test --format tokens --limit 8 -o examples/stackrnn.jsonl",
    "nested --count 4 --seed 0 -o examples/nestedrnn.jsonl",
    "drnn --count 4 --seed 0 --hidden 256 -o examples/drnn_small.jsonl",
    "drnn --count 4 --seed 0 --hidden 512 -o examples/drnn_large.jsonl",
    "berxit --count 2 --seed 0 --threshold 0.9 -o examples/berxit.jsonl",
];

fn main() -> ExitCode {
    let mut data_dir: Option<PathBuf> = None;
    let mut argv = std::env::args().skip(1);
    while let Some(a) = argv.next() {
        match (a.as_str(), argv.next()) {
            ("--data-dir", Some(dir)) => {
                // Relative to where the example was started, before changing directory.
                let dir = PathBuf::from(dir);
                data_dir = Some(std::path::absolute(&dir).unwrap_or(dir));
            }
            _ => {
                eprintln!("usage: make_samples [--data-dir DIR]");
                return ExitCode::from(2);
            }
        }
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    if let Err(e) = std::env::set_current_dir(&repo) {
        eprintln!("cannot change to {}: {e}", repo.display());
        return ExitCode::FAILURE;
    }
    for command in COMMANDS {
        let mut words: Vec<String> = command.split(' ').map(str::to_string).collect();
        let uses_sst = matches!(words[0].as_str(), "sst" | "vocab");
        if let (true, Some(dir)) = (uses_sst, &data_dir) {
            words.push("--data-dir".to_string());
            words.push(dir.display().to_string());
        }
        println!("tumble data {}", words.join(" "));
        let parsed =
            match Data::try_parse_from(std::iter::once("tumble data".to_string()).chain(words)) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
        if let Err(e) = run(&parsed.args) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
