//! `ferrite-engine bench`: prompt processing and single-stream decode speed, next to the
//! machine's memory bandwidth and the decode speed it allows.

use std::time::Instant;

use candle_core::Device;

use crate::cli::BenchArgs;
use crate::engine::{EngineConfig, EngineHandle, Event};
use crate::error::{Error, Result};
use crate::generate::generate;
use crate::kv::cache::SingleSequence;
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
        let mut cache = SingleSequence::new(model, KvDtype::Auto);
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
            &mut cache,
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
    println!("| threads | {} |", rayon::current_num_threads());
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

/// How the requests of a batching measurement arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrival {
    /// Every client sends one request at the same instant (the HTTP table's closed loop
    /// starts this way; with equal lengths the clients then stay in lockstep).
    Burst,
    /// Clients join one at a time, each when the previous one's first token arrives, and
    /// send `rounds` requests back to back: new prompts meet running decodes as in steady
    /// traffic rather than all at once.
    Staggered {
        /// Requests per client.
        rounds: usize,
    },
}

/// One batching measurement.
#[derive(Debug, Clone, Copy)]
struct Load {
    tokens_per_s: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    /// Unused share of the allocated slots at the first step of the peak allocation.
    waste_first: f64,
    /// The same, averaged over every step that held the peak allocation.
    waste_mean: f64,
}

impl Load {
    /// A table row: `label`, throughput and its ratio to `single`'s, TTFT (with
    /// `ttft_ratio`, also p90 over `single`'s), KV waste at the peak's first step and mean.
    fn row(&self, label: &str, single: &Load, ttft_ratio: bool) -> String {
        let ratio = if ttft_ratio {
            format!(" {:.2}× |", self.ttft_p90 / single.ttft_p90.max(1e-9))
        } else {
            String::new()
        };
        format!(
            "| {label} | {:.1} | {:.2}× | {:.2} s | {:.2} s |{ratio} {:.1} % / {:.1} % |",
            self.tokens_per_s,
            self.tokens_per_s / single.tokens_per_s.max(1e-9),
            self.ttft_p50,
            self.ttft_p90,
            100.0 * self.waste_first,
            100.0 * self.waste_mean
        )
    }
}

/// What one client saw: each request's time to first token (from its own submission) and
/// tokens received.
type ClientLog = Vec<(Option<f64>, usize)>;

