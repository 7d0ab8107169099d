//! The autoscaler against real engines: two `ferrite-engine serve` processes on loopback with
//! the default model, driven past their queue and TTFT targets by concurrent clients. The
//! operator's autoscaler (the same scrape → window → decide path it runs for pods, pointed at
//! these two endpoints) must recommend scaling up and say why; once the load stops it must
//! hold the replica count for the stabilization window and only then recommend scaling down.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrite_e2e::{free_port, KillOnDrop};
use ferrite_operator::autoscale::policy::Targets;
use ferrite_operator::autoscale::ServiceState;
use serde_json::json;

/// An engine, killed when the test ends, however it ends.
struct Engine {
    _child: KillOnDrop,
    url: String,
}

fn start_engine() -> Engine {
    let port = free_port();
    let child = Command::new(ferrite_e2e::engine_bin())
        .args(["serve", "--model"])
        .arg(ferrite_e2e::default_model())
        .args(["--served-model-name", "smollm2", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        // Two sequences at a time, so a dozen clients make a queue.
        .args(["--max-num-seqs", "2", "--max-model-len", "512"])
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("ferrite-engine starts");
    Engine {
        _child: KillOnDrop(child),
        url: format!("http://127.0.0.1:{port}"),
    }
}

async fn wait_healthy(http: &reqwest::Client, engine: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ok = http
            .get(format!("{}/health", engine.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} never became healthy",
            engine.url
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One client: completions back to back until `stop`.
async fn client_loop(http: reqwest::Client, url: String, stop: Arc<AtomicBool>) {
    let body = json!({
        "model": "smollm2",
        "prompt": "The history of the printing press begins in the fifteenth century, when",
        "max_tokens": 32,
        "temperature": 0.8,
    });
    while !stop.load(Ordering::Relaxed) {
        let _ = http
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaler_scales_real_engines_up_under_load_and_down_after_stabilization() {
    let http = reqwest::Client::new();
    let engines = [start_engine(), start_engine()];
    for e in &engines {
        wait_healthy(&http, e).await;
    }
    let endpoints: Vec<(String, Option<String>)> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (format!("engine-{i}"), Some(format!("{}/metrics", e.url))))
        .collect();
    let targets = Targets {
        min: 1,
        max: 8,
        // Far below any TTFT a queued request can have, so no speed is assumed.
        ttft_seconds: Some(0.01),
        ttft_quantile: 0.9,
        queue_depth: Some(1.0),
        window_seconds: 3.0,
        stabilization_seconds: 5.0,
        scale_to_zero_after: None,
    };
    let current = 2;
    let mut state = ServiceState::default();
    let started = Instant::now();
    let interval = Duration::from_millis(500);
    let timeout = Duration::from_secs(2);

    // Load: twelve clients per engine against two sequence slots each.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = engines
        .iter()
        .flat_map(|e| std::iter::repeat_n(e.url.clone(), 12))
        .map(|url| tokio::spawn(client_loop(http.clone(), url, stop.clone())))
        .collect();

    let up = loop {
        tokio::time::sleep(interval).await;
        let now = started.elapsed().as_secs_f64();
        let ev = state
            .evaluate(&http, &targets, current, &endpoints, now, timeout, false)
            .await;
        assert!(ev.samples.iter().all(Option::is_some), "a scrape failed");
        // Wait for both signals: the queue at once, TTFT once a window has two scrapes.
        if ev.decision.desired > current && ev.ttft.is_some() {
            break ev;
        }
        assert!(
            now < 90.0,
            "no scale-up under load; last: {:?}",
            ev.decision
        );
    };
    // Twelve waiting per engine is far above 1 per replica: the most one interval may add.
    assert_eq!(up.decision.desired, 4, "{:?}", up.decision);
    let reason = &up.decision.reason;
    assert!(
        reason.contains("per replica > target 1"),
        "the queue is over target: {reason}"
    );
    assert!(reason.contains("limited to x2 per interval"), "{reason}");
    let q = up.decision.queue_per_replica.expect("queue measured");
    assert!(q > 1.0, "queue per replica {q}");
    let ttft = up.ttft.expect("TTFT measured");
    // The reason and the reported TTFT agree: over target.
    assert!(
        reason.contains("TTFT p90 ") && reason.contains("s > target 0.01 s") && ttft > 0.01,
        "{reason} (TTFT {ttft})"
    );

    // Stop the load; the clients' connections close and the engines cancel their requests.
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.abort();
    }
    let mut last_up_vote = started.elapsed().as_secs_f64();
    let mut held = false;
    let down = loop {
        tokio::time::sleep(interval).await;
        let now = started.elapsed().as_secs_f64();
        let ev = state
            .evaluate(&http, &targets, current, &endpoints, now, timeout, false)
            .await;
        if ev.decision.recommendation >= current {
            last_up_vote = now;
        }
        if ev.decision.desired < current {
            break (now, ev);
        }
        if ev.decision.recommendation < current {
            // Idle now, but an earlier interval wanted more: the window holds the count.
            assert_eq!(ev.decision.desired, current, "{:?}", ev.decision);
            held = true;
        }
        assert!(now < 120.0, "never scaled down; last: {:?}", ev.decision);
    };
    let (at, ev) = down;
    assert!(
        held,
        "the scale-down was never held back by the stabilization window"
    );
    assert!(
        at - last_up_vote >= targets.stabilization_seconds - interval.as_secs_f64(),
        "scaled down {:.1} s after the last vote for {current} or more",
        at - last_up_vote
    );
    assert_eq!(ev.decision.desired, 1, "{:?}", ev.decision);
    assert_eq!(ev.decision.queue_per_replica, Some(0.0));
    assert!(
        ev.decision
            .reason
            .contains("queue 0 per replica <= target 1"),
        "{}",
        ev.decision.reason
    );
}
