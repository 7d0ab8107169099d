//! Continuous (iteration-level) batching, as vLLM's scheduler does it: every step keeps
//! decoding the running sequences, admits waiting ones first-come-first-served while the
//! sequence, token and block budgets allow, splits long prompts into chunks, and — when a
//! running sequence needs a block and none is left — preempts the most recently admitted
//! sequence, which gives its blocks back and is recomputed later. A sequence in a step
//! still in flight (a pipeline keeps several) is neither planned again nor preempted until
//! that step completes.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use crate::kv::{block_hash, BlockId, BlockPool};
use crate::sequence::SequenceState;

/// The budgets the scheduler keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one step.
    pub max_num_batched_tokens: usize,
    /// Reuse full blocks whose tokens and prefix match an earlier request's.
    pub enable_prefix_caching: bool,
}

/// A sequence's blocks, given back to the pool when the table is dropped.
#[derive(Debug)]
pub struct BlockTable {
    ids: Vec<BlockId>,
    pool: Rc<RefCell<BlockPool>>,
}

impl BlockTable {
    fn new(pool: &Rc<RefCell<BlockPool>>) -> Self {
        BlockTable {
            ids: Vec::new(),
            pool: Rc::clone(pool),
        }
    }

    /// The block ids, in position order.
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    fn release_all(&mut self) {
        let mut pool = self.pool.borrow_mut();
        for id in self.ids.drain(..) {
            pool.release(id);
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.release_all();
    }
}

/// One request's tokens, cache blocks and generation state.
#[derive(Debug)]
pub struct Sequence<E> {
    /// The request id.
    pub id: u64,
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    /// Number of prompt tokens.
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    pub computed: usize,
    /// Prompt tokens that were found in the prefix cache at the last admission.
    pub cached_prompt_tokens: usize,
    /// Sampling and text state.
    pub state: SequenceState,
    /// Where this sequence's output goes (the engine's concern).
    pub sink: E,
    blocks: BlockTable,
    hashes: Vec<u64>,
    /// Planned in a step that has not completed.
    in_flight: bool,
    /// Times this sequence was preempted.
    pub preemptions: u32,
}

impl<E> Sequence<E> {
    /// The block table.
    pub fn blocks(&self) -> &[BlockId] {
        self.blocks.ids()
    }

    /// Whether a step that computes this sequence's tokens has been planned and not yet
    /// completed.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }
}

/// One sequence's share of a step: `len` tokens starting at `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// Index into [`Scheduler::running`] when the step was planned (later steps may move
    /// it; [`Scheduler::index_of`] finds it again).
    pub index: usize,
    /// The sequence's id.
    pub id: u64,
    /// First position computed this step.
    pub start: usize,
    /// Number of tokens computed this step.
    pub len: usize,
}

/// The waiting queue, the running batch and the block pool.
#[derive(Debug)]
pub struct Scheduler<E> {
    config: SchedulerConfig,
    pool: Rc<RefCell<BlockPool>>,
    waiting: VecDeque<Sequence<E>>,
    running: Vec<Sequence<E>>,
    preemptions: u64,
}

impl<E> Scheduler<E> {
    /// A scheduler over `pool`.
    pub fn new(config: SchedulerConfig, pool: BlockPool) -> Self {
        Scheduler {
            config,
            pool: Rc::new(RefCell::new(pool)),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
        }
    }

    /// Queues a new request.
    pub fn add(&mut self, id: u64, prompt: Vec<u32>, state: SequenceState, sink: E) {
        let prompt_len = prompt.len();
        self.waiting.push_back(Sequence {
            id,
            tokens: prompt,
            prompt_len,
            computed: 0,
            cached_prompt_tokens: 0,
            state,
            sink,
            blocks: BlockTable::new(&self.pool),
            hashes: Vec::new(),
            in_flight: false,
            preemptions: 0,
        });
    }

    /// The running sequences, in admission order.
    pub fn running(&self) -> &[Sequence<E>] {
        &self.running
    }

    /// Mutable access to a running sequence.
    pub fn running_mut(&mut self, index: usize) -> &mut Sequence<E> {
        &mut self.running[index]
    }

    /// The generation state of every running sequence, in admission order.
    pub fn states_mut(&mut self) -> impl Iterator<Item = &mut SequenceState> {
        self.running.iter_mut().map(|s| &mut s.state)
    }

