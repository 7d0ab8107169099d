//! Each tier of the quantized products against the portable arithmetic, and the
//! portable arithmetic against ggml's.

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
    let mat = QuantMatrix::from_gguf(BlockFormat::Q4_1.into(), rows, cols, &encode_q4_1(&w))
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

/// For each batch size `m`, `mat`'s product of `m` activation rows (a fixed pattern) gives
/// every row `want(row)` bit for bit.
fn assert_batches(
    mat: &QuantMatrix,
    sizes: &[usize],
    what: &str,
    want: impl Fn(&[f32]) -> Vec<f32>,
) {
    let (rows, cols) = (mat.rows(), mat.cols());
    for &m in sizes {
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 11) % 19) as f32 / 19.0 - 0.45)
            .collect();
        let out = mat.matmul(&x);
        for (i, row) in x.chunks_exact(cols).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let got = bits(&out[i * rows..(i + 1) * rows]);
            assert_eq!(got, bits(&want(row)), "{what}: batch of {m}, row {i}");
        }
    }
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
    let mat = QuantMatrix::from_gguf(BlockFormat::Q4_1.into(), rows, cols, &encode_q4_1(&w))
        .expect("sizes");
    // Batches on either side of WEIGHT_PARALLEL_MAX_ROWS.
    let sizes = [
        2,
        7,
        WEIGHT_PARALLEL_MAX_ROWS,
        WEIGHT_PARALLEL_MAX_ROWS + 1,
        70,
    ];
    assert_batches(&mat, &sizes, "Q4_1", |x| mat.matmul(x).to_vec());
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
fn the_largest_byte_products_are_exact_on_every_tier() {
    // Q8_0 weights of -128 and 127 against activations of ±127 whose signs make every product
    // as large as it gets: the byte pairs AVX2's `maddubs` adds in 16 bits reach 32 512, just
    // under its saturation, and every tier must give the exact sum.
    let mut w = Vec::new();
    for (i, byte) in [0x80u8, 0x7f].into_iter().enumerate() {
        w.extend(f16::from_f32(0.5 + i as f32).to_le_bytes());
        w.extend([byte; BLOCK]);
    }
    let x: Vec<f32> = (0..2 * BLOCK)
        .map(|i| if i < BLOCK { -1.0 } else { 1.0 })
        .collect();
    let a = quantize_row(&x, false);
    assert_eq!((a.q[0], a.q[BLOCK]), (-127, 127));
    let want = dot_kernel(cpu::detect().capped(1), BlockFormat::Q8_0)(&w, &a);
    // 32 · 128 · 127 · 0.5 / 127 + 32 · 127 · 127 · 1.5 / 127, but for the activation
    // scale's rounding to f16: no product was clipped.
    assert!((want / 8144.0 - 1.0).abs() < 1e-4, "portable dot {want}");
    let mut ran = Vec::new();
    for tiers in 1..=cpu::TIER_NAMES.len() {
        let features = cpu::detect().capped(tiers);
        let got = dot_kernel(features, BlockFormat::Q8_0)(&w, &a);
        assert_eq!(got.to_bits(), want.to_bits(), "{:?}", features.tiers());
        ran.extend(features.tiers().last().copied());
    }
    say_checked(
        "the largest byte products (under each FERRITE_CPU_TIER cap)",
        &ran,
    );
}

/// Says which tiers a test checked (`ran`: each tier it ran, as often as it ran it) beside
/// the tiers this CPU runs as `FERRITE_CPU_TIER` leaves them, so that a tier skipped for want
/// of the CPU shows in the test output rather than passing silently.
fn say_checked(what: &str, ran: &[&str]) {
    let mut checked: Vec<&str> = Vec::new();
    for &tier in ran {
        if !checked.contains(&tier) {
            checked.push(tier);
        }
    }
    tell!(
        "{what} checked on {}; this CPU's tiers: {}",
        checked.join(", "),
        cpu::detect().tiers().join(", ")
    );
}

/// A tier's dot product for each format.
type DotFor = fn(BlockFormat) -> Dot;

/// The portable dot product for each format: what every tier's kernels must give.
fn portable_dot(format: BlockFormat) -> Dot {
    match format {
        BlockFormat::Q4_1 => dot_q4_1,
        BlockFormat::Q4_0 => dot_q4_0,
        BlockFormat::Q8_0 => dot_q8_0,
    }
}

#[test]
fn every_kernel_matches_the_portable_code_bit_for_bit() {
    let nb = 6;
    // The tiles run on rows of 70 blocks too: a tile that goes wrong only after many blocks
    // (a register reused, a run of blocks miscounted) shows there.
    let long = 70;
    let bytes: Vec<u8> = (0..64 * long).map(|i| (i * 131 % 251) as u8).collect();
    // Scales must be finite f16 values: write them explicitly.
    let block = |fmt: BlockFormat, nb: usize| {
        let mut out = Vec::new();
        for (i, chunk) in bytes.chunks(fmt.block_bytes()).take(nb).enumerate() {
            let mut b = chunk.to_vec();
            b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 0.003).to_le_bytes());
            if fmt == BlockFormat::Q4_1 {
                b[2..4].copy_from_slice(&f16::from_f32(-0.05 * i as f32).to_le_bytes());
            }
            out.extend(b);
        }
        out
    };
    let x: Vec<f32> = (0..BLOCK * long)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
        .collect();
    let bits = |v: f32| v.to_bits();
    let features = cpu::detect();
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    let mut dots: Vec<(&str, DotFor)> = vec![("portable", portable_dot)];
    #[cfg(target_arch = "x86_64")]
    {
        if features.avx2().is_some() {
            dots.push(("avx2", |fmt| {
                avx2::dot(cpu::detect().avx2().expect("avx2"), fmt)
            }));
        }
        if features.avx_vnni().is_some() {
            dots.push(("avx-vnni", |fmt| {
                avx2::dot(cpu::detect().avx_vnni().expect("avx-vnni"), fmt)
            }));
        }
        if features.avx512_vnni().is_some() {
            dots.push(("avx512-vnni", |fmt| {
                avx512::dot(
                    cpu::detect().avx512_vnni().expect("vnni"),
                    Batched::Block(fmt),
                )
            }));
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if features.neon().is_some() {
            dots.push(("neon", |fmt| {
                neon::dot(cpu::detect().neon().expect("neon"), Batched::Block(fmt))
            }));
        }
        if features.neon_dotprod().is_some() {
            dots.push(("neon-dotprod", |fmt| {
                let cpu = cpu::detect().neon_dotprod().expect("dotprod");
                neon::dot(cpu, Batched::Block(fmt))
            }));
        }
    }
    let names: Vec<&str> = dots.iter().map(|(name, _)| *name).collect();
    say_checked("32-value dot products", &names);
    for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
        // An odd count of blocks too: the AVX-512 dot takes blocks two at a time.
        for n in [1, 5, nb] {
            let w = block(fmt, n);
            let a = quantize_row(&x[..n * BLOCK], fmt == BlockFormat::Q4_1);
            let want = bits(portable_dot(fmt)(&w, &a));
            for (name, dot) in &dots {
                assert_eq!(
                    bits(dot(fmt)(&w, &a)),
                    want,
                    "{fmt:?} {name} dot of {n} blocks"
                );
            }
            assert_eq!(bits(dot_kernel(features, fmt)(&w, &a)), want, "{fmt:?} dot");
        }
        for blocks in [nb, long] {
            tiles_match_the_portable_dot(fmt, &block(fmt, blocks), &x[..blocks * BLOCK]);
        }
    }
}

