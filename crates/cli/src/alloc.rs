//! The process's allocator: mimalloc, asked for plain blocks wherever plain blocks are aligned
//! enough.
//!
//! `mimalloc::MiMalloc` passes every request to `mi_malloc_aligned`, whose fast path only serves
//! blocks up to 1 KiB; anything larger (a tensor of 257 floats or more, a row list, a frame's
//! slots) takes its generic aligned path, which over-allocates by the alignment and aligns within
//! the block (~160 instructions a call in callgrind). `mi_malloc` serves those from its size
//! classes directly. It returns blocks aligned to 16 bytes (8 for blocks under 16), the same
//! guarantee the system allocator gives, so a layout asking no more than that gets `mi_malloc`.
//! Every layout tumble itself allocates does (buffers that need 64 bytes or 2 MiB, such as
//! `tumble_kernels`' packed weights, align an offset inside a plain `Vec<f32>`); a stricter one
//! from a dependency still gets `mi_malloc_aligned`.

use libmimalloc_sys::{
    mi_free, mi_malloc, mi_malloc_aligned, mi_realloc, mi_realloc_aligned, mi_zalloc,
    mi_zalloc_aligned,
};
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// The alignment `mi_malloc` guarantees for a block of at least this many bytes
/// (`MI_MAX_ALIGN_SIZE`).
const PLAIN_ALIGN: usize = 16;

/// mimalloc, with plain allocation where the alignment allows it (see the module's comment).
pub struct MiMallocPlain;

/// Whether `mi_malloc(size)` meets `align`: blocks are aligned to 16 bytes, or to their size
/// below that (the rule the standard library's own `System` allocator applies to `malloc`).
#[inline]
fn plain_fits(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// `plain(size)` where [`plain_fits`], else `aligned(size, align)`: mimalloc's allocating entry
/// points (plain or zeroed) for one layout.
///
/// # Safety
/// As for [`GlobalAlloc::alloc`]: `layout` has a non-zero size.
#[inline]
unsafe fn alloc_with(
    layout: Layout,
    plain: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    // SAFETY: both are mimalloc allocation functions, valid for any size and (`aligned`) any
    // power-of-two alignment, which a `Layout` guarantees.
    unsafe {
        if plain_fits(layout.size(), layout.align()) {
            plain(layout.size()) as *mut u8
        } else {
            aligned(layout.size(), layout.align()) as *mut u8
        }
    }
}

// SAFETY: every method forwards to the mimalloc function for the same request (plain or aligned,
// by `plain_fits`, which only picks the plain one where its guaranteed alignment meets the
// layout's), and `dealloc`/`realloc` receive pointers this allocator returned, which `mi_free`
// and `mi_realloc` accept whichever way they were allocated.
unsafe impl GlobalAlloc for MiMallocPlain {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl's comment.
        unsafe { alloc_with(layout, mi_malloc, mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl's comment.
        unsafe { alloc_with(layout, mi_zalloc, mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (the `GlobalAlloc` contract).
        unsafe { mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` (the `GlobalAlloc` contract);
        // the plain reallocation keeps the 16-byte (or size) alignment `plain_fits` checks
        // against the new size.
        unsafe {
            if plain_fits(new_size, layout.align()) {
                mi_realloc(ptr as *mut c_void, new_size) as *mut u8
            } else {
                mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout this allocator serves comes back aligned as asked, survives a write over its
    /// whole length, and keeps its contents across growing and shrinking reallocations, plain
    /// and aligned, including the sizes on either side of mimalloc's 1 KiB small-block limit.
    #[test]
    fn blocks_are_aligned_and_keep_their_contents() {
        let a = MiMallocPlain;
        for align in [1usize, 2, 4, 8, 16, 32, 64, 4096] {
            for size in [
                1usize, 3, 8, 15, 16, 17, 100, 1023, 1024, 1025, 3000, 70_000,
            ] {
                let Ok(layout) = Layout::from_size_align(size, align) else {
                    continue;
                };
                for (zeroed, new_size) in [(false, size * 3 + 1), (true, (size / 2).max(1))] {
                    // SAFETY: `layout` has a non-zero size; each block is used within its
                    // current size and freed once, with the layout it last had.
                    unsafe {
                        let p = if zeroed {
                            a.alloc_zeroed(layout)
                        } else {
                            a.alloc(layout)
                        };
                        assert!(!p.is_null());
                        assert_eq!(p as usize % align, 0, "size {size} align {align}");
                        if zeroed {
                            assert!((0..size).all(|i| *p.add(i) == 0));
                        }
                        for i in 0..size {
                            *p.add(i) = (i % 251) as u8;
                        }
                        let kept = size.min(new_size);
                        let q = a.realloc(p, layout, new_size);
                        assert!(!q.is_null());
                        assert_eq!(q as usize % align, 0, "realloc {size} -> {new_size}");
                        assert!((0..kept).all(|i| *q.add(i) == (i % 251) as u8));
                        let grown = Layout::from_size_align_unchecked(new_size, align);
                        let back = a.realloc(q, grown, size);
                        assert!(!back.is_null());
                        assert_eq!(back as usize % align, 0, "realloc back to {size}");
                        assert!((0..kept).all(|i| *back.add(i) == (i % 251) as u8));
                        a.dealloc(back, layout);
                    }
                }
            }
        }
    }
}

/// mimalloc's `mi_option_purge_delay` in the `mi_option_e` of the v3 header libmimalloc-sys
/// builds (the crate names only some options as constants).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// mimalloc's own purge delay (v3), in milliseconds.
#[cfg(test)]
const MI_DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// How long freed memory stays mapped before mimalloc hands it back to the OS, unless the user
/// set `MIMALLOC_PURGE_DELAY` (1000 restores mimalloc's default). A transformer layer at batch
/// 64 takes about as long as mimalloc's 1 s, so its large buffers were handed back between one
/// layer freeing them and the next allocating them again, and faulted in afresh: Berxit-small at
/// batch 64 took 408,000–432,000 page faults a run, 305,000 with this delay (sys 1.0–1.3 s →
/// 0.8 s; on this project's VMs a page the host took back costs more again).
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
    #[cfg(test)]
    fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
}

/// Sets mimalloc's purge delay to [`PURGE_DELAY_MS`] unless `MIMALLOC_PURGE_DELAY` is set.
pub fn keep_freed_memory_a_while() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` only stores the option's value (mimalloc reads it when it next
    // decides whether to purge); any value is valid for this option.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
}

#[cfg(test)]
mod purge_tests {
    /// The option index is mimalloc's purge delay: its default read back, then the value set.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reading an option's value.
        let get = || unsafe { super::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert_eq!(get(), super::MI_DEFAULT_PURGE_DELAY_MS);
        super::keep_freed_memory_a_while();
        assert_eq!(get(), super::PURGE_DELAY_MS);
    }
}
