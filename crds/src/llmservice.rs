//! `LLMService` (`serving.ferrite.dev/v1alpha1`): one manifest describes a served model,
//! how the engine runs it, how many replicas serve it and how they scale.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A large language model served behind a cluster-internal OpenAI-compatible endpoint.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "serving.ferrite.dev",
    version = "v1alpha1",
    kind = "LLMService",
    plural = "llmservices",
    shortname = "llms",
    doc = "A large language model served by Ferrite: engine pods behind a cluster-internal OpenAI-compatible endpoint, scaled on time-to-first-token and queue depth.",
    namespaced,
    status = "LLMServiceStatus",
    scale = r#"{"specReplicasPath":".spec.replicas","statusReplicasPath":".status.replicas","labelSelectorPath":".status.selector"}"#,
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model.source"}"#,
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".status.desiredReplicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"TTFT","type":"number","jsonPath":".status.autoscaling.ttftSeconds"}"#,
    printcolumn = r#"{"name":"Queue","type":"number","jsonPath":".status.autoscaling.queueDepthPerReplica"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("size(self.metadata.name) <= 63").message("metadata.name must be at most 63 characters: it names the Service"),
    validation = Rule::new(
        "!has(self.spec.engine.pipelineParallelSize) || self.spec.engine.pipelineParallelSize <= 1 || size(self.metadata.name) <= 48"
    ).message("metadata.name must be at most 48 characters when spec.engine.pipelineParallelSize is above 1: a group's pods are named <name>-stages-<group>-<stage>, which must stay a 63-character hostname")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!has(self.autoscaling) || !has(self.replicas) || \
     (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)"
).message("spec.replicas must lie within spec.autoscaling.minReplicas..maxReplicas when autoscaling is set").field_path(".replicas"))]
#[x_kube(validation = Rule::new(
    "!has(self.engine.pipelineParallelSize) || \
     (has(self.autoscaling) ? self.autoscaling.maxReplicas : (has(self.replicas) ? self.replicas : 1)) \
     * self.engine.pipelineParallelSize <= 2147483647"
).message("spec.engine.pipelineParallelSize times the replicas (spec.replicas or spec.autoscaling.maxReplicas) must not exceed 2147483647: a LeaderWorkerSet holds replicas x size pods").field_path(".engine.pipelineParallelSize"))]
#[x_kube(validation = Rule::new(
    "!has(self.pod) || !has(self.pod.stageTopologyKey) || \
     (has(self.engine.pipelineParallelSize) && self.engine.pipelineParallelSize > 1)"
).message("spec.pod.stageTopologyKey spreads the pipeline stages of a replica across nodes, so it needs spec.engine.pipelineParallelSize above 1").field_path(".pod.stageTopologyKey"))]
#[x_kube(validation = Rule::new(
    "!has(self.gpuResource) || !has(self.resources) || !has(self.resources.limits) || \
     !(self.gpuResource in self.resources.limits)"
).message("spec.resources.limits must not name spec.gpuResource: the operator requests spec.engine.tensorParallelSize GPUs per pod (times pipelineParallelSize when one pod holds every stage)").field_path(".resources.limits"))]
pub struct LLMServiceSpec {
    /// Which model to serve and where its weights come from.
    pub model: ModelSpec,
    /// Engine settings; each maps to the engine flag of the same vLLM name.
    #[serde(default)]
    pub engine: EngineSpec,
    /// Number of engine replicas when `autoscaling` is absent (also set by the scale
    /// subresource, `kubectl scale`, HPA or KEDA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub replicas: Option<i32>,
    /// Scale on time-to-first-token and queue depth scraped from the engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    /// CPU and memory requests and limits of the engine container; GPUs are added from
    /// `gpuResource`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Extended resource name of the GPUs (e.g. `nvidia.com/gpu`). A replica in one pod
    /// requests `tensorParallelSize` of them; with `pipelineParallelSize` above 1 each stage
    /// is a pod of its own and requests `tensorParallelSize`. Omitted: the CPU engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 3, max = 253))]
    #[x_kube(validation = Rule::new("self.contains('/')").message("spec.gpuResource must be an extended resource name such as nvidia.com/gpu"))]
    pub gpu_resource: Option<String>,
    /// Engine image, overriding the operator's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Scheduling and environment settings of the engine pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodSettings>,
    /// How a changed model or engine setting rolls out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// An InferencePool (Gateway API Inference Extension, `inference.networking.k8s.io/v1`)
    /// selecting this LLMService's engine pods on port 8000, for gateways that route through
    /// an endpoint picker; rendered when that API is installed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolSpec>,
}

