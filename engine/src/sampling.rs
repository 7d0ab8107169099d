//! Per-request sampling: penalties, temperature, top-k, top-p, min-p, seeded randomness.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::RequestError;
use crate::grammar::Constraint;

/// How to pick each next token and when to stop; field names and ranges follow vLLM.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one.
    pub min_p: f32,
    /// Subtracted from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens in the prompt or output.
    pub repetition_penalty: f32,
    /// Seed for the random choices; the same seed gives the same text.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Fewest tokens to generate before an end token may stop the sequence.
    pub min_tokens: usize,
    /// Generation stops before any of these strings; they are not returned.
    pub stop: Vec<String>,
    /// Extra token ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end tokens.
    pub ignore_eos: bool,
    /// Number of most likely alternatives to report with each token's log-probability.
    pub logprobs: Option<usize>,
    /// Score the prompt too (vLLM's `prompt_logprobs`): the log-probability of every prompt
    /// token after the first given the tokens before it, with this many alternatives.
    pub prompt_logprobs: Option<usize>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`): each bias in
    /// [-100, 100], where -100 in effect bans a token and 100 in effect forces it.
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must match (structured output, a forced tool call): each
    /// step's logits are masked to the tokens it allows, and it ends the sequence where
    /// it is complete.
    pub constraint: Option<Constraint>,
}

impl SamplingParams {
    /// The defaults every entry point starts from (OpenAI's and vLLM's): temperature 1, no
    /// truncation or penalties, 16 tokens.
    pub const DEFAULT: SamplingParams = SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        seed: None,
        max_tokens: 16,
        min_tokens: 0,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: None,
        logit_bias: Vec::new(),
        constraint: None,
    };
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Most alternatives a request may ask for per token (OpenAI allows 20).
pub const MAX_LOGPROBS: usize = 20;
const _: () = assert!(MAX_LOGPROBS == 20, "the range `validate` names");

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    /// Checks every field against its allowed range; the error names the field.
    pub fn validate(&self) -> Result<(), RequestError> {
        for (param, got) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty),
        ] {
            if !got.is_finite() {
                return Err(RequestError::NotFinite { param, got });
            }
        }
        let range = |param, range, ok: bool, got: f32| match ok {
            true => Ok(()),
            false => Err(RequestError::OutOfRange {
                param,
                range,
                got: got.to_string(),
            }),
        };
        let t = self.temperature;
        range("temperature", "[0, 2]", (0.0..=2.0).contains(&t), t)?;
        range(
            "top_p",
            "(0, 1]",
            self.top_p > 0.0 && self.top_p <= 1.0,
            self.top_p,
        )?;
        range(
            "min_p",
            "[0, 1]",
            (0.0..=1.0).contains(&self.min_p),
            self.min_p,
        )?;
        for (param, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            range(param, "[-2, 2]", (-2.0..=2.0).contains(&v), v)?;
        }
        let r = self.repetition_penalty;
        range("repetition_penalty", "(0, 2]", r > 0.0 && r <= 2.0, r)?;
        if self.max_tokens == 0 {
            return Err(RequestError::Zero {
                param: "max_tokens",
            });
        }
        if self.min_tokens > self.max_tokens {
            return Err(RequestError::MinAboveMax {
                min: self.min_tokens,
                max: self.max_tokens,
            });
        }
        if let Some(&(token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(RequestError::BiasOutOfRange { token, bias });
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(RequestError::EmptyStop);
        }
        for (param, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = n.filter(|&n| n > MAX_LOGPROBS) {
                return Err(RequestError::OutOfRange {
                    param,
                    range: "[0, 20]",
                    got: n.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Whether sampling is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }
}

/// Turns one row of logits into a token, applying a request's parameters.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    seen_in_prompt: Vec<u32>,
    output_counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for one sequence whose prompt is `prompt` (used by the repetition penalty).
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let mut seen_in_prompt = if params.repetition_penalty != 1.0 {
            prompt.to_vec()
        } else {
            Vec::new()
        };
        seen_in_prompt.sort_unstable();
        seen_in_prompt.dedup();
        Sampler {
            params,
            rng,
            seen_in_prompt,
            output_counts: HashMap::new(),
        }
    }

    /// The parameters this sampler applies.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (for the penalties).
    pub fn observe(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// Applies penalties, then logit biases, in place; `banned` ids (end tokens before
    /// `min_tokens`) get -inf.
    pub fn adjust_logits(&self, logits: &mut [f32], banned: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let penalise = |l: &mut f32| {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                }
            };
            for &t in &self.seen_in_prompt {
                if !self.output_counts.contains_key(&t) {
                    logits.get_mut(t as usize).map(penalise);
                }
            }
            for &t in self.output_counts.keys() {
                logits.get_mut(t as usize).map(penalise);
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
        for &t in banned {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Picks the next token from penalised logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp()))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        let needs_sort = (p.top_k > 0 && p.top_k < cand.len()) || p.top_p < 1.0;
        if needs_sort {
            cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        }
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        if p.min_p > 0.0 {
            let top = cand.iter().map(|c| c.1).fold(0.0, f32::max);
            cand.retain(|c| c.1 >= p.min_p * top);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(id, w) in &cand {
            if r < w {
                return id;
            }
            r -= w;
        }
        cand.last().map(|c| c.0).unwrap_or(0)
    }
}

/// Index of the largest logit (the first one on ties; NaNs never win, and a row that starts
/// with NaN gives 0). Two passes the compiler vectorizes, sixteen lanes at a time: the
/// maximum, then the first chunk holding it (a 49152-token vocabulary in ~4 µs instead of
/// ~25 µs one logit at a time, for every sequence of every greedy step).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    if logits.first().is_none_or(|l| l.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (best, &l) in lanes.iter_mut().zip(chunk) {
            if l > *best {
                *best = l;
            }
        }
    }
    let max = lanes
        .iter()
        .chain(chunks.remainder())
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    let mut at = 0;
    for chunk in logits.chunks(LANES) {
        if chunk.iter().fold(false, |hit, &l| hit | (l == max)) {
            return (at + chunk.iter().position(|&l| l == max).unwrap_or(0)) as u32;
        }
        at += chunk.len();
    }
    0
}

/// The `k` most likely `(token, logprob)` pairs of a log-probability row, best first.
pub fn top_logprobs(logprobs: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logprobs[b as usize].total_cmp(&logprobs[a as usize])
    });
    idx.truncate(k);
    idx.sort_unstable_by(|&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy(4), &[]);
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn argmax_is_the_first_largest_logit_as_a_one_by_one_scan_finds_it() {
        fn scan(logits: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &l) in logits.iter().enumerate() {
                if l > logits[best] {
                    best = i;
                }
            }
            best as u32
        }
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let edges: [&[f32]; 9] = [
            &[],
            &[nan, 5.0, 6.0],
            &[1.0, nan, 3.0, nan],
            &[-inf; 40],
            &[-0.0, 0.0, -1.0],
            &[-1.0, 0.0, -0.0, 0.0],
            &[2.0, 7.0, 7.0, 1.0, 7.0],
            &[inf, 1.0, inf],
            &[nan; 33],
        ];
        for row in edges {
            assert_eq!(argmax(row), scan(row), "{row:?}");
        }
        // Rows of every length around the lane width, ties and NaNs sprinkled in.
        let mut state = 0x2545f491u32;
        for len in 1..100 {
            for _ in 0..20 {
                let row: Vec<f32> = (0..len)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 17;
                        state ^= state << 5;
                        match state % 23 {
                            0 => nan,
                            1 => -inf,
                            v => (v % 6) as f32 - 2.0,
                        }
                    })
                    .collect();
                assert_eq!(argmax(&row), scan(&row), "{row:?}");
            }
        }
    }

    #[test]
    fn same_seed_same_choices() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = || {
            let mut s = Sampler::new(params(|_| {}), &[]);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(params(|p| p.top_k = 1), &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&[1.0, 5.0, 4.9]), 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 holds ~88 % of the mass: top_p 0.5 keeps it alone.
        let mut s = Sampler::new(params(|p| p.top_p = 0.5), &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&[4.0, 2.0, 1.0]), 0);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(params(|p| p.min_p = 0.5), &[]);
        for _ in 0..50 {
            assert_ne!(s.sample(&[3.0, 3.0, 0.0]), 2);
        }
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut s = Sampler::new(
            params(|p| {
                p.presence_penalty = 1.0;
                p.frequency_penalty = 0.5;
                p.repetition_penalty = 2.0;
            }),
            &[2],
        );
        s.observe(0);
        s.observe(0);
        let mut logits = vec![4.0, 1.0, 2.0];
        s.adjust_logits(&mut logits, &[1]);
        assert_eq!(logits[0], 4.0 / 2.0 - 1.0 - 1.0);
        assert_eq!(logits[1], f32::NEG_INFINITY);
        assert_eq!(logits[2], 1.0);
    }

    #[test]
    fn validation_names_the_parameter_and_range() {
        let err = params(|p| p.top_p = 1.5)
            .validate()
            .err()
            .map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("`top_p` must be in (0, 1], got 1.5"));
        let err = params(|p| p.temperature = -1.0)
            .validate()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("`temperature` must be in [0, 2], got -1")
        );
        assert!(params(|p| p.max_tokens = 0).validate().is_err());
        assert!(params(|p| p.logprobs = Some(21)).validate().is_err());
        let err = params(|p| p.prompt_logprobs = Some(21)).validate().err();
        assert_eq!(
            err.map(|e| e.to_string()).as_deref(),
            Some("`prompt_logprobs` must be in [0, 20], got 21")
        );
        assert!(params(|p| p.stop = vec![String::new()]).validate().is_err());
        let err = params(|p| p.logit_bias = vec![(3, 1.0), (5, -101.0)])
            .validate()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("`logit_bias` values must be in [-100, 100], got -101 for token 5")
        );
    }

    #[test]
    fn logit_bias_moves_the_choice_and_minus_100_bans_a_token() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let pick = |bias: Vec<(u32, f32)>, temperature: f32| {
            let p = params(|p| {
                p.logit_bias = bias;
                p.temperature = temperature;
            });
            let mut s = Sampler::new(p, &[]);
            let mut l = logits;
            s.adjust_logits(&mut l, &[]);
            s.sample(&l)
        };
        assert_eq!(pick(vec![(3, 5.0)], 0.0), 3, "a bias lifts a token");
        assert_eq!(pick(vec![(1, -100.0)], 0.0), 2, "-100 bans the argmax");
        // Sampled, not greedy: a token biased by -100 is never drawn.
        for _ in 0..50 {
            assert_ne!(pick(vec![(1, -100.0), (2, -100.0)], 2.0), 1);
        }
    }

    #[test]
    fn top_logprobs_sorted_best_first() {
        let top = top_logprobs(&[-3.0, -0.1, -2.0, -5.0], 2);
        assert_eq!(top, vec![(1, -0.1), (2, -2.0)]);
    }
}
