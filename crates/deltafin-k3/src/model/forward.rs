//! The K3 text model: embedding, the layer loop with Attention Residuals (docs/K3.md §4.2),
//! and the output head (§4.9).
//!
//! Activations are f32 throughout; bf16/MXFP4 weights are widened to f32 with f32
//! accumulation (docs/K3.md §5.3 #7, the llama.cpp policy).
//!
//! ```text
//! P ← E[token];  S ← []
//! for l:
//!     a ← P if S = [] else AR(P; S; attn_res_l)
//!     if l mod block = 0: S.push(P); P ← ∅
//!     o ← Attn_l(RMS(a; input_layernorm_l));   P ← o if P = ∅ else P + o
//!     m ← AR(P; S; mlp_res_l)
//!     P ← P + FFN_l(RMS(m; post_attention_layernorm_l))
//! logits ← lm_head · RMS(AR(P; S; output_res); norm)
//! ```
//!
//! The loop (`K3Model::run_layers`) is only this math; what a pass does besides it (spine
//! reads, read hints, taps, the experts' schedule) happens in `PassHooks` it calls at
//! fixed points. The entry points ([`K3Model::forward`], [`K3Model::decode`], …) and the
//! engine's hooks are in `crate::exec`.

use crate::error::ModelError;
use crate::model::attn_res::AttnResWeights;
use crate::model::finite;
use crate::model::kda::KdaForm;
use crate::model::layer::{Attention, Ffn, Layer};
use crate::model::linear::Linear;
use crate::model::mla::MlaCache;
use crate::model::moe::{ExpertSchedule, ExpertSource};
use crate::model::norm::rms_norm_rows_new;
use crate::model::situ::SituMlp;
use crate::model::state::{LayerState, State};
use deltafin_store::dims::{AttnKind, CacheDtype, FfnKind, ModelDims};
use deltafin_store::inventory::{self, StoredShape, name};
use deltafin_tensor::{Bf16Matrix, DType};

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last input position.
    Last,
    /// Every input position (perplexity, speculative verification).
    All,
    /// No row: the pass only advances the state (a prefill chunk before the last one);
    /// `lm_head` does not run.
    None,
}

/// Logits, `rows × vocab`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    /// Number of rows.
    pub rows: usize,
    /// Vocabulary size (row width).
    pub vocab: usize,
    /// The values.
    pub values: Vec<f32>,
}

impl Logits {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.vocab..(i + 1) * self.vocab]
    }
    /// The last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.rows - 1)
    }
}

/// One sequence's part of a batched pass ([`K3Model::forward_batch`]): its state, the tokens
/// appended to it, and which of their logit rows it wants.
pub struct Segment<'s> {
    /// The sequence's state, advanced by `tokens`.
    pub state: &'s mut State,
    /// The tokens appended (at least one).
    pub tokens: &'s [u32],
    /// Which of their rows' logits are returned.
    pub want: LogitRows,
    /// How KDA runs the rows: [`KdaForm::Chunked`] as [`K3Model::forward`] (a prompt chunk),
    /// [`KdaForm::Recurrent`] as [`K3Model::forward_exact`] (a verification). One row always
    /// takes the recurrent step.
    pub kda_form: KdaForm,
}

/// The K3 text model. Build with [`K3Model::new`], which validates every shape.
pub struct K3Model {
    /// Dimensions and constants.
    pub dims: ModelDims,
    /// `model.embed_tokens.weight` `[vocab, D]`.
    pub embed: Bf16Matrix,
    /// Decoder layers.
    pub layers: Vec<Layer>,
    /// `model.norm.weight` `[D]`.
    pub norm: Vec<f32>,
    /// `model.output_attn_res_norm.weight` / `model.output_attn_res_proj.weight`.
    pub output_res: AttnResWeights,
    /// `lm_head.weight` `[vocab, D]` (untied).
    pub lm_head: Linear,
    /// Routed experts of every MoE layer.
    pub experts: Box<dyn ExpertSource>,
    /// What watches every MoE pass's routes (heat histogram, router trace), called before
    /// the pass's route union reaches `experts`.
    pub route_observers: deltafin_experts::RouteObservers,
    /// Spine streaming (`crate::weights::spine_stream`): when set, the layers it streams take their
    /// projections from per-pass reads instead of `layers[l]`'s own (unread) views.
    pub spine_stream: Option<Box<dyn super::spine::StreamedSpine>>,
    /// Routed experts on a device (`crate::model::offload`, `--expert-backend cuda`): when set, the
    /// MoE layers run their expert products there.
    pub device_experts: Option<std::sync::Arc<super::device_experts::DeviceExpertCache>>,
    /// What [`K3Model::copy_spine_to_huge_pages`] copied at load, if it ran
    /// (`crate::weights::resident`).
    pub resident_copy: Option<super::spine::ResidentCopy>,
    /// The provisional next-token rows of `lm_head` (`crate::model::next_token`), built at the first
    /// pass that can use them (an expert source that wants PILOT guesses), and how often
    /// their token was the next pass's first.
    pub(crate) provisional: crate::model::next_token::Provisional,
    /// When set, every pass reports each layer's phase times to it (`crate::model::profile`,
    /// `deltafin run --layer-profile`); timing only.
    pub layer_profile: Option<crate::model::profile::LayerProfile>,
}

/// What a forward pass does besides the math, called by `K3Model::run_layers` at fixed
/// points of the layer loop: spine reads, read hints, observation, the experts' schedule.
/// No hook changes a value. The engine's hooks are `crate::model::exec`'s.
pub(crate) trait PassHooks {
    /// A pass over `tokens` (checked, not yet embedded) begins.
    fn begin(&mut self, tokens: &[u32]) -> Result<(), ModelError>;
    /// Layer `l`'s weights when they are not `own` (the model's entry): a streamed layer's.
    fn layer_weights(&mut self, l: usize, own: &Layer) -> Result<Option<Layer>, ModelError>;
    /// `x`: layer `l`'s normalised input (`t` rows), before its attention runs.
    fn layer_input(&mut self, l: usize, layer: &Layer, x: &[f32], t: usize);
    /// Layer `l`'s attention is done; its MLP or MoE comes next.
    fn attention_done(&mut self, l: usize);
    /// How MoE layer `l`'s routed experts are obtained and run.
    fn experts(&self, l: usize) -> ExpertSchedule<'_>;
    /// `p`: `P` after layer `l`.
    fn layer_output(&mut self, l: usize, p: &[f32]);
    /// `x`: the normalised rows (`rows` of them) that `lm_head` multiplies next.
    fn head_input(&mut self, x: &[f32], rows: usize);
}

/// A matrix shape the model checks: a [`Bf16Matrix`] or a [`Linear`].
trait Shaped {
    fn shape(&self) -> (usize, usize);
}

impl Shaped for Bf16Matrix {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }
}

impl Shaped for Linear {
    fn shape(&self) -> (usize, usize) {
        (self.rows(), self.cols())
    }
}

