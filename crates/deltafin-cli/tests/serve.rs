//! `deltafin serve` as a process: startup echo, same tokens as `deltafin run`, strict flags,
//! a clear error without a model, graceful exit 0 on SIGTERM.

#[path = "../../deltafin-openai/tests/common/mod.rs"]
mod common;
/// The helpers of this crate's process tests.
#[path = "common/mod.rs"]
mod process;

use common::{get, model_root, post_json, wait_until};
use process::{exits, jsonl};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn deltafin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    // Responses are compared with the library's bf16 model: pin the bf16 spine.
    cmd.env("K3_SPINE", "bf16")
        .env_remove("K3_REASONING_EFFORT")
        .env_remove("K3_SERVER_QUEUE");
    cmd
}

/// Starts `deltafin serve --port 0`, returns the child, the bound address and the startup lines.
fn spawn_serve(extra: &[&str]) -> (Child, SocketAddr, Vec<String>) {
    let mut child = deltafin()
        .args(["serve", "--port", "0", "--model-root"])
        .arg(model_root())
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "serve exited: {lines:?}"
        );
        lines.push(line.clone());
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    (child, addr, lines)
}

fn sigterm(child: &mut Child) -> std::process::ExitStatus {
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let t = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ready(addr: SocketAddr) {
    wait_until(
        Duration::from_secs(30),
        || {
            post_json(
                addr,
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 1}),
            )
            .status
                == 200
        },
        "model ready",
    );
}

fn run_events(args: &[&str]) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("ev.jsonl");
    let out = deltafin()
        .args(["run", "--model-root"])
        .arg(model_root())
        .args(args)
        .args(["--top-logits", "1", "--events-jsonl"])
        .arg(&ev)
        .output()
        .unwrap();
    exits(&out, 0);
    jsonl(&ev)
}

/// (token bytes, logprob) of each decode step of a `run` events file.
fn run_steps(events: &[Value]) -> Vec<(u32, f64)> {
    events
        .iter()
        .filter(|e| e["event"] == "decode_step")
        .map(|d| {
            let top = d["top_logits"][0][1].as_f64().unwrap() as f32;
            (
                d["token_id"].as_u64().unwrap() as u32,
                f64::from(top) - d["logsumexp"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn serve_gives_the_same_tokens_as_run_and_exits_0_on_sigterm() {
    let (mut child, addr, lines) = spawn_serve(&["--queue", "2"]);
    let echo = lines
        .iter()
        .find(|l| l.contains("surface=server"))
        .expect("startup echo");
    for key in [
        "queue=2 (flag)",
        "max_tokens=1000000",
        "max_request_bytes=134217728",
        "reasoning_effort=max (default)",
        "port=",
    ] {
        assert!(echo.contains(key), "{key} missing from {echo}");
    }
    assert_eq!(get(addr, "/v1/models").status, 200);
    ready(addr);
    let tok = deltafin_k3::text::tokenizer::Tokenizer::from_dir(model_root()).unwrap();

    // Raw completion.
    let prompt = "The capital of France is";
    let steps = run_steps(&run_events(&["--prompt", prompt, "--max-new", "6"]));
    assert_eq!(steps.len(), 6);
    let v = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "logprobs": 1}),
    )
    .json();
    let lp = &v["choices"][0]["logprobs"];
    let served: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let text_steps: Vec<&(u32, f64)> = steps
        .iter()
        .filter(|(id, _)| !matches!(*id, 163585 | 163586))
        .collect();
    assert_eq!(served.len(), text_steps.len());
    for ((id, want), (got, token)) in text_steps
        .iter()
        .zip(served.iter().zip(lp["tokens"].as_array().unwrap()))
    {
        assert_eq!(*got, *want);
        assert_eq!(
            token.as_str().unwrap(),
            String::from_utf8_lossy(tok.token_bytes(*id).unwrap())
        );
    }

    // Chat: compare token bytes of every reported token.
    let steps = run_steps(&run_events(&[
        "--prompt",
        "Hi there",
        "--chat",
        "--max-new",
        "5",
    ]));
    let v = post_json(
        addr,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "logprobs": true
        }),
    )
    .json();
    let lp = &v["choices"][0]["logprobs"];
    let mut served: Vec<Value> = lp["reasoning_content"].as_array().unwrap().clone();
    served.extend(lp["content"].as_array().unwrap().iter().cloned());
    let ordinary: Vec<&(u32, f64)> = steps
        .iter()
        .filter(|(id, _)| !tok.is_special(*id))
        .collect();
    assert_eq!(served.len(), ordinary.len());
    for (e, (id, want)) in served.iter().zip(ordinary) {
        assert_eq!(e["bytes"], json!(tok.token_bytes(*id).unwrap()));
        assert_eq!(e["logprob"].as_f64().unwrap(), *want);
    }
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        steps.len() - usize::from(steps.last().is_some_and(|s| s.0 == 163586))
    );

    let status = sigterm(&mut child);
    assert!(status.success(), "exit status {status}");
}

#[test]
fn strict_flags_and_environment() {
    let bad = |args: &[&str], env: &[(&str, &str)], want: &str| {
        let mut cmd = deltafin();
        cmd.args(["serve", "--port", "0", "--model-root"])
            .arg(model_root())
            .args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(err.contains(want), "{args:?} {env:?}: {err}");
    };
    bad(&["--queue", "65"], &[], "--queue");
    bad(&[], &[("K3_SERVER_QUEUE", "abc")], "K3_SERVER_QUEUE");
    bad(&[], &[("K3_SERVER_QUEUE", "65")], "K3_SERVER_QUEUE");
    bad(&["--host", "a/b"], &[], "--host");
    bad(&["--max-tokens", "0"], &[], "--max-tokens");
    bad(
        &["--max-request-bytes", "1073741825"],
        &[],
        "--max-request-bytes",
    );
    bad(
        &[],
        &[("K3_REASONING_EFFORT", "huge")],
        "K3_REASONING_EFFORT",
    );
}

#[test]
fn environment_queue_and_a_missing_model() {
    let (mut child, _addr, lines) = {
        let mut cmd = deltafin();
        cmd.env("K3_SERVER_QUEUE", "3");
        let mut child = cmd
            .args(["serve", "--port", "0", "--model-root"])
            .arg(model_root())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            assert!(err.read_line(&mut l).unwrap() > 0);
            lines.push(l.clone());
            if l.contains("listening on") {
                break;
            }
        }
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        (child, (), lines)
    };
    assert!(
        lines.iter().any(|l| l.contains("queue=3 (env)")),
        "{lines:?}"
    );
    assert!(sigterm(&mut child).success());

    let tmp = tempfile::tempdir().unwrap();
    let out = deltafin()
        .args(["serve", "--port", "0", "--model-root"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no K3 model installed") && err.contains("config.json"),
        "{err}"
    );
}
