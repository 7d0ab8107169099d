//! Floating-point weights with AVX-512: each output's 64 partial sums in four 512-bit
//! accumulators, F16 weights widened by `vcvtph2ps` and BF16 by a 16-bit shift; four
//! weight rows at a time against one activation row share its loads.

use std::arch::x86_64::*;

use super::super::float::{
    finish, fold16, shares, tile_columns, Activation, FloatFormat, LANES, PAIR_BLOCK, TILE_ROWS,
};
use super::super::sse2::{prefetch_ahead, Carry};
use crate::cpu::Avx512;

/// Sixteen values of `format` (weights, or activations as [`Activation::FORMAT`] names
/// them) from `w` at value `i`, widened exactly.
///
/// # Safety
/// `w` must hold sixteen values of `format` from value `i` on.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn load(format: FloatFormat, w: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees sixteen readable values at `i`.
    unsafe {
        match format {
            FloatFormat::F32 => _mm512_loadu_ps(w.add(4 * i).cast()),
            FloatFormat::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * i).cast())),
            FloatFormat::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(2 * i).cast())),
            )),
        }
    }
}

/// The first values of weight row `row` widened exactly into `out`, sixteen per
/// instruction; returns how many (`out.len()` rounded down to a multiple of sixteen). The
/// caller checks that `row` holds `out.len()` values of `format`.
pub(crate) fn widen(cpu: Avx512, format: FloatFormat, row: &[u8], out: &mut [f32]) -> usize {
    let _ = cpu;
    let whole = out.len() / 16 * 16;
    assert!(
        row.len() >= whole * format.bytes(),
        "weight row shorter than its output"
    );
    // SAFETY: `cpu` proves AVX-512 F; the row holds `whole` values.
    unsafe { widen_avx512(format, row, &mut out[..whole]) };
    whole
}

/// # Safety
/// `row` must hold `out.len()` values of `format`, a multiple of sixteen.
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(format: FloatFormat, row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for i in (0..out.len()).step_by(16) {
        // SAFETY: values `i..i + 16` are in both `row` and `out`.
        unsafe { _mm512_storeu_ps(o.add(i), load(format, w, i)) };
    }
}

/// The odd and the even BF16 values of the sixteen column pairs at `w` (32 values), widened
/// exactly: the pair order's two halves of sixteen lanes.
///
/// # Safety
/// `w` must hold 32 BF16 values.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn load_pairs(w: *const u8) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 64 readable bytes.
    let v = unsafe { _mm512_loadu_si512(w.cast()) };
    let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000_u32 as i32));
    let even = _mm512_slli_epi32::<16>(v);
    (_mm512_castsi512_ps(odd), _mm512_castsi512_ps(even))
}

/// A BF16 row's whole pair-order blocks (`out.len()` values, a multiple of
/// [`PAIR_BLOCK`]) widened exactly into `out` in pair order.
pub(crate) fn widen_paired(cpu: Avx512, row: &[u8], out: &mut [f32]) {
    let _ = cpu;
    assert!(
        out.len().is_multiple_of(PAIR_BLOCK) && row.len() >= 2 * out.len(),
        "whole pair-order blocks"
    );
    // SAFETY: `cpu` proves AVX-512 F; the row holds `out.len()` BF16 values.
    unsafe { widen_paired_avx512(row, out) }
}

/// # Safety
/// `row` must hold `out.len()` BF16 values, a multiple of [`PAIR_BLOCK`].
#[target_feature(enable = "avx512f")]
unsafe fn widen_paired_avx512(row: &[u8], out: &mut [f32]) {
    let (w, o) = (row.as_ptr(), out.as_mut_ptr());
    for b in (0..out.len()).step_by(PAIR_BLOCK) {
        for j in 0..4 {
            // SAFETY: columns `b + 32 j .. b + 32 j + 32` are in the row, and both halves'
            // lanes `b + 16 j ..` and `b + 64 + 16 j ..` in `out`.
            unsafe {
                let (odd, even) = load_pairs(w.add(2 * (b + 32 * j)));
                _mm512_storeu_ps(o.add(b + 16 * j), odd);
                _mm512_storeu_ps(o.add(b + LANES + 16 * j), even);
            }
        }
    }
}