/// A weight as the model holds it: a matrix, or a vector widened to f32 (whatever the rank
/// of its stored shape).
#[derive(Clone, Copy, Debug)]
enum Held {
    Matrix(usize, usize),
    Vector(usize),
}

fn matrix(m: &impl Shaped) -> Held {
    let (r, c) = m.shape();
    Held::Matrix(r, c)
}

fn vector(v: &[f32]) -> Held {
    Held::Vector(v.len())
}

/// The inventory's entries `expected` (names under `prefix`) against the weights the model
/// `held` under the same names: one for one, a matrix of the stored shape, a vector of as
/// many values (of a zero-padded vector, as many as are used: `A_log` holds one per head).
fn check_against(
    dims: &ModelDims,
    prefix: &str,
    expected: &[(String, Vec<usize>, DType)],
    held: &[(&str, Held)],
) -> Result<(), ModelError> {
    for (name, stored, _) in expected {
        let found = name
            .strip_prefix(prefix)
            .and_then(|short| held.iter().find(|(n, _)| *n == short));
        let Some(&(_, h)) = found else {
            return Err(ModelError::Dims(format!(
                "the model holds no weight for the inventory's `{name}`"
            )));
        };
        let (ok, expected, found) = match h {
            Held::Matrix(r, c) => (stored[..] == [r, c], stored.clone(), vec![r, c]),
            Held::Vector(n) => {
                let want = match inventory::stored_shape(dims, name) {
                    StoredShape::ZeroPadded { used } => used,
                    StoredShape::Exact => stored.iter().product(),
                };
                (n == want, vec![want], vec![n])
            }
        };
        if !ok {
            return Err(ModelError::Shape {
                tensor: name.clone(),
                expected: format!("{expected:?}"),
                found: format!("{found:?}"),
            });
        }
    }
    if held.len() != expected.len() {
        return Err(ModelError::Dims(format!(
            "the model holds {} weights under `{prefix}`, the inventory lists {}",
            held.len(),
            expected.len()
        )));
    }
    Ok(())
}

impl Layer {
    /// Every weight of the layer, named as in the inventory (under `model.layers.{l}.`).
    fn held(&self) -> Vec<(&'static str, Held)> {
        let mut w = vec![
            (name::INPUT_NORM, vector(&self.input_layernorm)),
            (
                name::POST_ATTENTION_NORM,
                vector(&self.post_attention_layernorm),
            ),
            (name::ATTN_RES_NORM, vector(&self.attn_res.norm)),
            (name::MLP_RES_NORM, vector(&self.mlp_res.norm)),
            (name::ATTN_RES_PROJ, vector(&self.attn_res.proj)),
            (name::MLP_RES_PROJ, vector(&self.mlp_res.proj)),
        ];
        match &self.attn {
            Attention::Kda(k) => {
                use name::kda::*;
                w.extend([
                    (Q_PROJ, matrix(&k.q_proj)),
                    (K_PROJ, matrix(&k.k_proj)),
                    (V_PROJ, matrix(&k.v_proj)),
                    (Q_CONV, vector(&k.q_conv)),
                    (K_CONV, vector(&k.k_conv)),
                    (V_CONV, vector(&k.v_conv)),
                    (F_A_PROJ, matrix(&k.f_a_proj)),
                    (F_B_PROJ, matrix(&k.f_b_proj)),
                    (B_PROJ, matrix(&k.b_proj)),
                    (A_LOG, vector(&k.a_log)),
                    (DT_BIAS, vector(&k.dt_bias)),
                    (O_NORM, vector(&k.o_norm)),
                    (G_PROJ, matrix(&k.g_proj)),
                    (O_PROJ, matrix(&k.o_proj)),
                ])
            }
            Attention::Mla(m) => {
                use name::mla::*;
                w.extend([
                    (Q_A_PROJ, matrix(&m.q_a_proj)),
                    (Q_A_NORM, vector(&m.q_a_layernorm)),
                    (Q_B_PROJ, matrix(&m.q_b_proj)),
                    (KV_A_PROJ, matrix(&m.kv_a_proj)),
                    (KV_A_NORM, vector(&m.kv_a_layernorm)),
                    (KV_B_PROJ, matrix(&m.kv_b_proj)),
                    (G_PROJ, matrix(&m.g_proj)),
                    (O_PROJ, matrix(&m.o_proj)),
                ])
            }
        }
        let situ = |names: [&'static str; 3], m: &'_ SituMlp| {
            [
                (names[0], matrix(&m.gate_proj)),
                (names[1], matrix(&m.up_proj)),
                (names[2], matrix(&m.down_proj)),
            ]
        };
        match &self.ffn {
            Ffn::Dense(m) => w.extend(situ(name::DENSE, m)),
            Ffn::Moe(m) => {
                use name::moe::*;
                w.extend([
                    (ROUTER, matrix(&m.router.weight)),
                    (ROUTER_BIAS, vector(&m.router.bias)),
                    (LATENT_DOWN, matrix(&m.latent_down)),
                    (LATENT_UP, matrix(&m.latent_up)),
                    (LATENT_NORM, vector(&m.latent_norm)),
                ]);
                w.extend(situ(SHARED, &m.shared));
            }
        }
        w
    }
}

impl K3Model {
    /// Assemble and validate a model.
    pub fn new(
        dims: ModelDims,
        embed: Bf16Matrix,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        output_res: AttnResWeights,
        lm_head: Linear,
        experts: Box<dyn ExpertSource>,
    ) -> Result<K3Model, ModelError> {
        let model = K3Model {
            dims,
            embed,
            layers,
            norm,
            output_res,
            lm_head,
            experts,
            route_observers: Default::default(),
            spine_stream: None,
            device_experts: None,
            provisional: Default::default(),
            resident_copy: None,
            layer_profile: None,
        };
        model.validate()?;
        Ok(model)
    }

    /// Check every weight shape against the checkpoint inventory for these dimensions
    /// (`deltafin_store::inventory`) and every block against the layer schedule.
    pub fn validate(&self) -> Result<(), ModelError> {
        let d = &self.dims;
        d.validate()?;
        let globals = [
            (inventory::EMBED, matrix(&self.embed)),
            (inventory::LM_HEAD, matrix(&self.lm_head)),
            (inventory::FINAL_NORM, vector(&self.norm)),
            (inventory::OUTPUT_RES_NORM, vector(&self.output_res.norm)),
            (inventory::OUTPUT_RES_PROJ, vector(&self.output_res.proj)),
        ];
        check_against(d, "", &inventory::global_spine(d), &globals)?;
        if self.layers.len() != d.num_layers() {
            return Err(ModelError::Dims(format!(
                "{} layers given, the schedule has {}",
                self.layers.len(),
                d.num_layers()
            )));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let mismatch = |message: String| Err(ModelError::Layer { layer: l, message });
            match (&layer.attn, d.attn_kind(l)) {
                (Attention::Kda(_), AttnKind::Kda) | (Attention::Mla(_), AttnKind::Mla) => {}
                (_, kind) => {
                    return mismatch(format!(
                        "the schedule says {kind:?} attention, the weights are the other kind"
                    ));
                }
            }
            match (&layer.ffn, d.ffn_kind(l)) {
                (Ffn::Dense(_), FfnKind::Dense) | (Ffn::Moe(_), FfnKind::Moe) => {}
                (_, kind) => {
                    return mismatch(format!(
                        "the schedule says a {kind:?} FFN, the weights are the other kind"
                    ));
                }
            }
            let prefix = format!("model.layers.{l}.");
            check_against(d, &prefix, &inventory::layer_spine(d, l), &layer.held())?;
        }
        Ok(())
    }

