//! The load and fault test of the `deltafin serve` process (bounded, loopback only; Linux,
//! for `/proc`): 64 clients mix valid chat and completion requests (streamed and not) with
//! malformed JSON, a wrong content type, oversized bodies, slow bodies, slow heads, streams
//! dropped after their first frame and long prompts dropped during their prefill, for
//! `DELTAFIN_LOAD_SECS` seconds (default 8). Meanwhile the server's RSS is sampled from
//! `/proc/<pid>/status`.
//!
//! It asserts: every answer is a well-formed HTTP response, every refusal carries the
//! server's JSON error (`{"error":{"message","type","param","code"}}`) with the status its
//! kind calls for, every valid request is served (200) or refused busy (429), nothing
//! waits past its deadline, no valid request loses its connection; the peak RSS stays
//! within the memory plan the server prints plus what its own flags let it hold; afterwards
//! the process is up, `/health` is ok, the slot, the queue, the body budget and the
//! connections are free, no 5xx was counted, nothing panicked, and SIGTERM exits 0. It
//! prints one `[load]` summary line (the figures of docs/OPERATIONS.md "Load and faults").

#[path = "common/mod.rs"]
mod cli_common;
#[path = "../../deltafin-openai/tests/common/mod.rs"]
mod common;

use cli_common::{ServeProcess, serve_process};
use common::model_root;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Concurrent clients.
const CLIENTS: usize = 64;
/// `--max-request-bytes`: small, so that oversized bodies are cheap to send.
const MAX_REQUEST_BYTES: usize = 32 * 1024;
/// `--queue`.
const QUEUE: usize = 4;
/// `--max-connections`: twice the clients. Each client has one connection open at a time;
/// the server may still hold one a client just dropped until it notices (within 50 ms), so
/// the cap is never reached and a 503 `too_many_connections` is a failure here.
const MAX_CONNECTIONS: usize = 2 * CLIENTS;
/// `--header-deadline-secs` and `--body-deadline-secs`.
const HEADER_DEADLINE: Duration = Duration::from_secs(2);
const BODY_DEADLINE: Duration = Duration::from_secs(2);
/// `--response-memo-bytes`.
const MEMO_BYTES: usize = 1 << 20;
/// `--memory-budget-gb`: the server plans its memory and prints the plan.
const BUDGET_GB: &str = "0.25";
/// How late past its deadline a deadline refusal (408, a closed slow head) may come on a
/// loaded 2-core machine.
const DEADLINE_SLACK: Duration = Duration::from_secs(5);
/// The longest a valid request may wait for its whole answer: at most `QUEUE` requests of a
/// few tokens (or a prefill that is cancelled within a layer) are ahead of it.
const ANSWER_LIMIT: Duration = Duration::from_secs(30);
/// The longest a refusal may take.
const REFUSAL_LIMIT: Duration = Duration::from_secs(10);

/// `DELTAFIN_LOAD_SECS` (1…3600), else 8.
fn load_duration() -> Duration {
    match std::env::var("DELTAFIN_LOAD_SECS") {
        Err(_) => Duration::from_secs(8),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(n @ 1..=3600) => Duration::from_secs(n),
            _ => panic!("DELTAFIN_LOAD_SECS={v:?}: not an integer in 1…3600"),
        },
    }
}

// ---------------------------------------------------------------------------------------
// The server process.

fn spawn_server() -> ServeProcess {
    let n = |v: usize| v.to_string();
    serve_process([
        "--model-root",
        model_root().to_str().unwrap(),
        "--memory-budget-gb",
        BUDGET_GB,
        "--queue",
        &n(QUEUE),
        "--max-request-bytes",
        &n(MAX_REQUEST_BYTES),
        "--max-connections",
        &n(MAX_CONNECTIONS),
        "--header-deadline-secs",
        &HEADER_DEADLINE.as_secs().to_string(),
        "--body-deadline-secs",
        &BODY_DEADLINE.as_secs().to_string(),
        "--response-memo-bytes",
        &n(MEMO_BYTES),
    ])
}

/// `VmRSS` and `VmHWM` of `pid` in bytes (`None` once the process is gone).
fn proc_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    };
    Some((kb("VmRSS:")? * 1024, kb("VmHWM:")? * 1024))
}

/// The memory plan the server printed once loaded:
/// `[deltafin] memory budget B GB = spine … + runtime R GB + … + expert cache C GB (…)`.
struct Plan {
    line: String,
    budget: u64,
    runtime: u64,
}

fn gb_after(line: &str, key: &str) -> u64 {
    let rest = line
        .split(key)
        .nth(1)
        .unwrap_or_else(|| panic!("no {key:?} in the plan line: {line}"));
    let v: f64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    (v * 1e9).round() as u64
}

