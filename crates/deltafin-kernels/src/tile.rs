//! Register-tiled products on AVX-512: `NR` weight rows × `NB` activation rows per call, for
//! bf16 ([`dot_bf16_tile`]) and row-int8 against int16 activations ([`dot_i8_q16_tile`]).
//!
//! One bf16 kernel serves decode (`NR = 1`, `NB = 1`) and prefill (`NR = 2`, `NB = 6`, the
//! ragged rest of a batch in `NB = 1…4`): every
//! product `(r, b)` owns two accumulators (even columns, odd columns) and sees exactly the
//! same instruction sequence whatever `NR` and `NB` are — one FMA per 32-column group into
//! each accumulator, in column order, the last group masked — followed by the same
//! reduction, `reduce_add(acc_even + acc_odd)`. So a value does not depend on the tile it
//! was computed in, the batch width or the thread count: it is bit-identical to the
//! single-row result.
//!
//! Why a 2 × 4 tile: the weight group (one 64-byte load, a shift and a mask) is shared by
//! four activation rows, and each activation load by two weight rows, so a 2 × 4 tile issues
//! 10 loads per 16 FMAs where the former 1 × 4 tile with four accumulators per product
//! issued 18; 16 accumulators + 4 weight registers + 2 activation registers fit the 32 zmm
//! registers. The bf16 prefill takes the 2 × 6 instance (24 accumulators + 4 + 2 + the mask
//! = 31 registers): 4 shifts/masks per 24 FMAs instead of per 16, and the reductions
//! and the call shared by 12 products.
//!
//! Activations are in the *bf16-paired* layout of [`crate::layout::pair_groups`]: each 32-column group
//! as `[16 even columns, 16 odd columns]`, zero-padded to a whole group. Dword lane `i` of
//! a 64-byte weight load is `w[2i] | w[2i+1] << 16`, so a 16-bit left shift gives the even
//! columns as f32 and masking the low half gives the odd ones.
//!
//! # Safety
//! The functions require AVX-512 F/BW/VL and FMA; all weight rows have the same length `n`,
//! and every activation row holds at least `n` rounded up to 32 values.

use crate::layout::Q16_BLOCK;
use deltafin_tensor::bf16;
use std::arch::x86_64::*;

/// Software prefetch distance in bytes ahead of the weight stream. One core keeps only
/// about 16 demand misses in flight, which caps a single stream near 7 GB/s here; asking
/// for the line [`PREFETCH_BYTES`] ahead (rows are contiguous, so past a row's end this is
/// the next row) keeps the memory system busy. Measured on the 2-core machine: row-int8
/// products from DRAM 14.3 → 19.0 GB/s (7168 columns) and 11.1 → 17.4 GB/s (1024).
pub(crate) const PREFETCH_BYTES: usize = 2048;

/// Prefetch distance of a register tile over `tile_bytes` of weights (its `NR` consecutive
/// rows): [`PREFETCH_BYTES`] rounded up to a whole number of tiles, so that row `r`'s
/// prefetch lands on the same column of row `r + k·NR`, which the same register of a later
/// tile reads: every row is fetched ahead, each line once. A fixed distance that is not a
/// multiple of the tile sends some rows' prefetches into a row the tile is already loading.
/// Used by the row-int8 tiles: from DRAM, 2 threads, A B B A × 2, 2816 columns
/// 0.71–0.82 → 0.94–1.00 × the read probe, 7168 columns 0.91–0.94 → 0.95–1.04 ×, 512 and 1024
/// columns unchanged (their 2-row tiles are already 1–2 KiB; rows of at most
/// 1024 columns take 4-row tiles, see `rows::TALL_TILE_MAX_COLS`). The bf16 tiles use
/// [`bf16_distance`]: whole tiles of at least 4 KiB for decode tiles up to 8 KiB, the fixed
/// distance otherwise (whole tiles were worse at 7168 columns: 0.79–0.89 against 0.95–1.11 ×,
/// a 28 KiB distance).
#[inline]
pub(crate) fn tile_distance(tile_bytes: usize) -> usize {
    whole_tiles(tile_bytes, PREFETCH_BYTES)
}

/// `at_least` bytes rounded up to a whole number of `tile_bytes` tiles.
#[inline]
fn whole_tiles(tile_bytes: usize, at_least: usize) -> usize {
    let t = tile_bytes.max(1);
    t * at_least.div_ceil(t)
}

/// Prefetch distance of a bf16 tile of `NR` rows of `n` values against `NB` activation rows.
/// Decode tiles (`NB = 1`) of at most 8 KiB prefetch whole tiles, at least 4 KiB ahead: with
/// the fixed 2 KiB, a 2-row tile of 1024-column rows sent its first row's prefetches into its
/// own second row, so half of them were wasted and the other row ran one tile ahead only.
/// Measured on `mini` (1024- and 512-column products), bf16 decode A B B A × 4:
/// 20.2 → 23.0 token/s; 3 and 8 KiB measured the same as 4. Wider rows (a 7168-column row is
/// 14 KiB: the fixed distance stays inside the row) and batched tiles keep
/// [`PREFETCH_BYTES`], which measured better there.
#[inline]
fn bf16_distance<const NR: usize, const NB: usize>(n: usize) -> usize {
    let tile = NR * n * 2;
    if NB == 1 && tile <= 8192 {
        whole_tiles(tile, 4096)
    } else {
        PREFETCH_BYTES
    }
}

