//! The K-quant products on arm64 with NEON, bit for bit the portable code's: a weight
//! super-block is unpacked to 256 signed bytes and one (low, high) pair of scales per 32,
//! each 32-byte chunk meets the activation bytes in widening multiplies summed four by four
//! (the same eight integer lanes `maddubs` + `madd` give: bytes `4l..4l + 4` of every chunk
//! in lane `l`, the low scale on lanes 0..4, the high on 4..8 — exact sums, so the order of
//! their terms does not matter), and the float step is the portable one, lane for lane.
//! Q3_K's values are met as `low - high`, the difference of ggml's two products. The
//! `neon-dotprod` tier sums each four products with `sdot`.
//!
//! The tile unpacks each super-block of four weight rows once for a group of activation
//! rows, where the pairwise product unpacks it again for each.

use std::arch::aarch64::*;

use super::super::neon::{dot4, lanes8};
use super::super::portable::hsum8;
use super::{
    f16_at, format, scales_mins_k4, scales_q3k, KFormat, Q8KRow, Q2, Q3, Q4, Q5, Q6, QK_K,
};
use crate::cpu::{ByteDot, Features};
use crate::quant::PairTile;

/// One weight row's super-block, unpacked.
#[derive(Clone, Copy)]
struct Block {
    /// Chunk `c`: its 32 values as signed bytes, meeting activation bytes `32c..32c + 32`.
    q: [[int8x16_t; 2]; 8],
    /// Chunk `c`: the scale of its first sixteen values, then of its last sixteen.
    s: [[i32; 2]; 8],
    /// Q4_K and Q5_K: the eight minimums; Q2_K: the sixteen minimums; Q6_K: the sixteen
    /// scales.
    extra: [i16; 16],
    d: f32,
    dmin: f32,
}

/// One pair's accumulators, as the portable dot product keeps them.
#[derive(Clone, Copy)]
struct Acc {
    acc: [float32x4_t; 2],
    /// Q4_K: the four minimum lanes.
    m: [f32; 4],
    /// Q5_K: the minimums' running sum.
    s: f32,
}

/// Nothing accumulated yet.
#[inline]
#[target_feature(enable = "neon")]
fn zero() -> Acc {
    Acc {
        acc: [vdupq_n_f32(0.0); 2],
        m: [0.0; 4],
        s: 0.0,
    }
}

/// Thirty-two bytes from `b` at `at`.
#[inline]
#[target_feature(enable = "neon")]
fn load32(b: &[u8], at: usize) -> [uint8x16_t; 2] {
    let b = &b[at..at + 32];
    // SAFETY: `b` is exactly 32 bytes; the loads need no alignment.
    unsafe { [vld1q_u8(b.as_ptr()), vld1q_u8(b.as_ptr().add(16))] }
}

/// `f` on both halves of 32 bytes.
#[inline(always)]
fn map2(v: [uint8x16_t; 2], f: impl Fn(uint8x16_t) -> uint8x16_t) -> [uint8x16_t; 2] {
    [f(v[0]), f(v[1])]
}

/// The bytes as signed values (every K-quant value fits).
#[inline]
#[target_feature(enable = "neon")]
fn signed(v: [uint8x16_t; 2]) -> [int8x16_t; 2] {
    [vreinterpretq_s8_u8(v[0]), vreinterpretq_s8_u8(v[1])]
}

/// Each byte shifted right by `n` (0..8) and masked with `mask`.
#[inline]
#[target_feature(enable = "neon")]
fn bits(v: uint8x16_t, n: usize, mask: u8) -> uint8x16_t {
    vandq_u8(vshlq_u8(v, vdupq_n_s8(-(n as i8))), vdupq_n_u8(mask))
}

