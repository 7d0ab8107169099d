//! ggml's AVX-512 `ggml_v_expf` and `ggml_v_silu`, sixteen lanes at a time.

use std::arch::x86_64::*;

use crate::cpu::Avx512;

/// [`super::swiglu`] sixteen values at a time, the tail one at a time.
pub(super) fn swiglu(cpu: Avx512, gate: &mut [f32], up: &[f32]) {
    let _ = cpu;
    // SAFETY: `cpu` proves AVX-512 F.
    unsafe { swiglu_avx512(gate, up) }
}

#[target_feature(enable = "avx512f")]
fn swiglu_avx512(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let whole = n / 16 * 16;
    let one = _mm512_set1_ps(1.0);
    for (g, u) in gate[..whole]
        .chunks_exact_mut(16)
        .zip(up[..whole].chunks_exact(16))
    {
        // SAFETY: `g` and `u` are sixteen f32 each: unaligned loads and a store.
        unsafe {
            let x = _mm512_loadu_ps(g.as_ptr());
            let e = expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
            _mm512_storeu_ps(
                g.as_mut_ptr(),
                _mm512_mul_ps(silu, _mm512_loadu_ps(u.as_ptr())),
            );
        }
    }
    super::swiglu_portable(&mut gate[whole..n], &up[whole..n]);
}

/// `ggml_v_expf`: the same constants and operations as [`super::expf`].
#[inline]
#[target_feature(enable = "avx512f")]
fn expf(x: __m512) -> __m512 {
    let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
    let huge = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if huge == 0 {
        return res;
    }
    let negative = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(negative, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(huge, res, alt)
}
