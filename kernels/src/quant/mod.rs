//! Quantized matmul on CPU for the GGUF block formats the Llama family ships in (Q4_0,
//! Q4_1, Q8_0): activations are quantized to 8 bits per 32-value block, then each output is
//! an integer dot product per block scaled and summed in f32.
//!
//! The arithmetic is ggml's x86 code, operation for operation — activation scale
//! `127 / amax` with round-half-even, block sums accumulated in eight lanes with fused
//! multiply-adds and reduced in the same tree — so a GGUF model gives llama.cpp's
//! logits bit for bit rather than merely close (a small model amplifies any rounding
//! difference into different tokens within a few dozen steps). Each output depends only on
//! its own activation row and weight row, in a fixed order, so results are batch-invariant.
//! The kernel walks weight rows in parallel and streams each once for all activation rows.
//!
//! This module holds the matrix type and how a product is planned; the arithmetic lives
//! in one file per instruction set — [`portable`] (the reference every other tier equals
//! bit for bit), `sse2`, `avx2` (for the `avx2` and `avx-vnni` tiers) and `avx512` on
//! x86-64, `neon` on arm64 — each chosen at run time through [`crate::cpu`]'s tokens.

use std::ops::{Deref, Range};
use std::sync::{Arc, OnceLock};

use half::f16;
use rayon::prelude::*;

use crate::buffers::Buf;
use crate::cpu;
use crate::hugepages::HugePages;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx512;
pub mod float;
pub mod kquant;
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
mod neon;
pub(crate) mod portable;
mod q5;
pub mod quantize;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod sse2;
#[cfg(test)]
mod tests;

pub use float::FloatFormat;
pub use kquant::KFormat;
use portable::{dot_q4_0, dot_q4_1, dot_q8_0, nibbles, quantize_block, tile_portable};

/// Values per quantization block of the 32-value formats.
pub const BLOCK: usize = 32;

/// Grows (or shrinks) `store` to `len` values and a cache line more, and returns where in
/// it `len` values start on a 64-byte line: there no vector load of a multiple of its own
/// size straddles two lines (the activation rows the tiles read again for every weight row).
pub(crate) fn line_start<T: Copy + Default>(store: &mut Vec<T>, len: usize) -> usize {
    let line = 64 / std::mem::size_of::<T>();
    store.resize(len + line, T::default());
    store.as_ptr().align_offset(64).min(line)
}

/// Weight formats with a kernel of our own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// 4-bit values with one f16 scale per block of 32, offset by 8.
    Q4_0,
    /// 4-bit values with an f16 scale and minimum per block of 32.
    Q4_1,
    /// 8-bit values with one f16 scale per block of 32.
    Q8_0,
    /// 5-bit values with one f16 scale per block of 32, offset by 16.
    Q5_0,
    /// 5-bit values with an f16 scale and minimum per block of 32.
    Q5_1,
    /// A K-quant: 256-value super-blocks of scaled sub-blocks.
    K(KFormat),
    /// Floating-point values, one per "block".
    Float(FloatFormat),
}

impl From<BlockFormat> for WeightFormat {
    fn from(f: BlockFormat) -> Self {
        match f {
            BlockFormat::Q4_0 => WeightFormat::Q4_0,
            BlockFormat::Q4_1 => WeightFormat::Q4_1,
            BlockFormat::Q8_0 => WeightFormat::Q8_0,
        }
    }
}

impl WeightFormat {
    /// The format's name in lower case, as `llama-quantize` and `--quantization` spell it.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::K(KFormat::Q2K) => "q2_k",
            WeightFormat::K(KFormat::Q3K) => "q3_k",
            WeightFormat::K(KFormat::Q4K) => "q4_k",
            WeightFormat::K(KFormat::Q5K) => "q5_k",
            WeightFormat::K(KFormat::Q6K) => "q6_k",
            WeightFormat::Float(FloatFormat::F16) => "f16",
            WeightFormat::Float(FloatFormat::BF16) => "bf16",
            WeightFormat::Float(FloatFormat::F32) => "f32",
        }
    }

    /// Values per block.
    pub const fn block_values(self) -> usize {
        match self {
            WeightFormat::K(_) => kquant::QK_K,
            WeightFormat::Float(_) => 1,
            _ => BLOCK,
        }
    }

    /// Bytes of one block in GGUF.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightFormat::Q4_0 => BlockFormat::Q4_0.block_bytes(),
            WeightFormat::Q4_1 => BlockFormat::Q4_1.block_bytes(),
            WeightFormat::Q8_0 => BlockFormat::Q8_0.block_bytes(),
            WeightFormat::Q5_0 => q5::Q5_0_BYTES,
            WeightFormat::Q5_1 => q5::Q5_1_BYTES,
            WeightFormat::K(k) => k.block_bytes(),
            WeightFormat::Float(f) => f.bytes(),
        }
    }

    /// The 32-value batch format this is, if it is one.
    fn batched(self) -> Option<Batched> {
        match self {
            WeightFormat::Q4_0 => Some(Batched::Block(BlockFormat::Q4_0)),
            WeightFormat::Q4_1 => Some(Batched::Block(BlockFormat::Q4_1)),
            WeightFormat::Q8_0 => Some(Batched::Block(BlockFormat::Q8_0)),
            WeightFormat::Q5_0 => Some(Batched::Q5_0),
            WeightFormat::Q5_1 => Some(Batched::Q5_1),
            WeightFormat::K(_) | WeightFormat::Float(_) => None,
        }
    }
}