fn plan_of(s: &ServeProcess) -> Plan {
    let lines = s.lines_with("[deltafin] memory budget ");
    let line = lines
        .first()
        .unwrap_or_else(|| panic!("serve printed no memory plan"))
        .clone();
    Plan {
        budget: gb_after(&line, "memory budget "),
        runtime: gb_after(&line, "+ runtime "),
        line,
    }
}

/// What the server may hold beside the model's plan, bounded by its own flags. The plan
/// (spine, state, the RSS measured when the model loaded, scratch, prefix states, expert
/// cache) does not count the requests; they add at most:
/// - request bodies: the body budget, 4 × `--max-request-bytes`, and what validating them
///   builds (the JSON value, the parsed request, the prompt ids), counted 4 times over;
/// - the response memo, `--response-memo-bytes`;
/// - per open connection (at most `--max-connections`), hyper's buffers: a read buffer
///   that grows to about 400 KiB and the write buffer, 512 KiB;
/// - threads started under load (tokio's blocking pool encodes prompts and runs
///   generations; each new thread maps a stack and may get its own malloc arena): 64 MiB.
fn server_allowance() -> u64 {
    let bodies = 4 * MAX_REQUEST_BYTES as u64 * 4;
    let connections = MAX_CONNECTIONS as u64 * 512 * 1024;
    bodies + MEMO_BYTES as u64 + connections + (64 << 20)
}

// ---------------------------------------------------------------------------------------
// A raw HTTP/1.1 client that never panics: every outcome is classified by the caller.

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn text(&self) -> String {
        let t = String::from_utf8_lossy(&self.body);
        t.chars().take(300).collect()
    }
}

/// How reading stopped.
#[derive(Debug, PartialEq)]
enum End {
    Eof,
    Reset,
    Timeout,
    Stop,
    Failed(ErrorKind),
}

/// Reads until `stop(bytes)` holds, end of stream, an error or `limit`.
fn read_until(s: &mut TcpStream, limit: Duration, stop: &dyn Fn(&[u8]) -> bool) -> (Vec<u8>, End) {
    let until = Instant::now() + limit;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        if stop(&buf) {
            return (buf, End::Stop);
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (buf, End::Timeout);
        }
        let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match s.read(&mut chunk) {
            Ok(0) => return (buf, End::Eof),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return (buf, End::Reset),
            Err(e) => return (buf, End::Failed(e.kind())),
        }
    }
}

/// The response in `raw`: `Ok(None)` while incomplete (`eof`: the stream ended, which
/// completes a body without a length), `Err` when the bytes are no HTTP response.
fn parse(raw: &[u8], eof: bool) -> Result<Option<Answer>, String> {
    let Some(head_end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        if raw.len() > 64 * 1024 {
            return Err("a response head over 64 KiB".into());
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&raw[..head_end]).map_err(|_| "a head that is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    if parts.next() != Some("HTTP/1.1") {
        return Err(format!("status line {status_line:?}"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("status line {status_line:?}"))?;
    let mut headers = Vec::new();
    for l in lines {
        let (k, v) = l.split_once(':').ok_or_else(|| format!("header {l:?}"))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let rest = &raw[head_end + 4..];
    let body = if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        match dechunk(rest)? {
            Some(b) => b,
            None => return Ok(None),
        }
    } else if let Some(len) = get("content-length") {
        let len: usize = len.parse().map_err(|_| format!("content-length {len:?}"))?;
        if rest.len() < len {
            return Ok(None);
        }
        if rest.len() > len {
            return Err(format!(
                "{} bytes past the content length",
                rest.len() - len
            ));
        }
        rest.to_vec()
    } else if eof {
        rest.to_vec()
    } else {
        return Ok(None);
    };
    Ok(Some(Answer {
        status,
        headers,
        body,
    }))
}

/// A chunked body: `Ok(None)` until its last chunk has arrived.
fn dechunk(mut data: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&data[..eol]).map_err(|_| "a chunk size not UTF-8")?;
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("chunk size {line:?}"))?;
        let start = eol + 2;
        if size == 0 {
            // The last chunk, then (no trailers) the final CRLF.
            return Ok((data.len() >= start + 2).then_some(out));
        }
        if data.len() < start + size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&data[start..start + size]);
        data = &data[start + size + 2..];
    }
}

/// Reads one whole response within `limit`.
fn read_answer(s: &mut TcpStream, limit: Duration) -> Result<Answer, String> {
    let (buf, end) = read_until(s, limit, &|b| matches!(parse(b, false), Ok(Some(_))));
    match parse(&buf, end == End::Eof) {
        Ok(Some(a)) => Ok(a),
        Ok(None) => Err(format!(
            "{} ({} bytes, no complete response)",
            match end {
                End::Eof => "closed".to_string(),
                End::Reset => "reset".to_string(),
                End::Timeout => format!("no answer within {limit:?}"),
                End::Stop => "stopped".to_string(),
                End::Failed(k) => format!("read failed ({k:?})"),
            },
            buf.len()
        )),
        Err(e) => Err(format!("malformed response: {e}")),
    }
}