/// Unpacks super-block `b` of format `F`.
#[inline]
#[target_feature(enable = "neon")]
fn unpack<const F: u8>(b: &[u8]) -> Block {
    let mut u = Block {
        q: [[vdupq_n_s8(0); 2]; 8],
        s: [[0; 2]; 8],
        extra: [0; 16],
        d: 0.0,
        dmin: 0.0,
    };
    match F {
        Q4 | Q5 => {
            let (scales, mins) = scales_mins_k4(&b[4..16]);
            for (e, m) in u.extra.iter_mut().zip(mins) {
                *e = i16::from(m);
            }
            let (qh, qs) = if F == Q5 { (16, 48) } else { (0, 16) };
            let hb = (F == Q5).then(|| load32(b, qh));
            for j in 0..QK_K / 64 {
                let v = load32(b, qs + 32 * j);
                let mut lo = map2(v, |v| vandq_u8(v, vdupq_n_u8(15)));
                let mut hi = map2(v, |v| vshrq_n_u8::<4>(v));
                if let Some(h) = hb {
                    let high = |bit: usize| map2(h, |h| vshlq_n_u8::<4>(bits(h, bit, 1)));
                    let (h0, h1) = (high(2 * j), high(2 * j + 1));
                    lo = [vaddq_u8(lo[0], h0[0]), vaddq_u8(lo[1], h0[1])];
                    hi = [vaddq_u8(hi[0], h1[0]), vaddq_u8(hi[1], h1[1])];
                }
                u.q[2 * j] = signed(lo);
                u.q[2 * j + 1] = signed(hi);
                let (s0, s1) = (i32::from(scales[2 * j]), i32::from(scales[2 * j + 1]));
                u.s[2 * j] = [s0, s0];
                u.s[2 * j + 1] = [s1, s1];
            }
            u.d = f16_at(b, 0);
            u.dmin = f16_at(b, 2);
        }
        Q6 => {
            let sc = &b[192..208];
            for (e, &s) in u.extra.iter_mut().zip(sc) {
                *e = i16::from(s as i8);
            }
            for j in 0..QK_K / 128 {
                let (b1, b2, h) = (
                    load32(b, 64 * j),
                    load32(b, 64 * j + 32),
                    load32(b, 128 + 32 * j),
                );
                let or = |a: [uint8x16_t; 2], c: [uint8x16_t; 2]| {
                    signed([vorrq_u8(a[0], c[0]), vorrq_u8(a[1], c[1])])
                };
                let low4 = |v: [uint8x16_t; 2]| map2(v, |v| vandq_u8(v, vdupq_n_u8(15)));
                let high4 = |v: [uint8x16_t; 2]| map2(v, |v| vshrq_n_u8::<4>(v));
                let q = [
                    or(
                        low4(b1),
                        map2(h, |h| vshlq_n_u8::<4>(vandq_u8(h, vdupq_n_u8(3)))),
                    ),
                    or(
                        low4(b2),
                        map2(h, |h| vshlq_n_u8::<2>(vandq_u8(h, vdupq_n_u8(12)))),
                    ),
                    or(high4(b1), map2(h, |h| vandq_u8(h, vdupq_n_u8(48)))),
                    or(
                        high4(b2),
                        map2(h, |h| vshrq_n_u8::<2>(vandq_u8(h, vdupq_n_u8(0xC0)))),
                    ),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let c = 4 * j + k;
                    u.q[c] = q;
                    u.s[c] = [i32::from(u.extra[2 * c]), i32::from(u.extra[2 * c + 1])];
                }
            }
            u.d = f16_at(b, 208);
        }
        Q2 => {
            let sc = &b[0..16];
            for (e, &s) in u.extra.iter_mut().zip(sc) {
                *e = i16::from(s >> 4);
            }
            for j in 0..QK_K / 128 {
                let v = load32(b, 16 + 32 * j);
                for k in 0..4 {
                    let c = 4 * j + k;
                    u.q[c] = signed(map2(v, |v| bits(v, 2 * k, 3)));
                    u.s[c] = [i32::from(sc[2 * c] & 15), i32::from(sc[2 * c + 1] & 15)];
                }
            }
            u.d = f16_at(b, 80);
            u.dmin = f16_at(b, 82);
        }
        _ => {
            let scales = scales_q3k(&b[96..108]);
            let hmask = load32(b, 0);
            for j in 0..QK_K / 128 {
                let v = load32(b, 32 + 32 * j);
                for k in 0..4 {
                    let c = 4 * j + k;
                    let low = signed(map2(v, |v| bits(v, 2 * k, 3)));
                    // 4 where the mask bit is clear: ggml's second product's bytes.
                    let high = signed(map2(hmask, |h| vshlq_n_u8::<2>(bits(vmvnq_u8(h), c, 1))));
                    u.q[c] = [vsubq_s8(low[0], high[0]), vsubq_s8(low[1], high[1])];
                    u.s[c] = [i32::from(scales[2 * c]), i32::from(scales[2 * c + 1])];
                }
            }
            u.d = f16_at(b, 108);
        }
    }
    u
}

