//! Every way a checkpoint can be broken yields one clear error naming the file and the
//! tensor or field — never a panic. A small synthetic checkpoint is written once and copied
//! into a fresh directory for each corruption.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use deltafin_k3::model::inventory::shard_file_name;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::{Checkpoint, CheckpointError};
use serde_json::Value;

/// A few-MB checkpoint (small vocabulary) shared by all tests.
fn pristine() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut dims = SynthDims::tiny();
        dims.vocab = 1024;
        synthesize(dir.path(), &SynthSpec::new(dims, 7)).unwrap();
        deltafin_k3::synth::remove_at_exit(dir.path());
        dir
    })
    .path()
}

fn fresh_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(pristine()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn open_err(root: &Path) -> String {
    match Checkpoint::open(root) {
        Ok(_) => panic!("corrupted checkpoint opened without error"),
        Err(e) => e.to_string(),
    }
}

fn shard(root: &Path, i: usize) -> PathBuf {
    // tiny: 14 layers → 17 shards
    root.join(shard_file_name(i, 17))
}

/// Rewrite a shard's JSON header (data section kept byte for byte).
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut h = header.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

fn edit_config(root: &Path, edit: impl FnOnce(&mut Value)) {
    let p = root.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

const Q_PROJ: &str = "language_model.model.layers.1.self_attn.q_proj.weight";

#[test]
fn pristine_checkpoint_opens() {
    let ck = Checkpoint::open(pristine()).unwrap();
    assert_eq!(ck.config().n_layers(), 14);
    assert_eq!(ck.vision_tensor_count(), 2 * 6 + 3);
    assert_eq!(ck.projector_tensor_count(), 3);
}

#[test]
fn truncated_shard() {
    let dir = fresh_copy();
    let p = shard(dir.path(), 2);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 10).unwrap(); // the last tensor (expert "9" in string order) is a 32-byte scale
    let e = open_err(dir.path());
    assert!(e.contains("model-00002-of-000017.safetensors"), "{e}");
    assert!(e.contains("truncated: tensor `language_model.model.layers.1.block_sparse_moe.experts.9.w3.weight_scale`"), "{e}");
}

#[test]
fn flipped_dtype_same_size() {
    let dir = fresh_copy();
    edit_header(&shard(dir.path(), 2), |h| {
        h[Q_PROJ]["dtype"] = "F16".into();
    });
    let e = open_err(dir.path());
    assert!(e.contains("model-00002-of-000017.safetensors"), "{e}");
    assert!(
        e.contains(&format!("tensor `{Q_PROJ}` has dtype F16, expected BF16")),
        "{e}"
    );
}

#[test]
fn flipped_dtype_inconsistent_size() {
    let dir = fresh_copy();
    edit_header(&shard(dir.path(), 2), |h| {
        h[Q_PROJ]["dtype"] = "F32".into();
    });
    let e = open_err(dir.path());
    assert!(
        e.contains("model-00002-of-000017.safetensors") && e.contains(Q_PROJ),
        "{e}"
    );
    assert!(e.contains("needs"), "{e}");
}

#[test]
fn changed_shape() {
    let dir = fresh_copy();
    edit_header(&shard(dir.path(), 2), |h| {
        h[Q_PROJ]["shape"] = serde_json::json!([48, 64]);
    });
    let e = open_err(dir.path());
    assert!(
        e.contains(&format!(
            "tensor `{Q_PROJ}` has shape [48, 64], expected [64, 48]"
        )),
        "{e}"
    );
}

#[test]
fn tensor_deleted_from_shard() {
    let dir = fresh_copy();
    edit_header(&shard(dir.path(), 2), |h| {
        h.shift_remove(Q_PROJ);
    });
    let e = open_err(dir.path());
    assert!(e.contains("model-00002-of-000017.safetensors"), "{e}");
    assert!(e.contains(&format!("tensor `{Q_PROJ}` is listed in model.safetensors.index.json but missing from this shard")), "{e}");
}

#[test]
fn garbage_json_header() {
    let dir = fresh_copy();
    let p = shard(dir.path(), 3);
    let mut bytes = std::fs::read(&p).unwrap();
    for b in &mut bytes[8..40] {
        *b = b'#';
    }
    std::fs::write(&p, bytes).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("model-00003-of-000017.safetensors") && e.contains("not valid JSON"),
        "{e}"
    );
}

