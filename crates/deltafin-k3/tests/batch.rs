//! Several sequences in one pass ([`K3Model::forward_batch`]): each sequence's logits and state
//! are bit-identical to running it alone, whatever else is in the batch — sequences joining
//! with their whole prompt beside others' decode steps, verification segments, random batch
//! compositions — with the bf16 and the int8 spine, resident and with the experts streamed
//! under a memory budget.

use deltafin_k3::engine::EngineBuilder;
use deltafin_k3::model::state::State;
use deltafin_k3::model::{K3Model, KdaForm, LogitRows, Logits, Segment};
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::spine_int8::{SpineFormat, convert_spine};
use std::path::Path;

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn assert_bits(what: &str, got: &Logits, want: &Logits) {
    assert_eq!((got.rows, got.vocab), (want.rows, want.vocab), "{what}");
    let differ = got
        .values
        .iter()
        .zip(&want.values)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert_eq!(differ, None, "{what}: first differing logit");
}

/// What one sequence does at each step of a schedule: join with its prompt, decode its
/// previous greedy token, or verify a short run of tokens (the recurrent form, every row).
#[derive(Clone, Debug)]
enum Step {
    Prompt(Vec<u32>),
    Decode,
    Verify(Vec<u32>),
}

/// A sequence's whole history: the steps it takes, at which batch step it starts.
#[derive(Clone, Debug)]
struct Plan {
    start: usize,
    steps: Vec<Step>,
}

/// Tokens a step feeds, given the sequence's last greedy token.
fn input(step: &Step, last: u32) -> (Vec<u32>, LogitRows, KdaForm) {
    match step {
        Step::Prompt(p) => (p.clone(), LogitRows::Last, KdaForm::Chunked),
        Step::Decode => (vec![last], LogitRows::Last, KdaForm::Chunked),
        Step::Verify(v) => {
            let mut t = vec![last];
            t.extend(v);
            (t, LogitRows::All, KdaForm::Recurrent)
        }
    }
}

/// Run `plan` alone, with the single-sequence entry points: the logits of every step and
/// the final state.
fn solo(model: &K3Model, plan: &Plan) -> (Vec<Logits>, State) {
    let mut state = model.new_state();
    let mut last = 0;
    let mut out = Vec::new();
    for step in &plan.steps {
        let (tokens, want, form) = input(step, last);
        let logits = match form {
            KdaForm::Chunked => model.forward(&mut state, &tokens, want).unwrap(),
            KdaForm::Recurrent => model.forward_exact(&mut state, &tokens, want).unwrap(),
        };
        last = argmax(logits.last());
        out.push(logits);
    }
    (out, state)
}

/// Run all `plans` together: at batch step `s`, every sequence with a step due feeds it,
/// in one [`K3Model::forward_batch`] call.
fn together(model: &K3Model, plans: &[Plan]) -> (Vec<Vec<Logits>>, Vec<State>) {
    let mut states: Vec<State> = plans.iter().map(|_| model.new_state()).collect();
    let mut last = vec![0u32; plans.len()];
    let mut out: Vec<Vec<Logits>> = plans.iter().map(|_| Vec::new()).collect();
    let end = plans
        .iter()
        .map(|p| p.start + p.steps.len())
        .max()
        .unwrap_or(0);
    for s in 0..end {
        let due: Vec<usize> = (0..plans.len())
            .filter(|&i| s >= plans[i].start && s - plans[i].start < plans[i].steps.len())
            .collect();
        if due.is_empty() {
            continue;
        }
        let inputs: Vec<(Vec<u32>, LogitRows, KdaForm)> = due
            .iter()
            .map(|&i| input(&plans[i].steps[s - plans[i].start], last[i]))
            .collect();
        let mut segments: Vec<Segment<'_>> = Vec::new();
        let mut it = inputs.iter();
        for (i, state) in states.iter_mut().enumerate() {
            if due.contains(&i) {
                let (tokens, want, kda_form) = it.next().unwrap();
                segments.push(Segment {
                    state,
                    tokens,
                    want: *want,
                    kda_form: *kda_form,
                });
            }
        }
        let logits = model.forward_batch(&mut segments).unwrap();
        assert_eq!(logits.len(), due.len());
        for (&i, l) in due.iter().zip(logits) {
            last[i] = argmax(l.last());
            out[i].push(l);
        }
    }
    (out, states)
}

fn check(model: &K3Model, plans: &[Plan], what: &str) {
    let (batched, states) = together(model, plans);
    for (i, plan) in plans.iter().enumerate() {
        let (want, state) = solo(model, plan);
        for (k, (g, w)) in batched[i].iter().zip(&want).enumerate() {
            assert_bits(&format!("{what}: sequence {i} step {k}"), g, w);
        }
        assert!(states[i] == state, "{what}: sequence {i}'s final state");
    }
}

