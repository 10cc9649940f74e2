//! The chat page (docs/SERVER.md "The chat page"): `GET /` and its files under `/assets/`,
//! built into the binary, served with a strict Content-Security-Policy.
//!
//! The page speaks the server's own API from the same origin (`/v1/chat/completions` with
//! `stream: true`, `/v1/status`, `/v1/benchmark`); it loads nothing from any other host. Its
//! markdown goes through the vendored `marked` and is sanitized by the vendored `DOMPurify`
//! (`assets/vendor/README.md`) before it enters the page, and the policy below makes that
//! the only way HTML can: no inline script or style, Trusted Types required for every HTML
//! sink, no frames, no form posts, connections to this origin only.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The Content-Security-Policy of the page and of its files.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types deltafin dompurify";

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// The built-in files: path, content type, bytes.
const ASSETS: &[(&str, &str, &str)] = &[
    ("/", HTML, include_str!("../assets/index.html")),
    ("/assets/app.js", JS, include_str!("../assets/app.js")),
    (
        "/assets/app.css",
        "text/css; charset=utf-8",
        include_str!("../assets/app.css"),
    ),
    (
        "/assets/favicon.svg",
        "image/svg+xml",
        include_str!("../assets/favicon.svg"),
    ),
    (
        "/assets/marked.umd.js",
        JS,
        include_str!("../assets/vendor/marked.umd.js"),
    ),
    (
        "/assets/purify.min.js",
        JS,
        include_str!("../assets/vendor/purify.min.js"),
    ),
    (
        "/assets/LICENSE-marked.md",
        TEXT,
        include_str!("../assets/vendor/LICENSE-marked.md"),
    ),
    (
        "/assets/LICENSE-dompurify",
        TEXT,
        include_str!("../assets/vendor/LICENSE-dompurify"),
    ),
    (
        "/assets/vendor.md",
        TEXT,
        include_str!("../assets/vendor/README.md"),
    ),
];

/// Asset `path` (`/index.html` is `/`): its index in [`ASSETS`], content type and bytes.
fn find(path: &str) -> Option<(usize, &'static str, &'static str)> {
    let path = if path == "/index.html" { "/" } else { path };
    ASSETS
        .iter()
        .enumerate()
        .find(|(_, a)| a.0 == path)
        .map(|(i, &(_, content_type, body))| (i, content_type, body))
}

/// Whether `path` is the page or one of its files (served without the API key: they hold
/// nothing but the page's code).
pub fn is_page(path: &str) -> bool {
    find(path).is_some()
}

/// The entity tag of asset `i`: SHA-256 of its bytes, computed once.
fn etag(i: usize) -> &'static str {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| format!("\"{}\"", &hex::encode(Sha256::digest(a.2.as_bytes()))[..32]))
            .collect()
    });
    tags.get(i).map_or("\"\"", String::as_str)
}

/// The headers every answer of the page carries: the policy, no framing, no sniffing, no
/// referrer, its own browsing-context group, and no use of its files by another origin.
pub fn protect(h: &mut HeaderMap, csp: &'static str) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(csp),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
}

/// `GET`/`HEAD` of the page or one of its files (`None`: `path` is none of them). A request
/// whose `If-None-Match` names the current version gets 304.
pub fn serve(path: &str, request: &HeaderMap) -> Option<Response> {
    let (i, content_type, body) = find(path)?;
    let tag = etag(i);
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag));
    let mut resp = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        Response::new(Body::from(body))
    };
    let h = resp.headers_mut();
    if !fresh {
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    if let Ok(v) = HeaderValue::from_str(tag) {
        h.insert(header::ETAG, v);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    protect(h, CSP);
    Some(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendored_files_match_their_recorded_digests() {
        let readme = include_str!("../assets/vendor/README.md");
        for (file, body) in [
            (
                "marked.umd.js",
                include_str!("../assets/vendor/marked.umd.js"),
            ),
            (
                "purify.min.js",
                include_str!("../assets/vendor/purify.min.js"),
            ),
        ] {
            let line = readme
                .lines()
                .find(|l| l.starts_with(&format!("| `{file}` | `")))
                .unwrap_or_else(|| panic!("{file} has no digest line in the vendor README"));
            let recorded = line.split('`').nth(3).unwrap();
            assert_eq!(
                hex::encode(Sha256::digest(body.as_bytes())),
                recorded,
                "{file} differs from the recorded digest"
            );
        }
    }

    #[test]
    fn the_page_names_only_its_own_files() {
        let html = find("/").unwrap().2;
        // Every script and stylesheet the page loads is one of its files; none is inline.
        for attr in ["src=\"", "href=\""] {
            for part in html.split(attr).skip(1) {
                let url = part.split('"').next().unwrap();
                assert!(
                    is_page(url) || url == "/metrics",
                    "the page refers to {url}, which the server does not serve"
                );
            }
        }
        assert!(!html.contains("<style"), "inline style in the page");
        assert!(
            !html.contains("<script>") && !html.contains("style=\""),
            "inline script or style"
        );
        // The page's own code names no other host (the vendored libraries load nothing).
        for path in ["/", "/assets/app.js", "/assets/app.css"] {
            let body = find(path).unwrap().2;
            assert!(!body.contains("://"), "{path} names another host");
        }
    }

    #[test]
    fn answers_carry_the_policy_and_a_tag() {
        let r = serve("/", &HeaderMap::new()).unwrap();
        assert_eq!(r.status(), 200);
        let h = r.headers();
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        assert_eq!(h[header::X_FRAME_OPTIONS], "DENY");
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let tag = h[header::ETAG].clone();
        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, tag);
        assert_eq!(serve("/", &again).unwrap().status(), 304);
        assert!(serve("/assets/nope.js", &HeaderMap::new()).is_none());
        assert!(is_page("/index.html") && !is_page("/v1/status"));
    }
}
