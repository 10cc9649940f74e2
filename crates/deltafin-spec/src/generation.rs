//! The one generation driver: every front end (`deltafin run`, the server's APIs) and every
//! library user generates through a [`Generation`].
//!
//! A [`Generation`] is built from a prompt (or a state restored from a stored prefix), the stop
//! rule, the token budget, the admitted context, the token rule ([`Choose`]: greedy, K3's
//! seeded sampling or a grammar), an optional drafter with its [`SpecPolicy`], the prefill's
//! cache and progress report, and the interrupt flag. [`Generation::run`] prefills the prompt
//! and then commits tokens step by step, reporting each step as an [`Event`]; everything one
//! sequence carries from step to step (K3's [`State`]: the MLA latent cache, the KDA states and
//! the position; the ids so far; the drafter, its policy and its taps) is one [`Sequence`].
//!
//! **The rules, decided here once.**
//!
//! - *Stop ids*: [`Generation::chat`] takes them from [`deltafin_k3::generate::stop_ids`]; a
//!   stop id is emitted and ends the generation ([`StopReason::Eos`]).
//! - *Context edge*: the state may hold at most `max_context` positions (the engine's
//!   [`admitted_context`](deltafin_k3::engine::LoadedEngine::admitted_context)). The last
//!   emitted token is chosen from the logits of the last position and never run through K3,
//!   so a prompt of `p ≤ max_context` tokens gets at most `max_context + 1 − p` new tokens
//!   ([`StopReason::ContextFull`]), drafted or not: a verify pass never holds more than
//!   `max_context` positions either, because drafts are only asked for while the budget
//!   leaves room for them and K3's own token. A prompt longer than `max_context` is refused
//!   ([`GenerateError::PromptTooLong`]).
//! - *Token budget*: at most `max_new` tokens ([`StopReason::MaxNew`]); the reasons are
//!   checked in the order stop id, budget, context, interrupt. `max_new == 0` still prefills
//!   (the prompt's state is stored in the cache, [`Event::Prefilled`] is reported, a drafter
//!   observes the prompt), with or without a drafter, and emits nothing.
//! - *Interrupt*: the flag is checked before every step (the first token's included) and,
//!   with a chunked prefill, before every layer of the prefill; an interrupted prefill ends
//!   with no ids ([`StopReason::Interrupted`]).
//!
//! **Drafted equals plain.** With a drafter, each step after the first verifies the drafts in
//! one exact K3 pass ([`crate::verify`]) and commits the accepted prefix and K3's own token;
//! without one, each step is one decode. Both choose every token with the same rule from the
//! same logits, so the ids are the same.

use crate::batch::Batcher;
use crate::policy::{Clock, PolicyReport, SpecPolicy, WallClock};
use crate::{Committed, Drafter, RuleRows, SpecStats, StepFeedback, verify_rows};
use deltafin_k3::generate::{
    Choose, GenerateError, GenerateEvent, GenerateOptions, GenerateOutcome, Greedy, LogitSummary,
    StopReason, stop_ids,
};
use deltafin_k3::model::K3Model;
use deltafin_k3::model::state::State;
use deltafin_k3::model::taps::Taps;
use deltafin_k3::prefix::{
    Chunked, OnePass, PrefillProgress, Prefilled, Prefiller, PrefixCache, message_ends,
};
use deltafin_k3::text::tokenizer::END_OF_MSG;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One event of a generation, in order: [`Event::Prefilled`] once, then one
/// [`Event::Committed`] per step (the first step is K3's token after the prompt).
#[derive(Clone, Debug)]
pub enum Event<'e> {
    /// The prompt was processed.
    Prefilled {
        /// Time of the prefill.
        duration: Duration,
        /// The last prompt position's logits, when [`Generation::top_logits`] asks for them.
        summary: Option<&'e LogitSummary>,
        /// Prompt positions restored from a stored prefix state.
        reused: usize,
    },
    /// A step committed tokens.
    Committed(Committed<'e>),
}

/// What a generation produced.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The emitted ids (a final stop id included).
    pub ids: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Time of the prefill.
    pub prefill_duration: Duration,
    /// Time of the whole generation.
    pub total_duration: Duration,
    /// Prompt positions restored from a stored prefix state.
    pub reused: usize,
    /// Drafting counters (all zero without a drafter).
    pub stats: SpecStats,
}

