//! K-quant dot products of two weight rows with one activation row on AVX-512: each
//! 512-bit register holds the first row's 256-bit lanes of ggml's AVX2 loop in its low half
//! and the second row's in its high half, so every instruction of [`super::avx2`]'s loop
//! does both rows' work and each half computes exactly what that loop computes for its row
//! (the same integer lanes, the same fused multiply-adds, the same reduction): each result
//! is the one-row dot product's bit for bit.
//!
//! This is the decode step's path (one activation row; more take [`super::tile`]'s tiles),
//! and what it gains is reading two streams of weights where the one-row loop read one:
//! from the caches the loop is no faster than one row after the other (one thread, a 2-core
//! Xeon, family 6, model 207: Q4_K 17.5 against 19.5 GB/s, Q6_K 20 against 25), but decode
//! of a random 1.1B Q4_K_M model went from 34.3–37.2 to 42.5–46.3 tok/s on two threads,
//! where the AVX2 loop run on two rows one after the other ([`super::avx2::dot2`]) gave
//! 41.6–43.0, and on one thread 18.2–19.1 to 23.1–23.4 against 19.2–22.4. On an AMD EPYC
//! (family 26, model 2) it is faster from the caches too (one thread, 1 MiB of 2048-value
//! rows from L2, `matvec -- <format> 1024`, against the same run capped to AVX2): Q2_K 3.3
//! against 3.8–4.1 ns a super-block, Q3_K 4.5 against 6.1–6.3, Q4_K 3.7 against 4.6–4.7,
//! Q6_K 3.9–4.1 against 5.1–5.3; with the activation chunks doubled
//! ([`Q8KRow::doubled`]) Q2_K 2.9, Q3_K 4.3, Q4_K 3.4–3.5, Q6_K 3.7.

use std::arch::x86_64::*;

use super::avx2::{
    control16, hsum, k4_scales_mins, load32, load_i16x16, load_i16x8, q2k_scales_mins, q3k_scales,
    super_blocks, SuperBlock, BROADCAST_I16, SPLIT_I16, SPLIT_I8,
};
use super::{KFormat, Q8KRow, QK_K};
use crate::cpu::Avx512;
use crate::quant::avx2::scale_splat;
use crate::quant::sse2::prefetch_ahead;
use crate::quant::Dot2;

/// The two-row dot product for `format`. Q3_K's AVX2 loop on one row after the other, then
/// on two rows at once here (one thread, 1 MiB of 2048-value rows from L2, `matvec -- q3_k
/// 1024`, alternating, on an AMD EPYC, family 26, model 2): 6.3–6.4 → 4.5 ns a super-block.
/// A 2-core Xeon (family 6, model 207) had measured the opposite (4.8–5.0 against 4.0–4.1
/// GB/s) when [`pairs`] was not inlined and paid, every super-block, bounds checks and a
/// prefetch loop of run-time length; it was not at hand to measure again.
pub(crate) fn dot2(cpu: Avx512, format: KFormat) -> Dot2<Q8KRow> {
    let _ = cpu;
    match format {
        KFormat::Q2K => q2k,
        KFormat::Q3K => q3k,
        KFormat::Q4K => q4k,
        KFormat::Q5K => q5k,
        KFormat::Q6K => q6k,
    }
}

// Handed out only by `dot2`, which takes the AVX-512 token (F, BW, VL and the AVX2 tier).

fn q4k(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    // SAFETY: handed out by `dot2`, which takes the AVX-512 token.
    unsafe { k4_rows2::<false>(w, a) }
}

fn q5k(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    // SAFETY: as in `q4k`.
    unsafe { k4_rows2::<true>(w, a) }
}

fn q6k(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    // SAFETY: as in `q4k`.
    unsafe { q6k_rows2(w, a) }
}

fn q2k(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    // SAFETY: as in `q4k`.
    unsafe { q2k_rows2(w, a) }
}

fn q3k(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    // SAFETY: as in `q4k`.
    unsafe { q3k_rows2(w, a) }
}