/// Every 32-value tile this CPU has, on four different weight rows made from `w` (`fmt`
/// blocks) against six different activation rows made from `x`, gives each pair's portable
/// dot product, bit for bit.
fn tiles_match_the_portable_dot(fmt: BlockFormat, w: &[u8], x: &[f32]) {
    let features = cpu::detect();
    let blocks = x.len() / BLOCK;
    // Four different rows, so a mixed-up row order shows.
    let rows: Vec<Vec<u8>> = (0..4)
        .map(|r| {
            let mut v = w.to_vec();
            v.rotate_left(r * fmt.block_bytes());
            v
        })
        .collect();
    let quad = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
    // Six different activation rows too, so a tile that pairs a weight row with the
    // wrong activation row (or scale) shows; each pair's portable dot is what the tiles
    // must give.
    let acts: Vec<QuantizedRow> = (0..6)
        .map(|i| {
            let mut v = x.to_vec();
            v.rotate_left(i * 7);
            v.iter_mut().for_each(|x| *x *= 1.0 + i as f32 * 0.3);
            quantize_row(&v, fmt == BlockFormat::Q4_1)
        })
        .collect();
    let want: Vec<[u32; 4]> = acts
        .iter()
        .map(|a| quad.map(|r| portable_dot(fmt)(r, a).to_bits()))
        .collect();
    let mut u = Unpacked::default();
    u.fill(fmt, quad);
    // Runs of 1, 4 and 6 activation rows (the wide kernels' groups and remainder).
    for n in [1, 4, 6] {
        let (acts, want) = (&acts[..n], &want[..n]);
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = features.avx512_vnni() {
            let packed = avx512::packed_tile(cpu, fmt);
            let mut out = vec![[0f32; 4]; n];
            packed(quad, acts, &mut out);
            let got: Vec<[u32; 4]> = out.iter().map(|o| o.map(f32::to_bits)).collect();
            assert_eq!(got, want, "{fmt:?} packed tile of {n} by {blocks} blocks");
        }
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_mut)
        )]
        let mut kernels: Vec<Tile> = vec![tile_kernel(features), tile_portable];
        #[cfg(target_arch = "x86_64")]
        {
            kernels.extend(features.avx2().map(avx2::tile));
            kernels.extend(features.avx_vnni().map(avx2::tile));
        }
        #[cfg(target_arch = "aarch64")]
        {
            kernels.extend(features.neon().map(neon::tile));
            kernels.extend(features.neon_dotprod().map(neon::tile));
        }
        for kernel in kernels {
            let mut out = vec![[0f32; 4]; n];
            kernel(&u, acts, &mut out);
            let got: Vec<[u32; 4]> = out.iter().map(|o| o.map(f32::to_bits)).collect();
            assert_eq!(got, want, "{fmt:?} tile of {n} by {blocks} blocks");
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
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    let mut ran = vec!["portable"];
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        let (mut scalar, mut wide) = ([0i8; BLOCK], [0i8; BLOCK]);
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_variables)
        )]
        let want = quantize_block(block, &mut scalar);
        // The vector tier's scale, sum and bytes against the scalar code's.
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_variables)
        )]
        let check = |got: (f32, i32), wide: &[i8; BLOCK]| {
            assert_eq!(
                (got.0.to_bits(), got.1),
                (want.0.to_bits(), want.1),
                "block {b}"
            );
            assert_eq!(wide, &scalar, "block {b}");
        };
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = cpu::detect().avx2() {
            check(avx2::quantize_block(cpu, block, &mut wide), &wide);
            ran.push("avx2");
        }
        #[cfg(target_arch = "aarch64")]
        if let Some(cpu) = cpu::detect().neon() {
            check(neon::quantize_block(cpu, block, &mut wide), &wide);
            ran.push("neon");
        }
        let mut unpacked = [0i8; BLOCK];
        let packed: Vec<u8> = (0..16).map(|j| (j * 37 + b) as u8).collect();
        unpack_nibbles(&packed, 8, &mut unpacked);
        assert_eq!(unpacked, nibbles(&packed, 8));
        let _ = &mut wide;
    }
    say_checked("activation quantization", &ran);
}

#[test]
fn mismatched_sizes_are_refused() {
    assert!(QuantMatrix::from_gguf(BlockFormat::Q8_0.into(), 2, 32, &[0u8; 10]).is_none());
    assert!(QuantMatrix::from_gguf(BlockFormat::Q8_0.into(), 2, 30, &[0u8; 68]).is_none());
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
        QuantMatrix::from_gguf(BlockFormat::Q4_1.into(), rows, 64, &encode_q4_1(&w)).expect("sizes")
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
    let q8 = QuantMatrix::from_gguf(BlockFormat::Q8_0.into(), 1, 64, &[0u8; 68]).expect("sizes");
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
        QuantMatrix::from_gguf(BlockFormat::Q4_1.into(), rows, cols, &encode_q4_1(&w))
            .expect("sizes")
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
        (GgmlDType::Q4_0, BlockFormat::Q4_0),
        (GgmlDType::Q4_1, BlockFormat::Q4_1),
        (GgmlDType::Q8_0, BlockFormat::Q8_0),
    ] {
        let q = QTensor::quantize(&t, dtype).expect("quantizes");
        let want = q
            .dequantize(&Device::Cpu)
            .and_then(|d| d.to_vec2::<f32>())
            .expect("dequantizes");
        let data = q.data().expect("bytes");
        let m = QuantMatrix::from_gguf(format.into(), rows, cols, &data).expect("sizes");
        for (r, want) in want.iter().enumerate() {
            let mut got = vec![0f32; cols];
            m.dequantize_row(r, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(want), "{format:?} row {r}");
        }
    }
}

/// ggml's own outputs on deterministic inputs (`scripts/ggml-reference/`): per format, rows
/// of weights as ggml quantizes them, activations as ggml's CPU backend quantizes them, their
/// dot product and the dequantized weights.
mod ggml {
    use super::kquant::{self, KFormat};

    /// One row of the fixture.
    pub(super) struct Row {
        pub(super) w: Vec<f32>,
        pub(super) x: Vec<f32>,
        pub(super) weights: Vec<u8>,
        pub(super) activations: Vec<u8>,
        pub(super) dot: f32,
        pub(super) dequantized: Vec<f32>,
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array()
            .expect("a list of bit patterns")
            .iter()
            .map(|b| f32::from_bits(b.as_u64().expect("bits") as u32))
            .collect()
    }

    fn bytes(v: &serde_json::Value) -> Vec<u8> {
        let s = v.as_str().expect("hex");
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex digit"))
            .collect()
    }

    /// The whole fixture.
    fn fixture() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/ggml-reference.json"
        );
        let text = std::fs::read_to_string(path).expect("the ggml reference fixture");
        serde_json::from_str(&text).expect("JSON")
    }

    /// The names of the formats the fixture holds.
    pub(super) fn formats() -> Vec<String> {
        fixture()
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect()
    }

    /// The fixture's rows for ggml's type `name`.
    pub(super) fn rows(name: &str) -> Vec<Row> {
        fixture()[name]["rows"]
            .as_array()
            .unwrap_or_else(|| panic!("no {name} in the fixture"))
            .iter()
            .map(|r| Row {
                w: floats(&r["w"]),
                x: floats(&r["x"]),
                weights: bytes(&r["weights"]),
                activations: bytes(&r["activations"]),
                dot: floats(&serde_json::Value::Array(vec![r["dot"][0].clone()]))[0],
                dequantized: floats(&r["dequantized"]),
            })
            .collect()
    }

    /// The fixture row's weights decoded by `m` (a one-row matrix of them), checked bit for
    /// bit against ggml's decoding.
    pub(super) fn assert_decodes(m: &super::QuantMatrix, row: &Row, what: &str) -> Vec<f32> {
        let mut back = vec![0f32; row.x.len()];
        m.dequantize_row(0, &mut back);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&row.dequantized), "{what}: decoded");
        back
    }

    /// A Q8_K row in ggml's `block_q8_K` bytes.
    pub(super) fn q8k_bytes(a: &kquant::Q8KRow) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, d) in a.d.iter().enumerate() {
            out.extend(d.to_le_bytes());
            out.extend(a.qs[i * 256..(i + 1) * 256].iter().map(|&q| q as u8));
            for s in &a.bsums[i * 16..(i + 1) * 16] {
                out.extend(s.to_le_bytes());
            }
        }
        out
    }

    pub(super) const K_FORMATS: [(KFormat, &str); 5] = [
        (KFormat::Q2K, "q2_K"),
        (KFormat::Q3K, "q3_K"),
        (KFormat::Q4K, "q4_K"),
        (KFormat::Q5K, "q5_K"),
        (KFormat::Q6K, "q6_K"),
    ];
}