/// The bytes of a request (`Connection: close`, `Host: 127.0.0.1`).
fn request_bytes(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("connect failed: {e}"))?;
    let _ = s.set_nodelay(true);
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    Ok(s)
}

/// A GET on a fresh connection (for `/health` and `/metrics`).
fn get(addr: SocketAddr, path: &str) -> Result<Answer, String> {
    let mut s = connect(addr)?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .map_err(|e| format!("write failed: {e}"))?;
    read_answer(&mut s, Duration::from_secs(10))
}

/// The samples of `name` in a `/metrics` text: (labels, value).
fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => {
                    let (labels, v) = r.split_once("} ")?;
                    (labels.to_string(), v)
                }
                None => (String::new(), rest.strip_prefix(' ')?),
            };
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

fn gauge(text: &str, name: &str) -> f64 {
    samples(text, name).first().map_or(f64::NAN, |(_, v)| *v)
}

// ---------------------------------------------------------------------------------------
// What a refusal and an answer must look like.

/// The server's error body: `{"error":{"message","type","param","code"}}` (nothing else),
/// as JSON; returns the code. A 429 also says `Retry-After: 1`, and 408, 413 and 429 close
/// the connection.
fn refusal(a: &Answer) -> Result<String, String> {
    let ct = a.header("content-type").unwrap_or("");
    if !ct.starts_with("application/json") {
        return Err(format!("{} refusal with content type {ct:?}", a.status));
    }
    let v: Value = serde_json::from_slice(&a.body)
        .map_err(|_| format!("{} refusal body is not JSON: {}", a.status, a.text()))?;
    let e = &v["error"];
    let well_formed = v.as_object().is_some_and(|o| o.len() == 1)
        && e["message"].is_string()
        && e["type"].is_string()
        && e["code"].is_string()
        && e.get("param").is_some_and(|p| p.is_null() || p.is_string());
    if !well_formed {
        return Err(format!(
            "{} refusal body is not the error shape: {v}",
            a.status
        ));
    }
    if a.status == 429 && a.header("retry-after") != Some("1") {
        return Err(format!("429 without Retry-After: 1: {:?}", a.headers));
    }
    if matches!(a.status, 408 | 413 | 429) && a.header("connection") != Some("close") {
        return Err(format!("{} without Connection: close", a.status));
    }
    Ok(e["code"].as_str().unwrap_or_default().to_string())
}

/// A refusal with `status` and `code`.
fn refused_as(a: &Answer, status: u16, code: &str) -> Result<(), String> {
    let got = refusal(a)?;
    if a.status != status || got != code {
        return Err(format!(
            "wanted {status} {code}, got {} {got}: {}",
            a.status,
            a.text()
        ));
    }
    Ok(())
}

/// A 200 JSON answer of `object` (`chat.completion` or `text_completion`) within
/// `max_tokens`.
fn json_answer(a: &Answer, object: &str, max_tokens: u64) -> Result<(), String> {
    let v: Value = serde_json::from_slice(&a.body)
        .map_err(|_| format!("200 body is not JSON: {}", a.text()))?;
    let n = v["usage"]["completion_tokens"].as_u64();
    if v["object"] != object
        || !v["choices"][0]["finish_reason"].is_string()
        || n.is_none_or(|n| n > max_tokens)
    {
        return Err(format!("not a {object} within {max_tokens} tokens: {v}"));
    }
    Ok(())
}

