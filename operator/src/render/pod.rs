//! The engine pod template every workload shares: the engine container (arguments, model
//! volume, probes, GPUs), the model download and the pod's security settings — for a pod
//! that serves a whole replica, or for one rank of a pipeline-parallel group.

use ferrite_crds::{engine_args, served_model_names, LLMService, ModelSource};
use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};

use super::{
    labels, name_of, RenderConfig, DOWNLOAD_CONTAINER, ENGINE_CONTAINER, ENGINE_PORT,
    LLMSERVICE_LABEL, WORKER_OF_LABEL,
};
use crate::Error;

/// Where model volumes are mounted in the pod.
const MODEL_DIR: &str = "/models";
/// Seconds between startup probes.
const STARTUP_PERIOD: i64 = 10;

/// The path the engine's `--model` flag gets inside the pod.
pub fn model_path(svc: &LLMService) -> Result<String, Error> {
    let m = &svc.spec.model;
    let source = ModelSource::parse(&m.source, m.revision.as_deref())?;
    Ok(match source {
        ModelSource::HuggingFace { .. } => match &m.file {
            Some(f) => format!("{MODEL_DIR}/{f}"),
            None => MODEL_DIR.to_string(),
        },
        ModelSource::Pvc { path, .. } => {
            let p = path.trim_matches('/');
            match (&m.file, p.is_empty()) {
                (Some(f), true) => format!("{MODEL_DIR}/{f}"),
                (Some(f), false) => format!("{MODEL_DIR}/{p}/{f}"),
                (None, true) => MODEL_DIR.to_string(),
                (None, false) => format!("{MODEL_DIR}/{p}"),
            }
        }
        ModelSource::File(p) => match &m.file {
            Some(f) => p.join(f).display().to_string(),
            None => p.display().to_string(),
        },
    })
}

/// Billions of parameters named in the model source (`...-70B-...` → 70), if any.
fn parameter_billions(source: &str) -> Option<f64> {
    let lower = source.to_ascii_lowercase();
    let bytes = lower.as_bytes();
    let mut best = None;
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'b' || i == 0 || !bytes[i - 1].is_ascii_digit() {
            continue;
        }
        // The number must end the token: "8b", "70b-instruct", not "8bit".
        if bytes.get(i + 1).is_some_and(|c| c.is_ascii_alphabetic()) {
            continue;
        }
        let start = lower[..i]
            .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
            .map_or(0, |p| p + 1);
        if let Ok(v) = lower[start..i].parse::<f64>() {
            best = Some(v);
        }
    }
    best
}

/// How long the startup probe waits for the model to load: `spec.pod.startupTimeoutSeconds`
/// when set, else sized from the model (5 minutes, plus 20 s per billion parameters named in
/// the source, so a 70B model gets about 28 minutes).
pub fn startup_timeout_seconds(svc: &LLMService) -> i64 {
    if let Some(t) = svc
        .spec
        .pod
        .as_ref()
        .and_then(|p| p.startup_timeout_seconds)
    {
        return t.max(STARTUP_PERIOD);
    }
    let billions = parameter_billions(&svc.spec.model.source).unwrap_or(0.0);
    300 + (billions * 20.0).round() as i64
}

/// Pipeline stages of one replica (`pipelineParallelSize`, at least 1).
pub fn pipeline_stages(svc: &LLMService) -> i32 {
    svc.spec.engine.pipeline_parallel_size.unwrap_or(1).max(1)
}

/// Tensor-parallel ranks of one stage (`tensorParallelSize`, at least 1).
pub fn tensor_ranks(svc: &LLMService) -> i32 {
    svc.spec.engine.tensor_parallel_size.unwrap_or(1).max(1)
}

/// Which process of a replica a pod runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The whole replica in one pod (a Deployment's pods).
    Replica,
    /// Stage 0 of a pipeline-parallel group: the OpenAI API, where the other stages join.
    Leader,
    /// A later stage (`--node-rank $(LWS_WORKER_INDEX)`): no API, only `/health`.
    Worker,
}

/// GPUs a pod requests: the tensor ranks of each stage it runs (every stage for a whole
/// replica, one for a rank of a group).
fn gpus(svc: &LLMService, role: Role) -> i64 {
    let stages = match role {
        Role::Replica => pipeline_stages(svc),
        Role::Leader | Role::Worker => 1,
    };
    i64::from(tensor_ranks(svc)) * i64::from(stages)
}

fn resources(svc: &LLMService, role: Role) -> ResourceRequirements {
    let mut r = svc.spec.resources.clone().unwrap_or_default();
    if let Some(gpu) = &svc.spec.gpu_resource {
        // Extended resources go in limits (requests default to them).
        r.limits
            .get_or_insert_with(Default::default)
            .insert(gpu.clone(), Quantity(gpus(svc, role).to_string()));
    }
    r
}

