// deltafin Metal prelude: prepended to the kernel files (one library, compiled at run time by
// newLibraryWithSource; no other header needed). The Metal twin of kernels/cuda/prelude.cuh.
//
// Portable subset: scalar loads, explicit fma, simd_shuffle_xor, threadgroup_barrier, and
// precise::exp; no simd_sum (its order is unspecified), no vector types, no atomics. The same
// text compiles as C++ on the host through crates/deltafin-kernels/tests/metal_shim/ (the
// logic test).
//
// Determinism: every reduction runs in a fixed order that depends only on the shape, never on
// timing: per-lane sequential accumulation over a fixed column assignment, then the butterfly
// of `lane_sum` (xor offsets 16, 8, 4, 2, 1), then (block reductions) simdgroup partials summed
// by simdgroup 0 in order. SIMD groups must be 32 wide (checked when the pipelines are built).

#include <metal_stdlib>
using namespace metal;

// The threadgroup address space, spelled through a macro: the host shim of the logic test
// defines TG_MEM as nothing (it cannot redefine `threadgroup`, which also names the
// [[threadgroup(i)]] argument attribute).
#ifndef TG_MEM
#define TG_MEM threadgroup
#endif

#define SIMD 32u
#define NEG_INF as_type<float>(0xff800000u)

// Thread coordinates every kernel receives (the same six builtins, in this order).
#define THREAD_ARGS                                                                              \
    uint tgid [[threadgroup_position_in_grid]], uint tid [[thread_position_in_threadgroup]],    \
        uint ntg [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],          \
        uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
inline float bf16_to_f32(ushort v) { return as_type<float>(uint(v) << 16); }

// E2M1 magnitudes (k3-model.md §3.4): bit 3 sign, bits 2..0 index this table.
constant float E2M1_MAG[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

inline float e2m1(uint code) {
    const float m = E2M1_MAG[code & 7u];
    return (code & 8u) != 0u ? -m : m;
}

// E8M0 scale 2^(e-127) as an exact f32; e = 0 is the subnormal 2^-127 (255 is rejected when
// the checkpoint is opened).
inline float e8m0(uint e) { return e == 0u ? as_type<float>(1u << 22) : as_type<float>(e << 23); }

// Sum over the 32 lanes of a simdgroup in a fixed butterfly order; every lane gets the result.
inline float lane_sum(float v) {
    for (ushort off = 16; off > 0; off >>= 1) v += simd_shuffle_xor(v, off);
    return v;
}

inline float lane_max(float v) {
    for (ushort off = 16; off > 0; off >>= 1) v = fmax(v, simd_shuffle_xor(v, off));
    return v;
}

// Threadgroup-wide sum (ntg a multiple of 32, at most 1024); `scratch` holds 32 floats.
// Simdgroup partials are added by simdgroup 0 in order. Every thread gets the result.
inline float group_sum(float v, TG_MEM float* scratch, uint lane, uint sg, uint nsg) {
    v = lane_sum(v);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0u) scratch[sg] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0u) {
        float t = lane < nsg ? scratch[lane] : 0.0f;
        t = lane_sum(t);
        if (lane == 0u) scratch[0] = t;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return scratch[0];
}

inline float group_max(float v, TG_MEM float* scratch, uint lane, uint sg, uint nsg) {
    v = lane_max(v);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0u) scratch[sg] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0u) {
        float t = lane < nsg ? scratch[lane] : NEG_INF;
        t = lane_max(t);
        if (lane == 0u) scratch[0] = t;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return scratch[0];
}
