//! Absorbed latent attention of one query position (docs/K3.md §4.4), all heads of a group
//! at once, so each cached row is read once per query position rather than once per head:
//!
//! ```text
//! score_h(s) = (q_lat_h · ĉ(s) + q_tail_h · kt(s)) · scale,   s < n
//! p_h = softmax(score_h);   ctx_h = Σ_s p_h(s) ĉ(s)
//! ```
//!
//! Every dot product has one fixed order (16 lane sums, then a fixed pairwise reduction) and
//! every head's values are computed by the same operations whatever the head group or the
//! backend, so a row's result does not depend on how rows and heads are split into tasks.

use crate::kda_chunk::dot;
use crate::ops::softmax_inplace;
use half::bf16;

/// A cached value the attention can widen to f32.
pub trait CacheValue: Copy + Send + Sync {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
}

impl CacheValue for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl CacheValue for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// One query position over the first `n` cached rows for `heads` heads: `q_lat` holds
/// `heads` rows of `kvl`, `q_tail` `heads` rows of `dr`; `latent` / `tail` hold at least `n`
/// rows of `kvl` / `dr`. Writes the probabilities to `p` (`heads` rows of `n`) and the
/// contexts to `ctx` (`heads` rows of `kvl`). The same values as
/// [`causal_latent_attention`] with one query.
///
/// # Panics
/// If a length disagrees with `heads`, `n` or the row widths, or `n` is 0.
#[allow(clippy::too_many_arguments)]
pub fn latent_attention<E: CacheValue>(
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    n: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
) {
    assert!(n > 0, "latent_attention: no cached rows");
    causal_latent_attention(q_lat, q_tail, latent, tail, heads, 1, n, scale, p, ctx)
}

/// `queries` consecutive query positions, causally: query `i` (`0..queries`) attends to
/// the first `n0 + i` cached rows. `q_lat` / `q_tail` / `ctx` hold `queries × heads` rows
/// (query-major) of `kvl` / `dr` / `kvl`; `p` holds as many rows of `n0 + queries − 1`
/// (the probabilities of query `i` fill the first `n0 + i` of its rows, the rest is left
/// as it was).
///
/// Blocked for long prompts: cached rows are widened in tiles of [`KEY_TILE`], once per
/// block of queries, and each tile serves every (query, head) row of the block from the
/// cache. Every (query, head) value is computed by the operations of the one-query form
/// in the same order (each dot product in 16 lane sums and the fixed pairwise reduction,
/// [`softmax_inplace`], each context element summed over the cached rows in order), so a
/// query's bits do not depend on the block it is in, on the head grouping, or on the
/// backend. On AVX2 and AVX-512 hosts the scores and the context sums run in register
/// tiles (`tiles_avx2`: four cached rows per pass over a query row, 64 context columns held
/// in registers across a key tile; `tiles_avx512`: eight rows, 128 columns) that perform
/// exactly those operations.
///
/// # Panics
/// If a length disagrees with `queries`, `heads`, `n0` or the row widths, or `n0` is 0.
#[allow(clippy::too_many_arguments)]
pub fn causal_latent_attention<E: CacheValue>(
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    queries: usize,
    n0: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
) {
    causal_latent_attention_on(
        crate::settings::backend(),
        q_lat,
        q_tail,
        latent,
        tail,
        heads,
        queries,
        n0,
        scale,
        p,
        ctx,
    )
}

