//! Snapshot tests of the render functions: the Deployment (or LeaderWorkerSet and group
//! Secret), Service and PodDisruptionBudget an LLMService becomes, as YAML (`UPDATE_SNAPSHOTS=1 cargo test -p ferrite-operator --test render`
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
        inference_pools: false,
    }
}

/// `v` with every object's keys in sorted order: a snapshot must not depend on whether
/// serde_json keeps insertion order, a feature any crate in the build may turn on.
fn sorted_keys(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted_keys).collect()),
        other => other,
    }
}

/// One object as a YAML document with its keys sorted.
fn yaml_doc(object: &impl serde::Serialize) -> String {
    let value = serde_json::to_value(object).expect("object serializes");
    serde_yaml::to_string(&sorted_keys(value)).expect("yaml")
}

/// Renders every child of `svc` as one multi-document YAML string.
fn render_all(svc: &LLMService) -> String {
    let replicas = render::spec_replicas(svc);
    let mut docs = if render::uses_groups(svc) {
        let lws = render::leaderworkerset(svc, &cfg(), replicas).expect("leaderworkerset");
        let secret = render::group_secret(svc, "made-by-the-reconciler").expect("secret");
        vec![yaml_doc(&lws), yaml_doc(&secret)]
    } else {
        let d = render::deployment(svc, &cfg(), replicas).expect("deployment");
        vec![yaml_doc(&d)]
    };
    docs.push(yaml_doc(&render::service(svc).expect("service")));
    if let Some(p) = render::pdb(svc, replicas).expect("pdb") {
        docs.push(yaml_doc(&p));
    }
    docs.join("---\n")
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
    serde_yaml::from_str(first).expect("workload yaml")
}

/// The pod spec and engine container of a LeaderWorkerSet's `leaderTemplate` or
/// `workerTemplate`.
fn group_pod<'a>(lws: &'a Value, template: &str) -> (&'a Value, &'a Value) {
    let t = &lws["spec"]["leaderWorkerTemplate"][template];
    (&t["spec"], &t["spec"]["containers"][0])
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("an array")
        .iter()
        .filter_map(Value::as_str)
        .collect()
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
fn gpu_tp2_pp2_hf_model_becomes_groups_of_two_pods_with_two_gpus_each() {
    let svc = llms(
        "llama",
        json!({
            "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "v1.0",
                      "file": "model.gguf", "tokenHubSecret": "hf-token"},
            "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpuMemoryUtilization": 0.9},
            "gpuResource": "nvidia.com/gpu",
            "resources": {"limits": {"memory": "200Gi"}},
            "replicas": 3,
            "pod": {"stageTopologyKey": "kubernetes.io/hostname"},
        }),
    );
    let lws = check_snapshot("gpu-tp2-pp2-hf", &svc);
    assert_eq!(lws["kind"], json!("LeaderWorkerSet"));
    assert_eq!(lws["metadata"]["name"], json!("llama-stages"));
    let spec = &lws["spec"];
    assert_eq!(spec["replicas"], json!(3), "replicas are groups");
    let lwt = &spec["leaderWorkerTemplate"];
    assert_eq!(lwt["size"], json!(2), "one pod per stage");
    assert_eq!(lwt["restartPolicy"], json!("RecreateGroupOnPodRestart"));
    assert_eq!(
        spec["rolloutStrategy"]["rollingUpdateConfiguration"],
        json!({"maxSurge": 1, "maxUnavailable": 0})
    );

    let (leader_pod, leader) = group_pod(&lws, "leaderTemplate");
    let (worker_pod, worker) = group_pod(&lws, "workerTemplate");
    for (pod, c) in [(leader_pod, leader), (worker_pod, worker)] {
        // Each stage's tensor ranks are GPUs of its own pod.
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], json!("2"));
        assert_eq!(c["resources"]["limits"]["memory"], json!("200Gi"));
        let mounts = c["volumeMounts"].as_array().expect("mounts");
        let at = |path: &str| mounts.iter().find(|m| m["mountPath"] == json!(path));
        assert_eq!(at("/dev/shm").map(|m| &m["name"]), Some(&json!("dshm")));
        assert_eq!(
            at("/etc/ferrite/group"),
            Some(
                &json!({"name": "group-secret", "mountPath": "/etc/ferrite/group", "readOnly": true})
            )
        );
        let volumes = pod["volumes"].as_array().expect("volumes");
        assert!(volumes.contains(&json!({"name": "group-secret", "secret": {
            "secretName": "llama-group-secret", "defaultMode": 0o440}})));
        // The group's secret is a file, never an environment variable.
        assert!(!c["env"].to_string().contains("SECRET"), "{}", c["env"]);
        // Every pod downloads its own copy of the model.
        let init = &pod["initContainers"][0];
        assert_eq!(
            strings(&init["args"]),
            [
                "download",
                "hf://meta-llama/Llama-3.1-70B-Instruct@v1.0",
                "--to",
                "/models",
                "--file",
                "model.gguf"
            ]
        );
        assert_eq!(
            init["env"][0]["valueFrom"]["secretKeyRef"],
            json!({"name": "hf-token", "key": "HF_TOKEN"})
        );
        // 70B: 5 min + 70 * 20 s = 1700 s of startup probe at 10 s per probe.
        assert_eq!(c["startupProbe"]["failureThreshold"], json!(170));
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], json!("/health"));
        // Stages of one group on different nodes.
        assert_eq!(
            pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
            json!([{
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llama",
                    "app.kubernetes.io/managed-by": "ferrite-operator"}},
                "matchLabelKeys": ["leaderworkerset.sigs.k8s.io/group-key"],
                "topologyKey": "kubernetes.io/hostname",
            }])
        );
    }
    let leader_args = strings(&leader["args"]);
    let tail = &leader_args[leader_args.len() - 8..];
    assert_eq!(
        tail,
        [
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-port",
            "29500",
            "--group-secret-file",
            "/etc/ferrite/group/secret"
        ]
    );
    assert!(leader_args
        .windows(2)
        .any(|w| w == ["--pipeline-parallel-size", "2"]));
    assert_eq!(
        leader["readinessProbe"]["httpGet"]["path"],
        json!("/health")
    );
    assert_eq!(
        leader["ports"][1],
        json!({"name": "group", "containerPort": 29500, "protocol": "TCP"}),
        "the leader admits the other stages on its group port"
    );
    let worker_args = strings(&worker["args"]);
    let tail = &worker_args[worker_args.len() - 11..];
    assert_eq!(
        tail,
        [
            "--nnodes",
            "2",
            "--node-rank",
            "$(LWS_WORKER_INDEX)",
            "--master-port",
            "29500",
            "--group-secret-file",
            "/etc/ferrite/group/secret",
            "--master-addr",
            "$(LWS_LEADER_ADDRESS)",
            "--headless"
        ]
    );
    assert!(
        worker.get("readinessProbe").is_none(),
        "a worker serves no requests"
    );
    assert_eq!(worker_pod["terminationGracePeriodSeconds"], json!(60));

    // The Service and the autoscaler select leaders: workers lack the selector label.
    let leader_labels =
        &lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"];
    let worker_labels =
        &lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"];
    assert_eq!(
        leader_labels["serving.ferrite.dev/llmservice"],
        json!("llama")
    );
    assert_eq!(leader_labels["serving.ferrite.dev/role"], json!("leader"));
    assert!(worker_labels
        .get("serving.ferrite.dev/llmservice")
        .is_none());
    assert_eq!(
        worker_labels["serving.ferrite.dev/worker-of"],
        json!("llama")
    );
    let service = serde_json::to_value(render::service(&svc).expect("service")).expect("json");
    assert_eq!(
        service["spec"]["selector"],
        json!({"serving.ferrite.dev/llmservice": "llama"})
    );
    assert!(
        !render_all(&svc).contains("hf_"),
        "no token value in the objects"
    );
}

