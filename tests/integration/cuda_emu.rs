//! The CUDA kernels (`kernels/cuda/*.cu`) on the CPU: `kernels/build.rs` (the `cuda-emu` feature) compiles them with the
//! host C++ compiler through the SIMT emulation (`kernels/cuda/emu/simt.h`: blocks in turn,
//! the threads of a block as real threads, barriers, warp shuffles), and each kernel is
//! compared here with the CPU backend's op (`kernels::ops` on `Device::Cpu`) or, for the
//! sampler, with the engine's CPU sampler.
//!
//! Tolerances: bitwise where the kernel performs the CPU's operations in the CPU's order
//! (the emulation's `expf` is glibc's, as Rust's); otherwise `|got − want| ≤ tol·(1 + |want|)`
//! with the smallest `tol` that the reduction-order difference named at the check allows.
//! Sizes are small and odd (the emulation runs a thread per CUDA thread).

use kernels::ops::{self, AdamWStep};
use kernels::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod attention;
mod sampler;

/// The launch shims (kernels/build.rs), declared from the kernels' signatures.
use kernels::cuda::emu::ffi;

/// Launch geometry for the shims: grid then block, (x, y, z) each.
fn geom(grid: [usize; 3], block: [usize; 3]) -> [u32; 6] {
    let mut g = [0u32; 6];
    for (o, v) in g.iter_mut().zip(grid.iter().chain(&block)) {
        *o = u32::try_from(*v).unwrap();
    }
    g
}

/// A grid-stride kernel over `n` items: blocks of 64 threads, at most 4 blocks (the grid
/// loop covers the rest, as on the GPU with a capped grid).
fn stride(n: usize) -> [u32; 6] {
    geom([n.div_ceil(64).clamp(1, 4), 1, 1], [64, 1, 1])
}

/// One block of `threads` per row.
fn per_row(rows: usize, threads: usize) -> [u32; 6] {
    geom([rows, 1, 1], [threads, 1, 1])
}

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
}

fn cpu(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_vec().unwrap()
}

fn i32s(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| i32::try_from(x).unwrap()).collect()
}

/// Bitwise equality (NaN payloads included).
fn bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

