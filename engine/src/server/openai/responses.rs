//! The Responses API's shapes as types: the request of `POST /v1/responses` (input items,
//! function tools, `text.format`), the response object with its output items, and the
//! events of its stream, each in OpenAI's names.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::response::TopLogprob;

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// The served model name.
    pub model: String,
    /// The new turn: a user message's text, or a list of input items.
    pub input: Input,
    /// A system message placed before the conversation (not carried to later turns).
    pub instructions: Option<String>,
    /// Most tokens to generate.
    pub max_output_tokens: Option<usize>,
    /// Softmax temperature in [0, 2]; default 1.
    pub temperature: Option<f32>,
    /// Nucleus probability mass in (0, 1].
    pub top_p: Option<f32>,
    /// Alternatives per output token, returned with
    /// `include: ["message.output_text.logprobs"]`.
    pub top_logprobs: Option<usize>,
    /// Function tools the model may call.
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or `{"type": "function", "name": ...}`.
    pub tool_choice: Option<Value>,
    /// Whether one answer may call several tools (default true).
    pub parallel_tool_calls: Option<bool>,
    /// The output's format: `{"format": {"type": "text" | "json_object" | "json_schema"}}`.
    pub text: Option<TextConfig>,
    /// Stream the Responses events.
    pub stream: Option<bool>,
    /// Streaming options (`include_obfuscation` is accepted; nothing is obfuscated).
    pub stream_options: Option<Value>,
    /// A stored response this one continues: its conversation comes first.
    pub previous_response_id: Option<String>,
    /// Keep this response for `previous_response_id` and `GET /v1/responses/{id}`
    /// (default true).
    pub store: Option<bool>,
    /// Extra output to include; `message.output_text.logprobs` is honoured, the others
    /// name items this server never produces.
    pub include: Option<Vec<String>>,
    /// `disabled` (a conversation longer than the context is refused) or `auto` (its
    /// oldest turns are dropped until it fits).
    pub truncation: Option<String>,
    /// Up to 16 string pairs, returned with the response.
    pub metadata: Option<Value>,
    /// Reasoning options, for reasoning models; the models served here do not reason.
    pub reasoning: Option<Value>,
    /// Run in the background: not supported, refused when true.
    pub background: Option<bool>,
    /// Most tool calls in one response: not enforced beyond `parallel_tool_calls`, refused
    /// when set.
    pub max_tool_calls: Option<usize>,
}

/// `input`: a string or a list of items.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of input items")]
pub enum Input {
    /// One user message's text.
    Text(String),
    /// Messages, function calls and their outputs, each checked where it is read.
    Items(Vec<Value>),
}

/// `text`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextConfig {
    /// The output's format.
    pub format: Option<TextFormat>,
    /// How long an answer should be, a hint GPT-5 models read: accepted and ignored, as
    /// chat's `verbosity` is.
    pub verbosity: Option<String>,
}

/// `text.format`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TextFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `schema`.
    JsonSchema {
        /// The schema's name.
        name: Option<String>,
        /// What the schema is for.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        /// The JSON schema.
        schema: Value,
        /// OpenAI's strict mode; the schema is always enforced.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// A response, as `POST /v1/responses` returns it, the stream's events carry it, and the
/// store keeps it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseObject {
    /// `resp_` and hex digits.
    pub id: String,
    /// Always `response`.
    pub object: &'static str,
    /// Unix seconds of the request.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    /// What failed, when `status` is `failed`.
    pub error: Option<ResponseError>,
    /// Why it is incomplete, when it is.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's instructions.
    pub instructions: Option<String>,
    /// The request's output token limit.
    pub max_output_tokens: Option<usize>,
    /// The model name the request asked for.
    pub model: String,
    /// The output items: a message, function calls, or both.
    pub output: Vec<OutputItem>,
    /// Whether several calls were allowed.
    pub parallel_tool_calls: bool,
    /// The response this one continues.
    pub previous_response_id: Option<String>,
    /// The temperature used.
    pub temperature: f32,
    /// The nucleus mass used.
    pub top_p: f32,
    /// The tool choice, as sent (default `auto`).
    pub tool_choice: Value,
    /// The tools, as sent.
    pub tools: Vec<Value>,
    /// The output format.
    pub text: TextOut,
    /// The truncation mode.
    pub truncation: String,
    /// The request's metadata.
    pub metadata: Value,
    /// Whether it is stored.
    pub store: bool,
    /// Always `default`.
    pub service_tier: &'static str,
    /// Token counts, once it has finished.
    pub usage: Option<ResponseUsage>,
}

/// `text` in a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextOut {
    /// The output's format (`{"type": "text"}` by default).
    pub format: Value,
}

/// `error` of a failed response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseError {
    /// `server_error`.
    pub code: &'static str,
    /// What happened.
    pub message: String,
}

/// `incomplete_details`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: &'static str,
}

/// One output item.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The assistant's text.
    Message {
        /// `msg_` and hex digits.
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        /// Always `assistant`.
        role: &'static str,
        /// Its parts: one `output_text`.
        content: Vec<OutputText>,
    },
    /// A call of a function tool.
    FunctionCall {
        /// `fc_` and hex digits.
        id: String,
        /// The id the tool's output names.
        call_id: String,
        /// The function.
        name: String,
        /// Its arguments, a JSON text.
        arguments: String,
        /// `in_progress` or `completed`.
        status: &'static str,
    },
}

