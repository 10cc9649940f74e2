//! What the driver's tests share: a small synthesized K3 (1,024-token vocabulary, 4 layers).

use deltafin_k3::model::K3Model;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::weights::loader::{EngineOptions, open_model};

/// The tiny checkpoint with a 1,024-token vocabulary and 4 layers, synthesized from `seed`,
/// and its directory (kept alive with the model).
pub fn small_model(seed: u64) -> (tempfile::TempDir, K3Model) {
    let dir = tempfile::tempdir().unwrap();
    let dims = SynthDims {
        vocab: 1024,
        layers: 4,
        ..SynthDims::tiny()
    };
    synthesize(dir.path(), &SynthSpec::new(dims, seed)).unwrap();
    let m = open_model(dir.path(), &EngineOptions::default()).unwrap();
    (dir, m)
}

/// A drafter that proposes the continuation of a known run, off by one from position
/// `wrong_from` on (agreeing, then disagreeing), counting how often it was asked.
#[allow(dead_code)] // Not every test binary that shares this module drafts.
pub struct Replay {
    pub run: Vec<u32>,
    pub wrong_from: usize,
    pub asked: usize,
}

impl deltafin_spec::Drafter for Replay {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        self.asked += 1;
        let wrong_from = self.wrong_from;
        self.run
            .iter()
            .enumerate()
            .skip(history.len())
            .take(max)
            .map(|(i, &t)| if i >= wrong_from { t ^ 1 } else { t })
            .collect()
    }
}
