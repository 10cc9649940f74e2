//! `deltafin run`: prefill one prompt, decode it (greedily, or by K3's seeded sampling with
//! `--temperature`), stream the text (or live stats), and optionally write the run events
//! file and the per-layer profile.

use crate::RunArgs;
use crate::events::EventWriter;
use crate::prefill_bar::PrefillBar;
use crate::session;
use anyhow::{Context, Result, anyhow, bail};
use deltafin_k3::engine::{EngineConfig, LoadedEngine};
use deltafin_k3::generate::{
    Choose, GenerateEvent, GenerateOptions, Greedy, LogitSummary, StopReason, generate_prefilled,
    stop_ids,
};
use deltafin_k3::prefix::{Chunked, PrefillProgress, message_ends};
use deltafin_k3::sampling::{Sampler, Sampling, fresh_seed};
use deltafin_k3::text::chat::{self, ChatMessage, ReasoningEffort, Thinking};
use deltafin_k3::text::tokenizer::{END_OF_MSG, StreamDecoder};
use deltafin_spec::dspark::{DraftMode, SpecConfig};
use deltafin_spec::select::{Chosen, DraftModels, Surfaces};
use deltafin_spec::{Committed, WallClock, generate_with_prefill};
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
    let opts = GenerateOptions {
        max_new: args.max_new,
        stop_ids: stop_ids(args.chat),
        max_context,
        top_logits: top_n,
    };
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
    let mut prefiller = Chunked::new(cache.as_ref());
    if args.chat {
        prefiller.marks = message_ends(&prompt_ids, END_OF_MSG);
    }
    prefiller.interrupt = Some(&interrupt);
    prefiller.progress = Some(&mut show);
    if let Some(chosen) = chosen {
        return run_speculative(
            &mut prefiller,
            args,
            &model,
            &tokenizer,
            &prompt_ids,
            &opts,
            chosen,
            events.as_mut(),
            &interrupt,
            started,
            spine.as_str(),
            sampling,
        );
    }
    let config = json!({
        "surface": surface,
        "model_root": root.display().to_string(),
        "reasoning_effort": if args.chat { json!(thinking.to_string()) } else { Value::Null },
        "thinking": if args.chat { json!(thinking.is_on()) } else { Value::Null },
        "max_new": args.max_new,
        "top_logits": top_n,
        "sampling": sampling_json(sampling.as_ref()),
        "spine": spine.as_str(),
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
    let result = deltafin_kernels::pool::run_warm(|| {
        let mut sampler = sampling.map(Sampler);
        let rule: &mut dyn Choose = match sampler.as_mut() {
            Some(s) => s,
            None => &mut Greedy,
        };
        generate_prefilled(
            &model,
            &prompt_ids,
            &mut prefiller,
            &opts,
            rule,
            &interrupt,
            |ev| {
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
                                add_summary(
                                    &mut start,
                                    summary,
                                    "last_prompt_top_logits",
                                    "last_prompt_logsumexp",
                                );
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
                            ..
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
                                write_stats_line(&mut out, live_stats, &line)?;
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
                                add_summary(&mut step_ev, summary, "top_logits", "logsumexp");
                                w.emit("decode_step", step_ev)?;
                            }
                        }
                    }
                    Ok(())
                })();
                r.map_err(|e| {
                    let msg = crate::errtext::describe(&e);
                    sink_error = Some(e);
                    msg
                })
            },
        )
    });
    report_reuse(prefiller.reused, prompt_ids.len());

    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            let err = sink_error.take().unwrap_or_else(|| anyhow!(e));
            if let Some(w) = events.as_mut() {
                emit_run_error(
                    w,
                    emitted.is_empty(),
                    &crate::errtext::describe(&err),
                    started,
                );
            }
            return Err(err);
        }
    };
    finish_output(decoder, &mut text, &mut out, args.stats, live_stats)?;
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

