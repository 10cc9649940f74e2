//! The loaded model, its tokenizer and one generation (greedy, constrained or sampled) with
//! its output events.

use crate::constrain::{self, GrammarRule, Grammars};
use crate::error::ApiError;
use crate::memo::{self, MemoEntry, ResponseMemo};
pub use crate::outcome::{FinishReason, Usage};
use crate::output::{Assembler, Delta, EarlyEnd, TokenLogprob};
use crate::request::{ChatControls, GenRequest, Prompt, ToolMode};
use crate::sharing::Sharing;
use deltafin_k3::engine::{EngineBuilder, EngineConfig, EngineError, LoadedEngine, MemoryPlan};
use deltafin_k3::error::ModelError;
use deltafin_k3::generate::{Choose, GenerateError, Greedy, StopReason};
use deltafin_k3::model::K3Model;
use deltafin_k3::prefix::{PrefillProgress, PrefixCache};
use deltafin_k3::sampling::Sampler;
use deltafin_k3::text::chat::{ChatError, ChatOptions, ToolChoice, encode_chat};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_k3::weights::install::{self, Missing};
use deltafin_k3::weights::spine_int8::SpineFormat;
use deltafin_spec::select::{Chosen, DraftModels};
use deltafin_spec::{Event, Generation};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Why the model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The root holds no install (no `config.json`, or no shards / stream-install spine).
    #[error(
        "no K3 model installed at {root}: {what}. Run `deltafin setup --model-root {root}` to install Kimi K3, or pass --model-root PATH pointing at an install"
    )]
    NotInstalled {
        /// The model root.
        root: PathBuf,
        /// What it lacks.
        what: Missing,
    },
    /// The checkpoint, model or tokenizer failed to load.
    #[error("cannot load the K3 model from {root}: {reason}")]
    Failed {
        /// The model root.
        root: PathBuf,
        /// What failed.
        reason: String,
    },
}

/// Why a load failed, in words that do not repeat the root: an install that cannot be
/// opened says what failed in it; anything else is the error with its causes.
fn reason(e: &EngineError) -> String {
    use std::error::Error;
    if let EngineError::Install(i) = e {
        return i.source().map_or_else(|| i.to_string(), |s| s.to_string());
    }
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(src) = at {
        s += &format!(": {src}");
        at = src.source();
    }
    s
}

/// A model ready to generate.
pub struct Engine {
    /// The model.
    pub model: K3Model,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Largest number of positions (prompt + generated).
    pub max_context: usize,
    /// Draft models (DSpark for chat completions, Qwen for completions), used by requests
    /// without `logprobs`; `None`: plain greedy decoding only.
    pub drafts: Option<DraftModels>,
    /// Prefix states kept between requests (RAM and disk tiers, docs/SERVER.md
    /// "Conversation state"); `None`: every prompt is prefilled from its first token.
    pub prefix: Option<PrefixCache>,
    /// Finished answers of greedy requests, replayed for an identical request.
    pub memo: ResponseMemo,
    /// The memory split when experts stream under a budget (`None`: every expert
    /// resident); `GET /v1/status` reports it with the two fields below.
    pub plan: Option<MemoryPlan>,
    /// The spine the model multiplies with.
    pub spine: SpineFormat,
    /// Where the products run (`device=cpu`, `device=cuda:0 …`).
    pub device_line: String,
    /// How many generations run together and the state each reserves
    /// ([`crate::sharing`]).
    pub sharing: Sharing,
    /// The grammar engine over the tokenizer, built on the first constrained request.
    grammars: OnceLock<Result<Grammars, String>>,
}

// Generation runs on a blocking thread while handlers hold the engine.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Engine>();
};

impl Engine {
    /// Loads the install at `root` with the library's plain configuration
    /// ([`EngineConfig::default`]: every expert resident, the bf16 spine, the CPU).
    pub fn load(root: &Path) -> Result<Engine, LoadError> {
        Engine::load_with(root, &EngineConfig::default())
    }

