//! `ferrite-operator`: parses flags and runs the operator.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use ferrite_operator::{run, Options};

/// The Ferrite operator: serves LLMService manifests as engine Deployments.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "FERRITE_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Engine image for LLMServices that name none.
    #[arg(long, env = "FERRITE_ENGINE_IMAGE", default_value_t = Options::default().engine_image)]
    engine_image: String,
    /// Seconds engines drain in-flight requests after SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_timeout_seconds: i64,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Turn off leader election (only for a single replica).
    #[arg(long)]
    no_leader_election: bool,
    /// Namespace of the leader-election Lease (default: the pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "ferrite-operator")]
    lease_name: String,
    /// Seconds a lease holds without renewal.
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Seconds between autoscaling decisions.
    #[arg(long, default_value_t = 15)]
    autoscale_interval: u64,
    /// Seconds to wait for one engine's /metrics.
    #[arg(long, default_value_t = 2)]
    scrape_timeout: u64,
    /// Port of the engines' /metrics.
    #[arg(long, default_value_t = 8000)]
    engine_metrics_port: u16,
    /// This replica's identity (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let identity = args.identity.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| format!("ferrite-operator-{}", std::process::id()))
    });
    let opts = Options {
        namespace: args.namespace,
        engine_image: args.engine_image,
        drain_timeout_seconds: args.drain_timeout_seconds,
        metrics_addr: Some(args.metrics_addr),
        leader_election: !args.no_leader_election,
        lease_namespace: args.lease_namespace,
        lease_name: args.lease_name,
        identity,
        lease_duration: Duration::from_secs(args.lease_duration_seconds.max(3)),
        autoscale: ferrite_operator::autoscale::Settings {
            interval: Duration::from_secs(args.autoscale_interval.max(1)),
            scrape_timeout: Duration::from_secs(args.scrape_timeout.max(1)),
            metrics_port: args.engine_metrics_port,
        },
    };
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot reach the Kubernetes API: {e}");
            std::process::exit(1);
        }
    };
    let shutdown = async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutting down");
    };
    if let Err(e) = run(client, opts, shutdown).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
