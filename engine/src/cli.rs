//! Command-line interface: flags grouped per concern, and the subcommands they drive.

use std::io::Write;
use std::path::PathBuf;

use candle_core::Device;
use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result};
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
    Generate(GenerateArgs),
    /// Measure prompt processing, single-stream decode and the memory-bandwidth bound.
    Bench(BenchArgs),
}

/// Which model to load.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "FERRITE_MODEL")]
    pub model: PathBuf,
}

/// How to pick tokens.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling probability mass, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalty for tokens already generated, in [-2, 2].
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Penalty per repetition of a generated token, in [-2, 2].
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Multiplicative penalty for tokens in the prompt or output, in (0, 2].
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed; the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Stop at this token id (repeatable).
    #[arg(long)]
    pub stop_token_id: Vec<u32>,
    /// Keep generating past the model's end token.
    #[arg(long)]
    pub ignore_eos: bool,
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
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for `--chat`.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
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
    /// Repetitions; the best run is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate(args),
        Command::Bench(args) => crate::bench::run(&args),
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let loaded = crate::model::load(&args.model.model, &Device::Cpu)?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        let text = loaded.tokenizer.chat_template()?.render(&messages, true)?;
        loaded.tokenizer.encode(&text, false)?
    } else {
        loaded.tokenizer.encode(&args.prompt, true)?
    };
    let io = |e: std::io::Error| Error::InvalidParameter(format!("cannot write to stdout: {e}"));
    let g = crate::generate::generate(&loaded, &prompt, args.sampling.params(), |t| {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(t.as_bytes());
        let _ = out.flush();
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out).and_then(|()| out.flush()).map_err(io)?;
    let decoded = g.tokens.len().saturating_sub(1);
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | finish: {}",
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prompt_seconds.max(1e-9),
        g.tokens.len(),
        decoded as f64 / g.decode_seconds.max(1e-9),
        g.finish_reason.as_str()
    );
    Ok(())
}
