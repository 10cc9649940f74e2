//! Committed source manifests: the pinned repository revision and, per file, the size and
//! the sha256 where it is known.
//!
//! The built-in manifests live in `crates/deltafin-fetch/manifests/` and are compiled in.
//! `DELTAFIN_MANIFESTS=<dir>` replaces them with the four files of a directory (`k3.json`,
//! `dspark.json`, `qwen3-0.6b-base.json`, `qwen3-1.7b-base.json`), which is how tests point
//! the commands at a synthesized checkpoint.
//!
//! K3 weight shards: the real index gives every tensor's shard, and the config gives every
//! tensor's shape, so each shard's **data** bytes are exact. A shard's file size is
//! `8 + header length + data bytes`; the header length is not pinned, so the manifest carries
//! an estimate (`header_estimate`, the length of a safetensors header written for the same
//! tensors) until the real header is read with a range request (`setup-k3`), after which the
//! exact length comes from the local inventory.

use crate::error::FetchError;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::Path;

/// Environment variable that replaces the built-in manifests with a directory.
pub const MANIFESTS_ENV: &str = "DELTAFIN_MANIFESTS";

/// One pinned file of a repository.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinnedFile {
    /// Path inside the repository (and inside the install directory).
    pub path: String,
    /// Exact size in bytes.
    pub size: u64,
    /// Lowercase hex sha256, where pinned.
    pub sha256: Option<String>,
}

/// A repository installed file by file (DSpark, Qwen3).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepoManifest {
    /// `owner/name` on the hub.
    pub repo: String,
    /// Full 40-hex commit.
    pub revision: String,
    /// Directory under the model root.
    pub install_dir: String,
    /// Every file to install.
    pub files: Vec<PinnedFile>,
    /// Exact safetensors header length (without the 8-byte prefix) of `model.safetensors`,
    /// where pinned.
    pub safetensors_header_len: Option<u64>,
    /// Tensor count of `model.safetensors`, where pinned.
    pub safetensors_tensors: Option<u64>,
}

/// Pin of the generated tensor inventory (`k3-meta/tensor_inventory_offsets.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InventoryPin {
    pub size: u64,
    pub sha256: String,
    pub records: u64,
}

/// One K3 weight shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// `model-NNNNN-of-000096.safetensors`.
    pub file: String,
    /// Tensors in the shard.
    pub tensors: u64,
    /// Exact data-section bytes (sum of tensor bytes).
    pub data_bytes: u64,
    /// Of which routed-expert bytes (0 for non-layer shards).
    pub expert_bytes: u64,
    /// The 0-based MoE layer whose experts the shard holds.
    pub moe_layer: Option<usize>,
    /// Estimated header length (without the 8-byte prefix) when the real one is not pinned.
    pub header_estimate: u64,
    /// Exact header length, where pinned.
    pub header_len: Option<u64>,
    /// Lowercase hex sha256 of the whole shard, where pinned.
    pub sha256: Option<String>,
}

impl ShardEntry {
    /// Non-expert ("spine") bytes: text spine, projector and vision tensors.
    pub fn spine_bytes(&self) -> u64 {
        self.data_bytes - self.expert_bytes
    }

    /// File size `8 + header + data` and whether it is exact (header pinned).
    pub fn file_size(&self) -> (u64, bool) {
        // Validation refuses sizes that overflow; saturate rather than wrap regardless.
        let size = |h: u64| 8u64.saturating_add(h).saturating_add(self.data_bytes);
        match self.header_len {
            Some(h) => (size(h), true),
            None => (size(self.header_estimate), false),
        }
    }
}

/// The K3 source: metadata files, the inventory pin and the shard roster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct K3Manifest {
    pub repo: String,
    pub revision: String,
    /// Pinned metadata files, installed at the model root (`config.json`,
    /// `model.safetensors.index.json`, tokenizer files, …).
    pub metadata: Vec<PinnedFile>,
    /// The generated inventory's pin.
    pub inventory: InventoryPin,
    /// Number of decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Bytes of one routed expert (six tensors).
    pub expert_bytes: u64,
    /// `metadata.total_size` of the index: sum of all tensor bytes.
    pub total_tensor_bytes: u64,
    pub shards: Vec<ShardEntry>,
}

