//! Matrix-vector (`y = W·x`) and small-batch products (`Y = X·Wᵀ`, one output row per input
//! row) over f32, bf16, row-int8 and MXFP4 weights, f32 activations, f32 accumulation.
//!
//! Determinism: every output value `y[b][r]` is one call of a row dot product for weight row
//! `r` and activation row `b`, computed by one thread with a fixed lane layout and a fixed
//! final reduction. Neither the thread count nor the batch width (activation rows are
//! processed in tiles of four against one weight row, the remainder one at a time, with the
//! same per-row arithmetic) changes the result: it is bit-identical within one backend.
//! Different backends (scalar, AVX2, AVX-512, NEON) use different lane layouts and may differ
//! in the last bits.
//!
//! Threads: output rows are split into contiguous ranges (about four per worker) on the
//! current rayon pool — the persistent global pool unless the caller `install`s another —
//! so no thread is spawned per call; small products run on the calling thread.

use std::borrow::Cow;

use deltafin_tensor::mxfp4::GROUP;
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix};
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dispatch::{Backend, backend};
use crate::mxfp4_q8::{Mxfp4Act, avx512_mxfp4_act, q8_image};
use crate::scalar;

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;
/// Activation rows processed together against one weight row (the row is read once per tile).
const BATCH_TILE: usize = 4;
/// Activation rows of the bf16 register tiles on AVX-512 (2 weight rows × 6 activation rows:
/// 24 accumulators; the ragged rest of a batch takes the 2 × 1…4 tiles). Against 2 × 4 the
/// weight widening (a shift and a mask per weight row and 32-column group) and the final
/// reductions are shared by half as many more products: ≈ 8% less time per value on the
/// mini prefill shape (512 × 1024, n = 64). Every value is the same either way.
#[cfg(target_arch = "x86_64")]
const BF16_WIDE_TILE: usize = 6;
/// Weight rows of the MXFP4 (q16) register tiles on AVX-512 in batches: 3 weight rows × 4
/// activation rows (the ragged rest of a batch takes the 2-row tiles). Each activation load
/// and scale conversion then serves three weight rows instead of two: ≈ 7% less time per
/// value on 1024-column experts (n = 80), ≈ 3% on 512 columns. Every value is the same
/// either way.
#[cfg(target_arch = "x86_64")]
const MXFP4_WIDE_ROWS: usize = 3;
/// Row-int8 and bf16 matrix-vector products (one activation row) with rows of at most this
/// many columns take 4-row register tiles instead of 2-row ones: the per-tile work (row
/// slices, the final reductions, the row scales, the epilogue) is shared by twice the bytes,
/// and the whole-tile prefetch distance grows with the tile (row-int8 4 KiB, bf16 8 KiB).
/// Row-int8 from DRAM, 1024 columns, 2 threads (`kernel-point row-int8 --cols 1024 --bytes 2M
/// --count 256`, alternated, session 7): 20.8–21.5 → 22.6–24.1 GB/s; `mini` decode, A B B A:
/// int8 spine 1.06 ×, bf16 spine 1.04–1.05 ×. Wider rows keep 2-row tiles (7168 columns: 4-row
/// int8 tiles put the prefetch 28 KiB ahead and measured 19.5 against 23.5 GB/s). Every value
/// is the same either way (each output row has its own accumulators).
#[cfg(target_arch = "x86_64")]
const TALL_TILE_MAX_COLS: usize = 1024;
/// Weight bytes of one row block in batched products (kept in L2 while every activation tile
/// passes over it).
const ROW_BLOCK_BYTES: usize = 96 * 1024;

/// A weight matrix of any supported format, `[rows, cols]`, used as `y = W·x`.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// Row-major f32 values (`data.len() == rows * cols`).
    F32 {
        data: &'a [f32],
        rows: usize,
        cols: usize,
    },
    /// Row-major bf16.
    Bf16(&'a Bf16Matrix),
    /// Row-major int8 codes with one f16 scale per row.
    RowInt8(&'a RowInt8Matrix),
    /// MXFP4 (E2M1 codes, one E8M0 scale per 32 columns).
    Mxfp4(&'a Mxfp4Matrix),
}

impl Weights<'_> {
    /// Output rows.
    pub fn rows(&self) -> usize {
        match self {
            Weights::F32 { rows, .. } => *rows,
            Weights::Bf16(m) => m.rows(),
            Weights::RowInt8(m) => m.rows(),
            Weights::Mxfp4(m) => m.rows(),
        }
    }
    /// Input columns.
    pub fn cols(&self) -> usize {
        match self {
            Weights::F32 { cols, .. } => *cols,
            Weights::Bf16(m) => m.cols(),
            Weights::RowInt8(m) => m.cols(),
            Weights::Mxfp4(m) => m.cols(),
        }
    }
    /// Bytes of weight data one full product reads (codes and scales).
    pub fn weight_bytes(&self) -> usize {
        let (r, c) = (self.rows(), self.cols());
        match self {
            Weights::F32 { .. } => r * c * 4,
            Weights::Bf16(_) => r * c * 2,
            Weights::RowInt8(_) => r * c + r * 2,
            Weights::Mxfp4(_) => r * c / 2 + r * c / GROUP,
        }
    }
    /// Format name for logs and benches.
    pub fn dtype(&self) -> &'static str {
        match self {
            Weights::F32 { .. } => "f32",
            Weights::Bf16(_) => "bf16",
            Weights::RowInt8(_) => "row-int8",
            Weights::Mxfp4(_) => "mxfp4",
        }
    }
}

/// What is done with each product value `v = (W·x_b)[r]`.
#[derive(Clone, Copy)]
enum Epilogue<'a> {
    /// `y[b][r] = v`.
    Store,
    /// `y[b][r] += alpha[b] · v` (e.g. a routing-weighted expert output added to the sum).
    Axpy(&'a [f32]),
}

