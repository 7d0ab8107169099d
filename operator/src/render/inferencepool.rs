//! The InferencePool of an LLMService (Gateway API Inference Extension,
//! `inference.networking.k8s.io/v1`): its engine pods — a group's leaders only, as the Service
//! selects them — on port 8000, and the endpoint picker a gateway consults, for clusters whose
//! gateway routes inference through the extension.

use ferrite_crds::llmservice::FailureMode;
use ferrite_crds::LLMService;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use super::{child_meta, name_of, selector_labels, RenderConfig, ENGINE_PORT};
use crate::Error;

/// The Inference Extension's API group.
pub const INFERENCE_GROUP: &str = "inference.networking.k8s.io";
/// The endpoint picker's usual port.
pub const ENDPOINT_PICKER_PORT: i32 = 9002;

/// The InferencePool resource, for `Api<DynamicObject>`.
pub fn inference_pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(INFERENCE_GROUP, "v1", "InferencePool"),
        "inferencepools",
    )
}

/// Whether `svc` gets an InferencePool: its own `spec.inferencePool.enabled`, else the
/// operator's default.
pub fn wants_inference_pool(svc: &LLMService, cfg: &RenderConfig) -> bool {
    svc.spec
        .inference_pool
        .as_ref()
        .and_then(|p| p.enabled)
        .unwrap_or(cfg.inference_pools)
}

/// The InferencePool `<name>`: the pods the Service selects, port 8000, and the endpoint
/// picker when the spec names one.
pub fn inference_pool(svc: &LLMService) -> Result<DynamicObject, Error> {
    let name = name_of(svc)?;
    let mut spec = json!({
        "selector": {"matchLabels": selector_labels(&name)},
        "targetPorts": [{"number": ENGINE_PORT}],
    });
    if let Some(picker) = svc
        .spec
        .inference_pool
        .as_ref()
        .and_then(|p| p.endpoint_picker.as_ref())
    {
        let mode = match picker.failure_mode.unwrap_or(FailureMode::FailClose) {
            FailureMode::FailOpen => "FailOpen",
            FailureMode::FailClose => "FailClose",
        };
        spec["endpointPickerRef"] = json!({
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port.unwrap_or(ENDPOINT_PICKER_PORT)},
            "failureMode": mode,
        });
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": format!("{INFERENCE_GROUP}/v1"),
        "kind": "InferencePool",
        "metadata": child_meta(svc)?,
        "spec": spec,
    }))?)
}