impl K3Manifest {
    /// The MoE layers (0-based ids of shards holding experts), ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.shards.iter().filter_map(|s| s.moe_layer).collect();
        v.sort_unstable();
        v
    }

    /// The shard holding MoE layer `layer`.
    pub fn shard_of_layer(&self, layer: usize) -> Option<&ShardEntry> {
        self.shards.iter().find(|s| s.moe_layer == Some(layer))
    }

    fn validate(&self, name: &str) -> Result<(), FetchError> {
        let bad = FetchError::manifest(name);
        check_repo(&self.repo, &self.revision).map_err(bad)?;
        check_files(&self.metadata).map_err(bad)?;
        check_sha(&self.inventory.sha256).map_err(|m| bad(format!("inventory: {m}")))?;
        let mut seen = HashSet::new();
        let mut total = 0u64;
        for s in &self.shards {
            check_path(&s.file).map_err(bad)?;
            if !seen.insert(&s.file) {
                return Err(bad(format!("shard {} listed twice", s.file)));
            }
            if s.expert_bytes > s.data_bytes {
                return Err(bad(format!("shard {}: expert_bytes > data_bytes", s.file)));
            }
            if let Some(h) = &s.sha256 {
                check_sha(h).map_err(|m| bad(format!("shard {}: {m}", s.file)))?;
            }
            // Sizes come from a file (DELTAFIN_MANIFESTS may name any): nothing derived
            // from them may overflow.
            let sizes = [s.header_len.unwrap_or(0), s.header_estimate];
            if sizes.iter().any(|h| {
                8u64.checked_add(*h)
                    .and_then(|x| x.checked_add(s.data_bytes))
                    .is_none()
            }) {
                return Err(bad(format!("shard {}: the file size overflows", s.file)));
            }
            if let Some(l) = s.moe_layer {
                let per = self
                    .expert_bytes
                    .checked_mul(self.experts_per_layer as u64)
                    .ok_or_else(|| {
                        bad(format!(
                            "{} experts x {} B overflows",
                            self.experts_per_layer, self.expert_bytes
                        ))
                    })?;
                if s.expert_bytes != per {
                    return Err(bad(format!(
                        "shard {}: layer {l} expert bytes {} != {} experts x {} B",
                        s.file, s.expert_bytes, self.experts_per_layer, self.expert_bytes
                    )));
                }
            } else if s.expert_bytes != 0 {
                return Err(bad(format!("shard {}: experts without a layer", s.file)));
            }
            total = total
                .checked_add(s.data_bytes)
                .ok_or_else(|| bad("the shards' data bytes overflow when added up".into()))?;
        }
        if total != self.total_tensor_bytes {
            return Err(bad(format!(
                "shard data bytes add up to {total}, but total_tensor_bytes is {}",
                self.total_tensor_bytes
            )));
        }
        Ok(())
    }
}

fn check_repo(repo: &str, rev: &str) -> Result<(), String> {
    let ok_part = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && p != "."
            && p != ".."
    };
    match repo.split_once('/') {
        Some((a, b)) if ok_part(a) && ok_part(b) => {}
        _ => return Err(format!("repo {repo:?} is not owner/name")),
    }
    if rev.len() != 40
        || !rev
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    {
        return Err(format!("revision {rev:?} is not a 40-hex commit"));
    }
    Ok(())
}

/// A relative path of safe components (`[A-Za-z0-9._-]`, no `.`/`..`).
pub fn check_path(p: &str) -> Result<(), String> {
    let ok = !p.is_empty()
        && p.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.'))
        });
    if ok {
        Ok(())
    } else {
        Err(format!("path {p:?} is not a safe relative path"))
    }
}

fn check_sha(h: &str) -> Result<(), String> {
    if h.len() == 64
        && h.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    {
        Ok(())
    } else {
        Err(format!("sha256 {h:?} is not 64 lowercase hex digits"))
    }
}

