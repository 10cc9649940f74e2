// Matrix-vector and small-batch products Y = X·Wᵀ over bf16, row-int8 and MXFP4 weights,
// f32 activations, f32 accumulation (the CUDA twin of crates/deltafin-kernels/src/matvec.rs).
//
// Layout: W is [rows, cols] row-major; X is [n, cols]; Y is [n, rows] (Y[b, r] = W[r]·X[b]).
// One warp computes one weight row r against NB activation rows, so each weight byte is read
// once per launch; the host splits n = 1..16 into launches of NB ∈ {16, 8, 4, 2, 1}.
//
// Every multiply-add is an explicit __fmaf_rn, so the arithmetic of one (row, activation row)
// pair is spelled out and cannot change with the compiler's contraction choices per NB.
//
// Reduction order (fixed, documented): lane l owns a fixed set of column chunks (chunk
// index ≡ l mod 32, in increasing order) and accumulates sequentially in f32; the 32 lane
// partials are then summed by warp_sum's butterfly. The order depends only on `cols`, so a
// row's result is independent of NB, of n and of the grid: bit-identical across batch widths.
//
// Chunks: MXFP4 — one 32-column scale group (16 packed bytes + 1 scale byte), the group's
// 32 products summed first, then scaled (as the CPU reference: Σ_b scale_b · Σ_k E2M1·x).
// bf16 — 8 columns (16 bytes) when cols % 8 == 0, else 1 column. int8 — 16 columns (16 bytes)
// when cols % 16 == 0, else 1 column; the f32 row scale multiplies the finished dot product.

#define ROWS_PER_BLOCK 8  // blockDim.x = 256 = 8 warps, one row each

template <int NB>
__device__ __forceinline__ void store_rows(float (&acc)[NB], float* __restrict__ y, int rows, int r,
                                           float scale) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        float s = warp_sum(acc[b]);
        if (lane == 0) y[(size_t)b * rows + r] = s * scale;
    }
}

template <int NB>
__device__ __forceinline__ void mxfp4_body(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                           const float* __restrict__ x, float* __restrict__ y, int rows,
                                           int cols) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const int groups = cols / 32;
    const uint4* prow = reinterpret_cast<const uint4*>(packed + (size_t)r * (cols / 2));
    const u8* srow = scales + (size_t)r * groups;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    for (int g = lane; g < groups; g += WARP) {
        const uint4 p = prow[g];
        const float s = e8m0(srow[g]);
        const u32 words[4] = {p.x, p.y, p.z, p.w};
        float w[32];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
            for (int j = 0; j < 8; ++j) w[q * 8 + j] = e2m1((words[q] >> (4 * j)) & 0xfu);
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const float4* xb = reinterpret_cast<const float4*>(x + (size_t)b * cols + g * 32);
            float part = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float4 v = xb[k];
                part = __fmaf_rn(w[4 * k], v.x, part);
                part = __fmaf_rn(w[4 * k + 1], v.y, part);
                part = __fmaf_rn(w[4 * k + 2], v.z, part);
                part = __fmaf_rn(w[4 * k + 3], v.w, part);
            }
            acc[b] = __fmaf_rn(s, part, acc[b]);
        }
    }
    store_rows<NB>(acc, y, rows, r, 1.0f);
}

template <int NB>
__device__ __forceinline__ void bf16_body(const u16* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int cols) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const u16* row = w + (size_t)r * cols;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    if (cols % 8 == 0) {
        const uint4* rv = reinterpret_cast<const uint4*>(row);
        for (int c8 = lane; c8 < cols / 8; c8 += WARP) {
            const uint4 p = rv[c8];
            const u32 words[4] = {p.x, p.y, p.z, p.w};
            float wv[8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                wv[2 * q] = __uint_as_float(words[q] << 16);
                wv[2 * q + 1] = __uint_as_float(words[q] & 0xffff0000u);
            }
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float4* xb = reinterpret_cast<const float4*>(x + (size_t)b * cols + c8 * 8);
                const float4 a = xb[0], c = xb[1];
                acc[b] = __fmaf_rn(wv[0], a.x, acc[b]);
                acc[b] = __fmaf_rn(wv[1], a.y, acc[b]);
                acc[b] = __fmaf_rn(wv[2], a.z, acc[b]);
                acc[b] = __fmaf_rn(wv[3], a.w, acc[b]);
                acc[b] = __fmaf_rn(wv[4], c.x, acc[b]);
                acc[b] = __fmaf_rn(wv[5], c.y, acc[b]);
                acc[b] = __fmaf_rn(wv[6], c.z, acc[b]);
                acc[b] = __fmaf_rn(wv[7], c.w, acc[b]);
            }
        }
    } else {
        for (int c = lane; c < cols; c += WARP) {
            const float wv = bf16_to_f32(row[c]);
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[b] = __fmaf_rn(wv, x[(size_t)b * cols + c], acc[b]);
        }
    }
    store_rows<NB>(acc, y, rows, r, 1.0f);
}

template <int NB>
__device__ __forceinline__ void rowint8_body(const i8* __restrict__ w, const float* __restrict__ scale,
                                             const float* __restrict__ x, float* __restrict__ y, int rows,
                                             int cols) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const i8* row = w + (size_t)r * cols;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    if (cols % 16 == 0) {
        const int4* rv = reinterpret_cast<const int4*>(row);
        for (int c16 = lane; c16 < cols / 16; c16 += WARP) {
            const int4 p = rv[c16];
            const int words[4] = {p.x, p.y, p.z, p.w};
            float wv[16];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int j = 0; j < 4; ++j) wv[4 * q + j] = (float)(signed char)((words[q] >> (8 * j)) & 0xff);
            }
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float4* xb = reinterpret_cast<const float4*>(x + (size_t)b * cols + c16 * 16);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float4 v = xb[k];
                    acc[b] = __fmaf_rn(wv[4 * k], v.x, acc[b]);
                    acc[b] = __fmaf_rn(wv[4 * k + 1], v.y, acc[b]);
                    acc[b] = __fmaf_rn(wv[4 * k + 2], v.z, acc[b]);
                    acc[b] = __fmaf_rn(wv[4 * k + 3], v.w, acc[b]);
                }
            }
        }
    } else {
        for (int c = lane; c < cols; c += WARP) {
            const float wv = (float)row[c];
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[b] = __fmaf_rn(wv, x[(size_t)b * cols + c], acc[b]);
        }
    }
    store_rows<NB>(acc, y, rows, r, scale[r]);
}

#define DEFINE_NB(NB)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) matmul_mxfp4_nb##NB(                          \
        const u8* __restrict__ packed, const u8* __restrict__ scales, const float* __restrict__ x, \
        float* __restrict__ y, int rows, int cols) {                                               \
        mxfp4_body<NB>(packed, scales, x, y, rows, cols);                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) matmul_bf16_nb##NB(                           \
        const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int rows,   \
        int cols) {                                                                                \
        bf16_body<NB>(w, x, y, rows, cols);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) matmul_rowint8_nb##NB(                        \
        const i8* __restrict__ w, const float* __restrict__ scale, const float* __restrict__ x,    \
        float* __restrict__ y, int rows, int cols) {                                               \
        rowint8_body<NB>(w, scale, x, y, rows, cols);                                              \
    }

DEFINE_NB(1)
DEFINE_NB(2)
DEFINE_NB(4)
DEFINE_NB(8)
DEFINE_NB(16)
