//! The chunked KDA delta rule for one head (docs/K3.md §4.3, "Chunked prefill form").
//!
//! For a chunk of positions with incoming state `S₀` (row = key channel) and per-channel
//! cumulative log-decay `Γ_i = Σ_{s ≤ i} g_s` measured from the chunk start:
//!
//! ```text
//! A_ij = Σ_c k̂_ic k̂_jc e^{Γ_ic − Γ_jc}      B_ij = Σ_c q̂_ic k̂_jc e^{Γ_ic − Γ_jc}     (j < i)
//! u_i  = β_i (v_i − S₀ᵀ(e^{Γ_i} ⊙ k̂_i) − Σ_{j<i} A_ij u_j)        (forward substitution)
//! o_i  = S₀ᵀ(e^{Γ_i} ⊙ q̂_i) + Σ_{j≤i} B_ij u_j                   (B_ii = q̂_i · k̂_i)
//! S_C  = diag(e^{Γ_C}) S₀ + Σ_j (e^{Γ_C − Γ_j} ⊙ k̂_j) u_jᵀ
//! ```
//!
//! The pairwise decays `e^{Γ_i − Γ_j}` are never exponentiated pair by pair: the chunk is cut
//! into tiles of at most [`TILE`] positions over which every partial sum of `g` stays within
//! [`SPAN`] nats (FLA's `safe_gate` sub-chunking; with K3's `g ≥ −5` a tile is 16 rows), and
//! with `P_i` the sum of `g` from the tile start `b` to `i` and `D_j` the sum of `g` over
//! `j < s < b`:
//!
//! ```text
//! j in the tile:     e^{Γ_i − Γ_j} = e^{P_i} · e^{−P_j}      (both factors within e^{±SPAN})
//! j before the tile: e^{Γ_i − Γ_j} = e^{P_i} · e^{D_j}        (both factors ≤ 1)
//! ```
//!
//! so `A` and `B` are plain dot products of pre-scaled rows, and a chunk of `C` rows costs
//! `O(C·d)` exponentials instead of `O(C²·d)`. Every exponent is a sum of `g` over a range
//! accumulated directly (never a difference of two long cumulative sums). The products with
//! `S₀` run over blocks of rows so the state is read once per block, and the state update
//! visits each state row once per chunk. The dot products use a fixed 16-lane order, so the
//! result does not depend on the vector width of the backend that runs it.

/// Most positions in one tile of the pairwise decays.
pub const TILE: usize = 16;

/// Largest `|Σ g|` inside one tile (nats): `e^{80} ≈ 5.5·10³⁴` fits in f32 with room for the
/// dot products.
pub const SPAN: f32 = 80.0;

/// Rows of the `S₀ᵀ x` products computed per pass over the state.
const ROW_BLOCK: usize = 8;

/// One head's prepared rows for [`kda_chunked`]: row `i` of `q` is
/// `q[i·stride .. i·stride + d]` (likewise `k`, `v`, `g`), and its write strength is
/// `beta[i·beta_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct KdaRows<'a> {
    /// Normalised, scaled queries `q̂`.
    pub q: &'a [f32],
    /// Normalised keys `k̂`.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Log-decays `g ≤ 0` per channel.
    pub g: &'a [f32],
    /// Distance between consecutive rows of `q`, `k`, `v`, `g`.
    pub stride: usize,
    /// Write strengths `β`.
    pub beta: &'a [f32],
    /// Distance between consecutive rows' `β`.
    pub beta_stride: usize,
    /// Head dimension `d`.
    pub d: usize,
}

impl KdaRows<'_> {
    fn row<'b>(&self, x: &'b [f32], i: usize) -> &'b [f32] {
        &x[i * self.stride..i * self.stride + self.d]
    }
}