    fn check_state(&self, state: &State) -> Result<(), ModelError> {
        if state.layers.len() != self.layers.len() {
            return Err(ModelError::StateMismatch(format!(
                "{} layer states for {} layers",
                state.layers.len(),
                self.layers.len()
            )));
        }
        for (l, (s, layer)) in state.layers.iter().zip(&self.layers).enumerate() {
            let ok = match (s, &layer.attn) {
                (LayerState::Kda(k), Attention::Kda(_)) => {
                    k.recurrent.len() == self.dims.kda_recurrent_values()
                        && k.conv.len() == self.dims.kda_conv_values()
                }
                (LayerState::Mla(c), Attention::Mla(_)) => {
                    let right_type = matches!(
                        (c, self.dims.mla_cache_dtype),
                        (MlaCache::Bf16(_), CacheDtype::Bf16) | (MlaCache::F32(_), CacheDtype::F32)
                    );
                    right_type
                        && c.values()
                            == (
                                state.position * self.dims.kv_lora_rank,
                                state.position * self.dims.qk_rope_head_dim,
                            )
                }
                _ => false,
            };
            if !ok {
                return Err(ModelError::StateMismatch(format!(
                    "layer {l} state has the wrong kind or size"
                )));
            }
        }
        Ok(())
    }

    /// Input errors (empty input, a token out of range, a state for another model), before
    /// anything changes.
    fn check_input(&self, state: &State, tokens: &[u32]) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let vocab = self.dims.vocab_size;
        for (index, &token) in tokens.iter().enumerate() {
            if token as usize >= vocab {
                return Err(ModelError::TokenOutOfRange {
                    token,
                    index,
                    vocab,
                });
            }
        }
        self.check_state(state)
    }

    /// `tokens` (appended to the sequence in `state`) through the layer loop (docs/K3.md
    /// §4.2) and the output head (§4.9), batched per layer; the requested logit rows.
    /// `hooks` are called at fixed points and change no value.
    pub(crate) fn run_layers(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        kda_form: KdaForm,
        hooks: &mut dyn PassHooks,
    ) -> Result<Logits, ModelError> {
        let mut one = [Segment {
            state,
            tokens,
            want,
            kda_form,
        }];
        let mut logits = self.run_segments(&mut one, hooks)?;
        logits.pop().ok_or(ModelError::EmptyInput)
    }

    /// The layer loop over several sequences at once: each [`Segment`]'s tokens are appended
    /// to its own state. The rows of all segments go through every weight together (each
    /// matrix and each routed expert is read once for the pass); only attention, which reads
    /// a sequence's own cache, runs segment by segment. Every stage but attention is
    /// row-invariant (a row's result does not depend on the other rows, their number or the
    /// thread split: docs/NUMERICS.md), so a segment's logits are bit-identical to those of
    /// the same tokens run alone. One logits value per segment, in order.
    pub(crate) fn run_segments(
        &self,
        segments: &mut [Segment<'_>],
        hooks: &mut dyn PassHooks,
    ) -> Result<Vec<Logits>, ModelError> {
        if segments.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        for s in segments.iter() {
            self.check_input(s.state, s.tokens)?;
        }
        let d = &self.dims;
        let dm = d.hidden_size;
        // Row ranges: segment i holds rows spans[i].0 .. spans[i].1 of every activation.
        let mut spans = Vec::with_capacity(segments.len());
        let mut tokens = Vec::new();
        for s in segments.iter() {
            spans.push((tokens.len(), tokens.len() + s.tokens.len()));
            tokens.extend_from_slice(s.tokens);
        }
        let t = tokens.len();
        hooks.begin(&tokens)?;

        // P ← E[token];  S ← []
        let mut p = Vec::with_capacity(t * dm);
        for &token in &tokens {
            p.extend(self.embed.row(token as usize).iter().map(|v| v.to_f32()));
        }
        // Every stage's output must be finite (`crate::model::finite`): a NaN or an
        // infinity stops the pass, naming where it first appeared.
        finite::check(&p, || {
            let bad = p
                .chunks(dm)
                .position(|r| !finite::all_finite(r))
                .unwrap_or(0);
            format!(
                "the embedding row of token {} (model.embed_tokens.weight)",
                tokens[bad]
            )
        })?;
        let mut snaps: Vec<Vec<f32>> = Vec::new();
        for (l, own) in self.layers.iter().enumerate() {
            let streamed = hooks.layer_weights(l, own)?;
            let layer = streamed.as_ref().unwrap_or(own);
            // a ← P if S = [] else AR(P; S; attn_res_l);  at a block start S.push(P), P ← ∅
            let a = if snaps.is_empty() {
                p.clone()
            } else {
                layer.attn_res.mix_rows(&snaps, &p, t, d.attn_res_eps)
            };
            let restart = l % d.attn_res_block_size == 0;
            if restart {
                snaps.push(std::mem::take(&mut p));
            }
            // o ← Attn_l(RMS(a; input_layernorm_l));  P ← o if P = ∅ else P + o
            let x = rms_norm_rows_new(&a, &layer.input_layernorm, d.rms_norm_eps);
            hooks.layer_input(l, layer, &x, t);
            let mut o = Vec::with_capacity(t * dm);
            for (seg, &(from, to)) in segments.iter_mut().zip(&spans) {
                let rows = to - from;
                let x = &x[from * dm..to * dm];
                let ls = seg.state.layers.get_mut(l);
                o.extend(match (&layer.attn, ls) {
                    (Attention::Kda(w), Some(LayerState::Kda(s))) => {
                        w.forward(d, x, rows, s, seg.kda_form.for_rows(rows))?
                    }
                    (Attention::Mla(w), Some(LayerState::Mla(c))) => w.forward(d, x, rows, c)?,
                    _ => {
                        return Err(ModelError::StateMismatch(format!(
                            "layer {l} state has the wrong kind"
                        )));
                    }
                });
            }
            hooks.attention_done(l);
            let attention_site = || {
                format!(
                    "layer {l}'s attention output (model.layers.{l}.self_attn, input_layernorm or self_attention_res)"
                )
            };
            if restart {
                finite::check(&o, attention_site)?;
                p = o;
            } else if !finite::add_checked(&mut p, &o) {
                return Err(ModelError::NonFinite {
                    site: attention_site(),
                });
            }
            // P ← P + FFN_l(RMS(AR(P; S; mlp_res_l); post_attention_layernorm_l))
            let m = layer.mlp_res.mix_rows(&snaps, &p, t, d.attn_res_eps);
            let x = rms_norm_rows_new(&m, &layer.post_attention_layernorm, d.rms_norm_eps);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(d, &x, t)?,
                Ffn::Moe(moe) => moe.forward_scheduled(d, l, &x, t, &hooks.experts(l))?,
            };
            if !finite::add_checked(&mut p, &f) {
                return Err(ModelError::NonFinite {
                    site: format!(
                        "layer {l}'s FFN output (model.layers.{l}.mlp, post_attention_layernorm or mlp_res)"
                    ),
                });
            }
            hooks.layer_output(l, &p);
        }
        for seg in segments.iter_mut() {
            seg.state.position += seg.tokens.len();
        }

        // logits ← lm_head · RMS(AR(P; S; output_res); norm), on the requested rows of
        // every segment, all through lm_head together.
        let mut wanted = Vec::new();
        for (seg, &(from, to)) in segments.iter().zip(&spans) {
            match seg.want {
                LogitRows::Last => wanted.push((to - 1, to)),
                LogitRows::All => wanted.push((from, to)),
                LogitRows::None => wanted.push((to, to)),
            }
        }
        let rows: usize = wanted.iter().map(|(a, b)| b - a).sum();
        let mut values = vec![0f32; rows * d.vocab_size];
        if rows > 0 {
            let gather = |v: &[f32]| -> Vec<f32> {
                let mut out = Vec::with_capacity(rows * dm);
                for &(a, b) in &wanted {
                    out.extend_from_slice(&v[a * dm..b * dm]);
                }
                out
            };
            let snap_rows: Vec<Vec<f32>> = snaps.iter().map(|s| gather(s)).collect();
            let x = self
                .output_res
                .mix_rows(&snap_rows, &gather(&p), rows, d.attn_res_eps);
            let x = rms_norm_rows_new(&x, &self.norm, d.rms_norm_eps);
            hooks.head_input(&x, rows);
            self.lm_head.matmul(&x, rows, &mut values)?;
            finite::check(&values, || {
                "the logits (model.norm.weight, model.output_attn_res or lm_head.weight)".into()
            })?;
        }
        if let [(a, b)] = wanted[..] {
            return Ok(vec![Logits {
                rows: b - a,
                vocab: d.vocab_size,
                values,
            }]);
        }
        let mut out = Vec::with_capacity(segments.len());
        let mut at = 0;
        for &(a, b) in &wanted {
            let n = (b - a) * d.vocab_size;
            out.push(Logits {
                rows: b - a,
                vocab: d.vocab_size,
                values: values[at..at + n].to_vec(),
            });
            at += n;
        }
        Ok(out)
    }

