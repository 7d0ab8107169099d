//! Products with floating-point weights (F32, F16, BF16), in ggml's `ggml_vec_dot_f32` /
//! `ggml_vec_dot_f16` arithmetic as its AVX-512 build runs it: each output is 64 partial
//! sums in f32, one fused multiply-add per value over the columns in steps of 64, folded
//! as `(p[l] + p[32+l]) + (p[16+l] + p[48+l])` into 16 lanes and those by halves
//! (`_mm512_reduce_add_ps`), then the columns past the last whole step. F16 weights meet
//! activations rounded to f16 (ggml's `vec_dot_type`) and add the leftover products in
//! f64; F32 weights meet the f32 activations.
//!
//! BF16 weights meet activations rounded to BF16 as ggml rounds them, in the pairs
//! `vdpbf16ps` adds: each of the 64 partial sums takes a pair of adjacent columns per step of
//! 128, the odd column's product first, then the even one's, each a fused multiply-add (the
//! products of two BF16 values are exact in f32). The kernels see that as the F32 arithmetic
//! on values laid out in *pair order* — in every whole block of 128 columns the odd columns
//! first, then the even ones ([`FloatFormat::activations`], [`FloatKernel::widen`]) — so
//! every tier runs the F32 code on them, and the `vdpbf16ps` tier gives the same bits
//! wherever no input or partial sum can be subnormal (which it flushes to zero), and
//! leaves the rest to the multiply-adds ([`pairs_exact`]). Our own definition: ggml's
//! vector dot product and llamafile's sgemm each add BF16 products in orders of their own.
//!
//! Every tier computes that same arithmetic, so results are equal bit for bit between
//! tiers and between batch sizes.

use std::borrow::Cow;

use half::{bf16, f16};
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

/// Most bytes of activation rows (as the tiles read them) a task of a long float product
/// takes: each group of weight rows meets every one of them, so they stay in the core's L2
/// cache (2 MiB on the Xeon it was measured on). At 64 rows of 8192 columns of f32 (2 MiB, a
/// down projection's) they did not. F16 tile alone, one thread, eight weight rows at a time
/// against 8192-column activation rows, a 2-core Xeon (family 6, model 207): 64 rows a
/// task 28–30 GMAC/s, 32 rows 43; 2048-column rows, 64 or 128, 38–44.
const TASK_ACT_BYTES: usize = 1 << 20;

/// Columns each of the AVX2 tile's passes covers before the next activation rows' turn (a
/// multiple of 64): the four weight rows' block (8 KiB of f32) stays in the L1 cache while
/// all [`TILE_ROWS`] activation rows meet it, and each eighth's pass finds the lines the
/// eighth before it half read, where whole widened rows of a 2048- to 8192-wide layer (32
/// to 128 KiB) would be fetched from L2 again. Random 1.1B F16 prompt processing on Zen 4
/// capped to AVX2: 512 columns 34–37 tok/s, whole rows 28–29.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const TILE_BLOCK: usize = 512;

/// Columns of one BF16 pair-order block: 64 pairs, one for each partial sum.
pub(crate) const PAIR_BLOCK: usize = 2 * LANES;

/// The least exponent a BF16 weight's and an activation's least exponents may add up to for
/// `vdpbf16ps` to give the multiply-adds' bits: every product, and so every partial sum, is
/// then a multiple of `2^(ew + ex - 14)` (eight significant bits each), at least the
/// smallest normal f32 `2^-126`, so nothing it flushes to zero can arise.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PAIRS_EXACT_FROM: i32 = -112;

/// A BF16 value's exponent field (`0xff` for a zero, which bounds nothing) and whether it is
/// subnormal, infinite or NaN.
#[inline(always)]
fn exponent_field(b: u16) -> (u16, bool) {
    let exp = (b >> 7) & 0xff;
    let zero = b & 0x7fff == 0;
    (
        if zero { 0xff } else { exp },
        exp == 0xff || (exp == 0 && !zero),
    )
}

/// The least exponent field found and whether any value was odd, as an exponent.
fn least_exponent(least: u16, odd: bool) -> Option<i32> {
    (!odd).then(|| {
        if least == 0xff {
            i32::MAX
        } else {
            i32::from(least) - 127
        }
    })
}

/// The least binary exponent among the nonzero BF16 values `bits` (`i32::MAX` when all are
/// zero), or `None` when one is subnormal, infinite or NaN.
pub(crate) fn bf16_least_exponent(bits: impl Iterator<Item = u16>) -> Option<i32> {
    let (least, odd) = bits.fold((0xff, false), |(least, odd), b| {
        let (e, o) = exponent_field(b);
        (least.min(e), odd | o)
    });
    least_exponent(least, odd)
}

