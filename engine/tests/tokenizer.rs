//! Tokenizers built from GGUF metadata: round trips, incremental detokenization that
//! never splits a character, SentencePiece vocabularies with byte fallback.

mod common;

use candle_core::quantized::gguf_file::Value;
use candle_core::Device;
use common::{write_tiny_gguf, TinySpec};
use ferrite_engine::model::load;
use ferrite_engine::tokenizer::{IncrementalDecoder, Tokenizer};

const TEXTS: &[&str] = &[
    "Hello, world! It's 2026.",
    "Grüße aus München — ça va? Ünïcödé façade.",
    "日本語のテキスト、中文文本。한국어 텍스트.",
    "Здравствуй, мир! Γειά σου Κόσμε. مرحبا بالعالم",
    "Emoji: 🌧️ 🚀👩‍👩‍👧 ❤️‍🔥 🇫🇷 done",
    "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}\n\n  trailing  spaces  ",
];

fn default_tokenizer() -> Tokenizer {
    load(&common::default_model(), &Device::Cpu)
        .expect("default model loads")
        .tokenizer
}

#[test]
fn round_trips_multilingual_text_and_emoji() {
    let tk = default_tokenizer();
    for text in TEXTS {
        let ids = tk.encode(text, false).expect("encodes");
        assert_eq!(tk.decode(&ids, false).expect("decodes"), *text);
    }
}

#[test]
fn incremental_decoding_equals_full_decoding_and_never_splits_a_character() {
    let tk = default_tokenizer();
    let prompt = tk.encode("Say:", false).expect("encodes");
    for text in TEXTS {
        let ids = tk.encode(text, false).expect("encodes");
        let mut dec = IncrementalDecoder::new(&prompt, true);
        let mut out = String::new();
        for &id in &ids {
            let delta = dec.push(&tk, id).expect("decodes");
            assert!(
                !delta.contains('\u{FFFD}'),
                "delta {delta:?} of {text:?} holds a broken character"
            );
            out.push_str(&delta);
        }
        out.push_str(&dec.flush(&tk).expect("flush"));
        assert_eq!(out, *text);
    }
}

#[test]
fn special_tokens_in_text_are_parsed_and_skipped_when_asked() {
    let tk = default_tokenizer();
    let ids = tk
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .expect("encodes");
    assert_eq!(ids.first(), Some(&1), "<|im_start|> is one token");
    assert_eq!(tk.decode(&ids, true).expect("decodes"), "user\nhi");
    assert_eq!(
        tk.stop_token_ids(),
        &[2],
        "SmolLM2 ends turns with <|im_end|>"
    );
}

/// A small SentencePiece vocabulary: control tokens, 256 byte tokens, then pieces whose
/// scores rank the merges.
fn spm_gguf(dir: &std::path::Path) -> std::path::PathBuf {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2i32, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or",
        "▁wor", "ld", "▁world",
    ];
    for p in pieces {
        tokens.push(p.into());
        types.push(1);
    }
    // Longer pieces score higher, so they are merged first.
    let scores: Vec<Value> = tokens
        .iter()
        .map(|t| {
            Value::F32(if t.starts_with('<') {
                0.0
            } else {
                t.chars().count() as f32
            })
        })
        .collect();
    let path = dir.join("spm.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec::llama(),
        "llama",
        &[
            ("tokenizer.ggml.model", Value::String("llama".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            ("tokenizer.ggml.scores", Value::Array(scores)),
            (
                "tokenizer.ggml.token_type",
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ],
    );
    path
}

#[test]
fn sentencepiece_vocabulary_with_byte_fallback() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = load(&spm_gguf(dir.path()), &Device::Cpu)
        .expect("loads")
        .tokenizer;
    let id = |piece: &str| {
        3 + 256
            + [
                "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w",
                "or", "▁wor", "ld", "▁world",
            ]
            .iter()
            .position(|p| *p == piece)
            .expect("piece") as u32
    };
    // BOS is added for raw prompts, as llama.cpp does for SentencePiece models.
    assert_eq!(
        tk.encode("hello world", true).expect("encodes"),
        vec![1, id("▁hello"), id("▁world")]
    );
    assert_eq!(
        tk.decode(&[id("▁hello"), id("▁world")], true)
            .expect("decodes"),
        "hello world"
    );
    // "é" is not in the vocabulary: it falls back to its two UTF-8 bytes.
    let ids = tk.encode("hé", false).expect("encodes");
    assert_eq!(ids, vec![id("▁h"), 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tk.decode(&ids, false).expect("decodes"), "hé");
    let mut dec = IncrementalDecoder::new(&[], true);
    let deltas: Vec<String> = ids
        .iter()
        .map(|&i| dec.push(&tk, i).expect("push"))
        .collect();
    assert_eq!(
        deltas,
        vec!["h".to_string(), String::new(), "é".to_string()]
    );
}

#[test]
fn chat_request_for_a_model_without_template_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tk = load(&spm_gguf(dir.path()), &Device::Cpu)
        .expect("loads")
        .tokenizer;
    let msg = tk
        .chat_template()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("no chat template"), "{msg}");
}
