//! Latent MoE (k3-model.md §4.6) and the expert-weight source.
//!
//! ```text
//! x_L = W_down y                                           D → Lr
//! h_e = W2_e · SiTU(W1_e x_L, W3_e x_L)   e ∈ I            MXFP4 experts, Lr → F → Lr
//! r   = Σ_{e ∈ I} w_e h_e                                  f32, in route order
//! R   = W_up · RMS_ε(r; routed_expert_norm)                Lr → D
//! Sh  = W_sd · SiTU(W_sg y, W_su y)                        fused shared experts
//! FFN(y) = R + Sh
//! ```

use crate::dims::ModelDims;
use crate::linear::{Linear, apply_group};
use crate::model::ModelError;
use crate::offload::DeviceExpertCache;
use crate::router::{Route, RouterWeights};
use crate::situ::SituMlp;
use deltafin_kernels::{
    GroupProduct, Weights, matmul, matmul_group, matmul_group_serial, matmul_serial,
    rms_norm_inplace, situ_glu,
};
use deltafin_tensor::Mxfp4Matrix;
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use deltafin_experts::rank_guesses;
pub use deltafin_experts::{ExpertError, ExpertSource, ExpertWeights};
use deltafin_experts::{PassRoutes, RouteObservers};

/// PILOT's guess for MoE layer `next_layer` from its router's routes on an earlier layer's
/// input: most confident first (a guess's best rank over the rows, then its votes), handed
/// to `experts` as a read hint. Values never depend on it.
fn predict_routes(experts: &dyn ExpertSource, next_layer: usize, guessed: &[Route]) {
    let guesses = rank_guesses(guessed.iter().map(|r| r.ids.as_slice()));
    experts.predict(next_layer, guessed.len(), &guesses);
}

/// PILOT across a dense layer: `router` (MoE layer `next_layer`'s) applied to `y` (`t`
/// rows), the dense layer's normalised input, when the source wants predictions. The MoE
/// path guesses inside [`MoeWeights::forward_with_pilot`] from its own FFN input; this one
/// starts the first MoE layer's reads before the dense layer ahead of it computes (at a
/// token boundary the disk is otherwise idle until the first MoE router has run). On the
/// `stream` preset the dense layer's input guesses layer 1 better than its FFN input does
/// (recall 77.7% against 72.1%, docs/PERFORMANCE.md).
pub(crate) fn predict_across_dense(
    dims: &ModelDims,
    experts: &dyn ExpertSource,
    next_layer: usize,
    router: &RouterWeights,
    y: &[f32],
    t: usize,
) {
    if experts.wants_prediction() {
        predict_routes(experts, next_layer, &router.route(dims, y, t));
    }
}

/// Check an expert's three shapes against the dimensions (`w1`, `w3` `[F, Lr]`, `w2` `[Lr, F]`).
pub fn validate_expert(
    w: &ExpertWeights,
    dims: &ModelDims,
    layer: usize,
    expert: usize,
) -> Result<(), ModelError> {
    w.check_shape(dims.moe_intermediate, dims.latent_size, layer, expert)
        .map_err(|m| ModelError::Shape {
            tensor: m.tensor,
            expected: m.expected,
            found: m.found,
        })
}

/// All experts held in memory: `layers[l][e]` (dense layers hold an empty list).
#[derive(Clone, Debug, Default)]
pub struct InMemoryExperts {
    /// Per layer, per expert id.
    pub layers: Vec<Vec<ExpertWeights>>,
}

impl ExpertSource for InMemoryExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.layers
            .get(layer)
            .and_then(|l| l.get(expert))
            .cloned()
            .ok_or_else(|| ExpertError::Unavailable {
                layer,
                expert,
                message: "not present in the in-memory expert set".into(),
            })
    }
}

/// The non-expert weights of one MoE layer (`model.layers.N.block_sparse_moe.*`).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `gate.weight` and `gate.e_score_correction_bias`.
    pub router: RouterWeights,
    /// `routed_expert_down_proj.weight` `[Lr, D]`.
    pub latent_down: Linear,
    /// `routed_expert_up_proj.weight` `[D, Lr]`.
    pub latent_up: Linear,
    /// `routed_expert_norm.weight` `[Lr]`.
    pub latent_norm: Vec<f32>,
    /// `shared_experts.{gate,up,down}_proj` (two experts fused, width Fs).
    pub shared: SituMlp,
}