/// [`bf16_least_exponent`] of little-endian BF16 `bytes`, 32 lanes at a time so that it
/// vectorises (a whole model's weights pass through it once, at memory speed).
pub(crate) fn bf16_bytes_least_exponent(bytes: &[u8]) -> Option<i32> {
    let mut least = [0xffu16; 32];
    let mut odd = [false; 32];
    let mut step = |c: &[u8]| {
        for l in 0..32 {
            let (e, o) = exponent_field(u16::from_le_bytes([c[2 * l], c[2 * l + 1]]));
            least[l] = least[l].min(e);
            odd[l] |= o;
        }
    };
    let mut chunks = bytes.chunks_exact(64);
    for c in &mut chunks {
        step(c);
    }
    // The rest padded with zeros, which bound nothing.
    let mut rest = [0u8; 64];
    rest[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    step(&rest);
    let all = least.iter().copied().min().unwrap_or(0xff);
    least_exponent(all, odd.iter().any(|&o| o))
}

/// Whether `vdpbf16ps` computes the pair-order arithmetic exactly for weights and activations
/// with these [`bf16_least_exponent`]s: no subnormal input, and no product or partial sum
/// below the smallest normal f32.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn pairs_exact(weights: Option<i32>, activations: Option<i32>) -> bool {
    matches!((weights, activations), (Some(w), Some(x)) if w.saturating_add(x) >= PAIRS_EXACT_FROM)
}

/// `v` rounded to BF16 as ggml's `GGML_FP32_TO_BF16` rounds it: to nearest, ties to even,
/// NaN kept quiet.
fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// `row` (in original column order) written to `out` in BF16 pair order: in each whole
/// block of [`PAIR_BLOCK`] columns the odd columns, then the even ones; the columns past the
/// last whole block as they are.
fn pair_order<T: Copy>(row: &[T], out: &mut [T]) {
    let whole = row.len() / PAIR_BLOCK * PAIR_BLOCK;
    for (o, r) in out[..whole]
        .chunks_exact_mut(PAIR_BLOCK)
        .zip(row[..whole].chunks_exact(PAIR_BLOCK))
    {
        for u in 0..LANES {
            o[u] = r[2 * u + 1];
            o[LANES + u] = r[2 * u];
        }
    }
    out[whole..row.len()].copy_from_slice(&row[whole..]);
}

/// The BF16 bits of an activation row in pair order ([`FloatFormat::activations`] of a BF16
/// row) put back in column order, as `vdpbf16ps` reads them.
pub(crate) fn bf16_columns(paired: &[f32], out: &mut [u16]) {
    let whole = paired.len() / PAIR_BLOCK * PAIR_BLOCK;
    let bits = |v: f32| (v.to_bits() >> 16) as u16;
    for (o, p) in out[..whole]
        .chunks_exact_mut(PAIR_BLOCK)
        .zip(paired[..whole].chunks_exact(PAIR_BLOCK))
    {
        for u in 0..LANES {
            o[2 * u + 1] = bits(p[u]);
            o[2 * u] = bits(p[LANES + u]);
        }
    }
    for (o, &p) in out[whole..paired.len()].iter_mut().zip(&paired[whole..]) {
        *o = bits(p);
    }
}

/// The `vdpbf16ps` tiles ([`FloatKernel::pair_tiles`]): BF16 weight rows as stored against
/// activation rows as BF16 bits in column order.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PairTiles {
    /// AVX-512 BF16.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(cpu::Avx512Bf16),
}

impl PairTiles {
    /// BF16 weight row `w` against one activation row `x` (BF16 bits in column order):
    /// [`FloatKernel::dot`]'s result.
    pub(crate) fn dot(self, w: &[u8], x: &[u16]) -> f32 {
        let _ = (w, x);
        match self {
            #[cfg(target_arch = "x86_64")]
            PairTiles::Avx512Bf16(cpu) => super::avx512::bf16::dot(cpu, w, x),
        }
    }

    /// Four BF16 weight rows against activation rows `x` (a multiple of four, at most
    /// [`TILE_ROWS`]): `out[a][r]`, each [`FloatKernel::dot`]'s result. `ahead`'s cache lines
    /// are fetched while it computes.
    pub(crate) fn tile(self, w: [&[u8]; 4], x: &[&[u16]], ahead: &[u8], out: &mut [[f32; 4]]) {
        let _ = (w, x, ahead, &out);
        match self {
            #[cfg(target_arch = "x86_64")]
            PairTiles::Avx512Bf16(cpu) => super::avx512::bf16::tile(cpu, w, x, ahead, out),
        }
    }

    /// The activation rows [`PairTiles::tile8`]'s register tile takes per pass.
    pub(crate) const EIGHT_ROW_PASS: usize = 3;

    /// Eight BF16 weight rows against activation rows `x` (BF16 bits in column order, any
    /// number, at most [`TILE_ROWS`]): `out[a][r]`, each [`FloatKernel::dot`]'s result.
    /// `ahead`'s cache lines are fetched while it computes.
    pub(crate) fn tile8(self, w: [&[u8]; 8], x: &[&[u16]], ahead: &[u8], out: &mut [[f32; 8]]) {
        let _ = (w, x, ahead, &out);
        match self {
            #[cfg(target_arch = "x86_64")]
            PairTiles::Avx512Bf16(cpu) => super::avx512::bf16::tile8(cpu, w, x, ahead, out),
        }
    }
}

