//! `POST /v1/responses` (OpenAI's Responses API) and `GET`/`DELETE /v1/responses/{id}`.
//! The stored previous response and the input items become a chat conversation, answered
//! by the chat completions' path (template, tools, grammar); the answer becomes output
//! items, whole or as the Responses event stream ([`EventStream`]), and is stored for
//! `previous_response_id` unless `store: false`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::call_reader::{CallPiece, CallReader};
use super::completions::{assistant, known_fields, render_chat, submit, Answer, Job, Tracker};
use super::errors::{from_json, ApiError, Body};
use super::openai::fields_of;
use super::openai::request::{template_call, Sampling};
use super::openai::response::ChatLogprobs;
use super::openai::responses::{
    Deleted, IncompleteDetails, Input, Numbered, OutputItem, OutputText, ResponseError,
    ResponseObject, ResponseUsage, ResponsesRequest, StreamEvent, TextFormat, TextOut,
    TokenLogprob,
};
use super::response_store::{Lookup, Stored};
use super::tools::{Call, NamedFunction, ToolChoiceSpec, ToolFormat, ToolSpec, Tools};
use super::{AppState, Ready};
use crate::engine::{Event, Finish, RequestStream};
use crate::grammar::Grammar;
use crate::sequence::{FinishReason, TokenOutput};
use crate::tokenizer::ChatMessage;

