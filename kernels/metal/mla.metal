// Gated MLA absorbed decode attention for one new token (k3-model.md §4.4; the Metal twin of
// kernels/cuda/mla.cu and of `MlaWeights::attend` in crates/deltafin-k3/src/mla.rs for t = 1,
// after the token's ĉ and kt rows were appended to the cache).
//
// Per head h (rows = h·(nope + v) of kv_b_proj, B^K = the first `nope` rows, B^V the next v):
//   q_lat = B^Kᵀ qn_h                                  (kvl values)
//   score(s) = [q_lat · ĉ(s) + qt_h · kt(s)] · scale    for s = 0..n−1
//   p = softmax(score);   ctx = Σ_s p_s ĉ(s);   o_h[j] = (B^V_j · ctx) · σ(gate_h[j])
// q is [H, nope + rope] f32; kv_b is [H·(nope + v), kvl] bf16; latent is [n, kvl] bf16;
// tail is [n, rope] bf16; gate is [H, v] f32; out is [H, v] f32; scores is [H, n] f32 scratch.
//
// Grid: one threadgroup per head, 256 threads. Reduction orders (fixed): q_lat[j] and ctx[j]
// are sequential sums (over i, over s) in one thread per column j; a score's dot products are
// lane-sequential over columns j ≡ lane (mod 32), then lane_sum; the softmax max and sum are
// group reductions (threads stride the tokens; see group_sum in the prelude). Threadgroup
// memory `sh` holds q_lat / ctx [kvl], qt [rope] and 32 floats of reduction scratch.

// Shapes of one decode (`MlaParams` in crates/deltafin-kernels/src/metal/sources.rs).
struct MlaParams {
    uint n;
    uint nope;
    uint rope;
    uint vdim;
    uint kvl;
    float scale;
};

kernel void mla_decode(device const float* q [[buffer(0)]], device const ushort* kv_b [[buffer(1)]],
                       device const ushort* latent [[buffer(2)]],
                       device const ushort* tail [[buffer(3)]], device const float* gate [[buffer(4)]],
                       device float* scores [[buffer(5)]], device float* out [[buffer(6)]],
                       constant MlaParams& p [[buffer(7)]], TG_MEM float* sh [[threadgroup(0)]],
                       THREAD_ARGS) {
    const uint n = p.n, nope = p.nope, rope = p.rope, vdim = p.vdim, kvl = p.kvl;
    TG_MEM float* q_lat = sh;
    TG_MEM float* qt = sh + kvl;
    TG_MEM float* red = sh + kvl + rope;
    const uint h = tgid;
    device const float* qh = q + h * (nope + rope);
    const uint rows = h * (nope + vdim);
    device float* sc = scores + h * n;

    // q_lat = B^Kᵀ qn: thread per latent column j, sequential over the nope key rows.
    for (uint j = tid; j < kvl; j += ntg) {
        float a = 0.0f;
        for (uint i = 0; i < nope; ++i) a += qh[i] * bf16_to_f32(kv_b[(rows + i) * kvl + j]);
        q_lat[j] = a;
    }
    for (uint j = tid; j < rope; j += ntg) qt[j] = qh[nope + j];
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Scores: simdgroup per token.
    for (uint s = sg; s < n; s += nsg) {
        device const ushort* c = latent + s * kvl;
        device const ushort* kt = tail + s * rope;
        float a = 0.0f, at = 0.0f;
        for (uint j = lane; j < kvl; j += SIMD) a += q_lat[j] * bf16_to_f32(c[j]);
        for (uint j = lane; j < rope; j += SIMD) at += qt[j] * bf16_to_f32(kt[j]);
        a = lane_sum(a);
        at = lane_sum(at);
        if (lane == 0u) sc[s] = (a + at) * p.scale;
    }
    // The scores live in device memory: make them visible to the whole threadgroup.
    threadgroup_barrier(mem_flags::mem_device);

    // Softmax over the n scores.
    float m = NEG_INF;
    for (uint s = tid; s < n; s += ntg) m = fmax(m, sc[s]);
    m = group_max(m, red, lane, sg, nsg);
    float z = 0.0f;
    for (uint s = tid; s < n; s += ntg) {
        const float e = precise::exp(sc[s] - m);
        sc[s] = e;
        z += e;
    }
    z = group_sum(z, red, lane, sg, nsg);
    threadgroup_barrier(mem_flags::mem_device);
    const float inv = 1.0f / z;

    // ctx = Σ_s p_s ĉ(s): thread per column j, sequential over s (reuses q_lat's storage).
    for (uint j = tid; j < kvl; j += ntg) {
        float a = 0.0f;
        for (uint s = 0; s < n; ++s) a += (sc[s] * inv) * bf16_to_f32(latent[s * kvl + j]);
        q_lat[j] = a;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // o_h[j] = (B^V_j · ctx) · σ(gate): simdgroup per output value.
    for (uint jv = sg; jv < vdim; jv += nsg) {
        device const ushort* bv = kv_b + (rows + nope + jv) * kvl;
        float a = 0.0f;
        for (uint j = lane; j < kvl; j += SIMD) a += bf16_to_f32(bv[j]) * q_lat[j];
        a = lane_sum(a);
        if (lane == 0u) {
            const float gj = gate[h * vdim + jv];
            out[h * vdim + jv] = a * (1.0f / (1.0f + precise::exp(-gj)));
        }
    }
}
