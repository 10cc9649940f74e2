//! The expected tensor inventory of a K3 checkpoint, derived from the config alone
//! (docs/K3.md §3.1–§3.2, §3.4). The spine's shapes are stated once, here: the checkpoint
//! checks its tensors against them, the model its weights.
//!
//! Shards (1-based, `N` = number of layers): shard `l + 1` holds all of layer `l` (spine and,
//! for MoE layers, every routed expert); shard `N + 1` the embedding, `lm_head`, final norm and
//! output AttnRes vectors; shard `N + 2` the `mm_projector`; shard `N + 3` the vision tower.
//! Inside a shard, tensors are laid out the way the reference `safetensors` serializer does:
//! by descending dtype alignment (F32, then BF16, then U8), then by name. For the experts this
//! is the **string** order of the expert ids (`0, 1, 10, 100, …`) with each expert's six
//! tensors adjacent in the §3.4 order.

use deltafin_tensor::DType;

use crate::config::K3Config;
use crate::dims::{AttnKind, FfnKind, ModelDims};

/// Prefix of every text-model tensor name.
pub const PREFIX: &str = "language_model.";

/// The names of the spine tensors outside the layers (without [`PREFIX`]), as
/// [`global_spine`] lists them: the embedding, `lm_head`, the final norm and the output
/// Attention Residuals.
pub const EMBED: &str = "model.embed_tokens.weight";
/// The output head (untied from the embedding).
pub const LM_HEAD: &str = "lm_head.weight";
/// The final RMSNorm.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The output Attention Residuals' norm.
pub const OUTPUT_RES_NORM: &str = "model.output_attn_res_norm.weight";
/// The output Attention Residuals' projection.
pub const OUTPUT_RES_PROJ: &str = "model.output_attn_res_proj.weight";

/// The names of a layer's spine tensors, relative to `model.layers.{l}.`: the one place they
/// are spelled. [`layer_spine`] (the shapes), the loader, the model's validation, the spine
/// streamer, the resident copy and the device offload all name a layer's tensors through
/// these.
pub mod name {
    /// The RMSNorm before attention.
    pub const INPUT_NORM: &str = "input_layernorm.weight";
    /// The RMSNorm before the feed-forward block.
    pub const POST_ATTENTION_NORM: &str = "post_attention_layernorm.weight";
    /// The attention block's Attention Residuals norm.
    pub const ATTN_RES_NORM: &str = "self_attention_res_norm.weight";
    /// The attention block's Attention Residuals projection.
    pub const ATTN_RES_PROJ: &str = "self_attention_res_proj.weight";
    /// The feed-forward block's Attention Residuals norm.
    pub const MLP_RES_NORM: &str = "mlp_res_norm.weight";
    /// The feed-forward block's Attention Residuals projection.
    pub const MLP_RES_PROJ: &str = "mlp_res_proj.weight";

    /// Kimi Delta Attention (`self_attn.*` of a KDA layer).
    pub mod kda {
        pub const Q_PROJ: &str = "self_attn.q_proj.weight";
        pub const K_PROJ: &str = "self_attn.k_proj.weight";
        pub const V_PROJ: &str = "self_attn.v_proj.weight";
        pub const Q_CONV: &str = "self_attn.q_conv1d.weight";
        pub const K_CONV: &str = "self_attn.k_conv1d.weight";
        pub const V_CONV: &str = "self_attn.v_conv1d.weight";
        pub const F_A_PROJ: &str = "self_attn.f_a_proj.weight";
        pub const F_B_PROJ: &str = "self_attn.f_b_proj.weight";
        pub const B_PROJ: &str = "self_attn.b_proj.weight";
        pub const A_LOG: &str = "self_attn.A_log";
        pub const DT_BIAS: &str = "self_attn.dt_bias";
        pub const O_NORM: &str = "self_attn.o_norm.weight";
        pub const G_PROJ: &str = "self_attn.g_proj.weight";
        pub const O_PROJ: &str = "self_attn.o_proj.weight";
    }

