//! Workloads: the prompt text, and the request list (prompt tokens and output length) a seed
//! determines.

use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

use crate::Error;

/// Public-domain prose the prompts are cut from.
pub const TEXT: &str = concat!(
    include_str!("../data/declaration.txt"),
    "\n",
    include_str!("../data/gettysburg.txt")
);

/// The shape of the prompt and output lengths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Shape {
    /// Every request has `prompt` prompt tokens and `output` output tokens.
    Fixed {
        /// Prompt tokens.
        prompt: usize,
        /// Output tokens.
        output: usize,
    },
    /// Chat-like traffic: log-normal prompt lengths (median 256, 16..=1536) and output
    /// lengths (median 128, 8..=512).
    Mixed,
}

impl FromStr for Shape {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || {
            Error::Invalid(format!(
                "workload `{s}`: expected `fixed:<prompt tokens>:<output tokens>` (e.g. fixed:128:128) or `mixed`"
            ))
        };
        if s == "mixed" {
            return Ok(Shape::Mixed);
        }
        let mut parts = s.split(':');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("fixed"), Some(p), Some(o), None) => {
                let prompt: usize = p.parse().map_err(|_| bad())?;
                let output: usize = o.parse().map_err(|_| bad())?;
                if prompt == 0 || output == 0 {
                    return Err(bad());
                }
                Ok(Shape::Fixed { prompt, output })
            }
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Fixed { prompt, output } => write!(f, "fixed:{prompt}:{output}"),
            Shape::Mixed => write!(f, "mixed"),
        }
    }
}

/// One request: its prompt as token ids and how many tokens to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens (`max_tokens`, with `ignore_eos`).
    pub max_tokens: usize,
}

/// `n` requests of `shape`, prompts cut from `corpus` (the tokenised [`TEXT`]) at offsets
/// the seed chooses, wrapping around the end. The same inputs give the same list.
pub fn requests(shape: Shape, corpus: &[u32], n: usize, seed: u64) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    // Both distributions are valid for these constants.
    let prompt_len = LogNormal::new(256f64.ln(), 0.8).ok();
    let output_len = LogNormal::new(128f64.ln(), 0.7).ok();
    (0..n)
        .map(|_| {
            let (p, o) = match shape {
                Shape::Fixed { prompt, output } => (prompt, output),
                Shape::Mixed => {
                    let p = prompt_len.map_or(256.0, |d| d.sample(&mut rng));
                    let o = output_len.map_or(128.0, |d| d.sample(&mut rng));
                    (
                        (p.round() as usize).clamp(16, 1536),
                        (o.round() as usize).clamp(8, 512),
                    )
                }
            };
            let start = if corpus.is_empty() {
                0
            } else {
                rng.random_range(0..corpus.len())
            };
            let prompt = corpus.iter().cycle().skip(start).take(p).copied().collect();
            RequestSpec {
                prompt,
                max_tokens: o,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_say_what_is_allowed() {
        assert_eq!(
            "fixed:128:64".parse::<Shape>().ok(),
            Some(Shape::Fixed {
                prompt: 128,
                output: 64
            })
        );
        assert_eq!("mixed".parse::<Shape>().ok(), Some(Shape::Mixed));
        for bad in ["fixed:0:1", "fixed:12", "chat", "fixed:a:b", "fixed:1:2:3"] {
            let e = bad.parse::<Shape>().expect_err(bad).to_string();
            assert!(e.contains("fixed:<prompt tokens>:<output tokens>"), "{e}");
        }
    }

    #[test]
    fn requests_have_exact_lengths_and_depend_only_on_the_seed() {
        let corpus: Vec<u32> = (0..300).collect();
        let fixed = Shape::Fixed {
            prompt: 128,
            output: 32,
        };
        let a = requests(fixed, &corpus, 20, 7);
        assert!(a
            .iter()
            .all(|r| r.prompt.len() == 128 && r.max_tokens == 32));
        assert_eq!(a, requests(fixed, &corpus, 20, 7));
        assert_ne!(a, requests(fixed, &corpus, 20, 8));
        // Windows wrap around the end of the text.
        let long = requests(
            Shape::Fixed {
                prompt: 1000,
                output: 1,
            },
            &corpus,
            1,
            1,
        );
        assert_eq!(long[0].prompt.len(), 1000);
        let mixed = requests(Shape::Mixed, &corpus, 200, 3);
        let lens: Vec<usize> = mixed.iter().map(|r| r.prompt.len()).collect();
        assert!(lens.iter().all(|&l| (16..=1536).contains(&l)));
        assert!(lens.iter().min() < lens.iter().max(), "mixed lengths vary");
        assert!(mixed.iter().all(|r| (8..=512).contains(&r.max_tokens)));
    }
}
