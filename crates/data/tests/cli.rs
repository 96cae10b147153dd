//! `tumble data ...` through `DataArgs` and `run`, on a small SST directory made here.

use std::path::{Path, PathBuf};

use clap::Parser;
use tumble_data::cli::{run, DataArgs};

#[derive(Parser)]
#[command(name = "tumble data")]
struct Data {
    #[command(flatten)]
    args: DataArgs,
}

fn parse(args: &[&str]) -> DataArgs {
    Data::try_parse_from(std::iter::once("tumble data").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .args
}

fn run_args(args: &[&str]) -> Result<(), String> {
    run(&parse(args))
}

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn write_sst(dir: &Path, test: &str) {
    std::fs::write(
        dir.join("train.txt"),
        "(3 (2 the) (3 good))\n(1 (2 the) (1 bad))\n",
    )
    .unwrap();
    std::fs::write(dir.join("dev.txt"), "(2 (2 the) (2 film))\n").unwrap();
    std::fs::write(dir.join("test.txt"), test).unwrap();
}

#[test]
fn sst_trees_tokens_offset_limit_and_vocab() {
    let dir = scratch("sst");
    write_sst(
        &dir,
        "(3 (2 a) (3 good))\n(2 (2 the) (2 (2 odd) (2 film)))\n(0 bad)\n",
    );
    let out = dir.join("out.jsonl");
    // vocab: the (4), then a bad film good odd (1 each... bad 2, film 2, good 2).
    run_args(&[
        "vocab",
        "--data-dir",
        s(&dir),
        "-o",
        s(&dir.join("vocab.txt")),
    ])
    .unwrap();
    let vocab = std::fs::read_to_string(dir.join("vocab.txt")).unwrap();
    assert_eq!(vocab, "<none>\n<unk>\nthe\nbad\nfilm\ngood\na\nodd\n");

    run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--split",
        "test",
        "-o",
        s(&out),
    ])
    .unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        text,
        "{\"tree\": {\"Rose\": [[0], [{\"Rose\": [[6], []]}, {\"Rose\": [[5], []]}]]}}\n\
         {\"tree\": {\"Rose\": [[0], [{\"Rose\": [[2], []]}, {\"Rose\": [[0], [{\"Rose\": [[7], []]}, {\"Rose\": [[4], []]}]]}]]}}\n\
         {\"tree\": {\"Rose\": [[3], []]}}\n"
    );
    run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--format",
        "tokens",
        "--offset",
        "1",
        "--limit",
        "1",
        "-o",
        s(&out),
    ])
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"tokens\": [[2], [7], [4]]}\n"
    );
    // --count is --limit; a given vocab.txt is used as is.
    std::fs::write(dir.join("mine.txt"), "<none>\n<unk>\ngood\n").unwrap();
    run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--format",
        "tokens",
        "--count",
        "1",
        "--vocab",
        s(&dir.join("mine.txt")),
        "-o",
        s(&out),
    ])
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"tokens\": [[1], [2]]}\n"
    );
    // Other splits; an offset past the end writes nothing.
    run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--split",
        "dev",
        "--format",
        "tokens",
        "-o",
        s(&out),
    ])
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"tokens\": [[2], [4]]}\n"
    );
    run_args(&["sst", "--data-dir", s(&dir), "--offset", "9", "-o", s(&out)]).unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "");
    // No temp files are left behind.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn errors_name_the_file_and_place() {
    let dir = scratch("errors");
    write_sst(&dir, "(2 a)\n(3 (2 b) (2 c)\n(2 d)\n");
    let out = dir.join("out.jsonl");
    std::fs::write(&out, "old\n").unwrap();
    let e = run_args(&["sst", "--data-dir", s(&dir), "-o", s(&out)]).unwrap_err();
    let test = dir.join("test.txt");
    assert!(
        e.starts_with(&format!("{}: line 2, column 15: ", test.display())),
        "{e}"
    );
    // The failed run left the old output alone and no temp file.
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "old\n");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 4); // 3 splits + out.jsonl
                                                             // ...but with a given vocabulary, a limit that stops before the bad tree succeeds.
    let v = dir.join("v.txt");
    std::fs::write(&v, "<none>\n<unk>\na\n").unwrap();
    run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--vocab",
        s(&v),
        "--limit",
        "1",
        "-o",
        s(&out),
    ])
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"tree\": {\"Rose\": [[2], []]}}\n"
    );
    // A bad tree in train.txt breaks the vocabulary.
    std::fs::write(dir.join("train.txt"), "(9 x)\n").unwrap();
    let e = run_args(&["vocab", "--data-dir", s(&dir)]).unwrap_err();
    assert!(
        e.contains("train.txt: line 1, column 2: expected a sentiment label"),
        "{e}"
    );

    let missing = dir.join("nope");
    let e = run_args(&["sst", "--data-dir", s(&missing)]).unwrap_err();
    assert!(e.contains(s(&missing)) && e.contains("not found"), "{e}");
    let e = run_args(&["sst", "--data-dir", s(&dir), "--vocab", s(&missing)]).unwrap_err();
    assert!(e.contains("cannot read") && e.contains(s(&missing)), "{e}");
    std::fs::write(dir.join("v.txt"), "<none>\n<unk>\nx\nx\n").unwrap();
    write_sst(&dir, "(2 a)\n");
    let e = run_args(&[
        "sst",
        "--data-dir",
        s(&dir),
        "--vocab",
        s(&dir.join("v.txt")),
    ])
    .unwrap_err();
    assert!(
        e.contains("v.txt: line 4, column 1: the word \"x\" is repeated"),
        "{e}"
    );
    // Bad generator settings.
    let e = run_args(&["nested", "--outer-min", "3", "--outer-max", "2"]).unwrap_err();
    assert!(e.contains("outer length"), "{e}");
    let e = run_args(&["drnn", "--hidden", "0"]).unwrap_err();
    assert!(e.contains("hidden"), "{e}");
    let e = run_args(&["berxit", "--threshold", "inf"]).unwrap_err();
    assert!(e.contains("threshold"), "{e}");
    // An output path in a missing directory.
    let e = run_args(&["berxit", "-o", s(&dir.join("no/such/dir/out.jsonl"))]).unwrap_err();
    assert!(e.contains("cannot create"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generators_write_json_lines() {
    let dir = scratch("gen");
    let out = dir.join("out.jsonl");
    for (args, count) in [
        (vec!["nested", "--count", "3", "--seed", "5"], 3),
        (
            vec![
                "drnn",
                "--count",
                "2",
                "--hidden",
                "8",
                "--depth-min",
                "1",
                "--depth-max",
                "1",
            ],
            2,
        ),
        (vec!["berxit", "--count", "1", "--threshold", "0.5"], 1),
    ] {
        let mut full = args.clone();
        full.extend(["-o", s(&out)]);
        run_args(&full).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(text.lines().count(), count, "{args:?}");
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert!(v.is_object());
            match args[0] {
                "drnn" => {
                    assert_eq!(v["latent"][0].as_array().unwrap().len(), 8);
                    assert_eq!(v["max_depth"], 1);
                }
                "berxit" => assert_eq!(v["threshold"], 0.5),
                _ => assert!(v["seqs"].is_array()),
            }
        }
    }
    // Same seed, same file; the default count is 100.
    run_args(&["nested", "--seed", "1", "-o", s(&out)]).unwrap();
    let a = std::fs::read_to_string(&out).unwrap();
    run_args(&["nested", "--seed", "1", "-o", s(&out)]).unwrap();
    assert_eq!(a, std::fs::read_to_string(&out).unwrap());
    assert_eq!(a.lines().count(), 100);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_values_are_rejected_by_clap() {
    for args in [
        &["sst", "--split", "validation"][..],
        &["sst", "--format", "json"],
        &["nested", "--count", "-1"],
        &["frobnicate"],
    ] {
        assert!(
            Data::try_parse_from(std::iter::once("tumble data").chain(args.iter().copied()))
                .is_err(),
            "{args:?}"
        );
    }
}

#[test]
fn sst_labels_root_and_all() {
    let dir = scratch("labels");
    write_sst(&dir, "(3 (2 a) (4 (2 good) (4 film)))\n");
    let out = dir.join("out.jsonl");
    let vocab = dir.join("vocab.txt");
    run_args(&["vocab", "--data-dir", s(&dir), "-o", s(&vocab)]).unwrap();
    let sst = |extra: &[&str]| {
        let mut a = vec![
            "sst",
            "--data-dir",
            s(&dir),
            "--vocab",
            s(&vocab),
            "-o",
            s(&out),
        ];
        a.extend_from_slice(extra);
        run_args(&a).unwrap();
        std::fs::read_to_string(&out).unwrap()
    };
    let root = sst(&["--labels", "root"]);
    assert!(root.trim_end().ends_with(", \"label\": 3}"), "{root}");
    let all = sst(&["--labels", "all"]);
    assert!(
        all.contains(
            "\"labels\": {\"Rose\": [3, [{\"Rose\": [2, []]}, {\"Rose\": [4, [{\"Rose\": [2, []]}, {\"Rose\": [4, []]}]]}]]}}"
        ),
        "{all}"
    );
    let tokens = sst(&["--labels", "all", "--format", "tokens"]);
    assert!(
        tokens.trim_end().ends_with("\"labels\": [2, 2, 4]}"),
        "{tokens}"
    );
    let plain = sst(&[]);
    assert!(!plain.contains("label"), "{plain}");
    let positions = sst(&["--format", "tokens", "--positions"]);
    assert!(
        positions
            .trim_end()
            .ends_with("\"positions\": [[0], [1], [2]]}"),
        "{positions}"
    );
}