    /// Gated multi-head latent attention (`self_attn.*` of an MLA layer).
    pub mod mla {
        pub const Q_A_PROJ: &str = "self_attn.q_a_proj.weight";
        pub const Q_A_NORM: &str = "self_attn.q_a_layernorm.weight";
        pub const Q_B_PROJ: &str = "self_attn.q_b_proj.weight";
        pub const KV_A_PROJ: &str = "self_attn.kv_a_proj_with_mqa.weight";
        pub const KV_A_NORM: &str = "self_attn.kv_a_layernorm.weight";
        pub const KV_B_PROJ: &str = "self_attn.kv_b_proj.weight";
        pub const G_PROJ: &str = "self_attn.g_proj.weight";
        pub const O_PROJ: &str = "self_attn.o_proj.weight";
    }

    /// A dense layer's SiTU-GLU (`mlp.*`): gate, up, down.
    pub const DENSE: [&str; 3] = [
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];

    /// A MoE layer's spine (`block_sparse_moe.*`; the routed experts are named by
    /// [`super::ExpertMatrix`]).
    pub mod moe {
        pub const ROUTER: &str = "block_sparse_moe.gate.weight";
        pub const ROUTER_BIAS: &str = "block_sparse_moe.gate.e_score_correction_bias";
        pub const LATENT_DOWN: &str = "block_sparse_moe.routed_expert_down_proj.weight";
        pub const LATENT_UP: &str = "block_sparse_moe.routed_expert_up_proj.weight";
        pub const LATENT_NORM: &str = "block_sparse_moe.routed_expert_norm.weight";
        /// The shared experts' SiTU-GLU: gate, up, down.
        pub const SHARED: [&str; 3] = [
            "block_sparse_moe.shared_experts.gate_proj.weight",
            "block_sparse_moe.shared_experts.up_proj.weight",
            "block_sparse_moe.shared_experts.down_proj.weight",
        ];
    }
}

/// One routed-expert matrix (HF `KimiBlockSparseMLP` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertMatrix {
    /// `w1`: gate, logical `[moe_intermediate, latent]`.
    W1,
    /// `w2`: down, logical `[latent, moe_intermediate]`.
    W2,
    /// `w3`: up, logical `[moe_intermediate, latent]`.
    W3,
}

impl ExpertMatrix {
    /// `w1`, `w2`, `w3`.
    pub fn as_str(self) -> &'static str {
        match self {
            ExpertMatrix::W1 => "w1",
            ExpertMatrix::W2 => "w2",
            ExpertMatrix::W3 => "w3",
        }
    }
}

/// Packed E2M1 codes or E8M0 scales of an MXFP4 matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertPart {
    Packed,
    Scale,
}

impl ExpertPart {
    /// `weight_packed` or `weight_scale`.
    pub fn as_str(self) -> &'static str {
        match self {
            ExpertPart::Packed => "weight_packed",
            ExpertPart::Scale => "weight_scale",
        }
    }
}

/// What a tensor is, for code that walks the inventory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// Any non-expert text weight of layer `Some(l)` or a global one (`None`).
    Spine { layer: Option<usize> },
    /// A routed-expert tensor.
    Expert {
        layer: usize,
        expert: usize,
        matrix: ExpertMatrix,
        part: ExpertPart,
    },
    /// `mm_projector.*` (ignored by the text engine).
    Projector,
    /// `vision_tower.*` (ignored by the text engine).
    Vision,
}

/// `A_log` is stored zero-padded to a multiple of this many entries (docs/K3.md §3.2).
pub const A_LOG_PAD: usize = 128;

/// The reference's stored length of `A_log` for `heads` KDA heads: `heads` rounded up to a
/// multiple of [`A_LOG_PAD`] (128 for K3's 96 heads).
pub fn a_log_stored_len(heads: usize) -> usize {
    heads.div_ceil(A_LOG_PAD) * A_LOG_PAD
}

/// Which stored shapes a checkpoint may hold for a tensor (docs/K3.md §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StoredShape {
    /// Exactly the spec's shape.
    Exact,
    /// A zero-padded vector of which the model reads the first `used` entries (`A_log`: one
    /// per KDA head). The spec's shape is the reference's own layout; any 1-D length of at
    /// least `used` is accepted, and the entries past `used` must be exactly zero (checked
    /// when the values are loaded).
    ZeroPadded { used: usize },
}

