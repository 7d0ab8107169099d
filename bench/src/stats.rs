//! Summaries of one load level: throughput and latency percentiles.

use serde::{Deserialize, Serialize};

use crate::client::Sample;

pub use ferrite_util::percentile;

fn sorted(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v
}

/// What one load level measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed (HTTP error, broken stream).
    pub errors: usize,
    /// Wall time of the level, seconds.
    pub duration_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second, all requests together.
    pub output_tokens_per_s: f64,
    /// Prompt tokens sent (completed requests).
    pub prompt_tokens: usize,
    /// Output tokens received.
    pub output_tokens: usize,
    /// Time to first token, seconds: p50, p90, p99.
    pub ttft_s: [f64; 3],
    /// Inter-token latency, seconds: p50, p90.
    pub itl_s: [f64; 2],
    /// End-to-end latency, seconds: p50, p90.
    pub e2e_s: [f64; 2],
}

impl Summary {
    /// Summarises completed samples (with their prompt lengths) and the error count.
    pub fn new(samples: &[(usize, Sample)], errors: usize, duration_s: f64) -> Self {
        let ttft = sorted(samples.iter().map(|(_, s)| s.ttft));
        let itl = sorted(samples.iter().flat_map(|(_, s)| s.itl.iter().copied()));
        let e2e = sorted(samples.iter().map(|(_, s)| s.e2e));
        let output_tokens: usize = samples.iter().map(|(_, s)| s.output_tokens).sum();
        let d = duration_s.max(1e-9);
        Self {
            completed: samples.len(),
            errors,
            duration_s,
            requests_per_s: samples.len() as f64 / d,
            output_tokens_per_s: output_tokens as f64 / d,
            prompt_tokens: samples.iter().map(|(p, _)| p).sum(),
            output_tokens,
            ttft_s: [
                percentile(&ttft, 0.5),
                percentile(&ttft, 0.9),
                percentile(&ttft, 0.99),
            ],
            itl_s: [percentile(&itl, 0.5), percentile(&itl, 0.9)],
            e2e_s: [percentile(&e2e, 0.5), percentile(&e2e, 0.9)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_counts_tokens_over_wall_time() {
        let s = |ttft: f64, n: usize| Sample {
            ttft,
            itl: vec![0.01; n.saturating_sub(1)],
            e2e: ttft + 0.01 * n as f64,
            output_tokens: n,
        };
        let sum = Summary::new(&[(128, s(0.1, 10)), (128, s(0.3, 30))], 1, 2.0);
        assert_eq!(sum.completed, 2);
        assert_eq!(sum.errors, 1);
        assert_eq!(sum.output_tokens, 40);
        assert_eq!(sum.prompt_tokens, 256);
        assert!((sum.output_tokens_per_s - 20.0).abs() < 1e-9);
        assert!((sum.requests_per_s - 1.0).abs() < 1e-9);
        assert_eq!(sum.ttft_s[0], 0.1);
        assert_eq!(sum.ttft_s[1], 0.3);
        assert!((sum.itl_s[0] - 0.01).abs() < 1e-12);
    }
}
