//! Per-thread recycling of large `f32` buffers (the batching runtime's activations).
//!
//! A launch's outputs are large (a TreeLSTM level: rows × 512 floats, up to megabytes) and live
//! until the next level has read them. Freed to the allocator, such buffers may go back to the
//! operating system and the next launch's come from fresh pages, which the kernel zeroes on
//! first touch (TreeLSTM-large, 512 trees, 2 threads: row programs 12–113 ms without the pool
//! against 10–16 ms with it; `bench/RESULTS.md`, 2026-11-23). Here a dropped [`Buffer`]
//! (`crate::Buffer`) of at least [`MIN_POOLED`] floats is kept by the thread that drops it, up to
//! [`MAX_POOLED_BYTES`], and [`zeroed_f32`] hands it out again (zero-filled: a memset of memory
//! that is already mapped and often in cache), or [`with_capacity_f32`] empty, for outputs built by
//! appending.
//!
//! Results never depend on the pool: every buffer it hands out is zero-filled like a fresh one.
//! [`set_enabled`]`(false)` turns it off for the whole process (the CLI's `--no-buffer-pool`).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, Ordering};

/// Smaller buffers are left to the allocator, whose small-object pages are recycled anyway.
/// 16 KiB, not 64: a training step's operators one by one make outputs of tens of rows (a launch
/// of 20–60 rows of 256 floats), which the allocator served from fresh pages and `scratch_f32`
/// zero-filled at every step; pooled, they come back without either (SST training, 1,000 trees,
/// two epochs: page faults 46–52 k → 41–43 k, maximum RSS 181 → 144 MB, weights byte-identical;
/// inference's instructions unchanged to 0.1%).
pub const MIN_POOLED: usize = 4 << 10;

/// Most bytes of buffers one thread keeps.
pub const MAX_POOLED_BYTES: usize = 64 << 20;

/// Most buffers one thread keeps (bounds the search of [`zeroed_f32`]).
const MAX_POOLED: usize = 256;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Tests: [`scratch_f32`] fills with NaN, so a kernel that leaves part of a scratch output
/// unwritten shows in the results instead of passing with stale values.
static POISON_SCRATCH: AtomicBool = AtomicBool::new(false);

/// Makes every later [`scratch_f32`] buffer NaN-filled (for the differential tests).
pub fn set_poison_scratch(on: bool) {
    POISON_SCRATCH.store(on, Ordering::Relaxed);
}

thread_local! {
    static POOL: RefCell<Pool> = const { RefCell::new(Pool { bufs: Vec::new(), bytes: 0 }) };
    /// Requests this thread served from its pool.
    static HITS: Cell<u64> = const { Cell::new(0) };
}

struct Pool {
    bufs: Vec<Vec<f32>>,
    bytes: usize,
}

/// Turns recycling on or off for every thread (buffers already kept are used up, not freed).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether recycling is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// How many [`zeroed_f32`] requests of this thread a recycled buffer has served so far.
pub fn hits() -> u64 {
    HITS.try_with(Cell::get).unwrap_or(0)
}

/// `len` zeros, in a recycled buffer when this thread has one of a fitting capacity (at least
/// `len`, at most twice that, the smallest such), else in a new allocation.
pub fn zeroed_f32(len: usize) -> Vec<f32> {
    // Not `vec![0.0; len]` for a new buffer either: that asks the allocator for zeroed memory,
    // which it serves from fresh pages.
    let mut v = with_capacity_f32(len);
    v.resize(len, 0.0);
    v
}

/// `len` floats whose values are unspecified — a recycled buffer's old contents (no fill), or zeros
/// for a new one — for outputs the caller overwrites completely (a GEMM's C, whose first K block
/// stores rather than accumulates). Zero-filling such a buffer only to overwrite it cost a memset
/// per launch output (6% of MV-RNN-large).
pub fn scratch_f32(len: usize) -> Vec<f32> {
    let mut v = if len >= MIN_POOLED && enabled() {
        take(len).unwrap_or_default()
    } else {
        Vec::new()
    };
    if POISON_SCRATCH.load(Ordering::Relaxed) {
        v.clear();
        v.resize(len, f32::NAN);
    } else if v.len() >= len {
        v.truncate(len);
    } else {
        v.reserve_exact(len - v.len());
        v.resize(len, 0.0);
    }
    v
}

/// An empty vector with room for `len` floats, recycled like [`zeroed_f32`]'s, for outputs built by
/// appending (no zero fill: every element is written by the caller).
pub fn with_capacity_f32(len: usize) -> Vec<f32> {
    let mut v = if len >= MIN_POOLED && enabled() {
        take(len).unwrap_or_default()
    } else {
        Vec::new()
    };
    v.clear();
    v.reserve_exact(len);
    v
}

