//! End-to-end tests of the `deltafin` binary on a synthesized tiny K3 checkpoint.

mod common;

use common::{deltafin_bf16, exits, fails_with, ids, jsonl, shared_checkpoint};

use deltafin_k3::generate::{greedy, logsumexp};
use deltafin_k3::synth::SynthDims;
use deltafin_k3::text::chat::{ChatMessage, ChatOptions, ReasoningEffort, encode_chat};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// One tiny checkpoint shared by every test of this binary.
fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    shared_checkpoint(&DIR, SynthDims::tiny(), 11)
}

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    // The library comparisons here use the weight-exact bf16 model: pin the bf16 spine (the
    // CLI default is int8; tests/spine.rs covers it). A test's own env may override it.
    let env = [&[("K3_SPINE", "bf16")], env].concat();
    common::deltafin(args, &["K3_REASONING_EFFORT"], &env)
}

/// [`deltafin`] on the shared checkpoint: `args --model-root <it>`.
fn on_model(args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin_bf16(model_root(), args, &["K3_REASONING_EFFORT"], env)
}

fn top(v: &Value) -> Vec<(u32, f32)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
        .collect()
}

fn root_arg() -> String {
    model_root().display().to_string()
}

#[test]
fn run_events_carry_ids_and_the_engines_own_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let ev_path: PathBuf = tmp.path().join("events.jsonl");
    let out = on_model(
        &[
            "run",
            "--max-new",
            "6",
            "--events-jsonl",
            ev_path.to_str().unwrap(),
            "--top-logits",
            "8",
        ],
        &[],
    );
    exits(&out, 0);
    let ev = jsonl(&ev_path);
    let kinds: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(kinds[..2], ["run_start", "prefill_done"]);
    assert_eq!(kinds.last(), Some(&"run_end"));
    for e in &ev {
        assert_eq!(e["schema"], "deltafin.run_event.v1");
    }

    // The prompt ids are the raw encoding of the default prompt (no BOS).
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    let prompt = tok.encode_ordinary("The capital of France is");
    assert_eq!(prompt, [1008, 10484, 318, 15383, 387]);
    assert_eq!(ids(&ev[0]["prompt_token_ids"]), prompt);

    // Recompute every distribution in-process: the events carry exactly these values.
    let model = open_model(model_root(), &EngineOptions::default()).unwrap();
    let mut state = model.new_state();
    let mut logits = model.prefill(&mut state, &prompt).unwrap();
    let steps: Vec<&Value> = ev.iter().filter(|e| e["event"] == "decode_step").collect();
    assert_eq!(steps.len(), 6);
    let want_top = |l: &[f32]| deltafin_k3::generate::top_logits(l, 8);
    assert_eq!(top(&ev[0]["last_prompt_top_logits"]), want_top(&logits));
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
    assert!(close(
        ev[0]["last_prompt_logsumexp"].as_f64().unwrap(),
        logsumexp(&logits)
    ));
    let mut emitted = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"].as_u64().unwrap() as usize, i);
        let id = s["token_id"].as_u64().unwrap() as u32;
        assert_eq!(id, greedy(&logits), "step {i} is not the greedy choice");
        assert_eq!(ids(&s["emitted_token_ids"]), vec![id]);
        let t = top(&s["top_logits"]);
        assert_eq!(t, want_top(&logits), "step {i} top logits");
        assert_eq!(t[0].0, id);
        let lse = s["logsumexp"].as_f64().unwrap();
        assert!(close(lse, logsumexp(&logits)));
        assert!(lse >= t[0].1 as f64, "logsumexp below the top logit");
        assert!(t.windows(2).all(|w| w[0].1 >= w[1].1), "not descending");
        emitted.push(id);
        logits = model.decode(&mut state, id).unwrap();
    }
    let end = ev.last().unwrap();
    assert_eq!(ids(&end["emitted_token_ids"]), emitted);
    assert_eq!(ids(&end["prompt_token_ids"]), prompt);
    assert_eq!(end["stop_reason"], "max_new");

    // stdout is exactly the decoded completion.
    let text = tok.decode(&emitted).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{text}\n"));
    assert_eq!(end["completion_text"].as_str().unwrap(), text);
    // The startup echo names the resolved settings.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("surface=raw") && err.contains("max_new=6"),
        "{err}"
    );
}