/// The tiles that read F16 or BF16 weight rows as stored ([`FloatKernel::stored_tiles`]),
/// widening each weight vector as they load it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StoredTiles {
    /// AVX2 with F16C, for F16. (BF16 rows read as stored, in pair order, were slower here
    /// than the widened copy: random 1.1B BF16 prompt processing of 512 tokens in the AVX2
    /// build, 76–85 tok/s against 93–95.)
    #[cfg(target_arch = "x86_64")]
    Avx2(cpu::Avx2),
    /// AVX-512 F, for this format.
    #[cfg(target_arch = "x86_64")]
    Avx512(cpu::Avx512, FloatFormat),
}

impl StoredTiles {
    /// Four weight rows as stored against activation rows `x` (a multiple of four, at most
    /// [`TILE_ROWS`]): `out[a][r]`, each [`FloatKernel::tile`]'s result on the rows widened.
    /// `ahead`'s cache lines are fetched while it computes.
    pub(crate) fn tile(self, w: [&[u8]; 4], x: &[&[f32]], ahead: &[u8], out: &mut [[f32; 4]]) {
        let _ = (w, x, ahead, &out);
        match self {
            #[cfg(target_arch = "x86_64")]
            StoredTiles::Avx2(cpu) => super::avx2::float_tile_f16(cpu, w, x, ahead, out),
            #[cfg(target_arch = "x86_64")]
            StoredTiles::Avx512(cpu, format) => {
                super::avx512::float::tile_stored(cpu, format, w, x, ahead, out)
            }
        }
    }

    /// The eight-row tiles, where this tier has a register file for them (AVX-512; AVX2's
    /// sixteen registers hold no tile wider than [`StoredTiles::tile`]'s).
    pub(crate) fn eight_rows(self) -> Option<EightRowTiles> {
        match self {
            #[cfg(target_arch = "x86_64")]
            StoredTiles::Avx512(cpu, format) => Some(EightRowTiles::Avx512(cpu, format)),
            #[cfg(target_arch = "x86_64")]
            StoredTiles::Avx2(_) => None,
        }
    }
}

/// The tiles that read eight F16 or BF16 weight rows as stored
/// ([`StoredTiles::eight_rows`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum EightRowTiles {
    /// AVX-512 F, for this format.
    #[cfg(target_arch = "x86_64")]
    Avx512(cpu::Avx512, FloatFormat),
}

impl EightRowTiles {
    /// The activation rows its register tile takes per pass.
    fn pass_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            EightRowTiles::Avx512(_, format) => super::avx512::float::tile8_pass_rows(format),
        }
    }

    /// Eight weight rows as stored against activation rows `x` (any number, at most
    /// [`TILE_ROWS`]): `out[a][r]`, each [`FloatKernel::dot`]'s result. `ahead`'s cache
    /// lines are fetched while it computes.
    pub(crate) fn tile(self, w: [&[u8]; 8], x: &[&[f32]], ahead: &[u8], out: &mut [[f32; 8]]) {
        let _ = (w, x, ahead, &out);
        match self {
            #[cfg(target_arch = "x86_64")]
            EightRowTiles::Avx512(cpu, format) => {
                super::avx512::float::tile8_stored(cpu, format, w, x, ahead, out)
            }
        }
    }
}

/// The eight-row tile a float product runs, where its tier has one for the format.
#[derive(Clone, Copy)]
enum EightRows {
    /// `vdpbf16ps` on the activations' BF16 bits in column order.
    Pairs(PairTiles),
    /// Rows as stored on the activations' values.
    Stored(EightRowTiles),
}

impl EightRows {
    /// The first activation row and the number of rows of each call of
    /// [`EightRows::tile`] for `m` activation rows: as many at a time as are a multiple of
    /// the rows the register tile takes per pass, but a last single row joins the call
    /// before it where the tile takes one more, rather than streaming the eight weight rows
    /// again on its own (the tile then runs sixteen rows as four threes and two twos). AMD
    /// EPYC (Zen 5), random 1.1B F16, a 16-request decode step's weight products 115–127 ->
    /// 113–117 ms, the whole step 123–128 -> 117–123 ms (six alternating pairs); 512-token
    /// prompts even.
    fn calls(self, m: usize) -> Vec<(usize, usize)> {
        let pass = match self {
            EightRows::Pairs(_) => PairTiles::EIGHT_ROW_PASS,
            EightRows::Stored(tiles) => tiles.pass_rows(),
        };
        let per_call = TILE_ROWS / pass * pass;
        let mut calls = Vec::new();
        let mut i = 0;
        while i < m {
            let mut n = per_call.min(m - i);
            if m - i - n == 1 && n < TILE_ROWS {
                n += 1;
            }
            calls.push((i, n));
            i += n;
        }
        calls
    }