    /// Loads the install at `root` through the engine builder with `config` (memory budget,
    /// streaming, spine format, device: what `deltafin run` and `deltafin serve` use).
    pub fn load_with(root: &Path, config: &EngineConfig) -> Result<Engine, LoadError> {
        if let Some(what) = install::missing(root) {
            return Err(LoadError::NotInstalled {
                root: root.to_path_buf(),
                what,
            });
        }
        let loaded = EngineBuilder::new(root)
            .config(config.clone())
            .build()
            .map_err(|e| LoadError::Failed {
                root: root.to_path_buf(),
                reason: reason(&e),
            })?;
        Ok(Engine::from_loaded(loaded, None))
    }

    /// The engine over a model loaded by [`EngineBuilder`], with `drafts` (`None`: plain
    /// greedy decoding only).
    pub fn from_loaded(loaded: LoadedEngine, drafts: Option<DraftModels>) -> Engine {
        let max_context = loaded.admitted_context();
        // One generation at a time until [`Engine::with_parallel`] (`deltafin serve` calls it).
        let one = Some((1, "one at a time"));
        let sharing = Sharing::new(&loaded.model, loaded.plan.as_ref(), max_context, one);
        Engine {
            max_context,
            sharing,
            plan: loaded.plan,
            spine: loaded.spine,
            device_line: loaded.device_line,
            model: loaded.model,
            tokenizer: Arc::new(loaded.tokenizer),
            drafts,
            prefix: None,
            memo: ResponseMemo::new(memo::DEFAULT_ENTRIES, memo::DEFAULT_BYTES),
            grammars: OnceLock::new(),
        }
    }

    /// This engine running `parallel` generations together (`None`: as many as the memory
    /// plan admits; [`crate::sharing`]), `source` naming where the count came from.
    pub fn with_parallel(mut self, parallel: Option<(usize, &'static str)>) -> Engine {
        self.sharing = Sharing::new(&self.model, self.plan.as_ref(), self.max_context, parallel);
        self
    }

    /// This engine with prefix states kept in `cache`.
    pub fn with_state_cache(mut self, cache: PrefixCache) -> Engine {
        self.prefix = cache.enabled().then_some(cache);
        self
    }

    /// This engine with a response memo of at most `entries` answers and `bytes` bytes
    /// (either 0: none).
    pub fn with_memo(mut self, entries: usize, bytes: usize) -> Engine {
        self.memo = ResponseMemo::new(entries, bytes);
        self
    }

    /// The token rule of `req`: K3's argmax over what its constraint allows
    /// ([`crate::constrain`]), or `None` for plain argmax. A constraint that cannot be
    /// built is the request's error (a 400), found before generation starts.
    pub fn rule(&self, req: &GenRequest) -> Result<Option<GrammarRule>, ApiError> {
        let Prompt::Chat { controls, .. } = &req.prompt else {
            return Ok(None);
        };
        if !constrain::constrains(controls) {
            return Ok(None);
        }
        let grammars = self
            .grammars
            .get_or_init(|| Grammars::new(self.tokenizer.clone()))
            .as_ref()
            .map_err(|e| ApiError::server(e.clone()))?;
        grammars.for_controls(controls)
    }

    /// The prompt ids: raw text with specials off and no BOS, or the XTML chat template
    /// rendered with the request's [`chat_options`] (the same ids `deltafin run` uses for the
    /// same options). `param` is the field that holds the prompt (`messages`, `prompt`,
    /// `input`), named by a refusal of the whole prompt.
    pub fn encode(&self, req: &GenRequest, param: &str) -> Result<Vec<u32>, ApiError> {
        let ids = self.prompt_ids(req, param)?;
        if ids.is_empty() {
            return Err(ApiError::invalid_param(
                param,
                "the prompt encodes to no tokens",
            ));
        }
        if ids.len() > self.max_context {
            return Err(ApiError::context_length(param, ids.len(), self.max_context));
        }
        // A constraint that cannot be built is refused now, not when generation starts.
        self.rule(req)?;
        Ok(ids)
    }

    /// How many tokens the prompt of `req` is (whatever the context holds).
    pub fn count(&self, req: &GenRequest, param: &str) -> Result<usize, ApiError> {
        Ok(self.prompt_ids(req, param)?.len())
    }

    fn prompt_ids(&self, req: &GenRequest, param: &str) -> Result<Vec<u32>, ApiError> {
        Ok(match &req.prompt {
            Prompt::Raw(text) => self.tokenizer.encode_ordinary(text),
            Prompt::Chat { messages, controls } => {
                encode_chat(&self.tokenizer, messages, &chat_options(controls)).map_err(|e| {
                    match e {
                        // A damaged install, not a bad request.
                        ChatError::MarkerMismatch { .. } => ApiError::server(format!(
                            "{e}; restore it with `deltafin setup-k3 --meta-only`"
                        )),
                        _ => ApiError::invalid_param(param, e.to_string()),
                    }
                })?
            }
        })
    }
}

/// How a chat request's controls render (docs/SERVER.md "Tool calling"): thinking and its
/// effort, the declared tools, the tool-choice message and the response format.
///
/// `tool_choice` follows the reference renderers (NeMo AutoModel's K3 encoder, llama.cpp's
/// Kimi-K3 template): `required` and `none` add their internal system message, `auto` adds
/// none, and a named function adds none either: neither reference has a frame for it, so
/// the named choice is enforced only by constrained decoding, never by the prompt.
pub fn chat_options(controls: &ChatControls) -> ChatOptions {
    ChatOptions {
        thinking: controls.thinking,
        effort: controls.thinking.then_some(controls.effort),
        add_generation_prompt: true,
        tools: controls.tools.clone(),
        tool_choice: match controls.tool_mode {
            ToolMode::Required => Some(ToolChoice::Required),
            ToolMode::None => Some(ToolChoice::Forbidden),
            ToolMode::Auto | ToolMode::Named(_) => None,
        },
        response_format: controls.response_format.clone(),
    }
}

/// What a generation sends to its handler.
#[derive(Debug)]
pub enum GenEvent {
    /// The prefill has processed `done` of the prompt's `total` positions (`reused` of
    /// them restored from a stored prefix state). Sent when the prefill starts, at most
    /// every [`PREFILL_REPORT_EVERY`] while it runs, and when it is done.
    Prefill {
        done: usize,
        total: usize,
        reused: usize,
    },
    /// Newly releasable output.
    Delta(Delta),
    /// The generation ended normally.
    Done {
        /// Why.
        finish: FinishReason,
        /// Counts.
        usage: Usage,
    },
    /// It failed; nothing more follows.
    Failed(ApiError),
}

/// Why a generation did not finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The client went away (or its handler was dropped).
    Client,
    /// The server is shutting down.
    Shutdown,
}

