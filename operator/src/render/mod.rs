//! Pure functions from an `LLMService` to the objects that serve it: a Deployment of engine
//! pods (or, for a model split into pipeline stages, a LeaderWorkerSet of pod groups and
//! their group Secret), a Service and (with more than one replica) a PodDisruptionBudget.
//! No cluster access: the reconciler applies what these return with server-side apply.

mod deployment;
mod inferencepool;
mod leaderworkerset;
mod pdb;
mod pod;
mod service;

use std::collections::BTreeMap;

use ferrite_crds::LLMService;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;

pub use deployment::{deployment, rollout_bounds};
pub use inferencepool::{
    inference_pool, inference_pool_resource, wants_inference_pool, ENDPOINT_PICKER_PORT,
    INFERENCE_GROUP,
};
pub use leaderworkerset::{
    group_secret, leaderworkerset, lws_name, lws_resource, uses_groups, LWS_GROUP,
    LWS_WORKER_INDEX_LABEL,
};
pub use pdb::pdb;
pub use pod::{
    group_secret_name, model_path, pipeline_stages, pod_template, startup_timeout_seconds,
    tensor_ranks, Role, GROUP_PORT, GROUP_SECRET_KEY, ROLE_LABEL,
};
pub use service::service;

use crate::Error;

/// The label every child object carries, with the LLMService's name; also the selector of
/// the pods that serve the API (a Deployment's pods, a group's leader).
pub const LLMSERVICE_LABEL: &str = "serving.ferrite.dev/llmservice";
/// The label a group's workers carry instead of [`LLMSERVICE_LABEL`], with the LLMService's
/// name: they serve no API, so the Service, the autoscaler and `status.selector` leave them
/// out.
pub const WORKER_OF_LABEL: &str = "serving.ferrite.dev/worker-of";
/// The selector of every engine pod of every LLMService (workers included); a pod's
/// `app.kubernetes.io/instance` names its LLMService.
pub const ENGINE_PODS_SELECTOR: &str =
    "app.kubernetes.io/managed-by=ferrite-operator,app.kubernetes.io/name=ferrite-engine";

/// The selector of every engine pod of the LLMService `name`, workers included.
pub fn engine_pods_selector(name: &str) -> String {
    format!("{ENGINE_PODS_SELECTOR},app.kubernetes.io/instance={name}")
}
/// The HTTP port of the engine (OpenAI API, `/health`, `/metrics`).
pub const ENGINE_PORT: i32 = 8000;
/// Name of the engine container.
pub const ENGINE_CONTAINER: &str = "engine";
/// Name of the init container that downloads `hf://` models.
pub const DOWNLOAD_CONTAINER: &str = "model-download";

/// Operator-wide settings the render functions need.
#[derive(Debug, Clone)]
pub struct RenderConfig {
    /// Engine image used when the spec names none.
    pub engine_image: String,
    /// Seconds the engine drains in-flight requests after SIGTERM (`--shutdown-timeout`).
    pub drain_timeout_seconds: i64,
    /// Give every LLMService an InferencePool unless its spec says otherwise.
    pub inference_pools: bool,
}

impl Default for RenderConfig {
    fn default() -> Self {
        Self {
            engine_image: format!(
                "ghcr.io/ferrite-serving/ferrite-engine:{}",
                env!("CARGO_PKG_VERSION")
            ),
            drain_timeout_seconds: 30,
            inference_pools: false,
        }
    }
}

/// The LLMService's name, or an error for an object without one.
pub fn name_of(svc: &LLMService) -> Result<String, Error> {
    svc.metadata
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))
}

/// The pod selector: `serving.ferrite.dev/llmservice=<name>`.
pub fn selector_labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(LLMSERVICE_LABEL.to_string(), name.to_string())])
}

/// The standard `app.kubernetes.io/*` labels plus the selector label.
pub fn labels(name: &str) -> BTreeMap<String, String> {
    let mut l = selector_labels(name);
    for (k, v) in [
        ("app.kubernetes.io/name", "ferrite-engine"),
        ("app.kubernetes.io/instance", name),
        ("app.kubernetes.io/component", "inference-engine"),
        ("app.kubernetes.io/part-of", "ferrite"),
        ("app.kubernetes.io/managed-by", "ferrite-operator"),
    ] {
        l.insert(k.to_string(), v.to_string());
    }
    l
}

/// Metadata of a child object: same name and namespace, the labels, and a controller owner
/// reference to the LLMService (so deleting it deletes the child).
pub fn child_meta(svc: &LLMService) -> Result<ObjectMeta, Error> {
    let name = name_of(svc)?;
    let owner: OwnerReference = svc
        .controller_owner_ref(&())
        .ok_or(Error::MissingField("metadata.uid"))?;
    Ok(ObjectMeta {
        name: Some(name.clone()),
        namespace: svc.metadata.namespace.clone(),
        labels: Some(labels(&name)),
        owner_references: Some(vec![owner]),
        ..Default::default()
    })
}

/// Replicas (pods or groups) the workload should have when no autoscaler decides: `spec.replicas` (default 1),
/// clamped into the autoscaling bounds when autoscaling is set.
pub fn spec_replicas(svc: &LLMService) -> i32 {
    let r = svc.spec.replicas.unwrap_or(1).max(0);
    match &svc.spec.autoscaling {
        Some(a) => r.clamp(a.min_replicas, a.max_replicas.max(a.min_replicas)),
        None => r,
    }
}
