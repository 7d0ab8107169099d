//! The AVX2 tier's attention: f16 <-> f32 eight values at a time with the F16C
//! instructions (the same IEEE conversions, round to nearest even, as the `half` crate's,
//! without a call per row), and the f16-cache head kernel, which computes exactly what the
//! portable loop does with 8-lane registers. F16C belongs to the AVX2 tier; each entry
//! point takes its token.

use std::arch::x86_64::*;

use half::f16;

use super::expf::{C, INV_LN2_N, MAY_UNDERFLOW, OVERFLOW, SHIFT, T, UNDERFLOW};
use super::{prefetch_next_chunk, softmax_chunk, subnormal_weight, HeadJob, HeadKernel, CHUNK};
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

/// glibc's `expf` of four lanes (see [`super::expf`]), in double precision as glibc
/// computes it: the same table lookup, polynomial and fused multiply-adds, so every lane
/// equals what libm returns bit for bit (special cases aside; [`expf8`] handles those).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn expf4(x: __m128) -> __m128 {
    let inv = _mm256_set1_pd(f64::from_bits(INV_LN2_N));
    let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
    let xd = _mm256_cvtps_pd(x);
    // k = round(x · 32/ln2) and r = x · 32/ln2 - k, each one fused multiply-add.
    let kd = _mm256_fmadd_pd(inv, xd, shift);
    let ki = _mm256_castpd_si256(kd);
    let kd = _mm256_sub_pd(kd, shift);
    let r = _mm256_fmsub_pd(inv, xd, kd);
    // s = 2^(k/32): the table entry for k mod 32, k / 32 added to the exponent.
    let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    // SAFETY: every index is below 32 (masked above), inside the 32 u64 of `T`.
    let t = unsafe { _mm256_i64gather_epi64::<8>(T.as_ptr().cast(), idx) };
    let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
    let c0 = _mm256_set1_pd(f64::from_bits(C[0]));
    let c1 = _mm256_set1_pd(f64::from_bits(C[1]));
    let c2 = _mm256_set1_pd(f64::from_bits(C[2]));
    let z = _mm256_fmadd_pd(r, c0, c1);
    let r2 = _mm256_mul_pd(r, r);
    let y = _mm256_fmadd_pd(r, c2, _mm256_set1_pd(1.0));
    _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s))
}

/// `expf` of each lane of `x`, bit for bit libm's.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn expf8(x: __m256) -> __m256 {
    let out = _mm256_set_m128(
        expf4(_mm256_extractf128_ps::<1>(x)),
        expf4(_mm256_castps256_ps128(x)),
    );
    // The special cases glibc takes out of the main path.
    let under = _mm256_set1_ps(f32::from_bits(UNDERFLOW));
    let may_under = _mm256_set1_ps(f32::from_bits(MAY_UNDERFLOW));
    let overflow = _mm256_set1_ps(f32::from_bits(OVERFLOW));
    let zero = _mm256_cmp_ps::<_CMP_LT_OQ>(x, under);
    let tiny = _mm256_andnot_ps(zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x, may_under));
    let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, overflow);
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let out = _mm256_blendv_ps(out, _mm256_setzero_ps(), zero);
    let out = _mm256_blendv_ps(out, _mm256_set1_ps(f32::from_bits(1)), tiny);
    let out = _mm256_blendv_ps(out, _mm256_set1_ps(f32::INFINITY), over);
    _mm256_blendv_ps(out, _mm256_add_ps(x, x), nan)
}

/// [`expf8`] over a chunk of arguments.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn expf_chunk(x: &[f32; CHUNK]) -> [f32; CHUNK] {
    let mut out = [0f32; CHUNK];
    for (o, x) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
        // SAFETY: each chunk holds exactly eight f32; loads and stores are unaligned.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), expf8(_mm256_loadu_ps(x.as_ptr()))) };
    }
    out
}

/// The vector `expf` on a chunk of values, for tests.
#[cfg(test)]
pub(super) fn expf16(cpu: Avx2, x: &[f32; CHUNK]) -> [f32; CHUNK] {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX2 and FMA.
    unsafe { expf_chunk(x) }
}

/// Eight f16 at `row[at..]` widened to f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn load8(row: &[f16], at: usize) -> __m256 {
    assert!(at + 8 <= row.len());
    // SAFETY: the assertion keeps the 16 bytes read inside `row`; loadu is unaligned.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(row.as_ptr().add(at).cast()) })
}

