//! K-quant products of four weight rows with many activation rows at once. Each weight
//! super-block is unpacked once — its values to bytes, its scales to the i16 lanes ggml's
//! dot products multiply by — and then met by every activation row, where the pairwise
//! dot product ([`super::avx2`]) unpacks it again for each.
//!
//! Every (weight row, activation row) pair still gets ggml's result bit for bit: its eight
//! i32 lanes are exact sums of exact products (no byte pair product saturates in any
//! K-quant), equal whatever order their terms are added in, and its float accumulation runs
//! super-block by super-block with ggml's fused multiply-adds on those lanes. The AVX-512
//! variant multiplies two 32-value chunks per instruction and adds the halves before the
//! float step. Q3_K's signed values are met as `value + 4`, and `4 * y` taken off per byte
//! pair: the same i16 ggml forms from its two products. Where the CPU has AVX-512 VNNI,
//! every format takes [`super::vnni`]'s tile instead, which shares this one's float step
//! ([`quad_float_step`]) and reduction ([`finish_quads`]).

use std::arch::x86_64::*;

use super::avx2::{
    broadcast_i16, bsums, hsum, k4_scales_mins, k4_values, load32, load_q8, q2k_scales_mins,
    q2k_values, q3k_scales, q3k_values, q6k_values, scale_halves, split_i16, split_i8, sums32,
};
use super::{f16_at, format, scales_in_values, KFormat, KTile, Q8KRow, Q2, Q3, Q4, Q5, Q6, QK_K};
use crate::cpu::Features;
use crate::quant::avx2::on_tier;
use crate::quant::portable::hsum8;
use crate::quant::PairTile;

/// A tile: four weight rows (whole rows of one K-quant format) times every activation row,
/// `out[a][r]` the product of activation row `a` with weight row `r`.
pub(super) type Tile = PairTile<Q8KRow>;

/// The tile for `format` on the widest tier `features` has, if it has AVX2, with its
/// quantizer: the AVX-512 VNNI tile reads its activation rows' bytes in pair order.
pub(crate) fn tile(features: Features, format: KFormat) -> Option<KTile> {
    let avx2 = features.avx2()?;
    if let Some(run) = features
        .avx512_vnni()
        .map(|vnni| super::vnni::tile(vnni, format))
    {
        let quantize = super::quantize_row_q8k_paired;
        return Some(KTile { run, quantize });
    }
    let run = match (features.avx512(), features.avx_vnni()) {
        (Some(cpu), _) => tile_avx512(cpu, format),
        (None, Some(vnni)) => tile_avx_vnni(vnni, format),
        (None, None) => tile_avx2(avx2, format),
    };
    let quantize = super::quantize_row_q8k;
    Some(KTile { run, quantize })
}

/// The AVX-512 tile without VNNI, the paired tile's fallback (the kernel tests check it on
/// AVX-512 VNNI CPUs too).
pub(crate) fn tile_avx512(cpu: crate::cpu::Avx512, format: KFormat) -> Tile {
    let _ = cpu;
    match format {
        KFormat::Q2K => run_avx512::<Q2>,
        KFormat::Q3K => run_avx512::<Q3>,
        KFormat::Q4K => run_avx512::<Q4>,
        KFormat::Q5K => run_avx512::<Q5>,
        KFormat::Q6K => run_avx512::<Q6>,
    }
}

/// The tile on AVX2 alone (the kernel tests check it on AVX-512 CPUs too).
pub(crate) fn tile_avx2(cpu: crate::cpu::Avx2, format: KFormat) -> Tile {
    let _ = cpu;
    avx2_tile::<false>(format)
}

/// The AVX2 tile compiled for AVX-VNNI, whose `vpdpwssd` adds each chunk's scaled pair
/// sums into the lanes in the instruction that multiplies them (the same exact integers).
pub(crate) fn tile_avx_vnni(cpu: crate::cpu::AvxVnni, format: KFormat) -> Tile {
    let _ = cpu;
    avx2_tile::<true>(format)
}

