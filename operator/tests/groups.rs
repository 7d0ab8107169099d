//! LLMServices split into pipeline stages against a real control plane with LeaderWorkerSet's
//! real controller and webhooks: each replica becomes a group of pods with LWS's labels and
//! environment, status counts groups, scaling moves groups without restarting them, a model
//! change rolls them, a lost rank is named and restarts its group, switching
//! pipelineParallelSize between 1 and 2 leaves no orphans, deletion cascades, and a cluster
//! without LeaderWorkerSet gets a status that says how to install it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use ferrite_crds::LLMService;
use ferrite_operator::{render, Options};
use ferrite_testcluster::{eventually, install_crds, TestCluster};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(120);

/// One cluster for this file, with two fake nodes so stages can land on different ones.
fn cluster() -> &'static TestCluster {
    static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        TestCluster::start_with(ferrite_testcluster::Options {
            nodes: 2,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("the test control plane did not start: {e}"))
    })
}

struct Operator {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>,
}

impl Operator {
    fn start(client: &Client, ns: &str) -> Self {
        let opts = Options {
            namespace: Some(ns.to_string()),
            engine_image: "ferrite-engine:test".into(),
            leader_election: false,
            ..Options::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        let c = client.clone();
        let task = tokio::spawn(async move {
            ferrite_operator::run(c, opts, async move {
                let _ = rx.await;
            })
            .await
        });
        Self {
            stop: Some(tx),
            task,
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

async fn crd(client: &Client) {
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    install_crds(client, &crd).await.expect("install CRD");
}

fn staged(name: &str, stages: i32, replicas: i32) -> LLMService {
    serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "file:///models/SmolLM2-135M-Instruct.Q4_1.gguf", "servedName": "smollm2"},
            "engine": {"pipelineParallelSize": stages, "maxModelLen": 512},
            "replicas": replicas,
            "pod": {"stageTopologyKey": "kubernetes.io/hostname"},
        },
    }))
    .expect("LLMService")
}

fn status_text(s: &LLMService) -> String {
    serde_json::to_string(&s.status).unwrap_or_default()
}

/// Waits until the LLMService's `Ready` condition is True for its current generation and
/// `check` accepts it.
async fn wait_for(
    api: &Api<LLMService>,
    name: &str,
    what: &str,
    check: impl Fn(&LLMService) -> bool,
) -> LLMService {
    eventually(&format!("LLMService {name}: {what}"), WAIT, || async {
        let s = api.get(name).await.map_err(|e| e.to_string())?;
        let st = s.status.clone().unwrap_or_default();
        let ready = st
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if ready && st.observed_generation == s.metadata.generation && check(&s) {
            Ok(Some(s))
        } else {
            Err(format!("status: {}", status_text(&s)))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster().log_tail("lws-controller", 2000)))
}

fn ready_condition(s: &LLMService) -> Option<Condition> {
    s.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .cloned()
}

fn ready_message(s: &LLMService) -> String {
    ready_condition(s).map(|c| c.message).unwrap_or_default()
}

/// Whether `name` exists, for `eventually`.
async fn exists<K>(api: &Api<K>, name: &str) -> Result<bool, String>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .is_some())
}

fn lws_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &render::lws_resource())
}

async fn pods_of(client: &Client, ns: &str, name: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&render::engine_pods_selector(name)))
        .await
        .expect("pods")
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

