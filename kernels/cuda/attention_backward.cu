// Backward of causal GQA attention over packed sequences (the learner's varlen batch), as
// kernels/src/cpu/backward.rs `attention_backward`. Sequence s is rows spans[s] of
// q [t, n_heads·D], k/v [t, n_kv_heads·D], da [t, n_heads·D], at positions 0..len; with
// p_ij = softmax_j(q_i·k_j/√D) (recomputed, the forward's formula) and dp_ij = da_i·v_j:
//   ds_ij = p_ij (dp_ij − Σ_j p_ij dp_ij) / √D,
//   dq_i = Σ_j ds_ij k_j,  dk_j = Σ_{h in group} Σ_i ds_ij q_i,  dv_j = Σ_{h, i} p_ij da_i.
// Three kernels, no atomics, each output owned by one block and summed in a fixed order:
//   1. attention_backward_stats: per (row, head) the softmax max, 1/Σ and D_i = Σ_j p dp;
//   2. attention_backward_dq: dq (sum over keys j ascending, as the CPU);
//   3. attention_backward_dkdv: dk, dv (sum over heads of the group, then rows i ascending,
//      as the CPU).
// Shared arguments: row_start [t], row_end [t] (int32): the span of row r (its position is
// r − row_start[r]); row_start = −1 for a row in no span (its gradients are zero);
// stats [t, n_heads, 3] (f32: max, 1/Σ, D); scale = 1/√D.
// Launch (all): grid (heads, t) with heads = n_heads (1, 2) or n_kv_heads (3); any block
// ≤ 1024 (host: 128). Dynamic shared memory: none (1), (blockDim + D)·4 bytes (2),
// (2·blockDim + 2·D)·4 bytes (3). Dot products run sequentially over D (the CPU's are SIMD),
// so results agree with the CPU to ~1e-6 relative, not bitwise.
#include "common.cuh"

