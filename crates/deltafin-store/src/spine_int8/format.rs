//! The row-int8 spine's files: names, formats, receipts, and the zero-copy loading of a
//! converted spine ([`Int8Spine`]).

use crate::checkpoint::CheckpointError;
use crate::config::K3Config;
use crate::inventory::{TensorKind, TensorSpec, text_inventory};
use deltafin_tensor::{Bytes, DType, RowInt8Matrix};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Directory of the row-int8 spine under the model root.
pub const INT8_DIR: &str = "k3-resident-int8";
/// Schema of the per-tensor receipt.
pub const RECEIPT_SCHEMA: &str = "deltafin-spine-row-i8-f16-v1";
/// Schema of the per-tensor resume record.
pub const PROGRESS_SCHEMA: &str = "deltafin-spine-row-i8-progress-v1";
/// Name substrings that are never quantized (docs/K3.md §12.6).
pub const EXCLUDED: [&str; 9] = [
    "conv1d",
    "norm",
    "A_log",
    "dt_bias",
    "res_proj",
    "e_score_correction_bias",
    ".experts.",
    "vision",
    "mm_projector",
];
/// Default durable checkpoint interval (rows).
pub const DEFAULT_CHECKPOINT_ROWS: usize = 128;
/// Largest accepted checkpoint interval (rows).
pub const MAX_CHECKPOINT_ROWS: usize = 1 << 20;
pub(super) const LOCK_FILE: &str = ".convert.lock";

/// Which spine the model multiplies with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpineFormat {
    /// The checkpoint's BF16 matrices (weight-exact; the library default).
    #[default]
    Bf16,
    /// The row-int8 spine of [`INT8_DIR`] (quantized; the CLI default).
    Int8,
}

impl SpineFormat {
    /// `"bf16"` or `"int8"`.
    pub fn as_str(self) -> &'static str {
        match self {
            SpineFormat::Bf16 => "bf16",
            SpineFormat::Int8 => "int8",
        }
    }
}

/// The user's spine choice (`--spine`, `K3_SPINE`): `auto` = int8.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpineChoice {
    #[default]
    Auto,
    Int8,
    Bf16,
}

impl std::str::FromStr for SpineChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<SpineChoice, String> {
        match s {
            "auto" => Ok(SpineChoice::Auto),
            "int8" => Ok(SpineChoice::Int8),
            "bf16" => Ok(SpineChoice::Bf16),
            "mixed" => Err(
                "\"mixed\" is rejected: research codecs change target weights; use auto, int8 or bf16"
                    .into(),
            ),
            _ => Err(format!("{s:?} is not auto, int8 or bf16")),
        }
    }
}

impl SpineChoice {
    /// The format this choice loads: `auto` and `int8` → [`SpineFormat::Int8`].
    pub fn format(self) -> SpineFormat {
        match self {
            SpineChoice::Auto | SpineChoice::Int8 => SpineFormat::Int8,
            SpineChoice::Bf16 => SpineFormat::Bf16,
        }
    }
}

/// An error of the int8 spine; each names the tensor and file at fault.
#[derive(Debug, thiserror::Error)]
pub enum SpineError {
    #[error(
        "the row-int8 spine (the default, --spine auto/int8) is not converted: {dir} is missing. \
         Run `deltafin convert-spine-int8 --model-root {root}` once (quantized, not weight-exact), \
         or pass --spine bf16 (K3_SPINE=bf16) to use the original BF16 weights"
    )]
    NotConverted { dir: PathBuf, root: PathBuf },
    #[error("int8 spine tensor `{tensor}`: {path}: {message}")]
    Tensor {
        tensor: String,
        path: PathBuf,
        message: String,
    },
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error(
        "{path} is held by another convert-spine-int8 (one converter per model root); wait for it to finish"
    )]
    Locked { path: PathBuf },
    #[error("--checkpoint-rows {0}: must be in 1…{MAX_CHECKPOINT_ROWS}")]
    CheckpointRows(usize),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

