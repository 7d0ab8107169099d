//! `ferrite-engine`: parses flags and hands them to the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    ferrite_engine::cli::run(ferrite_engine::cli::Cli::parse())?;
    Ok(())
}