/// An `output_text` content part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty: nothing is cited.
    pub annotations: Vec<Value>,
    /// The tokens' log-probabilities (with `include: ["message.output_text.logprobs"]`).
    pub logprobs: Vec<TokenLogprob>,
}

impl OutputText {
    /// A part holding `text`.
    pub fn new(text: String, logprobs: Vec<TokenLogprob>) -> Self {
        OutputText {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs,
        }
    }
}

/// One output token's log-probability, with its most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// Its text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// Its text's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its step.
    pub top_logprobs: Vec<TopLogprob>,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Of which cached.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Of which reasoning (always none).
    pub output_tokens_details: OutputTokensDetails,
    /// Their sum.
    pub total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct InputTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Prompt tokens written to a cache a client pays for: none, the prefix cache is free.
    pub cache_write_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OutputTokensDetails {
    /// Reasoning tokens: none, the models served here do not reason.
    pub reasoning_tokens: usize,
}

impl ResponseUsage {
    /// `input` prompt tokens (`cached` of them from the cache) and `output` generated.
    pub fn new(input: usize, output: usize, cached: usize) -> Self {
        ResponseUsage {
            input_tokens: input,
            input_tokens_details: InputTokensDetails {
                cached_tokens: cached,
                cache_write_tokens: 0,
            },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: input + output,
        }
    }
}

/// An event of a streamed response with its place in the stream, sent as `event: <type>`
/// and `data: {"type", "sequence_number", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Numbered {
    /// The event.
    #[serde(flatten)]
    pub event: StreamEvent,
    /// Its place in the stream, from 0.
    pub sequence_number: u64,
}

/// One event of a streamed response.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum StreamEvent {
    /// The response exists (`status: in_progress`).
    #[serde(rename = "response.created")]
    Created {
        /// The response so far.
        response: ResponseObject,
    },
    /// The response is being generated.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// The response so far.
        response: ResponseObject,
    },
    /// An output item begins.
    #[serde(rename = "response.output_item.added")]
    ItemAdded {
        /// Its index in `output`.
        output_index: usize,
        /// The item, empty.
        item: OutputItem,
    },
    /// An output item is whole.
    #[serde(rename = "response.output_item.done")]
    ItemDone {
        /// Its index in `output`.
        output_index: usize,
        /// The item, whole.
        item: OutputItem,
    },
    /// A message's content part begins.
    #[serde(rename = "response.content_part.added")]
    PartAdded {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index in the message.
        content_index: usize,
        /// The part, empty.
        part: OutputText,
    },
    /// A message's content part is whole.
    #[serde(rename = "response.content_part.done")]
    PartDone {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index in the message.
        content_index: usize,
        /// The part, whole.
        part: OutputText,
    },
    /// More of the text.
    #[serde(rename = "response.output_text.delta")]
    TextDelta {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index in the message.
        content_index: usize,
        /// The new text.
        delta: String,
        /// Its tokens' log-probabilities, when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// The text is whole.
    #[serde(rename = "response.output_text.done")]
    TextDone {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index in the message.
        content_index: usize,
        /// The whole text.
        text: String,
        /// Its tokens' log-probabilities, when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// More of a function call's arguments.
    #[serde(rename = "response.function_call_arguments.delta")]
    ArgumentsDelta {
        /// The call item's id.
        item_id: String,
        /// The call's index in `output`.
        output_index: usize,
        /// More of the arguments' JSON text.
        delta: String,
    },
    /// A function call's arguments are whole.
    #[serde(rename = "response.function_call_arguments.done")]
    ArgumentsDone {
        /// The call item's id.
        item_id: String,
        /// The call's index in `output`.
        output_index: usize,
        /// The whole arguments.
        arguments: String,
    },
    /// The response has finished (`completed`).
    #[serde(rename = "response.completed")]
    Completed {
        /// The whole response.
        response: ResponseObject,
    },
    /// The response stopped at its output token limit.
    #[serde(rename = "response.incomplete")]
    Incomplete {
        /// The response as far as it got.
        response: ResponseObject,
    },
    /// The response failed.
    #[serde(rename = "response.failed")]
    Failed {
        /// The response, with its error.
        response: ResponseObject,
    },
}

impl StreamEvent {
    /// The event's `type`, its SSE event name.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::ItemAdded { .. } => "response.output_item.added",
            StreamEvent::ItemDone { .. } => "response.output_item.done",
            StreamEvent::PartAdded { .. } => "response.content_part.added",
            StreamEvent::PartDone { .. } => "response.content_part.done",
            StreamEvent::TextDelta { .. } => "response.output_text.delta",
            StreamEvent::TextDone { .. } => "response.output_text.done",
            StreamEvent::ArgumentsDelta { .. } => "response.function_call_arguments.delta",
            StreamEvent::ArgumentsDone { .. } => "response.function_call_arguments.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Failed { .. } => "response.failed",
        }
    }
}

/// `DELETE /v1/responses/{id}`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Deleted {
    /// The id.
    pub id: String,
    /// Always `response`.
    pub object: &'static str,
    /// Always true.
    pub deleted: bool,
}