/// How a generation ended: the closing event to send (after the slot is released, so a
/// client that saw its answer can never find its own slot still taken), or why nothing
/// more is sent.
#[derive(Debug)]
pub enum Ending {
    /// Send this `Done` or `Failed` event.
    Event(GenEvent),
    /// The generation was cancelled; send nothing more.
    Cancelled(Cancelled),
}

/// The SSE comment frame of a [`GenEvent::Prefill`] report (`: prefill 1234/5000`): clients
/// skip comments, and a long prefill is not mistaken for a hung connection.
pub fn prefill_comment(done: usize, total: usize) -> String {
    format!(": prefill {done}/{total}\n\n")
}

/// Least time between two [`GenEvent::Prefill`] reports.
pub const PREFILL_REPORT_EVERY: Duration = Duration::from_millis(500);

/// Where the time of one generation went (for `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timing {
    /// Answered from the response memo (no model time at all).
    pub from_memo: bool,
    /// Prompt positions restored from a stored prefix state.
    pub reused: usize,
    /// The prefill pass over the prompt (it also yields the first generated token).
    pub prefill: Duration,
    /// Everything after the prefill.
    pub decode: Duration,
    /// Tokens generated after the prefill's (generated tokens − 1).
    pub decode_tokens: usize,
    /// It failed on a NaN or infinite value in the forward pass (damaged weights;
    /// `deltafin_numerical_failures_total`).
    pub numerical_failure: bool,
}

/// Runs one greedy generation, sending deltas to `send`; stops within one token once
/// `interrupt` is raised or `send` fails. Returns the closing event, or why it was cancelled.
/// With draft models and no `logprobs`, K3 verifies drafts (same tokens, fewer passes).
pub fn run_generation(
    engine: &Engine,
    req: &GenRequest,
    prompt: &[u32],
    interrupt: &AtomicBool,
    shutdown: &AtomicBool,
    send: impl FnMut(GenEvent) -> bool + Send,
) -> Ending {
    run_generation_timed(engine, req, prompt, interrupt, shutdown, send).0
}

