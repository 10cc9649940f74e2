//! The K3 text model: embedding, the layer loop with Attention Residuals (k3-model.md §4.2),
//! and the output head (§4.9).
//!
//! Activations are f32 throughout; bf16/MXFP4 weights are widened to f32 with f32
//! accumulation (k3-model.md §5.3 #7, the llama.cpp policy).
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

use crate::attn_res::AttnResWeights;
use crate::dims::{AttnKind, CacheDtype, FfnKind, ModelDims};
use crate::kda::KdaWeights;
use crate::linear::Linear;
use crate::mla::{MlaCache, MlaWeights};
use crate::moe::{ExpertSource, MoeWeights};
use crate::norm::rms_norm_rows_new;
use crate::situ::DenseMlp;
use crate::state::{LayerState, State};
use crate::taps::Taps;
use deltafin_tensor::Bf16Matrix;

/// Errors of model construction and of the forward pass. Each names what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Inconsistent dimensions.
    #[error("model dimensions: {0}")]
    Dims(String),
    /// A weight whose shape disagrees with the dimensions.
    #[error("tensor `{tensor}`: expected shape {expected}, found {found}")]
    Shape {
        tensor: String,
        expected: String,
        found: String,
    },
    /// A layer whose block kind disagrees with the schedule.
    #[error("layer {layer}: {message}")]
    Layer { layer: usize, message: String },
    /// A token id outside the vocabulary.
    #[error("token id {token} at input position {index} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    /// An empty token list.
    #[error("no input tokens")]
    EmptyInput,
    /// A `State` built for different dimensions.
    #[error("state does not fit this model: {0}")]
    StateMismatch(String),
    /// A product, upload or other operation on the compute device failed (`matrix`: the
    /// tensor, or `layer L expert E` for a routed expert).
    #[error("device: {matrix}: {message}")]
    Device { matrix: String, message: String },
    /// A weight matrix could not be moved to other memory
    /// ([`K3Model::copy_spine_to_huge_pages`]).
    #[error("{name}: {message}")]
    Weights { name: String, message: String },
    /// A routed expert could not be obtained.
    #[error("expert {expert} of layer {layer}: {message}")]
    Expert {
        layer: usize,
        expert: usize,
        message: String,
    },
}

impl From<deltafin_experts::ExpertError> for ModelError {
    fn from(e: deltafin_experts::ExpertError) -> ModelError {
        match e.location() {
            Some((layer, expert)) => ModelError::Expert {
                layer,
                expert,
                message: e.detail(),
            },
            None => ModelError::Dims(e.to_string()),
        }
    }
}

/// The attention block of a layer.
#[derive(Clone, Debug)]
// Built once per layer: boxing the larger variant would only add an indirection.
#[allow(clippy::large_enum_variant)]
pub enum Attention {
    /// Kimi Delta Attention.
    Kda(KdaWeights),
    /// Gated MLA.
    Mla(MlaWeights),
}

/// The feed-forward block of a layer.
#[derive(Clone, Debug)]
// Built once per layer: boxing the larger variant would only add an indirection.
#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    /// Dense SiTU-GLU MLP (layer 0).
    Dense(DenseMlp),
    /// Latent MoE (its routed experts come from the model's [`ExpertSource`]).
    Moe(MoeWeights),
}

/// One decoder layer (`model.layers.N.*`); vectors are widened to f32.
#[derive(Clone, Debug)]
pub struct Layer {
    /// `self_attention_res_norm.weight` / `self_attention_res_proj.weight`.
    pub attn_res: AttnResWeights,
    /// `mlp_res_norm.weight` / `mlp_res_proj.weight`.
    pub mlp_res: AttnResWeights,
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vec<f32>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vec<f32>,
    /// `self_attn.*`.
    pub attn: Attention,
    /// `mlp.*` (dense) or `block_sparse_moe.*`.
    pub ffn: Ffn,
}

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last input position.
    Last,
    /// Every input position (perplexity, speculative verification).
    All,
}

