//! Over the memory budget, `tumble data -o FILE` stops between lines like an interrupt: the temp
//! file is removed and the error is the budget's message. The budget is process-wide: this file
//! is its own process, with the counting allocator installed as the CLI has it.

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

#[test]
fn over_the_budget_the_write_stops_and_leaves_nothing() {
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
