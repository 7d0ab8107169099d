//! Causal attention over a KV cache stored in blocks (the PagedAttention layout),
//! following the shape of vLLM's CPU kernel: parallel over query × head, keys read
//! block by block through the sequence's block list, online softmax, weighted sum of V.
//!
//! The cache element decides the arithmetic. With an f32 cache everything is f32. With an
//! f16 cache the kernel rounds as llama.cpp's CPU flash attention does — the query to f16,
//! q·k accumulated in f32, the V accumulator kept in f16 — so GGUF models reproduce
//! llama.cpp's tokens. Each (query, head) reduces its keys in position order whatever else
//! shares the batch, so results are batch-invariant.

use half::f16;
#[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// A KV cache element type.
pub trait KvElement: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// Converts (rounding) from f32.
    fn from_f32(x: f32) -> Self;
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this precision and back.
    fn round(x: f32) -> f32 {
        Self::from_f32(x).to_f32()
    }
    /// Widens a row into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds every value of `x` to this precision and back, using `scratch` (same length).
    fn round_slice(x: &mut [f32], scratch: &mut [Self]);
}

impl KvElement for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn round(x: f32) -> f32 {
        x
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn round_slice(_: &mut [f32], _: &mut [Self]) {}
}

impl KvElement for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        #[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
        f16c::widen(src, dst);
        #[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
        src.convert_to_f32_slice(dst);
    }
    #[cfg_attr(
        all(target_arch = "x86_64", target_feature = "f16c"),
        allow(unused_variables)
    )]
    fn round_slice(x: &mut [f32], scratch: &mut [Self]) {
        #[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
        f16c::round(x);
        #[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
        {
            scratch.convert_from_f32_slice(x);
            scratch.convert_to_f32_slice(x);
        }
    }
}

/// f16 <-> f32 eight values at a time with the F16C instructions: the same IEEE
/// conversions (round to nearest even) as the `half` crate's, without a call per row.
/// Chosen at compile time (every build here targets a CPU with F16C: `native` locally,
/// `x86-64-v3` in images), so the per-row hot path carries no feature check.
#[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
#[allow(unsafe_code)]
mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// Widens `src` into `dst` (same length).
    #[inline]
    pub fn widen(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        for (s, d) in src[..whole]
            .chunks_exact(8)
            .zip(dst[..whole].chunks_exact_mut(8))
        {
            // SAFETY: F16C and AVX are enabled at compile time (this module's cfg); `s` holds
            // eight f16 (16 bytes) and `d` eight f32, accessed unaligned, exactly those bytes.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast());
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        for (s, d) in src[whole..n].iter().zip(&mut dst[whole..n]) {
            *d = s.to_f32();
        }
    }

    /// Rounds every value of `x` to f16 and back.
    #[inline]
    pub fn round(x: &mut [f32]) {
        let whole = x.len() / 8 * 8;
        for c in x[..whole].chunks_exact_mut(8) {
            // SAFETY: F16C and AVX are enabled at compile time (this module's cfg); `c` holds
            // eight f32, loaded and stored unaligned, exactly those bytes.
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
}

/// One sequence's keys (or values) in one layer: rows of `kv_heads * head_dim` values,
/// `block_size` rows per block, blocks in position order.
#[derive(Debug, Clone, Copy)]
pub struct KvBlocks<'a, T> {
    /// The sequence's blocks, in position order.
    pub blocks: &'a [&'a [T]],
    /// Rows per block.
    pub block_size: usize,
}

impl<T> KvBlocks<'_, T> {
    fn row(&self, pos: usize, width: usize) -> &[T] {
        let block = self.blocks[pos / self.block_size];
        let at = (pos % self.block_size) * width;
        &block[at..at + width]
    }
}

