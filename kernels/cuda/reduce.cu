// Reductions over whole buffers: column sums (bias gradients) and the f64 sum of squares
// (global gradient norm).
#include "common.cuh"

// sum_rows(x [m, n], out [n], m, n): out[c] = Σ_r x[r, c], rows added in order in f32
// (contract `sum_rows`; the CPU's row-by-row add_inplace: bitwise equal).
// Launch: grid-stride over columns; any grid and block (host: 256 threads).
extern "C" __global__ void sum_rows(const float* x, float* out, int m, int n) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n; c += gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < m; ++r) s += x[(long long)r * n + c];
        out[c] = s;
    }
}

// sum_squares_partial(x [n], n, chunk, partial [ceil(n / chunk)]): partial[b] = Σ x² (f64) over
// elements [b·chunk, (b+1)·chunk). Launch: grid ceil(n / chunk), any block ≤ 1024 (host:
// 256), no dynamic shared memory. Fixed order: each thread sums its stride in f64, then
// the block tree of common.cuh. Second stage: sum_f64. The CPU sums 65536-element chunks
// sequentially and then the chunk sums; the orders differ, so results agree to ~1e-15
// relative, not bitwise (contract `sum_squares`).
extern "C" __global__ void sum_squares_partial(const float* x, long long n, long long chunk, double* partial) {
    __shared__ double red[RLS_MAX_THREADS];
    long long start = (long long)blockIdx.x * chunk, end = start + chunk < n ? start + chunk : n;
    double s = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) s += (double)x[i] * (double)x[i];
    s = rls_block_reduce(s, red, RlsSum());
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// sum_f64(x [n], n, out [at + 1], at): out[at] = Σ x in f64 (the total of one tensor of a
// multi-tensor sum of squares goes to its slot). Launch: grid 1, any block ≤ 1024 (host: 256).
extern "C" __global__ void sum_f64(const double* x, int n, double* out, int at) {
    __shared__ double red[RLS_MAX_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = rls_block_reduce(s, red, RlsSum());
    if (threadIdx.x == 0) out[at] = s;
}
