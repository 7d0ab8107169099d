//! What every x86-64 CPU runs (SSE and SSE2 are part of the baseline): the weight
//! prefetch, unpacking 4-bit blocks for the buffered tiles, and the partial sums the float
//! tiles carry between blocks of columns.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::BLOCK;

/// A register tile's partial sums carried from one block of columns to the next, unset
/// until the first block's pass puts them (its passes start from zero registers). The float
/// tiles carry 16 KiB of them, which were cleared on every call only to be overwritten: a
/// `memset` beside the BF16 tile in a 1000-token prompt's profile. Without it, on an AMD
/// EPYC (Zen 4), 2 threads, BF16 matrices against 128 activation rows read 1.3–1.6 -> 1.7–1.9
/// GB/s of weights at 2048 columns, against 64 rows 2.0–2.2 -> 3.6–4.0 GB/s at 5632; the F16
/// tiles measured the same either way.
#[derive(Clone, Copy)]
pub(super) struct Carry<T: Copy>(MaybeUninit<T>);

impl<T: Copy> Carry<T> {
    /// Sums not yet put.
    pub(super) const UNSET: Self = Carry(MaybeUninit::uninit());

    /// The sums a pass starts from: `zero` in the first block, else what the last pass put.
    ///
    /// # Safety
    /// Unless `first`, [`Carry::put`] must have been called.
    #[inline(always)]
    pub(super) unsafe fn start(&self, first: bool, zero: T) -> T {
        if first {
            zero
        } else {
            // SAFETY: the caller guarantees a pass put the sums.
            unsafe { self.0.assume_init() }
        }
    }

    /// Keeps `sums` for the next block's pass.
    #[inline(always)]
    pub(super) fn put(&mut self, sums: T) {
        self.0 = MaybeUninit::new(sums);
    }

    /// The sums the last pass put.
    ///
    /// # Safety
    /// [`Carry::put`] must have been called.
    #[inline(always)]
    pub(super) unsafe fn sums(&self) -> &T {
        // SAFETY: the caller guarantees a pass put the sums.
        unsafe { self.0.assume_init_ref() }
    }
}

/// Prefetches the cache line holding the start of `line` into every cache level.
#[inline]
pub(super) fn prefetch_line(line: &[u8]) {
    // SAFETY: a prefetch is a hint that never faults, and SSE is part of every x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) }
}

/// The 32 values of a 4-bit block minus `offset` into `dst`.
#[inline(always)]
pub(super) fn unpack_nibbles(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
    // SAFETY: SSE2 is part of the x86-64 baseline every build of this module targets.
    unsafe { unpack_nibbles_sse2(qs, offset, dst) }
}

#[inline]
#[target_feature(enable = "sse2")]
fn unpack_nibbles_sse2(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
    assert!(qs.len() >= 16);
    // SAFETY: the assertion guarantees 16 readable bytes; loadu is unaligned.
    let raw = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let (mask, off) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(offset));
    let lo = _mm_sub_epi8(_mm_and_si128(raw, mask), off);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), off);
    // SAFETY: `dst` is 32 bytes: two unaligned 16-byte stores fill it exactly.
    unsafe {
        _mm_storeu_si128(dst.as_mut_ptr().cast(), lo);
        _mm_storeu_si128(dst.as_mut_ptr().add(16).cast(), hi);
    }
}
