//! `deltafin run`: prefill one prompt, decode greedily, stream the text (or live stats), and
//! optionally write the run events file.

use crate::RunArgs;
use crate::events::EventWriter;
use crate::session::{self, Session};
use anyhow::{Context, Result, anyhow, bail};
use deltafin_k3::chat::{self, ChatMessage, ChatOptions, ReasoningEffort};
use deltafin_k3::generate::{GenerateEvent, GenerateOptions, LogitSummary, StopReason, generate};
use deltafin_k3::tokenizer::{END_OF_MSG, EOS, StreamDecoder};
use deltafin_spec::dspark::{DraftMode, DsparkDrafter, DsparkModel, SpecConfig};
use deltafin_spec::{Committed, generate_speculative_streaming};
use serde_json::{Value, json};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

/// Effort from the flag, else `K3_REASONING_EFFORT`, else the template default (max). Both
/// sources are parsed strictly, even without --chat.
fn resolve_effort(flag: Option<&str>) -> Result<(ReasoningEffort, &'static str)> {
    let env = session::env_var("K3_REASONING_EFFORT")?;
    let from_env = env
        .as_deref()
        .map(|v| {
            ReasoningEffort::from_str(v)
                .map_err(|e| anyhow!("environment variable K3_REASONING_EFFORT: {e}"))
        })
        .transpose()?;
    if let Some(f) = flag {
        let e = ReasoningEffort::from_str(f).map_err(|e| anyhow!("--reasoning-effort: {e}"))?;
        return Ok((e, "flag"));
    }
    Ok(match from_env {
        Some(e) => (e, "env"),
        None => (ReasoningEffort::Max, "default"),
    })
}

fn summary_json(s: &LogitSummary) -> (Value, Value) {
    let top: Vec<Value> = s.top.iter().map(|&(id, l)| json!([id, l])).collect();
    (Value::Array(top), json!(s.logsumexp))
}

