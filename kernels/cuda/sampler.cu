// The token sampler, the GPU twin of engine/src/sampling.rs `sample` (vLLM's order): per row,
//   1. logit_bias: l[t] = f32(f64(l[t]) + bias), pairs applied in order (repeats add up);
//   2. repetition penalty (CTRL, Keskar et al. 2019) on the distinct tokens of prompt ∪
//      output: l > 0 ? l / r : l · r;
//   3. frequency / presence penalties on the distinct output tokens: l −= f·count + p;
//   4. masked tokens (EOS / stop ids before min_tokens) → −inf;
//   5. greedy (temperature < 1e-5, NaN included): the first index of the largest non-NaN
//      value, behaviour log-prob 0;
//   6. otherwise weights w_i = exp((l_i − max)/T) in f64; without truncation the candidates
//      are all tokens in index order, with it (top_k > 0, top_p < 1 or min_p > 0) the tokens
//      sorted by (value descending in IEEE total order, index ascending), cut to top_k, to
//      the shortest prefix whose mass reaches top_p · (mass of the top-k set) (Holtzman et
//      al. 2020), and to w ≥ min_p · w_first (Nguyen et al. 2024);
//   7. one draw u = U · Σ w_kept with U the first f64 of the CPU's stream: rand 0.8
//      `StdRng::seed_from_u64(splitmix64(seed ^ splitmix64(step)))` (ChaCha12, Bernstein
//      2008, 12 rounds, key from rand_core's PCG32 seed expansion, block 0, nonce 0;
//      U = (first u64 >> 11) · 2⁻⁵³), reproduced bit for bit here (sampler_uniforms below;
//      tested bitwise against rand); the token is the first
//      kept candidate with w > 0 and u < (prefix sum of w through it), its behaviour
//      log-prob ln(w / Σ w_kept).
// Exact equality with the CPU draw: the uniform U is bitwise the CPU's, but (a) the device
// f64 exp is not glibc's (≤ 1 ulp apart) and (b) the prefix sums run as a blocked scan (each
// thread a contiguous chunk, then the chunk totals in order) where the CPU subtracts
// sequentially, so the sums differ by ~n·2⁻⁵³ relative. The drawn token differs from the
// CPU's only when u falls within that distance of a cumulative boundary (probability
// ~1e-12 per draw); the behaviour log-prob agrees to ~1e-15 relative before the f32 cast.
// Serialising the sums on one thread would remove (b), not (a), at ~0.5 ms per row.
//
// One sampling call (contract `sample`, kernels/src/sample.rs) is two launches over one
// packed description uploaded as two buffers (kernels/src/cuda/sample.rs builds them):
//   meta (int32): header n, d, K, n_rep, n_out, n_bias, n_mask; then rows [n] (logit row of
//     each entry), tokens [n] (the scored token; unused for draws), topk [n], untouched [n]
//     (1: a draw whose μ is its raw log-prob), rep_off, out_off, bias_off, mask_off [d+1]
//     each (row r's list is entries off[r] .. off[r+1]), rep_tok [n_rep] (distinct ids),
//     out_tok [n_out] (distinct ids), out_cnt [n_out], bias_tok [n_bias], bias_val [2·n_bias]
//     (each bias an f64's bits as a (low, high) word pair), mask_tok [n_mask];
//   wide (u64): params [d] (RlsSampleParams, 6 words each): a fixed size for a given d, so a
//     step plan can place meta after it at an address that does not depend on the lists
//     (kernels/src/cuda/plan.rs: a decode graph captures both addresses).
// Entries 0 .. d are draws, d .. n scored tokens. Every id < vocab (the host checks).
// out [n, 3 + 2K] (f32): token bits, μ, raw log-prob, then K (id bits, raw log-prob) pairs.
//
// sampler(logits [_, vocab], vocab, meta, wide, work [d, vocab] (f32 scratch), keys
//   [d, sort_len] (u64 scratch, sort_len = next power of two ≥ vocab; null when no draw
//   truncates), cum [d, vocab] (f64 scratch), sort_len, out): columns 0 and 1 of the draws.
// Launch: grid d, block a power of two ≤ 1024 (host: 1024; tests: 64), no dynamic shared
// memory. One block per row: batch-invariant.
#include "common.cuh"

