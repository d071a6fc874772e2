//! The backend contract, op by op: one test body per op of `kernels::ops`, run on every
//! available device (candle's `test_device!` pattern) against an f64 reference written here
//! from the op's formula, or against f64 finite differences for the backward ops. The CPU
//! and the CUDA backend on the emulated device run them in CI; with `--features cuda` (and a
//! GPU) the CUDA backend runs the same bodies on the GPU; CUDA also in `--batch-invariant` mode.

use kernels::ops::{self, AdamWStep, AttnBatch, AttnSeq, KvLayout};
use kernels::{Device, Tensor};
use std::ops::Range;

/// `test_device!(body)`: `body::cpu` and `body::cuda_emu` (the CUDA backend on the emulated
/// device, `kernels::cuda::emu`) always, each CUDA variant also in `--batch-invariant` mode;
/// `body::cuda` on a real GPU with the `cuda` feature.
macro_rules! test_device {
    ($($body:ident),+ $(,)?) => {$(
        mod $body {
            #[test]
            fn cpu() {
                super::$body(&kernels::Device::Cpu)
            }
            #[test]
            fn cuda_emu() {
                super::$body(&kernels::Device::cuda_emu(kernels::CudaOptions::default()).unwrap())
            }
            #[test]
            fn cuda_emu_batch_invariant() {
                let o = kernels::CudaOptions { batch_invariant: true, bf16_weights: false };
                super::$body(&kernels::Device::cuda_emu(o).unwrap())
            }
            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                match kernels::Device::cuda(0) {
                    Ok(d) => super::$body(&d),
                    Err(e) => eprintln!("no CUDA device: {e}"),
                }
            }
            /// The same body with `--batch-invariant`'s kernels (gemm.cu, split-KV attention).
            #[cfg(feature = "cuda")]
            #[test]
            fn cuda_batch_invariant() {
                match kernels::Device::cuda_with(0, kernels::CudaOptions { batch_invariant: true, bf16_weights: false }) {
                    Ok(d) => super::$body(&d),
                    Err(e) => eprintln!("no CUDA device: {e}"),
                }
            }
        }
    )+};
}

test_device!(
    linear_and_packing,
    linear_backward,
    rms_norm_and_backward,
    rope,
    silu_mul_and_backward,
    elementwise_and_reductions,
    softmaxes,
    row_and_column_copies,
    paged_attention_with_block_tables,
    kv_cache_layouts,
    attention_backward,
    token_logprobs_and_backward,
    adamw,
);

/// `--dtype bfloat16`'s serving GEMM (the CUDA backend only: a bf16 copy of the packed weight,
/// `x` rounded to bf16, GemmEx with f32 accumulation): `linear` is the f64 product of the
/// bf16-rounded operands (round to nearest even, by hand below) plus the f32 bias, within
/// f32 summation rounding, on the decode, tile-tail and odd shapes of `linear_and_packing`.
fn bf16_serving_linear(dev: &Device) {
    fn bf16(x: f32) -> f64 {
        let b = x.to_bits();
        f32::from_bits(((b + 0x7fff + ((b >> 16) & 1)) >> 16) << 16) as f64
    }
    assert_eq!((bf16(1.0 + 1.0 / 256.0), bf16(1.0 + 3.0 / 256.0)), (1.0, 1.0 + 4.0 / 256.0), "ties to even");
    for (m, n, k) in [(1, 70, 37), (3, 7, 45), (7, 33, 77), (13, 1, 64), (2, 64, 1), (64, 100, 129)] {
        let (x, w, b) = (vals(m * k, 1), vals(n * k, 2), vals(n, 3));
        let (x16, w16): (Vec<f64>, Vec<f64>) =
            (x.iter().map(|&v| bf16(v)).collect(), w.iter().map(|&v| bf16(v)).collect());
        let want: Vec<f64> =
            matmul_t64(&x16, &w16, m, n, k).iter().enumerate().map(|(i, v)| v + b[i % n] as f64).collect();
        let packed = ops::pack_weight(&up(dev, &w, &[n, k])).unwrap();
        let y = ops::linear(&up(dev, &x, &[m, k]), &packed, Some(&up(dev, &b, &[n]))).unwrap();
        close(&host(&y), &want, 1e-5, &format!("bf16 linear {m}x{n}x{k}"));
    }
}

mod bf16_serving_linear {
    const BF16: kernels::CudaOptions = kernels::CudaOptions { batch_invariant: false, bf16_weights: true };
    #[test]
    fn cuda_emu() {
        super::bf16_serving_linear(&kernels::Device::cuda_emu(BF16).unwrap())
    }
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda() {
        match kernels::Device::cuda_with(0, BF16) {
            Ok(d) => super::bf16_serving_linear(&d),
            Err(e) => eprintln!("no CUDA device: {e}"),
        }
    }
}

