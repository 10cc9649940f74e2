//! `deltafin doctor` on a good synthesized install and on broken copies of it: it reports
//! what `run` and `serve` would load with the same flags, and fails where they would refuse.

mod common;

use common::text;

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The settings a test gets only when it asks for them.
const SETTINGS: [&str; 6] = [
    "DELTAFIN_ROOT",
    "K3_SPINE",
    "K3_MEMORY_BUDGET_GB",
    "K3_EXPERT_SCALE4",
    "K3_DEV",
    "K3_MOE",
];

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(args);
    for k in SETTINGS {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// One tiny checkpoint with its row-int8 spine converted (what `setup` leaves), shared by
/// every test of this file; broken cases work on copies.
fn good_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 5)).unwrap();
        deltafin_k3::synth::remove_at_exit(d.path());
        let root = d.path().to_str().unwrap();
        let o = deltafin(&["convert-spine-int8", "--model-root", root], &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        d
    })
    .path()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn copy_install() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    copy_dir(good_root(), d.path());
    d
}

fn doctor(args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin(&[&["doctor"][..], args].concat(), env)
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
        t.contains("[FAIL] model root: model root /no/such/install does not exist"),
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

    for flags in [
        &["--model-root", "/x"][..],
        &["--spine", "bf16"],
        &["--memory-budget-gb", "8"],
    ] {
        let out = doctor(&[&["--runtime-only"][..], flags].concat(), &[]);
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        assert!(text(&out).contains("cannot be used with"), "{flags:?}");
    }
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

/// `run` on `root` with `args`, on the shared settings of this file.
fn run(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let root = root.to_str().unwrap();
    let base = [
        "run",
        "--model-root",
        root,
        "--max-new",
        "1",
        "--prompt",
        "Hi",
    ];
    deltafin(&[&base[..], args].concat(), env)
}

#[test]
fn a_default_int8_spine_that_is_not_converted_fails_as_run_refuses() {
    let d = copy_install();
    std::fs::remove_dir_all(d.path().join("k3-resident-int8")).unwrap();
    let root = d.path().to_str().unwrap();
    let out = doctor(&["--model-root", root], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("[FAIL] spine: the default --spine auto loads the row-int8 spine, but it is not converted"),
        "{t}"
    );
    assert!(t.contains("run and serve would refuse to start"), "{t}");
    assert!(
        t.contains(&format!(
            "fix: convert it once with `deltafin convert-spine-int8 --model-root {root}`"
        )),
        "{t}"
    );
    assert!(t.contains("--spine bf16"), "{t}");
    assert!(t.contains("doctor: 1 problem found"), "{t}");
    assert!(!t.contains("doctor: healthy"), "{t}");
    // `run` and `serve` do refuse.
    let r = run(d.path(), &[], &[]);
    assert_eq!(r.status.code(), Some(1));
    assert!(text(&r).contains("not converted"), "{}", text(&r));
    // The BF16 spine needs no conversion: healthy, from the flag or the variable.
    for (args, env, origin) in [
        (&["--spine", "bf16"][..], &[][..], "--spine bf16"),
        (&[], &[("K3_SPINE", "bf16")], "K3_SPINE=bf16"),
    ] {
        let out = doctor(&[&["--model-root", root, "--json"][..], args].concat(), env);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let spine = check(&json(&out), "spine").clone();
        assert_eq!(spine["status"], "ok", "{spine}");
        let detail = spine["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("{origin}: the original BF16 weights")),
            "{detail}"
        );
    }
}

#[test]
fn a_converted_int8_spine_is_the_one_run_and_serve_load() {
    let root = good_root().to_str().unwrap();
    let out = doctor(&["--model-root", root], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains(
            "[ ok ] spine: the default --spine auto: the row-int8 spine in k3-resident-int8/ ("
        ),
        "{t}"
    );
    assert!(t.contains("which run and serve load"), "{t}");
    assert!(!t.contains("not used by this build"), "{t}");
    // And `run` does load it: its events file says so.
    let tmp = tempfile::tempdir().unwrap();
    let events = tmp.path().join("events.jsonl");
    let r = run(
        good_root(),
        &["--events-jsonl", events.to_str().unwrap()],
        &[],
    );
    assert_eq!(r.status.code(), Some(0), "{}", text(&r));
    assert_eq!(common::jsonl(&events)[0]["config"]["spine"], "int8");
    // Asked for the BF16 spine, the int8 files are present but unused.
    let out = doctor(&["--model-root", root, "--spine", "bf16"], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains("[info] int8 spine: k3-resident-int8/ present but not used: --spine bf16 loads the BF16 weights"),
        "{t}"
    );
    // Packs that are not complete are not loaded, and the doctor says so.
    let d = copy_install();
    std::fs::create_dir(d.path().join("k3-resident-packs")).unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap()], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains("[info] spine packs: k3-resident-packs/ incomplete: not used"),
        "{t}"
    );
    assert!(t.contains("the row-int8 spine in k3-resident-int8/"), "{t}");
    // An incomplete conversion fails the doctor as it fails `run`.
    let d = copy_install();
    let tensors = d.path().join("k3-resident-int8/tensors");
    let receipt = std::fs::read_dir(&tensors)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".row-i8.json"))
        .unwrap();
    std::fs::remove_file(&receipt).unwrap();
    let out = doctor(&["--model-root", d.path().to_str().unwrap(), "--json"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let spine = check(&json(&out), "spine").clone();
    assert_eq!(spine["status"], "fail", "{spine}");
    let name = receipt.file_name().unwrap().to_string_lossy().to_string();
    assert!(spine["detail"].as_str().unwrap().contains(&name), "{spine}");
    assert!(
        spine["fix"]
            .as_str()
            .unwrap()
            .contains("convert-spine-int8"),
        "{spine}"
    );
    let r = run(d.path(), &[], &[]);
    assert_eq!(r.status.code(), Some(1));
    assert!(text(&r).contains(&name), "{}", text(&r));
}

/// The memory-plan line `serve` prints once its background load has planned (the server is
/// stopped then).
fn serve_plan_line(root: &str, args: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(["serve", "--port", "0", "--model-root", root])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for k in SETTINGS {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn().unwrap();
    let mut seen = Vec::new();
    let mut found = None;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("[deltafin] memory budget ") {
            found = Some(line);
            break;
        }
        seen.push(line);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    found.unwrap_or_else(|| panic!("serve printed no memory plan: {seen:?}"))
}

/// The token count of `run`'s memory-plan line: `… + state X GB (N tokens, 1 sequence) + …`.
fn planned_tokens(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("[deltafin] memory budget "))
        .unwrap_or_else(|| panic!("no memory plan line in {stderr}"));
    let (_, state) = line.split_once(" + state ").unwrap();
    let (_, tokens) = state.split_once(" GB (").unwrap();
    tokens.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn the_admitted_context_comes_from_the_memory_plan_run_uses() {
    let root = good_root().to_str().unwrap();
    // With a budget: the plan `run` prints, and the longest context it holds.
    let out = doctor(
        &["--model-root", root, "--memory-budget-gb", "0.2", "--json"],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v = json(&out);
    let plan = check(&v, "memory plan");
    assert_eq!(plan["status"], "ok", "{plan}");
    assert!(
        plan["detail"]
            .as_str()
            .unwrap()
            .starts_with("memory budget 0.200 GB = spine "),
        "{plan}"
    );
    let reserved = v["facts"]["reserved_context"].as_u64().unwrap();
    let admitted = v["admitted_context"].as_u64().unwrap();
    assert!(
        admitted >= reserved && reserved > 0,
        "{admitted} {reserved}"
    );
    assert_eq!(v["facts"]["memory_plan_budget_bytes"], 200_000_000);
    // `serve` plans for that reserve; `run --max-new 1 --prompt Hi` for 2 + 1 + 32 tokens.
    let serve = serve_plan_line(root, &["--memory-budget-gb", "0.2"]);
    assert_eq!(planned_tokens(&serve), reserved, "{serve}");
    let r = run(good_root(), &["--memory-budget-gb", "0.2"], &[]);
    assert_eq!(r.status.code(), Some(0), "{}", text(&r));
    let (_, stderr) = common::stdout_stderr(&r);
    assert_eq!(planned_tokens(&stderr), 35, "{stderr}");
    // The budget from the environment is the same budget.
    let out = doctor(
        &["--model-root", root, "--json"],
        &[("K3_MEMORY_BUDGET_GB", "0.2")],
    );
    assert_eq!(json(&out)["facts"]["reserved_context"], reserved);

    // A budget the plan cannot meet fails the doctor as it fails `run`.
    let out = doctor(&["--model-root", root, "--memory-budget-gb", "0.01"], &[]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("[FAIL] memory plan: run and serve would refuse to start: memory budget 0.010 GB is too small"),
        "{t}"
    );
    assert!(t.contains("fix: raise --memory-budget-gb"), "{t}");
    let r = run(good_root(), &["--memory-budget-gb", "0.01"], &[]);
    assert_eq!(r.status.code(), Some(1));
    assert!(
        text(&r).contains("memory budget 0.010 GB is too small"),
        "{}",
        text(&r)
    );

    // Without a budget: what the memory available admits under the same planner, never 0
    // for a model whose whole plan is a few megabytes.
    let out = doctor(&["--model-root", root, "--json"], &[]);
    let v = json(&out);
    let c = check(&v, "admitted context");
    let detail = c["detail"].as_str().unwrap();
    assert!(
        detail.contains("as the memory plan of `--memory-budget-gb "),
        "{c}"
    );
    assert_eq!(v["facts"]["memory_plan_budget_from"], "memory available");
    assert!(v["admitted_context"].as_u64().unwrap() > 0, "{c}");
}
