//! What an engine's `/metrics` says, as the operator's autoscaler and the router read it:
//! scraped and parsed (Prometheus text format, with the `openmetrics-parser` crate, whose name
//! pattern accepts the `:` in vLLM's metric names), and the TTFT quantile over a time window
//! from differences of histogram snapshots.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::PrometheusValue;

/// The engine's TTFT histogram (vLLM's name).
pub const TTFT: &str = "vllm:time_to_first_token_seconds";
/// Requests waiting for admission.
pub const WAITING: &str = "vllm:num_requests_waiting";
/// Requests running.
pub const RUNNING: &str = "vllm:num_requests_running";
/// The share of KV-cache blocks in use.
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// Requests finished, by reason.
pub const FINISHED: &str = "vllm:request_success_total";

/// A cumulative histogram: (upper bound, cumulative count) in increasing bound order, the last
/// bound +Inf.
pub type Buckets = Vec<(f64, f64)>;

/// What one scrape of one engine says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineSample {
    /// Waiting requests.
    pub waiting: f64,
    /// Running requests.
    pub running: f64,
    /// The share of KV-cache blocks in use, 0 to 1.
    pub kv_usage: f64,
    /// Requests finished since the engine started, whatever their reason.
    pub finished: f64,
    /// The TTFT histogram, summed over its label sets (one per served model).
    pub ttft: Buckets,
}

/// Parses `/metrics` text; `None` when it carries none of the engine's metrics.
pub fn parse(text: &str) -> Option<EngineSample> {
    let exposition = parse_prometheus(text).ok()?;
    let mut sample = EngineSample::default();
    let mut seen = false;
    let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for (name, family) in &exposition.families {
        for s in family.iter_samples() {
            match (name.as_str(), &s.value) {
                (WAITING, PrometheusValue::Gauge(v) | PrometheusValue::Unknown(v)) => {
                    sample.waiting += v.as_f64();
                    seen = true;
                }
                (RUNNING, PrometheusValue::Gauge(v) | PrometheusValue::Unknown(v)) => {
                    sample.running += v.as_f64();
                    seen = true;
                }
                (KV_USAGE, PrometheusValue::Gauge(v) | PrometheusValue::Unknown(v)) => {
                    sample.kv_usage = sample.kv_usage.max(v.as_f64());
                }
                (FINISHED, PrometheusValue::Counter(c)) => {
                    sample.finished += c.value.as_f64();
                }
                (FINISHED, PrometheusValue::Unknown(v)) => sample.finished += v.as_f64(),
                (TTFT, PrometheusValue::Histogram(h)) => {
                    for b in &h.buckets {
                        // Key by the bound's bit pattern: bounds are positive, so order holds.
                        let e = buckets
                            .entry(b.upper_bound.to_bits())
                            .or_insert((b.upper_bound, 0.0));
                        e.1 += b.count.as_f64();
                    }
                    seen = true;
                }
                _ => {}
            }
        }
    }
    sample.ttft = buckets.into_values().collect();
    seen.then_some(sample)
}

/// Scrapes and parses one engine's `/metrics`; `None` when it cannot be read or is no
/// engine's.
pub async fn scrape(http: &reqwest::Client, url: &str, timeout: Duration) -> Option<EngineSample> {
    let resp = http.get(url).timeout(timeout).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    parse(&resp.text().await.ok()?)
}

/// `now - then` bucket by bucket; `None` when a count went down (the engine restarted, so its
/// counters started again from zero) or the bucket layouts differ.
pub fn difference(now: &Buckets, then: &Buckets) -> Option<Buckets> {
    if now.len() != then.len() {
        return None;
    }
    now.iter()
        .zip(then)
        .map(|((b, n), (b2, t))| (b == b2 && n >= t).then_some((*b, n - t)))
        .collect()
}

/// Adds histograms with the same bounds (pods of one service); mismatched layouts are skipped.
pub fn sum(hists: &[Buckets]) -> Buckets {
    let mut total: Buckets = Vec::new();
    for h in hists {
        if total.is_empty() {
            total = h.clone();
        } else if total.len() == h.len() && total.iter().zip(h).all(|(a, b)| a.0 == b.0) {
            for (a, b) in total.iter_mut().zip(h) {
                a.1 += b.1;
            }
        }
    }
    total
}

/// The `q` quantile of a cumulative histogram, interpolating linearly inside the bucket as
/// Prometheus' `histogram_quantile` does; `None` without observations. A quantile in the +Inf
/// bucket is reported as the highest finite bound.
pub fn quantile(q: f64, h: &Buckets) -> Option<f64> {
    let total = h.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev_bound = 0.0;
    let mut prev_count = 0.0;
    for &(bound, count) in h {
        if count >= rank {
            if bound.is_infinite() {
                return Some(prev_bound);
            }
            let in_bucket = count - prev_count;
            if in_bucket <= 0.0 {
                return Some(bound);
            }
            return Some(prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket);
        }
        prev_bound = bound;
        prev_count = count;
    }
    Some(prev_bound)
}

