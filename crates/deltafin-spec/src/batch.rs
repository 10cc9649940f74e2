//! Several generations sharing K3: their decode steps run together in one pass
//! ([`K3Model::forward_batch`]), everything else takes turns.
//!
//! Each generation keeps its own thread, its [`Generation`](crate::Generation) driver and its
//! [`Sequence`](crate::Sequence); a [`Batcher`] shared by them decides what runs on the model:
//!
//! - A **decode step** ([`Batcher::decode`]) is queued; the first waiting thread that finds
//!   the model free takes every queued step and runs them as one batch (each weight matrix
//!   and routed expert read once for all of them), then hands each its logits. It waits
//!   (at most [`GATHER`]) until every generation that is decoding has queued its step, so the
//!   batch holds all of them rather than whoever came first.
//! - Anything else — a prompt's prefill, a drafted verification — takes an **exclusive turn**
//!   ([`Batcher::exclusive`]), shortest work first (a prompt's length; ties in arrival order).
//!   A prefill offers its turn back after every layer ([`Turn::yield_now`]): to shorter work
//!   at once, so a short prompt arriving during a long prefill waits at most one of its
//!   layers; to waiting decode steps once it has held the model for as long as their last
//!   batch took (at least [`SLICE`]), so a new request never freezes the running streams for
//!   its whole prefill (they run at about half speed during it), and a short prefill runs
//!   through in one turn. (Over a streamed spine, whose reads go one pass at a time, a prefill keeps its
//!   turn for the whole prompt.)
//! - When both wait, decode batches and exclusive turns alternate.
//!
//! **Exactness.** A segment's logits and state from [`K3Model::forward_batch`] are, bit for
//! bit, those of the segment run alone (docs/NUMERICS.md, "Several sequences in one pass"),
//! and the exclusive turns run exactly what a generation alone runs. So a generation's ids,
//! logits and logprobs never depend on what runs beside it; only its timing does.
//!
//! The threads that wait here must not be the kernels' pool threads (the pass a batch leader
//! starts needs them): call [`Generation::run`](crate::Generation::run) with a batcher from an
//! ordinary thread, never inside [`deltafin_kernels::pool::run_warm`].

use deltafin_k3::error::ModelError;
use deltafin_k3::model::state::State;
use deltafin_k3::model::{K3Model, KdaForm, LogitRows, Segment};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Longest a batch leader waits for the other decoding generations to queue their steps.
pub const GATHER: Duration = Duration::from_millis(5);

/// Least time an exclusive turn holds the model before it gives way to waiting decode steps.
pub const SLICE: Duration = Duration::from_millis(20);

/// The scheduler several generations share (see the module documentation).
#[derive(Default)]
pub struct Batcher {
    inner: Mutex<Inner>,
    changed: Condvar,
}

/// Counters of a [`Batcher`] (for `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Generations registered now.
    pub members: usize,
    /// Decode batches run.
    pub batches: u64,
    /// Decode steps run in them (÷ `batches`: the mean batch size).
    pub batched_steps: u64,
    /// The largest batch.
    pub largest: usize,
    /// Exclusive turns taken (a prefill takes one per layer).
    pub exclusive_turns: u64,
    /// Decode steps waiting for a batch now.
    pub queued_steps: usize,
    /// Exclusive turns waiting now.
    pub waiting_turns: usize,
    /// How long the pass on the model now (a decode batch or an exclusive turn) has run;
    /// zero when the model is free. A figure that keeps growing is a stuck pass.
    pub running_for: Duration,
}

