//! The rule for a test that cannot run on this machine, shared by the tests of every crate
//! (deltafin-openai's and the workspace's `tests/`, and the kernels' unit tests, include this
//! file).

use std::io::Write as _;

/// `test` cannot run here because of `why`: a failure when `switch=1` (`.ci/run` sets the
/// switch of everything CI installs), else a SKIP line written to the process's stderr past
/// the test harness's capture, so that `cargo test` shows it.
#[track_caller]
pub fn skip(test: &str, switch: &str, why: &str) {
    assert!(
        !std::env::var(switch).is_ok_and(|v| v == "1"),
        "{switch}=1 but {test} cannot run: {why}"
    );
    let _ = writeln!(
        std::io::stderr(),
        "SKIP {test}: {why} ({switch}=1 makes this a failure)"
    );
}
