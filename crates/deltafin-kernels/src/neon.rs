//! aarch64 Advanced SIMD (NEON) row dot products, 4 f32 lanes × 4 accumulators.
//!
//! Same contract as the x86 kernels: `NB` activation rows per weight row with identical
//! per-row arithmetic, fixed reduction order, MXFP4 activations in the paired layout.
//!
//! # Safety
//! Requires NEON; every activation row must be at least as long as the weight row.

use deltafin_tensor::bf16;
use std::arch::aarch64::*;

const L: usize = 4;
const U: usize = 4;

/// E2M1 values × 2 as int8 (exact); the block scale is halved to compensate.
const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[inline]
#[target_feature(enable = "neon")]
fn hsum(a: [float32x4_t; U]) -> f32 {
    vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])))
}

macro_rules! dense_dot {
    ($(#[$m:meta])* $name:ident, $T:ty, |$p:ident| $load:expr, |$s:ident| $widen:expr) => {
        $(#[$m])*
        #[target_feature(enable = "neon")]
        pub(crate) unsafe fn $name<const NB: usize>(w: &[$T], xs: [&[f32]; NB]) -> [f32; NB] {
            let n = w.len();
            let wp = w.as_ptr();
            let main = n - n % (L * U);
            let mut acc = [[vdupq_n_f32(0.0); U]; NB];
            let mut c = 0;
            // SAFETY: loads cover columns < main <= n; activation rows hold at least n values.
            unsafe {
                while c < main {
                    for u in 0..U {
                        let $p = wp.add(c + u * L);
                        let wv: float32x4_t = $load;
                        for b in 0..NB {
                            let xv = vld1q_f32(xs[b].as_ptr().add(c + u * L));
                            acc[b][u] = vfmaq_f32(acc[b][u], wv, xv);
                        }
                    }
                    c += L * U;
                }
            }
            let mut out = [0f32; NB];
            for b in 0..NB {
                let mut tail = 0f32;
                for i in main..n {
                    let $s = w[i];
                    tail += $widen * xs[b][i];
                }
                out[b] = hsum(acc[b]) + tail;
            }
            out
        }
    };
}

dense_dot!(
    /// `Σ w·x` over an f32 row.
    dot_f32, f32,
    |p| vld1q_f32(p),
    |v| v
);
dense_dot!(
    /// `Σ w·x` over a bf16 row.
    dot_bf16, bf16,
    |p| vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p as *const u16))),
    |v| crate::scalar::widen_bf16(v)
);
dense_dot!(
    /// `Σ q·x` over an int8 row (unscaled; 4 codes per step).
    dot_i8, i8,
    |p| {
        let q = i32::from_le_bytes([*p as u8, *p.add(1) as u8, *p.add(2) as u8, *p.add(3) as u8]);
        let v = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(q)));
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(v)))
    },
    |v| v as f32
);

/// Widen 16 int8 values to four f32x4.
#[inline]
#[target_feature(enable = "neon")]
fn widen16(q: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(q));
    let hi = vmovl_high_s8(q);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// `Σ_blk 2^(e−128) · Σ 2·E2M1(code)·x` over one MXFP4 row, activations in paired layout.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_mxfp4<const NB: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; NB],
) -> [f32; NB] {
    let mut acc = [[vdupq_n_f32(0.0); 2]; NB];
    // SAFETY: packed holds 16 bytes per block, activation rows 32 values per block.
    unsafe {
        let tbl = vld1q_s8(E2M1_X2.as_ptr());
        for (blk, &e) in scales.iter().enumerate() {
            // 2^(e − 128); e = 0 → 2^−128 (subnormal bit 21).
            let half = if e == 0 {
                f32::from_bits(1 << 21)
            } else if e == 1 {
                f32::from_bits(1 << 22)
            } else {
                f32::from_bits(((e - 1) as u32) << 23)
            };
            let v = vld1q_u8(packed.as_ptr().add(blk * 16));
            let lo = vqtbl1q_s8(tbl, vandq_u8(v, vdupq_n_u8(0x0f)));
            let hi = vqtbl1q_s8(tbl, vshrq_n_u8::<4>(v));
            let we = widen16(lo);
            let wo = widen16(hi);
            for b in 0..NB {
                let xp = xs[b].as_ptr().add(blk * 32);
                let mut t = vmulq_f32(we[0], vld1q_f32(xp));
                for (k, &wk) in we.iter().enumerate().skip(1) {
                    t = vfmaq_f32(t, wk, vld1q_f32(xp.add(4 * k)));
                }
                for (k, &wk) in wo.iter().enumerate() {
                    t = vfmaq_f32(t, wk, vld1q_f32(xp.add(16 + 4 * k)));
                }
                acc[b][blk % 2] = vfmaq_n_f32(acc[b][blk % 2], t, half);
            }
        }
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        out[b] = vaddvq_f32(vaddq_f32(acc[b][0], acc[b][1]));
    }
    out
}
