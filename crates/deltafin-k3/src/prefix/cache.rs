//! [`PrefixCache`]: prefix states keyed by the exact token ids before them, in two tiers:
//! RAM (least recently used out first, by bytes) and a directory on disk
//! ([`crate::prefix::disk`]), docs/SERVER.md "Conversation state".
//!
//! A key is SHA-256 over the cache's tag (which names the checkpoint files and the
//! numerics, so a state is never offered to a model that would not have computed it) and
//! the token ids. An entry also keeps its ids, and a lookup compares them: a hash
//! collision cannot hand out a wrong state.

use crate::model::K3Model;
use crate::prefix::disk::DiskTier;
use crate::prefix::snapshot::{Key, Snapshot, shaped_for};
use deltafin_store::dims::ModelDims;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Where the cache keeps what and how much.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Bytes of snapshots held in RAM (0: no RAM tier).
    pub ram_bytes: u64,
    /// The disk tier's directory and byte budget (`None`: no disk tier).
    pub disk: Option<(PathBuf, u64)>,
}

/// Counters, for `/metrics` and `--stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub ram_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub stored: u64,
    /// Disk entries found damaged and removed.
    pub corrupt: u64,
    pub ram_bytes: u64,
    pub ram_entries: u64,
}

struct RamEntry {
    ids: Arc<[u32]>,
    snap: Arc<Snapshot>,
    bytes: u64,
    used: u64,
}

#[derive(Default)]
struct Ram {
    entries: HashMap<Key, RamEntry>,
    bytes: u64,
    clock: u64,
}

/// The two-tier prefix-state cache of one loaded model.
pub struct PrefixCache {
    tag: String,
    dims: ModelDims,
    ram_budget: u64,
    ram: Mutex<Ram>,
    disk: Option<DiskTier>,
    hits_ram: AtomicU64,
    hits_disk: AtomicU64,
    misses: AtomicU64,
    stored: AtomicU64,
}

impl PrefixCache {
    /// A cache for `model`'s states under `tag` (see [`crate::engine::LoadedEngine::state_tag`]).
    /// `warn` receives what the disk tier could not do (a damaged entry, a failed write);
    /// the cache then goes on without it. An unusable disk directory is an error.
    pub fn new(
        model: &K3Model,
        tag: impl Into<String>,
        config: &CacheConfig,
        warn: Box<dyn Fn(&str) + Send + Sync>,
    ) -> Result<PrefixCache, String> {
        let tag = tag.into();
        let disk = match &config.disk {
            Some((dir, budget)) => Some(DiskTier::open(dir.clone(), *budget, warn)?),
            None => None,
        };
        Ok(PrefixCache {
            tag,
            dims: model.dims.clone(),
            ram_budget: config.ram_bytes,
            ram: Mutex::new(Ram::default()),
            disk,
            hits_ram: AtomicU64::new(0),
            hits_disk: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            stored: AtomicU64::new(0),
        })
    }

    /// Whether states also go to disk (the directory is writable).
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    /// Whether either tier can hold anything.
    pub fn enabled(&self) -> bool {
        self.ram_budget > 0 || self.disk.is_some()
    }

    /// The tag keys are made under.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The key of `ids`.
    pub fn key(&self, ids: &[u32]) -> Key {
        let mut h = self.hasher();
        feed(&mut h, ids);
        h.finalize().into()
    }

    fn hasher(&self) -> Sha256 {
        let mut h = Sha256::new();
        h.update((self.tag.len() as u64).to_le_bytes());
        h.update(self.tag.as_bytes());
        h
    }

