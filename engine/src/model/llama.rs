//! The Llama-family transformer (Llama, Mistral, SmolLM2, Qwen2): weights, `load`, `forward`.
//!
//! The forward pass takes one flattened batch of tokens from any number of sequences
//! (`[total_tokens, hidden]`, no padding); matmuls see every token at once and attention
//! runs per sequence through a [`KvCache`], which owns where K/V live between steps. It is
//! three stages — [`Llama::embed`], [`Llama::run_layers`] over any range of [`Block`]s,
//! [`Llama::head`] — and a pipeline stage loads ([`Llama::load_part`]) and runs only its
//! own: a contiguous range of layers, with the embedding on the first stage and the final
//! norm and vocabulary projection on the last. A tensor-parallel rank loads 1/T of every
//! projection's output rows ([`Shard`]) and gathers what the others computed through its
//! [`TensorGroup`] after each, so every value is still computed whole, by one rank.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use ferrite_kernels::activation::swiglu_rows;
use ferrite_kernels::buffers::Buf;
use ferrite_kernels::quant::QuantMatrix;
use ferrite_kernels::rows_per_task;

use super::config::{Architecture, ModelConfig, RopeStyle};
use super::weights::{WeightName, WeightSource};
use crate::error::{Error, RequestError, Result};
use crate::parallel::tensor::{share, shares, TensorGroup};

/// One sequence's share of a flattened batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSlice {
    /// Index of the sequence's first token in the batch.
    pub start: usize,
    /// Number of tokens the sequence contributes this step.
    pub len: usize,
    /// The cache's handle for this sequence.
    pub cache_slot: usize,
}

/// A step's input: tokens of many sequences with their absolute positions.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// Token ids of all scheduled tokens, sequence after sequence.
    pub tokens: &'a [u32],
    /// Each token's position within its own sequence.
    pub positions: &'a [usize],
    /// Which tokens belong to which sequence.
    pub seqs: &'a [SeqSlice],
}

/// Storage for keys and values between steps, and the attention that reads them.
pub trait KvCache {
    /// Stores `k`/`v` (row-major `[tokens, kv_heads * head_dim]`) of every sequence of
    /// `batch` in `layer`, then returns causal attention of `q` (`[tokens, heads *
    /// head_dim]`), each token over its own sequence's keys so far, as row-major
    /// `[tokens, heads * head_dim]`.
    fn attend(
        &mut self,
        layer: usize,
        batch: &Batch<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<Buf>;
}

/// A projection, optionally with a bias (Qwen2's Q/K/V).
#[derive(Debug, Clone)]
struct Linear {
    weight: QuantMatrix,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// `x` (row-major rows of the weight's width) times the transposed weight, plus the
    /// bias, as row-major values.
    fn forward(&self, x: &[f32]) -> Buf {
        let mut y = self.weight.matmul(x);
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(bias.len().max(1)) {
                row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
        y
    }
}

/// Projections of one input (Q/K/V, or gate/up), their outputs side by side per token.
/// Where they share one of our quantized formats they are stacked into one matrix, so a step
/// quantizes the input once and runs one parallel pass instead of one per projection; each
/// output row is computed exactly as it would be alone.
#[derive(Debug, Clone)]
enum Fanout {
    /// One stacked projection. Its bias, if any part has one, is the parts' biases side by
    /// side, an unbiased part's stretch holding -0.0: adding it leaves every value as it is,
    /// the sign of a zero included.
    Stacked(Linear),
    /// Each projection on its own (parts in different formats, as K-quant mixes have).
    Separate(Vec<Linear>),
}

impl Fanout {
    fn new(parts: Vec<Linear>) -> Self {
        let quant: Vec<&QuantMatrix> = parts.iter().map(|l| &l.weight).collect();
        let Some(weight) = QuantMatrix::stack(&quant) else {
            return Fanout::Separate(parts);
        };
        let bias = parts.iter().any(|l| l.bias.is_some()).then(|| {
            quant
                .iter()
                .zip(&parts)
                .flat_map(|(w, l)| l.bias.clone().unwrap_or_else(|| vec![-0.0; w.rows()]))
                .collect()
        });
        Fanout::Stacked(Linear { weight, bias })
    }

