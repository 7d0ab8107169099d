//! Splitting a model into pipeline stages: contiguous ranges of layers balanced by the bytes
//! of weights each stage holds, the embedding counted on the first stage and the vocabulary
//! projection on the last.

use super::config::ModelConfig;
use super::llama::ModelPart;
use super::weights::{matrix_bytes, WeightName, WeightSource};
use crate::error::{ConfigError, Result};

/// Every matrix of the model with its `[rows, cols]` shape: each layer's seven projections,
/// then the embedding, then the output projection when it is not tied to the embedding.
pub fn matrices(c: &ModelConfig) -> Vec<(WeightName, (usize, usize))> {
    let h = c.hidden_size;
    let mut out: Vec<(WeightName, (usize, usize))> = (0..c.num_layers)
        .flat_map(|l| layer_matrices(c, l))
        .collect();
    out.push((WeightName::Embed, (c.vocab_size, h)));
    if !c.tie_word_embeddings {
        out.push((WeightName::Output, (c.vocab_size, h)));
    }
    out
}

/// Layer `l`'s projections with their shapes.
fn layer_matrices(c: &ModelConfig, l: usize) -> [(WeightName, (usize, usize)); 7] {
    let (h, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
    [
        (WeightName::Q(l), (c.num_heads * hd, h)),
        (WeightName::K(l), (c.num_kv_heads * hd, h)),
        (WeightName::V(l), (c.num_kv_heads * hd, h)),
        (WeightName::O(l), (h, c.num_heads * hd)),
        (WeightName::Gate(l), (i, h)),
        (WeightName::Up(l), (i, h)),
        (WeightName::Down(l), (h, i)),
    ]
}

/// The parts of `stages` pipeline stages: contiguous layer ranges, none empty, that make the
/// largest stage's weight bytes as small as they can be.
pub fn split(c: &ModelConfig, src: &dyn WeightSource, stages: usize) -> Result<Vec<ModelPart>> {
    if stages <= 1 {
        return Ok(vec![ModelPart::whole(c.num_layers)]);
    }
    if stages > c.num_layers {
        return Err(ConfigError::OutOfRange {
            setting: "pipeline_parallel_size",
            range: format!("at most the model's {} layers", c.num_layers),
            got: stages.to_string(),
        }
        .into());
    }
    let bytes =
        |name, shape| -> Result<u64> { Ok(matrix_bytes(src.matrix_format(name, shape)?, shape)) };
    let mut layers = Vec::with_capacity(c.num_layers);
    for l in 0..c.num_layers {
        let mut sum = 0;
        for (name, shape) in layer_matrices(c, l) {
            sum += bytes(name, shape)?;
        }
        layers.push(sum);
    }
    let table = (c.vocab_size, c.hidden_size);
    let embed = bytes(WeightName::Embed, table)?;
    let head = match c.tie_word_embeddings {
        true => embed,
        false => bytes(WeightName::Output, table)?,
    };
    Ok(balance(&layers, embed, head, stages)
        .into_iter()
        .enumerate()
        .map(|(i, layers)| ModelPart {
            layers,
            embed: i == 0,
            head: i + 1 == stages,
        })
        .collect())
}

/// Contiguous ranges of `layers` (bytes per layer) into `stages` non-empty stages, `first`
/// bytes more on the first and `last` more on the last, minimising the largest stage; among
/// equal splits, earlier stages take more layers.
fn balance(layers: &[u64], first: u64, last: u64, stages: usize) -> Vec<std::ops::Range<usize>> {
    let n = layers.len();
    let prefix: Vec<u64> = std::iter::once(0)
        .chain(layers.iter().scan(0u64, |s, &b| {
            *s += b;
            Some(*s)
        }))
        .collect();
    let cost = |stage: usize, a: usize, b: usize| {
        prefix[b] - prefix[a]
            + if stage == 0 { first } else { 0 }
            + if stage + 1 == stages { last } else { 0 }
    };
    // best[s][e]: the smallest largest stage of layers 0..e in stages 0..=s; from[s][e]: where
    // stage s starts in it.
    let mut best = vec![vec![u64::MAX; n + 1]; stages];
    let mut from = vec![vec![0usize; n + 1]; stages];
    for (e, best) in best[0].iter_mut().enumerate().skip(1) {
        *best = cost(0, 0, e);
    }
    for s in 1..stages {
        for e in s + 1..=n {
            for a in s..e {
                let worst = best[s - 1][a].max(cost(s, a, e));
                if worst < best[s][e] || worst == best[s][e] && a > from[s][e] {
                    best[s][e] = worst;
                    from[s][e] = a;
                }
            }
        }
    }
    let mut ranges = vec![0..0; stages];
    let mut end = n;
    for s in (0..stages).rev() {
        let start = if s == 0 { 0 } else { from[s][end] };
        ranges[s] = start..end;
        end = start;
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_layers_split_evenly_and_the_head_pulls_layers_off_the_last_stage() {
        assert_eq!(balance(&[10; 4], 0, 0, 2), vec![0..2, 2..4]);
        // A head as large as two layers: the last stage takes one layer fewer.
        assert_eq!(balance(&[10; 6], 0, 20, 2), vec![0..4, 4..6]);
        assert_eq!(balance(&[10; 9], 0, 0, 3), vec![0..3, 3..6, 6..9]);
        // Every stage keeps at least one layer, however large the head.
        assert_eq!(balance(&[1; 3], 0, 1000, 3), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn uneven_layers_are_balanced_by_bytes_not_counted() {
        // K-quant mixes hold some layers in a wider format.
        let ranges = balance(&[30, 10, 10, 10], 0, 0, 2);
        assert_eq!(ranges, vec![0..1, 1..4]);
    }
}
