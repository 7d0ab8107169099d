//! Weights quantized at load: ggml's reference quantizers (`quantize_row_*_ref`, what
//! llama.cpp's `llama-quantize` runs without an importance matrix), operation for operation,
//! so a checkpoint quantized here holds the very blocks llama.cpp would write.

use half::f16;

use super::kquant::{scale_min_k4, KFormat, QK_K};
use super::{WeightFormat, BLOCK};

/// The formats [`quantize_row`] writes: every block format the kernels run.
pub const QUANTIZABLE: [WeightFormat; 10] = [
    WeightFormat::Q8_0,
    WeightFormat::Q4_0,
    WeightFormat::Q4_1,
    WeightFormat::Q5_0,
    WeightFormat::Q5_1,
    WeightFormat::K(KFormat::Q2K),
    WeightFormat::K(KFormat::Q3K),
    WeightFormat::K(KFormat::Q4K),
    WeightFormat::K(KFormat::Q5K),
    WeightFormat::K(KFormat::Q6K),
];

/// The format a matrix `cols` wide is quantized to when `target` is asked for, as
/// `llama-quantize` decides (its `tensor_type_fallback`): `target` where its blocks fit the
/// row, else Q4_0 for Q2_K and Q3_K, Q5_0 for Q4_K, Q5_1 for Q5_K and Q8_0 for Q6_K; `None`
/// where no block fits (llama.cpp then writes F16; the checkpoint's floats are kept).
pub fn format_for(target: WeightFormat, cols: usize) -> Option<WeightFormat> {
    let fits = |f: WeightFormat| cols.is_multiple_of(f.block_values());
    if fits(target) {
        return Some(target);
    }
    let fallback = match target {
        WeightFormat::K(KFormat::Q2K | KFormat::Q3K) => WeightFormat::Q4_0,
        WeightFormat::K(KFormat::Q4K) => WeightFormat::Q5_0,
        WeightFormat::K(KFormat::Q5K) => WeightFormat::Q5_1,
        WeightFormat::K(KFormat::Q6K) => WeightFormat::Q8_0,
        _ => return None,
    };
    fits(fallback).then_some(fallback)
}

/// `x` (a whole number of `format`'s blocks) in `format`'s GGUF encoding; `None` for a
/// format without a quantizer here.
pub fn quantize_row(format: WeightFormat, x: &[f32]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(x.len() / format.block_values() * format.block_bytes());
    match format {
        WeightFormat::Q8_0 => x.chunks_exact(BLOCK).for_each(|b| q8_0(b, &mut out)),
        WeightFormat::Q4_0 => x.chunks_exact(BLOCK).for_each(|b| q4_0(b, &mut out)),
        WeightFormat::Q4_1 => x
            .chunks_exact(BLOCK)
            .for_each(|b| with_min::<4>(b, &mut out)),
        WeightFormat::Q5_0 => x.chunks_exact(BLOCK).for_each(|b| q5_0(b, &mut out)),
        WeightFormat::Q5_1 => x
            .chunks_exact(BLOCK)
            .for_each(|b| with_min::<5>(b, &mut out)),
        WeightFormat::K(KFormat::Q2K) => x.chunks_exact(QK_K).for_each(|b| q2_k(b, &mut out)),
        WeightFormat::K(KFormat::Q3K) => x.chunks_exact(QK_K).for_each(|b| q3_k(b, &mut out)),
        WeightFormat::K(KFormat::Q4K) => x.chunks_exact(QK_K).for_each(|b| q4_k(b, &mut out)),
        WeightFormat::K(KFormat::Q5K) => x.chunks_exact(QK_K).for_each(|b| q5_k(b, &mut out)),
        WeightFormat::K(KFormat::Q6K) => x.chunks_exact(QK_K).for_each(|b| q6_k(b, &mut out)),
        WeightFormat::Float(_) => return None,
    }
    Some(out)
}

/// ggml's bound below which a group of values counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`.
fn nearest_int(f: f32) -> i32 {
    let val = f + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// `quantize_row_q8_0_ref`.
fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x
        .iter()
        .fold(0f32, |m, v| if m > v.abs() { m } else { v.abs() });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16_bytes(d));
    // `roundf`: halves away from zero.
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// The value of largest magnitude (the first of equals), whose sign Q4_0's and Q5_0's scales
/// take.
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// A 32-value block's levels `q(value)` as ggml lays them out: values `j` and `j + 16` in the
/// low and high nibbles of byte `j`, after them where `fifth` their fifth bits (bits `j` and
/// `j + 16` of a little-endian u32, `qh`).
fn pack_levels(x: &[f32], fifth: bool, q: impl Fn(f32) -> u8, out: &mut Vec<u8>) {
    let mut qh = 0u32;
    let mut qs = [0u8; BLOCK / 2];
    for j in 0..BLOCK / 2 {
        let (a, b) = (q(x[j]), q(x[j + BLOCK / 2]));
        qs[j] = (a & 0x0f) | ((b & 0x0f) << 4);
        qh |= u32::from((a & 0x10) >> 4) << j;
        qh |= u32::from((b & 0x10) >> 4) << (j + BLOCK / 2);
    }
    if fifth {
        out.extend(qh.to_le_bytes());
    }
    out.extend(qs);
}