#[test]
fn index_names_missing_shard() {
    let dir = fresh_copy();
    std::fs::remove_file(shard(dir.path(), 5)).unwrap();
    let e = open_err(dir.path());
    assert!(e.contains("model.safetensors.index.json"), "{e}");
    assert!(
        e.contains("shard `model-00005-of-000017.safetensors`") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn tensor_missing_from_index() {
    let dir = fresh_copy();
    let p = dir.path().join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .shift_remove(Q_PROJ);
    std::fs::write(&p, v.to_string()).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains(&format!("`{Q_PROJ}` is missing from weight_map")),
        "{e}"
    );
}

#[test]
fn unknown_extra_text_tensor() {
    let dir = fresh_copy();
    let p = dir.path().join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["weight_map"]["language_model.model.layers.1.self_attn.rotary.inv_freq"] =
        "model-00002-of-000017.safetensors".into();
    std::fs::write(&p, v.to_string()).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("unknown text tensor `language_model.model.layers.1.self_attn.rotary.inv_freq`"),
        "{e}"
    );
}

#[test]
fn missing_config_field() {
    let dir = fresh_copy();
    edit_config(dir.path(), |v| {
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .shift_remove("moe_intermediate_size");
    });
    let e = open_err(dir.path());
    assert!(
        e.contains("config.json")
            && e.contains("missing field `text_config.moe_intermediate_size`"),
        "{e}"
    );
}

#[test]
fn unsupported_hidden_act() {
    let dir = fresh_copy();
    edit_config(dir.path(), |v| {
        v["text_config"]["hidden_act"] = "gelu".into()
    });
    let e = open_err(dir.path());
    assert!(
        e.contains(r#"text_config.hidden_act: "gelu" is not supported (expected "situ")"#),
        "{e}"
    );
}

#[test]
fn config_dims_disagree_with_tensors() {
    let dir = fresh_copy();
    edit_config(dir.path(), |v| {
        v["text_config"]["routed_expert_hidden_size"] = 64.into()
    });
    let e = open_err(dir.path());
    assert!(
        e.contains("routed_expert_down_proj.weight` has shape [32, 48], expected [64, 48]"),
        "{e}"
    );
}

#[test]
fn missing_config_and_index_files() {
    let dir = fresh_copy();
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.starts_with("model.safetensors.index.json is missing under"),
        "{e}"
    );
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.starts_with("config.json is missing under")
            && e.contains(&dir.path().display().to_string()),
        "{e}"
    );
}

#[test]
fn nan_scale_is_reported_when_the_expert_is_read() {
    let dir = fresh_copy();
    let name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale";
    let ck = Checkpoint::open(pristine()).unwrap();
    let (off, _) = ck.expert_span(2, 3).unwrap().ranges[3];
    drop(ck);
    let p = shard(dir.path(), 3);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[off as usize + 5] = 255;
    std::fs::write(&p, bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let e = ck.expert_matrices(2, 3).unwrap_err().to_string();
    assert!(
        e.contains("experts.3.w2") && e.contains("NaN"),
        "{e}; {name}"
    );
    assert!(ck.expert_matrices(2, 4).is_ok());
}

#[test]
fn bad_requests_are_errors() {
    let ck = Checkpoint::open(pristine()).unwrap();
    assert!(matches!(
        ck.expert_matrices(0, 0),
        Err(CheckpointError::Request { .. })
    ));
    assert!(
        ck.expert_span(1, 16)
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
    assert!(ck.expert_span(14, 0).is_err());
    assert!(
        ck.bf16_matrix("model.layers.1.self_attn.A_log")
            .unwrap_err()
            .to_string()
            .contains("not a 2-D BF16 matrix")
    );
    assert!(ck.tensor_bytes("model.layers.99.nope").is_err());
}