/// The super-blocks of two weight rows (as long as each other) beside the activation row's:
/// the first row's as [`super_blocks`] hands them out, the second's bytes beside them,
/// asked for as far ahead, and the activation super-block's bytes [`Q8KRow::doubled`] (512).
/// Inlined always, as [`super_blocks`] is, so `format` is a constant in both.
#[inline(always)]
fn pairs<'a>(
    w: [&'a [u8]; 2],
    format: KFormat,
    a: &'a Q8KRow,
) -> impl Iterator<Item = (SuperBlock<'a>, [&'a [u8]; 2], &'a [i8])> {
    assert_eq!(
        w[0].len(),
        w[1].len(),
        "two weight rows as long as each other"
    );
    assert_eq!(
        a.doubled.len(),
        2 * a.qs.len(),
        "the AVX-512 two-row dot products read activation rows from quantize_row_q8k_doubled"
    );
    let bytes = format.block_bytes();
    super_blocks(w[0], format, a)
        .zip(w[1].chunks_exact(bytes))
        .zip(a.doubled.chunks_exact(2 * QK_K))
        .map(move |((sb, second), y2)| {
            prefetch_ahead(second.as_ptr(), bytes.div_ceil(64));
            let b = [sb.w, second];
            (sb, b, y2)
        })
}

/// The 256-bit `lo` and `hi` as one register, `lo` in the low half.
#[inline]
#[target_feature(enable = "avx512f")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The f32 `lo` and `hi` as one register, `lo` in the low half.
#[inline]
#[target_feature(enable = "avx512f")]
fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castsi512_ps(join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)))
}

/// 32 bytes at `at` of each row's super-block, the first row's in the low half.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn pair32(b: [&[u8]; 2], at: usize) -> __m512i {
    join(load32(b[0], at), load32(b[1], at))
}

/// The 32 activation bytes at `at` of a super-block, in both halves: 64 bytes at `2 at` of
/// its bytes [`Q8KRow::doubled`] (`y2`).
#[inline]
#[target_feature(enable = "avx512f")]
fn both(y2: &[i8], at: usize) -> __m512i {
    let y = &y2[2 * at..2 * at + 64];
    // SAFETY: `y` is 64 bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512(y.as_ptr().cast()) }
}

/// A 32-byte shuffle control in both halves of a 512-bit register.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn control512(c: &[i8; 32]) -> __m512i {
    // SAFETY: `c` is 32 bytes; the load is unaligned.
    _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(c.as_ptr().cast()) })
}

/// A 16-byte shuffle control in both halves of a 256-bit register.
#[inline]
#[target_feature(enable = "avx2")]
fn control256(c: &[i8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(control16(c))
}

/// Each row's sixteen i16 scales (`scales`: the first row's in the low 256 bits) as
/// [`super::avx2::scale_halves`] gives them, both rows at once: scales `8j..8j + 8` in both
/// 128-bit lanes of each row's half.
#[inline]
#[target_feature(enable = "avx512f")]
fn scale_halves(scales: __m512i) -> [__m512i; 2] {
    [
        _mm512_shuffle_i64x2::<0b10_10_00_00>(scales, scales),
        _mm512_shuffle_i64x2::<0b11_11_01_01>(scales, scales),
    ]
}

/// The two rows' f32 accumulators, reduced each as ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn hsums(acc: __m512) -> [f32; 2] {
    let lo = _mm512_castps512_ps256(acc);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    [hsum(lo), hsum(hi)]
}

/// Values of chunks `2j` and `2j + 1` of both rows' Q4_K super-blocks (`hbits` none) or Q5_K
/// ones (their 32 high-bit bytes each), as unsigned bytes: [`super::avx2::k4_values`] on
/// both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn k4_values(b: [&[u8]; 2], hbits: Option<__m512i>, j: usize) -> [__m512i; 2] {
    let m4 = _mm512_set1_epi8(0xF);
    let bits = pair32(b, if hbits.is_some() { 48 } else { 16 } + 32 * j);
    let mut v = [
        _mm512_and_si512(bits, m4),
        _mm512_and_si512(_mm512_srli_epi16::<4>(bits), m4),
    ];
    if let Some(hbits) = hbits {
        let one = _mm512_set1_epi8(1);
        for (k, v) in v.iter_mut().enumerate() {
            let shifted = _mm512_srl_epi16(hbits, _mm_cvtsi32_si128((2 * j + k) as i32));
            *v = _mm512_add_epi8(*v, _mm512_slli_epi16::<4>(_mm512_and_si512(shifted, one)));
        }
    }
    v
}

