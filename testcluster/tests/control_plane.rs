//! The test control plane behaves like a real cluster: controllers run, kwok makes pods Ready,
//! LeaderWorkerSet's controller makes groups whose pods its webhook gave the `LWS_*`
//! environment, CEL rules are enforced, owners garbage-collect dependents, and no process
//! outlives a test.

use std::time::Duration;

use ferrite_testcluster::{eventually, install_crds, process, TestCluster};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::ApiResource;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("test object is valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_gets_replicaset_and_ready_pods() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let ns = cluster
        .namespace(&client, "smoke")
        .await
        .expect("namespace");

    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let cm = from_json(json!({"metadata": {"name": "settings"}, "data": {"model": "smollm2"}}));
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create configmap");
    let got = cms.get("settings").await.expect("get configmap");
    assert_eq!(
        got.data.and_then(|d| d.get("model").cloned()).as_deref(),
        Some("smollm2")
    );

    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let d = from_json(json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:1"}]}
            }
        }
    }));
    deployments
        .create(&PostParams::default(), &d)
        .await
        .expect("create deployment");

    let rss = Api::<ReplicaSet>::namespaced(client.clone(), &ns);
    let rs = eventually(
        "the controller-manager to create a ReplicaSet",
        WAIT,
        || async {
            let list = rss
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(list.items.into_iter().next())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("kube-controller-manager", 3000)));
    let owner = rs.metadata.owner_references.unwrap_or_default();
    assert!(
        owner
            .iter()
            .any(|o| o.kind == "Deployment" && o.name == "web"),
        "{owner:?}"
    );

    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    eventually("kwok to make both pods Running and Ready", WAIT, || async {
        let list = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let ready = list
            .items
            .iter()
            .filter(|p| {
                let s = p.status.as_ref();
                s.and_then(|s| s.phase.as_deref()) == Some("Running")
                    && s.and_then(|s| s.pod_ip.as_ref()).is_some()
                    && s.and_then(|s| s.conditions.as_ref()).is_some_and(|cs| {
                        cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                    })
            })
            .count();
        Ok((ready == 2).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("kwok", 3000)));

    eventually(
        "the Deployment to report readyReplicas = 2",
        WAIT,
        || async {
            let d = deployments.get("web").await.map_err(|e| e.to_string())?;
            Ok((d.status.and_then(|s| s.ready_replicas) == Some(2)).then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

const WIDGET_CRD: &str = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.test.ferrite.dev
spec:
  group: test.ferrite.dev
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              min: {type: integer}
              max: {type: integer}
            x-kubernetes-validations:
            - rule: self.min <= self.max
              message: spec.min must not exceed spec.max
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_cel_rule_is_enforced() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let ns = cluster.namespace(&client, "cel").await.expect("namespace");
    let file = cluster.data_dir().join("widget-crd.yaml");
    std::fs::write(&file, WIDGET_CRD).expect("write CRD");
    install_crds(&client, &file).await.expect("install CRD");

    let gvk = GroupVersionKind::gvk("test.ferrite.dev", "v1", "Widget");
    let api = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::from_gvk_with_plural(&gvk, "widgets"),
    );
    let widget = |name: &str, min: i64, max: i64| -> DynamicObject {
        from_json(json!({
            "apiVersion": "test.ferrite.dev/v1", "kind": "Widget",
            "metadata": {"name": name}, "spec": {"min": min, "max": max}
        }))
    };
    api.create(&PostParams::default(), &widget("good", 1, 2))
        .await
        .expect("valid widget");
    let err = api
        .create(&PostParams::default(), &widget("bad", 3, 2))
        .await
        .expect_err("the API server must refuse min > max");
    let text = err.to_string();
    assert!(text.contains("spec.min must not exceed spec.max"), "{text}");
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 422),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_owner_garbage_collects_its_dependents() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let ns = cluster.namespace(&client, "gc").await.expect("namespace");
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let owner = cms
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "owner"}})),
        )
        .await
        .expect("owner");
    let uid = owner.metadata.uid.expect("uid");
    let dependent = from_json(
        json!({"metadata": {"name": "dependent", "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
        ]}}),
    );
    cms.create(&PostParams::default(), &dependent)
        .await
        .expect("dependent");

    cms.delete("owner", &DeleteParams::background())
        .await
        .expect("delete owner");
    eventually(
        "the garbage collector to delete the dependent",
        WAIT,
        || async {
            let gone = cms
                .get_opt("dependent")
                .await
                .map_err(|e| e.to_string())?
                .is_none();
            Ok(gone.then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("kube-controller-manager", 3000)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaderworkerset_groups_get_pods_with_lws_environment() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let ns = cluster.namespace(&client, "lws").await.expect("namespace");
    let lws = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &ns,
        &ferrite_testcluster::lws::api_resource(),
    );
    let group: DynamicObject = from_json(json!({
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "pair"},
        "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}},
    }));
    lws.create(&PostParams::default(), &group)
        .await
        .expect("create LeaderWorkerSet");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let env = |p: &Pod, name: &str| {
        p.spec.as_ref()?.containers[0]
            .env
            .as_ref()?
            .iter()
            .find(|e| e.name == name)?
            .value
            .clone()
    };
    let (leader, worker) = eventually("the group's two pods", WAIT, || async {
        let list = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let find = |n: &str| {
            list.items
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(n))
        };
        Ok(find("pair-0").cloned().zip(find("pair-0-1").cloned()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("lws-controller", 3000)));
    let leader_address = format!("pair-0.pair.{ns}");
    for (pod, index) in [(&leader, "0"), (&worker, "1")] {
        assert_eq!(env(pod, "LWS_WORKER_INDEX").as_deref(), Some(index));
        assert_eq!(env(pod, "LWS_GROUP_SIZE").as_deref(), Some("2"));
        assert_eq!(
            env(pod, "LWS_LEADER_ADDRESS").as_deref(),
            Some(leader_address.as_str())
        );
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels
                .get("leaderworkerset.sigs.k8s.io/worker-index")
                .map(String::as_str),
            Some(index)
        );
    }
}

