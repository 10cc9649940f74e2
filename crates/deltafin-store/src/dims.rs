//! Model dimensions, the layer schedule and the numeric constants the forward pass uses.
//!
//! [`ModelDims`] is filled from `config.json` ([`ModelDims::from_config`]); the model never
//! hard-codes the released sizes. Every epsilon is a field so that an oracle comparison can switch it
//! (docs/K3.md §5.1, §5.3).

use crate::config::{K3Config, LayerKind};

/// Inconsistent dimensions ([`ModelDims::validate`]); `deltafin_k3::ModelError::Dims` carries
/// the same message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model dimensions: {0}")]
pub struct DimsError(pub String);

/// Which attention block a layer runs (docs/K3.md §1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Kimi Delta Attention (§4.3).
    Kda,
    /// Gated MLA, NoPE (§4.4).
    Mla,
}

/// Which feed-forward block a layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// Dense SiTU-GLU MLP (§4.7; layers `< first_k_dense`).
    Dense,
    /// Latent MoE (§4.6).
    Moe,
}

/// Storage type of the MLA latent cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheDtype {
    /// bf16 (the default: 27,648 B per token for K3).
    Bf16,
    /// f32 (twice the memory; results independent of bf16 rounding of `ĉ`/`kt`).
    F32,
}