impl Finished {
    /// The completion: the ids without the stop id that ended them.
    pub fn completion(&self) -> &[u32] {
        match self.stop {
            StopReason::Eos => &self.ids[..self.ids.len().saturating_sub(1)],
            _ => &self.ids,
        }
    }
}

/// Where a generation starts.
enum Start<'a> {
    /// A prompt, prefilled by the generation.
    Prompt(&'a [u32]),
    /// A state already holding `ids` (restored from a stored prefix, or a previous turn) and
    /// the logits of its last position.
    Restored {
        ids: &'a [u32],
        prefilled: Prefilled,
    },
}

/// A drafter and its policy, for [`Generation::drafter`].
struct Drafting<'a> {
    drafter: &'a mut dyn Drafter,
    policy: &'a mut SpecPolicy,
}

/// One generation, built step by step and run once ([`Generation::run`]).
///
/// ```no_run
/// # fn demo(engine: &deltafin_k3::engine::LoadedEngine, prompt: &[u32]) -> Result<(), Box<dyn std::error::Error>> {
/// use deltafin_spec::generation::Generation;
/// let done = Generation::new(&engine.model, prompt)
///     .chat(false)
///     .max_new(Some(32))
///     .max_context(engine.admitted_context())
///     .run(|_| Ok(()))?;
/// println!("{}", engine.tokenizer.decode(done.completion())?);
/// # Ok(()) }
/// ```
pub struct Generation<'a> {
    model: &'a K3Model,
    start: Start<'a>,
    stop_ids: Vec<u32>,
    chat: bool,
    max_new: Option<usize>,
    max_context: usize,
    top_logits: usize,
    rule: Option<&'a mut dyn Choose>,
    drafting: Option<Drafting<'a>>,
    clock: Option<&'a dyn Clock>,
    chunked: bool,
    cache: Option<&'a PrefixCache>,
    progress: Option<&'a mut (dyn FnMut(PrefillProgress) + Send)>,
    interrupt: Option<&'a AtomicBool>,
    batcher: Option<&'a Batcher>,
}

