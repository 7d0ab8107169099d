//! Continuous batching over the paged KV cache gives every request exactly the tokens it
//! gets alone — with many at once, under memory pressure, with chunked prefill and with
//! prefix caching — and never leaks a block.

mod common;

use std::time::{Duration, Instant};

use candle_core::Device;
use ferrite_engine::engine::{
    EngineConfig, EngineHandle, Event, RequestStream, StepObserver, StepView,
};
use ferrite_engine::model::llama::log_softmax;
use ferrite_engine::model::{load, LoadedModel};
use ferrite_engine::reference::generate;
use ferrite_engine::sampling::SamplingParams;
use ferrite_engine::sequence::TokenOutput;

const TEXT: &str =
    "The quick brown fox jumps over the lazy dog. In the beginning the universe was \
created. This has made a lot of people very angry and been widely regarded as a bad move. It was \
the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness. All happy families are alike; each unhappy family is unhappy in its own way. Call me \
Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse.";

fn model() -> LoadedModel {
    load(&common::default_model(), &Device::Cpu).expect("default model loads")
}

/// `n` prompts of different lengths cut from the text.
fn prompts(m: &LoadedModel, n: usize) -> Vec<Vec<u32>> {
    let ids = m.tokenizer.encode(TEXT, false).expect("encodes");
    (0..n)
        .map(|i| ids[(i * 7) % 40..(i * 7) % 40 + 3 + (i * 13) % 50].to_vec())
        .collect()
}

fn alone(m: &LoadedModel, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    generate(m, prompt, params, |_| {})
        .expect("generates")
        .tokens
        .iter()
        .map(|t| t.id)
        .collect()
}

fn start(config: EngineConfig) -> EngineHandle {
    EngineHandle::start(model(), config).expect("engine starts")
}

fn small(blocks_of_16: u64, config: EngineConfig) -> EngineConfig {
    // SmolLM2: 30 layers × 3 KV heads × 64 × 2 (K and V) × 2 bytes = 23 040 bytes per token.
    let max_model_len = config.max_model_len.or(Some(256));
    EngineConfig {
        kv_cache_memory: Some(blocks_of_16 * 16 * 23_040),
        max_model_len,
        ..config
    }
}

/// Submits every prompt at once and collects each completion's ids.
fn batched(engine: &EngineHandle, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(p.clone(), params.clone()).expect("accepted"))
        .collect();
    streams.into_iter().map(ids).collect()
}

/// A completion's token ids.
fn ids(stream: RequestStream) -> Vec<u32> {
    let done = stream.collect_blocking().expect("completes");
    done.tokens.iter().map(|t| t.id).collect()
}

/// Waits for the engine to go idle and checks that it preempted on the way there.
fn assert_idle_after_preempting(engine: &EngineHandle) {
    wait_idle(engine);
    assert!(
        engine.stats().preemptions > 0,
        "the cache was too small not to preempt"
    );
}

fn wait_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let st = engine.stats();
        if st.running == 0 && st.waiting == 0 && st.used_blocks == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("engine did not become idle: {:?}", engine.stats());
}

#[test]
fn thirty_two_prompts_batched_equal_each_alone() {
    let m = model();
    let ps = prompts(&m, 32);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&m, p, 12)).collect();
    let engine = start(small(256, EngineConfig::default()));
    assert_eq!(batched(&engine, &ps, 12), want);
    wait_idle(&engine);
    assert!(
        engine.stats().steps < 32 * 12,
        "requests were batched: {:?}",
        engine.stats()
    );
}

#[test]
fn under_memory_pressure_everything_completes_identically_with_preemptions() {
    let m = model();
    let ps = prompts(&m, 16);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&m, p, 24)).collect();
    // 10 blocks hold 160 tokens: far less than 16 requests need at once.
    let engine = start(small(
        10,
        EngineConfig {
            max_model_len: Some(160),
            ..EngineConfig::default()
        },
    ));
    assert_eq!(batched(&engine, &ps, 24), want);
    assert_idle_after_preempting(&engine);
}

#[test]
fn a_prompt_four_times_the_token_budget_is_chunked_and_unchanged() {
    let m = model();
    let p: Vec<u32> = m.tokenizer.encode(&TEXT.repeat(2), false).expect("encodes")[..128].to_vec();
    let want = alone(&m, &p, 8);
    let engine = start(small(
        64,
        EngineConfig {
            max_num_batched_tokens: 32,
            ..EngineConfig::default()
        },
    ));
    assert_eq!(batched(&engine, &[p], 8), vec![want]);
    wait_idle(&engine);
    assert!(
        engine.stats().steps >= 4 + 7,
        "prefill took at least four steps"
    );
}

