//! The paged KV cache: a block pool with prefix caching, per-layer block storage, and the
//! memory budget that sizes it.

/// Most tokens a KV cache block may hold (`--block-size`), as vLLM allows: a larger block
/// wastes more of each sequence's last block than it saves in block-table entries.
pub const MAX_BLOCK_SIZE: usize = 256;

pub mod block_pool;
pub mod budget;
pub mod cache;

pub use block_pool::{block_hash, BlockId, BlockPool, PrefixStats};
