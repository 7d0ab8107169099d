//! Snapshot tests of the render functions: the Deployment, Service and PodDisruptionBudget an
//! LLMService becomes, as YAML (`UPDATE_SNAPSHOTS=1 cargo test -p ferrite-operator --test render`
//! rewrites the files under tests/snapshots/ after an intended change; review the diff).

use std::path::PathBuf;

use ferrite_crds::LLMService;
use ferrite_operator::render::{self, RenderConfig};
use serde_json::{json, Value};

fn llms(name: &str, spec: Value) -> LLMService {
    serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "ml", "uid": "00000000-0000-0000-0000-000000000001"},
        "spec": spec,
    }))
    .expect("test spec deserializes")
}

fn example(file: &str) -> LLMService {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("example exists");
    let mut v: Value = serde_yaml::from_str(&text).expect("example is YAML");
    v["metadata"]["namespace"] = json!("ml");
    v["metadata"]["uid"] = json!("00000000-0000-0000-0000-000000000002");
    serde_json::from_value(v).expect("example is an LLMService")
}

fn cfg() -> RenderConfig {
    RenderConfig {
        engine_image: "ferrite-engine:test".into(),
        drain_timeout_seconds: 30,
    }
}

/// Renders every child of `svc` as one multi-document YAML string.
fn render_all(svc: &LLMService) -> String {
    let replicas = render::spec_replicas(svc);
    let mut docs = vec![
        serde_yaml::to_string(&render::deployment(svc, &cfg(), replicas).expect("deployment")),
        serde_yaml::to_string(&render::service(svc).expect("service")),
    ];
    if let Some(p) = render::pdb(svc, replicas).expect("pdb") {
        docs.push(serde_yaml::to_string(&p));
    }
    docs.into_iter()
        .map(|d| d.expect("yaml"))
        .collect::<Vec<_>>()
        .join("---\n")
}

fn check_snapshot(name: &str, svc: &LLMService) -> Value {
    let got = render_all(svc);
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.yaml"));
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).expect("write snapshot");
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{} is missing; run with UPDATE_SNAPSHOTS=1", path.display()));
    assert_eq!(
        got,
        want,
        "{name}: rendered objects differ from {}",
        path.display()
    );
    let first = got.split("---\n").next().unwrap_or_default();
    serde_yaml::from_str(first).expect("deployment yaml")
}

fn engine_container(d: &Value) -> &Value {
    &d["spec"]["template"]["spec"]["containers"][0]
}

#[test]
fn cpu_file_model() {
    let svc = llms(
        "smollm2",
        json!({
            "model": {"source": "file:///models/SmolLM2-135M-Instruct.Q4_1.gguf", "servedName": "smollm2"},
            "engine": {"maxNumSeqs": 16, "enablePrefixCaching": false},
        }),
    );
    let d = check_snapshot("cpu-file", &svc);
    let c = engine_container(&d);
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        args,
        [
            "serve",
            "--model",
            "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "--served-model-name",
            "smollm2",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--shutdown-timeout",
            "30",
            "--max-num-seqs",
            "16",
            "--no-enable-prefix-caching"
        ]
    );
    assert!(d["spec"]["template"]["spec"]
        .get("initContainers")
        .is_none());
    assert_eq!(
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
        json!(45)
    );
    assert!(
        c["resources"].get("limits").is_none(),
        "no GPU on CPU: {}",
        c["resources"]
    );
    assert_eq!(
        render::pdb(&svc, 1).expect("pdb"),
        None,
        "one replica gets no PDB"
    );
}

