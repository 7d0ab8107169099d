//! The engine: one thread owns the model, the paged KV cache and the scheduler
//! ([`step`]); requests arrive through a cheap-to-clone [`EngineHandle`], each taking a
//! permit of the waiting bound, and stream their tokens back on their own channel
//! ([`stream`]). A request whose receiver is dropped (the client went away) is cancelled
//! and its blocks freed in the next step.

mod step;
mod stream;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::unbounded_channel;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use step::{StepObserver, StepView};
pub use stream::{Collected, Collector, Event, Finish, RequestStream};

use crate::error::{ConfigError, Error, RequestError, Result};
use crate::kv::budget::{self, CachePlan, CacheRequest};
use crate::kv::{KvDtype, KvElementType};
use crate::model::{Llama, LoadedModel, ModelConfig};
use crate::parallel::tensor::MAX_TENSOR_RANKS;
use crate::parallel::{Pipeline, StageStats};
use crate::sampling::SamplingParams;
use step::{EngineLoop, Request};

/// How the engine sizes its cache and batches; the fields carry vLLM's names.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus completion; `None` is the model's context length.
    pub max_model_len: Option<usize>,
    /// Fraction of device memory for weights, activations and KV cache.
    pub gpu_memory_utilization: f64,
    /// KV cache size in bytes, overriding the fraction.
    pub kv_cache_memory: Option<u64>,
    /// Share KV blocks between requests with a common prefix.
    pub enable_prefix_caching: bool,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Tensor-parallel ranks on one host, each holding 1/T of every layer (a divisor of the
    /// model's KV heads).
    pub tensor_parallel_size: usize,
    /// Pipeline stages, each its own process holding a contiguous range of layers.
    pub pipeline_parallel_size: usize,
    /// Most requests accepted and not yet started at any instant; a submission beyond it
    /// is refused with [`Error::QueueFull`].
    pub max_waiting_requests: usize,
    /// Where to compute.
    pub device: ComputeDevice,
}

/// Where the engine computes (vLLM's `--device`). Only the CPU is built: asking for a GPU
/// is refused at startup rather than leaving the GPU idle while looking used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    /// The CPU (the only device there is a backend for).
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU: refused, there is no GPU backend.
    Cuda,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            gpu_memory_utilization: 0.9,
            kv_cache_memory: None,
            enable_prefix_caching: true,
            kv_dtype: KvDtype::Auto,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            max_waiting_requests: 1024,
            device: ComputeDevice::Auto,
        }
    }
}

impl EngineConfig {
    /// Checks every setting against the model; returns the longest sequence they allow.
    pub fn validate(&self, model: &ModelConfig) -> Result<usize, ConfigError> {
        if self.device == ComputeDevice::Cuda {
            return Err(ConfigError::Unsupported {
                setting: "device",
                value: "cuda".into(),
                reason: "Ferrite's engine computes on CPU only: it has no GPU backend, so the \
                         GPUs given to it would sit idle. Remove spec.gpuResource (and any GPU \
                         requests) from the LLMService to run it on CPU"
                    .into(),
            });
        }
        check_tensor_split(self.tensor_parallel_size, model.num_kv_heads)?;
        if !(1..=model.num_layers.max(1)).contains(&self.pipeline_parallel_size) {
            return Err(ConfigError::OutOfRange {
                setting: "pipeline_parallel_size",
                range: format!("from 1 to the model's {} layers", model.num_layers),
                got: self.pipeline_parallel_size.to_string(),
            });
        }
        let max_model_len = self.max_model_len.unwrap_or(model.max_position_embeddings);
        if max_model_len > model.max_position_embeddings {
            return Err(ConfigError::OutOfRange {
                setting: "max_model_len",
                range: format!(
                    "at most the model's context length {}",
                    model.max_position_embeddings
                ),
                got: max_model_len.to_string(),
            });
        }
        for (setting, v) in [
            ("max_model_len", max_model_len),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_waiting_requests", self.max_waiting_requests),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { setting });
            }
        }
        if !(1..=crate::kv::MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(ConfigError::OutOfRange {
                setting: "block_size",
                range: format!("between 1 and {} tokens", crate::kv::MAX_BLOCK_SIZE),
                got: self.block_size.to_string(),
            });
        }
        Ok(max_model_len)
    }
}

