//! Strict validation of a run's events stream, and the steady-state figures it gives.

use serde_json::{Map, Value};

/// The events schema the benchmark reads.
pub const EVENT_SCHEMA: &str = "deltafin.run_event.v1";

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
