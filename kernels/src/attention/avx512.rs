//! The f16-cache head kernel with AVX-512: the query, the V accumulator and each key and
//! value row live in `N` 16-lane registers (`head_dim = 16 N`), converted with the F16C
//! instructions straight from the cache. Every operation is the portable loop's — the same
//! q·k lanes and reduction tree as [`dot`], the same online softmax (its exponentials by a
//! vector copy of glibc's `expf`), fused multiply-adds and f16 rounding of the accumulator —
//! so results are bit for bit equal.
use std::arch::x86_64::*;

use half::f16;

use super::{prefetch_next_chunk, softmax_chunk, subnormal_weight, HeadJob, HeadKernel, CHUNK};
use crate::cpu::Avx512;
use crate::fold::{halves, pairs, quarters};

/// Lane `p`: the sum of `z[p]`'s sixteen lanes as GCC expands `_mm512_reduce_add_ps`
/// (what ggml's f16 dot ends with; see the portable `reduce16`) — lanes `i` and `i + 8`,
/// then `i` and `i + 4`, then `i` and `i + 2`, then the last two — for all sixteen at
/// once: each lane adds the same pairs in the same order, but the sixteen reductions
/// share their shuffles and additions.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16x16(z: &[__m512; 16]) -> __m512 {
    let t: [__m512; 8] = std::array::from_fn(|k| halves(z[2 * k], z[2 * k + 1]));
    let u: [__m512; 4] = std::array::from_fn(|k| quarters(t[2 * k], t[2 * k + 1]));
    // Each quarter: two lanes of a position of `u[0]` (or `u[2]`), two of `u[1]` (`u[3]`).
    let (v0, v1) = (pairs(u[0], u[1]), pairs(u[2], u[3]));
    // The last pair of each: lane 4q + s holds position q + 4s.
    let w = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(v0, v1),
        _mm512_shuffle_ps::<0b11_01_11_01>(v0, v1),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, w)
}

/// Sixteen f16 widened to f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn load16(row: &[f16], at: usize) -> __m512 {
    assert!(at + 16 <= row.len());
    // SAFETY: the assertion keeps the 32 bytes read inside `row`; loadu is unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(row.as_ptr().add(at).cast()) })
}

/// Rounds sixteen f32 to f16 and back (round to nearest even).
#[inline]
#[target_feature(enable = "avx512f")]
fn round16(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// Whether all sixteen lanes are finite.
#[inline]
#[target_feature(enable = "avx512f")]
fn is_finite16(x: __m512) -> bool {
    let abs = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(0x7fff_ffff),
    ));
    _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs, _mm512_set1_ps(f32::INFINITY)) == 0xffff
}

/// `round16(fma(v, w, a))` for an f16 accumulator `a`, finite value rows `v` (at most 65504)
/// and a subnormal weight `w` (below 2^-126), without the subnormal arithmetic that costs a
/// microcode assist per instruction on Intel CPUs. A long prompt whose scores spread more
/// than ~87 below their maximum meets such weights (`exp(s - max)`) in most of its keys: on
/// an Intel Xeon (Sapphire Rapids class), 2 threads, a random-weight model of Llama 3 8B's
/// layer shape (hidden 4096, 32 query and 8 KV heads of 128), 2048-token prompts took
/// 52.1–54.8 -> 86.4–90.3 tok/s with this. `|v · w|` is below 2^-110: added to a nonzero
/// f16 it leaves it as it is; added to a zero it gives a zero (or an f32 subnormal that
/// rounds to one) with the product's sign, `v`'s, or, where `v` is a zero too, the sum of
/// two zeros (-0 only if both are).
#[inline]
#[target_feature(enable = "avx512f")]
fn below_f16(a: __m512, v: __m512) -> __m512 {
    let zero = _mm512_setzero_ps();
    let a_zero = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, zero);
    let v_zero = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, zero);
    let (ai, vi) = (_mm512_castps_si512(a), _mm512_castps_si512(v));
    let sign = _mm512_set1_epi32(i32::MIN);
    // A zero's sign: `v`'s, or `a`'s and `v`'s both where `v` is a zero.
    let of_v = _mm512_and_si512(vi, sign);
    let both = _mm512_and_si512(_mm512_and_si512(ai, vi), sign);
    let zeros = _mm512_mask_blend_epi32(v_zero, of_v, both);
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(a_zero, ai, zeros))
}