fn env_of(pod: &Pod, var: &str) -> Option<String> {
    pod.spec.as_ref()?.containers[0]
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == var)?
        .value
        .clone()
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_stages_become_groups_that_scale_roll_switch_and_cascade() {
    let cluster = cluster();
    let client = cluster.client().await.expect("client");
    crd(&client).await;
    let ns = cluster.namespace(&client, "groups").await.expect("ns");
    let operator = Operator::start(&client, &ns);
    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &staged("chat", 2, 2))
        .await
        .expect("create");

    // Two groups of two pods, counted as groups.
    let ready = wait_for(&api, "chat", "2 groups ready", |s| {
        s.status.as_ref().and_then(|s| s.ready_replicas) == Some(2)
    })
    .await;
    let st = ready.status.clone().expect("status");
    assert_eq!(st.replicas, Some(2));
    assert_eq!(ready_message(&ready), "2/2 groups ready, 4 pods");
    let par = st.parallelism.expect("parallelism");
    assert_eq!((par.tensor, par.pipeline, par.pods_per_replica), (1, 2, 2));
    assert_eq!(
        st.selector.as_deref(),
        Some("serving.ferrite.dev/llmservice=chat")
    );

    let lws = lws_api(&client, &ns)
        .get("chat-stages")
        .await
        .expect("the LeaderWorkerSet");
    assert_eq!(lws.data["spec"]["replicas"], json!(2));
    assert_eq!(lws.data["spec"]["leaderWorkerTemplate"]["size"], json!(2));
    assert_eq!(
        lws.metadata
            .owner_references
            .as_ref()
            .map(|o| o[0].kind.as_str()),
        Some("LLMService")
    );
    let secret = Api::<Secret>::namespaced(client.clone(), &ns)
        .get("chat-group-secret")
        .await
        .expect("the group Secret");
    assert!(secret
        .data
        .as_ref()
        .and_then(|d| d.get("secret"))
        .is_some_and(|v| v.0.len() == 64));

    // The pods LWS made: a leader and a worker per group, with LWS's labels and the
    // environment its webhook injects, the stages of a group on different nodes.
    let pods = pods_of(&client, &ns, "chat").await;
    assert_eq!(pods.len(), 4, "{pods:?}");
    for g in 0..2 {
        let leader_name = format!("chat-stages-{g}");
        let worker_name = format!("chat-stages-{g}-1");
        let find = |n: &str| {
            pods.iter()
                .find(|p| p.metadata.name.as_deref() == Some(n))
                .unwrap_or_else(|| panic!("pod {n} exists"))
        };
        let (leader, worker) = (find(&leader_name), find(&worker_name));
        let address = format!("{leader_name}.chat-stages.{ns}");
        for (pod, index) in [(leader, "0"), (worker, "1")] {
            assert_eq!(env_of(pod, "LWS_WORKER_INDEX").as_deref(), Some(index));
            assert_eq!(env_of(pod, "LWS_GROUP_SIZE").as_deref(), Some("2"));
            assert_eq!(
                env_of(pod, "LWS_LEADER_ADDRESS").as_deref(),
                Some(address.as_str())
            );
            assert_eq!(
                label(pod, "leaderworkerset.sigs.k8s.io/worker-index"),
                Some(index)
            );
            assert_eq!(
                label(pod, "leaderworkerset.sigs.k8s.io/group-index"),
                Some(g.to_string().as_str())
            );
        }
        assert_eq!(label(leader, "serving.ferrite.dev/role"), Some("leader"));
        assert_eq!(label(worker, "serving.ferrite.dev/worker-of"), Some("chat"));
        let node = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
        assert!(node(leader).is_some());
        assert_ne!(
            node(leader),
            node(worker),
            "stageTopologyKey spreads stages"
        );
    }

    // The Service reaches the leaders only.
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), &ns);
    let leader_ips: Vec<String> = pods
        .iter()
        .filter(|p| label(p, "serving.ferrite.dev/role") == Some("leader"))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    eventually(
        "the Service's endpoints to be the leaders",
        WAIT,
        || async {
            let list = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=chat"))
                .await
                .map_err(|e| e.to_string())?;
            let mut ips: Vec<String> = list
                .items
                .iter()
                .flat_map(|s| s.endpoints.iter().flat_map(|e| e.addresses.clone()))
                .collect();
            ips.sort();
            let mut want = leader_ips.clone();
            want.sort();
            if ips == want {
                Ok(Some(()))
            } else {
                Err(format!("endpoints {ips:?}, leaders {want:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Scaling through the scale subresource moves groups; the running ones stay.
    let before: Vec<String> = pods.iter().map(uid).collect();
    api.patch_scale(
        "chat",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 3}})),
    )
    .await
    .expect("scale");
    wait_for(&api, "chat", "3 groups ready", |s| {
        s.status.as_ref().and_then(|s| s.ready_replicas) == Some(3)
    })
    .await;
    let lws = lws_api(&client, &ns).get("chat-stages").await.expect("lws");
    assert_eq!(lws.data["spec"]["replicas"], json!(3));
    let now: Vec<String> = pods_of(&client, &ns, "chat")
        .await
        .iter()
        .map(uid)
        .collect();
    assert_eq!(now.len(), 6);
    assert!(
        before.iter().all(|u| now.contains(u)),
        "scaling restarted a group"
    );

    // A model change rolls every group.
    api.patch(
        "chat",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"engine": {"maxNumSeqs": 8}}})),
    )
    .await
    .expect("change the engine settings");
    let rolled = wait_for(&api, "chat", "rolled groups ready", |_| true).await;
    assert_eq!(
        rolled.status.as_ref().and_then(|s| s.ready_replicas),
        Some(3)
    );
    // The surge group LWS added during the rollout goes once the others are ready.
    let pods = eventually("six pods, all new", WAIT, || async {
        let pods = pods_of(&client, &ns, "chat").await;
        let fresh = pods.iter().filter(|p| !now.contains(&uid(p))).count();
        match (pods.len(), fresh) {
            (6, 6) => Ok(Some(pods)),
            other => Err(format!("(pods, new pods) = {other:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for p in &pods {
        let args = &p.spec.as_ref().expect("spec").containers[0].args;
        assert!(
            args.iter().flatten().any(|a| a == "--max-num-seqs"),
            "{args:?}"
        );
    }

    // pipelineParallelSize 2 -> 1: a Deployment takes over, then the groups go.
    api.patch(
        "chat",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"engine": {"pipelineParallelSize": 1}, "pod": null}})),
    )
    .await
    .expect("one stage");
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let lwss = lws_api(&client, &ns);
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    eventually("the groups replaced by a Deployment", WAIT, || async {
        let d = exists(&deployments, "chat").await?;
        let l = exists(&lwss, "chat-stages").await?;
        let sec = exists(&secrets, "chat-group-secret").await?;
        let pods = pods_of(&client, &ns, "chat").await;
        let workers = pods
            .iter()
            .filter(|p| label(p, "serving.ferrite.dev/role").is_some())
            .count();
        match (d, !l, !sec, pods.len(), workers) {
            (true, true, true, 3, 0) => Ok(Some(())),
            other => Err(format!(
                "(deployment, lws gone, secret gone, pods, group pods) = {other:?}"
            )),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let single = wait_for(&api, "chat", "3 replicas ready", |s| {
        s.status.as_ref().and_then(|s| s.ready_replicas) == Some(3)
    })
    .await;
    let par = single
        .status
        .and_then(|s| s.parallelism)
        .expect("parallelism");
    assert_eq!((par.pipeline, par.pods_per_replica), (1, 1));

    // ... and back to 2: the Deployment goes once the groups serve.
    api.patch(
        "chat",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"engine": {"pipelineParallelSize": 2}}})),
    )
    .await
    .expect("two stages");
    eventually("the Deployment replaced by groups", WAIT, || async {
        let d = exists(&deployments, "chat").await?;
        let l = exists(&lwss, "chat-stages").await?;
        let pods = pods_of(&client, &ns, "chat").await;
        let group_pods = pods
            .iter()
            .filter(|p| label(p, "leaderworkerset.sigs.k8s.io/name").is_some())
            .count();
        match (!d, l, pods.len(), group_pods) {
            (true, true, 6, 6) => Ok(Some(())),
            other => Err(format!(
                "(deployment gone, lws, pods, group pods) = {other:?}"
            )),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Deleting the LLMService takes everything with it.
    api.delete("chat", &DeleteParams::foreground())
        .await
        .expect("delete");
    eventually("the children to be garbage-collected", WAIT, || async {
        let l = exists(&lwss, "chat-stages").await?;
        let sec = exists(&secrets, "chat-group-secret").await?;
        let pods = pods_of(&client, &ns, "chat").await;
        match (!l, !sec, pods.len()) {
            (true, true, 0) => Ok(Some(())),
            other => Err(format!("(lws gone, secret gone, pods) = {other:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_is_named_in_status_and_restarts_its_group() {
    let cluster = cluster();
    let client = cluster.client().await.expect("client");
    crd(&client).await;
    let ns = cluster.namespace(&client, "rankfail").await.expect("ns");
    let operator = Operator::start(&client, &ns);
    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &staged("split", 2, 1))
        .await
        .expect("create");
    wait_for(&api, "split", "the group ready", |_| true).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let leader_uid = uid(&pods.get("split-stages-0").await.expect("leader"));

    // What a kubelet reports when stage 1's engine exits: its words in the termination
    // message, the container no longer ready.
    let words = "error: the model's 30 layers cannot be split into 31 stages";
    let status = |restarts: i32| {
        json!({"status": {
            "conditions": [{"type": "Ready", "status": "False"},
                           {"type": "ContainersReady", "status": "False"}],
            "containerStatuses": [{
                "name": "engine", "image": "ferrite-engine:test", "ready": false,
                "restartCount": restarts,
                "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": words}},
            }],
        }})
    };
    pods.patch_status(
        "split-stages-0-1",
        &PatchParams::default(),
        &Patch::Strategic(&status(0)),
    )
    .await
    .expect("report the exit");
    let failed = eventually("status to name the failed rank", WAIT, || async {
        let s = api.get("split").await.map_err(|e| e.to_string())?;
        Ok(ready_condition(&s).filter(|c| c.reason == "EngineStartupFailed"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        failed.message,
        format!("engine in rank 1 (pod split-stages-0-1) failed: {words}")
    );

    // The kubelet restarts the container: LWS recreates the whole group.
    pods.patch_status(
        "split-stages-0-1",
        &PatchParams::default(),
        &Patch::Strategic(&status(1)),
    )
    .await
    .expect("report the restart");
    eventually("LWS to recreate the group", WAIT, || async {
        let leader = pods
            .get_opt("split-stages-0")
            .await
            .map_err(|e| e.to_string())?;
        Ok(leader.filter(|p| uid(p) != leader_uid).map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("lws-controller", 2000)));
    wait_for(&api, "split", "the recreated group ready", |_| true).await;
    operator.stop().await;
}

fn example(file: &str) -> LLMService {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(file);
    serde_yaml::from_str(&std::fs::read_to_string(&path).expect("example")).expect("LLMService")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_examples_pass_dry_run_through_lws_and_the_cpu_one_serves() {
    let cluster = cluster();
    let client = cluster.client().await.expect("client");
    crd(&client).await;
    let ns = cluster.namespace(&client, "ppexamples").await.expect("ns");
    let cfg = render::RenderConfig::default();
    for file in ["pipeline-parallel-cpu.yaml", "llama3-70b-gpu-pp2.yaml"] {
        let mut svc = example(file);
        svc.metadata.namespace = Some(ns.clone());
        svc.metadata.uid = Some("00000000-0000-0000-0000-000000000003".into());
        let replicas = render::spec_replicas(&svc);
        let lws = render::leaderworkerset(&svc, &cfg, replicas).expect("render");
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let accepted = lws_api(&client, &ns)
            .create(&dry, &lws)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        // LWS's defaulting webhook saw it.
        assert_eq!(
            accepted.data["spec"]["leaderWorkerTemplate"]["restartPolicy"],
            json!("RecreateGroupOnPodRestart"),
            "{file}"
        );
        let secret = render::group_secret(&svc, "x").expect("render");
        Api::<Secret>::namespaced(client.clone(), &ns)
            .create(&dry, &secret)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let operator = Operator::start(&client, &ns);
    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &example("pipeline-parallel-cpu.yaml"),
    )
    .await
    .expect("create");
    let ready = wait_for(&api, "smollm2-pp", "its group ready", |_| true).await;
    assert_eq!(ready_message(&ready), "1/1 groups ready, 2 pods");
    // Every pod fetches the model before its engine starts.
    for p in pods_of(&client, &ns, "smollm2-pp").await {
        let init = p.spec.and_then(|s| s.init_containers).unwrap_or_default();
        assert_eq!(
            init.first().map(|c| c.name.as_str()),
            Some("model-download")
        );
    }
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_leaderworkerset_a_staged_llmservice_says_how_to_install_it() {
    // A cluster of its own: no LeaderWorkerSet CRD, no controllers.
    let bare = tokio::task::spawn_blocking(|| {
        TestCluster::start_with(ferrite_testcluster::Options {
            controller_manager: false,
            scheduler: false,
            kwok: false,
            leaderworkerset: false,
            ..Default::default()
        })
    })
    .await
    .expect("join")
    .expect("a bare control plane");
    let client = bare.client().await.expect("client");
    crd(&client).await;
    let ns = bare.namespace(&client, "nolws").await.expect("ns");
    let operator = Operator::start(&client, &ns);
    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &staged("split", 2, 1))
        .await
        .expect("create");
    let ready = eventually("Ready=False LeaderWorkerSetMissing", WAIT, || async {
        let s = api.get("split").await.map_err(|e| e.to_string())?;
        Ok(ready_condition(&s)
            .filter(|c| c.reason == "LeaderWorkerSetMissing" && c.status == "False"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        ready.message.contains("Install LeaderWorkerSet")
            && ready.message.contains("pipelineParallelSize is 2"),
        "{}",
        ready.message
    );
    // The operator keeps running (no crash loop) and serves a one-stage LLMService.
    assert!(!operator.task.is_finished());
    let mut one: Value = serde_json::to_value(staged("whole", 1, 1)).expect("json");
    one["spec"]["pod"] = Value::Null;
    api.create(
        &PostParams::default(),
        &serde_json::from_value(one).expect("LLMService"),
    )
    .await
    .expect("create");
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    eventually("the one-stage Deployment", WAIT, || async {
        Ok(deployments
            .get_opt("whole")
            .await
            .map_err(|e| e.to_string())?
            .map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!operator.task.is_finished());
    operator.stop().await;
}
