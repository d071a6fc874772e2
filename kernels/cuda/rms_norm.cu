// RMSNorm forward (plain and fused with the residual add) and backward.
// y = x / sqrt(mean(x²) + eps) · w (Zhang & Sennrich 2019, eq. 4; HF LlamaRMSNorm), with the
// mean of squares accumulated in f64 as the CPU backend (kernels/src/cpu/elementwise.rs).
//
// The row kernels take one block per row: grid m, any block ≤ 1024 (host: 256), no dynamic
// shared memory. The f64 sum runs in the fixed order of common.cuh's block tree; the CPU
// sums sequentially, so the f64 sums differ by ~1e-16 relative and the f32 outputs agree
// to 1 ulp (almost always bitwise).
#include "common.cuh"

/// 1 / sqrt(Σ x² / d + eps) of one row, in f64 (every thread gets it).
__device__ double rls_row_rstd(const float* x, int d, float eps, double* red) {
    double s = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += (double)x[i] * (double)x[i];
    s = rls_block_reduce(s, red, RlsSum());
    return 1.0 / sqrt(s / (double)d + (double)eps);
}

// rms_norm(x [m, d], w [d], y [m, d], m, d, eps) (contract `rms_norm`).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, int m, int d, float eps) {
    __shared__ double red[RLS_MAX_THREADS];
    const float* xr = x + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    float inv = (float)rls_row_rstd(xr, d, eps, red);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// rms_norm_residual(x [m, d], residual [m, d], w [d], y [m, d], m, d, eps): the decoder
// layer's "residual += x; y = rms_norm(residual)" in one pass: residual is updated in place
// (f32 add, as `add_inplace`) and y is the RMSNorm of the sum. Same launch as rms_norm.
extern "C" __global__ void rms_norm_residual(const float* x, float* residual, const float* w, float* y, int m, int d,
                                             float eps) {
    __shared__ double red[RLS_MAX_THREADS];
    const float* xr = x + (long long)blockIdx.x * d;
    float* hr = residual + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    // Each thread updates the elements it later reads (same stride), then the reduction syncs.
    for (int i = threadIdx.x; i < d; i += blockDim.x) hr[i] += xr[i];
    float inv = (float)rls_row_rstd(hr, d, eps, red);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = hr[i] * inv * w[i];
}

// rms_norm_backward(x [m, d], w [d], dy [m, d], dx [m, d], rstd [m] (f64, out), m, d, eps):
// with r = 1/sqrt(mean(x²) + eps): dx = r·dy·w − x·r³·Σ(dy·w·x)/d (f64), and r per row for
// rms_norm_backward_dw (kernels/src/cpu/backward.rs). Same launch as rms_norm.
extern "C" __global__ void rms_norm_backward(const float* x, const float* w, const float* dy, float* dx, double* rstd,
                                             int m, int d, float eps) {
    __shared__ double red[RLS_MAX_THREADS];
    long long off = (long long)blockIdx.x * d;
    const float *xr = x + off, *dyr = dy + off;
    double r = rls_row_rstd(xr, d, eps, red);
    double gx = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) gx += (double)dyr[i] * (double)w[i] * (double)xr[i];
    gx = rls_block_reduce(gx, red, RlsSum());
    double c = r * r * r * gx / (double)d;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        dx[off + i] = (float)(r * (double)dyr[i] * (double)w[i] - (double)xr[i] * c);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// rms_norm_backward_dw(x [m, d], dy [m, d], rstd [m], dw [d], m, d): dw[c] = Σ_r f32(dy·x·r),
// rows added in order in f32 as the CPU. Launch: grid-stride over columns, any grid and
// block (host: 256). Run after rms_norm_backward (which writes rstd).
extern "C" __global__ void rms_norm_backward_dw(const float* x, const float* dy, const double* rstd, float* dw, int m,
                                                int d) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < d; c += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < m; ++r) {
            long long i = (long long)r * d + c;
            acc += (float)((double)dy[i] * (double)x[i] * rstd[r]);
        }
        dw[c] = acc;
    }
}
