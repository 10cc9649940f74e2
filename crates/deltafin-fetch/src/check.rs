//! Offline audits (`setup --check`, `setup-k3 --check`, `setup-dspark --check`,
//! `setup-qwen --check`): no network, no writes.
//!
//! Every file must be a regular file of the exact size. Files with a pinned sha256 are
//! re-hashed (metadata, DSpark, Qwen, and K3 shards where the manifest pins them). The real
//! K3 weights have no pinned digests: each weight file (a shard, a spine tensor, a routed
//! expert) is re-hashed against the receipt recorded when it was fetched
//! ([`crate::receipts`]), and one without a receipt is reported as unverifiable. This reads
//! every local weight byte once (the inventory digest pins the offsets).

use crate::inventory::{INVENTORY_PATH, Inventory};
use crate::manifest::{K3Manifest, PinnedFile, RepoManifest};
use crate::plan::{Mode, SPINE_DIR, expert_path};
use crate::receipts::Receipts;
use crate::transfer::sha256_file;
use std::path::Path;

/// Result of an audit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Files found complete.
    pub ok: usize,
    /// One line per problem (`missing …`, `corrupted …`).
    pub problems: Vec<String>,
    /// Stream installs: experts not cached locally (fetched on demand).
    pub lazy_missing: Option<u64>,
}

impl CheckReport {
    /// No problems.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    fn merge(&mut self, o: CheckReport) {
        self.ok += o.ok;
        self.problems.extend(o.problems);
        if o.lazy_missing.is_some() {
            self.lazy_missing = o.lazy_missing;
        }
    }
}

/// Check one file: regular, exact size, sha256 when pinned.
pub fn check_file(path: &Path, size: u64, sha256: Option<&str>, r: &mut CheckReport) {
    match std::fs::symlink_metadata(path) {
        Err(_) => r.problems.push(format!("missing {}", path.display())),
        Ok(m) if !m.is_file() => r
            .problems
            .push(format!("not a regular file: {}", path.display())),
        Ok(m) if m.len() != size => r.problems.push(format!(
            "corrupted {}: {} bytes, expected {size}",
            path.display(),
            m.len()
        )),
        Ok(_) => match sha256.map(|want| (want, sha256_file(path))) {
            None => r.ok += 1,
            Some((want, Ok(got))) if got == want => r.ok += 1,
            Some((want, Ok(got))) => r.problems.push(format!(
                "corrupted {}: sha256 {got}, expected {want}",
                path.display()
            )),
            Some((_, Err(e))) => r.problems.push(format!("unreadable: {e}")),
        },
    }
}

fn check_files(dir: &Path, files: &[PinnedFile]) -> CheckReport {
    let mut r = CheckReport::default();
    for f in files {
        check_file(&dir.join(&f.path), f.size, f.sha256.as_deref(), &mut r);
    }
    r
}

/// K3 metadata and inventory. Returns the inventory when it is intact.
pub fn check_k3_meta(root: &Path, m: &K3Manifest) -> (CheckReport, Option<Inventory>) {
    let mut r = check_files(root, &m.metadata);
    match Inventory::load(root, &m.inventory) {
        Ok(inv) => {
            r.ok += 1;
            (r, Some(inv))
        }
        Err(e) => {
            let p = root.join(INVENTORY_PATH);
            r.problems.push(if p.exists() {
                format!("corrupted {}: {e}", p.display())
            } else {
                format!("missing {}", p.display())
            });
            (r, None)
        }
    }
}

/// A weight file: exact size, then the pinned sha256, else the fetch receipt's; a file of
/// the right size with neither is unverifiable.
fn check_weight(
    root: &Path,
    path: &Path,
    size: u64,
    pinned: Option<&str>,
    receipts: &Receipts,
    r: &mut CheckReport,
) {
    let sha = pinned.or_else(|| receipts.sha256_at(root, path, size));
    let sized = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && m.len() == size);
    if sha.is_none() && sized {
        r.problems.push(format!(
            "unverifiable {}: no sha256 was recorded when it was fetched (delete it and rerun the setup step to fetch it again)",
            path.display()
        ));
        return;
    }
    check_file(path, size, sha, r);
}

/// K3 weights of `mode` (needs the inventory for exact sizes).
pub fn check_k3_weights(root: &Path, m: &K3Manifest, inv: &Inventory, mode: Mode) -> CheckReport {
    let mut r = CheckReport::default();
    let receipts = match Receipts::load(root) {
        Ok(x) => x,
        Err(e) => {
            r.problems.push(format!("unreadable fetch receipts: {e}"));
            Receipts::default()
        }
    };
    if receipts.malformed > 0 {
        r.problems.push(format!(
            "{}: {} damaged line(s) skipped",
            root.join(crate::receipts::RECEIPTS_PATH).display(),
            receipts.malformed
        ));
    }
    match mode {
        Mode::Full => {
            for s in &m.shards {
                let size = inv.hlen(&s.file).map(|h| 8 + h + s.data_bytes);
                match size {
                    Some(size) => check_weight(
                        root,
                        &root.join(&s.file),
                        size,
                        s.sha256.as_deref(),
                        &receipts,
                        &mut r,
                    ),
                    None => r.problems.push(format!("{}: not in the inventory", s.file)),
                }
            }
        }
        Mode::Stream => {
            for rec in inv.records().iter().filter(|x| !x.is_expert()) {
                check_weight(
                    root,
                    &root.join(SPINE_DIR).join(&rec.name),
                    rec.end - rec.start,
                    None,
                    &receipts,
                    &mut r,
                );
            }
            let mut missing = 0u64;
            for l in m.moe_layers() {
                for e in 0..m.experts_per_layer {
                    let p = expert_path(root, l, e);
                    match std::fs::symlink_metadata(&p) {
                        Err(_) => missing += 1,
                        Ok(_) => check_weight(root, &p, m.expert_bytes, None, &receipts, &mut r),
                    }
                }
            }
            r.lazy_missing = Some(missing);
        }
    }
    r
}

/// A file-by-file repository (DSpark, Qwen) installed in `dir`.
pub fn check_repo(dir: &Path, m: &RepoManifest) -> CheckReport {
    check_files(dir, &m.files)
}

/// K3 metadata, inventory and weights together.
pub fn check_k3(root: &Path, m: &K3Manifest, mode: Mode) -> CheckReport {
    let (mut r, inv) = check_k3_meta(root, m);
    if let Some(inv) = inv {
        r.merge(check_k3_weights(root, m, &inv, mode));
    } else {
        r.problems
            .push("weights not checked: the inventory is missing or corrupted".into());
    }
    r
}

/// Merge helper for callers.
pub fn merge(a: &mut CheckReport, b: CheckReport) {
    a.merge(b);
}