/// The pair's eight integer lanes for super-block `i` of activation row `a`, compiled for
/// its tier: with `sdot` in line where `DOT` (one call per super-block rather than one per
/// sixteen products).
#[inline]
fn sumi<const DOT: bool>(u: &Block, a: &Q8KRow, i: usize) -> [int32x4_t; 2] {
    #[target_feature(enable = "neon")]
    fn neon(u: &Block, a: &Q8KRow, i: usize) -> [int32x4_t; 2] {
        sumi_body::<false>(u, a, i)
    }
    #[target_feature(enable = "neon,dotprod")]
    fn dotprod(u: &Block, a: &Q8KRow, i: usize) -> [int32x4_t; 2] {
        sumi_body::<true>(u, a, i)
    }
    // SAFETY: `DOT` is set only in the kernels the `NeonDotprod` token hands out; every
    // arm64 CPU has NEON.
    unsafe {
        if DOT {
            dotprod(u, a, i)
        } else {
            neon(u, a, i)
        }
    }
}

/// [`sumi`]'s arithmetic.
#[inline]
#[target_feature(enable = "neon")]
fn sumi_body<const DOT: bool>(u: &Block, a: &Q8KRow, i: usize) -> [int32x4_t; 2] {
    let y = &a.qs[i * QK_K..(i + 1) * QK_K];
    let mut sumi = [vdupq_n_s32(0); 2];
    for (c, (q, s)) in u.q.iter().zip(&u.s).enumerate() {
        // SAFETY: `y` is exactly 256 bytes; bytes `32c..32c + 32` are in it.
        let (y0, y1) = unsafe {
            (
                vld1q_s8(y.as_ptr().add(32 * c)),
                vld1q_s8(y.as_ptr().add(32 * c + 16)),
            )
        };
        sumi[0] = vmlaq_n_s32(sumi[0], dot4::<DOT>(q[0], y0), s[0]);
        sumi[1] = vmlaq_n_s32(sumi[1], dot4::<DOT>(q[1], y1), s[1]);
    }
    sumi
}

/// `_mm256_madd_epi16` of sixteen i16 pairs: lane `u` the sum of products `2u` and `2u + 1`.
#[inline]
#[target_feature(enable = "neon")]
fn madd16(a: &[i16; 16], b: &[i16]) -> [int32x4_t; 2] {
    assert!(b.len() >= 16);
    // SAFETY: both hold sixteen i16 (asserted for `b`); the loads need no alignment.
    let (a, b) = unsafe {
        (
            [vld1q_s16(a.as_ptr()), vld1q_s16(a.as_ptr().add(8))],
            [vld1q_s16(b.as_ptr()), vld1q_s16(b.as_ptr().add(8))],
        )
    };
    let half = |a: int16x8_t, b: int16x8_t| {
        vpaddq_s32(
            vmull_s16(vget_low_s16(a), vget_low_s16(b)),
            vmull_high_s16(a, b),
        )
    };
    [half(a[0], b[0]), half(a[1], b[1])]
}