    /// All projections of row-major `x` (`[tokens, cols]`) as one row-major
    /// `[tokens, Σ widths]` vector: each token's outputs of every part, in the order given to
    /// [`Fanout::new`], biases added.
    fn forward(&self, x: &[f32], cols: usize) -> Buf {
        let parts = match self {
            Fanout::Stacked(stacked) => return stacked.forward(x),
            Fanout::Separate(parts) => parts,
        };
        let outs: Vec<Buf> = parts.iter().map(|l| l.forward(x)).collect();
        let tokens = x.len() / cols.max(1);
        let mut y = Vec::with_capacity(outs.iter().map(|o| o.len()).sum());
        for t in 0..tokens {
            for out in &outs {
                let width = out.len() / tokens;
                y.extend_from_slice(&out[t * width..(t + 1) * width]);
            }
        }
        Buf::from_vec(y)
    }
}

/// The token embedding table, in the file's encoding: rows decoded as they are looked up
/// (the output projection's own matrix when the two are tied). A tensor-parallel rank
/// holds the vocabulary rows from `first` on.
#[derive(Debug, Clone)]
struct Embedding {
    table: QuantMatrix,
    first: usize,
}

impl Embedding {
    /// The rows of `ids` (each within the vocabulary), one after another, and which of
    /// them this table holds (the others are left as the buffer had them).
    fn rows(&self, ids: &[u32]) -> (Buf, Vec<usize>) {
        let h = self.table.cols();
        let held = self.first..self.first + self.table.rows();
        let mut x = Buf::take(ids.len() * h);
        let mut owned = Vec::with_capacity(ids.len());
        for (i, (&id, row)) in ids.iter().zip(x.chunks_exact_mut(h)).enumerate() {
            if held.contains(&(id as usize)) {
                self.table.dequantize_row(id as usize - self.first, row);
                owned.push(i);
            }
        }
        (x, owned)
    }
}

/// Which share of every projection a tensor-parallel rank holds: rank `rank` of `size`
/// takes a contiguous share of the KV heads (and the query heads that read them), of the
/// hidden features each output projection writes, of the MLP's features and of the
/// vocabulary. `size` 1 is the whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This rank.
    pub rank: usize,
    /// Ranks the model is split among.
    pub size: usize,
}

impl Shard {
    /// The whole model, on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    /// KV heads held.
    fn kv_heads(&self, c: &ModelConfig) -> std::ops::Range<usize> {
        share(c.num_kv_heads, self.size, self.rank)
    }

    /// Query heads held: those reading the KV heads held.
    fn heads(&self, c: &ModelConfig) -> std::ops::Range<usize> {
        let group = c.num_heads / c.num_kv_heads.max(1);
        let kv = self.kv_heads(c);
        kv.start * group..kv.end * group
    }

    /// This rank's share of `n` output rows.
    fn rows(&self, n: usize) -> std::ops::Range<usize> {
        share(n, self.size, self.rank)
    }
}

/// How wide each rank's share of every gathered activation is, in rank order.
#[derive(Debug, Clone)]
struct Widths {
    /// Attention outputs (query heads × head size).
    attn: Vec<usize>,
    /// Hidden features (the output and down projections).
    hidden: Vec<usize>,
    /// MLP features.
    mlp: Vec<usize>,
    /// Vocabulary.
    vocab: Vec<usize>,
}

impl Widths {
    fn new(c: &ModelConfig, size: usize) -> Self {
        let heads = |rank| Shard { rank, size }.heads(c).len();
        Widths {
            attn: (0..size).map(|r| heads(r) * c.head_dim).collect(),
            hidden: shares(c.hidden_size, size),
            mlp: shares(c.intermediate_size, size),
            vocab: shares(c.vocab_size, size),
        }
    }
}

/// One transformer layer: attention, then the MLP, each behind an RMSNorm and added to the
/// residual stream.
#[derive(Debug, Clone)]
pub struct Block {
    /// RMSNorm weights before attention.
    attn_norm: Vec<f32>,
    /// Q, K and V.
    qkv: Fanout,
    o: Linear,
    /// RMSNorm weights before the MLP.
    ffn_norm: Vec<f32>,
    /// Gate and up.
    gate_up: Fanout,
    down: Linear,
}

impl Block {
    /// `x += attention(norm(x))`, then `x += mlp(norm(x))`, for layer `layer` of `m`.
    fn forward(
        &self,
        m: &Llama,
        layer: usize,
        batch: &Batch<'_>,
        cache: &mut dyn KvCache,
        x: &mut [f32],
    ) -> Result<()> {
        let (h, eps) = (m.config.hidden_size, m.config.rms_norm_eps as f32);
        let y = rms_norm(x, h, &self.attn_norm, eps);
        let attn = self.attention(m, layer, batch, cache, y)?;
        add_into(x, &attn);
        drop(attn);
        let mlp = self.mlp(m, rms_norm(x, h, &self.ffn_norm, eps))?;
        add_into(x, &mlp);
        Ok(())
    }