/// Gauges and counters of the engine, updated every step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Sequences in the running batch.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Blocks held by sequences.
    pub used_blocks: usize,
    /// Blocks holding reusable prefixes that nobody uses.
    pub cached_blocks: usize,
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Sequences preempted (and recomputed later) so far.
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found there.
    pub prefix_hits: u64,
    /// Prompt tokens computed (not served from the prefix cache).
    pub computed_prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Steps run.
    pub steps: u64,
    /// Tokens each step computed (prompt and generated), as histogram buckets.
    pub iteration_tokens: IterationTokens,
}

/// Upper bounds of [`IterationTokens`]' buckets: vLLM's `vllm:iteration_tokens_total` buckets.
pub const ITERATION_TOKEN_BUCKETS: [u64; 13] = [
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
];

/// A histogram of tokens per step, kept with the engine's counters so every way of running
/// the loop (one process, a pipeline leader) feeds it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IterationTokens {
    /// Steps with at most [`ITERATION_TOKEN_BUCKETS`]`[i]` tokens, not cumulative; the last
    /// entry counts the steps above every bound.
    pub buckets: [u64; ITERATION_TOKEN_BUCKETS.len() + 1],
    /// Tokens over every step.
    pub sum: u64,
}

impl IterationTokens {
    /// Counts one step of `tokens` tokens.
    pub fn observe(&mut self, tokens: u64) {
        let i = ITERATION_TOKEN_BUCKETS
            .iter()
            .position(|&b| tokens <= b)
            .unwrap_or(ITERATION_TOKEN_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += tokens;
    }
}

/// Fixed facts about the running engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// The cache's size and how it was derived.
    pub cache: CachePlan,
    /// Longest prompt plus completion.
    pub max_model_len: usize,
    /// Vocabulary size of the model.
    pub vocab_size: usize,
    /// The `--gpu-memory-utilization` the cache was sized with.
    pub utilization: f64,
    /// Whether prefix caching is on.
    pub prefix_caching: bool,
    /// Most requests that may wait for their first step.
    pub max_waiting_requests: usize,
}

/// What the handles and the engine thread share.
struct Shared {
    info: EngineInfo,
    stats: Mutex<EngineStats>,
    next_id: AtomicU64,
    /// Whether the engine thread is still running (false once it has ended, by a panic too).
    running: AtomicBool,
    /// One permit per request that may wait: taken at submission, given back by the request
    /// when it is first scheduled (or dropped), so the bound holds at every instant.
    admission: Arc<Semaphore>,
    /// Each pipeline stage's counters, when the model runs as a group.
    stages: Option<Arc<Mutex<Vec<StageStats>>>>,
    /// Set by [`EngineHandle::stop`]: the engine thread ends once it has nothing to run.
    stop: AtomicBool,
    /// When the engine thread last made progress (finished a step, or found nothing to do),
    /// in milliseconds since `started`.
    progress_ms: AtomicU64,
    started: std::time::Instant,
}

impl Shared {
    /// Records that the engine thread made progress now.
    fn progressed(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.progress_ms.store(ms, Ordering::Release);
    }
}

/// An engine thread that has made no progress while requests waited for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    /// How long since it last made progress.
    pub for_: std::time::Duration,
    /// Requests accepted and not finished: running, waiting, and submitted but not admitted.
    pub pending: usize,
}

/// Clears [`Shared::running`] when the engine thread ends, however it ends: dropped on return
/// and while a panic unwinds, so a dead engine never passes for a live one.
struct RunningFlag(Arc<Shared>);

impl Drop for RunningFlag {
    fn drop(&mut self) {
        self.0.running.store(false, Ordering::Release);
    }
}

