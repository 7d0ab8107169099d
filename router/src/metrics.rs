//! The router's own Prometheus metrics (`ferrite_router_*`): requests by model and status,
//! held requests and how long they waited, retries, picks by reason, and activations asked
//! of the operator.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The `reason`s of `ferrite_router_retries_total`: the replica refused the connection, it
/// answered 503, or a held request's new replica was still starting.
pub const RETRY_REASONS: [&str; 3] = ["connect", "unavailable", "starting"];

/// Every series the router exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by model and HTTP status.
    pub requests: IntCounterVec,
    /// Requests held now for a model without a ready replica.
    pub held: IntGaugeVec,
    /// Seconds held requests waited for a replica.
    pub hold_seconds: Histogram,
    /// Requests sent again to another replica (or, held, to the same one) before any byte
    /// reached the client, by why.
    pub retries: IntCounterVec,
    /// Replicas picked, by why.
    pub picks: IntCounterVec,
    /// Replicas asked of the operator for models at zero.
    pub activations: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry with every series registered.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "ferrite_router_requests_total",
                "Requests answered, by model and HTTP status",
            ),
            &["model", "code"],
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "ferrite_router_held_requests",
                "Requests held now for a model without a ready replica",
            ),
            &["model"],
        )?;
        let hold_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "ferrite_router_hold_seconds",
                "Seconds held requests waited for a ready replica",
            )
            .buckets(vec![
                0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
            ]),
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "ferrite_router_retries_total",
                "Requests sent again before any byte reached the client, by reason",
            ),
            &["model", "reason"],
        )?;
        let picks = IntCounterVec::new(
            Opts::new("ferrite_router_picks_total", "Replicas picked, by reason"),
            &["model", "reason"],
        )?;
        let activations = IntCounterVec::new(
            Opts::new(
                "ferrite_router_activations_total",
                "Replicas asked of the operator for LLMServices at zero",
            ),
            &["namespace", "llmservice"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(hold_seconds.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(picks.clone()))?;
        registry.register(Box::new(activations.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            held,
            hold_seconds,
            retries,
            picks,
            activations,
        })
    }

    /// Makes a routed model's held and retry series exist (at 0) from its first request, so
    /// dashboards and alerts read none rather than no data.
    pub fn touch_model(&self, model: &str) {
        self.held.with_label_values(&[model]);
        for reason in RETRY_REASONS {
            self.retries.with_label_values(&[model, reason]);
        }
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}