/// The AVX2 tile for `format`, with AVX-VNNI where `VNNI`: for [`tile_avx2`] and
/// [`tile_avx_vnni`] only, whose tokens prove the tier.
fn avx2_tile<const VNNI: bool>(format: KFormat) -> Tile {
    match format {
        KFormat::Q2K => run_avx2::<Q2, VNNI>,
        KFormat::Q3K => run_avx2::<Q3, VNNI>,
        KFormat::Q4K => run_avx2::<Q4, VNNI>,
        KFormat::Q5K => run_avx2::<Q5, VNNI>,
        KFormat::Q6K => run_avx2::<Q6, VNNI>,
    }
}

/// Activation rows whose accumulators a tile holds at once (on the stack); a weight
/// super-block is unpacked once per group. What a super-block step touches — the group's
/// activation super-blocks (256 bytes each), integer lanes and accumulators — fits the
/// 32 KiB L1 cache at 32 rows, not at 64. Zen 4, 2 threads, 64 -> 32: 8192 x 2048 Q4_K
/// against 128 rows 0.55 -> 0.61 GB/s (AVX-512 and AVX2 tiers alike), Q6_K 0.72 -> 0.81;
/// random 1.1B Q4_K_M prompt processing, 512 tokens 110-111 -> 124-126 tok/s.
pub(super) const GROUP: usize = 32;

fn run_avx2<const F: u8, const VNNI: bool>(
    rows: [&[u8]; 4],
    acts: &[Q8KRow],
    out: &mut [[f32; 4]],
) {
    // SAFETY: handed out only through `tile_avx2` (which saw the AVX2 token) and, with
    // `VNNI`, `tile_avx_vnni` (which saw the AVX-VNNI token).
    unsafe { tile_avx2_body::<F, VNNI>(rows, acts, out) }
}

fn run_avx512<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
    // SAFETY: handed out only by `tile`, which saw the AVX-512 (F, BW, VL) token.
    unsafe { tile_avx512_body::<F>(rows, acts, out) }
}

/// A weight row's super-block, unpacked, beyond its values and their scales.
#[derive(Clone, Copy)]
pub(super) struct Scalars {
    /// Q4_K and Q5_K: the eight minimums (low half); Q2_K: the sixteen minimums; Q6_K: the
    /// sixteen scales.
    pub(super) extra: __m256i,
    pub(super) d: f32,
    pub(super) dmin: f32,
}

/// One weight row's super-block, unpacked (the AVX2 tile).
#[derive(Clone, Copy)]
struct Unpacked {
    /// Chunk `c`: the 32 values, as unsigned bytes, meeting activation bytes `32c..32c + 32`
    /// (on AVX-VNNI, Q2_K's and Q3_K's already scaled: [`prescale`]).
    q: [__m256i; 8],
    /// Chunk `c`: the i16 scale of each of its sixteen byte pairs.
    s: [__m256i; 8],
    /// Where the lanes start ([`prescale`]'s Q3_K; zero otherwise).
    start: __m256i,
    k: Scalars,
}

/// One activation row's super-block, beyond its bytes.
struct Act {
    bsums: __m256i,
    /// Q4_K and Q5_K: the sums of each 32 bytes (pairs of `bsums` added).
    q8s: __m128i,
    d: f32,
}

/// One pair's float accumulators (the AVX2 tile).
#[derive(Clone, Copy)]
struct PairAcc {
    acc: __m256,
    /// Q4_K: the four minimum lanes.
    m: __m128,
    /// Q5_K: the minimums' scalar sum.
    s: f32,
}

/// One activation row's float accumulators against four weight rows (the AVX-512 tile):
/// rows 0 and 1's eight lanes in `acc[0]`, rows 2 and 3's in `acc[1]`; in `m`, row `r`'s
/// Q4_K minimum lanes (or, in lane `4r`, its Q5_K minimums' sum) at lanes `4r..4r + 4`.
#[derive(Clone, Copy)]
pub(super) struct QuadAcc {
    acc: [__m512; 2],
    m: __m512,
}

impl QuadAcc {
    /// Every lane NaN: the state of an activation row that no super-block has set yet. A
    /// tile sets each row's state at the group's first super-block rather than zeroing the
    /// group's states beforehand, so this is never read — and were it read, the row's
    /// outputs would be NaN. (A zeroed array of states compiles to a call to `memset`,
    /// which took 4–5 % of a Q4_K_M prompt's samples, Zen 5.)
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn unset() -> Self {
        let nan = _mm512_set1_ps(f32::NAN);
        QuadAcc {
            acc: [nan; 2],
            m: nan,
        }
    }

