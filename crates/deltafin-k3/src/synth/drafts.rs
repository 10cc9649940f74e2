//! Synthetic draft models: a DSpark-like speculative head for a K3 target and Qwen3-like
//! checkpoints.

use std::path::Path;

use deltafin_tensor::DType;
use serde_json::Value;

use super::k3::*;
use super::spec::*;
use deltafin_store::config::K3Config;
use deltafin_store::inventory::{StoredShape, TensorKind, TensorSpec};

pub(super) fn bf16_spec(name: String, shape: Vec<usize>) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        dtype: DType::BF16,
        shard: 1,
        kind: TensorKind::Spine { layer: None },
        stored: StoredShape::Exact,
    }
}

pub(super) fn plain_init(s: &TensorSpec) -> Init {
    if s.shape.len() == 1 && !s.name.ends_with("bias") {
        Init::Ones
    } else if s.name.contains("embed_tokens") {
        Init::Std(1.0)
    } else {
        let fan_in = s.shape.get(1).copied().unwrap_or(1).max(1) as f32;
        Init::Std(1.0 / fan_in.sqrt())
    }
}

/// The DSpark draft config (assets/kimi/dspark-config.json) scaled to `target`: hidden size
/// and the MLA head dims and ranks from the target, but (as in the release, 64 drafter heads
/// for K3's 96) a head count of its own, about ⅔ of the target's and never equal to it;
/// 5 layers, intermediate 2·hidden, Markov rank 16, tap layers mapped proportionally onto
/// the target depth, the target's special ids.
pub fn dspark_config(target: &K3Config) -> Result<Value, SynthError> {
    let src = std::fs::read_to_string(default_assets_dir().join("dspark-config.json"))
        .map_err(io_err(&default_assets_dir().join("dspark-config.json")))?;
    let mut v: Value = serde_json::from_str(&src)
        .map_err(|e| SynthError::Dims(format!("dspark-config.json: {e}")))?;
    let t = &target.text;
    let n = target.n_layers();
    let real_taps = [2usize, 23, 47, 71, 89];
    let mut taps: Vec<usize> = real_taps.iter().map(|&l| (l * (n - 1) + 46) / 92).collect();
    taps.dedup();
    let set = |v: &mut Value, k: &str, x: Value| v[k] = x;
    set(&mut v, "hidden_size", t.hidden_size.into());
    set(&mut v, "intermediate_size", (2 * t.hidden_size).into());
    let target_heads = t.num_attention_heads;
    let heads = match (2 * target_heads).div_ceil(3) {
        h if h == target_heads => h + 1,
        h => h,
    };
    set(&mut v, "num_attention_heads", heads.into());
    set(&mut v, "num_key_value_heads", heads.into());
    set(&mut v, "q_lora_rank", t.q_lora_rank.into());
    set(&mut v, "kv_lora_rank", t.kv_lora_rank.into());
    set(&mut v, "qk_nope_head_dim", t.qk_nope_head_dim.into());
    set(&mut v, "qk_rope_head_dim", t.qk_rope_head_dim.into());
    set(&mut v, "v_head_dim", t.v_head_dim.into());
    set(&mut v, "vocab_size", t.vocab_size.into());
    set(&mut v, "draft_vocab_size", t.vocab_size.into());
    set(&mut v, "target_hidden_size", t.hidden_size.into());
    set(&mut v, "target_num_hidden_layers", n.into());
    set(&mut v, "num_target_layers", taps.len().into());
    set(&mut v, "target_layer_ids", taps.into());
    set(&mut v, "markov_rank", 16.into());
    // The special ids are the target's; the mask id keeps its offset from the end of the
    // vocabulary, as `scaled_config` does for the target's own ids.
    set(&mut v, "bos_token_id", target.bos_token_id.into());
    set(&mut v, "eos_token_id", target.eos_token_id.into());
    set(&mut v, "pad_token_id", target.pad_token_id.into());
    let mask = v["mask_token_id"].as_u64().unwrap_or(0) as usize;
    let mask = (mask + t.vocab_size)
        .checked_sub(REAL_VOCAB)
        .ok_or_else(|| SynthError::Dims(format!("vocab {} is too small", t.vocab_size)))?;
    set(&mut v, "mask_token_id", mask.into());
    Ok(v)
}

/// Synthesise a DSpark draft checkpoint (config.json + model.safetensors, §9.2 names) that
/// fits `target`.
pub fn synthesize_dspark(
    out_dir: &Path,
    seed: u64,
    target: &K3Config,
) -> Result<SynthReport, SynthError> {
    synthesize_dspark_from_config(out_dir, seed, &dspark_config(target)?)
}

