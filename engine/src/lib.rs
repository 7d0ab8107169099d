//! Ferrite's inference engine: Llama-family models from GGUF or Hugging Face checkpoints,
//! tokenizers and chat templates, sampling, and the `ferrite-engine` command line.

#![forbid(unsafe_code)]

pub mod bench;
pub mod cli;
pub mod download;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod server;
pub mod tokenizer;

pub use error::{Error, Result};