/// Head counts and width of the attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (query head `h` reads KV head `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// Writes `out[i, h, :]` = softmax(q_i,h · K[0..=positions[i]] / sqrt(d)) · V for every
/// query row `i` (`q` and `out` are `[len, heads * head_dim]`).
pub fn paged_attention<T: KvElement>(
    q: &[f32],
    positions: &[usize],
    keys: KvBlocks<'_, T>,
    values: KvBlocks<'_, T>,
    shape: HeadShape,
    out: &mut [f32],
) {
    let HeadShape {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let group = heads / kv_heads;
    let width = kv_heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    // Small steps (a decode over a short context) cost less than waking another thread.
    let work = positions.iter().map(|p| p + 1).sum::<usize>() * heads * d;
    let per_task = if work < 1 << 16 { out.len() } else { d };
    let one = |row: usize, o: &mut [f32]| {
        let (i, h) = (row / heads, row % heads);
        let kvh = h / group;
        let qr: Vec<f32> = q[row * d..(row + 1) * d]
            .iter()
            .map(|&x| T::round(x))
            .collect();
        let acc = o;
        acc.iter_mut().for_each(|a| *a = 0.0);
        let (mut k32, mut v32, mut scratch) = (vec![0f32; d], vec![0f32; d], vec![T::default(); d]);
        let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
        for pos in 0..=positions[i] {
            T::widen(&keys.row(pos, width)[kvh * d..(kvh + 1) * d], &mut k32);
            let s = dot(&qr, &k32) * scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > max {
                ms = (max - s).exp();
                max = s;
                acc.iter_mut().for_each(|a| *a *= ms);
                T::round_slice(acc, &mut scratch);
            } else {
                vs = (s - max).exp();
            }
            T::widen(&values.row(pos, width)[kvh * d..(kvh + 1) * d], &mut v32);
            for (a, &x) in acc.iter_mut().zip(&v32) {
                *a = x.mul_add(vs, *a);
            }
            T::round_slice(acc, &mut scratch);
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        acc.iter_mut().for_each(|a| *a *= inv);
    };
    out.par_chunks_mut(per_task)
        .enumerate()
        .for_each(|(t, chunk)| {
            for (j, o) in chunk.chunks_mut(d).enumerate() {
                one(t * (per_task / d) + j, o);
            }
        });
}

/// q · k as ggml's AVX-512 `ggml_vec_dot_f16` sums it: 64 values at a time in four
/// 16-lane accumulators, folded (0+2)+(1+3), then the 16 lanes halved down to one; any
/// remainder is added one product at a time in f64.
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let whole = q.len() / 64 * 64;
    let mut acc = [[0f32; 16]; 4];
    for (cq, ck) in q[..whole].chunks_exact(64).zip(k[..whole].chunks_exact(64)) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = cq[j * 16 + l].mul_add(ck[j * 16 + l], *lane);
            }
        }
    }
    let mut z = [0f32; 16];
    for l in 0..16 {
        z[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = f64::from(reduce16(z));
    for (x, y) in q[whole..].iter().zip(&k[whole..]) {
        sum += f64::from(x * y);
    }
    sum as f32
}

/// `_mm512_reduce_add_ps` as GCC expands it: halves, quarters, then pairs.
fn reduce16(a: [f32; 16]) -> f32 {
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = a[i + 8] + a[i];
    }
    let u = [t[4] + t[0], t[5] + t[1], t[6] + t[2], t[7] + t[3]];
    (u[0] + u[2]) + (u[1] + u[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversions_match_the_half_crate_bit_for_bit() {
        // Ties, subnormals, overflow, infinities and ordinary values, in odd-length rows.
        let mut x: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            65504.0,
            65520.0,
            1e6,
            -1e6,
            6.0e-8,
            3.0e-8,
            5.96e-8,
            1.0e-5,
            2049.0,
            2051.0,
            0.1,
            -0.3333,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.000_976_6,
        ];
        x.extend((0..1000).map(|i| ((i * 7919) % 2003) as f32 * 0.013 - 13.0));
        let want: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        let mut got = x.clone();
        let mut scratch = vec![f16::ZERO; x.len()];
        <f16 as KvElement>::round_slice(&mut got, &mut scratch);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let halves: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let mut wide = vec![0f32; halves.len()];
        <f16 as KvElement>::widen(&halves, &mut wide);
        assert_eq!(
            wide.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    fn naive(q: &[f32], k: &[f32], v: &[f32], pos: usize, d: usize) -> Vec<f32> {
        let scores: Vec<f32> = (0..=pos)
            .map(|p| (0..d).map(|j| q[j] * k[p * d + j]).sum::<f32>() / (d as f32).sqrt())
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = w.iter().sum();
        (0..d)
            .map(|j| (0..=pos).map(|p| w[p] * v[p * d + j]).sum::<f32>() / total)
            .collect()
    }

    fn check<T: KvElement>(tol: f32) {
        let (d, ctx, bs) = (32, 11, 4);
        let val = |i: usize| ((i * 7919 % 97) as f32 / 97.0) - 0.5;
        let k: Vec<f32> = (0..ctx * d).map(val).collect();
        let v: Vec<f32> = (0..ctx * d).map(|i| val(i + 13)).collect();
        let q: Vec<f32> = (0..2 * d).map(|i| val(i + 5)).collect();
        let (kt, vt): (Vec<T>, Vec<T>) = (
            k.iter().map(|&x| T::from_f32(x)).collect(),
            v.iter().map(|&x| T::from_f32(x)).collect(),
        );
        // Blocks of 4 rows, the last one partly filled.
        let kb: Vec<&[T]> = kt.chunks(bs * d).collect();
        let vb: Vec<&[T]> = vt.chunks(bs * d).collect();
        let mut out = vec![0f32; 2 * d];
        let shape = HeadShape {
            heads: 1,
            kv_heads: 1,
            head_dim: d,
        };
        paged_attention(
            &q,
            &[4, 10],
            KvBlocks {
                blocks: &kb,
                block_size: bs,
            },
            KvBlocks {
                blocks: &vb,
                block_size: bs,
            },
            shape,
            &mut out,
        );
        for (i, pos) in [(0, 4), (1, 10)] {
            let want = naive(&q[i * d..(i + 1) * d], &k, &v, pos, d);
            for (a, b) in out[i * d..(i + 1) * d].iter().zip(&want) {
                assert!((a - b).abs() < tol, "query {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn f32_cache_matches_naive_softmax_attention_across_blocks() {
        check::<f32>(1e-5);
    }

    #[test]
    fn f16_cache_stays_within_half_precision() {
        check::<f16>(5e-3);
    }

    #[test]
    fn a_query_row_does_not_depend_on_its_batch() {
        let d = 16;
        let k: Vec<f32> = (0..8 * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let v: Vec<f32> = (0..8 * d).map(|i| (i as f32 * 0.11).cos()).collect();
        let q: Vec<f32> = (0..3 * d).map(|i| (i as f32 * 0.23).sin()).collect();
        let blocks = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
        let (k16, v16) = (blocks(&k), blocks(&v));
        let (kb, vb) = ([k16.as_slice()], [v16.as_slice()]);
        let shape = HeadShape {
            heads: 1,
            kv_heads: 1,
            head_dim: d,
        };
        let run = |q: &[f32], pos: &[usize]| {
            let mut out = vec![0f32; q.len()];
            let kv = |b| KvBlocks {
                blocks: b,
                block_size: 8,
            };
            paged_attention(q, pos, kv(&kb), kv(&vb), shape, &mut out);
            out
        };
        let together = run(&q, &[5, 6, 7]);
        let alone = run(&q[2 * d..], &[7]);
        assert_eq!(together[2 * d..], alone[..]);
    }
}