pub fn run(args: &RunArgs) -> Result<ExitCode> {
    let (effort, effort_source) = resolve_effort(args.reasoning_effort.as_deref())?;
    if args.top_logits.is_some() && args.events_jsonl.is_none() {
        bail!("--top-logits adds fields to the events file: it needs --events-jsonl PATH");
    }
    let spec = SpecConfig::from_env().map_err(|e| anyhow!("{e}"))?;
    let speculate = spec.dspark == DraftMode::On;
    if speculate && args.top_logits.is_some() {
        bail!(
            "--top-logits is not available with speculative decoding (K3_DSPARK=on): run without it to see each distribution"
        );
    }
    let mut events = args
        .events_jsonl
        .as_deref()
        .map(EventWriter::create)
        .transpose()?;
    let load_opts = args.model.load_options()?;
    let interrupt = session::interrupt_flag();
    let started = Instant::now();

    let Session {
        mut model,
        tokenizer,
        load_seconds,
        checkpoint,
        memory,
        spine,
    } = session::load_with(&args.model.model_root, &load_opts)?;
    session::report_memory_plan(&model, memory.as_ref());
    if let Some(p) = &args.router_trace {
        let path = args.model.model_root.join(p);
        let inner = std::mem::replace(
            &mut model.experts,
            Box::new(deltafin_k3::moe::InMemoryExperts::default()),
        );
        let trace = deltafin_experts::RouterTrace::create(&path, inner)
            .with_context(|| format!("--router-trace: cannot open {}", path.display()))?;
        model.experts = Box::new(trace);
    }

    let prompt_ids = if args.chat {
        let opts = ChatOptions {
            effort: Some(effort),
            ..Default::default()
        };
        chat::encode_chat(&tokenizer, &[ChatMessage::new("user", &args.prompt)], &opts)
            .context("cannot render the chat prompt")?
    } else {
        tokenizer.encode_ordinary(&args.prompt)
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens; give a non-empty --prompt");
    }
    // Chat turns end with <|end_of_msg|>; raw completions also stop at [EOS], the end of a
    // pretraining document (product contract §2).
    let stop_ids = if args.chat {
        vec![END_OF_MSG]
    } else {
        vec![END_OF_MSG, EOS]
    };
    let max_context = checkpoint.config().text.max_position_embeddings;
    let top_n = args.top_logits.map(usize::from).unwrap_or(0);
    let opts = GenerateOptions {
        max_new: args.max_new,
        stop_ids,
        max_context,
        top_logits: top_n,
    };
    let surface = if args.chat { "chat" } else { "raw" };
    let effort_text = if args.chat {
        format!("{effort} ({effort_source})")
    } else {
        "n/a".to_string()
    };
    let max_new_text = args
        .max_new
        .map(|m| m.to_string())
        .unwrap_or_else(|| "none".into());
    eprintln!(
        "[deltafin] surface={surface} {} spine={} model_root={} prompt_tokens={} reasoning_effort={effort_text} max_new={max_new_text} top_logits={top_n} dspark={} load={load_seconds:.2}s",
        session::backend_description(),
        spine.as_str(),
        args.model.model_root.display(),
        prompt_ids.len(),
        match spec.dspark {
            DraftMode::On => format!(
                "on (depth {})",
                spec.depth.min(deltafin_spec::dspark::BLOCK)
            ),
            DraftMode::Off => "off".to_string(),
            DraftMode::Auto =>
                "auto (inactive: the speed probe is not implemented yet; K3_DSPARK=on drafts)"
                    .to_string(),
        },
    );
    if speculate {
        return run_speculative(
            args,
            &model,
            &tokenizer,
            &prompt_ids,
            &opts,
            &spec,
            events.as_mut(),
            &interrupt,
            started,
        );
    }
    let config = json!({
        "surface": surface,
        "model_root": args.model.model_root.display().to_string(),
        "reasoning_effort": if args.chat { json!(effort.to_string()) } else { Value::Null },
        "max_new": args.max_new,
        "top_logits": top_n,
        "spine": "bf16",
        "backend": session::backend_description(),
    });

    let stdout = std::io::stdout();
    let live_stats = args.stats && stdout.is_terminal();
    let mut out = stdout;
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let mut emitted: Vec<u32> = Vec::new();
    let gen_start = Instant::now();
    let mut sink_error: Option<anyhow::Error> = None;

    // Run the whole generation on a pool worker: the kernels' parallel loops then start by
    // work-stealing from this thread instead of waking the pool from outside for every
    // matrix product.
    let result = rayon::scope(|_| {
        generate(&model, &prompt_ids, &opts, &interrupt, |ev| {
            let r: Result<()> = (|| {
                match ev {
                    GenerateEvent::Prefilled { duration, summary } => {
                        if let Some(w) = events.as_mut() {
                            let mut start = json!({
                                "prompt": args.prompt,
                                "chat": args.chat,
                                "max_new": args.max_new,
                                "input_token_ids": prompt_ids,
                                "prompt_token_ids": prompt_ids,
                                "config": config,
                            });
                            if let Some(s) = summary {
                                let (top, lse) = summary_json(s);
                                start["last_prompt_top_logits"] = top;
                                start["last_prompt_logsumexp"] = lse;
                            }
                            w.emit("run_start", start)?;
                            w.emit(
                            "prefill_done",
                            json!({"duration_ns": duration.as_nanos() as u64, "prompt_tokens": prompt_ids.len()}),
                        )?;
                        }
                    }
                    GenerateEvent::Token {
                        step,
                        id,
                        duration,
                        summary,
                    } => {
                        emitted.push(id);
                        let piece = decoder
                            .push(&tokenizer, id)
                            .map_err(|e| anyhow!("cannot decode token {id}: {e}"))?;
                        text.push_str(&piece);
                        if args.stats {
                            let elapsed = gen_start.elapsed().as_secs_f64();
                            let n = emitted.len();
                            let line = format!(
                                "[stats] generated={n} elapsed={elapsed:.2}s speed={:.3} token/s ({:.3} s/token)",
                                n as f64 / elapsed.max(1e-9),
                                elapsed / n as f64
                            );
                            if live_stats {
                                write!(out, "\r{line}")?;
                            } else {
                                writeln!(out, "{line}")?;
                            }
                        } else {
                            write!(out, "{piece}")?;
                        }
                        out.flush()?;
                        if let Some(w) = events.as_mut() {
                            let mut step_ev = json!({
                                "step": step,
                                "duration_ns": duration.as_nanos() as u64,
                                "token_id": id,
                                "text": piece,
                                "emitted_token_ids": [id],
                                "proposal_candidate_count": 0,
                                "proposed_token_count": 0,
                                "accepted_token_count": 0,
                                "proposal_memory_rejected": false,
                            });
                            if let Some(s) = summary {
                                let (top, lse) = summary_json(s);
                                step_ev["top_logits"] = top;
                                step_ev["logsumexp"] = lse;
                            }
                            w.emit("decode_step", step_ev)?;
                        }
                    }
                }
                Ok(())
            })();
            r.map_err(|e| {
                let msg = format!("{e:#}");
                sink_error = Some(e);
                msg
            })
        })
    });

    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            let err = sink_error.take().unwrap_or_else(|| anyhow!(e));
            if let Some(w) = events.as_mut() {
                let _ = w.emit(
                    "run_error",
                    json!({
                        "phase": if emitted.is_empty() { "prefill" } else { "decode" },
                        "error_type": "generation",
                        "message": format!("{err:#}"),
                        "duration_ns": started.elapsed().as_nanos() as u64,
                    }),
                );
            }
            return Err(err);
        }
    };
    let tail = decoder.finish();
    text.push_str(&tail);
    if args.stats {
        if live_stats {
            writeln!(out)?;
        }
    } else {
        write!(out, "{tail}")?;
        writeln!(out)?;
    }
    out.flush()?;
    let completion: Vec<u32> = match outcome.stop {
        StopReason::Eos => outcome.ids[..outcome.ids.len().saturating_sub(1)].to_vec(),
        _ => outcome.ids.clone(),
    };
    let decode_steps = outcome.ids.len().saturating_sub(1);
    let decode_seconds = (outcome.total_duration - outcome.prefill_duration).as_secs_f64();
    eprintln!(
        "[deltafin] stop={} generated={} prefill={:.3}s ({:.1} token/s) decode={:.3} token/s",
        outcome.stop.as_str(),
        outcome.ids.len(),
        outcome.prefill_duration.as_secs_f64(),
        prompt_ids.len() as f64 / outcome.prefill_duration.as_secs_f64().max(1e-9),
        if decode_steps > 0 {
            decode_steps as f64 / decode_seconds.max(1e-9)
        } else {
            0.0
        }
    );
    if args.stats {
        session::report_expert_stats(&model);
    }
    if let Some(w) = events.as_mut() {
        w.emit(
            "run_end",
            json!({
                "status": if outcome.stop == StopReason::Interrupted { "interrupted" } else { "ok" },
                "duration_ns": started.elapsed().as_nanos() as u64,
                "prompt_token_ids": prompt_ids,
                "emitted_token_ids": outcome.ids,
                "completion_token_ids": completion,
                "stop_reason": outcome.stop.as_str(),
                "completion_text": text,
                "runtime": {
                    "backend": session::backend_description(),
                    "load_seconds": load_seconds,
                    "prefill_ns": outcome.prefill_duration.as_nanos() as u64,
                    "generated_tokens": outcome.ids.len(),
                },
            }),
        )?;
    }
    Ok(if outcome.stop == StopReason::Interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}

