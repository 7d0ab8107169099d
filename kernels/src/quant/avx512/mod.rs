//! The quantized products with AVX-512: the one-row dot product (two blocks per 512-bit
//! register), the packed tile for a few activation rows (two weight rows per register,
//! each block unpacked once in registers for all rows) and, in [`wide`], the kernel for
//! batches. Every entry point takes the [`Avx512Vnni`] token.

pub(super) mod bf16;
pub(super) mod float;
pub(crate) mod wide;

use std::arch::x86_64::*;

use super::avx2::{self, lanes};
use super::portable::hsum8;
use super::sse2::prefetch_ahead;
use super::{Batched, BlockFormat, Dot, Dot2, PackedTile, QuantizedRow, BLOCK};
use crate::cpu::Avx512Vnni;

/// The four outputs of two paired accumulators (rows 0-1, 2-3): each half reduced as
/// [`hsum8`] does, plus the row's `m · s` sum for Q4_1 (`with_mins`).
#[inline]
#[target_feature(enable = "avx512f")]
fn finish_rows(acc: [__m512; 2], summs: __m128, with_mins: bool) -> [f32; 4] {
    let mut m = [0f32; 4];
    // SAFETY: `m` holds exactly four f32.
    unsafe { _mm_storeu_ps(m.as_mut_ptr(), summs) };
    let mut out = [0f32; 4];
    for (p, pair) in acc.iter().enumerate() {
        let mut all = [0f32; 16];
        // SAFETY: `all` holds exactly sixteen f32.
        unsafe { _mm512_storeu_ps(all.as_mut_ptr(), *pair) };
        for half in 0..2 {
            let mut l = [0f32; 8];
            l.copy_from_slice(&all[half * 8..half * 8 + 8]);
            let row = 2 * p + half;
            out[row] = hsum8(l) + if with_mins { m[row] } else { 0.0 };
        }
    }
    out
}

/// The 32-byte values of block `at` of two Q8_0 rows, one row per 256-bit half.
///
/// # Safety
/// Both rows must hold 32 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn row_pair_q8(a: &[u8], b: &[u8], at: usize) -> __m512i {
    // SAFETY: the caller guarantees 32 readable bytes at `at` in both rows.
    unsafe {
        let lo = _mm256_loadu_si256(a.as_ptr().add(at).cast());
        let hi = _mm256_loadu_si256(b.as_ptr().add(at).cast());
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// The 16 packed bytes at `at` of each of two rows, each as it is and shifted right by four
/// bits, laid out `[a, a >> 4, b, b >> 4]` (16 bytes each; the shifted copies keep the
/// neighbouring byte's low bits in their high nibbles).
///
/// # Safety
/// Both rows must hold 16 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn row_pair_shifted(a: &[u8], b: &[u8], at: usize) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes at `at` in both rows.
    let y = unsafe {
        let lo = _mm_loadu_si128(a.as_ptr().add(at).cast());
        let hi = _mm_loadu_si128(b.as_ptr().add(at).cast());
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
    };
    // [a, b] -> [a, a, b, b], every second copy shifted.
    let z = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
        _mm512_castsi256_si512(y),
    );
    let four = 0x0004_0004_0004_0004;
    _mm512_srlv_epi16(z, _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four))
}

/// The 32 values of the 4-bit block whose 16 packed bytes start at `at` in each of two
/// rows, minus `shift`, laid out `[a lo, a hi, b lo, b hi]` (16 bytes each).
///
/// # Safety
/// Both rows must hold 16 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn row_pair_q4(a: &[u8], b: &[u8], at: usize, shift: i8) -> __m512i {
    // SAFETY: the caller's guarantee.
    let z = unsafe { row_pair_shifted(a, b, at) };
    let z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
    _mm512_sub_epi8(z, _mm512_set1_epi8(shift))
}

/// Q4_0 weights, for the `F` parameter of [`packed_avx512`].
const FMT_Q4_0: u8 = 0;
/// Q4_1 weights (unsigned values and a minimum per block).
const FMT_Q4_1: u8 = 1;
/// Q8_0 weights.
const FMT_Q8_0: u8 = 2;
/// Q5_0 weights (the one-row products only).
const FMT_Q5_0: u8 = 3;
/// Q5_1 weights (the one-row products only).
const FMT_Q5_1: u8 = 4;

/// The weight format an `F` parameter names.
const fn block_format(f: u8) -> BlockFormat {
    match f {
        FMT_Q8_0 => BlockFormat::Q8_0,
        FMT_Q4_1 => BlockFormat::Q4_1,
        _ => BlockFormat::Q4_0,
    }
}

