//! The quantized products with AVX2: `maddubs` + `madd` give exactly the eight four-value
//! integer lanes of the portable code, then one fused multiply-add per block. On the
//! `avx-vnni` tier the 32-value formats' lanes are one `vpdpbusd` instead (exact four-product
//! sums, as `maddubs` is here: its 16-bit pair sums cannot saturate with these formats'
//! values), so the same bits in one instruction where AVX2 takes two. Every entry point
//! takes (or is handed out by a function that takes) the [`Avx2`] or [`crate::cpu::AvxVnni`]
//! token.

use std::arch::x86_64::*;

use super::float::{self, Activation, FloatFormat};
use super::portable::hsum8;
use super::sse2::{prefetch_ahead, Carry};
use super::{Batched, BlockFormat, Dot, Dot2, QuantizedRow, Tile, Unpacked, BLOCK};
use crate::cpu::{Avx2, ByteDot, Features};

/// `f`, compiled with its tier's target features — AVX2, FMA and F16C, and AVX-VNNI where
/// `VNNI` — so that the `#[inline]` kernel bodies it calls are inlined with them.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and (`VNNI`) AVX-VNNI.
#[inline(always)]
pub(super) unsafe fn on_tier<const VNNI: bool, R>(f: impl FnOnce() -> R) -> R {
    #[target_feature(enable = "avx2,fma,f16c")]
    fn avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn vnni<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
    // SAFETY: the caller guarantees the features.
    unsafe {
        if VNNI {
            vnni(f)
        } else {
            avx2(f)
        }
    }
}

const Q4_0: usize = BlockFormat::Q4_0.block_bytes();
const Q4_1: usize = BlockFormat::Q4_1.block_bytes();
const Q8_0: usize = BlockFormat::Q8_0.block_bytes();

/// Eight f32 lanes of a vector.
#[inline(always)]
pub(super) fn lanes(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `out` holds exactly eight f32; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// Unsigned weight bytes times signed activation bytes, four products per i32 lane: one
/// `vpdpbusd` where `VNNI`, `maddubs` + `madd` otherwise. The two agree because no pair sum
/// reaches `maddubs`'s 16-bit saturation: weight bytes are at most 128 (a signed format's
/// magnitudes) and activation bytes at most 127 in magnitude, so a pair at most 32 512.
#[inline]
#[target_feature(enable = "avx2")]
fn lane_sums<const VNNI: bool>(qx: __m256i, qy: __m256i) -> __m256 {
    let sums = if VNNI {
        // SAFETY: `VNNI` is set only in the kernels the `AvxVnni` token hands out, which run
        // with AVX-VNNI enabled (`on_tier`).
        unsafe { _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qx, qy) }
    } else {
        _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(qx, qy))
    };
    _mm256_cvtepi32_ps(sums)
}

/// [`super::portable::quantize_block`] with AVX2: the same scale, `127 / amax` products
/// and round-half-even conversion (the default rounding mode), so the same bytes.
#[inline]
pub(super) fn quantize_block(cpu: Avx2, block: &[f32], q: &mut [i8]) -> (f32, i32) {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX2.
    unsafe { quantize_block_avx2(block, q) }
}

#[target_feature(enable = "avx2")]
fn quantize_block_avx2(block: &[f32], q: &mut [i8]) -> (f32, i32) {
    assert!(block.len() == BLOCK && q.len() == BLOCK);
    // SAFETY: `block` holds exactly 32 f32 (asserted): four unaligned 8-lane loads.
    let v = unsafe {
        let p = block.as_ptr();
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    };
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
    );
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let i = [
        _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
        _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
    ];
    let total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    let t4 = _mm_add_epi32(
        _mm256_castsi256_si128(total),
        _mm256_extracti128_si256::<1>(total),
    );
    let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2)));
    // Packing interleaves 128-bit lanes; the permutation restores value order.
    let bytes = _mm256_packs_epi16(
        _mm256_packs_epi32(i[0], i[1]),
        _mm256_packs_epi32(i[2], i[3]),
    );
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `q` holds exactly 32 bytes (asserted); storeu is unaligned.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered) };
    (d, sum)
}

#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8]) -> __m256i {
    assert!(qs.len() >= 16);
    // SAFETY: the assertion guarantees 16 readable bytes; loadu is unaligned.
    let raw = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// One activation block's 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2")]
fn activation(a: &QuantizedRow, i: usize) -> __m256i {
    let q = &a.q[i * BLOCK..(i + 1) * BLOCK];
    // SAFETY: `q` is exactly 32 bytes; loadu is unaligned.
    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
}

