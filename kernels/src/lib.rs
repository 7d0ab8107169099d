//! Ferrite's CPU kernels, where candle's generic ops are too slow or round differently:
//! quantized products, paged attention, activations, the memory they run in and the memory
//! tensor-parallel ranks share. Every
//! `unsafe` line of the workspace lives in this crate, in one file per instruction set,
//! behind the run-time tokens of [`cpu`]; the crates above it forbid `unsafe` code.

pub mod activation;
pub mod attention;
pub mod buffers;
pub mod cpu;
#[cfg(target_arch = "x86_64")]
mod fold;
#[allow(unsafe_code)]
pub mod hugepages;
pub mod quant;
#[allow(unsafe_code)]
pub mod shm;

/// Rows each parallel task takes in row-by-row work on rows of `len` values: enough for
/// about 32k values (below that, waking another thread costs more than it saves), at least
/// one.
pub fn rows_per_task(len: usize) -> usize {
    (1usize << 15).div_ceil(len.max(1))
}
