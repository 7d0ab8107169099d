//! `ferrite-engine`: reads flags and runs the command they name with the engine library.

#![forbid(unsafe_code)]

mod bench;
mod cli;
mod download;
mod generate;
mod group;
mod perplexity;
mod serve;

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = cli::run(cli::Cli::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
