//! Causal attention over a KV cache stored in blocks (the PagedAttention layout),
//! following the shape of vLLM's CPU kernel: parallel over token × KV head (the query heads
//! sharing it together), keys read block by block through the sequence's block list, online
//! softmax, weighted sum of V.
//!
//! The cache element decides the arithmetic. With an f32 cache everything is f32. With an
//! f16 cache the kernel rounds as llama.cpp's CPU flash attention does — the query to f16,
//! q·k accumulated in f32, the V accumulator kept in f16 — so GGUF models reproduce
//! llama.cpp's tokens. Each (query, head) reduces its keys in position order whatever else
//! shares the batch, so results are batch-invariant.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use crate::cpu;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod expf;

/// A KV cache element type.
pub trait KvElement: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// Widens a row into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Narrows a row into `dst` (same length), rounding to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// Rounds every value of `x` to this precision and back, using `scratch` (same length).
    fn round_slice(x: &mut [f32], scratch: &mut [Self]);
    /// A vectorized kernel for one (query, head) with `head_dim` values per head, if this
    /// element type and CPU have one; it must compute exactly what the portable loop does.
    fn head_kernel(_head_dim: usize) -> Option<HeadKernel<Self>> {
        None
    }
}

/// Attention of the query heads that share one KV head (1 to [`MAX_GROUP`] of them, each
/// `head_dim` values) over positions `0..=job.last`: reads the rounded queries side by side,
/// writes the heads' outputs side by side.
pub type HeadKernel<T> = fn(&[f32], HeadJob<'_, T>, &mut [f32]);

/// What a head kernel reads besides the queries.
#[derive(Debug, Clone, Copy)]
pub struct HeadJob<'a, T> {
    /// The sequence's keys in this layer.
    pub keys: KvBlocks<'a, T>,
    /// The sequence's values in this layer.
    pub values: KvBlocks<'a, T>,
    /// The KV head.
    pub head: usize,
    /// The last position attended to.
    pub last: usize,
    /// The factor applied to each q·k.
    pub scale: f32,
    /// Whether the kernel asks for each chunk's next key and value rows ahead of reading
    /// them: for rows that must come from memory, as a decode step's do (it reads each row
    /// once). A prompt's tokens after its first meet rows already in the caches, and asking
    /// again only costs them time (one layer's attention over a 1024-token prompt, Zen 5,
    /// 2 threads: 49–50 ms asking for every token, 42–43 asking for the first).
    pub prefetch: bool,
}

/// Buffers a task reuses from one (token, KV head) unit to the next: the rounded queries,
/// the rounding scratch (for the queries, and the portable loop's accumulator), and for the
/// portable loop the widened key and value rows.
struct Scratch<T> {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    round: Vec<T>,
}

impl KvElement for f32 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn round_slice(_: &mut [f32], _: &mut [Self]) {}
}

impl KvElement for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = cpu::detect().avx2() {
            return avx2::widen(cpu, src, dst);
        }
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = cpu::detect().avx2() {
            return avx2::narrow(cpu, src, dst);
        }
        dst.convert_from_f32_slice(src);
    }
    fn head_kernel(head_dim: usize) -> Option<HeadKernel<Self>> {
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = cpu::detect();
            if let Some(cpu) = cpu.avx512() {
                return avx512::head_kernel(cpu, head_dim);
            }
            if let Some(cpu) = cpu.avx2() {
                return avx2::head_kernel(cpu, head_dim);
            }
        }
        let _ = head_dim;
        None
    }
    fn round_slice(x: &mut [f32], scratch: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = cpu::detect().avx2() {
            return avx2::round(cpu, x);
        }
        scratch.convert_from_f32_slice(x);
        scratch.convert_to_f32_slice(x);
    }
}

/// One sequence's keys (or values) in one layer: blocks in position order, each holding
/// `block_size` positions of every KV head, head by head (`[kv_head][position][head_dim]`,
/// see [`head_row`]), so the rows one attention task reads follow each other in memory.
#[derive(Debug, Clone, Copy)]
pub struct KvBlocks<'a, T> {
    /// The sequence's blocks, in position order.
    pub blocks: &'a [&'a [T]],
    /// Positions per block.
    pub block_size: usize,
}

/// Where KV head `head`'s row (`head_dim` values) for position `at` of a block starts in
/// the block.
pub fn head_row(block_size: usize, head_dim: usize, head: usize, at: usize) -> usize {
    (head * block_size + at) * head_dim
}

