//! Legacy NPZ expert caches → raw-v1 expert files (`warm-expert-cache --convert-npz`,
//! product contract §5.6; docs/CLI.md).
//!
//! The original's caches hold one NumPy archive per expert, `L{layer}-E{expert}.npz`: a ZIP of
//! six `uint8` arrays named `w1_p.npy`, `w1_s.npy`, `w2_p.npy`, `w2_s.npy`, `w3_p.npy`,
//! `w3_s.npy` (the MXFP4 codes and E8M0 scales of w1, w2, w3), each in C or Fortran order.
//! Their C-order bytes, concatenated in that order, are exactly the raw-v1 expert file
//! (docs/K3.md §12.3). Conversion is lossless and checked: every member's CRC-32 is verified
//! as it is read, its `.npy` header must name `uint8` and the expert's exact shape from
//! `config.json`, the file is written to a temporary, fsynced, read back and compared by
//! SHA-256, published without replacing anything (a hard link), and only then is the NPZ
//! deleted (unless `--keep-npz`).

use anyhow::{Context, Result, anyhow, bail};
use deltafin_experts::layout::ExpertShape;
use deltafin_store::checkpoint::expert_file_name;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The largest archive accepted (a K3 expert is 17.5 MB).
pub const MAX_ARCHIVE_BYTES: u64 = 64 << 20;
/// The largest `.npy` header accepted.
const MAX_NPY_HEADER: usize = 64 << 10;

/// The six members of a legacy expert archive, in raw-v1 order, with their `(rows, cols)`
/// shapes for an expert of `shape`: codes are two E2M1 values per byte, scales one E8M0 byte
/// per 32 inputs.
pub fn members(shape: ExpertShape) -> [(&'static str, (usize, usize)); 6] {
    let g = deltafin_tensor::mxfp4::GROUP;
    let (f, lr) = (shape.f, shape.lr);
    [
        ("w1_p.npy", (f, lr / 2)),
        ("w1_s.npy", (f, lr / g)),
        ("w2_p.npy", (lr, f / 2)),
        ("w2_s.npy", (lr, f / g)),
        ("w3_p.npy", (f, lr / 2)),
        ("w3_s.npy", (f, lr / g)),
    ]
}

/// The raw-v1 bytes of the expert archive `bytes` (`what` names it in errors).
pub fn expert_from_npz(bytes: &[u8], shape: ExpertShape, what: &str) -> Result<Vec<u8>> {
    let members = members(shape);
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| anyhow!("{what}: not a ZIP archive: {e}"))?;
    if zip.offset() != 0 {
        bail!("{what}: {} bytes precede the ZIP archive", zip.offset());
    }
    let mut seen = [false; 6];
    for i in 0..zip.len() {
        let m = zip
            .by_index_raw(i)
            .map_err(|e| anyhow!("{what}: ZIP member {i}: {e}"))?;
        let name = String::from_utf8_lossy(m.name_raw()).into_owned();
        let Some(k) = members
            .iter()
            .position(|(n, _)| n.as_bytes() == m.name_raw())
        else {
            bail!(
                "{what}: unexpected member {name:?} (a legacy expert archive holds exactly {})",
                members.map(|m| m.0).join(", ")
            );
        };
        if std::mem::replace(&mut seen[k], true) {
            bail!("{what}: member {name} appears twice");
        }
        if m.encrypted() || !m.is_file() {
            bail!("{what}: member {name} is encrypted or not a plain file");
        }
        if !matches!(
            m.compression(),
            zip::CompressionMethod::Stored | zip::CompressionMethod::Deflated
        ) {
            bail!(
                "{what}: member {name} uses compression {:?} (stored or deflated expected)",
                m.compression()
            );
        }
    }
    if let Some(k) = seen.iter().position(|s| !s) {
        bail!("{what}: member {} is missing", members[k].0);
    }
    let mut out = Vec::with_capacity(shape.expert_bytes() as usize);
    for (name, (rows, cols)) in members {
        let m = zip
            .by_name(name)
            .map_err(|e| anyhow!("{what}: member {name}: {e}"))?;
        let limit = (rows * cols + MAX_NPY_HEADER + 16) as u64;
        let mut npy = Vec::new();
        // Read to the end: the reader checks the member's CRC-32 there.
        m.take(limit + 1)
            .read_to_end(&mut npy)
            .map_err(|e| anyhow!("{what}: member {name}: {e}"))?;
        if npy.len() as u64 > limit {
            bail!("{what}: member {name} is larger than a {rows}×{cols} uint8 array");
        }
        let array = parse_npy(&npy).map_err(|e| anyhow!("{what}: member {name}: {e}"))?;
        if array.shape != (rows, cols) {
            bail!(
                "{what}: member {name} has shape {:?}, an expert of this config.json needs ({rows}, {cols})",
                array.shape
            );
        }
        if array.fortran_order {
            // Column-major: element (r, c) is at c·rows + r.
            let at = out.len();
            out.resize(at + rows * cols, 0);
            for c in 0..cols {
                for r in 0..rows {
                    out[at + r * cols + c] = array.data[c * rows + r];
                }
            }
        } else {
            out.extend_from_slice(array.data);
        }
    }
    Ok(out)
}

