//! Command-line interface: flags grouped per concern, and the subcommands they drive.

use std::io::Write;
use std::path::PathBuf;

use candle_core::Device;
use clap::{Args, Parser, Subcommand};

use crate::engine::{EngineConfig, EngineHandle, Event};
use crate::error::{Error, Result};
use crate::model::llama::KvDtype;
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;

/// Ferrite's inference engine.
#[derive(Debug, Parser)]
#[command(name = "ferrite-engine", version, about)]
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
    #[arg(long, env = "HF_ENDPOINT", default_value = crate::download::DEFAULT_ENDPOINT)]
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
    /// HTTP.
    #[command(flatten)]
    pub server: ServerArgs,
    /// KV cache.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Batching.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
}

/// Which model to load.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "FERRITE_MODEL")]
    pub model: PathBuf,
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
    #[arg(long, default_value = "auto", value_parser = ["auto", "f16", "f32"])]
    pub kv_cache_dtype: String,
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
    /// Devices to split the model across within a node (only 1 is supported yet; larger
    /// values are refused at startup).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline stages to split the model into (only 1 is supported yet).
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
        kv_dtype: match cache.kv_cache_dtype.as_str() {
            "f16" => KvDtype::F16,
            "f32" => KvDtype::F32,
            _ => KvDtype::Auto,
        },
        tensor_parallel_size: sched.tensor_parallel_size,
        pipeline_parallel_size: sched.pipeline_parallel_size,
        max_waiting_requests: sched.max_waiting_requests,
    }
}

/// How to pick tokens.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling probability mass, in (0, 1].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalty for tokens already generated, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Penalty per repetition of a generated token, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Multiplicative penalty for tokens in the prompt or output, in (0, 2].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
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
            min_tokens: 0,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_id.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: self.logit_bias.clone(),
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
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate(*args),
        Command::Bench(args) => crate::bench::run(&args),
        Command::Serve(args) => serve(*args),
        Command::Download(args) => download(args),
    }
}

fn download(args: DownloadArgs) -> Result<()> {
    use crate::download::{download, DownloadRequest};
    let (repo, revision) = DownloadRequest::parse_source(&args.source)?;
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty());
    let req = DownloadRequest {
        repo,
        revision,
        file: args.file,
        to: args.to,
        endpoint: args.endpoint,
        token,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let files = runtime.block_on(download(&req))?;
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}