    /// Causal self-attention of the normed rows `y` through the cache, projected back to
    /// the hidden size. Each intermediate goes back to the pool as soon as it has been read,
    /// so a long prefill holds no more buffers than the pool keeps.
    fn attention(
        &self,
        m: &Llama,
        layer: usize,
        batch: &Batch<'_>,
        cache: &mut dyn KvCache,
        y: Buf,
    ) -> Result<Buf> {
        let c = &m.config;
        let qkv = self.qkv.forward(&y, c.hidden_size);
        drop(y);
        let [q, k, v] = m.split_qkv(&qkv, batch.positions);
        drop(qkv);
        let attn = cache.attend(layer, batch, &q, &k, &v)?;
        drop((q, k, v));
        let attn = m.gather(attn, |w| &w.attn)?;
        m.gather(self.o.forward(&attn), |w| &w.hidden)
    }

    /// `down(silu(gate(y)) * up(y))`.
    fn mlp(&self, m: &Llama, y: Buf) -> Result<Buf> {
        let c = &m.config;
        let gate_up = self.gate_up.forward(&y, c.hidden_size);
        drop(y);
        let act = swiglu_rows(&gate_up, m.local.intermediate_size);
        drop(gate_up);
        let act = m.gather(act, |w| &w.mlp)?;
        m.gather(self.down.forward(&act), |w| &w.hidden)
    }

    /// The block's weight products in the order [`Block::forward`] runs them.
    fn products(&self, c: &ModelConfig) -> [Product<'_>; 4] {
        let attn = c.num_heads * c.head_dim;
        [
            Product::fanout(&self.qkv, c.hidden_size),
            Product::linear(&self.o, attn),
            Product::fanout(&self.gate_up, c.hidden_size),
            Product::linear(&self.down, c.intermediate_size),
        ]
    }
}

/// One weight product of a step, for timing the products apart from the rest: a
/// projection and the width of its input rows.
#[derive(Debug, Clone, Copy)]
pub struct Product<'a> {
    weights: ProductWeights<'a>,
    /// Values per input row.
    pub cols: usize,
}

#[derive(Debug, Clone, Copy)]
enum ProductWeights<'a> {
    Fanout(&'a Fanout),
    Linear(&'a Linear),
}

impl<'a> Product<'a> {
    fn fanout(f: &'a Fanout, cols: usize) -> Self {
        Product {
            weights: ProductWeights::Fanout(f),
            cols,
        }
    }

    fn linear(l: &'a Linear, cols: usize) -> Self {
        Product {
            weights: ProductWeights::Linear(l),
            cols,
        }
    }

    /// The product of row-major `x` (rows of [`Product::cols`] values).
    pub fn run(&self, x: &[f32]) -> Buf {
        match self.weights {
            ProductWeights::Fanout(f) => f.forward(x, self.cols),
            ProductWeights::Linear(l) => l.forward(x),
        }
    }
}

/// Logits of the rows a step asked for: `rows × vocab` values, row-major, in a pooled
/// buffer that the next step's logits reuse.
#[derive(Debug)]
pub struct Logits {
    values: Buf,
    vocab: usize,
}

impl Logits {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.values.len() / self.vocab.max(1)
    }

    /// Whether no row was asked for.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The rows in order, each mutable (sampling adjusts logits in place).
    pub fn rows_mut(&mut self) -> std::slice::ChunksExactMut<'_, f32> {
        self.values.chunks_exact_mut(self.vocab.max(1))
    }

    /// Logits of `values.len() / vocab` rows received whole (from a pipeline's last stage).
    pub fn from_values(values: Buf, vocab: usize) -> Self {
        Logits { values, vocab }
    }

    /// The rows' values, row after row.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Every row as its own vector.
    pub fn to_vec2(&self) -> Vec<Vec<f32>> {
        self.values
            .chunks_exact(self.vocab.max(1))
            .map(<[f32]>::to_vec)
            .collect()
    }
}

/// A loaded Llama-family model, ready to run forward passes on its device.
#[derive(Debug, Clone)]
pub struct Llama {
    config: ModelConfig,
    /// The layers, embedding and head this instance holds.
    part: ModelPart,
    embed: Option<Embedding>,
    /// Layers `part.layers`, in order.
    blocks: Vec<Block>,
    /// The final RMSNorm's weights and the vocabulary projection.
    head: Option<(Vec<f32>, Linear)>,
    cos_sin: Vec<Vec<(f32, f32)>>,
    device: Device,
    weight_bytes: usize,
    /// What the weights occupy in memory: those read every step and an embedding held apart.
    resident_bytes: usize,
    kv_f16: bool,
    /// This rank's share of every projection.
    shard: Shard,
    /// The configuration of the share held: the query and KV heads and MLP features of
    /// this rank (the whole model's without tensor parallelism).
    local: ModelConfig,
    /// Each rank's share of the gathered activations, under tensor parallelism.
    widths: Option<Widths>,
    /// The other ranks of this rank's stage, once joined ([`Llama::join_tensor_group`]).
    tensor: Option<std::sync::Arc<TensorGroup>>,
}

