//! Scale to zero and back over a real control plane with real engines: a request for a model
//! at zero replicas is held by the router, which asks through the LLMService's status; the
//! operator scales to one, and the request completes once the replica is ready. The hold
//! queue is bounded (503 with Retry-After), a model that never becomes ready times out (504),
//! and after `scaleToZeroAfterSeconds` of quiet the model returns to zero — the spec never
//! written.

mod support;

use std::time::Duration;

use ferrite_crds::LLMService;
use ferrite_testcluster::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use serde_json::{json, Value};
use support::{metric, WAIT};

fn at_zero(name: &str, served: &str, extra: Value) -> Value {
    let mut manifest = json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {"model": {"source": "file:///models/smollm2.gguf", "servedName": served},
                 "replicas": 0,
                 "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "targetQueueDepth": 4,
                                 "scaleToZeroAfterSeconds": 6,
                                 "scaleDownStabilizationSeconds": 0}},
    });
    if let (Some(spec), Some(extra)) = (manifest["spec"].as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    manifest
}

async fn ask(http: &reqwest::Client, router: &str, model: &str) -> reqwest::Response {
    http.post(format!("{router}/v1/chat/completions"))
        .json(
            &json!({"model": model, "messages": [{"role": "user", "content": "Say hi."}],
                      "max_tokens": 4}),
        )
        .send()
        .await
        .expect("an answer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_brings_a_model_back_from_zero_within_bounds_and_quiet_returns_it() {
    let h = support::start(
        "10.231.4.0/24",
        &["--max-held-per-model", "2", "--hold-timeout", "40"],
    )
    .await;
    let http = reqwest::Client::new();
    let llms: Api<LLMService> = Api::namespaced(h.client.clone(), &h.ns);
    h.create(at_zero("zeta", "smol-z", json!({}))).await;
    // Its pods can never be scheduled: it asks for a replica that never becomes ready.
    h.create(at_zero(
        "never",
        "smol-never",
        json!({"pod": {"nodeSelector": {"ferrite.dev/no-such-node": "true"}}}),
    ))
    .await;
    let idle = eventually("zeta to report Idle", WAIT, || async {
        let s = llms.get("zeta").await.map_err(|e| e.to_string())?;
        let phase = s.status.as_ref().and_then(|st| st.phase.clone());
        Ok((phase.as_deref() == Some("Idle")).then_some(s))
    })
    .await
    .expect("Idle");
    let conditions = &idle.status.as_ref().expect("status").conditions;
    let ready = conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert_eq!(ready.reason, "NoReplicas", "what Argo CD reads as Healthy");
    eventually("the router to know smol-z", WAIT, || async {
        let models = http
            .get(format!("{}/v1/models", h.router))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        Ok(models.contains("smol-z").then_some(()))
    })
    .await
    .expect("known");

    // Two requests are held (the bound per model); a third is refused at once.
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (http, router) = (http.clone(), h.router.clone());
            tokio::spawn(async move { ask(&http, &router, "smol-z").await })
        })
        .collect();
    eventually("two held requests", WAIT, || async {
        let n = metric(
            &http,
            &h.router,
            "ferrite_router_held_requests",
            "model=\"smol-z\"",
        )
        .await;
        Ok((n == 2.0).then_some(()))
    })
    .await
    .expect("held");
    let third = ask(&http, &h.router, "smol-z").await;
    assert_eq!(third.status(), 503);
    assert_eq!(
        third
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body: Value = third.json().await.expect("json");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("hold queue is full"), "{message}");

    // The operator scales to one; the held requests complete on the new replica.
    for r in held {
        let resp = tokio::time::timeout(WAIT, r)
            .await
            .expect("the held request ended")
            .expect("join");
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["model"], "smol-z");
    }
    let zeta = llms.get("zeta").await.expect("zeta");
    let auto = zeta
        .status
        .as_ref()
        .and_then(|s| s.autoscaling.clone())
        .expect("autoscaling status");
    assert!(auto.activation_requested_at.is_some());
    assert!(
        auto.last_scale_reason
            .as_deref()
            .is_some_and(|r| r.contains("a request is waiting")),
        "{auto:?}"
    );

    // A model that never becomes ready: 504 once the hold times out, saying so.
    let never = ask(&http, &h.router, "smol-never").await;
    assert_eq!(never.status(), 504);
    let body: Value = never.json().await.expect("json");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("no ready replica within 40 s"),
        "{message}"
    );

    // Quiet for scaleToZeroAfterSeconds: back to zero, the engine stopped.
    let deployments: Api<Deployment> = Api::namespaced(h.client.clone(), &h.ns);
    eventually("zeta to scale back to zero", WAIT, || async {
        let d = deployments.get("zeta").await.map_err(|e| e.to_string())?;
        let s = llms.get("zeta").await.map_err(|e| e.to_string())?;
        let replicas = d.spec.and_then(|s| s.replicas);
        let phase = s.status.and_then(|st| st.phase);
        Ok((replicas == Some(0) && phase.as_deref() == Some("Idle")).then_some(()))
    })
    .await
    .expect("zero");
    // Neither the router nor the operator ever wrote the spec.
    for name in ["zeta", "never"] {
        let s = llms.get(name).await.expect("LLMService");
        assert_eq!(s.metadata.generation, Some(1), "{name}'s spec was written");
        assert_eq!(s.spec.replicas, Some(0));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
}
