//! Workspace-level integration tests for deltafin. The tests live in `tests/tests/`,
//! golden fixtures in `tests/fixtures/`; this library holds shared helpers.

use std::path::PathBuf;

/// Directory of the committed golden fixtures.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The `shared/kimi` reference data folder beside the clone, if present.
pub fn shared_kimi_dir() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/kimi");
    p.is_dir().then_some(p)
}