/// Call the row dot product of the selected backend.
macro_rules! dispatch {
    ($be:expr, $f:ident($($a:expr),*)) => {
        match $be {
            // SAFETY: `product` checked that the backend is supported by this CPU.
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => unsafe { crate::x86::avx512::$f($($a),*) },
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => unsafe { crate::x86::avx2::$f($($a),*) },
            #[cfg(target_arch = "aarch64")]
            Backend::Neon => unsafe { crate::neon::$f($($a),*) },
            _ => scalar::$f($($a),*),
        }
    };
}

/// A weight matrix's raw slices, fetched once per row range: the per-row accessors of the
/// tensor types go through the byte owner (a dynamic call) and are not inlined across
/// crates, which cost ≈ 9% of whole-model decode on 1024-column matrices.
#[derive(Clone, Copy)]
enum Raw<'a> {
    F32(&'a [f32], usize),
    Bf16(&'a [deltafin_tensor::bf16], usize),
    /// Codes, f16 scales, columns.
    RowInt8(&'a [i8], &'a [half::f16], usize),
    /// Packed codes, E8M0 scales, columns.
    Mxfp4(&'a [u8], &'a [u8], usize),
}

impl<'a> Raw<'a> {
    fn of(w: Weights<'a>) -> Raw<'a> {
        match w {
            Weights::F32 { data, cols, .. } => Raw::F32(data, cols),
            Weights::Bf16(m) => Raw::Bf16(m.data(), m.cols()),
            Weights::RowInt8(m) => Raw::RowInt8(m.data(), m.scales(), m.cols()),
            Weights::Mxfp4(m) => Raw::Mxfp4(m.packed(), m.scales(), m.cols()),
        }
    }

    /// Dot products of weight row `r` with `NB` prepared activation rows: the same kernel
    /// call on the same row slices as the matrices' own accessors give.
    #[inline(always)]
    fn dot<const NB: usize>(self, be: Backend, r: usize, xs: [&[f32]; NB]) -> [f32; NB] {
        match self {
            Raw::F32(data, cols) => dispatch!(be, dot_f32(&data[r * cols..(r + 1) * cols], xs)),
            Raw::Bf16(data, cols) => dispatch!(be, dot_bf16(&data[r * cols..(r + 1) * cols], xs)),
            Raw::RowInt8(data, scales, cols) => {
                let row = &data[r * cols..(r + 1) * cols];
                #[cfg(target_arch = "x86_64")]
                if be == Backend::Avx512 && q16_int8() {
                    // SAFETY: `product` checked AVX-512; `q16_int8` checked VNNI. The kernel
                    // applies the row scale itself.
                    return unsafe { crate::x86::avx512::dot_i8_q16(row, scales[r].to_bits(), xs) };
                }
                let s = scales[r].to_f32();
                #[cfg(target_arch = "x86_64")]
                if be == Backend::Avx2 {
                    // SAFETY: `product` checked AVX2; the activations are the q16 image.
                    return unsafe { crate::x86::avx2::dot_i8_q16(row, xs) }.map(|v| s * v);
                }
                dispatch!(be, dot_i8(row, xs)).map(|v| s * v)
            }
            Raw::Mxfp4(packed, scales, cols) => {
                let (pb, g) = (cols / 2, cols / GROUP);
                #[cfg(target_arch = "x86_64")]
                if be == Backend::Avx512 && avx512_mxfp4_act() == Mxfp4Act::Q8 {
                    // SAFETY: `product` checked AVX-512; `avx512_mxfp4_act` checked VNNI.
                    return unsafe {
                        crate::x86::avx512::dot_mxfp4_q8(
                            &packed[r * pb..(r + 1) * pb],
                            &scales[r * g..(r + 1) * g],
                            xs,
                        )
                    };
                }
                #[cfg(target_arch = "x86_64")]
                if be == Backend::Avx512 && mxfp4_int_tiles() {
                    let (p, s) = (&packed[r * pb..(r + 1) * pb], &scales[r * g..(r + 1) * g]);
                    // SAFETY: `product` checked AVX-512; `mxfp4_int_tiles` checked VNNI and
                    // `prepare` built the image of this process's activation format.
                    return unsafe { mxfp4_int_tile::<1, NB>([p], [s], xs) }[0];
                }
                dispatch!(
                    be,
                    dot_mxfp4(
                        &packed[r * pb..(r + 1) * pb],
                        &scales[r * g..(r + 1) * g],
                        xs
                    )
                )
            }
        }
    }
}

impl Weights<'_> {
    /// Which activation image [`Weights::prepare`] builds for `be` (0: none, the input as
    /// it is). Two products with the same kind and the same number of columns read the same
    /// image of the same input, so a group builds it once.
    fn image_kind(&self, be: Backend) -> u8 {
        match (self, be) {
            (Weights::RowInt8(_), Backend::Avx512) if q16_int8() => 1,
            (Weights::RowInt8(_), Backend::Avx2) => 1,
            (Weights::Bf16(_), Backend::Avx512) => 2,
            (Weights::Bf16(_), Backend::Avx2) => 3,
            (Weights::Mxfp4(_), Backend::Avx512) if avx512_mxfp4_act() == Mxfp4Act::Q8 => 4,
            (Weights::Mxfp4(_), Backend::Avx512) if mxfp4_q16_levels().is_some() => 5,
            (Weights::Mxfp4(_), Backend::Avx512) if avx512_mxfp4_act() == Mxfp4Act::Q8x3 => 8,
            (Weights::Mxfp4(_), Backend::Avx512) => 6,
            (Weights::Mxfp4(_), Backend::Avx2 | Backend::Neon) => 7,
            _ => 0,
        }
    }

    /// The activation layout the backend's kernel expects (see `x86.rs`), and its row
    /// stride: the AVX2 and NEON MXFP4 kernels take each 32-column block as `[even columns,
    /// odd columns]` (paired); the AVX-512 one takes each full 128-column span transposed
    /// (`xt[16j + i] = x[8i + j]`) and the remaining blocks paired — or, with int8
    /// activations (AVX-512 VNNI, opt-in `DELTAFIN_MXFP4_ACT=q8`), the q8 image
    /// of [`crate::mxfp4_q8`]. The x86 bf16 kernels take
    /// the bf16-paired layout: groups of 32 (AVX-512) or 16 (AVX2) columns as `[even, odd]`,
    /// the last group zero-padded (the stride is `cols` rounded up to a whole group).
    /// Everything else is unchanged. Returns the image, the offset of its first row (the
    /// bf16-paired images start on a 64-byte boundary, so no activation load splits a cache
    /// line) and the row stride.
    fn prepare<'x>(&self, be: Backend, xs: &'x [f32]) -> (Cow<'x, [f32]>, usize, usize) {
        let cols = self.cols();
        match (self, be) {
            (Weights::RowInt8(_), Backend::Avx512) if q16_int8() => {
                let (img, stride) = q16_image(xs, cols);
                (img, 0, stride)
            }
            (Weights::RowInt8(_), Backend::Avx2) => {
                let (img, stride) = q16_image(xs, cols);
                (img, 0, stride)
            }
            (Weights::Bf16(_), Backend::Avx512) => {
                let (img, base) = pair_groups(xs, cols, 32);
                (img, base, cols.next_multiple_of(32))
            }
            (Weights::Bf16(_), Backend::Avx2) => {
                let (img, base) = pair_groups(xs, cols, 16);
                (img, base, cols.next_multiple_of(16))
            }
            (Weights::Mxfp4(_), Backend::Avx512) if avx512_mxfp4_act() == Mxfp4Act::Q8 => {
                let (img, stride) = q8_image(xs, cols);
                (img, 0, stride)
            }
            (Weights::Mxfp4(_), Backend::Avx512) if mxfp4_q16_levels().is_some() => {
                let levels = mxfp4_q16_levels().unwrap_or(1);
                crate::mxfp4_q16::q16_image(xs, cols, levels)
            }
            (Weights::Mxfp4(_), Backend::Avx512) if avx512_mxfp4_act() == Mxfp4Act::Q8x3 => {
                crate::mxfp4_q8x3::q8x3_image(xs, cols)
            }
            (Weights::Mxfp4(_), Backend::Avx512 | Backend::Avx2 | Backend::Neon) => {
                let spans = if be == Backend::Avx512 { cols / 128 } else { 0 };
                (mxfp4_f32_image(xs, cols, spans), 0, cols)
            }
            _ => (Cow::Borrowed(xs), 0, cols),
        }
    }
}

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

