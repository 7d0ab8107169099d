//! The AVX-512 VNNI kernel of the quantized product for batches: four weight rows against
//! activation rows four at a time, with exactly ggml's per-block arithmetic (eight integer
//! lanes per block, the scale product rounded to f32, one fused multiply-add per lane),
//! laid out so the multiply ports do only the integer dot products and the fused
//! multiply-adds.
//!
//! - Every (weight row, activation row) pair of a tile has its own 256-bit accumulator, so
//!   a block's eight lanes meet a single scale product, which the fused multiply-add takes
//!   straight from memory with an embedded broadcast. On a CPU that splits 512-bit
//!   operations in two (Zen 4), 256-bit ones do the same arithmetic in the same time.
//! - On a CPU that runs 512-bit operations at full width (Zen 5), or whose 256-bit
//!   operations share the 512-bit ones' ports (Intel's Xeons), two pairs share each
//!   512-bit register instead, so every integer dot product, conversion and multiply-add
//!   does twice the work ([`full_width`] measures which kind of CPU this is).
//! - Weight blocks are unpacked once per group of four rows to 32 unsigned bytes each
//!   ([`WideQuad::fill`]), with no lane shuffles (pairing two activation rows per 512-bit
//!   register would double every weight group). Activation rows are used as quantized,
//!   grouped by four.
//! - Signed weights (Q4_0, Q8_0, Q5_0) are made unsigned by an offset `k` (8 for the raw
//!   nibbles, 128 for bytes, 16 for five-bit values), and each integer dot product starts
//!   from minus `k` times its activation values' sum, so it ends at the signed sum itself.
//!   Q5_1 runs as Q4_1 does, its values five bits wide.
//! - A tile's sixteen results are summed from their lanes in registers, by the same tree
//!   as the row-at-a-time code.
//!
//! Products of eight or more activation rows run here; each group of four weight rows is
//! unpacked once and then serves every group of activation rows.

use std::arch::x86_64::*;
use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::cpu::Avx512Vnni;
use crate::fold::{pairs, quarters};
use crate::quant::{Batched, BlockFormat, QuantizedRow, BLOCK};

/// 64 bytes aligned for one 512-bit load.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Lane64([u8; 64]);

impl Lane64 {
    const ZERO: Lane64 = Lane64([0; 64]);

    /// The sixteen f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn ps(&self) -> __m512 {
        // SAFETY: `self` is 64 bytes aligned to 64 (repr above): one aligned load.
        unsafe { _mm512_load_ps(self.0.as_ptr().cast()) }
    }

    /// The `k`-th f32 (`k < 16`) in all eight lanes of a 256-bit register.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn splat(&self, k: usize) -> __m256 {
        let bytes = &self.0[4 * k..4 * k + 4];
        // SAFETY: `bytes` is 4 readable bytes; the load is unaligned.
        unsafe { _mm256_set1_ps(bytes.as_ptr().cast::<f32>().read_unaligned()) }
    }
}

/// 32 bytes aligned for one 256-bit load: a block's values, or its eight integer lanes.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Lane32([u8; 32]);

impl Lane32 {
    const ZERO: Lane32 = Lane32([0; 32]);

    /// The 32 bytes.
    #[inline]
    #[target_feature(enable = "avx")]
    fn si(&self) -> __m256i {
        // SAFETY: `self` is 32 bytes aligned to 32 (repr above): one aligned load.
        unsafe { _mm256_load_si256(self.0.as_ptr().cast()) }
    }
}

/// One block of four weight rows unpacked for the kernel: each row's 32 values as unsigned
/// bytes, then the four scales (lane `4k + r` holds row `k`'s, for every `r`) and the four
/// minimums likewise.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct QuadBlock {
    q: [Lane32; 4],
    scales: Lane64,
    mins: Lane64,
}

