//! How a MoE layer's routed experts are obtained and run; the MoE block's math
//! (docs/K3.md §4.6) is in `crate::model::moe`, which calls this module for its expert outputs.
//!
//! The schedule decides only when and where work happens, never what is computed: each
//! expert is requested once, in the order the source has it ready; its products run as a
//! pool task as soon as it is here, so compute overlaps the remaining reads; at most a few
//! experts per worker are held in flight; with a device, each expert is uploaded (or found
//! cached) before its task runs there; the shared experts run first beside the reads, or
//! last over the whole pool when every expert is already in memory. PILOT read hints
//! (a later MoE layer's router on an earlier layer's input) tell a streaming source what
//! to read next. Each token's result is the same whatever the order.

use crate::model::ModelError;
use crate::model::device_experts::DeviceExpertCache;
use crate::model::router::{Route, RouterWeights};
use deltafin_experts::{ExpertSource, ExpertWeights, PassRoutes, RouteObservers, rank_guesses};
use deltafin_store::dims::ModelDims;
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Where a MoE layer's routed experts come from and how their products are scheduled.
#[derive(Clone, Copy)]
pub struct ExpertSchedule<'a> {
    /// The routed experts.
    pub experts: &'a dyn ExpertSource,
    /// What watches the routes (heat, router trace), told before the source.
    pub observers: Option<&'a RouteObservers>,
    /// PILOT: the next MoE layer and its router, applied to this layer's FFN input to
    /// guess that layer's experts (used when the source wants predictions).
    pub next: Option<(usize, &'a RouterWeights)>,
    /// Run the expert products on this device (`crate::model::offload`).
    pub device: Option<&'a DeviceExpertCache>,
}

