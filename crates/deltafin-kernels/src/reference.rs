//! f32 CPU references for the GPU (CUDA and Metal) KDA and MLA kernels: line-by-line ports of the recurrent
//! step in `crates/deltafin-k3/src/model/kda.rs` and of `MlaWeights::attend` (one query token) in
//! `crates/deltafin-k3/src/model/mla.rs`, on plain slices. Used by the GPU tests and the doctor
//! canaries. Their `exp`/σ are [`crate::vmath`]'s, as in the model. (The products' reference
//! is [`crate::matmul`].)

use deltafin_tensor::bf16;

use crate::ops::softmax_inplace;

/// One KDA delta-rule step for one head: `S′ = diag(exp g) S`, `u = β (v − S′ᵀ k)`,
/// `S = S′ + k uᵀ`, returns `o = Sᵀ q`. `s` is `d × d` (row = key channel), updated in place.
pub fn kda_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32) -> Vec<f32> {
    let d = q.len();
    assert!(s.len() == d * d && k.len() == d && v.len() == d && g.len() == d);
    let mut u = v.to_vec();
    for r in 0..d {
        let alpha = crate::vmath::exp_one(g[r]);
        let row = &mut s[r * d..(r + 1) * d];
        for (x, ui) in row.iter_mut().zip(u.iter_mut()) {
            *x *= alpha;
            *ui -= k[r] * *x;
        }
    }
    for ui in u.iter_mut() {
        *ui *= beta;
    }
    let mut o = vec![0f32; d];
    for r in 0..d {
        let row = &mut s[r * d..(r + 1) * d];
        for ((x, &ui), oc) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
            *x += k[r] * ui;
            *oc += q[r] * *x;
        }
    }
    o
}

/// Absorbed MLA decode of one query over `n` cached tokens for `heads` heads; layouts as in
/// `kernels/cuda/mla.cu`. Returns the gated head outputs `[heads, v]`.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode(
    (heads, nope, rope, v, kvl): (usize, usize, usize, usize, usize),
    n: usize,
    q: &[f32],
    kvb: &[bf16],
    latent: &[bf16],
    tail: &[bf16],
    gate: &[f32],
) -> Vec<f32> {
    let (dn, dr, dv) = (nope, rope, v);
    let dq = dn + dr;
    assert!(q.len() == heads * dq && kvb.len() == heads * (dn + dv) * kvl);
    assert!(latent.len() == n * kvl && tail.len() == n * dr && gate.len() == heads * dv);
    let scale = 1.0 / (dq as f32).sqrt();
    let ld = |b: bf16| b.to_f32();
    let mut o = vec![0f32; heads * dv];
    for hh in 0..heads {
        let (qn, qt) = q[hh * dq..(hh + 1) * dq].split_at(dn);
        let rows = hh * (dn + dv);
        let mut q_lat = vec![0f32; kvl];
        for (i, &qi) in qn.iter().enumerate() {
            for (a, &b) in q_lat
                .iter_mut()
                .zip(&kvb[(rows + i) * kvl..(rows + i + 1) * kvl])
            {
                *a += qi * ld(b);
            }
        }
        let mut p = vec![0f32; n];
        for (s, ps) in p.iter_mut().enumerate() {
            let c = &latent[s * kvl..(s + 1) * kvl];
            let kt = &tail[s * dr..(s + 1) * dr];
            // The CPU path's fixed 16-lane order (`crate::attn`), so the two agree bit for bit.
            let acc = crate::attn::dot_bf16_f32(c, &q_lat);
            let acc_t = crate::attn::dot_bf16_f32(kt, qt);
            *ps = (acc + acc_t) * scale;
        }
        softmax_inplace(&mut p);
        let mut ctx = vec![0f32; kvl];
        for (s, &ps) in p.iter().enumerate() {
            for (a, &b) in ctx.iter_mut().zip(&latent[s * kvl..(s + 1) * kvl]) {
                *a += ps * ld(b);
            }
        }
        for j in 0..dv {
            let r = &kvb[(rows + dn + j) * kvl..(rows + dn + j + 1) * kvl];
            let val = crate::attn::dot_bf16_f32(r, &ctx);
            let gj = gate[hh * dv + j];
            o[hh * dv + j] = val * crate::vmath::sigmoid_one(gj);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kda_step_by_hand() {
        // d = 2, S = I, g = 0 (α = 1), k = e0, v = (1, 2), β = 0.5, q = (1, 1):
        // u = 0.5 · ((1, 2) − Sᵀe0) = (0, 1);  S = I + e0 (0, 1)ᵀ = [[1, 1], [0, 1]];
        // o = Sᵀ q = (1, 2).
        let mut s = vec![1.0, 0.0, 0.0, 1.0];
        let o = kda_step(
            &mut s,
            &[1.0, 1.0],
            &[1.0, 0.0],
            &[1.0, 2.0],
            &[0.0, 0.0],
            0.5,
        );
        assert_eq!(o, vec![1.0, 2.0]);
        assert_eq!(s, vec![1.0, 1.0, 0.0, 1.0]);
        // A log-decay of ln 0.5 halves the state before the update.
        let mut s = vec![2.0, 0.0, 0.0, 2.0];
        let g = [0.5f32.ln(); 2];
        let o = kda_step(&mut s, &[0.0, 1.0], &[0.0, 0.0], &[0.0, 0.0], &g, 1.0);
        assert!((o[1] - 1.0).abs() < 1e-6 && o[0].abs() < 1e-6, "{o:?}");
    }

    #[test]
    fn mla_with_one_token_is_the_gated_value_projection_of_its_latent() {
        // n = 1: softmax is 1, so ctx = ĉ(0) and o_j = (B^V_j · ĉ(0)) · σ(g_j).
        let (h, dn, dr, dv, kvl) = (2, 2, 1, 2, 4);
        let b = |x: f32| bf16::from_f32(x);
        let kvb: Vec<bf16> = (0..h * (dn + dv) * kvl)
            .map(|i| b((i % 5) as f32 - 2.0))
            .collect();
        let latent: Vec<bf16> = [1.0, -1.0, 0.5, 2.0].map(b).to_vec();
        let tail = vec![b(3.0)];
        let q: Vec<f32> = (0..h * (dn + dr)).map(|i| i as f32 * 0.3).collect();
        let gate = vec![0.0, 1.0, -1.0, 2.0];
        let o = mla_decode((h, dn, dr, dv, kvl), 1, &q, &kvb, &latent, &tail, &gate);
        for hh in 0..h {
            for j in 0..dv {
                let r = (hh * (dn + dv) + dn + j) * kvl;
                let dot: f32 = (0..kvl)
                    .map(|c| kvb[r + c].to_f32() * latent[c].to_f32())
                    .sum();
                let g = gate[hh * dv + j];
                let want = dot / (1.0 + (-g).exp());
                assert!((o[hh * dv + j] - want).abs() < 1e-5, "{hh} {j}");
            }
        }
    }
}