/// Code levels of the q16 image of AVX-512 MXFP4 products in this process (`q16`: 1,
/// `q16x2`: 2), or `None` when they take f32 or q8 activations.
#[inline]
fn mxfp4_q16_levels() -> Option<usize> {
    match avx512_mxfp4_act() {
        Mxfp4Act::Q16 => Some(1),
        Mxfp4Act::Q16x2 => Some(2),
        Mxfp4Act::F32 | Mxfp4Act::Q8 | Mxfp4Act::Q8x3 => None,
    }
}

/// Whether AVX-512 MXFP4 products in this process run in the integer register tiles
/// (`q16`, `q16x2`, `q8x3`).
#[cfg(target_arch = "x86_64")]
#[inline]
fn mxfp4_int_tiles() -> bool {
    matches!(
        avx512_mxfp4_act(),
        Mxfp4Act::Q16 | Mxfp4Act::Q16x2 | Mxfp4Act::Q8x3
    )
}

/// Whether the two-row `q8x3` kernel ([`crate::x86::avx512::dot_mxfp4_q8x3_pair_vbmi`])
/// serves this process's one-activation-row MXFP4 tiles: the format is `q8x3` and the CPU
/// has AVX-512 VBMI.
#[cfg(target_arch = "x86_64")]
fn q8x3_pair() -> bool {
    avx512_mxfp4_act() == Mxfp4Act::Q8x3 && crate::x86::avx512::vbmi_available()
}

/// The integer MXFP4 tile kernel of this process's activation format (`q8x3`, or q16 with
/// its level count).
///
/// # Safety
/// As [`crate::x86::avx512::dot_mxfp4_q16_tile`] / [`crate::x86::avx512::dot_mxfp4_q8x3_tile`];
/// the images must have been built for this process's format.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn mxfp4_int_tile<const NR: usize, const NB: usize>(
    packed: [&[u8]; NR],
    scales: [&[u8]; NR],
    xs: [&[f32]; NB],
) -> [[f32; NB]; NR] {
    // SAFETY: forwarded from the caller.
    unsafe {
        if avx512_mxfp4_act() == Mxfp4Act::Q8x3 {
            crate::x86::avx512::dot_mxfp4_q8x3_tile::<NR, NB>(packed, scales, xs)
        } else if mxfp4_q16_levels() == Some(2) {
            crate::x86::avx512::dot_mxfp4_q16_tile::<2, NR, NB>(packed, scales, xs)
        } else {
            crate::x86::avx512::dot_mxfp4_q16_tile::<1, NR, NB>(packed, scales, xs)
        }
    }
}

/// Columns per activation scale in the q16 image of row-int8 products.
pub(crate) const Q16_BLOCK: usize = 256;

/// Whether AVX-512 row-int8 products use int16-quantised activations (`vpdpwssd`, AVX-512
/// VNNI). Activation error ≤ half a step of `absmax(block)/32767` per value: about 1.5e-5 of
/// the block's largest value, far below the int8 weights' own error.
#[inline]
fn q16_int8() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The q16 image of activation rows for [`crate::x86::avx512::dot_i8_q16`]: per row,
/// `ceil(cols / Q16_BLOCK)` f32 scales (`absmax / 32767`; 1 for an all-zero block; NaN when
/// the block holds a non-finite value, so the product is NaN as in f32), then the int16
/// codes `round_half_even(x / scale)`, two per f32 slot, zero-padded to whole 32-column steps.
fn q16_image(xs: &[f32], cols: usize) -> (Cow<'static, [f32]>, usize) {
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
            scales[blk] = q16_block(chunk, dst);
        }
    }
    (Cow::Owned(img), stride)
}