/// Synthesise a DSpark draft checkpoint for the DSpark `config.json` value `v`: every tensor
/// shape is read from it (heads, ranks, head dims, Markov rank, tap count and target hidden
/// size, layers, the confidence head's flags); the loader then checks the config itself.
pub fn synthesize_dspark_from_config(
    out_dir: &Path,
    seed: u64,
    v: &Value,
) -> Result<SynthReport, SynthError> {
    let u = |k: &str| -> Result<usize, SynthError> {
        v[k].as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| SynthError::Dims(format!("DSpark config: `{k}` is not an integer")))
    };
    let flag = |k: &str| v[k].as_bool().unwrap_or(false);
    let (d, inter, h) = (
        u("hidden_size")?,
        u("intermediate_size")?,
        u("num_attention_heads")?,
    );
    let (ql, kvl) = (u("q_lora_rank")?, u("kv_lora_rank")?);
    let (nope, rope, vh) = (
        u("qk_nope_head_dim")?,
        u("qk_rope_head_dim")?,
        u("v_head_dim")?,
    );
    let (vocab, r) = (u("vocab_size")?, u("markov_rank")?);
    let taps = u("num_target_layers")? * u("target_hidden_size")?;
    let mut specs = vec![
        bf16_spec("context_proj.weight".into(), vec![d, taps]),
        bf16_spec("context_norm.weight".into(), vec![d]),
        bf16_spec("embed_tokens.weight".into(), vec![vocab, d]),
        bf16_spec("final_norm.weight".into(), vec![d]),
        bf16_spec("markov_head.markov_w1.weight".into(), vec![vocab, r]),
        bf16_spec("markov_head.markov_w2.weight".into(), vec![vocab, r]),
    ];
    if flag("enable_confidence_head") {
        let width = d + if flag("confidence_head_with_markov") {
            r
        } else {
            0
        };
        specs.push(bf16_spec(
            "confidence_head.proj.weight".into(),
            vec![1, width],
        ));
        specs.push(bf16_spec("confidence_head.proj.bias".into(), vec![1]));
    }
    for n in 0..u("num_hidden_layers")? {
        let p = format!("layers.{n}.");
        for (name, shape) in [
            ("input_layernorm.weight", vec![d]),
            ("post_attention_layernorm.weight", vec![d]),
            ("self_attn.q_a_proj.weight", vec![ql, d]),
            ("self_attn.q_a_layernorm.weight", vec![ql]),
            ("self_attn.q_b_proj.weight", vec![h * (nope + rope), ql]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![kvl + rope, d]),
            ("self_attn.kv_a_layernorm.weight", vec![kvl]),
            ("self_attn.kv_b_proj.weight", vec![h * (nope + vh), kvl]),
            ("self_attn.o_proj.weight", vec![d, h * vh]),
            ("mlp.gate_proj.weight", vec![inter, d]),
            ("mlp.up_proj.weight", vec![inter, d]),
            ("mlp.down_proj.weight", vec![d, inter]),
        ] {
            specs.push(bf16_spec(format!("{p}{name}"), shape));
        }
    }
    single_file(out_dir, v, specs, seed, &plain_init)
}

/// Which Qwen3 Base draft to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QwenSize {
    /// Qwen3-0.6B-Base, scaled to hidden 64, 2 layers.
    Small,
    /// Qwen3-1.7B-Base, scaled to hidden 96, 2 layers.
    Large,
}

/// The Qwen3 config (assets/kimi/qwen3-*-config.json) scaled down; vocabulary kept.
pub fn qwen3_config(size: QwenSize) -> Result<Value, SynthError> {
    let (file, hidden) = match size {
        QwenSize::Small => ("qwen3-0.6b-base-config.json", 64usize),
        QwenSize::Large => ("qwen3-1.7b-base-config.json", 96),
    };
    let path = default_assets_dir().join(file);
    let src = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let mut v: Value =
        serde_json::from_str(&src).map_err(|e| SynthError::Dims(format!("{file}: {e}")))?;
    v["hidden_size"] = hidden.into();
    v["intermediate_size"] = (3 * hidden).into();
    v["num_hidden_layers"] = 2.into();
    v["max_window_layers"] = 2.into();
    v["num_attention_heads"] = 4.into();
    v["num_key_value_heads"] = 2.into();
    v["head_dim"] = 16.into();
    Ok(v)
}

/// Synthesise a Qwen3 draft checkpoint (config.json + model.safetensors, tied embedding).
pub fn synthesize_qwen3(
    out_dir: &Path,
    seed: u64,
    size: QwenSize,
) -> Result<SynthReport, SynthError> {
    let v = qwen3_config(size)?;
    let u = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
    let (d, inter, hd) = (u("hidden_size"), u("intermediate_size"), u("head_dim"));
    let (h, kvh, vocab) = (
        u("num_attention_heads"),
        u("num_key_value_heads"),
        u("vocab_size"),
    );
    let mut specs = vec![
        bf16_spec("model.embed_tokens.weight".into(), vec![vocab, d]),
        bf16_spec("model.norm.weight".into(), vec![d]),
    ];
    for n in 0..u("num_hidden_layers") {
        let p = format!("model.layers.{n}.");
        for (name, shape) in [
            ("input_layernorm.weight", vec![d]),
            ("post_attention_layernorm.weight", vec![d]),
            ("self_attn.q_proj.weight", vec![h * hd, d]),
            ("self_attn.k_proj.weight", vec![kvh * hd, d]),
            ("self_attn.v_proj.weight", vec![kvh * hd, d]),
            ("self_attn.o_proj.weight", vec![d, h * hd]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("mlp.gate_proj.weight", vec![inter, d]),
            ("mlp.up_proj.weight", vec![inter, d]),
            ("mlp.down_proj.weight", vec![d, inter]),
        ] {
            specs.push(bf16_spec(format!("{p}{name}"), shape));
        }
    }
    single_file(out_dir, &v, specs, seed, &plain_init)
}
