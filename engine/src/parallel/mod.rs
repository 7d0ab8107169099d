//! Model parallelism across processes. Pipeline parallelism: the leader (rank 0) keeps the
//! API, scheduler and sampler and runs the first stage; every other rank holds one
//! contiguous stage of layers and its KV cache, joins the leader over TCP with an
//! authenticated handshake ([`wire`]), and runs each step's hidden states through its
//! layers ([`stage`]). The leader's [`Pipeline`] sends each step from stage to stage and
//! returns the last stage's logits. Tensor parallelism: each stage is T processes on one
//! host, each holding 1/T of every layer, exchanging activations through shared memory
//! ([`tensor`]). Either way the group computes exactly what one process computes.

pub mod leader;
pub mod stage;
pub mod tensor;
pub mod wire;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

pub use leader::{form_group, Member, Pipeline, StageStats};
pub use stage::{join_group, serve_stage, serve_tensor_peer};
pub use tensor::TensorGroup;

use crate::engine::{plan_cache, EngineConfig, EngineHandle};
use crate::error::{ConfigError, Error, Result};
use crate::kv::cache::new_paged;
use crate::kv::KvElementType;
use crate::model::{Llama, LoadOptions, ModelConfig};
use crate::tokenizer::Tokenizer;
use wire::{Bytes32, Layout, StageReport};

/// Where a group's shared secret is read from when no file is given.
pub const SECRET_ENV: &str = "FERRITE_GROUP_SECRET";

/// The group's shared secret. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A secret of these bytes (surrounding whitespace removed); refused when empty.
    pub fn new(bytes: &[u8]) -> Result<Self> {
        let s = bytes.trim_ascii();
        if s.is_empty() {
            return Err(ConfigError::Input {
                what: "group secret".into(),
                message: "is empty; give at least one non-blank byte".into(),
            }
            .into());
        }
        Ok(Secret(s.to_vec()))
    }

    /// A fresh random secret (for ranks the leader starts itself).
    pub fn random() -> Self {
        let bytes: [u8; 32] = rand::random();
        Secret(hex(&bytes).into_bytes())
    }

    /// The secret in the file `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ConfigError::Input {
            what: format!("--group-secret-file {}", path.display()),
            message: format!("cannot read: {e}"),
        })?;
        Self::new(&bytes)
    }

    /// The secret's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// What every rank of a group must agree on, and how long the group may take to form.
#[derive(Debug, Clone)]
pub struct GroupSettings {
    /// The settings compared at the handshake.
    pub layout: Layout,
    /// The model's fingerprint ([`crate::model::LoadedModel::fingerprint`]).
    pub fingerprint: Bytes32,
    /// The shared secret.
    pub secret: Secret,
    /// How long forming the group may take.
    pub timeout: Duration,
    /// The longest step frame: the largest batch, its tables and hidden states, and the
    /// logits of every row.
    pub max_frame: usize,
}

/// How a stage's tensor rank 0 reaches the other tensor ranks of its stage.
#[derive(Debug, Clone)]
pub struct TensorPeers {
    /// The shared-memory file rank 0 creates and the peers map.
    pub region: PathBuf,
    /// Process ids of tensor ranks 1.. as started (a peer that exits before joining fails
    /// startup at once); empty when they are not processes of their own.
    pub pids: Vec<u32>,
}

/// How a rank of a pipeline group starts: the model, how it is loaded, the engine
/// settings every rank shares, the secret and how long the group may take to form.
#[derive(Debug, Clone)]
pub struct RankSpec {
    /// The GGUF file or HF directory every rank loads.
    pub model: PathBuf,
    /// How the weights are held (`stage` is set per rank).
    pub load: LoadOptions,
    /// The engine settings (`pipeline_parallel_size` is the number of stages).
    pub engine: EngineConfig,
    /// The group's shared secret.
    pub secret: Secret,
    /// How long forming the group may take.
    pub timeout: Duration,
}

impl RankSpec {
    /// Pipeline stages of the group.
    pub fn stages(&self) -> usize {
        self.engine.pipeline_parallel_size
    }

    /// Tensor-parallel ranks of each stage.
    pub fn tensor_ranks(&self) -> usize {
        self.engine.tensor_parallel_size
    }