/// Which parts of a model one process holds: a pipeline stage's layers, with the embedding
/// on the first stage and the final norm and vocabulary projection on the last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPart {
    /// The layers held, a contiguous range.
    pub layers: std::ops::Range<usize>,
    /// Whether the token embedding is held.
    pub embed: bool,
    /// Whether the final norm and the vocabulary projection are held.
    pub head: bool,
}

impl ModelPart {
    /// Every part of a model of `layers` layers.
    pub fn whole(layers: usize) -> Self {
        ModelPart {
            layers: 0..layers,
            embed: true,
            head: true,
        }
    }
}

impl Llama {
    /// Builds the model from named weights, checking each shape against `config`.
    pub fn load(config: ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        let whole = ModelPart::whole(config.num_layers);
        Self::load_part(config, src, whole, Shard::WHOLE)
    }

    /// Builds only `part` of the model (a pipeline stage), and of it only `shard`'s share
    /// (a tensor-parallel rank's): no other layer's weights are read, and of each matrix
    /// only the share's rows are kept.
    pub fn load_part(
        config: ModelConfig,
        src: &mut dyn WeightSource,
        part: ModelPart,
        shard: Shard,
    ) -> Result<Self> {
        let c = &config;
        crate::engine::check_tensor_split(shard.size, c.num_kv_heads)?;
        if shard.rank >= shard.size {
            return Err(Error::internal(format!(
                "tensor rank {} of {}",
                shard.rank, shard.size
            )));
        }
        if part.layers.end > c.num_layers || part.layers.is_empty() && c.num_layers > 0 {
            return Err(Error::internal(format!(
                "layers {:?} of a model with {} layers",
                part.layers, c.num_layers
            )));
        }
        let (h, hd) = (c.hidden_size, c.head_dim);
        let mut bytes = 0usize;
        let (heads, kv) = (shard.heads(c), shard.kv_heads(c));
        let (q_rows, kv_rows) = (heads.start * hd..heads.end * hd, kv.start * hd..kv.end * hd);
        let (h_rows, mlp_rows) = (shard.rows(h), shard.rows(c.intermediate_size));
        let mut linear = |src: &mut dyn WeightSource, name: WeightName, out: usize, inp: usize| {
            let rows = match name {
                WeightName::Q(_) => q_rows.clone(),
                WeightName::K(_) | WeightName::V(_) => kv_rows.clone(),
                WeightName::Gate(_) | WeightName::Up(_) => mlp_rows.clone(),
                _ => h_rows.clone(),
            };
            let weight = shard_rows(src.matmul(name, (out, inp))?, rows.clone())?;
            bytes += weight.gguf_bytes();
            let bias = match (c.architecture, name) {
                (Architecture::Qwen2, WeightName::Q(l)) => Some(WeightName::QBias(l)),
                (Architecture::Qwen2, WeightName::K(l)) => Some(WeightName::KBias(l)),
                (Architecture::Qwen2, WeightName::V(l)) => Some(WeightName::VBias(l)),
                _ => None,
            };
            let bias = match bias {
                Some(b) => Some(to_f32_vec(&src.vector(b, out)?)?[rows].to_vec()),
                None => None,
            };
            Ok::<_, Error>(Linear { weight, bias })
        };
        let mut blocks = Vec::with_capacity(part.layers.len());
        for l in part.layers.clone() {
            blocks.push(Block {
                attn_norm: to_f32_vec(&src.vector(WeightName::AttnNorm(l), h)?)?,
                qkv: Fanout::new(vec![
                    linear(src, WeightName::Q(l), c.num_heads * hd, h)?,
                    linear(src, WeightName::K(l), c.num_kv_heads * hd, h)?,
                    linear(src, WeightName::V(l), c.num_kv_heads * hd, h)?,
                ]),
                o: linear(src, WeightName::O(l), h, c.num_heads * hd)?,
                ffn_norm: to_f32_vec(&src.vector(WeightName::FfnNorm(l), h)?)?,
                gate_up: Fanout::new(vec![
                    linear(src, WeightName::Gate(l), c.intermediate_size, h)?,
                    linear(src, WeightName::Up(l), c.intermediate_size, h)?,
                ]),
                down: linear(src, WeightName::Down(l), h, c.intermediate_size)?,
            });
        }
        let tied = c.tie_word_embeddings;
        let head_name = if tied {
            WeightName::Embed
        } else {
            WeightName::Output
        };
        let vocab_rows = shard.rows(c.vocab_size);
        let mut lm_head = match part.head {
            true => Some(Linear {
                weight: shard_rows(
                    src.matmul(head_name, (c.vocab_size, h))?,
                    vocab_rows.clone(),
                )?,
                bias: None,
            }),
            false => None,
        };
        bytes += lm_head.as_ref().map_or(0, |l| l.weight.gguf_bytes());
        // Untied, or on a stage without the head, the embedding is a matrix of its own,
        // packed with the others below; tied beside the head, it is the output projection's.
        let shares_head = tied && lm_head.is_some();
        let mut embed_weight = match part.embed && !shares_head {
            true => Some(shard_rows(
                src.matmul(WeightName::Embed, (c.vocab_size, h))?,
                vocab_rows.clone(),
            )?),
            false => None,
        };
        let mut quant: Vec<&mut QuantMatrix> = Vec::new();
        for b in &mut blocks {
            for fanout in [&mut b.qkv, &mut b.gate_up] {
                match fanout {
                    Fanout::Stacked(l) => quant.push(&mut l.weight),
                    Fanout::Separate(parts) => {
                        quant.extend(parts.iter_mut().map(|l| &mut l.weight))
                    }
                }
            }
            quant.push(&mut b.o.weight);
            quant.push(&mut b.down.weight);
        }
        quant.extend(lm_head.as_mut().map(|l| &mut l.weight));
        quant.extend(embed_weight.as_mut());
        QuantMatrix::share_huge_pages(&mut quant);
        let table = match (part.embed, embed_weight, &lm_head) {
            (false, _, _) => None,
            (true, Some(w), _) => Some(w),
            (true, None, Some(head)) => Some(head.weight.clone()),
            (true, None, None) => None,
        };
        let embed = table.map(|table| Embedding {
            table,
            first: vocab_rows.start,
        });
        // Memory of its own unless it shares the (counted) output projection's.
        let resident_bytes = bytes
            + match (&embed, shares_head) {
                (Some(e), false) => e.table.gguf_bytes(),
                _ => 0,
            };
        let head = match lm_head {
            Some(l) => Some((to_f32_vec(&src.vector(WeightName::Norm, h)?)?, l)),
            None => None,
        };
        let device = src.device().clone();
        let kv_f16 = !src.is_f32();
        let cos_sin = rope_tables(c);
        let mut local = config.clone();
        local.num_heads = heads.len();
        local.num_kv_heads = kv.len();
        local.intermediate_size = mlp_rows.len();
        let widths = (shard.size > 1).then(|| Widths::new(c, shard.size));
        Ok(Llama {
            config,
            part,
            embed,
            blocks,
            head,
            cos_sin,
            device,
            weight_bytes: bytes,
            resident_bytes,
            kv_f16,
            shard,
            local,
            widths,
            tensor: None,
        })
    }

