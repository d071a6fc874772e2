// Token log-probabilities, entropies and their gradient w.r.t. the logits: the one formula
// of the sampler's raw log-probability (T = 1) and the learner's ℓ (DESIGN-NOTES §3), as
// kernels/src/cpu/logprob.rs, in f64 with the max subtracted:
//   ℓ = (z_tok − max)/T − ln Σ_j exp((z_j − max)/T)
//   H = −Σ_j p_j ln p_j,  p = softmax(z/T)   (nats; terms with p_j = 0 skipped)
//   dz_j = g·(1[j = tok] − p_j)/T + e·(−p_j (ln p_j + H)/T)   (hand-derived; checked by
//   finite differences in the learner tests)
// Launch (both): one block per row, grid m, any block ≤ 1024 (host: 256), no dynamic shared
// memory. The f64 sums run in common.cuh's tree order (CPU: sequential) and the device
// exp/log are not glibc's, so values agree with the CPU to ~1e-7 relative, not bitwise.
#include "common.cuh"

// token_logprobs(logits [m, v], tokens [m], m, v, temperature, logp [m], entropy [m])
// (contract `token_logprobs`).
extern "C" __global__ void token_logprobs(const float* logits, const unsigned* tokens, int m, int v, float temperature,
                                          float* logp, float* entropy) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    const float* z = logits + (long long)blockIdx.x * v;
    double t = (double)temperature, mx = (double)rls_row_max(z, v, redf);
    double zs = rls_row_partition(z, v, mx, t, red);
    double h = 0.0;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        double w = exp(((double)z[j] - mx) / t);
        if (w > 0.0) h += (w / zs) * log(w / zs);
    }
    h = rls_block_reduce(h, red, RlsSum());
    if (threadIdx.x == 0) {
        logp[blockIdx.x] = (float)(((double)z[tokens[blockIdx.x]] - mx) / t - log(zs));
        entropy[blockIdx.x] = (float)(-h);
    }
}

// token_logprobs_backward(logits [m, v], tokens [m], m, v, temperature, dl_dlogp [m],
//   dl_dentropy [m] or null, entropies [m] (token_logprobs' output), dz [m, v])
// (contract `token_logprobs_backward`).
extern "C" __global__ void token_logprobs_backward(const float* logits, const unsigned* tokens, int m, int v,
                                                   float temperature, const float* dl_dlogp, const float* dl_dentropy,
                                                   const float* entropies, float* dz) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    long long row = blockIdx.x;
    const float* z = logits + row * v;
    double tinv = 1.0 / (double)temperature, mx = (double)rls_row_max(z, v, redf);
    double s = 0.0;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += exp(((double)z[j] - mx) * tinv);
    double zinv = 1.0 / rls_block_reduce(s, red, RlsSum());
    double g = (double)dl_dlogp[row], e = dl_dentropy ? (double)dl_dentropy[row] : 0.0, hh = (double)entropies[row];
    unsigned tok = tokens[row];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        double p = exp(((double)z[j] - mx) * tinv) * zinv;
        double onehot = (unsigned)j == tok ? 1.0 : 0.0;
        double dh = p > 0.0 ? -tinv * p * (log(p) + hh) : 0.0;
        dz[row * v + j] = (float)(g * tinv * (onehot - p) + e * dh);
    }
}