/// Per-row sampling parameters (vLLM SamplingParams); the host mirrors this layout
/// (#[repr(C)]: six f32, two i32, two u64 = 48 bytes).
struct RlsSampleParams {
    float temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    int top_k, pad;
    unsigned long long seed, step;
};

__device__ __forceinline__ unsigned long long rls_splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned rls_rotl(unsigned x, int n) { return (x << n) | (x >> (32 - n)); }

#define RLS_QR(a, b, c, d)                                 \
    a += b, d = rls_rotl(d ^ a, 16), c += d, b = rls_rotl(b ^ c, 12); \
    a += b, d = rls_rotl(d ^ a, 8), c += d, b = rls_rotl(b ^ c, 7)

/// The first f64 of rand 0.8's `StdRng::seed_from_u64(state)`, `gen::<f64>()`.
__device__ double rls_std_rng_first_f64(unsigned long long state) {
    unsigned x[16], in[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u};
    for (int i = 0; i < 8; ++i) {  // rand_core 0.6 seed_from_u64: PCG32 → the 32-byte key
        state = state * 6364136223846793005ull + 11634580027462260723ull;
        unsigned xs = (unsigned)(((state >> 18) ^ state) >> 27), rot = (unsigned)(state >> 59);
        in[4 + i] = (xs >> rot) | (xs << ((32 - rot) & 31));
    }
    for (int i = 12; i < 16; ++i) in[i] = 0;  // block counter 0, nonce 0
    for (int i = 0; i < 16; ++i) x[i] = in[i];
    for (int r = 0; r < 6; ++r) {  // ChaCha12: 6 double rounds
        RLS_QR(x[0], x[4], x[8], x[12]);
        RLS_QR(x[1], x[5], x[9], x[13]);
        RLS_QR(x[2], x[6], x[10], x[14]);
        RLS_QR(x[3], x[7], x[11], x[15]);
        RLS_QR(x[0], x[5], x[10], x[15]);
        RLS_QR(x[1], x[6], x[11], x[12]);
        RLS_QR(x[2], x[7], x[8], x[13]);
        RLS_QR(x[3], x[4], x[9], x[14]);
    }
    unsigned long long u = (unsigned long long)(x[0] + in[0]) | ((unsigned long long)(x[1] + in[1]) << 32);
    return (double)(u >> 11) * (1.0 / 9007199254740992.0);
}

/// (value, index) for the greedy argmax (engine `argmax`): non-NaN beats NaN, larger beats
/// smaller, then the lower index.
struct RlsArg {
    float v;
    int i;
};
struct RlsArgMax {
    __device__ RlsArg operator()(RlsArg a, RlsArg b) const {
        bool an = a.v != a.v, bn = b.v != b.v;
        if (an != bn) return an ? b : a;
        if (an) return a.i > b.i ? a : b;  // all NaN: the CPU's argmax ends on the last index
        if (a.v != b.v) return a.v > b.v ? a : b;
        return a.i < b.i ? a : b;
    }
};
struct RlsMin {
    template <class T>
    __device__ T operator()(T a, T b) const { return a < b ? a : b; }
};

/// Sort key: ascending key = value descending in IEEE total order (Rust `total_cmp`), then
/// index ascending.
__device__ __forceinline__ unsigned long long rls_sort_key(float v, int i) {
    unsigned b = __float_as_uint(v);
    unsigned ord = (b >> 31) ? ~b : (b | 0x80000000u);  // ascending total order
    return ((unsigned long long)(~ord) << 32) | (unsigned)i;
}