/// The four accumulators folded as ggml's `GGML_F32x16_REDUCE`: `(a0 + a2) + (a1 + a3)`,
/// then the 16 lanes by halves.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn fold(acc: [__m512; 4]) -> f32 {
    let x0 = _mm512_add_ps(acc[0], acc[2]);
    let x1 = _mm512_add_ps(acc[1], acc[3]);
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds exactly sixteen f32; storeu has no alignment requirement.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(x0, x1)) };
    fold16(lanes)
}

/// Weight row `w` (in `format`, `x.len()` values) against activation row `x`.
pub(crate) fn dot<T: Activation>(cpu: Avx512, format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
    let _ = cpu;
    assert!(
        w.len() >= x.len() * format.bytes(),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves AVX-512 F; the row holds `x.len()` values.
    unsafe { dot_avx512(format, w, x) }
}

/// # Safety
/// `w` must hold `x.len()` values of `format`.
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512<T: Activation>(format: FloatFormat, w: &[u8], x: &[T]) -> f32 {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut acc = [_mm512_setzero_ps(); 4];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    if format == FloatFormat::BF16 {
        // Whole pair-order blocks: each lane's odd column, then its even one.
        while i + PAIR_BLOCK <= k {
            prefetch_ahead(wp.wrapping_add(2 * i), PAIR_BLOCK / 32);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: columns `i .. i + 128` of both rows.
                unsafe {
                    let (odd, even) = load_pairs(wp.add(2 * (i + 32 * j)));
                    *a = _mm512_fmadd_ps(odd, load(T::FORMAT, xp.cast(), i + 16 * j), *a);
                    *a = _mm512_fmadd_ps(even, load(T::FORMAT, xp.cast(), i + LANES + 16 * j), *a);
                }
            }
            i += PAIR_BLOCK;
        }
    }
    while i < whole {
        prefetch_ahead(
            wp.wrapping_add(i * format.bytes()),
            LANES * format.bytes() / 64,
        );
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `i + 16 j + 16 <= whole <= k` values of both rows.
            unsafe {
                let wv = load(format, wp, i + 16 * j);
                *a = _mm512_fmadd_ps(wv, load(T::FORMAT, xp.cast(), i + 16 * j), *a);
            }
        }
        i += LANES;
    }
    let tail = (whole..k).map(|i| (format.at(w, i), x[i].value()));
    finish(format, fold(acc), tail)
}

/// Four widened weight rows against activation row `x`: sixteen accumulators, each
/// activation vector loaded once for the four rows.
pub(crate) fn quad(cpu: Avx512, format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let _ = cpu;
    assert!(
        w.iter().all(|w| w.len() >= x.len()),
        "weight row shorter than its input"
    );
    // SAFETY: `cpu` proves AVX-512 F; every row holds `x.len()` values.
    unsafe { quad_avx512(format, w, x) }
}

