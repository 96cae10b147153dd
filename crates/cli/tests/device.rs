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

#[test]
fn device_cuda_runs_the_zoo_as_the_cpu_does_or_says_why_not() {
    let model = |m: &str| root().join(format!("models/{m}.rly")).display().to_string();
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
            let args = |device: &'static str| {
                vec![
                    "run".to_string(),
                    model(m),
                    "--inputs".into(),
                    inputs.clone(),
                    "--random-params".into(),
                    "0".into(),
                    "--batch".into(),
                    batch.into(),
                    "--device".into(),
                    device.into(),
                ]
            };
            let run = |device| {
                let a = args(device);
                let a: Vec<&str> = a.iter().map(String::as_str).collect();
                tumble(&a)
            };
            let (cpu, gpu) = (run("cpu"), run("cuda"));
            if !cpu.status.success() || !gpu.status.success() {
                failures.push(format!(
                    "{m} b{batch}: cpu {} / cuda {}: {}",
                    cpu.status,
                    gpu.status,
                    text(&gpu.stderr)
                ));
                continue;
            }
            let (c, g) = (text(&cpu.stdout), text(&gpu.stdout));
            let (cl, gl): (Vec<&str>, Vec<&str>) = (c.lines().collect(), g.lines().collect());
            if cl.len() != gl.len() {
                failures.push(format!("{m} b{batch}: {} vs {} lines", gl.len(), cl.len()));
                continue;
            }
            for (i, (gline, cline)) in gl.iter().zip(&cl).enumerate() {
                let parse = |s: &str| serde_json::from_str::<serde_json::Value>(s);
                let mut errs = Vec::new();
                match (parse(gline), parse(cline)) {
                    (Ok(gv), Ok(cv)) => compare(&gv, &cv, "", &mut errs),
                    _ => errs.push("not JSON".into()),
                }
                if let Some(e) = errs.first() {
                    failures.push(format!("{m} b{batch} instance {i}: {e}"));
                    break;
                }
            }
            eprintln!("{m} b{batch}: compared");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
