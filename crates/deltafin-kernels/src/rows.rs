//! The row drivers of the kernel table: [`rows_dot`] runs a row dot product ([`Dot`]) over a
//! product's rows in cache-sized blocks, [`rows_tiled`] runs AVX-512 register tiles
//! ([`Tiles`]) over them. Each table entry is one of these instantiated for its kernel, so the
//! kernel call inside the loops is static.
//!
//! Prefill tiling: a block of weight rows (about [`ROW_BLOCK_BYTES`], cache-resident) meets
//! every activation tile before the next block, so the activations stream through the cache
//! once per block instead of once per weight row. A decode product (`n < BATCH_TILE`) has
//! one tile and the block order changes nothing. Each `(r, b)` value is the same dot call
//! either way.

use crate::prepared::Prepared;
use crate::weights::Raw;

/// Activation rows processed together against one weight row (the row is read once per tile).
pub(crate) const BATCH_TILE: usize = 4;
/// [`BATCH_TILE`] of the AVX2 f32 and bf16 row dot products: their four accumulators per
/// activation row fill the 16 registers at two rows (at four rows the accumulators spill to
/// the stack). The row-int8 and MXFP4 AVX2 dot products keep four rows (two or three
/// accumulators per row fit, and the weight decoding is shared by more rows).
#[cfg(target_arch = "x86_64")]
pub(crate) const AVX2_BATCH_TILE: usize = 2;
/// Activation rows of the bf16 register tiles on AVX-512 (2 weight rows × 6 activation rows:
/// 24 accumulators; the ragged rest of a batch takes the 2 × 1…4 tiles). Against 2 × 4 the
/// weight widening (a shift and a mask per weight row and 32-column group) and the final
/// reductions are shared by half as many more products: ≈ 8% less time per value on the
/// mini prefill shape (512 × 1024, n = 64). Every value is the same either way.
#[cfg(target_arch = "x86_64")]
pub(crate) const BF16_WIDE_TILE: usize = 6;
/// Weight rows of the MXFP4 (integer-activation) register tiles on AVX-512 in batches: 3 weight rows × 4
/// activation rows (the ragged rest of a batch takes the 2-row tiles). Each activation load
/// and scale conversion then serves three weight rows instead of two: ≈ 7% less time per
/// value on 1024-column experts (n = 80), ≈ 3% on 512 columns. Every value is the same
/// either way.
#[cfg(target_arch = "x86_64")]
pub(crate) const MXFP4_WIDE_ROWS: usize = 3;
/// Row-int8 and bf16 matrix-vector products (one activation row) with rows of at most this
/// many columns take 4-row register tiles instead of 2-row ones: the per-tile work (row
/// slices, the final reductions, the row scales, the epilogue) is shared by twice the bytes,
/// and the whole-tile prefetch distance grows with the tile (row-int8 4 KiB, bf16 8 KiB).
/// Row-int8 from DRAM, 1024 columns, 2 threads (`kernel-point row-int8 --cols 1024 --bytes 2M
/// --count 256`, alternated): 20.8–21.5 → 22.6–24.1 GB/s; `mini` decode, A B B A:
/// int8 spine 1.06 ×, bf16 spine 1.04–1.05 ×. Wider rows keep 2-row tiles (7168 columns: 4-row
/// int8 tiles put the prefetch 28 KiB ahead and measured 19.5 against 23.5 GB/s). Every value
/// is the same either way (each output row has its own accumulators).
#[cfg(target_arch = "x86_64")]
pub(crate) const TALL_TILE_MAX_COLS: usize = 1024;
/// Weight bytes of one row block in batched products (kept in L2 while every activation tile
/// passes over it).
pub(crate) const ROW_BLOCK_BYTES: usize = 96 * 1024;

