//! Helpers shared by the engine's integration tests.
#![allow(dead_code, missing_docs, unused_imports)]

use std::path::PathBuf;

pub use ferrite_e2e::{default_model, workspace};

/// The logits of every token of `ids`, as one sequence's prefill in a fresh cache (of the
/// element type the model prefers).
pub fn prefill_logits(
    model: &ferrite_engine::model::llama::Llama,
    ids: &[u32],
) -> ferrite_engine::Result<Vec<Vec<f32>>> {
    use ferrite_engine::kv::cache::SingleSequence;
    use ferrite_engine::kv::KvDtype;
    let mut cache = SingleSequence::new(model, KvDtype::Auto);
    Ok(cache.forward_all(model, ids)?.to_vec2())
}

/// The fixture file with llama.cpp's reference outputs.
pub fn fixture(name: &str) -> PathBuf {
    workspace().join("tests/fixtures").join(name)
}

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

/// Shape and family of a tiny random model.
#[derive(Debug, Clone, Copy)]
pub struct TinySpec {
    pub qwen2: bool,
    pub tied: bool,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub seed: u64,
}

impl TinySpec {
    pub fn llama() -> Self {
        TinySpec {
            qwen2: false,
            tied: false,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            layers: 2,
            intermediate: 96,
            vocab: 101,
            seed: 1,
        }
    }
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// Deterministic pseudo-random numbers in [-0.5, 0.5).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// The weights of a tiny model under their HF names, in f32.
pub fn tiny_weights(s: &TinySpec) -> Vec<(String, Tensor)> {
    let mut rng = Rng(s.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let hd = s.head_dim();
    let mut out = Vec::new();
    let mut t = |name: String, dims: &[usize], scale: f32, offset: f32| {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| offset + scale * rng.next()).collect();
        out.push((
            name,
            Tensor::from_vec(data, dims, &Device::Cpu).expect("tensor"),
        ));
    };
    t(
        "model.embed_tokens.weight".into(),
        &[s.vocab, s.hidden],
        2.0,
        0.0,
    );
    for l in 0..s.layers {
        let p = format!("model.layers.{l}.");
        t(format!("{p}input_layernorm.weight"), &[s.hidden], 0.4, 1.0);
        t(
            format!("{p}self_attn.q_proj.weight"),
            &[s.heads * hd, s.hidden],
            0.5,
            0.0,
        );
        t(
            format!("{p}self_attn.k_proj.weight"),
            &[s.kv_heads * hd, s.hidden],
            0.5,
            0.0,
        );
        t(
            format!("{p}self_attn.v_proj.weight"),
            &[s.kv_heads * hd, s.hidden],
            0.5,
            0.0,
        );
        t(
            format!("{p}self_attn.o_proj.weight"),
            &[s.hidden, s.heads * hd],
            0.5,
            0.0,
        );
        if s.qwen2 {
            t(
                format!("{p}self_attn.q_proj.bias"),
                &[s.heads * hd],
                0.5,
                0.0,
            );
            t(
                format!("{p}self_attn.k_proj.bias"),
                &[s.kv_heads * hd],
                0.5,
                0.0,
            );
            t(
                format!("{p}self_attn.v_proj.bias"),
                &[s.kv_heads * hd],
                0.5,
                0.0,
            );
        }
        t(
            format!("{p}post_attention_layernorm.weight"),
            &[s.hidden],
            0.4,
            1.0,
        );
        t(
            format!("{p}mlp.gate_proj.weight"),
            &[s.intermediate, s.hidden],
            0.5,
            0.0,
        );
        t(
            format!("{p}mlp.up_proj.weight"),
            &[s.intermediate, s.hidden],
            0.5,
            0.0,
        );
        t(
            format!("{p}mlp.down_proj.weight"),
            &[s.hidden, s.intermediate],
            0.5,
            0.0,
        );
    }
    t("model.norm.weight".into(), &[s.hidden], 0.4, 1.0);
    if !s.tied {
        t("lm_head.weight".into(), &[s.vocab, s.hidden], 0.5, 0.0);
    }
    out
}

/// Writes `config.json` and `model.safetensors` (weights stored as `dtype`).
pub fn write_tiny_hf(dir: &Path, s: &TinySpec, dtype: DType) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let arch = if s.qwen2 {
        "Qwen2ForCausalLM"
    } else {
        "LlamaForCausalLM"
    };
    let config = serde_json::json!({
        "architectures": [arch],
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": s.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": s.tied,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let tensors: HashMap<String, Tensor> = tiny_weights(s)
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(dtype).expect("dtype")))
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
}

