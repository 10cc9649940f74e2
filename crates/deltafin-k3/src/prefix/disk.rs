//! The disk tier of the prefix cache: one file per prefix state in a directory
//! (`k3-meta/state-cache/` under the model root), written atomically, checked in full
//! before use, removed oldest first past a byte budget. Deleting the directory or any file
//! in it is always safe.
//!
//! File `<key hex>.k3state` (docs/SERVER.md "Conversation state", all integers
//! little-endian):
//!
//! ```text
//! "DFPSTATE" · u32 version (1) · u32 header length · header (JSON: tag, positions,
//! layer kinds, MLA cache type, tap layers and hidden size) · ids (u32 × positions) ·
//! per layer: KDA recurrent f32s then conv f32s | MLA latent then tail (bf16 or f32) ·
//! taps (bf16) · SHA-256 of everything before it
//! ```
//!
//! Every size comes from the header through checked arithmetic and must add up to the
//! file's length before anything is allocated; the checksum, the tag, the ids and every
//! size must agree, or the file is reported, removed and never used.

use crate::model::kda::KdaState;
use crate::model::mla::{CacheRows, MlaCache};
use crate::model::state::{LayerState, State};
use crate::model::taps::Taps;
use crate::prefix::snapshot::{Key, Snapshot, shaped_for};
use deltafin_store::dims::{AttnKind, CacheDtype, ModelDims};
use deltafin_tensor::bf16;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

const MAGIC: &[u8; 8] = b"DFPSTATE";
const VERSION: u32 = 1;
const EXT: &str = "k3state";
/// Largest header accepted (a header names layer kinds and tap layers: a few KiB).
const MAX_HEADER: u32 = 1 << 20;

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Header {
    tag: String,
    positions: u64,
    /// `"kda"` / `"mla"` per layer.
    layers: Vec<String>,
    kda_recurrent: u64,
    kda_conv: u64,
    kv_lora_rank: u64,
    rope_dim: u64,
    /// `"bf16"` or `"f32"`.
    mla_dtype: String,
    tap_layers: Option<Vec<u64>>,
    hidden: u64,
}

pub(crate) struct DiskTier {
    dir: PathBuf,
    budget: u64,
    warn: Box<dyn Fn(&str) + Send + Sync>,
    corrupt: AtomicU64,
    /// Serialises this process's writes and evictions.
    lock: Mutex<()>,
    seq: AtomicU64,
}

fn dtype_name(d: CacheDtype) -> &'static str {
    match d {
        CacheDtype::Bf16 => "bf16",
        CacheDtype::F32 => "f32",
    }
}

impl DiskTier {
    pub(crate) fn open(
        dir: PathBuf,
        budget: u64,
        warn: Box<dyn Fn(&str) + Send + Sync>,
    ) -> Result<DiskTier, String> {
        fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create the state cache {}: {e}", dir.display()))?;
        crate::weights::install::writable(&dir)
            .map_err(|e| format!("cannot write the state cache {}: {e}", dir.display()))?;
        sweep_temporaries(&dir);
        Ok(DiskTier {
            dir,
            budget,
            warn,
            corrupt: AtomicU64::new(0),
            lock: Mutex::new(()),
            seq: AtomicU64::new(0),
        })
    }

    pub(crate) fn corrupt(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    fn path(&self, key: &Key) -> PathBuf {
        self.dir.join(format!("{}.{EXT}", hex::encode(key)))
    }

    /// The entry for `key` if it exists and is whole and for exactly `ids` under `tag`.
    pub(crate) fn read(
        &self,
        key: &Key,
        tag: &str,
        ids: &[u32],
        dims: &ModelDims,
    ) -> Option<Snapshot> {
        let path = self.path(key);
        let file = File::open(&path).ok()?;
        match decode(file, tag, ids, dims) {
            Ok(s) => {
                // Recently used entries are evicted last.
                if let Ok(f) = File::options().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Some(s)
            }
            Err(Refused::Other(why)) => {
                (self.warn)(&format!(
                    "state cache: {} is not usable ({why}); ignored",
                    path.display()
                ));
                None
            }
            Err(Refused::Damaged(why)) => {
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                let removed = fs::remove_file(&path).is_ok();
                (self.warn)(&format!(
                    "state cache: {} is damaged ({why}); ignored{}",
                    path.display(),
                    if removed { " and removed" } else { "" }
                ));
                None
            }
        }
    }

    /// Write `snap` for `ids` unless an entry with at least its taps is there. Returns
    /// whether a file was written.
    pub(crate) fn write(&self, key: &Key, tag: &str, ids: &[u32], snap: &Snapshot) -> bool {
        let path = self.path(key);
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if path.exists() && (snap.taps.is_none() || has_taps(&path)) {
            return false;
        }
        let size = encoded_len(snap, ids.len());
        if size > self.budget {
            return false;
        }
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(
            "{TMP_PREFIX}{}-{}-{n}",
            hex::encode(&key[..8]),
            std::process::id()
        ));
        let written = encode_to(&tmp, tag, ids, snap).and_then(|()| {
            fs::rename(&tmp, &path)?;
            if let Ok(d) = File::open(&self.dir) {
                let _ = d.sync_all();
            }
            Ok(())
        });
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            (self.warn)(&format!(
                "state cache: cannot write {}: {e}; the state stays in memory only",
                path.display()
            ));
            return false;
        }
        self.evict(&path);
        true
    }

    /// Remove the oldest entries (by modification time) until the directory holds at most
    /// the budget; `keep` goes last. Writes in progress (temporaries) count against the
    /// budget but are not removed.
    fn evict(&self, keep: &Path) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        let mut in_progress = 0u64;
        let mut entries: Vec<(SystemTime, u64, PathBuf)> = rd
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                if e.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                    in_progress += m.len();
                    return None;
                }
                e.path()
                    .extension()
                    .is_some_and(|x| x == EXT)
                    .then_some(())?;
                Some((m.modified().ok()?, m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = entries.iter().map(|e| e.1).sum::<u64>() + in_progress;
        entries.sort_by_key(|e| (e.2 == keep, e.0));
        for (_, len, p) in entries {
            if total <= self.budget {
                break;
            }
            if fs::remove_file(&p).is_ok() {
                total = total.saturating_sub(len);
            }
        }
    }
}

