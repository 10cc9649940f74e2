//! `A_log` storage follows the reference (docs/K3.md §3.2): any length of at least
//! `num_heads` is accepted, the padding must be exactly zero, and padded, narrow and wider
//! storage of the same weights give bit-identical logits. The checkpoint is a tiny K3 whose
//! sizes that the release makes equal all differ (3 KDA heads of dim 32, 5 MLA heads, …), so
//! a rule that holds only because two release dims coincide fails here.

use std::path::Path;
use std::sync::Arc;

use deltafin_tensor::{SafetensorsFile, SafetensorsWriter, TensorEntry};
use serde_json::Value;

use super::checkpoint::write_stream_install;
use crate::model::LogitRows;
use crate::synth::{SynthDims, SynthSpec, synthesize};
use crate::weights::loader::{EngineOptions, load_model};
use deltafin_store::checkpoint::*;
use deltafin_store::config::LayerKind;
use deltafin_store::inventory::a_log_stored_len;
use deltafin_store::spine_int8::SpineFormat;
use deltafin_store::spine_pack::{PackOptions, PackSet, default_pack_dir, pack_spine};

const HEADS: usize = 3;

/// 3 KDA heads of dim 32 (`A_log` stored as `[128]`), 5 MLA heads, `q_lora ≠ kv_lora`,
/// `qk_nope ≠ v_head`, and the latent (128), expert (32), shared (2 × 32) and dense (80)
/// widths all different, so no two matrices of a layer share a shape by accident.
fn distinct_dims() -> SynthDims {
    SynthDims {
        vocab: 1024,
        layers: 6,
        attn_res_block: 4,
        hidden: 48,
        dense_inter: 80,
        kda_heads: HEADS,
        kda_head_dim: 32,
        mla_heads: 5,
        q_lora: 40,
        kv_lora: 24,
        qk_nope: 12,
        qk_rope: 6,
        v_head: 20,
        latent: 128,
        moe_inter: 32,
        ..SynthDims::tiny()
    }
}

fn a_log_name(l: usize) -> String {
    format!("language_model.model.layers.{l}.self_attn.A_log")
}