    /// Number of requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The block pool (for gauges and tests).
    pub fn pool(&self) -> std::cell::Ref<'_, BlockPool> {
        self.pool.borrow()
    }

    /// Removes (and returns) every sequence, waiting or running, for which `gone` holds;
    /// their blocks go back to the pool as they are dropped.
    pub fn remove_where(&mut self, mut gone: impl FnMut(&Sequence<E>) -> bool) -> Vec<Sequence<E>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if gone(&self.running[i]) {
                out.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        // In place: the engine calls this every step, usually removing nothing.
        let mut i = 0;
        while i < self.waiting.len() {
            if gone(&self.waiting[i]) {
                out.extend(self.waiting.remove(i));
            } else {
                i += 1;
            }
        }
        out
    }

    /// Removes a finished running sequence.
    pub fn finish(&mut self, index: usize) -> Sequence<E> {
        self.running.remove(index)
    }

    /// Plans the next step: which sequences compute which tokens. Blocks for every planned
    /// token are allocated before this returns.
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        self.schedule_at_most(usize::MAX)
    }

    /// One of `steps` equal shares of the sequences that can run (those running and waiting,
    /// at most `max_num_seqs`): what each of `steps` steps in flight at once takes, so that
    /// every one finds sequences to run.
    pub fn share(&self, steps: usize) -> usize {
        let runnable = (self.running.len() + self.waiting.len()).min(self.config.max_num_seqs);
        runnable.div_ceil(steps.max(1)).max(1)
    }

    /// [`Scheduler::schedule`] of at most `seqs` sequences, none of them in a step still in
    /// flight; the planned ones are in flight until [`Scheduler::complete`].
    pub fn schedule_at_most(&mut self, seqs: usize) -> Vec<Scheduled> {
        let plan = self.plan(seqs.max(1));
        for s in &plan {
            self.running[s.index].in_flight = true;
        }
        plan
    }

    fn plan(&mut self, seqs: usize) -> Vec<Scheduled> {
        let mut budget = self.config.max_num_batched_tokens;
        // Logits rows of the step: one per sequence that completes its tokens, plus one per
        // prompt token scored for `prompt_logprobs`; scored tokens are held to what is left
        // of `max_num_seqs` rows, which the activation memory was sized for.
        let mut rows = self.config.max_num_seqs;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && plan.len() < seqs {
            let seq = &self.running[i];
            if seq.in_flight {
                i += 1;
                continue;
            }
            let want = chunk(seq, budget, &mut rows);
            if want == 0 {
                i += 1;
                continue;
            }
            let target = seq.computed + want;
            if self.grow(i, target) {
                plan.push(Scheduled {
                    index: i,
                    id: self.running[i].id,
                    start: self.running[i].computed,
                    len: want,
                });
                budget -= want;
                i += 1;
                continue;
            }
            // Out of blocks: give back the newest sequence's not in flight (a step in
            // flight still writes its blocks), possibly this one's.
            preempted = true;
            let victim = (i..self.running.len())
                .rev()
                .find(|&j| !self.running[j].in_flight)
                .unwrap_or(i);
            self.preempt(victim);
            if victim == i {
                break;
            }
        }
        if preempted {
            return plan;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs && plan.len() < seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            // Prompt tokens served from the cache would go unscored.
            if seq.computed == 0 && self.config.enable_prefix_caching && !scores_prompt(&seq) {
                self.match_prefix(&mut seq);
            }
            let want = chunk(&seq, budget, &mut rows);
            if want == 0 {
                self.waiting.push_front(seq);
                break;
            }
            self.running.push(seq);
            let index = self.running.len() - 1;
            let target = self.running[index].computed + want;
            if !self.grow(index, target) {
                // Not enough blocks yet: back to the head of the queue, holding what it has.
                if let Some(seq) = self.running.pop() {
                    self.waiting.push_front(seq);
                }
                break;
            }
            plan.push(Scheduled {
                index,
                id: self.running[index].id,
                start: self.running[index].computed,
                len: want,
            });
            budget -= want;
        }
        plan
    }

    /// Where the sequence `s` planned is in [`Scheduler::running`] now; `None` once it has
    /// been removed (cancelled while its step was in flight).
    pub fn index_of(&self, s: &Scheduled) -> Option<usize> {
        match self.running.get(s.index) {
            Some(seq) if seq.id == s.id => Some(s.index),
            _ => self.running.iter().position(|seq| seq.id == s.id),
        }
    }

    /// Records that the planned tokens were computed: their sequences may be planned again.
    pub fn complete(&mut self, plan: &[Scheduled]) {
        for s in plan {
            if let Some(i) = self.index_of(s) {
                let seq = &mut self.running[i];
                seq.computed = s.start + s.len;
                seq.in_flight = false;
            }
        }
    }

    /// Removes (and returns) every sequence after a step that failed, and forgets every
    /// indexed prefix: the failed step's blocks were indexed when it was planned but may
    /// never have been filled, so no later request may share them.
    pub fn abort_all(&mut self) -> Vec<Sequence<E>> {
        self.pool.borrow_mut().forget_hashes();
        self.running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect()
    }

    /// Ensures running sequence `index` has blocks for `tokens` tokens, and with prefix
    /// caching indexes the blocks those tokens fill as soon as the step that computes them
    /// is planned (as vLLM does): a request admitted later in the same step — another
    /// choice of an `n > 1` request, or the same prompt sent twice at once — shares them
    /// instead of computing them again. This is sound because a step stores every
    /// sequence's keys and values of a layer before any of them attends, so the sharer
    /// reads blocks the same step has just filled.
    fn grow(&mut self, index: usize, tokens: usize) -> bool {
        let mut pool = self.pool.borrow_mut();
        let bs = pool.block_size();
        let seq = &mut self.running[index];
        let need = tokens.div_ceil(bs).saturating_sub(seq.blocks.ids.len());
        if need > pool.num_available() {
            return false;
        }
        for _ in 0..need {
            match pool.allocate() {
                Some(id) => seq.blocks.ids.push(id),
                None => return false,
            }
        }
        while self.config.enable_prefix_caching && (seq.hashes.len() + 1) * bs <= tokens {
            let b = seq.hashes.len();
            let h = block_hash(
                seq.hashes.last().copied(),
                &seq.tokens[b * bs..(b + 1) * bs],
            );
            pool.register(seq.blocks.ids[b], h);
            seq.hashes.push(h);
        }
        true
    }

    /// Shares the cached blocks that hold this sequence's prefix. At least one token is
    /// always left to compute, so the step produces logits.
    fn match_prefix(&mut self, seq: &mut Sequence<E>) {
        let mut pool = self.pool.borrow_mut();
        let bs = pool.block_size();
        let full = (seq.tokens.len() - 1) / bs;
        seq.hashes.clear();
        for b in 0..full {
            let h = block_hash(
                seq.hashes.last().copied(),
                &seq.tokens[b * bs..(b + 1) * bs],
            );
            match pool.lookup(h) {
                Some(id) => {
                    seq.blocks.ids.push(id);
                    seq.hashes.push(h);
                }
                None => break,
            }
        }
        seq.computed = seq.hashes.len() * bs;
        seq.cached_prompt_tokens = seq.computed.min(seq.prompt_len);
        // As vLLM counts: every token of the sequence asked for.
        pool.count_lookup(seq.tokens.len(), seq.computed);
    }

    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        seq.blocks.release_all();
        seq.hashes.clear();
        seq.computed = 0;
        seq.preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }
}

