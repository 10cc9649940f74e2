//! Faults injected into the `deltafin` process and the files it reads and writes, each
//! reproduced here as the fault table of docs/OPERATIONS.md lists it: bytes flipped in a
//! copy of an install (an infinite norm weight, a NaN expert scale, a damaged scale4
//! record, a renamed chat marker), a file-size limit standing for a full disk (`ulimit -f`:
//! writes past it take part of a record and then fail, as on ENOSPC), a torn line left by a
//! crash, a process killed between writing a state and renaming it, a second converter, a
//! signal, and roots spelled several ways.

mod common;

use common::{
    BF16_INF, assert_says, checkpoint, checkpoint_in, damage_scale4, exits, fails_with, jsonl,
    poke_tensor, rename_open_marker, stdout_stderr, text,
};
use deltafin_k3::synth::SynthDims;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The settings a test gets only when it asks for them.
const SETTINGS: [&str; 13] = [
    "DELTAFIN_ROOT",
    "K3_SPINE",
    "K3_MEMORY_BUDGET_GB",
    "K3_EXPERT_SCALE4",
    "K3_TRACE",
    "K3_TRACE_PATH",
    "K3_STATE_CACHE",
    "K3_STATE_CACHE_DISK_GB",
    "K3_EXPERT_HEAT",
    "K3_DSPARK",
    "K3_UAG_DRAFT",
    "K3_REASONING_EFFORT",
    "K3_SERVER_QUEUE",
];

/// `deltafin args` with the weight-exact bf16 spine (no conversion needed) before `env`.
fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(args);
    for k in SETTINGS {
        cmd.env_remove(k);
    }
    cmd.env("K3_SPINE", "bf16");
    cmd.envs(env.iter().copied());
    cmd
}

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    command(args, env).output().unwrap()
}

/// `deltafin args` under `sh` with a file-size limit of `blocks` (`ulimit -f`) and SIGXFSZ
/// ignored: a write past the limit writes what fits and then fails (EFBIG), as a write to
/// a full disk does (ENOSPC).
fn deltafin_with_file_limit(blocks: u32, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg(format!(
            r#"trap "" XFSZ; ulimit -f {blocks}; exec "$0" "$@""#
        ))
        .arg(env!("CARGO_BIN_EXE_deltafin"))
        .args(args);
    for k in SETTINGS {
        sh.env_remove(k);
    }
    sh.env("K3_SPINE", "bf16");
    sh.envs(env.iter().copied());
    sh.output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run_args<'a>(root: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "run",
        "--model-root",
        root,
        "--prompt",
        "The capital of France is",
        "--max-new",
        "6",
    ];
    a.extend(extra);
    a
}

/// The generated ids of a run's events file.
fn emitted(events: &Path) -> Vec<Value> {
    jsonl(events)
        .into_iter()
        .filter(|e| e["event"] == "decode_step")
        .map(|e| e["token_id"].clone())
        .collect()
}

#[test]
fn an_infinite_weight_stops_run_and_benchmark_naming_the_layer_and_doctor_finds_it() {
    let d = checkpoint(SynthDims::tiny(), 31);
    let root = s(d.path());
    let ev = d.path().join("ev.jsonl");
    let healthy = deltafin(&["doctor", "--model-root", root], &[]);
    let t = exits(&healthy, 0);
    assert_says(&t, &["[ ok ] forward canary", "[ ok ] expert scales"]);
    // The issue's reproduction: layer 0's input norm weight becomes +inf.
    poke_tensor(
        d.path(),
        "language_model.model.layers.0.input_layernorm.weight",
        0,
        &BF16_INF,
    );
    let o = deltafin(&run_args(root, &["--events-jsonl", s(&ev)]), &[]);
    let (out, err) = stdout_stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert_says(
        &err,
        &[
            "numerical failure",
            "non-finite value (NaN or infinity) first appeared in layer 0's attention output",
        ],
    );
    assert!(out.is_empty(), "no token is printed: {out:?}");
    let events = jsonl(&ev);
    assert!(
        events.iter().all(|e| e["status"] != "ok"),
        "no event says ok: {events:?}"
    );
    // The doctor's canary runs the weights run and serve load.
    let o = deltafin(&["doctor", "--model-root", root], &[]);
    let t = exits(&o, 1);
    assert_says(
        &t,
        &[
            "[FAIL] forward canary",
            "layer 0's attention output",
            "fix: a weight file is damaged",
        ],
    );
    // A benchmark run on it is invalid, with the reason.
    let evd = d.path().join("bench");
    let o = deltafin(
        &[
            "benchmark",
            "--model-root",
            root,
            "--max-new",
            "2",
            "--reps",
            "1",
            "--output-dir",
            s(&evd),
        ],
        &[],
    );
    exits(&o, 1);
    let runs = jsonl(&evd.join("runs.jsonl"));
    assert_eq!(runs[0]["valid"], false);
    let why = runs[0]["invalid_reason"].as_str().unwrap();
    assert!(why.contains("numerical failure"), "{why}");
}

