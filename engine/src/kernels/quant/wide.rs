//! The AVX-512 VNNI kernel of the quantized product for batches: four weight rows against
//! activation rows four at a time, with exactly ggml's per-block arithmetic (eight integer
//! lanes per block, the scale product rounded to f32, one fused multiply-add per lane),
//! laid out so the multiply ports do only the work that needs them.
//!
//! - Two weight rows share a 512-bit register with their four-value groups interleaved
//!   (lane `2j` is the first row's lane `j`, lane `2j + 1` the second's), so both rows'
//!   scale products arrive in one 64-bit broadcast load; the sixteen scale products of a
//!   4 × 4 tile are one multiply, and its sixteen `m · s` sums (Q4_1) one fused multiply-add.
//! - Signed weights (Q4_0, Q8_0) are made unsigned by an offset `k` (8 for the raw nibbles,
//!   128 for bytes), and each integer dot product starts from minus `k` times its
//!   activation values' sum, so it ends at the signed sum itself.
//!
//! Products of eight or more activation rows run here; each group of four weight rows is
//! unpacked once ([`WideQuad::fill`]) and then serves every group of activation rows.

use std::arch::x86_64::*;

use super::{hsum8, QuantizedRow, WeightFormat, BLOCK};

/// Proof that the CPU runs the 512-bit kernels — this one and the small-batch kernels in
/// registers: AVX-512 F/BW/VNNI and the AVX2, FMA and F16C their helpers use (every such
/// CPU has them; checked rather than assumed). Only [`detect`] makes one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Avx512(());

/// The token when the CPU runs the 512-bit kernels, checked at run time.
pub(super) fn detect() -> Option<Avx512> {
    use std::arch::is_x86_feature_detected as has;
    (has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vnni")
        && has!("avx2")
        && has!("fma")
        && has!("f16c"))
    .then_some(Avx512(()))
}

/// 64 bytes aligned for one 512-bit load.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Lane64([u8; 64]);

impl Lane64 {
    const ZERO: Lane64 = Lane64([0; 64]);

    /// The sixteen f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn ps(&self) -> __m512 {
        // SAFETY: `self` is 64 bytes aligned to 64 (repr above): one aligned load.
        unsafe { _mm512_load_ps(self.0.as_ptr().cast()) }
    }

    /// The `k`-th pair of f32 (`k < 8`) in every 64-bit lane: one broadcast load.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn pair(&self, k: usize) -> __m512 {
        let bytes = &self.0[8 * k..8 * k + 8];
        // SAFETY: `bytes` is 8 readable bytes; the load is unaligned.
        unsafe {
            _mm512_castpd_ps(_mm512_set1_pd(
                bytes.as_ptr().cast::<f64>().read_unaligned(),
            ))
        }
    }

    /// The 64 bytes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn si(&self) -> __m512i {
        // SAFETY: as in `ps`.
        unsafe { _mm512_load_si512(self.0.as_ptr().cast()) }
    }
}

/// Four weight rows unpacked for the kernel, per block: rows 0-1 and 2-3 interleaved as
/// unsigned bytes, the four scales repeated four times, the four minimums likewise.
#[derive(Debug, Default)]
pub(super) struct WideQuad {
    blocks: Vec<[Lane64; 4]>,
    /// Per block, the scale products and activation sums of the activation group at hand.
    products: Vec<[Lane64; 2]>,
}

