//! `ferrite-engine bench`: prompt processing and single-stream decode speed, next to the
//! machine's memory bandwidth and the decode speed its read bandwidth allows.

use rayon::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Device;
use ferrite_engine::engine::{EngineConfig, EngineHandle, Event, StepObserver, StepView};
use ferrite_engine::error::{ConfigError, Error, Result};
use ferrite_engine::kv::cache::SingleSequence;
use ferrite_engine::kv::KvDtype;
use ferrite_engine::model::llama::Llama;
use ferrite_engine::model::LoadedModel;
use ferrite_engine::reference::generate;
use ferrite_engine::sampling::SamplingParams;
use ferrite_kernels::hugepages::HugePages;
use ferrite_util::percentile;

use crate::cli::{BenchArgs, ModelArgs};

/// Text that prompts are cut from (public domain: the opening of *Moby-Dick*).
const TEXT: &str = "Call me Ishmael. Some years ago, never mind how long precisely, having little or \
no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen and \
regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is a \
damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin \
warehouses, and bringing up the rear of every funeral I meet; then, I account it high time to get to \
sea as soon as I can. ";

/// Bytes of each buffer the bandwidth measurements stream: far larger than any cache.
const BANDWIDTH_BYTES: usize = 256 << 20;

/// The machine's memory bandwidth, in bytes per second, each the best of five runs over
/// [`BANDWIDTH_BYTES`] split among the threads.
#[derive(Debug, Clone, Copy)]
pub struct Bandwidth {
    /// Reading alone (a sum of every word): what a decode step does with its weights, so
    /// the decode bound divides this one.
    pub read: f64,
    /// A copy, counting both the bytes read and the bytes written.
    pub copy: f64,
}

/// Measures [`Bandwidth`] on the thread pool the model runs on, one part per thread. The
/// buffer both measurements read lies in huge pages, as the model's weights do
/// ([`HugePages`]), so the read figure is what the weights' own reads could reach. Threads
/// of their own would share the cores with the pool's, which keep spinning a while after
/// each step: on a 2-core VM right after decoding, 44 GB/s against 70–79 on the pool.
pub fn memory_bandwidth() -> Bandwidth {
    let chunk = BANDWIDTH_BYTES.div_ceil(rayon::current_num_threads());
    let (src, _) = HugePages::pack(vec![vec![1u8; BANDWIDTH_BYTES]]);
    // Not zero, so every page is written before the runs and no run pays for its first touch.
    let mut dst = vec![2u8; BANDWIDTH_BYTES];
    let best = |run: &mut dyn FnMut()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let read = best(&mut || {
        src.par_chunks(chunk).for_each(|part| {
            std::hint::black_box(sum_words(part));
        })
    });
    let copy = best(&mut || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s))
    });
    std::hint::black_box(&dst);
    Bandwidth {
        read: BANDWIDTH_BYTES as f64 / read,
        copy: 2.0 * BANDWIDTH_BYTES as f64 / copy,
    }
}

/// The wrapping sum of `bytes` read as little-endian 64-bit words (a trailing part word
/// left out): one plain reduction, which the compiler turns into wide vector loads and adds
/// that keep up with memory.
fn sum_words(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .fold(0u64, u64::wrapping_add)
}