#[test]
fn k_quants_compute_what_ggml_computes_bit_for_bit() {
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    let mut ran = vec!["portable"];
    for (format, name) in ggml::K_FORMATS {
        for (r, row) in ggml::rows(name).iter().enumerate() {
            let a = kquant::quantize_row_q8k(&row.x);
            assert_eq!(
                ggml::q8k_bytes(&a),
                row.activations,
                "{name} row {r}: Q8_K bytes"
            );
            let got = kquant::dot(format)(&row.weights, &a);
            assert_eq!(
                got.to_bits(),
                row.dot.to_bits(),
                "{name} row {r}: dot {got} vs {}",
                row.dot
            );
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = cpu::detect().avx2() {
                let v = kquant::avx2::dot(cpu, format)(&row.weights, &a);
                assert_eq!(v.to_bits(), row.dot.to_bits(), "{name} row {r}: AVX2 dot");
                ran.push("avx2");
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(dot2) = cpu::detect()
                .avx512()
                .map(|cpu| kquant::rows2::dot2(cpu, format))
            {
                let w = &row.weights[..];
                let doubled = kquant::quantize_row_q8k_doubled(&row.x);
                let v = dot2([w, w], &doubled).map(f32::to_bits);
                assert_eq!(
                    v,
                    [row.dot.to_bits(); 2],
                    "{name} row {r}: AVX-512 two-row dot"
                );
                ran.push("avx512");
            }
            #[cfg(target_arch = "aarch64")]
            {
                if let Some(cpu) = cpu::detect().neon() {
                    let v = kquant::neon::dot(cpu, format)(&row.weights, &a);
                    assert_eq!(v.to_bits(), row.dot.to_bits(), "{name} row {r}: NEON dot");
                    ran.push("neon");
                }
                if let Some(cpu) = cpu::detect().neon_dotprod() {
                    let v = kquant::neon::dot(cpu, format)(&row.weights, &a);
                    assert_eq!(v.to_bits(), row.dot.to_bits(), "{name} row {r}: sdot");
                    ran.push("neon-dotprod");
                }
            }
            let m = QuantMatrix::from_gguf(WeightFormat::K(format), 1, row.x.len(), &row.weights)
                .expect("sizes");
            assert_eq!(
                m.matmul(&row.x)[0].to_bits(),
                row.dot.to_bits(),
                "{name} row {r}: matmul"
            );
            ggml::assert_decodes(&m, row, &format!("{name} row {r}"));
        }
    }
    say_checked("K-quant dot products", &ran);
}

#[test]
fn q3_k_scales_unpack_in_vector_registers_as_the_portable_loop_unpacks_them() {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut ran: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = cpu::detect().avx2() {
        // Every value of every header byte, the other bytes of the super-block varied.
        for at in 96..108 {
            for v in 0..=255u8 {
                let mut b: Vec<u8> = (0..KFormat::Q3K.block_bytes())
                    .map(|i| (i * 37 + at * 11 + usize::from(v)) as u8)
                    .collect();
                b[at] = v;
                assert_eq!(
                    kquant::avx2::q3k_scales_i16(cpu, &b),
                    kquant::scales_q3k(&b[96..108]),
                    "header byte {} = {v:#04x}",
                    at - 96
                );
            }
        }
        ran.push("avx2");
    }
    if ran.is_empty() {
        ran.push("no tier (the vector unpacking is AVX2's)");
    }
    say_checked("Q3_K scale unpacking", &ran);
}

#[test]
fn the_32_value_formats_compute_what_ggml_computes_bit_for_bit() {
    for (format, name) in [
        (BlockFormat::Q4_0, "q4_0"),
        (BlockFormat::Q4_1, "q4_1"),
        (BlockFormat::Q8_0, "q8_0"),
    ] {
        for (r, row) in ggml::rows(name).iter().enumerate() {
            let sums = format == BlockFormat::Q4_1;
            let a = quantize_row(&row.x, sums);
            let mut bytes = Vec::new();
            for i in 0..a.d.len() {
                bytes.extend(f16::from_f32(a.d[i]).to_le_bytes());
                if sums {
                    bytes.extend(f16::from_f32(a.s[i]).to_le_bytes());
                }
                bytes.extend(a.q[i * BLOCK..(i + 1) * BLOCK].iter().map(|&q| q as u8));
            }
            assert_eq!(bytes, row.activations, "{name} row {r}: activation bytes");
            for features in [cpu::detect(), cpu::detect().capped(1)] {
                let got = dot_kernel(features, format)(&row.weights, &a);
                assert_eq!(got.to_bits(), row.dot.to_bits(), "{name} row {r}: dot");
            }
            let m =
                QuantMatrix::from_gguf(format.into(), 1, row.x.len(), &row.weights).expect("sizes");
            ggml::assert_decodes(&m, row, &format!("{name} row {r}"));
        }
    }
}

#[test]
fn the_5_bit_formats_compute_what_ggml_computes_bit_for_bit() {
    let mut ran = Vec::new();
    for (format, name) in [(WeightFormat::Q5_0, "q5_0"), (WeightFormat::Q5_1, "q5_1")] {
        let signed = format == WeightFormat::Q5_0;
        for (r, row) in ggml::rows(name).iter().enumerate() {
            let a = quantize_row(&row.x, !signed);
            let portable = if signed { q5::dot_q5_0 } else { q5::dot_q5_1 };
            #[cfg_attr(
                not(any(target_arch = "x86_64", target_arch = "aarch64")),
                allow(unused_mut)
            )]
            let mut dots: Vec<(&str, Dot)> = vec![("portable", portable)];
            #[cfg(target_arch = "x86_64")]
            {
                let f = cpu::detect();
                dots.extend(f.avx2().map(|cpu| ("avx2", avx2::dot_q5(cpu, signed))));
                dots.extend(
                    f.avx_vnni()
                        .map(|cpu| ("avx-vnni", avx2::dot_q5(cpu, signed))),
                );
                let b = if signed { Batched::Q5_0 } else { Batched::Q5_1 };
                dots.extend(
                    f.avx512_vnni()
                        .map(|cpu| ("avx512-vnni", avx512::dot(cpu, b))),
                );
            }
            #[cfg(target_arch = "aarch64")]
            {
                let (f, b) = (
                    cpu::detect(),
                    if signed { Batched::Q5_0 } else { Batched::Q5_1 },
                );
                dots.extend(f.neon().map(|cpu| ("neon", neon::dot(cpu, b))));
                dots.extend(
                    f.neon_dotprod()
                        .map(|cpu| ("neon-dotprod", neon::dot(cpu, b))),
                );
            }
            for (tier, dot) in dots {
                let got = dot(&row.weights, &a);
                assert_eq!(
                    got.to_bits(),
                    row.dot.to_bits(),
                    "{name} row {r}: {tier} dot"
                );
                ran.push(tier);
            }
            let m = QuantMatrix::from_gguf(format, 1, row.x.len(), &row.weights).expect("sizes");
            ggml::assert_decodes(&m, row, &format!("{name} row {r}"));
            let out = m.matmul(&row.x);
            assert_eq!(
                out[0].to_bits(),
                row.dot.to_bits(),
                "{name} row {r}: matmul"
            );
        }
    }
    say_checked("Q5_0 and Q5_1 dot products", &ran);
}