impl WideQuad {
    /// Unpacks four GGUF rows of `format` into this buffer, reusing its memory.
    pub(super) fn fill(&mut self, cpu: Avx512, format: WeightFormat, rows: [&[u8]; 4]) {
        let _ = cpu;
        // SAFETY: `cpu` exists only where `detect` found every feature `fill_quad` enables.
        unsafe { fill_quad(self, format, rows) }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
fn fill_quad(quad: &mut WideQuad, format: WeightFormat, rows: [&[u8]; 4]) {
    let stride = format.block_bytes();
    let nb = rows[0].len() / stride;
    assert!(rows.iter().all(|r| r.len() == nb * stride));
    quad.blocks.resize(nb, [Lane64::ZERO; 4]);
    // Value groups of two rows laid out [a 0..8, b 0..8] -> [a0 b0 a1 b1 ..].
    let pair_bytes = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    // Nibbles laid out [a lo, b lo, a hi, b hi] (16 bytes each) -> [a0 b0 a1 b1 ..].
    let pair_nibbles = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    // Q4_1 heads [d0 m0 d1 m1 d2 m2 d3 m3] -> scales and minimums, each four times.
    let scale_of = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    let min_of = _mm512_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
    let low = _mm512_set1_epi8(0x0F);
    let flip = _mm512_set1_epi8(-128);
    let values = match format {
        WeightFormat::Q4_1 => 4,
        _ => 2,
    };
    let p = rows.map(|r| r.as_ptr());
    for (i, dst) in quad.blocks.iter_mut().enumerate() {
        let at = i * stride;
        // SAFETY: every row holds `nb` blocks of `stride` bytes (asserted), so each read
        // stays inside block `i` of its row: a 2- or 4-byte head, then 16 or 32 value bytes
        // at `values`; all loads are unaligned.
        let (scales, mins, pairs) = unsafe {
            let (scales, mins) = if format == WeightFormat::Q4_1 {
                let head = |r: usize| p[r].add(at).cast::<i32>().read_unaligned();
                let dm = _mm256_cvtph_ps(_mm_setr_epi32(head(0), head(1), head(2), head(3)));
                let dm = _mm512_castps256_ps512(dm);
                (
                    _mm512_permutexvar_ps(scale_of, dm),
                    _mm512_permutexvar_ps(min_of, dm),
                )
            } else {
                let head = |r: usize| p[r].add(at).cast::<i16>().read_unaligned();
                let d = _mm_cvtph_ps(_mm_setr_epi16(
                    head(0),
                    head(1),
                    head(2),
                    head(3),
                    0,
                    0,
                    0,
                    0,
                ));
                (_mm512_broadcast_f32x4(d), _mm512_setzero_ps())
            };
            let v = |r: usize| p[r].add(at + values);
            let pairs = if format == WeightFormat::Q8_0 {
                let pair = |r: usize| {
                    let both = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(v(r).cast())),
                        _mm256_loadu_si256(v(r + 1).cast()),
                    );
                    _mm512_xor_si512(_mm512_permutexvar_epi32(pair_bytes, both), flip)
                };
                [pair(0), pair(2)]
            } else {
                let pair = |r: usize| {
                    let y = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(_mm_loadu_si128(v(r).cast())),
                        _mm_loadu_si128(v(r + 1).cast()),
                    );
                    let z = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(y),
                        _mm256_srli_epi16::<4>(y),
                    );
                    _mm512_permutexvar_epi32(pair_nibbles, _mm512_and_si512(z, low))
                };
                [pair(0), pair(2)]
            };
            (scales, mins, pairs)
        };
        // SAFETY: each `Lane64` is 64 bytes aligned to 64: aligned stores.
        unsafe {
            _mm512_store_si512(dst[0].0.as_mut_ptr().cast(), pairs[0]);
            _mm512_store_si512(dst[1].0.as_mut_ptr().cast(), pairs[1]);
            _mm512_store_ps(dst[2].0.as_mut_ptr().cast(), scales);
            _mm512_store_ps(dst[3].0.as_mut_ptr().cast(), mins);
        }
    }
}

/// Activation rows laid out for the kernel in groups of four (the last group padded with
/// zero rows, whose results are dropped).
#[derive(Debug)]
pub(super) struct WideActs {
    rows: usize,
    blocks: usize,
    /// Q4_1: `m · s` terms are added (and the integer sums start from zero).
    mins: bool,
    /// `[group][block][row]`: the row's 32 bytes.
    q: Vec<[i8; BLOCK]>,
    /// `[group][block][row]`: where each of the eight integer sums starts (signed weights).
    start: Vec<[i32; 8]>,
    /// `[group][block]`: the four rows' scales, then their `d · Σq` sums (Q4_1).
    ds: Vec<[f32; 8]>,
}