    /// Eight weight rows as stored against `n` (at most [`TILE_ROWS`]) of the task's
    /// `k`-value activation rows from row `i`: `out[a][r]`, each [`FloatKernel::dot`]'s
    /// result. `ahead`'s cache lines are fetched while it computes.
    fn tile(
        self,
        w: [&[u8]; 8],
        acts: Acts<'_>,
        k: usize,
        (i, n): (usize, usize),
        ahead: &[u8],
        out: &mut [[f32; 8]],
    ) {
        match self {
            EightRows::Pairs(pairs) => {
                pairs.tile8(w, &act_rows(acts.columns, k, i, n)[..n], ahead, out)
            }
            EightRows::Stored(tiles) => tiles.tile(w, &act_rows(acts.x, k, i, n)[..n], ahead, out),
        }
    }
}

/// The value of BF16 bits, exactly.
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The values of an activation row as the one-row dot products read them: f32, or the
/// 16-bit values F16 and BF16 weights' activations are rounded to, exact in half the bytes.
/// The row is read again for every weight row, and at 8192 columns an f32 row no longer
/// shares the L1 cache with the weights streaming past.
pub(crate) trait Activation: Copy + Sync {
    /// The encoding of the values, as the vector kernels widen it.
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    const FORMAT: FloatFormat;
    /// The value, exactly.
    fn value(self) -> f32;
}

impl Activation for f32 {
    const FORMAT: FloatFormat = FloatFormat::F32;
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
}

impl Activation for f16 {
    const FORMAT: FloatFormat = FloatFormat::F16;
    #[inline(always)]
    fn value(self) -> f32 {
        self.to_f32()
    }
}

