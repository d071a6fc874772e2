// SIMT emulation: compiles the unmodified kernels/cuda/*.cu with a host C++20 compiler and
// runs them on the CPU, for the tests (tests/build.rs force-includes this header).
//
// Model (enough for the kernels of this project, not a general CUDA):
// - A launch runs the blocks of its grid one after another, in blockIdx order (x fastest).
//   The threads of a block are real threads (one pooled std::thread per thread of the block,
//   kept between launches); each runs every block in turn, with a barrier between blocks.
// - `__syncthreads()` is a std::barrier over the block's threads; `__syncwarp()` and the warp
//   shuffles use one barrier per warp of 32 consecutive linear thread ids (the last warp
//   may be partial) and a per-warp exchange buffer. A kernel must reach them with every
//   thread of the block / warp, as CUDA requires.
// - `__shared__` is `static`: one copy, shared by the threads of the running block (only one
//   block runs at a time). Dynamic shared memory (`RLS_DYN_SMEM` in common.cuh) is one
//   buffer of the launch's `smem_bytes`, zeroed once per launch.
// - Atomics use std::atomic_ref; math intrinsics map to <cmath> (`__expf` = expf etc.:
//   the emulation is as precise as the accurate functions, not as the fast ones).
// - `__nv_bfloat16` / `__half` convert with round-to-nearest-even (NaN stays NaN).
#pragma once
#define RLSERVE_EMU 1

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace emu {

/// One launch's shared state: barriers, warp exchange buffers and dynamic shared memory.
struct Launch {
    std::unique_ptr<std::barrier<>> block_barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    std::vector<std::uint64_t> exchange;  // 32 slots per warp
    std::vector<std::uint64_t> dyn_smem;  // 8-byte aligned
};
inline Launch* current = nullptr;
/// Launches from several host threads (parallel tests) run one at a time: the launch
/// geometry and `current` are process-wide.
inline std::mutex launch_mutex;

/// The threads that run the launches: grown to the largest block seen, kept between launches
/// (creating 256 threads per launch dominated the emulated engine's time). `run(n, f)` runs
/// `f(0..n)` on workers 0..n and returns when all are done.
struct Pool {
    std::mutex m;
    std::condition_variable start, done;
    std::vector<std::thread> threads;
    unsigned long long generation = 0;
    unsigned active = 0, remaining = 0;
    const std::function<void(unsigned)>* job = nullptr;

    void run(unsigned n, const std::function<void(unsigned)>& f) {
        std::unique_lock<std::mutex> lk(m);
        while (threads.size() < n) {
            unsigned id = threads.size();
            threads.emplace_back([this, id] { work(id); });
        }
        job = &f;
        active = remaining = n;
        ++generation;
        start.notify_all();
        done.wait(lk, [&] { return remaining == 0; });
        job = nullptr;
    }

    void work(unsigned id) {
        unsigned long long seen = 0;
        std::unique_lock<std::mutex> lk(m);
        for (;;) {
            start.wait(lk, [&] { return generation != seen; });
            seen = generation;
            if (id >= active) continue;
            const auto* f = job;  // stable until every active worker has finished
            lk.unlock();
            (*f)(id);
            lk.lock();
            if (--remaining == 0) done.notify_one();
        }
    }
};
/// Never destroyed: its threads wait for work until the process ends.
inline Pool& pool() {
    static Pool* p = new Pool;
    return *p;
}

inline unsigned linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline void* dyn_smem() { return current->dyn_smem.data(); }

/// All lanes of the calling thread's warp exchange a 64-bit value: returns lane `src`'s.
/// Two warp barriers: one after the writes, one after the reads (so the buffer can be reused).
inline std::uint64_t exchange(std::uint64_t v, unsigned src) {
    unsigned t = linear_tid(), w = t / 32;
    std::uint64_t* buf = &current->exchange[w * 32];
    buf[t % 32] = v;
    current->warp_barriers[w]->arrive_and_wait();
    unsigned block_threads = blockDim.x * blockDim.y * blockDim.z;
    unsigned lanes = std::min(32u, block_threads - w * 32);
    std::uint64_t r = src < lanes ? buf[src] : v;
    current->warp_barriers[w]->arrive_and_wait();
    return r;
}

template <class T>
std::uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8);
    std::uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
