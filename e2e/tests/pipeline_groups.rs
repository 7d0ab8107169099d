//! A pipeline-parallel LLMService end to end with real engines. The operator renders the
//! LeaderWorkerSet; LWS's controller and webhook (in the test control plane) make the group's
//! pods and their environment; kwok plays their nodes. The test then plays the kubelet: it
//! starts one `ferrite-engine` per pod with exactly the pod's arguments and environment, the
//! `$(VAR)` references expanded from it as a kubelet does, the pod's Secret volume written to
//! a file, and — since the pods share this host's network — the leader's DNS name resolved to
//! loopback and each pod's ports mapped to free loopback ports. The group must serve a single
//! engine's greedy completion through the pod the Service selects, and a killed worker must be
//! reported in the LLMService's status, naming its rank, once the kubelet reports it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferrite_crds::LLMService;
use ferrite_e2e::{free_port, KillOnDrop};
use ferrite_operator::Options;
use ferrite_testcluster::{eventually, install_crds, TestCluster};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(180);

/// An engine process, killed when the test ends however it ends, and its log.
struct Engine {
    child: KillOnDrop,
    log: PathBuf,
}

impl Engine {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn spawn(args: &[String], env: &HashMap<String, String>, log: &Path) -> Engine {
    let out = std::fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(ferrite_e2e::engine_bin())
        .args(args)
        .envs(env)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("ferrite-engine starts");
    Engine {
        child: KillOnDrop(child),
        log: log.to_path_buf(),
    }
}

/// `$(NAME)` references in `arg` replaced from `env`, as the kubelet expands a container's
/// arguments.
fn expand(arg: &str, env: &HashMap<String, String>) -> String {
    let mut out = arg.to_string();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// How this host stands in for the pods' network and volumes.
struct Host {
    /// Each DNS name a pod's arguments may name, resolved to loopback.
    names: Vec<String>,
    /// A pod's own ports (`--port`) to free loopback ports.
    api_port: u16,
    /// The group's port (`--master-port`), the same for every rank.
    group_port: u16,
    /// Where the pod's group Secret volume is written.
    secret_file: PathBuf,
}

/// The command line of `pod`'s engine container on this host, and its environment.
fn command_line(pod: &Pod, host: &Host) -> (Vec<String>, HashMap<String, String>) {
    let c = &pod.spec.as_ref().expect("pod spec").containers[0];
    let env: HashMap<String, String> = c
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let mut args: Vec<String> = c.args.iter().flatten().map(|a| expand(a, &env)).collect();
    for a in &mut args {
        if host.names.contains(a) {
            *a = "127.0.0.1".into();
        }
    }
    for i in 0..args.len().saturating_sub(1) {
        let value = match args[i].as_str() {
            "--host" => "127.0.0.1".to_string(),
            "--port" => host.api_port.to_string(),
            "--master-port" => host.group_port.to_string(),
            "--group-secret-file" => host.secret_file.display().to_string(),
            _ => continue,
        };
        args[i + 1] = value;
    }
    (args, env)
}

async fn complete(http: &reqwest::Client, base: &str) -> String {
    let body = json!({"model": "smollm2", "prompt": "The capital of France is",
                      "max_tokens": 16, "temperature": 0});
    let resp: Value = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("completion request")
        .json()
        .await
        .expect("completion JSON");
    resp["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {resp}"))
        .to_string()
}

async fn health(http: &reqwest::Client, base: &str) -> Option<u16> {
    let r = http.get(format!("{base}/health")).send().await.ok()?;
    Some(r.status().as_u16())
}

async fn wait_health(http: &reqwest::Client, base: &str, want: u16, who: &Engine) {
    let deadline = Instant::now() + WAIT;
    while health(http, base).await != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{base}/health never answered {want}:\n{}",
            who.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_started_from_its_pods_serves_one_engines_tokens_and_a_lost_worker_is_reported() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let crd = ferrite_e2e::workspace().join("crds/llmservice.yaml");
    install_crds(&client, &crd).await.expect("CRD");
    let ns = cluster.namespace(&client, "pp-e2e").await.expect("ns");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let opts = Options {
        namespace: Some(ns.clone()),
        engine_image: "ferrite-engine:test".into(),
        leader_election: false,
        ..Options::default()
    };
    let operator = tokio::spawn(ferrite_operator::run(client.clone(), opts, async move {
        let _ = rx.await;
    }));

    let model = ferrite_e2e::default_model();
    let svc: LLMService = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "split"},
        "spec": {
            "model": {"source": format!("file://{}", model.display()), "servedName": "smollm2"},
            "engine": {"pipelineParallelSize": 2, "maxModelLen": 256, "maxNumSeqs": 4},
        },
    }))
    .expect("LLMService");
    let llms = Api::<LLMService>::namespaced(client.clone(), &ns);
    llms.create(&PostParams::default(), &svc)
        .await
        .expect("create");

    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let (leader_pod, worker_pod) = eventually("the group's two pods", WAIT, || async {
        let leader = pods
            .get_opt("split-stages-0")
            .await
            .map_err(|e| e.to_string())?;
        let worker = pods
            .get_opt("split-stages-0-1")
            .await
            .map_err(|e| e.to_string())?;
        Ok(leader.zip(worker))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let secret = Api::<Secret>::namespaced(client.clone(), &ns)
        .get("split-group-secret")
        .await
        .expect("the group Secret");
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("secret");
    let value = secret
        .data
        .and_then(|d| d.get("secret").cloned())
        .expect("the secret key");
    std::fs::write(&secret_file, &value.0).expect("write the Secret volume");

    let names = vec![format!("split-stages-0.split-stages.{ns}")];
    let group_port = free_port();
    let leader_host = Host {
        names: names.clone(),
        api_port: free_port(),
        group_port,
        secret_file: secret_file.clone(),
    };
    let worker_host = Host {
        names,
        api_port: free_port(),
        group_port,
        secret_file,
    };
    let (leader_args, leader_env) = command_line(&leader_pod, &leader_host);
    let (worker_args, worker_env) = command_line(&worker_pod, &worker_host);
    assert!(
        worker_args.contains(&"--headless".to_string()),
        "{worker_args:?}"
    );
    assert_eq!(
        worker_env.get("LWS_WORKER_INDEX").map(String::as_str),
        Some("1")
    );
    let leader = spawn(&leader_args, &leader_env, &dir.path().join("leader.log"));
    let worker = spawn(&worker_args, &worker_env, &dir.path().join("worker.log"));

    // The Service's endpoint is the leader's pod: that pod's port on this host.
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), &ns);
    let ip = eventually("the Service's endpoint", WAIT, || async {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=split"))
            .await
            .map_err(|e| e.to_string())?;
        let ips: Vec<String> = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flat_map(|e| e.addresses.clone()))
            .collect();
        Ok((ips.len() == 1).then(|| ips[0].clone()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let leader_ip = pods
        .get("split-stages-0")
        .await
        .expect("the leader pod")
        .status
        .and_then(|s| s.pod_ip);
    assert_eq!(Some(ip), leader_ip, "the Service selects the leader");
    let base = format!("http://127.0.0.1:{}", leader_host.api_port);
    let http = reqwest::Client::new();
    wait_health(&http, &base, 200, &leader).await;

    // One engine with the same model and limits.
    let port = free_port();
    let single_args: Vec<String> = [
        "serve",
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
    ]
    .map(String::from)
    .into();
    let single = spawn(
        &single_args,
        &HashMap::new(),
        &dir.path().join("single.log"),
    );
    let single_base = format!("http://127.0.0.1:{port}");
    wait_health(&http, &single_base, 200, &single).await;
    let want = complete(&http, &single_base).await;
    drop(single);
    assert_eq!(complete(&http, &base).await, want, "{}", leader.output());

    // Stage 1 dies. The kubelet reports the exit with the end of its log
    // (FallbackToLogsOnError), and the operator names the rank.
    let mut worker = worker;
    worker.child.0.kill().expect("kill the worker");
    let code = worker.child.0.wait().expect("wait").code().unwrap_or(137);
    let tail: String = {
        let out = worker.output();
        let lines: Vec<&str> = out.lines().collect();
        lines[lines.len().saturating_sub(5)..].join("\n")
    };
    let status = json!({"status": {
        "conditions": [{"type": "Ready", "status": "False"},
                       {"type": "ContainersReady", "status": "False"}],
        "containerStatuses": [{
            "name": "engine", "image": "ferrite-engine:test", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": "Error", "message": tail}},
        }],
    }});
    pods.patch_status(
        "split-stages-0-1",
        &PatchParams::default(),
        &Patch::Strategic(&status),
    )
    .await
    .expect("report the exit");
    let ready = eventually("status to report the lost rank", WAIT, || async {
        let s = llms.get("split").await.map_err(|e| e.to_string())?;
        let c = s
            .status
            .as_ref()
            .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready").cloned());
        Ok(c.filter(|c| c.status == "False" && c.message.contains("rank 1")))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        ready.message.contains("rank 1 (pod split-stages-0-1)"),
        "{}",
        ready.message
    );
    // The leader itself says its group is gone, at the latest when a request needs stage 1.
    let _ = http
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "smollm2", "prompt": "Hello", "max_tokens": 4}))
        .send()
        .await;
    wait_health(&http, &base, 500, &leader).await;
    assert!(
        leader.output().contains("lost rank 1"),
        "{}",
        leader.output()
    );
    drop(leader);
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), operator).await;
}
