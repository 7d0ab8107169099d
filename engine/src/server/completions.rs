//! `/v1/completions` and `/v1/chat/completions`: validate, tokenize, submit one engine
//! request per prompt and choice, then answer with one typed JSON body or, with
//! `stream: true`, a stream of Server-Sent Events ([`super::stream`]) ending in
//! `data: [DONE]`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::errors::{ApiError, Body};
use super::openai::fields_of;
use super::openai::request::{
    note_ignored, ChatRequest, CompletionRequest, Prompt, Sampling, IGNORED_FIELDS,
};
use super::openai::response::{
    now_unix, request_id, AssistantMessage, ChatChoice, ChatCompletion, ChatLogprobs, Completion,
    CompletionChoice, CompletionLogprobs, FunctionCall, ToolCall, Usage,
};
use super::tools::{ToolFormat, Tools};
use super::{AppState, Ready};
use crate::engine::{Collected, Event, Finish, RequestStream};
use crate::grammar::Grammar;
use crate::sampling::SamplingParams;
use crate::sequence::{FinishReason, TokenOutput};
use crate::tokenizer::ChatMessage;

/// Which endpoint a response is shaped for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// A JSON body's object with each field checked against `known`: another field is refused
/// by name (the message lists what is accepted) unless OpenAI defines it and it changes
/// nothing generated ([`IGNORED_FIELDS`]), in which case it is dropped and logged once.
pub(super) fn known_fields(
    body: &Bytes,
    known: &[&'static str],
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let Value::Object(obj) = super::errors::json_body(body)? else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    };
    let ignored = |k: &str| !known.contains(&k) && IGNORED_FIELDS.contains(&k);
    if let Some(k) = obj
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !ignored(k))
    {
        let all: Vec<&str> = known
            .iter()
            .chain(IGNORED_FIELDS.iter().filter(|f| !known.contains(f)))
            .copied()
            .collect();
        return Err(ApiError::bad_request(
            format!(
                "unrecognized request argument `{k}`; accepted: {}",
                all.join(", ")
            ),
            Some(k),
        ));
    }
    Ok(obj
        .into_iter()
        .filter(|(k, _)| {
            let drop = ignored(k);
            if drop {
                note_ignored(k);
            }
            !drop
        })
        .collect())
}

/// Parses a JSON body into the endpoint's own fields (`T`) and the sampling fields both
/// endpoints share, refusing malformed JSON and unknown fields by name. The two are read
/// apart, each naming a field of the wrong type (a flattened struct would hide the sampling
/// fields' names); the accepted names come from the structs themselves.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<(T, Sampling), ApiError> {
    let (own, sampling) = (fields_of::<T>(), fields_of::<Sampling>());
    let known: Vec<&'static str> = own.iter().chain(sampling).copied().collect();
    let (sampling_part, own_part): (serde_json::Map<_, _>, serde_json::Map<_, _>) =
        known_fields(body, &known)?
            .into_iter()
            .partition(|(k, _)| sampling.contains(&k.as_str()));
    Ok((
        super::errors::from_json(own_part.into())?,
        super::errors::from_json(sampling_part.into())?,
    ))
}

/// One engine request: a prompt and the choice it answers.
pub(super) struct Job {
    pub(super) prompt: Vec<u32>,
    /// Which prompt (for usage, counted once per prompt) and which choice.
    pub(super) prompt_index: usize,
    pub(super) choice: usize,
}

/// Submits every job together, refusing new work while draining; the engine refuses it
/// when its waiting queue has no room for all of them.
pub(super) fn submit(
    ready: &Ready,
    state: &AppState,
    jobs: &[Job],
    params: &SamplingParams,
) -> Result<Vec<RequestStream>, ApiError> {
    if state.draining() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let requests = jobs
        .iter()
        .map(|j| {
            let mut p = params.clone();
            // n choices from one seed must differ yet stay reproducible.
            p.seed = p.seed.map(|s| s.wrapping_add(j.choice as u64));
            // A prompt is scored once, by its first choice; the others share its scores (and,
            // unscored, its cached blocks).
            if j.choice > 0 {
                p.prompt_logprobs = None;
            }
            (j.prompt.clone(), p)
        })
        .collect();
    let streams = ready.engine.submit_all(requests).map_err(ApiError::from)?;
    // Each prompt is one request of `n` choices, as vLLM counts them.
    for job in jobs.iter().filter(|j| j.choice == 0) {
        let n = jobs
            .iter()
            .filter(|j| j.prompt_index == job.prompt_index)
            .count();
        state.metrics.note_params(n, params.max_tokens);
    }
    Ok(streams)
}

