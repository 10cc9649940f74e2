//! The row-int8 spine on disk (product-contract §4.6): conversion from the BF16 shards,
//! zero-copy loading, and a full hash check.
//!
//! Layout under the model root: `k3-resident-int8/tensors/<name>.i8` (int8 codes, row-major),
//! `<name>.sc` (one little-endian f16 scale per row) and `<name>.row-i8.json` (the receipt,
//! schema [`RECEIPT_SCHEMA`]), where `<name>` is the full checkpoint tensor name.
//!
//! Quantized: every 2-D BF16 spine matrix whose name contains none of [`EXCLUDED`], except
//! the router (`block_sparse_moe.gate.weight`) and the embedding; `lm_head` is quantized.
//! The rule is [`deltafin_tensor::int8::quantize_row`] (one function for conversion and for
//! in-memory quantization).
//!
//! Loading checks every receipt (schema, tensor, source dtype and shape against the
//! inventory, byte counts) and every file size, maps the files, and scans the f16 scales; it
//! does **not** hash the 53 GB of codes. [`verify_spine`] (`deltafin convert-spine-int8
//! --check`) re-hashes every output and its BF16 source against the receipts.
//!
//! Conversion is resumable: each tensor is written to `<name>.i8.part` / `<name>.sc.part`,
//! and every `checkpoint_rows` rows the parts are synced and `<name>.progress.json` records
//! the rows done. A restart truncates the parts to the recorded rows and continues; the
//! result is byte-identical to an uninterrupted conversion because each row is quantized
//! independently. Finished parts are renamed into place and the receipt is written last (a
//! receipt means a complete tensor). `.convert.lock` (an advisory file lock, released when
//! the process dies) keeps a second converter out.

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::K3Config;
use crate::filelock::{FileLock, try_lock};
use crate::inventory::{TensorKind, TensorSpec, text_inventory};
use deltafin_tensor::int8::quantize_row;
use deltafin_tensor::{Bytes, DType, RowInt8Matrix};
use half::f16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Directory of the row-int8 spine under the model root.
pub const INT8_DIR: &str = "k3-resident-int8";
/// Schema of the per-tensor receipt.
pub const RECEIPT_SCHEMA: &str = "deltafin-spine-row-i8-f16-v1";
/// Schema of the per-tensor resume record.
pub const PROGRESS_SCHEMA: &str = "deltafin-spine-row-i8-progress-v1";
/// Name substrings that are never quantized (product-contract §4.6).
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
const LOCK_FILE: &str = ".convert.lock";

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

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> SpineError + '_ {
    move |e| SpineError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn tensor_err(tensor: &str, path: &Path, message: impl Into<String>) -> SpineError {
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
struct Progress {
    schema: String,
    tensor: String,
    rows: usize,
    cols: usize,
    rows_done: usize,
}

/// The files of one tensor.
#[derive(Clone, Debug)]
pub struct TensorFiles {
    pub i8: PathBuf,
    pub sc: PathBuf,
    pub receipt: PathBuf,
    i8_part: PathBuf,
    sc_part: PathBuf,
    progress: PathBuf,
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

fn read_receipt(name: &str, files: &TensorFiles) -> Result<Receipt, SpineError> {
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
fn check_receipt(spec: &TensorSpec, files: &TensorFiles, r: &Receipt) -> Result<(), SpineError> {
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

fn map_file(name: &str, path: &Path) -> Result<Bytes, SpineError> {
    let file = File::open(path).map_err(|e| tensor_err(name, path, e.to_string()))?;
    let len = file
        .metadata()
        .map_err(|e| tensor_err(name, path, e.to_string()))?
        .len();
    if len == 0 {
        return Ok(Bytes::from_vec(Vec::new()));
    }
    // SAFETY: the file is opened read-only; like the shards, the spine files must not be
    // modified while a model runs (docs/OPERATIONS.md, "The row-int8 spine").
    let mmap =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| tensor_err(name, path, e.to_string()))?;
    Ok(Bytes::from_owner(Arc::new(mmap)))
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

/// Conversion options.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Durable checkpoint interval in rows (1…[`MAX_CHECKPOINT_ROWS`]).
    pub checkpoint_rows: usize,
    /// Continue from `.part` files and finished tensors (`false`: `--no-resume`, start over).
    pub resume: bool,
    /// Stop (as if killed) after this many rows have been made durable in this run; tests.
    pub stop_after_rows: Option<usize>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            checkpoint_rows: DEFAULT_CHECKPOINT_ROWS,
            resume: true,
            stop_after_rows: None,
        }
    }
}

/// Where a conversion stands, for progress bars.
#[derive(Clone, Debug)]
pub struct ConvertProgress<'a> {
    pub tensor: &'a str,
    /// Source bytes handled so far (finished tensors included) and in all.
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// What a conversion did.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    /// Tensors of the int8 spine.
    pub tensors: usize,
    /// Tensors converted in this run (the rest were already complete).
    pub converted: usize,
    /// Tensors continued from a durable checkpoint.
    pub resumed: usize,
    /// Source bytes read in this run and output bytes written.
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub seconds: f64,
    /// `(tensor, weight rel-RMS)` of every tensor (from the receipts), inventory order.
    pub weight_error: Vec<(String, f64)>,
    /// The run stopped early at `stop_after_rows`.
    pub stopped: bool,
}

