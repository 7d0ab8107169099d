//! The chart's dashboards and alert rules against a real Prometheus: it scrapes a real engine
//! (with the labels the chart's PodMonitor gives it), the operator and the router over a real
//! control plane while a short, varied load runs through the router; then every query of
//! every dashboard panel and variable must return data through Prometheus's HTTP API, and
//! every alert rule must evaluate without error — so no panel is empty and no metric name or
//! label is misspelt.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferrite_e2e::{free_port, workspace, KillOnDrop};
use ferrite_testcluster::eventually;
use futures::StreamExt;
use serde_json::{json, Value};
use support::{chat, routable, WAIT};

/// What the dashboards' `$__rate_interval` stands for with a 1 s scrape interval.
const RATE_INTERVAL: &str = "10s";

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// A Prometheus on loopback scraping `jobs` every second, with the chart's alert rules.
struct Prometheus {
    url: String,
    _process: KillOnDrop,
}

impl Prometheus {
    fn start(dir: &Path, jobs: &str) -> Self {
        let bin = ferrite_testcluster::prometheus_dir()
            .expect("Prometheus (scripts/build-prometheus.sh)")
            .join("prometheus");
        let rules = workspace().join("charts/ferrite/rules/ferrite-alerts.yaml");
        let config = format!(
            "global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}\n\
             rule_files: [{}]\nscrape_configs:\n{jobs}",
            rules.display()
        );
        let path = dir.join("prometheus.yml");
        std::fs::write(&path, config).expect("prometheus.yml");
        let port = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
        let child = Command::new(bin)
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("prometheus starts");
        Prometheus {
            url: format!("http://127.0.0.1:{port}"),
            _process: KillOnDrop(child),
        }
    }

    /// `path` of the HTTP API with `params`; its `data`, or why not.
    async fn api(
        &self,
        http: &reqwest::Client,
        path: &str,
        params: &[(&str, String)],
    ) -> Result<Value, String> {
        let resp = http
            .get(format!("{}/api/v1/{path}", self.url))
            .query(params)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: Value = resp.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(format!("{}: {}", body["errorType"], body["error"]));
        }
        Ok(body["data"].clone())
    }
}

/// One scrape job of static targets, each with its own labels.
fn job(name: &str, honor_labels: bool, targets: &[(String, Value)]) -> String {
    let configs: Vec<Value> = targets
        .iter()
        .map(|(addr, labels)| json!({"targets": [addr], "labels": labels}))
        .collect();
    format!(
        "  - job_name: {name}\n    honor_labels: {honor_labels}\n    static_configs: {}\n",
        Value::Array(configs)
    )
}

/// A dashboard query as Grafana would send it with every variable at "All".
fn expand(expr: &str, range_seconds: u64) -> String {
    expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__range", &format!("{range_seconds}s"))
        .replace("$namespace", ".*")
        .replace("$llmservice", ".*")
        .replace("$pod", ".*")
}

/// Whether a query result holds at least one finite sample.
fn has_data(data: &Value) -> bool {
    let finite = |v: &Value| {
        v.get(1)
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    };
    data["result"].as_array().is_some_and(|series| {
        series.iter().any(|s| {
            s["values"]
                .as_array()
                .is_some_and(|vs| vs.iter().any(finite))
                || finite(&s["value"])
        })
    })
}

/// Every dashboard the chart ships, by file name.
fn dashboards() -> Vec<(String, Value)> {
    let dir = workspace().join("charts/ferrite/dashboards");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("charts/ferrite/dashboards")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no dashboards in {}", dir.display());
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("dashboard");
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            (
                name.unwrap_or_default(),
                serde_json::from_str(&text).expect("dashboard JSON"),
            )
        })
        .collect()
}

/// A stream through the router that the client leaves after its first chunk.
async fn abandoned_stream(http: &reqwest::Client, router: &str) {
    let resp = http
        .post(format!("{router}/v1/chat/completions"))
        .json(
            &json!({"model": "smol-m", "stream": true, "max_tokens": 200, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "Count to a thousand."}]}),
        )
        .send()
        .await
        .expect("a stream");
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let _ = body.next().await;
}

