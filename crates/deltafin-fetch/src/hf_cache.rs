//! Existing downloads: files a user already fetched with `huggingface_hub` (`hf download`),
//! used instead of fetching them again (docs/SETUP.md, "Existing downloads").
//!
//! The Hugging Face cache keeps one directory per repository,
//! `<hub>/models--<owner>--<name>/`, with the bytes in `blobs/<hash>` and, per commit,
//! `snapshots/<commit>/<file>` as a relative symlink to its blob. For a file stored with Git LFS
//! (every weight file) the blob is named by the SHA-256 of its bytes, which the hub computed.
//!
//! A job of the transfer engine whose repository has a snapshot of the **pinned** commit in
//! the cache, holding the job's file, is installed from the cache:
//!
//! 1. The cached file is verified once per run: a regular file (after the symlink), the pinned
//!    size where the manifest pins one, and its SHA-256 (one read) equal to the pinned digest
//!    where there is one **and** to the blob's name where that is a SHA-256. A file that
//!    fails is refused with an error naming it ([`FetchError::Cache`]); nothing is installed
//!    from it. A file that can be verified neither way (no pin, blob not named by a SHA-256) is
//!    not used: it is fetched from the hub and counted in [`HfCache::unverifiable`].
//! 2. A whole file is hard-linked into the model root (`dest.part`, then renamed), or copied
//!    when the cache is on another filesystem (`std::fs::copy`, which uses `copy_file_range`:
//!    a reflink where the filesystem does that). A byte range (a spine tensor or an expert of a
//!    stream install) is copied out of the cached shard.
//! 3. An unpinned file gets its fetch receipt (crate::receipts) before it is published, as a
//!    fetched one does; `setup --check` then treats it the same.
//!
//! Files the cache lacks are fetched from the hub as usual.

use crate::error::FetchError;
use crate::manifest::Manifests;
use crate::plan::Plan;
use crate::transfer::{Job, LocalSource, is_complete, part_path, resume_path, sync_dir};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// What the pins say about one file of a repository.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FilePin {
    size: Option<u64>,
    sha256: Option<String>,
}

/// The result of verifying one cached file: its blob and SHA-256, or `None` when it cannot be
/// verified (fetched from the hub instead).
type Verified = Result<Option<(PathBuf, String)>, String>;

/// One verification per (repository, file), shared by the transfer workers.
type VerifyCells = HashMap<(String, String), Arc<OnceLock<Verified>>>;

/// A Hugging Face hub cache directory used as a local source of pinned files.
pub struct HfCache {
    hub: PathBuf,
    pins: HashMap<(String, String), FilePin>,
    verified: Mutex<VerifyCells>,
    unverifiable: Mutex<Vec<String>>,
    linked: AtomicUsize,
    copied: AtomicUsize,
    bytes: AtomicU64,
}

impl LocalSource for HfCache {
    fn install(&self, job: &Job, receipts: Option<&Path>) -> Result<bool, FetchError> {
        HfCache::install(self, job, receipts)
    }
}

impl std::fmt::Debug for HfCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCache").field("hub", &self.hub).finish()
    }
}

/// How the files installed from the cache got there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheUse {
    /// Whole files hard-linked.
    pub linked: usize,
    /// Whole files copied (another filesystem) and byte ranges copied out of cached shards.
    pub copied: usize,
    /// Bytes installed from the cache.
    pub bytes: u64,
}