/// One q16 block: returns its scale (`absmax / 32767`; 1 when all zero; NaN when a value
/// is not finite, leaving `codes` zero) and writes `round_half_even(x / scale)` clamped to
/// ±32767 into `codes` (as long as `chunk`).
pub(crate) fn q16_block(chunk: &[f32], codes: &mut [i16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::dispatch::Backend::Avx512.is_supported() {
            // SAFETY: AVX-512 F/BW/VL are present (checked above).
            return unsafe { crate::x86::avx512::q16_block(chunk, codes) };
        }
        if crate::dispatch::Backend::Avx2.is_supported() {
            // SAFETY: AVX2 and FMA are present (checked above).
            return unsafe { crate::x86::avx2::q16_block(chunk, codes) };
        }
    }
    q16_block_scalar(chunk, codes)
}

/// The portable definition of [`q16_block`], which the SIMD version equals bit for bit.
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
fn pair_groups(xs: &[f32], cols: usize, g: usize) -> (Cow<'static, [f32]>, usize) {
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

/// Output written by row ranges into a batch-major buffer: `ys[b * rows + r]`.
struct BatchOut {
    ptr: *mut f32,
    rows: usize,
}
// SAFETY: every task writes a disjoint set of weight rows `r` (for all batch rows `b`), so
// the index sets `b * rows + r` written by different tasks never overlap.
unsafe impl Send for BatchOut {}
unsafe impl Sync for BatchOut {}

impl BatchOut {
    /// # Safety
    /// `b * rows + r` must be in bounds and written by one task only.
    #[inline(always)]
    unsafe fn apply(&self, epi: Epilogue<'_>, b: usize, r: usize, v: f32) {
        // SAFETY: upheld by the caller.
        let y = unsafe { &mut *self.ptr.add(b * self.rows + r) };
        match epi {
            Epilogue::Store => *y = v,
            Epilogue::Axpy(alpha) => *y += alpha[b] * v,
        }
    }
}

/// Rows per parallel task of one batched product `p` (`n ≥ BATCH_TILE`), or `None` to run on
/// the calling thread. Decode-sized products are scheduled by [`run_guided`] instead.
fn chunk_rows(p: &Prepared<'_>) -> Option<usize> {
    let rows = p.w.rows();
    if rows * p.work_per_row() < PAR_THRESHOLD || rows < 2 {
        return None;
    }
    let threads = rayon::current_num_threads().max(1);
    if threads == 1 {
        return None;
    }
    // About four even ranges per worker, at least 8 rows each: the tasks must span whole
    // `ROW_BLOCK_BYTES` blocks for the activations to stream through the cache once per block.
    Some(rows.div_ceil(threads * 4).max(8))
}

/// Weight bytes of the smallest piece of a decode-sized product that [`run_guided`] hands out.
const UNIT_BYTES: usize = 16 * 1024;

/// Decode-sized products (`n < BATCH_TILE`, memory-bound) by guided self-scheduling: their
/// rows are cut into units of about [`UNIT_BYTES`] of weights, and each worker repeatedly takes
/// `1/(2·threads)` of the units still left (at least one) from a shared counter, so the first
/// pieces are large and the last ones small. All workers then finish within about one unit
/// (≈ 1 µs of DRAM time) of each other. A fixed split into even ranges ends with one core
/// idle for up to a whole range while the other finishes its last one: measured on `mini`
/// decode (two cores), the second worker idled ≈ 17% of each token, two thirds of that
/// while the generation thread was still inside a product. Which worker computes a row never
/// changes its value.
fn run_guided(be: Backend, prepared: &[Prepared<'_>], threads: usize) {
    crate::lookahead::note_products(prepared.iter().map(|p| (p.w, p.n)));
    // starts[i]..starts[i + 1]: the units of member i, `unit_rows[i]` rows each.
    let mut unit_rows = Vec::with_capacity(prepared.len());
    let mut starts = Vec::with_capacity(prepared.len() + 1);
    starts.push(0usize);
    for p in prepared {
        let rows = p.w.rows();
        let row_bytes = (p.w.weight_bytes() / rows.max(1)).max(1);
        let ur = (UNIT_BYTES / row_bytes).clamp(1, rows.max(1));
        unit_rows.push(ur);
        starts.push(starts[starts.len() - 1] + rows.div_ceil(ur));
    }
    let total = starts[prepared.len()];
    let next = AtomicUsize::new(0);
    let work = || {
        loop {
            let mut cur = next.load(Ordering::Relaxed);
            let end = loop {
                if cur >= total {
                    return;
                }
                let take = ((total - cur) / (2 * threads)).max(1);
                match next.compare_exchange_weak(
                    cur,
                    cur + take,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break cur + take,
                    Err(seen) => cur = seen,
                }
            };
            // Units cur..end, member by member.
            for (i, p) in prepared.iter().enumerate() {
                let (lo, hi) = (cur.max(starts[i]), end.min(starts[i + 1]));
                if lo < hi {
                    let r0 = (lo - starts[i]) * unit_rows[i];
                    let r1 = ((hi - starts[i]) * unit_rows[i]).min(p.w.rows());
                    // SAFETY: the counter hands each unit to exactly one worker, so the row
                    // ranges of all calls are disjoint.
                    unsafe { p.rows(be, r0, r1) };
                }
            }
        }
    };
    let work = &work;
    rayon::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(move |_| work());
        }
        work();
    });
}

/// Activations in a kernel's layout: the image, the offset of its first row, the row stride
/// (as [`Weights::prepare`] returns them).
type Image<'a> = (Cow<'a, [f32]>, usize, usize);

/// One product ready to run: weights, activations in the kernel's layout, the output.
struct Prepared<'a> {
    w: Weights<'a>,
    /// `w`'s raw slices, fetched once (the byte owner's accessor is a dynamic call, and a
    /// decode product runs its rows in many small pieces).
    raw: Raw<'a>,
    xs: Cow<'a, [f32]>,
    base: usize,
    stride: usize,
    n: usize,
    out: BatchOut,
    epi: Epilogue<'a>,
}

