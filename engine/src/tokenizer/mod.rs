//! Text <-> token ids: from `tokenizer.json` or built from GGUF metadata, with the model's
//! special tokens and chat template.

mod chat;
mod detok;
mod gguf;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::IncrementalDecoder;

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::Deserialize;

use crate::error::{Error, Result};

/// A model's tokenizer plus the special tokens and template that go with it.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    stop_ids: Vec<u32>,
    add_bos: bool,
    bos_text: String,
    eos_text: String,
    chat_template: Option<String>,
}

fn tk_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        gguf::build(content, path)
    }

    /// Reads `tokenizer.json` and `tokenizer_config.json` from an HF model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(Error::model(
                &file,
                "missing: an HF model directory needs tokenizer.json",
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::model(&file, format!("malformed tokenizer.json: {e}")))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: HfTokenizerConfig = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                Error::model(&cfg_path, format!("malformed tokenizer_config.json: {e}"))
            })?,
            Err(_) => HfTokenizerConfig::default(),
        };
        let text_of = |t: &Option<TokenText>| t.as_ref().map(TokenText::text).unwrap_or_default();
        let bos_text = text_of(&cfg.bos_token);
        let eos_text = text_of(&cfg.eos_token);
        let bos = inner.token_to_id(&bos_text);
        let mut stop_ids: Vec<u32> = inner.token_to_id(&eos_text).into_iter().collect();
        // `generation_config.json` and `config.json` may name further end tokens (Llama 3's eot).
        for name in ["generation_config.json", "config.json"] {
            if let Ok(text) = std::fs::read_to_string(dir.join(name)) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                    match &v["eos_token_id"] {
                        serde_json::Value::Number(n) => {
                            stop_ids.extend(n.as_u64().map(|x| x as u32))
                        }
                        serde_json::Value::Array(a) => {
                            stop_ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32))
                        }
                        _ => {}
                    }
                }
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(Tokenizer {
            inner,
            bos,
            stop_ids,
            // tokenizer.json's post-processor adds BOS itself where the model wants it.
            add_bos: false,
            bos_text,
            eos_text,
            chat_template: cfg.chat_template.and_then(ChatTemplateField::into_default),
        })
    }

    /// Token ids of `text`; special tokens written in the text are parsed as such.
    /// `add_special_tokens` adds the model's BOS where it expects one (raw prompts; chat
    /// templates write their own).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(tk_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids`; special tokens are left out when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tk_err)
    }

    /// The surface form of one token (for logprobs), e.g. `Ġthe` rendered as ` the`.
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }

    /// Every token's bytes, by id, over `vocab_size` ids (at least the tokenizer's own):
    /// byte-level tokens mapped back to bytes, byte-fallback `<0xNN>` tokens as their
    /// byte, `▁` as a space, special tokens marked with a leading 0xFF (as llguidance
    /// expects), ids the tokenizer lacks empty.
    pub fn token_bytes(&self, vocab_size: usize) -> Result<Vec<Vec<u8>>> {
        let decoder = serde_json::to_value(self.inner.get_decoder()).map_err(tk_err)?;
        let pieces = Pieces::of(&decoder);
        let mut words = vec![Vec::new(); vocab_size.max(self.vocab_size())];
        for (piece, id) in self.inner.get_vocab(false) {
            if let Some(w) = words.get_mut(id as usize) {
                *w = pieces.bytes(&piece);
            }
        }
        for (id, added) in self.inner.get_added_tokens_decoder() {
            if let Some(w) = words.get_mut(id as usize) {
                *w = added.content.into_bytes();
                if added.special {
                    w.insert(0, 0xFF);
                }
            }
        }
        Ok(words)
    }

    /// Number of ids the tokenizer knows, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids that end generation (EOS, EOT).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`Tokenizer::encode`] with special tokens starts a text with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// The model's chat template's source, if it has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The model's chat template, or an error saying it has none.
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        let source = self.chat_template.as_deref().ok_or_else(|| {
            Error::ChatTemplate(
                "this model has no chat template (no tokenizer.chat_template in the GGUF, no \
                 chat_template in tokenizer_config.json); use a completion instead"
                    .into(),
            )
        })?;
        ChatTemplate::new(source, &self.bos_text, &self.eos_text)
    }
}

/// How a tokenizer writes bytes in its vocabulary's pieces, read from its decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pieces {
    /// GPT-2's byte-level alphabet: every byte is one printable character.
    ByteLevel,
    /// SentencePiece: `<0xNN>` pieces for bytes, this character for a space.
    ByteFallback(char),
    /// The piece's own text.
    Text,
}

