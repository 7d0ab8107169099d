//! Products with floating-point weights (F32, F16, BF16), in ggml's `ggml_vec_dot_f32` /
//! `ggml_vec_dot_f16` arithmetic as its AVX-512 build runs it: each output is 64 partial
//! sums in f32, one fused multiply-add per value over the columns in steps of 64, folded
//! as `(p[l] + p[32+l]) + (p[16+l] + p[48+l])` into 16 lanes and those by halves
//! (`_mm512_reduce_add_ps`), then the columns past the last whole step. F16 weights meet
//! activations rounded to f16 (ggml's `vec_dot_type`) and add the leftover products in
//! f64; F32 and BF16 weights meet the f32 activations (BF16 widened exactly, our own
//! definition: ggml rounds the activations to BF16). Every tier computes that same
//! arithmetic, so results are equal bit for bit between tiers and between batch sizes.

use std::borrow::Cow;

use rayon::prelude::*;

use super::{
    task_pieces, QuantMatrix, ACT_ROWS_PER_TASK, TASK_OUTPUT_BYTES, WEIGHT_PARALLEL_MAX_ROWS,
};
use crate::buffers::Buf;
use crate::cpu;

/// Partial sums per output: the values one step of the column loop covers.
pub(crate) const LANES: usize = 64;

/// Most activation rows one [`FloatKernel::tile`] call takes: four register tiles of four.
pub(crate) const TILE_ROWS: usize = 16;

/// Columns each of a tile's passes covers before the next activation rows' turn (a multiple
/// of 64): the four weight rows' block (8 KiB of f32) stays in the L1 cache while all
/// [`TILE_ROWS`] activation rows meet it, where whole widened rows of a 2048- to 8192-wide
/// layer (32 to 128 KiB) would be fetched from L2 again for every few activation rows.
pub(crate) const TILE_BLOCK: usize = 512;

/// A floating-point weight encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatFormat {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16: the upper half of an f32.
    BF16,
}

impl FloatFormat {
    /// Bytes per value.
    pub const fn bytes(self) -> usize {
        match self {
            FloatFormat::F32 => 4,
            FloatFormat::F16 | FloatFormat::BF16 => 2,
        }
    }

