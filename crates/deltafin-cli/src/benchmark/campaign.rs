//! The campaign's run loop: every scheduled run, its validation, the oracle check and the
//! `runs.jsonl` record.

use super::args::BenchmarkArgs;
use super::arms::Arm;
use super::child::{ChildOutcome, run_child};
use super::validate::{RunData, RunMetrics, metrics, validate_events};
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum OracleCheck {
    /// The oracle was derived from this run.
    Reference,
    Match,
    Mismatch,
    /// No oracle was available to check against.
    Unchecked,
    /// The run was invalid before any oracle check.
    NotApplicable,
}

impl OracleCheck {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            OracleCheck::Reference => "reference",
            OracleCheck::Match => "match",
            OracleCheck::Mismatch => "mismatch",
            OracleCheck::Unchecked => "unchecked",
            OracleCheck::NotApplicable => "n/a",
        }
    }
}

/// One scheduled run: where it stands in the schedule, what came back and its verdict.
pub(super) struct RunRecord {
    pub(super) index: usize,
    pub(super) rep: u64,
    pub(super) arm: usize,
    pub(super) position: usize,
    pub(super) dir: String,
    pub(super) outcome: Option<ChildOutcome>,
    pub(super) data: Option<RunData>,
    pub(super) metrics: Option<RunMetrics>,
    pub(super) invalid: Option<String>,
    pub(super) oracle: OracleCheck,
}

/// The completion every run must produce: given on the command line, or the first valid run
/// of the first arm.
#[derive(Clone, Debug)]
pub(super) struct Oracle {
    pub(super) source: &'static str,
    pub(super) ids: Option<Vec<u32>>,
    pub(super) text: Option<String>,
}

impl Oracle {
    /// `None` when `d` matches, else why not.
    pub(super) fn check(&self, d: &RunData) -> Option<String> {
        if let Some(ids) = &self.ids
            && &d.completion_ids != ids
        {
            let at = d
                .completion_ids
                .iter()
                .zip(ids)
                .position(|(a, b)| a != b)
                .unwrap_or(d.completion_ids.len().min(ids.len()));
            return Some(format!(
                "token-id oracle ({}): completion {:?} differs from the expected {:?} at position {at}",
                self.source, d.completion_ids, ids
            ));
        }
        if let Some(t) = &self.text
            && &d.completion_text != t
        {
            return Some(format!(
                "text oracle ({}): completion {:?} differs from the expected {:?}",
                self.source, d.completion_text, t
            ));
        }
        None
    }
}

fn record_json(r: &RunRecord, arms: &[Arm]) -> Value {
    let o = r.outcome.as_ref();
    let m = r.metrics.as_ref();
    json!({
        "index": r.index,
        "repetition": r.rep + 1,
        "arm": arms[r.arm].name,
        "position": r.position,
        "dir": r.dir,
        "exit_status": o.and_then(|o| o.exit),
        "timed_out": o.map(|o| o.timed_out),
        "wall_seconds": o.map(|o| o.wall_seconds),
        "stdout_bytes": o.map(|o| o.stdout.0),
        "stdout_truncated": o.map(|o| o.stdout.1),
        "stderr_bytes": o.map(|o| o.stderr.0),
        "stderr_truncated": o.map(|o| o.stderr.1),
        "valid": r.invalid.is_none(),
        "invalid_reason": r.invalid,
        "oracle": r.oracle.as_str(),
        "prompt_tokens": r.data.as_ref().map(|d| d.prompt_tokens),
        "emitted_tokens": r.data.as_ref().map(|d| d.emitted.len()),
        "stop_reason": r.data.as_ref().map(|d| d.stop_reason.clone()),
        "completion_token_ids": r.data.as_ref().map(|d| d.completion_ids.clone()),
        "completion_text": r.data.as_ref().map(|d| d.completion_text.clone()),
        "prefill_seconds": m.map(|m| m.prefill_seconds),
        "steady_steps": m.map(|m| m.steady_steps),
        "steady_tokens": m.map(|m| m.steady_tokens),
        "decode_tokens_per_second": m.and_then(|m| m.decode_tokens_per_second),
        "decode_seconds_per_token": m.and_then(|m| m.decode_seconds_per_token),
        "bytes_read_per_token": m.and_then(|m| m.bytes_read_per_token),
        "proposed_tokens": r.data.as_ref().map(|d| d.proposed),
        "accepted_tokens": r.data.as_ref().map(|d| d.accepted),
        "acceptance_rate": m.and_then(|m| m.acceptance_rate),
        "step_latency_ms": r.data.as_ref().map(|d| d.step_ns.iter().map(|&n| n as f64 / 1e6).collect::<Vec<_>>()),
    })
}

