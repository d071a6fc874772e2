// Self-test kernels of the SIMT emulation, not device code of rlserve: they exercise the
// emulated primitives the production kernels do not use (shuffles other than xor, ballot,
// atomics, f16 conversion). tests/build.rs compiles them with the kernels;
// tests/integration/cuda_emu.rs checks them against hand-derived values.
#include "common.cuh"

// selftest_warp(out [n·5], sum [1], mx [1], fsum [1]) with n = gridDim.x·blockDim.x and
// blockDim.x a multiple of 32. Thread t (global id g, lane l) writes:
//   out[5g]   = __shfl_down_sync(t, 3): t + 3 if l + 3 < 32, else t
//   out[5g+1] = __shfl_up_sync(t, 2):   t − 2 if l ≥ 2, else t
//   out[5g+2] = __shfl_sync(t, 5):      the block-local id of lane 5 of the warp
//   out[5g+3] = __ballot_sync(l % 3 == 0) (as int): bits 0, 3, ..., 30 = 0x49249249
//   out[5g+4] = the block's shared atomicAdd total after __syncthreads: Σ_t t
// and atomically: sum += g, mx = max(mx, g), fsum += 0.5f.
extern "C" __global__ void selftest_warp(int* out, int* sum, int* mx, float* fsum) {
    __shared__ int block_total;
    int t = threadIdx.x, g = blockIdx.x * blockDim.x + t, l = t % 32;
    if (t == 0) block_total = 0;
    __syncthreads();
    atomicAdd(&block_total, t);
    out[5 * g] = __shfl_down_sync(0xffffffffu, t, 3);
    out[5 * g + 1] = __shfl_up_sync(0xffffffffu, t, 2);
    out[5 * g + 2] = __shfl_sync(0xffffffffu, t, 5);
    out[5 * g + 3] = (int)__ballot_sync(0xffffffffu, l % 3 == 0);
    __syncthreads();
    out[5 * g + 4] = block_total;
    atomicAdd(sum, g);
    atomicMax(mx, g);
    atomicAdd(fsum, 0.5f);
}

// selftest_half(x [n], bits [n], back [n], bf16 [n], bf16_back [n], n): bits = f16 bits of x
// rounded to nearest even, back = that f16 as f32; the same for the emulated __nv_bfloat16.
// Launch: grid-stride.
extern "C" __global__ void selftest_half(const float* x, unsigned short* bits, float* back, unsigned short* bf16,
                                         float* bf16_back, int n) {
    RLS_GRID_STRIDE(i, n) {
        __half h = __float2half_rn(x[i]);
        bits[i] = __half_as_ushort(h);
        back[i] = __half2float(h);
        __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
        bf16[i] = __bfloat16_as_ushort(b);
        bf16_back[i] = __bfloat162float(b);
    }
}
