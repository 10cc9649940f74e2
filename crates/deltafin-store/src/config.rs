//! Kimi K3 `config.json` (docs/K3.md §1), parsed strictly.
//!
//! Keys that are read (everything else is transformers boilerplate — `top_k`, `max_length`,
//! `temperature`, `id2label`, `auto_map`, `use_cache`, `initializer_range`, … — and is kept
//! verbatim for [`K3Config::to_json_value`] but never interpreted):
//!
//! - top level: `model_type`, `bos_token_id`, `eos_token_id`, `pad_token_id`,
//!   `media_placeholder_token_id`, `tie_word_embeddings`, `text_config`, `vision_config`
//!   (optional; only its shape fields, for the vision tensor inventory);
//! - `text_config`: the fields of [`TextConfig`] (same names), `linear_attn_config`
//!   ([`LinearAttnConfig`]) and `quantization_config` ([`QuantizationConfig`]).
//!
//! A missing field, a value of the wrong JSON type, or a value the engine does not implement
//! is an error naming the JSON path of the field.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

/// A configuration error. Every variant names the JSON path (or file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("missing field `{field}`")]
    Missing { field: String },
    #[error("`{field}`: expected {expected}, found {found}")]
    Type {
        field: String,
        expected: &'static str,
        found: String,
    },
    #[error("{field}: {value} is not supported (expected {expected})")]
    Unsupported {
        field: String,
        value: String,
        expected: String,
    },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("{path}: {source}")]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<ConfigError>,
    },
}

/// Attention kind of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Kimi Delta Attention (linear attention, §4.3).
    Kda,
    /// Gated multi-head latent attention, NoPE (§4.4).
    Mla,
}

/// `text_config.linear_attn_config` (§1.3). Layer lists are 1-based, as in the file.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinearAttnConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub short_conv_kernel_size: usize,
    pub use_full_rank_gate: bool,
    pub gate_lower_bound: f64,
    pub full_attn_layers: Vec<usize>,
    pub kda_layers: Vec<usize>,
}

/// `text_config.quantization_config` (§1.4); only the MXFP4 pack format is implemented.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizationConfig {
    pub quant_method: String,
    pub format: String,
    pub group_size: usize,
    pub num_bits: usize,
}

/// `text_config` (§1.2). Serialised, it is the file's fields of the same names (the nested
/// configs are written back on their own).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TextConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub mla_use_nope: bool,
    pub mla_use_output_gate: bool,
    pub hidden_act: String,
    pub activation_situ_beta: f64,
    pub activation_situ_linear_beta: f64,
    pub rms_norm_eps: f64,
    pub attn_res_block_size: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub latent_moe_use_norm: bool,
    pub moe_router_activation_func: String,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f64,
    pub topk_method: String,
    pub use_grouped_topk: bool,
    pub num_expert_group: usize,
    pub topk_group: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub num_nextn_predict_layers: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    #[serde(skip)]
    pub linear_attn: LinearAttnConfig,
    #[serde(skip)]
    pub quantization: QuantizationConfig,
}

/// Shape fields of `vision_config` (MoonViT); used only to list the vision tensors.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VisionConfig {
    pub patch_size: usize,
    pub vt_hidden_size: usize,
    pub vt_intermediate_size: usize,
    pub vt_num_hidden_layers: usize,
    pub vt_num_attention_heads: usize,
    pub qkv_hidden_size: usize,
    pub init_pos_emb_height: usize,
    pub init_pos_emb_width: usize,
    pub merge_kernel_size: Vec<usize>,
    pub mm_hidden_size: usize,
    pub text_hidden_size: usize,
}

/// The whole K3 `config.json`. Serialised, it is the file's top-level fields of the same
/// names (the nested configs are written back on their own).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct K3Config {
    pub model_type: String,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    pub media_placeholder_token_id: u32,
    pub tie_word_embeddings: bool,
    #[serde(skip)]
    pub text: TextConfig,
    #[serde(skip)]
    pub vision: Option<VisionConfig>,
    #[serde(skip)]
    raw: Value,
}

