// The batch-invariant GEMM of `--batch-invariant` (contract `linear` on CUDA in that mode):
// y [m, n] = x [m, k] · w [n, k]ᵀ, both row-major, w as stored (the CUDA layout is the
// row-major one).
//
// Reduction order: every output is one sequential FMA chain over the reduction from zero,
// acc = 0; for l in 0..k: acc = fmaf(x[i, l], w[j, l], acc), exactly the CPU GEMM's contract
// (kernels/src/cpu/matmul.rs). No split-K, no tree: the tile sizes only decide which thread
// computes an output, never the order of its sums, so y[i, j] does not depend on m, on the
// other rows, on the tile it falls in, or on the device: it is bitwise the CPU's value (with
// --fmad=false, nvrtc_options.txt). A token's logits are therefore the same whether it is
// decoded alone, prefilled in a chunk, batched, or recomputed by the learner (ℓ = μ, the
// approach of Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025).
// cuBLAS SGEMM, used otherwise, splits and reorders the reduction by shape.
//
// linear_bi(x, w, y, m, n, k). Launch: grid (ceil(n / 64), ceil(m / 64)), block (16, 16);
// no dynamic shared memory. Each block computes a 64 × 64 tile of y, each thread 4 × 4
// outputs (rows ty + 16·a, columns tx + 16·b), staging 16 reduction steps of x and w in
// shared memory at a time.
#include "common.cuh"

#define RLS_BI_TILE 64
#define RLS_BI_STEP 16

extern "C" __global__ void linear_bi(const float* x, const float* w, float* y, int m, int n, int k) {
    __shared__ float xs[RLS_BI_STEP][RLS_BI_TILE];
    __shared__ float ws[RLS_BI_STEP][RLS_BI_TILE];
    int tx = threadIdx.x, ty = threadIdx.y, t = ty * 16 + tx;
    int r0 = blockIdx.y * RLS_BI_TILE, c0 = blockIdx.x * RLS_BI_TILE;
    float acc[4][4];
    for (int a = 0; a < 4; ++a)
        for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
    for (int k0 = 0; k0 < k; k0 += RLS_BI_STEP) {
        int steps = k - k0 < RLS_BI_STEP ? k - k0 : RLS_BI_STEP;
        // 64 rows × 16 steps of each operand, read along the reduction (coalesced).
        for (int e = t; e < RLS_BI_TILE * RLS_BI_STEP; e += 256) {
            int r = e / RLS_BI_STEP, l = e % RLS_BI_STEP, gl = k0 + l;
            xs[l][r] = (r0 + r < m && gl < k) ? x[(long long)(r0 + r) * k + gl] : 0.0f;
            ws[l][r] = (c0 + r < n && gl < k) ? w[(long long)(c0 + r) * k + gl] : 0.0f;
        }
        __syncthreads();
        for (int l = 0; l < steps; ++l) {
            float xa[4], wb[4];
            for (int a = 0; a < 4; ++a) xa[a] = xs[l][ty + 16 * a];
            for (int b = 0; b < 4; ++b) wb[b] = ws[l][tx + 16 * b];
            for (int a = 0; a < 4; ++a)
                for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(xa[a], wb[b], acc[a][b]);
        }
        __syncthreads();
    }
    for (int a = 0; a < 4; ++a) {
        int r = r0 + ty + 16 * a;
        if (r >= m) continue;
        for (int b = 0; b < 4; ++b) {
            int c = c0 + tx + 16 * b;
            if (c < n) y[(long long)r * n + c] = acc[a][b];
        }
    }
}