/// The f16 at `b[at..at + 2]` in all eight lanes, exactly. The one-row dot products take a
/// block's scale and minimum this way rather than as a scalar `f16_at`: LLVM compiles a
/// scalar f16 conversion to a `vpinsrw` into whatever register is at hand, and when that was
/// an accumulator, every block waited for the block before (Q8_0 one-row decode on this tier
/// ran at 54 % of the read bound on a Zen 5, Q5_0 at half llama.cpp's speed).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn f16_splat(b: &[u8], at: usize) -> __m256 {
    let bits = i16::from_le_bytes([b[at], b[at + 1]]);
    _mm256_cvtph_ps(_mm_set1_epi16(bits))
}

/// A block's f16 scale at `b[at..at + 2]` times `ad` in all eight lanes: the f32 product
/// `f16_at(b, at) * ad`, lane by lane ([`f16_splat`]).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn scale_splat(b: &[u8], at: usize, ad: f32) -> __m256 {
    _mm256_mul_ps(f16_splat(b, at), _mm256_set1_ps(ad))
}

/// `summs` plus the block's f16 minimum at `b[at..at + 2]` times `s`, fused, in every lane
/// (each lane the scalar `f16_at(b, at).mul_add(s, summs)`; [`f16_splat`] says why not a
/// scalar).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn add_min(b: &[u8], at: usize, s: f32, summs: __m256) -> __m256 {
    _mm256_fmadd_ps(f16_splat(b, at), _mm256_set1_ps(s), summs)
}

/// The number of `stride`-byte blocks in each of the rows `w`, which must be as long as
/// each other and hold whole blocks.
#[inline(always)]
fn blocks_in<const R: usize>(w: &[&[u8]; R], stride: usize) -> usize {
    let len = w[0].len();
    assert!(
        len.is_multiple_of(stride) && w.iter().all(|w| w.len() == len),
        "weight rows of whole blocks, as long as each other"
    );
    len / stride
}

/// `ggml_vec_dot_q4_1_q8_1` of each of the `R` rows `w` with `a`: each row its own
/// accumulators, so its bits are the one-row product's whatever `R` is (see [`Dot2`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1<const VNNI: bool, const R: usize>(w: [&[u8]; R], a: &QuantizedRow) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [_mm256_setzero_ps(); R];
    for i in 0..blocks_in(&w, Q4_1) {
        let qy = activation(a, i);
        for r in 0..R {
            let b = &w[r][i * Q4_1..(i + 1) * Q4_1];
            prefetch_ahead(b.as_ptr(), 1);
            summs[r] = add_min(b, 2, a.s[i], summs[r]);
            let d = scale_splat(b, 0, a.d[i]);
            acc[r] = _mm256_fmadd_ps(d, lane_sums::<VNNI>(nibbles(&b[4..]), qy), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum8(lanes(acc[r])) + _mm256_cvtss_f32(summs[r]))
}

/// One block of one Q4_0/Q8_0 row: the eight-lane update.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_block<const VNNI: bool>(
    b: &[u8],
    a: &QuantizedRow,
    i: usize,
    qy: __m256i,
    acc: __m256,
    four_bit: bool,
) -> __m256 {
    let qx = if four_bit {
        _mm256_sub_epi8(nibbles(&b[2..]), _mm256_set1_epi8(8))
    } else {
        assert!(b.len() >= 34);
        // SAFETY: the assertion guarantees the block's 32 value bytes after its scale.
        unsafe { _mm256_loadu_si256(b[2..].as_ptr().cast()) }
    };
    // |x| times sign(x)·y: the same products, with the unsigned-by-signed instruction.
    let prod = lane_sums::<VNNI>(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
    _mm256_fmadd_ps(scale_splat(b, 0, a.d[i]), prod, acc)
}

/// The Q4_0 (`four_bit`) or Q8_0 dot product of each of the `R` rows `w` with `a`, each
/// row its own accumulator (as in [`q4_1`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed<const VNNI: bool, const R: usize>(
    w: [&[u8]; R],
    a: &QuantizedRow,
    stride: usize,
    four_bit: bool,
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..blocks_in(&w, stride) {
        let qy = activation(a, i);
        for r in 0..R {
            let b = &w[r][i * stride..(i + 1) * stride];
            prefetch_ahead(b.as_ptr(), stride.div_ceil(64));
            acc[r] = signed_block::<VNNI>(b, a, i, qy, acc[r], four_bit);
        }
    }
    std::array::from_fn(|r| hsum8(lanes(acc[r])))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn tile_avx2<const VNNI: bool>(u: &Unpacked, a: &QuantizedRow) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0f32; 4];
    for i in 0..a.d.len() {
        let qy = activation(a, i);
        for r in 0..4 {
            let k = i * 4 + r;
            // SAFETY: each unpacked block is exactly 32 bytes; loadu is unaligned.
            let qx = unsafe { _mm256_loadu_si256(u.q[k].as_ptr().cast()) };
            let prod = if u.signed {
                lane_sums::<VNNI>(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx))
            } else {
                summs[r] = u.m[k].mul_add(a.s[i], summs[r]);
                lane_sums::<VNNI>(qx, qy)
            };
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(u.d[k] * a.d[i]), prod, acc[r]);
        }
    }
    // A loop, not a closure over `acc` ([`tile_pair_avx2`] says why).
    let mut out = [0f32; 4];
    for ((out, acc), summs) in out.iter_mut().zip(acc).zip(summs) {
        *out = hsum8(lanes(acc)) + if u.signed { 0.0 } else { summs };
    }
    out
}

