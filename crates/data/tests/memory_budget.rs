//! Over the memory budget, `tumble data -o FILE` stops between lines like an interrupt: the temp
//! file is removed and the error is the budget's message. The budget is process-wide: this file
//! is its own process, with the counting allocator installed as the CLI has it.

mod common;

use std::path::PathBuf;

use tumble_data::output::write_lines;
use tumble_data::DataError;
use tumble_limits::{CountingAlloc, Stop};

#[global_allocator]
static GLOBAL: CountingAlloc<std::alloc::System> = CountingAlloc(std::alloc::System);

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tumble-data-mem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The budget is the process's: the tests that set it take turns.
static BUDGET: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn over_the_budget_the_write_stops_and_leaves_nothing() {
    let _turn = BUDGET.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("over");
    let out = dir.join("out.jsonl");
    // Each line keeps 1 MiB alive; the budget runs out after a few.
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let base = tumble_limits::in_use();
    tumble_limits::set_limit(Some(base + (8 << 20)));
    let lines = (0..1000).map(|i| {
        kept.push(vec![1u8; 1 << 20]);
        Ok(format!("{{\"i\": {i}}}"))
    });
    let e = write_lines(Some(&out), lines).unwrap_err();
    tumble_limits::set_limit(None);
    assert!(
        matches!(
            &e,
            DataError::Stopped {
                stop: Stop::Memory { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("memory budget exceeded"), "{e}");
    assert!(e.to_string().contains("--max-memory"), "{e}");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A line is made whole before it is written, so a command whose lines can outgrow the budget
/// is refused before the first: one NestedRNN instance of 10⁸ × 1,000 tokens grew to 7 GB past
/// a 100 MiB budget (and a `--timeout` waited for it).
#[test]
fn a_line_that_cannot_fit_the_budget_is_refused_before_it_is_made() {
    let _turn = BUDGET.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("line");
    let out = dir.join("big.jsonl");
    let out_s = out.display().to_string();
    tumble_limits::set_limit(Some(tumble_limits::in_use() + (100 << 20)));
    let nested = [
        "nested",
        "--count",
        "1",
        "--outer-min",
        "100000000",
        "--outer-max",
        "100000000",
        "--inner-min",
        "1000",
        "--inner-max",
        "1000",
        "-o",
        &out_s,
    ];
    let t0 = std::time::Instant::now();
    let e = common::run_args(&nested).unwrap_err();
    assert!(e.contains("memory budget exceeded"), "{e}");
    assert!(t0.elapsed().as_secs() < 5, "{:?}", t0.elapsed());
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    tumble_limits::set_limit(None);
    // Lines that fit are made as before.
    let small = ["nested", "--count", "3", "-o", &out_s];
    common::run_args(&small).unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}
