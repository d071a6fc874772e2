// AdamW (Loshchilov & Hutter 2019, Alg. 2; PyTorch torch.optim.AdamW), the formula of
// kernels/src/ops.rs `adamw_delta` / the CPU backend, in f64 per element:
//   g' = clip·g,  m ← β₁m + (1−β₁)g',  v ← β₂v + (1−β₂)g'²,
//   Δ = −lr · (m / bc1) / (√(v / bc2) + ε),  bc1 = 1 − β₁ᵗ, bc2 = 1 − β₂ᵗ.
// Every operation is an IEEE-rounded f64 op (sqrt included), so with --fmad=false the
// results are bitwise equal to the CPU's.
// Launch (both): grid-stride over n; any grid and block (host: 256); no shared memory.
#include "common.cuh"

/// One element's moment update (m, v in place) and its step Δ.
__device__ __forceinline__ float rls_adamw_step(float g, float* m, float* v, double lr, double beta1, double beta2,
                                                double eps, double bc1, double bc2, double clip) {
    double gi = (double)g * clip;
    double mi = beta1 * (double)*m + (1.0 - beta1) * gi;
    double vi = beta2 * (double)*v + (1.0 - beta2) * gi * gi;
    *m = (float)mi;
    *v = (float)vi;
    return (float)(-lr * (mi / bc1) / (sqrt(vi / bc2) + eps));
}

// adamw_delta(g [n], m [n], v [n], delta [n], n, lr, beta1, beta2, eps, bc1, bc2, clip):
// advances m, v in place and writes Δ (contract `adamw_delta`).
extern "C" __global__ void adamw_delta(const float* g, float* m, float* v, float* delta, long long n, double lr,
                                       double beta1, double beta2, double eps, double bc1, double bc2, double clip) {
    RLS_GRID_STRIDE(i, n)
        delta[i] = rls_adamw_step(g[i], &m[i], &v[i], lr, beta1, beta2, eps, bc1, bc2, clip);
}

// adamw_apply(g [n], m [n], v [n], master [n], copy [n] (bf16 bits) or null, n, lr, beta1, beta2,
//   eps, bc1, bc2, clip, decay): the fused update: master = master·decay + Δ (decay =
// 1 − lr·weight_decay; the f32 ops of `scale_add_inplace`), then copy = bf16(master)
// (round to nearest even): the serving copy rewritten in the same launch.
extern "C" __global__ void adamw_apply(const float* g, float* m, float* v, float* master, unsigned short* copy,
                                       long long n, double lr, double beta1, double beta2, double eps, double bc1,
                                       double bc2, double clip, float decay) {
    RLS_GRID_STRIDE(i, n) {
        float d = rls_adamw_step(g[i], &m[i], &v[i], lr, beta1, beta2, eps, bc1, bc2, clip);
        float p = master[i] * decay + d;
        master[i] = p;
        if (copy) copy[i] = rls_bf16_rne(p);
    }
}
