// Row gather / scatter / scatter-add (embedding lookup and its backward, row selection).
//
// Deterministic without atomics: in the scatters, the thread of (source row i, column)
// handles destination row rows[i] only if i is the last (scatter) or first (scatter-add)
// source of that destination; the scatter-add thread then adds every source of that
// destination in source-row order, as the CPU's in-order loop (bitwise equal). Each thread
// scans the index list: O(n) per thread, meant for token counts (n ≤ a few thousand).
// Launch (all three): grid-stride over n·c (source rows × columns); any grid and block
// (host: 256); no shared memory.
#include "common.cuh"

// gather_rows(table [_, c], ids [n], out [n, c], n, c): out[i] = table[ids[i]] (contract
// `gather_rows`; ids are checked < rows by the host).
extern "C" __global__ void gather_rows(const float* table, const unsigned* ids, float* out, int n, int c) {
    RLS_GRID_STRIDE(idx, (long long)n * c) {
        long long i = idx / c, j = idx % c;
        out[idx] = table[(long long)ids[i] * c + j];
    }
}

// scatter_rows(dst [_, c], rows [n], src [n, c], n, c): dst[rows[i]] = src[i]; with repeated
// destinations the last source wins (contract `scatter_rows`).
extern "C" __global__ void scatter_rows(float* dst, const unsigned* rows, const float* src, int n, int c) {
    RLS_GRID_STRIDE(idx, (long long)n * c) {
        int i = (int)(idx / c);
        long long j = idx % c;
        unsigned r = rows[i];
        bool last = true;
        for (int k = i + 1; k < n && last; ++k) last = rows[k] != r;
        if (last) dst[(long long)r * c + j] = src[idx];
    }
}

// scatter_add_rows(dst [_, c], rows [n], src [n, c], n, c): dst[rows[i]] += src[i], repeats
// adding up in source-row order (contract `scatter_add_rows`: the embedding's backward).
extern "C" __global__ void scatter_add_rows(float* dst, const unsigned* rows, const float* src, int n, int c) {
    RLS_GRID_STRIDE(idx, (long long)n * c) {
        int i = (int)(idx / c);
        long long j = idx % c;
        unsigned r = rows[i];
        bool first = true;
        for (int k = 0; k < i && first; ++k) first = rows[k] != r;
        if (!first) continue;
        float acc = dst[(long long)r * c + j];
        for (int k = i; k < n; ++k)
            if (rows[k] == r) acc += src[(long long)k * c + j];
        dst[(long long)r * c + j] = acc;
    }
}