/// The 32-value formats the batch kernels run: the 4- and 8-bit ones every kernel has, and
/// the 5-bit ones, which the wide and buffered kernels take unpacked (Q5_0's arithmetic is
/// Q4_0's with five-bit values, Q5_1's Q4_1's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batched {
    /// Q4_0, Q4_1 or Q8_0.
    Block(BlockFormat),
    /// Five-bit values minus 16 with a scale.
    Q5_0,
    /// Five-bit values with a scale and a minimum.
    Q5_1,
}

impl Batched {
    /// Bytes of one block.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Batched::Block(f) => f.block_bytes(),
            Batched::Q5_0 => q5::Q5_0_BYTES,
            Batched::Q5_1 => q5::Q5_1_BYTES,
        }
    }

    /// Whether blocks carry a minimum (and activations their sums).
    pub(crate) const fn mins(self) -> bool {
        matches!(self, Batched::Block(BlockFormat::Q4_1) | Batched::Q5_1)
    }

    /// The two-row dot product on the best tier `features` has, if it has one ([`Dot2`]):
    /// the x86 tiers; arm64, whose speed nothing here measures, keeps one row at a time.
    fn dot2(self, features: cpu::Features) -> Option<Dot2> {
        #[cfg(target_arch = "x86_64")]
        match features.avx512_vnni() {
            Some(cpu) => Some(avx512::dot2(cpu, self)),
            None => avx2::best_dot2(features, self),
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = features;
            None
        }
    }

    /// The single-row dot product on the best tier `features` has.
    fn dot(self, features: cpu::Features) -> Dot {
        #[cfg(target_arch = "aarch64")]
        if let Some(dot) = neon::best_dot(features, self) {
            return dot;
        }
        match self {
            Batched::Block(f) => dot_kernel(features, f),
            Batched::Q5_0 => q5_dot(features, true),
            Batched::Q5_1 => q5_dot(features, false),
        }
    }
}

/// The 32-value formats, which the tiles and wide kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockFormat {
    /// 4-bit values with one f16 scale per block, offset by 8.
    Q4_0,
    /// 4-bit values with an f16 scale and an f16 minimum per block.
    Q4_1,
    /// 8-bit values with one f16 scale per block.
    Q8_0,
}

impl BlockFormat {
    /// Bytes of one 32-value block in GGUF: the scale (and, for Q4_1, the minimum) as f16,
    /// then the values.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
        }
    }
}

/// A `[rows, cols]` quantized weight matrix, used as `x @ W^T`, kept in its GGUF encoding.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Bytes,
    /// BF16 weights' [`float::bf16_least_exponent`], found at the first product that asks.
    bf16_exponent: OnceLock<Option<i32>>,
}

/// Where a matrix's GGUF bytes live.
#[derive(Debug, Clone)]
enum Bytes {
    /// An allocation of its own.
    Own(Vec<u8>),
    /// A stretch of a huge-page arena shared with other matrices ([`QuantMatrix::share_huge_pages`]).
    Shared(Arc<HugePages>, Range<usize>),
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Shared(arena, r) => &arena[r.clone()],
        }
    }
}

/// The little-endian f16 at byte `at` of `b`, widened.
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// How many groups of four weight rows ahead a quantized product asks the memory system
/// for: the weights stream from memory once per step (once per task in a long prefill), and
/// the hardware prefetcher alone leaves the kernels waiting on them.
const PREFETCH_QUADS: usize = 4;

/// Asks for `bytes` to be brought into the cache ahead of their use (a hint: no effect on
/// results, and none at all on CPUs without the instruction).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        sse2::prefetch_line(line);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Fewest weight rows each parallel task of a small-batch product computes.
const ROWS_PER_TASK: usize = 16;

/// Tasks per thread a small-batch product aims for: enough to balance the threads when one
/// runs late, few enough that each task streams a long run of weight rows with its prefetch
/// running ahead (every task starts cold) and the pool's scheduling stays cheap — 16 made
/// single-stream decode ~13 % slower than 4.
const TASKS_PER_THREAD: usize = 4;

/// Output bytes each parallel task of a matrix-matrix product aims to write: its weights are
/// re-read once per task, so tasks are large, but its scattered output rows stay within the
/// core's cache (a wide output, such as the stacked gate/up projection, gets fewer rows).
const TASK_OUTPUT_BYTES: usize = 384 << 10;

/// Fewest and most activation rows of such a task.
const ACT_ROWS_PER_TASK: (usize, usize) = (64, 128);

/// Activation rows of a task of the 32-value formats (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1), whose
/// every group of four weight rows is read from memory (and unpacked) once per task: twice
/// [`ACT_ROWS_PER_TASK`]'s fewest halves that work for a long prompt. Random 1.1B Q8_0,
/// 512-token prompts on a Zen 5, 2 threads, alternating: capped to AVX2 97.6–98.0 → 106.3–
/// 106.9 tok/s, on AVX-512 VNNI even (166–179 against 170–177); the default model (Q4_1,
/// 135M) within noise (capped to AVX2 639–682 against 664–692). The K-quant and float
/// products keep 64: with 128, Q4_K_M lost 5–15 % and F16 9 %.
const BLOCK_ACT_ROWS_PER_TASK: usize = 128;

/// From this many activation rows, the AVX-512 kernel (`avx512::wide`) runs; below, the weight
/// blocks are unpacked in registers for each row instead of into a buffer shared by all.
#[cfg(target_arch = "x86_64")]
const WIDE_MIN_ROWS: usize = 8;

/// Up to this many activation rows, a matrix product splits the weight rows among threads
/// (each weight block unpacked once); beyond it, the activation rows.
const WEIGHT_PARALLEL_MAX_ROWS: usize = 32;

impl QuantMatrix {
    /// Wraps GGUF block data of a `[rows, cols]` matrix; `None` if the sizes disagree.
    pub fn from_gguf(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        Self::from_gguf_vec(format, rows, cols, data.to_vec())
    }

