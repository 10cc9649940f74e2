//! A `config.json` with sizes chosen to overflow (`num_hidden_layers` = 2^64 − 1, products of
//! dimensions past `u64`) is an error naming the field, never a panic or a wrapped size.

use deltafin_k3::config::K3Config;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use serde_json::Value;

#[test]
fn overflowing_config_sizes_are_errors() {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 5)).unwrap();
    let text = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let base: Value = serde_json::from_str(&text).unwrap();
    let huge = u64::MAX;
    for (field, value) in [
        ("num_hidden_layers", huge),
        ("hidden_size", huge),
        ("vocab_size", huge),
        ("num_experts", huge),
        ("moe_intermediate_size", huge),
        ("num_attention_heads", huge),
        ("kv_lora_rank", huge),
        ("max_position_embeddings", huge),
        ("hidden_size", 1 << 40),
        ("num_experts", 1 << 40),
    ] {
        let mut v = base.clone();
        let text_cfg = v
            .get_mut("text_config")
            .filter(|t| t.get(field).is_some())
            .cloned();
        match text_cfg {
            Some(mut t) => {
                t[field] = Value::from(value);
                v["text_config"] = t;
            }
            None => v[field] = Value::from(value),
        }
        let outcome = std::panic::catch_unwind(|| {
            let cfg = K3Config::from_json_value(v.clone()).map_err(|e| e.to_string())?;
            let path = d.path().join("config.json");
            std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
            let opened = deltafin_k3::weights::install::open_checkpoint(d.path());
            std::fs::write(&path, &text).unwrap();
            opened.map(|_| cfg).map_err(|e| e.to_string())
        });
        let Ok(result) = outcome else {
            std::fs::write(d.path().join("config.json"), &text).unwrap();
            panic!("{field} = {value} panicked");
        };
        assert!(result.is_err(), "{field} = {value} was accepted");
    }
}
