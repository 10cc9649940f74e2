// Gated MLA absorbed decode attention for one new token (k3-model.md §4.4; the CUDA twin of
// `MlaWeights::attend` in crates/deltafin-k3/src/mla.rs for t = 1, after the token's ĉ and kt
// rows were appended to the cache).
//
// Per head h (rows = h·(nope + v) of kv_b_proj, B^K = the first `nope` rows, B^V the next v):
//   q_lat = B^Kᵀ qn_h                                  (kvl values)
//   score(s) = [q_lat · ĉ(s) + qt_h · kt(s)] · scale    for s = 0..n−1
//   p = softmax(score);   ctx = Σ_s p_s ĉ(s);   o_h[j] = (B^V_j · ctx) · σ(gate_h[j])
// q is [H, nope + rope] f32; kv_b is [H·(nope + v), kvl] bf16; latent is [n, kvl] bf16;
// tail is [n, rope] bf16; gate is [H, v] f32; out is [H, v] f32; scores is [H, n] f32 scratch.
//
// Grid: one block per head, 256 threads. Reduction orders (fixed): q_lat[j] and ctx[j] are
// sequential sums (over i, over s) in one thread per column j; a score's dot products are
// lane-sequential over columns j ≡ lane (mod 32), then warp_sum; the softmax max and sum are
// block reductions (threads stride the tokens; see block_sum in the prelude).

extern "C" __global__ void __launch_bounds__(256) mla_decode(const float* __restrict__ q,
                                                            const u16* __restrict__ kv_b,
                                                            const u16* __restrict__ latent,
                                                            const u16* __restrict__ tail,
                                                            const float* __restrict__ gate,
                                                            float* __restrict__ scores,
                                                            float* __restrict__ out, int n, int nope,
                                                            int rope, int vdim, int kvl, float scale) {
    extern __shared__ float sh[];  // q_lat / ctx [kvl], qt [rope], red [32]
    float* q_lat = sh;
    float* qt = sh + kvl;
    float* red = sh + kvl + rope;
    const int h = blockIdx.x;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const float* qh = q + (size_t)h * (nope + rope);
    const size_t rows = (size_t)h * (nope + vdim);
    float* sc = scores + (size_t)h * n;

    // q_lat = B^Kᵀ qn: thread per latent column j, sequential over the nope key rows.
    for (int j = threadIdx.x; j < kvl; j += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < nope; ++i) a += qh[i] * bf16_to_f32(kv_b[(rows + i) * kvl + j]);
        q_lat[j] = a;
    }
    for (int j = threadIdx.x; j < rope; j += blockDim.x) qt[j] = qh[nope + j];
    __syncthreads();

    // Scores: warp per token.
    for (int s = warp; s < n; s += warps) {
        const u16* c = latent + (size_t)s * kvl;
        const u16* kt = tail + (size_t)s * rope;
        float a = 0.0f, at = 0.0f;
        for (int j = lane; j < kvl; j += WARP) a += q_lat[j] * bf16_to_f32(c[j]);
        for (int j = lane; j < rope; j += WARP) at += qt[j] * bf16_to_f32(kt[j]);
        a = warp_sum(a);
        at = warp_sum(at);
        if (lane == 0) sc[s] = (a + at) * scale;
    }
    __syncthreads();

    // Softmax over the n scores.
    float m = NEG_INF;
    for (int s = threadIdx.x; s < n; s += blockDim.x) m = fmaxf(m, sc[s]);
    m = block_max(m, red);
    float z = 0.0f;
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
        const float e = expf(sc[s] - m);
        sc[s] = e;
        z += e;
    }
    z = block_sum(z, red);
    const float inv = 1.0f / z;

    // ctx = Σ_s p_s ĉ(s): thread per column j, sequential over s (reuses q_lat's storage).
    for (int j = threadIdx.x; j < kvl; j += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n; ++s) a += (sc[s] * inv) * bf16_to_f32(latent[(size_t)s * kvl + j]);
        q_lat[j] = a;
    }
    __syncthreads();

    // o_h[j] = (B^V_j · ctx) · σ(gate): warp per output value.
    for (int jv = warp; jv < vdim; jv += warps) {
        const u16* bv = kv_b + (rows + nope + jv) * kvl;
        float a = 0.0f;
        for (int j = lane; j < kvl; j += WARP) a += bf16_to_f32(bv[j]) * q_lat[j];
        a = warp_sum(a);
        if (lane == 0) {
            const float gj = gate[(size_t)h * vdim + jv];
            out[(size_t)h * vdim + jv] = a * (1.0f / (1.0f + expf(-gj)));
        }
    }
}
