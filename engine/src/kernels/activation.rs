//! Element-wise activations with ggml's arithmetic: SiLU through ggml's vectorized `expf`
//! polynomial (not libm), so the MLP of a GGUF model matches llama.cpp bit for bit.

/// ggml's `ggml_v_expf` (the AVX-512 version), one lane at a time.
pub fn expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000);
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    scale_by_pow2(j, n as i32)
}

/// `j * 2^n` as `vscalefps` computes it for the exponents `expf` produces.
fn scale_by_pow2(j: f32, n: i32) -> f32 {
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    match n {
        -126..=127 => j * pow2(n),
        128.. => j * pow2(127) * pow2(n - 127),
        _ => j * pow2(-126) * pow2(n + 126),
    }
}

/// `silu(gate) * up`, element by element, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = (x / (1.0 + expf(0.0 - x))) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_within_two_ulps_of_libm() {
        for i in -8000..8000 {
            let x = i as f32 * 0.01;
            let (a, b) = (expf(x), x.exp());
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b, "{x}: {a} vs {b}");
        }
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
    }

    #[test]
    fn swiglu_is_silu_times_up() {
        let mut g = vec![-2.0f32, 0.0, 3.0];
        swiglu(&mut g, &[1.0, 5.0, 2.0]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        for (got, want) in g.iter().zip([silu(-2.0), 0.0, silu(3.0) * 2.0]) {
            assert!((got - want).abs() < 1e-5);
        }
    }
}