/// The 32-value format an `F` parameter names, the 5-bit ones included.
const fn batched(f: u8) -> Batched {
    match f {
        FMT_Q5_0 => Batched::Q5_0,
        FMT_Q5_1 => Batched::Q5_1,
        f => Batched::Block(block_format(f)),
    }
}

/// Four GGUF weight rows of format `F` against `R` activation rows, two weight rows per
/// 512-bit register (lanes 0..8 the first, 8..16 the second), unpacking each block
/// straight from the GGUF bytes once for all `R` rows (no round trip through memory): the
/// lanes, scales and fused multiply-adds of every output are exactly the 256-bit kernel's.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn packed_avx512<const F: u8, const R: usize>(
    w: [&[u8]; 4],
    acts: &[QuantizedRow],
    out: &mut [[f32; 4]],
) {
    let stride = block_format(F).block_bytes();
    let unsigned = F == FMT_Q4_1;
    assert!(acts.len() == R && out.len() == R);
    let nb = acts[0].d.len();
    assert!(w.iter().all(|r| r.len() == nb * stride));
    assert!(acts
        .iter()
        .all(|a| a.d.len() == nb && a.q.len() == nb * BLOCK));
    assert!(!unsigned || acts.iter().all(|a| a.s.len() == nb));
    // [d0 m0 d1 m1 d2 m2 d3 m3] -> [d0 x8, d1 x8] and [d2 x8, d3 x8]; m as four lanes.
    let pair01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let pair23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    let mins = _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut summs = [_mm_setzero_ps(); R];
    for i in 0..nb {
        let at = i * stride;
        // SAFETY: every row holds `nb` blocks of `stride` bytes (asserted), so each read
        // below stays inside block `i` of its row; all loads are unaligned.
        let (qx, heads) = unsafe {
            let head = |r: usize| (w[r].as_ptr().add(at) as *const u32).read_unaligned();
            let heads = _mm_setr_epi32(
                head(0) as i32,
                head(1) as i32,
                head(2) as i32,
                head(3) as i32,
            );
            let qx = match F {
                FMT_Q8_0 => [
                    row_pair_q8(w[0], w[1], at + 2),
                    row_pair_q8(w[2], w[3], at + 2),
                ],
                FMT_Q4_1 => [
                    row_pair_q4(w[0], w[1], at + 4, 0),
                    row_pair_q4(w[2], w[3], at + 4, 0),
                ],
                _ => [
                    row_pair_q4(w[0], w[1], at + 2, 8),
                    row_pair_q4(w[2], w[3], at + 2, 8),
                ],
            };
            (qx, heads)
        };
        let dm = _mm512_castps256_ps512(_mm256_cvtph_ps(heads));
        let scales = [
            _mm512_permutexvar_ps(pair01, dm),
            _mm512_permutexvar_ps(pair23, dm),
        ];
        let m4 = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(_mm512_castps512_ps256(dm), mins));
        // Signed weights: |x| times sign(x)·y (there is no 512-bit sign instruction).
        let (negative, magnitude) = if unsigned {
            ([0; 2], qx)
        } else {
            (
                [_mm512_movepi8_mask(qx[0]), _mm512_movepi8_mask(qx[1])],
                [_mm512_abs_epi8(qx[0]), _mm512_abs_epi8(qx[1])],
            )
        };
        for r in 0..R {
            let a = &acts[r];
            // SAFETY: block `i` of each activation is 32 bytes inside its `q` (asserted).
            let qy = unsafe {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(a.q.as_ptr().add(i * BLOCK).cast()))
            };
            let ad = _mm512_set1_ps(a.d[i]);
            for p in 0..2 {
                let sy = if unsigned {
                    qy
                } else {
                    _mm512_mask_sub_epi8(qy, negative[p], _mm512_setzero_si512(), qy)
                };
                let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude[p], sy);
                let d = _mm512_mul_ps(scales[p], ad);
                acc[r][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(prod), acc[r][p]);
            }
            if unsigned {
                summs[r] = _mm_fmadd_ps(m4, _mm_set1_ps(a.s[i]), summs[r]);
            }
        }
    }
    for r in 0..R {
        out[r] = finish_rows(acc[r], summs[r], unsigned);
    }
}