    /// The load options of tensor rank `tensor` of pipeline stage `rank`.
    fn options(&self, rank: usize, tensor: usize) -> LoadOptions {
        LoadOptions {
            stage: Some((rank, self.stages())),
            tensor: (self.tensor_ranks() > 1).then_some((tensor, self.tensor_ranks())),
            ..self.load
        }
    }

    /// What the tensor ranks of stage `stage` must share: the model, the settings and
    /// the stage.
    fn tensor_identity(settings: &GroupSettings, stage: usize) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(settings.fingerprint);
        h.update(format!("{:?};stage {stage}", settings.layout));
        h.finalize().into()
    }

    /// With tensor parallelism, makes `model` (tensor rank 0 of stage `stage`) compute with
    /// the stage's other tensor ranks, once they have all joined through `peers`.
    fn form_tensor(
        &self,
        model: &mut Llama,
        stage: usize,
        settings: &GroupSettings,
        peers: Option<&TensorPeers>,
    ) -> Result<()> {
        let size = self.tensor_ranks();
        if size <= 1 {
            return Ok(());
        }
        let peers = peers.ok_or_else(|| {
            Error::internal("tensor rank 0 started without its peers' shared memory")
        })?;
        let slot = tensor_slot_bytes(model.config(), &settings.layout);
        let identity = Self::tensor_identity(settings, stage);
        let mut group = TensorGroup::create(&peers.region, size, slot, identity)?;
        tracing::info!(
            "stage {stage}: waiting for {} more tensor ranks ({:.1} MiB of shared memory)",
            size - 1,
            (2 * slot) as f64 / (1 << 20) as f64
        );
        group.wait_for_peers(self.timeout, &peers.pids)?;
        model.join_tensor_group(Arc::new(group))
    }

    /// Runs tensor rank `tensor` (1 or more) of pipeline stage `stage`: loads its share,
    /// sizes its cache from its own budget, joins the stage's tensor rank 0 through the
    /// shared memory at `region`, and runs every step rank 0 passes on until it shuts the
    /// group down (`Ok`) or a rank is lost (`Err`). Its steps run in a thread pool of its
    /// own.
    pub fn run_tensor_peer(&self, stage: usize, tensor: usize, region: &Path) -> Result<()> {
        let (mut model, fingerprint) =
            crate::model::load_part_with(&self.model, &Device::Cpu, &self.options(stage, tensor))?;
        let (settings, kv, max_model_len) = self.settings(&model, fingerprint)?;
        let plan = plan_cache(&model, &self.engine, kv, max_model_len)?;
        let report = (plan.num_blocks as u64, model.resident_weight_bytes() as u64);
        let identity = Self::tensor_identity(&settings, stage);
        let group = TensorGroup::join(
            region,
            tensor,
            self.tensor_ranks(),
            identity,
            report,
            self.timeout,
        )?;
        model.join_tensor_group(Arc::new(group))?;
        tracing::info!("tensor rank {tensor} of stage {stage} joined its group");
        let mut cache = new_paged(&model, kv, plan.block_size);
        in_own_pool(|| {
            serve_tensor_peer(&model, cache.as_mut(), plan.num_blocks, settings.max_frame)
        })?
    }

    /// What this rank checks the others against, with the element type of its cache and
    /// the longest sequence.
    fn settings(
        &self,
        model: &Llama,
        fingerprint: Bytes32,
    ) -> Result<(GroupSettings, KvElementType, usize)> {
        let c = model.config();
        let max_model_len = self.engine.validate(c)?;
        let kv = self.engine.kv_dtype.resolve(model);
        let e = &self.engine;
        let layout = Layout {
            pipeline: self.stages() as u32,
            tensor: e.tensor_parallel_size as u32,
            block_size: e.block_size as u32,
            max_num_batched_tokens: e.max_num_batched_tokens as u32,
            max_num_seqs: e.max_num_seqs as u32,
            max_model_len: max_model_len as u32,
            kv_f16: kv == KvElementType::F16,
        };
        let settings = GroupSettings {
            max_frame: max_step_frame(c, &layout),
            layout,
            fingerprint,
            secret: self.secret.clone(),
            timeout: self.timeout,
        };
        Ok((settings, kv, max_model_len))
    }

    /// Runs worker rank `rank`: loads its stage, sizes its cache from its own memory
    /// budget, joins the leader at `leader` (`host:port`), calls `joined`, and runs steps
    /// until the leader shuts the group down (`Ok`) or is lost (`Err`).
    /// With tensor parallelism, `peers` reaches the stage's other tensor ranks, and the
    /// steps run in a thread pool of their own.
    pub fn run_worker(
        &self,
        rank: usize,
        leader: &str,
        peers: Option<&TensorPeers>,
        joined: impl FnOnce(),
    ) -> Result<()> {
        let (mut model, fingerprint) =
            crate::model::load_part_with(&self.model, &Device::Cpu, &self.options(rank, 0))?;
        let (settings, kv, max_model_len) = self.settings(&model, fingerprint)?;
        self.form_tensor(&mut model, rank, &settings, peers)?;
        let plan = plan_cache(&model, &self.engine, kv, max_model_len)?;
        let layers = model.part().layers.clone();
        let report = StageReport {
            first_layer: layers.start as u32,
            end_layer: layers.end as u32,
            weight_bytes: model.resident_weight_bytes() as u64,
            kv_blocks: plan.num_blocks as u64,
            explanation: plan.explanation.clone(),
        };
        let stream = join_group(leader, rank, &settings, report)?;
        tracing::info!("rank {rank} joined the group at {leader}: layers {layers:?}");
        joined();
        let mut cache = new_paged(&model, kv, plan.block_size);
        let serve = || {
            serve_stage(
                stream,
                &model,
                cache.as_mut(),
                plan.num_blocks,
                settings.max_frame,
            )
        };
        match self.tensor_ranks() > 1 {
            true => in_own_pool(serve)?,
            false => serve(),
        }
    }

    /// Runs the leader: loads the first stage (its share of it, with `peers` reaching the
    /// stage's other tensor ranks), admits every other stage on `listener`, and starts the
    /// engine over the group. Returns the engine and the tokenizer.
    pub fn start_leader(
        &self,
        listener: &TcpListener,
        peers: Option<&TensorPeers>,
    ) -> Result<(EngineHandle, Tokenizer)> {
        let mut loaded = crate::model::load_with(&self.model, &Device::Cpu, &self.options(0, 0))?;
        let (settings, _, _) = self.settings(&loaded.model, loaded.fingerprint)?;
        self.form_tensor(&mut loaded.model, 0, &settings, peers)?;
        let members = match self.stages() {
            1 => Vec::new(),
            stages => {
                tracing::info!(
                    "waiting for {} more ranks on {}",
                    stages - 1,
                    listener.local_addr()?
                );
                form_group(listener, &settings, stages)?
            }
        };
        let tokenizer = loaded.tokenizer.clone();
        let pipeline = Pipeline::new(members, settings.max_frame);
        let engine = EngineHandle::start_pipeline(loaded, self.engine.clone(), pipeline)?;
        Ok((engine, tokenizer))
    }
}

