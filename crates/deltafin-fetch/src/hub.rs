//! A Hugging Face Hub client for pinned files.
//!
//! URL: `{endpoint}/{repo}/resolve/{revision}/{file}`. Redirects (301/302/303/307/308) are
//! followed by hand, at most [`MAX_REDIRECTS`]; the `Authorization: Bearer` header (from
//! `HF_TOKEN`) is sent only to the endpoint's own host, never to a CDN it redirects to, and
//! is never logged. `X-Repo-Commit` must be present on some response of the chain and equal
//! the pinned revision. `X-Linked-Size` / `X-Linked-Etag` (or `Content-Length` / `ETag`)
//! report the file's size and etag; ranges use `Range: bytes=a-b` and are checked against
//! `Content-Range`.

use crate::error::FetchError;
use std::io::Read;
use std::time::Duration;

/// Default endpoint (overridden by `HF_ENDPOINT`).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// At most this many redirects per request.
pub const MAX_REDIRECTS: usize = 5;

/// Whether plain `http://` may be used: never by default (a network attacker could change
/// unpinned bytes), only when the operator says so for a mirror they trust
/// (`--insecure-http`, `DELTAFIN_INSECURE_HTTP=1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Scheme {
    /// `https://` endpoints and redirects only.
    #[default]
    HttpsOnly,
    /// `http://` accepted too.
    AllowHttp,
}

/// The environment variable that allows plain HTTP (`1`; `0` or empty: HTTPS only).
pub const INSECURE_HTTP_ENV: &str = "DELTAFIN_INSECURE_HTTP";

impl Scheme {
    /// `AllowHttp` when `flag` is set or [`INSECURE_HTTP_ENV`] is `1`; an other value of the
    /// variable is an error naming it.
    pub fn resolve(flag: bool) -> Result<Scheme, FetchError> {
        let env = std::env::var_os(INSECURE_HTTP_ENV);
        let from_env = match env.as_ref().map(|v| v.to_str()) {
            None => false,
            Some(Some("" | "0")) => false,
            Some(Some("1")) => true,
            Some(v) => {
                return Err(FetchError::Invalid(format!(
                    "{INSECURE_HTTP_ENV}={:?}: expected 1 (allow plain http://) or 0",
                    v.unwrap_or("<not UTF-8>")
                )));
            }
        };
        Ok(if flag || from_env {
            Scheme::AllowHttp
        } else {
            Scheme::HttpsOnly
        })
    }

    fn admits(self, url: &str) -> bool {
        self == Scheme::AllowHttp || url.starts_with("https://")
    }
}

/// A hub client: endpoint, optional token and a connection pool.
#[derive(Clone)]
pub struct HubClient {
    endpoint: String,
    origin: String,
    token: Option<String>,
    agent: ureq::Agent,
    scheme: Scheme,
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// The answer to one (possibly redirected) GET.
pub struct HubResponse {
    /// The URL that was finally answered.
    pub url: String,
    /// 200 or 206.
    pub status: u16,
    /// `X-Repo-Commit` seen on the chain.
    pub commit: Option<String>,
    /// `X-Linked-Size`, else (for a 200) `Content-Length`.
    pub file_size: Option<u64>,
    /// `X-Linked-Etag`, else `ETag`.
    pub etag: Option<String>,
    /// `Content-Length` of this body.
    pub content_length: Option<u64>,
    /// Parsed `Content-Range: bytes a-b/total` (inclusive `b`).
    pub content_range: Option<(u64, u64, Option<u64>)>,
    /// The body.
    pub body: Box<dyn Read + Send>,
}

fn split_origin(url: &str) -> Option<(String, String)> {
    let (scheme, rest) = url.split_once("://")?;
    if scheme != "http" && scheme != "https" {
        return None;
    }
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if host.is_empty() || host.contains('@') {
        return None;
    }
    Some((format!("{scheme}://{host}"), path.to_string()))
}

fn header(resp: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

/// Where a redirect from `url` to `Location: loc` goes: absolute, or a path on the same
/// origin; a plain `http://` target only under [`Scheme::AllowHttp`].
fn redirect_target(scheme: Scheme, url: &str, loc: &str) -> Result<String, String> {
    let target = if loc.starts_with("http://") || loc.starts_with("https://") {
        loc.to_string()
    } else if loc.starts_with('/') {
        let (o, _) = split_origin(url).ok_or_else(|| format!("unparseable URL {url}"))?;
        format!("{o}{loc}")
    } else {
        return Err(format!("unsupported redirect target {loc:?}"));
    };
    if !scheme.admits(&target) {
        return Err(format!(
            "redirected to plain http:// ({target}); downloads use https:// only (--insecure-http or {INSECURE_HTTP_ENV}=1 allows it)"
        ));
    }
    Ok(target)
}

/// Parse `bytes a-b/total` (total may be `*`).
pub fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().ok()?)
    };
    Some((a.parse().ok()?, b.parse().ok()?, total))
}