    /// Nothing accumulated yet.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn zero() -> Self {
        let zf = _mm512_setzero_ps();
        QuadAcc {
            acc: [zf; 2],
            m: zf,
        }
    }
}

/// One activation row's state in the AVX-512 tile: its float accumulators, and its integer
/// lanes against weight rows 0 and 1 of the super-block at hand, kept until rows 2 and 3's
/// are summed.
#[derive(Clone, Copy)]
struct QuadRow {
    acc: QuadAcc,
    lanes01: __m512i,
}

/// Four weight rows' super-block, unpacked, with what the AVX-512 float step multiplies by.
/// Aligned to a cache line, so no 512-bit load of its values or scales straddles two.
#[repr(C, align(64))]
struct Quad {
    /// Rows `2h` and `2h + 1`'s chunk `c` side by side at `q[h][2c..2c + 2]`: one 512-bit
    /// load meets the activation chunk twice over.
    q: [[__m256i; 16]; 2],
    /// Their scales, laid out as `q`.
    s: [[__m256i; 16]; 2],
    k: [Scalars; 4],
    f: Floats,
}

/// What the AVX-512 float step multiplies four weight rows' super-block by, for integer
/// lanes laid out as [`Quad`]'s (rows 0 and 1's eight lanes, then rows 2 and 3's) or as
/// [`super::vnni`]'s pairs.
#[derive(Clone, Copy)]
pub(super) struct Floats {
    /// Each lane's row's `d`: rows 0 and 1's lanes, then rows 2 and 3's.
    pub(super) d: [__m512; 2],
    /// The same for `dmin` (Q2_K).
    pub(super) dmin: [__m512; 2],
    /// Row `r`'s `dmin` at lanes `4r..4r + 4` (Q4_K, Q5_K).
    pub(super) dmin4: __m512,
    /// Row `r`'s eight i16 minimums in 128-bit lane `r` (Q4_K, Q5_K).
    pub(super) mins4: __m512i,
    /// Each lane's row's pair of sixteen-value scales, as i16, for that lane's block sums
    /// (Q6_K), or its minimums (Q2_K).
    pub(super) extra2: [__m512i; 2],
}

impl Floats {
    /// All zero, for a tile to fill.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn zero() -> Self {
        let (zf, zi) = (_mm512_setzero_ps(), _mm512_setzero_si512());
        Floats {
            d: [zf; 2],
            dmin: [zf; 2],
            dmin4: zf,
            mins4: zi,
            extra2: [zi; 2],
        }
    }

    /// Fills the Q4_K and Q5_K minimums' constants from four rows' scalars.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) fn set_mins4(&mut self, k: &[Scalars; 4]) {
        let [a, b, c, d] = [0, 1, 2, 3].map(|r| k[r].dmin);
        self.dmin4 = _mm512_set_ps(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a);
        let lane = |r: usize| _mm256_castsi256_si128(k[r].extra);
        let lo = _mm256_set_m128i(lane(1), lane(0));
        let hi = _mm256_set_m128i(lane(3), lane(2));
        self.mins4 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    }
}

