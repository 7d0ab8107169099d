//! `ferrite-operator`: parses flags and runs the operator.

#![forbid(unsafe_code)]

use clap::Parser;
use ferrite_operator::cli::Args;
use ferrite_operator::run;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| format!("ferrite-operator-{}", std::process::id()));
    let opts = Args::parse().into_options(host);
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot reach the Kubernetes API: {e}");
            std::process::exit(1);
        }
    };
    let shutdown = async {
        ferrite_util::shutdown_signal().await;
        tracing::info!("shutting down");
    };
    if let Err(e) = run(client, opts, shutdown).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
