//! The engine Deployment: the pod template (engine container, model volume, probes, GPUs)
//! and the rolling-update strategy.

use ferrite_crds::{engine_args, served_model_name, LLMService, ModelSource};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};

use super::{
    child_meta, labels, name_of, selector_labels, RenderConfig, DOWNLOAD_CONTAINER,
    ENGINE_CONTAINER, ENGINE_PORT,
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

/// GPUs one replica needs: `tensorParallelSize * pipelineParallelSize`.
fn gpus(svc: &LLMService) -> i64 {
    let e = &svc.spec.engine;
    i64::from(e.tensor_parallel_size.unwrap_or(1).max(1))
        * i64::from(e.pipeline_parallel_size.unwrap_or(1).max(1))
}

fn resources(svc: &LLMService) -> ResourceRequirements {
    let mut r = svc.spec.resources.clone().unwrap_or_default();
    if let Some(gpu) = &svc.spec.gpu_resource {
        // Extended resources go in limits (requests default to them).
        r.limits
            .get_or_insert_with(Default::default)
            .insert(gpu.clone(), Quantity(gpus(svc).to_string()));
    }
    r
}

/// The engine Deployment for `replicas` replicas.
pub fn deployment(
    svc: &LLMService,
    cfg: &RenderConfig,
    replicas: i32,
) -> Result<Deployment, Error> {
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
        served_model_name(svc),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        ENGINE_PORT.to_string(),
        "--shutdown-timeout".into(),
        cfg.drain_timeout_seconds.to_string(),
    ];
    args.extend(engine_args(&svc.spec));

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
    if svc.spec.engine.tensor_parallel_size.unwrap_or(1) > 1 {
        volumes.push(json!({"name": "dshm", "emptyDir": {"medium": "Memory"}}));
        mounts.push(json!({"name": "dshm", "mountPath": "/dev/shm"}));
    }

    let startup_failures = (startup_timeout_seconds(svc) + STARTUP_PERIOD - 1) / STARTUP_PERIOD;
    let rollout = svc.spec.rollout.clone();
    let max_surge = rollout.as_ref().and_then(|r| r.max_surge).unwrap_or(1);
    let max_unavailable = rollout
        .as_ref()
        .and_then(|r| r.max_unavailable)
        .unwrap_or(0);

    let container = json!({
        "name": ENGINE_CONTAINER,
        "image": image,
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": resources(svc),
        "volumeMounts": mounts,
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": STARTUP_PERIOD,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 20,
            "failureThreshold": 6,
        },
        "securityContext": container_security(),
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    });

    let mut pod_spec = json!({
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": cfg.drain_timeout_seconds + 15,
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
    if let Some(a) = &pod.affinity {
        obj.insert("affinity".into(), serde_json::to_value(a)?);
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

    let meta = child_meta(svc)?;
    let d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(&name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": max_surge, "maxUnavailable": max_unavailable}},
            "template": {
                "metadata": {"labels": labels(&name)},
                "spec": pod_spec,
            },
        },
    });
    Ok(serde_json::from_value(d)?)
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
