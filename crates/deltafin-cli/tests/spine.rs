//! The spine formats of the `deltafin` binary: `--spine` / `K3_SPINE` (default auto = int8),
//! `convert-spine-int8` (conversion, resume after a kill, lock, `--check`), and runs on the
//! int8 spine matching the library's int8 model exactly.

mod common;

use common::{ids, jsonl, library_greedy, stdout_stderr};

use deltafin_k3::synth::SynthDims;
use deltafin_k3::weights::spine_int8::{SpineFormat, tensor_dir};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const PROMPT: &str = "The capital of France is";

/// A fresh tiny checkpoint (the real vocabulary, so that `run` can load the tokenizer).
fn checkpoint(seed: u64) -> tempfile::TempDir {
    common::checkpoint(SynthDims::tiny(), seed)
}

/// A fresh checkpoint with a 1,024-token vocabulary: a short conversion (no `run`).
fn small_checkpoint(seed: u64) -> tempfile::TempDir {
    let dims = SynthDims {
        vocab: 1024,
        ..SynthDims::tiny()
    };
    common::checkpoint(dims, seed)
}

/// Few durable checkpoints: the real-vocabulary lm_head has 163,840 rows.
const FAST: &[&str] = &["--checkpoint-rows", "65536"];

fn deltafin(args: &[&str], root: &Path, env: &[(&str, &str)]) -> Output {
    let root = root.to_str().unwrap();
    let args = [args, &["--model-root", root]].concat();
    let unset = ["K3_SPINE", "K3_REASONING_EFFORT", "K3_MEMORY_BUDGET_GB"];
    common::deltafin(&args, &unset, env)
}

fn convert(root: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["convert-spine-int8"];
    args.extend_from_slice(extra);
    let o = deltafin(&args, root, &[]);
    assert!(o.status.success(), "{:?}", stdout_stderr(&o));
    o
}

/// The library's greedy completion (4 tokens) on `spine`.
fn library_ids(root: &Path, spine: SpineFormat) -> Vec<u32> {
    library_greedy(root, spine, PROMPT, 4)
}

/// The ids a run emitted, from its events file.
fn emitted(events: &Path) -> Vec<u32> {
    ids(&jsonl(events).last().unwrap()["emitted_token_ids"])
}

/// Every file of the int8 spine by name, with its bytes.
fn snapshot(root: &Path) -> BTreeMap<OsString, Vec<u8>> {
    let read = |e: std::fs::DirEntry| (e.file_name(), std::fs::read(e.path()).unwrap());
    let dir = std::fs::read_dir(tensor_dir(root)).unwrap();
    dir.map(|e| read(e.unwrap())).collect()
}

#[test]
fn auto_without_the_int8_spine_fails_and_bad_choices_are_rejected() {
    let d = checkpoint(1);
    let root = d.path();
    for args in [
        vec!["run", "--max-new", "1"],
        vec!["run", "--max-new", "1", "--spine", "int8"],
    ] {
        let o = deltafin(&args, root, &[]);
        let (_, err) = stdout_stderr(&o);
        assert!(!o.status.success());
        assert!(
            err.contains("deltafin convert-spine-int8") && err.contains("--spine bf16"),
            "{err}"
        );
    }
    let o = deltafin(&["run", "--max-new", "1"], root, &[("K3_SPINE", "auto")]);
    assert!(stdout_stderr(&o).1.contains("convert-spine-int8"));
    let o = deltafin(&["serve", "--port", "0"], root, &[]);
    assert!(!o.status.success());
    assert!(
        stdout_stderr(&o).1.contains("convert-spine-int8"),
        "{:?}",
        stdout_stderr(&o)
    );

    let o = deltafin(&["run", "--spine", "mixed"], root, &[]);
    let err = stdout_stderr(&o).1;
    assert!(!o.status.success());
    assert!(
        err.contains("--spine") && err.contains("research codecs change target weights"),
        "{err}"
    );
    for bad in ["mixed", "fp8", ""] {
        let o = deltafin(&["run", "--max-new", "1"], root, &[("K3_SPINE", bad)]);
        let err = stdout_stderr(&o).1;
        assert!(!o.status.success());
        assert!(err.contains("environment variable K3_SPINE"), "{err}");
    }
    // bf16 needs no conversion; the flag wins over the environment.
    let o = deltafin(
        &["run", "--max-new", "1", "--spine", "bf16"],
        root,
        &[("K3_SPINE", "int8")],
    );
    assert!(o.status.success(), "{:?}", stdout_stderr(&o));
    assert!(stdout_stderr(&o).1.contains("spine=bf16"));
    let o = deltafin(&["run", "--max-new", "1"], root, &[("K3_SPINE", "bf16")]);
    assert!(o.status.success(), "{:?}", stdout_stderr(&o));
}

