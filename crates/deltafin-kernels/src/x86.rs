//! x86-64 row dot products: AVX2+FMA (8 f32 lanes) and AVX-512 F/BW/VL (16 f32 lanes).
//!
//! Every function handles `NB` activation rows against one weight row, which is loaded and
//! widened once; each activation row has its own accumulators and sees exactly the same
//! instruction sequence whatever `NB` is, so a row's result does not depend on the batch.
//! Reductions use a fixed order (accumulator tree, then a fixed horizontal sum).
//!
//! MXFP4 activations are pre-arranged once per call (see [`crate::matvec`]): the AVX2 kernel
//! takes the *paired* layout, each 32-column block as `[x0, x2, …, x30, x1, x3, …, x31]`, so
//! low nibbles (even columns) and high nibbles (odd columns) of 16 packed bytes meet
//! contiguous activations; the AVX-512 kernel takes the *span* layout described at its
//! `dot_mxfp4`.
//!
//! # Safety
//! All functions require the CPU features named in their `target_feature` attribute, and
//! every activation row must be at least as long as the weight row.

use deltafin_tensor::bf16;
use deltafin_tensor::mxfp4::E2M1;

use std::arch::x86_64::*;

/// AVX-512 F/BW/VL kernels.
pub(crate) mod avx512 {
    use super::*;

    const L: usize = 16;
    const U: usize = 4;

