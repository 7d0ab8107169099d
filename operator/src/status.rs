//! From what the cluster reports (the Deployment or LeaderWorkerSet and its pods) to the
//! LLMService status a person reads: phase, replica (or group) counts, topology, endpoint and
//! the `Ready`, `Progressing` and `Available` conditions, with reasons and messages to act
//! on. Pure functions.

use ferrite_crds::{LLMService, LLMServiceStatus, ParallelismStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::core::DynamicObject;

use crate::render::{
    pipeline_stages, tensor_ranks, uses_groups, DOWNLOAD_CONTAINER, ENGINE_CONTAINER, ENGINE_PORT,
    LLMSERVICE_LABEL, LWS_WORKER_INDEX_LABEL,
};

/// Why the engine of some pod could not start, taken from the pod's container statuses.
#[derive(Debug, Clone, PartialEq)]
pub struct StartupFailure {
    /// `EngineStartupFailed` or `ModelDownloadFailed`.
    pub reason: &'static str,
    /// The pod it happened in.
    pub pod: String,
    /// The pipeline rank that pod runs, when replicas are groups (0: the leader).
    pub rank: Option<u32>,
    /// The container's termination message (the engine's own error), or its exit code.
    pub message: String,
}

/// The replica counts of the workload (a Deployment's pods or a LeaderWorkerSet's groups).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkloadStatus {
    /// `metadata.generation`.
    pub generation: i64,
    /// `status.observedGeneration`: the generation its controller has acted on.
    pub observed_generation: i64,
    /// Replicas that exist.
    pub replicas: i32,
    /// Replicas that are ready.
    pub ready: i32,
    /// Replicas on the current template.
    pub updated: i32,
    /// Whether its controller reports no update in progress (a LeaderWorkerSet's
    /// `Available` condition; a Deployment's counts say it all).
    pub settled: bool,
}

impl WorkloadStatus {
    /// A Deployment's counts (pods).
    pub fn of_deployment(d: &Deployment) -> Self {
        let s = d.status.clone().unwrap_or_default();
        Self {
            generation: d.metadata.generation.unwrap_or(0),
            observed_generation: s.observed_generation.unwrap_or(0),
            replicas: s.replicas.unwrap_or(0),
            ready: s.ready_replicas.unwrap_or(0),
            updated: s.updated_replicas.unwrap_or(0),
            settled: true,
        }
    }

    /// A LeaderWorkerSet's counts (groups; a group is ready when all its pods are).
    pub fn of_leaderworkerset(lws: &DynamicObject) -> Self {
        let s = &lws.data["status"];
        let int = |k: &str| s[k].as_i64().unwrap_or(0);
        let count = |k: &str| i32::try_from(int(k)).unwrap_or(i32::MAX);
        Self {
            generation: lws.metadata.generation.unwrap_or(0),
            observed_generation: int("observedGeneration"),
            replicas: count("replicas"),
            ready: count("readyReplicas"),
            updated: count("updatedReplicas"),
            settled: s["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Available" && c["status"] == "True")
            }),
        }
    }
}

impl WorkloadStatus {
    /// Whether its controller has acted on the current spec and it holds exactly `desired`
    /// replicas, all on the current template.
    pub fn rolled_out(&self, desired: i32) -> bool {
        self.settled
            && self.observed_generation >= self.generation
            && self.updated == desired
            && self.replicas == desired
    }

    /// [`WorkloadStatus::rolled_out`], and every wanted replica ready.
    pub fn complete(&self, desired: i32) -> bool {
        self.rolled_out(desired) && self.ready >= desired
    }
}

/// What the reconciler saw in the cluster.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The workload after applying it: the Deployment's or LeaderWorkerSet's counts.
    pub workload: Option<WorkloadStatus>,
    /// The engine pods.
    pub pods: Vec<Pod>,
}

fn failure_of(
    pod_name: &str,
    cs: &ContainerStatus,
    reason: &'static str,
) -> Option<StartupFailure> {
    if cs.ready {
        return None;
    }
    let state = cs.state.as_ref();
    let terminated = state
        .and_then(|s| s.terminated.as_ref())
        .filter(|t| t.exit_code != 0)
        .or_else(|| cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()))
        .filter(|t| t.exit_code != 0)?;
    let message = match terminated.message.as_deref().map(str::trim) {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => format!(
            "container {} exited with code {}{}",
            cs.name,
            terminated.exit_code,
            terminated
                .reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        ),
    };
    Some(StartupFailure {
        reason,
        pod: pod_name.to_string(),
        rank: None,
        message,
    })
}

impl StartupFailure {
    /// Where it happened, for a person: `pod X`, or `rank R (pod X)` in a group.
    pub fn place(&self) -> String {
        match self.rank {
            Some(r) => format!("rank {r} (pod {})", self.pod),
            None => format!("pod {}", self.pod),
        }
    }
}

/// The first engine (or model download) that exited with an error in a pod that is not
/// Ready — what a CrashLoopBackOff hides — with the pod's pipeline rank when it has one.
pub fn startup_failure(pods: &[Pod]) -> Option<StartupFailure> {
    pods.iter().find_map(|pod| {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        let status = pod.status.as_ref()?;
        let init = status.init_container_statuses.iter().flatten();
        let main = status.container_statuses.iter().flatten();
        let rank = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LWS_WORKER_INDEX_LABEL))
            .and_then(|r| r.parse().ok());
        init.filter(|c| c.name == DOWNLOAD_CONTAINER)
            .find_map(|c| failure_of(name, c, "ModelDownloadFailed"))
            .or_else(|| {
                main.filter(|c| c.name == ENGINE_CONTAINER)
                    .find_map(|c| failure_of(name, c, "EngineStartupFailed"))
            })
            .map(|f| StartupFailure { rank, ..f })
    })
}

