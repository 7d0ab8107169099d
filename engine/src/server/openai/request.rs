//! OpenAI's request shapes for `/v1/completions` and `/v1/chat/completions` (with vLLM's
//! extra sampling fields), and their translation to [`SamplingParams`], whose defaults they
//! start from.

use serde::Deserialize;

use crate::grammar::Grammar;
use crate::sampling::SamplingParams;
use crate::server::errors::ApiError;
use crate::server::tools::{ToolChoiceSpec, ToolSpec};
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
    /// The shape of the output: `text`, any JSON object, or JSON valid under a schema,
    /// enforced while decoding.
    pub response_format: Option<ResponseFormat>,
    /// vLLM's structured outputs: a JSON schema, a regular expression, a choice of strings
    /// or a Lark grammar, enforced while decoding.
    pub structured_outputs: Option<StructuredOutputs>,
}

/// `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `json_schema.schema`.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// The schema's name (reported back, not enforced).
    pub name: Option<String>,
    /// What the schema is for (given to no one: the grammar enforces the schema).
    pub description: Option<String>,
    /// The JSON schema; absent, any JSON value.
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict mode; Ferrite always enforces the schema, so both values mean the
    /// same.
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs`: exactly one of its constraints.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or the schema as a string).
    pub json: Option<serde_json::Value>,
    /// A regular expression the whole output matches.
    pub regex: Option<String>,
    /// The output is exactly one of these strings.
    pub choice: Option<Vec<String>>,
    /// A grammar in Lark syntax (llguidance's dialect).
    pub grammar: Option<String>,
    /// Any JSON object.
    pub json_object: Option<bool>,
}

impl StructuredOutputs {
    /// The one grammar these ask for, or which fields conflict.
    fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        let bad = |m: String| ApiError::bad_request(m, Some("structured_outputs"));
        let mut found = Vec::new();
        if let Some(json) = &self.json {
            let schema = match json {
                serde_json::Value::String(text) => serde_json::from_str(text).map_err(|e| {
                    bad(format!("`structured_outputs.json` is not valid JSON: {e}"))
                })?,
                other => other.clone(),
            };
            found.push(("json", Grammar::JsonSchema(schema)));
        }
        if let Some(rx) = &self.regex {
            found.push(("regex", Grammar::Regex(rx.clone())));
        }
        if let Some(choice) = &self.choice {
            if choice.is_empty() {
                return Err(bad(
                    "`structured_outputs.choice` must list at least one string".into(),
                ));
            }
            found.push(("choice", Grammar::Choice(choice.clone())));
        }
        if let Some(g) = &self.grammar {
            found.push(("grammar", Grammar::Lark(g.clone())));
        }
        if self.json_object == Some(true) {
            found.push(("json_object", Grammar::JsonObject));
        }
        match found.len() {
            0 | 1 => Ok(found.pop().map(|(_, g)| g)),
            _ => {
                let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
                Err(bad(format!(
                    "`structured_outputs` takes one of json, regex, choice, grammar, json_object; got {}",
                    names.join(" and ")
                )))
            }
        }
    }
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

    /// The grammar the request's output must match, with the field that asked for it
    /// (`response_format` or `structured_outputs`, not both).
    pub fn grammar(&self) -> Result<Option<(Grammar, &'static str)>, ApiError> {
        let format = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Grammar::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema }) => Some(match &json_schema.schema {
                Some(schema) => Grammar::JsonSchema(schema.clone()),
                None => Grammar::JsonSchema(serde_json::json!({})),
            }),
        };
        let extra = match &self.structured_outputs {
            Some(so) => so.grammar()?,
            None => None,
        };
        match (format, extra) {
            (Some(_), Some(_)) => Err(ApiError::bad_request(
                "`response_format` and `structured_outputs` cannot both constrain the output; send one",
                Some("structured_outputs"),
            )),
            (Some(g), None) => Ok(Some((g, "response_format"))),
            (None, Some(g)) => Ok(Some((g, "structured_outputs"))),
            (None, None) => Ok(None),
        }
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

/// Fields OpenAI defines that change nothing Ferrite generates: accepted by every
/// endpoint and ignored, each logged the first time a request sends it. Storage and
/// billing hints (`store`, `metadata`, `service_tier`, `user`, `safety_identifier`), cache
/// and latency hints (`prompt_cache_key`, `prompt_cache_retention`, `prediction`), and
/// `reasoning_effort` and `verbosity`, which only reasoning models read and which the
/// models Ferrite runs do not.
pub const IGNORED_FIELDS: &[&str] = &[
    "store",
    "metadata",
    "service_tier",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prediction",
    "reasoning_effort",
    "verbosity",
];

/// Logs, once per field name for the life of the process, that a request sent a field
/// that is ignored.
pub fn note_ignored(field: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let Ok(mut seen) = SEEN.lock() else { return };
    if !seen.iter().any(|f| f == field) {
        tracing::warn!("ignoring request field `{field}`: it changes nothing this server generates (logged once)");
        seen.push(field.to_string());
    }
}

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
    /// `system`, `user`, `assistant`, `tool` (or `developer`, treated as `system`).
    pub role: String,
    /// The message text; may be null in an assistant turn that calls tools.
    #[serde(default)]
    pub content: Option<Content>,
    /// A participant's name (accepted and ignored).
    pub name: Option<String>,
    /// An assistant turn's tool calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// Which call a `tool` turn answers.
    pub tool_call_id: Option<String>,
}

/// A tool call in an assistant turn of the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallIn {
    /// The call's id, which the `tool` turn answering it repeats.
    pub id: Option<String>,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function called.
    pub function: FunctionCallIn,
}

/// The function of a tool call in the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallIn {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
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
    /// Function tools the model may call.
    pub tools: Option<Vec<ToolSpec>>,
    /// Whether and which tool to call: `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<ToolChoiceSpec>,
    /// Whether one answer may call several tools (default true).
    pub parallel_tool_calls: Option<bool>,
}

