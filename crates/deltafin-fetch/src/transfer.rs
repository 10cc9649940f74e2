//! The parallel transfer engine.
//!
//! Each [`Job`] copies one file, or one byte range of a file, from the hub to `dest`:
//!
//! 1. `dest` already a regular file of the right size → skipped (files under their final
//!    name are complete and verified by construction).
//! 2. Bytes go to `dest.part`; an existing `.part` is resumed with a `Range` request from its
//!    last durable resume point. The answer must be a 206 for exactly the requested range (or
//!    a 200 for a whole file from zero).
//!
//!    Resume points (docs/SETUP.md "Resuming"): every [`TransferOptions::checkpoint_bytes`]
//!    and when a transfer stops, the `.part` is `fsync`ed, then `dest.part.resume` records
//!    its length and the SHA-256 of its last MiB (written to a temporary name, synced,
//!    renamed). A resume trusts only that length: bytes past it (which a power loss can
//!    leave as zeros or garbage) are cut off, and a tail that does not hash as recorded, a
//!    damaged record or a `.part` shorter than its record restarts the file from zero.
//! 3. 5xx, 429, connection failures and bodies cut short are retried with exponential
//!    backoff; a retry that made progress resets the attempt count, so a flaky connection
//!    cannot stall the install but a dead one ends after [`RetryPolicy::attempts`].
//! 4. When complete: exact size, then the sha256 where pinned (a mismatch deletes the `.part`
//!    and refetches once; a second mismatch is an error), `fsync`, the receipt of an unpinned
//!    file ([`TransferOptions::receipts`]), rename to `dest`, `fsync` of the directory.
//!
//! Workers pull jobs from a shared queue; the first non-retryable error (404, commit
//! mismatch, disk full, permission denied, persistent hash mismatch) stops the others
//! between chunks, keeping their `.part` files for the next run.

use crate::error::FetchError;
use crate::hub::{HubClient, check_range};
use crate::progress;
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Default parallel transfers.
pub const DEFAULT_WORKERS: usize = 8;
/// Maximum parallel transfers.
pub const MAX_WORKERS: usize = 16;
/// Complete downloads allowed per file when the sha256 does not match.
pub const SHA_ATTEMPTS: u32 = 2;
const CHUNK: usize = 256 * 1024;

/// One file or byte range to install.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// `owner/name`.
    pub repo: String,
    /// Pinned commit.
    pub revision: String,
    /// File in the repository.
    pub file: String,
    /// `(offset, length)` inside `file`; `None` for the whole file.
    pub range: Option<(u64, u64)>,
    /// Final path.
    pub dest: PathBuf,
    /// Exact size of the result.
    pub size: u64,
    /// Pinned lowercase hex sha256 of the result.
    pub sha256: Option<String>,
}

/// Files available locally that a job may be installed from instead of the hub.
pub trait LocalSource: Send + Sync + std::fmt::Debug {
    /// Install `job` from the local copy: `Ok(true)` when `job.dest` is now complete and
    /// verified (with its receipt under `receipts` when the job pins no digest), `Ok(false)`
    /// when the hub must be asked, an error when the local copy fails its pins.
    fn install(&self, job: &Job, receipts: Option<&Path>) -> Result<bool, FetchError>;
}

/// Bounded retry with exponential backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts without progress before giving up.
    pub attempts: u32,
    /// First backoff delay (doubled each time).
    pub base_delay: Duration,
    /// Cap on one delay.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 6,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(8),
        }
    }
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct TransferOptions {
    /// Parallel transfers, 1…[`MAX_WORKERS`].
    pub workers: usize,
    pub retry: RetryPolicy,
    /// Draw a progress bar (only when stderr is a terminal).
    pub progress: bool,
    /// Bytes between two durable resume points of one transfer.
    pub checkpoint_bytes: u64,
    /// The model root whose fetch receipts (`crate::receipts`) record the SHA-256 of every
    /// file fetched without a pinned digest; `None` records nothing.
    pub receipts: Option<PathBuf>,
    /// A local copy of the pinned files (a Hugging Face cache: `crate::hf_cache`) whose
    /// verified files are linked or copied instead of fetched; `None` fetches everything.
    pub local: Option<std::sync::Arc<dyn LocalSource>>,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            workers: DEFAULT_WORKERS,
            retry: RetryPolicy::default(),
            progress: true,
            checkpoint_bytes: CHECKPOINT_BYTES,
            receipts: None,
            local: None,
        }
    }
}

