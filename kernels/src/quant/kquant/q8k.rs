//! Activation rows quantized to Q8_K with AVX-512: ggml's `quantize_row_q8_K_ref`, sixteen
//! values per instruction, and the bytes laid out in pair order in the same pass. The
//! scale, the rounding (ggml's `nearest_int`, through the float's mantissa) and the sums
//! are the portable quantizer's operations, so the blocks are its bit for bit.

use std::arch::x86_64::*;

use super::{Q8KRow, QK_K};
use crate::cpu::Avx512;

/// `x` (a multiple of 256 values) quantized as [`super::quantize_row_q8k_portable`] does,
/// with [`Q8KRow::paired`] filled too where `paired` says so.
pub(super) fn quantize(cpu: Avx512, x: &[f32], paired: bool) -> Q8KRow {
    let _ = cpu;
    let nb = x.len() / QK_K;
    let mut row = Q8KRow::empty(nb, paired);
    for (i, block) in x.chunks_exact(QK_K).enumerate() {
        let qs = &mut row.qs[i * QK_K..(i + 1) * QK_K];
        let bsums = &mut row.bsums[i * 16..(i + 1) * 16];
        let order = match paired {
            true => Some(&mut row.paired[i * QK_K..(i + 1) * QK_K]),
            false => None,
        };
        // SAFETY: `cpu` proves AVX-512 F and BW.
        let d = unsafe { block_avx512(block, qs, bsums, order) };
        row.d.push(d);
    }
    row.sums32 = super::sums32(&row.bsums);
    row
}

/// One super-block: its bytes into `qs` (and in pair order into `paired`), the sums of each
/// sixteen into `bsums`; returns its scale. A block of zeros leaves the outputs as they are
/// (zeros) and has scale 0. `x`, `qs` and `paired` hold 256 values, `bsums` sixteen
/// (asserted).
#[target_feature(enable = "avx512f,avx512bw")]
fn block_avx512(x: &[f32], qs: &mut [i8], bsums: &mut [i16], mut paired: Option<&mut [i8]>) -> f32 {
    assert!(x.len() == QK_K && qs.len() == QK_K && bsums.len() == 16);
    assert!(paired.as_ref().is_none_or(|p| p.len() == QK_K));
    let v: [__m512; 16] = std::array::from_fn(|k| {
        // SAFETY: `x` holds 256 f32 (asserted), so sixteen from `16 k`; unaligned load.
        unsafe { _mm512_loadu_ps(x[16 * k..].as_ptr()) }
    });
    let abs = |v: __m512| _mm512_abs_ps(v);
    // The largest magnitude: `max` returns its second operand where the first is NaN, so
    // NaNs are passed over as the portable loop's `>` passes them over.
    let amax = _mm512_reduce_max_ps(
        v.iter()
            .fold(_mm512_setzero_ps(), |m, &v| _mm512_max_ps(abs(v), m)),
    );
    if amax == 0.0 {
        return 0.0;
    }
    // The first value of that magnitude, as the portable loop keeps the first.
    let wanted = _mm512_set1_ps(amax);
    let max = (0..16)
        .find_map(|k| {
            let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(abs(v[k]), wanted);
            (hit != 0).then(|| x[16 * k + hit.trailing_zeros() as usize])
        })
        .unwrap_or(amax);
    let iscale = -127.0 / max;
    let (scale, magic) = (_mm512_set1_ps(iscale), _mm512_set1_ps(12_582_912.0));
    let (mantissa, half) = (
        _mm512_set1_epi32(0x007f_ffff),
        _mm512_set1_epi32(0x0040_0000),
    );
    for (k, v) in v.iter().enumerate() {
        // ggml's `nearest_int(iscale * v)`, then at most 127.
        let val = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(scale, *v), magic));
        let q = _mm512_sub_epi32(_mm512_and_si512(val, mantissa), half);
        let q = _mm512_min_epi32(q, _mm512_set1_epi32(127));
        // SAFETY: `qs` holds 256 bytes (asserted), so sixteen from `16 k`; unaligned store.
        unsafe { _mm_storeu_si128(qs[16 * k..].as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q)) };
    }
    // Pair order: group `L` of each 64 bytes is group `L / 2` of their first 32 (`L` even)
    // or of their second.
    let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for c in 0..4 {
        // SAFETY: `qs` holds 256 bytes, so 64 from `64 c`; unaligned load.
        let b = unsafe { _mm512_loadu_si512(qs[64 * c..].as_ptr().cast()) };
        // Each 8 bytes' sum, offset by 128 per byte so the bytes are unsigned.
        let sums = _mm512_sad_epu8(
            _mm512_xor_si512(b, _mm512_set1_epi8(-128)),
            _mm512_setzero_si512(),
        );
        let mut eight = [0i64; 8];
        // SAFETY: `eight` holds eight i64; unaligned store.
        unsafe { _mm512_storeu_si512(eight.as_mut_ptr().cast(), sums) };
        for j in 0..4 {
            bsums[4 * c + j] = (eight[2 * j] + eight[2 * j + 1] - 16 * 128) as i16;
        }
        if let Some(paired) = paired.as_deref_mut() {
            let p = _mm512_permutexvar_epi32(order, b);
            // SAFETY: `paired` holds 256 bytes (asserted), so 64 from `64 c`; unaligned.
            unsafe { _mm512_storeu_si512(paired[64 * c..].as_mut_ptr().cast(), p) };
        }
    }
    1.0 / iscale
}