impl<'a> Generation<'a> {
    /// A generation after `prompt`, with the defaults: the stop ids of a raw completion
    /// ([`stop_ids`]`(false)`), no token budget, no context bound beyond the budget, greedy
    /// tokens, no drafter, one prefill pass, no interrupt.
    pub fn new(model: &'a K3Model, prompt: &'a [u32]) -> Generation<'a> {
        Generation::starting(model, Start::Prompt(prompt))
    }

    /// A generation that continues a state already holding `ids` (`prefilled`: restored from
    /// a stored prefix state, or the state of a previous turn), with the defaults of
    /// [`Generation::new`]. A drafter reading K3's taps has not observed those positions; it
    /// may then propose worse drafts, never other tokens.
    pub fn resume(model: &'a K3Model, ids: &'a [u32], prefilled: Prefilled) -> Generation<'a> {
        Generation::starting(model, Start::Restored { ids, prefilled })
    }

    fn starting(model: &'a K3Model, start: Start<'a>) -> Generation<'a> {
        Generation {
            model,
            start,
            stop_ids: stop_ids(false),
            chat: false,
            max_new: None,
            max_context: usize::MAX,
            top_logits: 0,
            rule: None,
            drafting: None,
            clock: None,
            chunked: false,
            cache: None,
            progress: None,
            interrupt: None,
            batcher: None,
        }
    }

    /// The surface: a chat turn (stops at `<|end_of_msg|>`; the prefill stores prefix
    /// states at message ends) or a raw completion (also stops at `[EOS]`). The stop ids are
    /// [`stop_ids`]'s, the one rule for every front end.
    pub fn chat(mut self, chat: bool) -> Self {
        self.chat = chat;
        self.stop_ids = stop_ids(chat);
        self
    }

    /// Other stop ids than the surface's (tests, synthetic vocabularies).
    pub fn stop_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_ids = ids;
        self
    }

    /// At most this many new tokens (`None`: until a stop id or the context is full).
    pub fn max_new(mut self, max_new: Option<usize>) -> Self {
        self.max_new = max_new;
        self
    }

    /// The most positions the state may hold: the engine's admitted context
    /// ([`LoadedEngine::admitted_context`](deltafin_k3::engine::LoadedEngine::admitted_context)).
    pub fn max_context(mut self, positions: usize) -> Self {
        self.max_context = positions;
        self
    }

    /// Report the `n` largest logits and the log-sum-exp of the distributions tokens are
    /// chosen from ([`Committed::summary`]; 0: none).
    pub fn top_logits(mut self, n: usize) -> Self {
        self.top_logits = n;
        self
    }

    /// Choose every token with `rule` (K3's seeded sampling, a grammar) instead of greedy.
    pub fn rule(mut self, rule: &'a mut dyn Choose) -> Self {
        self.rule = Some(rule);
        self
    }

    /// Draft with `drafter` under `policy`; K3 verifies every draft, so the ids are those of
    /// the same generation without it.
    pub fn drafter(mut self, drafter: &'a mut dyn Drafter, policy: &'a mut SpecPolicy) -> Self {
        self.drafting = Some(Drafting { drafter, policy });
        self
    }

    /// The clock the steps and the drafting policy are timed by (default: the wall clock).
    pub fn clock(mut self, clock: &'a dyn Clock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Prefill in aligned passes ([`Chunked`]) that resume from, and store into, `cache`
    /// (`None`: aligned passes, no cache); the interrupt flag then also stops the prefill.
    pub fn prefix_cache(mut self, cache: Option<&'a PrefixCache>) -> Self {
        self.chunked = true;
        self.cache = cache;
        self
    }

    /// Report the prefill's progress after every layer (implies aligned passes, as
    /// [`Generation::prefix_cache`]).
    pub fn progress(mut self, progress: &'a mut (dyn FnMut(PrefillProgress) + Send)) -> Self {
        self.chunked = true;
        self.progress = Some(progress);
        self
    }

    /// Stop at the next step (or prefill layer) once `flag` is raised.
    pub fn interrupt(mut self, flag: &'a AtomicBool) -> Self {
        self.interrupt = Some(flag);
        self
    }

    /// Share the model with the other generations of `batcher` ([`crate::batch`]): decode
    /// steps run in batches with theirs, the prefill (in aligned passes, as with
    /// [`Generation::prefix_cache`]) and drafted verifications take exclusive turns, the
    /// prefill giving its turn back after every layer. The ids, logits and logprobs are those
    /// of the generation alone. Run it from an ordinary thread, not on the kernels' pool.
    pub fn batcher(mut self, batcher: &'a Batcher) -> Self {
        self.chunked = true;
        self.batcher = Some(batcher);
        self
    }

    /// Run the generation, telling `on_event` every event in order; an error it returns
    /// stops the generation ([`GenerateError::Sink`]).
    pub fn run(
        self,
        mut on_event: impl FnMut(Event<'_>) -> Result<(), String>,
    ) -> Result<Finished, GenerateError> {
        let Generation {
            model,
            start,
            stop_ids,
            chat,
            max_new,
            max_context,
            top_logits,
            rule,
            drafting,
            clock,
            chunked,
            cache,
            progress,
            interrupt,
            batcher,
        } = self;
        let _member = batcher.map(Batcher::member);
        let wall = WallClock::new();
        let clock = clock.unwrap_or(&wall);
        let mut greedy = Greedy;
        let rule: &mut dyn Choose = match rule {
            Some(r) => r,
            None => &mut greedy,
        };
        let interrupt = interrupt.unwrap_or(&NEVER);
        let started = clock.now();
        let prompt_len = match &start {
            Start::Prompt(p) => p.len(),
            Start::Restored { ids, .. } => ids.len(),
        };
        if prompt_len > max_context {
            return Err(GenerateError::PromptTooLong {
                prompt: prompt_len,
                max_context,
            });
        }
        // The prompt's prefill: aligned passes over the cache (stopped by the interrupt,
        // reported), or one pass.
        let mut reused_before_stop = 0;
        let seq = match start {
            Start::Prompt(prompt) => {
                let marks = if chat {
                    message_ends(prompt, END_OF_MSG)
                } else {
                    Vec::new()
                };
                let how = chunked.then_some((cache, marks, interrupt));
                match batcher {
                    // An exclusive turn, given back after every layer.
                    Some(b) => b.exclusive(prompt.len(), |turn| {
                        let mut user = progress;
                        let mut yielding = |p: PrefillProgress| {
                            if let Some(u) = user.as_mut() {
                                u(p);
                            }
                            turn.yield_between_layers(model);
                        };
                        prefill_prompt(
                            model,
                            prompt,
                            how,
                            Some(&mut yielding),
                            drafting,
                            &mut reused_before_stop,
                        )
                    })?,
                    None => prefill_prompt(
                        model,
                        prompt,
                        how,
                        progress,
                        drafting,
                        &mut reused_before_stop,
                    )?,
                }
            }
            Start::Restored { ids, prefilled } => {
                Some(Sequence::restored(model, ids, prefilled, drafting)?)
            }
        };
        let prefill_duration = clock.now().saturating_sub(started);
        let finished = |ids: Vec<u32>, stop, reused, stats| Finished {
            ids,
            stop,
            prefill_duration,
            total_duration: clock.now().saturating_sub(started),
            reused,
            stats,
        };
        let Some((mut seq, reused)) = seq else {
            // Interrupted: what the prefill had restored before it stopped.
            return Ok(finished(
                Vec::new(),
                StopReason::Interrupted,
                reused_before_stop,
                SpecStats::default(),
            ));
        };
        let summarize = |l: &[f32]| (top_logits > 0).then(|| LogitSummary::of(l, top_logits));
        let summary = summarize(&seq.logits);
        on_event(Event::Prefilled {
            duration: prefill_duration,
            summary: summary.as_ref(),
            reused,
        })
        .map_err(GenerateError::Sink)?;
        let limits = Limits {
            stop_ids: &stop_ids,
            max_new,
            max_context,
        };
        let stop = loop {
            if let Some(reason) = seq.stopped(&limits) {
                break reason;
            }
            if interrupt.load(Ordering::Relaxed) {
                break StopReason::Interrupted;
            }
            let step = seq.step(model, batcher, rule, &limits, clock, prefill_duration)?;
            let summary = step.logits.as_deref().and_then(summarize);
            on_event(Event::Committed(Committed {
                first: step.first,
                ids: &seq.emitted()[step.first..],
                proposed: step.proposed,
                accepted: step.accepted,
                duration: step.duration,
                logit: step.logit,
                summary: summary.as_ref(),
                policy: step.policy,
            }))
            .map_err(GenerateError::Sink)?;
        };
        let stats = seq.stats();
        Ok(finished(seq.emitted().to_vec(), stop, reused, stats))
    }
}

/// The prompt's prefill: aligned passes over `chunked`'s cache (with its message-end marks,
/// stopped by its interrupt flag, reported to `progress`), or one pass. Sets `reused` to the
/// positions restored from a stored prefix state.
fn prefill_prompt<'d, 'p>(
    model: &K3Model,
    prompt: &[u32],
    chunked: Option<(Option<&'p PrefixCache>, Vec<usize>, &'p AtomicBool)>,
    progress: Option<&'p mut (dyn FnMut(PrefillProgress) + Send + 'p)>,
    drafting: Option<Drafting<'d>>,
    reused: &mut usize,
) -> Result<Option<(Sequence<'d>, usize)>, GenerateError> {
    let Some((cache, marks, interrupt)) = chunked else {
        return Sequence::prefill(model, prompt, &mut OnePass, drafting);
    };
    let mut p = Chunked::new(cache);
    p.marks = marks;
    p.interrupt = Some(interrupt);
    p.progress = progress;
    let seq = Sequence::prefill(model, prompt, &mut p, drafting);
    *reused = p.reused;
    seq
}