/// One pod's histogram snapshots over time, enough to difference across a window.
#[derive(Debug, Clone, Default)]
pub struct PodWindow {
    snapshots: VecDeque<(f64, Buckets)>,
    after_reset: bool,
}

impl PodWindow {
    /// Records a snapshot taken at `at` (seconds) and forgets those no longer needed for a
    /// window of `window` seconds (the newest one at or before the window's start is kept as
    /// its base).
    pub fn record(&mut self, at: f64, ttft: Buckets, window: f64) {
        if let Some((_, last)) = self.snapshots.back() {
            if difference(&ttft, last).is_none() {
                // Counter reset: history before the restart cannot be compared.
                self.snapshots.clear();
                self.after_reset = true;
            }
        }
        self.snapshots.push_back((at, ttft));
        let start = at - window;
        while self.snapshots.len() > 1 && self.snapshots.get(1).is_some_and(|(t, _)| *t <= start) {
            self.snapshots.pop_front();
        }
    }

    /// Observations within the window ending at the latest snapshot: the latest minus the
    /// window's base. Right after a counter reset the base is zero (the counts since the engine
    /// restarted); with a single snapshot otherwise there is no window yet (`None`).
    pub fn in_window(&self) -> Option<Buckets> {
        let (_, latest) = self.snapshots.back()?;
        match self.snapshots.front() {
            Some((_, base)) if self.snapshots.len() > 1 => difference(latest, base),
            _ if self.after_reset => Some(latest.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captured from `ferrite-engine serve` (SmolLM2-135M) after four requests.
    const ENGINE_METRICS: &str = include_str!("testdata/engine_metrics.txt");

    #[test]
    fn parses_real_engine_metrics() {
        let s = parse(ENGINE_METRICS).expect("engine metrics");
        assert_eq!(s.waiting, 0.0);
        assert_eq!(s.running, 0.0);
        assert_eq!(s.kv_usage, 0.0);
        assert_eq!(s.finished, 4.0, "four requests finished");
        let last = s.ttft.last().expect("buckets");
        assert!(last.0.is_infinite());
        assert_eq!(last.1, 4.0, "four requests were observed");
        assert!(s
            .ttft
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(parse("# nothing here\nother_metric 1\n"), None);
    }

    #[test]
    fn quantile_from_bucket_differences_matches_a_hand_computation() {
        let then: Buckets = vec![(0.1, 10.0), (0.5, 20.0), (1.0, 30.0), (f64::INFINITY, 30.0)];
        let now: Buckets = vec![(0.1, 10.0), (0.5, 30.0), (1.0, 70.0), (f64::INFINITY, 70.0)];
        let d = difference(&now, &then).expect("no reset");
        assert_eq!(
            d,
            vec![(0.1, 0.0), (0.5, 10.0), (1.0, 40.0), (f64::INFINITY, 40.0)]
        );
        // 40 observations in the window; p90 is the 36th: 26 into the (0.5, 1.0] bucket of 30,
        // so 0.5 + 0.5 * 26/30.
        let p90 = quantile(0.9, &d).expect("data");
        assert!((p90 - (0.5 + 0.5 * 26.0 / 30.0)).abs() < 1e-12, "{p90}");
        // p20 is the 8th, inside (0.1, 0.5]: 0.1 + 0.4 * 8/10.
        assert!((quantile(0.2, &d).expect("data") - 0.42).abs() < 1e-12);
        assert_eq!(quantile(0.9, &vec![(0.1, 0.0), (f64::INFINITY, 0.0)]), None);
        assert_eq!(
            quantile(0.99, &vec![(0.1, 1.0), (f64::INFINITY, 5.0)]),
            Some(0.1)
        );
    }

    #[test]
    fn window_uses_the_base_at_its_start_and_survives_a_counter_reset() {
        let h = |a: f64, b: f64| -> Buckets { vec![(0.5, a), (f64::INFINITY, b)] };
        let mut w = PodWindow::default();
        w.record(0.0, h(10.0, 10.0), 60.0);
        assert_eq!(w.in_window(), None, "one snapshot is no window");
        w.record(30.0, h(20.0, 25.0), 60.0);
        w.record(60.0, h(30.0, 40.0), 60.0);
        assert_eq!(w.in_window(), Some(h(20.0, 30.0)), "since t=0");
        w.record(90.0, h(30.0, 50.0), 60.0);
        assert_eq!(w.in_window(), Some(h(10.0, 25.0)), "since t=30");
        // The engine restarted: counts fell. The window restarts from the new counters.
        w.record(120.0, h(2.0, 3.0), 60.0);
        assert_eq!(w.in_window(), Some(h(2.0, 3.0)));
        w.record(150.0, h(4.0, 9.0), 60.0);
        assert_eq!(w.in_window(), Some(h(2.0, 6.0)));
        assert_eq!(sum(&[h(1.0, 2.0), h(3.0, 4.0)]), h(4.0, 6.0));
    }
}
