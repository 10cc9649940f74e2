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

use crate::buildinfo;
use anyhow::{Context, Result, anyhow, bail};
use deltafin_k3::checkpoint::CONFIG_FILE;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Cap on each run's captured stdout.
pub const STDOUT_CAP: u64 = 64 << 20;
/// Cap on each run's captured stderr.
pub const STDERR_CAP: u64 = 16 << 20;
/// The events schema the benchmark reads.
pub const EVENT_SCHEMA: &str = "deltafin.run_event.v1";
/// The result schema the benchmark writes.
pub const RESULT_SCHEMA: &str = "deltafin.benchmark.v1";

fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!(
            "`{s}`: the timeout must be a positive number of seconds"
        ));
    }
    Ok(v)
}

/// `benchmark` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchmarkArgs {
    /// Text to continue (raw completion) or the user message (with --chat).
    #[arg(long, value_name = "TEXT", default_value = "The capital of France is")]
    pub prompt: String,
    /// Wrap the prompt in K3's XTML chat template.
    #[arg(long)]
    pub chat: bool,
    /// Generated tokens per run.
    #[arg(long, visible_alias = "tokens", value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_new: u64,
    /// Repetitions per arm [default: 3 with one arm; 4 with two or more, whose runs
    /// alternate in ABBA order and so need an even count].
    #[arg(long, visible_alias = "repetitions", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=10000))]
    pub reps: Option<u64>,
    /// Decode steps after the first token excluded from the steady-state figures.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_steps: u64,
    /// Kill a run that takes longer than this many seconds.
    #[arg(long, visible_alias = "timeout-seconds", value_name = "SECONDS",
          default_value = "3600", value_parser = positive_seconds)]
    pub timeout: f64,
    /// Arms as quoted, space-separated `KEY=VALUE` environment deltas (`""` = no change).
    #[arg(long, visible_alias = "config", value_name = "ENV", num_args = 1.., conflicts_with = "arm")]
    pub configs: Vec<String>,
    /// Names for the --configs arms, one each, unique.
    #[arg(long, visible_alias = "name", value_name = "NAME", num_args = 1.., requires = "configs")]
    pub names: Vec<String>,
    /// A named arm `NAME=KEY=VALUE [KEY=VALUE…]`; repeatable.
    #[arg(long, value_name = "NAME=ENV")]
    pub arm: Vec<String>,
    /// Exact completion-id oracle: a JSON array or comma-separated integers.
    #[arg(long, value_name = "IDS")]
    pub expect_token_ids: Option<String>,
    /// Exact completion-text oracle.
    #[arg(long, value_name = "TEXT")]
    pub expect_text: Option<String>,
    /// New evidence directory [default: bench-results/native-<UTC time>].
    #[arg(long, visible_alias = "output", value_name = "PATH")]
    pub output_dir: Option<PathBuf>,
    /// Continue after an invalid run.
    #[arg(long)]
    pub keep_going: bool,
    /// Install root passed to every run.
    #[arg(long, value_name = "PATH", default_value = ".")]
    pub model_root: PathBuf,
    /// Compute device passed to every run (`--device`; auto, cpu, mps, cuda, cuda:N)
    /// [default: the runs read K3_DEV].
    #[arg(long, value_name = "DEV")]
    pub device: Option<String>,
    /// Expert backend passed to every run (`--expert-backend`; auto, cpu, metal, cuda)
    /// [default: the runs read K3_MOE].
    #[arg(long, value_name = "BACKEND")]
    pub expert_backend: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Arms and oracles

/// One arm: a name and the environment changes its runs get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arm {
    pub name: String,
    pub env: Vec<(String, String)>,
}