#[test]
fn appends_start_on_a_fresh_line_and_a_full_disk_leaves_only_whole_records() {
    let d = checkpoint(SynthDims::tiny(), 32);
    let root = s(d.path());
    // The documented trace path on a root without k3-meta/.
    assert!(!d.path().join("k3-meta").exists());
    let trace = d.path().join("k3-meta/routes.jsonl");
    let quiet = [("K3_EXPERT_HEAT", "off"), ("K3_STATE_CACHE", "off")];
    let o = deltafin(
        &run_args(root, &["--router-trace", "k3-meta/routes.jsonl"]),
        &quiet,
    );
    exits(&o, 0);
    let first = std::fs::read_to_string(&trace).unwrap().lines().count();
    assert!(first > 0);
    // A crash left a torn line; the next run appends on a fresh line, and the ranking skips
    // and counts the torn one.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&trace)
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"step\": 9, \"layer\": 1, \"ids\": [3,").unwrap();
    drop(f);
    let o = deltafin(
        &run_args(root, &["--router-trace", "k3-meta/routes.jsonl"]),
        &quiet,
    );
    exits(&o, 0);
    let text_now = std::fs::read_to_string(&trace).unwrap();
    let bad: Vec<&str> = text_now
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).is_err())
        .collect();
    assert_eq!(bad, ["{\"step\": 9, \"layer\": 1, \"ids\": [3,"]);
    assert_eq!(text_now.lines().count(), 2 * first + 1);
    let o = deltafin(&["warm-expert-cache", "--model-root", root], &[]);
    let t = exits(&o, 0);
    assert_says(
        &t,
        &["1 torn line skipped", &format!("{} lines", 2 * first)],
    );

    // A full disk mid-trace (sync mode writes every line): one warning, the run goes on,
    // and the file holds only whole lines.
    let full = d.path().join("full.jsonl");
    let o = deltafin_with_file_limit(
        4,
        &run_args(
            root,
            &["--router-trace", s(&full), "--router-trace-mode", "sync"],
        ),
        &quiet,
    );
    let (_, err) = stdout_stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.matches("warning: router trace").count(), 1, "{err}");
    assert_says(&err, &["no more lines are written"]);
    let kept = std::fs::read_to_string(&full).unwrap();
    assert!(!kept.is_empty() && kept.ends_with('\n'), "{kept:?}");
    for l in kept.lines() {
        serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
    }

    // The events file on a full disk: the run stops with an error naming the file, which
    // keeps its whole events; each cause is said once.
    let events = d.path().join("events.jsonl");
    let o = deltafin_with_file_limit(
        4,
        &run_args(root, &["--events-jsonl", s(&events), "--top-logits", "20"]),
        &quiet,
    );
    let err = fails_with(&o, "cannot write the events file");
    assert_says(&err, &[s(&events)]);
    let kept = std::fs::read_to_string(&events).unwrap();
    assert!(kept.ends_with('\n'), "{kept:?}");
    for l in kept.lines() {
        serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
    }
    let o = deltafin(
        &run_args(root, &["--events-jsonl", "/nonexistent-dir/e.jsonl"]),
        &quiet,
    );
    let err = fails_with(&o, "/nonexistent-dir/e.jsonl");
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_full_disk_under_the_heat_and_state_files_leaves_no_temporary() {
    let d = checkpoint(SynthDims::tiny(), 43);
    let root = s(d.path());
    let prompt = "a prompt long enough to fill one chunk of the prefill ".repeat(12);
    // 512 bytes (one block of `sh`'s `ulimit -f`): the heat histogram and every prefix
    // state are larger.
    let o = deltafin_with_file_limit(
        1,
        &[
            "run",
            "--model-root",
            root,
            "--prompt",
            &prompt,
            "--max-new",
            "2",
        ],
        &[],
    );
    let (_, err) = stdout_stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_says(&err, &["expert heat", "state cache: cannot write"]);
    let left: Vec<PathBuf> = files_under(&d.path().join("k3-meta"))
        .into_iter()
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with(".tmp-") || n.ends_with(".tmp")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A copy of `root`'s checkpoint after `convert-experts-scale4`.
fn with_scale4(seed: u64) -> tempfile::TempDir {
    let d = checkpoint(SynthDims::tiny(), seed);
    let o = deltafin(
        &["convert-experts-scale4", "--model-root", s(d.path())],
        &[],
    );
    exits(&o, 0);
    d
}

/// The converters that write whole files through a `.part` on a disk that fills up: the
/// error names the file, no partial file stays to hold the space, and a rerun with room
/// finishes.
#[test]
fn converters_on_a_full_disk_leave_no_partial_file() {
    let d = checkpoint(SynthDims::tiny(), 44);
    let root = s(d.path());
    let parts = || -> Vec<PathBuf> {
        files_under(d.path())
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".part"))
            .collect()
    };
    for args in [
        &["pack-spine", "--model-root", root, "--spine", "bf16"][..],
        &["convert-experts-scale4", "--model-root", root],
    ] {
        let o = deltafin_with_file_limit(8, args, &[]);
        let err = fails_with(&o, ".part");
        assert!(
            err.contains("File too large") || err.contains("No space left"),
            "{err}"
        );
        assert!(parts().is_empty(), "{args:?}: {:?}", parts());
        exits(&deltafin(args, &[]), 0);
    }
}

