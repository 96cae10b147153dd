//! Fresh memory faulted in ahead of its first writes, a whole region per system call.
//!
//! A loader writes its weights and the packer their panels onto pages the process has never
//! touched: each 4 KiB page then costs a page fault of its own, ~0.9–1.6 µs on the 2-vCPU VMs the
//! suite runs on (`bench/page_fault_cost.c`), a third of reading a large weights file and of
//! packing it. Asking the kernel to populate a region at once (`MADV_POPULATE_WRITE`, Linux 5.14)
//! costs under half as much a page there, and nothing changes in the memory: the pages are mapped
//! writable as if written, and their contents (zeros for fresh ones, the old bytes for present
//! ones) stay. Callers populate a chunk that fits in cache just before writing it: a region
//! populated whole ahead of its writes is zeroed from beyond the caches and then written again
//! (packing Berxit-large's weights: 215 → 270 ms so, 215 → 170 ms by chunks of 512 KiB). A first
//! run's fresh launch buffers gained nothing measurable from it (TreeLSTM-small b64, 8 pairs),
//! so the buffer pool does not call it.

/// Regions smaller than this are left to fault as they are written: the call would cost more
/// than the faults it saves.
pub const PREFAULT_MIN_BYTES: usize = 64 << 10;

/// Faults in the whole pages of `region` for writing before the caller writes them (its spare
/// capacity, `Vec::spare_capacity_mut`, or a buffer about to be overwritten). A hint: where the
/// kernel cannot (an older kernel, another OS, `TUMBLE_NO_PREFAULT=1`) the pages fault one by one
/// as they are written, as before.
pub fn prefault<T>(region: &mut [T]) {
    let bytes = std::mem::size_of_val(region);
    if bytes < PREFAULT_MIN_BYTES || crate::switch_on!("TUMBLE_NO_PREFAULT") {
        return;
    }
    populate_write(region.as_mut_ptr().cast::<u8>(), bytes);
}

#[cfg(target_os = "linux")]
fn populate_write(start: *mut u8, bytes: usize) {
    const PAGE: usize = 4096;
    let first = (start as usize).next_multiple_of(PAGE);
    let end = (start as usize + bytes) & !(PAGE - 1);
    if end <= first {
        return;
    }
    // SAFETY: [first, end) lies inside `region`, memory the caller holds exclusively (a `&mut`
    // slice) and that stays allocated for the call. MADV_POPULATE_WRITE neither reads, writes
    // nor unmaps it: it maps its pages writable, as a write fault would, and leaves their
    // contents. A failure (EINVAL before Linux 5.14, ENOMEM under memory pressure) only leaves
    // the pages to fault when written, so the result is ignored.
    unsafe {
        libc::madvise(
            first as *mut libc::c_void,
            end - first,
            libc::MADV_POPULATE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn populate_write(_start: *mut u8, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Populating keeps every byte — fresh zeros, written values, unaligned edges — and a
    /// region too small to bother with is left alone.
    #[test]
    fn prefaulting_changes_no_byte() {
        for len in [0usize, 7, PREFAULT_MIN_BYTES / 4 - 1, 100_003, 1 << 20] {
            let mut v: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            let before = v.clone();
            // An unaligned start and end inside the allocation.
            let inner = len.saturating_sub(3);
            prefault(&mut v[inner.min(1)..inner]);
            prefault(&mut v);
            assert_eq!(v, before, "len {len}");
            let mut w: Vec<u32> = Vec::with_capacity(len);
            prefault(w.spare_capacity_mut());
            w.resize(len, 0);
            assert!(w.iter().all(|&x| x == 0));
        }
    }
}