impl Activation for bf16 {
    const FORMAT: FloatFormat = FloatFormat::BF16;
    #[inline(always)]
    fn value(self) -> f32 {
        self.to_f32()
    }
}

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
                f16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32()
            }
            FloatFormat::BF16 => bf16_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])),
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
                    *y = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            FloatFormat::BF16 => {
                for (y, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        }
    }

    /// The activation row as this format's dot product reads it: rounded to f16 (to
    /// nearest, ties to even) for F16 weights, rounded to BF16 and in pair order for BF16
    /// weights, as it is for F32.
    pub(crate) fn activations(self, x: &[f32]) -> Cow<'_, [f32]> {
        match self {
            FloatFormat::F16 | FloatFormat::BF16 => {
                let mut out = vec![0.0; x.len()];
                self.activations_into(x, &mut out);
                Cow::Owned(out)
            }
            FloatFormat::F32 => Cow::Borrowed(x),
        }
    }

    /// [`Self::activations`] of one row written into `out` (as long as `x`).
    pub(crate) fn activations_into(self, x: &[f32], out: &mut [f32]) {
        match self {
            FloatFormat::F16 => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = f16::from_f32(v).to_f32();
                }
            }
            FloatFormat::BF16 => {
                pair_order(x, out);
                for o in out.iter_mut() {
                    *o = round_bf16(*o);
                }
            }
            FloatFormat::F32 => out.copy_from_slice(x),
        }
    }

    /// How many of a row's `k` columns lie in whole pair-order blocks (BF16), 0 for the
    /// formats read in column order.
    pub(crate) fn paired_columns(self, k: usize) -> usize {
        if self == FloatFormat::BF16 {
            k / PAIR_BLOCK * PAIR_BLOCK
        } else {
            0
        }
    }

    /// Weight row `row` widened exactly, in the order the kernels read it: pair order for
    /// BF16, column order otherwise. `out` is as long as the row.
    pub(crate) fn widen_paired(self, row: &[u8], out: &mut [f32]) {
        let whole = self.paired_columns(out.len());
        let mut block = [0f32; PAIR_BLOCK];
        for (b, o) in out[..whole].chunks_exact_mut(PAIR_BLOCK).enumerate() {
            self.widen(
                &row[2 * b * PAIR_BLOCK..2 * (b + 1) * PAIR_BLOCK],
                &mut block,
            );
            pair_order(&block, o);
        }
        self.widen(&row[2 * whole..], &mut out[whole..]);
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
pub(crate) fn dot_portable<T: Activation>(format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut p = [0f32; LANES];
    let mut chunk = [0f32; PAIR_BLOCK];
    let paired = format.paired_columns(k);
    for (b, xs) in x[..paired].chunks_exact(PAIR_BLOCK).enumerate() {
        let bytes = 2 * PAIR_BLOCK;
        format.widen_paired(&w[b * bytes..(b + 1) * bytes], &mut chunk);
        for (ws, xs) in chunk.chunks_exact(LANES).zip(xs.chunks_exact(LANES)) {
            for l in 0..LANES {
                p[l] = ws[l].mul_add(xs[l].value(), p[l]);
            }
        }
    }
    for (i, xs) in x[paired..whole].chunks_exact(LANES).enumerate() {
        let bytes = LANES * format.bytes();
        let at = paired * format.bytes() + i * bytes;
        format.widen(&w[at..at + bytes], &mut chunk[..LANES]);
        for l in 0..LANES {
            p[l] = chunk[l].mul_add(xs[l].value(), p[l]);
        }
    }
    let tail = (whole..k).map(|i| (format.at(w, i), x[i].value()));
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
    /// [`FloatKernel::Avx512`], with BF16 weights multiplied by `vdpbf16ps` where
    /// [`pairs_exact`] holds (the caller's check).
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(cpu::Avx512Bf16),
    /// Sixteen 4-lane accumulators per output (arm64).
    #[cfg(target_arch = "aarch64")]
    Neon(cpu::Neon),
}

impl FloatKernel {
    /// The best kernel `features` allow.
    pub(crate) fn new(features: cpu::Features) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(cpu) = features.avx512_bf16() {
                return FloatKernel::Avx512Bf16(cpu);
            }
            if let Some(cpu) = features.avx512() {
                return FloatKernel::Avx512(cpu);
            }
            if let Some(cpu) = features.avx2() {
                return FloatKernel::Avx2(cpu);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if let Some(cpu) = features.neon() {
            return FloatKernel::Neon(cpu);
        }
        let _ = features;
        FloatKernel::Portable
    }

    /// This kernel for a BF16 product whose weights and activations have these
    /// [`bf16_least_exponent`]s: the `vdpbf16ps` tier only where [`pairs_exact`] holds,
    /// the AVX-512 multiply-adds otherwise (the same bits either way).
    pub(crate) fn for_bf16(
        self,
        weights: impl FnOnce() -> Option<i32>,
        activations: impl FnOnce() -> Option<i32>,
    ) -> Self {
        match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => {
                if pairs_exact(weights(), activations()) {
                    self
                } else {
                    FloatKernel::Avx512(cpu.avx512())
                }
            }
            _ => {
                let _ = (weights, activations);
                self
            }
        }
    }

    /// The `vdpbf16ps` tiles, if this kernel multiplies `format`'s weights with them (read
    /// as stored) rather than widened ([`FloatKernel::tile`]).
    pub(crate) fn pair_tiles(self, format: FloatFormat) -> Option<PairTiles> {
        match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) if format == FloatFormat::BF16 => {
                Some(PairTiles::Avx512Bf16(cpu))
            }
            _ => {
                let _ = format;
                None
            }
        }
    }

    /// The tiles that read F16 or BF16 weight rows as stored, if this kernel has them for
    /// `format` (F16 on AVX2; F16 and BF16 on AVX-512, BF16 only where no `vdpbf16ps` tile,
    /// [`FloatKernel::pair_tiles`], takes it): [`FloatKernel::tile`]'s results with no
    /// widened copy of the rows.
    pub(crate) fn stored_tiles(self, format: FloatFormat) -> Option<StoredTiles> {
        if format == FloatFormat::F32 || self.pair_tiles(format).is_some() {
            return None;
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) if format == FloatFormat::F16 => Some(StoredTiles::Avx2(cpu)),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => Some(StoredTiles::Avx512(cpu, format)),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => Some(StoredTiles::Avx512(cpu.avx512(), format)),
            _ => None,
        }
    }

    /// Weight row `w` (in `format`) against activation row `x` (as
    /// [`FloatFormat::activations`] gives it, or those values in the 16 bits F16 and BF16
    /// weights' activations are rounded to).
    pub(crate) fn dot<T: Activation>(self, format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
        match self {
            FloatKernel::Portable => dot_portable(format, w, x),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_dot(cpu, format, w, x),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::dot(cpu, format, w, x),
            // `vdpbf16ps` reads column-order activations ([`PairTiles::dot`]); on pair-order
            // ones the multiply-adds compute the same bits.
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => super::avx512::float::dot(cpu.avx512(), format, w, x),
            #[cfg(target_arch = "aarch64")]
            FloatKernel::Neon(cpu) => super::neon::float_dot(cpu, format, w, x),
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
            FloatKernel::Avx512Bf16(cpu) => {
                super::avx512::float::tile(cpu.avx512(), format, w, x, ahead, out)
            }
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_tile(cpu, format, w, x, ahead, out),
            #[cfg(target_arch = "aarch64")]
            FloatKernel::Neon(_) => {
                for (o, x) in out.iter_mut().zip(x) {
                    *o = self.quad(format, w, x);
                }
            }
            FloatKernel::Portable => {
                super::prefetch(ahead);
                for (o, x) in out.iter_mut().zip(x) {
                    *o = self.quad(format, w, x);
                }
            }
        }
    }

    /// Weight row `row` (in `format`) widened exactly to f32 into `out`, in the order the
    /// kernels read it ([`FloatFormat::widen_paired`]).
    pub(crate) fn widen(self, format: FloatFormat, row: &[u8], out: &mut [f32]) {
        assert!(
            row.len() >= out.len() * format.bytes(),
            "weight row shorter than its output"
        );
        // BF16's whole pair-order blocks first, then the rest in column order.
        let paired = format.paired_columns(out.len());
        let (head_row, row) = row.split_at(2 * paired);
        let (head, out) = out.split_at_mut(paired);
        match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::widen_paired(cpu, head_row, head),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => {
                super::avx512::float::widen_paired(cpu.avx512(), head_row, head)
            }
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_widen_paired(cpu, head_row, head),
            #[cfg(target_arch = "aarch64")]
            FloatKernel::Neon(cpu) => super::neon::float_widen_paired(cpu, head_row, head),
            FloatKernel::Portable => format.widen_paired(head_row, head),
        }
        let done = match self {
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512(cpu) => super::avx512::float::widen(cpu, format, row, out),
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => {
                super::avx512::float::widen(cpu.avx512(), format, row, out)
            }
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx2(cpu) => super::avx2::float_widen(cpu, format, row, out),
            #[cfg(target_arch = "aarch64")]
            FloatKernel::Neon(cpu) => super::neon::float_widen(cpu, format, row, out),
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
            #[cfg(target_arch = "x86_64")]
            FloatKernel::Avx512Bf16(cpu) => super::avx512::float::quad(cpu.avx512(), format, w, x),
            #[cfg(target_arch = "aarch64")]
            FloatKernel::Neon(cpu) => super::neon::float_quad(cpu, format, w, x),
        }
    }
}