fn check_files(files: &[PinnedFile]) -> Result<(), String> {
    let mut seen = HashSet::new();
    for f in files {
        check_path(&f.path)?;
        if !seen.insert(&f.path) {
            return Err(format!("file {} listed twice", f.path));
        }
        if let Some(h) = &f.sha256 {
            check_sha(h).map_err(|m| format!("{}: {m}", f.path))?;
        }
    }
    Ok(())
}

impl RepoManifest {
    fn validate(&self, name: &str) -> Result<(), FetchError> {
        let bad = FetchError::manifest(name);
        check_repo(&self.repo, &self.revision).map_err(bad)?;
        check_path(&self.install_dir).map_err(bad)?;
        check_files(&self.files).map_err(bad)
    }
}

/// The four sources.
#[derive(Clone, Debug)]
pub struct Manifests {
    pub k3: K3Manifest,
    pub dspark: RepoManifest,
    /// Qwen3-0.6B-Base.
    pub qwen_small: RepoManifest,
    /// Qwen3-1.7B-Base.
    pub qwen_large: RepoManifest,
}

/// File names of the four manifests (built-in and in a `DELTAFIN_MANIFESTS` directory).
pub const MANIFEST_FILES: [&str; 4] = [
    "k3.json",
    "dspark.json",
    "qwen3-0.6b-base.json",
    "qwen3-1.7b-base.json",
];

const BUILTIN: [&str; 4] = [
    include_str!("../manifests/k3.json"),
    include_str!("../manifests/dspark.json"),
    include_str!("../manifests/qwen3-0.6b-base.json"),
    include_str!("../manifests/qwen3-1.7b-base.json"),
];

fn parse<T: for<'de> Deserialize<'de>>(name: &str, text: &str) -> Result<T, FetchError> {
    serde_json::from_str(text).map_err(|e| FetchError::manifest(name)(e.to_string()))
}

impl Manifests {
    /// The compiled-in manifests of the real sources.
    pub fn builtin() -> Result<Manifests, FetchError> {
        Self::from_texts(
            &MANIFEST_FILES.map(|n| format!("built-in {n}")),
            &BUILTIN.map(str::to_string),
        )
    }

    /// Read the four manifests from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Manifests, FetchError> {
        let mut texts = Vec::new();
        let mut names = Vec::new();
        for n in MANIFEST_FILES {
            let p = dir.join(n);
            texts.push(std::fs::read_to_string(&p).map_err(FetchError::io(&p))?);
            names.push(p.display().to_string());
        }
        Self::from_texts(
            &[
                names[0].clone(),
                names[1].clone(),
                names[2].clone(),
                names[3].clone(),
            ],
            &[
                texts[0].clone(),
                texts[1].clone(),
                texts[2].clone(),
                texts[3].clone(),
            ],
        )
    }

    /// `DELTAFIN_MANIFESTS` when set (non-empty), else the built-in manifests.
    pub fn from_env() -> Result<Manifests, FetchError> {
        match std::env::var_os(MANIFESTS_ENV) {
            Some(d) if !d.is_empty() => Self::from_dir(Path::new(&d)),
            _ => Self::builtin(),
        }
    }

    fn from_texts(names: &[String; 4], texts: &[String; 4]) -> Result<Manifests, FetchError> {
        let k3: K3Manifest = parse(&names[0], &texts[0])?;
        k3.validate(&names[0])?;
        let mut repos = Vec::new();
        for i in 1..4 {
            let m: RepoManifest = parse(&names[i], &texts[i])?;
            m.validate(&names[i])?;
            repos.push(m);
        }
        let mut it = repos.into_iter();
        let (Some(dspark), Some(qwen_small), Some(qwen_large)) = (it.next(), it.next(), it.next())
        else {
            unreachable!("three repository manifests were parsed")
        };
        Ok(Manifests {
            k3,
            dspark,
            qwen_small,
            qwen_large,
        })
    }

    /// Write the four manifests into `dir` (pretty JSON), e.g. for a synthesized source.
    pub fn write_dir(&self, dir: &Path) -> Result<(), FetchError> {
        std::fs::create_dir_all(dir).map_err(FetchError::io(dir))?;
        let texts = [
            serde_json::to_string_pretty(&self.k3),
            serde_json::to_string_pretty(&self.dspark),
            serde_json::to_string_pretty(&self.qwen_small),
            serde_json::to_string_pretty(&self.qwen_large),
        ];
        for (n, t) in MANIFEST_FILES.iter().zip(texts) {
            let p = dir.join(n);
            let t = t.map_err(|e| FetchError::manifest(n)(e.to_string()))?;
            std::fs::write(&p, t + "\n").map_err(FetchError::io(&p))?;
        }
        Ok(())
    }
}

