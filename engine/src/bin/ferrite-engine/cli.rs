//! The command line: flags grouped per concern, named as vLLM names them, and the
//! engine settings they stand for.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ferrite_engine::engine::{ComputeDevice, EngineConfig};
use ferrite_engine::kv::KvDtype;
use ferrite_engine::model::LoadOptions;
use ferrite_engine::sampling::SamplingParams;

/// Ferrite's inference engine.
#[derive(Debug, Parser)]
#[command(name = "ferrite-engine", version, about, args_override_self = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The engine's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a completion for one prompt and print it with prompt and decode speed.
    Generate(Box<GenerateArgs>),
    /// Measure prompt processing, single-stream decode and the memory-bandwidth bound.
    Bench(BenchArgs),
    /// Serve the model over the OpenAI-compatible HTTP API.
    Serve(Box<ServeArgs>),
    /// Fetch a model from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN) into a folder.
    Download(DownloadArgs),
    /// Measure the model's perplexity on a text file (llama.cpp's llama-perplexity method).
    Perplexity(PerplexityArgs),
}

/// Flags of `ferrite-engine perplexity`.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// The model, and how its weights are held.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (UTF-8).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window; the second half of each window is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many windows (default: as many as the text fills).
    #[arg(long)]
    pub max_windows: Option<usize>,
    /// Also print the result as one JSON line.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `ferrite-engine download`.
#[derive(Debug, Args)]
pub struct DownloadArgs {
    /// `hf://org/repo` or `hf://org/repo@revision` (default revision: main).
    pub source: String,
    /// Folder to write the files into (created if missing).
    #[arg(long)]
    pub to: PathBuf,
    /// Only this file of the repository (e.g. one GGUF of several).
    #[arg(long)]
    pub file: Option<String>,
    /// The hub's base URL.
    #[arg(long, env = "HF_ENDPOINT", default_value = ferrite_engine::download::DEFAULT_ENDPOINT)]
    pub endpoint: String,
}

/// Where and how the HTTP server listens.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Address to bind.
    #[arg(long, env = "FERRITE_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// Port to bind.
    #[arg(long, env = "FERRITE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// The `model` name(s) clients use, as vLLM takes them (`--served-model-name a b`):
    /// requests may name any of them, and metrics carry the first; default: the model file
    /// or directory name.
    #[arg(long, env = "FERRITE_SERVED_MODEL_NAME", num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Seconds in-flight requests may run after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Most Responses API responses kept in memory for `previous_response_id` and
    /// `GET /v1/responses/{id}`, the oldest evicted first; 0 stores none.
    #[arg(long, env = "FERRITE_MAX_STORED_RESPONSES", default_value_t = 1024)]
    pub max_stored_responses: usize,
    /// Seconds without progress, while requests are pending, after which `/health` answers
    /// 500 so a liveness probe restarts the server (a step that never returns); 0 never.
    #[arg(long, env = "FERRITE_STALL_TIMEOUT", default_value_t = 120)]
    pub stall_timeout: u64,
}

/// Flags of `ferrite-engine serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A GGUF file or a Hugging Face model directory.
    #[arg(long, env = "FERRITE_MODEL", required_unless_present = "from_manifest")]
    pub model: Option<PathBuf>,
    /// Serve an LLMService manifest's model and engine settings, with the flags the
    /// operator gives the pod; server flags (--host, --port, ...) still apply.
    #[arg(long, conflicts_with = "model")]
    pub from_manifest: Option<PathBuf>,
    /// How the weights are held.
    #[command(flatten)]
    pub load: LoadArgs,
    /// HTTP.
    #[command(flatten)]
    pub server: ServerArgs,
    /// KV cache.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Batching.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    /// The ranks of a model-parallel group.
    #[command(flatten)]
    pub group: GroupArgs,
}