/// [`packed_avx512`] over any number of activation rows, four at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn packed_rows_avx512<const F: u8>(w: [&[u8]; 4], acts: &[QuantizedRow], out: &mut [[f32; 4]]) {
    let fours = acts.len() / 4 * 4;
    for (a, o) in acts[..fours].chunks_exact(4).zip(out.chunks_exact_mut(4)) {
        packed_avx512::<F, 4>(w, a, o);
    }
    for (a, o) in acts[fours..].chunks(1).zip(out[fours..].chunks_mut(1)) {
        packed_avx512::<F, 1>(w, a, o);
    }
}

/// `R` GGUF weight rows of format `F`, each against the same activation row, two blocks per
/// 512-bit register (block `i` in the low half, `i + 1` in the high half): each block's
/// eight integer lanes are the 256-bit kernel's, and they meet the row's accumulator one
/// block after the next with the same scale and fused multiply-add, so each row's bits are
/// the same whatever `R` is. With `R` = 2 two rows' chains of multiply-adds run side by
/// side (see [`Dot2`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn rows_avx512<const F: u8, const R: usize>(w: [&[u8]; R], a: &QuantizedRow) -> [f32; R] {
    let stride = batched(F).block_bytes();
    let nb = a.d.len();
    assert!(w.iter().all(|w| w.len() == nb * stride) && a.q.len() == nb * BLOCK);
    assert!(!batched(F).mins() || a.s.len() == nb);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [_mm256_setzero_ps(); R];
    let pairs = nb / 2 * 2;
    for i in (0..pairs).step_by(2) {
        // SAFETY: blocks `i` and `i + 1` of the activation, 64 bytes, lie inside `a.q`
        // (asserted length); the load is unaligned.
        let qy = unsafe { _mm512_loadu_si512(a.q.as_ptr().add(i * BLOCK).cast()) };
        for r in 0..R {
            let (x, y) = w[r][i * stride..(i + 2) * stride].split_at(stride);
            prefetch_ahead(x.as_ptr(), (2 * stride).div_ceil(64));
            // SAFETY: `x` and `y` are whole blocks of the row.
            let sums = unsafe { pair_lanes::<F>(x, y, qy) };
            let low = _mm512_castps512_ps256(sums);
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sums)));
            (acc[r], summs[r]) = add_block::<F>(x, a, i, low, acc[r], summs[r]);
            (acc[r], summs[r]) = add_block::<F>(y, a, i + 1, high, acc[r], summs[r]);
        }
    }
    if pairs < nb {
        let i = pairs;
        // SAFETY: the last block of the activation, 32 bytes, lies inside `a.q`.
        let qy = unsafe {
            _mm512_zextsi256_si512(_mm256_loadu_si256(a.q.as_ptr().add(i * BLOCK).cast()))
        };
        for r in 0..R {
            let x = &w[r][i * stride..];
            // SAFETY: `x` is the row's last whole block (taken as both halves).
            let sums = unsafe { pair_lanes::<F>(x, x, qy) };
            let low = _mm512_castps512_ps256(sums);
            (acc[r], summs[r]) = add_block::<F>(x, a, i, low, acc[r], summs[r]);
        }
    }
    std::array::from_fn(|r| hsum8(lanes(acc[r])) + _mm256_cvtss_f32(summs[r]))
}

/// The eight integer lanes of weight block `x` (low half) and of weight block `y` (high
/// half), GGUF blocks of format `F`, against the activation bytes `qy` (32 for each), as
/// f32: each lane the sum of four products, the integers the 256-bit kernel computes.
///
/// # Safety
/// `x` and `y` must each hold a whole block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
unsafe fn pair_lanes<const F: u8>(x: &[u8], y: &[u8], qy: __m512i) -> __m512 {
    let zero = _mm512_setzero_si512();
    // SAFETY: the caller guarantees a whole block in `x` and in `y`.
    let prod = unsafe {
        match F {
            FMT_Q8_0 => {
                // |x| times sign(x)·y, as in `packed_avx512`.
                let qx = row_pair_q8(x, y, 2);
                let sy = _mm512_mask_sub_epi8(qy, _mm512_movepi8_mask(qx), zero, qy);
                _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(qx), sy)
            }
            FMT_Q4_1 => _mm512_dpbusd_epi32(zero, row_pair_q4(x, y, 4, 0), qy),
            FMT_Q5_0 | FMT_Q5_1 => {
                // The nibbles, plus 16 where the block's high bit is set (bit `j` of its
                // four `qh` bytes for value `j`, byte `j` of each half here); Q5_0's
                // (n - 16)·y summed as Q4_0's (n - 8)·y are below.
                let (qh, qs) = if F == FMT_Q5_0 { (2, 6) } else { (4, 8) };
                let high =
                    |b: &[u8]| u64::from((b.as_ptr().add(qh) as *const u32).read_unaligned());
                let sixteens = _mm512_maskz_mov_epi8(high(x) | high(y) << 32, _mm512_set1_epi8(16));
                // (nibbles & 0x0F) | sixteens in one instruction.
                let n = _mm512_ternarylogic_epi32::<0xEA>(
                    row_pair_shifted(x, y, qs),
                    _mm512_set1_epi8(0x0F),
                    sixteens,
                );
                let sums = _mm512_dpbusd_epi32(zero, n, qy);
                if F == FMT_Q5_0 {
                    _mm512_sub_epi32(sums, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(16), qy))
                } else {
                    sums
                }
            }
            _ => {
                // Four (n - 8)·y summed are four n·y summed minus four 8·y summed: the
                // same integers, with the unsigned-by-signed instruction and no signs.
                let n = row_pair_q4(x, y, 2, 0);
                let eights = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(8), qy);
                _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, n, qy), eights)
            }
        }
    };
    _mm512_cvtepi32_ps(prod)
}

