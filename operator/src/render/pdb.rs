//! The PodDisruptionBudget that keeps node drains from taking more than one replica at a time.

use ferrite_crds::LLMService;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use serde_json::json;

use super::{child_meta, name_of};
use crate::Error;

/// A PodDisruptionBudget allowing one voluntary disruption at a time among every engine pod
/// (a group's workers too: evicting one restarts its group), or `None` when the service
/// runs one replica or none (a budget would then block node drains entirely).
pub fn pdb(svc: &LLMService, replicas: i32) -> Result<Option<PodDisruptionBudget>, Error> {
    if replicas <= 1 {
        return Ok(None);
    }
    let name = name_of(svc)?;
    Ok(Some(serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(svc)?,
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/managed-by": "ferrite-operator",
                "app.kubernetes.io/name": "ferrite-engine",
            }},
        },
    }))?))
}