/// A row dot product of one weight format on one instruction set: the values of weight row
/// `r` against `NB` activation rows in the kernel's layout.
pub(crate) trait Dot {
    /// # Safety
    /// The CPU has the kernel's features and `xs` are rows of the kernel's layout for `raw`.
    unsafe fn dot<const NB: usize>(raw: Raw<'_>, r: usize, xs: [&[f32]; NB]) -> [f32; NB];
}

/// Rows `r0..r1` of `p` with the row dot product `D`: activation rows four at a time against
/// each weight row, the remainder one at a time, weight rows in cache-sized blocks.
///
/// # Safety
/// As [`crate::prepared::Kernel::rows`], with `D` the entry's dot product.
pub(crate) unsafe fn rows_dot<D: Dot>(p: &Prepared<'_>, r0: usize, r1: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { rows_dot_n::<D, BATCH_TILE>(p, r0, r1) }
}

/// [`rows_dot`] with `NB` activation rows per weight-row call: the AVX2 f32 and bf16 entries
/// take [`AVX2_BATCH_TILE`], whose accumulators fit the 16 vector registers. Each `(r, b)` value
/// is the same dot call whatever `NB` (a dot product's activation rows have their own
/// accumulators).
///
/// # Safety
/// As [`rows_dot`].
pub(crate) unsafe fn rows_dot_n<D: Dot, const NB: usize>(p: &Prepared<'_>, r0: usize, r1: usize) {
    let (w, n) = (p.w, p.n);
    let raw = p.raw;
    let x = |b: usize| p.x(b);
    let row_bytes = (w.weight_bytes() / w.rows().max(1)).max(1);
    let block = (ROW_BLOCK_BYTES / row_bytes).clamp(1, 64);
    let mut rb = r0;
    while rb < r1 {
        let re = (rb + block).min(r1);
        let mut b = 0;
        while b + NB <= n {
            let tile: [&[f32]; NB] = std::array::from_fn(|i| x(b + i));
            for r in rb..re {
                // SAFETY: forwarded from the caller.
                let v = unsafe { D::dot::<NB>(raw, r, tile) };
                for (i, &vi) in v.iter().enumerate() {
                    // SAFETY: the caller owns row r; b + i < n.
                    unsafe { p.apply(b + i, r, vi) };
                }
            }
            b += NB;
        }
        while b < n {
            for r in rb..re {
                // SAFETY: as above.
                let v = unsafe { D::dot::<1>(raw, r, [x(b)]) }[0];
                // SAFETY: as above.
                unsafe { p.apply(b, r, v) };
            }
            b += 1;
        }
        rb = re;
    }
}

/// The AVX-512 register tiles of one weight format × activation format.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Tiles: Sized {
    /// One `NR × NB` tile at weight row `r`, activation row `b`.
    ///
    /// Each format's tile is a function compiled with its kernel's CPU features, so that the
    /// kernel inlines into it and its results reach the output in registers. Across a call
    /// they went through memory: the kernel's 4-byte result stores, then a wider load here,
    /// which the store buffer cannot forward — that load waited until every older instruction
    /// (the whole tile before it) had retired, and consecutive tiles stopped overlapping.
    ///
    /// # Safety
    /// As [`rows_tiled`], with `r + NR` and `b + NB` in range.
    unsafe fn tile<const NR: usize, const NB: usize>(p: &Prepared<'_>, r: usize, b: usize);

    /// The wide tiles a batch starts with, over weight rows `rb..re`; returns how many
    /// activation rows they did (none by default).
    ///
    /// # Safety
    /// As [`rows_tiled`].
    #[inline(always)]
    unsafe fn wide(_p: &Prepared<'_>, _rb: usize, _re: usize) -> usize {
        0
    }

    /// The tiles that go first on one activation row `b` (a decode product, or the last
    /// row of a batch), from weight row `r` up to `re`; returns the first row not done
    /// (`r` by default: the 2-row tiles do them all).
    ///
    /// # Safety
    /// As [`rows_tiled`].
    #[inline(always)]
    unsafe fn one_row(_p: &Prepared<'_>, r: usize, _re: usize, _b: usize) -> usize {
        r
    }
}

/// Rows `r0..r1` of `p` in the register tiles `T`: [`Tiles::wide`] first, then per group of
/// up to four activation rows 2-row tiles ([`Tiles::one_row`]'s first on a single row), the
/// ragged edges in the 1-row and 1–3-row instances of the same kernels, whose per-value
/// arithmetic is identical; weight rows in cache-sized blocks as in [`rows_dot`].
///
/// # Safety
/// As [`crate::prepared::Kernel::rows`], with `T` the entry's tiles.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn rows_tiled<T: Tiles>(p: &Prepared<'_>, r0: usize, r1: usize) {
    let n = p.n;
    let row_bytes = (p.w.weight_bytes() / p.w.rows().max(1)).max(1);
    let block = (ROW_BLOCK_BYTES / row_bytes).clamp(2, 64);
    let mut rb = r0;
    while rb < r1 {
        let re = (rb + block).min(r1);
        // SAFETY: forwarded from the caller.
        let mut b = unsafe { T::wide(p, rb, re) };
        while b < n {
            let nb = (n - b).min(BATCH_TILE);
            let mut r = rb;
            if nb == 1 {
                // SAFETY: forwarded from the caller; b < n.
                r = unsafe { T::one_row(p, r, re, b) };
            }
            while r < re {
                let nr = (re - r).min(2);
                // SAFETY: forwarded from the caller; r + nr <= r1, b + nb <= n.
                unsafe {
                    match (nr, nb) {
                        (2, 4) => T::tile::<2, 4>(p, r, b),
                        (2, 3) => T::tile::<2, 3>(p, r, b),
                        (2, 2) => T::tile::<2, 2>(p, r, b),
                        (2, _) => T::tile::<2, 1>(p, r, b),
                        (_, 4) => T::tile::<1, 4>(p, r, b),
                        (_, 3) => T::tile::<1, 3>(p, r, b),
                        (_, 2) => T::tile::<1, 2>(p, r, b),
                        _ => T::tile::<1, 1>(p, r, b),
                    }
                }
                r += nr;
            }
            b += nb;
        }
        rb = re;
    }
}

