//! Who may use the server (docs/SERVER.md "Access"): web pages of other origins, rebound
//! host names, non-JSON posts and clients without the API key are refused before any work;
//! an allowed origin gets CORS headers and its preflight.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use deltafin_openai::access::{AccessConfig, ApiKey};
use serde_json::json;
use std::sync::OnceLock;

const KEY: &str = "test-key-0123456789";

fn open() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    shared_server(&S, any_port())
}

/// A ready server that wants [`KEY`] and allows `cors_origin`.
fn keyed(cors_origin: Option<&str>) -> TestServer {
    let s = TestServer::start(ServerConfig {
        access: AccessConfig {
            api_key: Some(ApiKey::new(KEY).unwrap()),
            cors_origin: cors_origin.map(str::to_string),
        },
        ..any_port()
    });
    // Readiness through /health, which needs no key.
    wait_until(
        std::time::Duration::from_secs(30),
        || send(&s, "GET", "/health", &[HOST]).status == 200,
        "model ready",
    );
    s
}

fn guarded() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    S.get_or_init(|| keyed(Some("http://localhost:3000")))
}

fn body() -> Vec<u8> {
    json!({"prompt": "x", "max_tokens": 1})
        .to_string()
        .into_bytes()
}

/// A raw request with exactly these headers (beside Connection and Content-Length).
fn send(s: &TestServer, method: &str, path: &str, headers: &[(&str, &str)]) -> Resp {
    let b = if method == "POST" { body() } else { Vec::new() };
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        b.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(&b);
    raw(s.addr, &bytes)
}

const JSON: (&str, &str) = ("Content-Type", "application/json");
const HOST: (&str, &str) = ("Host", "127.0.0.1:8000");

#[test]
fn cross_origin_rebound_and_non_json_requests_are_refused() {
    let s = open();
    assert_eq!(
        send(s, "POST", "/v1/completions", &[HOST, JSON]).status,
        200
    );
    // A web page of any origin (the browser adds Origin), also for GETs.
    for origin in ["http://evil.example", "null", "http://localhost:3000"] {
        let r = send(
            s,
            "POST",
            "/v1/completions",
            &[HOST, JSON, ("Origin", origin)],
        );
        let e = r.error(403);
        assert_eq!(e["code"], "forbidden_origin", "{origin}");
        assert!(e["message"].as_str().unwrap().contains("--cors-origin"));
        assert!(r.header("access-control-allow-origin").is_none());
        assert_eq!(
            send(s, "GET", "/v1/models", &[HOST, ("Origin", origin)]).status,
            403
        );
    }
    // A DNS name rebound to 127.0.0.1.
    let r = send(
        s,
        "POST",
        "/v1/completions",
        &[("Host", "evil.example:8000"), JSON],
    );
    assert_eq!(r.error(403)["code"], "forbidden_host");
    assert_eq!(
        send(s, "GET", "/metrics", &[("Host", "evil.example")]).status,
        403
    );
    for ok in ["localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"] {
        assert_eq!(
            send(s, "GET", "/v1/models", &[("Host", ok)]).status,
            200,
            "{ok}"
        );
    }
    // Bodies a page can send without a preflight.
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let r = send(
            s,
            "POST",
            "/v1/chat/completions",
            &[HOST, ("Content-Type", ct)],
        );
        let e = r.error(415);
        assert_eq!(e["code"], "unsupported_media_type", "{ct}");
        assert!(e["message"].as_str().unwrap().contains("application/json"));
    }
    assert_eq!(send(s, "POST", "/v1/completions", &[HOST]).status, 415);
    assert_eq!(
        send(
            s,
            "POST",
            "/tokenize",
            &[HOST, ("Content-Type", "text/plain")]
        )
        .status,
        415
    );
    let r = send(
        s,
        "POST",
        "/v1/completions",
        &[HOST, ("Content-Type", "Application/JSON; charset=utf-8")],
    );
    assert_eq!(r.status, 200);
}

