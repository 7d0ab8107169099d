//! CPU kernels of our own, where candle's generic ops are too slow or round differently.

pub mod activation;
pub mod attention;
pub mod buffers;
#[cfg(target_arch = "x86_64")]
mod fold;
#[allow(unsafe_code)]
pub mod hugepages;
pub mod quant;

/// Rows each parallel task takes in row-by-row work on rows of `len` values: enough for
/// about 32k values (below that, waking another thread costs more than it saves), at least
/// one.
pub(crate) fn rows_per_task(len: usize) -> usize {
    (1usize << 15).div_ceil(len.max(1))
}