#[test]
fn a_shared_prefix_is_computed_once_and_changes_nothing() {
    let m = model();
    let ids = m.tokenizer.encode(TEXT, false).expect("encodes");
    let first: Vec<u32> = ids[..80].to_vec();
    let mut second: Vec<u32> = ids[..64].to_vec();
    second.extend_from_slice(&ids[90..100]);
    let without = start(small(
        64,
        EngineConfig {
            enable_prefix_caching: false,
            ..EngineConfig::default()
        },
    ));
    let want = batched(&without, &[second.clone()], 8);

    let engine = start(small(64, EngineConfig::default()));
    batched(&engine, &[first], 4);
    wait_idle(&engine);
    let before = engine.stats();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(8)
    };
    let ferrite_engine::engine::Collected { tokens, finish, .. } = engine
        .submit(second.clone(), params)
        .expect("accepted")
        .collect_blocking()
        .expect("completes");
    wait_idle(&engine);
    let after = engine.stats();
    assert_eq!(vec![tokens.iter().map(|t| t.id).collect::<Vec<_>>()], want);
    // Four full blocks (64 tokens) came from the cache; only the 10 new tokens were computed.
    assert_eq!(finish.cached_tokens, 64);
    assert_eq!(
        after.computed_prompt_tokens - before.computed_prompt_tokens,
        10
    );
    assert!(after.prefix_hits - before.prefix_hits >= 64);
}

#[test]
fn twins_sent_together_compute_their_prompt_once() {
    let m = model();
    let text = m.tokenizer.encode(TEXT, false).expect("encodes");
    // Four full blocks and six tokens, as the four choices of an `n = 4` request send it.
    let twin: Vec<u32> = text[..70].to_vec();
    let want = alone(&m, &twin, 6);
    let engine = start(small(
        128,
        EngineConfig {
            max_model_len: Some(512),
            ..EngineConfig::default()
        },
    ));
    // A long prompt (starting elsewhere in the text, so it shares no block with the twins)
    // keeps the engine busy while the twins are sent, so they reach it together.
    let blocker: Vec<u32> = text[5..].iter().cycle().take(400).copied().collect();
    let one = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(1)
    };
    let busy = engine.submit(blocker, one).expect("accepted");
    let before = engine.stats();
    let got = batched(&engine, &vec![twin; 4], 6);
    ids(busy);
    wait_idle(&engine);
    let after = engine.stats();
    assert_eq!(got, vec![want; 4]);
    // The first twin computed its 70 prompt tokens; each other one shared its four full
    // blocks and computed only the last 6.
    assert_eq!(
        after.computed_prompt_tokens - before.computed_prompt_tokens,
        400 + 70 + 3 * 6,
        "{after:?}"
    );
}

#[test]
fn dropping_a_request_mid_generation_frees_its_blocks() {
    let m = model();
    let ps = prompts(&m, 3);
    let engine = start(small(64, EngineConfig::default()));
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(200)
    };
    let mut doomed = engine.submit(ps[0].clone(), params).expect("accepted");
    for _ in 0..3 {
        assert!(matches!(doomed.next_blocking(), Some(Event::Token { .. })));
    }
    drop(doomed);
    let others = batched(&engine, &ps[1..], 6);
    assert_eq!(others.len(), 2);
    wait_idle(&engine);
    let st = engine.stats();
    assert_eq!(st.used_blocks, 0, "{st:?}");
    assert!(
        st.generated_tokens < 200,
        "the dropped request stopped early: {st:?}"
    );
}

#[test]
fn a_cache_smaller_than_max_model_len_is_refused_at_startup() {
    let err = EngineHandle::start(model(), small(4, EngineConfig::default()))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("holds 64 tokens") && err.contains("--max-model-len is 256"),
        "{err}"
    );
}

#[test]
fn a_limit_out_of_range_is_refused_at_startup_naming_its_flag() {
    let with = |set: fn(&mut EngineConfig)| {
        let mut config = EngineConfig::default();
        set(&mut config);
        config
    };
    let refused = [
        (
            "--max-model-len must be at least 1",
            with(|c| c.max_model_len = Some(0)),
        ),
        (
            "--block-size must be between 1 and 256 tokens, got 0",
            with(|c| c.block_size = 0),
        ),
        (
            "--block-size must be between 1 and 256 tokens, got 100000",
            with(|c| c.block_size = 100_000),
        ),
        (
            "--max-num-seqs must be at least 1",
            with(|c| c.max_num_seqs = 0),
        ),
        (
            "--max-num-batched-tokens must be at least 1",
            with(|c| c.max_num_batched_tokens = 0),
        ),
    ];
    for (want, config) in refused {
        let err = EngineHandle::start(model(), config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(err, want);
    }
}

#[test]
fn a_logit_bias_beyond_the_vocabulary_is_refused() {
    let engine = start(small(64, EngineConfig::default()));
    let params = SamplingParams {
        logit_bias: vec![(49_152, 5.0)],
        ..SamplingParams::greedy(4)
    };
    let err = engine
        .submit(vec![1, 2, 3], params)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        err,
        "`logit_bias` holds token id 49152, beyond the vocabulary of 49152 tokens"
    );
}

