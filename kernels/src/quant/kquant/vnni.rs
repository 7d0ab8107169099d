//! The AVX-512 VNNI K-quant tile: four weight rows against many activation rows, each
//! pair's result ggml's dot product bit for bit, in fewer multiplies than
//! [`super::tile`]'s AVX-512 tile.
//!
//! ggml's lane `l` of a pair (weight row, activation row) sums, over a super-block's eight
//! 32-value chunks `c`, the chunk's scale times `D(c, l)`, the four products of bytes
//! `4l..4l + 4` (Q6_K, Q3_K and Q2_K scale each chunk's lanes 0–3 and 4–7 apart). One
//! `vpdpbusd` gives the `D`s of two chunks of one weight row (16 lanes); they fit in i16 (at
//! most 4 · 63 · 127), so `vpackssdw` packs two rows' into i16 pairs `(D(c, l), D(c + 1,
//! l))`, and one `vpdpwssd` multiplies each pair by its two scales and adds both to the
//! lane: three multiplies per two chunks of two rows, where `maddubs` and `madd` take four.
//! Q2_K's and Q3_K's values times their scales (one per sixteen values) fit a byte (Q3_K's
//! negated), so their rows are unpacked already scaled and their lanes need only the
//! `vpdpbusd`s ([`scaled_sumi`]). The integers are exact, so each lane holds ggml's sum.
//!
//! For the pairs to land in one i32 lane, the two chunks' 4-byte groups alternate: weight and
//! activation bytes alike are laid out in [`super::pair_order`] (the activation rows once
//! per product, in [`super::Q8KRow::paired`]; the weight rows as they are unpacked). The
//! tile's lane `4g + j` (for `g` in 0..4, `j` in 0..4) then holds weight row `2h + j / 2`'s
//! ggml lane `2g + j % 2`; its float constants are laid out alike, and the results are read
//! back in ggml's order.
//!
//! Each activation super-block is four 64-byte loads per four weight rows, so the pair-order
//! bytes start on a cache line ([`super::LineBytes`]): 16 bytes past one, every load
//! straddles two lines and the tile ran no faster than [`super::tile`]'s. On the line (the
//! tile then taking two weight rows at a time), AMD EPYC (Zen 5), 2 threads, random 1.1B
//! Q4_K_M, alternating with the AVX-512 tile: 512-token prompts 214–220 -> 257–263 tok/s, a
//! 16-request decode step's weight products 80–88 -> 67 ms.

use std::arch::x86_64::*;

use super::avx2::{
    k4_scales_mins, k4_values, load32, q2k_scales_mins, q2k_values, q3k_scales, q3k_values,
    q6k_values,
};
use super::tile::{finish_quads, no_scalars, quad_float_step, Floats, QuadAcc, Scalars, GROUP};
use super::{f16_at, format, scales_in_values, KFormat, Q8KRow, Q2, Q3, Q4, Q5, Q6, QK_K};

/// Where weight row `r`'s ggml lane `l` lies in the tile's accumulators (two vectors of
/// sixteen lanes, rows 0 and 1 in the first).
fn lane_of(r: usize, l: usize) -> usize {
    16 * (r / 2) + 4 * (l / 2) + 2 * (r % 2) + l % 2
}

/// Word indices that gather, from sixteen i16 scales of row `2h` then sixteen of row
/// `2h + 1`, lane `4g + j`'s pair of scales for chunks `2p` and `2p + 1`: Q4_K and Q5_K have
/// one scale per chunk (the first eight words), Q6_K, Q3_K and Q2_K one per sixteen values,
/// so lanes 4–7 of a chunk take its second.
const fn scale_index(per_sixteen: bool) -> [[u16; 32]; 4] {
    let mut idx = [[0u16; 32]; 4];
    let mut p = 0;
    while p < 4 {
        let mut lane = 0;
        while lane < 16 {
            let (g, j) = (lane / 4, lane % 4);
            let (row, l) = (j / 2, 2 * g + j % 2);
            let mut t = 0;
            while t < 2 {
                let chunk = 2 * p + t;
                let scale = if per_sixteen {
                    2 * chunk + (l >= 4) as usize
                } else {
                    chunk
                };
                idx[p][2 * lane + t] = (16 * row + scale) as u16;
                t += 1;
            }
            lane += 1;
        }
        p += 1;
    }
    idx
}