/// Deterministic values in [-1, 1).
fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 8) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn up(dev: &Device, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap().to_device(dev).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_vec().unwrap()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// `|got − want| ≤ tol · (1 + |want|)` everywhere, and equal lengths.
fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Central finite differences of `f` at `x` (f64, step 1e-6).
fn numeric_grad(x: &[f64], f: &dyn Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-6;
    (0..x.len())
        .map(|i| {
            let (mut a, mut b) = (x.to_vec(), x.to_vec());
            a[i] += h;
            b[i] -= h;
            (f(&a) - f(&b)) / (2.0 * h)
        })
        .collect()
}

/// `y [m, n] = x [m, k] · w [n, k]ᵀ` in f64.
fn matmul_t64(x: &[f64], w: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    (0..m * n).map(|i| (0..k).map(|l| x[i / n * k + l] * w[i % n * k + l]).sum()).collect()
}

fn linear_and_packing(dev: &Device) {
    // Decode (m = 1), every tile shape, k with 32-, 8- and scalar tails, one column, one input.
    let shapes =
        [(1, 70, 37), (1, 576, 1536), (2, 5, 576), (3, 7, 45), (7, 33, 77), (13, 1, 64), (2, 64, 1), (64, 100, 129)];
    for (m, n, k) in shapes {
        let (x, w, b) = (vals(m * k, 1), vals(n * k, 2), vals(n, 3));
        let packed = ops::pack_weight(&up(dev, &w, &[n, k])).unwrap();
        assert_eq!(packed.shape(), [n, k]);
        assert_eq!(host(&ops::unpack_weight(&packed).unwrap()), w, "unpack ∘ pack = id");
        let mut want = matmul_t64(&f64s(&x), &f64s(&w), m, n, k);
        let y = ops::linear(&up(dev, &x, &[m, k]), &packed, None).unwrap();
        assert_eq!(y.shape(), [m, n]);
        close(&host(&y), &want, 1e-5, &format!("linear {m}x{n}x{k}"));
        for (i, v) in want.iter_mut().enumerate() {
            *v += b[i % n] as f64;
        }
        let yb = ops::matmul_t(&up(dev, &x, &[m, k]), &up(dev, &w, &[n, k]), Some(&up(dev, &b, &[n]))).unwrap();
        close(&host(&yb), &want, 1e-5, &format!("matmul_t + bias {m}x{n}x{k}"));
        // Batch invariance: each row alone is bitwise the row of the batch.
        let all = host(&y);
        for i in 0..m {
            let row = ops::linear(&up(dev, &x[i * k..(i + 1) * k], &[1, k]), &packed, None).unwrap();
            assert_eq!(host(&row), &all[i * n..(i + 1) * n], "row {i} of {m}x{n}x{k} alone");
        }
    }
    assert!(ops::linear(
        &up(dev, &vals(6, 1), &[2, 3]),
        &ops::pack_weight(&up(dev, &vals(8, 2), &[2, 4])).unwrap(),
        None
    )
    .is_err());
}

fn linear_backward(dev: &Device) {
    let (m, n, k) = (5, 67, 33);
    let (dy, w, x) = (vals(m * n, 4), vals(n * k, 5), vals(m * k, 6));
    let packed = ops::pack_weight(&up(dev, &w, &[n, k])).unwrap();
    // dx = dy · W: W's transpose is W as an [n, k] "x" times… written out directly.
    let want_dx: Vec<f64> =
        (0..m * k).map(|i| (0..n).map(|j| dy[i / k * n + j] as f64 * w[j * k + i % k] as f64).sum()).collect();
    close(&host(&ops::linear_grad_input(&up(dev, &dy, &[m, n]), &packed).unwrap()), &want_dx, 1e-5, "dx");
    let want_dw: Vec<f64> =
        (0..n * k).map(|i| (0..m).map(|r| dy[r * n + i / k] as f64 * x[r * k + i % k] as f64).sum()).collect();
    let dw = ops::linear_grad_weight(&up(dev, &dy, &[m, n]), &up(dev, &x, &[m, k])).unwrap();
    assert_eq!(dw.shape(), [n, k]);
    close(&host(&dw), &want_dw, 1e-5, "dW");
}

/// RMSNorm of `[m, d]` rows in f64.
fn rms_norm64(x: &[f64], w: &[f64], d: usize, eps: f64) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            r.iter().zip(w).map(move |(v, w)| v * inv * w)
        })
        .collect()
}

