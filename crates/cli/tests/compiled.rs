//! `tumble compile` and `tumble run model.tumble`: same outputs as running the source, and clear
//! errors for stale, corrupt or mismatched compiled models.

mod common;

use common::{root, text, tumble};

use std::process::Output;

fn path_of(rel: &str) -> String {
    root().join(rel).display().to_string()
}

fn temp_path(name: &str) -> String {
    let path = common::scratch_dir("tumble-compiled-test").join(name);
    let _ = std::fs::remove_file(&path);
    path.display().to_string()
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        text(&out.stderr)
    );
}

fn failed_with(out: &Output, words: &[&str]) {
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    for w in words {
        assert!(err.contains(w), "expected `{w}` in: {err}");
    }
    assert!(
        out.stdout.is_empty(),
        "nothing written: {}",
        text(&out.stdout)
    );
}

/// Outputs of the zoo models from a compiled file equal those from source, with the weights
/// stored in the file and with them given at run time.
#[test]
fn compiled_models_give_the_outputs_of_their_source() {
    for (model, inputs) in [
        ("treelstm_small", "treelstm"),
        ("birnn_small", "birnn"),
        ("mvrnn_small", "mvrnn"),
        ("stackrnn_small", "stackrnn"),
        ("drnn_small", "drnn_small"),
    ] {
        let rly = path_of(&format!("models/{model}.rly"));
        let x = path_of(&format!("examples/{inputs}.jsonl"));
        let weights = temp_path(&format!("{model}.safetensors"));
        let from_source = tumble(&[
            "run",
            &rly,
            "--inputs",
            &x,
            "--random-params",
            "0",
            "--save-params",
            &weights,
            "--batch",
            "3",
        ]);
        ok(&from_source, model);
        let stored = temp_path(&format!("{model}.tumble"));
        ok(
            &tumble(&["compile", &rly, "--params", &weights, "-o", &stored]),
            model,
        );
        let run = tumble(&["run", &stored, "--inputs", &x, "--batch", "3"]);
        ok(&run, model);
        assert_eq!(text(&run.stdout), text(&from_source.stdout), "{model}");
        let bare = temp_path(&format!("{model}.bare.tumble"));
        ok(
            &tumble(&[
                "compile",
                &rly,
                "--params",
                &weights,
                "--no-weights",
                "-o",
                &bare,
            ]),
            model,
        );
        let run = tumble(&[
            "run", &bare, "--inputs", &x, "--params", &weights, "--batch", "3",
        ]);
        ok(&run, model);
        assert_eq!(text(&run.stdout), text(&from_source.stdout), "{model}");
        // Other plan switches at run time plan again: the outputs of the source run with them.
        let switches = ["--no-hfuse", "--no-epilogue", "--batch", "3"];
        let source_switched = tumble(
            &[
                &["run", &rly, "--inputs", &x, "--params", &weights][..],
                &switches[..],
            ]
            .concat(),
        );
        ok(&source_switched, model);
        let run = tumble(&[&["run", &stored, "--inputs", &x][..], &switches[..]].concat());
        ok(&run, model);
        assert_eq!(text(&run.stdout), text(&source_switched.stdout), "{model}");
    }
}

/// `rly` compiled with random weights (seed 0) into temporary file `name`: its path and bytes.
fn compiled_random(rly: &str, name: &str) -> (String, Vec<u8>) {
    let path = temp_path(name);
    ok(
        &tumble(&["compile", rly, "--random-params", "0", "-o", &path]),
        "compile",
    );
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    (path, bytes)
}