T from_bits(std::uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace emu

inline void __syncthreads() { emu::current->block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::current->warp_barriers[emu::linear_tid() / 32]->arrive_and_wait(); }

template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
    unsigned lane = emu::linear_tid() % 32;
    unsigned s = (lane / width) * width + (unsigned)src % width;
    return emu::from_bits<T>(emu::exchange(emu::to_bits(v), s));
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    unsigned lane = emu::linear_tid() % 32;
    unsigned s = lane ^ (unsigned)mask;
    if (s / width != lane / width) s = lane;
    return emu::from_bits<T>(emu::exchange(emu::to_bits(v), s));
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::linear_tid() % 32;
    unsigned s = lane + delta;
    if (s / width != lane / width) s = lane;
    return emu::from_bits<T>(emu::exchange(emu::to_bits(v), s));
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::linear_tid() % 32;
    unsigned s = (lane % width) >= delta ? lane - delta : lane;
    return emu::from_bits<T>(emu::exchange(emu::to_bits(v), s));
}
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned bits = 0;
    for (unsigned l = 0; l < 32; ++l) {
        // Every lane reads lane l's predicate; lanes past a partial warp read their own.
        bits |= (emu::exchange(pred ? 1 : 0, l) ? 1u : 0u) << l;
    }
    return bits;
}

// Atomics (device-scope, relaxed is enough for the emulation's sequential blocks).
template <class T>
T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}
template <class T>
T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <class T>
T atomicMin(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old > v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <class T>
T atomicExch(T* p, T v) {
    return std::atomic_ref<T>(*p).exchange(v);
}
template <class T>
T atomicCAS(T* p, T cmp, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v);
    return cmp;
}

// Math intrinsics used by the kernels.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline double __longlong_as_double(long long i) { return std::bit_cast<double>(i); }
inline long long __double_as_longlong(double d) { return std::bit_cast<long long>(d); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// The f-suffixed functions (expf, logf, fmaxf, ...) are the global ones of <math.h>.
using std::exp;
using std::fabs;
using std::fmax;
using std::fmin;
using std::log;
using std::sqrt;
using std::max;
using std::min;

// bf16 / f16 storage types with round-to-nearest-even conversion.
struct __nv_bfloat16 {
    unsigned short x;
};
struct __half {
    unsigned short x;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = std::bit_cast<unsigned>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(unsigned short)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return std::bit_cast<float>((unsigned)b.x << 16); }
inline __half __float2half_rn(float f) {
    unsigned u = std::bit_cast<unsigned>(f);
    unsigned sign = (u >> 16) & 0x8000u;
    unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return {(unsigned short)(sign | 0x7e00u)};
    if (a >= 0x477ff000u) return {(unsigned short)(sign | 0x7c00u)};  // rounds to >= 65520: inf
    if (a < 0x38800000u) {                                              // subnormal or zero in f16
        // value = a_float; f16 subnormal unit is 2^-24: round(a_float * 2^24) with RNE.
        float v = std::bit_cast<float>(a) * 16777216.0f;  // exact (power of two scaling)
        float r = std::nearbyint(v);                          // default rounding mode: RNE
        return {(unsigned short)(sign | (unsigned)r)};
    }
    unsigned e = ((a >> 23) - 112) << 10;
    unsigned m = a & 0x7fffffu;
    unsigned h = e | (m >> 13);
    unsigned rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return {(unsigned short)(sign | h)};
}
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline float __half2float(__half h) {
    unsigned sign = (unsigned)(h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu;
    if (e == 0) return std::bit_cast<float>(sign) + (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-8f;
    if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
    return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

/// Runs `kernel(args...)` over `grid` blocks of `block` threads with `smem_bytes` of dynamic
/// shared memory (see the model at the top of this file); launches are serialised.
template <class... P, class... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem_bytes, A... args) {
    std::lock_guard<std::mutex> lock(emu::launch_mutex);
    unsigned n = block.x * block.y * block.z;
    emu::Launch launch;
    launch.block_barrier = std::make_unique<std::barrier<>>(n);
    for (unsigned w = 0; w * 32 < n; ++w) {
        launch.warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - w * 32)));
    }
    launch.exchange.assign(launch.warp_barriers.size() * 32, 0);
    launch.dyn_smem.assign((smem_bytes + 7) / 8, 0);
    emu::current = &launch;
    blockDim = block;
    gridDim = grid;
    std::function<void(unsigned)> body = [&](unsigned t) {
        threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx = dim3(bx, by, bz);
                    kernel(static_cast<P>(args)...);
                    launch.block_barrier->arrive_and_wait();
                }
    };
    emu::pool().run(n, body);
    emu::current = nullptr;
}
