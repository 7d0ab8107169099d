//! The engine thread's loop, one step at a time in phases that hand data on, as vLLM v1's
//! engine core does: the scheduler plans the step ([`Scheduler::schedule`]), its inputs
//! are gathered ([`StepInput`]), the model runs them in one forward pass, and the output
//! updates every sequence — prompt scores, sampled tokens, events, finished sequences —
//! before the gauges are published. An optional [`StepObserver`] sees the state after
//! each step from outside the loop.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::OwnedSemaphorePermit;

use super::stream::{Event, Finish};
use super::{EngineConfig, Shared};
use crate::error::{Error, Result};
use crate::kv::cache::{new_paged, PagedCache};
use crate::kv::{BlockId, BlockPool, KvElementType};
use crate::model::llama::{Batch, Logits, SeqSlice};
use crate::model::LoadedModel;
use crate::parallel::Pipeline;
use crate::sampling::SamplingParams;
use crate::scheduler::{Scheduled, Scheduler, SchedulerConfig, Sequence};
use crate::sequence::{FinishReason, SequenceState, TokenOutput};

/// A request on its way to the engine thread.
pub(crate) struct Request {
    pub(super) arrived: Instant,
    pub(super) id: u64,
    pub(super) prompt: Vec<u32>,
    pub(super) params: SamplingParams,
    /// Where the request's events go.
    pub(crate) events: UnboundedSender<Event>,
    /// Its share of [`EngineConfig::max_waiting_requests`], released once it is scheduled.
    pub(super) admission: OwnedSemaphorePermit,
}

/// Where a sequence's events go, and when it arrived and was first scheduled.
pub(crate) struct Sink {
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

    /// Sends `seq`'s last event: why and how it ended.
    fn finish(seq: &Sequence<Sink>, reason: FinishReason) {
        let sink = &seq.sink;
        let queued = sink.scheduled.unwrap_or_else(Instant::now) - sink.arrived;
        let _ = sink.events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.tokens.len() - seq.prompt_len,
            cached_tokens: seq.cached_prompt_tokens,
            queue_seconds: queued.as_secs_f64(),
            scheduled: sink.scheduled,
            preemptions: seq.preemptions,
        }));
    }
}

/// Something shown the engine's state after every step, from outside the loop (the
/// benchmark measures the KV cache's fill this way).
pub trait StepObserver: Send {
    /// Called once after each step that ran.
    fn after_step(&mut self, view: &StepView<'_>);
}

/// The engine's state as an observer sees it after a step.
pub struct StepView<'a> {
    sched: &'a Scheduler<Sink>,
}

impl StepView<'_> {
    /// Cache slots the running sequences hold (their blocks × the block size).
    pub fn allocated_slots(&self) -> usize {
        let block = self.sched.pool().block_size();
        self.sched
            .running()
            .iter()
            .map(|s| s.blocks().len() * block)
            .sum()
    }

    /// Cache slots holding a computed token.
    pub fn filled_slots(&self) -> usize {
        self.sched.running().iter().map(|s| s.computed).sum()
    }
}

/// One step's model inputs, gathered from the plan.
#[derive(Debug, Default)]
struct StepInput {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    seqs: Vec<SeqSlice>,
    tables: Vec<Vec<BlockId>>,
    /// Token rows whose logits the step needs: scored prompt positions, and each sequence's
    /// last token where the step completes its tokens.
    rows: Vec<u32>,
    /// Prompt tokens this step computes.
    prompt_tokens: u64,
    /// Logits rows each planned sequence takes, in plan order.
    rows_per_seq: Vec<usize>,
}

/// A step sent into the pipeline whose logits have not come back.
#[derive(Debug)]
struct InFlight {
    plan: Vec<Scheduled>,
    prompt_tokens: u64,
    rows_per_seq: Vec<usize>,
}

/// What a step's output did to the sequences.
#[derive(Debug, Default)]
struct StepOutput {
    generated: u64,
    /// Indexes into the running batch of the sequences that finished, in order.
    finished: Vec<usize>,
}

/// The state the engine thread owns.
pub(super) struct EngineLoop {
    model: LoadedModel,
    cache: Box<dyn PagedCache>,
    sched: Scheduler<Sink>,
    shared: Arc<Shared>,
    observer: Option<Box<dyn StepObserver>>,
    /// The other stages, when the model runs as a pipeline group.
    pipeline: Option<Pipeline>,
    /// Steps sent through the pipeline, oldest first (at most one per stage).
    in_flight: std::collections::VecDeque<InFlight>,
}