/// `quantize_row_q4_0_ref`.
fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let d = signed_max(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16_bytes(d));
    // `(int8_t)(x * id + 8.5f)` truncates toward zero, then at most 15.
    pack_levels(x, false, |v| ((v * id + 8.5) as i8).min(15) as u8, out);
}

/// `quantize_row_q5_0_ref`.
fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let d = signed_max(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16_bytes(d));
    // `(int8_t)(x * id + 16.5f)`, at most 31.
    pack_levels(x, true, |v| ((v * id + 16.5) as i8).min(31) as u8, out);
}

/// `quantize_row_q4_1_ref` (`BITS` 4) and `quantize_row_q5_1_ref` (`BITS` 5): the block's
/// minimum and its range over `2^BITS - 1` as f16, each value `(x - min) / d` rounded half up.
fn with_min<const BITS: u32>(x: &[f32], out: &mut Vec<u8>) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / ((1u32 << BITS) - 1) as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16_bytes(d));
    out.extend(f16_bytes(min));
    // Q4_1: `MIN(15, (int8_t)(x + 0.5f))`; Q5_1: `(uint8_t)(x + 0.5f)`, both truncating.
    let q = |v: f32| {
        let v = (v - min) * id + 0.5;
        if BITS == 4 {
            (v as i8).min(15) as u8
        } else {
            v as u8
        }
    };
    pack_levels(x, BITS == 5, q, out);
}

/// ggml's `make_qkx2_quants`: a scale and minimum for `x` (with `weights`), the levels in
/// `l`; returns the scale and writes minus the minimum to `the_min`. Each candidate's error
/// sums `weights[i]` times the squared difference, or with `use_mad` the absolute one.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    the_min: &mut f32,
    laux: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
    use_mad: bool,
) -> f32 {
    let error = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        *the_min = -min;
        return 0.0;
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * error(diff);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * error(diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    scale
}

/// Q4_K's and Q5_K's shared steps (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`): each
/// 32-value sub-block's scale and minimum by [`make_qkx2_quants`] (levels up to `nmax`, its
/// search from `rmin` in `nstep` steps), both packed to six bits under the f16 `d` and `dmin`,
/// then every level taken again from the packed ones. Returns `d`, `dmin`, the twelve packed
/// bytes and the levels.
fn k4_levels(x: &[f32], nmax: i32, (rmin, nstep): (f32, i32)) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let (mut mins, mut scales) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * (j + 1)];
        let sum_x2: f32 = xs.iter().fold(0.0, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        scales[j] = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * (j + 1)],
            &mut mins[j],
            &mut laux,
            (rmin, 0.1, nstep),
            false,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..QK_K / 32 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..QK_K / 32 {
        let (s, m) = scale_min_k4(j, &sc);
        let dj = d.to_f32() * f32::from(s);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * f32::from(m);
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, sc, l)
}

/// `quantize_row_q4_K_ref`.
fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, sc, l) = k4_levels(x, 15, (-1.0, 20));
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(sc);
    for j in (0..QK_K).step_by(64) {
        out.extend((0..32).map(|i| l[j + i] | (l[j + i + 32] << 4)));
    }
}

/// `quantize_row_q5_K_ref`: Q4_K's steps to 31 levels; each value's fifth bit in `qh`, bit
/// `2n` for value `j` of the `n`-th 64 and bit `2n + 1` for value `32 + j`.
fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, sc, l) = k4_levels(x, 31, (-0.5, 15));
    let mut qh = [0u8; QK_K / 8];
    let mut ql = [0u8; QK_K / 2];
    for (n, ql) in ql.chunks_exact_mut(32).enumerate() {
        for (j, q) in ql.iter_mut().enumerate() {
            let (lo, hi) = (l[64 * n + j], l[64 * n + j + 32]);
            qh[j] |= ((lo >> 4) << (2 * n)) | ((hi >> 4) << (2 * n + 1));
            *q = (lo & 0xF) | ((hi & 0xF) << 4);
        }
    }
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(sc);
    out.extend(qh);
    out.extend(ql);
}

/// Two-bit levels (Q2_K's and Q3_K's low bits): byte `32 c + i` of each 128 values holds
/// values `i`, `32 + i`, `64 + i` and `96 + i` from its low bits up.
fn pack2(l: &[u8; QK_K], out: &mut Vec<u8>) {
    for j in (0..QK_K).step_by(128) {
        out.extend((0..32).map(|i| {
            l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6)
        }));
    }
}