/// The `include` value that asks for the output tokens' log-probabilities.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// `POST /v1/responses`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let req: ResponsesRequest =
        from_json(known_fields(&body, fields_of::<ResponsesRequest>())?.into())?;
    state.check_model(&req.model)?;
    refuse_unsupported(&req)?;
    let mut conversation = match &req.previous_response_id {
        Some(id) => match state.responses.get(id, Some("previous_response_id")) {
            Lookup::Found(previous) => previous.conversation.clone(),
            Lookup::Missing(e) => return Err(e),
        },
        None => Vec::new(),
    };
    conversation.extend(input_messages(&req.input)?);
    let specs = tool_specs(req.tools.as_deref().unwrap_or_default())?;
    let choice = tool_choice(req.tool_choice.as_ref())?;
    let format = ToolFormat::of_template(ready.tokenizer.chat_template_source());
    let tools = Tools::new(
        Some(&specs),
        choice.as_ref(),
        req.parallel_tool_calls,
        format,
    )?;
    let truncate = req.truncation.as_deref() == Some("auto");
    let (prompt, conversation) = fit(
        &ready,
        req.instructions.as_deref(),
        conversation,
        tools.as_ref(),
        truncate,
    )?;
    let logprobs = req
        .include
        .iter()
        .flatten()
        .any(|i| i == INCLUDE_LOGPROBS)
        .then(|| req.top_logprobs.unwrap_or(0))
        .or(req.top_logprobs);
    let sampling = Sampling {
        temperature: req.temperature,
        top_p: req.top_p,
        ..Sampling::default()
    };
    let answer = Answer {
        max_tokens: req.max_output_tokens,
        logprobs,
        tools: tools.as_ref(),
        requested: requested_grammar(req.text.as_ref().and_then(|t| t.format.as_ref())),
    };
    let params = answer.params(&state, &ready, &sampling, prompt.len())?;
    let base = ResponseObject {
        id: state.responses.new_id(),
        object: "response",
        created_at: super::openai::response::now_unix(),
        status: "in_progress",
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model: req.model.clone(),
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: req.previous_response_id.clone(),
        temperature: params.temperature,
        top_p: params.top_p,
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: req.tools.clone().unwrap_or_default(),
        text: TextOut {
            format: req
                .text
                .as_ref()
                .and_then(|t| t.format.as_ref())
                .and_then(|f| serde_json::to_value(f).ok())
                .unwrap_or_else(|| json!({"type": "text"})),
        },
        truncation: req.truncation.clone().unwrap_or_else(|| "disabled".into()),
        metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
        store: req.store.unwrap_or(true) && state.responses.capacity() > 0,
        service_tier: "default",
        usage: None,
    };
    let arrived = Instant::now();
    let job = Job {
        prompt,
        prompt_index: 0,
        choice: 0,
    };
    let mut streams = submit(&ready, &state, std::slice::from_ref(&job), &params)?;
    let Some(engine_stream) = streams.pop() else {
        return Err(ApiError::internal("the engine accepted no request"));
    };
    let answer = Turn {
        state: Arc::clone(&state),
        ready,
        response: base,
        conversation,
        tools,
        logprobs: logprobs.is_some(),
    };
    if req.stream.unwrap_or(false) {
        return Ok(answer.stream(engine_stream, arrived).into_response());
    }
    let mut tracker = Tracker::new(arrived, Arc::clone(&state));
    let c = engine_stream.collect(move |e| tracker.observe(e)).await?;
    let message_id = item_id("msg");
    let response = answer.finish(&message_id, c.text, &c.tokens, &c.finish);
    Ok(Json(response).into_response())
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ResponseObject>, ApiError> {
    match state.responses.get(&id, None) {
        Lookup::Found(stored) => Ok(Json(stored.response.clone())),
        Lookup::Missing(e) => Err(e),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Deleted>, ApiError> {
    if state.responses.delete(&id) {
        return Ok(Json(Deleted {
            id,
            object: "response",
            deleted: true,
        }));
    }
    match state.responses.get(&id, None) {
        Lookup::Missing(e) => Err(e),
        Lookup::Found(_) => Err(ApiError::internal(format!(
            "response `{id}` was stored again while it was being deleted"
        ))),
    }
}

/// Refuses what this server cannot honour and would change the answer.
fn refuse_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.background == Some(true) {
        return Err(ApiError::bad_request(
            "`background: true` is not supported: responses run while the request is open; \
             use `stream: true` for long ones",
            Some("background"),
        ));
    }
    if req.max_tool_calls.is_some() {
        return Err(ApiError::bad_request(
            "`max_tool_calls` is not supported; `parallel_tool_calls: false` limits an answer \
             to one call",
            Some("max_tool_calls"),
        ));
    }
    match req.truncation.as_deref() {
        None | Some("disabled") | Some("auto") => Ok(()),
        Some(other) => Err(ApiError::bad_request(
            format!("`truncation` must be `disabled` or `auto`, got `{other}`"),
            Some("truncation"),
        )),
    }
}

/// The grammar `text.format` asks for.
fn requested_grammar(format: Option<&TextFormat>) -> Option<(Grammar, &'static str)> {
    let grammar = match format? {
        TextFormat::Text => return None,
        TextFormat::JsonObject => Grammar::JsonObject,
        TextFormat::JsonSchema { schema, .. } => Grammar::JsonSchema(schema.clone()),
    };
    Some((grammar, "text.format"))
}

/// The prompt of `instructions` (a system turn, first) and `conversation` as the model
/// reads them, with the conversation as it was used. When it does not fit the context and
/// `truncate` is set, the oldest turns are dropped until it does, as OpenAI's
/// `truncation: "auto"` does; otherwise the engine refuses it, naming the lengths.
fn fit(
    ready: &Ready,
    instructions: Option<&str>,
    mut conversation: Vec<ChatMessage>,
    tools: Option<&Tools>,
    truncate: bool,
) -> Result<(Vec<u32>, Vec<ChatMessage>), ApiError> {
    let max_model_len = ready.engine.info().max_model_len;
    loop {
        let messages = instructions
            .map(|i| ChatMessage::new("system", i))
            .into_iter()
            .chain(conversation.iter().cloned())
            .collect();
        let prompt = render_chat(ready, messages, tools)?;
        if !truncate || prompt.len() < max_model_len || conversation.len() <= 1 {
            return Ok((prompt, conversation));
        }
        conversation.remove(0);
        // A tool's answer without the call it answers is no turn to start from.
        while conversation.first().is_some_and(|m| m.role == "tool") && conversation.len() > 1 {
            conversation.remove(0);
        }
    }
}

/// The input items as chat turns: messages (`role` and text `content`), function calls
/// (joined to the assistant turn they follow) and their outputs (tool turns). Each mistake
/// is a 400 naming `input` and the item.
fn input_messages(input: &Input) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        Input::Text(text) => return Ok(vec![ChatMessage::new("user", text.as_str())]),
        Input::Items(items) => items,
    };
    let mut turns: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let bad = |m: String| ApiError::bad_request(format!("`input[{i}]` {m}"), Some("input"));
        let field = |name: &str| -> Result<&str, ApiError> {
            item.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("needs `{name}`, a string")))
        };
        match item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message")
        {
            "message" => {
                let role = match field("role")? {
                    r @ ("user" | "system" | "assistant") => r,
                    "developer" => "system",
                    other => {
                        return Err(bad(format!(
                            "has role `{other}`; a message's role is user, system, developer or assistant"
                        )))
                    }
                };
                let content = text_of(item.get("content")).map_err(bad)?;
                turns.push(ChatMessage::new(role, content));
            }
            "function_call" => {
                let call =
                    template_call(Some(field("call_id")?), field("name")?, field("arguments")?);
                match turns.last_mut() {
                    Some(last) if last.role == "assistant" => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call);
                    }
                    _ => turns.push(ChatMessage {
                        tool_calls: Some(vec![call]),
                        ..ChatMessage::new("assistant", "")
                    }),
                }
            }
            "function_call_output" => {
                let output = text_of(item.get("output")).map_err(bad)?;
                turns.push(ChatMessage {
                    tool_call_id: Some(field("call_id")?.to_string()),
                    ..ChatMessage::new("tool", output)
                });
            }
            // A reasoning model's thoughts: the models served here neither write nor read them.
            "reasoning" => {}
            other => {
                return Err(bad(format!(
                    "has type `{other}`; supported: message, function_call, function_call_output"
                )))
            }
        }
    }
    Ok(turns)
}