/// Per-request latency bookkeeping for the metrics. A request dropped before it finished —
/// its client went away, so the engine cancels it — counts as finished with reason `abort`,
/// as vLLM counts it.
pub(super) struct Tracker {
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    finished: bool,
    state: Arc<AppState>,
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.finished {
            self.state.metrics.note_end("abort");
        }
    }
}

impl Tracker {
    pub(super) fn new(arrived: Instant, state: Arc<AppState>) -> Self {
        Tracker {
            arrived,
            first: None,
            last: None,
            finished: false,
            state,
        }
    }

    /// Records what an event means for the latency metrics.
    pub(super) fn observe(&mut self, event: &Event) {
        match event {
            Event::Token { .. } => self.token(),
            Event::Finished(f) => self.finish(f),
            Event::PromptLogprobs(_) => {}
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        let m = &self.state.metrics;
        match self.last {
            None => {
                m.ttft.observe((now - self.arrived).as_secs_f64());
                self.first = Some(now);
            }
            Some(t) => m.inter_token.observe((now - t).as_secs_f64()),
        }
        self.last = Some(now);
    }

    fn finish(&mut self, f: &Finish) {
        self.finished = true;
        let timeline = super::metrics::Timeline {
            arrived: self.arrived,
            first_token: self.first,
            last_token: self.last,
        };
        self.state.metrics.note_finished(f, &timeline);
    }
}

/// The prompt's tokens as log-probability entries: the first unscored (nothing precedes
/// it), then the engine's scores of the rest.
pub(super) fn prompt_entries(prompt: &[u32], scores: Vec<TokenOutput>) -> Vec<TokenOutput> {
    let first = prompt.first().map(|&id| TokenOutput {
        id,
        logprob: None,
        top: Vec::new(),
    });
    first.into_iter().chain(scores).collect()
}

/// Everything a response needs besides the streams.
pub(super) struct Plan {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) jobs: Vec<Job>,
    pub(super) prompts: Vec<usize>,
    /// Text to prepend to each prompt's choices (`echo`).
    pub(super) echo: Vec<String>,
    pub(super) logprobs: bool,
    /// The prompt is scored (`echo` with `logprobs`): its tokens lead the log-probabilities.
    pub(super) score_prompt: bool,
    pub(super) include_usage: bool,
    /// A chat request's tools: each choice's text is read for tool calls.
    pub(super) tools: Option<Arc<Tools>>,
}

impl Plan {
    /// The text `echo` puts before job `job`'s choice.
    pub(super) fn echo_of(&self, job: &Job) -> &str {
        self.echo.get(job.prompt_index).map_or("", String::as_str)
    }

    /// Prompt tokens over every prompt (each counted once, whatever `n`).
    pub(super) fn prompt_tokens(&self) -> usize {
        self.prompts.iter().sum()
    }
}