fn valid_env_key(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Parse `KEY=VALUE KEY=VALUE`: whitespace-separated pairs, valid unique keys, no
/// dynamic-loader variables (`LD_*`, `DYLD_*`).
pub fn parse_env_delta(spec: &str) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for tok in spec.split_whitespace() {
        let Some((k, v)) = tok.split_once('=') else {
            bail!("`{tok}` is not KEY=VALUE");
        };
        if !valid_env_key(k) {
            bail!("`{k}` is not a valid environment variable name");
        }
        if k.starts_with("LD_") || k.starts_with("DYLD_") {
            bail!(
                "`{k}`: dynamic-loader variables are forbidden in arms (they would change which code runs, not how)"
            );
        }
        if out.iter().any(|(o, _)| o == k) {
            bail!("`{k}` is set twice");
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

fn valid_arm_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The arms from `--arm` or `--configs/--names`; one arm `defaults` when neither is given.
pub fn parse_arms(arm: &[String], configs: &[String], names: &[String]) -> Result<Vec<Arm>> {
    let mut arms = Vec::new();
    if !arm.is_empty() {
        for a in arm {
            let Some((name, env)) = a.split_once('=') else {
                bail!("--arm {a:?}: expected NAME=ENV (e.g. --arm fast=RAYON_NUM_THREADS=8)");
            };
            let env = parse_env_delta(env).with_context(|| format!("--arm {a:?}"))?;
            arms.push(Arm {
                name: name.to_string(),
                env,
            });
        }
    } else if !configs.is_empty() {
        if !names.is_empty() && names.len() != configs.len() {
            bail!(
                "--names gives {} names for {} --configs arms; give one name per arm",
                names.len(),
                configs.len()
            );
        }
        for (i, c) in configs.iter().enumerate() {
            let env = parse_env_delta(c).with_context(|| format!("--configs {c:?}"))?;
            let name = names
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("config-{}", i + 1));
            arms.push(Arm { name, env });
        }
    } else {
        arms.push(Arm {
            name: "defaults".into(),
            env: Vec::new(),
        });
    }
    let mut seen = BTreeSet::new();
    for a in &arms {
        if !valid_arm_name(&a.name) {
            bail!(
                "arm name {:?}: use 1–64 characters from A–Z, a–z, 0–9, `-`, `_`, `.`",
                a.name
            );
        }
        if !seen.insert(a.name.as_str()) {
            bail!(
                "arm name `{}` is used twice; arm names must be unique",
                a.name
            );
        }
    }
    Ok(arms)
}

/// Token ids from a JSON array (`[1, 2]`) or a comma list (`1,2`).
pub fn parse_token_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    let ids: Vec<u32> = if t.starts_with('[') {
        serde_json::from_str::<Vec<u32>>(t).map_err(|e| {
            anyhow!("--expect-token-ids {s:?}: not a JSON array of token ids (0…4294967295): {e}")
        })?
    } else {
        t.split(',')
            .map(|p| {
                p.trim().parse::<u32>().map_err(|_| {
                    anyhow!("--expect-token-ids {s:?}: `{}` is not a token id", p.trim())
                })
            })
            .collect::<Result<_>>()?
    };
    if ids.is_empty() {
        bail!("--expect-token-ids {s:?}: no token ids given");
    }
    Ok(ids)
}

/// The schedule: `(repetition, arm index, position)` in execution order. Even repetitions
/// run the arms in order, odd repetitions in reverse (ABBA).
pub fn abba_schedule(arms: usize, reps: u64) -> Vec<(u64, usize, usize)> {
    let mut out = Vec::new();
    for rep in 0..reps {
        for pos in 0..arms {
            let arm = if rep % 2 == 0 { pos } else { arms - 1 - pos };
            out.push((rep, arm, pos));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Events validation

/// What a valid events stream says about one run.
#[derive(Clone, Debug, Default)]
pub struct RunData {
    pub prompt_tokens: usize,
    pub prefill_ns: u64,
    /// Per decode step (step 0 is the token produced by the prefill): duration and tokens.
    pub step_ns: Vec<u64>,
    pub step_tokens: Vec<usize>,
    /// `bytes_read` per step where the run reports it.
    pub step_bytes: Vec<Option<u64>>,
    pub runtime_bytes_read: Option<u64>,
    pub emitted: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub completion_text: String,
    pub stop_reason: String,
    pub proposed: u64,
    pub accepted: u64,
}

fn get_u64(o: &Map<String, Value>, k: &str, what: &str) -> std::result::Result<u64, String> {
    o.get(k)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("{what}: `{k}` is missing or not a non-negative integer"))
}

fn get_ids(o: &Map<String, Value>, k: &str, what: &str) -> std::result::Result<Vec<u32>, String> {
    let arr = o
        .get(k)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("{what}: `{k}` is missing or not an array"))?;
    arr.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| format!("{what}: `{k}` holds a value that is not a token id"))
        })
        .collect()
}

