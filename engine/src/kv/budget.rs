//! Sizing the KV cache: `--gpu-memory-utilization` of the device's memory, minus the
//! weights and the activations of the largest step, divided into blocks. On CPU the
//! device's memory is the container's cgroup limit, else the machine's.

use crate::error::{ConfigError, Result};
use crate::model::ModelConfig;

/// Bytes of memory this process may use: the cgroup limit when one is set, else the
/// machine's total memory.
pub fn device_memory() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(8 << 30);
    let limit = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok());
    match limit {
        Some(l) if l < total => l,
        _ => total,
    }
}

/// Bytes of KV one token takes in `layers` layers (keys and values): every layer of the
/// model, or a pipeline stage's.
pub fn bytes_per_token(config: &ModelConfig, layers: usize, element_bytes: usize) -> u64 {
    (2 * layers * config.num_kv_heads * config.head_dim * element_bytes) as u64
}

/// Upper estimate of the activation memory of one step of `tokens` tokens from up to
/// `seqs` sequences: the f32 hidden, projection and MLP buffers alive at once, their
/// quantized copies, and one logits row per sequence.
pub fn activation_bytes(config: &ModelConfig, tokens: usize, seqs: usize) -> u64 {
    let c = config;
    let per_token = 4
        * (3 * c.hidden_size
            + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * 2
            + 3 * c.intermediate_size)
        + 2 * c.intermediate_size;
    (tokens * per_token + seqs * c.vocab_size * 4 * 2) as u64
}

/// The inputs and result of sizing the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CachePlan {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes given to KV storage.
    pub kv_bytes: u64,
    /// How the KV bytes were derived, for the startup log.
    pub explanation: String,
}

/// What the plan is computed from.
#[derive(Debug, Clone)]
pub struct CacheRequest {
    /// Fraction of device memory the engine may use, in (0, 1].
    pub utilization: f64,
    /// Explicit KV size in bytes (`--kv-cache-memory`), overriding the fraction.
    pub kv_cache_memory: Option<u64>,
    /// Bytes of model weights.
    pub weight_bytes: u64,
    /// Bytes of the largest step's activations.
    pub activation_bytes: u64,
    /// Bytes of KV per token.
    pub bytes_per_token: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// The longest sequence the engine must hold.
    pub max_model_len: usize,
}

/// Sizes the cache and refuses one that cannot hold a single `max_model_len` sequence.
pub fn plan(req: &CacheRequest, device_memory: u64) -> Result<CachePlan> {
    if !(req.utilization > 0.0 && req.utilization <= 1.0) {
        return Err(ConfigError::OutOfRange {
            setting: "gpu_memory_utilization",
            range: "in (0, 1]".into(),
            got: req.utilization.to_string(),
        }
        .into());
    }
    let (kv_bytes, explanation) = match req.kv_cache_memory {
        Some(b) => (b, format!("--kv-cache-memory {b}")),
        None => {
            let budget = (req.utilization * device_memory as f64) as u64;
            let kv = budget.saturating_sub(req.weight_bytes + req.activation_bytes);
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            (
                kv,
                format!(
                    "{:.2} × {:.2} GiB memory − {:.2} GiB weights − {:.2} GiB activations",
                    req.utilization,
                    gib(device_memory),
                    gib(req.weight_bytes),
                    gib(req.activation_bytes)
                ),
            )
        }
    };
    let block_bytes = req.bytes_per_token * req.block_size as u64;
    let num_blocks = (kv_bytes / block_bytes.max(1)) as usize;
    let capacity = num_blocks * req.block_size;
    if capacity < req.max_model_len {
        return Err(ConfigError::CacheTooSmall {
            capacity,
            blocks: num_blocks,
            block_size: req.block_size,
            explanation,
            max_model_len: req.max_model_len,
        }
        .into());
    }
    Ok(CachePlan {
        num_blocks,
        block_size: req.block_size,
        kv_bytes,
        explanation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> CacheRequest {
        CacheRequest {
            utilization: 0.5,
            kv_cache_memory: None,
            weight_bytes: 100,
            activation_bytes: 100,
            bytes_per_token: 10,
            block_size: 4,
            max_model_len: 16,
        }
    }

    #[test]
    fn the_fraction_of_memory_left_after_weights_and_activations_becomes_blocks() {
        let p = plan(&req(), 2000).expect("fits");
        assert_eq!((p.kv_bytes, p.num_blocks), (800, 20));
    }

    #[test]
    fn an_explicit_size_overrides_the_fraction() {
        let p = plan(
            &CacheRequest {
                kv_cache_memory: Some(400),
                ..req()
            },
            2000,
        )
        .expect("fits");
        assert_eq!(p.num_blocks, 10);
    }

    #[test]
    fn a_cache_smaller_than_one_sequence_is_refused_with_both_numbers() {
        let err = plan(
            &CacheRequest {
                kv_cache_memory: Some(120),
                ..req()
            },
            2000,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.contains("holds 12 tokens"), "{err}");
        assert!(err.contains("--max-model-len is 16"), "{err}");
    }

    #[test]
    fn device_memory_is_positive() {
        assert!(device_memory() > 0);
    }
}
