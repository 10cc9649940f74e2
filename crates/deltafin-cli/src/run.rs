//! `deltafin run`: prefill one prompt, decode it (greedily, or by K3's seeded sampling with
//! `--temperature`), stream the text (or live stats), and optionally write the run events
//! file and the per-layer profile.

use crate::RunArgs;
use crate::events::EventWriter;
use crate::prefill_bar::PrefillBar;
use crate::session;
use anyhow::{Context, Result, anyhow, bail};
use deltafin_k3::engine::{EngineConfig, LoadedEngine};
use deltafin_k3::generate::{Choose, Greedy, LogitSummary, StopReason};
use deltafin_k3::prefix::PrefillProgress;
use deltafin_k3::sampling::{Sampler, Sampling, fresh_seed};
use deltafin_k3::text::chat::{self, ChatMessage, ReasoningEffort, Thinking};
use deltafin_k3::text::tokenizer::StreamDecoder;
use deltafin_spec::dspark::{DraftMode, SpecConfig};
use deltafin_spec::select::{DraftModels, Surfaces};
use deltafin_spec::{Event, Generation, PolicyMode, PolicyReport};
use serde_json::{Value, json};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Thinking from `--no-thinking` or `--reasoning-effort` (clap refuses both at once), else
/// `K3_REASONING_EFFORT`, else thinking at the template default (max). The variable is
/// parsed strictly even when a flag wins or without --chat.
fn resolve_thinking(args: &RunArgs) -> Result<(Thinking, &'static str)> {
    let from_env = crate::env::env_thinking()?;
    if args.no_thinking {
        return Ok((Thinking::Off, "flag"));
    }
    if let Some(f) = args.reasoning_effort.as_deref() {
        let t = Thinking::parse(f).map_err(|e| anyhow!("--reasoning-effort: {e}"))?;
        return Ok((t, "flag"));
    }
    Ok(match from_env {
        Some(t) => (t, "env"),
        None => (Thinking::On(ReasoningEffort::Max), "default"),
    })
}

/// Sampling from the flags, else their `K3_*` variables (docs/CLI.md "Sampling"); `None`
/// (greedy) without a temperature or at 0. Every variable is parsed strictly.
fn resolve_sampling(args: &RunArgs) -> Result<Option<Sampling>> {
    fn pick<T: std::str::FromStr>(flag: Option<T>, var: &str) -> Result<Option<T>> {
        let env = crate::env::env_var(var)?
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|_| anyhow!("environment variable {var}: {v:?} is not a number"))
            })
            .transpose()?;
        Ok(flag.or(env))
    }
    let temperature = pick(args.temperature, "K3_TEMPERATURE")?.unwrap_or(0.0);
    let top_p = pick(args.top_p, "K3_TOP_P")?.unwrap_or(1.0);
    let top_k = pick(args.top_k, "K3_TOP_K")?.unwrap_or(0);
    let min_p = pick(args.min_p, "K3_MIN_P")?.unwrap_or(0.0);
    let seed = pick(args.seed, "K3_SEED")?;
    if !(0.0..=2.0).contains(&temperature) {
        bail!("--temperature {temperature} must be in 0..=2 (0: greedy)");
    }
    if temperature == 0.0 {
        return Ok(None);
    }
    Sampling::new(
        temperature,
        top_k,
        top_p,
        min_p,
        seed.unwrap_or_else(fresh_seed),
    )
    .map(Some)
    .map_err(|e| anyhow!("sampling: {e}"))
}

/// Add `summary`'s largest logits and log-sum-exp (`--top-logits`) to `event` under
/// `top_key` and `lse_key`.
fn add_summary(event: &mut Value, summary: Option<&LogitSummary>, top_key: &str, lse_key: &str) {
    if let Some(s) = summary {
        let top: Vec<Value> = s.top.iter().map(|&(id, l)| json!([id, l])).collect();
        event[top_key] = Value::Array(top);
        event[lse_key] = json!(s.logsumexp);
    }
}

