//! An in-process HTTP/1.1 server that speaks the hub protocol used by [`crate::hub`], for
//! tests: `GET /{owner}/{name}/resolve/{revision}/{file}` answers a 302 to
//! `/cdn/{owner}/{name}/{file}` with `X-Repo-Commit`, `X-Linked-Size` and `X-Linked-Etag`
//! (the sha256); the CDN path serves the bytes with `Range` support. Files are served from
//! disk. Faults can be injected per file, and every request is logged.
//!
//! Loopback only; one request per connection (`Connection: close`).

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One injectable fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Close the connection after this many body bytes.
    DropAfter(u64),
    /// Answer the resolve request with this status.
    Status(u16),
    /// Serve the byte at this absolute file offset with its bits flipped.
    Corrupt(u64),
    /// Report another commit in `X-Repo-Commit`.
    WrongCommit,
    /// Sleep this long before every 8 KiB of body.
    Slow(Duration),
}

/// A fault applied to the next `remaining` matching requests (`u32::MAX`: always).
#[derive(Clone, Debug)]
pub struct FaultRule {
    /// Substring of the file path that selects the requests.
    pub file: String,
    pub fault: Fault,
    pub remaining: u32,
}

#[derive(Default)]
struct State {
    /// (repo, file) → (path on disk, sha256, size).
    files: HashMap<(String, String), (PathBuf, String, u64)>,
    /// repo → commit.
    commits: HashMap<String, String>,
    faults: Vec<FaultRule>,
    log: Vec<String>,
}

/// The server. Dropping it stops the accept loop.
pub struct MockHub {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl MockHub {
    /// Bind `127.0.0.1:0` and serve in background threads.
    pub fn start() -> std::io::Result<MockHub> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(c) = conn {
                    let st = st.clone();
                    std::thread::spawn(move || {
                        let _ = serve(c, &st);
                    });
                }
            }
        });
        Ok(MockHub { addr, state, stop })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serve `path` as `file` of `repo` at `commit` (hashes it once).
    pub fn add_file(
        &self,
        repo: &str,
        commit: &str,
        file: &str,
        path: &Path,
    ) -> std::io::Result<()> {
        let mut f = File::open(path)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            size += n as u64;
        }
        let mut s = self.lock();
        s.commits.insert(repo.to_string(), commit.to_string());
        s.files.insert(
            (repo.to_string(), file.to_string()),
            (path.to_path_buf(), hex::encode(h.finalize()), size),
        );
        Ok(())
    }

    /// Inject a fault for the next `times` requests of files whose name starts with `file`
    /// (a whole name such as `config.json`, or a prefix such as `model-`).
    pub fn add_fault(&self, file: &str, fault: Fault, times: u32) {
        self.lock().faults.push(FaultRule {
            file: file.to_string(),
            fault,
            remaining: times,
        });
    }

    /// Remove every fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Every request so far (`GET <path> [range]`).
    pub fn requests(&self) -> Vec<String> {
        self.lock().log.clone()
    }

    /// Forget the request log.
    pub fn clear_log(&self) {
        self.lock().log.clear();
    }
}

impl Drop for MockHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

fn take_fault(s: &mut State, file: &str, pick: &dyn Fn(&Fault) -> bool) -> Option<Fault> {
    for r in s.faults.iter_mut() {
        if r.remaining > 0 && file.starts_with(&r.file) && pick(&r.fault) {
            if r.remaining != u32::MAX {
                r.remaining -= 1;
            }
            return Some(r.fault.clone());
        }
    }
    None
}