/// A handle to the engine thread; clones share it. The thread stops when every handle is
/// dropped and the last request has finished.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Request>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.shared.info)
            .finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Checks `config`, sizes the cache, then starts the engine thread with `model`.
    pub fn start(model: LoadedModel, config: EngineConfig) -> Result<Self> {
        Self::start_observed(model, config, None)
    }

    /// [`EngineHandle::start`] with an observer shown the engine's state after every step
    /// (a benchmark's measurements; nothing is computed for it when there is none).
    pub fn start_observed(
        model: LoadedModel,
        config: EngineConfig,
        observer: Option<Box<dyn StepObserver>>,
    ) -> Result<Self> {
        Self::start_with(model, config, observer, None)
    }

    /// Starts the engine as the leader of a pipeline group: `model` holds the first stage,
    /// `pipeline` reaches the others, and the cache holds as many blocks as the smallest
    /// stage's budget allows (each stage's is logged, and which one bounds the group).
    pub fn start_pipeline(
        model: LoadedModel,
        config: EngineConfig,
        pipeline: Pipeline,
    ) -> Result<Self> {
        Self::start_with(model, config, None, Some(pipeline))
    }

    fn start_with(
        model: LoadedModel,
        config: EngineConfig,
        observer: Option<Box<dyn StepObserver>>,
        pipeline: Option<Pipeline>,
    ) -> Result<Self> {
        let c = model.model.config().clone();
        let max_model_len = config.validate(&c)?;
        for (setting, size) in [
            ("pipeline_parallel_size", config.pipeline_parallel_size),
            ("tensor_parallel_size", config.tensor_parallel_size),
        ] {
            if size > 1 && pipeline.is_none() {
                return Err(ConfigError::Unsupported {
                    setting,
                    value: size.to_string(),
                    reason: "model-parallel ranks run as a group of processes, which \
                             `ferrite-engine serve` starts; this command runs the model in one"
                        .into(),
                }
                .into());
            }
        }
        if let Some(message) = ferrite_kernels::cpu::tier_cap_error() {
            return Err(ConfigError::Input {
                what: ferrite_kernels::cpu::TIER_CAP_VAR.into(),
                message,
            }
            .into());
        }
        tracing::info!(
            "kernel tiers: {}; 32-value batch kernel: {}",
            ferrite_kernels::cpu::detect().tiers().join(", "),
            ferrite_kernels::cpu::full_width_512_words(ferrite_kernels::cpu::full_width_512())
        );
        if let Some(gpus) = visible_gpus() {
            tracing::warn!(
                "GPUs are visible to this process (NVIDIA_VISIBLE_DEVICES={gpus}) but unused: \
                 Ferrite's engine computes on CPU"
            );
        }
        let kv = config.kv_dtype.resolve(&model.model);
        let mut plan = plan_cache(&model.model, &config, kv, max_model_len)?;
        if let Some(p) = &pipeline {
            plan = group_plan(plan, &model.model, p);
        }
        let stages = pipeline.as_ref().map(Pipeline::stats);
        let info = EngineInfo {
            cache: plan,
            max_model_len,
            vocab_size: c.vocab_size,
            utilization: config.gpu_memory_utilization,
            prefix_caching: config.enable_prefix_caching,
            max_waiting_requests: config.max_waiting_requests,
        };
        let (handle, _thread) = Self::spawn(info, stages, move |rx, shared| {
            EngineLoop::new(model, &config, kv, shared, observer, pipeline).run(rx)
        })?;
        Ok(handle)
    }

    /// Starts the engine thread: `body` gets the request channel and the shared state, and
    /// the running flag is cleared however `body` ends.
    fn spawn(
        info: EngineInfo,
        stages: Option<Arc<Mutex<Vec<StageStats>>>>,
        body: impl FnOnce(mpsc::Receiver<Request>, Arc<Shared>) + Send + 'static,
    ) -> Result<(Self, std::thread::JoinHandle<()>)> {
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats {
                total_blocks: info.cache.num_blocks,
                ..Default::default()
            }),
            admission: Arc::new(Semaphore::new(info.max_waiting_requests)),
            info,
            next_id: AtomicU64::new(0),
            running: AtomicBool::new(true),
            stages,
            stop: AtomicBool::new(false),
            progress_ms: AtomicU64::new(0),
            started: std::time::Instant::now(),
        });
        let (tx, rx) = mpsc::channel();
        let flag = RunningFlag(Arc::clone(&shared));
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ferrite-engine".into())
            .spawn(move || {
                let _running = flag;
                body(rx, thread_shared)
            })?;
        Ok((EngineHandle { tx, shared }, thread))
    }

    /// Ends the engine thread once every sequence it holds has finished, and waits up to
    /// `timeout` for it to end; returns whether it did. Its model goes with it — for a
    /// pipeline group's leader, that tells every other stage the group is over. Requests
    /// submitted afterwards are refused as after any engine's end.
    pub fn stop(&self, timeout: std::time::Duration) -> bool {
        self.shared.stop.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + timeout;
        while self.shared.running.load(Ordering::Acquire) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// Facts about the engine (cache size, limits).
    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
    }

    /// Each pipeline stage's counters (the leader's own first), when the model runs as a
    /// group; empty otherwise.
    pub fn stage_stats(&self) -> Vec<StageStats> {
        self.shared
            .stages
            .as_ref()
            .and_then(|s| s.lock().ok().map(|s| s.clone()))
            .unwrap_or_default()
    }

    /// A snapshot of the engine's gauges and counters.
    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Queues a request after checking it could ever be served; tokens arrive on the
    /// returned stream. Dropping the stream cancels the request. Refused with
    /// [`Error::QueueFull`] when [`EngineConfig::max_waiting_requests`] requests are already
    /// waiting.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream> {
        let mut streams = self.submit_all(vec![(prompt, params)])?;
        streams
            .pop()
            .ok_or_else(|| Error::internal("one request submitted, no stream returned"))
    }

    /// Queues several requests together (the prompts and choices of one API call): every
    /// one is checked first, then all are admitted or none is.
    pub fn submit_all(
        &self,
        requests: Vec<(Vec<u32>, SamplingParams)>,
    ) -> Result<Vec<RequestStream>> {
        for (prompt, params) in &requests {
            self.check(prompt, params)?;
        }
        let limit = self.shared.info.max_waiting_requests;
        if requests.len() > limit {
            return Err(RequestError::TooManyRequests {
                requests: requests.len(),
                limit,
            }
            .into());
        }
        let Some(mut permits) = u32::try_from(requests.len()).ok().and_then(|n| {
            Arc::clone(&self.shared.admission)
                .try_acquire_many_owned(n)
                .ok()
        }) else {
            return Err(Error::QueueFull { limit });
        };
        // One permit per request, each released by its own request.
        let mut singles: Vec<OwnedSemaphorePermit> = (1..requests.len())
            .filter_map(|_| permits.split(1))
            .collect();
        singles.push(permits);
        let mut streams = Vec::with_capacity(requests.len());
        for ((prompt, params), admission) in requests.into_iter().zip(singles) {
            let (events, rx) = unbounded_channel();
            let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
            self.tx
                .send(Request {
                    arrived: Instant::now(),
                    id,
                    prompt,
                    params,
                    events,
                    admission,
                })
                .map_err(|_| Error::EngineStopped)?;
            streams.push(RequestStream { rx });
        }
        Ok(streams)
    }

    /// Whether `prompt` with `params` could ever be served by this engine.
    fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<(), RequestError> {
        params.validate()?;
        let info = &self.shared.info;
        let vocab = info.vocab_size;
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if let Some(&(id, _)) = params
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= vocab)
        {
            return Err(RequestError::TokenOutOfVocab {
                param: "logit_bias",
                id,
                vocab,
            });
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(RequestError::PromptToken { id, vocab });
        }
        if prompt.len() + params.max_tokens > info.max_model_len {
            return Err(RequestError::ContextTooLong {
                max: info.max_model_len,
                prompt: prompt.len(),
                completion: params.max_tokens,
            });
        }
        Ok(())
    }

    /// Whether the engine thread is still running: false once it has ended, by a panic too
    /// (then nothing more can be served and the process should be restarted).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Acquire)
    }

    /// The stall, when the engine thread has made no progress for at least `after` while
    /// requests are pending (a step that never returns: a stage or device that hangs). An
    /// idle engine is never stalled.
    pub fn stalled(&self, after: std::time::Duration) -> Option<Stall> {
        let now = self.shared.started.elapsed().as_millis() as u64;
        let last = self.shared.progress_ms.load(Ordering::Acquire);
        let for_ = std::time::Duration::from_millis(now.saturating_sub(last));
        if for_ < after {
            return None;
        }
        let (running, waiting) = self
            .shared
            .stats
            .lock()
            .map(|s| (s.running, s.waiting))
            .unwrap_or((0, 0));
        let submitted = self
            .shared
            .info
            .max_waiting_requests
            .saturating_sub(self.shared.admission.available_permits());
        let pending = running + waiting.max(submitted);
        (pending > 0).then_some(Stall { for_, pending })
    }

    /// For tests without a model: a handle whose engine thread runs `body` instead of the
    /// loop, started as the real one is; returns the thread to join.
    #[cfg(test)]
    pub(crate) fn with_thread(
        body: impl FnOnce(mpsc::Receiver<Request>) + Send + 'static,
    ) -> (Self, std::thread::JoinHandle<()>) {
        let info = EngineInfo {
            cache: CachePlan {
                num_blocks: 1,
                block_size: 16,
                kv_bytes: 0,
                explanation: String::new(),
            },
            max_model_len: 16,
            vocab_size: 16,
            utilization: 0.9,
            prefix_caching: false,
            max_waiting_requests: 4,
        };
        Self::spawn(info, None, |rx, _| body(rx)).expect("the thread starts")
    }
}

