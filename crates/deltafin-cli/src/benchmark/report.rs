//! The campaign's verdict: per-arm spreads, `result.json`, the latency plot, the table on
//! stdout and the exit status.

use super::args::BenchmarkArgs;
use super::arms::Arm;
use super::campaign::{Oracle, OracleCheck, RunRecord, Runs};
use super::evidence::write_json;
use super::plot::latency_svg;
use super::stats::{Spread, fmt_spread, overlaps, ratio, spread, spread_json};
use super::validate::RunMetrics;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::Path;
use std::process::ExitCode;

/// The result schema the benchmark writes.
pub const RESULT_SCHEMA: &str = "deltafin.benchmark.v1";

/// Per-arm spreads of the valid runs' figures.
#[derive(Clone, Copy)]
struct ArmStats {
    prefill: Option<Spread>,
    tps: Option<Spread>,
    spt: Option<Spread>,
    bpt: Option<Spread>,
}

/// Summarise `runs` of a campaign of `scheduled` runs into `dir`; exit 0 when every run was
/// valid and matched the oracle; with `--keep-going`, also when invalid runs were skipped but
/// at least one run was valid.
pub(super) fn report(
    args: &BenchmarkArgs,
    arms: &[Arm],
    arms_json: &[Value],
    scheduled: usize,
    runs: &Runs,
    explicit: Option<&Oracle>,
    dir: &Path,
) -> Result<ExitCode> {
    let (records, implicit, stopped) = (&runs.records, &runs.implicit, runs.stopped);
    let valid_runs = records.iter().filter(|r| r.invalid.is_none()).count();
    let all_runs_valid = !stopped && valid_runs == scheduled;
    let all_outputs_exact = all_runs_valid
        && records
            .iter()
            .all(|r| matches!(r.oracle, OracleCheck::Match | OracleCheck::Reference));
    let per_arm: Vec<ArmStats> = (0..arms.len())
        .map(|a| {
            let ms: Vec<&RunMetrics> = records
                .iter()
                .filter(|r| r.arm == a && r.invalid.is_none())
                .filter_map(|r| r.metrics.as_ref())
                .collect();
            let of = |f: &dyn Fn(&RunMetrics) -> Option<f64>| {
                spread(&ms.iter().filter_map(|m| f(m)).collect::<Vec<_>>())
            };
            ArmStats {
                prefill: of(&|m| Some(m.prefill_seconds)),
                tps: of(&|m| m.decode_tokens_per_second),
                spt: of(&|m| m.decode_seconds_per_token),
                bpt: of(&|m| m.bytes_read_per_token),
            }
        })
        .collect();
    let base = per_arm[0];
    let arms_summary: Vec<Value> = arms
        .iter()
        .enumerate()
        .map(|(a, arm)| {
            let ArmStats {
                prefill: pre,
                tps,
                spt,
                bpt,
            } = per_arm[a];
            let runs: Vec<&RunRecord> = records.iter().filter(|r| r.arm == a).collect();
            let proposed: u64 = runs
                .iter()
                .filter(|r| r.invalid.is_none())
                .filter_map(|r| r.data.as_ref())
                .map(|d| d.proposed)
                .sum();
            let accepted: u64 = runs
                .iter()
                .filter(|r| r.invalid.is_none())
                .filter_map(|r| r.data.as_ref())
                .map(|d| d.accepted)
                .sum();
            json!({
                "name": arm.name,
                "env": arms_json[a]["env"],
                "runs": runs.len(),
                "valid_runs": runs.iter().filter(|r| r.invalid.is_none()).count(),
                "prefill_seconds": spread_json(pre),
                "decode_tokens_per_second": spread_json(tps),
                "decode_seconds_per_token": spread_json(spt),
                "bytes_read_per_token": spread_json(bpt),
                "bytes_read_reported": bpt.is_some(),
                "proposed_tokens": proposed,
                "accepted_tokens": accepted,
                "acceptance_rate": if proposed > 0 { json!(accepted as f64 / proposed as f64) } else { Value::Null },
                "relative_to_first_config": {
                    "prefill_seconds_median": ratio(pre, base.prefill),
                    "decode_tokens_per_second_median": ratio(tps, base.tps),
                },
                "overlaps_baseline": {
                    "prefill_seconds": overlaps(pre, base.prefill),
                    "decode_tokens_per_second": overlaps(tps, base.tps),
                },
            })
        })
        .collect();
    let oracle = explicit.or(implicit.as_ref());
    let result = json!({
        "schema": RESULT_SCHEMA,
        "campaign": "campaign.json",
        "runs_file": "runs.jsonl",
        "plot": "latency.svg",
        "runs_scheduled": scheduled,
        "runs_executed": records.len(),
        "completed": !stopped,
        "valid_runs": valid_runs,
        "all_runs_valid": all_runs_valid,
        "all_outputs_exact": all_outputs_exact,
        "warmup_steps": args.warmup_steps,
        "steady_state": "decode steps after step 0 (the prefill's token) and the warmup steps",
        "oracle": oracle.map(|o| json!({"source": o.source, "token_ids": o.ids, "text": o.text})),
        "arms": arms_summary,
    });
    write_json(&dir.join("result.json"), &result)?;
    let series: Vec<(usize, Vec<f64>)> = records
        .iter()
        .filter(|r| r.invalid.is_none())
        .filter_map(|r| {
            r.data.as_ref().map(|d| {
                (
                    r.arm,
                    d.step_ns.iter().skip(1).map(|&n| n as f64 / 1e6).collect(),
                )
            })
        })
        .collect();
    let svg_path = dir.join("latency.svg");
    std::fs::write(&svg_path, latency_svg(arms, &series)?)
        .with_context(|| format!("cannot write {}", svg_path.display()))?;

    // Table.
    let wname = arms.iter().map(|a| a.name.len()).max().unwrap_or(3).max(3);
    println!(
        "{:<wname$}  {:>5}  {:>5}  {:<30}  {:<30}  {:>9}",
        "arm",
        "runs",
        "valid",
        "prefill s (min/median/max)",
        "decode token/s (min/median/max)",
        "vs first"
    );
    for (a, arm) in arms.iter().enumerate() {
        let ArmStats {
            prefill: pre, tps, ..
        } = per_arm[a];
        let runs = records.iter().filter(|r| r.arm == a).count();
        let valid = records
            .iter()
            .filter(|r| r.arm == a && r.invalid.is_none())
            .count();
        let rel = match ratio(tps, base.tps) {
            Value::Number(n) => format!("{:.3}x", n.as_f64().unwrap_or(0.0)),
            _ => "-".into(),
        };
        println!(
            "{:<wname$}  {:>5}  {:>5}  {:<30}  {:<30}  {:>9}",
            arm.name,
            runs,
            valid,
            fmt_spread(pre, 4),
            fmt_spread(tps, 2),
            rel
        );
    }
    println!(
        "all runs valid: {all_runs_valid}; all outputs exact: {all_outputs_exact}; evidence: {}",
        dir.display()
    );
    let ok = if args.keep_going {
        valid_runs > 0
    } else {
        all_runs_valid && all_outputs_exact
    };
    if !ok {
        eprintln!(
            "deltafin: error: the benchmark campaign has invalid runs (see {})",
            dir.join("runs.jsonl").display()
        );
    } else if !all_runs_valid {
        eprintln!(
            "deltafin: warning: {} of {} runs were invalid and skipped (--keep-going)",
            scheduled - valid_runs,
            scheduled
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
