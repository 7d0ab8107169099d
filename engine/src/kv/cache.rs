//! KV storage in blocks: per layer one buffer of `num_blocks * block_size` rows for K and
//! one for V. New keys and values are written through the slot mapping
//! (`slot = table[pos / block_size] * block_size + pos % block_size`) and attention reads
//! them through the sequence's block table — a sequence's cache is never copied.

use candle_core::Tensor;

use super::block_pool::BlockId;
use crate::error::{Error, Result};
use crate::kernels::attention::{paged_attention, HeadShape, KvBlocks, KvElement};
use crate::model::llama::{to_f32_vec, KvCache, KvDtype, Llama, SeqSlice};

/// A paged cache whose block tables are set for each step; `SeqSlice::cache_slot` indexes
/// the tables.
pub trait PagedCache: KvCache + Send {
    /// The block tables of this step's sequences, in `cache_slot` order.
    fn set_tables(&mut self, tables: Vec<Vec<BlockId>>);
}

/// Paged storage for `model` in the element type `dtype` resolves to.
pub fn new_paged(model: &Llama, dtype: KvDtype, block_size: usize) -> Box<dyn PagedCache> {
    let c = model.config();
    let width = c.num_kv_heads * c.head_dim;
    let f16 = match dtype {
        KvDtype::F16 => true,
        KvDtype::F32 => false,
        KvDtype::Auto => model.kv_prefers_f16(),
    };
    if f16 {
        Box::new(PagedKv::<half::f16>::new(block_size, c.num_layers, width))
    } else {
        Box::new(PagedKv::<f32>::new(block_size, c.num_layers, width))
    }
}

/// One sequence's paged cache whose block table grows as its tokens arrive — for
/// single-request generation and tests, without a pool or scheduler.
pub struct SingleSequence {
    cache: Box<dyn PagedCache>,
    block_size: usize,
    blocks: usize,
}

impl SingleSequence {
    /// An empty cache for one sequence of `model`.
    pub fn new(model: &Llama, dtype: KvDtype) -> Self {
        const BLOCK: usize = 16;
        SingleSequence {
            cache: new_paged(model, dtype, BLOCK),
            block_size: BLOCK,
            blocks: 0,
        }
    }
}

impl KvCache for SingleSequence {
    fn attend(
        &mut self,
        layer: usize,
        seq: &SeqSlice,
        positions: &[usize],
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let need = positions
            .iter()
            .max()
            .map_or(0, |p| p / self.block_size + 1);
        if need > self.blocks {
            self.blocks = need;
            self.cache.set_tables(vec![(0..need as BlockId).collect()]);
        }
        self.cache.attend(
            layer,
            &SeqSlice {
                cache_slot: 0,
                ..*seq
            },
            positions,
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
    width: usize,
    layers: Vec<(Vec<T>, Vec<T>)>,
    tables: Vec<Vec<BlockId>>,
}

impl<T: KvElement> PagedKv<T> {
    /// Storage for blocks of `block_size` tokens in each of `layers` layers, each token
    /// `kv_heads * head_dim` keys and as many values. Buffers grow to the highest block id
    /// written (the pool hands out low ids first), so memory follows peak use rather than
    /// the pool's size.
    pub fn new(block_size: usize, layers: usize, width: usize) -> Self {
        PagedKv {
            block_size,
            width,
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

impl<T: KvElement> KvCache for PagedKv<T> {
    fn attend(
        &mut self,
        layer: usize,
        seq: &SeqSlice,
        positions: &[usize],
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (len, heads, head_dim) = q.dims3()?;
        let (bs, width) = (self.block_size, self.width);
        let table = self
            .tables
            .get(seq.cache_slot)
            .ok_or_else(|| Error::InvalidParameter(format!("no block table {}", seq.cache_slot)))?;
        let last = positions.iter().max().copied().unwrap_or(0);
        if table.len() * bs <= last {
            return Err(Error::InvalidParameter(format!(
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
        let (kd, vd) = (to_f32_vec(k)?, to_f32_vec(v)?);
        for (i, &pos) in positions.iter().enumerate() {
            let slot = table[pos / bs] as usize * bs + pos % bs;
            for (dst, &x) in ck[slot * width..(slot + 1) * width]
                .iter_mut()
                .zip(&kd[i * width..])
            {
                *dst = T::from_f32(x);
            }
            for (dst, &x) in cv[slot * width..(slot + 1) * width]
                .iter_mut()
                .zip(&vd[i * width..])
            {
                *dst = T::from_f32(x);
            }
        }
        let used = last / bs + 1;
        let span = |id: BlockId| id as usize * bs * width..(id as usize + 1) * bs * width;
        let kb: Vec<&[T]> = table[..used].iter().map(|&id| &ck[span(id)]).collect();
        let vb: Vec<&[T]> = table[..used].iter().map(|&id| &cv[span(id)]).collect();
        let mut out = vec![0f32; len * heads * head_dim];
        paged_attention(
            &to_f32_vec(q)?,
            positions,
            KvBlocks {
                blocks: &kb,
                block_size: bs,
            },
            KvBlocks {
                blocks: &vb,
                block_size: bs,
            },
            HeadShape {
                heads,
                kv_heads: width / head_dim,
                head_dim,
            },
            &mut out,
        );
        Ok(Tensor::from_vec(out, (len, heads * head_dim), q.device())?)
    }
}
