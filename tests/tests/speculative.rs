//! Speculative decoding is exact: whatever a drafter proposes, the emitted ids equal plain
//! greedy K3 (synthesized tiny checkpoint: real vocabulary, KDA/MLA pattern, MXFP4 experts).

use deltafin_k3::generate::Greedy;
use deltafin_k3::model::{K3Model, LogitRows};
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS, Tokenizer};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_spec::policy::PROBE_STEPS;
use deltafin_spec::{
    Clock, Drafter, PolicyMode, PolicyReport, PolicyState, RuleRows, SpecPolicy, SpecStats,
    generate_speculative, generate_with_policy, verify,
};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

fn setup() -> (tempfile::TempDir, K3Model, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(SynthDims::tiny(), 21)).unwrap();
    let model = open_model(dir.path(), &EngineOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, model, tok)
}

const MAX_NEW: usize = 16;
const STOP: [u32; 2] = [END_OF_MSG, EOS];

fn plain_greedy(model: &K3Model, prompt: &[u32]) -> Vec<u32> {
    deltafin_tests::plain_greedy(model, prompt, MAX_NEW)
}

/// Knows the true continuation; proposes it, optionally corrupting the draft at position
/// `corrupt_at` of every proposal.
struct Oracle {
    prompt_len: usize,
    truth: Vec<u32>,
    corrupt_at: Option<usize>,
}

impl Drafter for Oracle {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let done = history.len() - self.prompt_len;
        let mut d: Vec<u32> = self.truth.iter().skip(done).take(max).copied().collect();
        if let Some(j) = self.corrupt_at
            && j < d.len()
        {
            d[j] = (d[j] + 1) % 163_840;
        }
        d
    }
}

/// Seeded pseudo-random token ids.
struct Random(u64);

impl Drafter for Random {
    fn propose(&mut self, _history: &[u32], max: usize) -> Vec<u32> {
        (0..max)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 33) % 163_840) as u32
            })
            .collect()
    }
}

/// Repeats the last token (a typical cheap n-gram guess that is usually wrong).
struct Repeat;

impl Drafter for Repeat {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        history.last().map(|&t| vec![t; max]).unwrap_or_default()
    }
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Kimi K3 routes every token to sixteen of 896 experts per layer; the spine stays resident.",
];

#[test]
fn verify_rows_are_bit_identical_to_decode() {
    let (_d, model, tok) = setup();
    let prompt = tok.encode_ordinary(PROMPTS[2]);
    let truth = plain_greedy(&model, &prompt);
    // Decode token by token, keeping each step's logits.
    let mut s1 = model.new_state();
    model.prefill(&mut s1, &prompt).unwrap();
    let mut want = Vec::new();
    for &t in &truth[..8] {
        want.push(model.decode(&mut s1, t).unwrap());
    }
    // One exact pass over the same 8 tokens.
    let mut s2 = model.new_state();
    model.prefill(&mut s2, &prompt).unwrap();
    let got = model
        .forward_exact(&mut s2, &truth[..8], LogitRows::All)
        .unwrap();
    for (i, w) in want.iter().enumerate() {
        assert!(
            got.row(i)
                .iter()
                .zip(w)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i} differs from one-token decode"
        );
    }
    assert_eq!(
        s1, s2,
        "states after decode and after the exact pass differ"
    );
}

#[test]
fn rejected_drafts_roll_the_state_back_exactly() {
    let (_d, model, tok) = setup();
    let prompt = tok.encode_ordinary(PROMPTS[0]);
    let truth = plain_greedy(&model, &prompt);
    let mut reference = model.new_state();
    model.prefill(&mut reference, &prompt).unwrap();
    let mut state = reference.clone();
    // Two right drafts, then wrong ones.
    let drafts = [truth[1], truth[2], truth[3] ^ 1, 7, 9];
    let mut rows = RuleRows {
        rule: &mut Greedy,
        step: 1,
        stop_ids: &[],
    };
    let v = verify(&model, &mut state, truth[0], &drafts, &mut rows, None).unwrap();
    assert_eq!(v.accepted, 2);
    assert_eq!(v.next, truth[3]);
    model
        .forward_exact(&mut reference, &truth[..3], LogitRows::Last)
        .unwrap();
    assert_eq!(
        state, reference,
        "state after rollback differs from feeding the accepted tokens"
    );
}

#[test]
fn speculative_output_equals_plain_greedy_for_every_drafter() {
    let (_d, model, tok) = setup();
    let stop = AtomicBool::new(false);
    for text in PROMPTS {
        let prompt = tok.encode_ordinary(text);
        let truth = plain_greedy(&model, &prompt);
        let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
            (
                "perfect",
                Box::new(Oracle {
                    prompt_len: prompt.len(),
                    truth: truth.clone(),
                    corrupt_at: None,
                }),
            ),
            (
                "adversarial@0",
                Box::new(Oracle {
                    prompt_len: prompt.len(),
                    truth: truth.clone(),
                    corrupt_at: Some(0),
                }),
            ),
            (
                "adversarial@2",
                Box::new(Oracle {
                    prompt_len: prompt.len(),
                    truth: truth.clone(),
                    corrupt_at: Some(2),
                }),
            ),
            ("random", Box::new(Random(5))),
            ("repeat", Box::new(Repeat)),
        ];
        for (name, d) in drafters.iter_mut() {
            let widths: &[usize] = if *name == "perfect" {
                &[1, 3, 7]
            } else {
                &[2, 7]
            };
            for &width in widths {
                let (ids, stats) =
                    generate_speculative(&model, &prompt, MAX_NEW, &STOP, width, d.as_mut(), &stop)
                        .unwrap();
                assert_eq!(ids, truth, "{name} width {width} on {text:?}");
                if *name == "perfect" {
                    assert_eq!(
                        stats.accepted, stats.proposed,
                        "perfect drafts must all be accepted"
                    );
                    assert!(
                        stats.verify_passes < truth.len() - 1,
                        "no speed-up in passes: {stats:?}"
                    );
                }
                if *name == "adversarial@0" {
                    assert_eq!(stats.accepted, 0);
                }
            }
        }
    }
}

