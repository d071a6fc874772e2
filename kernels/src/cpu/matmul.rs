//! `y [m, n] = x [m, k] · w [n, k]ᵀ`.

use super::simd::dot;
use gemm::Parallelism;
use rayon::prelude::*;

/// GEMV work split: about this many tasks per thread, each at least `GEMV_MIN_ROWS` rows.
const GEMV_TASKS_PER_THREAD: usize = 2;
const GEMV_MIN_ROWS: usize = 16;

/// Computes `y = x · wᵀ` with `x [m, k]`, `w [n, k]`, `y [m, n]` (all row-major).
pub fn matmul_t(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    assert!(x.len() == m * k && w.len() == n * k && y.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if m == 1 {
        // Few, contiguous tasks: each thread streams long runs of weight rows.
        let rows = n.div_ceil(rayon::current_num_threads() * GEMV_TASKS_PER_THREAD).max(GEMV_MIN_ROWS);
        y.par_chunks_mut(rows).enumerate().for_each(|(c, ys)| {
            for (j, yj) in ys.iter_mut().enumerate() {
                let r = c * rows + j;
                *yj = dot(x, &w[r * k..(r + 1) * k]);
            }
        });
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    // SAFETY: the pointers cover m·k, n·k and m·n elements with the strides given:
    // dst[i, j] at i·n + j; lhs[i, l] at i·k + l; rhs[l, j] = w[j, l] at j·k + l.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
}
