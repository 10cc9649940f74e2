//! MXFP4 products against activations quantised to three int8 levels (AVX-512 VNNI,
//! `vpdpbusd`): about f32's own precision at the instruction cost of a little more than
//! llama.cpp's one-level MXFP4 × Q8_0 product.
//!
//! Each activation row is quantised once per product call, per 32-column block (the MXFP4
//! block), by [`q8x3_block`] with `d = absmax/127` and the fine step `t = d/65536`:
//!
//! ```text
//! T = round_half_even(x / t)          (one f32 division; |T| ≤ 127·65536, clamped there + 127)
//! T = 65536·q1 + 256·q2 + q3          q2, q3 ∈ −128…127 (balanced base-256 digits: q3 is the
//!                                     low byte of T as a signed byte, and so on), q1 ∈ −127…127
//! ```
//!
//! so a column is represented as `t·T = d·(q1 + q2/256 + q3/65536)` with an error of at most
//! `t/2` plus the rounding of the quotient (`|x/t| < 2^23`, so at most a quarter step): below
//! `t = absmax/(127·2^16) ≈ absmax·2^−23`, about f32's own precision, as the two int16 levels
//! of two int16 levels would give. An all-zero block has `d = 0` and codes 0; a block
//! holding a non-finite value has `d = NaN` (the product is NaN, as in f32); when `t` is not a
//! normal number (a block so small that the fine step would underflow) `T = 65536·q1` with
//! `q1 = round_half_even(x/d)` clamped to ±127.
//!
//! The weight code `w_c` (E2M1) is looked up as the unsigned byte `u_c = 2·E2M1(w_c) + 12`
//! (0…24). `vpdpbusd` sums four byte products per dword lane exactly, and the three digits
//! are folded in the integer domain — two `vpdpbusd` per digit, the first digit's lane sum
//! shifted left by 16 bits, the second's by 8, the correction taken as the third's starting
//! value — so per 8-column lane
//!
//! ```text
//! S = 65536·Σ u·q1 + 256·Σ u·q2 + (Σ u·q3 − C),     C = 12·Σ T
//!   = Σ 2·E2M1(w_c)·T_c                                   (exact: |S| < 2^31 throughout)
//! y = Σ_lanes f32(S) · (d·2^−17) · 2^(e−127)               (one multiply, one FMA per lane)
//! ```
//!
//! The correction `C` depends on the activations only and is part of the image. Per span
//! and weight row that is six `vpdpbusd` (in three independent pairs), two shifts, two
//! additions, one conversion, one multiply and one FMA, where two int16 levels at the same
//! precision take eight `vpdpwssd` and twice the f32 work (1.1–1.25× slower products,
//! docs/PERFORMANCE.md). It is the default MXFP4 activation format on AVX-512 VNNI (the kernel
//! setting `mxfp4_act`).
//!
//! A single int8 digit (llama.cpp's MXFP4 × Q8_0 scheme, `d = absmax/127`, error up to
//! `absmax/254` per column) fails the forward-pass fidelity tests (docs/NUMERICS.md); the two
//! further digits are what make this format as precise as f32.

// The q8x3 kernels are AVX-512 VNNI only.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::borrow::Cow;

use deltafin_tensor::mxfp4::{E2M1, GROUP};

/// Columns of one span: four MXFP4 blocks, one 64-byte load of weight codes.
pub(crate) const SPAN: usize = 128;

/// f32 slots of one span of the image: 16 lane scales, 16 int32 corrections, then per digit
/// 64 even-column codes and 64 odd-column codes (32 slots).
pub(crate) const SPAN_SLOTS: usize = 32 + 3 * 32;

/// `2·E2M1(code) + 12` for codes 0…15: the unsigned weight bytes of the product.
pub(crate) const E2M1_X2_PLUS_12: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (2.0 * E2M1[i] + 12.0) as u8;
        i += 1;
    }
    t
};

/// The weight-byte offset removed by the correction term.
pub(crate) const OFFSET: i32 = 12;

/// The fine step relative to `d` (exact power of two).
pub(crate) const STEP: f32 = 1.0 / 65536.0;
/// The lane scale relative to `d`: `S` counts `2·E2M1` units of `t = d/65536`, so a lane is
/// worth `f32(S)·t/2`.
pub(crate) const LANE_SCALE: f32 = 1.0 / 131072.0;
/// The largest `|T|`: `127·65536 + 127` keeps `q1` within ±127 (`|x/t|` cannot exceed
/// `127·65536` by more than a rounding, so the clamp only guards the digit ranges).
pub(crate) const T_MAX: i32 = 127 * 65536 + 127;