fn rms_norm_and_backward(dev: &Device) {
    // 130 rows: the CPU backward's row tasks (64 rows) and their dw parts, a partial last one.
    for m in [3, 130] {
        rms_norm_case(dev, m);
    }
}

fn rms_norm_case(dev: &Device, m: usize) {
    let (d, eps) = (37, 1e-5);
    let (x, w, dy) = (vals(m * d, 7), vals(d, 8), vals(m * d, 9));
    let y = ops::rms_norm(&up(dev, &x, &[m, d]), &up(dev, &w, &[d]), eps as f32).unwrap();
    close(&host(&y), &rms_norm64(&f64s(&x), &f64s(&w), d, eps), 1e-5, "rms_norm");
    let (dx, dw) =
        ops::rms_norm_backward(&up(dev, &x, &[m, d]), &up(dev, &w, &[d]), &up(dev, &dy, &[m, d]), eps as f32).unwrap();
    let loss = |x: &[f64], w: &[f64]| rms_norm64(x, w, d, eps).iter().zip(&dy).map(|(a, b)| a * *b as f64).sum::<f64>();
    let (x64, w64) = (f64s(&x), f64s(&w));
    close(&host(&dx), &numeric_grad(&x64, &|x| loss(x, &w64)), 1e-5, "rms_norm dx");
    close(&host(&dw), &numeric_grad(&w64, &|w| loss(&x64, w)), 1e-5, "rms_norm dw");
}

fn rope(dev: &Device) {
    let (heads, hd, max_pos) = (3, 8, 20);
    let half = hd / 2;
    let positions = [0u32, 5, 19, 7];
    let m = positions.len();
    let angle = |p: usize, i: usize| p as f64 / 10000f64.powf(2.0 * i as f64 / hd as f64);
    let table =
        |f: fn(f64) -> f64| -> Vec<f32> { (0..max_pos * half).map(|j| f(angle(j / half, j % half)) as f32).collect() };
    let (cos, sin) = (up(dev, &table(f64::cos), &[max_pos, half]), up(dev, &table(f64::sin), &[max_pos, half]));
    let x = vals(m * heads * hd, 10);
    let mut t = up(dev, &x, &[m, heads * hd]);
    ops::rope_inplace(&mut t, &positions, &cos, &sin, hd).unwrap();
    let want: Vec<f64> = (0..x.len())
        .map(|j| {
            let (row, c) = (j / (heads * hd), j % hd);
            let base = j - c;
            let (i, a) = (c % half, angle(positions[row] as usize, c % half));
            let (x1, x2) = (x[base + i] as f64, x[base + i + half] as f64);
            if c < half {
                x1 * a.cos() - x2 * a.sin()
            } else {
                x2 * a.cos() + x1 * a.sin()
            }
        })
        .collect();
    close(&host(&t), &want, 1e-5, "rope");
    // The inverse rotation (sin → −sin, the learner's backward) restores the input.
    ops::rope_inplace(&mut t, &positions, &cos, &ops::scale(&sin, -1.0).unwrap(), hd).unwrap();
    close(&host(&t), &f64s(&x), 1e-5, "rope⁻¹");
    assert!(ops::rope_inplace(&mut up(dev, &x[..heads * hd], &[1, heads * hd]), &[20], &cos, &sin, hd).is_err());
}

fn silu_mul64(gu: &[f64], i: usize) -> Vec<f64> {
    gu.chunks(2 * i).flat_map(|r| (0..i).map(move |j| r[j] / (1.0 + (-r[j]).exp()) * r[i + j])).collect()
}

fn silu_mul_and_backward(dev: &Device) {
    let (m, i) = (3, 11);
    let (gu, da) = (vals(m * 2 * i, 11).iter().map(|v| v * 4.0).collect::<Vec<_>>(), vals(m * i, 12));
    let y = ops::silu_mul(&up(dev, &gu, &[m, 2 * i])).unwrap();
    assert_eq!(y.shape(), [m, i]);
    close(&host(&y), &silu_mul64(&f64s(&gu), i), 1e-5, "silu_mul");
    let d = ops::silu_mul_backward(&up(dev, &gu, &[m, 2 * i]), &up(dev, &da, &[m, i])).unwrap();
    let loss = |g: &[f64]| silu_mul64(g, i).iter().zip(&da).map(|(a, b)| a * *b as f64).sum::<f64>();
    close(&host(&d), &numeric_grad(&f64s(&gu), &loss), 1e-5, "silu_mul backward");
}

