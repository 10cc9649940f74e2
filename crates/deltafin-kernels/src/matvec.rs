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
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::dispatch::Backend;
use crate::layout::Image;
use crate::prepared::{Epilogue, Kernel, Layout, Prepared};
use crate::rows::BATCH_TILE;
use crate::settings::backend;
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix};

pub use crate::weights::Weights;

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

/// The table entry of a product over `w` on `be` with the installed MXFP4 activation format.
///
/// # Panics
/// If `be` is not supported by this CPU.
#[inline]
fn kernel_for(be: Backend, w: &Weights<'_>) -> &'static Kernel {
    assert!(
        be.is_supported(),
        "kernel backend {} is not supported by this CPU",
        be.name()
    );
    crate::table::isa(be).kernel(w, crate::settings::current().mxfp4_act)
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
fn run_guided(prepared: &[Prepared<'_>], threads: usize) {
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
                    unsafe { p.rows(r0, r1) };
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

/// The driver behind every single public product.
fn product(be: Backend, w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32], epi: Epilogue<'_>) {
    product_with(kernel_for(be, &w), w, xs, n, ys, epi);
}

/// [`product`] by table entry `kernel` (the tests run every entry this CPU has).
pub(crate) fn product_with(
    kernel: &'static Kernel,
    w: Weights<'_>,
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
    epi: Epilogue<'_>,
) {
    let p = Prepared::new(kernel, w, xs, n, ys, epi, None);
    if n == 0 || p.w.rows() == 0 {
        return;
    }
    let rows = p.w.rows();
    let threads = rayon::current_num_threads().max(1);
    if n < BATCH_TILE && threads > 1 && rows * p.work_per_row() >= PAR_THRESHOLD {
        run_guided(std::slice::from_ref(&p), threads);
        return;
    }
    let p = &p;
    match chunk_rows(p) {
        // SAFETY: one task owns all rows.
        None => unsafe { p.rows(0, rows) },
        Some(chunk) => (0..rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            // SAFETY: the ranges are disjoint.
            unsafe { p.rows(ci * chunk, ((ci + 1) * chunk).min(rows)) }
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
    // Each member's table entry, and the key of the image it reads (none for the input as it is).
    let keys: Vec<_> = products
        .iter()
        .map(|g| {
            let k = kernel_for(be, &g.w);
            let key = (k.layout != Layout::Plain)
                .then(|| (g.xs.as_ptr() as usize, g.xs.len(), g.w.cols(), k.layout));
            (k, key)
        })
        .collect();
    let first: Vec<usize> = (0..keys.len())
        .map(|j| match keys[j].1 {
            Some(k) => keys.iter().position(|o| o.1 == Some(k)).unwrap_or(j),
            None => j,
        })
        .collect();
    let images: Vec<Option<Image<'_>>> = products
        .iter()
        .enumerate()
        .map(|(j, g)| {
            (keys[j].1.is_some() && first[j] == j).then(|| (keys[j].0.prepare)(g.xs, g.w.cols()))
        })
        .collect();
    let prepared: Vec<Prepared<'_>> = products
        .into_iter()
        .enumerate()
        .map(|(j, g)| {
            let image = images[first[j]]
                .as_ref()
                .map(|(img, base, stride)| (Cow::Borrowed(&img[..]), *base, *stride));
            Prepared::new(keys[j].0, g.w, g.xs, g.n, g.ys, Epilogue::Store, image)
        })
        .collect();
    let total: usize = prepared.iter().map(|p| p.w.rows() * p.work_per_row()).sum();
    let threads = rayon::current_num_threads().max(1);
    if total < PAR_THRESHOLD || threads == 1 || !parallel {
        for p in &prepared {
            // SAFETY: one task owns all rows of every member.
            unsafe { p.rows(0, p.w.rows()) };
        }
        return;
    }
    if prepared.iter().all(|p| p.n < BATCH_TILE) {
        run_guided(&prepared, threads);
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
        unsafe { prepared[i].rows(r0, r1) }
    });
}

/// [`matmul_group_with`] on the selected backend.
///
/// # Panics
/// As [`matmul_group_with`], .
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

/// [`matmul_with`] on the installed backend ([`crate::settings::backend`]).
///
/// # Panics
/// As [`matmul_with`], .
pub fn matmul(w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    matmul_with(backend(), w, xs, n, ys);
}

/// [`matmul`] entirely on the calling thread (no fork/join), for callers that already run
/// several products side by side as separate pool tasks (the routed experts of a MoE
/// layer). Every value is bit-identical to [`matmul`]'s; only the scheduling differs.
///
/// # Panics
/// As [`matmul_with`], .
pub fn matmul_serial(w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    let p = Prepared::new(
        kernel_for(backend(), &w),
        w,
        xs,
        n,
        ys,
        Epilogue::Store,
        None,
    );
    if n == 0 || p.w.rows() == 0 {
        return;
    }
    // SAFETY: one task owns all rows.
    unsafe { p.rows(0, p.w.rows()) }
}

/// [`matmul_group`] entirely on the calling thread (members that read the same input share
/// its activation image, as in a group), for callers that run several groups side by side as
/// separate pool tasks (a routed expert's `w1` and `w3`). Every value is bit-identical to
/// the members' own [`matmul`].
///
/// # Panics
/// As [`matmul_group_with`], .
pub fn matmul_group_serial(products: &mut [GroupProduct<'_>]) {
    group_with(backend(), products, false);
}

/// [`matmul_axpy_with`] on the selected backend.
///
/// # Panics
/// As [`matmul_axpy_with`], .
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

/// `y = W·x` with `W` MXFP4 `[rows, cols]` (docs/K3.md §3.3 kernel form: per 32-column block,
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
