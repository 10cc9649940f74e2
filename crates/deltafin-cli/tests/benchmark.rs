//! `deltafin benchmark` on the tiny synthesized model: two arms in ABBA order, oracles,
//! invalid runs, timeouts and argument checks.

mod common;

use common::{exits, ids, jsonl, library_greedy, shared_checkpoint, text};

use deltafin_k3::synth::SynthDims;
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_k3::weights::spine_int8::SpineFormat;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

const PROMPT: &str = "The capital of France is";

fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    shared_checkpoint(&DIR, SynthDims::tiny(), 3)
}

/// K3's own greedy completion of PROMPT (3 tokens), from the library.
fn greedy_ids() -> Vec<u32> {
    let ids = library_greedy(model_root(), SpineFormat::Bf16, PROMPT, 3);
    assert_eq!(
        ids.len(),
        3,
        "the tiny model stopped early; pick another seed"
    );
    ids
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .arg("benchmark")
        .arg("--model-root")
        .arg(model_root())
        .args(args)
        .env_remove("K3_REASONING_EFFORT")
        // The oracles come from the library's bf16 model; the children inherit the spine.
        .env("K3_SPINE", "bf16")
        .output()
        .unwrap()
}

/// A campaign with the whitespace-separated `words` then `extra` (arguments with spaces) as
/// its arguments, its evidence in `ev`: the exit code is asserted; the printed text and the
/// runs of `runs.jsonl` come back.
fn campaign(ev: &Path, words: &str, extra: &[&str], code: i32) -> (String, Vec<Value>) {
    let mut args: Vec<&str> = words.split_whitespace().collect();
    args.extend(extra);
    args.extend(["--output-dir", ev.to_str().unwrap()]);
    let t = exits(&bench(&args), code);
    (t, jsonl(&ev.join("runs.jsonl")))
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn two_arms_run_abba_and_match_k3_greedy() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let (t, r) = campaign(
        &ev,
        "--arm one=RAYON_NUM_THREADS=1 --reps 2 --tokens 3 --warmup-steps 1",
        &["--arm", "two=RAYON_NUM_THREADS=2 K3_REASONING_EFFORT=low"],
        0,
    );
    assert!(
        t.contains("all runs valid: true; all outputs exact: true"),
        "{t}"
    );

    let order: Vec<&str> = r.iter().map(|x| x["arm"].as_str().unwrap()).collect();
    assert_eq!(order, ["one", "two", "two", "one"]);
    let want = greedy_ids();
    for run in &r {
        assert_eq!(run["valid"], true, "{run}");
        assert_eq!(ids(&run["completion_token_ids"]), want);
        assert_eq!(
            run["steady_steps"], 1,
            "step 0 and one warmup step excluded"
        );
        assert!(run["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
        let dir = ev.join(run["dir"].as_str().unwrap());
        assert!(dir.join("events.jsonl").is_file());
        assert!(dir.join("stderr.txt").is_file());
        assert!(
            std::fs::read_to_string(dir.join("stderr.txt"))
                .unwrap()
                .contains("[deltafin] surface=raw")
        );
    }
    assert_eq!(r[0]["oracle"], "reference");
    assert_eq!(r[1]["oracle"], "match");

    let res = read_json(&ev.join("result.json"));
    assert_eq!(res["schema"], "deltafin.benchmark.v1");
    assert_eq!(res["all_runs_valid"], true);
    assert_eq!(res["all_outputs_exact"], true);
    assert_eq!(ids(&res["oracle"]["token_ids"]), want);
    let arms = res["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 2);
    for a in arms {
        assert_eq!(a["valid_runs"], 2);
        let p = &a["prefill_seconds"];
        let (min, med, max) = (
            p["min"].as_f64().unwrap(),
            p["median"].as_f64().unwrap(),
            p["max"].as_f64().unwrap(),
        );
        assert!(0.0 < min && min <= med && med <= max, "{p}");
        assert!(a["decode_tokens_per_second"]["median"].as_f64().unwrap() > 0.0);
        assert_eq!(a["bytes_read_reported"], false);
    }
    assert_eq!(
        arms[0]["relative_to_first_config"]["decode_tokens_per_second_median"],
        1.0
    );
    assert_eq!(arms[1]["env"]["K3_REASONING_EFFORT"], "low");

    let campaign = read_json(&ev.join("campaign.json"));
    assert_eq!(campaign["schedule"].as_array().unwrap().len(), 4);
    let runner = ev
        .join("bin")
        .join(format!("deltafin{}", std::env::consts::EXE_SUFFIX));
    assert!(runner.is_file());
    assert_eq!(
        campaign["runner"]["sha256"].as_str().unwrap().len(),
        64,
        "{campaign}"
    );
    let svg = std::fs::read_to_string(ev.join("latency.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
    // One line per run (plotters draws series with width 2) and one legend entry per arm.
    assert_eq!(svg.matches("stroke-width=\"2\" points").count(), 4, "{svg}");
    assert!(svg.contains("\none\n</text>") && svg.contains("\ntwo\n</text>"));
}

#[test]
fn wrong_token_oracle_invalidates_and_stops_the_campaign() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let mut wrong = greedy_ids();
    wrong[1] = wrong[1].wrapping_add(1);
    let list = format!("{},{},{}", wrong[0], wrong[1], wrong[2]);
    let words = format!("--max-new 3 --reps 2 --expect-token-ids {list}");
    let (t, r) = campaign(&ev, &words, &[], 1);
    assert!(t.contains("stopping after an invalid run"), "{t}");
    assert_eq!(r.len(), 1, "the campaign stops at the first invalid run");
    assert_eq!(r[0]["valid"], false);
    assert_eq!(r[0]["oracle"], "mismatch");
    let why = r[0]["invalid_reason"].as_str().unwrap();
    assert!(
        why.contains("token-id oracle") && why.contains("position 1"),
        "{why}"
    );
    let res = read_json(&ev.join("result.json"));
    assert_eq!(res["completed"], false);
    assert_eq!(res["all_runs_valid"], false);

    // The right ids (JSON form) and text pass.
    let good = greedy_ids();
    let ev2 = tmp.path().join("ev2");
    let text_oracle = {
        let tok = Tokenizer::from_dir(model_root()).unwrap();
        tok.decode(&good).unwrap()
    };
    let words = format!(
        "--max-new 3 --reps 1 --expect-token-ids {}",
        serde_json::to_string(&good).unwrap()
    );
    let extra = ["--prompt", PROMPT, "--expect-text", &text_oracle];
    let (_, r) = campaign(&ev2, &words, &extra, 0);
    assert_eq!(r[0]["oracle"], "match");

    // A wrong text oracle with --keep-going: every run invalid, so still a failure.
    let ev3 = tmp.path().join("ev3");
    let extra = ["--expect-text", "definitely not the completion"];
    let (_, r) = campaign(&ev3, "--max-new 2 --reps 2 --keep-going", &extra, 1);
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|x| x["oracle"] == "mismatch"));
}

#[test]
fn keep_going_continues_past_a_failing_arm() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let arms = "--arm good= --arm bad=K3_REASONING_EFFORT=bogus --reps 2 --max-new 2";
    let (t, r) = campaign(&ev, &format!("{arms} --keep-going"), &[], 0);
    assert!(t.contains("2 of 4 runs were invalid"), "{t}");
    assert_eq!(r.len(), 4);
    for run in &r {
        let bad = run["arm"] == "bad";
        assert_eq!(run["valid"], !bad, "{run}");
        if bad {
            assert_eq!(run["exit_status"], 1);
            assert!(
                run["invalid_reason"]
                    .as_str()
                    .unwrap()
                    .contains("K3_REASONING_EFFORT"),
                "{run}"
            );
        }
    }
    let res = read_json(&ev.join("result.json"));
    assert_eq!(res["all_runs_valid"], false);
    assert_eq!(res["arms"][1]["valid_runs"], 0);
    assert_eq!(res["arms"][1]["prefill_seconds"], Value::Null);

    // Without --keep-going the same campaign stops at run 2.
    let (_, r) = campaign(&tmp.path().join("ev2"), arms, &[], 1);
    assert_eq!(r.len(), 2);
}

#[test]
fn a_stalled_run_is_killed_at_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let (_, r) = campaign(&ev, "--timeout 0.001 --reps 1", &[], 1);
    assert_eq!(r[0]["timed_out"], true);
    assert!(
        r[0]["invalid_reason"]
            .as_str()
            .unwrap()
            .contains("timed out")
    );
}