fn respond(
    c: &mut TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut h = format!(
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    c.write_all(h.as_bytes())?;
    c.write_all(body)?;
    c.flush()
}

fn parse_range(v: &str, size: u64) -> Option<(u64, u64)> {
    let r = v.strip_prefix("bytes=")?;
    let (a, b) = r.split_once('-')?;
    let a: u64 = a.parse().ok()?;
    let b: u64 = if b.is_empty() {
        size.checked_sub(1)?
    } else {
        b.parse().ok()?
    };
    (a <= b && b < size).then_some((a, b.min(size - 1)))
}

fn serve(mut c: TcpStream, st: &Mutex<State>) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut rd = BufReader::new(c.try_clone()?);
    let mut line = String::new();
    rd.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range_h = None;
    loop {
        let mut l = String::new();
        if rd.read_line(&mut l)? == 0 || l == "\r\n" || l == "\n" {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.trim().eq_ignore_ascii_case("range")
        {
            range_h = Some(v.trim().to_string());
        }
    }
    let lock = || st.lock().unwrap_or_else(|p| p.into_inner());
    lock().log.push(format!(
        "GET {path}{}",
        range_h
            .as_ref()
            .map(|r| format!(" {r}"))
            .unwrap_or_default()
    ));
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    // /{owner}/{name}/resolve/{rev}/{file}
    if parts.len() == 5 && parts[2] == "resolve" {
        let repo = format!("{}/{}", parts[0], parts[1]);
        let (rev, file) = (parts[3], parts[4]);
        let mut s = lock();
        let Some(commit) = s.commits.get(&repo).cloned() else {
            drop(s);
            return respond(&mut c, 404, &[], b"repo not found");
        };
        let Some((_, sha, size)) = s.files.get(&(repo.clone(), file.to_string())).cloned() else {
            drop(s);
            return respond(
                &mut c,
                404,
                &[("X-Repo-Commit".into(), commit)],
                b"entry not found",
            );
        };
        if rev != commit && rev != "main" {
            drop(s);
            return respond(&mut c, 404, &[], b"revision not found");
        }
        if let Some(Fault::Status(code)) =
            take_fault(&mut s, file, &|f| matches!(f, Fault::Status(_)))
        {
            drop(s);
            return respond(
                &mut c,
                code,
                &[("X-Repo-Commit".into(), commit)],
                b"injected",
            );
        }
        let commit = match take_fault(&mut s, file, &|f| *f == Fault::WrongCommit) {
            Some(_) => "0".repeat(40),
            None => commit,
        };
        drop(s);
        return respond(
            &mut c,
            302,
            &[
                ("Location".into(), format!("/cdn/{repo}/{file}")),
                ("X-Repo-Commit".into(), commit),
                ("X-Linked-Size".into(), size.to_string()),
                ("X-Linked-Etag".into(), format!("\"{sha}\"")),
            ],
            b"",
        );
    }
    // /cdn/{owner}/{name}/{file}
    let cparts: Vec<&str> = path.trim_start_matches('/').splitn(4, '/').collect();
    if cparts.len() == 4 && cparts[0] == "cdn" {
        let repo = format!("{}/{}", cparts[1], cparts[2]);
        let file = cparts[3];
        let mut s = lock();
        let Some((p, _, size)) = s.files.get(&(repo, file.to_string())).cloned() else {
            drop(s);
            return respond(&mut c, 404, &[], b"not found");
        };
        let drop_after = match take_fault(&mut s, file, &|f| matches!(f, Fault::DropAfter(_))) {
            Some(Fault::DropAfter(n)) => Some(n),
            _ => None,
        };
        let corrupt = match take_fault(&mut s, file, &|f| matches!(f, Fault::Corrupt(_))) {
            Some(Fault::Corrupt(o)) => Some(o),
            _ => None,
        };
        let slow = match take_fault(&mut s, file, &|f| matches!(f, Fault::Slow(_))) {
            Some(Fault::Slow(d)) => Some(d),
            _ => None,
        };
        drop(s);
        let (status, a, b) = match &range_h {
            Some(r) => match parse_range(r, size) {
                Some((a, b)) => (206, a, b),
                None => {
                    return respond(
                        &mut c,
                        416,
                        &[("Content-Range".into(), format!("bytes */{size}"))],
                        b"",
                    );
                }
            },
            None => (200, 0, size.saturating_sub(1)),
        };
        let len = if size == 0 { 0 } else { b - a + 1 };
        let mut h = format!(
            "HTTP/1.1 {status} X\r\nContent-Length: {len}\r\nConnection: close\r\nAccept-Ranges: bytes\r\n"
        );
        if status == 206 {
            h.push_str(&format!("Content-Range: bytes {a}-{b}/{size}\r\n"));
        }
        h.push_str("\r\n");
        c.write_all(h.as_bytes())?;
        let mut f = File::open(&p)?;
        f.seek(SeekFrom::Start(a))?;
        let mut sent = 0u64;
        let mut buf = vec![0u8; if slow.is_some() { 8 * 1024 } else { 64 * 1024 }];
        while sent < len {
            if let Some(d) = slow {
                std::thread::sleep(d);
            }
            let mut n = ((len - sent) as usize).min(buf.len());
            if let Some(limit) = drop_after {
                if sent >= limit {
                    let _ = c.shutdown(std::net::Shutdown::Both);
                    return Ok(());
                }
                n = n.min((limit - sent) as usize);
            }
            f.read_exact(&mut buf[..n])?;
            if let Some(o) = corrupt
                && o >= a + sent
                && o < a + sent + n as u64
            {
                buf[(o - a - sent) as usize] ^= 0xff;
            }
            c.write_all(&buf[..n])?;
            sent += n as u64;
        }
        return c.flush();
    }
    respond(&mut c, 404, &[], b"unknown path")
}
