// AdamW (Loshchilov & Hutter 2019, Alg. 2), the formula of kernels/src/ops.rs
// `adamw_delta` / the CPU backend (kernels/src/cpu/optim.rs): f32 in PyTorch's operation
// order (torch.optim.AdamW, single-tensor path), coefficients rounded to f32 from the f64
// arguments exactly as the CPU does:
//   g' = clip·g,  m ← m + (1−β₁)(g' − m),  v ← v·β₂ + (1−β₂)·g'·g',
//   Δ = −(lr / bc1) · (m / (√v / √bc2 + ε)),  bc1 = 1 − β₁ᵗ, bc2 = 1 − β₂ᵗ.
// Every operation is an IEEE-rounded op (sqrtf and the division too, NVRTC's defaults), so
// with --fmad=false the results are bitwise equal to the CPU's.
// Launch: grid-stride over n; any grid and block (host: 256); no shared memory.
#include "common.cuh"

/// One element's moment update (m, v in place) and its step Δ.
__device__ __forceinline__ float rls_adamw_step(float g, float* m, float* v, double lr, double beta1, double beta2,
                                                double eps, double bc1, double bc2, double clip) {
    const float c = (float)clip, omb1 = (float)(1.0 - beta1), b2 = (float)beta2, omb2 = (float)(1.0 - beta2);
    const float bc2_sqrt = (float)sqrt(bc2), epsf = (float)eps, neg_step = (float)(-lr / bc1);
    float gi = c == 1.0f ? g : g * c;
    float mi = *m + omb1 * (gi - *m);
    float vi = *v * b2 + omb2 * gi * gi;
    *m = mi;
    *v = vi;
    return neg_step * (mi / (sqrtf(vi) / bc2_sqrt + epsf));
}

// adamw_delta(g [n], m [n], v [n], delta [n], n, lr, beta1, beta2, eps, bc1, bc2, clip):
// advances m, v in place and writes Δ (contract `adamw_delta`).
extern "C" __global__ void adamw_delta(const float* g, float* m, float* v, float* delta, long long n, double lr,
                                       double beta1, double beta2, double eps, double bc1, double bc2, double clip) {
    RLS_GRID_STRIDE(i, n)
        delta[i] = rls_adamw_step(g[i], &m[i], &v[i], lr, beta1, beta2, eps, bc1, bc2, clip);
}
