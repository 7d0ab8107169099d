//! The engine loop: one thread owns the model, the paged KV cache and the scheduler;
//! requests arrive through a cheap-to-clone [`EngineHandle`], and each request streams its
//! tokens back on its own channel. A request whose receiver is dropped (the client went
//! away) is cancelled and its blocks freed in the next step.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::kv::budget::{self, CachePlan, CacheRequest};
use crate::kv::cache::{new_paged, PagedCache};
use crate::kv::BlockPool;
use crate::model::llama::{Batch, KvDtype, SeqSlice};
use crate::model::LoadedModel;
use crate::sampling::SamplingParams;
use crate::scheduler::{Scheduled, Scheduler, SchedulerConfig};
use crate::sequence::{FinishReason, SequenceState, TokenOutput};

/// How the engine sizes its cache and batches.
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
    /// Devices a model is split across within a node; only 1 is built so far.
    pub tensor_parallel_size: usize,
    /// Pipeline stages; only 1 is built so far.
    pub pipeline_parallel_size: usize,
    /// Most requests accepted and not yet started at any instant; a submission beyond it
    /// is refused with [`Error::QueueFull`].
    pub max_waiting_requests: usize,
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
        }
    }
}

/// What a request's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token and the text it completes.
    Token {
        /// The token and its log-probabilities.
        token: TokenOutput,
        /// Text that may be shown (stop-string prefixes are held back).
        text: String,
    },
    /// The prompt's tokens after the first, each scored given the tokens before it (asked
    /// for with `prompt_logprobs`); comes once, before the first token.
    PromptLogprobs(Vec<TokenOutput>),
    /// The request ended; nothing follows.
    Finished(Finish),
}

/// How a request ended, with its token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    /// Why generation stopped.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Seconds from arrival until the request was first scheduled.
    pub queue_seconds: f64,
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
    /// Most cache slots the running sequences held at once (blocks × block size).
    pub peak_allocated_slots: usize,
    /// Slots holding a token at the first step that reached that peak (the emptiest
    /// moment of the peak: new blocks have just been taken).
    pub filled_at_peak: usize,
    /// Steps that ended holding the peak number of slots.
    pub steps_at_peak: u64,
    /// Slots holding a token, summed over those steps (their mean fill is this divided by
    /// `steps_at_peak`).
    pub filled_over_peak_steps: u64,
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

/// Where a sequence's events go, and when it arrived and was first scheduled.
struct Sink {
    events: UnboundedSender<Event>,
    arrived: Instant,
    scheduled: Option<Instant>,
    /// With `prompt_logprobs`, until they are sent: the scores of prompt tokens `1..`, by
    /// position (a sequence preempted before sending recomputes and overwrites them).
    prompt_scores: Option<Vec<Option<TokenOutput>>>,
    /// The request's place in the waiting bound, held until it is first scheduled.
    admission: Option<OwnedSemaphorePermit>,
}

impl Sink {
    /// The positions of `s` (a sequence's share of the step) whose logits score a prompt
    /// token (position `p` scores token `p + 1`): none once the scores are sent, or if never
    /// asked for.
    fn scored_positions(&self, s: &Scheduled) -> std::ops::Range<usize> {
        let end = self.prompt_scores.as_ref().map_or(0, Vec::len);
        s.start.min(end)..(s.start + s.len).min(end)
    }

    fn finish(&self, seq_prompt: usize, seq_len: usize, cached: usize, reason: FinishReason) {
        let queued = self.scheduled.unwrap_or_else(Instant::now) - self.arrived;
        let _ = self.events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: seq_prompt,
            completion_tokens: seq_len - seq_prompt,
            cached_tokens: cached,
            queue_seconds: queued.as_secs_f64(),
        }));
    }
}

/// A request on its way to the engine thread.
pub(crate) struct Request {
    arrived: Instant,
    id: u64,
    prompt: Vec<u32>,
    params: SamplingParams,
    /// Where the request's events go.
    pub(crate) events: UnboundedSender<Event>,
    /// Its share of [`EngineConfig::max_waiting_requests`], released once it is scheduled.
    admission: OwnedSemaphorePermit,
}

