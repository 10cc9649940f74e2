//! Process memory while streaming the spine (Linux: `/proc/self/status`). Its own test
//! binary, so no other test shares the process. The streamed layers' spine matrices are read
//! into two reusable buffers per pass and never faulted in through the shard mmaps. Without
//! `/proc/self/status` and `clear_refs` the test prints a SKIP line, a failure with
//! `DELTAFIN_REQUIRE_PROC_MEM=1` (set by `.ci/run`).

use deltafin_experts::{PilotGate, StreamOptions};
use deltafin_k3::model::K3Model;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::loader::{
    EngineOptions, load_model, load_model_with_experts, streaming_experts,
};
use deltafin_k3::weights::spine_stream::layer_matrix_bytes;
use std::sync::Arc;

fn generate(model: &K3Model) -> Vec<u32> {
    deltafin_tests::greedy_tokens(model, &deltafin_tests::test_prompt(32), 8)
}

#[test]
fn spine_streaming_peak_rss_stays_within_the_budget() {
    if deltafin_tests::proc_mem().is_none() || !deltafin_tests::reset_peak_rss() {
        deltafin_tests::skip(
            "spine_streaming_peak_rss_stays_within_the_budget",
            "DELTAFIN_REQUIRE_PROC_MEM",
            "/proc/self/status or /proc/self/clear_refs is not available (Linux only)",
        );
        return;
    }
    let dims = SynthDims {
        hidden: 512,
        vocab: 1024,
        dense_inter: 1024,
        kda_heads: 4,
        kda_head_dim: 128,
        mla_heads: 4,
        q_lora: 256,
        kv_lora: 128,
        qk_nope: 64,
        qk_rope: 32,
        v_head: 64,
        experts: 32,
        moe_inter: 256,
        latent: 256,
        ..SynthDims::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(dims, 11)).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let file_total = deltafin_tests::shard_file_bytes(&ckpt);
    let cache = 1_000_000u64;
    let experts = || {
        let opts = StreamOptions {
            cache_bytes: cache,
            read_threads: 2,
            pilot: PilotGate::Off,
            ..StreamOptions::with_cache_bytes(0)
        };
        Box::new(streaming_experts(&ckpt, opts).unwrap())
    };
    let resident_model =
        load_model_with_experts(ckpt.clone(), &EngineOptions::default(), experts()).unwrap();
    let per_layer: Vec<u64> = resident_model
        .layers
        .iter()
        .map(layer_matrix_bytes)
        .collect();
    let want = generate(&resident_model);
    drop(resident_model);

    let keep = 1usize;
    let streamed: u64 = per_layer[keep..].iter().sum();
    let max_layer = per_layer[keep..].iter().copied().max().unwrap();
    let expert_bytes: u64 = file_total - per_layer.iter().sum::<u64>();
    // The budget: what stays mapped (at most the file minus the streamed matrices and the
    // experts), two layer buffers, the expert cache, and 4 MB of activations.
    let resident_spine = file_total - streamed - expert_bytes.min(file_total - streamed);
    let budget = resident_spine.max(1) + 2 * (max_layer + (64 << 10)) + cache + (4 << 20);
    assert!(
        file_total >= 3 * budget,
        "the model ({file_total} B) must be several times the budget ({budget} B)"
    );

    // A fresh mapping: the resident run above faulted in the pages of `ckpt`'s mmaps.
    let fresh = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let model = load_model_with_experts(
        fresh.clone(),
        &EngineOptions {
            spine_resident_layers: Some(keep),
            ..Default::default()
        },
        experts(),
    )
    .unwrap();
    assert!(deltafin_tests::reset_peak_rss());
    let before = deltafin_tests::proc_mem().unwrap();
    let got = generate(&model);
    let after = deltafin_tests::proc_mem().unwrap();
    let st = deltafin_k3::weights::spine_stream::streamer(&model)
        .unwrap()
        .stats();
    eprintln!(
        "spine streaming: before {before:?} after {after:?}; file {file_total} B, streamed {streamed} B/pass, budget {budget} B; {st:?}"
    );
    assert_eq!(got, want, "tokens differ from the resident spine");
    assert_eq!(st.passes, 9);
    assert!(st.bytes_read >= 9 * streamed, "it must really stream");
    let peak_growth = after.hwm.saturating_sub(before.rss);
    assert!(
        peak_growth as f64 <= budget as f64 * 1.05,
        "peak RSS grew {peak_growth} B, budget {budget} B"
    );
    // No streamed layer is faulted in through the mmap.
    let file_growth = after.file.saturating_sub(before.file);
    assert!(
        file_growth <= resident_spine + (1 << 20),
        "RssFile grew {file_growth} B (resident spine {resident_spine} B)"
    );
    drop(model);

    // The resident spine maps the streamed layers' pages in.
    drop(fresh);
    let resident = load_model(
        Arc::new(Checkpoint::open(dir.path()).unwrap()),
        &EngineOptions::default(),
    )
    .unwrap();
    let before = deltafin_tests::proc_mem().unwrap();
    generate(&resident);
    let after = deltafin_tests::proc_mem().unwrap();
    let file_growth = after.file.saturating_sub(before.file);
    eprintln!("resident: RssFile grew {file_growth} B");
    assert!(
        file_growth > streamed / 2,
        "resident RssFile grew only {file_growth} B"
    );
}
