//! Workspace-level integration tests for deltafin. The tests live in `tests/tests/`,
//! golden fixtures in `tests/fixtures/`; this library holds shared helpers.

use std::path::PathBuf;

/// Directory of the committed golden fixtures.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

#[path = "../../crates/deltafin-kernels/tests/common/skip.rs"]
mod skip;
pub use skip::skip;

/// The `shared/kimi` reference data folder beside the clone, if present.
pub fn shared_kimi_dir() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/kimi");
    p.is_dir().then_some(p)
}

/// Process memory from `/proc/self/status` (Linux), in bytes: `VmRSS`, the peak `VmHWM`,
/// and the `RssAnon` / `RssFile` split.
#[derive(Debug, Clone, Copy)]
pub struct ProcMem {
    /// Resident set.
    pub rss: u64,
    /// Peak resident set since start or the last [`reset_peak_rss`].
    pub hwm: u64,
    /// Anonymous resident pages.
    pub anon: u64,
    /// File-backed resident pages (mmap'd weights).
    pub file: u64,
}

/// The current [`ProcMem`], or `None` where `/proc/self/status` lacks the fields.
pub fn proc_mem() -> Option<ProcMem> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some(ProcMem {
        rss: field("VmRSS:")?,
        hwm: field("VmHWM:")?,
        anon: field("RssAnon:")?,
        file: field("RssFile:")?,
    })
}

/// Reset the peak resident set (`VmHWM`) through `/proc/self/clear_refs`; false where the
/// kernel refuses.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A deterministic prompt of `n` token ids below 1000.
pub fn test_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 389 + 17) % 1000).collect()
}

/// `steps` greedy tokens after prefilling `prompt`: each the argmax of the last logits (the
/// last of equal maxima), decoded in turn.
pub fn greedy_tokens(
    model: &deltafin_k3::model::K3Model,
    prompt: &[u32],
    steps: usize,
) -> Vec<u32> {
    let mut st = model.new_state();
    let mut logits = model.prefill(&mut st, prompt).expect("prefill");
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let id = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .expect("non-empty logits");
        out.push(id);
        logits = model.decode(&mut st, id).expect("decode");
    }
    out
}

/// Plain greedy generation: at most `max_new` tokens after `prompt`, stopping at K3's
/// end-of-message and end-of-text tokens (the ids every speculative path must reproduce).
pub fn plain_greedy(
    model: &deltafin_k3::model::K3Model,
    prompt: &[u32],
    max_new: usize,
) -> Vec<u32> {
    use deltafin_k3::generate::GenerateOptions;
    use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS};
    use deltafin_spec::generate;
    let opts = GenerateOptions {
        max_new: Some(max_new),
        stop_ids: vec![END_OF_MSG, EOS],
        max_context: 1 << 20,
        top_logits: 0,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    generate(model, prompt, &opts, &stop, |_| Ok(()))
        .expect("plain greedy generation")
        .ids
}

/// Total bytes of a checkpoint's shard files.
pub fn shard_file_bytes(ckpt: &deltafin_k3::weights::checkpoint::Checkpoint) -> u64 {
    ckpt.shard_paths()
        .iter()
        .map(|p| std::fs::metadata(p).expect("shard metadata").len())
        .sum()
}

/// The greedy bigram table of `seqs`: the most frequent successor of each token (ties: the
/// smallest successor id), sorted by token.
pub fn greedy_bigrams(seqs: &[Vec<u32>]) -> Vec<(u32, u32)> {
    use std::collections::BTreeMap;
    let mut counts: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    for seq in seqs {
        for w in seq.windows(2) {
            *counts.entry((w[0], w[1])).or_default() += 1;
        }
    }
    let mut best: BTreeMap<u32, (usize, u32)> = BTreeMap::new();
    for (&(a, b), &n) in &counts {
        let e = best.entry(a).or_insert((0, b));
        if n > e.0 {
            *e = (n, b);
        }
    }
    best.into_iter().map(|(a, (_, b))| (a, b)).collect()
}

/// A DSpark that agrees with the target by construction: its block logits vanish
/// (`final_norm = 0`) and its rank-r Markov head (r = number of bigrams) maps each previous
/// token `a` onto its bigram successor `b` (`markov_w1[a] = e_k`, `markov_w2[b] += e_k`, so
/// `argmax(w2 · w1[a]) = b`); the confidence head is dropped.
pub fn agreeing_dspark(
    base: &deltafin_spec::dspark::DsparkModel,
    table: &[(u32, u32)],
) -> deltafin_spec::dspark::DsparkModel {
    use deltafin_tensor::{Bf16Matrix, bf16};
    let mut m = base.clone();
    let (v, r) = (m.config.vocab_size, table.len());
    let (mut w1, mut w2) = (vec![bf16::ZERO; v * r], vec![bf16::ZERO; v * r]);
    for (k, &(a, b)) in table.iter().enumerate() {
        w1[a as usize * r + k] = bf16::ONE;
        w2[b as usize * r + k] = bf16::ONE;
    }
    m.config.markov_rank = r;
    m.markov_w1 = Bf16Matrix::from_values(v, r, &w1).expect("one-hot Markov factor shape");
    m.markov_w2 = Bf16Matrix::from_values(v, r, &w2).expect("one-hot Markov factor shape");
    m.final_norm.iter_mut().for_each(|w| *w = 0.0);
    m.confidence = None;
    m
}