/// The interrupt flag of a generation that has none: never raised.
static NEVER: AtomicBool = AtomicBool::new(false);

/// When a sequence stops.
struct Limits<'l> {
    stop_ids: &'l [u32],
    max_new: Option<usize>,
    max_context: usize,
}

impl Limits<'_> {
    /// The most tokens a sequence whose prompt is `prompt_len` ids may emit: the budget, and
    /// the context edge (the state holds at most `max_context` positions; the last token is
    /// never run through K3).
    fn most(&self, prompt_len: usize) -> usize {
        let room = self
            .max_context
            .saturating_add(1)
            .saturating_sub(prompt_len);
        self.max_new.map_or(room, |m| m.min(room))
    }
}

/// The drafter of one sequence, its policy, the taps it reads and its counters.
struct DraftState<'d> {
    drafter: &'d mut dyn Drafter,
    policy: &'d mut SpecPolicy,
    taps: Option<Taps>,
    stats: SpecStats,
}

/// Everything one sequence carries from step to step: K3's [`State`] (MLA latent cache, KDA
/// states, position), the ids it holds and emitted, the logits of its next token, the token
/// emitted but not yet run through K3, and the drafter with its policy and taps.
pub struct Sequence<'d> {
    state: State,
    /// The prompt and every emitted id.
    history: Vec<u32>,
    prompt_len: usize,
    /// K3's logits for the next token, before the first step.
    logits: Vec<f32>,
    /// The newest emitted id, not yet run through K3.
    pending: Option<u32>,
    draft: Option<DraftState<'d>>,
}

