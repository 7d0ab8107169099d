//! ggml's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256-value super-blocks of sub-blocks
//! with their own 4- to 8-bit scales, multiplied against activations quantized to Q8_K.
//!
//! The portable code here is ggml's AVX2 dot products written one 256-bit register at a
//! time, lane for lane: the same integer lanes (the byte pairs of `maddubs`, the i16 pairs
//! of `madd`), the same fused multiply-adds of each lane into eight f32 accumulators, and
//! the same final reduction. ggml has no other x86 version of these (its AVX-512 builds use
//! the AVX2 code too), so this is llama.cpp's arithmetic on every x86 CPU; [`avx2`] is the
//! same with the instructions themselves, [`neon`] the same lanes on arm64. The tests hold
//! them to ggml's own outputs (`tests/fixtures/ggml-reference.json`).

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod avx2;
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
pub(super) mod neon;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod q8k;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod rows2;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod tile;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod vnni;

use half::f16;

use super::portable::hsum8;

/// Values per super-block.
pub const QK_K: usize = 256;

// The formats, as the vector kernels' const parameter.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const Q2: u8 = 0;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const Q3: u8 = 1;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const Q4: u8 = 2;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const Q5: u8 = 3;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const Q6: u8 = 4;

/// Whether format `f`'s values times their scales fit a byte (Q2_K's 0–3 times 0–15, Q3_K's
/// -4–3 times -32–31 once negated), so the `vpdpbusd` tiles take its values already scaled
/// and need no scale vectors ([`vnni`]'s AVX-512 tile, [`tile`]'s AVX-VNNI one).
#[cfg(target_arch = "x86_64")]
const fn scales_in_values(f: u8) -> bool {
    f == Q2 || f == Q3
}

/// The format a vector kernel's const parameter names.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const fn format(f: u8) -> KFormat {
    match f {
        Q2 => KFormat::Q2K,
        Q3 => KFormat::Q3K,
        Q4 => KFormat::Q4K,
        Q5 => KFormat::Q5K,
        _ => KFormat::Q6K,
    }
}

/// The K-quant formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KFormat {
    /// 2-bit values, 4-bit scales and minimums per 16 values.
    Q2K,
    /// 3-bit values, 6-bit scales per 16 values.
    Q3K,
    /// 4-bit values, 6-bit scales and minimums per 32 values.
    Q4K,
    /// 5-bit values, 6-bit scales and minimums per 32 values.
    Q5K,
    /// 6-bit values, 8-bit scales per 16 values.
    Q6K,
}

impl KFormat {
    /// Bytes of one super-block in GGUF.
    pub const fn block_bytes(self) -> usize {
        match self {
            KFormat::Q2K => 84,
            KFormat::Q3K => 110,
            KFormat::Q4K => 144,
            KFormat::Q5K => 176,
            KFormat::Q6K => 210,
        }
    }
}

/// An activation row quantized as ggml's `block_q8_K`: per super-block an f32 scale, 256
/// signed bytes and the sums of each 16 of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Q8KRow {
    pub(crate) d: Vec<f32>,
    pub(crate) qs: LineBytes,
    pub(crate) bsums: Vec<i16>,
    /// The sums of each 32 bytes (adjacent `bsums` added, wrapping, as ggml's `hadd`), eight
    /// per super-block: what Q4_K and Q5_K multiply their minimums by, worked out once for
    /// every weight row.
    pub(crate) sums32: Vec<i16>,
    /// `qs` in [`pair_order`], for the AVX-512 VNNI tile ([`vnni`]); empty unless the row was
    /// quantized by [`quantize_row_q8k_paired`].
    pub(crate) paired: LineBytes,
    /// `qs` with each 32-byte chunk twice in a row ([`doubled`]), for the AVX-512 two-row
    /// dot products ([`rows2`]); empty unless the row was quantized by
    /// [`quantize_row_q8k_doubled`].
    pub(crate) doubled: LineBytes,
}

