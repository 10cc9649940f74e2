//! Build a [`K3Model`] from a validated [`Checkpoint`]: map `config.json` onto
//! [`ModelDims`], take zero-copy bf16 matrix views of the spine, widen the small vectors to
//! f32, and serve routed experts straight from the shard bytes.

use crate::attn_res::AttnResWeights;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{K3Config, LayerKind};
use crate::dims::{AttnKind, CacheDtype, ModelDims};
use crate::kda::KdaWeights;
use crate::mla::MlaWeights;
use crate::model::{Attention, Ffn, K3Model, Layer, ModelError};
use crate::moe::{ExpertSource, ExpertWeights, MoeWeights};
use crate::router::RouterWeights;
use crate::situ::SituMlp;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// An error while loading a model: the checkpoint or the assembled model is invalid.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Engine choices that are not part of `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineOptions {
    /// Storage type of the MLA latent cache (bf16 by default, §6).
    pub mla_cache_dtype: CacheDtype,
    /// Chunk length of the chunked KDA prefill (64, as FLA).
    pub kda_chunk: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            mla_cache_dtype: CacheDtype::Bf16,
            kda_chunk: 64,
        }
    }
}

/// The model dimensions and constants for `cfg` (k3-model.md §1, epsilons of §5.1).
pub fn dims_from_config(cfg: &K3Config, opts: &EngineOptions) -> ModelDims {
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
        kda_chunk: opts.kda_chunk,
        mla_cache_dtype: opts.mla_cache_dtype,
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

/// Routed experts served from the checkpoint's memory-mapped shards. Each expert's
/// matrices are validated (E8M0 NaN scan) on first use and then reused.
pub struct CheckpointExperts {
    ckpt: Arc<Checkpoint>,
    num_experts: usize,
    cells: Vec<OnceLock<ExpertWeights>>,
}

impl CheckpointExperts {
    pub fn new(ckpt: Arc<Checkpoint>) -> CheckpointExperts {
        let cfg = ckpt.config();
        let num_experts = cfg.text.num_experts;
        let cells = (0..cfg.n_layers() * num_experts)
            .map(|_| OnceLock::new())
            .collect();
        CheckpointExperts {
            ckpt,
            num_experts,
            cells,
        }
    }
}

impl ExpertSource for CheckpointExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ModelError> {
        let err = |message: String| ModelError::Expert {
            layer,
            expert,
            message,
        };
        if expert >= self.num_experts {
            return Err(err(format!(
                "out of range (num_experts = {})",
                self.num_experts
            )));
        }
        let cell = self
            .cells
            .get(layer * self.num_experts + expert)
            .ok_or_else(|| err("layer out of range".into()))?;
        if let Some(w) = cell.get() {
            return Ok(w.clone());
        }
        let m = self
            .ckpt
            .expert_matrices(layer, expert)
            .map_err(|e| err(e.to_string()))?;
        let w = ExpertWeights {
            w1: m.w1,
            w2: m.w2,
            w3: m.w3,
        };
        Ok(cell.get_or_init(|| w).clone())
    }
}

struct Names<'a> {
    ckpt: &'a Checkpoint,
    prefix: String,
}

impl Names<'_> {
    fn mat(&self, name: &str) -> Result<deltafin_tensor::Bf16Matrix, CheckpointError> {
        self.ckpt.bf16_matrix(&format!("{}{name}", self.prefix))
    }
    fn vec(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        self.ckpt.f32_vector(&format!("{}{name}", self.prefix))
    }
    fn attn_res(&self, which: &str) -> Result<AttnResWeights, CheckpointError> {
        Ok(AttnResWeights {
            norm: self.vec(&format!("{which}_norm.weight"))?,
            proj: self.vec(&format!("{which}_proj.weight"))?,
        })
    }
    fn situ(&self, base: &str) -> Result<SituMlp, CheckpointError> {
        Ok(SituMlp {
            gate_proj: self.mat(&format!("{base}.gate_proj.weight"))?,
            up_proj: self.mat(&format!("{base}.up_proj.weight"))?,
            down_proj: self.mat(&format!("{base}.down_proj.weight"))?,
        })
    }
}