/// Checks a tile's rows (`x` a multiple of `group` rows, at most [`TILE_ROWS`], as many
/// outputs, every activation row as long as `x[0]`, and weight rows holding at least
/// `values` each) and returns the activation rows' length.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn tile_columns<T, const R: usize>(
    values: [usize; R],
    x: &[&[T]],
    outputs: usize,
    group: usize,
) -> usize {
    let k = x.first().map_or(0, |x| x.len());
    assert!(
        x.len().is_multiple_of(group) && x.len() <= TILE_ROWS && outputs >= x.len(),
        "a tile takes activation rows {group} at a time, at most {TILE_ROWS}"
    );
    assert!(
        values.iter().all(|&v| v >= k) && x.iter().all(|x| x.len() == k),
        "rows shorter than the product's input"
    );
    k
}

/// `ahead` cut into one share of whole cache lines for each of a tile's `passes`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn shares(ahead: &[u8], passes: usize) -> std::slice::Chunks<'_, u8> {
    ahead.chunks(64 * ahead.len().div_ceil(64).div_ceil(passes.max(1)).max(1))
}

/// `len` values of `store` (grown as needed) starting on a 64-byte cache line.
fn aligned<T: Copy + Default>(store: &mut Vec<T>, len: usize) -> &mut [T] {
    let at = super::line_start(store, len);
    &mut store[at..at + len]
}

