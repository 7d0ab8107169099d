//! The Llama-family transformer (Llama, Mistral, SmolLM2, Qwen2): weights, `load`, `forward`.
//!
//! The forward pass takes one flattened batch of tokens from any number of sequences
//! (`[total_tokens, hidden]`, no padding); matmuls see every token at once and attention
//! runs per sequence through a [`KvCache`], which owns where K/V live between steps.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::config::{Architecture, ModelConfig, RopeStyle};
use super::weights::{Matmul, WeightName, WeightSource};
use crate::error::{Error, Result};
use crate::kernels::activation::{swiglu, swiglu_rows};
use crate::kernels::quant::QuantMatrix;

/// Per-token work below this many values stays on one thread: waking another costs more.
const PARALLEL_MIN_VALUES: usize = 1 << 15;

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
    /// Stores `k`/`v` (`[tokens, kv_heads, head_dim]`) of every sequence of `batch` in
    /// `layer`, then returns causal attention of `q` (`[tokens, heads, head_dim]`), each
    /// token over its own sequence's keys so far, as `[tokens, heads * head_dim]`.
    fn attend(
        &mut self,
        layer: usize,
        batch: &Batch<'_>,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor>;
}

/// A projection, optionally with a bias (Qwen2's Q/K/V).
#[derive(Debug, Clone)]
struct Linear {
    weight: Matmul,
    bias: Option<Tensor>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.weight.forward(x)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Projections of one input (Q/K/V, or gate/up). Where they share one of our quantized
/// formats they are stacked into one matrix, so a step quantizes the input once and runs
/// one parallel pass instead of one per projection; each output row is computed exactly
/// as it would be alone.
#[derive(Debug, Clone)]
enum Fanout {
    /// One stacked matrix, and each part's output features and bias, in order.
    Stacked {
        weight: Matmul,
        parts: Vec<(usize, Option<Tensor>)>,
    },
    /// Each projection on its own (candle formats).
    Separate(Vec<Linear>),
}

impl Fanout {
    fn new(parts: Vec<Linear>) -> Self {
        let quant: Option<Vec<&QuantMatrix>> = parts
            .iter()
            .map(|l| match &l.weight {
                Matmul::Quant(w) => Some(w),
                Matmul::Candle(_) => None,
            })
            .collect();
        match quant.as_deref().and_then(QuantMatrix::stack) {
            Some(weight) => Fanout::Stacked {
                weight: Matmul::Quant(weight),
                parts: quant
                    .iter()
                    .flatten()
                    .map(|w| w.rows())
                    .zip(parts.iter().map(|l| l.bias.clone()))
                    .collect(),
            },
            None => Fanout::Separate(parts),
        }
    }

    /// All projections of `x` (`[tokens, cols]`) side by side in one row-major
    /// `[tokens, Σ widths]` vector, when they are stacked and have no biases (`None`
    /// otherwise): callers that read each token's parts in place skip splitting them into
    /// tensors of their own.
    fn forward_stacked(&self, x: &Tensor) -> Result<Option<Vec<f32>>> {
        match self {
            Fanout::Stacked { weight, parts } if parts.iter().all(|(_, b)| b.is_none()) => {
                Ok(Some(weight.forward_vec(x)?))
            }
            _ => Ok(None),
        }
    }

