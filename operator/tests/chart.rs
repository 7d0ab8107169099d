//! The Helm chart on a real control plane: the objects the real Helm SDK renders are applied
//! and accepted, the operator runs with exactly the chart's RBAC (impersonating the chart's
//! ServiceAccount) and the flags the chart gives it, serves an example to Ready, and is
//! refused anything its role does not grant.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Parser;
use ferrite_crds::LLMService;
use ferrite_operator::cli::Args;
use ferrite_operator::render;
use ferrite_testcluster::{
    apply, ensure_namespace, eventually, inference_pool_crd, install_crds, TestCluster,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(90);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The test Python (with helm-python-sdk): `FERRITE_PYTHON`, else the one `make test` uses.
fn python() -> String {
    if let Ok(p) = std::env::var("FERRITE_PYTHON") {
        return p;
    }
    let out = Command::new(root().join("scripts/python-env.sh"))
        .output()
        .expect("scripts/python-env.sh runs");
    assert!(out.status.success(), "python-env.sh failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The chart's objects as Helm renders them for release `ferrite` in `namespace`.
fn render(namespace: &str, values: Option<&Path>, set_json: Option<Value>) -> Vec<Value> {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/chart/render.py")).args([
        "--name",
        "ferrite",
        "--namespace",
        namespace,
    ]);
    if let Some(v) = values {
        cmd.arg("--values").arg(v);
    }
    if let Some(j) = set_json {
        cmd.arg("--set-json").arg(j.to_string());
    }
    let out = cmd.output().expect("render.py runs");
    assert!(
        out.status.success(),
        "helm render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| serde::Deserialize::deserialize(d).expect("rendered YAML"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn container_args(objects: &[Value]) -> Vec<String> {
    deployment_args(objects, "ferrite")
}

/// The container args of the rendered Deployment `name`.
fn deployment_args(objects: &[Value], name: &str) -> Vec<String> {
    let dep = objects
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("the chart renders Deployment {name}"));
    dep["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect()
}

fn forbidden<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

async fn wait_ready(api: &Api<LLMService>, name: &str) {
    eventually(&format!("LLMService {name} Ready"), WAIT, || async {
        let s = api.get(name).await.map_err(|e| e.to_string())?;
        let ready = s.status.as_ref().is_some_and(|st| {
            st.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        });
        if ready {
            Ok(Some(()))
        } else {
            Err(format!("status: {:?}", s.status))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

fn example(file: &str) -> LLMService {
    let text = std::fs::read_to_string(root().join("examples").join(file)).expect("example");
    serde_yaml::from_str(&text).expect("LLMService")
}

/// Runs the operator as the chart's Deployment would: with its args and as its ServiceAccount.
fn start_operator(
    client: Client,
    args: &[String],
    pod_namespace: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>,
) {
    let parsed = Args::try_parse_from(
        std::iter::once("ferrite-operator".to_string()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("the chart's args are not the operator's flags: {e}"));
    let mut opts = parsed.into_options("ferrite-0".into());
    // What the downward API gives the pod; the metrics port stays free on this machine.
    opts.lease_namespace = pod_namespace.to_string();
    opts.identity = "ferrite-0".into();
    opts.metrics_addr = None;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        ferrite_operator::run(client, opts, async move {
            let _ = rx.await;
        })
        .await
    });
    (tx, task)
}

async fn stop(
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>,
) {
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_installs_an_operator_that_serves_with_only_its_rbac() {
    let cluster = TestCluster::shared();
    let admin = cluster.client().await.expect("client");
    install_crds(&admin, &root().join("charts/ferrite/crds/llmservice.yaml"))
        .await
        .expect("the chart's CRD is accepted");
    let release_ns = cluster
        .namespace(&admin, "ferrite-system")
        .await
        .expect("ns");
    let objects = render(&release_ns, None, None);
    for obj in &objects {
        apply(&admin, obj, &release_ns, "helm")
            .await
            .unwrap_or_else(|e| panic!("{} {} refused: {e}", obj["kind"], obj["metadata"]["name"]));
    }
    // The operator's own Deployment is valid enough that kwok's "kubelet" runs it Ready.
    let deployments = Api::<Deployment>::namespaced(admin.clone(), &release_ns);
    eventually("the operator Deployment to be available", WAIT, || async {
        let d = deployments
            .get("ferrite")
            .await
            .map_err(|e| e.to_string())?;
        match d.status.and_then(|s| s.ready_replicas) {
            Some(1) => Ok(Some(())),
            r => Err(format!("ready replicas {r:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let sa = format!("system:serviceaccount:{release_ns}:ferrite");
    let operator_client = cluster
        .client_as(
            &sa,
            &[
                "system:serviceaccounts",
                &format!("system:serviceaccounts:{release_ns}"),
                "system:authenticated",
            ],
        )
        .await
        .expect("impersonating client");
    let args = container_args(&objects);
    let (tx, task) = start_operator(operator_client.clone(), &args, &release_ns);

    let app_ns = cluster.namespace(&admin, "chart-app").await.expect("ns");
    let llms = Api::<LLMService>::namespaced(admin.clone(), &app_ns);
    llms.create(&PostParams::default(), &example("smollm2-cpu.yaml"))
        .await
        .expect("example accepted");
    wait_ready(&llms, "smollm2").await;
    // It led through its Lease in the release namespace, and used the chart's engine image.
    let lease = Api::<Lease>::namespaced(admin.clone(), &release_ns)
        .get("ferrite")
        .await
        .expect("the leader Lease");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("ferrite-0")
    );
    let engine = Api::<Deployment>::namespaced(admin.clone(), &app_ns)
        .get("smollm2")
        .await
        .expect("engine Deployment");
    let image = engine
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers.first().and_then(|c| c.image.clone()));
    assert_eq!(
        image.as_deref(),
        Some("ghcr.io/ferrite-serving/ferrite-engine:0.1.0")
    );

    // With the Inference Extension installed, an LLMService that asks gets its InferencePool,
    // through exactly the chart's verbs on pools.
    install_crds(
        &admin,
        &inference_pool_crd().expect("the InferencePool CRD"),
    )
    .await
    .expect("the InferencePool CRD");
    let pool_on = json!({"spec": {"inferencePool": {"enabled": true,
                                                     "endpointPicker": {"name": "epp"}}}});
    llms.patch("smollm2", &PatchParams::default(), &Patch::Merge(&pool_on))
        .await
        .expect("ask for a pool");
    let pools = Api::<DynamicObject>::namespaced_with(
        admin.clone(),
        &app_ns,
        &render::inference_pool_resource(),
    );
    eventually("the operator to make the InferencePool", WAIT, || async {
        pools.get_opt("smollm2").await.map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // A model split into stages becomes LeaderWorkerSet groups with their Secret, through
    // exactly the chart's verbs on them.
    let mut staged = example("pipeline-parallel-cpu.yaml");
    // One fake node here: the stages may share it.
    if let Some(p) = staged.spec.pod.as_mut() {
        p.stage_topology_key = None;
    }
    llms.create(&PostParams::default(), &staged)
        .await
        .expect("pipeline example accepted");
    wait_ready(&llms, "smollm2-pp").await;
    Api::<DynamicObject>::namespaced_with(admin.clone(), &app_ns, &render::lws_resource())
        .get("smollm2-pp-stages")
        .await
        .expect("the LeaderWorkerSet");
    Api::<Secret>::namespaced(admin.clone(), &app_ns)
        .get("smollm2-pp-group-secret")
        .await
        .expect("the group Secret");

    // Anything outside the ClusterRole is refused.
    let as_operator = |ns: &str| Api::<LLMService>::namespaced(operator_client.clone(), ns);
    forbidden(
        "reading Secrets",
        Api::<Secret>::namespaced(operator_client.clone(), &app_ns)
            .list(&Default::default())
            .await,
    );
    forbidden(
        "deleting an LLMService",
        as_operator(&app_ns)
            .delete("smollm2", &DeleteParams::default())
            .await,
    );
    forbidden(
        "changing an LLMService's spec",
        as_operator(&app_ns)
            .patch(
                "smollm2",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 3}})),
            )
            .await,
    );
    forbidden(
        "deleting the engine Service",
        Api::<Service>::namespaced(operator_client.clone(), &app_ns)
            .delete("smollm2", &DeleteParams::default())
            .await,
    );

    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "escalate"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": "ferrite", "namespace": release_ns}],
    }))
    .expect("crb");
    forbidden(
        "binding itself to cluster-admin",
        Api::<ClusterRoleBinding>::all(operator_client.clone())
            .create(&PostParams::default(), &crb)
            .await,
    );

    // The router, with the chart's args and as its own ServiceAccount: it lists the models
    // (LLMServices and EndpointSlices watched), and asks for a replica of one at zero through
    // its status — and can do nothing else.
    let router_client = cluster
        .client_as(
            &format!("system:serviceaccount:{release_ns}:ferrite-router"),
            &[
                "system:serviceaccounts",
                &format!("system:serviceaccounts:{release_ns}"),
                "system:authenticated",
            ],
        )
        .await
        .expect("impersonating client");
    let router_args = deployment_args(&objects, "ferrite-router");
    let router_opts = ferrite_router::cli::Args::try_parse_from(
        std::iter::once("ferrite-router".to_string()).chain(router_args),
    )
    .unwrap_or_else(|e| panic!("the chart's args are not the router's flags: {e}"))
    .into_options();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router_url = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop_router, rx) = tokio::sync::oneshot::channel::<()>();
    let rc = router_client.clone();
    let router = tokio::spawn(async move {
        ferrite_router::run(rc, router_opts, listener, async move {
            let _ = rx.await;
        })
        .await
    });
    let http = reqwest::Client::new();
    // It serves once both watches have listed, so an answer at all shows it may list them.
    eventually("the router to list the model", WAIT, || async {
        let get = http
            .get(format!("{router_url}/v1/models"))
            .timeout(Duration::from_secs(5));
        let models = match get.send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(e) => return Err(e.to_string()),
        };
        Ok(models.contains("\"smollm2\"").then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let idle: LLMService = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "idle"},
        "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "replicas": 0,
                 "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "targetQueueDepth": 4}},
    }))
    .expect("LLMService");
    llms.create(&PostParams::default(), &idle)
        .await
        .expect("an LLMService at zero");
    // Asked until the router has seen the new LLMService (a 404 before) and holds the request.
    let held = tokio::spawn({
        let (http, url) = (http.clone(), router_url.clone());
        async move {
            loop {
                let _ = http
                    .post(format!("{url}/v1/chat/completions"))
                    .json(
                        &json!({"model": "idle", "messages": [{"role": "user", "content": "hi"}]}),
                    )
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    eventually("the router to ask for a replica of idle", WAIT, || async {
        let s = llms.get("idle").await.map_err(|e| e.to_string())?;
        let asked = s
            .status
            .and_then(|st| st.autoscaling)
            .and_then(|a| a.activation_requested_at);
        Ok(asked.map(|_| ()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    held.abort();
    let as_router = Api::<LLMService>::namespaced(router_client.clone(), &app_ns);
    forbidden(
        "the router changing an LLMService's spec",
        as_router
            .patch(
                "idle",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 1}})),
            )
            .await,
    );
    forbidden(
        "the router listing pods",
        Api::<Pod>::namespaced(router_client.clone(), &app_ns)
            .list(&Default::default())
            .await,
    );
    forbidden(
        "the router reading Secrets",
        Api::<Secret>::namespaced(router_client.clone(), &app_ns)
            .list(&Default::default())
            .await,
    );
    forbidden(
        "the router reading Deployments",
        Api::<Deployment>::namespaced(router_client, &app_ns)
            .get("smollm2")
            .await,
    );
    let _ = stop_router.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), router).await;
    stop(tx, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaced_install_serves_its_namespace_and_nothing_else() {
    let cluster = TestCluster::shared();
    let admin = cluster.client().await.expect("client");
    install_crds(&admin, &root().join("charts/ferrite/crds/llmservice.yaml"))
        .await
        .expect("CRD");
    // values-custom.yaml watches team-a; monitors off here (no prometheus-operator CRDs).
    ensure_namespace(&admin, "team-a").await.expect("team-a");
    let release_ns = cluster.namespace(&admin, "platform").await.expect("ns");
    let objects = render(
        &release_ns,
        Some(&root().join("tests/chart/values-custom.yaml")),
        Some(json!({"metrics": {"service": true}})),
    );
    assert!(objects.iter().all(|o| o["kind"] != "ClusterRole"));
    for obj in &objects {
        apply(&admin, obj, &release_ns, "helm")
            .await
            .unwrap_or_else(|e| panic!("{} {} refused: {e}", obj["kind"], obj["metadata"]["name"]));
    }
    let sa = format!("system:serviceaccount:{release_ns}:ferrite-controller");
    let operator_client = cluster
        .client_as(&sa, &["system:serviceaccounts", "system:authenticated"])
        .await
        .expect("impersonating client");
    let (tx, task) = start_operator(
        operator_client.clone(),
        &container_args(&objects),
        &release_ns,
    );

    let watched = Api::<LLMService>::namespaced(admin.clone(), "team-a");
    watched
        .create(&PostParams::default(), &example("smollm2-cpu.yaml"))
        .await
        .expect("example");
    wait_ready(&watched, "smollm2").await;
    // Another namespace is out of its reach: the Role grants nothing there.
    let other = cluster.namespace(&admin, "team-b").await.expect("ns");
    forbidden(
        "listing LLMServices outside the watched namespace",
        Api::<LLMService>::namespaced(operator_client.clone(), &other)
            .list(&Default::default())
            .await,
    );
    forbidden(
        "listing LLMServices cluster-wide",
        Api::<LLMService>::all(operator_client.clone())
            .list(&Default::default())
            .await,
    );
    stop(tx, task).await;
}