#[test]
fn max_tokens_beyond_max_model_len_is_refused_with_both_numbers() {
    let engine = start(small(64, EngineConfig::default()));
    let err = engine
        .submit(vec![1, 2, 3], SamplingParams::greedy(300))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("maximum context length is 256") && err.contains("303"),
        "{err}"
    );
}

/// Records the cache slots held and filled after every step.
struct SlotLog(std::sync::Arc<std::sync::Mutex<Vec<(usize, usize)>>>);

impl StepObserver for SlotLog {
    fn after_step(&mut self, view: &StepView<'_>) {
        if let Ok(mut log) = self.0.lock() {
            log.push((view.allocated_slots(), view.filled_slots()));
        }
    }
}

#[test]
fn an_observer_sees_the_blocks_held_and_filled_after_every_step() {
    let m = model();
    let prompt = prompts(&m, 1).remove(0);
    assert_eq!(prompt.len(), 3);
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let engine = EngineHandle::start_observed(
        m,
        small(64, EngineConfig::default()),
        Some(Box::new(SlotLog(std::sync::Arc::clone(&log)))),
    )
    .expect("starts");
    // 3 prompt tokens + 29 fed-back outputs = 32 cached positions: exactly two blocks.
    batched(&engine, &[prompt], 30);
    wait_idle(&engine);
    let log = log.lock().expect("log").clone();
    // One step for the prompt, one per further token (the last token is never cached).
    assert_eq!(log.len(), 30, "{log:?}");
    let peak = log.iter().map(|&(held, _)| held).max();
    assert_eq!(peak, Some(32), "{log:?}");
    let at_peak: Vec<usize> = log
        .iter()
        .filter(|&&(held, _)| held == 32)
        .map(|&(_, filled)| filled)
        .collect();
    assert!(
        at_peak.len() > 1 && at_peak.windows(2).all(|w| w[0] < w[1]) && at_peak[0] < 32,
        "the second block fills up while it is held: {log:?}"
    );
}

/// Each prompt token after the first with its log-probability and best alternative, from
/// one forward pass over the whole prompt: what scoring the prompt must give.
fn reference_scores(m: &LoadedModel, prompt: &[u32]) -> Vec<(u32, f32, u32)> {
    let rows = common::prefill_logits(&m.model, prompt).expect("forward");
    rows.iter()
        .zip(&prompt[1..])
        .map(|(row, &next)| {
            let lp = log_softmax(row);
            let best = (0..lp.len()).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)));
            (next, lp[next as usize], best.expect("a vocabulary") as u32)
        })
        .collect()
}

fn as_scores(scores: &[TokenOutput]) -> Vec<(u32, f32, u32)> {
    scores
        .iter()
        .map(|t| (t.id, t.logprob.expect("scored"), t.top[0].0))
        .collect()
}

#[test]
fn a_scored_prompt_gets_one_forward_pass_scores_chunked_batched_or_after_a_cache_hit() {
    let m = model();
    let ids = m.tokenizer.encode(TEXT, false).expect("encodes");
    let prompt: Vec<u32> = ids[..70].to_vec();
    let want = reference_scores(&m, &prompt);
    let scored = SamplingParams {
        prompt_logprobs: Some(1),
        ignore_eos: true,
        ..SamplingParams::greedy(2)
    };
    // Prefix caching on, the prompt's blocks already cached: scoring still computes them.
    let engine = start(small(64, EngineConfig::default()));
    batched(&engine, std::slice::from_ref(&prompt), 2);
    let got = engine
        .submit(prompt.clone(), scored.clone())
        .expect("accepted")
        .collect_blocking()
        .expect("completes");
    assert_eq!(as_scores(&got.prompt.expect("scores sent")), want);
    assert_eq!(got.finish.cached_tokens, 0);
    assert_eq!(got.tokens.len(), 2);
    wait_idle(&engine);
    // Chunked over many steps beside other requests, with room for only a few logits rows
    // a step: the same scores, and the other requests their own tokens.
    let engine = start(small(
        64,
        EngineConfig {
            max_num_batched_tokens: 16,
            max_num_seqs: 4,
            ..EngineConfig::default()
        },
    ));
    let others = prompts(&m, 3);
    let want_others: Vec<Vec<u32>> = others.iter().map(|p| alone(&m, p, 6)).collect();
    let stream = engine.submit(prompt, scored).expect("accepted");
    assert_eq!(batched(&engine, &others, 6), want_others);
    let got = stream.collect_blocking().expect("completes");
    assert_eq!(as_scores(&got.prompt.expect("scores sent")), want);
    wait_idle(&engine);
}