/// `--layer-profile`: one stderr line per layer of every forward pass,
/// `[phase layer N/L] pass=P rows=R kda+moe total_ms=… weights_ms=… mix_ms=… attention_ms=…
/// ffn_ms=…` (`L` the last layer's index, so `N/L` runs 0/92 … 92/92 on K3; `P` counts the
/// passes from 1).
fn layer_profile_lines() -> deltafin_k3::model::profile::LayerProfile {
    let pass = std::sync::atomic::AtomicU64::new(0);
    Box::new(move |p: &deltafin_k3::model::profile::LayerPhases| {
        use std::sync::atomic::Ordering;
        if p.layer == 0 {
            pass.fetch_add(1, Ordering::Relaxed);
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "[phase layer {}/{}] pass={} rows={} {}+{} total_ms={:.3} weights_ms={:.3} mix_ms={:.3} attention_ms={:.3} ffn_ms={:.3}",
            p.layer,
            p.layers.saturating_sub(1),
            pass.load(Ordering::Relaxed),
            p.rows,
            p.attention,
            p.ffn,
            ms(p.total()),
            ms(p.weights),
            ms(p.mix),
            ms(p.attention_time),
            ms(p.ffn_time),
        );
    })
}

/// Context tokens reserved beyond the prompt and `--max-new`: a speculative verification
/// window holds drafted tokens in the state before they are accepted or rolled back.
const VERIFY_SLACK_TOKENS: usize = 32;

/// The engine configuration `deltafin run` loads with: the model flags and their variables,
/// the router trace, and with `--max-new` the context bound (the prompt's bound plus
/// `max_new` plus a speculative verification window), so the memory budget reserves state
/// for that instead of `CONTEXT_RESERVE_TOKENS` and gives the rest to the spine and the
/// expert cache.
pub fn engine_config(args: &RunArgs, thinking: Thinking) -> Result<EngineConfig> {
    let mut config = crate::engine_config::engine_config(&args.model, None, None)?;
    if let Some(max_new) = args.max_new {
        let prompt_bound = if args.chat {
            let chat_opts = thinking.chat_options();
            chat::token_bound(
                &chat::render_segments(&[ChatMessage::new("user", &args.prompt)], &chat_opts)
                    .context("cannot render the chat prompt")?,
            )
        } else {
            args.prompt.len()
        };
        config.context_tokens = Some(prompt_bound + max_new + VERIFY_SLACK_TOKENS);
    }
    config.router_trace = crate::engine_config::resolve_router_trace(
        args.router_trace.as_deref(),
        args.router_trace_mode.as_deref(),
        &args.model.root(),
    )?;
    Ok(config)
}