#[test]
fn damaged_stale_and_mismatched_compiled_models_are_clear_errors() {
    let rly = path_of("models/treelstm_small.rly");
    let x = path_of("examples/treelstm.jsonl");
    let (good, bytes) = compiled_random(&rly, "good.tumble");
    let write = |name: &str, b: &[u8]| {
        let p = temp_path(name);
        std::fs::write(&p, b).unwrap_or_else(|e| panic!("{e}"));
        p
    };
    let truncated = write("truncated.tumble", &bytes[..bytes.len() / 2]);
    failed_with(
        &tumble(&["run", &truncated, "--inputs", &x]),
        &["truncated", "compile the model again"],
    );
    // Cut inside its header, or its magic damaged: read as a broken source file before.
    let cut = write("cut.tumble", &bytes[..6]);
    let mut bad_magic = bytes.clone();
    bad_magic[5] = b'X';
    let bad_magic = write("bad-magic.tumble", &bad_magic);
    for damaged in [&cut, &bad_magic] {
        failed_with(
            &tumble(&["run", damaged, "--inputs", &x]),
            &["header is damaged", "compile the model again"],
        );
    }
    let mut flipped = bytes.clone();
    let mid = 40 + (flipped.len() - 40) / 3;
    flipped[mid] ^= 0x10;
    let flipped = write("flipped.tumble", &flipped);
    failed_with(
        &tumble(&["run", &flipped, "--inputs", &x]),
        &["checksum", "corrupt"],
    );
    let mut stale = bytes.clone();
    stale[8] = stale[8].wrapping_add(1);
    let stale = write("stale.tumble", &stale);
    failed_with(
        &tumble(&["run", &stale, "--inputs", &x]),
        &["stale", "tumble compile"],
    );
    failed_with(
        &tumble(&["run", &good, "--inputs", &x, "--no-dup"]),
        &["--no-dup", "tumble compile"],
    );
    failed_with(
        &tumble(&["run", &good, "--inputs", &x, "--engine", "reference"]),
        &["reference engine"],
    );
    failed_with(
        &tumble(&["run", &good, "--inputs", &x, "--params", &good]),
        &["stores its weights"],
    );
    failed_with(
        &tumble(&["run", &good, "--inputs", &x, "--random-params", "5"]),
        &["stores its weights", "--random-params"],
    );
    // Commands that read the source say so when given the compiled file.
    failed_with(&tumble(&["check", &good]), &["is a compiled model", ".rly"]);
    let w = temp_path("from_compiled.safetensors");
    failed_with(
        &tumble(&[
            "train",
            &good,
            "--train",
            &x,
            "--random-params",
            "0",
            "-o",
            &w,
        ]),
        &["is a compiled model", ".rly"],
    );
    // A file no run could use: the tree (an instance's argument) taken for a weight because the
    // --inputs file's instances do not have it.
    let empty = temp_path("no_keys.jsonl");
    std::fs::write(&empty, "{}\n").unwrap_or_else(|e| panic!("{e}"));
    let unusable = temp_path("unusable.tumble");
    failed_with(
        &tumble(&[
            "compile",
            &rly,
            "--no-weights",
            "-i",
            &empty,
            "-o",
            &unusable,
        ]),
        &["%tree", "cannot be a weight", "--inputs"],
    );
    assert!(!std::path::Path::new(&unusable).exists());
    // `--entry` takes `@name` as `run` does.
    let at = temp_path("at_main.tumble");
    ok(
        &tumble(&[
            "compile",
            &rly,
            "--entry",
            "@main",
            "--random-params",
            "0",
            "-o",
            &at,
        ]),
        "compile --entry @main",
    );
    failed_with(
        &tumble(&["run", &good, "--inputs", &x, "--entry", "other"]),
        &["compiled for @main"],
    );
    // Compiled without weights, run without them.
    let bare = temp_path("bare.tumble");
    ok(&tumble(&["compile", &rly, "-o", &bare]), "compile");
    failed_with(
        &tumble(&["run", &bare, "--inputs", &x]),
        &["missing parameters"],
    );
    // The output must not replace the model.
    failed_with(&tumble(&["compile", &rly, "-o", &rly]), &["would replace"]);
}

/// A weights file that gives none of @main's arguments (one with no tensors, or another
/// model's) is an error naming the arguments and what the file holds: it made every argument an
/// instance input without a word.
#[test]
fn a_weights_file_with_none_of_the_arguments_is_an_error() {
    let empty = temp_path("no_tensors.safetensors");
    let header = b"{}";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(&empty, bytes).unwrap();
    let out = temp_path("no_tensors.tumble");
    let model = path_of("models/treelstm_small.rly");
    let r = tumble(&["compile", &model, "--params", &empty, "-o", &out]);
    failed_with(
        &r,
        &["gives none of @main's arguments", "%emb", "no tensors"],
    );
    assert!(!std::path::Path::new(&out).exists());
}