async fn respond(
    state: Arc<AppState>,
    ready: Arc<Ready>,
    plan: Plan,
    params: SamplingParams,
    stream: bool,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let streams = submit(&ready, &state, &plan.jobs, &params)?;
    if stream {
        return Ok(super::stream::sse(state, ready, plan, streams, arrived).into_response());
    }
    let choices = futures::future::join_all(streams.into_iter().map(|s| {
        let mut tracker = Tracker::new(arrived, Arc::clone(&state));
        s.collect(move |e| tracker.observe(e))
    }))
    .await;
    let (mut completion_tokens, mut cached) = (0, 0);
    // The scores of the current prompt, from its first choice, for its other choices (kept
    // only when it has others: a lone choice's scores are not copied).
    let mut scored = None;
    let mut done = Vec::with_capacity(choices.len());
    for (k, (job, choice)) in plan.jobs.iter().zip(choices).enumerate() {
        let mut c: Collected = choice?;
        if job.choice > 0 {
            c.prompt.clone_from(&scored);
        } else if plan.jobs.get(k + 1).is_some_and(|next| next.choice > 0) {
            scored.clone_from(&c.prompt);
        }
        completion_tokens += c.finish.completion_tokens;
        if job.choice == 0 {
            cached += c.finish.cached_tokens;
        }
        done.push(c);
    }
    let usage = Usage::new(plan.prompt_tokens(), completion_tokens, cached);
    let tk = &ready.tokenizer;
    Ok(match plan.kind {
        Kind::Completion => {
            let choices = plan
                .jobs
                .iter()
                .zip(done)
                .enumerate()
                .map(|(index, (job, c))| {
                    let echo = plan.echo_of(job);
                    let logprobs = plan.logprobs.then(|| match c.prompt {
                        // With `echo`, the prompt's tokens lead, scored, as in OpenAI's
                        // legacy API.
                        Some(scores) => {
                            let mut all = prompt_entries(&job.prompt, scores);
                            all.extend(c.tokens);
                            CompletionLogprobs::new(tk, &all, 0)
                        }
                        None => CompletionLogprobs::new(tk, &c.tokens, echo.len()),
                    });
                    CompletionChoice {
                        index,
                        text: format!("{echo}{}", c.text),
                        logprobs,
                        finish_reason: Some(c.finish.reason.as_str()),
                    }
                })
                .collect();
            Json(Completion {
                id: plan.id,
                object: "text_completion",
                created: plan.created,
                model: plan.model,
                choices,
                usage: Some(usage),
            })
            .into_response()
        }
        Kind::Chat => {
            let choices = done
                .into_iter()
                .enumerate()
                .map(|(index, c)| {
                    let (message, finish_reason) =
                        assistant(&state, plan.tools.as_deref(), c.text, c.finish.reason);
                    ChatChoice {
                        index,
                        logprobs: plan.logprobs.then(|| ChatLogprobs::new(tk, &c.tokens)),
                        message,
                        finish_reason,
                    }
                })
                .collect();
            Json(ChatCompletion {
                id: plan.id,
                object: "chat.completion",
                created: plan.created,
                model: plan.model,
                choices,
                usage,
            })
            .into_response()
        }
    })
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let (req, sampling): (CompletionRequest, Sampling) = parse(&body)?;
    state.check_model(&req.model)?;
    let n = sampling.n()?;
    let echo = req.echo.unwrap_or(false);
    let tk = &ready.tokenizer;
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        Prompt::Text(t) => vec![tk.encode(t, true)?],
        Prompt::Texts(ts) => ts
            .iter()
            .map(|t| tk.encode(t, true))
            .collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids.clone()],
        Prompt::TokenLists(l) => l.clone(),
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request(
            "`prompt` must not be empty",
            Some("prompt"),
        ));
    }
    let echo_text = if echo {
        prompts
            .iter()
            .map(|p| tk.decode(p, false))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let answer = Answer {
        max_tokens: Some(req.max_tokens.unwrap_or(SamplingParams::DEFAULT.max_tokens)),
        logprobs: req.logprobs,
        tools: None,
        requested: sampling.grammar()?,
    };
    let mut params = answer.params(&state, &ready, &sampling, 0)?;
    let score_prompt = echo && req.logprobs.is_some();
    if score_prompt {
        params.prompt_logprobs = req.logprobs;
    }
    let (stream, include_usage) = sampling.streaming()?;
    let plan = Plan {
        kind: Kind::Completion,
        id: request_id("cmpl"),
        created: now_unix(),
        model: req.model.clone(),
        jobs: jobs(&prompts, n),
        prompts: prompts.iter().map(Vec::len).collect(),
        echo: echo_text,
        logprobs: req.logprobs.is_some(),
        score_prompt,
        include_usage,
        tools: None,
    };
    respond(Arc::clone(&state), ready, plan, params, stream).await
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(state): State<Arc<AppState>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let (req, sampling): (ChatRequest, Sampling) = parse(&body)?;
    state.check_model(&req.model)?;
    let n = sampling.n()?;
    let format = ToolFormat::of_template(ready.tokenizer.chat_template_source());
    let tools = Tools::new(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        format,
    )?;
    let prompt = render_chat(&ready, req.messages()?, tools.as_ref())?;
    let top = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, k) => Some(k.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::bad_request(
                "`top_logprobs` requires `logprobs: true`",
                Some("top_logprobs"),
            ))
        }
        (false, None) => None,
    };
    let answer = Answer {
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        logprobs: top,
        tools: tools.as_ref(),
        requested: sampling.grammar()?,
    };
    let params = answer.params(&state, &ready, &sampling, prompt.len())?;
    let (stream, include_usage) = sampling.streaming()?;
    let plan = Plan {
        kind: Kind::Chat,
        id: request_id("chatcmpl"),
        created: now_unix(),
        model: req.model.clone(),
        jobs: jobs(std::slice::from_ref(&prompt), n),
        prompts: vec![prompt.len()],
        echo: Vec::new(),
        logprobs: top.is_some(),
        score_prompt: false,
        include_usage,
        tools: tools.map(Arc::new),
    };
    respond(Arc::clone(&state), ready, plan, params, stream).await
}