    /// Each projection of `x` (`[tokens, cols]`), in the order given to [`Fanout::new`].
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let (weight, parts) = match self {
            Fanout::Separate(parts) => return parts.iter().map(|l| l.forward(x)).collect(),
            Fanout::Stacked { weight, parts } => (weight, parts),
        };
        let y = weight.forward(x)?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(parts.len());
        for (width, bias) in parts {
            let part = y.narrow(1, offset, *width)?.contiguous()?;
            out.push(match bias {
                Some(b) => part.broadcast_add(b)?,
                None => part,
            });
            offset += width;
        }
        Ok(out)
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    /// Q, K and V.
    qkv: Fanout,
    o: Linear,
    ffn_norm: Tensor,
    /// Gate and up.
    gate_up: Fanout,
    down: Linear,
}

/// A loaded Llama-family model, ready to run forward passes on its device.
#[derive(Debug, Clone)]
pub struct Llama {
    config: ModelConfig,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    cos_sin: Vec<Vec<(f32, f32)>>,
    device: Device,
    weight_bytes: usize,
    kv_f16: bool,
}

impl Llama {
    /// Builds the model from named weights, checking each shape against `config`.
    pub fn load(config: ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let mut bytes = 0usize;
        let mut linear = |src: &mut dyn WeightSource, name: WeightName, out: usize, inp: usize| {
            let weight = src.matmul(name, (out, inp))?;
            bytes += weight.bytes();
            let bias = match (c.architecture, name) {
                (Architecture::Qwen2, WeightName::Q(l)) => {
                    Some(src.vector(WeightName::QBias(l), out)?)
                }
                (Architecture::Qwen2, WeightName::K(l)) => {
                    Some(src.vector(WeightName::KBias(l), out)?)
                }
                (Architecture::Qwen2, WeightName::V(l)) => {
                    Some(src.vector(WeightName::VBias(l), out)?)
                }
                _ => None,
            };
            Ok::<_, Error>(Linear { weight, bias })
        };
        let mut blocks = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            blocks.push(Block {
                attn_norm: src.vector(WeightName::AttnNorm(l), h)?,
                qkv: Fanout::new(vec![
                    linear(src, WeightName::Q(l), c.num_heads * hd, h)?,
                    linear(src, WeightName::K(l), c.num_kv_heads * hd, h)?,
                    linear(src, WeightName::V(l), c.num_kv_heads * hd, h)?,
                ]),
                o: linear(src, WeightName::O(l), h, c.num_heads * hd)?,
                ffn_norm: src.vector(WeightName::FfnNorm(l), h)?,
                gate_up: Fanout::new(vec![
                    linear(src, WeightName::Gate(l), c.intermediate_size, h)?,
                    linear(src, WeightName::Up(l), c.intermediate_size, h)?,
                ]),
                down: linear(src, WeightName::Down(l), h, c.intermediate_size)?,
            });
        }
        let embed = src.embedding(WeightName::Embed, (c.vocab_size, h))?;
        let head_name = if c.tie_word_embeddings {
            WeightName::Embed
        } else {
            WeightName::Output
        };
        let lm_head = Linear {
            weight: src.matmul(head_name, (c.vocab_size, h))?,
            bias: None,
        };
        bytes += lm_head.weight.bytes();
        let norm = src.vector(WeightName::Norm, h)?;
        let device = src.device().clone();
        let kv_f16 = !src.is_f32();
        let cos_sin = rope_tables(c);
        Ok(Llama {
            config,
            embed,
            blocks,
            norm,
            lm_head,
            cos_sin,
            device,
            weight_bytes: bytes,
            kv_f16,
        })
    }

    /// The hyper-parameters this model was built with.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of matmul weights read for every decoded token (the decode memory traffic).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes
    }

    /// Rotary embedding of a projection (`[tokens, heads * head_dim]`) at each token's
    /// position, returned as `[tokens, heads, head_dim]`, with ggml's rounding so GGUF models
    /// reproduce llama.cpp.
    fn rope(&self, x: &Tensor, positions: &[usize], heads: usize) -> Result<Tensor> {
        let d = self.config.head_dim;
        let mut data = to_f32_vec(x)?;
        for (token, &p) in data.chunks_exact_mut(heads * d).zip(positions) {
            self.rotate(token, p);
        }
        Ok(Tensor::from_vec(
            data,
            (positions.len(), heads, d),
            x.device(),
        )?)
    }

    /// Rotates every head of one token's projection (`[heads * head_dim]`) to position `p`.
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
    /// side), Q and K rotated to each token's position, as `[tokens, heads, head_dim]`
    /// tensors; tokens spread over the threads.
    fn split_qkv(&self, qkv: &[f32], positions: &[usize]) -> Result<[Tensor; 3]> {
        let c = &self.config;
        let d = c.head_dim;
        let (wq, wk) = (c.num_heads * d, c.num_kv_heads * d);
        let row = wq + 2 * wk;
        let n = positions.len();
        let (mut q, mut k, mut v) = (vec![0f32; n * wq], vec![0f32; n * wk], vec![0f32; n * wk]);
        let per_task = PARALLEL_MIN_VALUES.div_ceil(row).max(1);
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
        let device = &self.device;
        Ok([
            Tensor::from_vec(q, (n, c.num_heads, d), device)?,
            Tensor::from_vec(k, (n, c.num_kv_heads, d), device)?,
            Tensor::from_vec(v, (n, c.num_kv_heads, d), device)?,
        ])
    }

    /// Whether `KvDtype::Auto` resolves to f16 (any checkpoint that is not all f32).
    pub fn kv_prefers_f16(&self) -> bool {
        self.kv_f16
    }

    /// Runs the batch and returns logits (`[batch.seqs.len(), vocab]`) for the last token
    /// of each sequence.
    pub fn forward(&self, batch: &Batch<'_>, cache: &mut dyn KvCache) -> Result<Tensor> {
        let last: Vec<u32> = batch
            .seqs
            .iter()
            .map(|s| (s.start + s.len - 1) as u32)
            .collect();
        self.forward_rows(batch, cache, &last)
    }

    /// Runs the batch and returns logits (`[total_tokens, vocab]`) for every token.
    pub fn forward_all(&self, batch: &Batch<'_>, cache: &mut dyn KvCache) -> Result<Tensor> {
        let all: Vec<u32> = (0..batch.tokens.len() as u32).collect();
        self.forward_rows(batch, cache, &all)
    }

    /// Runs the batch and returns logits (`[rows.len(), vocab]`) for the given token rows
    /// (indexes into `batch.tokens`); steps that only fill the cache pass none.
    pub fn forward_rows(
        &self,
        batch: &Batch<'_>,
        cache: &mut dyn KvCache,
        rows: &[u32],
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = batch.tokens.len();
        check_batch(batch, c.max_position_embeddings)?;
        let ids = Tensor::from_slice(batch.tokens, n, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        for (layer, b) in self.blocks.iter().enumerate() {
            let y = rms_norm(&x, &b.attn_norm, c.rms_norm_eps as f32)?;
            let [q, k, v] = match b.qkv.forward_stacked(&y)? {
                Some(qkv) => self.split_qkv(&qkv, batch.positions)?,
                None => {
                    let [q, k, v] = projections(b.qkv.forward(&y)?)?;
                    [
                        self.rope(&q, batch.positions, c.num_heads)?,
                        self.rope(&k, batch.positions, c.num_kv_heads)?,
                        v.reshape((n, c.num_kv_heads, c.head_dim))?,
                    ]
                }
            };
            let attn = cache.attend(layer, batch, &q, &k, &v)?;
            x = (x + b.o.forward(&attn)?)?;
            let y = rms_norm(&x, &b.ffn_norm, c.rms_norm_eps as f32)?;
            let act = match b.gate_up.forward_stacked(&y)? {
                Some(gate_up) => swiglu_rows(&gate_up, c.intermediate_size),
                None => {
                    let [gate, up] = projections(b.gate_up.forward(&y)?)?;
                    let mut act = to_f32_vec(&gate)?;
                    swiglu(&mut act, &to_f32_vec(&up)?);
                    act
                }
            };
            let act = Tensor::from_vec(act, (n, c.intermediate_size), &self.device)?;
            x = (x + b.down.forward(&act)?)?;
        }
        if rows.is_empty() {
            return Ok(Tensor::zeros((0, c.vocab_size), DType::F32, &self.device)?);
        }
        // Rows are increasing indexes into the batch, so as many rows as tokens means all.
        let x = if rows.len() == n {
            x
        } else {
            x.index_select(&Tensor::from_slice(rows, rows.len(), &self.device)?, 0)?
        };
        let x = rms_norm(&x, &self.norm, c.rms_norm_eps as f32)?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }
}

