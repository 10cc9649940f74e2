//! Cross-tokenizer Qwen3 drafting (k3-model.md §10) on the synthesized tiny K3 and a
//! synthesized Qwen3-0.6B-shaped model: exact output, the history round-trip rule, and
//! proposals that are K3's own re-encoding of the drafted text.

use deltafin_k3::generate::{GenerateOptions, generate};
use deltafin_k3::loader::{EngineOptions, open_model};
use deltafin_k3::synth::{QwenSize, SynthDims, SynthSpec, synthesize, synthesize_qwen3};
use deltafin_k3::tokenizer::{END_OF_MSG, EOS, Tokenizer};
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
        let opts = GenerateOptions {
            max_new: Some(MAX_NEW),
            stop_ids: STOP.to_vec(),
            max_context: 1 << 20,
            top_logits: 0,
        };
        let truth = generate(&model, &prompt, &opts, &AtomicBool::new(false), |_| Ok(()))
            .unwrap()
            .ids;
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