fn elementwise_and_reductions(dev: &Device) {
    let (m, n) = (4, 9);
    let (a, b) = (vals(m * n, 13), vals(m * n, 14));
    let mut t = up(dev, &a, &[m, n]);
    ops::add_inplace(&mut t, &up(dev, &b, &[m, n])).unwrap();
    close(&host(&t), &a.iter().zip(&b).map(|(x, y)| *x as f64 + *y as f64).collect::<Vec<_>>(), 1e-6, "add");
    close(
        &host(&ops::scale(&up(dev, &a, &[m, n]), -2.5).unwrap()),
        &a.iter().map(|x| -2.5 * *x as f64).collect::<Vec<_>>(),
        1e-6,
        "scale",
    );
    let axpby: Vec<f64> = a.iter().zip(&b).map(|(x, y)| 0.9 * *x as f64 + *y as f64).collect();
    let mut t = up(dev, &a, &[m, n]);
    ops::scale_add_inplace(&mut t, 0.9, &up(dev, &b, &[m, n])).unwrap();
    close(&host(&t), &axpby, 1e-6, "scale_add");
    let inplace = host(&t);
    // The optimizer's update of the served weights: the new weight prepared in the step's
    // buffer (the weight only read), then committed (swapped, or copied in), packed and
    // dense; the same bits as the in-place form.
    for keep_address in [false, true] {
        let mut w = ops::pack_weight(&up(dev, &a, &[m, n])).unwrap();
        let mut d = ops::pack_weight(&up(dev, &b, &[m, n])).unwrap();
        ops::scale_add_packed_into(&w, 0.9, &mut d).unwrap();
        assert_eq!(host(&ops::unpack_weight(&w).unwrap()), a, "scale_add_packed_into only reads the weight");
        ops::commit_packed(&mut w, &mut d, keep_address).unwrap();
        assert_eq!(host(&ops::unpack_weight(&w).unwrap()), inplace, "commit_packed, keep_address {keep_address}");
        let (mut t, mut d) = (up(dev, &a, &[m, n]), up(dev, &b, &[m, n]));
        ops::scale_add_into(&t, 0.9, &mut d).unwrap();
        ops::commit(&mut t, &mut d, keep_address).unwrap();
        assert_eq!(host(&t), inplace, "commit, keep_address {keep_address}");
    }
    let mut wrong = up(dev, &b, &[n, m]);
    let e = ops::scale_add_into(&up(dev, &a, &[m, n]), 0.9, &mut wrong).unwrap_err().to_string();
    assert!(e.contains("scale_add_into"), "{e}");
    let ss: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    assert!((ops::sum_squares(&up(dev, &a, &[m, n])).unwrap() - ss).abs() < 1e-9 * ss, "sum_squares");
    // Several tensors (the global gradient norm), one of them empty: the sum of all squares.
    let (ta, tb, te) = (up(dev, &a, &[m, n]), up(dev, &b, &[m, n]), up(dev, &[], &[0]));
    let all = ss + b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
    let got = ops::sum_squares_all(&[&ta, &te, &tb]).unwrap();
    assert!((got - all).abs() < 1e-9 * all, "sum_squares_all: {got} vs {all}");
    assert_eq!(ops::sum_squares_all(&[]).unwrap(), 0.0);
    let cols: Vec<f64> = (0..n).map(|j| (0..m).map(|r| a[r * n + j] as f64).sum()).collect();
    close(&host(&ops::sum_rows(&up(dev, &a, &[m, n])).unwrap()), &cols, 1e-6, "sum_rows");
    assert!(ops::add_inplace(&mut up(dev, &a, &[m, n]), &up(dev, &b[..n], &[1, n])).is_err());
}

fn softmaxes(dev: &Device) {
    let (m, n) = (3, 50);
    let x: Vec<f32> = vals(m * n, 15).iter().map(|v| v * 30.0).collect();
    let lse: Vec<f64> = x
        .chunks(n)
        .map(|r| {
            let mx = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            mx + r.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln()
        })
        .collect();
    let ls: Vec<f64> = (0..m * n).map(|j| x[j] as f64 - lse[j / n]).collect();
    close(&host(&ops::log_softmax(&up(dev, &x, &[m, n])).unwrap()), &ls, 1e-5, "log_softmax");
    close(
        &host(&ops::softmax(&up(dev, &x, &[m, n])).unwrap()),
        &ls.iter().map(|v| v.exp()).collect::<Vec<_>>(),
        1e-6,
        "softmax",
    );
}