impl ChatRequest {
    /// The messages as the chat template expects them; a `tool` turn must name the call
    /// it answers.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        chat_messages(&self.messages)
    }
}

/// `messages` as the chat template expects them, each mistake a 400 naming `messages`.
pub fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let bad = |msg: String| ApiError::bad_request(msg, Some("messages"));
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => m.role.clone(),
                "developer" => "system".into(),
                other => {
                    return Err(bad(format!(
                        "`messages[{i}].role` must be system, developer, user, assistant or tool, got `{other}`"
                    )))
                }
            };
            let content = match &m.content {
                None if role == "assistant" && m.tool_calls.is_some() => String::new(),
                None => return Err(bad(format!("`messages[{i}].content` is missing"))),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(bad(format!(
                                    "`messages[{i}].content` part of type `{kind}` is not supported; only `text` parts are"
                                )))
                            }
                        }
                    }
                    text
                }
            };
            if role == "tool" && m.tool_call_id.is_none() {
                return Err(bad(format!(
                    "`messages[{i}]` has role `tool` but no `tool_call_id`; a tool turn names the call it answers"
                )));
            }
            if m.tool_calls.is_some() && role != "assistant" {
                return Err(bad(format!(
                    "`messages[{i}].tool_calls` is only allowed in an assistant turn, not `{role}`"
                )));
            }
            let tool_calls = m.tool_calls.as_ref().map(|calls| {
                calls
                    .iter()
                    .map(|c| template_call(c.id.as_deref(), &c.function.name, &c.function.arguments))
                    .collect()
            });
            Ok(ChatMessage {
                role,
                content,
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
            })
        })
        .collect()
}

/// A function call as chat templates read it: OpenAI's shape, with the arguments parsed as
/// JSON when they are JSON.
pub fn template_call(id: Option<&str>, name: &str, arguments: &str) -> serde_json::Value {
    let arguments = serde_json::from_str::<serde_json::Value>(arguments)
        .unwrap_or_else(|_| serde_json::Value::String(arguments.to_string()));
    serde_json::json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}
