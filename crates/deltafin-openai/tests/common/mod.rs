//! Shared helpers of the server tests: a tiny synthesized checkpoint, an in-process server on
//! a loopback port, and a minimal raw HTTP/1.1 client (full control over bytes, timing and
//! disconnects).
#![allow(dead_code)]

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_openai::{Engine, Server, ServerConfig, ServerStats};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[path = "../../../deltafin-kernels/tests/common/skip.rs"]
mod skip;
#[allow(unused_imports)] // Not every test binary has a test that may skip.
pub use skip::skip;

/// One tiny checkpoint shared by every test of a test binary.
pub fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 11)).unwrap();
        deltafin_k3::synth::remove_at_exit(d.path());
        d
    })
    .path()
}

/// The engine loaded once, for comparisons with direct generation.
pub fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::load(model_root()).unwrap())
}

/// A server running on its own runtime thread; stopped (and joined) on drop.
pub struct TestServer {
    pub addr: SocketAddr,
    pub stats: Arc<ServerStats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

/// The default server settings on a free loopback port.
pub fn any_port() -> ServerConfig {
    ServerConfig {
        port: 0,
        ..Default::default()
    }
}

/// The server kept in `cell`, started with `cfg` (ready) on first use: one server shared by
/// the tests of a binary.
pub fn shared_server(
    cell: &'static OnceLock<TestServer>,
    cfg: ServerConfig,
) -> &'static TestServer {
    cell.get_or_init(|| {
        let s = TestServer::start(cfg);
        s.wait_ready();
        s
    })
}

/// The engine of `root`, loaded as a server's loader does (the error as text), without the
/// response memo: every request of a test runs the model (the memo's own tests turn it on).
pub fn load_engine(root: &Path) -> Result<Engine, String> {
    Engine::load(root)
        .map(|e| e.with_memo(0, 0))
        .map_err(|e| e.to_string())
}

impl TestServer {
    pub fn start(cfg: ServerConfig) -> TestServer {
        let root = model_root().to_path_buf();
        Self::start_with(cfg, move || load_engine(&root))
    }

    pub fn start_with(
        cfg: ServerConfig,
        loader: impl FnOnce() -> Result<Engine, String> + Send + 'static,
    ) -> TestServer {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let server = Server::bind_with_loader(cfg, loader)
                    .await
                    .map_err(|e| e.to_string())?;
                addr_tx
                    .send((server.local_addr().unwrap(), server.stats()))
                    .unwrap();
                server
                    .run(async move {
                        let _ = stop_rx.await;
                    })
                    .await
                    .map_err(|e| e.to_string())
            })
        });
        let (addr, stats) = addr_rx.recv_timeout(Duration::from_secs(20)).unwrap();
        TestServer {
            addr,
            stats,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// Waits until completions answer something other than 503.
    pub fn wait_ready(&self) {
        let t = Instant::now();
        loop {
            let r = post_json(
                self.addr,
                "/v1/completions",
                &serde_json::json!({"prompt": "x", "max_tokens": 1}),
            );
            if r.status != 503 {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "model never became ready"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Signals shutdown and returns what `run` returned.
    pub fn shutdown(mut self) -> Result<(), String> {
        self.stop.take().map(|s| s.send(()));
        self.thread.take().unwrap().join().unwrap()
    }

    /// Waits for the server to stop on its own (e.g. a failed load).
    pub fn join(mut self) -> Result<(), String> {
        let r = self.thread.take().unwrap().join().unwrap();
        self.stop.take();
        r
    }

    pub fn reserved(&self) -> usize {
        self.stats
            .reserved
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits (bounded) until no request holds the slot or a queue place.
    pub fn wait_idle(&self) {
        wait_until(
            Duration::from_secs(20),
            || self.reserved() == 0,
            "slot freed",
        );
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            // A server that does not stop is a hang (a generation stuck on the model): end
            // the test binary with a message instead of waiting for CI's time limit.
            let t0 = Instant::now();
            while !t.is_finished() {
                if t0.elapsed() > Duration::from_secs(120) {
                    eprintln!("test server did not stop within 120 s of shutdown: aborting");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = t.join();
        }
    }
}

pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool, what: &str) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn started(stats: &ServerStats) -> u64 {
    stats
        .generations_started
        .load(std::sync::atomic::Ordering::SeqCst)
}
pub fn cancelled(stats: &ServerStats) -> u64 {
    stats
        .generations_cancelled
        .load(std::sync::atomic::Ordering::SeqCst)
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    /// The `data:` payloads of an SSE body.
    pub fn sse(&self) -> Vec<String> {
        sse_payloads(&String::from_utf8(self.body.clone()).unwrap())
    }
    /// Asserts an OpenAI-shaped error with the contract's headers; returns the error object.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/json; charset=utf-8")
        );
        assert_eq!(self.header("x-content-type-options"), Some("nosniff"));
        let v = self.json();
        let e = &v["error"];
        assert!(
            e["message"].is_string() && e["type"].is_string() && e["code"].is_string(),
            "{v}"
        );
        assert!(e.as_object().unwrap().contains_key("param"), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 1);
        e.clone()
    }
}

pub fn sse_payloads(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|block| block.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Parses a complete HTTP/1.1 response (Content-Length, chunked, or close-delimited).
pub fn parse_response(raw: &[u8]) -> Resp {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..head_end]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let rest = &raw[head_end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Resp {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size_str = std::str::from_utf8(&data[..eol]).unwrap();
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        if start + size + 2 > data.len() {
            break;
        }
        data = &data[start + size + 2..];
    }
    out
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// Sends raw bytes, reads to EOF.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Resp {
    let mut s = connect(addr);
    s.write_all(bytes).unwrap();
    read_all(&mut s)
}

pub fn read_all(s: &mut TcpStream) -> Resp {
    let mut buf = Vec::new();
    // A reset after a complete answer (the server closed with unread input) is fine.
    let mut chunk = [0u8; 8192];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if !buf.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "read failed: {e}; the server's sequences now:\n{}",
                sequences_now(s.peer_addr().ok())
            ),
        }
    }
    parse_response(&buf)
}

/// The server's `/metrics` lines about its generations and batched passes (what a stalled
/// request waits for), read on a fresh connection with a short timeout.
fn sequences_now(addr: Option<SocketAddr>) -> String {
    let Some(addr) = addr else {
        return "(no peer address)".into();
    };
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return "(cannot connect)".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if s.write_all(req).is_err() {
        return "(cannot send)".into();
    }
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf)
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && [
                    "sequences",
                    "decode",
                    "turns",
                    "pass",
                    "generation",
                    "queue",
                ]
                .iter()
                .any(|k| l.contains(k))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A request as a client on this machine sends it: `Host: 127.0.0.1`, a JSON body (unless
/// `extra` names its own `Content-Type`).
pub fn request_bytes(method: &str, path: &str, body: &[u8], extra: &[(&str, &str)]) -> Vec<u8> {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !extra
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Resp {
    raw(
        addr,
        &request_bytes(method, path, body, &[("Content-Type", "application/json")]),
    )
}

pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, b"")
}
