//! Load and fault tests (bounded, loopback only): contention with queue 0 and 8, body limits,
//! slow clients, disconnects and disconnect storms, graceful shutdown. After each, the slot
//! must be free and the server must still serve.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use deltafin_openai::error::BUSY_MESSAGE;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn start(queue: usize, max_request_bytes: usize) -> TestServer {
    let s = TestServer::start(ServerConfig {
        queue,
        max_request_bytes,
        ..any_port()
    });
    s.wait_ready();
    s
}

/// The bytes of `POST /v1/completions` with `body`.
fn completion_request(body: &Value) -> Vec<u8> {
    request_bytes("POST", "/v1/completions", body.to_string().as_bytes(), &[])
}

/// Connects and sends `POST /v1/completions` with `body`; the response is left unread.
fn send_completion(addr: SocketAddr, body: &Value) -> TcpStream {
    let mut c = connect(addr);
    c.write_all(&completion_request(body)).unwrap();
    c
}

/// Waits (at most 10 s) until `cond` holds.
fn eventually(what: &str, cond: impl FnMut() -> bool) {
    wait_until(Duration::from_secs(10), cond, what)
}

/// Opens a long streaming generation and waits for its first content frame, so the slot is
/// certainly held. Returns the open connection.
fn hold_slot(s: &TestServer) -> BufReader<TcpStream> {
    let c = send_completion(
        s.addr,
        &json!({"prompt": "hold", "max_tokens": 1_000_000, "stream": true}),
    );
    let mut r = BufReader::new(c);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream closed early");
        if line.starts_with("data: {") {
            return r;
        }
    }
}

/// A server with a queue of 8 whose slot a long stream holds: the server, the generations
/// started before the stream, and the stream's connection.
fn held_server() -> (TestServer, u64, BufReader<TcpStream>) {
    let s = start(8, 1 << 20);
    let base = started(&s.stats);
    let holder = hold_slot(&s);
    (s, base, holder)
}

fn assert_busy(r: &Resp) {
    let e = r.error(429);
    assert_eq!(e["code"], "server_busy");
    assert_eq!(e["message"], BUSY_MESSAGE);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("connection"), Some("close"));
}

/// The slot and queue are free again, and the server still answers.
fn recovered(s: &TestServer) {
    s.wait_idle();
    short_ok(s);
}

fn short_ok(s: &TestServer) {
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "still there?", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

fn fire(s: &TestServer, n: usize) -> Vec<std::thread::JoinHandle<Resp>> {
    let barrier = Arc::new(Barrier::new(n));
    (0..n)
        .map(|i| {
            let (addr, b) = (s.addr, barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                post_json(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": format!("client {i}"), "max_tokens": 2}),
                )
            })
        })
        .collect()
}

#[test]
fn sixty_four_clients_with_queue_0_get_429_while_busy() {
    let s = start(0, 1 << 20);
    let holder = hold_slot(&s);
    let results: Vec<Resp> = fire(&s, 64)
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    results.iter().for_each(assert_busy);
    assert_eq!(s.stats.busy_rejections.load(Ordering::SeqCst), 64);
    drop(holder);
    s.wait_idle();
    // Unheld: concurrent clients each get a well-formed answer, and at least one is served.
    let results: Vec<Resp> = fire(&s, 64)
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let ok = results.iter().filter(|r| r.status == 200).count();
    for r in results.iter().filter(|r| r.status != 200) {
        assert_busy(r);
    }
    assert!(ok >= 1);
    recovered(&s);
}

#[test]
fn sixty_four_clients_with_queue_8_queue_eight_in_order_and_refuse_the_rest() {
    let (s, base, holder) = held_server();
    let handles = fire(&s, 64);
    wait_until(
        Duration::from_secs(20),
        || s.stats.busy_rejections.load(Ordering::SeqCst) == 56 && s.reserved() == 9,
        "56 refusals and 8 waiters",
    );
    // The waiters do not run while the slot is held.
    assert_eq!(started(&s.stats), base + 1);
    drop(holder);
    let results: Vec<Resp> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let served: Vec<&Resp> = results.iter().filter(|r| r.status == 200).collect();
    assert_eq!(served.len(), 8);
    for r in &served {
        assert_eq!(r.json()["object"], "text_completion");
    }
    for r in results.iter().filter(|r| r.status != 200) {
        assert_busy(r);
    }
    s.wait_idle();
    assert_eq!(started(&s.stats), base + 9);
    short_ok(&s);
}

