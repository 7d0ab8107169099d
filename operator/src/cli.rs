//! The `ferrite-operator` command line: flags (each with an environment variable where a pod
//! sets it through the downward API) and their mapping to [`Options`]. Kept in the library
//! so the chart test can check that the flags the Helm chart renders are the ones it takes.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::autoscale;
use crate::Options;

/// The Ferrite operator: serves LLMService manifests as engine Deployments.
#[derive(Debug, Clone, Parser)]
#[command(name = "ferrite-operator", version, about)]
pub struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "FERRITE_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Engine image for LLMServices that name none.
    #[arg(long, env = "FERRITE_ENGINE_IMAGE", default_value_t = Options::default().engine_image)]
    pub engine_image: String,
    /// Seconds engines drain in-flight requests after SIGTERM.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(i64).range(0..))]
    pub drain_timeout_seconds: i64,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Turn off leader election (only for a single replica).
    #[arg(long)]
    pub no_leader_election: bool,
    /// Namespace of the leader-election Lease (default: the pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "ferrite-operator")]
    pub lease_name: String,
    /// Seconds a lease holds without renewal (at least 3).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..))]
    pub lease_duration_seconds: u64,
    /// Seconds between autoscaling decisions (at least 1).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub autoscale_interval: u64,
    /// Seconds to wait for one engine's /metrics (at least 1).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub scrape_timeout: u64,
    /// Port of the engines' /metrics.
    #[arg(long, default_value_t = 8000, value_parser = clap::value_parser!(u16).range(1..))]
    pub engine_metrics_port: u16,
    /// This replica's identity (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Give every LLMService an InferencePool (Gateway API Inference Extension) where that
    /// API is installed, unless its `spec.inferencePool.enabled` says otherwise.
    #[arg(long)]
    pub inference_pools: bool,
}

impl Args {
    /// The operator's options; `identity` is used when `--identity` / `POD_NAME` is absent.
    pub fn into_options(self, identity: String) -> Options {
        Options {
            namespace: self.namespace.filter(|n| !n.is_empty()),
            engine_image: self.engine_image,
            drain_timeout_seconds: self.drain_timeout_seconds,
            metrics_addr: Some(self.metrics_addr),
            leader_election: !self.no_leader_election,
            lease_namespace: self.lease_namespace,
            lease_name: self.lease_name,
            identity: self.identity.unwrap_or(identity),
            lease_duration: Duration::from_secs(self.lease_duration_seconds),
            autoscale: autoscale::Settings {
                interval: Duration::from_secs(self.autoscale_interval),
                scrape_timeout: Duration::from_secs(self.scrape_timeout),
                metrics_port: self.engine_metrics_port,
            },
            inference_pools: self.inference_pools,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("ferrite-operator").chain(args.iter().copied()))
    }

    #[test]
    fn flags_map_to_options() {
        let o = parse(&[
            "--namespace=team-a",
            "--engine-image=e:1",
            "--lease-duration-seconds=20",
            "--autoscale-interval=5",
            "--engine-metrics-port=9000",
            "--identity=op-0",
        ])
        .expect("parse")
        .into_options("host".into());
        assert_eq!(o.namespace.as_deref(), Some("team-a"));
        assert_eq!(o.engine_image, "e:1");
        assert_eq!(o.lease_duration, Duration::from_secs(20));
        assert_eq!(o.autoscale.interval, Duration::from_secs(5));
        assert_eq!(o.autoscale.metrics_port, 9000);
        assert_eq!(o.identity, "op-0");
        assert!(o.leader_election);
    }

    #[test]
    fn out_of_range_values_are_refused_with_the_flag_name() {
        for bad in [
            "--lease-duration-seconds=1",
            "--autoscale-interval=0",
            "--scrape-timeout=0",
            "--engine-metrics-port=0",
            "--drain-timeout-seconds=-5",
        ] {
            let e = parse(&[bad]).expect_err(bad).to_string();
            let flag = bad.split('=').next().unwrap_or(bad);
            assert!(e.contains(flag), "{bad}: {e}");
        }
    }
}
