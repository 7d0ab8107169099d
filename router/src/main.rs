//! `ferrite-router`: parses flags and runs the router.

#![forbid(unsafe_code)]

use clap::Parser;
use ferrite_router::cli::Args;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let listen = args.listen;
    let opts = args.into_options();
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot reach the Kubernetes API: {e}");
            std::process::exit(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) =
        ferrite_router::run(client, opts, listener, ferrite_util::shutdown_signal()).await
    {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
