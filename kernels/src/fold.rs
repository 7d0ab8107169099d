//! Sums of two 512-bit vectors' lanes, pairwise, in the shapes the kernels' transposed
//! reduction trees use: each step halves how many lanes hold a vector's partial sums, and
//! packs two vectors' partial sums into one register, so many vectors reduce at once with
//! the same additions, in the same order, as reducing each alone.

use std::arch::x86_64::*;

/// `[a_i + a_{i+8} | b_i + b_{i+8}]` for `i < 8`: each vector's upper half onto its lower.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn halves(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
    )
}

/// For two vectors of two 8-lane halves each: every half's lanes `i + 4` onto `i`, giving
/// `[a_lo | a_hi | b_lo | b_hi]` in 128-bit quarters.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn quarters(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
    )
}

/// In every 128-bit quarter: `[a_0 + a_2, a_1 + a_3, b_0 + b_2, b_1 + b_3]`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn pairs(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
        _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
    )
}