/// `|got − want| ≤ tol · (1 + |want|)` everywhere.
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn elementwise_kernels_equal_the_cpu_bitwise() {
    let (m, i) = (3, 37);
    let n = m * 2 * i;
    let (a0, b) = (rnd(n, 1), rnd(n, 2));
    let mut a = a0.clone();
    unsafe { ffi::emu_add_inplace(stride(n).as_ptr(), 0, a.as_mut_ptr(), b.as_ptr(), n as i64) };
    let mut want = cpu(&a0, &[n]);
    ops::add_inplace(&mut want, &cpu(&b, &[n])).unwrap();
    bitwise(&a, &host(&want), "add_inplace");

    let mut a = a0.clone();
    unsafe { ffi::emu_scale_add_inplace(stride(n).as_ptr(), 0, a.as_mut_ptr(), 0.93, b.as_ptr(), n as i64) };
    let mut want = cpu(&a0, &[n]);
    ops::scale_add_inplace(&mut want, 0.93, &cpu(&b, &[n])).unwrap();
    bitwise(&a, &host(&want), "scale_add_inplace");

    // The same update also writing the bf16 serving copy: the master as above, the copy its
    // round-to-nearest-even bf16.
    let mut a = a0.clone();
    let mut a16 = vec![0u16; n];
    unsafe {
        ffi::emu_scale_add_inplace_bf16(
            stride(n).as_ptr(),
            0,
            a.as_mut_ptr(),
            0.93,
            b.as_ptr(),
            a16.as_mut_ptr(),
            n as i64,
        )
    };
    bitwise(&a, &host(&want), "scale_add_inplace_bf16 master");
    assert!(a16.iter().zip(&a).all(|(&h, &x)| h == half::bf16::from_f32(x).to_bits()), "the bf16 copy");

    let mut y = vec![0.0; n];
    unsafe { ffi::emu_scale(stride(n).as_ptr(), 0, a0.as_ptr(), y.as_mut_ptr(), -1.7, n as i64) };
    bitwise(&y, &host(&ops::scale(&cpu(&a0, &[n]), -1.7).unwrap()), "scale");

    // Bias: against the CPU's linear with and without bias (same product, so the difference
    // is the bias add alone).
    let (x, w, bias) = (rnd(m * 5, 3), rnd(7 * 5, 4), rnd(7, 5));
    let pw = ops::pack_weight(&cpu(&w, &[7, 5])).unwrap();
    let mut y = host(&ops::linear(&cpu(&x, &[m, 5]), &pw, None).unwrap());
    unsafe { ffi::emu_add_bias(stride(m * 7).as_ptr(), 0, y.as_mut_ptr(), bias.as_ptr(), m as i32, 7) };
    bitwise(&y, &host(&ops::linear(&cpu(&x, &[m, 5]), &pw, Some(&cpu(&bias, &[7]))).unwrap()), "add_bias");

    let gu: Vec<f32> = rnd(n, 6).iter().map(|v| v * 6.0).collect();
    let mut out = vec![0.0; m * i];
    unsafe { ffi::emu_silu_mul(stride(m * i).as_ptr(), 0, gu.as_ptr(), out.as_mut_ptr(), m as i32, i as i32) };
    bitwise(&out, &host(&ops::silu_mul(&cpu(&gu, &[m, 2 * i])).unwrap()), "silu_mul");
    let da = rnd(m * i, 7);
    let mut d = vec![0.0; n];
    unsafe {
        ffi::emu_silu_mul_backward(
            stride(m * i).as_ptr(),
            0,
            gu.as_ptr(),
            da.as_ptr(),
            d.as_mut_ptr(),
            m as i32,
            i as i32,
        )
    };
    let want = ops::silu_mul_backward(&cpu(&gu, &[m, 2 * i]), &cpu(&da, &[m, i])).unwrap();
    bitwise(&d, &host(&want), "silu_mul_backward");

    // bf16 round-to-nearest-even against the `half` crate, ties and specials included.
    let mut x = rnd(200, 8);
    x.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::INFINITY, -0.0, f32::NAN, 3.4e38, 1e-40]);
    let mut y = vec![0u16; x.len()];
    unsafe { ffi::emu_f32_to_bf16(stride(x.len()).as_ptr(), 0, x.as_ptr(), y.as_mut_ptr(), x.len() as i64) };
    for (i, (&got, &v)) in y.iter().zip(&x).enumerate() {
        let want = half::bf16::from_f32(v);
        if v.is_nan() {
            assert!(half::bf16::from_bits(got).is_nan(), "bf16[{i}] of NaN");
        } else {
            assert_eq!(got, want.to_bits(), "bf16[{i}] of {v}");
        }
    }
}

/// `linear_bi` (gemm.cu, `--batch-invariant`) performs the CPU GEMM's FMA chains: bitwise
/// equal to the CPU backend's `linear` on sizes off the 64 × 64 tile and the 16-step stage
/// (m = 1, 5, 67; n = 70; k = 100 and 37), so each row is also bitwise the same alone and
/// in a batch.
#[test]
fn the_batch_invariant_gemm_is_the_cpu_gemm_bitwise() {
    let (n, wide) = (70usize, 67usize);
    for k in [100usize, 37] {
        let (x, w) = (rnd(wide * k, 40 + k as u64), rnd(n * k, 41 + k as u64));
        let pw = ops::pack_weight(&cpu(&w, &[n, k])).unwrap();
        let mut batched = vec![0.0f32; wide * n];
        for m in [1usize, 5, wide] {
            let mut y = vec![f32::NAN; m * n];
            let g = geom([n.div_ceil(64), m.div_ceil(64), 1], [16, 16, 1]);
            unsafe {
                ffi::emu_linear_bi(g.as_ptr(), 0, x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), m as i32, n as i32, k as i32)
            };
            let want = host(&ops::linear(&cpu(&x[..m * k], &[m, k]), &pw, None).unwrap());
            bitwise(&y, &want, &format!("linear_bi m {m} k {k}"));
            if m == wide {
                batched = y;
            }
        }
        // Row 3 of the batch against row 3 alone (m = 1 on its own row).
        let mut alone = vec![0.0f32; n];
        let g = geom([n.div_ceil(64), 1, 1], [16, 16, 1]);
        unsafe {
            ffi::emu_linear_bi(
                g.as_ptr(),
                0,
                x[3 * k..].as_ptr(),
                w.as_ptr(),
                alone.as_mut_ptr(),
                1,
                n as i32,
                k as i32,
            )
        };
        bitwise(&alone, &batched[3 * n..4 * n], "row 3 alone vs batched");
    }
}

