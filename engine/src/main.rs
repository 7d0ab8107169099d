//! `ferrite-engine`: parses flags and hands them to the library.

#![forbid(unsafe_code)]

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = ferrite_engine::cli::run(ferrite_engine::cli::Cli::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
