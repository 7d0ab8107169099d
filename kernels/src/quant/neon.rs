//! The products on arm64 with NEON: the 32-value formats (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1),
//! activation quantization and the floating-point weights (F32, F16, BF16), each the
//! portable code's arithmetic bit for bit. A block's eight integer lanes of four products
//! are widening byte multiplies (`smull`) added pairwise twice — exact sums, so the same
//! lanes whatever the order — then one fused multiply-add per block, as the other tiers do;
//! a float product's 64 partial sums are sixteen 4-lane accumulators. Where the CPU has
//! Armv8.2's dot product instructions (the `neon-dotprod` tier), `sdot` gives the same
//! four-product lanes in one instruction. F16 values are widened by integer shifts and one
//! exact multiply by 2^112, BF16 by a 16-bit shift. (The intrinsics of `sdot` and of the F16
//! conversion are not stable in Rust 1.95: `sdot` is written as inline assembly.) Every
//! entry point takes (or is handed out by a function that takes) a NEON tier's token.

use std::arch::aarch64::*;
use std::arch::asm;

use super::float::{self, Activation, FloatFormat, LANES, PAIR_BLOCK};
use super::portable::hsum8;
use super::{f16_at, q5, Batched, BlockFormat, Dot, QuantizedRow, Tile, Unpacked, BLOCK};
use crate::cpu::{ByteDot, Features, Neon};

// The block formats, as the kernels' const parameter.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;

/// Bytes of a block of format `F`.
const fn stride(f: u8) -> usize {
    match f {
        Q4_0 => BlockFormat::Q4_0.block_bytes(),
        Q4_1 => BlockFormat::Q4_1.block_bytes(),
        Q8_0 => BlockFormat::Q8_0.block_bytes(),
        Q5_0 => q5::Q5_0_BYTES,
        _ => q5::Q5_1_BYTES,
    }
}

/// Whether format `F` has a minimum per block (and its activations their sums).
const fn has_mins(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

/// Two vectors' eight f32 lanes, in order.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn lanes8(v: [float32x4_t; 2]) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `out` holds exactly eight f32; the stores need no alignment.
    unsafe {
        vst1q_f32(out.as_mut_ptr(), v[0]);
        vst1q_f32(out.as_mut_ptr().add(4), v[1]);
    }
    out
}

/// `acc` plus the sixteen signed byte products of `w` and `a` summed four by four: `sdot`.
#[inline]
#[target_feature(enable = "neon,dotprod")]
fn sdot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads and writes only these three registers; the target feature says
    // the CPU has it.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            a = in(vreg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// Sixteen signed byte products summed four by four: values `4l..4l + 4` in lane `l`,
/// exactly (at most 4 · 128 · 128 in magnitude) — by `sdot` where `DOT`, by widening
/// multiplies added pairwise twice otherwise.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn dot4<const DOT: bool>(w: int8x16_t, a: int8x16_t) -> int32x4_t {
    if DOT {
        // SAFETY: `DOT` is set only in the kernels the `NeonDotprod` token hands out, which
        // run with the dot product feature enabled.
        unsafe { sdot(vdupq_n_s32(0), w, a) }
    } else {
        let lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
        let hi = vpaddlq_s16(vmull_high_s8(w, a));
        vpaddq_s32(lo, hi)
    }
}

/// The eight lanes of one block, values `4l..4l + 4` in lane `l`, as f32 (exact).
#[inline]
#[target_feature(enable = "neon")]
fn block_lanes<const DOT: bool>(w: [int8x16_t; 2], a: [int8x16_t; 2]) -> [float32x4_t; 2] {
    [
        vcvtq_f32_s32(dot4::<DOT>(w[0], a[0])),
        vcvtq_f32_s32(dot4::<DOT>(w[1], a[1])),
    ]
}