/// The largest step message of a model under a layout: every token's id, position and
/// hidden state and logits row, every sequence's slice and block table; the logits of a
/// step are at most `max_num_seqs` rows (the scheduler holds scored rows to it).
pub fn max_step_frame(c: &ModelConfig, layout: &Layout) -> usize {
    let (tokens, seqs) = (
        layout.max_num_batched_tokens as usize,
        layout.max_num_seqs as usize,
    );
    let blocks = (layout.max_model_len as usize).div_ceil(layout.block_size.max(1) as usize);
    let metadata = 64 + tokens * 12 + seqs * (12 + blocks * 4);
    let values = (tokens * c.hidden_size).max(seqs * c.vocab_size);
    metadata + 4 * values
}

/// The largest collective of a tensor-parallel stage: a step as its rank 0 passes it on, or
/// the widest activation every rank gathers (attention outputs or MLP features of every
/// token).
pub fn tensor_slot_bytes(c: &ModelConfig, layout: &Layout) -> usize {
    let tokens = layout.max_num_batched_tokens as usize;
    let widest = (c.num_heads * c.head_dim)
        .max(c.intermediate_size)
        .max(c.hidden_size);
    max_step_frame(c, layout).max(4 * tokens * widest) + 64
}

/// Runs `f` in a thread pool of its own, as large as the current one: a rank whose steps
/// wait on its tensor peers inside the pool never holds a thread another rank's step needs.
fn in_own_pool<R: Send>(f: impl FnOnce() -> R + Send) -> Result<R> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("ferrite-rank-{i}"))
        .build()
        .map_err(|e| Error::internal(format!("cannot start a thread pool: {e}")))?;
    Ok(pool.install(f))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
