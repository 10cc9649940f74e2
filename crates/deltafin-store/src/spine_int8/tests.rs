use super::*;
use crate::config::{K3Config, REAL_CONFIG_JSON};

#[test]
fn quantized_set_follows_the_exclusion_list_and_spares_the_router() {
    let cfg = K3Config::from_json_str(REAL_CONFIG_JSON).unwrap();
    let q = quantized_tensors(&cfg);
    // 69 KDA × 8 + 24 MLA × 6 + dense 3 + 92 MoE × 5 (latent down/up, shared gate/up/down)
    // = 1,159 per-layer matrices (the original's 1,251 minus the 92 routers) + lm_head.
    assert_eq!(q.len(), 1160);
    let names: Vec<&str> = q.iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"language_model.lm_head.weight"));
    assert!(names.contains(&"language_model.model.layers.0.self_attn.q_proj.weight"));
    assert!(
        names
            .iter()
            .all(|n| !n.ends_with("block_sparse_moe.gate.weight"))
    );
    assert!(names.iter().all(|n| !n.contains("embed_tokens")));
    assert!(
        names
            .iter()
            .all(|n| !EXCLUDED.iter().any(|x| n.contains(x)))
    );
    assert!(!is_quantized("model.layers.1.block_sparse_moe.gate.weight"));
    assert!(is_quantized("model.layers.0.mlp.gate_proj.weight"));
    assert!(!is_quantized("model.layers.1.mlp_res_proj.weight"));
}

#[test]
fn spine_choice_parsing() {
    assert_eq!(
        "auto".parse::<SpineChoice>().unwrap().format(),
        SpineFormat::Int8
    );
    assert_eq!(
        "int8".parse::<SpineChoice>().unwrap().format(),
        SpineFormat::Int8
    );
    assert_eq!(
        "bf16".parse::<SpineChoice>().unwrap().format(),
        SpineFormat::Bf16
    );
    let e = "mixed".parse::<SpineChoice>().unwrap_err();
    assert!(e.contains("research codecs change target weights"), "{e}");
    assert!(
        "fp8"
            .parse::<SpineChoice>()
            .unwrap_err()
            .contains("\"fp8\"")
    );
}
