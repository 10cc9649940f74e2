//! `deltafin benchmark`: A/B campaigns over environment "arms" (product contract §8).
//!
//! The running executable is copied into a new evidence directory and relaunched as
//! `run --events-jsonl …` once per (repetition, arm), in ABBA order: even repetitions run the
//! arms in the given order, odd ones in reverse, so every arm holds every position equally
//! often (hence an even number of repetitions when there are two arms or more). Only the
//! child's events stream is read; it is validated strictly (order, contiguous steps, counts),
//! the completion is checked against a token-id / text oracle, and per-arm min/median/max of
//! prefill seconds and steady decode rate are written as `result.json`
//! (schema `deltafin.benchmark.v1`), a table on stdout and an SVG plot of per-token latency.
//!
//! Files: `arms` (arm and oracle flags, the ABBA schedule), `child` (one run with capped
//! capture and a timeout), `validate` (the events stream and a run's figures), `campaign` (the
//! run loop, oracle checks, `runs.jsonl`), `stats` and `plot` (spreads, the SVG), `evidence`
//! (the evidence directory, environment and system records), `report` (`result.json`, the
//! table, the exit status).

mod args;
mod arms;
mod campaign;
mod child;
mod evidence;
mod plot;
mod report;
mod stats;
mod validate;

use anyhow::{Context, Result, anyhow, bail};
pub use args::BenchmarkArgs;
use arms::{abba_schedule, parse_arms, parse_token_ids};
use campaign::{Oracle, run_schedule};
use evidence::{
    create_evidence_dir, perf_environment, redacted, sha256_file, system_state, write_json,
};
use serde_json::{Map, Value, json};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

/// Run the campaign. Exit 0 when every run was valid and matched the oracle; with
/// `--keep-going`, also when invalid runs were skipped but at least one run was valid.
pub fn benchmark(args: &BenchmarkArgs) -> Result<ExitCode> {
    let arms = parse_arms(&args.arm, &args.configs, &args.names)?;
    let reps = match args.reps {
        Some(r) => r,
        None if arms.len() >= 2 => 4,
        None => 3,
    };
    if arms.len() >= 2 && reps % 2 == 1 {
        bail!(
            "--reps {reps}: with {} arms the runs alternate in ABBA order, which needs an even number of repetitions (e.g. --reps {})",
            arms.len(),
            reps + 1
        );
    }
    if args.warmup_steps > 0 && args.warmup_steps + 2 > args.max_new {
        bail!(
            "--warmup-steps {} leaves no steady decode step with --max-new {} (step 0 is the prefill's token; need warmup ≤ max-new − 2)",
            args.warmup_steps,
            args.max_new
        );
    }
    let explicit_ids = args
        .expect_token_ids
        .as_deref()
        .map(parse_token_ids)
        .transpose()?;
    if let Some(ids) = &explicit_ids
        && ids.len() as u64 > args.max_new
    {
        bail!(
            "--expect-token-ids has {} ids but each run generates at most --max-new {}",
            ids.len(),
            args.max_new
        );
    }
    // Reject a bad device or backend before any run; the runs repeat the full selection.
    if let Some(d) = &args.device {
        crate::device::parse_device(d).map_err(|e| anyhow!("--device {e}"))?;
    }
    if let Some(b) = &args.expert_backend {
        crate::device::parse_expert_backend(b).map_err(|e| anyhow!("--expert-backend {e}"))?;
    }
    let given_root = args.root.resolve();
    crate::session::check_root(&given_root)?;
    let model_root = given_root
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", given_root.display()))?;
    let explicit = (explicit_ids.is_some() || args.expect_text.is_some()).then(|| Oracle {
        source: "expected",
        ids: explicit_ids.clone(),
        text: args.expect_text.clone(),
    });

    let dir = create_evidence_dir(args.output_dir.as_deref())?;
    let exe = std::env::current_exe().context("cannot locate the running binary")?;
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir)
        .with_context(|| format!("cannot create {}", bin_dir.display()))?;
    let runner = bin_dir.join(format!("deltafin{}", std::env::consts::EXE_SUFFIX));
    std::fs::copy(&exe, &runner).with_context(|| {
        format!(
            "cannot copy the runner {} to {}",
            exe.display(),
            runner.display()
        )
    })?;
    let runner = runner
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", runner.display()))?;
    let runner_sha = sha256_file(&runner)?;
    let schedule = abba_schedule(arms.len(), reps);
    let arms_json: Vec<Value> = arms
        .iter()
        .map(|a| {
            let env: Map<String, Value> = a
                .env
                .iter()
                .map(|(k, v)| (k.clone(), redacted(k, v)))
                .collect();
            json!({"name": a.name, "env": env})
        })
        .collect();
    let campaign = json!({
        "schema": "deltafin.benchmark.campaign.v1",
        "created_unix_seconds": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "argv": std::env::args().collect::<Vec<_>>(),
        "arguments": {
            "prompt": args.prompt,
            "chat": args.chat,
            "max_new": args.max_new,
            "reps": reps,
            "warmup_steps": args.warmup_steps,
            "timeout_seconds": args.timeout,
            "expect_token_ids": explicit_ids,
            "expect_text": args.expect_text,
            "keep_going": args.keep_going,
            "model_root": model_root.display().to_string(),
        },
        "arms": arms_json,
        "order": "ABBA: even repetitions run the arms in the given order, odd repetitions in reverse",
        "schedule": schedule.iter().enumerate().map(|(i, &(rep, arm, pos))| json!({
            "index": i, "repetition": rep + 1, "arm": arms[arm].name, "position": pos,
        })).collect::<Vec<_>>(),
        "runner": {
            "source": exe.display().to_string(),
            "copy": runner.display().to_string(),
            "sha256": runner_sha,
        },
        "environment": perf_environment(),
        "system": system_state(),
    });
    write_json(&dir.join("campaign.json"), &campaign)?;
    eprintln!(
        "[benchmark] {} arm(s) × {} repetition(s) = {} runs, max_new={}, evidence in {}",
        arms.len(),
        reps,
        schedule.len(),
        args.max_new,
        dir.display()
    );

    let runs = run_schedule(
        args,
        &arms,
        &schedule,
        &dir,
        &runner,
        &model_root,
        explicit.as_ref(),
    )?;
    report::report(
        args,
        &arms,
        &arms_json,
        schedule.len(),
        &runs,
        explicit.as_ref(),
        &dir,
    )
}