/// A model compiled for another entry than `@main` runs that entry without `--entry` (it was
/// refused unless `--entry` was repeated, and `serve`, which has no `--entry`, could not start
/// it; an audit's), and `--entry` naming another function is still refused.
#[test]
fn a_model_compiled_for_another_entry_runs_it() {
    let src = "def @depth(%t: Tensor[(), int32]) -> Tensor[(), int32] { add(%t, 1) }\n\
               def @main(%t: Tensor[(), int32]) -> Tensor[(), int32] { %t }\n";
    let rly = temp_path("two_entries.rly");
    std::fs::write(&rly, src).unwrap_or_else(|e| panic!("{e}"));
    let inputs = temp_path("two_entries.jsonl");
    std::fs::write(&inputs, "{\"t\": 1}\n{\"t\": 5}\n").unwrap_or_else(|e| panic!("{e}"));
    let out = temp_path("depth.tumble");
    let r = tumble(&["compile", &rly, "--entry", "@depth", "-o", &out]);
    ok(&r, "compile --entry @depth");
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("weights none"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    for extra in [&[][..], &["--entry", "@depth"][..]] {
        let mut a = vec!["run", out.as_str(), "--inputs", inputs.as_str()];
        a.extend_from_slice(extra);
        let r = tumble(&a);
        ok(&r, "run of the compiled @depth");
        assert_eq!(String::from_utf8_lossy(&r.stdout), "2\n6\n");
    }
    failed_with(
        &tumble(&["run", &out, "--inputs", &inputs, "--entry", "main"]),
        &["compiled for @depth, not @main"],
    );
}

/// A compiled model gives its source's results bit for bit at every mini-batch size, though
/// `tumble run` merges blocks only for mini-batches of 32 or more (NestedRNN's input transform
/// into its GRU step): the file keeps the program without merging for the smaller ones, and a
/// run asking for no merging takes it too. (Compiled once, merged, it differed by up to 6e-7 at
/// batch 1.) Plan switches the file was compiled with hold for its runs (`--no-fusion` was
/// planned again with fusion on).
#[test]
fn compiled_models_follow_their_source_at_every_batch_and_plan_switch() {
    let rly = path_of("models/nestedrnn_small.rly");
    let x = temp_path("nested40.jsonl");
    ok(
        &tumble(&[
            "data",
            "nested",
            "--count",
            "40",
            "--outer-max",
            "3",
            "-o",
            &x,
        ]),
        "data",
    );
    let weights = temp_path("nested.safetensors");
    ok(
        &tumble(&[
            "run",
            &rly,
            "-i",
            &x,
            "--random-params",
            "0",
            "--save-params",
            &weights,
        ]),
        "weights",
    );
    let stored = temp_path("nested.tumble");
    ok(
        &tumble(&["compile", &rly, "--params", &weights, "-o", &stored]),
        "compile",
    );
    let mut outputs = Vec::new();
    for extra in [
        &["--batch", "1"][..],
        &["--batch", "40"],
        &["--no-block-merge"],
    ] {
        let source = tumble(&[&["run", &rly, "-i", &x, "--params", &weights][..], extra].concat());
        ok(&source, "source");
        let compiled = tumble(&[&["run", &stored, "-i", &x][..], extra].concat());
        ok(&compiled, "compiled");
        assert_eq!(text(&compiled.stdout), text(&source.stdout), "{extra:?}");
        outputs.push(text(&source.stdout));
    }
    // Merging changes the last bits here, so the check above saw both programs.
    assert_ne!(
        outputs[0], outputs[1],
        "merging made no difference: the test checks nothing"
    );

    let unfused = temp_path("nested-unfused.tumble");
    ok(
        &tumble(&[
            "compile",
            &rly,
            "--params",
            &weights,
            "--no-fusion",
            "-o",
            &unfused,
        ]),
        "compile --no-fusion",
    );
    let source = tumble(&["run", &rly, "-i", &x, "--params", &weights, "--no-fusion"]);
    ok(&source, "source --no-fusion");
    let compiled = tumble(&["run", &unfused, "-i", &x, "--profile"]);
    ok(&compiled, "compiled --no-fusion");
    assert_eq!(text(&compiled.stdout), text(&source.stdout));
    assert!(
        text(&compiled.stderr).contains("kernel plans: 0 dense stages"),
        "{}",
        text(&compiled.stderr)
    );
}

/// `compile --no-statics` runs as `run` with every static switch off does: the runtime's halves
/// of hoisting, phases, ghosts and duplication stay off too (the compiled BiRNN ran its input
/// transforms hoisted and its classifier held at the phase boundary, 55 launches in 2 flushes,
/// against 59 in 1 for the source).
#[test]
fn a_model_compiled_without_statics_runs_without_their_runtime_halves() {
    let rly = path_of("models/birnn_small.rly");
    let x = path_of("examples/birnn.jsonl");
    let stored = temp_path("birnn-nostatics.tumble");
    ok(
        &tumble(&[
            "compile",
            &rly,
            "--random-params",
            "0",
            "--no-statics",
            "-o",
            &stored,
        ]),
        "compile --no-statics",
    );
    let all_off = [
        "--no-dup",
        "--no-param-consts",
        "--no-specialize",
        "--no-leaf-inline",
        "--no-hoist",
        "--no-ghosts",
        "--no-phases",
        "--no-auto-concurrency",
        "--no-derived-params",
        "--no-canonical-products",
        "--no-cse",
        "--no-block-merge",
    ];
    let head = |r: &std::process::Output| {
        text(&r.stderr)
            .lines()
            .find(|l| l.starts_with("instances "))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no profile head in {}", text(&r.stderr)))
    };
    let source = tumble(
        &[
            &["run", &rly, "-i", &x, "--random-params", "0", "--profile"][..],
            &all_off,
        ]
        .concat(),
    );
    ok(&source, "source with every static switch off");
    let compiled = tumble(&["run", &stored, "-i", &x, "--profile"]);
    ok(&compiled, "compiled --no-statics");
    assert_eq!(text(&compiled.stdout), text(&source.stdout));
    assert_eq!(head(&compiled), head(&source));
    let defaults = tumble(&["run", &rly, "-i", &x, "--random-params", "0", "--profile"]);
    ok(&defaults, "source with the defaults");
    assert_ne!(
        head(&defaults),
        head(&source),
        "the switches change nothing here: the test checks nothing"
    );
}

/// A compiled file whose type tables were altered (an ADT renamed) and its checksum recomputed
/// is refused when it is read, naming the tables; it failed only when the run wrote its result,
/// with an "internal" message.
#[test]
fn altered_type_tables_are_refused_at_load() {
    let rly = path_of("models/stackrnn_small.rly");
    let x = path_of("examples/stackrnn.jsonl");
    let (good, mut bytes) = compiled_random(&rly, "stack.tumble");
    ok(
        &tumble(&["run", &good, "--inputs", &x]),
        "the unaltered file",
    );
    const HEADER: usize = 36;
    // The first postcard string "List" (its length byte, then the name) after the sources is
    // the tables' ADT of that name: the sources hold the word only inside longer text.
    let at = bytes
        .windows(5)
        .position(|w| w == b"\x04List")
        .unwrap_or_else(|| panic!("no encoded `List` in the file"));
    bytes[at + 4] = b'x';
    let payload_len =
        u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_else(|e| panic!("{e}"))) as usize;
    let weights_len =
        u64::from_le_bytes(bytes[20..28].try_into().unwrap_or_else(|e| panic!("{e}"))) as usize;
    // The header's checksum, recomputed: what the load-time checks, not the checksum, refuse.
    let sum = crc32fast::hash(&bytes[HEADER..HEADER + payload_len + weights_len]);
    bytes[28..36].copy_from_slice(&u64::from(sum).to_le_bytes());
    let altered = temp_path("stack-altered.tumble");
    std::fs::write(&altered, &bytes).unwrap_or_else(|e| panic!("{e}"));
    failed_with(
        &tumble(&["run", &altered, "--inputs", &x]),
        &["type tables are malformed", "compile the model again"],
    );
}