#[test]
fn reductions_and_copies() {
    let (m, n) = (13, 45);
    let x = rnd(m * n, 10);
    let mut s = vec![0.0; n];
    unsafe { ffi::emu_sum_rows(stride(n).as_ptr(), 0, x.as_ptr(), s.as_mut_ptr(), m as i32, n as i32) };
    bitwise(&s, &host(&ops::sum_rows(&cpu(&x, &[m, n])).unwrap()), "sum_rows");

    // Sum of squares: three 65536-element chunks (the CPU's chunk) plus a tail; the chunk
    // sums and the final sum are trees here, sequential on the CPU: 1e-12 relative.
    let len = 3 * 65536 + 1234;
    let big = rnd(len, 11);
    let chunk = 65536usize;
    let parts = len.div_ceil(chunk);
    let (mut partial, mut total) = (vec![0.0f64; parts], 0.0f64);
    unsafe {
        ffi::emu_sum_squares_partial(
            per_row(parts, 64).as_ptr(),
            0,
            big.as_ptr(),
            len as i64,
            chunk as i64,
            partial.as_mut_ptr(),
        );
        ffi::emu_sum_f64(per_row(1, 64).as_ptr(), 0, partial.as_ptr(), parts as i32, &mut total, 0);
    }
    let want = ops::sum_squares(&cpu(&big, &[len])).unwrap();
    assert!((total - want).abs() <= 1e-12 * want, "sum_squares: {total} vs {want}");

    // Transpose: 37 × 45 (partial 32-tiles on both axes).
    let (r, c) = (37usize, 45usize);
    let x2 = rnd(r * c, 12);
    let mut t = vec![0.0; r * c];
    unsafe {
        ffi::emu_transpose(
            geom([c.div_ceil(32), r.div_ceil(32), 1], [32, 8, 1]).as_ptr(),
            0,
            x2.as_ptr(),
            t.as_mut_ptr(),
            r as i32,
            c as i32,
        )
    };
    let want: Vec<f32> = (0..c * r).map(|i| x2[(i % r) * c + i / r]).collect();
    bitwise(&t, &want, "transpose");

    // split_cols / cat_cols through copy_cols.
    let widths = [7usize, 30, 8];
    let parts_cpu = ops::split_cols(&cpu(&x, &[m, n]), &widths).unwrap();
    let mut off = 0;
    let mut cat = vec![0.0; m * n];
    for (w, want) in widths.iter().zip(&parts_cpu) {
        let mut part = vec![0.0; m * w];
        unsafe {
            let g = stride(m * w);
            ffi::emu_copy_cols(
                g.as_ptr(),
                0,
                x.as_ptr(),
                n as i32,
                off,
                part.as_mut_ptr(),
                *w as i32,
                0,
                m as i32,
                *w as i32,
            );
            ffi::emu_copy_cols(
                g.as_ptr(),
                0,
                part.as_ptr(),
                *w as i32,
                0,
                cat.as_mut_ptr(),
                n as i32,
                off,
                m as i32,
                *w as i32,
            );
        }
        bitwise(&part, &host(want), "split_cols");
        off += *w as i32;
    }
    let refs: Vec<&Tensor> = parts_cpu.iter().collect();
    bitwise(&cat, &host(&ops::cat_cols(&refs).unwrap()), "cat_cols");
}

