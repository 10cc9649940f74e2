//! AVX-512 F/BW/VL kernels: the dense dots, the f32-activation MXFP4 dot and the row-int8
//! q16 block quantiser.

use deltafin_tensor::mxfp4::E2M1;
use std::arch::x86_64::*;
pub(crate) const L: usize = 16;
const U: usize = 4;

#[inline(always)]
pub(crate) fn mask(cnt: usize) -> __mmask16 {
    ((1u32 << cnt) - 1) as __mmask16
}

/// `((a0 + a1) + (a2 + a3))`, then the horizontal sum.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
fn hsum(acc: [__m512; U]) -> f32 {
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s)
}

macro_rules! dense_dot {
    ($(#[$m:meta])* $name:ident, $T:ty, |$p:ident| $load:expr, |$pm:ident, $k:ident| $mload:expr) => {
        $(#[$m])*
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
        pub(crate) unsafe fn $name<const NB: usize>(w: &[$T], xs: [&[f32]; NB]) -> [f32; NB] {
            let n = w.len();
            let wp = w.as_ptr();
            let main = n - n % (L * U);
            let mut acc = [[_mm512_setzero_ps(); U]; NB];
            let mut c = 0;
            // SAFETY: c + L * U <= n for the full steps; the tail uses masked loads that
            // touch only columns < n; activation rows hold at least n values.
            unsafe {
                while c < main {
                    for u in 0..U {
                        crate::tile::prefetch(wp.wrapping_add(c + u * L) as *const u8);
                        let $p = wp.add(c + u * L);
                        let wv: __m512 = $load;
                        for b in 0..NB {
                            let xv = _mm512_loadu_ps(xs[b].as_ptr().add(c + u * L));
                            acc[b][u] = _mm512_fmadd_ps(wv, xv, acc[b][u]);
                        }
                    }
                    c += L * U;
                }
                // At most four remaining chunks (the last one partial) go to accumulators 0..3.
                let mut u = 0;
                while c < n {
                    let $k = mask((n - c).min(L));
                    let $pm = wp.add(c);
                    let wv: __m512 = $mload;
                    for b in 0..NB {
                        let xv = _mm512_maskz_loadu_ps($k, xs[b].as_ptr().add(c));
                        acc[b][u] = _mm512_fmadd_ps(wv, xv, acc[b][u]);
                    }
                    u += 1;
                    c += L;
                }
            }
            let mut out = [0f32; NB];
            for b in 0..NB {
                out[b] = hsum(acc[b]);
            }
            out
        }
    };
}

dense_dot!(
    /// `Σ w·x` over an f32 row.
    dot_f32, f32,
    |p| _mm512_loadu_ps(p),
    |p, k| _mm512_maskz_loadu_ps(k, p)
);
dense_dot!(
    /// `Σ q·x` over an int8 row (unscaled).
    dot_i8, i8,
    |p| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))),
    |p, k| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)))
);

/// [`crate::layout::q16_block_scalar`] in AVX-512: the maximum is order-free, the
/// division is the same IEEE operation and `vcvtps2dq` rounds half to even (the MXCSR
/// default, which Rust never changes), so the codes are bit-identical.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) unsafe fn q16_block(chunk: &[f32], codes: &mut [i16]) -> f32 {
    let n = chunk.len().min(codes.len());
    let inf = _mm512_set1_epi32(0x7f80_0000);
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let mut m = _mm512_setzero_ps();
    let mut bad: __mmask16 = 0;
    // SAFETY: every load and store is masked to indices < n.
    unsafe {
        let mut c = 0;
        while c < n {
            let k = mask((n - c).min(L));
            let v = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, chunk.as_ptr().add(c)));
            let a = _mm512_and_si512(v, abs);
            // Not finite: exponent bits all ones.
            bad |= _mm512_cmpge_epi32_mask(a, inf);
            m = _mm512_max_ps(m, _mm512_castsi512_ps(a));
            c += L;
        }
        if bad != 0 {
            return f32::NAN;
        }
        let absmax = _mm512_reduce_max_ps(m);
        let scale = if absmax == 0.0 { 1.0 } else { absmax / 32767.0 };
        let s = _mm512_set1_ps(scale);
        let lo = _mm512_set1_epi32(-32767);
        let hi = _mm512_set1_epi32(32767);
        let mut c = 0;
        while c < n {
            let k = mask((n - c).min(L));
            let v = _mm512_maskz_loadu_ps(k, chunk.as_ptr().add(c));
            let q = _mm512_cvtps_epi32(_mm512_div_ps(v, s));
            let q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
            _mm512_mask_cvtepi32_storeu_epi16(codes.as_mut_ptr().add(c), k, q);
            c += L;
        }
        scale
    }
}