fn write_runs(path: &Path, records: &[RunRecord], arms: &[Arm]) -> Result<()> {
    let mut text = String::new();
    for r in records {
        text.push_str(&serde_json::to_string(&record_json(r, arms))?);
        text.push('\n');
    }
    super::evidence::write_whole(path, &text)
}

/// The variables that make `deltafin run` sample: arms that set them differently emit other
/// ids, so each distinct setting has its own implicit oracle (docs/CLI.md "deltafin
/// benchmark").
const SAMPLING_VARS: [&str; 5] = [
    "K3_TEMPERATURE",
    "K3_TOP_P",
    "K3_TOP_K",
    "K3_MIN_P",
    "K3_SEED",
];

/// An arm's sampling settings (sorted): arms with equal settings must emit equal ids.
fn output_class(arm: &Arm) -> Vec<(String, String)> {
    let mut c: Vec<(String, String)> = arm
        .env
        .iter()
        .filter(|(k, _)| SAMPLING_VARS.contains(&k.as_str()))
        .cloned()
        .collect();
    c.sort();
    c
}

/// What the run loop leaves: one record per executed run, the oracle derived from the first
/// arm (when none was given), and whether it stopped at an invalid run.
pub(super) struct Runs {
    pub(super) records: Vec<RunRecord>,
    pub(super) implicit: Option<Oracle>,
    pub(super) stopped: bool,
}

