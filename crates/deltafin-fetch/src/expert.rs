//! On-demand routed-expert fetch for stream installs.
//!
//! An expert is the verbatim concatenation of its six shard tensors (docs/K3.md §3.4),
//! which are adjacent in the shard, so one range request fetches it. The range comes from
//! the local, pinned inventory; before the first range of a shard, the shard's 8-byte header
//! length is fetched and compared with the inventory's (a changed header would shift every
//! offset). The bytes go through the transfer engine (`.part`, resume, retry, exact size,
//! atomic rename) into `k3-experts/L{layer}-E{expert}.bin`, where the expert store reads them.
//! Each fetch holds its expert's byte of the install lock ([`crate::lock`]) while it writes.
//!
//! The expert store (`deltafin-experts`) can hold a `Box<dyn ExpertFetch>` and call
//! [`ExpertFetch::fetch_expert`] for an expert that is missing locally.

use crate::error::FetchError;
use crate::hub::HubClient;
use crate::inventory::Inventory;
use crate::lock::{EXPERT_WAIT, expert_index, lock_expert};
use crate::manifest::K3Manifest;
use crate::plan::{expert_path, expert_span};
use crate::transfer::{Job, RetryPolicy, TransferOptions, is_complete, run_jobs};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Something that can make one routed expert available as a local `raw-v1` file.
pub trait ExpertFetch: Send + Sync {
    /// Ensure `k3-experts/L{layer}-E{expert}.bin` exists, complete and verified; return its
    /// path. Already-cached experts return immediately without network.
    fn fetch_expert(&self, layer: usize, expert: usize) -> Result<PathBuf, FetchError>;
}

/// Fetches experts from the hub by byte range, using the pinned inventory.
pub struct RemoteExperts {
    root: PathBuf,
    manifest: K3Manifest,
    inventory: Inventory,
    client: HubClient,
    retry: RetryPolicy,
    checked_shards: Mutex<HashSet<String>>,
}

impl RemoteExperts {
    /// Open for the install at `root` (loads and verifies the inventory against its pin).
    pub fn open(root: &Path, manifest: &K3Manifest, client: HubClient) -> Result<Self, FetchError> {
        let inventory = Inventory::load(root, &manifest.inventory)?;
        Ok(RemoteExperts {
            root: root.to_path_buf(),
            manifest: manifest.clone(),
            inventory,
            client,
            retry: RetryPolicy::default(),
            checked_shards: Mutex::new(HashSet::new()),
        })
    }

    /// Replace the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Local path of an expert file.
    pub fn path(&self, layer: usize, expert: usize) -> PathBuf {
        expert_path(&self.root, layer, expert)
    }

    /// `(shard, absolute offset, length)` of an expert.
    pub fn span(&self, layer: usize, expert: usize) -> Result<(String, u64, u64), FetchError> {
        expert_span(&self.manifest, &self.inventory, layer, expert)
    }

    fn check_shard_header(&self, shard: &str) -> Result<(), FetchError> {
        if self
            .checked_shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(shard)
        {
            return Ok(());
        }
        let m = &self.manifest;
        let b = self
            .client
            .get_range_bytes(&m.repo, &m.revision, shard, 0, 7)?;
        let mut le = [0u8; 8];
        le.copy_from_slice(&b);
        let remote = u64::from_le_bytes(le);
        let local = self.inventory.hlen(shard);
        if local != Some(remote) {
            return Err(FetchError::Inventory(format!(
                "{shard}: remote header length {remote}, the inventory says {local:?}"
            )));
        }
        self.checked_shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(shard.to_string());
        Ok(())
    }
}

impl ExpertFetch for RemoteExperts {
    fn fetch_expert(&self, layer: usize, expert: usize) -> Result<PathBuf, FetchError> {
        let (shard, offset, len) = self.span(layer, expert)?;
        let dest = self.path(layer, expert);
        if is_complete(&dest, len) {
            return Ok(dest);
        }
        // One writer per expert file across threads and processes (crate::lock); a fetch
        // that waited for another one of the same expert finds the file complete.
        let index = expert_index(layer, expert, self.manifest.experts_per_layer)?;
        let _lock = lock_expert(&self.root, index, EXPERT_WAIT)?;
        if is_complete(&dest, len) {
            return Ok(dest);
        }
        self.check_shard_header(&shard)?;
        let m = &self.manifest;
        let job = Job {
            repo: m.repo.clone(),
            revision: m.revision.clone(),
            file: shard,
            range: Some((offset, len)),
            dest: dest.clone(),
            size: len,
            sha256: None,
        };
        let opts = TransferOptions {
            workers: 1,
            retry: self.retry,
            progress: false,
            receipts: Some(self.root.clone()),
            ..TransferOptions::default()
        };
        run_jobs(&self.client, &[job], &opts)?;
        Ok(dest)
    }
}
