//! `ferrite-router`: one OpenAI-compatible endpoint for every LLMService in the namespaces it
//! watches. It learns the LLMServices and their ready engines by watching the API
//! ([`catalog`]), picks a replica by load and prompt prefix ([`pick`], [`loads`]), forwards
//! and streams ([`proxy`]), and holds requests for a model at zero replicas while the
//! operator brings one back.

#![forbid(unsafe_code)]

pub mod catalog;
pub mod cli;
pub mod loads;
pub mod metrics;
pub mod pick;
pub mod proxy;

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;

pub use proxy::Settings;

/// Everything `run` needs besides the client and the listener.
#[derive(Debug, Clone)]
pub struct Options {
    /// Watch only this namespace (`None`: all).
    pub namespace: Option<String>,
    /// Picking, holding and retrying.
    pub settings: Settings,
    /// How often each engine's `/metrics` is scraped for its load.
    pub scrape_interval: Duration,
    /// How long in-flight requests may run after SIGTERM.
    pub shutdown_timeout: Duration,
}

/// The errors `run` ends with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The metrics registry refused a series (a bug).
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Serving failed.
    #[error("serving failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves on `listener` until `shutdown` resolves; then turns `/readyz` to 503, stops
/// accepting, and lets in-flight requests (streams included) finish for up to the shutdown
/// timeout.
pub async fn run(
    client: kube::Client,
    opts: Options,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let metrics = metrics::Metrics::new()?;
    let (catalog, watches) = catalog::Catalog::watch(client.clone(), opts.namespace.as_deref());
    let watches = tokio::spawn(watches);
    let loads = loads::Loads::default();
    let scrapes = tokio::spawn({
        let loads = loads.clone();
        let catalog = catalog.clone();
        let interval = opts.scrape_interval;
        async move {
            loads
                .scrape_every(catalog, interval, interval.max(Duration::from_secs(1)))
                .await
        }
    });
    if !catalog.synced().await {
        tracing::warn!("the watches ended before listing; serving without them");
    }
    let proxy = proxy::Proxy::new(catalog, client, loads, metrics, opts.settings.clone());
    let drain = std::sync::Arc::clone(&proxy);
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: finishing in-flight requests");
        drain.start_draining();
        let _ = stopped_tx.send(());
    };
    let server = axum::serve(listener, proxy::router(proxy)).with_graceful_shutdown(signal);
    let serving = tokio::spawn(async move { server.await });
    let _ = stopped_rx.await;
    let result = match tokio::time::timeout(opts.shutdown_timeout, serving).await {
        Ok(Ok(r)) => r.map_err(Error::from),
        Ok(Err(e)) => Err(Error::Io(std::io::Error::other(e))),
        Err(_) => {
            tracing::warn!("shutdown timeout reached with requests still running");
            Ok(())
        }
    };
    watches.abort();
    scrapes.abort();
    result
}
