// Row-wise softmax and log-softmax (max-subtracted), as the CPU backend
// (kernels/src/cpu/elementwise.rs): softmax's sum of f32 exponentials and log-softmax's
// sum of f64 exponentials accumulate in f64.
//
// Launch (both): one block per row, grid m, any block ≤ 1024 (host: 256), no dynamic shared
// memory. The f64 sums run in common.cuh's fixed tree order (the CPU sums sequentially):
// results agree with the CPU to ~1 ulp.
#include "common.cuh"

// softmax_rows(x [m, n], y [m, n], m, n): y = e / Σe with e = exp(x − max) (f32), Σ in f64
// (contract `softmax`). x and y may alias.
extern "C" __global__ void softmax_rows(const float* x, float* y, int m, int n) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float mx = rls_row_max(xr, n, redf);
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(xr[i] - mx);
        yr[i] = e;
        s += (double)e;
    }
    s = rls_block_reduce(s, red, RlsSum());
    float inv = (float)(1.0 / s);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] *= inv;
}

// log_softmax_rows(x [m, n], y [m, n], m, n): y = (x − max) − f32(ln Σ exp(f64(x − max)))
// (contract `log_softmax`). x and y may alias.
extern "C" __global__ void log_softmax_rows(const float* x, float* y, int m, int n) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float mx = rls_row_max(xr, n, redf);
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp((double)(xr[i] - mx));
    s = rls_block_reduce(s, red, RlsSum());
    float ln_sum = (float)log(s);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] - mx) - ln_sum;
}
