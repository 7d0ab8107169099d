//! `/v1/completions` and `/v1/chat/completions`: validate, tokenize, submit one engine
//! request per prompt and choice, then answer with one JSON body or a stream of
//! Server-Sent Events ending in `data: [DONE]`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};

use super::errors::{ApiError, Body};
use super::openai::{
    ChatRequest, CompletionRequest, Prompt, Sampling, CHAT_FIELDS, COMPLETION_FIELDS,
    SAMPLING_FIELDS,
};
use super::{AppState, Ready};
use crate::engine::{Event, Finish, RequestStream};
use crate::sampling::SamplingParams;
use crate::sequence::TokenOutput;

/// Which endpoint a response is shaped for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Parses a JSON body into the endpoint's own fields (`T`, from `known`) and the sampling
/// fields both endpoints share, refusing malformed JSON and unknown fields by name. The two
/// are read apart, each naming a field of the wrong type (a flattened struct would hide
/// the sampling fields' names).
fn parse<T: serde::de::DeserializeOwned>(
    body: &Bytes,
    known: &[&str],
) -> Result<(T, Sampling), ApiError> {
    let Value::Object(obj) = super::errors::json_body(body)? else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    };
    let accepted = |k: &str| known.contains(&k) || SAMPLING_FIELDS.contains(&k);
    if let Some(k) = obj.keys().find(|k| !accepted(k)) {
        let all: Vec<&str> = known.iter().chain(SAMPLING_FIELDS).copied().collect();
        return Err(ApiError::bad_request(
            format!(
                "unrecognized request argument `{k}`; accepted: {}",
                all.join(", ")
            ),
            Some(k),
        ));
    }
    let (sampling, own): (serde_json::Map<_, _>, serde_json::Map<_, _>) = obj
        .into_iter()
        .partition(|(k, _)| SAMPLING_FIELDS.contains(&k.as_str()));
    Ok((
        super::errors::from_json(own.into())?,
        super::errors::from_json(sampling.into())?,
    ))
}

/// One engine request: a prompt and the choice it answers.
struct Job {
    prompt: Vec<u32>,
    /// Which prompt (for usage, counted once per prompt) and which choice.
    prompt_index: usize,
    choice: usize,
}

/// Submits every job together, refusing new work while draining; the engine refuses it
/// when its waiting queue has no room for all of them.
fn submit(
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
    ready.engine.submit_all(requests).map_err(ApiError::from)
}

/// Per-request latency bookkeeping for the metrics.
struct Tracker {
    arrived: Instant,
    last: Option<Instant>,
    state: Arc<AppState>,
}

impl Tracker {
    fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => self
                .state
                .metrics
                .ttft
                .observe((now - self.arrived).as_secs_f64()),
            Some(t) => self
                .state
                .metrics
                .inter_token
                .observe((now - t).as_secs_f64()),
        }
        self.last = Some(now);
    }

    fn finish(&self, f: &Finish) {
        let m = &self.state.metrics;
        m.e2e.observe(self.arrived.elapsed().as_secs_f64());
        m.queue_time.observe(f.queue_seconds);
        m.prompt_tokens.inc_by(f.prompt_tokens as u64);
        m.generation_tokens.inc_by(f.completion_tokens as u64);
        m.success.with_label_values(&[f.reason.as_str()]).inc();
    }
}

/// A finished choice.
struct Choice {
    /// The scored prompt tokens after the first, if asked for.
    prompt: Option<Vec<TokenOutput>>,
    tokens: Vec<TokenOutput>,
    text: String,
    finish: Finish,
}

async fn collect(mut stream: RequestStream, mut tracker: Tracker) -> Result<Choice, ApiError> {
    let (mut tokens, mut text, mut prompt) = (Vec::new(), String::new(), None);
    while let Some(ev) = stream.next().await {
        match ev {
            Event::PromptLogprobs(scores) => prompt = Some(scores),
            Event::Token { token, text: t } => {
                tracker.token();
                tokens.push(token);
                text.push_str(&t);
            }
            Event::Finished(finish) => {
                tracker.finish(&finish);
                return Ok(Choice {
                    prompt,
                    tokens,
                    text,
                    finish,
                });
            }
        }
    }
    Err(crate::Error::EngineStopped.into())
}

