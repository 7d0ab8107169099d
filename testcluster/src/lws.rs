//! LeaderWorkerSet (kubernetes-sigs/lws) in the test control plane: its controller, built by
//! `scripts/build-lws.sh` from the Go module proxy, runs on loopback with its CRDs installed
//! and its webhooks registered at `https://127.0.0.1:<port>` (a certificate from the cluster's
//! CA), so the API server calls them as it would in a cluster and pods get the `LWS_*`
//! environment LWS really injects.

use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::ByteString;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::Client;
use serde_json::{json, Value};

use crate::Error;

/// The API group of LeaderWorkerSet.
pub const GROUP: &str = "leaderworkerset.x-k8s.io";

/// The LeaderWorkerSet resource, for `Api<DynamicObject>`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, "v1", "LeaderWorkerSet"),
        "leaderworkersets",
    )
}

/// The folder holding `lws-controller` and `crds.yaml`: `$FERRITE_LWS_DIR` when set,
/// otherwise the one `scripts/build-lws.sh` prints — building them first when missing.
pub fn binaries_dir() -> Result<PathBuf, Error> {
    crate::cached_dir("FERRITE_LWS_DIR", "build-lws.sh")
}

/// The controller's configuration file: no leader election, the webhook server on
/// `127.0.0.1:<webhook_port>` with certificates from `cert_dir` (LWS's own certificate
/// rotation is off), health probes on `127.0.0.1:<health_port>`, no metrics listener.
pub fn config(webhook_port: u16, health_port: u16, cert_dir: &Path) -> String {
    format!(
        "apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
webhook:
  port: {webhook_port}
  host: 127.0.0.1
  certDir: {certs}
metrics:
  bindAddress: \"0\"
health:
  healthProbeBindAddress: 127.0.0.1:{health_port}
internalCertManagement:
  enable: false
",
        certs = cert_dir.display()
    )
}

fn hook(
    name: &str,
    url: &str,
    ca: &ByteString,
    group: &str,
    resource: &str,
    ops: &[&str],
) -> Value {
    let mut h = json!({
        "name": name,
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Fail",
        "clientConfig": {"url": url, "caBundle": ca},
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ops,
                   "resources": [resource]}],
    });
    if resource == "pods" {
        // As LWS's own manifests: only pods LWS created reach its pod webhooks.
        h["objectSelector"] = json!({"matchExpressions": [
            {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]});
    }
    h
}

/// Registers LWS's mutating and validating webhooks (the ones its manifests install) at
/// `https://127.0.0.1:<port>`, trusted through `ca_pem`.
pub async fn register_webhooks(client: &Client, port: u16, ca_pem: &[u8]) -> Result<(), Error> {
    let ca = ByteString(ca_pem.to_vec());
    let base = format!("https://127.0.0.1:{port}");
    let url = |path: &str| format!("{base}{path}");
    let lws_ops = ["CREATE", "UPDATE"];
    let mutating = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "lws-mutating-webhook-configuration"},
        "webhooks": [
            hook("mleaderworkerset.kb.io",
                &url("/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset"),
                &ca, GROUP, "leaderworkersets", &lws_ops),
            hook("mpod.kb.io", &url("/mutate--v1-pod"), &ca, "", "pods", &["CREATE"]),
        ],
    });
    let validating = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "lws-validating-webhook-configuration"},
        "webhooks": [
            hook("vleaderworkerset.kb.io",
                &url("/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset"),
                &ca, GROUP, "leaderworkersets", &lws_ops),
            hook("vpod.kb.io", &url("/validate--v1-pod"), &ca, "", "pods", &lws_ops),
            hook("vdisaggregatedset.kb.io",
                &url("/validate-disaggregatedset-x-k8s-io-v1-disaggregatedset"),
                &ca, "disaggregatedset.x-k8s.io", "disaggregatedsets", &lws_ops),
        ],
    });
    let pp = PatchParams::apply("ferrite-testcluster").force();
    let m: MutatingWebhookConfiguration = serde_json::from_value(mutating)?;
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .patch("lws-mutating-webhook-configuration", &pp, &Patch::Apply(&m))
        .await?;
    let v: ValidatingWebhookConfiguration = serde_json::from_value(validating)?;
    Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .patch(
            "lws-validating-webhook-configuration",
            &pp,
            &Patch::Apply(&v),
        )
        .await?;
    Ok(())
}

/// Whether LWS's webhooks answer: a LeaderWorkerSet created in dry-run mode passes through
/// both (the defaulting webhook fills `leaderWorkerTemplate.restartPolicy`).
pub async fn webhooks_answer(client: &Client) -> Result<bool, Error> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), "default", &api_resource());
    let probe: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "webhook-probe"},
        "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {
            "containers": [{"name": "c", "image": "probe"}]}}}},
    }))?;
    let pp = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let created = api.create(&pp, &probe).await?;
    Ok(created.data["spec"]["leaderWorkerTemplate"]["restartPolicy"].is_string())
}
