// deltafin CUDA prelude: prepended to every kernel file before NVRTC compiles it (no
// #include: NVRTC needs no toolkit headers for these kernels).
//
// Determinism: every reduction below runs in a fixed order that depends only on the shape,
// never on timing: per-lane sequential accumulation over a fixed column assignment, then the
// butterfly tree of `warp_sum` (offsets 16, 8, 4, 2, 1), then (for block reductions) warp
// partials summed by warp 0 in warp order. Results are bit-identical run to run on one GPU.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)  // -inf without <math.h>

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

// E2M1 code -> value (k3-model.md §3.4): bit 3 sign, bits 2..0 index {0,.5,1,1.5,2,3,4,6}.
__device__ __forceinline__ float e2m1(u32 code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float m = mag[code & 7u];
    return (code & 8u) ? -m : m;
}

// E8M0 scale 2^(e-127) as an exact f32; e = 0 is the subnormal 2^-127. (255, NaN, is
// rejected when the checkpoint is opened.)
__device__ __forceinline__ float e8m0(u32 e) {
    return e == 0u ? __uint_as_float(1u << 22) : __uint_as_float(e << 23);
}

// Sum over the 32 lanes of a warp in a fixed butterfly order; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Block-wide sum (blockDim.x a multiple of 32, at most 1024); `scratch` holds 32 floats.
// Warp partials are added by warp 0 in warp order. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? scratch[lane] : NEG_INF;
        t = warp_max(t);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}