/// A parsed `.npy` array of `uint8`.
#[derive(Debug, PartialEq, Eq)]
pub struct Npy<'a> {
    pub fortran_order: bool,
    pub shape: (usize, usize),
    pub data: &'a [u8],
}

/// Parse a version 1, 2 or 3 `.npy` file of a two-dimensional `uint8` array whose payload is
/// exactly `rows × cols` bytes.
pub fn parse_npy(b: &[u8]) -> Result<Npy<'_>, String> {
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        return Err("not a .npy array (no \\x93NUMPY magic)".into());
    }
    let (prefix, len) = match (b[6], b[7]) {
        (1, 0) => (10, u16::from_le_bytes([b[8], b[9]]) as usize),
        (2 | 3, 0) if b.len() >= 12 => {
            (12, u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize)
        }
        (major, minor) => {
            return Err(format!(
                ".npy version {major}.{minor} is not 1.0, 2.0 or 3.0"
            ));
        }
    };
    if len == 0 || len > MAX_NPY_HEADER || prefix + len > b.len() {
        return Err(format!("a header of {len} bytes does not fit the array"));
    }
    let header = std::str::from_utf8(&b[prefix..prefix + len])
        .map_err(|_| "the header is not text".to_string())?;
    let (descr, fortran_order, shape) = parse_header(header)?;
    if !matches!(descr.as_str(), "|u1" | "<u1" | ">u1" | "=u1") {
        return Err(format!("dtype {descr:?} is not uint8"));
    }
    let data = &b[prefix + len..];
    if shape.0.checked_mul(shape.1) != Some(data.len()) {
        return Err(format!("{} payload bytes for shape {shape:?}", data.len()));
    }
    Ok(Npy {
        fortran_order,
        shape,
        data,
    })
}

