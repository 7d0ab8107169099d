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