struct Shared {
    info: EngineInfo,
    stats: Mutex<EngineStats>,
    next_id: AtomicU64,
    /// Whether the engine thread is still running (false once it has ended, by a panic too).
    running: AtomicBool,
    /// One permit per request that may wait: taken at submission, given back by the request
    /// when it is first scheduled (or dropped), so the bound holds at every instant.
    admission: Arc<Semaphore>,
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

/// A whole completion, collected from its stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// The prompt's tokens after the first, scored (with `prompt_logprobs`).
    pub prompt: Option<Vec<TokenOutput>>,
    /// The generated tokens.
    pub tokens: Vec<TokenOutput>,
    /// Their text.
    pub text: String,
    /// How the request ended.
    pub finish: Finish,
}

/// The tokens of one request as they are produced.
#[derive(Debug)]
pub struct RequestStream {
    rx: UnboundedReceiver<Event>,
}

impl RequestStream {
    /// The next event, waiting for it (for async callers).
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event, blocking the thread (for synchronous callers, outside a runtime).
    pub fn next_blocking(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    /// Waits for the whole completion: its tokens, text and how it ended.
    pub fn collect_blocking(self) -> Result<(Vec<TokenOutput>, String, Finish)> {
        self.collect_scored_blocking()
            .map(|c| (c.tokens, c.text, c.finish))
    }

    /// [`RequestStream::collect_blocking`] with the prompt's scores, if the request asked
    /// for them (`prompt_logprobs`).
    pub fn collect_scored_blocking(mut self) -> Result<Collected> {
        let (mut prompt, mut tokens, mut text) = (None, Vec::new(), String::new());
        while let Some(ev) = self.next_blocking() {
            match ev {
                Event::PromptLogprobs(scores) => prompt = Some(scores),
                Event::Token { token, text: t } => {
                    tokens.push(token);
                    text.push_str(&t);
                }
                Event::Finished(finish) => {
                    return Ok(Collected {
                        prompt,
                        tokens,
                        text,
                        finish,
                    })
                }
            }
        }
        Err(Error::EngineStopped)
    }
}

impl EngineHandle {
    /// Sizes the cache, then starts the engine thread with `model`.
    pub fn start(model: LoadedModel, config: EngineConfig) -> Result<Self> {
        for (flag, v) in [
            ("--tensor-parallel-size", config.tensor_parallel_size),
            ("--pipeline-parallel-size", config.pipeline_parallel_size),
        ] {
            if v != 1 {
                return Err(Error::InvalidParameter(format!(
                    "{flag} {v}: model parallelism is not built yet; this engine runs a model on \
                     one device, so use {flag} 1"
                )));
            }
        }
        let c = model.model.config().clone();
        let max_model_len = config.max_model_len.unwrap_or(c.max_position_embeddings);
        if max_model_len > c.max_position_embeddings {
            return Err(Error::InvalidParameter(format!(
                "--max-model-len {max_model_len} is longer than the model's context length {}",
                c.max_position_embeddings
            )));
        }
        let check = |name: &str, v: usize| {
            if v == 0 {
                Err(Error::InvalidParameter(format!(
                    "{name} must be at least 1"
                )))
            } else {
                Ok(())
            }
        };
        check("--max-model-len", max_model_len)?;
        if !(1..=crate::kv::MAX_BLOCK_SIZE).contains(&config.block_size) {
            return Err(Error::InvalidParameter(format!(
                "--block-size must be between 1 and {} tokens, got {}",
                crate::kv::MAX_BLOCK_SIZE,
                config.block_size
            )));
        }
        check("--max-num-seqs", config.max_num_seqs)?;
        check("--max-waiting-requests", config.max_waiting_requests)?;
        check("--max-num-batched-tokens", config.max_num_batched_tokens)?;
        let f16 = match config.kv_dtype {
            KvDtype::F16 => true,
            KvDtype::F32 => false,
            KvDtype::Auto => model.model.kv_prefers_f16(),
        };
        let element_bytes = if f16 { 2 } else { 4 };
        let plan = budget::plan(
            &CacheRequest {
                utilization: config.gpu_memory_utilization,
                kv_cache_memory: config.kv_cache_memory,
                weight_bytes: model.model.resident_weight_bytes() as u64,
                activation_bytes: budget::activation_bytes(
                    &c,
                    config.max_num_batched_tokens,
                    config.max_num_seqs,
                ),
                bytes_per_token: budget::bytes_per_token(&c, element_bytes),
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
        let cache = new_paged(&model.model, config.kv_dtype, plan.block_size);
        let info = EngineInfo {
            cache: plan.clone(),
            max_model_len,
            vocab_size: c.vocab_size,
            utilization: config.gpu_memory_utilization,
            prefix_caching: config.enable_prefix_caching,
            max_waiting_requests: config.max_waiting_requests,
        };
        let sched = SchedulerConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            enable_prefix_caching: config.enable_prefix_caching,
        };
        let (handle, _thread) = Self::spawn(info, move |rx, shared| {
            let pool = BlockPool::new(plan.num_blocks, plan.block_size);
            EngineLoop {
                model,
                cache,
                sched: Scheduler::new(sched, pool),
                shared,
            }
            .run(rx)
        })?;
        Ok(handle)
    }

    /// Starts the engine thread: `body` gets the request channel and the shared state, and
    /// the running flag is cleared however `body` ends.
    fn spawn(
        info: EngineInfo,
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
        });
        let (tx, rx) = mpsc::channel();
        let flag = RunningFlag(Arc::clone(&shared));
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ferrite-engine".into())
            .spawn(move || {
                let _running = flag;
                body(rx, thread_shared)
            })
            .map_err(|e| Error::InvalidParameter(format!("cannot start the engine thread: {e}")))?;
        Ok((EngineHandle { tx, shared }, thread))
    }