/// `deltafin run` with DSpark drafts (`K3_DSPARK=on`): K3 verifies every draft, so the ids
/// equal plain greedy decoding; each committed step writes one `decode_step` with the
/// proposal counts.
#[allow(clippy::too_many_arguments)]
fn run_speculative(
    args: &RunArgs,
    model: &deltafin_k3::model::K3Model,
    tokenizer: &deltafin_k3::tokenizer::Tokenizer,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    spec: &SpecConfig,
    mut events: Option<&mut EventWriter>,
    interrupt: &std::sync::atomic::AtomicBool,
    started: Instant,
) -> Result<ExitCode> {
    let dir = args.model.model_root.join("k3-draft-dspark");
    if !dir.join("config.json").is_file() {
        bail!(
            "K3_DSPARK=on but no DSpark checkpoint at {}: run `deltafin setup-dspark --destination {}` or set K3_DSPARK=off",
            dir.display(),
            dir.display()
        );
    }
    let dspark = Arc::new(
        DsparkModel::open(&dir)
            .with_context(|| format!("cannot load the DSpark drafter from {}", dir.display()))?,
    );
    let mut drafter = DsparkDrafter::new(dspark, model, spec.dspark_max_context)
        .map_err(|e| anyhow!("DSpark does not fit this K3: {e}"))?;
    if prompt_ids.len() >= opts.max_context {
        bail!(
            "prompt of {} tokens does not fit the context of {} positions",
            prompt_ids.len(),
            opts.max_context
        );
    }
    let room = opts.max_context - prompt_ids.len();
    let max_new = opts.max_new.unwrap_or(room).min(room);
    let width = spec.depth.min(deltafin_spec::dspark::BLOCK);
    if let Some(w) = events.as_deref_mut() {
        w.emit(
            "run_start",
            json!({
                "prompt": args.prompt,
                "chat": args.chat,
                "max_new": args.max_new,
                "input_token_ids": prompt_ids,
                "prompt_token_ids": prompt_ids,
                "config": {"surface": if args.chat { "chat" } else { "raw" }, "dspark": "on", "depth": width},
            }),
        )?;
    }
    let stdout = std::io::stdout();
    let live_stats = args.stats && stdout.is_terminal();
    let mut out = stdout.lock();
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let mut step = 0usize;
    let (mut proposed, mut accepted, mut emitted) = (0usize, 0usize, 0usize);
    let gen_start = Instant::now();
    let result = generate_speculative_streaming(
        model,
        prompt_ids,
        max_new,
        &opts.stop_ids,
        width,
        &mut drafter,
        interrupt,
        |c: &Committed<'_>| {
            let r: Result<()> = (|| {
                let mut piece = String::new();
                for &id in c.ids {
                    piece.push_str(
                        &decoder
                            .push(tokenizer, id)
                            .map_err(|e| anyhow!("cannot decode token {id}: {e}"))?,
                    );
                }
                text.push_str(&piece);
                proposed += c.proposed;
                accepted += c.accepted;
                emitted += c.ids.len();
                if args.stats {
                    let elapsed = gen_start.elapsed().as_secs_f64();
                    let line = format!(
                        "[stats] generated={emitted} elapsed={elapsed:.2}s speed={:.3} token/s ({:.3} s/token) drafts={accepted}/{proposed} verify_passes={step}",
                        emitted as f64 / elapsed.max(1e-9),
                        elapsed / emitted.max(1) as f64
                    );
                    if live_stats {
                        write!(out, "\r{line}")?;
                    } else {
                        writeln!(out, "{line}")?;
                    }
                } else {
                    write!(out, "{piece}")?;
                }
                out.flush()?;
                if let Some(w) = events.as_deref_mut() {
                    w.emit(
                        "decode_step",
                        json!({
                            "step": step,
                            "duration_ns": c.duration.as_nanos() as u64,
                            "token_id": c.ids.last(),
                            "text": piece,
                            "emitted_token_ids": c.ids,
                            "proposal_candidate_count": usize::from(c.proposed > 0),
                            "proposed_token_count": c.proposed,
                            "accepted_token_count": c.accepted,
                            "proposal_memory_rejected": false,
                        }),
                    )?;
                }
                step += 1;
                Ok(())
            })();
            r.map_err(|e| format!("{e:#}"))
        },
    );
    let (ids, _stats) = match result {
        Ok(v) => v,
        Err(e) => {
            if let Some(w) = events.as_deref_mut() {
                let _ = w.emit(
                    "run_error",
                    json!({"phase": "decode", "error_type": "generation", "message": e.to_string(),
                           "duration_ns": started.elapsed().as_nanos() as u64}),
                );
            }
            bail!("{e}");
        }
    };
    let tail = decoder.finish();
    text.push_str(&tail);
    if args.stats {
        if live_stats {
            writeln!(out)?;
        }
    } else {
        writeln!(out, "{tail}")?;
    }
    out.flush()?;
    let stop = if ids.last().is_some_and(|t| opts.stop_ids.contains(t)) {
        StopReason::Eos
    } else if ids.len() >= max_new {
        if max_new == room && opts.max_new.is_none_or(|m| m > room) {
            StopReason::ContextFull
        } else {
            StopReason::MaxNew
        }
    } else {
        StopReason::Interrupted
    };
    let completion: Vec<u32> = match stop {
        StopReason::Eos => ids[..ids.len() - 1].to_vec(),
        _ => ids.clone(),
    };
    eprintln!(
        "[deltafin] stop={} generated={} drafts accepted {accepted}/{proposed} in {step} passes ({:.2} tokens per pass)",
        stop.as_str(),
        ids.len(),
        ids.len() as f64 / step.max(1) as f64
    );
    if let Some(w) = events {
        w.emit(
            "run_end",
            json!({
                "status": if stop == StopReason::Interrupted { "interrupted" } else { "ok" },
                "duration_ns": started.elapsed().as_nanos() as u64,
                "prompt_token_ids": prompt_ids,
                "emitted_token_ids": ids,
                "completion_token_ids": completion,
                "stop_reason": stop.as_str(),
                "completion_text": text,
                "runtime": {"backend": session::backend_description(), "dspark": {"proposed": proposed, "accepted": accepted, "passes": step}},
            }),
        )?;
    }
    Ok(if stop == StopReason::Interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}