/// Four weight rows unpacked for the kernel, block by block.
#[derive(Debug, Default)]
pub(crate) struct WideQuad {
    blocks: Vec<QuadBlock>,
    /// Per block, the scale products of the activation group at hand (lane `4k + r`: weight
    /// row `k`'s scale times activation row `r`'s).
    products: Vec<Lane64>,
}

impl WideQuad {
    /// Unpacks four GGUF rows of `format` into this buffer, reusing its memory.
    pub(crate) fn fill(&mut self, cpu: Avx512Vnni, format: Batched, rows: [&[u8]; 4]) {
        let _ = cpu;
        // SAFETY: `cpu` proves every feature `fill_quad` enables.
        unsafe { fill_quad(self, format, rows) }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
fn fill_quad(quad: &mut WideQuad, format: Batched, rows: [&[u8]; 4]) {
    let stride = format.block_bytes();
    let nb = rows[0].len() / stride;
    assert!(rows.iter().all(|r| r.len() == nb * stride));
    let empty = QuadBlock {
        q: [Lane32::ZERO; 4],
        scales: Lane64::ZERO,
        mins: Lane64::ZERO,
    };
    quad.blocks.resize(nb, empty);
    // Q4_1 heads [d0 m0 d1 m1 d2 m2 d3 m3] -> scales and minimums, each four times in a row.
    let scale_of = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    let min_of = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
    // Q4_0 and Q8_0 heads [d0 d1 d2 d3] -> each scale four times in a row.
    let fours = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let low = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    // Where a block's value bytes (nibbles or bytes) start, and its high bits (Q5_0, Q5_1).
    let (values, high) = match format {
        Batched::Block(BlockFormat::Q4_1) => (4, None),
        Batched::Block(_) => (2, None),
        Batched::Q5_0 => (6, Some(2)),
        Batched::Q5_1 => (8, Some(4)),
    };
    let sixteen = _mm256_set1_epi8(16);
    let p = rows.map(|r| r.as_ptr());
    for (i, dst) in quad.blocks.iter_mut().enumerate() {
        let at = i * stride;
        // SAFETY: every row holds `nb` blocks of `stride` bytes (asserted), so each read
        // stays inside block `i` of its row: a 2- or 4-byte head, then 16 or 32 value bytes
        // at `values`; all loads are unaligned. Each `Lane32` and `Lane64` is aligned to
        // its size: aligned stores.
        unsafe {
            let (scales, mins) = if format.mins() {
                let head = |r: usize| p[r].add(at).cast::<i32>().read_unaligned();
                let dm = _mm256_cvtph_ps(_mm_setr_epi32(head(0), head(1), head(2), head(3)));
                let dm = _mm512_castps256_ps512(dm);
                (
                    _mm512_permutexvar_ps(scale_of, dm),
                    _mm512_permutexvar_ps(min_of, dm),
                )
            } else {
                let head = |r: usize| p[r].add(at).cast::<i16>().read_unaligned();
                let d = _mm_cvtph_ps(_mm_setr_epi16(
                    head(0),
                    head(1),
                    head(2),
                    head(3),
                    0,
                    0,
                    0,
                    0,
                ));
                (
                    _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(d)),
                    _mm512_setzero_ps(),
                )
            };
            for (row, lane) in p.iter().zip(&mut dst.q) {
                let v = row.add(at + values);
                // The 32 values in order, unsigned: Q8_0 bytes with the sign bit flipped,
                // nibbles as they are (low nibbles are values 0-15, high ones 16-31).
                let mut bytes = if format == Batched::Block(BlockFormat::Q8_0) {
                    _mm256_xor_si256(_mm256_loadu_si256(v.cast()), flip)
                } else {
                    let x = _mm_loadu_si128(v.cast());
                    let y = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(x),
                        _mm_srli_epi16::<4>(x),
                    );
                    _mm256_and_si256(y, low)
                };
                if let Some(high) = high {
                    // Value j's fifth bit is bit j of the block's four high-bit bytes: 16
                    // added to the nibble (Q5_0's values are thereby 16 above themselves).
                    let bits = row.add(at + high).cast::<u32>().read_unaligned();
                    bytes = _mm256_mask_add_epi8(bytes, bits, bytes, sixteen);
                }
                _mm256_store_si256(lane.0.as_mut_ptr().cast(), bytes);
            }
            _mm512_store_ps(dst.scales.0.as_mut_ptr().cast(), scales);
            _mm512_store_ps(dst.mins.0.as_mut_ptr().cast(), mins);
        }
    }
}

