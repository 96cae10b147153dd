//! An interrupt (Ctrl-C) stops `tumble data -o FILE` between lines: the temp file is removed,
//! nothing is at FILE (an old FILE is left as it was) and the error says so. The interrupt flag
//! is process-wide and sticky, so this file is its own process and its one test runs the cases
//! in order: before the interrupt, then after it.

mod common;
use common::{names, run_args, scratch};

use tumble_data::output::write_lines;
use tumble_data::DataError;
use tumble_limits::Stop;

#[test]
fn interrupted_writes_leave_nothing() {
    assert!(!tumble_limits::interrupted());
    an_interrupt_mid_write_leaves_no_file_and_no_temp_file();
    once_interrupted_data_commands_write_nothing();
}

fn an_interrupt_mid_write_leaves_no_file_and_no_temp_file() {
    let dir = scratch("int", "mid");
    let out = dir.join("out.jsonl");
    // Ctrl-C arrives while line 5 of 1000 is being made; the lines so far (large enough to
    // have reached the temp file) are thrown away.
    let pad = "x".repeat(16 << 10);
    let mut temp_seen = false;
    let lines = (0..1000).map(|i| {
        if i == 5 {
            let now = names(&dir);
            temp_seen = now.len() == 1 && now[0].starts_with(".out.jsonl.tmp.");
            tumble_limits::interrupt();
        }
        Ok(format!("{{\"i\": {i}, \"pad\": \"{pad}\"}}"))
    });
    let e = write_lines(Some(&out), lines).unwrap_err();
    assert!(temp_seen);
    assert!(
        matches!(&e, DataError::Stopped { stop: Stop::Interrupted, path: Some(p) } if p == &out),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!("interrupted; nothing was written to {}", out.display())
    );
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn once_interrupted_data_commands_write_nothing() {
    assert!(tumble_limits::interrupted());
    let dir = scratch("int", "cli");
    let out = dir.join("out.jsonl");
    let out_s = out.to_str().unwrap();
    for args in [
        vec!["nested", "--count", "20", "--seed", "3"],
        vec!["drnn", "--count", "20", "--seed", "1"],
        vec!["berxit", "--count", "3", "--seed", "2"],
    ] {
        let mut full = args.clone();
        full.extend(["-o", out_s]);
        let e = run_args(&full).unwrap_err();
        assert_eq!(
            e,
            format!("interrupted; nothing was written to {out_s}"),
            "{args:?}"
        );
        assert!(names(&dir).is_empty(), "{args:?}: {:?}", names(&dir));
    }
    // An existing file is left as it was.
    std::fs::write(&out, "old\n").unwrap();
    let e = run_args(&["nested", "--count", "2", "-o", out_s]).unwrap_err();
    assert!(e.starts_with("interrupted; nothing was written to"), "{e}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "old\n");
    assert_eq!(names(&dir), ["out.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