/// [`run_generation`], also returning where its time went (zero where it failed before).
pub fn run_generation_timed(
    engine: &Engine,
    req: &GenRequest,
    prompt: &[u32],
    interrupt: &AtomicBool,
    shutdown: &AtomicBool,
    send: impl FnMut(GenEvent) -> bool + Send,
) -> (Ending, Timing) {
    // An identical greedy request answered before: its stored answer.
    let memo_key =
        (engine.memo.enabled() && req.sampling.is_none()).then(|| ResponseMemo::key(req, prompt));
    let send = Mutex::new(send);
    let send = |ev: GenEvent| (send.lock().unwrap_or_else(PoisonError::into_inner))(ev);
    if let Some(mut hit) = memo_key.as_ref().and_then(|k| engine.memo.get(k)) {
        crate::output::renew_call_ids(&mut hit.delta.tool_calls);
        let timing = Timing {
            from_memo: true,
            ..Timing::default()
        };
        if !hit.delta.is_empty() && !send(GenEvent::Delta(hit.delta)) {
            return (Ending::Cancelled(Cancelled::Client), timing);
        }
        let done = GenEvent::Done {
            finish: hit.finish,
            usage: hit.usage,
        };
        return (Ending::Event(done), timing);
    }
    // Everything sent is also gathered for the memo.
    let gathered = Mutex::new(Delta::default());
    let send = |ev: GenEvent| {
        if let (Some(_), GenEvent::Delta(d)) = (&memo_key, &ev) {
            gathered
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(d.clone());
        }
        send(ev)
    };
    let (ending, timing) = generate_answer(engine, req, prompt, interrupt, shutdown, &send);
    if let (Some(key), Ending::Event(GenEvent::Done { finish, usage })) = (memo_key, &ending) {
        let delta = gathered
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = MemoEntry {
            delta,
            finish: *finish,
            usage: *usage,
        };
        engine.memo.put(key, entry);
    }
    (ending, timing)
}

fn generate_answer(
    engine: &Engine,
    req: &GenRequest,
    prompt: &[u32],
    interrupt: &AtomicBool,
    shutdown: &AtomicBool,
    send: &(dyn Fn(GenEvent) -> bool + Sync),
) -> (Ending, Timing) {
    let chat = matches!(req.prompt, Prompt::Chat { .. });
    // The token rule: the grammar (argmax or sampled within it), the sampler, or argmax.
    let mut grammar = match engine.rule(req) {
        Ok(g) => g.map(|g| g.with_sampling(req.sampling)),
        Err(e) => return (Ending::Event(GenEvent::Failed(e)), Timing::default()),
    };
    let mut sampler = req.sampling.map(Sampler);
    let rule: &mut (dyn Choose + Send) = match (grammar.as_mut(), sampler.as_mut()) {
        (Some(g), _) => g,
        (None, Some(s)) => s,
        (None, None) => &mut Greedy,
    };
    // Drafts only without `logprobs` (a drafted step reports no per-token distribution).
    let chosen = match (&engine.drafts, req.logprobs) {
        (Some(drafts), None) => match drafts.choose(&engine.model, &engine.tokenizer, chat) {
            Ok(chosen) => chosen,
            Err(e) => {
                let failed = Ending::Event(GenEvent::Failed(ApiError::server(e)));
                return (failed, Timing::default());
            }
        },
        _ => None,
    };
    let run = Run {
        engine,
        req,
        prompt,
        interrupt,
        shutdown,
    };
    run_model(run, chosen, rule, send)
}

/// The fixed inputs of one generation.
struct Run<'a> {
    engine: &'a Engine,
    req: &'a GenRequest,
    prompt: &'a [u32],
    interrupt: &'a AtomicBool,
    shutdown: &'a AtomicBool,
}

