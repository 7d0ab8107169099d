//! Named weights of a Llama-family model, and the trait that GGUF and safetensors loaders implement.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};

use crate::error::Result;
use ferrite_kernels::buffers::Buf;
use ferrite_kernels::quant::QuantMatrix;

/// A weight matrix used as `x @ W^T`: our own kernel for the common GGUF block formats,
/// candle's for everything else (K-quants, float checkpoints).
#[derive(Debug, Clone)]
pub enum Matmul {
    /// Q4_0 / Q4_1 / Q8_0 blocks, ggml-exact arithmetic.
    Quant(QuantMatrix),
    /// Any other format, through candle.
    Candle(QMatMul),
}

impl Matmul {
    /// Row-major `x` (`[tokens, cols]`) times the transposed weight, as a row-major vector:
    /// our kernel reads the rows where they are; candle's gets them as a tensor on `device`.
    pub fn forward_rows(&self, x: &[f32], cols: usize, device: &Device) -> Result<Buf> {
        match self {
            Matmul::Quant(w) => Ok(w.matmul(x)),
            Matmul::Candle(w) => {
                let x = Tensor::from_slice(x, (x.len() / cols.max(1), cols), device)?;
                let y = w.forward(&x)?.flatten_all()?.to_dtype(DType::F32)?;
                Ok(Buf::from_vec(y.to_vec1::<f32>()?))
            }
        }
    }

    /// The weight, if it is one of our quantized formats.
    pub fn quant_mut(&mut self) -> Option<&mut QuantMatrix> {
        match self {
            Matmul::Quant(w) => Some(w),
            Matmul::Candle(_) => None,
        }
    }

    /// Bytes one pass over the weight reads from memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matmul::Quant(w) => w.gguf_bytes(),
            Matmul::Candle(QMatMul::QTensor(t)) => t.storage_size_in_bytes(),
            Matmul::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }
}

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

/// A file format's view of the weights, producing tensors on one device.
pub trait WeightSource {
    /// The device tensors are created on.
    fn device(&self) -> &Device;
    /// Whether every weight is stored in f32 (then the KV cache defaults to f32 too).
    fn is_f32(&self) -> bool;
    /// A `[rows, cols]` matrix used as `x @ W^T`, kept quantized where the file is.
    fn matmul(&mut self, name: WeightName, shape: (usize, usize)) -> Result<Matmul>;
    /// A 1-D f32 tensor of `len` elements (norm weights, biases).
    fn vector(&mut self, name: WeightName, len: usize) -> Result<Tensor>;
}