/// How the ranks of a pipeline-parallel group find each other (vLLM's multi-node flags).
#[derive(Debug, Args, Clone)]
pub struct GroupArgs {
    /// Hosts the group spans: 1 (the leader starts every stage on this host) or the
    /// pipeline size (one stage per host, each started with its own --node-rank).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's rank in the group: 0 is the leader (the OpenAI API); the others run
    /// with --headless.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The leader's address, which the other ranks connect to.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// The port the leader admits ranks on.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Serve no OpenAI API, only `/health` (ranks other than 0).
    #[arg(long)]
    pub headless: bool,
    /// File holding the group's shared secret (required across hosts; else read from
    /// FERRITE_GROUP_SECRET). Never logged.
    #[arg(long, env = "FERRITE_GROUP_SECRET_FILE")]
    pub group_secret_file: Option<PathBuf>,
    /// Seconds the group may take to form before startup fails naming the missing rank.
    #[arg(long, default_value_t = 300)]
    pub group_timeout: u64,
    /// A rank the leader started on this host: secret on stdin, exits when stdin closes.
    #[arg(long, hide = true)]
    pub group_child: bool,
    /// A tensor-parallel rank (1 or more) its stage's rank 0 started: the shared memory's
    /// path on stdin, exits when stdin closes.
    #[arg(long, hide = true, default_value_t = 0)]
    pub tensor_rank: usize,
}

impl GroupArgs {
    /// These flags as arguments again (to carry them through `--from-manifest`).
    pub fn to_args(&self) -> Vec<String> {
        let mut out = vec![
            "--nnodes".to_string(),
            self.nnodes.to_string(),
            "--node-rank".into(),
            self.node_rank.to_string(),
            "--master-addr".into(),
            self.master_addr.clone(),
            "--master-port".into(),
            self.master_port.to_string(),
            "--group-timeout".into(),
            self.group_timeout.to_string(),
        ];
        if let Some(f) = &self.group_secret_file {
            out.extend(["--group-secret-file".into(), f.display().to_string()]);
        }
        if self.tensor_rank > 0 {
            out.extend(["--tensor-rank".into(), self.tensor_rank.to_string()]);
        }
        for (on, flag) in [
            (self.headless, "--headless"),
            (self.group_child, "--group-child"),
        ] {
            if on {
                out.push(flag.into());
            }
        }
        out
    }
}

/// Which model to load.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "FERRITE_MODEL")]
    pub model: PathBuf,
    /// How the weights are held.
    #[command(flatten)]
    pub load: LoadArgs,
}

/// How the weights are held in memory.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Quantize the checkpoint's floating-point matrices while loading: q8_0, q4_0, q4_1,
    /// q5_0, q5_1, q2_k, q3_k, q4_k, q5_k or q6_k (every matrix in that llama.cpp block format,
    /// as `llama-quantize --pure` writes it), or q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m,
    /// q5_k_s or q5_k_m (llama.cpp's K-quant mixes: each matrix in the format `llama-quantize`
    /// chooses for it); matrices a GGUF file stores quantized are kept as they are. vLLM's GPU methods (fp8, awq, gptq, ...) are
    /// refused.
    #[arg(long, env = "FERRITE_QUANTIZATION", value_parser = ferrite_engine::model::parse_quantization)]
    pub quantization: Option<ferrite_engine::model::Quantization>,
}

impl LoadArgs {
    /// The load options these flags describe.
    pub fn options(&self) -> LoadOptions {
        LoadOptions {
            quantization: self.quantization,
            stage: None,
            tensor: None,
        }
    }
}