    /// Facts about the engine (cache size, limits).
    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
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
        streams.pop().ok_or(Error::EngineStopped)
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
            return Err(Error::InvalidParameter(format!(
                "`n` times the prompts gives {} requests, more than the {limit} that may wait at \
                 once (--max-waiting-requests)",
                requests.len()
            )));
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
    fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        params.validate()?;
        let info = &self.shared.info;
        if prompt.is_empty() {
            return Err(Error::InvalidParameter(
                "the prompt must contain at least one token".into(),
            ));
        }
        if let Some(&(bad, _)) = params
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= info.vocab_size)
        {
            return Err(Error::InvalidParameter(format!(
                "`logit_bias` holds token id {bad}, beyond the vocabulary of {} tokens",
                info.vocab_size
            )));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Error::InvalidParameter(format!(
                "token id {bad} is out of range: the vocabulary has {} tokens",
                info.vocab_size
            )));
        }
        let total = prompt.len() + params.max_tokens;
        if total > info.max_model_len {
            return Err(Error::InvalidParameter(format!(
                "this model's maximum context length is {} tokens, but {} were requested ({} in \
                 the prompt, {} for the completion); reduce the prompt or `max_tokens`",
                info.max_model_len,
                total,
                prompt.len(),
                params.max_tokens
            )));
        }
        Ok(())
    }

    /// Whether the engine thread is still running: false once it has ended, by a panic too
    /// (then nothing more can be served and the process should be restarted).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Acquire)
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
        Self::spawn(info, |rx, _| body(rx)).expect("the thread starts")
    }
}

struct EngineLoop {
    model: LoadedModel,
    cache: Box<dyn PagedCache>,
    sched: Scheduler<Sink>,
    shared: Arc<Shared>,
}

impl EngineLoop {
    fn run(mut self, rx: mpsc::Receiver<Request>) {
        let mut open = true;
        loop {
            if self.sched.is_idle() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(req) => self.admit(req),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(req) => self.admit(req),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            drop(self.sched.remove_where(|s| s.sink.events.is_closed()));
            if let Err(e) = self.step() {
                tracing::error!("engine step failed: {e}");
                // Nothing can be computed reliably any more: end every request with abort.
                for seq in self.sched.abort_all() {
                    let (p, n, c) = (seq.prompt_len, seq.tokens.len(), seq.cached_prompt_tokens);
                    seq.sink.finish(p, n, c, FinishReason::Abort);
                }
            }
            self.publish();
        }
    }

    fn admit(&mut self, req: Request) {
        let sink = Sink {
            events: req.events,
            arrived: req.arrived,
            scheduled: None,
            prompt_scores: req
                .params
                .prompt_logprobs
                .map(|_| vec![None; req.prompt.len().saturating_sub(1)]),
            admission: Some(req.admission),
        };
        let state = SequenceState::new(
            &req.prompt,
            req.params,
            self.model.tokenizer.stop_token_ids(),
        );
        self.sched.add(req.id, req.prompt, state, sink);
    }

