//! AVX2 + FMA kernels.

use deltafin_tensor::bf16;
use deltafin_tensor::mxfp4::E2M1;
use std::arch::x86_64::*;
const L: usize = 8;
const U: usize = 4;

/// Fixed-order horizontal sum of one register.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

macro_rules! dense_dot {
    ($(#[$m:meta])* $name:ident, $T:ty, |$p:ident| $load:expr, |$s:ident| $widen:expr) => {
        $(#[$m])*
        #[target_feature(enable = "avx2,fma")]
        pub(crate) unsafe fn $name<const NB: usize>(w: &[$T], xs: [&[f32]; NB]) -> [f32; NB] {
            let n = w.len();
            let wp = w.as_ptr();
            let main = n - n % (L * U);
            let vec_end = n - n % L;
            let mut acc = [[_mm256_setzero_ps(); U]; NB];
            let mut c = 0;
            // SAFETY: every vector load covers columns < vec_end <= n; activation rows
            // hold at least n values.
            unsafe {
                while c < main {
                    for u in 0..U {
                        crate::tile::prefetch(wp.wrapping_add(c + u * L) as *const u8);
                        let $p = wp.add(c + u * L);
                        let wv: __m256 = $load;
                        for b in 0..NB {
                            let xv = _mm256_loadu_ps(xs[b].as_ptr().add(c + u * L));
                            acc[b][u] = _mm256_fmadd_ps(wv, xv, acc[b][u]);
                        }
                    }
                    c += L * U;
                }
                let mut u = 0;
                while c < vec_end {
                    let $p = wp.add(c);
                    let wv: __m256 = $load;
                    for b in 0..NB {
                        let xv = _mm256_loadu_ps(xs[b].as_ptr().add(c));
                        acc[b][u] = _mm256_fmadd_ps(wv, xv, acc[b][u]);
                    }
                    u += 1;
                    c += L;
                }
            }
            let mut out = [0f32; NB];
            for b in 0..NB {
                let a = &acc[b];
                let s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
                let mut tail = 0f32;
                for i in vec_end..n {
                    let $s = w[i];
                    tail += $widen * xs[b][i];
                }
                out[b] = hsum256(s) + tail;
            }
            out
        }
    };
}

dense_dot!(
    /// `Σ w·x` over an f32 row.
    dot_f32, f32,
    |p| _mm256_loadu_ps(p),
    |v| v
);
/// `Σ w·x` over a bf16 row, activations in the bf16-paired layout with 16-column groups
/// (`[8 even, 8 odd]`, zero-padded): the AVX-512 scheme on 256-bit registers.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_bf16<const NB: usize>(w: &[bf16], xs: [&[f32]; NB]) -> [f32; NB] {
    let n = w.len();
    let wp = w.as_ptr();
    let full = n / 16;
    let mut acc = [[_mm256_setzero_ps(); U]; NB];
    // SAFETY: full groups are in bounds; the partial group is copied to a zero-padded
    // buffer first; activation rows hold whole zero-padded groups.
    unsafe {
        let hi = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        let group = |v: __m256i, c: usize, u: usize, acc: &mut [[__m256; U]; NB]| {
            let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
            let wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            for b in 0..NB {
                let xp = xs[b].as_ptr().add(16 * c);
                acc[b][2 * u] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xp), acc[b][2 * u]);
                acc[b][2 * u + 1] =
                    _mm256_fmadd_ps(wo, _mm256_loadu_ps(xp.add(8)), acc[b][2 * u + 1]);
            }
        };
        let mut c = 0;
        while c + 2 <= full {
            for u in 0..2 {
                let v = _mm256_loadu_si256(wp.add(16 * (c + u)) as *const __m256i);
                group(v, c + u, u, &mut acc);
            }
            c += 2;
        }
        let mut u = 0;
        while 16 * c < n {
            let mut tail = [bf16::ZERO; 16];
            let cnt = (n - 16 * c).min(16);
            tail[..cnt].copy_from_slice(&w[16 * c..16 * c + cnt]);
            let v = _mm256_loadu_si256(tail.as_ptr() as *const __m256i);
            group(v, c, u, &mut acc);
            u += 1;
            c += 1;
        }
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        let a = &acc[b];
        let s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        out[b] = hsum256(s);
    }
    out
}
/// `Σ q·x` over an int8 row (unscaled) against the q16 image of [`crate::layout`] (per
/// activation row `ceil(n / Q16_BLOCK)` f32 block scales, then int16 codes zero-padded to
/// whole 32-column steps): per 16-column step `vpmovsxbw` + `vpmaddwd` (pairs of int16
/// products, exact) into two int32 accumulators, per block one convert and one FMA with
/// the block scale. `|Σ|` per lane and block ≤ 32 · 127 · 32767 < 2^31.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // `blk` indexes weights, codes and scales together
pub(crate) unsafe fn dot_i8_q16<const NB: usize>(w: &[i8], xs: [&[f32]; NB]) -> [f32; NB] {
    use crate::layout::Q16_BLOCK;
    let n = w.len();
    let nblk = n.div_ceil(Q16_BLOCK);
    let mut facc = [_mm256_setzero_ps(); NB];
    // SAFETY: full 16-column steps are in bounds of `w`; a partial one is copied to a
    // zero-padded buffer; image rows hold nblk scales and codes for whole 32-column steps.
    unsafe {
        let codes: [*const i16; NB] =
            std::array::from_fn(|b| xs[b].as_ptr().add(nblk) as *const i16);
        let wp = w.as_ptr();
        for blk in 0..nblk {
            let (c0, c1) = (blk * Q16_BLOCK, ((blk + 1) * Q16_BLOCK).min(n));
            let mut iacc = [[_mm256_setzero_si256(); 2]; NB];
            macro_rules! step {
                ($c:expr, $u:literal) => {{
                    let c = $c;
                    let wv = if c + 16 <= c1 {
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(wp.add(c) as *const __m128i))
                    } else {
                        let mut t = [0i8; 16];
                        t[..c1 - c].copy_from_slice(&w[c..c1]);
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(t.as_ptr() as *const __m128i))
                    };
                    for b in 0..NB {
                        let xv = _mm256_loadu_si256(codes[b].add(c) as *const __m256i);
                        iacc[b][$u] = _mm256_add_epi32(iacc[b][$u], _mm256_madd_epi16(wv, xv));
                    }
                }};
            }
            let mut c = c0;
            while c + 32 <= c1 {
                crate::tile::prefetch(wp.wrapping_add(c) as *const u8);
                step!(c, 0);
                step!(c + 16, 1);
                c += 32;
            }
            if c < c1 {
                step!(c, 0);
                if c + 16 < c1 {
                    step!(c + 16, 1);
                }
            }
            for b in 0..NB {
                let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(iacc[b][0], iacc[b][1]));
                facc[b] = _mm256_fmadd_ps(sum, _mm256_set1_ps(xs[b][blk]), facc[b]);
            }
        }
    }
    facc.map(|v| hsum256(v))
}