fn usage(prompt_tokens: usize, completion_tokens: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// Log-probabilities in the shape of each endpoint.
fn logprobs_json(ready: &Ready, kind: Kind, tokens: &[TokenOutput], offset: usize) -> Value {
    let text = |id: u32| ready.tokenizer.token_text(id);
    match kind {
        Kind::Completion => {
            let mut at = offset;
            let mut offsets = Vec::new();
            for t in tokens {
                offsets.push(at);
                at += text(t.id).len();
            }
            json!({
                "tokens": tokens.iter().map(|t| text(t.id)).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": tokens.iter().map(|t| {
                    t.logprob.map(|_| t.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect::<serde_json::Map<_, _>>())
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
        Kind::Chat => {
            let entry = |id: u32, lp: Option<f32>| {
                let t = text(id);
                json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
            };
            json!({"content": tokens.iter().map(|t| {
                let mut e = entry(t.id, t.logprob);
                e["top_logprobs"] = Value::Array(t.top.iter().map(|&(id, lp)| entry(id, Some(lp))).collect());
                e
            }).collect::<Vec<_>>()})
        }
    }
}

/// The prompt's tokens as log-probability entries: the first unscored (nothing precedes
/// it), then the engine's scores of the rest.
fn prompt_entries(prompt: &[u32], scores: Vec<TokenOutput>) -> Vec<TokenOutput> {
    let first = prompt.first().map(|&id| TokenOutput {
        id,
        logprob: None,
        top: Vec::new(),
    });
    first.into_iter().chain(scores).collect()
}

/// Everything a response needs besides the streams.
struct Plan {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    jobs: Vec<Job>,
    prompts: Vec<usize>,
    /// Text to prepend to each prompt's choices (`echo`).
    echo: Vec<String>,
    logprobs: bool,
    /// The prompt is scored (`echo` with `logprobs`): its tokens lead the log-probabilities.
    score_prompt: bool,
    include_usage: bool,
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
        return Ok(sse(state, ready, plan, streams, arrived).into_response());
    }
    let tracker = |_: usize| Tracker {
        arrived,
        last: None,
        state: Arc::clone(&state),
    };
    let choices = futures::future::join_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, s)| collect(s, tracker(i))),
    )
    .await;
    let mut out = Vec::new();
    let (mut completion_tokens, mut cached) = (0, 0);
    // The scores of the current prompt, from its first choice, for its other choices (kept
    // only when it has others: a lone choice's scores are not copied).
    let mut scored = None;
    for (k, (job, choice)) in plan.jobs.iter().zip(choices).enumerate() {
        let mut c = choice?;
        if job.choice > 0 {
            c.prompt.clone_from(&scored);
        } else if plan.jobs.get(k + 1).is_some_and(|next| next.choice > 0) {
            scored.clone_from(&c.prompt);
        }
        completion_tokens += c.finish.completion_tokens;
        if job.choice == 0 {
            cached += c.finish.cached_tokens;
        }
        let echo = plan
            .echo
            .get(job.prompt_index)
            .map(String::as_str)
            .unwrap_or("");
        let logprobs = plan.logprobs.then(|| match c.prompt {
            // With `echo`, the prompt's tokens lead, scored, as in OpenAI's legacy API.
            Some(scores) => {
                let mut all = prompt_entries(&job.prompt, scores);
                all.extend(c.tokens);
                logprobs_json(&ready, plan.kind, &all, 0)
            }
            None => logprobs_json(&ready, plan.kind, &c.tokens, echo.len()),
        });
        let index = out.len();
        out.push(match plan.kind {
            Kind::Completion => json!({
                "index": index,
                "text": format!("{echo}{}", c.text),
                "logprobs": logprobs,
                "finish_reason": c.finish.reason.as_str(),
            }),
            Kind::Chat => json!({
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish.reason.as_str(),
            }),
        });
    }
    let object = if plan.kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let prompt_tokens: usize = plan.prompts.iter().sum();
    Ok(Json(json!({
        "id": plan.id,
        "object": object,
        "created": plan.created,
        "model": plan.model,
        "choices": out,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }))
    .into_response())
}

