//! Install plans: what each step downloads, where it goes and how much disk it needs.
//!
//! [`plan_setup`] needs no network: sizes come from the manifests, and the exact shard sizes
//! from the local inventory when `setup-k3` has already run (otherwise the estimate of the
//! manifest, flagged `≈`); the plan ends with the row-int8 spine `setup` converts locally.
//! [`weight_jobs`] turns a weight selection into transfer jobs; it needs the inventory
//! (exact tensor offsets).

use crate::error::FetchError;
use crate::inventory::{INVENTORY_PATH, Inventory};
use crate::manifest::{K3Manifest, Manifests, RepoManifest};
use crate::transfer::{Job, is_complete};
use deltafin_k3::config::{K3Config, REAL_CONFIG_JSON};
use deltafin_k3::weights::spine_int8::{INT8_DIR, Int8Spine, SpineFormat, quantized_tensors};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Directory of the BF16 spine, one raw file per tensor.
pub const SPINE_DIR: &str = "k3-resident/tensors";
/// Directory of per-expert files `L{layer}-E{expert}.bin`.
pub const EXPERT_DIR: &str = "k3-experts";
/// Headroom kept free when `setup` chooses full mode (contract §5.2).
pub const FULL_HEADROOM: u64 = 100_000_000_000;
/// The plan step of the row-int8 spine `setup` converts last (written locally, no download).
pub const INT8_STEP: &str = "int8";

/// `bytes` for people, in decimal units: `121.70 GB`, `59.8 MB`, `3.1 kB`, `53 B`.
pub fn size_text(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}

/// Full (all shards) or stream (spine only, experts on demand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Full,
    Stream,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Stream => "stream",
        }
    }
}

/// Which weights to transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The release shards, whole (full install).
    Shards,
    /// Every non-expert tensor as `k3-resident/tensors/<name>` (stream install).
    Spine,
    /// Per-expert files of these MoE layers.
    Experts(Vec<usize>),
}

/// One line of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanItem {
    /// Step: `k3-meta`, `inventory`, `dspark`, `qwen`, `weights`.
    pub step: &'static str,
    /// Destination, relative to the model root.
    pub dest: String,
    /// Bytes of the result.
    pub bytes: u64,
    /// Tensor data bytes for weight items (the part fixed by the index).
    pub data_bytes: Option<u64>,
    /// Whether `bytes` is exact (false: header length estimated).
    pub exact: bool,
    /// Already complete on disk.
    pub present: bool,
}

/// A whole plan.
#[derive(Clone, Debug)]
pub struct Plan {
    pub mode: Mode,
    pub items: Vec<PlanItem>,
}

impl Plan {
    /// Bytes of the items still to make, downloaded (`convert` false) or converted locally.
    fn missing_bytes(&self, convert: bool) -> u64 {
        self.items
            .iter()
            .filter(|i| !i.present && (i.step == INT8_STEP) == convert)
            .map(|i| i.bytes)
            .sum()
    }

    /// Bytes still to download (items not present).
    pub fn download_bytes(&self) -> u64 {
        self.missing_bytes(false)
    }

    /// Bytes the row-int8 spine conversion still writes (no network).
    pub fn convert_bytes(&self) -> u64 {
        self.missing_bytes(true)
    }

    /// Peak additional disk use: every missing byte lands once (`.part` files are renamed,
    /// never copied), so the peak is the download plus the int8 spine written after it.
    pub fn peak_additional_bytes(&self) -> u64 {
        self.download_bytes().saturating_add(self.convert_bytes())
    }

    /// Sum of the tensor data bytes of the weight items.
    pub fn weight_data_bytes(&self) -> u64 {
        self.items.iter().filter_map(|i| i.data_bytes).sum()
    }

    /// Whether every size is exact.
    pub fn exact(&self) -> bool {
        self.items.iter().all(|i| i.exact)
    }

    /// Whether the sizes of the downloads are exact (shard headers known).
    pub fn download_exact(&self) -> bool {
        self.items.iter().all(|i| i.exact || i.step == INT8_STEP)
    }

    /// Whether the size of the row-int8 spine is exact (its `config.json` known).
    pub fn convert_exact(&self) -> bool {
        self.items.iter().all(|i| i.exact || i.step != INT8_STEP)
    }
}

fn repo_items(root: &Path, m: &RepoManifest, step: &'static str, out: &mut Vec<PlanItem>) {
    for f in &m.files {
        let dest = format!("{}/{}", m.install_dir, f.path);
        out.push(PlanItem {
            step,
            present: is_complete(&root.join(&dest), f.size),
            dest,
            bytes: f.size,
            data_bytes: None,
            exact: true,
        });
    }
}

