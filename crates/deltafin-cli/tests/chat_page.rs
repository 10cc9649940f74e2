//! The chat page of `deltafin serve` in a real browser: headless Chromium driven through
//! WebDriver (Debian's `chromium` and `chromium-driver`), against the real `deltafin serve`
//! process on a synthesized tiny checkpoint, with an API key and a memory budget (so that
//! the page shows a memory plan and the expert cache).
//!
//! It loads the page (which asks for the key once and keeps it), sends a message and sees
//! its answer and folded reasoning, sends a long one and watches the prefill bar move and
//! the tokens stream, presses Stop and sees the server's slot free in `/metrics`, sees a
//! queued and a refused request said on the page, reloads and finds the conversation (and
//! stored markdown rendered, sanitized), regenerates (reusing the stored prefix) and edits,
//! shows a forced tool call, shows the last benchmark, and checks that no
//! Content-Security-Policy violation happened. Then a page of another origin tries to use
//! the server (fetch with and without CORS, a frame) and a page on a rebound host name tries
//! to load it: all refused, nothing generated.
//!
//! Screenshots of each step are written under `target/tmp/chat-page/` (the test prints each
//! path). Without a browser the test prints a SKIP line; `DELTAFIN_REQUIRE_CHROMIUM=1` (set
//! by `.ci/run`) makes that a failure. `DELTAFIN_CHROMIUM` and `DELTAFIN_CHROMEDRIVER` name
//! the binaries when they are not `chromium` / `chromedriver` on the PATH.

#[path = "common/mod.rs"]
mod cli_common;
#[path = "../../deltafin-openai/tests/common/mod.rs"]
mod common;

use base64::Engine as _;
use cli_common::{ServeProcess, serve_process};
use common::{Resp, model_root, request_bytes, skip};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const KEY: &str = "chat-page-test-key-0123456789";
const TEST: &str = "chat_page_in_headless_chromium";
const SWITCH: &str = "DELTAFIN_REQUIRE_CHROMIUM";
/// The prefill of the long message is sized to take about this long.
const PREFILL_TARGET: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// Finding the browser.

fn on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