/// `qs` with each 32-byte chunk twice in a row. The AVX-512 two-row dot products meet each
/// activation chunk with two weight rows' chunks, one in each half of a 512-bit register:
/// from this layout that is a 64-byte load, where from `qs` it was a 32-byte load
/// broadcast to both halves. One thread, 1 MiB of 2048-value rows from L2 (`matvec --
/// <format> 1024`), an AMD EPYC (Zen 5), alternating: Q2_K 3.20–3.27 -> 2.90–2.94 ns a
/// super-block, Q4_K 3.61–3.72 -> 3.44–3.51, Q3_K 4.49 -> 4.32–4.34, Q5_K 4.35–4.41 ->
/// 4.13–4.25, Q6_K 3.90–3.97 -> 3.65–3.76. Random 1.1B decode on one thread, alternating:
/// Q2_K 60.4–61.4 -> 63.3–64.9 tok/s, Q3_K_M 51.6–52.8 -> 53.0–53.6, Q4_K_M even
/// (54.1–55.6), its one thread held by memory more than by the loop.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn doubled(qs: &[i8]) -> LineBytes {
    let mut out = LineBytes::zeroed(2 * qs.len());
    for (to, chunk) in out.chunks_exact_mut(64).zip(qs.chunks_exact(32)) {
        to[..32].copy_from_slice(chunk);
        to[32..].copy_from_slice(chunk);
    }
    out
}

/// [`quantize_row_q8k`] with the bytes also [`doubled`], for the AVX-512 two-row dot
/// products.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn quantize_row_q8k_doubled(x: &[f32]) -> Q8KRow {
    let mut row = quantize_row_q8k(x);
    row.doubled = doubled(&row.qs);
    row
}

/// `qs` with the 4-byte groups of each two 32-value chunks alternating: in every 64 bytes,
/// group `L` (of sixteen) is group `L / 2` of the first chunk (`L` even) or of the second
/// (`L` odd). The AVX-512 VNNI tile lays its weight rows out alike, so one `vpdpbusd` leaves
/// each chunk's sums of four products beside the other's.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn pair_order(qs: &[i8]) -> LineBytes {
    let mut out = LineBytes::zeroed(qs.len());
    for (to, two) in out.chunks_exact_mut(64).zip(qs.chunks_exact(64)) {
        for (l, to) in to.chunks_exact_mut(4).enumerate() {
            let at = 32 * (l % 2) + 4 * (l / 2);
            to.copy_from_slice(&two[at..at + 4]);
        }
    }
    out
}

/// A K-quant tile (four weight rows against every activation row) with the quantizer its
/// activation rows must come from.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
#[derive(Clone, Copy)]
pub(crate) struct KTile {
    pub(crate) run: super::PairTile<Q8KRow>,
    /// [`quantize_row_q8k`], or [`quantize_row_q8k_paired`] for a tile that reads the bytes
    /// in pair order.
    pub(crate) quantize: fn(&[f32]) -> Q8KRow,
}

/// [`quantize_row_q8k`] with the bytes also in [`pair_order`], for the AVX-512 VNNI tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn quantize_row_q8k_paired(x: &[f32]) -> Q8KRow {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = crate::cpu::detect().avx512() {
        return q8k::quantize(cpu, x, true);
    }
    let mut row = quantize_row_q8k_portable(x);
    row.paired = pair_order(&row.qs);
    row
}

/// Bytes that start on a 64-byte cache line, so a vector load of 32 or 64 of them at a
/// multiple of its size never straddles two lines. The tiles load every activation byte
/// once per weight row, and a load that straddles two lines costs two: on an AMD EPYC
/// (Zen 5), a loop of 64-byte loads and VNNI products ran 157–162 G multiply-adds/s with
/// its rows 16 bytes past a line, 211 on the line.
#[derive(Debug)]
pub(crate) struct LineBytes {
    /// The bytes and a cache line more ([`super::line_start`]), or nothing for no bytes.
    store: Vec<i8>,
    at: usize,
    len: usize,
}