impl MoeWeights {
    /// `t` rows of `y` (already normalised by `post_attention_layernorm`) through the MoE of
    /// layer `layer`. Tokens routed to the same expert are batched; each token's weighted sum
    /// runs in its route order, so a row's result does not depend on the batch.
    pub fn forward(
        &self,
        dims: &ModelDims,
        layer: usize,
        experts: &dyn ExpertSource,
        y: &[f32],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let observers = RouteObservers::default();
        self.forward_with_pilot(dims, layer, experts, &observers, y, t, None, None)
    }

    /// [`MoeWeights::forward`], first handing the pass's routes to `observers`, then telling
    /// `experts` the route union (each expert is then requested once, ascending, however many
    /// rows chose it) and, when the source wants predictions and `next` is given, PILOT's guess
    /// for the next MoE layer: `next` (that layer's router) applied to this layer's input `y`.
    /// The hints only schedule reads; the result is bit-identical with or without them. With
    /// `device`, the routed experts' products run on its device (`crate::offload`: each expert
    /// of the union is uploaded on this thread as it arrives, unless cached, before its
    /// products are handed to a task).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with_pilot(
        &self,
        dims: &ModelDims,
        layer: usize,
        experts: &dyn ExpertSource,
        observers: &RouteObservers,
        y: &[f32],
        t: usize,
        next: Option<(usize, &RouterWeights)>,
        device: Option<&DeviceExpertCache>,
    ) -> Result<Vec<f32>, ModelError> {
        let (lr, k) = (dims.latent_size, dims.experts_per_token);
        // The router and the latent down projection (and PILOT's guess for the next layer
        // when the source wants one) in one parallel region; the shared experts run later,
        // beside the routed ones, so expert reads start as early as possible.
        let sh = &self.shared;
        let pilot = next.filter(|_| experts.wants_prediction());
        let mut jobs = vec![
            (Weights::Bf16(&self.router.weight).into(), y),
            (self.latent_down.product(), y),
        ];
        if let Some((_, router)) = pilot {
            jobs.push((Weights::Bf16(&router.weight).into(), y));
        }
        let mut outs = apply_group(&jobs, t)?.into_iter();
        let (Some(logits), Some(xl)) = (outs.next(), outs.next()) else {
            unreachable!("apply_group returns one result per product")
        };
        let next_logits = outs.next();
        let routes = self.router.routes_from_logits(dims, &logits);

        // (token, slot) pairs per expert, experts visited in id order.
        let mut users: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (ti, r) in routes.iter().enumerate() {
            for (slot, &e) in r.ids.iter().enumerate() {
                users.entry(e).or_default().push((ti, slot));
            }
        }
        let union: Vec<usize> = users.keys().copied().collect();
        if !observers.is_empty() {
            let ids: Vec<usize> = routes.iter().flat_map(|r| r.ids.iter().copied()).collect();
            let weights: Vec<f32> = routes
                .iter()
                .flat_map(|r| r.weights.iter().copied())
                .collect();
            observers.observe(&PassRoutes {
                layer,
                k,
                ids: &ids,
                weights: &weights,
                union: &union,
            });
        }
        experts.begin_layer(layer, &union);
        if let (Some((next_layer, router)), Some(next_logits)) = (pilot, &next_logits) {
            predict_routes(
                experts,
                next_layer,
                &router.routes_from_logits(dims, next_logits),
            );
        }
        // Experts are requested in id order on this thread (a streaming source may block
        // on reads) and each one's products run as a pool task as soon as it is here, so
        // compute overlaps the remaining reads and small experts share the cores without a
        // fork/join per product. Each task computes exactly what a serial loop would.
        let slots: Vec<Mutex<Option<Vec<f32>>>> = users.iter().map(|_| Mutex::new(None)).collect();
        let xl = &xl;
        let mut fetch_err = None;
        let shared_act: Mutex<Option<Result<Vec<f32>, ModelError>>> = Mutex::new(None);
        // The first device error of an expert task (`device` only).
        let task_err: Mutex<Option<ModelError>> = Mutex::new(None);
        let task_err = &task_err;
        let threads = rayon::current_num_threads().max(1);
        // Up to two experts per worker are held by running or queued tasks, so a long
        // prefill's union never pins more than a few experts beyond the cache. Two, not one:
        // the CLI and the server run generation on a pool worker, so this loop's thread also
        // runs expert tasks (`InFlight::wait_for_slot`) and hands out none meanwhile; with
        // one per worker the other workers ran dry whenever it was busy (mini prefill on 2
        // threads: one worker took 60% of the samples, the other 38%, the expert products
        // 23.6% against 8.8%); with two a queued task is left for them.
        let in_flight = InFlight::new(2 * threads);
        // While at least one more expert per other worker is still to come, the expert
        // tasks fill the pool: an expert's products then run on its own task's thread,
        // without a fork/join per product (same values, see `matmul_serial`). The last ones
        // split their rows over the pool, so the layer does not end with one worker
        // computing a whole expert while the others wait.
        let serial_while = threads - 1;
        // With every expert already in memory (a source that does no I/O, no device) the
        // shared experts run last, after this thread has run its queued expert tasks: their
        // products are split over the pool, so a core that finishes its last routed expert
        // joins them instead of waiting for the other core's (measured on `mini`: the
        // layer's end left one core idle ≈ 0.65 ms a token). A streaming source keeps them
        // first, as a task computing while expert reads are still in flight.
        let shared_last = device.is_none() && experts.stats().is_none();
        let run_shared = || {
            let a = sh.activation(dims, y, t);
            if let Ok(mut s) = shared_act.lock() {
                *s = Some(a);
            }
        };
        // `in_place_scope`: from a thread outside the pool this loop stays on that thread,
        // which only fetches experts and sleeps while the slots are full; on a worker it is
        // the same as `rayon::scope`.
        rayon::in_place_scope(|scope| {
            if !shared_last {
                scope.spawn(|_| run_shared());
            }
            // Hits first, then misses as their reads complete (`next_ready`); each result
            // lands in its expert's slot, so the sum below keeps the fixed route order.
            let mut todo: Vec<_> = users.iter().zip(&slots).collect();
            let mut pending: Vec<usize> = union.clone();
            while !todo.is_empty() {
                in_flight.wait_for_slot();
                let next = experts.next_ready(layer, &pending).min(pending.len() - 1);
                pending.remove(next);
                let ((&e, list), slot) = todo.remove(next);
                let w = match experts
                    .expert(layer, e)
                    .map_err(ModelError::from)
                    .and_then(|w| validate_expert(&w, dims, layer, e).map(|()| w))
                {
                    Ok(w) => w,
                    Err(err) => {
                        fetch_err = Some(err);
                        break;
                    }
                };
                let on_device = match device.map(|c| c.get_or_upload(layer, e, &w)) {
                    None => None,
                    Some(Ok(d)) => Some(d),
                    Some(Err(err)) => {
                        fetch_err = Some(err);
                        break;
                    }
                };
                let held = in_flight.take();
                let serial = shared_last || (todo.len() >= serial_while && serial_while > 0);
                scope.spawn(move |_| {
                    // Released on every exit, a panic included (the scope re-raises it).
                    let _held = held;
                    let he = match (&on_device, device) {
                        (Some(d), Some(cache)) => {
                            drop(w);
                            match cache.expert_rows(dims, d, &gather(xl, list, lr), list.len()) {
                                Ok(he) => he,
                                Err(err) => {
                                    if let Ok(mut s) = task_err.lock() {
                                        s.get_or_insert(err);
                                    }
                                    return;
                                }
                            }
                        }
                        _ => {
                            let he = expert_rows(dims, &w, xl, list, serial);
                            drop(w);
                            he
                        }
                    };
                    if let Ok(mut s) = slot.lock() {
                        *s = Some(he);
                    }
                });
            }
            if shared_last && fetch_err.is_none() {
                // This thread's queued expert tasks first (newest first, while the other
                // workers take the oldest), then the shared experts over the whole pool.
                while rayon::yield_local() == Some(rayon::Yield::Executed) {}
                run_shared();
            }
        });
        if let Some(err) = fetch_err {
            return Err(err);
        }
        if let Some(err) = task_err.lock().ok().and_then(|mut s| s.take()) {
            return Err(err);
        }
        // Each expert's rows stay where its task left them; `at[ti·k + slot]` says which
        // expert result and row hold h_e for that token and slot (no t·k·Lr copy).
        let mut hes = Vec::with_capacity(users.len());
        let mut at = vec![(0usize, 0usize); t * k];
        for (u, ((e, list), slot)) in users.iter().zip(slots).enumerate() {
            let he = slot
                .into_inner()
                .ok()
                .flatten()
                .ok_or_else(|| ModelError::Layer {
                    layer,
                    message: format!("expert {e}: its worker produced no result"),
                })?;
            for (i, &(ti, slot)) in list.iter().enumerate() {
                at[ti * k + slot] = (u, i);
            }
            hes.push(he);
        }
        // r = Σ w_e h_e in route order, then the latent norm.
        let mut r = vec![0f32; t * lr];
        for (ti, route) in routes.iter().enumerate() {
            let rt = &mut r[ti * lr..(ti + 1) * lr];
            for (slot, &we) in route.weights.iter().enumerate() {
                let (u, i) = at[ti * k + slot];
                let he = &hes[u][i * lr..(i + 1) * lr];
                for (a, &b) in rt.iter_mut().zip(he) {
                    *a += we * b;
                }
            }
            rms_norm_inplace(rt, &self.latent_norm, dims.routed_expert_norm_eps);
        }
        // The latent up projection and the shared experts' down projection, together.
        let a = shared_act
            .into_inner()
            .ok()
            .flatten()
            .ok_or_else(|| ModelError::Layer {
                layer,
                message: "shared experts: their worker produced no result".into(),
            })??;
        let outs = apply_group(
            &[(self.latent_up.product(), &r), (sh.down_proj.product(), &a)],
            t,
        )?;
        let Ok([mut out, shared]) = <[Vec<f32>; 2]>::try_from(outs) else {
            unreachable!("apply_group returns one result per product")
        };
        for (o, s) in out.iter_mut().zip(&shared) {
            *o += s;
        }
        Ok(out)
    }
}

