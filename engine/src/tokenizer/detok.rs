//! Incremental detokenization: turns a growing list of ids into text deltas that never
//! split a UTF-8 character, whatever byte-level or byte-fallback tokens arrive.

use super::Tokenizer;
use crate::error::Result;

/// How many earlier tokens are decoded with each new one, so that decoders that look at
/// their neighbours (leading-space stripping, byte fusion) see the same context.
const CONTEXT: usize = 5;

/// Per-sequence detokenizer state.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// Starts after `prompt` (whose last tokens give context to the first new ones).
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let keep = prompt.len().min(CONTEXT);
        IncrementalDecoder {
            ids: prompt[prompt.len() - keep..].to_vec(),
            prefix_offset: 0,
            read_offset: keep,
            skip_special_tokens,
        }
    }

    /// Adds `id` and returns the text it completes (possibly empty while a character is
    /// still partial).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window small so each push decodes a bounded number of tokens.
            if self.prefix_offset > CONTEXT {
                let cut = self.prefix_offset - CONTEXT;
                self.ids.drain(..cut);
                self.prefix_offset -= cut;
                self.read_offset -= cut;
            }
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back at the end of a sequence (an incomplete character at the end
    /// of generation is emitted as the replacement character, as a full decode would).
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