const SCALES_PER_CHUNK: [[u16; 32]; 4] = scale_index(false);
const SCALES_PER_SIXTEEN: [[u16; 32]; 4] = scale_index(true);

/// Word indices that gather, from row `2h`'s sixteen Q6_K scales (or Q2_K minimums) then row
/// `2h + 1`'s, lane `4g + j`'s two (those of its sixteen-value blocks `2l` and `2l + 1`).
const fn block_scale_index() -> [u16; 32] {
    let mut idx = [0u16; 32];
    let mut lane = 0;
    while lane < 16 {
        let (g, j) = (lane / 4, lane % 4);
        let (row, l) = (j / 2, 2 * g + j % 2);
        idx[2 * lane] = (16 * row + 2 * l) as u16;
        idx[2 * lane + 1] = (16 * row + 2 * l + 1) as u16;
        lane += 1;
    }
    idx
}

const BLOCK_SCALES: [u16; 32] = block_scale_index();

/// Word indices that gather, from a Q2_K or Q3_K row's sixteen i16 scales, the scale of each
/// word of its chunks `2p` and `2p + 1` in pair order (`[p]`): 32-bit lane `L` holds four
/// values of chunk `2p + L % 2`, from its first sixteen where `L < 8`.
const VALUE_SCALES: [[u16; 32]; 4] = {
    let mut idx = [[0u16; 32]; 4];
    let mut p = 0;
    while p < 4 {
        let mut word = 0;
        while word < 32 {
            let lane = word / 2;
            let chunk = 2 * p + lane % 2;
            idx[p][word] = (2 * chunk + (lane >= 8) as usize) as u16;
            word += 1;
        }
        p += 1;
    }
    idx
};

/// 32-bit indices that gather, from an activation row's sixteen block sums (as eight i32),
/// lane `4g + j`'s two: those of its ggml lane `2g + j % 2`.
const BLOCK_SUMS: [u32; 16] = {
    let mut idx = [0u32; 16];
    let mut lane = 0;
    while lane < 16 {
        idx[lane] = (2 * (lane / 4) + lane % 2) as u32;
        lane += 1;
    }
    idx
};

/// Four weight rows' super-block, unpacked in pair order, with what the float step
/// multiplies by.
#[repr(C, align(64))]
struct Pairs {
    /// Row `2h + k % 2`'s chunks `2p` and `2p + 1` (`p = k / 2`) at `w[h][k]`, in pair order.
    w: [[__m512i; 8]; 2],
    /// For chunks `2p` and `2p + 1`, each lane's two scales at `s[h][p]` (not for Q2_K and Q3_K,
    /// whose values carry theirs).
    s: [[__m512i; 4]; 2],
    /// Each row's scales as sixteen i16 (Q4_K and Q5_K: eight, twice).
    scales: [__m256i; 4],
    /// Each row's lanes' start (in pair order): Q3_K's takes off 127 times the sum of the
    /// lane's scaled values ([`scaled_sumi`]); zero for the other formats.
    start: [__m512i; 4],
    k: [Scalars; 4],
    f: Floats,
}

/// A word-index vector's 32 indices.
#[inline]
#[target_feature(enable = "avx512f")]
fn words(idx: &[u16; 32]) -> __m512i {
    // SAFETY: `idx` is 64 bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

/// Chunks `c` (`lo`) and `c + 1` (`hi`) in pair order: 4-byte group `L` from group `L / 2`
/// of `lo` (`L` even) or of `hi` (`L` odd).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn interleave(lo: __m256i, hi: __m256i) -> __m512i {
    let idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_permutex2var_epi32(_mm512_zextsi256_si512(lo), idx, _mm512_zextsi256_si512(hi))
}

