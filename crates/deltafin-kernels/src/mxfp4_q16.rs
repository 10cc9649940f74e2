//! MXFP4 products against int16-quantised activations (AVX-512 VNNI, `vpdpwssd`).
//!
//! Each activation row is quantised once per product call, per 32-column block (the MXFP4
//! block), by [`crate::matvec::q16_block`]: `s = absmax/32767`, `h = round_half_even(x/s)` in
//! −32767…32767 (an all-zero block gives `s = 1` and codes 0; a block holding a non-finite
//! value gives `s = NaN`, so the product is NaN as in f32). With two levels (`q16x2`) the
//! remainder is quantised again on a 65536× finer step:
//! `l = round_half_even((x − h·s) / (s/65536))`, clamped to ±32767, so a column is
//! represented as `s·(h + l/65536)` with an error of at most `absmax/2^32` (plus f32 rounding
//! of the remainder, about 2^−24·|x|): the precision of f32 itself. One level (`q16`) keeps
//! an error of at most `s/2 = absmax/65534` per column.
//!
//! The weight nibbles become `256·2·E2M1` in int16 lanes (`vpshufb` with a table of
//! `2·E2M1` as signed bytes, then the byte moved to the high half of each 16-bit word:
//! `vpsllw 8` for the even byte, `& 0xFF00` for the odd one, no port-5 sign extension), and
//! four `vpdpwssd` per span and level sum them against the codes exactly in int32: dword lane
//! `i` of a 128-column span covers the 8 columns `8i..8i+8` of block `i/4`, at most
//! `8·3072·32767 < 2^31`. Each lane's exact sum is converted to f32 once, multiplied by
//! `s/512` (`s/512 · 2^−16` for the second level) and multiplied into the accumulator of the
//! span's parity with `2^(e−127)` (one FMA); the final value is `reduce16(acc0 + acc1)`. The f32 part is the same for
//! every tile shape, so batched rows are bit-identical to single rows.

use std::borrow::Cow;

use deltafin_tensor::mxfp4::{E2M1, GROUP};

/// Columns of one span: four MXFP4 blocks, one 64-byte load of weight codes.
pub(crate) const SPAN: usize = 128;

/// f32 slots of one span of the image with `levels` code levels: 16 lane scales, then per
/// level 128 int16 codes (64 slots).
pub(crate) const fn span_slots(levels: usize) -> usize {
    16 + 64 * levels
}

/// Step of the second level relative to the first (exact power of two).
pub(crate) const LO_STEP: f32 = 1.0 / 65536.0;

/// `2·E2M1(code)` for codes 0…15 as signed bytes (−12…12).
pub(crate) const E2M1_X2: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (2.0 * E2M1[i]) as i8;
        i += 1;
    }
    t
};

/// Offset of code vector `j`'s columns within a lane's 8 columns: vector 0 holds the even
/// bytes' low nibbles, 1 the odd bytes' low nibbles, 2 the even bytes' high nibbles, 3 the
/// odd bytes' high nibbles.
const VEC_OFFSET: [usize; 4] = [0, 2, 1, 3];

/// The span column (0…127) that word `m` (0…31) of code vector `j` (0…3) holds:
/// `8·(m/2) + 4·(m%2) + [0, 2, 1, 3][j]`. Word `m` of vector `j` meets the weight of the
/// same column in the kernel's decode: byte `2m` (`j` even) or `2m + 1` (`j` odd) of the
/// span's 64 code bytes, low nibble (`j < 2`) or high nibble.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const fn word_column(j: usize, m: usize) -> usize {
    8 * (m / 2) + 4 * (m % 2) + VEC_OFFSET[j]
}

/// The inverse of [`word_column`]: `(j, m)` of span column `c`.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const fn column_word(c: usize) -> (usize, usize) {
    let t = c % 8;
    (VEC_OFFSET[t % 4], 2 * (c / 8) + t / 4)
}

/// Block-relative column of word `t` (0…7) of block `k`'s part of code vector `j`:
/// `BLOCK_COLUMN[8j + t]` = [`word_column`]`(j, 8k + t) − 32k`.
pub(crate) const BLOCK_COLUMN: [usize; 32] = {
    let mut t = [0usize; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = 8 * ((i % 8) / 2) + 4 * (i % 2) + VEC_OFFSET[i / 8];
        i += 1;
    }
    t
};

/// Write block `k`'s 32 codes (natural column order) into one level's 4 code vectors of a
/// span: words `8k..8k+8` of each vector.
#[inline]
fn scatter_block(block: &[i16; GROUP], level: &mut [i16], k: usize) {
    for j in 0..4 {
        let dst = &mut level[32 * j + 8 * k..32 * j + 8 * k + 8];
        for (t, d) in dst.iter_mut().enumerate() {
            *d = block[BLOCK_COLUMN[8 * j + t]];
        }
    }
}