#[test]
fn gpu_tp2_pp2_hf_model_with_token() {
    let svc = llms(
        "llama",
        json!({
            "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "v1.0",
                      "file": "model.gguf", "tokenHubSecret": "hf-token"},
            "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpuMemoryUtilization": 0.9},
            "gpuResource": "nvidia.com/gpu",
            "resources": {"limits": {"memory": "200Gi"}},
            "replicas": 3,
        }),
    );
    let d = check_snapshot("gpu-tp2-pp2-hf", &svc);
    let c = engine_container(&d);
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], json!("4"));
    assert_eq!(c["resources"]["limits"]["memory"], json!("200Gi"));
    // Tensor ranks share memory through /dev/shm, memory-backed rather than 64 MiB.
    let shm = c["volumeMounts"].as_array().and_then(|m| {
        m.iter()
            .find(|m| m["mountPath"] == json!("/dev/shm"))
            .map(|m| m["name"].clone())
    });
    assert_eq!(shm, Some(json!("dshm")));
    let volumes = &d["spec"]["template"]["spec"]["volumes"];
    assert!(
        volumes
            .as_array()
            .is_some_and(|v| v.contains(&json!({"name": "dshm", "emptyDir": {"medium": "Memory"}}))),
        "{volumes}"
    );
    let init = &d["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(
        init["args"],
        json!([
            "download",
            "hf://meta-llama/Llama-3.1-70B-Instruct@v1.0",
            "--to",
            "/models",
            "--file",
            "model.gguf"
        ])
    );
    assert_eq!(
        init["env"][0]["valueFrom"]["secretKeyRef"],
        json!({"name": "hf-token", "key": "HF_TOKEN"})
    );
    assert!(
        !render_all(&svc).contains("hf_"),
        "no token value in the objects"
    );
    // 70B: 5 min + 70 * 20 s = 1700 s of startup probe at 10 s per probe.
    assert_eq!(c["startupProbe"]["failureThreshold"], json!(170));
    assert_eq!(d["spec"]["replicas"], json!(3));
}

#[test]
fn pvc_model_mounted_read_only() {
    let svc = llms(
        "pvc",
        json!({"model": {"source": "pvc://models/smollm2/model.gguf"}, "replicas": 2}),
    );
    let d = check_snapshot("pvc", &svc);
    let vol = &d["spec"]["template"]["spec"]["volumes"][0];
    assert_eq!(
        vol["persistentVolumeClaim"],
        json!({"claimName": "models", "readOnly": true})
    );
    let c = engine_container(&d);
    assert_eq!(
        c["volumeMounts"][0],
        json!({"name": "model", "mountPath": "/models", "readOnly": true})
    );
    assert_eq!(c["args"][2], json!("/models/smollm2/model.gguf"));
}

#[test]
fn custom_pod_settings() {
    let svc = llms(
        "custom",
        json!({
            "model": {"source": "file:///m/model.gguf"},
            "image": "registry.example.com/ferrite-engine:custom",
            "pod": {
                "nodeSelector": {"pool": "inference"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
                "priorityClassName": "high",
                "imagePullSecrets": [{"name": "regcred"}],
                "env": [{"name": "RUST_LOG", "value": "debug"}],
                "startupTimeoutSeconds": 1200,
            },
            "rollout": {"maxSurge": 0, "maxUnavailable": 1},
        }),
    );
    let d = check_snapshot("custom-pod", &svc);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({"pool": "inference"}));
    assert_eq!(pod["priorityClassName"], json!("high"));
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "regcred"}]));
    let c = engine_container(&d);
    assert_eq!(
        c["image"],
        json!("registry.example.com/ferrite-engine:custom")
    );
    assert_eq!(c["env"], json!([{"name": "RUST_LOG", "value": "debug"}]));
    assert_eq!(c["startupProbe"]["failureThreshold"], json!(120));
    assert_eq!(
        d["spec"]["strategy"]["rollingUpdate"],
        json!({"maxSurge": 0, "maxUnavailable": 1})
    );
}

#[test]
fn every_example_renders() {
    for (file, snap) in [
        ("smollm2-cpu.yaml", "example-smollm2-cpu"),
        ("llama3-8b-gpu.yaml", "example-llama3-8b-gpu"),
        ("llama3-70b-gpu-tp4.yaml", "example-llama3-70b-gpu-tp4"),
        ("autoscaling.yaml", "example-autoscaling"),
        ("pvc-model.yaml", "example-pvc-model"),
    ] {
        let d = check_snapshot(snap, &example(file));
        let labels = &d["metadata"]["labels"];
        assert_eq!(
            labels["app.kubernetes.io/managed-by"],
            json!("ferrite-operator"),
            "{file}"
        );
        assert_eq!(
            d["metadata"]["ownerReferences"][0]["kind"],
            json!("LLMService"),
            "{file}"
        );
    }
}