impl<T> KvBlocks<'_, T> {
    /// KV head `head`'s rows of `d` values at positions `from..from + n`, in order, walking
    /// the blocks instead of dividing each position by the block size.
    fn rows(
        &self,
        head: usize,
        d: usize,
        from: usize,
        n: usize,
    ) -> impl Iterator<Item = &[T]> + '_ {
        let (mut block, mut at) = (from / self.block_size, from % self.block_size);
        let base = head_row(self.block_size, d, head, 0);
        (0..n).map(move |_| {
            let row = &self.blocks[block][base + at * d..base + (at + 1) * d];
            at += 1;
            if at == self.block_size {
                (block, at) = (block + 1, 0);
            }
            row
        })
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

/// Most query heads per KV head a [`HeadKernel`] serves in one pass (wider groups are
/// split).
pub const MAX_GROUP: usize = 4;

/// One sequence's share of a batched attention call: its cache and how many consecutive
/// query rows of the batch are its tokens.
#[derive(Debug, Clone, Copy)]
pub struct SeqKv<'a, T> {
    /// The sequence's keys in this layer.
    pub keys: KvBlocks<'a, T>,
    /// The sequence's values in this layer.
    pub values: KvBlocks<'a, T>,
    /// Query rows (tokens) the sequence has in the batch.
    pub tokens: usize,
}

