//! BF16 weights with AVX-512 BF16: `vdpbf16ps` multiplies 32 weights by 32 activations
//! (both BF16, as stored) and adds each adjacent pair's products to one of 16 f32 lanes,
//! the odd column's first — the pair-order arithmetic of [`super::super::float`], which
//! the other tiers run as multiply-adds on widened values. The weights need no widening, and
//! one instruction does the work of two multiply-adds. The instruction flushes subnormal
//! inputs and results to zero, so callers use it only where
//! [`super::super::float::pairs_exact`] says none can arise.

use std::arch::x86_64::*;

use super::super::float::{
    bf16_to_f32, finish, shares, tile_columns, FloatFormat, PairTiles, LANES, PAIR_BLOCK, TILE_ROWS,
};
use super::super::sse2::Carry;
use super::float::{fold, fold_quarters, load, tile8_parts};
use crate::cpu::Avx512Bf16;

/// Columns each of a tile's passes covers before the next activation rows' turn (a multiple
/// of [`PAIR_BLOCK`]): the four weight rows' block, 16 KiB of BF16, stays in the L1 cache for
/// all the tile's activation rows. Four times the f32 tiles' block, whose widened values take
/// twice the bytes and half the columns a step: a pass's sixteen accumulators are loaded and
/// stored once per sixteen steps, not once per four.
const BLOCK: usize = 2048;

/// 32 BF16 values as `vdpbf16ps` takes them.
#[inline]
#[target_feature(enable = "avx512f")]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 512-bit vectors and every bit pattern is a valid value of either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// BF16 weight row `w` (`x.len()` values, as stored) against activation row `x` (BF16 bits
/// in column order, as the tiles take it): one weight load, one activation load and one
/// `vdpbf16ps` per 32 columns; the bits of the pair-order multiply-adds of the other tiers.
pub(crate) fn dot(cpu: Avx512Bf16, w: &[u8], x: &[u16]) -> f32 {
    let _ = cpu;
    assert!(w.len() >= 2 * x.len(), "weight row shorter than its input");
    // SAFETY: `cpu` proves AVX-512 F and BF16; the row holds `x.len()` values.
    unsafe { dot_bf16(w, x) }
}

/// # Safety
/// `w` must hold `x.len()` BF16 values.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_bf16(w: &[u8], x: &[u16]) -> f32 {
    let k = x.len();
    let paired = k / PAIR_BLOCK * PAIR_BLOCK;
    let whole = k / LANES * LANES;
    let mut acc = [_mm512_setzero_ps(); 4];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i < paired {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: columns `i + 32 j .. i + 32 j + 32 <= k` of both rows, column order.
            unsafe {
                let wv = bh(_mm512_loadu_si512(wp.add(2 * (i + 32 * j)).cast()));
                let xv = bh(_mm512_loadu_si512(xp.add(i + 32 * j).cast()));
                *a = _mm512_dpbf16_ps(*a, wv, xv);
            }
        }
        i += PAIR_BLOCK;
    }
    if i < whole {
        // One step of 64 columns past the last whole block: one multiply-add each.
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: columns `i .. i + 64 <= k` of both rows; activation bits are BF16's
            // little-endian bytes.
            unsafe {
                let wv = load(FloatFormat::BF16, wp, i + 16 * j);
                let xv = load(FloatFormat::BF16, xp.cast(), i + 16 * j);
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
        }
    }
    with_tail(fold(acc), w, x, whole)
}

/// `folded`, the sum of the whole 64-column steps of BF16 weight row `w` against
/// column-order activation bits `x`, plus the columns from `whole` on, as [`finish`] adds
/// them.
fn with_tail(folded: f32, w: &[u8], x: &[u16], whole: usize) -> f32 {
    let tail = (whole..x.len()).map(|i| (FloatFormat::BF16.at(w, i), bf16_to_f32(x[i])));
    finish(FloatFormat::BF16, folded, tail)
}

/// Four BF16 weight rows (as stored) against activation rows `x` (BF16 bits in column
/// order, a multiple of four rows, at most [`TILE_ROWS`]): `out[a][r]`, each [`dot`]'s
/// result. As the f32 tile does, the column loop runs once per quarter of each block's
/// lanes for four activation rows at a time, a block of columns at a time, with sixteen
/// accumulators; each weight and activation vector is loaded once for four products.
pub(crate) fn tile(
    cpu: Avx512Bf16,
    w: [&[u8]; 4],
    x: &[&[u16]],
    ahead: &[u8],
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    tile_columns(w.map(|w| w.len() / 2), x, out.len(), 4);
    // SAFETY: `cpu` proves AVX-512 F and BF16; every row holds as many values as `x[0]`.
    unsafe { tile_bf16::<4, 4>(w, x, ahead, out) }
}