/// The text of a message's `content` or a call's `output`: a string, or text parts
/// (`input_text`, `output_text`, `refusal`) joined.
fn text_of(content: Option<&Value>) -> Result<String, String> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                let key = match kind {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    other => {
                        return Err(format!(
                            "has a content part of type `{other}`; only text parts \
                             (input_text, output_text) are supported"
                        ))
                    }
                };
                match part.get(key).and_then(Value::as_str) {
                    Some(t) => text.push_str(t),
                    None => return Err(format!("has a `{kind}` part without `{key}`")),
                }
            }
            Ok(text)
        }
        _ => Err("needs `content` (or `output`): a string or a list of text parts".into()),
    }
}

/// `tools` as the chat path takes them: only function tools, each flat as the Responses
/// API writes them (`{"type": "function", "name", "parameters", ...}`).
fn tool_specs(tools: &[Value]) -> Result<Vec<ToolSpec>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let bad = |m: String| ApiError::bad_request(m, Some("tools"));
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                other => {
                    return Err(bad(format!(
                        "`tools[{i}].type` must be `function` (the only tools this server runs), got {}",
                        other.map_or("nothing".to_string(), |o| format!("`{o}`"))
                    )))
                }
            }
            let mut function = t.clone();
            if let Value::Object(o) = &mut function {
                o.remove("type");
            }
            let function = serde_json::from_value(function)
                .map_err(|e| bad(format!("`tools[{i}]` is not a function tool: {e}")))?;
            Ok(ToolSpec {
                kind: "function".into(),
                function,
            })
        })
        .collect()
}

/// `tool_choice` as the chat path takes it: a mode or `{"type": "function", "name"}`.
fn tool_choice(choice: Option<&Value>) -> Result<Option<ToolChoiceSpec>, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
            Some("tool_choice"),
        )
    };
    match choice {
        None => Ok(None),
        Some(Value::String(mode)) => Ok(Some(ToolChoiceSpec::Mode(mode.clone()))),
        Some(named) => match (
            named.get("type").and_then(Value::as_str),
            named.get("name").and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => Ok(Some(ToolChoiceSpec::Named {
                kind: "function".into(),
                function: NamedFunction { name: name.into() },
            })),
            _ => Err(bad()),
        },
    }
}

/// A fresh item id with `prefix` (`msg`, `fc`).
fn item_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// Output tokens' log-probabilities in the Responses shape.
fn token_logprobs(ready: &Ready, tokens: &[TokenOutput]) -> Vec<TokenLogprob> {
    ChatLogprobs::new(&ready.tokenizer, tokens)
        .content
        .into_iter()
        .map(|t| TokenLogprob {
            token: t.token,
            logprob: t.logprob.unwrap_or(0.0),
            bytes: t.bytes,
            top_logprobs: t.top_logprobs,
        })
        .collect()
}

