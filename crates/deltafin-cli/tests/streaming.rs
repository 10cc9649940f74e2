//! `deltafin run` / `perplexity` with `--memory-budget-gb`: experts stream from disk, the
//! tokens equal the resident run, the budget is parsed strictly, `--stats` reports the cache.

mod common;

use common::{
    checkpoint, deltafin_bf16, exits, fails_with, jsonl, shared_checkpoint, stdout_stderr,
};

use deltafin_k3::synth::SynthDims;
use std::path::Path;
use std::process::Output;
use std::sync::OnceLock;

/// The tiny model with 43 MB of experts ([`SynthDims::tiny_streaming`]), shared by the tests
/// that write nothing under the model root.
fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    shared_checkpoint(&DIR, SynthDims::tiny_streaming(), 3)
}

/// A private copy of the streaming model (the heat file lives under the model root).
fn fresh_root() -> tempfile::TempDir {
    checkpoint(SynthDims::tiny_streaming(), 3)
}

/// What the tests here ask for themselves: a budget, the PILOT gate, expert heat, a pinned tier.
const UNSET: &[&str] = &[
    "K3_MEMORY_BUDGET_GB",
    "K3_PILOT_GATE",
    "K3_EXPERT_HEAT",
    "K3_EXPERT_PIN_GB",
];

/// `deltafin args --model-root root` on the bf16 spine (tests/spine.rs covers the int8 default).
fn deltafin_at(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin_bf16(root, args, UNSET, env)
}

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin_at(model_root(), args, env)
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
    exits(&resident, 0);
    let mut args = base.to_vec();
    args.extend(["--memory-budget-gb", "0.2"]);
    for gate in ["off", "measure", "on", "ranked"] {
        let streamed = deltafin(&args, &[("K3_PILOT_GATE", gate)]);
        let (out, err) = stdout_stderr(&streamed);
        assert!(streamed.status.success(), "{err}");
        assert_eq!(
            out,
            stdout_stderr(&resident).0,
            "K3_PILOT_GATE={gate}: completion text"
        );
        assert!(err.contains("memory budget 0.200 GB = spine"), "{err}");
        assert!(err.contains("explicit reads, never the mmap"), "{err}");
    }
    let mut stats = args.clone();
    stats.push("--stats");
    let (out, err) = stdout_stderr(&deltafin(&stats, &[("K3_MEMORY_BUDGET_GB", "7")]));
    assert_eq!(out.lines().count(), 10, "{out}");
    assert!(out.lines().all(|l| l.starts_with("[stats] generated=")));
    for needle in [
        "[stats] experts hits=",
        "prefetch_recall=",
        "bytes_read=",
        "read_gbps=",
        "[stats] experts hit% by layer: 1:",
        "prefetch_precision=",
        "prefetch_wasted_bytes=",
        "[stats] experts PILOT precision% by rank (decode; decayed, off = gated): 0:",
        "[stats] memory peak_rss=",
    ] {
        assert!(err.contains(needle), "missing {needle}: {err}");
    }
}