/// Where Kubernetes reads a container's termination message.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// The `serve` flags an LLMService manifest stands for: its model (a `file://` source) and
/// `spec.engine` through the mapping the operator uses.
pub fn manifest_args(path: &std::path::Path) -> Result<Vec<String>> {
    use ferrite_crds::{engine_args, served_model_name, LLMService, ModelSource};
    let bad =
        |m: String| Error::InvalidParameter(format!("--from-manifest {}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let svc: LLMService =
        serde_yaml::from_str(&text).map_err(|e| bad(format!("not an LLMService: {e}")))?;
    let model = &svc.spec.model;
    let file = match ModelSource::parse(&model.source, model.revision.as_deref())
        .map_err(|e| bad(e.to_string()))?
    {
        ModelSource::File(p) => match &model.file {
            Some(f) => p.join(f),
            None => p,
        },
        ModelSource::HuggingFace { .. } | ModelSource::Pvc { .. } => {
            return Err(bad(format!(
                "source `{}` is fetched or mounted by the operator inside a pod; to serve it \
                 locally, point spec.model.source at a local copy with file:///abs/path",
                model.source
            )))
        }
    };
    let mut args = vec![
        "ferrite-engine".to_string(),
        "serve".into(),
        "--model".into(),
        file.display().to_string(),
        "--served-model-name".into(),
        served_model_name(&svc),
    ];
    args.extend(engine_args(&svc.spec.engine));
    Ok(args)
}

fn serve(args: ServeArgs) -> Result<()> {
    use crate::server::{run as run_server, shutdown_signal, AppState, ServerConfig};
    if let Some(manifest) = &args.from_manifest {
        let mut argv = manifest_args(manifest)?;
        let sv = &args.server;
        argv.extend([
            "--host".to_string(),
            sv.host.clone(),
            "--port".into(),
            sv.port.to_string(),
            "--shutdown-timeout".into(),
            sv.shutdown_timeout.to_string(),
            "--max-waiting-requests".into(),
            args.scheduler.max_waiting_requests.to_string(),
        ]);
        tracing::info!("serving {} as: {}", manifest.display(), argv[1..].join(" "));
        let cli = Cli::try_parse_from(&argv).map_err(|e| Error::InvalidParameter(e.to_string()))?;
        return match cli.command {
            Command::Serve(a) => serve(*a),
            _ => Err(Error::InvalidParameter(
                "the manifest did not map to `serve`".into(),
            )),
        };
    }
    let Some(model_path) = args.model.clone() else {
        return Err(Error::InvalidParameter(
            "--model or --from-manifest is required".into(),
        ));
    };
    let err = |e: &dyn std::fmt::Display| Error::Server(e.to_string());
    let mut names = args.server.served_model_name.clone();
    if let Some(empty) = names.iter().find(|n| n.trim().is_empty()) {
        return Err(Error::InvalidParameter(format!(
            "--served-model-name {empty:?}: a served model name must not be empty"
        )));
    }
    if names.is_empty() {
        let p = &model_path;
        let stem = if p.is_dir() {
            p.file_name()
        } else {
            p.file_stem()
        };
        names.push(
            stem.map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        );
    }
    let config = ServerConfig {
        served_model_names: names,
        shutdown_timeout: std::time::Duration::from_secs(args.server.shutdown_timeout),
    };
    let engine_config = engine_config(&args.cache, &args.scheduler);
    let path = model_path.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| err(&e))?;
    let result = runtime.block_on(async move {
        let state = AppState::new(config).map_err(|e| err(&e))?;
        let addr = (args.server.host.as_str(), args.server.port);
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            Error::Server(format!(
                "cannot listen on {}:{}: {e}",
                args.server.host, args.server.port
            ))
        })?;
        tracing::info!(
            "listening on http://{}",
            listener.local_addr().map_err(|e| err(&e))?
        );
        let server = tokio::spawn(run_server(
            listener,
            std::sync::Arc::clone(&state),
            shutdown_signal(),
        ));
        let load_state = std::sync::Arc::clone(&state);
        tokio::task::spawn_blocking(move || -> Result<()> {
            let loaded = crate::model::load(&path, &Device::Cpu)?;
            let tokenizer = loaded.tokenizer.clone();
            let engine = EngineHandle::start(loaded, engine_config)?;
            load_state.set_ready(engine, tokenizer);
            tracing::info!(
                "model loaded; serving `{}`",
                load_state.config.served_model_names.join("`, `")
            );
            Ok(())
        })
        .await
        .map_err(|e| err(&e))??;
        server.await.map_err(|e| err(&e))?.map_err(|e| err(&e))
    });
    if let Err(e) = &result {
        // Kubernetes shows this file as the container's termination message.
        if std::path::Path::new(TERMINATION_LOG).exists() {
            let _ = std::fs::write(TERMINATION_LOG, e.to_string());
        }
    }
    result
}