/// Runs the benchmark and prints a markdown table.
pub fn run(args: &BenchArgs) -> Result<()> {
    let loaded = load(&args.model)?;
    let model = &loaded.model;
    let mut text = String::new();
    while loaded.tokenizer.encode(&text, false)?.len() < args.prompt_tokens {
        text.push_str(TEXT);
    }
    let mut prompt = loaded.tokenizer.encode(&text, false)?;
    prompt.truncate(args.prompt_tokens);
    if prompt.len() + args.decode_tokens > model.config().max_position_embeddings {
        return Err(ConfigError::Input {
            what: format!(
                "--prompt-tokens {} + --decode-tokens {}",
                args.prompt_tokens, args.decode_tokens
            ),
            message: format!(
                "exceed the context length {}",
                model.config().max_position_embeddings
            ),
        }
        .into());
    }
    let repeat = args.repeat.max(1);
    let mut pp_best = 0.0f64;
    for _ in 0..repeat {
        let mut cache = SingleSequence::new(model, KvDtype::Auto);
        let t = Instant::now();
        cache.forward(model, &prompt)?;
        pp_best = pp_best.max(prompt.len() as f64 / t.elapsed().as_secs_f64());
    }
    let mut decode_best = 0.0f64;
    let short = &prompt[..16.min(prompt.len())];
    // The bound divides the best bandwidth measured right before and right after each
    // decode run: a shared machine's bandwidth drifts (a VM's plain read went from 44 to 79
    // GB/s within minutes), and one measurement on a slow phase after decoding on a fast one
    // put decode at 132 % of its "bound"; measured only after, a run still showed 113 %.
    let mut bw = Bandwidth {
        read: 0.0,
        copy: 0.0,
    };
    let mut measure_bandwidth = || {
        let now = memory_bandwidth();
        bw.read = bw.read.max(now.read);
        bw.copy = bw.copy.max(now.copy);
    };
    for _ in 0..repeat {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(args.decode_tokens + 1)
        };
        measure_bandwidth();
        let g = generate(&loaded, short, params, |_| {})?;
        decode_best = decode_best.max((g.tokens.len() - 1) as f64 / g.decode_seconds.max(1e-9));
        measure_bandwidth();
    }
    let bytes = model.weight_bytes_per_token() as f64;
    let bound = bw.read / bytes;
    println!("| figure | value |");
    println!("|---|---|");
    println!("| model | {} |", loaded.path.display());
    println!("| CPU | {} |", ferrite_kernels::cpu::model_name());
    println!(
        "| kernel tiers | {} |",
        ferrite_kernels::cpu::detect().tiers().join(", ")
    );
    println!(
        "| 32-value batch kernel | {} |",
        ferrite_kernels::cpu::full_width_512_words(ferrite_kernels::cpu::full_width_512())
    );
    println!("| threads | {} |", rayon::current_num_threads());
    println!(
        "| prompt processing ({} tokens) | {pp_best:.1} tok/s |",
        prompt.len()
    );
    println!(
        "| single-stream decode ({} tokens) | {decode_best:.1} tok/s |",
        args.decode_tokens
    );
    println!("| memory bandwidth (read) | {:.1} GB/s |", bw.read / 1e9);
    println!(
        "| memory bandwidth (copy, read+write) | {:.1} GB/s |",
        bw.copy / 1e9
    );
    println!("| weights read per token | {:.1} MB |", bytes / 1e6);
    println!("| decode bound (read bandwidth / weights) | {bound:.1} tok/s |");
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
#[derive(Debug, Clone, Copy, Default)]
struct Load {
    tokens_per_s: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    /// Unused share of the allocated slots at the first step of the peak allocation.
    waste_first: f64,
    /// The same, averaged over every step that held the peak allocation.
    waste_mean: f64,
    /// For a burst, its prompt and decode phases. Steady traffic has no such split: new
    /// prompts keep arriving until its end.
    burst: Option<Phases>,
    /// Seconds the model's weight products alone take on as many rows as the load has
    /// clients, timed right after the load (so on the same phase of a shared machine), where
    /// its setup asks for it.
    products_s: Option<f64>,
}

/// A burst split at the last request's first token. Once every prompt has been prefilled,
/// every step only decodes, so the decode phase is what batching does to decoding alone;
/// the whole-run figure also carries the prompts' processing.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Phases {
    /// Seconds from the start to the last request's first token.
    prompts_s: f64,
    /// Tokens that arrived after it.
    decode_tokens: usize,
    /// Seconds from it to the end.
    decode_s: f64,
}

impl Phases {
    /// Output tokens/s of the decode phase (0 when no token came in it).
    fn decode_per_s(&self) -> f64 {
        match self.decode_tokens {
            0 => 0.0,
            n => n as f64 / self.decode_s.max(1e-9),
        }
    }
}

/// Which optional columns a table row has.
#[derive(Debug, Clone, Copy, Default)]
struct Columns {
    /// With more than one round, the lowest and highest of the rounds' own ratios.
    range: bool,
    /// TTFT p90 over the median single run's.
    ttft_ratio: bool,
}