#[derive(Default)]
struct Inner {
    /// A pass (batch or exclusive turn) is running.
    busy: bool,
    /// Since when (set and cleared with `busy`).
    busy_since: Option<Instant>,
    /// The last pass was an exclusive turn (the next one goes to a waiting decode batch).
    last_exclusive: bool,
    /// How long the last decode batch took.
    last_batch: Duration,
    /// Generations registered ([`Member`]), and how many of them are in or waiting for an
    /// exclusive turn (the others are decoding and will queue steps).
    members: usize,
    exclusive_members: usize,
    next_ticket: u64,
    /// Decode steps waiting for a batch.
    queued: Vec<Job>,
    /// When the oldest queued step was queued.
    oldest: Option<Instant>,
    /// Finished steps, by ticket.
    done: HashMap<u64, StepResult>,
    /// Exclusive turns waiting: (work, ticket); the least work goes first, then the oldest.
    exclusive: Vec<(usize, u64)>,
    stats: BatchStats,
}

/// A finished decode step: the advanced state and the logits, or the pass's error.
type StepResult = Result<(State, Vec<f32>), ModelError>;

struct Job {
    ticket: u64,
    state: State,
    token: u32,
}

impl Inner {
    fn set_busy(&mut self, busy: bool) {
        self.busy = busy;
        self.busy_since = busy.then(Instant::now);
    }

    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// Whether a decode batch may start now (`now`: the gathering deadline is checked).
    fn batch_due(&self, now: Instant) -> bool {
        if self.busy || self.queued.is_empty() {
            return false;
        }
        if !self.exclusive.is_empty() && !self.last_exclusive {
            return false;
        }
        let decoding = self.members.saturating_sub(self.exclusive_members);
        self.queued.len() >= decoding || self.oldest.is_some_and(|t| now >= t + GATHER)
    }

    /// The exclusive turn to go next.
    fn next_turn(&self) -> Option<(usize, u64)> {
        self.exclusive.iter().min().copied()
    }

    /// Whether the exclusive turn `ticket` may start now.
    fn turn_due(&self, ticket: u64) -> bool {
        !self.busy
            && self.next_turn().is_some_and(|(_, t)| t == ticket)
            && (self.queued.is_empty() || !self.last_exclusive)
    }
}