/// [`tile_avx2`] for two activation rows at once: each weight block is loaded, and for
/// signed formats made absolute, once for both rows, and the four weight rows × two
/// activation rows keep eight accumulators in registers. Every output's arithmetic is
/// [`tile_avx2`]'s (the same lanes, scale products and fused multiply-adds, block by block).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn tile_pair_avx2<const VNNI: bool>(u: &Unpacked, a: [&QuantizedRow; 2]) -> [[f32; 4]; 2] {
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let mut summs = [_mm_setzero_ps(); 2];
    let blocks = a[0].d.len();
    assert!(a[1].d.len() == blocks && u.d.len() >= 4 * blocks);
    for i in 0..blocks {
        let qy = [activation(a[0], i), activation(a[1], i)];
        // The block's eight scale products (weight row `k` by activation row `r` in lane
        // `4 r + k`) in one multiplication, each then broadcast from memory: a load, where a
        // scalar product and a register broadcast per pair took two slots of the
        // multiply-add pipes the integer products also need. The same f32 products.
        let mut scales = [0f32; 8];
        // SAFETY: `u.d` holds four scales per block (asserted); `scales` holds eight f32;
        // loads and stores are unaligned.
        unsafe {
            let dw = _mm_loadu_ps(u.d[i * 4..i * 4 + 4].as_ptr());
            let da = _mm256_set_m128(_mm_set1_ps(a[1].d[i]), _mm_set1_ps(a[0].d[i]));
            let products = _mm256_mul_ps(_mm256_set_m128(dw, dw), da);
            _mm256_storeu_ps(scales.as_mut_ptr(), products);
        }
        // Opaque, so the compiler keeps the products in memory rather than turning each
        // broadcast back into a shuffle of the register.
        let scales = std::hint::black_box(&scales);
        for (k, acc) in acc.iter_mut().enumerate() {
            let at = i * 4 + k;
            // SAFETY: each unpacked block is exactly 32 bytes; loadu is unaligned.
            let qx = unsafe { _mm256_loadu_si256(u.q[at].as_ptr().cast()) };
            let ax = if u.signed {
                _mm256_sign_epi8(qx, qx)
            } else {
                qx
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let sy = if u.signed {
                    _mm256_sign_epi8(qy[r], qx)
                } else {
                    qy[r]
                };
                let scale = _mm256_broadcast_ss(&scales[4 * r + k]);
                *acc = _mm256_fmadd_ps(scale, lane_sums::<VNNI>(ax, sy), *acc);
            }
        }
        if !u.signed {
            // SAFETY: block `i` has four minimums, one per weight row; loadu is unaligned.
            let m = unsafe { _mm_loadu_ps(u.m[i * 4..i * 4 + 4].as_ptr()) };
            for (r, summs) in summs.iter_mut().enumerate() {
                *summs = _mm_fmadd_ps(m, _mm_set1_ps(a[r].s[i]), *summs);
            }
        }
    }
    // Loops, not closures over `acc`: a closure called out of line kept the accumulators in
    // memory, and the loop above stored all eight after every block.
    let mut out = [[0f32; 4]; 2];
    for (r, (out, summs)) in out.iter_mut().zip(summs).enumerate() {
        let mut m = [0f32; 4];
        // SAFETY: `m` holds exactly four f32; storeu is unaligned.
        unsafe { _mm_storeu_ps(m.as_mut_ptr(), summs) };
        for (k, out) in out.iter_mut().enumerate() {
            *out = hsum8(lanes(acc[k][r])) + if u.signed { 0.0 } else { m[k] };
        }
    }
    out
}

