//! Model loading: a GGUF file or an HF directory becomes a [`Llama`] plus its [`Tokenizer`].

pub mod config;
pub mod gguf;
pub mod llama;
pub mod mix;
pub mod safetensors;
pub mod stages;
pub mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;

pub use config::{Architecture, ModelConfig, RopeStyle};
pub use llama::{Llama, ModelPart, Shard};

use ferrite_kernels::quant::{quantize, WeightFormat};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use mix::Mix;
use weights::WeightSource;

/// A model ready to serve: weights, tokenizer and where they came from.
#[derive(Debug)]
pub struct LoadedModel {
    /// The network.
    pub model: Llama,
    /// Its tokenizer, special tokens and chat template.
    pub tokenizer: Tokenizer,
    /// The file or directory it was loaded from.
    pub path: PathBuf,
    /// SHA-256 of the model's metadata (hyper-parameters, every matrix's name, shape and
    /// format as held): ranks of a group must agree on it.
    pub fingerprint: [u8; 32],
    /// Every pipeline stage's part when it was loaded as one stage of several, else the
    /// whole model alone.
    pub stages: Vec<ModelPart>,
}

/// How to load a model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Quantize the floating-point matrices as they are read (`--quantization`); matrices
    /// the file stores quantized are kept.
    pub quantization: Option<Quantization>,
    /// Load only one pipeline stage's part: `(stage, stages)`.
    pub stage: Option<(usize, usize)>,
    /// Load only one tensor-parallel rank's share: `(rank, ranks)`.
    pub tensor: Option<(usize, usize)>,
}

/// What `--quantization` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// Every floating-point matrix in one format, as `llama-quantize --pure` writes it
    /// (llama.cpp's fallback format where its blocks do not fit a row).
    Pure(WeightFormat),
    /// One of llama.cpp's K-quant mixes: each matrix in the format `llama-quantize` chooses
    /// for it.
    Mix(Mix),
}

impl Quantization {
    /// Every value `--quantization` takes, in the order they are listed: one format for
    /// every matrix, then llama.cpp's K-quant mixes.
    pub fn all() -> impl Iterator<Item = Quantization> {
        quantize::QUANTIZABLE
            .into_iter()
            .map(Quantization::Pure)
            .chain(Mix::ALL.into_iter().map(Quantization::Mix))
    }

    /// The `--quantization` value that names it.
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Pure(format) => format.name(),
            Quantization::Mix(mix) => mix.name(),
        }
    }
}

/// vLLM's `--quantization` methods that need a GPU (or a checkpoint quantized for one).
const GPU_QUANTIZATIONS: [&str; 16] = [
    "fp8",
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "gptq_marlin_24",
    "marlin",
    "bitsandbytes",
    "compressed-tensors",
    "fbgemm_fp8",
    "modelopt",
    "modelopt_fp4",
    "mxfp4",
    "aqlm",
    "deepspeedfp",
    "experts_int8",
];

/// What `--quantization NAME` asks for; the error names the flag, the value and the formats
/// the CPU engine quantizes to.
pub fn parse_quantization(name: &str) -> std::result::Result<Quantization, String> {
    let lower = name.trim().to_ascii_lowercase();
    if let Some(q) = Quantization::all().find(|q| q.name() == lower) {
        return Ok(q);
    }
    let allowed = Quantization::all()
        .map(Quantization::name)
        .collect::<Vec<_>>()
        .join(", ");
    Err(if GPU_QUANTIZATIONS.contains(&lower.as_str()) {
        format!(
            "--quantization {name}: {lower} is a GPU quantization method and this engine \
             computes on CPU; quantize at load to one of {allowed}, or serve a GGUF file \
             quantized in advance"
        )
    } else {
        format!("--quantization {name}: unknown method; expected one of {allowed}")
    })
}

/// Loads only the network from a GGUF file or an HF directory (no tokenizer needed).
pub fn load_model(path: &Path, device: &Device) -> Result<Llama> {
    load_model_with(path, device, &LoadOptions::default())
}

/// [`load_model`] with `options`.
pub fn load_model_with(path: &Path, device: &Device, options: &LoadOptions) -> Result<Llama> {
    Ok(load_parts(path, device, options, false)?.model)
}

/// Loads only the network part `options.stage` names (no tokenizer), with the model's
/// fingerprint: what a pipeline stage other than the first needs.
pub fn load_part_with(
    path: &Path,
    device: &Device,
    options: &LoadOptions,
) -> Result<(Llama, [u8; 32])> {
    let parts = load_parts(path, device, options, false)?;
    Ok((parts.model, parts.fingerprint))
}

/// Loads the network and its tokenizer.
pub fn load(path: &Path, device: &Device) -> Result<LoadedModel> {
    load_with(path, device, &LoadOptions::default())
}