impl<'a> Prepared<'a> {
    /// Check the lengths against the shape and arrange the activations for `be`.
    fn new(
        be: Backend,
        w: Weights<'a>,
        xs: &'a [f32],
        n: usize,
        ys: &mut [f32],
        epi: Epilogue<'a>,
    ) -> Prepared<'a> {
        Prepared::with_image(be, w, xs, n, ys, epi, None)
    }

    /// [`Prepared::new`] with the activation image already built (`image`: the image of `xs`
    /// for `w` on `be`, as [`Weights::prepare`] returns it), or built here when `None`.
    fn with_image(
        be: Backend,
        w: Weights<'a>,
        xs: &'a [f32],
        n: usize,
        ys: &mut [f32],
        epi: Epilogue<'a>,
        image: Option<Image<'a>>,
    ) -> Prepared<'a> {
        assert!(
            be.is_supported(),
            "kernel backend {} is not supported by this CPU",
            be.name()
        );
        let (rows, cols) = (w.rows(), w.cols());
        if let Weights::F32 { data, .. } = w {
            assert_eq!(data.len(), rows * cols, "f32 weights: data length");
        }
        assert_eq!(xs.len(), n * cols, "{} product: input length", w.dtype());
        assert_eq!(ys.len(), n * rows, "{} product: output length", w.dtype());
        if let Epilogue::Axpy(alpha) = epi {
            assert_eq!(alpha.len(), n, "{} product: alpha length", w.dtype());
        }
        let (xs, base, stride) = if n == 0 || rows == 0 {
            (Cow::Borrowed(xs), 0, cols)
        } else if let Some(image) = image {
            image
        } else {
            w.prepare(be, xs)
        };
        Prepared {
            w,
            raw: Raw::of(w),
            xs,
            base,
            stride,
            n,
            out: BatchOut {
                ptr: ys.as_mut_ptr(),
                rows,
            },
            epi,
        }
    }

    /// Activation row `b` in the kernel's layout.
    #[inline(always)]
    fn x(&self, b: usize) -> &[f32] {
        let at = self.base + b * self.stride;
        &self.xs[at..at + self.stride]
    }

    /// bf16 and q16 row-int8 on AVX-512: rows `r0..r1` in register tiles of 2 weight rows ×
    /// 4 activation rows (bf16: 2 × [`BF16_WIDE_TILE`] first, MXFP4: [`MXFP4_WIDE_ROWS`] × 4
    /// first, then 2 × 4 for the rest)
    /// ([`crate::tile`]; ragged edges take the 1-row and 1–3-row instances
    /// of the same kernels, whose per-value arithmetic is identical), weight rows in
    /// cache-sized blocks as in [`Prepared::rows`].
    ///
    /// # Safety
    /// As [`Prepared::rows`]; the backend must be AVX-512 (checked by [`Prepared::new`]),
    /// with VNNI for row-int8 ([`q16_int8`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_tiled(&self, r0: usize, r1: usize) {
        let n = self.n;
        let row_bytes = (self.w.weight_bytes() / self.w.rows().max(1)).max(1);
        let block = (ROW_BLOCK_BYTES / row_bytes).clamp(2, 64);
        let raw = self.raw;
        let mut rb = r0;
        while rb < r1 {
            let re = (rb + block).min(r1);
            let mut b = 0;
            if let Raw::Bf16(..) = raw {
                // SAFETY: forwarded from the caller.
                b = unsafe { self.wide_tiles::<2, BF16_WIDE_TILE>(raw, rb, re) };
            }
            if let Raw::Mxfp4(..) = raw {
                // SAFETY: forwarded from the caller.
                b = unsafe { self.wide_tiles::<MXFP4_WIDE_ROWS, BATCH_TILE>(raw, rb, re) };
            }
            while b < n {
                let nb = (n - b).min(BATCH_TILE);
                let mut r = rb;
                if nb == 1
                    && matches!(raw, Raw::RowInt8(..) | Raw::Bf16(..))
                    && self.w.cols() <= TALL_TILE_MAX_COLS
                {
                    while r + 4 <= re {
                        // SAFETY: forwarded from the caller; r + 4 <= re <= r1, b < n.
                        unsafe { self.tile::<4, 1>(raw, r, b) };
                        r += 4;
                    }
                }
                if let Raw::Mxfp4(packed, scales, cols) = raw
                    && nb == 1
                    && (cols / GROUP).is_multiple_of(16)
                    && q8x3_pair()
                {
                    // SAFETY: forwarded from the caller; the CPU has what `q8x3_pair` checks.
                    r = unsafe { self.mxfp4_pairs(packed, scales, cols, r, re, b) };
                }
                while r < re {
                    let nr = (re - r).min(2);
                    // SAFETY: forwarded from the caller; r + nr <= r1, b + nb <= n.
                    unsafe {
                        match (nr, nb) {
                            (2, 4) => self.tile::<2, 4>(raw, r, b),
                            (2, 3) => self.tile::<2, 3>(raw, r, b),
                            (2, 2) => self.tile::<2, 2>(raw, r, b),
                            (2, _) => self.tile::<2, 1>(raw, r, b),
                            (_, 4) => self.tile::<1, 4>(raw, r, b),
                            (_, 3) => self.tile::<1, 3>(raw, r, b),
                            (_, 2) => self.tile::<1, 2>(raw, r, b),
                            _ => self.tile::<1, 1>(raw, r, b),
                        }
                    }
                    r += nr;
                }
                b += nb;
            }
            rb = re;
        }
    }

    /// Weight rows `rb..re` against the first `n - n % NB` activation rows in `NR × NB`
    /// tiles (a ragged last weight row in `1 × NB` tiles); returns how many activation rows
    /// were done.
    ///
    /// # Safety
    /// As [`Prepared::rows_tiled`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn wide_tiles<const NR: usize, const NB: usize>(
        &self,
        raw: Raw<'_>,
        rb: usize,
        re: usize,
    ) -> usize {
        let full = self.n - self.n % NB;
        let mut b = 0;
        while b < full {
            let mut r = rb;
            while r + NR <= re {
                // SAFETY: forwarded from the caller; r + NR <= re, b + NB <= n.
                unsafe { self.tile::<NR, NB>(raw, r, b) };
                r += NR;
            }
            while r < re {
                // SAFETY: as above.
                unsafe { self.tile::<1, NB>(raw, r, b) };
                r += 1;
            }
            b += NB;
        }
        full
    }

    /// One `NR × NB` tile at weight row `r`, activation row `b`.
    ///
    /// Each format's tile is a function compiled with its kernel's CPU features, so that the
    /// kernel inlines into it and its results reach the output in registers. Across a call
    /// they went through memory: the kernel's 4-byte result stores, then a wider load here,
    /// which the store buffer cannot forward — that load waited until every older instruction
    /// (the whole tile before it) had retired, and consecutive tiles stopped overlapping.
    ///
    /// # Safety
    /// As [`Prepared::rows_tiled`], with `r + NR` and `b + NB` in range.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile<const NR: usize, const NB: usize>(&self, raw: Raw<'_>, r: usize, b: usize) {
        // SAFETY: forwarded from the caller; `Prepared::new` checked AVX-512, and the caller
        // VNNI for the integer formats.
        unsafe {
            match raw {
                Raw::Bf16(data, cols) => self.tile_bf16::<NR, NB>(data, cols, r, b),
                Raw::RowInt8(data, scales, cols) => {
                    self.tile_i8::<NR, NB>(data, scales, cols, r, b)
                }
                Raw::Mxfp4(packed, scales, cols) => {
                    self.tile_mxfp4::<NR, NB>(packed, scales, cols, r, b)
                }
                _ => unreachable!("only bf16, q16 row-int8 and q16 MXFP4 products are tiled"),
            }
        }
    }

    /// The activation rows `b..b + NB` of a tile.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn tile_xs<const NB: usize>(&self, b: usize) -> [&[f32]; NB] {
        // Loops, not `array::from_fn`: called from the tiles' feature-enabled functions it
        // stayed a call, whose array came back through memory (see `Prepared::tile`).
        let mut xs: [&[f32]; NB] = [&[]; NB];
        for (j, x) in xs.iter_mut().enumerate() {
            *x = self.x(b + j);
        }
        xs
    }

    /// A tile's results into the output.
    ///
    /// # Safety
    /// The caller owns rows `r..r + NR`; `b + NB <= n`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_out<const NR: usize, const NB: usize>(
        &self,
        v: [[f32; NB]; NR],
        r: usize,
        b: usize,
    ) {
        for (i, vr) in v.iter().enumerate() {
            for (j, &vij) in vr.iter().enumerate() {
                // SAFETY: upheld by the caller.
                unsafe { self.out.apply(self.epi, b + j, r + i, vij) };
            }
        }
    }

    /// [`Prepared::tile`] of bf16 weights.
    ///
    /// # Safety
    /// As [`Prepared::tile`]; AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn tile_bf16<const NR: usize, const NB: usize>(
        &self,
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
            let v = crate::tile::dot_bf16_tile::<NR, NB>(ws, self.tile_xs::<NB>(b));
            self.tile_out(v, r, b);
        }
    }

    /// [`Prepared::tile`] of row-int8 weights (q16 image).
    ///
    /// # Safety
    /// As [`Prepared::tile`]; AVX-512 VNNI and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tile_i8<const NR: usize, const NB: usize>(
        &self,
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
            let v = crate::tile::dot_i8_q16_tile::<NR, NB>(ws, ss, self.tile_xs::<NB>(b));
            self.tile_out(v, r, b);
        }
    }

    /// Rows `r..` up to `re` of MXFP4 weights against activation row `b` in pairs, with the
    /// two-row `q8x3` kernel ([`crate::x86::avx512::dot_mxfp4_q8x3_pair_vbmi`]) inlined into
    /// this loop (a call per pair through [`Prepared::tile`] took a tenth of the samples but
    /// overlapped with the kernel: the same throughput either way, measured). Returns the
    /// first row not done (`re`, or `re − 1` when an odd number of rows was left).
    ///
    /// # Safety
    /// As [`Prepared::tile`]; the process's MXFP4 format is `q8x3` and the CPU has AVX-512
    /// VBMI ([`q8x3_pair`]); rows hold a multiple of 16 blocks.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma")]
    unsafe fn mxfp4_pairs(
        &self,
        packed: &[u8],
        scales: &[u8],
        cols: usize,
        mut r: usize,
        re: usize,
        b: usize,
    ) -> usize {
        let (pb, g) = (cols / 2, cols / GROUP);
        let x = self.x(b);
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
                let v = crate::x86::avx512::dot_mxfp4_q8x3_pair_vbmi(
                    packed.as_ptr().add(r * pb),
                    packed.as_ptr().add((r + 1) * pb),
                    scales.as_ptr().add(r * g),
                    scales.as_ptr().add((r + 1) * g),
                    g,
                    x.as_ptr(),
                );
                self.out.apply(self.epi, b, r, v[0]);
                self.out.apply(self.epi, b, r + 1, v[1]);
            }
            r += 2;
        }
        r
    }

    /// [`Prepared::tile`] of MXFP4 weights (the integer image of this process's format).
    ///
    /// # Safety
    /// As [`Prepared::tile`]; AVX-512 VNNI.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
    unsafe fn tile_mxfp4<const NR: usize, const NB: usize>(
        &self,
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
        // SAFETY: the image is the one of this process's integer format; the rest as the
        // caller guarantees.
        unsafe {
            let v = mxfp4_int_tile::<NR, NB>(ps, ss, self.tile_xs::<NB>(b));
            self.tile_out(v, r, b);
        }
    }

    /// Multiply-adds of one output row over the whole batch.
    fn work_per_row(&self) -> usize {
        self.w.cols() * self.n
    }

    /// Output rows `r0..r1` for every activation row.
    ///
    /// # Safety
    /// No other task may write rows `r0..r1` of this product's output while this runs.
    unsafe fn rows(&self, be: Backend, r0: usize, r1: usize) {
        #[cfg(target_arch = "x86_64")]
        if be == Backend::Avx512
            && (matches!(self.w, Weights::Bf16(_))
                || matches!(self.w, Weights::RowInt8(_)) && q16_int8()
                || matches!(self.w, Weights::Mxfp4(_)) && mxfp4_int_tiles())
        {
            // SAFETY: forwarded from the caller.
            return unsafe { self.rows_tiled(r0, r1) };
        }
        let (w, n, epi) = (self.w, self.n, self.epi);
        let raw = self.raw;
        let x = |b: usize| self.x(b);
        // Prefill tiling: a block of weight rows (about ROW_BLOCK_BYTES, cache-resident)
        // meets every activation tile before the next block, so the activations stream
        // through the cache once per block instead of once per weight row. A decode product
        // (n < BATCH_TILE) has one tile and the block order changes nothing. Each (r, b)
        // value is the same dot call either way.
        let row_bytes = (w.weight_bytes() / w.rows().max(1)).max(1);
        let block = (ROW_BLOCK_BYTES / row_bytes).clamp(1, 64);
        let mut rb = r0;
        while rb < r1 {
            let re = (rb + block).min(r1);
            let mut b = 0;
            while b + BATCH_TILE <= n {
                let tile = [x(b), x(b + 1), x(b + 2), x(b + 3)];
                for r in rb..re {
                    let v = raw.dot::<BATCH_TILE>(be, r, tile);
                    for (i, &vi) in v.iter().enumerate() {
                        // SAFETY: the caller owns row r; b + i < n.
                        unsafe { self.out.apply(epi, b + i, r, vi) };
                    }
                }
                b += BATCH_TILE;
            }
            while b < n {
                for r in rb..re {
                    let v = raw.dot::<1>(be, r, [x(b)])[0];
                    // SAFETY: as above.
                    unsafe { self.out.apply(epi, b, r, v) };
                }
                b += 1;
            }
            rb = re;
        }
    }
}

