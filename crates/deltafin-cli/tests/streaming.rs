//! `deltafin run` / `perplexity` with `--memory-budget-gb`: experts stream from disk, the
//! tokens equal the resident run, the budget is parsed strictly, `--stats` reports the cache.

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Tiny with 64 experts of 52,224 B (F 256, Lr 128): 43 MB of experts.
fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let dims = SynthDims {
            experts: 64,
            moe_inter: 256,
            latent: 128,
            ..SynthDims::tiny()
        };
        synthesize(d.path(), &SynthSpec::new(dims, 3)).unwrap();
        d
    })
    .path()
}

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(args)
        .args(["--model-root", &model_root().display().to_string()])
        .env_remove("K3_MEMORY_BUDGET_GB")
        // Compared with the library's bf16 model (tests/spine.rs covers the int8 default).
        .env("K3_SPINE", "bf16")
        .env_remove("K3_PILOT_GATE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn budgeted_run_streams_and_matches_the_resident_run() {
    let base = [
        "run",
        "--prompt",
        "Expert streaming keeps",
        "--max-new",
        "10",
    ];
    let resident = deltafin(&base, &[]);
    assert!(resident.status.success(), "{:?}", text(&resident));
    let mut args = base.to_vec();
    args.extend(["--memory-budget-gb", "0.2"]);
    for gate in ["off", "measure", "on"] {
        let streamed = deltafin(&args, &[("K3_PILOT_GATE", gate)]);
        let (out, err) = text(&streamed);
        assert!(streamed.status.success(), "{err}");
        assert_eq!(
            out,
            text(&resident).0,
            "K3_PILOT_GATE={gate}: completion text"
        );
        assert!(err.contains("memory budget 0.200 GB = spine"), "{err}");
        assert!(err.contains("explicit reads, never the mmap"), "{err}");
    }
    let mut stats = args.clone();
    stats.push("--stats");
    let (out, err) = text(&deltafin(&stats, &[("K3_MEMORY_BUDGET_GB", "7")]));
    assert_eq!(out.lines().count(), 10, "{out}");
    assert!(out.lines().all(|l| l.starts_with("[stats] generated=")));
    for needle in [
        "[stats] experts hits=",
        "prefetch_recall=",
        "bytes_read=",
        "read_gbps=",
        "[stats] experts hit% by layer: 1:",
        "[stats] memory peak_rss=",
    ] {
        assert!(err.contains(needle), "missing {needle}: {err}");
    }
}

#[test]
fn perplexity_with_a_budget_equals_resident() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("t.txt");
    std::fs::write(
        &file,
        "Routed experts live on disk; the router picks a few per token.\n",
    )
    .unwrap();
    let f = file.display().to_string();
    let a = deltafin(&["perplexity", "--file", &f, "--json"], &[]);
    let b = deltafin(
        &["perplexity", "--file", &f, "--json"],
        &[("K3_MEMORY_BUDGET_GB", "0.2")],
    );
    assert!(a.status.success() && b.status.success(), "{:?}", text(&b));
    let pick = |o: &Output| {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (
            v["mean_nll"].as_f64().unwrap(),
            v["tokens_scored"].as_u64().unwrap(),
        )
    };
    assert_eq!(pick(&a), pick(&b));
}

#[test]
fn bad_budgets_and_knobs_are_clear_errors() {
    for (args, env, needle) in [
        (
            vec!["--memory-budget-gb", "lots"],
            vec![],
            "--memory-budget-gb: \"lots\" is not a number of GB",
        ),
        (
            vec!["--memory-budget-gb=-1"],
            vec![],
            "must be a positive number",
        ),
        (
            vec![],
            vec![("K3_MEMORY_BUDGET_GB", "0")],
            "environment variable K3_MEMORY_BUDGET_GB",
        ),
        (vec!["--memory-budget-gb", "0.001"], vec![], "is too small"),
        (
            vec!["--memory-budget-gb", "1"],
            vec![("K3_PILOT_GATE", "maybe")],
            "K3_PILOT_GATE: \"maybe\" is not off, measure or on",
        ),
        (
            vec!["--memory-budget-gb", "1"],
            vec![("K3_EXPERT_READ_THREADS", "0")],
            "K3_EXPERT_READ_THREADS",
        ),
        (
            vec!["--memory-budget-gb", "1"],
            vec![("K3_PILOT_GATE_THRESHOLD", "1.5")],
            "K3_PILOT_GATE_THRESHOLD",
        ),
    ] {
        let mut a = vec!["run", "--max-new", "1"];
        a.extend(args);
        let o = deltafin(&a, &env);
        let (_, err) = text(&o);
        assert!(
            !o.status.success() && err.contains(needle),
            "{needle}: {err}"
        );
    }
}

#[test]
fn router_trace_writes_one_line_per_pass_and_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("routes.jsonl");
    let t = trace.display().to_string();
    let o = deltafin(
        &[
            "run",
            "--prompt",
            "Trace the routes",
            "--max-new",
            "3",
            "--router-trace",
            &t,
        ],
        &[("K3_MEMORY_BUDGET_GB", "0.2")],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 3 passes (prefill + 2 decode steps) × 13 MoE layers.
    assert_eq!(lines.len(), 3 * 13);
    assert_eq!(lines[0]["step"], 0);
    assert_eq!(lines[0]["layer"], 1);
    assert_eq!(lines[13]["step"], 1);
    let first = &lines[0];
    let n = first["ids"].as_array().unwrap().len();
    assert_eq!(n, first["w"].as_array().unwrap().len());
    assert_eq!(n % 4, 0, "top-4 per row");
    assert_eq!(lines[13]["ids"].as_array().unwrap().len(), 4);
}