pub fn run(args: &RunArgs) -> Result<ExitCode> {
    let (thinking, thinking_source) = resolve_thinking(args)?;
    let sampling = resolve_sampling(args)?;
    if args.top_logits.is_some() && args.events_jsonl.is_none() {
        bail!("--top-logits adds fields to the events file: it needs --events-jsonl PATH");
    }
    let spec = crate::env::spec_config()?;
    if args.top_logits.is_some() {
        if spec.dspark == DraftMode::On {
            bail!(
                "--top-logits is not available with speculative decoding (K3_DSPARK=on): run without it to see each distribution"
            );
        }
        if !args.chat && spec.uag == DraftMode::On {
            bail!(
                "--top-logits is not available with speculative decoding (K3_UAG_DRAFT=on): run without it to see each distribution"
            );
        }
    }
    let mut events = args
        .events_jsonl
        .as_deref()
        .map(EventWriter::create)
        .transpose()?;
    let config = engine_config(args, thinking)?;
    let root = args.model.root();
    let interrupt = session::interrupt_flag();
    let started = Instant::now();

    // The read probe `--stats` compares the load with, before the load (docs/PERFORMANCE.md,
    // "Loading").
    let probe = if args.stats {
        session::load_probe(&root)
    } else {
        None
    };
    let states = crate::engine_config::state_cache_settings(&args.model)?;
    let loaded = session::load(&root, &config)?;
    let cache = session::state_cache(&loaded, &states);
    // The admitted context, as the server admits it: the model's, capped by what the memory
    // budget reserved state for (or, without a budget, by the memory available now).
    let max_context = loaded.admitted_context();
    let LoadedEngine {
        mut model,
        tokenizer,
        load_seconds,
        plan: memory,
        spine,
        resident_copies,
        ..
    } = loaded;
    if args.stats {
        session::report_load(load_seconds, &resident_copies, probe.as_ref());
    }
    if args.layer_profile {
        model.layer_profile = Some(layer_profile_lines());
    }
    let tokenizer = Arc::new(tokenizer);
    // Drafters: none when --top-logits asks for every distribution (auto modes yield).
    let surfaces = Surfaces {
        chat: args.chat,
        raw: !args.chat,
    };
    let drafts = if args.top_logits.is_some() {
        let off = SpecConfig {
            dspark: DraftMode::Off,
            uag: DraftMode::Off,
            ..spec.clone()
        };
        DraftModels::load(&root, &off, surfaces, &model)
    } else {
        DraftModels::load(&root, &spec, surfaces, &model)
    }
    .map_err(|e| anyhow!("{e}"))?;
    session::report_memory_plan(&model, memory.as_ref());

    // Without thinking the generation prompt opens `response`: the text printed is the
    // answer, then the closing markers the model writes.
    let chat_opts = thinking.chat_options();
    let chat_messages = [ChatMessage::new("user", &args.prompt)];
    let prompt_ids = if args.chat {
        chat::encode_chat(&tokenizer, &chat_messages, &chat_opts)
            .context("cannot render the chat prompt")?
    } else {
        tokenizer.encode_ordinary(&args.prompt)
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens; give a non-empty --prompt");
    }
    if let Some(plan) = &memory
        && let Some(max_new) = args.max_new
        && prompt_ids.len() + max_new + VERIFY_SLACK_TOKENS > plan.context_tokens
    {
        bail!(
            "internal: the memory budget reserved state for {} tokens, but the prompt ({} tokens) plus --max-new {max_new} needs more",
            plan.context_tokens,
            prompt_ids.len()
        );
    }
    let top_n = args.top_logits.map(usize::from).unwrap_or(0);
    let surface = if args.chat { "chat" } else { "raw" };
    let effort_text = if args.chat {
        format!("{thinking} ({thinking_source})")
    } else {
        "n/a".to_string()
    };
    let max_new_text = args
        .max_new
        .map(|m| m.to_string())
        .unwrap_or_else(|| "none".into());
    let chosen = drafts
        .choose(&model, &tokenizer, args.chat)
        .map_err(|e| anyhow!("{e}"))?;
    eprintln!(
        "[deltafin] surface={surface} {} spine={} model_root={} prompt_tokens={} reasoning_effort={effort_text} max_new={max_new_text} top_logits={top_n} {} drafter={} {} load={load_seconds:.2}s",
        session::backend_description(),
        spine.as_str(),
        root.display(),
        prompt_ids.len(),
        drafts.describe(),
        chosen.as_ref().map_or("none", |c| c.name),
        sampling_text(sampling.as_ref()),
    );
    // The prefill: aligned passes resumed from a stored prefix state (docs/CLI.md
    // `--state-cache`), stopped by Ctrl-C, shown by a progress bar on a terminal.
    let mut bar = PrefillBar::new();
    let mut show = |p: PrefillProgress| bar.update(p);
    // The drafter, if any: its name and policy mode for the events and the summary line.
    let mut chosen = chosen;
    let drafting = chosen.as_ref().map(|c| {
        let mode = match c.policy.report().mode {
            PolicyMode::On => "on",
            PolicyMode::Auto => "auto",
            PolicyMode::Fixed => "fixed",
        };
        (c.name, mode)
    });
    let config = match drafting {
        None => json!({
            "surface": surface,
            "model_root": root.display().to_string(),
            "reasoning_effort": if args.chat { json!(thinking.to_string()) } else { Value::Null },
            "thinking": if args.chat { json!(thinking.is_on()) } else { Value::Null },
            "max_new": args.max_new,
            "top_logits": top_n,
            "sampling": sampling_json(sampling.as_ref()),
            "spine": spine.as_str(),
            "backend": session::backend_description(),
        }),
        Some((name, mode)) => json!({
            "surface": surface,
            "drafter": name,
            "draft_mode": mode,
            "spine": spine.as_str(),
            "sampling": sampling_json(sampling.as_ref()),
            "backend": session::backend_description(),
        }),
    };

    let stdout = std::io::stdout();
    let live_stats = args.stats && stdout.is_terminal();
    let mut out = stdout;
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let mut step = 0usize;
    let (mut proposed, mut accepted, mut emitted, mut drafting_passes) = (0, 0, 0, 0);
    let mut last_policy: Option<PolicyReport> = None;
    let mut prefill_ns = 0u64;
    let gen_start = Instant::now();
    let mut sink_error: Option<anyhow::Error> = None;
    let mut sampler = sampling.map(Sampler);
    let rule: &mut (dyn Choose + Send) = match sampler.as_mut() {
        Some(s) => s,
        None => &mut Greedy,
    };

    // Run the whole generation on a pool worker: the kernels' parallel loops then start by
    // work-stealing from this thread instead of waking the pool from outside for every
    // matrix product.
    let result = deltafin_kernels::pool::run_warm(|| {
        let mut generation = Generation::new(&model, &prompt_ids)
            .chat(args.chat)
            .max_new(args.max_new)
            .max_context(max_context)
            .top_logits(top_n)
            .rule(rule)
            .prefix_cache(cache.as_ref())
            .progress(&mut show)
            .interrupt(&interrupt);
        if let Some(c) = chosen.as_mut() {
            generation = generation.drafter(c.drafter.as_mut(), &mut c.policy);
        }
        generation.run(|ev| {
            let r: Result<()> = (|| {
                match ev {
                    Event::Prefilled {
                        duration, summary, ..
                    } => {
                        prefill_ns = duration.as_nanos() as u64;
                        if let Some(w) = events.as_mut() {
                            let mut start = json!({
                                "prompt": args.prompt,
                                "chat": args.chat,
                                "max_new": args.max_new,
                                "input_token_ids": prompt_ids,
                                "prompt_token_ids": prompt_ids,
                                "config": config,
                            });
                            add_summary(
                                &mut start,
                                summary,
                                "last_prompt_top_logits",
                                "last_prompt_logsumexp",
                            );
                            w.emit("run_start", start)?;
                            w.emit(
                                "prefill_done",
                                json!({"duration_ns": prefill_ns, "prompt_tokens": prompt_ids.len()}),
                            )?;
                        }
                    }
                    Event::Committed(c) => {
                        let mut piece = String::new();
                        for &id in c.ids {
                            piece.push_str(
                                &decoder
                                    .push(&tokenizer, id)
                                    .map_err(|e| anyhow!("cannot decode token {id}: {e}"))?,
                            );
                        }
                        text.push_str(&piece);
                        proposed += c.proposed;
                        accepted += c.accepted;
                        drafting_passes += usize::from(c.proposed > 0);
                        emitted += c.ids.len();
                        last_policy = Some(c.policy);
                        if args.stats {
                            let elapsed = gen_start.elapsed().as_secs_f64();
                            let mut line = format!(
                                "[stats] generated={emitted} elapsed={elapsed:.2}s speed={:.3} token/s ({:.3} s/token)",
                                emitted as f64 / elapsed.max(1e-9),
                                elapsed / emitted.max(1) as f64,
                            );
                            if let Some((_, mode)) = drafting {
                                let p = &c.policy;
                                line += &format!(
                                    " drafts={accepted}/{proposed} mean_accepted={:.2} verify_passes={step} policy={mode}:{} width={} speedup={}",
                                    accepted as f64 / drafting_passes.max(1) as f64,
                                    p.state.as_str(),
                                    p.width,
                                    percent(p.speedup),
                                );
                            }
                            write_stats_line(&mut out, live_stats, &line)?;
                        } else {
                            write!(out, "{piece}")?;
                        }
                        out.flush()?;
                        if let Some(w) = events.as_mut() {
                            let mut step_ev = json!({
                                "step": step,
                                "duration_ns": c.duration.as_nanos() as u64,
                                "token_id": c.ids.first(),
                                "text": piece,
                                "emitted_token_ids": c.ids,
                                "proposal_candidate_count": usize::from(c.proposed > 0),
                                "proposed_token_count": c.proposed,
                                "accepted_token_count": c.accepted,
                                "proposal_memory_rejected": false,
                            });
                            if drafting.is_some() {
                                step_ev["draft_policy"] = json!(c.policy.state.as_str());
                            }
                            add_summary(&mut step_ev, c.summary, "top_logits", "logsumexp");
                            w.emit("decode_step", step_ev)?;
                        }
                        step += 1;
                    }
                }
                Ok(())
            })();
            r.map_err(|e| {
                let msg = crate::errtext::describe(&e);
                sink_error = Some(e);
                msg
            })
        })
    });

    let finished = match result {
        Ok(f) => f,
        Err(e) => {
            let err = sink_error.take().unwrap_or_else(|| anyhow!(e));
            if let Some(w) = events.as_mut() {
                emit_run_error(w, step == 0, &crate::errtext::describe(&err), started);
            }
            return Err(err);
        }
    };
    report_reuse(finished.reused, prompt_ids.len());
    finish_output(decoder, &mut text, &mut out, args.stats, live_stats)?;
    let ids = &finished.ids;
    let decode_steps = ids.len().saturating_sub(1);
    let decode_seconds = (finished.total_duration - finished.prefill_duration).as_secs_f64();
    let decode_speed = decode_steps as f64 / decode_seconds.max(1e-9);
    let drafter_json = match (drafting, last_policy) {
        (Some((name, mode)), Some(p)) => {
            let passes = step.saturating_sub(1);
            eprintln!(
                "[deltafin] stop={} generated={} drafter={name} ({mode}) drafts accepted {accepted}/{proposed} ({:.1}%) mean accepted length {:.2} in {passes} verify passes ({drafting_passes} with drafts, {:.2} tokens per pass) policy={} width={} speedup vs plain step {} (plain step {}, marginal cost per verified token {}) switched_off={}{}",
                finished.stop.as_str(),
                ids.len(),
                100.0 * accepted as f64 / proposed.max(1) as f64,
                accepted as f64 / drafting_passes.max(1) as f64,
                decode_steps as f64 / passes.max(1) as f64,
                p.state.as_str(),
                p.width,
                percent(p.speedup),
                p.plain_seconds.map_or("n/a".into(), |t| format!("{t:.4}s")),
                p.marginal.map_or("n/a".into(), |m| format!("{m:.2}")),
                p.switched_off,
                if passes > 0 {
                    format!(" decode={decode_speed:.3} token/s")
                } else {
                    String::new()
                },
            );
            json!({"name": name, "mode": mode, "proposed": proposed, "accepted": accepted,
                   "verify_passes": passes, "drafting_passes": drafting_passes,
                   "policy": p.state.as_str(), "width": p.width,
                   "speedup": p.speedup, "switched_off": p.switched_off})
        }
        _ => {
            eprintln!(
                "[deltafin] stop={} generated={} prefill={:.3}s ({:.1} token/s) decode={:.3} token/s",
                finished.stop.as_str(),
                ids.len(),
                finished.prefill_duration.as_secs_f64(),
                prompt_ids.len() as f64 / finished.prefill_duration.as_secs_f64().max(1e-9),
                if decode_steps > 0 { decode_speed } else { 0.0 }
            );
            Value::Null
        }
    };
    if args.stats {
        session::report_expert_stats(&model);
    }
    if let Some(w) = events.as_mut() {
        let mut runtime = json!({
            "backend": session::backend_description(),
            "load_seconds": load_seconds,
            "prefill_ns": finished.prefill_duration.as_nanos() as u64,
            "generated_tokens": ids.len(),
        });
        if !drafter_json.is_null() {
            runtime["drafter"] = drafter_json;
        }
        w.emit(
            "run_end",
            json!({
                "status": if finished.stop == StopReason::Interrupted { "interrupted" } else { "ok" },
                "duration_ns": started.elapsed().as_nanos() as u64,
                "prompt_token_ids": prompt_ids,
                "emitted_token_ids": ids,
                "completion_token_ids": finished.completion(),
                "stop_reason": finished.stop.as_str(),
                "completion_text": text,
                "runtime": runtime,
            }),
        )?;
    }
    Ok(if finished.stop == StopReason::Interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}

/// Say how much of the prompt a stored prefix state saved (nothing when none was used).
fn report_reuse(reused: usize, prompt_tokens: usize) {
    if reused > 0 {
        eprintln!(
            "[deltafin] prefill: {reused} of {prompt_tokens} prompt tokens restored from the state cache"
        );
    }
}

/// The header line's sampling field.
fn sampling_text(s: Option<&Sampling>) -> String {
    match s {
        None => "sampling=greedy".into(),
        Some(s) => format!(
            "sampling=temperature:{},top_p:{},top_k:{},min_p:{},seed:{}",
            s.temperature, s.top_p, s.top_k, s.min_p, s.seed
        ),
    }
}

/// The events file's `sampling` (`null`: greedy).
fn sampling_json(s: Option<&Sampling>) -> Value {
    s.map_or(Value::Null, |s| {
        json!({"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
               "min_p": s.min_p, "seed": s.seed})
    })
}

/// Percent text of a speed-up (`+12.3%`), or `n/a`.
fn percent(x: Option<f64>) -> String {
    x.map_or("n/a".into(), |s| format!("{:+.1}%", 100.0 * s))
}

/// The `run_error` event of a generation that failed (in the prefill when `in_prefill`);
/// best effort: the error itself is what the run reports.
fn emit_run_error(w: &mut EventWriter, in_prefill: bool, message: &str, started: Instant) {
    let _ = w.emit(
        "run_error",
        json!({
            "phase": if in_prefill { "prefill" } else { "decode" },
            "error_type": "generation",
            "message": message,
            "duration_ns": started.elapsed().as_nanos() as u64,
        }),
    );
}

/// End the output of a generation: the decoder's held-back bytes go to `text` and `out`,
/// then the line ends (after the text, or after the live `--stats` line on a terminal).
fn finish_output(
    decoder: StreamDecoder,
    text: &mut String,
    out: &mut impl Write,
    stats: bool,
    live_stats: bool,
) -> std::io::Result<()> {
    let tail = decoder.finish();
    text.push_str(&tail);
    if !stats {
        writeln!(out, "{tail}")?;
    } else if live_stats {
        writeln!(out)?;
    }
    out.flush()
}

/// One `--stats` line: rewritten in place on a terminal (`\r`), one line per token otherwise.
fn write_stats_line(out: &mut impl Write, live: bool, line: &str) -> std::io::Result<()> {
    if live {
        write!(out, "\r{line}")
    } else {
        writeln!(out, "{line}")
    }
}
