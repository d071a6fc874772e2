// Causal grouped-query attention over a paged K/V cache (PagedAttention, Kwon et al. 2023):
// out = softmax(q·kᵀ/√D)·v (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023, query head
// h reads KV head h / (n_heads / n_kv_heads)), the semantics of kernels/src/cpu/attention.rs.
//
// Shared arguments:
//   q [t, n_heads·D]; k, v [slots, n_kv_heads·D] (the paged cache: position p of a sequence
//   lives in slot block_tables[row_table[r] + p / block_size]·block_size + p % block_size);
//   block_tables: the sequences' block tables, concatenated (u32);
//   row_table [t] (int32): offset of row r's sequence's table in block_tables;
//   row_pos [t] (int32): position of row r; it attends positions 0..=row_pos[r];
//   scale = 1/√D.
// A row's result depends only on its own (q row, position, table) and the host-fixed launch
// constants (partition, blockDim): batch-invariant (tested bitwise). Decode and prefill
// order their sums differently, so they agree with each other and with the CPU to ~1e-6
// relative, not bitwise.
#include "common.cuh"

/// Prefill tile: query rows per block and keys per step.
#define RLS_PREFILL_TQ 8
#define RLS_PREFILL_TK 32

/// Cache slot of position p under a block table.
__device__ __forceinline__ long long rls_slot(const unsigned* table, int p, int block_size) {
    return (long long)table[p / block_size] * block_size + p % block_size;
}

// paged_attention_split(q, k, v, block_tables, row_table, row_pos, part_out, part_ml, n_heads,
//   n_kv_heads, head_dim, block_size, partition, max_parts, scale): decode, split over the
// KV positions (flash-decoding): block (h, r, p) covers positions [p·partition,
// min((p+1)·partition, row_pos[r]+1)) and writes the partition's max score m, Σ e with
// e = exp(s − m), and Σ e·v to part_ml [t, n_heads, max_parts, 2] and
// part_out [t, n_heads, max_parts, D]; blocks past the row's context write nothing.
// Launch: grid (n_heads, t, max_parts) with max_parts ≥ ceil(max context / partition);
// block a multiple of 32, ≤ 1024 (host: 128; one warp per key for the dot products);
// dynamic shared memory partition·4 bytes (the scores).
extern "C" __global__ void paged_attention_split(const float* q, const float* k, const float* v,
                                                 const unsigned* block_tables, const int* row_table, const int* row_pos,
                                                 float* part_out, float* part_ml, int n_heads, int n_kv_heads,
                                                 int head_dim, int block_size, int partition, int max_parts,
                                                 float scale) {
    __shared__ float red[RLS_MAX_THREADS];
    RLS_DYN_SMEM(float, scores);
    int h = blockIdx.x, row = blockIdx.y, part = blockIdx.z;
    int ctx = row_pos[row] + 1, start = part * partition;
    if (start >= ctx) return;  // the whole block: no barrier is skipped by some threads only
    int len = ctx - start < partition ? ctx - start : partition;
    int kvh = h / (n_heads / n_kv_heads);
    long long qc = (long long)n_heads * head_dim, kc = (long long)n_kv_heads * head_dim;
    const float* qv = q + row * qc + (long long)h * head_dim;
    const unsigned* table = block_tables + row_table[row];
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int j = warp; j < len; j += nwarps) {
        const float* kr = k + rls_slot(table, start + j, block_size) * kc + (long long)kvh * head_dim;
        float s = 0.0f;
        for (int d = lane; d < head_dim; d += 32) s += qv[d] * kr[d];
        s = rls_warp_sum(s);
        if (lane == 0) scores[j] = s * scale;
    }
    __syncthreads();
    float mx = RLS_NEG_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) mx = fmaxf(mx, scores[j]);
    mx = rls_block_reduce(mx, red, RlsMax());
    float l = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(scores[j] - mx);
        scores[j] = e;
        l += e;
    }
    l = rls_block_reduce(l, red, RlsSum());  // its barriers publish the exponentials too
    long long po = ((long long)row * n_heads + h) * max_parts + part;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < len; ++j)
            acc += scores[j] * v[rls_slot(table, start + j, block_size) * kc + (long long)kvh * head_dim + d];
        part_out[po * head_dim + d] = acc;
    }
    if (threadIdx.x == 0) {
        part_ml[po * 2] = mx;
        part_ml[po * 2 + 1] = l;
    }
}

// paged_attention_reduce(part_out, part_ml, row_pos, out [t, n_heads·D], n_heads, head_dim,
//   partition, max_parts): combines the row's ceil((row_pos+1)/partition) partitions in
// order: M = max m_p, out = Σ_p part_out_p·e^(m_p − M) / Σ_p l_p·e^(m_p − M).
// Launch: grid (n_heads, t), any block (host: head_dim rounded up to 32), no shared memory.
extern "C" __global__ void paged_attention_reduce(const float* part_out, const float* part_ml, const int* row_pos,
                                                  float* out, int n_heads, int head_dim, int partition, int max_parts) {
    int h = blockIdx.x, row = blockIdx.y;
    int nparts = (row_pos[row] + partition) / partition;
    long long base = ((long long)row * n_heads + h) * max_parts;
    float mx = RLS_NEG_INF;
    for (int p = 0; p < nparts; ++p) mx = fmaxf(mx, part_ml[(base + p) * 2]);
    float l = 0.0f;
    for (int p = 0; p < nparts; ++p) l += part_ml[(base + p) * 2 + 1] * expf(part_ml[(base + p) * 2] - mx);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < nparts; ++p) acc += part_out[(base + p) * head_dim + d] * expf(part_ml[(base + p) * 2] - mx);
        out[(long long)row * n_heads * head_dim + (long long)h * head_dim + d] = acc / l;
    }
}