/// [`causal_latent_attention`] on the given backend (the tests compare every backend):
/// the portable body compiled with the backend's features, with the register tiles on the
/// x86-64 SIMD backends.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_latent_attention_on<E: CacheValue>(
    backend: crate::Backend,
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    queries: usize,
    n0: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx512<E: CacheValue>(
            q_lat: &[f32],
            q_tail: &[f32],
            latent: &[E],
            tail: &[E],
            heads: usize,
            queries: usize,
            n0: usize,
            scale: f32,
            p: &mut [f32],
            ctx: &mut [f32],
        ) {
            causal_latent_attention_body(
                q_lat,
                q_tail,
                latent,
                tail,
                heads,
                queries,
                n0,
                scale,
                p,
                ctx,
                Tiles::Avx512,
            )
        }
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2<E: CacheValue>(
            q_lat: &[f32],
            q_tail: &[f32],
            latent: &[E],
            tail: &[E],
            heads: usize,
            queries: usize,
            n0: usize,
            scale: f32,
            p: &mut [f32],
            ctx: &mut [f32],
        ) {
            causal_latent_attention_body(
                q_lat,
                q_tail,
                latent,
                tail,
                heads,
                queries,
                n0,
                scale,
                p,
                ctx,
                Tiles::Avx2,
            )
        }
        match backend {
            // SAFETY: callers pass a backend this CPU supports (the settings hold only such
            // a backend; the tests pass `Backend::available()` ones).
            crate::Backend::Avx512 => {
                return unsafe {
                    avx512(
                        q_lat, q_tail, latent, tail, heads, queries, n0, scale, p, ctx,
                    )
                };
            }
            // SAFETY: as above.
            crate::Backend::Avx2 => {
                return unsafe {
                    avx2(
                        q_lat, q_tail, latent, tail, heads, queries, n0, scale, p, ctx,
                    )
                };
            }
            _ => {}
        }
    }
    let _ = backend;
    causal_latent_attention_body(
        q_lat,
        q_tail,
        latent,
        tail,
        heads,
        queries,
        n0,
        scale,
        p,
        ctx,
        Tiles::Portable,
    )
}

/// Cached rows widened per tile.
const KEY_TILE: usize = 16;

/// [`causal_latent_attention`]: the checks, then the operations (compiled once per backend,
/// the same operations on each).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn causal_latent_attention_body<E: CacheValue>(
    q_lat: &[f32],
    q_tail: &[f32],
    latent: &[E],
    tail: &[E],
    heads: usize,
    queries: usize,
    n0: usize,
    scale: f32,
    p: &mut [f32],
    ctx: &mut [f32],
    tiles: Tiles,
) {
    assert!(
        heads > 0 && queries > 0,
        "latent_attention: no heads or queries"
    );
    assert!(n0 > 0, "latent_attention: no cached rows");
    let rows = heads * queries;
    let (kvl, dr) = (q_lat.len() / rows, q_tail.len() / rows);
    let stride = n0 + queries - 1;
    assert_eq!(q_lat.len(), rows * kvl, "latent_attention: q_lat length");
    assert_eq!(q_tail.len(), rows * dr, "latent_attention: q_tail length");
    assert!(
        latent.len() >= stride * kvl,
        "latent_attention: latent rows"
    );
    assert!(tail.len() >= stride * dr, "latent_attention: tail rows");
    assert_eq!(
        p.len(),
        rows * stride,
        "latent_attention: probability length"
    );
    assert_eq!(ctx.len(), rows * kvl, "latent_attention: context length");
    // Keys seen by row r (query r / heads).
    let len = |r: usize| n0 + r / heads;
    let mut cw = vec![0f32; KEY_TILE * kvl];
    let mut tw = vec![0f32; KEY_TILE * dr];

    // Scores, one tile of cached rows at a time (widened once for every row of the block).
    for s0 in (0..stride).step_by(KEY_TILE) {
        let s1 = (s0 + KEY_TILE).min(stride);
        widen_row(&latent[s0 * kvl..s1 * kvl], &mut cw[..(s1 - s0) * kvl]);
        widen_row(&tail[s0 * dr..s1 * dr], &mut tw[..(s1 - s0) * dr]);
        for r in 0..rows {
            let e = s1.min(len(r));
            if e <= s0 {
                continue;
            }
            let (ql, qt) = (
                &q_lat[r * kvl..(r + 1) * kvl],
                &q_tail[r * dr..(r + 1) * dr],
            );
            let out = &mut p[r * stride + s0..r * stride + e];
            if tiles != Tiles::Portable {
                let (mut a, mut b) = ([0f32; KEY_TILE], [0f32; KEY_TILE]);
                let nk = e - s0;
                tiles.dots(ql, &cw[..nk * kvl], &mut a[..nk]);
                tiles.dots(qt, &tw[..nk * dr], &mut b[..nk]);
                for (o, (&a, &b)) in out.iter_mut().zip(a.iter().zip(&b)) {
                    *o = (a + b) * scale;
                }
                continue;
            }
            for (k, o) in out.iter_mut().enumerate() {
                let a = dot(ql, &cw[k * kvl..(k + 1) * kvl]);
                let b = dot(qt, &tw[k * dr..(k + 1) * dr]);
                *o = (a + b) * scale;
            }
        }
    }
    for r in 0..rows {
        softmax_inplace(&mut p[r * stride..r * stride + len(r)]);
    }
    // Contexts: ctx_r = Σ_s p_r(s) ĉ(s), s in order.
    ctx.fill(0.0);
    for s0 in (0..stride).step_by(KEY_TILE) {
        let s1 = (s0 + KEY_TILE).min(stride);
        widen_row(&latent[s0 * kvl..s1 * kvl], &mut cw[..(s1 - s0) * kvl]);
        for (r, ch) in ctx.chunks_exact_mut(kvl).enumerate() {
            let e = s1.min(len(r));
            if tiles != Tiles::Portable {
                if e > s0 {
                    tiles.accumulate(
                        ch,
                        &p[r * stride + s0..r * stride + e],
                        &cw[..(e - s0) * kvl],
                    );
                }
                continue;
            }
            for s in s0..e {
                let ps = p[r * stride + s];
                let k = s - s0;
                for (a, &b) in ch.iter_mut().zip(&cw[k * kvl..(k + 1) * kvl]) {
                    *a += ps * b;
                }
            }
        }
    }
}