#[test]
fn bad_arguments_are_refused_before_any_run() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let evs = ev.to_str().unwrap();
    // Whitespace-separated arguments, then what the refusal says.
    let cases = [
        ("--arm a= --arm b= --reps 3", "even number of repetitions"),
        ("--arm a=LD_PRELOAD=/tmp/x.so", "dynamic-loader"),
        ("--arm a= --arm a=X=1", "used twice"),
        ("--expect-token-ids 1,two", "`two` is not a token id"),
        ("--timeout 0", "positive"),
        ("--max-new 3 --warmup-steps 2", "--warmup-steps 2"),
        ("--configs A=1 B=2 --names x", "one name per arm"),
    ];
    for (words, msg) in cases {
        let mut args: Vec<&str> = words.split_whitespace().collect();
        args.extend(["--output-dir", evs]);
        let out = bench(&args);
        let t = text(&out);
        assert_ne!(out.status.code(), Some(0), "{words}: {t}");
        assert!(t.contains(msg), "{words}: {t}");
        assert!(!ev.exists(), "{words} created the evidence directory");
    }
    let out = bench(&["--arm", "a=", "--configs", "X=1"]);
    assert_eq!(out.status.code(), Some(2));
    std::fs::create_dir_all(&ev).unwrap();
    std::fs::write(ev.join("keep"), "x").unwrap();
    let out = bench(&["--output-dir", evs]);
    assert!(
        text(&out).contains("not an empty directory"),
        "{}",
        text(&out)
    );
}