/// A fake clock: every reading advances it by one tick (1 ms), so every step (two readings)
/// costs the same whatever its width; a [`Costly`] drafter adds its own ticks.
#[derive(Clone)]
struct Ticks(Rc<Cell<u64>>);

impl Clock for Ticks {
    fn now(&self) -> Duration {
        let t = self.0.get();
        self.0.set(t + 1);
        Duration::from_millis(t)
    }
}

/// Wraps a drafter; each proposal costs `ticks` on the fake clock.
struct Costly<D> {
    inner: D,
    clock: Ticks,
    ticks: u64,
}

impl<D: Drafter> Drafter for Costly<D> {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let c = &self.clock.0;
        c.set(c.get() + self.ticks);
        self.inner.propose(history, max)
    }
}

fn with_policy(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    drafter: &mut dyn Drafter,
    mode: PolicyMode,
    width: usize,
    clock: &Ticks,
) -> (Vec<u32>, SpecStats, Vec<PolicyReport>) {
    let mut policy = SpecPolicy::new(mode, width, 0.03);
    let mut reports = Vec::new();
    let (ids, stats) = generate_with_policy(
        model,
        prompt,
        max_new,
        &STOP,
        drafter,
        &mut Greedy,
        &mut policy,
        clock,
        &AtomicBool::new(false),
        |c| {
            reports.push(c.policy);
            Ok(())
        },
    )
    .unwrap();
    (ids, stats, reports)
}

#[test]
fn auto_and_on_policies_are_exact_and_auto_drafts_only_when_it_pays() {
    const LONG: usize = 56;
    let (_d, model, tok) = setup();
    let prompt = tok.encode_ordinary(PROMPTS[0]);
    let truth = deltafin_tests::plain_greedy(&model, &prompt, LONG);
    assert_eq!(
        truth.len(),
        LONG,
        "the tiny model stopped early; pick another prompt"
    );
    let clock = Ticks(Rc::new(Cell::new(0)));
    let perfect = || Oracle {
        prompt_len: prompt.len(),
        truth: truth.clone(),
        corrupt_at: None,
    };

    // Exactness under every policy, width and drafter.
    for mode in [PolicyMode::Auto, PolicyMode::On] {
        for width in [1, 3, 8] {
            let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
                ("perfect", Box::new(perfect())),
                (
                    "adversarial@1",
                    Box::new(Oracle {
                        prompt_len: prompt.len(),
                        truth: truth.clone(),
                        corrupt_at: Some(1),
                    }),
                ),
                ("random", Box::new(Random(9))),
                ("repeat", Box::new(Repeat)),
                (
                    "slow perfect",
                    Box::new(Costly {
                        inner: perfect(),
                        clock: clock.clone(),
                        ticks: 20,
                    }),
                ),
            ];
            for (name, d) in drafters.iter_mut() {
                let (ids, stats, _) =
                    with_policy(&model, &prompt, LONG, d.as_mut(), mode, width, &clock);
                assert_eq!(ids, truth, "{name} {mode:?} width {width}");
                assert!(stats.accepted <= stats.proposed);
            }
        }
    }

    // A perfect, cheap drafter: auto probes, then keeps drafting at the full width.
    let (_, stats, reports) = with_policy(
        &model,
        &prompt,
        LONG,
        &mut perfect(),
        PolicyMode::Auto,
        7,
        &clock,
    );
    let last = reports.last().unwrap();
    assert_eq!(last.state, PolicyState::Drafting, "{reports:?}");
    assert_eq!(last.switched_off, 0);
    assert!(last.speedup.unwrap() > 1.0, "{last:?}");
    assert_eq!(stats.accepted, stats.proposed);
    assert!(stats.verify_passes < LONG / 3, "{stats:?}");

    // A drafter that is always wrong: switched off after the probe; plain decode after.
    let (_, stats, reports) = with_policy(
        &model,
        &prompt,
        LONG,
        &mut Random(3),
        PolicyMode::Auto,
        7,
        &clock,
    );
    assert!(
        reports.iter().any(|r| r.state == PolicyState::Plain),
        "{reports:?}"
    );
    assert!(reports.last().unwrap().switched_off >= 1);
    assert!(stats.drafting_passes <= 2 * PROBE_STEPS, "{stats:?}");
    // `on` keeps drafting it (every pass after the one baseline step and before the last; the
    // width then follows the cost model: wide here, where the fake clock makes width free).
    let (_, stats, reports) = with_policy(
        &model,
        &prompt,
        LONG,
        &mut Random(3),
        PolicyMode::On,
        7,
        &clock,
    );
    assert_eq!(reports.last().unwrap().state, PolicyState::Drafting);
    assert!(
        stats.drafting_passes + 2 >= stats.verify_passes,
        "{stats:?}"
    );

    // Always right but 20 plain steps slow: auto measures no speed-up and stops drafting.
    let mut slow = Costly {
        inner: perfect(),
        clock: clock.clone(),
        ticks: 20,
    };
    let (_, _, reports) = with_policy(
        &model,
        &prompt,
        LONG,
        &mut slow,
        PolicyMode::Auto,
        7,
        &clock,
    );
    let off = reports.iter().position(|r| r.state == PolicyState::Plain);
    assert!(off.is_some_and(|i| i <= 2 + PROBE_STEPS + 1), "{reports:?}");
}
