//! `deltafin doctor` on a good synthesized install and on broken copies of it.

mod common;

use common::text;

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// One tiny checkpoint shared by every test of this file; broken cases work on copies.
fn good_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 5)).unwrap();
        d
    })
    .path()
}

fn copy_install() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(good_root()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

fn doctor(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.arg("doctor").args(args).env_remove("DELTAFIN_ROOT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

fn check<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {v}"))
}

#[test]
fn good_install_is_healthy_with_contract_and_admitted_context() {
    let root = good_root().to_str().unwrap();
    let out = doctor(&["--model-root", root], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains("model contract: Kimi K3 14 layers (10 KDA, 4 MLA), 16 experts/top-4, context "),
        "{t}"
    );
    assert!(t.contains("doctor: healthy"), "{t}");
    assert!(t.contains("canary matvec_mxfp4"), "{t}");
    assert!(t.contains("admitted context"), "{t}");

    let out = doctor(&["--model-root", root, "--json"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(v["schema"], "deltafin.doctor.v1");
    assert_eq!(v["healthy"], true);
    assert_eq!(v["problems"], 0);
    assert_eq!(check(&v, "checkpoint")["status"], "ok");
    assert_eq!(check(&v, "tokenizer")["status"], "ok");
    assert_eq!(check(&v, "draft qwen")["status"], "info");
    // Tiny model: 4 MLA layers × (kv_lora 32 + rope 8) × 2 B.
    assert_eq!(v["facts"]["mla_cache_bytes_per_token"], 4 * 40 * 2);
    let admitted = v["admitted_context"].as_u64().unwrap();
    assert!(admitted > 0);
    assert!(v["facts"]["disk_read_gb_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn root_comes_from_deltafin_root_and_the_flag_wins() {
    let root = good_root().to_str().unwrap();
    let out = doctor(&["--json"], &[("DELTAFIN_ROOT", root)]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(json(&out)["model_root"], root);

    let out = doctor(
        &["--json", "--model-root", root],
        &[("DELTAFIN_ROOT", "/no/such/install")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(json(&out)["model_root"], root);

    let out = doctor(&[], &[("DELTAFIN_ROOT", "/no/such/install")]);
    assert_eq!(out.status.code(), Some(1));
    let t = text(&out);
    assert!(
        t.contains("no K3 model installed at /no/such/install"),
        "{t}"
    );
    assert!(t.contains("--runtime-only"), "{t}");
}

#[test]
fn runtime_only_skips_model_data_and_conflicts_with_a_root() {
    let out = doctor(
        &["--runtime-only", "--json"],
        &[("DELTAFIN_ROOT", "/no/such/install")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v = json(&out);
    assert_eq!(v["model_root"], Value::Null);
    assert_eq!(v["model_contract"], Value::Null);
    assert_eq!(check(&v, "gpu backends")["status"], "info");
    let gpu = check(&v, "gpu backends")["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(gpu.contains("device path: "), "{gpu}");
    assert!(v["facts"]["device_path"].is_string());
    if cfg!(target_os = "linux") {
        assert_eq!(check(&v, "loader")["status"], "ok");
    }
    assert!(v["facts"]["kernel_backend"].is_string());
    for c in v["checks"].as_array().unwrap() {
        if c["name"].as_str().unwrap().starts_with("canary") {
            assert_eq!(c["status"], "ok", "{c}");
        }
    }

    let out = doctor(&["--runtime-only", "--model-root", "/x"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("cannot be used with"));
}

#[test]
fn missing_shard_is_a_problem_with_a_fix() {
    let d = copy_install();
    std::fs::remove_file(d.path().join("model-00003-of-000017.safetensors")).unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap()], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("[FAIL] checkpoint"), "{t}");
    assert!(t.contains("model-00003-of-000017.safetensors"), "{t}");
    assert!(t.contains("fix: a weight shard is missing"), "{t}");
    assert!(t.contains("deltafin fetch-weights"), "{t}");
    assert!(t.contains("doctor: 1 problem found"), "{t}");
}

#[test]
fn corrupted_shard_header_is_a_problem_with_a_fix() {
    let d = copy_install();
    let shard = d.path().join("model-00002-of-000017.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&shard, bytes).unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap(), "--json"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let v = json(&out);
    assert_eq!(v["healthy"], false);
    let c = check(&v, "checkpoint");
    assert_eq!(c["status"], "fail");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("model-00002-of-000017.safetensors"),
        "{c}"
    );
    assert!(c["fix"].as_str().unwrap().contains("damaged"), "{c}");
}

#[test]
fn missing_tokenizer_file_is_a_problem_with_a_fix() {
    let d = copy_install();
    std::fs::remove_file(d.path().join("tiktoken.model")).unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap()], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("[FAIL] tokenizer"), "{t}");
    assert!(t.contains("tiktoken.model"), "{t}");
    assert!(t.contains("setup-k3 --meta-only"), "{t}");
    assert!(t.contains("[ ok ] checkpoint"), "{t}");
}

#[test]
fn partial_qwen_pair_is_an_error_and_a_broken_dspark_too() {
    let d = copy_install();
    std::fs::create_dir(d.path().join("k3-draft-qwen3-1.7b-base")).unwrap();
    std::fs::create_dir(d.path().join("k3-draft-dspark")).unwrap();
    std::fs::write(d.path().join("k3-draft-dspark/config.json"), "{}").unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap(), "--json"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let v = json(&out);
    let q = check(&v, "draft qwen");
    assert_eq!(q["status"], "fail");
    assert!(q["detail"].as_str().unwrap().contains("partial Qwen3 pair"));
    assert!(q["fix"].as_str().unwrap().contains("setup-qwen"));
    let ds = check(&v, "draft dspark");
    assert_eq!(ds["status"], "fail");
    assert!(
        ds["detail"].as_str().unwrap().contains("model.safetensors"),
        "{ds}"
    );
    assert_eq!(v["problems"], 2);
}