/// Which register tiles [`causal_latent_attention_body`] runs its scores and context sums
/// in: the portable loops, or [`tiles_avx2`] / [`tiles_avx512`] (the same operations in the
/// same order, so the same bits).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tiles {
    Portable,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Tiles {
    /// `out[k] = q · keys[k]`, each in [`dot`]'s order.
    #[inline(always)]
    fn dots(self, q: &[f32], keys: &[f32], out: &mut [f32]) {
        match self {
            // SAFETY: `Tiles::Avx512` and `Tiles::Avx2` are passed only by the wrappers of
            // `causal_latent_attention_on` for those backends, which run on CPUs that have
            // the features.
            #[cfg(target_arch = "x86_64")]
            Tiles::Avx512 => unsafe { tiles_avx512::dots(q, keys, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Tiles::Avx2 => unsafe { tiles_avx2::dots(q, keys, out) },
            _ => {
                let w = q.len();
                for (o, k) in out.iter_mut().zip(keys.chunks_exact(w.max(1))) {
                    *o = dot(q, k);
                }
            }
        }
    }

    /// `ctx[c] += p[k] · keys[k][c]` for `k` in order.
    #[inline(always)]
    fn accumulate(self, ctx: &mut [f32], p: &[f32], keys: &[f32]) {
        match self {
            // SAFETY: as in `dots`.
            #[cfg(target_arch = "x86_64")]
            Tiles::Avx512 => unsafe { tiles_avx512::accumulate(ctx, p, keys) },
            // SAFETY: as in `dots`.
            #[cfg(target_arch = "x86_64")]
            Tiles::Avx2 => unsafe { tiles_avx2::accumulate(ctx, p, keys) },
            _ => {
                let w = ctx.len();
                for (k, &pk) in p.iter().enumerate() {
                    for (a, &b) in ctx.iter_mut().zip(&keys[k * w..(k + 1) * w]) {
                        *a += pk * b;
                    }
                }
            }
        }
    }
}

/// Register tiles of the latent attention for AVX2: the
/// operations of the portable loops, in the same order, with the values held in registers.
///
/// - [`tiles_avx2::dots`]: a query row against up to [`KEY_TILE`] cached rows, four rows per
///   pass, so each loaded query vector serves four products and eight independent sums hide
///   the add latency. Each product keeps the portable 16 lane sums in two registers (lanes
///   0–7 and 8–15), multiplies then adds (no fused multiply-add, as the portable code), takes
///   the columns past the last multiple of 16 into lanes 0… one at a time, and reduces in
///   [`crate::kda_chunk::reduce_lanes`]'s pairwise order.
/// - [`tiles_avx2::accumulate`]: `ctx += Σ_s p(s) ĉ(s)` with 64 context columns held in
///   eight registers across the tile's cached rows, each element summed over the rows in
///   order (the portable loop reads and writes `ctx` once per row instead).
#[cfg(target_arch = "x86_64")]
mod tiles_avx2 {
    use std::arch::x86_64::*;

    /// `out[k] = q · keys[k]` (`keys` holds `out.len()` rows of `q.len()`), each in the
    /// order of [`crate::kda_chunk::dot`].
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let w = q.len();
        assert_eq!(keys.len(), out.len() * w, "dots: key rows");
        let mut k = 0;
        while k + 4 <= out.len() {
            let mut acc = [_mm256_setzero_ps(); 8];
            let rows = [0, 1, 2, 3].map(|j| &keys[(k + j) * w..(k + j + 1) * w]);
            let mut c = 0;
            while c + 16 <= w {
                // SAFETY: columns c..c + 16 lie in `q` and in every key row (c + 16 <= w).
                unsafe {
                    let q0 = _mm256_loadu_ps(q.as_ptr().add(c));
                    let q1 = _mm256_loadu_ps(q.as_ptr().add(c + 8));
                    for (j, row) in rows.iter().enumerate() {
                        let k0 = _mm256_loadu_ps(row.as_ptr().add(c));
                        let k1 = _mm256_loadu_ps(row.as_ptr().add(c + 8));
                        acc[2 * j] = _mm256_add_ps(acc[2 * j], _mm256_mul_ps(q0, k0));
                        acc[2 * j + 1] = _mm256_add_ps(acc[2 * j + 1], _mm256_mul_ps(q1, k1));
                    }
                }
                c += 16;
            }
            for (j, row) in rows.iter().enumerate() {
                out[k + j] = finish(acc[2 * j], acc[2 * j + 1], &q[c..], &row[c..]);
            }
            k += 4;
        }
        while k < out.len() {
            let row = &keys[k * w..(k + 1) * w];
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c + 16 <= w {
                // SAFETY: as above.
                unsafe {
                    let (q0, q1) = (
                        _mm256_loadu_ps(q.as_ptr().add(c)),
                        _mm256_loadu_ps(q.as_ptr().add(c + 8)),
                    );
                    let (k0, k1) = (
                        _mm256_loadu_ps(row.as_ptr().add(c)),
                        _mm256_loadu_ps(row.as_ptr().add(c + 8)),
                    );
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(q0, k0));
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(q1, k1));
                }
                c += 16;
            }
            out[k] = finish(a0, a1, &q[c..], &row[c..]);
            k += 1;
        }
    }

    /// Lanes 0–7 in `lo`, 8–15 in `hi`, plus the remaining columns (fewer than 16) into lanes
    /// 0…, then [`crate::kda_chunk::reduce_lanes`]'s order: `l += l + 8`, `l += l + 4`,
    /// `l += l + 2`, `l += l + 1`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn finish(lo: __m256, hi: __m256, q: &[f32], k: &[f32]) -> f32 {
        let (mut lo, mut hi) = (lo, hi);
        if !q.is_empty() {
            let mut lanes = [0f32; 16];
            // SAFETY: `lanes` holds 16 values.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
            }
            for (l, (x, y)) in q.iter().zip(k).enumerate() {
                lanes[l] += x * y;
            }
            // SAFETY: as above.
            unsafe {
                lo = _mm256_loadu_ps(lanes.as_ptr());
                hi = _mm256_loadu_ps(lanes.as_ptr().add(8));
            }
        }
        let v = _mm256_add_ps(lo, hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// `ctx[c] += p[k] · keys[k][c]` for `k` in order (`keys` holds `p.len()` rows of
    /// `ctx.len()`), each element multiplied then added, as the portable loop.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn accumulate(ctx: &mut [f32], p: &[f32], keys: &[f32]) {
        let w = ctx.len();
        assert_eq!(keys.len(), p.len() * w, "accumulate: key rows");
        let mut c = 0;
        while c + 64 <= w {
            // SAFETY: columns c..c + 64 lie in `ctx` and in every key row.
            unsafe {
                let cp = ctx.as_mut_ptr().add(c);
                let mut acc = [0, 1, 2, 3, 4, 5, 6, 7].map(|i| _mm256_loadu_ps(cp.add(8 * i)));
                for (k, &pk) in p.iter().enumerate() {
                    let pv = _mm256_set1_ps(pk);
                    let kp = keys.as_ptr().add(k * w + c);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, _mm256_loadu_ps(kp.add(8 * i))));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(cp.add(8 * i), *a);
                }
            }
            c += 64;
        }
        while c + 8 <= w {
            // SAFETY: columns c..c + 8 lie in `ctx` and in every key row.
            unsafe {
                let cp = ctx.as_mut_ptr().add(c);
                let mut a = _mm256_loadu_ps(cp);
                for (k, &pk) in p.iter().enumerate() {
                    let kv = _mm256_loadu_ps(keys.as_ptr().add(k * w + c));
                    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(pk), kv));
                }
                _mm256_storeu_ps(cp, a);
            }
            c += 8;
        }
        for (cc, o) in ctx.iter_mut().enumerate().skip(c) {
            for (k, &pk) in p.iter().enumerate() {
                *o += pk * keys[k * w + cc];
            }
        }
    }
}

