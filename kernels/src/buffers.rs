//! Activation buffers recycled from one layer and step to the next, so a forward pass writes
//! into memory the process already has mapped instead of fresh pages the OS must fault in
//! and zero (a 2048-token prefill's gate/up output alone is 25 MB per layer; glibc often
//! hands buffers that large back to the OS when they are freed). What the pool keeps is
//! about one layer's intermediates of the largest step, which the KV budget already sets
//! aside.

use std::sync::{Mutex, MutexGuard};

/// Buffers shorter than this (in f32) come from and go back to the allocator: its own free
/// lists already keep them mapped.
const MIN_POOLED: usize = 1 << 14;

/// Most buffers the pool keeps: a layer of a forward pass holds about this many at once.
const MAX_KEPT: usize = 12;

/// Spare f32 buffers, handed out best fit first.
#[derive(Debug, Default)]
pub struct Pool {
    kept: Mutex<Vec<Vec<f32>>>,
}

/// The process's pool, whichever thread runs a step's forward pass; a few dozen takes per
/// layer make its lock's cost nothing beside the layer's.
static POOL: Pool = Pool::new();

impl Pool {
    /// An empty pool.
    pub const fn new() -> Self {
        Pool {
            kept: Mutex::new(Vec::new()),
        }
    }

    /// The kept buffers, even if a thread panicked holding them (a list of spare buffers
    /// has no invariant to break).
    fn kept(&self) -> MutexGuard<'_, Vec<Vec<f32>>> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A vector of `len` f32 for the caller to overwrite whole: its values are whatever the
    /// recycled buffer held (zeros where it grew), so every element must be written before
    /// it is read. Takes the smallest kept buffer that holds `len`, else allocates.
    pub fn take(&self, len: usize) -> Vec<f32> {
        let mut v = if len < MIN_POOLED {
            None
        } else {
            let mut kept = self.kept();
            let best = (0..kept.len())
                .filter(|&i| kept[i].capacity() >= len)
                .min_by_key(|&i| kept[i].capacity());
            best.map(|i| kept.swap_remove(i))
        }
        .unwrap_or_default();
        if v.len() > len {
            v.truncate(len);
        } else {
            v.resize(len, 0.0);
        }
        v
    }

    /// Keeps `v` for [`Pool::take`]; past [`MAX_KEPT`] buffers, the smallest of them all is
    /// freed.
    pub fn recycle(&self, v: Vec<f32>) {
        if v.capacity() < MIN_POOLED {
            return;
        }
        let mut kept = self.kept();
        kept.push(v);
        if kept.len() > MAX_KEPT {
            if let Some(smallest) = (0..kept.len()).min_by_key(|&i| kept[i].capacity()) {
                kept.swap_remove(smallest);
            }
        }
    }
}

/// An f32 buffer from the process's pool that goes back to it when dropped, so no path
/// through a forward pass can forget to return its intermediates.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Buf(Vec<f32>);

impl Buf {
    /// `len` values for the caller to overwrite whole ([`Pool::take`]: their contents are
    /// whatever the recycled buffer held).
    pub fn take(len: usize) -> Self {
        Buf(POOL.take(len))
    }

    /// A buffer holding `v`'s values, returned to the pool when dropped.
    pub fn from_vec(v: Vec<f32>) -> Self {
        Buf(v)
    }

    /// The values, taken out of the pool's care.
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.0)
    }
}

impl std::ops::Deref for Buf {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl FromIterator<f32> for Buf {
    fn from_iter<I: IntoIterator<Item = f32>>(iter: I) -> Self {
        Buf(iter.into_iter().collect())
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        POOL.recycle(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacities(pool: &Pool) -> Vec<usize> {
        let mut caps: Vec<usize> = pool.kept().iter().map(Vec::capacity).collect();
        caps.sort_unstable();
        caps
    }

    #[test]
    fn a_recycled_buffer_comes_back_at_the_length_asked_for() {
        let pool = Pool::new();
        let mut v = pool.take(MIN_POOLED * 2);
        v.fill(7.0);
        let at = v.as_ptr();
        pool.recycle(v);
        let w = pool.take(MIN_POOLED + 5);
        assert_eq!(w.len(), MIN_POOLED + 5);
        assert_eq!(w.as_ptr(), at, "the recycled buffer was not reused");
        pool.recycle(w);
        // Longer than the buffer last was, within its capacity: the same memory, the part
        // past its last length zero.
        let x = pool.take(MIN_POOLED * 2);
        assert_eq!((x.as_ptr(), x.len()), (at, MIN_POOLED * 2));
        assert!(x[MIN_POOLED + 5..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn the_best_fit_is_taken_and_the_smallest_dropped_past_the_limit() {
        let pool = Pool::new();
        let bufs: Vec<Vec<f32>> = (1..=MAX_KEPT + 3)
            .map(|i| pool.take(MIN_POOLED * i))
            .collect();
        bufs.into_iter().for_each(|b| pool.recycle(b));
        let caps = capacities(&pool);
        assert_eq!(caps.len(), MAX_KEPT);
        assert!(
            caps[0] >= MIN_POOLED * 4,
            "kept a buffer it should have freed"
        );
        let v = pool.take(MIN_POOLED * 5 + 1);
        assert!(v.capacity() >= MIN_POOLED * 6 && v.capacity() < MIN_POOLED * 7);
    }

    #[test]
    fn a_dropped_buf_is_taken_again() {
        let b = Buf::take(MIN_POOLED * 3 + 1);
        let at = b.as_ptr();
        drop(b);
        let again = Buf::take(MIN_POOLED * 3);
        assert_eq!(again.as_ptr(), at, "the dropped buffer was not reused");
        assert_eq!(again.len(), MIN_POOLED * 3);
    }

    #[test]
    fn small_buffers_bypass_the_pool() {
        let pool = Pool::new();
        pool.recycle(vec![0.0; 16]);
        assert!(capacities(&pool).is_empty());
        assert_eq!(pool.take(16).len(), 16);
    }
}
