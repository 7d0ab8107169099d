//! OpenAI's request shapes for `/v1/completions` and `/v1/chat/completions` (with vLLM's
//! extra sampling fields), and their translation to [`SamplingParams`], whose defaults they
//! start from.

use serde::Deserialize;

use crate::sampling::SamplingParams;
use crate::server::errors::ApiError;
use crate::tokenizer::ChatMessage;

/// `prompt`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string, a list of strings, a list of token ids or a list of lists of token ids"
)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One tokenized prompt.
    Tokens(Vec<u32>),
    /// Several tokenized prompts.
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of strings")]
pub enum Stop {
    /// A single stop string.
    One(String),
    /// Up to four stop strings.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a final chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    /// Softmax temperature in [0, 2]; default 1.
    pub temperature: Option<f32>,
    /// Nucleus probability mass in (0, 1].
    pub top_p: Option<f32>,
    /// Number of choices to generate.
    pub n: Option<usize>,
    /// Strings that end generation.
    pub stop: Option<Stop>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Penalty for tokens already present, in [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Penalty per occurrence, in [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// Keep the k most likely tokens (vLLM); -1 or 0 keeps all.
    pub top_k: Option<i64>,
    /// Minimum probability relative to the most likely token (vLLM).
    pub min_p: Option<f32>,
    /// Multiplicative repetition penalty (vLLM).
    pub repetition_penalty: Option<f32>,
    /// Continue past end tokens (vLLM).
    pub ignore_eos: Option<bool>,
    /// Minimum tokens before an end token may stop generation (vLLM).
    pub min_tokens: Option<usize>,
    /// Token ids that end generation (vLLM).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Biases in [-100, 100] added to the logits of token ids (the keys, as strings) before
    /// sampling.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Stream Server-Sent Events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
}

/// Most choices per request.
pub const MAX_N: usize = 16;

impl Sampling {
    /// Choices requested, checked.
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n),
            n => Err(ApiError::bad_request(
                format!("`n` must be in [1, {MAX_N}], got {n}"),
                Some("n"),
            )),
        }
    }

    /// The engine's parameters for `max_tokens` tokens and `logprobs` alternatives.
    pub fn params(
        &self,
        max_tokens: usize,
        logprobs: Option<usize>,
    ) -> Result<SamplingParams, ApiError> {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::bad_request(
                    format!("`top_k` must be -1 (disabled) or at least 1, got {k}"),
                    Some("top_k"),
                ))
            }
        };
        let mut logit_bias = Vec::new();
        for (token, &bias) in self.logit_bias.iter().flatten() {
            let id = token.trim().parse().map_err(|_| {
                ApiError::bad_request(
                    format!("`logit_bias` keys must be token ids, got {token:?}"),
                    Some("logit_bias"),
                )
            })?;
            logit_bias.push((id, bias));
        }
        let d = SamplingParams::DEFAULT;
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(d.min_p),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            seed: self.seed,
            max_tokens,
            min_tokens: self.min_tokens.unwrap_or(d.min_tokens),
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(d.ignore_eos),
            logprobs,
            logit_bias,
            ..d
        };
        p.validate()?;
        Ok(p)
    }

    /// Whether to stream, and whether to end with a usage chunk; `stream_options` without
    /// `stream: true` is refused, as OpenAI and vLLM refuse it.
    pub fn streaming(&self) -> Result<(bool, bool), ApiError> {
        let stream = self.stream.unwrap_or(false);
        match &self.stream_options {
            Some(_) if !stream => Err(ApiError::bad_request(
                "`stream_options` is only allowed with `stream: true`",
                Some("stream_options"),
            )),
            options => Ok((stream, options.as_ref().is_some_and(|o| o.include_usage))),
        }
    }
}

/// Fields OpenAI defines that change nothing Ferrite generates: accepted by both
/// endpoints and ignored.
pub const IGNORED_FIELDS: &[&str] = &["user"];

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The served model name.
    pub model: String,
    /// What to complete.
    pub prompt: Prompt,
    /// Most tokens to generate; default 16.
    pub max_tokens: Option<usize>,
    /// Log-probabilities of this many most likely tokens per position.
    pub logprobs: Option<usize>,
    /// Prepend the prompt to the completion.
    pub echo: Option<bool>,
}

/// Message content: a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of content parts")]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only `text` parts are supported.
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    /// The part's type; `text` is the only one this server accepts.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or `developer`, treated as `system`).
    pub role: String,
    /// The message text (`name` is accepted and ignored).
    pub content: Content,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The served model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Most tokens to generate (legacy name).
    pub max_tokens: Option<usize>,
    /// Most tokens to generate.
    pub max_completion_tokens: Option<usize>,
    /// Return log-probabilities of the output tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per position, with `logprobs`.
    pub top_logprobs: Option<usize>,
}

impl ChatRequest {
    /// The messages as the chat template expects them.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "user" | "assistant" => m.role.clone(),
                    "developer" => "system".into(),
                    other => {
                        return Err(ApiError::bad_request(
                            format!("`messages[{i}].role` must be system, user or assistant, got `{other}`"),
                            Some("messages"),
                        ))
                    }
                };
                let content = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::Parts(parts) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::bad_request(
                                        format!("`messages[{i}].content` part of type `{kind}` is not supported; only `text` parts are"),
                                        Some("messages"),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                Ok(ChatMessage { role, content })
            })
            .collect()
    }
}