#[test]
fn streamed_spine_layers_match_the_resident_run() {
    let base = ["run", "--prompt", "Spine streaming keeps", "--max-new", "6"];
    let resident = deltafin(&base, &[]);
    exits(&resident, 0);
    let mut budgeted = base.to_vec();
    budgeted.extend(["--memory-budget-gb", "0.2", "--stats"]);
    for (args, env) in [
        (base.to_vec(), [("K3_PROVIDER_RESIDENT_LAYERS", "0")]),
        (budgeted, [("K3_PROVIDER_RESIDENT_LAYERS", "5")]),
    ] {
        let o = deltafin(&args, &env);
        let (out, err) = stdout_stderr(&o);
        assert!(o.status.success(), "{err}");
        let want = stdout_stderr(&resident).0;
        if args.contains(&"--stats") {
            assert!(err.contains("[stats] spine streamed_layers=9"), "{err}");
            assert!(err.contains("5 of 14 layers resident, 9 streamed"), "{err}");
        } else {
            assert_eq!(out, want, "{env:?}");
            assert!(
                err.contains("spine: 0 of 14 layers resident, 14 streamed"),
                "{err}"
            );
        }
    }
    for (v, needle) in [
        (
            "15",
            "K3_PROVIDER_RESIDENT_LAYERS: \"15\" is not an integer in 0…14",
        ),
        ("x", "K3_PROVIDER_RESIDENT_LAYERS"),
    ] {
        let env = [("K3_PROVIDER_RESIDENT_LAYERS", v)];
        fails_with(&deltafin(&["run", "--max-new", "1"], &env), needle);
    }
    let env = [("K3_SPINE_READ_THREADS", "0")];
    fails_with(
        &deltafin(&["run", "--max-new", "1"], &env),
        "K3_SPINE_READ_THREADS",
    );
    // --spine-read-threads (run, serve, perplexity, doctor): 1…16, winning over the variable,
    // which is checked all the same; the streamed spine reports what it runs.
    let streamed = [("K3_PROVIDER_RESIDENT_LAYERS", "3")];
    let env = [streamed[0], ("K3_SPINE_READ_THREADS", "7")];
    let o = deltafin(
        &["run", "--max-new", "1", "--spine-read-threads", "2"],
        &env,
    );
    let (_, err) = stdout_stderr(&o);
    assert!(
        o.status.success() && err.contains("read_threads=2)"),
        "{err}"
    );
    let o = deltafin(&["run", "--max-new", "1"], &env);
    let (_, err) = stdout_stderr(&o);
    assert!(
        o.status.success() && err.contains("read_threads=7)"),
        "{err}"
    );
    for bad in ["0", "17", "x"] {
        fails_with(
            &deltafin(
                &["run", "--max-new", "1", "--spine-read-threads", bad],
                &streamed,
            ),
            "--spine-read-threads",
        );
    }
    let env = [streamed[0], ("K3_SPINE_READ_THREADS", "99")];
    fails_with(
        &deltafin(
            &["run", "--max-new", "1", "--spine-read-threads", "2"],
            &env,
        ),
        "K3_SPINE_READ_THREADS",
    );
    for cmd in ["serve", "perplexity", "doctor"] {
        let o = deltafin(&[cmd, "--spine-read-threads", "0"], &[]);
        let (_, err) = stdout_stderr(&o);
        assert!(
            !o.status.success() && err.contains("--spine-read-threads"),
            "{cmd}: {err}"
        );
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
    assert!(
        a.status.success() && b.status.success(),
        "{:?}",
        stdout_stderr(&b)
    );
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
    let run = ["run", "--max-new", "1"];
    for (flags, needle) in [
        (
            "--memory-budget-gb lots",
            "--memory-budget-gb: \"lots\" is not a number of GB",
        ),
        ("--memory-budget-gb=-1", "must be a positive number"),
        (
            "--memory-budget-gb 0.001",
            "is too small even with every spine layer streamed",
        ),
    ] {
        let args: Vec<&str> = run
            .iter()
            .copied()
            .chain(flags.split_whitespace())
            .collect();
        fails_with(&deltafin(&args, &[]), needle);
    }
    fails_with(
        &deltafin(&run, &[("K3_MEMORY_BUDGET_GB", "0")]),
        "environment variable K3_MEMORY_BUDGET_GB",
    );
    // The knobs of expert streaming, under a budget.
    let budgeted = [&run[..], &["--memory-budget-gb", "1"]].concat();
    for (knob, needle) in [
        (
            ("K3_PILOT_GATE", "maybe"),
            "K3_PILOT_GATE: \"maybe\" is not off, measure, on or ranked",
        ),
        (("K3_EXPERT_READ_THREADS", "0"), "K3_EXPERT_READ_THREADS"),
        (
            ("K3_PILOT_GATE_THRESHOLD", "1.5"),
            "K3_PILOT_GATE_THRESHOLD",
        ),
        (
            ("K3_PILOT_RANK_PRECISION", "-0.1"),
            "K3_PILOT_RANK_PRECISION: \"-0.1\" is not a number in [0, 1]",
        ),
        (
            ("K3_PILOT_MAX_GUESSES", "lots"),
            "K3_PILOT_MAX_GUESSES: \"lots\" is not an integer in 0…4096",
        ),
    ] {
        fails_with(&deltafin(&budgeted, &[knob]), needle);
    }
}

#[test]
fn router_trace_writes_one_line_per_pass_and_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("routes.jsonl");
    let t = trace.display().to_string();
    let args = [
        "run",
        "--prompt",
        "Trace the routes",
        "--max-new",
        "3",
        "--router-trace",
        &t,
    ];
    exits(&deltafin(&args, &[("K3_MEMORY_BUDGET_GB", "0.2")]), 0);
    let lines = jsonl(&trace);
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

#[test]
fn router_trace_modes_and_their_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("sync.jsonl");
    let t = trace.display().to_string();
    // Mode and path from the environment; sync mode.
    let o = deltafin(
        &["run", "--prompt", "Trace", "--max-new", "2"],
        &[("K3_TRACE", "sync"), ("K3_TRACE_PATH", &t)],
    );
    exits(&o, 0);
    assert_eq!(
        std::fs::read_to_string(&trace).unwrap().lines().count(),
        2 * 13
    );
    for (args, env, needle) in [
        (
            vec!["--router-trace", t.as_str(), "--router-trace-mode", "off"],
            vec![],
            "given with mode off",
        ),
        (vec!["--router-trace-mode", "sync"], vec![], "needs a path"),
        (
            vec!["--router-trace-mode", "often"],
            vec![],
            "--router-trace-mode: \"often\" is not off, buffered or sync",
        ),
        (
            vec![],
            vec![("K3_TRACE", "always")],
            "environment variable K3_TRACE: \"always\"",
        ),
        (
            vec!["--router-trace", t.as_str()],
            vec![("K3_TRACE", "off")],
            "given with mode off",
        ),
    ] {
        fails_with(
            &deltafin(&[&["run", "--max-new", "1"], &args[..]].concat(), &env),
            needle,
        );
        // `serve` resolves the same flags the same way, before it binds.
        fails_with(
            &deltafin(&[&["serve", "--port", "0"], &args[..]].concat(), &env),
            needle,
        );
    }
}

