//! The K-quant dot products with AVX2: ggml's own instruction sequences, so each result is
//! its portable twin's (`super`) bit for bit. Every entry point is handed out by [`dot`],
//! which takes the [`Avx2`] token.

use std::arch::x86_64::*;

use super::{KFormat, Q8KRow, QK_K};
use crate::cpu::Avx2;
use crate::quant::avx2::scale_splat;
use crate::quant::portable::hsum8;
use crate::quant::sse2::prefetch_ahead;
use crate::quant::Dot2;

/// The dot product of a weight row of `format` with an activation row.
pub(crate) fn dot(cpu: Avx2, format: KFormat) -> fn(&[u8], &Q8KRow) -> f32 {
    let _ = cpu;
    match format {
        KFormat::Q2K => q2k,
        KFormat::Q3K => q3k,
        KFormat::Q4K => q4k,
        KFormat::Q5K => q5k,
        KFormat::Q6K => q6k,
    }
}

/// Two weight rows of `format` against one activation row, one after the other: each row
/// its one-row dot product, the two rows read as two streams ([`super::rows2`] says why).
pub(crate) fn dot2(cpu: Avx2, format: KFormat) -> Dot2<Q8KRow> {
    let _ = cpu;
    match format {
        KFormat::Q2K => |w, a| w.map(|w| q2k(w, a)),
        KFormat::Q3K => |w, a| w.map(|w| q3k(w, a)),
        KFormat::Q4K => |w, a| w.map(|w| q4k(w, a)),
        KFormat::Q5K => |w, a| w.map(|w| q5k(w, a)),
        KFormat::Q6K => |w, a| w.map(|w| q6k(w, a)),
    }
}

// Handed out only by `dot` and `dot2`, which take the AVX2 token: each runs only where AVX2 and FMA
// were detected.

fn q4k(w: &[u8], a: &Q8KRow) -> f32 {
    // SAFETY: handed out by `dot`, which takes the AVX2 token.
    unsafe { q4k_avx2(w, a) }
}

fn q5k(w: &[u8], a: &Q8KRow) -> f32 {
    // SAFETY: as in `q4k`.
    unsafe { q5k_avx2(w, a) }
}

fn q6k(w: &[u8], a: &Q8KRow) -> f32 {
    // SAFETY: as in `q4k`.
    unsafe { q6k_avx2(w, a) }
}

fn q2k(w: &[u8], a: &Q8KRow) -> f32 {
    // SAFETY: as in `q4k`.
    unsafe { q2k_avx2(w, a) }
}

fn q3k(w: &[u8], a: &Q8KRow) -> f32 {
    // SAFETY: as in `q4k`.
    unsafe { q3k_avx2(w, a) }
}

/// 32 bytes at `at` of `b` (which must hold them), unaligned.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load32(b: &[u8], at: usize) -> __m256i {
    assert!(b.len() >= at + 32);
    // SAFETY: the assertion keeps the 32 bytes read inside `b`; the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast()) }
}

/// 32 activation bytes at `at`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_q8(q: &[i8], at: usize) -> __m256i {
    assert!(q.len() >= at + 32);
    // SAFETY: as in `load32`.
    unsafe { _mm256_loadu_si256(q.as_ptr().add(at).cast()) }
}

/// The sixteen block sums of super-block `i`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn bsums(a: &Q8KRow, i: usize) -> __m256i {
    load_i16x16(&a.bsums[16 * i..16 * (i + 1)])
}

/// The first sixteen i16 of `s` (which must hold them).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_i16x16(s: &[i16]) -> __m256i {
    assert!(s.len() >= 16);
    // SAFETY: the assertion keeps the 32 bytes read inside `s`; the load is unaligned.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The first eight i16 of `s` (which must hold them).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn load_i16x8(s: &[i16]) -> __m128i {
    assert!(s.len() >= 8);
    // SAFETY: the assertion keeps the 16 bytes read inside `s`; the load is unaligned.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// One super-block of a weight row beside the activation row's.
pub(super) struct SuperBlock<'a> {
    /// The weight super-block's bytes.
    pub(super) w: &'a [u8],
    /// Its 256 quantized activations.
    pub(super) q: &'a [i8],
    /// Their scale.
    pub(super) d: f32,
    /// Their sixteen block sums.
    pub(super) bsums: &'a [i16],
    /// Their eight 32-value sums.
    pub(super) sums32: &'a [i16],
}

