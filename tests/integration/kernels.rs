//! CPU ops against hand-derived values and f64 loops.

use kernels::{ops, Tensor};

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

/// Deterministic values in [-1, 1).
fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 8) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn matmul_matches_f64_loops() {
    // (m, n, k): GEMV path (m = 1), gemm path, and lengths that are not multiples of 8/32.
    let check = |m: usize, n: usize, k: usize| {
        let (x, w, b) = (vals(m * k, 1), vals(n * k, 2), vals(n, 3));
        let want: Vec<f64> = (0..m * n)
            .map(|idx| {
                (0..k).map(|l| x[idx / n * k + l] as f64 * w[idx % n * k + l] as f64).sum::<f64>() + b[idx % n] as f64
            })
            .collect();
        let y = ops::matmul_t(&t(&x, &[m, k]), &t(&w, &[n, k]), Some(&t(&b, &[n]))).unwrap();
        assert_eq!(y.shape(), &[m, n]);
        assert_close(y.as_slice().unwrap(), &want, 1e-5, &format!("matmul {m}x{n}x{k}"));
    };
    check(1, 1, 1);
    check(1, 70, 37);
    check(1, 576, 1536);
    check(2, 3, 5);
    check(17, 33, 64);
    check(64, 100, 129);
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
fn attention_gqa_matches_f64_loops() {
    let (t_q, past, h, kvh, d) = (3, 4, 4, 2, 8);
    let l = past + t_q;
    let (q, k, v) = (vals(t_q * h * d, 4), vals(l * kvh * d, 5), vals(l * kvh * d, 6));
    let mut want = vec![0.0f64; t_q * h * d];
    for i in 0..t_q {
        for hh in 0..h {
            let g = hh / (h / kvh);
            let s: Vec<f64> = (0..=past + i)
                .map(|j| {
                    (0..d).map(|e| q[i * h * d + hh * d + e] as f64 * k[j * kvh * d + g * d + e] as f64).sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let z: f64 = s.iter().map(|x| x.exp()).sum();
            for (j, sj) in s.iter().enumerate() {
                for e in 0..d {
                    want[i * h * d + hh * d + e] += sj.exp() / z * v[j * kvh * d + g * d + e] as f64;
                }
            }
        }
    }
    let o =
        ops::attention(&t(&q, &[t_q, h * d]), &t(&k, &[l, kvh * d]), &t(&v, &[l, kvh * d]), past, h, kvh, d).unwrap();
    assert_close(o.as_slice().unwrap(), &want, 1e-5, "gqa attention");
}

#[test]
fn embedding_gathers_rows_and_rejects_bad_ids() {
    let table = t(&[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]);
    let e = ops::embedding(&table, &[2, 0, 2]).unwrap();
    assert_eq!(e.as_slice().unwrap(), &[20.0, 21.0, 0.0, 1.0, 20.0, 21.0]);
    let err = ops::embedding(&table, &[1, 3]).unwrap_err();
    assert!(err.to_string().contains("token id 3 >= vocab size 3"), "{err}");
}

#[test]
fn cuda_is_reported_unavailable_without_the_feature() {
    let e = kernels::Device::cuda(0).unwrap_err();
    assert!(e.to_string().contains("without the `cuda` feature"), "{e}");
}

#[test]
fn split_and_cat_are_inverse() {
    let x = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let parts = ops::split_cols(&x, &[1, 2]).unwrap();
    assert_eq!(parts[0].as_slice().unwrap(), &[1.0, 4.0]);
    assert_eq!(parts[1].as_slice().unwrap(), &[2.0, 3.0, 5.0, 6.0]);
    assert!(ops::split_cols(&x, &[2, 2]).unwrap_err().to_string().contains("widths [2, 2] do not sum to 3"));
    let y = ops::cat_rows(&[&x, &t(&[7.0, 8.0, 9.0], &[1, 3])]).unwrap();
    assert_eq!(y.shape(), &[3, 3]);
    assert_eq!(&y.as_slice().unwrap()[6..], &[7.0, 8.0, 9.0]);
}

#[test]
fn matmul_is_batch_invariant() {
    // Each row of a batched product is bitwise equal to the same row computed alone,
    // for batch sizes that hit every tile shape and k with 32-, 8- and scalar tails.
    for (m, n, k) in [(2, 5, 576), (3, 7, 45), (7, 33, 77), (64, 20, 1536)] {
        let (x, w) = (vals(m * k, 7), vals(n * k, 8));
        let wt = t(&w, &[n, k]);
        let batched = ops::matmul_t(&t(&x, &[m, k]), &wt, None).unwrap();
        for i in 0..m {
            let alone = ops::matmul_t(&t(&x[i * k..(i + 1) * k], &[1, k]), &wt, None).unwrap();
            assert_eq!(
                alone.as_slice().unwrap(),
                &batched.as_slice().unwrap()[i * n..(i + 1) * n],
                "row {i} of {m}x{n}x{k}"
            );
        }
    }
}