    /// The hyper-parameters of the share this rank holds: its query and KV heads and MLP
    /// features (what its KV cache and activations are sized by).
    pub fn local_config(&self) -> &ModelConfig {
        &self.local
    }

    /// Runs every later step together with the other ranks of `group` (this model's
    /// [`Shard`] among them); refused unless the group has this shard's rank and size.
    pub fn join_tensor_group(&mut self, group: std::sync::Arc<TensorGroup>) -> Result<()> {
        if (group.rank(), group.size()) != (self.shard.rank, self.shard.size) {
            return Err(Error::internal(format!(
                "tensor rank {} of {} joining a group as rank {} of {}",
                self.shard.rank,
                self.shard.size,
                group.rank(),
                group.size()
            )));
        }
        self.tensor = Some(group);
        Ok(())
    }

    /// The tensor-parallel group this rank computes with, once joined.
    pub fn tensor_group(&self) -> Option<&std::sync::Arc<TensorGroup>> {
        self.tensor.as_ref()
    }

    /// `local` (this rank's columns of a `[tokens, Σ widths]` activation) with every rank's
    /// columns beside it; `local` itself without tensor parallelism.
    fn gather(&self, local: Buf, widths: impl Fn(&Widths) -> &Vec<usize>) -> Result<Buf> {
        let (Some(group), Some(w)) = (&self.tensor, &self.widths) else {
            return Ok(local);
        };
        let widths = widths(w);
        let rows = local.len() / widths[self.shard.rank].max(1);
        let all = group.gather_columns(&local, rows, widths, true)?;
        all.ok_or_else(|| Error::internal("a gather to every rank left this one out"))
    }

