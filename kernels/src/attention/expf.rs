//! The constants of glibc's `expf` (2.28 and later, the variant it picks on CPUs with
//! FMA): a 32-entry table of `2^(i/32)`, a cubic polynomial in double precision and the
//! bounds of its special cases. The vector head kernels compute `expf` from them with the
//! same operations as glibc, so every lane equals what libm returns (which llama.cpp's
//! softmax calls) bit for bit.

/// `32 / ln 2`.
pub(super) const INV_LN2_N: u64 = 0x40471547652b82fe;
/// `1.5 · 2^52`: adding it rounds to an integer held in the low mantissa bits.
pub(super) const SHIFT: u64 = 0x4338000000000000;
/// The polynomial's coefficients of `r^3`, `r^2` and `r`.
pub(super) const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];
/// `2^(i/32)` with `i << 47` subtracted from its bits.
pub(super) const T: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// Above this (`log 2^128`) the result overflows to infinity.
pub(super) const OVERFLOW: u32 = 0x42b17217;
/// Below this (`log 2^-150`) the result is zero.
pub(super) const UNDERFLOW: u32 = 0xc2cff1b4;
/// Below this (`log 2^-149`) and not below [`UNDERFLOW`], the smallest subnormal.
pub(super) const MAY_UNDERFLOW: u32 = 0xc2ce8ecf;
