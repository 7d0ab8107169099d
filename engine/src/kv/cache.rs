//! KV storage in blocks: per layer one buffer of `num_blocks` blocks for K and one for V,
//! each block `block_size` positions of every KV head, head by head (so attention over one
//! head reads consecutive memory). New keys and values are written through the slot mapping
//! (block `table[pos / block_size]`, position `pos % block_size` within it) and attention
//! reads them through the sequence's block table — a sequence's cache is never copied.

use super::block_pool::BlockId;
use crate::error::{Error, Result};
use ferrite_kernels::attention::{
    head_row, paged_attention_batch, HeadShape, KvBlocks, KvElement, SeqKv,
};
use ferrite_kernels::buffers::Buf;

use super::{KvDtype, KvElementType};
use crate::model::llama::{Batch, KvCache, Llama, Logits, SeqSlice};

/// A paged cache whose block tables are set for each step; `SeqSlice::cache_slot` indexes
/// the tables.
pub trait PagedCache: KvCache + Send {
    /// The block tables of this step's sequences, in `cache_slot` order.
    fn set_tables(&mut self, tables: Vec<Vec<BlockId>>);
}

/// Paged storage for `model` in elements of `element`.
pub fn new_paged(model: &Llama, element: KvElementType, block_size: usize) -> Box<dyn PagedCache> {
    let c = model.local_config();
    if element == KvElementType::F16 {
        Box::new(PagedKv::<half::f16>::new(
            block_size,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        ))
    } else {
        Box::new(PagedKv::<f32>::new(
            block_size,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        ))
    }
}

/// One sequence's paged cache whose block table grows as its tokens arrive — for
/// single-request generation and tests, without a pool or scheduler.
pub struct SingleSequence {
    cache: Box<dyn PagedCache>,
    block_size: usize,
    blocks: usize,
    /// Tokens the sequence holds: the next one goes to this position.
    len: usize,
}

impl SingleSequence {
    /// An empty cache for one sequence of `model`.
    pub fn new(model: &Llama, dtype: KvDtype) -> Self {
        const BLOCK: usize = 16;
        SingleSequence {
            cache: new_paged(model, dtype.resolve(model), BLOCK),
            block_size: BLOCK,
            blocks: 0,
            len: 0,
        }
    }

    /// Appends `tokens` to the sequence through `model` (a prefill, or a decode step of one
    /// token) and returns the logits of the last of them (one row).
    pub fn forward(&mut self, model: &Llama, tokens: &[u32]) -> Result<Logits> {
        self.append(model, tokens, false)
    }

    /// [`SingleSequence::forward`] returning the logits of every token (a row each).
    pub fn forward_all(&mut self, model: &Llama, tokens: &[u32]) -> Result<Logits> {
        self.append(model, tokens, true)
    }

    fn append(&mut self, model: &Llama, tokens: &[u32], all: bool) -> Result<Logits> {
        let positions: Vec<usize> = (self.len..self.len + tokens.len()).collect();
        let seqs = [SeqSlice {
            start: 0,
            len: tokens.len(),
            cache_slot: 0,
        }];
        let batch = Batch {
            tokens,
            positions: &positions,
            seqs: &seqs,
        };
        let rows: Vec<u32> = match all {
            true => (0..tokens.len() as u32).collect(),
            false => vec![tokens.len().saturating_sub(1) as u32],
        };
        let logits = model.forward(&batch, self, &rows)?;
        self.len += tokens.len();
        Ok(logits)
    }
}

