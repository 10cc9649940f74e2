//! How a forward pass runs, besides its math: the entry points of [`K3Model`] and the
//! `PassHooks` the layer loop (`crate::model`) calls.
//!
//! - **Spine streaming** (a [`crate::model::spine::StreamedSpine`]): a streamed layer's
//!   projections are read before the layer runs, the next one's read starting meanwhile.
//! - **PILOT** read hints: a MoE layer's experts are guessed from an earlier input, across
//!   the dense layer 0 and across the token boundary (the provisional head,
//!   `crate::model::next_token`), so a streaming source reads them early.
//! - **The experts' schedule** (`crate::model::moe_schedule`): the source, the device, the next
//!   MoE layer's router.
//! - **Taps** (`crate::model::taps`): `P` after chosen layers, for drafters.
//! - **The layer profile** (`crate::model::profile`): each layer's phase times, when the model
//!   has a sink for them.
//!
//! None of it changes a value: the logits are the loop's whatever the hooks do.

use crate::error::ModelError;
use crate::model::forward::{K3Model, LogitRows, Logits, PassHooks, Segment};
use crate::model::kda::KdaForm;
use crate::model::layer::{Attention, Ffn, Layer};
use crate::model::moe_schedule::{ExpertSchedule, predict_across_dense};
use crate::model::next_token::ProvisionalHead;
use crate::model::norm::rms_norm_rows_new;
use crate::model::profile::PassClock;
use crate::model::router::RouterWeights;
use crate::model::spine::SpineLayers;
use crate::model::state::State;
use crate::model::taps::Taps;
use std::sync::atomic::{AtomicBool, Ordering};

/// What a watched pass ([`K3Model::forward_watched`]) reports and obeys between layers.
#[derive(Default)]
pub struct Watch<'a> {
    /// Checked before each layer: once raised, the pass stops with
    /// [`ModelError::Interrupted`] (the state is then partially advanced: discard it).
    pub interrupt: Option<&'a AtomicBool>,
    /// Called after each layer with its index (progress within a long pass).
    pub on_layer: Option<&'a mut dyn FnMut(usize)>,
}

impl K3Model {
    /// Run `tokens` (appended to the sequence in `state`) through the model and return the
    /// requested logit rows. The whole input is processed batched per layer (chunked KDA,
    /// batched MLA); a single token takes the recurrent KDA path.
    ///
    /// On an error from the expert source the state is partially advanced and must be
    /// discarded; input errors (empty input, token out of range, mismatched state) are
    /// reported before anything changes.
    pub fn forward(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
    ) -> Result<Logits, ModelError> {
        self.execute(state, tokens, want, KdaForm::Chunked, None)
    }

    /// Like [`Self::forward`], but KDA runs its recurrent form token by token, so row `i` is
    /// bit-identical to the logits of the `i`-th of `tokens.len()` single-token
    /// [`Self::decode`] calls (matrix products, MLA, MoE and AttnRes are row-invariant). This
    /// is the speculative-verification pass.
    pub fn forward_exact(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
    ) -> Result<Logits, ModelError> {
        self.execute(state, tokens, want, KdaForm::Recurrent, None)
    }

    /// [`Self::forward`] that also appends, per input position, the bf16-rounded partial sum
    /// `P` after each of `taps`' layers (docs/K3.md §9.3). The logits are unchanged.
    pub fn forward_tapped(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        taps: &mut Taps,
    ) -> Result<Logits, ModelError> {
        self.execute(state, tokens, want, KdaForm::Chunked, Some(taps))
    }

    /// [`Self::forward_exact`] with taps, as [`Self::forward_tapped`].
    pub fn forward_exact_tapped(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        taps: &mut Taps,
    ) -> Result<Logits, ModelError> {
        self.execute(state, tokens, want, KdaForm::Recurrent, Some(taps))
    }

