//! f16 <-> f32 eight values at a time with the F16C instructions: the same IEEE
//! conversions (round to nearest even) as the `half` crate's, without a call per row.
//! F16C belongs to the AVX2 tier; each entry point takes its token.

use std::arch::x86_64::*;

use half::f16;

use crate::cpu::Avx2;

/// `dst[i] = one(src[i])` over the shorter slice's length: `eight` takes exactly eight
/// of each at a time, `one` the rest.
#[inline]
fn by_eights<S: Copy, D>(
    src: &[S],
    dst: &mut [D],
    eight: impl Fn(&[S], &mut [D]),
    one: impl Fn(S) -> D,
) {
    let n = src.len().min(dst.len());
    let whole = n / 8 * 8;
    for (s, d) in src[..whole]
        .chunks_exact(8)
        .zip(dst[..whole].chunks_exact_mut(8))
    {
        eight(s, d);
    }
    for (s, d) in src[whole..n].iter().zip(&mut dst[whole..n]) {
        *d = one(*s);
    }
}

/// Widens `src` into `dst` (same length).
#[inline]
pub(super) fn widen(cpu: Avx2, src: &[f16], dst: &mut [f32]) {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX and F16C.
    unsafe { widen_f16c(src, dst) }
}

#[inline]
#[target_feature(enable = "avx,f16c")]
fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    // SAFETY: `by_eights` hands over eight values of each slice, so the unaligned load and
    // store touch exactly their 16 (f16) and 32 (f32) bytes.
    let eight = |s: &[f16], d: &mut [f32]| unsafe {
        _mm256_storeu_ps(
            d.as_mut_ptr(),
            _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast())),
        );
    };
    by_eights(src, dst, eight, f16::to_f32);
}

/// Narrows `src` into `dst` (same length), rounding to nearest even.
#[inline]
pub(super) fn narrow(cpu: Avx2, src: &[f32], dst: &mut [f16]) {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX and F16C.
    unsafe { narrow_f16c(src, dst) }
}

#[inline]
#[target_feature(enable = "avx,f16c")]
fn narrow_f16c(src: &[f32], dst: &mut [f16]) {
    // SAFETY: as in `widen_f16c`.
    let eight = |s: &[f32], d: &mut [f16]| unsafe {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
        _mm_storeu_si128(d.as_mut_ptr().cast(), h);
    };
    by_eights(src, dst, eight, f16::from_f32);
}

/// Rounds every value of `x` to f16 and back.
#[inline]
pub(super) fn round(cpu: Avx2, x: &mut [f32]) {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX and F16C.
    unsafe { round_f16c(x) }
}

#[inline]
#[target_feature(enable = "avx,f16c")]
fn round_f16c(x: &mut [f32]) {
    let whole = x.len() / 8 * 8;
    for c in x[..whole].chunks_exact_mut(8) {
        // SAFETY: `c` holds eight f32, loaded and stored unaligned, exactly those bytes.
        unsafe {
            let v = _mm256_loadu_ps(c.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for v in &mut x[whole..] {
        *v = f16::from_f32(*v).to_f32();
    }
}