/// Activation rows laid out for the kernel in groups of four (the last group padded with
/// zero rows, whose results are dropped).
#[derive(Debug)]
pub(crate) struct WideActs {
    rows: usize,
    blocks: usize,
    /// Q4_1: `m · s` terms are added (and the integer sums start from zero).
    mins: bool,
    /// `[group][block][row]`: the row's 32 bytes of the block.
    q: Vec<Lane32>,
    /// `[group][block][row]`: where each of the block's eight integer sums starts (signed
    /// weights).
    start: Vec<Lane32>,
    /// `[group][block]`: the four rows' scales, then their `d · Σq` sums (Q4_1).
    ds: Vec<[f32; 8]>,
    /// Whether [`tile`] runs [`paired_avx512`] ([`full_width`]), decided once per product.
    paired: bool,
}

/// One group of four activation rows' cells in [`WideActs`].
struct Group<'a> {
    /// `[block][row]`: the rows' bytes.
    q: &'a [Lane32],
    /// `[block][row]`: the integer sums' starts (empty with minimums).
    start: &'a [Lane32],
    /// `[block]`: the scales, then the `d · Σq` sums.
    ds: &'a [[f32; 8]],
}

impl WideActs {
    /// Lays out `acts` for weights of `format`.
    pub(crate) fn new(cpu: Avx512Vnni, format: Batched, acts: &[QuantizedRow]) -> Self {
        let blocks = acts.first().map_or(0, |a| a.d.len());
        assert!(acts
            .iter()
            .all(|a| a.d.len() == blocks && a.q.len() == blocks * BLOCK));
        let mins = format.mins();
        // What makes the weights unsigned, as a power of two: raw nibbles are 8 above Q4_0's
        // values, flipped sign bits 128 above Q8_0's, five-bit values 16 above Q5_0's.
        let shift = match format {
            Batched::Block(BlockFormat::Q4_1) | Batched::Q5_1 => None,
            Batched::Block(BlockFormat::Q4_0) => Some(3),
            Batched::Block(BlockFormat::Q8_0) => Some(7),
            Batched::Q5_0 => Some(4),
        };
        let cells = acts.len().div_ceil(4) * blocks * 4;
        let mut out = WideActs {
            rows: acts.len(),
            blocks,
            mins,
            q: vec![Lane32::ZERO; cells],
            start: if mins {
                Vec::new()
            } else {
                vec![Lane32::ZERO; cells]
            },
            ds: vec![[0.0; 8]; cells / 4],
            paired: full_width(cpu),
        };
        for (n, a) in acts.iter().enumerate() {
            let (g, r) = (n / 4, n % 4);
            for (i, q) in a.q.chunks_exact(BLOCK).enumerate() {
                let cell = &mut out.q[(g * blocks + i) * 4 + r];
                for (dst, &src) in cell.0.iter_mut().zip(q) {
                    *dst = src as u8;
                }
            }
            for (i, ds) in out.ds[g * blocks..(g + 1) * blocks].iter_mut().enumerate() {
                ds[r] = a.d[i];
                if mins {
                    ds[4 + r] = a.s[i];
                }
            }
        }
        if let Some(shift) = shift {
            let _ = cpu;
            // SAFETY: `cpu` proves every feature `starts` enables.
            unsafe { starts(&mut out, shift) };
        }
        out
    }

