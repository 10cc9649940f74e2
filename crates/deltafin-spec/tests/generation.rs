//! The generation driver's own rules (`deltafin_spec::generation`): the context edge, stop
//! ids, a zero budget, the interrupt, a restored state, and drafted generation emitting
//! exactly the ids of plain greedy generation.

mod common;

use common::Replay;

use std::sync::atomic::{AtomicBool, Ordering};

use deltafin_k3::generate::{GenerateError, StopReason, stop_ids};
use deltafin_k3::model::K3Model;
use deltafin_k3::prefix::{OnePass, Prefiller};
use deltafin_spec::{Event, Finished, Generation, SpecPolicy};

fn model() -> (tempfile::TempDir, K3Model) {
    common::small_model(11)
}

const PROMPT: [u32; 5] = [17, 400, 3, 99, 250];

/// Plain greedy generation with no stop ids.
fn plain(m: &K3Model, max_new: Option<usize>, max_context: usize) -> Finished {
    Generation::new(m, &PROMPT)
        .stop_ids(vec![])
        .max_new(max_new)
        .max_context(max_context)
        .run(|_| Ok(()))
        .unwrap()
}

/// The same generation drafted by a [`Replay`] of `run` (4 drafts at most per pass).
fn drafted(
    m: &K3Model,
    run: &[u32],
    wrong_from: usize,
    max_new: Option<usize>,
    max_context: usize,
    stop: Vec<u32>,
) -> (Finished, usize) {
    let mut d = Replay {
        run: run.to_vec(),
        wrong_from,
        asked: 0,
    };
    let mut policy = SpecPolicy::fixed(4);
    let done = Generation::new(m, &PROMPT)
        .stop_ids(stop)
        .max_new(max_new)
        .max_context(max_context)
        .drafter(&mut d, &mut policy)
        .run(|_| Ok(()))
        .unwrap();
    (done, d.asked)
}

#[test]
fn drafted_generation_emits_the_plain_greedy_ids() {
    let (_d, m) = model();
    let want = plain(&m, Some(24), 4096);
    assert_eq!(want.ids.len(), 24);
    assert_eq!(want.stop, StopReason::MaxNew);
    let mut run = PROMPT.to_vec();
    run.extend_from_slice(&want.ids);
    for wrong_from in [usize::MAX, PROMPT.len() + 7, 0] {
        let (got, asked) = drafted(&m, &run, wrong_from, Some(24), 4096, vec![]);
        assert_eq!(got.ids, want.ids, "drafts wrong from {wrong_from}");
        assert_eq!(got.stop, StopReason::MaxNew);
        assert!(asked > 0);
        assert!(got.stats.proposed > 0);
        if wrong_from == usize::MAX {
            assert!(got.stats.accepted > 0 && got.stats.verify_passes < 23);
        }
        if wrong_from == 0 {
            assert_eq!(got.stats.accepted, 0);
        }
    }
}

#[test]
fn the_context_edge_allows_one_token_past_the_free_positions() {
    let (_d, m) = model();
    let full = plain(&m, Some(16), 4096);
    let mut run = PROMPT.to_vec();
    run.extend_from_slice(&full.ids);
    let p = PROMPT.len();
    for free in [0usize, 1, 3, 6] {
        // The state holds at most p + free positions; the last token is never run through
        // K3, so free + 1 tokens come out.
        let got = plain(&m, None, p + free);
        assert_eq!(got.ids, full.ids[..free + 1], "free {free}");
        assert_eq!(got.stop, StopReason::ContextFull);
        let (d, _) = drafted(&m, &run, usize::MAX, None, p + free, vec![]);
        assert_eq!(d.ids, got.ids, "drafted, free {free}");
        assert_eq!(d.stop, StopReason::ContextFull);
        // A budget that ends at the same token is the budget's stop.
        let got = plain(&m, Some(free + 1), p + free);
        assert_eq!(got.stop, StopReason::MaxNew);
    }
    // A prompt longer than the context is refused.
    let e = Generation::new(&m, &PROMPT)
        .max_context(p - 1)
        .run(|_| Ok(()))
        .unwrap_err();
    assert!(
        matches!(
            e,
            GenerateError::PromptTooLong {
                prompt: 5,
                max_context: 4
            }
        ),
        "{e}"
    );
}

#[test]
fn a_stop_id_is_emitted_and_ends_the_generation() {
    let (_d, m) = model();
    let full = plain(&m, Some(16), 4096);
    let stop = full.ids[4];
    let first = full.ids.iter().position(|&t| t == stop).unwrap();
    let got = Generation::new(&m, &PROMPT)
        .stop_ids(vec![stop])
        .max_new(Some(16))
        .run(|_| Ok(()))
        .unwrap();
    assert_eq!(got.ids, full.ids[..=first]);
    assert_eq!(got.stop, StopReason::Eos);
    assert_eq!(got.completion(), &full.ids[..first]);
    let mut run = PROMPT.to_vec();
    run.extend_from_slice(&full.ids);
    let (d, _) = drafted(&m, &run, usize::MAX, Some(16), 4096, vec![stop]);
    assert_eq!(d.ids, got.ids);
    assert_eq!(d.stop, StopReason::Eos);
    // A chat turn stops at the library's chat stop ids.
    let chat = Generation::new(&m, &PROMPT)
        .chat(true)
        .max_new(Some(16))
        .run(|_| Ok(()))
        .unwrap();
    let explicit = Generation::new(&m, &PROMPT)
        .stop_ids(stop_ids(true))
        .max_new(Some(16))
        .run(|_| Ok(()))
        .unwrap();
    assert_eq!((chat.ids, chat.stop), (explicit.ids, explicit.stop));
}