/// [`tiles_avx2`]'s operations on 512-bit registers: a dot product's 16 lane sums are one
/// register, eight cached rows per pass over a query row, 128 context columns held in eight
/// registers.
#[cfg(target_arch = "x86_64")]
mod tiles_avx512 {
    use std::arch::x86_64::*;

    /// As [`super::tiles_avx2::dots`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let w = q.len();
        assert_eq!(keys.len(), out.len() * w, "dots: key rows");
        let mut k = 0;
        while k + 8 <= out.len() {
            let mut acc = [_mm512_setzero_ps(); 8];
            let mut c = 0;
            while c + 16 <= w {
                // SAFETY: columns c..c + 16 lie in `q` and in each of the eight key rows.
                unsafe {
                    let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                    let kp = keys.as_ptr().add(k * w + c);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let kv = _mm512_loadu_ps(kp.add(j * w));
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(qv, kv));
                    }
                }
                c += 16;
            }
            for (j, a) in acc.iter().enumerate() {
                out[k + j] = finish(*a, &q[c..], &keys[(k + j) * w + c..(k + j + 1) * w]);
            }
            k += 8;
        }
        while k < out.len() {
            let row = &keys[k * w..(k + 1) * w];
            let mut a = _mm512_setzero_ps();
            let mut c = 0;
            while c + 16 <= w {
                // SAFETY: as above.
                unsafe {
                    let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                    a = _mm512_add_ps(a, _mm512_mul_ps(qv, _mm512_loadu_ps(row.as_ptr().add(c))));
                }
                c += 16;
            }
            out[k] = finish(a, &q[c..], &row[c..]);
            k += 1;
        }
    }

    /// The 16 lane sums in `v`, plus the remaining columns into lanes 0…, reduced in
    /// [`crate::kda_chunk::reduce_lanes`]'s order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn finish(v: __m512, q: &[f32], k: &[f32]) -> f32 {
        let mut v = v;
        if !q.is_empty() {
            let mut lanes = [0f32; 16];
            // SAFETY: `lanes` holds 16 values.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
            for (l, (x, y)) in q.iter().zip(k).enumerate() {
                lanes[l] += x * y;
            }
            // SAFETY: as above.
            v = unsafe { _mm512_loadu_ps(lanes.as_ptr()) };
        }
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let v = _mm256_add_ps(lo, hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// As [`super::tiles_avx2::accumulate`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn accumulate(ctx: &mut [f32], p: &[f32], keys: &[f32]) {
        let w = ctx.len();
        assert_eq!(keys.len(), p.len() * w, "accumulate: key rows");
        let mut c = 0;
        while c + 128 <= w {
            // SAFETY: columns c..c + 128 lie in `ctx` and in every key row.
            unsafe {
                let cp = ctx.as_mut_ptr().add(c);
                let mut acc = [0, 1, 2, 3, 4, 5, 6, 7].map(|i| _mm512_loadu_ps(cp.add(16 * i)));
                for (k, &pk) in p.iter().enumerate() {
                    let pv = _mm512_set1_ps(pk);
                    let kp = keys.as_ptr().add(k * w + c);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(pv, _mm512_loadu_ps(kp.add(16 * i))));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(cp.add(16 * i), *a);
                }
            }
            c += 128;
        }
        while c + 16 <= w {
            // SAFETY: columns c..c + 16 lie in `ctx` and in every key row.
            unsafe {
                let cp = ctx.as_mut_ptr().add(c);
                let mut a = _mm512_loadu_ps(cp);
                for (k, &pk) in p.iter().enumerate() {
                    let kv = _mm512_loadu_ps(keys.as_ptr().add(k * w + c));
                    a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(pk), kv));
                }
                _mm512_storeu_ps(cp, a);
            }
            c += 16;
        }
        for (cc, o) in ctx.iter_mut().enumerate().skip(c) {
            for (k, &pk) in p.iter().enumerate() {
                *o += pk * keys[k * w + cc];
            }
        }
    }
}