impl HubClient {
    /// A client for `endpoint` (`https://host[:port][/prefix]`, no query; `http://` too
    /// under [`Scheme::AllowHttp`]) and an optional bearer token.
    pub fn new(
        endpoint: &str,
        token: Option<String>,
        scheme: Scheme,
    ) -> Result<HubClient, FetchError> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        let (origin, path) = split_origin(&endpoint).ok_or_else(|| {
            FetchError::Invalid(format!(
                "HF_ENDPOINT {endpoint:?}: expected http(s)://host[:port][/path] without user info"
            ))
        })?;
        if !scheme.admits(&endpoint) {
            return Err(FetchError::Invalid(format!(
                "HF_ENDPOINT {endpoint:?} is plain http://: downloads use https:// only; pass --insecure-http (or {INSECURE_HTTP_ENV}=1) for a mirror you trust"
            )));
        }
        if path.contains('?') || path.contains('#') {
            return Err(FetchError::Invalid(format!(
                "HF_ENDPOINT {endpoint:?}: no query or fragment allowed"
            )));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent("deltafin-fetch/0.1")
            .build()
            .into();
        Ok(HubClient {
            endpoint,
            origin,
            token: token.filter(|t| !t.is_empty()),
            agent,
            scheme,
        })
    }

    /// `HF_ENDPOINT` (default [`DEFAULT_ENDPOINT`]) and `HF_TOKEN`; plain HTTP when
    /// `insecure_http` or `DELTAFIN_INSECURE_HTTP=1` ([`Scheme::resolve`]).
    pub fn from_env(insecure_http: bool) -> Result<HubClient, FetchError> {
        let ep = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Self::new(
            &ep,
            std::env::var("HF_TOKEN").ok(),
            Scheme::resolve(insecure_http)?,
        )
    }

    /// The endpoint in use.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{file}`.
    pub fn resolve_url(&self, repo: &str, revision: &str, file: &str) -> String {
        format!("{}/{repo}/resolve/{revision}/{file}", self.endpoint)
    }