impl Load {
    /// A table row for `label` from its runs (one per round) against `single`'s runs of the
    /// same rounds: the median run's throughput and the ratio of the two medians, its TTFT,
    /// the `columns` asked for, and its KV waste at the peak's first step and mean.
    fn row(label: &str, runs: &[Load], single: &[Load], columns: Columns) -> String {
        let Columns { range, ttft_ratio } = columns;
        let (this, one) = (Load::median(runs), Load::median(single));
        // The decode phase of a burst, from the same (median) runs.
        let decode = match (this.burst, one.burst) {
            (Some(b), Some(o)) => {
                let (d, o) = (b.decode_per_s(), o.decode_per_s());
                format!(" {d:.1} ({:.2}×) |", d / o.max(1e-9))
            }
            _ => String::new(),
        };
        let per_round = |l: &Load, s: &Load| l.tokens_per_s / s.tokens_per_s.max(1e-9);
        let spread = if range && runs.len() > 1 {
            let ratios: Vec<f64> = runs
                .iter()
                .zip(single)
                .map(|(l, s)| per_round(l, s))
                .collect();
            let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!(" ({low:.2}–{high:.2})")
        } else {
            String::new()
        };
        let ratio = if ttft_ratio {
            format!(" {:.2}× |", this.ttft_p90 / one.ttft_p90.max(1e-9))
        } else {
            String::new()
        };
        format!(
            "| {label} | {:.1} | {:.2}×{spread} | {:.2} s | {:.2} s |{ratio}{decode} {:.1} % / {:.1} % |",
            this.tokens_per_s,
            per_round(&this, &one),
            this.ttft_p50,
            this.ttft_p90,
            100.0 * this.waste_first,
            100.0 * this.waste_mean
        )
    }

    /// The run with the median throughput (of an even count, the lower of the middle two;
    /// of none, an all-zero run).
    fn median(runs: &[Load]) -> Load {
        let mut sorted = runs.to_vec();
        sorted.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
        sorted
            .get(sorted.len().saturating_sub(1) / 2)
            .copied()
            .unwrap_or_default()
    }
}

/// One load of a batching table: the engine configuration, clients and arrival.
struct Setup {
    config: EngineConfig,
    clients: usize,
    arrival: Arrival,
    /// Whether to time the weight products on `clients` rows after each run.
    time_products: bool,
}

/// Runs every setup `rounds` times, each round running each setup once in turn, so that
/// the slow and fast phases of a shared machine fall on every row alike; returns each
/// setup's runs in round order.
/// The model `args` name, loaded as they say.
fn load(args: &ModelArgs) -> Result<LoadedModel> {
    ferrite_engine::model::load_with(&args.model, &Device::Cpu, &args.load.options())
}

fn measure(
    model_args: &ModelArgs,
    prompt: &[u32],
    setups: &[Setup],
    rounds: usize,
) -> Result<Vec<Vec<Load>>> {
    let mut runs = vec![Vec::with_capacity(rounds); setups.len()];
    // The model whose products are timed (the engine of each run loads its own).
    let timed = setups.iter().any(|s| s.time_products);
    let model = timed.then(|| load(model_args)).transpose()?;
    for _ in 0..rounds.max(1) {
        for (s, runs) in setups.iter().zip(&mut runs) {
            let (config, len) = (s.config.clone(), prompt.len());
            let mut load = run_load(model_args, config, prompt, s.clients, s.arrival, len)?;
            if let (true, Some(loaded)) = (s.time_products, &model) {
                load.products_s = Some(time_products(&loaded.model, s.clients)?);
            }
            runs.push(load);
        }
    }
    Ok(runs)
}

/// What one client saw of one request.
struct Received {
    /// Time to first token, from the request's own submission.
    ttft: Option<f64>,
    /// When each token arrived, in seconds from the start of the load.
    arrivals: Vec<f64>,
}

/// A burst of `requests` that ended at `elapsed`, split at the last request's first token.
fn phases(requests: &[Received], elapsed: f64) -> Phases {
    let last_first = requests
        .iter()
        .filter_map(|r| r.arrivals.first().copied())
        .fold(0.0, f64::max);
    let later = requests
        .iter()
        .flat_map(|r| &r.arrivals)
        .filter(|&&t| t > last_first)
        .count();
    Phases {
        prompts_s: last_first,
        decode_tokens: later,
        decode_s: elapsed - last_first,
    }
}