#[test]
fn one_pod_replicas_request_every_gpu_of_every_stage_and_get_no_group_flags() {
    let svc = llms(
        "tp4",
        json!({
            "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "engine": {"tensorParallelSize": 4},
            "gpuResource": "nvidia.com/gpu",
        }),
    );
    let d = serde_json::to_value(render::deployment(&svc, &cfg(), 1).expect("deployment"))
        .expect("json");
    let c = engine_container(&d);
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], json!("4"));
    let args = strings(&c["args"]);
    assert!(
        !args.contains(&"--nnodes") && !args.contains(&"--headless"),
        "{args:?}"
    );
    assert!(d["spec"]["template"]["spec"].get("affinity").is_none());
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

#[test]
fn an_inference_pool_selects_the_pods_the_service_selects_and_names_the_picker() {
    let svc = llms(
        "chat",
        json!({"model": {"source": "hf://a/b", "aliases": ["chat-latest"]},
               "inferencePool": {"endpointPicker": {"name": "chat-epp", "failureMode": "FailOpen"}}}),
    );
    let pool = serde_json::to_value(render::inference_pool(&svc).expect("pool")).expect("json");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(pool["kind"], "InferencePool");
    let service = serde_json::to_value(render::service(&svc).expect("service")).expect("json");
    assert_eq!(
        pool["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"]
    );
    assert_eq!(pool["spec"]["targetPorts"], json!([{"number": 8000}]));
    assert_eq!(
        pool["spec"]["endpointPickerRef"],
        json!({"kind": "Service", "name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailOpen"})
    );
    assert_eq!(pool["metadata"]["ownerReferences"][0]["kind"], "LLMService");
    // Per LLMService, else the operator's default.
    let mut on = cfg();
    assert!(!render::wants_inference_pool(
        &llms("x", json!({"model": {"source": "hf://a/b"}})),
        &on
    ));
    on.inference_pools = true;
    assert!(render::wants_inference_pool(
        &llms("x", json!({"model": {"source": "hf://a/b"}})),
        &on
    ));
    let off = llms(
        "x",
        json!({"model": {"source": "hf://a/b"}, "inferencePool": {"enabled": false}}),
    );
    assert!(!render::wants_inference_pool(&off, &on));
    // The engine answers to every name the router routes here.
    let d = serde_json::to_value(render::deployment(&svc, &cfg(), 1).expect("deployment"))
        .expect("json");
    let args = strings(&engine_container(&d)["args"]);
    let at = args
        .iter()
        .position(|a| *a == "--served-model-name")
        .expect("names");
    assert_eq!(&args[at + 1..at + 3], ["chat", "chat-latest"]);
}