fn generate(args: GenerateArgs) -> Result<()> {
    let texts: Vec<String> = match (&args.prompts_file, &args.prompt) {
        (Some(path), _) => {
            let file = std::fs::read_to_string(path).map_err(|e| {
                Error::InvalidParameter(format!("--prompts-file {}: {e}", path.display()))
            })?;
            let lines: Vec<String> = file
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect();
            if lines.is_empty() {
                return Err(Error::InvalidParameter(format!(
                    "--prompts-file {} holds no prompts: it needs one prompt per line (blank \
                     lines are skipped)",
                    path.display()
                )));
            }
            lines
        }
        (None, Some(_)) if args.num_prompts == 0 => {
            return Err(Error::InvalidParameter(
                "--num-prompts must be at least 1, got 0".into(),
            ))
        }
        (None, Some(p)) => vec![p.clone(); args.num_prompts],
        (None, None) => Vec::new(),
    };
    let loaded = crate::model::load(&args.model.model, &Device::Cpu)?;
    let template = if args.chat {
        Some(loaded.tokenizer.chat_template()?)
    } else {
        None
    };
    let mut prompts = Vec::with_capacity(texts.len());
    for text in &texts {
        prompts.push(match &template {
            Some(t) => {
                let mut messages = Vec::new();
                if let Some(system) = &args.system {
                    messages.push(ChatMessage::new("system", system.clone()));
                }
                messages.push(ChatMessage::new("user", text.clone()));
                loaded
                    .tokenizer
                    .encode(&t.render(&messages, true)?, false)?
            }
            None => loaded.tokenizer.encode(text, true)?,
        });
    }
    let mut config = engine_config(&args.cache, &args.scheduler);
    // Every prompt is submitted at once.
    config.max_waiting_requests = config.max_waiting_requests.max(prompts.len());
    let engine = EngineHandle::start(loaded, config)?;
    let start = std::time::Instant::now();
    let streams = prompts
        .iter()
        .map(|p| engine.submit(p.clone(), args.sampling.params()))
        .collect::<Result<Vec<_>>>()?;
    let io = |e: std::io::Error| Error::InvalidParameter(format!("cannot write to stdout: {e}"));
    let mut out = std::io::stdout();
    // Each request's first token time, and the prompt tokens served from the prefix cache.
    let (mut firsts, mut generated, mut cached) = (Vec::new(), 0usize, 0usize);
    let single = streams.len() == 1;
    for (i, mut stream) in streams.into_iter().enumerate() {
        if !single {
            writeln!(out, "--- {} ---", i + 1).map_err(io)?;
        }
        let mut first_token = None;
        while let Some(ev) = stream.next_blocking() {
            match ev {
                Event::Token { text, .. } => {
                    first_token.get_or_insert_with(std::time::Instant::now);
                    generated += 1;
                    out.write_all(text.as_bytes())
                        .and_then(|()| out.flush())
                        .map_err(io)?;
                }
                // `generate` does not ask for them.
                Event::PromptLogprobs(_) => {}
                Event::Finished(f) => {
                    writeln!(out).map_err(io)?;
                    if single {
                        eprintln!("finish: {}", f.reason.as_str());
                    }
                    cached += f.cached_tokens;
                    break;
                }
            }
        }
        firsts.extend(first_token);
    }
    let end = std::time::Instant::now();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let seconds = |t: std::time::Instant| (t - start).as_secs_f64();
    if let ([first], true) = (firsts.as_slice(), single) {
        eprintln!(
            "prompt: {prompt_tokens} tokens, {:.1} tok/s | decode: {generated} tokens, {:.1} tok/s",
            prompt_tokens as f64 / seconds(*first).max(1e-9),
            generated.saturating_sub(1) as f64 / (end - *first).as_secs_f64().max(1e-9),
        );
    } else {
        // Many requests share steps, so their prompts and decodes overlap: whole-run figures.
        let (soonest, latest) = firsts.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &t| {
            (lo.min(seconds(t)), hi.max(seconds(t)))
        });
        let total = seconds(end);
        eprintln!(
            "{} request(s) in {total:.2} s: prompts {prompt_tokens} tokens ({cached} from the prefix cache), {generated} tokens generated, {:.1} output tok/s | first tokens after {:.2}–{:.2} s",
            prompts.len(),
            generated as f64 / total.max(1e-9),
            soonest.min(latest),
            latest
        );
    }
    Ok(())
}
