// Kimi Delta Attention, one recurrent decode step for every head (k3-model.md §4.3; the Metal
// twin of kernels/cuda/kda.cu and of the recurrent form in crates/deltafin-k3/src/kda.rs).
//
// Per head h, with the d×d f32 state S (row r = key channel, column c = value channel), the
// L2-normalised q̂, k̂, the value v, the log-decay g (α_r = exp(g_r)) and the scalar β:
//   S′ = diag(α) S;   u = β (v − S′ᵀ k̂);   S = S′ + k̂ uᵀ;   o = Sᵀ q̂
// Inputs are [H, d] rows (q, k, v, g), beta is [H], state is [H, d, d], out is [H, d].
//
// Grid: one threadgroup per head; thread c owns value column c (columns c, c + ntg, …), so
// every sum over r runs sequentially in r = 0..d−1 in one thread — the same order as the CPU
// loop. Threadgroup memory `sh` holds alpha[d], k[d], q[d] (3·d floats). No atomics.

// Shape of one step (`KdaParams` in crates/deltafin-kernels/src/metal/sources.rs).
struct KdaParams {
    uint d;
};

kernel void kda_step(device float* state [[buffer(0)]], device const float* q [[buffer(1)]],
                     device const float* k [[buffer(2)]], device const float* v [[buffer(3)]],
                     device const float* g [[buffer(4)]], device const float* beta [[buffer(5)]],
                     device float* out [[buffer(6)]], constant KdaParams& p [[buffer(7)]],
                     TG_MEM float* sh [[threadgroup(0)]], THREAD_ARGS) {
    const uint d = p.d;
    TG_MEM float* alpha = sh;
    TG_MEM float* ks = sh + d;
    TG_MEM float* qs = sh + 2u * d;
    const uint h = tgid;
    const uint base = h * d;
    for (uint r = tid; r < d; r += ntg) {
        alpha[r] = precise::exp(g[base + r]);
        ks[r] = k[base + r];
        qs[r] = q[base + r];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float b = beta[h];
    device float* s = state + h * d * d;
    for (uint c = tid; c < d; c += ntg) {
        // S′ = diag(α) S and u = v − S′ᵀ k̂, accumulated in r order.
        float u = v[base + c];
        for (uint r = 0; r < d; ++r) {
            const float x = alpha[r] * s[r * d + c];
            s[r * d + c] = x;
            u -= ks[r] * x;
        }
        u *= b;
        // S = S′ + k̂ u;  o = Sᵀ q̂, accumulated in r order.
        float o = 0.0f;
        for (uint r = 0; r < d; ++r) {
            const float x = s[r * d + c] + ks[r] * u;
            s[r * d + c] = x;
            o += qs[r] * x;
        }
        out[base + c] = o;
    }
}
