//! Constrained decoding: a grammar a request asks for (a JSON schema, any JSON object, a
//! regular expression, one of several strings, a Lark grammar) compiled by llguidance
//! against the model's vocabulary, and the per-sequence matcher that masks each step's
//! logits to the tokens the grammar allows and ends the sequence where the grammar ends.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// What the output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (which also embeds JSON schemas, `%json`).
    Lark(String),
}

impl Grammar {
    /// The kind, as the metrics and logs name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "json_object",
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::Regex(_) => "regex",
            Grammar::Choice(_) => "choice",
            Grammar::Lark(_) => "grammar",
        }
    }

    /// The grammar as llguidance takes it. JSON is written the way `json.dumps` writes it
    /// (`", "` and `": "`, no other whitespace) unless the schema sets its own
    /// `x-guidance` options: free whitespace lets a small model loop on newlines forever.
    fn top_level(&self) -> TopLevelGrammar {
        let layout =
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(json!({"type": "object", "x-guidance": layout()}))
            }
            Grammar::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if let Value::Object(o) = &mut schema {
                    o.entry("x-guidance").or_insert_with(layout);
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(options) => {
                let alternatives: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Grammar::Lark(source) => TopLevelGrammar::from_lark(source.clone()),
        }
    }
}

/// Compiles grammars for one model: the vocabulary's token trie and llguidance's shared
/// lexer state, built once per model (tens of milliseconds for a 50k vocabulary).
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// A compiler for `tokenizer`'s vocabulary, whose logits rows are `vocab_size` long
    /// (at least the tokenizer's size; ids past it are never allowed).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self> {
        let words = tokenizer.token_bytes(vocab_size)?;
        let ends = tokenizer.stop_token_ids();
        let first_end = *ends
            .first()
            .ok_or_else(|| Error::Tokenizer("the model names no end token".into()))?;
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: first_end,
            tok_bos: tokenizer.bos_token_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        if ends.iter().any(|&e| e as usize >= words.len()) {
            return Err(Error::Tokenizer(format!(
                "an end token id ({ends:?}) lies outside the {} token vocabulary",
                words.len()
            )));
        }
        let trie = TokTrie::from(&info, &words).with_eos_tokens(ends);
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| {
            Error::Tokenizer(format!("cannot prepare grammars for this vocabulary: {e}"))
        })?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits::default();
        Ok(GrammarCompiler { factory })
    }

    /// A fresh matcher for `grammar`, or what is wrong with the grammar.
    pub fn compile(&self, grammar: &Grammar) -> std::result::Result<Constraint, String> {
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            grammar: Arc::new(grammar.clone()),
            matcher,
        })
    }
}

/// The vocabulary as llguidance reads it: every token's bytes, and our tokenizer for
/// the text it tokenizes itself.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// One sequence's grammar state: which tokens may come next, advanced token by token.
#[derive(Clone)]
pub struct Constraint {
    grammar: Arc<Grammar>,
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Constraint").field(&self.grammar).finish()
    }
}

/// Two constraints are equal when they enforce the same grammar (whatever their state).
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        self.grammar == other.grammar
    }
}

/// The tokens a grammar allows at one step.
#[derive(Debug, Clone)]
pub struct Mask(SimpleVob);

impl Mask {
    /// Whether `token` is allowed.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets every disallowed logit to -inf (ids past the grammar's vocabulary too).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, l) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let covered = (words.len() * 32).min(self.0.len());
        for l in logits.iter_mut().skip(covered) {
            *l = f32::NEG_INFINITY;
        }
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

impl Constraint {
    /// The grammar this enforces.
    pub fn grammar(&self) -> &Grammar {
        &self.grammar
    }

    /// The tokens allowed next; only end tokens once the grammar is complete.
    pub fn mask(&mut self) -> std::result::Result<Mask, String> {
        self.matcher
            .compute_mask_or_eos()
            .map(Mask)
            .map_err(|e| e.to_string())
    }

    /// Advances past `token`, which the last mask allowed.
    pub fn accept(&mut self, token: u32) -> std::result::Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tokenizer whose tokens are single bytes plus a few longer pieces and `</s>`.
    pub(crate) fn tokenizer() -> Tokenizer {
        crate::tokenizer::tests::byte_level_tokenizer(&[
            "{\"", "\":", "\": ", "true", "false", "null", "name", "age", "ab", "yes", "no",
        ])
    }

    fn compile(g: &Grammar) -> Constraint {
        let tk = tokenizer();
        GrammarCompiler::new(&tk, tk.vocab_size() + 3)
            .expect("compiler")
            .compile(g)
            .expect("valid grammar")
    }