/// The experts held by running or queued tasks, at most `max` at a time.
struct InFlight {
    held: Mutex<usize>,
    freed: Condvar,
    max: usize,
}

impl InFlight {
    fn new(max: usize) -> InFlight {
        InFlight {
            held: Mutex::new(0),
            freed: Condvar::new(),
            max: max.max(1),
        }
    }

    fn count(&self) -> MutexGuard<'_, usize> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Return once fewer than `max` experts are held. A pool worker runs pending tasks
    /// meanwhile (it must not sleep: the tasks may need it); any other thread sleeps until
    /// a task releases its expert.
    fn wait_for_slot(&self) {
        if rayon::current_thread_index().is_some() {
            while *self.count() >= self.max {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            }
        } else {
            let mut held = self.count();
            while *held >= self.max {
                held = self
                    .freed
                    .wait(held)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    /// Hold one more expert until the returned guard drops.
    fn take(&self) -> Held<'_> {
        *self.count() += 1;
        Held(self)
    }
}

/// One expert held by a task; dropping it releases the slot.
struct Held<'a>(&'a InFlight);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        *self.0.count() -= 1;
        self.0.freed.notify_one();
    }
}

/// The latent rows of the tokens in `list` ((token, slot) pairs), `[list.len(), lr]`.
fn gather(xl: &[f32], list: &[(usize, usize)], lr: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(list.len() * lr);
    for &(ti, _) in list {
        x.extend_from_slice(&xl[ti * lr..(ti + 1) * lr]);
    }
    x
}

