//! Model loading: a GGUF file or an HF directory becomes a [`Llama`] plus its [`Tokenizer`].

pub mod config;
pub mod gguf;
pub mod llama;
pub mod safetensors;
pub mod weights;

use std::path::{Path, PathBuf};

use candle_core::Device;

pub use config::{Architecture, ModelConfig, RopeStyle};
pub use llama::Llama;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// A model ready to serve: weights, tokenizer and where they came from.
#[derive(Debug)]
pub struct LoadedModel {
    /// The network.
    pub model: Llama,
    /// Its tokenizer, special tokens and chat template.
    pub tokenizer: Tokenizer,
    /// The file or directory it was loaded from.
    pub path: PathBuf,
}

/// Loads only the network from a GGUF file or an HF directory (no tokenizer needed).
pub fn load_model(path: &Path, device: &Device) -> Result<Llama> {
    match open(path, device)? {
        Source::Gguf(mut file) => {
            let config = ModelConfig::from_gguf(&file.content, path)?;
            Llama::load(config, &mut file)
        }
        Source::Hf(dir) => load_hf(&dir, device),
    }
}

/// Loads the network and its tokenizer.
pub fn load(path: &Path, device: &Device) -> Result<LoadedModel> {
    let (model, tokenizer) = match open(path, device)? {
        Source::Gguf(mut file) => {
            let config = ModelConfig::from_gguf(&file.content, path)?;
            let tokenizer = Tokenizer::from_gguf(&file.content, path)?;
            (Llama::load(config, &mut file)?, tokenizer)
        }
        Source::Hf(dir) => {
            let tokenizer = Tokenizer::from_hf_dir(&dir)?;
            (load_hf(&dir, device)?, tokenizer)
        }
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        path: path.to_path_buf(),
    })
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

fn load_hf(dir: &Path, device: &Device) -> Result<Llama> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| Error::model(&cfg_path, format!("cannot read: {e}")))?;
    let config = ModelConfig::from_hf_json(&text, &cfg_path)?;
    let mut weights = safetensors::SafetensorsWeights::load(dir, device)?;
    Llama::load(config, &mut weights)
}