/// The `N` outputs of a [`Fanout`] as an array.
fn projections<const N: usize>(parts: Vec<Tensor>) -> Result<[Tensor; N]> {
    let got = parts.len();
    parts.try_into().map_err(|_| {
        Error::Tensor(candle_core::Error::Msg(format!(
            "expected {N} projections, got {got}"
        )))
    })
}

/// RMSNorm with ggml's arithmetic: squares in f32 summed in f64, `1 / sqrt(mean + eps)` in
/// f32, the row scaled, then multiplied by the weight (activation quantization downstream
/// sees bit-identical inputs, so GGUF models reproduce llama.cpp).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let (rows, h) = x.dims2()?;
    let w = weight.to_vec1::<f32>()?;
    let mut data = to_f32_vec(x)?;
    let per_task = PARALLEL_MIN_VALUES.div_ceil(h.max(1)).max(1);
    data.par_chunks_mut(per_task * h.max(1)).for_each(|rows| {
        for row in rows.chunks_exact_mut(h) {
            let sum: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
            let mean = (sum / h as f64) as f32;
            let scale = 1.0 / (mean + eps).sqrt();
            for (v, &g) in row.iter_mut().zip(&w) {
                *v = (*v * scale) * g;
            }
        }
    });
    Ok(Tensor::from_vec(data, (rows, h), x.device())?)
}

fn check_batch(batch: &Batch<'_>, max_pos: usize) -> Result<()> {
    let n = batch.tokens.len();
    if n == 0 || batch.positions.len() != n {
        return Err(Error::InvalidParameter(format!(
            "a batch needs one position per token and at least one token, got {n} tokens and {} positions",
            batch.positions.len()
        )));
    }
    if let Some(&p) = batch.positions.iter().find(|&&p| p >= max_pos) {
        return Err(Error::InvalidParameter(format!(
            "position {p} is beyond the model's context length of {max_pos} tokens"
        )));
    }
    let mut next = 0;
    for s in batch.seqs {
        if s.start != next || s.len == 0 {
            return Err(Error::InvalidParameter(
                "batch sequences must be non-empty and cover the tokens in order".into(),
            ));
        }
        next = s.start + s.len;
    }
    if next != n {
        return Err(Error::InvalidParameter(format!(
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

/// Element type of the KV cache; `Auto` follows the checkpoint like vLLM's `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// f32 for f32 checkpoints, f16 for everything else (llama.cpp's default for GGUF).
    #[default]
    Auto,
    /// Half precision: half the memory, llama.cpp's numerics.
    F16,
    /// Single precision.
    F32,
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

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(lp[2] > lp[1] && lp[1] > lp[0]);
    }
}
