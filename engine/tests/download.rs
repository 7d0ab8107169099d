//! `ferrite-engine download` against a local server that speaks the Hugging Face hub's HTTP
//! API: the revision API, `resolve` redirects with ETags, range requests, 401 and 404.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

const TOKEN: &str = "hf_test_secret_token_123";

#[derive(Default)]
struct Hub {
    /// repo -> file -> contents
    repos: HashMap<String, HashMap<String, Vec<u8>>>,
    gated: Vec<String>,
    /// CDN requests seen: (file, Range header)
    cdn_requests: Vec<(String, Option<String>)>,
    /// Break the next CDN response after this many bytes.
    break_after: Option<usize>,
}

type Shared = Arc<Mutex<Hub>>;

fn sha256(b: &[u8]) -> String {
    format!("{:x}", Sha256::digest(b))
}

fn authorized(hub: &Hub, repo: &str, headers: &HeaderMap) -> bool {
    !hub.gated.iter().any(|g| g == repo)
        || headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            == Some(&format!("Bearer {TOKEN}"))
}

async fn revision(
    State(hub): State<Shared>,
    UrlPath((org, name, _rev)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let hub = hub.lock().expect("lock");
    let repo = format!("{org}/{name}");
    let Some(files) = hub.repos.get(&repo) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    if !authorized(&hub, &repo, &headers) {
        return (StatusCode::UNAUTHORIZED, "Access to model is restricted").into_response();
    }
    let siblings: Vec<_> = files
        .iter()
        .map(|(f, b)| {
            if f.ends_with(".json") || f.ends_with(".md") {
                serde_json::json!({"rfilename": f, "size": b.len()})
            } else {
                serde_json::json!({"rfilename": f, "size": b.len(), "lfs": {"sha256": sha256(b), "size": b.len()}})
            }
        })
        .collect();
    axum::Json(serde_json::json!({"id": repo, "sha": "0123456789abcdef", "siblings": siblings}))
        .into_response()
}

async fn resolve(
    State(hub): State<Shared>,
    UrlPath((org, name, rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let hub = hub.lock().expect("lock");
    let repo = format!("{org}/{name}");
    assert_eq!(
        rev, "0123456789abcdef",
        "files are fetched at the pinned commit"
    );
    let Some(b) = hub.repos.get(&repo).and_then(|r| r.get(&file)) else {
        return (StatusCode::NOT_FOUND, "Entry not found").into_response();
    };
    if !authorized(&hub, &repo, &headers) {
        return (StatusCode::UNAUTHORIZED, "Access restricted").into_response();
    }
    Response::builder()
        .status(StatusCode::FOUND)
        .header(header::LOCATION, format!("/cdn/{repo}/{file}"))
        .header(header::ETAG, format!("\"{}\"", sha256(b)))
        .header("x-repo-commit", "0123456789abcdef")
        .body(Body::empty())
        .expect("response")
}

async fn cdn(
    State(hub): State<Shared>,
    UrlPath((org, name, file)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let mut hub = hub.lock().expect("lock");
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    hub.cdn_requests.push((file.clone(), range.clone()));
    let Some(b) = hub
        .repos
        .get(&format!("{org}/{name}"))
        .and_then(|r| r.get(&file))
        .cloned()
    else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let start = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    if start >= b.len() && start > 0 {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    let rest = b[start..].to_vec();
    let status = if start > 0 {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let len = rest.len();
    let body = match hub.break_after.take() {
        Some(n) => {
            use futures::StreamExt;
            let first = Bytes::from(rest[..n.min(len)].to_vec());
            // The first part goes out, then the connection breaks.
            let broken = futures::stream::once(async {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                Err::<Bytes, _>(std::io::Error::other("connection reset"))
            });
            Body::from_stream(futures::stream::iter([Ok(first)]).chain(broken))
        }
        None => Body::from(rest),
    };
    let mut r = Response::builder()
        .status(status)
        .header(header::CONTENT_LENGTH, len)
        .header(header::ETAG, format!("\"{}\"", sha256(&b)));
    if start > 0 {
        r = r.header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{}", b.len() - 1, b.len()),
        );
    }
    r.body(body).expect("response")
}

struct Server {
    url: String,
    hub: Shared,
    _rt: tokio::runtime::Runtime,
}

fn serve(hub: Hub) -> Server {
    let hub: Shared = Arc::new(Mutex::new(hub));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let app = Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(revision))
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
        .route("/cdn/{org}/{name}/{*file}", get(cdn))
        .with_state(hub.clone());
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    rt.spawn(async move { axum::serve(listener, app).await });
    Server { url, hub, _rt: rt }
}

fn weights(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn hub() -> Hub {
    let mut repos = HashMap::new();
    repos.insert(
        "org/gguf".to_string(),
        HashMap::from([
            ("model.Q4_1.gguf".to_string(), weights(300_000, 1)),
            ("model.Q8_0.gguf".to_string(), weights(500_000, 2)),
            ("README.md".to_string(), b"# a model".to_vec()),
        ]),
    );
    repos.insert(
        "org/safetensors".to_string(),
        HashMap::from([
            (
                "config.json".to_string(),
                b"{\"model_type\": \"llama\"}".to_vec(),
            ),
            ("tokenizer.json".to_string(), b"{}".to_vec()),
            ("model.safetensors".to_string(), weights(200_000, 3)),
            ("README.md".to_string(), b"# readme".to_vec()),
            ("onnx/model.onnx".to_string(), weights(1000, 4)),
        ]),
    );
    repos.insert(
        "org/gated".to_string(),
        HashMap::from([("model.gguf".to_string(), weights(100_000, 5))]),
    );
    Hub {
        repos,
        gated: vec!["org/gated".into()],
        ..Hub::default()
    }
}

fn run(server: &Server, args: &[&str], token: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"));
    cmd.arg("download")
        .args(args)
        .env("HF_ENDPOINT", &server.url)
        .env_remove("HF_TOKEN");
    if let Some(t) = token {
        cmd.env("HF_TOKEN", t);
    }
    let out = cmd.output().expect("run ferrite-engine download");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn cdn_count(server: &Server) -> usize {
    server.hub.lock().expect("lock").cdn_requests.len()
}

fn to(dir: &Path) -> &str {
    dir.to_str().expect("utf-8 path")
}

#[test]
fn downloads_one_gguf_and_does_nothing_when_complete() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, stdout, stderr) = run(
        &server,
        &[
            "hf://org/gguf",
            "--to",
            to(dir.path()),
            "--file",
            "model.Q4_1.gguf",
        ],
        None,
    );
    assert!(ok, "{stderr}");
    let got = std::fs::read(dir.path().join("model.Q4_1.gguf")).expect("file");
    assert_eq!(got, weights(300_000, 1));
    assert!(stdout.contains("model.Q4_1.gguf"), "{stdout}");
    assert!(!dir.path().join("model.Q8_0.gguf").exists() && !dir.path().join("README.md").exists());
    assert_eq!(cdn_count(&server), 1);

    let (ok, _, stderr) = run(
        &server,
        &[
            "hf://org/gguf@main",
            "--to",
            to(dir.path()),
            "--file",
            "model.Q4_1.gguf",
        ],
        None,
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        cdn_count(&server),
        1,
        "a complete file is not fetched again"
    );
}

#[test]
fn several_ggufs_without_file_is_refused_with_the_choices() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, stderr) = run(&server, &["hf://org/gguf", "--to", to(dir.path())], None);
    assert!(!ok);
    assert!(
        stderr.contains("2 GGUF files")
            && stderr.contains("model.Q8_0.gguf")
            && stderr.contains("--file"),
        "{stderr}"
    );
}

#[test]
fn safetensors_repo_gets_only_what_the_engine_loads() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, stderr) = run(
        &server,
        &["hf://org/safetensors", "--to", to(dir.path())],
        None,
    );
    assert!(ok, "{stderr}");
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(dir.path().join(f).is_file(), "{f} missing");
    }
    assert!(!dir.path().join("README.md").exists() && !dir.path().join("onnx").exists());
    assert_eq!(
        std::fs::read(dir.path().join("model.safetensors")).expect("read"),
        weights(200_000, 3)
    );
}