    /// The longest stored prefix of `prompt` of at most `max_len` tokens whose length is a
    /// multiple of the KDA chunk length, with taps for exactly `tap_layers` when those are
    /// asked for: its length and state. RAM first, then disk (a disk hit is kept in RAM).
    pub fn lookup(
        &self,
        prompt: &[u32],
        max_len: usize,
        tap_layers: Option<&[usize]>,
    ) -> Option<(usize, Arc<Snapshot>)> {
        let align = self.dims.kda_chunk.max(1);
        let max_len = max_len.min(prompt.len());
        // Keys of every aligned prefix, from one pass of the hash.
        let mut keys = Vec::with_capacity(max_len / align);
        let mut h = self.hasher();
        let mut at = 0;
        while at + align <= max_len {
            feed(&mut h, &prompt[at..at + align]);
            at += align;
            keys.push((at, h.clone().finalize().into()));
        }
        let fits = |s: &Snapshot| match tap_layers {
            None => true,
            Some(l) => s.taps.as_ref().is_some_and(|t| t.layer_ids() == l),
        };
        for (len, key) in keys.into_iter().rev() {
            let ids = &prompt[..len];
            if let Some(s) = self.ram_get(&key, ids).filter(|s| fits(s)) {
                self.hits_ram.fetch_add(1, Ordering::Relaxed);
                return Some((len, s));
            }
            if let Some(disk) = &self.disk
                && let Some(s) = disk.read(&key, &self.tag, ids, &self.dims)
                && fits(&s)
            {
                let s = Arc::new(s);
                self.ram_put(key, ids, s.clone());
                self.hits_disk.fetch_add(1, Ordering::Relaxed);
                return Some((len, s));
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Store `snap`, the state after `ids`, in both tiers (a tier that holds the key with
    /// at least the same taps keeps its entry). Returns whether anything was written.
    pub fn store(&self, ids: &[u32], snap: Snapshot) -> bool {
        if snap.state.position != ids.len() || !shaped_for(&snap.state, &self.dims) {
            return false;
        }
        let key = self.key(ids);
        let snap = Arc::new(snap);
        let has_taps = snap.taps.is_some();
        let mut wrote = false;
        let in_ram = self
            .ram_get(&key, ids)
            .is_some_and(|s| s.taps.is_some() || !has_taps);
        if !in_ram {
            wrote |= self.ram_put(key, ids, snap.clone());
        }
        if let Some(disk) = &self.disk {
            wrote |= disk.write(&key, &self.tag, ids, &snap);
        }
        if wrote {
            self.stored.fetch_add(1, Ordering::Relaxed);
        }
        wrote
    }

    /// Counters and the RAM tier's size.
    pub fn stats(&self) -> CacheStats {
        let ram = self.ram.lock().unwrap_or_else(PoisonError::into_inner);
        CacheStats {
            ram_hits: self.hits_ram.load(Ordering::Relaxed),
            disk_hits: self.hits_disk.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            stored: self.stored.load(Ordering::Relaxed),
            corrupt: self.disk.as_ref().map_or(0, |d| d.corrupt()),
            ram_bytes: ram.bytes,
            ram_entries: ram.entries.len() as u64,
        }
    }

    /// Forget the RAM tier (the disk tier stays).
    pub fn clear_ram(&self) {
        let mut ram = self.ram.lock().unwrap_or_else(PoisonError::into_inner);
        *ram = Ram::default();
    }

    fn ram_get(&self, key: &Key, ids: &[u32]) -> Option<Arc<Snapshot>> {
        let mut ram = self.ram.lock().unwrap_or_else(PoisonError::into_inner);
        ram.clock += 1;
        let now = ram.clock;
        let e = ram.entries.get_mut(key)?;
        if *e.ids != *ids {
            return None;
        }
        e.used = now;
        Some(e.snap.clone())
    }

    fn ram_put(&self, key: Key, ids: &[u32], snap: Arc<Snapshot>) -> bool {
        let bytes = (snap.bytes() + ids.len() * 4) as u64;
        if bytes > self.ram_budget {
            return false;
        }
        let mut ram = self.ram.lock().unwrap_or_else(PoisonError::into_inner);
        ram.clock += 1;
        let used = ram.clock;
        if let Some(old) = ram.entries.remove(&key) {
            ram.bytes -= old.bytes;
        }
        while ram.bytes + bytes > self.ram_budget {
            let Some(oldest) = ram
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| *k)
            else {
                break;
            };
            if let Some(e) = ram.entries.remove(&oldest) {
                ram.bytes -= e.bytes;
            }
        }
        ram.bytes += bytes;
        ram.entries.insert(
            key,
            RamEntry {
                ids: ids.into(),
                snap,
                bytes,
                used,
            },
        );
        true
    }
}

fn feed(h: &mut Sha256, ids: &[u32]) {
    for id in ids {
        h.update(id.to_le_bytes());
    }
}
