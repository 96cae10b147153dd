//! The generators: deterministic per seed, within their documented ranges, and in sync with the
//! bundled samples.

use std::path::PathBuf;

use serde_json::Value;
use tumble_data::gen::{
    berxit_json, berxit_many, berxit_tokens, drnn, drnn_json, drnn_many, nested, nested_json,
    nested_many, BerxitConfig, DrnnConfig, NestedConfig, BERT_VOCAB_SIZE, BERXIT_SEQ_LEN, CLS_ID,
};
use tumble_data::sst::SST_VOCAB_SIZE;
use tumble_tensor::Rng;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn bundled(file: &str) -> Vec<String> {
    std::fs::read_to_string(repo().join("examples").join(file))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn nested_is_deterministic_and_in_range() {
    let cfg = NestedConfig::default();
    assert_eq!(
        (cfg.outer_min, cfg.outer_max, cfg.inner_min, cfg.inner_max),
        (1, 8, 20, 40)
    );
    assert_eq!(cfg.vocab_size as usize, SST_VOCAB_SIZE);
    let a = nested_many(7, 50, &cfg).unwrap();
    assert_eq!(a, nested_many(7, 50, &cfg).unwrap());
    assert_ne!(a, nested_many(8, 50, &cfg).unwrap());
    // A larger count extends a smaller one.
    assert_eq!(a[..10], nested_many(7, 10, &cfg).unwrap()[..]);

    let mut rng = Rng::new(1);
    let (mut inner_total, mut inner_n) = (0usize, 0usize);
    let mut outer_seen = [false; 9];
    let (mut min_id, mut max_id) = (u32::MAX, 0);
    for _ in 0..2000 {
        let seqs = nested(&mut rng, &cfg);
        assert!((1..=8).contains(&seqs.len()));
        outer_seen[seqs.len()] = true;
        for s in &seqs {
            assert!((20..=40).contains(&s.len()));
            inner_total += s.len();
            inner_n += 1;
            for &id in s {
                min_id = min_id.min(id);
                max_id = max_id.max(id);
            }
        }
    }
    assert!(outer_seen[1..].iter().all(|&s| s), "{outer_seen:?}");
    let mean = inner_total as f64 / inner_n as f64;
    assert!((mean - 30.0).abs() < 0.5, "mean inner length {mean}");
    assert!((2..100).contains(&min_id), "{min_id}");
    assert!(max_id < SST_VOCAB_SIZE as u32 && max_id > SST_VOCAB_SIZE as u32 - 100);

    // The JSON shape.
    assert_eq!(
        nested_json(&[vec![3, 9, 4], vec![8, 1], vec![]]),
        r#"{"seqs": [[[3], [9], [4]], [[8], [1]], []]}"#
    );
    let v: Value = serde_json::from_str(&a[0]).unwrap();
    let seqs = v["seqs"].as_array().unwrap();
    assert!(!seqs.is_empty());
    assert!(seqs[0][0][0].is_u64());

    // Zero-length ranges are allowed; inverted ones are not.
    let empty = NestedConfig {
        outer_min: 0,
        outer_max: 0,
        ..cfg.clone()
    };
    assert_eq!(nested_many(0, 2, &empty).unwrap(), [r#"{"seqs": []}"#; 2]);
    let bad = NestedConfig {
        inner_min: 5,
        inner_max: 4,
        ..cfg.clone()
    };
    assert!(nested_many(0, 1, &bad)
        .unwrap_err()
        .contains("inner length"));
    let bad = NestedConfig {
        vocab_size: 2,
        ..cfg
    };
    assert!(bad.validate().is_err());
}

#[test]
fn drnn_is_deterministic_and_in_range() {
    let cfg = DrnnConfig::default();
    assert_eq!(cfg.hidden, 256);
    let a = drnn_many(0, 20, &cfg).unwrap();
    assert_eq!(a, drnn_many(0, 20, &cfg).unwrap());
    assert_ne!(a, drnn_many(1, 20, &cfg).unwrap());

    let mut rng = Rng::new(3);
    let (mut sum, mut sum_sq, mut n) = (0f64, 0f64, 0usize);
    let mut depths = [0usize; 6];
    let mut widths = [0usize; 4];
    for _ in 0..400 {
        let inst = drnn(&mut rng, &cfg);
        assert_eq!(inst.latent.len(), 256);
        for &x in &inst.latent {
            assert!(x.is_finite());
            sum += f64::from(x);
            sum_sq += f64::from(x) * f64::from(x);
            n += 1;
        }
        depths[inst.max_depth as usize] += 1;
        widths[inst.max_width as usize] += 1;
    }
    let mean = sum / n as f64;
    let var = sum_sq / n as f64 - mean * mean;
    assert!(mean.abs() < 0.02, "mean {mean}");
    assert!((var - 1.0).abs() < 0.03, "variance {var}");
    assert_eq!(depths[..3], [0, 0, 0]);
    assert!(depths[3..].iter().all(|&c| c > 80), "{depths:?}");
    assert_eq!(widths[..2], [0, 0]);
    assert!(widths[2..].iter().all(|&c| c > 150), "{widths:?}");

    // JSON: a (1, H) latent and two integer scalars; floats read back as the same f32.
    let mut rng = Rng::new(9);
    let inst = drnn(
        &mut rng,
        &DrnnConfig {
            hidden: 512,
            ..cfg.clone()
        },
    );
    let v: Value = serde_json::from_str(&drnn_json(&inst)).unwrap();
    let latent = v["latent"].as_array().unwrap();
    assert_eq!(latent.len(), 1);
    let row: Vec<f32> = latent[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(row, inst.latent);
    assert_eq!(v["max_depth"].as_u64(), Some(u64::from(inst.max_depth)));
    assert_eq!(v["max_width"].as_u64(), Some(u64::from(inst.max_width)));

    for bad in [
        DrnnConfig {
            hidden: 0,
            ..cfg.clone()
        },
        DrnnConfig {
            depth_min: 0,
            ..cfg.clone()
        },
        DrnnConfig {
            width_min: 4,
            ..cfg.clone()
        },
    ] {
        assert!(drnn_many(0, 1, &bad).is_err(), "{bad:?}");
    }
}

#[test]
fn berxit_is_deterministic_and_in_range() {
    let cfg = BerxitConfig::default();
    assert_eq!(cfg.threshold, 0.9);
    let a = berxit_many(0, 10, &cfg).unwrap();
    assert_eq!(a, berxit_many(0, 10, &cfg).unwrap());
    assert_ne!(a, berxit_many(5, 10, &cfg).unwrap());
    let mut rng = Rng::new(4);
    let (mut lo, mut hi) = (u32::MAX, 0);
    for _ in 0..300 {
        let t = berxit_tokens(&mut rng, &cfg);
        assert_eq!(t.len(), BERXIT_SEQ_LEN);
        assert_eq!(t[0], CLS_ID);
        for &id in &t[1..] {
            lo = lo.min(id);
            hi = hi.max(id);
        }
    }
    assert!(lo < 20 && (BERT_VOCAB_SIZE - 20..BERT_VOCAB_SIZE).contains(&hi));

    let v: Value = serde_json::from_str(&a[0]).unwrap();
    let tokens = v["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 128);
    assert_eq!(tokens[0], 101);
    assert_eq!(v["threshold"].as_f64().map(|t| t as f32), Some(0.9f32));
    assert_eq!(
        berxit_json(&[101, 7], 0.5),
        r#"{"tokens": [101, 7], "threshold": 0.5}"#
    );
    let bad = BerxitConfig {
        threshold: f32::NAN,
        ..cfg.clone()
    };
    assert!(berxit_many(0, 1, &bad).is_err());
}

#[test]
fn variable_length_berxit_inputs_carry_positions() {
    use tumble_data::gen::{berxit_var_json, Lengths};
    assert_eq!(
        berxit_var_json(&[101, 7, 9], 0.5),
        r#"{"tokens": [101, 7, 9], "positions": [0, 1, 2], "threshold": 0.5}"#
    );
    let cfg = BerxitConfig {
        lengths: Lengths::Uniform(1, 9),
        ..BerxitConfig::default()
    };
    let lines = berxit_many(3, 200, &cfg).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let n = v["tokens"].as_array().unwrap().len();
        assert!((1..=9).contains(&n), "{line}");
        assert_eq!(v["positions"].as_array().unwrap().len(), n);
        assert_eq!(v["tokens"][0], 101);
        seen.insert(n);
    }
    assert_eq!(seen.len(), 9, "every length drawn: {seen:?}");
    // `--lengths N`: every sequence N long, with positions like the other variable forms (it
    // wrote none, as the fixed-length zoo model's form does; an audit's find).
    let all = BerxitConfig {
        lengths: Lengths::All(5),
        ..BerxitConfig::default()
    };
    for line in berxit_many(3, 4, &all).unwrap() {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["tokens"].as_array().unwrap().len(), 5, "{line}");
        assert_eq!(v["positions"], serde_json::json!([0, 1, 2, 3, 4]), "{line}");
    }
    for bad in [
        Lengths::Uniform(0, 4),
        Lengths::Uniform(5, 4),
        Lengths::Fixed(513),
    ] {
        let cfg = BerxitConfig {
            lengths: bad,
            ..BerxitConfig::default()
        };
        assert!(berxit_many(0, 1, &cfg).is_err());
    }
}

#[test]
fn bundled_generated_samples_are_current() {
    assert_eq!(
        bundled("nestedrnn.jsonl"),
        nested_many(0, 4, &NestedConfig::default()).unwrap()
    );
    let small = DrnnConfig::default();
    let large = DrnnConfig {
        hidden: 512,
        ..DrnnConfig::default()
    };
    assert_eq!(
        bundled("drnn_small.jsonl"),
        drnn_many(0, 4, &small).unwrap()
    );
    assert_eq!(
        bundled("drnn_large.jsonl"),
        drnn_many(0, 4, &large).unwrap()
    );
    assert_eq!(
        bundled("berxit.jsonl"),
        berxit_many(0, 2, &BerxitConfig::default()).unwrap()
    );
}