/// `t` rows of one head through the chunked delta rule (chunks of `chunk` rows), continuing
/// from the state `s` (`d × d`, row = key channel) and leaving the final state in it; the
/// outputs go to `o` (`t` rows of `d`).
///
/// # Panics
/// If `s.len() != d²`, `o.len() != t·d`, `chunk == 0`, or a row of `rows` lies outside its slice.
pub fn kda_chunked(s: &mut [f32], rows: &KdaRows<'_>, t: usize, chunk: usize, o: &mut [f32]) {
    let d = rows.d;
    assert_eq!(s.len(), d * d, "kda_chunked: state size");
    assert_eq!(o.len(), t * d, "kda_chunked: output length");
    assert!(chunk > 0, "kda_chunked: chunk length");
    if t == 0 {
        return;
    }
    let last = (t - 1) * rows.stride + d;
    for (n, len) in [
        ("q", rows.q.len()),
        ("k", rows.k.len()),
        ("v", rows.v.len()),
        ("g", rows.g.len()),
    ] {
        assert!(len >= last, "kda_chunked: {n} holds fewer than {t} rows");
    }
    assert!(
        rows.beta.len() > (t - 1) * rows.beta_stride,
        "kda_chunked: beta holds fewer than {t} rows"
    );
    kda_chunked_with(crate::settings::backend(), s, rows, t, chunk, o)
}

crate::simd::simd_versions! {
    /// [`kda_chunked`] compiled for `backend` (same operations, wider vectors).
    #[inline(always)]
    fn kda_chunked_with(backend, s: &mut [f32], rows: &KdaRows<'_>, t: usize, chunk: usize,
        o: &mut [f32]) = kda_chunked_body;
}

/// `x ← e^x` element-wise ([`crate::vmath`]: the same bits on every backend).
#[inline(always)]
fn exp_inplace(x: &mut [f32]) {
    crate::vmath::exp_inplace(x);
}

/// `Σ a_c b_c` in a fixed order: 16 lane sums, then a fixed pairwise reduction.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            lanes[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ar.iter().zip(br).enumerate() {
        lanes[l] += x * y;
    }
    reduce_lanes(lanes)
}

/// `lanes[0] + … + lanes[15]` in a fixed pairwise order.
#[inline(always)]
pub fn reduce_lanes(mut lanes: [f32; 16]) -> f32 {
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            lanes[l] += lanes[l + w];
        }
        w /= 2;
    }
    lanes[0]
}

/// `y += a · x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Scratch of one chunk, allocated once per call.
struct Scratch {
    /// `Γ_i` then `e^{Γ_i}`, `[C, d]`.
    eg: Vec<f32>,
    /// `e^{Γ_i} ⊙ k̂_i` (rows `0..C`) and `e^{Γ_i} ⊙ q̂_i` (rows `C..2C`).
    xs: Vec<f32>,
    /// `S₀ᵀ xs`, `[2C, d]`.
    sx: Vec<f32>,
    /// Column side of the current tile: `k̂_j ⊙ e^{D_j}` before it, `k̂_j ⊙ e^{−P_j}` in it.
    kj: Vec<f32>,
    /// `P_i` then `e^{P_i}` for the current tile's rows.
    ep: Vec<f32>,
    /// `A` and `B`, `[C, C]`.
    a: Vec<f32>,
    b: Vec<f32>,
    /// Pseudo values `u`, `[C, d]`.
    u: Vec<f32>,
    /// Row scratch (`k̂_i ⊙ e^{P_i}`, `q̂_i ⊙ e^{P_i}`, partial sums).
    ki: Vec<f32>,
    qi: Vec<f32>,
    sum: Vec<f32>,
}

#[inline(always)]
fn kda_chunked_body(s: &mut [f32], rows: &KdaRows<'_>, t: usize, chunk: usize, o: &mut [f32]) {
    let d = rows.d;
    let c = chunk.min(t);
    let mut w = Scratch {
        eg: vec![0.0; c * d],
        xs: vec![0.0; 2 * c * d],
        sx: vec![0.0; 2 * c * d],
        kj: vec![0.0; c * d],
        ep: vec![0.0; TILE * d],
        a: vec![0.0; c * c],
        b: vec![0.0; c * c],
        u: vec![0.0; c * d],
        ki: vec![0.0; d],
        qi: vec![0.0; d],
        sum: vec![0.0; d],
    };
    for c0 in (0..t).step_by(chunk) {
        let cl = chunk.min(t - c0);
        one_chunk(s, rows, c0, cl, &mut w, &mut o[c0 * d..(c0 + cl) * d]);
    }
}

