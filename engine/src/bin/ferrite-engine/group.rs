//! `serve` as a rank of a model-parallel group: which rank this process is, the ranks
//! started on this host (child processes of this binary that exit when their parent does:
//! the leader starts the pipeline stages, each stage's tensor rank 0 its tensor peers), and
//! a worker rank's life — load its share, join, run steps — with `/health` for its probes
//! when it runs on a host of its own.

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
use ferrite_engine::parallel::{tensor, RankSpec, Secret, TensorPeers, SECRET_ENV};

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
    /// A tensor-parallel rank other than a stage's first, started by that rank.
    TensorPeer,
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
    let tensor = args.scheduler.tensor_parallel_size;
    if g.tensor_rank > 0 {
        if g.tensor_rank >= tensor {
            return Err(flag_error(
                &format!("--tensor-rank {}", g.tensor_rank),
                format!("must be below --tensor-parallel-size {tensor}"),
            ));
        }
        return Ok(Role::TensorPeer);
    }
    if stages <= 1 && tensor > 1 {
        if g.nnodes != 1 || g.node_rank != 0 || g.headless || g.group_child {
            return Err(flag_error(
                "--nnodes/--node-rank/--headless",
                "tensor-parallel ranks all run on one host, which the leader starts itself; \
                 to span hosts, split the model into pipeline stages, one per host \
                 (--pipeline-parallel-size equal to --nnodes)"
                    .into(),
            ));
        }
        return Ok(Role::Leader);
    }
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

/// Ranks this process started, each ended (its stdin closed, then waited for) when this is
/// dropped.
#[derive(Default)]
pub struct Children(Vec<(Child, ChildStdin)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (child, stdin) in self.0.drain(..) {
            drop(stdin);
            let mut child = child;
            let _ = child.wait();
        }
    }
}

impl Children {
    /// Starts this binary again with this process's flags and `extra`, given `threads`
    /// threads and `line` on its stdin; `what` names it in errors.
    fn start(&mut self, what: &str, extra: &[String], threads: usize, line: &[u8]) -> Result<u32> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .args(extra)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .env_remove(SECRET_ENV)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Group(format!("cannot start {what}: {e}")))?;
        let mut stdin = child
            .stdin
            .take()
            .ok_or_else(|| Error::Group(format!("{what} has no stdin")))?;
        stdin.write_all(line)?;
        stdin.write_all(b"\n")?;
        stdin.flush()?;
        let pid = child.id();
        self.0.push((child, stdin));
        Ok(pid)
    }

    /// With tensor parallelism, starts tensor ranks `1..` of this process's stage with
    /// `threads` threads each, and says how tensor rank 0 reaches them.
    fn start_tensor_peers(
        &mut self,
        args: &ServeArgs,
        threads: usize,
    ) -> Result<Option<TensorPeers>> {
        let size = args.scheduler.tensor_parallel_size;
        if size <= 1 {
            return Ok(None);
        }
        let region = tensor::region_path();
        let line = region.as_os_str().as_encoded_bytes().to_vec();
        let mut pids = Vec::new();
        for t in 1..size {
            let extra = ["--tensor-rank".to_string(), t.to_string()];
            pids.push(self.start(&format!("tensor rank {t}"), &extra, threads, &line)?);
        }
        tracing::info!(
            "started {} more tensor ranks of stage {} on this host, {threads} threads each",
            size - 1,
            args.group.node_rank
        );
        Ok(Some(TensorPeers { region, pids }))
    }
}

