//! `ferrite-engine bench`: prompt processing and single-stream decode speed, next to the
//! machine's memory bandwidth and the decode speed it allows.

use std::time::Instant;

use candle_core::Device;

use crate::cli::BenchArgs;
use crate::engine::{EngineConfig, EngineHandle, Event};
use crate::error::{Error, Result};
use crate::generate::generate;
use crate::model::llama::{Batch, KvDtype, SeqSlice};
use crate::sampling::SamplingParams;

/// Text that prompts are cut from (public domain: the opening of *Moby-Dick*).
const TEXT: &str = "Call me Ishmael. Some years ago, never mind how long precisely, having little or \
no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen and \
regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is a \
damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin \
warehouses, and bringing up the rear of every funeral I meet; then, I account it high time to get to \
sea as soon as I can. ";

/// Bytes per second of a multi-threaded copy of a buffer much larger than the caches,
/// counting both the bytes read and the bytes written.
pub fn memory_bandwidth() -> f64 {
    const LEN: usize = 256 << 20;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let src = vec![1u8; LEN];
    let mut dst = vec![0u8; LEN];
    let chunk = LEN.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, sr) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(sr));
            }
        });
        best = best.max(2.0 * LEN as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    best
}

/// Runs the benchmark and prints a markdown table.
pub fn run(args: &BenchArgs) -> Result<()> {
    let loaded = crate::model::load(&args.model.model, &Device::Cpu)?;
    let model = &loaded.model;
    let mut text = String::new();
    while loaded.tokenizer.encode(&text, false)?.len() < args.prompt_tokens {
        text.push_str(TEXT);
    }
    let mut prompt = loaded.tokenizer.encode(&text, false)?;
    prompt.truncate(args.prompt_tokens);
    if prompt.len() + args.decode_tokens > model.config().max_position_embeddings {
        return Err(Error::InvalidParameter(format!(
            "--prompt-tokens {} + --decode-tokens {} exceed the context length {}",
            args.prompt_tokens,
            args.decode_tokens,
            model.config().max_position_embeddings
        )));
    }
    let repeat = args.repeat.max(1);
    let mut pp_best = 0.0f64;
    for _ in 0..repeat {
        let mut cache = model.new_cache(1, KvDtype::Auto);
        let positions: Vec<usize> = (0..prompt.len()).collect();
        let seqs = [SeqSlice {
            start: 0,
            len: prompt.len(),
            cache_slot: 0,
        }];
        let t = Instant::now();
        model.forward(
            &Batch {
                tokens: &prompt,
                positions: &positions,
                seqs: &seqs,
            },
            cache.as_mut(),
        )?;
        pp_best = pp_best.max(prompt.len() as f64 / t.elapsed().as_secs_f64());
    }
    let mut decode_best = 0.0f64;
    let short = &prompt[..16.min(prompt.len())];
    for _ in 0..repeat {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(args.decode_tokens + 1)
        };
        let g = generate(&loaded, short, params, |_| {})?;
        decode_best = decode_best.max((g.tokens.len() - 1) as f64 / g.decode_seconds.max(1e-9));
    }
    let bw = memory_bandwidth();
    let bytes = model.weight_bytes_per_token() as f64;
    let bound = bw / bytes;
    println!("| figure | value |");
    println!("|---|---|");
    println!("| model | {} |", loaded.path.display());
    println!(
        "| threads | {} |",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!(
        "| prompt processing ({} tokens) | {pp_best:.1} tok/s |",
        prompt.len()
    );
    println!(
        "| single-stream decode ({} tokens) | {decode_best:.1} tok/s |",
        args.decode_tokens
    );
    println!(
        "| memory bandwidth (copy, read+write) | {:.1} GB/s |",
        bw / 1e9
    );
    println!("| weights read per token | {:.1} MB |", bytes / 1e6);
    println!("| decode bound (bandwidth / weights) | {bound:.1} tok/s |");
    println!("| decode / bound | {:.0} % |", 100.0 * decode_best / bound);
    if !args.concurrency.is_empty() {
        batching(args, prompt)?;
    }
    Ok(())
}

/// One batching measurement: `requests` requests of `len` prompt and `len` output tokens,
/// at most `concurrency` in flight.
struct Load {
    tokens_per_s: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    waste: f64,
}

fn run_load(
    path: &std::path::Path,
    config: EngineConfig,
    prompt: &[u32],
    requests: usize,
    concurrency: usize,
    len: usize,
) -> Result<Load> {
    let loaded = crate::model::load(path, &Device::Cpu)?;
    let engine = EngineHandle::start(loaded, config)?;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(len)
    };
    let start = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let ttfts = std::sync::Mutex::new(Vec::new());
    let generated = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..concurrency {
            s.spawn(|| {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                    let submitted = Instant::now();
                    let Ok(mut stream) = engine.submit(prompt[..len].to_vec(), params.clone())
                    else {
                        return;
                    };
                    let mut first = None;
                    while let Some(ev) = stream.next_blocking() {
                        match ev {
                            Event::Token { .. } => {
                                first.get_or_insert_with(|| submitted.elapsed().as_secs_f64());
                                generated.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Event::Finished(_) => break,
                        }
                    }
                    if let (Some(t), Ok(mut v)) = (first, ttfts.lock()) {
                        v.push(t);
                    }
                }
            });
        }
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut t = ttfts.into_inner().unwrap_or_default();
    t.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        t.get(((t.len() as f64 * p).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };
    let st = engine.stats();
    Ok(Load {
        tokens_per_s: generated.into_inner() as f64 / elapsed,
        ttft_p50: pct(0.5),
        ttft_p90: pct(0.9),
        waste: 1.0 - st.filled_at_peak as f64 / st.peak_allocated_slots.max(1) as f64,
    })
}

fn batching(args: &BenchArgs, mut prompt: Vec<u32>) -> Result<()> {
    let len = args.request_tokens;
    prompt.truncate(len);
    if prompt.len() < len {
        return Err(Error::InvalidParameter(format!(
            "--request-tokens {len} is longer than the benchmark prompt"
        )));
    }
    let path = &args.model.model;
    let base = EngineConfig {
        max_model_len: Some(4 * len),
        ..EngineConfig::default()
    };
    let naive = run_load(
        path,
        EngineConfig {
            max_num_seqs: 1,
            ..base.clone()
        },
        &prompt,
        args.naive_requests,
        args.naive_requests,
        len,
    )?;
    println!();
    println!("Continuous batching, {len}-token prompts and {len} output tokens each (greedy, prefix caching off):");
    println!();
    println!("| concurrent requests | output tok/s | × single | TTFT p50 | TTFT p90 | KV waste at peak |");
    println!("|---|---|---|---|---|---|");
    let mut single = None;
    for &c in &args.concurrency {
        let r = run_load(path, base.clone(), &prompt, c.max(1), c.max(1), len)?;
        let one = *single.get_or_insert(r.tokens_per_s);
        println!(
            "| {c} | {:.1} | {:.2}× | {:.2} s | {:.2} s | {:.1} % |",
            r.tokens_per_s,
            r.tokens_per_s / one,
            r.ttft_p50,
            r.ttft_p90,
            100.0 * r.waste
        );
    }
    println!(
        "| naive: {} requests, --max-num-seqs 1 | {:.1} | {:.2}× | {:.2} s | {:.2} s | {:.1} % |",
        args.naive_requests,
        naive.tokens_per_s,
        naive.tokens_per_s / single.unwrap_or(naive.tokens_per_s),
        naive.ttft_p50,
        naive.ttft_p90,
        100.0 * naive.waste
    );
    Ok(())
}
