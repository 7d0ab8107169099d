//! Ferrite's operator: turns `LLMService` objects into engine Deployments (or, for models
//! split into pipeline stages, LeaderWorkerSet groups), Services and PodDisruptionBudgets,
//! keeps their status honest, and elects one leader among its replicas.

#![forbid(unsafe_code)]

pub mod autoscale;
pub mod cli;
pub mod error;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod render;
pub mod status;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferrite_crds::LLMService;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DynamicObject};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, Controller};
use kube::{Client, ResourceExt};

pub use error::Error;
use reconcile::Context;
use render::{RenderConfig, ENGINE_PODS_SELECTOR, LLMSERVICE_LABEL};

/// How the operator runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    /// Default engine image.
    pub engine_image: String,
    /// Seconds engines drain in-flight requests after SIGTERM.
    pub drain_timeout_seconds: i64,
    /// Where `/metrics`, `/healthz` and `/readyz` listen; `None` serves nothing.
    pub metrics_addr: Option<SocketAddr>,
    /// Elect a leader through a Lease before reconciling.
    pub leader_election: bool,
    /// Namespace of the Lease.
    pub lease_namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This replica's identity in the Lease (the pod name).
    pub identity: String,
    /// How long a lease holds without renewal.
    pub lease_duration: Duration,
    /// Autoscaler timing and the engines' metrics port.
    pub autoscale: autoscale::Settings,
    /// Give every LLMService an InferencePool (where that API is installed) unless its spec
    /// says otherwise.
    pub inference_pools: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            namespace: None,
            engine_image: RenderConfig::default().engine_image,
            drain_timeout_seconds: 30,
            metrics_addr: None,
            leader_election: true,
            lease_namespace: "default".into(),
            lease_name: "ferrite-operator".into(),
            identity: "ferrite-operator".into(),
            lease_duration: Duration::from_secs(15),
            autoscale: autoscale::Settings::default(),
            inference_pools: false,
        }
    }
}

/// Runs the operator until `shutdown` resolves (graceful: the lease is released) or leadership
/// is lost (an error: the process should exit and restart as a standby).
pub async fn run(
    client: Client,
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let metrics = metrics::Metrics::new().map_err(|e| Error::Leader(format!("metrics: {e}")))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    if let Some(addr) = opts.metrics_addr {
        let m = metrics.clone();
        let mut rx = stop_rx.clone();
        let server = metrics::serve(addr, m, async move {
            let _ = rx.wait_for(|s| *s).await;
        });
        tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, %addr, "metrics server failed");
            }
        });
    }

    let lock = opts.leader_election.then(|| {
        leader::LeaseLock::new(
            client.clone(),
            &opts.lease_namespace,
            &opts.lease_name,
            &opts.identity,
            opts.lease_duration,
        )
    });
    metrics.set_ready(true);
    let mut stop_wait = stop_rx.clone();
    if let Some(lock) = &lock {
        tracing::info!(identity = lock.identity(), lease = %opts.lease_name, "waiting for leadership");
        tokio::select! {
            r = lock.acquire() => r?,
            _ = stop_wait.wait_for(|s| *s) => return Ok(()),
        }
        tracing::info!(identity = lock.identity(), "leading");
    }

    let ctx = Arc::new(Context::new(
        client.clone(),
        RenderConfig {
            engine_image: opts.engine_image.clone(),
            drain_timeout_seconds: opts.drain_timeout_seconds,
            inference_pools: opts.inference_pools,
        },
        Recorder::new(
            client.clone(),
            Reporter {
                controller: "ferrite-operator".into(),
                instance: Some(opts.identity.clone()),
            },
        ),
        metrics.clone(),
    ));
    let autoscale_metrics = autoscale::AutoscaleMetrics::new(metrics.registry())
        .map_err(|e| Error::Leader(format!("metrics: {e}")))?;
    let autoscaler = tokio::spawn(autoscale::run(
        client.clone(),
        opts.namespace.clone(),
        opts.autoscale.clone(),
        Recorder::new(
            client.clone(),
            Reporter {
                controller: "ferrite-operator".into(),
                instance: Some(opts.identity.clone()),
            },
        ),
        autoscale_metrics,
    ));
    // Stops the autoscaler whenever `run` returns.
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _autoscaler = AbortOnDrop(autoscaler);
    let lws = render::lws_resource();
    let (llms, deployments, services, pods, groups) = match &opts.namespace {
        Some(ns) => (
            Api::<LLMService>::namespaced(client.clone(), ns),
            Api::<Deployment>::namespaced(client.clone(), ns),
            Api::<Service>::namespaced(client.clone(), ns),
            Api::<Pod>::namespaced(client.clone(), ns),
            Api::<DynamicObject>::namespaced_with(client.clone(), ns, &lws),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all_with(client.clone(), &lws),
        ),
    };
    let children = watcher::Config::default().labels(LLMSERVICE_LABEL);
    let controller = Controller::new(llms, watcher::Config::default())
        .owns(deployments, children.clone())
        .owns(services, children.clone())
        // Where LeaderWorkerSet is not installed this watch retries with backoff (and the
        // LLMServices that need it say so in status) until it is.
        .owns_with(groups, lws, children)
        .watches(
            pods,
            watcher::Config::default().labels(ENGINE_PODS_SELECTOR),
            |pod: Pod| {
                let ns = pod.namespace()?;
                let name = pod.labels().get("app.kubernetes.io/instance")?.clone();
                Some(ObjectRef::<LLMService>::new(&name).within(&ns))
            },
        )
        .graceful_shutdown_on(stopped)
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(llmservice = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile failed"),
            }
        });

    match &lock {
        Some(lock) => {
            tokio::select! {
                _ = controller => { lock.release().await; Ok(()) }
                e = lock.keep() => Err(e),
            }
        }
        None => {
            controller.await;
            Ok(())
        }
    }
}