// paged_attention_prefill(q, k, v, block_tables, row_table, row_pos, tiles, out [t, n_heads·D],
//   n_heads, n_kv_heads, head_dim, block_size, scale): prefill / chunked prefill, tiled
// (FlashAttention-style online softmax, Dao et al. 2022, Alg. 1): block (h, b) takes the
// rows tiles[2b] .. tiles[2b] + tiles[2b+1] (at most RLS_PREFILL_TQ rows of ONE sequence),
// and walks the keys in steps of RLS_PREFILL_TK from position 0. A row stops at the step
// holding its own position, and masked keys add exact zeros, so its sums run in an order
// fixed by its position alone: batch- and tiling-invariant.
// Launch: grid (n_heads, number of tiles); any block (host: 128); dynamic shared memory
// (2·TQ·D + 2·TK·D + TQ·TK + 3·TQ)·4 bytes (42 KiB at D = 128; D = 256 needs the >48 KiB
// opt-in, cudaFuncAttributeMaxDynamicSharedMemorySize).
extern "C" __global__ void paged_attention_prefill(const float* q, const float* k, const float* v,
                                                   const unsigned* block_tables, const int* row_table,
                                                   const int* row_pos, const int* tiles, float* out, int n_heads,
                                                   int n_kv_heads, int head_dim, int block_size, float scale) {
    const int TQ = RLS_PREFILL_TQ, TK = RLS_PREFILL_TK, D = head_dim;
    RLS_DYN_SMEM(float, sm);
    float *qs = sm, *ks = qs + TQ * D, *vs = ks + TK * D, *sc = vs + TK * D, *o = sc + TQ * TK;
    float *mrow = o + TQ * D, *lrow = mrow + TQ, *resc = lrow + TQ;
    int h = blockIdx.x, first = tiles[2 * blockIdx.y], cnt = tiles[2 * blockIdx.y + 1];
    int kvh = h / (n_heads / n_kv_heads);
    long long qc = (long long)n_heads * D, kc = (long long)n_kv_heads * D;
    const unsigned* table = block_tables + row_table[first];
    unsigned tid = threadIdx.x, nt = blockDim.x;
    for (unsigned x = tid; x < (unsigned)(TQ * D); x += nt) {
        int i = x / D, d = x % D;
        qs[x] = i < cnt ? q[(first + i) * qc + (long long)h * D + d] : 0.0f;
        o[x] = 0.0f;
    }
    if (tid < (unsigned)TQ) {
        mrow[tid] = RLS_NEG_INF;
        lrow[tid] = 0.0f;
    }
    int max_pos = row_pos[first + cnt - 1];
    for (int k0 = 0; k0 <= max_pos; k0 += TK) {
        __syncthreads();  // the previous step's readers are done with ks/vs/sc
        for (unsigned x = tid; x < (unsigned)(TK * D); x += nt) {
            int j = k0 + (int)(x / D), d = x % D;
            bool in = j <= max_pos;
            long long s = in ? rls_slot(table, j, block_size) * kc + (long long)kvh * D + d : 0;
            ks[x] = in ? k[s] : 0.0f;
            vs[x] = in ? v[s] : 0.0f;
        }
        __syncthreads();
        for (unsigned x = tid; x < (unsigned)(TQ * TK); x += nt) {
            int i = x / TK, j = k0 + (int)(x % TK);
            float s = RLS_NEG_INF;
            if (i < cnt && j <= row_pos[first + i]) {
                float a = 0.0f;
                for (int d = 0; d < D; ++d) a += qs[i * D + d] * ks[(x % TK) * D + d];
                s = a * scale;
            }
            sc[x] = s;
        }
        __syncthreads();
        if (tid < (unsigned)cnt && k0 <= row_pos[first + tid]) {
            float* si = sc + tid * TK;
            float mo = mrow[tid], mn = mo;
            for (int j = 0; j < TK; ++j) mn = fmaxf(mn, si[j]);
            float r = expf(mo - mn), l = 0.0f;  // mo = -inf on the first step: r = 0
            for (int j = 0; j < TK; ++j) {
                float p = si[j] == RLS_NEG_INF ? 0.0f : expf(si[j] - mn);
                si[j] = p;
                l += p;
            }
            lrow[tid] = lrow[tid] * r + l;
            mrow[tid] = mn;
            resc[tid] = r;
        }
        __syncthreads();
        for (unsigned x = tid; x < (unsigned)(TQ * D); x += nt) {
            int i = x / D, d = x % D;
            if (i >= cnt || k0 > row_pos[first + i]) continue;
            float acc = o[x] * resc[i];
            for (int j = 0; j < TK; ++j) acc += sc[i * TK + j] * vs[j * D + d];
            o[x] = acc;
        }
    }
    __syncthreads();
    for (unsigned x = tid; x < (unsigned)(cnt * D); x += nt) {
        int i = x / D, d = x % D;
        out[(first + i) * qc + (long long)h * D + d] = o[x] / lrow[i];
    }
}
