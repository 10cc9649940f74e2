//! The AVX-512 register-tiled entries of the kernel table: bf16 (F/BW/VL), row-int8 against
//! the q16 image and MXFP4 against the q8x3 image (both VNNI). Each implements
//! [`Tiles`] for [`crate::rows::rows_tiled`]; each tile is a function compiled with its
//! kernel's features, so the kernel inlines into it (see [`Tiles::tile`]).

use deltafin_tensor::mxfp4::GROUP;

use crate::prepared::Prepared;
use crate::rows::{
    BATCH_TILE, BF16_WIDE_TILE, MXFP4_WIDE_ROWS, Tiles, tall_tiles, tile_out, tile_xs, wide_tiles,
};
use crate::weights::Raw;

/// bf16 weights against the bf16-paired image: 2 × [`BF16_WIDE_TILE`] tiles in batches,
/// 4-row tiles on one activation row for narrow rows ([`tall_tiles`]).
pub(crate) struct Bf16Tiles;

impl Tiles for Bf16Tiles {
    #[inline(always)]
    unsafe fn tile<const NR: usize, const NB: usize>(p: &Prepared<'_>, r: usize, b: usize) {
        let Raw::Bf16(data, cols) = p.raw else {
            unreachable!("bf16 tiles on other weights")
        };
        // SAFETY: forwarded from the caller (AVX-512 checked by `Prepared::new`).
        unsafe { tile_bf16::<NR, NB>(p, data, cols, r, b) }
    }

    #[inline(always)]
    unsafe fn wide(p: &Prepared<'_>, rb: usize, re: usize) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { wide_tiles::<Self, 2, BF16_WIDE_TILE>(p, rb, re) }
    }

    #[inline(always)]
    unsafe fn one_row(p: &Prepared<'_>, r: usize, re: usize, b: usize) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { tall_tiles::<Self>(p, r, re, b) }
    }
}

/// Row-int8 weights against the q16 image: 4-row tiles on one activation row for narrow
/// rows ([`tall_tiles`]), else 2-row tiles.
pub(crate) struct RowInt8Q16Tiles;

impl Tiles for RowInt8Q16Tiles {
    #[inline(always)]
    unsafe fn tile<const NR: usize, const NB: usize>(p: &Prepared<'_>, r: usize, b: usize) {
        let Raw::RowInt8(data, scales, cols) = p.raw else {
            unreachable!("row-int8 tiles on other weights")
        };
        // SAFETY: forwarded from the caller (AVX-512 VNNI: the entry is in the VNNI table).
        unsafe { tile_i8::<NR, NB>(p, data, scales, cols, r, b) }
    }

    #[inline(always)]
    unsafe fn one_row(p: &Prepared<'_>, r: usize, re: usize, b: usize) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { tall_tiles::<Self>(p, r, re, b) }
    }
}

/// MXFP4 weights against the q8x3 image: [`MXFP4_WIDE_ROWS`] × 4 tiles in batches, the
/// two-row kernel on one activation row where the CPU has VBMI and rows hold a multiple of
/// 16 blocks ([`mxfp4_pairs`]).
pub(crate) struct Mxfp4Q8x3Tiles;

impl Tiles for Mxfp4Q8x3Tiles {
    #[inline(always)]
    unsafe fn tile<const NR: usize, const NB: usize>(p: &Prepared<'_>, r: usize, b: usize) {
        let Raw::Mxfp4(packed, scales, cols) = p.raw else {
            unreachable!("MXFP4 tiles on other weights")
        };
        // SAFETY: forwarded from the caller (AVX-512 VNNI: the entry is in the VNNI table).
        unsafe { tile_mxfp4::<NR, NB>(p, packed, scales, cols, r, b) }
    }

    #[inline(always)]
    unsafe fn wide(p: &Prepared<'_>, rb: usize, re: usize) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { wide_tiles::<Self, MXFP4_WIDE_ROWS, BATCH_TILE>(p, rb, re) }
    }

    #[inline(always)]
    unsafe fn one_row(p: &Prepared<'_>, r: usize, re: usize, b: usize) -> usize {
        let Raw::Mxfp4(packed, scales, cols) = p.raw else {
            unreachable!("MXFP4 tiles on other weights")
        };
        if (cols / GROUP).is_multiple_of(16) && crate::x86::avx512::vbmi_available() {
            // SAFETY: forwarded from the caller; the CPU has VBMI (checked above).
            unsafe { mxfp4_pairs(p, packed, scales, cols, r, re, b) }
        } else {
            r
        }
    }
}