/// [`run_generation`] through the generation driver, drafted by `chosen` or plain: the same
/// deltas, finish reason and usage either way (ids after a stop sequence are verified but
/// never released or counted).
fn run_model(
    run: Run<'_>,
    mut chosen: Option<Chosen>,
    rule: &mut (dyn Choose + Send),
    send: &(dyn Fn(GenEvent) -> bool + Sync),
) -> (Ending, Timing) {
    let Run {
        engine,
        req,
        prompt,
        interrupt,
        shutdown,
    } = run;
    let chat = matches!(req.prompt, Prompt::Chat { .. });
    let mut asm = Assembler::for_request(&engine.tokenizer, req);
    let mut client_gone = false;
    let mut counted = 0usize;
    let mut sink_error: Option<ApiError> = None;
    let mut progress = progress_reporter(send, interrupt);
    let batcher = engine.sharing.batcher.as_ref();
    let mut generate = || {
        let mut generation = Generation::new(&engine.model, prompt)
            .chat(chat)
            .max_new(Some(req.max_new))
            .max_context(engine.max_context)
            .top_logits(req.logprobs.map(|k| k.max(1)).unwrap_or(0))
            .rule(rule)
            .prefix_cache(engine.prefix.as_ref())
            .progress(&mut progress)
            .interrupt(interrupt);
        if let Some(c) = chosen.as_mut() {
            generation = generation.drafter(c.drafter.as_mut(), &mut c.policy);
        }
        if let Some(b) = batcher {
            generation = generation.batcher(b);
        }
        generation.run(|ev| {
            let Event::Committed(c) = ev else {
                return Ok(());
            };
            for (i, &id) in c.ids.iter().enumerate() {
                if asm.early_end().is_some() {
                    break;
                }
                counted += 1;
                // K3's unfiltered log-softmax of the emitted token (under a grammar it need not
                // be the top one) and of the top alternatives: the step's last token, the one
                // K3 chose from `summary`'s row (a plain step has only that one).
                let lp = match (req.logprobs, c.summary, c.logit) {
                    (Some(k), Some(s), Some(logit)) if i + 1 == c.ids.len() => Some(TokenLogprob {
                        id,
                        logprob: f64::from(logit) - s.logsumexp,
                        top: s
                            .top
                            .iter()
                            .take(k)
                            .map(|&(t, l)| (t, f64::from(l) - s.logsumexp))
                            .collect(),
                    }),
                    _ => None,
                };
                let delta = asm.push(id, lp).map_err(|e| {
                    sink_error = Some(ApiError::server(format!("cannot decode token {id}: {e}")));
                    e.to_string()
                })?;
                if !delta.is_empty() && !send(GenEvent::Delta(delta)) {
                    client_gone = true;
                    interrupt.store(true, Ordering::Relaxed);
                    break;
                }
            }
            if asm.early_end().is_some() {
                // Ends generation before the next forward pass.
                interrupt.store(true, Ordering::Relaxed);
            }
            Ok(())
        })
    };
    let result = match batcher {
        // Shared: this thread waits for its turns; the passes run on the kernels' pool.
        Some(_) => generate(),
        // Alone, on a rayon worker as `deltafin run` does: the kernels' parallel loops then
        // start by work-stealing instead of waking the pool from outside for every product.
        None => deltafin_kernels::pool::run_warm(generate),
    };
    // The next request with this drafter starts from this one's measurements (the plain
    // baseline is measured once per server, not once per request).
    if let (Some(drafts), Some(c)) = (&engine.drafts, &chosen) {
        drafts.remember(c.name, &c.policy);
    }
    let finished = match result {
        Ok(finished) => finished,
        Err(e) => {
            let model = match &e {
                GenerateError::Model(m) => Some(m),
                _ => None,
            };
            return generation_failed(sink_error, &e, model);
        }
    };
    let timing = Timing {
        from_memo: false,
        reused: finished.reused,
        prefill: finished.prefill_duration,
        decode: finished
            .total_duration
            .saturating_sub(finished.prefill_duration),
        decode_tokens: finished.ids.len().saturating_sub(1),
        numerical_failure: false,
    };
    // The stop id ended the answer only when it was released (not after a stop sequence).
    let eos = finished.stop == StopReason::Eos && counted == finished.ids.len();
    let finish = match (finish_reason(&asm, eos), finished.stop) {
        (Some(finish), _) => finish,
        (None, StopReason::MaxNew | StopReason::ContextFull) => FinishReason::Length,
        (None, _) => return (interrupted(client_gone, shutdown), timing),
    };
    let completion_tokens = if eos {
        counted.saturating_sub(1)
    } else {
        counted
    };
    let ending = done(asm, finish, prompt.len(), completion_tokens, send);
    (ending, timing)
}