fn row_and_column_copies(dev: &Device) {
    let (m, c) = (5, 7);
    let x = vals(m * c, 16);
    let t = up(dev, &x, &[m, c]);
    let parts = ops::split_cols(&t, &[2, 0, 5]).unwrap();
    assert_eq!(parts.iter().map(|p| p.shape().to_vec()).collect::<Vec<_>>(), [[m, 2], [m, 0], [m, 5]]);
    assert_eq!(host(&parts[0]), x.chunks(c).flat_map(|r| r[..2].to_vec()).collect::<Vec<_>>());
    assert_eq!(host(&ops::cat_cols(&parts.iter().collect::<Vec<_>>()).unwrap()), x, "cat_cols ∘ split_cols = id");
    let rows = ops::split_rows(&t, &[1, 3, 1]).unwrap();
    assert_eq!(host(&rows[1]), &x[c..4 * c]);
    assert_eq!(host(&ops::rows(&t, 2..4).unwrap()), &x[2 * c..4 * c]);
    assert_eq!(host(&ops::cat_rows(&rows.iter().collect::<Vec<_>>()).unwrap()), x, "cat_rows ∘ split_rows = id");
    // Gathers, scatters (KV append) and scatter-adds (embedding backward, repeated ids add up).
    let ids = [4u32, 0, 4, 2];
    let g = ops::embedding(&t, &ids).unwrap();
    assert_eq!(
        host(&g),
        ids.iter().flat_map(|&i| x[i as usize * c..(i as usize + 1) * c].to_vec()).collect::<Vec<_>>()
    );
    assert!(ops::embedding(&t, &[5]).is_err());
    // A tied embedding's lookup in its LM head: rows of a packed weight (70 rows: a full and
    // a partial 64-row panel on the CPU), the row-major rows bitwise.
    {
        let (n, k) = (70, 37);
        let w = vals(n * k, 18);
        let packed = ops::pack_weight(&up(dev, &w, &[n, k])).unwrap();
        let ids = [69u32, 0, 64, 63, 69];
        let want: Vec<f32> = ids.iter().flat_map(|&i| w[i as usize * k..(i as usize + 1) * k].to_vec()).collect();
        assert_eq!(host(&ops::embedding_packed(&packed, &ids).unwrap()), want);
        let e = ops::embedding_packed(&packed, &[70]).unwrap_err();
        assert!(e.to_string().contains("token id 70 >= vocab size 70"), "{e}");
    }
    let src = vals(ids.len() * c, 17);
    let mut dst = up(dev, &x, &[m, c]);
    ops::scatter_rows(&mut dst, &[3, 1, 0, 2], &up(dev, &src, &[4, c])).unwrap();
    let got = host(&dst);
    assert_eq!((&got[3 * c..4 * c], &got[4 * c..]), (&src[..c], &x[4 * c..]));
    let mut acc = up(dev, &x, &[m, c]);
    ops::scatter_add_rows(&mut acc, &ids, &up(dev, &src, &[4, c])).unwrap();
    let mut want = f64s(&x);
    for (r, &i) in ids.iter().enumerate() {
        for j in 0..c {
            want[i as usize * c + j] += src[r * c + j] as f64;
        }
    }
    close(&host(&acc), &want, 1e-6, "scatter_add_rows");
    assert!(ops::scatter_rows(&mut dst, &[5, 0, 0, 0], &up(dev, &src, &[4, c])).is_err());
}

/// One query row of an f64 attention reference: its values, and the key/value rows it attends.
fn attend64(q: &[f64], k: &[f64], v: &[f64], keys: &[usize], heads: usize, kv_heads: usize, hd: usize) -> Vec<f64> {
    let (kc, group) = (kv_heads * hd, heads / kv_heads);
    let mut out = vec![0.0; heads * hd];
    for h in 0..heads {
        let off = (h / group) * hd;
        let s: Vec<f64> = keys
            .iter()
            .map(|&j| (0..hd).map(|i| q[h * hd + i] * k[j * kc + off + i]).sum::<f64>() / (hd as f64).sqrt())
            .collect();
        let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
        for (&j, x) in keys.iter().zip(&s) {
            for i in 0..hd {
                out[h * hd + i] += (x - mx).exp() / z * v[j * kc + off + i];
            }
        }
    }
    out
}

/// The sequences of a paged-attention case: `(rows, start position)` and a block table each,
/// in blocks of `bs`.
fn attn_batch(specs: &[(Range<usize>, usize)], tables: &[Vec<u32>], bs: usize) -> AttnBatch {
    let seqs: Vec<AttnSeq> = specs
        .iter()
        .zip(tables)
        .map(|((rows, start), table)| AttnSeq { rows: rows.clone(), start_pos: *start, block_table: table })
        .collect();
    AttnBatch::new(&seqs, bs).unwrap()
}