/// The q16 image of activation rows of `cols` values (a multiple of 32) with `levels`
/// (1 or 2) code levels: per row, `ceil(cols / 128)` spans of [`span_slots`] f32 slots:
/// - slots 0..16: lane `i`'s `s/512` of its block `4·span + i/4` (0 for padding blocks);
/// - per level `v`, slots `16 + 64v ..`: 4 vectors of 32 int16 codes, word `m` of vector `j`
///   = the code of span column [`word_column`]`(j, m)` (0 for padding).
///
/// Returns the image, the offset of its first row (a 64-byte boundary, so no code load
/// splits a cache line) and the row stride.
pub(crate) fn q16_image(
    xs: &[f32],
    cols: usize,
    levels: usize,
) -> (Cow<'static, [f32]>, usize, usize) {
    #[cfg(target_arch = "x86_64")]
    let fused = crate::dispatch::Backend::Avx512.is_supported();
    #[cfg(not(target_arch = "x86_64"))]
    let fused = false;
    q16_image_with(xs, cols, levels, fused)
}

/// [`q16_image`], whole blocks through the fused AVX-512 block quantiser
/// ([`crate::x86::avx512::q16_image_block`]: both levels in registers, one `vpermw` into
/// the span's word order, four 16-byte stores per level) when `fused`, else (and for a
/// ragged last block) through [`crate::matvec::q16_block`], [`lo_block`] and the table
/// scatter. Both give the same image bit for bit.
pub(crate) fn q16_image_with(
    xs: &[f32],
    cols: usize,
    levels: usize,
    fused: bool,
) -> (Cow<'static, [f32]>, usize, usize) {
    assert!((1..=2).contains(&levels), "q16 image: 1 or 2 levels");
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fused;
    let slots = span_slots(levels);
    let stride = cols.div_ceil(SPAN) * slots;
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let mut img = vec![0f32; rows * stride + 16];
    let base = (img.as_ptr() as usize).wrapping_neg() % 64 / 4;
    let (mut hi, mut lo) = ([0i16; GROUP], [0i16; GROUP]);
    for (dst, src) in img[base..]
        .chunks_exact_mut(stride.max(1))
        .zip(xs.chunks_exact(cols.max(1)))
    {
        for (blk, chunk) in src.chunks(GROUP).enumerate() {
            let (span, k) = (blk / 4, blk % 4);
            let sp = &mut dst[span * slots..(span + 1) * slots];
            #[cfg(target_arch = "x86_64")]
            if fused && let Ok(block) = <&[f32; GROUP]>::try_from(chunk) {
                let (scales, codes) = sp.split_at_mut(16);
                let codes: &mut [i16] = bytemuck::cast_slice_mut(codes);
                // SAFETY: `fused` is set only where AVX-512 F/BW/VL are present; the span
                // holds `levels` levels of 128 codes.
                let s = unsafe {
                    crate::x86::avx512::q16_image_block(block, &mut codes[..128 * levels], k)
                };
                scales[4 * k..4 * k + 4].fill(s / 512.0);
                continue;
            }
            hi.fill(0);
            let s = crate::matvec::q16_block(chunk, &mut hi[..chunk.len()]);
            sp[4 * k..4 * k + 4].fill(s / 512.0);
            let (_, codes) = sp.split_at_mut(16);
            let codes: &mut [i16] = bytemuck::cast_slice_mut(codes);
            scatter_block(&hi, &mut codes[..128], k);
            if levels == 2 {
                lo.fill(0);
                lo_block(chunk, &hi[..chunk.len()], s, &mut lo[..chunk.len()]);
                scatter_block(&lo, &mut codes[128..], k);
            }
        }
    }
    (Cow::Owned(img), base, stride)
}

/// The second-level codes of one block: `round_half_even((x − h·s) / (s/65536))` clamped to
/// ±32767 (the remainder as `x − (h·s)`, two roundings, no fused multiply-add), or all zero
/// when `s/65536` is not a normal number (a non-finite block, or a block so small that the
/// finer step would underflow). AVX-512 when present, bit-identical to [`lo_block_scalar`].
pub(crate) fn lo_block(chunk: &[f32], hi: &[i16], s: f32, lo: &mut [i16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::dispatch::Backend::Avx512.is_supported() {
        // SAFETY: AVX-512 F/BW/VL are present (checked above).
        return unsafe { crate::x86::avx512::q16_lo_block(chunk, hi, s, lo) };
    }
    lo_block_scalar(chunk, hi, s, lo)
}

/// The portable definition of [`lo_block`].
pub(crate) fn lo_block_scalar(chunk: &[f32], hi: &[i16], s: f32, lo: &mut [i16]) {
    let step = s * LO_STEP;
    if !step.is_normal() {
        lo.fill(0);
        return;
    }
    for ((o, &x), &h) in lo.iter_mut().zip(chunk).zip(hi) {
        let rest = x - h as f32 * s;
        *o = (rest / step).round_ties_even().clamp(-32767.0, 32767.0) as i16;
    }
}