pub(super) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> SpineError + '_ {
    move |e| SpineError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

pub(super) fn tensor_err(tensor: &str, path: &Path, message: impl Into<String>) -> SpineError {
    SpineError::Tensor {
        tensor: tensor.to_string(),
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Whether tensor `name` is quantized in the int8 spine (a 2-D BF16 spine matrix is assumed):
/// none of [`EXCLUDED`], not the router, not the embedding.
pub fn is_quantized(name: &str) -> bool {
    !EXCLUDED.iter().any(|x| name.contains(x))
        && !name.ends_with(".gate.weight")
        && !name.ends_with("embed_tokens.weight")
}

/// The tensors of the int8 spine, in inventory order.
pub fn quantized_tensors(cfg: &K3Config) -> Vec<TensorSpec> {
    text_inventory(cfg)
        .into_iter()
        .filter(|t| {
            matches!(t.kind, TensorKind::Spine { .. })
                && t.dtype == DType::BF16
                && t.shape.len() == 2
                && is_quantized(&t.name)
        })
        .collect()
}

/// The receipt `<name>.row-i8.json` of one converted tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    pub schema: String,
    pub tensor: String,
    pub source_dtype: String,
    pub source_shape: Vec<usize>,
    pub rows: usize,
    pub cols: usize,
    /// SHA-256 of the source tensor's bytes (BF16, little endian, row-major).
    pub source_sha256: String,
    pub i8_bytes: u64,
    pub i8_sha256: String,
    pub sc_bytes: u64,
    pub sc_sha256: String,
    /// `‖W − Ŵ‖ / ‖W‖` over the tensor (Ŵ = f16 scale · code).
    pub weight_rel_rms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Progress {
    pub(super) schema: String,
    pub(super) tensor: String,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) rows_done: usize,
}

/// The files of one tensor.
#[derive(Clone, Debug)]
pub struct TensorFiles {
    pub i8: PathBuf,
    pub sc: PathBuf,
    pub receipt: PathBuf,
    pub(super) i8_part: PathBuf,
    pub(super) sc_part: PathBuf,
    pub(super) progress: PathBuf,
}

impl TensorFiles {
    /// The files of `name` under `root`.
    pub fn new(root: &Path, name: &str) -> TensorFiles {
        let d = tensor_dir(root);
        let f = |ext: &str| d.join(format!("{name}{ext}"));
        TensorFiles {
            i8: f(".i8"),
            sc: f(".sc"),
            receipt: f(".row-i8.json"),
            i8_part: f(".i8.part"),
            sc_part: f(".sc.part"),
            progress: f(".progress.json"),
        }
    }
}

/// `<root>/k3-resident-int8/tensors`.
pub fn tensor_dir(root: &Path) -> PathBuf {
    root.join(INT8_DIR).join("tensors")
}

/// Whether the int8 spine directory exists under `root` (it may still be incomplete).
pub fn int8_spine_present(root: &Path) -> bool {
    tensor_dir(root).is_dir()
}

pub(super) fn read_receipt(name: &str, files: &TensorFiles) -> Result<Receipt, SpineError> {
    let text = std::fs::read_to_string(&files.receipt).map_err(|e| {
        tensor_err(
            name,
            &files.receipt,
            format!("receipt unreadable ({e}); the conversion is incomplete: rerun `deltafin convert-spine-int8`"),
        )
    })?;
    let r: Receipt = serde_json::from_str(&text)
        .map_err(|e| tensor_err(name, &files.receipt, format!("invalid receipt: {e}")))?;
    if r.schema != RECEIPT_SCHEMA {
        return Err(tensor_err(
            name,
            &files.receipt,
            format!("schema {:?}, expected {RECEIPT_SCHEMA:?}", r.schema),
        ));
    }
    if r.tensor != name {
        return Err(tensor_err(
            name,
            &files.receipt,
            format!("receipt is for tensor `{}`", r.tensor),
        ));
    }
    Ok(r)
}

/// Check a receipt against the inventory entry and the files' sizes.
pub(super) fn check_receipt(
    spec: &TensorSpec,
    files: &TensorFiles,
    r: &Receipt,
) -> Result<(), SpineError> {
    let name = spec.name.as_str();
    let bad = |m: String| tensor_err(name, &files.receipt, m);
    if r.source_dtype != "BF16" || r.source_shape != spec.shape {
        return Err(bad(format!(
            "source {} {:?} does not match the checkpoint's BF16 {:?}",
            r.source_dtype, r.source_shape, spec.shape
        )));
    }
    let (rows, cols) = (spec.shape[0], spec.shape[1]);
    if r.rows != rows || r.cols != cols {
        return Err(bad(format!(
            "rows/cols [{}, {}] do not match the shape [{rows}, {cols}]",
            r.rows, r.cols
        )));
    }
    let (want_i8, want_sc) = ((rows * cols) as u64, (rows * 2) as u64);
    if r.i8_bytes != want_i8 || r.sc_bytes != want_sc {
        return Err(bad(format!(
            "records {} code bytes and {} scale bytes, the shape needs {want_i8} and {want_sc}",
            r.i8_bytes, r.sc_bytes
        )));
    }
    for (path, want) in [(&files.i8, want_i8), (&files.sc, want_sc)] {
        let len = std::fs::metadata(path)
            .map_err(|e| tensor_err(name, path, format!("missing ({e})")))?
            .len();
        if len != want {
            return Err(tensor_err(
                name,
                path,
                format!(
                    "is {len} bytes, expected {want} (truncated or corrupt: rerun `deltafin convert-spine-int8 --no-resume`)"
                ),
            ));
        }
    }
    Ok(())
}

pub(super) fn map_file(name: &str, path: &Path) -> Result<Bytes, SpineError> {
    let file = File::open(path).map_err(|e| tensor_err(name, path, e.to_string()))?;
    // Like the shards, the spine files must not be modified while a model runs
    // (docs/OPERATIONS.md, "The row-int8 spine").
    deltafin_tensor::storage::map_file(&file, path)
        .map_err(|e| tensor_err(name, path, e.to_string()))
}

/// The loaded int8 spine: one zero-copy [`RowInt8Matrix`] per quantized tensor.
#[derive(Debug, Default)]
pub struct Int8Spine {
    matrices: HashMap<String, RowInt8Matrix>,
    /// Total bytes of codes and scales.
    pub bytes: u64,
}

impl Int8Spine {
    /// Open and validate every tensor of the int8 spine of the checkpoint under `root`.
    pub fn open(root: &Path, cfg: &K3Config) -> Result<Int8Spine, SpineError> {
        if !int8_spine_present(root) {
            return Err(SpineError::NotConverted {
                dir: tensor_dir(root),
                root: root.to_path_buf(),
            });
        }
        let mut spine = Int8Spine::default();
        for spec in quantized_tensors(cfg) {
            let name = spec.name.as_str();
            let files = TensorFiles::new(root, name);
            let r = read_receipt(name, &files)?;
            check_receipt(&spec, &files, &r)?;
            let data = map_file(name, &files.i8)?;
            let scales = map_file(name, &files.sc)?;
            let m = RowInt8Matrix::new_unscanned(name, data, scales, r.rows, r.cols)
                .map_err(|e| tensor_err(name, &files.sc, e.to_string()))?;
            spine.bytes += r.i8_bytes + r.sc_bytes;
            spine.matrices.insert(spec.name.clone(), m);
        }
        Ok(spine)
    }

    /// The matrix of full tensor name `name`.
    pub fn get(&self, name: &str) -> Option<&RowInt8Matrix> {
        self.matrices.get(name)
    }

    /// Number of matrices.
    pub fn len(&self) -> usize {
        self.matrices.len()
    }

    /// Whether no matrix is loaded.
    pub fn is_empty(&self) -> bool {
        self.matrices.is_empty()
    }
}
