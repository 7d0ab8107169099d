//! The scaling decision: a pure, deterministic function of the spec, the replica counts, the
//! latest samples and the recent recommendations. No clock, no I/O — tested as a table.

use ferrite_crds::llmservice::AutoscalingSpec;

/// No change while the ratio stays within this fraction of 1.
pub const TOLERANCE: f64 = 0.10;

/// The autoscaling targets with DESIGN's defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Targets {
    /// Fewest replicas.
    pub min: i32,
    /// Most replicas.
    pub max: i32,
    /// TTFT target in seconds, if set.
    pub ttft_seconds: Option<f64>,
    /// The quantile the TTFT target applies to.
    pub ttft_quantile: f64,
    /// Waiting requests per ready replica, if set.
    pub queue_depth: Option<f64>,
    /// TTFT window in seconds.
    pub window_seconds: f64,
    /// Scale-down stabilization in seconds.
    pub stabilization_seconds: f64,
    /// With `minReplicas: 0`: seconds without requests before scaling to zero.
    pub scale_to_zero_after: Option<f64>,
}

/// Seconds without requests before an LLMService with `minReplicas: 0` scales to zero, when
/// `scaleToZeroAfterSeconds` is not set.
pub const SCALE_TO_ZERO_AFTER_SECONDS: i64 = 600;

impl Targets {
    /// Targets from `spec.autoscaling` (quantile 0.9, window 60 s, stabilization 300 s by default).
    pub fn from_spec(a: &AutoscalingSpec) -> Self {
        Self {
            min: a.min_replicas.max(0),
            max: a.max_replicas.max(a.min_replicas.max(1)),
            ttft_seconds: a.target_ttft_seconds,
            ttft_quantile: a.ttft_quantile.unwrap_or(0.9),
            queue_depth: a.target_queue_depth,
            window_seconds: a.window_seconds.unwrap_or(60) as f64,
            stabilization_seconds: a.scale_down_stabilization_seconds.unwrap_or(300) as f64,
            scale_to_zero_after: (a.min_replicas <= 0).then(|| {
                a.scale_to_zero_after_seconds
                    .unwrap_or(SCALE_TO_ZERO_AFTER_SECONDS) as f64
            }),
        }
    }
}

/// What one scrape found on one ready pod; `None` in [`Inputs::pods`] marks a pod that could
/// not be scraped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodLoad {
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:num_requests_running`.
    pub running: f64,
}

/// A past recommendation: (seconds on the caller's clock, replicas).
pub type Recommendation = (f64, i32);

/// Everything the decision depends on.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// The targets.
    pub targets: &'a Targets,
    /// Replicas the Deployment has now.
    pub current: i32,
    /// One entry per ready pod: its load, or `None` when its scrape failed.
    pub pods: &'a [Option<PodLoad>],
    /// TTFT at the target quantile over the window, summed over the pods that answered; `None`
    /// without requests in the window.
    pub ttft: Option<f64>,
    /// Recommendations of earlier intervals (oldest first).
    pub history: &'a [Recommendation],
    /// Now, on the history's clock.
    pub now: f64,
    /// Seconds since a request was last seen (running, waiting or finished on a pod, or
    /// asking for a replica); `None` when unknown.
    pub idle_seconds: Option<f64>,
    /// A request is waiting for a replica of a model at zero (the router asked, after the
    /// last scale).
    pub activation: bool,
}

/// The outcome of one interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Replicas to run.
    pub desired: i32,
    /// This interval's own recommendation (before scale-down stabilization); goes into history.
    pub recommendation: i32,
    /// Why, in words for an Event (`scaled 2 -> 4: ...`).
    pub reason: String,
    /// Set when `[min, max]` cut the recommendation: the `ScalingLimited` message.
    pub limited: Option<String>,
    /// Waiting requests per ready replica (missing pods as idle), if measured.
    pub queue_per_replica: Option<f64>,
    /// What decided it, as a metric label.
    pub signal: Signal,
}

/// What an interval's decision rested on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// TTFT against its target had the larger ratio.
    Ttft,
    /// Waiting requests per replica against their target had the larger ratio.
    Queue,
    /// No ready pod answered its scrape.
    NoMetrics,
    /// A request waits for a model at zero replicas.
    Activation,
    /// No request for `scaleToZeroAfterSeconds`.
    Idle,
}

impl Signal {
    /// The `reason` label of `ferrite_operator_autoscale_decisions_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Signal::Ttft => "ttft",
            Signal::Queue => "queue",
            Signal::NoMetrics => "no_metrics",
            Signal::Activation => "activation",
            Signal::Idle => "idle",
        }
    }
}