/// [`crate::layout::q16_block_scalar`] in AVX2, bit-identical for the same reasons as
/// the AVX-512 version (order-free max, same division, `vcvtps2dq` rounds half to even).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn q16_block(chunk: &[f32], codes: &mut [i16]) -> f32 {
    let n = chunk.len().min(codes.len());
    let full = n - n % 8;
    let abs = _mm256_set1_epi32(0x7fff_ffff);
    let inf = _mm256_set1_epi32(0x7f80_0000 - 1);
    let mut m = _mm256_setzero_ps();
    let mut bad = _mm256_setzero_si256();
    // SAFETY: vector loads and stores stay below `full` <= n; the tail is scalar.
    unsafe {
        let mut c = 0;
        while c < full {
            let a = _mm256_and_si256(
                _mm256_castps_si256(_mm256_loadu_ps(chunk.as_ptr().add(c))),
                abs,
            );
            // Not finite: the magnitude's bits exceed those of the largest finite value.
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(a, inf));
            m = _mm256_max_ps(m, _mm256_castsi256_ps(a));
            c += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let mut absmax = lanes.iter().fold(0f32, |a, &v| a.max(v));
        let mut finite = _mm256_testz_si256(bad, bad) == 1;
        for &v in &chunk[full..n] {
            finite &= v.is_finite();
            absmax = absmax.max(v.abs());
        }
        if !finite {
            return f32::NAN;
        }
        let scale = if absmax == 0.0 { 1.0 } else { absmax / 32767.0 };
        let sv = _mm256_set1_ps(scale);
        let lo = _mm256_set1_epi32(-32767);
        let hi = _mm256_set1_epi32(32767);
        let mut c = 0;
        while c < full {
            let q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(chunk.as_ptr().add(c)), sv));
            let q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
            // Pack to int16 (saturating, values already in range) and fix the lane order.
            let p = _mm256_packs_epi32(q, q);
            let p = _mm256_permute4x64_epi64::<0b1000>(p);
            _mm_storeu_si128(
                codes.as_mut_ptr().add(c) as *mut __m128i,
                _mm256_castsi256_si128(p),
            );
            c += 8;
        }
        for (o, &v) in codes[full..n].iter_mut().zip(&chunk[full..n]) {
            *o = (v / scale).round_ties_even().clamp(-32767.0, 32767.0) as i16;
        }
        scale
    }
}

