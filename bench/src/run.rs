//! Driving load: closed loop (a fixed number of requests in flight) or open loop (Poisson
//! arrivals at a request rate), one level at a time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};
use serde::{Deserialize, Serialize};

use crate::client::{complete, Sample};
use crate::stats::Summary;
use crate::workload::RequestSpec;

/// How load is offered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "value")]
pub enum Load {
    /// Closed loop: this many requests in flight; a new one starts when one finishes.
    Concurrency(usize),
    /// Open loop: requests arrive as a Poisson process at this many per second, whether or
    /// not earlier ones finished.
    Rate(f64),
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Concurrency(c) => write!(f, "concurrency {c}"),
            Load::Rate(r) => write!(f, "{r} req/s"),
        }
    }
}

/// The server under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub base: String,
    /// The `model` field of requests.
    pub model: String,
    /// Fields added to every request body (a JSON object, or null).
    pub extra_body: serde_json::Value,
}

type Outcome = (usize, Result<Sample, String>);

async fn one(http: &reqwest::Client, target: &Target, spec: &RequestSpec) -> Outcome {
    let r = complete(http, &target.base, &target.model, spec, &target.extra_body)
        .await
        .map_err(|e| e.to_string());
    (spec.prompt.len(), r)
}

/// Runs `specs` under `load` and summarises; `bar` advances once per finished request.
/// Failed requests are counted, and the first failure's message is returned with the summary.
pub async fn run_level(
    http: &reqwest::Client,
    target: &Target,
    load: Load,
    specs: Vec<RequestSpec>,
    seed: u64,
    bar: &ProgressBar,
) -> (Summary, Option<String>) {
    let start = Instant::now();
    let outcomes: Vec<Outcome> = match load {
        Load::Concurrency(c) => {
            let queue = Arc::new(Mutex::new(VecDeque::from(specs)));
            let workers = (0..c.max(1)).map(|_| {
                let queue = queue.clone();
                async move {
                    let mut out = Vec::new();
                    loop {
                        let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                        let Some(spec) = next else { break };
                        out.push(one(http, target, &spec).await);
                        bar.inc(1);
                    }
                    out
                }
            });
            futures::future::join_all(workers)
                .await
                .into_iter()
                .flatten()
                .collect()
        }
        Load::Rate(rate) => {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
            let gaps = Exp::new(rate.max(1e-6)).ok();
            let mut at = 0.0f64;
            let arrivals = specs.into_iter().map(|spec| {
                at += gaps.as_ref().map_or(0.0, |g| g.sample(&mut rng));
                let when = start + Duration::from_secs_f64(at);
                async move {
                    tokio::time::sleep_until(when.into()).await;
                    let o = one(http, target, &spec).await;
                    bar.inc(1);
                    o
                }
            });
            futures::future::join_all(arrivals).await
        }
    };
    let duration = start.elapsed().as_secs_f64();
    let mut first_error = None;
    let mut samples = Vec::new();
    let mut errors = 0;
    for (prompt, r) in outcomes {
        match r {
            Ok(s) => samples.push((prompt, s)),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    (Summary::new(&samples, errors, duration), first_error)
}