/// RMSNorm (plain, fused with the residual, backward) on `[m, d]` against the CPU. The f64
/// sums of squares run as a tree here (sequentially on the CPU): outputs agree to 1e-6.
fn check_rms_norm(m: usize, d: usize, threads: usize) {
    let (x, w, dy, res) = (rnd(m * d, 20), rnd(d, 21), rnd(m * d, 22), rnd(m * d, 23));
    let eps = 1e-5;
    let g = per_row(m, threads);
    let mut y = vec![0.0; m * d];
    unsafe { ffi::emu_rms_norm(g.as_ptr(), 0, x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), m as i32, d as i32, eps) };
    close(&y, &host(&ops::rms_norm(&cpu(&x, &[m, d]), &cpu(&w, &[d]), eps).unwrap()), 1e-6, "rms_norm");

    let mut h = res.clone();
    unsafe {
        ffi::emu_rms_norm_residual(
            g.as_ptr(),
            0,
            x.as_ptr(),
            h.as_mut_ptr(),
            w.as_ptr(),
            y.as_mut_ptr(),
            m as i32,
            d as i32,
            eps,
        )
    };
    let mut want_h = cpu(&res, &[m, d]);
    ops::add_inplace(&mut want_h, &cpu(&x, &[m, d])).unwrap();
    bitwise(&h, &host(&want_h), "rms_norm_residual: residual");
    close(&y, &host(&ops::rms_norm(&want_h, &cpu(&w, &[d]), eps).unwrap()), 1e-6, "rms_norm_residual: y");

    let (mut dx, mut dw, mut rstd) = (vec![0.0; m * d], vec![0.0; d], vec![0.0f64; m]);
    unsafe {
        ffi::emu_rms_norm_backward(
            g.as_ptr(),
            0,
            x.as_ptr(),
            w.as_ptr(),
            dy.as_ptr(),
            dx.as_mut_ptr(),
            rstd.as_mut_ptr(),
            m as i32,
            d as i32,
            eps,
        );
        ffi::emu_rms_norm_backward_dw(
            stride(d).as_ptr(),
            0,
            x.as_ptr(),
            dy.as_ptr(),
            rstd.as_ptr(),
            dw.as_mut_ptr(),
            m as i32,
            d as i32,
        );
    }
    let (wdx, wdw) = ops::rms_norm_backward(&cpu(&x, &[m, d]), &cpu(&w, &[d]), &cpu(&dy, &[m, d]), eps).unwrap();
    close(&dx, &host(&wdx), 1e-6, "rms_norm_backward: dx");
    close(&dw, &host(&wdw), 1e-6, "rms_norm_backward: dw");
}

#[test]
fn rms_norm_kernels() {
    check_rms_norm(5, 100, 32);
    check_rms_norm(3, 576, 48);
}

/// RoPE over `[m, heads·head_dim]` at scattered positions; the CPU's operations in its order.
fn check_rope(m: usize, heads: usize, head_dim: usize) {
    let (half, max_pos) = (head_dim / 2, 300);
    let (cos, sin): (Vec<f32>, Vec<f32>) = (0..max_pos * half)
        .map(|i| {
            let a = (i / half) as f64 / 10000f64.powf(2.0 * (i % half) as f64 / head_dim as f64);
            (a.cos() as f32, a.sin() as f32)
        })
        .unzip();
    let positions: Vec<u32> = (0..m).map(|r| ((r * 37 + 5) % max_pos) as u32).collect();
    let c = heads * head_dim;
    let x0 = rnd(m * c, 30);
    let mut x = x0.clone();
    let pos = positions.clone();
    unsafe {
        ffi::emu_rope(
            stride(m * c / 2).as_ptr(),
            0,
            x.as_mut_ptr(),
            pos.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            m as i32,
            c as i32,
            head_dim as i32,
        )
    };
    let mut want = cpu(&x0, &[m, c]);
    ops::rope_inplace(&mut want, &positions, &cpu(&cos, &[max_pos, half]), &cpu(&sin, &[max_pos, half]), head_dim)
        .unwrap();
    bitwise(&x, &host(&want), "rope");
}

#[test]
fn rope_kernel() {
    check_rope(5, 3, 64);
    check_rope(3, 2, 128);
}

/// The launch shim of a scatter kernel (`dst, rows, src, n, c`) and the CPU op it mirrors.
type ScatterKernel = unsafe extern "C" fn(*const u32, usize, *mut f32, *const u32, *const f32, i32, i32);
type ScatterOp = fn(&mut Tensor, &[u32], &Tensor) -> kernels::Result<()>;

/// A scatter kernel on `table [_, c]` against its CPU op, bitwise (same adds in the same order).
fn check_scatter(kernel: ScatterKernel, op: ScatterOp, table: &[f32], ids: &[u32], src: &[f32], c: usize, what: &str) {
    let (rows, n) = (table.len() / c, ids.len());
    let mut dst = table.to_vec();
    unsafe { kernel(stride(n * c).as_ptr(), 0, dst.as_mut_ptr(), ids.as_ptr(), src.as_ptr(), n as i32, c as i32) };
    let mut want = cpu(table, &[rows, c]);
    op(&mut want, ids, &cpu(src, &[n, c])).unwrap();
    bitwise(&dst, &host(&want), what);
}