/// The `.npy` header dictionary: `{'descr': '|u1', 'fortran_order': False, 'shape': (R, C), }`
/// padded with spaces and ending in a newline; exactly these three keys.
fn parse_header(h: &str) -> Result<(String, bool, (usize, usize)), String> {
    let bad = |why: &str| format!("header {:?}: {why}", h.trim_end());
    let body = h
        .trim_end()
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .ok_or_else(|| bad("not a {…} dictionary"))?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (key, after) = quoted(rest).ok_or_else(|| bad("a key is not a quoted string"))?;
        let after = after
            .trim_start()
            .strip_prefix(':')
            .ok_or_else(|| bad("no ':' after a key"))?
            .trim_start();
        let after = match key {
            "descr" if descr.is_none() => {
                let (v, a) = quoted(after).ok_or_else(|| bad("descr is not a string"))?;
                descr = Some(v.to_string());
                a
            }
            "fortran_order" if fortran.is_none() => {
                if let Some(a) = after.strip_prefix("True") {
                    fortran = Some(true);
                    a
                } else if let Some(a) = after.strip_prefix("False") {
                    fortran = Some(false);
                    a
                } else {
                    return Err(bad("fortran_order is not True or False"));
                }
            }
            "shape" if shape.is_none() => {
                let close = after.find(')').ok_or_else(|| bad("shape is not a tuple"))?;
                let inner = after
                    .strip_prefix('(')
                    .ok_or_else(|| bad("shape is not a tuple"))?;
                let dims: Vec<&str> = inner[..close - 1]
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .collect();
                let dims: Vec<usize> = dims
                    .iter()
                    .map(|d| {
                        d.parse::<usize>()
                            .map_err(|_| bad("a dimension is not an integer"))
                    })
                    .collect::<Result<_, _>>()?;
                let [r, c] = dims[..] else {
                    return Err(bad("the array is not two-dimensional"));
                };
                shape = Some((r, c));
                &after[close + 1..]
            }
            _ => return Err(bad(&format!("unexpected or repeated key {key:?}"))),
        };
        rest = after.trim_start();
        match rest.strip_prefix(',') {
            Some(r) => rest = r.trim_start(),
            None if rest.is_empty() => {}
            None => return Err(bad("entries are not separated by ','")),
        }
    }
    match (descr, fortran, shape) {
        (Some(d), Some(f), Some(s)) => Ok((d, f, s)),
        _ => Err(bad("descr, fortran_order and shape are required")),
    }
}

/// A `'…'` or `"…"` string at the start of `s` and what follows it.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let end = s[1..].find(q)? + 1;
    Some((&s[1..end], &s[end + 1..]))
}

/// One archive to convert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub layer: usize,
    pub expert: usize,
    pub npz: PathBuf,
}

/// The `L{layer}-E{expert}.npz` archives of `dirs` (directories that do not exist are
/// skipped), sorted by layer then expert. A name of that form whose layer is not a MoE layer
/// of the model or whose expert is out of range, a non-canonical spelling (`L01-E2.npz`) or an
/// expert found twice is an error.
pub fn scan(
    dirs: &[PathBuf],
    moe_layer: impl Fn(usize) -> bool,
    experts: usize,
) -> Result<Vec<Job>> {
    let mut jobs: Vec<Job> = Vec::new();
    for dir in dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(anyhow!("cannot list {}: {e}", dir.display())),
        };
        for entry in entries {
            let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some((l, e)) = name
                .strip_prefix('L')
                .and_then(|s| s.strip_suffix(".npz"))
                .and_then(|s| s.split_once("-E"))
            else {
                continue;
            };
            let (Ok(layer), Ok(expert)) = (l.parse::<usize>(), e.parse::<usize>()) else {
                continue;
            };
            let path = dir.join(name);
            if format!("L{layer}-E{expert}.npz") != name {
                bail!(
                    "{}: not a canonical legacy expert name (L{layer}-E{expert}.npz)",
                    path.display()
                );
            }
            if !moe_layer(layer) || expert >= experts {
                bail!(
                    "{}: layer {layer} expert {expert} is not a routed expert of this config.json ({experts} experts per MoE layer)",
                    path.display()
                );
            }
            if let Some(j) = jobs.iter().find(|j| (j.layer, j.expert) == (layer, expert)) {
                bail!(
                    "expert {expert} of layer {layer} is in two legacy caches: {} and {}",
                    j.npz.display(),
                    path.display()
                );
            }
            jobs.push(Job {
                layer,
                expert,
                npz: path,
            });
        }
    }
    jobs.sort_by_key(|j| (j.layer, j.expert));
    Ok(jobs)
}

/// How a conversion runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Archives converted at once, 1…16.
    pub workers: usize,
    /// Pause after each converted archive, per worker (keeps the disk free for other work).
    pub throttle: Duration,
    /// Keep the archives after their raw file is published.
    pub keep_npz: bool,
}

/// What one archive became.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A new raw file was published.
    Converted,
    /// An identical raw file was already there.
    Reused,
}

/// Totals of [`convert`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub converted: usize,
    pub reused: usize,
    pub deleted: usize,
    pub bytes: u64,
    /// `(archive, error)` of each archive that failed (its raw file is not published and the
    /// archive is kept).
    pub failed: Vec<(PathBuf, String)>,
}