/// A 200 event stream: JSON frames without an error, then `data: [DONE]`.
fn stream_answer(a: &Answer) -> Result<(), String> {
    let ct = a.header("content-type").unwrap_or("");
    if !ct.starts_with("text/event-stream") {
        return Err(format!("a stream with content type {ct:?}"));
    }
    let text = String::from_utf8_lossy(&a.body);
    let payloads: Vec<&str> = text
        .split("\n\n")
        .filter_map(|b| b.strip_prefix("data: "))
        .collect();
    let Some((last, frames)) = payloads.split_last() else {
        return Err("an empty stream".into());
    };
    if *last != "[DONE]" {
        return Err(format!("a stream that ends with {last:?}"));
    }
    for f in frames {
        let v: Value = serde_json::from_str(f).map_err(|_| format!("frame {f:?}"))?;
        if v.get("error").is_some() {
            return Err(format!("an error frame {f}"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The clients.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Chat,
    ChatStream,
    Completion,
    Malformed,
    WrongType,
    Oversized,
    SlowBody,
    SlowHead,
    Disconnect,
    CancelPrefill,
}

impl Kind {
    /// The mix: (kind, weight).
    const MIX: [(Kind, u64); 10] = [
        (Kind::Chat, 14),
        (Kind::ChatStream, 12),
        (Kind::Completion, 14),
        (Kind::Malformed, 12),
        (Kind::WrongType, 8),
        (Kind::Oversized, 8),
        (Kind::SlowBody, 6),
        (Kind::SlowHead, 3),
        (Kind::Disconnect, 12),
        (Kind::CancelPrefill, 8),
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::ChatStream => "chat_stream",
            Kind::Completion => "completion",
            Kind::Malformed => "malformed",
            Kind::WrongType => "wrong_type",
            Kind::Oversized => "oversized",
            Kind::SlowBody => "slow_body",
            Kind::SlowHead => "slow_head",
            Kind::Disconnect => "disconnect",
            Kind::CancelPrefill => "cancel_prefill",
        }
    }

    /// A valid request (to be served or refused busy).
    fn valid(self) -> bool {
        matches!(
            self,
            Kind::Chat
                | Kind::ChatStream
                | Kind::Completion
                | Kind::Disconnect
                | Kind::CancelPrefill
        )
    }
}

/// xorshift64*: a reproducible mix per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn kind(&mut self) -> Kind {
        let total: u64 = Kind::MIX.iter().map(|(_, w)| w).sum();
        let mut r = self.below(total);
        for (k, w) in Kind::MIX {
            if r < w {
                return k;
            }
            r -= w;
        }
        Kind::Chat
    }
}

/// How one request ended, for the tally.
enum Outcome {
    /// 200, the whole answer read (its latency counts).
    Served,
    /// 429 `server_busy`.
    Busy,
    /// Refused as its kind calls for: the code.
    Refused(String),
    /// A stream dropped by the client after its first frame.
    Disconnected,
    /// A request dropped by the client before its answer.
    Dropped,
    /// A slow head the server closed at the header deadline.
    Closed,
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// (kind, outcome) → count.
    counts: BTreeMap<(Kind, String), u64>,
    served_latency: Vec<Duration>,
    busy_latency: Vec<Duration>,
    violations: Vec<String>,
    violation_count: u64,
}

impl Tally {
    fn add(&mut self, kind: Kind, r: Result<Outcome, String>, took: Duration) {
        let label = match r {
            Ok(Outcome::Served) => {
                self.served_latency.push(took);
                "200".to_string()
            }
            Ok(Outcome::Busy) => {
                self.busy_latency.push(took);
                "429".to_string()
            }
            Ok(Outcome::Refused(code)) => code,
            Ok(Outcome::Disconnected) => "disconnected".into(),
            Ok(Outcome::Dropped) => "dropped".into(),
            Ok(Outcome::Closed) => "closed at the header deadline".into(),
            Err(e) => {
                self.violation_count += 1;
                if self.violations.len() < 20 {
                    self.violations.push(format!("{}: {e}", kind.name()));
                }
                "VIOLATION".into()
            }
        };
        *self.counts.entry((kind, label)).or_default() += 1;
    }

    fn merge(&mut self, o: Tally) {
        for (k, n) in o.counts {
            *self.counts.entry(k).or_default() += n;
        }
        self.served_latency.extend(o.served_latency);
        self.busy_latency.extend(o.busy_latency);
        self.violation_count += o.violation_count;
        let room = 20usize.saturating_sub(self.violations.len());
        self.violations.extend(o.violations.into_iter().take(room));
    }

    fn count(&self, f: impl Fn(Kind, &str) -> bool) -> u64 {
        self.counts
            .iter()
            .filter(|((k, l), _)| f(*k, l))
            .map(|(_, n)| n)
            .sum()
    }
}

/// A valid request's answer: served (checked by `ok`) or refused busy.
fn served_or_busy(
    a: &Answer,
    ok: impl Fn(&Answer) -> Result<(), String>,
) -> Result<Outcome, String> {
    match a.status {
        200 => ok(a).map(|()| Outcome::Served),
        429 => refused_as(a, 429, "server_busy").map(|()| Outcome::Busy),
        s => Err(format!("a valid request answered {s}: {}", a.text())),
    }
}

/// Sends `bytes` on a new connection; a valid request must be written whole.
fn send(addr: SocketAddr, bytes: &[u8]) -> Result<TcpStream, String> {
    let mut s = connect(addr)?;
    s.write_all(bytes)
        .map_err(|e| format!("write failed on a valid request: {e}"))?;
    Ok(s)
}

/// A valid generation request: `body` (its `stream` field says how the answer comes) to
/// `path`, answered 200 (an `object` of at most `max_tokens`, or a whole stream) or 429.
fn valid(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    object: &str,
    max_tokens: u64,
) -> Result<Outcome, String> {
    let stream = body["stream"] == true;
    let bytes = request_bytes(path, "application/json", body.to_string().as_bytes());
    let mut s = send(addr, &bytes)?;
    let a = read_answer(&mut s, ANSWER_LIMIT)?;
    served_or_busy(&a, |a| {
        if stream {
            stream_answer(a)
        } else {
            json_answer(a, object, max_tokens)
        }
    })
}

/// One request of `kind` by client `client` (its `n`th).
fn one(
    addr: SocketAddr,
    kind: Kind,
    rng: &mut Rng,
    client: usize,
    n: u64,
) -> Result<Outcome, String> {
    let tag = format!("client {client} request {n}");
    match kind {
        Kind::Chat | Kind::ChatStream => {
            let stream = kind == Kind::ChatStream;
            let max_tokens = 1 + rng.below(4);
            let mut body = json!({
                "messages": [{"role": "user", "content": format!("Hello from {tag}")}],
                "max_tokens": max_tokens,
                "stream": stream,
            });
            if rng.below(2) == 0 {
                body["reasoning_effort"] = json!("none");
            }
            valid(
                addr,
                "/v1/chat/completions",
                &body,
                "chat.completion",
                max_tokens,
            )
        }
        Kind::Completion => {
            let stream = rng.below(3) == 0;
            let max_tokens = 1 + rng.below(4);
            let body = json!({"prompt": format!("The answer to {tag} is"), "max_tokens": max_tokens, "stream": stream});
            valid(
                addr,
                "/v1/completions",
                &body,
                "text_completion",
                max_tokens,
            )
        }
        Kind::Malformed => {
            let (path, body): (&str, String) = match rng.below(4) {
                0 => (
                    "/v1/completions",
                    format!("{{\"prompt\": \"{tag}\", \"max_tokens\": "),
                ),
                1 => ("/v1/chat/completions", "[1, 2, 3]".into()),
                2 => ("/v1/completions", json!({"prompt": 7}).to_string()),
                _ => (
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": tag}], "max_tokens": -1})
                        .to_string(),
                ),
            };
            let mut s = connect(addr)?;
            let _ = s.write_all(&request_bytes(path, "application/json", body.as_bytes()));
            let a = read_answer(&mut s, REFUSAL_LIMIT)?;
            match a.status {
                400 => refused_as(&a, 400, "invalid_request_error")
                    .map(|()| Outcome::Refused("400 invalid_request_error".into())),
                // The body budget was full while it arrived.
                429 => refused_as(&a, 429, "server_busy").map(|()| Outcome::Busy),
                s => Err(format!("malformed JSON answered {s}: {}", a.text())),
            }
        }
        Kind::WrongType => {
            let body = json!({"prompt": tag, "max_tokens": 1}).to_string();
            let mut s = connect(addr)?;
            let _ = s.write_all(&request_bytes(
                "/v1/completions",
                "text/plain",
                body.as_bytes(),
            ));
            let a = read_answer(&mut s, REFUSAL_LIMIT)?;
            refused_as(&a, 415, "unsupported_media_type")
                .map(|()| Outcome::Refused("415 unsupported_media_type".into()))
        }
        Kind::Oversized => {
            let size = MAX_REQUEST_BYTES + 1 + rng.below(MAX_REQUEST_BYTES as u64) as usize;
            let mut body = json!({"prompt": tag, "max_tokens": 1})
                .to_string()
                .into_bytes();
            body.resize(size, b' ');
            let mut s = connect(addr)?;
            let chunked = rng.below(2) == 0;
            if chunked {
                // No length: the limit is enforced while reading.
                let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
                for piece in body.chunks(8192) {
                    let mut c = format!("{:x}\r\n", piece.len()).into_bytes();
                    c.extend_from_slice(piece);
                    c.extend_from_slice(b"\r\n");
                    if s.write_all(&c).is_err() {
                        break;
                    }
                }
                let _ = s.write_all(b"0\r\n\r\n");
            } else {
                let _ = s.write_all(&request_bytes("/v1/completions", "application/json", &body));
            }
            let a = read_answer(&mut s, REFUSAL_LIMIT)?;
            match a.status {
                413 => refused_as(&a, 413, "request_too_large")
                    .map(|()| Outcome::Refused("413 request_too_large".into())),
                429 if chunked => refused_as(&a, 429, "server_busy").map(|()| Outcome::Busy),
                s => Err(format!(
                    "an oversized body (chunked: {chunked}) answered {s}: {}",
                    a.text()
                )),
            }
        }
        Kind::SlowBody => {
            // A head, then a few body bytes trickled, then nothing: 408 at the deadline.
            let body = json!({"prompt": tag, "max_tokens": 1}).to_string();
            let full = request_bytes("/v1/completions", "application/json", body.as_bytes());
            let head = &full[..full.len() - body.len()];
            let mut s = connect(addr)?;
            s.write_all(head)
                .map_err(|e| format!("write failed: {e}"))?;
            let t = Instant::now();
            for b in body.as_bytes().iter().take(3) {
                std::thread::sleep(Duration::from_millis(200));
                if s.write_all(&[*b]).is_err() {
                    break;
                }
            }
            let a = read_answer(&mut s, BODY_DEADLINE + DEADLINE_SLACK)?;
            let took = t.elapsed();
            match a.status {
                408 => {
                    refused_as(&a, 408, "request_timeout")?;
                    if took + Duration::from_millis(100) < BODY_DEADLINE {
                        return Err(format!(
                            "408 after {took:?}, before the {BODY_DEADLINE:?} deadline"
                        ));
                    }
                    Ok(Outcome::Refused("408 request_timeout".into()))
                }
                429 => refused_as(&a, 429, "server_busy").map(|()| Outcome::Busy),
                s => Err(format!("a slow body answered {s}: {}", a.text())),
            }
        }
        Kind::SlowHead => {
            // A head that never ends: closed, without an answer, at the header deadline.
            let mut s = connect(addr)?;
            let t = Instant::now();
            let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
            let (buf, end) = read_until(&mut s, HEADER_DEADLINE + DEADLINE_SLACK, &|_| false);
            let took = t.elapsed();
            if !buf.is_empty() {
                // An answer instead of a close must still be well-formed.
                let a = parse(&buf, true)?.ok_or("an incomplete answer to a slow head")?;
                return Err(format!("a slow head answered {}: {}", a.status, a.text()));
            }
            if !matches!(end, End::Eof | End::Reset) {
                return Err(format!("a slow head still open after {took:?} ({end:?})"));
            }
            if took + Duration::from_millis(100) < HEADER_DEADLINE {
                return Err(format!(
                    "a slow head closed after {took:?}, before the deadline"
                ));
            }
            Ok(Outcome::Closed)
        }
        Kind::Disconnect => {
            // A long stream: read its head and first frame, then leave.
            let (path, body) = if rng.below(2) == 0 {
                (
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": tag}], "max_tokens": 256, "stream": true}),
                )
            } else {
                (
                    "/v1/completions",
                    json!({"prompt": tag, "max_tokens": 256, "stream": true}),
                )
            };
            let mut s = send(
                addr,
                &request_bytes(path, "application/json", body.to_string().as_bytes()),
            )?;
            let first_frame = |b: &[u8]| {
                b.windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .is_some_and(|h| {
                        !b.starts_with(b"HTTP/1.1 200") || b[h..].windows(6).any(|w| w == b"data: ")
                    })
            };
            let (buf, end) = read_until(&mut s, ANSWER_LIMIT, &first_frame);
            if buf.starts_with(b"HTTP/1.1 200") && end == End::Stop {
                drop(s);
                return Ok(Outcome::Disconnected);
            }
            if end == End::Stop {
                // Not a 200: read the whole refusal.
                let rest = read_until(&mut s, REFUSAL_LIMIT, &|_| false);
                let all = [buf, rest.0].concat();
                let a = parse(&all, true)?.ok_or("an incomplete refusal")?;
                return served_or_busy(&a, |_| Err("unreachable".into()));
            }
            Err(format!(
                "no first frame ({end:?} after {} bytes)",
                buf.len()
            ))
        }
        Kind::CancelPrefill => {
            // A long prompt, dropped after 20…200 ms unless answered by then.
            let mut prompt = format!("{tag}: ");
            while prompt.len() < 16 * 1024 {
                prompt.push_str(&format!("w{} ", rng.below(10_000)));
            }
            let body = json!({"prompt": prompt, "max_tokens": 2});
            let mut s = send(
                addr,
                &request_bytes(
                    "/v1/completions",
                    "application/json",
                    body.to_string().as_bytes(),
                ),
            )?;
            let wait = Duration::from_millis(20 + rng.below(180));
            let (buf, end) = read_until(&mut s, wait, &|b| matches!(parse(b, false), Ok(Some(_))));
            match end {
                End::Timeout => Ok(Outcome::Dropped),
                End::Stop => {
                    let a = parse(&buf, false)?.ok_or("unreachable")?;
                    served_or_busy(&a, |a| json_answer(a, "text_completion", 2))
                }
                e => Err(format!(
                    "a long prompt's connection ended ({e:?}, {} bytes)",
                    buf.len()
                )),
            }
        }
    }
}

fn client(addr: SocketAddr, client: usize, until: Instant) -> Tally {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((client as u64 + 1) << 17));
    let mut tally = Tally::default();
    let mut n = 0u64;
    while Instant::now() < until {
        let kind = rng.kind();
        let t = Instant::now();
        let r = one(addr, kind, &mut rng, client, n);
        tally.add(kind, r, t.elapsed());
        n += 1;
    }
    tally
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

// ---------------------------------------------------------------------------------------

#[test]
#[cfg(target_os = "linux")]
fn sixty_four_clients_with_faults_leave_the_server_up_within_its_memory_plan() {
    let secs = load_duration();
    let mut server = spawn_server();
    let (addr, pid) = (server.addr, server.child.id());
    let t = Instant::now();
    loop {
        if get(addr, "/health").is_ok_and(|a| a.status == 200) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the model never became ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let plan = plan_of(&server);
    let bound = plan.budget + server_allowance();
    let (ready_rss, _) = proc_rss(pid).unwrap();
    // The request counts before the load (the readiness probes' 503s are not its).
    let before = String::from_utf8_lossy(&get(addr, "/metrics").unwrap().body).to_string();

    // RSS every 50 ms; the gauges every 250 ms.
    let done = Arc::new(AtomicBool::new(false));
    let peak_sampled = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, peak) = (done.clone(), peak_sampled.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                if let Some((rss, _)) = proc_rss(pid) {
                    peak.fetch_max(rss, Ordering::SeqCst);
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            n
        })
    };
    let gauges = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut max = BTreeMap::<&str, f64>::new();
            while !done.load(Ordering::SeqCst) {
                if let Ok(a) = get(addr, "/metrics") {
                    let text = String::from_utf8_lossy(&a.body).to_string();
                    for name in [
                        "deltafin_connections_open",
                        "deltafin_queue_depth",
                        "deltafin_request_body_bytes_held",
                    ] {
                        let v = gauge(&text, name);
                        let m = max.entry(name).or_insert(0.0);
                        *m = m.max(v);
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            max
        })
    };

    let start = Instant::now();
    let until = start + secs;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| std::thread::spawn(move || client(addr, i, until)))
        .collect();
    let mut tally = Tally::default();
    for c in clients {
        tally.merge(c.join().unwrap());
    }
    let load_wall = start.elapsed();
    done.store(true, Ordering::SeqCst);
    let samples_taken = sampler.join().unwrap();
    let gauge_max = gauges.join().unwrap();
    let peak_sampled = peak_sampled.load(Ordering::SeqCst);

    // The server is up and drains: the slot, the queue, the body budget and the
    // connections free (slow heads and dropped streams close within their deadlines).
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server exited under load: {:?}",
        server.lines_with("panicked")
    );
    let health = get(addr, "/health").unwrap();
    assert_eq!(health.status, 200, "{}", health.text());
    assert_eq!(
        serde_json::from_slice::<Value>(&health.body).unwrap(),
        json!({"status": "ok"})
    );
    let t = Instant::now();
    let metrics = loop {
        let text = String::from_utf8_lossy(&get(addr, "/metrics").unwrap().body).to_string();
        let idle = gauge(&text, "deltafin_generation_busy") == 0.0
            && gauge(&text, "deltafin_queue_depth") == 0.0
            && gauge(&text, "deltafin_request_body_bytes_held") == 0.0
            && gauge(&text, "deltafin_connections_open") <= 1.0;
        if idle {
            break text;
        }
        assert!(
            t.elapsed() < HEADER_DEADLINE + DEADLINE_SLACK,
            "the server did not drain after the load: {}",
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (end_rss, hwm) = proc_rss(pid).unwrap();

    // SIGTERM: exit 0 within the shutdown grace (nothing is open).
    // SAFETY: kill(2) on the child's pid; no memory is touched.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(12) {
            let _ = server.child.kill();
            panic!("serve did not exit within 12 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let shutdown = t.elapsed();
    // The reader thread has seen every line once stderr closed.
    std::thread::sleep(Duration::from_millis(200));

    // The figures.
    let total: u64 = tally.counts.values().sum();
    let valid = tally.count(|k, _| k.valid());
    let served = tally.count(|k, l| k.valid() && l == "200");
    let busy = tally.count(|_, l| l == "429");
    let mut refused = BTreeMap::<String, u64>::new();
    for ((k, l), n) in &tally.counts {
        if !k.valid() && l != "429" && l != "VIOLATION" {
            *refused.entry(l.clone()).or_default() += n;
        }
    }
    let refused_text: Vec<String> = refused.iter().map(|(l, n)| format!("{l} {n}")).collect();
    let mut lat = tally.served_latency.clone();
    lat.sort();
    let mut busy_lat = tally.busy_latency.clone();
    busy_lat.sort();
    let metric_sum = |name: &str, label: &str| -> f64 {
        samples(&metrics, name)
            .iter()
            .filter(|(l, _)| l.contains(label))
            .map(|(_, v)| v)
            .sum()
    };
    let finished = metric_sum("deltafin_generations_total", "outcome=\"finished\"");
    let cancelled = metric_sum("deltafin_generations_total", "outcome=\"cancelled\"");
    // What the load added to each request count: every status one the clients were
    // meant to see, or 499 for a client that left first; no 5xx.
    let counted_before = samples(&before, "deltafin_requests_total");
    let added: Vec<(String, f64)> = samples(&metrics, "deltafin_requests_total")
        .into_iter()
        .map(|(l, v)| {
            let was = counted_before
                .iter()
                .find(|(b, _)| *b == l)
                .map_or(0.0, |(_, n)| *n);
            (l, v - was)
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    let server_5xx: u64 = added
        .iter()
        .filter(|(l, _)| l.contains("status=\"5"))
        .map(|(_, v)| *v as u64)
        .sum();
    let server_499: u64 = added
        .iter()
        .filter(|(l, _)| l.contains("status=\"499\""))
        .map(|(_, v)| *v as u64)
        .sum();
    let refused_conns = gauge(&metrics, "deltafin_connections_refused_total");
    eprintln!(
        "[load] {}s x {CLIENTS} clients (queue {QUEUE}, --max-request-bytes {MAX_REQUEST_BYTES}, deadlines {}s/{}s): {total} requests; valid {valid}: served {served} (200), busy {} (429), streams dropped after the first frame {}, long prompts dropped {}; refused {} ({}), body budget 429 {}; violations {}; server: generations finished {finished:.0} cancelled {cancelled:.0}, 5xx {server_5xx}, 499 (client left) {server_499}, peak connections {:.0} queue {:.0} body bytes {:.0}; RSS ready {:.1} MB, peak {:.1} MB sampled ({samples_taken} samples) / {:.1} MB VmHWM, end {:.1} MB, plan {:.1} MB (runtime {:.1} MB) + allowance {:.1} MB; served latency p50 {:.1} ms p99 {:.1} ms (n {}), 429 p50 {:.1} ms; SIGTERM exit in {:.2}s",
        secs.as_secs(),
        HEADER_DEADLINE.as_secs(),
        BODY_DEADLINE.as_secs(),
        tally.count(|k, l| k.valid() && l == "429"),
        tally.count(|_, l| l == "disconnected"),
        tally.count(|_, l| l == "dropped"),
        refused.values().sum::<u64>(),
        refused_text.join(", "),
        tally.count(|k, l| !k.valid() && l == "429"),
        tally.violation_count,
        gauge_max
            .get("deltafin_connections_open")
            .copied()
            .unwrap_or(f64::NAN),
        gauge_max
            .get("deltafin_queue_depth")
            .copied()
            .unwrap_or(f64::NAN),
        gauge_max
            .get("deltafin_request_body_bytes_held")
            .copied()
            .unwrap_or(f64::NAN),
        mb(ready_rss),
        mb(peak_sampled),
        mb(hwm),
        mb(end_rss),
        mb(plan.budget),
        mb(plan.runtime),
        mb(server_allowance()),
        percentile(&lat, 0.50).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        lat.len(),
        percentile(&busy_lat, 0.50).as_secs_f64() * 1e3,
        shutdown.as_secs_f64(),
    );
    eprintln!("[load] plan: {}", plan.line);
    let by_kind: Vec<String> = tally
        .counts
        .iter()
        .map(|((k, l), n)| format!("{}/{l} {n}", k.name()))
        .collect();
    eprintln!("[load] by kind: {}", by_kind.join(", "));

    // The verdicts.
    assert!(
        tally.violation_count == 0,
        "{} violations, the first: {:#?}",
        tally.violation_count,
        tally.violations
    );
    assert!(status.success(), "exit status {status} after SIGTERM");
    let panics = server.lines_with("panicked");
    assert!(panics.is_empty(), "the server panicked: {panics:?}");
    let unexpected: Vec<&(String, f64)> = added
        .iter()
        .filter(|(l, _)| {
            !["200", "400", "408", "413", "415", "429", "499"]
                .iter()
                .any(|s| l.ends_with(&format!("status=\"{s}\"")))
        })
        .collect();
    assert!(
        unexpected.is_empty() && server_5xx == 0,
        "the server counted answers no client was meant to get: {unexpected:?} {:?}",
        server.lines_with("status=5")
    );
    assert_eq!(refused_conns, 0.0, "connections refused below the cap");
    assert!(
        hwm <= bound,
        "peak RSS {:.1} MB passed the plan's {:.1} MB + the allowance {:.1} MB",
        mb(hwm),
        mb(plan.budget),
        mb(server_allowance())
    );
    // Every kind ran, and the workload did what it is for: valid requests were served
    // while others were refused busy, streams and prefills were dropped by their clients.
    for (k, _) in Kind::MIX {
        assert!(
            tally.count(|kk, _| kk == k) > 0,
            "no {} request ran",
            k.name()
        );
    }
    assert!(served > 0 && busy > 0, "served {served}, busy {busy}");
    assert!(
        cancelled > 0.0,
        "no generation was cancelled by a client leaving"
    );
    assert!(
        load_wall < secs + ANSWER_LIMIT,
        "the clients took {load_wall:?}"
    );
}
