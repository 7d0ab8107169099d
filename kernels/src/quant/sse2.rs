//! What every x86-64 CPU runs (SSE and SSE2 are part of the baseline): the weight
//! prefetch, unpacking 4-bit blocks for the buffered tiles, and the partial sums the float
//! tiles carry between blocks of columns.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    prefetch_at(line.as_ptr());
}

/// Prefetches the cache line holding `at` into every cache level: a hint, for any address.
#[inline]
fn prefetch_at(at: *const u8) {
    // SAFETY: a prefetch is a hint that reads no memory and faults on no address, and SSE is
    // part of every x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) }
}

/// How far past the block at hand a one-row dot product asks for weight bytes, on CPUs other
/// than Intel's ([`prefetch_distance`]).
///
/// A decode step reads every weight once, one row after the next, and with the hardware
/// prefetcher alone each core's loop waited on memory: single-threaded, the AVX2 Q4_K loop
/// ran at ~27 GB/s over a matrix in memory against ~33 over one in the caches, and Q6_K's
/// at ~31 against ~46. Asking 4 KiB ahead, one request per cache line of each block, on an
/// AMD EPYC (Zen 5), 2 threads unless said, single-stream decode of random 1.1B models:
/// - Q4_K_M: 43.1–45.6 -> 46.5–49.8 tok/s on one thread; on two, a median of 67.2 -> 73.7
///   over eight alternating runs (8 KiB ahead: 72.5, even);
/// - Q8_0: 45.2–47.6 -> 49.3–53.3 tok/s; capped to AVX2, 47.6–48.5 -> 52.4–54.2;
/// - F16: 25.7–27.9 -> 28.7–33.1 tok/s; capped to AVX2, 28.5–30.3 -> 29.1–33.9;
/// - BF16 on the AVX-512 tier without BF16 instructions: 23.3–30.4 -> 28.3–33.2 tok/s.
///
/// BF16 by `vdpbf16ps`, already at ~88 % of the read bandwidth, measured 33.4–36.6 without
/// and 33.2–34.1 with, and goes without.
const PREFETCH_AHEAD: usize = 4096;

/// [`PREFETCH_AHEAD`] on Intel CPUs. The distance that keeps a core's loop fed is about the
/// bytes one core has on their way from memory at once (its bandwidth times the latency),
/// and a core of the Intel Xeon (Sapphire Rapids class) measured here reads about half what
/// one of the Zen 5 above does (14–17 GB/s). There, 2 threads, single-stream decode, 4 KiB
/// -> 2 KiB ahead, alternating runs of the two binaries:
/// - random 1.1B F16: 9.4–9.5 -> 11.5–11.7 tok/s (53–54 -> 65–66 % of the bound);
/// - random 1.1B Q4_K_M: 30.4–31.7 -> 32.2–34.1 (3 KiB: 33.8–34.2; 1 KiB: 30.8–32.0);
/// - Q8_0, the default model's Q4_1 and a random model of Llama 3 8B's layer shape in Q4_K_M
///   even (27.3–28.5 -> 27.0–28.8; 209–224 -> 200–221; 20.9–21.2 -> 20.5–21.1).
const INTEL_PREFETCH_AHEAD: usize = 2048;

/// How far ahead [`prefetch_ahead`] asks: [`PREFETCH_AHEAD`] until [`tune_prefetch`] sets
/// this CPU's distance. A relaxed load, no check: the dot products ask once per block.
static DISTANCE: AtomicUsize = AtomicUsize::new(PREFETCH_AHEAD);

/// Sets [`prefetch_ahead`]'s distance for this CPU: [`INTEL_PREFETCH_AHEAD`] on Intel's,
/// [`PREFETCH_AHEAD`] elsewhere. Called by [`crate::cpu::detect`], which hands out the
/// tokens every x86 kernel takes, so it has run before any dot product; the distance is a
/// hint only and changes no result.
pub(crate) fn tune_prefetch() {
    let distance = if is_intel() {
        INTEL_PREFETCH_AHEAD
    } else {
        PREFETCH_AHEAD
    };
    DISTANCE.store(distance, Ordering::Relaxed);
}

/// The distance [`tune_prefetch`] set.
#[inline]
fn prefetch_distance() -> usize {
    DISTANCE.load(Ordering::Relaxed)
}

/// Whether the CPU's vendor string (CPUID leaf 0) is Intel's, "GenuineIntel".
fn is_intel() -> bool {
    // The twelve bytes come in ebx, edx, ecx, in that order, each little-endian.
    let id = __cpuid(0);
    [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes) == [*b"Genu", *b"ineI", *b"ntel"]
}

/// Asks for `lines` cache lines from [`prefetch_distance`] bytes past `b`: a hint, with no
/// effect on any result. The address may lie past the row or the weights; nothing reads it.
#[inline]
pub(super) fn prefetch_ahead(b: *const u8, lines: usize) {
    let ahead = prefetch_distance();
    for l in 0..lines {
        prefetch_at(b.wrapping_add(ahead + 64 * l));
    }
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

#[cfg(test)]
mod tests {
    /// The vendor string read from CPUID is the one Linux reports: the prefetch distance
    /// follows the vendor, so a byte-order slip would give Intel CPUs the other distance.
    #[test]
    fn the_vendor_string_is_the_one_linux_reports() {
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
            tell!("no /proc/cpuinfo here: the vendor check was not run");
            return;
        };
        let Some(vendor) = crate::cpu::cpuinfo_field(&cpuinfo, "vendor_id") else {
            tell!("/proc/cpuinfo names no vendor_id: the vendor check was not run");
            return;
        };
        assert_eq!(
            super::is_intel(),
            vendor == "GenuineIntel",
            "vendor_id {vendor:?}"
        );
        super::tune_prefetch();
        let expected = if vendor == "GenuineIntel" {
            super::INTEL_PREFETCH_AHEAD
        } else {
            super::PREFETCH_AHEAD
        };
        assert_eq!(super::prefetch_distance(), expected);
    }
}
