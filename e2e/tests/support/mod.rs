//! A cluster in which LLMServices are served by real engines: a control plane whose kwok
//! nodes give pods addresses from a private range this host answers for (a `local` route on
//! `lo`: EndpointSlices refuse loopback addresses), the operator, the router, and a stand-in
//! kubelet that starts a real `ferrite-engine` on each engine pod's address (port 8000) and
//! stops it when the pod goes.

#![allow(dead_code)]

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use ferrite_e2e::{default_model, engine_bin, workspace, KillOnDrop};
use ferrite_testcluster::{eventually, install_crds, Options as ClusterOptions, TestCluster};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::ResourceExt;
use serde_json::{json, Value};

/// How long anything in these tests may take to happen.
pub const WAIT: Duration = Duration::from_secs(180);

/// An engine the stand-in kubelet runs for a pod.
pub struct Engine {
    /// `http://<pod IP>:8000`.
    pub url: String,
    /// The LLMService the pod belongs to.
    pub llmservice: String,
    /// The model names the pod's container serves, sorted.
    pub served: Vec<String>,
    process: KillOnDrop,
}

/// A `local` route that makes this host answer every address of a range, removed on drop.
struct LocalRoute(String);

impl LocalRoute {
    fn add(cidr: &str) -> Self {
        let out = Command::new("ip")
            .args(["route", "replace", "local", cidr, "dev", "lo"])
            .output();
        match out {
            Ok(o) if o.status.success() => LocalRoute(cidr.to_string()),
            Ok(o) => panic!(
                "this test serves the pods' addresses ({cidr}) from this host and needs \
                 `ip route replace local {cidr} dev lo` (root or CAP_NET_ADMIN): {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => panic!("this test needs iproute2's `ip` to route {cidr} to this host: {e}"),
        }
    }
}

impl Drop for LocalRoute {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["route", "del", "local", &self.0, "dev", "lo"])
            .output();
    }
}

/// Everything a test talks to.
pub struct Harness {
    /// The control plane.
    pub cluster: TestCluster,
    /// An admin client.
    pub client: kube::Client,
    /// The test's namespace.
    pub ns: String,
    /// The router's base URL.
    pub router: String,
    /// Engines by pod name.
    pub engines: Arc<Mutex<HashMap<String, Engine>>>,
    stop_operator: Option<tokio::sync::oneshot::Sender<()>>,
    stop_router: Option<tokio::sync::oneshot::Sender<()>>,
    kubelet: tokio::task::JoinHandle<()>,
    _route: LocalRoute,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.kubelet.abort();
        let _ = self.stop_operator.take().map(|s| s.send(()));
        let _ = self.stop_router.take().map(|s| s.send(()));
    }
}

/// The names a pod's engine container serves (`--served-model-name` and what follows).
fn served_names(pod: &Pod) -> Vec<String> {
    let args = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default();
    args.iter()
        .skip_while(|a| *a != "--served-model-name")
        .skip(1)
        .take_while(|a| !a.starts_with("--"))
        .cloned()
        .collect()
}

/// Starts the default model as `pod`'s engine on its IP, port 8000.
fn start_engine(pod: &Pod, ip: &str, log_dir: &std::path::Path) -> std::io::Result<KillOnDrop> {
    let log = std::fs::File::create(log_dir.join(format!("{}.log", pod.name_any())))?;
    let mut cmd = Command::new(engine_bin());
    cmd.args(["serve", "--model"])
        .arg(default_model())
        .arg("--served-model-name")
        .args(served_names(pod))
        .args(["--host", ip, "--port", "8000", "--max-model-len", "1024"])
        .args(["--kv-cache-memory", "60000000", "--shutdown-timeout", "2"])
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log));
    cmd.spawn().map(KillOnDrop)
}