impl Pieces {
    fn of(decoder: &serde_json::Value) -> Self {
        let kind = |d: &serde_json::Value| d["type"].as_str().unwrap_or_default().to_string();
        let steps: Vec<&serde_json::Value> = match decoder["decoders"].as_array() {
            Some(list) => list.iter().collect(),
            None => vec![decoder],
        };
        if steps.iter().any(|d| kind(d) == "ByteLevel") {
            return Pieces::ByteLevel;
        }
        let space = steps
            .iter()
            .find_map(|d| match kind(d).as_str() {
                "Metaspace" => d["replacement"].as_str().and_then(|r| r.chars().next()),
                "Replace" if d["content"] == " " => d["pattern"]["String"]
                    .as_str()
                    .and_then(|p| p.chars().next()),
                _ => None,
            })
            .unwrap_or('\u{2581}');
        if steps
            .iter()
            .any(|d| matches!(kind(d).as_str(), "ByteFallback" | "Metaspace"))
        {
            Pieces::ByteFallback(space)
        } else {
            Pieces::Text
        }
    }

    fn bytes(self, piece: &str) -> Vec<u8> {
        match self {
            Pieces::ByteLevel => piece.chars().filter_map(byte_of_char).collect(),
            Pieces::ByteFallback(space) => {
                let hex = piece
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => vec![b],
                    None => piece.replace(space, " ").into_bytes(),
                }
            }
            Pieces::Text => piece.as_bytes().to_vec(),
        }
    }
}

/// The byte GPT-2's byte-level alphabet writes as `c`: printable Latin-1 stands for
/// itself, the other 68 bytes for U+0100 onwards in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = c as u32;
    if printable(code) {
        return u8::try_from(code).ok();
    }
    let n = code.checked_sub(0x100)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .and_then(|b| u8::try_from(b).ok())
}

#[derive(Deserialize, Default)]
struct HfTokenizerConfig {
    bos_token: Option<TokenText>,
    eos_token: Option<TokenText>,
    chat_template: Option<ChatTemplateField>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenText {
    Plain(String),
    Added { content: String },
}

impl TokenText {
    fn text(&self) -> String {
        match self {
            TokenText::Plain(s) | TokenText::Added { content: s } => s.clone(),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ChatTemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl ChatTemplateField {
    fn into_default(self) -> Option<String> {
        match self {
            ChatTemplateField::One(s) => Some(s),
            ChatTemplateField::Named(list) => list
                .into_iter()
                .find(|t| t.name == "default")
                .map(|t| t.template),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE tokenizer (no merges) of every byte, `extra` longer pieces and
    /// the end token `</s>`, for tests that need a vocabulary and no model.
    pub(crate) fn byte_level_tokenizer(extra: &[&str]) -> Tokenizer {
        let alphabet: Vec<char> = (0u32..=255)
            .map(|b| {
                let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
                let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
                char::from_u32(if printable(b) { b } else { 0x100 + shifted }).unwrap_or('?')
            })
            .collect();
        let mut vocab = serde_json::Map::new();
        for c in &alphabet {
            vocab.insert(c.to_string(), json!(vocab.len()));
        }
        for piece in extra {
            let mapped: String = piece.bytes().map(|b| alphabet[b as usize]).collect();
            vocab.insert(mapped, json!(vocab.len()));
        }
        let end = vocab.len();
        let spec = json!({
            "version": "1.0",
            "added_tokens": [{"id": end, "content": "</s>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}],
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        });
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("tokenizer.json"), spec.to_string()).expect("write");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"eos_token": "</s>"}).to_string(),
        )
        .expect("write");
        Tokenizer::from_hf_dir(dir.path()).expect("tokenizer")
    }

    #[test]
    fn token_bytes_undo_the_byte_level_alphabet_and_mark_special_tokens() {
        let tk = byte_level_tokenizer(&["h\u{e9}llo world\n"]);
        let words = tk.token_bytes(tk.vocab_size() + 2).expect("bytes");
        assert_eq!(words.len(), tk.vocab_size() + 2);
        for b in 0..=255u8 {
            assert_eq!(words[b as usize], vec![b]);
        }
        assert_eq!(words[256], "h\u{e9}llo world\n".as_bytes());
        assert_eq!(words[257], b"\xFF</s>");
        assert!(words[258].is_empty());
    }

    #[test]
    fn sentencepiece_pieces_give_their_bytes_and_spaces() {
        let p = Pieces::of(&json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}));
        assert_eq!(p, Pieces::ByteFallback('\u{2581}'));
        assert_eq!(p.bytes("<0x0A>"), b"\n");
        assert_eq!(p.bytes("\u{2581}the"), b" the");
        assert_eq!(p.bytes("<0x0>"), b"<0x0>");
    }
}