/// One response being answered: what it started as, and what it needs to finish.
struct Turn {
    state: Arc<AppState>,
    ready: Arc<Ready>,
    /// The response, `in_progress`, without output.
    response: ResponseObject,
    /// The conversation it answers (without instructions), stored with the answer.
    conversation: Vec<ChatMessage>,
    tools: Option<Tools>,
    /// Whether the tokens' log-probabilities go with the text.
    logprobs: bool,
}

impl Turn {
    /// The output items of the answer `text` (read for calls when there are tools), in a
    /// message whose id is `message_id`.
    /// The output items of the answer `text` (read for calls when there are tools), in a
    /// message whose id is `message_id`; calls already streamed as they were written
    /// (`streamed`, with their item ids) come first and stand for the calls in the text.
    fn items(
        &self,
        message_id: &str,
        text: String,
        tokens: &[TokenOutput],
        finish: &Finish,
        streamed: &[(String, Call)],
    ) -> Vec<OutputItem> {
        let (message, reason) = assistant(&self.state, self.tools.as_ref(), text, finish.reason);
        let status = match finish.reason {
            FinishReason::Length => "incomplete",
            _ => "completed",
        };
        let (content, calls): (String, Vec<(String, Call)>) = match streamed {
            [] => (
                message.content.unwrap_or_default(),
                message
                    .tool_calls
                    .into_iter()
                    .map(|c| {
                        let call = Call {
                            id: c.id,
                            name: c.function.name,
                            arguments: c.function.arguments,
                        };
                        (item_id("fc"), call)
                    })
                    .collect(),
            ),
            _ => (String::new(), streamed.to_vec()),
        };
        let mut items: Vec<OutputItem> = calls
            .into_iter()
            .map(|(id, call)| OutputItem::FunctionCall {
                id,
                call_id: call.id,
                name: call.name,
                arguments: call.arguments,
                status,
            })
            .collect();
        if !content.is_empty() || items.is_empty() {
            let logprobs = match self.logprobs && reason != "tool_calls" {
                true => token_logprobs(&self.ready, tokens),
                false => Vec::new(),
            };
            items.insert(
                0,
                OutputItem::Message {
                    id: message_id.to_string(),
                    status,
                    role: "assistant",
                    content: vec![OutputText::new(content, logprobs)],
                },
            );
        }
        items
    }

    /// The finished response with `items` as its output, stored unless `store: false`.
    fn done(&self, items: Vec<OutputItem>, finish: &Finish) -> ResponseObject {
        let mut response = self.response.clone();
        (response.status, response.incomplete_details, response.error) = match finish.reason {
            FinishReason::Stop => ("completed", None, None),
            FinishReason::Length => (
                "incomplete",
                Some(IncompleteDetails {
                    reason: "max_output_tokens",
                }),
                None,
            ),
            FinishReason::Abort => (
                "failed",
                None,
                Some(ResponseError {
                    code: "server_error",
                    message: "generation was aborted before the answer was complete".into(),
                }),
            ),
        };
        response.usage = Some(ResponseUsage::new(
            finish.prompt_tokens,
            finish.completion_tokens,
            finish.cached_tokens,
        ));
        response.output = items;
        if response.store {
            let mut conversation = self.conversation.clone();
            conversation.push(answer_turn(&response.output));
            self.state.responses.put(Stored {
                response: response.clone(),
                conversation,
            });
        }
        response
    }

    /// The whole response to a collected answer.
    fn finish(
        &self,
        message_id: &str,
        text: String,
        tokens: &[TokenOutput],
        finish: &Finish,
    ) -> ResponseObject {
        let items = self.items(message_id, text, tokens, finish, &[]);
        self.done(items, finish)
    }