#[inline(always)]
fn widen_row<E: CacheValue>(x: &[E], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.widen();
    }
}

/// `Σ w_c x_c` over a bf16 row, in the fixed order of [`latent_attention`]'s dot products.
///
/// # Panics
/// If the lengths differ.
pub fn dot_bf16_f32(w: &[bf16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_bf16_f32: lengths");
    dot_widened(w, x, |v| v.widen())
}

/// `Σ (s·q_c) x_c` over a row-int8 row with scale `s` (each weight dequantised as `s·q`, then
/// multiplied), in the fixed order of [`dot_bf16_f32`].
///
/// # Panics
/// If the lengths differ.
pub fn dot_i8_f32(q: &[i8], s: f32, x: &[f32]) -> f32 {
    assert_eq!(q.len(), x.len(), "dot_i8_f32: lengths");
    dot_widened(q, x, |v| s * v as f32)
}

/// `out_c += alpha · (s·q_c)` over a row-int8 row with scale `s`: each element on its own, so
/// every backend gives the same bits.
///
/// # Panics
/// If the lengths differ.
pub fn axpy_i8_f32(q: &[i8], s: f32, alpha: f32, out: &mut [f32]) {
    assert_eq!(q.len(), out.len(), "axpy_i8_f32: lengths");
    axpy_widened(q, alpha, out, |v| s * v as f32)
}

/// `out_c += alpha · w_c` over a bf16 row, element by element (the same bits on every backend).
///
/// # Panics
/// If the lengths differ.
pub fn axpy_bf16_f32(w: &[bf16], alpha: f32, out: &mut [f32]) {
    assert_eq!(w.len(), out.len(), "axpy_bf16_f32: lengths");
    axpy_widened(w, alpha, out, |v| v.widen())
}

crate::simd::simd_versions! {
    /// `out_c += alpha · widen(w_c)`, compiled for the selected backend.
    #[inline(always)]
    fn axpy_widened<T: Copy>(w: &[T], alpha: f32, out: &mut [f32], widen: impl Fn(T) -> f32) =
        axpy_widened_body;
}

#[inline(always)]
fn axpy_widened_body<T: Copy>(w: &[T], alpha: f32, out: &mut [f32], widen: impl Fn(T) -> f32) {
    for (a, &v) in out.iter_mut().zip(w) {
        *a += alpha * widen(v);
    }
}

crate::simd::simd_versions! {
    /// `Σ widen(w_c) x_c` in 16 lane sums and [`crate::kda_chunk::reduce_lanes`], compiled for
    /// the selected backend (the same operations, so the same bits, on each).
    #[inline(always)]
    fn dot_widened<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 = dot_widened_body;
}

#[inline(always)]
fn dot_widened_body<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let mut lanes = [0f32; 16];
    let (wc, xc) = (w.chunks_exact(16), x.chunks_exact(16));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..16 {
            lanes[l] += widen(a[l]) * b[l];
        }
    }
    for (l, (&a, b)) in wr.iter().zip(xr).enumerate() {
        lanes[l] += widen(a) * b;
    }
    crate::kda_chunk::reduce_lanes(lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_and_is_head_group_invariant() {
        let (heads, kvl, dr, n) = (4, 40, 8, 23);
        let v = |i: usize| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.7;
        let q_lat: Vec<f32> = (0..heads * kvl).map(v).collect();
        let q_tail: Vec<f32> = (0..heads * dr).map(|i| v(i + 7)).collect();
        let latent: Vec<bf16> = (0..n * kvl).map(|i| bf16::from_f32(v(i + 3))).collect();
        let tail: Vec<bf16> = (0..n * dr).map(|i| bf16::from_f32(v(i + 11))).collect();
        let scale = 0.3;
        let mut p = vec![0f32; heads * n];
        let mut ctx = vec![0f32; heads * kvl];
        latent_attention(
            &q_lat, &q_tail, &latent, &tail, heads, n, scale, &mut p, &mut ctx,
        );
        for hh in 0..heads {
            let sc: Vec<f64> = (0..n)
                .map(|s| {
                    let a: f64 = (0..kvl)
                        .map(|c| q_lat[hh * kvl + c] as f64 * latent[s * kvl + c].to_f64())
                        .sum();
                    let b: f64 = (0..dr)
                        .map(|c| q_tail[hh * dr + c] as f64 * tail[s * dr + c].to_f64())
                        .sum();
                    (a + b) * scale as f64
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            for c in 0..kvl {
                let want: f64 = (0..n)
                    .map(|s| (sc[s] - m).exp() / z * latent[s * kvl + c].to_f64())
                    .sum();
                let got = ctx[hh * kvl + c] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "head {hh} c {c}: {got} vs {want}"
                );
            }
            // One head alone gives the same bits as inside the group.
            let mut p1 = vec![0f32; n];
            let mut c1 = vec![0f32; kvl];
            latent_attention(
                &q_lat[hh * kvl..(hh + 1) * kvl],
                &q_tail[hh * dr..(hh + 1) * dr],
                &latent,
                &tail,
                1,
                n,
                scale,
                &mut p1,
                &mut c1,
            );
            assert_eq!(&c1[..], &ctx[hh * kvl..(hh + 1) * kvl]);
            assert_eq!(&p1[..], &p[hh * n..(hh + 1) * n]);
        }
    }

    /// The one-query form, written out plainly: each score a 16-lane dot product, the
    /// softmax of `ops::softmax_inplace`, each context element summed over the rows in order.
    fn one_query(
        q_lat: &[f32],
        q_tail: &[f32],
        latent: &[bf16],
        tail: &[bf16],
        n: usize,
        scale: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let (kvl, dr) = (q_lat.len(), q_tail.len());
        let w = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let mut p: Vec<f32> = (0..n)
            .map(|s| {
                let a = portable_dot(q_lat, &w(&latent[s * kvl..(s + 1) * kvl]), |v| v);
                let b = portable_dot(q_tail, &w(&tail[s * dr..(s + 1) * dr]), |v| v);
                (a + b) * scale
            })
            .collect();
        crate::ops::softmax_inplace(&mut p);
        let mut ctx = vec![0f32; kvl];
        for (s, &ps) in p.iter().enumerate() {
            for (a, b) in ctx.iter_mut().zip(w(&latent[s * kvl..(s + 1) * kvl])) {
                *a += ps * b;
            }
        }
        (p, ctx)
    }

    #[test]
    fn causal_blocks_give_every_query_the_one_query_bits() {
        let v = |i: usize| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.9;
        // (heads, kvl, dr, n0, queries): widths on and off the 16-lane and 32-column steps,
        // blocks shorter and longer than a key tile, one head and several.
        for &(heads, kvl, dr, n0, queries) in &[
            (8, 256, 32, 1, 40),
            (8, 64, 16, 37, 9),
            (3, 40, 8, 5, 21),
            (1, 17, 3, 1, 1),
            (5, 33, 7, 16, 17),
            (2, 96, 32, 100, 3),
            (4, 512, 64, 45, 20),
            (2, 72, 20, 3, 30),
        ] {
            let rows = heads * queries;
            let total = n0 + queries - 1;
            let q_lat: Vec<f32> = (0..rows * kvl).map(|i| v(i * 3 + 1)).collect();
            let q_tail: Vec<f32> = (0..rows * dr).map(|i| v(i + 7)).collect();
            let latent: Vec<bf16> = (0..total * kvl).map(|i| bf16::from_f32(v(i + 3))).collect();
            let tail: Vec<bf16> = (0..total * dr)
                .map(|i| bf16::from_f32(v(i * 5 + 11)))
                .collect();
            let scale = 0.37;
            let mut p = vec![0f32; rows * total];
            let mut ctx = vec![0f32; rows * kvl];
            causal_latent_attention(
                &q_lat, &q_tail, &latent, &tail, heads, queries, n0, scale, &mut p, &mut ctx,
            );
            // Every backend of this CPU (the register tiles on x86-64) gives the same bits.
            for be in crate::Backend::available() {
                let mut pb = vec![0f32; rows * total];
                let mut cb = vec![0f32; rows * kvl];
                causal_latent_attention_on(
                    be, &q_lat, &q_tail, &latent, &tail, heads, queries, n0, scale, &mut pb,
                    &mut cb,
                );
                let case = (be.name(), heads, kvl, dr, n0, queries);
                assert_eq!(pb, p, "{case:?}");
                assert_eq!(cb, ctx, "{case:?}");
            }
            for r in 0..rows {
                let n = n0 + r / heads;
                let (pw, cw) = one_query(
                    &q_lat[r * kvl..(r + 1) * kvl],
                    &q_tail[r * dr..(r + 1) * dr],
                    &latent,
                    &tail,
                    n,
                    scale,
                );
                let case = (heads, kvl, dr, n0, queries, r);
                assert_eq!(&p[r * total..r * total + n], &pw[..], "{case:?}");
                assert_eq!(&ctx[r * kvl..(r + 1) * kvl], &cw[..], "{case:?}");
            }
            // One query of the block alone, through the one-query entry.
            let i = queries - 1;
            let n = n0 + i;
            let mut p1 = vec![0f32; heads * n];
            let mut c1 = vec![0f32; heads * kvl];
            latent_attention(
                &q_lat[i * heads * kvl..],
                &q_tail[i * heads * dr..],
                &latent,
                &tail,
                heads,
                n,
                scale,
                &mut p1,
                &mut c1,
            );
            assert_eq!(&c1[..], &ctx[i * heads * kvl..]);
        }
    }

    #[test]
    fn bf16_dot_matches_portable_body() {
        let w: Vec<bf16> = (0..75)
            .map(|i| bf16::from_f32(i as f32 * 0.01 - 0.3))
            .collect();
        let x: Vec<f32> = (0..75).map(|i| (i as f32 * 0.37).sin()).collect();
        let want: f64 = w.iter().zip(&x).map(|(a, &b)| a.to_f64() * b as f64).sum();
        let got = dot_bf16_f32(&w, &x);
        assert!((got as f64 - want).abs() < 1e-5);
        assert_eq!(
            got.to_bits(),
            portable_dot(&w, &x, |v| v.to_f32()).to_bits()
        );
    }

    /// The lane order of [`dot_widened`] written out plainly.
    fn portable_dot<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 {
        let mut lanes = [0f32; 16];
        for (c, (&a, &b)) in w.iter().zip(x).enumerate() {
            lanes[c % 16] += widen(a) * b;
        }
        crate::kda_chunk::reduce_lanes(lanes)
    }

    #[test]
    fn int8_dot_and_the_axpys_match_the_portable_order() {
        for len in [1usize, 15, 16, 17, 75, 256] {
            let q: Vec<i8> = (0..len).map(|i| (i * 53 % 255) as i32 as i8).collect();
            let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let s = 0.0123f32;
            let want: f64 = q
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (s * a as f32) as f64 * b as f64)
                .sum();
            let got = dot_i8_f32(&q, s, &x);
            assert!((got as f64 - want).abs() < 1e-5, "{len}: {got} vs {want}");
            assert_eq!(
                got.to_bits(),
                portable_dot(&q, &x, |v| s * v as f32).to_bits(),
                "{len}"
            );
            let mut out: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let mut want = out.clone();
            for (a, &v) in want.iter_mut().zip(&q) {
                *a += -1.5 * (s * v as f32);
            }
            axpy_i8_f32(&q, s, -1.5, &mut out);
            assert_eq!(out, want, "{len}");
            let w: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut want = out.clone();
            for (a, &v) in want.iter_mut().zip(&w) {
                *a += 0.25 * v.to_f32();
            }
            axpy_bf16_f32(&w, 0.25, &mut out);
            assert_eq!(out, want, "{len}");
        }
    }
}