/// Which KDA form a multi-token forward uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KdaForm {
    /// Chunked (prefill; the reference's choice for more than one token).
    Chunked,
    /// Recurrent, token by token (bit-identical to decode).
    Recurrent,
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
    /// Spine streaming (`crate::spine_stream`): when set, the layers it streams take their
    /// projections from per-pass reads instead of `layers[l]`'s own (unread) views.
    pub spine_stream: Option<crate::spine_stream::SpineStreamer>,
    /// Routed experts on a device (`crate::offload`, `--expert-backend cuda`): when set, the
    /// MoE layers run their expert products there.
    pub device_experts: Option<std::sync::Arc<crate::offload::DeviceExpertCache>>,
    /// What [`K3Model::copy_spine_to_huge_pages`] copied at load, if it ran
    /// (`crate::resident`).
    pub resident_copy: Option<crate::resident::ResidentCopy>,
    /// The provisional next-token rows of `lm_head` (`crate::next_token`), built at the first
    /// pass that can use them: an expert source that wants PILOT guesses.
    provisional: std::sync::OnceLock<Result<crate::next_token::ProvisionalHead, String>>,
    /// The last provisional token not yet compared with the next pass's first token, and how
    /// often it was right.
    provisional_tally: std::sync::Mutex<crate::next_token::Tally>,
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

fn check_mat(name: String, m: &impl Shaped, rows: usize, cols: usize) -> Result<(), ModelError> {
    let (r, c) = m.shape();
    if r != rows || c != cols {
        return Err(ModelError::Shape {
            tensor: name,
            expected: format!("[{rows}, {cols}]"),
            found: format!("[{r}, {c}]"),
        });
    }
    Ok(())
}