/// glibc's `expf` eight lanes at a time (see [`super::super::expf`]): the table lookup,
/// polynomial, fused multiply-adds and special cases in the same order, so every lane
/// equals what libm returns bit for bit.
mod expf {
    use std::arch::x86_64::*;

    use super::super::expf::{C, INV_LN2_N, MAY_UNDERFLOW, OVERFLOW, SHIFT, T, UNDERFLOW};
    use super::CHUNK;

    /// `expf` of each lane of `x`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn expf8(x: __m256) -> __m256 {
        // SAFETY: each load reads eight u64 at 0, 8, 16 or 24, inside the 32 of `T`.
        let table = unsafe {
            let t = T.as_ptr();
            [
                _mm512_loadu_si512(t.cast()),
                _mm512_loadu_si512(t.add(8).cast()),
                _mm512_loadu_si512(t.add(16).cast()),
                _mm512_loadu_si512(t.add(24).cast()),
            ]
        };
        let inv = _mm512_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm512_set1_pd(f64::from_bits(SHIFT));
        let xd = _mm512_cvtps_pd(x);
        // k = round(x · 32/ln2) and r = x · 32/ln2 - k, each one fused multiply-add.
        let kd = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // s = 2^(k/32): the table entry for k mod 32, k / 32 added to the exponent.
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let low = _mm512_permutex2var_epi64(table[0], idx, table[1]);
        let high = _mm512_permutex2var_epi64(table[2], idx, table[3]);
        let upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, low, high);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let c0 = _mm512_set1_pd(f64::from_bits(C[0]));
        let c1 = _mm512_set1_pd(f64::from_bits(C[1]));
        let c2 = _mm512_set1_pd(f64::from_bits(C[2]));
        let z = _mm512_fmadd_pd(r, c0, c1);
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, c2, _mm512_set1_pd(1.0));
        let y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s);
        let out = _mm512_cvtpd_ps(y);
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

    /// [`expf8`] over a chunk of arguments. Inlined into the head kernel: called out of line
    /// once per head and chunk (the registers saved, the upper halves cleared), it cost one
    /// layer's attention over a 1024-token prompt 42.0–42.5 ms against 36.4–36.5 (Zen 5,
    /// 2 threads).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn expf_chunk(x: &[f32; CHUNK]) -> [f32; CHUNK] {
        let mut out = [0f32; CHUNK];
        for (o, x) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
            // SAFETY: each chunk holds exactly eight f32; loads and stores are unaligned.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), expf8(_mm256_loadu_ps(x.as_ptr()))) };
        }
        out
    }
}

/// A chunk's value rows into the heads' f16 accumulators: at position `j`, head `g`'s
/// accumulator scaled by `ms[g][j]` (where its maximum rose) and `vs[g][j]` times the row
/// added, each step rounded to f16. Out of line, with the accumulators copied in and out
/// once per chunk, so they stay in registers across its positions (inlined, they shared the
/// registers with the queries and went through the stack at every position: one layer's
/// attention over a 1024-token prompt, `cargo run --release -p ferrite-kernels --example
/// attention -- 1024`, Zen 5, one thread, 93–95 -> 86–89 ms). `CHECK`: the chunk has
/// subnormal weights, taken without subnormal arithmetic ([`below_f16`]).
#[inline(never)]
#[target_feature(enable = "avx512f")]
fn values_chunk<'a, const N: usize, const G: usize, const CHECK: bool>(
    acc: &mut [[__m512; N]; G],
    rows: impl Iterator<Item = &'a [f16]>,
    ms: &[[f32; CHUNK]; G],
    vs: &[[f32; CHUNK]; G],
) {
    let mut a = *acc;
    for (j, v) in rows.enumerate() {
        let mut vx = [_mm512_setzero_ps(); N];
        for (c, vx) in vx.iter_mut().enumerate() {
            *vx = load16(v, 16 * c);
        }
        if (0..G).all(|g| ms[g][j] == 1.0 && !(CHECK && subnormal_weight(vs[g][j]))) {
            for g in 0..G {
                let w = _mm512_set1_ps(vs[g][j]);
                for (a, v) in a[g].iter_mut().zip(&vx) {
                    *a = round16(_mm512_fmadd_ps(*v, w, *a));
                }
            }
        } else {
            let weights = std::array::from_fn(|g| (ms[g][j], vs[g][j]));
            rare_position::<N, G, CHECK>(&mut a, &vx, weights);
        }
    }
    *acc = a;
}

