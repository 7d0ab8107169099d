//! InferencePools against a real control plane with the Gateway API Inference Extension's own
//! CRD (v1.6.0, from the Go module proxy): without the API an LLMService that asks for a pool
//! is told so by an Event; with it, the pool selects the engine pods on port 8000 with the
//! named endpoint picker, is owned by the LLMService, and goes when it is turned off.

use std::path::PathBuf;
use std::time::Duration;

use ferrite_crds::LLMService;
use ferrite_operator::{render, Options};
use ferrite_testcluster::{eventually, inference_pool_crd, install_crds, TestCluster};
use k8s_openapi::api::core::v1::{Event, Service};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llmservice_gets_an_inference_pool_where_the_api_is_installed() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    install_crds(&client, &root().join("crds/llmservice.yaml"))
        .await
        .expect("CRD");
    let ns = cluster
        .namespace(&client, "pools")
        .await
        .expect("namespace");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let opts = Options {
        namespace: Some(ns.clone()),
        engine_image: "ferrite-engine:test".into(),
        leader_election: false,
        ..Options::default()
    };
    let c = client.clone();
    let operator = tokio::spawn(async move {
        ferrite_operator::run(c, opts, async move {
            let _ = rx.await;
        })
        .await
    });
    let llms = Api::<LLMService>::namespaced(client.clone(), &ns);
    let svc: LLMService = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "pooled"},
        "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
                 "inferencePool": {"enabled": true, "endpointPicker": {"name": "pooled-epp"}}},
    }))
    .expect("LLMService");
    llms.create(&PostParams::default(), &svc)
        .await
        .expect("create");

    // No InferencePool API yet: the LLMService serves, and an Event says why it has no pool.
    let events = Api::<Event>::namespaced(client.clone(), &ns);
    let note = eventually("the InferencePoolUnavailable Event", WAIT, || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(list
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("InferencePoolUnavailable"))
            .and_then(|e| e.message))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(note.contains("inference.networking.k8s.io/v1"), "{note}");

    // With the extension's CRD, the next reconcile (here: a change to the object) makes it.
    install_crds(
        &client,
        &inference_pool_crd().expect("the InferencePool CRD"),
    )
    .await
    .expect("the InferencePool CRD");
    let touch = json!({"metadata": {"annotations": {"example.com/touched": "1"}}});
    llms.patch("pooled", &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .expect("touch");
    let pools = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &ns,
        &render::inference_pool_resource(),
    );
    let pool = eventually("the InferencePool", WAIT, || async {
        pools.get_opt("pooled").await.map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let service = Api::<Service>::namespaced(client.clone(), &ns)
        .get("pooled")
        .await
        .expect("the Service");
    let selector = serde_json::to_value(service.spec.and_then(|s| s.selector)).expect("json");
    assert_eq!(pool.data["spec"]["selector"]["matchLabels"], selector);
    assert_eq!(pool.data["spec"]["targetPorts"], json!([{"number": 8000}]));
    assert_eq!(pool.data["spec"]["endpointPickerRef"]["name"], "pooled-epp");
    assert_eq!(
        pool.data["spec"]["endpointPickerRef"]["port"]["number"],
        9002
    );
    let owner = pool.metadata.owner_references.unwrap_or_default();
    assert_eq!(owner.first().map(|o| o.kind.as_str()), Some("LLMService"));

    // Turned off, it goes.
    let off = json!({"spec": {"inferencePool": {"enabled": false}}});
    llms.patch("pooled", &PatchParams::default(), &Patch::Merge(&off))
        .await
        .expect("turn off");
    eventually("the InferencePool to go", WAIT, || async {
        let p = pools.get_opt("pooled").await.map_err(|e| e.to_string())?;
        Ok(p.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), operator).await;
}