/// Validate an events file against the run that was asked for.
pub fn validate_events(
    text: &str,
    prompt: &str,
    chat: bool,
    max_new: u64,
) -> std::result::Result<RunData, String> {
    #[derive(PartialEq)]
    enum Phase {
        Start,
        Prefill,
        Steps,
        Ended,
    }
    let mut phase = Phase::Start;
    let mut d = RunData::default();
    let mut input_ids: Vec<u32> = Vec::new();
    let mut last_mono = 0u64;
    for (i, line) in text.lines().enumerate() {
        let ln = i + 1;
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("events line {ln}: not JSON: {e}"))?;
        let Value::Object(o) = v else {
            return Err(format!("events line {ln}: not a JSON object"));
        };
        if o.get("schema").and_then(Value::as_str) != Some(EVENT_SCHEMA) {
            return Err(format!("events line {ln}: `schema` is not {EVENT_SCHEMA}"));
        }
        let ev = o
            .get("event")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("events line {ln}: `event` is missing"))?
            .to_string();
        let what = format!("events line {ln} ({ev})");
        get_u64(&o, "wall_time_ns", &what)?;
        let mono = get_u64(&o, "monotonic_ns", &what)?;
        if mono < last_mono {
            return Err(format!("{what}: monotonic_ns goes backwards"));
        }
        last_mono = mono;
        if phase == Phase::Ended {
            return Err(format!("{what}: an event after run_end"));
        }
        match ev.as_str() {
            "run_error" => {
                let msg = o.get("message").and_then(Value::as_str).unwrap_or("");
                let ph = o.get("phase").and_then(Value::as_str).unwrap_or("?");
                return Err(format!(
                    "the run reported an error in its {ph} phase: {msg}"
                ));
            }
            "run_start" => {
                if phase != Phase::Start {
                    return Err(format!("{what}: run_start is not the first event"));
                }
                if o.get("prompt").and_then(Value::as_str) != Some(prompt) {
                    return Err(format!("{what}: `prompt` is not the benchmark's prompt"));
                }
                if o.get("chat").and_then(Value::as_bool) != Some(chat) {
                    return Err(format!("{what}: `chat` is not {chat}"));
                }
                if o.get("max_new").and_then(Value::as_u64) != Some(max_new) {
                    return Err(format!("{what}: `max_new` is not {max_new}"));
                }
                input_ids = get_ids(&o, "input_token_ids", &what)?;
                if input_ids.is_empty() {
                    return Err(format!("{what}: `input_token_ids` is empty"));
                }
                if !o.get("config").is_some_and(Value::is_object) {
                    return Err(format!("{what}: `config` is missing"));
                }
                phase = Phase::Prefill;
            }
            "prefill_done" => {
                if phase != Phase::Prefill {
                    return Err(format!("{what}: prefill_done out of order"));
                }
                d.prefill_ns = get_u64(&o, "duration_ns", &what)?;
                let n = get_u64(&o, "prompt_tokens", &what)?;
                if n != input_ids.len() as u64 {
                    return Err(format!(
                        "{what}: prompt_tokens {n} but run_start has {} input ids",
                        input_ids.len()
                    ));
                }
                d.prompt_tokens = input_ids.len();
                phase = Phase::Steps;
            }
            "decode_step" => {
                if phase != Phase::Steps {
                    return Err(format!("{what}: decode_step before prefill_done"));
                }
                let step = get_u64(&o, "step", &what)?;
                if step != d.step_ns.len() as u64 {
                    return Err(format!(
                        "{what}: step {step} where step {} was expected (steps are contiguous from 0)",
                        d.step_ns.len()
                    ));
                }
                let dur = get_u64(&o, "duration_ns", &what)?;
                let ids = get_ids(&o, "emitted_token_ids", &what)?;
                get_u64(&o, "proposal_candidate_count", &what)?;
                let proposed = get_u64(&o, "proposed_token_count", &what)?;
                let accepted = get_u64(&o, "accepted_token_count", &what)?;
                if !o
                    .get("proposal_memory_rejected")
                    .is_some_and(Value::is_boolean)
                {
                    return Err(format!("{what}: `proposal_memory_rejected` is missing"));
                }
                if ids.is_empty() || ids.len() as u64 > accepted + 1 {
                    return Err(format!(
                        "{what}: {} emitted ids with {accepted} accepted drafts (must be 1…accepted+1)",
                        ids.len()
                    ));
                }
                if accepted > proposed {
                    return Err(format!(
                        "{what}: {accepted} accepted of {proposed} proposed drafts"
                    ));
                }
                if let Some(t) = o.get("token_id")
                    && t.as_u64() != Some(ids[0] as u64)
                {
                    return Err(format!(
                        "{what}: `token_id` disagrees with `emitted_token_ids`"
                    ));
                }
                d.step_bytes
                    .push(o.get("bytes_read").and_then(Value::as_u64));
                d.step_ns.push(dur);
                d.step_tokens.push(ids.len());
                d.emitted.extend_from_slice(&ids);
                d.proposed += proposed;
                d.accepted += accepted;
            }
            "run_end" => {
                if phase != Phase::Steps {
                    return Err(format!("{what}: run_end before prefill_done"));
                }
                let status = o.get("status").and_then(Value::as_str).unwrap_or("");
                if status != "ok" {
                    return Err(format!("{what}: status `{status}` (not ok)"));
                }
                get_u64(&o, "duration_ns", &what)?;
                if get_ids(&o, "prompt_token_ids", &what)? != input_ids {
                    return Err(format!(
                        "{what}: prompt_token_ids differ from run_start's input_token_ids"
                    ));
                }
                let emitted = get_ids(&o, "emitted_token_ids", &what)?;
                if emitted != d.emitted {
                    return Err(format!(
                        "{what}: emitted_token_ids ({} ids) differ from the decode steps' ({} ids)",
                        emitted.len(),
                        d.emitted.len()
                    ));
                }
                if d.step_ns.is_empty() {
                    return Err(format!("{what}: the run emitted no decode step"));
                }
                let stop = o
                    .get("stop_reason")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("{what}: `stop_reason` is missing"))?;
                let completion = get_ids(&o, "completion_token_ids", &what)?;
                let n = emitted.len() as u64;
                match stop {
                    "max_new" if n != max_new => {
                        return Err(format!(
                            "{what}: stop_reason max_new after {n} of {max_new} tokens"
                        ));
                    }
                    "eos" if completion[..] != emitted[..emitted.len() - 1] => {
                        return Err(format!(
                            "{what}: completion_token_ids must be the emitted ids without the final stop token"
                        ));
                    }
                    "max_new" | "context_full" if completion != emitted => {
                        return Err(format!(
                            "{what}: completion_token_ids differ from emitted_token_ids"
                        ));
                    }
                    "max_new" | "context_full" | "eos" => {}
                    other => {
                        return Err(format!("{what}: stop_reason `{other}` ends a valid run"));
                    }
                }
                if n > max_new {
                    return Err(format!(
                        "{what}: {n} tokens emitted with --max-new {max_new}"
                    ));
                }
                let rt = o
                    .get("runtime")
                    .and_then(Value::as_object)
                    .ok_or_else(|| format!("{what}: `runtime` is missing"))?;
                if let Some(g) = rt.get("generated_tokens")
                    && g.as_u64() != Some(n)
                {
                    return Err(format!(
                        "{what}: runtime.generated_tokens disagrees with the {n} emitted ids"
                    ));
                }
                d.runtime_bytes_read = rt.get("bytes_read").and_then(Value::as_u64);
                d.completion_text = o
                    .get("completion_text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("{what}: `completion_text` is missing"))?
                    .to_string();
                d.completion_ids = completion;
                d.stop_reason = stop.to_string();
                phase = Phase::Ended;
            }
            other => return Err(format!("{what}: unknown event `{other}`")),
        }
    }
    if phase != Phase::Ended {
        return Err("the events stream ends before run_end (the run stopped early)".into());
    }
    Ok(d)
}