/// Run `schedule` (from `abba_schedule`) with `runner`, each run in `dir/runs/NNN-ARM-repR`,
/// rewriting `dir/runs.jsonl` after every run.
pub(super) fn run_schedule(
    args: &BenchmarkArgs,
    arms: &[Arm],
    schedule: &[(u64, usize, usize)],
    dir: &Path,
    runner: &Path,
    model_root: &Path,
    explicit: Option<&Oracle>,
) -> Result<Runs> {
    let runs_dir = dir.join("runs");
    std::fs::create_dir_all(&runs_dir)
        .with_context(|| format!("cannot create {}", runs_dir.display()))?;
    let mut records: Vec<RunRecord> = Vec::new();
    // The implicit oracle of each output class: the first valid run of its first arm.
    let classes: Vec<Vec<(String, String)>> = arms.iter().map(output_class).collect();
    let leader = |a: usize| classes.iter().position(|c| *c == classes[a]).unwrap_or(a);
    let mut implicit: Vec<Option<Oracle>> = (0..arms.len()).map(|_| None).collect();
    let mut stopped = false;
    for (index, &(rep, arm, position)) in schedule.iter().enumerate() {
        let name = format!("{:03}-{}-rep{}", index + 1, arms[arm].name, rep + 1);
        let run_dir = runs_dir.join(&name);
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("cannot create {}", run_dir.display()))?;
        let events_path = run_dir.join("events.jsonl");
        let mut child_args: Vec<String> = vec![
            "run".into(),
            "--events-jsonl".into(),
            events_path.display().to_string(),
            "--max-new".into(),
            args.max_new.to_string(),
            // `=` form: a prompt starting with `-` must not read as a flag.
            format!("--prompt={}", args.prompt),
            "--model-root".into(),
            model_root.display().to_string(),
        ];
        if args.chat {
            child_args.push("--chat".into());
        }
        if let Some(d) = &args.device {
            child_args.push(format!("--device={d}"));
        }
        if let Some(e) = &args.expert_backend {
            child_args.push(format!("--expert-backend={e}"));
        }
        if let Some(h) = &args.expert_homes {
            child_args.push(format!("--expert-homes={h}"));
        }
        let outcome = run_child(runner, &child_args, &arms[arm].env, &run_dir, args.timeout)?;
        let mut rec = RunRecord {
            index: index + 1,
            rep,
            arm,
            position,
            dir: format!("runs/{name}"),
            outcome: None,
            data: None,
            metrics: None,
            invalid: None,
            oracle: OracleCheck::NotApplicable,
        };
        if outcome.timed_out {
            rec.invalid = Some(format!("timed out after {} s and was killed", args.timeout));
        } else if outcome.exit != Some(0) {
            let tail = std::fs::read_to_string(run_dir.join("stderr.txt"))
                .unwrap_or_default()
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .to_string();
            rec.invalid = Some(format!(
                "the run exited with status {}: {tail}",
                outcome
                    .exit
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "none (killed by a signal)".into())
            ));
        }
        if rec.invalid.is_none() {
            let text = std::fs::read_to_string(&events_path).unwrap_or_default();
            match validate_events(&text, &args.prompt, args.chat, args.max_new) {
                Ok(d) => {
                    rec.metrics = Some(metrics(&d, args.warmup_steps));
                    let lead = leader(arm);
                    let oracle = explicit.or(implicit[lead].as_ref());
                    match oracle {
                        Some(o) => match o.check(&d) {
                            None => rec.oracle = OracleCheck::Match,
                            Some(why) => {
                                rec.oracle = OracleCheck::Mismatch;
                                rec.invalid = Some(why);
                            }
                        },
                        None if arm == lead => {
                            implicit[lead] = Some(Oracle {
                                source: if lead == 0 {
                                    "first valid run of the first arm"
                                } else {
                                    "first valid run of the first arm with these sampling settings"
                                },
                                ids: Some(d.completion_ids.clone()),
                                text: Some(d.completion_text.clone()),
                            });
                            rec.oracle = OracleCheck::Reference;
                        }
                        None => rec.oracle = OracleCheck::Unchecked,
                    }
                    rec.data = Some(d);
                }
                Err(why) => rec.invalid = Some(format!("invalid events stream: {why}")),
            }
        }
        rec.outcome = Some(outcome);
        let summary = match (&rec.invalid, &rec.metrics) {
            (Some(why), _) => format!("INVALID: {why}"),
            (None, Some(m)) => format!(
                "ok prefill={:.4}s decode={} oracle={}",
                m.prefill_seconds,
                m.decode_tokens_per_second
                    .map(|v| format!("{v:.2} token/s"))
                    .unwrap_or_else(|| "-".into()),
                rec.oracle.as_str()
            ),
            (None, None) => "ok".into(),
        };
        eprintln!(
            "[benchmark] run {}/{} arm={} rep={}: {summary}",
            index + 1,
            schedule.len(),
            arms[arm].name,
            rep + 1
        );
        let invalid = rec.invalid.is_some();
        records.push(rec);
        write_runs(&dir.join("runs.jsonl"), &records, arms)?;
        if invalid && !args.keep_going {
            eprintln!(
                "[benchmark] stopping after an invalid run (pass --keep-going to continue past invalid runs)"
            );
            stopped = true;
            break;
        }
    }
    // Runs of later arms that ran before the first arm of their class produced its oracle.
    for r in records
        .iter_mut()
        .filter(|r| r.oracle == OracleCheck::Unchecked)
    {
        if let (Some(o), Some(d)) = (&implicit[leader(r.arm)], &r.data) {
            {
                match o.check(d) {
                    None => r.oracle = OracleCheck::Match,
                    Some(why) => {
                        r.oracle = OracleCheck::Mismatch;
                        r.invalid = Some(why);
                    }
                }
            }
        }
    }
    write_runs(&dir.join("runs.jsonl"), &records, arms)?;

    Ok(Runs {
        records,
        implicit: implicit.into_iter().next().flatten(),
        stopped,
    })
}