impl QuantMatrix {
    /// [`QuantMatrix::matmul`] for floating-point weights: the weight rows split among the
    /// threads for decode steps and short prefills (each row read once for every
    /// activation row), the activation rows for long prefills. With more than one
    /// activation row, each group of four weight rows is read as stored by all of them
    /// (BF16 by `vdpbf16ps`; F16 on AVX2 and AVX-512 and BF16 on AVX-512 by tiles that
    /// widen each vector as they load it; eight rows at a time on AVX-512, `vdpbf16ps`
    /// included), or elsewhere widened to f32 once and reused from cache for all of them.
    pub(super) fn matmul_float(&self, format: FloatFormat, x: &[f32], m: usize) -> Buf {
        let mut kernel = FloatKernel::new(cpu::detect());
        // Several rows are read many times over by the tiles: written (as the format reads
        // them) to start on a cache line, so (with a row length a multiple of 16) no vector
        // load straddles two.
        let (mut store, one);
        let x: &[f32] = if m > 1 {
            store = Vec::new();
            let dst = aligned(&mut store, x.len());
            for (dst, x) in dst
                .chunks_exact_mut(self.cols)
                .zip(x.chunks_exact(self.cols))
            {
                format.activations_into(x, dst);
            }
            dst
        } else {
            one = format.activations(x);
            &one
        };
        if format == FloatFormat::BF16 {
            let bits = x.iter().map(|v| (v.to_bits() >> 16) as u16);
            kernel = kernel.for_bf16(
                || *self.bf16_exponent.get_or_init(|| self.weights_exponent()),
                || bf16_least_exponent(bits),
            );
        }
        // The `vdpbf16ps` kernels read the activations as BF16 in column order.
        // Read by the `vdpbf16ps` tiles 64 bytes at a time, so on cache lines too: 16 bytes
        // past one, as a `Vec` put them, each of those loads took two lines.
        let mut column_store = Vec::new();
        let columns: &[u16] = if kernel.pair_tiles(format).is_some() {
            let cols = aligned(&mut column_store, x.len());
            for (c, row) in cols
                .chunks_exact_mut(self.cols)
                .zip(x.chunks_exact(self.cols))
            {
                bf16_columns(row, c);
            }
            cols
        } else {
            &[]
        };
        // One activation row, read again for every weight row: the dot products read it as
        // the 16-bit values it holds for F16 and BF16 weights, in half the bytes.
        let narrow = match format {
            FloatFormat::F16 if m == 1 => {
                Some(Narrow::F16(x.iter().map(|&v| f16::from_f32(v)).collect()))
            }
            FloatFormat::BF16 if m == 1 && columns.is_empty() => {
                Some(Narrow::BF16(x.iter().map(|&v| bf16::from_f32(v)).collect()))
            }
            _ => None,
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
                    let acts = Acts {
                        x,
                        columns,
                        narrow: narrow.as_ref(),
                    };
                    self.float_rows(
                        kernel,
                        format,
                        first..first + n,
                        acts,
                        scratch,
                        |i, r, v| dst[i][r - first] = v,
                    );
                });
        } else {
            let (fewest, most) = ACT_ROWS_PER_TASK;
            let fit = (TASK_OUTPUT_BYTES / (self.rows * 4).max(1)).clamp(fewest, most);
            // Every group of weight rows meets all the task's activation rows, as the tiles
            // read them (f32, or BF16 bits for `vdpbf16ps`): no more of them than stay in L2.
            let act_bytes = if columns.is_empty() { 4 * k } else { 2 * k };
            let fit = fit.min((TASK_ACT_BYTES / act_bytes.max(1)).max(TILE_ROWS));
            let per_task = fit.min(m.div_ceil(rayon::current_num_threads()).max(1));
            let rows = self.rows;
            out.par_chunks_mut(per_task * rows)
                .enumerate()
                .for_each_init(Vec::new, |scratch, (task, dst)| {
                    let span = task * per_task * k..(task * per_task + dst.len() / rows) * k;
                    let acts = Acts {
                        x: &x[span.clone()],
                        columns: columns.get(span).unwrap_or_default(),
                        narrow: None,
                    };
                    self.float_rows(kernel, format, 0..rows, acts, scratch, |i, r, v| {
                        dst[i * rows + r] = v
                    });
                });
        }
        out
    }

    /// The [`bf16_least_exponent`] of this BF16 matrix's weights.
    fn weights_exponent(&self) -> Option<i32> {
        // Pieces of 1 MiB (an even number of bytes, so no value is cut) shared by the threads.
        let pieces: Vec<Option<i32>> = self
            .data
            .par_chunks(1 << 20)
            .map(bf16_bytes_least_exponent)
            .collect();
        pieces
            .into_iter()
            .try_fold(i32::MAX, |least, e| e.map(|e| least.min(e)))
    }

    /// Weight rows `range` against every row of `acts`, each result handed to
    /// `put(activation row, weight row, value)`.
    fn float_rows(
        &self,
        kernel: FloatKernel,
        format: FloatFormat,
        range: std::ops::Range<usize>,
        acts: Acts<'_>,
        scratch: &mut Vec<f32>,
        mut put: impl FnMut(usize, usize, f32),
    ) {
        let k = self.cols;
        let m = acts.x.len() / k.max(1);
        let pairs = kernel.pair_tiles(format);
        // Weight row `w` against activation row `i`: `vdpbf16ps` on the column-order BF16
        // bits where this CPU has it for the format, else the kernel's dot product (on the
        // 16-bit values where they are kept).
        let dot = |w: &[u8], i: usize| match (pairs, acts.narrow) {
            (Some(pairs), _) => pairs.dot(w, &acts.columns[i * k..(i + 1) * k]),
            (None, Some(Narrow::F16(x))) => kernel.dot(format, w, &x[i * k..(i + 1) * k]),
            (None, Some(Narrow::BF16(x))) => kernel.dot(format, w, &x[i * k..(i + 1) * k]),
            (None, None) => kernel.dot(format, w, &acts.x[i * k..(i + 1) * k]),
        };
        if m == 1 {
            // One activation row: each weight row read once, as stored, without whole rows
            // prefetched (see `QuantMatrix::prefetch_rows`); the dot products on x86 ask for
            // their own bytes a few KiB ahead as they go. On x86 a row from each half of the
            // range in turn, two sequential streams, as the quantized formats' one-row
            // products read them: random 1.1B F16 decode, 2 threads, a 2-core Xeon (family 6,
            // model 207), ten alternating pairs: 10.2–13.0 against 9.5–10.4 tok/s (BF16
            // even). arm64, whose speed nothing here measures, reads one stream.
            let half = if cfg!(target_arch = "x86_64") {
                range.len() / 2
            } else {
                0
            };
            let (first, second) = (range.start, range.start + half);
            for r in first..second {
                put(0, r, dot(self.weight_row(r), 0));
                put(0, r + half, dot(self.weight_row(r + half), 0));
            }
            for r in second + half..range.end {
                put(0, r, dot(self.weight_row(r), 0));
            }
            return;
        }
        // F16 and BF16 rows are read as stored where the tier can (widened as the tile loads
        // them, or BF16 by `vdpbf16ps`), with no copy: eight rows at a time where the tier
        // has registers for it, then four at a time.
        let stored = kernel.stored_tiles(format);
        let mut range = range;
        let eight = match pairs {
            Some(pairs) => Some(EightRows::Pairs(pairs)),
            None => stored
                .and_then(StoredTiles::eight_rows)
                .map(EightRows::Stored),
        };
        if let Some(eight) = eight {
            let eights = range.start + range.len() / 8 * 8;
            let calls = eight.calls(m);
            let mut tiles = [[0f32; 8]; TILE_ROWS];
            for r in (range.start..eights).step_by(8) {
                let raw: [&[u8]; 8] = std::array::from_fn(|j| self.weight_row(r + j));
                let next = self.rows_bytes(r + 8, (r + 16).min(eights));
                let mut ahead = next.chunks(next.len().div_ceil(calls.len()).max(1));
                for &(i, n) in &calls {
                    let ahead = ahead.next().unwrap_or_default();
                    eight.tile(raw, acts, k, (i, n), ahead, &mut tiles[..n]);
                    for (a, v) in tiles[..n].iter().enumerate() {
                        for (j, &v) in v.iter().enumerate() {
                            put(i + a, r + j, v);
                        }
                    }
                }
            }
            range.start = eights;
        }
        let quads = range.start + range.len() / 4 * 4;
        let widens = pairs.is_none() && stored.is_none();
        let scratch = aligned(scratch, if widens { 4 * k } else { 0 });
        let mut tiles = [[0f32; 4]; TILE_ROWS];
        let fours = m / 4 * 4;
        for r in (range.start..quads).step_by(4) {
            let raw: [&[u8]; 4] = std::array::from_fn(|j| self.weight_row(r + j));
            if widens {
                for (j, w) in scratch.chunks_exact_mut(k).enumerate() {
                    kernel.widen(format, raw[j], w);
                }
            }
            // The widened rows (empty where the tile reads them as stored).
            let w: [&[f32]; 4] =
                std::array::from_fn(|j| scratch.get(j * k..(j + 1) * k).unwrap_or_default());
            // The next group's rows, fetched a share per tile while these compute (the
            // hardware prefetcher alone leaves the widening waiting on memory).
            let next = self.rows_bytes(r + 4, (r + 8).min(quads));
            let calls = fours.div_ceil(TILE_ROWS).max(1);
            let mut ahead = next.chunks(next.len().div_ceil(calls).max(1));
            for i in (0..fours).step_by(TILE_ROWS) {
                let n = TILE_ROWS.min(fours - i);
                let ahead = ahead.next().unwrap_or_default();
                if let Some(pairs) = pairs {
                    let x = act_rows(acts.columns, k, i, n);
                    pairs.tile(raw, &x[..n], ahead, &mut tiles[..n]);
                } else {
                    let x = act_rows(acts.x, k, i, n);
                    match stored {
                        Some(stored) => stored.tile(raw, &x[..n], ahead, &mut tiles[..n]),
                        None => kernel.tile(format, w, &x[..n], ahead, &mut tiles[..n]),
                    }
                }
                for (a, v) in tiles[..n].iter().enumerate() {
                    for (j, &v) in v.iter().enumerate() {
                        put(i + a, r + j, v);
                    }
                }
            }
            for i in fours..m {
                let v = if !widens {
                    raw.map(|w| dot(w, i))
                } else {
                    kernel.quad(format, w, &acts.x[i * k..(i + 1) * k])
                };
                for (j, v) in v.into_iter().enumerate() {
                    put(i, r + j, v);
                }
            }
        }
        for r in quads..range.end {
            for i in 0..m {
                put(i, r, dot(self.weight_row(r), i));
            }
        }
    }
}