#[test]
fn int8_runs_match_the_library_int8_model_and_bf16_stays_exact() {
    let d = checkpoint(2);
    let root = d.path();
    let o = convert(root, FAST);
    let (out, err) = stdout_stderr(&o);
    assert!(err.contains("QUANTIZED and NOT weight-exact"), "{err}");
    assert!(out.contains("weight error (relative RMS"), "{out}");
    assert!(
        out.contains("lm_head.weight") || out.contains("proj.weight"),
        "{out}"
    );
    assert!(out.contains("converted"), "{out}");

    let ev = tempfile::tempdir().unwrap();
    let events = ev.path().join("events.jsonl");
    let ev_arg = events.display().to_string();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--prompt",
            PROMPT,
            "--max-new",
            "4",
            "--events-jsonl",
            &ev_arg,
        ];
        args.extend_from_slice(extra);
        let o = deltafin(&args, root, &[]);
        assert!(o.status.success(), "{:?}", stdout_stderr(&o));
        (stdout_stderr(&o).1, emitted(&events))
    };
    let (int8_err, int8_ids) = run(&[]);
    assert!(int8_err.contains("spine=int8"), "{int8_err}");
    assert_eq!(int8_ids, library_ids(root, SpineFormat::Int8));
    assert_eq!(run(&["--spine", "int8"]).1, int8_ids);
    let (bf16_err, bf16_ids) = run(&["--spine", "bf16"]);
    assert!(bf16_err.contains("spine=bf16"));
    assert_eq!(bf16_ids, library_ids(root, SpineFormat::Bf16));

    // Under a memory budget the int8 spine is used as well.
    assert_eq!(run(&["--memory-budget-gb", "1"]).1, int8_ids);

    // A second conversion finds everything complete; --check verifies every hash.
    let (out, _) = stdout_stderr(&convert(root, FAST));
    assert!(out.contains("converted 0 of"), "{out}");
    let (out, _) = stdout_stderr(&convert(root, &["--check"]));
    assert!(out.contains("int8 spine OK"), "{out}");

    // Damage: a changed code byte is found by --check, a truncated scale file by loading.
    let name = "language_model.model.layers.3.block_sparse_moe.shared_experts.down_proj.weight";
    let i8_path = tensor_dir(root).join(format!("{name}.i8"));
    let mut codes = std::fs::read(&i8_path).unwrap();
    codes[0] = codes[0].wrapping_add(1) & 0x7f;
    std::fs::write(&i8_path, &codes).unwrap();
    let o = deltafin(&["convert-spine-int8", "--check"], root, &[]);
    let err = stdout_stderr(&o).1;
    assert!(!o.status.success());
    assert!(
        err.contains(name) && err.contains(".i8") && err.contains("sha256"),
        "{err}"
    );
    let sc_path = tensor_dir(root).join(format!("{name}.sc"));
    let sc = std::fs::read(&sc_path).unwrap();
    std::fs::write(&sc_path, &sc[..sc.len() - 2]).unwrap();
    let o = deltafin(&["run", "--max-new", "1"], root, &[]);
    let err = stdout_stderr(&o).1;
    assert!(!o.status.success());
    assert!(err.contains(name) && err.contains(".sc"), "{err}");
    // --no-resume rebuilds it.
    convert(root, &["--no-resume", "--checkpoint-rows", "65536"]);
    convert(root, &["--check"]);
}

#[test]
fn a_killed_conversion_resumes_byte_identical_and_a_second_converter_is_locked_out() {
    let (da, db) = (small_checkpoint(4), small_checkpoint(4));
    convert(da.path(), &[]);
    let want = snapshot(da.path());

    // One durable checkpoint per row keeps the converter busy long enough to kill it.
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "convert-spine-int8",
            "--checkpoint-rows",
            "1",
            "--model-root",
        ])
        .arg(db.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let dir = tensor_dir(db.path());
    let has = |suffix: &str| {
        std::fs::read_dir(&dir).is_ok_and(|rd| {
            rd.filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().ends_with(suffix))
        })
    };
    while !(has(".row-i8.json") && has(".progress.json")) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the converter finished before it could be interrupted"
        );
        assert!(t.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    // While it runs, a second converter gets a clear error.
    let o = deltafin(&["convert-spine-int8"], db.path(), &[]);
    let err = stdout_stderr(&o).1;
    assert!(!o.status.success());
    assert!(err.contains("held by another convert-spine-int8"), "{err}");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(has(".part"), "no partial file was left by the kill");

    let (out, _) = stdout_stderr(&convert(db.path(), &[]));
    assert!(out.contains("1 resumed"), "{out}");
    assert_eq!(snapshot(db.path()), want);
}
