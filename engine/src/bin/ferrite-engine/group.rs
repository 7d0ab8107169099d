//! `serve` as a rank of a pipeline-parallel group: which rank this process is, the ranks
//! the leader starts itself on one host (child processes of this binary that exit when
//! the leader does), and a worker rank's life — load its stage, join, run steps — with
//! `/health` for its probes when it runs on a host of its own.

use std::io::{BufRead, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferrite_engine::engine::EngineConfig;
use ferrite_engine::error::{ConfigError, Error, Result};
use ferrite_engine::model::LoadOptions;
use ferrite_engine::parallel::{RankSpec, Secret, SECRET_ENV};

use crate::cli::{GroupArgs, ServeArgs};

/// What this `serve` process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The whole model in this process.
    Single,
    /// Rank 0 of a group: the API, and on one host the parent of the other ranks.
    Leader,
    /// A stage other than the first.
    Worker,
}

fn flag_error(what: &str, message: String) -> Error {
    ConfigError::Input {
        what: what.into(),
        message,
    }
    .into()
}

/// This process's role from its flags, refusing combinations that form no group.
pub fn role(args: &ServeArgs) -> Result<Role> {
    let g = &args.group;
    let stages = args.scheduler.pipeline_parallel_size;
    if stages <= 1 {
        if g.nnodes != 1 || g.node_rank != 0 || g.headless || g.group_child {
            return Err(flag_error(
                "--nnodes/--node-rank/--headless",
                "form a pipeline-parallel group; set --pipeline-parallel-size to its number of \
                 stages"
                    .into(),
            ));
        }
        return Ok(Role::Single);
    }
    if g.nnodes != 1 && g.nnodes != stages {
        return Err(flag_error(
            &format!("--nnodes {}", g.nnodes),
            format!(
                "must be 1 (every stage on this host) or the pipeline size {stages} (one stage \
                 per host)"
            ),
        ));
    }
    if g.node_rank >= stages {
        return Err(flag_error(
            &format!("--node-rank {}", g.node_rank),
            format!("must be below the {stages} ranks of the group"),
        ));
    }
    match (g.node_rank, g.headless) {
        (0, true) => Err(flag_error(
            "--headless",
            "is for ranks other than 0; rank 0 serves the API".into(),
        )),
        (0, false) => Ok(Role::Leader),
        (r, false) => Err(flag_error(
            &format!("--node-rank {r}"),
            "serves no API; start it with --headless".into(),
        )),
        (r, true) if g.nnodes == 1 && !g.group_child => Err(flag_error(
            &format!("--node-rank {r} with --nnodes 1"),
            format!(
                "the leader starts every rank itself on one host; to run rank {r} on a host \
                 of its own, start each rank with --nnodes {stages}"
            ),
        )),
        (_, true) => Ok(Role::Worker),
    }
}

/// The group's secret for ranks started by hand: the file, else the environment.
fn configured_secret(g: &GroupArgs) -> Result<Secret> {
    if let Some(f) = &g.group_secret_file {
        return Secret::from_file(f);
    }
    match std::env::var(SECRET_ENV) {
        Ok(v) => Secret::new(v.as_bytes()),
        Err(_) => Err(flag_error(
            "--group-secret-file",
            format!(
                "a group across hosts needs a shared secret: give every rank the same \
                 --group-secret-file or {SECRET_ENV}"
            ),
        )),
    }
}

/// Threads each of `ranks` processes on this host gets: the machine's (or
/// RAYON_NUM_THREADS) divided among them.
fn threads_per_rank(ranks: usize) -> usize {
    let total = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    (total / ranks.max(1)).max(1)
}

/// The leader's side of a group before its model loads: the listener ranks join, what
/// they must agree on, and the ranks it started (whose stdin closes when it exits).
pub struct Leader {
    /// Where ranks join.
    pub listener: TcpListener,
    /// The group's settings.
    pub spec: RankSpec,
    children: Vec<(Child, ChildStdin)>,
}

impl Drop for Leader {
    fn drop(&mut self) {
        // Closing their stdin ends the ranks this process started.
        for (child, stdin) in self.children.drain(..) {
            drop(stdin);
            let mut child = child;
            let _ = child.wait();
        }
    }
}

fn spec(
    args: &ServeArgs,
    model: &Path,
    engine: &EngineConfig,
    load: LoadOptions,
    secret: Secret,
) -> RankSpec {
    RankSpec {
        model: model.to_path_buf(),
        load,
        engine: engine.clone(),
        secret,
        timeout: Duration::from_secs(args.group.group_timeout),
    }
}