/// What one step committed (the ids are the sequence's, from `first` on).
struct Step {
    first: usize,
    proposed: usize,
    accepted: usize,
    duration: Duration,
    logit: Option<f32>,
    /// The logits the step's last id was chosen from, when K3 chose it.
    logits: Option<Vec<f32>>,
    policy: PolicyReport,
}

impl<'d> Sequence<'d> {
    /// Prefill `prompt` with `prefiller` (the drafter, if any, observes every prompt
    /// position's taps). `None`: the prefill was interrupted. Also returns the positions
    /// restored from a stored prefix state.
    fn prefill(
        model: &K3Model,
        prompt: &[u32],
        prefiller: &mut dyn Prefiller,
        drafting: Option<Drafting<'d>>,
    ) -> Result<Option<(Sequence<'d>, usize)>, GenerateError> {
        let mut draft = drafting.map(DraftState::new);
        if let Some(d) = draft.as_mut() {
            d.prepare(model)?;
        }
        let taps = draft.as_mut().and_then(|d| d.taps.as_mut());
        let Some(Prefilled {
            state,
            logits,
            reused,
            ..
        }) = prefiller.prefill(model, prompt, taps)?
        else {
            return Ok(None);
        };
        if let Some(d) = draft.as_mut() {
            d.observe(0);
        }
        let seq = Sequence {
            state,
            history: prompt.to_vec(),
            prompt_len: prompt.len(),
            logits,
            pending: None,
            draft,
        };
        Ok(Some((seq, reused)))
    }

    /// A sequence over a state that already holds `ids`, and the positions it restored.
    fn restored(
        model: &K3Model,
        ids: &[u32],
        prefilled: Prefilled,
        drafting: Option<Drafting<'d>>,
    ) -> Result<(Sequence<'d>, usize), GenerateError> {
        if prefilled.state.len() != ids.len() {
            return Err(GenerateError::Restored {
                positions: prefilled.state.len(),
                ids: ids.len(),
            });
        }
        let mut draft = drafting.map(DraftState::new);
        if let Some(d) = draft.as_mut() {
            d.prepare(model)?;
        }
        let seq = Sequence {
            state: prefilled.state,
            history: ids.to_vec(),
            prompt_len: ids.len(),
            logits: prefilled.logits,
            pending: None,
            draft,
        };
        Ok((seq, prefilled.reused))
    }

    /// The ids emitted so far.
    pub fn emitted(&self) -> &[u32] {
        &self.history[self.prompt_len..]
    }

    /// The prompt and every emitted id.
    pub fn ids(&self) -> &[u32] {
        &self.history
    }

    /// K3's state: the positions run through the model so far.
    pub fn state(&self) -> &State {
        &self.state
    }

    fn stats(&self) -> SpecStats {
        self.draft
            .as_ref()
            .map(|d| d.stats.clone())
            .unwrap_or_default()
    }