    /// How many activation rows (without padding).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Checks that these rows fit a tile of `nb`-block weight rows with `mins` into `out`.
    fn check(&self, nb: usize, out: &[[f32; 4]], mins: bool) {
        assert!(self.blocks == nb && out.len() == self.rows && self.mins == mins);
        assert!(
            self.q.len() == out.len().div_ceil(4) * 4 * nb && self.ds.len() * 4 == self.q.len()
        );
        assert!(mins || self.start.len() == self.q.len());
    }

    /// Group `g`'s cells.
    fn group(&self, g: usize) -> Group<'_> {
        let (nb, cells) = (self.blocks, 4 * g * self.blocks..4 * (g + 1) * self.blocks);
        Group {
            q: &self.q[cells.clone()],
            start: if self.mins { &[] } else { &self.start[cells] },
            ds: &self.ds[g * nb..(g + 1) * nb],
        }
    }
}

/// Fills `out.start` with minus `2^shift` times each four activation values' sum.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
fn starts(out: &mut WideActs, shift: u32) {
    let ones = _mm256_set1_epi8(1);
    for (q, start) in out.q.iter().zip(&mut out.start) {
        let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q.si());
        let start_at = _mm256_sub_epi32(
            _mm256_setzero_si256(),
            _mm256_sll_epi32(sums, _mm_cvtsi32_si128(shift as i32)),
        );
        // SAFETY: each `Lane32` is 32 bytes aligned to 32: an aligned store.
        unsafe { _mm256_store_si256(start.0.as_mut_ptr().cast(), start_at) };
    }
}

/// `out[i]`: the four weight rows of `quad` against activation row `i` of `acts`; exactly
/// the arithmetic of the row-at-a-time dot products. Where this CPU runs 512-bit integer
/// dot products as fast as 256-bit ones ([`full_width`], asked once per product by
/// [`WideActs::new`]), two (weight row, activation row) pairs share each register
/// ([`paired_avx512`]); elsewhere each pair has a 256-bit register of its own
/// ([`tile_avx512`]). The two give the same bits.
pub(crate) fn tile(cpu: Avx512Vnni, quad: &mut WideQuad, acts: &WideActs, out: &mut [[f32; 4]]) {
    tile_as(cpu, acts.paired, quad, acts, out);
}

/// [`tile`] with the kernel chosen by `paired`.
fn tile_as(
    cpu: Avx512Vnni,
    paired: bool,
    quad: &mut WideQuad,
    acts: &WideActs,
    out: &mut [[f32; 4]],
) {
    let _ = cpu;
    // SAFETY: `cpu` proves every feature `tile_avx512` and `paired_avx512` enable.
    unsafe {
        match (paired, acts.mins) {
            (true, true) => paired_avx512::<true>(quad, acts, out),
            (true, false) => paired_avx512::<false>(quad, acts, out),
            (false, true) => tile_avx512::<true>(quad, acts, out),
            (false, false) => tile_avx512::<false>(quad, acts, out),
        }
    }
}

/// Whether [`paired_avx512`] beats [`tile_avx512`] on this CPU: measured once per process
/// by running each kernel's mix of operations per block ([`block_mix`]: the integer dot
/// products, conversions and fused multiply-adds, and the paired kernel's permutes) on
/// registers alone, a few microseconds, the faster of five tries each; paired where its mix
/// takes under nine tenths of the other's time. A CPU that splits 512-bit operations in two
/// (Zen 4) gains nothing from pairing. One that runs them at full width (Zen 5) does the
/// paired block in about two thirds of the time. So do Intel cores that run a 512-bit
/// `vpdpbusd` on one port and a 256-bit one on two (a Xeon of family 6, model 167): there
/// every 256-bit operation of the unpaired tile shares those two ports too, and pairing
/// halves their count. The choice changes no result, only the time.
pub(crate) fn full_width(cpu: Avx512Vnni) -> bool {
    static FULL: OnceLock<bool> = OnceLock::new();
    *FULL.get_or_init(|| {
        let _ = cpu;
        let (mut wide, mut narrow) = (Duration::MAX, Duration::MAX);
        for _ in 0..5 {
            // SAFETY: `cpu` proves AVX-512 F, VL and VNNI.
            unsafe {
                narrow = narrow.min(block_mix::<false>());
                wide = wide.min(block_mix::<true>());
            }
        }
        wide.as_nanos() * 10 < narrow.as_nanos() * 9
    })
}