/// The stored-shape rule of spine tensor `name` (without the `language_model.` prefix) of a
/// model with dimensions `dims`.
pub fn stored_shape(dims: &ModelDims, name: &str) -> StoredShape {
    if name.ends_with(".self_attn.A_log") {
        StoredShape::ZeroPadded {
            used: dims.kda_heads,
        }
    } else {
        StoredShape::Exact
    }
}

/// The first `used` entries of a zero-padded vector stored as `values`
/// ([`StoredShape::ZeroPadded`]), or why they cannot be taken: fewer than `used` entries, or
/// an entry past them that is not exactly zero.
pub fn unpad(mut values: Vec<f32>, used: usize) -> Result<Vec<f32>, String> {
    if values.len() < used {
        return Err(format!(
            "has {} entries, fewer than the {used} it must hold",
            values.len()
        ));
    }
    if let Some((i, v)) = values
        .iter()
        .enumerate()
        .skip(used)
        .find(|&(_, &v)| v != 0.0)
    {
        return Err(format!(
            "entry {i} is {v}, but the entries past the first {used} are zero padding and must be exactly 0"
        ));
    }
    values.truncate(used);
    Ok(values)
}

/// One expected tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Full name as stored (`language_model.…` for text tensors).
    pub name: String,
    /// The shape the reference writes (what the synthesizer writes and sizes are computed
    /// from); [`TensorSpec::stored`] says which other shapes a checkpoint may hold.
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// 1-based shard index.
    pub shard: usize,
    pub kind: TensorKind,
    pub stored: StoredShape,
}

impl TensorSpec {
    /// Data bytes of [`TensorSpec::shape`].
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }

    /// Whether a checkpoint may store this tensor with shape `found`.
    pub fn accepts_shape(&self, found: &[usize]) -> bool {
        match self.stored {
            StoredShape::Exact => found == self.shape.as_slice(),
            StoredShape::ZeroPadded { used } => matches!(found, [n] if *n >= used),
        }
    }

    /// The accepted shapes, for error messages: `[a, b]`, or `[128] (any [n] with n ≥ 3,
    /// zero past entry 3)`.
    pub fn expected_shape(&self) -> String {
        match self.stored {
            StoredShape::Exact => format!("{:?}", self.shape),
            StoredShape::ZeroPadded { used } => format!(
                "{:?} (or any [n] with n ≥ {used}, zero-padded past the first {used})",
                self.shape
            ),
        }
    }
}

/// Number of shard files (`N + 3`).
pub fn shard_count(cfg: &K3Config) -> usize {
    cfg.n_layers() + 3
}

/// `model-{i:05}-of-{n:06}.safetensors` (1-based `i`), the release naming.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:06}.safetensors")
}

/// The position of a dtype in the reference serializer's `Dtype` enum (increasing alignment);
/// shards are laid out by descending rank, then by name.
fn serializer_rank(d: DType) -> u8 {
    match d {
        DType::Bool => 0,
        DType::U8 => 1,
        DType::I8 => 2,
        DType::I16 => 5,
        DType::U16 => 6,
        DType::F16 => 7,
        DType::BF16 => 8,
        DType::I32 => 9,
        DType::U32 => 10,
        DType::F32 => 11,
        DType::F64 => 12,
        DType::I64 => 13,
        DType::U64 => 14,
    }
}

/// Sort a shard's tensors into the reference serializer's layout order.
pub fn sort_shard(specs: &mut [TensorSpec]) {
    specs.sort_by(|a, b| {
        serializer_rank(b.dtype)
            .cmp(&serializer_rank(a.dtype))
            .then_with(|| a.name.as_bytes().cmp(b.name.as_bytes()))
    });
}

