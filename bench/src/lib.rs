//! `ferrite-bench`: a load generator for any OpenAI-compatible `/v1/completions` endpoint
//! with streaming — Ferrite, llama.cpp's `llama-server`, vLLM, or the naive Transformers
//! baseline in `scripts/hf_server.py`.
//!
//! Requests are built from a seed: prompts are windows of real text (public-domain prose in
//! `bench/data/`) tokenised by the server under test, so every prompt has an exact token
//! length; outputs have exact lengths through `max_tokens` with `ignore_eos`. Load is either
//! closed-loop (a fixed number of requests in flight) or open-loop (Poisson arrivals at a
//! request rate). Each level reports requests/s, output tokens/s, TTFT, inter-token latency
//! and end-to-end latency percentiles, and errors; results go to a JSON file from which
//! markdown tables, peer ratios and SVG plots are made.

#![forbid(unsafe_code)]

pub mod client;
pub mod plot;
pub mod report;
pub mod run;
pub mod stats;
pub mod workload;

/// What can go wrong while benchmarking.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server could not be reached or answered with an error.
    #[error("{0}")]
    Http(String),
    /// A flag or a results file is not what it must be.
    #[error("{0}")]
    Invalid(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A plot could not be drawn.
    #[error("plot: {0}")]
    Plot(String),
}

/// Result with the crate's error.
pub type Result<T> = std::result::Result<T, Error>;
