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
