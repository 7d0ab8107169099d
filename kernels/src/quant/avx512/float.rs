//! Floating-point weights with AVX-512: each output's 64 partial sums in four 512-bit
//! accumulators, F16 weights widened by `vcvtph2ps` and BF16 by a 16-bit shift; four
//! weight rows at a time against one activation row share its loads.

use std::arch::x86_64::*;

use super::super::float::{finish, fold16, FloatFormat, LANES};
use crate::cpu::Avx512;

/// Sixteen weights from `w` at value `i`, widened exactly.
///
/// # Safety
/// `w` must hold sixteen values of `format` from value `i` on.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load(format: FloatFormat, w: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees sixteen readable values at `i`.
    unsafe {
        match format {
            FloatFormat::F32 => _mm512_loadu_ps(w.add(4 * i).cast()),
            FloatFormat::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * i).cast())),
            FloatFormat::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(2 * i).cast())),
            )),
        }
    }
}

/// The four accumulators folded as ggml's `GGML_F32x16_REDUCE`: `(a0 + a2) + (a1 + a3)`,
/// then the 16 lanes by halves.
#[inline]
#[target_feature(enable = "avx512f")]
fn fold(acc: [__m512; 4]) -> f32 {
    let x0 = _mm512_add_ps(acc[0], acc[2]);
    let x1 = _mm512_add_ps(acc[1], acc[3]);
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds exactly sixteen f32; storeu has no alignment requirement.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(x0, x1)) };
    fold16(lanes)
}

/// Weight row `w` (in `format`, `x.len()` values) against activation row `x`.
pub(crate) fn dot(cpu: Avx512, format: FloatFormat, w: &[u8], x: &[f32]) -> f32 {
    let _ = cpu;
    assert!(
        w.len() >= x.len() * format.bytes(),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves AVX-512 F; the row holds `x.len()` values.
    unsafe { dot_avx512(format, w, x) }
}

/// # Safety
/// `w` must hold `x.len()` values of `format`.
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(format: FloatFormat, w: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut acc = [_mm512_setzero_ps(); 4];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i < whole {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `i + 16 j + 16 <= whole <= k` values of both rows.
            unsafe {
                let wv = load(format, wp, i + 16 * j);
                *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp.add(i + 16 * j)), *a);
            }
        }
        i += LANES;
    }
    let tail = (whole..k).map(|i| (format.at(w, i), x[i]));
    finish(format, fold(acc), tail)
}

/// Four widened weight rows against activation row `x`: sixteen accumulators, each
/// activation vector loaded once for the four rows.
pub(crate) fn quad(cpu: Avx512, format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let _ = cpu;
    assert!(
        w.iter().all(|w| w.len() >= x.len()),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves AVX-512 F; every row holds `x.len()` values.
    unsafe { quad_avx512(format, w, x) }
}

/// # Safety
/// Every row of `w` must hold `x.len()` values.
#[target_feature(enable = "avx512f")]
unsafe fn quad_avx512(format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let xp = x.as_ptr();
    let wp = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 64 <= whole <= k` values of every row.
        unsafe {
            let xv = [
                _mm512_loadu_ps(xp.add(i)),
                _mm512_loadu_ps(xp.add(i + 16)),
                _mm512_loadu_ps(xp.add(i + 32)),
                _mm512_loadu_ps(xp.add(i + 48)),
            ];
            for r in 0..4 {
                for j in 0..4 {
                    let wv = _mm512_loadu_ps(wp[r].add(i + 16 * j));
                    acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
                }
            }
        }
        i += LANES;
    }
    let mut out = [0f32; 4];
    for r in 0..4 {
        let tail = w[r][whole..k]
            .iter()
            .copied()
            .zip(x[whole..k].iter().copied());
        out[r] = finish(format, fold(acc[r]), tail);
    }
    out
}

/// Four widened weight rows against four activation rows: `out[a][r]`. The column loop runs
/// once per 16-lane quarter of each 64-value step — the quarters' partial sums never meet
/// before the fold, so each lane's chain of multiply-adds is the one [`dot`] runs — with
/// sixteen accumulators, each weight and activation vector loaded once for four products.
pub(crate) fn tile(
    cpu: Avx512,
    format: FloatFormat,
    w: [&[f32]; 4],
    x: [&[f32]; 4],
) -> [[f32; 4]; 4] {
    let _ = cpu;
    let k = x[0].len();
    assert!(
        w.iter().all(|w| w.len() >= k) && x.iter().all(|x| x.len() == k),
        "rows shorter than the product's input"
    );
    // SAFETY: `cpu` proves AVX-512 F; every row holds `k` values.
    unsafe { tile_avx512(format, w, x) }
}

/// # Safety
/// Every row of `w` and `x` must hold `x[0].len()` values.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(format: FloatFormat, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let k = x[0].len();
    let whole = k / LANES * LANES;
    let wp = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    let xp = [x[0].as_ptr(), x[1].as_ptr(), x[2].as_ptr(), x[3].as_ptr()];
    // `part[q][a][r]`: quarter `q`'s partial sums of activation row `a` by weight row `r`.
    let mut part = [[[_mm512_setzero_ps(); 4]; 4]; 4];
    for (q, part) in part.iter_mut().enumerate() {
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut i = 16 * q;
        while i < whole {
            // SAFETY: `i + 16 <= whole <= k` values of every row.
            unsafe {
                let wv = [
                    _mm512_loadu_ps(wp[0].add(i)),
                    _mm512_loadu_ps(wp[1].add(i)),
                    _mm512_loadu_ps(wp[2].add(i)),
                    _mm512_loadu_ps(wp[3].add(i)),
                ];
                for a in 0..4 {
                    let xv = _mm512_loadu_ps(xp[a].add(i));
                    for r in 0..4 {
                        acc[a][r] = _mm512_fmadd_ps(wv[r], xv, acc[a][r]);
                    }
                }
            }
            i += LANES;
        }
        *part = acc;
    }
    let mut out = [[0f32; 4]; 4];
    for a in 0..4 {
        for r in 0..4 {
            let sums = [part[0][a][r], part[1][a][r], part[2][a][r], part[3][a][r]];
            let tail = w[r][whole..k]
                .iter()
                .copied()
                .zip(x[a][whole..].iter().copied());
            out[a][r] = finish(format, fold(sums), tail);
        }
    }
    out
}