/// `rows` weight rows of `blocks` blocks of `format` (a 32-value format), every row
/// different, with finite f16 scales (and minima).
fn block_rows(format: Batched, rows: usize, blocks: usize) -> Vec<u8> {
    let bytes = format.block_bytes();
    let mut w: Vec<u8> = (0..rows * blocks * bytes)
        .map(|i| ((i * 131 + 17) % 251) as u8 ^ (i >> 6) as u8)
        .collect();
    for (b, block) in w.chunks_exact_mut(bytes).enumerate() {
        let d = 0.003 + (b % 11) as f32 * 0.0009;
        block[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        if format.mins() {
            let m = -0.02 + (b % 7) as f32 * 0.004;
            block[2..4].copy_from_slice(&f16::from_f32(m).to_le_bytes());
        }
    }
    w
}

/// The portable one-row dot product of a 32-value format.
fn portable_batched_dot(format: Batched) -> Dot {
    match format {
        Batched::Block(f) => portable_dot(f),
        Batched::Q5_0 => q5::dot_q5_0,
        Batched::Q5_1 => q5::dot_q5_1,
    }
}

/// Asserts that `dot2` gives pairs of the 37 weight rows `row(r)` against `a` the one-row
/// results `want` (as bits): neighbours, rows far apart in either order, and a row with itself.
fn assert_two_rows<'w, A>(
    what: &str,
    dot2: Dot2<A>,
    row: &dyn Fn(usize) -> &'w [u8],
    a: &A,
    want: &[u32],
) {
    for (r0, r1) in [(0, 1), (5, 36), (36, 2), (7, 7)] {
        let got = dot2([row(r0), row(r1)], a).map(f32::to_bits);
        assert_eq!(got, [want[r0], want[r1]], "{what}: rows {r0} and {r1}");
    }
}

#[test]
fn two_rows_at_once_give_each_row_its_one_row_dot_product() {
    let formats = [
        (WeightFormat::Q4_0, Batched::Block(BlockFormat::Q4_0)),
        (WeightFormat::Q4_1, Batched::Block(BlockFormat::Q4_1)),
        (WeightFormat::Q8_0, Batched::Block(BlockFormat::Q8_0)),
        (WeightFormat::Q5_0, Batched::Q5_0),
        (WeightFormat::Q5_1, Batched::Q5_1),
    ];
    let mut ran = Vec::new();
    for (format, batched) in formats {
        // An odd number of blocks (the AVX-512 kernel takes two at a time), and of rows (a
        // task's halves leave one row over).
        let (rows, blocks) = (37, 5);
        let cols = blocks * BLOCK;
        let w = block_rows(batched, rows, blocks);
        let row_bytes = blocks * batched.block_bytes();
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let a = quantize_row(&x, batched.mins());
        let want: Vec<u32> = w
            .chunks_exact(row_bytes)
            .map(|r| portable_batched_dot(batched)(r, &a).to_bits())
            .collect();
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut dots: Vec<(&str, Dot2)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let f = cpu::detect();
            dots.extend(f.avx2().map(|cpu| ("avx2", avx2::dot2(cpu, batched))));
            dots.extend(
                f.avx_vnni()
                    .map(|cpu| ("avx-vnni", avx2::dot2(cpu, batched))),
            );
            dots.extend(
                f.avx512_vnni()
                    .map(|cpu| ("avx512-vnni", avx512::dot2(cpu, batched))),
            );
        }
        let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
        for (tier, dot2) in dots {
            assert_two_rows(&format!("{format:?} {tier}"), dot2, &row, &a, &want);
            ran.push(tier);
        }
        // The product of one activation row, whichever way this CPU pairs the rows.
        let mat = QuantMatrix::from_gguf(format, rows, cols, &w).expect("sizes");
        let got: Vec<u32> = mat.matmul(&x).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{format:?}: one activation row");
    }
    if ran.is_empty() {
        tell!(
            "two-row dot products: none on this CPU's tiers ({})",
            cpu::detect().tiers().join(", ")
        );
    } else {
        say_checked("two-row dot products", &ran);
    }
}

#[test]
fn weights_quantized_at_load_are_the_blocks_llama_cpp_writes() {
    // Every block format the fixture holds (ggml's names: `q4_K`) has a quantizer.
    let names: Vec<String> = quantize::QUANTIZABLE
        .iter()
        .map(|f| f.name().replace("_k", "_K"))
        .collect();
    for held in ggml::formats().iter().filter(|n| n.starts_with('q')) {
        assert!(names.contains(held), "no quantizer for {held}");
    }
    for (format, name) in quantize::QUANTIZABLE.into_iter().zip(names) {
        for (r, row) in ggml::rows(&name).iter().enumerate() {
            let got = quantize::quantize_row(format, &row.w).expect("a quantizer");
            assert_eq!(got, row.weights, "{name} row {r}");
        }
    }
    let f16 = WeightFormat::Float(FloatFormat::F16);
    assert_eq!(quantize::quantize_row(f16, &[0.0; 32]), None);
    // llama-quantize's fallbacks for rows the asked-for blocks do not fit.
    let [q2k, q3k, q4k, q5k, q6k] = [
        KFormat::Q2K,
        KFormat::Q3K,
        KFormat::Q4K,
        KFormat::Q5K,
        KFormat::Q6K,
    ]
    .map(WeightFormat::K);
    assert_eq!(quantize::format_for(q4k, 512), Some(q4k));
    assert_eq!(quantize::format_for(q2k, 576), Some(WeightFormat::Q4_0));
    assert_eq!(quantize::format_for(q3k, 576), Some(WeightFormat::Q4_0));
    assert_eq!(quantize::format_for(q4k, 576), Some(WeightFormat::Q5_0));
    assert_eq!(quantize::format_for(q5k, 576), Some(WeightFormat::Q5_1));
    assert_eq!(quantize::format_for(q6k, 576), Some(WeightFormat::Q8_0));
    assert_eq!(quantize::format_for(q4k, 100), None);
    assert_eq!(quantize::format_for(WeightFormat::Q8_0, 100), None);
}

/// Every float kernel this CPU has, portable first, with the tier's name.
fn float_kernels() -> Vec<(&'static str, float::FloatKernel)> {
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    let mut kernels = vec![("portable", float::FloatKernel::Portable)];
    #[cfg(target_arch = "x86_64")]
    {
        let features = cpu::detect();
        kernels.extend(
            features
                .avx2()
                .map(|c| ("avx2", float::FloatKernel::Avx2(c))),
        );
        kernels.extend(
            features
                .avx512()
                .map(|c| ("avx512", float::FloatKernel::Avx512(c))),
        );
        kernels.extend(
            features
                .avx512_bf16()
                .map(|c| ("avx512-bf16", float::FloatKernel::Avx512Bf16(c))),
        );
    }
    #[cfg(target_arch = "aarch64")]
    kernels.extend(
        cpu::detect()
            .neon()
            .map(|c| ("neon", float::FloatKernel::Neon(c))),
    );
    let names: Vec<&str> = kernels.iter().map(|(n, _)| *n).collect();
    say_checked("float kernels", &names);
    kernels
}

/// `n` values of `format` with edge values among them: zeros of both signs, large and
/// tiny magnitudes (f16 subnormals), exact ties of the f16 rounding.
fn float_row(format: FloatFormat, n: usize, salt: usize) -> (Vec<u8>, Vec<f32>) {
    let mut values = Vec::with_capacity(n);
    let mut bytes = Vec::with_capacity(n * format.bytes());
    for i in 0..n {
        let u = ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.5 - 1.0;
        let v = match (i + salt) % 17 {
            0 => 0.0,
            1 => -0.0,
            2 => u * 3.0e4,
            3 => u * 3.0e-6,
            _ => u * (1.0 + (i % 5) as f32),
        };
        let v = match format {
            FloatFormat::F32 => {
                bytes.extend(v.to_le_bytes());
                v
            }
            FloatFormat::F16 => {
                let h = f16::from_f32(v);
                bytes.extend(h.to_le_bytes());
                h.to_f32()
            }
            FloatFormat::BF16 => {
                let b = half::bf16::from_f32(v);
                bytes.extend(b.to_le_bytes());
                b.to_f32()
            }
        };
        values.push(v);
    }
    (bytes, values)
}