/// The load: plain, streamed, `n` > 1, schema-held and tool-calling chats on the one model,
/// a client that leaves midway, and a request for a model that never gets a replica (held,
/// then 504).
async fn load(http: &reqwest::Client, router: &str) {
    let system = "You are a terse assistant for a team that writes reports on rivers.";
    let mut runs = Vec::new();
    for i in 0..12 {
        let (http, router) = (http.clone(), router.to_string());
        runs.push(tokio::spawn(async move {
            let mut body = json!({"model": "smol-m", "max_tokens": 16, "temperature": 0.7,
                                  "seed": i,
                                  "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": format!("Name river {i}.")}]});
            match i % 4 {
                1 => body["n"] = json!(2),
                2 => {
                    body["response_format"] = json!({"type": "json_schema", "json_schema": {
                        "name": "river", "strict": true,
                        "schema": {"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"], "additionalProperties": false}}});
                }
                3 => {
                    body["tools"] = json!([{"type": "function", "function": {
                        "name": "lookup_river", "description": "Looks a river up.",
                        "parameters": {"type": "object",
                                       "properties": {"name": {"type": "string"}},
                                       "required": ["name"]}}}]);
                    body["tool_choice"] = json!("required");
                }
                _ => {}
            }
            let (status, reply) = chat(&http, &router, body).await;
            assert_eq!(status, 200, "{reply}");
        }));
    }
    for r in runs {
        r.await.expect("a request of the load");
    }
    abandoned_stream(http, router).await;
    let (status, reply) = chat(
        http,
        router,
        json!({"model": "smol-never", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 504, "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_and_alert_rule_reads_real_series_through_prometheus() {
    let operator_metrics = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let h = support::start_with(
        "10.231.5.0/24",
        &["--scrape-interval", "1", "--hold-timeout", "3"],
        Some(operator_metrics),
    )
    .await;
    let http = reqwest::Client::new();
    h.create(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "smol"},
        "spec": {"model": {"source": "file:///models/smollm2.gguf", "servedName": "smol-m"},
                 "replicas": 1,
                 "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 8,
                                 "targetTTFTSeconds": 30, "windowSeconds": 30}},
    }))
    .await;
    // Its pods can never be scheduled: requests for it are held, then refused.
    h.create(json!({
        "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "never"},
        "spec": {"model": {"source": "file:///models/smollm2.gguf", "servedName": "smol-never"},
                 "replicas": 1,
                 "pod": {"nodeSelector": {"ferrite.dev/no-such-node": "true"}}},
    }))
    .await;
    h.healthy_engines("smol", 1).await;
    routable(&h, &http, "smol-m").await;
    let engines: Vec<(String, Value)> = h
        .engines
        .lock()
        .expect("engines")
        .iter()
        .map(|(pod, e)| {
            let addr = e.url.trim_start_matches("http://").to_string();
            let labels = json!({"namespace": h.ns, "llmservice": e.llmservice, "pod": pod});
            (addr, labels)
        })
        .collect();
    let router_addr = h.router.trim_start_matches("http://").to_string();
    let jobs = job("engines", false, &engines)
        + &job(
            "operator",
            true,
            &[(operator_metrics.to_string(), json!({}))],
        )
        + &job("router", false, &[(router_addr, json!({}))]);
    let dir = tempfile::tempdir().expect("tempdir");
    let prom = Prometheus::start(dir.path(), &jobs);
    eventually("Prometheus to scrape every target", WAIT, || async {
        let data = prom.api(&http, "targets", &[]).await?;
        let active = data["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = active.iter().filter(|t| t["health"] == "up").count();
        Ok((active.len() == engines.len() + 2 && up == active.len()).then_some(()))
    })
    .await
    .unwrap_or_else(|e| {
        let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
        panic!("{e}\n{log}")
    });
    let started = now();

    load(&http, &h.router).await;
    // The autoscaler's TTFT over its window, and a few scrapes and rule evaluations after
    // the load.
    eventually("the autoscaler's TTFT in Prometheus", WAIT, || async {
        let data = prom
            .api(
                &http,
                "query",
                &[(
                    "query",
                    "ferrite_operator_autoscale_ttft_seconds{llmservice=\"smol\"}".to_string(),
                )],
            )
            .await?;
        Ok(has_data(&data).then_some(()))
    })
    .await
    .expect("TTFT scraped");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let end = now();
    let range = (end - started).ceil() as u64 + 1;

    // Every panel's queries, over the test's range as Grafana would ask (instant ones now).
    let mut empty = Vec::new();
    let mut asked = 0;
    for (file, dash) in dashboards() {
        let panels = dash["panels"].as_array().cloned().unwrap_or_default();
        for panel in panels.iter().filter(|p| p["type"] != "row") {
            for target in panel["targets"].as_array().cloned().unwrap_or_default() {
                let expr = expand(target["expr"].as_str().unwrap_or_default(), range);
                let result = if target["instant"] == true {
                    prom.api(&http, "query", &[("query", expr.clone())]).await
                } else {
                    let params = [
                        ("query", expr.clone()),
                        ("start", started.to_string()),
                        ("end", end.to_string()),
                        ("step", "1".to_string()),
                    ];
                    prom.api(&http, "query_range", &params).await
                };
                asked += 1;
                match result {
                    Ok(data) if has_data(&data) => {}
                    Ok(_) => empty.push(format!("{file} / {}: no data: {expr}", panel["title"])),
                    Err(e) => empty.push(format!("{file} / {}: {e}: {expr}", panel["title"])),
                }
            }
        }
        // The variables' label_values(metric{...}, label) lookups.
        let vars = dash["templating"]["list"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for var in vars.iter().filter(|v| v["type"] == "query") {
            let def = var["definition"].as_str().unwrap_or_default();
            let inner = def
                .strip_prefix("label_values(")
                .and_then(|d| d.strip_suffix(')'))
                .expect("a label_values query");
            let (series, label) = inner.rsplit_once(',').expect("label_values(series, label)");
            let params = [("match[]", expand(series.trim(), range))];
            let values = prom
                .api(&http, &format!("label/{}/values", label.trim()), &params)
                .await;
            asked += 1;
            if !values
                .as_ref()
                .is_ok_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
            {
                empty.push(format!(
                    "{file} / variable {}: {values:?}: {def}",
                    var["name"]
                ));
            }
        }
    }
    assert!(asked > 40, "only {asked} queries in the dashboards");
    assert!(
        empty.is_empty(),
        "{} of {asked} dashboard queries return nothing:\n{}",
        empty.len(),
        empty.join("\n")
    );

    // Every alert rule evaluates against the real series without error.
    let data = prom.api(&http, "rules", &[]).await.expect("rules");
    let rules: Vec<Value> = data["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(rules.len() >= 10, "{rules:?}");
    for rule in &rules {
        assert_eq!(
            rule["health"], "ok",
            "{}: {}",
            rule["name"], rule["lastError"]
        );
    }
    // Nothing in this healthy, briefly loaded cluster is firing; `never` is the one LLMService
    // without a ready replica, and it has not been so for the alert's 10 minutes.
    let firing: Vec<&Value> = rules.iter().filter(|r| r["state"] == "firing").collect();
    assert!(firing.is_empty(), "{firing:?}");
}