/// The time of 2048 rounds of one kernel's operations for twelve (weight row, activation
/// row) pair-blocks: [`paired_avx512`]'s (`WIDE`: six 512-bit integer dot products,
/// conversions, permutes and fused multiply-adds) or [`tile_avx512`]'s (twelve 256-bit dot
/// products, conversions and fused multiply-adds), each in a chain of its own so that only
/// the CPU's ports bound the time.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni")]
fn block_mix<const WIDE: bool>() -> Duration {
    const ROUNDS: usize = 2048;
    let (a, b) = (
        black_box(_mm512_set1_epi8(3)),
        black_box(_mm512_set1_epi8(5)),
    );
    let start = Instant::now();
    if WIDE {
        const CHAINS: usize = 6;
        let pick = black_box(_mm512_setr_epi32(
            1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14,
        ));
        let mut acc = [_mm512_setzero_si512(); CHAINS];
        let mut scale = [_mm512_set1_ps(1.0); CHAINS];
        let mut sum = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..ROUNDS {
            for k in 0..CHAINS {
                acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
                scale[k] = _mm512_permutexvar_ps(pick, scale[k]);
                sum[k] = _mm512_fmadd_ps(scale[k], _mm512_cvtepi32_ps(acc[k]), sum[k]);
            }
        }
        black_box((acc, sum));
    } else {
        const CHAINS: usize = 12;
        let (a, b) = (_mm512_castsi512_si256(a), _mm512_castsi512_si256(b));
        let scale = black_box(_mm256_set1_ps(1.0));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        let mut sum = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..ROUNDS {
            for k in 0..CHAINS {
                acc[k] = _mm256_dpbusd_epi32(acc[k], a, b);
                sum[k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc[k]), sum[k]);
            }
        }
        black_box((acc, sum));
    }
    start.elapsed()
}

/// Two adjacent 32-byte cells, `cells[at]` and `cells[at + 1]`, in one register.
#[inline]
#[target_feature(enable = "avx512f")]
fn two_cells(cells: &[Lane32], at: usize) -> __m512i {
    assert!(at + 2 <= cells.len());
    // SAFETY: the assertion keeps the 64 bytes read inside `cells` (`Lane32` is 32 bytes,
    // `repr(C)`, so two neighbours are 64 contiguous bytes); the load is unaligned.
    unsafe { _mm512_loadu_si512(cells.as_ptr().add(at).cast()) }
}