/// A JSON object with the path that reached it, for error messages.
struct Obj<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

fn type_name(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

impl<'a> Obj<'a> {
    fn child_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }
    fn get(&self, key: &str) -> Result<&'a Value, ConfigError> {
        self.map.get(key).ok_or_else(|| ConfigError::Missing {
            field: self.child_path(key),
        })
    }
    fn type_err(&self, key: &str, expected: &'static str, v: &Value) -> ConfigError {
        ConfigError::Type {
            field: self.child_path(key),
            expected,
            found: type_name(v),
        }
    }
    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        let v = self.get(key)?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| self.type_err(key, "a non-negative integer", v))
    }
    fn u32(&self, key: &str) -> Result<u32, ConfigError> {
        let v = self.get(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| self.type_err(key, "a token id", v))
    }
    fn f64(&self, key: &str) -> Result<f64, ConfigError> {
        let v = self.get(key)?;
        v.as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.type_err(key, "a number", v))
    }
    fn bool(&self, key: &str) -> Result<bool, ConfigError> {
        let v = self.get(key)?;
        v.as_bool()
            .ok_or_else(|| self.type_err(key, "true or false", v))
    }
    fn str(&self, key: &str) -> Result<&'a str, ConfigError> {
        let v = self.get(key)?;
        v.as_str().ok_or_else(|| self.type_err(key, "a string", v))
    }
    fn obj(&self, key: &str) -> Result<Obj<'a>, ConfigError> {
        let v = self.get(key)?;
        let map = v
            .as_object()
            .ok_or_else(|| self.type_err(key, "an object", v))?;
        Ok(Obj {
            path: self.child_path(key),
            map,
        })
    }
    fn usize_list(&self, key: &str) -> Result<Vec<usize>, ConfigError> {
        let v = self.get(key)?;
        let arr = v
            .as_array()
            .ok_or_else(|| self.type_err(key, "an array of integers", v))?;
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| self.type_err(key, "an array of integers", v))
            })
            .collect()
    }
    fn expect_str(&self, key: &str, expected: &str) -> Result<String, ConfigError> {
        let s = self.str(key)?;
        if s != expected {
            return Err(ConfigError::Unsupported {
                field: self.child_path(key),
                value: format!("{s:?}"),
                expected: format!("{expected:?}"),
            });
        }
        Ok(s.to_string())
    }
    fn expect_bool(&self, key: &str, expected: bool) -> Result<bool, ConfigError> {
        self.expect(key, self.bool(key)?, expected)
    }
    fn expect_usize(&self, key: &str, expected: usize) -> Result<usize, ConfigError> {
        self.expect(key, self.usize(key)?, expected)
    }
    /// `value` (read from `key`) must equal the one value the engine implements.
    fn expect<T: PartialEq + ToString>(
        &self,
        key: &str,
        value: T,
        expected: T,
    ) -> Result<T, ConfigError> {
        if value != expected {
            return Err(ConfigError::Unsupported {
                field: self.child_path(key),
                value: value.to_string(),
                expected: expected.to_string(),
            });
        }
        Ok(value)
    }
}

fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

impl K3Config {
    /// Read and validate `config.json`; errors name the file and the field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<K3Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| ConfigError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// Parse and validate a config from JSON text.
    pub fn from_json_str(s: &str) -> Result<K3Config, ConfigError> {
        let v: Value = serde_json::from_str(s).map_err(ConfigError::Json)?;
        Self::from_json_value(v)
    }

