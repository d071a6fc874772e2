// KV-cache write into paged blocks: the new tokens' K and V rows go to their cache slots
// (slot = block_table[p / block_size]·block_size + p % block_size, computed by the host's
// block manager; see paged_attention.cu for the read side).
#include "common.cuh"

// kv_cache_write(k [n, kc], v [n, kc], k_cache [slots, kc], v_cache [slots, kc], slots [n], n, kc):
// k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i]; kc = n_kv_heads·head_dim. The slots of
// one call are distinct (each token has its own slot), so the order of writes is free.
// Launch: grid-stride over n·kc; any grid and block (host: 256); no shared memory.
extern "C" __global__ void kv_cache_write(const float* k, const float* v, float* k_cache, float* v_cache,
                                          const unsigned* slots, int n, int kc) {
    RLS_GRID_STRIDE(idx, (long long)n * kc) {
        long long i = idx / kc, j = idx % kc, dst = (long long)slots[i] * kc + j;
        k_cache[dst] = k[idx];
        v_cache[dst] = v[idx];
    }
}
