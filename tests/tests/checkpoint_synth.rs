//! The tiny synthetic checkpoint: it validates, matches its inventory entry for entry, is
//! byte-for-byte deterministic, stays small, and reads back through the Checkpoint API.

use std::io::{Read, Seek, SeekFrom};

use deltafin_k3::model::inventory::{self, TensorKind};
use deltafin_k3::synth::{self, QwenSize, SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_tensor::{DType, SafetensorsFile};

#[test]
fn tiny_validates_matches_inventory_and_is_deterministic() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let t0 = std::time::Instant::now();
    let ra = synthesize(a.path(), &SynthSpec::new(SynthDims::tiny(), 42)).unwrap();
    eprintln!(
        "tiny synthesis: {:?}, {} bytes",
        t0.elapsed(),
        ra.total_bytes
    );
    let rb = synthesize(b.path(), &SynthSpec::new(SynthDims::tiny(), 42)).unwrap();
    assert!(
        ra.total_bytes <= 40_000_000,
        "tiny is {} bytes",
        ra.total_bytes
    );
    assert_eq!(ra.files.len(), 1 + 17 + 1 + 3);
    // Same seed → identical bytes in every file.
    for (fa, fb) in ra.files.iter().zip(&rb.files) {
        assert_eq!(fa.path.file_name(), fb.path.file_name());
        assert!(
            std::fs::read(&fa.path).unwrap() == std::fs::read(&fb.path).unwrap(),
            "{} differs between runs",
            fa.path.display()
        );
    }
    assert_eq!(ra.config_sha256, rb.config_sha256);
    // A different seed changes the weights but not the layout.
    let c = tempfile::tempdir().unwrap();
    let mut d = SynthDims::tiny();
    d.vocab = 1024;
    let rc = synthesize(c.path(), &SynthSpec::new(d, 43)).unwrap();
    assert_ne!(rc.config_sha256, ra.config_sha256);

    let ck = Checkpoint::open(a.path()).unwrap();
    let cfg = ck.config();
    assert_eq!(cfg.n_layers(), 14);
    assert_eq!(cfg.text.vocab_size, 163_840);
    assert_eq!(cfg.text.attn_res_block_size, 12);

    // Every shard holds exactly the inventory's tensors, in the inventory's order.
    let mut all = inventory::text_inventory(cfg);
    all.extend(inventory::vision_inventory(cfg));
    let n = inventory::shard_count(cfg);
    for s in 1..=n {
        let f = SafetensorsFile::open(a.path().join(inventory::shard_file_name(s, n))).unwrap();
        let want: Vec<_> = all.iter().filter(|t| t.shard == s).collect();
        assert_eq!(f.tensors().len(), want.len(), "shard {s}");
        for (got, want) in f.tensors().iter().zip(want) {
            assert_eq!(
                (&got.name, got.dtype, &got.shape),
                (&want.name, want.dtype, &want.shape)
            );
        }
        assert_eq!(f.metadata().unwrap()["format"], "pt");
    }
    let config_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.path().join("config.json")).unwrap())
            .unwrap();
    let real: serde_json::Value =
        serde_json::from_str(deltafin_k3::config::REAL_CONFIG_JSON).unwrap();
    // All real fields present, same nesting.
    fn keys(v: &serde_json::Value, p: &str, out: &mut Vec<String>) {
        if let Some(m) = v.as_object() {
            for (k, x) in m {
                let q = format!("{p}.{k}");
                out.push(q.clone());
                keys(x, &q, out);
            }
        }
    }
    let (mut kr, mut ks) = (Vec::new(), Vec::new());
    keys(&real, "", &mut kr);
    keys(&config_json, "", &mut ks);
    assert_eq!(kr, ks);
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(a.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        idx["metadata"]["total_size"].as_u64().unwrap(),
        ra.tensor_bytes
    );
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), all.len());
}