fn load_layer(ckpt: &Checkpoint, l: usize) -> Result<Layer, CheckpointError> {
    let cfg = ckpt.config();
    let n = Names {
        ckpt,
        prefix: format!("model.layers.{l}."),
    };
    let attn = match cfg.layer_kind(l) {
        LayerKind::Kda => Attention::Kda(KdaWeights {
            q_proj: n.mat("self_attn.q_proj.weight")?,
            k_proj: n.mat("self_attn.k_proj.weight")?,
            v_proj: n.mat("self_attn.v_proj.weight")?,
            q_conv: n.vec("self_attn.q_conv1d.weight")?,
            k_conv: n.vec("self_attn.k_conv1d.weight")?,
            v_conv: n.vec("self_attn.v_conv1d.weight")?,
            f_a_proj: n.mat("self_attn.f_a_proj.weight")?,
            f_b_proj: n.mat("self_attn.f_b_proj.weight")?,
            b_proj: n.mat("self_attn.b_proj.weight")?,
            a_log: n.vec("self_attn.A_log")?,
            dt_bias: n.vec("self_attn.dt_bias")?,
            g_proj: n.mat("self_attn.g_proj.weight")?,
            o_norm: n.vec("self_attn.o_norm.weight")?,
            o_proj: n.mat("self_attn.o_proj.weight")?,
        }),
        LayerKind::Mla => Attention::Mla(MlaWeights {
            q_a_proj: n.mat("self_attn.q_a_proj.weight")?,
            q_a_layernorm: n.vec("self_attn.q_a_layernorm.weight")?,
            q_b_proj: n.mat("self_attn.q_b_proj.weight")?,
            kv_a_proj: n.mat("self_attn.kv_a_proj_with_mqa.weight")?,
            kv_a_layernorm: n.vec("self_attn.kv_a_layernorm.weight")?,
            kv_b_proj: n.mat("self_attn.kv_b_proj.weight")?,
            g_proj: n.mat("self_attn.g_proj.weight")?,
            o_proj: n.mat("self_attn.o_proj.weight")?,
        }),
    };
    let ffn = if cfg.is_dense(l) {
        Ffn::Dense(n.situ("mlp")?)
    } else {
        Ffn::Moe(MoeWeights {
            router: RouterWeights {
                weight: n.mat("block_sparse_moe.gate.weight")?,
                bias: n.vec("block_sparse_moe.gate.e_score_correction_bias")?,
            },
            latent_down: n.mat("block_sparse_moe.routed_expert_down_proj.weight")?,
            latent_up: n.mat("block_sparse_moe.routed_expert_up_proj.weight")?,
            latent_norm: n.vec("block_sparse_moe.routed_expert_norm.weight")?,
            shared: n.situ("block_sparse_moe.shared_experts")?,
        })
    };
    Ok(Layer {
        attn_res: n.attn_res("self_attention_res")?,
        mlp_res: n.attn_res("mlp_res")?,
        input_layernorm: n.vec("input_layernorm.weight")?,
        post_attention_layernorm: n.vec("post_attention_layernorm.weight")?,
        attn,
        ffn,
    })
}

/// Assemble the model over an opened checkpoint (zero-copy for every matrix).
pub fn load_model(ckpt: Arc<Checkpoint>, opts: &EngineOptions) -> Result<K3Model, LoadError> {
    let dims = dims_from_config(ckpt.config(), opts);
    let layers = (0..ckpt.config().n_layers())
        .map(|l| load_layer(&ckpt, l))
        .collect::<Result<Vec<_>, _>>()?;
    let g = Names {
        ckpt: &ckpt,
        prefix: "model.".into(),
    };
    let embed = g.mat("embed_tokens.weight")?;
    let norm = g.vec("norm.weight")?;
    let output_res = g.attn_res("output_attn_res")?;
    let lm_head = ckpt.bf16_matrix("lm_head.weight")?;
    let experts = Box::new(CheckpointExperts::new(ckpt.clone()));
    Ok(K3Model::new(
        dims, embed, layers, norm, output_res, lm_head, experts,
    )?)
}

/// Open the checkpoint under `root`, validate it, and build the model.
pub fn open_model(root: &Path, opts: &EngineOptions) -> Result<K3Model, LoadError> {
    let ckpt = Arc::new(Checkpoint::open(root)?);
    load_model(ckpt, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::REAL_CONFIG_JSON;

    #[test]
    fn real_config_maps_to_the_k3_dims_and_state_sizes() {
        let cfg = K3Config::from_json_str(REAL_CONFIG_JSON).unwrap();
        let d = dims_from_config(&cfg, &EngineOptions::default());
        d.validate().unwrap();
        assert_eq!(d.num_layers(), 93);
        assert_eq!(d.num_mla_layers(), 24);
        assert_eq!(d.num_kda_layers(), 69);
        assert_eq!(d.attn_kind(0), AttnKind::Kda);
        assert_eq!(d.attn_kind(91), AttnKind::Mla);
        assert_eq!(d.attn_kind(92), AttnKind::Mla);
        assert_eq!(d.shared_intermediate, 6144);
        assert_eq!(d.gate_lower_bound, -5.0);
        assert_eq!(
            (d.mla_norm_eps, d.kda_l2_eps, d.rms_norm_eps),
            (1e-6, 1e-6, 1e-5)
        );
        // §6: 576 bf16 values per token per MLA layer, 24 layers; 443.1 MiB of KDA state.
        assert_eq!(d.mla_cache_bytes_per_token(), 27_648);
        assert_eq!(d.kda_state_bytes(), 464_633_856);
        let f32_cache = dims_from_config(
            &cfg,
            &EngineOptions {
                mla_cache_dtype: CacheDtype::F32,
                ..Default::default()
            },
        );
        assert_eq!(f32_cache.mla_cache_bytes_per_token(), 55_296);
    }
}