    /// [`Self::forward`] (with taps when given) that stops between layers once
    /// `watch.interrupt` is raised and reports each finished layer to `watch.on_layer`: a
    /// long prefill pass that can be cancelled and shown. The logits are [`Self::forward`]'s.
    pub fn forward_watched(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        taps: Option<&mut Taps>,
        watch: Watch<'_>,
    ) -> Result<Logits, ModelError> {
        let mut hooks = Execution {
            model: self,
            taps,
            spine: None,
            watch,
            clock: None,
        };
        self.run_layers(state, tokens, want, KdaForm::Chunked, &mut hooks)
    }

    /// Several sequences in one pass: each [`Segment`]'s tokens are appended to its own
    /// state, and its requested logit rows come back in order. Every weight matrix and every
    /// routed expert is read once for all rows (the experts' reads are the union of the
    /// segments' routes); attention runs per sequence on its own cache. A segment's logits
    /// and final state are bit-identical to running it alone ([`Self::forward`] for
    /// [`KdaForm::Chunked`], [`Self::forward_exact`] for [`KdaForm::Recurrent`]), whatever
    /// else is in the batch.
    ///
    /// Input errors (an empty batch or segment, a token out of range, a mismatched state)
    /// are reported before any state changes; on a later error every segment's state is
    /// partially advanced and must be discarded.
    pub fn forward_batch(&self, segments: &mut [Segment<'_>]) -> Result<Vec<Logits>, ModelError> {
        let mut hooks = Execution {
            model: self,
            taps: None,
            spine: None,
            watch: Watch::default(),
            clock: None,
        };
        self.run_segments(segments, &mut hooks)
    }

    /// Process a prompt; returns the logits of its last position.
    pub fn prefill(&self, state: &mut State, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward(state, tokens, LogitRows::Last)?.values)
    }

    /// Process one token; returns its logits.
    pub fn decode(&self, state: &mut State, token: u32) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward(state, &[token], LogitRows::Last)?.values)
    }

    /// A tap collector for this model's layers `layer_ids`.
    pub fn taps(&self, layer_ids: &[usize]) -> Result<Taps, ModelError> {
        Taps::new(layer_ids, self.layers.len(), self.dims.hidden_size)
    }

    /// The provisional next-token rows (`crate::model::next_token`), once a pass has built them:
    /// `Err` names why they could not be gathered (the guess is then skipped).
    pub fn provisional_head(&self) -> Option<Result<&ProvisionalHead, &str>> {
        self.provisional.built()
    }

    /// How often the provisional next token was the token the next pass began with:
    /// `(right, judged)` (`--stats`). With several sequences on one model a guess made at
    /// the end of one sequence's pass is judged against whichever pass comes next.
    pub fn provisional_accuracy(&self) -> (u64, u64) {
        self.provisional.accuracy()
    }

    fn execute(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        kda_form: KdaForm,
        taps: Option<&mut Taps>,
    ) -> Result<Logits, ModelError> {
        let mut hooks = Execution {
            model: self,
            taps,
            spine: None,
            watch: Watch::default(),
            clock: None,
        };
        self.run_layers(state, tokens, want, kda_form, &mut hooks)
    }
}

/// The engine's hooks for one pass of `model`.
struct Execution<'m, 't, 'w> {
    model: &'m K3Model,
    taps: Option<&'t mut Taps>,
    /// The pass over the streamed layers (spine streaming only); dropped with the pass.
    spine: Option<Box<dyn SpineLayers + 'm>>,
    /// Interrupt and per-layer progress ([`K3Model::forward_watched`]).
    watch: Watch<'w>,
    /// The pass's clock when the model has a layer profile.
    clock: Option<PassClock>,
}

impl<'m> Execution<'m, '_, '_> {
    /// PILOT's next target after layer `l`: layer `l + 1` when it is MoE, with its router
    /// (always resident, also for a streamed layer).
    fn next_router(&self, l: usize) -> Option<(usize, &'m RouterWeights)> {
        match self.model.layers.get(l + 1).map(|x| &x.ffn) {
            Some(Ffn::Moe(m)) => Some((l + 1, &m.router)),
            _ => None,
        }
    }