/// Writes `out[i, h, :]` = softmax(q_i,h · K[0..=positions[i]] / sqrt(d)) · V for every
/// query row `i` of a whole step (`q` and `out` are `[tokens, heads * head_dim]`), each row
/// over the cache of the sequence it belongs to: the rows of `seqs` follow each other in
/// `q` and `positions`, and every (token, KV head) of every sequence is one task of a single
/// parallel pass, so a decode step of many short sequences costs one dispatch.
pub fn paged_attention_batch<T: KvElement>(
    q: &[f32],
    positions: &[usize],
    seqs: &[SeqKv<'_, T>],
    shape: HeadShape,
    out: &mut [f32],
) {
    attention_with(
        q,
        positions,
        seqs,
        shape,
        out,
        T::head_kernel(shape.head_dim),
    );
}

/// [`paged_attention_batch`] with a given head kernel, or the portable loop (`None`).
fn attention_with<T: KvElement>(
    q: &[f32],
    positions: &[usize],
    seqs: &[SeqKv<'_, T>],
    shape: HeadShape,
    out: &mut [f32],
    kernel: Option<HeadKernel<T>>,
) {
    let HeadShape {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let owner: Vec<usize> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| std::iter::repeat_n(s, seq.tokens))
        .collect();
    // Tasks of at least ~32k multiply-adds: small steps cost less than waking a thread.
    let work = positions.iter().map(|p| p + 1).sum::<usize>() * heads * d;
    let rows = (positions.len() * heads).max(1);
    let rows_per_task = ((1usize << 15) * rows).div_ceil(work.max(1)).clamp(1, rows);
    // The unit of work: `chunk` query heads of one token sharing a KV head, so each key and
    // value row is converted once for all of them (and, in a head kernel, their chains
    // interleave).
    let chunk = (1..=MAX_GROUP.min(group))
        .rev()
        .find(|c| group.is_multiple_of(*c))
        .unwrap_or(1);
    let one = |scratch: &mut Scratch<T>, unit: usize, o: &mut [f32]| {
        let row = unit * chunk;
        let (i, h) = (row / heads, row % heads);
        // A sequence's first query row of the step brings its rows into the caches; its
        // other rows (a prompt's) meet them there.
        let prefetch = i == 0 || owner[i] != owner[i - 1];
        let SeqKv { keys, values, .. } = seqs[owner[i]];
        scratch.q.clear();
        scratch.q.extend_from_slice(&q[row * d..(row + chunk) * d]);
        scratch.round.resize(chunk * d, T::default());
        T::round_slice(&mut scratch.q, &mut scratch.round);
        let job = HeadJob {
            keys,
            values,
            head: h / group,
            last: positions[i],
            scale,
            prefetch,
        };
        match kernel {
            Some(kernel) => kernel(&scratch.q, job, o),
            None => portable_heads(job, o, scratch),
        }
    };
    let units_per_task = rows_per_task.div_ceil(chunk);
    let scratch = || Scratch {
        q: Vec::new(),
        k: vec![0f32; d],
        v: vec![0f32; d],
        round: vec![T::default(); d],
    };
    out.par_chunks_mut(units_per_task * chunk * d)
        .enumerate()
        .for_each_init(scratch, |scratch, (t, part)| {
            for (j, o) in part.chunks_mut(chunk * d).enumerate() {
                one(scratch, t * units_per_task + j, o);
            }
        });
}

/// The query heads of `scratch.q` (1 to [`MAX_GROUP`], `head_dim` values each, side by side)
/// over the KV head they share, one position at a time: the portable loop that every vector
/// kernel must equal bit for bit. Each key and value row is widened once for all the heads;
/// each head's operations are those of a loop over it alone, in the same order, so a head's
/// result does not depend on the group it shares. Writes the heads' outputs side by side.
fn portable_heads<T: KvElement>(job: HeadJob<'_, T>, out: &mut [f32], scratch: &mut Scratch<T>) {
    let Scratch { q, k, v, round } = scratch;
    let d = k.len();
    let (heads, n) = (out.len() / d, job.last + 1);
    assert!(
        (1..=MAX_GROUP).contains(&heads) && out.len() == heads * d && q.len() == out.len(),
        "a group of 1 to {MAX_GROUP} query heads of {d} values"
    );
    let round = &mut round[..d];
    out.iter_mut().for_each(|a| *a = 0.0);
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    // Per head: the factor its accumulator was rescaled by, and its value row's weight.
    let mut weights = [(1f32, 1f32); MAX_GROUP];
    let rows = job.keys.rows(job.head, d, 0, n);
    for (key, value) in rows.zip(job.values.rows(job.head, d, 0, n)) {
        T::widen(key, k);
        for (h, (acc, q)) in out.chunks_exact_mut(d).zip(q.chunks_exact(d)).enumerate() {
            let s = dot(q, k) * job.scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > max[h] {
                ms = (max[h] - s).exp();
                max[h] = s;
                acc.iter_mut().for_each(|a| *a *= ms);
                T::round_slice(acc, round);
            } else {
                vs = (s - max[h]).exp();
            }
            weights[h] = (ms, vs);
        }
        T::widen(value, v);
        for (h, acc) in out.chunks_exact_mut(d).enumerate() {
            let (ms, vs) = weights[h];
            for (a, &x) in acc.iter_mut().zip(v.iter()) {
                *a = x.mul_add(vs, *a);
            }
            T::round_slice(acc, round);
            sum[h] = sum[h].mul_add(ms, vs);
        }
    }
    for (acc, &sum) in out.chunks_exact_mut(d).zip(&sum) {
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        acc.iter_mut().for_each(|a| *a *= inv);
    }
}

/// Positions a vector head kernel handles per pass.
#[cfg(target_arch = "x86_64")]
const CHUNK: usize = 16;

/// Asks for the cache lines of the key and value rows of the chunk after the one from
/// position `first` (rows of `d` values), while that one computes, where the job says so
/// ([`HeadJob::prefetch`]): a long context is far beyond the caches, and a decode step
/// reads each row once.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse")]
fn prefetch_next_chunk<T>(job: &HeadJob<'_, T>, d: usize, first: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if !job.prefetch {
        return;
    }
    let ahead = CHUNK.min((job.last + 1).saturating_sub(first + CHUNK));
    for rows in [&job.keys, &job.values] {
        for row in rows.rows(job.head, d, first + CHUNK, ahead) {
            for line in row.chunks(64 / size_of::<T>().max(1)) {
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
            }
        }
    }
}

/// Whether a value row's softmax weight `w` is subnormal: where the vector head kernels work
/// out the multiply-add and its f16 rounding without subnormal arithmetic, which costs a
/// microcode assist per instruction on Intel CPUs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn subnormal_weight(w: f32) -> bool {
    w > 0.0 && w < f32::MIN_POSITIVE
}