impl<'a> ExpertSchedule<'a> {
    /// Experts from `experts`, products on the CPU, no read hints for a later layer.
    pub fn new(experts: &'a dyn ExpertSource) -> ExpertSchedule<'a> {
        ExpertSchedule {
            experts,
            observers: None,
            next: None,
            device: None,
        }
    }

    /// The router whose product on this layer's input makes PILOT's guess, when there is a
    /// next MoE layer and the source wants guesses.
    pub fn pilot(&self) -> Option<(usize, &'a RouterWeights)> {
        self.next.filter(|_| self.experts.wants_prediction())
    }

    /// Hand this pass's routes at `layer` to the observers, tell the source the experts it will request (the
    /// route union, each once, ascending), then PILOT's guess for the next layer from that
    /// layer's router logits `next_logits` (from [`Self::pilot`]'s router). Returns which
    /// tokens chose each expert.
    pub fn announce(
        &self,
        dims: &ModelDims,
        layer: usize,
        routes: &[Route],
        next_logits: Option<&[f32]>,
    ) -> ExpertUsers {
        // (token, slot) pairs per expert, experts visited in id order.
        let mut users: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (ti, r) in routes.iter().enumerate() {
            for (slot, &e) in r.ids.iter().enumerate() {
                users.entry(e).or_default().push((ti, slot));
            }
        }
        let union: Vec<usize> = users.keys().copied().collect();
        if let Some(observers) = self.observers.filter(|o| !o.is_empty()) {
            let ids: Vec<usize> = routes.iter().flat_map(|r| r.ids.iter().copied()).collect();
            let weights: Vec<f32> = routes
                .iter()
                .flat_map(|r| r.weights.iter().copied())
                .collect();
            observers.observe(&PassRoutes {
                layer,
                k: dims.experts_per_token,
                ids: &ids,
                weights: &weights,
                union: &union,
            });
        }
        let experts = self.experts;
        experts.begin_layer(layer, &union);
        if let (Some((next_layer, router)), Some(logits)) = (self.next, next_logits) {
            predict_routes(
                experts,
                next_layer,
                &router.routes_from_logits(dims, logits),
            );
        }
        ExpertUsers {
            users,
            rows: routes.len(),
        }
    }

    /// Every expert of `users` over the latent rows `xl` that chose it, and the shared
    /// experts' activation (`shared`) beside them. `expert(w, x, n, serial)` computes one
    /// expert's `n` gathered rows `x` on the CPU (on the calling thread with `serial`).
    pub fn run<S, E>(
        &self,
        dims: &ModelDims,
        layer: usize,
        users: &ExpertUsers,
        xl: &[f32],
        shared: S,
        expert: E,
    ) -> Result<(ExpertRows, Vec<f32>), ModelError>
    where
        S: Fn() -> Result<Vec<f32>, ModelError> + Sync,
        E: Fn(&ExpertWeights, &[f32], usize, bool) -> Vec<f32> + Sync,
    {
        let (lr, k) = (dims.latent_size, dims.experts_per_token);
        let (experts, device) = (self.experts, self.device);
        let users_map = &users.users;
        let expert = &expert;
        // Experts are requested in id order on this thread (a streaming source may block
        // on reads) and each one's products run as a pool task as soon as it is here, so
        // compute overlaps the remaining reads and small experts share the cores without a
        // fork/join per product. Each task computes exactly what a serial loop would.
        let slots: Vec<Mutex<Option<Vec<f32>>>> =
            users_map.iter().map(|_| Mutex::new(None)).collect();
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
            let a = shared();
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
            // lands in its expert's slot, so the weighted sum keeps the fixed route order.
            let mut todo: Vec<_> = users_map.iter().zip(&slots).collect();
            let mut pending: Vec<usize> = users_map.keys().copied().collect();
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
                            let he = expert(&w, &gather(xl, list, lr), list.len(), serial);
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
        let mut rows = Vec::with_capacity(users_map.len());
        let mut at = vec![(0usize, 0usize); users.rows * k];
        for (u, ((e, list), slot)) in users_map.iter().zip(slots).enumerate() {
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
            rows.push(he);
        }
        let shared =
            shared_act
                .into_inner()
                .ok()
                .flatten()
                .ok_or_else(|| ModelError::Layer {
                    layer,
                    message: "shared experts: their worker produced no result".into(),
                })??;
        Ok((ExpertRows { rows, at, k, lr }, shared))
    }
}

/// Which tokens chose each expert of one layer's pass: (token, route slot) pairs, experts
/// ascending.
pub struct ExpertUsers {
    users: BTreeMap<usize, Vec<(usize, usize)>>,
    /// Tokens in the pass.
    rows: usize,
}

/// The routed experts' outputs `h_e` of one pass, each expert's rows where its task left
/// them, addressed by token and route slot.
pub struct ExpertRows {
    rows: Vec<Vec<f32>>,
    /// `at[token·k + slot]`: (expert result, row) holding that token's slot.
    at: Vec<(usize, usize)>,
    k: usize,
    lr: usize,
}

impl ExpertRows {
    /// `h_e` (Lr values) of the expert in route slot `slot` of token `token`.
    #[inline]
    pub fn row(&self, token: usize, slot: usize) -> &[f32] {
        let (u, i) = self.at[token * self.k + slot];
        &self.rows[u][i * self.lr..(i + 1) * self.lr]
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

/// PILOT's guess for MoE layer `next_layer` from its router's routes on an earlier layer's
/// input: most confident first (a guess's best rank over the rows, then its votes), handed
/// to `experts` as a read hint. Values never depend on it.
fn predict_routes(experts: &dyn ExpertSource, next_layer: usize, guessed: &[Route]) {
    let guesses = rank_guesses(guessed.iter().map(|r| r.ids.as_slice()));
    experts.predict(next_layer, guessed.len(), &guesses);
}

/// PILOT across a dense layer: `router` (MoE layer `next_layer`'s) applied to `y` (`t`
/// rows), the dense layer's normalised input, when the source wants predictions. A MoE
/// layer guesses in [`ExpertSchedule::announce`] from its own FFN input; this one starts
/// the first MoE layer's reads before the dense layer ahead of it computes (at a token
/// boundary the disk is otherwise idle until the first MoE router has run). On the
/// `stream` preset the dense layer's input guesses layer 1 better than its FFN input does
/// (recall 77.7% against 72.1%, docs/PERFORMANCE.md).
pub fn predict_across_dense(
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