/// The plan of `setup` (no network, no writes): metadata, inventory, DSpark, optional Qwen,
/// then the weights of `mode`.
pub fn plan_setup(root: &Path, ms: &Manifests, mode: Mode, include_qwen: bool) -> Plan {
    let m = &ms.k3;
    let mut items = Vec::new();
    for f in &m.metadata {
        items.push(PlanItem {
            step: "k3-meta",
            dest: f.path.clone(),
            bytes: f.size,
            data_bytes: None,
            exact: true,
            present: is_complete(&root.join(&f.path), f.size),
        });
    }
    let inv = Inventory::load(root, &m.inventory).ok();
    items.push(PlanItem {
        step: "inventory",
        dest: INVENTORY_PATH.into(),
        bytes: m.inventory.size,
        data_bytes: None,
        exact: true,
        present: inv.is_some(),
    });
    repo_items(root, &ms.dspark, "dspark", &mut items);
    if include_qwen {
        repo_items(root, &ms.qwen_large, "qwen", &mut items);
        repo_items(root, &ms.qwen_small, "qwen", &mut items);
    }
    items.extend(weight_items(root, m, inv.as_ref(), mode));
    items.push(int8_item(root, m));
    Plan { mode, items }
}

/// The row-int8 spine `setup` ends with (`convert-spine-int8`, docs/K3.md §12.6): the codes
/// and f16 row scales of every quantized spine matrix of `config.json` (the installed one
/// when it is complete, else the pinned one when it is the released configuration built into
/// the runtime); without either, estimated as half the BF16 spine of the manifest.
fn int8_item(root: &Path, m: &K3Manifest) -> PlanItem {
    let pinned = m.metadata.iter().find(|f| f.path == "config.json");
    let local = pinned
        .filter(|f| is_complete(&root.join(&f.path), f.size))
        .and_then(|f| K3Config::from_file(root.join(&f.path)).ok());
    let real = || {
        let sha = hex::encode(Sha256::digest(REAL_CONFIG_JSON.as_bytes()));
        pinned
            .filter(|f| f.sha256.as_deref() == Some(sha.as_str()))
            .and_then(|_| K3Config::from_json_str(REAL_CONFIG_JSON).ok())
    };
    let dest = format!("{INT8_DIR}/tensors/ (row-int8 spine, converted locally)");
    let Some(cfg) = local.or_else(real) else {
        let bf16: u64 = m.shards.iter().map(|s| s.spine_bytes()).sum();
        return PlanItem {
            step: INT8_STEP,
            dest,
            bytes: bf16.div_ceil(2),
            data_bytes: None,
            exact: false,
            present: false,
        };
    };
    // The planner's formula: the spine in int8 of a spine that is only the quantized
    // matrices in BF16 is their codes and scales.
    let quantized: u64 = quantized_tensors(&cfg)
        .iter()
        .map(|t| t.byte_len() as u64)
        .sum();
    PlanItem {
        step: INT8_STEP,
        dest,
        bytes: deltafin_k3::engine::plan::spine_bytes_in_format(&cfg, SpineFormat::Int8, quantized),
        data_bytes: None,
        exact: true,
        present: Int8Spine::open(root, &cfg).is_ok(),
    }
}

/// Weight lines of a plan, per shard.
pub fn weight_items(
    root: &Path,
    m: &K3Manifest,
    inv: Option<&Inventory>,
    mode: Mode,
) -> Vec<PlanItem> {
    let mut items = Vec::new();
    for s in &m.shards {
        let (size, exact) = match inv.and_then(|i| i.hlen(&s.file)) {
            Some(h) => (8 + h + s.data_bytes, true),
            None => s.file_size(),
        };
        match mode {
            Mode::Full => items.push(PlanItem {
                step: "weights",
                present: exact && is_complete(&root.join(&s.file), size),
                dest: s.file.clone(),
                bytes: size,
                data_bytes: Some(s.data_bytes),
                exact,
            }),
            Mode::Stream => {
                let present = inv.is_some_and(|i| {
                    i.records()
                        .iter()
                        .filter(|r| r.shard == s.file && !r.is_expert())
                        .all(|r| is_complete(&root.join(SPINE_DIR).join(&r.name), r.end - r.start))
                });
                items.push(PlanItem {
                    step: "weights",
                    dest: format!("{SPINE_DIR}/ (spine of {})", s.file),
                    bytes: s.spine_bytes(),
                    data_bytes: Some(s.spine_bytes()),
                    exact: true,
                    present,
                });
            }
        }
    }
    items
}