#[inline]
#[target_feature(enable = "avx2")]
/// Unpacks super-block `b`: chunk `c`'s values to `q[c * stride + offset]` and its scales
/// to `s[c * stride + offset]`, the rest to `u`.
fn unpack<const F: u8>(
    b: &[u8],
    q: &mut [__m256i],
    s: &mut [__m256i],
    (stride, offset): (usize, usize),
    u: &mut Scalars,
) {
    let at = |c: usize| c * stride + offset;
    match F {
        Q4 | Q5 => {
            let (scales, mins) = k4_scales_mins(b);
            u.extra = _mm256_zextsi128_si256(mins);
            let hbits = (F == Q5).then(|| load32(b, 16));
            for j in 0..QK_K / 64 {
                let [lo, hi] = k4_values(b, hbits, j);
                q[at(2 * j)] = lo;
                q[at(2 * j + 1)] = hi;
                s[at(2 * j)] = broadcast_i16(scales, 2 * j as i32);
                s[at(2 * j + 1)] = broadcast_i16(scales, 2 * j as i32 + 1);
            }
            u.d = f16_at(b, 0);
            u.dmin = f16_at(b, 2);
        }
        Q6 => {
            // SAFETY: the super-block's sixteen scale bytes start at 192 of its 210.
            let scales = unsafe { _mm_loadu_si128(b[192..208].as_ptr().cast()) };
            u.extra = _mm256_cvtepi8_epi16(scales);
            for j in 0..QK_K / 128 {
                for (k, v) in q6k_values(b, j).into_iter().enumerate() {
                    q[at(4 * j + k)] = v;
                }
                for k in 0..4 {
                    let c = 4 * j + k;
                    s[at(c)] = _mm256_cvtepi8_epi16(split_i8(scales, c as i32));
                }
            }
            u.d = f16_at(b, 208);
        }
        Q2 => {
            let (scales, mins) = q2k_scales_mins(b);
            u.extra = mins;
            let halves = scale_halves(scales);
            for (j, scales) in halves.iter().enumerate() {
                for (k, v) in q2k_values(b, j).into_iter().enumerate() {
                    q[at(4 * j + k)] = v;
                    s[at(4 * j + k)] = split_i16(*scales, k as i32);
                }
            }
            u.d = f16_at(b, 80);
            u.dmin = f16_at(b, 82);
        }
        _ => {
            let halves = scale_halves(q3k_scales(b));
            let hbits = load32(b, 0);
            for (j, scales) in halves.iter().enumerate() {
                for (k, v) in q3k_values(b, hbits, j).into_iter().enumerate() {
                    q[at(4 * j + k)] = v;
                    s[at(4 * j + k)] = split_i16(*scales, k as i32);
                }
            }
            u.d = f16_at(b, 108);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn act<const F: u8>(a: &Q8KRow, i: usize) -> Act {
    let bsums = bsums(a, i);
    let q8s = if F == Q4 || F == Q5 {
        sums32(a, i)
    } else {
        _mm_setzero_si128()
    };
    Act {
        bsums,
        q8s,
        d: a.d[i],
    }
}

/// Q2_K's and Q3_K's values times their scales, for the AVX-VNNI tile's `vpdpbusd` alone, as
/// [`super::vnni`]'s tile takes them: Q2_K's times theirs (at most 3 · 15, so a word's
/// product carries nothing between its bytes), Q3_K's times minus theirs (-128..=124; each
/// byte's product the low byte of its word's), met by the activation bytes flipped to
/// `127 - a`, with each lane's start at -127 times its values' sum (Q2_K's stays zero).
#[inline]
#[target_feature(enable = "avx2")]
fn prescale<const F: u8>(u: &mut Unpacked) {
    let high_bytes = _mm256_set1_epi16(0xFF00u16 as i16);
    let mut sum = _mm256_setzero_si256();
    for (q, s) in u.q.iter_mut().zip(&u.s) {
        if F == Q2 {
            *q = _mm256_mullo_epi16(*q, *s);
        } else {
            let minus = _mm256_sub_epi8(_mm256_set1_epi8(4), *q);
            let low = _mm256_mullo_epi16(minus, *s);
            let high = _mm256_mullo_epi16(_mm256_and_si256(minus, high_bytes), *s);
            *q = _mm256_blendv_epi8(low, high, high_bytes);
            // 127 times each pair (at most 127 · 256 in size), then each lane's two pairs.
            let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(127), *q);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
    }
    if F == Q3 {
        u.start = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
    }
}

/// The integer lanes of weight row `u` against super-block `i` of each activation row,
/// into `sumis[a]`: four chunks at a time, whose values and scales (eight of the sixteen
/// registers) are loaded once for every activation row, which then costs one load per two
/// multiplies where a pair's chunks cost three (its values, its scales and the activation
/// bytes). AMD EPYC (Zen 5), the AVX2 build capped to AVX2, random 1.1B Q4_K_M, against a
/// pair's eight chunks at a time: 512-token prompts 116–122 -> 135–141 tok/s, a
/// 16-request decode step's weight products 151–157 -> 119–121 ms.
///
/// With `VNNI`, one `vpdpwssd` multiplies each chunk's pair sums by their scales and adds
/// them to the lanes, where `vpmaddwd` and `vpaddd` take two instructions: the same exact
/// integers; `on_tier` compiles it with AVX-VNNI. LLVM keeps one `vpdpwssd` of
/// each four and splits the rest back into the two (its tuning, for the x86-64-v3 release
/// build and a Zen 3 build alike); capped to AVX-VNNI on a Zen 5, random 1.1B Q4_K_M,
/// 512-token prompts measured 1–8 % faster in six alternating pairs (136–142 -> 143–150
/// tok/s), within the VM's drift. Q2_K's and Q3_K's values come already scaled there
/// ([`prescale`]), so one `vpdpbusd` a chunk adds their lanes (Q3_K's with the activation
/// bytes flipped), where `maddubs` and `vpdpwssd` took two (Q3_K four). Capped to AVX-VNNI
/// on the Zen 5, alternating: `matvec -- q3_k 2304 1 256` 64–65 -> 82 G multiply-adds/s
/// (Q2_K's even, 79–81: its float steps hold it), random 1.1B Q3_K_M 512-token prompts
/// 125–130 -> 140–145 tok/s.
#[inline]
#[target_feature(enable = "avx2")]
fn sumis_avx2<const F: u8, const VNNI: bool>(
    u: &Unpacked,
    acts: &[Q8KRow],
    i: usize,
    sumis: &mut [__m256i],
) {
    let (four, flip) = (_mm256_set1_epi8(4), _mm256_set1_epi8(0x7F));
    let scaled = VNNI && scales_in_values(F);
    for half in 0..2 {
        let q: [__m256i; 4] = std::array::from_fn(|k| u.q[4 * half + k]);
        let s: [__m256i; 4] = std::array::from_fn(|k| u.s[4 * half + k]);
        for (a, sumi) in acts.iter().zip(sumis.iter_mut()) {
            let bytes = &a.qs[i * QK_K..(i + 1) * QK_K];
            let mut acc = if half == 0 { u.start } else { *sumi };
            for k in 0..4 {
                let y = load_q8(bytes, 32 * (4 * half + k));
                // The `unsafe` blocks run only with `VNNI`, inlined into `on_tier`'s function
                // with AVX-VNNI enabled (`tile_avx2_body` calls it so).
                acc = if scaled && F == Q3 {
                    // The values already scaled ([`prescale`]); the unsigned factor first.
                    // SAFETY: `scaled` implies `VNNI` (above).
                    unsafe { _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(y, flip), q[k]) }
                } else if scaled {
                    // SAFETY: as above.
                    unsafe { _mm256_dpbusd_avx_epi32(acc, q[k], y) }
                } else {
                    let mut p16 = _mm256_maddubs_epi16(q[k], y);
                    if F == Q3 {
                        p16 = _mm256_sub_epi16(p16, _mm256_maddubs_epi16(four, y));
                    }
                    if VNNI {
                        // SAFETY: as above.
                        unsafe { _mm256_dpwssd_avx_epi32(acc, s[k], p16) }
                    } else {
                        _mm256_add_epi32(acc, _mm256_madd_epi16(s[k], p16))
                    }
                };
            }
            *sumi = acc;
        }
    }
}

/// The pair's float step for one super-block, as ggml's dot product takes it.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn accumulate<const F: u8>(u: &Unpacked, a: &Act, mut sumi: __m256i, p: &mut PairAcc) {
    let (d, dmin) = (a.d * u.k.d, -a.d * u.k.dmin);
    match F {
        Q4 => {
            let prod = _mm_madd_epi16(_mm256_castsi256_si128(u.k.extra), a.q8s);
            p.m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), p.m);
        }
        Q5 => {
            let prod = _mm_madd_epi16(_mm256_castsi256_si128(u.k.extra), a.q8s);
            let zero = _mm_setzero_si128();
            let hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, zero), zero);
            p.s = dmin.mul_add(_mm_cvtsi128_si32(hs) as f32, p.s);
        }
        Q6 => {
            let sub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(a.bsums, u.k.extra));
            sumi = _mm256_sub_epi32(sumi, sub);
        }
        Q2 => {
            let prod = _mm256_madd_epi16(u.k.extra, a.bsums);
            p.acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), p.acc);
        }
        _ => {}
    }
    p.acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), p.acc);
}

