//! [`Checkpoint::open`]: reading `config.json` and the index, mapping the shards (or a stream
//! install's per-tensor files) and validating every tensor of the inventory.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use deltafin_tensor::{Bytes, SafetensorsFile, TensorError};
use serde_json::Value;

use crate::config::K3Config;
use crate::inventory::{self, PREFIX, TensorSpec};

use super::*;

impl Checkpoint {
    /// Open and fully validate the install under `model_root`, in either [`Layout`]
    /// (detected with [`Layout::detect`]).
    pub fn open(model_root: &Path) -> Result<Checkpoint, CheckpointError> {
        let root = model_root.to_path_buf();
        let config_path = root.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(CheckpointError::MissingFile {
                root,
                file: CONFIG_FILE,
            });
        }
        let config = K3Config::from_file(&config_path)?;
        if Layout::detect(&root) == Some(Layout::StreamInstall) {
            return Self::open_stream_install(root, config);
        }
        let index_path = root.join(INDEX_FILE);
        if !index_path.is_file() {
            return Err(CheckpointError::MissingFile {
                root,
                file: INDEX_FILE,
            });
        }
        let (weight_map, total_size) = read_index(&index_path)?;

        // Classify the index entries.
        let expected = inventory::text_inventory(&config);
        let expected_names: HashMap<&str, &TensorSpec> =
            expected.iter().map(|t| (t.name.as_str(), t)).collect();
        let (mut vision_tensors, mut projector_tensors) = (0, 0);
        for name in weight_map.keys() {
            if name.starts_with(PREFIX) {
                if !expected_names.contains_key(name.as_str()) {
                    return Err(file_err(
                        &index_path,
                        format!(
                            "unknown text tensor `{name}` (not part of the K3 inventory for this config.json)"
                        ),
                    ));
                }
            } else if name.starts_with("vision_tower.") {
                vision_tensors += 1;
            } else if name.starts_with("mm_projector.") {
                projector_tensors += 1;
            } else {
                return Err(file_err(
                    &index_path,
                    format!(
                        "unexpected tensor `{name}` (neither `language_model.`, `vision_tower.` nor `mm_projector.`)"
                    ),
                ));
            }
        }

        // Open every shard the index names, once.
        let files: BTreeSet<&str> = weight_map.values().map(String::as_str).collect();
        let mut shards = Vec::with_capacity(files.len());
        let mut shard_of_file: HashMap<&str, usize> = HashMap::new();
        for f in files {
            if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
                return Err(file_err(
                    &index_path,
                    format!("shard name {f:?} is not a plain file name"),
                ));
            }
            let path = root.join(f);
            if !path.is_file() {
                let example = weight_map
                    .iter()
                    .find(|(_, v)| v.as_str() == f)
                    .map(|(k, _)| k.as_str())
                    .unwrap_or("");
                return Err(file_err(
                    &index_path,
                    format!(
                        "weight_map names shard `{f}` (e.g. for `{example}`), which does not exist under {}",
                        root.display()
                    ),
                ));
            }
            shard_of_file.insert(f, shards.len());
            shards.push(SafetensorsFile::open(&path)?);
        }

        // Every expected tensor: in the index, in that shard, right dtype and shape.
        let mut locate = HashMap::with_capacity(expected.len());
        for spec in &expected {
            let Some(file) = weight_map.get(&spec.name) else {
                return Err(file_err(
                    &index_path,
                    format!("tensor `{}` is missing from weight_map", spec.name),
                ));
            };
            let si = shard_of_file[file.as_str()];
            let shard = &shards[si];
            let Some(info) = shard.info(&spec.name) else {
                return Err(file_err(
                    shard.path(),
                    format!(
                        "tensor `{}` is listed in {INDEX_FILE} but missing from this shard",
                        spec.name
                    ),
                ));
            };
            if info.dtype != spec.dtype {
                return Err(file_err(
                    shard.path(),
                    format!(
                        "tensor `{}` has dtype {}, expected {}",
                        spec.name, info.dtype, spec.dtype
                    ),
                ));
            }
            if !spec.accepts_shape(&info.shape) {
                return Err(file_err(
                    shard.path(),
                    format!(
                        "tensor `{}` has shape {:?}, expected {}",
                        spec.name,
                        info.shape,
                        spec.expected_shape()
                    ),
                ));
            }
            locate.insert(spec.name.clone(), si);
        }
        // Shard headers must agree with the index (no stale or unlisted tensors).
        let mut total = 0u64;
        for shard in &shards {
            let fname = shard
                .path()
                .file_name()
                .and_then(|s| s.to_str())
                .unwrap_or("");
            for t in shard.tensors() {
                match weight_map.get(&t.name) {
                    Some(f) if f == fname => total += t.byte_len() as u64,
                    Some(f) => {
                        return Err(file_err(
                            shard.path(),
                            format!(
                                "tensor `{}` is also in this shard but {INDEX_FILE} maps it to `{f}`",
                                t.name
                            ),
                        ));
                    }
                    None => {
                        return Err(file_err(
                            shard.path(),
                            format!("tensor `{}` is not listed in {INDEX_FILE}", t.name),
                        ));
                    }
                }
            }
        }
        for (name, f) in &weight_map {
            if !name.starts_with(PREFIX) && shards[shard_of_file[f.as_str()]].info(name).is_none() {
                return Err(file_err(
                    &root.join(f),
                    format!(
                        "tensor `{name}` is listed in {INDEX_FILE} but missing from this shard"
                    ),
                ));
            }
        }
        if let Some(ts) = total_size
            && ts != total
        {
            return Err(file_err(
                &index_path,
                format!("metadata.total_size is {ts} but the shards hold {total} tensor bytes"),
            ));
        }
        Ok(Checkpoint {
            root,
            config,
            store: Store::Shards { shards, locate },
            vision_tensors,
            projector_tensors,
        })
    }

    /// Open a stream install: every non-expert text tensor of the inventory must be a file
    /// `k3-resident/tensors/<full name>` of exactly its byte length; each is mapped whole
    /// (zero-copy). Vision and projector tensor files are counted, anything else is an error.
    fn open_stream_install(root: PathBuf, config: K3Config) -> Result<Checkpoint, CheckpointError> {
        let dir = root.join(SPINE_TENSOR_DIR);
        let expected = inventory::text_inventory(&config);
        let spine: HashMap<&str, &TensorSpec> = expected
            .iter()
            .filter(|t| matches!(t.kind, inventory::TensorKind::Spine { .. }))
            .map(|t| (t.name.as_str(), t))
            .collect();
        let (mut vision_tensors, mut projector_tensors) = (0, 0);
        let listing = std::fs::read_dir(&dir).map_err(|e| file_err(&dir, e.to_string()))?;
        for entry in listing {
            let entry = entry.map_err(|e| file_err(&dir, e.to_string()))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(file_err(&entry.path(), "file name is not UTF-8"));
            };
            if spine.contains_key(name) {
                continue;
            } else if name.starts_with("vision_tower.") {
                vision_tensors += 1;
            } else if name.starts_with("mm_projector.") {
                projector_tensors += 1;
            } else {
                return Err(file_err(
                    &entry.path(),
                    format!(
                        "unexpected file in {SPINE_TENSOR_DIR}/: `{name}` is not a non-expert tensor of the K3 inventory for this config.json (routed experts belong in {EXPERT_DIR}/)"
                    ),
                ));
            }
        }
        let mut files = HashMap::with_capacity(spine.len());
        for spec in expected
            .iter()
            .filter(|t| matches!(t.kind, inventory::TensorKind::Spine { .. }))
        {
            let path = dir.join(&spec.name);
            let len = match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => m.len(),
                Ok(_) => {
                    return Err(file_err(
                        &path,
                        format!("tensor `{}`: not a regular file", spec.name),
                    ));
                }
                Err(e) => {
                    return Err(file_err(
                        &path,
                        format!(
                            "tensor `{}` of the stream-install spine is missing ({e}); rerun `deltafin setup --stream`",
                            spec.name
                        ),
                    ));
                }
            };
            let Some(shape) = stored_file_shape(spec, len) else {
                return Err(file_err(
                    &path,
                    format!(
                        "tensor `{}` is {len} bytes, expected {} ({} {})",
                        spec.name,
                        spec.byte_len(),
                        spec.dtype,
                        spec.expected_shape()
                    ),
                ));
            };
            let bytes = map_file(&path)?;
            files.insert(
                spec.name.clone(),
                TensorFile {
                    path,
                    dtype: spec.dtype,
                    shape,
                    bytes,
                },
            );
        }
        Ok(Checkpoint {
            root,
            config,
            store: Store::Tensors { files },
            vision_tensors,
            projector_tensors,
        })
    }
}