/// Path of the per-expert file.
pub fn expert_path(root: &Path, layer: usize, expert: usize) -> PathBuf {
    root.join(EXPERT_DIR)
        .join(format!("L{layer}-E{expert}.bin"))
}

/// The six tensor names of one expert in the span order (w1 packed, w1 scale, w2 packed,
/// w2 scale, w3 packed, w3 scale; docs/K3.md §3.4).
pub fn expert_tensor_names(layer: usize, expert: usize) -> [String; 6] {
    let n = |m: &str, p: &str| {
        format!(
            "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{m}.weight_{p}"
        )
    };
    [
        n("w1", "packed"),
        n("w1", "scale"),
        n("w2", "packed"),
        n("w2", "scale"),
        n("w3", "packed"),
        n("w3", "scale"),
    ]
}

/// `(shard, absolute offset, length)` of one expert: its six tensors must be in one shard,
/// adjacent in the span order, and add up to the manifest's expert size.
pub fn expert_span(
    m: &K3Manifest,
    inv: &Inventory,
    layer: usize,
    expert: usize,
) -> Result<(String, u64, u64), FetchError> {
    if m.shard_of_layer(layer).is_none() || expert >= m.experts_per_layer {
        return Err(FetchError::Invalid(format!(
            "expert L{layer}-E{expert} does not exist (MoE layers {:?}, {} experts each)",
            crate::layers::format_layers(&m.moe_layers()),
            m.experts_per_layer
        )));
    }
    let names = expert_tensor_names(layer, expert);
    let mut recs = Vec::with_capacity(6);
    for n in &names {
        recs.push(
            inv.get(n)
                .ok_or_else(|| FetchError::Inventory(format!("{n} is not in the inventory")))?,
        );
    }
    for w in recs.windows(2) {
        if w[0].shard != w[1].shard || w[0].end != w[1].start {
            return Err(FetchError::Inventory(format!(
                "{} and {} are not adjacent in one shard",
                w[0].name, w[1].name
            )));
        }
    }
    let (a, _) = recs[0].file_range();
    let (_, b) = recs[5].file_range();
    if b - a != m.expert_bytes {
        return Err(FetchError::Inventory(format!(
            "expert L{layer}-E{expert} spans {} bytes, expected {}",
            b - a,
            m.expert_bytes
        )));
    }
    Ok((recs[0].shard.clone(), a, b - a))
}

/// Transfer jobs for `sel`.
pub fn weight_jobs(
    root: &Path,
    m: &K3Manifest,
    inv: &Inventory,
    sel: &Selection,
) -> Result<Vec<Job>, FetchError> {
    let job = |file: &str, range, dest, size, sha256| Job {
        repo: m.repo.clone(),
        revision: m.revision.clone(),
        file: file.to_string(),
        range,
        dest,
        size,
        sha256,
    };
    let mut jobs = Vec::new();
    match sel {
        Selection::Shards => {
            for s in &m.shards {
                let h = inv
                    .hlen(&s.file)
                    .ok_or_else(|| FetchError::Inventory(format!("{} has no records", s.file)))?;
                jobs.push(job(
                    &s.file,
                    None,
                    root.join(&s.file),
                    8 + h + s.data_bytes,
                    s.sha256.clone(),
                ));
            }
        }
        Selection::Spine => {
            for r in inv.records().iter().filter(|r| !r.is_expert()) {
                crate::manifest::check_path(&r.name).map_err(FetchError::Inventory)?;
                let (a, b) = r.file_range();
                jobs.push(job(
                    &r.shard,
                    Some((a, b - a)),
                    root.join(SPINE_DIR).join(&r.name),
                    b - a,
                    None,
                ));
            }
        }
        Selection::Experts(layers) => {
            for &l in layers {
                for e in 0..m.experts_per_layer {
                    let (shard, a, n) = expert_span(m, inv, l, e)?;
                    jobs.push(job(&shard, Some((a, n)), expert_path(root, l, e), n, None));
                }
            }
        }
    }
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::size_text;

    #[test]
    fn sizes_read_in_decimal_units() {
        for (bytes, text) in [
            (0, "0 B"),
            (999, "999 B"),
            (1_000, "1.0 kB"),
            (3_065, "3.1 kB"),
            (59_764_096, "59.8 MB"),
            (999_999_999, "1000.0 MB"),
            (1_000_000_000, "1.00 GB"),
            (1_560_860_324_864, "1560.86 GB"),
        ] {
            assert_eq!(size_text(bytes), text, "{bytes}");
        }
    }
}