/// The super-blocks of weight row `w` (in `format`) beside those of `a`, in order, each
/// handed out once the weight bytes a few KiB past it have been asked for
/// ([`prefetch_ahead`]). Every slice comes with its fixed length, so the kernels' loads at
/// constant offsets within it are checked at compile time rather than once per load — as
/// long as it is inlined where `format` is a constant: out of line, as LLVM left it in
/// [`super::rows2`]'s loops, the lengths and the prefetch's line count were values read at
/// run time, and every super-block paid eight bounds checks and a loop of prefetches
/// (`matvec -- <format> 1024`, one thread, on an AMD EPYC, family 26, model 2: Q2_K 4.1–4.2
/// → 3.3, Q4_K 4.6–4.7 → 3.7, Q6_K 6.0–6.2 → 3.9–4.1 ns a super-block when inlined).
#[inline(always)]
pub(super) fn super_blocks<'a>(
    w: &'a [u8],
    format: KFormat,
    a: &'a Q8KRow,
) -> impl Iterator<Item = SuperBlock<'a>> {
    let bytes = format.block_bytes();
    let blocks = w.chunks_exact(bytes);
    assert!(
        a.d.len() >= blocks.len(),
        "activation row shorter than the weight row"
    );
    blocks
        .zip(a.qs.chunks_exact(QK_K))
        .zip(&a.d)
        .zip(a.bsums.chunks_exact(16).zip(a.sums32.chunks_exact(8)))
        .map(move |(((w, q), &d), (bsums, sums32))| {
            prefetch_ahead(w.as_ptr(), bytes.div_ceil(64));
            SuperBlock {
                w,
                q,
                d,
                bsums,
                sums32,
            }
        })
}

/// The eight f32 lanes, summed as ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx")]
pub(super) fn hsum(v: __m256) -> f32 {
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly eight f32; the store is unaligned.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
    hsum8(lanes)
}

/// `K` byte-shuffle controls of `W` bytes, computed at compile time: byte `b` of control
/// `k` is the byte index `$f`.
macro_rules! shuffle_table {
    ($n:literal, $w:literal, |$k:ident, $b:ident| $f:expr) => {{
        let mut t = [[0i8; $w]; $n];
        let mut $k = 0;
        while $k < $n {
            let mut $b = 0;
            while $b < $w {
                t[$k][$b] = ($f) as i8;
                $b += 1;
            }
            $k += 1;
        }
        t
    }};
}

/// Controls repeating the i16 at byte `2k` of each 128-bit half (ggml's
/// `get_scale_shuffle_k4` rows), `k` of 0..8.
pub(super) const BROADCAST_I16: [[i8; 32]; 8] = shuffle_table!(8, 32, |k, b| 2 * k + b % 2);

/// Controls repeating i16 lane `2k` in the low 128 bits and lane `2k + 1` in the high 128
/// bits (ggml's `get_scale_shuffle_q3k` rows), `k` of 0..4.
pub(super) const SPLIT_I16: [[i8; 32]; 4] =
    shuffle_table!(4, 32, |k, b| 4 * k + 2 * (b / 16) + b % 2);

/// Controls giving byte `2k` eight times then byte `2k + 1` eight times (ggml's
/// `get_scale_shuffle` rows), `k` of 0..8.
pub(super) const SPLIT_I8: [[i8; 16]; 8] = shuffle_table!(8, 16, |k, b| 2 * k + b / 8);

/// `v`'s bytes shuffled within each 128-bit half by the 32-byte control `c`.
#[inline]
#[target_feature(enable = "avx2")]
fn shuffle(v: __m256i, c: &[i8; 32]) -> __m256i {
    // SAFETY: `c` is 32 bytes; the load is unaligned.
    _mm256_shuffle_epi8(v, unsafe { _mm256_loadu_si256(c.as_ptr().cast()) })
}

