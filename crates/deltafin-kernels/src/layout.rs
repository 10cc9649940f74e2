//! Activation layouts shared by several kernels: the bf16-paired rows, the f32 layouts of the
//! SIMD MXFP4 kernels and the row-int8 q16 image. Each builder runs once per product on the
//! calling thread, before the rows are spread over the pool.

// The q16 and bf16-paired layouts serve the x86 kernels only.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::borrow::Cow;

use deltafin_tensor::mxfp4::GROUP;

/// Activations in a kernel's layout: the image, the offset of its first row, the row stride.
pub(crate) type Image<'a> = (Cow<'a, [f32]>, usize, usize);

/// The f32 activation layout of the SIMD MXFP4 kernels: the first `spans` 128-column spans
/// transposed (`xt[16j + i] = x[8i + j]`, AVX-512), every remaining 32-column block paired
/// (`[even columns, odd columns]`).
pub(crate) fn mxfp4_f32_image(xs: &[f32], cols: usize, spans: usize) -> Cow<'static, [f32]> {
    let mut p = vec![0f32; xs.len()];
    for (dst, src) in p.chunks_exact_mut(cols).zip(xs.chunks_exact(cols)) {
        for s in 0..spans {
            for i in 0..16 {
                for j in 0..8 {
                    dst[128 * s + 16 * j + i] = src[128 * s + 8 * i + j];
                }
            }
        }
        let tail = 128 * spans;
        for (d, x) in dst[tail..]
            .chunks_exact_mut(GROUP)
            .zip(src[tail..].chunks_exact(GROUP))
        {
            for j in 0..GROUP / 2 {
                d[j] = x[2 * j];
                d[GROUP / 2 + j] = x[2 * j + 1];
            }
        }
    }
    Cow::Owned(p)
}

/// Columns per activation scale in the q16 image of row-int8 products.
pub(crate) const Q16_BLOCK: usize = 256;

/// The q16 image of activation rows for the row-int8 q16 kernels (AVX-512 VNNI, AVX2): per
/// row, `ceil(cols / Q16_BLOCK)` f32 scales (`absmax / 32767`; 1 for an all-zero block; NaN
/// when the block holds a non-finite value, so the product is NaN as in f32), then the int16
/// codes `round_half_even(x / scale)`, two per f32 slot, zero-padded to whole 32-column steps.
/// `block` quantises one block: [`q16_block_scalar`] or a SIMD version equal to it bit for bit.
/// Returns the image, the offset of its first row (0) and the row stride.
pub(crate) fn q16_image(
    xs: &[f32],
    cols: usize,
    block: impl Fn(&[f32], &mut [i16]) -> f32,
) -> Image<'static> {
    let nblk = cols.div_ceil(Q16_BLOCK);
    let padded = cols.next_multiple_of(32);
    let stride = nblk + padded / 2;
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let mut img = vec![0f32; rows * stride];
    for (dst, src) in img
        .chunks_exact_mut(stride)
        .zip(xs.chunks_exact(cols.max(1)))
    {
        let (scales, codes) = dst.split_at_mut(nblk);
        let codes: &mut [i16] = bytemuck::cast_slice_mut(codes);
        for (blk, chunk) in src.chunks(Q16_BLOCK).enumerate() {
            let dst = &mut codes[blk * Q16_BLOCK..blk * Q16_BLOCK + chunk.len()];
            scales[blk] = block(chunk, dst);
        }
    }
    (Cow::Owned(img), 0, stride)
}

/// One q16 block: returns its scale (`absmax / 32767`; 1 when all zero; NaN when a value
/// is not finite, leaving `codes` zero) and writes `round_half_even(x / scale)` clamped to
/// ±32767 into `codes` (as long as `chunk`). The portable definition, which the SIMD
/// versions equal bit for bit.
pub(crate) fn q16_block_scalar(chunk: &[f32], codes: &mut [i16]) -> f32 {
    let finite = chunk.iter().all(|v| v.is_finite());
    let absmax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if !finite {
        f32::NAN
    } else if absmax == 0.0 {
        1.0
    } else {
        absmax / 32767.0
    };
    if finite {
        for (o, &v) in codes.iter_mut().zip(chunk) {
            *o = (v / scale).round_ties_even().clamp(-32767.0, 32767.0) as i16;
        }
    }
    scale
}

/// Rows of `cols` values rearranged in groups of `g` columns as `[even, odd]`, the last
/// group zero-padded; each output row is `cols` rounded up to a multiple of `g`. The rows
/// start at the returned offset, the first 64-byte boundary of the buffer (with `g` a
/// multiple of 16, every row then starts on one).
pub(crate) fn pair_groups(xs: &[f32], cols: usize, g: usize) -> (Cow<'static, [f32]>, usize) {
    match g {
        32 => pair_groups_of::<32>(xs, cols),
        16 => pair_groups_of::<16>(xs, cols),
        _ => unreachable!("bf16 pairing groups are 16 or 32 columns"),
    }
}

/// [`pair_groups`] for groups of `G` columns: whole groups as fixed-size de-interleaves
/// (vectorised by the compiler; this runs on the calling thread before a product's rows are
/// spread over the pool), the last partial group element by element.
fn pair_groups_of<const G: usize>(xs: &[f32], cols: usize) -> (Cow<'static, [f32]>, usize) {
    let stride = cols.next_multiple_of(G);
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let mut p = vec![0f32; rows * stride + ALIGN_F32];
    let base = (p.as_ptr() as usize).wrapping_neg() % (4 * ALIGN_F32) / 4;
    let whole = cols / G * G;
    for (dst, src) in p[base..]
        .chunks_exact_mut(stride)
        .zip(xs.chunks_exact(cols.max(1)))
    {
        for (d, s) in dst[..whole]
            .chunks_exact_mut(G)
            .zip(src[..whole].chunks_exact(G))
        {
            let (even, odd) = d.split_at_mut(G / 2);
            for i in 0..G / 2 {
                even[i] = s[2 * i];
                odd[i] = s[2 * i + 1];
            }
        }
        for (i, &v) in src[whole..].iter().enumerate() {
            dst[whole + (i % 2) * (G / 2) + i / 2] = v;
        }
    }
    (Cow::Owned(p), base)
}

/// f32 values per 64-byte cache line.
const ALIGN_F32: usize = 16;