/// Streams every choice's tokens as chunks, then the usage chunk if asked, then `[DONE]`.
fn sse(
    state: Arc<AppState>,
    ready: Arc<Ready>,
    plan: Plan,
    streams: Vec<RequestStream>,
    arrived: Instant,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let n = streams.len();
    // Every choice's events, then `None` once all streams have ended.
    let merged = stream::select_all(streams.into_iter().enumerate().map(|(i, s)| {
        Box::pin(
            stream::unfold(s, |mut s| async move { s.next().await.map(|ev| (ev, s)) })
                .map(move |ev| Some((i, ev))),
        )
    }))
    .chain(stream::once(async { None }));
    let plan = Arc::new(plan);
    let trackers: Vec<Tracker> = (0..n)
        .map(|_| Tracker {
            arrived,
            last: None,
            state: Arc::clone(&state),
        })
        .collect();
    let chunk_object = if plan.kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let envelope = {
        let plan = Arc::clone(&plan);
        move |choices: Value| json!({"id": plan.id, "object": chunk_object, "created": plan.created, "model": plan.model, "choices": choices})
    };
    // First chunks: the assistant role for chat, the echoed prompt for completions.
    let mut opening = Vec::new();
    for (i, job) in plan.jobs.iter().enumerate() {
        let first = match plan.kind {
            Kind::Chat => Some(
                json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            ),
            // A scored prompt is echoed when its scores arrive.
            Kind::Completion if plan.score_prompt => None,
            Kind::Completion => plan
                .echo
                .get(job.prompt_index)
                .filter(|e| !e.is_empty())
                .map(|e| json!({"index": i, "text": e, "logprobs": null, "finish_reason": null})),
        };
        if let Some(c) = first {
            opening.push(envelope(json!([c])));
        }
    }
    struct Acc {
        trackers: Vec<Tracker>,
        open: usize,
        completion_tokens: usize,
        cached: usize,
        offsets: Vec<usize>,
        /// Events of a scored prompt's later choices, held until the prompt's scores (from
        /// its first choice) have been echoed for them.
        held: Vec<Option<Vec<Event>>>,
    }
    let acc = Acc {
        trackers,
        open: n,
        completion_tokens: 0,
        cached: 0,
        offsets: vec![0; n],
        held: plan
            .jobs
            .iter()
            .map(|j| (plan.score_prompt && j.choice > 0).then(Vec::new))
            .collect(),
    };
    // Choice `i`'s chunks for one of its events.
    let render = {
        let plan = Arc::clone(&plan);
        let envelope = envelope.clone();
        move |acc: &mut Acc, i: usize, ev: Event| -> Vec<Value> {
            match ev {
                Event::PromptLogprobs(scores) => {
                    // The echo, scored, for every choice of this prompt.
                    let job = &plan.jobs[i];
                    let entries = prompt_entries(&job.prompt, scores);
                    let logprobs = logprobs_json(&ready, plan.kind, &entries, 0);
                    let offset = entries
                        .iter()
                        .map(|t| ready.tokenizer.token_text(t.id).len())
                        .sum();
                    let echo = plan.echo.get(job.prompt_index).map_or("", String::as_str);
                    let chunk = |k| json!([{"index": k, "text": echo, "logprobs": logprobs, "finish_reason": null}]);
                    siblings(&plan.jobs, i)
                        .map(|k| {
                            acc.offsets[k] = offset;
                            envelope(chunk(k))
                        })
                        .collect()
                }
                Event::Token { token, text } => {
                    acc.trackers[i].token();
                    let logprobs = plan.logprobs.then(|| {
                        logprobs_json(
                            &ready,
                            plan.kind,
                            std::slice::from_ref(&token),
                            acc.offsets[i],
                        )
                    });
                    acc.offsets[i] += ready.tokenizer.token_text(token.id).len();
                    if text.is_empty() && logprobs.is_none() {
                        Vec::new()
                    } else {
                        vec![envelope(json!([match plan.kind {
                            Kind::Chat =>
                                json!({"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null}),
                            Kind::Completion =>
                                json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": null}),
                        }]))]
                    }
                }
                Event::Finished(f) => {
                    acc.trackers[i].finish(&f);
                    acc.open -= 1;
                    acc.completion_tokens += f.completion_tokens;
                    if plan.jobs[i].choice == 0 {
                        acc.cached += f.cached_tokens;
                    }
                    let reason = f.reason.as_str();
                    let mut chunks = vec![envelope(json!([match plan.kind {
                        Kind::Chat =>
                            json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": reason}),
                        Kind::Completion =>
                            json!({"index": i, "text": "", "logprobs": null, "finish_reason": reason}),
                    }]))];
                    if acc.open == 0 && plan.include_usage {
                        let mut u = envelope(json!([]));
                        u["usage"] =
                            usage(plan.prompts.iter().sum(), acc.completion_tokens, acc.cached);
                        chunks.push(u);
                    }
                    chunks
                }
            }
        }
    };
    // Renders the events held for choice `k`, which need no more holding.
    let release = {
        let render = render.clone();
        move |acc: &mut Acc, k: usize, out: &mut Vec<Value>| {
            for ev in acc.held[k].take().unwrap_or_default() {
                out.extend(render(acc, k, ev));
            }
        }
    };
    let body = merged
        .scan(acc, {
            let plan = Arc::clone(&plan);
            move |acc, item| {
                let mut out = Vec::new();
                let Some((i, ev)) = item else {
                    for k in 0..acc.held.len() {
                        release(acc, k, &mut out);
                    }
                    // Streams that ended without finishing lost their engine: say so rather
                    // than end as if complete.
                    out.extend(
                        (acc.open > 0).then(|| ApiError::from(crate::Error::EngineStopped).body()),
                    );
                    return futures::future::ready(Some(out));
                };
                if let Some(held) = acc.held[i].as_mut() {
                    held.push(ev);
                    return futures::future::ready(Some(out));
                }
                // A first choice's scores (or its end, if none came) free its siblings.
                let frees = plan.jobs[i].choice == 0
                    && matches!(ev, Event::PromptLogprobs(_) | Event::Finished(_));
                out.extend(render(acc, i, ev));
                if frees {
                    for k in siblings(&plan.jobs, i) {
                        release(acc, k, &mut out);
                    }
                }
                futures::future::ready(Some(out))
            }
        })
        .flat_map(stream::iter);
    let events = stream::iter(opening)
        .chain(body)
        .map(|v| Ok(SseEvent::default().data(v.to_string())))
        .chain(stream::once(async {
            Ok(SseEvent::default().data("[DONE]"))
        }));
    Sse::new(events)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let (req, sampling): (CompletionRequest, Sampling) = parse(&body, COMPLETION_FIELDS)?;
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
    let mut params = sampling.params(req.max_tokens.unwrap_or(16), req.logprobs)?;
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
    };
    respond(Arc::clone(&state), ready, plan, params, stream).await
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(state): State<Arc<AppState>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let (req, sampling): (ChatRequest, Sampling) = parse(&body, CHAT_FIELDS)?;
    state.check_model(&req.model)?;
    let n = sampling.n()?;
    let messages = req.messages()?;
    let template = ready.tokenizer.chat_template()?;
    let prompt = ready
        .tokenizer
        .encode(&template.render(&messages, true)?, false)?;
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
    let max_tokens = match req.max_completion_tokens.or(req.max_tokens) {
        Some(m) => m,
        None => ready
            .engine
            .info()
            .max_model_len
            .saturating_sub(prompt.len())
            .max(1),
    };
    let params = sampling.params(max_tokens, top)?;
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
    };
    respond(Arc::clone(&state), ready, plan, params, stream).await
}

/// The indexes of the jobs that share job `i`'s prompt, `i` among them.
fn siblings(jobs: &[Job], i: usize) -> impl Iterator<Item = usize> + '_ {
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
        parse(&Bytes::from(body.to_string()), COMPLETION_FIELDS)
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