impl EngineLoop {
    pub(super) fn new(
        model: LoadedModel,
        config: &EngineConfig,
        kv: KvElementType,
        shared: Arc<Shared>,
        observer: Option<Box<dyn StepObserver>>,
        pipeline: Option<Pipeline>,
    ) -> Self {
        let plan = &shared.info.cache;
        let pool = BlockPool::new(plan.num_blocks, plan.block_size);
        let sched = SchedulerConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            enable_prefix_caching: config.enable_prefix_caching,
        };
        EngineLoop {
            cache: new_paged(&model.model, kv, plan.block_size),
            model,
            sched: Scheduler::new(sched, pool),
            shared,
            observer,
            pipeline,
            in_flight: std::collections::VecDeque::new(),
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Request>) {
        let mut open = true;
        loop {
            let mut admitted = false;
            if self.sched.is_idle() {
                if !open || self.shared.stop.load(Ordering::Acquire) {
                    return;
                }
                // Idle: wait for a request, looking up now and then for a stop.
                self.shared.progressed();
                match rx.recv_timeout(std::time::Duration::from_millis(50)) {
                    Ok(req) => {
                        self.admit(req);
                        admitted = true;
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(req) => {
                        self.admit(req);
                        admitted = true;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if admitted {
                // The gauges show new work before a step that may never return (the stall
                // check reads them).
                self.publish();
            }
            drop(self.sched.remove_where(|s| s.sink.events.is_closed()));
            match self.step() {
                Ok(true) => {
                    self.shared.progressed();
                    if let Some(observer) = self.observer.as_mut() {
                        observer.after_step(&StepView { sched: &self.sched });
                    }
                }
                Ok(false) => {}
                Err(e @ Error::Group(_)) => {
                    // A stage is gone: no step can run again. Ending the thread ends every
                    // request's stream with an error and turns `/health` to 500.
                    tracing::error!("{e}; stopping the engine");
                    return;
                }
                Err(e) => {
                    tracing::error!("engine step failed: {e}");
                    // Nothing can be computed reliably any more: end every request with abort.
                    for seq in self.sched.abort_all() {
                        Sink::finish(&seq, FinishReason::Abort);
                    }
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

    /// Plans, runs and applies one step; false when there was nothing to run. Through a
    /// pipeline of P stages it first fills the pipeline — up to P steps in flight, each over
    /// about 1/P of the sequences and none in two — then applies the oldest.
    fn step(&mut self) -> Result<bool> {
        let Some(depth) = self.pipeline.as_ref().map(Pipeline::depth) else {
            let plan = self.sched.schedule();
            if plan.is_empty() {
                return Ok(false);
            }
            self.mark_scheduled(&plan);
            let mut input = self.gather(&plan);
            let mut logits = self.execute(&mut input, &plan)?;
            self.apply(plan, input.prompt_tokens, &input.rows_per_seq, &mut logits)?;
            return Ok(true);
        };
        while self.in_flight.len() < depth {
            // Each step takes its share of the sequences, so the next finds some to run.
            let plan = self.sched.schedule_at_most(self.sched.share(depth));
            if plan.is_empty() {
                break;
            }
            self.mark_scheduled(&plan);
            let input = self.gather(&plan);
            self.send(&input)?;
            self.in_flight.push_back(InFlight {
                plan,
                prompt_tokens: input.prompt_tokens,
                rows_per_seq: input.rows_per_seq,
            });
        }
        let Some(done) = self.in_flight.pop_front() else {
            return Ok(false);
        };
        let vocab = self.model.model.config().vocab_size;
        let pipeline = self
            .pipeline
            .as_mut()
            .ok_or_else(|| Error::internal("a step in flight without a pipeline"))?;
        let mut logits = pipeline.receive(vocab)?;
        self.apply(
            done.plan,
            done.prompt_tokens,
            &done.rows_per_seq,
            &mut logits,
        )?;
        Ok(true)
    }

    /// Applies a completed step's logits to the sequences it planned that are still there.
    fn apply(
        &mut self,
        plan: Vec<Scheduled>,
        prompt_tokens: u64,
        rows_per_seq: &[usize],
        logits: &mut Logits,
    ) -> Result<()> {
        self.sched.complete(&plan);
        let mut out = self.update_from_output(&plan, rows_per_seq, logits)?;
        out.finished.sort_unstable();
        for index in out.finished.into_iter().rev() {
            drop(self.sched.finish(index));
        }
        if let Ok(mut st) = self.shared.stats.lock() {
            st.steps += 1;
            st.iteration_tokens.observe(prompt_tokens + out.generated);
            st.generated_tokens += out.generated;
            st.computed_prompt_tokens += prompt_tokens;
        }
        Ok(())
    }

    /// Notes when each planned sequence was first scheduled; a started request gives its
    /// place in the waiting bound to the next one.
    fn mark_scheduled(&mut self, plan: &[Scheduled]) {
        let now = Instant::now();
        for s in plan {
            let sink = &mut self.sched.running_mut(s.index).sink;
            sink.scheduled.get_or_insert(now);
            sink.admission = None;
        }
    }

    /// The model inputs of `plan`: every planned token with its position, each sequence's
    /// slice and block table, and the rows whose logits are needed.
    fn gather(&self, plan: &[Scheduled]) -> StepInput {
        let mut input = StepInput::default();
        for (slot, s) in plan.iter().enumerate() {
            let seq = &self.sched.running()[s.index];
            let start = input.tokens.len();
            input
                .tokens
                .extend_from_slice(&seq.tokens[s.start..s.start + s.len]);
            input.positions.extend(s.start..s.start + s.len);
            input.seqs.push(SeqSlice {
                start,
                len: s.len,
                cache_slot: slot,
            });
            input.tables.push(seq.blocks().to_vec());
            let before = input.rows.len();
            input.rows.extend(
                seq.sink
                    .scored_positions(s)
                    .map(|p| (start + p - s.start) as u32),
            );
            if s.start + s.len == seq.tokens.len() {
                input.rows.push((start + s.len - 1) as u32);
            }
            input.rows_per_seq.push(input.rows.len() - before);
            input.prompt_tokens += seq.prompt_len.saturating_sub(s.start).min(s.len) as u64;
        }
        input
    }

    /// One forward pass over the step's tokens (the block tables go to the cache). The
    /// grammar masks of the constrained sequences that sample from this step are computed
    /// on a thread of their own meanwhile, so no sequence waits for them after the pass.
    fn execute(&mut self, input: &mut StepInput, plan: &[Scheduled]) -> Result<Logits> {
        let batch = Batch {
            tokens: &input.tokens,
            positions: &input.positions,
            seqs: &input.seqs,
        };
        let sampling: Vec<usize> = plan
            .iter()
            .filter(|s| {
                let seq = &self.sched.running()[s.index];
                s.start + s.len == seq.tokens.len() && seq.state.is_constrained()
            })
            .map(|s| s.index)
            .collect();
        let (model, cache) = (&self.model.model, &mut self.cache);
        cache.set_tables(std::mem::take(&mut input.tables));
        // One injection into the thread pool per step; its workers run the whole forward.
        let forward = |cache: &mut Box<dyn PagedCache>| {
            rayon::scope(|_| model.forward(&batch, cache.as_mut(), &input.rows))
        };
        if sampling.is_empty() {
            return forward(cache);
        }
        let states: Vec<&mut SequenceState> = self
            .sched
            .states_mut()
            .enumerate()
            .filter(|(i, _)| sampling.contains(i))
            .map(|(_, s)| s)
            .collect();
        std::thread::scope(|scope| {
            scope.spawn(move || states.into_iter().for_each(SequenceState::prepare_mask));
            forward(cache)
        })
    }

    /// Starts the step's tokens through the pipeline (the block tables go to every
    /// stage's cache); its logits come back in order, after any step sent before it.
    fn send(&mut self, input: &StepInput) -> Result<()> {
        let batch = Batch {
            tokens: &input.tokens,
            positions: &input.positions,
            seqs: &input.seqs,
        };
        let (model, cache) = (&self.model.model, &mut self.cache);
        let pipeline = self
            .pipeline
            .as_mut()
            .ok_or_else(|| Error::internal("a pipeline step without a pipeline"))?;
        cache.set_tables(input.tables.clone());
        // Not inside the thread pool: the pipeline waits on other stages, and a pool thread
        // held while waiting is one no stage can compute on.
        pipeline.send(model, &batch, &input.tables, cache.as_mut(), &input.rows)
    }

    /// Applies the logits to the planned sequences, in plan order: scores of prompt tokens,
    /// then a sampled token for each sequence whose tokens are all computed, its events,
    /// and whether it finished.
    fn update_from_output(
        &mut self,
        plan: &[Scheduled],
        rows_per_seq: &[usize],
        logits: &mut Logits,
    ) -> Result<StepOutput> {
        let mut rows = logits.rows_mut();
        let mut out = StepOutput::default();
        for (s, &taken) in plan.iter().zip(rows_per_seq) {
            // Cancelled while its step was in flight: its rows go unread.
            let Some(index) = self.sched.index_of(s) else {
                if taken > 0 {
                    let _ = rows.nth(taken - 1);
                }
                continue;
            };
            let seq = self.sched.running_mut(index);
            let positions = seq.sink.scored_positions(s);
            if let Some(scores) = seq.sink.prompt_scores.as_mut() {
                let k = seq.state.params().prompt_logprobs.unwrap_or(0);
                for p in positions {
                    let row = rows
                        .next()
                        .ok_or_else(|| Error::internal("fewer logits rows than scored tokens"))?;
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
            let row = rows
                .next()
                .ok_or_else(|| Error::internal("fewer logits rows than sampled sequences"))?;
            let step = seq.state.step(row, &self.model.tokenizer)?;
            out.generated += 1;
            seq.tokens.push(step.token.id);
            let _ = seq.sink.events.send(Event::Token {
                token: step.token,
                text: step.text,
            });
            if let Some(reason) = step.finished {
                Sink::finish(seq, reason);
                out.finished.push(index);
            }
        }
        Ok(out)
    }

    /// The gauges and counters handles read.
    fn publish(&self) {
        let pool = self.sched.pool();
        let prefix = pool.prefix_stats();
        if let Ok(mut st) = self.shared.stats.lock() {
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