fn take(len: usize) -> Option<Vec<f32>> {
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        let best = p
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len && b.capacity() <= 2 * len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)?;
        let v = p.bufs.swap_remove(best);
        p.bytes -= v.capacity() * 4;
        let _ = HITS.try_with(|h| h.set(h.get() + 1));
        Some(v)
    })
    .ok()
    .flatten()
}

/// Offers a buffer being freed to this thread's pool (dropped if it is small, the pool is full or
/// recycling is off).
pub fn recycle(v: Vec<f32>) {
    let bytes = v.capacity() * 4;
    if v.capacity() < MIN_POOLED || bytes > MAX_POOLED_BYTES || !enabled() {
        return;
    }
    // During thread teardown the pool may be gone: the buffer is then simply freed.
    let _ = POOL.try_with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return;
        };
        // Full: the oldest buffers make room (the newest match the launches now running).
        while !p.bufs.is_empty()
            && (p.bufs.len() >= MAX_POOLED || p.bytes + bytes > MAX_POOLED_BYTES)
        {
            let old = p.bufs.remove(0);
            p.bytes -= old.capacity() * 4;
        }
        p.bytes += bytes;
        p.bufs.push(v);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycled_buffers_come_back_zeroed_and_only_when_they_fit() {
        let n = MIN_POOLED + 7;
        let mut a = zeroed_f32(n);
        a.iter_mut().for_each(|x| *x = 3.5);
        let ptr = a.as_ptr();
        recycle(a);
        // Too large a request (more than the capacity): not this buffer.
        let big = zeroed_f32(3 * n);
        assert_ne!(big.as_ptr(), ptr);
        // A fitting one gets it back, zero-filled.
        let before = hits();
        let b = zeroed_f32(n - 3);
        assert_eq!(hits(), before + 1);
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(b.len(), n - 3);
        assert!(b.iter().all(|&x| x == 0.0));
        // Small buffers are neither kept nor served from the pool.
        let before = hits();
        recycle(vec![1.0f32; 33]);
        let s = zeroed_f32(33);
        assert!(s.iter().all(|&x| x == 0.0));
        assert_eq!(hits(), before);
        POOL.with(|p| assert!(p.borrow().bufs.iter().all(|b| b.capacity() >= MIN_POOLED)));
    }

    #[test]
    fn scratch_buffers_have_the_length_asked_for() {
        let n = MIN_POOLED + 5;
        let mut a = zeroed_f32(n);
        a.iter_mut().for_each(|x| *x = 2.5);
        recycle(a);
        let before = hits();
        let b = scratch_f32(n - 2);
        assert_eq!(hits(), before + 1);
        assert_eq!(b.len(), n - 2);
        // A recycled buffer shorter than asked for is extended with zeros.
        let mut c = with_capacity_f32(n);
        c.resize(n / 2, 1.0);
        recycle(c);
        let d = scratch_f32(n - 1);
        assert_eq!(d.len(), n - 1);
        let s = scratch_f32(7);
        assert_eq!(s, vec![0.0; 7]);
        set_poison_scratch(true);
        let p = scratch_f32(9);
        set_poison_scratch(false);
        assert!(p.len() == 9 && p.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn buffers_for_appending_come_back_empty_with_room() {
        let n = MIN_POOLED + 33;
        let mut a = with_capacity_f32(n);
        assert!(a.is_empty() && a.capacity() >= n);
        a.resize(n, 1.5);
        let ptr = a.as_ptr();
        recycle(a);
        let before = hits();
        let b = with_capacity_f32(n - 1);
        assert_eq!(hits(), before + 1);
        assert_eq!(b.as_ptr(), ptr);
        assert!(b.is_empty() && b.capacity() >= n - 1);
    }

    #[test]
    fn the_pool_stays_within_its_bounds() {
        for _ in 0..3 * MAX_POOLED {
            recycle(Vec::with_capacity(MIN_POOLED));
        }
        recycle(Vec::with_capacity(MAX_POOLED_BYTES / 8));
        POOL.with(|p| {
            let p = p.borrow();
            assert!(p.bufs.len() <= MAX_POOLED);
            assert!(p.bytes <= MAX_POOLED_BYTES);
            assert_eq!(
                p.bytes,
                p.bufs.iter().map(|b| b.capacity() * 4).sum::<usize>()
            );
        });
    }
}