/// [`load`] with `options`.
pub fn load_with(path: &Path, device: &Device, options: &LoadOptions) -> Result<LoadedModel> {
    let parts = load_parts(path, device, options, true)?;
    let tokenizer = parts
        .tokenizer
        .ok_or_else(|| Error::internal("the tokenizer was not loaded"))?;
    Ok(LoadedModel {
        model: parts.model,
        tokenizer,
        path: path.to_path_buf(),
        fingerprint: parts.fingerprint,
        stages: parts.stages,
    })
}

/// What [`load_parts`] read.
struct Parts {
    model: Llama,
    tokenizer: Option<Tokenizer>,
    fingerprint: [u8; 32],
    stages: Vec<ModelPart>,
}

/// The network (or the stage of it `options` names), and with `tokenizer` its tokenizer.
fn load_parts(
    path: &Path,
    device: &Device,
    options: &LoadOptions,
    tokenizer: bool,
) -> Result<Parts> {
    let (config, mut source, tk): (ModelConfig, Box<dyn WeightSource>, Option<Tokenizer>) =
        match open(path, device)? {
            Source::Gguf(file) => {
                let config = ModelConfig::from_gguf(&file.content, path)?;
                let tk = tokenizer
                    .then(|| Tokenizer::from_gguf(&file.content, path))
                    .transpose()?;
                (config, Box::new(file), tk)
            }
            Source::Hf(dir) => {
                let cfg_path = dir.join("config.json");
                let text = std::fs::read_to_string(&cfg_path)
                    .map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
                let config = ModelConfig::from_hf_json(&text, &cfg_path)?;
                let tk = tokenizer
                    .then(|| Tokenizer::from_hf_dir(&dir))
                    .transpose()?;
                let weights = safetensors::SafetensorsWeights::load(&dir, device)?;
                (config, Box::new(weights), tk)
            }
        };
    let (model, fingerprint, stages) = match options.quantization {
        None => load_stage(config, source.as_mut(), options)?,
        Some(quantization) => {
            let model = mix::MixModel::new(&config);
            let mut q = weights::Quantizing::new(source.as_mut(), quantization, model);
            let loaded = load_stage(config, &mut q, options)?;
            let c = q.counts;
            tracing::info!(
                "quantized at load to {}: {} matrices, {} more in llama.cpp's fallback format \
                 for rows that the asked-for blocks do not fit, {} kept in floating point",
                quantization.name(),
                c.quantized,
                c.fallback,
                c.kept
            );
            loaded
        }
    };
    Ok(Parts {
        model,
        tokenizer: tk,
        fingerprint,
        stages,
    })
}

/// The model's fingerprint, its split into the stages `options` names, and the part of
/// its stage and tensor rank (the whole model without either).
fn load_stage(
    config: ModelConfig,
    src: &mut dyn WeightSource,
    options: &LoadOptions,
) -> Result<(Llama, [u8; 32], Vec<ModelPart>)> {
    let fingerprint = fingerprint(&config, src)?;
    let (index, count) = options.stage.unwrap_or((0, 1));
    let (rank, size) = options.tensor.unwrap_or((0, 1));
    let stages = stages::split(&config, src, count)?;
    let part = stages
        .get(index)
        .cloned()
        .ok_or_else(|| Error::internal(format!("stage {index} of {count}")))?;
    let shard = Shard { rank, size };
    Ok((
        Llama::load_part(config, src, part, shard)?,
        fingerprint,
        stages,
    ))
}

/// SHA-256 of what identifies a model to the ranks of a group: its hyper-parameters and
/// every matrix's name, shape and format as it will be held (after `--quantization`).
fn fingerprint(config: &ModelConfig, src: &dyn WeightSource) -> Result<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(format!("{config:?}"));
    for (name, shape) in stages::matrices(config) {
        let format = src.matrix_format(name, shape)?;
        h.update(format!("{}:{shape:?}:{format:?};", name.gguf()));
    }
    Ok(h.finalize().into())
}

enum Source {
    Gguf(gguf::GgufFile),
    Hf(PathBuf),
}

fn open(path: &Path, device: &Device) -> Result<Source> {
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(Error::model(
                path,
                "directory has no config.json: expected an HF model directory (config.json, \
                 model.safetensors or model.safetensors.index.json, tokenizer.json) or a .gguf file",
            ));
        }
        Ok(Source::Hf(path.to_path_buf()))
    } else if path.is_file() {
        Ok(Source::Gguf(gguf::GgufFile::open(path, device)?))
    } else {
        Err(Error::model(
            path,
            "no such file or directory: expected a .gguf file or an HF model directory",
        ))
    }
}