/// The dot product for `format` on the better of the AVX2 tiers `features` has, if any.
pub(super) fn best_dot(features: Features, format: BlockFormat) -> Option<Dot> {
    match features.avx_vnni() {
        Some(cpu) => Some(dot(cpu, format)),
        None => features.avx2().map(|cpu| dot(cpu, format)),
    }
}

/// The two-row dot product for `format` on the better of the AVX2 tiers `features` has, if
/// any.
pub(super) fn best_dot2(features: Features, format: Batched) -> Option<Dot2> {
    match features.avx_vnni() {
        Some(cpu) => Some(dot2(cpu, format)),
        None => features.avx2().map(|cpu| dot2(cpu, format)),
    }
}

/// The buffered tile on the better of the AVX2 tiers `features` has, if any.
pub(super) fn best_tile(features: Features) -> Option<Tile> {
    match features.avx_vnni() {
        Some(cpu) => Some(tile(cpu)),
        None => features.avx2().map(tile),
    }
}

/// The Q5_0 (`signed`) or Q5_1 dot product on the better of the AVX2 tiers `features` has,
/// if any.
pub(super) fn best_dot_q5(features: Features, signed: bool) -> Option<Dot> {
    match features.avx_vnni() {
        Some(cpu) => Some(dot_q5(cpu, signed)),
        None => features.avx2().map(|cpu| dot_q5(cpu, signed)),
    }
}

/// The dot product for `format` on tier `T`.
pub(super) fn dot<T: ByteDot>(cpu: T, format: BlockFormat) -> Dot {
    let _ = cpu;
    if T::DOT {
        dots::<true>(format)
    } else {
        dots::<false>(format)
    }
}

fn dots<const VNNI: bool>(format: BlockFormat) -> Dot {
    match format {
        BlockFormat::Q4_1 => dot_q4_1::<VNNI>,
        BlockFormat::Q4_0 => dot_q4_0::<VNNI>,
        BlockFormat::Q8_0 => dot_q8_0::<VNNI>,
    }
}

/// The two-row dot product for `format` on tier `T`.
pub(super) fn dot2<T: ByteDot>(cpu: T, format: Batched) -> Dot2 {
    let _ = cpu;
    if T::DOT {
        dots2::<true>(format)
    } else {
        dots2::<false>(format)
    }
}

fn dots2<const VNNI: bool>(format: Batched) -> Dot2 {
    match format {
        Batched::Block(BlockFormat::Q4_1) => rows_q4_1::<VNNI, 2>,
        Batched::Block(BlockFormat::Q4_0) => rows_q4_0::<VNNI, 2>,
        Batched::Block(BlockFormat::Q8_0) => rows_q8_0::<VNNI, 2>,
        Batched::Q5_0 => rows_q5::<true, VNNI, 2>,
        Batched::Q5_1 => rows_q5::<false, VNNI, 2>,
    }
}

/// The buffered tile on tier `T`.
pub(super) fn tile<T: ByteDot>(cpu: T) -> Tile {
    let _ = cpu;
    if T::DOT {
        tile_rows::<true>
    } else {
        tile_rows::<false>
    }
}

// The functions below are handed out only by `dot`, `tile` and `dot_q5`, which take an
// AVX2 tier's token: each runs only where AVX2 and FMA were detected, and with `VNNI` only
// where AVX-VNNI was.

fn tile_rows<const VNNI: bool>(u: &Unpacked, a: &[QuantizedRow], out: &mut [[f32; 4]]) {
    let pairs = a.len() / 2 * 2;
    for (a, out) in a[..pairs].chunks_exact(2).zip(out.chunks_exact_mut(2)) {
        // SAFETY: handed out by `tile`, with its tier's token.
        let [o0, o1] = unsafe { on_tier::<VNNI, _>(|| tile_pair_avx2::<VNNI>(u, [&a[0], &a[1]])) };
        (out[0], out[1]) = (o0, o1);
    }
    for (a, out) in a[pairs..].iter().zip(&mut out[pairs..]) {
        // SAFETY: as above.
        *out = unsafe { on_tier::<VNNI, _>(|| tile_avx2::<VNNI>(u, a)) };
    }
}

fn dot_q4_1<const VNNI: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    rows_q4_1::<VNNI, 1>([w], a)[0]
}

fn dot_q4_0<const VNNI: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    rows_q4_0::<VNNI, 1>([w], a)[0]
}