/// Distance in bytes of the second, far software prefetch of the weight stream (into L2,
/// `prefetcht1`), in whole tiles ([`far_distance`]). The near prefetch ([`PREFETCH_BYTES`],
/// into L1) is bounded by the core's L1 fill buffers: about 16 lines in flight, each waiting a
/// whole DRAM latency, caps one core near 13 GB/s, and the L2 streamer restarts at every 4 KiB
/// page. Asking L2 for the line far ahead (its miss queue is deeper) turns most of the near
/// prefetches into L2 hits. Used by the row-int8 and bf16 tiles (the MXFP4 tiles, bound by
/// their arithmetic, measured no gain). Measured (`kernel-point`, 2 MiB products from DRAM,
/// `n = 1`): row-int8 at 1024 columns, one thread 13.0–13.6 → 14.9–15.2 GB/s, two
/// 23.6–25.4 → 25.8–27.3; bf16 at 1024 columns, one thread 13.3–13.5 → 14.4–14.7, two 23.9–24.0
/// → 24.3–24.4; bf16 at 7168 columns, two threads 23.8–24.2 → 25.4; 8, 16 and 32 KiB measured
/// alike within the noise, 64 KiB worse on two threads. Changes no value.
pub(crate) const FAR_PREFETCH_BYTES: usize = 16 * 1024;

/// Far prefetch distance of a register tile over `tile_bytes` of weights: at least
/// [`FAR_PREFETCH_BYTES`], whole tiles (see [`tile_distance`]).
#[inline]
pub(crate) fn far_distance(tile_bytes: usize) -> usize {
    whole_tiles(tile_bytes, FAR_PREFETCH_BYTES)
}

/// Hint the line `dist` bytes after `p` into L2 (see [`FAR_PREFETCH_BYTES`]).
#[inline(always)]
pub(crate) fn prefetch_far(p: *const u8, dist: usize) {
    // SAFETY: PREFETCHT1 is SSE (baseline x86-64) and does not access memory
    // architecturally.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(dist) as *const i8) };
}

/// Hint the line `dist` bytes after `p` into L1 (see [`prefetch`]).
#[inline(always)]
pub(crate) fn prefetch_at(p: *const u8, dist: usize) {
    // SAFETY: PREFETCHT0 is SSE (baseline x86-64) and does not access memory
    // architecturally.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(dist) as *const i8) };
}

/// Hint the line [`PREFETCH_BYTES`] after `p` into L1. A prefetch never faults, so the
/// address may lie past the end of the weights (it is computed with wrapping arithmetic
/// and never dereferenced).
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    // SAFETY: PREFETCHT0 is SSE (baseline x86-64) and does not access memory
    // architecturally.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8) };
}

/// `[r][b] = Σ_c w_r[c] · x_b[c]` for `NR` bf16 weight rows and `NB` paired activation rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[allow(clippy::needless_range_loop)] // `r`, `b` index weights, activations and accumulators
pub(crate) unsafe fn dot_bf16_tile<const NR: usize, const NB: usize>(
    ws: [&[bf16]; NR],
    xs: [&[f32]; NB],
) -> [[f32; NB]; NR] {
    let n = ws[0].len();
    let groups = n.div_ceil(32);
    let mut acc = [[[_mm512_setzero_ps(); 2]; NB]; NR];
    // SAFETY: full groups are in bounds of every weight row (all of length n); the last
    // group's load is masked to the columns < n; activation rows hold whole zero-padded
    // groups.
    unsafe {
        let hi = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let wp: [*const u8; NR] = std::array::from_fn(|r| ws[r].as_ptr() as *const u8);
        let pfd = bf16_distance::<NR, NB>(n);
        let far = far_distance(NR * n * 2);
        for c in 0..groups {
            let cnt = n - 32 * c;
            let mut we = [_mm512_setzero_ps(); NR];
            let mut wo = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                prefetch_at(wp[r].wrapping_add(64 * c), pfd);
                prefetch_far(wp[r].wrapping_add(64 * c), far);
                let v = if cnt >= 32 {
                    _mm512_loadu_si512(wp[r].add(64 * c) as *const __m512i)
                } else {
                    let k: __mmask32 = (1u32 << cnt) - 1;
                    _mm512_maskz_loadu_epi16(k, wp[r].add(64 * c) as *const i16)
                };
                we[r] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
            for b in 0..NB {
                let xp = xs[b].as_ptr().add(32 * c);
                let xe = _mm512_loadu_ps(xp);
                let xo = _mm512_loadu_ps(xp.add(16));
                for r in 0..NR {
                    acc[r][b][0] = _mm512_fmadd_ps(we[r], xe, acc[r][b][0]);
                    acc[r][b][1] = _mm512_fmadd_ps(wo[r], xo, acc[r][b][1]);
                }
            }
        }
    }
    let mut out = [[0f32; NB]; NR];
    for r in 0..NR {
        for b in 0..NB {
            out[r][b] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
        }
    }
    out
}

