//! OpenAI's response shapes as types: completions and chat completions, their streamed
//! chunks, choices, deltas, usage and log-probabilities. Fields serialize in OpenAI's names;
//! what a request did not ask for is `null` where OpenAI sends `null`, absent where it
//! leaves the field out. Log-probabilities are the engine's f32 values widened to f64, as
//! a Python server prints them.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::sequence::TokenOutput;
use crate::tokenizer::Tokenizer;

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens, over every choice.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// How many prompt tokens came from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// The usage of `prompt_tokens` in, `completion_tokens` out, `cached` from the cache.
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// `/v1/completions`' response, and each chunk of its stream (the same shape).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    /// The request's id, shared by its chunks.
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds of the request.
    pub created: u64,
    /// The model name the request asked for.
    pub model: String,
    /// The choices (one per chunk while streaming; none in the usage chunk).
    pub choices: Vec<CompletionChoice>,
    /// Token counts: always in a whole response, only in the last chunk of a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    /// Which choice.
    pub index: usize,
    /// Its text (or this chunk's part of it).
    pub text: String,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// Why it ended; `null` until it has.
    pub finish_reason: Option<&'static str>,
}

/// The legacy completions' log-probabilities: parallel lists per token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability (`null` for a prompt's first token).
    pub token_logprobs: Vec<Option<f64>>,
    /// Each token's most likely alternatives, by text.
    pub top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
    /// Where each token's text starts in the choice's text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// `tokens` in this shape, their texts starting at byte `offset` of the choice.
    pub fn new(tk: &Tokenizer, tokens: &[TokenOutput], offset: usize) -> Self {
        let mut at = offset;
        let mut text_offset = Vec::with_capacity(tokens.len());
        for t in tokens {
            text_offset.push(at);
            at += tk.token_text(t.id).len();
        }
        CompletionLogprobs {
            tokens: tokens.iter().map(|t| tk.token_text(t.id)).collect(),
            token_logprobs: tokens.iter().map(|t| t.logprob.map(f64::from)).collect(),
            top_logprobs: tokens
                .iter()
                .map(|t| {
                    t.logprob.map(|_| {
                        t.top
                            .iter()
                            .map(|&(id, lp)| (tk.token_text(id), f64::from(lp)))
                            .collect()
                    })
                })
                .collect(),
            text_offset,
        }
    }
}

/// `/v1/chat/completions`' whole response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    /// The request's id.
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds of the request.
    pub created: u64,
    /// The model name the request asked for.
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    /// Which choice.
    pub index: usize,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Why it ended.
    pub finish_reason: &'static str,
}

/// The message a chat choice answers with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// Its text; `null` when the message only calls tools.
    pub content: Option<String>,
    /// The tools it calls, when it calls any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A tool call in a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// The call's id, which the tool's answer names.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// A tool call's part of a streamed chunk: its id, type and name first, then its
/// arguments.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the message.
    pub index: usize,
    /// The call's id, in its first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in its first chunk.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first chunk) or more of the arguments.
    pub function: FunctionDelta,
}

/// What a streamed call's function gains in one chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDelta {
    /// The function's name, in the call's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More of the arguments' JSON text.
    pub arguments: String,
}

/// A chunk of a streamed chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    /// The request's id, shared by its chunks.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds of the request.
    pub created: u64,
    /// The model name the request asked for.
    pub model: String,
    /// The choices this chunk advances (none in the usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// Token counts, in the last chunk when `stream_options.include_usage` asks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice's step in a chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    /// Which choice.
    pub index: usize,
    /// What the message gains.
    pub delta: Delta,
    /// This step's log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Why the choice ended, in its last chunk.
    pub finish_reason: Option<&'static str>,
}

/// What a chat message gains in one chunk: the role first, then content.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// More text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls, streamed name first, then arguments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// Chat's log-probabilities: one entry per token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// The tokens.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token of chat's log-probabilities, with its most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// Its text.
    pub token: String,
    /// Its log-probability.
    pub logprob: Option<f64>,
    /// Its text's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its step.
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative at one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    /// Its text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// Its text's bytes.
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    /// `tokens` in this shape.
    pub fn new(tk: &Tokenizer, tokens: &[TokenOutput]) -> Self {
        ChatLogprobs {
            content: tokens
                .iter()
                .map(|t| {
                    let token = tk.token_text(t.id);
                    ChatTokenLogprob {
                        bytes: token.as_bytes().to_vec(),
                        token,
                        logprob: t.logprob.map(f64::from),
                        top_logprobs: t
                            .top
                            .iter()
                            .map(|&(id, logprob)| {
                                let token = tk.token_text(id);
                                TopLogprob {
                                    bytes: token.as_bytes().to_vec(),
                                    token,
                                    logprob: f64::from(logprob),
                                }
                            })
                            .collect(),
                    }
                })
                .collect(),
        }
    }
}

/// Now, in Unix seconds.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh response id with `prefix` (`cmpl`, `chatcmpl`).
pub fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// One card per served name.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    /// The name requests use.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds of its creation (unknown: 0).
    pub created: u64,
    /// Always `ferrite`.
    pub owned_by: &'static str,
    /// Longest prompt plus completion (vLLM's extra field).
    pub max_model_len: usize,
}