/// One chunk of `cl` rows starting at row `c0`.
#[inline(always)]
fn one_chunk(
    s: &mut [f32],
    rows: &KdaRows<'_>,
    c0: usize,
    cl: usize,
    w: &mut Scratch,
    o: &mut [f32],
) {
    let d = rows.d;
    let q = |i: usize| rows.row(rows.q, c0 + i);
    let k = |i: usize| rows.row(rows.k, c0 + i);
    let g = |i: usize| rows.row(rows.g, c0 + i);
    let beta = |i: usize| rows.beta[(c0 + i) * rows.beta_stride];

    // Γ_i from the chunk start, then e^{Γ_i}.
    let eg = &mut w.eg[..cl * d];
    w.sum.fill(0.0);
    for (i, row) in eg.chunks_exact_mut(d).enumerate() {
        for ((x, acc), &gc) in row.iter_mut().zip(w.sum.iter_mut()).zip(g(i)) {
            *acc += gc;
            *x = *acc;
        }
    }
    exp_inplace(eg);

    // xs = [e^{Γ} ⊙ K̂; e^{Γ} ⊙ Q̂], sx = S₀ᵀ xs (row blocks share one pass over S₀).
    let (xk, xq) = w.xs[..2 * cl * d].split_at_mut(cl * d);
    for (i, (rk, rq)) in xk
        .chunks_exact_mut(d)
        .zip(xq.chunks_exact_mut(d))
        .enumerate()
    {
        let e = &eg[i * d..(i + 1) * d];
        for (((yk, yq), (&kc, &qc)), &ec) in rk
            .iter_mut()
            .zip(rq.iter_mut())
            .zip(k(i).iter().zip(q(i)))
            .zip(e)
        {
            *yk = ec * kc;
            *yq = ec * qc;
        }
    }
    let xs = &w.xs[..2 * cl * d];
    let sx = &mut w.sx[..2 * cl * d];
    sx.fill(0.0);
    for (xb, ab) in xs.chunks(ROW_BLOCK * d).zip(sx.chunks_mut(ROW_BLOCK * d)) {
        for (r, srow) in s.chunks_exact(d).enumerate() {
            for (xm, am) in xb.chunks_exact(d).zip(ab.chunks_exact_mut(d)) {
                axpy(am, xm[r], srow);
            }
        }
    }

    // A and B, tile by tile.
    let mut b0 = 0;
    while b0 < cl {
        // The tile [b0, e): P_i = Σ_{b0 ≤ s ≤ i} g_s while every |P| stays within SPAN.
        let ep = &mut w.ep;
        w.sum.fill(0.0);
        let mut e = b0;
        while e < cl && e - b0 < TILE {
            let row = &mut ep[(e - b0) * d..(e - b0 + 1) * d];
            let mut widest = 0f32;
            for ((x, acc), &gc) in row.iter_mut().zip(&w.sum).zip(g(e)) {
                *x = *acc + gc;
                widest = widest.max(x.abs());
            }
            if e > b0 && widest > SPAN {
                break;
            }
            w.sum.copy_from_slice(row);
            e += 1;
        }
        let n = e - b0;
        // Column side: D_j = Σ_{j < s < b0} g_s for j < b0 (≤ 0), −P_j in the tile.
        w.sum.fill(0.0);
        for j in (0..b0).rev() {
            let row = &mut w.kj[j * d..(j + 1) * d];
            if j + 1 < b0 {
                for (acc, &gc) in w.sum.iter_mut().zip(g(j + 1)) {
                    *acc += gc;
                }
            }
            row.copy_from_slice(&w.sum);
        }
        for (j, row) in w.kj[b0 * d..e * d].chunks_exact_mut(d).enumerate() {
            for (x, &p) in row.iter_mut().zip(&ep[j * d..(j + 1) * d]) {
                *x = -p;
            }
        }
        exp_inplace(&mut w.kj[..e * d]);
        exp_inplace(&mut ep[..n * d]);
        for (j, row) in w.kj[..e * d].chunks_exact_mut(d).enumerate() {
            for (x, &kc) in row.iter_mut().zip(k(j)) {
                *x *= kc;
            }
        }
        for i in b0..e {
            let epi = &ep[(i - b0) * d..(i - b0 + 1) * d];
            for (((yk, yq), (&kc, &qc)), &ec) in
                w.ki.iter_mut()
                    .zip(w.qi.iter_mut())
                    .zip(k(i).iter().zip(q(i)))
                    .zip(epi)
            {
                *yk = kc * ec;
                *yq = qc * ec;
            }
            for j in 0..i {
                let kjr = &w.kj[j * d..(j + 1) * d];
                w.a[i * cl + j] = dot(&w.ki, kjr);
                w.b[i * cl + j] = dot(&w.qi, kjr);
            }
            w.b[i * cl + i] = dot(q(i), k(i));
        }
        b0 = e;
    }

    // Forward substitution for u, then the outputs.
    let (sk, sq) = sx.split_at(cl * d);
    for i in 0..cl {
        let (done, rest) = w.u[..cl * d].split_at_mut(i * d);
        let ui = &mut rest[..d];
        for ((x, &vc), &sc) in ui
            .iter_mut()
            .zip(rows.row(rows.v, c0 + i))
            .zip(&sk[i * d..(i + 1) * d])
        {
            *x = vc - sc;
        }
        for (j, uj) in done.chunks_exact(d).enumerate() {
            let a = w.a[i * cl + j];
            for (x, &y) in ui.iter_mut().zip(uj) {
                *x -= a * y;
            }
        }
        let bi = beta(i);
        for x in ui.iter_mut() {
            *x *= bi;
        }
        let oi = &mut o[i * d..(i + 1) * d];
        oi.copy_from_slice(&sq[i * d..(i + 1) * d]);
        for (j, uj) in w.u[..(i + 1) * d].chunks_exact(d).enumerate() {
            axpy(oi, w.b[i * cl + j], uj);
        }
    }

    // S_C = diag(e^{Γ_C}) S₀ + Σ_j (e^{Γ_C − Γ_j} ⊙ k̂_j) u_jᵀ, one pass over the state rows;
    // the scaled keys reuse `kj` (row j: k̂_j ⊙ e^{Σ_{j < s < C} g_s}).
    w.sum.fill(0.0);
    for j in (0..cl).rev() {
        if j + 1 < cl {
            for (acc, &gc) in w.sum.iter_mut().zip(g(j + 1)) {
                *acc += gc;
            }
        }
        w.kj[j * d..(j + 1) * d].copy_from_slice(&w.sum);
    }
    exp_inplace(&mut w.kj[..cl * d]);
    for (j, row) in w.kj[..cl * d].chunks_exact_mut(d).enumerate() {
        for (x, &kc) in row.iter_mut().zip(k(j)) {
            *x *= kc;
        }
    }
    let eg_last = &eg[(cl - 1) * d..cl * d];
    for (r, srow) in s.chunks_exact_mut(d).enumerate() {
        let decay = eg_last[r];
        for x in srow.iter_mut() {
            *x *= decay;
        }
        for j in (0..cl).rev() {
            axpy(srow, w.kj[j * d + r], &w.u[j * d..(j + 1) * d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recurrence in f64, one token after another.
    fn recurrent64(s: &mut [f64], rows: &KdaRows<'_>, t: usize) -> Vec<f64> {
        let d = rows.d;
        let mut o = vec![0f64; t * d];
        for i in 0..t {
            let (q, k, v, g) = (
                rows.row(rows.q, i),
                rows.row(rows.k, i),
                rows.row(rows.v, i),
                rows.row(rows.g, i),
            );
            let beta = rows.beta[i * rows.beta_stride] as f64;
            let mut u: Vec<f64> = v.iter().map(|&x| x as f64).collect();
            for r in 0..d {
                let a = (g[r] as f64).exp();
                for c in 0..d {
                    s[r * d + c] *= a;
                    u[c] -= k[r] as f64 * s[r * d + c];
                }
            }
            for x in u.iter_mut() {
                *x *= beta;
            }
            for r in 0..d {
                for c in 0..d {
                    s[r * d + c] += k[r] as f64 * u[c];
                    o[i * d + c] += q[r] as f64 * s[r * d + c];
                }
            }
        }
        o
    }

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn unit_rows(rng: &mut Lcg, n: usize, d: usize, stride: usize) -> Vec<f32> {
        let mut x = vec![0f32; n * stride];
        for i in 0..n {
            let row = &mut x[i * stride..i * stride + d];
            for v in row.iter_mut() {
                *v = rng.next();
            }
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            for v in row.iter_mut() {
                *v /= norm;
            }
        }
        x
    }

    fn rel(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-300)).sqrt()
    }

    /// Chunked == recurrent (f64) for chunk lengths that do and do not divide `t`, strided
    /// rows, a non-zero incoming state, and gates from mild to the −5 bound (the strongest
    /// forces tiles shorter than 16 rows when `SPAN` would be exceeded).
    #[test]
    fn chunked_matches_f64_recurrence() {
        let (d, stride, t) = (32, 40, 75);
        for (lo, chunk) in [(-0.05f32, 64), (-5.0, 64), (-5.0, 7), (-12.0, 16)] {
            let mut rng = Lcg(7);
            let q = unit_rows(&mut rng, t, d, stride);
            let k = unit_rows(&mut rng, t, d, stride);
            let v: Vec<f32> = (0..t * stride).map(|_| rng.next()).collect();
            let g: Vec<f32> = (0..t * stride)
                .map(|_| lo * (rng.next() * 0.5 + 0.5))
                .collect();
            let beta: Vec<f32> = (0..t * 3).map(|_| rng.next() * 0.5 + 0.5).collect();
            let rows = KdaRows {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                stride,
                beta: &beta,
                beta_stride: 3,
                d,
            };
            let s0: Vec<f32> = (0..d * d).map(|_| rng.next() * 0.3).collect();
            let mut s = s0.clone();
            let mut o = vec![0f32; t * d];
            kda_chunked(&mut s, &rows, t, chunk, &mut o);
            let mut s64: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
            let o64 = recurrent64(&mut s64, &rows, t);
            let (eo, es) = (rel(&o, &o64), rel(&s, &s64));
            assert!(
                eo < 1e-5 && es < 1e-5,
                "g ≥ {lo}, chunk {chunk}: output {eo}, state {es}"
            );
            assert!(o.iter().chain(&s).all(|x| x.is_finite()));
        }
    }

    /// Every backend gives the same bits (fixed reduction order).
    #[test]
    fn backends_agree_bit_for_bit() {
        let (d, t) = (64, 40);
        let mut rng = Lcg(3);
        let q = unit_rows(&mut rng, t, d, d);
        let k = unit_rows(&mut rng, t, d, d);
        let v: Vec<f32> = (0..t * d).map(|_| rng.next()).collect();
        let g: Vec<f32> = (0..t * d)
            .map(|_| -2.0 * (rng.next() * 0.5 + 0.5))
            .collect();
        let beta: Vec<f32> = (0..t).map(|_| rng.next() * 0.5 + 0.5).collect();
        let rows = KdaRows {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            stride: d,
            beta: &beta,
            beta_stride: 1,
            d,
        };
        let s0: Vec<f32> = (0..d * d).map(|_| rng.next() * 0.3).collect();
        let (mut s1, mut o1) = (s0.clone(), vec![0f32; t * d]);
        kda_chunked(&mut s1, &rows, t, 16, &mut o1);
        let (mut s2, mut o2) = (s0, vec![0f32; t * d]);
        kda_chunked_body(&mut s2, &rows, t, 16, &mut o2);
        assert_eq!(o1, o2);
        assert_eq!(s1, s2);
    }
}
