//! What every x86-64 CPU runs (SSE and SSE2 are part of the baseline): the weight
//! prefetch and unpacking 4-bit blocks for the buffered tiles.

use std::arch::x86_64::*;

use super::BLOCK;

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