/// [`tile_avx512`] with each 512-bit register holding two (weight row, activation row)
/// pairs' eight lanes — weight row `k` against activation rows `2p` and `2p + 1` — so a
/// block takes eight 512-bit integer dot products, conversions and fused multiply-adds
/// where [`tile_avx512`] takes sixteen 256-bit ones, plus eight permutes that spread the
/// scale products over the halves. On a Zen 5 (AMD EPYC, family 26) the integer dot
/// products and the fused multiply-adds share two pipes, two a cycle whatever their width,
/// and the conversions and permutes run beside them: sixteen operations a block on those
/// pipes where there were 32. Each lane sees the same operations in the same block order,
/// so the bits are [`tile_avx512`]'s. Zen 5, one thread, `cargo run --release -p
/// ferrite-kernels --example matvec -- q8_0 2304 1 256`: 110–112 → 152–154 G
/// multiply-adds/s (Q4_1 111–112 → 151–154, Q4_0 108 → 146, Q5_0 113 → 154, Q5_1 110 →
/// 149); 1000-token prompts of the random 1.1B model in Q8_0, 2 threads, 164–170 → 201–202
/// tok/s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn paired_avx512<const MINS: bool>(quad: &WideQuad, acts: &WideActs, out: &mut [[f32; 4]]) {
    let quad = &quad.blocks;
    acts.check(quad.len(), out, MINS);
    // `pick[k][p]`: lane 4k + 2p of the scale products in the low eight lanes, lane
    // 4k + 2p + 1 in the high eight.
    let pick: [[__m512i; 2]; 4] = std::array::from_fn(|k| {
        std::array::from_fn(|p| {
            let lo = _mm512_set1_epi32((4 * k + 2 * p) as i32);
            _mm512_mask_add_epi32(lo, 0xff00, lo, _mm512_set1_epi32(1))
        })
    });
    for (g, outs) in out.chunks_mut(4).enumerate() {
        let group = acts.group(g);
        let mut summs = _mm512_setzero_ps();
        // `acc[k][p]`: weight row k against activation rows 2p (low half), 2p + 1 (high).
        let mut acc = [[_mm512_setzero_ps(); 2]; 4];
        for (i, (w, ds)) in quad.iter().zip(group.ds).enumerate() {
            if MINS {
                summs = _mm512_fmadd_ps(w.mins.ps(), four_times(&ds[4..]), summs);
            }
            // Lane 4k + r: weight row k's scale times activation row r's, as [`tile`] has.
            let products = _mm512_mul_ps(w.scales.ps(), four_times(ds));
            let y = [0, 1].map(|p| two_cells(group.q, 4 * i + 2 * p));
            let from = [0, 1].map(|p| {
                if MINS {
                    _mm512_setzero_si512()
                } else {
                    two_cells(group.start, 4 * i + 2 * p)
                }
            });
            for (k, (row, pick)) in acc.iter_mut().zip(&pick).enumerate() {
                let x = _mm512_broadcast_i64x4(w.q[k].si());
                for p in 0..2 {
                    let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(from[p], x, y[p]));
                    let scale = _mm512_permutexvar_ps(pick[p], products);
                    row[p] = _mm512_fmadd_ps(scale, sums, row[p]);
                }
            }
        }
        // The pairs' halves as [`tile`]'s 256-bit accumulators.
        let half = |z: __m512, high: bool| {
            let z = _mm512_castps_pd(z);
            _mm256_castpd_ps(if high {
                _mm512_extractf64x4_pd::<1>(z)
            } else {
                _mm512_castpd512_pd256(z)
            })
        };
        let acc = acc.map(|row| [0, 1, 2, 3].map(|r| half(row[r / 2], r % 2 == 1)));
        store_group(finish(acc), summs, outs);
    }
}

/// A group's sixteen sums (lane `4k + r`: weight row `k`, activation row `r`) plus its
/// `m · s` terms `summs`, into its one to four rows of outputs.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_group(sums: __m512, summs: __m512, outs: &mut [[f32; 4]]) {
    // Lane 4k + r (weight row k, activation row r) to lane 4r + k.
    let by_row = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let rows = _mm512_permutexvar_ps(by_row, _mm512_add_ps(sums, summs));
    if outs.len() == 4 {
        // SAFETY: four rows of four f32 are exactly sixteen contiguous f32; the store is
        // unaligned. (A whole group is stored straight, not through a library copy.)
        unsafe { _mm512_storeu_ps(outs.as_mut_ptr().cast(), rows) };
    } else {
        let mut all = [[0f32; 4]; 4];
        // SAFETY: `all` holds exactly sixteen f32; the store is unaligned.
        unsafe { _mm512_storeu_ps(all.as_mut_ptr().cast(), rows) };
        outs.copy_from_slice(&all[..outs.len()]);
    }
}

