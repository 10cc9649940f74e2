//! `cargo xtask synth-layout`: the real K3 release layout at full scale, as sparse files.
//!
//! The model root it writes has the release's 96 shards
//! (`model-000NN-of-000096.safetensors`) with valid safetensors headers for every tensor of
//! the real weight index (text, `mm_projector` and `vision_tower`), each shard extended to its
//! full size with the data left as holes: 1,560,860,324,864 bytes of tensors (1.42 TiB) that
//! take almost no disk. Beside them: the real `config.json`, the real
//! `model.safetensors.index.json` (byte for byte), the tokenizer files and a
//! `generation_config.json`. It is a test bed for everything that depends on sizes and names,
//! not on values (opening, validation, memory planning, loading, streaming): every weight
//! reads as zero.
//!
//! Names and shard files come from the real index (`assets/kimi/k3-model.safetensors.index.json.gz`),
//! shapes and dtypes from the real config through the inventory (docs/K3.md §3.1–§3.4);
//! the two must agree entry for entry, and the tensor bytes must add up to the index's
//! `metadata.total_size`, or nothing is written. Inside a shard tensors follow the reference
//! serializer's order, as in the release (docs/K3.md §3.1).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use deltafin_k3::config::K3Config;
use deltafin_k3::model::inventory::{self, TensorSpec};
use deltafin_k3::weights::checkpoint::{CONFIG_FILE, INDEX_FILE};
use deltafin_tensor::{SafetensorsWriter, TensorEntry};
use serde_json::Value;

/// The real weight index, gzipped, in `assets/kimi`.
pub const INDEX_GZ: &str = "k3-model.safetensors.index.json.gz";
/// The real `config.json` in `assets/kimi`.
pub const CONFIG_ASSET: &str = "k3-config.json";
/// Tokenizer files copied from `assets/kimi` unchanged.
pub const TOKENIZER_FILES: [&str; 2] = ["tiktoken.model", "tokenizer_config.json"];

/// `assets/kimi` of this source tree.
pub fn default_assets_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/kimi"))
}

/// One shard to write: its file name and the header writer for its tensors.
pub struct ShardPlan {
    pub file: String,
    pub writer: SafetensorsWriter,
}

/// Everything the layout holds, built in memory (no file is written).
pub struct LayoutPlan {
    /// The real `config.json`, verbatim.
    pub config_text: String,
    pub config: K3Config,
    /// The real `model.safetensors.index.json`, verbatim.
    pub index_text: String,
    /// `metadata.total_size` of the index.
    pub total_size: u64,
    /// Shards in file order.
    pub shards: Vec<ShardPlan>,
}

impl LayoutPlan {
    /// Sum of every shard's tensor bytes.
    pub fn tensor_bytes(&self) -> Result<u64> {
        self.shards.iter().try_fold(0u64, |acc, s| {
            acc.checked_add(s.writer.data_size())
                .context("tensor bytes overflow u64")
        })
    }

    /// Number of tensors over all shards.
    pub fn tensor_count(&self) -> usize {
        self.shards.iter().map(|s| s.writer.entries().len()).sum()
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The decompressed real index of `assets`.
fn read_index_gz(path: &Path) -> Result<String> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .with_context(|| format!("{} is not gzipped UTF-8 text", path.display()))?;
    Ok(text)
}

/// Build the plan from the real config and index in `assets`, checking that the index's
/// entries are exactly the inventory's (names and shard files) and that the tensor bytes
/// equal its `metadata.total_size`.
pub fn plan(assets: &Path) -> Result<LayoutPlan> {
    let config_path = assets.join(CONFIG_ASSET);
    let config_text = read_text(&config_path)?;
    let config = K3Config::from_json_str(&config_text)
        .with_context(|| format!("{} is not a K3 config", config_path.display()))?;
    let index_path = assets.join(INDEX_GZ);
    let index_text = read_index_gz(&index_path)?;
    let index: Value = serde_json::from_str(&index_text)
        .with_context(|| format!("{} is not JSON", index_path.display()))?;
    let weight_map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("{}: no `weight_map` object", index_path.display()))?;
    let total_size = index
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(Value::as_u64)
        .with_context(|| format!("{}: no integer `metadata.total_size`", index_path.display()))?;

