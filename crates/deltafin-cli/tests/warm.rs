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
    deltafin_store::experts::convert_to_expert_files(&ck).unwrap();
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

/// A `.npy` file of a `uint8` `(rows, cols)` array: `c_order` bytes written in C order, or in
/// Fortran (column-major) order; header version 1.0 or 2.0.
fn npy(c_order: &[u8], (rows, cols): (usize, usize), fortran: bool, v2: bool) -> Vec<u8> {
    let header = format!(
        "{{'descr': '|u1', 'fortran_order': {}, 'shape': ({rows}, {cols}), }}",
        if fortran { "True" } else { "False" }
    );
    let prefix = if v2 { 12 } else { 10 };
    let mut h = header;
    while !(prefix + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY".to_vec();
    if v2 {
        b.extend([2, 0]);
        b.extend((h.len() as u32).to_le_bytes());
    } else {
        b.extend([1, 0]);
        b.extend((h.len() as u16).to_le_bytes());
    }
    b.extend(h.as_bytes());
    if fortran {
        for c in 0..cols {
            for r in 0..rows {
                b.push(c_order[r * cols + c]);
            }
        }
    } else {
        b.extend_from_slice(c_order);
    }
    b
}

/// The original's legacy archive of one raw expert (`raw`) of the install at `root`: its six
/// arrays, each member stored or deflated, in C or Fortran order, written in `order`.
fn legacy_npz(root: &Path, raw: &[u8], variant: usize, order: [usize; 6]) -> Vec<u8> {
    use std::io::Write;
    let cfg = deltafin_k3::config::K3Config::from_file(root.join("config.json")).unwrap();
    let (f, lr) = (
        cfg.text.moe_intermediate_size,
        cfg.text.routed_expert_hidden_size,
    );
    let members = [
        ("w1_p.npy", (f, lr / 2)),
        ("w1_s.npy", (f, lr / 32)),
        ("w2_p.npy", (lr, f / 2)),
        ("w2_s.npy", (lr, f / 32)),
        ("w3_p.npy", (f, lr / 2)),
        ("w3_s.npy", (f, lr / 32)),
    ];
    let mut parts = Vec::new();
    let mut at = 0;
    for (k, &(name, (r, c))) in members.iter().enumerate() {
        let fortran = (k + variant) % 2 == 1;
        parts.push((
            name,
            npy(&raw[at..at + r * c], (r, c), fortran, variant == 2),
        ));
        at += r * c;
    }
    assert_eq!(at, raw.len(), "small_dims' expert size");
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for &k in &order {
        let method = if (k + variant).is_multiple_of(3) {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let opts = zip::write::SimpleFileOptions::default().compression_method(method);
        zip.start_file(parts[k].0, opts).unwrap();
        zip.write_all(&parts[k].1).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// `warm-expert-cache --convert-npz` on a legacy cache built here: archives in `k3-cache/`
/// and in `k3-experts/` become raw files byte-identical to the checkpoint's experts (C and
/// Fortran order, stored and deflated members, .npy 1.0 and 2.0, members in any order); a
/// damaged archive is refused with its raw file unpublished and the archive kept; a rerun
/// reuses identical files; `--keep-npz`, `--convert-limit` and bad combinations.
#[test]
fn convert_npz_migrates_a_legacy_cache_to_identical_raw_files() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("k3");
    deltafin_k3::synth::synthesize(&root, &deltafin_k3::synth::SynthSpec::new(small_dims(), 4))
        .unwrap();
    let ck = Checkpoint::open(&root).unwrap();
    deltafin_store::experts::convert_to_expert_files(&ck).unwrap();
    let dir = root.join("k3-experts");
    let legacy = root.join("k3-cache");
    std::fs::create_dir_all(&legacy).unwrap();
    let experts = [(1, 0), (2, 7), (3, 15), (5, 4)];
    let mut want = Vec::new();
    for (i, &(l, e)) in experts.iter().enumerate() {
        let raw = std::fs::read(dir.join(format!("L{l}-E{e}.bin"))).unwrap();
        assert_eq!(raw, expert_bytes_of(&root, l, e));
        std::fs::remove_file(dir.join(format!("L{l}-E{e}.bin"))).unwrap();
        let order = if i.is_multiple_of(2) {
            [0, 1, 2, 3, 4, 5]
        } else {
            [5, 3, 1, 0, 2, 4]
        };
        // One archive sits in k3-experts/ itself, the others in the legacy k3-cache/.
        let at = if i == 3 { &dir } else { &legacy };
        std::fs::write(
            at.join(format!("L{l}-E{e}.npz")),
            legacy_npz(&root, &raw, i, order),
        )
        .unwrap();
        want.push(raw);
    }
    // A damaged archive: one payload byte of a stored member flipped (its CRC-32 fails).
    let raw = std::fs::read(dir.join("L4-E9.bin")).unwrap();
    std::fs::remove_file(dir.join("L4-E9.bin")).unwrap();
    let mut bad = legacy_npz(&root, &raw, 1, [0, 1, 2, 3, 4, 5]);
    let npy_at = bad.windows(6).position(|w| w == b"\x93NUMPY").unwrap();
    bad[npy_at + 200] ^= 1;
    std::fs::write(legacy.join("L4-E9.npz"), &bad).unwrap();

    let run = |args: &[&str]| {
        bin()
            .arg("warm-expert-cache")
            .args(args)
            .arg("--model-root")
            .arg(&root)
            .output()
            .unwrap()
    };
    // --convert-limit 2: the first two by (layer, expert), archives kept.
    let o = run(&["--convert-npz", "--convert-limit", "2", "--keep-npz"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("converted 2 archives"), "{}", text(&o));
    assert_eq!(std::fs::read(dir.join("L1-E0.bin")).unwrap(), want[0]);
    assert_eq!(std::fs::read(dir.join("L2-E7.bin")).unwrap(), want[1]);
    assert!(!dir.join("L3-E15.bin").exists());
    assert!(legacy.join("L1-E0.npz").is_file());

    // Everything: the damaged archive fails alone, named; the rest are converted or reused.
    let o = run(&["--convert-npz", "--convert-workers", "3"]);
    assert!(!o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("1 of 5 legacy archives were not converted") && t.contains("L4-E9.npz"),
        "{t}"
    );
    assert!(
        t.contains("converted 2 archives") && t.contains("2 identical raw files"),
        "{t}"
    );
    for (&(l, e), raw) in experts.iter().zip(&want) {
        assert_eq!(
            &std::fs::read(dir.join(format!("L{l}-E{e}.bin"))).unwrap(),
            raw
        );
    }
    assert!(!dir.join("L4-E9.bin").exists());
    assert!(legacy.join("L4-E9.npz").is_file());
    assert!(!legacy.join("L1-E0.npz").exists() && !dir.join("L5-E4.npz").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // The damaged archive replaced by a good one: converted, and the install is whole again.
    std::fs::write(
        legacy.join("L4-E9.npz"),
        legacy_npz(&root, &raw, 0, [0, 1, 2, 3, 4, 5]),
    )
    .unwrap();
    let o = run(&["--convert-npz"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(dir.join("L4-E9.bin")).unwrap(), raw);
    Checkpoint::open(&root).unwrap();
    deltafin_store::experts::expert_table(&Checkpoint::open(&root).unwrap()).unwrap();
    let o = run(&["--convert-npz"]);
    assert!(
        o.status.success() && text(&o).contains("no legacy NPZ"),
        "{}",
        text(&o)
    );

    // An archive whose raw file exists with other bytes is refused.
    std::fs::write(
        legacy.join("L1-E0.npz"),
        legacy_npz(&root, &want[1], 0, [0, 1, 2, 3, 4, 5]),
    )
    .unwrap();
    let o = run(&["--convert-npz"]);
    assert!(
        !o.status.success() && text(&o).contains("other bytes"),
        "{}",
        text(&o)
    );
    std::fs::remove_file(legacy.join("L1-E0.npz")).unwrap();
    // A name outside the model's experts is an error naming it.
    std::fs::write(legacy.join("L0-E1.npz"), b"x").unwrap();
    let o = run(&["--convert-npz"]);
    assert!(
        !o.status.success() && text(&o).contains("L0-E1.npz"),
        "{}",
        text(&o)
    );
}

#[test]
fn convert_npz_flags_and_bad_combinations_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (&["--convert-workers", "4"][..], "--convert-npz"),
        (&["--keep-npz"], "--convert-npz"),
        (
            &["--convert-npz", "--convert-workers", "17"],
            "--convert-workers",
        ),
        (
            &["--convert-npz", "--convert-limit", "0"],
            "--convert-limit",
        ),
        (
            &["--convert-npz", "--convert-throttle-ms", "x"],
            "--convert-throttle-ms",
        ),
        (&["--convert-npz", "--fetch", "2"], "cannot be used with"),
        (&["--fetch", "2", "--cache", "/tmp"], "cannot be used with"),
        (&["--workers", "17"], "--workers"),
        (&["--show", "x"], "--show"),
        (&["--convert-npz"], "config.json is missing"),
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
}