/// Runs an engine for each engine pod of `ns` that has an address, and stops those whose
/// pod is gone, until aborted.
async fn kubelet(
    client: kube::Client,
    ns: String,
    engines: Arc<Mutex<HashMap<String, Engine>>>,
    log_dir: std::path::PathBuf,
) {
    let pods: Api<Pod> = Api::namespaced(client, &ns);
    let lp = ListParams::default().labels("app.kubernetes.io/name=ferrite-engine");
    loop {
        if let Ok(list) = pods.list(&lp).await {
            let live: Vec<&Pod> = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .collect();
            let mut map = engines.lock().expect("engines");
            map.retain(|name, _| live.iter().any(|p| &p.name_any() == name));
            for pod in live {
                let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
                    continue;
                };
                if map.contains_key(&pod.name_any()) {
                    continue;
                }
                match start_engine(pod, &ip, &log_dir) {
                    Ok(process) => {
                        let llmservice = pod
                            .labels()
                            .get("app.kubernetes.io/instance")
                            .cloned()
                            .unwrap_or_default();
                        map.insert(
                            pod.name_any(),
                            Engine {
                                url: format!("http://{ip}:8000"),
                                llmservice,
                                served: {
                                    let mut names = served_names(pod);
                                    names.sort();
                                    names
                                },
                                process,
                            },
                        );
                    }
                    Err(e) => eprintln!("cannot start an engine for {}: {e}", pod.name_any()),
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The test Python (with the openai SDK): `FERRITE_PYTHON`, else the one `make test` uses.
pub fn python() -> String {
    if let Ok(p) = std::env::var("FERRITE_PYTHON") {
        return p;
    }
    let out = Command::new(workspace().join("scripts/python-env.sh"))
        .output()
        .expect("scripts/python-env.sh runs");
    assert!(out.status.success(), "python-env.sh failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A cluster whose pods get addresses in `cidr` (routed to this host), the CRD, a namespace, the operator
/// (autoscaling every second), the router started with `router_args`, and the kubelet.
pub async fn start(cidr: &str, router_args: &[&str]) -> Harness {
    start_with(cidr, router_args, None).await
}

/// [`start`], with the operator's `/metrics` served on `operator_metrics` when given.
pub async fn start_with(
    cidr: &str,
    router_args: &[&str],
    operator_metrics: Option<std::net::SocketAddr>,
) -> Harness {
    let route = LocalRoute::add(cidr);
    let cidr = cidr.to_string();
    let cluster = tokio::task::spawn_blocking(move || {
        TestCluster::start_with(ClusterOptions {
            pod_cidr: cidr,
            leaderworkerset: false,
            ..ClusterOptions::default()
        })
    })
    .await
    .expect("join")
    .expect("cluster");
    let client = cluster.client().await.expect("client");
    install_crds(&client, &workspace().join("crds/llmservice.yaml"))
        .await
        .expect("CRD");
    let ns = cluster
        .namespace(&client, "router")
        .await
        .expect("namespace");

    let (stop_operator, rx) = tokio::sync::oneshot::channel::<()>();
    let opts = ferrite_operator::Options {
        namespace: Some(ns.clone()),
        engine_image: "ferrite-engine:test".into(),
        leader_election: false,
        metrics_addr: operator_metrics,
        autoscale: ferrite_operator::autoscale::Settings {
            interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_secs(1),
            metrics_port: 8000,
        },
        ..ferrite_operator::Options::default()
    };
    let c = client.clone();
    tokio::spawn(async move {
        let _ = ferrite_operator::run(c, opts, async move {
            let _ = rx.await;
        })
        .await;
    });

    let mut argv = vec!["ferrite-router", "--namespace", &ns];
    argv.extend(router_args);
    let router_opts = ferrite_router::cli::Args::try_parse_from(&argv)
        .expect("router flags")
        .into_options();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let router = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop_router, rx) = tokio::sync::oneshot::channel::<()>();
    let c = client.clone();
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = rx.await;
        };
        if let Err(e) = ferrite_router::run(c, router_opts, listener, shutdown).await {
            eprintln!("router: {e}");
        }
    });

    let engines = Arc::new(Mutex::new(HashMap::new()));
    let log_dir = workspace().join("target").join(format!("e2e-{ns}"));
    std::fs::create_dir_all(&log_dir).expect("log dir");
    let kubelet = tokio::spawn(kubelet(
        client.clone(),
        ns.clone(),
        Arc::clone(&engines),
        log_dir,
    ));
    Harness {
        cluster,
        client,
        ns,
        router,
        engines,
        stop_operator: Some(stop_operator),
        stop_router: Some(stop_router),
        kubelet,
        _route: route,
    }
}

impl Harness {
    /// Creates an LLMService from its manifest (namespace filled in).
    pub async fn create(&self, manifest: Value) {
        let api: Api<ferrite_crds::LLMService> = Api::namespaced(self.client.clone(), &self.ns);
        let svc = serde_json::from_value(manifest).expect("an LLMService");
        api.create(&PostParams::default(), &svc)
            .await
            .expect("create the LLMService");
    }

    /// The URLs of `llmservice`'s engines, once `n` of the processes this harness started
    /// are running, answer `/health` and list their pod's model names: an address answered
    /// by some other process (one left over from another run, say) never counts.
    pub async fn healthy_engines(&self, llmservice: &str, n: usize) -> Vec<String> {
        let http = reqwest::Client::new();
        eventually(
            &format!("{n} healthy engines of {llmservice}"),
            WAIT,
            || {
                let mut problems = Vec::new();
                let engines: Vec<(String, Vec<String>)> = self
                    .engines
                    .lock()
                    .expect("engines")
                    .values_mut()
                    .filter(|e| e.llmservice == llmservice)
                    .filter_map(|e| match e.process.0.try_wait() {
                        Ok(None) => Some((e.url.clone(), e.served.clone())),
                        Ok(Some(status)) => {
                            problems.push(format!(
                                "the engine started for {} exited ({status}; its log is \
                                 under target/e2e-{})",
                                e.url, self.ns
                            ));
                            None
                        }
                        Err(err) => {
                            problems.push(format!("the engine for {}: {err}", e.url));
                            None
                        }
                    })
                    .collect();
                let http = http.clone();
                async move {
                    let mut healthy = Vec::new();
                    for (url, served) in engines {
                        let up = http
                            .get(format!("{url}/health"))
                            .timeout(Duration::from_secs(1))
                            .send()
                            .await
                            .is_ok_and(|r| r.status().is_success());
                        if !up {
                            continue;
                        }
                        let mut names = model_ids(&http, &url).await;
                        names.sort();
                        if names == served {
                            healthy.push(url);
                        } else {
                            problems.push(format!("{url} serves {names:?}, not {served:?}"));
                        }
                    }
                    healthy.sort();
                    match healthy.len() == n {
                        true => Ok(Some(healthy)),
                        false if problems.is_empty() => Ok(None),
                        false => Err(problems.join("; ")),
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.cluster.log_tail("kwok", 2000)))
    }

    /// Sends the router its shutdown signal (what SIGTERM does to the binary).
    pub fn stop_router(&mut self) {
        let _ = self.stop_router.take().map(|s| s.send(()));
    }

    /// Stops the engine at `url` while its pod stays Ready: the replica refuses connections.
    pub fn kill_engine(&self, url: &str) {
        let mut map = self.engines.lock().expect("engines");
        if let Some(e) = map.values_mut().find(|e| e.url == url) {
            let _ = e.process.0.kill();
            let _ = e.process.0.wait();
        }
    }
}

/// The model ids `/v1/models` at `base` lists, in its order (none if it does not answer).
pub async fn model_ids(http: &reqwest::Client, base: &str) -> Vec<String> {
    let body: Value = match http
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(1))
        .send()
        .await
    {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    body["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// POSTs a chat completion to `base`; its status and JSON body (null when not JSON).
pub async fn chat(http: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let resp = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// Waits until the router routes `model` to a replica that answers.
pub async fn routable(h: &Harness, http: &reqwest::Client, model: &str) {
    ferrite_testcluster::eventually(&format!("the router to serve {model}"), WAIT, || async {
        let (status, _) = chat(
            http,
            &h.router,
            json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        )
        .await;
        Ok((status == 200).then_some(()))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\nendpoint slices: {}",
            std::process::Command::new(ferrite_testcluster::binaries_dir().expect("binaries").join("kubectl"))
                .args(["--kubeconfig"])
                .arg(h.cluster.kubeconfig_path())
                .args(["get", "endpointslices", "-o", "yaml", "-n", &h.ns])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        )
    });
}

/// One counter or gauge of an engine's (or the router's) `/metrics`, summed over its label
/// sets whose labels contain `labels`.
pub async fn metric(http: &reqwest::Client, base: &str, name: &str, labels: &str) -> f64 {
    let text = match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0.0,
    };
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let bare = series.split('{').next()?;
            (bare == name && series.contains(labels)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