/// Unpacks super-block `b` of weight row `r` into `pairs` (Q2_K's values already
/// multiplied by their scales, Q3_K's by minus theirs).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
fn unpack<const F: u8>(b: &[u8], r: usize, pairs: &mut Pairs) {
    let (h, side) = (r / 2, r % 2);
    let k = &mut pairs.k[r];
    if F == Q6 {
        // SAFETY: the super-block's sixteen scale bytes start at 192 of its 210.
        let scales = unsafe { _mm_loadu_si128(b[192..208].as_ptr().cast()) };
        k.extra = _mm256_cvtepi8_epi16(scales);
        pairs.scales[r] = k.extra;
        for j in 0..QK_K / 128 {
            let [a, b1, c, d] = q6k_values(b, j);
            pairs.w[h][4 * j + side] = interleave(a, b1);
            pairs.w[h][4 * j + 2 + side] = interleave(c, d);
        }
        k.d = f16_at(b, 208);
    } else if F == Q2 || F == Q3 {
        if F == Q2 {
            (pairs.scales[r], k.extra) = q2k_scales_mins(b);
            k.d = f16_at(b, 80);
            k.dmin = f16_at(b, 82);
        } else {
            pairs.scales[r] = q3k_scales(b);
            k.d = f16_at(b, 108);
        }
        let hbits = (F == Q3).then(|| load32(b, 0));
        for j in 0..QK_K / 128 {
            let [a, b1, c, d] = match hbits {
                Some(hbits) => q3k_values(b, hbits, j),
                None => q2k_values(b, j),
            };
            pairs.w[h][4 * j + side] = interleave(a, b1);
            pairs.w[h][4 * j + 2 + side] = interleave(c, d);
        }
        let scales = _mm512_zextsi256_si512(pairs.scales[r]);
        let mut sum = _mm512_setzero_si512();
        for (p, idx) in VALUE_SCALES.iter().enumerate() {
            let s = _mm512_permutexvar_epi16(words(idx), scales);
            let w = &mut pairs.w[h][2 * p + side];
            if F == Q2 {
                // Each value times its scale: at most 3 · 15, a byte, and the i16 product of
                // a word's two bytes carries nothing from the low one into the high one.
                *w = _mm512_mullo_epi16(*w, s);
            } else {
                // Minus each value times its scale, -128..=124 (from -4 · -32 down to 3 · 31
                // up): a byte's product is the low byte of its word's product with the
                // scale, the low byte's taken from the word as it is and the high byte's
                // from the word with its low byte cleared.
                let minus = _mm512_sub_epi8(_mm512_set1_epi8(4), *w);
                let low = _mm512_mullo_epi16(minus, s);
                let high_only = _mm512_and_si512(minus, _mm512_set1_epi16(0xFF00u16 as i16));
                let high = _mm512_mullo_epi16(high_only, s);
                *w = _mm512_mask_blend_epi8(0xAAAA_AAAA_AAAA_AAAA, low, high);
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(127), *w);
            }
        }
        if F == Q3 {
            pairs.start[r] = _mm512_sub_epi32(_mm512_setzero_si512(), sum);
        }
    } else {
        let (scales, mins) = k4_scales_mins(b);
        k.extra = _mm256_zextsi128_si256(mins);
        pairs.scales[r] = scales;
        let hbits = (F == Q5).then(|| load32(b, 16));
        for j in 0..QK_K / 64 {
            let [lo, hi] = k4_values(b, hbits, j);
            pairs.w[h][2 * j + side] = interleave(lo, hi);
        }
        k.d = f16_at(b, 0);
        k.dmin = f16_at(b, 2);
    }
}

/// `a` in the lanes of row `2h` and `b` in those of row `2h + 1` (lane `4g + j` is row
/// `2h + j / 2`'s).
#[inline]
#[target_feature(enable = "avx512f")]
fn per_lane(a: f32, b: f32) -> __m512 {
    _mm512_set_ps(b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a)
}

/// Fills `pairs`' scale pairs and float constants from its four rows' scales and scalars.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn constants<const F: u8>(pairs: &mut Pairs) {
    let table = if F == Q4 || F == Q5 {
        &SCALES_PER_CHUNK
    } else {
        &SCALES_PER_SIXTEEN
    };
    for h in 0..2 {
        let both = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(pairs.scales[2 * h]),
            pairs.scales[2 * h + 1],
        );
        if !scales_in_values(F) {
            for (s, idx) in pairs.s[h].iter_mut().zip(table) {
                *s = _mm512_permutexvar_epi16(words(idx), both);
            }
        }
        if F == Q6 {
            pairs.f.extra2[h] = _mm512_permutexvar_epi16(words(&BLOCK_SCALES), both);
        }
        let rows = [&pairs.k[2 * h], &pairs.k[2 * h + 1]];
        if F == Q2 {
            let mins =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(rows[0].extra), rows[1].extra);
            pairs.f.extra2[h] = _mm512_permutexvar_epi16(words(&BLOCK_SCALES), mins);
            pairs.f.dmin[h] = per_lane(rows[0].dmin, rows[1].dmin);
        }
        pairs.f.d[h] = per_lane(rows[0].d, rows[1].d);
    }
    if F == Q4 || F == Q5 {
        pairs.f.set_mins4(&pairs.k);
    }
}