/// Activation block `i`'s 32 bytes.
#[inline]
#[target_feature(enable = "neon")]
fn activation(a: &QuantizedRow, i: usize) -> [int8x16_t; 2] {
    let q = &a.q[i * BLOCK..(i + 1) * BLOCK];
    // SAFETY: `q` is exactly 32 bytes; the loads need no alignment.
    unsafe { [vld1q_s8(q.as_ptr()), vld1q_s8(q.as_ptr().add(16))] }
}

/// The 32 values of a 4-bit block (low nibbles first), as unsigned bytes.
#[inline]
#[target_feature(enable = "neon")]
fn nibbles(qs: &[u8]) -> [uint8x16_t; 2] {
    assert!(qs.len() >= 16);
    // SAFETY: the assertion guarantees 16 readable bytes; the load needs no alignment.
    let raw = unsafe { vld1q_u8(qs.as_ptr()) };
    [vandq_u8(raw, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(raw)]
}

/// Bit 4 of each of the 32 values from a 5-bit block's four high-bit bytes: `0x10` where
/// bit `j` is set, for value `j`.
#[inline]
#[target_feature(enable = "neon")]
fn high_bits(qh: &[u8]) -> [uint8x16_t; 2] {
    // SAFETY: the mask's sixteen bytes are read from a 16-byte array.
    let mask =
        unsafe { vld1q_u8([1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128].as_ptr()) };
    let set = |a: u8, b: u8| {
        let bytes = vcombine_u8(vdup_n_u8(a), vdup_n_u8(b));
        vandq_u8(vtstq_u8(bytes, mask), vdupq_n_u8(0x10))
    };
    [set(qh[0], qh[1]), set(qh[2], qh[3])]
}

/// The 32 values of block `b` of format `F`, signed as the portable code has them.
#[inline]
#[target_feature(enable = "neon")]
fn values<const F: u8>(b: &[u8]) -> [int8x16_t; 2] {
    let signed = |v: [uint8x16_t; 2], offset: u8| {
        let o = vdupq_n_u8(offset);
        [0, 1].map(|h| vreinterpretq_s8_u8(vsubq_u8(v[h], o)))
    };
    match F {
        Q4_0 => signed(nibbles(&b[2..18]), 8),
        Q4_1 => signed(nibbles(&b[4..20]), 0),
        Q8_0 => {
            assert!(b.len() >= 34);
            // SAFETY: the assertion guarantees the 32 value bytes after the scale.
            unsafe {
                [
                    vld1q_s8(b[2..].as_ptr().cast()),
                    vld1q_s8(b[18..].as_ptr().cast()),
                ]
            }
        }
        Q5_0 => {
            let (n, h) = (nibbles(&b[6..22]), high_bits(&b[2..6]));
            signed([vorrq_u8(n[0], h[0]), vorrq_u8(n[1], h[1])], 16)
        }
        _ => {
            let (n, h) = (nibbles(&b[8..24]), high_bits(&b[4..8]));
            signed([vorrq_u8(n[0], h[0]), vorrq_u8(n[1], h[1])], 0)
        }
    }
}

/// A weight row of format `F` against an activation row: the portable dot product's lanes,
/// fused multiply-adds and reduction.
#[inline]
#[target_feature(enable = "neon")]
fn dot_body<const F: u8, const DOT: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 2];
    let mut summs = 0f32;
    for (i, b) in w.chunks_exact(stride(F)).enumerate() {
        if has_mins(F) {
            summs = f16_at(b, 2).mul_add(a.s[i], summs);
        }
        let l = block_lanes::<DOT>(values::<F>(b), activation(a, i));
        let d = vdupq_n_f32(f16_at(b, 0) * a.d[i]);
        acc = [vfmaq_f32(acc[0], d, l[0]), vfmaq_f32(acc[1], d, l[1])];
    }
    hsum8(lanes8(acc)) + summs
}

#[target_feature(enable = "neon")]
fn dot_neon<const F: u8>(w: &[u8], a: &QuantizedRow) -> f32 {
    dot_body::<F, false>(w, a)
}

