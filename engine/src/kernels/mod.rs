//! CPU kernels of our own, where candle's generic ops are too slow or round differently.

pub mod activation;
pub mod attention;
pub mod quant;