    let n_shards = inventory::shard_count(&config);
    let mut specs = inventory::text_inventory(&config);
    specs.extend(inventory::vision_inventory(&config));
    ensure!(
        specs.len() == weight_map.len(),
        "the inventory of {} has {} tensors, the real index {}",
        config_path.display(),
        specs.len(),
        weight_map.len()
    );
    let mut by_shard: BTreeMap<usize, Vec<&TensorSpec>> = BTreeMap::new();
    for t in &specs {
        let want = inventory::shard_file_name(t.shard, n_shards);
        match weight_map.get(&t.name).and_then(Value::as_str) {
            Some(f) if f == want => {}
            Some(f) => bail!(
                "tensor `{}`: the real index puts it in {f}, the inventory in {want}",
                t.name
            ),
            None => bail!(
                "tensor `{}` of the inventory is not in the real index",
                t.name
            ),
        }
        by_shard.entry(t.shard).or_default().push(t);
    }
    let shards: Vec<ShardPlan> = (1..=n_shards)
        .map(|s| {
            let entries = by_shard
                .get(&s)
                .map(|v| {
                    v.iter()
                        .map(|t| TensorEntry {
                            name: t.name.clone(),
                            dtype: t.dtype,
                            shape: t.shape.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            ShardPlan {
                file: inventory::shard_file_name(s, n_shards),
                writer: SafetensorsWriter::new(entries).with_metadata("format", "pt"),
            }
        })
        .collect();
    let plan = LayoutPlan {
        config_text,
        config,
        index_text,
        total_size,
        shards,
    };
    let bytes = plan.tensor_bytes()?;
    ensure!(
        bytes == total_size,
        "the shapes of the inventory give {bytes} tensor bytes, the real index's metadata.total_size is {total_size}"
    );
    Ok(plan)
}

/// What [`write`] wrote.
#[derive(Debug)]
pub struct LayoutReport {
    pub shards: usize,
    pub tensors: usize,
    /// Apparent bytes of the shards (headers and holes).
    pub shard_bytes: u64,
    /// Bytes the shards occupy on disk (allocated blocks).
    pub shard_disk_bytes: u64,
    pub tensor_bytes: u64,
}

/// Bytes of disk `meta`'s file occupies (allocated 512-byte blocks).
fn disk_bytes(meta: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    meta.blocks().saturating_mul(512)
}

/// Write one shard: the 8-byte header length, the header, then a hole up to the full size.
/// Fails (and removes the file) when the filesystem allocated the hole.
fn write_sparse_shard(path: &Path, writer: &SafetensorsWriter) -> Result<(u64, u64)> {
    let header = writer.header();
    let size = writer.file_size();
    let mut f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|_| f.write_all(&header))
        .and_then(|_| f.set_len(size))
        .with_context(|| format!("cannot write {}", path.display()))?;
    let meta = f
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?;
    let disk = disk_bytes(&meta);
    // The header plus a few blocks of slack: anything more means the data was allocated.
    let allowed = 8 + header.len() as u64 + (1 << 20);
    if disk > allowed {
        drop(f);
        let _ = std::fs::remove_file(path);
        bail!(
            "{}: the filesystem allocated {disk} bytes for a {size}-byte sparse shard (it does not keep holes); choose a directory on ext4, xfs, btrfs, tmpfs or APFS",
            path.display()
        );
    }
    Ok((size, disk))
}

/// Write the layout of `plan` into `out` (created if needed). Existing files of the same
/// names are replaced; `progress` gets one line per shard.
pub fn write(
    out: &Path,
    plan: &LayoutPlan,
    assets: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LayoutReport> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut report = LayoutReport {
        shards: 0,
        tensors: 0,
        shard_bytes: 0,
        shard_disk_bytes: 0,
        tensor_bytes: plan.tensor_bytes()?,
    };
    for s in &plan.shards {
        let (size, disk) = write_sparse_shard(&out.join(&s.file), &s.writer)?;
        report.shards += 1;
        report.tensors += s.writer.entries().len();
        report.shard_bytes += size;
        report.shard_disk_bytes += disk;
        progress(&format!(
            "{}: {} tensors, {size} bytes ({disk} on disk)",
            s.file,
            s.writer.entries().len()
        ));
    }
    let write_file = |name: &str, bytes: &[u8]| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, bytes).with_context(|| format!("cannot write {}", p.display()))
    };
    write_file(CONFIG_FILE, plan.config_text.as_bytes())?;
    write_file(INDEX_FILE, plan.index_text.as_bytes())?;
    for f in TOKENIZER_FILES {
        let src = assets.join(f);
        let dst = out.join(f);
        std::fs::copy(&src, &dst)
            .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
    }
    let cfg = &plan.config;
    let generation = serde_json::json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    });
    let mut text = serde_json::to_string_pretty(&generation)?;
    text.push('\n');
    write_file("generation_config.json", text.as_bytes())?;
    progress("config.json, model.safetensors.index.json, tokenizer and generation config written");
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_k3::weights::checkpoint::Checkpoint;
    use std::collections::HashMap;

    /// Shard file → tensor names, as the layout's index lists them (for checks).
    fn index_shards(index_text: &str) -> Result<HashMap<String, Vec<String>>> {
        let v: Value = serde_json::from_str(index_text)?;
        let wm = v
            .get("weight_map")
            .and_then(Value::as_object)
            .context("no weight_map")?;
        let mut out: HashMap<String, Vec<String>> = HashMap::new();
        for (name, f) in wm {
            let f = f.as_str().context("a weight_map value is not a string")?;
            out.entry(f.to_string()).or_default().push(name.clone());
        }
        Ok(out)
    }

    /// The headers of the real layout, in memory: every tensor of the real index in the shard
    /// it names, and 1,560,860,324,864 bytes of tensors in all.
    #[test]
    fn the_plan_holds_the_real_index_and_its_total_size() {
        let plan = plan(&default_assets_dir()).unwrap();
        assert_eq!(plan.shards.len(), 96);
        assert_eq!(plan.total_size, 1_560_860_324_864);
        assert_eq!(plan.tensor_bytes().unwrap(), 1_560_860_324_864);
        assert_eq!(plan.tensor_count(), 497_220);
        let listed = index_shards(&plan.index_text).unwrap();
        for s in &plan.shards {
            let mut want = listed.get(&s.file).cloned().unwrap_or_default();
            let mut got: Vec<String> = s.writer.entries().iter().map(|e| e.name.clone()).collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{}", s.file);
        }
        // The vision tower and projector are in their own shards, with the real counts.
        let vision = &plan.shards[95];
        assert_eq!(vision.file, "model-00096-of-000096.safetensors");
        assert_eq!(vision.writer.entries().len(), 165);
        assert_eq!(vision.writer.data_size(), 802_428_928);
        assert_eq!(plan.shards[94].writer.entries().len(), 3);
        // The real index names lm_head and the embedding in shard 94.
        assert!(
            plan.shards[93]
                .writer
                .entries()
                .iter()
                .any(|e| e.name == "language_model.lm_head.weight")
        );
    }

    /// A config whose shapes disagree with the index is refused before anything is written.
    #[test]
    fn a_config_that_does_not_give_the_index_is_refused() {
        let assets = default_assets_dir();
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(assets.join(INDEX_GZ), dir.path().join(INDEX_GZ)).unwrap();
        let text = read_text(&assets.join(CONFIG_ASSET)).unwrap();
        let changed = text.replacen(
            "\"moe_intermediate_size\": 3072",
            "\"moe_intermediate_size\": 3104",
            1,
        );
        assert_ne!(
            changed, text,
            "the real config states moe_intermediate_size 3072"
        );
        std::fs::write(dir.path().join(CONFIG_ASSET), changed).unwrap();
        let e = plan(dir.path()).err().unwrap().to_string();
        assert!(e.contains("total_size is 1560860324864"), "{e}");
    }

    /// The layout on disk: sparse shards whose headers parse, opened and validated by the
    /// checkpoint like the release (every tensor's dtype and shape, the total size).
    #[test]
    fn the_written_layout_opens_as_a_checkpoint_and_takes_little_disk() {
        let assets = default_assets_dir();
        let plan = plan(&assets).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let r = write(dir.path(), &plan, &assets, &mut |_| {}).unwrap();
        assert_eq!((r.shards, r.tensors), (96, 497_220));
        assert_eq!(r.tensor_bytes, 1_560_860_324_864);
        assert!(r.shard_bytes > r.tensor_bytes);
        assert!(
            r.shard_disk_bytes < 200 << 20,
            "{} bytes on disk",
            r.shard_disk_bytes
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.vision_tensor_count(), 165);
        assert_eq!(ck.projector_tensor_count(), 3);
        assert_eq!(ck.shard_paths().len(), 96);
        assert_eq!(
            std::fs::read(dir.path().join(CONFIG_FILE)).unwrap(),
            std::fs::read(assets.join(CONFIG_ASSET)).unwrap()
        );
    }
}
