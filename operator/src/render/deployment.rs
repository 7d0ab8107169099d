//! The engine Deployment of an LLMService whose replicas are one pod each: the pod template
//! and the rolling-update strategy.

use ferrite_crds::LLMService;
use k8s_openapi::api::apps::v1::Deployment;
use serde_json::json;

use super::pod::{pod_template, Role};
use super::{child_meta, name_of, selector_labels, RenderConfig};
use crate::Error;

/// The rollout bounds of `spec.rollout`: (maxSurge, maxUnavailable), default (1, 0).
pub fn rollout_bounds(svc: &LLMService) -> (i32, i32) {
    let rollout = svc.spec.rollout.as_ref();
    (
        rollout.and_then(|r| r.max_surge).unwrap_or(1),
        rollout.and_then(|r| r.max_unavailable).unwrap_or(0),
    )
}

/// The engine Deployment for `replicas` replicas.
pub fn deployment(
    svc: &LLMService,
    cfg: &RenderConfig,
    replicas: i32,
) -> Result<Deployment, Error> {
    let name = name_of(svc)?;
    let (max_surge, max_unavailable) = rollout_bounds(svc);
    let d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_meta(svc)?,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(&name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": max_surge, "maxUnavailable": max_unavailable}},
            "template": pod_template(svc, cfg, Role::Replica)?,
        },
    });
    Ok(serde_json::from_value(d)?)
}