#[target_feature(enable = "neon,dotprod")]
fn dot_dotprod<const F: u8>(w: &[u8], a: &QuantizedRow) -> f32 {
    dot_body::<F, true>(w, a)
}

/// The dot product for `format` on the best NEON tier `features` has, if any.
pub(super) fn best_dot(features: Features, format: Batched) -> Option<Dot> {
    match features.neon_dotprod() {
        Some(cpu) => Some(dot(cpu, format)),
        None => features.neon().map(|cpu| dot(cpu, format)),
    }
}

/// The dot product for `format` on tier `T`.
pub(super) fn dot<T: ByteDot>(cpu: T, format: Batched) -> Dot {
    let _ = cpu;
    if T::DOT {
        dots::<true>(format)
    } else {
        dots::<false>(format)
    }
}

fn dots<const DOT: bool>(format: Batched) -> Dot {
    match format {
        Batched::Block(BlockFormat::Q4_0) => run_dot::<Q4_0, DOT>,
        Batched::Block(BlockFormat::Q4_1) => run_dot::<Q4_1, DOT>,
        Batched::Block(BlockFormat::Q8_0) => run_dot::<Q8_0, DOT>,
        Batched::Q5_0 => run_dot::<Q5_0, DOT>,
        Batched::Q5_1 => run_dot::<Q5_1, DOT>,
    }
}

fn run_dot<const F: u8, const DOT: bool>(w: &[u8], a: &QuantizedRow) -> f32 {
    // SAFETY: handed out only by `dot`, with a NEON token, and with `DOT` only for the
    // `NeonDotprod` token.
    unsafe {
        if DOT {
            dot_dotprod::<F>(w, a)
        } else {
            dot_neon::<F>(w, a)
        }
    }
}

/// The buffered tile on the best NEON tier `features` has, if any.
pub(super) fn best_tile(features: Features) -> Option<Tile> {
    match features.neon_dotprod() {
        Some(cpu) => Some(tile(cpu)),
        None => features.neon().map(tile),
    }
}

/// The buffered tile on tier `T`: four unpacked weight rows against the activation rows
/// two at a time, each weight block loaded once for both.
pub(super) fn tile<T: ByteDot>(cpu: T) -> Tile {
    let _ = cpu;
    if T::DOT {
        tile_rows::<true>
    } else {
        tile_rows::<false>
    }
}

fn tile_rows<const DOT: bool>(u: &Unpacked, a: &[QuantizedRow], out: &mut [[f32; 4]]) {
    let pairs = a.len() / 2 * 2;
    for (a, out) in a[..pairs].chunks_exact(2).zip(out.chunks_exact_mut(2)) {
        // SAFETY: handed out only by `tile`, with a NEON token, and with `DOT` only for the
        // `NeonDotprod` token.
        let [o0, o1] = unsafe { tile_tier::<2, DOT>(u, [&a[0], &a[1]]) };
        (out[0], out[1]) = (o0, o1);
    }
    for (a, out) in a[pairs..].iter().zip(&mut out[pairs..]) {
        // SAFETY: as above.
        [*out] = unsafe { tile_tier::<1, DOT>(u, [a]) };
    }
}

/// [`tile_body`] with the target features of its tier.
///
/// # Safety
/// The CPU must have NEON, and (`DOT`) the dot product instructions.
#[inline]
unsafe fn tile_tier<const N: usize, const DOT: bool>(
    u: &Unpacked,
    a: [&QuantizedRow; N],
) -> [[f32; 4]; N] {
    #[target_feature(enable = "neon")]
    fn neon<const N: usize>(u: &Unpacked, a: [&QuantizedRow; N]) -> [[f32; 4]; N] {
        tile_body::<N, false>(u, a)
    }
    #[target_feature(enable = "neon,dotprod")]
    fn dotprod<const N: usize>(u: &Unpacked, a: [&QuantizedRow; N]) -> [[f32; 4]; N] {
        tile_body::<N, true>(u, a)
    }
    // SAFETY: the caller guarantees the features.
    unsafe {
        if DOT {
            dotprod::<N>(u, a)
        } else {
            neon::<N>(u, a)
        }
    }
}