#[test]
fn gated_repo_needs_the_token_and_never_prints_it() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, stderr) = run(&server, &["hf://org/gated", "--to", to(dir.path())], None);
    assert!(!ok);
    assert!(
        stderr.contains("401") && stderr.contains("HF_TOKEN"),
        "{stderr}"
    );
    let (ok, _, stderr) = run(
        &server,
        &["hf://org/gated", "--to", to(dir.path())],
        Some("hf_wrong"),
    );
    assert!(!ok);
    assert!(stderr.contains("does not grant access"), "{stderr}");
    assert!(!stderr.contains("hf_wrong"), "the token leaked: {stderr}");
    let (ok, stdout, stderr) = run(
        &server,
        &["hf://org/gated", "--to", to(dir.path())],
        Some(TOKEN),
    );
    assert!(ok, "{stderr}");
    assert!(
        !stdout.contains(TOKEN) && !stderr.contains(TOKEN),
        "the token leaked"
    );
    assert_eq!(
        std::fs::read(dir.path().join("model.gguf")).expect("read"),
        weights(100_000, 5)
    );
}

#[test]
fn missing_repo_or_file_is_a_clear_404() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, stderr) = run(&server, &["hf://org/nope", "--to", to(dir.path())], None);
    assert!(!ok);
    assert!(
        stderr.contains("404") && stderr.contains("hf://org/nope"),
        "{stderr}"
    );
    let (ok, _, stderr) = run(
        &server,
        &[
            "hf://org/gguf",
            "--to",
            to(dir.path()),
            "--file",
            "nope.gguf",
        ],
        None,
    );
    assert!(!ok);
    assert!(stderr.contains("no file `nope.gguf`"), "{stderr}");
    let (ok, _, stderr) = run(&server, &["s3://bucket/x", "--to", to(dir.path())], None);
    assert!(!ok);
    assert!(stderr.contains("hf://org/repo"), "{stderr}");
}

