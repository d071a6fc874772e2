// Shared device helpers of the rlserve kernels (included by every kernels/cuda/*.cu).
//
// Compiles under NVRTC (options in nvrtc_options.txt, this directory on the include path)
// and under the SIMT emulation (emu/simt.h, which defines RLSERVE_EMU). The one guard of
// the sources is below: the dynamic shared memory declaration. No CUDA header is included,
// so compiling at run time needs libnvrtc alone (bf16 values are stored as their 16 bits,
// rounded by rls_bf16_rne).
//
// Reductions here run in a fixed order for a given blockDim (a shared-memory tree over the
// threads' partials, or a warp xor-butterfly), so a result never depends on timing, and the
// host fixes blockDim per op so a row's result never depends on the batch either.
#pragma once

#ifdef RLSERVE_EMU
#define RLS_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::dyn_smem())
#else
#define RLS_DYN_SMEM(T, name)                                   \
    extern __shared__ __align__(16) unsigned char rls_smem_[]; \
    T* name = reinterpret_cast<T*>(rls_smem_)
#endif

/// -inf as a float constant (no <math.h> under NVRTC).
#define RLS_NEG_INF __int_as_float(0xff800000)

/// Largest blockDim any kernel of this project is launched with.
#define RLS_MAX_THREADS 1024

/// Grid-stride loop: `i` runs over 0..n, spread over every thread of the grid.
#define RLS_GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

/// Linear thread id within the block.
__device__ __forceinline__ unsigned rls_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

/// Threads of the block.
__device__ __forceinline__ unsigned rls_nthreads() { return blockDim.x * blockDim.y * blockDim.z; }

struct RlsSum {
    template <class T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct RlsMax {
    template <class T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

/// Reduces one value per thread over the block with `op`, as a tree over thread ids: step
/// `s` (the largest power of two below the thread count, then halving) combines
/// `scratch[i]` with `scratch[i + s]`. The order is fixed by blockDim alone. Every thread
/// must call it; all get the result. `scratch` is shared memory of at least blockDim values.
template <class T, class Op>
__device__ T rls_block_reduce(T v, T* scratch, Op op) {
    unsigned t = rls_tid(), n = rls_nthreads();
    scratch[t] = v;
    __syncthreads();
    unsigned s = 1;
    while (s * 2 < n) s *= 2;
    for (; s > 0; s >>= 1) {
        if (t < s && t + s < n) scratch[t] = op(scratch[t], scratch[t + s]);
        __syncthreads();
    }
    T r = scratch[0];
    __syncthreads();
    return r;
}

/// Max of one row (NaN ignored, as `f32::max`); every thread gets it. One
/// block per row, threads striding over it; `red` as in rls_block_reduce.
__device__ __forceinline__ float rls_row_max(const float* x, int n, float* red) {
    float mx = RLS_NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, x[i]);
    return rls_block_reduce(mx, red, RlsMax());
}

/// Σ_j exp((z_j − max)/T) of one row in f64 (every thread gets it): the partition of the
/// learner's ℓ (logprob.cu) and of the sampler's raw log-probabilities (sampler.cu), one
/// code so that, at the same block size, the two agree bitwise.
__device__ __forceinline__ double rls_row_partition(const float* z, int v, double mx, double t, double* red) {
    double s = 0.0;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += exp(((double)z[j] - mx) / t);
    return rls_block_reduce(s, red, RlsSum());
}

/// Sum over the 32 lanes of a full warp by an xor butterfly (every lane gets the same,
/// order-fixed result).
__device__ __forceinline__ float rls_warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

/// Max over the 32 lanes of a full warp.
__device__ __forceinline__ float rls_warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

/// The bf16 bits of `f`, rounded to nearest even (NaN stays a quiet NaN): the layout cuBLAS
/// reads as CUDA_R_16BF.
__device__ __forceinline__ unsigned short rls_bf16_rne(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/// `eˣ` exactly as the CPU backend's `simd::exp` (Cephes `expf`: `x = n·ln 2 + r` with
/// `n = round(x·log₂e)` and `ln 2` split in two, then a degree-5 polynomial for `eʳ`; inputs
/// clamped to [−87, 88]): the same f32 operations in the same order, so SiLU rounds like the
/// CPU's bitwise (with `--fmad=false`).
__device__ __forceinline__ float rls_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // comparisons keep NaN
    float n = rintf(x * 1.44269504088896340736f);
    float r = fmaf(n, 2.1219444e-4f, fmaf(n, -0.6933594f, x));
    float p = 1.9875691e-4f;
    p = fmaf(p, r, 1.3981999e-3f);
    p = fmaf(p, r, 8.333452e-3f);
    p = fmaf(p, r, 4.1665796e-2f);
    p = fmaf(p, r, 1.6666665e-1f);
    p = fmaf(p, r, 0.5f);
    float y = fmaf(p, r * r, r) + 1.0f;
    return y * __int_as_float(((int)n + 127) << 23);
}
