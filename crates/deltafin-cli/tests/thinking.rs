//! `deltafin run --chat` thinking control (`--no-thinking`, `--reasoning-effort` with the
//! server's spellings, `K3_REASONING_EFFORT`), and environment values that are not UTF-8.

mod common;

use common::{deltafin_bf16, exits, ids, jsonl, shared_checkpoint};
use deltafin_k3::generate::GenerateOptions;
use deltafin_k3::synth::SynthDims;
use deltafin_k3::text::chat::{ChatMessage, ReasoningEffort, Thinking, encode_chat};
use deltafin_k3::text::tokenizer::{END_OF_MSG, Tokenizer};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_spec::generate;
use std::path::Path;
use std::process::Output;
use std::sync::OnceLock;

fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    shared_checkpoint(&DIR, SynthDims::tiny(), 11)
}

fn on_model(args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin_bf16(model_root(), args, &["K3_REASONING_EFFORT"], env)
}

fn prompt_ids(thinking: Thinking) -> Vec<u32> {
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    encode_chat(
        &tok,
        &[ChatMessage::new("user", "Hi")],
        &thinking.chat_options(),
    )
    .unwrap()
}

/// The events of `run --chat --prompt Hi --max-new 4` with `extra` flags.
fn chat_run(extra: &[&str], env: &[(&str, &str)]) -> (Output, Vec<serde_json::Value>) {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev.jsonl");
    let ev_arg = ev.to_str().unwrap().to_string();
    let args = [
        &[
            "run",
            "--chat",
            "--prompt",
            "Hi",
            "--max-new",
            "4",
            "--events-jsonl",
            &ev_arg,
        ][..],
        extra,
    ]
    .concat();
    let out = on_model(&args, env);
    exits(&out, 0);
    let events = jsonl(&ev);
    (out, events)
}

#[test]
fn no_thinking_opens_the_response_and_prints_the_answer() {
    let (out, ev) = chat_run(&["--no-thinking"], &[("K3_REASONING_EFFORT", "high")]);
    let want = prompt_ids(Thinking::Off);
    assert_eq!(ids(&ev[0]["prompt_token_ids"]), want);
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    let open_response = tok.encode_ordinary("response");
    assert!(want.ends_with(&[&open_response[..], &[deltafin_k3::text::tokenizer::SEP]].concat()));
    assert_eq!(ev[0]["config"]["thinking"], false);
    assert_eq!(ev[0]["config"]["reasoning_effort"], "none");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reasoning_effort=none (flag)"), "{err}");

    // The tokens are K3's greedy continuation of that prompt, and stdout is their text.
    let model = open_model(model_root(), &EngineOptions::default()).unwrap();
    let opts = GenerateOptions {
        max_new: Some(4),
        stop_ids: vec![END_OF_MSG],
        max_context: 4096,
        top_logits: 0,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let greedy = generate(&model, &want, &opts, &stop, |_| Ok(()))
        .unwrap()
        .ids;
    let end = ev.last().unwrap();
    assert_eq!(ids(&end["emitted_token_ids"]), greedy);
    let text = tok.decode(&greedy).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{text}\n"));
}

#[test]
fn effort_spellings_match_the_server() {
    // `off`, `none` and `minimal` turn thinking off, from the flag or the environment.
    for (extra, env, source) in [
        (&["--reasoning-effort", "off"][..], &[][..], "flag"),
        (&["--reasoning-effort", "minimal"], &[], "flag"),
        (&[], &[("K3_REASONING_EFFORT", "none")], "env"),
        (&[], &[("K3_REASONING_EFFORT", " None ")], "env"),
    ] {
        let (out, ev) = chat_run(extra, env);
        assert_eq!(ids(&ev[0]["prompt_token_ids"]), prompt_ids(Thinking::Off));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("reasoning_effort=none ({source})")),
            "{err}"
        );
    }
    // Case and whitespace are ignored, as on the server; the flag wins over the variable.
    let (out, ev) = chat_run(
        &["--reasoning-effort", " HIGH"],
        &[("K3_REASONING_EFFORT", "none")],
    );
    assert_eq!(
        ids(&ev[0]["prompt_token_ids"]),
        prompt_ids(Thinking::On(ReasoningEffort::High))
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("reasoning_effort=high (flag)"));
}