/// The GPUs a container runtime made visible, if any.
fn visible_gpus() -> Option<String> {
    std::env::var("NVIDIA_VISIBLE_DEVICES")
        .ok()
        .filter(|v| !matches!(v.trim(), "" | "void" | "none"))
}

/// Sizes the KV cache of `model` (the whole model, or the pipeline stage it holds) under
/// `config` for elements of `kv`, and logs the result.
pub fn plan_cache(
    model: &Llama,
    config: &EngineConfig,
    kv: KvElementType,
    max_model_len: usize,
) -> Result<CachePlan> {
    let c = model.local_config();
    let plan = budget::plan(
        &CacheRequest {
            utilization: config.gpu_memory_utilization,
            kv_cache_memory: config.kv_cache_memory,
            weight_bytes: model.resident_weight_bytes() as u64,
            activation_bytes: budget::activation_bytes(
                c,
                config.max_num_batched_tokens,
                config.max_num_seqs,
            ),
            bytes_per_token: budget::bytes_per_token(c, model.part().layers.len(), kv.bytes()),
            block_size: config.block_size,
            max_model_len,
        },
        budget::device_memory(),
    )?;
    tracing::info!(
        blocks = plan.num_blocks,
        tokens = plan.num_blocks * plan.block_size,
        "KV cache: {} blocks of {} tokens ({:.1} MiB from {})",
        plan.num_blocks,
        plan.block_size,
        plan.kv_bytes as f64 / (1 << 20) as f64,
        plan.explanation
    );
    Ok(tensor_plan(plan, model))
}