fn kda_layers(ckpt: &Checkpoint) -> Vec<usize> {
    let cfg = ckpt.config();
    (0..cfg.n_layers())
        .filter(|&l| cfg.layer_kind(l) == LayerKind::Kda)
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Replace tensor `name` of the checkpoint under `root` by the F32 vector `values`: its
/// shard is rewritten (every other tensor byte for byte, same order) and the index's
/// `metadata.total_size` follows.
fn rewrite_f32(root: &Path, name: &str, values: &[f32]) {
    let index_path = root.join(INDEX_FILE);
    let mut index: Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let path = root.join(index["weight_map"][name].as_str().unwrap());
    let file = SafetensorsFile::open(&path).unwrap();
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let entries: Vec<TensorEntry> = file
        .tensors()
        .iter()
        .map(|t| TensorEntry {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: if t.name == name {
                vec![values.len()]
            } else {
                t.shape.clone()
            },
        })
        .collect();
    let old_len = file.info(name).unwrap().byte_len() as u64;
    let tmp = path.with_extension("tmp");
    SafetensorsWriter::new(entries)
        .with_metadata("format", "pt")
        .write(&tmp, |_, e, out| {
            if e.name == name {
                out.write_all(&data)
            } else {
                out.write_all(file.bytes(&e.name).unwrap().as_slice())
            }
        })
        .unwrap();
    drop(file);
    std::fs::rename(&tmp, &path).unwrap();
    let total = index["metadata"]["total_size"].as_u64().unwrap() - old_len + data.len() as u64;
    index["metadata"]["total_size"] = total.into();
    std::fs::write(&index_path, serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

/// Every logit of a 12-token forward pass, as bits.
fn logit_bits(ckpt: Checkpoint) -> Vec<u32> {
    let model = load_model(Arc::new(ckpt), &EngineOptions::default()).unwrap();
    let toks: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 1024).collect();
    let mut s = model.new_state();
    let out = model.forward(&mut s, &toks, LogitRows::All).unwrap();
    assert_eq!(out.rows, toks.len());
    out.values.iter().map(|v| v.to_bits()).collect()
}

fn load_err(root: &Path) -> String {
    let ckpt = Checkpoint::open(root).unwrap();
    match load_model(Arc::new(ckpt), &EngineOptions::default()) {
        Ok(_) => panic!("{}: loaded", root.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_synthesizer_writes_the_reference_layout() {
    assert_eq!(
        [1, 3, 96, 128, 129, 160].map(a_log_stored_len),
        [128, 128, 128, 128, 256, 256]
    );
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(distinct_dims(), 11)).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let kda = kda_layers(&ckpt);
    assert_eq!(kda, vec![0, 1, 2, 4]);
    for l in kda {
        let name = a_log_name(l);
        // 3 heads are stored as [128]: the reference pads to a multiple of 128, not to the
        // head dim (32).
        assert_eq!(
            ckpt.tensor_info(&name).unwrap(),
            (deltafin_tensor::DType::F32, vec![128])
        );
        let v = ckpt.f32_vector(&name).unwrap();
        assert!(
            v[..HEADS].iter().all(|&x| x > 0.0 && x <= 4f32.ln()),
            "{v:?}"
        );
        assert!(v[HEADS..].iter().all(|&x| x.to_bits() == 0));
    }
}

#[test]
fn padded_narrow_and_wide_a_log_give_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    let padded = dir.path().join("padded");
    synthesize(&padded, &SynthSpec::new(distinct_dims(), 11)).unwrap();
    let reference = Checkpoint::open(&padded).unwrap();
    let kda = kda_layers(&reference);
    let stored: Vec<Vec<f32>> = kda
        .iter()
        .map(|&l| reference.f32_vector(&a_log_name(l)).unwrap())
        .collect();
    let spine = reference.spine_bytes();
    let want = logit_bits(reference);
    for len in [HEADS, 4, 256] {
        let root = dir.path().join(format!("len{len}"));
        copy_dir(&padded, &root);
        for (&l, v) in kda.iter().zip(&stored) {
            let mut w = v[..HEADS].to_vec();
            w.resize(len, 0.0);
            rewrite_f32(&root, &a_log_name(l), &w);
        }
        let ckpt = Checkpoint::open(&root).unwrap();
        assert_eq!(ckpt.tensor_info(&a_log_name(1)).unwrap().1, vec![len]);
        let delta = 4 * kda.len() as i64 * (len as i64 - 128);
        assert_eq!(ckpt.spine_bytes() as i64, spine as i64 + delta);
        assert!(logit_bits(ckpt) == want, "A_log stored as [{len}]");
        if len == HEADS {
            // The same narrow tensors as a stream install (one file per spine tensor).
            let stream = dir.path().join("stream");
            write_stream_install(&Checkpoint::open(&root).unwrap(), &stream);
            let ckpt = Checkpoint::open(&stream).unwrap();
            assert_eq!(ckpt.layout(), Layout::StreamInstall);
            assert_eq!(ckpt.tensor_info(&a_log_name(1)).unwrap().1, vec![HEADS]);
            assert!(logit_bits(ckpt) == want, "narrow A_log, stream install");
            // And through DFSP packs of the narrow checkpoint (their source inventory is the
            // tensors as stored).
            let ckpt = Checkpoint::open(&root).unwrap();
            let opts = PackOptions {
                format: SpineFormat::Bf16,
                output: root.join(default_pack_dir(SpineFormat::Bf16)),
                layer: None,
                chunk_size: 64 << 10,
                stop_after_packs: None,
            };
            pack_spine(&ckpt, &opts, &mut |_| {}).unwrap();
            let set = PackSet::open_if_complete(&ckpt, SpineFormat::Bf16).unwrap();
            assert_eq!(
                set.unwrap().f32_vector(&a_log_name(1)).unwrap().len(),
                HEADS
            );
            assert!(logit_bits(ckpt) == want, "narrow A_log, DFSP packs");
        }
    }
}

#[test]
fn a_log_padding_must_be_zero_and_the_tensor_long_enough() {
    let dir = tempfile::tempdir().unwrap();
    let pristine = dir.path().join("pristine");
    synthesize(&pristine, &SynthSpec::new(distinct_dims(), 11)).unwrap();
    let name = a_log_name(1);
    let v = Checkpoint::open(&pristine)
        .unwrap()
        .f32_vector(&name)
        .unwrap();
    let edited = |label: &str, values: Vec<f32>| {
        let root = dir.path().join(label);
        copy_dir(&pristine, &root);
        rewrite_f32(&root, &name, &values);
        root
    };

    // Non-zero padding: the shape is acceptable, the values are not.
    let mut w = v.clone();
    w[100] = 0.5;
    let e = load_err(&edited("nonzero", w));
    assert!(
        e.contains(&format!("tensor `{name}`")) && e.contains("entry 100 is 0.5"),
        "{e}"
    );
    let mut w = v.clone();
    w[HEADS] = f32::NAN;
    let e = load_err(&edited("nan", w));
    assert!(e.contains(&name) && e.contains("entry 3 is NaN"), "{e}");
    // A negative zero is exactly zero.
    let mut w = v.clone();
    w[HEADS] = -0.0;
    let ckpt = Checkpoint::open(&edited("negzero", w)).unwrap();
    load_model(Arc::new(ckpt), &EngineOptions::default()).unwrap();

    // Fewer entries than heads: refused when the checkpoint is opened.
    let root = edited("short", v[..HEADS - 1].to_vec());
    let e = Checkpoint::open(&root).unwrap_err().to_string();
    assert!(
        e.contains(&name) && e.contains("shape [2]") && e.contains("n ≥ 3"),
        "{e}"
    );

    // A stream install is checked the same way.
    let stream = dir.path().join("stream");
    write_stream_install(&Checkpoint::open(&pristine).unwrap(), &stream);
    let file = stream.join(SPINE_TENSOR_DIR).join(&name);
    let mut w = v.clone();
    w[127] = -1.0;
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&file, &bytes).unwrap();
    let e = load_err(&stream);
    assert!(e.contains(&name) && e.contains("entry 127 is -1"), "{e}");
    std::fs::write(&file, &bytes[..4 * (HEADS - 1)]).unwrap();
    let e = Checkpoint::open(&stream).unwrap_err().to_string();
    assert!(e.contains(&name) && e.contains("is 8 bytes"), "{e}");
    std::fs::write(&file, &bytes[..4 * HEADS + 1]).unwrap();
    let e = Checkpoint::open(&stream).unwrap_err().to_string();
    assert!(e.contains(&name) && e.contains("is 13 bytes"), "{e}");
}
