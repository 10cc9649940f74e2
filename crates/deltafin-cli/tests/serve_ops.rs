//! `deltafin serve` conveniences as a process: `--model-alias` (listed, accepted, strictly
//! checked), the default thinking from `K3_REASONING_EFFORT=none`, `/health` and one log line
//! per request on stderr.

#[path = "../../deltafin-openai/tests/common/mod.rs"]
mod common;

use common::{get, model_root, post_json, wait_until};
use deltafin_k3::text::chat::{ChatMessage, Thinking, encode_chat};
use deltafin_k3::text::tokenizer::Tokenizer;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

fn deltafin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.env("K3_SPINE", "bf16")
        .env_remove("K3_REASONING_EFFORT")
        .env_remove("K3_SERVER_QUEUE");
    cmd
}

/// `deltafin serve --port 0 … extra` with `env`: the child, its address, the lines up to
/// `listening on`, and the stderr lines after it.
fn spawn(
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Child, SocketAddr, Vec<String>, Receiver<String>) {
    spawn_from(deltafin(), extra, env)
}

/// [`spawn`] from `cmd` (the binary, or a shell that runs it).
fn spawn_from(
    mut cmd: Command,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Child, SocketAddr, Vec<String>, Receiver<String>) {
    cmd.args(["serve", "--port", "0", "--model-root"])
        .arg(model_root())
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
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
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, addr, lines, rx)
}

fn stop(mut child: Child) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let t = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("serve did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The next stderr line containing all of `needles`.
fn line_with(rx: &Receiver<String>, needles: &[&str]) -> String {
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200))
            && needles.iter().all(|n| l.contains(n))
        {
            return l;
        }
    }
    panic!("no stderr line with {needles:?}");
}

#[test]
fn aliases_health_thinking_default_and_the_request_log() {
    let (child, addr, lines, rx) = spawn(
        &["--model-alias", "kimi-k3", "--model-alias", "gpt-4o"],
        &[("K3_REASONING_EFFORT", "none")],
    );
    let echo = lines.iter().find(|l| l.contains("surface=server")).unwrap();
    assert!(echo.contains("model_aliases=kimi-k3,gpt-4o"), "{echo}");
    assert!(echo.contains("reasoning_effort=none (env)"), "{echo}");
    wait_until(
        Duration::from_secs(30),
        || get(addr, "/health").status == 200,
        "health ok",
    );
    let ids: Vec<String> = get(addr, "/v1/models").json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["deltafin-kimi-k3", "kimi-k3", "gpt-4o"]);

    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let tok = Tokenizer::from_dir(model_root()).unwrap();
    let want = encode_chat(
        &tok,
        &[ChatMessage::new("user", "Hi")],
        &Thinking::Off.chat_options(),
    )
    .unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], want.len());
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "");
    let id = v["id"].as_str().unwrap();
    let prompt = format!("prompt_tokens={}", want.len());
    let completion = format!("completion_tokens={}", v["usage"]["completion_tokens"]);
    let finish = format!(
        "finish={}",
        v["choices"][0]["finish_reason"].as_str().unwrap()
    );
    let log = line_with(&rx, &[id]);
    for field in [
        "[deltafin serve] request",
        "method=POST",
        "path=/v1/chat/completions",
        "status=200",
        &prompt,
        &completion,
        &finish,
        "duration=",
    ] {
        assert!(log.contains(field), "{field} missing from {log}");
    }
    let e = post_json(
        addr,
        "/v1/completions",
        &json!({"model": "gpt-5", "prompt": "x"}),
    );
    assert_eq!(e.status, 400);
    let log = line_with(&rx, &["path=/v1/completions", "status=400"]);
    assert!(
        log.contains("prompt_tokens=- completion_tokens=- finish=-"),
        "{log}"
    );
    stop(child);
}

#[test]
fn bad_aliases_are_startup_errors() {
    for (args, says) in [
        (&["--model-alias", ""][..], "must not be empty"),
        (&["--model-alias", "two words"], "whitespace"),
        (&["--model-alias", "a", "--model-alias", "a"], "given twice"),
        (&["--model-alias", "deltafin-kimi-k3"], "own id"),
    ] {
        let out = deltafin()
            .args(["serve", "--port", "0", "--model-root"])
            .arg(model_root())
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--model-alias") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

/// `deltafin` run by `sh` after `ulimit_args` (e.g. `-Sn 300`).
fn under_ulimit(ulimit_args: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit {ulimit_args} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_deltafin"))
        .env("K3_SPINE", "bf16")
        .env_remove("K3_REASONING_EFFORT")
        .env_remove("K3_SERVER_QUEUE");
    cmd
}

/// The soft and hard "Max open files" of a running process.
fn open_files_limits(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (v[0], v[1])
}

#[test]
#[cfg(target_os = "linux")]
fn serve_raises_its_open_files_limit_and_fits_its_connections_in_it() {
    // A low soft limit under a higher hard one is raised to the hard one.
    let (child, addr, lines, _rx) = spawn_from(under_ulimit("-Sn 300"), &[], &[]);
    let (soft, hard) = open_files_limits(child.id());
    assert!(hard > 300, "the hard limit here is {hard}");
    assert_eq!(soft, hard.min(1 << 20), "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("open files limit raised from 300 to")),
        "{lines:?}"
    );
    wait_until(
        Duration::from_secs(60),
        || get(addr, "/health").status == 200,
        "ready",
    );
    stop(child);

    // A hard limit of 400 holds (400 - 256) / 2 = 72 connections: the cap is lowered and
    // said, and the 73rd connection is refused while the others are open.
    let (child, addr, lines, _rx) = spawn_from(under_ulimit("-n 400"), &[], &[]);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("at most 72 connections (asked 256)")),
        "{lines:?}"
    );
    let idle: Vec<std::net::TcpStream> = (0..71)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    wait_until(
        Duration::from_secs(10),
        || {
            let m = get(addr, "/metrics");
            String::from_utf8_lossy(&m.body)
                .lines()
                .any(|l| l == "deltafin_connections_open 72")
        },
        "71 idle connections and one asking",
    );
    let mut held = idle;
    held.push(std::net::TcpStream::connect(addr).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    let r = get(addr, "/health");
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "too_many_connections");
    drop(held);
    wait_until(
        Duration::from_secs(10),
        || get(addr, "/health").status == 200,
        "served again",
    );
    stop(child);
}