/// The f64 reference of a paged-attention case over slot-row K/V (`heads` = query heads, KV
/// heads, head dimension): every row of every sequence, in order.
fn paged_attention64(
    specs: &[(Range<usize>, usize)],
    tables: &[Vec<u32>],
    (q, k, v): (&[f32], &[f32], &[f32]),
    bs: usize,
    (heads, kv_heads, hd): (usize, usize, usize),
) -> Vec<f64> {
    let (q64, k64, v64, qc) = (f64s(q), f64s(k), f64s(v), heads * hd);
    let mut want = vec![];
    for ((rows, start), table) in specs.iter().zip(tables) {
        for (i, r) in rows.clone().enumerate() {
            let keys: Vec<usize> = (0..=start + i).map(|p| table[p / bs] as usize * bs + p % bs).collect();
            want.extend(attend64(&q64[r * qc..(r + 1) * qc], &k64, &v64, &keys, heads, kv_heads, hd));
        }
    }
    want
}

/// The KV cache ops in each layout the device has ([`KvLayout::Rows`] everywhere,
/// [`KvLayout::Blocked`] on the CPU): slots written with `write_kv` read back by `read_kv`;
/// attention over them against the f64 reference, bitwise equal across layouts; a slot copy
/// (a fork's partial block); the layout's limits as errors.
fn kv_cache_layouts(dev: &Device) {
    // head_dim 20: a strip's chains are not a multiple of a vector; blocks of 16, out of order.
    let (heads, kv_heads, hd, bs, blocks) = (6, 2, 20, 16, 5);
    let (qc, kc, slots) = (heads * hd, kv_heads * hd, blocks * bs);
    let tables: [Vec<u32>; 2] = [vec![3, 0, 4], vec![1]];
    // A prefill chunk at positions 10..40 and a decode at position 13.
    let specs = [(0..30, 10usize), (30..31, 13)];
    let t = 31;
    let (q, k, v) = (vals(t * qc, 23), vals(slots * kc, 24), vals(slots * kc, 25));
    let all: Vec<u32> = (0..slots as u32).collect();
    let seqs = attn_batch(&specs, &tables, bs);
    let want = paged_attention64(&specs, &tables, (&q, &k, &v), bs, (heads, kv_heads, hd));
    let mut outs = vec![];
    for layout in [KvLayout::Rows, KvLayout::for_device(dev, bs)] {
        let (mut kt, mut vt) =
            (up(dev, &vec![0.0; slots * kc], &[slots, kc]), up(dev, &vec![0.0; slots * kc], &[slots, kc]));
        // Written in two calls, slots out of order.
        let (a, b): (Vec<u32>, Vec<u32>) = all.iter().rev().partition(|&&s| s % 3 == 0);
        for part in [a, b] {
            let rows = |x: &[f32]| {
                part.iter().flat_map(|&s| x[s as usize * kc..(s as usize + 1) * kc].to_vec()).collect::<Vec<f32>>()
            };
            let (kr, vr) = (up(dev, &rows(&k), &[part.len(), kc]), up(dev, &rows(&v), &[part.len(), kc]));
            ops::write_kv(&mut kt, &mut vt, &part, &kr, &vr, layout, bs, kv_heads).unwrap();
        }
        let (kr, vr) = ops::read_kv(&kt, &vt, &all, layout, bs, kv_heads).unwrap();
        assert_eq!((host(&kr), host(&vr)), (k.clone(), v.clone()), "{layout:?}: read back");
        let out =
            host(&ops::paged_attention(&up(dev, &q, &[t, qc]), &kt, &vt, &seqs, heads, kv_heads, hd, layout).unwrap());
        close(&out, &want, 1e-5, &format!("{layout:?} attention"));
        outs.push(out);
        // Slots 3 and 40 copied into 17 and 79.
        let (ks, vs) = ops::read_kv(&kt, &vt, &[3, 40], layout, bs, kv_heads).unwrap();
        ops::write_kv(&mut kt, &mut vt, &[17, 79], &ks, &vs, layout, bs, kv_heads).unwrap();
        let (kr, _) = ops::read_kv(&kt, &vt, &all, layout, bs, kv_heads).unwrap();
        let mut moved = k.clone();
        moved.copy_within(3 * kc..4 * kc, 17 * kc);
        moved.copy_within(40 * kc..41 * kc, 79 * kc);
        assert_eq!(host(&kr), moved, "{layout:?}: copied slots");
        assert!(ops::read_kv(&kt, &vt, &[slots as u32], layout, bs, kv_heads).is_err(), "slot past the cache");
    }
    let bits = |o: &Vec<f32>| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&outs[0]), bits(&outs[1]), "layouts disagree");
    // Blocked needs blocks of a multiple of 16, and the CPU.
    let (mut kt, mut vt) = (up(dev, &k, &[slots, kc]), up(dev, &v, &[slots, kc]));
    let one = up(dev, &k[..kc], &[1, kc]);
    let blocked8 = ops::write_kv(&mut kt, &mut vt, &[0], &one, &one, KvLayout::Blocked, 8, kv_heads);
    assert!(blocked8.is_err());
    let blocked = ops::write_kv(&mut kt, &mut vt, &[0], &one, &one, KvLayout::Blocked, bs, kv_heads);
    assert_eq!(blocked.is_ok(), matches!(dev, Device::Cpu));
}