#[test]
fn default_subcommand_is_run_and_chat_uses_the_env_effort() {
    let tmp = tempfile::tempdir().unwrap();
    let ev_path = tmp.path().join("e.jsonl");
    let out = on_model(
        &[
            "--chat",
            "--prompt",
            "Hello <|open|>",
            "--max-new",
            "2",
            "--events-jsonl",
            ev_path.to_str().unwrap(),
        ],
        &[("K3_REASONING_EFFORT", "low")],
    );
    exits(&out, 0);
    let ev = jsonl(&ev_path);
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    let opts = ChatOptions {
        effort: Some(ReasoningEffort::Low),
        ..Default::default()
    };
    let want = encode_chat(&tok, &[ChatMessage::new("user", "Hello <|open|>")], &opts).unwrap();
    assert_eq!(ids(&ev[0]["prompt_token_ids"]), want);
    // The flag wins over the environment.
    let out = on_model(
        &[
            "run",
            "--chat",
            "--reasoning-effort",
            "max",
            "--max-new",
            "1",
        ],
        &[("K3_REASONING_EFFORT", "low")],
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("reasoning_effort=max (flag)"));
}

#[test]
fn bad_inputs_are_clear_errors() {
    let empty = tempfile::tempdir().unwrap();
    let out = deltafin(
        &["run", "--model-root", empty.path().to_str().unwrap()],
        &[],
    );
    let err = fails_with(&out, "config.json is missing");
    assert!(err.contains("deltafin setup"), "{err}");

    // A bad setting in the environment is an error naming the variable and the value.
    for (var, value) in [
        ("K3_REASONING_EFFORT", "extreme"),
        ("DELTAFIN_POOL_SPIN", "maybe"),
        ("DELTAFIN_POOL_PREFETCH", "ON"),
    ] {
        let out = on_model(&["run"], &[(var, value)]);
        assert!(!out.status.success(), "{var}={value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(var) && err.contains(value), "{err}");
    }

    let out = on_model(&["run", "--top-logits", "5"], &[]);
    fails_with(&out, "--events-jsonl");

    let out = deltafin(&["run", "--top-logits", "101", "--events-jsonl", "x"], &[]);
    assert!(!out.status.success());
    let out = deltafin(&["run", "--max-new", "-3"], &[]);
    assert!(!out.status.success());
    let out = deltafin(&["run", "--no-such-flag"], &[]);
    assert!(!out.status.success());
}

/// Device requests that cannot be honoured are errors naming what is missing, never a panic
/// and never a CPU run claiming a GPU; `auto` and `cpu` run on the CPU.
#[test]
fn device_requests_name_what_is_missing() {
    let out = on_model(&["run", "--max-new", "1"], &[("K3_DEV_RESERVE_GB", "lots")]);
    let err = fails_with(&out, "K3_DEV_RESERVE_GB");
    assert!(err.contains("lots"), "{err}");
    for (flags, prefix) in [
        (&["--device", "cuda:7"][..], "--device cuda:7: "),
        (
            &["--expert-backend", "cuda", "--device", "cuda:7"][..],
            "--device cuda:7: ",
        ),
        (&["--device", "mps"][..], "--device mps: "),
        (
            &["--expert-backend", "metal"][..],
            "--expert-backend metal: ",
        ),
    ] {
        let out = on_model(&[&["run", "--max-new", "1"], flags].concat(), &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(prefix), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // No test machine has eight GPUs: cuda:7 names the missing piece.
    let out = on_model(&["run", "--device", "cuda:7"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("built without the `cuda` feature")
            || err.contains("libcuda")
            || err.contains("no CUDA device")
            || err.contains("does not exist"),
        "{err}"
    );
    let out = on_model(
        &[
            "run",
            "--max-new",
            "1",
            "--device",
            "auto",
            "--expert-backend",
            "auto",
        ],
        &[],
    );
    exits(&out, 0);
    assert!(String::from_utf8_lossy(&out.stderr).contains("device=cpu"));
}

/// `deltafin run --max-new N` on the tiny model with one environment setting: every decode
/// step's (token id, top logits, log-sum-exp) from the events, and stderr. Fails on a failed run.
fn decode_steps(dir: &Path, max_new: usize, var: &str, value: &str) -> (Vec<[Value; 3]>, String) {
    let ev_path = dir.join(format!("events-{var}-{value}.jsonl"));
    let out = on_model(
        &[
            "run",
            "--max-new",
            &max_new.to_string(),
            "--events-jsonl",
            ev_path.to_str().unwrap(),
            "--top-logits",
            "8",
        ],
        &[(var, value)],
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    let steps = jsonl(&ev_path)
        .into_iter()
        .filter(|e| e["event"] == "decode_step")
        .map(|e| {
            [
                e["token_id"].clone(),
                e["top_logits"].clone(),
                e["logsumexp"].clone(),
            ]
        })
        .collect();
    (steps, err)
}

/// `DELTAFIN_HUGE_PAGES`: copying the resident weights into huge-page memory changes no
/// token and no logit; the startup lines say what was copied; a bad value is an error naming
/// the variable.
#[test]
fn huge_page_copies_change_no_value() {
    let tmp = tempfile::tempdir().unwrap();
    let (off, off_err) = decode_steps(tmp.path(), 4, "DELTAFIN_HUGE_PAGES", "off");
    assert_eq!(off.len(), 4);
    assert!(
        !off_err.contains("copied into anonymous memory"),
        "{off_err}"
    );
    let (auto, auto_err) = decode_steps(tmp.path(), 4, "DELTAFIN_HUGE_PAGES", "auto");
    assert_eq!(auto, off);
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[always]") || thp.contains("[madvise]") {
        assert!(
            auto_err.contains("resident spine: ") && auto_err.contains("routed experts: "),
            "{auto_err}"
        );
    }
    let out = on_model(
        &["run", "--max-new", "1"],
        &[("DELTAFIN_HUGE_PAGES", "always")],
    );
    let err = fails_with(&out, "DELTAFIN_HUGE_PAGES");
    assert!(err.contains("\"always\""), "{err}");
}

/// The keep-warm loops and the idle workers' lookahead prefetch only schedule and hint:
/// tokens and log-probabilities are the same with each on and off.
#[test]
fn pool_spin_and_prefetch_change_no_value() {
    let tmp = tempfile::tempdir().unwrap();
    for (var, shown) in [
        ("DELTAFIN_POOL_SPIN", "pool_spin"),
        ("DELTAFIN_POOL_PREFETCH", "pool_prefetch"),
    ] {
        let (on, on_err) = decode_steps(tmp.path(), 5, var, "on");
        assert!(on_err.contains(&format!("{shown}=on")), "{on_err}");
        assert_eq!(on.len(), 5);
        let (off, off_err) = decode_steps(tmp.path(), 5, var, "off");
        assert!(off_err.contains(&format!("{shown}=off")), "{off_err}");
        assert_eq!(on, off, "{var}");
    }
}

#[test]
fn version_and_help() {
    let out = deltafin(&["--version"], &[]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "deltafin 0.1.0"
    );
    let out = deltafin(&["--help"], &[]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("Deltafin native runtime"));
}

#[test]
fn stats_lines_replace_the_text() {
    let out = on_model(&["run", "--max-new", "3", "--stats"], &[]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for (i, l) in lines.iter().enumerate() {
        assert!(
            l.starts_with(&format!("[stats] generated={} ", i + 1)),
            "{l}"
        );
        assert!(l.contains("token/s") && l.contains("s/token"));
    }
}

#[test]
fn perplexity_json_matches_the_library_score() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("text.txt");
    let text =
        "Kimi K3 keeps every routed expert. The spine stays resident; experts stream from disk.\n";
    std::fs::write(&file, text.repeat(3)).unwrap();
    let out = on_model(
        &[
            "perplexity",
            "--file",
            file.to_str().unwrap(),
            "--chunk",
            "16",
            "--json",
        ],
        &[],
    );
    exits(&out, 0);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let model = open_model(model_root(), &EngineOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    let ids = tok.encode_ordinary(&text.repeat(3));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let want = deltafin_k3::generate::score(&model, &ids, 16, false, &stop, |_, _| {}).unwrap();
    assert_eq!(v["tokens_scored"].as_u64().unwrap() as usize, ids.len() - 1);
    // serde_json's default float parser may be one ULP off, so compare at 1e-12.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
    assert!(close(v["mean_nll"].as_f64().unwrap(), want.mean_nll()));
    assert!(close(v["perplexity"].as_f64().unwrap(), want.perplexity()));

    let missing = on_model(&["perplexity", "--file", "/no/such/file"], &[]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/no/such/file"));
}

#[test]
fn ctrl_c_stops_at_a_token_boundary_and_closes_the_events_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ev_path = tmp.path().join("events.jsonl");
    let child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "run",
            "--model-root",
            &root_arg(),
            "--max-new",
            "100000",
            "--events-jsonl",
        ])
        .arg(&ev_path)
        .env("K3_SPINE", "bf16")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a few decode steps, then interrupt.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let steps = std::fs::read_to_string(&ev_path)
            .map(|s| s.matches("\"decode_step\"").count())
            .unwrap_or(0);
        if steps >= 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no decode steps");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(rc, 0);
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = jsonl(&ev_path);
    let end = ev.last().unwrap();
    assert_eq!(end["event"], "run_end");
    assert_eq!(end["stop_reason"], "interrupted");
    assert_eq!(end["status"], "interrupted");
    let steps = ev.iter().filter(|e| e["event"] == "decode_step").count();
    assert_eq!(
        ids(&end["emitted_token_ids"]).len(),
        steps,
        "every emitted token has its step"
    );
}

/// `--layer-profile`: one `[phase layer N/L]` line per layer of every forward pass (the
/// prefill, then each decode step), in layer order, the pass's rows and each layer's kinds,
/// and the same text as without it.
#[test]
fn layer_profile_prints_every_layer_of_every_pass() {
    // No stored prefix state: the second run must prefill like the first.
    let args = [
        "run",
        "--max-new",
        "3",
        "--prompt",
        "Profile me",
        "--state-cache",
        "off",
    ];
    let plain = on_model(&args, &[]);
    let plain_text = exits(&plain, 0);
    let out = on_model(&[&args[..], &["--layer-profile"]].concat(), &[]);
    exits(&out, 0);
    assert_eq!(out.stdout, plain.stdout, "the profile changes no token");
    assert!(!plain_text.contains("[phase layer"));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("[phase layer "))
        .collect();
    let model = open_model(model_root(), &EngineOptions::default()).unwrap();
    let n = model.layers.len();
    // The prefill (one pass: the prompt is shorter than a chunk) and two decode steps (the
    // third token's logits come from the second).
    assert_eq!(lines.len(), 3 * n, "{err}");
    let prompt_rows = Tokenizer::from_dir(model_root())
        .unwrap()
        .encode_ordinary("Profile me")
        .len();
    for (i, line) in lines.iter().enumerate() {
        let (pass, l) = (i / n + 1, i % n);
        let rows = if pass == 1 { prompt_rows } else { 1 };
        assert!(
            line.starts_with(&format!(
                "[phase layer {l}/{}] pass={pass} rows={rows} ",
                n - 1
            )),
            "{line}"
        );
        for field in [
            "total_ms=",
            "weights_ms=",
            "mix_ms=",
            "attention_ms=",
            "ffn_ms=",
        ] {
            assert!(line.contains(field), "{line}");
        }
        let attn = if model.dims.attn_kind(l) == deltafin_k3::model::dims::AttnKind::Kda {
            "kda"
        } else {
            "mla"
        };
        assert!(line.contains(&format!(" {attn}+")), "{line}");
    }
}

/// The startup line names the routed experts' backend and the scale4 mode with whether the
/// sidecars are used.
#[test]
fn startup_line_names_the_expert_backend_and_scale4() {
    let out = on_model(&["run", "--max-new", "1"], &[("K3_EXPERT_SCALE4", "off")]);
    let t = exits(&out, 0);
    assert!(
        t.contains("expert_backend=cpu scale4=off(raw scales)"),
        "{t}"
    );
    let out = on_model(&["run", "--max-new", "1"], &[]);
    let t = exits(&out, 0);
    assert!(
        t.contains("expert_backend=cpu scale4=auto(raw scales)"),
        "{t}"
    );
}

/// Variables of the original deltafin are never ignored silently: the ones without a
/// counterpart (the K3_METAL_SRC tripwire among them) stop every command but doctor, which
/// reports them; the legacy guards accept only exact K3; K3_DEV and K3_MOE are checked when a
/// flag wins over them.
#[test]
fn the_originals_variables_are_refused_or_guarded() {
    for (var, value) in [
        ("K3_METAL_SRC", ""),
        ("K3_METAL_SRC", "/tmp/moe.metal"),
        ("K3_SPINE_FDCACHE", "auto"),
        ("K3_SPINE_RESIDENT_GB", "2"),
        ("K3_MEMORY_PATIENCE_SECONDS", "105"),
        ("K3_HF_HOST", "mirror.example"),
    ] {
        for cmd in [&["run", "--max-new", "1"][..], &["serve"], &["benchmark"]] {
            let out = on_model(cmd, &[(var, value)]);
            let err = fails_with(&out, var);
            assert!(err.contains("not supported"), "{cmd:?} {var}: {err}");
        }
    }
    let out = deltafin(&["doctor", "--runtime-only"], &[("K3_METAL_SRC", "x")]);
    let t = exits(&out, 1);
    assert!(
        t.contains("[FAIL] environment") && t.contains("K3_METAL_SRC"),
        "{t}"
    );
    let out = deltafin(&["benchmark", "--arm", "a=K3_METAL_SRC=x"], &[]);
    fails_with(&out, "K3_METAL_SRC");

    // tiny: 4 routed experts per token.
    for (var, value, needle) in [
        ("K3_APPROX", "1", "approximate"),
        ("K3_APPROX", "fp16", "approximate"),
        ("K3_DTYPE", "fp16", "f32"),
        ("K3_MOE_TOP_K", "2", "routed experts"),
        ("K3_MOE_TOP_K", "16", "routed experts"),
        ("K3_MOE_TOP_K", "x", "routed experts"),
        ("K3_DEV", "bogus", "K3_DEV"),
        ("K3_MOE", "bogus", "K3_MOE"),
    ] {
        let args = [
            "run",
            "--max-new",
            "1",
            "--device",
            "cpu",
            "--expert-backend",
            "cpu",
        ];
        let err = fails_with(&on_model(&args, &[(var, value)]), var);
        assert!(
            err.contains(needle) && err.contains(value),
            "{var}={value}: {err}"
        );
    }
    let exact = [
        ("K3_APPROX", "off"),
        ("K3_DTYPE", "float32"),
        ("K3_MOE_TOP_K", "4"),
    ];
    exits(&on_model(&["run", "--max-new", "1"], &exact), 0);
}

/// `--help` ends with the environment section: every variable, the refused ones and the
/// legacy guards; `-h` points at it.
#[test]
fn help_lists_the_environment_variables() {
    for args in [&["--help"][..], &["run", "--help"], &["serve", "--help"]] {
        let out = deltafin(args, &[]);
        let t = exits(&out, 0);
        for needle in [
            "Environment (",
            "K3_SPINE_READ_THREADS",
            "K3_MXFP4_DISABLE_AVX2",
            "DELTAFIN_HUGE_PAGES",
            "Refused",
            "K3_METAL_SRC",
            "Legacy guards",
            "K3_MOE_TOP_K",
        ] {
            assert!(t.contains(needle), "{args:?}: {needle}");
        }
        assert!(!t.contains("greedily: every emitted token"), "{t}");
    }
    let t = exits(&deltafin(&["-h"], &[]), 0);
    assert!(
        t.contains("`deltafin --help` also lists the environment variables"),
        "{t}"
    );
}