fn check_vec(name: String, v: &[f32], len: usize) -> Result<(), ModelError> {
    if v.len() != len {
        return Err(ModelError::Shape {
            tensor: name,
            expected: format!("[{len}]"),
            found: format!("[{}]", v.len()),
        });
    }
    Ok(())
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
            provisional: std::sync::OnceLock::new(),
            provisional_tally: std::sync::Mutex::new(Default::default()),
            resident_copy: None,
        };
        model.validate()?;
        Ok(model)
    }

    /// Check every weight shape against the dimensions and the layer schedule.
    pub fn validate(&self) -> Result<(), ModelError> {
        let d = &self.dims;
        d.validate()?;
        let dm = d.hidden_size;
        check_mat(
            "model.embed_tokens.weight".into(),
            &self.embed,
            d.vocab_size,
            dm,
        )?;
        check_mat("lm_head.weight".into(), &self.lm_head, d.vocab_size, dm)?;
        check_vec("model.norm.weight".into(), &self.norm, dm)?;
        check_vec(
            "model.output_attn_res_norm.weight".into(),
            &self.output_res.norm,
            dm,
        )?;
        check_vec(
            "model.output_attn_res_proj.weight".into(),
            &self.output_res.proj,
            dm,
        )?;
        if self.layers.len() != d.num_layers() {
            return Err(ModelError::Dims(format!(
                "{} layers given, the schedule has {}",
                self.layers.len(),
                d.num_layers()
            )));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let pre = |s: &str| format!("model.layers.{l}.{s}");
            check_vec(
                pre("self_attention_res_norm.weight"),
                &layer.attn_res.norm,
                dm,
            )?;
            check_vec(
                pre("self_attention_res_proj.weight"),
                &layer.attn_res.proj,
                dm,
            )?;
            check_vec(pre("mlp_res_norm.weight"), &layer.mlp_res.norm, dm)?;
            check_vec(pre("mlp_res_proj.weight"), &layer.mlp_res.proj, dm)?;
            check_vec(pre("input_layernorm.weight"), &layer.input_layernorm, dm)?;
            check_vec(
                pre("post_attention_layernorm.weight"),
                &layer.post_attention_layernorm,
                dm,
            )?;
            match (&layer.attn, d.attn_kind(l)) {
                (Attention::Kda(w), AttnKind::Kda) => {
                    validate_kda(d, w, &|s| pre(&format!("self_attn.{s}")))?
                }
                (Attention::Mla(w), AttnKind::Mla) => {
                    validate_mla(d, w, &|s| pre(&format!("self_attn.{s}")))?
                }
                (_, kind) => {
                    return Err(ModelError::Layer {
                        layer: l,
                        message: format!(
                            "the schedule says {kind:?} attention, the weights are the other kind"
                        ),
                    });
                }
            }
            match (&layer.ffn, d.ffn_kind(l)) {
                (Ffn::Dense(m), FfnKind::Dense) => {
                    let f = d.dense_intermediate;
                    check_mat(pre("mlp.gate_proj.weight"), &m.gate_proj, f, dm)?;
                    check_mat(pre("mlp.up_proj.weight"), &m.up_proj, f, dm)?;
                    check_mat(pre("mlp.down_proj.weight"), &m.down_proj, dm, f)?;
                }
                (Ffn::Moe(m), FfnKind::Moe) => {
                    let p = |s: &str| pre(&format!("block_sparse_moe.{s}"));
                    let (ne, lr, fs) = (d.num_experts, d.latent_size, d.shared_intermediate);
                    check_mat(p("gate.weight"), &m.router.weight, ne, dm)?;
                    check_vec(p("gate.e_score_correction_bias"), &m.router.bias, ne)?;
                    check_mat(p("routed_expert_down_proj.weight"), &m.latent_down, lr, dm)?;
                    check_mat(p("routed_expert_up_proj.weight"), &m.latent_up, dm, lr)?;
                    check_vec(p("routed_expert_norm.weight"), &m.latent_norm, lr)?;
                    check_mat(
                        p("shared_experts.gate_proj.weight"),
                        &m.shared.gate_proj,
                        fs,
                        dm,
                    )?;
                    check_mat(
                        p("shared_experts.up_proj.weight"),
                        &m.shared.up_proj,
                        fs,
                        dm,
                    )?;
                    check_mat(
                        p("shared_experts.down_proj.weight"),
                        &m.shared.down_proj,
                        dm,
                        fs,
                    )?;
                }
                (_, kind) => {
                    return Err(ModelError::Layer {
                        layer: l,
                        message: format!(
                            "the schedule says a {kind:?} FFN, the weights are the other kind"
                        ),
                    });
                }
            }
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
        self.forward_impl(state, tokens, want, KdaForm::Chunked, None)
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
        self.forward_impl(state, tokens, want, KdaForm::Recurrent, None)
    }

    /// [`Self::forward`] that also appends, per input position, the bf16-rounded partial sum
    /// `P` after each of `taps`' layers (k3-model.md §9.3). The logits are unchanged.
    pub fn forward_tapped(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        taps: &mut Taps,
    ) -> Result<Logits, ModelError> {
        self.forward_impl(state, tokens, want, KdaForm::Chunked, Some(taps))
    }

    /// [`Self::forward_exact`] with taps, as [`Self::forward_tapped`].
    pub fn forward_exact_tapped(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        taps: &mut Taps,
    ) -> Result<Logits, ModelError> {
        self.forward_impl(state, tokens, want, KdaForm::Recurrent, Some(taps))
    }

    /// A tap collector for this model's layers `layer_ids`.
    pub fn taps(&self, layer_ids: &[usize]) -> Result<Taps, ModelError> {
        Taps::new(layer_ids, self.layers.len(), self.dims.hidden_size)
    }

    fn forward_impl(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: LogitRows,
        kda_form: KdaForm,
        mut taps: Option<&mut Taps>,
    ) -> Result<Logits, ModelError> {
        let d = &self.dims;
        let dm = d.hidden_size;
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        for (index, &token) in tokens.iter().enumerate() {
            if token as usize >= d.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    token,
                    index,
                    vocab: d.vocab_size,
                });
            }
        }
        self.check_state(state)?;
        let t = tokens.len();
        self.provisional_tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .judge(tokens[0]);

        // P ← E[token]
        let mut p = Vec::with_capacity(t * dm);
        for &token in tokens {
            p.extend(self.embed.row(token as usize).iter().map(|v| v.to_f32()));
        }
        let mut snaps: Vec<Vec<f32>> = Vec::new();
        // PILOT: each MoE layer's router on the previous MoE layer's FFN input, or on the
        // input of the dense layer before it.
        let next_router = |l: usize| match self.layers.get(l + 1).map(|x| &x.ffn) {
            Some(Ffn::Moe(m)) => Some((l + 1, &m.router)),
            _ => None,
        };
        if let Some(tp) = taps.as_deref_mut() {
            tp.begin(t);
        }
        let mut spine_pass = match &self.spine_stream {
            Some(s) => Some(s.begin_pass()?),
            None => None,
        };
        for (l, (resident, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            // A streamed layer's weights are resolved (read) before the layer runs.
            let streamed = match spine_pass.as_mut() {
                Some(pass) => pass.layer(l, resident)?,
                None => None,
            };
            let layer = streamed.as_ref().unwrap_or(resident);
            let a = if snaps.is_empty() {
                p.clone()
            } else {
                layer.attn_res.mix_rows(&snaps, &p, t, d.attn_res_eps)
            };
            let restart = l % d.attn_res_block_size == 0;
            if restart {
                snaps.push(std::mem::take(&mut p));
            }
            let x = rms_norm_rows_new(&a, &layer.input_layernorm, d.rms_norm_eps);
            // PILOT for the MoE layer after a dense one, from the dense layer's input: its
            // reads start before this layer's attention and MLP.
            if let (Ffn::Dense(_), Some((next, router))) = (&layer.ffn, next_router(l)) {
                crate::moe::predict_across_dense(d, self.experts.as_ref(), next, router, &x, t);
            }
            let o = match (&layer.attn, ls) {
                (Attention::Kda(w), LayerState::Kda(s)) => match kda_form {
                    KdaForm::Chunked => w.forward(d, &x, t, s)?,
                    KdaForm::Recurrent => w.forward_recurrent(d, &x, t, s)?,
                },
                (Attention::Mla(w), LayerState::Mla(c)) => w.forward(d, &x, t, c)?,
                _ => {
                    return Err(ModelError::StateMismatch(format!(
                        "layer {l} state has the wrong kind"
                    )));
                }
            };
            if restart {
                p = o;
            } else {
                add_into(&mut p, &o);
            }
            let m = layer.mlp_res.mix_rows(&snaps, &p, t, d.attn_res_eps);
            let x = rms_norm_rows_new(&m, &layer.post_attention_layernorm, d.rms_norm_eps);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(d, &x, t)?,
                Ffn::Moe(moe) => moe.forward_with_pilot(
                    d,
                    l,
                    self.experts.as_ref(),
                    &self.route_observers,
                    &x,
                    t,
                    next_router(l),
                    self.device_experts.as_deref(),
                )?,
            };
            add_into(&mut p, &f);
            if let Some(tp) = taps.as_deref_mut() {
                tp.record(l, &p);
            }
        }
        state.position += t;

        // Output: AR over the final snapshots, norm, lm_head on the requested rows.
        let first = match want {
            LogitRows::Last => t - 1,
            LogitRows::All => 0,
        };
        let rows = t - first;
        let snap_rows: Vec<Vec<f32>> = snaps.iter().map(|s| s[first * dm..].to_vec()).collect();
        let x = self
            .output_res
            .mix_rows(&snap_rows, &p[first * dm..], rows, d.attn_res_eps);
        let x = rms_norm_rows_new(&x, &self.norm, d.rms_norm_eps);
        if rows == 1 {
            self.guess_next_token_routes(&x);
        }
        let mut values = vec![0f32; rows * d.vocab_size];
        self.lm_head.matmul(&x, rows, &mut values)?;
        Ok(Logits {
            rows,
            vocab: d.vocab_size,
            values,
        })
    }

    /// PILOT across the token boundary (`crate::next_token`): before `lm_head` runs on the
    /// last position's normalised row `x`, guess the next pass's first MoE layer from a
    /// provisional token, so its reads overlap `lm_head`. Only for an expert source that
    /// wants guesses, a resident layer 0 that is dense and a layer 1 that is MoE (K3's
    /// schedule); changes no value.
    fn guess_next_token_routes(&self, x: &[f32]) {
        let experts = self.experts.as_ref();
        if self.spine_stream.is_some() || !experts.wants_prediction() {
            return;
        }
        let (Some(first), Some(Ffn::Moe(next))) =
            (self.layers.first(), self.layers.get(1).map(|l| &l.ffn))
        else {
            return;
        };
        if !matches!(first.ffn, Ffn::Dense(_)) {
            return;
        }
        let head = self
            .provisional
            .get_or_init(|| crate::next_token::ProvisionalHead::build(&self.lm_head));
        let Some(token) = head.as_ref().ok().and_then(|h| h.token(x)) else {
            return;
        };
        self.provisional_tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pending = Some(token);
        let d = &self.dims;
        let e: Vec<f32> = self
            .embed
            .row(token as usize)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let y = rms_norm_rows_new(&e, &first.input_layernorm, d.rms_norm_eps);
        crate::moe::predict_across_dense(d, experts, 1, &next.router, &y, 1);
    }

    /// The provisional next-token rows (`crate::next_token`), once a pass has built them:
    /// `Err` names why they could not be gathered (the guess is then skipped).
    pub fn provisional_head(&self) -> Option<Result<&crate::next_token::ProvisionalHead, &str>> {
        self.provisional
            .get()
            .map(|r| r.as_ref().map_err(String::as_str))
    }

    /// How often the provisional next token was the token the next pass began with:
    /// `(right, judged)` (`--stats`). With several sequences on one model a guess made at
    /// the end of one sequence's pass is judged against whichever pass comes next.
    pub fn provisional_accuracy(&self) -> (u64, u64) {
        let t = self
            .provisional_tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (t.right, t.judged)
    }

    /// Process a prompt; returns the logits of its last position.
    pub fn prefill(&self, state: &mut State, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward(state, tokens, LogitRows::Last)?.values)
    }

    /// Process one token; returns its logits.
    pub fn decode(&self, state: &mut State, token: u32) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward(state, &[token], LogitRows::Last)?.values)
    }

    /// A fresh state for this model.
    pub fn new_state(&self) -> State {
        State::new(&self.dims)
    }
}

