//! Ferrite's inference engine: Llama-family models from GGUF or Hugging Face checkpoints,
//! tokenizers and chat templates, the paged KV cache and continuous batching, sampling, and the
//! OpenAI-compatible server. The `ferrite-engine` binary (`src/bin/`) reads flags and calls it.

#![forbid(unsafe_code)]

pub mod download;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod kv;
pub mod model;
pub mod parallel;
pub mod reference;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod server;
pub mod tokenizer;

pub use error::{Error, Result};