fn dot_q8_0<const VNNI: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    rows_q8_0::<VNNI, 1>([w], a)[0]
}

fn rows_q4_1<const VNNI: bool, const R: usize>(w: [&[u8]; R], a: &QuantizedRow) -> [f32; R] {
    // SAFETY: handed out by `dot` or `dot2`, with its tier's token.
    unsafe { on_tier::<VNNI, _>(|| q4_1::<VNNI, R>(w, a)) }
}

fn rows_q4_0<const VNNI: bool, const R: usize>(w: [&[u8]; R], a: &QuantizedRow) -> [f32; R] {
    // SAFETY: handed out by `dot` or `dot2`, with its tier's token.
    unsafe { on_tier::<VNNI, _>(|| signed::<VNNI, R>(w, a, Q4_0, true)) }
}

fn rows_q8_0<const VNNI: bool, const R: usize>(w: [&[u8]; R], a: &QuantizedRow) -> [f32; R] {
    // SAFETY: handed out by `dot` or `dot2`, with its tier's token.
    unsafe { on_tier::<VNNI, _>(|| signed::<VNNI, R>(w, a, Q8_0, false)) }
}

/// The Q5_0 (`signed`) or Q5_1 dot product on tier `T`.
pub(super) fn dot_q5<T: ByteDot>(cpu: T, signed: bool) -> Dot {
    let _ = cpu;
    match (signed, T::DOT) {
        (true, false) => q5::<true, false>,
        (false, false) => q5::<false, false>,
        (true, true) => q5::<true, true>,
        (false, true) => q5::<false, true>,
    }
}

fn q5<const SIGNED: bool, const VNNI: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    rows_q5::<SIGNED, VNNI, 1>([w], a)[0]
}

fn rows_q5<const SIGNED: bool, const VNNI: bool, const R: usize>(
    w: [&[u8]; R],
    a: &QuantizedRow,
) -> [f32; R] {
    // SAFETY: handed out by `dot_q5` or `dot2`, with its tier's token.
    unsafe { on_tier::<VNNI, _>(|| q5_avx2::<SIGNED, VNNI, R>(w, a)) }
}

/// ggml's `bytes_from_bits_32`: byte `j` all ones where bit `j` of the four bytes is set.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_from_bits(qh: &[u8]) -> __m256i {
    let x32 = i32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf);
    let bit_mask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit_mask), _mm256_set1_epi64x(-1))
}

/// `ggml_vec_dot_q5_0_q8_0` (`SIGNED`) and `ggml_vec_dot_q5_1_q8_1` of each of the `R`
/// rows `w` with `a`, each row its own accumulators (as in [`q4_1`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_avx2<const SIGNED: bool, const VNNI: bool, const R: usize>(
    w: [&[u8]; R],
    a: &QuantizedRow,
) -> [f32; R] {
    let stride = if SIGNED {
        super::q5::Q5_0_BYTES
    } else {
        super::q5::Q5_1_BYTES
    };
    let (qh_at, qs_at) = if SIGNED { (2, 6) } else { (4, 8) };
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [_mm256_setzero_ps(); R];
    for i in 0..blocks_in(&w, stride) {
        let qy = activation(a, i);
        for r in 0..R {
            let b = &w[r][i * stride..(i + 1) * stride];
            prefetch_ahead(b.as_ptr(), 1);
            let qx = nibbles(&b[qs_at..]);
            let hi = bytes_from_bits(&b[qh_at..]);
            if SIGNED {
                let qx = _mm256_or_si256(qx, _mm256_andnot_si256(hi, _mm256_set1_epi8(-16)));
                let d = scale_splat(b, 0, a.d[i]);
                let q = lane_sums::<VNNI>(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
                acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
            } else {
                summs[r] = add_min(b, 2, a.s[i], summs[r]);
                let qx = _mm256_or_si256(qx, _mm256_and_si256(hi, _mm256_set1_epi8(0x10)));
                let d = scale_splat(b, 0, a.d[i]);
                acc[r] = _mm256_fmadd_ps(lane_sums::<VNNI>(qx, qy), d, acc[r]);
            }
        }
    }
    std::array::from_fn(|r| hsum8(lanes(acc[r])) + _mm256_cvtss_f32(summs[r]))
}

/// Eight values of `format` (weights, or activations as [`float::Activation::FORMAT`]
/// names them) from `w` at value `i`, widened exactly.
///
/// # Safety
/// `w` must hold eight values of `format` from value `i` on.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_float(format: FloatFormat, w: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees eight readable values at `i`.
    unsafe {
        match format {
            FloatFormat::F32 => _mm256_loadu_ps(w.add(4 * i).cast()),
            FloatFormat::F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i).cast())),
            FloatFormat::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * i).cast())),
            )),
        }
    }
}