/// The online-softmax bookkeeping of a vector head kernel's chunk of `n` positions, in
/// position order: for each head and position, the factor the accumulator is rescaled by
/// (`ms`: below 1 where the position raised the maximum; where it is exactly 1, rescaling
/// an accumulator of f16 values changes nothing, so the kernels skip it) and the weight of
/// its value row (`vs`); updates the running maximum and sum exactly as
/// [`portable_heads`] does. The exponentials' arguments only depend on the running
/// maximum, so they are found first and then handed to `exp` (`expf` of each lane) all at
/// once. A chunk where no score exceeds the maximum (most chunks after the first) takes a
/// shortcut with the same results: every argument is `s - max` and every `ms` is 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn softmax_chunk<const G: usize>(
    scores: &[[f32; CHUNK]; G],
    n: usize,
    max: &mut [f32; G],
    sum: &mut [f32; G],
    ms: &mut [[f32; CHUNK]; G],
    vs: &mut [[f32; CHUNK]; G],
    exp: impl Fn(&[f32; CHUNK]) -> [f32; CHUNK],
) {
    for g in 0..G {
        let top = max[g];
        // Without an early exit, so the comparisons run as one vector compare.
        if !scores[g][..n].iter().fold(false, |any, &s| any | (s > top)) {
            // The maximum stands for the whole chunk: what the loop below would compute
            // with `raised` false at every position.
            ms[g] = [1.0; CHUNK];
            vs[g] = exp(&scores[g].map(|s| s - top));
            continue;
        }
        let (mut args, mut raised) = ([0f32; CHUNK], [false; CHUNK]);
        for ((&s, arg), raised) in scores[g][..n].iter().zip(&mut args).zip(&mut raised) {
            *raised = s > max[g];
            if *raised {
                *arg = max[g] - s;
                max[g] = s;
            } else {
                *arg = s - max[g];
            }
        }
        let e = exp(&args);
        for j in 0..n {
            (ms[g][j], vs[g][j]) = if raised[j] { (e[j], 1.0) } else { (1.0, e[j]) };
        }
    }
    // Each head's running sum, in position order; the heads' chains of additions side by
    // side, so each waits on its own only (one head's after another's, and the comparisons
    // above one at a time, the example `attention -- 1024` took 86–89 ms where it now takes
    // 81–83, Zen 5, one thread). Where `ms` is 1, `sum · 1 + v` rounds once, as `sum + v`
    // does.
    for j in 0..n {
        for g in 0..G {
            sum[g] = sum[g].mul_add(ms[g][j], vs[g][j]);
        }
    }
}