/// Greedy against seeded sampling: each sampling setting is its own output class (its runs
/// must repeat each other, not match greedy), and a seed-less sampled arm, which cannot
/// repeat, is caught.
#[test]
fn sampled_arms_are_checked_against_their_own_first_run() {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev");
    let arms = [
        "--arm",
        "greedy=",
        "--arm",
        "t1=K3_TEMPERATURE=1.0 K3_SEED=7",
        "--arm",
        "t1b=K3_SEED=7 K3_TEMPERATURE=1.0",
    ];
    let (_, r) = campaign(&ev, "--max-new 6 --reps 2", &arms, 0);
    assert_eq!(r.len(), 6);
    assert!(r.iter().all(|x| x["valid"] == true), "{r:?}");
    let ids = |arm: &str| -> Vec<Value> {
        r.iter()
            .filter(|x| x["arm"] == arm)
            .map(|x| x["completion_token_ids"].clone())
            .collect()
    };
    assert_eq!(ids("t1"), ids("t1b"));
    assert_ne!(ids("greedy")[0], ids("t1")[0], "sampling changed nothing");
    let ev2 = tmp.path().join("ev2");
    let fresh = ["--arm", "greedy=", "--arm", "fresh=K3_TEMPERATURE=1.0"];
    let (t, r) = campaign(&ev2, "--max-new 6 --reps 2 --keep-going", &fresh, 0);
    assert!(t.contains("1 of 4 runs were invalid"), "{t}");
    assert!(r.iter().any(|x| x["oracle"] == "mismatch"), "{r:?}");
}