/// Steady-state figures of one run, excluding step 0 (the prefill) and `warmup` steps.
#[derive(Clone, Debug, Default)]
pub struct RunMetrics {
    pub prefill_seconds: f64,
    pub steady_steps: usize,
    pub steady_tokens: usize,
    pub decode_tokens_per_second: Option<f64>,
    pub decode_seconds_per_token: Option<f64>,
    pub bytes_read_per_token: Option<f64>,
    pub acceptance_rate: Option<f64>,
}

/// Figures of `d` with `warmup` decode steps after the first excluded.
pub fn metrics(d: &RunData, warmup: u64) -> RunMetrics {
    let skip = (1 + warmup as usize).min(d.step_ns.len());
    let ns: u64 = d.step_ns[skip..].iter().sum();
    let tokens: usize = d.step_tokens[skip..].iter().sum();
    let secs = ns as f64 / 1e9;
    let steady_bytes: Option<u64> = d.step_bytes[skip..].iter().copied().sum();
    let bytes_read_per_token = if tokens > 0 && skip < d.step_bytes.len() {
        steady_bytes.map(|b| b as f64 / tokens as f64)
    } else {
        None
    }
    .or_else(|| {
        d.runtime_bytes_read
            .filter(|_| !d.emitted.is_empty())
            .map(|b| b as f64 / d.emitted.len() as f64)
    });
    RunMetrics {
        prefill_seconds: d.prefill_ns as f64 / 1e9,
        steady_steps: d.step_ns.len() - skip,
        steady_tokens: tokens,
        decode_tokens_per_second: (tokens > 0 && ns > 0).then(|| tokens as f64 / secs),
        decode_seconds_per_token: (tokens > 0).then(|| secs / tokens as f64),
        bytes_read_per_token,
        acceptance_rate: (d.proposed > 0).then(|| d.accepted as f64 / d.proposed as f64),
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics, table, plot

/// min / median / max of a sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub n: usize,
}

/// Spread of `v` (`None` when empty); the median of an even count is the mean of the middle
/// two.
pub fn spread(v: &[f64]) -> Option<Spread> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    Some(Spread {
        min: s[0],
        median,
        max: s[n - 1],
        n,
    })
}