    /// A fresh state for this model.
    pub fn new_state(&self) -> State {
        State::new(&self.dims)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::attn_res::tests::attn_res64;
    use crate::model::kda::tests::{Kda64, kda64_step, random_kda};
    use crate::model::mla::tests::{Mla64, mla64_step, random_mla};
    use crate::model::moe::InMemoryExperts;
    use crate::model::moe::tests::{moe64, random_experts, random_moe};
    use crate::model::situ::SituMlp;
    use crate::model::situ::tests::situ_mlp64;
    use crate::model::taps::Taps;
    use crate::test_util::{Rng, mv64, rel_l2, rel_l2_32, rms64};
    use deltafin_kernels::argmax;
    use deltafin_tensor::bf16;

    /// Tiny dimensions with the real schedule shape: 14 layers, MLA at l ≡ 3 (mod 4) and the
    /// last layer, layer 0 dense, AttnRes block 12 (two blocks), vocab 300.
    pub(crate) fn tiny_dims() -> ModelDims {
        let n = 14;
        ModelDims {
            vocab_size: 300,
            hidden_size: 32,
            attn_kinds: (0..n)
                .map(|l| {
                    if l % 4 == 3 || l == n - 1 {
                        AttnKind::Mla
                    } else {
                        AttnKind::Kda
                    }
                })
                .collect(),
            first_k_dense: 1,
            attn_res_block_size: 12,
            kda_heads: 2,
            kda_head_dim: 8,
            conv_kernel: 4,
            gate_lower_bound: -5.0,
            kda_chunk: 64,
            mla_cache_dtype: CacheDtype::Bf16,
            mla_heads: 2,
            q_lora_rank: 16,
            kv_lora_rank: 16,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 8,
            dense_intermediate: 48,
            shared_intermediate: 24,
            moe_intermediate: 64,
            latent_size: 32,
            num_experts: 8,
            experts_per_token: 3,
            // K3's scaling factor, SiTU betas and epsilons.
            ..ModelDims::from_config(
                &deltafin_store::config::K3Config::from_json_str(
                    deltafin_store::config::REAL_CONFIG_JSON,
                )
                .unwrap(),
            )
        }
    }

    fn random_res(rng: &mut Rng, dm: usize) -> AttnResWeights {
        let norm = rng.around_one(dm, 0.2);
        AttnResWeights {
            norm: rng.bf16_vec(norm),
            proj: rng.vec(dm, 0.3),
        }
    }

    /// A tiny random model and a copy of its experts for the f64 reference.
    pub(crate) fn random_model(seed: u64) -> (K3Model, InMemoryExperts) {
        random_model_with(tiny_dims(), seed)
    }

    pub(crate) fn random_model_with(dims: ModelDims, seed: u64) -> (K3Model, InMemoryExperts) {
        let mut rng = Rng(seed);
        let dm = dims.hidden_size;
        let experts = random_experts(&mut rng, &dims, dims.num_layers());
        let layers = (0..dims.num_layers())
            .map(|l| Layer {
                attn_res: random_res(&mut rng, dm),
                mlp_res: random_res(&mut rng, dm),
                input_layernorm: rng.around_one(dm, 0.2),
                post_attention_layernorm: rng.around_one(dm, 0.2),
                attn: match dims.attn_kind(l) {
                    AttnKind::Kda => Attention::Kda(random_kda(&mut rng, &dims)),
                    AttnKind::Mla => Attention::Mla(random_mla(&mut rng, &dims)),
                },
                ffn: match dims.ffn_kind(l) {
                    FfnKind::Dense => Ffn::Dense(SituMlp {
                        gate_proj: rng
                            .bf16_matrix_scaled(dims.dense_intermediate, dm, 2.0)
                            .into(),
                        up_proj: rng
                            .bf16_matrix_scaled(dims.dense_intermediate, dm, 2.0)
                            .into(),
                        down_proj: rng.bf16_matrix(dm, dims.dense_intermediate).into(),
                    }),
                    FfnKind::Moe => Ffn::Moe(random_moe(&mut rng, &dims)),
                },
            })
            .collect();
        let embed = rng.bf16_matrix_scaled(dims.vocab_size, dm, (dm as f32 / 3.0).sqrt());
        let lm_head = rng.bf16_matrix_scaled(dims.vocab_size, dm, 3.0).into();
        let norm = rng.around_one(dm, 0.2);
        let output_res = random_res(&mut rng, dm);
        let model = K3Model::new(
            dims,
            embed,
            layers,
            norm,
            output_res,
            lm_head,
            Box::new(experts.clone()),
        )
        .unwrap();
        (model, experts)
    }

    /// f64 reference of the whole model, position by position (naive recurrent KDA, expanded
    /// MLA). Returns the logits of every position.
    pub(crate) fn reference_logits(
        model: &K3Model,
        experts: &InMemoryExperts,
        tokens: &[u32],
    ) -> Vec<Vec<f64>> {
        reference_run(model, experts, tokens).0
    }

    /// [`reference_logits`] and, per position, `P` after every layer (`[pos][layer]`).
    #[allow(clippy::type_complexity)]
    pub(crate) fn reference_run(
        model: &K3Model,
        experts: &InMemoryExperts,
        tokens: &[u32],
    ) -> (Vec<Vec<f64>>, Vec<Vec<Vec<f64>>>) {
        enum St {
            Kda(Kda64),
            Mla(Mla64),
        }
        let d = &model.dims;
        let (eps, are) = (d.rms_norm_eps as f64, d.attn_res_eps as f64);
        let (b1, b2) = (d.situ_beta as f64, d.situ_linear_beta as f64);
        let mut states: Vec<St> = d
            .attn_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Kda => St::Kda(Kda64::new(d)),
                AttnKind::Mla => St::Mla(Mla64::default()),
            })
            .collect();
        let mut out = Vec::new();
        let mut partial = Vec::new();
        for &tok in tokens {
            let mut after = Vec::new();
            let mut p: Option<Vec<f64>> = Some(
                model
                    .embed
                    .row(tok as usize)
                    .iter()
                    .map(|v| v.to_f64())
                    .collect(),
            );
            let mut snaps: Vec<Vec<f64>> = Vec::new();
            let with = |snaps: &Vec<Vec<f64>>, p: &Vec<f64>| {
                let mut c = snaps.clone();
                c.push(p.clone());
                c
            };
            for (l, layer) in model.layers.iter().enumerate() {
                let cur = p.take().unwrap();
                let a = if snaps.is_empty() {
                    cur.clone()
                } else {
                    attn_res64(&layer.attn_res, &with(&snaps, &cur), are)
                };
                if l % d.attn_res_block_size == 0 {
                    snaps.push(cur);
                } else {
                    p = Some(cur);
                }
                let x = rms64(&a, &layer.input_layernorm, eps);
                let o = match (&layer.attn, &mut states[l]) {
                    (Attention::Kda(w), St::Kda(s)) => kda64_step(w, d, &x, s),
                    (Attention::Mla(w), St::Mla(s)) => mla64_step(w, d, &x, s),
                    _ => unreachable!(),
                };
                let mut cur = match p.take() {
                    None => o,
                    Some(mut v) => {
                        v.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                        v
                    }
                };
                let m = attn_res64(&layer.mlp_res, &with(&snaps, &cur), are);
                let x = rms64(&m, &layer.post_attention_layernorm, eps);
                let f = match &layer.ffn {
                    Ffn::Dense(mlp) => situ_mlp64(mlp, &x, b1, b2),
                    Ffn::Moe(moe) => moe64(moe, d, l, experts, &x),
                };
                cur.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
                after.push(cur.clone());
                p = Some(cur);
            }
            let cur = p.take().unwrap();
            let x = attn_res64(&model.output_res, &with(&snaps, &cur), are);
            out.push(mv64(&model.lm_head, &rms64(&x, &model.norm, eps)));
            partial.push(after);
        }
        (out, partial)
    }

    fn prompt(n: usize, seed: u64) -> Vec<u32> {
        let mut rng = Rng(seed);
        (0..n).map(|_| (rng.next_u64() % 300) as u32).collect()
    }

    /// (max, mean) over positions of the relative L2 between `forward(All)` and stepwise
    /// `decode` logit rows, checking that the greedy token agrees at every position.
    fn prefill_vs_decode(model: &K3Model, n: usize) -> (f64, f64) {
        let toks = prompt(n, 40 + n as u64);
        let mut s1 = model.new_state();
        let all = model.forward(&mut s1, &toks, LogitRows::All).unwrap();
        assert_eq!((all.rows, all.vocab), (n, 300));
        let mut s2 = model.new_state();
        let (mut max_err, mut sum_err) = (0f64, 0f64);
        for (i, &tok) in toks.iter().enumerate() {
            let step = model.decode(&mut s2, tok).unwrap();
            let e = rel_l2_32(all.row(i), &step);
            max_err = max_err.max(e);
            sum_err += e;
            assert_eq!(
                argmax(all.row(i)),
                argmax(&step),
                "n={n} pos {i}: greedy token"
            );
        }
        assert_eq!((s1.position, s2.position), (n, n));
        let mut s3 = model.new_state();
        let last = model.prefill(&mut s3, &toks).unwrap();
        assert_eq!(&last[..], all.last());
        (max_err, sum_err / n as f64)
    }

    #[test]
    fn prefill_matches_stepwise_decode() {
        // With an f32 MLA cache the two paths differ only in f32 summation order: chunked vs
        // recurrent KDA (≈2e-7 relative per KDA layer, see the kda tests), everything else is
        // row-invariant. Through 14 random layers this grows to a few 1e-6 per logit row
        // (measured mean 3e-6 / 5e-6 for 70 / 130 tokens) with isolated sensitive rows up to
        // 1.4e-4. Bound: mean ≤ 1e-5 and max ≤ 3e-4 relative L2.
        //
        // With the default bf16 cache, f32-level differences upstream occasionally move a
        // cached `ĉ`/`kt` value across a bf16 rounding boundary (one bf16 ulp, 2^-8 relative),
        // which shows up as up to ~2e-4 relative L2 in this tiny model. Bound: mean ≤ 1e-4,
        // max ≤ 1e-3, and the greedy tokens must agree.
        for (cache, mean_bound, max_bound) in [
            (CacheDtype::F32, 1e-5, 3e-4),
            (CacheDtype::Bf16, 1e-4, 1e-3),
        ] {
            let dims = ModelDims {
                mla_cache_dtype: cache,
                ..tiny_dims()
            };
            let (model, _) = random_model_with(dims, 1);
            for &n in &[1usize, 7, 70, 130] {
                let (max, mean) = prefill_vs_decode(&model, n);
                eprintln!("{cache:?} cache n={n}: max {max:.2e} mean {mean:.2e}");
                assert!(
                    mean <= mean_bound && max <= max_bound,
                    "n={n}: {cache:?} cache, prefill vs decode rel L2 max {max} mean {mean}"
                );
            }
        }
    }

    /// Hints an expert source received: ("begin" | "predict", layer, experts).
    type HintEvents = std::sync::Arc<std::sync::Mutex<Vec<(&'static str, usize, Vec<usize>)>>>;

    /// An expert source that records the hints it gets (and wants PILOT guesses).
    struct HintLog {
        inner: InMemoryExperts,
        events: HintEvents,
    }

    impl ExpertSource for HintLog {
        fn expert(
            &self,
            layer: usize,
            expert: usize,
        ) -> Result<crate::model::moe::ExpertWeights, crate::model::moe::ExpertError> {
            self.inner.expert(layer, expert)
        }
        fn begin_layer(&self, layer: usize, experts: &[usize]) {
            let mut e = self.events.lock().unwrap();
            e.push(("begin", layer, experts.to_vec()));
        }
        fn wants_prediction(&self) -> bool {
            true
        }
        fn predict(&self, layer: usize, _rows: usize, guesses: &[deltafin_experts::PilotGuess]) {
            let ids = guesses.iter().map(|g| g.expert).collect();
            self.events.lock().unwrap().push(("predict", layer, ids));
        }
    }

    #[test]
    fn pilot_guesses_the_first_moe_layer_across_the_dense_layer() {
        // Layer 0 is dense: the first MoE layer's guess comes from layer 0's input, before
        // layer 1 begins; every later MoE layer is guessed from the one before, and the
        // last layer guesses nothing. Before `lm_head`, a pass of one output row guesses the
        // next pass's layer 1 from the provisional token (`crate::model::next_token`), the same
        // guess the next pass makes when it decodes that token. The hints never change a
        // value.
        let (plain, experts) = random_model(4);
        let (mut hinted, _) = random_model(4);
        let events = HintEvents::default();
        hinted.experts = Box::new(HintLog {
            inner: experts,
            events: events.clone(),
        });
        let d = tiny_dims();
        let n = d.num_layers();
        assert_eq!(d.ffn_kind(0), FfnKind::Dense);
        assert!((1..n).all(|l| d.ffn_kind(l) == FfnKind::Moe));
        // Layer l's guess for l + 1 follows its own begin; the next token's guess ends it.
        let expected: Vec<(&str, usize)> = (1..n)
            .flat_map(|l| [("predict", l), ("begin", l)])
            .chain([("predict", 1)])
            .collect();
        let toks = prompt(9, 3);
        let (mut s1, mut s2) = (plain.new_state(), hinted.new_state());
        let a = plain.prefill(&mut s1, &toks).unwrap();
        let mut b = hinted.prefill(&mut s2, &toks).unwrap();
        assert_eq!(a, b);
        let mut provisional_guess: Option<Vec<usize>> = None;
        for step in 0..3 {
            let seen: Vec<(&str, usize, Vec<usize>)> = std::mem::take(&mut *events.lock().unwrap());
            let order: Vec<(&str, usize)> = seen.iter().map(|(k, l, _)| (*k, *l)).collect();
            assert_eq!(order, expected, "pass {step}");
            // The guess is layer 1's router on layer 0's input: it names real expert ids, at
            // most k per row.
            let (_, _, first_guess) = &seen[0];
            let rows = if step == 0 { toks.len() } else { 1 };
            assert!(!first_guess.is_empty() && first_guess.len() <= rows * d.experts_per_token);
            assert!(first_guess.iter().all(|&e| e < d.num_experts));
            if let Some(g) = &provisional_guess {
                assert_eq!(g, first_guess, "pass {step}: the provisional token's guess");
            }
            provisional_guess = seen.last().map(|(_, _, g)| g.clone());
            // τ̂: the largest of this pass's logits over the provisional rows (lowest id on
            // ties); decoding it makes the next pass repeat the provisional guess.
            let head = hinted.provisional_head().unwrap().unwrap();
            assert_eq!(head.len(), d.vocab_size.div_ceil(32));
            let ids = head.ids();
            let mut tau = ids[0];
            for &id in ids {
                if b[id as usize] > b[tau as usize] {
                    tau = id;
                }
            }
            let c = plain.decode(&mut s1, tau).unwrap();
            b = hinted.decode(&mut s2, tau).unwrap();
            assert_eq!(c, b);
        }
        // Every decoded token was the provisional one; then one that is not.
        assert_eq!(hinted.provisional_accuracy(), (3, 3));
        let ids = hinted.provisional_head().unwrap().unwrap().ids().to_vec();
        let other = (0..d.vocab_size as u32).find(|t| !ids.contains(t)).unwrap();
        hinted.decode(&mut s2, other).unwrap();
        assert_eq!(hinted.provisional_accuracy(), (3, 4));
        // A source that wants no guesses gets none, and nothing is built or judged.
        plain.decode(&mut s1, other).unwrap();
        assert!(plain.provisional_head().is_none());
        assert_eq!(plain.provisional_accuracy(), (0, 0));
    }

    #[test]
    fn provisional_rows_are_the_largest_lm_head_rows_and_name_the_greedy_token() {
        let (model, _) = random_model(4);
        let head = crate::model::next_token::ProvisionalHead::build(&model.lm_head).unwrap();
        let v = model.dims.vocab_size;
        let dm = model.dims.hidden_size;
        assert_eq!(head.len(), v.div_ceil(32));
        let norm = |r: usize| {
            let mut row = vec![0f32; dm];
            model.lm_head.row_f32(r, &mut row);
            row.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>()
        };
        let ids = head.ids();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        let least_in = ids
            .iter()
            .map(|&i| norm(i as usize))
            .fold(f64::MAX, f64::min);
        let most_out = (0..v)
            .filter(|r| !ids.contains(&(*r as u32)))
            .map(norm)
            .fold(0.0, f64::max);
        assert!(least_in >= most_out, "{least_in} < {most_out}");
        // Its token is the argmax of the full product over the set: the greedy token
        // whenever that row is in the set. A hidden row along row `ids[1]` makes it win.
        let mut x = vec![0f32; dm];
        model.lm_head.row_f32(ids[1] as usize, &mut x);
        let full = model.lm_head.apply(&x, 1).unwrap();
        let best = ids
            .iter()
            .copied()
            .reduce(|a, b| {
                if full[b as usize] > full[a as usize] {
                    b
                } else {
                    a
                }
            })
            .unwrap();
        assert_eq!(head.token(&x), Some(best));
        assert_eq!(head.token(&x), Some(ids[1]));
        assert!(head.bytes() > 0);
    }

    #[test]
    fn greedy_continuation_after_prefill_matches_decode_only() {
        let (model, _) = random_model(2);
        let toks = prompt(20, 9);
        let greedy = |mut s: State, mut logits: Vec<f32>| {
            let mut out = Vec::new();
            for _ in 0..12 {
                let t = argmax(&logits).unwrap() as u32;
                out.push(t);
                logits = model.decode(&mut s, t).unwrap();
            }
            out
        };
        let mut s1 = model.new_state();
        let l1 = model.prefill(&mut s1, &toks).unwrap();
        let mut s2 = model.new_state();
        let mut l2 = Vec::new();
        for &t in &toks {
            l2 = model.decode(&mut s2, t).unwrap();
        }
        assert_eq!(greedy(s1, l1), greedy(s2, l2));
    }

    #[test]
    fn matches_f64_reference_model() {
        let (model, experts) = random_model(3);
        let toks = prompt(70, 5);
        let mut s = model.new_state();
        let got = model.forward(&mut s, &toks, LogitRows::All).unwrap();
        let want = reference_logits(&model, &experts, &toks);
        let mut max_err = 0f64;
        for (i, w) in want.iter().enumerate() {
            max_err = max_err.max(rel_l2(got.row(i), w));
        }
        assert!(
            max_err < 1e-4,
            "f32 engine vs f64 reference: rel L2 {max_err}"
        );
        eprintln!("f32 vs f64 reference, max rel L2 over 70 positions: {max_err:.3e}");
    }

    /// Dimensions in which every pair of sizes that the release happens to make equal
    /// differs (K3: KDA heads = MLA heads = 96, KDA head dim = `qk_nope` = `v_head` = 128,
    /// `A_log` length = head dim = 128), and `q_lora ≠ kv_lora`, `latent ≠ moe_intermediate`:
    /// a rule that ties two of them together fails here.
    pub(crate) fn distinct_dims() -> ModelDims {
        ModelDims {
            hidden_size: 48,
            kda_heads: 3,
            kda_head_dim: 16,
            mla_heads: 5,
            q_lora_rank: 24,
            kv_lora_rank: 20,
            qk_nope_head_dim: 12,
            qk_rope_head_dim: 6,
            v_head_dim: 10,
            dense_intermediate: 56,
            shared_intermediate: 40,
            moe_intermediate: 64,
            latent_size: 32,
            ..tiny_dims()
        }
    }

    #[test]
    fn distinct_dims_match_the_f64_reference_model() {
        let (model, experts) = random_model_with(distinct_dims(), 13);
        let toks = prompt(40, 17);
        let mut s = model.new_state();
        let got = model.forward(&mut s, &toks, LogitRows::All).unwrap();
        let want = reference_logits(&model, &experts, &toks);
        let max_err = want
            .iter()
            .enumerate()
            .map(|(i, w)| rel_l2(got.row(i), w))
            .fold(0f64, f64::max);
        assert!(max_err < 1e-4, "distinct dims: rel L2 {max_err}");
        let (max, _) = prefill_vs_decode(&model, 20);
        assert!(max < 1e-2, "distinct dims: prefill vs decode rel L2 {max}");
    }

    #[test]
    fn taps_leave_logits_unchanged_and_match_reference_partial_sums() {
        let (model, experts) = random_model(7);
        let toks = prompt(20, 11);
        let ids = [0usize, 3, 7, 12, 13];
        for exact in [false, true] {
            let run = |s: &mut State, t: &[u32], taps: Option<&mut Taps>| match (exact, taps) {
                (false, None) => model.forward(s, t, LogitRows::All).unwrap(),
                (true, None) => model.forward_exact(s, t, LogitRows::All).unwrap(),
                (false, Some(tp)) => model.forward_tapped(s, t, LogitRows::All, tp).unwrap(),
                (true, Some(tp)) => model
                    .forward_exact_tapped(s, t, LogitRows::All, tp)
                    .unwrap(),
            };
            let mut s1 = model.new_state();
            let plain = [
                run(&mut s1, &toks[..12], None),
                run(&mut s1, &toks[12..], None),
            ];
            let mut s2 = model.new_state();
            let mut taps = model.taps(&ids).unwrap();
            let tapped = [
                run(&mut s2, &toks[..12], Some(&mut taps)),
                run(&mut s2, &toks[12..], Some(&mut taps)),
            ];
            for (a, b) in plain.iter().zip(&tapped) {
                assert!(
                    a.values
                        .iter()
                        .zip(&b.values)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "exact={exact}: taps changed the logits"
                );
            }
            assert_eq!(s1, s2);
            assert_eq!(taps.rows(), toks.len());
            let (_, partial) = reference_run(&model, &experts, &toks);
            let dm = model.dims.hidden_size;
            for (pos, after) in partial.iter().enumerate() {
                for (slot, &l) in ids.iter().enumerate() {
                    let got = &taps.row(pos)[slot * dm..(slot + 1) * dm];
                    assert!(got.iter().all(|&v| bf16::from_f32(v).to_f32() == v));
                    let e = rel_l2(got, &after[l]);
                    assert!(e < 5e-3, "exact={exact} pos {pos} layer {l}: rel L2 {e}");
                }
            }
        }
        taps_are_validated(&model);
    }

    fn taps_are_validated(model: &K3Model) {
        let e = model.taps(&[2, 14]).unwrap_err().to_string();
        assert!(e.contains("tap layer 14"), "{e}");
        let e = model.taps(&[2, 2]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        assert!(model.taps(&[]).is_err());
        let mut t = model.taps(&[1, 2]).unwrap();
        assert_eq!(t.width(), 2 * model.dims.hidden_size);
        let mut s = model.new_state();
        model
            .forward_tapped(&mut s, &[1, 2, 3], LogitRows::Last, &mut t)
            .unwrap();
        assert_eq!(t.rows(), 3);
        assert_eq!(t.values().len(), 3 * t.width());
        assert_eq!(&t.values()[t.width()..2 * t.width()], t.row(1));
        t.truncate(1);
        assert_eq!(t.rows(), 1);
        t.clear();
        assert_eq!(t.rows(), 0);
    }

    #[test]
    fn a_non_finite_value_stops_the_pass_naming_where_it_first_appeared() {
        let toks = prompt(5, 3);
        type Edit = fn(&mut K3Model, &mut InMemoryExperts);
        let cases: [(&str, Edit); 5] = [
            ("layer 2's attention output", |m, _| {
                m.layers[2].input_layernorm[0] = f32::INFINITY
            }),
            ("layer 0's FFN output", |m, _| {
                m.layers[0].post_attention_layernorm[1] = f32::NAN
            }),
            ("layer 6's MoE input", |m, _| {
                m.layers[6].post_attention_layernorm[1] = f32::NAN
            }),
            ("the logits", |m, _| m.norm[0] = f32::INFINITY),
            // Every expert of layer 5 with the largest E8M0 scale (2^127) in its three
            // matrices: its products overflow.
            ("of layer 5 (its MXFP4 weights or E8M0 scales)", |m, x| {
                let huge = |w: &deltafin_tensor::Mxfp4Matrix| {
                    let s = vec![254u8; w.scales().len()];
                    w.with_scales("w", deltafin_tensor::Bytes::from_vec(s))
                        .unwrap()
                };
                for w in &mut x.layers[5] {
                    (w.w1, w.w2, w.w3) = (huge(&w.w1), huge(&w.w2), huge(&w.w3));
                }
                m.experts = Box::new(x.clone());
            }),
        ];
        for (site, edit) in cases {
            let (mut model, mut experts) = random_model(9);
            edit(&mut model, &mut experts);
            let last = model.forward(&mut model.new_state(), &toks, LogitRows::Last);
            let exact = model.forward_exact(&mut model.new_state(), &toks, LogitRows::All);
            let advance = model.forward(&mut model.new_state(), &toks, LogitRows::None);
            for (pass, r) in [("last", last), ("exact", exact), ("no rows", advance)] {
                if site == "the logits" && pass == "no rows" {
                    // A pass that computes no logits never reaches the damage.
                    assert!(r.is_ok());
                    continue;
                }
                let e = r.map(|_| ()).unwrap_err();
                let text = e.to_string();
                assert!(
                    matches!(e, ModelError::NonFinite { .. }),
                    "{site} {pass}: {text}"
                );
                assert!(
                    text.contains(site) && text.starts_with("numerical failure"),
                    "{site} {pass}: {text}"
                );
            }
            // Generation stops with the error instead of choosing token 0 from NaNs: its
            // prefill (the first pass of `deltafin_spec::generation::Generation`) fails.
            use crate::prefix::Prefiller;
            let g = crate::prefix::OnePass
                .prefill(&model, &toks, None)
                .map(|p| p.map(|p| p.logits.len()));
            assert!(
                matches!(g, Err(ModelError::NonFinite { .. })),
                "{site}: {g:?}"
            );
        }
        // The undamaged model runs.
        let (model, _) = random_model(9);
        model
            .forward(&mut model.new_state(), &toks, LogitRows::All)
            .unwrap();
    }

    #[test]
    fn bad_inputs_are_errors() {
        let (model, _) = random_model(4);
        let mut s = model.new_state();
        let e = model.prefill(&mut s, &[1, 300]).unwrap_err().to_string();
        assert!(e.contains("300") && e.contains("position 1"), "{e}");
        assert!(matches!(
            model.prefill(&mut s, &[]),
            Err(ModelError::EmptyInput)
        ));
        assert_eq!(s.position, 0);
        let mut wrong = State::new(&ModelDims {
            attn_kinds: vec![AttnKind::Kda; 3],
            ..tiny_dims()
        });
        assert!(matches!(
            model.decode(&mut wrong, 1),
            Err(ModelError::StateMismatch(_))
        ));
    }

    #[test]
    fn construction_names_misshapen_tensor() {
        let (model, experts) = random_model(6);
        let e = rebuilt_error(model, experts, |m| {
            if let Attention::Mla(w) = &mut m.layers[3].attn {
                w.kv_b_proj = w.q_b_proj.clone();
            }
        });
        assert!(
            e.contains("model.layers.3.self_attn.kv_b_proj.weight")
                && e.contains("expected shape [32, 16], found [24, 16]"),
            "{e}"
        );
    }

    /// `model` rebuilt after `edit`: the construction error's message.
    fn rebuilt_error(
        model: K3Model,
        experts: InMemoryExperts,
        edit: impl FnOnce(&mut K3Model),
    ) -> String {
        let mut model = model;
        edit(&mut model);
        let K3Model {
            dims,
            embed,
            layers,
            norm,
            output_res,
            lm_head,
            ..
        } = model;
        K3Model::new(
            dims,
            embed,
            layers,
            norm,
            output_res,
            lm_head,
            Box::new(experts),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    }

    #[test]
    fn every_block_kind_is_checked_against_the_inventory() {
        // Four dense layers: KDA and MLA layers with both FFN kinds are built and checked
        // against `inventory::layer_spine`, weight for weight.
        let dims = ModelDims {
            first_k_dense: 4,
            ..tiny_dims()
        };
        assert_eq!(dims.attn_kind(3), AttnKind::Mla);
        let (model, _) = random_model_with(dims.clone(), 8);
        for (l, layer) in model.layers.iter().enumerate() {
            let mut held: Vec<String> = layer
                .held()
                .iter()
                .map(|(n, _)| format!("model.layers.{l}.{n}"))
                .collect();
            let mut listed: Vec<String> = inventory::layer_spine(&dims, l)
                .into_iter()
                .map(|(n, _, _)| n)
                .collect();
            held.sort();
            listed.sort();
            assert_eq!(held, listed, "layer {l}");
        }
    }

    #[test]
    fn misshapen_weights_name_the_tensor_and_both_shapes() {
        // Each check reports the tensor, the inventory's shape (a vector's as its number of
        // values) and the shape found.
        type Edit = fn(&mut K3Model);
        let cases: [(&str, &str, Edit); 5] = [
            (
                // The model holds `A_log` unpadded: one value per head (2 here).
                "model.layers.1.self_attn.A_log",
                "expected shape [2], found [3]",
                |m| {
                    if let Attention::Kda(w) = &mut m.layers[1].attn {
                        w.a_log.push(0.0);
                    }
                },
            ),
            (
                "model.layers.2.self_attn.q_conv1d.weight",
                "expected shape [64], found [63]",
                |m| {
                    if let Attention::Kda(w) = &mut m.layers[2].attn {
                        w.q_conv.pop();
                    }
                },
            ),
            (
                "model.layers.5.block_sparse_moe.routed_expert_norm.weight",
                "expected shape [32], found [31]",
                |m| {
                    if let Ffn::Moe(w) = &mut m.layers[5].ffn {
                        w.latent_norm.pop();
                    }
                },
            ),
            (
                "model.output_attn_res_proj.weight",
                "expected shape [32], found [33]",
                |m| m.output_res.proj.push(0.0),
            ),
            (
                "lm_head.weight",
                "expected shape [300, 32], found [32, 300]",
                |m| m.lm_head = Rng(3).bf16_matrix(32, 300).into(),
            ),
        ];
        for (tensor, shapes, edit) in cases {
            let (model, experts) = random_model(6);
            let e = rebuilt_error(model, experts, edit);
            assert!(
                e.contains(&format!("tensor `{tensor}`: {shapes}")),
                "{tensor}: {e}"
            );
        }
        // A block of the other kind than the schedule's is named by layer.
        let (model, experts) = random_model(6);
        let e = rebuilt_error(model, experts, |m| {
            m.layers[2].attn = m.layers[3].attn.clone();
        });
        assert!(
            e.contains("layer 2: the schedule says Kda attention"),
            "{e}"
        );
        let (model, experts) = random_model(6);
        let e = rebuilt_error(model, experts, |m| {
            m.layers[0].ffn = m.layers[1].ffn.clone();
        });
        assert!(e.contains("layer 0: the schedule says a Dense FFN"), "{e}");
    }
}