/// Convert `jobs` into raw-v1 files in `dest`. `publish(layer, expert, path, bytes, sha256)`
/// runs under nothing else and is called for each newly published file (the CLI records its
/// receipt); `progress` after each archive. One archive's failure does not stop the others.
pub fn convert(
    jobs: &[Job],
    dest: &Path,
    shape: ExpertShape,
    opts: &Options,
    publish: &(dyn Fn(&Job, &Path, u64, &str) -> Result<()> + Sync),
    progress: &(dyn Fn() + Sync),
) -> Report {
    let next = AtomicUsize::new(0);
    let report = Mutex::new(Report::default());
    std::thread::scope(|s| {
        for _ in 0..opts.workers.clamp(1, 16).min(jobs.len()) {
            s.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let r = convert_one(job, dest, shape, opts.keep_npz, publish);
                    {
                        let mut rep = report.lock().unwrap_or_else(|p| p.into_inner());
                        match r {
                            Ok((outcome, deleted)) => {
                                match outcome {
                                    Outcome::Converted => {
                                        rep.converted += 1;
                                        rep.bytes += shape.expert_bytes();
                                    }
                                    Outcome::Reused => rep.reused += 1,
                                }
                                rep.deleted += usize::from(deleted);
                            }
                            Err(e) => rep.failed.push((job.npz.clone(), format!("{e:#}"))),
                        }
                    }
                    progress();
                    if !opts.throttle.is_zero() {
                        std::thread::sleep(opts.throttle);
                    }
                }
            });
        }
    });
    let mut rep = report.into_inner().unwrap_or_else(|p| p.into_inner());
    rep.failed.sort();
    rep
}

/// A temporary name in `dest` no other converter uses.
fn temporary(dest: &Path, job: &Job) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    dest.join(format!(
        ".{}.npz-convert.{}.{}.tmp",
        expert_file_name(job.layer, job.expert),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// SHA-256 of the file at `path` if it is a regular file of `len` bytes (`None`: absent).
fn existing_sha(path: &Path, len: u64) -> Result<Option<[u8; 32]>> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(anyhow!("cannot inspect {}: {e}", path.display())),
    };
    if !meta.is_file() || meta.len() != len {
        bail!(
            "{} already exists and is not a {len}-byte expert file; move it away and rerun",
            path.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Some(Sha256::digest(&bytes).into()))
}

/// Fsync directory `dir` (the names created or removed in it become durable).
fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync directory {}", dir.display()))
}

