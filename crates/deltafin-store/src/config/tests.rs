use super::*;

fn real() -> K3Config {
    K3Config::from_json_str(REAL_CONFIG_JSON).unwrap()
}

fn with(edit: impl FnOnce(&mut Value)) -> Result<K3Config, ConfigError> {
    let mut v: Value = serde_json::from_str(REAL_CONFIG_JSON).unwrap();
    edit(&mut v);
    K3Config::from_json_value(v)
}

#[test]
fn real_config_values() {
    let c = real();
    let t = &c.text;
    assert_eq!(c.n_layers(), 93);
    assert_eq!(t.hidden_size, 7168);
    assert_eq!(t.vocab_size, 163840);
    assert_eq!(t.intermediate_size, 33792);
    assert_eq!(t.num_experts, 896);
    assert_eq!(t.num_experts_per_token, 16);
    assert_eq!(t.routed_expert_hidden_size, 3584);
    assert_eq!(t.moe_intermediate_size, 3072);
    assert_eq!(c.shared_intermediate(), 6144);
    assert_eq!(c.kda_width(), 12288);
    assert_eq!((t.q_lora_rank, t.kv_lora_rank), (1536, 512));
    assert_eq!(
        (t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim),
        (128, 64, 128)
    );
    assert_eq!(t.activation_situ_beta, 4.0);
    assert_eq!(t.activation_situ_linear_beta, 25.0);
    assert_eq!(t.rms_norm_eps, 1e-5);
    assert_eq!(t.attn_res_block_size, 12);
    assert_eq!(t.linear_attn.gate_lower_bound, -5.0);
    assert_eq!(t.linear_attn.short_conv_kernel_size, 4);
    assert_eq!(
        (c.bos_token_id, c.eos_token_id, c.pad_token_id),
        (163584, 163586, 163839)
    );
    assert_eq!(c.media_placeholder_token_id, 163605);
    assert_eq!(t.quantization.group_size, 32);
    let mla: Vec<usize> = (0..93)
        .filter(|&l| c.layer_kind(l) == LayerKind::Mla)
        .collect();
    let mut want: Vec<usize> = (3..=91).step_by(4).collect();
    want.push(92);
    assert_eq!(mla, want);
    assert_eq!(mla.len(), 24);
    assert!(c.is_dense(0) && !c.is_dense(1));
    let v = c.vision.as_ref().unwrap();
    assert_eq!(
        (v.vt_hidden_size, v.vt_num_hidden_layers, v.qkv_hidden_size),
        (1024, 27, 1536)
    );
    // Round trip: emitting the unchanged config reproduces the file's JSON value.
    let orig: Value = serde_json::from_str(REAL_CONFIG_JSON).unwrap();
    assert_eq!(c.to_json_value(), orig);
}

#[test]
fn to_json_value_substitutes_dims() {
    let mut c = real();
    c.text.hidden_size = 64;
    let v = c.to_json_value();
    assert_eq!(v["text_config"]["hidden_size"], 64);
    assert_eq!(v["text_config"]["top_k"], 50, "boilerplate kept");
}

#[test]
fn unsupported_values_name_the_field() {
    let e = with(|v| v["text_config"]["hidden_act"] = "gelu".into()).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"text_config.hidden_act: "gelu" is not supported (expected "situ")"#
    );
    let e = with(|v| v["text_config"]["num_expert_group"] = 8.into()).unwrap_err();
    assert!(
        e.to_string().starts_with("text_config.num_expert_group: 8"),
        "{e}"
    );
    let e = with(|v| {
        v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
            ["group_size"] = 16.into()
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("quantization_config.config_groups.group_0.weights.group_size"),
        "{e}"
    );
    let e = with(|v| v["model_type"] = "deepseek_v3".into()).unwrap_err();
    assert!(e.to_string().starts_with("model_type: "), "{e}");
    let e = with(|v| v["text_config"]["mla_use_nope"] = false.into()).unwrap_err();
    assert!(e.to_string().contains("text_config.mla_use_nope"), "{e}");
}