#[test]
fn float_kernels_match_the_portable_code_bit_for_bit() {
    let kernels = float_kernels();
    if kernels
        .iter()
        .all(|(_, k)| k.pair_tiles(FloatFormat::BF16).is_none())
    {
        tell!("BF16 vdpbf16ps tiles not checked: no AVX-512 BF16 tier here (the CPU lacks it or FERRITE_CPU_TIER caps it)");
    }
    if kernels
        .iter()
        .all(|(_, k)| k.stored_tiles(FloatFormat::F16).is_none())
    {
        tell!("tiles on stored F16 and BF16 rows not checked: no AVX2 or AVX-512 tier here (the CPU lacks them or FERRITE_CPU_TIER caps them)");
    }
    for format in [FloatFormat::F32, FloatFormat::F16, FloatFormat::BF16] {
        for n in [1, 63, 64, 100, 128, 200, 576, 1000, 2300, 4200] {
            let rows: Vec<(Vec<u8>, Vec<f32>)> = (0..4)
                .map(|s| {
                    // The widened rows in the order the kernels read them (BF16: pair order).
                    let (bytes, _) = float_row(format, n, s);
                    let mut paired = vec![0.0; n];
                    format.widen_paired(&bytes, &mut paired);
                    (bytes, paired)
                })
                .collect();
            // Activations with f16 ties (odd multiples of 2^-11 near 1) and large values.
            let raw_x: Vec<f32> = (0..n)
                .map(|i| match i % 9 {
                    0 => 1.0 + (2 * (i % 50) + 1) as f32 * 2f32.powi(-11),
                    1 => -7.0e3,
                    _ => ((i * 37 % 101) as f32 - 50.0) * 0.013,
                })
                .collect();
            let x = format.activations(&raw_x);
            let want: Vec<u32> = rows
                .iter()
                .map(|(w, _)| float::dot_portable(format, w, &x).to_bits())
                .collect();
            // The activations as the 16-bit values they are rounded to (BF16 in pair order).
            let halves: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
            let bf16s: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
            for (tier, kernel) in &kernels {
                for (r, (w, values)) in rows.iter().enumerate() {
                    assert_eq!(
                        kernel.dot(format, w, &x).to_bits(),
                        want[r],
                        "{format:?} {n} values, {tier} dot of row {r}"
                    );
                    let narrow = match format {
                        FloatFormat::F16 => Some(kernel.dot(format, w, &halves)),
                        FloatFormat::BF16 => Some(kernel.dot(format, w, &bf16s)),
                        FloatFormat::F32 => None,
                    };
                    if let Some(got) = narrow {
                        assert_eq!(
                            got.to_bits(),
                            want[r],
                            "{format:?} {n} values, {tier} dot of row {r} on 16-bit activations"
                        );
                    }
                    assert_eq!(
                        float::dot_f32_portable(format, values, &x).to_bits(),
                        want[r],
                        "{format:?} {n} values: widened rows give the same sums"
                    );
                    let mut widened = vec![f32::NAN; n];
                    kernel.widen(format, w, &mut widened);
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&widened),
                        bits(values),
                        "{format:?} {n}, {tier} widening"
                    );
                }
                let quad = [0, 1, 2, 3].map(|r| &rows[r].1[..]);
                let got = kernel.quad(format, quad, &x).map(f32::to_bits);
                assert_eq!(got.to_vec(), want, "{format:?} {n} values, {tier} quad");
                // Four activation rows, the same one in the third place.
                let others: Vec<Vec<f32>> = (0..4)
                    .map(|s| x.iter().map(|v| v * (1.0 + s as f32 * 0.25)).collect())
                    .collect();
                // Two register tiles' worth: the rows again in another order.
                let acts = [
                    &others[0][..],
                    &others[1],
                    &x,
                    &others[3],
                    &others[3],
                    &x,
                    &others[1],
                    &others[0],
                ];
                let mut tile = [[0f32; 4]; 8];
                kernel.tile(format, quad, &acts, &[], &mut tile);
                for (a, row) in tile.iter().enumerate() {
                    let alone = kernel.quad(format, quad, acts[a]).map(f32::to_bits);
                    assert_eq!(
                        row.map(f32::to_bits),
                        alone,
                        "{format:?} {n}, {tier} tile row {a}"
                    );
                }
                for a in [2, 5] {
                    let got = tile[a].map(f32::to_bits).to_vec();
                    assert_eq!(got, want, "{format:?} {n}, {tier} tile row {a}");
                }
                if let Some(pairs) = kernel.pair_tiles(format) {
                    assert_bf16_tile(pairs, &rows, &raw_x);
                }
                if let Some(stored_tiles) = kernel.stored_tiles(format) {
                    // Rows as stored, widened as the tile loads them: the same bits.
                    let stored = [0, 1, 2, 3].map(|r| &rows[r].0[..]);
                    let mut direct = [[f32::NAN; 4]; 8];
                    stored_tiles.tile(stored, &acts, &[], &mut direct);
                    assert_eq!(
                        direct.map(|r| r.map(f32::to_bits)),
                        tile.map(|r| r.map(f32::to_bits)),
                        "{format:?} {n}, {tier} tile on stored rows"
                    );
                    // Eight distinct rows, where the tier has the eight-row tile: every
                    // (weight row, activation row) pair its own dot product's bits.
                    if let Some(eight_rows) = stored_tiles.eight_rows() {
                        let more: Vec<Vec<u8>> =
                            (4..8).map(|s| float_row(format, n, s).0).collect();
                        let eight: [&[u8]; 8] =
                            std::array::from_fn(
                                |r| {
                                    if r < 4 {
                                        stored[r]
                                    } else {
                                        &more[r - 4][..]
                                    }
                                },
                            );
                        // Every count of activation rows up to eight: whole register tiles,
                        // and the one or two rows left over.
                        for rows in 1..=acts.len() {
                            let mut wide = [[f32::NAN; 8]; 8];
                            eight_rows.tile(eight, &acts[..rows], &[], &mut wide[..rows]);
                            for (a, got) in wide[..rows].iter().enumerate() {
                                let want = eight.map(|w| kernel.dot(format, w, acts[a]).to_bits());
                                assert_eq!(
                                    got.map(f32::to_bits),
                                    want,
                                    "{format:?} {n}, {tier} eight-row tile of {rows}, activation row {a}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The `vdpbf16ps` tiles over BF16 weight `rows` (as stored) and two register tiles of
/// activation rows made from `raw_x`, and its one-row dot product on the same column-order
/// activations, give every pair the portable dot product's bits; so does the eight-row
/// tile, on those rows and four more, for every count of activation rows up to eight.
fn assert_bf16_tile(pairs: float::PairTiles, rows: &[(Vec<u8>, Vec<f32>)], raw_x: &[f32]) {
    let format = FloatFormat::BF16;
    let n = raw_x.len();
    let acts: Vec<Vec<f32>> = (0..4)
        .map(|s| {
            let scaled: Vec<f32> = raw_x.iter().map(|v| v * (1.0 + s as f32 * 0.3)).collect();
            format.activations(&scaled).into_owned()
        })
        .collect();
    let columns: Vec<Vec<u16>> = acts
        .iter()
        .map(|a| {
            let mut c = vec![0; n];
            float::bf16_columns(a, &mut c);
            c
        })
        .collect();
    let order = [0, 1, 2, 3, 3, 2, 1, 0];
    let x: Vec<&[u16]> = order.iter().map(|&i| &columns[i][..]).collect();
    let w: [&[u8]; 4] = [0, 1, 2, 3].map(|r| &rows[r].0[..]);
    let mut tile = [[0f32; 4]; 8];
    pairs.tile(w, &x, &[], &mut tile);
    for (a, got) in tile.iter().enumerate() {
        let want = w.map(|w| float::dot_portable(format, w, &acts[order[a]]).to_bits());
        assert_eq!(
            got.map(f32::to_bits),
            want,
            "{n} values, vdpbf16ps tile row {a}"
        );
    }
    let more: Vec<Vec<u8>> = (4..8).map(|s| float_row(format, n, s).0).collect();
    let eight: [&[u8]; 8] = std::array::from_fn(|r| if r < 4 { w[r] } else { &more[r - 4][..] });
    for count in 1..=x.len() {
        let mut wide = [[f32::NAN; 8]; 8];
        pairs.tile8(eight, &x[..count], &[], &mut wide[..count]);
        for (a, got) in wide[..count].iter().enumerate() {
            let want = eight.map(|w| float::dot_portable(format, w, &acts[order[a]]).to_bits());
            assert_eq!(
                got.map(f32::to_bits),
                want,
                "{n} values, vdpbf16ps eight-row tile of {count}, activation row {a}"
            );
        }
    }
    // The one-row product on column-order activations gives the same bits.
    for (c, a) in columns.iter().zip(&acts) {
        for w in w {
            assert_eq!(
                pairs.dot(w, c).to_bits(),
                float::dot_portable(format, w, a).to_bits(),
                "{n} values, vdpbf16ps dot on column-order activations"
            );
        }
    }
}

#[test]
fn float_matrices_give_every_row_its_single_row_result_in_any_batch() {
    // 16: one call of the eight-row F16 and BF16 tiles (four threes and two twos, not fifteen
    // and a single row).
    let sizes = [
        1,
        2,
        5,
        16,
        WEIGHT_PARALLEL_MAX_ROWS,
        WEIGHT_PARALLEL_MAX_ROWS + 1,
        70,
    ];
    // 37 rows: an odd number, so one activation row's two halves of them leave one over.
    // 8200 columns (and a tail past the last 64): a long product's task then takes no more
    // activation rows than fill 1 MiB, 31 of f32, where it would take 64 (or, on two
    // threads, 35), so 70 rows go in tasks of 31, 31 and 8.
    let shapes = [(37, 200, &sizes[..]), (9, 8200, &[1, 33, 70][..])];
    for (rows, cols, sizes) in shapes {
        for format in [FloatFormat::F32, FloatFormat::F16, FloatFormat::BF16] {
            let (bytes, _) = float_row(format, rows * cols, 5);
            let mat = QuantMatrix::from_gguf(WeightFormat::Float(format), rows, cols, &bytes)
                .expect("sizes");
            let row_bytes = cols * format.bytes();
            let what = format!("{format:?}, {rows} x {cols}");
            assert_batches(&mat, sizes, &what, |x| {
                let acts = format.activations(x);
                bytes
                    .chunks_exact(row_bytes)
                    .map(|w| float::dot_portable(format, w, &acts))
                    .collect()
            });
        }
    }
}

#[test]
fn bf16_least_exponents_find_what_vdpbf16ps_would_flush() {
    let bits = |v: &[f32]| {
        v.iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect::<Vec<_>>()
    };
    let least = |v: &[f32]| float::bf16_least_exponent(bits(v).into_iter());
    assert_eq!(least(&[1.0, -3.0, 0.0, -0.0]), Some(0));
    assert_eq!(least(&[0.5, 2.0e-3]), Some(-9));
    assert_eq!(least(&[0.0, -0.0]), Some(i32::MAX));
    assert_eq!(least(&[1.0, 1.0e-39]), None, "a subnormal");
    assert_eq!(least(&[1.0, f32::INFINITY]), None);
    assert_eq!(least(&[f32::NAN]), None);
    // The bytes version, over lengths that leave a remainder of the 32-value lanes.
    for n in [0, 1, 31, 32, 33, 100] {
        let v: Vec<f32> = (0..n).map(|i| (i as f32 - 40.0) * 0.37).collect();
        let bytes: Vec<u8> = bits(&v).iter().flat_map(|b| b.to_le_bytes()).collect();
        assert_eq!(
            float::bf16_bytes_least_exponent(&bytes),
            least(&v),
            "{n} values"
        );
    }
    let mut odd = vec![0u8; 130];
    odd[128] = 1; // the least subnormal, in the remainder
    assert_eq!(float::bf16_bytes_least_exponent(&odd), None);
    assert!(float::pairs_exact(Some(-56), Some(-56)));
    assert!(!float::pairs_exact(Some(-57), Some(-56)));
    assert!(float::pairs_exact(Some(i32::MAX), Some(-100)));
    assert!(!float::pairs_exact(None, Some(0)));
}

#[test]
fn bf16_products_keep_their_bits_where_vdpbf16ps_would_flush_to_zero() {
    // Products of 2^-60 by 2^-70 are subnormal f32 (vdpbf16ps makes them 0); a subnormal
    // weight and a subnormal activation are read as 0 by it. Every tier must still give the
    // multiply-adds' bits, at one activation row and in tiles.
    let (rows, cols) = (8, 200);
    let mut w: Vec<f32> = (0..rows * cols)
        .map(|i| 2f32.powi(-60) * (1.0 + (i % 7) as f32 / 8.0))
        .collect();
    w[3] = f32::from_bits(1 << 16); // the least BF16 subnormal
    let bytes: Vec<u8> = w
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let mat = QuantMatrix::from_gguf(WeightFormat::Float(FloatFormat::BF16), rows, cols, &bytes)
        .expect("sizes");
    for m in [1, 8] {
        let mut x: Vec<f32> = (0..m * cols)
            .map(|i| 2f32.powi(-70) * (1.0 + (i % 5) as f32 / 4.0))
            .collect();
        x[1] = 1.0e-39;
        let out = mat.matmul(&x);
        for (i, row) in x.chunks_exact(cols).enumerate() {
            let acts = FloatFormat::BF16.activations(row);
            for (r, w) in bytes.chunks_exact(2 * cols).enumerate() {
                let want = float::dot_portable(FloatFormat::BF16, w, &acts);
                assert!(want != 0.0, "the sums are subnormal, not zero");
                let got = out[i * rows + r];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "batch of {m}, row {i}, output {r}"
                );
            }
        }
    }
}

#[test]
fn float_weights_compute_what_ggml_computes_bit_for_bit() {
    let kernels = float_kernels();
    for (format, name) in [
        (FloatFormat::F16, "f16"),
        (FloatFormat::F16, "f16/500"),
        (FloatFormat::F32, "f32"),
        (FloatFormat::F32, "f32/500"),
        (FloatFormat::BF16, "bf16"),
        (FloatFormat::BF16, "bf16/500"),
    ] {
        for (r, row) in ggml::rows(name).iter().enumerate() {
            let n = row.x.len();
            let m = QuantMatrix::from_gguf(WeightFormat::Float(format), 1, n, &row.weights)
                .expect("sizes");
            let back = ggml::assert_decodes(&m, row, &format!("{name} row {r}"));
            if format == FloatFormat::BF16 {
                // The activations are rounded to BF16 as ggml rounds them; the products are
                // added in the pair order (ggml's vector dot and llamafile's sgemm each have
                // orders of their own), so the sums agree with ggml's to rounding, not bits.
                let acts = format.activations(&row.x);
                let mut columns = vec![0u16; n];
                float::bf16_columns(&acts, &mut columns);
                let bytes: Vec<u8> = columns.iter().flat_map(|b| b.to_le_bytes()).collect();
                assert_eq!(bytes, row.activations, "{name} row {r}: activations");
                let want = float::dot_portable(format, &row.weights, &acts);
                let got = m.matmul(&row.x)[0];
                assert_eq!(got.to_bits(), want.to_bits(), "{name} row {r}");
                let scale: f32 = back.iter().zip(&row.x).map(|(w, x)| (w * x).abs()).sum();
                assert!(
                    (got - row.dot).abs() <= 1e-5 * scale,
                    "{name} row {r}: {got} vs ggml's {}",
                    row.dot
                );
                continue;
            }
            let acts = format.activations(&row.x);
            let act_bytes: Vec<u8> = match format {
                FloatFormat::F16 => acts
                    .iter()
                    .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => acts.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            assert_eq!(act_bytes, row.activations, "{name} row {r}: activations");
            for (tier, kernel) in &kernels {
                let got = kernel.dot(format, &row.weights, &acts);
                assert_eq!(
                    got.to_bits(),
                    row.dot.to_bits(),
                    "{name} row {r}: {tier} dot {got} vs ggml's {}",
                    row.dot
                );
            }
            assert_eq!(
                m.matmul(&row.x)[0].to_bits(),
                row.dot.to_bits(),
                "{name} row {r}: matmul"
            );
        }
    }
}

/// Counts the heap allocations made on each thread (the dot products must make none: they
/// run once per weight row and activation row, millions of times a step).
#[allow(unsafe_code)]
mod allocations {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static COUNT: Cell<usize> = const { Cell::new(0) };
    }

    struct Counting;

    // SAFETY: every call is forwarded unchanged to the system allocator; the counter is a
    // thread-local `Cell` with a constant initialiser, which never allocates.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            COUNT.with(|c| c.set(c.get() + 1));
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    /// Allocations this thread made while running `f`.
    pub(super) fn during(f: impl FnOnce()) -> usize {
        let before = COUNT.with(Cell::get);
        f();
        COUNT.with(Cell::get) - before
    }
}

#[test]
fn dot_products_never_allocate() {
    for (format, name) in ggml::K_FORMATS {
        let rows = ggml::rows(name);
        let row = &rows[0];
        let a = kquant::quantize_row_q8k(&row.x);
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_mut)
        )]
        let mut dots = vec![("portable", kquant::dot(format))];
        #[cfg(target_arch = "x86_64")]
        dots.extend(
            cpu::detect()
                .avx2()
                .map(|cpu| ("avx2", kquant::avx2::dot(cpu, format))),
        );
        #[cfg(target_arch = "aarch64")]
        {
            let features = cpu::detect();
            dots.extend(
                features
                    .neon()
                    .map(|cpu| ("neon", kquant::neon::dot(cpu, format))),
            );
            dots.extend(
                features
                    .neon_dotprod()
                    .map(|cpu| ("neon-dotprod", kquant::neon::dot(cpu, format))),
            );
        }
        for (tier, dot) in dots {
            let n = allocations::during(|| {
                std::hint::black_box(dot(&row.weights, &a));
            });
            assert_eq!(n, 0, "{name} {tier}: {n} allocations in one dot product");
        }
    }
    let x: Vec<f32> = (0..256).map(|i| i as f32 * 0.01 - 1.0).collect();
    for (format, name) in [(FloatFormat::F16, "f16"), (FloatFormat::BF16, "bf16")] {
        let row = &ggml::rows(name)[0];
        for (tier, kernel) in float_kernels() {
            let n = allocations::during(|| {
                std::hint::black_box(kernel.dot(format, &row.weights, &x[..]));
            });
            assert_eq!(n, 0, "{name} {tier}: {n} allocations in one dot product");
        }
    }
}

/// `rows` weight rows of `cols` values in `format`: bytes from a fixed sequence, the f16
/// scales written as finite values.
fn kquant_rows(format: KFormat, rows: usize, cols: usize, salt: usize) -> Vec<u8> {
    kquant_rows_of(format, rows, cols, |i| {
        ((i * 131 + salt * 71) % 251) as u8 ^ (i >> 7) as u8
    })
}

/// `rows` weight rows of `cols` values in `format`: byte `i` is `byte(i)`, but for the f16
/// scales, written as finite values.
fn kquant_rows_of(
    format: KFormat,
    rows: usize,
    cols: usize,
    byte: impl Fn(usize) -> u8,
) -> Vec<u8> {
    let n = rows * cols / kquant::QK_K * format.block_bytes();
    let mut bytes: Vec<u8> = (0..n).map(byte).collect();
    let scales: &[usize] = match format {
        KFormat::Q2K => &[80, 82],
        KFormat::Q3K => &[108],
        KFormat::Q4K | KFormat::Q5K => &[0, 2],
        KFormat::Q6K => &[208],
    };
    for (b, block) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
        for (k, &at) in scales.iter().enumerate() {
            let v = 0.002 + ((b * 7 + k * 3) % 13) as f32 * 0.0007;
            block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

#[test]
fn the_q8_k_quantizers_equal_the_portable_loop_bit_for_bit() {
    // Super-blocks whose largest magnitude is held by values of both signs (the first
    // counts), NaNs beside values (passed over) and alone (a block of scale 0), zeros,
    // infinities, subnormals and values that scale to a tie, then ordinary rows.
    let mut blocks: Vec<Vec<f32>> = vec![
        vec![0.0; 256],
        vec![f32::NAN; 256],
        (0..256).map(|i| if i == 7 { 1e-40 } else { 0.0 }).collect(),
        (0..256)
            .map(|i| {
                if i % 2 == 0 {
                    f32::NAN
                } else {
                    i as f32 * 0.01
                }
            })
            .collect(),
        (0..256)
            .map(|i| if i == 200 { f32::INFINITY } else { 1.0 })
            .collect(),
        (0..256)
            .map(|i| if i == 3 { -f32::INFINITY } else { -2.0 })
            .collect(),
    ];
    for (first, second) in [(-3.0, 3.0), (3.0, -3.0)] {
        let mut b: Vec<f32> = (0..256).map(|i| (i % 11) as f32 * 0.2 - 1.0).collect();
        (b[40], b[41]) = (first, second);
        blocks.push(b);
    }
    // A largest magnitude of 127 makes the scale 1: every multiple of 0.5 is a tie.
    blocks.push(
        (0..256)
            .map(|i| {
                if i == 0 {
                    -127.0
                } else {
                    (i % 255) as f32 * 0.5 - 63.0
                }
            })
            .collect(),
    );
    blocks.push((0..256).map(|i| (i as f32 - 128.0) * 3.4e36).collect());
    blocks.push((0..256).map(|i| (i as f32 - 100.0) * 1e-42).collect());
    let mut rng = 0x2545_f491_u32;
    for _ in 0..24 {
        blocks.push(
            (0..256)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    (rng % 20_001) as f32 / 10_000.0 - 1.0
                })
                .collect(),
        );
    }
    let x: Vec<f32> = blocks.concat();
    let want = kquant::quantize_row_q8k_portable(&x);
    let want_pairs = kquant::pair_order(&want.qs);
    for (got, name) in [
        (kquant::quantize_row_q8k(&x), "quantize_row_q8k"),
        (
            kquant::quantize_row_q8k_paired(&x),
            "quantize_row_q8k_paired",
        ),
    ] {
        let bits = |d: &[f32]| d.iter().map(|d| d.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.d), bits(&want.d), "{name}: scales");
        for (b, (got, want)) in got.qs.chunks(256).zip(want.qs.chunks(256)).enumerate() {
            assert_eq!(got, want, "{name}: bytes of super-block {b}");
        }
        assert_eq!(got.bsums, want.bsums, "{name}: sums of 16");
        assert_eq!(got.sums32, want.sums32, "{name}: sums of 32");
        if name.ends_with("paired") {
            assert_eq!(*got.paired, *want_pairs, "{name}: pair order");
        } else {
            assert!(got.paired.is_empty(), "{name}: no pair order asked for");
        }
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::detect().avx512().is_none() {
        tell!("AVX-512 Q8_K quantizer not checked: no AVX-512 tier here (the CPU lacks it or FERRITE_CPU_TIER caps it)");
    }
    #[cfg(not(target_arch = "x86_64"))]
    tell!("no vector Q8_K quantizer on this architecture: the portable loop is all");
}

#[test]
fn q8_k_bytes_start_on_a_cache_line_in_both_orders_and_in_copies() {
    // The tiles' 64-byte loads of activation bytes straddle two lines otherwise.
    for cols in [256, 2048, 5632] {
        let x: Vec<f32> = (0..cols).map(|i| ((i % 19) as f32 - 9.0) * 0.1).collect();
        let row = kquant::quantize_row_q8k_paired(&x);
        let copy = row.clone();
        for bytes in [&row.qs, &row.paired, &copy.qs, &copy.paired] {
            assert_eq!(bytes.as_ptr() as usize % 64, 0, "{cols} columns");
            assert_eq!(bytes.len(), cols);
        }
        assert_eq!(copy, row);
        // Pair order: each 64 bytes' sixteen 4-byte groups alternate between its two chunks.
        assert_eq!(
            &row.paired[..8],
            &[&row.qs[..4], &row.qs[32..36]].concat()[..]
        );
    }
}

#[test]
fn k_quant_tiles_give_every_pair_its_dot_product_bit_for_bit() {
    let features = cpu::detect();
    // Each tier's tile for a format, if this CPU has the tier.
    type TileFor = fn(KFormat) -> Option<PairTile<kquant::Q8KRow>>;
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    let mut tiers: Vec<(&str, TileFor)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        tiers.push(("best", |f| {
            kquant::tile::tile(cpu::detect(), f).map(|t| t.run)
        }));
        tiers.push(("avx512-vnni", |f| {
            cpu::detect()
                .avx512_vnni()
                .map(|cpu| kquant::vnni::tile(cpu, f))
        }));
        tiers.push(("avx512", |f| {
            cpu::detect()
                .avx512()
                .map(|cpu| kquant::tile::tile_avx512(cpu, f))
        }));
        tiers.push(("avx2", |f| {
            cpu::detect()
                .avx2()
                .map(|cpu| kquant::tile::tile_avx2(cpu, f))
        }));
        tiers.push(("avx-vnni", |f| {
            cpu::detect()
                .avx_vnni()
                .map(|cpu| kquant::tile::tile_avx_vnni(cpu, f))
        }));
    }
    #[cfg(target_arch = "aarch64")]
    {
        tiers.push(("neon", |f| {
            cpu::detect().neon().map(|cpu| kquant::neon::tile(cpu, f))
        }));
        tiers.push(("neon-dotprod", |f| {
            cpu::detect()
                .neon_dotprod()
                .map(|cpu| kquant::neon::tile(cpu, f))
        }));
    }
    if tiers.iter().all(|(_, tile)| tile(KFormat::Q4K).is_none()) {
        tell!(
            "K-quant tiles: no vector tier here ({}; the CPU lacks one or FERRITE_CPU_TIER caps it), only the pairwise path was checked",
            features.tiers().join(", ")
        );
    }
    let cols = 3 * kquant::QK_K;
    for ((format, name), extreme) in ggml::K_FORMATS
        .into_iter()
        .flat_map(|f| [(f, false), (f, true)])
    {
        // Extreme: every value byte 0xFF (each format's largest values and scales) against
        // activations of -127 and 127 (Q8_K's range), the largest integer sums a lane holds.
        // The four rows written at once, so each has its own f16 scales too.
        let w = match extreme {
            false => kquant_rows(format, 4, cols, 0),
            true => kquant_rows_of(format, 4, cols, |_| 0xFF),
        };
        let rows: Vec<&[u8]> = w.chunks_exact(w.len() / 4).collect();
        let quad = [rows[0], rows[1], rows[2], rows[3]];
        // 37 activation rows: more than one group of the tile's accumulators.
        let acts: Vec<kquant::Q8KRow> = (0..37)
            .map(|a| {
                let x: Vec<f32> = (0..cols)
                    .map(|i| match extreme {
                        false => {
                            (((i * 37 + a * 11) % 101) as f32 - 50.0) * 0.013 * (1 + a % 3) as f32
                        }
                        // Q8_K maps each super-block's first largest value to -127.
                        true if a % 2 == 0 || i % kquant::QK_K == 0 => -1.0,
                        true => 1.0,
                    })
                    .collect();
                // With its bytes in pair order too, for the AVX-512 VNNI tile.
                kquant::quantize_row_q8k_paired(&x)
            })
            .collect();
        if extreme {
            assert_eq!((acts[0].qs[1], acts[1].qs[1]), (-127, 127));
        }
        let want: Vec<[u32; 4]> = acts
            .iter()
            .map(|a| quad.map(|w| kquant::dot(format)(w, a).to_bits()))
            .collect();
        for (tier, tile) in &tiers {
            let Some(tile) = tile(format) else {
                tell!("{name}: no {tier} tile (not on this CPU, or none for the format)");
                continue;
            };
            for n in [1, 2, 5, 37] {
                let mut out = vec![[0f32; 4]; n];
                tile(quad, &acts[..n], &mut out);
                let got: Vec<[u32; 4]> = out.iter().map(|o| o.map(f32::to_bits)).collect();
                assert_eq!(
                    got,
                    want[..n],
                    "{name} {tier} tile of {n} (extreme values: {extreme})"
                );
            }
        }
    }
}

#[test]
fn k_quant_two_row_dot_products_give_each_row_its_one_row_dot_product() {
    let mut ran = Vec::new();
    // Three super-blocks, and 37 rows: a task's two halves leave one row over.
    let (rows, cols) = (37, 3 * kquant::QK_K);
    for ((format, name), extreme) in ggml::K_FORMATS
        .into_iter()
        .flat_map(|f| [(f, false), (f, true)])
    {
        // Extreme: every value byte 0xFF against activations of -127 and 127, as in the
        // tiles' test: the largest integer sums a lane holds.
        let w = match extreme {
            false => kquant_rows(format, rows, cols, 3),
            true => kquant_rows_of(format, rows, cols, |_| 0xFF),
        };
        let x: Vec<f32> = (0..cols)
            .map(|i| match extreme {
                false => ((i * 37 % 101) as f32 - 50.0) * 0.013,
                true if i % 3 == 0 => -1.0,
                true => 1.0,
            })
            .collect();
        // With the bytes doubled too, as the AVX-512 two-row dot product reads them.
        let a = kquant::quantize_row_q8k_doubled(&x);
        let row_bytes = cols / kquant::QK_K * format.block_bytes();
        let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
        let want: Vec<u32> = (0..rows)
            .map(|r| kquant::dot(format)(row(r), &a).to_bits())
            .collect();
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut dots: Vec<(&str, Dot2<kquant::Q8KRow>)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let f = cpu::detect();
            dots.extend(
                f.avx2()
                    .map(|cpu| ("avx2", kquant::avx2::dot2(cpu, format))),
            );
            dots.extend(
                f.avx512()
                    .map(|cpu| ("avx512", kquant::rows2::dot2(cpu, format))),
            );
        }
        for (tier, dot2) in dots {
            let what = format!("{name} {tier} (extreme values: {extreme})");
            assert_two_rows(&what, dot2, &row, &a, &want);
            ran.push(tier);
        }
        // The product of one activation row, whichever way this CPU pairs the rows.
        let mat = QuantMatrix::from_gguf(WeightFormat::K(format), rows, cols, &w).expect("sizes");
        let got: Vec<u32> = mat.matmul(&x).iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "{name}: one activation row (extreme values: {extreme})"
        );
    }
    if ran.is_empty() {
        tell!(
            "K-quant two-row dot products: none on this CPU's tiers ({})",
            cpu::detect().tiers().join(", ")
        );
    } else {
        say_checked("K-quant two-row dot products", &ran);
    }
}