/// Build the K3 manifest from the config and the release index (`weight_map`,
/// `metadata.total_size`): every tensor the config implies must be mapped to the shard the
/// release layout puts it in, and nothing else may be mapped. Shard sha256 and exact header
/// lengths are left unpinned.
pub fn k3_manifest_from_index(
    cfg: &deltafin_k3::config::K3Config,
    index: &serde_json::Value,
    repo: &str,
    revision: &str,
    metadata: Vec<PinnedFile>,
    inventory: InventoryPin,
) -> Result<K3Manifest, FetchError> {
    use deltafin_k3::model::inventory::{self as inv, TensorKind};
    let bad = FetchError::manifest("model.safetensors.index.json");
    let map = index
        .get("weight_map")
        .and_then(|v| v.as_object())
        .ok_or_else(|| bad("no weight_map object".into()))?;
    let total = index
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(|v| v.as_u64())
        .ok_or_else(|| bad("no metadata.total_size".into()))?;
    let mut all = inv::text_inventory(cfg);
    all.extend(inv::vision_inventory(cfg));
    if all.len() != map.len() {
        return Err(bad(format!(
            "the index maps {} tensors, the config implies {}",
            map.len(),
            all.len()
        )));
    }
    let n = inv::shard_count(cfg);
    let mut shards = Vec::with_capacity(n);
    for i in 1..=n {
        let file = inv::shard_file_name(i, n);
        let mut specs: Vec<inv::TensorSpec> =
            all.iter().filter(|t| t.shard == i).cloned().collect();
        let mut layer = None;
        let (mut data, mut experts) = (0u64, 0u64);
        for t in &specs {
            match map.get(&t.name).and_then(|v| v.as_str()) {
                Some(f) if f == file => {}
                Some(f) => {
                    return Err(bad(format!("{} is in {f}, expected {file}", t.name)));
                }
                None => return Err(bad(format!("{} is missing", t.name))),
            }
            data += t.byte_len() as u64;
            if let TensorKind::Expert { layer: l, .. } = t.kind {
                experts += t.byte_len() as u64;
                if layer.is_some_and(|x| x != l) {
                    return Err(bad(format!("{file} holds experts of two layers")));
                }
                layer = Some(l);
            }
        }
        inv::sort_shard(&mut specs);
        let writer = deltafin_tensor::safetensors::SafetensorsWriter::new(
            specs
                .iter()
                .map(|s| deltafin_tensor::safetensors::TensorEntry {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                })
                .collect(),
        )
        .with_metadata("format", "pt");
        shards.push(ShardEntry {
            file,
            tensors: specs.len() as u64,
            data_bytes: data,
            expert_bytes: experts,
            moe_layer: layer,
            header_estimate: writer.header().len() as u64,
            header_len: None,
            sha256: None,
        });
    }
    let sum: u64 = shards.iter().map(|s| s.data_bytes).sum();
    if sum != total {
        return Err(bad(format!(
            "tensor bytes from the config add up to {sum}, metadata.total_size is {total}"
        )));
    }
    let t = &cfg.text;
    let one = inv::expert_layout(cfg, 1.min(cfg.n_layers() - 1), 0).total_bytes() as u64;
    let m = K3Manifest {
        repo: repo.to_string(),
        revision: revision.to_string(),
        metadata,
        inventory,
        layers: cfg.n_layers(),
        experts_per_layer: t.num_experts,
        expert_bytes: one,
        total_tensor_bytes: total,
        shards,
    };
    m.validate("generated K3 manifest")?;
    Ok(m)
}