    /// Why the sequence stops before its next step, in the order stop id, budget, context.
    fn stopped(&self, limits: &Limits<'_>) -> Option<StopReason> {
        let emitted = self.emitted();
        if emitted.last().is_some_and(|t| limits.stop_ids.contains(t)) {
            Some(StopReason::Eos)
        } else if limits.max_new.is_some_and(|m| emitted.len() >= m) {
            Some(StopReason::MaxNew)
        } else if emitted.len() >= limits.most(self.prompt_len) {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// One step: K3's first token after the prompt; then one decode, or with a drafter one
    /// draft and verify pass.
    fn step(
        &mut self,
        model: &K3Model,
        batcher: Option<&Batcher>,
        rule: &mut dyn Choose,
        limits: &Limits<'_>,
        clock: &dyn Clock,
        prefill: Duration,
    ) -> Result<Step, GenerateError> {
        let first = self.emitted().len();
        let Some(pending) = self.pending else {
            let logits = std::mem::take(&mut self.logits);
            let logit = self.commit_choice(rule, first, &logits)?;
            return Ok(Step {
                first,
                proposed: 0,
                accepted: 0,
                duration: prefill,
                logit: Some(logit),
                logits: Some(logits),
                policy: self.policy(),
            });
        };
        if let Some(mut d) = self.draft.take() {
            let step = self.drafted_step(model, batcher, rule, limits, clock, &mut d, pending);
            self.draft = Some(d);
            return step;
        }
        let t = clock.now();
        let logits = match batcher {
            Some(b) => b.decode(model, &mut self.state, pending)?,
            None => model.decode(&mut self.state, pending)?,
        };
        let logit = self.commit_choice(rule, first, &logits)?;
        Ok(Step {
            first,
            proposed: 0,
            accepted: 0,
            duration: clock.now().saturating_sub(t),
            logit: Some(logit),
            logits: Some(logits),
            policy: self.policy(),
        })
    }

    /// Choose the token of generated position `step` from `logits` with `rule`, commit it and
    /// return K3's logit for it.
    fn commit_choice(
        &mut self,
        rule: &mut dyn Choose,
        step: usize,
        logits: &[f32],
    ) -> Result<f32, GenerateError> {
        let id = rule.choose(step, logits).map_err(GenerateError::Choose)?;
        let logit = logit_of(logits, id)?;
        rule.accept(id).map_err(GenerateError::Choose)?;
        self.history.push(id);
        self.pending = Some(id);
        Ok(logit)
    }

    /// Propose drafts (never past the token budget: at most room − 1, K3 adds one more),
    /// verify them in one exact pass, commit the accepted ones and K3's own token.
    #[allow(clippy::too_many_arguments)]
    fn drafted_step(
        &mut self,
        model: &K3Model,
        batcher: Option<&Batcher>,
        rule: &mut dyn Choose,
        limits: &Limits<'_>,
        clock: &dyn Clock,
        d: &mut DraftState<'d>,
        pending: u32,
    ) -> Result<Step, GenerateError> {
        let t = clock.now();
        let first = self.emitted().len();
        let room = limits.most(self.prompt_len) - first;
        let ask = d.policy.ask().min(room - 1);
        let mut drafts = if ask > 0 {
            d.drafter.propose(&self.history, ask)
        } else {
            Vec::new()
        };
        drafts.truncate(ask);
        let draft_s = if ask > 0 {
            clock.now().saturating_sub(t).as_secs_f64()
        } else {
            0.0
        };
        let keep = d.policy.cut(d.drafter.confidence(), drafts.len(), draft_s);
        drafts.truncate(keep);
        let position = self.state.position;
        let mut rows = RuleRows {
            rule: &mut *rule,
            step: first,
            stop_ids: limits.stop_ids,
        };
        let state = &mut self.state;
        let taps = d.taps.as_mut();
        let verify = || verify_rows(model, state, pending, &drafts, &mut rows, taps);
        let v = match batcher {
            Some(b) => b.exclusive(drafts.len() + 1, |_| verify()),
            None => verify(),
        }?;
        d.observe(position);
        d.stats.verify_passes += 1;
        d.stats.proposed += drafts.len();
        d.stats.accepted += v.accepted;
        d.stats.drafting_passes += usize::from(!drafts.is_empty());
        let mut stopped = false;
        for &id in &drafts[..v.accepted] {
            self.history.push(id);
            if limits.stop_ids.contains(&id) {
                stopped = true;
                break;
            }
        }
        let (logit, logits) = if stopped {
            (None, None)
        } else {
            rule.accept(v.next).map_err(GenerateError::Choose)?;
            self.history.push(v.next);
            self.pending = Some(v.next);
            (Some(logit_of(&v.next_logits, v.next)?), Some(v.next_logits))
        };
        let duration = clock.now().saturating_sub(t);
        let emitted = self.emitted().len() - first;
        if ask > 0 {
            d.drafter.feedback(&StepFeedback {
                proposed: drafts.len(),
                accepted: v.accepted,
                emitted,
                seconds: duration.as_secs_f64(),
            });
        }
        d.policy.record(
            drafts.len(),
            v.accepted,
            emitted,
            duration.as_secs_f64(),
            draft_s,
        );
        Ok(Step {
            first,
            proposed: drafts.len(),
            accepted: v.accepted,
            duration,
            logit,
            logits,
            policy: d.policy.report(),
        })
    }

    /// The drafting policy's report (plain decoding reports a fixed width of 0).
    fn policy(&self) -> PolicyReport {
        match &self.draft {
            Some(d) => d.policy.report(),
            None => SpecPolicy::fixed(0).report(),
        }
    }
}

impl<'d> DraftState<'d> {
    fn new(drafting: Drafting<'d>) -> DraftState<'d> {
        DraftState {
            drafter: drafting.drafter,
            policy: drafting.policy,
            taps: None,
            stats: SpecStats::default(),
        }
    }

    /// Drafters that read K3's hidden states get the taps of every committed position.
    fn prepare(&mut self, model: &K3Model) -> Result<(), GenerateError> {
        self.taps = match self.drafter.tap_layers() {
            [] => None,
            ids => Some(model.taps(ids)?),
        };
        Ok(())
    }

    /// Hand the taps gathered since the last call (positions `first_position …`) to the
    /// drafter.
    fn observe(&mut self, first_position: usize) {
        if let Some(t) = self.taps.as_mut() {
            self.drafter.observe(first_position, t);
            t.clear();
        }
    }
}

/// K3's logit for `id`; an id outside the vocabulary is the rule's error.
fn logit_of(logits: &[f32], id: u32) -> Result<f32, GenerateError> {
    logits.get(id as usize).copied().ok_or_else(|| {
        GenerateError::Choose(format!(
            "token {id} is outside the vocabulary of {}",
            logits.len()
        ))
    })
}

/// Greedy generation from `prompt` under `opts`, reported as [`GenerateEvent`]s: a thin
/// wrapper over [`Generation`] for callers of the options form.
pub fn generate(
    model: &K3Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    interrupt: &AtomicBool,
    on_event: impl FnMut(GenerateEvent<'_>) -> Result<(), String>,
) -> Result<GenerateOutcome, GenerateError> {
    generate_with(model, prompt, opts, &mut Greedy, interrupt, on_event)
}

/// [`generate`] with the tokens chosen by `rule`.
pub fn generate_with(
    model: &K3Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    rule: &mut dyn Choose,
    interrupt: &AtomicBool,
    mut on_event: impl FnMut(GenerateEvent<'_>) -> Result<(), String>,
) -> Result<GenerateOutcome, GenerateError> {
    let done = Generation::new(model, prompt)
        .stop_ids(opts.stop_ids.clone())
        .max_new(opts.max_new)
        .max_context(opts.max_context)
        .top_logits(opts.top_logits)
        .rule(rule)
        .interrupt(interrupt)
        .run(|ev| match ev {
            Event::Prefilled {
                duration, summary, ..
            } => on_event(GenerateEvent::Prefilled { duration, summary }),
            Event::Committed(c) => match (c.ids, c.logit) {
                (&[id], Some(logit)) => on_event(GenerateEvent::Token {
                    step: c.first,
                    id,
                    logit,
                    duration: c.duration,
                    summary: c.summary,
                }),
                _ => Err("internal: a plain step committed other than one token".into()),
            },
        })?;
    Ok(GenerateOutcome {
        ids: done.ids,
        stop: done.stop,
        prefill_duration: done.prefill_duration,
        total_duration: done.total_duration,
    })
}