fn lock(dir: &Path) -> Result<FileLock, SpineError> {
    let path = dir.join(LOCK_FILE);
    match try_lock(&path) {
        Ok(Some(l)) => Ok(l),
        Ok(None) => Err(SpineError::Locked { path }),
        Err(e) => Err(io_err(&path)(e)),
    }
}

/// Running sums of one tensor: three hashes and the squared error / norm.
struct Acc {
    src: Sha256,
    i8: Sha256,
    sc: Sha256,
    err2: f64,
    norm2: f64,
}

impl Acc {
    fn new() -> Acc {
        Acc {
            src: Sha256::new(),
            i8: Sha256::new(),
            sc: Sha256::new(),
            err2: 0.0,
            norm2: 0.0,
        }
    }

    /// Add rows: source bf16 bytes, their codes and scales.
    fn add(&mut self, src: &[half::bf16], codes: &[i8], scales: &[u8], cols: usize) {
        self.src.update(bytemuck::cast_slice::<half::bf16, u8>(src));
        self.i8.update(bytemuck::cast_slice::<i8, u8>(codes));
        self.sc.update(scales);
        for ((x, q), s) in src
            .chunks_exact(cols.max(1))
            .zip(codes.chunks_exact(cols.max(1)))
            .zip(scales.chunks_exact(2))
        {
            let s = f16::from_le_bytes([s[0], s[1]]).to_f32() as f64;
            for (&x, &q) in x.iter().zip(q) {
                let x = x.to_f64();
                let e = x - s * q as f64;
                self.err2 += e * e;
                self.norm2 += x * x;
            }
        }
    }

    fn rel_rms(&self) -> f64 {
        if self.norm2 == 0.0 {
            0.0
        } else {
            (self.err2 / self.norm2).sqrt()
        }
    }
}

/// Quantize source rows into codes and little-endian f16 scales (rows in parallel).
fn quantize_rows(
    name: &str,
    src: &[half::bf16],
    cols: usize,
    first_row: usize,
) -> Result<(Vec<i8>, Vec<u8>), SpineError> {
    let rows = src.len() / cols.max(1);
    let mut codes = vec![0i8; rows * cols];
    let mut scales = vec![0u8; rows * 2];
    codes
        .par_chunks_mut(cols.max(1))
        .zip(scales.par_chunks_mut(2))
        .zip(src.par_chunks(cols.max(1)))
        .enumerate()
        .try_for_each(|(i, ((q, s), x))| {
            let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            let scale = quantize_row(&xf, q).map_err(|m| {
                SpineError::Checkpoint(CheckpointError::Request {
                    name: name.to_string(),
                    message: format!("row {}: {m}", first_row + i),
                })
            })?;
            s.copy_from_slice(&scale.to_le_bytes());
            Ok::<(), SpineError>(())
        })?;
    Ok((codes, scales))
}

