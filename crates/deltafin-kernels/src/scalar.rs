//! Portable row dot products: the reference every SIMD path is tested against.
//!
//! Eight independent accumulators (lane `k` takes columns `c ≡ k mod 8`), reduced in a fixed
//! tree, then the ragged tail added in column order. Plain `a * b + c` (no `mul_add`: without
//! the FMA target feature that is a libm call). Each function handles `NB` activation rows
//! with the same per-row arithmetic, so a row's result does not depend on `NB`.

use deltafin_tensor::bf16;
use deltafin_tensor::mxfp4::{E2M1, GROUP};

const LANES: usize = 8;

#[inline(always)]
pub(crate) fn widen_bf16(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// Reduce the lane accumulators in a fixed order.
#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

#[inline(always)]
fn dot_generic<T: Copy, const NB: usize>(
    w: &[T],
    widen: impl Fn(T) -> f32,
    xs: [&[f32]; NB],
) -> [f32; NB] {
    let n = w.len();
    let main = n - n % LANES;
    let mut acc = [[0f32; LANES]; NB];
    let mut c = 0;
    while c < main {
        let mut wv = [0f32; LANES];
        for k in 0..LANES {
            wv[k] = widen(w[c + k]);
        }
        for b in 0..NB {
            let x = &xs[b][c..c + LANES];
            for k in 0..LANES {
                acc[b][k] += wv[k] * x[k];
            }
        }
        c += LANES;
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        let mut tail = 0f32;
        for i in main..n {
            tail += widen(w[i]) * xs[b][i];
        }
        out[b] = reduce(&acc[b]) + tail;
    }
    out
}

/// `Σ w_i x_i` over an f32 row.
pub(crate) fn dot_f32<const NB: usize>(w: &[f32], xs: [&[f32]; NB]) -> [f32; NB] {
    dot_generic(w, |v| v, xs)
}

/// `Σ w_i x_i` over a bf16 row.
pub(crate) fn dot_bf16<const NB: usize>(w: &[bf16], xs: [&[f32]; NB]) -> [f32; NB] {
    dot_generic(w, widen_bf16, xs)
}

/// `Σ q_i x_i` over an int8 row (the caller multiplies by the row scale).
pub(crate) fn dot_i8<const NB: usize>(w: &[i8], xs: [&[f32]; NB]) -> [f32; NB] {
    dot_generic(w, |v| v as f32, xs)
}

/// Byte → (value of low nibble, value of high nibble).
const fn pair_table() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [E2M1[b & 0x0f], E2M1[b >> 4]];
        b += 1;
    }
    t
}
static PAIRS: [[f32; 2]; 256] = pair_table();

/// `2^(e − 127)` for a validated E8M0 byte (never 255).
#[inline(always)]
pub(crate) fn e8m0(e: u8) -> f32 {
    if e == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((e as u32) << 23)
    }
}

/// `Σ_b scale_b · Σ_k E2M1(code) · x` over one MXFP4 row (natural column order).
pub(crate) fn dot_mxfp4<const NB: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; NB],
) -> [f32; NB] {
    let mut total = [0f32; NB];
    let mut vals = [0f32; GROUP];
    for (blk, &e) in scales.iter().enumerate() {
        for j in 0..GROUP / 2 {
            let p = PAIRS[packed[blk * GROUP / 2 + j] as usize];
            vals[2 * j] = p[0];
            vals[2 * j + 1] = p[1];
        }
        let scale = e8m0(e);
        for b in 0..NB {
            let x = &xs[b][blk * GROUP..(blk + 1) * GROUP];
            let mut acc = [0f32; LANES];
            for c in (0..GROUP).step_by(LANES) {
                for k in 0..LANES {
                    acc[k] += vals[c + k] * x[c + k];
                }
            }
            total[b] += scale * reduce(&acc);
        }
    }
    total
}

/// The fixed reduction of 16 lane sums of the q8x3 MXFP4 kernels:
/// `((l0 + l8) + (l4 + l12)) + …`, a pairwise tree over the halves.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn reduce16(v: &[f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `Σ_lanes f32(S) · (d·2^−17) · 2^(e−127)` over one MXFP4 row against the q8x3 image of
/// `mxfp4_q8x3::q8x3_image`, `S` the exact lane sum of the three levels less the
/// correction: the arithmetic of the AVX-512 VNNI kernel
/// (`x86::avx512_q8x3::dot_mxfp4_q8x3_tile`; same lanes, same integer sums, one multiply
/// and one fused multiply-add per lane and span into one of two accumulators by span parity,
/// then [`reduce16`]), which equals this bit for bit.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn dot_mxfp4_q8x3<const NB: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; NB],
) -> [f32; NB] {
    use crate::mxfp4_q8x3::{E2M1_X2_PLUS_12, SPAN_SLOTS};
    let nblk = scales.len();
    let nspan = nblk.div_ceil(4);
    let mut acc = [[[0f32; 16]; 2]; NB];
    for span in 0..nspan {
        for b in 0..NB {
            let img = &xs[b][span * SPAN_SLOTS..(span + 1) * SPAN_SLOTS];
            let corr: &[i32] = bytemuck::cast_slice(&img[16..32]);
            let codes: &[i8] = bytemuck::cast_slice(&img[32..]);
            for lane in 0..16 {
                let blk = 4 * span + lane / 4;
                let e = if blk < nblk { scales[blk] } else { 0 };
                let mut s = 0i64;
                for c in 8 * lane..8 * lane + 8 {
                    let byte = if blk < nblk {
                        packed[64 * span + c / 2]
                    } else {
                        0
                    };
                    let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    let u = E2M1_X2_PLUS_12[nib as usize] as i64;
                    let at = |lv: usize| codes[128 * lv + 64 * (c % 2) + c / 2] as i64;
                    s += u * (65536 * at(0) + 256 * at(1) + at(2));
                }
                let s = (s - corr[lane] as i64) as i32;
                let f = s as f32 * img[lane];
                let a = &mut acc[b][span % 2][lane];
                *a = f.mul_add(e8m0(e), *a);
            }
        }
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        let v: [f32; 16] = std::array::from_fn(|i| acc[b][0][i] + acc[b][1][i]);
        out[b] = reduce16(&v);
    }
    out
}