/// The lanes of all four rows against super-block `i` of each activation row, handed to
/// `then(act, state, lanes)` with the row's state: rows 0 and 1's, then rows 2 and 3's. The
/// rows' values (sixteen registers) stay in registers for every activation row, whose
/// four 64-byte loads each meet all four rows, as do its state's loads and stores. Against
/// two rows at a time (the values and scales of two in registers, each activation row
/// loaded twice), Zen 5, 2 threads, random 1.1B Q4_K_M, alternating: 512-token prompts
/// 236–257 -> 259–277 tok/s, a 16-request decode step's weight products 72–73 -> 60–64 ms.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
fn quad_sumi<const F: u8>(
    pairs: &Pairs,
    acts: &[Q8KRow],
    i: usize,
    states: &mut [QuadAcc],
    then: impl Fn(&Q8KRow, &mut QuadAcc, [__m512i; 2]),
) {
    if scales_in_values(F) {
        return scaled_sumi::<F>(pairs, acts, i, states, then);
    }
    let w = pairs.w;
    let zero = _mm512_setzero_si512();
    for (act, state) in acts.iter().zip(states) {
        let y = &act.paired[i * QK_K..(i + 1) * QK_K];
        let mut acc = [zero; 2];
        for p in 0..4 {
            // SAFETY: `y` holds 256 bytes, so 64 from `64 p`; the load is unaligned.
            let y = unsafe { _mm512_loadu_si512(y[64 * p..].as_ptr().cast()) };
            for h in 0..2 {
                let r0 = _mm512_dpbusd_epi32(zero, w[h][2 * p], y);
                let r1 = _mm512_dpbusd_epi32(zero, w[h][2 * p + 1], y);
                acc[h] = _mm512_dpwssd_epi32(acc[h], pairs.s[h][p], _mm512_packs_epi32(r0, r1));
            }
        }
        then(act, state, acc);
    }
}

/// [`quad_sumi`] for Q2_K and Q3_K, whose values [`unpack`] has multiplied by their scales:
/// each `vpdpbusd` adds its four products, already scaled, into the row's lanes, so each
/// row's sixteen lanes gather the whole super-block (chunks `2p` in even lanes, `2p + 1` in
/// odd), and two rows' adjacent lanes are summed into the tile's layout at the end. The
/// same exact integers as the pairs' `vpdpwssd` (at most 16 · 255 · 128 a lane), without its
/// `vpackssdw`, `vpdpwssd` and scale vectors: 22 integer instructions an activation row
/// where [`quad_sumi`] takes 32 (Q3_K: 26 where 40).
///
/// Q3_K's scaled values are signed and reach 128 (-4 · -32), one past a signed byte, so the
/// rows hold minus each (`m`, down to -128) and the activation bytes `a` are met as the
/// unsigned `127 - a` (`a ^ 0x7F`): the lane gathers `127 Σ m - Σ a m`, and starts at
/// `-127 Σ m` ([`Pairs::start`]), which leaves `Σ a · (-m)`, ggml's sum.
///
/// AMD EPYC (Zen 5), alternating with [`quad_sumi`]: one thread, `matvec -- <format> 2304 1
/// 256`, Q2_K 187–194 -> 231–243 G multiply-adds per second, Q3_K 187–195 -> 221–227;
/// random 1.1B, 1000-token prompts, Q2_K (52 % of its weights Q2_K, 33 % Q3_K) 268 -> 298–304
/// tok/s, Q3_K_M (54 % Q3_K) 257–259 -> 288–289.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
fn scaled_sumi<const F: u8>(
    pairs: &Pairs,
    acts: &[Q8KRow],
    i: usize,
    states: &mut [QuadAcc],
    then: impl Fn(&Q8KRow, &mut QuadAcc, [__m512i; 2]),
) {
    let w = &pairs.w;
    let flip = _mm512_set1_epi8(0x7F);
    for (act, state) in acts.iter().zip(states) {
        let y = &act.paired[i * QK_K..(i + 1) * QK_K];
        let mut rows = pairs.start;
        for p in 0..4 {
            // SAFETY: `y` holds 256 bytes, so 64 from `64 p`; the load is unaligned.
            let y = unsafe { _mm512_loadu_si512(y[64 * p..].as_ptr().cast()) };
            let flipped = _mm512_xor_si512(y, flip);
            for (r, row) in rows.iter_mut().enumerate() {
                let w = w[r / 2][2 * p + r % 2];
                // The first factor is the unsigned one: Q2_K's values, Q3_K's flipped bytes.
                *row = if F == Q3 {
                    _mm512_dpbusd_epi32(*row, flipped, w)
                } else {
                    _mm512_dpbusd_epi32(*row, w, y)
                };
            }
        }
        let lanes = std::array::from_fn(|h| {
            // Lanes 4g..4g + 4 of row 2h, then of row 2h + 1, hold ggml lanes 2g and 2g + 1,
            // each as its even and odd chunks': summed pairwise into lanes 4g + j.
            let (a, b) = (
                _mm512_castsi512_ps(rows[2 * h]),
                _mm512_castsi512_ps(rows[2 * h + 1]),
            );
            let even = _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(a, b));
            let odd = _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(a, b));
            _mm512_add_epi32(even, odd)
        });
        then(act, state, lanes);
    }
}

