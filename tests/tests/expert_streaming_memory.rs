//! Process memory while streaming experts (Linux: `/proc/self/status`). Its own test binary,
//! so no other test shares the process. RSS is anonymous + file-backed (+ shmem) pages:
//! `VmRSS`/`VmHWM`, with `RssAnon` and `RssFile` as the split; the peak is reset with
//! `/proc/self/clear_refs` after loading. Without them the test prints a SKIP line, a failure
//! with `DELTAFIN_REQUIRE_PROC_MEM=1` (set by `.ci/run`).

use deltafin_experts::{PilotGate, StreamOptions};
use deltafin_k3::model::K3Model;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::loader::{
    EngineOptions, load_model, load_model_with_experts, streaming_experts,
};
use std::sync::Arc;

fn generate(model: &K3Model) {
    deltafin_tests::greedy_tokens(model, &deltafin_tests::test_prompt(48), 16);
}

#[test]
fn streaming_rss_stays_within_the_cache_budget() {
    if deltafin_tests::proc_mem().is_none() || !deltafin_tests::reset_peak_rss() {
        deltafin_tests::skip(
            "streaming_rss_stays_within_the_cache_budget",
            "DELTAFIN_REQUIRE_PROC_MEM",
            "/proc/self/status or /proc/self/clear_refs is not available (Linux only)",
        );
        return;
    }
    // 13 MoE layers × 64 experts × 78,336 B = 65 MB of experts; the cache gets 2 MB.
    let dims = SynthDims {
        vocab: 1024,
        experts: 64,
        moe_inter: 384,
        latent: 128,
        ..SynthDims::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(dims, 9)).unwrap();
    let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
    let expert_total = 13 * 64 * 78_336u64;
    let file_total = deltafin_tests::shard_file_bytes(&ckpt);
    let spine = file_total - expert_total;
    let budget = 2_000_000u64;
    let opts = StreamOptions {
        cache_bytes: budget,
        read_threads: 2,
        pilot: PilotGate::Off,
        ..StreamOptions::with_cache_bytes(0)
    };
    let src = streaming_experts(&ckpt, opts).unwrap();
    let model =
        load_model_with_experts(ckpt.clone(), &EngineOptions::default(), Box::new(src)).unwrap();

    assert!(deltafin_tests::reset_peak_rss());
    let before = deltafin_tests::proc_mem().unwrap();
    generate(&model);
    let after = deltafin_tests::proc_mem().unwrap();
    let st = model.experts.stats().unwrap();
    eprintln!(
        "streaming: before {before:?} after {after:?}; spine {spine} B; {}",
        st.summary_line()
    );
    assert!(st.cache_peak_bytes <= budget);
    assert!(st.total().bytes_read > 3 * budget, "it must really stream");
    // File-backed pages: only the spine may be mapped in (experts are never mmap-faulted).
    let file_growth = after.file.saturating_sub(before.file);
    assert!(
        file_growth <= spine + (1 << 20),
        "RssFile grew {file_growth} B"
    );
    // Anonymous: the cache plus activations, the decode state's touched pages and the
    // allocator's per-thread arenas (6–7 MB at these sizes, varying with thread timing).
    let anon_growth = after.anon.saturating_sub(before.anon);
    assert!(
        anon_growth <= budget + (8 << 20),
        "RssAnon grew {anon_growth} B"
    );
    let peak_growth = after.hwm.saturating_sub(before.rss);
    assert!(
        peak_growth <= budget + spine + (8 << 20),
        "peak RSS grew {peak_growth} B"
    );
    drop(model);

    // The same generation with resident experts maps most of the 65 MB of experts in.
    let resident = load_model(ckpt, &EngineOptions::default()).unwrap();
    let before = deltafin_tests::proc_mem().unwrap();
    generate(&resident);
    let after = deltafin_tests::proc_mem().unwrap();
    let file_growth = after.file.saturating_sub(before.file);
    eprintln!("resident: RssFile grew {file_growth} B");
    assert!(
        file_growth > expert_total / 3,
        "resident RssFile grew only {file_growth} B"
    );
}