/// [`values_chunk`] at a position where some head's maximum rose (its accumulator scaled
/// first) or, with `CHECK`, its weight is subnormal: `weights[g]` is head `g`'s (scale,
/// weight). Out of line, so the common position's loop keeps the accumulators in registers.
#[inline(never)]
#[target_feature(enable = "avx512f")]
fn rare_position<const N: usize, const G: usize, const CHECK: bool>(
    acc: &mut [[__m512; N]; G],
    vx: &[__m512; N],
    weights: [(f32, f32); G],
) {
    for (acc, (m, w)) in acc.iter_mut().zip(weights) {
        if m != 1.0 {
            let m = _mm512_set1_ps(m);
            for a in acc.iter_mut() {
                *a = round16(_mm512_mul_ps(*a, m));
            }
        }
        if CHECK && subnormal_weight(w) && vx.iter().all(|&v| is_finite16(v)) {
            // What the multiply-add and rounding give, worked out without subnormal
            // arithmetic (see `below_f16`).
            for (a, v) in acc.iter_mut().zip(vx) {
                *a = below_f16(*a, *v);
            }
            continue;
        }
        let w = _mm512_set1_ps(w);
        for (a, v) in acc.iter_mut().zip(vx) {
            *a = round16(_mm512_fmadd_ps(*v, w, *a));
        }
    }
}