    /// GET `file` of `repo` at `revision`, optionally the inclusive byte range `range`,
    /// following redirects and checking `X-Repo-Commit`. Statuses other than 200/206 are
    /// errors (404 → [`FetchError::NotFound`]).
    pub fn get(
        &self,
        repo: &str,
        revision: &str,
        file: &str,
        range: Option<(u64, u64)>,
    ) -> Result<HubResponse, FetchError> {
        let first = self.resolve_url(repo, revision, file);
        let mut url = first.clone();
        let mut commit: Option<String> = None;
        let mut linked_size: Option<u64> = None;
        let mut linked_etag: Option<String> = None;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some((a, b)) = range {
                req = req.header("Range", &format!("bytes={a}-{b}"));
            }
            let same_origin = split_origin(&url).is_some_and(|(o, _)| o == self.origin);
            if let (Some(t), true) = (&self.token, same_origin) {
                req = req.header("Authorization", &format!("Bearer {t}"));
            }
            let resp = req.call().map_err(|e| FetchError::Transport {
                url: url.clone(),
                msg: format!("request failed: {e}"),
            })?;
            if let Some(c) = header(&resp, "x-repo-commit") {
                commit = Some(c);
            }
            if let Some(s) = header(&resp, "x-linked-size") {
                linked_size = Some(s.parse().map_err(|_| FetchError::Protocol {
                    url: url.clone(),
                    msg: format!("X-Linked-Size {s:?} is not a byte count"),
                })?);
            }
            if let Some(e) = header(&resp, "x-linked-etag") {
                linked_etag = Some(e);
            }
            let status = resp.status().as_u16();
            if matches!(status, 301 | 302 | 303 | 307 | 308) {
                let loc = header(&resp, "location").ok_or_else(|| FetchError::Protocol {
                    url: url.clone(),
                    msg: format!("HTTP {status} without a Location header"),
                })?;
                url = redirect_target(self.scheme, &url, &loc).map_err(|msg| {
                    FetchError::Protocol {
                        url: first.clone(),
                        msg,
                    }
                })?;
                continue;
            }
            let got = commit
                .clone()
                .unwrap_or_else(|| "(no X-Repo-Commit header)".into());
            if status == 404 {
                return Err(FetchError::NotFound { url: first });
            }
            if status != 200 && status != 206 {
                return Err(FetchError::Http { url, status });
            }
            if commit.as_deref() != Some(revision) {
                return Err(FetchError::CommitMismatch {
                    url: first,
                    expected: revision.to_string(),
                    got,
                });
            }
            let content_length =
                header(&resp, "content-length").and_then(|s| s.parse::<u64>().ok());
            let content_range = match header(&resp, "content-range") {
                Some(v) => Some(parse_content_range(&v).ok_or_else(|| FetchError::Protocol {
                    url: url.clone(),
                    msg: format!("unparseable Content-Range {v:?}"),
                })?),
                None => None,
            };
            let file_size = linked_size.or(match status {
                200 => content_length,
                _ => content_range.and_then(|c| c.2),
            });
            let etag = linked_etag.or_else(|| header(&resp, "etag"));
            let body = Box::new(resp.into_body().into_reader());
            return Ok(HubResponse {
                url,
                status,
                commit,
                file_size,
                etag,
                content_length,
                content_range,
                body,
            });
        }
        Err(FetchError::Protocol {
            url: first,
            msg: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    /// GET the inclusive range `a..=b` and return exactly its bytes, checking
    /// `Content-Range` (for small reads: headers, one expert).
    pub fn get_range_bytes(
        &self,
        repo: &str,
        revision: &str,
        file: &str,
        a: u64,
        b: u64,
    ) -> Result<Vec<u8>, FetchError> {
        let mut r = self.get(repo, revision, file, Some((a, b)))?;
        check_range(&r, a, b)?;
        let want = b - a + 1;
        let mut out = Vec::with_capacity(want as usize);
        (&mut r.body)
            .take(want)
            .read_to_end(&mut out)
            .map_err(|e| FetchError::Transport {
                url: r.url.clone(),
                msg: format!("body read failed: {e}"),
            })?;
        if out.len() as u64 != want {
            return Err(FetchError::Transport {
                url: r.url,
                msg: format!("connection closed after {} of {want} bytes", out.len()),
            });
        }
        Ok(out)
    }
}

/// Check that `r` is a 206 answer for exactly `a..=b`.
pub fn check_range(r: &HubResponse, a: u64, b: u64) -> Result<(), FetchError> {
    match (r.status, r.content_range) {
        (206, Some((x, y, _))) if x == a && y == b => Ok(()),
        (206, cr) => Err(FetchError::Protocol {
            url: r.url.clone(),
            msg: format!("asked for bytes {a}-{b}, got Content-Range {cr:?}"),
        }),
        (s, _) => Err(FetchError::Protocol {
            url: r.url.clone(),
            msg: format!("asked for bytes {a}-{b}, got HTTP {s} instead of 206"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_is_refused_unless_allowed() {
        let e = HubClient::new("http://mirror.example", None, Scheme::HttpsOnly)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("--insecure-http"), "{e}");
        assert!(HubClient::new("http://mirror.example", None, Scheme::AllowHttp).is_ok());
        assert!(HubClient::new("https://huggingface.co", None, Scheme::HttpsOnly).is_ok());
        // Redirects: an https CDN is followed, a downgrade is refused, a path stays on the
        // origin's scheme.
        let from = "https://huggingface.co/o/n/resolve/r/f";
        assert_eq!(
            redirect_target(Scheme::HttpsOnly, from, "https://cdn.example/x").as_deref(),
            Ok("https://cdn.example/x")
        );
        let e = redirect_target(Scheme::HttpsOnly, from, "http://cdn.example/x").unwrap_err();
        assert!(e.contains("plain http://"), "{e}");
        assert_eq!(
            redirect_target(Scheme::AllowHttp, from, "http://cdn.example/x").as_deref(),
            Ok("http://cdn.example/x")
        );
        assert_eq!(
            redirect_target(Scheme::HttpsOnly, from, "/cdn/x").as_deref(),
            Ok("https://huggingface.co/cdn/x")
        );
        assert!(redirect_target(Scheme::HttpsOnly, from, "ftp://x").is_err());
    }
}
