//! The `embed` example (examples/embed.rs) runs under a memory budget on a synthesized
//! checkpoint and completes exactly as the resident model does.

#[path = "../examples/embed.rs"]
mod embed;

use deltafin_k3::engine::EngineBuilder;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};

#[test]
fn the_example_streams_experts_and_matches_the_resident_model() {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 7)).unwrap();
    let prompt = "Embedding keeps";
    let streamed = embed::complete(d.path(), 2.0, prompt, 6).unwrap();

    let resident = EngineBuilder::new(d.path()).build().unwrap();
    assert!(resident.plan.is_none(), "no budget: every expert resident");
    let want = embed::continue_greedily(&resident, prompt, 6).unwrap();
    assert!(!want.is_empty());
    assert_eq!(streamed, want);
    // A budget too small for the model is a clear error, not a panic.
    let e = embed::complete(d.path(), 0.001, prompt, 6).unwrap_err();
    let mut msg = e.to_string();
    let mut at = e.source();
    while let Some(s) = at {
        msg += &format!(": {s}");
        at = s.source();
    }
    assert!(msg.contains("is too small"), "{msg}");
}
