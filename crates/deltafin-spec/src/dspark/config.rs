//! The DSpark `config.json` (docs/K3.md §9.1), parsed strictly: every key is either used or
//! checked against the one value this engine implements; an unknown key is an error.

use super::DsparkError;
use crate::fields::{FieldError, Fields};
use serde_json::Value;
use std::path::Path;

/// Tokens drafted per pass: the query block is `[anchor, mask × (BLOCK − 1)]`.
pub const BLOCK: usize = 7;

/// YaRN RoPE parameters (`rope_parameters`, DeepSeek-V3 convention).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnConfig {
    /// `rope_theta` (base).
    pub rope_theta: f64,
    /// `factor` (context extension).
    pub factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
    /// `beta_fast`.
    pub beta_fast: f64,
    /// `beta_slow`.
    pub beta_slow: f64,
    /// `mscale`.
    pub mscale: f64,
    /// `mscale_all_dim`.
    pub mscale_all_dim: f64,
}

/// A validated DSpark configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct DsparkConfig {
    /// `hidden_size` (must equal the target's: K3's embedding and lm_head are shared).
    pub hidden_size: usize,
    /// `intermediate_size` (SwiGLU width).
    pub intermediate_size: usize,
    /// `num_hidden_layers` (dense MLA decoder layers).
    pub num_hidden_layers: usize,
    /// `num_attention_heads` (= `num_key_value_heads`).
    pub num_attention_heads: usize,
    /// `q_lora_rank`.
    pub q_lora_rank: usize,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim` (the YaRN-rotated tail).
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// `vocab_size` (= `draft_vocab_size`).
    pub vocab_size: usize,
    /// `rms_norm_eps` (every RMSNorm of the drafter).
    pub rms_norm_eps: f32,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `target_hidden_size`.
    pub target_hidden_size: usize,
    /// `target_num_hidden_layers`.
    pub target_num_hidden_layers: usize,
    /// `target_layer_ids` (0-based K3 layers whose partial sums are tapped).
    pub target_layer_ids: Vec<usize>,
    /// `mask_token_id`.
    pub mask_token_id: u32,
    /// `bos_token_id`.
    pub bos_token_id: u32,
    /// `eos_token_id`.
    pub eos_token_id: u32,
    /// `pad_token_id`.
    pub pad_token_id: u32,
    /// `markov_rank`.
    pub markov_rank: usize,
    /// `enable_confidence_head`.
    pub enable_confidence_head: bool,
    /// `confidence_head_with_markov` (the head also reads `markov_w1[prev]`).
    pub confidence_head_with_markov: bool,
    /// `rope_parameters`.
    pub rope: YarnConfig,
}

impl From<FieldError> for DsparkError {
    fn from(e: FieldError) -> Self {
        DsparkError::Config {
            field: e.field,
            message: e.message,
        }
    }
}

impl DsparkConfig {
    /// Parse `config.json` text; errors name the offending field.
    pub fn from_json_str(text: &str) -> Result<DsparkConfig, DsparkError> {
        let v: Value = serde_json::from_str(text).map_err(|e| DsparkError::Config {
            field: "config.json".into(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_json_value(v)
    }

    /// Read and parse `path`.
    pub fn from_file(path: &Path) -> Result<DsparkConfig, DsparkError> {
        let text = std::fs::read_to_string(path).map_err(|source| DsparkError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Parse a JSON value.
    pub fn from_json_value(v: Value) -> Result<DsparkConfig, DsparkError> {
        let Value::Object(map) = v else {
            return Err(DsparkError::Config {
                field: "config.json".into(),
                message: "expected a JSON object".into(),
            });
        };
        let mut f: Fields<DsparkError> = Fields::new("", map);
        let arch = f.take("architectures")?;
        if !arch
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "K3DSparkModel"))
        {
            return Err(f.err("architectures", format!("{arch} lacks `K3DSparkModel`")));
        }
        f.expect_str("model_type", "k3_dspark")?;
        f.string("_torchspec_version")?;
        f.expect_str("torch_dtype", "bfloat16")?;
        let hidden_size = f.positive("hidden_size")?;
        let intermediate_size = f.positive("intermediate_size")?;
        let num_hidden_layers = f.positive("num_hidden_layers")?;
        let num_attention_heads = f.positive("num_attention_heads")?;
        if f.usize("num_key_value_heads")? != num_attention_heads {
            return Err(f.err(
                "num_key_value_heads",
                "must equal num_attention_heads (MLA)",
            ));
        }
        let q_lora_rank = f.positive("q_lora_rank")?;
        let kv_lora_rank = f.positive("kv_lora_rank")?;
        let qk_nope_head_dim = f.positive("qk_nope_head_dim")?;
        let qk_rope_head_dim = f.positive("qk_rope_head_dim")?;
        if !qk_rope_head_dim.is_multiple_of(2) {
            return Err(f.err("qk_rope_head_dim", "must be even (rotated in pairs)"));
        }
        let v_head_dim = f.positive("v_head_dim")?;
        f.expect_bool("mla_use_nope", false)?;
        f.expect_bool("mla_use_output_gate", false)?;
        let vocab_size = f.positive("vocab_size")?;
        if f.usize("draft_vocab_size")? != vocab_size {
            return Err(f.err("draft_vocab_size", "must equal vocab_size"));
        }
        let eps = f.f64("rms_norm_eps")?;
        if eps <= 0.0 {
            return Err(f.err("rms_norm_eps", "must be positive"));
        }
        let max_position_embeddings = f.positive("max_position_embeddings")?;
        let rope_theta = f.f64("rope_theta")?;
        let num_target_layers = f.positive("num_target_layers")?;
        let target_hidden_size = f.positive("target_hidden_size")?;
        let target_num_hidden_layers = f.positive("target_num_hidden_layers")?;
        let ids = f.take("target_layer_ids")?;
        let target_layer_ids: Vec<usize> = ids
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .ok_or_else(|| {
                f.err(
                    "target_layer_ids",
                    format!("expected a list of layer indices, found {ids}"),
                )
            })?;
        if target_layer_ids.len() != num_target_layers {
            return Err(f.err(
                "target_layer_ids",
                format!(
                    "{} ids, num_target_layers is {num_target_layers}",
                    target_layer_ids.len()
                ),
            ));
        }
        if let Some(&l) = target_layer_ids
            .iter()
            .find(|&&l| l >= target_num_hidden_layers)
        {
            return Err(f.err(
                "target_layer_ids",
                format!("layer {l} is outside the target's {target_num_hidden_layers} layers"),
            ));
        }
        let mask_token_id = f.u32("mask_token_id")?;
        let bos_token_id = f.u32("bos_token_id")?;
        let eos_token_id = f.u32("eos_token_id")?;
        let pad_token_id = f.u32("pad_token_id")?;
        for (k, id) in [
            ("mask_token_id", mask_token_id),
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
        ] {
            if id as usize >= vocab_size {
                return Err(f.err(k, format!("{id} is outside the vocabulary of {vocab_size}")));
            }
        }
        let markov_rank = f.positive("markov_rank")?;
        f.expect_str("markov_head_type", "vanilla")?;
        let enable_confidence_head = f.bool("enable_confidence_head")?;
        let confidence_head_with_markov = f.bool("confidence_head_with_markov")?;
        f.expect_bool("tie_word_embeddings", false)?;
        let rp = f.take("rope_parameters")?;
        let Value::Object(rmap) = rp else {
            return Err(f.err("rope_parameters", "expected an object"));
        };
        let mut r: Fields<DsparkError> = Fields::new("rope_parameters.", rmap);
        r.expect_str("rope_type", "yarn")?;
        let rope = YarnConfig {
            rope_theta: r.f64("rope_theta")?,
            factor: r.f64("factor")?,
            original_max_position_embeddings: r.positive("original_max_position_embeddings")?,
            beta_fast: r.f64("beta_fast")?,
            beta_slow: r.f64("beta_slow")?,
            mscale: r.f64("mscale")?,
            mscale_all_dim: r.f64("mscale_all_dim")?,
        };
        if rope.rope_theta != rope_theta {
            return Err(r.err(
                "rope_theta",
                format!(
                    "{} disagrees with the top-level rope_theta {rope_theta}",
                    rope.rope_theta
                ),
            ));
        }
        if rope.rope_theta <= 1.0 {
            return Err(r.err("rope_theta", "must exceed 1"));
        }
        if rope.factor < 1.0 {
            return Err(r.err("factor", "must be at least 1"));
        }
        if rope.beta_fast <= 0.0 || rope.beta_slow <= 0.0 {
            return Err(r.err("beta_fast", "beta_fast and beta_slow must be positive"));
        }
        r.finish()?;
        f.finish()?;
        Ok(DsparkConfig {
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            vocab_size,
            rms_norm_eps: eps as f32,
            max_position_embeddings,
            target_hidden_size,
            target_num_hidden_layers,
            target_layer_ids,
            mask_token_id,
            bos_token_id,
            eos_token_id,
            pad_token_id,
            markov_rank,
            enable_confidence_head,
            confidence_head_with_markov,
            rope,
        })
    }

    /// Query/key head width (`nope + rope`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    const REAL: &str = include_str!("../../../../assets/kimi/dspark-config.json");

    #[test]
    fn parses_the_real_config() {
        let c = DsparkConfig::from_json_str(REAL).unwrap();
        assert_eq!(c.hidden_size, 7168);
        assert_eq!(c.intermediate_size, 14336);
        assert_eq!(c.num_hidden_layers, 5);
        assert_eq!(c.num_attention_heads, 64);
        assert_eq!(c.qk_head_dim(), 192);
        assert_eq!(c.target_layer_ids, vec![2, 23, 47, 71, 89]);
        assert_eq!(c.mask_token_id, 163_837);
        assert_eq!(c.markov_rank, 256);
        assert!(c.enable_confidence_head && c.confidence_head_with_markov);
        assert_eq!(c.rope.factor, 32.0);
        assert_eq!(c.rope.original_max_position_embeddings, 32768);
        assert_eq!(c.rms_norm_eps, 1e-5);
    }

    fn edit(f: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        f(v.as_object_mut().unwrap());
        DsparkConfig::from_json_value(v).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_field() {
        let e = edit(|m| {
            m.insert("surprise".into(), 1.into());
        });
        assert!(e.contains("`surprise`") && e.contains("unknown"), "{e}");
        let e = edit(|m| {
            m.remove("kv_lora_rank");
        });
        assert!(e.contains("`kv_lora_rank`") && e.contains("missing"), "{e}");
        let e = edit(|m| {
            m.insert("model_type".into(), "deepseek_v3".into());
        });
        assert!(e.contains("`model_type`"), "{e}");
        let e = edit(|m| {
            m.insert("hidden_size".into(), "big".into());
        });
        assert!(e.contains("`hidden_size`"), "{e}");
        let e = edit(|m| {
            m.insert("mla_use_nope".into(), true.into());
        });
        assert!(e.contains("`mla_use_nope`"), "{e}");
        let e = edit(|m| {
            m.insert(
                "target_layer_ids".into(),
                serde_json::json!([2, 23, 47, 71, 93]),
            );
        });
        assert!(e.contains("`target_layer_ids`") && e.contains("93"), "{e}");
        let e = edit(|m| {
            m.insert("num_target_layers".into(), 4.into());
        });
        assert!(e.contains("`target_layer_ids`"), "{e}");
        let e = edit(|m| {
            m["rope_parameters"]["rope_type"] = "linear".into();
        });
        assert!(e.contains("`rope_parameters.rope_type`"), "{e}");
        let e = edit(|m| {
            m["rope_parameters"]["rope_theta"] = 10000.0.into();
        });
        assert!(e.contains("`rope_parameters.rope_theta`"), "{e}");
        let e = edit(|m| {
            m["rope_parameters"]["extra"] = 1.into();
        });
        assert!(e.contains("`rope_parameters.extra`"), "{e}");
        let e = edit(|m| {
            m.insert("mask_token_id".into(), 163_840.into());
        });
        assert!(e.contains("`mask_token_id`"), "{e}");
    }
}