/// Refuses a tensor-parallel size that does not split `kv_heads` into whole heads per
/// rank, naming both numbers.
pub fn check_tensor_split(size: usize, kv_heads: usize) -> std::result::Result<(), ConfigError> {
    if size == 0 || size > MAX_TENSOR_RANKS {
        return Err(ConfigError::OutOfRange {
            setting: "tensor_parallel_size",
            range: format!("from 1 to {MAX_TENSOR_RANKS}, dividing the model's KV heads"),
            got: size.to_string(),
        });
    }
    if !kv_heads.is_multiple_of(size) {
        return Err(ConfigError::Unsupported {
            setting: "tensor_parallel_size",
            value: size.to_string(),
            reason: format!(
                "each tensor-parallel rank holds whole KV heads, and {size} does not divide the \
                 model's {kv_heads} KV heads; choose a divisor of {kv_heads}"
            ),
        });
    }
    Ok(())
}

/// The cache of a tensor-parallel stage: as many blocks as its smallest rank's budget
/// allows, every rank's weights and blocks logged.
fn tensor_plan(mut own: CachePlan, model: &Llama) -> CachePlan {
    let Some(group) = model.tensor_group().filter(|g| g.rank() == 0) else {
        return own;
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut smallest = (0, own.num_blocks as u64);
    for p in group.peers() {
        tracing::info!(
            "tensor rank {}: {:.1} MiB of weights, {} KV blocks",
            p.rank,
            mib(p.weight_bytes),
            p.kv_blocks
        );
        if p.kv_blocks < smallest.1 {
            smallest = (p.rank, p.kv_blocks);
        }
    }
    if smallest.0 != 0 {
        own.kv_bytes = own.kv_bytes / own.num_blocks.max(1) as u64 * smallest.1;
        own.num_blocks = smallest.1 as usize;
        own.explanation = format!("the smallest tensor rank's budget, rank {}", smallest.0);
    }
    own
}

/// The group's cache: as many blocks as the smallest stage's budget allows, with every
/// stage's part and budget logged and the stage that bounds the group named.
fn group_plan(mut own: CachePlan, model: &Llama, pipeline: &Pipeline) -> CachePlan {
    let part = model.part();
    let mut stages = vec![(
        0usize,
        part.layers.clone(),
        model.resident_weight_bytes() as u64,
        own.num_blocks as u64,
        own.explanation.clone(),
    )];
    stages.extend(pipeline.reports().map(|(rank, r)| {
        (
            rank,
            r.first_layer as usize..r.end_layer as usize,
            r.weight_bytes,
            r.kv_blocks,
            r.explanation.clone(),
        )
    }));
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for (rank, layers, weights, blocks, why) in &stages {
        tracing::info!(
            "pipeline stage {rank}: layers {}..{}, {:.1} MiB of weights, {blocks} KV blocks \
             ({why})",
            layers.start,
            layers.end,
            mib(*weights)
        );
    }
    if let Some((rank, _, _, blocks, why)) = stages.iter().min_by_key(|s| s.3) {
        tracing::info!(
            "the group's KV cache holds {blocks} blocks of {} tokens, bounded by stage {rank}",
            own.block_size
        );
        own.kv_bytes = own.kv_bytes / own.num_blocks.max(1) as u64 * *blocks;
        own.num_blocks = *blocks as usize;
        own.explanation = format!("the smallest stage's budget, stage {rank}: {why}");
    }
    own
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_thread_that_panics_is_reported_stopped_and_refuses_requests() {
        let (engine, thread) = EngineHandle::with_thread(|_rx| panic!("a bug in a step"));
        assert!(thread.join().is_err(), "the thread panicked");
        assert!(!engine.is_running());
        let err = engine
            .submit(vec![1, 2], SamplingParams::greedy(2))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("the engine has stopped; the server must be restarted")
        );
    }

    #[test]
    fn no_more_requests_are_accepted_than_may_wait_until_one_gives_its_place_back() {
        // An engine that holds every request it receives until told to drop one.
        let (drop_one, dropping) = mpsc::channel::<()>();
        let (engine, _thread) = EngineHandle::with_thread(move |rx| {
            let mut held: Vec<Request> = Vec::new();
            // Each signal drops one request: the channel is drained first, so the request
            // submitted before the signal is among those held.
            while dropping.recv().is_ok() {
                held.extend(rx.try_iter());
                drop(held.pop());
            }
        });
        let limit = engine.info().max_waiting_requests;
        let submit = || engine.submit(vec![1, 2], SamplingParams::greedy(2));
        let accepted: Vec<RequestStream> = (0..limit).map(|_| submit().expect("room")).collect();
        assert!(matches!(submit(), Err(Error::QueueFull { limit: l }) if l == limit));
        // Several at once are admitted together or not at all.
        let two = vec![(vec![1], SamplingParams::greedy(2)); 2];
        assert!(matches!(
            engine.submit_all(two),
            Err(Error::QueueFull { .. })
        ));
        drop_one.send(()).expect("engine listens");
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let again = loop {
            match submit() {
                Ok(s) => break s,
                Err(Error::QueueFull { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert!(matches!(submit(), Err(Error::QueueFull { .. })));
        drop((accepted, again));
    }

    #[test]
    fn a_running_engine_thread_is_reported_running() {
        let (stop, wait) = mpsc::channel::<()>();
        let (engine, thread) = EngineHandle::with_thread(move |_rx| {
            let _ = wait.recv();
        });
        assert!(engine.is_running());
        drop(stop);
        thread.join().expect("ends");
        assert!(
            !engine.is_running(),
            "a thread that returned is not running either"
        );
    }
}