/// llama.cpp's conversion of HF Q/K rows to the interleaved-RoPE layout.
fn permute_qk(t: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = t.dims2().expect("2d");
    let hd = rows / heads;
    t.reshape((heads, 2, hd / 2, cols))
        .and_then(|x| x.transpose(1, 2))
        .and_then(|x| x.contiguous())
        .and_then(|x| x.reshape((rows, cols)))
        .expect("permute")
}

/// Writes the tiny model as an F32 GGUF file the way llama.cpp's converter would.
pub fn write_tiny_gguf(path: &Path, s: &TinySpec, architecture: &str, extra: &[(&str, Value)]) {
    let hd = s.head_dim();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in tiny_weights(s) {
        let gguf_name = match name.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_string(),
            "model.norm.weight" => "output_norm.weight".to_string(),
            "lm_head.weight" => "output.weight".to_string(),
            other => {
                let rest = other.strip_prefix("model.layers.").expect("layer tensor");
                let (l, field) = rest.split_once('.').expect("layer index");
                let field = match field {
                    "input_layernorm.weight" => "attn_norm.weight",
                    "self_attn.q_proj.weight" => "attn_q.weight",
                    "self_attn.k_proj.weight" => "attn_k.weight",
                    "self_attn.v_proj.weight" => "attn_v.weight",
                    "self_attn.o_proj.weight" => "attn_output.weight",
                    "self_attn.q_proj.bias" => "attn_q.bias",
                    "self_attn.k_proj.bias" => "attn_k.bias",
                    "self_attn.v_proj.bias" => "attn_v.bias",
                    "post_attention_layernorm.weight" => "ffn_norm.weight",
                    "mlp.gate_proj.weight" => "ffn_gate.weight",
                    "mlp.up_proj.weight" => "ffn_up.weight",
                    "mlp.down_proj.weight" => "ffn_down.weight",
                    f => panic!("unexpected tensor {f}"),
                };
                format!("blk.{l}.{field}")
            }
        };
        let t = if !s.qwen2 && gguf_name.ends_with("attn_q.weight") {
            permute_qk(&t, s.heads)
        } else if !s.qwen2 && gguf_name.ends_with("attn_k.weight") {
            permute_qk(&t, s.kv_heads)
        } else {
            t
        };
        tensors.push((
            gguf_name,
            QTensor::quantize(&t, GgmlDType::F32).expect("f32 qtensor"),
        ));
    }
    let a = architecture;
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (format!("{a}.block_count"), Value::U32(s.layers as u32)),
        (format!("{a}.context_length"), Value::U32(64)),
        (format!("{a}.embedding_length"), Value::U32(s.hidden as u32)),
        (
            format!("{a}.feed_forward_length"),
            Value::U32(s.intermediate as u32),
        ),
        (
            format!("{a}.attention.head_count"),
            Value::U32(s.heads as u32),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            Value::U32(s.kv_heads as u32),
        ),
        (format!("{a}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
    ];
    let _ = hd;
    meta.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).expect("create gguf");
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).expect("write gguf");
}

/// Logits of the numpy reference for `ids` on the HF model in `dir`.
pub fn reference_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f32>> {
    let python = std::env::var("FERRITE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = workspace().join("tests/reference/llama_reference.py");
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir)
        .arg(ids.join(","))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {python} (set FERRITE_PYTHON; make test does): {e}")
        });
    assert!(
        out.status.success(),
        "reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reference prints JSON")
}
