//! A streamed completion: every choice's engine events, merged as they come, become typed
//! chunks — the opening chunk, one per token, one per finish, the usage chunk if asked —
//! sent as Server-Sent Events and closed by `data: [DONE]`. [`StreamState`] turns one event
//! at a time into chunks, with one method per kind of event.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, Sse};
use futures::stream::{self, Stream, StreamExt};
use serde::Serialize;

use super::call_reader::{CallPiece, CallReader};
use super::completions::{assistant, prompt_entries, siblings, Kind, Plan, Tracker};
use super::errors::ApiError;
use super::openai::response::{
    ChatChunk, ChatLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, Delta,
    FunctionDelta, ToolCallDelta, Usage,
};
use super::{AppState, Ready};
use crate::engine::{Event, Finish, RequestStream};
use crate::sequence::{FinishReason, TokenOutput};

/// One Server-Sent Event's data.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Chunk {
    Completion(Completion),
    Chat(ChatChunk),
    /// OpenAI's error object, when the engine cut the stream off.
    Error(serde_json::Value),
}

/// What a streamed response has sent so far, and what it still holds back.
struct StreamState {
    state: Arc<AppState>,
    ready: Arc<Ready>,
    plan: Plan,
    trackers: Vec<Tracker>,
    /// Choices not yet finished.
    open: usize,
    completion_tokens: usize,
    cached: usize,
    /// Per choice, where its next token's text starts (for `text_offset`).
    offsets: Vec<usize>,
    /// Events of a scored prompt's later choices, held until the prompt's scores (from its
    /// first choice) have been echoed for them.
    held: Vec<Option<Vec<Event>>>,
    /// With tools, each choice's text so far: it is read for calls when the choice ends.
    texts: Vec<String>,
    /// With tools whose every call a grammar shapes, each choice's calls read as they are
    /// written, so they stream as they grow.
    readers: Vec<Option<CallReader>>,
}

impl StreamState {
    fn new(state: &Arc<AppState>, ready: Arc<Ready>, plan: Plan, arrived: Instant) -> Self {
        let n = plan.jobs.len();
        StreamState {
            state: Arc::clone(state),
            trackers: (0..n)
                .map(|_| Tracker::new(arrived, Arc::clone(state)))
                .collect(),
            open: n,
            completion_tokens: 0,
            cached: 0,
            offsets: vec![0; n],
            texts: vec![String::new(); n],
            readers: vec![plan.tools.as_deref().and_then(CallReader::new); n],
            held: plan
                .jobs
                .iter()
                .map(|j| (plan.score_prompt && j.choice > 0).then(Vec::new))
                .collect(),
            ready,
            plan,
        }
    }

    /// A chunk of this response carrying `choice` of endpoint kind, and `usage`.
    fn chunk(&self, choice: Option<ChoiceStep>, usage: Option<Usage>) -> Chunk {
        let plan = &self.plan;
        match plan.kind {
            Kind::Completion => Chunk::Completion(Completion {
                id: plan.id.clone(),
                object: "text_completion",
                created: plan.created,
                model: plan.model.clone(),
                choices: choice.map(ChoiceStep::completion).into_iter().collect(),
                usage,
            }),
            Kind::Chat => Chunk::Chat(ChatChunk {
                id: plan.id.clone(),
                object: "chat.completion.chunk",
                created: plan.created,
                model: plan.model.clone(),
                choices: choice.map(ChoiceStep::chat).into_iter().collect(),
                usage,
            }),
        }
    }

    /// The first chunks: the assistant role for chat, the echoed prompt for completions
    /// (a scored prompt is echoed when its scores arrive).
    fn opening(&self) -> Vec<Chunk> {
        let mut out = Vec::new();
        for (index, job) in self.plan.jobs.iter().enumerate() {
            let step = match self.plan.kind {
                Kind::Chat => ChoiceStep {
                    role: true,
                    ..ChoiceStep::text(index, String::new())
                },
                Kind::Completion if self.plan.score_prompt => continue,
                Kind::Completion => match self.plan.echo_of(job) {
                    "" => continue,
                    echo => ChoiceStep::text(index, echo.to_string()),
                },
            };
            out.push(self.chunk(Some(step), None));
        }
        out
    }

    /// Choice `i`'s next event: held back while its prompt's scores have not been echoed,
    /// else rendered, releasing what its siblings held once a first choice's scores (or its
    /// end) arrive.
    fn on_event(&mut self, i: usize, event: Event) -> Vec<Chunk> {
        if let Some(held) = self.held[i].as_mut() {
            held.push(event);
            return Vec::new();
        }
        let frees = self.plan.jobs[i].choice == 0
            && matches!(event, Event::PromptLogprobs(_) | Event::Finished(_));
        let mut out = self.render(i, event);
        if frees {
            for k in siblings(&self.plan.jobs, i).collect::<Vec<_>>() {
                self.release(k, &mut out);
            }
        }
        out
    }

