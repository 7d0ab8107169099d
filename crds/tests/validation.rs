//! The API server itself refuses bad LLMService manifests, with a message that names the
//! field: the CRD's schema and CEL rules, checked by a real kube-apiserver.

use std::path::Path;

use ferrite_crds::LLMService;
use ferrite_testcluster::{install_crds, TestCluster};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{json, Value};

fn manifest(name: &str, spec: Value) -> LLMService {
    serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("the test manifest deserializes")
}

fn hf() -> Value {
    json!({"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_refuses_invalid_manifests_naming_the_field() {
    let cluster = TestCluster::shared();
    let client = cluster.client().await.expect("client");
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("llmservice.yaml");
    install_crds(&client, &crd)
        .await
        .expect("install the LLMService CRD");
    let ns = cluster
        .namespace(&client, "validation")
        .await
        .expect("namespace");
    let api = Api::<LLMService>::namespaced(client, &ns);

    // A complete valid manifest is accepted, so the refusals below are the rules' doing.
    let valid = manifest(
        "valid",
        json!({
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
            "engine": {"gpuMemoryUtilization": 1.0, "maxNumSeqs": 8, "blockSize": 16,
                       "quantization": "q4_k"},
            "replicas": 2,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetTTFTSeconds": 0.5,
                            "ttftQuantile": 0.9, "targetQueueDepth": 4},
            "gpuResource": "nvidia.com/gpu",
            "rollout": {"maxSurge": 0, "maxUnavailable": 1},
        }),
    );
    api.create(&PostParams::default(), &valid)
        .await
        .expect("a valid manifest is accepted");
    let scales_to_zero = manifest(
        "scales-to-zero",
        json!({
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
                      "aliases": ["smol", "smol-latest"]},
            "replicas": 0,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "targetQueueDepth": 4,
                            "scaleToZeroAfterSeconds": 300},
        }),
    );
    api.create(&PostParams::default(), &scales_to_zero)
        .await
        .expect("minReplicas 0 with a scale-to-zero delay and aliases is accepted");
    let staged = manifest(
        "staged",
        json!({
            "model": hf(),
            "engine": {"pipelineParallelSize": 2, "tensorParallelSize": 4},
            "gpuResource": "nvidia.com/gpu",
            "resources": {"limits": {"memory": "100Gi"}},
            "pod": {"stageTopologyKey": "kubernetes.io/hostname"},
        }),
    );
    api.create(&PostParams::default(), &staged)
        .await
        .expect("a valid pipeline-parallel manifest is accepted");
    for source in [
        "pvc://models/llama/model.gguf",
        "file:///models/smollm2.gguf",
    ] {
        let name = format!("ok-{}", &source[..3]);
        let m = manifest(&name, json!({"model": {"source": source}}));
        api.create(&PostParams::default(), &m).await.expect(source);
    }

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "gpu-mem-zero",
            json!({"model": hf(), "engine": {"gpuMemoryUtilization": 0.0}}),
            "gpuMemoryUtilization must be in (0, 1]",
        ),
        (
            "gpu-mem-above-one",
            json!({"model": hf(), "engine": {"gpuMemoryUtilization": 1.5}}),
            "gpuMemoryUtilization must be in (0, 1]",
        ),
        (
            "tp-zero",
            json!({"model": hf(), "engine": {"tensorParallelSize": 0}}),
            "spec.engine.tensorParallelSize",
        ),
        (
            "seqs-zero",
            json!({"model": hf(), "engine": {"maxNumSeqs": 0}}),
            "spec.engine.maxNumSeqs",
        ),
        (
            "block-zero",
            json!({"model": hf(), "engine": {"blockSize": 0}}),
            "spec.engine.blockSize",
        ),
        (
            "block-too-large",
            json!({"model": hf(), "engine": {"blockSize": 1024}}),
            "spec.engine.blockSize",
        ),
        (
            "min-above-max",
            json!({"model": hf(), "autoscaling":
            {"minReplicas": 5, "maxReplicas": 2, "targetQueueDepth": 4}}),
            "minReplicas must not exceed maxReplicas",
        ),
        (
            "ttft-zero",
            json!({"model": hf(), "autoscaling":
            {"minReplicas": 1, "maxReplicas": 2, "targetTTFTSeconds": 0.0}}),
            "targetTTFTSeconds must be greater than 0",
        ),
        (
            "quantile-one",
            json!({"model": hf(), "autoscaling":
            {"minReplicas": 1, "maxReplicas": 2, "targetTTFTSeconds": 1.0, "ttftQuantile": 1.0}}),
            "ttftQuantile must be in (0, 1)",
        ),
        (
            "no-target",
            json!({"model": hf(), "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}),
            "needs targetTTFTSeconds, targetQueueDepth or both",
        ),
        (
            "zero-delay-without-zero",
            json!({"model": hf(), "autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                   "targetQueueDepth": 4, "scaleToZeroAfterSeconds": 60}}),
            "scaleToZeroAfterSeconds applies only with minReplicas: 0",
        ),
        (
            "empty-alias",
            json!({"model": {"source": "hf://a/b", "aliases": [""]}}),
            "spec.model.aliases must be names of 1 to 256 characters",
        ),
        (
            "alias-twice",
            json!({"model": {"source": "hf://a/b", "aliases": ["x", "x"]}}),
            "spec.model.aliases",
        ),
        (
            "bad-scheme",
            json!({"model": {"source": "s3://bucket/model"}}),
            "spec.model.source must be hf://org/repo, pvc://claim/path or file:///abs/path",
        ),
        (
            "hf-no-repo",
            json!({"model": {"source": "hf://just-an-org"}}),
            "spec.model.source must be",
        ),
        (
            "file-relative",
            json!({"model": {"source": "file://models/x.gguf"}}),
            "spec.model.source must be",
        ),
        (
            "revision-with-pvc",
            json!({"model": {"source": "pvc://models/x.gguf", "revision": "v2"}}),
            "revision is only allowed with hf:// sources",
        ),
        (
            "replicas-outside",
            json!({"model": hf(), "replicas": 9, "autoscaling":
            {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4}}),
            "spec.replicas must lie within",
        ),
        (
            "negative-replicas",
            json!({"model": hf(), "replicas": -1}),
            "spec.replicas",
        ),
        (
            "gpu-resource-name",
            json!({"model": hf(), "gpuResource": "gpu"}),
            "spec.gpuResource must be an extended resource name",
        ),
        (
            "rollout-stuck",
            json!({"model": hf(), "rollout": {"maxSurge": 0, "maxUnavailable": 0}}),
            "maxSurge and maxUnavailable must not both be 0",
        ),
        (
            "stages-times-replicas",
            json!({"model": hf(), "replicas": 4, "engine": {"pipelineParallelSize": 1_073_741_824}}),
            "spec.engine.pipelineParallelSize times the replicas",
        ),
        (
            "topology-without-stages",
            json!({"model": hf(), "pod": {"stageTopologyKey": "kubernetes.io/hostname"}}),
            "spec.pod.stageTopologyKey spreads the pipeline stages",
        ),
        (
            "gpus-in-limits",
            json!({"model": hf(), "gpuResource": "nvidia.com/gpu",
                   "resources": {"limits": {"nvidia.com/gpu": "2"}}}),
            "spec.resources.limits must not name spec.gpuResource",
        ),
        (
            "a-name-too-long-for-the-hostnames-of-a-group-of-stages",
            json!({"model": hf(), "engine": {"pipelineParallelSize": 2}}),
            "metadata.name must be at most 48 characters when spec.engine.pipelineParallelSize",
        ),
    ];
    assert!(cases.len() >= 10);
    for (name, spec, expected) in cases {
        let err = api
            .create(&PostParams::default(), &manifest(name, spec))
            .await
            .expect_err(&format!("{name}: the API server must refuse it"));
        let text = match &err {
            kube::Error::Api(s) => {
                assert_eq!(s.code, 422, "{name}: {s:?}");
                s.message.clone()
            }
            other => panic!("{name}: expected a 422 from the API server, got {other}"),
        };
        assert!(
            text.contains(expected),
            "{name}: {text:?} does not contain {expected:?}"
        );
        assert!(
            text.contains("spec."),
            "{name}: message names no field: {text}"
        );
    }

    // A value the typed client cannot even write: a GPU quantization method, sent raw.
    let raw = Api::<DynamicObject>::namespaced_with(
        api.clone().into_client(),
        &ns,
        &ApiResource::erase::<LLMService>(&()),
    );
    let fp8: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "quant-fp8"},
        "spec": {"model": hf(), "engine": {"quantization": "fp8"}},
    }))
    .expect("a dynamic object");
    let err = raw
        .create(&PostParams::default(), &fp8)
        .await
        .expect_err("fp8 must be refused");
    let text = err.to_string();
    assert!(
        text.contains("spec.engine.quantization") && text.contains("\"q4_k\""),
        "{text}"
    );
}
