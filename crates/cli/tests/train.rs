//! `tumble grad`, `tumble train` and `tumble run --entry @name` end to end, on a small regression
//! model (so the debug binary is quick).

mod common;

use common::{text, tumble};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use tumble_tensor::Tensor;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble-train-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn temp_file(name: &str, contents: &str) -> String {
    let p = temp_path(name);
    std::fs::write(&p, contents).unwrap();
    p.display().to_string()
}

const MODEL: &str = r#"
def @pred(%x: Tensor[(3), float32], %y: Tensor[(), float32], %w: Tensor[(4, 3), float32],
          %b: Tensor[(4), float32], %v: Tensor[(1, 4), float32]) -> Tensor[(), float32] {
  let %h = tanh(nn.bias_add(nn.dense(reshape(%x, newshape=[1, 3]), %w), %b));
  sum(nn.dense(%h, %v))
}

def @main(%x: Tensor[(3), float32], %y: Tensor[(), float32], %w: Tensor[(4, 3), float32],
          %b: Tensor[(4), float32], %v: Tensor[(1, 4), float32]) -> Tensor[(), float32] {
  let %e = subtract(@pred(%x, %y, %w, %b, %v), %y);
  multiply(%e, %e)
}
"#;

/// Twelve instances of y = x0 - x1 + 0.5 x2.
fn instances() -> String {
    (0..12)
        .map(|i| {
            let x = [
                (i as f32 * 0.37).sin(),
                (i as f32 * 0.91).cos(),
                (i % 3) as f32 - 1.0,
            ];
            let y = x[0] - x[1] + 0.5 * x[2];
            format!(
                "{{\"x\": [{:.4}, {:.4}, {:.4}], \"y\": {:.4}}}",
                x[0], x[1], x[2], y
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A safetensors file's f32 tensors: name → (shape, values).
fn read_safetensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, v) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(v["dtype"], "F32", "{name}");
        let shape = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let off = v["data_offsets"].as_array().unwrap();
        let (s, e) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let vals = data[s..e]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), (shape, vals));
    }
    out
}

fn grad(model: &str, inputs: &str, out: &Path, extra: &[&str]) -> Output {
    let o = out.display().to_string();
    let mut a = vec![
        "grad",
        model,
        "--random-params",
        "7",
        "--inputs",
        inputs,
        "-o",
        &o,
    ];
    a.extend_from_slice(extra);
    tumble(&a)
}

