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
        Attention::Kda(KdaWeights {
            q_proj,
            k_proj,
            v_proj,
            f_a_proj,
            f_b_proj,
            b_proj,
            g_proj,
            o_proj,
            ..
        }) => {
            out.push(("self_attn.q_proj.weight", q_proj));
            out.push(("self_attn.k_proj.weight", k_proj));
            out.push(("self_attn.v_proj.weight", v_proj));
            out.push(("self_attn.f_a_proj.weight", f_a_proj));
            out.push(("self_attn.f_b_proj.weight", f_b_proj));
            out.push(("self_attn.b_proj.weight", b_proj));
            out.push(("self_attn.g_proj.weight", g_proj));
            out.push(("self_attn.o_proj.weight", o_proj));
        }
        Attention::Mla(MlaWeights {
            q_a_proj,
            q_b_proj,
            kv_a_proj,
            kv_b_proj,
            g_proj,
            o_proj,
            ..
        }) => {
            out.push(("self_attn.q_a_proj.weight", q_a_proj));
            out.push(("self_attn.q_b_proj.weight", q_b_proj));
            out.push(("self_attn.kv_a_proj_with_mqa.weight", kv_a_proj));
            out.push(("self_attn.kv_b_proj.weight", kv_b_proj));
            out.push(("self_attn.g_proj.weight", g_proj));
            out.push(("self_attn.o_proj.weight", o_proj));
        }
    }
    fn situ<'a>(
        base: &[&'static str; 3],
        m: &'a mut SituMlp,
        out: &mut Vec<(&'static str, &'a mut Linear)>,
    ) {
        out.push((base[0], &mut m.gate_proj));
        out.push((base[1], &mut m.up_proj));
        out.push((base[2], &mut m.down_proj));
    }
    match &mut layer.ffn {
        Ffn::Dense(m) => situ(
            &[
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ],
            m,
            &mut out,
        ),
        Ffn::Moe(m) => {
            out.push((
                "block_sparse_moe.routed_expert_down_proj.weight",
                &mut m.latent_down,
            ));
            out.push((
                "block_sparse_moe.routed_expert_up_proj.weight",
                &mut m.latent_up,
            ));
            situ(
                &[
                    "block_sparse_moe.shared_experts.gate_proj.weight",
                    "block_sparse_moe.shared_experts.up_proj.weight",
                    "block_sparse_moe.shared_experts.down_proj.weight",
                ],
                &mut m.shared,
                &mut out,
            );
        }
    }
    out
}
