//! Architecture hyper-parameters, read from GGUF metadata or an HF `config.json`.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::Deserialize;

use crate::error::{Error, Result};

/// The model families the engine runs; they share one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, Mistral, SmolLM2: no attention biases.
    Llama,
    /// Qwen2: biases on the Q, K and V projections.
    Qwen2,
}

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (GGUF llama, whose Q/K rows were permuted at conversion).
    Interleaved,
    /// First half with second half ("rotate half", HF checkpoints and GGUF qwen2).
    Halves,
}

/// Everything the forward pass needs to know about the network's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family, which decides biases.
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (fewer than `num_heads` with grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Number of tokens in the vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Pairing of rotary dimensions.
    pub rope_style: RopeStyle,
    /// The context length the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the token embedding.
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    /// Checks the invariants the forward pass relies on.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let fail = |m: String| Err(Error::model(path, m));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return fail("head and layer counts must be at least 1".into());
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "{} attention heads are not a multiple of {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head dimension {} must be even for rotary embeddings",
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Reads the `<arch>.*` keys of a GGUF file.
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let arch_name = meta_str(content, "general.architecture", path)?;
        let architecture = match arch_name.as_str() {
            "llama" | "mistral" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            other => {
                return Err(Error::model(
                    path,
                    format!(
                        "unknown architecture `{other}` in general.architecture; supported: llama, mistral, qwen2"
                    ),
                ))
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let num_heads = meta_usize(content, &key("attention.head_count"), path)?;
        let hidden_size = meta_usize(content, &key("embedding_length"), path)?;
        let head_dim = match content.metadata.get(&key("attention.key_length")) {
            Some(v) => v.to_u32().map_err(|e| Error::model(path, e.to_string()))? as usize,
            None => hidden_size / num_heads.max(1),
        };
        let vocab_size = match content.metadata.get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec().map(|t| t.len()).unwrap_or(0),
            None => 0,
        };
        let vocab_size = match content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims()[0],
            None => vocab_size,
        };
        let config = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: meta_usize(content, &key("feed_forward_length"), path)?,
            num_layers: meta_usize(content, &key("block_count"), path)?,
            num_heads,
            num_kv_heads: match content.metadata.get(&key("attention.head_count_kv")) {
                Some(v) => v.to_u32().map_err(|e| Error::model(path, e.to_string()))? as usize,
                None => num_heads,
            },
            head_dim,
            vocab_size,
            rms_norm_eps: meta_f64(content, &key("attention.layer_norm_rms_epsilon"), path)
                .unwrap_or(1e-5),
            rope_theta: meta_f64(content, &key("rope.freq_base"), path).unwrap_or(10_000.0),
            // llama.cpp's converter permutes llama Q/K for adjacent-pair RoPE; qwen2 keeps halves.
            rope_style: match architecture {
                Architecture::Llama => RopeStyle::Interleaved,
                Architecture::Qwen2 => RopeStyle::Halves,
            },
            max_position_embeddings: meta_usize(content, &key("context_length"), path)
                .unwrap_or(4096),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads an HF `config.json` (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`).
    pub fn from_hf_json(text: &str, path: &Path) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|e| Error::model(path, format!("malformed config.json: {e}")))?;
        let arch = raw.architectures.first().map(String::as_str).unwrap_or("");
        let architecture = match arch {
            "LlamaForCausalLM" | "MistralForCausalLM" => Architecture::Llama,
            "Qwen2ForCausalLM" => Architecture::Qwen2,
            other => {
                return Err(Error::model(
                    path,
                    format!(
                        "unknown architecture `{other}` in config.json `architectures`; supported: \
                         LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
                    ),
                ))
            }
        };
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let config = ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim: raw
                .head_dim
                .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Halves,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        };
        config.validate(path)?;
        Ok(config)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
}

fn missing(path: &Path, key: &str, e: impl std::fmt::Display) -> Error {
    Error::model(path, format!("GGUF metadata `{key}`: {e}"))
}

/// A required string value from GGUF metadata.
pub(crate) fn meta_str(content: &gguf_file::Content, key: &str, path: &Path) -> Result<String> {
    let v = content
        .metadata
        .get(key)
        .ok_or_else(|| missing(path, key, "missing"))?;
    v.to_string().cloned().map_err(|e| missing(path, key, e))
}

fn meta_usize(content: &gguf_file::Content, key: &str, path: &Path) -> Result<usize> {
    let v = content
        .metadata
        .get(key)
        .ok_or_else(|| missing(path, key, "missing"))?;
    let n = match v {
        gguf_file::Value::U64(n) => *n,
        gguf_file::Value::I64(n) => *n as u64,
        other => u64::from(other.to_u32().map_err(|e| missing(path, key, e))?),
    };
    Ok(n as usize)
}

fn meta_f64(content: &gguf_file::Content, key: &str, path: &Path) -> Result<f64> {
    let v = content
        .metadata
        .get(key)
        .ok_or_else(|| missing(path, key, "missing"))?;
    match v {
        gguf_file::Value::F64(x) => Ok(*x),
        other => other
            .to_f32()
            .map(f64::from)
            .map_err(|e| missing(path, key, e)),
    }
}