/// `[r][b] = s_r · Σ_c q_r[c] · x_b[c]` for `NR` int8 weight rows with f16 row scales `s_r`
/// (`scales`: the bit patterns of rows `r…r+NR`, converted exactly by F16C) against `NB`
/// activation rows quantised to int16 (the *q16 image* of [`crate::layout::q16_image`]: per activation
/// row, `ceil(n / Q16_BLOCK)` f32 block scales, then the int16 codes, zero-padded to whole
/// 32-column steps, two per f32 slot). Per block `Σ q·c` is exact in int32 (`vpdpwssd`,
/// |q| ≤ 127, |c| ≤ 32767, 256 terms stay below 2^31) in two accumulators alternating per
/// 32-column step, then converted and multiplied by the block scale into one f32 accumulator
/// per product; the reduced sum is multiplied by the row scale last (one f32 multiply, the
/// same as scaling the unscaled sum outside). The row scale is applied here rather than by
/// the caller because, in the caller, `half`'s runtime-dispatched conversion was a call per
/// row and the scaled values went back through a store-forwarding stall: about 6% of a
/// `mini` decode token's samples. A 2 × 4 tile holds 16 + 8 accumulators; each product's
/// instruction sequence is the same for every `NR`, `NB`.
///
/// # Safety
/// Also requires AVX-512 VNNI; all weight rows have length `n`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `blk`, `r`, `b` index weights, codes and scales together
pub(crate) unsafe fn dot_i8_q16_tile<const NR: usize, const NB: usize>(
    ws: [&[i8]; NR],
    scales: [u16; NR],
    xs: [&[f32]; NB],
) -> [[f32; NB]; NR] {
    let n = ws[0].len();
    let nblk = n.div_ceil(Q16_BLOCK);
    let pfd = tile_distance(NR * n);
    let far = far_distance(NR * n);
    let mut facc = [[_mm512_setzero_ps(); NB]; NR];
    // SAFETY: weight loads are in bounds or masked to columns < n; each image row holds
    // nblk scales and codes for whole 32-column steps (zero-padded).
    unsafe {
        let codes: [*const i16; NB] =
            std::array::from_fn(|b| xs[b].as_ptr().add(nblk) as *const i16);
        for blk in 0..nblk {
            let (c0, c1) = (blk * Q16_BLOCK, ((blk + 1) * Q16_BLOCK).min(n));
            let mut iacc = [[[_mm512_setzero_si512(); 2]; NB]; NR];
            // One 32-column step into accumulator `U` (a constant, so the accumulators stay
            // in registers); the int32 sums are exact, so how steps are spread over the two
            // accumulators does not change any result.
            macro_rules! step {
                ($c:expr, $u:literal) => {{
                    let c = $c;
                    let mut wv = [_mm512_setzero_si512(); NR];
                    for r in 0..NR {
                        let wp = ws[r].as_ptr();
                        wv[r] = if c + 32 <= c1 {
                            _mm512_cvtepi8_epi16(_mm256_loadu_si256(wp.add(c) as *const __m256i))
                        } else {
                            let k: __mmask32 = (1u32 << (c1 - c)) - 1;
                            _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(k, wp.add(c)))
                        };
                    }
                    for b in 0..NB {
                        let xv = _mm512_loadu_si512(codes[b].add(c) as *const __m512i);
                        for r in 0..NR {
                            iacc[r][b][$u] = _mm512_dpwssd_epi32(iacc[r][b][$u], wv[r], xv);
                        }
                    }
                }};
            }
            let mut c = c0;
            while c + 64 <= c1 {
                for r in 0..NR {
                    prefetch_at(ws[r].as_ptr().wrapping_add(c) as *const u8, pfd);
                    prefetch_far(ws[r].as_ptr().wrapping_add(c) as *const u8, far);
                }
                step!(c, 0);
                step!(c + 32, 1);
                c += 64;
            }
            if c < c1 {
                step!(c, 0);
                if c + 32 < c1 {
                    step!(c + 32, 1);
                }
            }
            for b in 0..NB {
                let scale = _mm512_set1_ps(xs[b][blk]);
                for r in 0..NR {
                    let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(iacc[r][b][0], iacc[r][b][1]));
                    facc[r][b] = _mm512_fmadd_ps(sum, scale, facc[r][b]);
                }
            }
        }
    }
    let mut out = [[0f32; NB]; NR];
    for r in 0..NR {
        let s = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(scales[r] as i32)));
        for b in 0..NB {
            out[r][b] = s * _mm512_reduce_add_ps(facc[r][b]);
        }
    }
    out
}
