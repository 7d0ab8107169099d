//! The OpenAI front: each request's `model` (and its prompt's prefix) picks a ready replica of
//! the LLMService serving that name; the request goes there and the answer comes back
//! unchanged, Server-Sent Events chunk by chunk, and a client that goes away cancels it
//! upstream. A request that fails before any byte reached the client is tried once more
//! elsewhere. A model with no ready replica holds the request, within bounds, until one is —
//! asking the operator for one when the model is at zero.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferrite_crds::LLMService;
use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::catalog::{Backend, Catalog, Endpoint, Route, Scaling};
use crate::loads::{InFlight, Loads};
use crate::metrics::Metrics;
use crate::pick::{pick, Reason};

/// Most bytes a request body may hold (the engine's own limit).
pub const MAX_BODY_BYTES: usize = 2 << 20;
/// Response ids remembered with the replica that stored them.
const RESPONSE_HOMES: usize = 16_384;
/// Least time between two activations of one LLMService.
const ACTIVATION_EVERY: Duration = Duration::from_secs(5);

/// How the router picks, holds and retries.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Characters of the prompt that place a request on the hash ring (0: least load only).
    pub prefix_chars: usize,
    /// A replica may carry this many times the mean load before a prefix spills past it.
    pub load_factor: f64,
    /// Most requests held for one model at once.
    pub max_held_per_model: usize,
    /// Most requests held for all models at once.
    pub max_held: usize,
    /// How long a held request waits for a ready replica.
    pub hold_timeout: Duration,
}

/// An error answered in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong and what to do.
    pub message: String,
    /// The request field at fault.
    pub param: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param,
        }
    }

    /// OpenAI's error object.
    fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
                "service_unavailable_error"
            }
            s if s.is_client_error() => "invalid_request_error",
            _ => "internal_server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param,
                         "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Everything the handlers share.