/// How large the KV cache is and how it is shared (vLLM's names).
#[derive(Debug, Args)]
pub struct CacheArgs {
    /// Tokens per KV cache block, 1 to 256.
    #[arg(long, env = "FERRITE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Fraction of device memory (on CPU: the cgroup limit, else the machine's memory) for
    /// weights, activations and the KV cache, in (0, 1].
    #[arg(long, env = "FERRITE_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// KV cache size in bytes; overrides --gpu-memory-utilization.
    #[arg(long, env = "FERRITE_KV_CACHE_MEMORY")]
    pub kv_cache_memory: Option<u64>,
    /// Share KV blocks between requests with a common prefix (the default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Compute every prompt in full.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// KV cache element type: auto (f32 for f32 checkpoints, else f16), f16 or f32.
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Where to compute: the engine runs on CPU; `cuda` is refused (there is no GPU
    /// backend), so a pod given GPUs fails at startup instead of leaving them idle.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU (refused: no GPU backend is built).
    Cuda,
}

/// `--kv-cache-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtype {
    /// f32 for f32 checkpoints, else f16.
    Auto,
    /// Half precision (llama.cpp's numerics).
    F16,
    /// Single precision.
    F32,
}

impl From<KvCacheDtype> for KvDtype {
    fn from(d: KvCacheDtype) -> Self {
        match d {
            KvCacheDtype::Auto => KvDtype::Auto,
            KvCacheDtype::F16 => KvDtype::F16,
            KvCacheDtype::F32 => KvDtype::F32,
        }
    }
}

/// How requests are batched (vLLM's names).
#[derive(Debug, Args)]
pub struct SchedulerArgs {
    /// Most sequences running at once.
    #[arg(long, env = "FERRITE_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks and decodes) in one step; longer prompts are chunked.
    #[arg(long, env = "FERRITE_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus completion; default: the model's context length.
    #[arg(long, env = "FERRITE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Tensor-parallel ranks per pipeline stage, all on one host: each a process holding
    /// 1/T of every layer (attention heads, MLP rows, vocabulary rows), exchanging
    /// activations through shared memory; it must divide the model's KV heads.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline stages to split the model into, each a process holding a contiguous range
    /// of layers and their KV cache: on one host (--nnodes 1) the leader starts them
    /// itself, the machine's threads divided among them; across hosts one per --node-rank.
    #[arg(long, default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// Requests that may wait for their first step at any instant; beyond this new requests
    /// get 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting_requests: usize,
}

/// The engine configuration these flags describe.
pub fn engine_config(cache: &CacheArgs, sched: &SchedulerArgs) -> EngineConfig {
    EngineConfig {
        block_size: cache.block_size,
        max_num_seqs: sched.max_num_seqs,
        max_num_batched_tokens: sched.max_num_batched_tokens,
        max_model_len: sched.max_model_len,
        gpu_memory_utilization: cache.gpu_memory_utilization,
        kv_cache_memory: cache.kv_cache_memory,
        enable_prefix_caching: !cache.no_enable_prefix_caching,
        kv_dtype: cache.kv_cache_dtype.into(),
        device: match cache.device {
            Device::Auto => ComputeDevice::Auto,
            Device::Cpu => ComputeDevice::Cpu,
            Device::Cuda => ComputeDevice::Cuda,
        },
        tensor_parallel_size: sched.tensor_parallel_size,
        pipeline_parallel_size: sched.pipeline_parallel_size,
        max_waiting_requests: sched.max_waiting_requests,
    }
}

/// How to pick tokens; defaults are the engine's ([`SamplingParams::DEFAULT`]) except the
/// temperature, greedy here.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Softmax temperature in [0, 2]; 0 (the default here) is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling probability mass, in (0, 1].
    #[arg(long, default_value_t = SamplingParams::DEFAULT.top_p, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = SamplingParams::DEFAULT.top_k)]
    pub top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = SamplingParams::DEFAULT.min_p, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalty for tokens already generated, in [-2, 2].
    #[arg(long, default_value_t = SamplingParams::DEFAULT.presence_penalty, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Penalty per repetition of a generated token, in [-2, 2].
    #[arg(long, default_value_t = SamplingParams::DEFAULT.frequency_penalty, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Multiplicative penalty for tokens in the prompt or output, in (0, 2].
    #[arg(long, default_value_t = SamplingParams::DEFAULT.repetition_penalty, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Random seed; the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Add BIAS (in [-100, 100]) to token ID's logit before sampling, as `ID=BIAS`
    /// (repeatable; OpenAI's `logit_bias`).
    #[arg(long, value_parser = parse_logit_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop at this token id (repeatable).
    #[arg(long)]
    pub stop_token_id: Vec<u32>,
    /// Keep generating past the model's end token.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS (a token id and a number), got {s:?}"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("{id:?} is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("{bias:?} is not a number"))?;
    Ok((id, bias))
}

