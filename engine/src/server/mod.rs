//! The OpenAI-compatible HTTP server: routes, readiness, metrics and graceful shutdown.
//!
//! The listener is bound before the model loads, so `/health` can answer 503 while a
//! large model is still loading (what a Kubernetes startup probe needs), and 200 once it
//! serves. SIGTERM turns health to 503, refuses new requests and lets in-flight ones
//! finish up to the shutdown timeout.

mod call_reader;
mod completions;
mod errors;
mod metrics;
pub mod openai;
mod response_store;
mod responses;
mod stream;
pub mod tools;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

pub use errors::ApiError;
pub use metrics::Metrics;

use openai::response::{ModelCard, ModelList};

use crate::engine::EngineHandle;
use crate::grammar::{Constraint, Grammar, GrammarCompiler};
use crate::tokenizer::Tokenizer;

/// Server settings that do not depend on the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// The `model` values clients may send, each listed by `/v1/models`; never empty (the
    /// first names the metrics).
    pub served_model_names: Vec<String>,
    /// How long in-flight requests may run after SIGTERM.
    pub shutdown_timeout: Duration,
    /// Most responses kept for `previous_response_id` (0: none).
    pub max_stored_responses: usize,
    /// `/health` fails once the engine has made no progress for this long while requests
    /// are pending; `None` never.
    pub stall_timeout: Option<Duration>,
}

/// What exists once the model has loaded.
pub struct Ready {
    /// The batching engine.
    pub engine: EngineHandle,
    /// The model's tokenizer (shared with the engine's copy).
    pub tokenizer: Tokenizer,
    /// Compiles requests' grammars against the vocabulary; built by the first request
    /// that needs one.
    grammars: OnceLock<Result<GrammarCompiler, String>>,
}

impl Ready {
    /// Compiles `grammar` into a fresh constraint; what is wrong with it is a 400 naming
    /// `param`.
    pub fn constraint(&self, grammar: &Grammar, param: &str) -> Result<Constraint, ApiError> {
        let compiler = self.grammars.get_or_init(|| {
            GrammarCompiler::new(&self.tokenizer, self.engine.info().vocab_size)
                .map_err(|e| e.to_string())
        });
        let compiler = compiler.as_ref().map_err(|e| {
            ApiError::internal(format!(
                "structured output is unavailable for this model: {e}"
            ))
        })?;
        compiler.compile(grammar).map_err(|e| {
            ApiError::bad_request(
                format!(
                    "invalid `{param}`: its {} cannot be enforced: {e}",
                    grammar.kind()
                ),
                Some(param),
            )
        })
    }
}

/// State shared by every handler.
pub struct AppState {
    /// Settings.
    pub config: ServerConfig,
    /// Metrics exported at `/metrics`.
    pub metrics: Metrics,
    /// Responses kept for `previous_response_id`.
    responses: response_store::ResponseStore,
    ready: OnceLock<Arc<Ready>>,
    draining: AtomicBool,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// State for a server that is still loading its model.
    pub fn new(config: ServerConfig) -> Result<Arc<Self>, prometheus::Error> {
        let first = config.served_model_names.first().map_or("", String::as_str);
        let metrics = Metrics::new(first)?;
        Ok(Arc::new(AppState {
            responses: response_store::ResponseStore::new(config.max_stored_responses),
            config,
            metrics,
            ready: OnceLock::new(),
            draining: AtomicBool::new(false),
        }))
    }

    /// Marks the model loaded and serving.
    pub fn set_ready(&self, engine: EngineHandle, tokenizer: Tokenizer) {
        if let Err(e) = self.metrics.set_engine_info(engine.info()) {
            tracing::warn!("cannot register the token-count histograms: {e}");
        }
        let _ = self.ready.set(Arc::new(Ready {
            engine,
            tokenizer,
            grammars: OnceLock::new(),
        }));
    }

    /// Ends the engine once it has finished what it holds (after a drain), waiting up to
    /// `timeout`; true when it ended or was never loaded. A pipeline group's leader thereby
    /// tells its other stages the group is over.
    pub fn stop_engine(&self, timeout: std::time::Duration) -> bool {
        match self.ready.get() {
            Some(r) => r.engine.stop(timeout),
            None => true,
        }
    }