    /// The hyper-parameters this model was built with.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The layers, embedding and head this instance holds.
    pub fn part(&self) -> &ModelPart {
        &self.part
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of matmul weights read for every decoded token (the decode memory traffic).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes the weights occupy in memory: [`Llama::weight_bytes_per_token`] and an
    /// embedding table not shared with the output projection (what the KV budget leaves
    /// them).
    pub fn resident_weight_bytes(&self) -> usize {
        self.resident_bytes
    }

    /// Rotates every head of one token's projection (`[heads * head_dim]`) to position `p`,
    /// with ggml's rounding so GGUF models reproduce llama.cpp.
    fn rotate(&self, token: &mut [f32], p: usize) {
        let d = self.config.head_dim;
        let table = &self.cos_sin[p];
        for head in token.chunks_exact_mut(d) {
            for (i, &(c, s)) in table.iter().enumerate() {
                let (a, b) = match self.config.rope_style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + d / 2),
                };
                let (x0, x1) = (head[a], head[b]);
                // ggml's `x0*cos - x1*sin` as GCC compiles it: the first product fused.
                head[a] = x0.mul_add(c, -(x1 * s));
                head[b] = x0.mul_add(s, x1 * c);
            }
        }
    }

    /// Q, K and V from one stacked projection (`qkv`: each token's Q, K and V values side by
    /// side), Q and K rotated to each token's position, each as row-major `[tokens, heads *
    /// head_dim]` values; tokens spread over the threads.
    fn split_qkv(&self, qkv: &[f32], positions: &[usize]) -> [Buf; 3] {
        let c = &self.local;
        let d = c.head_dim;
        let (wq, wk) = (c.num_heads * d, c.num_kv_heads * d);
        let row = wq + 2 * wk;
        let n = positions.len();
        let (mut q, mut k, mut v) = (Buf::take(n * wq), Buf::take(n * wk), Buf::take(n * wk));
        let per_task = rows_per_task(row);
        q.par_chunks_mut(per_task * wq)
            .zip(k.par_chunks_mut(per_task * wk))
            .zip(v.par_chunks_mut(per_task * wk))
            .zip(qkv.par_chunks(per_task * row))
            .zip(positions.par_chunks(per_task))
            .for_each(|((((q, k), v), src), positions)| {
                let tokens = q
                    .chunks_exact_mut(wq)
                    .zip(k.chunks_exact_mut(wk))
                    .zip(v.chunks_exact_mut(wk))
                    .zip(src.chunks_exact(row));
                for ((((q, k), v), src), &p) in tokens.zip(positions) {
                    let (sq, rest) = src.split_at(wq);
                    let (sk, sv) = rest.split_at(wk);
                    q.copy_from_slice(sq);
                    k.copy_from_slice(sk);
                    v.copy_from_slice(sv);
                    self.rotate(q, p);
                    self.rotate(k, p);
                }
            });
        [q, k, v]
    }

    /// Whether `KvDtype::Auto` resolves to f16 (any checkpoint that is not all f32).
    pub fn kv_prefers_f16(&self) -> bool {
        self.kv_f16
    }

    /// Runs the batch and returns the logits of the token rows `rows` (increasing indexes
    /// into `batch.tokens`; steps that only fill the cache pass none).
    pub fn forward(
        &self,
        batch: &Batch<'_>,
        cache: &mut dyn KvCache,
        rows: &[u32],
    ) -> Result<Logits> {
        let mut x = self.embed(batch)?;
        self.run_layers(self.part.layers.clone(), batch, cache, &mut x)?;
        self.head(x, rows)
    }

    /// The residual stream of `batch` entering the first layer, `[tokens, hidden]`: each
    /// token's embedding row. Checks the batch first.
    pub fn embed(&self, batch: &Batch<'_>) -> Result<Buf> {
        let c = &self.config;
        check_batch(batch, c.max_position_embeddings, c.vocab_size)?;
        let embed = self
            .embed
            .as_ref()
            .ok_or_else(|| Error::internal("this pipeline stage holds no embedding"))?;
        let (mut x, owned) = embed.rows(batch.tokens);
        if let Some(group) = &self.tensor {
            group.gather_rows(&mut x, c.hidden_size, &owned)?;
        }
        Ok(x)
    }

    /// Runs layers `layers` on the residual stream `x` in place.
    pub fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        batch: &Batch<'_>,
        cache: &mut dyn KvCache,
        x: &mut [f32],
    ) -> Result<()> {
        let first = self.part.layers.start;
        let held = layers
            .start
            .checked_sub(first)
            .zip(layers.end.checked_sub(first))
            .and_then(|(a, b)| self.blocks.get(a..b));
        let blocks = held.ok_or_else(|| {
            Error::internal(format!(
                "layers {layers:?} of a part holding layers {:?}",
                self.part.layers
            ))
        })?;
        for (block, layer) in blocks.iter().zip(layers) {
            block.forward(self, layer, batch, cache, x)?;
        }
        Ok(())
    }

    /// The final norm and vocabulary projection of the residual stream's rows `rows`; under
    /// tensor parallelism tensor rank 0 gets every rank's share of the vocabulary and the
    /// others no rows.
    pub fn head(&self, x: Buf, rows: &[u32]) -> Result<Logits> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let (norm, lm_head) = self
            .head
            .as_ref()
            .ok_or_else(|| Error::internal("this pipeline stage holds no vocabulary projection"))?;
        if rows.is_empty() {
            return Ok(Logits {
                values: Buf::default(),
                vocab,
            });
        }
        // Rows are increasing indexes into the batch, so as many rows as tokens means all.
        let x = if rows.len() * h == x.len() {
            x
        } else {
            rows.iter()
                .flat_map(|&r| &x[r as usize * h..(r as usize + 1) * h])
                .copied()
                .collect()
        };
        let normed = rms_norm(&x, h, norm, c.rms_norm_eps as f32);
        drop(x);
        let values = lm_head.forward(&normed);
        let values = match (&self.tensor, &self.widths) {
            (Some(group), Some(w)) => group
                .gather_columns(&values, rows.len(), &w.vocab, false)?
                .unwrap_or_default(),
            _ => values,
        };
        Ok(Logits { values, vocab })
    }

    /// Every weight product of a step in the order the forward pass runs them — each
    /// layer's Q/K/V, output, gate/up and down projections, then the vocabulary projection.
    pub fn products(&self) -> impl Iterator<Item = Product<'_>> + '_ {
        self.blocks
            .iter()
            .flat_map(|b| b.products(&self.config))
            .chain(
                self.head
                    .iter()
                    .map(|(_, l)| Product::linear(l, self.config.hidden_size)),
            )
    }
}

