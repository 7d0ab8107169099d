//! Read-only byte arenas backed by transparent huge pages, for the model's weights.
//!
//! A decode step streams every weight once, ~100 MB for the default model: with 4 KiB pages
//! that is some 25 000 pages, far beyond what the TLB holds, so the weight loads keep
//! waiting on page walks. In one 2 MiB-aligned allocation advised for huge pages
//! (`MADV_HUGEPAGE`, which Linux honours in its default `madvise` mode as well as in
//! `always`), the same weights span ~50 pages. Elsewhere, or where the kernel declines, the
//! arena is ordinary memory and only the speed differs.

use std::alloc::{self, Layout};
use std::ops::{Deref, Range};
use std::ptr::NonNull;

/// The huge-page size the arena is aligned to (x86-64 and most arm64 kernels).
const HUGE_PAGE: usize = 2 << 20;

/// Where each part's bytes start in an arena: a multiple of a cache line, so no part's
/// first row shares a line with the part before it.
const PART_ALIGN: usize = 64;

/// An immutable byte buffer aligned to [`HUGE_PAGE`] and advised for huge pages.
#[derive(Debug)]
pub struct HugePages {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is owned (freed only in `Drop`) and never written after construction,
// so sharing or sending it between threads is as safe as for a `Box<[u8]>`.
unsafe impl Send for HugePages {}
// SAFETY: as above: after construction only shared reads happen.
unsafe impl Sync for HugePages {}

impl HugePages {
    /// One arena holding `parts` one after another (each start a multiple of 64 bytes), and
    /// where each part lies in it. Each part is dropped once copied, and the memory freed so
    /// is handed back to the OS as the copy goes ([`release_freed`]): parts that own their
    /// bytes (a model's weights) would otherwise stay resident beside the arena, the
    /// allocator keeping them for reuse.
    pub fn pack<P: Deref<Target = [u8]>>(parts: Vec<P>) -> (Self, Vec<Range<usize>>) {
        let mut ranges = Vec::with_capacity(parts.len());
        let mut end = 0usize;
        for p in &parts {
            let start = end.next_multiple_of(PART_ALIGN);
            end = start + p.len();
            ranges.push(start..end);
        }
        let size = end.max(1).next_multiple_of(HUGE_PAGE);
        let layout = match Layout::from_size_align(size, HUGE_PAGE) {
            Ok(layout) => layout,
            Err(_) => panic!("an arena of {size} bytes exceeds the address space"),
        };
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        // Advised before the first write, so the first touch of each 2 MiB faults in a
        // huge page rather than small pages for the kernel to merge some day.
        advise_huge_pages(ptr, size);
        let (mut at, mut unreleased) = (0, 0);
        for (p, r) in parts.into_iter().zip(&ranges) {
            // SAFETY: `at <= r.start` and `r.end <= end <= size`: the writes (the padding
            // before the part, zeroed, then the part) stay inside the allocation, whose
            // bytes nothing else can see yet; `p` cannot overlap memory just allocated.
            unsafe {
                std::ptr::write_bytes(ptr.as_ptr().add(at), 0, r.start - at);
                std::ptr::copy_nonoverlapping(p.as_ptr(), ptr.as_ptr().add(r.start), p.len());
            }
            at = r.end;
            unreleased += p.len();
            drop(p);
            if unreleased >= RELEASE_EVERY {
                release_freed();
                unreleased = 0;
            }
        }
        release_freed();
        (
            HugePages {
                ptr,
                len: end,
                layout,
            },
            ranges,
        )
    }
}

impl Deref for HugePages {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `pack` wrote all of the first `len` bytes (the parts and the padding
        // between them); they are owned by `self` and never written again.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        // SAFETY: allocated in `pack` with exactly this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Bytes copied into an arena between hand-backs of freed memory: often enough that packing
/// holds little more than the arena, rarely enough that the allocator's walks cost nothing.
const RELEASE_EVERY: usize = 16 << 20;

/// Hands memory the allocator holds free back to the OS. glibc keeps freed blocks of all
/// but the largest sizes in its heap, resident, for reuse; weights copied into an arena are
/// freed once and never reused.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_freed() {
    // SAFETY: `malloc_trim` only returns free heap memory to the OS; it touches no live
    // allocation.
    let _ = unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_freed() {}

/// Asks Linux to back `len` bytes at `ptr` (aligned to [`HUGE_PAGE`]) with huge pages when
/// they are first touched; a refusal (an old kernel, THP disabled) leaves small pages.
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: `ptr..ptr + len` is one live allocation of ours; the advice changes how its
    // pages are backed, never their contents (the zeroed memory stays zero).
    let _ = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: NonNull<u8>, _: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_parts_read_back_as_given_each_on_its_own_cache_line() {
        let parts: [&[u8]; 4] = [&[1, 2, 3], &[], &[4; 100], &[5]];
        let (arena, ranges) = HugePages::pack(parts.to_vec());
        for (p, r) in parts.iter().zip(&ranges) {
            assert_eq!(&arena[r.clone()], *p);
            assert_eq!(r.start % PART_ALIGN, 0);
        }
        assert_eq!(arena.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(arena.len(), ranges[3].end);
    }

    #[test]
    fn an_empty_arena_is_empty() {
        let (arena, ranges) = HugePages::pack(Vec::<Vec<u8>>::new());
        assert!(arena.is_empty() && ranges.is_empty());
    }
}
