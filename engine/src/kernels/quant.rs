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

use half::f16;
use rayon::prelude::*;

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

/// One weight block, unpacked for the dot product: 32 unsigned or signed 8-bit values.
#[derive(Debug, Clone, Copy)]
struct WeightBlock {
    d: f32,
    m: f32,
    q: [i8; BLOCK],
}

/// A `[rows, cols]` quantized weight matrix, used as `x @ W^T`.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    blocks: Vec<WeightBlock>,
    bytes: usize,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl QuantMatrix {
    /// Parses GGUF block data of a `[rows, cols]` matrix; `None` if the sizes disagree.
    pub fn from_gguf(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        if cols % BLOCK != 0 || data.len() != rows * cols / BLOCK * format.block_bytes() {
            return None;
        }
        let blocks = data
            .chunks_exact(format.block_bytes())
            .map(|b| {
                let mut q = [0i8; BLOCK];
                match format {
                    WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                        // Low nibbles hold values 0..16, high nibbles 16..32; Q4_0 is offset by 8.
                        let (qs, shift) = if format == WeightFormat::Q4_0 {
                            (&b[2..], 8)
                        } else {
                            (&b[4..], 0)
                        };
                        for j in 0..BLOCK / 2 {
                            q[j] = (qs[j] & 0x0F) as i8 - shift;
                            q[j + BLOCK / 2] = (qs[j] >> 4) as i8 - shift;
                        }
                    }
                    WeightFormat::Q8_0 => {
                        for (dst, &src) in q.iter_mut().zip(&b[2..]) {
                            *dst = src as i8;
                        }
                    }
                }
                let m = if format == WeightFormat::Q4_1 {
                    f16_at(b, 2)
                } else {
                    0.0
                };
                WeightBlock {
                    d: f16_at(b, 0),
                    m,
                    q,
                }
            })
            .collect();
        Some(QuantMatrix {
            format,
            rows,
            cols,
            blocks,
            bytes: data.len(),
        })
    }

    /// Output features (rows of the weight).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns of the weight).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the weight occupies in its GGUF encoding (what a pass streams from memory).
    pub fn gguf_bytes(&self) -> usize {
        self.bytes
    }

    /// `x` (`[m, cols]`, row-major) times the transposed weight: `[m, rows]`.
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.cols;
        let with_sums = self.format == WeightFormat::Q4_1;
        let acts: Vec<QuantizedRow> = x
            .chunks_exact(self.cols)
            .map(|r| quantize_row(r, with_sums))
            .collect();
        let nb = self.cols / BLOCK;
        // Column-major scratch so each worker owns whole weight rows.
        let mut out_t = vec![0f32; self.rows * m];
        out_t
            .par_chunks_mut(m * 16)
            .enumerate()
            .for_each(|(chunk, dst)| {
                for (r, col) in dst.chunks_mut(m).enumerate() {
                    let row = chunk * 16 + r;
                    let w = &self.blocks[row * nb..(row + 1) * nb];
                    for (out, a) in col.iter_mut().zip(&acts) {
                        *out = match self.format {
                            WeightFormat::Q4_1 => dot_q4_1(w, a),
                            WeightFormat::Q4_0 | WeightFormat::Q8_0 => dot_q8(w, a),
                        };
                    }
                }
            });
        let mut out = vec![0f32; m * self.rows];
        for (row, col) in out_t.chunks_exact(m).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                out[i * self.rows + row] = v;
            }
        }
        out
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
    for (block, q) in x.chunks_exact(BLOCK).zip(row.q.chunks_exact_mut(BLOCK)) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (dst, &v) in q.iter_mut().zip(block) {
            let r = (v * id).round_ties_even() as i32;
            sum += r;
            *dst = r as i8;
        }
        row.d.push(f16::from_f32(d).to_f32());
        if with_sums {
            row.s.push(f16::from_f32(d * sum as f32).to_f32());
        }
    }
    row
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

/// ggml's `hsum_float_8`: halves added, then pairs, then the last two.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let r = [r[0] + r[2], r[1] + r[3]];
    r[0] + r[1]
}

/// `ggml_vec_dot_q4_1_q8_1`: eight fused lanes plus a fused running sum of `m * s`.
fn dot_q4_1(w: &[WeightBlock], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, b) in w.iter().enumerate() {
        summs = b.m.mul_add(a.s[i], summs);
        let d = b.d * a.d[i];
        let lanes = block_lanes(&b.q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(l, *acc);
        }
    }
    hsum8(acc) + summs
}

/// `ggml_vec_dot_q4_0_q8_0` and `ggml_vec_dot_q8_0_q8_0`: eight fused lanes.
fn dot_q8(w: &[WeightBlock], a: &QuantizedRow) -> f32 {
    let mut acc = [0f32; 8];
    for (i, b) in w.iter().enumerate() {
        let d = b.d * a.d[i];
        let lanes = block_lanes(&b.q, &a.q[i * BLOCK..(i + 1) * BLOCK]);
        for (acc, l) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(l, *acc);
        }
    }
    hsum8(acc)
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
    fn mismatched_sizes_are_refused() {
        assert!(QuantMatrix::from_gguf(WeightFormat::Q8_0, 2, 32, &[0u8; 10]).is_none());
        assert!(QuantMatrix::from_gguf(WeightFormat::Q8_0, 2, 30, &[0u8; 68]).is_none());
    }
}