/// Spine tensors of 0-based layer `l` of a model with dimensions `dims`: name (without the
/// `language_model.` prefix), stored shape and dtype. The model checks its weights against
/// this list too (`K3Model::validate`), so a shape is written down once.
pub fn layer_spine(dims: &ModelDims, l: usize) -> Vec<(String, Vec<usize>, DType)> {
    let d = dims.hidden_size;
    let p = format!("model.layers.{l}.");
    let mut v: Vec<(String, Vec<usize>, DType)> = Vec::new();
    let mut add = |name: &str, shape: Vec<usize>, dtype: DType| {
        v.push((format!("{p}{name}"), shape, dtype));
    };
    for n in [
        name::INPUT_NORM,
        name::POST_ATTENTION_NORM,
        name::ATTN_RES_NORM,
        name::MLP_RES_NORM,
    ] {
        add(n, vec![d], DType::BF16);
    }
    add(name::ATTN_RES_PROJ, vec![1, d], DType::BF16);
    add(name::MLP_RES_PROJ, vec![1, d], DType::BF16);
    match dims.attn_kind(l) {
        AttnKind::Kda => {
            use name::kda::*;
            let (h, hd) = (dims.kda_heads, dims.kda_head_dim);
            let w = dims.kda_width();
            for n in [Q_PROJ, K_PROJ, V_PROJ] {
                add(n, vec![w, d], DType::BF16);
            }
            for n in [Q_CONV, K_CONV, V_CONV] {
                add(n, vec![w, 1, dims.conv_kernel], DType::F32);
            }
            add(F_A_PROJ, vec![hd, d], DType::BF16);
            add(F_B_PROJ, vec![w, hd], DType::BF16);
            add(B_PROJ, vec![h, d], DType::BF16);
            add(A_LOG, vec![a_log_stored_len(h)], DType::F32);
            add(DT_BIAS, vec![w], DType::F32);
            add(O_NORM, vec![hd], DType::F32);
            add(G_PROJ, vec![w, d], DType::BF16);
            add(O_PROJ, vec![d, w], DType::BF16);
        }
        AttnKind::Mla => {
            use name::mla::*;
            let h = dims.mla_heads;
            let (q, kv) = (dims.q_lora_rank, dims.kv_lora_rank);
            let v = dims.v_head_dim;
            add(Q_A_PROJ, vec![q, d], DType::BF16);
            add(Q_A_NORM, vec![q], DType::BF16);
            add(Q_B_PROJ, vec![h * dims.mla_qk_head_dim(), q], DType::BF16);
            add(KV_A_PROJ, vec![kv + dims.qk_rope_head_dim, d], DType::BF16);
            add(KV_A_NORM, vec![kv], DType::BF16);
            add(
                KV_B_PROJ,
                vec![h * (dims.qk_nope_head_dim + v), kv],
                DType::BF16,
            );
            add(G_PROJ, vec![h * v, d], DType::BF16);
            add(O_PROJ, vec![d, h * v], DType::BF16);
        }
    }
    let situ = |add: &mut dyn FnMut(&str, Vec<usize>, DType), names: [&str; 3], i: usize| {
        add(names[0], vec![i, d], DType::BF16);
        add(names[1], vec![i, d], DType::BF16);
        add(names[2], vec![d, i], DType::BF16);
    };
    match dims.ffn_kind(l) {
        FfnKind::Dense => situ(&mut add, name::DENSE, dims.dense_intermediate),
        FfnKind::Moe => {
            use name::moe::*;
            let (e, lr) = (dims.num_experts, dims.latent_size);
            add(ROUTER, vec![e, d], DType::BF16);
            add(ROUTER_BIAS, vec![e], DType::F32);
            add(LATENT_DOWN, vec![lr, d], DType::BF16);
            add(LATENT_UP, vec![d, lr], DType::BF16);
            add(LATENT_NORM, vec![lr], DType::BF16);
            situ(&mut add, SHARED, dims.shared_intermediate);
        }
    }
    v
}

/// The spine tensors outside the layers (embedding, `lm_head`, final norm, output AttnRes):
/// name (without the `language_model.` prefix), stored shape and dtype.
pub fn global_spine(dims: &ModelDims) -> Vec<(String, Vec<usize>, DType)> {
    let (v, d) = (dims.vocab_size, dims.hidden_size);
    [
        (EMBED, vec![v, d]),
        (LM_HEAD, vec![v, d]),
        (FINAL_NORM, vec![d]),
        (OUTPUT_RES_NORM, vec![d]),
        (OUTPUT_RES_PROJ, vec![1, d]),
    ]
    .into_iter()
    .map(|(name, shape)| (name.to_string(), shape, DType::BF16))
    .collect()
}

