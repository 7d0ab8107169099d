//! Every manifest under `examples/` is accepted by a real API server (the top-level
//! LLMServices are also served to Ready by tests/cluster.rs), and the GitOps overlay, built by
//! kustomize, differs from its base in exactly the model revision.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrite_testcluster::{apply, binaries_dir, ensure_namespace, install_crds, TestCluster};
use serde_json::Value;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Every YAML file below `dir` (sorted), kustomizations aside.
fn manifests(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("examples dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            manifests(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml")
            && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        {
            out.push(p);
        }
    }
}

fn kustomize(dir: &Path) -> Vec<Value> {
    let kubectl = binaries_dir().expect("k8s binaries").join("kubectl");
    let out = Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl kustomize runs");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_docs(&String::from_utf8_lossy(&out.stdout))
}

/// JSON pointers where `a` and `b` differ.
fn diff(a: &Value, b: &Value, path: String, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                diff(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    format!("{path}/{k}"),
                    out,
                );
            }
        }
        _ if a != b => out.push(path),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_file_is_accepted_by_the_api_server() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let crd = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    install_crds(&client, &crd).await.expect("CRD");
    ensure_namespace(&client, "argocd").await.expect("argocd");
    let mut files = Vec::new();
    manifests(&examples(), &mut files);
    assert!(files.len() >= 8, "found only {files:?}");
    for file in &files {
        let ns = cluster.namespace(&client, "example").await.expect("ns");
        let docs = yaml_docs(&std::fs::read_to_string(file).expect("read"));
        assert!(!docs.is_empty(), "{} holds no object", file.display());
        for doc in docs {
            apply(&client, &doc, &ns, "examples-test")
                .await
                .unwrap_or_else(|e| panic!("{} refused: {e}", file.display()));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn production_overlay_changes_only_the_model_revision() {
    let base = kustomize(&examples().join("gitops/base"));
    let production = kustomize(&examples().join("gitops/overlays/production"));
    assert_eq!(base.len(), 1);
    assert_eq!(production.len(), 1);
    let mut changed = Vec::new();
    diff(&base[0], &production[0], String::new(), &mut changed);
    assert_eq!(changed, ["/spec/model/revision"]);
    assert_ne!(
        base[0]["spec"]["model"]["revision"],
        production[0]["spec"]["model"]["revision"]
    );

    // Both builds are valid LLMServices for the API server.
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let crd = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    install_crds(&client, &crd).await.expect("CRD");
    for obj in base.iter().chain(&production) {
        let ns = cluster.namespace(&client, "gitops").await.expect("ns");
        apply(&client, obj, &ns, "argocd-controller")
            .await
            .unwrap_or_else(|e| panic!("kustomize output refused: {e}"));
    }
}