#[test]
fn the_api_key_and_the_allowed_origin() {
    let s = guarded();
    for headers in [
        vec![HOST, JSON],
        vec![HOST, JSON, ("Authorization", "Bearer wrong-key-0123456789")],
        vec![HOST, JSON, ("Authorization", KEY)],
        vec![HOST, JSON, ("x-api-key", "test-key-012345678")],
    ] {
        let r = send(s, "POST", "/v1/completions", &headers);
        assert_eq!(r.error(401)["code"], "invalid_api_key", "{headers:?}");
    }
    assert_eq!(send(s, "GET", "/metrics", &[HOST]).status, 401);
    // /health stays open to probes.
    assert_eq!(send(s, "GET", "/health", &[HOST]).status, 200);
    let bearer = format!("Bearer {KEY}");
    let ok = send(
        s,
        "POST",
        "/v1/completions",
        &[HOST, JSON, ("Authorization", &bearer)],
    );
    assert_eq!(ok.status, 200);
    assert!(ok.header("access-control-allow-origin").is_none());
    let ok = send(
        s,
        "POST",
        "/v1/completions",
        &[HOST, JSON, ("x-api-key", KEY)],
    );
    assert_eq!(ok.status, 200);
    // The allowed origin: its preflight, then its request with CORS headers.
    let origin = ("Origin", "http://localhost:3000");
    let pre = send(
        s,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            HOST,
            origin,
            (
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
        ],
    );
    assert_eq!(pre.status, 204);
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    assert!(
        pre.header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
    assert_eq!(
        pre.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    let r = send(
        s,
        "POST",
        "/v1/completions",
        &[HOST, JSON, origin, ("Authorization", &bearer)],
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    assert!(
        r.header("access-control-expose-headers")
            .unwrap()
            .contains("x-request-id")
    );
    // Another origin is still refused, key or not.
    let r = send(
        s,
        "POST",
        "/v1/completions",
        &[
            HOST,
            JSON,
            ("Origin", "http://localhost:3001"),
            ("Authorization", &bearer),
        ],
    );
    assert_eq!(r.error(403)["code"], "forbidden_origin");
}

#[test]
fn the_chat_page_is_served_without_the_key_and_is_its_own_origin() {
    // A server of its own: the other tests' completions would find its one slot taken.
    let s = &keyed(None);
    let host = format!("127.0.0.1:{}", s.addr.port());
    let origin = format!("http://{host}");
    let auth = format!("Bearer {KEY}");
    let h = ("Host", host.as_str());
    // The page and its files need no key and carry the policy.
    let r = send(s, "GET", "/", &[h]);
    assert_eq!(r.status, 200);
    let csp = r.header("content-security-policy").unwrap();
    assert!(csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(r.header("x-frame-options"), Some("DENY"));
    assert_eq!(
        r.header("cross-origin-resource-policy"),
        Some("same-origin")
    );
    assert_eq!(send(s, "GET", "/assets/app.js", &[h]).status, 200);
    assert_eq!(
        send(s, "POST", "/", &[h, JSON]).error(405)["code"],
        "method_not_allowed"
    );
    // What the page asks of the server still wants the key...
    send(s, "GET", "/v1/status", &[h, ("Origin", &origin)]).error(401);
    // ...and with it the page's own origin is served, without CORS headers.
    let r = send(
        s,
        "POST",
        "/v1/completions",
        &[h, JSON, ("Origin", &origin), ("Authorization", &auth)],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("access-control-allow-origin").is_none());
    // Another port is another origin, and a rebound name stays refused even when its page's
    // origin matches its Host.
    let other = format!("http://127.0.0.1:{}", s.addr.port().wrapping_add(1));
    for (host, origin) in [
        (host.as_str(), other.as_str()),
        ("evil.example:8000", "http://evil.example:8000"),
    ] {
        let r = send(
            s,
            "POST",
            "/v1/completions",
            &[
                ("Host", host),
                JSON,
                ("Origin", origin),
                ("Authorization", &auth),
            ],
        );
        assert_eq!(r.error(403)["type"], "permission_error");
    }
    // The status object of a ready server without a memory budget.
    let v = send(s, "GET", "/v1/status", &[h, ("Authorization", &auth)]).json();
    assert_eq!(v["object"], "deltafin.status");
    assert_eq!(v["state"], "ready");
    assert!(v["model_info"]["context_tokens"].as_u64().unwrap() > 0);
    assert!(v["model_info"]["memory_plan"].is_null());
    assert!(v["totals"]["completion_tokens"].as_u64().unwrap() >= 1);
    // No benchmark directory: the page is told so.
    let e = send(s, "GET", "/v1/benchmark", &[h, ("Authorization", &auth)]).error(404);
    assert_eq!(e["code"], "benchmark_not_found");
}