/// Whether and how the LLMService gets an InferencePool.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Render the InferencePool; default: the operator's `--inference-pools` setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The endpoint picker the gateway asks which pod serves each request (the pool's
    /// `endpointPickerRef`); most gateways need one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker: Option<EndpointPickerSpec>,
}

/// The endpoint picker Service of an InferencePool, in the LLMService's namespace.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerSpec {
    /// The picker's Service.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The picker's port (default 9002, the endpoint picker's gRPC port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// What the gateway does when the picker does not answer: FailOpen (send to any pod) or
    /// FailClose (refuse); default FailClose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// An endpoint picker's failure mode.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum FailureMode {
    /// Send the request to any pod of the pool.
    FailOpen,
    /// Refuse the request.
    FailClose,
}

/// The model and its source.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.revision) || self.source.startsWith('hf://')")
    .message("spec.model.revision is only allowed with hf:// sources").field_path(".revision"))]
pub struct ModelSpec {
    /// Where the weights are: `hf://org/repo`, `pvc://claim/path` or `file:///abs/path`.
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(
        "self.matches('^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$') || \
         self.matches('^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.*$') || self.matches('^file:///.+$')"
    ).message("spec.model.source must be hf://org/repo, pvc://claim/path or file:///abs/path"))]
    pub source: String,
    /// Hugging Face revision (branch, tag or commit); only with `hf://` sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub revision: Option<String>,
    /// Which file to load when the source holds several GGUF files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The `model` value clients send in OpenAI requests; default: `metadata.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,
    /// More `model` values this LLMService answers to, beside `servedName` (the engine
    /// serves each, and the router routes each here): at most 8 distinct names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new("self.all(a, size(a) > 0 && size(a) <= 256)")
        .message("spec.model.aliases must be names of 1 to 256 characters"))]
    pub aliases: Vec<String>,
    /// Secret holding `HF_TOKEN` for gated or private Hugging Face repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_hub_secret: Option<String>,
}

/// Engine settings, each mapped one to one to a vLLM-named engine flag.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Ranks a model's layers are split across within a pod (`--tensor-parallel-size`): GPUs
    /// of one node, or on CPU processes the engine starts itself. The engine refuses, at
    /// startup, a size that does not divide the model's KV heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tensor_parallel_size: Option<i32>,
    /// Pipeline stages a model is split into (`--pipeline-parallel-size`). Above 1, each
    /// replica becomes a LeaderWorkerSet group of this many pods, one stage per pod (the
    /// LeaderWorkerSet controller must be installed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub pipeline_parallel_size: Option<i32>,
    /// Fraction of device memory for weights, activations and KV cache, in (0, 1]
    /// (`--gpu-memory-utilization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0 && self <= 1.0")
        .message("spec.engine.gpuMemoryUtilization must be in (0, 1]"))]
    pub gpu_memory_utilization: Option<f64>,
    /// Longest prompt plus completion (`--max-model-len`); default: the model's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_model_len: Option<i64>,
    /// Sequences running at once (`--max-num-seqs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_num_seqs: Option<i64>,
    /// Tokens per engine step; longer prompts are chunked (`--max-num-batched-tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_num_batched_tokens: Option<i64>,
    /// Tokens per KV cache block (`--block-size`), 1 to 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub block_size: Option<i64>,
    /// Share KV blocks of common prompt prefixes (`--enable-prefix-caching` /
    /// `--no-enable-prefix-caching`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_prefix_caching: Option<bool>,
    /// Quantize the checkpoint's floating-point weights while loading (`--quantization`),
    /// to one of llama.cpp's block formats or K-quant mixes; weights a GGUF file stores
    /// quantized are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Quantization>,
    /// Further engine flags, appended verbatim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
}