/// Rows `i..i + n` (at most [`TILE_ROWS`]) of the `k`-value rows in `x`, for a tile.
fn act_rows<T>(x: &[T], k: usize, i: usize, n: usize) -> [&[T]; TILE_ROWS] {
    let mut rows: [&[T]; TILE_ROWS] = [&[]; TILE_ROWS];
    for (row, x) in rows.iter_mut().zip(x[i * k..(i + n) * k].chunks_exact(k)) {
        *row = x;
    }
    rows
}

/// A task's activation rows as the kernels read them.
#[derive(Clone, Copy)]
struct Acts<'a> {
    /// As [`FloatFormat::activations`] gives them.
    x: &'a [f32],
    /// As BF16 in column order, for the `vdpbf16ps` kernels (empty otherwise).
    columns: &'a [u16],
    /// One row's values in 16 bits, for the dot products, where they are kept.
    narrow: Option<&'a Narrow>,
}

/// An activation row's values (as [`FloatFormat::activations`] gives them) in the 16 bits
/// they are rounded to, for the one-row dot products of F16 weights, and of BF16 weights
/// where no `vdpbf16ps` kernel reads them as [`Acts::columns`].
enum Narrow {
    /// An F16 product's activations.
    F16(Vec<f16>),
    /// A BF16 product's activations, in pair order.
    BF16(Vec<bf16>),
}

#[cfg(test)]
mod tests {
    use super::aligned;

    #[test]
    fn aligned_values_start_on_a_cache_line_whatever_their_size() {
        // The tiles' 64-byte loads of activation rows straddle two lines otherwise.
        for len in [1, 63, 64, 2048, 5000] {
            let (mut halves, mut floats) = (Vec::<u16>::new(), Vec::<f32>::new());
            let h = aligned(&mut halves, len);
            assert_eq!((h.as_ptr() as usize % 64, h.len()), (0, len));
            let f = aligned(&mut floats, len);
            assert_eq!((f.as_ptr() as usize % 64, f.len()), (0, len));
        }
    }
}