    /// [`QuantMatrix::from_gguf`] taking the bytes it is handed, without a copy.
    pub fn from_gguf_vec(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Option<Self> {
        let per_block = format.block_values();
        if !cols.is_multiple_of(per_block)
            || data.len() != rows * cols / per_block * format.block_bytes()
        {
            return None;
        }
        Some(QuantMatrix {
            format,
            rows,
            cols,
            data: Bytes::Own(data),
            bf16_exponent: OnceLock::new(),
        })
    }

    /// The matrices' rows one after another, as one matrix (projections of the same input
    /// computed in one pass); `None` unless all share a format and a width.
    pub fn stack(parts: &[&QuantMatrix]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols)
        {
            return None;
        }
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Some(QuantMatrix {
            format: first.format,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: Bytes::Own(data),
            bf16_exponent: OnceLock::new(),
        })
    }

    /// Rows `rows` of the matrix as a matrix of their own (a tensor-parallel rank's share
    /// of a projection); each row's products are those of the same row in the whole.
    pub fn select_rows(&self, rows: Range<usize>) -> Option<Self> {
        if rows.start > rows.end || rows.end > self.rows {
            return None;
        }
        let stride = self.data.len() / self.rows.max(1);
        Some(QuantMatrix {
            format: self.format,
            rows: rows.len(),
            cols: self.cols,
            data: Bytes::Own(self.data[rows.start * stride..rows.end * stride].to_vec()),
            bf16_exponent: OnceLock::new(),
        })
    }

    /// Moves the matrices' bytes into one arena backed by huge pages ([`HugePages`]): a
    /// step streams every weight, and small pages would make it wait on page walks. Values
    /// and results are unchanged.
    pub fn share_huge_pages(matrices: &mut [&mut QuantMatrix]) {
        // Taken out, so each matrix's own bytes are freed once copied.
        let parts: Vec<Bytes> = matrices
            .iter_mut()
            .map(|m| std::mem::replace(&mut m.data, Bytes::Own(Vec::new())))
            .collect();
        let (arena, ranges) = HugePages::pack(parts);
        let arena = Arc::new(arena);
        for (m, r) in matrices.iter_mut().zip(ranges) {
            m.data = Bytes::Shared(Arc::clone(&arena), r);
        }
    }