/// The pair's result, reduced as ggml reduces it.
#[inline]
#[target_feature(enable = "avx2")]
fn finish<const F: u8>(p: &PairAcc) -> f32 {
    match F {
        Q4 => {
            let m = _mm_add_ps(p.m, _mm_movehl_ps(p.m, p.m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            hsum(p.acc) + _mm_cvtss_f32(m)
        }
        Q5 => hsum(p.acc) + p.s,
        _ => hsum(p.acc),
    }
}

/// Nothing unpacked yet, for the tiles to unpack into.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn no_scalars() -> Scalars {
    Scalars {
        extra: _mm256_setzero_si256(),
        d: 0.0,
        dmin: 0.0,
    }
}

/// The AVX2 tile: each weight row's integer lanes against every activation row of a group
/// ([`sumis_avx2`]), then each pair's float step alone.
///
/// # Safety
/// The CPU must have the AVX2 tier (AVX2, FMA, F16C) and, with `VNNI`, AVX-VNNI.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_body<const F: u8, const VNNI: bool>(
    rows: [&[u8]; 4],
    acts: &[Q8KRow],
    out: &mut [[f32; 4]],
) {
    let bytes = format(F).block_bytes();
    let nb = rows[0].len() / bytes;
    let zero = PairAcc {
        acc: _mm256_setzero_ps(),
        m: _mm_setzero_ps(),
        s: 0.0,
    };
    let zi = _mm256_setzero_si256();
    let mut u = [Unpacked {
        q: [zi; 8],
        s: [zi; 8],
        start: zi,
        k: no_scalars(),
    }; 4];
    let mut sumis = [[zi; GROUP]; 4];
    for (group, out) in acts.chunks(GROUP).zip(out.chunks_mut(GROUP)) {
        let mut accs = [[zero; 4]; GROUP];
        for i in 0..nb {
            for ((u, w), sumis) in u.iter_mut().zip(rows).zip(sumis.iter_mut()) {
                let b = &w[i * bytes..(i + 1) * bytes];
                unpack::<F>(b, &mut u.q, &mut u.s, (1, 0), &mut u.k);
                if VNNI && scales_in_values(F) {
                    prescale::<F>(u);
                }
                // SAFETY: the caller guarantees the AVX2 tier (AVX2, FMA, F16C) and, with
                // `VNNI`, AVX-VNNI.
                unsafe { on_tier::<VNNI, _>(|| sumis_avx2::<F, VNNI>(u, group, i, sumis)) }
            }
            for (at, (a, accs)) in group.iter().zip(accs.iter_mut()).enumerate() {
                let a = act::<F>(a, i);
                for ((u, p), sumis) in u.iter().zip(accs.iter_mut()).zip(&sumis) {
                    accumulate::<F>(u, &a, sumis[at], p);
                }
            }
        }
        for (o, accs) in out.iter_mut().zip(&accs) {
            for (o, p) in o.iter_mut().zip(accs) {
                *o = finish::<F>(p);
            }
        }
    }
}