impl KvCache for SingleSequence {
    fn attend(
        &mut self,
        layer: usize,
        batch: &Batch<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<Buf> {
        let [seq] = batch.seqs else {
            return Err(Error::internal(format!(
                "a single-sequence cache takes batches of one sequence, got {}",
                batch.seqs.len()
            )));
        };
        let need = batch
            .positions
            .iter()
            .max()
            .map_or(0, |p| p / self.block_size + 1);
        if need > self.blocks {
            self.blocks = need;
            self.cache.set_tables(vec![(0..need as BlockId).collect()]);
        }
        let seqs = [SeqSlice {
            cache_slot: 0,
            ..*seq
        }];
        self.cache.attend(
            layer,
            &Batch {
                seqs: &seqs,
                ..*batch
            },
            q,
            k,
            v,
        )
    }
}

/// Block storage for every layer, in element type `T`.
#[derive(Debug)]
pub struct PagedKv<T> {
    block_size: usize,
    head_dim: usize,
    /// Values per token: every KV head's.
    width: usize,
    layers: Vec<(Vec<T>, Vec<T>)>,
    tables: Vec<Vec<BlockId>>,
}

impl<T: KvElement> PagedKv<T> {
    /// Storage for blocks of `block_size` tokens in each of `layers` layers, each token
    /// `kv_heads * head_dim` keys and as many values. Buffers grow to the highest block id
    /// written (the pool hands out low ids first), so memory follows peak use rather than
    /// the pool's size.
    pub fn new(block_size: usize, layers: usize, kv_heads: usize, head_dim: usize) -> Self {
        PagedKv {
            block_size,
            head_dim,
            width: kv_heads * head_dim,
            layers: (0..layers).map(|_| (Vec::new(), Vec::new())).collect(),
            tables: Vec::new(),
        }
    }
}

impl<T: KvElement> PagedCache for PagedKv<T> {
    fn set_tables(&mut self, tables: Vec<Vec<BlockId>>) {
        self.tables = tables;
    }
}

impl<T: KvElement> PagedKv<T> {
    /// Writes the new keys and values (`[len, width]` rows, f32) of `seq` at `positions`
    /// through its block table; returns how many of its blocks attention must read.
    fn store(
        &mut self,
        layer: usize,
        seq: &SeqSlice,
        positions: &[usize],
        kd: &[f32],
        vd: &[f32],
    ) -> Result<usize> {
        let (bs, width, d) = (self.block_size, self.width, self.head_dim);
        let table = self
            .tables
            .get(seq.cache_slot)
            .ok_or_else(|| Error::internal(format!("no block table {}", seq.cache_slot)))?;
        let last = positions.iter().max().copied().unwrap_or(0);
        if table.len() * bs <= last {
            return Err(Error::internal(format!(
                "position {last} is beyond the {} blocks of sequence slot {}",
                table.len(),
                seq.cache_slot
            )));
        }
        let (ck, cv) = &mut self.layers[layer];
        let highest = table.iter().max().map_or(0, |&b| b as usize + 1);
        if ck.len() < highest * bs * width {
            ck.resize(highest * bs * width, T::default());
            cv.resize(highest * bs * width, T::default());
        }
        for (i, &pos) in positions.iter().enumerate() {
            let block = table[pos / bs] as usize * bs * width;
            for (cache, new) in [(&mut *ck, kd), (&mut *cv, vd)] {
                let row = &new[i * width..(i + 1) * width];
                for (head, part) in row.chunks_exact(d).enumerate() {
                    let at = block + head_row(bs, d, head, pos % bs);
                    T::narrow(part, &mut cache[at..at + d]);
                }
            }
        }
        Ok(last / bs + 1)
    }
}

impl<T: KvElement> KvCache for PagedKv<T> {
    fn attend(
        &mut self,
        layer: usize,
        batch: &Batch<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<Buf> {
        let (bs, width, head_dim) = (self.block_size, self.width, self.head_dim);
        let len = batch.tokens.len();
        let heads = q.len() / (len * head_dim).max(1);
        if q.len() != len * heads * head_dim || k.len() != len * width || v.len() != k.len() {
            return Err(Error::internal(format!(
                "attention of {len} tokens needs whole heads of {head_dim} queries and \
                 {width} keys and values per token, got {}, {} and {} values",
                q.len(),
                k.len(),
                v.len()
            )));
        }
        let mut used = Vec::with_capacity(batch.seqs.len());
        for s in batch.seqs {
            let rows = s.start * width..(s.start + s.len) * width;
            let positions = &batch.positions[s.start..s.start + s.len];
            used.push(self.store(layer, s, positions, &k[rows.clone()], &v[rows])?);
        }
        let (ck, cv) = &self.layers[layer];
        // Each sequence's block slices, then the views over them the kernel reads.
        let tables: Vec<&[BlockId]> = batch
            .seqs
            .iter()
            .zip(&used)
            .map(|(s, &used)| &self.tables[s.cache_slot][..used])
            .collect();
        /// Every table's blocks as slices of `buf` (`block` elements each).
        fn slices<'b, T>(buf: &'b [T], tables: &[&[BlockId]], block: usize) -> Vec<Vec<&'b [T]>> {
            let span = |id: BlockId| id as usize * block..(id as usize + 1) * block;
            tables
                .iter()
                .map(|t| t.iter().map(|&id| &buf[span(id)]).collect())
                .collect()
        }
        let (kb, vb) = (
            slices(ck, &tables, bs * width),
            slices(cv, &tables, bs * width),
        );
        let kv: Vec<SeqKv<'_, T>> = kb
            .iter()
            .zip(&vb)
            .zip(batch.seqs)
            .map(|((kb, vb), s)| SeqKv {
                keys: KvBlocks {
                    blocks: kb,
                    block_size: bs,
                },
                values: KvBlocks {
                    blocks: vb,
                    block_size: bs,
                },
                tokens: s.len,
            })
            .collect();
        let mut out = Buf::take(len * heads * head_dim);
        paged_attention_batch(
            q,
            batch.positions,
            &kv,
            HeadShape {
                heads,
                kv_heads: width / head_dim,
                head_dim,
            },
            &mut out,
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-layer f32 cache of blocks of 4 positions, 2 KV heads of 8 values, whose only
    /// sequence owns blocks `table`.
    fn cache(table: Vec<BlockId>) -> PagedKv<f32> {
        let mut kv = PagedKv::<f32>::new(4, 1, 2, 8);
        kv.set_tables(vec![table]);
        kv
    }

    #[test]
    fn each_query_head_reads_its_own_kv_heads_values_across_blocks() {
        // 6 tokens of one sequence over blocks 3 and 1 (not in id order), 4 query heads on
        // 2 KV heads. Zero queries weigh every position alike, so token t's output for a head
        // is the mean of its KV head's value rows 0..=t, summed in position order.
        let mut kv = cache(vec![3, 1]);
        let (n, width) = (6, 16);
        let tokens = vec![0u32; n];
        let positions: Vec<usize> = (0..n).collect();
        let seqs = [SeqSlice {
            start: 0,
            len: n,
            cache_slot: 0,
        }];
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            seqs: &seqs,
        };
        let k = vec![0.5f32; n * width];
        let v: Vec<f32> = (0..n * width).map(|i| i as f32 * 0.25 - 3.0).collect();
        let q = vec![0f32; n * 4 * 8];
        let out = kv.attend(0, &batch, &q, &k, &v).expect("sizes agree");
        for t in 0..n {
            for head in 0..4 {
                let kv_head = head / 2;
                let mut acc = [0f32; 8];
                for p in 0..=t {
                    let row = &v[p * width + kv_head * 8..p * width + (kv_head + 1) * 8];
                    acc.iter_mut()
                        .zip(row)
                        .for_each(|(a, &x)| *a = x.mul_add(1.0, *a));
                }
                let inv = 1.0 / (t + 1) as f32;
                let want: Vec<f32> = acc.iter().map(|a| a * inv).collect();
                let at = (t * 4 + head) * 8;
                assert_eq!(out[at..at + 8], want[..], "token {t}, head {head}");
            }
        }
    }

    #[test]
    fn a_batch_whose_sizes_disagree_is_refused_with_the_counts() {
        let mut kv = cache(vec![0]);
        let seqs = [SeqSlice {
            start: 0,
            len: 1,
            cache_slot: 0,
        }];
        let batch = Batch {
            tokens: &[0],
            positions: &[0],
            seqs: &seqs,
        };
        let (q, k, v) = (vec![0f32; 32], vec![0f32; 16], vec![0f32; 15]);
        let err = kv
            .attend(0, &batch, &q, &k, &v)
            .expect_err("15 values refused");
        assert!(err.to_string().contains("got 32, 16 and 15"), "{err}");
    }
}