pub struct Proxy {
    catalog: Catalog,
    kube: kube::Client,
    http: reqwest::Client,
    loads: Loads,
    metrics: Metrics,
    settings: Settings,
    held_total: Arc<Semaphore>,
    held_per_model: Mutex<HashMap<String, Arc<Semaphore>>>,
    activated: Mutex<HashMap<(String, String), Instant>>,
    /// Stored responses' ids and the replica that holds each, newest last.
    homes: Mutex<(HashMap<String, SocketAddr>, VecDeque<String>)>,
    draining: AtomicBool,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every change under these locks is a single insert or remove.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Proxy {
    /// The front for `catalog`'s models; `kube` signals activations.
    pub fn new(
        catalog: Catalog,
        kube: kube::Client,
        loads: Loads,
        metrics: Metrics,
        settings: Settings,
    ) -> Arc<Self> {
        Arc::new(Proxy {
            catalog,
            kube,
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            loads,
            metrics,
            held_total: Arc::new(Semaphore::new(settings.max_held)),
            held_per_model: Mutex::new(HashMap::new()),
            activated: Mutex::new(HashMap::new()),
            homes: Mutex::new((HashMap::new(), VecDeque::new())),
            settings,
            draining: AtomicBool::new(false),
        })
    }

    /// Stops taking requests (SIGTERM): `/readyz` turns 503 so the Service stops sending.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    fn unknown_model(&self, model: &str) -> ApiError {
        let known = self.catalog.models();
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{model}` does not exist. This router serves `{}`.",
                known.join("`, `")
            ),
            Some("model"),
        )
    }

    /// Holds the request until `model` has a ready replica, asking the operator for one where
    /// the model is at zero; 503 when the hold queue is full, 504 when none is ready in time.
    async fn wait_for_replica(&self, model: &str, mut route: Route) -> Result<Route, ApiError> {
        if route.backends.iter().all(|b| b.scaling == Scaling::Off) {
            let names: Vec<String> = route
                .backends
                .iter()
                .map(|b| format!("{}/{}", b.namespace, b.name))
                .collect();
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the model `{model}` has no replica: LLMService {} is set to 0 replicas \
                     and does not autoscale; scale it up to serve",
                    names.join(", ")
                ),
                None,
            ));
        }
        let per_model = Arc::clone(
            lock(&self.held_per_model)
                .entry(model.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(self.settings.max_held_per_model))),
        );
        let full = || {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the hold queue is full: {} requests may wait for `{model}` \
                     (--max-held-per-model) and {} for all models (--max-held) while replicas \
                     start; retry later",
                    self.settings.max_held_per_model, self.settings.max_held
                ),
                None,
            )
        };
        let _model_permit: OwnedSemaphorePermit =
            per_model.try_acquire_owned().map_err(|_| full())?;
        let _total_permit = Arc::clone(&self.held_total)
            .try_acquire_owned()
            .map_err(|_| full())?;
        let held = self.metrics.held.with_label_values(&[model]);
        held.inc();
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.settings.hold_timeout;
        let mut changes = self.catalog.changes();
        let outcome = loop {
            for b in route
                .backends
                .iter()
                .filter(|b| b.scaling == Scaling::AtZero)
            {
                self.activate(b).await;
            }
            if !route.endpoints.is_empty() {
                break Ok(route);
            }
            let tick = tokio::time::Instant::now() + ACTIVATION_EVERY;
            match tokio::time::timeout_at(deadline.min(tick), changes.changed()).await {
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    break Err(ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!(
                            "the model `{model}` had no ready replica within {} s \
                             (--hold-timeout); it may still be starting: retry later",
                            self.settings.hold_timeout.as_secs()
                        ),
                        None,
                    ))
                }
                _ => {}
            }
            match self.catalog.route(model) {
                Some(r) => route = r,
                None => break Err(self.unknown_model(model)),
            }
        };
        held.dec();
        self.metrics
            .hold_seconds
            .observe(started.elapsed().as_secs_f64());
        outcome
    }

    /// Asks the operator for a replica of `backend` (at most every few seconds): the time
    /// of the request goes into its status, never its spec.
    async fn activate(&self, backend: &Backend) {
        let key = (backend.namespace.clone(), backend.name.clone());
        {
            let mut activated = lock(&self.activated);
            if activated
                .get(&key)
                .is_some_and(|at| at.elapsed() < ACTIVATION_EVERY)
            {
                return;
            }
            activated.insert(key, Instant::now());
        }
        let api: Api<LLMService> = Api::namespaced(self.kube.clone(), &backend.namespace);
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let patch = json!({"status": {"autoscaling": {"activationRequestedAt": now}}});
        match api
            .patch_status(
                &backend.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {
                self.metrics
                    .activations
                    .with_label_values(&[&backend.namespace, &backend.name])
                    .inc();
                tracing::info!(llmservice = %backend.name, namespace = %backend.namespace,
                    "asked for a replica of a model at zero");
            }
            Err(e) => {
                tracing::warn!(llmservice = %backend.name, error = %e, "cannot ask for a replica")
            }
        }
    }

    /// Remembers which replica stored response `id`.
    fn remember_home(&self, id: String, addr: SocketAddr) {
        let mut homes = lock(&self.homes);
        let (map, order) = &mut *homes;
        if map.insert(id.clone(), addr).is_none() {
            order.push_back(id);
        }
        while order.len() > RESPONSE_HOMES {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    fn home_of(&self, id: &str) -> Option<SocketAddr> {
        lock(&self.homes).0.get(id).copied()
    }
}

/// The text that places a request on the ring: the start of its first user message (chat,
/// Responses items), or of its prompt (completions, tokenize), as KubeAI's prefix hash reads
/// requests; at most `chars` characters.
pub fn prefix_of(body: &Value, chars: usize) -> Option<String> {
    fn text(content: &Value) -> Option<String> {
        match content {
            Value::String(s) => Some(s.clone()),
            Value::Array(parts) => Some(
                parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect(),
            ),
            _ => None,
        }
    }
    let first_user = |messages: &Value| {
        messages.as_array().and_then(|ms| {
            ms.iter()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                .and_then(|m| m.get("content"))
                .and_then(text)
        })
    };
    let whole = if let Some(messages) = body.get("messages") {
        first_user(messages)
    } else if let Some(input) = body.get("input") {
        match input {
            Value::String(s) => Some(s.clone()),
            items => first_user(items),
        }
    } else {
        match body.get("prompt")? {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => match list.first()? {
                Value::String(s) => Some(s.clone()),
                Value::Number(_) => Some(
                    list.iter()
                        .take(chars)
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                Value::Array(ids) => Some(
                    ids.iter()
                        .take(chars)
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                _ => None,
            },
            _ => None,
        }
    }?;
    Some(whole.chars().take(chars).collect())
}

/// Request headers passed upstream.
fn upstream_headers(headers: &HeaderMap) -> reqwest::header::HeaderMap {
    let mut out = reqwest::header::HeaderMap::new();
    for name in [
        header::CONTENT_TYPE,
        header::ACCEPT,
        header::AUTHORIZATION,
        header::USER_AGENT,
    ] {
        if let Some(v) = headers.get(&name) {
            out.insert(name, v.clone());
        }
    }
    for (name, v) in headers {
        if name.as_str().starts_with("x-") {
            out.insert(name.clone(), v.clone());
        }
    }
    out
}

/// Why an attempt did not reach an engine that would answer.
enum Failed {
    /// The connection failed: nothing reached the engine.
    Connect(String),
    /// The engine answered 503 (draining, loading, queue full): nothing was started.
    Unavailable(reqwest::Response),
}

/// Sends one attempt to `addr`.
async fn attempt(
    proxy: &Proxy,
    addr: SocketAddr,
    path: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<reqwest::Response, Failed> {
    let resp = proxy
        .http
        .post(format!("http://{addr}{path}"))
        .headers(upstream_headers(headers))
        .body(body.clone())
        .send()
        .await
        .map_err(|e| Failed::Connect(e.to_string()))?;
    if resp.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE {
        return Err(Failed::Unavailable(resp));
    }
    Ok(resp)
}

/// The answer streamed back as it comes; if the engine's stream breaks, an event stream ends
/// with an error event (and chat's `[DONE]`) instead of hanging or ending as if complete.
fn relay(
    proxy: &Arc<Proxy>,
    resp: reqwest::Response,
    path: &str,
    addr: SocketAddr,
    guard: InFlight,
) -> Response {
    let status = resp.status();
    let mut headers = HeaderMap::new();
    for name in [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::RETRY_AFTER,
    ] {
        if let Some(v) = resp.headers().get(&name) {
            headers.insert(name, v.clone());
        }
    }
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let learn = path == "/v1/responses" && status.is_success();
    let done_marker = path != "/v1/responses";
    let proxy = Arc::clone(proxy);
    let stream = resp.bytes_stream();
    let body = futures::stream::unfold(
        (stream, Some(guard), learn, false),
        move |(mut stream, guard, learn, ended)| {
            let proxy = Arc::clone(&proxy);
            async move {
                if ended {
                    return None;
                }
                match stream.next().await {
                    Some(Ok(chunk)) => {
                        if learn {
                            if let Some(id) = response_id(&chunk) {
                                proxy.remember_home(id, addr);
                            }
                        }
                        Some((
                            Ok::<Bytes, std::io::Error>(chunk),
                            (stream, guard, false, false),
                        ))
                    }
                    Some(Err(e)) if sse => {
                        tracing::warn!(%addr, error = %e, "an engine's stream broke");
                        let err = ApiError::new(
                            StatusCode::BAD_GATEWAY,
                            format!("the engine serving this request went away mid-stream: {e}"),
                            None,
                        );
                        let mut tail = format!("data: {}\n\n", err.body());
                        if done_marker {
                            tail.push_str("data: [DONE]\n\n");
                        }
                        Some((Ok(Bytes::from(tail)), (stream, None, false, true)))
                    }
                    Some(Err(e)) => {
                        Some((Err(std::io::Error::other(e)), (stream, None, false, true)))
                    }
                    None => {
                        drop(guard);
                        None
                    }
                }
            }
        },
    );
    let mut out = Response::new(Body::from_stream(body));
    *out.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    *out.headers_mut() = headers;
    out
}

/// The `resp_...` id at the start of a Responses answer (its JSON or its first event).
fn response_id(chunk: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(chunk.get(..chunk.len().min(4096))?).ok()?;
    let at = text.find("\"id\":\"resp_")? + "\"id\":\"".len();
    let end = text[at..].find('"')?;
    Some(text[at..at + end].to_string())
}

/// Forwards a POST whose body names a `model`.
async fn forward(proxy: Arc<Proxy>, path: &str, headers: HeaderMap, body: Bytes) -> Response {
    let json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the request body is not valid JSON: {e}"),
                None,
            )
            .into_response()
        }
    };
    let Some(model) = json
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "`model` is required: it names the model, and so the LLMService, to route to",
            Some("model"),
        )
        .into_response();
    };
    let resp = route_and_send(&proxy, &model, path, &headers, &json, &body).await;
    let code = resp.status().as_u16().to_string();
    proxy
        .metrics
        .requests
        .with_label_values(&[&model, &code])
        .inc();
    resp
}

async fn route_and_send(
    proxy: &Arc<Proxy>,
    model: &str,
    path: &str,
    headers: &HeaderMap,
    json: &Value,
    body: &Bytes,
) -> Response {
    if proxy.draining.load(Ordering::SeqCst) {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the router is shutting down",
            None,
        )
        .into_response();
    }
    let Some(mut route) = proxy.catalog.route(model) else {
        return proxy.unknown_model(model).into_response();
    };
    proxy.metrics.touch_model(model);
    let held = route.endpoints.is_empty();
    if held {
        route = match proxy.wait_for_replica(model, route).await {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        };
    }
    let deadline = Instant::now() + proxy.settings.hold_timeout;
    let prefix = prefix_of(json, proxy.settings.prefix_chars);
    let home = json
        .get("previous_response_id")
        .and_then(Value::as_str)
        .and_then(|id| proxy.home_of(id));
    let mut tried: Vec<SocketAddr> = Vec::new();
    let mut retried = false;
    loop {
        let candidates: Vec<Endpoint> = route
            .endpoints
            .iter()
            .filter(|e| !tried.contains(&e.addr) || held)
            .cloned()
            .collect();
        let sticky = home.and_then(|h| candidates.iter().position(|e| e.addr == h));
        let loads = proxy.loads.of(&candidates);
        let keys: Vec<String> = candidates.iter().map(|e| e.addr.to_string()).collect();
        let view: Vec<(&str, crate::pick::Load)> =
            keys.iter().map(String::as_str).zip(loads).collect();
        let picked = match sticky {
            Some(i) => Some((i, Reason::Sticky)),
            None => pick(&view, prefix.as_deref(), proxy.settings.load_factor),
        };
        let Some((i, reason)) = picked else {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no replica of `{model}` could take the request; retry later"),
                None,
            )
            .into_response();
        };
        let addr = candidates[i].addr;
        proxy
            .metrics
            .picks
            .with_label_values(&[model, reason.as_str()])
            .inc();
        let guard = proxy.loads.start(addr);
        let failure = match attempt(proxy, addr, path, headers, body).await {
            Ok(resp) => return relay(proxy, resp, path, addr, guard),
            Err(f) => f,
        };
        drop(guard);
        tried.push(addr);
        let (why, last) = match failure {
            Failed::Connect(e) => ("connect", Err(e)),
            Failed::Unavailable(resp) => ("unavailable", Ok(resp)),
        };
        // A held request's replica may still be opening its port: keep trying it until the
        // hold ends. Any other request is tried once more, on another replica.
        let again = if held {
            Instant::now() < deadline
        } else {
            !retried && route.endpoints.iter().any(|e| !tried.contains(&e.addr))
        };
        if !again {
            return match last {
                Ok(resp) if !held => relay(proxy, resp, path, addr, proxy.loads.start(addr)),
                _ if held => ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the model `{model}` had no replica that answered within {} s \
                         (--hold-timeout): its replicas are starting; retry later",
                        proxy.settings.hold_timeout.as_secs()
                    ),
                    None,
                )
                .into_response(),
                Ok(resp) => relay(proxy, resp, path, addr, proxy.loads.start(addr)),
                Err(e) => ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("no replica of `{model}` could be reached: {e}"),
                    None,
                )
                .into_response(),
            };
        }
        retried = true;
        proxy
            .metrics
            .retries
            .with_label_values(&[model, if held { "starting" } else { why }])
            .inc();
        if held {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Some(r) = proxy
                .catalog
                .route(model)
                .filter(|r| !r.endpoints.is_empty())
            {
                route = r;
            }
        }
    }
}

async fn models(State(proxy): State<Arc<Proxy>>) -> Json<Value> {
    let data: Vec<Value> = proxy
        .catalog
        .models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "ferrite"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `GET`/`DELETE /v1/responses/{id}`, sent to the replica that stored the response.
async fn stored_response(
    State(proxy): State<Arc<Proxy>>,
    method: Method,
    Path(id): Path<String>,
) -> Response {
    let Some(addr) = proxy.home_of(&id) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "response `{id}` is not known to this router: responses are stored by the \
                 replica that made them, and this router has not seen it made (or has \
                 restarted since)"
            ),
            None,
        )
        .into_response();
    };
    let url = format!("http://{addr}/v1/responses/{id}");
    let req = match method {
        Method::DELETE => proxy.http.delete(url),
        _ => proxy.http.get(url),
    };
    match req.send().await {
        Ok(resp) => relay(
            &proxy,
            resp,
            "/v1/responses/{id}",
            addr,
            proxy.loads.start(addr),
        ),
        Err(e) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("the replica holding response `{id}` cannot be reached: {e}"),
            None,
        )
        .into_response(),
    }
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(proxy): State<Arc<Proxy>>) -> Response {
    if proxy.draining.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    (StatusCode::OK, "ok").into_response()
}

async fn metrics(State(proxy): State<Arc<Proxy>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        proxy.metrics.render(),
    )
        .into_response()
}

/// Every route of the router.
pub fn router(proxy: Arc<Proxy>) -> Router {
    let forwarding = |path: &'static str| {
        post(
            move |State(proxy): State<Arc<Proxy>>, headers: HeaderMap, body: Bytes| async move {
                forward(proxy, path, headers, body).await
            },
        )
    };
    Router::new()
        .route("/v1/completions", forwarding("/v1/completions"))
        .route("/v1/chat/completions", forwarding("/v1/chat/completions"))
        .route("/v1/responses", forwarding("/v1/responses"))
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(stored_response),
        )
        .route("/tokenize", forwarding("/tokenize"))
        .route("/detokenize", forwarding("/detokenize"))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint", None) })
        .with_state(proxy)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_the_start_of_the_first_user_message_or_the_prompt() {
        let chat = json!({"messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
                                       {"role": "user", "content": "later"}]});
        assert_eq!(prefix_of(&chat, 5).as_deref(), Some("Hello"));
        assert_eq!(
            prefix_of(&json!({"prompt": "Once upon a time"}), 4).as_deref(),
            Some("Once")
        );
        assert_eq!(
            prefix_of(&json!({"prompt": [[1, 2, 3], [4]]}), 3).as_deref(),
            Some("1,2")
        );
        assert_eq!(
            prefix_of(&json!({"input": [{"role": "user", "content": "héllo"}]}), 2).as_deref(),
            Some("hé")
        );
        assert_eq!(
            prefix_of(&json!({"input": "abc"}), 10).as_deref(),
            Some("abc")
        );
        assert_eq!(prefix_of(&json!({"model": "m"}), 10), None);
    }

    #[test]
    fn a_responses_id_is_read_from_the_first_bytes_of_its_answer() {
        assert_eq!(
            response_id(br#"{"id":"resp_00ab","object":"response"}"#).as_deref(),
            Some("resp_00ab")
        );
        assert_eq!(
            response_id(b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\"").as_deref(),
            Some("resp_9")
        );
        assert_eq!(response_id(br#"{"id":"chatcmpl-1"}"#), None);
    }
}