/// The packed description of one sampling call (see the top of this file).
struct RlsSampleMeta {
    int n, d, k;
    const int *rows, *tokens, *topk, *untouched, *rep_off, *out_off, *bias_off, *mask_off, *out_cnt;
    const unsigned *rep_tok, *out_tok, *bias_tok, *mask_tok;
    const RlsSampleParams* params;
    const int* bias_val;
};

/// Bias value `b` of the (low, high) word pairs `bias_val`.
__device__ __forceinline__ double rls_bias_value(const int* bias_val, int b) {
    unsigned long long lo = (unsigned)bias_val[2 * b], hi = (unsigned)bias_val[2 * b + 1];
    return __longlong_as_double((long long)(hi << 32 | lo));
}

__device__ RlsSampleMeta rls_sample_meta(const int* meta, const unsigned long long* wide) {
    RlsSampleMeta s;
    s.n = meta[0], s.d = meta[1], s.k = meta[2];
    int n_rep = meta[3], n_out = meta[4], n_bias = meta[5];
    const int* p = meta + 7;
    s.rows = p, p += s.n;
    s.tokens = p, p += s.n;
    s.topk = p, p += s.n;
    s.untouched = p, p += s.n;
    s.rep_off = p, p += s.d + 1;
    s.out_off = p, p += s.d + 1;
    s.bias_off = p, p += s.d + 1;
    s.mask_off = p, p += s.d + 1;
    s.rep_tok = (const unsigned*)p, p += n_rep;
    s.out_tok = (const unsigned*)p, p += n_out;
    s.out_cnt = p, p += n_out;
    s.bias_tok = (const unsigned*)p, p += n_bias;
    s.bias_val = p, p += 2 * n_bias;
    s.mask_tok = (const unsigned*)p;
    s.params = (const RlsSampleParams*)wide;
    return s;
}

