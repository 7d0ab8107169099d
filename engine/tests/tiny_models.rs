//! Tiny random Llama and Qwen2 models, written by the test as HF safetensors and as GGUF,
//! produce the logits of an independent numpy transcription of the HF modeling code.

mod common;

use candle_core::{DType, Device};
use common::{reference_logits, write_tiny_gguf, write_tiny_hf, TinySpec};
use ferrite_engine::kv::cache::SingleSequence;
use ferrite_engine::kv::KvDtype;
use ferrite_engine::model::llama::Llama;
use ferrite_engine::model::load_model;

const IDS: [u32; 9] = [3, 17, 42, 99, 0, 8, 8, 57, 23];

/// Logits for every token: first as one prefill, then as a 4-token prefill followed by
/// single-token decode steps (the cached path).
fn engine_logits(model: &Llama) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    engine_logits_with(model, KvDtype::Auto)
}

/// [`engine_logits`] with K/V cached as `kv`.
fn engine_logits_with(model: &Llama, kv: KvDtype) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let all = SingleSequence::new(model, kv)
        .forward_all(model, &IDS)
        .map(|l| l.to_vec2())
        .expect("forward");
    let mut cache = SingleSequence::new(model, kv);
    let pre = 4;
    let mut stepped = cache
        .forward_all(model, &IDS[..pre])
        .map(|l| l.to_vec2())
        .expect("prefill");
    for i in pre..IDS.len() {
        let row = cache
            .forward(model, &IDS[i..=i])
            .map(|l| l.to_vec2())
            .expect("decode");
        stepped.extend(row);
    }
    (all, stepped)
}

fn assert_close(ours: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(ours.len(), want.len(), "{what}: rows");
    for (t, (a, b)) in ours.iter().zip(want).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: vocab");
        for (v, (x, y)) in a.iter().zip(b).enumerate() {
            let err = (x - y).abs() / y.abs().max(1.0);
            assert!(
                err <= tol,
                "{what}: token {t} logit {v}: {x} vs reference {y}"
            );
        }
    }
}

fn check_hf(spec: TinySpec, dtype: DType, tol: f32, what: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), &spec, dtype);
    let want = reference_logits(dir.path(), &IDS);
    let model = load_model(dir.path(), &Device::Cpu).expect("loads");
    let (all, stepped) = engine_logits(&model);
    assert_close(&all, &want, tol, &format!("{what} prefill"));
    assert_close(&stepped, &want, tol, &format!("{what} decode"));
}

#[test]
fn a_token_id_beyond_the_vocabulary_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::llama();
    write_tiny_hf(dir.path(), &spec, DType::F32);
    let model = load_model(dir.path(), &Device::Cpu).expect("loads");
    let vocab = spec.vocab as u32;
    let err = common::prefill_logits(&model, &[3, vocab]).expect_err("out of range");
    assert_eq!(
        err.to_string(),
        format!("token id {vocab} is out of range: the vocabulary has {vocab} tokens")
    );
}

#[test]
fn tiny_llama_gqa_untied_matches_reference() {
    check_hf(TinySpec::llama(), DType::F32, 1e-4, "llama f32");
}

#[test]
fn tiny_llama_tied_embeddings_matches_reference() {
    check_hf(
        TinySpec {
            tied: true,
            seed: 2,
            ..TinySpec::llama()
        },
        DType::F32,
        1e-4,
        "llama tied",
    );
}

#[test]
fn tiny_qwen2_with_biases_matches_reference() {
    let spec = TinySpec {
        qwen2: true,
        tied: true,
        kv_heads: 1,
        seed: 3,
        ..TinySpec::llama()
    };
    check_hf(spec, DType::F32, 1e-4, "qwen2");
}

#[test]
fn tiny_llama_half_precision_checkpoints_load() {
    // The reference reads the same rounded weights and rounds the activations the same way;
    // the f16 KV cache adds its own rounding, which BF16's coarser activations amplify.
    check_hf(
        TinySpec {
            seed: 4,
            ..TinySpec::llama()
        },
        DType::F16,
        2e-2,
        "llama f16",
    );
    check_hf(
        TinySpec {
            seed: 5,
            ..TinySpec::llama()
        },
        DType::BF16,
        3e-2,
        "llama bf16",
    );
}

#[test]
fn half_precision_checkpoints_match_the_reference_with_an_f32_cache() {
    // The weights run as stored, against activations rounded as llama.cpp rounds them (to
    // BF16 for BF16 weights, to f16 for F16); with K/V kept in f32, only that activation
    // rounding and the order of sums separate the engine from the reference.
    for (dtype, seed, tol) in [(DType::BF16, 8, 1e-3), (DType::F16, 9, 1e-2)] {
        let spec = TinySpec {
            seed,
            ..TinySpec::llama()
        };
        let dir = tempfile::tempdir().expect("tempdir");
        write_tiny_hf(dir.path(), &spec, dtype);
        let want = reference_logits(dir.path(), &IDS);
        let model = load_model(dir.path(), &Device::Cpu).expect("loads");
        let (all, stepped) = engine_logits_with(&model, KvDtype::F32);
        assert_close(&all, &want, tol, &format!("{dtype:?} prefill"));
        assert_close(&stepped, &want, tol, &format!("{dtype:?} decode"));
    }
}

#[test]
fn tiny_llama_as_gguf_matches_the_hf_reference() {
    let spec = TinySpec {
        seed: 6,
        ..TinySpec::llama()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), &spec, DType::F32);
    let want = reference_logits(dir.path(), &IDS);
    let gguf = dir.path().join("tiny.gguf");
    write_tiny_gguf(&gguf, &spec, "llama", &[]);
    let model = load_model(&gguf, &Device::Cpu).expect("gguf loads");
    let (all, stepped) = engine_logits(&model);
    assert_close(&all, &want, 1e-4, "gguf llama prefill");
    assert_close(&stepped, &want, 1e-4, "gguf llama decode");
}

#[test]
fn tiny_qwen2_as_gguf_matches_the_hf_reference() {
    let spec = TinySpec {
        qwen2: true,
        seed: 7,
        ..TinySpec::llama()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), &spec, DType::F32);
    let want = reference_logits(dir.path(), &IDS);
    let gguf = dir.path().join("tiny.gguf");
    write_tiny_gguf(&gguf, &spec, "qwen2", &[]);
    let model = load_model(&gguf, &Device::Cpu).expect("gguf loads");
    let (all, _) = engine_logits(&model);
    assert_close(&all, &want, 1e-4, "gguf qwen2");
}