/// Four unpacked weight rows against `N` activation rows: for each output the lanes, scale
/// products and fused multiply-adds of [`dot_body`], block by block.
#[inline]
#[target_feature(enable = "neon")]
fn tile_body<const N: usize, const DOT: bool>(
    u: &Unpacked,
    a: [&QuantizedRow; N],
) -> [[f32; 4]; N] {
    let mut acc = [[[vdupq_n_f32(0.0); 2]; 4]; N];
    let mut summs = [[0f32; 4]; N];
    for i in 0..a[0].d.len() {
        let y = a.map(|a| activation(a, i));
        for r in 0..4 {
            let k = i * 4 + r;
            let q = &u.q[k];
            // SAFETY: each unpacked block is exactly 32 bytes; the loads need no alignment.
            let x = unsafe { [vld1q_s8(q.as_ptr()), vld1q_s8(q.as_ptr().add(16))] };
            for n in 0..N {
                if !u.signed {
                    summs[n][r] = u.m[k].mul_add(a[n].s[i], summs[n][r]);
                }
                let l = block_lanes::<DOT>(x, y[n]);
                let d = vdupq_n_f32(u.d[k] * a[n].d[i]);
                let acc = &mut acc[n][r];
                *acc = [vfmaq_f32(acc[0], d, l[0]), vfmaq_f32(acc[1], d, l[1])];
            }
        }
    }
    std::array::from_fn(|n| {
        std::array::from_fn(|r| hsum8(lanes8(acc[n][r])) + if u.signed { 0.0 } else { summs[n][r] })
    })
}

/// [`super::portable::quantize_block`] with NEON: the same scale, `127 / amax` products and
/// round-half-even conversion (`fcvtns`), so the same bytes.
pub(super) fn quantize_block(cpu: Neon, block: &[f32], q: &mut [i8]) -> (f32, i32) {
    let _ = cpu;
    // SAFETY: `cpu` proves NEON.
    unsafe { quantize_block_neon(block, q) }
}

#[target_feature(enable = "neon")]
fn quantize_block_neon(block: &[f32], q: &mut [i8]) -> (f32, i32) {
    assert!(block.len() == BLOCK && q.len() == BLOCK);
    // SAFETY: `block` holds exactly 32 f32 (asserted); the loads need no alignment.
    let v: [float32x4_t; 8] =
        std::array::from_fn(|j| unsafe { vld1q_f32(block.as_ptr().add(4 * j)) });
    // `fmaxnm`, like `f32::max`, ignores a NaN beside a number.
    let m = v
        .iter()
        .fold(vdupq_n_f32(0.0), |m, &v| vmaxnmq_f32(m, vabsq_f32(v)));
    let amax = vmaxnmvq_f32(m);
    let d = amax / 127.0;
    let id = vdupq_n_f32(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let r = v.map(|v| vcvtnq_s32_f32(vmulq_f32(v, id)));
    let total = r.iter().fold(vdupq_n_s32(0), |t, &r| vaddq_s32(t, r));
    let sum = vaddvq_s32(total);
    for (h, r) in r.chunks_exact(4).enumerate() {
        // Truncating narrows, as `as i8` truncates.
        let lo = vcombine_s16(vmovn_s32(r[0]), vmovn_s32(r[1]));
        let hi = vcombine_s16(vmovn_s32(r[2]), vmovn_s32(r[3]));
        let bytes = vcombine_s8(vmovn_s16(lo), vmovn_s16(hi));
        // SAFETY: `q` holds exactly 32 bytes (asserted); sixteen from 16 h.
        unsafe { vst1q_s8(q.as_mut_ptr().add(16 * h), bytes) };
    }
    (d, sum)
}

/// Four F16 values widened exactly: the exponent and mantissa moved into f32's places and
/// multiplied by 2^112 (exact for normal and subnormal values alike), infinities and NaNs
/// (made quiet, as the conversion instructions make them) set apart, then the sign.
#[inline]
#[target_feature(enable = "neon")]
fn widen_f16(h: uint16x4_t) -> float32x4_t {
    let x = vmovl_u16(h);
    let sign = vshlq_n_u32::<16>(vandq_u32(x, vdupq_n_u32(0x8000)));
    let em = vandq_u32(x, vdupq_n_u32(0x7fff));
    let moved = vshlq_n_u32::<13>(em);
    let scaled = vmulq_f32(
        vreinterpretq_f32_u32(moved),
        vdupq_n_f32(f32::from_bits(0x7780_0000)),
    );
    let special = vcgeq_u32(em, vdupq_n_u32(0x7c00));
    let nan = vcgtq_u32(em, vdupq_n_u32(0x7c00));
    let infnan = vorrq_u32(
        vorrq_u32(moved, vdupq_n_u32(0x7f80_0000)),
        vandq_u32(nan, vdupq_n_u32(0x0040_0000)),
    );
    let mag = vbslq_u32(special, infnan, vreinterpretq_u32_f32(scaled));
    vreinterpretq_f32_u32(vorrq_u32(mag, sign))
}

/// Four values of `format` from `w` at value `i`, widened exactly.
///
/// # Safety
/// `w` must hold four values of `format` from value `i` on.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load(format: FloatFormat, w: *const u8, i: usize) -> float32x4_t {
    // SAFETY: the caller guarantees four readable values at `i`; no alignment needed.
    unsafe {
        match format {
            FloatFormat::F32 => vld1q_f32(w.add(4 * i).cast()),
            FloatFormat::F16 => widen_f16(vld1_u16(w.add(2 * i).cast())),
            FloatFormat::BF16 => {
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(w.add(2 * i).cast())))
            }
        }
    }
}