#[test]
fn k_quant_products_give_every_row_its_single_row_result_in_any_batch() {
    // 38 weight rows: quads and rows outside any quad.
    let (rows, cols) = (38, 2 * kquant::QK_K);
    for (format, name) in ggml::K_FORMATS {
        let w = kquant_rows(format, rows, cols, 5);
        let mat = QuantMatrix::from_gguf(WeightFormat::K(format), rows, cols, &w).expect("sizes");
        let sizes = [2, 7, WEIGHT_PARALLEL_MAX_ROWS + 1, 70];
        assert_batches(&mat, &sizes, name, |x| mat.matmul(x).to_vec());
    }
}

#[test]
fn q5_products_give_every_row_its_dot_product_in_any_batch() {
    // 38 weight rows: quads and rows outside any quad; 3 blocks each.
    let (rows, cols) = (38, 3 * BLOCK);
    for (format, batched) in [
        (WeightFormat::Q5_0, Batched::Q5_0),
        (WeightFormat::Q5_1, Batched::Q5_1),
    ] {
        let w = block_rows(batched, rows, 3);
        let mat = QuantMatrix::from_gguf(format, rows, cols, &w).expect("sizes");
        let dot = portable_batched_dot(batched);
        let sizes = [2, 7, WEIGHT_PARALLEL_MAX_ROWS + 1, 70];
        assert_batches(&mat, &sizes, &format!("{format:?}"), |x| {
            let a = quantize_row(x, batched.mins());
            w.chunks_exact(3 * batched.block_bytes())
                .map(|r| dot(r, &a))
                .collect()
        });
    }
}