/// `acc = fma(d, float(sumi), acc)`, lane by lane.
#[inline]
#[target_feature(enable = "neon")]
fn accumulate(acc: &mut [float32x4_t; 2], d: f32, sumi: [int32x4_t; 2]) {
    let d = vdupq_n_f32(d);
    for (acc, s) in acc.iter_mut().zip(sumi) {
        *acc = vfmaq_f32(*acc, d, vcvtq_f32_s32(s));
    }
}

/// The pair's float step for super-block `i`, as the portable dot product takes it.
#[inline]
#[target_feature(enable = "neon")]
fn step<const F: u8>(u: &Block, a: &Q8KRow, i: usize, mut sumi: [int32x4_t; 2], p: &mut Acc) {
    let (d, dmin) = (a.d[i] * u.d, -a.d[i] * u.dmin);
    match F {
        Q4 => {
            let q8s = &a.sums32[i * 8..(i + 1) * 8];
            for (m, acc_m) in p.m.iter_mut().enumerate() {
                let prod = i32::from(u.extra[2 * m]) * i32::from(q8s[2 * m])
                    + i32::from(u.extra[2 * m + 1]) * i32::from(q8s[2 * m + 1]);
                *acc_m = dmin.mul_add(prod as f32, *acc_m);
            }
        }
        Q5 => {
            let q8s = &a.sums32[i * 8..(i + 1) * 8];
            let hsum: i32 = (0..8)
                .map(|t| i32::from(u.extra[t]) * i32::from(q8s[t]))
                .sum();
            p.s = dmin.mul_add(hsum as f32, p.s);
        }
        Q6 => {
            let sub = madd16(&u.extra, &a.bsums[i * 16..(i + 1) * 16]);
            for (s, sub) in sumi.iter_mut().zip(sub) {
                *s = vsubq_s32(*s, vshlq_n_s32::<5>(sub));
            }
        }
        Q2 => {
            let mins = madd16(&u.extra, &a.bsums[i * 16..(i + 1) * 16]);
            accumulate(&mut p.acc, dmin, mins);
        }
        _ => {}
    }
    accumulate(&mut p.acc, d, sumi);
}

/// The pair's result, reduced as the portable dot product reduces it.
#[inline]
#[target_feature(enable = "neon")]
fn finish<const F: u8>(p: &Acc) -> f32 {
    let sum = hsum8(lanes8(p.acc));
    match F {
        Q4 => sum + ((p.m[0] + p.m[2]) + (p.m[1] + p.m[3])),
        Q5 => sum + p.s,
        _ => sum,
    }
}

#[inline]
#[target_feature(enable = "neon")]
fn dot_body<const F: u8, const DOT: bool>(w: &[u8], a: &Q8KRow) -> f32 {
    let mut p = zero();
    for (i, b) in w.chunks_exact(format(F).block_bytes()).enumerate() {
        let u = unpack::<F>(b);
        step::<F>(&u, a, i, sumi::<DOT>(&u, a, i), &mut p);
    }
    finish::<F>(&p)
}

#[target_feature(enable = "neon")]
fn dot_neon<const F: u8>(w: &[u8], a: &Q8KRow) -> f32 {
    dot_body::<F, false>(w, a)
}

#[target_feature(enable = "neon,dotprod")]
fn dot_dotprod<const F: u8>(w: &[u8], a: &Q8KRow) -> f32 {
    dot_body::<F, true>(w, a)
}

