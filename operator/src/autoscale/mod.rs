//! The autoscaler: every interval, for each autoscaled LLMService, scrape `/metrics` of its
//! ready pods, keep TTFT histogram windows, decide ([`policy::decide`]) and act — by recording
//! the decision in status (`desiredReplicas`), which the reconciler applies to the Deployment.
//! `LLMService.spec` is never written, so a GitOps tool that owns the manifest never fights it.

pub mod policy;

use std::collections::HashMap;
use std::time::Duration;

use ferrite_crds::LLMService;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use serde_json::json;

use crate::render::LLMSERVICE_LABEL;
use crate::status;
use ferrite_util::engine_metrics::{self as window, scrape, EngineSample, PodWindow};
use policy::{decide, Inputs, PodLoad, Recommendation, Targets};

/// The annotation the ReplicaSet controller reads to choose which pods to remove first.
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// Autoscaler settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Time between decisions.
    pub interval: Duration,
    /// Per-pod scrape timeout.
    pub scrape_timeout: Duration,
    /// Port of the engines' `/metrics`.
    pub metrics_port: u16,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(15),
            scrape_timeout: Duration::from_secs(2),
            metrics_port: 8000,
        }
    }
}

/// The autoscaler's metrics, and the replica counts and targets of every LLMService it
/// lists, so dashboards and alerts compare what is wanted with what runs.
#[derive(Clone)]
pub struct AutoscaleMetrics {
    scrape_errors: IntCounterVec,
    decisions: IntCounterVec,
    ttft: GaugeVec,
    queue: GaugeVec,
    recommended: GaugeVec,
    fleet: Fleet,
}

/// Per-LLMService gauges from spec and status, set anew on every listing.
#[derive(Clone)]
struct Fleet {
    desired: GaugeVec,
    replicas: GaugeVec,
    ready: GaugeVec,
    min: GaugeVec,
    max: GaugeVec,
    target_ttft: GaugeVec,
    target_queue: GaugeVec,
    phase: GaugeVec,
}

impl Fleet {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let gauge =
            |name: &str, help: &str, extra: &[&str]| -> Result<GaugeVec, prometheus::Error> {
                let labels: Vec<&str> = ["namespace", "llmservice"]
                    .iter()
                    .chain(extra)
                    .copied()
                    .collect();
                let g = GaugeVec::new(Opts::new(name, help), &labels)?;
                registry.register(Box::new(g.clone()))?;
                Ok(g)
            };
        Ok(Self {
            desired: gauge(
                "ferrite_operator_llmservice_desired_replicas",
                "Replicas (groups, with pipeline stages) an LLMService should run: status.desiredReplicas, else spec.replicas",
                &[],
            )?,
            replicas: gauge(
                "ferrite_operator_llmservice_replicas",
                "Replicas an LLMService's workload has (status.replicas)",
                &[],
            )?,
            ready: gauge(
                "ferrite_operator_llmservice_ready_replicas",
                "Ready replicas of an LLMService (status.readyReplicas)",
                &[],
            )?,
            min: gauge(
                "ferrite_operator_autoscale_min_replicas",
                "spec.autoscaling.minReplicas",
                &[],
            )?,
            max: gauge(
                "ferrite_operator_autoscale_max_replicas",
                "spec.autoscaling.maxReplicas",
                &[],
            )?,
            target_ttft: gauge(
                "ferrite_operator_autoscale_target_ttft_seconds",
                "spec.autoscaling.targetTTFTSeconds, labelled with the quantile it applies to",
                &["quantile"],
            )?,
            target_queue: gauge(
                "ferrite_operator_autoscale_target_queue_depth",
                "spec.autoscaling.targetQueueDepth",
                &[],
            )?,
            phase: gauge(
                "ferrite_operator_llmservice_phase",
                "1 for an LLMService's status.phase",
                &["phase"],
            )?,
        })
    }

    /// Sets every gauge from `list` alone, so LLMServices that are gone disappear.
    fn record(&self, list: &[LLMService]) {
        for g in [
            &self.desired,
            &self.replicas,
            &self.ready,
            &self.min,
            &self.max,
            &self.target_ttft,
            &self.target_queue,
            &self.phase,
        ] {
            g.reset();
        }
        for svc in list {
            let ns = svc.namespace().unwrap_or_default();
            let name = svc.name_any();
            let key = [ns.as_str(), name.as_str()];
            let status = svc.status.clone().unwrap_or_default();
            self.desired
                .with_label_values(&key)
                .set(crate::reconcile::desired_replicas(svc).into());
            self.replicas
                .with_label_values(&key)
                .set(status.replicas.unwrap_or(0).into());
            self.ready
                .with_label_values(&key)
                .set(status.ready_replicas.unwrap_or(0).into());
            if let Some(phase) = &status.phase {
                self.phase.with_label_values(&[&ns, &name, phase]).set(1.0);
            }
            let Some(spec) = &svc.spec.autoscaling else {
                continue;
            };
            let t = Targets::from_spec(spec);
            self.min.with_label_values(&key).set(t.min.into());
            self.max.with_label_values(&key).set(t.max.into());
            if let Some(ttft) = t.ttft_seconds {
                let q = t.ttft_quantile.to_string();
                self.target_ttft
                    .with_label_values(&[&ns, &name, &q])
                    .set(ttft);
            }
            if let Some(q) = t.queue_depth {
                self.target_queue.with_label_values(&key).set(q);
            }
        }
    }
}

