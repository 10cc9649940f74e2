//! `deltafin run` with DSpark drafts (`K3_DSPARK=on`) emits exactly the ids of plain greedy
//! decoding, and reports the proposals in the events file.

use deltafin_k3::config::K3Config;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize, synthesize_dspark};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn deltafin(root: &Path, events: &Path, dspark: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "run",
            "--chat",
            "--prompt",
            "Hi",
            "--max-new",
            "10",
            "--model-root",
        ])
        .arg(root)
        .arg("--events-jsonl")
        .arg(events)
        .env("K3_DSPARK", dspark)
        // Plain greedy and drafted runs on the weight-exact spine (no conversion needed).
        .env("K3_SPINE", "bf16")
        .env_remove("K3_REASONING_EFFORT")
        .output()
        .unwrap()
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn dspark_run_equals_plain_greedy() {
    let root = tempfile::tempdir().unwrap();
    synthesize(root.path(), &SynthSpec::new(SynthDims::tiny(), 3)).unwrap();
    let tmp = tempfile::tempdir().unwrap();

    // K3_DSPARK=on without a drafter checkpoint is a clear error.
    let out = deltafin(root.path(), &tmp.path().join("e0.jsonl"), "on");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("k3-draft-dspark") && err.contains("K3_DSPARK"),
        "{err}"
    );

    let cfg = K3Config::from_file(root.path().join("config.json")).unwrap();
    synthesize_dspark(&root.path().join("k3-draft-dspark"), 3, &cfg).unwrap();
    let plain = deltafin(root.path(), &tmp.path().join("off.jsonl"), "off");
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    let spec = deltafin(root.path(), &tmp.path().join("on.jsonl"), "on");
    assert!(
        spec.status.success(),
        "{}",
        String::from_utf8_lossy(&spec.stderr)
    );
    assert_eq!(plain.stdout, spec.stdout, "stdout differs with drafts");

    let off = events(&tmp.path().join("off.jsonl"));
    let on = events(&tmp.path().join("on.jsonl"));
    let end = |ev: &[Value]| ev.last().unwrap().clone();
    assert_eq!(
        end(&off)["emitted_token_ids"],
        end(&on)["emitted_token_ids"]
    );
    assert_eq!(end(&on)["stop_reason"], end(&off)["stop_reason"]);
    let steps: Vec<&Value> = on.iter().filter(|e| e["event"] == "decode_step").collect();
    let proposed: u64 = steps
        .iter()
        .map(|s| s["proposed_token_count"].as_u64().unwrap())
        .sum();
    let emitted: usize = steps
        .iter()
        .map(|s| s["emitted_token_ids"].as_array().unwrap().len())
        .sum();
    assert!(proposed > 0, "DSpark proposed nothing");
    assert_eq!(
        emitted,
        end(&on)["emitted_token_ids"].as_array().unwrap().len()
    );
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"].as_u64().unwrap() as usize, i);
        let n = s["emitted_token_ids"].as_array().unwrap().len() as u64;
        assert!(n >= 1 && n <= s["accepted_token_count"].as_u64().unwrap() + 1);
    }
    assert!(String::from_utf8_lossy(&spec.stderr).contains("dspark=on"));
}