    /// Every stream has ended: whatever is still held, then an error event if a choice
    /// never finished (its engine went away) rather than ending as if complete.
    fn on_end(&mut self) -> Vec<Chunk> {
        let mut out = Vec::new();
        for k in 0..self.held.len() {
            self.release(k, &mut out);
        }
        if self.open > 0 {
            out.push(Chunk::Error(
                ApiError::from(crate::Error::EngineStopped).body(),
            ));
        }
        out
    }

    /// Renders the events held for choice `k`, which need no more holding.
    fn release(&mut self, k: usize, out: &mut Vec<Chunk>) {
        for event in self.held[k].take().unwrap_or_default() {
            out.extend(self.render(k, event));
        }
    }

    fn render(&mut self, i: usize, event: Event) -> Vec<Chunk> {
        self.trackers[i].observe(&event);
        match event {
            Event::PromptLogprobs(scores) => self.on_prompt_scores(i, scores),
            Event::Token { token, text } => self.on_token(i, token, text),
            Event::Finished(f) => self.on_finished(i, f),
        }
    }

    /// The echo, scored, for every choice of choice `i`'s prompt.
    fn on_prompt_scores(&mut self, i: usize, scores: Vec<TokenOutput>) -> Vec<Chunk> {
        let job = &self.plan.jobs[i];
        let tk = &self.ready.tokenizer;
        let entries = prompt_entries(&job.prompt, scores);
        let logprobs = CompletionLogprobs::new(tk, &entries, 0);
        let offset = entries.iter().map(|t| tk.token_text(t.id).len()).sum();
        let echo = self.plan.echo_of(job).to_string();
        let choices: Vec<usize> = siblings(&self.plan.jobs, i).collect();
        choices
            .into_iter()
            .map(|k| {
                self.offsets[k] = offset;
                let mut step = ChoiceStep::text(k, echo.clone());
                step.logprobs = Some(Logprobs::Completion(logprobs.clone()));
                self.chunk(Some(step), None)
            })
            .collect()
    }

    /// A token's text (and log-probabilities, if asked for); nothing when both are empty.
    fn on_token(&mut self, i: usize, token: TokenOutput, text: String) -> Vec<Chunk> {
        let tk = &self.ready.tokenizer;
        let logprobs = self.plan.logprobs.then(|| {
            let one = std::slice::from_ref(&token);
            match self.plan.kind {
                Kind::Completion => {
                    Logprobs::Completion(CompletionLogprobs::new(tk, one, self.offsets[i]))
                }
                Kind::Chat => Logprobs::Chat(ChatLogprobs::new(tk, one)),
            }
        });
        self.offsets[i] += tk.token_text(token.id).len();
        if self.plan.tools.is_some() {
            // Read for calls as it grows where a grammar shapes them, else held until the
            // choice ends and its calls can be read.
            self.texts[i].push_str(&text);
            let pieces = match self.readers[i].as_mut() {
                Some(reader) => reader.advance(&self.texts[i]),
                None => Vec::new(),
            };
            return pieces
                .into_iter()
                .map(|piece| {
                    let delta = match piece {
                        CallPiece::Named { index, id, name } => ToolCallDelta {
                            index,
                            id: Some(id),
                            kind: Some("function"),
                            function: FunctionDelta {
                                name: Some(name),
                                arguments: String::new(),
                            },
                        },
                        CallPiece::Arguments { index, text } => ToolCallDelta {
                            index,
                            id: None,
                            kind: None,
                            function: FunctionDelta {
                                name: None,
                                arguments: text,
                            },
                        },
                    };
                    let step = ChoiceStep {
                        calls: vec![delta],
                        ..ChoiceStep::text(i, String::new())
                    };
                    self.chunk(Some(step), None)
                })
                .collect();
        }
        if text.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        let mut step = ChoiceStep::text(i, text);
        step.logprobs = logprobs;
        vec![self.chunk(Some(step), None)]
    }

