//! Times one weight matrix against one activation row, the product a decode step runs, in
//! one block format on a pool of its own, so a change to a dot product can be measured
//! without a model: `cargo run --release -p ferrite-kernels --example matvec -- FORMAT KIB
//! [THREADS [ROWS]]` (FORMAT one of the names below, KIB the matrix's size in KiB, of
//! 2048-value rows; THREADS 1 unless given; ROWS activation rows, 1 unless given: a
//! prefill's product, on the batch kernels, at hundreds). A matrix of a few hundred KiB stays
//! in a core's L2, one of hundreds of MiB streams from memory. Quantized weights are random
//! bytes, their f16 scales included: x86 float units take a slow path for denormal numbers
//! only, which f16 scales do not make in f32, not for the infinities and NaNs some random
//! scales are (on a Zen 5 every format here timed the same as with the scales set to 1.0 and
//! 0.5). Float weights are random values in [-1, 1). The best of five rounds of products is
//! printed, as GB/s of weights, nanoseconds per block and multiply-adds per second.

mod common;

use std::hint::black_box;
use std::process::ExitCode;

use common::{best_of_five, whole, Xorshift};
use ferrite_kernels::quant::{quantize, FloatFormat, QuantMatrix, WeightFormat};
use half::{bf16, f16};

/// The formats this example times ([`WeightFormat::name`] names them): every block format,
/// then the float ones.
fn formats() -> impl Iterator<Item = WeightFormat> {
    let floats = [FloatFormat::F16, FloatFormat::BF16, FloatFormat::F32];
    quantize::QUANTIZABLE
        .into_iter()
        .chain(floats.map(WeightFormat::Float))
}

/// The width of every row: the hidden size of the ~1B models the benchmarks use.
const COLS: usize = 2048;

fn main() -> ExitCode {
    let names: Vec<&str> = formats().map(WeightFormat::name).collect();
    common::main_with(
        "matvec",
        || {
            format!(
                "FORMAT KIB [THREADS [ROWS]]; FORMAT one of {}, KIB, THREADS and ROWS whole numbers from 1",
                names.join(", ")
            )
        },
        run,
    )
}

fn run(args: Vec<String>) -> Result<String, String> {
    let [name, kib, rest @ ..] = args.as_slice() else {
        return Err("FORMAT and KIB are required".into());
    };
    let format = formats()
        .find(|f| f.name() == name.as_str())
        .ok_or_else(|| format!("unknown format {name:?}"))?;
    let kib = whole("KIB", kib)?;
    let threads = rest.first().map_or(Ok(1), |t| whole("THREADS", t))?;
    let acts = rest.get(1).map_or(Ok(1), |m| whole("ROWS", m))?;
    let row_bytes = COLS / format.block_values() * format.block_bytes();
    let rows = ((kib << 10) / row_bytes).max(1);
    let bytes = match format {
        WeightFormat::Float(f) => random_floats(f, rows * COLS),
        _ => random_bytes(rows * row_bytes),
    };
    let matrix = QuantMatrix::from_gguf_vec(format, rows, COLS, bytes)
        .ok_or("the matrix's bytes do not fit its shape")?;
    let x: Vec<f32> = (0..acts * COLS)
        .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
        .collect();
    // About 2 GiB of weights read per round (as many bytes met by each activation row),
    // at least three products.
    let reps = ((2usize << 30) / (rows * row_bytes * acts)).max(3);
    let best = best_of_five(threads, || {
        for _ in 0..reps {
            black_box(matrix.matmul(black_box(&x)));
        }
    })? / reps as f64;
    let blocks = rows * COLS / format.block_values();
    Ok(format!(
        "{name}: {rows} rows of {COLS} ({} KiB) x {acts} activation row(s), {threads} thread(s): {:.1} GB/s, {:.2} ns per block, {:.1} G multiply-adds/s",
        (rows * row_bytes) >> 10,
        (rows * row_bytes) as f64 / best / 1e9,
        best * 1e9 / blocks as f64,
        (rows * COLS * acts) as f64 / best / 1e9,
    ))
}

/// `len` bytes from a fixed xorshift sequence.
fn random_bytes(len: usize) -> Vec<u8> {
    let mut random = Xorshift::new();
    (0..len).map(|_| random.next_u64() as u8).collect()
}

/// `len` values uniform in [-1, 1), stored as `format`: random bytes would make BF16
/// subnormals, which x86 float units take a slow path for.
fn random_floats(format: FloatFormat, len: usize) -> Vec<u8> {
    let mut random = Xorshift::new();
    let mut out = Vec::with_capacity(len * format.bytes());
    for _ in 0..len {
        let v = random.unit();
        match format {
            FloatFormat::F32 => out.extend_from_slice(&v.to_le_bytes()),
            FloatFormat::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            FloatFormat::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}