/// Quantize the checkpoint's floating-point weights while loading (`--quantization`): every
/// matrix to one of llama.cpp's block formats, or each to the format one of its K-quant
/// mixes chooses for it; weights a GGUF file stores quantized are kept.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Quantization {
    /// 8-bit blocks of 32 with an f16 scale (llama.cpp's Q8_0): closest to the original.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale (Q4_0).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (Q4_1).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// 5-bit blocks of 32 with an f16 scale (Q5_0).
    #[serde(rename = "q5_0")]
    Q5_0,
    /// 5-bit blocks of 32 with an f16 scale and minimum (Q5_1).
    #[serde(rename = "q5_1")]
    Q5_1,
    /// 2-bit super-blocks of 256 with 4-bit scales and minimums (Q2_K): smallest, least
    /// faithful.
    #[serde(rename = "q2_k")]
    Q2K,
    /// 3-bit super-blocks of 256 with 6-bit scales (Q3_K).
    #[serde(rename = "q3_k")]
    Q3K,
    /// 4-bit super-blocks of 256 with 6-bit scales and minimums (Q4_K).
    #[serde(rename = "q4_k")]
    Q4K,
    /// 5-bit super-blocks of 256 with 6-bit scales and minimums (Q5_K).
    #[serde(rename = "q5_k")]
    Q5K,
    /// 6-bit super-blocks of 256 (Q6_K).
    #[serde(rename = "q6_k")]
    Q6K,
    /// llama.cpp's Q3_K_S mix: Q3_K, the output projection Q6_K.
    #[serde(rename = "q3_k_s")]
    Q3KS,
    /// llama.cpp's Q3_K_M mix: Q3_K, with Q4_K and Q5_K where quantizing costs most.
    #[serde(rename = "q3_k_m")]
    Q3KM,
    /// llama.cpp's Q3_K_L mix: Q3_K, with Q5_K where quantizing costs most.
    #[serde(rename = "q3_k_l")]
    Q3KL,
    /// llama.cpp's Q4_K_S mix: Q4_K, with Q5_K in the first layers' value and down
    /// projections.
    #[serde(rename = "q4_k_s")]
    Q4KS,
    /// llama.cpp's Q4_K_M mix, its most used: Q4_K, with Q6_K in about half the value and
    /// down projections.
    #[serde(rename = "q4_k_m")]
    Q4KM,
    /// llama.cpp's Q5_K_S mix: Q5_K, the output projection Q6_K.
    #[serde(rename = "q5_k_s")]
    Q5KS,
    /// llama.cpp's Q5_K_M mix: Q5_K, with Q6_K in about half the value and down projections.
    #[serde(rename = "q5_k_m")]
    Q5KM,
}

impl Quantization {
    /// The engine's `--quantization` value.
    pub fn flag_value(self) -> &'static str {
        match self {
            Quantization::Q8_0 => "q8_0",
            Quantization::Q4_0 => "q4_0",
            Quantization::Q4_1 => "q4_1",
            Quantization::Q5_0 => "q5_0",
            Quantization::Q5_1 => "q5_1",
            Quantization::Q2K => "q2_k",
            Quantization::Q3K => "q3_k",
            Quantization::Q4K => "q4_k",
            Quantization::Q5K => "q5_k",
            Quantization::Q6K => "q6_k",
            Quantization::Q3KS => "q3_k_s",
            Quantization::Q3KM => "q3_k_m",
            Quantization::Q3KL => "q3_k_l",
            Quantization::Q4KS => "q4_k_s",
            Quantization::Q4KM => "q4_k_m",
            Quantization::Q5KS => "q5_k_s",
            Quantization::Q5KM => "q5_k_m",
        }
    }
}

/// Autoscaling on latency and queue depth.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas")
    .message("spec.autoscaling.minReplicas must not exceed maxReplicas").field_path(".minReplicas"))]
#[x_kube(validation = Rule::new("has(self.targetTTFTSeconds) || has(self.targetQueueDepth)")
    .message("spec.autoscaling needs targetTTFTSeconds, targetQueueDepth or both"))]
#[x_kube(validation = Rule::new("!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0")
    .message("spec.autoscaling.scaleToZeroAfterSeconds applies only with minReplicas: 0")
    .field_path(".scaleToZeroAfterSeconds"))]
