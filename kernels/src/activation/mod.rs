//! Element-wise activations with ggml's arithmetic: SiLU through ggml's vectorized `expf`
//! polynomial (not libm), so the MLP of a GGUF model matches llama.cpp bit for bit; with
//! AVX-512, sixteen lanes at a time exactly as ggml computes them.

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512;

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
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = crate::cpu::detect().avx512() {
        return avx512::swiglu(cpu, gate, up);
    }
    swiglu_portable(gate, up);
}

/// [`swiglu`] one element at a time: what the vector version must equal bit for bit.
fn swiglu_portable(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = (x / (1.0 + expf(0.0 - x))) * u;
    }
}

/// The MLP activation of a whole batch: `gate_up` holds each token's gate values followed
/// by its up values (`[tokens, 2 * width]`, one stacked projection); returns
/// `silu(gate) * up` as `[tokens, width]`, rows spread over the threads.
pub fn swiglu_rows(gate_up: &[f32], width: usize) -> crate::buffers::Buf {
    use rayon::prelude::*;
    let tokens = gate_up.len() / (2 * width).max(1);
    let mut out = crate::buffers::Buf::take(tokens * width);
    let rows = super::rows_per_task(width);
    out.par_chunks_mut(rows * width.max(1))
        .zip(gate_up.par_chunks(rows * 2 * width.max(1)))
        .for_each(|(out, gate_up)| {
            for (o, row) in out
                .chunks_exact_mut(width)
                .zip(gate_up.chunks_exact(2 * width))
            {
                let (gate, up) = row.split_at(width);
                o.copy_from_slice(gate);
                swiglu(o, up);
            }
        });
    out
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
    fn the_vector_swiglu_equals_the_scalar_one_bit_for_bit() {
        // Small, ordinary and huge magnitudes of both signs (the clamped exponents too),
        // zeros, and a length that leaves a scalar tail.
        let mut gate: Vec<f32> = (0..40_003)
            .map(|i| {
                let t = (i as f32 - 20_000.0) * 0.0137;
                t * t.abs() * if i % 7 == 0 { 3.0 } else { 0.02 }
            })
            .collect();
        gate.extend([0.0, -0.0, 200.0, -200.0, 1e-30, -1e-30, 89.0, -104.0]);
        let up: Vec<f32> = (0..gate.len())
            .map(|i| (i % 13) as f32 * 0.3 - 1.7)
            .collect();
        let (mut fast, mut slow) = (gate.clone(), gate);
        swiglu(&mut fast, &up);
        swiglu_portable(&mut slow, &up);
        for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "element {i}");
        }
    }

    #[test]
    fn swiglu_rows_takes_each_rows_gate_then_up() {
        let width = 5;
        let gate_up: Vec<f32> = (0..3 * 2 * width).map(|i| i as f32 * 0.1 - 1.0).collect();
        let out = swiglu_rows(&gate_up, width);
        for (row, o) in gate_up.chunks(2 * width).zip(out.chunks(width)) {
            let mut want = row[..width].to_vec();
            swiglu_portable(&mut want, &row[width..]);
            assert_eq!(o, &want[..]);
        }
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
