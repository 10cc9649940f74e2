//! The official Python clients against a running server: `anthropic` on `/v1/messages`
//! (tools/anthropic_client_test.py), `openai` on `/v1/responses`
//! (tools/openai_responses_test.py) and `ollama` on the Ollama API
//! (tools/ollama_client_test.py). Python comes from `DELTAFIN_TEST_PYTHON`, else
//! `python3`; a package that cannot be imported prints a SKIP line, unless its switch
//! (`DELTAFIN_REQUIRE_ANTHROPIC=1`, `DELTAFIN_REQUIRE_OPENAI=1`, `DELTAFIN_REQUIRE_OLLAMA=1`,
//! all set by `.ci/run`, which installs the pinned packages) makes that a failure.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `script` against a fresh server at `base` (a path after the address), after
/// checking that `package` imports.
fn run_client(test: &str, package: &str, pin: &str, switch: &str, script: &str, base: &str) {
    let python = std::env::var("DELTAFIN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", &format!("import {package}")])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        skip(
            test,
            switch,
            &format!(
                "`{python} -c 'import {package}'` failed; install it with `{python} -m pip install {package}=={pin}`"
            ),
        );
        return;
    }
    // A thinking budget of 1024 needs `max_tokens` above it, and a budget above the server's
    // ceiling is refused: the ceiling admits it.
    let s = TestServer::start(ServerConfig {
        queue: 4,
        max_tokens: 2048,
        ..any_port()
    });
    s.wait_ready();
    let script = format!("{}/../../tools/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}{base}", s.addr))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("{script} ran over 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("checks passed"), "{stdout}");
    s.wait_idle();
}

#[test]
fn official_anthropic_client_on_messages() {
    run_client(
        "official_anthropic_client_on_messages",
        "anthropic",
        "2.15.0",
        "DELTAFIN_REQUIRE_ANTHROPIC",
        "anthropic_client_test.py",
        "",
    );
}

#[test]
fn official_openai_client_on_responses() {
    run_client(
        "official_openai_client_on_responses",
        "openai",
        "3.51.0",
        "DELTAFIN_REQUIRE_OPENAI",
        "openai_responses_test.py",
        "/v1",
    );
}

#[test]
fn official_ollama_client_on_the_ollama_api() {
    run_client(
        "official_ollama_client_on_the_ollama_api",
        "ollama",
        "0.6.1",
        "DELTAFIN_REQUIRE_OLLAMA",
        "ollama_client_test.py",
        "",
    );
}
