//! A request body refused for the memory budget says whether it can ever fit: past the whole
//! budget it is too large (a server's 413), within it but not beside what is in use now it is
//! refused for now (a server's 503). Small requests were told 413 — "never" — while one large
//! request held the memory (an audit's find).

use std::alloc::System;

use tumble_io::{read_request_instances, IoError};
use tumble_limits::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc<System> = CountingAlloc(System);

/// Bytes a parsed JSON document is reckoned to take per byte of its text (the reader's
/// `PARSED_BYTES_PER_TEXT_BYTE`).
const PARSED_BYTES_PER_TEXT_BYTE: usize = 32;

fn refusal(body: &[u8]) -> IoError {
    match read_request_instances(body, "instances", "request") {
        Ok(_) => panic!("a body of {} bytes was taken", body.len()),
        Err(e) => e,
    }
}

fn body(text_bytes: usize) -> Vec<u8> {
    let items = "1,".repeat(text_bytes / 2);
    format!("{{\"instances\": [{items}0]}}").into_bytes()
}

#[test]
fn a_body_refused_for_memory_says_whether_it_can_ever_fit() {
    const MIB: usize = 1 << 20;
    let small = body(MIB / 4);
    let large = body(4 * MIB);
    // The large one once parsed is past the whole budget; the small one fits alone.
    let limit = 64 * MIB;
    assert!(large.len() * PARSED_BYTES_PER_TEXT_BYTE > limit);
    assert!(small.len() * PARSED_BYTES_PER_TEXT_BYTE < limit / 4);
    tumble_limits::set_limit(Some(limit));

    assert!(read_request_instances(&small, "instances", "request").is_ok());
    let e = refusal(&large);
    assert!(matches!(e, IoError::TooLarge { .. }), "{e}");

    // Most of the budget held elsewhere: the small body is refused for now only.
    let held = vec![1u8; 60 * MIB];
    let e = refusal(&small);
    assert!(matches!(e, IoError::NoRoomNow { .. }), "{e}");
    assert!(e.to_string().contains("would not fit once parsed"), "{e}");
    drop(held);
    assert!(read_request_instances(&small, "instances", "request").is_ok());
    tumble_limits::set_limit(None);
}