/// Eight BF16 weight rows (as stored) against activation rows `x` (BF16 bits in column
/// order, any number, at most [`TILE_ROWS`]): `out[a][r]`, each [`dot`]'s result. [`tile`]'s
/// passes with eight weight rows by three activation rows (24 accumulators), the rows left
/// after the threes two at a time (or the last one alone), as the F16 eight-row tile splits
/// them ([`tile8_parts`]): each activation vector meets eight weight vectors where it met
/// four, eleven loads per 24 `vdpbf16ps` where [`tile`] takes eight per 16.
pub(crate) fn tile8(
    cpu: Avx512Bf16,
    w: [&[u8]; 8],
    x: &[&[u16]],
    ahead: &[u8],
    out: &mut [[f32; 8]],
) {
    let _ = cpu;
    tile_columns(w.map(|w| w.len() / 2), x, out.len(), 1);
    const A: usize = PairTiles::EIGHT_ROW_PASS;
    tile8_parts::<_, A, 8>(x, ahead, out, |rows, x, ahead, out| {
        // SAFETY: `cpu` proves AVX-512 F and BF16; every row holds as many values as
        // `x[0]`; at most five groups of three rows, then the one row left or one or two
        // groups of two.
        unsafe {
            match rows {
                1 => tile_bf16::<8, 1>(w, x, ahead, out),
                2 => tile_bf16::<8, 2>(w, x, ahead, out),
                _ => tile_bf16::<8, A>(w, x, ahead, out),
            }
        }
    });
}

/// `R` BF16 weight rows (a multiple of four) against activation rows `x`, `A` at a time
/// (`R · A` accumulators, at most 24). Each quarter's passes over all the activation rows
/// run one after the other, as the f32 tiles' do, so the weight lines a quarter reads are
/// met again from L1 by every group of rows; with the groups outermost, eight rows' block
/// (32 KiB) and a group's activation lines together no longer fit it.
///
/// # Safety
/// Every row of `w` and `x` must hold `x[0].len()` BF16 values; `x` holds a multiple of
/// `A` rows, at most [`TILE_ROWS`], and at most `TILE_ROWS / 2` groups of `A`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_bf16<const R: usize, const A: usize>(
    w: [&[u8]; R],
    x: &[&[u16]],
    ahead: &[u8],
    out: &mut [[f32; R]],
) {
    let k = x[0].len();
    let paired = k / PAIR_BLOCK * PAIR_BLOCK;
    let whole = k / LANES * LANES;
    let wp: [*const u8; R] = std::array::from_fn(|r| w[r].as_ptr());
    let tiles = x.len() / A;
    // `part[t][q]`, `[a][r]` of it: quarter `q`'s partial sums of activation row `A t + a`
    // by weight row `r`, carried from one block of columns to the next.
    let mut part = [[Carry::<[[__m512; R]; A]>::UNSET; 4]; TILE_ROWS / 2];
    // At least one block, so every carry is put, even with no whole pair block.
    let blocks = paired.div_ceil(BLOCK).max(1);
    let mut ahead = shares(ahead, 4 * tiles * blocks);
    for b in 0..blocks {
        let (from, to) = (b * BLOCK, ((b + 1) * BLOCK).min(paired));
        for q in 0..4 {
            for (t, part) in part.iter_mut().take(tiles).enumerate() {
                let xp: [*const u16; A] = std::array::from_fn(|a| x[A * t + a].as_ptr());
                let part = &mut part[q];
                for line in ahead.next().unwrap_or_default().chunks(64) {
                    _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                }
                // SAFETY: the first block's pass put every carry the later ones start from.
                let mut acc = unsafe { part.start(b == 0, [[_mm512_setzero_ps(); R]; A]) };
                let mut i = from + 32 * q;
                while i < to {
                    // SAFETY: columns `i .. i + 32 <= to <= k` of every row.
                    unsafe {
                        let xv: [__m512bh; A] =
                            std::array::from_fn(|a| bh(_mm512_loadu_si512(xp[a].add(i).cast())));
                        for r in 0..R {
                            let wv = bh(_mm512_loadu_si512(wp[r].add(2 * i).cast()));
                            for (acc, &xv) in acc.iter_mut().zip(&xv) {
                                acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
                            }
                        }
                    }
                    i += PAIR_BLOCK;
                }
                part.put(acc);
            }
        }
    }
    if paired < whole {
        // One step of 64 columns past the last whole block, in column order.
        for (t, part) in part.iter_mut().take(tiles).enumerate() {
            for (q, part) in part.iter_mut().enumerate() {
                let i = paired + 16 * q;
                // SAFETY: the blocks put the carries of the first `tiles` groups.
                let mut sums = unsafe { *part.sums() };
                for (a, sums) in sums.iter_mut().enumerate() {
                    // SAFETY: columns `i .. i + 16 <= whole <= k` of every row; activation
                    // bits are BF16's little-endian bytes.
                    unsafe {
                        let xv = load(FloatFormat::BF16, x[A * t + a].as_ptr().cast(), i);
                        for (r, sum) in sums.iter_mut().enumerate() {
                            let wv = load(FloatFormat::BF16, wp[r], i);
                            *sum = _mm512_fmadd_ps(wv, xv, *sum);
                        }
                    }
                }
                part.put(sums);
            }
        }
    }
    for (t, part) in part.iter().take(tiles).enumerate() {
        // SAFETY: the blocks put the carries of the first `tiles` groups.
        let part: [&[[__m512; R]; A]; 4] = std::array::from_fn(|q| unsafe { part[q].sums() });
        fold_quarters(part, |a, r, folded| {
            out[A * t + a][r] = with_tail(folded, w[r], x[A * t + a], whole);
        });
    }
}
