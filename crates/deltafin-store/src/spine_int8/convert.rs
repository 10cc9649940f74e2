//! Conversion from the BF16 shards: resumable, checkpointed every few rows, one tensor
//! at a time under the conversion lock ([`convert_spine`]).

use super::format::*;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::filelock::{FileLock, Refused, lock_in};
use crate::inventory::TensorSpec;
use deltafin_tensor::int8::quantize_row;
use half::f16;
use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Instant;

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

/// Take the conversion lock of the int8 directory `dir`, as a converter does: a second
/// converter finds it held ([`SpineError::Locked`]).
pub fn lock(dir: &Path) -> Result<FileLock, SpineError> {
    lock_in(dir, LOCK_FILE).map_err(|r| match r {
        Refused::Held(path) => SpineError::Locked { path },
        Refused::Io(path, e) => io_err(&path)(e),
    })
}

/// Running sums of one tensor: three hashes and the squared error / norm.
pub(super) struct Acc {
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
pub(super) fn quantize_rows(
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
pub(super) fn write_json_atomic<T: Serialize>(
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
pub(super) fn resume_point(spec: &TensorSpec, files: &TensorFiles) -> usize {
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

pub(super) fn remove_if_present(path: &Path) -> Result<(), SpineError> {
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