fn fmt(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Decides the replica count for one interval.
///
/// For each signal with data the ratio measured/target is computed; the larger wins. Pods that
/// could not be scraped count as idle when that decides a scale-up and as exactly at target
/// when it decides a scale-down, so a scrape failure never causes a change by itself. Within
/// ±10 % nothing changes; up at most ×2 (at least +1) per interval; down only to the highest
/// recommendation of the stabilization window; always within `[min, max]`.
pub fn decide(inp: &Inputs) -> Decision {
    let t = inp.targets;
    let current = inp.current.max(0);
    if let Some(d) = to_or_from_zero(inp) {
        return d;
    }
    let ready = inp.pods.len();
    let scraped: Vec<PodLoad> = inp.pods.iter().flatten().copied().collect();
    let missing = ready - scraped.len();

    let waiting: f64 = scraped.iter().map(|p| p.waiting).sum();
    let queue_per_replica = (!scraped.is_empty()).then(|| waiting / ready as f64);
    // Queue ratio with missing pods idle (for scaling up) and at target (for scaling down).
    let queue_ratio = |missing_at_target: bool| -> Option<f64> {
        let target = t.queue_depth?;
        if scraped.is_empty() {
            return None;
        }
        let extra = if missing_at_target {
            missing as f64 * target
        } else {
            0.0
        };
        Some((waiting + extra) / ready as f64 / target)
    };
    let ttft_ratio = match (inp.ttft, t.ttft_seconds) {
        (Some(v), Some(target)) if !scraped.is_empty() => Some(v / target),
        _ => None,
    };
    let ratio = |missing_at_target| {
        [queue_ratio(missing_at_target), ttft_ratio]
            .into_iter()
            .flatten()
            .reduce(f64::max)
    };
    let describe = || {
        let mut parts = Vec::new();
        if let (Some(v), Some(target)) = (inp.ttft.filter(|_| ttft_ratio.is_some()), t.ttft_seconds)
        {
            let q = (t.ttft_quantile * 100.0).round();
            let cmp = if v > target { ">" } else { "<=" };
            parts.push(format!(
                "TTFT p{q} {} s {cmp} target {} s",
                fmt(v),
                fmt(target)
            ));
        }
        if let (Some(q), Some(target)) = (queue_per_replica, t.queue_depth) {
            let cmp = if q > target { ">" } else { "<=" };
            parts.push(format!(
                "queue {} per replica {cmp} target {}",
                fmt(q),
                fmt(target)
            ));
        }
        if missing > 0 {
            parts.push(format!("{missing} of {ready} pods not scraped"));
        }
        parts.join(", ")
    };

    let base = |reason: String, recommendation: i32| Decision {
        desired: current,
        recommendation,
        reason,
        limited: None,
        queue_per_replica,
        signal: Signal::NoMetrics,
    };
    let (Some(up), Some(down)) = (ratio(false), ratio(true)) else {
        let mut d = base(
            "no metrics from any ready pod; keeping the replica count".into(),
            current,
        );
        clamp(&mut d, t, current);
        return d;
    };

    let mut recommendation = current;
    let mut reason;
    if up > 1.0 + TOLERANCE {
        let raw = (ready as f64 * up).ceil() as i32;
        let limit = (current * 2).max(current + 1);
        recommendation = raw.max(current + 1).min(limit);
        reason = describe();
        if raw > limit {
            reason.push_str(&format!("; limited to x2 per interval (wanted {raw})"));
        }
    } else if down < 1.0 - TOLERANCE {
        // Ready pods answered, so one replica stays at least (min bounds it further below).
        recommendation = ((ready as f64 * down).ceil() as i32).max(1);
        reason = describe();
    } else {
        reason = format!("within 10% of target: {}", describe());
    }
    recommendation = recommendation.max(0);

    // Scale down only to the highest recommendation within the stabilization window.
    let mut desired = recommendation;
    if recommendation < current {
        let since = inp.now - t.stabilization_seconds;
        let highest = inp
            .history
            .iter()
            .filter(|(at, _)| *at >= since)
            .map(|(_, r)| *r)
            .chain([recommendation])
            .max()
            .unwrap_or(recommendation);
        desired = highest.min(current);
        if desired > recommendation {
            reason = format!(
                "{reason}; holding {desired} (highest recommendation of the last {} s)",
                fmt(t.stabilization_seconds)
            );
        }
    }
    let signal = match (queue_ratio(false), ttft_ratio) {
        (Some(q), Some(t)) if t > q => Signal::Ttft,
        (None, Some(_)) => Signal::Ttft,
        _ => Signal::Queue,
    };
    let mut d = Decision {
        desired,
        recommendation,
        reason,
        limited: None,
        queue_per_replica,
        signal,
    };
    clamp(&mut d, t, desired);
    d
}

/// The decisions of scale to zero: one replica for a model at zero that a request is waiting
/// for, and zero for one whose every replica has been idle for `scale_to_zero_after`.
fn to_or_from_zero(inp: &Inputs) -> Option<Decision> {
    let t = inp.targets;
    let after = t.scale_to_zero_after?;
    let current = inp.current.max(0);
    let decision = |desired: i32, reason: String| Decision {
        desired,
        recommendation: desired,
        reason,
        limited: None,
        queue_per_replica: None,
        signal: if desired == 0 {
            Signal::Idle
        } else {
            Signal::Activation
        },
    };
    if current == 0 && inp.activation {
        let desired = t.min.max(1).min(t.max);
        return Some(decision(
            desired,
            "a request is waiting for a model at zero replicas".into(),
        ));
    }
    match inp.idle_seconds {
        Some(idle) if current > 0 && !inp.activation && idle >= after => Some(decision(
            0,
            format!(
                "no requests for {} s (scaleToZeroAfterSeconds {})",
                fmt(idle.floor()),
                fmt(after)
            ),
        )),
        _ => None,
    }
}

fn clamp(d: &mut Decision, t: &Targets, wanted: i32) {
    let clamped = wanted.clamp(t.min, t.max);
    if clamped != wanted {
        let bound = if wanted > t.max {
            "maxReplicas"
        } else {
            "minReplicas"
        };
        d.limited = Some(format!(
            "wanted {wanted} replicas, limited to {bound} {clamped}"
        ));
    }
    d.desired = clamped;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets() -> Targets {
        Targets {
            min: 1,
            max: 10,
            ttft_seconds: Some(0.5),
            ttft_quantile: 0.9,
            queue_depth: Some(4.0),
            window_seconds: 60.0,
            stabilization_seconds: 300.0,
            scale_to_zero_after: None,
        }
    }

    /// (name, current, pods, ttft, history, expected desired, reason contains)
    type Case = (
        &'static str,
        i32,
        Vec<Option<PodLoad>>,
        Option<f64>,
        Vec<Recommendation>,
        i32,
        &'static str,
    );

    fn load(waiting: f64) -> Option<PodLoad> {
        Some(PodLoad {
            waiting,
            running: 8.0,
        })
    }

    fn run(
        current: i32,
        pods: &[Option<PodLoad>],
        ttft: Option<f64>,
        history: &[Recommendation],
    ) -> Decision {
        decide(&Inputs {
            targets: &targets(),
            current,
            pods,
            ttft,
            history,
            now: 1000.0,
            idle_seconds: None,
            activation: false,
        })
    }

    #[test]
    fn the_table() {
        // (name, current, pods, ttft, history, expected desired, reason contains)
        let cases: Vec<Case> = vec![
            (
                "at target: no change",
                2,
                vec![load(4.0), load(4.0)],
                Some(0.5),
                vec![],
                2,
                "within 10%",
            ),
            (
                "within tolerance up",
                2,
                vec![load(4.3), load(4.3)],
                None,
                vec![],
                2,
                "within 10%",
            ),
            (
                "within tolerance down",
                2,
                vec![load(3.7), load(3.7)],
                None,
                vec![],
                2,
                "within 10%",
            ),
            (
                "queue doubles: x2",
                2,
                vec![load(8.0), load(8.0)],
                None,
                vec![],
                4,
                "queue 8 per replica > target 4",
            ),
            (
                "TTFT drives when larger",
                2,
                vec![load(4.0), load(4.0)],
                Some(1.3),
                vec![],
                4,
                "TTFT p90 1.3 s > target 0.5 s",
            ),
            (
                "queue drives when larger",
                2,
                vec![load(12.0), load(12.0)],
                Some(0.6),
                vec![],
                4,
                "queue 12",
            ),
            (
                "at most x2 per interval",
                2,
                vec![load(40.0), load(40.0)],
                None,
                vec![],
                4,
                "limited to x2 per interval (wanted 20)",
            ),
            (
                "at least +1",
                1,
                vec![load(4.8)],
                None,
                vec![],
                2,
                "queue 4.8",
            ),
            (
                "clamped to max",
                8,
                vec![load(8.0); 8],
                None,
                vec![],
                10,
                "queue 8",
            ),
            (
                "idle scales down",
                4,
                vec![load(0.0); 4],
                Some(0.1),
                vec![],
                1,
                "TTFT p90 0.1 s <= target",
            ),
            (
                "half load halves",
                4,
                vec![load(2.0); 4],
                None,
                vec![],
                2,
                "queue 2 per replica",
            ),
            (
                "stabilization holds",
                4,
                vec![load(0.0); 4],
                Some(0.1),
                vec![(900.0, 4), (950.0, 3)],
                4,
                "holding 4",
            ),
            (
                "stabilization window expires",
                4,
                vec![load(0.0); 4],
                Some(0.1),
                vec![(600.0, 4), (800.0, 2)],
                2,
                "holding 2",
            ),
            (
                "no data: no change",
                3,
                vec![None, None, None],
                None,
                vec![],
                3,
                "no metrics",
            ),
            (
                "no pods: no change",
                0,
                vec![],
                None,
                vec![],
                1,
                "no metrics",
            ),
            (
                "missing pod idle for scale-up",
                2,
                vec![load(10.0), None],
                None,
                vec![],
                3,
                "1 of 2 pods not scraped",
            ),
            (
                "missing pod at target for scale-down",
                2,
                vec![load(0.0), None],
                None,
                vec![],
                1,
                "not scraped",
            ),
            (
                "missing pods alone never scale down",
                4,
                vec![load(4.0), None, None, None],
                None,
                vec![],
                4,
                "within 10%",
            ),
        ];
        for (name, current, pods, ttft, history, want, reason) in cases {
            let d = run(current, &pods, ttft, &history);
            assert_eq!(d.desired, want, "{name}: {d:?}");
            assert!(
                d.reason.contains(reason),
                "{name}: reason {:?} lacks {reason:?}",
                d.reason
            );
        }
    }

    #[test]
    fn clamping_sets_scaling_limited() {
        let d = run(8, &[load(8.0); 8], None, &[]);
        assert_eq!(
            d.limited.as_deref(),
            Some("wanted 16 replicas, limited to maxReplicas 10")
        );
        let d = run(1, &[load(0.0)], None, &[]);
        assert_eq!((d.desired, d.limited), (1, None));
        let mut t = targets();
        t.min = 3;
        let d = decide(&Inputs {
            targets: &t,
            current: 4,
            pods: &[load(0.0); 4],
            ttft: None,
            history: &[],
            now: 0.0,
            idle_seconds: None,
            activation: false,
        });
        assert_eq!(d.desired, 3);
        assert_eq!(
            d.limited.as_deref(),
            Some("wanted 1 replicas, limited to minReplicas 3")
        );
    }

    #[test]
    fn an_idle_model_scales_to_zero_and_a_waiting_request_brings_one_replica_back() {
        let mut t = targets();
        t.min = 0;
        t.scale_to_zero_after = Some(600.0);
        let at_with =
            |t: &Targets, current: i32, pods: &[Option<PodLoad>], idle: Option<f64>, activation| {
                decide(&Inputs {
                    targets: t,
                    current,
                    pods,
                    ttft: None,
                    history: &[(900.0, 2)],
                    now: 1000.0,
                    idle_seconds: idle,
                    activation,
                })
            };
        let at = |current, pods: &[Option<PodLoad>], idle, activation| {
            at_with(&t, current, pods, idle, activation)
        };
        let idle = [Some(PodLoad {
            waiting: 0.0,
            running: 0.0,
        }); 2];
        // Quiet for less than the delay: the usual rules (here: stabilization holds 2).
        assert_eq!(at(2, &idle, Some(599.0), false).desired, 2);
        let d = at(2, &idle, Some(600.5), false);
        assert_eq!(d.desired, 0);
        assert_eq!(
            d.reason,
            "no requests for 600 s (scaleToZeroAfterSeconds 600)"
        );
        // Unknown idleness never scales to zero.
        assert_eq!(at(2, &idle, None, false).desired, 2);
        // At zero, nothing to scrape: it stays there until a request asks.
        assert_eq!(at(0, &[], Some(5000.0), false).desired, 0);
        let d = at(0, &[], Some(0.0), true);
        assert_eq!(
            (d.desired, d.reason.as_str()),
            (1, "a request is waiting for a model at zero replicas")
        );
        // Without minReplicas 0 there is no scale to zero, however quiet.
        let always_on = targets();
        assert_eq!(
            at_with(&always_on, 1, &idle[..1], Some(5000.0), false).desired,
            1
        );
    }

    #[test]
    fn flapping_input_does_not_flap_the_output() {
        // The load alternates between twice and half the target every 15 s interval.
        let t = targets();
        let mut history: Vec<Recommendation> = Vec::new();
        let mut current = 2;
        let mut outputs = Vec::new();
        for i in 0..40 {
            let now = i as f64 * 15.0;
            let per_pod = if i % 2 == 0 { 8.0 } else { 2.0 };
            let pods = vec![load(per_pod); current as usize];
            let d = decide(&Inputs {
                targets: &t,
                current,
                pods: &pods,
                ttft: None,
                history: &history,
                now,
                idle_seconds: None,
                activation: false,
            });
            history.push((now, d.recommendation));
            current = d.desired;
            outputs.push(current);
        }
        let changes = outputs.windows(2).filter(|w| w[0] != w[1]).count();
        let downs = outputs.windows(2).filter(|w| w[1] < w[0]).count();
        assert_eq!(
            downs, 0,
            "scaled down while the load kept coming back: {outputs:?}"
        );
        assert!(changes <= 3, "flapped: {outputs:?}");
    }

    #[test]
    fn the_decision_names_the_signal_that_decided_it() {
        // Queue 8/4 = 2 against TTFT 0.6/0.5 = 1.2: the queue decides.
        let d = run(2, &[load(8.0), load(8.0)], Some(0.6), &[]);
        assert_eq!(d.signal, Signal::Queue);
        // Queue 4/4 = 1 against TTFT 1.5/0.5 = 3: TTFT decides.
        let d = run(2, &[load(4.0), load(4.0)], Some(1.5), &[]);
        assert_eq!(d.signal, Signal::Ttft);
        assert_eq!(d.signal.as_str(), "ttft");
        let d = run(2, &[None, None], Some(1.5), &[]);
        assert_eq!(d.signal, Signal::NoMetrics);
    }
}