    /// Parse and validate a config from a JSON value.
    pub fn from_json_value(raw: Value) -> Result<K3Config, ConfigError> {
        let map = raw.as_object().ok_or_else(|| ConfigError::Type {
            field: "<root>".into(),
            expected: "an object",
            found: type_name(&raw),
        })?;
        let top = Obj {
            path: String::new(),
            map,
        };
        let model_type = top.expect_str("model_type", "kimi_k3")?;
        let t = top.obj("text_config")?;
        let la = t.obj("linear_attn_config")?;
        let linear_attn = LinearAttnConfig {
            num_heads: la.usize("num_heads")?,
            head_dim: la.usize("head_dim")?,
            short_conv_kernel_size: la.usize("short_conv_kernel_size")?,
            use_full_rank_gate: la.expect_bool("use_full_rank_gate", true)?,
            gate_lower_bound: la.f64("gate_lower_bound")?,
            full_attn_layers: la.usize_list("full_attn_layers")?,
            kda_layers: la.usize_list("kda_layers")?,
        };
        let quantization = parse_quantization(&t.obj("quantization_config")?)?;
        let text = TextConfig {
            model_type: t.expect_str("model_type", "kimi_linear")?,
            vocab_size: t.usize("vocab_size")?,
            hidden_size: t.usize("hidden_size")?,
            num_hidden_layers: t.usize("num_hidden_layers")?,
            intermediate_size: t.usize("intermediate_size")?,
            num_attention_heads: t.usize("num_attention_heads")?,
            num_key_value_heads: t.usize("num_key_value_heads")?,
            q_lora_rank: t.usize("q_lora_rank")?,
            kv_lora_rank: t.usize("kv_lora_rank")?,
            qk_nope_head_dim: t.usize("qk_nope_head_dim")?,
            qk_rope_head_dim: t.usize("qk_rope_head_dim")?,
            v_head_dim: t.usize("v_head_dim")?,
            mla_use_nope: t.expect_bool("mla_use_nope", true)?,
            mla_use_output_gate: t.expect_bool("mla_use_output_gate", true)?,
            hidden_act: t.expect_str("hidden_act", "situ")?,
            activation_situ_beta: t.f64("activation_situ_beta")?,
            activation_situ_linear_beta: t.f64("activation_situ_linear_beta")?,
            rms_norm_eps: t.f64("rms_norm_eps")?,
            attn_res_block_size: t.usize("attn_res_block_size")?,
            num_experts: t.usize("num_experts")?,
            num_experts_per_token: t.usize("num_experts_per_token")?,
            num_shared_experts: t.usize("num_shared_experts")?,
            moe_intermediate_size: t.usize("moe_intermediate_size")?,
            routed_expert_hidden_size: t.usize("routed_expert_hidden_size")?,
            latent_moe_use_norm: t.expect_bool("latent_moe_use_norm", true)?,
            moe_router_activation_func: t.expect_str("moe_router_activation_func", "sigmoid")?,
            moe_renormalize: t.expect_bool("moe_renormalize", true)?,
            routed_scaling_factor: t.f64("routed_scaling_factor")?,
            topk_method: t.expect_str("topk_method", "noaux_tc")?,
            use_grouped_topk: t.bool("use_grouped_topk")?,
            num_expert_group: t.expect_usize("num_expert_group", 1)?,
            topk_group: t.expect_usize("topk_group", 1)?,
            first_k_dense_replace: t.expect_usize("first_k_dense_replace", 1)?,
            moe_layer_freq: t.expect_usize("moe_layer_freq", 1)?,
            num_nextn_predict_layers: t.expect_usize("num_nextn_predict_layers", 0)?,
            max_position_embeddings: t.usize("max_position_embeddings")?,
            tie_word_embeddings: t.expect_bool("tie_word_embeddings", false)?,
            bos_token_id: t.u32("bos_token_id")?,
            eos_token_id: t.u32("eos_token_id")?,
            pad_token_id: t.u32("pad_token_id")?,
            linear_attn,
            quantization,
        };
        let vision = match map.get("vision_config") {
            None | Some(Value::Null) => None,
            Some(_) => Some(parse_vision(&top.obj("vision_config")?)?),
        };
        let cfg = K3Config {
            model_type,
            bos_token_id: top.u32("bos_token_id")?,
            eos_token_id: top.u32("eos_token_id")?,
            pad_token_id: top.u32("pad_token_id")?,
            media_placeholder_token_id: top.u32("media_placeholder_token_id")?,
            tie_word_embeddings: top.expect_bool("tie_word_embeddings", false)?,
            text,
            vision,
            raw,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Cross-field checks (§1): layer partition, head counts, MXFP4 divisibility, ids.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = &self.text;
        let la = &t.linear_attn;
        let n = t.num_hidden_layers;
        let positive = [
            ("text_config.vocab_size", t.vocab_size),
            ("text_config.hidden_size", t.hidden_size),
            ("text_config.num_hidden_layers", n),
            ("text_config.intermediate_size", t.intermediate_size),
            ("text_config.num_attention_heads", t.num_attention_heads),
            ("text_config.q_lora_rank", t.q_lora_rank),
            ("text_config.kv_lora_rank", t.kv_lora_rank),
            ("text_config.qk_nope_head_dim", t.qk_nope_head_dim),
            ("text_config.v_head_dim", t.v_head_dim),
            ("text_config.attn_res_block_size", t.attn_res_block_size),
            ("text_config.num_experts", t.num_experts),
            ("text_config.num_experts_per_token", t.num_experts_per_token),
            ("text_config.num_shared_experts", t.num_shared_experts),
            ("text_config.moe_intermediate_size", t.moe_intermediate_size),
            (
                "text_config.routed_expert_hidden_size",
                t.routed_expert_hidden_size,
            ),
            ("text_config.linear_attn_config.num_heads", la.num_heads),
            ("text_config.linear_attn_config.head_dim", la.head_dim),
            (
                "text_config.linear_attn_config.short_conv_kernel_size",
                la.short_conv_kernel_size,
            ),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        // Upper bounds, far above K3's, that keep every size derived from the config (a
        // tensor's bytes, all experts' bytes, a context's cache) well inside u64: a config
        // cannot make an index wrap.
        let bounded = [
            ("text_config.num_hidden_layers", n, 1 << 10),
            ("text_config.vocab_size", t.vocab_size, 1 << 22),
            ("text_config.hidden_size", t.hidden_size, 1 << 17),
            (
                "text_config.intermediate_size",
                t.intermediate_size,
                1 << 18,
            ),
            (
                "text_config.num_attention_heads",
                t.num_attention_heads,
                1 << 12,
            ),
            (
                "text_config.num_key_value_heads",
                t.num_key_value_heads,
                1 << 12,
            ),
            ("text_config.q_lora_rank", t.q_lora_rank, 1 << 16),
            ("text_config.kv_lora_rank", t.kv_lora_rank, 1 << 16),
            ("text_config.qk_nope_head_dim", t.qk_nope_head_dim, 1 << 12),
            ("text_config.qk_rope_head_dim", t.qk_rope_head_dim, 1 << 12),
            ("text_config.v_head_dim", t.v_head_dim, 1 << 12),
            (
                "text_config.attn_res_block_size",
                t.attn_res_block_size,
                1 << 10,
            ),
            ("text_config.num_experts", t.num_experts, 1 << 14),
            (
                "text_config.num_shared_experts",
                t.num_shared_experts,
                1 << 8,
            ),
            (
                "text_config.moe_intermediate_size",
                t.moe_intermediate_size,
                1 << 17,
            ),
            (
                "text_config.routed_expert_hidden_size",
                t.routed_expert_hidden_size,
                1 << 17,
            ),
            (
                "text_config.max_position_embeddings",
                t.max_position_embeddings,
                1 << 32,
            ),
            (
                "text_config.linear_attn_config.num_heads",
                la.num_heads,
                1 << 12,
            ),
            (
                "text_config.linear_attn_config.head_dim",
                la.head_dim,
                1 << 12,
            ),
            (
                "text_config.linear_attn_config.short_conv_kernel_size",
                la.short_conv_kernel_size,
                1 << 6,
            ),
            (
                "text_config.quantization_config.group_size",
                self.text.quantization.group_size,
                1 << 16,
            ),
        ];
        for (field, v, max) in bounded {
            if v > max {
                return Err(invalid(
                    field,
                    format!("{v} exceeds the largest supported, {max}"),
                ));
            }
        }
        if self.text.quantization.group_size == 0 {
            return Err(invalid(
                "text_config.quantization_config.group_size",
                "must be positive",
            ));
        }
        if t.num_key_value_heads != t.num_attention_heads {
            return Err(ConfigError::Unsupported {
                field: "text_config.num_key_value_heads".into(),
                value: t.num_key_value_heads.to_string(),
                expected: format!("num_attention_heads = {}", t.num_attention_heads),
            });
        }
        if t.num_experts_per_token > t.num_experts {
            return Err(invalid(
                "text_config.num_experts_per_token",
                format!(
                    "{} exceeds num_experts = {}",
                    t.num_experts_per_token, t.num_experts
                ),
            ));
        }
        let g = self.text.quantization.group_size;
        for (field, v) in [
            (
                "text_config.routed_expert_hidden_size",
                t.routed_expert_hidden_size,
            ),
            ("text_config.moe_intermediate_size", t.moe_intermediate_size),
        ] {
            if v % g != 0 {
                return Err(invalid(
                    field,
                    format!("{v} is not a multiple of the MXFP4 group size {g}"),
                ));
            }
        }
        if la.gate_lower_bound >= 0.0 {
            return Err(invalid(
                "text_config.linear_attn_config.gate_lower_bound",
                format!("{} must be negative", la.gate_lower_bound),
            ));
        }
        if t.first_k_dense_replace > n {
            return Err(invalid(
                "text_config.first_k_dense_replace",
                format!(
                    "{} exceeds num_hidden_layers = {n}",
                    t.first_k_dense_replace
                ),
            ));
        }
        // full_attn_layers ∪ kda_layers must be exactly a partition of 1..=n (1-based).
        let mut seen = vec![None::<&str>; n + 1];
        for (list, name) in [
            (&la.full_attn_layers, "full_attn_layers"),
            (&la.kda_layers, "kda_layers"),
        ] {
            let field = format!("text_config.linear_attn_config.{name}");
            for &l in list {
                if l == 0 || l > n {
                    return Err(invalid(
                        &field,
                        format!("layer {l} is outside 1..={n} (the lists are 1-based)"),
                    ));
                }
                if let Some(prev) = seen[l] {
                    return Err(invalid(
                        &field,
                        format!("layer {l} is listed twice (also in {prev})"),
                    ));
                }
                seen[l] = Some(name);
            }
        }
        if let Some(l) = (1..=n).find(|&l| seen[l].is_none()) {
            return Err(invalid(
                "text_config.linear_attn_config",
                format!("layer {l} (1-based) is in neither full_attn_layers nor kda_layers"),
            ));
        }
        for (field, a, b) in [
            (
                "text_config.bos_token_id",
                t.bos_token_id,
                self.bos_token_id,
            ),
            (
                "text_config.eos_token_id",
                t.eos_token_id,
                self.eos_token_id,
            ),
            (
                "text_config.pad_token_id",
                t.pad_token_id,
                self.pad_token_id,
            ),
        ] {
            if a != b {
                return Err(invalid(
                    field,
                    format!("{a} differs from the top-level value {b}"),
                ));
            }
            if a as usize >= t.vocab_size {
                return Err(invalid(
                    field,
                    format!("{a} is outside the vocabulary ({})", t.vocab_size),
                ));
            }
        }
        if let Some(v) = &self.vision
            && v.text_hidden_size != t.hidden_size
        {
            return Err(invalid(
                "vision_config.text_hidden_size",
                format!(
                    "{} differs from text_config.hidden_size = {}",
                    v.text_hidden_size, t.hidden_size
                ),
            ));
        }
        Ok(())
    }

    /// Number of decoder layers.
    pub fn n_layers(&self) -> usize {
        self.text.num_hidden_layers
    }

    /// Attention kind of 0-based layer `l` (from the 1-based `full_attn_layers`).
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        if self.text.linear_attn.full_attn_layers.contains(&(l + 1)) {
            LayerKind::Mla
        } else {
            LayerKind::Kda
        }
    }

    /// Whether 0-based layer `l` has the dense MLP (`l < first_k_dense_replace`) rather than
    /// the latent MoE.
    pub fn is_dense(&self, l: usize) -> bool {
        l < self.text.first_k_dense_replace
    }

    /// KDA projection width `num_heads · head_dim` (12,288 for K3).
    pub fn kda_width(&self) -> usize {
        self.text.linear_attn.num_heads * self.text.linear_attn.head_dim
    }

    /// Fused shared-expert width `num_shared_experts · moe_intermediate_size`.
    pub fn shared_intermediate(&self) -> usize {
        self.text.num_shared_experts * self.text.moe_intermediate_size
    }

    /// The full JSON document: every field of the file this config was parsed from, with
    /// the typed fields (possibly changed, e.g. scaled for synthesis) written back.
    pub fn to_json_value(&self) -> Value {
        let mut raw = self.raw.clone();
        if let Value::Object(top) = &mut raw {
            write_back(top, self);
            if let Some(Value::Object(tc)) = top.get_mut("text_config") {
                write_back(tc, &self.text);
                if let Some(Value::Object(lc)) = tc.get_mut("linear_attn_config") {
                    write_back(lc, &self.text.linear_attn);
                }
            }
            if let (Some(v), Some(Value::Object(vc))) = (&self.vision, top.get_mut("vision_config"))
            {
                write_back(vc, v);
            }
        }
        raw
    }
}

/// Overwrite (in place, keeping the key order) the fields of `obj` that `typed` serialises.
/// The config structs hold only numbers, strings, booleans and lists of numbers, whose
/// serialisation cannot fail.
fn write_back(obj: &mut Map<String, Value>, typed: &impl Serialize) {
    if let Ok(Value::Object(fields)) = serde_json::to_value(typed) {
        obj.extend(fields);
    }
}

fn parse_quantization(q: &Obj<'_>) -> Result<QuantizationConfig, ConfigError> {
    let quant_method = q.expect_str("quant_method", "compressed-tensors")?;
    let format = q.expect_str("format", "mxfp4-pack-quantized")?;
    let groups = q.obj("config_groups")?;
    if groups.map.is_empty() {
        return Err(invalid(&groups.path, "no quantization group"));
    }
    let mut group_size = 0;
    let mut num_bits = 0;
    for key in groups.map.keys() {
        let g = groups.obj(key)?;
        g.expect_str("format", "mxfp4-pack-quantized")?;
        let w = g.obj("weights")?;
        num_bits = w.expect_usize("num_bits", 4)?;
        group_size = w.expect_usize("group_size", 32)?;
        w.expect_str("type", "float")?;
        w.expect_str("strategy", "group")?;
        w.expect_bool("symmetric", true)?;
        w.expect_str("scale_dtype", "torch.uint8")?;
    }
    Ok(QuantizationConfig {
        quant_method,
        format,
        group_size,
        num_bits,
    })
}

fn parse_vision(v: &Obj<'_>) -> Result<VisionConfig, ConfigError> {
    let merge_kernel_size = v.usize_list("merge_kernel_size")?;
    if merge_kernel_size.len() != 2 {
        return Err(invalid(
            &v.child_path("merge_kernel_size"),
            "must have two entries",
        ));
    }
    Ok(VisionConfig {
        patch_size: v.usize("patch_size")?,
        vt_hidden_size: v.usize("vt_hidden_size")?,
        vt_intermediate_size: v.usize("vt_intermediate_size")?,
        vt_num_hidden_layers: v.usize("vt_num_hidden_layers")?,
        vt_num_attention_heads: v.usize("vt_num_attention_heads")?,
        qkv_hidden_size: v.usize("qkv_hidden_size")?,
        init_pos_emb_height: v.usize("init_pos_emb_height")?,
        init_pos_emb_width: v.usize("init_pos_emb_width")?,
        merge_kernel_size,
        mm_hidden_size: v.usize("mm_hidden_size")?,
        text_hidden_size: v.usize("text_hidden_size")?,
    })
}

/// The real K3 `config.json` (assets/kimi/k3-config.json), embedded for synthesis and tests.
pub const REAL_CONFIG_JSON: &str = include_str!("../../../assets/kimi/k3-config.json");

#[cfg(test)]
mod tests;