/// Rows `rows` of `m` (all of it when they are all its rows).
fn shard_rows(m: QuantMatrix, rows: std::ops::Range<usize>) -> Result<QuantMatrix> {
    if rows == (0..m.rows()) {
        return Ok(m);
    }
    m.select_rows(rows.clone())
        .ok_or_else(|| Error::internal(format!("rows {rows:?} of a matrix of {} rows", m.rows())))
}

/// RMSNorm with ggml's arithmetic: squares in f32 summed in f64, `1 / sqrt(mean + eps)` in
/// f32, the row scaled, then multiplied by the weight (activation quantization downstream
/// sees bit-identical inputs, so GGUF models reproduce llama.cpp).
fn rms_norm(x: &[f32], h: usize, w: &[f32], eps: f32) -> Buf {
    let mut data = Buf::take(x.len());
    data.copy_from_slice(x);
    if h == 0 {
        return data;
    }
    data.par_chunks_mut(rows_per_task(h).next_multiple_of(SUM_ROWS) * h)
        .for_each(|rows| {
            for group in rows.chunks_mut(SUM_ROWS * h) {
                let sums = sums_of_squares(group, h);
                for (row, sum) in group.chunks_exact_mut(h).zip(sums) {
                    let mean = (sum / h as f64) as f32;
                    let scale = 1.0 / (mean + eps).sqrt();
                    for (v, &g) in row.iter_mut().zip(w) {
                        *v = (*v * scale) * g;
                    }
                }
            }
        });
    data
}

/// `x += y`, element by element (the residual connection), spread over the threads for
/// long batches.
fn add_into(x: &mut [f32], y: &[f32]) {
    let per_task = rows_per_task(1);
    x.par_chunks_mut(per_task)
        .zip(y.par_chunks(per_task))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(x, y)| *x += y));
}

/// Rows whose sums of squares [`sums_of_squares`] runs side by side.
const SUM_ROWS: usize = 8;

/// Each row's (up to [`SUM_ROWS`] rows of `h` values) sum of squares, each square in f32
/// added in f64 in value order as ggml does; the rows' chains interleave, so their
/// additions overlap instead of each waiting on the last. Entries past the group's rows
/// stay zero.
fn sums_of_squares(group: &[f32], h: usize) -> [f64; SUM_ROWS] {
    let mut sums = [0f64; SUM_ROWS];
    if group.len() == SUM_ROWS * h {
        for i in 0..h {
            for (r, sum) in sums.iter_mut().enumerate() {
                let v = group[r * h + i];
                *sum += f64::from(v * v);
            }
        }
    } else {
        for (row, sum) in group.chunks_exact(h).zip(&mut sums) {
            *sum = row.iter().map(|&v| f64::from(v * v)).sum();
        }
    }
    sums
}