fn convert_one(
    job: &Job,
    dest: &Path,
    shape: ExpertShape,
    keep_npz: bool,
    publish: &(dyn Fn(&Job, &Path, u64, &str) -> Result<()> + Sync),
) -> Result<(Outcome, bool)> {
    let npz = &job.npz;
    let meta = std::fs::symlink_metadata(npz)
        .with_context(|| format!("cannot inspect {}", npz.display()))?;
    if !meta.is_file() || meta.len() > MAX_ARCHIVE_BYTES {
        bail!(
            "{}: a legacy archive must be a regular file (not a link) of at most {MAX_ARCHIVE_BYTES} bytes",
            npz.display()
        );
    }
    let archive = std::fs::read(npz).with_context(|| format!("cannot read {}", npz.display()))?;
    let bytes = expert_from_npz(&archive, shape, &npz.display().to_string())?;
    if bytes.len() as u64 != shape.expert_bytes() {
        bail!(
            "{}: {} bytes of expert data, an expert of this config.json is {}",
            npz.display(),
            bytes.len(),
            shape.expert_bytes()
        );
    }
    let sha: [u8; 32] = Sha256::digest(&bytes).into();
    let target = dest.join(expert_file_name(job.layer, job.expert));
    let len = bytes.len() as u64;
    let outcome = match existing_sha(&target, len)? {
        Some(s) if s == sha => Outcome::Reused,
        Some(_) => bail!(
            "{} already exists with other bytes than {}; move one of them away and rerun",
            target.display(),
            npz.display()
        ),
        None => {
            let tmp = temporary(dest, job);
            let written = (|| -> Result<()> {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&tmp)
                    .with_context(|| format!("cannot create {}", tmp.display()))?;
                f.write_all(&bytes)
                    .and_then(|()| f.sync_all())
                    .with_context(|| format!("cannot write {}", tmp.display()))?;
                drop(f);
                let back = std::fs::read(&tmp)
                    .with_context(|| format!("cannot read back {}", tmp.display()))?;
                let back_sha: [u8; 32] = Sha256::digest(&back).into();
                if back_sha != sha {
                    bail!("{}: read back other bytes than were written", tmp.display());
                }
                Ok(())
            })();
            let published = written.and_then(|()| match std::fs::hard_link(&tmp, &target) {
                Ok(()) => Ok(Outcome::Converted),
                // Published meanwhile by another converter: the same bytes or an error.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    match existing_sha(&target, len)? {
                        Some(s) if s == sha => Ok(Outcome::Reused),
                        _ => bail!(
                            "{} appeared with other bytes than {} while converting",
                            target.display(),
                            npz.display()
                        ),
                    }
                }
                Err(e) => Err(anyhow!("cannot publish {}: {e}", target.display())),
            });
            let _ = std::fs::remove_file(&tmp);
            let outcome = published?;
            sync_dir(dest)?;
            if outcome == Outcome::Converted {
                publish(job, &target, len, &hex::encode(sha))?;
            }
            outcome
        }
    };
    let deleted = !keep_npz;
    if deleted {
        std::fs::remove_file(npz).with_context(|| format!("cannot remove {}", npz.display()))?;
        if let Some(dir) = npz.parent() {
            sync_dir(dir)?;
        }
    }
    Ok((outcome, deleted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut h = header.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((h.len() as u16).to_le_bytes());
        b.extend(h.as_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn npy_headers_are_parsed_strictly() {
        let d = [1u8, 2, 3, 4, 5, 6];
        let a = npy(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }",
            &d,
        );
        assert_eq!(
            parse_npy(&a),
            Ok(Npy {
                fortran_order: false,
                shape: (2, 3),
                data: &d
            })
        );
        let f = npy(
            "{\"shape\": (3,2), \"fortran_order\": True, \"descr\": \"<u1\"}",
            &d,
        );
        assert_eq!(
            parse_npy(&f).map(|n| (n.fortran_order, n.shape)),
            Ok((true, (3, 2)))
        );
        for (header, needle) in [
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                "not uint8",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (6,), }",
                "two-dimensional",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 4), }",
                "payload",
            ),
            (
                "{'descr': '|u1', 'fortran_order': 0, 'shape': (2, 3), }",
                "True or False",
            ),
            ("{'descr': '|u1', 'shape': (2, 3), }", "required"),
            (
                "{'descr': '|u1', 'descr': '|u1', 'fortran_order': False, 'shape': (2, 3)}",
                "repeated",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), 'x': 1}",
                "unexpected",
            ),
            ("['descr']", "dictionary"),
        ] {
            let e = parse_npy(&npy(header, &d)).unwrap_err();
            assert!(e.contains(needle), "{header}: {e}");
        }
        assert!(parse_npy(b"NUMPY").unwrap_err().contains("magic"));
        let mut v4 = a.clone();
        v4[6] = 4;
        assert!(parse_npy(&v4).unwrap_err().contains("version 4.0"));
    }

    #[test]
    fn member_shapes_follow_the_raw_layout() {
        let shape = ExpertShape { f: 3072, lr: 3584 };
        let bytes: Vec<usize> = members(shape).iter().map(|(_, (r, c))| r * c).collect();
        let want: Vec<usize> = shape.tensor_bytes().iter().map(|&b| b as usize).collect();
        assert_eq!(bytes, want);
        // The original's K3 members.
        assert_eq!(members(shape)[0], ("w1_p.npy", (3072, 1792)));
        assert_eq!(members(shape)[3], ("w2_s.npy", (3584, 96)));
        assert_eq!(shape.expert_bytes(), 17_547_264);
    }
}
