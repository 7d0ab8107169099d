//! Prometheus metrics with vLLM's names, types and buckets, labelled `model_name`, so
//! dashboards, KEDA rules and the Gateway API Inference Extension read Ferrite unchanged.

use std::sync::Mutex;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::engine::{EngineHandle, EngineStats};
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

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Time to first token, per request.
    pub ttft: Histogram,
    /// Time between consecutive output tokens.
    pub inter_token: Histogram,
    /// Request latency from arrival to the last token.
    pub e2e: Histogram,
    /// Time a request waited before it was first scheduled.
    pub queue_time: Histogram,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: IntCounter,
    /// Generated tokens.
    pub generation_tokens: IntCounter,
    /// Finished requests by `finished_reason`.
    pub success: IntCounterVec,
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
            queue_time: hist(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent waiting in the queue in seconds.",
                REQUEST_BUCKETS,
            )?,
            prompt_tokens: IntCounter::with_opts(opts(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
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

    /// Records the cache configuration as `vllm:cache_config_info` labels.
    pub fn set_cache_config(
        &self,
        block_size: usize,
        blocks: usize,
        utilization: f64,
        prefix: bool,
    ) {
        self.cache_info
            .with_label_values(&[
                &block_size.to_string(),
                &blocks.to_string(),
                &utilization.to_string(),
                &prefix.to_string(),
            ])
            .set(1.0);
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
            self.render_stages(&engine.stage_stats(), &mut text);
        }
        text
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
        let name = self.model_name.replace('\\', "\\\\").replace('"', "\\\"");
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
