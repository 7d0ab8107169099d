//! The load generator against a small scripted server: closed loop keeps exactly the asked
//! number of requests in flight, open loop does not wait for answers, tokens and failures
//! are counted, and nothing sent goes missing from the summary.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use ferrite_bench::client::tokenize;
use ferrite_bench::run::{run_level, Load, Target};
use ferrite_bench::workload::{requests, Shape};
use indicatif::ProgressBar;
use serde_json::{json, Value};

#[derive(Default)]
struct Counters {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    served: AtomicUsize,
}

/// Streams `max_tokens` one-token chunks 5 ms apart; prompts starting with token 0 fail.
async fn completions(State(c): State<Arc<Counters>>, Json(req): Json<Value>) -> Response {
    if req["prompt"][0] == 0 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
    }
    let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    c.peak.fetch_max(now, Ordering::SeqCst);
    let n = req["max_tokens"].as_u64().unwrap_or(1) as usize;
    let counters = c.clone();
    let stream = async_stream(n, counters);
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn async_stream(
    n: usize,
    c: Arc<Counters>,
) -> impl futures::Stream<Item = Result<String, std::convert::Infallible>> {
    futures::stream::unfold(0usize, move |i| {
        let c = c.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let event = match i {
                i if i < n => json!({"choices": [{"index": 0, "text": "x"}]}).to_string(),
                i if i == n => {
                    json!({"choices": [], "usage": {"completion_tokens": n}}).to_string()
                }
                i if i == n + 1 => {
                    c.in_flight.fetch_sub(1, Ordering::SeqCst);
                    c.served.fetch_add(1, Ordering::SeqCst);
                    "[DONE]".to_string()
                }
                _ => return None,
            };
            Some((Ok(format!("data: {event}\n\n")), i + 1))
        }
    })
}

async fn tokenize_route(Json(req): Json<Value>) -> Json<Value> {
    let words = req["prompt"]
        .as_str()
        .unwrap_or("")
        .split_whitespace()
        .count();
    Json(json!({"tokens": (1..=words as u64).collect::<Vec<_>>()}))
}

/// The scripted server, as a target for the load generator.
async fn server() -> (Target, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize_route))
        .with_state(counters.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let target = Target {
        base,
        model: "m".into(),
        extra_body: serde_json::Value::Null,
    };
    (target, counters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_keeps_exactly_the_concurrency_in_flight() {
    let (target, counters) = server().await;
    let http = reqwest::Client::new();
    let corpus = tokenize(&http, &target.base, "m", "one two three four five six")
        .await
        .expect("tokenize");
    assert_eq!(corpus, [1, 2, 3, 4, 5, 6]);
    let shape = Shape::Fixed {
        prompt: 4,
        output: 10,
    };
    let specs = requests(shape, &corpus, 12, 0);
    let (s, err) = run_level(
        &http,
        &target,
        Load::Concurrency(3),
        specs,
        0,
        &ProgressBar::hidden(),
    )
    .await;
    assert_eq!(err, None);
    assert_eq!(s.completed, 12);
    assert_eq!(s.errors, 0);
    assert_eq!(s.output_tokens, 120);
    assert_eq!(s.prompt_tokens, 48);
    assert_eq!(counters.peak.load(Ordering::SeqCst), 3);
    assert_eq!(counters.served.load(Ordering::SeqCst), 12);
    // The server sleeps 5 ms before every event, so no gap the client measures can be
    // shorter (a floor the server guarantees, not a speed), and the parts nest in order.
    assert!(s.ttft_s[0] >= 0.005, "{:?}", s.ttft_s);
    assert!(s.itl_s[0] >= 0.005, "{:?}", s.itl_s);
    assert!(s.ttft_s[1] <= s.e2e_s[1] && s.e2e_s[0] >= 0.05, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_overlaps_requests_and_counts_failures() {
    let (target, counters) = server().await;
    let http = reqwest::Client::new();
    // Token 0 starts the prompts of failing requests.
    let corpus: Vec<u32> = vec![0, 1, 2, 3];
    let specs = requests(
        Shape::Fixed {
            prompt: 1,
            output: 40,
        },
        &corpus,
        16,
        5,
    );
    let failing = specs.iter().filter(|s| s.prompt[0] == 0).count();
    assert!(failing > 0 && failing < 16);
    // 200 requests/s against 200 ms requests: arrivals do not wait for answers.
    let (s, err) = run_level(
        &http,
        &target,
        Load::Rate(200.0),
        specs,
        1,
        &ProgressBar::hidden(),
    )
    .await;
    assert_eq!(s.errors, failing);
    assert_eq!(s.completed + s.errors, 16, "every request is accounted for");
    assert!(err.is_some_and(|e| e.contains("500")));
    assert!(
        counters.peak.load(Ordering::SeqCst) > 1,
        "open loop overlapped requests"
    );
}