fn add_into(p: &mut [f32], o: &[f32]) {
    for (a, &b) in p.iter_mut().zip(o) {
        *a += b;
    }
}

fn validate_kda(
    d: &ModelDims,
    w: &KdaWeights,
    name: &dyn Fn(&str) -> String,
) -> Result<(), ModelError> {
    let (dm, h, hd) = (d.hidden_size, d.kda_heads, d.kda_head_dim);
    let p = h * hd;
    for (n, m) in [
        ("q_proj.weight", &w.q_proj),
        ("k_proj.weight", &w.k_proj),
        ("v_proj.weight", &w.v_proj),
        ("g_proj.weight", &w.g_proj),
    ] {
        check_mat(name(n), m, p, dm)?;
    }
    for (n, v) in [
        ("q_conv1d.weight", &w.q_conv),
        ("k_conv1d.weight", &w.k_conv),
        ("v_conv1d.weight", &w.v_conv),
    ] {
        check_vec(name(n), v, p * d.conv_kernel)?;
    }
    let r = w.f_a_proj.rows();
    check_mat(name("f_a_proj.weight"), &w.f_a_proj, r, dm)?;
    check_mat(name("f_b_proj.weight"), &w.f_b_proj, p, r)?;
    check_mat(name("b_proj.weight"), &w.b_proj, h, dm)?;
    check_mat(name("o_proj.weight"), &w.o_proj, dm, p)?;
    if w.a_log.len() < h {
        return Err(ModelError::Shape {
            tensor: name("A_log"),
            expected: format!("at least {h} entries (one per head)"),
            found: format!("[{}]", w.a_log.len()),
        });
    }
    check_vec(name("dt_bias"), &w.dt_bias, p)?;
    check_vec(name("o_norm.weight"), &w.o_norm, hd)?;
    Ok(())
}

