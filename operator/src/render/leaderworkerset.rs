//! The LeaderWorkerSet of an LLMService split into pipeline stages: one group of pods per
//! replica, a leader (stage 0, the OpenAI API) and a worker per later stage, started,
//! rolled, scaled and restarted as one (kubernetes-sigs/lws), and the Secret its ranks share.

use ferrite_crds::LLMService;
use k8s_openapi::api::core::v1::Secret;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use super::deployment::rollout_bounds;
use super::pod::{group_secret_name, pipeline_stages, pod_template, Role, GROUP_SECRET_KEY};
use super::{child_meta, name_of, RenderConfig};
use crate::Error;

/// LeaderWorkerSet's API group.
pub const LWS_GROUP: &str = "leaderworkerset.x-k8s.io";
/// The label LWS gives each pod with its index in the group (0: the leader).
pub const LWS_WORKER_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/worker-index";

/// The LeaderWorkerSet resource (`leaderworkerset.x-k8s.io/v1`), for `Api<DynamicObject>`.
pub fn lws_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(LWS_GROUP, "v1", "LeaderWorkerSet"),
        "leaderworkersets",
    )
}

/// The LeaderWorkerSet's name, `<name>-stages`: not `<name>`, which the ClusterIP Service
/// holds, because LWS gives a set a headless Service of its own name (the pods' DNS names
/// `<name>-stages-<group>.<name>-stages.<namespace>` live there).
pub fn lws_name(name: &str) -> String {
    format!("{name}-stages")
}

/// Whether `svc` is served by a LeaderWorkerSet (more than one pipeline stage) rather than a
/// Deployment.
pub fn uses_groups(svc: &LLMService) -> bool {
    pipeline_stages(svc) > 1
}

/// The LeaderWorkerSet for `replicas` groups of `pipelineParallelSize` pods: the leader runs
/// stage 0 and the API, each worker one later stage; a pod that restarts recreates its whole
/// group (a stage cannot rejoin a running group); a rollout replaces groups within the
/// LLMService's `rollout` bounds, counted in groups.
pub fn leaderworkerset(
    svc: &LLMService,
    cfg: &RenderConfig,
    replicas: i32,
) -> Result<DynamicObject, Error> {
    let name = name_of(svc)?;
    let mut meta = child_meta(svc)?;
    meta.name = Some(lws_name(&name));
    let (max_surge, max_unavailable) = rollout_bounds(svc);
    let lws = json!({
        "apiVersion": format!("{LWS_GROUP}/v1"),
        "kind": "LeaderWorkerSet",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            // Every stage starts loading its layers with the leader, not after it is ready.
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": max_surge, "maxUnavailable": max_unavailable}},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": pipeline_stages(svc),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(svc, cfg, Role::Leader)?,
                "workerTemplate": pod_template(svc, cfg, Role::Worker)?,
            },
        },
    });
    Ok(serde_json::from_value(lws)?)
}

/// The Secret `<name>-group-secret` whose `secret` key every rank of every group reads (as a
/// file) to admit the others; `value` is made once, when the Secret is first created.
pub fn group_secret(svc: &LLMService, value: &str) -> Result<Secret, Error> {
    let name = name_of(svc)?;
    let mut meta = child_meta(svc)?;
    meta.name = Some(group_secret_name(&name));
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {GROUP_SECRET_KEY: value},
    }))?)
}
