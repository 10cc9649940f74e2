//! Opening and validating a sharded K3 checkpoint (docs/K3.md §3).
//!
//! [`Checkpoint::open`] reads `config.json` and `model.safetensors.index.json`, maps every shard
//! the index names once, and checks **every** tensor of the expected inventory (present in the
//! index, present in that shard's header, right dtype and shape) before any inference. Vision
//! and projector tensors are allowed and counted but never read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use deltafin_tensor::{Bytes, DType, Mxfp4Matrix, SafetensorsFile, TensorError};

use crate::config::{ConfigError, K3Config};
use crate::inventory::{self};

mod open;
mod tensors;

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
/// tensor's full name, holding its exact checkpoint bytes (docs/K3.md §12.1, §5.2).
pub const SPINE_TENSOR_DIR: &str = "k3-resident/tensors";

/// Directory of the one-file-per-expert layout under the model root (docs/K3.md §12.1).
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

    /// Bytes of the non-expert tensors as stored (the spine), over either layout (a
    /// zero-padded `A_log` counts with its stored length).
    pub fn spine_bytes(&self) -> u64 {
        let cfg = &self.config;
        inventory::text_inventory(cfg)
            .iter()
            .filter(|t| matches!(t.kind, inventory::TensorKind::Spine { .. }))
            .map(|t| match self.tensor_bytes(&t.name) {
                Ok(b) => b.len() as u64,
                Err(_) => t.byte_len() as u64,
            })
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
}
