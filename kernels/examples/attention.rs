//! Times one layer's attention over a prompt, the pass a prefill runs per layer, on an f16
//! cache and a pool of its own, so a change to a head kernel can be measured without a
//! model: `cargo run --release -p ferrite-kernels --example attention -- TOKENS [THREADS]`
//! (TOKENS the prompt's length, THREADS 1 unless given). The shape is the ~1B benchmark
//! model's (32 query heads of 64 values over 8 KV heads, blocks of 16 positions); queries,
//! keys and values are random, so the scores spread as a trained model's do not, but every
//! position is read and every exponential computed as for real ones. The best of five
//! passes is printed, in milliseconds and in (query head, position) pairs per second.

mod common;

use std::hint::black_box;
use std::process::ExitCode;

use common::{best_of_five, whole, Xorshift};
use ferrite_kernels::attention::{paged_attention_batch, HeadShape, KvBlocks, SeqKv};
use half::f16;

/// The ~1B benchmark model's attention.
const SHAPE: HeadShape = HeadShape {
    heads: 32,
    kv_heads: 8,
    head_dim: 64,
};

/// Positions per cache block, as the engine's default.
const BLOCK: usize = 16;

fn main() -> ExitCode {
    common::main_with(
        "attention",
        || "TOKENS [THREADS]; both whole numbers from 1".into(),
        run,
    )
}

fn run(args: Vec<String>) -> Result<String, String> {
    let [tokens, rest @ ..] = args.as_slice() else {
        return Err("TOKENS is required".into());
    };
    let tokens = whole("TOKENS", tokens)?;
    let threads = rest.first().map_or(Ok(1), |t| whole("THREADS", t))?;
    let HeadShape {
        heads,
        kv_heads,
        head_dim: d,
    } = SHAPE;
    let mut random = Xorshift::new();
    let block_len = BLOCK * kv_heads * d;
    let mut cache = || -> Vec<Vec<f16>> {
        (0..tokens.div_ceil(BLOCK))
            .map(|_| {
                (0..block_len)
                    .map(|_| f16::from_f32(random.unit()))
                    .collect()
            })
            .collect()
    };
    let (keys, values) = (cache(), cache());
    let q: Vec<f32> = (0..tokens * heads * d)
        .map(|_| 2.0 * random.unit())
        .collect();
    let positions: Vec<usize> = (0..tokens).collect();
    let key_blocks: Vec<&[f16]> = keys.iter().map(Vec::as_slice).collect();
    let value_blocks: Vec<&[f16]> = values.iter().map(Vec::as_slice).collect();
    let seq = SeqKv {
        keys: KvBlocks {
            blocks: &key_blocks,
            block_size: BLOCK,
        },
        values: KvBlocks {
            blocks: &value_blocks,
            block_size: BLOCK,
        },
        tokens,
    };
    let mut out = vec![0f32; q.len()];
    let best = best_of_five(threads, || {
        paged_attention_batch(black_box(&q), &positions, &[seq], SHAPE, &mut out);
        black_box(&out);
    })?;
    let pairs = heads * tokens * (tokens + 1) / 2;
    Ok(format!(
        "{tokens} tokens, {heads} heads of {d} over {kv_heads}, {threads} thread(s): {:.2} ms, {:.0} M pairs/s",
        best * 1e3,
        pairs as f64 / best / 1e6,
    ))
}