#[test]
fn tiny_reads_back_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = SynthDims::tiny();
    d.vocab = 2048;
    synthesize(dir.path(), &SynthSpec::new(d.clone(), 5)).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let cfg = ck.config();
    let e = ck.bf16_matrix("model.embed_tokens.weight").unwrap();
    assert_eq!((e.rows(), e.cols()), (2048, 48));
    let rp = ck
        .bf16_matrix("language_model.model.layers.0.mlp_res_proj.weight")
        .unwrap();
    assert_eq!((rp.rows(), rp.cols()), (1, 48));
    // A_log: one value per head in ln(1)..ln(4), exact zeros after, stored as the reference
    // does: 4 heads padded to a multiple of 128 (not to the head dim, 16).
    let a = ck.f32_vector("model.layers.1.self_attn.A_log").unwrap();
    assert_eq!(a.len(), 128);
    assert!(a[..4].iter().all(|&x| (0.0..=4f32.ln()).contains(&x)));
    assert!(a[4..].iter().all(|&x| x.to_bits() == 0));
    let conv = ck
        .f32_vector("model.layers.1.self_attn.q_conv1d.weight")
        .unwrap();
    assert_eq!(conv.len(), 64 * 4);
    let norm = ck.f32_vector("model.norm.weight").unwrap();
    assert!(norm.iter().all(|&x| (0.85..1.15).contains(&x)));
    // Router bias: distinct values (no ties).
    let mut bias = ck
        .f32_vector("model.layers.5.block_sparse_moe.gate.e_score_correction_bias")
        .unwrap();
    bias.sort_by(f32::total_cmp);
    assert!(bias.windows(2).all(|w| w[1] - w[0] > 0.01));
    assert_eq!(
        ck.tensor_info("model.layers.1.self_attn.dt_bias").unwrap(),
        (DType::F32, vec![64])
    );

    // Experts: matrices and spans agree with the bytes in the file.
    for (layer, expert) in [(1, 0), (13, 15), (7, 10)] {
        let m = ck.expert_matrices(layer, expert).unwrap();
        assert_eq!((m.w1.rows(), m.w1.cols()), (32, 32));
        assert_eq!((m.w2.rows(), m.w2.cols()), (32, 32));
        let span = ck.expert_span(layer, expert).unwrap();
        assert!(span.contiguous);
        assert_eq!(span.total_bytes() as usize, d.expert_bytes());
        assert_eq!(
            span.shard_path.file_name().unwrap().to_str().unwrap(),
            inventory::shard_file_name(layer + 1, 17)
        );
        let mut f = std::fs::File::open(&span.shard_path).unwrap();
        f.seek(SeekFrom::Start(span.ranges[0].0)).unwrap();
        let mut buf = vec![0u8; span.total_bytes() as usize];
        f.read_exact(&mut buf).unwrap();
        let mut cat = Vec::new();
        for t in inventory::expert_layout(cfg, layer, expert).tensors {
            cat.extend_from_slice(ck.tensor_bytes(&t.name).unwrap().as_slice());
        }
        assert_eq!(buf, cat);
        // Dequantised weights have roughly the intended std 1/sqrt(32).
        let mut row = vec![0f32; 32];
        let mut s2 = 0f64;
        for r in 0..32 {
            m.w1.dequantize_row(r, &mut row);
            s2 += row.iter().map(|&x| (x * x) as f64).sum::<f64>();
        }
        let std = (s2 / 1024.0).sqrt();
        assert!((0.08..0.4).contains(&std), "w1 std {std}");
    }
    assert!(
        inventory::text_inventory(cfg)
            .iter()
            .any(|t| matches!(t.kind, TensorKind::Expert { .. }))
    );
}

#[test]
fn draft_model_synthesis() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = SynthDims::tiny();
    d.vocab = 1024;
    let target = synth::scaled_config(&d).unwrap();
    let r = synth::synthesize_dspark(&dir.path().join("dspark"), 3, &target).unwrap();
    let f = SafetensorsFile::open(dir.path().join("dspark/model.safetensors")).unwrap();
    assert_eq!(f.tensors().len(), 8 + 5 * 12);
    assert_eq!(
        f.info("context_proj.weight").unwrap().shape,
        vec![48, 5 * 48]
    );
    // The drafter's own head count, not the target's (3 for 4; the release has 64 for 96).
    assert_eq!(
        f.info("layers.4.self_attn.kv_b_proj.weight").unwrap().shape,
        vec![3 * 32, 32]
    );
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("dspark/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["model_type"], "k3_dspark");
    assert_eq!(cfg["num_attention_heads"], 3);
    // Special ids fit the 1024-token vocabulary (the mask keeps its offset from the end).
    assert_eq!(cfg["mask_token_id"], 1024 - 3);
    assert_eq!(cfg["eos_token_id"], target.eos_token_id);
    assert_eq!(
        cfg["target_layer_ids"],
        serde_json::json!([0, 3, 7, 10, 13])
    );
    assert!(r.total_bytes > 0);

    synth::synthesize_qwen3(&dir.path().join("q"), 3, QwenSize::Small).unwrap();
    let f = SafetensorsFile::open(dir.path().join("q/model.safetensors")).unwrap();
    assert_eq!(f.tensors().len(), 2 + 2 * 11);
    assert_eq!(
        f.info("model.embed_tokens.weight").unwrap().shape,
        vec![151_936, 64]
    );
    assert_eq!(
        f.info("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .shape,
        vec![32, 64]
    );
}