#[test]
fn a_scored_prompt_keeps_its_scores_through_preemptions() {
    let m = model();
    let text = m.tokenizer.encode(TEXT, false).expect("encodes");
    let prompt: Vec<u32> = text[..70].to_vec();
    let want = reference_scores(&m, &prompt);
    let others = prompts(&m, 8);
    let want_others: Vec<Vec<u32>> = others.iter().map(|p| alone(&m, p, 24)).collect();
    // 10 blocks (160 tokens), prompts chunked 16 tokens a step: the scored prompt, admitted
    // last while the others decode and grow, is the newest sequence, the one preempted.
    let engine = start(small(
        10,
        EngineConfig {
            max_model_len: Some(160),
            max_num_batched_tokens: 16,
            ..EngineConfig::default()
        },
    ));
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    };
    let streams: Vec<_> = others
        .iter()
        .map(|p| engine.submit(p.clone(), params.clone()).expect("accepted"))
        .collect();
    let scored = SamplingParams {
        prompt_logprobs: Some(1),
        ..params
    };
    let got = engine.submit(prompt, scored).expect("accepted");
    let tokens: Vec<Vec<u32>> = streams.into_iter().map(ids).collect();
    assert_eq!(tokens, want_others);
    let got = got.collect_blocking().expect("completes");
    assert_eq!(as_scores(&got.prompt.expect("scores sent")), want);
    assert_idle_after_preempting(&engine);
}

#[test]
fn a_one_token_prompt_has_nothing_to_score_and_other_requests_get_no_scores() {
    let engine = start(small(16, EngineConfig::default()));
    let scored = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::greedy(1)
    };
    let collect = |prompt: Vec<u32>, params| {
        engine
            .submit(prompt, params)
            .expect("accepted")
            .collect_blocking()
            .expect("completes")
    };
    assert_eq!(collect(vec![42], scored).prompt, Some(Vec::new()));
    assert_eq!(
        collect(vec![42, 43], SamplingParams::greedy(1)).prompt,
        None
    );
}

/// The tiny F16 model rewritten with every matrix in BF16 (exactly: the values are f16),
/// at `path`.
fn write_bf16_copy(path: &std::path::Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let src = common::fixture("tiny/tiny-F16.gguf");
    let mut file = std::fs::File::open(&src).expect("opens");
    let content = gguf_file::Content::read(&mut file).expect("GGUF");
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let q = content
            .tensor(&mut file, name, &Device::Cpu)
            .expect("reads");
        let q = if q.shape().dims().len() == 2 {
            let t = q.dequantize(&Device::Cpu).expect("decodes");
            QTensor::quantize(&t, GgmlDType::BF16).expect("to BF16")
        } else {
            q
        };
        tensors.push((name.clone(), q));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
    let mut out = std::fs::File::create(path).expect("creates");
    gguf_file::write(&mut out, &metadata, &tensors).expect("writes");
}

#[test]
fn every_weight_format_gives_each_request_its_tokens_alone_beside_fifteen_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bf16 = dir.path().join("tiny-BF16.gguf");
    write_bf16_copy(&bf16);
    let mut models: Vec<std::path::PathBuf> = std::fs::read_dir(common::fixture("tiny"))
        .expect("tiny models")
        .map(|e| e.expect("entry").path())
        .collect();
    models.sort();
    models.push(bf16);
    // Prompts of 1 to 40 tokens from the tiny vocabulary.
    let ps: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            (0..1 + (i * 13) % 40)
                .map(|j| ((i * 31 + j * 7) % 133) as u32)
                .collect()
        })
        .collect();
    for path in &models {
        let m = load(path, &Device::Cpu).expect("loads");
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&m, p, 8)).collect();
        let engine = EngineHandle::start(
            m,
            EngineConfig {
                max_model_len: Some(64),
                kv_cache_memory: Some(16 << 20),
                ..EngineConfig::default()
            },
        )
        .expect("engine starts");
        assert_eq!(batched(&engine, &ps, 8), want, "{}", path.display());
    }
}