    fn step(&mut self) -> Result<()> {
        let plan = self.sched.schedule();
        if plan.is_empty() {
            return Ok(());
        }
        let (mut tokens, mut positions, mut seqs, mut tables, mut rows) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut prompt_tokens = 0u64;
        let now = Instant::now();
        for s in &plan {
            let sink = &mut self.sched.running_mut(s.index).sink;
            sink.scheduled.get_or_insert(now);
            // Started: its place in the waiting bound goes to the next request.
            sink.admission = None;
        }
        for (slot, s) in plan.iter().enumerate() {
            let seq = &self.sched.running()[s.index];
            let start = tokens.len();
            tokens.extend_from_slice(&seq.tokens[s.start..s.start + s.len]);
            positions.extend(s.start..s.start + s.len);
            seqs.push(SeqSlice {
                start,
                len: s.len,
                cache_slot: slot,
            });
            tables.push(seq.blocks().to_vec());
            rows.extend(
                seq.sink
                    .scored_positions(s)
                    .map(|p| (start + p - s.start) as u32),
            );
            if s.start + s.len == seq.tokens.len() {
                rows.push((start + s.len - 1) as u32);
            }
            prompt_tokens += seq.prompt_len.saturating_sub(s.start).min(s.len) as u64;
        }
        self.cache.set_tables(tables);
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            seqs: &seqs,
        };
        let (model, cache) = (&self.model.model, &mut self.cache);
        // One injection into the thread pool per step; its workers run the whole forward.
        let mut all = rayon::scope(|_| model.forward(&batch, cache.as_mut(), &rows))?;
        let mut logits = all.rows_mut();
        self.sched.complete(&plan);
        let mut finished = Vec::new();
        let mut generated = 0u64;
        for s in &plan {
            let seq = self.sched.running_mut(s.index);
            let positions = seq.sink.scored_positions(s);
            if let Some(scores) = seq.sink.prompt_scores.as_mut() {
                let k = seq.state.params().prompt_logprobs.unwrap_or(0);
                for p in positions {
                    let Some(row) = logits.next() else { break };
                    scores[p] = Some(TokenOutput::scored(seq.tokens[p + 1], row, k));
                }
            }
            if seq.computed != seq.tokens.len() {
                continue;
            }
            if let Some(scores) = seq.sink.prompt_scores.take() {
                let scores = scores.into_iter().flatten().collect();
                let _ = seq.sink.events.send(Event::PromptLogprobs(scores));
            }
            let Some(row) = logits.next() else { break };
            let step = seq.state.step(row, &self.model.tokenizer)?;
            generated += 1;
            seq.tokens.push(step.token.id);
            let _ = seq.sink.events.send(Event::Token {
                token: step.token,
                text: step.text,
            });
            if let Some(reason) = step.finished {
                let (p, n, c) = (seq.prompt_len, seq.tokens.len(), seq.cached_prompt_tokens);
                seq.sink.finish(p, n, c, reason);
                finished.push(s.index);
            }
        }
        for index in finished.into_iter().rev() {
            drop(self.sched.finish(index));
        }
        if let Ok(mut st) = self.shared.stats.lock() {
            st.steps += 1;
            st.generated_tokens += generated;
            st.computed_prompt_tokens += prompt_tokens;
        }
        Ok(())
    }

    fn publish(&self) {
        let pool = self.sched.pool();
        let prefix = pool.prefix_stats();
        let running = self.sched.running();
        let allocated: usize = running
            .iter()
            .map(|s| s.blocks().len() * pool.block_size())
            .sum();
        let filled: usize = running.iter().map(|s| s.computed).sum();
        if let Ok(mut st) = self.shared.stats.lock() {
            if allocated > st.peak_allocated_slots {
                st.peak_allocated_slots = allocated;
                st.filled_at_peak = filled;
                st.steps_at_peak = 1;
                st.filled_over_peak_steps = filled as u64;
            } else if allocated == st.peak_allocated_slots && allocated > 0 {
                st.steps_at_peak += 1;
                st.filled_over_peak_steps += filled as u64;
            }
            st.running = self.sched.running().len();
            st.waiting = self.sched.num_waiting();
            st.used_blocks = pool.num_used();
            st.cached_blocks = pool.num_cached();
            st.preemptions = self.sched.preemptions();
            st.prefix_queries = prefix.queries;
            st.prefix_hits = prefix.hits;
        }
    }
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