#[test]
fn row_gather_scatter_and_kv_cache_write() {
    let (rows, c) = (11usize, 19usize);
    let table = rnd(rows * c, 40);
    let ids: Vec<u32> = vec![3, 0, 10, 3, 7, 3, 10];
    let n = ids.len();
    let src = rnd(n * c, 41);
    let mut out = vec![0.0; n * c];
    unsafe {
        ffi::emu_gather_rows(
            stride(n * c).as_ptr(),
            0,
            table.as_ptr(),
            ids.as_ptr(),
            out.as_mut_ptr(),
            n as i32,
            c as i32,
        )
    };
    bitwise(&out, &host(&ops::embedding(&cpu(&table, &[rows, c]), &ids).unwrap()), "gather_rows");

    check_scatter(
        ffi::emu_scatter_rows,
        |d, r, s| ops::scatter_rows(d, r, s),
        &table,
        &ids,
        &src,
        c,
        "scatter_rows (repeats: the last wins)",
    );
    let what = "scatter_add_rows (repeats add in row order)";
    check_scatter(ffi::emu_scatter_add_rows, |d, r, s| ops::scatter_add_rows(d, r, s), &table, &ids, &src, c, what);

    // KV write: distinct slots, K and V at once, as two scatter_rows.
    let slots: Vec<u32> = vec![9, 2, 5, 0];
    let (k, v) = (rnd(slots.len() * c, 42), rnd(slots.len() * c, 43));
    let (mut kc, mut vc) = (rnd(rows * c, 44), rnd(rows * c, 45));
    let (mut wk, mut wv) = (cpu(&kc, &[rows, c]), cpu(&vc, &[rows, c]));
    unsafe {
        ffi::emu_kv_cache_write(
            stride(slots.len() * c).as_ptr(),
            0,
            k.as_ptr(),
            v.as_ptr(),
            kc.as_mut_ptr(),
            vc.as_mut_ptr(),
            slots.as_ptr(),
            slots.len() as i32,
            c as i32,
        )
    };
    ops::scatter_rows(&mut wk, &slots, &cpu(&k, &[slots.len(), c])).unwrap();
    ops::scatter_rows(&mut wv, &slots, &cpu(&v, &[slots.len(), c])).unwrap();
    bitwise(&kc, &host(&wk), "kv_cache_write: k");
    bitwise(&vc, &host(&wv), "kv_cache_write: v");
}

/// Softmax, log-softmax, token log-probs / entropies and their backward on `[m, v]` logits
/// at temperature `t`. The f64 sums are trees here (sequential on the CPU): 1e-6.
fn check_softmax_and_logprobs(m: usize, v: usize, t: f32, threads: usize) {
    let z: Vec<f32> = rnd(m * v, 50).iter().map(|x| x * 8.0).collect();
    let g = per_row(m, threads);
    let mut y = vec![0.0; m * v];
    unsafe { ffi::emu_softmax_rows(g.as_ptr(), 0, z.as_ptr(), y.as_mut_ptr(), m as i32, v as i32) };
    close(&y, &host(&ops::softmax(&cpu(&z, &[m, v])).unwrap()), 1e-6, "softmax");
    unsafe { ffi::emu_log_softmax_rows(g.as_ptr(), 0, z.as_ptr(), y.as_mut_ptr(), m as i32, v as i32) };
    close(&y, &host(&ops::log_softmax(&cpu(&z, &[m, v])).unwrap()), 1e-6, "log_softmax");

    let tokens: Vec<u32> = (0..m).map(|r| ((r * 131 + 7) % v) as u32).collect();
    let (mut lp, mut ent) = (vec![0.0; m], vec![0.0; m]);
    unsafe {
        ffi::emu_token_logprobs(
            g.as_ptr(),
            0,
            z.as_ptr(),
            tokens.as_ptr(),
            m as i32,
            v as i32,
            t,
            lp.as_mut_ptr(),
            ent.as_mut_ptr(),
        )
    };
    let (wlp, went) = ops::token_logprobs(&cpu(&z, &[m, v]), &tokens, t).unwrap();
    close(&lp, &wlp, 1e-6, "token_logprobs");
    close(&ent, &went, 1e-6, "entropies");

    let (dl, de) = (rnd(m, 51), rnd(m, 52));
    for with_entropy in [false, true] {
        let mut dz = vec![0.0; m * v];
        let de_ptr = if with_entropy { de.as_ptr() } else { std::ptr::null() };
        unsafe {
            ffi::emu_token_logprobs_backward(
                g.as_ptr(),
                0,
                z.as_ptr(),
                tokens.as_ptr(),
                m as i32,
                v as i32,
                t,
                dl.as_ptr(),
                de_ptr,
                went.as_ptr(),
                dz.as_mut_ptr(),
            )
        };
        let want =
            ops::token_logprobs_backward(&cpu(&z, &[m, v]), &tokens, t, &dl, with_entropy.then_some(&de[..]), &went)
                .unwrap();
        close(&dz, &host(&want), 1e-6, "token_logprobs_backward");
    }
}

