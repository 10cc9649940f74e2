//! Opening and validating a sharded K3 checkpoint (k3-model.md §3).
//!
//! [`Checkpoint::open`] reads `config.json` and `model.safetensors.index.json`, maps every shard
//! the index names once, and checks **every** tensor of the expected inventory (present in the
//! index, present in that shard's header, right dtype and shape) before any inference. Vision
//! and projector tensors are allowed and counted but never read.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use deltafin_tensor::{Bf16Matrix, Bytes, DType, Mxfp4Matrix, SafetensorsFile, TensorError, bf16};
use serde_json::Value;

use crate::config::{ConfigError, K3Config};
use crate::inventory::{self, PREFIX, TensorSpec};

/// Name of the config file under the model root.
pub const CONFIG_FILE: &str = "config.json";
/// Name of the weight-map file under the model root.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A checkpoint error; each names the file and tensor (or field) at fault.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{file} is missing under {root}")]
    MissingFile { root: PathBuf, file: &'static str },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("tensor `{name}`: {message}")]
    Request { name: String, message: String },
}

fn file_err(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::File {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The matrices of one routed expert (logical shapes: `w1`, `w3` `[F, Lr]`, `w2` `[Lr, F]`).
#[derive(Clone, Debug)]
pub struct ExpertMatrices {
    /// Gate.
    pub w1: Mxfp4Matrix,
    /// Down.
    pub w2: Mxfp4Matrix,
    /// Up.
    pub w3: Mxfp4Matrix,
}

/// Where one expert's six tensors lie in its shard file, in the §3.4 order (w1 packed, w1
/// scale, w2 packed, w2 scale, w3 packed, w3 scale), as absolute `(offset, len)` pairs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSpan {
    pub shard_path: PathBuf,
    pub ranges: [(u64, u64); 6],
    /// True when the six ranges follow each other without gaps (one read covers the expert).
    pub contiguous: bool,
}

impl ExpertSpan {
    /// Total bytes of the six ranges.
    pub fn total_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }
}

/// Directory of a stream install's spine: one raw file per non-expert tensor, named by the
/// tensor's full name, holding its exact checkpoint bytes (product-contract §4.1, §5.2).
pub const SPINE_TENSOR_DIR: &str = "k3-resident/tensors";

/// Directory of the one-file-per-expert layout under the model root (product-contract §4.1).
pub const EXPERT_DIR: &str = "k3-experts";

/// `L{layer}-E{expert}.bin`: one expert's six tensors verbatim, §3.4 order (`raw-v1`).
pub fn expert_file_name(layer: usize, expert: usize) -> String {
    format!("L{layer}-E{expert}.bin")
}

/// Where `deltafin setup` records the install mode (`full` or `stream`).
pub const INSTALL_MODE_FILE: &str = "k3-meta/install-mode";

/// How the weights of an install are laid out on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The release shards (`model-*.safetensors`) through `model.safetensors.index.json`.
    Shards,
    /// A stream install: the spine as `k3-resident/tensors/<name>`, the routed experts as
    /// `k3-experts/L{l}-E{e}.bin` files that appear as they are fetched.
    StreamInstall,
}

impl Layout {
    /// `shards` or `stream-install` (the startup line's `layout=`).
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::Shards => "shards",
            Layout::StreamInstall => "stream-install",
        }
    }

    /// The layout of the install at `root`: a stream install when `k3-resident/tensors/`
    /// exists and either `k3-meta/install-mode` says `stream` (a stream install keeps the
    /// index as metadata) or there is no index; else shards when the index exists; `None`
    /// when neither applies.
    pub fn detect(root: &Path) -> Option<Layout> {
        let index = root.join(INDEX_FILE).is_file();
        let spine = root.join(SPINE_TENSOR_DIR).is_dir();
        let mode = std::fs::read_to_string(root.join(INSTALL_MODE_FILE)).unwrap_or_default();
        if spine && (!index || mode.trim() == "stream") {
            Some(Layout::StreamInstall)
        } else if index {
            Some(Layout::Shards)
        } else {
            None
        }
    }
}

