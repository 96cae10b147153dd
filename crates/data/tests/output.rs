//! Streamed, atomic output: lines are written to the temp file as they are made, the result is
//! byte for byte the in-memory encoding, and an error mid-way leaves neither the target nor a
//! temp file behind. (Interrupts and the memory budget are process-wide: their tests are in
//! `interrupt.rs` and `memory_budget.rs`, each its own process.)

mod common;
use common::{names, run_args, scratch};
use std::cell::Cell;

use tumble_data::gen::{
    berxit_many, drnn_many, nested_many, BerxitConfig, DrnnConfig, NestedConfig,
};
use tumble_data::output::{write_atomically, write_lines, AtomicFile};
use tumble_data::DataError;

/// What the output was before it streamed: every line made, joined, then written.
fn in_memory(lines: &[String]) -> String {
    let mut s = String::new();
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s
}

#[test]
fn streamed_generator_output_is_the_in_memory_encoding() {
    let dir = scratch("out", "same");
    let out = dir.join("out.jsonl");
    let out_s = out.to_str().unwrap();

    run_args(&["nested", "--count", "20", "--seed", "3", "-o", out_s]).unwrap();
    let expect = in_memory(&nested_many(3, 20, &NestedConfig::default()).unwrap());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), expect);

    run_args(&["drnn", "--count", "20", "--seed", "1", "-o", out_s]).unwrap();
    let expect = in_memory(&drnn_many(1, 20, &DrnnConfig::default()).unwrap());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), expect);

    run_args(&["berxit", "--count", "3", "--seed", "2", "-o", out_s]).unwrap();
    let expect = in_memory(&berxit_many(2, 3, &BerxitConfig::default()).unwrap());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), expect);

    // write_lines straight from the generator, no CLI.
    let lines = nested_many(11, 50, &NestedConfig::default()).unwrap();
    let n = write_lines(Some(&out), lines.iter().cloned().map(Ok)).unwrap();
    assert_eq!(n, 50);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), in_memory(&lines));
    // Zero lines: an empty file.
    assert_eq!(write_lines(Some(&out), std::iter::empty()).unwrap(), 0);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "");

    assert_eq!(names(&dir), ["out.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lines_reach_the_temp_file_while_later_ones_are_still_to_be_made() {
    let dir = scratch("out", "stream");
    let out = dir.join("big.jsonl");
    // Lines larger than the writer's buffer: each one is on disk before the next is made.
    let line = format!("{{\"pad\": \"{}\"}}", "x".repeat(64 << 10));
    let seen = Cell::new(0usize);
    let lines = (0..8).map(|i| {
        if i > 0 {
            // The target is not there yet; the temp file holds the lines so far.
            let now = names(&dir);
            assert_eq!(now.len(), 1, "{now:?}");
            assert!(now[0].starts_with(".big.jsonl.tmp."), "{now:?}");
            assert!(!out.exists());
            let len = std::fs::metadata(dir.join(&now[0])).unwrap().len() as usize;
            assert!(len >= (i - 1) * (line.len() + 1), "line {i}: {len} bytes");
            assert!(len <= i * (line.len() + 1), "line {i}: {len} bytes");
            seen.set(seen.get() + 1);
        }
        Ok(line.clone())
    });
    assert_eq!(write_lines(Some(&out), lines).unwrap(), 8);
    assert_eq!(seen.get(), 7);
    assert_eq!(names(&dir), ["big.jsonl"]);
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        in_memory(&vec![line; 8])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_error_mid_way_removes_the_temp_file_and_keeps_the_target() {
    let dir = scratch("out", "err");
    let out = dir.join("out.jsonl");
    let lines = |fail_at: usize| {
        (0..10).map(move |i| {
            if i == fail_at {
                Err(DataError::Invalid(format!("line {i} is bad")))
            } else {
                Ok(format!("{{\"i\": {i}}}"))
            }
        })
    };
    // No target before: none after.
    let e = write_lines(Some(&out), lines(4)).unwrap_err();
    assert_eq!(e.to_string(), "line 4 is bad");
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    // An old target: left as it was.
    std::fs::write(&out, "old\n").unwrap();
    let e = write_lines(Some(&out), lines(0)).unwrap_err();
    assert_eq!(e.to_string(), "line 0 is bad");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "old\n");
    assert_eq!(names(&dir), ["out.jsonl"]);
    // And a good run replaces it.
    assert_eq!(write_lines(Some(&out), lines(99)).unwrap(), 10);
    assert!(std::fs::read_to_string(&out)
        .unwrap()
        .starts_with("{\"i\": 0}\n"));
    assert_eq!(names(&dir), ["out.jsonl"]);

    // A failing writer callback, likewise.
    let e = write_atomically(&out, |w| {
        w.write_all(b"partial")?;
        Err(std::io::Error::other("disk full"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("disk full"), "{e}");
    assert!(e.to_string().contains("cannot write"), "{e}");
    assert!(std::fs::read_to_string(&out)
        .unwrap()
        .starts_with("{\"i\": 0}\n"));
    assert_eq!(names(&dir), ["out.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_atomic_file_dropped_uncommitted_leaves_nothing() {
    use std::io::Write;
    let dir = scratch("out", "drop");
    let out = dir.join("x.jsonl");
    {
        let mut f = AtomicFile::create(&out).unwrap();
        f.write_all(&vec![b'a'; 1 << 20]).unwrap();
        assert!(f.temp_path().is_some_and(|t| t.exists()));
        assert_eq!(f.target(), out.as_path());
    }
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    let mut f = AtomicFile::create(&out).unwrap();
    f.write_all(b"done\n").unwrap();
    f.commit().unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "done\n");
    assert_eq!(names(&dir), ["x.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(unix)]
#[test]
fn through_a_symlink_the_target_is_written_and_the_link_kept() {
    let dir = scratch("out", "link");
    let real = dir.join("real.jsonl");
    let link = dir.join("link.jsonl");
    std::os::unix::fs::symlink("real.jsonl", &link).unwrap();
    // The link's target does not exist yet.
    let lines = nested_many(2, 4, &NestedConfig::default()).unwrap();
    write_lines(Some(&link), lines.iter().cloned().map(Ok)).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read_to_string(&real).unwrap(), in_memory(&lines));
    // A failure through the link leaves the target as it was, and no temp file.
    let e = write_lines(
        Some(&link),
        [Ok("a".to_string()), Err(DataError::Invalid("no".into()))],
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "no");
    assert_eq!(std::fs::read_to_string(&real).unwrap(), in_memory(&lines));
    assert_eq!(names(&dir), ["link.jsonl", "real.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A named pipe as the output is written in place: it stays a pipe, its reader gets the lines
/// and no temp file is left (a rename over it made it a regular file nobody read; as root,
/// `-o /dev/null` replaced the device). Skipped where `mkfifo` is missing.
#[test]
fn a_fifo_output_is_written_in_place() {
    use std::io::Read;
    let dir = scratch("out", "fifo");
    let fifo = dir.join("lines.pipe");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut got = String::new();
            std::fs::File::open(&fifo)
                .and_then(|mut f| f.read_to_string(&mut got))
                .unwrap();
            got
        })
    };
    let n = write_lines(Some(&fifo), vec![Ok("1".to_string()), Ok("2".to_string())]).unwrap();
    assert_eq!(n, 2);
    assert_eq!(reader.join().unwrap(), "1\n2\n");
    assert!(!std::fs::symlink_metadata(&fifo).unwrap().is_file());
    assert_eq!(names(&dir), ["lines.pipe"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