/// The driver behind every single public product.
fn product(be: Backend, w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32], epi: Epilogue<'_>) {
    let p = Prepared::new(be, w, xs, n, ys, epi);
    if n == 0 || p.w.rows() == 0 {
        return;
    }
    let rows = p.w.rows();
    let threads = rayon::current_num_threads().max(1);
    if n < BATCH_TILE && threads > 1 && rows * p.work_per_row() >= PAR_THRESHOLD {
        run_guided(be, std::slice::from_ref(&p), threads);
        return;
    }
    let p = &p;
    match chunk_rows(p) {
        // SAFETY: one task owns all rows.
        None => unsafe { p.rows(be, 0, rows) },
        Some(chunk) => (0..rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            // SAFETY: the ranges are disjoint.
            unsafe { p.rows(be, ci * chunk, ((ci + 1) * chunk).min(rows)) }
        }),
    }
}

/// One member of a [`matmul_group`]: `ys = W·xs` over `n` activation rows, layout as
/// [`matmul_with`].
pub struct GroupProduct<'a> {
    /// The weights.
    pub w: Weights<'a>,
    /// `n` input rows of `w.cols()` values.
    pub xs: &'a [f32],
    /// Activation rows.
    pub n: usize,
    /// `n` output rows of `w.rows()` values.
    pub ys: &'a mut [f32],
}

