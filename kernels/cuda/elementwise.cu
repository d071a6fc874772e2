// Elementwise kernels: residual add, scale, scale-add (also writing a bf16 copy), bias add,
// SwiGLU (SiLU·mul) and its backward, and the f32 → bf16 copy.
//
// Every kernel here is a grid-stride loop over its elements: any grid, any block (the host
// uses 256 threads and min(ceil(n / 256), 65535) blocks), no shared memory. Formulas match
// the CPU backend (kernels/src/cpu/elementwise.rs, backward.rs, storage.rs) operation by
// operation; with --fmad=false (nvrtc_options.txt) they are bitwise equal up to the device
// expf (≤ 2 ulp, CUDA C Programming Guide, "Mathematical Functions").
#include "common.cuh"

// add_inplace(a [n], b [n], n): a += b (the residual connection; contract `add_inplace`).
extern "C" __global__ void add_inplace(float* a, const float* b, long long n) {
    RLS_GRID_STRIDE(i, n) a[i] += b[i];
}

// scale_add_inplace(a [n], s, d [n], n): a = a·s + d (contract `scale_add_inplace`: the
// optimizer's decayed update; packed weights too, their layout being elementwise-equal).
extern "C" __global__ void scale_add_inplace(float* a, float s, const float* d, long long n) {
    RLS_GRID_STRIDE(i, n) a[i] = a[i] * s + d[i];
}

// scale_add_inplace_bf16(a [n], s, d [n], a16 [n] (bf16 bits), n): a = a·s + d, then
// a16 = bf16(a) rounded to nearest even: the optimizer's update of a weight that has a bf16
// serving copy, master and copy in one launch (the engine's pause per update is this pass).
extern "C" __global__ void scale_add_inplace_bf16(float* a, float s, const float* d, unsigned short* a16, long long n) {
    RLS_GRID_STRIDE(i, n) {
        float x = a[i] * s + d[i];
        a[i] = x;
        a16[i] = rls_bf16_rne(x);
    }
}

// scale_add_into(w [n], s, d [n], n): d = w·s + d (contract `scale_add_into`: the optimizer's
// new weight prepared in its step's buffer; the arithmetic of scale_add_inplace).
extern "C" __global__ void scale_add_into(const float* w, float s, float* d, long long n) {
    RLS_GRID_STRIDE(i, n) d[i] = w[i] * s + d[i];
}

// copy_bf16(x [n], y [n], y16 [n] (bf16 bits), n): y = x and y16 = bf16(x) rounded to nearest
// even (contract `commit_from` for a weight whose f32 address must stay: master and serving
// copy in one pass).
extern "C" __global__ void copy_bf16(const float* x, float* y, unsigned short* y16, long long n) {
    RLS_GRID_STRIDE(i, n) {
        float v = x[i];
        y[i] = v;
        y16[i] = rls_bf16_rne(v);
    }
}

// scale(x [n], y [n], s, n): y = s·x (contract `scale`).
extern "C" __global__ void scale(const float* x, float* y, float s, long long n) {
    RLS_GRID_STRIDE(i, n) y[i] = x[i] * s;
}

// add_bias(y [m, n], b [n], m, n): y[r, c] += b[c] (the linear layer's bias after cuBLAS).
extern "C" __global__ void add_bias(float* y, const float* b, int m, int n) {
    RLS_GRID_STRIDE(i, (long long)m * n) y[i] += b[i % n];
}

// silu_mul(gate_up [m, 2i], out [m, i], m, i): out = silu(g)·u with silu(g) = g / (1 + e^-g) (rls_exp),
// g = gate_up[:, :i], u = gate_up[:, i:] (SwiGLU, Shazeer 2020, eq. 5; contract `silu_mul`).
extern "C" __global__ void silu_mul(const float* gate_up, float* out, int m, int i) {
    RLS_GRID_STRIDE(idx, (long long)m * i) {
        long long r = idx / i, j = idx % i;
        float g = gate_up[r * 2 * i + j], u = gate_up[r * 2 * i + i + j];
        out[idx] = g / (1.0f + rls_exp(-g)) * u;
    }
}

// silu_mul_backward(gate_up [m, 2i], da [m, i], dgu [m, 2i], m, i): with σ = 1/(1 + e^-g),
// dg = da·u·σ·(1 + g·(1 − σ)), du = da·g·σ (hand-derived; contract `silu_mul_backward`).
extern "C" __global__ void silu_mul_backward(const float* gate_up, const float* da, float* dgu, int m, int i) {
    RLS_GRID_STRIDE(idx, (long long)m * i) {
        long long r = idx / i, j = idx % i;
        float g = gate_up[r * 2 * i + j], u = gate_up[r * 2 * i + i + j], a = da[idx];
        float s = 1.0f / (1.0f + rls_exp(-g));
        dgu[r * 2 * i + j] = a * u * s * (1.0f + g * (1.0f - s));
        dgu[r * 2 * i + i + j] = a * g * s;
    }
}

// f32_to_bf16(x [n], y [n] (bf16 bits), n): y = bf16(x), round to nearest even (the serving
// copy).
extern "C" __global__ void f32_to_bf16(const float* x, unsigned short* y, long long n) {
    RLS_GRID_STRIDE(i, n) y[i] = rls_bf16_rne(x[i]);
}
