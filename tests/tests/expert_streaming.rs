//! Expert streaming on a synthesized checkpoint whose experts are many times the cache
//! budget: tokens and logits bit-identical to the resident (mmap) run, a cold prefill reads
//! each unique (layer, expert) exactly once, and the cache never exceeds its budget.

use deltafin_experts::{ExpertError, ExpertSource, ExpertWeights, PilotGate, StreamOptions};
use deltafin_k3::model::{K3Model, LogitRows};
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::loader::{
    CheckpointExperts, EngineOptions, load_model, load_model_with_experts, streaming_experts,
};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// 14 layers, 32 experts of 13,056 bytes (F 128, Lr 64): 5.4 MB of experts.
fn dims() -> SynthDims {
    SynthDims {
        vocab: 1024,
        experts: 32,
        moe_inter: 128,
        latent: 64,
        ..SynthDims::tiny()
    }
}

fn checkpoint() -> (tempfile::TempDir, Arc<Checkpoint>) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(dims(), 5)).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    (dir, ckpt)
}

fn stream_opts(cache_experts: u64, pilot: PilotGate) -> StreamOptions {
    StreamOptions {
        cache_bytes: cache_experts * 16384,
        read_threads: 3,
        pilot,
        ..StreamOptions::with_cache_bytes(0)
    }
}

fn streaming(ckpt: &Arc<Checkpoint>, opts: StreamOptions) -> K3Model {
    let src = streaming_experts(ckpt, opts).unwrap();
    load_model_with_experts(ckpt.clone(), &EngineOptions::default(), Box::new(src)).unwrap()
}

/// Greedy: (all prefill logits, then each decode step's logits, the ids).
fn run(model: &K3Model, n_prompt: usize, steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut st = model.new_state();
    let all = model
        .forward(
            &mut st,
            &deltafin_tests::test_prompt(n_prompt),
            LogitRows::All,
        )
        .unwrap();
    let mut logits = vec![all.values.clone()];
    let mut ids = Vec::new();
    let mut last = all.last().to_vec();
    for _ in 0..steps {
        let id = deltafin_kernels_argmax(&last);
        ids.push(id);
        last = model.decode(&mut st, id).unwrap();
        logits.push(last.clone());
    }
    (logits, ids)
}

fn deltafin_kernels_argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn streaming_is_bit_identical_to_resident() {
    let (_dir, ckpt) = checkpoint();
    let resident = load_model(ckpt.clone(), &EngineOptions::default()).unwrap();
    let want = run(&resident, 40, 12);
    for pilot in [
        PilotGate::Off,
        PilotGate::Measure,
        PilotGate::On {
            threshold: 0.5,
            warmup: 2,
        },
        PilotGate::Ranked {
            precision: 0.5,
            warmup: 2,
            max_guesses: 3,
        },
    ] {
        // 6 of 416 experts fit in the cache.
        let model = streaming(&ckpt, stream_opts(6, pilot));
        let got = run(&model, 40, 12);
        assert_eq!(got.1, want.1, "{pilot:?}: greedy ids");
        for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
            assert!(
                g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{pilot:?}: logits of pass {i} differ"
            );
        }
        let st = model.experts.stats().unwrap();
        eprintln!("{pilot:?}: {}", st.summary_line());
        assert!(st.cache_peak_bytes <= st.cache_budget_bytes);
        let t = st.total();
        assert!(t.misses > 0 && t.predictions > 0);
        if pilot == PilotGate::Measure {
            assert_eq!(t.prefetch_bytes, 0);
        }
        if pilot == PilotGate::Off {
            assert!(t.prefetch_bytes > 0);
        }
        if pilot != PilotGate::Measure {
            assert!(t.prefetch_issued > 0 && t.prefetch_right <= t.prefetch_issued);
            assert!(
                !st.pilot_ranks.is_empty(),
                "decode passes judge guesses per rank"
            );
        }
    }
}

/// Records which (layer, expert) pairs the model asks for.
struct Recorder {
    inner: CheckpointExperts,
    seen: Mutex<BTreeSet<(usize, usize)>>,
}

impl ExpertSource for Recorder {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.seen.lock().unwrap().insert((layer, expert));
        self.inner.expert(layer, expert)
    }
}

#[test]
fn cold_prefill_reads_each_unique_pair_once() {
    let (_dir, ckpt) = checkpoint();
    let rec = Arc::new(Recorder {
        inner: CheckpointExperts::new(ckpt.clone()),
        seen: Mutex::new(BTreeSet::new()),
    });
    struct Shared(Arc<Recorder>);
    impl ExpertSource for Shared {
        fn expert(&self, l: usize, e: usize) -> Result<ExpertWeights, ExpertError> {
            self.0.expert(l, e)
        }
    }
    let resident = load_model_with_experts(
        ckpt.clone(),
        &EngineOptions::default(),
        Box::new(Shared(rec.clone())),
    )
    .unwrap();
    resident
        .prefill(&mut resident.new_state(), &deltafin_tests::test_prompt(64))
        .unwrap();
    let pairs = rec.seen.lock().unwrap().len() as u64;

    let model = streaming(&ckpt, stream_opts(5, PilotGate::Measure));
    model
        .prefill(&mut model.new_state(), &deltafin_tests::test_prompt(64))
        .unwrap();
    let st = model.experts.stats().unwrap();
    let t = st.total();
    eprintln!("unique pairs {pairs}: {}", st.summary_line());
    assert!(
        pairs > 13 * 16,
        "the prompt should touch most experts: {pairs}"
    );
    assert_eq!(t.bytes_read, pairs * st.expert_bytes);
    assert_eq!((t.misses, t.hits), (pairs, 0));
    assert!(st.cache_peak_bytes <= st.cache_budget_bytes);
}

#[test]
fn shard_experts_are_contiguous() {
    let (_dir, ckpt) = checkpoint();
    let table = deltafin_store::experts::expert_table(&ckpt).unwrap();
    assert!(table.all_contiguous());
    assert_eq!(table.expert_count(), 13 * 32);
    assert_eq!(table.shape.expert_bytes(), 13056);
}

#[test]
fn one_file_per_expert_layout_streams_identically() {
    let (dir, ckpt) = checkpoint();
    let resident = load_model(ckpt.clone(), &EngineOptions::default()).unwrap();
    let want = run(&resident, 24, 6);
    let n = deltafin_store::experts::convert_to_expert_files(&ckpt).unwrap();
    assert_eq!(n, 13 * 32);
    let first = dir.path().join("k3-experts").join("L1-E0.bin");
    assert_eq!(std::fs::metadata(&first).unwrap().len(), 13056);
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let table = deltafin_store::experts::expert_table(&ckpt).unwrap();
    assert_eq!(table.files.len(), 13 * 32, "one file per expert");
    let model = streaming(&ckpt, stream_opts(6, PilotGate::Off));
    let got = run(&model, 24, 6);
    assert_eq!(got.1, want.1);
    for (g, w) in got.0.iter().zip(&want.0) {
        assert!(g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    // A wrong-sized expert file is named.
    std::fs::write(&first, b"short").unwrap();
    let e = deltafin_store::experts::expert_table(&ckpt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("L1-E0.bin") && e.contains("5 bytes"), "{e}");
}
