//! From what the cluster reports (the Deployment and its pods) to the LLMService status a
//! person reads: phase, replica counts, endpoint and the `Ready`, `Progressing` and
//! `Available` conditions, with reasons and messages to act on. Pure functions.

use ferrite_crds::{LLMService, LLMServiceStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::render::{DOWNLOAD_CONTAINER, ENGINE_CONTAINER, ENGINE_PORT, LLMSERVICE_LABEL};

/// Why the engine of some pod could not start, taken from the pod's container statuses.
#[derive(Debug, Clone, PartialEq)]
pub struct StartupFailure {
    /// `EngineStartupFailed` or `ModelDownloadFailed`.
    pub reason: &'static str,
    /// The pod it happened in.
    pub pod: String,
    /// The container's termination message (the engine's own error), or its exit code.
    pub message: String,
}

/// What the reconciler saw in the cluster.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The engine Deployment after applying it.
    pub deployment: Option<Deployment>,
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
        message,
    })
}

/// The first engine (or model download) that exited with an error in a pod that is not
/// Ready — what a CrashLoopBackOff hides.
pub fn startup_failure(pods: &[Pod]) -> Option<StartupFailure> {
    pods.iter().find_map(|pod| {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        let status = pod.status.as_ref()?;
        let init = status.init_container_statuses.iter().flatten();
        let main = status.container_statuses.iter().flatten();
        init.filter(|c| c.name == DOWNLOAD_CONTAINER)
            .find_map(|c| failure_of(name, c, "ModelDownloadFailed"))
            .or_else(|| {
                main.filter(|c| c.name == ENGINE_CONTAINER)
                    .find_map(|c| failure_of(name, c, "EngineStartupFailed"))
            })
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

    let d = observed.deployment.as_ref();
    let ds = d.and_then(|d| d.status.clone()).unwrap_or_default();
    let replicas = ds.replicas.unwrap_or(0);
    let ready = ds.ready_replicas.unwrap_or(0);
    let updated = ds.updated_replicas.unwrap_or(0);
    let d_generation = d.and_then(|d| d.metadata.generation).unwrap_or(0);
    let d_observed = ds.observed_generation.unwrap_or(0);
    let rolled_out =
        d.is_some() && d_observed >= d_generation && updated == desired && replicas == desired;
    let complete = rolled_out && ready >= desired;
    let failure = startup_failure(&observed.pods);

    let (phase, ready_reason, ready_message) = if desired == 0 {
        (
            "Pending",
            "NoReplicas",
            "0 replicas are desired; scale up to serve".to_string(),
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
            format!("{what} in pod {} failed: {}", f.pod, f.message),
        )
    } else if ready == 0 && observed.pods.is_empty() {
        (
            "Pending",
            "PodsPending",
            format!("0 of {desired} replicas exist yet"),
        )
    } else if ready == 0 {
        (
            "Loading",
            "ModelLoading",
            format!(
                "0 of {desired} replicas ready: the engines are starting and loading the model"
            ),
        )
    } else if ready < desired {
        let why = failure
            .as_ref()
            .map(|f| format!("; pod {} failed: {}", f.pod, f.message))
            .unwrap_or_default();
        (
            "Degraded",
            "ReplicasNotReady",
            format!("{ready} of {desired} replicas ready{why}"),
        )
    } else {
        (
            "Ready",
            "RollingOut",
            format!("{ready} replicas serve; rolling out {updated} of {desired} updated"),
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
            format!("{updated} of {desired} replicas updated, {ready} ready"),
        )
    } else {
        (
            true,
            "ScalingUp",
            format!("{ready} of {desired} replicas ready"),
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
            format!("{ready} replica(s) serve requests at the endpoint"),
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
