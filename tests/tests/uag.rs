//! Cross-tokenizer Qwen3 drafting (docs/K3.md §10) on the synthesized tiny K3 and a
//! synthesized Qwen3-0.6B-shaped model: exact output, the history round-trip rule, and
//! proposals that are K3's own re-encoding of the drafted text.

use deltafin_k3::generate::Greedy;
use deltafin_k3::synth::{QwenSize, SynthDims, SynthSpec, synthesize, synthesize_qwen3};
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS, Tokenizer};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_spec::qwen3::Qwen3Model;
use deltafin_spec::uag::{DraftTokenizer, UagDrafter};
use deltafin_spec::{Drafter, generate_speculative};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// A stand-in for Qwen's byte-level BPE (its `tokenizer.json` is not in the repository):
/// one id per UTF-8 byte; ids ≥ 256 decode to a space and a letter (a word).
struct Bytes;

impl DraftTokenizer for Bytes {
    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
    fn decode(&self, ids: &[u32]) -> Option<String> {
        let bytes: Vec<u8> = ids
            .iter()
            .map(|&i| {
                if i < 256 {
                    i as u8
                } else {
                    b'a' + (i % 26) as u8
                }
            })
            .collect();
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
}

const MAX_NEW: usize = 12;
const STOP: [u32; 2] = [END_OF_MSG, EOS];

#[test]
fn qwen_drafting_is_exact_and_proposals_are_k3_reencodings() {
    let dir = tempfile::tempdir().unwrap();
    let k3_dir = dir.path().join("k3");
    synthesize(&k3_dir, &SynthSpec::new(SynthDims::tiny(), 21)).unwrap();
    let q_dir = dir.path().join("qwen");
    synthesize_qwen3(&q_dir, 5, QwenSize::Small).unwrap();
    let model = open_model(&k3_dir, &EngineOptions::default()).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(&k3_dir).unwrap());
    let qwen = Arc::new(Qwen3Model::open(&q_dir).unwrap());

    // Exactness: whatever Qwen drafts, the ids equal plain greedy.
    for text in ["The capital of France is", "def fib(n):\n    return n"] {
        let prompt = tok.encode_ordinary(text);
        let truth = deltafin_tests::plain_greedy(&model, &prompt, MAX_NEW);
        for width in [2, 5] {
            let mut d = UagDrafter::new(qwen.clone(), Bytes, tok.clone());
            let (ids, _) = generate_speculative(
                &model,
                &prompt,
                MAX_NEW,
                &STOP,
                width,
                &mut d,
                &AtomicBool::new(false),
            )
            .unwrap();
            assert_eq!(ids, truth, "width {width} on {text:?}");
        }
    }

    // A proposal is the tail of K3's re-encoding of history + Qwen's greedy text. (The
    // random tied-embedding Qwen echoes the last byte; after Han characters the echoed
    // continuation byte decodes to U+FFFD, which K3 keeps apart from the history's tokens.
    // After a Latin word or a period the echo would merge with the history's last token and
    // correctly yield no proposal.)
    let history = tok.encode_ordinary("Speculative decoding: 推测解码");
    let mut d = UagDrafter::new(qwen.clone(), Bytes, tok.clone());
    let p = d.propose(&history, 2);
    assert_eq!(d.stats.proposals, 1, "{:?}", d.stats);
    let text = tok.decode(&history).unwrap();
    let q = qwen
        .draft(&mut qwen.new_cache(), &Bytes.encode(&text), 4)
        .unwrap();
    let ids: Vec<u32> = q.iter().map(|&(t, _)| t).collect();
    let all = tok.encode(&(text + &Bytes.decode(&ids).unwrap()), true);
    assert!(all.starts_with(&history));
    let want: Vec<u32> = all[history.len()..].iter().take(2).copied().collect();
    assert_eq!(p, want);
    // Deterministic, also when the cached Qwen prefix is reused.
    assert_eq!(d.propose(&history, 2), p);

    // A history that does not survive decode → re-encode gets no proposal.
    let a = tok.encode_ordinary("a");
    let b = tok.encode_ordinary("b");
    let split = [a, b].concat();
    assert_ne!(tok.encode_ordinary("ab"), split);
    assert!(d.propose(&split, 2).is_empty());
    assert_eq!(d.stats.history_mismatch, 1);
}

/// Advances by half a second at every reading (K3's share of a step) plus whatever the
/// drafters charge to it (their proposal time).
#[derive(Clone, Default)]
struct FakeClock(Arc<std::sync::atomic::AtomicU64>);

const TICK_NS: u64 = 500_000_000;