/// Q4_K (`FIVE` false) or Q5_K: ggml's AVX2 loops (`q4k_avx2`, `q5k_avx2` in
/// [`super::avx2`]) on two rows at once, the minimums' terms row by row as there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn k4_rows2<const FIVE: bool>(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    let format = if FIVE { KFormat::Q5K } else { KFormat::Q4K };
    let controls: [__m512i; 8] = std::array::from_fn(|k| control512(&BROADCAST_I16[k]));
    let mut acc = _mm512_setzero_ps();
    // Q4_K's minimums go into four f32 lanes per row, Q5_K's into a scalar per row.
    let mut acc_m = [_mm_setzero_ps(); 2];
    let mut summs = [0f32; 2];
    for (sb, b, y2) in pairs(w, format, a) {
        let d = join_ps(scale_splat(b[0], 0, sb.d), scale_splat(b[1], 0, sb.d));
        let mut scales = [_mm256_setzero_si256(); 2];
        for r in 0..2 {
            let dmin = scale_splat(b[r], 2, -sb.d);
            let (sc, mins) = k4_scales_mins(b[r]);
            scales[r] = sc;
            let prod = _mm_madd_epi16(mins, load_i16x8(sb.sums32));
            if FIVE {
                let zero = _mm_setzero_si128();
                let hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, zero), zero);
                let dmin = _mm256_cvtss_f32(dmin);
                summs[r] = dmin.mul_add(_mm_cvtsi128_si32(hs) as f32, summs[r]);
            } else {
                let dmin = _mm256_castps256_ps128(dmin);
                acc_m[r] = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(prod), acc_m[r]);
            }
        }
        let scales = join(scales[0], scales[1]);
        let hbits = FIVE.then(|| pair32(b, 16));
        let mut sumi = _mm512_setzero_si512();
        for j in 0..QK_K / 64 {
            let scale_l = _mm512_shuffle_epi8(scales, controls[2 * j]);
            let scale_h = _mm512_shuffle_epi8(scales, controls[2 * j + 1]);
            let [q4l, q4h] = k4_values(b, hbits, j);
            let p16l = _mm512_madd_epi16(scale_l, _mm512_maddubs_epi16(q4l, both(y2, 64 * j)));
            let q8h = both(y2, 64 * j + 32);
            let p16h = _mm512_madd_epi16(scale_h, _mm512_maddubs_epi16(q4h, q8h));
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(p16l, p16h));
        }
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    let sums = hsums(acc);
    std::array::from_fn(|r| {
        if FIVE {
            sums[r] + summs[r]
        } else {
            let m = acc_m[r];
            let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            sums[r] + _mm_cvtss_f32(m)
        }
    })
}

/// Values of chunks `4j..4j + 4` of both rows' Q6_K super-blocks, as unsigned bytes (32
/// above them): [`super::avx2::q6k_values`] on both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn q6k_values(b: [&[u8]; 2], j: usize) -> [__m512i; 4] {
    let (m3, m15) = (_mm512_set1_epi8(3), _mm512_set1_epi8(15));
    let bits1 = pair32(b, 64 * j);
    let bits2 = pair32(b, 64 * j + 32);
    let h = pair32(b, 128 + 32 * j);
    let h0 = _mm512_slli_epi16::<4>(_mm512_and_si512(h, m3));
    let h1 = _mm512_slli_epi16::<2>(_mm512_and_si512(h, _mm512_set1_epi8(12)));
    let h2 = _mm512_and_si512(h, _mm512_set1_epi8(48));
    let h3 = _mm512_srli_epi16::<2>(_mm512_and_si512(h, _mm512_set1_epi8(-64)));
    let high4 = |v: __m512i| _mm512_and_si512(_mm512_srli_epi16::<4>(v), m15);
    [
        _mm512_or_si512(_mm512_and_si512(bits1, m15), h0),
        _mm512_or_si512(_mm512_and_si512(bits2, m15), h1),
        _mm512_or_si512(high4(bits1), h2),
        _mm512_or_si512(high4(bits2), h3),
    ]
}

/// Q6_K: ggml's AVX2 loop (`q6k_avx2` in [`super::avx2`]) on two rows at once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn q6k_rows2(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    let controls: [__m256i; 8] = std::array::from_fn(|k| control256(&SPLIT_I8[k]));
    let mut acc = _mm512_setzero_ps();
    for (sb, b, y2) in pairs(w, KFormat::Q6K, a) {
        let d = join_ps(scale_splat(b[0], 208, sb.d), scale_splat(b[1], 208, sb.d));
        let q8sums = _mm512_broadcast_i64x4(load_i16x16(sb.bsums));
        // Each row's sixteen scale bytes (192..208 of its 210) in its 128-bit half.
        // SAFETY: each row's slice is sixteen bytes; the loads are unaligned.
        let [s0, s1] = b.map(|b| unsafe { _mm_loadu_si128(b[192..208].as_ptr().cast()) });
        let scales = _mm256_set_m128i(s1, s0);
        let scales_16 = _mm512_cvtepi8_epi16(scales);
        let q8sclsub = _mm512_slli_epi32::<5>(_mm512_madd_epi16(q8sums, scales_16));
        let mut sumi = _mm512_setzero_si512();
        for j in 0..QK_K / 128 {
            let q4 = q6k_values(b, j);
            let mut p = [_mm512_setzero_si512(); 4];
            for (k, (p, q)) in p.iter_mut().zip(q4).enumerate() {
                let y = both(y2, 128 * j + 32 * k);
                let scale = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(scales, controls[4 * j + k]));
                *p = _mm512_madd_epi16(scale, _mm512_maddubs_epi16(q, y));
            }
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(p[0], p[1]));
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(p[2], p[3]));
        }
        let sumi = _mm512_sub_epi32(sumi, q8sclsub);
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    hsums(acc)
}