#[test]
fn conflicting_or_misplaced_thinking_flags_are_errors() {
    let out = on_model(
        &[
            "run",
            "--chat",
            "--no-thinking",
            "--reasoning-effort",
            "high",
        ],
        &[],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--no-thinking") && err.contains("--reasoning-effort"),
        "{err}"
    );
    for flags in [&["--no-thinking"][..], &["--reasoning-effort", "low"]] {
        let out = on_model(&[&["run"][..], flags].concat(), &[]);
        assert!(!out.status.success(), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--chat"), "{flags:?}: {err}");
    }
    let out = on_model(&["run", "--chat", "--reasoning-effort", "extreme"], &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--reasoning-effort")
            && err.contains("\"extreme\"")
            && err.contains(deltafin_k3::text::chat::THINKING_SPELLINGS),
        "{err}"
    );
    // The variable is checked even when the flag wins.
    let out = on_model(
        &["run", "--chat", "--no-thinking"],
        &[("K3_REASONING_EFFORT", "lots")],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("K3_REASONING_EFFORT"));
}

/// Every `K3_*` / `DELTAFIN_*` setting the CLI reads refuses a value that is not UTF-8 with
/// an error naming the variable (never taken as unset).
#[cfg(unix)]
#[test]
fn non_utf8_settings_are_errors_naming_the_variable() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let bad = OsStr::from_bytes(b"o\xffn");
    let run_vars = [
        "K3_DSPARK",
        "K3_UAG_DRAFT",
        "K3_SPEC_DEPTH",
        "K3_DSPARK_MAX_CONTEXT",
        "K3_DSPARK_AUTO_MIN_SPEEDUP",
        "K3_REASONING_EFFORT",
        "K3_SPINE",
        "K3_MEMORY_BUDGET_GB",
        "K3_DEV",
        "K3_DEV_RESERVE_GB",
        "K3_MOE",
        "K3_EXPERT_SCALE4",
        "K3_EXPERT_HEAT",
        "K3_EXPERT_PIN_GB",
        "K3_EXPERT_READ_THREADS",
        "K3_EXPERT_STREAM_NOCACHE",
        "K3_SPINE_READ_THREADS",
        "K3_SPINE_STREAM_NOCACHE",
        "K3_PROVIDER_RESIDENT_LAYERS",
        "K3_PILOT_GATE",
        "K3_PILOT_GATE_THRESHOLD",
        "K3_PILOT_GATE_WARMUP",
        "K3_PILOT_RANK_PRECISION",
        "K3_PILOT_MAX_GUESSES",
        "K3_TRACE",
        "K3_TRACE_PATH",
        "DELTAFIN_HUGE_PAGES",
        "DELTAFIN_KERNEL",
        "DELTAFIN_MXFP4_ACT",
        "DELTAFIN_POOL_SPIN",
        "DELTAFIN_POOL_PREFETCH",
    ];
    let root = model_root().to_str().unwrap();
    let check = |args: &[&str], var: &str| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_deltafin"))
            .args(args)
            .args(["--model-root", root])
            .env_remove("K3_REASONING_EFFORT")
            .env("K3_SPINE", "bf16")
            .env(var, bad)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A server that accepted the value would not exit: stop it and fail.
        let t = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                panic!("{var}: {args:?} did not fail");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}: succeeded: {err}");
        assert!(err.contains(var), "{var}: {err}");
    };
    for var in run_vars {
        check(&["run", "--chat", "--max-new", "1"], var);
    }
    for var in [
        "K3_SERVER_QUEUE",
        "K3_REASONING_EFFORT",
        "K3_DSPARK",
        "K3_UAG_DRAFT",
    ] {
        check(&["serve", "--port", "0"], var);
    }
}
