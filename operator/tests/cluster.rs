//! The operator against a real control plane (kube-apiserver, controller-manager, scheduler,
//! kwok): examples become Deployments and Services, status follows the pods, rollouts and
//! scaling behave, failures surface, deletion cascades, and a standby never acts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrite_crds::LLMService;
use ferrite_operator::{render, Options};
use ferrite_testcluster::{eventually, install_crds, TestCluster};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(90);

struct Setup {
    client: Client,
    ns: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>>,
}

impl Setup {
    async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
    }
}

fn options(ns: &str, identity: &str) -> Options {
    Options {
        namespace: Some(ns.to_string()),
        engine_image: "ferrite-engine:test".into(),
        lease_namespace: ns.to_string(),
        identity: identity.to_string(),
        lease_duration: Duration::from_secs(3),
        ..Options::default()
    }
}

fn start_operator(
    client: &Client,
    opts: Options,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>,
) {
    let (tx, rx) = oneshot::channel::<()>();
    let c = client.clone();
    let task = tokio::spawn(async move {
        ferrite_operator::run(c, opts, async move {
            let _ = rx.await;
        })
        .await
    });
    (tx, task)
}

async fn setup(prefix: &str, with_operator: bool) -> Setup {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    install_crds(&client, &crd).await.expect("install CRD");
    let ns = cluster.namespace(&client, prefix).await.expect("namespace");
    let (stop, task) = if with_operator {
        let (s, t) = start_operator(&client, options(&ns, "operator-a"));
        (Some(s), Some(t))
    } else {
        (None, None)
    };
    Setup {
        client,
        ns,
        stop,
        task,
    }
}

fn example(file: &str) -> LLMService {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(file);
    serde_yaml::from_str(&std::fs::read_to_string(&path).expect("example")).expect("LLMService")
}

fn smollm2(name: &str) -> LLMService {
    serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"}},
    }))
    .expect("LLMService")
}

