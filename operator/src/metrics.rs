//! The operator's own metrics (`/metrics`) and health endpoints (`/healthz`, `/readyz`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};

/// Counters and histograms of the reconciler.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Reconciles by result (`ok`, `error`).
    pub reconciles: IntCounterVec,
    /// Reconcile errors by kind (`api`, `client`, `invalid_spec`, ...).
    pub errors: IntCounterVec,
    /// Reconcile duration in seconds.
    pub duration: HistogramVec,
    ready: Arc<AtomicBool>,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "ferrite_operator_reconciles_total",
                "LLMService reconciles by result",
            ),
            &["result"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "ferrite_operator_reconcile_errors_total",
                "Reconcile errors by kind",
            ),
            &["kind"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "ferrite_operator_reconcile_duration_seconds",
                "Time one LLMService reconcile took",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &[],
        )?;
        // Every series exists from the start, so a rate reads 0 rather than no data.
        for result in ["ok", "error"] {
            reconciles.with_label_values(&[result]);
        }
        for kind in crate::error::Error::KINDS {
            errors.with_label_values(&[kind]);
        }
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(Self {
            registry,
            reconciles,
            errors,
            duration,
            ready: Arc::default(),
        })
    }

    /// The registry, for other parts (the autoscaler) to register their metrics in.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Marks the operator ready (`/readyz` answers 200): it is leading, or standing by.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Everything registered, in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

async fn metrics(State(m): State<Metrics>) -> String {
    m.render()
}

async fn readyz(State(m): State<Metrics>) -> (StatusCode, &'static str) {
    if m.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    m: Metrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(m);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