/// `quantize_row_q2_K_ref`: each sixteen values' scale and minimum by [`make_qkx2_quants`]
/// (three levels, absolute errors weighted by `|x|`), both to four bits under `d` and `dmin`.
fn q2_k(x: &[f32], out: &mut Vec<u8>) {
    const Q4SCALE: f32 = 15.0;
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 16];
    let mut weights = [0f32; 16];
    let (mut mins, mut scales) = ([0f32; QK_K / 16], [0f32; QK_K / 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..QK_K / 16 {
        let xs = &x[16 * j..16 * (j + 1)];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        scales[j] = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * (j + 1)],
            &mut mins[j],
            &mut laux,
            (-0.5, 0.1, 15),
            true,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let mut sc = [0u8; QK_K / 16];
    let mut d = f16::ZERO;
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (s, &scale) in sc.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * scale) as u8;
        }
        d = f16::from_f32(max_scale / Q4SCALE);
    }
    let mut dmin = f16::ZERO;
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (s, &min) in sc.iter_mut().zip(&mins) {
            *s |= (nearest_int(iscale * min) << 4) as u8;
        }
        dmin = f16::from_f32(max_min / Q4SCALE);
    }
    for j in 0..QK_K / 16 {
        let dj = d.to_f32() * f32::from(sc[j] & 0xF);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * f32::from(sc[j] >> 4);
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / dj).clamp(0, 3) as u8;
        }
    }
    out.extend(sc);
    pack2(&l, out);
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
}

/// ggml's `make_q3_quants` with `do_rmse`: signed levels `-nmax..nmax` for `x`, improved
/// one value at a time (up to five passes) while `x²`-weighted agreement grows; the levels
/// are written offset by `nmax`, and the least-squares scale returned.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |v: i32| v.clamp(-nmax, nmax - 1);
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &v) in l.iter_mut().zip(x) {
        let lv = level(nearest_int(iscale * v));
        *q = lv as i8;
        let w = v * v;
        sumlx += w * v * lv as f32;
        suml2 += w * lv as f32 * lv as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (q, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let old = f32::from(*q);
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new = level(nearest_int(v * sl2 / slx));
                if new != i32::from(*q) {
                    slx += w * v * new as f32;
                    sl2 += w * new as f32 * new as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *q = new as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for q in l.iter_mut() {
        *q += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `quantize_row_q3_K_ref`: each sixteen values' scale by [`make_q3_quants`], to six signed
/// bits under `d` (low four bits in the first eight bytes, high two in the last four), levels
/// `-4..4` with their third bit in `hmask`.
fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..QK_K / 16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * (j + 1)], &mut l[16 * j..16 * (j + 1)]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut sc = [0u8; 12];
    let mut d = f16::ZERO;
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &scale) in scales.iter().enumerate() {
            // `int8_t l = nearest_int(...)`, then clamped and offset: 0..64.
            let lv = (nearest_int(iscale * scale) as i8).clamp(-32, 31) + 32;
            if j < 8 {
                sc[j] = (lv & 0xF) as u8;
            } else {
                sc[j - 8] |= ((lv & 0xF) << 4) as u8;
            }
            sc[j % 4 + 8] |= ((lv >> 4) << (2 * (j / 4))) as u8;
        }
        d = f16::from_f32(1.0 / iscale);
    }
    for j in 0..QK_K / 16 {
        let low = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        let dj = d.to_f32() * f32::from((low | (high << 4)) as i8 - 32);
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-4, 3) + 4) as i8;
        }
    }
    // The third bit of value `j` at bit `j / 32` of byte `j % 32`; the two low bits packed.
    let mut hmask = [0u8; QK_K / 8];
    let mut low = [0u8; QK_K];
    for (j, (&q, low)) in l.iter().zip(&mut low).enumerate() {
        let q = q as u8;
        if q > 3 {
            hmask[j % 32] |= 1 << (j / 32);
        }
        *low = q & 3;
    }
    out.extend(hmask);
    pack2(&low, out);
    out.extend(sc);
    out.extend(d.to_le_bytes());
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights (signed levels).
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &v) in l.iter_mut().zip(x) {
        let lv = level(iscale, v);
        *q = (lv + nmax) as i8;
        let w = v * v;
        sumlx += w * v * lv as f32;
        suml2 += w * lv as f32 * lv as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let lv = level(iscale, v);
            let w = v * v;
            sumlx += w * v * lv as f32;
            suml2 += w * lv as f32 * lv as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = (nmax + level(iscale, v)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `quantize_row_q6_K_ref`.
fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants(
            32,
            &x[16 * ib..16 * (ib + 1)],
            &mut l[16 * ib..16 * (ib + 1)],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    let block_start = out.len();
    out.resize(block_start + KFormat::Q6K.block_bytes(), 0);
    let block = &mut out[block_start..];
    if max_abs_scale < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let mut sc = [0i8; 16];
    for (s, &scale) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * scale).min(127) as i8;
    }
    for j in 0..QK_K / 16 {
        let dj = d.to_f32() * f32::from(sc[j]);
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, rest) = block.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (scb, dst) = rest.split_at_mut(16);
    for n in 0..2 {
        let (j, ql, qh) = (
            128 * n,
            &mut ql[64 * n..64 * (n + 1)],
            &mut qh[32 * n..32 * (n + 1)],
        );
        for i in 0..32 {
            let q = |k: usize| l[j + i + 32 * k] as u8;
            ql[i] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[i + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[i] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    for (b, s) in scb.iter_mut().zip(sc) {
        *b = s as u8;
    }
    dst.copy_from_slice(&d.to_le_bytes());
}