/// Q2_K: ggml's AVX2 loop (`q2k_avx2` in [`super::avx2`]) on two rows at once, the
/// minimums' multiply-add into the same accumulator before the values', as there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn q2k_rows2(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    let controls: [__m512i; 4] = std::array::from_fn(|k| control512(&SPLIT_I16[k]));
    let m3 = _mm512_set1_epi8(3);
    let mut acc = _mm512_setzero_ps();
    for (sb, b, y2) in pairs(w, KFormat::Q2K, a) {
        let d = join_ps(scale_splat(b[0], 80, sb.d), scale_splat(b[1], 80, sb.d));
        let dmin = join_ps(scale_splat(b[0], 82, -sb.d), scale_splat(b[1], 82, -sb.d));
        let [(s0, m0), (s1, m1)] = b.map(|b| q2k_scales_mins(b));
        let bsums = _mm512_broadcast_i64x4(load_i16x16(sb.bsums));
        let prod = _mm512_madd_epi16(join(m0, m1), bsums);
        acc = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(prod), acc);
        let scales = scale_halves(join(s0, s1));
        let mut sumi = _mm512_setzero_si512();
        for (j, scales) in scales.iter().enumerate() {
            let bits = pair32(b, 16 + 32 * j);
            let p: [__m512i; 4] = std::array::from_fn(|k| {
                let shift = _mm_cvtsi32_si128(2 * k as i32);
                let q = _mm512_and_si512(_mm512_srl_epi16(bits, shift), m3);
                let y = both(y2, 128 * j + 32 * k);
                let scale = _mm512_shuffle_epi8(*scales, controls[k]);
                _mm512_madd_epi16(scale, _mm512_maddubs_epi16(q, y))
            });
            let p0 = _mm512_add_epi32(p[0], p[1]);
            let p2 = _mm512_add_epi32(p[2], p[3]);
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(p0, p2));
        }
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    hsums(acc)
}

/// Q3_K: ggml's AVX2 loop (`q3k_avx2` in [`super::avx2`]) on two rows at once: four times
/// the activation subtracted where a value's high bit is clear, as there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn q3k_rows2(w: [&[u8]; 2], a: &Q8KRow) -> [f32; 2] {
    let controls: [__m512i; 4] = std::array::from_fn(|k| control512(&SPLIT_I16[k]));
    let (m3, one) = (_mm512_set1_epi8(3), _mm512_set1_epi8(1));
    let mut acc = _mm512_setzero_ps();
    for (sb, b, y2) in pairs(w, KFormat::Q3K, a) {
        let d = join_ps(scale_splat(b[0], 108, sb.d), scale_splat(b[1], 108, sb.d));
        let scales = scale_halves(join(q3k_scales(b[0]), q3k_scales(b[1])));
        let hbits = pair32(b, 0);
        let mut sumi = _mm512_setzero_si512();
        for (j, scales) in scales.iter().enumerate() {
            let bits = pair32(b, 32 + 32 * j);
            let p: [__m512i; 4] = std::array::from_fn(|k| {
                let bit = _mm_cvtsi32_si128((4 * j + k) as i32);
                let low =
                    _mm512_and_si512(_mm512_srl_epi16(bits, _mm_cvtsi32_si128(2 * k as i32)), m3);
                let high = _mm512_slli_epi16::<2>(_mm512_srl_epi16(
                    _mm512_andnot_si512(hbits, _mm512_sll_epi16(one, bit)),
                    bit,
                ));
                let y = both(y2, 128 * j + 32 * k);
                let q8s = _mm512_maddubs_epi16(high, y);
                let p16 = _mm512_sub_epi16(_mm512_maddubs_epi16(low, y), q8s);
                _mm512_madd_epi16(_mm512_shuffle_epi8(*scales, controls[k]), p16)
            });
            let p0 = _mm512_add_epi32(p[0], p[1]);
            let p2 = _mm512_add_epi32(p[2], p[3]);
            sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(p0, p2));
        }
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    hsums(acc)
}