/// Fills `quad`'s float constants from its four rows' scalars.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn quad_constants<const F: u8>(quad: &mut Quad) {
    let k = &quad.k;
    let eight = |a: f32, b: f32| {
        let (a, b) = (_mm512_set1_ps(a), _mm256_set1_ps(b));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(a),
            _mm256_castps_pd(b),
        ))
    };
    let f = &mut quad.f;
    f.d = [eight(k[0].d, k[1].d), eight(k[2].d, k[3].d)];
    if F == Q2 {
        f.dmin = [eight(k[0].dmin, k[1].dmin), eight(k[2].dmin, k[3].dmin)];
    }
    if F == Q2 || F == Q6 {
        let two = |a: __m256i, b: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
        f.extra2 = [two(k[0].extra, k[1].extra), two(k[2].extra, k[3].extra)];
    }
    if F == Q4 || F == Q5 {
        f.set_mins4(k);
    }
}

/// The integer lanes of rows `2h` and `2h + 1` of the quad against super-block `i` of each
/// activation row, handed to `then(act, state, lanes)` with the row's state. The two rows'
/// values and scales (sixteen registers) are loaded once and stay in registers for every
/// activation row, which then costs one broadcast load per two multiplies: with an operand
/// from memory each, the multiplies would run at the rate of the loads.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn quad_sumi<const F: u8>(
    quad: &Quad,
    h: usize,
    acts: &[Q8KRow],
    i: usize,
    states: &mut [QuadRow],
    then: impl Fn(&Q8KRow, &mut QuadRow, __m512i),
) {
    let four = _mm512_set1_epi8(4);
    // SAFETY: entries 2c and 2c + 1 of `q[h]` and `s[h]` are 64 contiguous bytes; the loads
    // are unaligned.
    let load =
        |v: &[__m256i; 16], c: usize| unsafe { _mm512_loadu_si512(v[2 * c..].as_ptr().cast()) };
    let q: [__m512i; 8] = std::array::from_fn(|c| load(&quad.q[h], c));
    let s: [__m512i; 8] = std::array::from_fn(|c| load(&quad.s[h], c));
    for (act, state) in acts.iter().zip(states) {
        let qs = &act.qs[i * QK_K..(i + 1) * QK_K];
        let mut acc = _mm512_setzero_si512();
        for c in 0..8 {
            let y = _mm512_broadcast_i64x4(load_q8(qs, 32 * c));
            let mut p16 = _mm512_maddubs_epi16(q[c], y);
            if F == Q3 {
                p16 = _mm512_sub_epi16(p16, _mm512_maddubs_epi16(four, y));
            }
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(s[c], p16));
        }
        then(act, state, acc);
    }
}