impl WideActs {
    /// Lays out `acts` for weights of `format`.
    pub(super) fn new(cpu: Avx512, format: WeightFormat, acts: &[QuantizedRow]) -> Self {
        let _ = cpu;
        let blocks = acts.first().map_or(0, |a| a.d.len());
        let mins = format == WeightFormat::Q4_1;
        // What makes the weights unsigned: raw nibbles are 8 above Q4_0's values, flipped
        // sign bits 128 above Q8_0's.
        let offset = match format {
            WeightFormat::Q4_1 => 0,
            WeightFormat::Q4_0 => 8,
            WeightFormat::Q8_0 => 128,
        };
        let groups = acts.len().div_ceil(4);
        let mut out = WideActs {
            rows: acts.len(),
            blocks,
            mins,
            q: vec![[0; BLOCK]; groups * blocks * 4],
            start: Vec::new(),
            ds: vec![[0.0; 8]; groups * blocks],
        };
        for (n, a) in acts.iter().enumerate() {
            let (g, r) = (n / 4, n % 4);
            for (i, q) in a.q.chunks_exact(BLOCK).enumerate() {
                out.q[(g * blocks + i) * 4 + r].copy_from_slice(q);
                let ds = &mut out.ds[g * blocks + i];
                ds[r] = a.d[i];
                if mins {
                    ds[4 + r] = a.s[i];
                }
            }
        }
        if !mins {
            out.start = out
                .q
                .iter()
                .map(|q| {
                    let mut start = [0i32; 8];
                    for (s, four) in start.iter_mut().zip(q.chunks_exact(4)) {
                        let sum: i32 = four.iter().map(|&v| i32::from(v)).sum();
                        *s = -offset * sum;
                    }
                    start
                })
                .collect();
        }
        out
    }

    /// How many activation rows (without padding).
    pub(super) fn rows(&self) -> usize {
        self.rows
    }
}