/// Sequential dot product of two rows of length n.
__device__ __forceinline__ float rls_dot(const float* a, const float* b, int n) {
    float s = 0.0f;
    for (int d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

extern "C" __global__ void attention_backward_stats(const float* q, const float* k, const float* v, const float* da,
                                                    const int* row_start, float* stats, int n_heads, int n_kv_heads,
                                                    int head_dim, float scale) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    int h = blockIdx.x, i = blockIdx.y, s0 = row_start[i];
    if (s0 < 0) return;
    int D = head_dim, kvh = h / (n_heads / n_kv_heads);
    long long qc = (long long)n_heads * D, kc = (long long)n_kv_heads * D;
    const float *qi = q + i * qc + (long long)h * D, *dai = da + i * qc + (long long)h * D;
    float mx = RLS_NEG_INF;
    for (int j = s0 + threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, rls_dot(qi, k + j * kc + kvh * D, D) * scale);
    mx = rls_block_reduce(mx, redf, RlsMax());
    double sum = 0.0;
    for (int j = s0 + threadIdx.x; j <= i; j += blockDim.x)
        sum += (double)expf(rls_dot(qi, k + j * kc + kvh * D, D) * scale - mx);
    float inv = (float)(1.0 / rls_block_reduce(sum, red, RlsSum()));
    float pdp = 0.0f;
    for (int j = s0 + threadIdx.x; j <= i; j += blockDim.x) {
        float p = expf(rls_dot(qi, k + j * kc + kvh * D, D) * scale - mx) * inv;
        pdp += p * rls_dot(dai, v + j * kc + kvh * D, D);
    }
    pdp = rls_block_reduce(pdp, redf, RlsSum());
    if (threadIdx.x == 0) {
        float* st = stats + ((long long)i * n_heads + h) * 3;
        st[0] = mx;
        st[1] = inv;
        st[2] = pdp;
    }
}

extern "C" __global__ void attention_backward_dq(const float* q, const float* k, const float* v, const float* da,
                                                 const int* row_start, const float* stats, float* dq, int n_heads,
                                                 int n_kv_heads, int head_dim, float scale) {
    RLS_DYN_SMEM(float, sm);
    int h = blockIdx.x, i = blockIdx.y, s0 = row_start[i], D = head_dim, B = blockDim.x;
    float *ds = sm, *acc = sm + B;
    long long qc = (long long)n_heads * D, kc = (long long)n_kv_heads * D;
    float* out = dq + i * qc + (long long)h * D;
    if (s0 < 0) {
        for (int d = threadIdx.x; d < D; d += B) out[d] = 0.0f;
        return;
    }
    int kvh = h / (n_heads / n_kv_heads);
    const float *qi = q + i * qc + (long long)h * D, *dai = da + i * qc + (long long)h * D;
    const float* st = stats + ((long long)i * n_heads + h) * 3;
    for (int d = threadIdx.x; d < D; d += B) acc[d] = 0.0f;
    for (int c0 = s0; c0 <= i; c0 += B) {
        int j = c0 + threadIdx.x;
        float g = 0.0f;
        if (j <= i) {
            float p = expf(rls_dot(qi, k + j * kc + kvh * D, D) * scale - st[0]) * st[1];
            g = p * (rls_dot(dai, v + j * kc + kvh * D, D) - st[2]) * scale;
        }
        ds[threadIdx.x] = g;
        __syncthreads();
        int n = i - c0 + 1 < B ? i - c0 + 1 : B;
        for (int d = threadIdx.x; d < D; d += B) {
            float a = acc[d];
            for (int jj = 0; jj < n; ++jj) a += ds[jj] * k[(c0 + jj) * kc + kvh * D + d];
            acc[d] = a;
        }
        __syncthreads();
    }
    for (int d = threadIdx.x; d < D; d += B) out[d] = acc[d];
}

extern "C" __global__ void attention_backward_dkdv(const float* q, const float* k, const float* v, const float* da,
                                                   const int* row_start, const int* row_end, const float* stats,
                                                   float* dk, float* dv, int n_heads, int n_kv_heads, int head_dim,
                                                   float scale) {
    RLS_DYN_SMEM(float, sm);
    int g = blockIdx.x, j = blockIdx.y, D = head_dim, B = blockDim.x, group = n_heads / n_kv_heads;
    float *pb = sm, *dsb = sm + B, *acck = sm + 2 * B, *accv = acck + D;
    long long qc = (long long)n_heads * D, kc = (long long)n_kv_heads * D;
    for (int d = threadIdx.x; d < D; d += B) acck[d] = accv[d] = 0.0f;
    if (row_start[j] >= 0) {
        int e = row_end[j];
        const float *kj = k + j * kc + (long long)g * D, *vj = v + j * kc + (long long)g * D;
        for (int hh = 0; hh < group; ++hh) {
            int h = g * group + hh;
            for (int c0 = j; c0 < e; c0 += B) {
                int i = c0 + threadIdx.x;
                float p = 0.0f, gs = 0.0f;
                if (i < e) {
                    const float* st = stats + ((long long)i * n_heads + h) * 3;
                    p = expf(rls_dot(q + i * qc + (long long)h * D, kj, D) * scale - st[0]) * st[1];
                    gs = p * (rls_dot(da + i * qc + (long long)h * D, vj, D) - st[2]) * scale;
                }
                pb[threadIdx.x] = p;
                dsb[threadIdx.x] = gs;
                __syncthreads();
                int n = e - c0 < B ? e - c0 : B;
                for (int d = threadIdx.x; d < D; d += B) {
                    float ak = acck[d], av = accv[d];
                    for (int ii = 0; ii < n; ++ii) {
                        long long r = (long long)(c0 + ii) * qc + (long long)h * D + d;
                        ak += dsb[ii] * q[r];
                        av += pb[ii] * da[r];
                    }
                    acck[d] = ak;
                    accv[d] = av;
                }
                __syncthreads();
            }
        }
    }
    for (int d = threadIdx.x; d < D; d += B) {
        dk[j * kc + (long long)g * D + d] = acck[d];
        dv[j * kc + (long long)g * D + d] = accv[d];
    }
}