/// `Σ_blk 2^(e−127) · Σ E2M1(code)·x` over one MXFP4 row, activations in paired layout.
/// Magnitudes come from an 8-entry permute, the sign bit is xor-ed in.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot_mxfp4<const NB: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; NB],
) -> [f32; NB] {
    let mut acc = [[_mm256_setzero_ps(); 2]; NB];
    // SAFETY: packed holds 16 bytes per block, activation rows 32 values per block.
    unsafe {
        let lut = _mm256_loadu_ps(E2M1.as_ptr());
        // Block `blk` goes to accumulator `blk % 2`, written with a constant index so the
        // accumulators stay in registers.
        let one = |blk: usize, e: u8, acc: &mut [__m256; NB]| {
            crate::tile::prefetch(packed.as_ptr().wrapping_add(blk * 16));
            let s = _mm256_set1_ps(crate::scalar::e8m0(e));
            let mut w = [_mm256_setzero_ps(); 4];
            for h in 0..2 {
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    packed.as_ptr().add(blk * 16 + 8 * h) as *const __m128i,
                ));
                let sign_lo = _mm256_slli_epi32::<28>(_mm256_and_si256(v, _mm256_set1_epi32(8)));
                let sign_hi = _mm256_slli_epi32::<24>(_mm256_and_si256(v, _mm256_set1_epi32(0x80)));
                w[h] = _mm256_xor_ps(
                    _mm256_permutevar8x32_ps(lut, v),
                    _mm256_castsi256_ps(sign_lo),
                );
                w[2 + h] = _mm256_xor_ps(
                    _mm256_permutevar8x32_ps(lut, _mm256_srli_epi32::<4>(v)),
                    _mm256_castsi256_ps(sign_hi),
                );
            }
            for b in 0..NB {
                let xp = xs[b].as_ptr().add(blk * 32);
                let t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
                let t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), t);
                let t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), t);
                let t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), t);
                acc[b] = _mm256_fmadd_ps(t, s, acc[b]);
            }
        };
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); NB], [_mm256_setzero_ps(); NB]);
        let mut pairs = scales.chunks_exact(2);
        let mut blk = 0;
        for pair in &mut pairs {
            one(blk, pair[0], &mut acc0);
            one(blk + 1, pair[1], &mut acc1);
            blk += 2;
        }
        if let [e] = pairs.remainder() {
            one(blk, *e, &mut acc0);
        }
        for b in 0..NB {
            acc[b] = [acc0[b], acc1[b]];
        }
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        out[b] = hsum256(_mm256_add_ps(acc[b][0], acc[b][1]));
    }
    out
}
