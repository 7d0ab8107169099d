//! ggml's 5-bit formats, Q5_0 (signed, against Q8_0 activations) and Q5_1 (unsigned with a
//! minimum, against Q8_1): each 32-value block holds its four high bits apart from the low
//! nibbles. The portable code is ggml's AVX2 dot products lane for lane — the same eight
//! integer lanes of four products, one fused multiply-add per block into each lane, the
//! same reduction — and `avx2` runs them with the instructions themselves.

use super::portable::{block_lanes, hsum8};
use super::{f16_at, QuantizedRow, BLOCK};

/// Bytes of a Q5_0 block: scale, high bits, nibbles.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of a Q5_1 block: scale, minimum, high bits, nibbles.
pub const Q5_1_BYTES: usize = 24;

/// The 32 five-bit values of a block (nibbles at `qs`, high bits `qh`), minus `offset`.
pub(super) fn values(qs: &[u8], qh: [u8; 4], offset: i8) -> [i8; BLOCK] {
    let bits = u32::from_le_bytes(qh);
    std::array::from_fn(|j| {
        let nibble = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        let high = (((bits >> j) & 1) << 4) as u8;
        (nibble | high) as i8 - offset
    })
}

/// The four bytes of high bits at `at` of block `b`.
pub(super) fn high_bits(b: &[u8], at: usize) -> [u8; 4] {
    [b[at], b[at + 1], b[at + 2], b[at + 3]]
}

/// `ggml_vec_dot_q5_0_q8_0`.
pub(crate) fn dot_q5_0(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(Q5_0_BYTES).enumerate() {
        let q = values(&b[6..22], high_bits(b, 2), 16);
        let lanes = block_lanes(&q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        let d = f16_at(b, 0) * a.d[i];
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(l, *acc);
        }
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q5_1_q8_1`.
pub(crate) fn dot_q5_1(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, b) in w.chunks_exact(Q5_1_BYTES).enumerate() {
        summs = f16_at(b, 2).mul_add(a.s[i], summs);
        let q = values(&b[8..24], high_bits(b, 4), 0);
        let lanes = block_lanes(&q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        let d = f16_at(b, 0) * a.d[i];
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = l.mul_add(d, *acc);
        }
    }
    hsum8(acc) + summs
}

/// A Q5_0 row decoded as ggml's `dequantize_row_q5_0`: `(q - 16) · d`.
pub(crate) fn dequantize_q5_0(row: &[u8], out: &mut [f32]) {
    for (b, y) in row
        .chunks_exact(Q5_0_BYTES)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let d = f16_at(b, 0);
        for (y, q) in y.iter_mut().zip(values(&b[6..22], high_bits(b, 2), 16)) {
            *y = f32::from(q) * d;
        }
    }
}

/// A Q5_1 row decoded as ggml's `dequantize_row_q5_1`: `q · d + m`, the product rounded
/// first.
pub(crate) fn dequantize_q5_1(row: &[u8], out: &mut [f32]) {
    for (b, y) in row
        .chunks_exact(Q5_1_BYTES)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (y, q) in y.iter_mut().zip(values(&b[8..24], high_bits(b, 4), 0)) {
            *y = f32::from(q) * d + m;
        }
    }
}
