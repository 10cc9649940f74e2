//! `deltafin warm-expert-cache`: ranking from router traces and the heat histogram, fetching
//! the best-ranked missing experts from the mock hub (stream install) or the local shards
//! (full install), strict trace parsing and rejected NPZ flags.

use deltafin_experts::heat::{HEAT_FILE, HeatDims, HeatTable};
use deltafin_fetch::mock_hub::MockHub;
use deltafin_fetch::synth_source::{SynthSource, small_dims};
use deltafin_k3::weights::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    c.env_remove("DELTAFIN_ROOT")
        .env_remove("DELTAFIN_MANIFESTS")
        .env_remove("HF_TOKEN");
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// small_dims: 6 layers (MoE layers 1…5), 16 experts, top-4.
const DIMS: HeatDims = HeatDims {
    layers: 5,
    experts: 16,
    top_k: 4,
};

/// A trace whose routes rank (2, 7) (3 routes) ≻ (5, 0) (2, weight 1.8) ≻ (1, 3) (2, weight
/// 1.0) ≻ (2, 1) (1, weight 0.3) ≻ ….
fn write_trace(path: &Path) {
    let lines = [
        r#"{"step": 0, "layer": 2, "ids": [7, 1, 2, 3, 7, 4, 5, 6], "w": [0.4, 0.3, 0.2, 0.1, 0.4, 0.3, 0.2, 0.1]}"#,
        r#"{"step": 0, "layer": 1, "ids": [3, 10, 11, 12], "w": [0.5, 0.2, 0.2, 0.1]}"#,
        r#"{"step": 1, "layer": 1, "ids": [3, 13, 14, 15], "w": [0.5, 0.2, 0.2, 0.1]}"#,
        r#"{"step": 1, "layer": 2, "ids": [7, 8, 9, 10], "w": [0.7, 0.1, 0.1, 0.1]}"#,
        r#"{"step": 1, "layer": 5, "ids": [0, 9, 8, 7], "w": [0.9, 0.05, 0.03, 0.02]}"#,
        r#"{"step": 2, "layer": 5, "ids": [0, 1, 2, 3], "w": [0.9, 0.05, 0.03, 0.02]}"#,
    ];
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn ranked(o: &Output) -> (serde_json::Value, Vec<(u64, u64)>) {
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = v["ranked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["layer"].as_u64().unwrap(), x["expert"].as_u64().unwrap()))
        .collect();
    (v, r)
}

fn expert_bytes_of(src: &Path, layer: usize, expert: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let ck = Checkpoint::open(src).unwrap();
    let span = ck.expert_span(layer, expert).unwrap();
    let f = std::fs::File::open(&span.shard_path).unwrap();
    let mut out = Vec::new();
    for (off, len) in span.ranges {
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off).unwrap();
        out.extend(b);
    }
    out
}

#[test]
fn stream_install_ranks_and_fetches_the_best_missing_experts_from_the_hub() {
    let tmp = tempfile::tempdir().unwrap();
    let src = SynthSource::create(&tmp.path().join("src"), small_dims(), 5).unwrap();
    src.manifests
        .write_dir(&tmp.path().join("manifests"))
        .unwrap();
    let hub = MockHub::start().unwrap();
    src.serve(&hub).unwrap();
    let root = tmp.path().join("root");
    let cmd = |args: &[&str]| {
        bin()
            .args(args)
            .env("HF_ENDPOINT", hub.url())
            .env("DELTAFIN_INSECURE_HTTP", "1")
            .env("DELTAFIN_MANIFESTS", tmp.path().join("manifests"))
            .env("DELTAFIN_ROOT", &root)
            .output()
            .unwrap()
    };
    let o = cmd(&["setup", "--stream"]);
    assert!(o.status.success(), "{}", text(&o));
    write_trace(&root.join("k3-meta/routes.jsonl"));
    // A run-events file in k3-meta is not a trace: skipped with a note.
    std::fs::write(
        root.join("k3-meta/events.jsonl"),
        "{\"schema\": \"deltafin.run_event.v1\", \"event\": \"run_start\"}\n",
    )
    .unwrap();
    // Heat makes (4, 4) the hottest of all.
    let mut t = HeatTable::empty(DIMS);
    for _ in 0..10 {
        t.record_pass([(4, &[4usize][..])]);
    }
    std::fs::write(root.join(HEAT_FILE), t.encode()).unwrap();

    hub.clear_log();
    let o = cmd(&["warm-expert-cache", "--json", "--show", "4"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("events.jsonl is not a router trace"),
        "{}",
        text(&o)
    );
    let (v, r) = ranked(&o);
    assert_eq!(v["schema"], "deltafin.warm_expert_cache.v1");
    assert_eq!(r, [(4, 4), (2, 7), (5, 0), (1, 3)]);
    assert_eq!(v["traces"][0]["lines"], 6);
    assert_eq!(v["traces"][0]["passes"], 3);
    assert_eq!(v["heat"]["status"], "loaded");
    assert_eq!(v["heat"]["passes"], 10);
    assert_eq!(v["ranked"][1]["routes"], 3);
    assert_eq!(v["experts_cached"], 0);
    assert_eq!(v["fetch"], serde_json::Value::Null);
    assert!(hub.requests().is_empty(), "planning made requests");

    let o = cmd(&["warm-expert-cache", "--fetch", "3", "--show", "5"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("fetched 3 experts"), "{}", text(&o));
    for (l, e) in [(4, 4), (2, 7), (5, 0)] {
        let got = std::fs::read(root.join(format!("k3-experts/L{l}-E{e}.bin"))).unwrap();
        assert_eq!(got, expert_bytes_of(&src.k3_dir, l, e), "L{l}-E{e}");
    }
    assert!(!root.join("k3-experts/L1-E3.bin").exists());
    // The next call fetches the next best missing ones.
    let o = cmd(&["warm-expert-cache", "--fetch", "2", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let (v, _) = ranked(&o);
    let fetched: Vec<(u64, u64)> = v["fetch"]["fetched"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["layer"].as_u64().unwrap(), x["expert"].as_u64().unwrap()))
        .collect();
    assert_eq!(fetched, [(1, 3), (2, 1)], "{v}");
    assert_eq!(v["fetch"]["source"], "hub");
    assert_eq!(v["experts_cached"], 5);

    // An explicit trace with a bad line names file and line.
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"step\": 0, \"layer\": 1, \"ids\": [1, 2, 3, 4], \"w\": [1, 1, 1, 1]}\n{\"step\": 0, \"layer\": 9, \"ids\": [1, 2, 3, 4], \"w\": [1, 1, 1, 1]}\n",
    )
    .unwrap();
    let o = cmd(&["warm-expert-cache", "--trace", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("bad.jsonl:2: layer 9 is not a MoE layer"),
        "{}",
        text(&o)
    );
}

#[test]
fn full_install_writes_missing_expert_files_from_the_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("k3");
    deltafin_k3::synth::synthesize(&root, &deltafin_k3::synth::SynthSpec::new(small_dims(), 9))
        .unwrap();
    write_trace(&root.join("k3-meta/routes.jsonl"));
    let run = |args: &[&str]| {
        bin()
            .args(args)
            .arg("--model-root")
            .arg(&root)
            .output()
            .unwrap()
    };
    // Every expert is in the local shards: nothing is missing.
    let o = run(&["warm-expert-cache", "--fetch", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("none is missing"), "{}", text(&o));
    assert!(!root.join("k3-experts").exists());
    // A per-expert layout with two best-ranked files missing gets them back from the shards.
    let ck = Checkpoint::open(&root).unwrap();
    deltafin_k3::weights::loader::convert_to_expert_files(&ck).unwrap();
    let dir: PathBuf = root.join("k3-experts");
    let want = std::fs::read(dir.join("L2-E7.bin")).unwrap();
    std::fs::remove_file(dir.join("L2-E7.bin")).unwrap();
    std::fs::remove_file(dir.join("L5-E0.bin")).unwrap();
    let o = run(&["warm-expert-cache", "--fetch", "5", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let (v, r) = ranked(&o);
    assert_eq!(r[..3], [(2, 7), (5, 0), (1, 3)]);
    assert_eq!(v["fetch"]["source"], "shards");
    assert_eq!(v["fetch"]["fetched"].as_array().unwrap().len(), 2);
    assert_eq!(std::fs::read(dir.join("L2-E7.bin")).unwrap(), want);
    assert_eq!(
        std::fs::read(dir.join("L5-E0.bin")).unwrap(),
        expert_bytes_of(&root, 5, 0)
    );
    // A non-canonical cache can be inspected, not filled.
    let o = run(&[
        "warm-expert-cache",
        "--cache",
        dir.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(ranked(&o).0["experts_cached"], 5 * 16);
}

#[test]
fn legacy_npz_flags_and_bad_combinations_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (&["--convert-npz"][..], "legacy NPZ expert caches"),
        (&["--convert-workers", "4"], "--convert-workers"),
        (
            &["--keep-npz", "--convert-limit", "3"],
            "--convert-limit, --keep-npz",
        ),
        (&["--fetch", "2", "--cache", "/tmp"], "cannot be used with"),
        (&["--workers", "17"], "--workers"),
        (&["--show", "x"], "--show"),
    ] {
        let o = bin()
            .arg("warm-expert-cache")
            .args(args)
            .arg("--model-root")
            .arg(tmp.path())
            .output()
            .unwrap();
        assert!(
            !o.status.success() && text(&o).contains(needle),
            "{args:?}: {}",
            text(&o)
        );
    }
    let o = bin()
        .args(["warm-expert-cache", "--model-root"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("config.json is missing"));
}