/// Several independent products in one parallel region (one fork/join instead of one per
/// product): the row ranges of all members are spread over the pool together. Every value
/// is bit-identical to the member's own [`matmul_with`]; only the scheduling changes.
///
/// # Panics
/// As [`matmul_with`], for any member.
pub fn matmul_group_with(be: Backend, products: &mut [GroupProduct<'_>]) {
    group_with(be, products, true);
}

/// [`matmul_group_with`] (or, with `parallel == false`, entirely on the calling thread).
fn group_with(be: Backend, products: &mut [GroupProduct<'_>], parallel: bool) {
    let products: Vec<&mut GroupProduct<'_>> = products
        .iter_mut()
        .filter(|g| g.n > 0 && g.w.rows() > 0)
        .collect();
    // Members that read the same input in the same layout (a layer's projections of one
    // normalised state) share one activation image: `first[j]` is the member whose image j
    // reads, and only those members build one.
    let key = |g: &GroupProduct<'_>| {
        let kind = g.w.image_kind(be);
        (kind != 0).then(|| (g.xs.as_ptr() as usize, g.xs.len(), g.w.cols(), kind))
    };
    let keys: Vec<_> = products.iter().map(|g| key(g)).collect();
    let first: Vec<usize> = (0..keys.len())
        .map(|j| match keys[j] {
            Some(k) => keys.iter().position(|&o| o == Some(k)).unwrap_or(j),
            None => j,
        })
        .collect();
    let images: Vec<Option<Image<'_>>> = products
        .iter()
        .enumerate()
        .map(|(j, g)| (keys[j].is_some() && first[j] == j).then(|| g.w.prepare(be, g.xs)))
        .collect();
    let prepared: Vec<Prepared<'_>> = products
        .into_iter()
        .enumerate()
        .map(|(j, g)| {
            let image = images[first[j]]
                .as_ref()
                .map(|(img, base, stride)| (Cow::Borrowed(&img[..]), *base, *stride));
            Prepared::with_image(be, g.w, g.xs, g.n, g.ys, Epilogue::Store, image)
        })
        .collect();
    let total: usize = prepared.iter().map(|p| p.w.rows() * p.work_per_row()).sum();
    let threads = rayon::current_num_threads().max(1);
    if total < PAR_THRESHOLD || threads == 1 || !parallel {
        for p in &prepared {
            // SAFETY: one task owns all rows of every member.
            unsafe { p.rows(be, 0, p.w.rows()) };
        }
        return;
    }
    if prepared.iter().all(|p| p.n < BATCH_TILE) {
        run_guided(be, &prepared, threads);
        return;
    }
    // About four tasks per worker over the whole group, at least 8 rows each.
    let target = total.div_ceil(threads * 4).max(1);
    let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
    for (i, p) in prepared.iter().enumerate() {
        let rows = p.w.rows();
        let chunk = target.div_ceil(p.work_per_row().max(1)).max(8).min(rows);
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + chunk).min(rows);
            tasks.push((i, r0, r1));
            r0 = r1;
        }
    }
    let prepared = &prepared;
    tasks.into_par_iter().for_each(|(i, r0, r1)| {
        // SAFETY: each (member, row range) pair is one task; ranges are disjoint.
        unsafe { prepared[i].rows(be, r0, r1) }
    });
}