/// Prefix of a state being written (`.tmp-<key>-<pid>-<n>`), renamed to its final name
/// once whole.
const TMP_PREFIX: &str = ".tmp-";

/// Remove the leftovers of writes that never finished: temporaries of a process that is no
/// longer running (killed between writing a state and renaming it), and any older than an
/// hour (a writer in another pid namespace). Another live process's write in progress is
/// left alone.
fn sweep_temporaries(dir: &Path) {
    let Ok(rd) = fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TMP_PREFIX)) else {
            continue;
        };
        let writer = rest.split('-').nth(1).and_then(|p| p.parse::<u32>().ok());
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|a| a > Duration::from_secs(3600));
        let orphan = match writer {
            Some(pid) => pid == std::process::id() || !process_alive(pid),
            None => true,
        };
        if orphan || old {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Whether a process with this id runs (on this machine's pid namespace).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn has_taps(path: &Path) -> bool {
    File::open(path)
        .ok()
        .and_then(|f| read_header(&mut BufReader::new(f)).ok())
        .is_some_and(|(h, _)| h.tap_layers.is_some())
}

fn header_for(tag: &str, positions: usize, snap: &Snapshot) -> Header {
    let state = &snap.state;
    let (mut rec, mut conv, mut dtype) = (0, 0, "bf16");
    let layers = state
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Kda(s) => {
                rec = s.recurrent.len() as u64;
                conv = s.conv.len() as u64;
                "kda".to_string()
            }
            LayerState::Mla(c) => {
                dtype = match c {
                    MlaCache::Bf16(_) => "bf16",
                    MlaCache::F32(_) => "f32",
                };
                "mla".to_string()
            }
        })
        .collect();
    let (kv, rope) = state
        .layers
        .iter()
        .find_map(|l| match l {
            LayerState::Mla(c) if positions > 0 => {
                let (a, b) = c.values();
                Some(((a / positions) as u64, (b / positions) as u64))
            }
            _ => None,
        })
        .unwrap_or((0, 0));
    Header {
        tag: tag.to_string(),
        positions: positions as u64,
        layers,
        kda_recurrent: rec,
        kda_conv: conv,
        kv_lora_rank: kv,
        rope_dim: rope,
        mla_dtype: dtype.to_string(),
        tap_layers: snap
            .taps
            .as_ref()
            .map(|t| t.layer_ids().iter().map(|&l| l as u64).collect()),
        hidden: snap.taps.as_ref().map_or(0, |t| t.hidden() as u64),
    }
}

/// Payload bytes past the ids that `h` announces, or `None` when a size overflows.
fn payload_len(h: &Header) -> Option<u64> {
    let mla_elem: u64 = if h.mla_dtype == "f32" { 4 } else { 2 };
    let mut total: u64 = 0;
    for kind in &h.layers {
        let add = match kind.as_str() {
            "kda" => h.kda_recurrent.checked_add(h.kda_conv)?.checked_mul(4)?,
            _ => h
                .positions
                .checked_mul(h.kv_lora_rank.checked_add(h.rope_dim)?)?
                .checked_mul(mla_elem)?,
        };
        total = total.checked_add(add)?;
    }
    if let Some(t) = &h.tap_layers {
        let taps = h
            .positions
            .checked_mul(t.len() as u64)?
            .checked_mul(h.hidden)?
            .checked_mul(2)?;
        total = total.checked_add(taps)?;
    }
    Some(total)
}