/// Write `value` to `path` through a temporary file and a rename. With `durable` the data is
/// synced before the rename; the progress records skip that: a lost or torn record only
/// resumes from an earlier row (it never claims rows the synced parts do not hold).
fn write_json_atomic<T: Serialize>(
    path: &Path,
    value: &T,
    durable: bool,
) -> Result<(), SpineError> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(value).map_err(|e| SpineError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(text.as_bytes()).map_err(io_err(&tmp))?;
    if durable {
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// The rows a resumed tensor can continue from: the recorded count, if the parts hold it.
fn resume_point(spec: &TensorSpec, files: &TensorFiles) -> usize {
    let (rows, cols) = (spec.shape[0], spec.shape[1]);
    let Ok(text) = std::fs::read_to_string(&files.progress) else {
        return 0;
    };
    let Ok(p) = serde_json::from_str::<Progress>(&text) else {
        return 0;
    };
    if p.schema != PROGRESS_SCHEMA
        || p.tensor != spec.name
        || p.rows != rows
        || p.cols != cols
        || p.rows_done > rows
    {
        return 0;
    }
    let len = |path: &Path| std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if len(&files.i8_part) < (p.rows_done * cols) as u64
        || len(&files.sc_part) < (p.rows_done * 2) as u64
    {
        return 0;
    }
    p.rows_done
}

fn remove_if_present(path: &Path) -> Result<(), SpineError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// Convert the BF16 spine of `ckpt` into the row-int8 spine under its root.
/// `progress` is called after every durable checkpoint and finished tensor.
pub fn convert_spine(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<ConvertReport, SpineError> {
    if opts.checkpoint_rows == 0 || opts.checkpoint_rows > MAX_CHECKPOINT_ROWS {
        return Err(SpineError::CheckpointRows(opts.checkpoint_rows));
    }
    let t0 = Instant::now();
    let root = ckpt.root().to_path_buf();
    let base = root.join(INT8_DIR);
    let dir = tensor_dir(&root);
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let _lock = lock(&base)?;
    let specs = quantized_tensors(ckpt.config());
    if !opts.resume {
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            if entry.file_type().map_err(io_err(&dir))?.is_file() {
                remove_if_present(&entry.path())?;
            }
        }
    }
    let total_bytes: u64 = specs.iter().map(|s| s.byte_len() as u64).sum();
    let mut report = ConvertReport {
        tensors: specs.len(),
        ..Default::default()
    };
    let mut done_bytes = 0u64;
    let mut durable_rows = 0usize;
    for spec in &specs {
        let name = spec.name.as_str();
        let files = TensorFiles::new(&root, name);
        if files.receipt.is_file() {
            let r = read_receipt(name, &files)?;
            check_receipt(spec, &files, &r)?;
            done_bytes += spec.byte_len() as u64;
            report
                .weight_error
                .push((spec.name.clone(), r.weight_rel_rms));
            continue;
        }
        let (rows, cols) = (spec.shape[0], spec.shape[1]);
        let w = ckpt.bf16_matrix(name)?;
        let src = w.data();
        let start = resume_point(spec, &files);
        let mut acc = Acc::new();
        let open_part = |path: &Path, keep: u64| -> Result<File, SpineError> {
            let mut f = OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(path)
                .map_err(io_err(path))?;
            f.set_len(keep).map_err(io_err(path))?;
            f.seek(SeekFrom::Start(keep)).map_err(io_err(path))?;
            Ok(f)
        };
        let mut fi = open_part(&files.i8_part, (start * cols) as u64)?;
        let mut fs = open_part(&files.sc_part, (start * 2) as u64)?;
        if start > 0 {
            // Rebuild the running hashes and error sums over the durable prefix.
            let mut codes = vec![0u8; start * cols];
            let mut scales = vec![0u8; start * 2];
            let mut ri = File::open(&files.i8_part).map_err(io_err(&files.i8_part))?;
            ri.read_exact(&mut codes).map_err(io_err(&files.i8_part))?;
            let mut rs = File::open(&files.sc_part).map_err(io_err(&files.sc_part))?;
            rs.read_exact(&mut scales).map_err(io_err(&files.sc_part))?;
            acc.add(
                &src[..start * cols],
                bytemuck::cast_slice(&codes),
                &scales,
                cols,
            );
            report.resumed += 1;
            report.read_bytes += (start * cols * 2) as u64;
        }
        done_bytes += (start * cols * 2) as u64;
        let mut r = start;
        while r < rows {
            let end = (r + opts.checkpoint_rows).min(rows);
            let chunk = &src[r * cols..end * cols];
            let (codes, scales) = quantize_rows(name, chunk, cols, r)?;
            fi.write_all(bytemuck::cast_slice(&codes))
                .map_err(io_err(&files.i8_part))?;
            fs.write_all(&scales).map_err(io_err(&files.sc_part))?;
            acc.add(chunk, &codes, &scales, cols);
            fi.sync_data().map_err(io_err(&files.i8_part))?;
            fs.sync_data().map_err(io_err(&files.sc_part))?;
            write_json_atomic(
                &files.progress,
                &Progress {
                    schema: PROGRESS_SCHEMA.into(),
                    tensor: spec.name.clone(),
                    rows,
                    cols,
                    rows_done: end,
                },
                false,
            )?;
            let n = end - r;
            report.read_bytes += (n * cols * 2) as u64;
            report.written_bytes += (n * cols + n * 2) as u64;
            done_bytes += (n * cols * 2) as u64;
            durable_rows += n;
            r = end;
            progress(&ConvertProgress {
                tensor: name,
                done_bytes,
                total_bytes,
            });
            if opts.stop_after_rows.is_some_and(|k| durable_rows >= k) && r < rows {
                report.stopped = true;
                report.seconds = t0.elapsed().as_secs_f64();
                return Ok(report);
            }
        }
        drop((fi, fs));
        std::fs::rename(&files.i8_part, &files.i8).map_err(io_err(&files.i8))?;
        std::fs::rename(&files.sc_part, &files.sc).map_err(io_err(&files.sc))?;
        let receipt = Receipt {
            schema: RECEIPT_SCHEMA.into(),
            tensor: spec.name.clone(),
            source_dtype: "BF16".into(),
            source_shape: spec.shape.clone(),
            rows,
            cols,
            source_sha256: hex::encode(acc.src.clone().finalize()),
            i8_bytes: (rows * cols) as u64,
            i8_sha256: hex::encode(acc.i8.clone().finalize()),
            sc_bytes: (rows * 2) as u64,
            sc_sha256: hex::encode(acc.sc.clone().finalize()),
            weight_rel_rms: acc.rel_rms(),
        };
        write_json_atomic(&files.receipt, &receipt, true)?;
        remove_if_present(&files.progress)?;
        report.converted += 1;
        report
            .weight_error
            .push((spec.name.clone(), receipt.weight_rel_rms));
        progress(&ConvertProgress {
            tensor: name,
            done_bytes,
            total_bytes,
        });
        if opts.stop_after_rows.is_some_and(|k| durable_rows >= k) {
            report.stopped = true;
            break;
        }
    }
    if let Ok(d) = File::open(&dir) {
        // Make the renames durable where the platform allows syncing a directory.
        let _ = d.sync_all();
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Result of a full check.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub tensors: usize,
    pub bytes_hashed: u64,
}

fn sha256_file(name: &str, path: &Path) -> Result<(String, u64), SpineError> {
    let mut f = File::open(path).map_err(|e| tensor_err(name, path, e.to_string()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(|e| tensor_err(name, path, e.to_string()))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

/// Re-hash every output and its BF16 source against the receipts (`convert-spine-int8
/// --check`). The first mismatch is an error naming the tensor and the file.
pub fn verify_spine(
    ckpt: &Checkpoint,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<VerifyReport, SpineError> {
    let root = ckpt.root();
    if !int8_spine_present(root) {
        return Err(SpineError::NotConverted {
            dir: tensor_dir(root),
            root: root.to_path_buf(),
        });
    }
    let specs = quantized_tensors(ckpt.config());
    let total_bytes: u64 = specs.iter().map(|s| s.byte_len() as u64).sum();
    let mut report = VerifyReport::default();
    let mut done_bytes = 0;
    for spec in &specs {
        let name = spec.name.as_str();
        let files = TensorFiles::new(root, name);
        let r = read_receipt(name, &files)?;
        check_receipt(spec, &files, &r)?;
        for (path, want) in [(&files.i8, &r.i8_sha256), (&files.sc, &r.sc_sha256)] {
            let (got, n) = sha256_file(name, path)?;
            report.bytes_hashed += n;
            if &got != want {
                return Err(tensor_err(
                    name,
                    path,
                    format!(
                        "sha256 {got} does not match the receipt's {want} (corrupt: rerun `deltafin convert-spine-int8 --no-resume`)"
                    ),
                ));
            }
        }
        let src = ckpt.tensor_bytes(name)?;
        let got = hex::encode(Sha256::digest(src.as_slice()));
        report.bytes_hashed += src.len() as u64;
        if got != r.source_sha256 {
            return Err(tensor_err(
                name,
                &files.receipt,
                format!(
                    "the checkpoint's BF16 bytes hash to {got}, the receipt records {}: the int8 spine was converted from other weights",
                    r.source_sha256
                ),
            ));
        }
        report.tensors += 1;
        done_bytes += spec.byte_len() as u64;
        progress(&ConvertProgress {
            tensor: name,
            done_bytes,
            total_bytes,
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::REAL_CONFIG_JSON;
    use crate::linear::Linear;
    use crate::loader::{EngineOptions, load_model};
    use crate::model::{Attention, Ffn, LogitRows};

    /// 14 layers (KDA, MLA, dense, MoE), a 1,024-token vocabulary.
    fn small() -> (tempfile::TempDir, Checkpoint) {
        crate::test_util::small_checkpoint(3, false)
    }

    fn convert_all(ckpt: &Checkpoint, opts: &ConvertOptions) -> ConvertReport {
        convert_spine(ckpt, opts, &mut |_| {}).unwrap()
    }

    /// Every file under the int8 tensor directory, sorted, with its bytes.
    fn snapshot(root: &Path) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(tensor_dir(root))
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn quantized_set_follows_the_exclusion_list_and_spares_the_router() {
        let cfg = K3Config::from_json_str(REAL_CONFIG_JSON).unwrap();
        let q = quantized_tensors(&cfg);
        // 69 KDA × 8 + 24 MLA × 6 + dense 3 + 92 MoE × 5 (latent down/up, shared gate/up/down)
        // = 1,159 per-layer matrices (the original's 1,251 minus the 92 routers) + lm_head.
        assert_eq!(q.len(), 1160);
        let names: Vec<&str> = q.iter().map(|t| t.name.as_str()).collect();
        assert!(names.contains(&"language_model.lm_head.weight"));
        assert!(names.contains(&"language_model.model.layers.0.self_attn.q_proj.weight"));
        assert!(
            names
                .iter()
                .all(|n| !n.ends_with("block_sparse_moe.gate.weight"))
        );
        assert!(names.iter().all(|n| !n.contains("embed_tokens")));
        assert!(
            names
                .iter()
                .all(|n| !EXCLUDED.iter().any(|x| n.contains(x)))
        );
        assert!(!is_quantized("model.layers.1.block_sparse_moe.gate.weight"));
        assert!(is_quantized("model.layers.0.mlp.gate_proj.weight"));
        assert!(!is_quantized("model.layers.1.mlp_res_proj.weight"));
    }

    #[test]
    fn spine_choice_parsing() {
        assert_eq!(
            "auto".parse::<SpineChoice>().unwrap().format(),
            SpineFormat::Int8
        );
        assert_eq!(
            "int8".parse::<SpineChoice>().unwrap().format(),
            SpineFormat::Int8
        );
        assert_eq!(
            "bf16".parse::<SpineChoice>().unwrap().format(),
            SpineFormat::Bf16
        );
        let e = "mixed".parse::<SpineChoice>().unwrap_err();
        assert!(e.contains("research codecs change target weights"), "{e}");
        assert!(
            "fp8"
                .parse::<SpineChoice>()
                .unwrap_err()
                .contains("\"fp8\"")
        );
    }

    #[test]
    fn converted_spine_loads_as_the_quantization_rule_and_keeps_the_router_bf16() {
        let (dir, ckpt) = small();
        let missing = Int8Spine::open(dir.path(), ckpt.config())
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("deltafin convert-spine-int8") && missing.contains("--spine bf16"),
            "{missing}"
        );
        let r = convert_all(&ckpt, &ConvertOptions::default());
        assert_eq!(r.converted, r.tensors);
        assert!(r.weight_error.iter().all(|(_, e)| *e > 0.0 && *e < 0.01));
        let ckpt = Arc::new(ckpt);
        let int8 = load_model(
            ckpt.clone(),
            &EngineOptions {
                spine: SpineFormat::Int8,
                ..Default::default()
            },
        )
        .unwrap();
        let bf16 = load_model(ckpt.clone(), &EngineOptions::default()).unwrap();
        let same_rule = |lin: &Linear, name: &str| {
            let Linear::RowInt8(m) = lin else {
                panic!("{name} is not row-int8");
            };
            let want = RowInt8Matrix::from_bf16(name, &ckpt.bf16_matrix(name).unwrap()).unwrap();
            assert_eq!(m.data(), want.data(), "{name}");
            assert_eq!(m.scales(), want.scales(), "{name}");
        };
        same_rule(&int8.lm_head, "lm_head.weight");
        let mut moe_layers = 0;
        for (l, layer) in int8.layers.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            match &layer.attn {
                Attention::Kda(w) => same_rule(&w.o_proj, &p("self_attn.o_proj.weight")),
                Attention::Mla(w) => same_rule(&w.kv_b_proj, &p("self_attn.kv_b_proj.weight")),
            }
            if let Ffn::Moe(m) = &layer.ffn {
                moe_layers += 1;
                same_rule(
                    &m.latent_down,
                    &p("block_sparse_moe.routed_expert_down_proj.weight"),
                );
                same_rule(
                    &m.shared.up_proj,
                    &p("block_sparse_moe.shared_experts.up_proj.weight"),
                );
                // The router multiplies the checkpoint's own BF16 bytes, so the routes of an
                // int8 run come from the unquantized router.
                let src = ckpt
                    .bf16_matrix(&p("block_sparse_moe.gate.weight"))
                    .unwrap();
                assert_eq!(m.router.weight.data(), src.data());
                let Ffn::Moe(mb) = &bf16.layers[l].ffn else {
                    unreachable!()
                };
                let d = int8.dims.hidden_size;
                let y: Vec<f32> = (0..3 * d)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                    .collect();
                let (ri, rb) = (
                    m.router.route(&int8.dims, &y, 3),
                    mb.router.route(&bf16.dims, &y, 3),
                );
                assert_eq!(format!("{ri:?}"), format!("{rb:?}"));
            }
        }
        assert!(moe_layers > 0);
        // The int8 model runs; its logits differ from bf16 (quantized) but stay finite and
        // of the same scale (the synthesized model amplifies a router flip, see
        // docs/NUMERICS.md, so no tighter bound holds for every seed).
        let ids = [1u32, 17, 99, 512, 3];
        let a = int8
            .forward(&mut int8.new_state(), &ids, LogitRows::All)
            .unwrap();
        let b = bf16
            .forward(&mut bf16.new_state(), &ids, LogitRows::All)
            .unwrap();
        let num: f64 = a
            .values
            .iter()
            .zip(&b.values)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum();
        let den: f64 = b.values.iter().map(|y| (*y as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        assert!(a.values.iter().all(|v| v.is_finite()));
        assert!(rel > 0.0 && rel < 1.0, "logit rel-L2 {rel}");
        // Rerunning finds everything complete; --check hashes it all.
        let again = convert_all(&ckpt, &ConvertOptions::default());
        assert_eq!((again.converted, again.read_bytes), (0, 0));
        let v = verify_spine(&ckpt, &mut |_| {}).unwrap();
        assert_eq!(v.tensors, r.tensors);
    }

    #[test]
    fn interrupted_conversion_resumes_byte_identical() {
        let (da, a) = small();
        let (db, b) = small();
        let opts = ConvertOptions {
            checkpoint_rows: 48,
            ..Default::default()
        };
        convert_all(&a, &opts);
        let want = snapshot(da.path());
        // Stop after 100 durable rows each time (mid-tensor: the vocabulary has 1,024 rows).
        let stopping = ConvertOptions {
            stop_after_rows: Some(100),
            ..opts.clone()
        };
        let mut runs = 0;
        let (mut resumed, mut saw_parts) = (0, false);
        loop {
            let r = convert_all(&b, &stopping);
            resumed += r.resumed;
            runs += 1;
            if !r.stopped {
                break;
            }
            let files = snapshot(db.path());
            saw_parts |= files.iter().any(|(n, _)| n.ends_with(".i8.part"))
                && files.iter().any(|(n, _)| n.ends_with(".progress.json"));
            assert!(runs < 10_000, "no progress");
        }
        assert!(runs > 2 && saw_parts);
        assert!(resumed > 0, "no tensor was continued from a checkpoint");
        assert_eq!(snapshot(db.path()), want);

        // --no-resume starts over and ends identical too.
        let (dc, c) = small();
        let partial = convert_all(&c, &stopping);
        assert!(partial.stopped);
        let fresh = convert_all(
            &c,
            &ConvertOptions {
                resume: false,
                ..opts.clone()
            },
        );
        assert_eq!((fresh.resumed, fresh.converted), (0, fresh.tensors));
        assert_eq!(snapshot(dc.path()), want);
    }

    #[test]
    fn a_second_converter_is_locked_out_and_bad_intervals_rejected() {
        let (dir, ckpt) = small();
        std::fs::create_dir_all(tensor_dir(dir.path())).unwrap();
        let held = lock(&dir.path().join(INT8_DIR)).unwrap();
        let e = convert_spine(&ckpt, &ConvertOptions::default(), &mut |_| {}).unwrap_err();
        assert!(matches!(e, SpineError::Locked { .. }), "{e}");
        assert!(e.to_string().contains(".convert.lock"), "{e}");
        drop(held);
        for bad in [0, MAX_CHECKPOINT_ROWS + 1] {
            let e = convert_spine(
                &ckpt,
                &ConvertOptions {
                    checkpoint_rows: bad,
                    ..Default::default()
                },
                &mut |_| {},
            )
            .unwrap_err();
            assert!(e.to_string().contains("--checkpoint-rows"), "{e}");
        }
    }

    #[test]
    fn damaged_files_are_named_errors() {
        let (dir, ckpt) = small();
        convert_all(
            &ckpt,
            &ConvertOptions {
                checkpoint_rows: 4096,
                ..Default::default()
            },
        );
        let root = dir.path();
        let cfg = ckpt.config();
        let name = "language_model.model.layers.2.self_attn.o_proj.weight";
        let files = TensorFiles::new(root, name);
        let open_err = || Int8Spine::open(root, cfg).unwrap_err().to_string();

        // A truncated code file.
        let codes = std::fs::read(&files.i8).unwrap();
        std::fs::write(&files.i8, &codes[..codes.len() - 1]).unwrap();
        let e = open_err();
        assert!(
            e.contains(name) && e.contains(".i8") && e.contains("truncated"),
            "{e}"
        );
        // Same size, one byte changed: loading does not hash, --check names the file.
        let mut flipped = codes.clone();
        flipped[5] ^= 1;
        std::fs::write(&files.i8, &flipped).unwrap();
        Int8Spine::open(root, cfg).unwrap();
        let e = verify_spine(&ckpt, &mut |_| {}).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains(".i8") && e.contains("sha256"),
            "{e}"
        );
        std::fs::write(&files.i8, &codes).unwrap();

        // A NaN scale.
        let scales = std::fs::read(&files.sc).unwrap();
        let mut nan = scales.clone();
        nan[..2].copy_from_slice(&f16::NAN.to_le_bytes());
        std::fs::write(&files.sc, &nan).unwrap();
        let e = open_err();
        assert!(
            e.contains(name) && e.contains(".sc") && e.contains("scale"),
            "{e}"
        );
        // A short scale file.
        std::fs::write(&files.sc, &scales[..2]).unwrap();
        let e = open_err();
        assert!(e.contains(name) && e.contains(".sc"), "{e}");
        std::fs::write(&files.sc, &scales).unwrap();

        // A receipt that is not JSON, a missing receipt, a receipt for other weights.
        let receipt = std::fs::read_to_string(&files.receipt).unwrap();
        std::fs::write(&files.receipt, "{").unwrap();
        let e = open_err();
        assert!(
            e.contains(name) && e.contains("row-i8.json") && e.contains("invalid receipt"),
            "{e}"
        );
        std::fs::remove_file(&files.receipt).unwrap();
        let e = open_err();
        assert!(e.contains(name) && e.contains("convert-spine-int8"), "{e}");
        let other = receipt.replace("\"source_sha256\": \"", "\"source_sha256\": \"00");
        std::fs::write(&files.receipt, other).unwrap();
        Int8Spine::open(root, cfg).unwrap();
        let e = verify_spine(&ckpt, &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("other weights"), "{e}");
        std::fs::write(&files.receipt, &receipt).unwrap();
        Int8Spine::open(root, cfg).unwrap();
        verify_spine(&ckpt, &mut |_| {}).unwrap();
    }
}