    /// Row `r` decoded to f32 into `out` (`cols` values), as ggml's and candle's
    /// `dequantize_row` functions decode it (`q · d`, `(q - 8) · d` or `q · d + m`, each
    /// product rounded before the minimum is added): an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let row = self.weight_row(r);
        let Some(Batched::Block(format)) = self.format.batched() else {
            match self.format {
                WeightFormat::K(k) => kquant::dequantize_row(k, row, out),
                WeightFormat::Q5_0 => q5::dequantize_q5_0(row, out),
                WeightFormat::Q5_1 => q5::dequantize_q5_1(row, out),
                WeightFormat::Float(f) => f.widen(row, out),
                _ => {}
            }
            return;
        };
        let stride = format.block_bytes();
        for (b, y) in row.chunks_exact(stride).zip(out.chunks_exact_mut(BLOCK)) {
            let d = f16_at(b, 0);
            let (q, m) = match format {
                BlockFormat::Q8_0 => (std::array::from_fn(|j| b[2 + j] as i8), None),
                BlockFormat::Q4_0 => (nibbles(&b[2..], 8), None),
                BlockFormat::Q4_1 => (nibbles(&b[4..], 0), Some(f16_at(b, 2))),
            };
            for (y, q) in y.iter_mut().zip(q) {
                // The product is rounded before the minimum is added (and a zero keeps its
                // sign where there is none to add).
                *y = f32::from(q) * d;
                if let Some(m) = m {
                    *y += m;
                }
            }
        }
    }

    /// Output features (rows of the weight).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns of the weight).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weight's format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes the weight occupies (what one pass streams from memory).
    pub fn gguf_bytes(&self) -> usize {
        self.data.len()
    }

    /// `x` (`[m, cols]`, row-major) times the transposed weight: `[m, rows]`. Decode steps
    /// and short prefills split the weight rows among the threads, so every weight block is
    /// unpacked once per call and reused for all activation rows; long prefills split the
    /// activation rows instead, so a task's rows stay in cache while the weights stream
    /// past. Each output is computed by the same arithmetic either way, so the split never
    /// changes a result.
    pub fn matmul(&self, x: &[f32]) -> Buf {
        let m = x.len() / self.cols;
        let features = cpu::detect();
        match self.format {
            WeightFormat::K(k) => {
                let tile = kquant_tile(features, k).filter(|_| m >= KQUANT_TILE_MIN_ROWS);
                let dot2 = kquant_dot2(features, k, tile.is_none());
                let quantize = match (tile, dot2) {
                    (Some(t), _) => t.quantize,
                    (None, Some((_, quantize))) => quantize,
                    (None, None) => kquant::quantize_row_q8k,
                };
                let kernels = PairKernels {
                    dot: kquant_dot(features, k),
                    dot2: dot2.map(|(dot2, _)| dot2),
                    tile: tile.map(|t| t.run),
                };
                self.matmul_pairs(x, m, quantize, kernels)
            }
            WeightFormat::Float(f) => self.matmul_float(f, x, m),
            _ => {
                let f = self
                    .format
                    .batched()
                    .unwrap_or(Batched::Block(BlockFormat::Q8_0));
                // One activation row: two weight rows at a time on the x86 tiers, one from
                // each half of a task's rows ([`Dot2`]). On the AVX-512 VNNI tier, Q4_1 ran
                // four weight rows at a time on the packed tiles below until the paired-block
                // kernel unpacked nibbles in fewer instructions; then, on a Zen 5 (2 threads,
                // single-stream decode), random 1.1B Q4_1 61–71 against 51–56 tok/s on the
                // tiles, the default model even (358–383 against 365–376). arm64, whose speed
                // nothing here measures, reads one row at a time.
                if m == 1 {
                    // Two weight rows at a time where the tier has a two-row dot product,
                    // else one after the next (see `pair_rows`).
                    let quantize = |r: &[f32]| quantize_row(r, f.mins());
                    let kernels = PairKernels {
                        dot: f.dot(features),
                        dot2: f.dot2(features),
                        tile: None,
                    };
                    self.matmul_pairs(x, m, quantize, kernels)
                } else if m <= WEIGHT_PARALLEL_MAX_ROWS {
                    self.matmat_by_weight_rows(f, x, m)
                } else {
                    self.matmat_by_activation_rows(f, x, m)
                }
            }
        }
    }

    /// The product of the formats run one (weight row, activation row) dot product at a
    /// time, or two weight rows at a time where the tier has a `dot2` (K-quants for one
    /// activation row or without a tile on this CPU, every 32-value format for one activation
    /// row), or, where there is a `tile` for the format, four weight rows at a time against
    /// every activation row: the activation rows quantized once by `quantize`, the weight rows
    /// split among the threads (each streamed once for all activation rows) or, for long
    /// prefills, the activation rows. A tile or a `dot2` gives each pair its dot product's
    /// bits, so neither the split nor the kernel changes a result.
    fn matmul_pairs<A: Sync>(
        &self,
        x: &[f32],
        m: usize,
        quantize: impl Fn(&[f32]) -> A + Sync,
        kernels: PairKernels<A>,
    ) -> Buf {
        let mut out = Buf::take(m * self.rows);
        if m <= WEIGHT_PARALLEL_MAX_ROWS {
            let acts: Vec<A> = x.chunks_exact(self.cols).map(&quantize).collect();
            let per_task = self.rows_per_weight_task();
            let mut pieces = task_pieces(&mut out, self.rows, m, per_task);
            pieces
                .par_chunks_mut(m)
                .enumerate()
                .for_each(|(task, dst)| {
                    let n = dst[0].len();
                    let first = task * per_task;
                    self.pair_rows(first..first + n, &acts, kernels, true, |i, r, v| {
                        dst[i][r..r + v.len()].copy_from_slice(v)
                    });
                });
        } else {
            let (fewest, most) = ACT_ROWS_PER_TASK;
            let fit = (TASK_OUTPUT_BYTES / (self.rows * 4).max(1)).clamp(fewest, most);
            let per_task = fit.min(m.div_ceil(rayon::current_num_threads()).max(1));
            out.par_chunks_mut(per_task * self.rows)
                .enumerate()
                .for_each(|(task, dst)| {
                    let first = task * per_task;
                    let rows = dst.len() / self.rows;
                    let acts: Vec<A> = x[first * self.cols..(first + rows) * self.cols]
                        .chunks_exact(self.cols)
                        .map(&quantize)
                        .collect();
                    let at = |i: usize, r: usize| i * self.rows + r;
                    self.pair_rows(0..self.rows, &acts, kernels, false, |i, r, v| {
                        dst[at(i, r)..at(i, r) + v.len()].copy_from_slice(v)
                    });
                });
        }
        out
    }

    /// Weight rows `rows` against `acts` for [`Self::matmul_pairs`]: four rows at a time
    /// through the kernels' tile if there is one, the rest through their `dot2` two rows at
    /// a time where they have one, else pair by pair through their `dot`; the results for
    /// activation row `i` from weight row `rows.start + r` on handed to `put(i, r, values)`.
    /// With `prefetch`, the tile's groups of four rows are asked for ahead ([`Self::quads`]).
    ///
    /// A product of a few activation rows (a batch's decode step) reads its weights from
    /// memory once, and the K-quant tiles waited on them: in their profile a fifth of the
    /// samples sat on the first use of a weight load. Prefetched, on an AMD EPYC (Zen 5), 2
    /// threads, random 1.1B Q4_K_M, the weight products of a 16-request decode step took
    /// 106–120 -> 78–88 ms (capped to AVX2, in the AVX2 build, 166–176 -> 147–159 ms). A
    /// long prefill's tasks, each dozens of activation rows against every weight row,
    /// measured even (AVX-512) or 2 % slower (AVX2) with it and go without.
    fn pair_rows<A>(
        &self,
        rows: std::ops::Range<usize>,
        acts: &[A],
        kernels: PairKernels<A>,
        prefetch: bool,
        mut put: impl FnMut(usize, usize, &[f32]),
    ) {
        let (first, n) = (rows.start, rows.len());
        let mut done = 0;
        if let Some(tile) = kernels.tile {
            let mut tiles = vec![[0f32; 4]; acts.len()];
            done = n / 4 * 4;
            let mut quad = |row: usize| {
                let w = [0, 1, 2, 3].map(|j| self.weight_row(row + j));
                tile(w, acts, &mut tiles);
                for (i, t) in tiles.iter().enumerate() {
                    put(i, row - first, t);
                }
            };
            if prefetch {
                self.quads(first, first + done).for_each(&mut quad);
            } else {
                (first..first + done).step_by(4).for_each(&mut quad);
            }
        }
        // Two rows at a time, one from each half of the rows left: two sequential streams,
        // each row's chain of multiply-adds beside the other's ([`Dot2`]).
        if let Some(dot2) = kernels.dot2 {
            let half = (n - done) / 2;
            let row_bytes = self.row_bytes();
            let (low, high) = self
                .rows_bytes(first + done, first + done + 2 * half)
                .split_at(half * row_bytes);
            let pairs = low
                .chunks_exact(row_bytes)
                .zip(high.chunks_exact(row_bytes));
            for (r, (w0, w1)) in (done..).zip(pairs) {
                for (i, a) in acts.iter().enumerate() {
                    let [v0, v1] = dot2([w0, w1], a);
                    put(i, r, &[v0]);
                    put(i, r + half, &[v1]);
                }
            }
            done += 2 * half;
        }
        // One row after the next, one sequential stream: no prefetch of whole rows (see
        // `prefetch_rows`); the dot products on x86 ask for their own bytes a few KiB
        // ahead, a block at a time.
        for r in done..n {
            let w = self.weight_row(first + r);
            for (i, a) in acts.iter().enumerate() {
                put(i, r, &[(kernels.dot)(w, a)]);
            }
        }
    }

    /// Weight rows per task (whole groups of four) when a product splits the weight rows
    /// among the threads.
    fn rows_per_weight_task(&self) -> usize {
        ROWS_PER_TASK.max(
            self.rows
                .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
                .next_multiple_of(4),
        )
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.format.block_values() * self.format.block_bytes()
    }

    /// Prefetches weight rows `from..to` (clamped to `end`; none if empty).
    ///
    /// Only for groups of four short rows read side by side ([`Self::quads`]): four streams
    /// that each end within a few cache lines. A product that reads its weight rows one
    /// after another, each row whole (one activation row against any format, or several
    /// against K-quants without a tile), is one sequential stream per thread, which the
    /// hardware prefetcher follows at close to the memory's read bandwidth; prefetching a
    /// whole row ahead of it only queued requests in its way. Measured on an AMD EPYC (Zen
    /// 4), 2 threads, 768 MiB of 8192 × 2048 matrices against one activation row, with ->
    /// without it: BF16 12.3 -> 25.4 GB/s, Q4_K 15.1 -> 18.0 GB/s, Q6_K 17.3 -> 21.6 GB/s.
    /// There, one row at a time also beat the four-row one-activation kernel it replaced,
    /// prefetched or not, on the AVX-512 VNNI and the AVX2 tier alike: Q8_0 11.5 -> 18 GB/s
    /// (AVX2 13.2 -> 16.9), Q4_1 8.3 -> 11.8 GB/s; Q4_0, bound by its arithmetic there,
    /// about even (~9.5). Q4_0 and Q4_1 against one row have since moved to the packed
    /// tiles, four rows side by side with these prefetches, on the AVX-512 VNNI tier. Those
    /// one-row figures were taken while a scalar f16 conversion chained every block of the
    /// one-row dot products to the block before ([`avx2::f16_splat`]). Without that chain, on
    /// a Zen 5 (2 threads, single-stream decode, `ferrite-engine bench`), one row against the
    /// tiles: random 1.1B Q4_0 52.6–53.3 against 52.2–52.5 tok/s, Q4_1 46.2–47.5 against
    /// 45.7–46.6, the default model (SmolLM2-135M Q4_1) 289–292 against 351–356; capped to
    /// AVX2, Q4_0 53–55 against 38–39, Q4_1 52–53 against 32–35, the default model 262–266
    /// against 200–205. So the AVX-512 VNNI tier kept the tiles and the AVX2 tiers, like
    /// Q8_0 and Q5_0 on every tier, read the rows without the tiles: since then two at a
    /// time, one from each half of a task's rows ([`Dot2`]), each half one sequential
    /// stream, which every 32-value format on the AVX-512 VNNI tier now does too (see
    /// [`Self::matmul`]).
    ///
    /// What did pay on Zen 5 is a steady request per cache line a fixed distance ahead,
    /// issued by the dot product itself as it reaches each block: the x86 one-row dot
    /// products of every format do so (`sse2::prefetch_ahead`).
    fn prefetch_rows(&self, from: usize, to: usize, end: usize) {
        let to = to.min(end);
        if from >= to {
            return;
        }
        let n = self.row_bytes();
        prefetch(&self.data[from * n..to * n]);
    }

    /// The first rows of the groups of four weight rows in `from..to` (which hold whole
    /// groups), each group's rows prefetched [`PREFETCH_QUADS`] groups before it is reached.
    fn quads(&self, from: usize, to: usize) -> impl Iterator<Item = usize> + '_ {
        let ahead = 4 * PREFETCH_QUADS;
        self.prefetch_rows(from, from + ahead, to);
        (from..to).step_by(4).inspect(move |&r| {
            self.prefetch_rows(r + ahead, r + ahead + 4, to);
        })
    }

    /// The bytes of weight rows `from..to` (none if empty).
    fn rows_bytes(&self, from: usize, to: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[from.min(to) * n..to * n]
    }

    fn weight_row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// The activation rows quantized as the weight format's dot product wants them.
    fn quantize(&self, f: Batched, x: &[f32]) -> Vec<QuantizedRow> {
        let with_sums = f.mins();
        x.chunks_exact(self.cols)
            .map(|row| quantize_row(row, with_sums))
            .collect()
    }

    fn matmat_by_weight_rows(&self, f: Batched, x: &[f32], m: usize) -> Buf {
        let dot = f.dot(cpu::detect());
        let acts = self.quantize(f, x);
        let plan = Plan::new(f, &acts);
        // Each task owns a range of weight rows: its piece of every output row.
        let per_task = self.rows_per_weight_task();
        let mut out = Buf::take(m * self.rows);
        let mut pieces = task_pieces(&mut out, self.rows, m, per_task);
        pieces.par_chunks_mut(m).enumerate().for_each_init(
            || (Scratch::default(), vec![[0f32; 4]; m]),
            |(scratch, tiles), (task, dst)| {
                let first = task * per_task;
                let n = dst[0].len();
                let quads = n / 4 * 4;
                for row in self.quads(first, first + quads) {
                    let r = row - first;
                    let w = [0, 1, 2, 3].map(|j| self.weight_row(row + j));
                    plan.quad(f, scratch, w, tiles);
                    for (d, v) in dst.iter_mut().zip(tiles.iter()) {
                        d[r..r + 4].copy_from_slice(v);
                    }
                }
                for r in quads..n {
                    let w = self.weight_row(first + r);
                    for (d, a) in dst.iter_mut().zip(&acts) {
                        d[r] = dot(w, a);
                    }
                }
            },
        );
        out
    }

    fn matmat_by_activation_rows(&self, f: Batched, x: &[f32], m: usize) -> Buf {
        let dot = f.dot(cpu::detect());
        let mut out = Buf::take(m * self.rows);
        let per_task = BLOCK_ACT_ROWS_PER_TASK.min(m.div_ceil(rayon::current_num_threads()).max(1));
        out.par_chunks_mut(per_task * self.rows)
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (task, dst)| {
                let first = task * per_task;
                let rows = dst.len() / self.rows;
                let acts = self.quantize(f, &x[first * self.cols..(first + rows) * self.cols]);
                let plan = Plan::new(f, &acts);
                let quads = self.rows / 4 * 4;
                let mut tiles = vec![[0f32; 4]; rows];
                for r in self.quads(0, quads) {
                    let w = [0, 1, 2, 3].map(|j| self.weight_row(r + j));
                    plan.quad(f, scratch, w, &mut tiles);
                    for (i, v) in tiles.iter().enumerate() {
                        let at = i * self.rows + r;
                        dst[at..at + 4].copy_from_slice(v);
                    }
                }
                for r in quads..self.rows {
                    for (i, a) in acts.iter().enumerate() {
                        dst[i * self.rows + r] = dot(self.weight_row(r), a);
                    }
                }
            });
        out
    }
}