fn spread_json(s: Option<Spread>) -> Value {
    match s {
        Some(s) => json!({"min": s.min, "median": s.median, "max": s.max, "n": s.n}),
        None => Value::Null,
    }
}

fn overlaps(a: Option<Spread>, b: Option<Spread>) -> Value {
    match (a, b) {
        (Some(a), Some(b)) => json!(a.min <= b.max && b.min <= a.max),
        _ => Value::Null,
    }
}

fn ratio(a: Option<Spread>, base: Option<Spread>) -> Value {
    match (a, base) {
        (Some(a), Some(b)) if b.median > 0.0 => json!(a.median / b.median),
        _ => Value::Null,
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// An SVG of per-token decode latency (ms, steps ≥ 1) per run, coloured by arm.
pub fn latency_svg(arms: &[Arm], series: &[(usize, Vec<f64>)]) -> String {
    let (w, h) = (900.0f64, 480.0f64);
    let (left, right, top, bottom) = (70.0, 190.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let max_steps = series.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let max_ms = series
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .fold(0.0f64, f64::max);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">deltafin benchmark: per-token decode latency (steps after the prefill)</text>"#,
        left + pw / 2.0
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
    );
    if max_steps == 0 || max_ms <= 0.0 {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">no decode steps to plot (every run emitted one token)</text>"#,
            left + pw / 2.0,
            top + ph / 2.0
        );
    } else {
        let y_max = max_ms * 1.1;
        let x_of = |i: usize| {
            if max_steps <= 1 {
                left + pw / 2.0
            } else {
                left + pw * i as f64 / (max_steps - 1) as f64
            }
        };
        let y_of = |ms: f64| top + ph * (1.0 - ms / y_max);
        for k in 0..=4 {
            let ms = y_max * k as f64 / 4.0;
            let y = y_of(ms);
            let _ = writeln!(
                svg,
                r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{ms:.3}</text>"##,
                left + pw,
                left - 6.0,
                y + 4.0
            );
        }
        for i in [0, max_steps - 1] {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                x_of(i),
                top + ph + 18.0,
                i + 1
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">decode step</text>"#,
            left + pw / 2.0,
            h - 10.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">latency (ms)</text>"#,
            top + ph / 2.0,
            top + ph / 2.0
        );
        for (arm, s) in series {
            if s.is_empty() {
                continue;
            }
            let pts: Vec<String> = s
                .iter()
                .enumerate()
                .map(|(i, &ms)| format!("{:.1},{:.1}", x_of(i), y_of(ms)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" stroke-opacity="0.8" points="{}"/>"#,
                PALETTE[arm % PALETTE.len()],
                pts.join(" ")
            );
        }
    }
    for (i, a) in arms.iter().enumerate() {
        let y = top + 14.0 + 20.0 * i as f64;
        let x = left + pw + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            PALETTE[i % PALETTE.len()],
            x + 30.0,
            y + 4.0,
            xml_escape(&a.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

// ---------------------------------------------------------------------------------------------
// Running one child

/// Copy up to `cap` bytes of `src` to `path`, counting the rest: (total bytes, truncated).
fn capture<R: Read + Send + 'static>(
    mut src: R,
    path: PathBuf,
    cap: u64,
) -> JoinHandle<std::io::Result<(u64, bool)>> {
    std::thread::spawn(move || {
        let mut f = File::create(&path)?;
        let mut buf = vec![0u8; 64 << 10];
        let mut total = 0u64;
        loop {
            let n = src.read(&mut buf)?;
            if n == 0 {
                break;
            }
            if total < cap {
                let keep = (cap - total).min(n as u64) as usize;
                f.write_all(&buf[..keep])?;
            }
            total += n as u64;
        }
        Ok((total, total > cap))
    })
}

struct ChildOutcome {
    exit: Option<i32>,
    timed_out: bool,
    wall_seconds: f64,
    stdout: (u64, bool),
    stderr: (u64, bool),
}

fn run_child(
    runner: &Path,
    args: &[String],
    env: &[(String, String)],
    dir: &Path,
    timeout: f64,
) -> Result<ChildOutcome> {
    let mut cmd = Command::new(runner);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", runner.display()))?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("the child's stdout was not captured"))?;
    let err = child
        .stderr
        .take()
        .ok_or_else(|| anyhow!("the child's stderr was not captured"))?;
    let out_t = capture(out, dir.join("stdout.txt"), STDOUT_CAP);
    let err_t = capture(err, dir.join("stderr.txt"), STDERR_CAP);
    let limit = Duration::from_secs_f64(timeout);
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child
            .try_wait()
            .context("cannot wait for a benchmark run")?
        {
            break st;
        }
        if t.elapsed() > limit {
            timed_out = true;
            let _ = child.kill();
            break child.wait().context("cannot reap a killed benchmark run")?;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let wall_seconds = t.elapsed().as_secs_f64();
    let join = |h: JoinHandle<std::io::Result<(u64, bool)>>, what: &str| -> Result<(u64, bool)> {
        h.join()
            .map_err(|_| anyhow!("the {what} capture thread panicked"))?
            .with_context(|| format!("cannot capture the run's {what}"))
    };
    Ok(ChildOutcome {
        exit: status.code(),
        timed_out,
        wall_seconds,
        stdout: join(out_t, "stdout")?,
        stderr: join(err_t, "stderr")?,
    })
}

// ---------------------------------------------------------------------------------------------
// Campaign

/// UTC `YYYYMMDD-HHMMSS` for `secs` since the Unix epoch.
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn is_secret_name(k: &str) -> bool {
    let u = k.to_ascii_uppercase();
    [
        "TOKEN",
        "SECRET",
        "PASSWORD",
        "PASSWD",
        "KEY",
        "AUTH",
        "CREDENTIAL",
        "COOKIE",
    ]
    .iter()
    .any(|s| u.contains(s))
}

fn redacted(k: &str, v: &str) -> Value {
    if is_secret_name(k) {
        json!("<redacted>")
    } else {
        json!(v)
    }
}

/// Performance-relevant environment variables of this process, secrets redacted.
fn perf_environment() -> Value {
    let mut m = Map::new();
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| {
            ["K3_", "DELTAFIN_", "RAYON_", "OMP_", "MKL_", "CUDA_", "HF_"]
                .iter()
                .any(|p| k.starts_with(p))
        })
        .collect();
    vars.sort();
    for (k, v) in vars {
        let val = redacted(&k, &v);
        m.insert(k, val);
    }
    Value::Object(m)
}

fn system_state() -> Value {
    let mem = crate::doctor::meminfo();
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.trim().to_string());
    json!({
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "logical_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "mem_total_bytes": mem.map(|m| m.total),
        "mem_available_bytes": mem.map(|m| m.available),
        "loadavg": loadavg,
        "kernel_backend": deltafin_kernels::kernel_backend(),
        "build_profile": buildinfo::PROFILE,
        "build_target": buildinfo::TARGET,
        "build_features": buildinfo::features(),
    })
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Create the evidence directory: a given path must be new or empty.
fn create_evidence_dir(given: Option<&Path>) -> Result<PathBuf> {
    match given {
        Some(p) => {
            if p.exists() {
                let empty = p.is_dir()
                    && std::fs::read_dir(p)
                        .with_context(|| format!("cannot read {}", p.display()))?
                        .next()
                        .is_none();
                if !empty {
                    bail!(
                        "--output-dir {}: already exists and is not an empty directory; give a new path",
                        p.display()
                    );
                }
            } else {
                std::fs::create_dir_all(p)
                    .with_context(|| format!("cannot create {}", p.display()))?;
            }
            Ok(p.to_path_buf())
        }
        None => {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let base = PathBuf::from("bench-results");
            std::fs::create_dir_all(&base)
                .with_context(|| format!("cannot create {}", base.display()))?;
            let stamp = utc_stamp(secs);
            for attempt in 0..100u32 {
                let name = if attempt == 0 {
                    format!("native-{stamp}Z")
                } else {
                    format!("native-{stamp}Z-{attempt}")
                };
                let p = base.join(name);
                match std::fs::create_dir(&p) {
                    Ok(()) => return Ok(p),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot create {}", p.display()));
                    }
                }
            }
            bail!("cannot find a new directory name under bench-results/")
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum OracleCheck {
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
    fn as_str(self) -> &'static str {
        match self {
            OracleCheck::Reference => "reference",
            OracleCheck::Match => "match",
            OracleCheck::Mismatch => "mismatch",
            OracleCheck::Unchecked => "unchecked",
            OracleCheck::NotApplicable => "n/a",
        }
    }
}

struct RunRecord {
    index: usize,
    rep: u64,
    arm: usize,
    position: usize,
    dir: String,
    outcome: Option<ChildOutcome>,
    data: Option<RunData>,
    metrics: Option<RunMetrics>,
    invalid: Option<String>,
    oracle: OracleCheck,
}

#[derive(Clone, Debug)]
struct Oracle {
    source: &'static str,
    ids: Option<Vec<u32>>,
    text: Option<String>,
}

impl Oracle {
    /// `None` when `d` matches, else why not.
    fn check(&self, d: &RunData) -> Option<String> {
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
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

fn fmt_spread(s: Option<Spread>, digits: usize) -> String {
    match s {
        Some(s) => format!(
            "{:.d$} / {:.d$} / {:.d$}",
            s.min,
            s.median,
            s.max,
            d = digits
        ),
        None => "-".into(),
    }
}

/// Per-arm spreads of the valid runs' figures.
#[derive(Clone, Copy)]
struct ArmStats {
    prefill: Option<Spread>,
    tps: Option<Spread>,
    spt: Option<Spread>,
    bpt: Option<Spread>,
}

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
    if !args.model_root.join(CONFIG_FILE).is_file() {
        bail!(
            "no K3 model installed at {}: {CONFIG_FILE} is missing; pass --model-root PATH",
            args.model_root.display()
        );
    }
    let model_root = args
        .model_root
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", args.model_root.display()))?;
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

    let runs_dir = dir.join("runs");
    std::fs::create_dir_all(&runs_dir)
        .with_context(|| format!("cannot create {}", runs_dir.display()))?;
    let mut records: Vec<RunRecord> = Vec::new();
    let mut implicit: Option<Oracle> = None;
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
        let outcome = run_child(&runner, &child_args, &arms[arm].env, &run_dir, args.timeout)?;
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
                    let oracle = explicit.as_ref().or(implicit.as_ref());
                    match oracle {
                        Some(o) => match o.check(&d) {
                            None => rec.oracle = OracleCheck::Match,
                            Some(why) => {
                                rec.oracle = OracleCheck::Mismatch;
                                rec.invalid = Some(why);
                            }
                        },
                        None if arm == 0 => {
                            implicit = Some(Oracle {
                                source: "first valid run of the first arm",
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
        write_runs(&dir.join("runs.jsonl"), &records, &arms)?;
        if invalid && !args.keep_going {
            eprintln!(
                "[benchmark] stopping after an invalid run (pass --keep-going to continue past invalid runs)"
            );
            stopped = true;
            break;
        }
    }
    // Runs of later arms that ran before the first arm produced its oracle.
    if let Some(o) = &implicit {
        for r in records
            .iter_mut()
            .filter(|r| r.oracle == OracleCheck::Unchecked)
        {
            if let Some(d) = &r.data {
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
    write_runs(&dir.join("runs.jsonl"), &records, &arms)?;

    // Per-arm summary.
    let valid_runs = records.iter().filter(|r| r.invalid.is_none()).count();
    let all_runs_valid = !stopped && valid_runs == schedule.len();
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
    let oracle = explicit.as_ref().or(implicit.as_ref());
    let result = json!({
        "schema": RESULT_SCHEMA,
        "campaign": "campaign.json",
        "runs_file": "runs.jsonl",
        "plot": "latency.svg",
        "runs_scheduled": schedule.len(),
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
    std::fs::write(&svg_path, latency_svg(&arms, &series))
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
            schedule.len() - valid_runs,
            schedule.len()
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abba_alternates_the_order() {
        let s: Vec<usize> = abba_schedule(2, 4).iter().map(|x| x.1).collect();
        assert_eq!(s, vec![0, 1, 1, 0, 0, 1, 1, 0]);
        let s: Vec<usize> = abba_schedule(3, 2).iter().map(|x| x.1).collect();
        assert_eq!(s, vec![0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn env_deltas_are_strict() {
        assert_eq!(
            parse_env_delta(" A=1  B_2=x=y ").unwrap(),
            vec![("A".into(), "1".into()), ("B_2".into(), "x=y".into())]
        );
        assert!(parse_env_delta("").unwrap().is_empty());
        assert!(
            parse_env_delta("LD_PRELOAD=/x.so")
                .unwrap_err()
                .to_string()
                .contains("dynamic-loader")
        );
        assert!(parse_env_delta("DYLD_INSERT_LIBRARIES=x").is_err());
        assert!(
            parse_env_delta("A=1 A=2")
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        assert!(parse_env_delta("NOEQUALS").is_err());
        assert!(parse_env_delta("1A=2").is_err());
    }

    #[test]
    fn arms_and_names() {
        let a = parse_arms(&["a=X=1".into(), "b=".into()], &[], &[]).unwrap();
        assert_eq!(
            a[1],
            Arm {
                name: "b".into(),
                env: vec![]
            }
        );
        assert!(parse_arms(&["a=".into(), "a=X=1".into()], &[], &[]).is_err());
        assert!(parse_arms(&["noequals".into()], &[], &[]).is_err());
        let c = parse_arms(&[], &["X=1".into(), "X=2".into()], &[]).unwrap();
        assert_eq!(c[1].name, "config-2");
        assert!(parse_arms(&[], &["X=1".into()], &["p".into(), "q".into()]).is_err());
        assert_eq!(parse_arms(&[], &[], &[]).unwrap()[0].name, "defaults");
    }

    #[test]
    fn token_ids_parse_both_forms() {
        assert_eq!(parse_token_ids("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_token_ids(" 4, 5 ").unwrap(), vec![4, 5]);
        assert!(parse_token_ids("1,x").is_err());
        assert!(parse_token_ids("[-1]").is_err());
        assert!(parse_token_ids("").is_err());
    }

    #[test]
    fn spread_and_stamp() {
        let s = spread(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.n), (1.0, 2.5, 10.0, 4));
        assert!(spread(&[]).is_none());
        assert_eq!(utc_stamp(0), "19700101-000000");
        assert_eq!(utc_stamp(951_782_400 + 3661), "20000229-010101");
    }

    fn ev(event: &str, mono: u64, extra: Value) -> String {
        let mut o = json!({"schema": EVENT_SCHEMA, "event": event, "wall_time_ns": 1, "monotonic_ns": mono});
        if let (Value::Object(m), Value::Object(e)) = (&mut o, extra) {
            m.extend(e);
        }
        o.to_string()
    }

    fn step(i: u64, id: u32) -> String {
        ev(
            "decode_step",
            10 + i,
            json!({"step": i, "duration_ns": 1000 + i, "token_id": id, "emitted_token_ids": [id],
                   "proposal_candidate_count": 0, "proposed_token_count": 0,
                   "accepted_token_count": 0, "proposal_memory_rejected": false}),
        )
    }

    fn stream(steps: &[String], end_ids: &[u32]) -> String {
        let mut lines = vec![
            ev(
                "run_start",
                1,
                json!({"prompt": "p", "chat": false, "max_new": 2,
                "input_token_ids": [5, 6], "config": {}}),
            ),
            ev(
                "prefill_done",
                2,
                json!({"duration_ns": 500, "prompt_tokens": 2}),
            ),
        ];
        lines.extend_from_slice(steps);
        lines.push(ev(
            "run_end",
            99,
            json!({"status": "ok", "duration_ns": 9, "prompt_token_ids": [5, 6],
                   "emitted_token_ids": end_ids, "completion_token_ids": end_ids,
                   "stop_reason": "max_new", "completion_text": "ab",
                   "runtime": {"generated_tokens": end_ids.len()}}),
        ));
        lines.join("\n")
    }

    #[test]
    fn events_validation_accepts_a_good_stream_and_rejects_defects() {
        let good = stream(&[step(0, 7), step(1, 8)], &[7, 8]);
        let d = validate_events(&good, "p", false, 2).unwrap();
        assert_eq!(d.emitted, vec![7, 8]);
        let m = metrics(&d, 0);
        assert_eq!(m.steady_tokens, 1);
        assert!((m.decode_seconds_per_token.unwrap() - 1001e-9).abs() < 1e-15);
        assert!(m.bytes_read_per_token.is_none());

        let gap = stream(&[step(0, 7), step(2, 8)], &[7, 8]);
        assert!(
            validate_events(&gap, "p", false, 2)
                .unwrap_err()
                .contains("contiguous")
        );
        let count = stream(&[step(0, 7), step(1, 8)], &[7, 9]);
        assert!(
            validate_events(&count, "p", false, 2)
                .unwrap_err()
                .contains("differ")
        );
        let short = stream(&[step(0, 7)], &[7]);
        assert!(
            validate_events(&short, "p", false, 2)
                .unwrap_err()
                .contains("max_new")
        );
        let truncated: String = good.lines().take(3).collect::<Vec<_>>().join("\n");
        assert!(
            validate_events(&truncated, "p", false, 2)
                .unwrap_err()
                .contains("before run_end")
        );
        assert!(
            validate_events(&good, "q", false, 2)
                .unwrap_err()
                .contains("prompt")
        );
        assert!(validate_events(&good, "p", true, 2).is_err());
    }

    #[test]
    fn svg_has_one_polyline_per_series() {
        let arms = parse_arms(&["a=".into(), "b<&>=".into()], &[], &[]);
        assert!(arms.is_err());
        let arms = parse_arms(&["a=".into(), "b=".into()], &[], &[]).unwrap();
        let svg = latency_svg(&arms, &[(0, vec![1.0, 2.0]), (1, vec![1.5, 1.0])]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.ends_with("</svg>\n"));
        let empty = latency_svg(&arms, &[]);
        assert!(empty.contains("no decode steps"));
    }
}
