//! `deltafin serve` as a process: startup echo, same tokens as `deltafin run`, strict flags,
//! a clear error without a model, graceful exit 0 on SIGTERM and on SIGHUP.

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
    let mut cmd = deltafin();
    cmd.args(["serve", "--port", "0", "--model-root"])
        .arg(model_root())
        .args(extra);
    spawn(cmd)
}

/// Starts `cmd` (a `deltafin serve --port 0 …`), returns the child, the bound address and the
/// startup lines.
fn spawn(mut cmd: Command) -> (Child, SocketAddr, Vec<String>) {
    let mut child = cmd
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
    signal(child, "-TERM")
}

/// Sends `sig` (`-TERM`, `-HUP`) to the server and waits for it to exit.
fn signal(child: &mut Child, sig: &str) -> std::process::ExitStatus {
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args([sig, &pid])
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
            "serve did not exit after {sig}"
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
    let (mut child, addr, lines) = spawn_serve(&["--queue", "2", "--parallel", "3"]);
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
    let status = get(addr, "/v1/status").json();
    assert_eq!(status["sequences"]["parallel"], 3, "{status}");
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

/// A hangup (the terminal that started the server closed) is a graceful shutdown: the
/// running stream ends with its error frame, and the exit status is 0, not 129.
#[test]
fn sighup_shuts_down_gracefully_like_sigterm() {
    use std::io::Write;
    let (mut child, addr, _) = spawn_serve(&[]);
    ready(addr);
    let mut c = common::connect(addr);
    let body = json!({"prompt": "hang up", "max_tokens": 1_000_000, "stream": true});
    c.write_all(&common::request_bytes(
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
        &[],
    ))
    .unwrap();
    let mut r = BufReader::new(c);
    let mut line = String::new();
    while !line.starts_with("data: {") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream closed early");
    }
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut r, &mut rest);
        rest
    });
    let status = signal(&mut child, "-HUP");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    let rest = reader.join().unwrap();
    assert!(rest.contains("server_shutting_down"), "{rest}");
    assert!(!rest.contains("[DONE]"), "{rest}");
}

/// The `/metrics` sample `name` (without labels).
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = String::from_utf8(get(addr, "/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

/// An install with an infinite weight and a renamed chat marker: a completion is a 500
/// `numerical_failure` naming the layer, counted in `/metrics`; a chat request is a 500
/// naming `tokenizer_config.json`, not a 400 on the client's `messages`.
#[test]
fn a_numerical_failure_is_a_500_counted_in_metrics() {
    let d = process::checkpoint(deltafin_k3::synth::SynthDims::tiny(), 41);
    process::poke_tensor(
        d.path(),
        "language_model.model.layers.0.input_layernorm.weight",
        0,
        &process::BF16_INF,
    );
    process::rename_open_marker(d.path());
    let mut cmd = deltafin();
    cmd.args(["serve", "--port", "0", "--model-root"])
        .arg(d.path());
    let (mut child, addr, _) = spawn(cmd);
    wait_until(
        Duration::from_secs(30),
        || get(addr, "/health").status == 200,
        "model ready",
    );
    assert_eq!(metric(addr, "deltafin_numerical_failures_total"), 0.0);
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    let e = r.error(500);
    assert_eq!(e["code"], "numerical_failure");
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains("numerical failure") && m.contains("layer 0's attention output"),
        "{m}"
    );
    assert_eq!(metric(addr, "deltafin_numerical_failures_total"), 1.0);
    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    let e = r.error(500);
    assert_eq!(e["type"], "server_error");
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains("tokenizer_config.json has no special token <|open|>") && !m.contains("None"),
        "{m}"
    );
    assert_eq!(e["param"], Value::Null);
    assert_eq!(metric(addr, "deltafin_numerical_failures_total"), 1.0);
    assert_eq!(get(addr, "/health").status, 200);
    assert!(sigterm(&mut child).success());
}

/// A server started with a relative `--model-root` names none of its files in a 500: the
/// root is made absolute at startup, so the path scrubbing sees every path.
#[test]
fn install_faults_are_500s_naming_no_server_path() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("k3");
    let tiny = deltafin_k3::synth::SynthDims::tiny();
    process::checkpoint_in(&root, tiny.clone(), 42);
    let o = deltafin()
        .args(["convert-experts-scale4", "--model-root"])
        .arg(&root)
        .output()
        .unwrap();
    exits(&o, 0);
    // Every record of layer 1 damaged, and the sidecars required: a completion fails on it.
    process::damage_scale4(&root, 1, tiny.experts);
    let mut cmd = deltafin();
    cmd.current_dir(d.path())
        .env("K3_EXPERT_SCALE4", "require")
        .args(["serve", "--port", "0", "--model-root", "k3"]);
    let (mut child, addr, _) = spawn(cmd);
    wait_until(
        Duration::from_secs(30),
        || get(addr, "/health").status == 200,
        "model ready",
    );
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    let e = r.error(500);
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("scale4") && m.contains("<path>"), "{m}");
    assert!(
        !m.contains("k3-experts-scale4") && !m.contains("k3/"),
        "{m}"
    );
    assert!(sigterm(&mut child).success());
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
    bad(&["--parallel", "0"], &[], "--parallel");
    bad(&["--parallel", "17"], &[], "--parallel");
    bad(&[], &[("K3_SERVER_PARALLEL", "0")], "K3_SERVER_PARALLEL");
    bad(&[], &[("K3_SERVER_PARALLEL", "two")], "K3_SERVER_PARALLEL");
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