/// A condition of `type_` with the transition time kept from `previous` when its status did
/// not change.
pub fn condition(
    previous: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// The status for `svc` with `desired` replicas wanted, given what was observed. Fields the
/// autoscaler owns (`autoscaling`, `ScalingLimited`) are carried over from `svc.status`.
pub fn compute(
    svc: &LLMService,
    desired: i32,
    observed: &Observed,
    now: Timestamp,
) -> LLMServiceStatus {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let ns = svc
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let generation = svc.metadata.generation;
    let previous = svc.status.clone().unwrap_or_default();

    let w = observed.workload.clone().unwrap_or_default();
    let (replicas, ready, updated) = (w.replicas, w.ready, w.updated);
    let rolled_out = observed.workload.is_some() && w.rolled_out(desired);
    let complete = observed.workload.is_some() && w.complete(desired);
    let failure = startup_failure(&observed.pods);
    let groups = uses_groups(svc);
    let unit = if groups { "groups" } else { "replicas" };
    let pods = observed.pods.len();

    let scales_from_zero = svc
        .spec
        .autoscaling
        .as_ref()
        .is_some_and(|a| a.min_replicas == 0);
    let (phase, ready_reason, ready_message) = if desired == 0 && scales_from_zero {
        (
            "Idle",
            "NoReplicas",
            "scaled to zero without requests; the next request through the router brings a \
             replica back"
                .to_string(),
        )
    } else if desired == 0 {
        (
            "Pending",
            "NoReplicas",
            "0 replicas are desired; scale up to serve".to_string(),
        )
    } else if complete && groups {
        (
            "Ready",
            "AllReplicasReady",
            format!("{ready}/{desired} groups ready, {pods} pods"),
        )
    } else if complete {
        (
            "Ready",
            "AllReplicasReady",
            format!("{ready} of {desired} replicas serve the model"),
        )
    } else if let Some(f) = failure.as_ref().filter(|_| ready == 0) {
        let what = if f.reason == "ModelDownloadFailed" {
            "model download"
        } else {
            "engine"
        };
        (
            "Failed",
            f.reason,
            format!("{what} in {} failed: {}", f.place(), f.message),
        )
    } else if ready == 0 && observed.pods.is_empty() {
        (
            "Pending",
            "PodsPending",
            format!("0 of {desired} {unit} exist yet"),
        )
    } else if ready == 0 {
        let who = if groups {
            format!("{pods} pods: the ranks are starting, loading their stages and forming")
        } else {
            "the engines are starting and loading the model".to_string()
        };
        (
            "Loading",
            "ModelLoading",
            format!("0 of {desired} {unit} ready: {who}"),
        )
    } else if ready < desired {
        let why = failure
            .as_ref()
            .map(|f| format!("; {} failed: {}", f.place(), f.message))
            .unwrap_or_default();
        let pods = if groups {
            format!(", {pods} pods")
        } else {
            String::new()
        };
        (
            "Degraded",
            "ReplicasNotReady",
            format!("{ready} of {desired} {unit} ready{pods}{why}"),
        )
    } else {
        (
            "Ready",
            "RollingOut",
            format!("{ready} {unit} serve; rolling out {updated} of {desired} updated"),
        )
    };
    let ready_ok = complete && desired > 0;
    let (progress_ok, progress_reason, progress_message) = if complete {
        (
            false,
            "RolloutComplete",
            "every replica runs the current spec".to_string(),
        )
    } else if !rolled_out {
        (
            true,
            "RollingOut",
            format!("{updated} of {desired} {unit} updated, {ready} ready"),
        )
    } else {
        (
            true,
            "ScalingUp",
            format!("{ready} of {desired} {unit} ready"),
        )
    };

    let prev = &previous.conditions;
    let mut conditions = vec![
        condition(
            prev,
            "Ready",
            ready_ok,
            ready_reason,
            ready_message,
            generation,
            now,
        ),
        condition(
            prev,
            "Progressing",
            progress_ok,
            progress_reason,
            progress_message,
            generation,
            now,
        ),
        condition(
            prev,
            "Available",
            ready > 0,
            if ready > 0 {
                "MinimumReplicasAvailable"
            } else {
                "NoReplicasAvailable"
            },
            format!(
                "{ready} {} serve requests at the endpoint",
                if groups { "group(s)" } else { "replica(s)" }
            ),
            generation,
            now,
        ),
    ];
    conditions.extend(prev.iter().filter(|c| c.type_ == "ScalingLimited").cloned());

    LLMServiceStatus {
        observed_generation: generation,
        phase: Some(phase.to_string()),
        replicas: Some(replicas),
        ready_replicas: Some(ready),
        desired_replicas: Some(desired),
        selector: Some(format!("{LLMSERVICE_LABEL}={name}")),
        endpoint: Some(format!("http://{name}.{ns}.svc:{ENGINE_PORT}/v1")),
        conditions,
        autoscaling: previous.autoscaling,
        parallelism: Some(parallelism(svc)),
    }
}

/// How `svc` lays out each replica.
pub fn parallelism(svc: &LLMService) -> ParallelismStatus {
    let pipeline = pipeline_stages(svc);
    ParallelismStatus {
        tensor: tensor_ranks(svc),
        pipeline,
        pods_per_replica: if uses_groups(svc) { pipeline } else { 1 },
    }
}

/// The status with every condition's transition time blanked, for comparing whether anything
/// a person would see changed.
pub fn comparable(status: &LLMServiceStatus) -> LLMServiceStatus {
    let mut s = status.clone();
    for c in &mut s.conditions {
        c.last_transition_time = Time(Timestamp::UNIX_EPOCH);
    }
    s
}
