// Kimi Delta Attention, one recurrent decode step for every head (k3-model.md §4.3; the CUDA
// twin of the recurrent form in crates/deltafin-k3/src/kda.rs).
//
// Per head h, with the d×d f32 state S (row r = key channel, column c = value channel), the
// L2-normalised q̂, k̂, the value v, the log-decay g (α_r = exp(g_r)) and the scalar β:
//   S′ = diag(α) S;   u = β (v − S′ᵀ k̂);   S = S′ + k̂ uᵀ;   o = Sᵀ q̂
// Inputs are [H, d] rows (q, k, v, g), beta is [H], state is [H, d, d], out is [H, d].
//
// Grid: one block per head; thread c owns value column c (columns c, c + blockDim, …), so
// every sum over r runs sequentially in r = 0..d−1 in one thread — the same order as the CPU
// loop — and the state column is read and written with coalesced accesses. No atomics.

extern "C" __global__ void __launch_bounds__(256) kda_step(float* __restrict__ state,
                                                          const float* __restrict__ q,
                                                          const float* __restrict__ k,
                                                          const float* __restrict__ v,
                                                          const float* __restrict__ g,
                                                          const float* __restrict__ beta,
                                                          float* __restrict__ out, int d) {
    extern __shared__ float sh[];  // alpha[d], k[d], q[d]
    float* alpha = sh;
    float* ks = sh + d;
    float* qs = sh + 2 * d;
    const int h = blockIdx.x;
    const size_t base = (size_t)h * d;
    for (int r = threadIdx.x; r < d; r += blockDim.x) {
        alpha[r] = expf(g[base + r]);
        ks[r] = k[base + r];
        qs[r] = q[base + r];
    }
    __syncthreads();
    const float b = beta[h];
    float* s = state + (size_t)h * d * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        // S′ = diag(α) S and u = v − S′ᵀ k̂, accumulated in r order.
        float u = v[base + c];
        for (int r = 0; r < d; ++r) {
            const float x = alpha[r] * s[(size_t)r * d + c];
            s[(size_t)r * d + c] = x;
            u -= ks[r] * x;
        }
        u *= b;
        // S = S′ + k̂ u;  o = Sᵀ q̂, accumulated in r order.
        float o = 0.0f;
        for (int r = 0; r < d; ++r) {
            const float x = s[(size_t)r * d + c] + ks[r] * u;
            s[(size_t)r * d + c] = x;
            o += qs[r] * x;
        }
        out[base + c] = o;
    }
}
