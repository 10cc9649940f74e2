//! The MXFP4 × q8x3 kernels of AVX-512 VNNI (see `mxfp4_q8x3` for the arithmetic): the
//! image block quantiser, the register tiles and the two-row decode kernel.

use std::arch::x86_64::*;

use super::avx512::{L, reduce16_ps, scales16, vbmi_available};
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
                    $acc0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i), ls), ws0, $acc0);
                    $acc1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(j), ls), ws1, $acc1);
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
