//! The block pool of a paged KV cache (vLLM's PagedAttention block manager): fixed-size
//! blocks with a free list, reference counts, and — for prefix caching — a map from the
//! hash of a full block's tokens (chained with its prefix) to the block holding them.
//!
//! A block is in exactly one of three states: free (on the free list, no hash), used
//! (reference count > 0) or cached (count 0 but hashed, evictable least-recently-used).
//! Allocation prefers free blocks and evicts the least recently used cached block only
//! when the free list is empty.

use std::collections::{BTreeMap, HashMap};

/// Index of a block in the pool.
pub type BlockId = u32;

/// Counters of the prefix cache, as vLLM exports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Tokens looked up in the prefix cache.
    pub queries: u64,
    /// Tokens found in it.
    pub hits: u64,
}

/// Fixed-size KV blocks with reference counts and a prefix-hash index.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    free: Vec<BlockId>,
    hash_of: Vec<Option<u64>>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached blocks with no users, by the tick they were last released (oldest first).
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    tick: u64,
    stats: PrefixStats,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockPool {
            block_size,
            refcount: vec![0; num_blocks],
            // Popped from the back: hand out low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            hash_of: vec![None; num_blocks],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks that nobody uses (allocatable by eviction).
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks that at least one sequence holds.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free() - self.num_cached()
    }

    /// Blocks an allocation could get right now (free or evictable).
    pub fn num_available(&self) -> usize {
        self.num_free() + self.num_cached()
    }

    /// How many sequences hold `block`.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount[block as usize]
    }

    /// Prefix-cache counters so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.stats
    }

    /// Takes a block for exclusive use: a free one, else the least recently used cached one.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (&tick, &id) = self.evictable.iter().next()?;
                self.evictable.remove(&tick);
                if let Some(h) = self.hash_of[id as usize].take() {
                    self.by_hash.remove(&h);
                }
                id
            }
        };
        self.refcount[id as usize] = 1;
        Some(id)
    }

    /// Releases one reference; a block nobody holds becomes cached (if hashed) or free.
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        debug_assert!(
            self.refcount[i] > 0,
            "block {block} released more often than taken"
        );
        self.refcount[i] = self.refcount[i].saturating_sub(1);
        if self.refcount[i] == 0 {
            if self.hash_of[i].is_some() {
                self.tick += 1;
                self.released_at[i] = self.tick;
                self.evictable.insert(self.tick, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Looks a full block up by its chained hash; on a hit the caller holds one more
    /// reference to it. The caller counts the lookup ([`BlockPool::count_lookup`]).
    pub fn lookup(&mut self, hash: u64) -> Option<BlockId> {
        let id = *self.by_hash.get(&hash)?;
        let i = id as usize;
        if self.refcount[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
        }
        self.refcount[i] += 1;
        Some(id)
    }

    /// Counts one sequence's lookup as vLLM counts it: all `queried` tokens of the sequence
    /// asked for, `hit` of them found.
    pub fn count_lookup(&mut self, queried: usize, hit: usize) {
        self.stats.queries += queried as u64;
        self.stats.hits += hit as u64;
    }

    /// Records that `block` (held by the caller) now holds a full block with `hash`, so
    /// later requests with the same prefix can share it. A hash already indexed keeps its
    /// first block.
    pub fn register(&mut self, block: BlockId, hash: u64) {
        if self.by_hash.contains_key(&hash) || self.hash_of[block as usize].is_some() {
            return;
        }
        self.hash_of[block as usize] = Some(hash);
        self.by_hash.insert(hash, block);
    }

    /// Drops every hash: no block can be found by [`BlockPool::lookup`] any more, cached
    /// blocks become free, and used blocks stay with their holders (unhashed, so they are
    /// freed rather than cached when released).
    pub fn forget_hashes(&mut self) {
        self.by_hash.clear();
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.free
            .extend(std::mem::take(&mut self.evictable).into_values());
    }
}

/// The chained hash of a full block: its tokens together with its prefix's hash, so equal
/// blocks after different prefixes never collide.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn free_blocks_are_used_before_cached_ones_are_evicted() {
        let mut pool = BlockPool::new(2, 4);
        let a = pool.allocate().expect("block");
        pool.register(a, 7);
        pool.release(a);
        assert_eq!((pool.num_free(), pool.num_cached()), (1, 1));
        let b = pool.allocate().expect("block");
        assert_ne!(a, b, "the free block is taken first");
        assert_eq!(pool.lookup(7), Some(a), "the cached block is still there");
        pool.release(a);
        pool.release(b);
        let c = pool.allocate().expect("free");
        let d = pool.allocate().expect("evicts");
        assert_eq!((c, d), (b, a));
        assert_eq!(pool.lookup(7), None, "eviction forgot the hash");
        pool.count_lookup(10, 4);
        assert_eq!(
            pool.prefix_stats(),
            PrefixStats {
                queries: 10,
                hits: 4
            }
        );
    }

    #[test]
    fn forgotten_hashes_are_never_found_and_their_blocks_come_back_free() {
        let mut pool = BlockPool::new(3, 4);
        let (a, b) = (pool.allocate().expect("a"), pool.allocate().expect("b"));
        pool.register(a, 1);
        pool.register(b, 2);
        pool.release(a);
        assert_eq!(
            (pool.num_free(), pool.num_cached(), pool.num_used()),
            (1, 1, 1)
        );
        pool.forget_hashes();
        assert_eq!(
            (pool.num_free(), pool.num_cached(), pool.num_used()),
            (2, 0, 1)
        );
        assert_eq!((pool.lookup(1), pool.lookup(2)), (None, None));
        // The held block stays with its holder and is freed, not cached, when released.
        assert_eq!(pool.refcount(b), 1);
        pool.release(b);
        assert_eq!((pool.num_free(), pool.num_cached()), (3, 0));
    }

    #[test]
    fn hashes_chain_over_the_prefix() {
        assert_ne!(block_hash(None, &[1, 2]), block_hash(Some(1), &[1, 2]));
        assert_eq!(block_hash(Some(3), &[1, 2]), block_hash(Some(3), &[1, 2]));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate,
        Release(usize),
        Share(usize),
        Register(usize, u8),
        Lookup(u8),
        Forget,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Allocate),
            3 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::Share),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(i, h)| Op::Register(i, h % 8)),
            2 => any::<u8>().prop_map(|h| Op::Lookup(h % 8)),
            1 => Just(Op::Forget),
        ]
    }

    proptest! {
        #[test]
        fn pool_invariants_hold(ops in proptest::collection::vec(op(), 1..200), n in 1usize..12) {
            let mut pool = BlockPool::new(n, 4);
            // The references the test holds, one entry per reference.
            let mut held: Vec<BlockId> = Vec::new();
            for op in ops {
                match op {
                    Op::Allocate => {
                        if let Some(b) = pool.allocate() {
                            prop_assert!(!held.contains(&b), "block {} handed out while held", b);
                            held.push(b);
                        } else {
                            prop_assert_eq!(pool.num_available(), 0);
                        }
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let b = held.swap_remove(i % held.len());
                        pool.release(b);
                    }
                    Op::Share(i) if !held.is_empty() => {
                        // Sharing is done through the hash index, as requests do.
                        let b = held[i % held.len()];
                        pool.register(b, 100 + u64::from(b));
                        if let Some(s) = pool.lookup(100 + u64::from(b)) {
                            held.push(s);
                        }
                    }
                    Op::Register(i, h) if !held.is_empty() => pool.register(held[i % held.len()], u64::from(h)),
                    Op::Lookup(h) => {
                        if let Some(b) = pool.lookup(u64::from(h)) {
                            held.push(b);
                        }
                    }
                    Op::Forget => {
                        pool.forget_hashes();
                        prop_assert_eq!(pool.num_cached(), 0);
                        for h in 0..8 {
                            prop_assert_eq!(pool.lookup(h), None);
                        }
                    }
                    _ => {}
                }
                prop_assert_eq!(pool.num_free() + pool.num_used() + pool.num_cached(), n);
                for b in 0..n as BlockId {
                    let refs = held.iter().filter(|&&h| h == b).count() as u32;
                    prop_assert_eq!(pool.refcount(b), refs, "refcount of block {}", b);
                }
            }
            for b in held.drain(..) {
                pool.release(b);
            }
            prop_assert_eq!(pool.num_used(), 0);
            prop_assert_eq!(pool.num_free() + pool.num_cached(), n);
        }
    }
}
