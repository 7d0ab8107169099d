//! Prometheus metrics with vLLM's names, types and buckets, labelled `model_name`, so
//! dashboards, KEDA rules and the Gateway API Inference Extension read Ferrite unchanged.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::engine::{EngineHandle, EngineInfo, EngineStats, Finish, ITERATION_TOKEN_BUCKETS};
use crate::parallel::StageStats;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's buckets for `vllm:request_num_preemptions`.
const PREEMPTION_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// vLLM's buckets for `vllm:request_params_n`.
const N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max`.
fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1, 2, 5] {
            let v = m * scale;
            if v > max {
                return out;
            }
            out.push(v as f64);
        }
        scale = scale.saturating_mul(10);
    }
}

/// Histograms of token counts, whose buckets run up to the model's length: registered once
/// the model is loaded and that length known.
struct Lengths {
    prompt: Histogram,
    generation: Histogram,
    prefill_computed: Histogram,
    max_tokens: Histogram,
    n: Histogram,
}

/// When a finished request's tokens came, as its stream's reader saw them.
#[derive(Debug, Clone, Copy)]
pub struct Timeline {
    /// Arrival.
    pub arrived: Instant,
    /// First token.
    pub first_token: Option<Instant>,
    /// Last token.
    pub last_token: Option<Instant>,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Time to first token, per request.
    pub ttft: Histogram,
    /// Time between consecutive output tokens.
    pub inter_token: Histogram,
    e2e: Histogram,
    /// Time a request waited before it was first scheduled.
    queue_time: Histogram,
    preemptions_per_request: Histogram,
    prefill_time: Histogram,
    decode_time: Histogram,
    inference_time: Histogram,
    time_per_output_token: Histogram,
    lengths: OnceLock<Lengths>,
    prompt_tokens: IntCounter,
    cached_prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    success: IntCounterVec,
    /// Tool calls made in answers.
    pub tool_calls: IntCounter,
    /// Requests whose output a grammar constrained, by the grammar's kind.
    structured: IntCounterVec,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    preemptions: IntCounter,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    cache_info: GaugeVec,
    seen: Mutex<EngineStats>,
    model_name: String,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Registers every metric with the constant label `model_name`.
    pub fn new(model_name: &str) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let opts =
            |name: &str, help: &str| Opts::new(name, help).const_label("model_name", model_name);
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .const_label("model_name", model_name)
                    .buckets(buckets.to_vec()),
            )
        };
        let m = Metrics {
            ttft: hist(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            )?,
            inter_token: hist(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            )?,
            e2e: hist(
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                REQUEST_BUCKETS,
            )?,
            preemptions_per_request: hist(
                "vllm:request_num_preemptions",
                "Histogram of number of preemptions per request.",
                PREEMPTION_BUCKETS,
            )?,
            queue_time: hist(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent waiting in the queue in seconds.",
                REQUEST_BUCKETS,
            )?,
            prefill_time: hist(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_BUCKETS,
            )?,
            decode_time: hist(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                REQUEST_BUCKETS,
            )?,
            inference_time: hist(
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                REQUEST_BUCKETS,
            )?,
            time_per_output_token: hist(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                ITL_BUCKETS,
            )?,
            lengths: OnceLock::new(),
            prompt_tokens: IntCounter::with_opts(opts(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
            ))?,
            cached_prompt_tokens: IntCounter::with_opts(opts(
                "vllm:prompt_tokens_cached_total",
                "Number of cached prompt tokens (local prefix cache hits).",
            ))?,
            generation_tokens: IntCounter::with_opts(opts(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
            ))?,
            success: IntCounterVec::new(
                opts(
                    "vllm:request_success_total",
                    "Count of successfully processed requests.",
                ),
                &["finished_reason"],
            )?,
            tool_calls: IntCounter::with_opts(opts(
                "ferrite:tool_calls_total",
                "Tool calls made in chat and Responses answers.",
            ))?,
            structured: IntCounterVec::new(
                opts(
                    "ferrite:structured_output_requests_total",
                    "Requests whose output a grammar constrained, by kind (json_object, json_schema, regex, choice, grammar).",
                ),
                &["kind"],
            )?,
            running: IntGauge::with_opts(opts(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
            ))?,
            waiting: IntGauge::with_opts(opts(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
            ))?,
            kv_usage: Gauge::with_opts(opts(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            ))?,
            preemptions: IntCounter::with_opts(opts(
                "vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine.",
            ))?,
            prefix_queries: IntCounter::with_opts(opts(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
            ))?,
            prefix_hits: IntCounter::with_opts(opts(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
            ))?,
            cache_info: GaugeVec::new(
                opts(
                    "vllm:cache_config_info",
                    "Information of the LLMEngine CacheConfig",
                ),
                &[
                    "block_size",
                    "num_gpu_blocks",
                    "gpu_memory_utilization",
                    "enable_prefix_caching",
                    "device",
                ],
            )?,
            seen: Mutex::new(EngineStats::default()),
            model_name: model_name.to_string(),
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.ttft.clone()))?;
        r.register(Box::new(m.inter_token.clone()))?;
        r.register(Box::new(m.e2e.clone()))?;
        r.register(Box::new(m.queue_time.clone()))?;
        r.register(Box::new(m.preemptions_per_request.clone()))?;
        r.register(Box::new(m.cached_prompt_tokens.clone()))?;
        r.register(Box::new(m.prefill_time.clone()))?;
        r.register(Box::new(m.decode_time.clone()))?;
        r.register(Box::new(m.inference_time.clone()))?;
        r.register(Box::new(m.time_per_output_token.clone()))?;
        r.register(Box::new(m.prompt_tokens.clone()))?;
        r.register(Box::new(m.generation_tokens.clone()))?;
        r.register(Box::new(m.success.clone()))?;
        r.register(Box::new(m.tool_calls.clone()))?;
        r.register(Box::new(m.structured.clone()))?;
        r.register(Box::new(m.running.clone()))?;
        r.register(Box::new(m.waiting.clone()))?;
        r.register(Box::new(m.kv_usage.clone()))?;
        r.register(Box::new(m.preemptions.clone()))?;
        r.register(Box::new(m.prefix_queries.clone()))?;
        r.register(Box::new(m.prefix_hits.clone()))?;
        r.register(Box::new(m.cache_info.clone()))?;
        for reason in ["stop", "length", "abort"] {
            m.success.with_label_values(&[reason]);
        }
        Ok(m)
    }

    /// Counts a request whose output a grammar of `kind` constrains.
    pub fn note_constrained(&self, kind: &str) {
        self.structured.with_label_values(&[kind]).inc();
    }

    /// Records what the loaded engine is: its cache configuration as
    /// `vllm:cache_config_info` labels (with `device="cpu"`: the blocks vLLM calls GPU blocks
    /// are in host memory here), and registers the token-count histograms whose buckets run
    /// up to its `max_model_len`.
    pub fn set_engine_info(&self, info: &EngineInfo) -> prometheus::Result<()> {
        self.cache_info
            .with_label_values(&[
                &info.cache.block_size.to_string(),
                &info.cache.num_blocks.to_string(),
                &info.utilization.to_string(),
                &info.prefix_caching.to_string(),
                "cpu",
            ])
            .set(1.0);
        let hist = |name: &str, help: &str, buckets: Vec<f64>| {
            Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .const_label("model_name", &self.model_name)
                    .buckets(buckets),
            )
        };
        let lengths = buckets_1_2_5(info.max_model_len);
        let l = Lengths {
            prompt: hist(
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                lengths.clone(),
            )?,
            generation: hist(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                lengths.clone(),
            )?,
            prefill_computed: hist(
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                lengths.clone(),
            )?,
            max_tokens: hist(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                lengths,
            )?,
            n: hist(
                "vllm:request_params_n",
                "Histogram of the n request parameter.",
                N_BUCKETS.to_vec(),
            )?,
        };
        for h in [
            &l.prompt,
            &l.generation,
            &l.prefill_computed,
            &l.max_tokens,
            &l.n,
        ] {
            self.registry.register(Box::new(h.clone()))?;
        }
        let _ = self.lengths.set(l);
        Ok(())
    }

    /// Records a request's parameters as it is admitted: its `n` and `max_tokens`.
    pub fn note_params(&self, n: usize, max_tokens: usize) {
        if let Some(l) = self.lengths.get() {
            l.n.observe(n as f64);
            l.max_tokens.observe(max_tokens as f64);
        }
    }

    /// Records a finished request as vLLM does: its latency, queue time and phases (prefill
    /// from first scheduled to first token, decode from first to last token, inference from
    /// first scheduled to last token, time per output token over the decode of requests of
    /// two tokens or more), its token counts and preemptions, and why it ended.
    pub fn note_finished(&self, f: &Finish, t: &Timeline) {
        let secs = |a: Option<Instant>, b: Option<Instant>| {
            a.zip(b)
                .map(|(a, b)| b.saturating_duration_since(a).as_secs_f64())
        };
        self.e2e.observe(t.arrived.elapsed().as_secs_f64());
        self.queue_time.observe(f.queue_seconds);
        if let Some(d) = secs(f.scheduled, t.first_token) {
            self.prefill_time.observe(d);
        }
        if let Some(d) = secs(t.first_token, t.last_token) {
            self.decode_time.observe(d);
            if f.completion_tokens > 1 {
                self.time_per_output_token
                    .observe(d / (f.completion_tokens - 1) as f64);
            }
        }
        if let Some(d) = secs(f.scheduled, t.last_token) {
            self.inference_time.observe(d);
        }
        self.preemptions_per_request
            .observe(f64::from(f.preemptions));
        if let Some(l) = self.lengths.get() {
            l.prompt.observe(f.prompt_tokens as f64);
            l.generation.observe(f.completion_tokens as f64);
            l.prefill_computed
                .observe(f.prompt_tokens.saturating_sub(f.cached_tokens) as f64);
        }
        self.prompt_tokens.inc_by(f.prompt_tokens as u64);
        self.cached_prompt_tokens.inc_by(f.cached_tokens as u64);
        self.note_end(f.reason.as_str());
    }

    /// Counts a request that ended, by `vllm:request_success_total`'s `finished_reason`.
    pub fn note_end(&self, reason: &str) {
        self.success.with_label_values(&[reason]).inc();
    }

    /// The Prometheus text exposition, with engine gauges read at this moment.
    pub fn render(&self, engine: Option<&EngineHandle>) -> String {
        if let Some(engine) = engine {
            let st = engine.stats();
            self.running.set(st.running as i64);
            self.waiting.set(st.waiting as i64);
            self.kv_usage
                .set(st.used_blocks as f64 / st.total_blocks.max(1) as f64);
            if let Ok(mut seen) = self.seen.lock() {
                self.preemptions
                    .inc_by(st.preemptions.saturating_sub(seen.preemptions));
                // As vLLM counts them: each step's tokens, whether or not their request ends.
                self.generation_tokens
                    .inc_by(st.generated_tokens.saturating_sub(seen.generated_tokens));
                self.prefix_queries
                    .inc_by(st.prefix_queries.saturating_sub(seen.prefix_queries));
                self.prefix_hits
                    .inc_by(st.prefix_hits.saturating_sub(seen.prefix_hits));
                *seen = st;
            }
        }
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        let mut text = String::from_utf8(out).unwrap_or_default();
        if let Some(engine) = engine {
            self.render_iterations(&engine.stats(), &mut text);
            self.render_stages(&engine.stage_stats(), &mut text);
        }
        text
    }

    /// The model name as a label value in the text format.
    fn escaped_model_name(&self) -> String {
        self.model_name.replace('\\', "\\\\").replace('"', "\\\"")
    }

    /// `vllm:iteration_tokens_total`: a histogram of the tokens each step computed, from the
    /// engine's own bucket counts.
    fn render_iterations(&self, st: &EngineStats, out: &mut String) {
        use std::fmt::Write;
        let metric = "vllm:iteration_tokens_total";
        let name = self.escaped_model_name();
        let _ = writeln!(
            out,
            "# HELP {metric} Histogram of number of tokens per engine_step.\n# TYPE {metric} histogram"
        );
        let mut cumulative = 0;
        let it = &st.iteration_tokens;
        for (bound, count) in ITERATION_TOKEN_BUCKETS.iter().zip(it.buckets) {
            cumulative += count;
            let _ = writeln!(
                out,
                "{metric}_bucket{{model_name=\"{name}\",le=\"{bound}\"}} {cumulative}"
            );
        }
        let total: u64 = it.buckets.iter().sum();
        let _ = writeln!(
            out,
            "{metric}_bucket{{model_name=\"{name}\",le=\"+Inf\"}} {total}\n\
             {metric}_sum{{model_name=\"{name}\"}} {}\n{metric}_count{{model_name=\"{name}\"}} {total}",
            it.sum
        );
    }

    /// Each pipeline stage's counters (none without a group), labelled `stage`: steps,
    /// compute and transfer seconds, bytes each way — the stage with the most compute
    /// seconds bounds the pipeline, transfer seconds are what the hops cost — and, with
    /// tensor parallelism, the leader's stage's collectives.
    fn render_stages(&self, stages: &[StageStats], out: &mut String) {
        use std::fmt::Write;
        type Field = fn(&StageStats) -> f64;
        let series: [(&str, &str, Field); 5] = [
            (
                "ferrite:pipeline_stage_steps_total",
                "Steps each pipeline stage ran.",
                |s| s.steps as f64,
            ),
            (
                "ferrite:pipeline_stage_compute_seconds_total",
                "Seconds each pipeline stage spent computing its layers.",
                |s| s.compute_seconds,
            ),
            (
                "ferrite:pipeline_stage_transfer_seconds_total",
                "Seconds each stage's steps spent on the wire to and from it (both ways, \
                 serialisation included); 0 for the leader's own stage.",
                |s| s.transfer_seconds,
            ),
            (
                "ferrite:pipeline_stage_sent_bytes_total",
                "Bytes the leader sent to each pipeline stage.",
                |s| s.bytes_sent as f64,
            ),
            (
                "ferrite:pipeline_stage_received_bytes_total",
                "Bytes the leader received from each pipeline stage.",
                |s| s.bytes_received as f64,
            ),
        ];
        let tensor: [(&str, &str, Field); 3] = [
            (
                "ferrite:tensor_parallel_collectives_total",
                "Collectives (gathers and step broadcasts through shared memory) the stage's \
                 tensor rank 0 ran.",
                |s| s.collectives as f64,
            ),
            (
                "ferrite:tensor_parallel_collective_seconds_total",
                "Seconds those collectives took: copying through shared memory and waiting for \
                 the stage's other tensor ranks.",
                |s| s.collective_seconds,
            ),
            (
                "ferrite:tensor_parallel_collective_bytes_total",
                "Bytes those collectives copied to and from shared memory.",
                |s| s.collective_bytes as f64,
            ),
        ];
        if stages.is_empty() {
            return;
        }
        let name = self.escaped_model_name();
        // Collectives are counted where the leader sees them: its own stage's.
        let tensor_stages = stages.iter().any(|s| s.collectives > 0);
        let tensor = tensor.iter().filter(|_| tensor_stages);
        for (&(metric, help, field), all) in series
            .iter()
            .map(|s| (s, true))
            .chain(tensor.map(|s| (s, false)))
        {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} counter");
            for (i, s) in stages.iter().enumerate() {
                if all || s.collectives > 0 {
                    let _ = writeln!(
                        out,
                        "{metric}{{model_name=\"{name}\",stage=\"{i}\"}} {}",
                        field(s)
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_run_1_2_5_up_to_the_model_length() {
        assert_eq!(
            buckets_1_2_5(2048),
            [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
        assert_eq!(buckets_1_2_5(1), [1.0]);
    }

    #[test]
    fn the_step_histogram_is_cumulative_with_every_step_under_inf() {
        let m = Metrics::new("m\"x").expect("metrics");
        let mut st = EngineStats::default();
        for tokens in [1, 8, 9, 300, 20_000] {
            st.iteration_tokens.observe(tokens);
        }
        let mut out = String::new();
        m.render_iterations(&st, &mut out);
        let value = |series: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(series))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let label = "model_name=\"m\\\"x\"";
        let bucket = |le: &str| {
            value(&format!(
                "vllm:iteration_tokens_total_bucket{{{label},le=\"{le}\"}}"
            ))
        };
        assert_eq!(bucket("1"), Some(1));
        assert_eq!(bucket("8"), Some(2));
        assert_eq!(bucket("16"), Some(3));
        assert_eq!(bucket("256"), Some(3));
        assert_eq!(bucket("512"), Some(4));
        assert_eq!(bucket("16384"), Some(4));
        assert_eq!(bucket("+Inf"), Some(5));
        assert_eq!(
            value(&format!("vllm:iteration_tokens_total_count{{{label}}}")),
            Some(5)
        );
        assert_eq!(
            value(&format!("vllm:iteration_tokens_total_sum{{{label}}}")),
            Some(1 + 8 + 9 + 300 + 20_000)
        );
    }
}