/// A conversation as the model reads it: through its chat template, with the tools it
/// may call described as its format asks, as prompt tokens.
pub(super) fn render_chat(
    ready: &Ready,
    mut messages: Vec<ChatMessage>,
    tools: Option<&Tools>,
) -> Result<Vec<u32>, ApiError> {
    let mut template_tools = None;
    if let Some(t) = tools {
        messages = t.conversation(messages);
        template_tools = t.for_template();
    }
    let template = ready.tokenizer.chat_template()?;
    let text = template.render_with_tools(&messages, template_tools.as_ref(), true)?;
    Ok(ready.tokenizer.encode(&text, false)?)
}

/// What a chat answer may be, besides its sampling fields: chat completions and the
/// Responses API both fill it.
pub(super) struct Answer<'a> {
    /// Most tokens to generate; absent, as many as the context leaves.
    pub(super) max_tokens: Option<usize>,
    /// Alternatives per token, when log-probabilities are asked for.
    pub(super) logprobs: Option<usize>,
    /// The tools it may call.
    pub(super) tools: Option<&'a Tools>,
    /// The grammar the request asks the answer to match, and the field that asked.
    pub(super) requested: Option<(Grammar, &'static str)>,
}

impl Answer<'_> {
    /// The engine's parameters for an answer to a prompt of `prompt_len` tokens, with the
    /// tools' grammar (which takes the requested one in) or else the requested one.
    pub(super) fn params(
        self,
        state: &AppState,
        ready: &Ready,
        sampling: &Sampling,
        prompt_len: usize,
    ) -> Result<SamplingParams, ApiError> {
        let max_tokens = match self.max_tokens {
            Some(m) => m,
            None => ready
                .engine
                .info()
                .max_model_len
                .saturating_sub(prompt_len)
                .max(1),
        };
        let mut params = sampling.params(max_tokens, self.logprobs)?;
        let tool_grammar = self
            .tools
            .and_then(|t| t.grammar(self.requested.as_ref().map(|(g, _)| g)));
        params.constraint = match (tool_grammar, self.requested) {
            (Some(g), _) => Some(ready.constraint(&g, "tools")?),
            (None, Some((g, param))) => Some(ready.constraint(&g, param)?),
            (None, None) => None,
        };
        if let Some(c) = &params.constraint {
            state.metrics.note_constrained(c.grammar().kind());
        }
        Ok(params)
    }
}