/// One 32-column block: `acc += scale · Σ (E2M1(even)·x_even + E2M1(odd)·x_odd)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn block<const NB: usize>(
    codes: *const u8,
    scale: f32,
    lut: __m512,
    xs: &[*const f32; NB],
    acc: &mut [__m512; NB],
) {
    // SAFETY: the caller guarantees 16 code bytes and 32 activations per row.
    unsafe {
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes as *const __m128i));
        // vpermps reads only index bits 3..0: the low nibble needs no mask.
        let we = _mm512_permutexvar_ps(v, lut);
        let wo = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), lut);
        let s = _mm512_set1_ps(scale);
        for b in 0..NB {
            let t = _mm512_mul_ps(we, _mm512_loadu_ps(xs[b]));
            let t = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xs[b].add(16)), t);
            acc[b] = _mm512_fmadd_ps(t, s, acc[b]);
        }
    }
}

/// Sixteen E8M0 bytes (masked to `cnt`) as the f32 scales `2^(e−127)` (e = 0 → 2^−127).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) unsafe fn scales16(p: *const u8, cnt: usize) -> __m512 {
    // SAFETY: the masked load touches only `cnt` bytes, which the caller guarantees.
    let e = _mm512_cvtepu8_epi32(unsafe { _mm_maskz_loadu_epi8(mask(cnt), p as *const i8) });
    // `e << 23` is the f32 2^(e−127) for e ≥ 1 (at least 1 << 23); the maximum with
    // 1 << 22, the bits of 2^−127, only changes e = 0.
    _mm512_castsi512_ps(_mm512_max_epu32(
        _mm512_slli_epi32::<23>(e),
        _mm512_set1_epi32(1 << 22),
    ))
}

/// `Σ_blk 2^(e−127) · Σ E2M1(code)·x` over one MXFP4 row.
///
/// Activations in the *span* layout of [`crate::layout`]: each full 128-column span
/// (four blocks) transposed as `xt[16j + i] = x[8i + j]`, the remaining blocks paired.
/// A span's 64 code bytes are loaded once; dword lane `i` holds columns `8i..8i+8`, so
/// shifting it right by `4j` puts column `8i + j`'s code in the index bits of `vpermps`,
/// and lane `i` belongs to block `i / 4`, whose scale is applied once per span.
/// Spans alternate between two accumulators, the tail blocks likewise.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) unsafe fn dot_mxfp4<const NB: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; NB],
) -> [f32; NB] {
    let nblk = scales.len();
    let nspan = nblk / 4;
    let mut acc0 = [_mm512_setzero_ps(); NB];
    let mut acc1 = [_mm512_setzero_ps(); NB];
    // SAFETY: packed holds 16 bytes per block and activation rows 32 values per block;
    // scale loads are masked to the blocks that exist.
    unsafe {
        let lut = _mm512_loadu_ps(E2M1.as_ptr());
        let mut sp = 0;
        while sp < nspan {
            // Scales of up to four spans (16 blocks) at once.
            let sc = scales16(scales.as_ptr().add(4 * sp), (4 * (nspan - sp)).min(L));
            let mut k = 0;
            while k < 4 && sp + k < nspan {
                let span = sp + k;
                let idx = _mm512_add_epi32(
                    _mm512_set1_epi32(4 * k as i32),
                    _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                );
                let s = _mm512_permutexvar_ps(idx, sc);
                crate::tile::prefetch(packed.as_ptr().wrapping_add(64 * span));
                let v = _mm512_loadu_si512(packed.as_ptr().add(64 * span) as *const __m512i);
                let w: [__m512; 8] = [
                    _mm512_permutexvar_ps(v, lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(v), lut),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(v), lut),
                ];
                for b in 0..NB {
                    let xp = xs[b].as_ptr().add(128 * span);
                    let mut t = _mm512_mul_ps(w[0], _mm512_loadu_ps(xp));
                    for (j, &wj) in w.iter().enumerate().skip(1) {
                        t = _mm512_fmadd_ps(wj, _mm512_loadu_ps(xp.add(16 * j)), t);
                    }
                    if span % 2 == 0 {
                        acc0[b] = _mm512_fmadd_ps(t, s, acc0[b]);
                    } else {
                        acc1[b] = _mm512_fmadd_ps(t, s, acc1[b]);
                    }
                }
                k += 1;
            }
            sp += 4;
        }
        for (blk, &e) in scales.iter().enumerate().skip(4 * nspan) {
            let xp: [*const f32; NB] = std::array::from_fn(|b| xs[b].as_ptr().add(blk * 32));
            let codes = packed.as_ptr().add(blk * 16);
            let scale = crate::scalar::e8m0(e);
            if blk % 2 == 0 {
                block(codes, scale, lut, &xp, &mut acc0);
            } else {
                block(codes, scale, lut, &xp, &mut acc1);
            }
        }
    }
    let mut out = [0f32; NB];
    for b in 0..NB {
        out[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b]));
    }
    out
}
/// [`crate::scalar::reduce16`] of the 16 lanes of `v` in registers, the same tree (so the
/// same bits): halves `v_i + v_{i+8}`, quarters `h_i + h_{i+4}`, then
/// `(q_0 + q_2) + (q_1 + q_3)` — 4 shuffles and 4 adds instead of a store and 15 scalar
/// adds (a 512-column MXFP4 row has only 4 spans, so its reduction is a large share).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn reduce16_ps(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<0b01>(p, p)))
}

/// Whether this CPU has AVX-512 VBMI (`vpermb`), detected once.
pub(crate) fn vbmi_available() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VBMI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vbmi"))
}