/// One spine tensor of a stream install: its file, mapped whole.
struct TensorFile {
    path: PathBuf,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Bytes,
}

/// Where the tensors come from.
enum Store {
    /// Release shards; full text tensor name → index into `shards`.
    Shards {
        shards: Vec<SafetensorsFile>,
        locate: HashMap<String, usize>,
    },
    /// A stream install; full name of every non-expert text tensor → its mapped file.
    Tensors { files: HashMap<String, TensorFile> },
}

/// A resolved tensor: its full name, zero-copy bytes, dtype and shape.
struct Found<'a> {
    full: String,
    bytes: Bytes,
    dtype: DType,
    shape: &'a [usize],
}

/// A validated checkpoint: release shards or a stream install's per-tensor spine.
pub struct Checkpoint {
    root: PathBuf,
    config: K3Config,
    store: Store,
    vision_tensors: usize,
    projector_tensors: usize,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (files, tensors) = match &self.store {
            Store::Shards { shards, locate } => (shards.len(), locate.len()),
            Store::Tensors { files } => (files.len(), files.len()),
        };
        f.debug_struct("Checkpoint")
            .field("root", &self.root)
            .field("layout", &self.layout())
            .field("files", &files)
            .field("text_tensors", &tensors)
            .finish()
    }
}

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
            if info.shape != spec.shape {
                return Err(file_err(
                    shard.path(),
                    format!(
                        "tensor `{}` has shape {:?}, expected {:?}",
                        spec.name, info.shape, spec.shape
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
            let want = spec.byte_len() as u64;
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
            if len != want {
                return Err(file_err(
                    &path,
                    format!(
                        "tensor `{}` is {len} bytes, expected {want} ({} {:?})",
                        spec.name, spec.dtype, spec.shape
                    ),
                ));
            }
            let bytes = map_file(&path)?;
            files.insert(
                spec.name.clone(),
                TensorFile {
                    path,
                    dtype: spec.dtype,
                    shape: spec.shape.clone(),
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

    /// How this install is laid out.
    pub fn layout(&self) -> Layout {
        match self.store {
            Store::Shards { .. } => Layout::Shards,
            Store::Tensors { .. } => Layout::StreamInstall,
        }
    }

    /// A stream install's spine files, one per tensor (empty for shards).
    pub fn spine_files(&self) -> Vec<&Path> {
        match &self.store {
            Store::Shards { .. } => Vec::new(),
            Store::Tensors { files } => files.values().map(|t| t.path.as_path()).collect(),
        }
    }

    /// Bytes of the non-expert tensors as stored (the spine), over either layout.
    pub fn spine_bytes(&self) -> u64 {
        let cfg = &self.config;
        inventory::text_inventory(cfg)
            .iter()
            .filter(|t| matches!(t.kind, inventory::TensorKind::Spine { .. }))
            .map(|t| t.byte_len() as u64)
            .sum()
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &K3Config {
        &self.config
    }

    /// `k3-experts/L{layer}-E{expert}.bin` under the model root.
    pub fn expert_file(&self, layer: usize, expert: usize) -> PathBuf {
        self.root
            .join(EXPERT_DIR)
            .join(expert_file_name(layer, expert))
    }

    /// The model root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Number of `vision_tower.*` tensors present (ignored).
    pub fn vision_tensor_count(&self) -> usize {
        self.vision_tensors
    }

    /// Number of `mm_projector.*` tensors present (ignored).
    pub fn projector_tensor_count(&self) -> usize {
        self.projector_tensors
    }

    /// Paths of the opened shard files (empty for a stream install).
    pub fn shard_paths(&self) -> Vec<&Path> {
        match &self.store {
            Store::Shards { shards, .. } => shards.iter().map(|s| s.path()).collect(),
            Store::Tensors { .. } => Vec::new(),
        }
    }

    /// Resolve a text tensor (name with or without the `language_model.` prefix).
    fn find(&self, name: &str) -> Result<Found<'_>, CheckpointError> {
        let full = if name.starts_with(PREFIX) {
            name.to_string()
        } else {
            format!("{PREFIX}{name}")
        };
        let not_here = |full: String, message: &str| CheckpointError::Request {
            name: full,
            message: message.into(),
        };
        match &self.store {
            Store::Shards { shards, locate } => {
                let Some(&i) = locate.get(&full) else {
                    return Err(not_here(full, "not a text tensor of this checkpoint"));
                };
                let shard = &shards[i];
                let info = shard
                    .info(&full)
                    .ok_or_else(|| file_err(shard.path(), format!("tensor `{full}` vanished")))?;
                Ok(Found {
                    bytes: shard.bytes(&full)?,
                    full,
                    dtype: info.dtype,
                    shape: &info.shape,
                })
            }
            Store::Tensors { files } => match files.get(&full) {
                Some(t) => Ok(Found {
                    full,
                    bytes: t.bytes.clone(),
                    dtype: t.dtype,
                    shape: &t.shape,
                }),
                None => Err(not_here(
                    full,
                    "not a spine tensor of this stream install (routed experts are read from k3-experts/)",
                )),
            },
        }
    }

    /// Zero-copy bytes of a text tensor (name with or without the `language_model.` prefix).
    pub fn tensor_bytes(&self, name: &str) -> Result<Bytes, CheckpointError> {
        Ok(self.find(name)?.bytes)
    }

    /// The file, absolute byte offset and length of a text tensor (for explicit reads that
    /// bypass the mmap, e.g. spine streaming).
    pub fn tensor_file_range(&self, name: &str) -> Result<(PathBuf, u64, u64), CheckpointError> {
        let full = if name.starts_with(PREFIX) {
            name.to_string()
        } else {
            format!("{PREFIX}{name}")
        };
        match &self.store {
            Store::Shards { shards, locate } => {
                let Some(&i) = locate.get(&full) else {
                    return Err(CheckpointError::Request {
                        name: full,
                        message: "not a text tensor of this checkpoint".into(),
                    });
                };
                let shard = &shards[i];
                let (off, len) = shard
                    .absolute_range(&full)
                    .map_err(|e| file_err(shard.path(), e.to_string()))?;
                Ok((shard.path().to_path_buf(), off, len))
            }
            Store::Tensors { files } => match files.get(&full) {
                Some(t) => Ok((t.path.clone(), 0, t.bytes.len() as u64)),
                None => Err(CheckpointError::Request {
                    name: full,
                    message: "not a spine tensor of this stream install".into(),
                }),
            },
        }
    }

    /// Dtype and shape of a text tensor.
    pub fn tensor_info(&self, name: &str) -> Result<(DType, Vec<usize>), CheckpointError> {
        let found = self.find(name)?;
        Ok((found.dtype, found.shape.to_vec()))
    }

    /// A 2-D BF16 tensor as a matrix (`[1, D]` vectors included).
    pub fn bf16_matrix(&self, name: &str) -> Result<Bf16Matrix, CheckpointError> {
        let found = self.find(name)?;
        let (rows, cols) = match (found.dtype, found.shape) {
            (DType::BF16, &[r, c]) => (r, c),
            _ => {
                return Err(CheckpointError::Request {
                    name: found.full,
                    message: format!(
                        "is {} {:?}, not a 2-D BF16 matrix",
                        found.dtype, found.shape
                    ),
                });
            }
        };
        Ok(Bf16Matrix::new(&found.full, found.bytes, rows, cols)?)
    }

    /// A BF16 or F32 tensor of any rank (norms, biases, conv taps, `res_proj`) widened to f32.
    pub fn f32_vector(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let found = self.find(name)?;
        let (bytes, full) = (found.bytes, found.full);
        match found.dtype {
            DType::F32 => Ok(bytes
                .as_slice()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            DType::BF16 => Ok(bytes
                .as_slice()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            other => Err(CheckpointError::Request {
                name: full,
                message: format!("is {other}, not BF16 or F32"),
            }),
        }
    }

    fn check_expert(&self, layer: usize, expert: usize) -> Result<(), CheckpointError> {
        let cfg = &self.config;
        let name = format!("{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{expert}");
        if layer >= cfg.n_layers() || cfg.is_dense(layer) {
            return Err(CheckpointError::Request {
                name,
                message: format!("layer {layer} is not a MoE layer"),
            });
        }
        if expert >= cfg.text.num_experts {
            return Err(CheckpointError::Request {
                name,
                message: format!(
                    "expert {expert} is out of range (num_experts = {})",
                    cfg.text.num_experts
                ),
            });
        }
        Ok(())
    }

    /// The three MXFP4 matrices of `expert` in MoE layer `layer` (scales checked for NaN).
    pub fn expert_matrices(
        &self,
        layer: usize,
        expert: usize,
    ) -> Result<ExpertMatrices, CheckpointError> {
        self.check_expert(layer, expert)?;
        let lay = inventory::expert_layout(&self.config, layer, expert);
        // A stream install keeps each expert as one raw-v1 file: map it and slice the six
        // tensors in span order.
        let file = match self.store {
            Store::Shards { .. } => None,
            Store::Tensors { .. } => {
                let path = self.expert_file(layer, expert);
                let want = lay.total_bytes() as u64;
                let len = std::fs::metadata(&path)
                    .map_err(|e| {
                        file_err(
                            &path,
                            format!("layer {layer} expert {expert} is not available locally: {e}"),
                        )
                    })?
                    .len();
                if len != want {
                    return Err(file_err(
                        &path,
                        format!(
                            "layer {layer} expert {expert}: file is {len} bytes, the expert is {want}"
                        ),
                    ));
                }
                Some((map_file(&path)?, path))
            }
        };
        let mut at = 0usize;
        let mut part = |name: &str, len: usize| -> Result<Bytes, CheckpointError> {
            match &file {
                None => self.tensor_bytes(name),
                Some((bytes, path)) => {
                    let b = bytes.slice(at..at + len).ok_or_else(|| {
                        file_err(path, format!("tensor `{name}` lies beyond the file"))
                    })?;
                    at += len;
                    Ok(b)
                }
            }
        };
        let mut mats = Vec::with_capacity(3);
        for pair in lay.tensors.chunks_exact(2) {
            let (p, s) = (&pair[0], &pair[1]);
            let [rows, cols] = inventory::ExpertLayout::logical_shape(&self.config, p.matrix);
            let name = p.name.trim_end_matches(".weight_packed");
            let packed = part(&p.name, p.bytes)?;
            let scale = part(&s.name, s.bytes)?;
            mats.push(Mxfp4Matrix::new(name, packed, scale, rows, cols)?);
        }
        let mut it = mats.into_iter();
        match (it.next(), it.next(), it.next()) {
            (Some(w1), Some(w2), Some(w3)) => Ok(ExpertMatrices { w1, w2, w3 }),
            _ => Err(CheckpointError::Request {
                name: format!("layer {layer} expert {expert}"),
                message: "internal: expected three matrices".into(),
            }),
        }
    }

    /// Absolute file ranges of one expert's six tensors, for direct span reads.
    pub fn expert_span(&self, layer: usize, expert: usize) -> Result<ExpertSpan, CheckpointError> {
        self.check_expert(layer, expert)?;
        let lay = inventory::expert_layout(&self.config, layer, expert);
        let mut ranges = [(0u64, 0u64); 6];
        if self.layout() == Layout::StreamInstall {
            // The expert's own file (which need not exist yet: it is fetched on demand).
            let mut at = 0u64;
            for (r, t) in ranges.iter_mut().zip(&lay.tensors) {
                *r = (at, t.bytes as u64);
                at += r.1;
            }
            return Ok(ExpertSpan {
                shard_path: self.expert_file(layer, expert),
                ranges,
                contiguous: true,
            });
        }
        let mut shard_path: Option<&Path> = None;
        for (k, t) in lay.tensors.iter().enumerate() {
            let Store::Shards { shards, locate } = &self.store else {
                break;
            };
            let full = t.name.clone();
            let Some(shard) = locate.get(&full).map(|&i| &shards[i]) else {
                return Err(CheckpointError::Request {
                    name: full,
                    message: "not a text tensor of this checkpoint".into(),
                });
            };
            match shard_path {
                None => shard_path = Some(shard.path()),
                Some(p) if p != shard.path() => {
                    return Err(CheckpointError::Request {
                        name: full,
                        message: format!(
                            "lies in {} but the expert's first tensor lies in {}: the expert spans shards",
                            shard.path().display(),
                            p.display()
                        ),
                    });
                }
                Some(_) => {}
            }
            ranges[k] = shard.absolute_range(&full)?;
        }
        let contiguous = ranges.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0);
        Ok(ExpertSpan {
            shard_path: shard_path.map(Path::to_path_buf).unwrap_or_default(),
            ranges,
            contiguous,
        })
    }
}

/// Map a whole file read-only (zero-copy [`Bytes`]).
fn map_file(path: &Path) -> Result<Bytes, CheckpointError> {
    let io = |e: std::io::Error| file_err(path, e.to_string());
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only; the install's files are not modified while loaded
    // (the same contract as the shard mmaps of `SafetensorsFile::open`).
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok(Bytes::from_owner(std::sync::Arc::new(mmap)))
}

/// Parse `model.safetensors.index.json`: `weight_map` (name → shard file) and the optional
/// `metadata.total_size`.
fn read_index(path: &Path) -> Result<(HashMap<String, String>, Option<u64>), CheckpointError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::TensorKind;
    use crate::loader::{EngineOptions, load_model};
    use crate::model::LogitRows;
    use crate::spine_int8::{ConvertOptions, convert_spine, tensor_dir};
    use crate::synth::{SynthDims, SynthSpec, synthesize};
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    /// A synthesized shard checkpoint and the same weights as a stream install: config,
    /// one file per spine tensor, and the experts as `k3-experts/` files.
    fn shards_and_stream() -> (tempfile::TempDir, Checkpoint, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let shards = dir.path().join("shards");
        let dims = SynthDims {
            vocab: 1024,
            layers: 6,
            attn_res_block: 4,
            ..SynthDims::tiny()
        };
        synthesize(&shards, &SynthSpec::new(dims, 5)).unwrap();
        let ckpt = Checkpoint::open(&shards).unwrap();
        let stream = dir.path().join("stream");
        std::fs::create_dir_all(stream.join(SPINE_TENSOR_DIR)).unwrap();
        std::fs::create_dir_all(stream.join(EXPERT_DIR)).unwrap();
        std::fs::copy(shards.join(CONFIG_FILE), stream.join(CONFIG_FILE)).unwrap();
        for t in inventory::text_inventory(ckpt.config()) {
            if let TensorKind::Spine { .. } = t.kind {
                let b = ckpt.tensor_bytes(&t.name).unwrap();
                std::fs::write(stream.join(SPINE_TENSOR_DIR).join(&t.name), b.as_slice()).unwrap();
            }
        }
        let cfg = ckpt.config().clone();
        for l in (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)) {
            for e in 0..cfg.text.num_experts {
                let span = ckpt.expert_span(l, e).unwrap();
                let f = std::fs::File::open(&span.shard_path).unwrap();
                let mut bytes = Vec::new();
                for (off, len) in span.ranges {
                    let mut b = vec![0u8; len as usize];
                    f.read_exact_at(&mut b, off).unwrap();
                    bytes.extend_from_slice(&b);
                }
                let p = stream.join(EXPERT_DIR).join(expert_file_name(l, e));
                std::fs::write(p, bytes).unwrap();
            }
        }
        (dir, ckpt, stream)
    }

    #[test]
    fn stream_install_layout_gives_the_shards_logits_and_int8_spine() {
        let (_dir, shards, stream) = shards_and_stream();
        assert_eq!(Layout::detect(&stream), Some(Layout::StreamInstall));
        assert_eq!(Layout::detect(shards.root()), Some(Layout::Shards));
        let st = Checkpoint::open(&stream).unwrap();
        assert_eq!(st.layout(), Layout::StreamInstall);
        assert_eq!(shards.layout(), Layout::Shards);
        let cfg = shards.config().clone();
        let spine_count = inventory::text_inventory(&cfg)
            .iter()
            .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
            .count();
        assert_eq!(st.spine_files().len(), spine_count);
        assert!(shards.spine_files().is_empty() && st.shard_paths().is_empty());
        let on_disk: u64 = st
            .spine_files()
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(st.spine_bytes(), on_disk);
        // The expert tensors are not spine tensors of a stream install.
        let e0 = inventory::expert_layout(&cfg, 1, 0);
        assert!(st.tensor_bytes(&e0.tensors[0].name).is_err());
        // Experts from their files equal the shards' experts.
        let (a, b) = (
            shards.expert_matrices(1, 3).unwrap(),
            st.expert_matrices(1, 3).unwrap(),
        );
        for (x, y) in [(&a.w1, &b.w1), (&a.w2, &b.w2), (&a.w3, &b.w3)] {
            assert_eq!((x.packed(), x.scales()), (y.packed(), y.scales()));
        }
        let span = st.expert_span(1, 3).unwrap();
        assert_eq!(span.shard_path, st.expert_file(1, 3));
        assert!(span.contiguous && span.ranges[0].0 == 0);
        let st = Arc::new(st);
        let shards = Arc::new(shards);
        let opts = EngineOptions::default();
        let (ma, mb) = (
            load_model(shards.clone(), &opts).unwrap(),
            load_model(st.clone(), &opts).unwrap(),
        );
        let ids = [1u32, 17, 99, 512, 3];
        let la = ma
            .forward(&mut ma.new_state(), &ids, LogitRows::All)
            .unwrap();
        let lb = mb
            .forward(&mut mb.new_state(), &ids, LogitRows::All)
            .unwrap();
        assert_eq!(la.values, lb.values);
        // The int8 conversion reads the bf16 spine through either layout identically.
        for c in [&shards, &st] {
            convert_spine(c, &ConvertOptions::default(), &mut |_| {}).unwrap();
        }
        let mut names: Vec<_> = std::fs::read_dir(tensor_dir(shards.root()))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert!(!names.is_empty());
        for n in names {
            assert_eq!(
                std::fs::read(tensor_dir(shards.root()).join(&n)).unwrap(),
                std::fs::read(tensor_dir(st.root()).join(&n)).unwrap(),
                "{n:?}"
            );
        }
    }

    #[test]
    fn stream_install_spine_file_errors_name_the_tensor() {
        let (_dir, _shards, stream) = shards_and_stream();
        let name = "language_model.model.layers.2.input_layernorm.weight";
        let path = stream.join(SPINE_TENSOR_DIR).join(name);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[1..]).unwrap();
        let msg = Checkpoint::open(&stream).unwrap_err().to_string();
        assert!(
            msg.contains(name) && msg.contains("bytes, expected"),
            "{msg}"
        );
        std::fs::remove_file(&path).unwrap();
        let msg = Checkpoint::open(&stream).unwrap_err().to_string();
        assert!(msg.contains(name) && msg.contains("is missing"), "{msg}");
        std::fs::write(&path, &bytes).unwrap();
        std::fs::write(stream.join(SPINE_TENSOR_DIR).join("stray.bin"), b"x").unwrap();
        let msg = Checkpoint::open(&stream).unwrap_err().to_string();
        assert!(msg.contains("stray.bin"), "{msg}");
        std::fs::remove_file(stream.join(SPINE_TENSOR_DIR).join("stray.bin")).unwrap();
        // A missing expert file names the layer and expert.
        let st = Checkpoint::open(&stream).unwrap();
        std::fs::remove_file(st.expert_file(2, 7)).unwrap();
        let msg = st.expert_matrices(2, 7).unwrap_err().to_string();
        assert!(msg.contains("layer 2 expert 7"), "{msg}");
    }
}