#[test]
fn softmax_and_logprob_kernels() {
    check_softmax_and_logprobs(3, 301, 1.0, 64);
    check_softmax_and_logprobs(4, 97, 0.7, 40);
}

#[test]
fn adamw_kernels_equal_the_cpu_bitwise() {
    let n = 517;
    let (g, m0, v0) = (rnd(n, 60), rnd(n, 61), rnd(n, 62).iter().map(|x| x.abs()).collect::<Vec<_>>());
    let s = AdamWStep {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        bias_correction1: 1.0 - 0.9f64.powi(7),
        bias_correction2: 1.0 - 0.999f64.powi(7),
        clip: 0.37,
    };
    let (mut m, mut v, mut d) = (m0.clone(), v0.clone(), vec![0.0; n]);
    unsafe {
        ffi::emu_adamw_delta(
            stride(n).as_ptr(),
            0,
            g.as_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            d.as_mut_ptr(),
            n as i64,
            s.lr,
            s.beta1,
            s.beta2,
            s.eps,
            s.bias_correction1,
            s.bias_correction2,
            s.clip,
        )
    };
    let (mut wm, mut wv) = (cpu(&m0, &[n]), cpu(&v0, &[n]));
    let wd = ops::adamw_delta(&cpu(&g, &[n]), &mut wm, &mut wv, &s).unwrap();
    bitwise(&d, &host(&wd), "adamw delta");
    bitwise(&m, &host(&wm), "adamw m");
    bitwise(&v, &host(&wv), "adamw v");
}

/// The emulation's primitives that the kernels above do not use (kernels/cuda/emu/selftest.cu),
/// against hand-derived values: shuffles, ballot, shared and global atomics, f16 rounding.
#[test]
fn simt_emulation_primitives() {
    let (blocks, threads) = (3usize, 64usize);
    let n = blocks * threads;
    let (mut out, mut sum, mut mx, mut fsum) = (vec![0i32; 5 * n], 0i32, -1i32, 0.0f32);
    unsafe {
        ffi::emu_selftest_warp(per_row(blocks, threads).as_ptr(), 0, out.as_mut_ptr(), &mut sum, &mut mx, &mut fsum)
    };
    for g in 0..n {
        let (t, l) = ((g % threads) as i32, (g % 32) as i32);
        let want = [
            if l + 3 < 32 { t + 3 } else { t },
            if l >= 2 { t - 2 } else { t },
            t - l + 5,
            0x4924_9249,
            (0..threads as i32).sum(),
        ];
        assert_eq!(out[5 * g..5 * g + 5], want, "thread {g}");
    }
    assert_eq!((sum, mx, fsum), ((0..n as i32).sum(), n as i32 - 1, 0.5 * n as f32));

    // f16 and bf16: ties to even, subnormals, overflow to inf, NaN.
    let mut x = rnd(100, 95).iter().map(|v| v * 70000.0).collect::<Vec<_>>();
    x.extend([1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, 65519.0, 65520.0, 3e-8, 6e-8, 1e-5, -0.0, f32::NEG_INFINITY]);
    x.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3.4e38, 1e-40]);
    let k = x.len();
    let (mut bits, mut back, mut bbits, mut bback) = (vec![0u16; k], vec![0.0f32; k], vec![0u16; k], vec![0.0f32; k]);
    unsafe {
        ffi::emu_selftest_half(
            stride(k).as_ptr(),
            0,
            x.as_ptr(),
            bits.as_mut_ptr(),
            back.as_mut_ptr(),
            bbits.as_mut_ptr(),
            bback.as_mut_ptr(),
            k as i32,
        )
    };
    for (i, &v) in x.iter().enumerate() {
        let (h, b) = (half::f16::from_f32(v), half::bf16::from_f32(v));
        assert_eq!(bits[i], h.to_bits(), "f16 bits of {v}");
        assert_eq!(back[i].to_bits(), h.to_f32().to_bits(), "f16 value of {v}");
        assert_eq!(bbits[i], b.to_bits(), "bf16 bits of {v}");
        assert_eq!(bback[i].to_bits(), b.to_f32().to_bits(), "bf16 value of {v}");
    }
}
