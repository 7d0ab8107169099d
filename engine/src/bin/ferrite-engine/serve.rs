//! `ferrite-engine serve`: bind the OpenAI-compatible server, load the model behind it
//! (`/health` answers 503 until it is loaded), and serve until SIGTERM drains it.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use clap::Parser;
use ferrite_engine::engine::EngineHandle;
use ferrite_engine::error::{ConfigError, Error, Result};
use ferrite_engine::server::{run as run_server, AppState, ServerConfig};

use crate::cli::{engine_config, Cli, Command, ServeArgs};
use crate::group::{self, Role};

/// Where Kubernetes reads a container's termination message.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// A `--from-manifest` problem.
fn manifest_error(path: &Path, message: String) -> Error {
    ConfigError::Input {
        what: format!("--from-manifest {}", path.display()),
        message,
    }
    .into()
}

/// The `serve` flags an LLMService manifest stands for: its model (a `file://` source) and
/// `spec.engine` through the mapping the operator uses.
pub fn manifest_args(path: &Path) -> Result<Vec<String>> {
    use ferrite_crds::{engine_args, served_model_names, LLMService, ModelSource};
    let bad = |m: String| manifest_error(path, m);
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let svc: LLMService =
        serde_yaml::from_str(&text).map_err(|e| bad(format!("not an LLMService: {e}")))?;
    let model = &svc.spec.model;
    let file = match ModelSource::parse(&model.source, model.revision.as_deref())
        .map_err(|e| bad(e.to_string()))?
    {
        ModelSource::File(p) => match &model.file {
            Some(f) => p.join(f),
            None => p,
        },
        ModelSource::HuggingFace { .. } | ModelSource::Pvc { .. } => {
            return Err(bad(format!(
                "source `{}` is fetched or mounted by the operator inside a pod; to serve it \
                 locally, point spec.model.source at a local copy with file:///abs/path",
                model.source
            )))
        }
    };
    let mut args = vec![
        "ferrite-engine".to_string(),
        "serve".into(),
        "--model".into(),
        file.display().to_string(),
        "--served-model-name".into(),
    ];
    args.extend(served_model_names(&svc));
    args.extend(engine_args(&svc.spec));
    Ok(args)
}

/// Serves until SIGTERM or Ctrl-C; a failure is also written where Kubernetes reads a
/// container's termination message.
pub fn run(args: ServeArgs) -> Result<()> {
    let result = serve(args);
    if let Err(e) = &result {
        if Path::new(TERMINATION_LOG).exists() {
            let _ = std::fs::write(TERMINATION_LOG, e.to_string());
        }
    }
    result
}

fn serve(args: ServeArgs) -> Result<()> {
    if let Some(manifest) = &args.from_manifest {
        let mut argv = manifest_args(manifest)?;
        let sv = &args.server;
        argv.extend([
            "--host".to_string(),
            sv.host.clone(),
            "--port".into(),
            sv.port.to_string(),
            "--shutdown-timeout".into(),
            sv.shutdown_timeout.to_string(),
            "--max-stored-responses".into(),
            sv.max_stored_responses.to_string(),
            "--stall-timeout".into(),
            sv.stall_timeout.to_string(),
            "--max-waiting-requests".into(),
            args.scheduler.max_waiting_requests.to_string(),
        ]);
        argv.extend(args.group.to_args());
        tracing::info!("serving {} as: {}", manifest.display(), argv[1..].join(" "));
        let cli =
            Cli::try_parse_from(&argv).map_err(|e| manifest_error(manifest, e.to_string()))?;
        return match cli.command {
            Command::Serve(a) => serve(*a),
            _ => Err(manifest_error(manifest, "did not map to `serve`".into())),
        };
    }
    let Some(model_path) = args.model.clone() else {
        return Err(ConfigError::Input {
            what: "serve".into(),
            message: "--model or --from-manifest is required".into(),
        }
        .into());
    };
    let mut names = args.server.served_model_name.clone();
    if let Some(empty) = names.iter().find(|n| n.trim().is_empty()) {
        return Err(ConfigError::Input {
            what: format!("--served-model-name {empty:?}"),
            message: "a served model name must not be empty".into(),
        }
        .into());
    }
    if names.is_empty() {
        let p = &model_path;
        let stem = if p.is_dir() {
            p.file_name()
        } else {
            p.file_stem()
        };
        names.push(
            stem.map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        );
    }
    let config = ServerConfig {
        served_model_names: names,
        shutdown_timeout: std::time::Duration::from_secs(args.server.shutdown_timeout),
        max_stored_responses: args.server.max_stored_responses,
        stall_timeout: (args.server.stall_timeout > 0)
            .then(|| std::time::Duration::from_secs(args.server.stall_timeout)),
    };
    let engine_config = engine_config(&args.cache, &args.scheduler);
    let load_options = args.load.options();
    let role = group::role(&args)?;
    match role {
        Role::Worker => return group::run_worker(&args, &model_path, &engine_config, load_options),
        Role::TensorPeer => {
            return group::run_tensor_peer(&args, &model_path, &engine_config, load_options)
        }
        Role::Single | Role::Leader => {}
    }
    // The group's listener and ranks exist before the API does, so a port conflict or a
    // rank that cannot start fails startup at once.
    let leader = match role {
        Role::Leader => Some(group::start_leader(
            &args,
            &model_path,
            &engine_config,
            load_options,
        )?),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let state = AppState::new(config)
            .map_err(|e| Error::internal(format!("cannot register the metrics: {e}")))?;
        let addr = (args.server.host.as_str(), args.server.port);
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            Error::Server(format!(
                "cannot listen on {}:{}: {e}",
                args.server.host, args.server.port
            ))
        })?;
        tracing::info!("listening on http://{}", listener.local_addr()?);
        let server = tokio::spawn(run_server(
            listener,
            Arc::clone(&state),
            ferrite_util::shutdown_signal(),
        ));
        let load_state = Arc::clone(&state);
        let _group = tokio::task::spawn_blocking(move || -> Result<Option<group::Leader>> {
            let (engine, tokenizer) = match &leader {
                Some(l) => l.spec.start_leader(&l.listener, l.tensor.as_ref())?,
                None => {
                    let loaded =
                        ferrite_engine::model::load_with(&model_path, &Device::Cpu, &load_options)?;
                    let tokenizer = loaded.tokenizer.clone();
                    (EngineHandle::start(loaded, engine_config)?, tokenizer)
                }
            };
            load_state.set_ready(engine, tokenizer);
            tracing::info!(
                "model loaded; serving `{}`",
                load_state.config.served_model_names.join("`, `")
            );
            Ok(leader)
        })
        .await
        .map_err(|e| Error::internal(format!("the model loader did not finish: {e}")))??;
        server
            .await
            .map_err(|e| Error::internal(format!("the server task did not finish: {e}")))??;
        // Drained: end the engine, so the ranks of a group hear from their leader that it
        // is over rather than find it gone.
        let stopping = Arc::clone(&state);
        let stopped = tokio::task::spawn_blocking(move || {
            stopping.stop_engine(std::time::Duration::from_secs(10))
        })
        .await
        .unwrap_or(false);
        if !stopped {
            tracing::warn!("the engine did not end within 10 s of the drain");
        }
        Ok(())
    })
}