/// The leader's side of a group before its model loads: the listener ranks join, what
/// they must agree on, and the ranks it started (whose stdin closes when it exits).
pub struct Leader {
    /// Where ranks join.
    pub listener: TcpListener,
    /// The group's settings.
    pub spec: RankSpec,
    /// How the leader reaches its own stage's tensor ranks.
    pub tensor: Option<TensorPeers>,
    _children: Children,
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
    let tensor = args.scheduler.tensor_parallel_size;
    let mut children = Children::default();
    if g.nnodes > 1 {
        let secret = configured_secret(g)?;
        // Ranks join on the address the API is served on (--host), at --master-port.
        let host = args.server.host.as_str();
        let listener = TcpListener::bind((host, g.master_port)).map_err(|e| {
            Error::Group(format!(
                "cannot listen for ranks on {host}:{}: {e}",
                g.master_port
            ))
        })?;
        let threads = threads_per_rank(tensor);
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
        let tensor = children.start_tensor_peers(args, threads)?;
        return Ok(Leader {
            listener,
            spec: spec(args, model, engine, load, secret),
            tensor,
            _children: children,
        });
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let threads = threads_per_rank(stages * tensor);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let secret = Secret::random();
    for rank in 1..stages {
        let extra: Vec<String> = [
            "--node-rank",
            &rank.to_string(),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
            "--headless",
            "--group-child",
        ]
        .map(String::from)
        .into();
        children.start(&format!("rank {rank}"), &extra, threads, secret.bytes())?;
    }
    if stages > 1 {
        tracing::info!(
            "started {} more pipeline ranks on this host, {threads} threads each",
            stages - 1
        );
    }
    let tensor = children.start_tensor_peers(args, threads)?;
    Ok(Leader {
        listener,
        spec: spec(args, model, engine, load, secret),
        tensor,
        _children: children,
    })
}

/// The first line its parent wrote on stdin, after which this process exits as soon as the
/// parent does (however it exits: stdin then reaches its end).
fn parent_line() -> Result<String> {
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line)?;
    drop(stdin);
    std::thread::spawn(|| {
        let mut rest = Vec::new();
        let _ = std::io::stdin().lock().read_to_end(&mut rest);
        eprintln!("error: the rank that started this one has exited; this rank stops");
        std::process::exit(1);
    });
    Ok(line.trim_end_matches('\n').to_string())
}

/// Runs this process as tensor rank `--tensor-rank` of stage `--node-rank`: the shared
/// memory's path from its stage's rank 0 on stdin, then every step rank 0 passes on until
/// it shuts the group down. Returns an error when a rank of the stage is lost.
pub fn run_tensor_peer(
    args: &ServeArgs,
    model: &Path,
    engine: &EngineConfig,
    load: LoadOptions,
) -> Result<()> {
    let g = &args.group;
    let region = std::path::PathBuf::from(parent_line()?);
    // The peers of a stage meet in shared memory, not over the network: no secret is used.
    let spec = spec(args, model, engine, load, Secret::random());
    spec.run_tensor_peer(g.node_rank, g.tensor_rank, &region)?;
    tracing::info!(
        "stage {} shut its tensor group down; tensor rank {} exits",
        g.node_rank,
        g.tensor_rank
    );
    Ok(())
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
    let secret = match g.group_child {
        // The leader holds the other end: when it exits, however it exits, so does this.
        true => Secret::new(parent_line()?.as_bytes())?,
        false => configured_secret(g)?,
    };
    // A child of the leader was given its threads; a host of its own divides its threads
    // among the stage's tensor ranks.
    let threads = threads_per_rank(match g.group_child {
        true => 1,
        false => args.scheduler.tensor_parallel_size,
    });
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let mut children = Children::default();
    let peers = children.start_tensor_peers(args, threads)?;
    let joined = Arc::new(AtomicBool::new(false));
    if !g.group_child {
        serve_health(&args.server.host, args.server.port, Arc::clone(&joined))?;
    }
    let rank = g.node_rank;
    let leader = format!("{}:{}", g.master_addr, g.master_port);
    let spec = spec(args, model, engine, load, secret);
    let flag = Arc::clone(&joined);
    let result = spec.run_worker(rank, &leader, peers.as_ref(), move || {
        flag.store(true, Ordering::Release)
    });
    joined.store(false, Ordering::Release);
    drop(children);
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
///
/// The same thread holds SIGTERM and SIGINT: a rank with a host of its own stops when its
/// leader ends the group, not when it is told to. Its pod is deleted together with the
/// leader's, and the leader, draining its requests first, still needs every stage until
/// it is done. Once the leader is gone the rank finds its connection closed and exits.
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
            runtime.spawn(async {
                loop {
                    ferrite_util::shutdown_signal().await;
                    tracing::info!(
                        "signal received: this rank stops when its leader ends the group"
                    );
                }
            });
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