/// All sizes and constants of the K3 text model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDims {
    /// `vocab_size` (Nv).
    pub vocab_size: usize,
    /// `hidden_size` (D).
    pub hidden_size: usize,
    /// Attention kind of every layer; its length is the number of layers.
    pub attn_kinds: Vec<AttnKind>,
    /// `first_k_dense_replace`: layers `0..first_k_dense` use the dense MLP.
    pub first_k_dense: usize,
    /// `attn_res_block_size`: a snapshot is taken entering layers `l ≡ 0 (mod block)`.
    pub attn_res_block_size: usize,

    /// KDA `num_heads`.
    pub kda_heads: usize,
    /// KDA `head_dim` (key and value width per head).
    pub kda_head_dim: usize,
    /// `short_conv_kernel_size`.
    pub conv_kernel: usize,
    /// `gate_lower_bound` (−5 for K3).
    pub gate_lower_bound: f32,
    /// Chunk length of the chunked KDA prefill (64, as FLA).
    pub kda_chunk: usize,
    /// Storage type of the MLA cache (an engine choice, not a config field; bf16 default).
    pub mla_cache_dtype: CacheDtype,

    /// MLA `num_attention_heads`.
    pub mla_heads: usize,
    /// `q_lora_rank`.
    pub q_lora_rank: usize,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim` (the unrotated shared key tail).
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,

    /// `intermediate_size` of the dense MLP.
    pub dense_intermediate: usize,
    /// Fused shared-expert width (`num_shared_experts × moe_intermediate_size`).
    pub shared_intermediate: usize,
    /// `moe_intermediate_size` (F).
    pub moe_intermediate: usize,
    /// `routed_expert_hidden_size` (Lr).
    pub latent_size: usize,
    /// `num_experts`.
    pub num_experts: usize,
    /// `num_experts_per_token`.
    pub experts_per_token: usize,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f32,
    /// `activation_situ_beta` (β₁).
    pub situ_beta: f32,
    /// `activation_situ_linear_beta` (β₂).
    pub situ_linear_beta: f32,

    /// `rms_norm_eps`: input/post-attention layernorms and `model.norm` (1e-5).
    pub rms_norm_eps: f32,
    /// AttnRes key norm epsilon (1e-5).
    pub attn_res_eps: f32,
    /// KDA gated `o_norm` epsilon (1e-5).
    pub kda_o_norm_eps: f32,
    /// `routed_expert_norm` epsilon (1e-5).
    pub routed_expert_norm_eps: f32,
    /// MLA `q_a_layernorm` / `kv_a_layernorm` epsilon (1e-6 in the reference).
    pub mla_norm_eps: f32,
    /// KDA q/k L2-norm epsilon, inside the root (1e-6).
    pub kda_l2_eps: f32,
    /// Router renormalisation epsilon added to the weight sum (1e-20).
    pub router_renorm_eps: f32,
}

impl ModelDims {
    /// The dimensions and constants of `cfg` (docs/K3.md §1, epsilons of §5.1), with the two
    /// engine choices that are not part of `config.json` at their defaults: a bf16 MLA cache
    /// and KDA chunks of 64 (`loader::dims_from_config` sets them from the engine options).
    pub fn from_config(cfg: &K3Config) -> ModelDims {
        let t = &cfg.text;
        let attn_kinds = (0..cfg.n_layers())
            .map(|l| match cfg.layer_kind(l) {
                LayerKind::Kda => AttnKind::Kda,
                LayerKind::Mla => AttnKind::Mla,
            })
            .collect();
        let rms = t.rms_norm_eps as f32;
        ModelDims {
            vocab_size: t.vocab_size,
            hidden_size: t.hidden_size,
            attn_kinds,
            first_k_dense: t.first_k_dense_replace,
            attn_res_block_size: t.attn_res_block_size,
            kda_heads: t.linear_attn.num_heads,
            kda_head_dim: t.linear_attn.head_dim,
            conv_kernel: t.linear_attn.short_conv_kernel_size,
            gate_lower_bound: t.linear_attn.gate_lower_bound as f32,
            kda_chunk: 64,
            mla_cache_dtype: CacheDtype::Bf16,
            mla_heads: t.num_attention_heads,
            q_lora_rank: t.q_lora_rank,
            kv_lora_rank: t.kv_lora_rank,
            qk_nope_head_dim: t.qk_nope_head_dim,
            qk_rope_head_dim: t.qk_rope_head_dim,
            v_head_dim: t.v_head_dim,
            dense_intermediate: t.intermediate_size,
            shared_intermediate: cfg.shared_intermediate(),
            moe_intermediate: t.moe_intermediate_size,
            latent_size: t.routed_expert_hidden_size,
            num_experts: t.num_experts,
            experts_per_token: t.num_experts_per_token,
            routed_scaling_factor: t.routed_scaling_factor as f32,
            situ_beta: t.activation_situ_beta as f32,
            situ_linear_beta: t.activation_situ_linear_beta as f32,
            rms_norm_eps: rms,
            // The AttnRes key norm, KDA o_norm and routed_expert_norm use rms_norm_eps (1e-5);
            // the MLA latent norms and the KDA L2 norm use the reference's 1e-6 (§5.1).
            attn_res_eps: rms,
            kda_o_norm_eps: rms,
            routed_expert_norm_eps: rms,
            mla_norm_eps: 1e-6,
            kda_l2_eps: 1e-6,
            router_renorm_eps: 1e-20,
        }
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.attn_kinds.len()
    }
    /// Attention kind of layer `l`.
    pub fn attn_kind(&self, l: usize) -> AttnKind {
        self.attn_kinds[l]
    }
    /// FFN kind of layer `l`.
    pub fn ffn_kind(&self, l: usize) -> FfnKind {
        if l < self.first_k_dense {
            FfnKind::Dense
        } else {
            FfnKind::Moe
        }
    }
    /// KDA projection width `H·d`.
    pub fn kda_width(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }
    /// The MLA head sizes `(heads, qk_nope, qk_rope, v, kv_lora)` (docs/K3.md §4.4), in the
    /// order the absorbed-attention kernels take them.
    pub fn mla_head_sizes(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.mla_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        )
    }
    /// MLA query width per head (`nope + rope`).
    pub fn mla_qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Number of MLA layers.
    pub fn num_mla_layers(&self) -> usize {
        self.attn_kinds
            .iter()
            .filter(|&&k| k == AttnKind::Mla)
            .count()
    }
    /// Number of KDA layers.
    pub fn num_kda_layers(&self) -> usize {
        self.num_layers() - self.num_mla_layers()
    }
    /// MLA cache values per token per layer: `ĉ` (kv_lora) + tail (rope).
    pub fn mla_cache_values_per_token_layer(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
    /// Bytes per cached value of the MLA cache.
    pub fn mla_cache_value_bytes(&self) -> usize {
        match self.mla_cache_dtype {
            CacheDtype::Bf16 => 2,
            CacheDtype::F32 => 4,
        }
    }
    /// MLA cache bytes per token over all MLA layers: 27,648 B for K3 with bf16 storage.
    pub fn mla_cache_bytes_per_token(&self) -> usize {
        self.num_mla_layers()
            * self.mla_cache_values_per_token_layer()
            * self.mla_cache_value_bytes()
    }
    /// KDA recurrent state values per layer (`H × d × d`, f32).
    pub fn kda_recurrent_values(&self) -> usize {
        self.kda_heads * self.kda_head_dim * self.kda_head_dim
    }
    /// KDA convolution history values per layer (3 streams × width × (kernel − 1), f32).
    pub fn kda_conv_values(&self) -> usize {
        3 * self.kda_width() * self.conv_kernel.saturating_sub(1)
    }
    /// KDA state bytes per layer (recurrent + conv history, f32): 6,733,824 B for K3.
    pub fn kda_state_bytes_per_layer(&self) -> usize {
        (self.kda_recurrent_values() + self.kda_conv_values()) * 4
    }
    /// KDA state bytes over all KDA layers (constant in the context length).
    pub fn kda_state_bytes(&self) -> usize {
        self.num_kda_layers() * self.kda_state_bytes_per_layer()
    }

    /// Check internal consistency: non-zero sizes, the MXFP4 32-multiple rule on expert
    /// widths, `experts_per_token ≤ num_experts`, a non-empty schedule.
    pub fn validate(&self) -> Result<(), DimsError> {
        let bad = |m: String| Err(DimsError(m));
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers()),
            ("attn_res_block_size", self.attn_res_block_size),
            ("kda_heads", self.kda_heads),
            ("kda_head_dim", self.kda_head_dim),
            ("conv_kernel", self.conv_kernel),
            ("kda_chunk", self.kda_chunk),
            ("mla_heads", self.mla_heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("dense_intermediate", self.dense_intermediate),
            ("shared_intermediate", self.shared_intermediate),
            ("moe_intermediate", self.moe_intermediate),
            ("latent_size", self.latent_size),
            ("num_experts", self.num_experts),
            ("experts_per_token", self.experts_per_token),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.experts_per_token > self.num_experts {
            return bad(format!(
                "experts_per_token {} exceeds num_experts {}",
                self.experts_per_token, self.num_experts
            ));
        }
        for (name, v) in [
            ("latent_size", self.latent_size),
            ("moe_intermediate", self.moe_intermediate),
        ] {
            if !v.is_multiple_of(deltafin_tensor::mxfp4::GROUP) {
                return bad(format!(
                    "{name} {v} is not a multiple of the MXFP4 group size 32"
                ));
            }
        }
        if self.first_k_dense > self.num_layers() {
            return bad(format!(
                "first_k_dense {} exceeds the {} layers",
                self.first_k_dense,
                self.num_layers()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released K3 dimensions, written out by hand from docs/K3.md §1.
    fn k3_dims() -> ModelDims {
        let attn_kinds = (0..93)
            .map(|l| {
                if l % 4 == 3 || l == 92 {
                    AttnKind::Mla
                } else {
                    AttnKind::Kda
                }
            })
            .collect();
        ModelDims {
            vocab_size: 163_840,
            hidden_size: 7168,
            attn_kinds,
            first_k_dense: 1,
            attn_res_block_size: 12,
            kda_heads: 96,
            kda_head_dim: 128,
            conv_kernel: 4,
            gate_lower_bound: -5.0,
            kda_chunk: 64,
            mla_cache_dtype: CacheDtype::Bf16,
            mla_heads: 96,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            dense_intermediate: 33_792,
            shared_intermediate: 6144,
            moe_intermediate: 3072,
            latent_size: 3584,
            num_experts: 896,
            experts_per_token: 16,
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

    #[test]
    fn the_released_config_gives_the_hand_written_dims() {
        let cfg = K3Config::from_json_str(crate::config::REAL_CONFIG_JSON).unwrap();
        assert_eq!(ModelDims::from_config(&cfg), k3_dims());
    }

    #[test]
    fn k3_state_sizes_match_spec() {
        let d = k3_dims();
        d.validate().unwrap();
        assert_eq!(d.num_mla_layers(), 24);
        assert_eq!(d.num_kda_layers(), 69);
        assert_eq!(d.mla_cache_bytes_per_token(), 27_648);
        assert_eq!(d.kda_recurrent_values(), 1_572_864);
        assert_eq!(d.kda_conv_values(), 110_592);
        assert_eq!(d.kda_state_bytes_per_layer(), 6_291_456 + 442_368);
        assert_eq!(d.kda_state_bytes(), 464_633_856);
        let f32_cache = ModelDims {
            mla_cache_dtype: CacheDtype::F32,
            ..d
        };
        assert_eq!(f32_cache.mla_cache_bytes_per_token(), 55_296);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let mut d = k3_dims();
        d.latent_size = 3585;
        let e = d.validate().unwrap_err().to_string();
        assert!(e.contains("latent_size"), "{e}");
        let mut d = k3_dims();
        d.experts_per_token = 900;
        assert!(
            d.validate()
                .unwrap_err()
                .to_string()
                .contains("experts_per_token")
        );
    }
}