/// One tensor of a routed expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertTensor {
    /// Full name (with the `language_model.` prefix).
    pub name: String,
    pub matrix: ExpertMatrix,
    pub part: ExpertPart,
    /// Stored U8 shape: `[rows, cols/2]` for codes, `[rows, cols/32]` for scales.
    pub shape: [usize; 2],
    /// Byte length (`shape[0] · shape[1]`).
    pub bytes: usize,
}

/// The six tensors of one expert in the §3.4 span order: w1 packed, w1 scale, w2 packed,
/// w2 scale, w3 packed, w3 scale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    pub layer: usize,
    pub expert: usize,
    pub tensors: [ExpertTensor; 6],
}

impl ExpertLayout {
    /// Bytes of the whole expert (17,547,264 for K3).
    pub fn total_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.bytes).sum()
    }
    /// Logical `[rows, cols]` of matrix `m`.
    pub fn logical_shape(cfg: &K3Config, m: ExpertMatrix) -> [usize; 2] {
        let f = cfg.text.moe_intermediate_size;
        let lr = cfg.text.routed_expert_hidden_size;
        match m {
            ExpertMatrix::W1 | ExpertMatrix::W3 => [f, lr],
            ExpertMatrix::W2 => [lr, f],
        }
    }
}

/// Layout of expert `expert` of layer `layer` (names and sizes; no bounds check).
pub fn expert_layout(cfg: &K3Config, layer: usize, expert: usize) -> ExpertLayout {
    let g = cfg.text.quantization.group_size;
    let mk = |m: ExpertMatrix, part: ExpertPart| {
        let [rows, cols] = ExpertLayout::logical_shape(cfg, m);
        let shape = match part {
            ExpertPart::Packed => [rows, cols / 2],
            ExpertPart::Scale => [rows, cols / g],
        };
        ExpertTensor {
            name: format!(
                "{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{expert}.{}.{}",
                m.as_str(),
                part.as_str()
            ),
            matrix: m,
            part,
            shape,
            bytes: shape[0] * shape[1],
        }
    };
    use ExpertMatrix::*;
    use ExpertPart::*;
    ExpertLayout {
        layer,
        expert,
        tensors: [
            mk(W1, Packed),
            mk(W1, Scale),
            mk(W2, Packed),
            mk(W2, Scale),
            mk(W3, Packed),
            mk(W3, Scale),
        ],
    }
}

/// Expert ids in the string order of their decimal names (`0, 1, 10, 100, …`).
pub fn experts_in_string_order(n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..n).collect();
    ids.sort_by_key(|e| e.to_string());
    ids
}

/// The complete text-model inventory (every `language_model.*` tensor) in release order:
/// shards ascending, each shard in serializer layout order.
pub fn text_inventory(cfg: &K3Config) -> Vec<TensorSpec> {
    let n = cfg.n_layers();
    let dims = ModelDims::from_config(cfg);
    let mut out = Vec::new();
    for l in 0..n {
        let mut shard: Vec<TensorSpec> = layer_spine(&dims, l)
            .into_iter()
            .map(|(name, shape, dtype)| TensorSpec {
                stored: stored_shape(&dims, &name),
                name: format!("{PREFIX}{name}"),
                shape,
                dtype,
                shard: l + 1,
                kind: TensorKind::Spine { layer: Some(l) },
            })
            .collect();
        sort_shard(&mut shard);
        out.extend(shard);
        if !cfg.is_dense(l) {
            // U8 sorts after F32/BF16, and within U8 the names sort by expert-id string.
            for e in experts_in_string_order(cfg.text.num_experts) {
                for t in expert_layout(cfg, l, e).tensors {
                    out.push(TensorSpec {
                        name: t.name,
                        shape: t.shape.to_vec(),
                        dtype: DType::U8,
                        shard: l + 1,
                        kind: TensorKind::Expert {
                            layer: l,
                            expert: e,
                            matrix: t.matrix,
                            part: t.part,
                        },
                        stored: StoredShape::Exact,
                    });
                }
            }
        }
    }
    let mut global: Vec<TensorSpec> = global_spine(&dims)
        .into_iter()
        .map(|(name, shape, dtype)| TensorSpec {
            stored: stored_shape(&dims, &name),
            name: format!("{PREFIX}{name}"),
            shape,
            dtype,
            shard: n + 1,
            kind: TensorKind::Spine { layer: None },
        })
        .collect();
    sort_shard(&mut global);
    out.extend(global);
    out
}