#[test]
fn doctor_finds_what_run_and_serve_would_trip_on() {
    // A damaged scale4 record: run (auto) uses the raw scales, with the same tokens and a
    // warning; doctor warns; under `require` both refuse.
    let d = with_scale4(33);
    let root = s(d.path());
    let ev = |n: &str| d.path().join(n);
    let o = deltafin(
        &run_args(root, &["--events-jsonl", s(&ev("off.jsonl"))]),
        &[("K3_EXPERT_SCALE4", "off")],
    );
    exits(&o, 0);
    let sc4 = damage_scale4(d.path(), 1, SynthDims::tiny().experts);
    let o = deltafin(
        &run_args(root, &["--events-jsonl", s(&ev("auto.jsonl"))]),
        &[],
    );
    let t = exits(&o, 0);
    assert_says(&t, &["warning: scale4 sidecar", "uses its raw scales"]);
    assert_eq!(emitted(&ev("auto.jsonl")), emitted(&ev("off.jsonl")));
    let t = exits(&deltafin(&["doctor", "--model-root", root], &[]), 0);
    assert_says(
        &t,
        &[
            "[warn] scale4",
            &sc4.display().to_string(),
            "convert-experts-scale4",
        ],
    );
    let t = exits(
        &deltafin(
            &["doctor", "--model-root", root],
            &[("K3_EXPERT_SCALE4", "require")],
        ),
        1,
    );
    assert_says(&t, &["[FAIL] scale4", "rewrites the damaged layer"]);
    fails_with(
        &deltafin(&run_args(root, &[]), &[("K3_EXPERT_SCALE4", "require")]),
        "scale4 sidecar",
    );

    // An E8M0 scale byte 0xFF (NaN) in a shard.
    let d = checkpoint(SynthDims::tiny(), 34);
    let root = s(d.path());
    poke_tensor(
        d.path(),
        "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale",
        3,
        &[0xff],
    );
    let t = exits(&deltafin(&["doctor", "--model-root", root], &[]), 1);
    assert_says(
        &t,
        &[
            "[FAIL] expert scales",
            "expert 5 of layer 2: E8M0 scale byte 0xFF (NaN) in w2",
            "fetch-weights",
        ],
    );

    // A renamed chat marker in tokenizer_config.json: chat refuses naming the file.
    let d = checkpoint(SynthDims::tiny(), 35);
    let root = s(d.path());
    rename_open_marker(d.path());
    let t = exits(&deltafin(&["doctor", "--model-root", root], &[]), 1);
    assert_says(
        &t,
        &[
            "[FAIL] tokenizer",
            "tokenizer_config.json has no special token <|open|>",
            "setup-k3 --meta-only",
        ],
    );
    let err = fails_with(
        &deltafin(&run_args(root, &["--chat"]), &[]),
        "tokenizer_config.json has no special token <|open|>",
    );
    assert!(!err.contains("None"), "{err}");
}

/// A process that ran and is gone (killed, then reaped).
fn dead_pid() -> u32 {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    pid
}