fn paged_attention_with_block_tables(dev: &Device) {
    let (heads, kv_heads, hd, bs, blocks) = (4, 2, 8, 4, 12);
    let (qc, kc) = (heads * hd, kv_heads * hd);
    // A prefill (positions 0..5), a decode at position 9, a chunk at positions 3..7; blocks
    // out of order and not shared.
    let tables: [Vec<u32>; 3] = [vec![7, 2], vec![0, 9, 4], vec![11, 5]];
    let specs = [(0..5, 0usize), (5..6, 9), (6..10, 3)];
    let t = 10;
    let (q, k, v) = (vals(t * qc, 18), vals(blocks * bs * kc, 19), vals(blocks * bs * kc, 20));
    let seqs = attn_batch(&specs, &tables, bs);
    let (kt, vt) = (up(dev, &k, &[blocks * bs, kc]), up(dev, &v, &[blocks * bs, kc]));
    let out =
        ops::paged_attention(&up(dev, &q, &[t, qc]), &kt, &vt, &seqs, heads, kv_heads, hd, KvLayout::Rows).unwrap();
    let want = paged_attention64(&specs, &tables, (&q, &k, &v), bs, (heads, kv_heads, hd));
    close(&host(&out), &want, 1e-5, "paged_attention");
    // Too few blocks for the context, a block outside the cache, a row in no sequence.
    let bad = |seqs: &[AttnSeq]| {
        AttnBatch::new(seqs, bs).and_then(|b| {
            ops::paged_attention(&up(dev, &q, &[t, qc]), &kt, &vt, &b, heads, kv_heads, hd, KvLayout::Rows)
        })
    };
    let short = [AttnSeq { rows: 0..t, start_pos: 0, block_table: &[1, 2] }];
    let outside = [AttnSeq { rows: 0..t, start_pos: 0, block_table: &[1, 2, 12] }];
    let partial = [AttnSeq { rows: 0..t - 1, start_pos: 0, block_table: &[1, 2, 3] }];
    assert!(bad(&short).is_err() && bad(&outside).is_err() && bad(&partial).is_err());
    // Packed sequences without a cache (the learner's forward): each row sees its own span.
    let spans = [0..4, 4..10];
    let (kp, vp) = (vals(t * kc, 21), vals(t * kc, 22));
    let packed = ops::attention_packed(
        &up(dev, &q, &[t, qc]),
        &up(dev, &kp, &[t, kc]),
        &up(dev, &vp, &[t, kc]),
        &spans,
        heads,
        kv_heads,
        hd,
    )
    .unwrap();
    close(
        &host(&packed),
        &packed_attention64(&f64s(&q), &f64s(&kp), &f64s(&vp), &spans, heads, kv_heads, hd),
        1e-5,
        "attention_packed",
    );
}

/// Causal attention over packed spans (positions 0..len each) in f64.
fn packed_attention64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    spans: &[Range<usize>],
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f64> {
    let qc = heads * hd;
    spans
        .iter()
        .flat_map(|s| s.clone().map(move |r| (s.start, r)))
        .flat_map(|(s0, r)| {
            attend64(&q[r * qc..(r + 1) * qc], k, v, &(s0..=r).collect::<Vec<_>>(), heads, kv_heads, hd)
        })
        .collect()
}