    /// The answer as the Responses event stream.
    fn stream(
        self,
        engine: RequestStream,
        arrived: Instant,
    ) -> Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>> {
        let tracker = Tracker::new(arrived, Arc::clone(&self.state));
        let mut events = EventStream {
            reader: self.tools.as_ref().and_then(CallReader::new),
            call_items: Vec::new(),
            turn: self,
            tracker,
            next: 0,
            message_id: item_id("msg"),
            streaming_text: false,
            text: String::new(),
            tokens: Vec::new(),
            finished: false,
        };
        let opening = events.opening();
        let engine = stream::unfold(
            engine,
            |mut s| async move { s.next().await.map(|e| (e, s)) },
        )
        .map(Some)
        .chain(stream::once(async { None }));
        let body = engine
            .scan(events, |events, event| {
                let out = match event {
                    Some(e) => events.on_event(e),
                    None => events.on_end(),
                };
                futures::future::ready(Some(out))
            })
            .flat_map(stream::iter);
        Sse::new(stream::iter(opening).chain(body).map(|e: Numbered| {
            let data = serde_json::to_string(&e).unwrap_or_else(|err| {
                format!(r#"{{"type":"error","sequence_number":{},"message":"cannot encode an event: {err}"}}"#, e.sequence_number)
            });
            Ok(SseEvent::default().event(e.event.name()).data(data))
        }))
    }
}

/// The assistant turn an answer's output items make, for a later response to continue.
fn answer_turn(items: &[OutputItem]) -> ChatMessage {
    let mut turn = ChatMessage::new("assistant", "");
    for item in items {
        match item {
            OutputItem::Message { content, .. } => {
                turn.content = content.iter().map(|p| p.text.as_str()).collect();
            }
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => turn
                .tool_calls
                .get_or_insert_with(Vec::new)
                .push(template_call(Some(call_id), name, arguments)),
        }
    }
    turn
}

/// A streamed response: the engine's events become Responses events, numbered in order.
/// Without tools the text is sent as it comes; with tools it is held until the answer
/// ends and its calls can be read, then sent as whole items.
struct EventStream {
    turn: Turn,
    tracker: Tracker,
    /// The next event's sequence number.
    next: u64,
    message_id: String,
    /// The message item and its text part have been opened.
    streaming_text: bool,
    text: String,
    tokens: Vec<TokenOutput>,
    finished: bool,
    /// With tools whose calls a grammar shapes, the calls read as they are written.
    reader: Option<CallReader>,
    /// The item ids of the calls streamed so far.
    call_items: Vec<String>,
}

impl EventStream {
    fn number(&mut self, event: StreamEvent) -> Numbered {
        self.next += 1;
        Numbered {
            event,
            sequence_number: self.next - 1,
        }
    }

    /// `response.created`, then `response.in_progress`.
    fn opening(&mut self) -> Vec<Numbered> {
        let response = self.turn.response.clone();
        vec![
            self.number(StreamEvent::Created {
                response: response.clone(),
            }),
            self.number(StreamEvent::InProgress { response }),
        ]
    }

    fn on_event(&mut self, event: Event) -> Vec<Numbered> {
        self.tracker.observe(&event);
        match event {
            Event::Token { token, text } => self.on_token(token, text),
            Event::Finished(f) => self.on_finished(&f),
            Event::PromptLogprobs(_) => Vec::new(),
        }
    }

    /// The message item and its text part, opened.
    fn open_message(&mut self) -> Vec<Numbered> {
        self.streaming_text = true;
        let item = OutputItem::Message {
            id: self.message_id.clone(),
            status: "in_progress",
            role: "assistant",
            content: Vec::new(),
        };
        let part = StreamEvent::PartAdded {
            item_id: self.message_id.clone(),
            output_index: 0,
            content_index: 0,
            part: OutputText::new(String::new(), Vec::new()),
        };
        vec![
            self.number(StreamEvent::ItemAdded {
                output_index: 0,
                item,
            }),
            self.number(part),
        ]
    }

    fn on_token(&mut self, token: TokenOutput, text: String) -> Vec<Numbered> {
        self.text.push_str(&text);
        self.tokens.push(token);
        if self.turn.tools.is_some() {
            return self.on_call_text();
        }
        if text.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if !self.streaming_text {
            out = self.open_message();
        }
        let logprobs = match self.turn.logprobs {
            true => token_logprobs(&self.turn.ready, &self.tokens[self.tokens.len() - 1..]),
            false => Vec::new(),
        };
        let delta = StreamEvent::TextDelta {
            item_id: self.message_id.clone(),
            output_index: 0,
            content_index: 0,
            delta: text,
            logprobs,
        };
        out.push(self.number(delta));
        out
    }