/// One block of up to 32 values → `(d, T)`, codes zero-padded to 32 (see the module docs
/// for the rule).
pub(crate) fn q8x3_block(block: &[f32]) -> (f32, [i32; GROUP]) {
    let mut q = [0i32; GROUP];
    let d = int8_step(block);
    if d.is_nan() || d == 0.0 {
        return (d, q);
    }
    let t = d * STEP;
    for (o, &x) in q.iter_mut().zip(block) {
        *o = if t.is_normal() {
            let m = T_MAX as f32;
            (x / t).round_ties_even().clamp(-m, m) as i32
        } else {
            65536 * (x / d).round_ties_even().clamp(-127.0, 127.0) as i32
        };
    }
    (d, q)
}

/// The int8 step of one block: `absmax/127`, 0 for an all-zero block, NaN when the block
/// holds a non-finite value.
pub(crate) fn int8_step(block: &[f32]) -> f32 {
    if !block.iter().all(|v| v.is_finite()) {
        return f32::NAN;
    }
    block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0
}

/// The digits `[q1, q2, q3]` of `T = 65536·q1 + 256·q2 + q3` (`q2`, `q3` in −128…127).
pub(crate) fn digits(t: i32) -> [i8; 3] {
    let q3 = t as i8;
    let t1 = (t - q3 as i32) >> 8;
    let q2 = t1 as i8;
    [((t1 - q2 as i32) >> 8) as i8, q2, q3]
}

/// The q8x3 image of activation rows of `cols` values: per row, `ceil(cols / 128)` spans of
/// [`SPAN_SLOTS`] f32 slots each. Span `s` covers columns `128s + 8i + t` (lane `i` = 0…15,
/// `t` = 0…7; lane `i` lies in block `4s + i/4`):
/// - slots 0..16: lane `i`'s `d·2^−17` of its block (0 for padding);
/// - slots 16..32: lane `i`'s correction `12·Σ T` over its 8 columns, as int32;
/// - per digit `v` (`q1`, `q2`, `q3`), slots `32 + 32v ..`: 64 int8 codes of the even columns
///   (byte `m` = column `2m`), then 64 of the odd columns (byte `m` = column `2m + 1`).
///
/// Byte `m` of a span's 64 weight bytes holds columns `2m` (low nibble) and `2m + 1` (high
/// nibble), so the low/high nibble vectors meet the even/odd code vectors byte for byte and
/// dword lane `i` of both covers columns `8i..8i+8`. Columns past `cols` are zero.
///
/// Returns the image, the offset of its first row (a 64-byte boundary, so no code load
/// splits a cache line) and the row stride. Whole blocks go through `fused(block, span, k)`
/// (the AVX-512 quantiser, bit-identical to [`q8x3_block`] + [`write_block`]) when given, the
/// ragged last block and every block without it through [`q8x3_block`].
pub(crate) fn q8x3_image<F>(
    xs: &[f32],
    cols: usize,
    fused: Option<F>,
) -> (Cow<'static, [f32]>, usize, usize)
where
    F: Fn(&[f32; GROUP], &mut [f32], usize),
{
    let stride = cols.div_ceil(SPAN) * SPAN_SLOTS;
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let mut img = vec![0f32; rows * stride + 16];
    let base = (img.as_ptr() as usize).wrapping_neg() % 64 / 4;
    for (dst, src) in img[base..]
        .chunks_exact_mut(stride.max(1))
        .zip(xs.chunks_exact(cols.max(1)))
    {
        for (blk, chunk) in src.chunks(GROUP).enumerate() {
            let (span, k) = (blk / 4, blk % 4);
            let sp = &mut dst[span * SPAN_SLOTS..(span + 1) * SPAN_SLOTS];
            if let (Some(f), Ok(block)) = (&fused, <&[f32; GROUP]>::try_from(chunk)) {
                f(block, sp, k);
                continue;
            }
            let (d, q) = q8x3_block(chunk);
            write_block(sp, k, d, &q);
        }
    }
    (Cow::Owned(img), base, stride)
}

/// [`q8x3_image`] with the portable quantiser only.
#[cfg(test)]
pub(crate) fn q8x3_image_portable(xs: &[f32], cols: usize) -> (Cow<'static, [f32]>, usize, usize) {
    q8x3_image(xs, cols, None::<fn(&[f32; GROUP], &mut [f32], usize)>)
}

/// Block `k` of a span (its scales, corrections and codes) from `(d, T)`.
pub(crate) fn write_block(sp: &mut [f32], k: usize, d: f32, q: &[i32; GROUP]) {
    let (scales, rest) = sp.split_at_mut(16);
    let (corr, codes) = rest.split_at_mut(16);
    scales[4 * k..4 * k + 4].fill(d * LANE_SCALE);
    let corr: &mut [i32] = bytemuck::cast_slice_mut(corr);
    for l in 0..4 {
        corr[4 * k + l] = OFFSET * q[8 * l..8 * l + 8].iter().sum::<i32>();
    }
    let codes: &mut [i8] = bytemuck::cast_slice_mut(codes);
    for (c, &t) in q.iter().enumerate() {
        for (lv, digit) in digits(t).into_iter().enumerate() {
            codes[128 * lv + 64 * (c % 2) + 16 * k + c / 2] = digit;
        }
    }
}