fn check_batch(batch: &Batch<'_>, max_pos: usize, vocab: usize) -> Result<()> {
    let n = batch.tokens.len();
    if n == 0 || batch.positions.len() != n {
        return Err(Error::internal(format!(
            "a batch needs one position per token and at least one token, got {n} tokens and {} positions",
            batch.positions.len()
        )));
    }
    if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::PromptToken { id: t, vocab }.into());
    }
    if let Some(&p) = batch.positions.iter().find(|&&p| p >= max_pos) {
        return Err(Error::internal(format!(
            "position {p} is beyond the model's context length of {max_pos} tokens"
        )));
    }
    let mut next = 0;
    for s in batch.seqs {
        if s.start != next || s.len == 0 {
            return Err(Error::internal(
                "batch sequences must be non-empty and cover the tokens in order",
            ));
        }
        next = s.start + s.len;
    }
    if next != n {
        return Err(Error::internal(format!(
            "batch sequences cover {next} of {n} tokens"
        )));
    }
    Ok(())
}

/// (cos, sin) of every position's rotary angles, `[max_position][head_dim / 2]`, computed as
/// ggml does (angles stepped in f32 by repeated multiplication) so GGUF models match llama.cpp.
fn rope_tables(c: &ModelConfig) -> Vec<Vec<(f32, f32)>> {
    let step = (c.rope_theta as f32).powf(-2.0 / c.head_dim as f32);
    (0..c.max_position_embeddings)
        .map(|p| {
            let mut theta = p as f32;
            (0..c.head_dim / 2)
                .map(|_| {
                    let cs = (theta.cos(), theta.sin());
                    theta *= step;
                    cs
                })
                .collect()
        })
        .collect()
}

/// A tensor's values as f32, row-major.
pub fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// Log-probabilities over the vocabulary for one row of logits.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max as f64 + sum.ln();
    logits
        .iter()
        .map(|&l| (f64::from(l) - lse) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_kernels::quant::WeightFormat;

    /// A Q8_0 projection of 64 inputs to `rows` outputs, with a bias if asked.
    fn q8_linear(rows: usize, salt: usize, bias: bool) -> Linear {
        let cols = 64;
        let mut data = Vec::new();
        for b in 0..rows * cols / 32 {
            data.extend(half::f16::from_f32(0.01 + (b + salt) as f32 * 1e-3).to_le_bytes());
            data.extend((0..32).map(|j| ((j * 7 + b * 13 + salt) % 255) as u8));
        }
        let weight = QuantMatrix::from_gguf(WeightFormat::Q8_0, rows, cols, &data).expect("sizes");
        let bias = bias.then(|| (0..rows).map(|i| i as f32 * 0.37 - 1.1).collect());
        Linear { weight, bias }
    }

    #[test]
    fn rms_norm_gives_every_row_its_one_row_result_whatever_rows_share_the_call() {
        // 8-row groups sum side by side; a lone row or a short last group one by one.
        let h = 96;
        let x: Vec<f32> = (0..19 * h)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 1e-2)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 * 0.01).collect();
        let all = rms_norm(&x, h, &w, 1e-5);
        for (r, want_row) in x.chunks(h).enumerate() {
            let one = rms_norm(want_row, h, &w, 1e-5);
            // ggml: squares in f32 summed in f64 in order, 1/sqrt(mean + eps) in f32.
            let sum: f64 = want_row.iter().map(|&v| f64::from(v * v)).sum();
            let scale = 1.0 / ((sum / h as f64) as f32 + 1e-5).sqrt();
            let want: Vec<u32> = want_row
                .iter()
                .zip(&w)
                .map(|(&v, &g)| ((v * scale) * g).to_bits())
                .collect();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&all[r * h..(r + 1) * h]), want, "row {r} of 19");
            assert_eq!(bits(&one), want, "row {r} alone");
        }
    }

    #[test]
    fn a_stacked_fanout_adds_each_parts_bias_as_the_separate_projections_do() {
        // Qwen2-like: biased and unbiased parts of different widths in one stacked matrix.
        let parts = vec![
            q8_linear(8, 1, true),
            q8_linear(4, 2, false),
            q8_linear(4, 3, true),
        ];
        let stacked = Fanout::new(parts.clone());
        assert!(matches!(stacked, Fanout::Stacked(_)));
        let separate = Fanout::Separate(parts);
        let x: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 11) % 19) as f32 / 19.0 - 0.5)
            .collect();
        let (got, want) = (stacked.forward(&x, 64), separate.forward(&x, 64));
        let bits = |v: Buf| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(want));
    }

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(lp[2] > lp[1] && lp[1] > lp[0]);
    }
}
