//! The Argo CD health check (examples/gitops/argocd/llmservice-health.lua) run by a real Lua
//! interpreter on LLMServices whose status the operator itself computed, in each state a
//! user meets: Healthy when Ready, Progressing while loading or rolling, Degraded when an
//! engine or its model download failed.

use std::path::PathBuf;

use ferrite_crds::LLMService;
use ferrite_operator::status::{compute, Observed, WorkloadStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use mlua::{Lua, LuaSerdeExt, Value};
use serde_json::json;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/gitops/argocd")
}

/// Runs the health script on `obj` the way Argo CD does (a global `obj`, a returned table).
fn health(obj: &serde_json::Value) -> (String, String) {
    let script = std::fs::read_to_string(examples().join("llmservice-health.lua")).expect("lua");
    let lua = Lua::new();
    let value = lua.to_value(obj).expect("to lua");
    lua.globals().set("obj", value).expect("obj");
    let hs: mlua::Table = lua.load(&script).eval().expect("health script runs");
    let status: String = hs.get("status").expect("status");
    let message: String = match hs.get::<Value>("message").expect("message") {
        Value::String(s) => s.to_str().expect("utf-8").to_string(),
        _ => String::new(),
    };
    (status, message)
}

fn service(generation: i64) -> LLMService {
    serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "ml", "generation": generation},
        "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}},
    }))
    .expect("LLMService")
}

fn deployment(replicas: i32, ready: i32, updated: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": "chat", "namespace": "ml", "generation": 1},
        "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                   "updatedReplicas": updated},
    }))
    .expect("Deployment")
}

fn pod(name: &str, exit: Option<(i32, &str)>) -> Pod {
    let state = match exit {
        Some((code, msg)) => json!({"terminated": {"exitCode": code, "message": msg}}),
        None => json!({"running": {}}),
    };
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ml"},
        "status": {"containerStatuses": [{"name": "engine", "ready": false, "restartCount": 1,
            "image": "ferrite-engine", "imageID": "", "state": state}]},
    }))
    .expect("Pod")
}

/// The LLMService as the API server would return it after the operator wrote `status`.
fn observed(svc: LLMService, desired: i32, obs: Observed) -> serde_json::Value {
    let status = compute(&svc, desired, &obs, Timestamp::UNIX_EPOCH);
    let mut v = serde_json::to_value(&svc).expect("json");
    v["status"] = serde_json::to_value(status).expect("status");
    v
}

#[test]
fn argocd_cm_carries_the_same_script() {
    let cm: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(examples().join("argocd-cm.yaml")).expect("argocd-cm"),
    )
    .expect("yaml");
    let embedded = cm["data"]["resource.customizations.health.serving.ferrite.dev_LLMService"]
        .as_str()
        .expect("health key");
    let script = std::fs::read_to_string(examples().join("llmservice-health.lua")).expect("lua");
    assert_eq!(embedded, script);
}

#[test]
fn ready_is_healthy() {
    let obs = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(2, 2, 2))),
        pods: vec![],
    };
    let (status, message) = health(&observed(service(1), 2, obs));
    assert_eq!(status, "Healthy");
    assert_eq!(message, "2 of 2 replicas serve the model");
}

#[test]
fn scaled_to_zero_is_healthy() {
    let obs = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(0, 0, 0))),
        pods: vec![],
    };
    assert_eq!(health(&observed(service(1), 0, obs)).0, "Healthy");
}

#[test]
fn loading_and_rolling_are_progressing() {
    let loading = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(1, 0, 1))),
        pods: vec![pod("chat-a", None)],
    };
    let (status, message) = health(&observed(service(1), 1, loading));
    assert_eq!(status, "Progressing");
    assert!(message.contains("loading the model"), "{message}");

    let scaling_up = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(3, 1, 3))),
        pods: vec![pod("chat-a", None)],
    };
    assert_eq!(
        health(&observed(service(1), 3, scaling_up)).0,
        "Progressing"
    );
}

#[test]
fn failed_engine_or_download_is_degraded_with_the_reason() {
    let crashed = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(1, 0, 1))),
        pods: vec![pod("chat-a", Some((1, "error: model file is not GGUF")))],
    };
    let (status, message) = health(&observed(service(1), 1, crashed));
    assert_eq!(status, "Degraded");
    assert!(message.contains("model file is not GGUF"), "{message}");

    let mut download: Pod = pod("chat-b", None);
    let st = download.status.as_mut().expect("status");
    st.init_container_statuses = st.container_statuses.take();
    if let Some(cs) = st.init_container_statuses.as_mut() {
        cs[0].name = "model-download".into();
        cs[0].state = serde_json::from_value(
            json!({"terminated": {"exitCode": 1, "message": "401 Unauthorized: gated repo"}}),
        )
        .ok();
    }
    let failed = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(1, 0, 1))),
        pods: vec![download],
    };
    let (status, message) = health(&observed(service(1), 1, failed));
    assert_eq!(status, "Degraded", "{message}");
    assert!(message.contains("401 Unauthorized"), "{message}");
}

#[test]
fn no_status_or_an_older_generation_is_progressing() {
    let fresh = serde_json::to_value(service(1)).expect("json");
    let (status, message) = health(&fresh);
    assert_eq!(status, "Progressing");
    assert!(message.contains("Waiting"), "{message}");

    // Status of generation 1 while the spec is at generation 2: a rollout not yet seen.
    let obs = Observed {
        workload: Some(WorkloadStatus::of_deployment(&deployment(1, 1, 1))),
        pods: vec![],
    };
    let mut stale = observed(service(1), 1, obs);
    stale["metadata"]["generation"] = json!(2);
    let (status, message) = health(&stale);
    assert_eq!(status, "Progressing");
    assert!(message.contains("generation 2"), "{message}");
}