    #[inline(always)]
    fn mask(cnt: usize) -> __mmask16 {
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
    /// `Σ w·x` over a bf16 row, activations in the *bf16-paired* layout of [`crate::matvec`]:
    /// the 1-row instance of the register-tiled kernel [`crate::tile::dot_bf16_tile`] (two
    /// accumulators per product, even and odd columns), so the batched products' tiles give
    /// bit-identical values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(crate) unsafe fn dot_bf16<const NB: usize>(w: &[bf16], xs: [&[f32]; NB]) -> [f32; NB] {
        // SAFETY: forwarded from the caller.
        let [v] = unsafe { crate::tile::dot_bf16_tile::<1, NB>([w], xs) };
        v
    }
    dense_dot!(
        /// `Σ q·x` over an int8 row (unscaled).
        dot_i8, i8,
        |p| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))),
        |p, k| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)))
    );

    /// `s · Σ q·x` over an int8 row with f16 scale `s` (its bit pattern) against activations
    /// quantised to int16 (the *q16 image* of [`crate::matvec`]): the 1-row instance of the
    /// register-tiled kernel [`crate::tile::dot_i8_q16_tile`], so batched tiles give
    /// bit-identical values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub(crate) unsafe fn dot_i8_q16<const NB: usize>(
        w: &[i8],
        scale: u16,
        xs: [&[f32]; NB],
    ) -> [f32; NB] {
        // SAFETY: forwarded from the caller.
        let [v] = unsafe { crate::tile::dot_i8_q16_tile::<1, NB>([w], [scale], xs) };
        v
    }

    /// [`crate::matvec::q16_block_scalar`] in AVX-512: the maximum is order-free, the
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

    /// [`crate::mxfp4_q16::lo_block_scalar`] in AVX-512: the same IEEE multiply, subtract and
    /// divide, `vcvtps2dq` rounding half to even (the MXCSR default), the same clamp (the
    /// quotients stay within ±32769, so clamping the int32 equals clamping the float).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(crate) unsafe fn q16_lo_block(chunk: &[f32], hi: &[i16], s: f32, lo: &mut [i16]) {
        let step = s * crate::mxfp4_q16::LO_STEP;
        if !step.is_normal() {
            lo.fill(0);
            return;
        }
        let n = chunk.len().min(hi.len()).min(lo.len());
        // SAFETY: every load and store is masked to indices < n.
        unsafe {
            let (sv, stepv) = (_mm512_set1_ps(s), _mm512_set1_ps(step));
            let (mn, mx) = (_mm512_set1_epi32(-32767), _mm512_set1_epi32(32767));
            let mut c = 0;
            while c < n {
                let k = mask((n - c).min(L));
                let x = _mm512_maskz_loadu_ps(k, chunk.as_ptr().add(c));
                let h = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(k, hi.as_ptr().add(c)));
                let rest = _mm512_sub_ps(x, _mm512_mul_ps(_mm512_cvtepi32_ps(h), sv));
                let q = _mm512_cvtps_epi32(_mm512_div_ps(rest, stepv));
                let q = _mm512_min_epi32(_mm512_max_epi32(q, mn), mx);
                _mm512_mask_cvtepi32_storeu_epi16(lo.as_mut_ptr().add(c), k, q);
                c += L;
            }
        }
    }

    /// [`crate::mxfp4_q16::BLOCK_COLUMN`] as `vpermw` indices.
    static WORD_ORDER: [i16; 32] = {
        let mut t = [0i16; 32];
        let mut p = 0;
        while p < 32 {
            t[p] = crate::mxfp4_q16::BLOCK_COLUMN[p] as i16;
            p += 1;
        }
        t
    };

    /// One whole 32-column block of the q16 image ([`crate::mxfp4_q16::q16_image`]): the
    /// codes of [`q16_block`] (level 1) and [`q16_lo_block`] (level 2, when `codes` holds
    /// two levels of 128 words) computed in registers with the same IEEE operations in the
    /// same order, so bit-identical to them, then put in the span's word order with one
    /// `vpermw` ([`crate::mxfp4_q16::BLOCK_COLUMN`]) and stored as four 16-byte pieces,
    /// words `8k..8k+8` of each of the level's four code vectors. Returns the block scale
    /// `s` (NaN, with all codes 0, for a block holding a non-finite value).
    ///
    /// # Safety
    /// Requires AVX-512 F/BW/VL; `codes.len()` is 128 or 256 and `k < 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(crate) unsafe fn q16_image_block(x: &[f32; 32], codes: &mut [i16], k: usize) -> f32 {
        use crate::mxfp4_q16::LO_STEP;
        debug_assert!(k < 4 && (codes.len() == 128 || codes.len() == 256));
        let levels = codes.len() / 128;
        // SAFETY: x holds 32 values; the stores write codes[128·lv + 32·j + 8k ..][..8],
        // inside `codes` for lv < levels, j < 4, k < 4.
        unsafe {
            let x0 = _mm512_loadu_ps(x.as_ptr());
            let x1 = _mm512_loadu_ps(x.as_ptr().add(16));
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let inf = _mm512_set1_epi32(0x7f80_0000);
            let a0 = _mm512_and_si512(_mm512_castps_si512(x0), abs);
            let a1 = _mm512_and_si512(_mm512_castps_si512(x1), abs);
            let base = codes.as_mut_ptr();
            let order = _mm512_loadu_si512(WORD_ORDER.as_ptr() as *const __m512i);
            let store = |lv: usize, h0: __m512i, h1: __m512i| {
                // 32 int16 codes in column order, then in the span's word order: word
                // `8j + t` of the result is column BLOCK_COLUMN[8j + t].
                let w = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm512_cvtepi32_epi16(h0)),
                    _mm512_cvtepi32_epi16(h1),
                );
                let w = _mm512_permutexvar_epi16(order, w);
                let dst = base.add(128 * lv + 8 * k);
                _mm_storeu_si128(dst as *mut __m128i, _mm512_castsi512_si128(w));
                _mm_storeu_si128(
                    dst.add(32) as *mut __m128i,
                    _mm512_extracti32x4_epi32::<1>(w),
                );
                _mm_storeu_si128(
                    dst.add(64) as *mut __m128i,
                    _mm512_extracti32x4_epi32::<2>(w),
                );
                _mm_storeu_si128(
                    dst.add(96) as *mut __m128i,
                    _mm512_extracti32x4_epi32::<3>(w),
                );
            };
            let zero = _mm512_setzero_si512();
            let bad = _mm512_cmpge_epi32_mask(a0, inf) | _mm512_cmpge_epi32_mask(a1, inf);
            if bad != 0 {
                for lv in 0..levels {
                    store(lv, zero, zero);
                }
                return f32::NAN;
            }
            let absmax = _mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_castsi512_ps(a0),
                _mm512_castsi512_ps(a1),
            ));
            let scale = if absmax == 0.0 { 1.0 } else { absmax / 32767.0 };
            let sv = _mm512_set1_ps(scale);
            let (mn, mx) = (_mm512_set1_epi32(-32767), _mm512_set1_epi32(32767));
            let q = |v: __m512, d: __m512| {
                _mm512_min_epi32(
                    _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v, d)), mn),
                    mx,
                )
            };
            let (h0, h1) = (q(x0, sv), q(x1, sv));
            store(0, h0, h1);
            if levels == 2 {
                let step = scale * LO_STEP;
                if step.is_normal() {
                    let stepv = _mm512_set1_ps(step);
                    let rest = |v: __m512, h: __m512i| {
                        _mm512_sub_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(h), sv))
                    };
                    store(1, q(rest(x0, h0), stepv), q(rest(x1, h1), stepv));
                } else {
                    store(1, zero, zero);
                }
            }
            scale
        }
    }

    /// One whole 32-column block `k` of the q8x3 image ([`crate::mxfp4_q8x3::q8x3_image`]):
    /// the fixed-point codes `T` of [`crate::mxfp4_q8x3::q8x3_block`] computed in registers
    /// with the same IEEE operations (the division, `vcvtps2dq` rounding half to even, the
    /// integer clamp), so bit-identical to it, on the block's even and odd columns separately
    /// (one `vpermt2ps` each); the digits split off with shifts and stored with `vpmovdb`,
    /// the lane corrections summed from `T`. A block holding a non-finite value or only
    /// zeros, or whose fine step underflows, takes the portable path.
    ///
    /// # Safety
    /// Requires AVX-512 F/BW/VL; `sp` is one span of the image
    /// ([`crate::mxfp4_q8x3::SPAN_SLOTS`] slots) and `k < 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn q8x3_image_block(x: &[f32; 32], sp: &mut [f32], k: usize) {
        use crate::mxfp4_q8x3::{LANE_SCALE, OFFSET, SPAN_SLOTS, STEP, T_MAX};
        debug_assert!(k < 4 && sp.len() == SPAN_SLOTS);
        // SAFETY: x holds 32 values; the stores write sp[4k..4k+4], sp[16+4k..16+4k+4] and
        // 16 bytes at byte offsets 128 + 128·lv + 64·parity + 16k, all inside the span.
        unsafe {
            let x0 = _mm512_loadu_ps(x.as_ptr());
            let x1 = _mm512_loadu_ps(x.as_ptr().add(16));
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let inf = _mm512_set1_epi32(0x7f80_0000);
            let a0 = _mm512_and_si512(_mm512_castps_si512(x0), abs);
            let a1 = _mm512_and_si512(_mm512_castps_si512(x1), abs);
            let bad = _mm512_cmpge_epi32_mask(a0, inf) | _mm512_cmpge_epi32_mask(a1, inf);
            let absmax = _mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_castsi512_ps(a0),
                _mm512_castsi512_ps(a1),
            ));
            let d = absmax / 127.0;
            let t = d * STEP;
            if bad != 0 || absmax == 0.0 || !t.is_normal() {
                let (d, q) = crate::mxfp4_q8x3::q8x3_block(x);
                crate::mxfp4_q8x3::write_block(sp, k, d, &q);
                return;
            }
            let tv = _mm512_set1_ps(t);
            let (mn, mx) = (_mm512_set1_epi32(-T_MAX), _mm512_set1_epi32(T_MAX));
            let even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
            let bytes = sp.as_mut_ptr().add(32) as *mut u8;
            let mut sum = _mm512_setzero_si512();
            for (parity, idx) in [even, odd].into_iter().enumerate() {
                let v = _mm512_permutex2var_ps(x0, idx, x1);
                let q = _mm512_min_epi32(
                    _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v, tv)), mn),
                    mx,
                );
                sum = _mm512_add_epi32(sum, q);
                // Balanced base-256 digits: the low byte as a signed byte, then the rest.
                let low = |t: __m512i| _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(t));
                let q3 = low(q);
                let t1 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(q, q3));
                let q2 = low(t1);
                let q1 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(t1, q2));
                for (lv, digit) in [q1, q2, q3].into_iter().enumerate() {
                    let dst = bytes.add(128 * lv + 64 * parity + 16 * k);
                    _mm_storeu_si128(dst as *mut __m128i, _mm512_cvtepi32_epi8(digit));
                }
            }
            // Position m of `sum` holds columns 2m and 2m + 1; lane l is positions 4l..4l+4.
            let mut pos = [0i32; 16];
            _mm512_storeu_si512(pos.as_mut_ptr() as *mut __m512i, sum);
            let (scales, rest) = sp.split_at_mut(16);
            scales[4 * k..4 * k + 4].fill(d * LANE_SCALE);
            let corr: &mut [i32] = bytemuck::cast_slice_mut(&mut rest[..16]);
            for l in 0..4 {
                corr[4 * k + l] = OFFSET * pos[4 * l..4 * l + 4].iter().sum::<i32>();
            }
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
    unsafe fn scales16(p: *const u8, cnt: usize) -> __m512 {
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
    /// Activations in the *span* layout of [`crate::matvec`]: each full 128-column span
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
    /// `Σ_blk 2^(e−127) · d_blk · Σ E2M1(code)·q` over one MXFP4 row against int8
    /// activations: the q8 image of [`crate::mxfp4_q8::q8_image`] (see that module for the
    /// arithmetic and its error bound).
    ///
    /// Per 128-column span: one 64-byte load of codes (masked for a last span of 1–3 blocks);
    /// low nibbles `v & 0x0F` and high nibbles `(v >> 4) & 0x0F` become the unsigned bytes
    /// `2·E2M1 + 12` through `vpshufb`; two `vpdpbusd` against the even- and odd-column
    /// int8 codes give each dword lane (8 columns of one block) an exact int32 sum; the
    /// lane's correction `12·Σq` is subtracted, the result converted to f32 and multiplied
    /// into the accumulator of the span's parity with the lane scale `2^(e−127) · d/2`.
    /// The final sum is `reduce16(acc0 + acc1)`, as in the scalar reference
    /// [`crate::scalar::dot_mxfp4_q8`], which this kernel equals bit for bit.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    pub(crate) unsafe fn dot_mxfp4_q8<const NB: usize>(
        packed: &[u8],
        scales: &[u8],
        xs: [&[f32]; NB],
    ) -> [f32; NB] {
        use crate::mxfp4_q8::{E2M1_X2_PLUS_12, SPAN_SLOTS};
        let nblk = scales.len();
        let nspan = nblk.div_ceil(4);
        let mut acc = [[_mm512_setzero_ps(); 2]; NB];
        // SAFETY: packed holds 16 bytes per block (the last span's load is masked to the
        // blocks that exist); scale loads are masked likewise; each image row holds
        // SPAN_SLOTS f32 slots per span.
        unsafe {
            let lut =
                _mm512_broadcast_i32x4(_mm_loadu_si128(E2M1_X2_PLUS_12.as_ptr() as *const __m128i));
            let m4 = _mm512_set1_epi8(0x0f);
            let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            let mut sp = 0;
            while sp < nspan {
                // Scales of up to four spans (16 blocks) at once.
                let sc = scales16(scales.as_ptr().add(4 * sp), (nblk - 4 * sp).min(L));
                let mut k = 0;
                while k < 4 && sp + k < nspan {
                    let span = sp + k;
                    let blocks = (nblk - 4 * span).min(4);
                    let wp = packed.as_ptr().add(64 * span);
                    crate::tile::prefetch(wp);
                    let v = if blocks == 4 {
                        _mm512_loadu_si512(wp as *const __m512i)
                    } else {
                        _mm512_maskz_loadu_epi8((1u64 << (16 * blocks)) - 1, wp as *const i8)
                    };
                    let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
                    let hi =
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4));
                    let ws = _mm512_permutexvar_ps(
                        _mm512_add_epi32(_mm512_set1_epi32(4 * k as i32), quarter),
                        sc,
                    );
                    for b in 0..NB {
                        let xp = xs[b].as_ptr().add(SPAN_SLOTS * span);
                        let dh = _mm512_loadu_ps(xp);
                        let corr = _mm512_loadu_si512(xp.add(16) as *const __m512i);
                        let xe = _mm512_loadu_si512(xp.add(32) as *const __m512i);
                        let xo = _mm512_loadu_si512(xp.add(48) as *const __m512i);
                        let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe);
                        let i = _mm512_dpbusd_epi32(i, hi, xo);
                        let f = _mm512_cvtepi32_ps(_mm512_sub_epi32(i, corr));
                        let a = &mut acc[b][span % 2];
                        *a = _mm512_fmadd_ps(f, _mm512_mul_ps(ws, dh), *a);
                    }
                    k += 1;
                }
                sp += 4;
            }
        }
        let mut out = [0f32; NB];
        for b in 0..NB {
            let mut v = [0f32; 16];
            // SAFETY: v holds 16 f32.
            unsafe { _mm512_storeu_ps(v.as_mut_ptr(), _mm512_add_ps(acc[b][0], acc[b][1])) };
            out[b] = crate::scalar::reduce16(&v);
        }
        out
    }

    /// [`crate::scalar::reduce16`] of the 16 lanes of `v` in registers, the same tree (so the
    /// same bits): halves `v_i + v_{i+8}`, quarters `h_i + h_{i+4}`, then
    /// `(q_0 + q_2) + (q_1 + q_3)` — 4 shuffles and 4 adds instead of a store and 15 scalar
    /// adds (a 512-column MXFP4 row has only 4 spans, so its reduction is a large share).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16_ps(v: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<0b01>(p, p)))
    }

    /// `acc + Σ pairs w·a` per dword lane (`vpdpwssd`), as one instruction: LLVM otherwise
    /// splits the intrinsic into `vpmaddwd` + `vpaddd` (two µops, both on the vector ports
    /// the decode also needs) for CPUs it does not know to have a fast `vpdpwssd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    fn dpwssd(acc: __m512i, w: __m512i, a: __m512i) -> __m512i {
        let mut acc = acc;
        // SAFETY: register-only instruction; callers are AVX-512 VNNI functions.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {acc}, {w}, {a}",
                acc = inout(zmm_reg) acc,
                w = in(zmm_reg) w,
                a = in(zmm_reg) a,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    /// `[r][b]` = the MXFP4 product of weight row `r` with activation row `b` in the q16
    /// image of [`crate::mxfp4_q16::q16_image`] with `LV` (1 or 2) levels, for a tile of `NR`
    /// weight rows × `NB` activation rows (see that module for the arithmetic and its error).
    ///
    /// Per 128-column span and weight row: one 64-byte load of codes (masked for a last span
    /// of 1–3 blocks) becomes four vectors of 32 words, each word the weight `2·E2M1` of
    /// one column × 256 (the signed byte in the high half of the word): with AVX-512 VBMI
    /// ([`q16_tile_vbmi`]) one `vpermb` per vector from a 64-entry table, after a
    /// `vpsllw`/`vpsrlw` that moves the wanted nibble into the word's high byte (7 µops);
    /// otherwise ([`q16_tile_bw`]) low nibbles `v & 0x0F` and high nibbles `(v >> 4) & 0x0F`
    /// become the signed bytes through `vpshufb`, then `vpsllw 8` and `& 0xFF00` put the
    /// even and odd bytes in the high halves (9 µops). Both give the same words, so the same
    /// values. Weights are prefetched [`tile_prefetch_distance`] ahead. Per activation row
    /// and level: four `vpdpwssd` give each dword lane (8 columns of one block) an exact int32
    /// sum, converted to f32 and multiplied by the lane's `s/512` (`· 2^−16` for the second
    /// level; the activation scale first, so a tiny E8M0 scale cannot flush the product to
    /// zero early), then multiplied into the accumulator of the span's parity with
    /// `2^(e−127)` (one FMA). The final sum is
    /// `reduce16(acc0 + acc1)`. Every `(r, b)` sees the same f32 operations whatever `NR` and
    /// `NB` are, and equals the scalar reference [`crate::scalar::dot_mxfp4_q16`] bit for bit.
    ///
    /// # Safety
    /// Also requires AVX-512 VNNI; all weight rows have the same number of blocks, `packed`
    /// rows 16 bytes per block, image rows [`crate::mxfp4_q16::span_slots`]`(LV)` slots per
    /// span.
    #[inline(always)]
    pub(crate) unsafe fn dot_mxfp4_q16_tile<const LV: usize, const NR: usize, const NB: usize>(
        packed: [&[u8]; NR],
        scales: [&[u8]; NR],
        xs: [&[f32]; NB],
    ) -> [[f32; NB]; NR] {
        // SAFETY: forwarded from the caller; the VBMI kernel runs only where the CPU has it.
        // The 2 × 3 tile keeps the `vpshufb` decode: with `vpermb` it measured ≈ 10% slower
        // (n = 3, one thread, in cache), the other shapes 0–4% faster.
        unsafe {
            if NB != 3 && vbmi_available() {
                q16_tile_vbmi::<LV, NR, NB>(packed, scales, xs)
            } else {
                q16_tile_bw::<LV, NR, NB>(packed, scales, xs)
            }
        }
    }

    /// Whether this CPU has AVX-512 VBMI (`vpermb`), detected once.
    pub(crate) fn vbmi_available() -> bool {
        static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VBMI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vbmi"))
    }

    /// Least software-prefetch distance of the MXFP4 tiles, in bytes. Measured from DRAM
    /// (2 threads, n = 1, a contended machine, so ±20% per run): 6144 read ≈ 10% more than
    /// 2048 at 1024 and 2048 columns (one 2-row tile there is 1–2 KiB, ≈ 250–500 cycles of
    /// work, so 2048 bytes ahead was shorter than the memory latency), 12288 less again.
    pub(crate) const MXFP4_PREFETCH_BYTES: usize = 6144;

    /// Prefetch distance in bytes of a register tile over `tile_bytes` of weights (its `NR`
    /// consecutive rows): [`MXFP4_PREFETCH_BYTES`] rounded up to a whole number of tiles.
    /// Row `r`'s prefetch then lands on the same column of row `r + k·NR`, which the same
    /// register of a later tile reads, so every row of the stream is fetched ahead, each
    /// line once. (The former fixed 2048 bytes on 3584-byte rows, K3's 7168 columns, in
    /// 2-row tiles sent the first row's prefetches past its end into the second row, already
    /// loaded, and never fetched the first 2048 bytes of every other row: 0.56 → 0.8–0.93 ×
    /// the read probe from DRAM with whole tiles.)
    #[inline]
    pub(crate) fn tile_prefetch_distance(tile_bytes: usize) -> usize {
        let t = tile_bytes.max(1);
        t * MXFP4_PREFETCH_BYTES.div_ceil(t)
    }

    /// Constants of the `vpshufb` decode.
    macro_rules! setup_bw {
        () => {{
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(
                crate::mxfp4_q16::E2M1_X2.as_ptr() as *const __m128i
            ));
            (
                lut,
                _mm512_set1_epi8(0x0f),
                _mm512_set1_epi16(0xff00_u16 as i16),
            )
        }};
    }
    /// The four weight-word vectors of one span's 64 code bytes `v` (`vpshufb` decode).
    macro_rules! decode_bw {
        ($v:expr, $c:expr) => {{
            let v = $v;
            let (lut, m4, odd) = $c;
            let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
            let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4));
            [
                _mm512_slli_epi16::<8>(lo),
                _mm512_and_si512(lo, odd),
                _mm512_slli_epi16::<8>(hi),
                _mm512_and_si512(hi, odd),
            ]
        }};
    }
    /// `2·E2M1(i & 15)` for `i` in 0…63.
    static E2M1_X2_64: [i8; 64] = {
        let mut t = [0i8; 64];
        let mut i = 0;
        while i < 64 {
            t[i] = crate::mxfp4_q16::E2M1_X2[i % 16];
            i += 1;
        }
        t
    };
    /// Constants of the `vpermb` decode: the table `2·E2M1(i & 15)` for `i` in 0…63 (so
    /// index bits 4–5 do not matter; `vpermb` ignores bits 6–7).
    macro_rules! setup_vbmi {
        () => {{
            (
                _mm512_loadu_si512(E2M1_X2_64.as_ptr() as *const __m512i),
                0xAAAA_AAAA_AAAA_AAAA_u64,
            )
        }};
    }

    /// `vpermb` with a zero mask (`{k}{z}`) in one instruction: LLVM otherwise turns the
    /// constant mask into a separate `vpandq`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn vpermb_high(k: u64, idx: __m512i, tab: __m512i) -> __m512i {
        let out: __m512i;
        // SAFETY: register-only instruction; callers are AVX-512 VBMI functions.
        unsafe {
            std::arch::asm!(
                "vpermb {out} {{{k}}}{{z}}, {idx}, {tab}",
                out = lateout(zmm_reg) out,
                k = in(kreg) k,
                idx = in(zmm_reg) idx,
                tab = in(zmm_reg) tab,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        out
    }
    /// The four weight-word vectors of one span's 64 code bytes `v` (`vpermb` decode), the
    /// same words as [`decode_bw`]: word `m` of `v` is `b0 | b1 << 8` (`b0` the even byte);
    /// `v << 8`, `v`, `v << 4` and `v >> 4` (16-bit shifts) hold the low nibble of `b0`, of
    /// `b1`, the high nibble of `b0`, of `b1` in bits 8–11, where `vpermb` of the high byte
    /// reads its index. The low byte must give 0: after `<< 8` it is 0 and after `<< 4` a
    /// multiple of 16, both table entry `2·E2M1(0) = 0`; `v` and `v >> 4` keep a code
    /// there, so those two `vpermb` zero the low bytes with a mask.
    macro_rules! decode_vbmi {
        ($v:expr, $c:expr) => {{
            let v = $v;
            let tab = $c;
            let (tab, high) = tab;
            [
                _mm512_permutexvar_epi8(_mm512_slli_epi16::<8>(v), tab),
                vpermb_high(high, v, tab),
                _mm512_permutexvar_epi8(_mm512_slli_epi16::<4>(v), tab),
                vpermb_high(high, _mm512_srli_epi16::<4>(v), tab),
            ]
        }};
    }

    /// The 64 code bytes of span `span` of one packed MXFP4 row (`blocks` of its four blocks
    /// exist; the load is masked to them), prefetching the byte `pfd` ahead into L1 (a
    /// prefetch never faults: the address may lie past the weights, wrapping arithmetic,
    /// never dereferenced).
    ///
    /// # Safety
    /// Requires AVX-512 BW; the row holds `16·blocks` bytes from `64·span`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn span_codes(row: &[u8], span: usize, blocks: usize, pfd: usize) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe {
            let wp = row.as_ptr().add(64 * span);
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(pfd) as *const i8);
            if blocks == 4 {
                _mm512_loadu_si512(wp as *const __m512i)
            } else {
                _mm512_maskz_loadu_epi8((1u64 << (16 * blocks)) - 1, wp as *const i8)
            }
        }
    }

    /// The span loop of the MXFP4 register tiles: per four spans one [`scales16`] per weight
    /// row, then the tile's `$span!(span, k, scales, accumulator)` for each span, spans
    /// alternating between the two accumulator sets (`$span` is the tile's own macro).
    macro_rules! spans {
        ($span:ident, $scales:ident, $nblk:ident, $nspan:ident, $acc0:ident, $acc1:ident) => {{
            let mut sp = 0;
            while sp < $nspan {
                // Scales of up to four spans (16 blocks) at once.
                let sc: [__m512; NR] = std::array::from_fn(|r| {
                    scales16($scales[r].as_ptr().add(4 * sp), ($nblk - 4 * sp).min(L))
                });
                if sp + 4 <= $nspan {
                    $span!(sp, 0, sc, $acc0);
                    $span!(sp + 1, 1, sc, $acc1);
                    $span!(sp + 2, 2, sc, $acc0);
                    $span!(sp + 3, 3, sc, $acc1);
                } else {
                    for k in 0..$nspan - sp {
                        if k % 2 == 0 {
                            $span!(sp + k, k, sc, $acc0);
                        } else {
                            $span!(sp + k, k, sc, $acc1);
                        }
                    }
                }
                sp += 4;
            }
        }};
    }

    /// `reduce16(acc0 + acc1)` of every product of a tile (the final sum of the MXFP4 tiles).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce_pairs<const NR: usize, const NB: usize>(
        acc0: &[[__m512; NB]; NR],
        acc1: &[[__m512; NB]; NR],
    ) -> [[f32; NB]; NR] {
        std::array::from_fn(|r| {
            std::array::from_fn(|b| reduce16_ps(_mm512_add_ps(acc0[r][b], acc1[r][b])))
        })
    }

    /// The body of [`dot_mxfp4_q16_tile`] with a given weight decode.
    macro_rules! q16_tile {
        ($(#[$m:meta])* $name:ident, $feat:literal, $setup:ident, $decode:ident) => {
            $(#[$m])*
            #[target_feature(enable = $feat)]
            #[allow(clippy::needless_range_loop)] // `r`, `b` index weights, images and accumulators
            pub(crate) unsafe fn $name<const LV: usize, const NR: usize, const NB: usize>(
                packed: [&[u8]; NR],
                scales: [&[u8]; NR],
                xs: [&[f32]; NB],
            ) -> [[f32; NB]; NR] {
                use crate::mxfp4_q16::{LO_STEP, span_slots};
                let slots = span_slots(LV);
                let nblk = scales[0].len();
                let nspan = nblk.div_ceil(4);
                let mut acc0 = [[_mm512_setzero_ps(); NB]; NR];
                let mut acc1 = [[_mm512_setzero_ps(); NB]; NR];
                let pfd = tile_prefetch_distance(NR * 16 * nblk);
                // SAFETY: packed rows hold 16 bytes per block (the last span's load is masked
                // to the blocks that exist); scale loads are masked likewise; each image row
                // holds `slots` f32 slots per span.
                unsafe {
                    let consts = $setup!();
                    let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                    let lo_step = _mm512_set1_ps(LO_STEP);
                    // One span into the accumulators `$acc` (a fixed array, so they stay in
                    // registers).
                    macro_rules! span {
                        ($span:expr, $k:expr, $sc:expr, $acc:ident) => {{
                            let span = $span;
                            let blocks = (nblk - 4 * span).min(4);
                            let qidx = _mm512_add_epi32(_mm512_set1_epi32(4 * $k as i32), quarter);
                            let mut w = [[_mm512_setzero_si512(); 4]; NR];
                            let mut ws = [_mm512_setzero_ps(); NR];
                            for r in 0..NR {
                                let v = span_codes(packed[r], span, blocks, pfd);
                                w[r] = $decode!(v, consts);
                                ws[r] = _mm512_permutexvar_ps(qidx, $sc[r]);
                            }
                            for b in 0..NB {
                                let xp = xs[b].as_ptr().add(slots * span);
                                let ls = _mm512_loadu_ps(xp);
                                let ls = [ls, _mm512_mul_ps(ls, lo_step)];
                                for lv in 0..LV {
                                    let cp = xp.add(16 + 64 * lv);
                                    let a: [__m512i; 4] = std::array::from_fn(|j| {
                                        _mm512_loadu_si512(cp.add(16 * j) as *const __m512i)
                                    });
                                    for r in 0..NR {
                                        let i = _mm512_madd_epi16(w[r][0], a[0]);
                                        let i = dpwssd(i, w[r][1], a[1]);
                                        let i = dpwssd(i, w[r][2], a[2]);
                                        let i = dpwssd(i, w[r][3], a[3]);
                                        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(i), ls[lv]);
                                        $acc[r][b] = _mm512_fmadd_ps(f, ws[r], $acc[r][b]);
                                    }
                                }
                            }
                        }};
                    }
                    spans!(span, scales, nblk, nspan, acc0, acc1);
                }
                reduce_pairs(&acc0, &acc1)
            }
        };
    }

    q16_tile!(
        /// [`dot_mxfp4_q16_tile`] with the `vpshufb` decode (AVX-512 BW).
        q16_tile_bw,
        "avx512f,avx512bw,avx512vl,avx512vnni,fma",
        setup_bw,
        decode_bw
    );
    q16_tile!(
        /// [`dot_mxfp4_q16_tile`] with the `vpermb` decode (AVX-512 VBMI).
        q16_tile_vbmi,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma",
        setup_vbmi,
        decode_vbmi
    );
    /// `[r][b] = Σ_c 2^(e−127)·E2M1(w_rc) · x_bc` for `NR` MXFP4 weight rows against `NB`
    /// activation rows in the q8x3 image of [`crate::mxfp4_q8x3`] (three int8 levels; see that
    /// module for the arithmetic and its error).
    ///
    /// Per 128-column span and weight row: one 64-byte load of codes (masked for a last span
    /// of 1–3 blocks) becomes the unsigned weight bytes `2·E2M1 + 12` of the low and of the
    /// high nibbles — with AVX-512 VBMI ([`dot_mxfp4_q8x3_tile_vbmi`]) one `vpermb` each from
    /// a 64-entry table (the high nibbles after one `vpsrlw`), otherwise
    /// ([`dot_mxfp4_q8x3_tile_bw`]) a mask and a `vpshufb` each; both give the same bytes, so
    /// the same values. Per activation row: six `vpdpbusd` in three independent pairs
    /// (one per digit, the third starting from the negated correction), the first pair's
    /// lanes shifted left 16 bits and the second's 8 and all added: the exact int32 lane
    /// sum, converted to f32, multiplied by the lane's `d·2^−17`, then multiplied into the
    /// accumulator of the span's parity with `2^(e−127)` (one FMA). The final sum is
    /// `reduce16(acc0 + acc1)`. Every `(r, b)` sees the same f32 operations whatever `NR` and
    /// `NB` are, and equals the scalar reference [`crate::scalar::dot_mxfp4_q8x3`] bit for bit.
    /// Weights are prefetched [`tile_prefetch_distance`] ahead.
    ///
    /// # Safety
    /// Requires AVX-512 F/BW/VL and VNNI; all weight rows have the same number of blocks,
    /// `packed` rows 16 bytes per block, image rows [`crate::mxfp4_q8x3::SPAN_SLOTS`] slots
    /// per span.
    #[inline(always)]
    pub(crate) unsafe fn dot_mxfp4_q8x3_tile<const NR: usize, const NB: usize>(
        packed: [&[u8]; NR],
        scales: [&[u8]; NR],
        xs: [&[f32]; NB],
    ) -> [[f32; NB]; NR] {
        // SAFETY: forwarded from the caller; the VBMI kernel runs only where the CPU has it.
        unsafe {
            if vbmi_available() {
                dot_mxfp4_q8x3_tile_vbmi::<NR, NB>(packed, scales, xs)
            } else {
                dot_mxfp4_q8x3_tile_bw::<NR, NB>(packed, scales, xs)
            }
        }
    }

    /// `2·E2M1(i & 15) + 12` for `i` in 0…63.
    static E2M1_X2_PLUS_12_64: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            t[i] = crate::mxfp4_q8x3::E2M1_X2_PLUS_12[i % 16];
            i += 1;
        }
        t
    };
    /// The unsigned weight bytes of one span's 64 code bytes `v` (low nibbles, high
    /// nibbles) with `vpermb` (only index bits 0–5 count and the table repeats every 16).
    macro_rules! decode_u8_vbmi {
        ($v:expr, $tab:expr) => {{
            let v = $v;
            (
                _mm512_permutexvar_epi8(v, $tab),
                _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v), $tab),
            )
        }};
    }
    /// The same bytes with `vpshufb` (index bits 0–3 after a mask).
    macro_rules! decode_u8_bw {
        ($v:expr, $tab:expr) => {{
            let v = $v;
            let m4 = _mm512_set1_epi8(0x0f);
            (
                _mm512_shuffle_epi8($tab, _mm512_and_si512(v, m4)),
                _mm512_shuffle_epi8($tab, _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4)),
            )
        }};
    }

    /// The body of [`dot_mxfp4_q8x3_tile`] with a given weight decode.
    macro_rules! q8x3_tile {
        ($(#[$m:meta])* $name:ident, $feat:literal, $tab:expr, $decode:ident) => {
            $(#[$m])*
            #[target_feature(enable = $feat)]
            #[allow(clippy::needless_range_loop)] // `r`, `b` index weights, images and accumulators
            pub(crate) unsafe fn $name<const NR: usize, const NB: usize>(
                packed: [&[u8]; NR],
                scales: [&[u8]; NR],
                xs: [&[f32]; NB],
            ) -> [[f32; NB]; NR] {
                use crate::mxfp4_q8x3::SPAN_SLOTS;
                let nblk = scales[0].len();
                let nspan = nblk.div_ceil(4);
                let mut acc0 = [[_mm512_setzero_ps(); NB]; NR];
                let mut acc1 = [[_mm512_setzero_ps(); NB]; NR];
                let pfd = tile_prefetch_distance(NR * 16 * nblk);
                // SAFETY: packed rows hold 16 bytes per block (the last span's load is masked
                // to the blocks that exist); scale loads are masked likewise; each image row
                // holds SPAN_SLOTS f32 slots per span.
                unsafe {
                    let tab = $tab;
                    let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                    macro_rules! span {
                        ($span:expr, $k:expr, $sc:expr, $acc:ident) => {{
                            let span = $span;
                            let blocks = (nblk - 4 * span).min(4);
                            let qidx = _mm512_add_epi32(_mm512_set1_epi32(4 * $k as i32), quarter);
                            let mut ul = [_mm512_setzero_si512(); NR];
                            let mut uh = [_mm512_setzero_si512(); NR];
                            let mut ws = [_mm512_setzero_ps(); NR];
                            for r in 0..NR {
                                let v = span_codes(packed[r], span, blocks, pfd);
                                (ul[r], uh[r]) = $decode!(v, tab);
                                ws[r] = _mm512_permutexvar_ps(qidx, $sc[r]);
                            }
                            for b in 0..NB {
                                let xp = xs[b].as_ptr().add(SPAN_SLOTS * span);
                                let ls = _mm512_loadu_ps(xp);
                                let ncorr = _mm512_sub_epi32(
                                    _mm512_setzero_si512(),
                                    _mm512_loadu_si512(xp.add(16) as *const __m512i),
                                );
                                let a: [__m512i; 6] = std::array::from_fn(|j| {
                                    _mm512_loadu_si512(xp.add(32 + 16 * j) as *const __m512i)
                                });
                                for r in 0..NR {
                                    // Three independent chains (short latency), the
                                    // correction folded into the third one's start.
                                    let z = _mm512_setzero_si512();
                                    let i1 = _mm512_dpbusd_epi32(z, ul[r], a[0]);
                                    let i2 = _mm512_dpbusd_epi32(z, ul[r], a[2]);
                                    let i3 = _mm512_dpbusd_epi32(ncorr, ul[r], a[4]);
                                    let i1 = _mm512_dpbusd_epi32(i1, uh[r], a[1]);
                                    let i2 = _mm512_dpbusd_epi32(i2, uh[r], a[3]);
                                    let i3 = _mm512_dpbusd_epi32(i3, uh[r], a[5]);
                                    let i = _mm512_add_epi32(
                                        _mm512_add_epi32(
                                            _mm512_slli_epi32::<16>(i1),
                                            _mm512_slli_epi32::<8>(i2),
                                        ),
                                        i3,
                                    );
                                    let f = _mm512_mul_ps(_mm512_cvtepi32_ps(i), ls);
                                    $acc[r][b] = _mm512_fmadd_ps(f, ws[r], $acc[r][b]);
                                }
                            }
                        }};
                    }
                    spans!(span, scales, nblk, nspan, acc0, acc1);
                }
                reduce_pairs(&acc0, &acc1)
            }
        };
    }

    /// [`dot_mxfp4_q8x3_tile_vbmi`] for two weight rows (at `p0`, `p1`, scales at `s0`, `s1`,
    /// `nblk` blocks each, a multiple of 16) and one image row at `xp0`: the one-token decode
    /// shape of every routed expert, with plain pointers so its arguments travel in registers.
    ///
    /// Per span and row the three digits are folded as one chain,
    /// `S = (((Σ₁ << 8) + Σ₂) << 8) − C + Σ₃` (`Σ_k`: the two `vpdpbusd` of digit k, each
    /// starting from the value before it): the same int32 as the tile's
    /// `(Σ₁ << 16) + (Σ₂ << 8) + (Σ₃ − C)` (wrapping integer arithmetic, `|S| < 2^31`), with one
    /// addition less; every floating-point operation is the tile's, in its order, so the
    /// results are the same bits (`avx512_mxfp4_q8x3_kernel_equals_scalar_reference_bitwise`).
    /// One thread, in cache, `mini`'s 512-column experts (`kernel-point`): 11.6 GB/s through
    /// the generic tile before this kernel, 13.4 GB/s with three independent digit pairs,
    /// 14.5 GB/s with the chain, 14.6 GB/s subtracting `C` (not adding its negation), and
    /// 16.3 GB/s once [`scales16`] took a maximum instead of a compare and a masked move.
    ///
    /// # Safety
    /// As [`dot_mxfp4_q8x3_tile`], with AVX-512 VBMI; the rows and the image row hold what
    /// `nblk` blocks need.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma")]
    #[inline]
    pub(crate) unsafe fn dot_mxfp4_q8x3_pair_vbmi(
        p0: *const u8,
        p1: *const u8,
        s0: *const u8,
        s1: *const u8,
        nblk: usize,
        xp0: *const f32,
    ) -> [f32; 2] {
        use crate::mxfp4_q8x3::SPAN_SLOTS;
        let nspan = nblk / 4;
        let pfd = tile_prefetch_distance(2 * 16 * nblk);
        // SAFETY: packed rows hold 16 bytes per block, scale rows one byte per block, the
        // image SPAN_SLOTS slots per span; nblk is a multiple of 16.
        unsafe {
            let tab = _mm512_loadu_si512(E2M1_X2_PLUS_12_64.as_ptr() as *const __m512i);
            let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            let mut a00 = _mm512_setzero_ps();
            let mut a01 = _mm512_setzero_ps();
            let mut a10 = _mm512_setzero_ps();
            let mut a11 = _mm512_setzero_ps();
            let mut sp = 0;
            while sp < nspan {
                let sc0 = scales16(s0.add(4 * sp), L);
                let sc1 = scales16(s1.add(4 * sp), L);
                macro_rules! span {
                    ($k:expr, $acc0:ident, $acc1:ident) => {{
                        let span = sp + $k;
                        let w0 = p0.add(64 * span);
                        let w1 = p1.add(64 * span);
                        _mm_prefetch::<_MM_HINT_T0>(w0.wrapping_add(pfd) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(w1.wrapping_add(pfd) as *const i8);
                        let v0 = _mm512_loadu_si512(w0 as *const __m512i);
                        let v1 = _mm512_loadu_si512(w1 as *const __m512i);
                        let ul0 = _mm512_permutexvar_epi8(v0, tab);
                        let uh0 = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v0), tab);
                        let ul1 = _mm512_permutexvar_epi8(v1, tab);
                        let uh1 = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(v1), tab);
                        let qidx = _mm512_add_epi32(_mm512_set1_epi32(4 * $k), quarter);
                        let ws0 = _mm512_permutexvar_ps(qidx, sc0);
                        let ws1 = _mm512_permutexvar_ps(qidx, sc1);
                        let xp = xp0.add(SPAN_SLOTS * span);
                        let ls = _mm512_loadu_ps(xp);
                        let corr = _mm512_loadu_si512(xp.add(16) as *const __m512i);
                        let a0 = _mm512_loadu_si512(xp.add(32) as *const __m512i);
                        let a1 = _mm512_loadu_si512(xp.add(48) as *const __m512i);
                        let a2 = _mm512_loadu_si512(xp.add(64) as *const __m512i);
                        let a3 = _mm512_loadu_si512(xp.add(80) as *const __m512i);
                        let a4 = _mm512_loadu_si512(xp.add(96) as *const __m512i);
                        let a5 = _mm512_loadu_si512(xp.add(112) as *const __m512i);
                        let z = _mm512_setzero_si512();
                        let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, ul0, a0), uh0, a1);
                        let j = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, ul1, a0), uh1, a1);
                        let i = _mm512_slli_epi32::<8>(i);
                        let j = _mm512_slli_epi32::<8>(j);
                        let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i, ul0, a2), uh0, a3);
                        let j = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(j, ul1, a2), uh1, a3);
                        let i = _mm512_sub_epi32(_mm512_slli_epi32::<8>(i), corr);
                        let j = _mm512_sub_epi32(_mm512_slli_epi32::<8>(j), corr);
                        let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i, ul0, a4), uh0, a5);
                        let j = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(j, ul1, a4), uh1, a5);
                        $acc0 =
                            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i), ls), ws0, $acc0);
                        $acc1 =
                            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(j), ls), ws1, $acc1);
                    }};
                }
                span!(0, a00, a10);
                span!(1, a01, a11);
                span!(2, a00, a10);
                span!(3, a01, a11);
                sp += 4;
            }
            [
                reduce16_ps(_mm512_add_ps(a00, a01)),
                reduce16_ps(_mm512_add_ps(a10, a11)),
            ]
        }
    }

    q8x3_tile!(
        /// [`dot_mxfp4_q8x3_tile`] with the `vpshufb` decode (AVX-512 BW).
        dot_mxfp4_q8x3_tile_bw,
        "avx512f,avx512bw,avx512vl,avx512vnni,fma",
        _mm512_broadcast_i32x4(_mm_loadu_si128(
            crate::mxfp4_q8x3::E2M1_X2_PLUS_12.as_ptr() as *const __m128i
        )),
        decode_u8_bw
    );
    q8x3_tile!(
        /// [`dot_mxfp4_q8x3_tile`] with the `vpermb` decode (AVX-512 VBMI).
        dot_mxfp4_q8x3_tile_vbmi,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma",
        _mm512_loadu_si512(E2M1_X2_PLUS_12_64.as_ptr() as *const __m512i),
        decode_u8_vbmi
    );
}