/// Block `i` (GGUF bytes `b`) of a [`rows_avx512`] row: its integer `lanes` scaled into
/// `acc`, and for Q4_1 and Q5_1 the `m · s` term into `summs`, as the 256-bit kernels do.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_block<const F: u8>(
    b: &[u8],
    a: &QuantizedRow,
    i: usize,
    lanes: __m256,
    acc: __m256,
    summs: __m256,
) -> (__m256, __m256) {
    let summs = if batched(F).mins() {
        avx2::add_min(b, 2, a.s[i], summs)
    } else {
        summs
    };
    let scale = avx2::scale_splat(b, 0, a.d[i]);
    (_mm256_fmadd_ps(scale, lanes, acc), summs)
}

fn row<const F: u8>(w: &[u8], a: &QuantizedRow) -> f32 {
    // SAFETY: handed out only by `dot`, which takes the AVX-512 VNNI token.
    unsafe { rows_avx512::<F, 1>([w], a)[0] }
}

fn rows2<const F: u8>(w: [&[u8]; 2], a: &QuantizedRow) -> [f32; 2] {
    // SAFETY: handed out only by `dot2`, which takes the AVX-512 VNNI token.
    unsafe { rows_avx512::<F, 2>(w, a) }
}

/// The one-row dot product for `format`.
pub(super) fn dot(cpu: Avx512Vnni, format: Batched) -> Dot {
    let _ = cpu;
    match format {
        Batched::Block(BlockFormat::Q4_1) => row::<FMT_Q4_1>,
        Batched::Block(BlockFormat::Q4_0) => row::<FMT_Q4_0>,
        Batched::Block(BlockFormat::Q8_0) => row::<FMT_Q8_0>,
        Batched::Q5_0 => row::<FMT_Q5_0>,
        Batched::Q5_1 => row::<FMT_Q5_1>,
    }
}

/// The two-row dot product for `format`.
pub(super) fn dot2(cpu: Avx512Vnni, format: Batched) -> Dot2 {
    let _ = cpu;
    match format {
        Batched::Block(BlockFormat::Q4_1) => rows2::<FMT_Q4_1>,
        Batched::Block(BlockFormat::Q4_0) => rows2::<FMT_Q4_0>,
        Batched::Block(BlockFormat::Q8_0) => rows2::<FMT_Q8_0>,
        Batched::Q5_0 => rows2::<FMT_Q5_0>,
        Batched::Q5_1 => rows2::<FMT_Q5_1>,
    }
}

/// The packed tile for `format`.
pub(super) fn packed_tile(cpu: Avx512Vnni, format: BlockFormat) -> PackedTile {
    let _ = cpu;
    match format {
        BlockFormat::Q4_1 => packed_q4_1,
        BlockFormat::Q4_0 => packed_q4_0,
        BlockFormat::Q8_0 => packed_q8_0,
    }
}

fn packed_q4_1(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
    // SAFETY: handed out only by `packed_tile`, which takes the AVX-512 VNNI token (the
    // AVX2, FMA and F16C tier included).
    unsafe { packed_rows_avx512::<FMT_Q4_1>(w, a, out) }
}

fn packed_q4_0(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
    // SAFETY: as in `packed_q4_1`.
    unsafe { packed_rows_avx512::<FMT_Q4_0>(w, a, out) }
}

fn packed_q8_0(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
    // SAFETY: as in `packed_q4_1`.
    unsafe { packed_rows_avx512::<FMT_Q8_0>(w, a, out) }
}
