//! The `ferrite-router` command line and its mapping to [`Options`]; kept in the library so the
//! chart test can check that the flags the Helm chart renders are the ones it takes.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::{Options, Settings};

/// One OpenAI endpoint for every LLMService: routes by model, by load and prompt prefix, and
/// holds requests while a model scales up from zero.
#[derive(Debug, Clone, Parser)]
#[command(name = "ferrite-router", version, about)]
pub struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "FERRITE_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address the OpenAI API, `/metrics`, `/healthz` and `/readyz` are served on.
    #[arg(long, default_value = "0.0.0.0:8000")]
    pub listen: SocketAddr,
    /// Characters of a prompt's first user message (or prompt) that place a request on the
    /// hash ring, so requests sharing them reach the replica that cached them; 0 picks by
    /// load alone.
    #[arg(long, default_value_t = 100)]
    pub prefix_chars: usize,
    /// How many times the mean load a replica may carry before requests for its prefixes go
    /// to the next replica on the ring (at least 1).
    #[arg(long, default_value_t = 1.25, value_parser = at_least_one)]
    pub load_factor: f64,
    /// Most requests held at once for one model without a ready replica.
    #[arg(long, default_value_t = 64)]
    pub max_held_per_model: usize,
    /// Most requests held at once for all models.
    #[arg(long, default_value_t = 1024)]
    pub max_held: usize,
    /// Seconds a held request waits for a ready replica before it is answered 504.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub hold_timeout: u64,
    /// Seconds between scrapes of each engine's `/metrics` for its load.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub scrape_interval: u64,
    /// Seconds in-flight requests may run after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

fn at_least_one(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 1.0 && v.is_finite() => Ok(v),
        _ => Err(format!("must be a number of at least 1, got `{s}`")),
    }
}

impl Args {
    /// The router's options.
    pub fn into_options(self) -> Options {
        Options {
            namespace: self.namespace.filter(|n| !n.is_empty()),
            settings: Settings {
                prefix_chars: self.prefix_chars,
                load_factor: self.load_factor,
                max_held_per_model: self.max_held_per_model,
                max_held: self.max_held,
                hold_timeout: Duration::from_secs(self.hold_timeout),
            },
            scrape_interval: Duration::from_secs(self.scrape_interval),
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout),
        }
    }
}