impl Batcher {
    /// A batcher with no generations.
    pub fn new() -> Batcher {
        Batcher::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'g>(
        &self,
        g: MutexGuard<'g, Inner>,
        timeout: Option<Duration>,
    ) -> MutexGuard<'g, Inner> {
        match timeout {
            Some(t) => {
                self.changed
                    .wait_timeout(g, t)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => self.changed.wait(g).unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> BatchStats {
        let g = self.lock();
        BatchStats {
            members: g.members,
            queued_steps: g.queued.len(),
            waiting_turns: g.exclusive.len(),
            running_for: g.busy_since.map_or(Duration::ZERO, |t| t.elapsed()),
            ..g.stats
        }
    }

    /// Register a generation for as long as the guard lives: a decode batch waits (at most
    /// [`GATHER`]) for the steps of every registered generation that is not in an exclusive
    /// turn.
    pub fn member(&self) -> Member<'_> {
        self.lock().members += 1;
        Member { batcher: self }
    }

    /// One decode step of `state` with `token`, run in a batch with the other generations'
    /// steps: the logits of `token`'s position, bit-identical to
    /// [`K3Model::decode`]`(state, token)`. On an error the state must be discarded (it is
    /// left empty).
    pub fn decode(
        &self,
        model: &K3Model,
        state: &mut State,
        token: u32,
    ) -> Result<Vec<f32>, ModelError> {
        let mut g = self.lock();
        let ticket = g.ticket();
        let taken = std::mem::replace(
            state,
            State {
                layers: Vec::new(),
                position: 0,
            },
        );
        g.queued.push(Job {
            ticket,
            state: taken,
            token,
        });
        g.oldest.get_or_insert_with(Instant::now);
        self.changed.notify_all();
        loop {
            if let Some(result) = g.done.remove(&ticket) {
                return result.map(|(s, logits)| {
                    *state = s;
                    logits
                });
            }
            let now = Instant::now();
            if g.batch_due(now) {
                let jobs = std::mem::take(&mut g.queued);
                g.oldest = None;
                g.set_busy(true);
                drop(g);
                // Released even if the pass panics: the waiters then get an error.
                let mut lead = Lead {
                    batcher: self,
                    tickets: jobs.iter().map(|j| j.ticket).collect(),
                    results: None,
                    took: Duration::ZERO,
                };
                let started = Instant::now();
                lead.results = Some(run_batch(model, jobs));
                lead.took = started.elapsed();
                drop(lead);
                g = self.lock();
                continue;
            }
            // Waiting to gather: wake at the deadline even if nothing changes.
            let timeout = match (g.busy, g.oldest) {
                (false, Some(t)) => Some((t + GATHER).saturating_duration_since(now)),
                _ => None,
            };
            g = self.wait(g, timeout.map(|t| t.max(Duration::from_micros(50))));
        }
    }

    /// Run `f` alone on the model (a prefill, a verification), when its turn comes (the least
    /// `work` first: the rows it runs); `f` may give the turn back between its passes or layers
    /// with [`Turn::yield_now`].
    pub fn exclusive<R>(&self, work: usize, f: impl FnOnce(&Turn<'_>) -> R) -> R {
        {
            let mut g = self.lock();
            g.exclusive_members += 1;
            let ticket = g.ticket();
            g.exclusive.push((work, ticket));
            self.changed.notify_all();
            g = self.acquire(g, ticket);
            drop(g);
        }
        let _release = Release { batcher: self };
        f(&Turn {
            batcher: self,
            work,
            since: Mutex::new(Instant::now()),
        })
    }

    /// Wait until the exclusive turn `ticket` (queued) is due, and take it.
    fn acquire<'g>(&'g self, mut g: MutexGuard<'g, Inner>, ticket: u64) -> MutexGuard<'g, Inner> {
        loop {
            if g.turn_due(ticket) {
                g.exclusive.retain(|&(_, t)| t != ticket);
                g.set_busy(true);
                g.stats.exclusive_turns += 1;
                return g;
            }
            g = self.wait(g, None);
        }
    }
}

/// The leader of a decode batch: on drop, the model is free again and every ticket has its
/// result (an error for each when the pass did not finish).
struct Lead<'b> {
    batcher: &'b Batcher,
    tickets: Vec<u64>,
    results: Option<Vec<(u64, StepResult)>>,
    took: Duration,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut g = self.batcher.lock();
        g.set_busy(false);
        g.last_exclusive = false;
        match self.results.take() {
            Some(results) => {
                g.last_batch = self.took;
                g.stats.batches += 1;
                g.stats.batched_steps += results.len() as u64;
                g.stats.largest = g.stats.largest.max(results.len());
                g.done.extend(results);
            }
            None => {
                let failed = ModelError::Dims("a batched decode pass panicked".into());
                for &t in &self.tickets {
                    g.done.insert(t, Err(failed.clone()));
                }
            }
        }
        self.batcher.changed.notify_all();
    }
}

/// An exclusive turn ending (normally or by a panic): the model is free again.
struct Release<'b> {
    batcher: &'b Batcher,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let mut g = self.batcher.lock();
        g.set_busy(false);
        g.last_exclusive = true;
        g.exclusive_members = g.exclusive_members.saturating_sub(1);
        self.batcher.changed.notify_all();
    }
}

/// A generation registered with a [`Batcher`] ([`Batcher::member`]).
pub struct Member<'b> {
    batcher: &'b Batcher,
}

impl Drop for Member<'_> {
    fn drop(&mut self) {
        let mut g = self.batcher.lock();
        g.members = g.members.saturating_sub(1);
        // A batch that was waiting for this generation's step may be due now.
        self.batcher.changed.notify_all();
    }
}

/// An exclusive turn on the model ([`Batcher::exclusive`]).
pub struct Turn<'b> {
    batcher: &'b Batcher,
    work: usize,
    /// When this turn last took the model.
    since: Mutex<Instant>,
}