    /// Drives `c` with a seeded random walk over the allowed tokens until the grammar
    /// ends (or `limit` tokens), checking every step's mask; returns the text.
    pub(crate) fn walk(
        c: &mut Constraint,
        tk: &Tokenizer,
        seed: u64,
        limit: usize,
    ) -> (String, bool) {
        let ends = tk.stop_token_ids().to_vec();
        let mut state = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
        let mut ids = Vec::new();
        for _ in 0..limit {
            let mask = c.mask().expect("mask");
            assert!(mask.count() > 0, "a grammar state allows no token");
            let allowed: Vec<u32> = (0..tk.vocab_size() as u32 + 3)
                .filter(|&t| mask.allows(t))
                .collect();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let t = allowed[(state % allowed.len() as u64) as usize];
            if ends.contains(&t) {
                return (tk.decode(&ids, true).expect("decodes"), true);
            }
            c.accept(t).expect("an allowed token is accepted");
            ids.push(t);
            if c.is_finished() {
                return (tk.decode(&ids, true).expect("decodes"), true);
            }
        }
        (tk.decode(&ids, true).expect("decodes"), false)
    }

    #[test]
    fn every_walk_through_a_schema_ends_in_json_that_validates() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let tk = tokenizer();
        let fresh = compile(&Grammar::JsonSchema(schema));
        for seed in 0..40 {
            let mut c = fresh.clone();
            let (text, ended) = walk(&mut c, &tk, seed, 200);
            assert!(ended, "seed {seed}: no end within 200 tokens: {text}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(
                v["name"].as_str().is_some_and(|s| s.chars().count() <= 4),
                "{text}"
            );
            assert!(v["age"].as_u64().is_some_and(|a| a <= 99), "{text}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{text}");
        }
    }

    #[test]
    fn an_end_token_is_allowed_only_where_the_grammar_can_end() {
        let tk = tokenizer();
        let end = tk.stop_token_ids()[0];
        let mut c = compile(&Grammar::Choice(vec!["yes".into(), "no".into()]));
        assert!(!c.mask().expect("mask").allows(end), "nothing written yet");
        for t in tk.encode("ye", false).expect("encodes") {
            c.accept(t).expect("allowed");
            assert!(!c.mask().expect("mask").allows(end), "`ye` is not a choice");
        }
        let s = tk.encode("s", false).expect("encodes")[0];
        c.accept(s).expect("allowed");
        let mask = c.mask().expect("mask");
        assert!(mask.allows(end) && mask.count() == tk.stop_token_ids().len());
    }

    #[test]
    fn a_regex_and_a_lark_grammar_are_met() {
        let tk = tokenizer();
        for (g, check) in [
            (
                Grammar::Regex("[a-c]{2,5}-[0-9]+".into()),
                Box::new(|s: &str| {
                    let (l, r) = s.split_once('-').expect("a dash");
                    (2..=5).contains(&l.len())
                        && l.chars().all(|c| ('a'..='c').contains(&c))
                        && !r.is_empty()
                        && r.chars().all(|c| c.is_ascii_digit())
                }) as Box<dyn Fn(&str) -> bool>,
            ),
            (
                Grammar::Lark("start: \"(\" item (\",\" item)* \")\"\nitem: /[xy]/".into()),
                Box::new(|s: &str| {
                    s.starts_with('(')
                        && s.ends_with(')')
                        && s[1..s.len() - 1].split(',').all(|i| i == "x" || i == "y")
                }),
            ),
        ] {
            let fresh = compile(&g);
            for seed in 0..20 {
                let mut c = fresh.clone();
                let (text, ended) = walk(&mut c, &tk, seed, 60);
                if ended {
                    assert!(check(&text), "{g:?}: {text}");
                }
            }
        }
    }

    #[test]
    fn a_mask_sets_disallowed_logits_to_minus_infinity() {
        let tk = tokenizer();
        let mut c = compile(&Grammar::Choice(vec!["ab".into()]));
        let mask = c.mask().expect("mask");
        let mut logits = vec![1.0; tk.vocab_size() + 3];
        mask.apply(&mut logits);
        let kept: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        assert!(!kept.is_empty());
        assert!(kept.iter().all(|&i| mask.allows(i as u32)));
        assert_eq!(kept.len(), mask.count());
    }

    #[test]
    fn a_schema_that_is_not_json_schema_is_refused_with_the_reason() {
        let tk = tokenizer();
        let compiler = GrammarCompiler::new(&tk, tk.vocab_size()).expect("compiler");
        let e = compiler
            .compile(&Grammar::JsonSchema(json!({"type": "banana"})))
            .expect_err("refused");
        assert!(e.contains("banana"), "{e}");
        assert!(compiler.compile(&Grammar::Lark("start: (".into())).is_err());
        assert!(compiler.compile(&Grammar::Regex("(".into())).is_err());
    }
}
