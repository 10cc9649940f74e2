//! `deltafin run` with DSpark drafts (`K3_DSPARK=on`) emits exactly the ids of plain greedy
//! decoding, and reports the proposals in the events file.

mod common;

use common::{checkpoint, deltafin_bf16, jsonl};

use deltafin_k3::config::K3Config;
use deltafin_k3::synth::{QwenSize, SynthDims, synthesize_dspark, synthesize_qwen3};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_spec::uag::synthesize_tokenizer_json;
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

#[test]
fn dspark_run_equals_plain_greedy() {
    let root = checkpoint(SynthDims::tiny(), 3);
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

    let off = jsonl(&tmp.path().join("off.jsonl"));
    let on = jsonl(&tmp.path().join("on.jsonl"));
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

/// What a test here asks for itself: the reasoning effort and the drafting settings.
const UNSET: &[&str] = &[
    "K3_REASONING_EFFORT",
    "K3_DSPARK",
    "K3_UAG_DRAFT",
    "K3_SPEC_DEPTH",
    "K3_DSPARK_AUTO_MIN_SPEEDUP",
];

/// `deltafin run args` on the weight-exact spine (no conversion needed).
fn run_env(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin_bf16(root, &[&["run"], args].concat(), UNSET, env)
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Raw completions draft with Qwen (K3_UAG_DRAFT), chat with DSpark in auto mode; every
/// mode prints exactly the plain greedy text, and bad draft files are named.
#[test]
fn qwen_and_auto_drafting_in_run_equal_plain_greedy() {
    let root = checkpoint(SynthDims::tiny(), 3);
    let raw = ["--prompt", "The capital of France is", "--max-new", "12"];

    // K3_UAG_DRAFT=on without the Qwen directory names the missing file.
    let out = run_env(root.path(), &raw, &[("K3_UAG_DRAFT", "on")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("k3-draft-qwen3-0.6b-base/config.json") && err.contains("K3_UAG_DRAFT"),
        "{err}"
    );

    let qdir = root.path().join("k3-draft-qwen3-0.6b-base");
    synthesize_qwen3(&qdir, 5, QwenSize::Small).unwrap();
    let out = run_env(root.path(), &raw, &[("K3_UAG_DRAFT", "auto")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tokenizer.json"),
        "{err}"
    );
    std::fs::write(qdir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let out = run_env(root.path(), &raw, &[("K3_UAG_DRAFT", "on")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tokenizer.json"),
        "{err}"
    );
    let tok = Tokenizer::from_dir(root.path()).unwrap();
    let json = synthesize_tokenizer_json(&tok, 3000);
    std::fs::write(qdir.join("tokenizer.json"), json.to_string()).unwrap();

    let plain = run_env(root.path(), &raw, &[("K3_UAG_DRAFT", "off")]);
    assert!(ok(&plain).contains("drafter=none"));
    for (mode, depth) in [("on", "8"), ("auto", "3"), ("on", "1")] {
        let o = run_env(
            root.path(),
            &raw,
            &[("K3_UAG_DRAFT", mode), ("K3_SPEC_DEPTH", depth)],
        );
        let err = ok(&o);
        assert!(err.contains("drafter=qwen3-0.6b"), "{err}");
        assert_eq!(plain.stdout, o.stdout, "K3_UAG_DRAFT={mode} depth {depth}");
    }
    // --stats: the drafting counters and the policy.
    let o = run_env(
        root.path(),
        &[&raw[..], &["--stats"]].concat(),
        &[("K3_UAG_DRAFT", "on")],
    );
    ok(&o);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let last = stdout.lines().last().unwrap();
    for field in [
        "drafts=",
        "mean_accepted=",
        "verify_passes=",
        "policy=on:",
        "width=",
        "speedup=",
    ] {
        assert!(last.contains(field), "{field} missing: {last}");
    }
    // --top-logits needs every distribution: auto yields, on refuses.
    let tl = tempfile::tempdir().unwrap();
    let ev = tl.path().join("e.jsonl");
    let ev = ev.to_str().unwrap();
    let o = run_env(
        root.path(),
        &[&raw[..], &["--top-logits", "3", "--events-jsonl", ev]].concat(),
        &[],
    );
    assert!(ok(&o).contains("drafter=none"));
    let o = run_env(
        root.path(),
        &[&raw[..], &["--top-logits", "3", "--events-jsonl", ev]].concat(),
        &[("K3_UAG_DRAFT", "on")],
    );
    assert!(!o.status.success());

    // Chat with DSpark installed: auto (the default) drafts and stays exact.
    let cfg = K3Config::from_file(root.path().join("config.json")).unwrap();
    synthesize_dspark(&root.path().join("k3-draft-dspark"), 3, &cfg).unwrap();
    let chat = ["--chat", "--prompt", "Hi", "--max-new", "10"];
    let off = run_env(root.path(), &chat, &[("K3_DSPARK", "off")]);
    assert!(ok(&off).contains("drafter=none"));
    let auto = run_env(root.path(), &chat, &[]);
    assert!(ok(&auto).contains("drafter=dspark"));
    assert_eq!(off.stdout, auto.stdout);
    // K3_DSPARK=on takes raw completions too.
    let o = run_env(root.path(), &raw, &[("K3_DSPARK", "on")]);
    assert!(ok(&o).contains("drafter=dspark"));
    assert_eq!(plain.stdout, o.stdout);
    // A bad margin is named.
    let o = run_env(root.path(), &raw, &[("K3_DSPARK_AUTO_MIN_SPEEDUP", "2")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("K3_DSPARK_AUTO_MIN_SPEEDUP"),
        "{err}"
    );
}

/// `deltafin benchmark` A/B-tests drafting: the DSpark arm's events validate, its output
/// matches the plain arm exactly, and its proposals are counted.
#[test]
fn benchmark_ab_tests_dspark_against_plain() {
    let root = checkpoint(SynthDims::tiny(), 3);
    let cfg = K3Config::from_file(root.path().join("config.json")).unwrap();
    synthesize_dspark(&root.path().join("k3-draft-dspark"), 3, &cfg).unwrap();
    let ev = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .env("K3_SPINE", "bf16")
        .args([
            "benchmark",
            "--chat",
            "--prompt",
            "Hi",
            "--arm",
            "plain=K3_DSPARK=off",
            "--arm",
            "dspark=K3_DSPARK=on",
            "--reps",
            "2",
            "--tokens",
            "6",
            "--model-root",
        ])
        .arg(root.path())
        .arg("--output-dir")
        .arg(ev.path())
        .env_remove("K3_REASONING_EFFORT")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("all runs valid: true; all outputs exact: true"),
        "{text}"
    );
    let runs: Vec<Value> = std::fs::read_to_string(ev.path().join("runs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(runs.len(), 4);
    for r in &runs {
        let proposed = r["proposed_tokens"].as_u64().unwrap();
        if r["arm"] == "dspark" {
            assert!(proposed > 0, "{r}");
        } else {
            assert_eq!(proposed, 0, "{r}");
        }
    }
}

/// `deltafin run --temperature`: the same seed gives the same ids with drafting on or off and
/// through the `K3_*` variables; the seed is in the events file; a run without one reports a
/// fresh seed that repeats it; bad values are named.
#[test]
fn seeded_sampling_repeats_with_and_without_drafts() {
    let root = checkpoint(SynthDims::tiny(), 3);
    let cfg = K3Config::from_file(root.path().join("config.json")).unwrap();
    synthesize_dspark(&root.path().join("k3-draft-dspark"), 3, &cfg).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str], env: &[(&str, &str)]| -> Vec<Value> {
        let events = tmp.path().join(name);
        let mut args = vec![
            "run",
            "--chat",
            "--no-thinking",
            "--prompt",
            "Hi",
            "--max-new",
            "12",
        ];
        args.extend(extra);
        args.extend(["--events-jsonl", events.to_str().unwrap()]);
        let unset = [
            "K3_TEMPERATURE",
            "K3_SEED",
            "K3_TOP_P",
            "K3_TOP_K",
            "K3_MIN_P",
        ];
        let out = deltafin_bf16(root.path(), &args, &unset, env);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        jsonl(&events)
    };
    let emitted = |ev: &[Value]| ev.last().unwrap()["emitted_token_ids"].clone();
    let sampled = ["--temperature", "1.0", "--top-p", "0.95", "--seed", "42"];
    let off = run("off.jsonl", &sampled, &[("K3_DSPARK", "off")]);
    let on = run("on.jsonl", &sampled, &[("K3_DSPARK", "on")]);
    assert_eq!(emitted(&off), emitted(&on));
    let via_env = run(
        "env.jsonl",
        &[],
        &[
            ("K3_DSPARK", "off"),
            ("K3_TEMPERATURE", "1.0"),
            ("K3_TOP_P", "0.95"),
            ("K3_SEED", "42"),
        ],
    );
    assert_eq!(emitted(&via_env), emitted(&off));
    assert_eq!(off[0]["config"]["sampling"]["seed"], 42, "{}", off[0]);
    let greedy = run("greedy.jsonl", &[], &[("K3_DSPARK", "off")]);
    assert!(greedy[0]["config"]["sampling"].is_null());
    assert_ne!(emitted(&greedy), emitted(&off), "sampling changed nothing");
    // No seed: a fresh one, reported, repeats the run.
    let fresh = run(
        "fresh.jsonl",
        &["--temperature", "0.8"],
        &[("K3_DSPARK", "off")],
    );
    let seed = fresh[0]["config"]["sampling"]["seed"]
        .as_u64()
        .unwrap()
        .to_string();
    let again = run(
        "again.jsonl",
        &["--temperature", "0.8", "--seed", &seed],
        &[("K3_DSPARK", "off")],
    );
    assert_eq!(emitted(&fresh), emitted(&again));
    for (args, env, needle) in [
        (vec!["--temperature", "3"], vec![], "--temperature"),
        (vec!["--temperature", "1", "--top-p", "0"], vec![], "top_p"),
        (vec![], vec![("K3_TEMPERATURE", "hot")], "K3_TEMPERATURE"),
    ] {
        let root_s = root.path().to_str().unwrap();
        let mut a = vec![
            "run",
            "--prompt",
            "Hi",
            "--max-new",
            "2",
            "--model-root",
            root_s,
        ];
        a.extend(args);
        let out = common::deltafin(&a, &[], &[&[("K3_SPINE", "bf16")], env.as_slice()].concat());
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{needle}: {err}");
    }
}