/// Percent text of a speed-up (`+12.3%`), or `n/a`.
/// The header line's sampling field.
/// Say how much of the prompt a stored prefix state saved (nothing when none was used).
fn report_reuse(reused: usize, prompt_tokens: usize) {
    if reused > 0 {
        eprintln!(
            "[deltafin] prefill: {reused} of {prompt_tokens} prompt tokens restored from the state cache"
        );
    }
}

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

fn percent(x: Option<f64>) -> String {
    x.map_or("n/a".into(), |s| format!("{:+.1}%", 100.0 * s))
}

/// `deltafin run` with a drafter (DSpark or Qwen, under its `auto`/`on` policy): K3 verifies
/// every draft, so the ids equal plain greedy decoding; each committed step writes one
/// `decode_step` with the proposal counts and the policy state.
#[allow(clippy::too_many_arguments)]
fn run_speculative(
    prefiller: &mut Chunked<'_>,
    args: &RunArgs,
    model: &deltafin_k3::model::K3Model,
    tokenizer: &deltafin_k3::text::tokenizer::Tokenizer,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    chosen: Chosen,
    mut events: Option<&mut EventWriter>,
    interrupt: &std::sync::atomic::AtomicBool,
    started: Instant,
    spine: &str,
    sampling: Option<Sampling>,
) -> Result<ExitCode> {
    let Chosen {
        name,
        mut drafter,
        mut policy,
    } = chosen;
    if prompt_ids.len() >= opts.max_context {
        bail!(
            "prompt of {} tokens does not fit the context of {} positions",
            prompt_ids.len(),
            opts.max_context
        );
    }
    let room = opts.max_context - prompt_ids.len();
    let max_new = opts.max_new.unwrap_or(room).min(room);
    let initial = policy.report();
    let mode = match initial.mode {
        deltafin_spec::PolicyMode::On => "on",
        deltafin_spec::PolicyMode::Auto => "auto",
        deltafin_spec::PolicyMode::Fixed => "fixed",
    };
    if let Some(w) = events.as_deref_mut() {
        w.emit(
            "run_start",
            json!({
                "prompt": args.prompt,
                "chat": args.chat,
                "max_new": args.max_new,
                "input_token_ids": prompt_ids,
                "prompt_token_ids": prompt_ids,
                "config": {"surface": if args.chat { "chat" } else { "raw" }, "drafter": name,
                           "draft_mode": mode, "spine": spine,
                           "sampling": sampling_json(sampling.as_ref()),
                           "backend": session::backend_description()},
            }),
        )?;
    }
    let stdout = std::io::stdout();
    let live_stats = args.stats && stdout.is_terminal();
    let mut out = stdout;
    let mut decoder = StreamDecoder::new();
    let mut text = String::new();
    let mut step = 0usize;
    let (mut proposed, mut accepted, mut emitted, mut drafting) = (0usize, 0usize, 0usize, 0usize);
    let mut last_policy = initial;
    let mut prefill_ns = 0u64;
    let gen_start = Instant::now();
    let clock = WallClock::new();
    let mut sampler = sampling.map(Sampler);
    let rule: &mut (dyn Choose + Send) = match sampler.as_mut() {
        Some(s) => s,
        None => &mut Greedy,
    };
    let result = deltafin_kernels::pool::run_warm(|| {
        generate_with_prefill(
            model,
            prompt_ids,
            prefiller,
            max_new,
            &opts.stop_ids,
            drafter.as_mut(),
            rule,
            &mut policy,
            &clock,
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
                    drafting += usize::from(c.proposed > 0);
                    emitted += c.ids.len();
                    last_policy = c.policy;
                    if args.stats {
                        let elapsed = gen_start.elapsed().as_secs_f64();
                        let p = &c.policy;
                        let line = format!(
                            "[stats] generated={emitted} elapsed={elapsed:.2}s speed={:.3} token/s ({:.3} s/token) drafts={accepted}/{proposed} mean_accepted={:.2} verify_passes={} policy={mode}:{} width={} speedup={}",
                            emitted as f64 / elapsed.max(1e-9),
                            elapsed / emitted.max(1) as f64,
                            accepted as f64 / drafting.max(1) as f64,
                            step,
                            p.state.as_str(),
                            p.width,
                            percent(p.speedup),
                        );
                        write_stats_line(&mut out, live_stats, &line)?;
                    } else {
                        write!(out, "{piece}")?;
                    }
                    out.flush()?;
                    if let Some(w) = events.as_deref_mut() {
                        if step == 0 {
                            prefill_ns = c.duration.as_nanos() as u64;
                            w.emit(
                                "prefill_done",
                                json!({"duration_ns": prefill_ns, "prompt_tokens": prompt_ids.len()}),
                            )?;
                        }
                        w.emit(
                            "decode_step",
                            json!({
                                "step": step,
                                "duration_ns": c.duration.as_nanos() as u64,
                                "token_id": c.ids.first(),
                                "text": piece,
                                "emitted_token_ids": c.ids,
                                "proposal_candidate_count": usize::from(c.proposed > 0),
                                "proposed_token_count": c.proposed,
                                "accepted_token_count": c.accepted,
                                "proposal_memory_rejected": false,
                                "draft_policy": c.policy.state.as_str(),
                            }),
                        )?;
                    }
                    step += 1;
                    Ok(())
                })();
                r.map_err(|e| crate::errtext::describe(&e))
            },
        )
    });
    report_reuse(prefiller.reused, prompt_ids.len());
    let (ids, _stats) = match result {
        Ok(v) => v,
        Err(e) => {
            if let Some(w) = events.as_deref_mut() {
                emit_run_error(w, step == 0, &e.to_string(), started);
            }
            bail!("{e}");
        }
    };
    finish_output(decoder, &mut text, &mut out, args.stats, live_stats)?;
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
    let passes = step.saturating_sub(1);
    let decode_s = gen_start.elapsed().as_secs_f64() - prefill_ns as f64 * 1e-9;
    eprintln!(
        "[deltafin] stop={} generated={} drafter={name} ({mode}) drafts accepted {accepted}/{proposed} ({:.1}%) mean accepted length {:.2} in {passes} verify passes ({drafting} with drafts, {:.2} tokens per pass) policy={} width={} speedup vs plain step {} (plain step {}, marginal cost per verified token {}) switched_off={}{}",
        stop.as_str(),
        ids.len(),
        100.0 * accepted as f64 / proposed.max(1) as f64,
        accepted as f64 / drafting.max(1) as f64,
        ids.len().saturating_sub(1) as f64 / passes.max(1) as f64,
        last_policy.state.as_str(),
        last_policy.width,
        percent(last_policy.speedup),
        last_policy
            .plain_seconds
            .map_or("n/a".into(), |t| format!("{t:.4}s")),
        last_policy
            .marginal
            .map_or("n/a".into(), |m| format!("{m:.2}")),
        last_policy.switched_off,
        if passes > 0 {
            format!(
                " decode={:.3} token/s",
                ids.len().saturating_sub(1) as f64 / decode_s.max(1e-9)
            )
        } else {
            String::new()
        },
    );
    if args.stats {
        session::report_expert_stats(model);
    }
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
                "runtime": {
                    "backend": session::backend_description(),
                    "prefill_ns": prefill_ns,
                    "generated_tokens": ids.len(),
                    "drafter": {"name": name, "mode": mode, "proposed": proposed, "accepted": accepted,
                                "verify_passes": passes, "drafting_passes": drafting,
                                "policy": last_policy.state.as_str(), "width": last_policy.width,
                                "speedup": last_policy.speedup, "switched_off": last_policy.switched_off},
                },
            }),
        )?;
    }
    Ok(if stop == StopReason::Interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
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