/// q · k as ggml's AVX-512 `ggml_vec_dot_f16` sums it: 64 values at a time in four
/// 16-lane accumulators, folded (0+2)+(1+3), then the 16 lanes halved down to one; any
/// remainder is added one product at a time in f64.
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let whole = q.len() / 64 * 64;
    let mut acc = [[0f32; 16]; 4];
    // Sixteen lanes at a time, zipped, which the compiler turns into vector multiply-adds
    // (indexing the 64-lane state by `j * 16 + l`, it moved two lanes at a time).
    for (cq, ck) in q[..whole].chunks_exact(64).zip(k[..whole].chunks_exact(64)) {
        let sixteens = cq.chunks_exact(16).zip(ck.chunks_exact(16));
        for (lanes, (cq, ck)) in acc.iter_mut().zip(sixteens) {
            for ((lane, &x), &y) in lanes.iter_mut().zip(cq).zip(ck) {
                *lane = x.mul_add(y, *lane);
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

    /// Why a tier's kernel went unchecked.
    #[cfg(target_arch = "x86_64")]
    const NO_TIER: &str = "the CPU lacks, or FERRITE_CPU_TIER caps away, its tier:";

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_expf_equals_libm_bit_for_bit() {
        let cpu = cpu::detect();
        type Expf = Box<dyn Fn(&[f32; CHUNK]) -> [f32; CHUNK]>;
        let mut tiers: Vec<(&str, Expf)> = Vec::new();
        match cpu.avx512() {
            Some(cpu) => tiers.push(("AVX-512", Box::new(move |x| avx512::expf16(cpu, x)))),
            None => tell!("AVX-512 expf not checked: {NO_TIER} AVX-512"),
        }
        match cpu.avx2() {
            Some(cpu) => tiers.push(("AVX2", Box::new(move |x| avx2::expf16(cpu, x)))),
            None => tell!("AVX2 expf not checked: {NO_TIER} AVX2"),
        }
        // The edges of glibc's special cases, zeros, infinities, NaN, subnormals, then every
        // 4099th bit pattern of the whole float range.
        let edges = [
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            -f32::from_bits(1),
            -88.0,
            -87.5,
            -1.0,
            1.0,
        ];
        let near = [
            0x42b17217u32,
            0xc2cff1b4,
            0xc2ce8ecf,
            0x42b00000,
            0xc2b00000,
        ]
        .into_iter()
        .flat_map(|b| b - 2..=b + 2)
        .map(f32::from_bits);
        let sweep = (0..=u32::MAX).step_by(4099).map(f32::from_bits);
        let all: Vec<f32> = edges.into_iter().chain(near).chain(sweep).collect();
        for (tier, expf16) in &tiers {
            for chunk in all.chunks(CHUNK) {
                let mut x = [0f32; CHUNK];
                x[..chunk.len()].copy_from_slice(chunk);
                let got = expf16(&x);
                for (&x, &got) in x.iter().zip(&got) {
                    let want = x.exp();
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{tier} expf({x:e}) = {got:e}, libm says {want:e}"
                    );
                }
            }
        }
    }

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
        let mut narrow = vec![f16::ZERO; x.len()];
        <f16 as KvElement>::narrow(&x, &mut narrow);
        assert_eq!(
            narrow.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            halves.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let mut wide = vec![0f32; halves.len()];
        <f16 as KvElement>::widen(&halves, &mut wide);
        assert_eq!(
            wide.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Attention of one sequence's query rows.
    fn paged_attention<T: KvElement>(
        q: &[f32],
        positions: &[usize],
        keys: KvBlocks<'_, T>,
        values: KvBlocks<'_, T>,
        shape: HeadShape,
        out: &mut [f32],
    ) {
        let seq = SeqKv {
            keys,
            values,
            tokens: positions.len(),
        };
        paged_attention_batch(q, positions, &[seq], shape, out);
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
        let (mut kt, mut vt) = (vec![T::default(); k.len()], vec![T::default(); v.len()]);
        T::narrow(&k, &mut kt);
        T::narrow(&v, &mut vt);
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

    /// Value `i` of a fixed pattern in `-1.5..1.5`, varied by `salt`.
    fn val(i: usize, salt: usize) -> f32 {
        (((i * 7919 + salt) % 211) as f32 / 211.0 - 0.5) * 3.0
    }

    /// Position-major rows of `kv_heads * d` values laid out as the cache holds them:
    /// blocks of 16 positions, head by head, the last block padded.
    fn f16_cache(rows: &[f32], kv_heads: usize, d: usize) -> Vec<f16> {
        let width = kv_heads * d;
        let n = rows.len() / width;
        let mut out = vec![f16::ZERO; n.next_multiple_of(16) * width];
        for (pos, row) in rows.chunks(width).enumerate() {
            for (h, part) in row.chunks(d).enumerate() {
                let at = pos / 16 * 16 * width + head_row(16, d, h, pos % 16);
                for (o, &x) in out[at..at + d].iter_mut().zip(part) {
                    *o = f16::from_f32(x);
                }
            }
        }
        out
    }

    #[test]
    fn the_vector_head_kernels_equal_the_portable_loop_bit_for_bit() {
        // Widths with a kernel, grouped-query layouts (3 and 8 query heads per KV head) and
        // two sequences whose rows share one call: a prefill chunk and a decode.
        for (d, heads, kv_heads) in [(64, 9, 3), (128, 8, 1), (64, 4, 4), (256, 2, 2)] {
            let width = kv_heads * d;
            let cache_of = |rows: Vec<f32>| f16_cache(&rows, kv_heads, d);
            let cache = |salt: usize, rows: usize| {
                cache_of((0..rows * width).map(|i| val(i, salt)).collect())
            };
            let (k0, v0, k1, v1) = (cache(1, 40), cache(2, 40), cache(3, 24), cache(4, 24));
            // A third sequence whose keys grow with the position: a head whose query sums
            // positive raises its maximum in every chunk, one whose query sums negative never
            // after the first (the two softmax paths of the vector kernel), over a partial
            // last chunk.
            let ramp = cache_of(
                (0..100 * width)
                    .map(|i| (i / width) as f32 / 40.0)
                    .collect(),
            );
            let v2 = cache(6, 100);
            fn blocks(x: &[f16], rows: usize) -> Vec<&[f16]> {
                x.chunks(rows).collect()
            }
            let r = 16 * width;
            let (kb0, vb0) = (blocks(&k0, r), blocks(&v0, r));
            let (kb1, vb1) = (blocks(&k1, r), blocks(&v1, r));
            let (kb2, vb2) = (blocks(&ramp, r), blocks(&v2, r));
            let kv = |b| KvBlocks {
                blocks: b,
                block_size: 16,
            };
            let seqs = [
                SeqKv {
                    keys: kv(&kb0),
                    values: kv(&vb0),
                    tokens: 3,
                },
                SeqKv {
                    keys: kv(&kb1),
                    values: kv(&vb1),
                    tokens: 1,
                },
                SeqKv {
                    keys: kv(&kb2),
                    values: kv(&vb2),
                    tokens: 1,
                },
            ];
            let positions = [37, 38, 39, 23, 98];
            let q: Vec<f32> = (0..5 * heads * d).map(|i| val(i, 5)).collect();
            let shape = HeadShape {
                heads,
                kv_heads,
                head_dim: d,
            };
            let what = format!("head_dim {d}, {heads}/{kv_heads} heads");
            assert_kernels_equal_portable(&q, &positions, &seqs, shape, &what);
        }
    }

    #[test]
    fn subnormal_weights_and_signed_zeros_keep_the_portable_loops_bits() {
        // Scores spread far below the maximum give weights `exp(s - max)` below 2^-126 (the
        // kernels add those without subnormal arithmetic), next to weights of zero, normal
        // ones and a raised maximum; value rows hold zeros of both signs, f16 subnormals,
        // infinities in one row, so accumulators sit at +0 and -0 when the tiny weights
        // arrive.
        let (d, heads, n) = (64, 4, 80);
        // Head h's query is c_h at value 0, so its score at position p is c_h · x_p / 8.
        let c = [8.0f32, 4.0, 16.0, 8.5];
        let x = |p: usize| -> f32 {
            match p {
                0 => 0.0,
                37 => 3.0,
                p if p % 7 == 3 => -1.5,
                p if p % 11 == 5 => -200.0,
                p => -86.0 - (p % 19) as f32,
            }
        };
        let keys: Vec<f32> = (0..n)
            .flat_map(|p| (0..d).map(move |i| if i == 0 { x(p) } else { 0.0 }))
            .collect();
        let values: Vec<f32> = (0..n)
            .flat_map(|p| {
                (0..d).map(move |i| match (p, i % 8) {
                    (0, 0..=3) => 0.0,
                    (0, 4..=6) => -0.0,
                    (50, 7) => f32::INFINITY,
                    (_, 0) => -0.0,
                    (_, 1) => 0.0,
                    (_, 2) => 6.0e-8,
                    (_, 3) => -6.0e-8,
                    _ => val(p * d + i, 9),
                })
            })
            .collect();
        let (kc, vc) = (f16_cache(&keys, 1, d), f16_cache(&values, 1, d));
        let r = 16 * d;
        let (kb, vb): (Vec<&[f16]>, Vec<&[f16]>) = (kc.chunks(r).collect(), vc.chunks(r).collect());
        let kv = |b| KvBlocks {
            blocks: b,
            block_size: 16,
        };
        let seqs = [SeqKv {
            keys: kv(&kb),
            values: kv(&vb),
            tokens: n,
        }];
        let positions: Vec<usize> = (0..n).collect();
        let q: Vec<f32> = (0..n)
            .flat_map(|_| {
                c.iter()
                    .flat_map(|&c| (0..d).map(move |i| if i == 0 { c } else { 0.0 }))
            })
            .collect();
        // The case this test is for: the first head (the one a group of one keeps) meets
        // weights `exp(s - max)` below 2^-126 at many positions, its running maximum taken
        // as the loop takes it (scale 1/8).
        let mut max = f32::NEG_INFINITY;
        let subnormal_weights = (0..n)
            .filter(|&p| {
                let s = c[0] * x(p) / 8.0;
                max = max.max(s);
                let w = (s - max).exp();
                w > 0.0 && w < f32::MIN_POSITIVE
            })
            .count();
        assert!(
            subnormal_weights >= 20,
            "{subnormal_weights} subnormal weights"
        );
        for group in 1..=heads {
            let shape = HeadShape {
                heads: group,
                kv_heads: 1,
                head_dim: d,
            };
            let q: Vec<f32> = q
                .chunks(heads * d)
                .flat_map(|row| &row[..group * d])
                .copied()
                .collect();
            let what = format!("{group} heads");
            assert_kernels_equal_portable(&q, &positions, &seqs, shape, &what);
        }
    }

    /// Asserts that every vector head kernel this CPU runs gives the portable loop's bits for
    /// this attention call (`what` names the case).
    fn assert_kernels_equal_portable(
        q: &[f32],
        positions: &[usize],
        seqs: &[SeqKv<'_, f16>],
        shape: HeadShape,
        what: &str,
    ) {
        let run = |k: Option<HeadKernel<f16>>| {
            let mut out = vec![0f32; q.len()];
            attention_with(q, positions, seqs, shape, &mut out, k);
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let portable = run(None);
        for (tier, kernel) in vector_head_kernels(shape.head_dim) {
            assert_eq!(run(Some(kernel)), portable, "{tier} kernel, {what}");
        }
    }

    /// Each vector head kernel for heads of `d` values that this CPU runs, by tier (all of
    /// them, not only the one attention picks); says which tiers it could not check.
    #[cfg(target_arch = "x86_64")]
    fn vector_head_kernels(d: usize) -> Vec<(&'static str, HeadKernel<f16>)> {
        let mut kernels = Vec::new();
        let cpu = cpu::detect();
        match cpu.avx512() {
            Some(cpu) => kernels.extend(avx512::head_kernel(cpu, d).map(|k| ("AVX-512", k))),
            None => tell!("AVX-512 head kernel not checked: {NO_TIER} AVX-512"),
        }
        match cpu.avx2() {
            Some(cpu) => kernels.extend(avx2::head_kernel(cpu, d).map(|k| ("AVX2", k))),
            None => tell!("AVX2 head kernel not checked: {NO_TIER} AVX2"),
        }
        kernels
    }

    /// No architecture but x86-64 has vector head kernels: says so.
    #[cfg(not(target_arch = "x86_64"))]
    fn vector_head_kernels(_d: usize) -> Vec<(&'static str, HeadKernel<f16>)> {
        tell!("no vector head kernel on this architecture: the portable loop is all");
        Vec::new()
    }

    #[test]
    fn the_portable_loop_gives_each_head_of_a_group_what_it_gives_it_alone() {
        // 8 query heads on 2 KV heads (groups of 4) and 9 on 3 (groups of 3), over 40
        // positions in blocks of 16, with an f16 cache: the grouped loop against the loop
        // over each head by itself.
        for (heads, kv_heads) in [(8, 2), (9, 3)] {
            let (d, n) = (64, 40);
            let width = kv_heads * d;
            let cache = |salt: usize| {
                let rows: Vec<f32> = (0..n * width).map(|i| val(i, salt)).collect();
                f16_cache(&rows, kv_heads, d)
            };
            let (k, v) = (cache(1), cache(2));
            let (kb, vb): (Vec<&[f16]>, Vec<&[f16]>) = (
                k.chunks(16 * width).collect(),
                v.chunks(16 * width).collect(),
            );
            let kv = |b| KvBlocks {
                blocks: b,
                block_size: 16,
            };
            let q: Vec<f32> = (0..heads * d).map(|i| val(i, 3)).collect();
            let shape = HeadShape {
                heads,
                kv_heads,
                head_dim: d,
            };
            let seqs = [SeqKv {
                keys: kv(&kb),
                values: kv(&vb),
                tokens: 1,
            }];
            let mut grouped = vec![0f32; q.len()];
            attention_with(&q, &[n - 1], &seqs, shape, &mut grouped, None);
            let mut scratch = Scratch {
                q: Vec::new(),
                k: vec![0f32; d],
                v: vec![0f32; d],
                round: vec![f16::ZERO; d],
            };
            for h in 0..heads {
                scratch.q = q[h * d..(h + 1) * d].to_vec();
                f16::round_slice(&mut scratch.q, &mut scratch.round);
                let job = HeadJob {
                    keys: kv(&kb),
                    values: kv(&vb),
                    head: h / (heads / kv_heads),
                    last: n - 1,
                    scale: 1.0 / (d as f32).sqrt(),
                    prefetch: true,
                };
                let mut alone = vec![0f32; d];
                portable_heads(job, &mut alone, &mut scratch);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&grouped[h * d..(h + 1) * d]),
                    bits(&alone),
                    "head {h} of {heads} on {kv_heads}"
                );
            }
        }
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