/// Four f32 (`four[0..4]`) in each 128-bit lane: one broadcast load.
#[inline]
#[target_feature(enable = "avx512f")]
fn four_times(four: &[f32]) -> __m512 {
    assert!(four.len() >= 4);
    // SAFETY: the assertion keeps the 16 bytes read inside `four`; the load is unaligned.
    _mm512_broadcast_f32x4(unsafe { _mm_loadu_ps(four.as_ptr()) })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn tile_avx512<const MINS: bool>(quad: &mut WideQuad, acts: &WideActs, out: &mut [[f32; 4]]) {
    let WideQuad {
        blocks: quad,
        products,
    } = quad;
    acts.check(quad.len(), out, MINS);
    products.resize(quad.len(), Lane64::ZERO);
    for (g, outs) in out.chunks_mut(4).enumerate() {
        let group = acts.group(g);
        // First the scale products, so the main loop takes each from memory.
        for ((p, w), ds) in products.iter_mut().zip(quad.iter()).zip(group.ds) {
            let product = _mm512_mul_ps(w.scales.ps(), four_times(ds));
            // SAFETY: each `Lane64` is 64 bytes aligned to 64: an aligned store.
            unsafe { _mm512_store_ps(p.0.as_mut_ptr().cast(), product) };
        }
        let mut summs = _mm512_setzero_ps();
        // `acc[k][r]`: weight row k against activation row r, eight lanes.
        let mut acc = [[_mm256_setzero_ps(); 4]; 4];
        for (i, ((w, ds), scales)) in quad.iter().zip(group.ds).zip(products.iter()).enumerate() {
            if MINS {
                summs = _mm512_fmadd_ps(w.mins.ps(), four_times(&ds[4..]), summs);
            }
            let y = [0, 1, 2, 3].map(|r| group.q[4 * i + r].si());
            let from = [0, 1, 2, 3].map(|r| {
                if MINS {
                    _mm256_setzero_si256()
                } else {
                    group.start[4 * i + r].si()
                }
            });
            // Weight row by weight row: each row's block meets the four activation rows in
            // turn (the order the compiler allocates registers best for; every accumulator
            // sees the same operations in the same block order either way).
            for (k, row) in acc.iter_mut().enumerate() {
                let x = w.q[k].si();
                for (r, cell) in row.iter_mut().enumerate() {
                    let sums = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(from[r], x, y[r]));
                    *cell = _mm256_fmadd_ps(scales.splat(4 * k + r), sums, *cell);
                }
            }
        }
        store_group(finish(acc), summs, outs);
    }
}