/// The odd and the even BF16 values of the four column pairs at `w` (eight values), widened
/// exactly: four lanes of the pair order's two halves.
///
/// # Safety
/// `w` must hold eight BF16 values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load_pairs(w: *const u8) -> (float32x4_t, float32x4_t) {
    // SAFETY: the caller guarantees 16 readable bytes; no alignment needed.
    let v = unsafe { vld1q_u32(w.cast()) };
    let odd = vandq_u32(v, vdupq_n_u32(0xffff_0000));
    let even = vshlq_n_u32::<16>(v);
    (vreinterpretq_f32_u32(odd), vreinterpretq_f32_u32(even))
}

/// The first values of weight row `row` widened exactly into `out`, four at a time; returns
/// how many (`out.len()` rounded down to a multiple of four).
pub(super) fn float_widen(cpu: Neon, format: FloatFormat, row: &[u8], out: &mut [f32]) -> usize {
    let _ = cpu;
    let whole = out.len() / 4 * 4;
    assert!(
        row.len() >= whole * format.bytes(),
        "weight row shorter than its output"
    );
    // SAFETY: `cpu` proves NEON; the row holds `whole` values.
    unsafe { float_widen_neon(format, row, &mut out[..whole]) };
    whole
}

/// # Safety
/// `row` must hold `out.len()` values of `format`, a multiple of four.
#[target_feature(enable = "neon")]
unsafe fn float_widen_neon(format: FloatFormat, row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for i in (0..out.len()).step_by(4) {
        // SAFETY: values `i..i + 4` are in both `row` and `out`.
        unsafe { vst1q_f32(o.add(i), load(format, w, i)) };
    }
}

/// A BF16 row's whole pair-order blocks (`out.len()` values, a multiple of
/// [`PAIR_BLOCK`]) widened exactly into `out` in pair order.
pub(super) fn float_widen_paired(cpu: Neon, row: &[u8], out: &mut [f32]) {
    let _ = cpu;
    assert!(
        out.len().is_multiple_of(PAIR_BLOCK) && row.len() >= 2 * out.len(),
        "whole pair-order blocks"
    );
    // SAFETY: `cpu` proves NEON; the row holds `out.len()` BF16 values.
    unsafe { float_widen_paired_neon(row, out) }
}