/// Binds where ranks join and, on one host, starts ranks `1..` as children of this binary
/// with the same flags, each given the threads of one rank and a fresh secret on stdin.
pub fn start_leader(
    args: &ServeArgs,
    model: &Path,
    engine: &EngineConfig,
    load: LoadOptions,
) -> Result<Leader> {
    let g = &args.group;
    let stages = args.scheduler.pipeline_parallel_size;
    if g.nnodes > 1 {
        let secret = configured_secret(g)?;
        let listener = TcpListener::bind(("0.0.0.0", g.master_port)).map_err(|e| {
            Error::Group(format!(
                "cannot listen for ranks on port {}: {e}",
                g.master_port
            ))
        })?;
        return Ok(Leader {
            listener,
            spec: spec(args, model, engine, load, secret),
            children: Vec::new(),
        });
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let threads = threads_per_rank(stages);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let secret = Secret::random();
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 1..stages {
        let mut child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .args(["--node-rank", &rank.to_string()])
            .args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port.to_string(),
            ])
            .args(["--headless", "--group-child"])
            .env("RAYON_NUM_THREADS", threads.to_string())
            .env_remove(SECRET_ENV)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Group(format!("cannot start rank {rank}: {e}")))?;
        let mut stdin = child
            .stdin
            .take()
            .ok_or_else(|| Error::Group(format!("rank {rank} has no stdin")))?;
        stdin.write_all(secret.bytes())?;
        stdin.write_all(b"\n")?;
        stdin.flush()?;
        children.push((child, stdin));
    }
    tracing::info!(
        "started {} more pipeline ranks on this host, {threads} threads each",
        stages - 1
    );
    Ok(Leader {
        listener,
        spec: spec(args, model, engine, load, secret),
        children,
    })
}

/// Runs this process as worker rank `--node-rank`: its secret (from the leader on stdin,
/// or configured), `/health` on `--port` when it has a host of its own, then its stage
/// until the leader shuts the group down. Returns an error when the leader is lost.
pub fn run_worker(
    args: &ServeArgs,
    model: &Path,
    engine: &EngineConfig,
    load: LoadOptions,
) -> Result<()> {
    let g = &args.group;
    let secret = if g.group_child {
        let mut stdin = std::io::stdin().lock();
        let mut line = String::new();
        stdin.read_line(&mut line)?;
        let secret = Secret::new(line.as_bytes())?;
        // The leader holds the other end: when it exits, however it exits, so does this.
        std::thread::spawn(|| {
            let mut rest = Vec::new();
            let _ = std::io::stdin().lock().read_to_end(&mut rest);
            eprintln!("error: the group's leader has exited; this rank stops");
            std::process::exit(1);
        });
        secret
    } else {
        configured_secret(g)?
    };
    let joined = Arc::new(AtomicBool::new(false));
    if !g.group_child {
        serve_health(&args.server.host, args.server.port, Arc::clone(&joined))?;
    }
    let rank = g.node_rank;
    let leader = format!("{}:{}", g.master_addr, g.master_port);
    let spec = spec(args, model, engine, load, secret);
    let flag = Arc::clone(&joined);
    let result = spec.run_worker(rank, &leader, move || flag.store(true, Ordering::Release));
    joined.store(false, Ordering::Release);
    match result {
        Ok(()) => {
            tracing::info!("the leader shut the group down; rank {rank} exits");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `/health` of a headless rank on `host:port`, in a thread of its own: 503 until it has
/// joined its group, 200 while it serves (the process exits when the group is lost).
fn serve_health(host: &str, port: u16, joined: Arc<AtomicBool>) -> Result<()> {
    use axum::http::StatusCode;
    let listener = std::net::TcpListener::bind((host, port))
        .map_err(|e| Error::Server(format!("cannot listen on {host}:{port}: {e}")))?;
    listener.set_nonblocking(true)?;
    tracing::info!(
        "headless rank: /health on http://{}",
        listener.local_addr()?
    );
    std::thread::Builder::new()
        .name("ferrite-health".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => return tracing::error!("no runtime for /health: {e}"),
            };
            runtime.block_on(async move {
                let app = axum::Router::new().route(
                    "/health",
                    axum::routing::get(move || {
                        let joined = joined.load(Ordering::Acquire);
                        async move {
                            match joined {
                                true => (StatusCode::OK, "ok"),
                                false => (StatusCode::SERVICE_UNAVAILABLE, "joining the group"),
                            }
                        }
                    }),
                );
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => {
                        if let Err(e) = axum::serve(l, app).await {
                            tracing::error!("/health stopped: {e}");
                        }
                    }
                    Err(e) => tracing::error!("/health cannot listen: {e}"),
                }
            })
        })?;
    Ok(())
}