    /// The choice's finish reason, then the usage chunk once every choice has finished.
    fn on_finished(&mut self, i: usize, f: Finish) -> Vec<Chunk> {
        self.open -= 1;
        self.completion_tokens += f.completion_tokens;
        if self.plan.jobs[i].choice == 0 {
            self.cached += f.cached_tokens;
        }
        let mut out = Vec::new();
        let mut finish = f.reason.as_str();
        let streamed = self.readers[i].as_ref().is_some_and(CallReader::started);
        if let Some(tools) = self.plan.tools.clone().filter(|_| streamed) {
            // The calls went out as they were written; what the text says is only counted.
            let text = std::mem::take(&mut self.texts[i]);
            assistant(&self.state, Some(&tools), text, f.reason);
            finish = match f.reason {
                FinishReason::Length => "length",
                _ => "tool_calls",
            };
        } else if let Some(tools) = self.plan.tools.clone() {
            let text = std::mem::take(&mut self.texts[i]);
            let (message, reason) = assistant(&self.state, Some(&tools), text, f.reason);
            finish = reason;
            if let Some(content) = message.content.filter(|c| !c.is_empty()) {
                out.push(self.chunk(Some(ChoiceStep::text(i, content)), None));
            }
            for (k, call) in message.tool_calls.into_iter().enumerate() {
                // The call's id and name, then its arguments, as OpenAI streams them.
                let named = ToolCallDelta {
                    index: k,
                    id: Some(call.id),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(call.function.name),
                        arguments: String::new(),
                    },
                };
                let args = ToolCallDelta {
                    index: k,
                    id: None,
                    kind: None,
                    function: FunctionDelta {
                        name: None,
                        arguments: call.function.arguments,
                    },
                };
                for delta in [named, args] {
                    let step = ChoiceStep {
                        calls: vec![delta],
                        ..ChoiceStep::text(i, String::new())
                    };
                    out.push(self.chunk(Some(step), None));
                }
            }
        }
        let mut step = ChoiceStep::text(i, String::new());
        step.finish = Some(finish);
        out.push(self.chunk(Some(step), None));
        if self.open == 0 && self.plan.include_usage {
            let usage = Usage::new(
                self.plan.prompt_tokens(),
                self.completion_tokens,
                self.cached,
            );
            out.push(self.chunk(None, Some(usage)));
        }
        out
    }
}

/// Log-probabilities in one endpoint's shape.
enum Logprobs {
    Completion(CompletionLogprobs),
    Chat(ChatLogprobs),
}

/// One choice's part of a chunk, before it takes its endpoint's shape.
struct ChoiceStep {
    index: usize,
    /// Chat's opening chunk: the assistant role.
    role: bool,
    text: String,
    logprobs: Option<Logprobs>,
    finish: Option<&'static str>,
    /// Chat: a tool call's part.
    calls: Vec<ToolCallDelta>,
}

impl ChoiceStep {
    fn text(index: usize, text: String) -> Self {
        ChoiceStep {
            index,
            role: false,
            text,
            logprobs: None,
            finish: None,
            calls: Vec::new(),
        }
    }

    fn completion(self) -> CompletionChoice {
        CompletionChoice {
            index: self.index,
            text: self.text,
            logprobs: match self.logprobs {
                Some(Logprobs::Completion(l)) => Some(l),
                _ => None,
            },
            finish_reason: self.finish,
        }
    }

    /// A finish carries an empty delta; the opening carries the role and empty content.
    fn chat(self) -> ChunkChoice {
        let delta = match (self.role, self.finish) {
            (true, _) => Delta {
                role: Some("assistant"),
                content: Some(self.text),
                tool_calls: Vec::new(),
            },
            (false, Some(_)) => Delta::default(),
            (false, None) if !self.calls.is_empty() => Delta {
                role: None,
                content: None,
                tool_calls: self.calls,
            },
            (false, None) => Delta {
                role: None,
                content: Some(self.text),
                tool_calls: Vec::new(),
            },
        };
        ChunkChoice {
            index: self.index,
            delta,
            logprobs: match self.logprobs {
                Some(Logprobs::Chat(l)) => Some(l),
                _ => None,
            },
            finish_reason: self.finish,
        }
    }
}

/// Streams every choice's tokens as chunks, then the usage chunk if asked, then `[DONE]`.
pub(super) fn sse(
    state: Arc<AppState>,
    ready: Arc<Ready>,
    plan: Plan,
    streams: Vec<RequestStream>,
    arrived: Instant,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    // Every choice's events, then `None` once all streams have ended.
    let merged = stream::select_all(streams.into_iter().enumerate().map(|(i, s)| {
        Box::pin(
            stream::unfold(s, |mut s| async move { s.next().await.map(|ev| (ev, s)) })
                .map(move |ev| Some((i, ev))),
        )
    }))
    .chain(stream::once(async { None }));
    let state = StreamState::new(&state, ready, plan, arrived);
    let opening = state.opening();
    let body = merged
        .scan(state, |state, item| {
            let chunks = match item {
                Some((i, event)) => state.on_event(i, event),
                None => state.on_end(),
            };
            futures::future::ready(Some(chunks))
        })
        .flat_map(stream::iter);
    let events = stream::iter(opening)
        .chain(body)
        .map(|chunk| {
            let data = serde_json::to_string(&chunk).unwrap_or_else(|e| {
                format!(r#"{{"error":{{"message":"cannot encode a chunk: {e}"}}}}"#)
            });
            Ok(SseEvent::default().data(data))
        })
        .chain(stream::once(async {
            Ok(SseEvent::default().data("[DONE]"))
        }));
    Sse::new(events)
}
