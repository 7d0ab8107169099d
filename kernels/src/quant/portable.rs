//! The portable arithmetic of the quantized products: ggml's x86 code written one value
//! at a time. Every vector tier must equal it bit for bit, and the tests hold them to it.

use super::{f16_at, BlockFormat, QuantizedRow, Unpacked, BLOCK};

const Q4_0: usize = BlockFormat::Q4_0.block_bytes();
const Q4_1: usize = BlockFormat::Q4_1.block_bytes();
const Q8_0: usize = BlockFormat::Q8_0.block_bytes();

/// One block of [`quantize_row`]: writes the 32 bytes and returns the scale (before f16
/// rounding) and the sum of the bytes.
pub(crate) fn quantize_block(block: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (dst, &v) in q.iter_mut().zip(block) {
        let r = (v * id).round_ties_even() as i32;
        sum += r;
        *dst = r as i8;
    }
    (d, sum)
}

/// Integer dot product of one block, summed in eight lanes of four values (`vpdpbusd`).
#[inline(always)]
pub(crate) fn block_lanes(w: &[i8; BLOCK], a: &[i8]) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for (l, lane) in lanes.iter_mut().enumerate() {
        let mut s = 0i32;
        for j in 0..4 {
            s += i32::from(w[l * 4 + j]) * i32::from(a[l * 4 + j]);
        }
        *lane = s as f32;
    }
    lanes
}

/// The 32 values of a 4-bit block: low nibbles are values 0..16, high nibbles 16..32.
#[inline(always)]
pub(crate) fn nibbles(qs: &[u8], offset: i8) -> [i8; BLOCK] {
    let mut q = [0i8; BLOCK];
    for j in 0..BLOCK / 2 {
        q[j] = (qs[j] & 0x0F) as i8 - offset;
        q[j + BLOCK / 2] = (qs[j] >> 4) as i8 - offset;
    }
    q
}

/// ggml's `hsum_float_8`: halves added, then pairs, then the last two.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let r = [r[0] + r[2], r[1] + r[3]];
    r[0] + r[1]
}

/// Eight lanes accumulated with fused multiply-adds, block after block.
#[inline(always)]
pub(crate) fn accumulate(acc: &mut [f32; 8], d: f32, lanes: [f32; 8]) {
    for (acc, l) in acc.iter_mut().zip(lanes) {
        *acc = d.mul_add(l, *acc);
    }
}

/// `ggml_vec_dot_q4_1_q8_1`: eight fused lanes plus a fused running sum of `m * s`.
pub(crate) fn dot_q4_1(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, b) in w.chunks_exact(Q4_1).enumerate() {
        summs = f16_at(b, 2).mul_add(a.s[i], summs);
        let lanes = block_lanes(&nibbles(&b[4..], 0), &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc) + summs
}

/// `ggml_vec_dot_q4_0_q8_0`.
pub(crate) fn dot_q4_0(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(Q4_0).enumerate() {
        let lanes = block_lanes(&nibbles(&b[2..], 8), &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q8_0_q8_0`.
pub(crate) fn dot_q8_0(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(Q8_0).enumerate() {
        let mut q = [0i8; BLOCK];
        for (dst, &src) in q.iter_mut().zip(&b[2..]) {
            *dst = src as i8;
        }
        let lanes = block_lanes(&q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc)
}

/// [`super::Tile`] one value at a time.
pub(crate) fn tile_portable(u: &Unpacked, acts: &[QuantizedRow], out: &mut [[f32; 4]]) {
    for (a, out) in acts.iter().zip(out) {
        *out = tile_portable_row(u, a);
    }
}

fn tile_portable_row(u: &Unpacked, a: &QuantizedRow) -> [f32; 4] {
    let mut acc = [[0f32; 8]; 4];
    let mut summs = [0f32; 4];
    for i in 0..a.d.len() {
        for r in 0..4 {
            let k = i * 4 + r;
            if !u.signed {
                summs[r] = u.m[k].mul_add(a.s[i], summs[r]);
            }
            let lanes = block_lanes(&u.q[k], &a.q[i * BLOCK..(i + 1) * BLOCK]);
            accumulate(&mut acc[r], u.d[k] * a.d[i], lanes);
        }
    }
    [0, 1, 2, 3].map(|r| hsum8(acc[r]) + if u.signed { 0.0 } else { summs[r] })
}
