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
#[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

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
        #[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
        f16c::widen(src, dst);
        #[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        #[cfg(all(target_arch = "x86_64", target_feature = "f16c"))]
        f16c::narrow(src, dst);
        #[cfg(not(all(target_arch = "x86_64", target_feature = "f16c")))]
        dst.convert_from_f32_slice(src);
    }
    fn head_kernel(head_dim: usize) -> Option<HeadKernel<Self>> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return match head_dim {
                64 => Some(avx512::heads::<4>),
                128 => Some(avx512::heads::<8>),
                256 => Some(avx512::heads::<16>),
                _ => None,
            };
        }
        let _ = head_dim;
        None
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

    /// `dst[i] = one(src[i])` over the shorter slice's length: `eight` takes exactly eight
    /// of each at a time, `one` the rest.
    #[inline]
    fn by_eights<S: Copy, D>(
        src: &[S],
        dst: &mut [D],
        eight: impl Fn(&[S], &mut [D]),
        one: impl Fn(S) -> D,
    ) {
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        for (s, d) in src[..whole]
            .chunks_exact(8)
            .zip(dst[..whole].chunks_exact_mut(8))
        {
            eight(s, d);
        }
        for (s, d) in src[whole..n].iter().zip(&mut dst[whole..n]) {
            *d = one(*s);
        }
    }

    /// Widens `src` into `dst` (same length).
    #[inline]
    pub fn widen(src: &[f16], dst: &mut [f32]) {
        // SAFETY (both blocks): F16C and AVX are enabled at compile time (this module's cfg);
        // `by_eights` hands over eight values of each slice, so every unaligned load and store
        // touches exactly their 16 (f16) or 32 (f32) bytes.
        let eight = |s: &[f16], d: &mut [f32]| unsafe {
            _mm256_storeu_ps(
                d.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast())),
            );
        };
        by_eights(src, dst, eight, f16::to_f32);
    }

    /// Narrows `src` into `dst` (same length), rounding to nearest even.
    #[inline]
    pub fn narrow(src: &[f32], dst: &mut [f16]) {
        // SAFETY: as in `widen`.
        let eight = |s: &[f32], d: &mut [f16]| unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
            _mm_storeu_si128(d.as_mut_ptr().cast(), h);
        };
        by_eights(src, dst, eight, f16::from_f32);
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
    // value row is converted once for all of them and their chains interleave.
    let chunk = if kernel.is_some() {
        (1..=MAX_GROUP.min(group))
            .rev()
            .find(|c| group.is_multiple_of(*c))
            .unwrap_or(1)
    } else {
        1
    };
    let one = |scratch: &mut Scratch<T>, unit: usize, o: &mut [f32]| {
        let row = unit * chunk;
        let (i, h) = (row / heads, row % heads);
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
        };
        match kernel {
            Some(kernel) => kernel(&scratch.q, job, o),
            None => portable_head(job, o, scratch),
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

/// One query head (`scratch.q`) over its KV head, one position at a time: the portable loop
/// that every vector kernel must equal bit for bit. Writes the head's output to `acc`.
fn portable_head<T: KvElement>(job: HeadJob<'_, T>, acc: &mut [f32], scratch: &mut Scratch<T>) {
    let (d, n) = (acc.len(), job.last + 1);
    let Scratch { q, k, v, round } = scratch;
    acc.iter_mut().for_each(|a| *a = 0.0);
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    let rows = job.keys.rows(job.head, d, 0, n);
    for (key, value) in rows.zip(job.values.rows(job.head, d, 0, n)) {
        T::widen(key, k);
        let s = dot(q, k) * job.scale;
        let (mut ms, mut vs) = (1f32, 1f32);
        if s > max {
            ms = (max - s).exp();
            max = s;
            acc.iter_mut().for_each(|a| *a *= ms);
            T::round_slice(acc, round);
        } else {
            vs = (s - max).exp();
        }
        T::widen(value, v);
        for (a, &x) in acc.iter_mut().zip(v.iter()) {
            *a = x.mul_add(vs, *a);
        }
        T::round_slice(acc, round);
        sum = sum.mul_add(ms, vs);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    acc.iter_mut().for_each(|a| *a *= inv);
}

/// The f16-cache head kernel with AVX-512: the query, the V accumulator and each key and
/// value row live in `N` 16-lane registers (`head_dim = 16 N`), converted with the F16C
/// instructions straight from the cache. Every operation is the portable loop's — the same
/// q·k lanes and reduction tree as [`dot`], the same online softmax (its exponentials by a
/// vector copy of glibc's `expf`), fused multiply-adds and f16 rounding of the accumulator —
/// so results are bit for bit equal.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::HeadJob;
    use crate::kernels::fold::{halves, pairs, quarters};

    /// Lane `p`: the sum of `z[p]`'s sixteen lanes as GCC expands `_mm512_reduce_add_ps`
    /// (what ggml's f16 dot ends with; see the portable `reduce16`) — lanes `i` and `i + 8`,
    /// then `i` and `i + 4`, then `i` and `i + 2`, then the last two — for all sixteen at
    /// once: each lane adds the same pairs in the same order, but the sixteen reductions
    /// share their shuffles and additions.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16x16(z: &[__m512; 16]) -> __m512 {
        let t: [__m512; 8] = std::array::from_fn(|k| halves(z[2 * k], z[2 * k + 1]));
        let u: [__m512; 4] = std::array::from_fn(|k| quarters(t[2 * k], t[2 * k + 1]));
        // Each quarter: two lanes of a position of `u[0]` (or `u[2]`), two of `u[1]` (`u[3]`).
        let (v0, v1) = (pairs(u[0], u[1]), pairs(u[2], u[3]));
        // The last pair of each: lane 4q + s holds position q + 4s.
        let w = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(v0, v1),
            _mm512_shuffle_ps::<0b11_01_11_01>(v0, v1),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, w)
    }

    /// Sixteen f16 widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load16(row: &[f16], at: usize) -> __m512 {
        assert!(at + 16 <= row.len());
        // SAFETY: the assertion keeps the 32 bytes read inside `row`; loadu is unaligned.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(row.as_ptr().add(at).cast()) })
    }

    /// Rounds sixteen f32 to f16 and back (round to nearest even).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn round16(x: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }

    /// Positions handled per pass of [`heads_avx512`].
    pub(super) const CHUNK: usize = 16;

    /// glibc's `expf` (2.28 and later, the variant it picks on CPUs with FMA) eight lanes at
    /// a time: the same 32-entry table of `2^(i/32)`, cubic polynomial in double precision,
    /// fused multiply-adds and special cases, so every lane equals what libm returns (which
    /// llama.cpp's softmax calls) bit for bit.
    mod expf {
        use std::arch::x86_64::*;

        /// `32 / ln 2`.
        const INV_LN2_N: u64 = 0x40471547652b82fe;
        /// `1.5 · 2^52`: adding it rounds to an integer held in the low mantissa bits.
        const SHIFT: u64 = 0x4338000000000000;
        /// The polynomial's coefficients of `r^3`, `r^2` and `r`.
        const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];
        /// `2^(i/32)` with `i << 47` subtracted from its bits.
        const T: [u64; 32] = [
            0x3ff0000000000000,
            0x3fefd9b0d3158574,
            0x3fefb5586cf9890f,
            0x3fef9301d0125b51,
            0x3fef72b83c7d517b,
            0x3fef54873168b9aa,
            0x3fef387a6e756238,
            0x3fef1e9df51fdee1,
            0x3fef06fe0a31b715,
            0x3feef1a7373aa9cb,
            0x3feedea64c123422,
            0x3feece086061892d,
            0x3feebfdad5362a27,
            0x3feeb42b569d4f82,
            0x3feeab07dd485429,
            0x3feea47eb03a5585,
            0x3feea09e667f3bcd,
            0x3fee9f75e8ec5f74,
            0x3feea11473eb0187,
            0x3feea589994cce13,
            0x3feeace5422aa0db,
            0x3feeb737b0cdc5e5,
            0x3feec49182a3f090,
            0x3feed503b23e255d,
            0x3feee89f995ad3ad,
            0x3feeff76f2fb5e47,
            0x3fef199bdd85529c,
            0x3fef3720dcef9069,
            0x3fef5818dcfba487,
            0x3fef7c97337b9b5f,
            0x3fefa4afa2a490da,
            0x3fefd0765b6e4540,
        ];
        /// Above this (`log 2^128`) the result overflows to infinity.
        const OVERFLOW: u32 = 0x42b17217;
        /// Below this (`log 2^-150`) the result is zero.
        const UNDERFLOW: u32 = 0xc2cff1b4;
        /// Below this (`log 2^-149`) and not below [`UNDERFLOW`], the smallest subnormal.
        const MAY_UNDERFLOW: u32 = 0xc2ce8ecf;

        /// `expf` of each lane of `x`.
        #[target_feature(enable = "avx512f")]
        pub(super) fn expf8(x: __m256) -> __m256 {
            // SAFETY: each load reads eight u64 at 0, 8, 16 or 24, inside the 32 of `T`.
            let table = unsafe {
                let t = T.as_ptr();
                [
                    _mm512_loadu_si512(t.cast()),
                    _mm512_loadu_si512(t.add(8).cast()),
                    _mm512_loadu_si512(t.add(16).cast()),
                    _mm512_loadu_si512(t.add(24).cast()),
                ]
            };
            let inv = _mm512_set1_pd(f64::from_bits(INV_LN2_N));
            let shift = _mm512_set1_pd(f64::from_bits(SHIFT));
            let xd = _mm512_cvtps_pd(x);
            // k = round(x · 32/ln2) and r = x · 32/ln2 - k, each one fused multiply-add.
            let kd = _mm512_fmadd_pd(inv, xd, shift);
            let ki = _mm512_castpd_si512(kd);
            let kd = _mm512_sub_pd(kd, shift);
            let r = _mm512_fmsub_pd(inv, xd, kd);
            // s = 2^(k/32): the table entry for k mod 32, k / 32 added to the exponent.
            let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
            let low = _mm512_permutex2var_epi64(table[0], idx, table[1]);
            let high = _mm512_permutex2var_epi64(table[2], idx, table[3]);
            let upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
            let t = _mm512_mask_blend_epi64(upper, low, high);
            let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
            let c0 = _mm512_set1_pd(f64::from_bits(C[0]));
            let c1 = _mm512_set1_pd(f64::from_bits(C[1]));
            let c2 = _mm512_set1_pd(f64::from_bits(C[2]));
            let z = _mm512_fmadd_pd(r, c0, c1);
            let r2 = _mm512_mul_pd(r, r);
            let y = _mm512_fmadd_pd(r, c2, _mm512_set1_pd(1.0));
            let y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s);
            let out = _mm512_cvtpd_ps(y);
            // The special cases glibc takes out of the main path.
            let under = _mm256_set1_ps(f32::from_bits(UNDERFLOW));
            let may_under = _mm256_set1_ps(f32::from_bits(MAY_UNDERFLOW));
            let overflow = _mm256_set1_ps(f32::from_bits(OVERFLOW));
            let zero = _mm256_cmp_ps::<_CMP_LT_OQ>(x, under);
            let tiny = _mm256_andnot_ps(zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x, may_under));
            let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, overflow);
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
            let out = _mm256_blendv_ps(out, _mm256_setzero_ps(), zero);
            let out = _mm256_blendv_ps(out, _mm256_set1_ps(f32::from_bits(1)), tiny);
            let out = _mm256_blendv_ps(out, _mm256_set1_ps(f32::INFINITY), over);
            _mm256_blendv_ps(out, _mm256_add_ps(x, x), nan)
        }

        /// [`expf8`] over a chunk of arguments.
        #[target_feature(enable = "avx512f")]
        pub(super) fn expf_chunk(x: &[f32; super::CHUNK]) -> [f32; super::CHUNK] {
            let mut out = [0f32; super::CHUNK];
            for (o, x) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
                // SAFETY: each chunk holds exactly eight f32; loads and stores are unaligned.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), expf8(_mm256_loadu_ps(x.as_ptr()))) };
            }
            out
        }
    }

    /// The online-softmax bookkeeping of one chunk, in position order: for each head and
    /// position, the factor the accumulator is rescaled by (`ms`: below 1 where the position
    /// raised the maximum; where it is exactly 1, rescaling an accumulator of f16 values
    /// changes nothing, so the kernel skips it) and the weight of its value row (`vs`);
    /// updates the running maximum and sum exactly as the single-position loop does. The
    /// exponentials' arguments only depend on the running maximum, so they are found first
    /// and then computed sixteen at a time. A chunk where no score exceeds the maximum (most
    /// chunks after the first) takes a shortcut with the same results: every argument is
    /// `s - max` in one vector subtraction and every `ms` is 1.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn softmax_chunk<const G: usize>(
        scores: &[[f32; CHUNK]; G],
        n: usize,
        max: &mut [f32; G],
        sum: &mut [f32; G],
        ms: &mut [[f32; CHUNK]; G],
        vs: &mut [[f32; CHUNK]; G],
    ) {
        let live: __mmask16 = if n >= CHUNK { !0 } else { (1 << n) - 1 };
        for g in 0..G {
            // SAFETY: `scores[g]` holds exactly sixteen f32; the load is unaligned.
            let s = unsafe { _mm512_loadu_ps(scores[g].as_ptr()) };
            let top = _mm512_set1_ps(max[g]);
            if _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(live, s, top) == 0 {
                // The maximum stands for the whole chunk: what the loop below would compute
                // with `raised` false at every position.
                let mut args = [0f32; CHUNK];
                // SAFETY: `args` holds exactly sixteen f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(args.as_mut_ptr(), _mm512_sub_ps(s, top)) };
                let e = expf::expf_chunk(&args);
                ms[g] = [1.0; CHUNK];
                vs[g] = e;
                for &v in &e[..n] {
                    // `sum · 1 + v` rounds once, as the fused multiply-add below does.
                    sum[g] += v;
                }
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
            let e = expf::expf_chunk(&args);
            for j in 0..n {
                let (m, v) = if raised[j] { (e[j], 1.0) } else { (1.0, e[j]) };
                ms[g][j] = m;
                vs[g][j] = v;
                sum[g] = sum[g].mul_add(m, v);
            }
        }
    }

    /// `G` query heads of `16 N` values against one KV head. Each head's arithmetic is
    /// exactly the single-head loop's; the heads only share the converted key and value rows.
    /// Positions go in chunks of [`CHUNK`], each in three passes: the scores (independent dot
    /// products, so they overlap), the softmax bookkeeping with its exponentials computed
    /// sixteen at a time, then the value rows into accumulators that stay in registers; the
    /// next chunk's rows are prefetched as each chunk starts.
    #[target_feature(enable = "avx512f")]
    fn heads_avx512<const N: usize, const G: usize>(
        qr: &[f32],
        job: HeadJob<'_, f16>,
        out: &mut [f32],
    ) {
        let HeadJob {
            keys,
            values,
            head,
            last,
            scale,
        } = job;
        let d = 16 * N;
        assert!(qr.len() == G * d && out.len() == G * d);
        let mut q = [[_mm512_setzero_ps(); N]; G];
        for (g, q) in q.iter_mut().enumerate() {
            for (j, q) in q.iter_mut().enumerate() {
                // SAFETY: `qr` holds exactly `G · 16 N` f32 (asserted); loadu is unaligned.
                *q = unsafe { _mm512_loadu_ps(qr.as_ptr().add(g * d + 16 * j)) };
            }
        }
        let mut acc = [[_mm512_setzero_ps(); N]; G];
        let (mut max, mut sum) = ([f32::NEG_INFINITY; G], [0f32; G]);
        let mut scores = [[0f32; CHUNK]; G];
        // Each position's 16 lanes of q · k, reduced for the whole chunk at once.
        let mut lanes16 = [[_mm512_setzero_ps(); CHUNK]; G];
        let (mut ms, mut vs) = ([[1f32; CHUNK]; G], [[0f32; CHUNK]; G]);
        let mut first = 0;
        while first <= last {
            let n = CHUNK.min(last + 1 - first);
            // The next chunk's key and value rows are asked for now, while this one computes
            // (a long context is far beyond the caches, and each row is read once per step).
            let ahead = CHUNK.min((last + 1).saturating_sub(first + CHUNK));
            for rows in [&keys, &values] {
                for row in rows.rows(head, d, first + CHUNK, ahead) {
                    for line in row.chunks(32) {
                        _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                    }
                }
            }
            for (j, k) in keys.rows(head, d, first, n).enumerate() {
                let mut kx = [_mm512_setzero_ps(); N];
                for (c, kx) in kx.iter_mut().enumerate() {
                    *kx = load16(k, 16 * c);
                }
                for g in 0..G {
                    // ggml's f16 dot: four 16-lane chains over each 64 values, folded
                    // (0+2)+(1+3).
                    let mut lanes = [_mm512_setzero_ps(); 4];
                    for c in 0..N {
                        lanes[c % 4] = _mm512_fmadd_ps(q[g][c], kx[c], lanes[c % 4]);
                    }
                    lanes16[g][j] = _mm512_add_ps(
                        _mm512_add_ps(lanes[0], lanes[2]),
                        _mm512_add_ps(lanes[1], lanes[3]),
                    );
                }
            }
            let scale16 = _mm512_set1_ps(scale);
            for (scores, lanes16) in scores.iter_mut().zip(&lanes16) {
                let s = _mm512_mul_ps(reduce16x16(lanes16), scale16);
                // SAFETY: `scores` holds exactly sixteen f32; the store is unaligned.
                unsafe { _mm512_storeu_ps(scores.as_mut_ptr(), s) };
            }
            softmax_chunk(&scores, n, &mut max, &mut sum, &mut ms, &mut vs);
            for (j, v) in values.rows(head, d, first, n).enumerate() {
                let mut vx = [_mm512_setzero_ps(); N];
                for (c, vx) in vx.iter_mut().enumerate() {
                    *vx = load16(v, 16 * c);
                }
                for g in 0..G {
                    if ms[g][j] != 1.0 {
                        let m = _mm512_set1_ps(ms[g][j]);
                        for a in &mut acc[g] {
                            *a = round16(_mm512_mul_ps(*a, m));
                        }
                    }
                    let w = _mm512_set1_ps(vs[g][j]);
                    for (a, v) in acc[g].iter_mut().zip(&vx) {
                        *a = round16(_mm512_fmadd_ps(*v, w, *a));
                    }
                }
            }
            first += n;
        }
        for g in 0..G {
            let inv = _mm512_set1_ps(if sum[g] == 0.0 { 0.0 } else { 1.0 / sum[g] });
            for (j, a) in acc[g].iter().enumerate() {
                // SAFETY: `out` holds exactly `G · 16 N` f32 (asserted); storeu is unaligned.
                unsafe {
                    _mm512_storeu_ps(out.as_mut_ptr().add(g * d + 16 * j), _mm512_mul_ps(*a, inv))
                };
            }
        }
    }

    /// The vector `expf` on sixteen values, for tests.
    #[cfg(test)]
    pub(super) fn expf16(x: &[f32; CHUNK]) -> [f32; CHUNK] {
        // SAFETY: tests call this only after detecting avx512f.
        unsafe { expf::expf_chunk(x) }
    }

    /// The query heads in `qr` (one to four of `16 N` values) against one KV head; see
    /// [`super::HeadKernel`].
    pub(super) fn heads<const N: usize>(qr: &[f32], job: HeadJob<'_, f16>, out: &mut [f32]) {
        let kernel = match qr.len() / (16 * N) {
            1 => heads_avx512::<N, 1>,
            2 => heads_avx512::<N, 2>,
            3 => heads_avx512::<N, 3>,
            4 => heads_avx512::<N, 4>,
            g => panic!(
                "a head kernel serves 1 to {} heads, got {g}",
                super::MAX_GROUP
            ),
        };
        // SAFETY: chosen by `head_kernel` only after `is_x86_feature_detected!` found avx512f
        // (which brings the 512-bit f16 conversions).
        unsafe { kernel(qr, job, out) }
    }
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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_expf_equals_libm_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
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
        for chunk in all.chunks(avx512::CHUNK) {
            let mut x = [0f32; avx512::CHUNK];
            x[..chunk.len()].copy_from_slice(chunk);
            let got = avx512::expf16(&x);
            for (&x, &got) in x.iter().zip(&got) {
                let want = x.exp();
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "expf({x:e}) = {got:e}, libm says {want:e}"
                );
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

    #[test]
    fn the_vector_head_kernels_equal_the_portable_loop_bit_for_bit() {
        // Widths with a kernel, grouped-query layouts (3 and 8 query heads per KV head) and
        // two sequences whose rows share one call: a prefill chunk and a decode.
        for (d, heads, kv_heads) in [(64, 9, 3), (128, 8, 1), (64, 4, 4)] {
            let Some(kernel) = <f16 as KvElement>::head_kernel(d) else {
                return;
            };
            let width = kv_heads * d;
            let val =
                |i: usize, salt: usize| (((i * 7919 + salt) % 211) as f32 / 211.0 - 0.5) * 3.0;
            // Position-major rows of `width` values laid out as the cache holds them: blocks
            // of 16 positions, head by head, the last block padded.
            let cache_of = |rows: Vec<f32>| -> Vec<f16> {
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
            };
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
            let run = |k: Option<HeadKernel<f16>>| {
                let mut out = vec![0f32; q.len()];
                attention_with(&q, &positions, &seqs, shape, &mut out, k);
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(
                run(Some(kernel)),
                run(None),
                "head_dim {d}, {heads}/{kv_heads} heads"
            );
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
