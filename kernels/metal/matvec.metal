// Matrix-vector and small-batch products Y = X·Wᵀ over bf16, row-int8 and MXFP4 weights, f32
// activations, f32 accumulation (the Metal twin of kernels/cuda/matvec.cu; same math, same
// reduction order).
//
// Layout: W is [rows, cols] row-major; X is [n, cols]; Y is [n, rows] (Y[b, r] = W[r]·X[b]).
// One simdgroup (32 lanes) computes one weight row r against NB activation rows, so each
// weight byte is read once per dispatch; the host splits n = 1..16 into dispatches of
// NB ∈ {16, 8, 4, 2, 1}. Threadgroups are 256 threads = 8 simdgroups = 8 rows.
//
// Every multiply-add is an explicit fma, so the arithmetic of one (row, activation row) pair
// is spelled out and cannot change with the compiler's contraction choices per NB.
//
// Reduction order (fixed, documented): lane l owns the column chunks with chunk index ≡ l
// (mod 32), in increasing order, and accumulates sequentially in f32; the 32 lane partials are
// then summed by lane_sum's butterfly. The order depends only on `cols`, so a row's result is
// independent of NB, of n and of the grid: bit-identical across batch widths.
//
// Chunks: MXFP4 — one 32-column scale group (16 packed bytes read as 4 little-endian words +
// 1 scale byte), the group's 32 products summed first (column order), then scaled (as the CPU
// reference: Σ_g scale_g · Σ_k E2M1·x). bf16 — 8 columns when cols % 8 == 0, else 1 column.
// int8 — 16 columns when cols % 16 == 0, else 1 column; the f32 row scale multiplies the
// finished dot product.

#define ROWS_PER_GROUP 8u

// Shapes of one product (`MatvecParams` in crates/deltafin-kernels/src/metal/sources.rs).
struct MatvecParams {
    uint rows;
    uint cols;
};

template <int NB>
inline void mxfp4_body(device const uint* packed, device const uchar* scales, device const float* x,
                       device float* y, uint rows, uint cols, uint tgid, uint lane, uint sg) {
    const uint r = tgid * ROWS_PER_GROUP + sg;
    if (r >= rows) return;  // the whole simdgroup leaves together
    const uint groups = cols / 32u;
    device const uint* prow = packed + r * (cols / 8u);  // 4 words per group
    device const uchar* srow = scales + r * groups;
    float acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    for (uint g = lane; g < groups; g += SIMD) {
        const float s = e8m0(uint(srow[g]));
        float w[32];
        for (uint q = 0; q < 4u; ++q) {
            const uint word = prow[4u * g + q];
            for (uint j = 0; j < 8u; ++j) w[q * 8u + j] = e2m1((word >> (4u * j)) & 0xfu);
        }
        for (int b = 0; b < NB; ++b) {
            device const float* xb = x + uint(b) * cols + g * 32u;
            float part = 0.0f;
            for (uint k = 0; k < 32u; ++k) part = fma(w[k], xb[k], part);
            acc[b] = fma(s, part, acc[b]);
        }
    }
    for (int b = 0; b < NB; ++b) {
        const float t = lane_sum(acc[b]);
        if (lane == 0u) y[uint(b) * rows + r] = t;
    }
}

template <int NB>
inline void bf16_body(device const ushort* w, device const float* x, device float* y, uint rows,
                      uint cols, uint tgid, uint lane, uint sg) {
    const uint r = tgid * ROWS_PER_GROUP + sg;
    if (r >= rows) return;
    device const ushort* row = w + r * cols;
    const uint chunk = cols % 8u == 0u ? 8u : 1u;
    float acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    for (uint c0 = lane * chunk; c0 < cols; c0 += SIMD * chunk) {
        float wv[8];
        for (uint k = 0; k < chunk; ++k) wv[k] = bf16_to_f32(row[c0 + k]);
        for (int b = 0; b < NB; ++b) {
            device const float* xb = x + uint(b) * cols + c0;
            for (uint k = 0; k < chunk; ++k) acc[b] = fma(wv[k], xb[k], acc[b]);
        }
    }
    for (int b = 0; b < NB; ++b) {
        const float t = lane_sum(acc[b]);
        if (lane == 0u) y[uint(b) * rows + r] = t;
    }
}

template <int NB>
inline void rowint8_body(device const char* w, device const float* scale, device const float* x,
                         device float* y, uint rows, uint cols, uint tgid, uint lane, uint sg) {
    const uint r = tgid * ROWS_PER_GROUP + sg;
    if (r >= rows) return;
    device const char* row = w + r * cols;
    const uint chunk = cols % 16u == 0u ? 16u : 1u;
    float acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    for (uint c0 = lane * chunk; c0 < cols; c0 += SIMD * chunk) {
        float wv[16];
        for (uint k = 0; k < chunk; ++k) wv[k] = float(row[c0 + k]);
        for (int b = 0; b < NB; ++b) {
            device const float* xb = x + uint(b) * cols + c0;
            for (uint k = 0; k < chunk; ++k) acc[b] = fma(wv[k], xb[k], acc[b]);
        }
    }
    const float sr = scale[r];
    for (int b = 0; b < NB; ++b) {
        const float t = lane_sum(acc[b]);
        if (lane == 0u) y[uint(b) * rows + r] = t * sr;
    }
}

// Buffers: the weight buffers, then x, y, then the params (see `MatvecParams`).
#define DEFINE_NB(NB)                                                                             \
    kernel void matmul_mxfp4_nb##NB(device const uint* packed [[buffer(0)]],                      \
                                    device const uchar* scales [[buffer(1)]],                     \
                                    device const float* x [[buffer(2)]],                          \
                                    device float* y [[buffer(3)]],                                \
                                    constant MatvecParams& p [[buffer(4)]], THREAD_ARGS) {        \
        mxfp4_body<NB>(packed, scales, x, y, p.rows, p.cols, tgid, lane, sg);                    \
    }                                                                                             \
    kernel void matmul_bf16_nb##NB(device const ushort* w [[buffer(0)]],                          \
                                   device const float* x [[buffer(1)]],                           \
                                   device float* y [[buffer(2)]],                                 \
                                   constant MatvecParams& p [[buffer(3)]], THREAD_ARGS) {         \
        bf16_body<NB>(w, x, y, p.rows, p.cols, tgid, lane, sg);                                  \
    }                                                                                             \
    kernel void matmul_rowint8_nb##NB(device const char* w [[buffer(0)]],                         \
                                      device const float* scale [[buffer(1)]],                    \
                                      device const float* x [[buffer(2)]],                        \
                                      device float* y [[buffer(3)]],                              \
                                      constant MatvecParams& p [[buffer(4)]], THREAD_ARGS) {      \
        rowint8_body<NB>(w, scale, x, y, p.rows, p.cols, tgid, lane, sg);                        \
    }

DEFINE_NB(1)
DEFINE_NB(2)
DEFINE_NB(4)
DEFINE_NB(8)
DEFINE_NB(16)
