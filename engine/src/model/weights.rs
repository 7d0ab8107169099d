//! Named weights of a Llama-family model, and the trait that GGUF and safetensors loaders implement.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::mix::MixModel;
use super::Quantization;
use crate::error::Result;
use ferrite_kernels::quant::{quantize, QuantMatrix, WeightFormat};

/// A weight of the network, independent of how a file format names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightName {
    /// Token embedding, `[vocab, hidden]`.
    Embed,
    /// Final RMSNorm.
    Norm,
    /// Output projection when it is not tied to the embedding.
    Output,
    /// RMSNorm before attention in layer `l`.
    AttnNorm(usize),
    /// Query projection.
    Q(usize),
    /// Key projection.
    K(usize),
    /// Value projection.
    V(usize),
    /// Attention output projection.
    O(usize),
    /// Query bias (Qwen2).
    QBias(usize),
    /// Key bias (Qwen2).
    KBias(usize),
    /// Value bias (Qwen2).
    VBias(usize),
    /// RMSNorm before the MLP.
    FfnNorm(usize),
    /// MLP gate projection.
    Gate(usize),
    /// MLP up projection.
    Up(usize),
    /// MLP down projection.
    Down(usize),
}

impl WeightName {
    /// The tensor's name in a GGUF file (llama.cpp's convention).
    pub fn gguf(self) -> String {
        match self {
            WeightName::Embed => "token_embd.weight".into(),
            WeightName::Norm => "output_norm.weight".into(),
            WeightName::Output => "output.weight".into(),
            WeightName::AttnNorm(l) => format!("blk.{l}.attn_norm.weight"),
            WeightName::Q(l) => format!("blk.{l}.attn_q.weight"),
            WeightName::K(l) => format!("blk.{l}.attn_k.weight"),
            WeightName::V(l) => format!("blk.{l}.attn_v.weight"),
            WeightName::O(l) => format!("blk.{l}.attn_output.weight"),
            WeightName::QBias(l) => format!("blk.{l}.attn_q.bias"),
            WeightName::KBias(l) => format!("blk.{l}.attn_k.bias"),
            WeightName::VBias(l) => format!("blk.{l}.attn_v.bias"),
            WeightName::FfnNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            WeightName::Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            WeightName::Up(l) => format!("blk.{l}.ffn_up.weight"),
            WeightName::Down(l) => format!("blk.{l}.ffn_down.weight"),
        }
    }

    /// The tensor's name in a Hugging Face checkpoint.
    pub fn hf(self) -> String {
        let layer = |l: usize, rest: &str| format!("model.layers.{l}.{rest}");
        match self {
            WeightName::Embed => "model.embed_tokens.weight".into(),
            WeightName::Norm => "model.norm.weight".into(),
            WeightName::Output => "lm_head.weight".into(),
            WeightName::AttnNorm(l) => layer(l, "input_layernorm.weight"),
            WeightName::Q(l) => layer(l, "self_attn.q_proj.weight"),
            WeightName::K(l) => layer(l, "self_attn.k_proj.weight"),
            WeightName::V(l) => layer(l, "self_attn.v_proj.weight"),
            WeightName::O(l) => layer(l, "self_attn.o_proj.weight"),
            WeightName::QBias(l) => layer(l, "self_attn.q_proj.bias"),
            WeightName::KBias(l) => layer(l, "self_attn.k_proj.bias"),
            WeightName::VBias(l) => layer(l, "self_attn.v_proj.bias"),
            WeightName::FfnNorm(l) => layer(l, "post_attention_layernorm.weight"),
            WeightName::Gate(l) => layer(l, "mlp.gate_proj.weight"),
            WeightName::Up(l) => layer(l, "mlp.up_proj.weight"),
            WeightName::Down(l) => layer(l, "mlp.down_proj.weight"),
        }
    }
}

/// A [`WeightSource`] whose floating-point matrices are quantized as they are read (the
/// engine's `--quantization`): each becomes the blocks of the format asked for (one for all,
/// or a mix's choice for the matrix), written by ggml's reference quantizer
/// ([`ferrite_kernels::quant::quantize`]), or of the format `llama-quantize` falls back to
/// where those blocks do not fit its rows ([`quantize::format_for`]). Matrices the file
/// already stores quantized are kept.
pub struct Quantizing<'a> {
    inner: &'a mut dyn WeightSource,
    quantization: Quantization,
    model: MixModel,
    /// What became of the float matrices.
    pub counts: QuantizedCounts,
}