/// `G` query heads of `16 N` values against one KV head. Each head's arithmetic is
/// exactly the single-head loop's; the heads only share the converted key and value rows.
/// Positions go in chunks of [`CHUNK`], each in three passes: the scores (independent dot
/// products, so they overlap), the softmax bookkeeping with its exponentials computed
/// sixteen at a time, then the value rows into accumulators that stay in registers; the
/// next chunk's rows are prefetched as each chunk starts.
#[target_feature(enable = "avx512f")]
fn heads_avx512<const N: usize, const G: usize>(
    qr: &[f32],
    job: HeadJob<'_, f16>,
    out: &mut [f32],
) {
    let HeadJob {
        keys,
        values,
        head,
        last,
        scale,
        ..
    } = job;
    let d = 16 * N;
    assert!(qr.len() == G * d && out.len() == G * d);
    let mut q = [[_mm512_setzero_ps(); N]; G];
    for (g, q) in q.iter_mut().enumerate() {
        for (j, q) in q.iter_mut().enumerate() {
            // SAFETY: `qr` holds exactly `G · 16 N` f32 (asserted); loadu is unaligned.
            *q = unsafe { _mm512_loadu_ps(qr.as_ptr().add(g * d + 16 * j)) };
        }
    }
    let mut acc = [[_mm512_setzero_ps(); N]; G];
    let (mut max, mut sum) = ([f32::NEG_INFINITY; G], [0f32; G]);
    let mut scores = [[0f32; CHUNK]; G];
    // Each position's 16 lanes of q · k, reduced for the whole chunk at once.
    let mut lanes16 = [[_mm512_setzero_ps(); CHUNK]; G];
    let (mut ms, mut vs) = ([[1f32; CHUNK]; G], [[0f32; CHUNK]; G]);
    let mut first = 0;
    while first <= last {
        let n = CHUNK.min(last + 1 - first);
        prefetch_next_chunk(&job, d, first);
        for (j, k) in keys.rows(head, d, first, n).enumerate() {
            let mut kx = [_mm512_setzero_ps(); N];
            for (c, kx) in kx.iter_mut().enumerate() {
                *kx = load16(k, 16 * c);
            }
            for g in 0..G {
                // ggml's f16 dot: four 16-lane chains over each 64 values, folded
                // (0+2)+(1+3).
                let mut lanes = [_mm512_setzero_ps(); 4];
                for c in 0..N {
                    lanes[c % 4] = _mm512_fmadd_ps(q[g][c], kx[c], lanes[c % 4]);
                }
                lanes16[g][j] = _mm512_add_ps(
                    _mm512_add_ps(lanes[0], lanes[2]),
                    _mm512_add_ps(lanes[1], lanes[3]),
                );
            }
        }
        let scale16 = _mm512_set1_ps(scale);
        for (scores, lanes16) in scores.iter_mut().zip(&lanes16) {
            let s = _mm512_mul_ps(reduce16x16(lanes16), scale16);
            // SAFETY: `scores` holds exactly sixteen f32; the store is unaligned.
            unsafe { _mm512_storeu_ps(scores.as_mut_ptr(), s) };
        }
        let exp = |x: &[f32; CHUNK]| expf::expf_chunk(x);
        softmax_chunk(&scores, n, &mut max, &mut sum, &mut ms, &mut vs, exp);
        // The value rows, the check for subnormal weights only in chunks that have one: the
        // common chunk runs the plain loop.
        let tiny = vs
            .iter()
            .any(|vs| vs[..n].iter().any(|&w| subnormal_weight(w)));
        let rows = values.rows(head, d, first, n);
        if tiny {
            values_chunk::<N, G, true>(&mut acc, rows, &ms, &vs);
        } else {
            values_chunk::<N, G, false>(&mut acc, rows, &ms, &vs);
        }
        first += n;
    }
    for g in 0..G {
        let inv = _mm512_set1_ps(if sum[g] == 0.0 { 0.0 } else { 1.0 / sum[g] });
        for (j, a) in acc[g].iter().enumerate() {
            // SAFETY: `out` holds exactly `G · 16 N` f32 (asserted); storeu is unaligned.
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr().add(g * d + 16 * j), _mm512_mul_ps(*a, inv))
            };
        }
    }
}

/// The vector `expf` on sixteen values, for tests.
#[cfg(test)]
pub(super) fn expf16(cpu: Avx512, x: &[f32; CHUNK]) -> [f32; CHUNK] {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX-512 F.
    unsafe { expf::expf_chunk(x) }
}

/// The head kernel for heads of `head_dim` values, where there is one.
pub(super) fn head_kernel(cpu: Avx512, head_dim: usize) -> Option<HeadKernel<f16>> {
    let _ = cpu;
    match head_dim {
        64 => Some(heads::<4>),
        128 => Some(heads::<8>),
        256 => Some(heads::<16>),
        _ => None,
    }
}

/// The query heads in `qr` (one to four of `16 N` values) against one KV head; see
/// [`super::HeadKernel`].
fn heads<const N: usize>(qr: &[f32], job: HeadJob<'_, f16>, out: &mut [f32]) {
    let kernel = match qr.len() / (16 * N) {
        1 => heads_avx512::<N, 1>,
        2 => heads_avx512::<N, 2>,
        3 => heads_avx512::<N, 3>,
        4 => heads_avx512::<N, 4>,
        g => panic!(
            "a head kernel serves 1 to {} heads, got {g}",
            super::MAX_GROUP
        ),
    };
    // SAFETY: handed out only by `head_kernel`, which takes the AVX-512 token (AVX-512 F
    // brings the 512-bit f16 conversions).
    unsafe { kernel(qr, job, out) }
}