/// The label LWS gives every pod of one group (a hash of its name and group index).
pub const LWS_GROUP_KEY_LABEL: &str = "leaderworkerset.sigs.k8s.io/group-key";
/// The label that tells a group's leader pod from its workers.
pub const ROLE_LABEL: &str = "serving.ferrite.dev/role";
/// Where a group's ranks admit each other (`--master-port`).
pub const GROUP_PORT: i32 = 29500;
/// Where the group Secret is mounted in a group's pods.
const GROUP_SECRET_DIR: &str = "/etc/ferrite/group";
/// The key of the group Secret that holds the shared secret.
pub const GROUP_SECRET_KEY: &str = "secret";

/// The Secret holding a pipeline-parallel LLMService's shared group secret.
pub fn group_secret_name(name: &str) -> String {
    format!("{name}-group-secret")
}

/// The pod template (`metadata` and `spec`) of the engine pods that run `role`.
pub fn pod_template(svc: &LLMService, cfg: &RenderConfig, role: Role) -> Result<Value, Error> {
    let name = name_of(svc)?;
    let m = &svc.spec.model;
    let source = ModelSource::parse(&m.source, m.revision.as_deref())?;
    let image = svc
        .spec
        .image
        .clone()
        .unwrap_or_else(|| cfg.engine_image.clone());

    let mut args = vec![
        "serve".to_string(),
        "--model".into(),
        model_path(svc)?,
        "--served-model-name".into(),
    ];
    args.extend(served_model_names(svc));
    args.extend([
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        ENGINE_PORT.to_string(),
        "--shutdown-timeout".into(),
        cfg.drain_timeout_seconds.to_string(),
    ]);
    args.extend(engine_args(&svc.spec));
    // The group flags: every rank names the group's size, its own rank, the leader's port
    // and the secret; LWS's webhook puts the variables a worker's flags name in every
    // container, and the kubelet expands them.
    let secret_file = format!("{GROUP_SECRET_DIR}/{GROUP_SECRET_KEY}");
    let (stages, port) = (pipeline_stages(svc).to_string(), GROUP_PORT.to_string());
    let group = |rank: &str| {
        let flags = [
            "--nnodes",
            &stages,
            "--node-rank",
            rank,
            "--master-port",
            &port,
        ];
        flags
            .into_iter()
            .chain(["--group-secret-file", &secret_file])
            .map(String::from)
            .collect::<Vec<_>>()
    };
    match role {
        Role::Replica => {}
        Role::Leader => args.extend(group("0")),
        Role::Worker => {
            args.extend(group("$(LWS_WORKER_INDEX)"));
            args.extend(["--master-addr", "$(LWS_LEADER_ADDRESS)", "--headless"].map(String::from));
        }
    }

    let pod = svc.spec.pod.clone().unwrap_or_default();
    let env: Vec<EnvVar> = pod.env.clone();

    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    let mut init_containers = Vec::new();
    match &source {
        ModelSource::HuggingFace { repo, revision } => {
            volumes.push(json!({"name": "model", "emptyDir": {}}));
            mounts.push(json!({"name": "model", "mountPath": MODEL_DIR, "readOnly": true}));
            let mut dl = vec![
                "download".to_string(),
                match revision {
                    Some(r) => format!("hf://{repo}@{r}"),
                    None => format!("hf://{repo}"),
                },
                "--to".into(),
                MODEL_DIR.into(),
            ];
            if let Some(f) = &m.file {
                dl.extend(["--file".to_string(), f.clone()]);
            }
            let mut dl_env = vec![];
            if let Some(secret) = &m.token_hub_secret {
                // The token reaches the downloader as an env var from the Secret; it never
                // appears in the pod spec or the logs.
                dl_env.push(json!({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": secret, "key": "HF_TOKEN"}}}));
            }
            for e in env.iter().filter(|e| e.name == "HF_ENDPOINT") {
                dl_env.push(serde_json::to_value(e)?);
            }
            init_containers.push(json!({
                "name": DOWNLOAD_CONTAINER,
                "image": image,
                "args": dl,
                "env": dl_env,
                "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}],
                "securityContext": container_security(),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }));
        }
        ModelSource::Pvc { claim, .. } => {
            volumes.push(json!({"name": "model", "persistentVolumeClaim": {
                "claimName": claim, "readOnly": true}}));
            mounts.push(json!({"name": "model", "mountPath": MODEL_DIR, "readOnly": true}));
        }
        ModelSource::File(_) => {}
    }
    // The engine may write scratch files; the root filesystem stays read-only.
    volumes.push(json!({"name": "tmp", "emptyDir": {}}));
    mounts.push(json!({"name": "tmp", "mountPath": "/tmp"}));
    // Tensor-parallel ranks exchange activations through /dev/shm, which a container gets
    // only 64 MiB of by default: give it memory-backed storage (counted against the pod's
    // memory limit) instead.
    if tensor_ranks(svc) > 1 {
        volumes.push(json!({"name": "dshm", "emptyDir": {"medium": "Memory"}}));
        mounts.push(json!({"name": "dshm", "mountPath": "/dev/shm"}));
    }
    // The group's secret reaches the ranks as a file, readable by the engine's group only:
    // never an environment variable that `kubectl describe` would show.
    if role != Role::Replica {
        volumes.push(json!({"name": "group-secret", "secret": {
            "secretName": group_secret_name(&name), "defaultMode": 0o440}}));
        mounts.push(
            json!({"name": "group-secret", "mountPath": GROUP_SECRET_DIR,
            "readOnly": true}),
        );
    }

    let startup_failures = (startup_timeout_seconds(svc) + STARTUP_PERIOD - 1) / STARTUP_PERIOD;
    let health = |period: i64, failures: i64| {
        json!({
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
        })
    };
    let mut ports = vec![json!({"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"})];
    if role == Role::Leader {
        ports.push(json!({"name": "group", "containerPort": GROUP_PORT, "protocol": "TCP"}));
    }
    let mut container = json!({
        "name": ENGINE_CONTAINER,
        "image": image,
        "args": args,
        "env": env,
        "ports": ports,
        "resources": resources(svc, role),
        "volumeMounts": mounts,
        "startupProbe": health(STARTUP_PERIOD, startup_failures),
        "livenessProbe": health(20, 6),
        "securityContext": container_security(),
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    });
    // A worker serves no requests: it is live while its stage is, and its group is ready
    // when the leader is (whose /health waits for every stage).
    if role != Role::Worker {
        container["readinessProbe"] = health(5, 3);
    }

    // A worker stays through its leader's drain (it ends when the leader ends the group), so
    // it may take longer to stop than the leader.
    let grace = match role {
        Role::Worker => cfg.drain_timeout_seconds + 30,
        Role::Replica | Role::Leader => cfg.drain_timeout_seconds + 15,
    };
    let mut pod_spec = json!({
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    });
    let obj = pod_spec
        .as_object_mut()
        .ok_or(Error::MissingField("pod spec"))?;
    if !init_containers.is_empty() {
        obj.insert("initContainers".into(), Value::Array(init_containers));
    }
    if !pod.node_selector.is_empty() {
        obj.insert(
            "nodeSelector".into(),
            serde_json::to_value(&pod.node_selector)?,
        );
    }
    if !pod.tolerations.is_empty() {
        obj.insert(
            "tolerations".into(),
            serde_json::to_value(&pod.tolerations)?,
        );
    }
    let mut affinity = match &pod.affinity {
        Some(a) => serde_json::to_value(a)?,
        None => json!({}),
    };
    if let (Some(key), Role::Leader | Role::Worker) = (&pod.stage_topology_key, role) {
        // No two pods of one group (LWS labels each with its group's key) on nodes that
        // share a value of `key`.
        let term = json!({
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": name,
                "app.kubernetes.io/managed-by": "ferrite-operator"}},
            "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
            "topologyKey": key,
        });
        let terms =
            &mut affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
        match terms.as_array_mut() {
            Some(list) => list.push(term),
            None => *terms = json!([term]),
        }
    }
    if affinity.as_object().is_some_and(|a| !a.is_empty()) {
        obj.insert("affinity".into(), affinity);
    }
    if let Some(p) = &pod.priority_class_name {
        obj.insert("priorityClassName".into(), json!(p));
    }
    if !pod.image_pull_secrets.is_empty() {
        obj.insert(
            "imagePullSecrets".into(),
            serde_json::to_value(&pod.image_pull_secrets)?,
        );
    }

    let mut template_labels = labels(&name);
    match role {
        Role::Replica => {}
        Role::Leader => {
            template_labels.insert(ROLE_LABEL.into(), "leader".into());
        }
        Role::Worker => {
            template_labels.remove(LLMSERVICE_LABEL);
            template_labels.insert(WORKER_OF_LABEL.into(), name.clone());
            template_labels.insert(ROLE_LABEL.into(), "worker".into());
        }
    }
    Ok(json!({
        "metadata": {"labels": template_labels},
        "spec": pod_spec,
    }))
}

fn container_security() -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]},
    })
}

#[cfg(test)]
mod tests {
    use super::parameter_billions;

    #[test]
    fn parameter_count_is_read_from_the_source() {
        assert_eq!(
            parameter_billions("hf://meta-llama/Llama-3.1-70B-Instruct"),
            Some(70.0)
        );
        assert_eq!(
            parameter_billions("hf://meta-llama/Meta-Llama-3-8B"),
            Some(8.0)
        );
        assert_eq!(
            parameter_billions("hf://Qwen/Qwen2.5-0.5B-Instruct"),
            Some(0.5)
        );
        assert_eq!(
            parameter_billions("hf://HuggingFaceTB/SmolLM2-135M-Instruct"),
            None
        );
        assert_eq!(
            parameter_billions("pvc://models/quant-8bit/model.gguf"),
            None
        );
    }
}