    /// Value `i` of a little-endian row, exactly.
    #[inline(always)]
    pub(crate) fn at(self, row: &[u8], i: usize) -> f32 {
        match self {
            FloatFormat::F32 => {
                let b = &row[4 * i..4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            FloatFormat::F16 => {
                half::f16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32()
            }
            FloatFormat::BF16 => {
                f32::from_bits(u32::from(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) << 16)
            }
        }
    }

    /// The row's values, exactly, into `out`.
    pub(crate) fn widen(self, row: &[u8], out: &mut [f32]) {
        match self {
            FloatFormat::F32 => {
                for (y, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            FloatFormat::F16 => {
                for (y, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *y = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            FloatFormat::BF16 => {
                for (y, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *y = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
        }
    }

    /// The activation row as this format's dot product reads it: rounded to f16 (to
    /// nearest, ties to even) for F16 weights, as it is otherwise.
    pub(crate) fn activations(self, x: &[f32]) -> Cow<'_, [f32]> {
        match self {
            FloatFormat::F16 => {
                let mut out = vec![0.0; x.len()];
                self.activations_into(x, &mut out);
                Cow::Owned(out)
            }
            FloatFormat::F32 | FloatFormat::BF16 => Cow::Borrowed(x),
        }
    }

    /// [`Self::activations`] written into `out` (as long as `x`).
    pub(crate) fn activations_into(self, x: &[f32], out: &mut [f32]) {
        match self {
            FloatFormat::F16 => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = half::f16::from_f32(v).to_f32();
                }
            }
            FloatFormat::F32 | FloatFormat::BF16 => out.copy_from_slice(x),
        }
    }
}

/// `_mm512_reduce_add_ps`'s order on 16 lanes: halves added lane by lane until one is left.
#[inline(always)]
pub(crate) fn fold16(c: [f32; 16]) -> f32 {
    let s: [f32; 8] = std::array::from_fn(|i| c[i] + c[i + 8]);
    let u: [f32; 4] = std::array::from_fn(|j| s[j] + s[j + 4]);
    (u[0] + u[2]) + (u[1] + u[3])
}

/// The 64 partial sums of [`LANES`] folded to one, as ggml's `GGML_F32x16_REDUCE`.
#[inline(always)]
pub(crate) fn fold64(p: &[f32; LANES]) -> f32 {
    fold16(std::array::from_fn(|l| {
        (p[l] + p[32 + l]) + (p[16 + l] + p[48 + l])
    }))
}

/// The folded sum plus the columns past the last whole step, each product rounded to f32
/// and added in f64 for F16, in f32 otherwise.
#[inline(always)]
pub(crate) fn finish(
    format: FloatFormat,
    folded: f32,
    tail: impl Iterator<Item = (f32, f32)>,
) -> f32 {
    if format == FloatFormat::F16 {
        let mut s = f64::from(folded);
        for (w, x) in tail {
            s += f64::from(w * x);
        }
        s as f32
    } else {
        tail.fold(folded, |s, (w, x)| s + w * x)
    }
}

/// One weight row in its encoding against one activation row (already as
/// [`FloatFormat::activations`] gives it), portably.
pub(crate) fn dot_portable(format: FloatFormat, w: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut p = [0f32; LANES];
    let mut chunk = [0f32; LANES];
    for (i, xs) in x[..whole].chunks_exact(LANES).enumerate() {
        let bytes = LANES * format.bytes();
        format.widen(&w[i * bytes..(i + 1) * bytes], &mut chunk);
        for l in 0..LANES {
            p[l] = chunk[l].mul_add(xs[l], p[l]);
        }
    }
    let tail = (whole..k).map(|i| (format.at(w, i), x[i]));
    finish(format, fold64(&p), tail)
}

/// One widened weight row against one activation row, portably.
pub(crate) fn dot_f32_portable(format: FloatFormat, w: &[f32], x: &[f32]) -> f32 {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut p = [0f32; LANES];
    for (ws, xs) in w[..whole]
        .chunks_exact(LANES)
        .zip(x[..whole].chunks_exact(LANES))
    {
        for l in 0..LANES {
            p[l] = ws[l].mul_add(xs[l], p[l]);
        }
    }
    let tail = w[whole..k].iter().copied().zip(x[whole..k].iter().copied());
    finish(format, fold64(&p), tail)
}

/// The vector code this CPU runs for floating-point weights.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FloatKernel {
    /// [`dot_portable`] and [`dot_f32_portable`].
    Portable,
    /// Eight 8-lane accumulators per output.
    #[cfg(target_arch = "x86_64")]
    Avx2(cpu::Avx2),
    /// Four 16-lane accumulators per output, four weight rows at a time.
    #[cfg(target_arch = "x86_64")]
    Avx512(cpu::Avx512),
}

impl FloatKernel {
    /// The best kernel `features` allow.
    pub(crate) fn new(features: cpu::Features) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(cpu) = features.avx512() {
                return FloatKernel::Avx512(cpu);
            }
            if let Some(cpu) = features.avx2() {
                return FloatKernel::Avx2(cpu);
            }
        }
        let _ = features;
        FloatKernel::Portable
    }

    /// Weight row `w` (in `format`) against activation row `x`.
    pub(crate) fn dot(self, format: FloatFormat, w: &[u8], x: &[f32]) -> f32 {
        match self {
            FloatKernel::Portable => dot_portable(format, w, x),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_dot(cpu, format, w, x),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::dot(cpu, format, w, x),
        }
    }

    /// Four widened weight rows against activation rows `x` (a multiple of four, at most
    /// [`TILE_ROWS`]): `out[a][r]`, each equal to [`FloatKernel::quad`] of row `a`.
    /// `ahead`'s cache lines are fetched while it computes.
    pub(crate) fn tile(
        self,
        format: FloatFormat,
        w: [&[f32]; 4],
        x: &[&[f32]],
        ahead: &[u8],
        out: &mut [[f32; 4]],
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::tile(cpu, format, w, x, ahead, out),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_tile(cpu, format, w, x, ahead, out),
            FloatKernel::Portable => {
                super::prefetch(ahead);
                for (o, x) in out.iter_mut().zip(x) {
                    *o = self.quad(format, w, x);
                }
            }
        }
    }

    /// Weight row `row` (in `format`) widened exactly to f32 into `out`.
    pub(crate) fn widen(self, format: FloatFormat, row: &[u8], out: &mut [f32]) {
        assert!(
            row.len() >= out.len() * format.bytes(),
            "weight row shorter than its output"
        );
        let done = match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::widen(cpu, format, row, out),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_widen(cpu, format, row, out),
            FloatKernel::Portable => 0,
        };
        for (i, v) in out.iter_mut().enumerate().skip(done) {
            *v = format.at(row, i);
        }
    }