/// The default hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (as `huggingface_hub` resolves it).
pub fn default_hub_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("HF_HUB_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = var("HF_HOME") {
        return Some(PathBuf::from(d).join("hub"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// `models--owner--name` for `owner/name`.
pub fn repo_dir_name(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

fn cache_err(msg: String) -> FetchError {
    FetchError::Cache(msg)
}

/// Whether `s` is a lowercase-hex SHA-256.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl HfCache {
    /// The cache at `dir` for the repositories of `ms`. `dir` is the hub cache (the directory
    /// holding `models--…`), one repository's directory, or one of its snapshots; a repository
    /// or snapshot directory must belong to one of the pinned repositories, and a snapshot must
    /// be the pinned commit.
    pub fn open(dir: &Path, ms: &Manifests) -> Result<HfCache, FetchError> {
        let md = std::fs::metadata(dir).map_err(|e| {
            cache_err(format!(
                "{}: {e} (give the Hugging Face hub cache, e.g. ~/.cache/huggingface/hub)",
                dir.display()
            ))
        })?;
        if !md.is_dir() {
            return Err(cache_err(format!("{}: not a directory", dir.display())));
        }
        // The pinned repositories and their revisions.
        let pinned = [
            (&ms.k3.repo, &ms.k3.revision),
            (&ms.dspark.repo, &ms.dspark.revision),
            (&ms.qwen_small.repo, &ms.qwen_small.revision),
            (&ms.qwen_large.repo, &ms.qwen_large.revision),
        ];
        let pinned_of = |dir_name: &str| pinned.iter().find(|(r, _)| repo_dir_name(r) == dir_name);
        let none_of = || {
            pinned
                .iter()
                .map(|(r, _)| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let name = |p: &Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let parent = |p: &Path| p.parent().map(Path::to_path_buf).unwrap_or_default();
        let dir_name = name(dir);
        let up = parent(dir);
        let hub = if name(&up) == "snapshots" && name(&parent(&up)).starts_with("models--") {
            // A snapshot: it must be the pinned commit of one of the repositories.
            let repo_dir = name(&parent(&up));
            let Some((repo, want)) = pinned_of(&repo_dir) else {
                return Err(cache_err(format!(
                    "{}: a snapshot of {repo_dir}, which is none of the pinned repositories ({})",
                    dir.display(),
                    none_of()
                )));
            };
            if dir_name != **want {
                return Err(cache_err(format!(
                    "{}: snapshot {dir_name} of {repo}, but the pinned revision is {want} (`hf download {repo} --revision {want}`, then give this cache again)",
                    dir.display()
                )));
            }
            parent(&parent(&up))
        } else if dir_name.starts_with("models--") {
            if pinned_of(&dir_name).is_none() {
                return Err(cache_err(format!(
                    "{}: {dir_name} is none of the pinned repositories ({})",
                    dir.display(),
                    none_of()
                )));
            }
            up
        } else {
            dir.to_path_buf()
        };
        let mut pins = HashMap::new();
        let k3 = &ms.k3;
        for f in &k3.metadata {
            pins.insert(
                (k3.repo.clone(), f.path.clone()),
                FilePin {
                    size: Some(f.size),
                    sha256: f.sha256.clone(),
                },
            );
        }
        for s in &k3.shards {
            let (size, exact) = s.file_size();
            pins.insert(
                (k3.repo.clone(), s.file.clone()),
                FilePin {
                    size: exact.then_some(size),
                    sha256: s.sha256.clone(),
                },
            );
        }
        for m in [&ms.dspark, &ms.qwen_small, &ms.qwen_large] {
            for f in &m.files {
                pins.insert(
                    (m.repo.clone(), f.path.clone()),
                    FilePin {
                        size: Some(f.size),
                        sha256: f.sha256.clone(),
                    },
                );
            }
        }
        Ok(HfCache {
            hub,
            pins,
            verified: Mutex::new(HashMap::new()),
            unverifiable: Mutex::new(Vec::new()),
            linked: AtomicUsize::new(0),
            copied: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
        })
    }

    /// The hub cache directory.
    pub fn hub_dir(&self) -> &Path {
        &self.hub
    }

    /// The snapshot directory of `repo@revision` (it may not exist).
    pub fn snapshot_dir(&self, repo: &str, revision: &str) -> PathBuf {
        self.hub
            .join(repo_dir_name(repo))
            .join("snapshots")
            .join(revision)
    }

    /// One line per pinned repository: whether the cache holds its pinned snapshot and how
    /// many of its files.
    pub fn describe(&self, ms: &Manifests) -> Vec<String> {
        let mut out = Vec::new();
        let k3_files: Vec<&str> = ms
            .k3
            .metadata
            .iter()
            .map(|f| f.path.as_str())
            .chain(ms.k3.shards.iter().map(|s| s.file.as_str()))
            .collect();
        let repos: Vec<(&str, &str, Vec<&str>)> =
            std::iter::once((ms.k3.repo.as_str(), ms.k3.revision.as_str(), k3_files))
                .chain(
                    [&ms.dspark, &ms.qwen_large, &ms.qwen_small]
                        .into_iter()
                        .map(|m| {
                            (
                                m.repo.as_str(),
                                m.revision.as_str(),
                                m.files.iter().map(|f| f.path.as_str()).collect(),
                            )
                        }),
                )
                .collect();
        for (repo, rev, files) in repos {
            let snap = self.snapshot_dir(repo, rev);
            if snap.is_dir() {
                let have = files.iter().filter(|f| snap.join(f).is_file()).count();
                out.push(format!(
                    "hf cache: {repo}@{rev}: {have} of {} files in {}",
                    files.len(),
                    snap.display()
                ));
            } else if self.hub.join(repo_dir_name(repo)).is_dir() {
                out.push(format!(
                    "hf cache: {repo}: no snapshot of the pinned revision {rev} in {} (other revisions are not used)",
                    self.hub.join(repo_dir_name(repo)).display()
                ));
            }
        }
        out
    }

    /// The cached copy of `file` of `repo@revision`: the snapshot entry when it resolves to a
    /// file.
    pub fn lookup(&self, repo: &str, revision: &str, file: &str) -> Option<PathBuf> {
        let p = self.snapshot_dir(repo, revision).join(file);
        p.is_file().then_some(p)
    }

    /// Verify the cached copy of `file` once (memoized): `Ok(None)` when the cache lacks it
    /// or it cannot be verified, `Ok(Some((blob, sha256)))` when it matches its pins, an
    /// error naming it when it does not.
    fn verify(
        &self,
        repo: &str,
        revision: &str,
        file: &str,
    ) -> Result<Option<(PathBuf, String)>, FetchError> {
        let Some(entry) = self.lookup(repo, revision, file) else {
            return Ok(None);
        };
        let cell = {
            let mut m = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            m.entry((repo.to_string(), file.to_string()))
                .or_default()
                .clone()
        };
        let pin = self
            .pins
            .get(&(repo.to_string(), file.to_string()))
            .cloned()
            .unwrap_or_default();
        let r = cell.get_or_init(|| self.verify_uncached(repo, file, &entry, &pin));
        match r {
            Ok(v) => Ok(v.clone()),
            Err(msg) => Err(cache_err(msg.clone())),
        }
    }

    fn verify_uncached(&self, repo: &str, file: &str, entry: &Path, pin: &FilePin) -> Verified {
        let blob = std::fs::canonicalize(entry).map_err(|e| format!("{}: {e}", entry.display()))?;
        let md = std::fs::metadata(&blob).map_err(|e| format!("{}: {e}", blob.display()))?;
        let named = blob
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| is_sha256_hex(n));
        if pin.sha256.is_none() && named.is_none() {
            self.unverifiable
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{repo}/{file}"));
            return Ok(None);
        }
        let refuse = |why: String| {
            format!(
                "{file} of {repo} in the Hugging Face cache ({}): {why}; it is not used — delete it from the cache (or give no --from-hf-cache) and rerun",
                entry.display()
            )
        };
        if let Some(size) = pin.size
            && md.len() != size
        {
            return Err(refuse(format!(
                "{} bytes, the pinned size is {size}",
                md.len()
            )));
        }
        let got = sha256_of(&blob).map_err(|e| refuse(format!("reading it failed: {e}")))?;
        if let Some(want) = &pin.sha256
            && &got != want
        {
            return Err(refuse(format!(
                "sha256 {got} does not match the pinned {want}"
            )));
        }
        if let Some(want) = &named
            && &got != want
        {
            return Err(refuse(format!(
                "sha256 {got} does not match its blob name {want} (the cached copy is damaged)"
            )));
        }
        Ok(Some((blob, got)))
    }

    /// Install `job` from the cache when the cache holds its file: `Ok(true)` when `job.dest`
    /// is now complete, `Ok(false)` when the hub must be asked, an error when the cached copy
    /// fails its pins. `receipts`: the model root whose receipts record an unpinned file.
    pub fn install(&self, job: &Job, receipts: Option<&Path>) -> Result<bool, FetchError> {
        let Some((blob, whole_sha)) = self.verify(&job.repo, &job.revision, &job.file)? else {
            return Ok(false);
        };
        let dir = job.dest.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(FetchError::io(dir))?;
        let part = part_path(&job.dest);
        for p in [part.clone(), resume_path(&job.dest)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(FetchError::io(&p)(e)),
            }
        }
        let sha = match job.range {
            None => {
                let len = std::fs::metadata(&blob)
                    .map_err(FetchError::io(&blob))?
                    .len();
                if len != job.size {
                    return Err(cache_err(format!(
                        "{} of {} in the Hugging Face cache ({}): {len} bytes, the job needs {}",
                        job.file,
                        job.repo,
                        blob.display(),
                        job.size
                    )));
                }
                if std::fs::hard_link(&blob, &part).is_ok() {
                    self.linked.fetch_add(1, Ordering::Relaxed);
                } else {
                    std::fs::copy(&blob, &part).map_err(FetchError::io(&part))?;
                    self.copied.fetch_add(1, Ordering::Relaxed);
                }
                whole_sha
            }
            Some((off, len)) => {
                let sha = copy_range(&blob, off, len, &part)?;
                self.copied.fetch_add(1, Ordering::Relaxed);
                sha
            }
        };
        if !is_complete(&part, job.size) {
            let _ = std::fs::remove_file(&part);
            return Err(cache_err(format!(
                "{}: installing {} from the Hugging Face cache left the wrong size",
                part.display(),
                job.file
            )));
        }
        if let Some(want) = &job.sha256
            && &sha != want
        {
            let _ = std::fs::remove_file(&part);
            return Err(cache_err(format!(
                "{} of {} in the Hugging Face cache ({}): sha256 {sha} does not match the pinned {want}",
                job.file,
                job.repo,
                blob.display()
            )));
        }
        File::open(&part)
            .and_then(|f| f.sync_all())
            .map_err(FetchError::io(&part))?;
        if job.sha256.is_none()
            && let Some(root) = receipts
        {
            crate::receipts::record(root, &job.dest, job.size, &sha)?;
        }
        std::fs::rename(&part, &job.dest).map_err(FetchError::io(&job.dest))?;
        sync_dir(dir)?;
        self.bytes.fetch_add(job.size, Ordering::Relaxed);
        Ok(true)
    }

    /// What was installed from the cache so far.
    pub fn used(&self) -> CacheUse {
        CacheUse {
            linked: self.linked.load(Ordering::Relaxed),
            copied: self.copied.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Cached files that could not be verified (no pin, blob not named by a SHA-256), fetched
    /// from the hub instead.
    pub fn unverifiable(&self) -> Vec<String> {
        self.unverifiable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The header of K3 shard `file` read from the cache, when the cache holds it (the
    /// inventory built from the headers is checked against its pin by the caller).
    pub fn shard_header(
        &self,
        ms: &Manifests,
        file: &str,
    ) -> Option<Result<crate::inventory::ShardHeader, FetchError>> {
        let p = self.lookup(&ms.k3.repo, &ms.k3.revision, file)?;
        Some(read_header(&p).map(|json| crate::inventory::ShardHeader {
            file: file.to_string(),
            json,
        }))
    }

    /// Bytes of `plan`'s missing items that the cache would hard-link rather than download
    /// (whole files of the pinned snapshots on the model root's filesystem): the disk check
    /// does not count them.
    pub fn linkable_bytes(&self, root: &Path, ms: &Manifests, plan: &Plan) -> u64 {
        let Some(root_dev) = nearest_dev(root) else {
            return 0;
        };
        let mut sources: HashMap<String, (String, String, String)> = HashMap::new();
        let k3 = &ms.k3;
        for f in k3
            .metadata
            .iter()
            .map(|f| f.path.clone())
            .chain(k3.shards.iter().map(|s| s.file.clone()))
        {
            sources.insert(f.clone(), (k3.repo.clone(), k3.revision.clone(), f));
        }
        for m in [&ms.dspark, &ms.qwen_small, &ms.qwen_large] {
            for f in &m.files {
                sources.insert(
                    format!("{}/{}", m.install_dir, f.path),
                    (m.repo.clone(), m.revision.clone(), f.path.clone()),
                );
            }
        }
        plan.items
            .iter()
            .filter(|it| !it.present)
            .filter_map(|it| {
                let (repo, rev, file) = sources.get(&it.dest)?;
                let p = self.lookup(repo, rev, file)?;
                let md = std::fs::metadata(&p).ok()?;
                (md.dev() == root_dev).then_some(it.bytes)
            })
            .sum()
    }
}

/// The device of `path` or of its nearest existing ancestor.
fn nearest_dev(path: &Path) -> Option<u64> {
    path.ancestors()
        .find_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.dev())
}

fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Copy `len` bytes at `off` of `src` to a new `dst`, returning their SHA-256.
fn copy_range(src: &Path, off: u64, len: u64, dst: &Path) -> Result<String, FetchError> {
    let mut f = File::open(src).map_err(FetchError::io(src))?;
    let have = f.metadata().map_err(FetchError::io(src))?.len();
    if off.checked_add(len).is_none_or(|end| end > have) {
        return Err(cache_err(format!(
            "{}: {have} bytes, too short for bytes {off}..{} of the pinned layout",
            src.display(),
            off.saturating_add(len)
        )));
    }
    f.seek(SeekFrom::Start(off)).map_err(FetchError::io(src))?;
    let mut out = OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(dst)
        .map_err(FetchError::io(dst))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = (left as usize).min(buf.len());
        f.read_exact(&mut buf[..n]).map_err(FetchError::io(src))?;
        h.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(FetchError::io(dst))?;
        left -= n as u64;
    }
    Ok(hex::encode(h.finalize()))
}

/// A safetensors header's JSON bytes.
fn read_header(path: &Path) -> Result<Vec<u8>, FetchError> {
    let mut f = File::open(path).map_err(FetchError::io(path))?;
    let mut le = [0u8; 8];
    f.read_exact(&mut le).map_err(FetchError::io(path))?;
    let hlen = u64::from_le_bytes(le);
    if hlen == 0 || hlen > crate::inventory::MAX_HEADER_BYTES {
        return Err(FetchError::Inventory(format!(
            "{}: header length {hlen} is outside 1..={}",
            path.display(),
            crate::inventory::MAX_HEADER_BYTES
        )));
    }
    let mut json = vec![0u8; hlen as usize];
    f.read_exact(&mut json).map_err(FetchError::io(path))?;
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_names_are_recognized() {
        assert!(is_sha256_hex(&"a".repeat(64)));
        assert!(!is_sha256_hex(&"A".repeat(64)));
        assert!(!is_sha256_hex(&"a".repeat(40)));
        assert_eq!(
            repo_dir_name("moonshotai/Kimi-K3"),
            "models--moonshotai--Kimi-K3"
        );
    }

    #[test]
    fn copy_range_refuses_a_short_source() {
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("s");
        std::fs::write(&src, b"0123456789").expect("write");
        let dst = d.path().join("d");
        assert_eq!(
            copy_range(&src, 2, 3, &dst).expect("copy"),
            hex::encode(Sha256::digest(b"234"))
        );
        assert_eq!(std::fs::read(&dst).expect("read"), b"234");
        let e = copy_range(&src, 8, 3, &d.path().join("e")).expect_err("short");
        assert!(e.to_string().contains("too short"), "{e}");
    }
}
