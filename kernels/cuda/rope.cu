// Rotary position embedding, HF rotate-half layout (Su et al. 2021, eq. 34; HF
// `apply_rotary_pos_emb`), in place: within each head, dims i and i + head_dim/2 rotate by
// the angle of the row's position: a' = a·cos − b·sin, b' = b·cos + a·sin (the CPU's
// kernels/src/cpu/elementwise.rs `rope`; bitwise equal with --fmad=false). The frequencies
// live in the host-built cos/sin tables, so a scaled RoPE (llama3's, YaRN) is a different
// table, not a different kernel.
#include "common.cuh"

// rope(x [m, c], positions [m] (uint32), cos [max_pos, head_dim/2], sin [max_pos, head_dim/2],
//      m, c, head_dim): c is n_heads·head_dim. The inverse rotation (the backward of RoPE) is
// the same kernel with a negated sin table.
// Launch: grid-stride over m·c/2 rotation pairs; any grid and block (host: 256).
extern "C" __global__ void rope(float* x, const unsigned* positions, const float* cos_t, const float* sin_t, int m, int c,
                                int head_dim) {
    int half = head_dim / 2, pairs = c / 2;
    RLS_GRID_STRIDE(idx, (long long)m * pairs) {
        long long row = idx / pairs;
        int rem = (int)(idx % pairs), head = rem / half, i = rem % half;
        long long p = positions[row];
        float cr = cos_t[p * half + i], sr = sin_t[p * half + i];
        float* h = x + row * c + (long long)head * head_dim;
        float a = h[i], b = h[i + half];
        h[i] = a * cr - b * sr;
        h[i + half] = b * cr + a * sr;
    }
}