    /// Four widened weight rows against activation row `x`.
    pub(crate) fn quad(self, format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        match self {
            FloatKernel::Portable => w.map(|w| dot_f32_portable(format, w, x)),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => w.map(|w| super::avx2::float_dot_f32(cpu, format, w, x)),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::quad(cpu, format, w, x),
        }
    }
}

/// Checks a tile's rows (`x` a multiple of `group` rows, at most [`TILE_ROWS`], as many
/// outputs, every row as long as `x[0]`) and returns their length.
pub(crate) fn tile_columns(w: [&[f32]; 4], x: &[&[f32]], outputs: usize, group: usize) -> usize {
    let k = x.first().map_or(0, |x| x.len());
    assert!(
        x.len().is_multiple_of(group) && x.len() <= TILE_ROWS && outputs >= x.len(),
        "a tile takes activation rows {group} at a time, at most {TILE_ROWS}"
    );
    assert!(
        w.iter().all(|w| w.len() >= k) && x.iter().all(|x| x.len() == k),
        "rows shorter than the product's input"
    );
    k
}

/// `ahead` cut into one share of whole cache lines for each of a tile's `passes`.
pub(crate) fn shares(ahead: &[u8], passes: usize) -> std::slice::Chunks<'_, u8> {
    ahead.chunks(64 * ahead.len().div_ceil(64).div_ceil(passes.max(1)).max(1))
}

/// `len` f32 of `store` (grown as needed) starting on a 64-byte cache line.
fn aligned(store: &mut Vec<f32>, len: usize) -> &mut [f32] {
    store.resize(len + 16, 0.0);
    let at = store.as_ptr().align_offset(64).min(16);
    &mut store[at..at + len]
}