impl LineBytes {
    /// `len` zero bytes (none allocated for none).
    fn zeroed(len: usize) -> Self {
        let mut store = Vec::new();
        let at = match len {
            0 => 0,
            _ => super::line_start(&mut store, len),
        };
        LineBytes { store, at, len }
    }
}

impl std::ops::Deref for LineBytes {
    type Target = [i8];

    fn deref(&self) -> &[i8] {
        &self.store[self.at..self.at + self.len]
    }
}

impl std::ops::DerefMut for LineBytes {
    fn deref_mut(&mut self) -> &mut [i8] {
        &mut self.store[self.at..self.at + self.len]
    }
}

impl Clone for LineBytes {
    /// A copy on a line of its own.
    fn clone(&self) -> Self {
        let mut copy = LineBytes::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl PartialEq for LineBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

/// ggml's `nearest_int`: round half to even through the float's mantissa.
fn nearest_int(f: f32) -> i32 {
    let val = f + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

impl Q8KRow {
    /// `nb` super-blocks of zeros with no scales yet, with room for the pair order where
    /// `paired` says so.
    fn empty(nb: usize, paired: bool) -> Self {
        Q8KRow {
            d: Vec::with_capacity(nb),
            qs: LineBytes::zeroed(nb * QK_K),
            bsums: vec![0; nb * QK_K / 16],
            sums32: Vec::new(),
            paired: LineBytes::zeroed(if paired { nb * QK_K } else { 0 }),
            doubled: LineBytes::zeroed(0),
        }
    }
}

/// The sums of each 32 bytes from the sums of each 16 (see [`Q8KRow::sums32`]).
fn sums32(bsums: &[i16]) -> Vec<i16> {
    bsums
        .chunks_exact(2)
        .map(|p| p[0].wrapping_add(p[1]))
        .collect()
}

/// Quantizes `x` (a multiple of 256 values) as ggml's `quantize_row_q8_K_ref` does: with
/// AVX-512 where the CPU has it, else [`quantize_row_q8k_portable`].
pub fn quantize_row_q8k(x: &[f32]) -> Q8KRow {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = crate::cpu::detect().avx512() {
        return q8k::quantize(cpu, x, false);
    }
    quantize_row_q8k_portable(x)
}

/// [`quantize_row_q8k`] one value at a time, as ggml's reference loop goes: the blocks every
/// vector quantizer must equal.
pub(crate) fn quantize_row_q8k_portable(x: &[f32]) -> Q8KRow {
    let mut row = Q8KRow::empty(x.len() / QK_K, false);
    for (i, block) in x.chunks_exact(QK_K).enumerate() {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in block {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            row.d.push(0.0);
            continue;
        }
        let iscale = -127.0 / max;
        let qs = &mut row.qs[i * QK_K..(i + 1) * QK_K];
        for (q, &v) in qs.iter_mut().zip(block) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (j, sum) in row.bsums[i * 16..(i + 1) * 16].iter_mut().enumerate() {
            *sum = qs[j * 16..(j + 1) * 16]
                .iter()
                .map(|&q| i32::from(q))
                .sum::<i32>() as i16;
        }
        row.d.push(1.0 / iscale);
    }
    row.sums32 = sums32(&row.bsums);
    row
}

/// The little-endian f16 at byte `at` of `b`, widened.
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `_mm256_maddubs_epi16`: unsigned bytes times signed bytes, adjacent pairs summed with
/// signed saturation to sixteen i16.
fn maddubs(a: &[u8; 32], b: &[i8]) -> [i16; 16] {
    std::array::from_fn(|t| {
        let p = i32::from(a[2 * t]) * i32::from(b[2 * t])
            + i32::from(a[2 * t + 1]) * i32::from(b[2 * t + 1]);
        p.clamp(i32::from(i16::MIN), i32::from(i16::MAX)) as i16
    })
}

/// `_mm256_madd_epi16`: i16 pairs multiplied and summed to eight i32.
fn madd(a: &[i16; 16], b: &[i16; 16]) -> [i32; 8] {
    std::array::from_fn(|u| {
        (i32::from(a[2 * u]) * i32::from(b[2 * u]))
            .wrapping_add(i32::from(a[2 * u + 1]) * i32::from(b[2 * u + 1]))
    })
}

/// `madd` by one i16 broadcast to lanes 0..8 and another to lanes 8..16 (a 128-bit scale
/// shuffle): i32 lanes 0..4 take `lo`, 4..8 take `hi`.
fn madd_split(lo: i16, hi: i16, p: &[i16; 16]) -> [i32; 8] {
    let s: [i16; 16] = std::array::from_fn(|t| if t < 8 { lo } else { hi });
    madd(&s, p)
}

/// Lane-wise wrapping i32 additions.
fn add(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
    std::array::from_fn(|l| a[l].wrapping_add(b[l]))
}

/// `acc[l] = fma(d, float(sumi[l]), acc[l])`.
fn accumulate(acc: &mut [f32; 8], d: f32, sumi: [i32; 8]) {
    for (a, s) in acc.iter_mut().zip(sumi) {
        *a = d.mul_add(s as f32, *a);
    }
}

/// `f(x)` for each of 32 bytes.
fn map32(x: &[u8], f: impl Fn(u8) -> u8) -> [u8; 32] {
    std::array::from_fn(|i| f(x[i]))
}

/// The eight 6-bit scales and eight 6-bit minimums of a Q4_K/Q5_K super-block's 12 scale
/// bytes, as ggml's AVX2 code unpacks them (`utmp`).
#[inline]
fn scales_mins_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (k1, k2, k3) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let mut u = [word(0), word(1), word(2), 0];
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    let uaux = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = uaux;
    u[0] &= k1;
    let bytes = le_bytes(u);
    (
        std::array::from_fn(|i| bytes[i]),
        std::array::from_fn(|i| bytes[8 + i]),
    )
}

/// `ggml_vec_dot_q4_K_q8_K`.
pub(crate) fn dot_q4k(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut acc_m = [0f32; 4];
    for (i, b) in w.chunks_exact(KFormat::Q4K.block_bytes()).enumerate() {
        let d = a.d[i] * f16_at(b, 0);
        let dmin = -a.d[i] * f16_at(b, 2);
        let (scales, mins) = scales_mins_k4(&b[4..16]);
        let q8s = &a.sums32[i * 8..(i + 1) * 8];
        for (m, acc_m) in acc_m.iter_mut().enumerate() {
            let prod = i32::from(mins[2 * m]) * i32::from(q8s[2 * m])
                + i32::from(mins[2 * m + 1]) * i32::from(q8s[2 * m + 1]);
            *acc_m = dmin.mul_add(prod as f32, *acc_m);
        }
        let (q4, q8) = (&b[16..144], &a.qs[i * QK_K..(i + 1) * QK_K]);
        let mut sumi = [0i32; 8];
        for j in 0..QK_K / 64 {
            let bits = &q4[32 * j..32 * (j + 1)];
            let (lo, hi) = (map32(bits, |v| v & 15), map32(bits, |v| v >> 4));
            let (sl, sh) = (i16::from(scales[2 * j]), i16::from(scales[2 * j + 1]));
            let pl = madd_split(sl, sl, &maddubs(&lo, &q8[64 * j..64 * j + 32]));
            let ph = madd_split(sh, sh, &maddubs(&hi, &q8[64 * j + 32..64 * j + 64]));
            sumi = add(sumi, add(pl, ph));
        }
        accumulate(&mut acc, d, sumi);
    }
    let m = [acc_m[0] + acc_m[2], acc_m[1] + acc_m[3]];
    hsum8(acc) + (m[0] + m[1])
}

/// `ggml_vec_dot_q5_K_q8_K`.
pub(crate) fn dot_q5k(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, b) in w.chunks_exact(KFormat::Q5K.block_bytes()).enumerate() {
        let d = a.d[i] * f16_at(b, 0);
        let dmin = -a.d[i] * f16_at(b, 2);
        let (scales, mins) = scales_mins_k4(&b[4..16]);
        let q8s = &a.sums32[i * 8..(i + 1) * 8];
        let hsum: i32 = (0..8).map(|t| i32::from(mins[t]) * i32::from(q8s[t])).sum();
        summs = dmin.mul_add(hsum as f32, summs);
        let (qh, q5, q8) = (&b[16..48], &b[48..176], &a.qs[i * QK_K..(i + 1) * QK_K]);
        let mut sumi = [0i32; 8];
        for j in 0..QK_K / 64 {
            let bits = &q5[32 * j..32 * (j + 1)];
            let high = |bit: usize| map32(qh, move |h| ((h >> bit) & 1) << 4);
            let (h0, h1) = (high(2 * j), high(2 * j + 1));
            let lo: [u8; 32] = std::array::from_fn(|t| (bits[t] & 15) + h0[t]);
            let hi: [u8; 32] = std::array::from_fn(|t| (bits[t] >> 4) + h1[t]);
            let (s0, s1) = (i16::from(scales[2 * j]), i16::from(scales[2 * j + 1]));
            let p0 = madd_split(s0, s0, &maddubs(&lo, &q8[64 * j..64 * j + 32]));
            let p1 = madd_split(s1, s1, &maddubs(&hi, &q8[64 * j + 32..64 * j + 64]));
            sumi = add(sumi, add(p0, p1));
        }
        accumulate(&mut acc, d, sumi);
    }
    hsum8(acc) + summs
}

/// `ggml_vec_dot_q6_K_q8_K`.
pub(crate) fn dot_q6k(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(KFormat::Q6K.block_bytes()).enumerate() {
        let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
        let d = a.d[i] * f16_at(b, 208);
        let q8 = &a.qs[i * QK_K..(i + 1) * QK_K];
        let bs = &a.bsums[i * 16..(i + 1) * 16];
        let scales: [i16; 16] = std::array::from_fn(|t| i16::from(sc[t] as i8));
        let bsums: [i16; 16] = std::array::from_fn(|t| bs[t]);
        let sub = madd(&bsums, &scales).map(|v| v.wrapping_shl(5));
        let mut sumi = [0i32; 8];
        for j in 0..QK_K / 128 {
            let (b1, b2) = (&ql[64 * j..64 * j + 32], &ql[64 * j + 32..64 * j + 64]);
            let h = &qh[32 * j..32 * (j + 1)];
            let q: [[u8; 32]; 4] = [
                std::array::from_fn(|t| (b1[t] & 15) | ((h[t] & 3) << 4)),
                std::array::from_fn(|t| (b2[t] & 15) | ((h[t] & 12) << 2)),
                std::array::from_fn(|t| (b1[t] >> 4) | (h[t] & 48)),
                std::array::from_fn(|t| (b2[t] >> 4) | ((h[t] & 0xC0) >> 2)),
            ];
            let mut p = [[0i32; 8]; 4];
            for (k, (q, p)) in q.iter().zip(&mut p).enumerate() {
                let c = 4 * j + k;
                let y = &q8[128 * j + 32 * k..128 * j + 32 * (k + 1)];
                let (lo, hi) = (scales[2 * c], scales[2 * c + 1]);
                *p = madd_split(lo, hi, &maddubs(q, y));
            }
            sumi = add(sumi, add(p[0], p[1]));
            sumi = add(sumi, add(p[2], p[3]));
        }
        let sumi: [i32; 8] = std::array::from_fn(|l| sumi[l].wrapping_sub(sub[l]));
        accumulate(&mut acc, d, sumi);
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q2_K_q8_K`.
pub(crate) fn dot_q2k(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(KFormat::Q2K.block_bytes()).enumerate() {
        let (sc, q2) = (&b[0..16], &b[16..80]);
        let d = a.d[i] * f16_at(b, 80);
        let dmin = -a.d[i] * f16_at(b, 82);
        let q8 = &a.qs[i * QK_K..(i + 1) * QK_K];
        let bs = &a.bsums[i * 16..(i + 1) * 16];
        let mins: [i16; 16] = std::array::from_fn(|t| i16::from(sc[t] >> 4));
        let bsums: [i16; 16] = std::array::from_fn(|t| bs[t]);
        accumulate(&mut acc, dmin, madd(&mins, &bsums));
        let scales: [i16; 16] = std::array::from_fn(|t| i16::from(sc[t] & 15));
        let mut sumi = [0i32; 8];
        for j in 0..QK_K / 128 {
            let bits = &q2[32 * j..32 * (j + 1)];
            let mut p = [[0i32; 8]; 4];
            for (k, p) in p.iter_mut().enumerate() {
                let q = map32(bits, |v| (v >> (2 * k)) & 3);
                let y = &q8[128 * j + 32 * k..128 * j + 32 * (k + 1)];
                let (lo, hi) = (scales[8 * j + 2 * k], scales[8 * j + 2 * k + 1]);
                *p = madd_split(lo, hi, &maddubs(&q, y));
            }
            sumi = add(sumi, add(add(p[0], p[1]), add(p[2], p[3])));
        }
        accumulate(&mut acc, d, sumi);
    }
    hsum8(acc)
}

/// The sixteen signed 6-bit scales of a Q3_K super-block, as ggml's AVX2 code unpacks
/// them (with 32 subtracted).
#[inline]
pub(super) fn scales_q3k(q: &[u8]) -> [i16; 16] {
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (k1, k2) = (0x0303_0303_u32, 0x0f0f_0f0f_u32);
    let aux = [word(0), word(1), word(2)];
    let e = [
        (aux[0] & k2) | ((aux[2] & k1) << 4),
        (aux[1] & k2) | (((aux[2] >> 2) & k1) << 4),
        ((aux[0] >> 4) & k2) | (((aux[2] >> 4) & k1) << 4),
        ((aux[1] >> 4) & k2) | (((aux[2] >> 6) & k1) << 4),
    ];
    let bytes = le_bytes(e);
    std::array::from_fn(|t| i16::from(bytes[t].wrapping_sub(32) as i8))
}

/// Four words as their sixteen little-endian bytes (in registers: the dot products call
/// this once per super-block).
#[inline(always)]
fn le_bytes(words: [u32; 4]) -> [u8; 16] {
    (u128::from(words[0])
        | u128::from(words[1]) << 32
        | u128::from(words[2]) << 64
        | u128::from(words[3]) << 96)
        .to_le_bytes()
}

/// `ggml_vec_dot_q3_K_q8_K`.
pub(crate) fn dot_q3k(w: &[u8], a: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(KFormat::Q3K.block_bytes()).enumerate() {
        let (hmask, q3, sc) = (&b[0..32], &b[32..96], &b[96..108]);
        let d = a.d[i] * f16_at(b, 108);
        let q8 = &a.qs[i * QK_K..(i + 1) * QK_K];
        let scales = scales_q3k(sc);
        let mut sumi = [0i32; 8];
        for j in 0..QK_K / 128 {
            let bits = &q3[32 * j..32 * (j + 1)];
            let mut p = [[0i32; 8]; 4];
            for (k, p) in p.iter_mut().enumerate() {
                let bit = 4 * j + k;
                let low = map32(bits, |v| (v >> (2 * k)) & 3);
                let high = map32(hmask, |h| ((!h >> bit) & 1) << 2);
                let y = &q8[128 * j + 32 * k..128 * j + 32 * (k + 1)];
                let (pl, ph) = (maddubs(&low, y), maddubs(&high, y));
                let diff: [i16; 16] = std::array::from_fn(|t| pl[t].wrapping_sub(ph[t]));
                let (lo, hi) = (scales[8 * j + 2 * k], scales[8 * j + 2 * k + 1]);
                *p = madd_split(lo, hi, &diff);
            }
            sumi = add(sumi, add(add(p[0], p[1]), add(p[2], p[3])));
        }
        accumulate(&mut acc, d, sumi);
    }
    hsum8(acc)
}

/// The dot product of a weight row of `format` with an activation row, portable.
pub(crate) fn dot(format: KFormat) -> fn(&[u8], &Q8KRow) -> f32 {
    match format {
        KFormat::Q2K => dot_q2k,
        KFormat::Q3K => dot_q3k,
        KFormat::Q4K => dot_q4k,
        KFormat::Q5K => dot_q5k,
        KFormat::Q6K => dot_q6k,
    }
}

/// One super-block row of `format` decoded to f32 into `out`, as ggml's `dequantize_row_*`
/// decode it.
pub(crate) fn dequantize_row(format: KFormat, row: &[u8], out: &mut [f32]) {
    for (b, y) in row
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(QK_K))
    {
        match format {
            KFormat::Q2K => dequantize_q2k(b, y),
            KFormat::Q3K => dequantize_q3k(b, y),
            KFormat::Q4K => dequantize_q4k(b, y, false),
            KFormat::Q5K => dequantize_q4k(b, y, true),
            KFormat::Q6K => dequantize_q6k(b, y),
        }
    }
}

/// ggml's `get_scale_min_k4`: scale and minimum `j` of the 12 packed bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K, and with `five` Q5_K: `d * scale * q - dmin * min`, the product rounded first.
fn dequantize_q4k(b: &[u8], y: &mut [f32], five: bool) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let sc = &b[4..16];
    let (qh, qs) = if five {
        (&b[16..48], &b[48..176])
    } else {
        (&b[0..0], &b[16..144])
    };
    for j in 0..4 {
        let (s1, m1) = scale_min_k4(2 * j, sc);
        let (s2, m2) = scale_min_k4(2 * j + 1, sc);
        let (d1, m1) = (d * f32::from(s1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), min * f32::from(m2));
        let q = &qs[32 * j..32 * (j + 1)];
        for l in 0..32 {
            let high = |bit: usize| if five { ((qh[l] >> bit) & 1) * 16 } else { 0 };
            let lo = (q[l] & 0xF) + high(2 * j);
            let hi = (q[l] >> 4) + high(2 * j + 1);
            y[64 * j + l] = d1 * f32::from(lo) - m1;
            y[64 * j + 32 + l] = d2 * f32::from(hi) - m2;
        }
    }
}

fn dequantize_q6k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..128 + 32 * n + 32]);
        let sc = |k: usize| f32::from(b[192 + 8 * n + k] as i8);
        for l in 0..32 {
            let is = l / 16;
            let q =
                |low: u8, shift: u8| f32::from((low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32);
            let y = &mut y[128 * n..128 * (n + 1)];
            y[l] = d * sc(is) * q(ql[l] & 0xF, 0);
            y[l + 32] = d * sc(is + 2) * q(ql[l + 32] & 0xF, 2);
            y[l + 64] = d * sc(is + 4) * q(ql[l] >> 4, 4);
            y[l + 96] = d * sc(is + 6) * q(ql[l + 32] >> 4, 6);
        }
    }
}

fn dequantize_q2k(b: &[u8], y: &mut [f32]) {
    let (sc, q) = (&b[0..16], &b[16..80]);
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    let mut out = y.iter_mut();
    for n in 0..2 {
        let q = &q[32 * n..32 * (n + 1)];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let s = sc[is];
                is += 1;
                let (dl, ml) = (d * f32::from(s & 0xF), min * f32::from(s >> 4));
                for l in 0..16 {
                    if let Some(o) = out.next() {
                        *o = dl * f32::from((q[16 * half + l] >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

fn dequantize_q3k(b: &[u8], y: &mut [f32]) {
    let (hm, q, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d_all = f16_at(b, 108);
    let scales = scales_q3k(sc);
    let mut is = 0;
    let mut m = 1u8;
    let mut out = y.iter_mut();
    for n in 0..2 {
        let q = &q[32 * n..32 * (n + 1)];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * f32::from(scales[is]);
                is += 1;
                for l in 0..16 {
                    let low = ((q[16 * half + l] >> shift) & 3) as i8;
                    let v = low - if hm[16 * half + l] & m != 0 { 0 } else { 4 };
                    if let Some(o) = out.next() {
                        *o = dl * f32::from(v);
                    }
                }
            }
            m <<= 1;
        }
    }
}
