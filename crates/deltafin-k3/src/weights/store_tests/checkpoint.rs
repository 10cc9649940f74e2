use deltafin_store::checkpoint::*;
use std::path::PathBuf;

use crate::model::LogitRows;
use crate::synth::{SynthDims, SynthSpec, synthesize};
use crate::weights::loader::{EngineOptions, load_model};
use deltafin_store::inventory::TensorKind;
use deltafin_store::inventory::{self};
use deltafin_store::spine_int8::{ConvertOptions, convert_spine, tensor_dir};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// A synthesized shard checkpoint and the same weights as a stream install: config,
/// one file per spine tensor, and the experts as `k3-experts/` files.
fn shards_and_stream() -> (tempfile::TempDir, Checkpoint, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    let dims = SynthDims {
        vocab: 1024,
        layers: 6,
        attn_res_block: 4,
        ..SynthDims::tiny()
    };
    synthesize(&shards, &SynthSpec::new(dims, 5)).unwrap();
    let ckpt = Checkpoint::open(&shards).unwrap();
    let stream = dir.path().join("stream");
    write_stream_install(&ckpt, &stream);
    (dir, ckpt, stream)
}

/// Write the weights of `ckpt` as a stream install under `stream`: its config, one file per
/// spine tensor (bytes as stored) and the experts as `k3-experts/` files.
pub(super) fn write_stream_install(ckpt: &Checkpoint, stream: &std::path::Path) {
    let shards = ckpt.root();
    std::fs::create_dir_all(stream.join(SPINE_TENSOR_DIR)).unwrap();
    std::fs::create_dir_all(stream.join(EXPERT_DIR)).unwrap();
    std::fs::copy(shards.join(CONFIG_FILE), stream.join(CONFIG_FILE)).unwrap();
    for t in inventory::text_inventory(ckpt.config()) {
        if let TensorKind::Spine { .. } = t.kind {
            let b = ckpt.tensor_bytes(&t.name).unwrap();
            std::fs::write(stream.join(SPINE_TENSOR_DIR).join(&t.name), b.as_slice()).unwrap();
        }
    }
    let cfg = ckpt.config().clone();
    for l in (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)) {
        for e in 0..cfg.text.num_experts {
            let span = ckpt.expert_span(l, e).unwrap();
            let f = std::fs::File::open(&span.shard_path).unwrap();
            let mut bytes = Vec::new();
            for (off, len) in span.ranges {
                let mut b = vec![0u8; len as usize];
                f.read_exact_at(&mut b, off).unwrap();
                bytes.extend_from_slice(&b);
            }
            let p = stream.join(EXPERT_DIR).join(expert_file_name(l, e));
            std::fs::write(p, bytes).unwrap();
        }
    }
}

#[test]
fn stream_install_layout_gives_the_shards_logits_and_int8_spine() {
    let (_dir, shards, stream) = shards_and_stream();
    assert_eq!(Layout::detect(&stream), Some(Layout::StreamInstall));
    assert_eq!(Layout::detect(shards.root()), Some(Layout::Shards));
    let st = Checkpoint::open(&stream).unwrap();
    assert_eq!(st.layout(), Layout::StreamInstall);
    assert_eq!(shards.layout(), Layout::Shards);
    let cfg = shards.config().clone();
    let spine_count = inventory::text_inventory(&cfg)
        .iter()
        .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
        .count();
    assert_eq!(st.spine_files().len(), spine_count);
    assert!(shards.spine_files().is_empty() && st.shard_paths().is_empty());
    let on_disk: u64 = st
        .spine_files()
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(st.spine_bytes(), on_disk);
    // The expert tensors are not spine tensors of a stream install.
    let e0 = inventory::expert_layout(&cfg, 1, 0);
    assert!(st.tensor_bytes(&e0.tensors[0].name).is_err());
    // Experts from their files equal the shards' experts.
    let (a, b) = (
        shards.expert_matrices(1, 3).unwrap(),
        st.expert_matrices(1, 3).unwrap(),
    );
    for (x, y) in [(&a.w1, &b.w1), (&a.w2, &b.w2), (&a.w3, &b.w3)] {
        assert_eq!((x.packed(), x.scales()), (y.packed(), y.scales()));
    }
    let span = st.expert_span(1, 3).unwrap();
    assert_eq!(span.shard_path, st.expert_file(1, 3));
    assert!(span.contiguous && span.ranges[0].0 == 0);
    let st = Arc::new(st);
    let shards = Arc::new(shards);
    let opts = EngineOptions::default();
    let (ma, mb) = (
        load_model(shards.clone(), &opts).unwrap(),
        load_model(st.clone(), &opts).unwrap(),
    );
    let ids = [1u32, 17, 99, 512, 3];
    let la = ma
        .forward(&mut ma.new_state(), &ids, LogitRows::All)
        .unwrap();
    let lb = mb
        .forward(&mut mb.new_state(), &ids, LogitRows::All)
        .unwrap();
    assert_eq!(la.values, lb.values);
    // The int8 conversion reads the bf16 spine through either layout identically.
    for c in [&shards, &st] {
        convert_spine(c, &ConvertOptions::default(), &mut |_| {}).unwrap();
    }
    let mut names: Vec<_> = std::fs::read_dir(tensor_dir(shards.root()))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(!names.is_empty());
    for n in names {
        assert_eq!(
            std::fs::read(tensor_dir(shards.root()).join(&n)).unwrap(),
            std::fs::read(tensor_dir(st.root()).join(&n)).unwrap(),
            "{n:?}"
        );
    }
}

#[test]
fn stream_install_spine_file_errors_name_the_tensor() {
    let (_dir, _shards, stream) = shards_and_stream();
    let name = "language_model.model.layers.2.input_layernorm.weight";
    let path = stream.join(SPINE_TENSOR_DIR).join(name);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[1..]).unwrap();
    let msg = Checkpoint::open(&stream).unwrap_err().to_string();
    assert!(
        msg.contains(name) && msg.contains("bytes, expected"),
        "{msg}"
    );
    std::fs::remove_file(&path).unwrap();
    let msg = Checkpoint::open(&stream).unwrap_err().to_string();
    assert!(msg.contains(name) && msg.contains("is missing"), "{msg}");
    std::fs::write(&path, &bytes).unwrap();
    std::fs::write(stream.join(SPINE_TENSOR_DIR).join("stray.bin"), b"x").unwrap();
    let msg = Checkpoint::open(&stream).unwrap_err().to_string();
    assert!(msg.contains("stray.bin"), "{msg}");
    std::fs::remove_file(stream.join(SPINE_TENSOR_DIR).join("stray.bin")).unwrap();
    // A missing expert file names the layer and expert.
    let st = Checkpoint::open(&stream).unwrap();
    std::fs::remove_file(st.expert_file(2, 7)).unwrap();
    let msg = st.expert_matrices(2, 7).unwrap_err().to_string();
    assert!(msg.contains("layer 2 expert 7"), "{msg}");
}