    /// With tools, the calls the text has grown: an item as each call is named, then its
    /// arguments as they are written (nothing where no grammar shapes the calls: they are
    /// read when the answer ends).
    fn on_call_text(&mut self) -> Vec<Numbered> {
        let Some(reader) = self.reader.as_mut() else {
            return Vec::new();
        };
        let pieces = reader.advance(&self.text);
        let mut out = Vec::new();
        for piece in pieces {
            let event = match piece {
                CallPiece::Named { index, id, name } => {
                    let item_id = item_id("fc");
                    self.call_items.push(item_id.clone());
                    StreamEvent::ItemAdded {
                        output_index: index,
                        item: OutputItem::FunctionCall {
                            id: item_id,
                            call_id: id,
                            name,
                            arguments: String::new(),
                            status: "in_progress",
                        },
                    }
                }
                CallPiece::Arguments { index, text } => StreamEvent::ArgumentsDelta {
                    item_id: self.call_items[index].clone(),
                    output_index: index,
                    delta: text,
                },
            };
            out.push(self.number(event));
        }
        out
    }

    /// The items' closing events (opening those not yet open), then the whole response.
    fn on_finished(&mut self, finish: &Finish) -> Vec<Numbered> {
        self.finished = true;
        let text = std::mem::take(&mut self.text);
        let streamed: Vec<(String, Call)> = match &self.reader {
            Some(reader) => self
                .call_items
                .iter()
                .cloned()
                .zip(reader.calls().iter().cloned())
                .collect(),
            None => Vec::new(),
        };
        let items = self
            .turn
            .items(&self.message_id, text, &self.tokens, finish, &streamed);
        let mut out = Vec::new();
        for (index, item) in items.iter().enumerate() {
            match item {
                OutputItem::Message { content, .. } => {
                    if !self.streaming_text {
                        out.extend(self.open_message());
                        let whole = content.first().map(|p| p.text.clone()).unwrap_or_default();
                        if !whole.is_empty() {
                            let delta = StreamEvent::TextDelta {
                                item_id: self.message_id.clone(),
                                output_index: index,
                                content_index: 0,
                                delta: whole,
                                logprobs: Vec::new(),
                            };
                            out.push(self.number(delta));
                        }
                    }
                    if let Some(part) = content.first() {
                        let text_done = StreamEvent::TextDone {
                            item_id: self.message_id.clone(),
                            output_index: index,
                            content_index: 0,
                            text: part.text.clone(),
                            logprobs: part.logprobs.clone(),
                        };
                        out.push(self.number(text_done));
                        let part_done = StreamEvent::PartDone {
                            item_id: self.message_id.clone(),
                            output_index: index,
                            content_index: 0,
                            part: part.clone(),
                        };
                        out.push(self.number(part_done));
                    }
                }
                OutputItem::FunctionCall { id, arguments, .. } if index < streamed.len() => {
                    out.push(self.number(StreamEvent::ArgumentsDone {
                        item_id: id.clone(),
                        output_index: index,
                        arguments: arguments.clone(),
                    }));
                }
                OutputItem::FunctionCall { id, arguments, .. } => {
                    let mut opened = item.clone();
                    if let OutputItem::FunctionCall {
                        arguments, status, ..
                    } = &mut opened
                    {
                        arguments.clear();
                        *status = "in_progress";
                    }
                    out.push(self.number(StreamEvent::ItemAdded {
                        output_index: index,
                        item: opened,
                    }));
                    out.push(self.number(StreamEvent::ArgumentsDelta {
                        item_id: id.clone(),
                        output_index: index,
                        delta: arguments.clone(),
                    }));
                    out.push(self.number(StreamEvent::ArgumentsDone {
                        item_id: id.clone(),
                        output_index: index,
                        arguments: arguments.clone(),
                    }));
                }
            }
            out.push(self.number(StreamEvent::ItemDone {
                output_index: index,
                item: item.clone(),
            }));
        }
        let response = self.turn.done(items, finish);
        let last = match response.status {
            "completed" => StreamEvent::Completed { response },
            "incomplete" => StreamEvent::Incomplete { response },
            _ => StreamEvent::Failed { response },
        };
        out.push(self.number(last));
        out
    }

    /// The engine's stream ended: a response it never finished (the engine went away) fails.
    fn on_end(&mut self) -> Vec<Numbered> {
        if self.finished {
            return Vec::new();
        }
        let mut response = self.turn.response.clone();
        response.status = "failed";
        response.error = Some(ResponseError {
            code: "server_error",
            message: crate::Error::EngineStopped.to_string(),
        });
        vec![self.number(StreamEvent::Failed { response })]
    }
}