/// [`matmul_group_with`] on the selected backend.
///
/// # Panics
/// As [`matmul_group_with`], or if `DELTAFIN_KERNEL` is invalid.
pub fn matmul_group(products: &mut [GroupProduct<'_>]) {
    matmul_group_with(backend(), products);
}

/// Batched product on an explicit backend: `xs` holds `n` input rows of length `cols`
/// (row-major), `ys` receives `n` output rows of length `rows`: `ys[b] = W·xs[b]`.
///
/// # Panics
/// If the backend is not supported by this CPU or the lengths disagree with the shape.
pub fn matmul_with(be: Backend, w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    product(be, w, xs, n, ys, Epilogue::Store);
}

/// Fused accumulate on an explicit backend: `ys[b] += alpha[b] · (W·xs[b])`, one pass over
/// the output. The product value is bit-identical to [`matmul_with`]'s.
///
/// # Panics
/// As [`matmul_with`], or if `alpha.len() != n`.
pub fn matmul_axpy_with(
    be: Backend,
    w: Weights<'_>,
    xs: &[f32],
    n: usize,
    alpha: &[f32],
    ys: &mut [f32],
) {
    product(be, w, xs, n, ys, Epilogue::Axpy(alpha));
}

/// [`matmul_with`] on the selected backend ([`crate::dispatch::backend`]).
///
/// # Panics
/// As [`matmul_with`], or if `DELTAFIN_KERNEL` is invalid.
pub fn matmul(w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul_with(backend(), w, xs, n, ys);
}

/// [`matmul`] entirely on the calling thread (no fork/join), for callers that already run
/// several products side by side as separate pool tasks (the routed experts of a MoE
/// layer). Every value is bit-identical to [`matmul`]'s; only the scheduling differs.
///
/// # Panics
/// As [`matmul_with`], or if `DELTAFIN_KERNEL` is invalid.
pub fn matmul_serial(w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    let p = Prepared::new(backend(), w, xs, n, ys, Epilogue::Store);
    if n == 0 || p.w.rows() == 0 {
        return;
    }
    // SAFETY: one task owns all rows.
    unsafe { p.rows(backend(), 0, p.w.rows()) }
}

/// [`matmul_group`] entirely on the calling thread (members that read the same input share
/// its activation image, as in a group), for callers that run several groups side by side as
/// separate pool tasks (a routed expert's `w1` and `w3`). Every value is bit-identical to
/// the members' own [`matmul`].
///
/// # Panics
/// As [`matmul_group_with`], or if `DELTAFIN_KERNEL` is invalid.
pub fn matmul_group_serial(products: &mut [GroupProduct<'_>]) {
    group_with(backend(), products, false);
}

/// [`matmul_axpy_with`] on the selected backend.
///
/// # Panics
/// As [`matmul_axpy_with`], or if `DELTAFIN_KERNEL` is invalid.
pub fn matmul_axpy(w: Weights<'_>, xs: &[f32], n: usize, alpha: &[f32], ys: &mut [f32]) {
    matmul_axpy_with(backend(), w, xs, n, alpha, ys);
}

/// `y = W·x` with `W` bf16 `[rows, cols]`, `x` of length `cols`, `y` of length `rows`.
///
/// # Panics
/// If the lengths disagree with the matrix shape.
pub fn matvec_bf16(w: &Bf16Matrix, x: &[f32], y: &mut [f32]) {
    matmul(Weights::Bf16(w), x, 1, y);
}

/// Batched bf16 product: `xs` holds `n` input rows of length `cols` (row-major), `ys`
/// receives `n` output rows of length `rows`: `ys[b] = W·xs[b]`. Row `b` of the result is
/// bit-identical to `matvec_bf16(w, xs[b])`.
///
/// # Panics
/// If the lengths disagree with the matrix shape and `n`.
pub fn matmul_bf16(w: &Bf16Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul(Weights::Bf16(w), xs, n, ys);
}

/// `y = W·x` with `W` MXFP4 `[rows, cols]` (k3-model.md §3.3 kernel form: per 32-column block,
/// scale × Σ E2M1·x, accumulated in f32).
///
/// # Panics
/// If the lengths disagree with the matrix shape.
pub fn matvec_mxfp4(w: &Mxfp4Matrix, x: &[f32], y: &mut [f32]) {
    matmul(Weights::Mxfp4(w), x, 1, y);
}

/// Batched MXFP4 product, layout as [`matmul_bf16`]. Row `b` of the result is bit-identical
/// to `matvec_mxfp4(w, xs[b])`.
///
/// # Panics
/// If the lengths disagree with the matrix shape and `n`.
pub fn matmul_mxfp4(w: &Mxfp4Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul(Weights::Mxfp4(w), xs, n, ys);
}

/// `y = W·x` with `W` row-int8 `[rows, cols]`: `y_r = scale_r · Σ q[r, c]·x_c`.
///
/// # Panics
/// If the lengths disagree with the matrix shape.
pub fn matvec_rowint8(w: &RowInt8Matrix, x: &[f32], y: &mut [f32]) {
    matmul(Weights::RowInt8(w), x, 1, y);
}

/// Batched row-int8 product, layout as [`matmul_bf16`]; row-invariant likewise.
///
/// # Panics
/// If the lengths disagree with the matrix shape and `n`.
pub fn matmul_rowint8(w: &RowInt8Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul(Weights::RowInt8(w), xs, n, ys);
}

/// `y = W·x` with `W` row-major f32 `[rows, cols]` in `w`.
///
/// # Panics
/// If the lengths disagree with `rows` and `cols`.
pub fn matvec_f32(w: &[f32], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    matmul(
        Weights::F32 {
            data: w,
            rows,
            cols,
        },
        x,
        1,
        y,
    );
}

/// Batched f32 product, layout as [`matmul_bf16`]; row-invariant likewise.
///
/// # Panics
/// If the lengths disagree with `rows`, `cols` and `n`.
pub fn matmul_f32(w: &[f32], rows: usize, cols: usize, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul(
        Weights::F32 {
            data: w,
            rows,
            cols,
        },
        xs,
        n,
        ys,
    );
}