/// The [`broadcast_i16`] controls as a one-row dot product's loop should use them: hidden
/// from LLVM ([`std::hint::black_box`]), which would otherwise rewrite each constant
/// shuffle into two (a lane shift, then a `vpbroadcastw`) and leave the AVX2 Q4_K loop
/// fifteen shuffles a super-block where ggml's has eight.
#[inline]
fn broadcast_controls() -> &'static [[i8; 32]; 8] {
    std::hint::black_box(&BROADCAST_I16)
}

/// i16 lane `k` of the eight in `v`, in every lane (a `get_scale_shuffle_k4` row).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn broadcast_i16(v: __m256i, k: i32) -> __m256i {
    shuffle(v, &BROADCAST_I16[k as usize])
}

/// i16 lanes `2k` (to the low eight) and `2k + 1` (the high eight) of each 128-bit half of
/// `v` (a `get_scale_shuffle_q3k` row).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn split_i16(v: __m256i, k: i32) -> __m256i {
    shuffle(v, &SPLIT_I16[k as usize])
}

/// Bytes of scales `2k` (eight times) then `2k + 1` (eight times) of `v` (a
/// `get_scale_shuffle` row).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn split_i8(v: __m128i, k: i32) -> __m128i {
    _mm_shuffle_epi8(v, control16(&SPLIT_I8[k as usize]))
}

/// A 16-byte constant (a shuffle control or a mask) in a 128-bit register.
#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn control16(c: &[i8; 16]) -> __m128i {
    // SAFETY: `c` is sixteen bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(c.as_ptr().cast()) }
}

/// Q4_K and Q5_K's header: the eight scales as i16 in both 128-bit lanes, and the eight
/// minimums as i16. The same integers as [`super::scales_mins_k4`] (ggml's `utmp` shuffle
/// of the twelve packed bytes), worked out in one register.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_scales_mins(b: &[u8]) -> (__m256i, __m128i) {
    // Bytes 4..16 hold the 6-bit scales and minimums, `s` below; 16..20 are loaded unused.
    assert!(b.len() >= 20);
    // SAFETY: the assertion keeps the 16 bytes read inside `b`; the load is unaligned.
    let s = unsafe { _mm_loadu_si128(b.as_ptr().add(4).cast()) };
    // Scales 0..4 are s[0..4] & 63, 4..8 s[8..12] & 15 with s[0..4]'s top two bits above;
    // minimums 0..4 are s[4..8] & 63, 4..8 s[8..12] >> 4 with s[4..8]'s top two bits above.
    let low = _mm_shuffle_epi8(s, control16(&K4_LOW_BYTES));
    let top = _mm_shuffle_epi8(s, control16(&K4_TOP_BYTES));
    let kept = _mm_and_si128(low, control16(&K4_LOW_MASK));
    let nibble = _mm_and_si128(_mm_srli_epi16::<4>(low), control16(&K4_NIBBLE_MASK));
    let top = _mm_and_si128(_mm_srli_epi16::<2>(top), _mm_set1_epi8(0x30));
    let sm = _mm_or_si128(_mm_or_si128(kept, nibble), top);
    let ms = _mm256_cvtepu8_epi16(sm);
    let sc128 = _mm256_extracti128_si256::<0>(ms);
    (
        _mm256_set_m128i(sc128, sc128),
        _mm256_extracti128_si256::<1>(ms),
    )
}

/// The packed header bytes each of Q4_K's eight scales then eight minimums takes its low
/// bits from (see [`k4_scales_mins`]).
const K4_LOW_BYTES: [i8; 16] = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11];
/// The packed header bytes whose top two bits become bits 4 and 5 of scales and minimums
/// 4..8 (-1: none, a zero byte).
const K4_TOP_BYTES: [i8; 16] = [-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7];
/// The bits kept of each `K4_LOW_BYTES` byte where they are its low bits.
const K4_LOW_MASK: [i8; 16] = [63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0];
/// Where the low bits are the byte's high nibble instead (minimums 4..8).
const K4_NIBBLE_MASK: [i8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15];

/// The eight 32-byte sums of super-block `i` of `a`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn sums32(a: &Q8KRow, i: usize) -> __m128i {
    load_i16x8(&a.sums32[8 * i..8 * (i + 1)])
}

/// Sixteen i16 scales as two registers: the first eight in both 128-bit lanes, then the last
/// eight (what `split_i16` picks from).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn scale_halves(all: __m256i) -> [__m256i; 2] {
    let (lo, hi) = (
        _mm256_extracti128_si256::<0>(all),
        _mm256_extracti128_si256::<1>(all),
    );
    [_mm256_set_m128i(lo, lo), _mm256_set_m128i(hi, hi)]
}