/// Rounds eight f32 to f16 and back (round to nearest even).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn round8(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// The q·k sums of eight positions, lane `p` position `p`'s: each `t[p]` holds a 16-lane
/// sum already folded to eight lanes (lane `i` plus lane `i + 8`, the first step of the
/// portable `reduce16`); the rest of that tree — lanes `i` and `i + 4`, then `i` and
/// `i + 2`, then the last two — is taken for the eight positions at once, each position
/// adding the same pairs in the same order as reducing it alone.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8x8(t: &[__m256; 8]) -> __m256 {
    // Positions p and p + 4 side by side, their upper four lanes added onto the lower.
    let u: [__m256; 4] = std::array::from_fn(|p| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(t[p], t[p + 4]),
            _mm256_permute2f128_ps::<0x31>(t[p], t[p + 4]),
        )
    });
    // In each 128-bit half: [a0 + a2, a1 + a3, b0 + b2, b1 + b3].
    let pairs = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (v0, v1) = (pairs(u[0], u[1]), pairs(u[2], u[3]));
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(v0, v1),
        _mm256_shuffle_ps::<0b11_01_11_01>(v0, v1),
    )
}

/// `G` query heads of `8 N` values against one KV head, with the shape of the AVX-512
/// kernel: positions in chunks of [`CHUNK`], each in three passes — the scores
/// (independent dot products, reduced eight positions at a time), the softmax bookkeeping
/// with its exponentials computed eight at a time, then the value rows into the
/// accumulators — and the next chunk's rows prefetched as each chunk starts. Each head's
/// arithmetic is exactly the portable loop's: q·k in ggml's four 16-lane chains (two
/// 8-lane registers each) and reduction tree, the same online softmax, fused
/// multiply-adds and f16 rounding of the accumulator.
#[target_feature(enable = "avx2,fma,f16c")]
fn heads_avx2<const N: usize, const G: usize>(qr: &[f32], job: HeadJob<'_, f16>, out: &mut [f32]) {
    let HeadJob {
        keys,
        values,
        head,
        last,
        scale,
        ..
    } = job;
    let d = 8 * N;
    assert!(qr.len() == G * d && out.len() == G * d && N.is_multiple_of(2));
    let mut q = [[_mm256_setzero_ps(); N]; G];
    for (g, q) in q.iter_mut().enumerate() {
        for (j, q) in q.iter_mut().enumerate() {
            // SAFETY: `qr` holds exactly `G · 8 N` f32 (asserted); loadu is unaligned.
            *q = unsafe { _mm256_loadu_ps(qr.as_ptr().add(g * d + 8 * j)) };
        }
    }
    let mut acc = [[_mm256_setzero_ps(); N]; G];
    let (mut max, mut sum) = ([f32::NEG_INFINITY; G], [0f32; G]);
    let mut scores = [[0f32; CHUNK]; G];
    // Each position's 16-lane q · k sum, folded to eight lanes.
    let mut lanes8 = [[_mm256_setzero_ps(); CHUNK]; G];
    let (mut ms, mut vs) = ([[1f32; CHUNK]; G], [[0f32; CHUNK]; G]);
    let mut first = 0;
    while first <= last {
        let n = CHUNK.min(last + 1 - first);
        prefetch_next_chunk(&job, d, first);
        for (j, k) in keys.rows(head, d, first, n).enumerate() {
            let mut kx = [_mm256_setzero_ps(); N];
            for (c, kx) in kx.iter_mut().enumerate() {
                *kx = load8(k, 8 * c);
            }
            for g in 0..G {
                // ggml's f16 dot: four 16-lane chains over each 64 values (lanes 0-7 and
                // 8-15 of chain `c % 4` for 16-lane chunk `c`), folded (0+2)+(1+3).
                let mut lanes = [[_mm256_setzero_ps(); 2]; 4];
                for c in 0..N / 2 {
                    for (h, lane) in lanes[c % 4].iter_mut().enumerate() {
                        *lane = _mm256_fmadd_ps(q[g][2 * c + h], kx[2 * c + h], *lane);
                    }
                }
                let z: [__m256; 2] = std::array::from_fn(|h| {
                    _mm256_add_ps(
                        _mm256_add_ps(lanes[0][h], lanes[2][h]),
                        _mm256_add_ps(lanes[1][h], lanes[3][h]),
                    )
                });
                lanes8[g][j] = _mm256_add_ps(z[1], z[0]);
            }
        }
        let scale8 = _mm256_set1_ps(scale);
        for (scores, lanes8) in scores.iter_mut().zip(&lanes8) {
            for (half, t) in scores.chunks_exact_mut(8).zip(lanes8.chunks_exact(8)) {
                let t: &[__m256; 8] = t.try_into().expect("eight positions");
                let s = _mm256_mul_ps(reduce8x8(t), scale8);
                // SAFETY: `half` holds exactly eight f32; the store is unaligned.
                unsafe { _mm256_storeu_ps(half.as_mut_ptr(), s) };
            }
        }
        let exp = |x: &[f32; CHUNK]| expf_chunk(x);
        softmax_chunk(&scores, n, &mut max, &mut sum, &mut ms, &mut vs, exp);
        // The value rows, the check for subnormal weights only in chunks that have one: the
        // common chunk runs the plain loop.
        let tiny = vs
            .iter()
            .any(|vs| vs[..n].iter().any(|&w| subnormal_weight(w)));
        let mut values_pass = |check: bool| {
            for (j, v) in values.rows(head, d, first, n).enumerate() {
                let mut vx = [_mm256_setzero_ps(); N];
                for (c, vx) in vx.iter_mut().enumerate() {
                    *vx = load8(v, 8 * c);
                }
                for g in 0..G {
                    if ms[g][j] != 1.0 {
                        let m = _mm256_set1_ps(ms[g][j]);
                        for a in &mut acc[g] {
                            *a = round8(_mm256_mul_ps(*a, m));
                        }
                    }
                    if check && subnormal_weight(vs[g][j]) && vx.iter().all(|&v| is_finite8(v)) {
                        // What the multiply-add and rounding give, worked out without
                        // subnormal arithmetic (see `below_f16`).
                        for (a, v) in acc[g].iter_mut().zip(&vx) {
                            *a = below_f16(*a, *v);
                        }
                        continue;
                    }
                    let w = _mm256_set1_ps(vs[g][j]);
                    for (a, v) in acc[g].iter_mut().zip(&vx) {
                        *a = round8(_mm256_fmadd_ps(*v, w, *a));
                    }
                }
            }
        };
        // Two calls, each compiled for its constant.
        if tiny {
            values_pass(true);
        } else {
            values_pass(false);
        }
        first += n;
    }
    for g in 0..G {
        let inv = _mm256_set1_ps(if sum[g] == 0.0 { 0.0 } else { 1.0 / sum[g] });
        for (j, a) in acc[g].iter().enumerate() {
            // SAFETY: `out` holds exactly `G · 8 N` f32 (asserted); storeu is unaligned.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr().add(g * d + 8 * j), _mm256_mul_ps(*a, inv))
            };
        }
    }
}