/// A chat choice's message and finish reason: with tools, the calls its text makes
/// (`finish_reason: "tool_calls"`) and the text left for the user.
pub(super) fn assistant(
    state: &AppState,
    tools: Option<&Tools>,
    text: String,
    reason: FinishReason,
) -> (AssistantMessage, &'static str) {
    let Some(tools) = tools else {
        let message = AssistantMessage {
            role: "assistant",
            content: Some(text),
            tool_calls: Vec::new(),
        };
        return (message, reason.as_str());
    };
    let parsed = tools.parse(&text);
    state.metrics.tool_calls.inc_by(parsed.calls.len() as u64);
    let finish = match parsed.calls.is_empty() {
        true => reason.as_str(),
        false => "tool_calls",
    };
    let message = AssistantMessage {
        role: "assistant",
        content: parsed.content,
        tool_calls: parsed
            .calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                kind: "function",
                function: FunctionCall {
                    name: c.name,
                    arguments: c.arguments,
                },
            })
            .collect(),
    };
    (message, finish)
}

/// The indexes of the jobs that share job `i`'s prompt, `i` among them.
pub(super) fn siblings(jobs: &[Job], i: usize) -> impl Iterator<Item = usize> + '_ {
    let prompt = jobs[i].prompt_index;
    (0..jobs.len()).filter(move |&k| jobs[k].prompt_index == prompt)
}

fn jobs(prompts: &[Vec<u32>], n: usize) -> Vec<Job> {
    prompts
        .iter()
        .enumerate()
        .flat_map(|(p, ids)| {
            (0..n).map(move |choice| Job {
                prompt: ids.clone(),
                prompt_index: p,
                choice,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A completion request body read as the endpoint reads it.
    fn read(body: &str) -> Result<(CompletionRequest, Sampling), ApiError> {
        parse(&Bytes::from(body.to_string()))
    }

    /// The sampling fields of a completion request body that parses.
    fn sampling(body: &str) -> Sampling {
        read(body).expect("parses").1
    }

    /// The status, `param` and message a completion request body is refused with.
    fn refusal(body: &str) -> (Option<String>, String) {
        let e = read(body).expect_err("refused");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        (e.param, e.message)
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_among_the_sampling_fields_too() {
        let (param, message) = refusal(r#"{"model": "m", "prompt": "hi", "max_tokens": -1}"#);
        assert_eq!(param.as_deref(), Some("max_tokens"), "{message}");
        let (param, message) = refusal(r#"{"model": "m", "prompt": "hi", "temperature": "hot"}"#);
        assert_eq!(param.as_deref(), Some("temperature"), "{message}");
        assert!(message.contains("expected f32"), "{message}");
        let (param, message) = refusal(r#"{"model": "m", "prompt": "hi", "stop": ["a", 3]}"#);
        assert_eq!(
            (param.as_deref(), message.as_str()),
            (
                Some("stop"),
                "invalid `stop`: expected a string or a list of strings"
            )
        );
        let (param, message) = refusal(r#"{"model": "m", "prompt": {"text": "hi"}}"#);
        assert_eq!(param.as_deref(), Some("prompt"), "{message}");
        assert!(message.contains("a list of token ids"), "{message}");
    }

    #[test]
    fn stream_options_need_stream_true() {
        let streaming = |body: &str| sampling(body).streaming();
        let e = streaming(
            r#"{"model": "m", "prompt": "hi", "stream_options": {"include_usage": true}}"#,
        )
        .expect_err("refused");
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        assert_eq!(
            streaming(r#"{"model": "m", "prompt": "hi", "stream": true, "stream_options": {"include_usage": true}}"#)
                .ok(),
            Some((true, true))
        );
        assert_eq!(
            streaming(r#"{"model": "m", "prompt": "hi"}"#).ok(),
            Some((false, false))
        );
    }

    #[test]
    fn logit_bias_keys_are_token_ids() {
        let bias = |bias: &str| {
            sampling(&format!(
                r#"{{"model": "m", "prompt": "hi", "logit_bias": {bias}}}"#
            ))
        };
        let p = bias(r#"{"7": 100, " 3": -2.5}"#)
            .params(4, None)
            .expect("valid");
        assert_eq!(p.logit_bias, vec![(3, -2.5), (7, 100.0)]);
        let e = bias(r#"{"the": 1}"#).params(4, None).expect_err("refused");
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (
                Some("logit_bias"),
                "`logit_bias` keys must be token ids, got \"the\""
            )
        );
    }
}