/// Values of chunks `2j` and `2j + 1` of a Q4_K super-block (`hbits` none) or a Q5_K one
/// (its 32 high-bit bytes), as unsigned bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_values(b: &[u8], hbits: Option<__m256i>, j: usize) -> [__m256i; 2] {
    let m4 = _mm256_set1_epi8(0xF);
    let bits = load32(b, if hbits.is_some() { 48 } else { 16 } + 32 * j);
    let mut v = [
        _mm256_and_si256(bits, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
    ];
    if let Some(hbits) = hbits {
        let mone = _mm256_set1_epi8(1);
        for (k, v) in v.iter_mut().enumerate() {
            let shifted = _mm256_srl_epi16(hbits, _mm_cvtsi32_si128((2 * j + k) as i32));
            *v = _mm256_add_epi8(*v, _mm256_slli_epi16::<4>(_mm256_and_si256(shifted, mone)));
        }
    }
    v
}

/// Values of chunks `4j..4j + 4` of a Q6_K super-block, as unsigned bytes (32 above them).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q6k_values(b: &[u8], j: usize) -> [__m256i; 4] {
    let (m3, m15) = (_mm256_set1_epi8(3), _mm256_set1_epi8(15));
    let bits1 = load32(b, 64 * j);
    let bits2 = load32(b, 64 * j + 32);
    let h = load32(b, 128 + 32 * j);
    let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, m3));
    let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(12)));
    let h2 = _mm256_and_si256(h, _mm256_set1_epi8(48));
    let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(-64)));
    let high4 = |v: __m256i| _mm256_and_si256(_mm256_srli_epi16::<4>(v), m15);
    [
        _mm256_or_si256(_mm256_and_si256(bits1, m15), h0),
        _mm256_or_si256(_mm256_and_si256(bits2, m15), h1),
        _mm256_or_si256(high4(bits1), h2),
        _mm256_or_si256(high4(bits2), h3),
    ]
}

/// Q2_K's header: the sixteen scales and the sixteen minimums, each as i16 (the low and high
/// nibbles of the super-block's first sixteen bytes).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q2k_scales_mins(b: &[u8]) -> (__m256i, __m256i) {
    let m4 = _mm_set1_epi8(0xF);
    // SAFETY: the super-block's sixteen scale bytes are its first; the load is unaligned.
    let ms = unsafe { _mm_loadu_si128(b[0..16].as_ptr().cast()) };
    let scales = _mm256_cvtepi8_epi16(_mm_and_si128(ms, m4));
    let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(ms), m4));
    (scales, mins)
}

/// Q3_K's sixteen signed scales as i16 ([`super::scales_q3k`] of bytes 96..108), unpacked
/// in vector registers: scale `t`'s low four bits are a nibble of header byte `t % 8` (the
/// low one for `t < 8`), its top two bits are bits `2 (t / 4)..` of byte `8 + t % 4`.
///
/// `scales_q3k`'s word arithmetic, which this replaced, went through general registers and
/// back (`vmovd`, `vpinsrd`), and held the AVX2 one-row loop: on an AMD EPYC (Zen 5), one
/// thread, `cargo run --release -p ferrite-kernels --example matvec -- q3_k 1024`, 8.1 -> 6.4
/// ns a super-block (13.5 -> 17.1 GB/s; over 256 MiB the same), where Q2_K's takes 4.1 and
/// Q4_K's two-row loop 4.5.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q3k_scales(b: &[u8]) -> __m256i {
    // The sixteen bytes ending with the super-block's f16 scale: its twelve header bytes
    // from the third on, no read past the super-block.
    let h = &b[94..110];
    // SAFETY: `h` is sixteen bytes; the load is unaligned.
    let v = unsafe { _mm_loadu_si128(h.as_ptr().cast()) };
    let low = _mm_shuffle_epi8(v, control16(&Q3K_LOW_BYTES));
    // Scales 8..16 (the upper four words) take the high nibbles.
    let low = _mm_blend_epi16::<0xF0>(low, _mm_srli_epi16::<4>(low));
    let low = _mm_and_si128(low, _mm_set1_epi8(0xF));
    // Each 32-bit lane holds bytes 8..12 and shifts its own pair of bits down.
    let top = _mm_shuffle_epi8(v, control16(&Q3K_TOP_BYTES));
    let top = _mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6));
    let top = _mm_slli_epi32::<4>(_mm_and_si128(top, _mm_set1_epi8(3)));
    let scales = _mm_sub_epi8(_mm_or_si128(low, top), _mm_set1_epi8(32));
    _mm256_cvtepi8_epi16(scales)
}