#[test]
fn bodies_over_the_limit_get_413_and_close() {
    let s = start(0, 1000);
    // Declared too large: refused before any body byte is sent.
    let mut c = connect(s.addr);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
        .unwrap();
    let r = read_all(&mut c);
    let e = r.error(413);
    assert_eq!(e["message"], "request body exceeds the 1000-byte limit");
    assert_eq!(r.header("connection"), Some("close"));
    // Chunked without a length: enforced while reading.
    let mut c = connect(s.addr);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        .unwrap();
    let chunk = " ".repeat(600);
    for _ in 0..2 {
        let _ = c.write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
    }
    let r = read_all(&mut c);
    r.error(413);
    assert_eq!(r.header("connection"), Some("close"));
    // Exactly at the limit is fine.
    let mut body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    body.push_str(&" ".repeat(1000 - body.len()));
    assert_eq!(
        request(s.addr, "POST", "/v1/completions", body.as_bytes()).status,
        200
    );
    recovered(&s);
}

#[test]
fn a_slow_body_takes_no_place_until_it_is_complete() {
    let s = start(0, 1 << 20);
    let body = json!({"prompt": "slowly", "max_tokens": 2}).to_string();
    let bytes = request_bytes("POST", "/v1/completions", body.as_bytes(), &[]);
    let mut c = connect(s.addr);
    let (head, rest) = bytes.split_at(bytes.len() - body.len());
    c.write_all(head).unwrap();
    for (i, piece) in rest.chunks(body.len().div_ceil(8)).enumerate() {
        std::thread::sleep(Duration::from_millis(25));
        c.write_all(piece).unwrap();
        if i == 0 {
            // The body is still arriving: it holds no place, and with queue 0 another
            // request is served meanwhile.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(s.reserved(), 0);
            short_ok(&s);
            let m = get(s.addr, "/metrics");
            let text = String::from_utf8_lossy(&m.body).to_string();
            assert!(
                text.lines()
                    .any(|l| l.starts_with("deltafin_request_body_bytes_held ")
                        && l != "deltafin_request_body_bytes_held 0"),
                "{text}"
            );
        }
    }
    let r = read_all(&mut c);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["usage"]["completion_tokens"], 2);
    // A slow SSE reader: the generation finishes and the slot is freed.
    let mut c = send_completion(
        s.addr,
        &json!({"prompt": "slow reader", "max_tokens": 64, "stream": true}),
    );
    std::thread::sleep(Duration::from_millis(300));
    let r = read_all(&mut c);
    assert_eq!(r.sse().last().map(String::as_str), Some("[DONE]"));
    recovered(&s);
}