/// Whether `seq` asks for its prompt tokens' log-probabilities.
fn scores_prompt<E>(seq: &Sequence<E>) -> bool {
    seq.state.params().prompt_logprobs.is_some()
}

/// How many of `seq`'s tokens to compute this step within `budget` tokens, taking the
/// logits rows they need from `rows`: a sequence still scoring its prompt gets at most one
/// token per row left (at least one row is always left for the first such sequence, since
/// the others before it take one each and the running batch is at most `max_num_seqs`);
/// any other takes one row.
fn chunk<E>(seq: &Sequence<E>, budget: usize, rows: &mut usize) -> usize {
    let mut want = (seq.tokens.len() - seq.computed).min(budget);
    let scoring = scores_prompt(seq) && seq.computed + 1 < seq.prompt_len;
    if scoring {
        want = want.min(*rows);
    }
    *rows = rows.saturating_sub(if scoring { want } else { 1 });
    want
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sched(blocks: usize, seqs: usize, tokens: usize) -> Scheduler<()> {
        let config = SchedulerConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: tokens,
            enable_prefix_caching: true,
        };
        Scheduler::new(config, BlockPool::new(blocks, 4))
    }

    fn add(s: &mut Scheduler<()>, id: u64, len: usize) {
        let prompt: Vec<u32> = (0..len as u32).collect();
        let state = SequenceState::new(&prompt, SamplingParams::greedy(8), &[]);
        s.add(id, prompt, state, ());
    }

    #[test]
    fn a_scored_prompt_takes_only_the_logits_rows_left_and_skips_the_prefix_cache() {
        // Room for 3 logits rows a step; one decode runs beside the scored prompt.
        let mut s = sched(64, 3, 64);
        add(&mut s, 1, 8);
        let plan = s.schedule();
        s.complete(&plan);
        s.running_mut(0).tokens.push(99);
        let prompt: Vec<u32> = (0..8).collect();
        let scored = SamplingParams {
            prompt_logprobs: Some(1),
            ..SamplingParams::greedy(8)
        };
        let state = SequenceState::new(&prompt, scored, &[]);
        s.add(2, prompt, state, ());
        // Its first 4 tokens are in the cache (sequence 1's first block), yet all are computed.
        let lens: Vec<(usize, usize)> = s.schedule().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(lens, vec![(8, 1), (0, 2)]);
        assert_eq!(s.running()[1].cached_prompt_tokens, 0);
    }

    #[test]
    fn a_prompt_admitted_beside_its_twin_shares_the_blocks_that_step_fills() {
        // Two 10-token prompts alike (an `n = 2` request) arrive together: the first fills
        // blocks 0 and 1 this step, the second shares them and computes only its last two.
        let mut s = sched(64, 8, 64);
        add(&mut s, 1, 10);
        add(&mut s, 2, 10);
        let lens: Vec<(usize, usize)> = s.schedule().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(lens, vec![(0, 10), (8, 2)]);
        let (first, second) = (&s.running()[0], &s.running()[1]);
        assert_eq!(second.cached_prompt_tokens, 8);
        // Both asked for all 10 tokens, as vLLM counts queries; the twin found 8.
        assert_eq!(
            s.pool().prefix_stats(),
            crate::kv::PrefixStats {
                queries: 20,
                hits: 8
            }
        );
        assert_eq!(first.blocks()[..2], second.blocks()[..2]);
        assert_ne!(first.blocks()[2], second.blocks()[2]);
        // With a 6-token budget the first prompt takes a step alone; in its second step it
        // fills block 1, and the twin, admitted beside it, shares blocks 0 and 1.
        let mut s = sched(64, 8, 6);
        add(&mut s, 1, 10);
        add(&mut s, 2, 10);
        let plan = s.schedule();
        assert_eq!(plan.len(), 1, "the budget went to the first prompt");
        s.complete(&plan);
        let lens: Vec<(usize, usize)> = s.schedule().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(lens, vec![(6, 4), (8, 2)]);
    }

    #[test]
    fn a_sequence_in_flight_is_neither_planned_again_nor_preempted() {
        // Three blocks of 4: a 4-token prompt takes one, an 8-token prompt two.
        let mut s = sched(3, 8, 64);
        add(&mut s, 1, 4);
        // Other tokens than the first prompt's, so no block is shared.
        let prompt: Vec<u32> = (100..108).collect();
        let state = SequenceState::new(&prompt, SamplingParams::greedy(8), &[]);
        s.add(2, prompt, state, ());
        let first = s.schedule_at_most(1);
        assert_eq!(first.iter().map(|p| p.id).collect::<Vec<_>>(), [1]);
        let second = s.schedule_at_most(8);
        assert_eq!(second.iter().map(|p| p.id).collect::<Vec<_>>(), [2]);
        assert!(s.schedule_at_most(8).is_empty(), "both are in flight");
        // The first step completes; its sequence decodes into a fifth token, which needs a
        // block none is left for. The newest sequence is in flight, so the one that needs
        // the block gives its own back.
        s.complete(&first);
        s.running_mut(0).tokens.push(7);
        assert!(s.schedule_at_most(8).is_empty());
        assert_eq!(s.preemptions(), 1);
        let running: Vec<(u64, usize)> = s
            .running()
            .iter()
            .map(|q| (q.id, q.blocks().len()))
            .collect();
        assert_eq!(running, [(2, 2)], "the step in flight keeps its blocks");
        // Its step completes where its sequence now is (it moved from index 1 to 0).
        s.complete(&second);
        assert_eq!(s.running()[0].computed, 8);
        assert!(!s.running()[0].in_flight());
    }

    #[test]
    fn steps_in_flight_share_the_sequences_that_can_run() {
        let mut s = sched(64, 4, 64);
        assert_eq!(
            s.share(2),
            1,
            "even with nothing to run, a step may take one"
        );
        for id in 0..3 {
            add(&mut s, id, 4);
        }
        assert_eq!(s.share(2), 2);
        for id in 3..10 {
            add(&mut s, id, 4);
        }
        // Ten requests, but only four may run at once: two each for two steps.
        assert_eq!(s.share(2), 2);
        assert_eq!(s.share(1), 4);
    }

    #[test]
    fn forgotten_prefixes_are_computed_again() {
        let mut s = sched(64, 8, 64);
        add(&mut s, 1, 10);
        assert_eq!(s.schedule().len(), 1);
        // The step fails: every sequence goes, and nothing the step indexed may be shared.
        assert_eq!(s.abort_all().len(), 1);
        assert!(s.is_idle());
        add(&mut s, 2, 10);
        let lens: Vec<(usize, usize)> = s.schedule().iter().map(|p| (p.start, p.len)).collect();
        assert_eq!(lens, vec![(0, 10)]);
        assert_eq!(s.running()[0].cached_prompt_tokens, 0);
    }

    #[test]
    fn long_prompts_are_chunked_and_decodes_keep_running() {
        let mut s = sched(64, 8, 8);
        add(&mut s, 1, 3);
        let plan = s.schedule();
        assert_eq!(
            plan,
            vec![Scheduled {
                index: 0,
                id: 1,
                start: 0,
                len: 3
            }]
        );
        s.complete(&plan);
        s.running_mut(0).tokens.push(99);
        add(&mut s, 2, 20);
        // The decode of 1 and a 7-token chunk of 2's prompt share the 8-token budget.
        let plan = s.schedule();
        assert_eq!(
            plan,
            vec![
                Scheduled {
                    index: 0,
                    id: 1,
                    start: 3,
                    len: 1
                },
                Scheduled {
                    index: 1,
                    id: 2,
                    start: 0,
                    len: 7
                }
            ]
        );
        s.complete(&plan);
        s.running_mut(0).tokens.push(98);
        let plan = s.schedule();
        assert_eq!(
            plan[1],
            Scheduled {
                index: 1,
                id: 2,
                start: 7,
                len: 7
            }
        );
    }

    #[test]
    fn the_newest_sequence_is_preempted_when_blocks_run_out() {
        let mut s = sched(3, 8, 64);
        add(&mut s, 1, 4);
        add(&mut s, 2, 4);
        let plan = s.schedule();
        assert_eq!(plan.len(), 2);
        s.complete(&plan);
        for i in 0..2 {
            s.running_mut(i).tokens.push(7);
        }
        // Both need a second block; only one is left: sequence 2 gives its block back.
        let plan = s.schedule();
        assert_eq!(
            plan,
            vec![Scheduled {
                index: 0,
                id: 1,
                start: 4,
                len: 1
            }]
        );
        assert_eq!(s.preemptions(), 1);
        assert_eq!(s.num_waiting(), 1);
        s.complete(&plan);
        drop(s.finish(0));
        let plan = s.schedule();
        // Recomputed from scratch: its prompt block is found in the prefix cache.
        assert_eq!(
            plan,
            vec![Scheduled {
                index: 0,
                id: 2,
                start: 4,
                len: 1
            }]
        );
        // Both 4-token prompts asked for every token and found none; coming back with 5
        // tokens it found its first block. The preemption is its own.
        assert_eq!(s.running()[0].preemptions, 1);
        assert_eq!(
            s.pool().prefix_stats(),
            crate::kv::PrefixStats {
                queries: 4 + 4 + 5,
                hits: 4
            }
        );
    }

    #[test]
    fn dropped_sequences_return_every_block() {
        let mut s = sched(8, 8, 64);
        add(&mut s, 1, 9);
        add(&mut s, 2, 5);
        let plan = s.schedule();
        s.complete(&plan);
        assert!(s.pool().num_used() > 0);
        let gone = s.remove_where(|_| true);
        drop(gone);
        assert_eq!(s.pool().num_used(), 0);
    }
}