fn browser() -> Option<(PathBuf, PathBuf)> {
    let pick = |var: &str, names: &[&str]| match std::env::var_os(var) {
        Some(p) => Some(PathBuf::from(p)).filter(|p| p.is_file()),
        None => on_path(names),
    };
    let chromium = pick("DELTAFIN_CHROMIUM", &["chromium", "chromium-browser"])?;
    let driver = pick("DELTAFIN_CHROMEDRIVER", &["chromedriver"])?;
    Some((chromium, driver))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ---------------------------------------------------------------------------------------
// WebDriver over HTTP (W3C protocol).

struct Driver {
    child: Child,
    addr: SocketAddr,
    session: String,
    shots: PathBuf,
    _profile: tempfile::TempDir,
}

impl Driver {
    fn start(chromium: &Path, chromedriver: &Path, shots: PathBuf) -> Driver {
        let port = free_port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromedriver.display()));
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let t = Instant::now();
        while TcpStream::connect(addr).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "chromedriver never listened"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = tempfile::tempdir().unwrap();
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-extensions".into(),
            "--disable-dev-shm-usage".into(),
            "--window-size=1280,860".into(),
            // A host name that resolves to this machine: a page "rebound" to the server.
            "--host-resolver-rules=MAP rebound.test 127.0.0.1".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let mut d = Driver {
            child,
            addr,
            session: String::new(),
            shots,
            _profile: profile,
        };
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let v = d.call("POST", "/session", Some(&caps));
        d.session = v["sessionId"].as_str().unwrap().to_string();
        d
    }

    /// One WebDriver command; its `value`, or a panic with the driver's error.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let body = body.map(Value::to_string).unwrap_or_default();
        let bytes = request_bytes(method, path, body.as_bytes(), &[]);
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s.write_all(&bytes).unwrap();
        let r = read_sized(&mut s);
        let v: Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| {
            panic!(
                "webdriver {method} {path}: not JSON ({e}): {}",
                String::from_utf8_lossy(&r.body)
            )
        });
        assert!(
            r.status == 200,
            "webdriver {method} {path} answered {}: {}",
            r.status,
            v["value"]
        );
        v["value"].clone()
    }

    fn session_call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(&json!({"url": url})));
    }

    fn refresh(&self) {
        self.session_call("POST", "/refresh", Some(&json!({})));
    }

    /// Runs `script` (a function body; `arguments` are `args`) and returns its value.
    fn js(&self, script: &str, args: Value) -> Value {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(&json!({"script": script, "args": args})),
        )
    }

    fn element(&self, css: &str) -> String {
        let v = self.session_call(
            "POST",
            "/element",
            Some(&json!({"using": "css selector", "value": css})),
        );
        v.as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element id for {css}: {v}"))
            .to_string()
    }

    fn click(&self, css: &str) {
        let id = self.element(css);
        self.session_call("POST", &format!("/element/{id}/click"), Some(&json!({})));
    }

    fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.session_call(
            "POST",
            &format!("/element/{id}/value"),
            Some(&json!({"text": text})),
        );
    }

    fn text(&self, css: &str) -> String {
        self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
            json!([css]),
        )
        .as_str()
        .unwrap_or_default()
        .to_string()
    }

    /// Sets a form field's value as the user would leave it (with its change event).
    fn set_value(&self, css: &str, value: &str) {
        self.js(
            "const e = document.querySelector(arguments[0]); e.value = arguments[1]; e.dispatchEvent(new Event('change'));",
            json!([css, value]),
        );
    }

    fn phase(&self) -> String {
        self.js("return document.body.dataset.phase;", json!([]))
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    fn wait(&self, what: &str, limit: Duration, mut cond: impl FnMut(&Driver) -> bool) {
        let t = Instant::now();
        while !cond(self) {
            if t.elapsed() > limit {
                self.screenshot(&format!("failed-{}", what.replace(' ', "-")));
                let errors = self.js("return [window.deltafinErrors, window.deltafinViolations, document.body.dataset.phase, document.getElementById('notice').textContent, document.getElementById('messages').innerText.slice(0, 400), document.getElementById('input').value];", json!([]));
                panic!(
                    "waited {limit:?} for {what}; the page's errors and policy violations: {errors}"
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.session_call("GET", "/screenshot", None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().unwrap())
            .unwrap();
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        eprintln!("[chat_page] screenshot {}", path.display());
        path
    }
}

/// Reads one response with a `Content-Length` (chromedriver keeps its connections open, so
/// reading to the end would wait for its idle timeout).
fn read_sized(s: &mut TcpStream) -> Resp {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                buf.truncate(end + 4 + len);
                return common::parse_response(&buf);
            }
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "webdriver closed the connection mid-answer");
        buf.extend_from_slice(&chunk[..n]);
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let path = format!("/session/{}", self.session);
            let bytes = request_bytes("DELETE", &path, b"", &[]);
            if let Ok(mut s) = TcpStream::connect(self.addr) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
                let _ = s.write_all(&bytes);
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// The server process.

fn spawn_server(bench: &Path) -> ServeProcess {
    // One generation at a time (a budget's plan would admit two): the page's slot, queue and
    // refusal are what this test drives.
    serve_process([
        "--parallel",
        "1",
        "--queue",
        "1",
        "--api-key",
        KEY,
        "--memory-budget-gb",
        "0.25",
        "--response-memo-entries",
        "0",
        "--benchmark-dir",
        bench.to_str().unwrap(),
        "--model-root",
        model_root().to_str().unwrap(),
    ])
}

/// One request with the key, read to its end (a generation on a busy machine may take a
/// while).
fn call(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Resp {
    let auth = format!("Bearer {KEY}");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(&request_bytes(
        method,
        path,
        body,
        &[("Authorization", &auth)],
    ))
    .unwrap();
    common::read_all(&mut s)
}

fn status(addr: SocketAddr) -> Value {
    let r = call(addr, "GET", "/v1/status", b"");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The sum of a metric's samples whose line contains `filter`.
fn metric(addr: SocketAddr, name: &str, filter: &str) -> f64 {
    let r = call(addr, "GET", "/metrics", b"");
    String::from_utf8(r.body)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter(|l| l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn tokens_of(addr: SocketAddr, text: &str) -> usize {
    let r = call(
        addr,
        "POST",
        "/tokenize",
        json!({"content": text}).to_string().as_bytes(),
    );
    r.json()["tokens"].as_array().unwrap().len()
}

/// A text of about `words` distinct words (numbers: never repeated, so never a cached
/// prefix of another text).
fn filler(seed: u64, words: usize) -> String {
    (0..words as u64)
        .map(|i| ((i + 1) * 7919 + seed * 104_729) % 1_000_003)
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A streamed chat request that holds its place until dropped (it has received its first
/// bytes when this returns, if `wait_head`).
fn hold(addr: SocketAddr, wait_head: bool) -> TcpStream {
    let body = json!({"messages": [{"role": "user", "content": "hold the slot"}],
                      "reasoning_effort": "none", "max_tokens": 200000, "stream": true});
    let auth = format!("Bearer {KEY}");
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&request_bytes(
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[("Authorization", &auth)],
    ))
    .unwrap();
    if wait_head {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut b = [0u8; 64];
        assert!(s.read(&mut b).unwrap() > 0);
    }
    s
}

fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------------------
// Another origin: a page on another port of this machine.

fn serve_other_origin(target: SocketAddr) -> (SocketAddr, Arc<AtomicBool>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let page = format!(
        r#"<!doctype html><html><body><iframe id="f" src="http://{target}/"></iframe><script>
(async () => {{
  const t = 'http://{target}';
  const body = JSON.stringify({{messages: [{{role: 'user', content: 'from another origin'}}], max_tokens: 4}});
  const out = {{}};
  const attempt = async (name, f) => {{ try {{ const r = await f(); out[name] = 'answered ' + r.status + ' ' + r.type; }} catch (e) {{ out[name] = 'blocked'; }} }};
  await attempt('cors_post', () => fetch(t + '/v1/chat/completions', {{method: 'POST', headers: {{'Content-Type': 'application/json', 'Authorization': 'Bearer {KEY}'}}, body}}));
  await attempt('simple_post', () => fetch(t + '/v1/chat/completions', {{method: 'POST', mode: 'no-cors', headers: {{'Content-Type': 'text/plain'}}, body}}));
  await attempt('status_read', () => fetch(t + '/v1/status', {{headers: {{'Authorization': 'Bearer {KEY}'}}}}));
  await attempt('page_read', () => fetch(t + '/'));
  document.body.dataset.result = JSON.stringify(out);
}})();
</script></body></html>"#
    );
    l.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        page.len()
                    );
                    let _ = s.write_all(head.as_bytes());
                    let _ = s.write_all(page.as_bytes());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    (addr, stop)
}

// ---------------------------------------------------------------------------------------
// The test.

/// A benchmark evidence directory as `deltafin benchmark` leaves it (the two files the
/// page reads).
fn fake_benchmark(dir: &Path) {
    let e = dir.join("native-20250101-000000Z");
    std::fs::create_dir_all(&e).unwrap();
    let result = json!({"schema": "deltafin.benchmark.v1", "all_runs_valid": true, "all_outputs_exact": true,
        "arms": [{"name": "plain", "runs": 2, "valid_runs": 2,
                  "prefill_seconds": {"min": 0.1, "median": 0.12, "max": 0.2},
                  "decode_tokens_per_second": {"min": 30.0, "median": 31.5, "max": 33.0},
                  "relative_to_first_config": {"decode_tokens_per_second_median": 1.0}}]});
    std::fs::write(e.join("result.json"), result.to_string()).unwrap();
    std::fs::write(
        e.join("latency.svg"),
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="300" height="100"><rect width="300" height="100" fill="#ddd"/></svg>"##,
    )
    .unwrap();
}

#[test]
fn chat_page_in_headless_chromium() {
    let Some((chromium, chromedriver)) = browser() else {
        skip(
            TEST,
            SWITCH,
            "no chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
        );
        return;
    };
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page");
    std::fs::create_dir_all(&shots).unwrap();
    let bench = tempfile::tempdir().unwrap();
    fake_benchmark(bench.path());
    let server = spawn_server(bench.path());
    let addr = server.addr;
    wait_until("the model to load", Duration::from_secs(120), || {
        status(addr)["state"] == "ready"
    });
    let d = Driver::start(&chromium, &chromedriver, shots);
    let base = format!("http://{addr}");

    // The page asks for the key once (the status endpoint said 401) and keeps it.
    d.goto(&format!("{base}/"));
    d.wait("the key dialog", Duration::from_secs(20), |d| {
        d.js(
            "return document.getElementById('key-dialog').open;",
            json!([]),
        ) == json!(true)
    });
    d.screenshot("01-api-key");
    d.type_into("#key-input", KEY);
    d.click("#key-save");
    d.wait("the server ready", Duration::from_secs(20), |d| {
        d.text("#server-state") == "ready"
    });
    assert_eq!(
        d.js("return localStorage.getItem('deltafin.apiKey');", json!([])),
        json!(KEY)
    );
    assert!(
        d.text("#memory-summary").contains("budget"),
        "{}",
        d.text("#memory-summary")
    );

    // A short message with thinking on: the answer comes with its reasoning, folded.
    d.set_value("#max_tokens", "24");
    d.set_value("#effort", "high");
    d.type_into("#input", "Hello K3\u{E007}");
    d.wait("the first answer", Duration::from_secs(60), |d| {
        d.phase() == "idle" && d.text(".msg.assistant .meta").contains("finish")
    });
    let reasoning = d.js(
        "const r = document.querySelector('.msg.assistant details.reasoning'); return [r.open, r.hidden, r.querySelector('.reasoning-text').textContent.length];",
        json!([]),
    );
    assert_eq!(reasoning[0], json!(false), "reasoning is folded");
    assert_eq!(reasoning[1], json!(false), "reasoning is shown");
    assert!(reasoning[2].as_u64().unwrap() > 0, "{reasoning}");
    assert!(
        d.text(".msg.assistant .meta")
            .contains("24 completion tokens")
    );
    d.screenshot("02-first-answer");

    // A long message: the prefill bar moves with done/total and an ETA, then tokens stream.
    let calib = filler(1, 300);
    let calib_tokens = tokens_of(addr, &calib);
    let r = call(
        addr,
        "POST",
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": calib}], "max_tokens": 1, "reasoning_effort": "none"})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200);
    let st = status(addr);
    let rate = st["last_generation"]["prefill_tokens_per_second"]
        .as_f64()
        .unwrap();
    let context = st["model_info"]["context_tokens"].as_u64().unwrap() as f64;
    let want = (rate * PREFILL_TARGET.as_secs_f64()).clamp(1000.0, context * 0.8);
    let words = (300.0 * want / calib_tokens as f64) as usize;
    let long = filler(2, words);
    eprintln!(
        "[chat_page] prefill {rate:.0} tokens/s; the long message has {words} words (~{want:.0} tokens)"
    );
    d.set_value("#max_tokens", "");
    d.set_value("#effort", "none");
    d.set_value("#input", &long);
    d.click("#send");
    let mut seen = Vec::new();
    let mut texts = Vec::new();
    let mut shot = false;
    let t = Instant::now();
    while d.phase() != "decode" {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no token after {:?}",
            t.elapsed()
        );
        let v = d.js(
            "const b = document.getElementById('prefill-bar'); return [b.value, b.max, document.getElementById('prefill-text').textContent, document.getElementById('reused').textContent];",
            json!([]),
        );
        let (done, total) = (v[0].as_f64().unwrap(), v[1].as_f64().unwrap());
        if done > 0.0 && done < total {
            if !seen.contains(&done) {
                seen.push(done);
                texts.push(v[2].as_str().unwrap().to_string());
            }
            if !shot && seen.len() >= 2 {
                d.screenshot("03-prefill");
                shot = true;
            }
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    assert!(seen.len() >= 2, "the prefill bar did not move: {seen:?}");
    assert!(
        texts
            .iter()
            .any(|t| t.contains(" / ") && t.contains("tokens") && t.contains("ETA")),
        "{texts:?}"
    );
    // Tokens stream: the answer grows while it is being generated.
    let mut lengths = Vec::new();
    while lengths.len() < 4 {
        let n = d
            .js(
                "const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1].querySelector('.content').textContent.length;",
                json!([]),
            )
            .as_u64()
            .unwrap();
        if n > 0 && lengths.last() != Some(&n) {
            lengths.push(n);
        }
        assert_eq!(d.phase(), "decode", "the answer ended early: {lengths:?}");
        std::thread::sleep(Duration::from_millis(80));
    }
    assert!(lengths.windows(2).all(|w| w[0] < w[1]), "{lengths:?}");
    assert!(
        d.text("#decode-rate").contains("tok/s"),
        "{}",
        d.text("#decode-rate")
    );
    // The memory plan unfolded: its parts as a bar and a list.
    d.js(
        "document.getElementById('memory').open = true; const m = document.getElementById('messages'); m.scrollTop = m.scrollHeight;",
        json!([]),
    );
    let parts = d.js(
        "return [document.querySelectorAll('#memory-bar span').length, document.getElementById('memory-parts').textContent];",
        json!([]),
    );
    assert_eq!(parts[0], json!(6), "{parts}");
    assert!(
        parts[1].as_str().unwrap().contains("expert cache"),
        "{parts}"
    );
    d.screenshot("04-decoding");
    d.js("document.getElementById('memory').open = false;", json!([]));

    // Stop: the server cancels at once and frees its slot.
    let cancelled = metric(addr, "deltafin_generations_total", "cancelled");
    let pressed = Instant::now();
    d.click("#stop");
    wait_until("the slot freed after Stop", Duration::from_secs(10), || {
        metric(addr, "deltafin_generation_busy", "") == 0.0
            && metric(addr, "deltafin_generations_total", "cancelled") == cancelled + 1.0
    });
    eprintln!("[chat_page] slot free {:?} after Stop", pressed.elapsed());
    d.wait("the page idle after Stop", Duration::from_secs(10), |d| {
        d.phase() == "idle"
    });
    assert!(
        d.text("#notice").contains("Stopped"),
        "{}",
        d.text("#notice")
    );
    assert!(
        d.text(".msg.assistant:last-child .meta")
            .contains("stopped")
    );
    d.screenshot("05-stopped");

    // A request that finds the slot taken waits in the queue, and the page says so.
    d.set_value("#max_tokens", "4");
    let holder = hold(addr, true);
    d.type_into("#input", "Are you there?\u{E007}");
    d.wait("the queued notice", Duration::from_secs(20), |d| {
        d.text("#notice").contains("Queued")
    });
    d.screenshot("06-queued");
    drop(holder);
    d.wait(
        "the queued request answered",
        Duration::from_secs(60),
        |d| d.phase() == "idle",
    );
    assert!(d.text(".msg.assistant:last-child .meta").contains("finish"));
    // With the slot and the queue place taken, the request is refused, and the page says so.
    let a = hold(addr, true);
    let b = hold(addr, false);
    wait_until("a queued holder", Duration::from_secs(20), || {
        status(addr)["slot"]["queue_depth"] == 1
    });
    d.type_into("#input", "And now?\u{E007}");
    d.wait("the refusal", Duration::from_secs(20), |d| {
        d.phase() == "idle" && d.text("#notice").contains("429")
    });
    assert!(
        d.text("#notice").contains("Refused"),
        "{}",
        d.text("#notice")
    );
    d.screenshot("07-refused");
    drop(a);
    drop(b);
    wait_until("the holders gone", Duration::from_secs(20), || {
        let s = status(addr);
        s["slot"]["busy"] == false && s["slot"]["queue_depth"] == 0
    });

    // Nothing the page did so far failed or was blocked by its own Content-Security-Policy.
    let problems = d.js(
        "return [window.deltafinErrors, window.deltafinViolations];",
        json!([]),
    );
    assert_eq!(problems, json!([[], []]));

    // Reload: the conversation is still there (and the key: no dialog). A stored answer's
    // markdown is rendered and sanitized. The page saves its conversations a second after a
    // change (`persistSoon` in app.js): let a pending save land first, or it overwrites the
    // list edited here behind the page's back.
    std::thread::sleep(Duration::from_millis(1500));
    d.js(
        r#"const cs = JSON.parse(localStorage.getItem('deltafin.conversations.v1'));
           cs.push({id: 'md', title: 'Markdown', created: 0, messages: [
             {role: 'user', content: 'show markdown'},
             {role: 'assistant', content: '# Title\n\n`inline` and\n\n```rust\nfn main() {}\n```\n\n<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>[link](https://example.com) <b onclick="window.pwned=3">bold</b>', finish: 'stop'}]});
           localStorage.setItem('deltafin.conversations.v1', JSON.stringify(cs));"#,
        json!([]),
    );
    d.refresh();
    d.wait("the page after reload", Duration::from_secs(20), |d| {
        d.text("#server-state") == "ready"
    });
    assert_eq!(
        d.js(
            "return document.getElementById('key-dialog').open;",
            json!([])
        ),
        json!(false)
    );
    let titles = d.js(
        "return [...document.querySelectorAll('#conversations .title')].map(e => e.textContent);",
        json!([]),
    );
    assert_eq!(titles, json!(["Hello K3", "Markdown"]));
    let user = d.js(
        "return [...document.querySelectorAll('.msg.user .content')].map(e => e.textContent.slice(0, 40));",
        json!([]),
    );
    assert_eq!(user[0], json!("Hello K3"));
    assert_eq!(user.as_array().unwrap().len(), 4, "{user}");
    d.screenshot("08-reloaded");
    d.click("#conversations li:last-child");
    let md = d.js(
        r#"const c = document.querySelector('.msg.assistant .content');
           return {h1: c.querySelectorAll('h1').length, code: c.querySelectorAll('pre code.language-rust').length,
                   img: c.querySelectorAll('img').length, script: c.querySelectorAll('script').length,
                   onclick: c.querySelectorAll('[onclick]').length, rel: c.querySelector('a').rel,
                   pwned: window.pwned === undefined ? null : window.pwned};"#,
        json!([]),
    );
    assert_eq!(
        md,
        json!({"h1": 1, "code": 1, "img": 0, "script": 0, "onclick": 0, "rel": "noopener noreferrer", "pwned": null})
    );
    d.screenshot("09-markdown");
    d.click("#conversations li:first-child");

    // Regenerate the last answer: the long prompt's stored prefix is reused, and the answer
    // says how much.
    d.wait("the conversation shown", Duration::from_secs(10), |d| {
        d.js(
            "return document.querySelectorAll('.msg').length;",
            json!([]),
        ) == json!(8)
    });
    d.click(".msg.assistant:last-child button.regenerate");
    d.wait("the regenerated answer", Duration::from_secs(120), |d| {
        d.phase() == "idle" && d.text(".msg.assistant:last-child .meta").contains("finish")
    });
    let meta = d.text(".msg.assistant:last-child .meta");
    let reused: u64 = meta
        .split(" prefix tokens reused")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no reuse figure in {meta:?}"));
    assert!(reused >= 64, "{meta}");

    // Edit the first message: the conversation is cut there and answered again.
    d.click(".msg.user button.edit");
    d.js(
        "document.querySelector('.msg.user textarea.edit').value = 'Hello again';",
        json!([]),
    );
    d.click(".msg.user button.save");
    d.wait(
        "the edited conversation answered",
        Duration::from_secs(60),
        |d| {
            d.phase() == "idle"
                && d.js(
                    "return document.querySelectorAll('.msg').length;",
                    json!([]),
                ) == json!(2)
        },
    );
    assert_eq!(d.text(".msg.user .content"), "Hello again");

    // A forced tool call is shown with its arguments, with a place for its result.
    d.set_value(
        "#tools",
        r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#,
    );
    d.set_value("#tool_choice", "required");
    d.set_value("#max_tokens", "64");
    d.type_into("#input", "Weather in Paris?\u{E007}");
    d.wait("the tool call", Duration::from_secs(60), |d| {
        d.phase() == "idle"
    });
    let call = d.text(".msg.assistant:last-child .tool-call .name");
    assert!(
        call.contains("get_weather"),
        "{call:?} / {}",
        d.text(".msg.assistant:last-child .meta")
    );
    d.screenshot("10-tool-call");
    d.set_value("#tools", "");
    d.set_value("#tool_choice", "");

    // The last benchmark: its table and its plot.
    d.click("#show-benchmark");
    d.wait("the benchmark plot", Duration::from_secs(20), |d| {
        d.js(
            "const i = document.getElementById('bench-plot'); return !i.hidden && i.complete && i.naturalWidth > 0;",
            json!([]),
        ) == json!(true)
    });
    assert!(
        d.text("#bench-table").contains("plain"),
        "{}",
        d.text("#bench-table")
    );
    d.screenshot("11-benchmark");
    d.click("#bench-close");

    // Since the reload nothing failed, and the policy blocked only the inline handlers of the
    // hostile stored markdown (met by the sanitizer as it parsed it; none ran).
    let problems = d.js(
        "return [window.deltafinErrors, window.deltafinViolations];",
        json!([]),
    );
    assert_eq!(problems[0], json!([]), "{problems}");
    for v in problems[1].as_array().unwrap() {
        let v = v.as_str().unwrap();
        assert!(
            v.starts_with("script-src-attr: inline") && v.contains("/assets/purify.min.js"),
            "{problems}"
        );
    }

    // Another origin's page cannot use the server, even knowing the key.
    let generated = metric(addr, "deltafin_generations_total", "");
    let refused = metric(addr, "deltafin_requests_total", "status=\"403\"");
    let (other, stop) = serve_other_origin(addr);
    d.goto(&format!("http://{other}/"));
    d.wait(
        "the other origin's attempts",
        Duration::from_secs(30),
        |d| {
            d.js("return document.body.dataset.result || null;", json!([]))
                .is_string()
        },
    );
    let result: Value = serde_json::from_str(
        d.js("return document.body.dataset.result;", json!([]))
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(result["cors_post"], "blocked", "{result}");
    assert_eq!(result["status_read"], "blocked", "{result}");
    assert_eq!(result["page_read"], "blocked", "{result}");
    // The no-cors POST reaches the server as an opaque request and is refused there.
    let frame = d.element("#f");
    d.session_call(
        "POST",
        "/frame",
        Some(&json!({"id": {"element-6066-11e4-a52e-4f735466cecf": frame}})),
    );
    let framed = d.js("return location.href;", json!([]));
    d.session_call("POST", "/frame", Some(&json!({"id": null})));
    assert!(
        !framed.as_str().unwrap_or_default().starts_with(&base),
        "the page was framed: {framed}"
    );
    d.screenshot("12-other-origin");
    stop.store(true, Ordering::Relaxed);
    // A page whose host name was rebound to this machine cannot even load the page.
    let rebound = format!("http://rebound.test:{}/", addr.port());
    d.goto(&rebound);
    let body = d.text("body");
    assert!(body.contains("forbidden_host"), "{body}");
    assert_eq!(metric(addr, "deltafin_generations_total", ""), generated);
    assert!(
        metric(addr, "deltafin_requests_total", "status=\"403\"") >= refused + 4.0,
        "403s before {refused}, after {}",
        metric(addr, "deltafin_requests_total", "status=\"403\"")
    );
    let log = server.log.lock().unwrap().join("\n");
    assert!(!log.contains("panicked"), "{log}");
}