    /// Stops taking requests (SIGTERM).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn ready(&self) -> Result<Arc<Ready>, ApiError> {
        self.ready
            .get()
            .cloned()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
    }

    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if self.config.served_model_names.iter().any(|n| n == model) {
            Ok(())
        } else {
            Err(ApiError::unknown_model(
                model,
                &self.config.served_model_names,
            ))
        }
    }
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/version", get(version))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such endpoint".into(),
                param: None,
            }
        })
        .with_state(state)
        .layer(axum::extract::DefaultBodyLimit::max(errors::MAX_BODY_BYTES))
        .layer(panics_answered())
}

/// Answers a request whose handler panicked (a bug) with OpenAI's 500 error instead of
/// dropping its connection.
fn panics_answered(
) -> tower_http::catch_panic::CatchPanicLayer<fn(Box<dyn std::any::Any + Send + 'static>) -> Response>
{
    fn answer(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "internal error: the request's handler failed; this is a bug".into(),
            param: None,
        }
        .into_response()
    }
    tower_http::catch_panic::CatchPanicLayer::custom(answer)
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    let ready = state.ready()?;
    let max_model_len = ready.engine.info().max_model_len;
    let data = state
        .config
        .served_model_names
        .iter()
        .map(|name| ModelCard {
            id: name.clone(),
            object: "model",
            created: 0,
            owned_by: "ferrite",
            max_model_len,
        })
        .collect();
    Ok(Json(ModelList {
        object: "list",
        data,
    }))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    match state.ready.get() {
        // A dead engine fails the liveness probe, so Kubernetes restarts the pod.
        Some(r) if !r.engine.is_running() => (
            StatusCode::INTERNAL_SERVER_ERROR,
            crate::Error::EngineStopped.to_string(),
        )
            .into_response(),
        // A loop that stopped making progress with work pending serves nothing either, though
        // its thread lives: fail the liveness probe too.
        Some(r) => match state
            .config
            .stall_timeout
            .and_then(|after| r.engine.stalled(after))
        {
            Some(stall) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the engine has made no progress for {} s with {} requests pending \
                     (--stall-timeout {} s); the server must be restarted",
                    stall.for_.as_secs(),
                    stall.pending,
                    state.config.stall_timeout.map_or(0, |t| t.as_secs())
                ),
            )
                .into_response(),
            None => (StatusCode::OK, "ok").into_response(),
        },
        None => (StatusCode::SERVICE_UNAVAILABLE, "loading").into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let ready = state.ready.get().cloned();
    let body = state.metrics.render(ready.as_ref().map(|r| &r.engine));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn version() -> Json<serde_json::Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "engine": "ferrite"}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<crate::tokenizer::ChatMessage>>,
    add_special_tokens: Option<bool>,
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    errors::Body(body): errors::Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ready = state.ready()?;
    let req: TokenizeRequest = errors::from_json(errors::json_body(&body)?)?;
    if let Some(m) = &req.model {
        state.check_model(m)?;
    }
    let tk = &ready.tokenizer;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => tk.encode(p, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(m)) => tk.encode(
            &tk.chat_template()?.render(m, true)?,
            req.add_special_tokens.unwrap_or(false),
        )?,
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` or `messages`",
                Some("prompt"),
            ))
        }
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": ready.engine.info().max_model_len,
        "tokens": tokens,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    errors::Body(body): errors::Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ready = state.ready()?;
    let req: DetokenizeRequest = errors::from_json(errors::json_body(&body)?)?;
    if let Some(m) = &req.model {
        state.check_model(m)?;
    }
    let vocab = ready.engine.info().vocab_size;
    if let Some(&bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(
            format!("`tokens` holds id {bad}, beyond the vocabulary of {vocab} tokens"),
            Some("tokens"),
        ));
    }
    Ok(Json(
        json!({"prompt": ready.tokenizer.decode(&req.tokens, false)?}),
    ))
}

/// Serves `state` on `listener` until `shutdown` resolves; then refuses new requests and
/// waits for in-flight ones up to the configured timeout.
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let timeout = state.config.shutdown_timeout;
    let drain_state = Arc::clone(&state);
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: draining in-flight requests for up to {timeout:?}");
        drain_state.start_draining();
        let _ = stopped_tx.send(());
    };
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(signal);
    let serving = tokio::spawn(async move { server.await });
    let _ = stopped_rx.await;
    match tokio::time::timeout(timeout, serving).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(std::io::Error::other(e)),
        Err(_) => {
            tracing::warn!("shutdown timeout reached with requests still running");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn loading() -> Arc<AppState> {
        AppState::new(ServerConfig {
            served_model_names: vec!["m".into()],
            shutdown_timeout: Duration::from_secs(1),
            max_stored_responses: 4,
            stall_timeout: Some(Duration::from_secs(120)),
        })
        .expect("metrics register")
    }

    async fn call(state: Arc<AppState>, req: Request<Body>) -> (StatusCode, String) {
        let resp = router(state).oneshot(req).await.expect("router answers");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    fn post(uri: &str, body: &str) -> Request<Body> {
        Request::post(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request")
    }

    #[tokio::test]
    async fn health_is_503_while_loading_and_while_draining() {
        let state = loading();
        let get = || {
            Request::get("/health")
                .body(Body::empty())
                .expect("request")
        };
        assert_eq!(
            call(Arc::clone(&state), get()).await,
            (StatusCode::SERVICE_UNAVAILABLE, "loading".into())
        );
        state.start_draining();
        assert_eq!(call(state, get()).await.0, StatusCode::SERVICE_UNAVAILABLE);
    }

    /// A word-level tokenizer of a few words, for a server state without a model.
    fn tiny_tokenizer() -> Tokenizer {
        let dir = tempfile::tempdir().expect("tempdir");
        let vocab: serde_json::Map<String, serde_json::Value> = ["<unk>", "hi", "there"]
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let spec = json!({
            "version": "1.0",
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
            "pre_tokenizer": {"type": "Whitespace"},
        });
        std::fs::write(dir.path().join("tokenizer.json"), spec.to_string()).expect("write");
        Tokenizer::from_hf_dir(dir.path()).expect("tokenizer")
    }

    #[tokio::test]
    async fn an_engine_that_stops_making_progress_with_work_pending_fails_health() {
        // An engine thread that takes one request and never steps.
        let (engine, thread) = EngineHandle::with_thread(|rx| {
            let held = rx.recv();
            while rx.recv().is_ok() {}
            drop(held);
        });
        let state = AppState::new(ServerConfig {
            served_model_names: vec!["m".into()],
            shutdown_timeout: Duration::from_secs(1),
            max_stored_responses: 0,
            stall_timeout: Some(Duration::from_millis(200)),
        })
        .expect("metrics register");
        state.set_ready(engine.clone(), tiny_tokenizer());
        let health = || {
            Request::get("/health")
                .body(Body::empty())
                .expect("request")
        };
        // Idle, however long, is not stalled.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(call(Arc::clone(&state), health()).await.0, StatusCode::OK);
        let params = crate::sampling::SamplingParams {
            max_tokens: 4,
            ..crate::sampling::SamplingParams::DEFAULT
        };
        let _stream = engine.submit(vec![1], params).expect("accepted");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = call(Arc::clone(&state), health()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
        assert!(
            body.contains("no progress") && body.contains("1 requests pending"),
            "{body}"
        );
        drop((_stream, state, engine));
        let _ = thread.join();
    }

    #[tokio::test]
    async fn a_dead_engine_fails_health_and_requests_with_500() {
        let (engine, thread) = EngineHandle::with_thread(|_rx| panic!("a bug in a step"));
        assert!(thread.join().is_err());
        let state = loading();
        state.set_ready(engine, tiny_tokenizer());
        let (status, body) = call(
            Arc::clone(&state),
            Request::get("/health")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(
            (status, body.as_str()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine has stopped; the server must be restarted"
            )
        );
        let (status, body) = call(
            state,
            post(
                "/v1/completions",
                r#"{"model":"m","prompt":"hi there","max_tokens":2}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
        assert!(body.contains("the engine has stopped"), "{body}");
    }

    #[tokio::test]
    async fn a_stream_cut_off_by_the_engine_ends_with_an_error_event() {
        // An engine that takes the request, sends one token and dies.
        let (engine, _thread) = EngineHandle::with_thread(|rx| {
            if let Ok(req) = rx.recv() {
                let token = crate::sequence::TokenOutput {
                    id: 1,
                    logprob: None,
                    top: Vec::new(),
                };
                let _ = req.events.send(crate::engine::Event::Token {
                    token,
                    text: " hi".into(),
                });
            }
            panic!("a bug in a step");
        });
        let state = loading();
        state.set_ready(engine, tiny_tokenizer());
        let (status, body) = call(
            state,
            post(
                "/v1/completions",
                r#"{"model":"m","prompt":"hi","max_tokens":4,"stream":true}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let events: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert!(events[0].contains(r#""text":" hi""#), "{body}");
        assert!(
            events[events.len() - 2].contains("the engine has stopped"),
            "{body}"
        );
        assert_eq!(events[events.len() - 1], "[DONE]", "{body}");
    }

    #[tokio::test]
    async fn a_handler_that_panics_is_answered_with_a_500_error() {
        let app = Router::new()
            .route(
                "/boom",
                get(|| async {
                    if true {
                        panic!("a bug in a handler");
                    }
                    "unreachable"
                }),
            )
            .layer(panics_answered());
        let resp = app
            .oneshot(Request::get("/boom").body(Body::empty()).expect("request"))
            .await
            .expect("answered");
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"]["code"], 500);
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("this is a bug")));
    }

    #[tokio::test]
    async fn requests_while_loading_get_an_openai_error_with_retry_after() {
        let resp = router(loading())
            .oneshot(post("/v1/completions", r#"{"model":"m","prompt":"hi"}"#))
            .await
            .expect("router answers");
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            resp.headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"]["message"], "the model is still loading");
        assert_eq!(v["error"]["type"], "service_unavailable_error");
    }

    #[tokio::test]
    async fn unknown_paths_and_metrics_before_load() {
        let (status, body) = call(
            loading(),
            Request::get("/v2/nothing")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(body.contains("no such endpoint"));
        let (status, body) = call(
            loading(),
            Request::get("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.contains("vllm:num_requests_waiting{model_name=\"m\"} 0"),
            "{body}"
        );
        assert!(body.contains("vllm:time_to_first_token_seconds_bucket"));
    }

    #[test]
    fn every_served_model_name_is_accepted_and_an_unknown_one_is_told_them_all() {
        let state = AppState::new(ServerConfig {
            served_model_names: vec!["smol".into(), "smollm2-135m".into()],
            shutdown_timeout: Duration::from_secs(1),
            max_stored_responses: 4,
            stall_timeout: Some(Duration::from_secs(120)),
        })
        .expect("metrics register");
        assert!(state.check_model("smol").is_ok());
        assert!(state.check_model("smollm2-135m").is_ok());
        let e = state.check_model("gpt-4").expect_err("unknown");
        assert_eq!(
            (e.status, e.param.as_deref(), e.message.as_str()),
            (
                StatusCode::NOT_FOUND,
                Some("model"),
                "The model `gpt-4` does not exist. This server serves `smol`, `smollm2-135m`."
            )
        );
    }

    #[test]
    fn a_field_of_the_wrong_type_or_range_is_named() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Req {
            max_tokens: Option<usize>,
            stop: Option<Vec<String>>,
        }
        let err = |body: &str| {
            let e = errors::json_body(body.as_bytes())
                .and_then(errors::from_json::<Req>)
                .expect_err("refused");
            (e.status, e.param, e.message)
        };
        let (status, param, message) = err(r#"{"max_tokens": -1}"#);
        assert_eq!(
            (status, param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("max_tokens"))
        );
        assert!(message.starts_with("invalid `max_tokens`: "), "{message}");
        assert!(message.contains("-1"), "{message}");
        let (_, param, message) = err(r#"{"stop": ["a", 3]}"#);
        assert_eq!(param.as_deref(), Some("stop[1]"), "{message}");
        let (_, param, message) = err("{not json");
        assert_eq!(param, None);
        assert!(
            message.starts_with("the request body is not valid JSON"),
            "{message}"
        );
    }

    #[test]
    fn validation_errors_name_their_parameter() {
        let e = ApiError::from(crate::Error::from(crate::error::RequestError::OutOfRange {
            param: "top_p",
            range: "(0, 1]",
            got: "1.5".into(),
        }));
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("top_p"))
        );
    }

    #[test]
    fn server_faults_are_never_the_clients_400() {
        for e in [
            crate::Error::internal("a batch that does not add up"),
            crate::Error::Io(std::io::Error::other("disk")),
            crate::Error::EngineStopped,
        ] {
            assert_eq!(ApiError::from(e).status, StatusCode::INTERNAL_SERVER_ERROR);
        }
    }
}