const HEAT_DIMS: deltafin_experts::heat::HeatDims = deltafin_experts::heat::HeatDims {
    layers: 13,
    experts: 64,
    top_k: 4,
};

#[test]
fn expert_heat_persists_across_runs_and_can_be_switched_off() {
    use deltafin_experts::heat::{HEAT_FILE, load};
    let root = fresh_root();
    let heat = root.path().join(HEAT_FILE);
    let args = ["run", "--prompt", "Heat learns routes", "--max-new", "4"];
    let o = deltafin_at(root.path(), &args, &[("K3_EXPERT_HEAT", "off")]);
    exits(&o, 0);
    assert!(
        stdout_stderr(&o).1.contains("expert_heat=off"),
        "{:?}",
        stdout_stderr(&o)
    );
    assert!(!heat.exists(), "K3_EXPERT_HEAT=off wrote the histogram");
    // Default on: 4 passes (prefill + 3 decode steps), then 4 more.
    for want in [4, 8] {
        let o = deltafin_at(root.path(), &args, &[("K3_MEMORY_BUDGET_GB", "0.2")]);
        exits(&o, 0);
        let l = load(&heat, HEAT_DIMS);
        assert!(l.note.is_none(), "{:?}", l.note);
        assert_eq!(l.table.passes, want);
        assert_eq!(
            std::fs::metadata(&heat).unwrap().len() as usize,
            HEAT_DIMS.file_bytes()
        );
        // Every pass routes ≥ 4 distinct experts per layer, each counted once per pass.
        for layer in 1..=13 {
            let sum: f64 = (0..64).map(|e| l.table.get(layer, e)).sum();
            assert!(sum >= 4.0 * l.table.mass - 1e-3, "layer {layer}: {sum}");
            assert!((0..64).all(|e| l.table.get(layer, e) <= l.table.mass + 1e-3));
        }
    }
    assert!(
        stdout_stderr(&deltafin_at(root.path(), &args, &[]))
            .1
            .contains("(8 passes learned")
    );
    // A corrupt file is a warning, not an error, and is then rewritten.
    std::fs::write(&heat, b"K3HEATv1 but short").unwrap();
    let o = deltafin_at(root.path(), &args, &[]);
    exits(&o, 0);
    assert!(
        stdout_stderr(&o).1.contains("ignored"),
        "{:?}",
        stdout_stderr(&o)
    );
    assert_eq!(load(&heat, HEAT_DIMS).table.passes, 4);
    for (env, needle) in [
        (
            ("K3_EXPERT_HEAT", "yes"),
            "K3_EXPERT_HEAT: \"yes\" is not on or off",
        ),
        (("K3_EXPERT_PIN_GB", "-2"), "K3_EXPERT_PIN_GB"),
        (("K3_EXPERT_PIN_GB", "lots"), "K3_EXPERT_PIN_GB"),
    ] {
        fails_with(
            &deltafin_at(root.path(), &["run", "--max-new", "1"], &[env]),
            needle,
        );
    }
}