#[test]
fn a_zero_budget_prefills_and_emits_nothing() {
    let (_d, m) = model();
    let full = plain(&m, Some(4), 4096);
    let mut run = PROMPT.to_vec();
    run.extend_from_slice(&full.ids);
    for with_drafter in [false, true] {
        let mut d = Replay {
            run: run.clone(),
            wrong_from: usize::MAX,
            asked: 0,
        };
        let mut policy = SpecPolicy::fixed(4);
        let mut g = Generation::new(&m, &PROMPT).max_new(Some(0)).top_logits(3);
        if with_drafter {
            g = g.drafter(&mut d, &mut policy);
        }
        let (mut prefilled, mut committed) = (0, 0);
        let done = g
            .run(|ev| {
                match ev {
                    Event::Prefilled { summary, .. } => {
                        assert_eq!(summary.map(|s| s.top.len()), Some(3));
                        prefilled += 1;
                    }
                    Event::Committed(_) => committed += 1,
                }
                Ok(())
            })
            .unwrap();
        assert!(done.ids.is_empty());
        assert_eq!(done.stop, StopReason::MaxNew);
        assert_eq!((prefilled, committed), (1, 0), "drafter {with_drafter}");
        assert_eq!(d.asked, 0);
    }
}

#[test]
fn the_interrupt_stops_at_a_step_boundary() {
    let (_d, m) = model();
    let full = plain(&m, Some(12), 4096);
    let mut run = PROMPT.to_vec();
    run.extend_from_slice(&full.ids);
    for with_drafter in [false, true] {
        // Raised by the consumer after the third step: nothing more is committed.
        let flag = AtomicBool::new(false);
        let mut d = Replay {
            run: run.clone(),
            wrong_from: usize::MAX,
            asked: 0,
        };
        let mut policy = SpecPolicy::fixed(2);
        let mut g = Generation::new(&m, &PROMPT)
            .stop_ids(vec![])
            .max_new(Some(12))
            .interrupt(&flag);
        if with_drafter {
            g = g.drafter(&mut d, &mut policy);
        }
        let mut steps = 0;
        let mut seen = Vec::new();
        let done = g
            .run(|ev| {
                if let Event::Committed(c) = ev {
                    assert_eq!(c.first, seen.len());
                    seen.extend_from_slice(c.ids);
                    steps += 1;
                    if steps == 3 {
                        flag.store(true, Ordering::Relaxed);
                    }
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(done.stop, StopReason::Interrupted);
        assert_eq!(steps, 3);
        assert_eq!(done.ids, seen);
        assert_eq!(
            done.ids,
            full.ids[..done.ids.len()],
            "drafter {with_drafter}"
        );
    }
    // Raised before: a one-pass prefill runs, then nothing is emitted; an aligned prefill
    // stops before its first layer and reports nothing.
    let flag = AtomicBool::new(true);
    let done = Generation::new(&m, &PROMPT)
        .interrupt(&flag)
        .run(|_| Ok(()))
        .unwrap();
    assert_eq!((done.ids.len(), done.stop), (0, StopReason::Interrupted));
    let mut events = 0;
    let done = Generation::new(&m, &PROMPT)
        .prefix_cache(None)
        .interrupt(&flag)
        .run(|_| {
            events += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        (done.ids.len(), done.stop, events),
        (0, StopReason::Interrupted, 0)
    );
}

#[test]
fn a_restored_state_continues_as_the_prompt_would() {
    let (_d, m) = model();
    let want = plain(&m, Some(8), 4096);
    let prefilled = OnePass.prefill(&m, &PROMPT, None).unwrap().unwrap();
    let got = Generation::resume(&m, &PROMPT, prefilled)
        .stop_ids(vec![])
        .max_new(Some(8))
        .run(|_| Ok(()))
        .unwrap();
    assert_eq!(got.ids, want.ids);
    // Aligned passes (no cache) give the same ids too.
    let aligned = Generation::new(&m, &PROMPT)
        .stop_ids(vec![])
        .max_new(Some(8))
        .prefix_cache(None)
        .run(|_| Ok(()))
        .unwrap();
    assert_eq!(aligned.ids, want.ids);
    // A state that does not hold the ids it comes with is refused.
    let prefilled = OnePass.prefill(&m, &PROMPT, None).unwrap().unwrap();
    let e = Generation::resume(&m, &PROMPT[..3], prefilled)
        .run(|_| Ok(()))
        .unwrap_err();
    assert!(
        matches!(
            e,
            GenerateError::Restored {
                positions: 5,
                ids: 3
            }
        ),
        "{e}"
    );
}

#[test]
fn a_failing_consumer_stops_the_generation_with_its_error() {
    let (_d, m) = model();
    let mut calls = 0;
    let e = Generation::new(&m, &PROMPT)
        .max_new(Some(8))
        .run(|_| {
            calls += 1;
            if calls == 3 {
                Err("closed".into())
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(
        matches!(e, GenerateError::Sink(ref s) if s == "closed"),
        "{e}"
    );
    assert_eq!(calls, 3);
}
