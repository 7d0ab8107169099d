//! The unbatched reference: one request alone, its prompt prefilled and then decoded token
//! by token through a one-sequence cache, with no scheduler in the way. The batching tests
//! hold the engine to it as their oracle, and the benchmark's single-stream figure uses it.

use std::time::Instant;

use crate::error::{Error, RequestError, Result};
use crate::kv::cache::SingleSequence;
use crate::kv::KvDtype;
use crate::model::LoadedModel;
use crate::sampling::SamplingParams;
use crate::sequence::{FinishReason, SequenceState, TokenOutput};

/// The result of one generation, with its timing.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Number of prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens with their log-probabilities.
    pub tokens: Vec<TokenOutput>,
    /// The generated text (stop strings removed).
    pub text: String,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// Seconds spent on the prompt (time to first token).
    pub prompt_seconds: f64,
    /// Seconds spent on every token after the first.
    pub decode_seconds: f64,
}

/// Generates after `prompt` alone, calling `on_text` with each piece of text as it is
/// produced.
pub fn generate(
    loaded: &LoadedModel,
    prompt: &[u32],
    params: SamplingParams,
    mut on_text: impl FnMut(&str) + Send,
) -> Result<Generation> {
    params.validate()?;
    let model = &loaded.model;
    let ctx = model.config().max_position_embeddings;
    if prompt.is_empty() {
        return Err(RequestError::EmptyPrompt.into());
    }
    if prompt.len() + params.max_tokens > ctx {
        return Err(RequestError::ContextTooLong {
            max: ctx,
            prompt: prompt.len(),
            completion: params.max_tokens,
        }
        .into());
    }
    // Run on the thread pool's own workers so the caller sleeps instead of competing for a core.
    rayon::scope(|_| run(loaded, prompt, params, &mut on_text))
}

fn run(
    loaded: &LoadedModel,
    prompt: &[u32],
    params: SamplingParams,
    on_text: &mut (impl FnMut(&str) + Send),
) -> Result<Generation> {
    let model = &loaded.model;
    let mut cache = SingleSequence::new(model, KvDtype::Auto);
    let mut seq = SequenceState::new(prompt, params, loaded.tokenizer.stop_token_ids());
    let mut tokens = Vec::new();
    let mut text = String::new();
    let start = Instant::now();
    let mut first_token_at = None;
    let mut input: Vec<u32> = prompt.to_vec();
    loop {
        let mut logits = cache.forward(model, &input)?;
        let Some(row) = logits.rows_mut().next() else {
            return Err(Error::internal("a step gave no logits"));
        };
        let step = seq.step(row, &loaded.tokenizer)?;
        first_token_at.get_or_insert_with(Instant::now);
        on_text(&step.text);
        text.push_str(&step.text);
        input = vec![step.token.id];
        tokens.push(step.token);
        if let Some(reason) = step.finished {
            let end = Instant::now();
            let first = first_token_at.unwrap_or(end);
            return Ok(Generation {
                prompt_tokens: prompt.len(),
                tokens,
                text,
                finish_reason: reason,
                prompt_seconds: (first - start).as_secs_f64(),
                decode_seconds: (end - first).as_secs_f64(),
            });
        }
    }
}
