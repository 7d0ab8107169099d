//! The paged KV cache: a block pool with prefix caching, per-layer block storage, and the
//! memory budget that sizes it.

pub mod block_pool;
pub mod budget;
pub mod cache;

pub use block_pool::{block_hash, BlockId, BlockPool, PrefixStats};
