//! The paged KV cache: a block pool with prefix caching, per-layer block storage, and the
//! memory budget that sizes it.

/// Most tokens a KV cache block may hold (`--block-size`; vLLM offers sizes up to 128, and
/// picks up to 256 on TPUs): a larger block wastes more of each sequence's last block than
/// it saves in block-table entries.
pub const MAX_BLOCK_SIZE: usize = 256;

pub mod block_pool;
pub mod budget;
pub mod cache;

pub use block_pool::{block_hash, BlockId, BlockPool, PrefixStats};

use crate::model::Llama;

/// Element type of the KV cache as asked for; `Auto` follows the checkpoint like vLLM's
/// `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// f32 for f32 checkpoints, f16 for everything else (llama.cpp's default for GGUF).
    #[default]
    Auto,
    /// Half precision: half the memory, llama.cpp's numerics.
    F16,
    /// Single precision.
    F32,
}

/// The element type a cache is built with: a [`KvDtype`] resolved against a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvElementType {
    /// f16.
    F16,
    /// f32.
    F32,
}

impl KvDtype {
    /// The element type this choice means for `model` (the one place `Auto` is decided).
    pub fn resolve(self, model: &Llama) -> KvElementType {
        match self {
            KvDtype::F16 => KvElementType::F16,
            KvDtype::F32 => KvElementType::F32,
            KvDtype::Auto if model.kv_prefers_f16() => KvElementType::F16,
            KvDtype::Auto => KvElementType::F32,
        }
    }
}

impl KvElementType {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            KvElementType::F16 => 2,
            KvElementType::F32 => 4,
        }
    }
}
