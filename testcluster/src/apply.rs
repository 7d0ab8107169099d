//! Applying arbitrary manifests (Helm output, examples, kustomize builds) the way `kubectl
//! apply --server-side` does, and clients that act as another user (a ServiceAccount) so a
//! test can run code with exactly the permissions a role grants.

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{pinned_kind, Scope};
use kube::Client;
use serde_json::Value;

use crate::{Error, TestCluster};

/// Server-side applies one object under `field_manager`, into its own namespace or, when it
/// names none and is namespaced, into `namespace`. The API server's refusal is returned as is.
pub async fn apply(
    client: &Client,
    obj: &Value,
    namespace: &str,
    field_manager: &str,
) -> Result<(), kube::Error> {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, obj["kind"].as_str().unwrap_or_default());
    let (resource, caps) = pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => {
            let ns = obj["metadata"]["namespace"].as_str().unwrap_or(namespace);
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    api.patch(
        name,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(obj),
    )
    .await
    .map(|_| ())
}

impl TestCluster {
    /// A client that impersonates `user` in `groups` (e.g. a ServiceAccount,
    /// `system:serviceaccount:<ns>:<name>`): every request is authorized as that user alone.
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> Result<Client, Error> {
        let mut config = crate::config_from(self.kubeconfig_path()).await?;
        config.auth_info.impersonate = Some(user.to_string());
        config.auth_info.impersonate_groups = Some(groups.iter().map(|g| g.to_string()).collect());
        Ok(Client::try_from(config)?)
    }
}