#[test]
fn an_interrupted_download_resumes_and_a_corrupt_one_restarts() {
    let server = serve(hub());
    let dir = tempfile::tempdir().expect("tempdir");
    server.hub.lock().expect("lock").break_after = Some(120_000);
    let args = [
        "hf://org/gguf",
        "--to",
        to(dir.path()),
        "--file",
        "model.Q8_0.gguf",
    ];
    let (ok, _, stderr) = run(&server, &args, None);
    assert!(!ok, "the broken transfer must fail");
    assert!(stderr.contains("run again to resume"), "{stderr}");
    let partial = dir.path().join(".model.Q8_0.gguf.incomplete");
    assert!(
        partial.exists() && !dir.path().join("model.Q8_0.gguf").exists(),
        "no final file before it is complete"
    );
    let have = std::fs::metadata(&partial).expect("partial").len();
    assert!(have > 0 && have < 500_000, "{have}");

    let (ok, _, stderr) = run(&server, &args, None);
    assert!(ok, "{stderr}");
    let last = server
        .hub
        .lock()
        .expect("lock")
        .cdn_requests
        .last()
        .cloned()
        .expect("request");
    assert_eq!(
        last.1,
        Some(format!("bytes={have}-")),
        "the second run resumes with a Range request"
    );
    assert_eq!(
        std::fs::read(dir.path().join("model.Q8_0.gguf")).expect("read"),
        weights(500_000, 2)
    );
    assert!(!partial.exists());

    // A partial file with wrong bytes: the hash check fails, the download restarts from zero.
    let dir2 = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir2.path().join(".model.Q8_0.gguf.incomplete"),
        vec![0u8; 1000],
    )
    .expect("write");
    let before = cdn_count(&server);
    let (ok, _, stderr) = run(
        &server,
        &[
            "hf://org/gguf",
            "--to",
            to(dir2.path()),
            "--file",
            "model.Q8_0.gguf",
        ],
        None,
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        cdn_count(&server) - before,
        2,
        "one resumed attempt, one fresh"
    );
    assert_eq!(
        std::fs::read(dir2.path().join("model.Q8_0.gguf")).expect("read"),
        weights(500_000, 2)
    );
}