const CHILD_ENV: &str = "FERRITE_TESTCLUSTER_ABANDON";

/// Run by `no_process_outlives_the_test_binary` in a child process: starts a cluster, reports
/// its data folder and pids, and exits without dropping anything — like a test binary that
/// ends (or is killed) with the cluster still up.
#[test]
fn abandon_cluster_in_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let cluster = TestCluster::start().expect("start");
    let pids: Vec<String> = cluster
        .processes()
        .iter()
        .map(|(n, p)| format!("{n}:{p}"))
        .collect();
    println!("DATA_DIR={}", cluster.data_dir().display());
    println!("PIDS={}", pids.join(","));
    std::process::exit(0);
}

#[test]
fn no_process_outlives_the_test_binary() {
    // A dropped cluster stops at once.
    let cluster = TestCluster::start().expect("start");
    let dir = cluster.data_dir().to_path_buf();
    let pids = cluster.processes();
    assert_eq!(
        pids.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "lws-controller"
        ]
    );
    drop(cluster);
    for (name, pid) in &pids {
        assert!(
            !process::pid_alive(*pid),
            "{name} ({pid}) still runs after drop"
        );
    }
    assert!(!dir.exists(), "{} remains after drop", dir.display());

    // A test binary that exits with its cluster still up leaves nothing behind either.
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "abandon_cluster_in_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .expect("run child test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.split_once(key).map(|(_, v)| v))
            .unwrap_or_else(|| panic!("child printed no {key}: {stdout}"))
            .to_string()
    };
    let dir = field("DATA_DIR=");
    let pids = field("PIDS=");
    assert_eq!(pids.split(',').count(), 6, "{pids}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(eventually(
        "the abandoned cluster's processes to exit",
        WAIT,
        || async {
            let left = process::processes_mentioning(&dir);
            if left.is_empty() && !std::path::Path::new(&dir).exists() {
                Ok(Some(()))
            } else {
                Err(format!(
                    "still running: {left:?}; data folder exists: {}",
                    std::path::Path::new(&dir).exists()
                ))
            }
        },
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    for entry in pids.split(',') {
        let (name, pid) = entry.split_once(':').expect("name:pid");
        let pid: u32 = pid.parse().expect("pid");
        assert!(
            !process::pid_alive(pid),
            "{name} ({pid}) outlived its test binary"
        );
    }
}