/// The odd and the even BF16 values of the eight column pairs at `w` (16 values), widened
/// exactly: eight lanes of each half of the pair order.
///
/// # Safety
/// `w` must hold 16 BF16 values.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_pairs(w: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees 32 readable bytes.
    let v = unsafe { _mm256_loadu_si256(w.cast()) };
    let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000_u32 as i32));
    let even = _mm256_slli_epi32::<16>(v);
    (_mm256_castsi256_ps(odd), _mm256_castsi256_ps(even))
}

/// A BF16 row's whole pair-order blocks (`out.len()` values, a multiple of
/// [`float::PAIR_BLOCK`]) widened exactly into `out` in pair order.
pub(super) fn float_widen_paired(cpu: Avx2, row: &[u8], out: &mut [f32]) {
    let _ = cpu;
    assert!(
        out.len().is_multiple_of(float::PAIR_BLOCK) && row.len() >= 2 * out.len(),
        "whole pair-order blocks"
    );
    // SAFETY: `cpu` proves AVX2; the row holds `out.len()` BF16 values.
    unsafe { float_widen_paired_avx2(row, out) }
}

/// # Safety
/// `row` must hold `out.len()` BF16 values, a multiple of [`float::PAIR_BLOCK`].
#[target_feature(enable = "avx2")]
unsafe fn float_widen_paired_avx2(row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for b in (0..out.len()).step_by(float::PAIR_BLOCK) {
        for j in 0..8 {
            // SAFETY: columns `b + 16 j .. b + 16 j + 16` are in the row, and both halves'
            // lanes `b + 8 j ..` and `b + 64 + 8 j ..` in `out`.
            unsafe {
                let (odd, even) = load_pairs(w.add(2 * (b + 16 * j)));
                _mm256_storeu_ps(o.add(b + 8 * j), odd);
                _mm256_storeu_ps(o.add(b + float::LANES + 8 * j), even);
            }
        }
    }
}

/// Eight 8-lane accumulators holding the 64 partial sums of [`float::LANES`], folded as
/// the AVX-512 code folds its four 16-lane ones.
#[inline]
#[target_feature(enable = "avx2")]
fn fold_float(a: [__m256; 8]) -> f32 {
    let lo = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
    let (lo, hi) = (lanes(lo), lanes(hi));
    float::fold16(std::array::from_fn(
        |l| if l < 8 { lo[l] } else { hi[l - 8] },
    ))
}

/// Four widened weight rows against activation rows `x` (an even number, at most
/// [`float::TILE_ROWS`]): `out[a][r]`, each [`float_dot_f32`]'s result. Two activation
/// rows meet the four weight rows at a time in eight accumulators, one eighth of each
/// 64-value step per pass (the eighths' partial sums never meet before the fold, so each
/// lane's chain of multiply-adds is the single row's), six loads per eight multiply-adds
/// where one row at a time takes two per one.
pub(super) fn float_tile(
    cpu: Avx2,
    format: FloatFormat,
    w: [&[f32]; 4],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    float::tile_columns(w.map(<[f32]>::len), x, out.len(), 2);
    // SAFETY: `cpu` proves AVX2 and FMA; every row holds as many values as `x[0]`.
    unsafe { float_tile_avx2(Widened(w, format), x, ahead, out) }
}

/// [`float_tile`] on four F16 weight rows as stored: each weight vector widened by
/// `vcvtph2ps` as the tile loads it, so no widened copy of the rows is written and read
/// back. The same values meet the same multiply-adds, so the same bits.
pub(super) fn float_tile_f16(
    cpu: Avx2,
    w: [&[u8]; 4],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    float::tile_columns(w.map(|w| w.len() / 2), x, out.len(), 2);
    // SAFETY: `cpu` proves AVX2, FMA and F16C; every row holds as many values as `x[0]`.
    unsafe { float_tile_avx2(F16Rows(w), x, ahead, out) }
}

/// Where the tile's four weight rows come from.
trait TileRows: Copy {
    /// The format the rows' values were stored in (how the tail is summed).
    fn format(self) -> FloatFormat;
    /// Eight values of row `r` from value `i`, as f32.
    ///
    /// # Safety
    /// Row `r` must hold eight values from `i` on, and the CPU must have AVX2 and F16C.
    unsafe fn load(self, r: usize, i: usize) -> __m256;
    /// Value `i` of row `r`, exactly.
    fn at(self, r: usize, i: usize) -> f32;
}