/// AVX2 + FMA kernels.
pub(crate) mod avx2 {
    use super::*;

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
    dense_dot!(
        /// `Σ q·x` over an int8 row (unscaled).
        dot_i8, i8,
        |p| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))),
        |v| v as f32
    );

    /// `Σ q·x` over an int8 row (unscaled) against the q16 image of [`crate::matvec`] (per
    /// activation row `ceil(n / Q16_BLOCK)` f32 block scales, then int16 codes zero-padded to
    /// whole 32-column steps): per 16-column step `vpmovsxbw` + `vpmaddwd` (pairs of int16
    /// products, exact) into two int32 accumulators, per block one convert and one FMA with
    /// the block scale. `|Σ|` per lane and block ≤ 32 · 127 · 32767 < 2^31.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // `blk` indexes weights, codes and scales together
    pub(crate) unsafe fn dot_i8_q16<const NB: usize>(w: &[i8], xs: [&[f32]; NB]) -> [f32; NB] {
        use crate::matvec::Q16_BLOCK;
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

    /// [`crate::matvec::q16_block_scalar`] in AVX2, bit-identical for the same reasons as
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
                let q =
                    _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(chunk.as_ptr().add(c)), sv));
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
                    let sign_lo =
                        _mm256_slli_epi32::<28>(_mm256_and_si256(v, _mm256_set1_epi32(8)));
                    let sign_hi =
                        _mm256_slli_epi32::<24>(_mm256_and_si256(v, _mm256_set1_epi32(0x80)));
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
}
