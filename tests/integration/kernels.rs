//! Ops against hand-derived values, and their error messages (the f64 references of every
//! op, on every backend, are in `conformance.rs`).

use kernels::{ops, Tensor};

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn matmul_rejects_mismatched_inner_dims() {
    let e = ops::matmul_t(&t(&[0.0; 6], &[2, 3]), &t(&[0.0; 8], &[2, 4]), None).unwrap_err();
    assert!(e.to_string().contains("x is [2, 3] but w is [2, 4]"), "{e}");
}

#[test]
fn rms_norm_hand_values() {
    // x = [3, 4]: mean(x²) = 12.5, 1/sqrt(12.5) = 0.28284271; w = [1, 2].
    let y = ops::rms_norm(&t(&[3.0, 4.0], &[1, 2]), &t(&[1.0, 2.0], &[2]), 0.0).unwrap();
    assert_close(y.as_slice().unwrap(), &[0.848528137423857, 2.262741699796952], 1e-6, "rms_norm");
}

#[test]
fn rope_rotates_half_pairs() {
    // head_dim 4: pairs (0, 2) and (1, 3). Position 1 has angles (π/2, 0).
    let cos = t(&[1.0, 1.0, 0.0, 1.0], &[2, 2]);
    let sin = t(&[0.0, 0.0, 1.0, 0.0], &[2, 2]);
    let mut x = t(&[1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0], &[2, 4]);
    ops::rope_inplace(&mut x, &[0, 1], &cos, &sin, 4).unwrap();
    // Row 0 (position 0) unchanged; row 1: (1, 3) → (1·0 − 3·1, 3·0 + 1·1) = (−3, 1); (2, 4) unchanged.
    assert_close(x.as_slice().unwrap(), &[1.0, 2.0, 3.0, 4.0, -3.0, 2.0, 1.0, 4.0], 1e-7, "rope");
    let e = ops::rope_inplace(&mut x, &[0, 2], &cos, &sin, 4).unwrap_err();
    assert!(e.to_string().contains("position 2 beyond table of 2"), "{e}");
}

#[test]
fn silu_mul_hand_values() {
    // silu(0) = 0, silu(1) = 1/(1+e⁻¹) = 0.7310585786, silu(−2) = −2/(1+e²) = −0.2384058440.
    let y = ops::silu_mul(&t(&[0.0, 1.0, -2.0, 5.0, 2.0, 3.0], &[1, 6])).unwrap();
    assert_close(y.as_slice().unwrap(), &[0.0, 1.4621171572600098, -0.7152175321], 1e-6, "silu_mul");
}

#[test]
fn softmax_and_log_softmax_hand_values() {
    let x = t(&[1.0, 2.0, 3.0, 1000.0, 1000.0, 1000.0], &[2, 3]);
    let s = ops::softmax(&x).unwrap();
    let third = 1.0 / 3.0;
    assert_close(
        s.as_slice().unwrap(),
        &[0.09003057317038046, 0.24472847105479767, 0.6652409557748219, third, third, third],
        1e-6,
        "softmax",
    );
    let l = ops::log_softmax(&x).unwrap();
    let lt = third.ln();
    assert_close(
        l.as_slice().unwrap(),
        &[-2.40760596444438, -1.40760596444438, -0.40760596444438, lt, lt, lt],
        1e-6,
        "log_softmax",
    );
}

#[test]
fn attention_hand_values() {
    // One head, d = 2, q = [1, 0], keys [1, 0], [0, 1], values [1, 2], [3, 4].
    // scores (1/√2, 0) → p0 = 1/(1+e^(−1/√2)); out = p0·[1, 2] + (1−p0)·[3, 4].
    let p0 = 1.0 / (1.0 + (-(0.5f64).sqrt()).exp());
    let k = t(&[1.0, 0.0, 0.0, 1.0], &[2, 2]);
    let v = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let o = ops::attention(&t(&[1.0, 0.0], &[1, 2]), &k, &v, 1, 1, 1, 2).unwrap();
    assert_close(o.as_slice().unwrap(), &[p0 + 3.0 * (1.0 - p0), 2.0 * p0 + 4.0 * (1.0 - p0)], 1e-6, "attention");
    // Causality: the same query at position 0 sees only the first key.
    let o = ops::attention(&t(&[1.0, 0.0], &[1, 2]), &k, &v, 0, 1, 1, 2).unwrap();
    assert_close(o.as_slice().unwrap(), &[1.0, 2.0], 1e-7, "attention causal");
}

#[test]
fn embedding_gathers_rows_and_rejects_bad_ids() {
    let table = t(&[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]);
    let e = ops::embedding(&table, &[2, 0, 2]).unwrap();
    assert_eq!(e.as_slice().unwrap(), &[20.0, 21.0, 0.0, 1.0, 20.0, 21.0]);
    let err = ops::embedding(&table, &[1, 3]).unwrap_err();
    assert!(err.to_string().contains("token id 3 >= vocab size 3"), "{err}");
}

/// The input gradient reads the packed weight itself, so it sees every update: after
/// `w ← s·w + Δ` (prepared in Δ's buffer, committed by a swap), `dy · W` is bitwise what a
/// freshly packed updated weight gives, and by hand on a 2 × 3 weight.
#[test]
fn the_input_gradient_sees_every_update_of_the_weight() {
    let w0 = [1.0, 2.0, 3.0, -1.0, 0.5, 0.0];
    let mut w = ops::pack_weight(&t(&w0, &[2, 3])).unwrap();
    let dy = t(&[1.0, 2.0, -1.0, 0.5], &[2, 2]);
    // dx = dy · W: [1·1 + 2·(−1), 1·2 + 2·0.5, 1·3 + 0] and [−1 + −0.5, −2 + 0.25, −3 + 0].
    let dx = ops::linear_grad_input(&dy, &w).unwrap();
    assert_close(dx.as_slice().unwrap(), &[-1.0, 3.0, 3.0, -1.5, -1.75, -3.0], 0.0, "dx before");
    let step = [0.5, 0.0, -1.0, 1.0, 0.0, 2.0];
    for update in 1..=2 {
        let mut d = ops::pack_weight(&t(&step, &[2, 3])).unwrap();
        ops::scale_add_packed_into(&w, 2.0, &mut d).unwrap();
        ops::commit_packed(&mut w, &mut d, false).unwrap();
        let fresh = ops::pack_weight(&ops::unpack_weight(&w).unwrap()).unwrap();
        let (got, want) = (ops::linear_grad_input(&dy, &w).unwrap(), ops::linear_grad_input(&dy, &fresh).unwrap());
        assert_eq!(got.as_slice().unwrap(), want.as_slice().unwrap(), "after update {update}");
    }
    // Two updates w ← 2w + Δ: W = 4·W0 + 3·Δ, and dx = dy · W by hand:
    // W = [5.5, 8, 9; −1, 2, 6], dx = [5.5 − 2, 8 + 4, 9 + 12; −5.5 − 0.5, −8 + 1, −9 + 3].
    let want: Vec<f64> = w0.iter().zip(&step).map(|(a, b)| 4.0 * *a as f64 + 3.0 * *b as f64).collect();
    assert_close(ops::unpack_weight(&w).unwrap().as_slice().unwrap(), &want, 0.0, "W after two updates");
    let dx = ops::linear_grad_input(&dy, &w).unwrap();
    assert_close(dx.as_slice().unwrap(), &[3.5, 12.0, 21.0, -6.0, -7.0, -6.0], 0.0, "dx after two updates");
}