    /// PILOT across the token boundary (`crate::model::next_token`): before `lm_head` runs on the
    /// last position's normalised row `x`, guess the next pass's first MoE layer from a
    /// provisional token, so its reads overlap `lm_head`. Only for an expert source that
    /// wants guesses, a resident layer 0 that is dense and a layer 1 that is MoE (K3's
    /// schedule).
    fn guess_next_token_routes(&self, x: &[f32]) {
        let model = self.model;
        let experts = model.experts.as_ref();
        if model.spine_stream.is_some() || !experts.wants_prediction() {
            return;
        }
        let (Some(first), Some(Ffn::Moe(next))) =
            (model.layers.first(), model.layers.get(1).map(|l| &l.ffn))
        else {
            return;
        };
        if !matches!(first.ffn, Ffn::Dense(_)) {
            return;
        }
        let Some(token) = model
            .provisional
            .head(&model.lm_head)
            .and_then(|h| h.token(x))
        else {
            return;
        };
        model.provisional.guessed(token);
        let d = &model.dims;
        let e = model.embed.row_f32(token as usize);
        let y = rms_norm_rows_new(&e, &first.input_layernorm, d.rms_norm_eps);
        predict_across_dense(d, experts, 1, &next.router, &y, 1);
    }
}

impl PassHooks for Execution<'_, '_, '_> {
    fn begin(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        let model = self.model;
        if let Some(&first) = tokens.first() {
            model.provisional.judge(first);
        }
        if let Some(tp) = self.taps.as_deref_mut() {
            tp.begin(tokens.len());
        }
        if let Some(s) = &model.spine_stream {
            self.spine = Some(s.begin_pass()?);
        }
        if model.layer_profile.is_some() {
            self.clock = Some(PassClock::new(tokens.len()));
        }
        Ok(())
    }

    fn layer_weights(&mut self, l: usize, own: &Layer) -> Result<Option<Layer>, ModelError> {
        if self
            .watch
            .interrupt
            .is_some_and(|i| i.load(Ordering::Relaxed))
        {
            return Err(ModelError::Interrupted);
        }
        if let Some(c) = self.clock.as_mut() {
            c.layer_started();
        }
        let weights = match self.spine.as_mut() {
            Some(pass) => pass.layer(l, own),
            None => Ok(None),
        };
        if let Some(c) = self.clock.as_mut() {
            c.weights_ready();
        }
        weights
    }

    fn layer_input(&mut self, l: usize, layer: &Layer, x: &[f32], t: usize) {
        // PILOT for the MoE layer after a dense one, from the dense layer's input: its
        // reads start before this layer's attention and MLP.
        if let (Ffn::Dense(_), Some((next, router))) = (&layer.ffn, self.next_router(l)) {
            let m = self.model;
            predict_across_dense(&m.dims, m.experts.as_ref(), next, router, x, t);
        }
        if let Some(c) = self.clock.as_mut() {
            c.attention_started();
        }
    }

    fn attention_done(&mut self, _l: usize) {
        if let Some(c) = self.clock.as_mut() {
            c.attention_done();
        }
    }

    fn experts(&self, l: usize) -> ExpertSchedule<'_> {
        ExpertSchedule {
            experts: self.model.experts.as_ref(),
            observers: Some(&self.model.route_observers),
            next: self.next_router(l),
            device: self.model.device_experts.as_deref(),
        }
    }

    fn layer_output(&mut self, l: usize, p: &[f32]) {
        let model = self.model;
        if let (Some(c), Some(sink), Some(layer)) = (
            self.clock.as_ref(),
            model.layer_profile.as_ref(),
            model.layers.get(l),
        ) {
            let kinds = (
                match layer.attn {
                    Attention::Kda(_) => "kda",
                    Attention::Mla(_) => "mla",
                },
                match layer.ffn {
                    Ffn::Dense(_) => "dense",
                    Ffn::Moe(_) => "moe",
                },
            );
            sink(&c.layer_done(l, model.layers.len(), kinds));
        }
        if let Some(tp) = self.taps.as_deref_mut() {
            tp.record(l, p);
        }
        if let Some(f) = self.watch.on_layer.as_mut() {
            f(l);
        }
    }

    fn head_input(&mut self, x: &[f32], rows: usize) {
        if rows == 1 {
            self.guess_next_token_routes(x);
        }
    }
}
