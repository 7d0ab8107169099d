//! Builds a tokenizer from GGUF `tokenizer.ggml.*` metadata: GPT-2 style byte-level BPE
//! (with the pre-tokenizer named by `tokenizer.ggml.pre`) or llama SentencePiece.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use super::Tokenizer;
use crate::error::{Error, Result};

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// Llama 3's pre-tokenizer split (llama.cpp `llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer split: like Llama 3's but one digit at a time.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn meta<'a>(content: &'a Content, key: &str) -> Option<&'a Value> {
    content.metadata.get(key)
}

fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::model(path, msg)
}

fn strings(content: &Content, key: &str, path: &Path) -> Result<Vec<String>> {
    let v =
        meta(content, key).ok_or_else(|| bad(path, format!("GGUF metadata `{key}` is missing")))?;
    let list = v
        .to_vec()
        .map_err(|e| bad(path, format!("GGUF metadata `{key}`: {e}")))?;
    list.iter()
        .map(|x| {
            x.to_string()
                .cloned()
                .map_err(|e| bad(path, format!("GGUF metadata `{key}`: {e}")))
        })
        .collect()
}

fn opt_u32(content: &Content, key: &str) -> Option<u32> {
    meta(content, key).and_then(|v| v.to_u32().ok())
}

fn opt_bool(content: &Content, key: &str) -> Option<bool> {
    meta(content, key).and_then(|v| v.to_bool().ok())
}

pub(super) fn build(content: &Content, path: &Path) -> Result<Tokenizer> {
    let model = meta(content, "tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok().cloned())
        .ok_or_else(|| {
            bad(
                path,
                "GGUF metadata `tokenizer.ggml.model` is missing; the file has no tokenizer",
            )
        })?;
    let tokens = strings(content, "tokenizer.ggml.tokens", path)?;
    let types: Vec<i32> = match meta(content, "tokenizer.ggml.token_type").map(Value::to_vec) {
        Some(Ok(list)) => list.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let vocab: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let (mut inner, add_bos_default) = match model.as_str() {
        "gpt2" => (byte_level_bpe(content, path, vocab)?, false),
        "llama" => (sentencepiece_bpe(content, path, &tokens, vocab)?, true),
        other => {
            return Err(bad(
                path,
                format!("tokenizer.ggml.model `{other}` is not supported; supported: gpt2 (BPE), llama (SentencePiece)"),
            ))
        }
    };
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TYPE_CONTROL || t == TYPE_USER_DEFINED)
        .map(|(s, &t)| AddedToken::from(s.clone(), t == TYPE_CONTROL))
        .collect();
    inner.add_special_tokens(&specials);

    let bos = opt_u32(content, "tokenizer.ggml.bos_token_id");
    let eos = opt_u32(content, "tokenizer.ggml.eos_token_id");
    let text_of = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .cloned()
            .unwrap_or_default()
    };
    let mut stop_ids: Vec<u32> = eos.into_iter().collect();
    stop_ids.extend(opt_u32(content, "tokenizer.ggml.eot_token_id"));
    stop_ids.extend(opt_u32(content, "tokenizer.ggml.eom_token_id"));
    stop_ids.sort_unstable();
    stop_ids.dedup();
    Ok(Tokenizer {
        inner,
        bos,
        stop_ids,
        add_bos: opt_bool(content, "tokenizer.ggml.add_bos_token").unwrap_or(add_bos_default),
        bos_text: text_of(bos),
        eos_text: text_of(eos),
        chat_template: meta(content, "tokenizer.chat_template")
            .and_then(|v| v.to_string().ok().cloned()),
    })
}

fn byte_level_bpe(
    content: &Content,
    path: &Path,
    vocab: HashMap<String, u32>,
) -> Result<tokenizers::Tokenizer> {
    let merges: Vec<(String, String)> = strings(content, "tokenizer.ggml.merges", path)?
        .into_iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(bad(
                path,
                format!("malformed BPE merge `{m}` (expected two tokens separated by a space)"),
            )),
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(
            vocab
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .build()
        .map_err(|e| bad(path, format!("cannot build BPE from GGUF vocabulary: {e}")))?;
    let pre = meta(content, "tokenizer.ggml.pre").and_then(|v| v.to_string().ok().cloned());
    let byte_level =
        |regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| bad(path, format!("pre-tokenizer regex: {e}")))?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    let steps = match pre.as_deref().unwrap_or("default") {
        "default" | "gpt-2" | "gpt2" => vec![byte_level(true)],
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]
        }
        "llama-bpe" | "llama3" | "smaug-bpe" => vec![split(LLAMA3_SPLIT)?, byte_level(false)],
        "qwen2" | "deepseek-r1-qwen" => vec![split(QWEN2_SPLIT)?, byte_level(false)],
        other => {
            return Err(bad(
                path,
                format!(
                "tokenizer.ggml.pre `{other}` is not supported; supported: default, gpt2, smollm, \
                     starcoder, refact, llama-bpe, qwen2"
            ),
            ))
        }
    };
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(PreSequence::new(steps))));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
    Ok(tk)
}

/// SentencePiece BPE: merges ranked by the score of the piece they produce, byte fallback
/// through `<0xNN>` tokens, `▁` for spaces.
fn sentencepiece_bpe(
    content: &Content,
    path: &Path,
    tokens: &[String],
    vocab: HashMap<String, u32>,
) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f32> = match meta(content, "tokenizer.ggml.scores").map(Value::to_vec) {
        Some(Ok(list)) => list.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect(),
        _ => vec![0.0; tokens.len()],
    };
    let mut merges: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        let chars: Vec<(usize, char)> = piece.char_indices().collect();
        for &(split, _) in chars.iter().skip(1) {
            let (left, right) = piece.split_at(split);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                let score = scores.get(id).copied().unwrap_or(0.0);
                merges.push((score, id as u32, left.to_string(), right.to_string()));
            }
        }
    }
    // Higher score merges first; ties broken by id like SentencePiece.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = merges.into_iter().map(|(_, _, l, r)| (l, r)).collect();
    let unk = opt_u32(content, "tokenizer.ggml.unknown_token_id")
        .and_then(|i| tokens.get(i as usize))
        .cloned();
    let mut builder = BPE::builder()
        .vocab_and_merges(
            vocab
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| bad(path, format!("cannot build SentencePiece BPE: {e}")))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let add_space = opt_bool(content, "tokenizer.ggml.add_space_prefix").unwrap_or(true);
    let mut norm = Vec::new();
    if add_space {
        norm.push(NormalizerWrapper::Prepend(Prepend::new("▁".into())));
    }
    norm.push(NormalizerWrapper::Replace(
        Replace::new(" ", "▁").map_err(|e| bad(path, format!("normalizer: {e}")))?,
    ));
    tk.with_normalizer(Some(NormalizerWrapper::Sequence(
        tokenizers::normalizers::Sequence::new(norm),
    )));
    let replace = Replace::new("▁", " ").map_err(|e| bad(path, format!("decoder: {e}")))?;
    let mut dec = vec![
        DecoderWrapper::Replace(replace),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space {
        dec.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tk.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(dec))));
    Ok(tk)
}
