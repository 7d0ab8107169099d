//! The autoscaler against a real control plane: kwok gives the pods loopback IPs, one local
//! server answers `/metrics` for all of them with a load the test sets, and the operator must
//! scale the Deployment (never the spec), record status and Events, and come back down — and
//! for a model split into stages, scale the LeaderWorkerSet's groups, scraping leaders only.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use ferrite_crds::LLMService;
use ferrite_operator::{autoscale, render, Options};
use ferrite_testcluster::{eventually, install_crds, Options as ClusterOptions, TestCluster};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

fn engine_metrics(waiting: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} 4\n\
         # TYPE vllm:time_to_first_token_seconds histogram\n\
         vllm:time_to_first_token_seconds_bucket{{model_name=\"m\",le=\"0.1\"}} 0\n\
         vllm:time_to_first_token_seconds_bucket{{model_name=\"m\",le=\"+Inf\"}} 0\n\
         vllm:time_to_first_token_seconds_sum{{model_name=\"m\"}} 0\n\
         vllm:time_to_first_token_seconds_count{{model_name=\"m\"}} 0\n"
    )
}

/// A cluster whose pods get addresses in `cidr` (all answered by `app` on 0.0.0.0:<port>),
/// the CRD, a fresh namespace, and the operator there scraping `<pod>:<port>` every second.
/// Returns the cluster, a client, the namespace, and what stops the operator.
async fn setup(
    cidr: &str,
    app: Router,
) -> (
    TestCluster,
    kube::Client,
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), ferrite_operator::Error>>,
) {
    let cidr = cidr.to_string();
    let cluster = tokio::task::spawn_blocking(move || {
        TestCluster::start_with(ClusterOptions {
            pod_cidr: cidr,
            ..ClusterOptions::default()
        })
    })
    .await
    .expect("join")
    .expect("cluster");
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = cluster.client().await.expect("client");
    let crd = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    install_crds(&client, &crd).await.expect("CRD");
    let ns = cluster
        .namespace(&client, "autoscale")
        .await
        .expect("namespace");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let opts = Options {
        namespace: Some(ns.clone()),
        engine_image: "ferrite-engine:test".into(),
        leader_election: false,
        autoscale: autoscale::Settings {
            interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_secs(1),
            metrics_port: port,
        },
        ..Options::default()
    };
    let c = client.clone();
    let operator = tokio::spawn(async move {
        ferrite_operator::run(c, opts, async move {
            let _ = rx.await;
        })
        .await
    });
    (cluster, client, ns, stop, operator)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaler_scales_the_deployment_not_the_spec() {
    // Pods get 127.1.0.x addresses, all answered by one server on 0.0.0.0:<port>.
    let waiting = Arc::new(AtomicU32::new(6));
    let w = waiting.clone();
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let w = w.clone();
            async move { engine_metrics(w.load(Ordering::Relaxed)) }
        }),
    );
    let (cluster, client, ns, stop, operator) = setup("127.1.0.0/24", app).await;

    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    let svc: LLMService = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "auto"},
        "spec": {
            "model": {"source": "file:///models/m.gguf"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
                            "scaleDownStabilizationSeconds": 3},
        },
    }))
    .expect("LLMService");
    let created = api
        .create(&PostParams::default(), &svc)
        .await
        .expect("create");
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);

    // 6 waiting per replica against a target of 2: 1 -> 2 -> 4 (x2 per interval), capped at 4.
    let up = eventually(
        "the autoscaler to scale the Deployment to 4",
        WAIT,
        || async {
            let d = deployments
                .get_opt("auto")
                .await
                .map_err(|e| e.to_string())?;
            let r = d.and_then(|d| d.spec).and_then(|s| s.replicas);
            let s = api.get("auto").await.map_err(|e| e.to_string())?;
            Ok((r == Some(4)).then_some(s))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log_tail("kwok", 2000)));
    let st = up.status.clone().expect("status");
    assert_eq!(st.desired_replicas, Some(4));
    let auto = st.autoscaling.clone().expect("autoscaling status");
    let reason = auto.last_scale_reason.clone().expect("reason");
    assert!(
        reason.starts_with("scaled 2 -> 4: queue 6 per replica > target 2"),
        "{reason}"
    );
    assert!(auto.last_scale_time.is_some());
    assert_eq!(up.spec, created.spec, "the autoscaler must not write spec");
    assert_eq!(up.metadata.generation, created.metadata.generation);
    let limited = eventually(
        "ScalingLimited once 4 replicas still see the queue",
        WAIT,
        || async {
            let s = api.get("auto").await.map_err(|e| e.to_string())?;
            let c = s
                .status
                .unwrap_or_default()
                .conditions
                .into_iter()
                .find(|c| c.type_ == "ScalingLimited" && c.status == "True");
            Ok(c)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        limited.message.contains("limited to maxReplicas 4"),
        "{}",
        limited.message
    );
    let events = Api::<Event>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .expect("events");
    let notes: Vec<String> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Autoscaled"))
        .filter_map(|e| e.message.clone())
        .collect();
    assert!(
        notes.iter().any(|n| n.starts_with("scaled 1 -> 2")),
        "{notes:?}"
    );

    // The load goes away: back to minReplicas once the stabilization window has passed.
    waiting.store(0, Ordering::Relaxed);
    eventually("the autoscaler to scale back to 1", WAIT, || async {
        let d = deployments.get("auto").await.map_err(|e| e.to_string())?;
        Ok((d.spec.and_then(|s| s.replicas) == Some(1)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let s = api.get("auto").await.expect("get");
    assert_eq!(s.spec, created.spec);
    assert!(s
        .status
        .and_then(|s| s.autoscaling)
        .and_then(|a| a.last_scale_reason)
        .is_some_and(|r| r.contains("-> 1")));
    let _ = stop.send(());
    let _ = operator.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaler_moves_groups_and_scrapes_only_their_leaders() {
    // Which pod addresses were scraped, from the Host header of each scrape.
    let scraped = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let seen = scraped.clone();
    let app = Router::new().route(
        "/metrics",
        get(move |headers: axum::http::HeaderMap| {
            let seen = seen.clone();
            async move {
                if let Some(host) = headers.get("host").and_then(|h| h.to_str().ok()) {
                    let ip = host.split(':').next().unwrap_or(host).to_string();
                    seen.lock().expect("lock").insert(ip);
                }
                engine_metrics(6)
            }
        }),
    );
    let (_cluster, client, ns, stop, operator) = setup("127.2.0.0/24", app).await;
    let api = Api::<LLMService>::namespaced(client.clone(), &ns);
    let svc: LLMService = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "staged"},
        "spec": {
            "model": {"source": "file:///models/m.gguf"},
            "engine": {"pipelineParallelSize": 2},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 2},
        },
    }))
    .expect("LLMService");
    api.create(&PostParams::default(), &svc)
        .await
        .expect("create");
    let lws = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &render::lws_resource());
    eventually("the autoscaler to scale to 2 groups", WAIT, || async {
        let l = lws
            .get_opt("staged-stages")
            .await
            .map_err(|e| e.to_string())?;
        let replicas = l.map(|l| l.data["spec"]["replicas"].clone());
        Ok((replicas == Some(json!(2))).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // Two groups ready, then a few more scrapes; only leaders' addresses are ever asked.
    eventually("both groups' pods to have addresses", WAIT, || async {
        let s = api.get("staged").await.map_err(|e| e.to_string())?;
        let ready = s.status.and_then(|s| s.ready_replicas);
        Ok((ready == Some(2)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&render::engine_pods_selector("staged")))
        .await
        .expect("pods")
        .items;
    let ip_of = |role: &str| -> BTreeSet<String> {
        pods.iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("serving.ferrite.dev/role"))
                    .map(String::as_str)
                    == Some(role)
            })
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .collect()
    };
    let (leaders, workers) = (ip_of("leader"), ip_of("worker"));
    assert_eq!((leaders.len(), workers.len()), (2, 2), "{pods:?}");
    let scraped = scraped.lock().expect("lock").clone();
    assert!(
        scraped.is_subset(&leaders),
        "scraped {scraped:?}, leaders {leaders:?}"
    );
    assert!(
        scraped.is_disjoint(&workers),
        "scraped a worker: {scraped:?}"
    );
    assert_eq!(scraped, leaders, "every leader is scraped");
    let _ = stop.send(());
    let _ = operator.await;
}