/// Prefill progress as [`GenEvent::Prefill`], at most every [`PREFILL_REPORT_EVERY`] and
/// once at the end; a client that cannot be told is gone, and the prefill stops.
fn progress_reporter<'a>(
    send: &'a (dyn Fn(GenEvent) -> bool + Sync),
    interrupt: &'a AtomicBool,
) -> impl FnMut(PrefillProgress) + Send + 'a {
    let mut last: Option<Instant> = None;
    move |p: PrefillProgress| {
        let now = Instant::now();
        let done = p.done.round() as usize;
        let due = last.is_none_or(|t| now.duration_since(t) >= PREFILL_REPORT_EVERY);
        if !(due || done >= p.total) {
            return;
        }
        last = Some(now);
        let ev = GenEvent::Prefill {
            done: done.min(p.total),
            total: p.total,
            reused: p.reused,
        };
        if !send(ev) {
            interrupt.store(true, Ordering::Relaxed);
        }
    }
}

/// The finish reason of an answer the assembler ended, or that ended with the model's end
/// token (`eos`); `None` otherwise (a limit was reached or generation was interrupted).
/// An answer that ended with at least one tool call finishes with `tool_calls`.
fn finish_reason(asm: &Assembler<'_>, eos: bool) -> Option<FinishReason> {
    match asm.early_end() {
        Some(EarlyEnd::StopSequence) => Some(
            asm.matched_stop()
                .map_or(FinishReason::Stop, FinishReason::StopSequence),
        ),
        Some(EarlyEnd::ToolsRefused) => Some(FinishReason::Stop),
        Some(EarlyEnd::CallLimit) => Some(FinishReason::ToolCalls),
        None if eos && asm.tool_calls() > 0 => Some(FinishReason::ToolCalls),
        None if eos => Some(FinishReason::Stop),
        None => None,
    }
}

/// The generation failed: the sink's own error if it raised one, else the model's (`model`:
/// when the model raised it). A numerical failure (a NaN or an infinity in the forward
/// pass: damaged weights) is a 500 with code `numerical_failure`, counted in `/metrics`.
fn generation_failed(
    sink_error: Option<ApiError>,
    e: &dyn std::fmt::Display,
    model: Option<&ModelError>,
) -> (Ending, Timing) {
    let numerical = matches!(model, Some(ModelError::NonFinite { .. }));
    let err = sink_error.unwrap_or_else(|| {
        let err = ApiError::server(format!("generation failed: {e}"));
        if numerical {
            ApiError {
                code: "numerical_failure",
                ..err
            }
        } else {
            err
        }
    });
    let timing = Timing {
        numerical_failure: numerical,
        ..Timing::default()
    };
    (Ending::Event(GenEvent::Failed(err)), timing)
}

/// Stopped by the interrupt flag: the client left (or its handler was dropped) unless the
/// server is shutting down.
fn interrupted(client_gone: bool, shutdown: &AtomicBool) -> Ending {
    if client_gone || !shutdown.load(Ordering::Relaxed) {
        Ending::Cancelled(Cancelled::Client)
    } else {
        Ending::Event(GenEvent::Failed(ApiError::shutting_down()))
    }
}

/// A generation that ended with `finish`: send the text the assembler still holds, then
/// the closing `Done` with its usage.
fn done(
    mut asm: Assembler<'_>,
    finish: FinishReason,
    prompt_tokens: usize,
    completion_tokens: usize,
    mut send: impl FnMut(GenEvent) -> bool,
) -> Ending {
    match asm.finish() {
        Ok(delta) => {
            if !delta.is_empty() && !send(GenEvent::Delta(delta)) {
                return Ending::Cancelled(Cancelled::Client);
            }
        }
        Err(e) => {
            return Ending::Event(GenEvent::Failed(ApiError::server(format!(
                "cannot decode the output: {e}"
            ))));
        }
    }
    let usage = Usage {
        prompt_tokens,
        completion_tokens,
        reasoning_tokens: asm.reasoning_tokens().min(completion_tokens),
    };
    Ending::Event(GenEvent::Done { finish, usage })
}