/// Four pairs' float step for super-block `i` of activation row `a`, as ggml's dot
/// product takes it: `sumi` holds rows 0 and 1's lanes, then rows 2 and 3's, laid out as
/// `f`'s constants are; `bsums2` lays the row's sixteen block sums out likewise, as pairs of
/// i16 beside each lane's pair of scales in `f.extra2`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub(super) fn quad_float_step<const F: u8>(
    f: &Floats,
    a: &Q8KRow,
    i: usize,
    mut sumi: [__m512i; 2],
    p: &mut QuadAcc,
    bsums2: impl Fn(__m256i) -> __m512i,
) {
    let ad = a.d[i];
    if F == Q6 {
        let b2 = bsums2(bsums(a, i));
        for (s, e) in sumi.iter_mut().zip(&f.extra2) {
            let sub = _mm512_slli_epi32::<5>(_mm512_madd_epi16(b2, *e));
            *s = _mm512_sub_epi32(*s, sub);
        }
    }
    if F == Q2 {
        let b2 = bsums2(bsums(a, i));
        for h in 0..2 {
            let dmin = _mm512_mul_ps(_mm512_set1_ps(-ad), f.dmin[h]);
            let prod = _mm512_cvtepi32_ps(_mm512_madd_epi16(f.extra2[h], b2));
            p.acc[h] = _mm512_fmadd_ps(dmin, prod, p.acc[h]);
        }
    }
    for ((acc, sumi), d) in p.acc.iter_mut().zip(sumi).zip(f.d) {
        let d = _mm512_mul_ps(_mm512_set1_ps(ad), d);
        *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), *acc);
    }
    if F == Q4 || F == Q5 {
        let mut prod = _mm512_madd_epi16(f.mins4, _mm512_broadcast_i32x4(sums32(a, i)));
        if F == Q5 {
            // Each row's four lanes summed into its first (exact integers).
            let swap = _mm512_shuffle_epi32::<0b01_00_11_10>(prod);
            prod = _mm512_add_epi32(prod, swap);
            let swap = _mm512_shuffle_epi32::<0b10_11_00_01>(prod);
            prod = _mm512_add_epi32(prod, swap);
        }
        let dmin = _mm512_mul_ps(_mm512_set1_ps(-ad), f.dmin4);
        p.m = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(prod), p.m);
    }
}