/// Four weight rows widened to f32 beforehand, and the format they were stored in.
#[derive(Clone, Copy)]
struct Widened<'a>([&'a [f32]; 4], FloatFormat);

/// Four F16 weight rows as stored.
#[derive(Clone, Copy)]
struct F16Rows<'a>([&'a [u8]; 4]);

impl TileRows for Widened<'_> {
    fn format(self) -> FloatFormat {
        self.1
    }

    #[inline(always)]
    unsafe fn load(self, r: usize, i: usize) -> __m256 {
        // SAFETY: the caller guarantees eight values at `i` and AVX2.
        unsafe { _mm256_loadu_ps(self.0[r].as_ptr().add(i)) }
    }

    fn at(self, r: usize, i: usize) -> f32 {
        self.0[r][i]
    }
}

impl TileRows for F16Rows<'_> {
    fn format(self) -> FloatFormat {
        FloatFormat::F16
    }

    #[inline(always)]
    unsafe fn load(self, r: usize, i: usize) -> __m256 {
        // SAFETY: the caller guarantees eight values at `i` and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(self.0[r].as_ptr().add(2 * i).cast())) }
    }

    fn at(self, r: usize, i: usize) -> f32 {
        FloatFormat::F16.at(self.0[r], i)
    }
}

/// # Safety
/// Every row of `w` and `x` must hold `x[0].len()` values; `x` holds an even number of
/// rows, at most [`float::TILE_ROWS`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_tile_avx2<W: TileRows>(w: W, x: &[&[f32]], ahead: &[u8], out: &mut [[f32; 4]]) {
    let k = x[0].len();
    let whole = k / float::LANES * float::LANES;
    let pairs = x.len() / 2;
    // `part[p][e]`, `[a][r]` of it: eighth `e`'s partial sums of activation row `2p + a` by
    // weight row `r`, carried from one block of columns to the next.
    let mut part = [[Carry::UNSET; 8]; float::TILE_ROWS / 2];
    // At least one block, so every carry is put, even with no whole step.
    let block = float::TILE_BLOCK;
    let blocks = whole.div_ceil(block).max(1);
    let mut ahead = float::shares(ahead, 8 * pairs * blocks);
    for b in 0..blocks {
        let (from, to) = (b * block, ((b + 1) * block).min(whole));
        for (p, part) in part.iter_mut().take(pairs).enumerate() {
            let xp = [x[2 * p].as_ptr(), x[2 * p + 1].as_ptr()];
            for (e, part) in part.iter_mut().enumerate() {
                for line in ahead.next().unwrap_or_default().chunks(64) {
                    super::sse2::prefetch_line(line);
                }
                // SAFETY: the first block's pass put every carry the later ones start from.
                let mut acc = unsafe { part.start(b == 0, [[_mm256_setzero_ps(); 4]; 2]) };
                let mut i = from + 8 * e;
                while i < to {
                    // SAFETY: `i + 8 <= to <= whole <= k` values of every row.
                    unsafe {
                        let wv = [w.load(0, i), w.load(1, i), w.load(2, i), w.load(3, i)];
                        for (a, acc) in acc.iter_mut().enumerate() {
                            let xv = _mm256_loadu_ps(xp[a].add(i));
                            for (acc, wv) in acc.iter_mut().zip(wv) {
                                *acc = _mm256_fmadd_ps(wv, xv, *acc);
                            }
                        }
                    }
                    i += float::LANES;
                }
                part.put(acc);
            }
        }
    }
    for (p, part) in part.iter().take(pairs).enumerate() {
        // SAFETY: the blocks put the carries of the first `pairs` pairs.
        let part: [&[[__m256; 4]; 2]; 8] = std::array::from_fn(|e| unsafe { part[e].sums() });
        for a in 0..2 {
            let xa = x[2 * p + a];
            for r in 0..4 {
                let folded = fold_float(std::array::from_fn(|e| part[e][a][r]));
                let tail = (whole..k).map(|i| (w.at(r, i), xa[i]));
                out[2 * p + a][r] = float::finish(w.format(), folded, tail);
            }
        }
    }
}

/// The first values of weight row `row` widened exactly into `out`, eight per instruction;
/// returns how many (`out.len()` rounded down to a multiple of eight). The caller checks
/// that `row` holds `out.len()` values of `format`.
pub(super) fn float_widen(cpu: Avx2, format: FloatFormat, row: &[u8], out: &mut [f32]) -> usize {
    let _ = cpu;
    let whole = out.len() / 8 * 8;
    assert!(
        row.len() >= whole * format.bytes(),
        "weight row shorter than its output"
    );
    // SAFETY: `cpu` proves AVX2 and F16C; the row holds `whole` values.
    unsafe { float_widen_avx2(format, row, &mut out[..whole]) };
    whole
}

