//! DSpark's sizes are read from its `config.json`, never assumed from the release or from the
//! target: a drafter whose head count, Markov rank, ranks, head dims, depth and tapped
//! layers all differ from both the release's (64 heads, rank 256, 5 taps) and the target
//! K3's loads, fits the target and drafts, with speculative output equal to plain greedy.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use deltafin_k3::generate::GenerateOptions;
use deltafin_k3::synth::{
    SynthDims, SynthSpec, dspark_config, scaled_config, synthesize, synthesize_dspark,
    synthesize_dspark_from_config,
};
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_spec::dspark::{DsparkDrafter, DsparkModel, expected_tensors};
use deltafin_spec::{generate, generate_speculative};
use deltafin_tensor::SafetensorsFile;

#[test]
fn a_dspark_variant_is_read_from_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let dims = SynthDims {
        vocab: 1024,
        layers: 6,
        attn_res_block: 4,
        ..SynthDims::tiny()
    };
    let k3_dir = dir.path().join("k3");
    synthesize(&k3_dir, &SynthSpec::new(dims.clone(), 3)).unwrap();
    let target = scaled_config(&dims).unwrap();
    let k3 = open_model(&k3_dir, &EngineOptions::default()).unwrap();

    // The default synthetic drafter already has its own head count (3 for the target's 4).
    let plain = dir.path().join("dspark-default");
    synthesize_dspark(&plain, 5, &target).unwrap();
    let m = DsparkModel::open(&plain).unwrap();
    assert_eq!(
        (
            m.config.num_attention_heads,
            target.text.num_attention_heads
        ),
        (3, 4)
    );

    // A variant: every size differs from the release and from the target.
    let mut v = dspark_config(&target).unwrap();
    let set = |v: &mut serde_json::Value, k: &str, x: serde_json::Value| v[k] = x;
    set(&mut v, "num_attention_heads", 6.into());
    set(&mut v, "num_key_value_heads", 6.into());
    set(&mut v, "markov_rank", 24.into());
    set(&mut v, "q_lora_rank", 20.into());
    set(&mut v, "kv_lora_rank", 12.into());
    set(&mut v, "qk_nope_head_dim", 10.into());
    set(&mut v, "qk_rope_head_dim", 4.into());
    set(&mut v, "v_head_dim", 6.into());
    set(&mut v, "intermediate_size", 72.into());
    set(&mut v, "num_hidden_layers", 2.into());
    set(&mut v, "num_target_layers", 2.into());
    set(&mut v, "target_layer_ids", serde_json::json!([1, 4]));
    set(&mut v, "confidence_head_with_markov", false.into());
    let variant = dir.path().join("dspark-variant");
    synthesize_dspark_from_config(&variant, 9, &v).unwrap();
    let m = DsparkModel::open(&variant).unwrap();
    let c = &m.config;
    assert_eq!(
        (c.num_attention_heads, c.markov_rank, c.num_hidden_layers),
        (6, 24, 2)
    );
    assert_eq!(
        (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim()),
        (20, 12, 14)
    );
    assert_eq!(c.target_layer_ids, vec![1, 4]);
    assert_eq!(m.layers.len(), 2);
    assert_eq!((m.markov_w1.rows(), m.markov_w1.cols()), (1024, 24));
    let (w, _) = m.confidence.as_ref().unwrap();
    assert_eq!(
        w.len(),
        c.hidden_size,
        "confidence head without the Markov input"
    );
    // The file holds exactly the tensors the config implies.
    let file = SafetensorsFile::open(variant.join("model.safetensors")).unwrap();
    let mut got: Vec<(String, Vec<usize>)> = file
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let mut want = expected_tensors(c);
    got.sort();
    want.sort();
    assert_eq!(got, want);

    // It fits the target and drafts; speculative decoding stays exact.
    let m = Arc::new(m);
    let mut d = DsparkDrafter::new(m, &k3, 4096).unwrap();
    let prompt: Vec<u32> = (0..9).map(|i| (i * 101 + 7) % 1000).collect();
    let stop = [END_OF_MSG, EOS];
    let (ids, stats) =
        generate_speculative(&k3, &prompt, 16, &stop, 4, &mut d, &AtomicBool::new(false)).unwrap();
    assert!(stats.proposed > 0, "{stats:?}");
    let opts = GenerateOptions {
        max_new: Some(16),
        stop_ids: stop.to_vec(),
        max_context: 1 << 20,
        top_logits: 0,
    };
    let greedy = generate(&k3, &prompt, &opts, &AtomicBool::new(false), |_| Ok(()))
        .unwrap()
        .ids;
    assert_eq!(ids, greedy);

    // A config whose tap list names a layer the target lacks is refused by name.
    set(&mut v, "target_layer_ids", serde_json::json!([1, 6]));
    let bad = dir.path().join("dspark-bad");
    synthesize_dspark_from_config(&bad, 9, &v).unwrap();
    let e = DsparkModel::open(&bad).unwrap_err().to_string();
    assert!(e.contains("target_layer_ids") && e.contains('6'), "{e}");
}