/// Whether all eight lanes are finite.
#[inline]
#[target_feature(enable = "avx2")]
fn is_finite8(x: __m256) -> bool {
    let abs = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(
        abs,
        _mm256_set1_ps(f32::INFINITY),
    )) == 0xff
}

/// `round8(fma(v, w, a))` for an f16 accumulator `a`, finite values `v` and a subnormal
/// weight `w`, without subnormal arithmetic: the AVX-512 kernel's `below_f16` on eight
/// lanes (a nonzero `a` stays; a zero takes `v`'s sign, or where `v` is a zero too, -0
/// only if both are).
#[inline]
#[target_feature(enable = "avx2")]
fn below_f16(a: __m256, v: __m256) -> __m256 {
    let zero = _mm256_setzero_ps();
    let a_zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(a, zero);
    let v_zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(v, zero);
    let sign = _mm256_set1_ps(-0.0);
    let of_v = _mm256_and_ps(v, sign);
    let both = _mm256_and_ps(_mm256_and_ps(a, v), sign);
    let zeros = _mm256_blendv_ps(of_v, both, v_zero);
    _mm256_blendv_ps(a, zeros, a_zero)
}

/// The head kernel for heads of `head_dim` values, where there is one.
pub(super) fn head_kernel(cpu: Avx2, head_dim: usize) -> Option<HeadKernel<f16>> {
    let _ = cpu;
    match head_dim {
        64 => Some(heads::<8>),
        128 => Some(heads::<16>),
        256 => Some(heads::<32>),
        _ => None,
    }
}

/// The query heads in `qr` (one to four of `8 N` values) against one KV head; see
/// [`super::HeadKernel`].
fn heads<const N: usize>(qr: &[f32], job: HeadJob<'_, f16>, out: &mut [f32]) {
    let kernel = match qr.len() / (8 * N) {
        1 => heads_avx2::<N, 1>,
        2 => heads_avx2::<N, 2>,
        3 => heads_avx2::<N, 3>,
        4 => heads_avx2::<N, 4>,
        g => panic!(
            "a head kernel serves 1 to {} heads, got {g}",
            super::MAX_GROUP
        ),
    };
    // SAFETY: handed out only by `head_kernel`, which takes the AVX2 token (AVX2, FMA and
    // F16C).
    unsafe { kernel(qr, job, out) }
}
