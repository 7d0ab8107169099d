//! Each engine's load as the router sees it: the requests it has in flight there (counted by
//! a guard that lives as long as the answer's body), and what the engine's own `/metrics`
//! said at its last scrape (waiting, running, KV-cache usage), scraped on an interval.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrite_util::engine_metrics::scrape;

use crate::catalog::{Catalog, Endpoint};
use crate::pick::Load;

/// Loads by engine address.
#[derive(Debug, Clone, Default)]
pub struct Loads {
    inner: Arc<Mutex<HashMap<SocketAddr, Load>>>,
}

/// One request in flight to an engine; dropping it ends the count.
#[derive(Debug)]
pub struct InFlight {
    loads: Loads,
    addr: SocketAddr,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut map = self.loads.lock();
        if let Some(l) = map.get_mut(&self.addr) {
            l.in_flight = l.in_flight.saturating_sub(1);
        }
    }
}

impl Loads {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Load>> {
        // Every change is one assignment, so a poisoned map is still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The loads of `endpoints`, in order.
    pub fn of(&self, endpoints: &[Endpoint]) -> Vec<Load> {
        let map = self.lock();
        endpoints
            .iter()
            .map(|e| map.get(&e.addr).copied().unwrap_or_default())
            .collect()
    }

    /// Counts one more request in flight to `addr` until the guard drops.
    pub fn start(&self, addr: SocketAddr) -> InFlight {
        self.lock().entry(addr).or_default().in_flight += 1;
        InFlight {
            loads: self.clone(),
            addr,
        }
    }

    /// Scrapes every ready engine of `catalog` each `interval`, forever.
    pub async fn scrape_every(&self, catalog: Catalog, interval: Duration, timeout: Duration) {
        let http = reqwest::Client::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let endpoints = catalog.all_endpoints();
            let samples = futures::future::join_all(endpoints.iter().map(|e| {
                let url = format!("http://{}/metrics", e.addr);
                let http = &http;
                async move { scrape(http, &url, timeout).await }
            }))
            .await;
            let mut map = self.lock();
            for (e, sample) in endpoints.iter().zip(samples) {
                let l = map.entry(e.addr).or_default();
                match sample {
                    Some(s) => {
                        l.queued = Some(s.waiting + s.running);
                        l.kv_usage = s.kv_usage;
                    }
                    None => {
                        l.queued = None;
                        l.kv_usage = 0.0;
                    }
                }
            }
            // Engines that are gone, once nothing is in flight to them.
            map.retain(|addr, l| l.in_flight > 0 || endpoints.iter().any(|e| e.addr == *addr));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_while_its_guard_lives() {
        let loads = Loads::default();
        let addr: SocketAddr = "10.0.0.1:8000".parse().expect("addr");
        let e = [Endpoint { addr, pod: None }];
        let a = loads.start(addr);
        let b = loads.start(addr);
        assert_eq!(loads.of(&e)[0].in_flight, 2);
        drop(a);
        assert_eq!(loads.of(&e)[0].in_flight, 1);
        drop(b);
        assert_eq!(loads.of(&e)[0].in_flight, 0);
    }
}