/// For each Q3_K scale, the byte (of the sixteen [`q3k_scales`] loads, header byte `i` at
/// `2 + i`) holding its low four bits: header bytes 0..8, then the same again.
const Q3K_LOW_BYTES: [i8; 16] = [2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9];
/// For each Q3_K scale, the byte holding its top two bits: header bytes 8..12, four times.
const Q3K_TOP_BYTES: [i8; 16] = [
    10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
];

/// [`q3k_scales`] of super-block `b`, as an array: for the test that holds it to
/// [`super::scales_q3k`].
#[cfg(test)]
pub(crate) fn q3k_scales_i16(cpu: Avx2, b: &[u8]) -> [i16; 16] {
    let _ = cpu;
    let mut out = [0i16; 16];
    // SAFETY: `cpu` is the proof that AVX2 was detected; `out` is 32 bytes, stored unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), q3k_scales(b)) };
    out
}

/// Values of chunks `4j..4j + 4` of a Q2_K super-block.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q2k_values(b: &[u8], j: usize) -> [__m256i; 4] {
    let m3 = _mm256_set1_epi8(3);
    let bits = load32(b, 16 + 32 * j);
    [
        _mm256_and_si256(bits, m3),
        _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
        _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
        _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
    ]
}

/// Values of chunks `4j..4j + 4` of a Q3_K super-block (`hbits`: its 32 high-bit bytes), as
/// unsigned bytes 4 above ggml's signed values: the low two bits, and 4 where the high bit is
/// set (ggml takes 4 off where it is clear).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q3k_values(b: &[u8], hbits: __m256i, j: usize) -> [__m256i; 4] {
    let (m3, mone) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let bits = load32(b, 32 + 32 * j);
    std::array::from_fn(|k| {
        let shift = _mm_cvtsi32_si128(2 * k as i32);
        let bit = _mm_cvtsi32_si128((4 * j + k) as i32);
        let low = _mm256_and_si256(_mm256_srl_epi16(bits, shift), m3);
        let set = _mm256_and_si256(_mm256_srl_epi16(hbits, bit), mone);
        _mm256_or_si256(low, _mm256_slli_epi16::<2>(set))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_avx2(w: &[u8], a: &Q8KRow) -> f32 {
    let controls = broadcast_controls();
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for sb in super_blocks(w, KFormat::Q4K, a) {
        let b = sb.w;
        // The scales in every lane, never a scalar f16 conversion ([`scale_splat`]).
        let d = scale_splat(b, 0, sb.d);
        let dmin = _mm256_castps256_ps128(scale_splat(b, 2, -sb.d));
        let (scales, mins) = k4_scales_mins(b);
        let prod = _mm_madd_epi16(mins, load_i16x8(sb.sums32));
        acc_m = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(prod), acc_m);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..QK_K / 64 {
            let scale_l = shuffle(scales, &controls[2 * j]);
            let scale_h = shuffle(scales, &controls[2 * j + 1]);
            let [q4l, q4h] = k4_values(b, None, j);
            let q8l = load_q8(sb.q, 64 * j);
            let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
            let q8h = load_q8(sb.q, 64 * j + 32);
            let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    let acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    hsum(acc) + _mm_cvtss_f32(acc_m)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5k_avx2(w: &[u8], a: &Q8KRow) -> f32 {
    let controls = broadcast_controls();
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for sb in super_blocks(w, KFormat::Q5K, a) {
        let b = sb.w;
        let d = scale_splat(b, 0, sb.d);
        let dmin = _mm256_cvtss_f32(scale_splat(b, 2, -sb.d));
        let (scales, mins) = k4_scales_mins(b);
        let prod = _mm_madd_epi16(mins, load_i16x8(sb.sums32));
        let zero = _mm_setzero_si128();
        let hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, zero), zero);
        summs = dmin.mul_add(_mm_cvtsi128_si32(hs) as f32, summs);
        let hbits = load32(b, 16);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..QK_K / 64 {
            let scale_0 = shuffle(scales, &controls[2 * j]);
            let scale_1 = shuffle(scales, &controls[2 * j + 1]);
            let [q5_0, q5_1] = k4_values(b, Some(hbits), j);
            let q8_0 = load_q8(sb.q, 64 * j);
            let q8_1 = load_q8(sb.q, 64 * j + 32);
            let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, q8_0));
            let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, q8_1));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc) + summs
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_avx2(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for sb in super_blocks(w, KFormat::Q6K, a) {
        let b = sb.w;
        let d = scale_splat(b, 208, sb.d);
        let q8sums = load_i16x16(sb.bsums);
        // SAFETY: the super-block's sixteen scale bytes start at 192 of its 210.
        let scales = unsafe { _mm_loadu_si128(b[192..208].as_ptr().cast()) };
        let scales_16 = _mm256_cvtepi8_epi16(scales);
        let q8sclsub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(q8sums, scales_16));
        let mut sumi = _mm256_setzero_si256();
        for j in 0..QK_K / 128 {
            let base = 128 * j;
            let q4 = q6k_values(b, j);
            let mut p = [_mm256_setzero_si256(); 4];
            for (k, (p, q)) in p.iter_mut().zip(q4).enumerate() {
                let y = load_q8(sb.q, base + 32 * k);
                let scale = _mm256_cvtepi8_epi16(split_i8(scales, 4 * j as i32 + k as i32));
                *p = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q, y));
            }
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
        }
        let sumi = _mm256_sub_epi32(sumi, q8sclsub);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q2k_avx2(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for sb in super_blocks(w, KFormat::Q2K, a) {
        let b = sb.w;
        let d = scale_splat(b, 80, sb.d);
        let dmin = scale_splat(b, 82, -sb.d);
        let (scales, mins) = q2k_scales_mins(b);
        let prod = _mm256_madd_epi16(mins, load_i16x16(sb.bsums));
        acc = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), acc);
        let scales = scale_halves(scales);
        let mut sumi = _mm256_setzero_si256();
        for (j, scales) in scales.iter().enumerate() {
            let base = 128 * j;
            let q = q2k_values(b, j);
            let p: [__m256i; 4] = std::array::from_fn(|k| {
                let y = load_q8(sb.q, base + 32 * k);
                _mm256_madd_epi16(split_i16(*scales, k as i32), _mm256_maddubs_epi16(q[k], y))
            });
            let p0 = _mm256_add_epi32(p[0], p[1]);
            let p2 = _mm256_add_epi32(p[2], p[3]);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p2));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q3k_avx2(w: &[u8], a: &Q8KRow) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let mone = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    for sb in super_blocks(w, KFormat::Q3K, a) {
        let b = sb.w;
        let d = scale_splat(b, 108, sb.d);
        let scales = scale_halves(q3k_scales(b));
        let hbits = load32(b, 0);
        let mut sumi = _mm256_setzero_si256();
        for (j, scales) in scales.iter().enumerate() {
            let q3bits = load32(b, 32 + 32 * j);
            let base = 128 * j;
            let p: [__m256i; 4] = std::array::from_fn(|k| {
                let bit = _mm_cvtsi32_si128((4 * j + k) as i32);
                let low = _mm256_and_si256(
                    _mm256_srl_epi16(q3bits, _mm_cvtsi32_si128(2 * k as i32)),
                    m3,
                );
                let high = _mm256_slli_epi16::<2>(_mm256_srl_epi16(
                    _mm256_andnot_si256(hbits, _mm256_sll_epi16(mone, bit)),
                    bit,
                ));
                let y = load_q8(sb.q, base + 32 * k);
                let q8s = _mm256_maddubs_epi16(high, y);
                let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(low, y), q8s);
                _mm256_madd_epi16(split_i16(*scales, k as i32), p16)
            });
            let p0 = _mm256_add_epi32(p[0], p[1]);
            let p2 = _mm256_add_epi32(p[2], p[3]);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p2));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}