/// The tile: for each super-block, the four rows unpacked, then each activation row of a
/// group against all four ([`quad_sumi`]) and its float step beside the next row's
/// products.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
fn tile_body<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
    let bytes = format(F).block_bytes();
    let nb = rows[0].len() / bytes;
    let zi = _mm512_setzero_si512();
    let mut pairs = Pairs {
        w: [[zi; 8]; 2],
        s: [[zi; 4]; 2],
        scales: [_mm256_setzero_si256(); 4],
        start: [zi; 4],
        k: [no_scalars(); 4],
        f: Floats::zero(),
    };
    // SAFETY: `BLOCK_SUMS` is sixteen u32 (64 bytes); the load is unaligned.
    let sums = unsafe { _mm512_loadu_si512(BLOCK_SUMS.as_ptr().cast()) };
    // Set at each group's first super-block ([`QuadAcc::unset`]).
    let mut states = [QuadAcc::unset(); GROUP];
    for (group, out) in acts.chunks(GROUP).zip(out.chunks_mut(GROUP)) {
        for i in 0..nb {
            for (r, w) in rows.iter().enumerate() {
                unpack::<F>(&w[i * bytes..(i + 1) * bytes], r, &mut pairs);
            }
            constants::<F>(&mut pairs);
            quad_sumi::<F>(&pairs, group, i, &mut states, |act, row, lanes| {
                if i == 0 {
                    // The group's first super-block: nothing accumulated yet.
                    *row = QuadAcc::zero();
                }
                let spread = |b| _mm512_permutexvar_epi32(sums, _mm512_castsi256_si512(b));
                quad_float_step::<F>(&pairs.f, act, i, lanes, row, spread);
            });
        }
        finish_quads::<F>(states.iter(), out, lane_of);
    }
}

/// The tile for `format` on a CPU with AVX-512 VNNI (`cpu`); its activation rows must carry
/// [`Q8KRow::paired`].
pub(crate) fn tile(cpu: crate::cpu::Avx512Vnni, format: KFormat) -> super::tile::Tile {
    let _ = cpu;
    match format {
        KFormat::Q2K => run::<Q2>,
        KFormat::Q3K => run::<Q3>,
        KFormat::Q4K => run::<Q4>,
        KFormat::Q5K => run::<Q5>,
        KFormat::Q6K => run::<Q6>,
    }
}

fn run<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
    debug_assert!(
        acts.iter().all(|a| a.paired.len() == a.qs.len()),
        "the AVX-512 VNNI K-quant tile reads activation rows in pair order"
    );
    // SAFETY: handed out only by `tile`, which saw the AVX-512 VNNI token (AVX-512 F, BW, VL
    // and VNNI). Each super-block's pair-order bytes are sliced, bounds-checked, before the
    // loads within them (a row without them panics there).
    unsafe { tile_body::<F>(rows, acts, out) }
}