#[test]
fn malformed_requests_never_take_the_place_of_a_valid_one() {
    // Queue 0: while a generation holds the slot every valid request is a 429, but each
    // invalid one is refused for what it is.
    let (s, _, holder) = held_server();
    for (body, code) in [
        (json!({"prompt": "x", "max_tokens": -1}), 400),
        (json!({"prompt": 7}), 400),
        (json!({"prompt": "x", "temperature": 9}), 400),
    ] {
        let r = post_json(s.addr, "/v1/completions", &body);
        assert_eq!(
            r.status,
            code,
            "{body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["error"]["code"], "invalid_request_error");
    }
    let r = raw(
        s.addr,
        &request_bytes("POST", "/v1/completions", b"{not json", &[]),
    );
    assert_eq!(r.status, 400);
    assert_eq!(s.reserved(), 1, "only the holder has a place");
    drop(holder);
    recovered(&s);
}

#[test]
fn request_bodies_in_flight_are_bounded_in_bytes() {
    // A 1 KiB body limit: 4 KiB of bodies may be held while they arrive. Four bodies of
    // which 1,020 bytes arrived leave no room for another request's, which is refused with
    // 429; none of them takes a place.
    let s = start(8, 1024);
    let half = vec![b' '; 1020];
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut c = connect(s.addr);
        let mut head = request_bytes("POST", "/v1/completions", &[b' '; 1024], &[]);
        head.truncate(head.len() - 1024);
        c.write_all(&head).unwrap();
        c.write_all(&half).unwrap();
        open.push(c);
    }
    wait_until(
        Duration::from_secs(5),
        || metric(&s, "deltafin_request_body_bytes_held") == 4080.0,
        "four bodies held",
    );
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
    );
    let e = r.error(429);
    assert_eq!(e["code"], "server_busy");
    assert!(e["message"].as_str().unwrap().contains("4096 bytes"), "{e}");
    assert_eq!(s.reserved(), 0);
    drop(open);
    wait_until(
        Duration::from_secs(5),
        || metric(&s, "deltafin_request_body_bytes_held") == 0.0,
        "bodies released",
    );
    recovered(&s);
}

