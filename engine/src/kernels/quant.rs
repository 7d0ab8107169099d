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

use std::ops::{Deref, Range};
use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use super::hugepages::HugePages;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod wide;

/// Values per quantization block in every format here.
pub const BLOCK: usize = 32;

/// Weight formats with a kernel of our own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// 4-bit values with one f16 scale per block, offset by 8.
    Q4_0,
    /// 4-bit values with an f16 scale and an f16 minimum per block.
    Q4_1,
    /// 8-bit values with one f16 scale per block.
    Q8_0,
}

impl WeightFormat {
    /// Bytes of one 32-value block in GGUF.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
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
        x86::prefetch_line(line);
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
const ACT_ROWS_PER_TASK: (usize, usize) = (16, 128);

/// From this many activation rows, the AVX-512 kernel ([`wide`]) runs; below, the weight
/// blocks are unpacked in registers for each row instead of into a buffer shared by all.
const WIDE_MIN_ROWS: usize = 8;

/// Up to this many activation rows, a matrix product splits the weight rows among threads
/// (each weight block unpacked once); beyond it, the activation rows.
const WEIGHT_PARALLEL_MAX_ROWS: usize = 32;

impl QuantMatrix {
    /// Wraps GGUF block data of a `[rows, cols]` matrix; `None` if the sizes disagree.
    pub fn from_gguf(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        if !cols.is_multiple_of(BLOCK) || data.len() != rows * cols / BLOCK * format.block_bytes() {
            return None;
        }
        Some(QuantMatrix {
            format,
            rows,
            cols,
            data: Bytes::Own(data.to_vec()),
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
        Some(QuantMatrix {
            format: first.format,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: Bytes::Own(parts.iter().flat_map(|p| p.data.iter().copied()).collect()),
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
        let stride = self.format.block_bytes();
        for (b, y) in row.chunks_exact(stride).zip(out.chunks_exact_mut(BLOCK)) {
            let d = f16_at(b, 0);
            let (q, m) = match self.format {
                WeightFormat::Q8_0 => (std::array::from_fn(|j| b[2 + j] as i8), None),
                WeightFormat::Q4_0 => (nibbles(&b[2..], 8), None),
                WeightFormat::Q4_1 => (nibbles(&b[4..], 0), Some(f16_at(b, 2))),
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
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.cols;
        if m <= WEIGHT_PARALLEL_MAX_ROWS {
            self.matmat_by_weight_rows(x, m)
        } else {
            self.matmat_by_activation_rows(x, m)
        }
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    /// Prefetches weight rows `from..to` (clamped to `end`; none if empty).
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

    fn weight_row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// The activation rows quantized as the weight format's dot product wants them.
    fn quantize(&self, x: &[f32]) -> Vec<QuantizedRow> {
        let with_sums = self.format == WeightFormat::Q4_1;
        x.chunks_exact(self.cols)
            .map(|row| quantize_row(row, with_sums))
            .collect()
    }

    fn matmat_by_weight_rows(&self, x: &[f32], m: usize) -> Vec<f32> {
        let dot = dot_kernel(self.format);
        let acts = self.quantize(x);
        let plan = Plan::new(self.format, &acts);
        // Each task owns a range of weight rows: its piece of every output row.
        let per_task = ROWS_PER_TASK.max(
            self.rows
                .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
                .next_multiple_of(4),
        );
        let mut out = super::buffers::take(m * self.rows);
        let tasks = self.rows.div_ceil(per_task);
        // Task-major: task `t`'s piece of output row `i` at `t * m + i`.
        let mut pieces: Vec<&mut [f32]> = std::iter::repeat_with(Default::default)
            .take(tasks * m)
            .collect();
        for (i, row) in out.chunks_mut(self.rows).enumerate() {
            for (t, piece) in row.chunks_mut(per_task).enumerate() {
                pieces[t * m + i] = piece;
            }
        }
        pieces.par_chunks_mut(m).enumerate().for_each_init(
            || (Scratch::default(), vec![[0f32; 4]; m]),
            |(scratch, tiles), (task, dst)| {
                let first = task * per_task;
                let n = dst[0].len();
                let quads = n / 4 * 4;
                for row in self.quads(first, first + quads) {
                    let r = row - first;
                    let w = [0, 1, 2, 3].map(|j| self.weight_row(row + j));
                    plan.quad(self.format, scratch, w, tiles);
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

    fn matmat_by_activation_rows(&self, x: &[f32], m: usize) -> Vec<f32> {
        let dot = dot_kernel(self.format);
        let mut out = super::buffers::take(m * self.rows);
        let (fewest, most) = ACT_ROWS_PER_TASK;
        let fit = (TASK_OUTPUT_BYTES / (self.rows * 4).max(1)).clamp(fewest, most) / 4 * 4;
        let per_task = fit.min(m.div_ceil(rayon::current_num_threads()).max(1));
        out.par_chunks_mut(per_task * self.rows)
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (task, dst)| {
                let first = task * per_task;
                let rows = dst.len() / self.rows;
                let acts = self.quantize(&x[first * self.cols..(first + rows) * self.cols]);
                let plan = Plan::new(self.format, &acts);
                let quads = self.rows / 4 * 4;
                let mut tiles = vec![[0f32; 4]; rows];
                for r in self.quads(0, quads) {
                    let w = [0, 1, 2, 3].map(|j| self.weight_row(r + j));
                    plan.quad(self.format, scratch, w, &mut tiles);
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

/// How a product's groups of four weight rows meet its activation rows.
enum Plan<'a> {
    /// One activation row: four dot products side by side.
    Single(Dot4, &'a QuantizedRow),
    /// A few activation rows: weight blocks unpacked in registers for each.
    #[cfg(target_arch = "x86_64")]
    Packed(PackedTile, &'a [QuantizedRow]),
    /// The AVX-512 kernel ([`wide`]), the activation rows laid out for it.
    #[cfg(target_arch = "x86_64")]
    Wide(wide::Avx512, wide::WideActs),
    /// Weight blocks unpacked into a buffer once, then a tile over the rows.
    Buffered(Tile, &'a [QuantizedRow]),
}

impl<'a> Plan<'a> {
    /// The fastest way this CPU has for `acts` against weights of `format`.
    fn new(format: WeightFormat, acts: &'a [QuantizedRow]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = wide::detect() {
            return if acts.len() < WIDE_MIN_ROWS {
                Plan::Packed(packed_tile_kernel(cpu, format), acts)
            } else {
                Plan::Wide(cpu, wide::WideActs::new(cpu, format, acts))
            };
        }
        match acts {
            [one] => Plan::Single(dot4_kernel(format), one),
            _ => Plan::Buffered(tile_kernel(), acts),
        }
    }

    /// `out[i]`: the four weight rows `w` against activation row `i`.
    fn quad(
        &self,
        format: WeightFormat,
        scratch: &mut Scratch,
        w: [&[u8]; 4],
        out: &mut [[f32; 4]],
    ) {
        match self {
            Plan::Single(dot4, a) => out[0] = dot4(w, a),
            #[cfg(target_arch = "x86_64")]
            Plan::Packed(packed, acts) => packed(w, acts, out),
            #[cfg(target_arch = "x86_64")]
            Plan::Wide(cpu, acts) => {
                scratch.wide.fill(*cpu, format, w);
                wide::tile(*cpu, &mut scratch.wide, acts, &mut out[..acts.rows()]);
            }
            Plan::Buffered(tile, acts) => {
                scratch.unpacked.fill(format, w);
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
    wide: wide::WideQuad,
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
    /// Unpacks four weight rows into this buffer, reusing its memory.
    fn fill(&mut self, format: WeightFormat, rows: [&[u8]; 4]) {
        let stride = format.block_bytes();
        let nb = rows[0].len() / stride;
        self.signed = format != WeightFormat::Q4_1;
        self.q.resize(nb * 4, [0; BLOCK]);
        self.d.resize(nb * 4, 0.0);
        self.m.resize(nb * 4, 0.0);
        // Per block: four rows' values, scales and minimums side by side.
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
                match format {
                    WeightFormat::Q4_1 => {
                        m[r] = f16_at(b, 2);
                        unpack_nibbles(&b[4..20], 0, &mut q[r]);
                    }
                    WeightFormat::Q4_0 => {
                        m[r] = 0.0;
                        unpack_nibbles(&b[2..18], 8, &mut q[r]);
                    }
                    WeightFormat::Q8_0 => {
                        m[r] = 0.0;
                        for (dst, &src) in q[r].iter_mut().zip(&b[2..34]) {
                            *dst = src as i8;
                        }
                    }
                }
            }
        }
    }
}

/// The 32 values of a 4-bit block (16 bytes: low nibbles are values 0..16, high nibbles
/// 16..32) minus `offset`, written into `dst`.
#[inline(always)]
fn unpack_nibbles(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
    #[cfg(target_arch = "x86_64")]
    x86::unpack_nibbles(qs, offset, dst);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let (lo, hi) = dst.split_at_mut(BLOCK / 2);
        for ((l, h), &b) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[..BLOCK / 2]) {
            *l = (b & 0x0F) as i8 - offset;
            *h = (b >> 4) as i8 - offset;
        }
    }
}

/// Four unpacked weight rows against each of a run of activation rows (`out[i]` for
/// `acts[i]`); the arithmetic of each output is exactly that of [`dot_kernel`] for its row.
type Tile = fn(&Unpacked, &[QuantizedRow], &mut [[f32; 4]]);

fn tile_kernel() -> Tile {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            return x86::tile;
        }
    }
    tile_portable
}

fn tile_portable(u: &Unpacked, acts: &[QuantizedRow], out: &mut [[f32; 4]]) {
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

/// Four GGUF weight rows against a run of activation rows (`out[i]` for `acts[i]`),
/// unpacking each weight block once in registers; exactly [`dot_kernel`]'s arithmetic.
#[cfg(target_arch = "x86_64")]
type PackedTile = fn([&[u8]; 4], &[QuantizedRow], &mut [[f32; 4]]);

/// The packed tile for `format` (the CPU has it: `cpu`).
#[cfg(target_arch = "x86_64")]
fn packed_tile_kernel(cpu: wide::Avx512, format: WeightFormat) -> PackedTile {
    let _ = cpu;
    match format {
        WeightFormat::Q4_1 => x86::packed_512_q4_1,
        WeightFormat::Q4_0 => x86::packed_512_q4_0,
        WeightFormat::Q8_0 => x86::packed_512_q8_0,
    }
}

/// Four weight rows against one activation row: four independent accumulator chains, each
/// with exactly the arithmetic of [`dot_kernel`].
type Dot4 = fn([&[u8]; 4], &QuantizedRow) -> [f32; 4];

fn dot4_kernel(format: WeightFormat) -> Dot4 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return match format {
            WeightFormat::Q4_1 => x86::dot4_q4_1,
            WeightFormat::Q4_0 => x86::dot4_q4_0,
            WeightFormat::Q8_0 => x86::dot4_q8_0,
        };
    }
    match format {
        WeightFormat::Q4_1 => |w, a| w.map(|w| dot_q4_1(w, a)),
        WeightFormat::Q4_0 => |w, a| w.map(|w| dot_q4_0(w, a)),
        WeightFormat::Q8_0 => |w, a| w.map(|w| dot_q8_0(w, a)),
    }
}

/// The dot product for `format`: AVX2 where the CPU has it, portable code elsewhere; both
/// compute the same lanes in the same order, so results do not depend on the machine.
fn dot_kernel(format: WeightFormat) -> fn(&[u8], &QuantizedRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return match format {
            WeightFormat::Q4_1 => x86::dot_q4_1,
            WeightFormat::Q4_0 => x86::dot_q4_0,
            WeightFormat::Q8_0 => x86::dot_q8_0,
        };
    }
    match format {
        WeightFormat::Q4_1 => dot_q4_1,
        WeightFormat::Q4_0 => dot_q4_0,
        WeightFormat::Q8_0 => dot_q8_0,
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
    let simd = std::arch::is_x86_feature_detected!("avx2");
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        #[cfg(target_arch = "x86_64")]
        let (d, sum) = if simd {
            x86::quantize_block(block, q)
        } else {
            quantize_block(block, q)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (d, sum) = quantize_block(block, q);
        row.d.push(f16::from_f32(d).to_f32());
        if with_sums {
            row.s.push(f16::from_f32(d * sum as f32).to_f32());
        }
    }
    row
}

/// One block of [`quantize_row`]: writes the 32 bytes and returns the scale (before f16
/// rounding) and the sum of the bytes.
fn quantize_block(block: &[f32], q: &mut [i8]) -> (f32, i32) {
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
fn block_lanes(w: &[i8; BLOCK], a: &[i8]) -> [f32; 8] {
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
fn nibbles(qs: &[u8], offset: i8) -> [i8; BLOCK] {
    let mut q = [0i8; BLOCK];
    for j in 0..BLOCK / 2 {
        q[j] = (qs[j] & 0x0F) as i8 - offset;
        q[j + BLOCK / 2] = (qs[j] >> 4) as i8 - offset;
    }
    q
}

/// ggml's `hsum_float_8`: halves added, then pairs, then the last two.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let r = [r[0] + r[2], r[1] + r[3]];
    r[0] + r[1]
}

/// Eight lanes accumulated with fused multiply-adds, block after block.
#[inline(always)]
fn accumulate(acc: &mut [f32; 8], d: f32, lanes: [f32; 8]) {
    for (acc, l) in acc.iter_mut().zip(lanes) {
        *acc = d.mul_add(l, *acc);
    }
}

/// `ggml_vec_dot_q4_1_q8_1`: eight fused lanes plus a fused running sum of `m * s`.
fn dot_q4_1(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, b) in w.chunks_exact(20).enumerate() {
        summs = f16_at(b, 2).mul_add(a.s[i], summs);
        let lanes = block_lanes(&nibbles(&b[4..], 0), &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc) + summs
}

/// `ggml_vec_dot_q4_0_q8_0`.
fn dot_q4_0(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(18).enumerate() {
        let lanes = block_lanes(&nibbles(&b[2..], 8), &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q8_0_q8_0`.
fn dot_q8_0(w: &[u8], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.chunks_exact(34).enumerate() {
        let mut q = [0i8; BLOCK];
        for (dst, &src) in q.iter_mut().zip(&b[2..]) {
            *dst = src as i8;
        }
        let lanes = block_lanes(&q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        accumulate(&mut acc, f16_at(b, 0) * a.d[i], lanes);
    }
    hsum8(acc)
}

/// The same dot products with AVX2: `maddubs` + `madd` give exactly the eight four-value
/// integer lanes of the portable code, then one fused multiply-add per block.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{f16_at, hsum8, QuantizedRow, BLOCK};

    /// Prefetches the cache line holding the start of `line` into every cache level.
    #[inline]
    pub(super) fn prefetch_line(line: &[u8]) {
        // SAFETY: a prefetch is a hint that never faults, and SSE is part of every x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) }
    }

    /// Eight f32 lanes of a vector.
    #[inline(always)]
    fn lanes(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: `out` holds exactly eight f32; storeu has no alignment requirement.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    /// Unsigned weight bytes times signed activation bytes, four products per i32 lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lane_sums(qx: __m256i, qy: __m256i) -> __m256 {
        let pairs = _mm256_maddubs_epi16(qx, qy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs))
    }

    /// [`super::quantize_block`] with AVX2: the same scale, `127 / amax` products and
    /// round-half-even conversion (the default rounding mode), so the same bytes.
    #[inline]
    pub(super) fn quantize_block(block: &[f32], q: &mut [i8]) -> (f32, i32) {
        // SAFETY: chosen by `quantize_row` only after `is_x86_feature_detected!` found avx2.
        unsafe { quantize_block_avx2(block, q) }
    }

    #[target_feature(enable = "avx2")]
    fn quantize_block_avx2(block: &[f32], q: &mut [i8]) -> (f32, i32) {
        assert!(block.len() == BLOCK && q.len() == BLOCK);
        // SAFETY: `block` holds exactly 32 f32 (asserted): four unaligned 8-lane loads.
        let v = unsafe {
            let p = block.as_ptr();
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
        );
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let i = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
        ];
        let total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let t4 = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256::<1>(total),
        );
        let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2)));
        // Packing interleaves 128-bit lanes; the permutation restores value order.
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `q` holds exactly 32 bytes (asserted); storeu is unaligned.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered) };
        (d, sum)
    }

    /// The 32 values of a 4-bit block minus `offset` into `dst`, with SSE2 (every x86-64).
    #[inline(always)]
    pub(super) fn unpack_nibbles(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
        // SAFETY: SSE2 is part of the x86-64 baseline every build of this module targets.
        unsafe { unpack_nibbles_sse2(qs, offset, dst) }
    }

    #[inline]
    #[target_feature(enable = "sse2")]
    fn unpack_nibbles_sse2(qs: &[u8], offset: i8, dst: &mut [i8; BLOCK]) {
        assert!(qs.len() >= 16);
        // SAFETY: the assertion guarantees 16 readable bytes; loadu is unaligned.
        let raw = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let (mask, off) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(offset));
        let lo = _mm_sub_epi8(_mm_and_si128(raw, mask), off);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), off);
        // SAFETY: `dst` is 32 bytes: two unaligned 16-byte stores fill it exactly.
        unsafe {
            _mm_storeu_si128(dst.as_mut_ptr().cast(), lo);
            _mm_storeu_si128(dst.as_mut_ptr().add(16).cast(), hi);
        }
    }

    /// The 32 nibbles of a 4-bit block as bytes, low nibbles first.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibbles(qs: &[u8]) -> __m256i {
        assert!(qs.len() >= 16);
        // SAFETY: the assertion guarantees 16 readable bytes; loadu is unaligned.
        let raw = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// One activation block's 32 signed bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn activation(a: &QuantizedRow, i: usize) -> __m256i {
        let q = &a.q[i * BLOCK..(i + 1) * BLOCK];
        // SAFETY: `q` is exactly 32 bytes; loadu is unaligned.
        unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn q4_1(w: &[u8], a: &QuantizedRow) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        for (i, b) in w.chunks_exact(20).enumerate() {
            summs = f16_at(b, 2).mul_add(a.s[i], summs);
            let d = _mm256_set1_ps(f16_at(b, 0) * a.d[i]);
            acc = _mm256_fmadd_ps(d, lane_sums(nibbles(&b[4..]), activation(a, i)), acc);
        }
        hsum8(lanes(acc)) + summs
    }

    /// One block of one Q4_1 row: the fused `m * s` term and the eight-lane update.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn q4_1_block(
        b: &[u8],
        a: &QuantizedRow,
        i: usize,
        qy: __m256i,
        acc: __m256,
        summs: f32,
    ) -> (__m256, f32) {
        let summs = f16_at(b, 2).mul_add(a.s[i], summs);
        let d = _mm256_set1_ps(f16_at(b, 0) * a.d[i]);
        (
            _mm256_fmadd_ps(d, lane_sums(nibbles(&b[4..]), qy), acc),
            summs,
        )
    }

    #[target_feature(enable = "avx2,fma")]
    fn q4_1_x4(w: [&[u8]; 4], a: &QuantizedRow) -> [f32; 4] {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let (mut s0, mut s1, mut s2, mut s3) = (0f32, 0f32, 0f32, 0f32);
        let blocks = w.map(|r| r.chunks_exact(20));
        let [b0, b1, b2, b3] = blocks;
        for (i, (((x0, x1), x2), x3)) in b0.zip(b1).zip(b2).zip(b3).enumerate() {
            let qy = activation(a, i);
            (a0, s0) = q4_1_block(x0, a, i, qy, a0, s0);
            (a1, s1) = q4_1_block(x1, a, i, qy, a1, s1);
            (a2, s2) = q4_1_block(x2, a, i, qy, a2, s2);
            (a3, s3) = q4_1_block(x3, a, i, qy, a3, s3);
        }
        [
            hsum8(lanes(a0)) + s0,
            hsum8(lanes(a1)) + s1,
            hsum8(lanes(a2)) + s2,
            hsum8(lanes(a3)) + s3,
        ]
    }

    /// One block of one Q4_0/Q8_0 row: the eight-lane update.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn signed_block(
        b: &[u8],
        a: &QuantizedRow,
        i: usize,
        qy: __m256i,
        acc: __m256,
        four_bit: bool,
    ) -> __m256 {
        let qx = if four_bit {
            _mm256_sub_epi8(nibbles(&b[2..]), _mm256_set1_epi8(8))
        } else {
            assert!(b.len() >= 34);
            // SAFETY: the assertion guarantees the block's 32 value bytes after its scale.
            unsafe { _mm256_loadu_si256(b[2..].as_ptr().cast()) }
        };
        // |x| times sign(x)·y: the same products, with the unsigned-by-signed instruction.
        let prod = lane_sums(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
        _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0) * a.d[i]), prod, acc)
    }

    #[target_feature(enable = "avx2,fma")]
    fn signed_x4(w: [&[u8]; 4], a: &QuantizedRow, stride: usize, four_bit: bool) -> [f32; 4] {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let [b0, b1, b2, b3] = w.map(|r| r.chunks_exact(stride));
        for (i, (((x0, x1), x2), x3)) in b0.zip(b1).zip(b2).zip(b3).enumerate() {
            let qy = activation(a, i);
            a0 = signed_block(x0, a, i, qy, a0, four_bit);
            a1 = signed_block(x1, a, i, qy, a1, four_bit);
            a2 = signed_block(x2, a, i, qy, a2, four_bit);
            a3 = signed_block(x3, a, i, qy, a3, four_bit);
        }
        [a0, a1, a2, a3].map(|v| hsum8(lanes(v)))
    }

    #[target_feature(enable = "avx2,fma")]
    fn signed(w: &[u8], a: &QuantizedRow, stride: usize, four_bit: bool) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in w.chunks_exact(stride).enumerate() {
            acc = signed_block(b, a, i, activation(a, i), acc, four_bit);
        }
        hsum8(lanes(acc))
    }

    #[target_feature(enable = "avx2,fma")]
    fn tile_avx2(u: &super::Unpacked, a: &QuantizedRow) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0f32; 4];
        for i in 0..a.d.len() {
            let qy = activation(a, i);
            for r in 0..4 {
                let k = i * 4 + r;
                // SAFETY: each unpacked block is exactly 32 bytes; loadu is unaligned.
                let qx = unsafe { _mm256_loadu_si256(u.q[k].as_ptr().cast()) };
                let prod = if u.signed {
                    lane_sums(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx))
                } else {
                    summs[r] = u.m[k].mul_add(a.s[i], summs[r]);
                    lane_sums(qx, qy)
                };
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(u.d[k] * a.d[i]), prod, acc[r]);
            }
        }
        [0, 1, 2, 3].map(|r| hsum8(lanes(acc[r])) + if u.signed { 0.0 } else { summs[r] })
    }

    /// The four outputs of two paired accumulators (rows 0-1, 2-3): each half reduced as
    /// [`hsum8`] does, plus the row's `m · s` sum for Q4_1 (`with_mins`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finish_rows(acc: [__m512; 2], summs: __m128, with_mins: bool) -> [f32; 4] {
        let mut m = [0f32; 4];
        // SAFETY: `m` holds exactly four f32.
        unsafe { _mm_storeu_ps(m.as_mut_ptr(), summs) };
        let mut out = [0f32; 4];
        for (p, pair) in acc.iter().enumerate() {
            let mut all = [0f32; 16];
            // SAFETY: `all` holds exactly sixteen f32.
            unsafe { _mm512_storeu_ps(all.as_mut_ptr(), *pair) };
            for half in 0..2 {
                let mut l = [0f32; 8];
                l.copy_from_slice(&all[half * 8..half * 8 + 8]);
                let row = 2 * p + half;
                out[row] = hsum8(l) + if with_mins { m[row] } else { 0.0 };
            }
        }
        out
    }

    /// The 32-byte values of block `at` of two Q8_0 rows, one row per 256-bit half.
    ///
    /// # Safety
    /// Both rows must hold 32 readable bytes at `at`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn row_pair_q8(a: &[u8], b: &[u8], at: usize) -> __m512i {
        // SAFETY: the caller guarantees 32 readable bytes at `at` in both rows.
        unsafe {
            let lo = _mm256_loadu_si256(a.as_ptr().add(at).cast());
            let hi = _mm256_loadu_si256(b.as_ptr().add(at).cast());
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }
    }

    /// The 32 values of the 4-bit block whose 16 packed bytes start at `at` in each of two
    /// rows, minus `shift`, laid out `[a lo, a hi, b lo, b hi]` (16 bytes each).
    ///
    /// # Safety
    /// Both rows must hold 16 readable bytes at `at`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn row_pair_q4(a: &[u8], b: &[u8], at: usize, shift: i8) -> __m512i {
        // SAFETY: the caller guarantees 16 readable bytes at `at` in both rows.
        let y = unsafe {
            let lo = _mm_loadu_si128(a.as_ptr().add(at).cast());
            let hi = _mm_loadu_si128(b.as_ptr().add(at).cast());
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
        };
        // [a qs, b qs, a qs >> 4, b qs >> 4] -> [a lo, a hi, b lo, b hi].
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), _mm256_srli_epi16::<4>(y));
        let z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
        let z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), z);
        _mm512_sub_epi8(z, _mm512_set1_epi8(shift))
    }

    /// Q4_0 weights, for the `F` parameter of [`packed_avx512`].
    const FMT_Q4_0: u8 = 0;
    /// Q4_1 weights (unsigned values and a minimum per block).
    const FMT_Q4_1: u8 = 1;
    /// Q8_0 weights.
    const FMT_Q8_0: u8 = 2;

    /// Four GGUF weight rows of format `F` against `R` activation rows, two weight rows per
    /// 512-bit register (lanes 0..8 the first, 8..16 the second), unpacking each block
    /// straight from the GGUF bytes once for all `R` rows (no round trip through memory): the
    /// lanes, scales and fused multiply-adds of every output are exactly the 256-bit kernel's.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn packed_avx512<const F: u8, const R: usize>(
        w: [&[u8]; 4],
        acts: &[QuantizedRow],
        out: &mut [[f32; 4]],
    ) {
        let stride = match F {
            FMT_Q8_0 => super::WeightFormat::Q8_0,
            FMT_Q4_1 => super::WeightFormat::Q4_1,
            _ => super::WeightFormat::Q4_0,
        }
        .block_bytes();
        let unsigned = F == FMT_Q4_1;
        assert!(acts.len() == R && out.len() == R);
        let nb = acts[0].d.len();
        assert!(w.iter().all(|r| r.len() == nb * stride));
        assert!(acts
            .iter()
            .all(|a| a.d.len() == nb && a.q.len() == nb * BLOCK));
        assert!(!unsigned || acts.iter().all(|a| a.s.len() == nb));
        // [d0 m0 d1 m1 d2 m2 d3 m3] -> [d0 x8, d1 x8] and [d2 x8, d3 x8]; m as four lanes.
        let pair01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        let pair23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
        let mins = _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let mut summs = [_mm_setzero_ps(); R];
        for i in 0..nb {
            let at = i * stride;
            // SAFETY: every row holds `nb` blocks of `stride` bytes (asserted), so each read
            // below stays inside block `i` of its row; all loads are unaligned.
            let (qx, heads) = unsafe {
                let head = |r: usize| (w[r].as_ptr().add(at) as *const u32).read_unaligned();
                let heads = _mm_setr_epi32(
                    head(0) as i32,
                    head(1) as i32,
                    head(2) as i32,
                    head(3) as i32,
                );
                let qx = match F {
                    FMT_Q8_0 => [
                        row_pair_q8(w[0], w[1], at + 2),
                        row_pair_q8(w[2], w[3], at + 2),
                    ],
                    FMT_Q4_1 => [
                        row_pair_q4(w[0], w[1], at + 4, 0),
                        row_pair_q4(w[2], w[3], at + 4, 0),
                    ],
                    _ => [
                        row_pair_q4(w[0], w[1], at + 2, 8),
                        row_pair_q4(w[2], w[3], at + 2, 8),
                    ],
                };
                (qx, heads)
            };
            let dm = _mm512_castps256_ps512(_mm256_cvtph_ps(heads));
            let scales = [
                _mm512_permutexvar_ps(pair01, dm),
                _mm512_permutexvar_ps(pair23, dm),
            ];
            let m4 =
                _mm256_castps256_ps128(_mm256_permutevar8x32_ps(_mm512_castps512_ps256(dm), mins));
            // Signed weights: |x| times sign(x)·y (there is no 512-bit sign instruction).
            let (negative, magnitude) = if unsigned {
                ([0; 2], qx)
            } else {
                (
                    [_mm512_movepi8_mask(qx[0]), _mm512_movepi8_mask(qx[1])],
                    [_mm512_abs_epi8(qx[0]), _mm512_abs_epi8(qx[1])],
                )
            };
            for r in 0..R {
                let a = &acts[r];
                // SAFETY: block `i` of each activation is 32 bytes inside its `q` (asserted).
                let qy = unsafe {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(a.q.as_ptr().add(i * BLOCK).cast()))
                };
                let ad = _mm512_set1_ps(a.d[i]);
                for p in 0..2 {
                    let sy = if unsigned {
                        qy
                    } else {
                        _mm512_mask_sub_epi8(qy, negative[p], _mm512_setzero_si512(), qy)
                    };
                    let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude[p], sy);
                    let d = _mm512_mul_ps(scales[p], ad);
                    acc[r][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(prod), acc[r][p]);
                }
                if unsigned {
                    summs[r] = _mm_fmadd_ps(m4, _mm_set1_ps(a.s[i]), summs[r]);
                }
            }
        }
        for r in 0..R {
            out[r] = finish_rows(acc[r], summs[r], unsigned);
        }
    }

    /// [`packed_avx512`] over any number of activation rows, four at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn packed_rows_avx512<const F: u8>(w: [&[u8]; 4], acts: &[QuantizedRow], out: &mut [[f32; 4]]) {
        let fours = acts.len() / 4 * 4;
        for (a, o) in acts[..fours].chunks_exact(4).zip(out.chunks_exact_mut(4)) {
            packed_avx512::<F, 4>(w, a, o);
        }
        for (a, o) in acts[fours..].chunks(1).zip(out[fours..].chunks_mut(1)) {
            packed_avx512::<F, 1>(w, a, o);
        }
    }

    pub(super) fn packed_512_q4_1(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
        // SAFETY: chosen (`packed_tile_kernel`) only with the token of `wide::detect`, which
        // found avx512f, avx512bw, avx512vnni, avx2, fma and f16c.
        unsafe { packed_rows_avx512::<FMT_Q4_1>(w, a, out) }
    }

    pub(super) fn packed_512_q4_0(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
        // SAFETY: as in `packed_512_q4_1`.
        unsafe { packed_rows_avx512::<FMT_Q4_0>(w, a, out) }
    }

    pub(super) fn packed_512_q8_0(w: [&[u8]; 4], a: &[QuantizedRow], out: &mut [[f32; 4]]) {
        // SAFETY: as in `packed_512_q4_1`.
        unsafe { packed_rows_avx512::<FMT_Q8_0>(w, a, out) }
    }

    pub(super) fn tile(u: &super::Unpacked, a: &[QuantizedRow], out: &mut [[f32; 4]]) {
        for (a, out) in a.iter().zip(out) {
            // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
            *out = unsafe { tile_avx2(u, a) };
        }
    }

    pub(super) fn dot4_q4_1(w: [&[u8]; 4], a: &QuantizedRow) -> [f32; 4] {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { q4_1_x4(w, a) }
    }

    pub(super) fn dot4_q4_0(w: [&[u8]; 4], a: &QuantizedRow) -> [f32; 4] {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { signed_x4(w, a, 18, true) }
    }

    pub(super) fn dot4_q8_0(w: [&[u8]; 4], a: &QuantizedRow) -> [f32; 4] {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { signed_x4(w, a, 34, false) }
    }

    pub(super) fn dot_q4_1(w: &[u8], a: &QuantizedRow) -> f32 {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { q4_1(w, a) }
    }

    pub(super) fn dot_q4_0(w: &[u8], a: &QuantizedRow) -> f32 {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { signed(w, a, 18, true) }
    }

    pub(super) fn dot_q8_0(w: &[u8], a: &QuantizedRow) -> f32 {
        // SAFETY: chosen only after `is_x86_feature_detected!` found avx2 and fma.
        unsafe { signed(w, a, 34, false) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode_q4_1(rows: &[Vec<f32>]) -> Vec<u8> {
        let mut out = Vec::new();
        for row in rows {
            for block in row.chunks_exact(BLOCK) {
                let (lo, hi) = block
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let d = (hi - lo) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(lo).to_le_bytes());
                for j in 0..BLOCK / 2 {
                    let q0 = (((block[j] - lo) * id + 0.5) as u8).min(15);
                    let q1 = (((block[j + 16] - lo) * id + 0.5) as u8).min(15);
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        out
    }

    #[test]
    fn q4_1_matmul_approximates_the_float_product_and_is_batch_invariant() {
        let (rows, cols) = (24, 64);
        let w: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                (0..cols)
                    .map(|c| ((r * 31 + c * 7) % 23) as f32 / 23.0 - 0.5)
                    .collect()
            })
            .collect();
        let mat = QuantMatrix::from_gguf(WeightFormat::Q4_1, rows, cols, &encode_q4_1(&w))
            .expect("sizes");
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.4)
            .collect();
        let out = mat.matmul(&x);
        for i in 0..3 {
            for r in 0..rows {
                let exact: f32 = (0..cols).map(|c| w[r][c] * x[i * cols + c]).sum();
                assert!(
                    (out[i * rows + r] - exact).abs() < 0.1,
                    "{} vs {exact}",
                    out[i * rows + r]
                );
            }
        }
        let alone = mat.matmul(&x[2 * cols..]);
        assert_eq!(alone[..], out[2 * rows..]);
    }

    #[test]
    fn both_batch_splits_give_each_row_exactly_its_single_row_result() {
        // 38 rows: quads, a partial task and rows outside any quad.
        let (rows, cols) = (38, 96);
        let w: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                (0..cols)
                    .map(|c| ((r * 17 + c * 5) % 29) as f32 / 29.0 - 0.5)
                    .collect()
            })
            .collect();
        let mat = QuantMatrix::from_gguf(WeightFormat::Q4_1, rows, cols, &encode_q4_1(&w))
            .expect("sizes");
        // Batches on either side of WEIGHT_PARALLEL_MAX_ROWS.
        for m in [
            2,
            7,
            WEIGHT_PARALLEL_MAX_ROWS,
            WEIGHT_PARALLEL_MAX_ROWS + 1,
            70,
        ] {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 11) % 19) as f32 / 19.0 - 0.45)
                .collect();
            let out = mat.matmul(&x);
            for i in 0..m {
                let alone = mat.matmul(&x[i * cols..(i + 1) * cols]);
                assert_eq!(
                    alone[..],
                    out[i * rows..(i + 1) * rows],
                    "batch {m}, row {i}"
                );
            }
        }
    }

    #[test]
    fn activation_quantization_rounds_ties_to_even_like_ggml() {
        let mut x = vec![0f32; BLOCK];
        x[0] = 127.0;
        x[1] = 30.5;
        x[2] = -2.5;
        let q = quantize_row(&x, true);
        assert_eq!(&q.q[..3], &[127, 30, -2]);
        assert_eq!(q.d[0], 1.0);
        assert_eq!(q.s[0], 155.0);
    }

    #[test]
    fn every_kernel_matches_the_portable_code_bit_for_bit() {
        let nb = 6;
        let bytes: Vec<u8> = (0..64 * nb).map(|i| (i * 131 % 251) as u8).collect();
        // Scales must be finite f16 values: write them explicitly.
        let block = |fmt: WeightFormat| {
            let mut out = Vec::new();
            for (i, chunk) in bytes.chunks(fmt.block_bytes()).take(nb).enumerate() {
                let mut b = chunk.to_vec();
                b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 0.003).to_le_bytes());
                if fmt == WeightFormat::Q4_1 {
                    b[2..4].copy_from_slice(&f16::from_f32(-0.05 * i as f32).to_le_bytes());
                }
                out.extend(b);
            }
            out
        };
        let x: Vec<f32> = (0..BLOCK * nb)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for fmt in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let w = block(fmt);
            let a = quantize_row(&x, fmt == WeightFormat::Q4_1);
            let portable = match fmt {
                WeightFormat::Q4_1 => dot_q4_1(&w, &a),
                WeightFormat::Q4_0 => dot_q4_0(&w, &a),
                WeightFormat::Q8_0 => dot_q8_0(&w, &a),
            };
            let bits = |v: f32| v.to_bits();
            assert_eq!(bits(dot_kernel(fmt)(&w, &a)), bits(portable), "{fmt:?} dot");
            // Four different rows, so a mixed-up row order shows.
            let rows: Vec<Vec<u8>> = (0..4)
                .map(|r| {
                    let mut v = w.clone();
                    v.rotate_left(r * fmt.block_bytes());
                    v
                })
                .collect();
            let quad = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
            let want: Vec<u32> = quad.iter().map(|r| bits(dot_kernel(fmt)(r, &a))).collect();
            let four = dot4_kernel(fmt)(quad, &a);
            assert_eq!(four.map(bits).to_vec(), want, "{fmt:?} dot4");
            assert_eq!(want[0], bits(portable), "{fmt:?} dot");
            let mut u = Unpacked::default();
            u.fill(fmt, [&w, &w, &w, &w]);
            // Runs of 1, 4 and 6 activation rows (the wide kernels' groups and remainder).
            for n in [1, 4, 6] {
                let acts = vec![a.clone(); n];
                #[cfg(target_arch = "x86_64")]
                if let Some(cpu) = wide::detect() {
                    let packed = packed_tile_kernel(cpu, fmt);
                    let mut out = vec![[0f32; 4]; n];
                    packed(quad, &acts, &mut out);
                    for o in &out {
                        assert_eq!(o.map(bits).to_vec(), want, "{fmt:?} packed tile of {n}");
                    }
                }
                let mut kernels: Vec<Tile> = vec![tile_kernel(), tile_portable];
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    kernels.push(x86::tile);
                }
                for kernel in kernels {
                    let mut out = vec![[0f32; 4]; n];
                    kernel(&u, &acts, &mut out);
                    assert!(
                        out.iter().flatten().all(|&v| bits(v) == bits(portable)),
                        "{fmt:?} tile of {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn vector_activation_quantization_matches_the_scalar_code() {
        // Ties at every scale, zeros, a zero block, negatives and large magnitudes.
        let mut x: Vec<f32> = (0..BLOCK * 8)
            .map(|i| ((i * 7919 % 509) as f32 - 254.0) * 0.37)
            .collect();
        x[..BLOCK].fill(0.0);
        x[BLOCK] = 127.0;
        x[BLOCK + 1] = 30.5;
        x[BLOCK + 2] = -2.5;
        x[BLOCK + 3] = 0.5;
        x[2 * BLOCK] = -1e30;
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            let (mut scalar, mut wide) = ([0i8; BLOCK], [0i8; BLOCK]);
            let want = quantize_block(block, &mut scalar);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                let got = x86::quantize_block(block, &mut wide);
                assert_eq!(
                    (got.0.to_bits(), got.1),
                    (want.0.to_bits(), want.1),
                    "block {b}"
                );
                assert_eq!(wide, scalar, "block {b}");
            }
            let mut unpacked = [0i8; BLOCK];
            let packed: Vec<u8> = (0..16).map(|j| (j * 37 + b) as u8).collect();
            unpack_nibbles(&packed, 8, &mut unpacked);
            assert_eq!(unpacked, nibbles(&packed, 8));
            let _ = &mut wide;
        }
    }

    #[test]
    fn mismatched_sizes_are_refused() {
        assert!(QuantMatrix::from_gguf(WeightFormat::Q8_0, 2, 32, &[0u8; 10]).is_none());
        assert!(QuantMatrix::from_gguf(WeightFormat::Q8_0, 2, 30, &[0u8; 68]).is_none());
    }

    #[test]
    fn a_stacked_matrix_gives_each_part_exactly_its_own_rows() {
        // Parts of 9, 6 and 3 rows: quads straddle the parts' boundaries once stacked.
        let part = |rows: usize, salt: usize| {
            let w: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    (0..64)
                        .map(|c| ((r * 13 + c * 3 + salt) % 31) as f32 / 31.0 - 0.5)
                        .collect()
                })
                .collect();
            QuantMatrix::from_gguf(WeightFormat::Q4_1, rows, 64, &encode_q4_1(&w)).expect("sizes")
        };
        let parts = [part(9, 1), part(6, 2), part(3, 3)];
        let stacked = QuantMatrix::stack(&parts.iter().collect::<Vec<_>>()).expect("same format");
        assert_eq!((stacked.rows(), stacked.cols()), (18, 64));
        for m in [1, 5, 40] {
            let x: Vec<f32> = (0..m * 64)
                .map(|i| ((i * 11) % 19) as f32 / 19.0 - 0.5)
                .collect();
            let all = stacked.matmul(&x);
            let mut offset = 0;
            for p in &parts {
                let alone = p.matmul(&x);
                for i in 0..m {
                    let got = &all[i * 18 + offset..i * 18 + offset + p.rows()];
                    assert_eq!(got, &alone[i * p.rows()..(i + 1) * p.rows()], "{m} rows");
                }
                offset += p.rows();
            }
        }
        let q8 = QuantMatrix::from_gguf(WeightFormat::Q8_0, 1, 64, &[0u8; 68]).expect("sizes");
        assert!(QuantMatrix::stack(&[&parts[0], &q8]).is_none());
        assert!(QuantMatrix::stack(&[]).is_none());
    }

    #[test]
    fn matrices_moved_into_huge_pages_give_the_same_results() {
        let part = |rows: usize, cols: usize, salt: usize| {
            let w: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    (0..cols)
                        .map(|c| ((r * 7 + c * 5 + salt) % 37) as f32 / 37.0 - 0.5)
                        .collect()
                })
                .collect();
            QuantMatrix::from_gguf(WeightFormat::Q4_1, rows, cols, &encode_q4_1(&w)).expect("sizes")
        };
        let own = [part(12, 64, 1), part(5, 96, 2), part(8, 32, 3)];
        let mut shared = own.clone();
        QuantMatrix::share_huge_pages(&mut shared.iter_mut().collect::<Vec<_>>());
        for (a, b) in own.iter().zip(&shared) {
            assert!(matches!(b.data, Bytes::Shared(..)));
            assert_eq!(a.gguf_bytes(), b.gguf_bytes());
            for m in [1, 9, 40] {
                let x: Vec<f32> = (0..m * a.cols())
                    .map(|i| ((i * 11) % 19) as f32 / 19.0 - 0.5)
                    .collect();
                assert_eq!(a.matmul(&x), b.matmul(&x), "{m} rows");
            }
        }
    }

    #[test]
    fn rows_decode_as_candle_dequantizes_them() {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let (rows, cols) = (6, 96);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37) % 101) as f32 / 25.0 - 2.0 + (i % 7) as f32 * 1e-3)
            .collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        for (dtype, format) in [
            (GgmlDType::Q4_0, WeightFormat::Q4_0),
            (GgmlDType::Q4_1, WeightFormat::Q4_1),
            (GgmlDType::Q8_0, WeightFormat::Q8_0),
        ] {
            let q = QTensor::quantize(&t, dtype).expect("quantizes");
            let want = q
                .dequantize(&Device::Cpu)
                .and_then(|d| d.to_vec2::<f32>())
                .expect("dequantizes");
            let data = q.data().expect("bytes");
            let m = QuantMatrix::from_gguf(format, rows, cols, &data).expect("sizes");
            for (r, want) in want.iter().enumerate() {
                let mut got = vec![0f32; cols];
                m.dequantize_row(r, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "{format:?} row {r}");
            }
        }
    }
}