/// The sixteen sums of a tile's accumulators, lane `4k + r` for weight row `k` and
/// activation row `r`: each accumulator's eight lanes summed exactly as [`crate::quant::portable::hsum8`]
/// does — lanes `j` and `j + 4`, then the pairs, then the last two — all at once.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn finish(acc: [[__m256; 4]; 4]) -> __m512 {
    let joined = |a: __m256, b: __m256| {
        let a = _mm512_castps_pd(_mm512_castps256_ps512(a));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(a, _mm256_castps_pd(b)))
    };
    // Per activation row r, quarter k: weight row k's lanes j + (j + 4).
    let by_r =
        [0, 1, 2, 3].map(|r| quarters(joined(acc[0][r], acc[1][r]), joined(acc[2][r], acc[3][r])));
    // Quarter k: rows r and r + 1 of each pair, lanes (0 + 2, 1 + 3).
    let (a, b) = (pairs(by_r[0], by_r[1]), pairs(by_r[2], by_r[3]));
    // Quarter k: the last two of rows 0, 1, 2, 3.
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::portable::{dot_q4_0, dot_q4_1, dot_q8_0};
    use crate::quant::q5::{dot_q5_0, dot_q5_1};
    use half::f16;

    /// GGUF rows of `format` from a byte pattern, with finite scales (and minimums).
    fn weight_rows(format: Batched, blocks: usize, salt: usize) -> [Vec<u8>; 4] {
        [0, 1, 2, 3].map(|r| {
            let mut row = Vec::new();
            for i in 0..blocks {
                let k = salt + 7 * r + 3 * i;
                row.extend(f16::from_f32(0.01 + k as f32 * 0.003).to_le_bytes());
                if format.mins() {
                    row.extend(f16::from_f32(-0.05 * k as f32).to_le_bytes());
                }
                let values = format.block_bytes() - row.len() % format.block_bytes();
                // Extremes first (0x80 is -128 in Q8_0, 0xFF and 0x00 are 15 and 0
                // nibbles; in Q5_0 and Q5_1 the first four bytes are the high bits),
                // then a pattern.
                row.extend([0x80u8, 0x7F, 0xFF, 0x00]);
                row.extend((4..values).map(|j| (j * 131 + k * 17) as u8));
            }
            row
        })
    }

    /// An activation row with extreme bytes (±127) and a pattern, scales and sums.
    fn activation(blocks: usize, salt: usize) -> QuantizedRow {
        let q: Vec<i8> = (0..blocks * BLOCK)
            .map(|j| match (j + salt) % 9 {
                0 => 127,
                1 => -127,
                _ => ((j * 37 + salt * 11) % 255) as i32 as i8,
            })
            .collect();
        let d = (0..blocks)
            .map(|i| 0.002 + (i + salt) as f32 * 1e-3)
            .collect();
        let s = (0..blocks).map(|i| (i as f32 - 2.5) * 0.7).collect();
        QuantizedRow { d, s, q }
    }

    /// A row-at-a-time dot product: weight row, activation row.
    type Dot = fn(&[u8], &QuantizedRow) -> f32;

    #[test]
    fn both_wide_kernels_match_the_portable_code_bit_for_bit() {
        let Some(cpu) = crate::cpu::detect().avx512_vnni() else {
            tell!("the AVX-512 VNNI wide kernel not checked: no AVX-512 VNNI tier here (the CPU lacks it or FERRITE_CPU_TIER caps it)");
            return;
        };
        let blocks = 5;
        let formats: [(Batched, Dot); 5] = [
            (Batched::Block(BlockFormat::Q4_0), dot_q4_0),
            (Batched::Block(BlockFormat::Q4_1), dot_q4_1),
            (Batched::Block(BlockFormat::Q8_0), dot_q8_0),
            (Batched::Q5_0, dot_q5_0),
            (Batched::Q5_1, dot_q5_1),
        ];
        for (format, dot) in formats {
            let rows = weight_rows(format, blocks, 1);
            let w = [0, 1, 2, 3].map(|r| &rows[r][..]);
            let mut quad = WideQuad::default();
            quad.fill(cpu, format, w);
            // Whole groups, a padded group, and a single row.
            for n in [1, 3, 4, 9] {
                let acts: Vec<QuantizedRow> = (0..n).map(|i| activation(blocks, i)).collect();
                let wide = WideActs::new(cpu, format, &acts);
                // The kernel this CPU runs, and the other one.
                let mut out = vec![[0f32; 4]; n];
                tile(cpu, &mut quad, &wide, &mut out);
                let mut paired = vec![[0f32; 4]; n];
                tile_as(cpu, !wide.paired, &mut quad, &wide, &mut paired);
                for (i, ((o, p), a)) in out.iter().zip(&paired).zip(&acts).enumerate() {
                    let want = w.map(|row| dot(row, a).to_bits());
                    assert_eq!(o.map(f32::to_bits), want, "{format:?}, {n} rows, row {i}");
                    let other = if wide.paired { "256-bit" } else { "paired" };
                    assert_eq!(
                        p.map(f32::to_bits),
                        want,
                        "{other}: {format:?}, {n} rows, row {i}"
                    );
                }
            }
        }
    }
}
