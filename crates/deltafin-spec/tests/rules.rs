//! Speculative decoding under a token rule other than argmax (the hook constrained decoding
//! and sampling use): the ids equal plain decoding with the same rule for every drafter, and a
//! draft the rule would not choose is rejected.

mod common;

use std::sync::atomic::AtomicBool;

use deltafin_k3::generate::{Choose, GenerateOptions, Greedy, greedy};
use deltafin_k3::model::K3Model;
use deltafin_spec::{Drafter, SpecPolicy, WallClock, generate_with, generate_with_policy};

/// Forbids, at step `s`, every id with `(id + s)` even and the id accepted just before: a rule
/// that depends on the step and on the history, as a grammar or a seeded sampler does.
#[derive(Default)]
struct Picky {
    last: Option<u32>,
}

impl Choose for Picky {
    fn choose(&mut self, step: usize, logits: &[f32]) -> Result<u32, String> {
        let mut best: Option<(u32, f32)> = None;
        for (id, &l) in logits.iter().enumerate() {
            let id = id as u32;
            if (id as usize + step).is_multiple_of(2) || Some(id) == self.last {
                continue;
            }
            if best.is_none_or(|(_, b)| l > b) {
                best = Some((id, l));
            }
        }
        best.map(|b| b.0).ok_or_else(|| "nothing allowed".into())
    }
    fn accept(&mut self, id: u32) -> Result<(), String> {
        self.last = Some(id);
        Ok(())
    }
}

/// Proposes the continuation of a known run (the prompt first): an agreeing drafter.
struct Replay {
    run: Vec<u32>,
}

impl Drafter for Replay {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        self.run
            .iter()
            .skip(history.len())
            .take(max)
            .copied()
            .collect()
    }
}

fn model() -> (tempfile::TempDir, K3Model) {
    common::small_model(7)
}

fn plain(model: &K3Model, prompt: &[u32], n: usize, rule: &mut dyn Choose) -> Vec<u32> {
    let opts = GenerateOptions {
        max_new: Some(n),
        stop_ids: vec![],
        max_context: 4096,
        top_logits: 0,
    };
    generate_with(model, prompt, &opts, rule, &AtomicBool::new(false), |_| {
        Ok(())
    })
    .unwrap()
    .ids
}

fn drafted(
    model: &K3Model,
    prompt: &[u32],
    n: usize,
    drafter: &mut dyn Drafter,
    rule: &mut dyn Choose,
) -> (Vec<u32>, usize, usize) {
    let mut policy = SpecPolicy::fixed(4);
    let mut proposed = 0;
    let mut accepted = 0;
    let (ids, _) = generate_with_policy(
        model,
        prompt,
        n,
        &[],
        drafter,
        rule,
        &mut policy,
        &WallClock::new(),
        &AtomicBool::new(false),
        |c| {
            proposed += c.proposed;
            accepted += c.accepted;
            Ok(())
        },
    )
    .unwrap();
    (ids, proposed, accepted)
}

#[test]
fn drafting_under_a_rule_equals_plain_decoding_with_it() {
    let (_dir, m) = model();
    let prompt = [5u32, 77, 300, 12];
    let n = 24;
    let want = plain(&m, &prompt, n, &mut Picky::default());
    let greedy_ids = plain(&m, &prompt, n, &mut Greedy);
    assert_ne!(want, greedy_ids, "the rule must change the answer");
    for (i, &id) in want.iter().enumerate() {
        assert_eq!((id as usize + i) % 2, 1, "step {i}");
    }

    // Agreeing: every draft is the rule's own choice and is accepted.
    let mut run = prompt.to_vec();
    run.extend(&want);
    let (ids, proposed, accepted) =
        drafted(&m, &prompt, n, &mut Replay { run }, &mut Picky::default());
    assert_eq!(ids, want);
    assert!(
        proposed > 0 && accepted == proposed,
        "{accepted}/{proposed}"
    );

    // Plain argmax drafts: the rule forbids some of them, and those are rejected.
    let mut run = prompt.to_vec();
    run.extend(&greedy_ids);
    let (ids, proposed, accepted) =
        drafted(&m, &prompt, n, &mut Replay { run }, &mut Picky::default());
    assert_eq!(ids, want);
    assert!(proposed > accepted, "{accepted}/{proposed}");

    // Noise.
    let mut noise = Replay {
        run: (0..200u32).map(|i| (i * 37 + 11) % 1024).collect(),
    };
    let (ids, _, _) = drafted(&m, &prompt, n, &mut noise, &mut Picky::default());
    assert_eq!(ids, want);
}

#[test]
fn greedy_rule_is_argmax() {
    let l = [0.5f32, 3.0, 3.0, -1.0];
    assert_eq!(Greedy.choose(9, &l).unwrap(), greedy(&l));
}