extern "C" __global__ void sampler(const float* logits, int vocab, const int* meta, const unsigned long long* wide,
                                   float* work, unsigned long long* keys, double* cum, int sort_len, float* out) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double redd[RLS_MAX_THREADS];
    __shared__ int redi[RLS_MAX_THREADS];
    __shared__ RlsArg reda[RLS_MAX_THREADS];
    const RlsSampleMeta s = rls_sample_meta(meta, wide);
    long long row = blockIdx.x, stride = 3 + 2 * (long long)s.k;
    unsigned tid = threadIdx.x, nt = blockDim.x;
    const RlsSampleParams p = s.params[row];
    const float* z = logits + (long long)s.rows[row] * vocab;
    const int *rep_offsets = s.rep_off, *out_offsets = s.out_off, *bias_offsets = s.bias_off, *mask_offsets = s.mask_off;
    const unsigned *rep_tokens = s.rep_tok, *out_tokens = s.out_tok, *bias_tokens = s.bias_tok, *mask_tokens = s.mask_tok;
    const int* out_counts = s.out_cnt;
    const int* bias_values = s.bias_val;
    float* l = work + row * vocab;
    for (int i = tid; i < vocab; i += nt) l[i] = z[i];
    __syncthreads();
    if (tid == 0)
        for (int b = bias_offsets[row]; b < bias_offsets[row + 1]; ++b)
            l[bias_tokens[b]] = (float)((double)l[bias_tokens[b]] + rls_bias_value(bias_values, b));
    __syncthreads();
    if (p.repetition_penalty != 1.0f)
        for (int x = rep_offsets[row] + tid; x < rep_offsets[row + 1]; x += nt) {
            float& t = l[rep_tokens[x]];
            t = t > 0.0f ? t / p.repetition_penalty : t * p.repetition_penalty;
        }
    __syncthreads();
    if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
        for (int x = out_offsets[row] + tid; x < out_offsets[row + 1]; x += nt)
            l[out_tokens[x]] -= p.frequency_penalty * (float)out_counts[x] + p.presence_penalty;
    __syncthreads();
    for (int x = mask_offsets[row] + tid; x < mask_offsets[row + 1]; x += nt) l[mask_tokens[x]] = RLS_NEG_INF;
    __syncthreads();

    if (!(p.temperature >= 1e-5f)) {  // greedy (GREEDY_EPS), NaN included
        RlsArg best = {__int_as_float(0x7fc00000), vocab - 1};
        for (int i = tid; i < vocab; i += nt) best = RlsArgMax()(best, RlsArg{l[i], i});
        best = rls_block_reduce(best, reda, RlsArgMax());
        if (tid == 0) {
            out[row * stride] = __int_as_float(best.i);
            out[row * stride + 1] = 0.0f;
        }
        return;
    }
    double mx = (double)rls_row_max(l, vocab, redf), t = (double)p.temperature;
    bool truncated = p.top_k > 0 || p.top_p < 1.0f || p.min_p > 0.0f;
    unsigned long long* key = keys + row * sort_len;
    int ncand = vocab;
    if (truncated) {  // bitonic sort of the keys (Batcher 1968), padded with the largest key
        for (int i = tid; i < sort_len; i += nt) key[i] = i < vocab ? rls_sort_key(l[i], i) : ~0ull;
        for (int size = 2; size <= sort_len; size <<= 1)
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                __syncthreads();
                for (int i = tid; i < sort_len; i += nt) {
                    int o = i ^ stride;
                    if (o > i) {
                        bool up = (i & size) == 0;
                        unsigned long long a = key[i], b = key[o];
                        if ((a > b) == up) key[i] = b, key[o] = a;
                    }
                }
            }
        __syncthreads();
        if (p.top_k > 0 && p.top_k < vocab) ncand = p.top_k;
    }
    // Candidate c is token cand(c) with weight wt(c); cum gets the blocked inclusive prefix
    // sums: each thread a contiguous chunk, then the chunk totals in thread order.
    auto cand = [&](int c) { return truncated ? (int)(key[c] & 0xffffffffu) : c; };
    auto wt = [&](int c) { return exp(((double)l[cand(c)] - mx) / t); };
    double* w = cum + row * vocab;
    int chunk = (ncand + nt - 1) / nt, c0 = tid * chunk, c1 = c0 + chunk < ncand ? c0 + chunk : ncand;
    double run = 0.0;
    for (int c = c0; c < c1; ++c) w[c] = run += wt(c);
    redd[tid] = run;
    __syncthreads();
    if (tid == 0) {
        double acc = 0.0;
        for (unsigned x = 0; x < nt; ++x) {
            double s = redd[x];
            redd[x] = acc;
            acc += s;
        }
    }
    __syncthreads();
    for (int c = c0; c < c1; ++c) w[c] += redd[tid];
    __syncthreads();
    int keep = ncand;
    if (truncated && p.top_p < 1.0f) {
        double thresh = (double)p.top_p * w[ncand - 1];
        int first = ncand;
        for (int c = tid; c < ncand; c += nt)
            if (w[c] >= thresh && c < first) first = c;
        first = rls_block_reduce(first, redi, RlsMin());
        if (first < ncand) keep = first + 1;
    }
    if (truncated && p.min_p > 0.0f) {  // weights fall along the sorted order: a prefix stays
        double floor = (double)p.min_p * wt(0);
        int first = keep;
        for (int c = tid; c < keep; c += nt)
            if (wt(c) < floor && c < first) first = c;
        keep = rls_block_reduce(first, redi, RlsMin());
    }
    double total = w[keep - 1];
    double u = rls_std_rng_first_f64(rls_splitmix64(p.seed ^ rls_splitmix64(p.step))) * total;
    int chosen = keep;
    for (int c = tid; c < keep; c += nt)
        if (c < chosen && u < w[c] && wt(c) > 0.0) chosen = c;
    chosen = rls_block_reduce(chosen, redi, RlsMin());
    if (chosen == keep) {  // u ≥ total by rounding: the last candidate with w > 0
        int last = 0;
        for (int c = tid; c < keep; c += nt)
            if (c > last && wt(c) > 0.0) last = c;
        chosen = rls_block_reduce(last, redi, RlsMax());
    }
    if (tid == 0) {
        out[row * stride] = __int_as_float(cand(chosen));
        out[row * stride + 1] = (float)log(wt(chosen) / total);
    }
}

