//! One decoder layer's weights: the attention block ([`Attention`]), the feed-forward block
//! ([`Ffn`]) and the Attention Residuals and norms around them ([`Layer`]).
//!
//! Shared by the layer loop ([`crate::model::forward`]) and the code that fills or swaps a
//! layer's projections (the loader, spine streaming, device offload, the huge-page copy).

use crate::model::attn_res::AttnResWeights;
use crate::model::kda::KdaWeights;
use crate::model::linear::Linear;
use crate::model::mla::MlaWeights;
use crate::model::moe::MoeWeights;
use crate::model::situ::{DenseMlp, SituMlp};
use deltafin_store::inventory::name;

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
    /// Latent MoE (its routed experts come from the model's
    /// [`ExpertSource`](crate::model::moe::ExpertSource)).
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

/// Every spine projection of a layer (a [`Linear`]) with its name under
/// `model.layers.{l}.`, in a fixed order.
pub fn linears_mut(layer: &mut Layer) -> Vec<(&'static str, &mut Linear)> {
    let mut out: Vec<(&'static str, &mut Linear)> = Vec::new();
    match &mut layer.attn {
        Attention::Kda(k) => {
            use name::kda::*;
            out.push((Q_PROJ, &mut k.q_proj));
            out.push((K_PROJ, &mut k.k_proj));
            out.push((V_PROJ, &mut k.v_proj));
            out.push((F_A_PROJ, &mut k.f_a_proj));
            out.push((F_B_PROJ, &mut k.f_b_proj));
            out.push((B_PROJ, &mut k.b_proj));
            out.push((G_PROJ, &mut k.g_proj));
            out.push((O_PROJ, &mut k.o_proj));
        }
        Attention::Mla(m) => {
            use name::mla::*;
            out.push((Q_A_PROJ, &mut m.q_a_proj));
            out.push((Q_B_PROJ, &mut m.q_b_proj));
            out.push((KV_A_PROJ, &mut m.kv_a_proj));
            out.push((KV_B_PROJ, &mut m.kv_b_proj));
            out.push((G_PROJ, &mut m.g_proj));
            out.push((O_PROJ, &mut m.o_proj));
        }
    }
    fn situ<'a>(
        names: [&'static str; 3],
        m: &'a mut SituMlp,
        out: &mut Vec<(&'static str, &'a mut Linear)>,
    ) {
        out.push((names[0], &mut m.gate_proj));
        out.push((names[1], &mut m.up_proj));
        out.push((names[2], &mut m.down_proj));
    }
    match &mut layer.ffn {
        Ffn::Dense(m) => situ(name::DENSE, m, &mut out),
        Ffn::Moe(m) => {
            out.push((name::moe::LATENT_DOWN, &mut m.latent_down));
            out.push((name::moe::LATENT_UP, &mut m.latent_up));
            situ(name::moe::SHARED, &mut m.shared, &mut out);
        }
    }
    out
}
