//! The Service in front of the pods that serve the API (a group's leaders; workers do not carry
//! the selector label): `<name>:8000`, port named `http`.

use ferrite_crds::LLMService;
use k8s_openapi::api::core::v1::Service;
use serde_json::json;

use super::{child_meta, name_of, selector_labels, ENGINE_PORT};
use crate::Error;

/// The ClusterIP Service `<name>` on port 8000 (`http`), selecting the engine pods.
pub fn service(svc: &LLMService) -> Result<Service, Error> {
    let name = name_of(svc)?;
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc)?,
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(&name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http",
                       "protocol": "TCP", "appProtocol": "http"}],
        },
    }))?)
}