impl QuantMatrix {
    /// [`QuantMatrix::matmul`] for floating-point weights: the weight rows split among the
    /// threads for decode steps and short prefills (each row read once for every
    /// activation row), the activation rows for long prefills. With more than one
    /// activation row, each group of four weight rows is widened to f32 once and reused
    /// from cache for all of them.
    pub(super) fn matmul_float(&self, format: FloatFormat, x: &[f32], m: usize) -> Buf {
        let kernel = FloatKernel::new(cpu::detect());
        // Several rows are read many times over by the tiles: written (as the format reads
        // them) to start on a cache line, so (with a row length a multiple of 16) no vector
        // load straddles two.
        let (mut store, one);
        let x: &[f32] = if m > 1 {
            store = Vec::new();
            let dst = aligned(&mut store, x.len());
            format.activations_into(x, dst);
            dst
        } else {
            one = format.activations(x);
            &one
        };
        let k = self.cols;
        let mut out = Buf::take(m * self.rows);
        if m <= WEIGHT_PARALLEL_MAX_ROWS {
            let per_task = self.rows_per_weight_task();
            let mut pieces = task_pieces(&mut out, self.rows, m, per_task);
            pieces
                .par_chunks_mut(m)
                .enumerate()
                .for_each_init(Vec::new, |scratch, (task, dst)| {
                    let first = task * per_task;
                    let n = dst[0].len();
                    self.float_rows(kernel, format, first..first + n, x, scratch, |i, r, v| {
                        dst[i][r - first] = v
                    });
                });
        } else {
            let (fewest, most) = ACT_ROWS_PER_TASK;
            let fit = (TASK_OUTPUT_BYTES / (self.rows * 4).max(1)).clamp(fewest, most);
            let per_task = fit.min(m.div_ceil(rayon::current_num_threads()).max(1));
            let rows = self.rows;
            out.par_chunks_mut(per_task * rows)
                .enumerate()
                .for_each_init(Vec::new, |scratch, (task, dst)| {
                    let first = task * per_task;
                    let acts = &x[first * k..(first + dst.len() / rows) * k];
                    self.float_rows(kernel, format, 0..rows, acts, scratch, |i, r, v| {
                        dst[i * rows + r] = v
                    });
                });
        }
        out
    }

    /// Weight rows `range` against every row of `acts`, each result handed to
    /// `put(activation row, weight row, value)`.
    fn float_rows(
        &self,
        kernel: FloatKernel,
        format: FloatFormat,
        range: std::ops::Range<usize>,
        acts: &[f32],
        scratch: &mut Vec<f32>,
        mut put: impl FnMut(usize, usize, f32),
    ) {
        let k = self.cols;
        let m = acts.len() / k.max(1);
        if m == 1 {
            // One activation row: the weights stream once, read in their encoding.
            self.prefetch_rows(range.start, range.start + 4, range.end);
            for r in range.clone() {
                self.prefetch_rows(r + 4, r + 5, range.end);
                put(0, r, kernel.dot(format, self.weight_row(r), acts));
            }
            return;
        }
        let quads = range.start + range.len() / 4 * 4;
        let scratch = aligned(scratch, 4 * k);
        let mut tiles = [[0f32; 4]; TILE_ROWS];
        for r in (range.start..quads).step_by(4) {
            for (j, w) in scratch.chunks_exact_mut(k).enumerate() {
                kernel.widen(format, self.weight_row(r + j), w);
            }
            let w: [&[f32]; 4] = std::array::from_fn(|j| &scratch[j * k..(j + 1) * k]);
            let fours = m / 4 * 4;
            // The next group's rows, fetched a share per tile while these compute (the
            // hardware prefetcher alone leaves the widening waiting on memory).
            let next = self.rows_bytes(r + 4, (r + 8).min(quads));
            let calls = fours.div_ceil(TILE_ROWS).max(1);
            let mut ahead = next.chunks(next.len().div_ceil(calls).max(1));
            for i in (0..fours).step_by(TILE_ROWS) {
                let n = TILE_ROWS.min(fours - i);
                let mut x: [&[f32]; TILE_ROWS] = [&[]; TILE_ROWS];
                for (x, row) in x.iter_mut().zip(acts[i * k..(i + n) * k].chunks_exact(k)) {
                    *x = row;
                }
                let ahead = ahead.next().unwrap_or_default();
                kernel.tile(format, w, &x[..n], ahead, &mut tiles[..n]);
                for (a, v) in tiles[..n].iter().enumerate() {
                    for (j, &v) in v.iter().enumerate() {
                        put(i + a, r + j, v);
                    }
                }
            }
            for i in fours..m {
                let v = kernel.quad(format, w, &acts[i * k..(i + 1) * k]);
                for (j, v) in v.into_iter().enumerate() {
                    put(i, r + j, v);
                }
            }
        }
        for r in quads..range.end {
            for (i, x) in acts.chunks_exact(k).enumerate() {
                put(i, r, kernel.dot(format, self.weight_row(r), x));
            }
        }
    }
}