fn run_load(
    path: &std::path::Path,
    config: EngineConfig,
    prompt: &[u32],
    clients: usize,
    arrival: Arrival,
    len: usize,
) -> Result<Load> {
    let loaded = crate::model::load(path, &Device::Cpu)?;
    let engine = EngineHandle::start(loaded, config)?;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(len)
    };
    let rounds = match arrival {
        Arrival::Burst => 1,
        Arrival::Staggered { rounds } => rounds.max(1),
    };
    // Client j + 1 starts when client j's first token arrives (staggered arrival only).
    let (go, wait): (Vec<_>, Vec<_>) = (0..clients).map(|_| std::sync::mpsc::channel()).unzip();
    let start = Instant::now();
    // A burst is submitted here, before any client thread starts, so the engine sees every
    // request at once; staggered clients submit their own.
    let mut first_streams = Vec::with_capacity(clients);
    for _ in 0..clients {
        first_streams.push(match arrival {
            Arrival::Burst => Some(engine.submit(prompt[..len].to_vec(), params.clone())?),
            Arrival::Staggered { .. } => None,
        });
    }
    let logs: Vec<Result<ClientLog>> = std::thread::scope(|s| {
        let handles: Vec<_> = wait
            .into_iter()
            .zip(first_streams)
            .enumerate()
            .map(|(j, (wait, mut submitted))| {
                let mut next = go.get(j + 1).cloned();
                let (engine, params, prompt) = (&engine, &params, &prompt[..len]);
                s.spawn(move || -> Result<ClientLog> {
                    if j > 0 && submitted.is_none() {
                        let _ = wait.recv();
                    }
                    let mut log = Vec::with_capacity(rounds);
                    for _ in 0..rounds {
                        let (sent, mut stream) = match submitted.take() {
                            Some(stream) => (start, stream),
                            None => (
                                Instant::now(),
                                engine.submit(prompt.to_vec(), params.clone())?,
                            ),
                        };
                        let (mut first, mut n) = (None, 0);
                        while let Some(ev) = stream.next_blocking() {
                            match ev {
                                Event::Token { .. } => {
                                    if first.is_none() {
                                        first = Some(sent.elapsed().as_secs_f64());
                                        if let Some(go) = next.take() {
                                            let _ = go.send(());
                                        }
                                    }
                                    n += 1;
                                }
                                Event::Finished(_) => break,
                            }
                        }
                        log.push((first, n));
                    }
                    // A request that produced no token must not hold the next client back.
                    if let Some(go) = next.take() {
                        let _ = go.send(());
                    }
                    Ok(log)
                })
            })
            .collect();
        drop(go);
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::InvalidParameter(
                        "a benchmark client panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for log in logs {
        all.extend(log?);
    }
    let mut t: Vec<f64> = all.iter().filter_map(|r| r.0).collect();
    t.sort_by(f64::total_cmp);
    let st = engine.stats();
    let peak = st.peak_allocated_slots.max(1) as f64;
    let mean_fill = st.filled_over_peak_steps as f64 / st.steps_at_peak.max(1) as f64;
    Ok(Load {
        tokens_per_s: all.iter().map(|r| r.1).sum::<usize>() as f64 / elapsed,
        ttft_p50: percentile(&t, 0.5),
        ttft_p90: percentile(&t, 0.9),
        waste_first: 1.0 - st.filled_at_peak as f64 / peak,
        waste_mean: 1.0 - mean_fill / peak,
    })
}

/// The engine configuration of the batching table.
fn load_config(len: usize) -> EngineConfig {
    // Every request sends the same prompt: prefix caching off, so each one is computed.
    EngineConfig {
        max_model_len: Some(4 * len),
        enable_prefix_caching: false,
        ..EngineConfig::default()
    }
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
    let base = load_config(len);
    let naive = match args.naive_requests {
        0 => None,
        n => Some(run_load(
            path,
            EngineConfig {
                max_num_seqs: 1,
                ..base.clone()
            },
            &prompt,
            n,
            Arrival::Burst,
            len,
        )?),
    };
    println!();
    println!("Continuous batching, {len}-token prompts and {len} output tokens each (greedy, prefix caching off), all requests sent at once:");
    println!();
    println!("| concurrent requests | output tok/s | × single | TTFT p50 | TTFT p90 | KV waste at peak (first step / mean) |");
    println!("|---|---|---|---|---|---|");
    // A row per concurrency, each against the first (single) run, which is returned.
    let table = |arrival: Arrival, ttft_ratio: bool| -> Result<Option<Load>> {
        let mut single = None;
        for &c in &args.concurrency {
            let r = run_load(path, base.clone(), &prompt, c.max(1), arrival, len)?;
            println!(
                "{}",
                r.row(&c.to_string(), single.get_or_insert(r), ttft_ratio)
            );
        }
        Ok(single)
    };
    let single = table(Arrival::Burst, false)?;
    if let Some(naive) = naive {
        let label = format!("naive: {} requests, --max-num-seqs 1", args.naive_requests);
        println!("{}", naive.row(&label, &single.unwrap_or(naive), false));
    }
    if args.rounds == 0 {
        return Ok(());
    }
    println!();
    println!(
        "Steady traffic: clients join one at a time (each when the previous one's first token arrives) and send {} requests each back to back; TTFT from each request's submission:",
        args.rounds
    );
    println!();
    println!("| clients | output tok/s | × single | TTFT p50 | TTFT p90 | TTFT p90 / single's | KV waste at peak (first step / mean) |");
    println!("|---|---|---|---|---|---|---|");
    table(
        Arrival::Staggered {
            rounds: args.rounds,
        },
        true,
    )?;
    Ok(())
}

/// The nearest-rank `p`-quantile of sorted values (0 when empty).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0)
}