fn encoded_len(snap: &Snapshot, positions: usize) -> u64 {
    let h = header_for("", positions, snap);
    let header = serde_json::to_vec(&h).map_or(0, |v| v.len() as u64);
    16 + header + positions as u64 * 4 + payload_len(&h).unwrap_or(u64::MAX / 2) + 32
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn encode_to(path: &Path, tag: &str, ids: &[u32], snap: &Snapshot) -> std::io::Result<()> {
    let file = File::create(path)?;
    let mut w = Hashing {
        inner: BufWriter::with_capacity(1 << 20, file),
        hash: Sha256::new(),
    };
    let header = serde_json::to_vec(&header_for(tag, ids.len(), snap))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(MAGIC)?;
    w.write_all(&VERSION.to_le_bytes())?;
    w.write_all(&(header.len() as u32).to_le_bytes())?;
    w.write_all(&header)?;
    write_u32s(&mut w, ids)?;
    for l in &snap.state.layers {
        match l {
            LayerState::Kda(s) => {
                write_f32s(&mut w, &s.recurrent)?;
                write_f32s(&mut w, &s.conv)?;
            }
            LayerState::Mla(MlaCache::Bf16(c)) => {
                write_bf16s(&mut w, &c.latent)?;
                write_bf16s(&mut w, &c.tail)?;
            }
            LayerState::Mla(MlaCache::F32(c)) => {
                write_f32s(&mut w, &c.latent)?;
                write_f32s(&mut w, &c.tail)?;
            }
        }
    }
    if let Some(t) = &snap.taps {
        let v: Vec<bf16> = t.values().iter().map(|&x| bf16::from_f32(x)).collect();
        write_bf16s(&mut w, &v)?;
    }
    let Hashing { mut inner, hash } = w;
    inner.write_all(&hash.finalize())?;
    inner.flush()?;
    let file = inner.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

/// `v` as little-endian bytes of `N` each, written in pieces of 256 Ki values.
fn write_le<T: Copy, const N: usize>(
    w: &mut impl Write,
    v: &[T],
    bytes: impl Fn(T) -> [u8; N],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(v.len().min(1 << 18) * N);
    for c in v.chunks(1 << 18) {
        buf.clear();
        c.iter().for_each(|&x| buf.extend_from_slice(&bytes(x)));
        w.write_all(&buf)?;
    }
    Ok(())
}

fn write_u32s(w: &mut impl Write, v: &[u32]) -> std::io::Result<()> {
    write_le(w, v, u32::to_le_bytes)
}

fn write_f32s(w: &mut impl Write, v: &[f32]) -> std::io::Result<()> {
    write_le(w, v, f32::to_le_bytes)
}

fn write_bf16s(w: &mut impl Write, v: &[bf16]) -> std::io::Result<()> {
    write_le(w, v, |x: bf16| x.to_bits().to_le_bytes())
}

/// Why a file was not used: damaged (bad magic, sizes, checksum, truncated, or contents
/// that disagree with the key it is named by: removed), or written by another format
/// version (left for the build that wrote it).
enum Refused {
    Damaged(String),
    Other(String),
}

/// A reader that hashes what passes through it.
struct HashingReader<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// The header and its stored length in bytes.
fn read_header(r: &mut impl Read) -> Result<(Header, u64), Refused> {
    let damaged = |w: &str| Refused::Damaged(w.to_string());
    let mut fixed = [0u8; 16];
    r.read_exact(&mut fixed)
        .map_err(|_| damaged("shorter than its header"))?;
    if &fixed[..8] != MAGIC {
        return Err(damaged("not a deltafin prefix state"));
    }
    let version = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
    if version != VERSION {
        return Err(Refused::Other(format!("format version {version}")));
    }
    let len = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]);
    if len > MAX_HEADER {
        return Err(damaged("header length out of range"));
    }
    let mut header = vec![0u8; len as usize];
    r.read_exact(&mut header)
        .map_err(|_| damaged("truncated header"))?;
    let h =
        serde_json::from_slice(&header).map_err(|e| Refused::Damaged(format!("header: {e}")))?;
    Ok((h, u64::from(len)))
}

