//! Conversion: raw experts in, verified `L{layer}.sc4` files out.

use super::error::{Scale4Error, io_err};
use super::format::*;
use crate::error::ExpertError;
use crate::layout::{ExpertShape, ExpertTable};
use sha2::{Digest, Sha256};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The raw experts a conversion reads: a table and its files (kept open when there are few,
/// as shards; opened per read when every expert is its own file).
pub struct RawSource {
    pub table: ExpertTable,
    open: Option<Vec<std::fs::File>>,
}

impl RawSource {
    /// Files kept open at most (more: one `open` per read, as `k3-experts/` files).
    pub const MAX_OPEN: usize = 256;

    /// Wrap `table`, opening its files now when there are at most [`Self::MAX_OPEN`].
    pub fn new(table: ExpertTable) -> Result<RawSource, Scale4Error> {
        let open = if table.files.len() <= Self::MAX_OPEN {
            Some(
                table
                    .files
                    .iter()
                    .map(|p| std::fs::File::open(p).map_err(io_err(p)))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        } else {
            None
        };
        Ok(RawSource { table, open })
    }

    /// The three raw E8M0 scale arrays (w1, w2, w3) of one expert.
    pub fn scales(&self, layer: usize, expert: usize) -> Result<[Vec<u8>; 3], Scale4Error> {
        let loc = self.table.get(layer, expert)?;
        let path = &self.table.files[loc.file];
        let io = |offset: u64, len: u64| {
            move |source| {
                Scale4Error::Source(ExpertError::Io {
                    layer,
                    expert,
                    path: path.clone(),
                    offset,
                    len,
                    source,
                })
            }
        };
        let owned;
        let f = match &self.open {
            Some(files) => &files[loc.file],
            None => {
                owned = std::fs::File::open(path).map_err(io(0, 0))?;
                &owned
            }
        };
        let mut out: [Vec<u8>; 3] = Default::default();
        for (m, o) in out.iter_mut().enumerate() {
            let (off, len) = loc.ranges[2 * m + 1];
            *o = vec![0u8; len as usize];
            f.read_exact_at(o, off).map_err(io(off, len))?;
        }
        Ok(out)
    }

    /// Bytes of raw scales one expert conversion reads.
    pub fn scale_bytes_per_expert(&self) -> u64 {
        let t = self.table.shape.tensor_bytes();
        t[1] + t[3] + t[5]
    }
}

/// Write `L{layer}.sc4` into `dir` from the raw source: `.part` file, `workers` threads
/// encoding experts into their record slots, fsync, then verification of every record
/// against the raw scales, then an atomic rename. `progress(n)` is called as experts are
/// done. Returns the sha256 of the file. A conversion that fails (a full disk, a bad raw
/// scale) removes its `.part`.
pub fn convert_layer(
    dir: &Path,
    layout: &Scale4Layout,
    layer: usize,
    raw: &RawSource,
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<String, Scale4Error> {
    let part = dir.join(format!("{}.part", layer_file_name(layer)));
    let converted = convert_layer_via(&part, dir, layout, layer, raw, workers, progress);
    if converted.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    converted
}

fn convert_layer_via(
    part: &Path,
    dir: &Path,
    layout: &Scale4Layout,
    layer: usize,
    raw: &RawSource,
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<String, Scale4Error> {
    let path = dir.join(layer_file_name(layer));
    let f = std::fs::File::create(part).map_err(io_err(part))?;
    f.set_len(layout.file_bytes()).map_err(io_err(part))?;
    f.write_all_at(&file_header(layout, layer), 0)
        .map_err(io_err(part))?;
    for_each_expert(layout.num_experts, workers, |e| {
        let scales = raw.scales(layer, e)?;
        let enc = encode_expert([&scales[0], &scales[1], &scales[2]], layer, e)?;
        f.write_all_at(
            &write_record(layout, layer, e, &enc),
            layout.record_offset(e),
        )
        .map_err(io_err(part))?;
        progress(1);
        Ok(())
    })?;
    f.sync_all().map_err(io_err(part))?;
    drop(f);
    let sha = verify_layer(part, layout, layer, Some(raw), workers)?;
    std::fs::rename(part, &path).map_err(io_err(&path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all(); // directory fsync is best effort (not every filesystem allows it)
    }
    Ok(sha)
}

fn for_each_expert(
    n: usize,
    workers: usize,
    job: impl Fn(usize) -> Result<(), Scale4Error> + Sync,
) -> Result<(), Scale4Error> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Vec<Result<(), Scale4Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers.clamp(1, n.max(1)))
            .map(|_| {
                s.spawn(|| {
                    loop {
                        let e = next.fetch_add(1, Ordering::Relaxed);
                        if e >= n || failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        if let Err(err) = job(e) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(err);
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect()
}

/// Validate a layer file: size, header, every record; with a raw source, also that every
/// record decodes to the raw scale bytes. Returns the file's sha256.
pub fn verify_layer(
    path: &Path,
    layout: &Scale4Layout,
    layer: usize,
    raw: Option<&RawSource>,
    workers: usize,
) -> Result<String, Scale4Error> {
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let len = f.metadata().map_err(io_err(path))?.len();
    if len != layout.file_bytes() {
        return Err(Scale4Error::File {
            path: path.to_path_buf(),
            message: format!("is {len} bytes, expected {}", layout.file_bytes()),
        });
    }
    let mut h = vec![0u8; layout.header_bytes() as usize];
    f.read_exact_at(&mut h, 0).map_err(io_err(path))?;
    check_file_header(layout, layer, &h, path)?;
    for_each_expert(layout.num_experts, workers, |e| {
        let mut rec = vec![0u8; layout.record_bytes() as usize];
        f.read_exact_at(&mut rec, layout.record_offset(e))
            .map_err(io_err(path))?;
        let enc = parse_record(layout, layer, e, &rec, path)?;
        if let Some(raw) = raw {
            let want = raw.scales(layer, e)?;
            let got = decode_expert(layout, &enc);
            if let Some(m) = (0..3).find(|&m| got[m] != want[m]) {
                return Err(Scale4Error::Record {
                    path: path.to_path_buf(),
                    layer,
                    expert: e,
                    message: format!(
                        "{} decodes to scales that differ from the raw expert",
                        MATRICES[m]
                    ),
                });
            }
        }
        Ok(())
    })?;
    sha256_file(path)
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, Scale4Error> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut sha = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
    }
    Ok(hex::encode(sha.finalize()))
}

/// A table of `k3-experts/L{l}-E{e}.bin` files under `dir` (each must exist with the
/// expert's size); `moe_layers[l]` true for MoE layers.
pub fn raw_file_table(
    dir: &Path,
    shape: ExpertShape,
    moe_layers: &[bool],
    num_experts: usize,
) -> Result<ExpertTable, Scale4Error> {
    let mut files = Vec::new();
    let mut layers = Vec::with_capacity(moe_layers.len());
    let mut ranges = [(0u64, 0u64); 6];
    let mut at = 0;
    for (r, len) in ranges.iter_mut().zip(shape.tensor_bytes()) {
        *r = (at, len);
        at += len;
    }
    for (l, &moe) in moe_layers.iter().enumerate() {
        if !moe {
            layers.push(None);
            continue;
        }
        let mut locs = Vec::with_capacity(num_experts);
        for e in 0..num_experts {
            let p = dir.join(format!("L{l}-E{e}.bin"));
            let len = std::fs::metadata(&p).map_err(io_err(&p))?.len();
            if len != shape.expert_bytes() {
                return Err(Scale4Error::File {
                    path: p,
                    message: format!("is {len} bytes, an expert is {}", shape.expert_bytes()),
                });
            }
            files.push(p);
            locs.push(crate::ExpertLocation {
                file: files.len() - 1,
                ranges,
            });
        }
        layers.push(Some(locs));
    }
    let table = ExpertTable {
        files,
        shape,
        layers,
    };
    table.validate()?;
    Ok(table)
}