/// The value of an unlabelled sample in `/metrics`.
fn metric(s: &TestServer, name: &str) -> f64 {
    let m = get(s.addr, "/metrics");
    String::from_utf8_lossy(&m.body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(f64::NAN)
}

#[test]
fn connections_past_the_cap_get_503_and_the_rest_still_work() {
    let s = TestServer::start(ServerConfig {
        max_connections: 8,
        ..any_port()
    });
    s.wait_ready();
    // Seven idle connections and the one asking for the metrics fill the cap; then an
    // eighth idle one does.
    // Every refusal the test itself meets (a poll or a connection arriving while an earlier
    // one is still closing) is counted, so the server's refusal count can be checked exactly.
    let early = std::cell::Cell::new(0u32);
    let open_now = || {
        let m = get(s.addr, "/metrics");
        if m.status == 503 {
            early.set(early.get() + 1);
        }
        (m.status == 200).then_some(())?;
        String::from_utf8_lossy(&m.body).lines().find_map(|l| {
            l.strip_prefix("deltafin_connections_open ")?
                .parse::<f64>()
                .ok()
        })
    };
    let mut idle: Vec<TcpStream> = (0..7).map(|_| connect(s.addr)).collect();
    wait_until(
        Duration::from_secs(5),
        || open_now() == Some(8.0),
        "7 idle + 1 asking",
    );
    // The asking connection may still be closing when the eighth connects: one that got the
    // 503 instead (it has bytes to read) is replaced until one stays open and silent.
    loop {
        let c = connect(s.addr);
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let refused = c.peek(&mut [0u8; 1]).is_ok();
        if !refused {
            c.set_read_timeout(None).unwrap();
            idle.push(c);
            break;
        }
        early.set(early.get() + 1);
        assert!(early.get() < 20, "no place freed for the eighth connection");
    }
    let mut extra = (0..3).map(|_| connect(s.addr)).collect::<Vec<_>>();
    for mut c in extra.drain(..) {
        // Refused at once, whatever was sent.
        let _ = c.write_all(&request_bytes("GET", "/health", b"", &[]));
        let r = read_all(&mut c);
        assert_eq!(r.status, 503);
        assert_eq!(r.json()["error"]["code"], "too_many_connections");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    drop(idle);
    wait_until(
        Duration::from_secs(5),
        || open_now() == Some(1.0),
        "idle connections closed",
    );
    assert_eq!(
        metric_raw(s.addr, "deltafin_connections_refused_total"),
        Some(3.0 + f64::from(early.get()))
    );
    short_ok(&s);
}

/// `metric` by address; `None` when the answer is not a 200 (e.g. refused).
fn metric_raw(addr: SocketAddr, name: &str) -> Option<f64> {
    let m = get(addr, "/metrics");
    (m.status == 200).then_some(())?;
    String::from_utf8_lossy(&m.body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_slow_head_and_an_idle_keep_alive_are_closed_at_the_header_deadline() {
    let s = TestServer::start(ServerConfig {
        header_deadline: Duration::from_millis(500),
        ..any_port()
    });
    s.wait_ready();
    // A head that never ends.
    let mut c = connect(s.addr);
    let t = std::time::Instant::now();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(5),
        "closed after {took:?}"
    );
    // A keep-alive connection: served twice, then closed once idle past the deadline.
    let mut c = connect(s.addr);
    let keep = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let mut r = BufReader::new(c.try_clone().unwrap());
    for _ in 0..2 {
        c.write_all(keep).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
        let mut len = 0usize;
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let t = std::time::Instant::now();
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(rest.is_empty());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "idle connection kept open"
    );
    short_ok(&s);
}

#[test]
fn disconnects_cancel_the_generation_and_free_the_slot() {
    let s = start(0, 1 << 20);
    let base = started(&s.stats);
    // Streaming: the client leaves after the first frame.
    drop(hold_slot(&s));
    eventually("stream cancelled", || cancelled(&s.stats) == 1);
    s.wait_idle();
    // Non-streaming: the client leaves while the generation runs.
    let c = send_completion(s.addr, &json!({"prompt": "long", "max_tokens": 1_000_000}));
    eventually("second generation started", || {
        started(&s.stats) == base + 2
    });
    drop(c);
    eventually("non-stream cancelled", || cancelled(&s.stats) == 2);
    recovered(&s);
}

#[test]
fn disconnect_storm_leaves_no_leaked_slot() {
    let (s, base, holder) = held_server();
    // Eight waiters queue, then all leave: they are dropped without generating.
    let mut waiters = Vec::new();
    for i in 0..8 {
        let c = send_completion(s.addr, &json!({"prompt": format!("w{i}"), "max_tokens": 2}));
        waiters.push(c);
    }
    eventually("8 waiters", || s.reserved() == 9);
    drop(waiters);
    eventually("waiters dropped", || s.reserved() == 1);
    assert_eq!(started(&s.stats), base + 1);
    drop(holder);
    s.wait_idle();
    // Twenty clients open streams and vanish at once.
    let handles: Vec<_> = (0..20)
        .map(|_| {
            let addr = s.addr;
            std::thread::spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                let body = json!({"prompt": "storm", "max_tokens": 1_000_000, "stream": true});
                let _ = c.write_all(&completion_request(&body));
                std::thread::sleep(Duration::from_millis(30));
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    s.wait_idle();
    let st = &s.stats;
    eventually("every started generation ended", || {
        started(st) == cancelled(st) + st.generations_finished.load(Ordering::SeqCst)
    });
    short_ok(&s);
}

#[test]
fn shutdown_cancels_the_running_stream_and_returns() {
    let s = start(0, 1 << 20);
    let mut holder = hold_slot(&s);
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut holder, &mut rest);
        rest
    });
    let t = std::time::Instant::now();
    s.shutdown().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10));
    // The stream ends with one error frame and without [DONE].
    let rest = reader.join().unwrap();
    assert!(rest.contains("data: {\"error\":"), "{rest}");
    assert!(rest.contains("server_shutting_down"), "{rest}");
    assert!(!rest.contains("[DONE]"));
}

/// A client that trickles its body (a byte every 300 ms, never idle long enough for the
/// 60 s idle timeout) is answered 408 at the body deadline and its queue place is freed.
#[test]
fn a_trickled_body_meets_the_body_deadline() {
    let s = TestServer::start(ServerConfig {
        body_deadline: Duration::from_secs(1),
        ..any_port()
    });
    s.wait_ready();
    let mut c = connect(s.addr);
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
    )
    .unwrap();
    let t = std::time::Instant::now();
    let writer = {
        let mut c = c.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..20 {
                if c.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let r = read_all(&mut c);
    let took = t.elapsed();
    assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("did not arrive within 1 s"));
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    let _ = writer.join();
    s.wait_idle();
    short_ok(&s);
}