/// Default bytes between two resume points (one `fsync` each).
pub const CHECKPOINT_BYTES: u64 = 64 << 20;
/// Bytes at the end of a resume point that its record hashes.
const TAIL_BYTES: u64 = 1 << 20;
const RESUME_MAGIC: &[u8; 8] = b"DFRESUM1";

/// The resume-point record of `dest` (`dest.part.resume`).
pub fn resume_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_os_string();
    s.push(".part.resume");
    PathBuf::from(s)
}

/// SHA-256 of `part`'s bytes `len - min(len, TAIL_BYTES) .. len`.
fn tail_hash(part: &Path, len: u64) -> std::io::Result<[u8; 32]> {
    use std::io::{Seek, SeekFrom};
    let mut f = File::open(part)?;
    let from = len - len.min(TAIL_BYTES);
    f.seek(SeekFrom::Start(from))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; (len - from) as usize];
    f.read_exact(&mut buf)?;
    h.update(&buf);
    Ok(h.finalize().into())
}

/// Makes `len` bytes of `part` (open as `out`) a durable resume point.
fn checkpoint(out: &File, part: &Path, dest: &Path, len: u64) -> std::io::Result<()> {
    out.sync_data()?;
    let mut rec = Vec::with_capacity(80);
    rec.extend_from_slice(RESUME_MAGIC);
    rec.extend_from_slice(&len.to_le_bytes());
    rec.extend_from_slice(&tail_hash(part, len)?);
    let check: [u8; 32] = Sha256::digest(&rec).into();
    rec.extend_from_slice(&check);
    let path = resume_path(dest);
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = File::create(&tmp)?;
        f.write_all(&rec)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    if let Some(dir) = path.parent() {
        File::open(dir).and_then(|d| d.sync_all())?;
    }
    Ok(())
}

/// The length of `part` a resume may keep: its last resume point when the record is intact,
/// the `.part` holds that many bytes and their tail hashes as recorded; else 0.
fn durable_len(part: &Path, dest: &Path) -> u64 {
    let Ok(rec) = std::fs::read(resume_path(dest)) else {
        return 0;
    };
    if rec.len() != 80 || &rec[..8] != RESUME_MAGIC {
        return 0;
    }
    let check: [u8; 32] = Sha256::digest(&rec[..48]).into();
    if rec[48..] != check {
        return 0;
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&rec[8..16]);
    let len = u64::from_le_bytes(len);
    let have = std::fs::symlink_metadata(part).map_or(0, |m| m.len());
    if len > have {
        return 0;
    }
    match tail_hash(part, len) {
        Ok(h) if h[..] == rec[16..48] => len,
        _ => 0,
    }
}

/// Cuts `part` to its durable length (removing it and its record when that is 0) and
/// returns that length.
fn resume_from(part: &Path, dest: &Path) -> Result<u64, FetchError> {
    let keep = durable_len(part, dest);
    if keep == 0 {
        for p in [part.to_path_buf(), resume_path(dest)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(FetchError::io(&p)(e)),
            }
        }
        return Ok(0);
    }
    OpenOptions::new()
        .write(true)
        .open(part)
        .and_then(|f| f.set_len(keep))
        .map_err(FetchError::io(part))?;
    Ok(keep)
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferReport {
    /// Files fetched (fully or by resuming).
    pub fetched: usize,
    /// Files already complete.
    pub skipped: usize,
    /// Bytes received over the network.
    pub bytes: u64,
    /// Files installed from a local copy (`TransferOptions::local`: the Hugging Face cache).
    pub from_cache: usize,
}

/// Parse a `--workers` value strictly: an integer 1…16.
pub fn parse_workers(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number of workers"))?;
    if (1..=MAX_WORKERS).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} is out of range 1..={MAX_WORKERS}"))
    }
}

/// The `.part` path of `dest`.
pub fn part_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_os_string();
    s.push(".part");
    PathBuf::from(s)
}

/// Whether `dest` is already complete (regular file, exact size).
pub fn is_complete(dest: &Path, size: u64) -> bool {
    std::fs::symlink_metadata(dest).is_ok_and(|m| m.is_file() && m.len() == size)
}