/// `out` (`m` rows of `rows` outputs) cut into the pieces of the tasks that each own
/// `per_task` weight rows, task-major: task `t`'s piece of output row `i` at `t * m + i`.
fn task_pieces(out: &mut [f32], rows: usize, m: usize, per_task: usize) -> Vec<&mut [f32]> {
    let mut pieces: Vec<&mut [f32]> = std::iter::repeat_with(Default::default)
        .take(rows.div_ceil(per_task) * m)
        .collect();
    for (i, row) in out.chunks_mut(rows).enumerate() {
        for (t, piece) in row.chunks_mut(per_task).enumerate() {
            pieces[t * m + i] = piece;
        }
    }
    pieces
}

/// How a product's groups of four weight rows meet its activation rows.
enum Plan<'a> {
    /// A few activation rows: weight blocks unpacked in registers for each.
    #[cfg(target_arch = "x86_64")]
    Packed(PackedTile, &'a [QuantizedRow]),
    /// The AVX-512 kernel (`avx512::wide`), the activation rows laid out for it.
    #[cfg(target_arch = "x86_64")]
    Wide(cpu::Avx512Vnni, avx512::wide::WideActs),
    /// Weight blocks unpacked into a buffer once, then a tile over the rows.
    Buffered(Tile, &'a [QuantizedRow]),
}

impl<'a> Plan<'a> {
    /// The fastest way this CPU has for `acts` against weights of `format`.
    fn new(format: Batched, acts: &'a [QuantizedRow]) -> Self {
        let features = cpu::detect();
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = features.avx512_vnni() {
            if acts.len() >= WIDE_MIN_ROWS {
                return Plan::Wide(cpu, avx512::wide::WideActs::new(cpu, format, acts));
            }
            if let Batched::Block(f) = format {
                return Plan::Packed(avx512::packed_tile(cpu, f), acts);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = format;
        Plan::Buffered(tile_kernel(features), acts)
    }

    /// `out[i]`: the four weight rows `w` against activation row `i`.
    fn quad(&self, format: Batched, scratch: &mut Scratch, w: [&[u8]; 4], out: &mut [[f32; 4]]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Plan::Packed(packed, acts) => packed(w, acts, out),
            #[cfg(target_arch = "x86_64")]
            Plan::Wide(cpu, acts) => {
                scratch.wide.fill(*cpu, format, w);
                avx512::wide::tile(*cpu, &mut scratch.wide, acts, &mut out[..acts.rows()]);
            }
            Plan::Buffered(tile, acts) => {
                match format {
                    Batched::Block(f) => scratch.unpacked.fill(f, w),
                    Batched::Q5_0 => scratch.unpacked.fill_q5(true, w),
                    Batched::Q5_1 => scratch.unpacked.fill_q5(false, w),
                }
                tile(&scratch.unpacked, acts, out);
            }
        }
    }
}

/// A task's buffers for unpacked weight rows, reused from one group of four to the next.
#[derive(Debug, Default)]
struct Scratch {
    unpacked: Unpacked,
    #[cfg(target_arch = "x86_64")]
    wide: avx512::wide::WideQuad,
}

/// Four weight rows with their blocks unpacked to 32 bytes each, block-major, so a batch of
/// activation rows can reuse them from L1 without unpacking nibbles again.
#[derive(Debug, Default)]
pub struct Unpacked {
    /// `[block][row]` → 32 values (unsigned 0..16 for Q4_1, signed otherwise).
    q: Vec<[i8; BLOCK]>,
    /// `[block][row]` scales.
    d: Vec<f32>,
    /// `[block][row]` minimums (Q4_1) or zeros.
    m: Vec<f32>,
    signed: bool,
}

impl Unpacked {
    /// Unpacks four Q5_0 (`signed`) or Q5_1 weight rows into this buffer, as [`Self::fill`]
    /// the 4-bit formats: values minus 16 (Q5_0) or as they are with the minimum (Q5_1).
    fn fill_q5(&mut self, signed: bool, rows: [&[u8]; 4]) {
        let stride = if signed {
            q5::Q5_0_BYTES
        } else {
            q5::Q5_1_BYTES
        };
        self.fill_blocks(stride, signed, rows, |b, q| {
            if signed {
                *q = q5::values(&b[6..22], q5::high_bits(b, 2), 16);
                0.0
            } else {
                *q = q5::values(&b[8..24], q5::high_bits(b, 4), 0);
                f16_at(b, 2)
            }
        });
    }

    /// Unpacks four weight rows into this buffer, reusing its memory.
    fn fill(&mut self, format: BlockFormat, rows: [&[u8]; 4]) {
        let signed = format != BlockFormat::Q4_1;
        self.fill_blocks(format.block_bytes(), signed, rows, |b, q| match format {
            BlockFormat::Q4_1 => {
                unpack_nibbles(&b[4..20], 0, q);
                f16_at(b, 2)
            }
            BlockFormat::Q4_0 => {
                unpack_nibbles(&b[2..18], 8, q);
                0.0
            }
            BlockFormat::Q8_0 => {
                // A whole-array copy, one 32-byte vector load and store; a loop over the
                // bytes compiled to 32 byte loads and stores (unpacking was 8 % of a Q8_0
                // prompt's profile on the AVX2 tier, 5 % after).
                let bytes: &[u8; BLOCK] = b[2..2 + BLOCK].try_into().expect("a Q8_0 block");
                *q = bytes.map(|v| v as i8);
                0.0
            }
        });
    }

    /// Four rows of blocks of `stride` bytes, each with its f16 scale first: per block, the
    /// four rows' values, scales and minimums side by side, `unpack` writing a block's
    /// values and returning its minimum.
    fn fill_blocks(
        &mut self,
        stride: usize,
        signed: bool,
        rows: [&[u8]; 4],
        unpack: impl Fn(&[u8], &mut [i8; BLOCK]) -> f32,
    ) {
        let nb = rows[0].len() / stride;
        self.signed = signed;
        self.q.resize(nb * 4, [0; BLOCK]);
        self.d.resize(nb * 4, 0.0);
        self.m.resize(nb * 4, 0.0);
        let blocks = self
            .q
            .chunks_exact_mut(4)
            .zip(self.d.chunks_exact_mut(4))
            .zip(self.m.chunks_exact_mut(4));
        for (i, ((q, d), m)) in blocks.enumerate() {
            let at = i * stride;
            for r in 0..4 {
                let b = &rows[r][at..at + stride];
                d[r] = f16_at(b, 0);
                m[r] = unpack(b, &mut q[r]);
            }
        }
    }
}

/// The 32 values of a 4-bit block (16 bytes: low nibbles are values 0..16, high nibbles
/// 16..32) minus `offset`, written into `dst`.
#[inline(always)]
fn unpack_nibbles(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
    #[cfg(target_arch = "x86_64")]
    sse2::unpack_nibbles(qs, offset, dst);
    #[cfg(not(target_arch = "x86_64"))]
    {
        *dst = nibbles(qs, offset);
    }
}

/// Four unpacked weight rows against each of a run of activation rows (`out[i]` for
/// `acts[i]`); the arithmetic of each output is exactly that of [`dot_kernel`] for its row.
type Tile = fn(&Unpacked, &[QuantizedRow], &mut [[f32; 4]]);

/// The buffered tile of the best tier `features` has.
fn tile_kernel(features: cpu::Features) -> Tile {
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = avx2::best_tile(features) {
        return tile;
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(tile) = neon::best_tile(features) {
        return tile;
    }
    let _ = features;
    tile_portable
}

/// Four GGUF weight rows against a run of activation rows (`out[i]` for `acts[i]`),
/// unpacking each weight block once in registers; exactly [`dot_kernel`]'s arithmetic.
#[cfg(target_arch = "x86_64")]
type PackedTile = fn([&[u8]; 4], &[QuantizedRow], &mut [[f32; 4]]);

/// A weight row against an activation row.
type Dot = fn(&[u8], &QuantizedRow) -> f32;

/// The Q5_0 (`signed`) or Q5_1 dot product on the best x86 tier `features` has, else the
/// portable one ([`Batched::dot`] has already asked NEON).
fn q5_dot(features: cpu::Features, signed: bool) -> Dot {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = features.avx512_vnni() {
        return avx512::dot(cpu, if signed { Batched::Q5_0 } else { Batched::Q5_1 });
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(dot) = avx2::best_dot_q5(features, signed) {
        return dot;
    }
    let _ = features;
    if signed {
        q5::dot_q5_0
    } else {
        q5::dot_q5_1
    }
}

/// A tile of four weight rows against many activation rows, each result its pair's dot
/// product bit for bit.
type PairTile<A> = fn([&[u8]; 4], &[A], &mut [[f32; 4]]);

/// Two weight rows against one activation row, each result the row's [`Dot`] bit for bit
/// (each row keeps its own accumulators, in its own order).
///
/// Each block's multiply-add waits on the block before, in ggml's order; against one
/// activation row that chain, not the memory, bounded the 32-value formats: Q8_0 read ~30
/// GB/s a core on a Zen 5 where memory gave ~45. Two rows' chains side by side hide each
/// other's latency. The rows come from the two halves of a task's rows, so each is read
/// front to back as one sequential stream; two neighbouring rows, tried before, measured
/// slower than one row at a time (their streams interleave within a few KiB, where the
/// dot products' prefetches a fixed distance ahead land in the other row).
type Dot2<A = QuantizedRow> = fn([&[u8]; 2], &A) -> [f32; 2];

/// The kernels [`QuantMatrix::matmul_pairs`] runs a format on.
struct PairKernels<A> {
    /// One weight row against one activation row.
    dot: fn(&[u8], &A) -> f32,
    /// Two weight rows against one activation row, where the tier has it ([`Dot2`]).
    dot2: Option<Dot2<A>>,
    /// Four weight rows against many activation rows, where the format has a tile here.
    tile: Option<PairTile<A>>,
}

// By hand: derived, `Clone` and `Copy` would ask `A: Copy` of the activation rows too.
impl<A> Clone for PairKernels<A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A> Copy for PairKernels<A> {}

/// Activation rows from which a K-quant product runs four weight rows at a time: a weight
/// super-block is then unpacked once for all of them rather than once per pair.
const KQUANT_TILE_MIN_ROWS: usize = 2;

/// The K-quant tile for `format` on the best tier `features` has, if it has one, with the
/// quantizer its activation rows come from.
fn kquant_tile(features: cpu::Features, format: KFormat) -> Option<kquant::KTile> {
    #[cfg(target_arch = "x86_64")]
    return kquant::tile::tile(features, format);
    #[cfg(target_arch = "aarch64")]
    return kquant::neon::best_tile(features, format).map(|run| kquant::KTile {
        run,
        quantize: kquant::quantize_row_q8k,
    });
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (features, format);
        None
    }
}

/// The K-quant dot product for `format` on the best tier `features` has.
fn kquant_dot(features: cpu::Features, format: KFormat) -> fn(&[u8], &kquant::Q8KRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = features.avx2() {
        return kquant::avx2::dot(cpu, format);
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(dot) = kquant::neon::best_dot(features, format) {
        return dot;
    }
    let _ = features;
    kquant::dot(format)
}

/// A quantizer of activation rows to Q8_K, for a K-quant product.
type Q8KQuantizer = fn(&[f32]) -> kquant::Q8KRow;

/// The two-row K-quant dot product for `format` on the best tier `features` has, if it has
/// one, with the quantizer of the activation rows it takes: AVX-512's, two rows in one
/// register ([`kquant::rows2`]), on rows [`kquant::quantize_row_q8k_doubled`] gives, else
/// AVX2's, one row after the other (two streams of weights either way, which is what one
/// activation row gains). Without `own_rows` the rows come from another quantizer (a
/// tile's, whose rows the two-row product meets only in the weight rows a task has past its
/// groups of four), and AVX2's takes them.
fn kquant_dot2(
    features: cpu::Features,
    format: KFormat,
    own_rows: bool,
) -> Option<(Dot2<kquant::Q8KRow>, Q8KQuantizer)> {
    #[cfg(target_arch = "x86_64")]
    return features
        .avx512()
        .filter(|_| own_rows)
        .map(|cpu| {
            let quantize: Q8KQuantizer = kquant::quantize_row_q8k_doubled;
            (kquant::rows2::dot2(cpu, format), quantize)
        })
        .or_else(|| {
            let quantize: Q8KQuantizer = kquant::quantize_row_q8k;
            features
                .avx2()
                .map(|cpu| (kquant::avx2::dot2(cpu, format), quantize))
        });
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (features, format, own_rows);
        None
    }
}

/// The dot product for `format` on the best tier `features` has; every tier computes the
/// same lanes in the same order, so results do not depend on the machine.
fn dot_kernel(features: cpu::Features, format: BlockFormat) -> Dot {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = features.avx512_vnni() {
        return avx512::dot(cpu, Batched::Block(format));
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(dot) = avx2::best_dot(features, format) {
        return dot;
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(dot) = neon::best_dot(features, Batched::Block(format)) {
        return dot;
    }
    let _ = features;
    match format {
        BlockFormat::Q4_1 => dot_q4_1,
        BlockFormat::Q4_0 => dot_q4_0,
        BlockFormat::Q8_0 => dot_q8_0,
    }
}

/// An activation row quantized to 8 bits per block: ggml's `block_q8_0` / `block_q8_1`.
#[derive(Debug, Clone)]
pub struct QuantizedRow {
    d: Vec<f32>,
    s: Vec<f32>,
    q: Vec<i8>,
}

/// Quantizes one row exactly as ggml's x86 `quantize_row_q8_0/1` does; `with_sums` also
/// stores each block's `d * sum(q)` (Q8_1, used with Q4_1 weights).
pub fn quantize_row(x: &[f32], with_sums: bool) -> QuantizedRow {
    let nb = x.len() / BLOCK;
    let mut row = QuantizedRow {
        d: Vec::with_capacity(nb),
        s: Vec::with_capacity(if with_sums { nb } else { 0 }),
        q: vec![0; x.len()],
    };
    #[cfg(target_arch = "x86_64")]
    let simd = cpu::detect().avx2();
    #[cfg(target_arch = "aarch64")]
    let simd = cpu::detect().neon();
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        #[cfg(target_arch = "x86_64")]
        let (d, sum) = match simd {
            Some(cpu) => avx2::quantize_block(cpu, block, q),
            None => quantize_block(block, q),
        };
        #[cfg(target_arch = "aarch64")]
        let (d, sum) = match simd {
            Some(cpu) => neon::quantize_block(cpu, block, q),
            None => quantize_block(block, q),
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let (d, sum) = quantize_block(block, q);
        row.d.push(f16::from_f32(d).to_f32());
        if with_sums {
            row.s.push(f16::from_f32(d * sum as f32).to_f32());
        }
    }
    row
}