/// The shape of a stream-install tensor file of `len` bytes: the spec's shape when the length
/// is the spec's, else (a zero-padded vector, [`inventory::StoredShape::ZeroPadded`]) the
/// vector of `len / dtype size` entries the spec accepts; `None` when neither fits.
fn stored_file_shape(spec: &TensorSpec, len: u64) -> Option<Vec<usize>> {
    if len == spec.byte_len() as u64 {
        return Some(spec.shape.clone());
    }
    let size = spec.dtype.size() as u64;
    let n = usize::try_from(len / size).ok()?;
    let shape = vec![n];
    (len.is_multiple_of(size) && spec.accepts_shape(&shape)).then_some(shape)
}

/// Map a whole file read-only (zero-copy [`Bytes`]).
pub(super) fn map_file(path: &Path) -> Result<Bytes, CheckpointError> {
    let io = |e: std::io::Error| file_err(path, e.to_string());
    let file = std::fs::File::open(path).map_err(io)?;
    // The install's files are not modified while loaded (the same contract as the shard
    // mappings of `SafetensorsFile::open`).
    deltafin_tensor::storage::map_file(&file, path).map_err(io)
}

/// Parse `model.safetensors.index.json`: `weight_map` (name → shard file) and the optional
/// `metadata.total_size`.
pub(super) fn read_index(
    path: &Path,
) -> Result<(HashMap<String, String>, Option<u64>), CheckpointError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        CheckpointError::Tensor(TensorError::Io {
            path: path.to_path_buf(),
            source,
        })
    })?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| file_err(path, format!("not valid JSON: {e}")))?;
    let wm = v
        .get("weight_map")
        .ok_or_else(|| file_err(path, "missing field `weight_map`"))?
        .as_object()
        .ok_or_else(|| file_err(path, "`weight_map` is not an object"))?;
    let mut map = HashMap::with_capacity(wm.len());
    for (k, f) in wm {
        let f = f
            .as_str()
            .ok_or_else(|| file_err(path, format!("weight_map entry `{k}` is not a file name")))?;
        map.insert(k.clone(), f.to_string());
    }
    let total_size = match v.get("metadata").and_then(|m| m.get("total_size")) {
        None => None,
        Some(t) => Some(t.as_u64().ok_or_else(|| {
            file_err(path, "`metadata.total_size` is not a non-negative integer")
        })?),
    };
    Ok((map, total_size))
}