#[test]
fn pinned_tier_fills_from_the_heat_file_and_tokens_match_the_resident_run() {
    use deltafin_experts::heat::{HEAT_FILE, HeatTable};
    let root = fresh_root();
    let args = [
        "run",
        "--prompt",
        "Pinned experts stay",
        "--max-new",
        "8",
        "--stats",
    ];
    // Learn this prompt's routes from a trace, then write a histogram that saw its passes
    // over and over (300 passes of mass).
    let trace = root.path().join("learn.jsonl");
    let mut learn = args.to_vec();
    learn.extend(["--router-trace", "learn.jsonl"]);
    let o = deltafin_at(root.path(), &learn, &[("K3_EXPERT_HEAT", "off")]);
    exits(&o, 0);
    let mut passes: Vec<Vec<(usize, Vec<usize>)>> = Vec::new();
    for line in std::fs::read_to_string(&trace).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_u64().unwrap() as usize;
        let layer = v["layer"].as_u64().unwrap() as usize;
        let mut ids: Vec<usize> = v["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        passes.resize(step + 1, Vec::new());
        passes[step].push((layer, ids));
    }
    assert_eq!(passes.len(), 8, "prefill + 7 decode passes");
    let mut t = HeatTable::empty(HEAT_DIMS);
    for i in 0..300 {
        t.record_pass(passes[i % 8].iter().map(|(l, u)| (*l, u.as_slice())));
    }
    let candidates = t.pin_candidates().len();
    assert!(candidates > 18, "{candidates}");
    let path = root.path().join(HEAT_FILE);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, t.encode()).unwrap();
    let resident = deltafin_at(root.path(), &args, &[("K3_EXPERT_HEAT", "off")]);
    exits(&resident, 0);
    let pinned = deltafin_at(
        root.path(),
        &args,
        &[
            ("K3_MEMORY_BUDGET_GB", "0.2"),
            ("K3_EXPERT_PIN_GB", "0.001"),
        ],
    );
    let (out, err) = stdout_stderr(&pinned);
    assert!(pinned.status.success(), "{err}");
    let ids = |o: &str| -> Vec<String> {
        o.lines()
            .map(|l| l.split(" elapsed").next().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids(&out), ids(&stdout_stderr(&resident).0));
    assert!(
        err.contains(&format!(
            "(300 passes learned, {candidates} pin candidates) pinned_tier=0.001 GB"
        )),
        "{err}"
    );
    let field = |name: &str| -> u64 {
        err.split(&format!(" {name}="))
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(field("pinned") > 0, "{err}");
    assert!(field("pinned_hits") > 0, "{err}");
    assert!(
        field("pin_budget") > 0 && field("pin_budget") <= 1_000_000,
        "{err}"
    );
    // A tier larger than the expert cache is a clear error.
    let env = [("K3_MEMORY_BUDGET_GB", "0.2"), ("K3_EXPERT_PIN_GB", "5")];
    fails_with(
        &deltafin_at(root.path(), &args, &env),
        "does not fit the expert cache",
    );
}

/// `run --max-new N` reserves state for the prompt's bound plus N tokens (plus the
/// verification window) instead of 32,768 (chat mode's bound counts the template), and the
/// tokens are those of the resident run.
#[test]
fn the_budget_reserves_state_for_the_context_a_run_can_reach() {
    let tokens_reserved = |err: &str| -> usize {
        let at = err.find(" tokens, 1 sequence) + runtime").expect(err);
        let open = err[..at].rfind('(').expect(err);
        err[open + 1..at].parse().expect(err)
    };
    let prompt = "Expert streaming keeps";
    let base = ["run", "--prompt", prompt, "--max-new", "7"];
    let resident = deltafin(&base, &[]);
    exits(&resident, 0);
    let mut budgeted = base.to_vec();
    budgeted.extend(["--memory-budget-gb", "0.2"]);
    let o = deltafin(&budgeted, &[]);
    let (out, err) = stdout_stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(out, stdout_stderr(&resident).0);
    assert_eq!(tokens_reserved(&err), prompt.len() + 7 + 32, "{err}");
    let mut chat = budgeted.clone();
    chat.push("--chat");
    let o = deltafin(&chat, &[]);
    let (_, err) = stdout_stderr(&o);
    assert!(o.status.success(), "{err}");
    let chat_reserved = tokens_reserved(&err);
    assert!(
        chat_reserved > prompt.len() + 7 + 32 && chat_reserved < 32_768,
        "{err}"
    );
}