fn run_load(
    model_args: &ModelArgs,
    config: EngineConfig,
    prompt: &[u32],
    clients: usize,
    arrival: Arrival,
    len: usize,
) -> Result<Load> {
    let loaded = load(model_args)?;
    let fill = Arc::new(Mutex::new(PeakFill::default()));
    let watch = Box::new(WatchFill(Arc::clone(&fill)));
    let engine = EngineHandle::start_observed(loaded, config, Some(watch))?;
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
    let logs: Vec<Result<Vec<Received>>> = std::thread::scope(|s| {
        let handles: Vec<_> = wait
            .into_iter()
            .zip(first_streams)
            .enumerate()
            .map(|(j, (wait, mut submitted))| {
                let mut next = go.get(j + 1).cloned();
                let (engine, params, prompt) = (&engine, &params, &prompt[..len]);
                s.spawn(move || -> Result<Vec<Received>> {
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
                        let (mut ttft, mut arrivals) = (None, Vec::with_capacity(len));
                        while let Some(ev) = stream.next_blocking() {
                            match ev {
                                Event::Token { .. } => {
                                    if ttft.is_none() {
                                        ttft = Some(sent.elapsed().as_secs_f64());
                                        if let Some(go) = next.take() {
                                            let _ = go.send(());
                                        }
                                    }
                                    arrivals.push(start.elapsed().as_secs_f64());
                                }
                                // Not asked for here.
                                Event::PromptLogprobs(_) => {}
                                Event::Finished(_) => break,
                            }
                        }
                        log.push(Received { ttft, arrivals });
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
                h.join()
                    .unwrap_or_else(|_| Err(Error::internal("a benchmark client panicked")))
            })
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for log in logs {
        all.extend(log?);
    }
    let mut t: Vec<f64> = all.iter().filter_map(|r| r.ttft).collect();
    t.sort_by(f64::total_cmp);
    drop(engine);
    let st = fill.lock().map(|f| *f).unwrap_or_default();
    let peak = st.peak_allocated_slots.max(1) as f64;
    let mean_fill = st.filled_over_peak_steps as f64 / st.steps_at_peak.max(1) as f64;
    Ok(Load {
        tokens_per_s: all.iter().map(|r| r.arrivals.len()).sum::<usize>() as f64 / elapsed,
        ttft_p50: percentile(&t, 0.5),
        ttft_p90: percentile(&t, 0.9),
        waste_first: 1.0 - st.filled_at_peak as f64 / peak,
        waste_mean: 1.0 - mean_fill / peak,
        burst: (arrival == Arrival::Burst).then(|| phases(&all, elapsed)),
        products_s: None,
    })
}

/// The KV cache's fill at its peak allocation, as the engine's steps left it.
#[derive(Debug, Clone, Copy, Default)]
struct PeakFill {
    /// Most cache slots the running sequences held at once (blocks × block size).
    peak_allocated_slots: usize,
    /// Slots holding a token at the first step that reached that peak (the emptiest moment
    /// of the peak: new blocks have just been taken).
    filled_at_peak: usize,
    /// Steps that ended holding the peak number of slots.
    steps_at_peak: u64,
    /// Slots holding a token, summed over those steps.
    filled_over_peak_steps: u64,
}

/// Keeps a [`PeakFill`] up to date from each step.
struct WatchFill(Arc<Mutex<PeakFill>>);

impl PeakFill {
    /// Takes one step's slots held and filled.
    fn record(&mut self, allocated: usize, filled: usize) {
        if allocated > self.peak_allocated_slots {
            *self = PeakFill {
                peak_allocated_slots: allocated,
                filled_at_peak: filled,
                steps_at_peak: 1,
                filled_over_peak_steps: filled as u64,
            };
        } else if allocated == self.peak_allocated_slots && allocated > 0 {
            self.steps_at_peak += 1;
            self.filled_over_peak_steps += filled as u64;
        }
    }
}

impl StepObserver for WatchFill {
    fn after_step(&mut self, view: &StepView<'_>) {
        if let Ok(mut st) = self.0.lock() {
            st.record(view.allocated_slots(), view.filled_slots());
        }
    }
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
        return Err(ConfigError::Input {
            what: format!("--request-tokens {len}"),
            message: "is longer than the benchmark prompt".into(),
        }
        .into());
    }
    let base = load_config(len);
    let rounds = args.repeat.max(1);
    // A load per concurrency, every one against the engine configured as `base`.
    let per_concurrency = |arrival: Arrival| -> Vec<Setup> {
        args.concurrency
            .iter()
            .map(|&c| Setup {
                config: base.clone(),
                clients: c.max(1),
                arrival,
                time_products: arrival == Arrival::Burst,
            })
            .collect()
    };
    let mut burst = per_concurrency(Arrival::Burst);
    if args.naive_requests > 0 {
        burst.push(Setup {
            config: EngineConfig {
                max_num_seqs: 1,
                ..base.clone()
            },
            clients: args.naive_requests,
            arrival: Arrival::Burst,
            time_products: false,
        });
    }
    let runs = measure(&args.model, &prompt, &burst, rounds)?;
    let median_note = if rounds > 1 {
        format!(" Each figure is the median of {rounds} rounds, each round running every row once in turn; × single is the ratio of the medians, with the lowest and highest of the rounds' own ratios in brackets.")
    } else {
        String::new()
    };
    println!();
    println!("Continuous batching, {len}-token prompts and {len} output tokens each (greedy, prefix caching off), all requests sent at once.{median_note} The decode phase counts the tokens that arrived after the last request's first token, over the time since then: by then every prompt has been processed and the steps only decode.");
    println!();
    println!("| concurrent requests | output tok/s | × single | TTFT p50 | TTFT p90 | decode phase tok/s (× single's) | KV waste at peak (first step / mean) |");
    println!("|---|---|---|---|---|---|---|");
    let Some(single) = print_rows(&args.concurrency, &runs, false) else {
        return Ok(());
    };
    if let Some(naive) = runs.get(args.concurrency.len()) {
        let label = format!("naive: {} requests, --max-num-seqs 1", args.naive_requests);
        println!(
            "{}",
            Load::row(
                &label,
                naive,
                single,
                Columns {
                    range: true,
                    ttft_ratio: false
                }
            )
        );
    }
    products_table(&args.concurrency, &runs);
    if args.rounds == 0 {
        return Ok(());
    }
    let steady = per_concurrency(Arrival::Staggered {
        rounds: args.rounds,
    });
    let runs = measure(&args.model, &prompt, &steady, rounds)?;
    println!();
    println!(
        "Steady traffic: clients join one at a time (each when the previous one's first token arrives) and send {} requests each back to back; TTFT from each request's submission.{median_note}",
        args.rounds
    );
    println!();
    println!("| clients | output tok/s | × single | TTFT p50 | TTFT p90 | TTFT p90 / single's | KV waste at peak (first step / mean) |");
    println!("|---|---|---|---|---|---|---|");
    print_rows(&args.concurrency, &runs, true);
    Ok(())
}

/// Runs of a step's weight products timed for each concurrency; the table gives their median.
const PRODUCT_RUNS: usize = 9;

/// Prints, for each burst of the table before it, its decode step beside the model's weight
/// products alone on as many rows, and what the burst's ratios to one request would be if
/// every decode step cost only its products.
fn products_table(concurrency: &[usize], runs: &[Vec<Load>]) {
    let Some(single) = runs.first().map(|r| Load::median(r)) else {
        return;
    };
    println!();
    println!("Where a decode step goes: each burst's decode step (its requests over its decode-phase tok/s) beside the model's weight products alone — every projection of a step on stand-in inputs of as many rows, the median of {PRODUCT_RUNS} runs timed right after the burst — both from the median run above; the rest is attention, norms, sampling and the engine's own work. The last two columns are what the burst's × single figures would become if every decode step cost only its products and the prompts what they took here: ceilings that no saving outside the products can pass.");
    println!();
    println!("| concurrent requests | decode step | its weight products | the rest | decode phase × single's, at the products' pace | whole run × single, likewise |");
    println!("|---|---|---|---|---|---|");
    for (&c, runs) in concurrency.iter().zip(runs) {
        let this = Load::median(runs);
        if let Some(row) = this
            .products_s
            .and_then(|p| products_row(c.max(1), &this, &single, p))
        {
            println!("{row}");
        }
    }
}

/// Seconds one step's weight products take on `rows` rows: the median of [`PRODUCT_RUNS`]
/// runs after one to warm up, each run inside the thread pool as an engine step runs (one
/// injection, rather than one per product from outside it).
fn time_products(model: &Llama, rows: usize) -> Result<f64> {
    // Stand-in inputs spread over [-1, 1), one per input width, so activation quantization
    // sees ordinary rows; made before the timing.
    let mut inputs = std::collections::BTreeMap::new();
    for p in model.products() {
        inputs.entry(p.cols).or_insert_with(|| {
            (0..rows * p.cols)
                .map(|i| (i * 7919 % 2003) as f32 / 1001.5 - 1.0)
                .collect::<Vec<f32>>()
        });
    }
    let run = || rayon::scope(|_| model.products().for_each(|p| drop(p.run(&inputs[&p.cols]))));
    run();
    let mut times = Vec::with_capacity(PRODUCT_RUNS);
    for _ in 0..PRODUCT_RUNS {
        let t = Instant::now();
        run();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The row of [`products_table`] for a burst of `c` requests (`this`, against the single
/// request's `single`) whose step products take `products` seconds; none without a decode
/// phase on both sides.
fn products_row(c: usize, this: &Load, single: &Load, products: f64) -> Option<String> {
    let (b, one) = (this.burst?, single.burst?);
    let (rate, one_rate) = (b.decode_per_s(), one.decode_per_s());
    if rate <= 0.0 || one_rate <= 0.0 || single.tokens_per_s <= 0.0 {
        return None;
    }
    let step = c as f64 / rate;
    // At the products' pace the decode phase's tokens take `products` per step of `c`.
    let decode_ceiling = c as f64 / products.max(1e-12) / one_rate;
    let tokens = this.tokens_per_s * (b.prompts_s + b.decode_s);
    let elapsed = b.prompts_s + b.decode_tokens as f64 * products / c as f64;
    let whole_ceiling = tokens / elapsed.max(1e-12) / single.tokens_per_s;
    Some(format!(
        "| {c} | {:.2} ms | {:.2} ms | {:.2} ms | {decode_ceiling:.2}× | {whole_ceiling:.2}× |",
        1e3 * step,
        1e3 * products,
        1e3 * (step - products)
    ))
}

/// Prints a row per concurrency from its runs, each against the first row's (the single
/// request's), which it returns; with `ttft_ratio`, rows also give TTFT p90 over the
/// single request's.
fn print_rows<'a>(
    concurrency: &[usize],
    runs: &'a [Vec<Load>],
    ttft_ratio: bool,
) -> Option<&'a [Load]> {
    let single = runs.first()?;
    for (i, (c, r)) in concurrency.iter().zip(runs).enumerate() {
        println!(
            "{}",
            Load::row(
                &c.to_string(),
                r,
                single,
                Columns {
                    range: i > 0,
                    ttft_ratio
                }
            )
        );
    }
    Some(single)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(tokens_per_s: f64) -> Load {
        Load {
            tokens_per_s,
            ..Load::default()
        }
    }

    #[test]
    fn kv_waste_is_measured_over_the_whole_peak_not_just_its_first_step() {
        let mut fill = PeakFill::default();
        // Two blocks of 16 taken at step 3 and filled while held; then the sequence ends.
        for (held, filled) in [(16, 3), (16, 15), (32, 17), (32, 24), (32, 31), (0, 0)] {
            fill.record(held, filled);
        }
        assert_eq!(
            (
                fill.peak_allocated_slots,
                fill.filled_at_peak,
                fill.steps_at_peak
            ),
            (32, 17, 3)
        );
        assert_eq!(fill.filled_over_peak_steps, 17 + 24 + 31);
    }

    #[test]
    fn the_median_run_is_the_middle_one_or_the_lower_middle_one() {
        let runs = [load(3.0), load(1.0), load(2.0)];
        assert_eq!(Load::median(&runs).tokens_per_s, 2.0);
        assert_eq!(Load::median(&runs[..2]).tokens_per_s, 1.0);
        assert_eq!(Load::median(&[]).tokens_per_s, 0.0);
    }

    #[test]
    fn a_row_gives_the_medians_ratio_and_the_range_of_the_rounds_ratios() {
        let single = [load(100.0), load(120.0), load(110.0)];
        let sixteen = [load(250.0), load(300.0), load(330.0)];
        // Medians 300 / 110; per round 2.50, 2.50, 3.00.
        let row = Load::row(
            "16",
            &sixteen,
            &single,
            Columns {
                range: true,
                ttft_ratio: false,
            },
        );
        assert!(
            row.starts_with("| 16 | 300.0 | 2.73× (2.50–3.00) |"),
            "{row}"
        );
        let row = Load::row("1", &single, &single, Columns::default());
        assert!(row.starts_with("| 1 | 110.0 | 1.00× |"), "{row}");
    }

    #[test]
    fn the_decode_phase_starts_at_the_last_first_token() {
        // Two requests: first tokens at 1.0 s and 2.0 s, then tokens until the end at 4.0 s.
        let requests = [
            Received {
                ttft: Some(1.0),
                arrivals: vec![1.0, 1.5, 2.5, 3.0],
            },
            Received {
                ttft: Some(2.0),
                arrivals: vec![2.0, 3.0, 4.0],
            },
        ];
        // After 2.0 s: 2.5, 3.0 (first request), 3.0, 4.0 (second): 4 tokens in 2 s.
        let split = phases(&requests, 4.0);
        assert_eq!(
            split,
            Phases {
                prompts_s: 2.0,
                decode_tokens: 4,
                decode_s: 2.0
            }
        );
        assert_eq!(split.decode_per_s(), 2.0);
        // A lone token per request leaves no decode phase.
        let lone = [Received {
            ttft: Some(1.0),
            arrivals: vec![1.0],
        }];
        assert_eq!(phases(&lone, 1.0).decode_per_s(), 0.0);
    }

    /// A burst's run: `decode_tokens` in `decode_s` after `prompts_s`.
    fn burst(tokens_per_s: f64, prompts_s: f64, decode_tokens: usize, decode_s: f64) -> Load {
        Load {
            tokens_per_s,
            burst: Some(Phases {
                prompts_s,
                decode_tokens,
                decode_s,
            }),
            ..Load::default()
        }
    }

    #[test]
    fn burst_rows_give_the_decode_phase_against_the_single_requests() {
        let single = [burst(100.0, 0.1, 120, 1.0)];
        let sixteen = [burst(250.0, 1.0, 720, 2.0)];
        let row = Load::row("16", &sixteen, &single, Columns::default());
        assert!(row.contains("| 360.0 (3.00×) |"), "{row}");
        // Steady traffic has no decode phase: its rows keep the steady table's 7 columns.
        let steady = [load(250.0)];
        let row = Load::row(
            "16",
            &steady,
            &[load(100.0)],
            Columns {
                range: false,
                ttft_ratio: true,
            },
        );
        assert_eq!(row.matches('|').count(), 7 + 1, "{row}");
    }

    #[test]
    fn a_products_row_splits_the_decode_step_and_gives_the_ceilings_at_the_products_pace() {
        // One request decodes 100 tok/s and gets 100 tok/s over its whole run.
        let single = burst(100.0, 0.5, 150, 1.5);
        // Four requests: 400 tokens in 2 s after 1 s of prompts, 150 tok/s over the run
        // (450 tokens in 3 s); a step of four takes 4 / 200 = 20 ms, 10 of them products.
        let four = burst(150.0, 1.0, 400, 2.0);
        let row = products_row(4, &four, &single, 0.010);
        // At 10 ms a step the decode phase runs 400 tok/s (4.00× one request's 100) and the
        // run takes 1 + 100 × 0.010 = 2 s: 225 tok/s, 2.25× one request's 100.
        assert_eq!(
            row.as_deref(),
            Some("| 4 | 20.00 ms | 10.00 ms | 10.00 ms | 4.00× | 2.25× |")
        );
        // Without a decode phase there is no step to split.
        assert_eq!(products_row(4, &load(150.0), &single, 0.010), None);
        assert_eq!(
            products_row(4, &burst(150.0, 1.0, 0, 0.0), &single, 0.010),
            None
        );
    }
}