/// Run `jobs` with `opts.workers` parallel transfers.
pub fn run_jobs(
    client: &HubClient,
    jobs: &[Job],
    opts: &TransferOptions,
) -> Result<TransferReport, FetchError> {
    if opts.workers == 0 || opts.workers > MAX_WORKERS {
        return Err(FetchError::Invalid(format!(
            "workers = {} is out of range 1..={MAX_WORKERS}",
            opts.workers
        )));
    }
    let total: u64 = jobs.iter().map(|j| j.size).sum();
    let bar = progress::stderr_bar(total, progress::BYTES, opts.progress);
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let report = Mutex::new(TransferReport::default());
    let first_err: Mutex<Option<FetchError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..opts.workers.min(jobs.len().max(1)) {
            s.spawn(|| {
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    match run_job(client, job, opts, &stop, &bar) {
                        Ok(outcome) => {
                            let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
                            match outcome {
                                Outcome::Skipped => r.skipped += 1,
                                Outcome::FromCache => r.from_cache += 1,
                                Outcome::Fetched(n) => {
                                    r.fetched += 1;
                                    r.bytes += n;
                                }
                            }
                        }
                        Err(FetchError::Stopped) => return,
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            let mut fe = first_err.lock().unwrap_or_else(|p| p.into_inner());
                            if fe.is_none() {
                                *fe = Some(e);
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    bar.finish_and_clear();
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(report.into_inner().unwrap_or_else(|p| p.into_inner()))
}

enum Outcome {
    Skipped,
    FromCache,
    Fetched(u64),
}

fn backoff(policy: RetryPolicy, failures: u32) -> Duration {
    let f = 1u32 << failures.min(16);
    (policy.base_delay * f).min(policy.max_delay)
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = File::open(path).map_err(FetchError::io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(FetchError::io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// fsync a directory so a rename inside it is durable.
pub fn sync_dir(dir: &Path) -> Result<(), FetchError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(FetchError::io(dir))
}

fn run_job(
    client: &HubClient,
    job: &Job,
    opts: &TransferOptions,
    stop: &AtomicBool,
    bar: &ProgressBar,
) -> Result<Outcome, FetchError> {
    let (policy, checkpoint_bytes) = (opts.retry, opts.checkpoint_bytes.max(1));
    if is_complete(&job.dest, job.size) {
        bar.inc(job.size);
        return Ok(Outcome::Skipped);
    }
    if let Some(local) = &opts.local
        && local.install(job, opts.receipts.as_deref())?
    {
        bar.inc(job.size);
        return Ok(Outcome::FromCache);
    }
    let dir = job.dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(FetchError::io(dir))?;
    let part = part_path(&job.dest);
    let mut failures = 0u32;
    let mut sha_failures = 0u32;
    let mut received = 0u64;
    let mut counted = 0u64;
    loop {
        let have = match std::fs::symlink_metadata(&part) {
            Ok(m) if m.is_file() && m.len() <= job.size => resume_from(&part, &job.dest)?,
            Ok(_) => {
                std::fs::remove_file(&part).map_err(FetchError::io(&part))?;
                0
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => resume_from(&part, &job.dest)?,
            Err(e) => return Err(FetchError::io(&part)(e)),
        };
        if have < counted {
            bar.set_position(bar.position().saturating_sub(counted - have));
            counted = have;
        }
        if have > counted {
            bar.inc(have - counted);
            counted = have;
        }
        if have < job.size {
            match fetch_into(client, job, &part, have, stop, bar, checkpoint_bytes) {
                Ok(n) => {
                    received += n;
                    counted += n;
                }
                Err((n, e)) => {
                    received += n;
                    counted += n;
                    if matches!(e, FetchError::Stopped) || !e.is_retryable() {
                        return Err(e);
                    }
                    failures = if n > 0 { 1 } else { failures + 1 };
                    if failures >= policy.attempts {
                        return Err(e);
                    }
                    std::thread::sleep(backoff(policy, failures - 1));
                    continue;
                }
            }
        }
        // Complete: verify, then publish.
        let len = std::fs::metadata(&part)
            .map_err(FetchError::io(&part))?
            .len();
        if len != job.size {
            return Err(FetchError::Protocol {
                url: client.resolve_url(&job.repo, &job.revision, &job.file),
                msg: format!("{} has {len} bytes, expected {}", part.display(), job.size),
            });
        }
        if let Some(want) = &job.sha256 {
            let got = sha256_file(&part)?;
            if &got != want {
                sha_failures += 1;
                std::fs::remove_file(&part).map_err(FetchError::io(&part))?;
                let _ = std::fs::remove_file(resume_path(&job.dest));
                bar.set_position(bar.position().saturating_sub(counted));
                counted = 0;
                if sha_failures >= SHA_ATTEMPTS {
                    return Err(FetchError::Sha256 {
                        file: job.file.clone(),
                        expected: want.clone(),
                        got,
                        attempts: sha_failures,
                    });
                }
                continue;
            }
        }
        File::open(&part)
            .and_then(|f| f.sync_all())
            .map_err(FetchError::io(&part))?;
        // The receipt of an unpinned file, before it is published (crate::receipts).
        if job.sha256.is_none()
            && let Some(root) = &opts.receipts
        {
            let got = sha256_file(&part)?;
            crate::receipts::record(root, &job.dest, job.size, &got)?;
        }
        std::fs::rename(&part, &job.dest).map_err(FetchError::io(&job.dest))?;
        sync_dir(dir)?;
        let rp = resume_path(&job.dest);
        std::fs::remove_file(&rp).or_else(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(FetchError::io(&rp)(e))
            }
        })?;
        return Ok(Outcome::Fetched(received));
    }
}

/// Append the missing bytes `have..size` of `job` to `part`. On error, also returns the
/// bytes appended before it.
fn fetch_into(
    client: &HubClient,
    job: &Job,
    part: &Path,
    have: u64,
    stop: &AtomicBool,
    bar: &ProgressBar,
    checkpoint_bytes: u64,
) -> Result<u64, (u64, FetchError)> {
    let dest = job.dest.as_path();
    let mut out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .map_err(|e| (0, FetchError::io(part)(e)))?;
    let mut got = 0u64;
    let r = fetch_body(
        client,
        job,
        &mut out,
        part,
        have,
        &mut got,
        stop,
        bar,
        checkpoint_bytes,
    );
    // However it ended, what arrived becomes a resume point.
    if got > 0
        && let Err(e) = out
            .flush()
            .and_then(|()| checkpoint(&out, part, dest, have + got))
    {
        return Err((got, FetchError::io(part)(e)));
    }
    r.map(|()| got).map_err(|e| (got, e))
}

/// The body of [`fetch_into`]: appends to `out`, counting in `got`, with a resume point
/// every `checkpoint_bytes`.
#[allow(clippy::too_many_arguments)]
fn fetch_body(
    client: &HubClient,
    job: &Job,
    out: &mut File,
    part: &Path,
    have: u64,
    got: &mut u64,
    stop: &AtomicBool,
    bar: &ProgressBar,
    checkpoint_bytes: u64,
) -> Result<(), FetchError> {
    let (off, whole) = match job.range {
        Some((o, _)) => (o, false),
        None => (0, true),
    };
    let a = off + have;
    let b = off + job.size - 1;
    let mut resp = client.get(&job.repo, &job.revision, &job.file, Some((a, b)))?;
    let url = resp.url.clone();
    let proto = |msg: String| FetchError::Protocol {
        url: url.clone(),
        msg,
    };
    if resp.status == 200 && whole && have == 0 {
        if let Some(cl) = resp.content_length
            && cl != job.size
        {
            return Err(proto(format!("Content-Length {cl}, expected {}", job.size)));
        }
    } else {
        check_range(&resp, a, b)?;
    }
    if whole
        && let Some(fs) = resp.file_size
        && fs != job.size
    {
        return Err(proto(format!(
            "the hub reports {fs} bytes for {}, the pin is {}",
            job.file, job.size
        )));
    }
    let want = job.size - have;
    let mut since = 0u64;
    let mut buf = vec![0u8; CHUNK];
    while *got < want {
        if stop.load(Ordering::Relaxed) {
            return Err(FetchError::Stopped);
        }
        let max = ((want - *got) as usize).min(CHUNK);
        let n = match resp.body.read(&mut buf[..max]) {
            Ok(0) => {
                return Err(FetchError::Transport {
                    url,
                    msg: format!(
                        "connection closed after {} of {} bytes",
                        have + *got,
                        job.size
                    ),
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(FetchError::Transport {
                    url,
                    msg: format!("body read failed after {} bytes: {e}", have + *got),
                });
            }
        };
        out.write_all(&buf[..n]).map_err(FetchError::io(part))?;
        *got += n as u64;
        since += n as u64;
        bar.inc(n as u64);
        if since >= checkpoint_bytes && *got < want {
            checkpoint(out, part, &job.dest, have + *got).map_err(FetchError::io(part))?;
            since = 0;
        }
    }
    Ok(())
}
