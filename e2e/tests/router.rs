//! The router against a real control plane and real engines: one endpoint serving two
//! LLMServices by `model` (and an alias), the openai SDK through it, streaming passed through,
//! prefix affinity measured against random picks on a multi-turn chat workload, and a replica
//! that refuses connections or dies mid-stream.

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use support::{chat, metric, model_ids, python, routable, WAIT};

fn llmservice(name: &str, served: &str, aliases: &[&str], replicas: i32) -> Value {
    json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {"model": {"source": "file:///models/smollm2.gguf", "servedName": served,
                           "aliases": aliases},
                 "replicas": replicas},
    })
}

/// The prefix-cache hit rate over `engines` between two readings of their counters.
async fn cache_counters(http: &reqwest::Client, engines: &[String]) -> (f64, f64) {
    let mut hits = 0.0;
    let mut queries = 0.0;
    for e in engines {
        hits += metric(http, e, "vllm:prefix_cache_hits_total", "").await;
        queries += metric(http, e, "vllm:prefix_cache_queries_total", "").await;
    }
    (hits, queries)
}

/// Conversations of `turns` turns each, run side by side; each turn sends the whole history
/// to `target(conversation, turn)` and appends the answer.
async fn conversations(
    http: &reqwest::Client,
    topic: &str,
    count: usize,
    turns: usize,
    target: impl Fn(usize, usize) -> String + Clone + Send + 'static,
) {
    let runs = (0..count).map(|c| {
        let http = http.clone();
        let target = target.clone();
        let opening = format!(
            "Conversation {c} about {topic}. I am writing a long report on {topic} and need \
             careful help with its structure, its sources and its argument, one part at a time. \
             First, what should the introduction of part {c} say?"
        );
        async move {
            let mut messages = vec![json!({"role": "user", "content": opening})];
            for t in 0..turns {
                let (status, reply) = chat(
                    &http,
                    &target(c, t),
                    json!({"model": "smol-c", "messages": messages, "max_tokens": 12,
                           "temperature": 0}),
                )
                .await;
                assert_eq!(status, 200, "{reply}");
                let answer = reply["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                messages.push(json!({"role": "assistant", "content": answer}));
                messages.push(json!({"role": "user", "content": format!("Go on with step {t}.")}));
            }
        }
    });
    futures::future::join_all(runs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_endpoint_routes_by_model_keeps_prefixes_together_and_retries_before_the_first_byte() {
    let mut h = support::start(
        "10.231.3.0/24",
        &["--scrape-interval", "1", "--hold-timeout", "20"],
    )
    .await;
    let http = reqwest::Client::new();
    h.create(llmservice("alpha", "smol-a", &["smol-a-latest"], 1))
        .await;
    h.create(llmservice("beta", "smol-b", &[], 1)).await;
    h.create(llmservice("gamma", "smol-c", &[], 2)).await;
    let alpha = h.healthy_engines("alpha", 1).await;
    let beta = h.healthy_engines("beta", 1).await;
    let gamma = h.healthy_engines("gamma", 2).await;
    for model in ["smol-a", "smol-b", "smol-c"] {
        routable(&h, &http, model).await;
    }

    // Each model (and the alias) reaches its own LLMService's engine, as its counters say.
    for (model, engine) in [
        ("smol-a", &alpha[0]),
        ("smol-a-latest", &alpha[0]),
        ("smol-b", &beta[0]),
    ] {
        let before = metric(&http, engine, "vllm:request_success_total", "").await;
        let (status, reply) = chat(
            &http,
            &h.router,
            json!({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 4}),
        )
        .await;
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["model"], model);
        let after = metric(&http, engine, "vllm:request_success_total", "").await;
        assert_eq!(after, before + 1.0, "{model} reached {engine}");
    }

    // /v1/models lists every served name; an unknown model is a 404 naming them.
    let ids = model_ids(&http, &h.router).await;
    assert_eq!(ids, ["smol-a", "smol-a-latest", "smol-b", "smol-c"]);
    let (status, reply) = chat(
        &http,
        &h.router,
        json!({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 404);
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("`gpt-5`") && message.contains("`smol-b`"),
        "{message}"
    );
    assert_eq!(reply["error"]["param"], "model");

    // A client that goes away mid-stream cancels its request in the engine.
    let aborted_before = metric(&http, &beta[0], "vllm:request_success_total", "abort").await;
    let resp = http
        .post(format!("{}/v1/chat/completions", h.router))
        .json(
            &json!({"model": "smol-b", "messages": [{"role": "user", "content": "Tell a story."}],
                      "max_tokens": 900, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .expect("a stream");
    let mut body = resp.bytes_stream();
    let _ = body.next().await.expect("a first chunk");
    drop(body);
    ferrite_testcluster::eventually(
        "the engine to cancel the abandoned request",
        WAIT,
        || async {
            let aborted = metric(&http, &beta[0], "vllm:request_success_total", "abort").await;
            let running = metric(&http, &beta[0], "vllm:num_requests_running", "").await;
            Ok((aborted == aborted_before + 1.0 && running == 0.0).then_some(()))
        },
    )
    .await
    .expect("cancelled");

    // The openai SDK through the router, plain and streamed.
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
r = c.chat.completions.create(model="smol-a", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
assert r.model == "smol-a" and r.choices[0].message.content, r
chunks = list(c.chat.completions.create(model="smol-b", messages=[{"role": "user", "content": "Say hi."}],
                                        max_tokens=8, stream=True))
assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1]
assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
done = c.completions.create(model="smol-c", prompt="Once upon a time", max_tokens=4)
assert done.choices[0].text
print(sorted(m.id for m in c.models.list()))
"#;
    let out = Command::new(python())
        .args(["-c", script, &h.router])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("smol-c"));

    // Prefix affinity: the same conversations' later turns hit the cache that their earlier
    // turns filled more often through the router than with random picks.
    let (h0, q0) = cache_counters(&http, &gamma).await;
    let engines = gamma.clone();
    conversations(&http, "rivers", 6, 3, move |c, t| {
        // A fixed pseudo-random sequence: conversation c, turn t.
        engines[(c * 7 + t * 13 + (c * t) % 5) % 2].clone()
    })
    .await;
    let (h1, q1) = cache_counters(&http, &gamma).await;
    // Through the router, sampling every replica's queue: none may carry more than its
    // bounded share of the six conversations in flight (1.25 x (6 + 1) / 2, so 4).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampling = tokio::spawn({
        let (http, gamma, stop) = (http.clone(), gamma.clone(), stop.clone());
        async move {
            let mut most = 0.0f64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for e in &gamma {
                    let queued = metric(&http, e, "vllm:num_requests_running", "").await
                        + metric(&http, e, "vllm:num_requests_waiting", "").await;
                    most = most.max(queued);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        }
    });
    let router = h.router.clone();
    conversations(&http, "mountains", 6, 3, move |_, _| router.clone()).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = sampling.await.expect("sampling");
    assert!(most <= 4.0, "a replica carried {most} requests at once");
    let (h2, q2) = cache_counters(&http, &gamma).await;
    let random = (h1 - h0) / (q1 - q0);
    let affine = (h2 - h1) / (q2 - q1);
    eprintln!("prefix-cache hit rate: random picks {random:.3}, router {affine:.3}");
    assert!(
        affine > random,
        "affinity {affine:.3} is no better than random picks {random:.3}"
    );
    let picks = metric(
        &http,
        &h.router,
        "ferrite_router_picks_total",
        "model=\"smol-c\"",
    )
    .await;
    assert!(picks >= 18.0, "{picks}");

    // One replica refusing connections: requests that had not started are tried on the other.
    h.kill_engine(&gamma[0]);
    let retries_before = metric(&http, &h.router, "ferrite_router_retries_total", "").await;
    let mut by_status: HashMap<u16, usize> = HashMap::new();
    for i in 0..8 {
        let (status, _) = chat(
            &http,
            &h.router,
            json!({"model": "smol-c", "messages": [{"role": "user", "content": format!("Question {i}: why?")}],
                   "max_tokens": 2}),
        )
        .await;
        *by_status.entry(status).or_default() += 1;
    }
    assert_eq!(by_status, HashMap::from([(200, 8)]));
    let retries = metric(&http, &h.router, "ferrite_router_retries_total", "").await;
    assert!(retries > retries_before, "no request met the dead replica");

    // A replica that dies mid-stream ends the stream with an error event, not a hang.
    let resp = http
        .post(format!("{}/v1/chat/completions", h.router))
        .json(&json!({"model": "smol-c", "messages": [{"role": "user", "content": "Tell a long story."}],
                      "max_tokens": 600, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("a stream");
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.expect("a first chunk").expect("bytes");
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    h.kill_engine(&gamma[1]);
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        let mut text = String::new();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
                Err(_) => break,
            }
        }
        text
    })
    .await
    .expect("the stream ended instead of hanging");
    assert!(
        rest.contains("went away mid-stream") && rest.trim_end().ends_with("data: [DONE]"),
        "{}",
        &rest[rest.len().saturating_sub(400)..]
    );

    // Shutting down, the router finishes the streams it carries and takes no new requests.
    let resp = http
        .post(format!("{}/v1/chat/completions", h.router))
        .json(
            &json!({"model": "smol-a", "messages": [{"role": "user", "content": "Count to fifty."}],
                      "max_tokens": 48, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .expect("a stream");
    let mut body = resp.bytes_stream();
    let _ = body.next().await.expect("a first chunk");
    h.stop_router();
    let mut text = String::new();
    while let Some(Ok(c)) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    let after = http
        .get(format!("{}/v1/models", h.router))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(after.is_err(), "a stopped router still answered: {after:?}");
}