/// [`Tiles::tile`] of bf16 weights.
///
/// # Safety
/// As [`Tiles::tile`]; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn tile_bf16<const NR: usize, const NB: usize>(
    p: &Prepared<'_>,
    data: &[deltafin_tensor::bf16],
    cols: usize,
    r: usize,
    b: usize,
) {
    let mut ws: [&[deltafin_tensor::bf16]; NR] = [&[]; NR];
    for (i, w) in ws.iter_mut().enumerate() {
        *w = &data[(r + i) * cols..(r + i + 1) * cols];
    }
    // SAFETY: rows of one matrix share a length and the paired image rows hold whole
    // groups; the rest as the caller guarantees.
    unsafe {
        let v = crate::tile::dot_bf16_tile::<NR, NB>(ws, tile_xs::<NB>(p, b));
        tile_out(p, v, r, b);
    }
}

/// [`Tiles::tile`] of row-int8 weights (q16 image).
///
/// # Safety
/// As [`Tiles::tile`]; AVX-512 VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn tile_i8<const NR: usize, const NB: usize>(
    p: &Prepared<'_>,
    data: &[i8],
    scales: &[half::f16],
    cols: usize,
    r: usize,
    b: usize,
) {
    let mut ws: [&[i8]; NR] = [&[]; NR];
    let mut ss = [0u16; NR];
    for i in 0..NR {
        ws[i] = &data[(r + i) * cols..(r + i + 1) * cols];
        ss[i] = scales[r + i].to_bits();
    }
    // SAFETY: the image is the q16 one; the rest as the caller guarantees.
    unsafe {
        let v = crate::tile::dot_i8_q16_tile::<NR, NB>(ws, ss, tile_xs::<NB>(p, b));
        tile_out(p, v, r, b);
    }
}

/// [`Tiles::tile`] of MXFP4 weights (q8x3 image).
///
/// # Safety
/// As [`Tiles::tile`]; AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn tile_mxfp4<const NR: usize, const NB: usize>(
    p: &Prepared<'_>,
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    r: usize,
    b: usize,
) {
    let (pb, g) = (cols / 2, cols / GROUP);
    let (packed, scales) = (&packed[r * pb..(r + NR) * pb], &scales[r * g..(r + NR) * g]);
    let mut ps: [&[u8]; NR] = [&[]; NR];
    let mut ss: [&[u8]; NR] = [&[]; NR];
    for i in 0..NR {
        ps[i] = &packed[i * pb..(i + 1) * pb];
        ss[i] = &scales[i * g..(i + 1) * g];
    }
    // SAFETY: the image is the q8x3 one; the rest as the caller guarantees.
    unsafe {
        let v = crate::x86::avx512_q8x3::dot_mxfp4_q8x3_tile::<NR, NB>(ps, ss, tile_xs::<NB>(p, b));
        tile_out(p, v, r, b);
    }
}

/// Rows `r..` up to `re` of MXFP4 weights against activation row `b` in pairs, with the
/// two-row `q8x3` kernel ([`crate::x86::avx512_q8x3::dot_mxfp4_q8x3_pair_vbmi`]) inlined into
/// this loop (a call per pair through [`Tiles::tile`] took a tenth of the samples but
/// overlapped with the kernel: the same throughput either way, measured). Returns the first
/// row not done (`re`, or `re − 1` when an odd number of rows was left).
///
/// # Safety
/// As [`Tiles::tile`]; the image is the q8x3 one, the CPU has AVX-512 VNNI and VBMI, rows
/// hold a multiple of 16 blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma")]
unsafe fn mxfp4_pairs(
    p: &Prepared<'_>,
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    mut r: usize,
    re: usize,
    b: usize,
) -> usize {
    let (pb, g) = (cols / 2, cols / GROUP);
    let x = p.x(b);
    assert!(
        packed.len() >= re * pb
            && scales.len() >= re * g
            && x.len() >= g / 4 * crate::mxfp4_q8x3::SPAN_SLOTS
    );
    while r + 2 <= re {
        // SAFETY: rows r and r + 1 < re lie in the matrix (checked above), `g` is a
        // multiple of 16 and the image row holds `g / 4` spans; the CPU features as the
        // caller guarantees.
        unsafe {
            let v = crate::x86::avx512_q8x3::dot_mxfp4_q8x3_pair_vbmi(
                packed.as_ptr().add(r * pb),
                packed.as_ptr().add((r + 1) * pb),
                scales.as_ptr().add(r * g),
                scales.as_ptr().add((r + 1) * g),
                g,
                x.as_ptr(),
            );
            p.apply(b, r, v[0]);
            p.apply(b, r + 1, v[1]);
        }
        r += 2;
    }
    r
}