fn run_dot<const F: u8, const DOT: bool>(w: &[u8], a: &Q8KRow) -> f32 {
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

/// The dot product for `format` on the best NEON tier `features` has, if any.
pub(crate) fn best_dot(features: Features, format: KFormat) -> Option<fn(&[u8], &Q8KRow) -> f32> {
    match features.neon_dotprod() {
        Some(cpu) => Some(dot(cpu, format)),
        None => features.neon().map(|cpu| dot(cpu, format)),
    }
}

/// The dot product for `format` on tier `T`.
pub(crate) fn dot<T: ByteDot>(cpu: T, format: KFormat) -> fn(&[u8], &Q8KRow) -> f32 {
    let _ = cpu;
    if T::DOT {
        dots::<true>(format)
    } else {
        dots::<false>(format)
    }
}

fn dots<const DOT: bool>(format: KFormat) -> fn(&[u8], &Q8KRow) -> f32 {
    match format {
        KFormat::Q2K => run_dot::<Q2, DOT>,
        KFormat::Q3K => run_dot::<Q3, DOT>,
        KFormat::Q4K => run_dot::<Q4, DOT>,
        KFormat::Q5K => run_dot::<Q5, DOT>,
        KFormat::Q6K => run_dot::<Q6, DOT>,
    }
}

/// Activation rows whose accumulators a tile holds at once; a weight super-block is
/// unpacked once per group.
const GROUP: usize = 16;

/// The tile for `format` on the best NEON tier `features` has, if any.
pub(crate) fn best_tile(features: Features, format: KFormat) -> Option<PairTile<Q8KRow>> {
    match features.neon_dotprod() {
        Some(cpu) => Some(tile(cpu, format)),
        None => features.neon().map(|cpu| tile(cpu, format)),
    }
}

/// The tile for `format` on tier `T`: four weight rows against every activation row, each
/// pair's result its dot product's bits.
pub(crate) fn tile<T: ByteDot>(cpu: T, format: KFormat) -> PairTile<Q8KRow> {
    let _ = cpu;
    if T::DOT {
        tiles::<true>(format)
    } else {
        tiles::<false>(format)
    }
}

fn tiles<const DOT: bool>(format: KFormat) -> PairTile<Q8KRow> {
    match format {
        KFormat::Q2K => run_tile::<Q2, DOT>,
        KFormat::Q3K => run_tile::<Q3, DOT>,
        KFormat::Q4K => run_tile::<Q4, DOT>,
        KFormat::Q5K => run_tile::<Q5, DOT>,
        KFormat::Q6K => run_tile::<Q6, DOT>,
    }
}

fn run_tile<const F: u8, const DOT: bool>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
    #[target_feature(enable = "neon")]
    fn neon<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
        tile_body::<F, false>(rows, acts, out)
    }
    #[target_feature(enable = "neon,dotprod")]
    fn dotprod<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
        tile_body::<F, true>(rows, acts, out)
    }
    // SAFETY: handed out only by `tile`, with a NEON token, and with `DOT` only for the
    // `NeonDotprod` token.
    unsafe {
        if DOT {
            dotprod::<F>(rows, acts, out)
        } else {
            neon::<F>(rows, acts, out)
        }
    }
}

#[inline]
#[target_feature(enable = "neon")]
fn tile_body<const F: u8, const DOT: bool>(
    rows: [&[u8]; 4],
    acts: &[Q8KRow],
    out: &mut [[f32; 4]],
) {
    let bytes = format(F).block_bytes();
    let nb = rows[0].len() / bytes;
    for (group, out) in acts.chunks(GROUP).zip(out.chunks_mut(GROUP)) {
        let mut accs = [[zero(); 4]; GROUP];
        for i in 0..nb {
            let u = rows.map(|w| unpack::<F>(&w[i * bytes..(i + 1) * bytes]));
            for (a, accs) in group.iter().zip(accs.iter_mut()) {
                for (u, p) in u.iter().zip(accs.iter_mut()) {
                    step::<F>(u, a, i, sumi::<DOT>(u, a, i), p);
                }
            }
        }
        for (o, accs) in out.iter_mut().zip(&accs) {
            for (o, p) in o.iter_mut().zip(accs) {
                *o = finish::<F>(p);
            }
        }
    }
}