/// # Safety
/// Every row of `w` must hold `x.len()` values.
#[target_feature(enable = "avx512f")]
unsafe fn quad_avx512(format: FloatFormat, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let k = x.len();
    let whole = k / LANES * LANES;
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let xp = x.as_ptr();
    let wp = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 64 <= whole <= k` values of every row.
        unsafe {
            let xv = [
                _mm512_loadu_ps(xp.add(i)),
                _mm512_loadu_ps(xp.add(i + 16)),
                _mm512_loadu_ps(xp.add(i + 32)),
                _mm512_loadu_ps(xp.add(i + 48)),
            ];
            for r in 0..4 {
                for j in 0..4 {
                    let wv = _mm512_loadu_ps(wp[r].add(i + 16 * j));
                    acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
                }
            }
        }
        i += LANES;
    }
    let mut out = [0f32; 4];
    for r in 0..4 {
        let tail = w[r][whole..k]
            .iter()
            .copied()
            .zip(x[whole..k].iter().copied());
        out[r] = finish(format, fold(acc[r]), tail);
    }
    out
}

/// Columns each of [`tile`]'s passes covers before the next activation rows' turn (a
/// multiple of 64). Each quarter's pass reads one cache line in four, so every line is read
/// once per four activation rows whatever the block; what a block buys is the weight rows
/// met again from L1 rather than L2, and what it costs is the sixteen accumulators saved and
/// reloaded at every block's end. On an AMD EPYC (Zen 4), 2 threads, random 1.1B F16
/// prompt processing (256 and 512 tokens, alternating): 512 columns 46–49 tok/s, 4096
/// columns 55–60, a whole row (2048 or 5632) about the same as 4096. (The AVX2 tile, whose
/// eighths share lines, keeps [`super::super::float::TILE_BLOCK`].)
const BLOCK: usize = 4096;

/// [`BLOCK`] for [`tile8_stored`]: its eight F16 rows of 2048 columns are 32 KiB, which stay
/// in L1 for all the activation rows. Zen 5, one thread, eight F16 rows of 8192 columns by
/// two activation rows at a time, against 64 activation rows (a throwaway benchmark of the
/// tile alone): 68–71 GMAC/s with 2048 columns, 61–65 with 512.
const BLOCK8: usize = 2048;

/// Four widened weight rows against activation rows `x` (a multiple of four, at most
/// [`TILE_ROWS`]): `out[a][r]`. The column loop runs once per 16-lane quarter of each
/// 64-value step, for four activation rows at a time, a block of columns at a time — each
/// quarter's passes over all the activation rows one after the other, so the weight lines a
/// quarter reads (16 KiB of a block) are met again from L1 rather than L2 (Zen 5, 2
/// threads, random 1.1B F16 prompt processing of 512 tokens, alternating: 94–97 → 106–110
/// tok/s against the activation rows' passes outermost); the
/// quarters' partial sums never meet before the fold, so each lane's chain of multiply-adds
/// is the one [`dot`] runs — with sixteen accumulators, each weight and activation vector
/// loaded once for four products.
///
/// The cache lines of `ahead` (the next weight rows, say) are asked for a few at a time
/// through the passes, so they arrive while this tile computes rather than in one burst
/// that fills the CPU's miss buffers.
pub(crate) fn tile(
    cpu: Avx512,
    format: FloatFormat,
    w: [&[f32]; 4],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    tile_columns(w.map(<[f32]>::len), x, out.len(), 4);
    // SAFETY: `cpu` proves AVX-512 F; every row holds as many values as `x[0]`.
    unsafe { tile_avx512::<_, 4, 4>(Widened(w, format), x, ahead, BLOCK, out) }
}

/// [`tile`] on four F16 or BF16 (`format`) weight rows as stored: each weight vector
/// widened as the tile loads it (F16 by `vcvtph2ps`, BF16 by a shift or a mask, in pair
/// order), so no widened copy of the rows is written and read back. The same values meet
/// the same multiply-adds, so the same bits.
pub(crate) fn tile_stored(
    cpu: Avx512,
    format: FloatFormat,
    w: [&[u8]; 4],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    tile_columns(w.map(|w| w.len() / 2), x, out.len(), 4);
    // SAFETY: `cpu` proves AVX-512 F; every row holds as many values as `x[0]`.
    unsafe { tile_rows_stored::<4, 4>(format, w, x, ahead, BLOCK, out) }
}

/// Eight F16 or BF16 (`format`) weight rows as stored against activation rows `x` (any
/// number, at most [`TILE_ROWS`]): `out[a][r]`, each [`dot`]'s result. [`tile_stored`]'s
/// passes with the accumulators shared the other way: eight weight rows by three
/// activation rows (24 accumulators) for F16, by two for BF16, the last one or two rows by
/// themselves. Each activation vector, read from L2, meets eight weight rows rather than
/// four. Zen 5, 2 threads, random 1.1B F16 prompt processing of 1024 tokens, alternating:
/// eight by two against four by four 131–135 → 139–142 tok/s (four pairs; 512 tokens
/// 147–150 → 150–155), eight by three against eight by two 138–147 → 146–149 (seven
/// pairs, one even). BF16, whose pair-order loads take more registers, was slower by
/// three (capped to `avx512-vnni`, 512 tokens: 127–134 against 139–140).
pub(crate) fn tile8_stored(
    cpu: Avx512,
    format: FloatFormat,
    w: [&[u8]; 8],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 8]],
) {
    let _ = cpu;
    tile_columns(w.map(|w| w.len() / 2), x, out.len(), 1);
    // SAFETY: `cpu` proves AVX-512 F; every row holds as many values as `x[0]`.
    unsafe {
        match tile8_pass_rows(format) {
            2 => tile8_groups::<2>(format, w, x, ahead, out),
            _ => tile8_groups::<3>(format, w, x, ahead, out),
        }
    }
}

/// The activation rows each pass of [`tile8_stored`]'s register tile takes for `format`:
/// three for F16 (24 accumulators), two for BF16, whose pair-order loads take more
/// registers.
pub(crate) const fn tile8_pass_rows(format: FloatFormat) -> usize {
    match format {
        FloatFormat::BF16 => 2,
        _ => 3,
    }
}

/// [`tile8_stored`] with activation rows `A` at a time as [`tile8_parts`] divides them,
/// then two at a time for the rest (or the last one alone).
///
/// # Safety
/// The CPU must have AVX-512 F; every row of `w` and `x` must hold `x[0].len()` values; `x`
/// holds at most [`TILE_ROWS`] rows, `A` is two or three.
#[target_feature(enable = "avx512f")]
unsafe fn tile8_groups<const A: usize>(
    format: FloatFormat,
    w: [&[u8]; 8],
    x: &[&[f32]],
    ahead: &[u8],
    out: &mut [[f32; 8]],
) {
    tile8_parts::<_, A, 8>(x, ahead, out, |rows, x, ahead, out| {
        // SAFETY: as the caller guarantees; at most eight groups of `A` rows, then the one
        // row left or one or two groups of two.
        unsafe {
            match rows {
                1 => tile_rows_stored::<8, 1>(format, w, x, ahead, BLOCK8, out),
                2 => tile_rows_stored::<8, 2>(format, w, x, ahead, BLOCK8, out),
                _ => tile_rows_stored::<8, A>(format, w, x, ahead, BLOCK8, out),
            }
        }
    });
}

/// An eight-row tile's activation rows `x` in the calls its register tiles take:
/// `run(rows, x, ahead, out)` for the rows it takes `A` at a time (`rows` is `A`), then for
/// the rest two at a time, or the last one alone (`rows` is 2 or 1), each with its outputs
/// and its share of `ahead`. A single row left after threes goes with the last three as
/// two twos (eight by one reads each weight vector for one multiply-add), and is left alone
/// only where there is no three before it or `A` is two.
pub(super) fn tile8_parts<T, const A: usize, const R: usize>(
    x: &[&[T]],
    ahead: &[u8],
    out: &mut [[f32; R]],
    mut run: impl FnMut(usize, &[&[T]], &[u8], &mut [[f32; R]]),
) {
    let mut whole = x.len() / A * A;
    if A == 3 && x.len() - whole == 1 && whole > 0 {
        whole -= 3;
    }
    let (x, rest) = x.split_at(whole);
    let (out, out_rest) = out.split_at_mut(whole);
    let (ahead, ahead_rest) = ahead.split_at(ahead.len() * whole / (whole + rest.len()).max(1));
    if !x.is_empty() {
        run(A, x, ahead, out);
    }
    if !rest.is_empty() {
        run(rest.len().min(2), rest, ahead_rest, out_rest);
    }
}

/// [`tile_avx512`] on `R` F16 or BF16 (`format`) weight rows as stored.
///
/// # Safety
/// As [`tile_avx512`]'s.
#[target_feature(enable = "avx512f")]
unsafe fn tile_rows_stored<const R: usize, const A: usize>(
    format: FloatFormat,
    w: [&[u8]; R],
    x: &[&[f32]],
    ahead: &[u8],
    block: usize,
    out: &mut [[f32; R]],
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match format {
            FloatFormat::BF16 => {
                let paired = format.paired_columns(x[0].len());
                let rows = Bf16Rows { rows: w, paired };
                tile_avx512::<_, R, A>(rows, x, ahead, block, out)
            }
            _ => tile_avx512::<_, R, A>(F16Rows(w), x, ahead, block, out),
        }
    }
}

/// Where a tile's weight rows come from.
trait TileRows: Copy {
    /// The format the rows' values were stored in (how the tail is summed).
    fn format(self) -> FloatFormat;
    /// Sixteen values of row `r` from value `i`, as f32.
    ///
    /// # Safety
    /// Row `r` must hold sixteen values from `i` on, and the CPU must have AVX-512 F.
    unsafe fn load(self, r: usize, i: usize) -> __m512;
    /// Value `i` of row `r`, exactly.
    fn at(self, r: usize, i: usize) -> f32;
}

/// Four weight rows widened to f32 beforehand, and the format they were stored in.
#[derive(Clone, Copy)]
struct Widened<'a>([&'a [f32]; 4], FloatFormat);

/// `R` F16 weight rows as stored.
#[derive(Clone, Copy)]
struct F16Rows<'a, const R: usize>([&'a [u8]; R]);

/// `R` BF16 weight rows as stored, read in pair order up to column `paired` (as
/// [`widen_paired`] writes them) and in column order from there.
#[derive(Clone, Copy)]
struct Bf16Rows<'a, const R: usize> {
    rows: [&'a [u8]; R],
    paired: usize,
}

impl TileRows for Widened<'_> {
    fn format(self) -> FloatFormat {
        self.1
    }

    #[inline(always)]
    unsafe fn load(self, r: usize, i: usize) -> __m512 {
        // SAFETY: the caller guarantees sixteen values at `i` and AVX-512 F.
        unsafe { _mm512_loadu_ps(self.0[r].as_ptr().add(i)) }
    }

    fn at(self, r: usize, i: usize) -> f32 {
        self.0[r][i]
    }
}

impl<const R: usize> TileRows for F16Rows<'_, R> {
    fn format(self) -> FloatFormat {
        FloatFormat::F16
    }

    #[inline(always)]
    unsafe fn load(self, r: usize, i: usize) -> __m512 {
        // SAFETY: the caller guarantees sixteen values at `i` and AVX-512 F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(self.0[r].as_ptr().add(2 * i).cast())) }
    }

    fn at(self, r: usize, i: usize) -> f32 {
        FloatFormat::F16.at(self.0[r], i)
    }
}

impl<const R: usize> TileRows for Bf16Rows<'_, R> {
    fn format(self) -> FloatFormat {
        FloatFormat::BF16
    }

    #[inline(always)]
    unsafe fn load(self, r: usize, i: usize) -> __m512 {
        let w = self.rows[r].as_ptr();
        if i < self.paired {
            // Lanes `off .. off + 16` of a pair-order block: the odd (first half) or the
            // even (second half) values of the sixteen column pairs from `b + 2 (off % 64)`.
            let b = i / PAIR_BLOCK * PAIR_BLOCK;
            let off = i - b;
            // SAFETY: the caller guarantees the row's values to `i + 16`, so the whole
            // pair-order block holding `i`, and AVX-512 F.
            let (odd, even) = unsafe { load_pairs(w.add(2 * (b + 2 * (off % LANES)))) };
            if off < LANES {
                odd
            } else {
                even
            }
        } else {
            // SAFETY: the caller guarantees sixteen values at `i` and AVX-512 F.
            unsafe { load(FloatFormat::BF16, w, i) }
        }
    }

    fn at(self, r: usize, i: usize) -> f32 {
        FloatFormat::BF16.at(self.rows[r], i)
    }
}

/// `R` weight rows (a multiple of four) against activation rows `x`, `A` at a time
/// (`R · A` accumulators, at most 24), in blocks of `block` columns.
///
/// # Safety
/// Every row of `w` and `x` must hold `x[0].len()` values; `x` holds a multiple of `A`
/// rows, at most [`TILE_ROWS`], and at most `TILE_ROWS / 2` groups of `A`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<W: TileRows, const R: usize, const A: usize>(
    w: W,
    x: &[&[f32]],
    ahead: &[u8],
    block: usize,
    out: &mut [[f32; R]],
) {
    let k = x[0].len();
    let whole = k / LANES * LANES;
    let tiles = x.len() / A;
    // `part[t][q]`, `[a][r]` of it: quarter `q`'s partial sums of activation row `A t + a`
    // by weight row `r`, carried from one block of columns to the next.
    let mut part = [[Carry::<[[__m512; R]; A]>::UNSET; 4]; TILE_ROWS / 2];
    // At least one block, so every carry is put, even with no whole step.
    let blocks = whole.div_ceil(block).max(1);
    let mut ahead = shares(ahead, 4 * tiles * blocks);
    for b in 0..blocks {
        let (from, to) = (b * block, ((b + 1) * block).min(whole));
        for q in 0..4 {
            for (t, part) in part.iter_mut().take(tiles).enumerate() {
                let part = &mut part[q];
                let xp: [*const f32; A] = std::array::from_fn(|a| x[A * t + a].as_ptr());
                for line in ahead.next().unwrap_or_default().chunks(64) {
                    _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                }
                // SAFETY: the first block's pass put every carry the later ones start from.
                let mut acc = unsafe { part.start(b == 0, [[_mm512_setzero_ps(); R]; A]) };
                let mut i = from + 16 * q;
                while i < to {
                    // SAFETY: `i + 16 <= to <= whole <= k` values of every row.
                    unsafe {
                        let xv: [__m512; A] =
                            std::array::from_fn(|a| _mm512_loadu_ps(xp[a].add(i)));
                        for r in 0..R {
                            let wv = w.load(r, i);
                            for (acc, &xv) in acc.iter_mut().zip(&xv) {
                                acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
                            }
                        }
                    }
                    i += LANES;
                }
                part.put(acc);
            }
        }
    }
    for (t, part) in part.iter().take(tiles).enumerate() {
        // SAFETY: the blocks put the carries of the first `tiles` groups of rows.
        let part: [&[[__m512; R]; A]; 4] = std::array::from_fn(|q| unsafe { part[q].sums() });
        fold_quarters(part, |a, r, folded| {
            let xa = x[A * t + a];
            let tail = (whole..k).map(|i| (w.at(r, i), xa[i]));
            out[A * t + a][r] = finish(w.format(), folded, tail);
        });
    }
}

/// A register tile's quarters of partial sums folded, four weight rows at a time by
/// [`fold4`]: `put(a, r, folded)` for each activation row `a` and weight row `r`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn fold_quarters<const R: usize, const A: usize>(
    part: [&[[__m512; R]; A]; 4],
    mut put: impl FnMut(usize, usize, f32),
) {
    for a in 0..A {
        let quarters = part.map(|q| &q[a]);
        for g in (0..R).step_by(4) {
            let folded = fold4(std::array::from_fn(|r| quarters.map(|q| q[g + r])));
            for (r, folded) in (g..).zip(folded) {
                put(a, r, folded);
            }
        }
    }
}

/// [`fold`] of four outputs' accumulators at once, lane for lane the same additions: the
/// halves of two outputs' sums side by side in one register, then of four.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn fold4(acc: [[__m512; 4]; 4]) -> [f32; 4] {
    let x = acc.map(|a| _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
    // Lanes 0..8 plus lanes 8..16 of outputs (0, 1) and (2, 3).
    let halves = |p: __m512, q: __m512| {
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(p, q);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(p, q);
        _mm512_add_ps(lo, hi)
    };
    let (s01, s23) = (halves(x[0], x[1]), halves(x[2], x[3]));
    // Lanes 0..4 plus lanes 4..8 of each output: one 128-bit lane per output.
    let c = _mm512_shuffle_f32x4::<0b10_00_10_00>(s01, s23);
    let d = _mm512_shuffle_f32x4::<0b11_01_11_01>(s01, s23);
    let u = _mm512_add_ps(c, d);
    // (u0 + u2) + (u1 + u3) in each 128-bit lane.
    let v = _mm512_add_ps(u, _mm512_shuffle_ps::<0b01_00_11_10>(u, u));
    let v = _mm512_add_ps(v, _mm512_shuffle_ps::<0b10_11_00_01>(v, v));
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds exactly sixteen f32; storeu has no alignment requirement.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
    [lanes[0], lanes[4], lanes[8], lanes[12]]
}