impl AutoscaleMetrics {
    /// Registers the autoscaler's metrics.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let scrape_errors = IntCounterVec::new(
            Opts::new(
                "ferrite_operator_scrape_errors_total",
                "Engine /metrics scrapes that failed",
            ),
            &["namespace", "llmservice"],
        )?;
        let decisions = IntCounterVec::new(
            Opts::new(
                "ferrite_operator_autoscale_decisions_total",
                "Autoscaler decisions by direction",
            ),
            &["namespace", "llmservice", "direction", "reason"],
        )?;
        let ttft = GaugeVec::new(
            Opts::new(
                "ferrite_operator_autoscale_ttft_seconds",
                "TTFT at spec.autoscaling.ttftQuantile over windowSeconds, summed over the ready replicas; absent without requests in the window",
            ),
            &["namespace", "llmservice"],
        )?;
        let queue = GaugeVec::new(
            Opts::new(
                "ferrite_operator_autoscale_queue_depth_per_replica",
                "Last computed queue depth per ready replica",
            ),
            &["namespace", "llmservice"],
        )?;
        let recommended = GaugeVec::new(
            Opts::new(
                "ferrite_operator_autoscale_recommended_replicas",
                "Replicas the last interval's signals asked for, before minReplicas and maxReplicas",
            ),
            &["namespace", "llmservice"],
        )?;
        registry.register(Box::new(scrape_errors.clone()))?;
        registry.register(Box::new(decisions.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(queue.clone()))?;
        registry.register(Box::new(recommended.clone()))?;
        Ok(Self {
            scrape_errors,
            decisions,
            ttft,
            queue,
            recommended,
            fleet: Fleet::new(registry)?,
        })
    }
}

/// One LLMService's memory between intervals: a TTFT window per pod and the recent
/// recommendations.
#[derive(Default)]
pub struct ServiceState {
    windows: HashMap<String, PodWindow>,
    history: Vec<Recommendation>,
    /// Each pod's finished-requests counter at its last scrape.
    finished: HashMap<String, f64>,
    /// When a request was last seen (on the caller's clock); unset until the first interval.
    last_activity: Option<f64>,
}

/// What one interval scraped and decided.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// Each endpoint's sample, in order; `None` where the scrape failed.
    pub samples: Vec<Option<EngineSample>>,
    /// TTFT at the target quantile over the window, summed over the endpoints that answered.
    pub ttft: Option<f64>,
    /// The decision.
    pub decision: policy::Decision,
}