/// The `mm_projector` (shard `N + 2`) and `vision_tower` (shard `N + 3`) tensors implied by
/// `vision_config` (empty without one). The text engine never reads them.
pub fn vision_inventory(cfg: &K3Config) -> Vec<TensorSpec> {
    let Some(vc) = &cfg.vision else {
        return Vec::new();
    };
    let n = cfg.n_layers();
    let h = vc.vt_hidden_size;
    let merged = vc.mm_hidden_size * vc.merge_kernel_size.iter().product::<usize>();
    let spec = |name: String, shape: Vec<usize>, shard: usize, kind: TensorKind| TensorSpec {
        name,
        shape,
        dtype: DType::BF16,
        shard,
        kind,
        stored: StoredShape::Exact,
    };
    let mut proj = vec![
        spec(
            "mm_projector.proj.0.weight".into(),
            vec![merged, merged],
            n + 2,
            TensorKind::Projector,
        ),
        spec(
            "mm_projector.proj.2.weight".into(),
            vec![vc.text_hidden_size, merged],
            n + 2,
            TensorKind::Projector,
        ),
        spec(
            "mm_projector.post_norm.weight".into(),
            vec![vc.text_hidden_size],
            n + 2,
            TensorKind::Projector,
        ),
    ];
    sort_shard(&mut proj);
    let mut vis = vec![
        spec(
            "vision_tower.patch_embed.proj.weight".into(),
            vec![h, 3, vc.patch_size, vc.patch_size],
            n + 3,
            TensorKind::Vision,
        ),
        spec(
            "vision_tower.patch_embed.pos_emb.weight".into(),
            vec![vc.init_pos_emb_height, vc.init_pos_emb_width, h],
            n + 3,
            TensorKind::Vision,
        ),
        spec(
            "vision_tower.encoder.final_layernorm.weight".into(),
            vec![h],
            n + 3,
            TensorKind::Vision,
        ),
    ];
    for b in 0..vc.vt_num_hidden_layers {
        let p = format!("vision_tower.encoder.blocks.{b}.");
        for (name, shape) in [
            ("wqkv.weight", vec![3 * vc.qkv_hidden_size, h]),
            ("wo.weight", vec![h, vc.qkv_hidden_size]),
            ("mlp.fc0.weight", vec![vc.vt_intermediate_size, h]),
            ("mlp.fc1.weight", vec![h, vc.vt_intermediate_size]),
            ("norm0.weight", vec![h]),
            ("norm1.weight", vec![h]),
        ] {
            vis.push(spec(format!("{p}{name}"), shape, n + 3, TensorKind::Vision));
        }
    }
    sort_shard(&mut vis);
    proj.extend(vis);
    proj
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::REAL_CONFIG_JSON;
    use std::collections::HashMap;
    use std::io::Read;

    fn real() -> K3Config {
        K3Config::from_json_str(REAL_CONFIG_JSON).unwrap()
    }

    #[test]
    fn real_counts_and_bytes() {
        let cfg = real();
        let inv = text_inventory(&cfg);
        assert_eq!(inv.len(), 497_052);
        let spine: Vec<_> = inv
            .iter()
            .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
            .collect();
        assert_eq!(spine.len(), 2_460);
        let spine_bytes: usize = spine.iter().map(|t| t.byte_len()).sum();
        let expert_bytes: usize = inv
            .iter()
            .filter(|t| matches!(t.kind, TensorKind::Expert { .. }))
            .map(|t| t.byte_len())
            .sum();
        assert_eq!(spine_bytes, 113_509_540_864);
        assert_eq!(expert_bytes, 1_446_456_066_048);
        let vis = vision_inventory(&cfg);
        assert_eq!(vis.len(), 168);
        let vis_bytes: usize = vis.iter().map(|t| t.byte_len()).sum();
        assert_eq!(vis_bytes, 894_717_952);
        assert_eq!(
            spine_bytes + expert_bytes + vis_bytes,
            1_560_860_324_864,
            "metadata.total_size"
        );
        // §3.1 shard table: tensor counts and data bytes.
        let mut per_shard: HashMap<usize, (usize, usize)> = HashMap::new();
        for t in inv.iter().chain(vis.iter()) {
            let e = per_shard.entry(t.shard).or_default();
            e.0 += 1;
            e.1 += t.byte_len();
        }
        assert_eq!(per_shard[&1], (23, 2_341_213_184));
        assert_eq!(per_shard[&2], (5_404, 16_990_092_800)); // layer 1, KDA
        assert_eq!(per_shard[&4], (5_398, 16_566_684_160)); // layer 3, MLA
        assert_eq!(per_shard[&94], (5, 4_697_663_488));
        assert_eq!(per_shard[&95], (3, 92_289_024));
        assert_eq!(per_shard[&96], (165, 802_428_928));
        assert_eq!(expert_layout(&cfg, 5, 7).total_bytes(), 17_547_264);
    }

    #[test]
    fn within_shard_order_follows_the_serializer_rule() {
        let cfg = real();
        let inv = text_inventory(&cfg);
        let shard2: Vec<&TensorSpec> = inv.iter().filter(|t| t.shard == 2).collect();
        // F32 first, then BF16, then the U8 expert block.
        let first_bf16 = shard2.iter().position(|t| t.dtype == DType::BF16).unwrap();
        let first_u8 = shard2.iter().position(|t| t.dtype == DType::U8).unwrap();
        assert!(shard2[..first_bf16].iter().all(|t| t.dtype == DType::F32));
        assert!(shard2[first_u8..].iter().all(|t| t.dtype == DType::U8));
        assert_eq!(shard2[first_u8..].len(), 896 * 6);
        assert!(
            shard2[first_u8]
                .name
                .ends_with("experts.0.w1.weight_packed")
        );
        assert!(
            shard2[first_u8 + 6]
                .name
                .ends_with("experts.1.w1.weight_packed")
        );
        assert!(
            shard2[first_u8 + 12]
                .name
                .ends_with("experts.10.w1.weight_packed")
        );
        assert!(
            shard2[first_u8 + 18]
                .name
                .ends_with("experts.100.w1.weight_packed")
        );
        for w in shard2.windows(2) {
            if w[0].dtype == w[1].dtype {
                assert!(w[0].name < w[1].name);
            }
        }
        let l = expert_layout(&cfg, 1, 10);
        let pos = shard2
            .iter()
            .position(|t| t.name == l.tensors[0].name)
            .unwrap();
        for (k, t) in l.tensors.iter().enumerate() {
            assert_eq!(
                shard2[pos + k].name,
                t.name,
                "expert tensors adjacent in §3.4 order"
            );
        }
    }

    /// The key acceptance test: the inventory equals the text entries of the real weight
    /// map, names and shard files, entry for entry.
    #[test]
    fn real_index_matches_inventory() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../assets/kimi/k3-model.safetensors.index.json.gz"
        );
        let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .unwrap();
        let index: serde_json::Value = serde_json::from_str(&text).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), 497_220);
        let cfg = real();
        let n = shard_count(&cfg);
        let inv = text_inventory(&cfg);
        let vis = vision_inventory(&cfg);
        let mut text_entries = 0;
        let (mut vision, mut projector) = (0, 0);
        for (name, file) in map {
            if name.starts_with(PREFIX) {
                text_entries += 1;
            } else if name.starts_with("vision_tower.") {
                vision += 1;
            } else if name.starts_with("mm_projector.") {
                projector += 1;
            } else {
                panic!("unexpected entry {name} -> {file}");
            }
        }
        assert_eq!((text_entries, vision, projector), (497_052, 165, 3));
        assert_eq!(inv.len(), text_entries);
        for t in inv.iter().chain(vis.iter()) {
            let file = map
                .get(&t.name)
                .unwrap_or_else(|| panic!("{} not in the real index", t.name));
            assert_eq!(
                file.as_str().unwrap(),
                shard_file_name(t.shard, n),
                "{}",
                t.name
            );
        }
        assert_eq!(inv.len() + vis.len(), map.len(), "no extra index entries");
        let total: usize = inv.iter().chain(vis.iter()).map(|t| t.byte_len()).sum();
        assert_eq!(
            index["metadata"]["total_size"].as_u64().unwrap() as usize,
            total
        );
    }
}