impl Turn<'_> {
    /// [`Turn::yield_now`] between two layers of a pass over `model`, where a pass may stop
    /// midway: not over a streamed spine, whose pass holds the spine reader from its first
    /// layer to its last (another pass in between would wait for it forever), so a prefill
    /// there keeps its turn for the whole prompt.
    pub fn yield_between_layers(&self, model: &K3Model) {
        if model.spine_stream.is_none() {
            self.yield_now();
        }
    }

    /// Let shorter work run, or waiting decode steps once this turn has held the model for as
    /// long as their last batch took (at least [`SLICE`]); then take the turn back. Returns at
    /// once when neither is due.
    pub fn yield_now(&self) {
        let b = self.batcher;
        let mut g = b.lock();
        let shorter = g.exclusive.iter().any(|&(w, _)| w < self.work);
        let since = *self.since.lock().unwrap_or_else(PoisonError::into_inner);
        let decodes_due = !g.queued.is_empty() && since.elapsed() >= g.last_batch.max(SLICE);
        if !shorter && !decodes_due {
            return;
        }
        g.set_busy(false);
        g.last_exclusive = true;
        let ticket = g.ticket();
        g.exclusive.push((self.work, ticket));
        b.changed.notify_all();
        drop(b.acquire(g, ticket));
        *self.since.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }
}

/// Run `jobs` as one [`K3Model::forward_batch`] (on the kernels' pool) and pair each ticket
/// with its state and logits, or with the pass's error.
fn run_batch(model: &K3Model, mut jobs: Vec<Job>) -> Vec<(u64, StepResult)> {
    let tokens: Vec<[u32; 1]> = jobs.iter().map(|j| [j.token]).collect();
    let result = deltafin_kernels::pool::run_warm(|| {
        let mut segments: Vec<Segment<'_>> = jobs
            .iter_mut()
            .zip(&tokens)
            .map(|(j, t)| Segment {
                state: &mut j.state,
                tokens: t,
                want: LogitRows::Last,
                kda_form: KdaForm::Recurrent,
            })
            .collect();
        model.forward_batch(&mut segments)
    });
    match result {
        Ok(logits) if logits.len() == jobs.len() => jobs
            .into_iter()
            .zip(logits)
            .map(|(j, l)| (j.ticket, Ok((j.state, l.values))))
            .collect(),
        Ok(logits) => {
            let e = ModelError::Dims(format!(
                "a batch of {} decode steps returned {} logit rows",
                jobs.len(),
                logits.len()
            ));
            jobs.into_iter()
                .map(|j| (j.ticket, Err(e.clone())))
                .collect()
        }
        Err(e) => jobs
            .into_iter()
            .map(|j| (j.ticket, Err(e.clone())))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// The stats show a pass on the model and the turns waiting for it, and clear when it ends.
    #[test]
    fn stats_show_the_running_pass_and_the_waiting_turns() {
        let b = Batcher::new();
        assert_eq!(b.stats().running_for, Duration::ZERO);
        let (started, wait_started) = mpsc::channel();
        let (release, wait_release) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let b = &b;
            s.spawn(move || {
                b.exclusive(10, |_| {
                    started.send(()).unwrap();
                    wait_release.recv().unwrap();
                })
            });
            wait_started.recv().unwrap();
            std::thread::sleep(Duration::from_millis(20));
            assert!(b.stats().running_for >= Duration::from_millis(20));
            s.spawn(move || b.exclusive(5, |_| ()));
            let t = Instant::now();
            while b.stats().waiting_turns == 0 {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the turn never queued"
                );
                std::thread::yield_now();
            }
            assert_eq!(b.stats().queued_steps, 0);
            release.send(()).unwrap();
        });
        let st = b.stats();
        assert_eq!(
            (st.running_for, st.waiting_turns, st.exclusive_turns),
            (Duration::ZERO, 0, 2)
        );
    }
}
