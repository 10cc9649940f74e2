//! Who may use the server (docs/SERVER.md "Access"): checked on every request before
//! anything else is done for it.
//!
//! A server on 127.0.0.1 is reachable by every web page the user opens: a page may POST to
//! it (a "simple" cross-origin request needs no preflight when its body is `text/plain` or a
//! form), and a page whose DNS name is rebound to 127.0.0.1 may even read the answers. So:
//!
//! - **Host.** On a loopback address, the `Host` header must name this server: `localhost`,
//!   a loopback address, or the `--host` value (with any port). A rebound name is refused.
//! - **Origin.** A request with an `Origin` header (a browser's) is refused unless it comes
//!   from the server's own chat page or is the `--cors-origin`; then the answer carries the
//!   CORS headers, and an `OPTIONS` preflight from that origin is answered. The page's own
//!   origin is the one whose `host[:port]` is the request's `Host`, when that `Host` names
//!   this server beyond doubt: `localhost`, an IP address or the `--host` value (on a
//!   loopback listener the Host check below already holds every request to that), so a page
//!   whose DNS name was rebound to this machine is still another origin.
//! - **Content-Type.** A POST must say `application/json`; forms and `text/plain` are
//!   refused (a browser cannot send `application/json` cross-origin without a preflight).
//! - **API key.** With `--api-key` (or `DELTAFIN_API_KEY`), every endpoint but `/health`
//!   and the chat page's own files (`GET /`, `/assets/…`: code only, no data) wants `Authorization: Bearer KEY` (the OpenAI clients) or `x-api-key: KEY` (the
//!   Anthropic clients), compared in constant time.

use crate::error::ApiError;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::fmt;

/// An API key; its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key: 16…256 printable ASCII characters without spaces.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        let ok = (16..=256).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic());
        if ok {
            Ok(ApiKey(key.to_string()))
        } else {
            Err("an API key must be 16 to 256 printable ASCII characters without spaces".into())
        }
    }

    fn matches(&self, given: &[u8]) -> bool {
        let want = self.0.as_bytes();
        // Constant time in the key's content (the length is not secret).
        given.len() == want.len()
            && given
                .iter()
                .zip(want)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

/// `scheme://host[:port]` with scheme `http` or `https`, lowercase, no path: a browser's
/// `Origin` value, as `--cors-origin` takes it.
pub fn check_origin(origin: &str) -> Result<String, String> {
    let o = origin.trim_end_matches('/');
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))
        .ok_or_else(|| format!("{origin:?} is not an origin (http://HOST[:PORT] or https://…)"))?;
    let host_ok = !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if !host_ok {
        return Err(format!(
            "{origin:?} is not an origin: only scheme, host and port, no path, query or user"
        ));
    }
    Ok(o.to_ascii_lowercase())
}

/// What the server lets through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessConfig {
    /// `--api-key` / `DELTAFIN_API_KEY`.
    pub api_key: Option<ApiKey>,
    /// `--cors-origin`, already checked by [`check_origin`].
    pub cors_origin: Option<String>,
}

/// The hostname of a `Host` header (without its port; an IPv6 literal without brackets).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

fn is_loopback_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn forbidden(code: &'static str, message: String) -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        kind: "permission_error",
        code,
        param: None,
        message,
    }
}

/// Whether `origin` is the server's own page: `http://` or `https://` followed by exactly the
/// request's `host` (ASCII case ignored), where that host's name is a loopback name, an IP
/// address or `bound_host`: names no DNS rebinding can take over.
fn same_origin(origin: &str, host: Option<&str>, bound_host: &str) -> bool {
    let Some(host) = host.map(str::trim) else {
        return false;
    };
    let origin = origin.trim_end_matches('/');
    let Some(authority) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    let name = host_name(host);
    let trusted = is_loopback_name(name)
        || name.parse::<std::net::IpAddr>().is_ok()
        || name.eq_ignore_ascii_case(host_name(bound_host));
    trusted && !host.is_empty() && authority.eq_ignore_ascii_case(host)
}

/// What to do with a request after [`check`].
pub enum Admit {
    /// Serve it; add these CORS headers to the answer.
    Serve(Option<HeaderValue>),
    /// Answered already (a preflight).
    Answered(Response),
}