async fn wait_ready(api: &Api<LLMService>, name: &str) -> LLMService {
    eventually(&format!("LLMService {name} to be Ready"), WAIT, || async {
        let s = api.get(name).await.map_err(|e| e.to_string())?;
        let st = s.status.clone().unwrap_or_default();
        let ready = st
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let current = st.observed_generation == s.metadata.generation;
        if ready && current {
            Ok(Some(s))
        } else {
            Err(format!(
                "status: {}",
                serde_json::to_string(&st).unwrap_or_default()
            ))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A PersistentVolume and the claim `models` bound to it, for the pvc:// example.
async fn models_pvc(client: &Client, ns: &str) {
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": format!("models-{ns}")},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                 "storageClassName": "manual", "hostPath": {"path": "/srv/models"},
                 "claimRef": {"namespace": ns, "name": "models"}},
    }))
    .expect("pv");
    Api::<PersistentVolume>::all(client.clone())
        .create(&PostParams::default(), &pv)
        .await
        .expect("pv");
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "manual",
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .expect("pvc");
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pvc)
        .await
        .expect("pvc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_is_served_and_becomes_ready() {
    let mut s = setup("examples", true).await;
    models_pvc(&s.client, &s.ns).await;
    // The 70B example selects H100 nodes; label the fake node like GPU feature discovery would.
    let label =
        json!({"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}});
    Api::<k8s_openapi::api::core::v1::Node>::all(s.client.clone())
        .patch(
            "kwok-node-0",
            &PatchParams::default(),
            &Patch::Merge(&label),
        )
        .await
        .expect("label node");
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    let files = [
        "smollm2-cpu.yaml",
        "llama3-8b-gpu.yaml",
        "llama3-70b-gpu-tp4.yaml",
        "autoscaling.yaml",
        "pvc-model.yaml",
    ];
    for f in files {
        api.create(&PostParams::default(), &example(f))
            .await
            .unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let deployments = Api::<Deployment>::namespaced(s.client.clone(), &s.ns);
    let services = Api::<Service>::namespaced(s.client.clone(), &s.ns);
    let pdbs = Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.ns);
    for f in files {
        let svc = example(f);
        let name = svc.metadata.name.clone().expect("name");
        let ready = wait_ready(&api, &name).await;
        let st = ready.status.expect("status");
        let want = render::spec_replicas(&svc);
        assert_eq!(st.ready_replicas, Some(want), "{f}");
        assert_eq!(st.phase.as_deref(), Some("Ready"), "{f}");
        assert_eq!(
            st.endpoint,
            Some(format!("http://{name}.{}.svc:8000/v1", s.ns)),
            "{f}"
        );
        assert_eq!(
            st.selector,
            Some(format!("serving.ferrite.dev/llmservice={name}")),
            "{f}"
        );

        let d = deployments.get(&name).await.expect("deployment");
        assert_eq!(
            d.metadata
                .owner_references
                .as_ref()
                .map(|o| o[0].kind.as_str()),
            Some("LLMService")
        );
        let managers: Vec<_> = d
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|m| m.manager.clone())
            .collect();
        assert!(
            managers.iter().any(|m| m == "ferrite-operator"),
            "{f}: {managers:?}"
        );
        let pod = d
            .spec
            .as_ref()
            .expect("spec")
            .template
            .spec
            .as_ref()
            .expect("pod spec");
        let engine = &pod.containers[0];
        assert_eq!(engine.image.as_deref(), Some("ferrite-engine:test"));
        let gpus = engine
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone());
        let tp = svc.spec.engine.tensor_parallel_size.unwrap_or(1);
        assert_eq!(
            gpus,
            svc.spec.gpu_resource.as_ref().map(|_| tp.to_string()),
            "{f}"
        );
        let has_init = pod
            .init_containers
            .as_ref()
            .is_some_and(|i| i[0].name == "model-download");
        assert_eq!(has_init, svc.spec.model.source.starts_with("hf://"), "{f}");

        let service = services.get(&name).await.expect("service");
        let port = &service.spec.expect("spec").ports.expect("ports")[0];
        assert_eq!(
            (port.port, port.name.as_deref()),
            (8000, Some("http")),
            "{f}"
        );
        assert_eq!(
            pdbs.get_opt(&name).await.expect("pdb").is_some(),
            want > 1,
            "{f}: PDB only with >1 replica"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_keeps_pods_and_a_model_change_rolls_them() {
    let mut s = setup("rollout", true).await;
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    api.create(&PostParams::default(), &smollm2("chat"))
        .await
        .expect("create");
    let first = wait_ready(&api, "chat").await;
    let pods = Api::<Pod>::namespaced(s.client.clone(), &s.ns);
    let rss = Api::<ReplicaSet>::namespaced(s.client.clone(), &s.ns);
    let original: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("pods")
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert_eq!(original.len(), 1);

    // `kubectl scale llms/chat --replicas=3`: through the scale subresource.
    let scale = json!({"spec": {"replicas": 3}});
    api.patch_scale("chat", &PatchParams::default(), &Patch::Merge(&scale))
        .await
        .expect("scale");
    let scaled = wait_ready(&api, "chat").await;
    assert_eq!(
        scaled.status.as_ref().and_then(|s| s.ready_replicas),
        Some(3)
    );
    assert!(scaled.metadata.generation > first.metadata.generation);
    let now: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("pods")
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert!(
        original.iter().all(|p| now.contains(p)),
        "scaling restarted the original pod: {original:?} -> {now:?}"
    );
    assert_eq!(
        rss.list(&ListParams::default())
            .await
            .expect("rs")
            .items
            .len(),
        1,
        "a scale change made a new ReplicaSet"
    );
    assert!(
        Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.ns)
            .get_opt("chat")
            .await
            .expect("pdb")
            .is_some()
    );

    // A new model revision is a new pod template: the Deployment rolls.
    let change = json!({"spec": {"model": {"revision": "v2"}}});
    api.patch("chat", &PatchParams::default(), &Patch::Merge(&change))
        .await
        .expect("change model");
    let rolled = wait_ready(&api, "chat").await;
    assert_eq!(
        rolled.status.as_ref().and_then(|s| s.observed_generation),
        rolled.metadata.generation
    );
    let sets = rss.list(&ListParams::default()).await.expect("rs").items;
    assert_eq!(sets.len(), 2, "the model change made a new ReplicaSet");
    eventually("every pod to run the new revision", WAIT, || async {
        let list = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        // The model each live pod downloads: the second argument of its init container.
        let sources: Vec<Option<String>> = list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| {
                let init = p.spec.as_ref()?.init_containers.as_ref()?.first()?;
                init.args.as_ref()?.get(1).cloned()
            })
            .collect();
        let want = Some("hf://HuggingFaceTB/SmolLM2-135M-Instruct@v2".to_string());
        Ok((sources.len() == 3 && sources.iter().all(|s| *s == want)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_startup_failure_is_reported_in_status() {
    let mut s = setup("failure", true).await;
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    api.create(&PostParams::default(), &smollm2("broken"))
        .await
        .expect("create");
    wait_ready(&api, "broken").await;
    let pods = Api::<Pod>::namespaced(s.client.clone(), &s.ns);
    let pod = pods
        .list(&ListParams::default())
        .await
        .expect("pods")
        .items
        .remove(0);
    let name = pod.metadata.name.clone().expect("name");
    // What a kubelet reports when the engine exits at startup, its error in the termination
    // message, and restarts it: CrashLoopBackOff.
    let message = "error: --max-model-len 131072 does not fit the KV cache: 2048 tokens fit in 0.9 of 2 GiB; lower maxModelLen or raise gpuMemoryUtilization";
    let status = json!({"status": {
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
        "containerStatuses": [{
            "name": "engine", "image": "ferrite-engine:test", "imageID": "", "ready": false, "restartCount": 3, "started": false,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
        }],
    }});
    pods.patch_status(&name, &PatchParams::default(), &Patch::Strategic(&status))
        .await
        .expect("pod status");
    let failed = eventually("status to show EngineStartupFailed", WAIT, || async {
        let svc = api.get("broken").await.map_err(|e| e.to_string())?;
        let st = svc.status.unwrap_or_default();
        let c = st.conditions.iter().find(|c| c.type_ == "Ready").cloned();
        Ok(c.filter(|c| c.reason == "EngineStartupFailed")
            .map(|c| (st.phase, c)))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(failed.0.as_deref(), Some("Failed"));
    assert_eq!(failed.1.status, "False");
    assert!(failed.1.message.contains(message), "{}", failed.1.message);
    assert!(failed.1.message.contains(&name), "{}", failed.1.message);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_llmservice_removes_its_children() {
    let mut s = setup("delete", true).await;
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    let mut svc = smollm2("gone");
    svc.spec.replicas = Some(2);
    api.create(&PostParams::default(), &svc)
        .await
        .expect("create");
    wait_ready(&api, "gone").await;
    api.delete("gone", &DeleteParams::background())
        .await
        .expect("delete");
    let deployments = Api::<Deployment>::namespaced(s.client.clone(), &s.ns);
    let services = Api::<Service>::namespaced(s.client.clone(), &s.ns);
    let pdbs = Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.ns);
    eventually(
        "the Deployment, Service and PDB to be garbage-collected",
        WAIT,
        || async {
            let d = deployments
                .get_opt("gone")
                .await
                .map_err(|e| e.to_string())?;
            let sv = services.get_opt("gone").await.map_err(|e| e.to_string())?;
            let p = pdbs.get_opt("gone").await.map_err(|e| e.to_string())?;
            Ok((d.is_none() && sv.is_none() && p.is_none()).then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_operator_does_not_act_while_the_lease_is_held() {
    let mut s = setup("leader", false).await;
    let leases = Api::<Lease>::namespaced(s.client.clone(), &s.ns);
    // Another replica holds the lease and keeps renewing it.
    let holder = ferrite_operator::leader::LeaseLock::new(
        s.client.clone(),
        &s.ns,
        "ferrite-operator",
        "operator-a",
        Duration::from_secs(3),
    );
    assert!(holder.try_acquire_or_renew().await.expect("acquire"));
    let (stop_renew, mut renew_rx) = oneshot::channel::<()>();
    let h = holder.clone();
    let renewer = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = &mut renew_rx => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => { let _ = h.try_acquire_or_renew().await; }
            }
        }
    });

    let (stop_b, task_b) = start_operator(&s.client, options(&s.ns, "operator-b"));
    s.stop = Some(stop_b);
    s.task = Some(task_b);
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    api.create(&PostParams::default(), &smollm2("waiting"))
        .await
        .expect("create");
    let deployments = Api::<Deployment>::namespaced(s.client.clone(), &s.ns);
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        deployments.get_opt("waiting").await.expect("get").is_none(),
        "the standby acted while another replica held the lease"
    );
    assert!(
        api.get("waiting").await.expect("get").status.is_none(),
        "the standby wrote status"
    );

    // The holder goes away; the standby takes over and reconciles.
    let _ = stop_renew.send(());
    let _ = renewer.await;
    wait_ready(&api, "waiting").await;
    let lease = leases.get("ferrite-operator").await.expect("lease");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("operator-b"));
    assert_eq!(spec.lease_transitions, Some(1));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendered_examples_pass_server_side_dry_run() {
    let s = setup("dryrun", false).await;
    let api = Api::<LLMService>::namespaced(s.client.clone(), &s.ns);
    let cfg = render::RenderConfig::default();
    for f in [
        "smollm2-cpu.yaml",
        "llama3-8b-gpu.yaml",
        "llama3-70b-gpu-tp4.yaml",
        "autoscaling.yaml",
        "pvc-model.yaml",
    ] {
        let svc = api
            .create(&PostParams::default(), &example(f))
            .await
            .expect("create");
        let name = svc.metadata.name.clone().expect("name");
        let replicas = render::spec_replicas(&svc);
        let pp = PatchParams::apply("ferrite-operator").dry_run();
        let d = render::deployment(&svc, &cfg, replicas).expect("render");
        Api::<Deployment>::namespaced(s.client.clone(), &s.ns)
            .patch(&name, &pp, &Patch::Apply(&d))
            .await
            .unwrap_or_else(|e| panic!("{f}: Deployment refused: {e}"));
        let sv = render::service(&svc).expect("render");
        Api::<Service>::namespaced(s.client.clone(), &s.ns)
            .patch(&name, &pp, &Patch::Apply(&sv))
            .await
            .unwrap_or_else(|e| panic!("{f}: Service refused: {e}"));
        if let Some(p) = render::pdb(&svc, 2).expect("render") {
            Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.ns)
                .patch(&name, &pp, &Patch::Apply(&p))
                .await
                .unwrap_or_else(|e| panic!("{f}: PDB refused: {e}"));
        }
    }
}