pub struct AutoscalingSpec {
    /// Fewest replicas. 0 lets the LLMService scale to zero after `scaleToZeroAfterSeconds`
    /// without requests; a request through the router then brings one replica back, held
    /// until it is ready.
    #[schemars(range(min = 0))]
    pub min_replicas: i32,
    /// Most replicas.
    #[schemars(range(min = 1))]
    pub max_replicas: i32,
    /// Target time to first token at `ttftQuantile`, in seconds.
    #[serde(
        default,
        rename = "targetTTFTSeconds",
        skip_serializing_if = "Option::is_none"
    )]
    #[x_kube(validation = Rule::new("self > 0.0")
        .message("spec.autoscaling.targetTTFTSeconds must be greater than 0"))]
    pub target_ttft_seconds: Option<f64>,
    /// Quantile of TTFT over the window that must meet the target, in (0, 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0 && self < 1.0")
        .message("spec.autoscaling.ttftQuantile must be in (0, 1), e.g. 0.9"))]
    pub ttft_quantile: Option<f64>,
    /// Target waiting requests per ready replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0")
        .message("spec.autoscaling.targetQueueDepth must be greater than 0"))]
    pub target_queue_depth: Option<f64>,
    /// Window the TTFT quantile is computed over, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub window_seconds: Option<i64>,
    /// Scale down only to the highest recommendation of this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub scale_down_stabilization_seconds: Option<i64>,
    /// With `minReplicas: 0`, seconds without a request (none running, waiting or finished)
    /// before the LLMService scales to zero; default 600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub scale_to_zero_after_seconds: Option<i64>,
}

/// Pod-level settings of the engine pods.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodSettings {
    /// Node labels the pods must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node and pod affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Priority class of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Secrets for pulling the engine image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Extra environment variables of the engine container (`HF_ENDPOINT` also reaches the
    /// model downloader).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Seconds the startup probe allows for the model to load before the pod is restarted;
    /// default: sized from the model (5 minutes plus 20 s per billion parameters in its name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10))]
    pub startup_timeout_seconds: Option<i64>,
    /// With `pipelineParallelSize` above 1: a node label (e.g. `kubernetes.io/hostname`)
    /// whose values the pods of one replica must not share, so its stages land on
    /// different nodes (a required pod anti-affinity within the group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 316))]
    pub stage_topology_key: Option<String>,
}

/// Rolling update bounds.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.maxSurge) ? self.maxSurge : 1) + (has(self.maxUnavailable) ? self.maxUnavailable : 0) > 0")
    .message("spec.rollout.maxSurge and maxUnavailable must not both be 0"))]
pub struct RolloutSpec {
    /// Extra replicas a rollout may start above the desired count (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_surge: Option<i32>,
    /// Replicas a rollout may take out of service at once (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_unavailable: Option<i32>,
}

/// Observed state, written by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LLMServiceStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pending, Loading, Ready, Idle (scaled to zero, comes back on demand), Degraded or
    /// Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Replicas that exist: engine pods, or groups of pods when the model is split into
    /// pipeline stages (`parallelism.podsPerReplica` above 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub replicas: Option<i32>,
    /// Replicas that serve traffic (a group counts once all of its pods are ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Replicas the operator wants (from `replicas` or the autoscaler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// Label selector of the pods that serve the API (a group's leaders only), for the scale
    /// subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The OpenAI base URL inside the cluster, `http://<name>.<ns>.svc:8000/v1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Ready, Progressing, Available, ScalingLimited.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// What the autoscaler last measured and did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,
    /// How each replica is laid out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<ParallelismStatus>,
}

/// How one replica is split: tensor ranks within a pod, pipeline stages across pods.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParallelismStatus {
    /// Tensor-parallel ranks per stage (`tensorParallelSize`), all in one pod.
    pub tensor: i32,
    /// Pipeline stages (`pipelineParallelSize`).
    pub pipeline: i32,
    /// Pods per replica: 1, or one per stage (a LeaderWorkerSet group).
    pub pods_per_replica: i32,
}

/// The autoscaler's last observation and decision.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// TTFT at the configured quantile over the window, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_seconds: Option<f64>,
    /// Waiting requests per ready replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth_per_replica: Option<f64>,
    /// When the replica count last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<String>,
    /// Why it last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_reason: Option<String>,
    /// When a request last arrived for the model while it had no replica (RFC 3339): the
    /// router writes it, and an LLMService at zero scales to one replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_requested_at: Option<String>,
}