#[test]
fn missing_and_mistyped_fields() {
    let e = with(|v| {
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("kv_lora_rank");
    })
    .unwrap_err();
    assert_eq!(e.to_string(), "missing field `text_config.kv_lora_rank`");
    let e = with(|v| v["text_config"]["hidden_size"] = "big".into()).unwrap_err();
    assert!(
        e.to_string()
            .contains("`text_config.hidden_size`: expected a non-negative integer"),
        "{e}"
    );
    let e = with(|v| {
        v["text_config"]["linear_attn_config"]
            .as_object_mut()
            .unwrap()
            .remove("head_dim");
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "missing field `text_config.linear_attn_config.head_dim`"
    );
}

#[test]
fn cross_field_checks() {
    let e = with(|v| v["text_config"]["num_key_value_heads"] = 8.into()).unwrap_err();
    assert!(e.to_string().contains("num_key_value_heads"), "{e}");
    let e = with(|v| v["text_config"]["moe_intermediate_size"] = 3000.into()).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a multiple of the MXFP4 group size"),
        "{e}"
    );
    let e = with(|v| v["text_config"]["num_experts_per_token"] = 900.into()).unwrap_err();
    assert!(e.to_string().contains("exceeds num_experts"), "{e}");
    // `kda_layers` edited: a layer in neither list, one listed twice, layer 0 (1-based).
    let kda_layers_err = |edit: fn(&mut Vec<Value>)| {
        with(|v| {
            let layers = &mut v["text_config"]["linear_attn_config"]["kda_layers"];
            edit(layers.as_array_mut().unwrap())
        })
        .unwrap_err()
        .to_string()
    };
    let e = kda_layers_err(|l| {
        l.pop();
    });
    assert!(e.contains("layer 91 (1-based) is in neither"), "{e}");
    let e = kda_layers_err(|l| l.push(4.into()));
    assert!(e.contains("layer 4 is listed twice"), "{e}");
    let e = kda_layers_err(|l| l.push(0.into()));
    assert!(e.contains("outside 1..=93"), "{e}");
}

#[test]
fn from_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    std::fs::write(&p, "{").unwrap();
    let e = K3Config::from_file(&p).unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );
    let e = K3Config::from_file(dir.path().join("nope.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.json"), "{e}");
}

#[test]
fn kda_heads_are_independent_of_the_head_dim() {
    // `A_log` is stored padded to a multiple of 128 entries (docs/K3.md §3.2), not as
    // `[head_dim]`: more heads than the head dim, or far fewer, are valid configs.
    use crate::inventory::{StoredShape, text_inventory};
    for (heads, dim, stored) in [(160usize, 128usize, 256usize), (3, 32, 128)] {
        let c = with(|v| {
            let la = &mut v["text_config"]["linear_attn_config"];
            la["num_heads"] = heads.into();
            la["head_dim"] = dim.into();
        })
        .unwrap();
        assert_eq!(c.kda_width(), heads * dim);
        let inv = text_inventory(&c);
        let spec = inv
            .iter()
            .find(|t| t.name == "language_model.model.layers.1.self_attn.A_log")
            .unwrap();
        assert_eq!(spec.shape, vec![stored]);
        assert_eq!(spec.stored, StoredShape::ZeroPadded { used: heads });
        assert!(spec.accepts_shape(&[heads]) && spec.accepts_shape(&[stored + 128]));
        assert!(!spec.accepts_shape(&[heads - 1]) && !spec.accepts_shape(&[1, stored]));
        let norm = inv
            .iter()
            .find(|t| t.name == "language_model.model.layers.1.self_attn.o_norm.weight")
            .unwrap();
        assert_eq!(
            (norm.shape.clone(), norm.stored),
            (vec![dim], StoredShape::Exact)
        );
        assert!(!norm.accepts_shape(&[dim + 1]));
    }
}
