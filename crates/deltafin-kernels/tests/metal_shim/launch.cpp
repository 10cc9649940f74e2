// Host launchers of the deltafin Metal kernels for the logic test (appended after the kernel
// sources; see metal_stdlib for the execution model). Geometry (threadgroup counts, sizes and
// threadgroup memory) comes from the Rust caller, which takes it from
// deltafin_kernels::metal::sources, as the device wrapper does. Each returns 0, or 1 with the
// reason in shim_last_error().

static std::string g_last_error;

extern "C" const char* shim_last_error() { return g_last_error.c_str(); }

static int finish(const std::string& e) {
    g_last_error = e;
    return e.empty() ? 0 : 1;
}

#define MATMUL_CASE(KIND, NB, CALL)                                                              \
    if (std::strcmp(kind, #KIND) == 0 && nb == NB)                                               \
        return finish(metal::dispatch(groups, threads, [&](uint tg, uint t, uint nt, uint l, uint s, \
                                                           uint ns) { CALL; }));

#define MATMUL_NB(NB)                                                                            \
    MATMUL_CASE(mxfp4, NB,                                                                       \
                matmul_mxfp4_nb##NB((const uint*)w, (const uchar*)scales, x, y, p, tg, t, nt, l, s, ns)) \
    MATMUL_CASE(bf16, NB, matmul_bf16_nb##NB((const ushort*)w, x, y, p, tg, t, nt, l, s, ns))   \
    MATMUL_CASE(rowint8, NB,                                                                     \
                matmul_rowint8_nb##NB((const char*)w, (const float*)scales, x, y, p, tg, t, nt, l, s, ns))

// One product dispatch: `nb` activation rows at `x`, results at `y`.
extern "C" int shim_matmul(const char* kind, int nb, const void* w, const void* scales, const float* x,
                           float* y, uint rows, uint cols, uint groups, uint threads) {
    MatvecParams p{rows, cols};
    MATMUL_NB(1)
    MATMUL_NB(2)
    MATMUL_NB(4)
    MATMUL_NB(8)
    MATMUL_NB(16)
    return finish(std::string("no kernel matmul_") + kind + "_nb" + std::to_string(nb));
}

extern "C" int shim_kda_step(float* state, const float* q, const float* k, const float* v, const float* g,
                             const float* beta, float* out, uint heads, uint d, uint threads,
                             uint tg_bytes) {
    KdaParams p{d};
    std::vector<float> sh(tg_bytes / 4);
    return finish(metal::dispatch(heads, threads, [&](uint tg, uint t, uint nt, uint l, uint s, uint ns) {
        if (t == 0) std::fill(sh.begin(), sh.end(), NAN);  // fresh threadgroup memory is undefined
        kda_step(state, q, k, v, g, beta, out, p, sh.data(), tg, t, nt, l, s, ns);
    }));
}

extern "C" int shim_mla_decode(const float* q, const ushort* kv_b, const ushort* latent, const ushort* tail,
                               const float* gate, float* scores, float* out, uint heads, const MlaParams* prm,
                               uint threads, uint tg_bytes) {
    MlaParams p = *prm;
    std::vector<float> sh(tg_bytes / 4);
    return finish(metal::dispatch(heads, threads, [&](uint tg, uint t, uint nt, uint l, uint s, uint ns) {
        if (t == 0) std::fill(sh.begin(), sh.end(), NAN);
        mla_decode(q, kv_b, latent, tail, gate, scores, out, p, sh.data(), tg, t, nt, l, s, ns);
    }));
}