fn validate_mla(
    d: &ModelDims,
    w: &MlaWeights,
    name: &dyn Fn(&str) -> String,
) -> Result<(), ModelError> {
    let dm = d.hidden_size;
    let h = d.mla_heads;
    check_mat(name("q_a_proj.weight"), &w.q_a_proj, d.q_lora_rank, dm)?;
    check_vec(
        name("q_a_layernorm.weight"),
        &w.q_a_layernorm,
        d.q_lora_rank,
    )?;
    check_mat(
        name("q_b_proj.weight"),
        &w.q_b_proj,
        h * d.mla_qk_head_dim(),
        d.q_lora_rank,
    )?;
    check_mat(
        name("kv_a_proj_with_mqa.weight"),
        &w.kv_a_proj,
        d.kv_lora_rank + d.qk_rope_head_dim,
        dm,
    )?;
    check_vec(
        name("kv_a_layernorm.weight"),
        &w.kv_a_layernorm,
        d.kv_lora_rank,
    )?;
    check_mat(
        name("kv_b_proj.weight"),
        &w.kv_b_proj,
        h * (d.qk_nope_head_dim + d.v_head_dim),
        d.kv_lora_rank,
    )?;
    check_mat(name("g_proj.weight"), &w.g_proj, h * d.v_head_dim, dm)?;
    check_mat(name("o_proj.weight"), &w.o_proj, dm, h * d.v_head_dim)?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::attn_res::tests::attn_res64;
    use crate::kda::tests::{Kda64, kda64_step, random_kda};
    use crate::mla::tests::{Mla64, mla64_step, random_mla};
    use crate::moe::InMemoryExperts;
    use crate::moe::tests::{moe64, random_experts, random_moe};
    use crate::situ::SituMlp;
    use crate::situ::tests::situ_mlp64;
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
            routed_scaling_factor: 1.0,
            situ_beta: 4.0,
            situ_linear_beta: 25.0,
            rms_norm_eps: 1e-5,
            attn_res_eps: 1e-5,
            kda_o_norm_eps: 1e-5,
            routed_expert_norm_eps: 1e-5,
            mla_norm_eps: 1e-6,
            kda_l2_eps: 1e-6,
            router_renorm_eps: 1e-20,
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
        let dims = ModelDims {
            mla_cache_dtype: CacheDtype::F32,
            ..tiny_dims()
        };
        let (model, _) = random_model_with(dims, 1);
        for &n in &[1usize, 7, 70, 130] {
            let (max, mean) = prefill_vs_decode(&model, n);
            eprintln!("f32 cache n={n}: max {max:.2e} mean {mean:.2e}");
            assert!(
                mean <= 1e-5 && max <= 3e-4,
                "n={n}: f32 cache, prefill vs decode rel L2 max {max} mean {mean}"
            );
        }
        // With the default bf16 cache, f32-level differences upstream occasionally move a
        // cached `ĉ`/`kt` value across a bf16 rounding boundary (one bf16 ulp, 2^-8 relative),
        // which shows up as up to ~2e-4 relative L2 in this tiny model. Bound: mean ≤ 1e-4,
        // max ≤ 1e-3, and the greedy tokens must agree.
        let (model, _) = random_model(1);
        for &n in &[1usize, 7, 70, 130] {
            let (max, mean) = prefill_vs_decode(&model, n);
            eprintln!("bf16 cache n={n}: max {max:.2e} mean {mean:.2e}");
            assert!(
                mean <= 1e-4 && max <= 1e-3,
                "n={n}: bf16 cache, prefill vs decode rel L2 max {max} mean {mean}"
            );
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
        ) -> Result<crate::moe::ExpertWeights, crate::moe::ExpertError> {
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
        // next pass's layer 1 from the provisional token (`crate::next_token`), the same
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
        let head = crate::next_token::ProvisionalHead::build(&model.lm_head).unwrap();
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
        let K3Model {
            dims,
            embed,
            mut layers,
            norm,
            output_res,
            lm_head,
            ..
        } = model;
        if let Attention::Mla(w) = &mut layers[3].attn {
            w.kv_b_proj = w.q_b_proj.clone();
        }
        let e = K3Model::new(
            dims,
            embed,
            layers,
            norm,
            output_res,
            lm_head,
            Box::new(experts),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("model.layers.3.self_attn.kv_b_proj.weight"),
            "{e}"
        );
    }
}
