// Layout copies: transpose and column-block copies (split_cols / cat_cols); plain slices and
// row concatenations are device-to-device memcpy on the host side.
#include "common.cuh"

#define RLS_TILE 32

// transpose(x [rows, cols], y [cols, rows], rows, cols): y[c, r] = x[r, c].
// Launch: block (32, 8), grid (ceil(cols / 32), ceil(rows / 32)), no dynamic shared memory
// (a static 32×33 tile; the padding avoids bank conflicts).
extern "C" __global__ void transpose(const float* x, float* y, int rows, int cols) {
    __shared__ float tile[RLS_TILE][RLS_TILE + 1];
    int c0 = blockIdx.x * RLS_TILE, r0 = blockIdx.y * RLS_TILE;
    for (int dy = threadIdx.y; dy < RLS_TILE; dy += blockDim.y) {
        int r = r0 + dy, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[dy][threadIdx.x] = x[(long long)r * cols + c];
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < RLS_TILE; dy += blockDim.y) {
        int c = c0 + dy, r = r0 + threadIdx.x;
        if (r < rows && c < cols) y[(long long)c * rows + r] = tile[threadIdx.x][dy];
    }
}

// copy_cols(src [m, src_cols], src_off, dst [m, dst_cols], dst_off, m, w):
// dst[r, dst_off + j] = src[r, src_off + j] for j < w. One launch per part of split_cols /
// cat_cols. Launch: grid-stride over m·w; any grid and block (host: 256).
extern "C" __global__ void copy_cols(const float* src, int src_cols, int src_off, float* dst, int dst_cols, int dst_off,
                                     int m, int w) {
    RLS_GRID_STRIDE(i, (long long)m * w) {
        long long r = i / w, j = i % w;
        dst[r * dst_cols + dst_off + j] = src[r * src_cols + src_off + j];
    }
}