impl SamplingArgs {
    /// The sampling parameters these flags describe.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_id.clone(),
            ignore_eos: self.ignore_eos,
            logit_bias: self.logit_bias.clone(),
            ..SamplingParams::DEFAULT
        }
    }
}

/// Flags of `ferrite-engine generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompts_file")]
    pub prompt: Option<String>,
    /// Run the prompt this many times at once through the batcher.
    #[arg(long, default_value_t = 1, conflicts_with = "prompts_file")]
    pub num_prompts: usize,
    /// Run every line of this file as a prompt, all at once through the batcher.
    #[arg(long, conflicts_with = "prompt")]
    pub prompts_file: Option<PathBuf>,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for `--chat`.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// KV cache.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Batching.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
}

/// Flags of `ferrite-engine bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prompt-processing measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded for the single-stream measurement.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Repetitions: prompt processing and single-stream decode report the best run; the
    /// batching tables run every row this many times, interleaved, and report the median.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Concurrent request counts for the batching tables; `--concurrency` with no value
    /// skips them.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1,4,16,64")]
    pub concurrency: Vec<usize>,
    /// Requests for the naive baseline (one at a time, --max-num-seqs 1); 0 skips it.
    #[arg(long, default_value_t = 16)]
    pub naive_requests: usize,
    /// Prompt and output length of each batching request.
    #[arg(long, default_value_t = 128)]
    pub request_tokens: usize,
    /// Requests each client sends back to back in the steady-traffic table (clients join
    /// one at a time); 0 skips that table.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> ferrite_engine::Result<()> {
    match cli.command {
        Command::Generate(args) => crate::generate::run(*args),
        Command::Bench(args) => crate::bench::run(&args),
        Command::Serve(args) => crate::serve::run(*args),
        Command::Download(args) => crate::download::run(args),
        Command::Perplexity(args) => crate::perplexity::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(rel: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(rel);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    #[test]
    fn the_images_default_command_parses() {
        let dockerfile = read("engine/Dockerfile");
        let cmd_line = dockerfile
            .lines()
            .rev()
            .find(|l| l.starts_with("CMD"))
            .expect("CMD");
        let cmd: Vec<String> = serde_json::from_str(cmd_line[3..].trim()).expect("exec-form CMD");
        let parsed = Cli::try_parse_from(std::iter::once("ferrite-engine".to_string()).chain(cmd));
        // `--help` ends parsing with a help "error"; anything else is a wrong flag.
        if let Err(e) = parsed {
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{e}");
        }
    }

    #[test]
    fn every_engine_invocation_the_operator_renders_parses() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../operator/tests/snapshots");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).expect("snapshots") {
            let path = entry.expect("entry").path();
            let text = std::fs::read_to_string(&path).expect("snapshot");
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("yaml");
                if v["kind"] != "Deployment" {
                    continue;
                }
                let pod = &v["spec"]["template"]["spec"];
                let containers = pod["containers"].as_array().into_iter().flatten();
                let init = pod["initContainers"].as_array().into_iter().flatten();
                for c in containers.chain(init) {
                    let args: Vec<String> = c["args"]
                        .as_array()
                        .expect("args")
                        .iter()
                        .map(|a| a.as_str().expect("string").to_string())
                        .collect();
                    Cli::try_parse_from(
                        std::iter::once("ferrite-engine".to_string()).chain(args.clone()),
                    )
                    .unwrap_or_else(|e| panic!("{}: {args:?} rejected: {e}", path.display()));
                    assert!(
                        c.get("command").is_none(),
                        "the image's ENTRYPOINT must run"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 9, "only {checked} invocations found");
    }
}