/// The AVX-512 tile: two weight rows' chunk against the activation chunk (broadcast to both
/// halves) per integer instruction, so each half accumulates one pair's eight lanes, and
/// the four pairs' float steps two (or four) at a time.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
fn tile_avx512_body<const F: u8>(rows: [&[u8]; 4], acts: &[Q8KRow], out: &mut [[f32; 4]]) {
    let bytes = format(F).block_bytes();
    let nb = rows[0].len() / bytes;
    let z256 = _mm256_setzero_si256();
    let mut quad = Quad {
        q: [[z256; 16]; 2],
        s: [[z256; 16]; 2],
        k: [no_scalars(); 4],
        f: Floats::zero(),
    };
    // Set at each group's first super-block ([`QuadAcc::unset`]).
    let mut rows_state = [QuadRow {
        acc: QuadAcc::unset(),
        lanes01: _mm512_setzero_si512(),
    }; GROUP];
    for (group, out) in acts.chunks(GROUP).zip(out.chunks_mut(GROUP)) {
        for i in 0..nb {
            for (r, w) in rows.iter().enumerate() {
                let b = &w[i * bytes..(i + 1) * bytes];
                let (q, s) = (&mut quad.q[r / 2], &mut quad.s[r / 2]);
                unpack::<F>(b, q, s, (2, r % 2), &mut quad.k[r]);
            }
            quad_constants::<F>(&mut quad);
            // Rows 0 and 1's lanes kept for each activation row, then each row's float step
            // as soon as rows 2 and 3's are summed: in one loop with the next row's integer
            // products, which wait on their chain of eight multiply-adds, where a loop of
            // its own left the float steps 15–20 % of a prompt's time. Zen 5, random 1.1B
            // Q4_K_M, alternating: 512-token prompts 211–223 -> 213–235 tok/s (five of six
            // pairs ahead), 1024 tokens 207–213 -> 213–219, a 16-request decode step's
            // weight products 81–87 -> 76–84 ms.
            quad_sumi::<F>(&quad, 0, group, i, &mut rows_state, |_, row, lanes| {
                row.lanes01 = lanes
            });
            quad_sumi::<F>(&quad, 1, group, i, &mut rows_state, |act, row, lanes| {
                if i == 0 {
                    // The group's first super-block: nothing accumulated yet.
                    row.acc = QuadAcc::zero();
                }
                let broadcast = |b| _mm512_broadcast_i64x4(b);
                quad_float_step::<F>(
                    &quad.f,
                    act,
                    i,
                    [row.lanes01, lanes],
                    &mut row.acc,
                    broadcast,
                );
            });
        }
        let accs = rows_state.iter().map(|r| &r.acc);
        finish_quads::<F>(accs, out, |r, l| 8 * r + l);
    }
}

/// Each activation row's four results from its accumulators, reduced as ggml reduces a
/// pair's: `lane(r, l)` is where row `r`'s lane `l` (of ggml's eight) lies in `acc`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn finish_quads<'a, const F: u8>(
    accs: impl Iterator<Item = &'a QuadAcc>,
    out: &mut [[f32; 4]],
    lane: impl Fn(usize, usize) -> usize,
) {
    for (o, p) in out.iter_mut().zip(accs) {
        let mut acc = [0f32; 32];
        let mut m = [0f32; 16];
        // SAFETY: `acc` holds two vectors of sixteen f32 and `m` one; unaligned stores.
        unsafe {
            _mm512_storeu_ps(acc.as_mut_ptr(), p.acc[0]);
            _mm512_storeu_ps(acc[16..].as_mut_ptr(), p.acc[1]);
            _mm512_storeu_ps(m.as_mut_ptr(), p.m);
        }
        for (r, o) in o.iter_mut().enumerate() {
            let lanes: [f32; 8] = std::array::from_fn(|l| acc[lane(r, l)]);
            let m = &m[4 * r..4 * r + 4];
            *o = hsum8(lanes)
                + match F {
                    Q4 => (m[0] + m[2]) + (m[1] + m[3]),
                    Q5 => m[0],
                    _ => 0.0,
                };
        }
    }
}