impl ServiceState {
    /// One interval: scrapes every endpoint concurrently (`(pod name, metrics URL)`; no URL
    /// means the pod has no IP yet and counts as not scraped), updates the TTFT windows,
    /// forgets pods that are gone, decides and remembers the recommendation. `now` is seconds
    /// on any monotonic clock the caller keeps for this state; `activation` says a request
    /// waits for a replica of a model at zero.
    #[allow(clippy::too_many_arguments)]
    pub async fn evaluate(
        &mut self,
        http: &reqwest::Client,
        targets: &Targets,
        current: i32,
        endpoints: &[(String, Option<String>)],
        now: f64,
        timeout: Duration,
        activation: bool,
    ) -> Evaluation {
        let samples = join_all(endpoints.iter().map(|(_, url)| async move {
            match url {
                Some(u) => scrape(http, u, timeout).await,
                None => None,
            }
        }))
        .await;
        let mut loads = Vec::with_capacity(endpoints.len());
        let mut in_window = Vec::new();
        for ((pod, _), sample) in endpoints.iter().zip(&samples) {
            loads.push(sample.as_ref().map(|s| PodLoad {
                waiting: s.waiting,
                running: s.running,
            }));
            if let Some(s) = sample {
                let w = self.windows.entry(pod.clone()).or_default();
                w.record(now, s.ttft.clone(), targets.window_seconds);
                if let Some(h) = w.in_window() {
                    in_window.push(h);
                }
            }
        }
        self.windows
            .retain(|k, _| endpoints.iter().any(|(pod, _)| pod == k));
        if self.active(endpoints, &samples) || activation || self.last_activity.is_none() {
            self.last_activity = Some(now);
        }
        let ttft = window::quantile(targets.ttft_quantile, &window::sum(&in_window));
        let since = now - targets.stabilization_seconds;
        self.history.retain(|(at, _)| *at >= since);
        let decision = decide(&Inputs {
            targets,
            current,
            pods: &loads,
            ttft,
            history: &self.history,
            now,
            idle_seconds: self.last_activity.map(|at| now - at),
            activation,
        });
        self.history.push((now, decision.recommendation));
        Evaluation {
            samples,
            ttft,
            decision,
        }
    }
}

impl ServiceState {
    /// Whether this interval's samples show a request: one running or waiting, one finished
    /// since the pod's last scrape, or no ready pod answering (idleness cannot be told).
    fn active(
        &mut self,
        endpoints: &[(String, Option<String>)],
        samples: &[Option<EngineSample>],
    ) -> bool {
        let mut active = samples.iter().all(Option::is_none);
        for ((pod, _), sample) in endpoints.iter().zip(samples) {
            let Some(s) = sample else { continue };
            let before = self.finished.insert(pod.clone(), s.finished);
            if s.running + s.waiting > 0.0 || before.is_some_and(|b| b != s.finished) {
                active = true;
            }
        }
        self.finished
            .retain(|k, _| endpoints.iter().any(|(pod, _)| pod == k));
        active
    }
}