/// Weight rows `rb..re` against the first `n - n % NB` activation rows in `NR × NB` tiles
/// (a ragged last weight row in `1 × NB` tiles); returns how many activation rows were done.
///
/// # Safety
/// As [`rows_tiled`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn wide_tiles<T: Tiles, const NR: usize, const NB: usize>(
    p: &Prepared<'_>,
    rb: usize,
    re: usize,
) -> usize {
    let full = p.n - p.n % NB;
    let mut b = 0;
    while b < full {
        let mut r = rb;
        while r + NR <= re {
            // SAFETY: forwarded from the caller; r + NR <= re, b + NB <= n.
            unsafe { T::tile::<NR, NB>(p, r, b) };
            r += NR;
        }
        while r < re {
            // SAFETY: as above.
            unsafe { T::tile::<1, NB>(p, r, b) };
            r += 1;
        }
        b += NB;
    }
    full
}

/// 4-row tiles on one activation row for rows of at most [`TALL_TILE_MAX_COLS`] columns
/// (row-int8 and bf16); returns the first row not done.
///
/// # Safety
/// As [`rows_tiled`], `b < n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tall_tiles<T: Tiles>(
    p: &Prepared<'_>,
    mut r: usize,
    re: usize,
    b: usize,
) -> usize {
    if p.w.cols() <= TALL_TILE_MAX_COLS {
        while r + 4 <= re {
            // SAFETY: forwarded from the caller; r + 4 <= re, b < n.
            unsafe { T::tile::<4, 1>(p, r, b) };
            r += 4;
        }
    }
    r
}

/// The activation rows `b..b + NB` of a tile.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn tile_xs<'p, const NB: usize>(p: &'p Prepared<'_>, b: usize) -> [&'p [f32]; NB] {
    // Loops, not `array::from_fn`: called from the tiles' feature-enabled functions it
    // stayed a call, whose array came back through memory (see `Tiles::tile`).
    let mut xs: [&[f32]; NB] = [&[]; NB];
    for (j, x) in xs.iter_mut().enumerate() {
        *x = p.x(b + j);
    }
    xs
}

/// A tile's results into the output.
///
/// # Safety
/// The caller owns rows `r..r + NR`; `b + NB <= n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tile_out<const NR: usize, const NB: usize>(
    p: &Prepared<'_>,
    v: [[f32; NB]; NR],
    r: usize,
    b: usize,
) {
    for (i, vr) in v.iter().enumerate() {
        for (j, &vij) in vr.iter().enumerate() {
            // SAFETY: upheld by the caller.
            unsafe { p.apply(b + j, r + i, vij) };
        }
    }
}
