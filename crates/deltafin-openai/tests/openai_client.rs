//! The official `openai` Python package against a running server (tools/openai_client_test.py,
//! and the tool-calling agent loop tools/openai_tools_test.py).
//! Python comes from `DELTAFIN_TEST_PYTHON`, else `python3`; without an importable `openai`
//! the test prints a SKIP line and returns, unless `DELTAFIN_REQUIRE_OPENAI=1` (set by `.ci/run`,
//! which installs the pinned package), which makes that a failure.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `tools/<script>` against a fresh server (queue 0); SKIP or fail as the module says
/// when `openai` cannot be imported.
fn run_client_script(test: &str, script: &str) {
    let python = std::env::var("DELTAFIN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        skip(
            test,
            "DELTAFIN_REQUIRE_OPENAI",
            &format!(
                "`{python} -c 'import openai'` failed; install it with `{python} -m pip install openai==3.51.0`"
            ),
        );
        return;
    }
    let s = TestServer::start(ServerConfig {
        queue: 0,
        ..any_port()
    });
    s.wait_ready();
    let script = format!("{}/../../tools/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}/v1", s.addr))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(240) {
            let _ = child.kill();
            panic!("{script} ran over 240 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("checks passed"));
    s.wait_idle();
}

#[test]
fn official_openai_client() {
    run_client_script("official_openai_client", "openai_client_test.py");
}

/// tools/openai_tools_test.py: declare a tool, the model calls it (forced by `tool_choice`),
/// the client sends the result back, the model answers; streaming and not.
#[test]
fn official_openai_client_agent_loop() {
    run_client_script("official_openai_client_agent_loop", "openai_tools_test.py");
}