/// # Safety
/// `row` must hold `out.len()` values of `format`, a multiple of eight.
#[target_feature(enable = "avx2,f16c")]
unsafe fn float_widen_avx2(format: FloatFormat, row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for i in (0..out.len()).step_by(8) {
        // SAFETY: values `i..i + 8` are in both `row` and `out`; unaligned loads and stores.
        unsafe {
            let v = match format {
                FloatFormat::F32 => _mm256_loadu_ps(w.add(4 * i).cast()),
                FloatFormat::F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i).cast())),
                FloatFormat::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * i).cast())),
                )),
            };
            _mm256_storeu_ps(o.add(i), v);
        }
    }
}

/// Weight row `w` (in `format`, `x.len()` values) against activation row `x`, in the
/// arithmetic of [`float`].
pub(super) fn float_dot<T: Activation>(cpu: Avx2, format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
    let _ = cpu;
    assert!(
        w.len() >= x.len() * format.bytes(),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves AVX2, FMA and F16C; the row holds `x.len()` values.
    unsafe { float_dot_avx2(format, w.as_ptr(), x) }
}

/// A widened weight row against activation row `x`, in the arithmetic of [`float`].
pub(super) fn float_dot_f32(cpu: Avx2, format: FloatFormat, w: &[f32], x: &[f32]) -> f32 {
    let _ = cpu;
    assert!(w.len() >= x.len(), "weight row shorter than its input");
    // SAFETY: `cpu` proves AVX2, FMA and F16C; the row holds `x.len()` f32 values.
    let folded = unsafe { float_sums_avx2(FloatFormat::F32, w.as_ptr().cast(), x) };
    let whole = x.len() / float::LANES * float::LANES;
    let tail = w[whole..x.len()]
        .iter()
        .copied()
        .zip(x[whole..].iter().copied());
    float::finish(format, folded, tail)
}

/// # Safety
/// `w` must hold `x.len()` values of `format`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_dot_avx2<T: Activation>(format: FloatFormat, w: *const u8, x: &[T]) -> f32 {
    // SAFETY: forwarded from the caller.
    let folded = unsafe { float_sums_avx2(format, w, x) };
    let whole = x.len() / float::LANES * float::LANES;
    // SAFETY: the caller guarantees `x.len()` values of `format` at `w`.
    let row = unsafe { std::slice::from_raw_parts(w, x.len() * format.bytes()) };
    let tail = (whole..x.len()).map(|i| (format.at(row, i), x[i].value()));
    float::finish(format, folded, tail)
}

/// The folded sum of the whole 64-value steps.
///
/// # Safety
/// `w` must hold `x.len()` values of `format`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_sums_avx2<T: Activation>(format: FloatFormat, w: *const u8, x: &[T]) -> f32 {
    let whole = x.len() / float::LANES * float::LANES;
    let mut acc = [_mm256_setzero_ps(); 8];
    let xp = x.as_ptr();
    let mut i = 0;
    if format == FloatFormat::BF16 {
        // Whole pair-order blocks: each lane's odd column, then its even one.
        while i + float::PAIR_BLOCK <= x.len() {
            prefetch_ahead(w.wrapping_add(2 * i), float::PAIR_BLOCK / 32);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: columns `i .. i + 128` of both rows.
                unsafe {
                    let (odd, even) = load_pairs(w.add(2 * (i + 16 * j)));
                    *a = _mm256_fmadd_ps(odd, load_float(T::FORMAT, xp.cast(), i + 8 * j), *a);
                    let x_even = load_float(T::FORMAT, xp.cast(), i + float::LANES + 8 * j);
                    *a = _mm256_fmadd_ps(even, x_even, *a);
                }
            }
            i += float::PAIR_BLOCK;
        }
    }
    while i < whole {
        prefetch_ahead(
            w.wrapping_add(i * format.bytes()),
            float::LANES * format.bytes() / 64,
        );
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `i + 8 j + 8 <= whole <= x.len()` values of both rows.
            unsafe {
                let wv = load_float(format, w, i + 8 * j);
                *a = _mm256_fmadd_ps(wv, load_float(T::FORMAT, xp.cast(), i + 8 * j), *a);
            }
        }
        i += float::LANES;
    }
    fold_float(acc)
}
