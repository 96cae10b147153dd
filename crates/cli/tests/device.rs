//! `tumble run --device cuda`: on a machine without a GPU, a clear error and no output; on one
//! with a GPU, every zoo model (small and large) at mini-batches of 8 and 64 computes what the CPU
//! engine computes, within 1e-4.
//!
//! CI has no GPU, so there this checks the error path; the GPU half runs where one is present (the
//! development workplace's GPU machine runs this test binary, see bench/gpu_check.sh).

mod common;

use common::{compare, root, text, tumble};

/// `examples/NAME.jsonl`'s instances repeated to 72 (a mini-batch of 64 and a partial one).
fn inputs_72(name: &str, dir: &std::path::Path) -> String {
    let src = std::fs::read_to_string(root().join("examples").join(name)).unwrap_or_default();
    let lines: Vec<&str> = src.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no instances in {name}");
    let all: Vec<&str> = lines.iter().copied().cycle().take(72).collect();
    let path = dir.join(name);
    std::fs::write(&path, all.join("\n") + "\n").unwrap_or_else(|e| panic!("{e}"));
    path.display().to_string()
}

fn model(m: &str) -> String {
    root().join(format!("models/{m}.rly")).display().to_string()
}

/// Where `tumble run` of model `m` on `inputs` at mini-batch `batch` on `device` does not compute
/// what it computes on the CPU (within 1e-4): a message, or `None`.
fn disagreement(m: &str, inputs: &str, batch: &str, device: &str) -> Option<String> {
    let run = |device: &str| {
        tumble(&[
            "run",
            &model(m),
            "--inputs",
            inputs,
            "--random-params",
            "0",
            "--batch",
            batch,
            "--device",
            device,
        ])
    };
    let (cpu, dev) = (run("cpu"), run(device));
    if !cpu.status.success() || !dev.status.success() {
        return Some(format!(
            "{m} b{batch}: cpu {} / {device} {}: {}",
            cpu.status,
            dev.status,
            text(&dev.stderr)
        ));
    }
    let (c, g) = (text(&cpu.stdout), text(&dev.stdout));
    let (cl, gl): (Vec<&str>, Vec<&str>) = (c.lines().collect(), g.lines().collect());
    if cl.len() != gl.len() {
        return Some(format!("{m} b{batch}: {} vs {} lines", gl.len(), cl.len()));
    }
    for (i, (gline, cline)) in gl.iter().zip(&cl).enumerate() {
        let parse = |s: &str| serde_json::from_str::<serde_json::Value>(s);
        let mut errs = Vec::new();
        match (parse(gline), parse(cline)) {
            (Ok(gv), Ok(cv)) => compare(&gv, &cv, "", &mut errs),
            _ => errs.push("not JSON".into()),
        }
        if let Some(e) = errs.first() {
            return Some(format!("{m} b{batch} instance {i}: {e}"));
        }
    }
    None
}

/// The GPU executor on the emulated device (`--device emulated`, hidden: a developers' tool) from
/// the command line, where start-up puts the weights on the device: embedding lookups, row lists
/// gathered from the weights' and earlier launches' device copies, per-invocation products.
#[test]
fn device_emulated_runs_as_the_cpu_does() {
    let dir = std::env::temp_dir().join(format!("tumble-emulated-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for (m, ex) in [
        ("treelstm_small", "treelstm.jsonl"),
        ("mvrnn_small", "mvrnn.jsonl"),
        ("birnn_small", "birnn.jsonl"),
    ] {
        let inputs = inputs_72(ex, &dir);
        for batch in ["8", "64"] {
            failures.extend(disagreement(m, &inputs, batch, "emulated"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn device_cuda_runs_the_zoo_as_the_cpu_does_or_says_why_not() {
    let gpu = tumble_cuda::Gpu::open(0);
    if let Err(why) = &gpu {
        // No GPU here: one clear error, nothing written to stdout, a failure status.
        let out = tumble(&[
            "run",
            &model("treelstm_small"),
            "--inputs",
            &root().join("examples/treelstm.jsonl").display().to_string(),
            "--random-params",
            "0",
            "--device",
            "cuda",
        ]);
        assert!(!out.status.success());
        assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
        let err = text(&out.stderr);
        assert!(err.contains("--device cuda:"), "{err}");
        assert!(err.contains(&why.to_string()), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        eprintln!("no GPU here ({why}): checked the error path only");
        return;
    }
    drop(gpu);
    let dir = std::env::temp_dir().join(format!("tumble-device-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let cases = [
        ("treelstm", "treelstm.jsonl"),
        ("mvrnn", "mvrnn.jsonl"),
        ("birnn", "birnn.jsonl"),
        ("nestedrnn", "nestedrnn.jsonl"),
        ("stackrnn", "stackrnn.jsonl"),
        ("berxit", "berxit.jsonl"),
    ];
    let mut failures = Vec::new();
    let mut runs: Vec<(String, String)> = Vec::new();
    for (kind, ex) in cases {
        let inputs = inputs_72(ex, &dir);
        for size in ["small", "large"] {
            runs.push((format!("{kind}_{size}"), inputs.clone()));
        }
    }
    for size in ["small", "large"] {
        let ex = format!("drnn_{size}.jsonl");
        runs.push((format!("drnn_{size}"), inputs_72(&ex, &dir)));
    }
    // `TUMBLE_DEVICE_TEST_MODELS=mvrnn,berxit`: only the models whose names contain one of these
    // (a short run on the GPU machine).
    if let Ok(only) = std::env::var("TUMBLE_DEVICE_TEST_MODELS") {
        runs.retain(|(m, _)| only.split(',').any(|o| !o.is_empty() && m.contains(o)));
    }
    for (m, inputs) in &runs {
        for batch in ["8", "64"] {
            failures.extend(disagreement(m, inputs, batch, "cuda"));
            eprintln!("{m} b{batch}: compared");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