fn decode(file: File, tag: &str, ids: &[u32], dims: &ModelDims) -> Result<Snapshot, Refused> {
    let damaged = |w: &str| Refused::Damaged(w.to_string());
    let file_len = file
        .metadata()
        .map_err(|e| Refused::Other(e.to_string()))?
        .len();
    let mut r = HashingReader {
        inner: BufReader::with_capacity(1 << 20, file),
        hash: Sha256::new(),
    };
    let (h, header_len) = read_header(&mut r)?;
    // The announced sizes must add up to the file before anything is allocated.
    let payload = payload_len(&h).ok_or_else(|| damaged("sizes overflow"))?;
    let expect = h
        .positions
        .checked_mul(4)
        .and_then(|b| b.checked_add(payload))
        .and_then(|b| b.checked_add(32))
        .ok_or_else(|| damaged("sizes overflow"))?;
    let consumed = 16 + header_len;
    if file_len.checked_sub(consumed) != Some(expect) {
        return Err(damaged("length disagrees with its header"));
    }
    if h.tag != tag {
        return Err(damaged("written under another tag than its name says"));
    }
    if h.positions != ids.len() as u64 {
        return Err(damaged("for another prompt than its name says"));
    }
    let shape_ok = h.layers.len() == dims.num_layers()
        && h.layers.iter().zip(&dims.attn_kinds).all(|(k, a)| {
            matches!(
                (k.as_str(), a),
                ("kda", AttnKind::Kda) | ("mla", AttnKind::Mla)
            )
        })
        && h.kda_recurrent == dims.kda_recurrent_values() as u64
        && h.kda_conv == dims.kda_conv_values() as u64
        && (h.positions == 0
            || (h.kv_lora_rank == dims.kv_lora_rank as u64
                && h.rope_dim == dims.qk_rope_head_dim as u64))
        && h.mla_dtype == dtype_name(dims.mla_cache_dtype);
    if !shape_ok {
        return Err(damaged("shaped for other model dimensions"));
    }
    let n = ids.len();
    let stored_ids = read_u32s(&mut r, n)?;
    if stored_ids != ids {
        return Err(damaged("for another prompt than its name says"));
    }
    let mut layers = Vec::with_capacity(h.layers.len());
    for kind in &h.layers {
        layers.push(match kind.as_str() {
            "kda" => LayerState::Kda(KdaState {
                recurrent: read_f32s(&mut r, dims.kda_recurrent_values())?,
                conv: read_f32s(&mut r, dims.kda_conv_values())?,
            }),
            _ => {
                let (a, b) = (n * dims.kv_lora_rank, n * dims.qk_rope_head_dim);
                LayerState::Mla(match dims.mla_cache_dtype {
                    CacheDtype::Bf16 => MlaCache::Bf16(CacheRows {
                        latent: read_bf16s(&mut r, a)?,
                        tail: read_bf16s(&mut r, b)?,
                    }),
                    CacheDtype::F32 => MlaCache::F32(CacheRows {
                        latent: read_f32s(&mut r, a)?,
                        tail: read_f32s(&mut r, b)?,
                    }),
                })
            }
        });
    }
    let taps = match &h.tap_layers {
        Some(l) => {
            let ids: Vec<usize> = l.iter().map(|&x| x as usize).collect();
            let count = n * ids.len() * h.hidden as usize;
            let values: Vec<f32> = read_bf16s(&mut r, count)?
                .into_iter()
                .map(|x| x.to_f32())
                .collect();
            Some(
                Taps::with_rows(&ids, dims.num_layers(), h.hidden as usize, values)
                    .map_err(|e| Refused::Damaged(e.to_string()))?,
            )
        }
        None => None,
    };
    let HashingReader { mut inner, hash } = r;
    let mut sum = [0u8; 32];
    inner
        .read_exact(&mut sum)
        .map_err(|_| damaged("truncated checksum"))?;
    if hash.finalize().as_slice() != sum {
        return Err(damaged("checksum mismatch"));
    }
    let state = State {
        layers,
        position: n,
    };
    if !shaped_for(&state, dims) {
        return Err(damaged("shaped for other model dimensions"));
    }
    Ok(Snapshot { state, taps })
}

fn read_bytes(r: &mut impl Read, n: usize) -> Result<Vec<u8>, Refused> {
    let mut v = vec![0u8; n];
    r.read_exact(&mut v)
        .map_err(|_| Refused::Damaged("truncated".into()))?;
    Ok(v)
}

fn read_le<T, const N: usize>(
    r: &mut impl Read,
    n: usize,
    value: impl Fn([u8; N]) -> T,
) -> Result<Vec<T>, Refused> {
    let b = read_bytes(r, n * N)?;
    Ok(b.chunks_exact(N)
        .map(|c| value(c.try_into().unwrap_or([0; N])))
        .collect())
}

fn read_u32s(r: &mut impl Read, n: usize) -> Result<Vec<u32>, Refused> {
    read_le(r, n, u32::from_le_bytes)
}

fn read_f32s(r: &mut impl Read, n: usize) -> Result<Vec<f32>, Refused> {
    read_le(r, n, f32::from_le_bytes)
}

fn read_bf16s(r: &mut impl Read, n: usize) -> Result<Vec<bf16>, Refused> {
    read_le(r, n, |b| bf16::from_bits(u16::from_le_bytes(b)))
}