fn pod_ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether a request asked for a replica (`status.autoscaling.activationRequestedAt`, written
/// by the router) after the replica count last changed.
fn activation_requested(svc: &LLMService) -> bool {
    let Some(auto) = svc.status.as_ref().and_then(|s| s.autoscaling.as_ref()) else {
        return false;
    };
    let time = |t: &Option<String>| t.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
    match (
        time(&auto.activation_requested_at),
        time(&auto.last_scale_time),
    ) {
        (Some(asked), Some(scaled)) => asked > scaled,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Runs the autoscaler until the future is dropped.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    settings: Settings,
    recorder: Recorder,
    metrics: AutoscaleMetrics,
) {
    let http = reqwest::Client::new();
    let mut state: HashMap<String, ServiceState> = HashMap::new();
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(settings.interval);
    loop {
        tick.tick().await;
        let llms: Api<LLMService> = match &namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let list = match llms.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(error = %e, "autoscaler: cannot list LLMServices");
                continue;
            }
        };
        metrics.fleet.record(&list);
        let now = started.elapsed().as_secs_f64();
        let keys: Vec<String> = list
            .iter()
            .map(|s| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any()))
            .collect();
        state.retain(|k, _| keys.contains(k));
        for svc in list.iter().filter(|s| s.spec.autoscaling.is_some()) {
            let key = format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any());
            let st = state.entry(key).or_default();
            if let Err(e) = step(&client, &http, svc, st, now, &settings, &recorder, &metrics).await
            {
                tracing::warn!(llmservice = %svc.name_any(), error = %e, "autoscaler step failed");
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn step(
    client: &Client,
    http: &reqwest::Client,
    svc: &LLMService,
    st: &mut ServiceState,
    now: f64,
    settings: &Settings,
    recorder: &Recorder,
    metrics: &AutoscaleMetrics,
) -> Result<(), kube::Error> {
    let Some(spec) = &svc.spec.autoscaling else {
        return Ok(());
    };
    let targets = Targets::from_spec(spec);
    let ns = svc.namespace().unwrap_or_default();
    let name = svc.name_any();
    let pods_api = Api::<Pod>::namespaced(client.clone(), &ns);
    let pods: Vec<Pod> = pods_api
        .list(&ListParams::default().labels(&format!("{LLMSERVICE_LABEL}={name}")))
        .await?
        .items
        .into_iter()
        .filter(pod_ready)
        .collect();
    let current = crate::reconcile::desired_replicas(svc);
    // Only a model at zero is brought back; a request the router signalled while a replica
    // was already coming is served by it.
    let activation = current == 0 && activation_requested(svc);
    let endpoints: Vec<(String, Option<String>)> = pods
        .iter()
        .map(|p| {
            let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
            let url = ip.map(|ip| format!("http://{ip}:{}/metrics", settings.metrics_port));
            (p.name_any(), url)
        })
        .collect();
    let Evaluation {
        samples: scrapes,
        ttft,
        decision: d,
    } = st
        .evaluate(
            http,
            &targets,
            current,
            &endpoints,
            now,
            settings.scrape_timeout,
            activation,
        )
        .await;
    let failed = scrapes.iter().filter(|s| s.is_none()).count() as u64;
    metrics
        .scrape_errors
        .with_label_values(&[&ns, &name])
        .inc_by(failed);

    match ttft {
        Some(v) => metrics.ttft.with_label_values(&[&ns, &name]).set(v),
        // No request in the window: no TTFT, rather than the last one standing.
        None => {
            let _ = metrics.ttft.remove_label_values(&[&ns, &name]);
        }
    }
    if let Some(q) = d.queue_per_replica {
        metrics.queue.with_label_values(&[&ns, &name]).set(q);
    }
    let direction = match d.desired.cmp(&current) {
        std::cmp::Ordering::Greater => "up",
        std::cmp::Ordering::Less => "down",
        std::cmp::Ordering::Equal => "none",
    };
    metrics
        .decisions
        .with_label_values(&[&ns, &name, direction, d.signal.as_str()])
        .inc();
    metrics
        .recommended
        .with_label_values(&[&ns, &name])
        .set(d.recommendation.into());

    // Before a scale-down, mark the pods with the fewest running requests as cheapest to delete.
    if d.desired < current {
        for (pod, sample) in pods.iter().zip(&scrapes) {
            let running = sample.as_ref().map_or(0.0, |s| s.running);
            let patch = json!({"metadata": {"annotations": {POD_DELETION_COST: format!("{}", running.round() as i64)}}});
            let _ = pods_api
                .patch(
                    &pod.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await;
        }
    }

    let mut new_status = svc.status.clone().unwrap_or_default();
    let mut auto = new_status.autoscaling.clone().unwrap_or_default();
    auto.ttft_seconds = ttft;
    auto.queue_depth_per_replica = d.queue_per_replica;
    let changed = d.desired != current;
    if changed {
        let reason = format!("scaled {current} -> {}: {}", d.desired, d.reason);
        auto.last_scale_time = Some(Timestamp::now().to_string());
        auto.last_scale_reason = Some(reason.clone());
        let ev = Event {
            type_: EventType::Normal,
            reason: "Autoscaled".into(),
            note: Some(reason),
            action: "Scale".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&ev, &svc.object_ref(&())).await {
            tracing::warn!(error = %e, "could not publish an Event");
        }
    }
    new_status.desired_replicas = Some(d.desired);
    new_status.autoscaling = Some(auto);
    let limited = status::condition(
        &new_status.conditions,
        "ScalingLimited",
        d.limited.is_some(),
        if d.limited.is_some() {
            "BoundsReached"
        } else {
            "WithinBounds"
        },
        d.limited.clone().unwrap_or_else(|| {
            format!(
                "{} replicas are within [{}, {}]",
                d.desired, targets.min, targets.max
            )
        }),
        svc.metadata.generation,
        Timestamp::now(),
    );
    new_status
        .conditions
        .retain(|c| c.type_ != "ScalingLimited");
    new_status.conditions.push(limited);
    let patch = json!({"status": {
        "desiredReplicas": new_status.desired_replicas,
        "autoscaling": new_status.autoscaling,
        "conditions": new_status.conditions,
    }});
    Api::<LLMService>::namespaced(client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}
