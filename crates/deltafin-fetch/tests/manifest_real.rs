//! The committed K3 manifest against the real release index and config (`assets/kimi/`, see
//! its SOURCES.md). `DELTAFIN_REGEN_MANIFEST=1` rewrites the manifest.

use deltafin_fetch::manifest::{InventoryPin, Manifests, PinnedFile, k3_manifest_from_index};
use std::io::Read;
use std::path::PathBuf;

fn assets() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/kimi"))
}

fn pinned(path: &str, size: u64, sha: &str) -> PinnedFile {
    PinnedFile {
        path: path.into(),
        size,
        sha256: Some(sha.into()),
    }
}

#[test]
fn k3_manifest_matches_real_index() {
    let dir = assets();
    let gz = dir.join("k3-model.safetensors.index.json.gz");
    let file = std::fs::File::open(&gz)
        .unwrap_or_else(|e| panic!("{}: {e} (the release index)", gz.display()));
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .unwrap();
    let index: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cfg = deltafin_k3::config::K3Config::from_file(dir.join("k3-config.json")).unwrap();
    // Pins: docs/K3.md §12.2 and assets/kimi/SOURCES.md.
    let metadata = vec![
        pinned(
            "LICENSE",
            3065,
            "20c797ce19af0c17de52c6afb144644768a591c521655f5ebf5712c9850f2887",
        ),
        pinned(
            "config.json",
            7006,
            "9710e121a58d03ac92c8d6da287a19541994319afbbe6d6202af001ffd379213",
        ),
        pinned(
            "generation_config.json",
            53,
            "c6648c25e9705af7fba8847e243840d21b5cc63ddeb6297f750a7ddbb6a02836",
        ),
        pinned(
            "tokenizer_config.json",
            3478,
            "5d0803c94db9cd78763499e0956c95fd5a225c14a727e5a6cf5db3f96f010a6e",
        ),
        pinned(
            "tiktoken.model",
            2795286,
            "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103",
        ),
        pinned(
            "model.safetensors.index.json",
            59_764_096,
            "a1c5210650ce71d2d3ae9ec5a101ac4afd3cf4b10091be589853437eb967febd",
        ),
    ];
    let inventory = InventoryPin {
        size: 108_581_016,
        sha256: "b287e9659afbfd361b1485721a6703a5bc55bb8399ed074a1e5a29803958b425".into(),
        records: 497_220,
    };
    let m = k3_manifest_from_index(
        &cfg,
        &index,
        "moonshotai/Kimi-K3",
        "c5d1dd4c428bd1ce8b88c5044f3b6ccde9e3b721",
        metadata,
        inventory,
    )
    .unwrap();
    assert_eq!(m.shards.len(), 96);
    assert_eq!(m.total_tensor_bytes, 1_560_860_324_864);
    assert_eq!(m.expert_bytes, 17_547_264);
    assert_eq!(m.moe_layers(), (1..=92).collect::<Vec<_>>());
    let spine: u64 = m.shards.iter().map(|s| s.spine_bytes()).sum();
    assert_eq!(spine, 114_404_258_816, "contract §5.2 stream bytes");
    assert_eq!(m.shards[0].data_bytes, 2_341_213_184);
    assert_eq!(m.shards.iter().map(|s| s.tensors).sum::<u64>(), 497_220);
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/manifests/k3.json"));
    let text = serde_json::to_string_pretty(&m).unwrap() + "\n";
    if std::env::var_os("DELTAFIN_REGEN_MANIFEST").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap();
    assert!(
        committed == text,
        "manifests/k3.json is stale: rerun with DELTAFIN_REGEN_MANIFEST=1"
    );
    assert_eq!(Manifests::builtin().unwrap().k3, m);
}