// sample_logprobs(logits [_, vocab], vocab, meta, wide, out): for every entry, columns 0
// (scored rows: the token), 1 (μ: the sampler's, the raw log-prob for untouched draws, 0 for
// scored rows), 2 (the raw log-prob: logprob.cu token_logprobs' formula at T = 1 with the
// same partition code) and the K top pairs (the `topk[j]` largest logits by
// (value descending in IEEE total order, id ascending), z_i − (max + ln Σ exp(z − max)); the
// rest of the K written as 0). Reads column 0 of the draws (`sampler`, launched before it).
// Launch: grid n, block 256 (token_logprobs' block: the same f64 sum order), no dynamic
// shared memory.
extern "C" __global__ void sample_logprobs(const float* logits, int vocab, const int* meta,
                                           const unsigned long long* wide, float* out) {
    __shared__ float redf[RLS_MAX_THREADS];
    __shared__ double red[RLS_MAX_THREADS];
    __shared__ unsigned long long redk[RLS_MAX_THREADS];
    const RlsSampleMeta s = rls_sample_meta(meta, wide);
    long long j = blockIdx.x, stride = 3 + 2 * (long long)s.k;
    float* o = out + j * stride;
    const float* z = logits + (long long)s.rows[j] * vocab;
    bool draw = j < s.d;
    int tok = draw ? __float_as_int(o[0]) : s.tokens[j];
    double t = 1.0, mx = (double)rls_row_max(z, vocab, redf);
    double zs = rls_row_partition(z, vocab, mx, t, red);
    double lse = mx + log(zs);
    if (threadIdx.x == 0) {
        float raw = (float)(((double)z[tok] - mx) / t - log(zs));
        if (!draw) o[0] = __int_as_float(tok), o[1] = 0.0f;
        if (draw && s.untouched[j]) o[1] = raw;
        o[2] = raw;
    }
    unsigned long long prev = 0;
    for (int r = 0; r < s.k; ++r) {
        if (r >= s.topk[j]) {
            if (threadIdx.x == 0) o[3 + 2 * r] = 0.0f, o[4 + 2 * r] = 0.0f;
            continue;
        }
        unsigned long long best = ~0ull;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            unsigned long long key = rls_sort_key(z[i], i);
            if ((r == 0 || key > prev) && key < best) best = key;
        }
        best = rls_block_reduce(best, redk, RlsMin());
        prev = best;
        if (threadIdx.x == 0) {
            int i = (int)(best & 0xffffffffu);
            o[3 + 2 * r] = __int_as_float(i);
            o[4 + 2 * r] = (float)((double)z[i] - lse);
        }
    }
}

// sampler_uniforms(seeds [n], steps [n], out [n] (f64), n): the uniform U ∈ [0, 1) that
// `sampler` draws for (seed, step): rand 0.8's first `gen::<f64>()` of
// `StdRng::seed_from_u64(splitmix64(seed ^ splitmix64(step)))`, bit for bit. For logging a
// draw and for testing the stream. Launch: grid-stride over n; any grid and block.
extern "C" __global__ void sampler_uniforms(const unsigned long long* seeds, const unsigned long long* steps,
                                            double* out, int n) {
    RLS_GRID_STRIDE(i, n) out[i] = rls_std_rng_first_f64(rls_splitmix64(seeds[i] ^ rls_splitmix64(steps[i])));
}