/// # Safety
/// `row` must hold `out.len()` BF16 values, a multiple of [`PAIR_BLOCK`].
#[target_feature(enable = "neon")]
unsafe fn float_widen_paired_neon(row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for b in (0..out.len()).step_by(PAIR_BLOCK) {
        for j in 0..LANES / 4 {
            // SAFETY: columns `b + 8 j .. b + 8 j + 8` are in the row, and lanes
            // `b + 4 j ..` and `b + 64 + 4 j ..` in `out`.
            unsafe {
                let (odd, even) = load_pairs(w.add(2 * (b + 8 * j)));
                vst1q_f32(o.add(b + 4 * j), odd);
                vst1q_f32(o.add(b + LANES + 4 * j), even);
            }
        }
    }
}

/// Weight row `w` (in `format`, `x.len()` values) against activation row `x`, in the
/// arithmetic of [`float`].
pub(super) fn float_dot<T: Activation>(cpu: Neon, format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
    let _ = cpu;
    assert!(
        w.len() >= x.len() * format.bytes(),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves NEON; the row holds `x.len()` values.
    let folded = unsafe { float_sums_neon(format, w.as_ptr(), x) };
    let whole = x.len() / LANES * LANES;
    let tail = (whole..x.len()).map(|i| (format.at(w, i), x[i].value()));
    float::finish(format, folded, tail)
}

/// Four widened weight rows against activation row `x`, in the arithmetic of [`float`].
pub(super) fn float_quad(cpu: Neon, format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let _ = cpu;
    assert!(
        w.iter().all(|w| w.len() >= x.len()),
        "weight row shorter than its input"
    );
    let whole = x.len() / LANES * LANES;
    w.map(|w| {
        // SAFETY: `cpu` proves NEON; the row holds `x.len()` f32 values.
        let folded = unsafe { float_sums_neon(FloatFormat::F32, w.as_ptr().cast(), x) };
        let tail = w[whole..x.len()]
            .iter()
            .copied()
            .zip(x[whole..].iter().copied());
        float::finish(format, folded, tail)
    })
}

/// The folded sum of the whole 64-value steps: partial sum `l` in lane `l % 4` of
/// accumulator `l / 4`.
///
/// # Safety
/// `w` must hold `x.len()` values of `format`.
#[target_feature(enable = "neon")]
unsafe fn float_sums_neon<T: Activation>(format: FloatFormat, w: *const u8, x: &[T]) -> f32 {
    let whole = x.len() / LANES * LANES;
    let mut acc = [vdupq_n_f32(0.0); LANES / 4];
    let xp: *const u8 = x.as_ptr().cast();
    let mut i = 0;
    if format == FloatFormat::BF16 {
        // Whole pair-order blocks: each lane's odd column, then its even one.
        while i + PAIR_BLOCK <= x.len() {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: columns `i .. i + 128` of both rows.
                unsafe {
                    let (odd, even) = load_pairs(w.add(2 * (i + 8 * j)));
                    *a = vfmaq_f32(*a, odd, load(T::FORMAT, xp, i + 4 * j));
                    *a = vfmaq_f32(*a, even, load(T::FORMAT, xp, i + LANES + 4 * j));
                }
            }
            i += PAIR_BLOCK;
        }
    }
    while i < whole {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `i + 4 j + 4 <= whole <= x.len()` values of both rows.
            unsafe {
                *a = vfmaq_f32(
                    *a,
                    load(format, w, i + 4 * j),
                    load(T::FORMAT, xp, i + 4 * j),
                )
            };
        }
        i += LANES;
    }
    let mut p = [0f32; LANES];
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: lanes `4 j .. 4 j + 4` of `p`; the store needs no alignment.
        unsafe { vst1q_f32(p.as_mut_ptr().add(4 * j), *a) };
    }
    float::fold64(&p)
}