/// Check one request. `bound_host` is `--host`; `loopback`, whether the listener is on a
/// loopback address.
pub fn check(
    cfg: &AccessConfig,
    bound_host: &str,
    loopback: bool,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> Result<Admit, ApiError> {
    let text = |name: header::HeaderName| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    if loopback && let Some(host) = text(header::HOST) {
        let name = host_name(host.trim());
        if !is_loopback_name(name) && !name.eq_ignore_ascii_case(host_name(bound_host)) {
            return Err(forbidden(
                "forbidden_host",
                format!(
                    "`Host: {host}` does not name this server (listening on {bound_host}): a server on a loopback address answers only localhost, loopback addresses and its --host, so that a web page whose name was rebound to this machine cannot read answers"
                ),
            ));
        }
    }
    let mut cors = None;
    if let Some(origin) = text(header::ORIGIN)
        && !same_origin(&origin, text(header::HOST).as_deref(), bound_host)
    {
        let allowed = cfg
            .cors_origin
            .as_deref()
            .is_some_and(|o| o == origin.trim_end_matches('/').to_ascii_lowercase());
        if !allowed {
            return Err(forbidden(
                "forbidden_origin",
                format!(
                    "requests from web pages are refused (`Origin: {origin}`); start the server with --cors-origin {origin} to allow that page"
                ),
            ));
        }
        cors = HeaderValue::from_str(&origin).ok();
        if method == Method::OPTIONS {
            return Ok(Admit::Answered(preflight(cors, headers)));
        }
    }
    let public = matches!(path, "/health" | "/v1/health") || crate::page::is_page(path);
    if let Some(key) = &cfg.api_key
        && !public
    {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        let x_key = headers.get("x-api-key").map(HeaderValue::as_bytes);
        if !bearer.or(x_key).is_some_and(|k| key.matches(k)) {
            return Err(ApiError {
                status: StatusCode::UNAUTHORIZED,
                kind: "authentication_error",
                code: "invalid_api_key",
                param: None,
                message: "this server wants its API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`".into(),
            });
        }
    }
    if method == Method::POST {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            let given = text(header::CONTENT_TYPE).unwrap_or_else(|| "none".into());
            return Err(ApiError {
                status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
                kind: "invalid_request_error",
                code: "unsupported_media_type",
                param: None,
                message: format!(
                    "request bodies must be JSON with `Content-Type: application/json` (got {given}); with curl add -H 'Content-Type: application/json'"
                ),
            });
        }
    }
    Ok(Admit::Serve(cors))
}

/// The answer to a preflight from the allowed origin.
fn preflight(origin: Option<HeaderValue>, headers: &HeaderMap) -> Response {
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let h = resp.headers_mut();
    add_cors(h, origin);
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    let asked = headers
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    resp
}

/// The CORS headers of an answer to the allowed origin.
pub fn add_cors(h: &mut HeaderMap, origin: Option<HeaderValue>) {
    let Some(origin) = origin else { return };
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, x-deltafin-seed"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_and_origins_parse() {
        assert_eq!(host_name("localhost:8000"), "localhost");
        assert_eq!(host_name("[::1]:8000"), "::1");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert!(is_loopback_name("LOCALHOST") && is_loopback_name("127.0.0.2"));
        assert!(is_loopback_name("::1") && !is_loopback_name("evil.example"));
        assert_eq!(
            check_origin("http://LOCALHOST:3000/").as_deref(),
            Ok("http://localhost:3000")
        );
        for bad in [
            "localhost:3000",
            "http://a/b",
            "ftp://a",
            "http://",
            "http://u@h",
        ] {
            assert!(check_origin(bad).is_err(), "{bad}");
        }
        assert!(ApiKey::new("short").is_err());
        // The page's own origin: the Host it was loaded from, when that names this server.
        assert!(same_origin(
            "http://127.0.0.1:8000",
            Some("127.0.0.1:8000"),
            "127.0.0.1"
        ));
        assert!(same_origin(
            "http://LocalHost:9",
            Some("localhost:9"),
            "127.0.0.1"
        ));
        assert!(same_origin("http://[::1]:8000", Some("[::1]:8000"), "::1"));
        assert!(same_origin(
            "http://192.168.1.5:80",
            Some("192.168.1.5:80"),
            "0.0.0.0"
        ));
        assert!(same_origin(
            "http://box.lan:80",
            Some("box.lan:80"),
            "box.lan"
        ));
        for (origin, host) in [
            ("http://127.0.0.1:8001", Some("127.0.0.1:8000")),
            ("http://127.0.0.1:8000", None),
            ("http://evil.example:8000", Some("evil.example:8000")),
            ("null", Some("127.0.0.1:8000")),
            ("file://", Some("127.0.0.1:8000")),
            ("http://127.0.0.1:8000/x", Some("127.0.0.1:8000")),
        ] {
            assert!(!same_origin(origin, host, "0.0.0.0"), "{origin} {host:?}");
        }
        let k = ApiKey::new("0123456789abcdef").unwrap();
        assert!(k.matches(b"0123456789abcdef") && !k.matches(b"0123456789abcdeg"));
        assert_eq!(format!("{k:?}"), "ApiKey(..)");
    }
}