/// Random plans: 1–8 sequences, prompts of 1–40 tokens, 1–6 decode or verify steps, joining
/// at different batch steps.
fn random_plans(rng: &mut Rng, vocab: usize) -> Vec<Plan> {
    let n = 1 + rng.below(8);
    (0..n)
        .map(|_| {
            let prompt: Vec<u32> = (0..1 + rng.below(40))
                .map(|_| rng.below(vocab) as u32)
                .collect();
            let mut steps = vec![Step::Prompt(prompt)];
            for _ in 0..1 + rng.below(6) {
                steps.push(if rng.below(4) == 0 {
                    let v = (0..1 + rng.below(3))
                        .map(|_| rng.below(vocab) as u32)
                        .collect();
                    Step::Verify(v)
                } else {
                    Step::Decode
                });
            }
            Plan {
                start: rng.below(4),
                steps,
            }
        })
        .collect()
}

fn tiny(dims: SynthDims, seed: u64) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(dims, seed)).unwrap();
    d
}

fn int8(root: &Path) {
    let ckpt = Checkpoint::open(root).unwrap();
    convert_spine(&ckpt, &Default::default(), &mut |_| {}).unwrap();
}

/// A fixed schedule: a long prompt joins while two others decode; one verifies beside them.
fn fixed_plans() -> Vec<Plan> {
    let prompt = |n: u32, k: u32| (0..n).map(|i| (i * 37 + k) % 1000 + 3).collect::<Vec<_>>();
    vec![
        Plan {
            start: 0,
            steps: vec![
                Step::Prompt(prompt(9, 1)),
                Step::Decode,
                Step::Decode,
                Step::Decode,
                Step::Decode,
            ],
        },
        Plan {
            start: 1,
            steps: vec![
                Step::Prompt(prompt(33, 2)),
                Step::Decode,
                Step::Verify(vec![5, 6, 7]),
                Step::Decode,
            ],
        },
        Plan {
            start: 0,
            steps: vec![Step::Prompt(prompt(1, 3)), Step::Decode, Step::Decode],
        },
    ]
}

#[test]
fn batched_sequences_equal_solo_runs_with_both_spines() {
    let d = tiny(SynthDims::tiny(), 11);
    int8(d.path());
    for spine in [SpineFormat::Bf16, SpineFormat::Int8] {
        let engine = EngineBuilder::new(d.path()).spine(spine).build().unwrap();
        let model = &engine.model;
        check(model, &fixed_plans(), spine.as_str());
        let mut rng = Rng(0xba7c_0001 ^ spine.as_str().len() as u64);
        for round in 0..6 {
            let plans = random_plans(&mut rng, model.dims.vocab_size);
            check(model, &plans, &format!("{} round {round}", spine.as_str()));
        }
    }
}

#[test]
fn batched_sequences_equal_solo_runs_with_experts_streamed() {
    let d = tiny(SynthDims::tiny_streaming(), 3);
    let engine = EngineBuilder::new(d.path())
        .memory_budget(Some(110_000_000))
        .runtime_bytes(50_000_000)
        .build()
        .unwrap();
    let model = &engine.model;
    assert!(model.experts.stats().is_some(), "the experts stream");
    check(model, &fixed_plans(), "streamed");
    let mut rng = Rng(0x5eed_0002);
    for round in 0..3 {
        let plans = random_plans(&mut rng, model.dims.vocab_size);
        check(model, &plans, &format!("streamed round {round}"));
    }
}

#[test]
fn a_bad_segment_is_refused_before_any_state_changes() {
    let d = tiny(SynthDims::tiny(), 5);
    let engine = EngineBuilder::new(d.path()).build().unwrap();
    let model = &engine.model;
    let mut a = model.new_state();
    let mut b = model.new_state();
    model.forward(&mut a, &[1, 2, 3], LogitRows::None).unwrap();
    let (a0, b0) = (a.clone(), b.clone());
    let vocab = model.dims.vocab_size as u32;
    let good = [4u32];
    let bad = [5u32, vocab];
    let mut segments = [
        Segment {
            state: &mut a,
            tokens: &good,
            want: LogitRows::Last,
            kda_form: KdaForm::Chunked,
        },
        Segment {
            state: &mut b,
            tokens: &bad,
            want: LogitRows::Last,
            kda_form: KdaForm::Chunked,
        },
    ];
    let e = model.forward_batch(&mut segments).unwrap_err();
    assert!(e.to_string().contains(&vocab.to_string()), "{e}");
    assert!(a == a0 && b == b0, "no state changed");
    assert!(model.forward_batch(&mut []).is_err(), "an empty batch");
}