impl FakeClock {
    fn charge(&self, seconds: f64) {
        self.0
            .fetch_add((seconds * 1e9) as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

impl deltafin_spec::Clock for FakeClock {
    fn now(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(
            self.0
                .fetch_add(TICK_NS, std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// A drafter whose every proposal costs `seconds` on the fake clock.
struct Timed {
    inner: Box<dyn Drafter + Send>,
    clock: FakeClock,
    seconds: f64,
    calls: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drafter for Timed {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        self.clock.charge(self.seconds);
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.propose(history, max)
    }
    fn confidence(&self) -> &[f32] {
        self.inner.confidence()
    }
}

/// A stand-in for a 1.7B that agrees with K3: proposes K3's own greedy continuation.
struct Oracle {
    prompt_len: usize,
    truth: Vec<u32>,
}

impl Drafter for Oracle {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let done = history.len() - self.prompt_len;
        self.truth.iter().skip(done).take(max).copied().collect()
    }
}

#[test]
fn the_1_7b_is_tried_when_the_0_6b_is_rarely_accepted_and_kept_only_when_it_pays() {
    use deltafin_spec::escalate::{Escalating, TRIAL_STEPS};
    use deltafin_spec::{PolicyMode, SpecPolicy, generate_with_policy};
    use std::sync::atomic::{AtomicUsize, Ordering};
    const N: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let k3_dir = dir.path().join("k3");
    synthesize(&k3_dir, &SynthSpec::new(SynthDims::tiny(), 21)).unwrap();
    let (small_dir, large_dir) = (dir.path().join("q06"), dir.path().join("q17"));
    synthesize_qwen3(&small_dir, 5, QwenSize::Small).unwrap();
    synthesize_qwen3(&large_dir, 6, QwenSize::Large).unwrap();
    let model = open_model(&k3_dir, &EngineOptions::default()).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(&k3_dir).unwrap());
    let small = Arc::new(Qwen3Model::open(&small_dir).unwrap());
    let large = Arc::new(Qwen3Model::open(&large_dir).unwrap());
    assert!(large.config.hidden_size > small.config.hidden_size);
    let prompt = tok.encode_ordinary("The capital of France is");
    let truth = deltafin_tests::plain_greedy(&model, &prompt, N);
    assert_eq!(truth.len(), N, "the tiny model should not stop early");

    // Runs the escalating drafter: the 0.6B-shaped Qwen costs 0.1 s per proposal, the large
    // one `large_s`; returns the drafter's stats and the large drafter's proposal count.
    let run = |large_drafter: Box<dyn Drafter + Send>, large_s: f64| {
        let clock = FakeClock::default();
        let (small_calls, large_calls) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut d = Escalating::new(
            Box::new(Timed {
                inner: Box::new(UagDrafter::new(small.clone(), Bytes, tok.clone())),
                clock: clock.clone(),
                seconds: 0.1,
                calls: small_calls.clone(),
            }),
            Box::new(Timed {
                inner: large_drafter,
                clock: clock.clone(),
                seconds: large_s,
                calls: large_calls.clone(),
            }),
        );
        let mut policy = SpecPolicy::new(PolicyMode::On, 4, 0.03);
        let (ids, stats) = generate_with_policy(
            &model,
            &prompt,
            N,
            &STOP,
            &mut d,
            &mut Greedy,
            &mut policy,
            &clock,
            &AtomicBool::new(false),
            |_| Ok(()),
        )
        .unwrap();
        assert_eq!(ids, truth);
        (
            d.phase(),
            d.stats.clone(),
            stats,
            small_calls.load(Ordering::Relaxed),
            large_calls.load(Ordering::Relaxed),
        )
    };

    // A 1.7B that agrees (K3's own continuation stands in for it) is kept.
    let oracle = Box::new(Oracle {
        prompt_len: prompt.len(),
        truth: truth.clone(),
    });
    let (phase, esc, stats, small_calls, large_calls) = run(oracle, 0.3);
    assert_eq!(phase, deltafin_spec::escalate::Phase::Large, "{esc:?}");
    assert_eq!((esc.trials, esc.escalated), (1, 1), "{esc:?}");
    assert!(esc.large_rate.unwrap() > esc.small_rate.unwrap(), "{esc:?}");
    assert_eq!(small_calls, deltafin_spec::escalate::ESCALATE_WINDOW);
    assert!(large_calls >= TRIAL_STEPS, "{large_calls}");
    assert!(stats.accepted > 0, "{stats:?}");

    // The synthesized 1.7B-shaped Qwen (random weights, never accepted) costs more than the
    // 0.6B and gives nothing more: tried once in this short run, then the 0.6B drafts on.
    let random = Box::new(UagDrafter::new(large.clone(), Bytes, tok.clone()));
    let (phase, esc, _, small_calls, large_calls) = run(random, 0.3);
    assert_eq!(phase, deltafin_spec::escalate::Phase::Small, "{esc:?}");
    assert_eq!((esc.trials, esc.escalated), (1, 0), "{esc:?}");
    assert!(esc.large_rate.unwrap() < esc.small_rate.unwrap(), "{esc:?}");
    assert_eq!(large_calls, TRIAL_STEPS);
    assert!(small_calls > deltafin_spec::escalate::ESCALATE_WINDOW);
}