/// One expert over the latent rows of the tokens that chose it (`list`: (token, slot)
/// pairs): `W2 · SiTU(W1 x, W3 x)` per row, `[list.len(), Lr]`. With `serial` the three
/// products stay on the calling thread (bit-identical either way).
fn expert_rows(
    dims: &ModelDims,
    w: &ExpertWeights,
    xl: &[f32],
    list: &[(usize, usize)],
    serial: bool,
) -> Vec<f32> {
    let mm = |m: &Mxfp4Matrix, xs: &[f32], n: usize, ys: &mut [f32]| {
        if serial {
            matmul_serial(Weights::Mxfp4(m), xs, n, ys)
        } else {
            matmul(Weights::Mxfp4(m), xs, n, ys)
        }
    };
    let lr = dims.latent_size;
    let n = list.len();
    let f = w.w1.rows();
    let x = gather(xl, list, lr);
    let mut g = vec![0f32; n * f];
    let mut u = vec![0f32; n * f];
    // w1 and w3 read the same rows: one group, one activation image.
    let mut gate_up = [
        GroupProduct {
            w: Weights::Mxfp4(&w.w1),
            xs: &x,
            n,
            ys: &mut g,
        },
        GroupProduct {
            w: Weights::Mxfp4(&w.w3),
            xs: &x,
            n,
            ys: &mut u,
        },
    ];
    if serial {
        matmul_group_serial(&mut gate_up);
    } else {
        matmul_group(&mut gate_up);
    }
    let mut a = vec![0f32; n * f];
    situ_glu(&g, &u, dims.situ_beta, dims.situ_linear_beta, &mut a);
    let mut he = vec![0f32; n * lr];
    mm(&w.w2, &a, n, &mut he);
    he
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::router::tests::route64;
    use crate::situ::tests::situ_mlp64;
    use crate::test_util::{Rng, mv64, mv64_mx, rel_l2, rel_l2_32, rms64, situ64, to64};

    pub(crate) fn random_moe(rng: &mut Rng, dims: &ModelDims) -> MoeWeights {
        let (dm, lr, fs) = (dims.hidden_size, dims.latent_size, dims.shared_intermediate);
        MoeWeights {
            router: RouterWeights {
                weight: rng.bf16_matrix_scaled(dims.num_experts, dm, 2.0),
                bias: rng.vec(dims.num_experts, 0.2),
            },
            latent_down: rng.bf16_matrix(lr, dm).into(),
            latent_up: rng.bf16_matrix(dm, lr).into(),
            latent_norm: rng.around_one(lr, 0.2),
            shared: SituMlp {
                gate_proj: rng.bf16_matrix_scaled(fs, dm, 2.0).into(),
                up_proj: rng.bf16_matrix_scaled(fs, dm, 2.0).into(),
                down_proj: rng.bf16_matrix(dm, fs).into(),
            },
        }
    }

    pub(crate) fn random_experts(
        rng: &mut Rng,
        dims: &ModelDims,
        layers: usize,
    ) -> InMemoryExperts {
        let (f, lr) = (dims.moe_intermediate, dims.latent_size);
        InMemoryExperts {
            layers: (0..layers)
                .map(|l| {
                    if dims.ffn_kind(l) == crate::dims::FfnKind::Dense {
                        return Vec::new();
                    }
                    (0..dims.num_experts)
                        .map(|_| ExpertWeights {
                            w1: rng.mxfp4_matrix(f, lr),
                            w2: rng.mxfp4_matrix(lr, f),
                            w3: rng.mxfp4_matrix(f, lr),
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// f64 reference of the latent MoE for one row.
    pub(crate) fn moe64(
        m: &MoeWeights,
        dims: &ModelDims,
        layer: usize,
        experts: &InMemoryExperts,
        y: &[f64],
    ) -> Vec<f64> {
        let (b1, b2) = (dims.situ_beta as f64, dims.situ_linear_beta as f64);
        let (ids, w) = route64(&m.router, dims, y);
        let xl = mv64(&m.latent_down, y);
        let mut r = vec![0f64; dims.latent_size];
        for (&e, &we) in ids.iter().zip(&w) {
            let ex = &experts.layers[layer][e];
            let a = situ64(&mv64_mx(&ex.w1, &xl), &mv64_mx(&ex.w3, &xl), b1, b2);
            for (ri, hi) in r.iter_mut().zip(mv64_mx(&ex.w2, &a)) {
                *ri += we * hi;
            }
        }
        let rn = rms64(&r, &m.latent_norm, dims.routed_expert_norm_eps as f64);
        let mut out = mv64(&m.latent_up, &rn);
        for (o, s) in out.iter_mut().zip(situ_mlp64(&m.shared, y, b1, b2)) {
            *o += s;
        }
        out
    }

    #[test]
    fn matches_f64_and_is_batch_invariant() {
        let mut rng = Rng(23);
        let dims = crate::model::tests::tiny_dims();
        let m = random_moe(&mut rng, &dims);
        let ex = random_experts(&mut rng, &dims, 2);
        let dm = dims.hidden_size;
        let t = 9;
        let y = rng.vec(t * dm, 1.0);
        let out = m.forward(&dims, 1, &ex, &y, t).unwrap();
        for ti in 0..t {
            let row = &y[ti * dm..(ti + 1) * dm];
            let want = moe64(&m, &dims, 1, &ex, &to64(row));
            let e = rel_l2(&out[ti * dm..(ti + 1) * dm], &want);
            assert!(e < 1e-5, "row {ti}: {e}");
            let single = m.forward(&dims, 1, &ex, row, 1).unwrap();
            assert_eq!(rel_l2_32(&single, &out[ti * dm..(ti + 1) * dm]), 0.0);
        }
    }

    #[test]
    fn missing_or_misshapen_expert_is_an_error() {
        let mut rng = Rng(2);
        let dims = crate::model::tests::tiny_dims();
        let m = random_moe(&mut rng, &dims);
        let y = rng.vec(dims.hidden_size, 1.0);
        let empty = InMemoryExperts::default();
        let e = m.forward(&dims, 1, &empty, &y, 1).unwrap_err().to_string();
        assert!(e.contains("layer 1"), "{e}");
        let mut ex = random_experts(&mut rng, &dims, 2);
        for x in ex.layers[1].iter_mut() {
            x.w2 = x.w1.clone();
        }
        let e = m.forward(&dims, 1, &ex, &y, 1).unwrap_err().to_string();
        assert!(e.contains("experts.") && e.contains(".w2"), "{e}");
    }
}