fn attention_backward(dev: &Device) {
    let (heads, kv_heads, hd) = (4, 2, 4);
    let (qc, kc) = (heads * hd, kv_heads * hd);
    let spans = [0..3, 3..7];
    let t = 7;
    let (q, k, v, da) = (vals(t * qc, 23), vals(t * kc, 24), vals(t * kc, 25), vals(t * qc, 26));
    let (dq, dk, dv) = ops::attention_backward(
        &up(dev, &q, &[t, qc]),
        &up(dev, &k, &[t, kc]),
        &up(dev, &v, &[t, kc]),
        &up(dev, &da, &[t, qc]),
        &spans,
        heads,
        kv_heads,
        hd,
    )
    .unwrap();
    let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
    let loss = |q: &[f64], k: &[f64], v: &[f64]| {
        packed_attention64(q, k, v, &spans, heads, kv_heads, hd)
            .iter()
            .zip(&da)
            .map(|(a, b)| a * *b as f64)
            .sum::<f64>()
    };
    close(&host(&dq), &numeric_grad(&q64, &|x| loss(x, &k64, &v64)), 1e-5, "dq");
    close(&host(&dk), &numeric_grad(&k64, &|x| loss(&q64, x, &v64)), 1e-5, "dk");
    close(&host(&dv), &numeric_grad(&v64, &|x| loss(&q64, &k64, x)), 1e-5, "dv");
}

/// `(ℓ, H)` of one logits row at temperature `t` in f64.
fn logprob64(z: &[f64], tok: usize, t: f64) -> (f64, f64) {
    let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = z.iter().map(|x| ((x - mx) / t).exp()).sum::<f64>().ln();
    let lp: Vec<f64> = z.iter().map(|x| (x - mx) / t - lse).collect();
    (lp[tok], -lp.iter().map(|l| l.exp() * l).sum::<f64>())
}

fn token_logprobs_and_backward(dev: &Device) {
    let (m, v, temp) = (3, 40, 0.7f32);
    let z: Vec<f32> = vals(m * v, 27).iter().map(|x| x * 6.0).collect();
    let tokens = [3u32, 39, 0];
    let (lp, ent) = ops::token_logprobs(&up(dev, &z, &[m, v]), &tokens, temp).unwrap();
    let z64 = f64s(&z);
    let want: Vec<(f64, f64)> =
        (0..m).map(|i| logprob64(&z64[i * v..(i + 1) * v], tokens[i] as usize, temp as f64)).collect();
    close(&lp, &want.iter().map(|w| w.0).collect::<Vec<_>>(), 1e-6, "ℓ");
    close(&ent, &want.iter().map(|w| w.1).collect::<Vec<_>>(), 1e-6, "H");
    let (g, e) = ([0.5f32, -1.5, 2.0], [0.3f32, 0.0, -0.7]);
    let loss = |z: &[f64]| {
        (0..m)
            .map(|i| {
                let (l, h) = logprob64(&z[i * v..(i + 1) * v], tokens[i] as usize, temp as f64);
                g[i] as f64 * l + e[i] as f64 * h
            })
            .sum::<f64>()
    };
    let dz = ops::token_logprobs_backward(&up(dev, &z, &[m, v]), &tokens, temp, &g, Some(&e), &ent).unwrap();
    close(&host(&dz), &numeric_grad(&z64, &loss), 1e-5, "dz");
    assert!(ops::token_logprobs(&up(dev, &z, &[m, v]), &[0, 40, 1], temp).is_err(), "token id ≥ vocab");
}

fn adamw(dev: &Device) {
    let n = 10;
    let (b1, b2, lr, eps) = (0.9, 0.999, 1e-2, 1e-8);
    let (mut m, mut v) = (up(dev, &vec![0.0; n], &[n]), up(dev, &vec![0.0; n], &[n]));
    let (mut m64, mut v64) = (vec![0.0f64; n], vec![0.0f64; n]);
    for t in 1..=3 {
        let g = vals(n, 28 + t);
        let clip = if t == 2 { 0.5 } else { 1.0 };
        let step = AdamWStep {
            lr,
            beta1: b1,
            beta2: b2,
            eps,
            bias_correction1: 1.0 - b1.powi(t as i32),
            bias_correction2: 1.0 - b2.powi(t as i32),
            clip,
        };
        let d = ops::adamw_delta(&up(dev, &g, &[n]), &mut m, &mut v, &step).unwrap();
        let mut want = vec![];
        for i in 0..n {
            let gi = g[i] as f64 * clip;
            m64[i] = b1 * m64[i] + (1.0 - b1) * gi;
            v64[i] = b2 * v64[i] + (1.0 - b2) * gi * gi;
            want.push(-lr * (m64[i] / step.bias_correction1) / ((v64[i] / step.bias_correction2).sqrt() + eps));
        }
        close(&host(&d), &want, 1e-5, &format!("Δ at step {t}"));
        close(&host(&m), &m64, 1e-6, &format!("m at step {t}"));
        close(&host(&v), &v64, 1e-6, &format!("v at step {t}"));
    }
}