/// How many float matrices [`Quantizing`] turned into what.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuantizedCounts {
    /// Quantized to the format asked for (a mix's choice for the matrix).
    pub quantized: usize,
    /// Quantized to llama.cpp's fallback format (rows not a whole number of blocks).
    pub fallback: usize,
    /// Kept in floating point (rows not a whole number of 32-value blocks).
    pub kept: usize,
}

impl<'a> Quantizing<'a> {
    /// Quantizes `inner`'s float matrices as `quantization` asks (a mix choosing by
    /// `model`'s shape).
    pub fn new(
        inner: &'a mut dyn WeightSource,
        quantization: Quantization,
        model: MixModel,
    ) -> Self {
        Quantizing {
            inner,
            quantization,
            model,
            counts: QuantizedCounts::default(),
        }
    }

    /// The format asked for matrix `name` (rows of `cols` values), and the one it takes:
    /// llama.cpp's fallback where the asked-for blocks do not fit a row, `None` where none
    /// does (kept in floating point).
    fn target(&self, name: WeightName, cols: usize) -> (WeightFormat, Option<WeightFormat>) {
        let asked = match self.quantization {
            Quantization::Pure(format) => format,
            Quantization::Mix(mix) => mix.choose(name, cols, &self.model),
        };
        (asked, quantize::format_for(asked, cols))
    }
}

impl WeightSource for Quantizing<'_> {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn is_f32(&self) -> bool {
        self.inner.is_f32()
    }

    fn matrix_format(&self, name: WeightName, (r, c): (usize, usize)) -> Result<WeightFormat> {
        let stored = self.inner.matrix_format(name, (r, c))?;
        Ok(match stored {
            WeightFormat::Float(_) => self.target(name, c).1.unwrap_or(stored),
            kept => kept,
        })
    }

    fn matmul(&mut self, name: WeightName, (r, c): (usize, usize)) -> Result<QuantMatrix> {
        let m = self.inner.matmul(name, (r, c))?;
        if !matches!(m.format(), WeightFormat::Float(_)) {
            return Ok(m);
        }
        let (asked, Some(format)) = self.target(name, c) else {
            self.counts.kept += 1;
            return Ok(m);
        };
        // Rows in parallel, a run of them per task: each row's blocks are independent of the
        // others', so the bytes are the same whatever the thread count. A random 1.1B F16
        // model loaded with `--quantization q4_k_m` and one token generated, 2 threads (AMD
        // EPYC, Zen 5): 53.6 s with one row after another, 27.6-27.8 s in parallel.
        let per_task = r.div_ceil(8 * rayon::current_num_threads()).max(1);
        let runs: Option<Vec<Vec<u8>>> = (0..r)
            .step_by(per_task)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|first| {
                let mut values = vec![0f32; c];
                let mut run = Vec::new();
                for row in first..(first + per_task).min(r) {
                    m.dequantize_row(row, &mut values);
                    run.extend(quantize::quantize_row(format, &values)?);
                }
                Some(run)
            })
            .collect();
        let bytes = runs
            .ok_or_else(|| crate::error::Error::internal(format!("no quantizer for {format:?}")))?
            .concat();
        drop(m);
        let q = QuantMatrix::from_gguf(format, r, c, &bytes).ok_or_else(|| {
            crate::error::Error::internal("quantized bytes that do not fill the matrix")
        })?;
        if format == asked {
            self.counts.quantized += 1;
        } else {
            self.counts.fallback += 1;
        }
        Ok(q)
    }

    fn vector(&mut self, name: WeightName, len: usize) -> Result<Tensor> {
        self.inner.vector(name, len)
    }
}

/// A file format's view of the weights, producing tensors on one device.
pub trait WeightSource {
    /// The device tensors are created on.
    fn device(&self) -> &Device;
    /// Whether every weight is stored in f32 (then the KV cache defaults to f32 too).
    fn is_f32(&self) -> bool;
    /// The format the `[rows, cols]` matrix `name` is held in once loaded, found without
    /// reading it (pipeline stages are balanced by the bytes it gives).
    fn matrix_format(&self, name: WeightName, shape: (usize, usize)) -> Result<WeightFormat>;
    /// A `[rows, cols]` matrix used as `x @ W^T`, kept in the file's encoding.
    fn matmul(&mut self, name: WeightName, shape: (usize, usize)) -> Result<QuantMatrix>;
    /// A 1-D f32 tensor of `len` elements (norm weights, biases).
    fn vector(&mut self, name: WeightName, len: usize) -> Result<Tensor>;
}

/// Bytes a `[rows, cols]` matrix of `format` occupies.
pub fn matrix_bytes(format: WeightFormat, (rows, cols): (usize, usize)) -> u64 {
    (rows * (cols / format.block_values().max(1)) * format.block_bytes()) as u64
}