#[test]
fn a_killed_writers_state_temporary_is_swept_by_the_next_run() {
    let d = checkpoint(SynthDims::tiny(), 36);
    let root = s(d.path());
    let dir = d.path().join("k3-meta/state-cache");
    std::fs::create_dir_all(&dir).unwrap();
    // What `run` killed between writing a state and renaming it leaves.
    let orphan = dir.join(format!(".tmp-0011223344556677-{}-0", dead_pid()));
    std::fs::write(&orphan, vec![0u8; 1 << 20]).unwrap();
    exits(&deltafin(&run_args(root, &[]), &[]), 0);
    assert!(!orphan.exists(), "the temporary of a dead writer stays");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn the_state_cache_is_keyed_by_the_model_not_by_how_its_root_is_spelled() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("k3");
    checkpoint_in(&root, SynthDims::tiny(), 37);
    let prompt = "a prompt long enough to fill one chunk of the prefill ".repeat(12);
    let run_in = |cwd: &Path, spelled: &str| {
        let o = command(
            &[
                "run",
                "--model-root",
                spelled,
                "--prompt",
                &prompt,
                "--max-new",
                "2",
            ],
            &[],
        )
        .current_dir(cwd)
        .output()
        .unwrap();
        exits(&o, 0)
    };
    let t = run_in(d.path(), s(&root));
    assert!(!t.contains("restored from the state cache"), "{t}");
    let sub = d.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for spelled in ["k3", "./k3", "../k3/"] {
        let cwd = if spelled.starts_with("..") {
            sub.clone()
        } else {
            d.path().to_path_buf()
        };
        let t = run_in(&cwd, spelled);
        assert_says(&t, &["restored from the state cache"]);
    }
    // Moved elsewhere: the same model, the same states.
    let moved = d.path().join("moved");
    std::fs::rename(&root, &moved).unwrap();
    let t = run_in(d.path(), s(&moved));
    assert_says(&t, &["restored from the state cache"]);
}

#[test]
fn a_second_scale4_converter_gets_the_lock_error() {
    let d = checkpoint(SynthDims::tiny(), 38);
    let out = d.path().join("k3-experts-scale4");
    std::fs::create_dir_all(&out).unwrap();
    // Another converter holds the directory.
    let held = deltafin_k3::weights::filelock::try_lock(&out.join(".convert.lock"))
        .unwrap()
        .unwrap();
    let o = deltafin(
        &["convert-experts-scale4", "--model-root", s(d.path())],
        &[],
    );
    let err = fails_with(&o, "is held by another convert-experts-scale4");
    assert!(!err.contains(".part"), "{err}");
    drop(held);
    exits(
        &deltafin(
            &["convert-experts-scale4", "--model-root", s(d.path())],
            &[],
        ),
        0,
    );
}

#[test]
fn experts_missing_from_a_partial_k3_experts_come_from_the_shards() {
    let d = checkpoint(SynthDims::tiny(), 39);
    let root = s(d.path());
    let budget = ["--memory-budget-gb", "0.25"];
    let want = d.path().join("want.jsonl");
    exits(
        &deltafin(
            &run_args(root, &[&budget[..], &["--events-jsonl", s(&want)]].concat()),
            &[],
        ),
        0,
    );
    // `warm-expert-cache --fetch` made two experts local from the shards; a first try on
    // a full disk failed naming the file and left no temporary.
    let experts = d.path().join("k3-experts");
    std::fs::create_dir_all(&experts).unwrap();
    let o = deltafin_with_file_limit(
        1,
        &["warm-expert-cache", "--model-root", root, "--fetch", "2"],
        &[],
    );
    fails_with(&o, "cannot write");
    assert!(
        files_under(&experts).is_empty(),
        "{:?}",
        files_under(&experts)
    );
    exits(
        &deltafin(
            &["warm-expert-cache", "--model-root", root, "--fetch", "2"],
            &[],
        ),
        0,
    );
    let files = std::fs::read_dir(d.path().join("k3-experts"))
        .unwrap()
        .count();
    assert!((1..=2).contains(&files), "{files} expert files");
    let got = d.path().join("got.jsonl");
    exits(
        &deltafin(
            &run_args(root, &[&budget[..], &["--events-jsonl", s(&got)]].concat()),
            &[],
        ),
        0,
    );
    assert_eq!(emitted(&got), emitted(&want));
    exits(
        &deltafin(
            &["doctor", "--model-root", root, "--memory-budget-gb", "0.25"],
            &[],
        ),
        0,
    );
}

#[test]
fn doctor_says_a_read_only_root_keeps_states_and_heat_in_memory() {
    let d = checkpoint(SynthDims::tiny(), 40);
    let meta = d.path().join("k3-meta");
    std::fs::create_dir_all(&meta).unwrap();
    let mut cmd = command(&["doctor", "--model-root", s(d.path())], &[]);
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // Root writes anywhere: run the doctor as nobody, over a root it can read.
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        cmd.uid(65534).gid(65534);
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&meta, std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    let o = cmd.output().unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert_says(
        &t,
        &[
            "[warn] model root writable",
            "keep prefix states and the expert heat in memory only",
        ],
    );
}