/// `out[i]`: the four weight rows of `quad` against activation row `i` of `acts`; exactly
/// the arithmetic of the row-at-a-time dot products.
pub(super) fn tile(cpu: Avx512, quad: &mut WideQuad, acts: &WideActs, out: &mut [[f32; 4]]) {
    let _ = cpu;
    // SAFETY: `cpu` exists only where `detect` found every feature `tile_avx512` enables.
    unsafe {
        if acts.mins {
            tile_avx512::<true>(quad, acts, out)
        } else {
            tile_avx512::<false>(quad, acts, out)
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn tile_avx512<const MINS: bool>(quad: &mut WideQuad, acts: &WideActs, out: &mut [[f32; 4]]) {
    let WideQuad {
        blocks: quad,
        products,
    } = quad;
    let nb = quad.len();
    assert!(acts.blocks == nb && out.len() == acts.rows && acts.mins == MINS);
    assert!(acts.q.len() == out.len().div_ceil(4) * 4 * nb && acts.ds.len() * 4 == acts.q.len());
    assert!(MINS || acts.start.len() == acts.q.len());
    // Eight 32-bit groups -> each twice, for the two interleaved weight rows.
    let twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    // Four values -> each four times (lane 4r + k holds activation row r's).
    let fours = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let doubled = |v: __m256i| _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(v));
    for (g, outs) in out.chunks_mut(4).enumerate() {
        let cells = g * 4 * nb..(g + 1) * 4 * nb;
        let group_q = &acts.q[cells.clone()];
        let group_start = if MINS { &[][..] } else { &acts.start[cells] };
        let group_ds = &acts.ds[g * nb..(g + 1) * nb];
        // First the scale products (lane 4r + k: weight row k's scale times activation
        // row r's) and the `d · Σq` sums likewise laid out, so the main loop reads each pair
        // of products with a broadcast load instead of a shuffle.
        products.clear();
        for (w, ds) in quad.iter().zip(group_ds) {
            // SAFETY: `ds` is eight f32: one unaligned load.
            let ds = unsafe { _mm512_castps256_ps512(_mm256_loadu_ps(ds.as_ptr())) };
            let da = _mm512_permutexvar_ps(fours, ds);
            let sa = _mm512_permutexvar_ps(fours, _mm512_shuffle_f32x4::<0b01_01_01_01>(ds, ds));
            let mut p = [Lane64::ZERO; 2];
            // SAFETY: each `Lane64` is 64 bytes aligned to 64: aligned stores.
            unsafe {
                _mm512_store_ps(p[0].0.as_mut_ptr().cast(), _mm512_mul_ps(w[2].ps(), da));
                _mm512_store_ps(p[1].0.as_mut_ptr().cast(), sa);
            }
            products.push(p);
        }
        let mut summs = _mm512_setzero_ps();
        let mut acc = [[_mm512_setzero_ps(); 2]; 4];
        for (i, ((w, q), [scales, sa])) in quad
            .iter()
            .zip(group_q.chunks_exact(4))
            .zip(products.iter())
            .enumerate()
        {
            if MINS {
                summs = _mm512_fmadd_ps(w[3].ps(), sa.ps(), summs);
            }
            let pairs = [w[0].si(), w[1].si()];
            for (r, y) in q.iter().enumerate() {
                // SAFETY: `y` is 32 bytes and each start is eight i32: unaligned loads.
                let (y, from) = unsafe {
                    let y = doubled(_mm256_loadu_si256(y.as_ptr().cast()));
                    let from = if MINS {
                        _mm512_setzero_si512()
                    } else {
                        doubled(_mm256_loadu_si256(group_start[4 * i + r].as_ptr().cast()))
                    };
                    (y, from)
                };
                for (p, x) in pairs.iter().enumerate() {
                    let sums = _mm512_dpbusd_epi32(from, *x, y);
                    let sums = _mm512_cvtepi32_ps(sums);
                    let d = scales.pair(2 * r + p);
                    acc[r][p] = _mm512_fmadd_ps(d, sums, acc[r][p]);
                }
            }
        }
        let mut m = [0f32; 16];
        // SAFETY: `m` holds exactly sixteen f32.
        unsafe { _mm512_storeu_ps(m.as_mut_ptr(), summs) };
        for (r, o) in outs.iter_mut().enumerate() {
            for (p, pair) in acc[r].iter().enumerate() {
                let mut all = [0f32; 16];
                // SAFETY: `all` holds exactly sixteen f32.
                unsafe { _mm512_storeu_ps(all.as_mut_ptr(), *pair) };
                for h in 0..2 {
                    let lanes = [0, 1, 2, 3, 4, 5, 6, 7].map(|j| all[2 * j + h]);
                    let k = 2 * p + h;
                    o[k] = if MINS {
                        hsum8(lanes) + m[4 * r + k]
                    } else {
                        hsum8(lanes)
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::{dot_q4_0, dot_q4_1, dot_q8_0};
    use half::f16;

    /// GGUF rows of `format` from a byte pattern, with finite scales (and minimums).
    fn weight_rows(format: WeightFormat, blocks: usize, salt: usize) -> [Vec<u8>; 4] {
        [0, 1, 2, 3].map(|r| {
            let mut row = Vec::new();
            for i in 0..blocks {
                let k = salt + 7 * r + 3 * i;
                row.extend(f16::from_f32(0.01 + k as f32 * 0.003).to_le_bytes());
                if format == WeightFormat::Q4_1 {
                    row.extend(f16::from_f32(-0.05 * k as f32).to_le_bytes());
                }
                let values = format.block_bytes() - row.len() % format.block_bytes();
                // Extremes first (0x80 is -128 in Q8_0, 0xFF and 0x00 are 15 and 0
                // nibbles), then a pattern.
                row.extend([0x80u8, 0x7F, 0xFF, 0x00]);
                row.extend((4..values).map(|j| (j * 131 + k * 17) as u8));
            }
            row
        })
    }

    /// An activation row with extreme bytes (±127) and a pattern, scales and sums.
    fn activation(blocks: usize, salt: usize) -> QuantizedRow {
        let q: Vec<i8> = (0..blocks * BLOCK)
            .map(|j| match (j + salt) % 9 {
                0 => 127,
                1 => -127,
                _ => ((j * 37 + salt * 11) % 255) as i32 as i8,
            })
            .collect();
        let d = (0..blocks)
            .map(|i| 0.002 + (i + salt) as f32 * 1e-3)
            .collect();
        let s = (0..blocks).map(|i| (i as f32 - 2.5) * 0.7).collect();
        QuantizedRow { d, s, q }
    }

    #[test]
    fn the_wide_kernel_matches_the_portable_code_bit_for_bit() {
        let Some(cpu) = detect() else {
            return;
        };
        let blocks = 5;
        for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let dot = match format {
                WeightFormat::Q4_0 => dot_q4_0,
                WeightFormat::Q4_1 => dot_q4_1,
                WeightFormat::Q8_0 => dot_q8_0,
            };
            let rows = weight_rows(format, blocks, 1);
            let w = [0, 1, 2, 3].map(|r| &rows[r][..]);
            let mut quad = WideQuad::default();
            quad.fill(cpu, format, w);
            // Whole groups, a padded group, and a single row.
            for n in [1, 3, 4, 9] {
                let acts: Vec<QuantizedRow> = (0..n).map(|i| activation(blocks, i)).collect();
                let wide = WideActs::new(cpu, format, &acts);
                let mut out = vec![[0f32; 4]; n];
                tile(cpu, &mut quad, &wide, &mut out);
                for (i, (o, a)) in out.iter().zip(&acts).enumerate() {
                    let want = w.map(|row| dot(row, a).to_bits());
                    assert_eq!(o.map(f32::to_bits), want, "{format:?}, {n} rows, row {i}");
                }
            }
        }
    }
}
