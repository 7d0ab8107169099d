//! Broken or unsupported model files fail with errors that name the file and what was
//! expected — never a panic.

mod common;

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device};
use common::{write_tiny_gguf, write_tiny_hf, TinySpec};
use ferrite_engine::model::{load, load_model};

fn error_of(path: &Path) -> String {
    match load_model(path, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error {msg:?} should mention {p:?}");
    }
}

#[test]
fn truncated_gguf_names_the_file_and_the_missing_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let full = dir.path().join("full.gguf");
    write_tiny_gguf(&full, &TinySpec::llama(), "llama", &[]);
    let bytes = std::fs::read(&full).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).expect("write");
    let msg = error_of(&cut);
    assert_mentions(&msg, &["cut.gguf", "truncated", "needs bytes up to"]);
    // Cut inside the header: still an error, not a panic.
    std::fs::write(&cut, &bytes[..40]).expect("write");
    assert_mentions(&error_of(&cut), &["cut.gguf", "not a readable GGUF file"]);
}

#[test]
fn a_file_that_is_not_gguf_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "hello, I am not a model").expect("write");
    assert_mentions(
        &error_of(&path),
        &["notes.txt", "not a readable GGUF file", "Q4_1"],
    );
}

#[test]
fn directory_without_config_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert_mentions(
        &error_of(dir.path()),
        &["no config.json", "HF model directory", ".gguf"],
    );
}

#[test]
fn missing_path() {
    assert_mentions(
        &error_of(Path::new("/nonexistent/model.gguf")),
        &["no such file or directory"],
    );
}

#[test]
fn unknown_gguf_architecture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mamba.gguf");
    write_tiny_gguf(&path, &TinySpec::llama(), "mamba", &[]);
    assert_mentions(
        &error_of(&path),
        &[
            "mamba.gguf",
            "unknown architecture `mamba`",
            "llama, mistral, qwen2",
        ],
    );
}

#[test]
fn unknown_hf_architecture() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), &TinySpec::llama(), DType::F32);
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .expect("config")
        .replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(&cfg, text).expect("write");
    assert_mentions(
        &error_of(dir.path()),
        &["config.json", "`GPT2LMHeadModel`", "LlamaForCausalLM"],
    );
}

#[test]
fn unsupported_safetensors_dtype() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), &TinySpec::llama(), DType::F32);
    let mut tensors = std::collections::HashMap::new();
    let ids = candle_core::Tensor::new(&[1i64, 2, 3], &Device::Cpu).expect("tensor");
    tensors.insert("model.embed_tokens.weight".to_string(), ids);
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).expect("save");
    assert_mentions(
        &error_of(dir.path()),
        &[
            "model.safetensors",
            "dtype I64",
            "supported: F32, F16, BF16",
        ],
    );
}

#[test]
fn unsupported_gguf_tensor_type() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("iq.gguf");
    write_tiny_gguf(&path, &TinySpec::llama(), "llama", &[]);
    // Rewrite the first tensor's type (F32 = 0) to 16, llama.cpp's IQ2_XXS.
    let mut bytes = std::fs::read(&path).expect("read");
    let name = b"token_embd.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("tensor info");
    let type_at = at + name.len() + 4 + 2 * 8;
    assert_eq!(bytes[type_at..type_at + 4], [0, 0, 0, 0], "F32 type field");
    bytes[type_at] = 16;
    std::fs::write(&path, bytes).expect("write");
    assert_mentions(&error_of(&path), &["iq.gguf", "unknown dtype", "Q4_K"]);
}

#[test]
fn wrong_tensor_shape_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("shape.gguf");
    // The metadata says 2 KV heads; the tensors were written for 4.
    let spec = TinySpec {
        kv_heads: 4,
        ..TinySpec::llama()
    };
    write_tiny_gguf(
        &path,
        &spec,
        "llama",
        &[("llama.attention.head_count_kv", Value::U32(2))],
    );
    assert_mentions(
        &error_of(&path),
        &["shape.gguf", "attn_k.weight", "expected [32, 64]"],
    );
}

#[test]
fn gguf_without_tokenizer_loads_weights_but_not_for_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bare.gguf");
    write_tiny_gguf(&path, &TinySpec::llama(), "llama", &[]);
    assert!(load_model(&path, &Device::Cpu).is_ok());
    let msg = load(&path, &Device::Cpu)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_mentions(
        &msg,
        &["bare.gguf", "tokenizer.ggml.model", "has no tokenizer"],
    );
}
