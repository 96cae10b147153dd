//! A time limit stops `tumble data` inside a line, not only between lines: one NestedRNN
//! instance can hold hundreds of millions of ids (`--timeout 1` stopped after 4.1 s, the temp
//! file left behind once the CLI's grace ran out). The deadline is process-wide and set once, so
//! this file is its own process.

mod common;
use common::{names, run_args, scratch};

#[test]
fn a_time_limit_stops_a_huge_line_while_it_is_made() {
    let dir = scratch("time", "huge");
    let out = dir.join("out.jsonl");
    let out_s = out.display().to_string();
    let t0 = std::time::Instant::now();
    tumble_limits::set_time_limit(std::time::Duration::from_millis(300));
    let e = run_args(&[
        "nested",
        "--count",
        "1",
        "--outer-min",
        "40000000",
        "--outer-max",
        "40000000",
        "--inner-min",
        "10",
        "--inner-max",
        "10",
        "-o",
        &out_s,
    ])
    .unwrap_err();
    assert!(e.contains("time limit"), "{e}");
    assert!(e.contains("nothing was written"), "{e}");
    assert!(t0.elapsed().as_secs() < 3, "{:?}", t0.elapsed());
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}
