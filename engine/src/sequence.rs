//! One sequence's generation state: sampling, incremental text, stop tokens and stop strings.

use crate::error::Result;
use crate::grammar::{Constraint, Mask};
use crate::model::llama::log_softmax;
use crate::sampling::{top_logprobs, Sampler, SamplingParams};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// Why a sequence ended, with OpenAI's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end token or stop string was produced.
    Stop,
    /// `max_tokens` (or the context length) was reached.
    Length,
    /// The client went away or the request was cancelled.
    Abort,
}

impl FinishReason {
    /// The `finish_reason` string of the OpenAI API.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// A generated token with its log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    /// The chosen token id.
    pub id: u32,
    /// Its log-probability under the model (before penalties and temperature); computed
    /// only when the request asked for `logprobs` (a full-vocabulary softmax per token).
    pub logprob: Option<f32>,
    /// The `logprobs` most likely tokens at this step, best first.
    pub top: Vec<(u32, f32)>,
}

impl TokenOutput {
    /// Token `id` as scored by one row of raw logits: its log-probability and the `k` most
    /// likely tokens (a prompt token's entry for `prompt_logprobs`).
    pub fn scored(id: u32, logits: &[f32], k: usize) -> Self {
        Self::from_logprobs(id, &log_softmax(logits), k)
    }

    /// Token `id` with its entry of `logprobs` (a whole row's log-softmax) and the `k` most
    /// likely tokens of that row.
    fn from_logprobs(id: u32, logprobs: &[f32], k: usize) -> Self {
        TokenOutput {
            id,
            logprob: Some(
                logprobs
                    .get(id as usize)
                    .copied()
                    .unwrap_or(f32::NEG_INFINITY),
            ),
            top: top_logprobs(logprobs, k),
        }
    }
}

/// What one sampling step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The sampled token.
    pub token: TokenOutput,
    /// New text that may be shown to the user (stop-string prefixes are held back).
    pub text: String,
    /// Set when this step ended the sequence.
    pub finished: Option<FinishReason>,
}

/// Sampling and text state of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceState {
    sampler: Sampler,
    decoder: IncrementalDecoder,
    end_ids: Vec<u32>,
    output: Vec<u32>,
    text: String,
    emitted: usize,
    finish: Option<FinishReason>,
    /// The request's grammar, advanced with every token.
    constraint: Option<Constraint>,
    /// The grammar's mask for the next token, when computed ahead (while the step's
    /// forward pass ran).
    mask: Option<std::result::Result<Mask, String>>,
    /// The model's end tokens, which end a constrained sequence where its grammar allows
    /// an end, even with `ignore_eos`.
    model_ends: Vec<u32>,
}

impl SequenceState {
    /// State for generating after `prompt`; `end_ids` are the model's end tokens.
    pub fn new(prompt: &[u32], mut params: SamplingParams, end_ids: &[u32]) -> Self {
        let constraint = params.constraint.take();
        let mut ends: Vec<u32> = if params.ignore_eos {
            Vec::new()
        } else {
            end_ids.to_vec()
        };
        ends.extend_from_slice(&params.stop_token_ids);
        SequenceState {
            decoder: IncrementalDecoder::new(prompt, true),
            sampler: Sampler::new(params, prompt),
            end_ids: ends,
            output: Vec::new(),
            text: String::new(),
            emitted: 0,
            finish: None,
            constraint,
            mask: None,
            model_ends: end_ids.to_vec(),
        }
    }

    /// Whether a grammar constrains this sequence's tokens.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Computes the grammar's mask for the next token now, so that [`SequenceState::step`]
    /// finds it ready (the engine does this while the step's forward pass runs).
    pub fn prepare_mask(&mut self) {
        if let Some(c) = self.constraint.as_mut() {
            self.mask = Some(c.mask());
        }
    }

    /// The request's sampling parameters.
    pub fn params(&self) -> &SamplingParams {
        self.sampler.params()
    }

    /// Samples the next token from `logits` (modified in place) and advances the text. A
    /// grammar masks the logits after the penalties and biases, so the sampled token is
    /// always one it allows, and it decides where the sequence may end (`min_tokens`
    /// does not hold back an end it requires); a grammar that fails ends the sequence
    /// with `abort`.
    pub fn step(&mut self, logits: &mut [f32], tokenizer: &Tokenizer) -> Result<Step> {
        let params = self.sampler.params();
        let want_top = params.logprobs;
        let min_tokens = params.min_tokens;
        let max_tokens = params.max_tokens;
        // Log-probabilities before penalties, and only when asked for.
        let raw = want_top.map(|k| (log_softmax(logits), k));
        let mask = match self.constraint.as_mut() {
            Some(c) => Some(self.mask.take().unwrap_or_else(|| c.mask())),
            None => None,
        };
        let banned: &[u32] = if self.output.len() < min_tokens && mask.is_none() {
            &self.end_ids
        } else {
            &[]
        };
        self.sampler.adjust_logits(logits, banned);
        let mut failed = None;
        match &mask {
            Some(Ok(m)) => m.apply(logits),
            Some(Err(e)) => failed = Some(e.clone()),
            None => {}
        }
        let id = self.sampler.sample(logits);
        let token = match raw {
            Some((raw, k)) => TokenOutput::from_logprobs(id, &raw, k),
            None => TokenOutput {
                id,
                logprob: None,
                top: Vec::new(),
            },
        };
        let grammar_end = self.constraint.is_some() && self.model_ends.contains(&id);
        if let (Some(c), None, false) = (self.constraint.as_mut(), &failed, grammar_end) {
            if let Err(e) = c.accept(id) {
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            tracing::warn!("a sequence's grammar failed, ending it: {e}");
            self.finish = Some(FinishReason::Abort);
            return Ok(Step {
                token,
                text: self.take_text(),
                finished: self.finish,
            });
        }
        self.sampler.observe(id);
        self.output.push(id);
        if grammar_end || self.end_ids.contains(&id) {
            self.finish = Some(FinishReason::Stop);
        } else {
            let delta = self.decoder.push(tokenizer, id)?;
            self.text.push_str(&delta);
            let complete = self
                .constraint
                .as_ref()
                .is_some_and(Constraint::is_finished);
            if self.output.len() >= max_tokens || complete {
                let rest = self.decoder.flush(tokenizer)?;
                self.text.push_str(&rest);
            }
            if let Some(at) = self.find_stop() {
                self.text.truncate(at);
                self.finish = Some(FinishReason::Stop);
            } else if complete {
                self.finish = Some(FinishReason::Stop);
            } else if self.output.len() >= max_tokens {
                self.finish = Some(FinishReason::Length);
            }
        }
        let text = self.take_text();
        Ok(Step {
            token,
            text,
            finished: self.finish,
        })
    }

    fn find_stop(&self) -> Option<usize> {
        let stops = &self.sampler.params().stop;
        let longest = stops.iter().map(String::len).max()?;
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
    }

    /// Text not yet emitted, minus a tail that could still become a stop string.
    fn take_text(&mut self) -> String {
        let mut end = self.text.len();
        if self.finish.is_none() {
            let tail = &self.text[self.emitted..];
            let hold = self
                .sampler
                .params()
                .stop
                .iter()
                .map(|s| {
                    (1..s.len().min(tail.len() + 1))
                        .rev()
                        .find(|&n| s.is_char_boundary(n) && tail.ends_with(&s[..n]))
                        .unwrap_or(0)
                })
                .max()
                .unwrap_or(0);
            end -= hold;
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}