#[test]
fn grad_is_the_reference_gradient_at_every_batch_size() {
    let model = temp_file("reg.rly", MODEL);
    let inputs = temp_file("reg.jsonl", &instances());
    let reference = temp_path("g_ref.safetensors");
    let o = grad(&model, &inputs, &reference, &["--reference"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let want = read_safetensors(&reference);
    assert_eq!(
        want.keys().cloned().collect::<Vec<_>>(),
        ["b", "v", "w"],
        "one gradient per float parameter, named like it"
    );
    assert_eq!(want["w"].0, [4, 3]);
    assert!(want["w"].1.iter().any(|v| *v != 0.0));
    // Mini-batches of 1, 5 and 12 instances, each one worker's or split among three.
    for (batch, workers) in [("1", "1"), ("5", "1"), ("12", "1"), ("5", "3"), ("12", "3")] {
        let got_path = temp_path(&format!("g_{batch}_{workers}.safetensors"));
        let o = grad(
            &model,
            &inputs,
            &got_path,
            &["--batch", batch, "--threads", "3", "--workers", workers],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        let got = read_safetensors(&got_path);
        for (name, (shape, vals)) in &want {
            assert_eq!(&got[name].0, shape);
            let scale = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in got[name].1.iter().zip(vals) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale.max(1.0),
                    "batch {batch}, {workers} workers, {name}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn grad_of_a_non_scalar_main_is_a_located_error() {
    let model = temp_file("vec.rly", "def @main(%x: Tensor[(3), float32], %w: Tensor[(2, 3), float32]) -> Tensor[(1, 2), float32] {\n  nn.dense(reshape(%x, newshape=[1, 3]), %w)\n}\n");
    let inputs = temp_file("vec.jsonl", "{\"x\": [1, 2, 3]}\n");
    let out = temp_path("never.safetensors");
    let o = grad(&model, &inputs, &out, &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("float scalar"), "{err}");
    assert!(
        err.contains("vec.rly:1:5"),
        "the error points at @main: {err}"
    );
    assert!(!out.exists(), "nothing is written");
}

fn train(model: &str, train: &str, dev: &str, out: &Path, extra: &[&str]) -> Output {
    train_epochs(model, train, dev, out, "6", extra)
}

/// [`train`] for `epochs` epochs.
fn train_epochs(
    model: &str,
    train: &str,
    dev: &str,
    out: &Path,
    epochs: &str,
    extra: &[&str],
) -> Output {
    let a = train_args(model, train, dev, out, epochs, extra);
    tumble(&a.iter().map(String::as_str).collect::<Vec<_>>())
}

/// [`train_epochs`]'s command line.
fn train_args(
    model: &str,
    train: &str,
    dev: &str,
    out: &Path,
    epochs: &str,
    extra: &[&str],
) -> Vec<String> {
    let o = out.display().to_string();
    let mut a = vec![
        "train",
        model,
        "--train",
        train,
        "--dev",
        dev,
        "--random-params",
        "3",
        "--epochs",
        epochs,
        "--batch",
        "4",
        "--lr",
        "0.05",
        "--seed",
        "11",
        "--quiet",
        "-o",
        &o,
    ];
    a.extend_from_slice(extra);
    if !extra.contains(&"--optimizer") {
        a.extend_from_slice(&["--optimizer", "adam"]);
    }
    a.into_iter().map(String::from).collect()
}

/// The dev losses printed after each epoch.
fn dev_losses(stderr: &str) -> Vec<f64> {
    stderr
        .lines()
        .filter_map(|l| l.split("dev loss ").nth(1))
        .filter_map(|r| r.split([',', ' ']).next())
        .filter_map(|v| v.parse().ok())
        .collect()
}

#[test]
fn train_lowers_the_loss_deterministically_and_run_reads_its_weights() {
    let model = temp_file("reg2.rly", MODEL);
    let data = temp_file("reg2.jsonl", &instances());
    let a = temp_path("w_a.safetensors");
    let b = temp_path("w_b.safetensors");
    for opt in ["sgd", "adagrad"] {
        let o = train(
            &model,
            &data,
            &data,
            &a,
            &["--optimizer", opt, "--weight-decay", "1e-4"],
        );
        assert!(o.status.success(), "{opt}: {}", text(&o.stderr));
    }
    let o = train(&model, &data, &data, &a, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    let losses = dev_losses(&err);
    assert_eq!(losses.len(), 6, "{err}");
    assert!(
        losses[5] < 0.5 * losses[0],
        "training lowers the dev loss: {losses:?}"
    );
    // Same seed, same weights: the shuffle and the updates are deterministic.
    let o = train(&model, &data, &data, &b, &[]);
    assert!(o.status.success());
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // --eval reports another global's mean on dev and picks the best epoch by it.
    let o = train(&model, &data, &data, &b, &["--eval", "@pred"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("dev @pred"));
    // The trained weights drive `run`, here of @pred.
    let w = a.display().to_string();
    let o = tumble(&[
        "run", &model, "--params", &w, "--inputs", &data, "--entry", "@pred",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).lines().count(), 12);
}

/// `--workers` splits each mini-batch among threads and sums the parts' gradients: the same
/// training as one worker up to float rounding (plain SGD, whose updates are linear in the
/// gradient), and deterministic for a given count.
#[test]
fn workers_split_mini_batches_with_the_same_gradient() {
    let model = temp_file("reg_workers.rly", MODEL);
    let data = temp_file("reg_workers.jsonl", &instances());
    let run = |workers: &str, name: &str| {
        let out = temp_path(name);
        let o = train(
            &model,
            &data,
            &data,
            &out,
            &["--optimizer", "sgd", "--threads", "4", "--workers", workers],
        );
        assert!(o.status.success(), "{workers}: {}", text(&o.stderr));
        let on = format!("on {workers} workers");
        assert_eq!(
            text(&o.stderr).contains(&on),
            workers != "1",
            "{}",
            text(&o.stderr)
        );
        (read_safetensors(&out), dev_losses(&text(&o.stderr)), out)
    };
    let (one, losses_one, _) = run("1", "w_workers1.safetensors");
    for workers in ["2", "4"] {
        let (many, losses, out) = run(workers, &format!("w_workers{workers}.safetensors"));
        assert_eq!(
            one.keys().collect::<Vec<_>>(),
            many.keys().collect::<Vec<_>>()
        );
        for (name, (shape, a)) in &one {
            let (shape_b, b) = &many[name];
            assert_eq!(shape, shape_b, "{name}");
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                    "{workers} workers, {name}: {x} vs {y}"
                );
            }
        }
        assert_eq!(losses.len(), losses_one.len());
        for (x, y) in losses.iter().zip(&losses_one) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                "{losses:?} vs {losses_one:?}"
            );
        }
        // The same count again: the same bits.
        let (_, _, again) = run(workers, &format!("w_workers{workers}b.safetensors"));
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&again).unwrap());
    }
    // More workers than threads: reduced, and said so.
    let out = temp_path("w_workers_reduced.safetensors");
    let o = train(
        &model,
        &data,
        &data,
        &out,
        &["--optimizer", "sgd", "--threads", "1", "--workers", "3"],
    );
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: --workers 3: running 1"), "{err}");
}

#[test]
fn train_refuses_bad_settings() {
    let model = temp_file("reg3.rly", MODEL);
    let data = temp_file("reg3.jsonl", &instances());
    let out = temp_path("w_bad.safetensors");
    let o = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "1",
        "--eval",
        "@pred",
        "-o",
        &out.display().to_string(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("--eval needs --dev"),
        "{}",
        text(&o.stderr)
    );
    let o = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "1",
        "--lr=-1",
        "-o",
        &out.display().to_string(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--lr"));
    assert!(!out.exists());
    let base = ["train", &model, "--train", &data, "--random-params", "1"];
    // A negative value after a space is a value refused as one, not clap's unknown flag `-0`.
    for bad in [["--lr", "-0.1"], ["--weight-decay", "-1"]] {
        let o = tumble(&[&base[..], &bad, &["-o", &out.display().to_string()]].concat());
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{bad:?}: {err}");
        assert!(
            err.contains(bad[0]) && !err.contains("unexpected argument"),
            "{err}"
        );
    }
    // A rate float32 rounds to 0 would train nothing; a weight decay likewise.
    for bad in [["--lr", "1e-50"], ["--weight-decay", "1e-60"]] {
        let o = tumble(&[&base[..], &bad, &["-o", &out.display().to_string()]].concat());
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{bad:?}: {err}");
        assert!(err.contains(bad[0]) && err.contains("float32"), "{err}");
    }
    // Outputs refused before any work: standard output (the weights are a binary file), a file
    // in a folder that does not exist.
    let missing = temp_path("no_such_folder").join("w.safetensors");
    for (o_flag, says) in [
        ("-".to_string(), "standard output"),
        (missing.display().to_string(), "create it first"),
    ] {
        let o = tumble(&[&base[..], &["-o", &o_flag]].concat());
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{o_flag}: {err}");
        assert!(err.contains(says), "{o_flag}: {err}");
        assert!(!err.contains("epoch"), "refused before training: {err}");
    }
    assert!(!std::path::Path::new("-").exists());
}

/// A training instance that fails in a launch is named by its line (instances are kept as their
/// text, parsed only to be decoded), with one worker (every instance decoded up front) and with
/// two (whose helper decodes its parts as they come), in the training file and in the dev file.
#[test]
fn a_failing_training_instance_is_named_by_its_line() {
    let model = temp_file(
        "fail_train.rly",
        "def @main(%tok: Tensor[(1), int32], %emb: Tensor[(10, 4), float32]) -> Tensor[(), float32] {\n  sum(tanh(take(%emb, %tok, axis=0, mode=\"fast\")))\n}\n",
    );
    let good = temp_file(
        "fail_train_good.jsonl",
        "{\"tok\": [1]}\n{\"tok\": [2]}\n{\"tok\": [3]}\n{\"tok\": [4]}\n",
    );
    let bad = temp_file(
        "fail_train_bad.jsonl",
        "{\"tok\": [1]}\n{\"tok\": [2]}\n{\"tok\": [3]}\n{\"tok\": [12]}\n{\"tok\": [4]}\n",
    );
    let out = temp_path("w_fail.safetensors");
    for (train_file, dev_file) in [(&bad, &good), (&good, &bad)] {
        for workers in ["1", "2"] {
            let o = train(
                &model,
                train_file,
                dev_file,
                &out,
                &["--workers", workers, "--threads", workers],
            );
            let err = text(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{workers} workers: {err}");
            assert!(
                err.contains("line 4") && err.contains("index 12 is out of range"),
                "{workers} workers: {err}"
            );
            // Which of the two files: `--train` and `--dev` fail alike.
            assert!(
                err.contains("fail_train_bad.jsonl"),
                "{workers} workers: {err}"
            );
        }
    }
}

/// Training that diverges (a learning rate of 1e30) stops with status 1 and a message at the
/// first epoch whose loss is not finite, and writes nothing: a NaN dev loss is never "the best"
/// (it was saved as the best, and then no later epoch could beat it).
#[test]
fn a_diverging_training_stops_and_keeps_no_nan_weights() {
    let data = temp_file("diverge.jsonl", &instances());
    let model = temp_file("diverge.rly", MODEL);
    let out = temp_path("diverged.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = out.display().to_string();
    let r = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--dev",
        &data,
        "--random-params",
        "3",
        "--epochs",
        "6",
        "--batch",
        "4",
        "--optimizer",
        "sgd",
        "--lr",
        "1e30",
        "--quiet",
        "-o",
        &o,
    ]);
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(
        err.contains("diverged") || err.contains("no epoch had a finite dev score"),
        "{err}"
    );
    assert!(!err.contains("NaN -> saved"), "{err}");
    assert!(!out.exists(), "{err}");
}

/// An instance whose loss is not finite at the starting weights (a log of 0) is named by its line,
/// by `grad` and by `train` (which stops before the step, not at the epoch's end blaming only the
/// learning rate), with one and two workers, and nothing is written. (Found by an audit: `grad`
/// wrote NaN gradients with status 0, `train` said the weights diverged.)
#[test]
fn a_non_finite_loss_names_its_instance() {
    let model = temp_file(
        "log0.rly",
        "def @main(%x: Tensor[(1, 3), float32], %W: Tensor[(3, 3), float32]) -> Tensor[(), float32] {\n  let %h = nn.dense(%x, %W);\n  log(sum(multiply(%h, %h)))\n}\n",
    );
    let mut lines = ["{\"x\": [[1, 2, 3]]}"; 9];
    lines[5] = "{\"x\": [[0, 0, 0]]}";
    let data = temp_file("log0.jsonl", &(lines.join("\n") + "\n"));
    let out = temp_path("log0.safetensors");
    for workers in ["1", "2"] {
        let _ = std::fs::remove_file(&out);
        let g = grad(&model, &data, &out, &["--workers", workers]);
        let err = text(&g.stderr);
        assert_eq!(g.status.code(), Some(1), "{err}");
        assert!(err.contains("line 6") && err.contains("-inf"), "{err}");
        assert!(!out.exists(), "{err}");
        let t = train(&model, &data, &data, &out, &["--workers", workers]);
        let err = text(&t.stderr);
        assert_eq!(t.status.code(), Some(1), "{err}");
        assert!(
            err.contains("line 6") && err.contains("loss is not finite on this instance"),
            "{err}"
        );
        assert!(!out.exists(), "{err}");
    }
}

/// Dropout draws a new mask every epoch (the streams were keyed by instance and --seed only, so
/// every epoch trained with the same masks: an audit's find): with a learning rate too small to
/// move the weights, the epochs' losses differ; the first epoch's equals `grad`'s draws (its loss
/// is the same as at one epoch); and replaying traces changes nothing.
#[test]
fn dropout_masks_differ_from_epoch_to_epoch() {
    let model = temp_file(
        "dropout.rly",
        "def @main(%x: Tensor[(1, 3), float32], %W: Tensor[(8, 3), float32]) -> Tensor[(), float32] {\n  let %keep = cast(greater(random.db_uniform(low=0f, high=1f, out_shape=[1, 8], out_dtype=\"float32\"), 0.5f), dtype=\"float32\");\n  let %h = multiply(tanh(nn.dense(%x, %W)), %keep);\n  sum(multiply(%h, %h))\n}\n",
    );
    let data = temp_file("dropout.jsonl", &"{\"x\": [[1, -2, 3]]}\n".repeat(6));
    let out = temp_path("dropout.safetensors");
    let losses = |extra: &[&str]| -> Vec<String> {
        let mut a = vec![
            "train",
            &model,
            "--train",
            &data,
            "--random-params",
            "1",
            "--batch",
            "3",
            "--optimizer",
            "sgd",
            "--lr",
            "1e-30",
            "--quiet",
        ];
        let o = out.display().to_string();
        a.extend_from_slice(&["-o", &o]);
        a.extend_from_slice(extra);
        let r = tumble(&a);
        let err = text(&r.stderr);
        assert_eq!(r.status.code(), Some(0), "{err}");
        err.lines()
            .filter_map(|l| l.split("train loss ").nth(1))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    let three = losses(&["--epochs", "3"]);
    assert_eq!(three.len(), 3, "{three:?}");
    assert!(three[0] != three[1] && three[1] != three[2], "{three:?}");
    assert_eq!(losses(&["--epochs", "1"])[0], three[0]);
    assert_eq!(losses(&["--epochs", "3", "--no-trace-replay"]), three);
}

/// `--eval @f` where @f takes fewer of the dev instances' arguments than @main (no label) runs,
/// without a warning about @main's weights it does not take; a weight @f declares otherwise than
/// @main is an error naming @f. (The first failed on the dev file's "unknown key", the second
/// blamed "the file"; an audit's.)
#[test]
fn eval_functions_take_what_they_need_and_errors_name_them() {
    let src = format!(
        "{MODEL}\ndef @sum_x(%x: Tensor[(3), float32]) -> Tensor[(), float32] {{ sum(%x) }}\n\
         def @wide_w(%x: Tensor[(3), float32], %w: Tensor[(5, 3), float32]) -> Tensor[(), float32] {{ sum(%w) }}\n"
    );
    let model = temp_file("eval_subset.rly", &src);
    let data = temp_file("eval_subset.jsonl", &instances());
    let out = temp_path("eval_subset.safetensors");
    let o = train(&model, &data, &data, &out, &["--eval", "@sum_x"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("dev @sum_x"), "{err}");
    assert!(!err.contains("warning"), "{err}");
    let o = train(&model, &data, &data, &out, &["--eval", "@wide_w"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--eval @wide_w") && err.contains("%w"),
        "{err}"
    );
    // On the loss itself, higher-is-better keeps the worst weights: said, not silently done.
    let o = train(&model, &data, &data, &out, &["--eval", "@main"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("warning: --eval @main"), "{err}");
}

/// A model file `name`: the sum of `nn.dense(%x, %W)` for `%x` (1, 2) and the parameter `%W`
/// (2, 2), both of `dtype`.
fn sum_of_product_model(name: &str, dtype: &str) -> String {
    temp_file(
        name,
        &format!(
            "def @main(%x: Tensor[(1, 2), {dtype}], %W: Tensor[(2, 2), {dtype}]) -> Tensor[(), {dtype}] {{\n  sum(nn.dense(%x, %W))\n}}\n"
        ),
    )
}

/// An f64 parameter is updated in f64: an SGD step of 1e-12 moves it by 1e-12 × its gradient
/// (through the f32 path every update rounded it to f32: a change of ~1e-8).
#[test]
fn f64_parameters_train_in_f64() {
    let model = sum_of_product_model("f64.rly", "float64");
    let data = temp_file("f64.jsonl", "{\"x\": [[1.0, 2.0]]}\n");
    let init = temp_path("f64_init.safetensors");
    let out = temp_path("f64_out.safetensors");
    let (i, o) = (init.display().to_string(), out.display().to_string());
    let r = tumble(&[
        "run",
        &model,
        "--inputs",
        &data,
        "--random-params",
        "0",
        "--save-params",
        &i,
    ]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let r = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--params",
        &i,
        "--optimizer",
        "sgd",
        "--lr",
        "1e-12",
        "--quiet",
        "-o",
        &o,
    ]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let read = |p: &Path| -> Vec<f64> {
        let bytes = std::fs::read(p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let w = &header["W"];
        assert_eq!(w["dtype"], "F64");
        let (s, e) = (
            w["data_offsets"][0].as_u64().unwrap() as usize,
            w["data_offsets"][1].as_u64().unwrap() as usize,
        );
        bytes[8 + n + s..8 + n + e]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (a, b) = (read(&init), read(&out));
    // dW = xᵀ · 1 for every output: rows of W (outputs) get x = [1, 2].
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        let want = -1e-12 * [1.0, 2.0][k % 2];
        assert!(((y - x) - want).abs() < 1e-15, "W[{k}] moved by {}", y - x);
    }
}

/// A step that overflows the weights after a finite loss (no --dev to notice) stops the training
/// with status 1 and writes nothing; `--epochs 0` is refused; a gradient of a model with no float
/// parameters is an error, not an empty file; an output that is a folder is refused at once.
#[test]
fn diverged_weights_empty_gradients_and_bad_outputs_are_errors() {
    let model = sum_of_product_model("overflow.rly", "float32");
    let data = temp_file("overflow.jsonl", "{\"x\": [[2.0, 2.0]]}\n");
    let out = temp_path("overflow.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = out.display().to_string();
    let base = [
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "0",
        "--quiet",
    ];
    let r = tumble(
        &[
            &base[..],
            &[
                "--optimizer",
                "sgd",
                "--lr",
                "3e38",
                "--batch",
                "1",
                "-o",
                &o,
            ],
        ]
        .concat(),
    );
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(err.contains("%W has NaN or infinite values"), "{err}");
    assert!(!out.exists());
    // Weights that are not finite to begin with are refused before the first epoch, as such.
    let nan_weights = temp_path("nan_start.safetensors");
    let mut w = BTreeMap::new();
    w.insert(
        "W".to_string(),
        Tensor::from_vec(vec![2, 2], vec![f32::NAN, 1.0, 0.5, 0.25]).unwrap(),
    );
    tumble_io::weights::save_params(&nan_weights, &w).unwrap();
    let r = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--params",
        &nan_weights.display().to_string(),
        "-o",
        &o,
    ]);
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(err.contains("before training"), "{err}");
    assert!(!err.contains("diverged") && !out.exists(), "{err}");
    let r = tumble(&[&base[..], &["--epochs", "0", "-o", &o]].concat());
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    let dir = temp_path("a_folder");
    let _ = std::fs::create_dir_all(&dir);
    let r = tumble(&[&base[..], &["-o", &dir.display().to_string()]].concat());
    assert!(
        text(&r.stderr).contains("is a folder"),
        "{}",
        text(&r.stderr)
    );
    let ints = temp_file(
        "ints.rly",
        "def @main(%x: Tensor[(2), float32], %k: Tensor[(2), int32]) -> Tensor[(), float32] {\n  sum(multiply(%x, cast(%k, dtype=\"float32\")))\n}\n",
    );
    let xs = temp_file("ints.jsonl", "{\"x\": [1.0, 2.0]}\n");
    let g = temp_path("ints_grad.safetensors");
    let _ = std::fs::remove_file(&g);
    let r = grad(&ints, &xs, &g, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", text(&r.stderr));
    assert!(
        text(&r.stderr).contains("no float parameters"),
        "{}",
        text(&r.stderr)
    );
    assert!(!g.exists());
}

/// `--timeout` stops training like Ctrl-C: at the next safe point, with status 124, saying so,
/// and the output holding the last complete checkpoint (an epoch is milliseconds here: one is
/// done long before the limit, a million are not).
#[test]
fn training_past_its_time_limit_keeps_the_last_checkpoint() {
    let model = temp_file("timeout_model.rly", MODEL);
    let data = temp_file("timeout_train.jsonl", &instances());
    let out = temp_path("timeout_out.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = out.display().to_string();
    let t = std::time::Instant::now();
    let r = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "3",
        "--epochs",
        "1000000",
        "--batch",
        "4",
        "--quiet",
        "--timeout",
        "1500ms",
        "-o",
        &o,
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.status.code(), Some(124), "{err}");
    assert!(
        err.contains("the time limit of 1.5 s passed (raise it with --timeout)"),
        "{err}"
    );
    assert!(err.contains("holds the last complete checkpoint"), "{err}");
    assert!(!err.contains("instance at line"), "{err}");
    let weights = read_safetensors(&out);
    assert!(
        weights.contains_key("w") && weights.contains_key("v"),
        "{weights:?}"
    );
}

/// A tree regression: each node's state from its own vector and its children's summed states.
const TREE_MODEL: &str = r#"
def @enc(%t: Tree[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32])
    -> Tensor[(1, 4), float32] {
  match (%t) {
    Rose(%x, Nil) => tanh(nn.dense(%x, %w)),
    Rose(%x, %cs) => {
      let %hs = @map(fn (%c: Tree[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
        @enc(%c, %w, %u)
      }, %cs);
      let %s = @foldl(fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32])
          -> Tensor[(1, 4), float32] { add(%a, %b) }, @hd(%hs), @tl(%hs));
      tanh(add(nn.dense(%x, %w), nn.dense(%s, %u)))
    },
  }
}

def @main(%t: Tree[Tensor[(1, 4), float32]], %y: Tensor[(), float32], %w: Tensor[(4, 4), float32],
          %u: Tensor[(4, 4), float32], %v: Tensor[(1, 4), float32]) -> Tensor[(), float32] {
  let %e = subtract(sum(multiply(@enc(%t, %w, %u), %v)), %y);
  multiply(%e, %e)
}
"#;

/// Trees of 1 to 7 nodes, each a different shape.
fn tree_instances() -> String {
    fn node(seed: usize, size: usize) -> String {
        let x: Vec<String> = (0..4)
            .map(|k| format!("{:.3}", ((seed * 4 + k) as f32 * 0.77).sin()))
            .collect();
        let mut children = Vec::new();
        let mut left = size.saturating_sub(1);
        let mut k = 1;
        while left > 0 {
            let take = left.min(k);
            children.push(node(seed * 3 + k, take));
            left -= take;
            k += 1;
        }
        format!(
            "{{\"Rose\": [[[{}]], [{}]]}}",
            x.join(", "),
            children.join(", ")
        )
    }
    (0..14)
        .map(|i| {
            format!(
                "{{\"t\": {}, \"y\": {:.3}}}",
                node(i, i % 7 + 1),
                (i as f32 * 0.4).cos()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Epochs after the first replay the block invocations each instance's first run recorded
/// instead of interpreting its program, training and dev instances alike: the trained weights
/// and the dev losses are the same as with `--no-trace-replay`, on one worker and on two.
#[test]
fn replayed_epochs_train_the_same_weights_as_interpreted_ones() {
    let data = temp_file("tree_replay.jsonl", &tree_instances());
    // The loss after a phase boundary too (every tree encoded, then every loss): recorded across
    // the boundary, replayed up to it and on after the barrier.
    let phased = TREE_MODEL.replace(
        "  let %e = subtract(",
        "  let %h = @enc(%t, %w, %u);\n  let %p = db.phase_change();\n  let %e = subtract(",
    );
    let phased = phased.replace(
        "sum(multiply(@enc(%t, %w, %u), %v))",
        "sum(multiply(%h, %v))",
    );
    assert!(phased.contains("db.phase_change") && phased.contains("multiply(%h, %v)"));
    for (name, text_of_model) in [("plain", TREE_MODEL), ("phased", phased.as_str())] {
        replayed_and_interpreted_agree(name, text_of_model, &data);
    }
}

/// A run of one epoch records no traces (nothing would replay them): its epoch line names none,
/// and its weights are those of `--no-trace-replay`.
#[test]
fn one_epoch_records_no_traces() {
    let data = temp_file("tree_one_epoch.jsonl", &tree_instances());
    let model = temp_file("tree_one_epoch.rly", TREE_MODEL);
    let run = |what: &str, epochs: &str, extra: &[&str]| {
        let out = temp_path(&format!("w_one_epoch_{what}.safetensors"));
        let r = train_epochs(&model, &data, &data, &out, epochs, extra);
        assert!(r.status.success(), "{}", text(&r.stderr));
        (text(&r.stderr), std::fs::read(&out).unwrap())
    };
    let (err, one) = run("one", "1", &["--optimizer", "adagrad"]);
    assert!(err.contains("dev loss") && !err.contains("traced"), "{err}");
    let (_, off) = run("off", "1", &["--optimizer", "adagrad", "--no-trace-replay"]);
    assert_eq!(one, off);
    let (err, _) = run("two", "2", &["--optimizer", "adagrad"]);
    assert!(err.contains("14 of 14 instances traced ("), "{err}");
}

fn replayed_and_interpreted_agree(name: &str, model_text: &str, data: &str) {
    let model = temp_file(&format!("tree_replay_{name}.rly"), model_text);
    let data = data.to_string();
    for workers in ["1", "2"] {
        let out = |what: &str| temp_path(&format!("w_replay_{name}_{workers}_{what}.safetensors"));
        let (replayed, interpreted) = (out("replayed"), out("interpreted"));
        let extra = [
            "--optimizer",
            "adagrad",
            "--threads",
            "2",
            "--workers",
            workers,
        ];
        let o = train(&model, &data, &data, &replayed, &extra);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains("14 of 14 instances traced ("), "{err}");
        assert!(
            err.contains("dev loss 0.") && err.contains(" (14 of 14 traced)"),
            "the dev set: {err}"
        );
        let losses = dev_losses(&err);
        assert!(losses[5] < losses[0], "{losses:?}");
        let mut off = extra.to_vec();
        off.push("--no-trace-replay");
        let o = train(&model, &data, &data, &interpreted, &off);
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert!(!text(&o.stderr).contains("traced"));
        // The dev set, evaluated after every epoch, is replayed too: the same losses.
        assert_eq!(dev_losses(&text(&o.stderr)), losses, "{workers} workers");
        assert_eq!(
            std::fs::read(&replayed).unwrap(),
            std::fs::read(&interpreted).unwrap(),
            "{name}, {workers} workers"
        );
    }
}

/// `train`'s stderr carries its progress: a reader that goes away (`2>&1 | head -1`) stopped the
/// training after the epoch whose line failed — with status 0, as when `| head` closes stdout —
/// and a failing command whose message could not be written reported success.
#[test]
fn a_closed_stderr_neither_stops_nor_hides_anything() {
    use std::process::{Command, Stdio};
    let model = temp_file("closed_stderr.rly", MODEL);
    let data = temp_file("closed_stderr.jsonl", &instances());
    let with_closed_stderr = |args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tumble"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run tumble: {e}"));
        // The reader goes away before the command writes anything.
        drop(child.stderr.take());
        child.wait().unwrap_or_else(|e| panic!("{e}"))
    };
    let full = temp_path("closed_stderr_full.safetensors");
    let piped = temp_path("closed_stderr_piped.safetensors");
    let args = |out: &Path| -> Vec<String> {
        [
            "train",
            &model,
            "--train",
            &data,
            "--dev",
            &data,
            "--random-params",
            "3",
            "--epochs",
            "4",
            "--batch",
            "4",
            "--lr",
            "0.05",
            "--optimizer",
            "sgd",
            "-o",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([out.display().to_string()])
        .collect()
    };
    let full_args = args(&full);
    let out = tumble(&full_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let piped_args = args(&piped);
    let status = with_closed_stderr(&piped_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(status.success(), "{status:?}");
    assert_eq!(
        std::fs::read(&full).unwrap(),
        std::fs::read(&piped).unwrap(),
        "the run with a closed stderr did not train every epoch"
    );
    let missing = temp_path("closed_stderr_nothing_here.jsonl");
    let status = with_closed_stderr(&[
        "grad",
        &model,
        "--inputs",
        &missing.display().to_string(),
        "--random-params",
        "3",
        "-o",
        &temp_path("closed_stderr_g.safetensors")
            .display()
            .to_string(),
    ]);
    assert_eq!(status.code(), Some(1), "a failure reported as {status:?}");
}

/// A finite loss whose gradient is not (`sqrt` at 0): `grad` wrote NaN with status 0; now it
/// names the instance and writes nothing.
#[test]
fn a_non_finite_gradient_of_a_finite_loss_names_its_instance() {
    let model = temp_file(
        "sqrt_at_zero.rly",
        "def @main(%x: Tensor[(), float32], %w: Tensor[(), float32]) -> Tensor[(), float32] {\n  \
         sqrt(multiply(multiply(%w, %w), %x))\n}\n",
    );
    let data = temp_file(
        "sqrt_at_zero.jsonl",
        "{\"x\": 1.0}\n{\"x\": 0.0}\n{\"x\": 2.0}\n",
    );
    let out = temp_path("sqrt_at_zero.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = tumble(&[
        "grad",
        &model,
        "--inputs",
        &data,
        "--random-params",
        "1",
        "--threads",
        "1",
        "-o",
        &out.display().to_string(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("instance at line 2") && err.contains("%w is not finite"),
        "{err}"
    );
    assert!(!out.exists());
    // `train` stops before the step that would make %w NaN, naming the same instance: it used
    // to take the step and blame the next mini-batch's NaN loss on an instance of its own.
    let o = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "1",
        "--batch",
        "1",
        "--epochs",
        "1",
        "--threads",
        "1",
        "--quiet",
        "-o",
        &out.display().to_string(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("instance at line 2") && err.contains("%w is not finite"),
        "{err}"
    );
    assert!(!out.exists());
}

/// The optimizer's state is held to the memory budget when it is made: Adam's two moments of a
/// large table were allocated past `--max-memory`, and the next check blamed an instance.
#[test]
fn the_optimizer_state_is_held_to_the_memory_budget() {
    let model = temp_file(
        "adam_budget.rly",
        "def @main(%tok: Tensor[(1), int32], %emb: Tensor[(2000000), float32]) -> Tensor[(), float32] {\n  \
         sum(take(%emb, %tok, axis=0))\n}\n",
    );
    let data = temp_file("adam_budget.jsonl", "{\"tok\": [3]}\n{\"tok\": [5]}\n");
    let out = temp_path("adam_budget.safetensors");
    let o = tumble(&[
        "train",
        &model,
        "--train",
        &data,
        "--random-params",
        "0",
        "--optimizer",
        "adam",
        "--max-memory",
        "20M",
        "--quiet",
        "-o",
        &out.display().to_string(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "the adam optimizer's state for %emb (2000000 weights): memory budget exceeded"
        ),
        "{err}"
    );
    assert!(!out.exists());
}

/// A child-sum tree LSTM of width 4: a leaf's gates are `split(bias_add(dense(..)))` read by
/// `sigmoid`/`tanh`, a forget gate `sigmoid(dense(..) + b)` written with `add` — every form the
/// kept forward fuses (`kept::Fusions`) — and an internal node's product a sum of two.
const TREE_LSTM: &str = r#"
def @leaf(%x: Tensor[(1, 4), float32], %W: Tensor[(12, 4), float32], %b: Tensor[(12), float32],
          Primitive=1) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %iou = split(nn.bias_add(nn.dense(%x, %W), %b), indices_or_sections=3, axis=1);
  let %c = multiply(sigmoid(%iou.0), tanh(%iou.2));
  (multiply(sigmoid(%iou.1), tanh(%c)), %c)
}

def @forget(%h: Tensor[(1, 4), float32], %c: Tensor[(1, 4), float32], %U_f: Tensor[(4, 4), float32],
            %b_f: Tensor[(4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  multiply(sigmoid(add(nn.dense(%h, %U_f), %b_f)), %c)
}

def @internal(%x: Tensor[(1, 4), float32], %hs: Tensor[(1, 4), float32], %fcs: Tensor[(1, 4), float32],
              %W: Tensor[(12, 4), float32], %U: Tensor[(12, 4), float32], %b: Tensor[(12), float32],
              Primitive=1) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %iou = split(nn.bias_add(add(nn.dense(%x, %W), nn.dense(%hs, %U)), %b),
                   indices_or_sections=3, axis=1);
  let %c = add(multiply(sigmoid(%iou.0), tanh(%iou.2)), %fcs);
  (multiply(sigmoid(%iou.1), tanh(%c)), %c)
}

def @enc(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(12, 4), float32], %U: Tensor[(12, 4), float32],
         %b: Tensor[(12), float32], %U_f: Tensor[(4, 4), float32], %b_f: Tensor[(4), float32])
    -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  match (%t) {
    Rose(%x, Nil) => @leaf(%x, %W, %b),
    Rose(%x, %cs) => {
      let %ss = @map(fn (%c: Tree[Tensor[(1, 4), float32]]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
        @enc(%c, %W, %U, %b, %U_f, %b_f)
      }, %cs);
      let %hs = @map(fn (%s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32])) -> Tensor[(1, 4), float32] {
        %s.0
      }, %ss);
      let %fs = @map(fn (%s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32])) -> Tensor[(1, 4), float32] {
        @forget(%s.0, %s.1, %U_f, %b_f)
      }, %ss);
      let %add2 = fn (%a: Tensor[(1, 4), float32], %c: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
        add(%a, %c)
      };
      @internal(%x, @foldl(%add2, @hd(%hs), @tl(%hs)), @foldl(%add2, @hd(%fs), @tl(%fs)), %W, %U, %b)
    },
  }
}

def @main(%t: Tree[Tensor[(1, 4), float32]], %y: Tensor[(), float32], %W: Tensor[(12, 4), float32],
          %U: Tensor[(12, 4), float32], %b: Tensor[(12), float32], %U_f: Tensor[(4, 4), float32],
          %b_f: Tensor[(4), float32], %v: Tensor[(1, 4), float32]) -> Tensor[(), float32] {
  let %e = subtract(sum(multiply(@enc(%t, %W, %U, %b, %U_f, %b_f).0, %v)), %y);
  multiply(%e, %e)
}
"#;

/// `tumble` with `TUMBLE_NO_KEPT_FUSION` set or not.
fn tumble_fusing(fuse: bool, args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tumble"));
    cmd.args(args).arg("--color=never");
    if !fuse {
        cmd.env("TUMBLE_NO_KEPT_FUSION", "1");
        cmd.env("TUMBLE_NO_SPLIT_VJP_FUSION", "1");
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run tumble: {e}"))
}

/// The kept forward's fusions (a product's bias and gate in its epilogue, a split's gates where
/// they lie) and the backward's (a split differentiated with its gates) change no bit: the
/// gradient and the weights trained over replayed epochs are the same files with
/// `TUMBLE_NO_KEPT_FUSION=1 TUMBLE_NO_SPLIT_VJP_FUSION=1`, and `grad --profile` shows that they
/// happened.
#[test]
fn the_kept_forward_s_fusions_change_no_bit() {
    let model = temp_file("tree_lstm.rly", TREE_LSTM);
    let data = temp_file("tree_lstm.jsonl", &tree_instances());
    let count_after = |stderr: &str, label: &str| -> u64 {
        let at = stderr
            .find(label)
            .unwrap_or_else(|| panic!("no count {label:?}: {stderr}"));
        let rest = &stderr[at + label.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("{stderr}"))
    };
    let mut files = Vec::new();
    for fuse in [true, false] {
        let g = temp_path(&format!("tree_lstm_grad_{fuse}.safetensors"));
        let o = tumble_fusing(
            fuse,
            &[
                "grad",
                &model,
                "--random-params",
                "5",
                "--inputs",
                &data,
                "--batch",
                "7",
                "--profile",
                "-o",
                &g.display().to_string(),
            ],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        let count = count_after(&text(&o.stderr), "by the kept forward ");
        // Per launch of a leaf: its bias_add and its three gates; of a forget gate: its
        // bias `add` and sigmoid; of an internal node: its three gates.
        assert_eq!(count > 0, fuse, "{count} fused operators");
        // Per launch of a leaf or an internal node: its split of the gates.
        let splits = count_after(&text(&o.stderr), "with their gates in one pass ");
        assert_eq!(splits > 0, fuse, "{splits} fused split vjps");
        let w = temp_path(&format!("tree_lstm_weights_{fuse}.safetensors"));
        let args = train_args(&model, &data, &data, &w, "3", &["--optimizer", "adagrad"]);
        let o = tumble_fusing(fuse, &args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", text(&o.stderr));
        // Epochs after the first replay their traces: the fusions there too.
        assert!(text(&o.stderr).contains("14 of 14 instances traced ("));
        files.push((std::fs::read(&g).unwrap(), std::fs::read(&w).unwrap()));
    }
    assert!(files[0].0 == files[1].0, "the gradients differ");
    assert!(files[0].1 == files[1].1, "the trained weights differ");
}
