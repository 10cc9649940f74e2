//! Placing copies of experts in homes: the plan (which expert goes to which home), and one
//! verified copy (written, synced, read back from the drive, compared by SHA-256, then
//! journaled). Everything a plan asks for that a home's journal already lists is skipped, so
//! an interrupted placement resumes where it stopped.

use super::{CopyDigest, Home, Record};
use crate::buffer::ExpertBuffer;
use crate::error::ExpertError;
use crate::io::{DirectIo, SourceFile};
use crate::layout::{ExpertTable, ReadPlan};
use sha2::{Digest, Sha256};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// One copy to make: expert `expert` of `layer` into home `home` (an index into the homes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy {
    pub layer: usize,
    pub expert: usize,
    pub home: usize,
}

/// The copies to make so that every expert of `wanted` has its number of copies, at most one
/// per home: experts in the order given (hottest first when ranked by heat), each new copy to
/// a home not holding the expert yet with the fewest bytes (held plus planned), ties to the
/// first. Copies the homes already hold count, so the plan of a resumed placement is what
/// is left.
pub fn plan(homes: &[Home], wanted: &[((usize, usize), usize)]) -> Vec<Copy> {
    let mut load: Vec<u64> = homes.iter().map(Home::held_bytes).collect();
    let mut out = Vec::new();
    for &((layer, expert), copies) in wanted {
        let copies = copies.min(homes.len());
        let mut have: Vec<bool> = homes.iter().map(|h| h.holds(layer, expert)).collect();
        let mut n = have.iter().filter(|&&x| x).count();
        while n < copies {
            let Some(h) = (0..homes.len())
                .filter(|&h| !have[h])
                .min_by_key(|&h| (load[h], h))
            else {
                break;
            };
            have[h] = true;
            n += 1;
            load[h] += homes[h].model().slot_bytes();
            out.push(Copy {
                layer,
                expert,
                home: h,
            });
        }
    }
    out
}

/// Copies wanted per expert: `replicas` for every expert, and with a ranking (hottest first)
/// one more for the hottest tenth, capped at `homes`.
pub fn copies_wanted(
    order: &[(usize, usize)],
    replicas: usize,
    by_heat: bool,
    homes: usize,
) -> Vec<((usize, usize), usize)> {
    let hot = if by_heat { order.len().div_ceil(10) } else { 0 };
    order
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, (replicas + usize::from(i < hot)).min(homes)))
        .collect()
}

/// The bytes of `(layer, expert)` as the model root holds them: its six tensors, in order,
/// read with positional reads, and their digests.
pub fn read_source(
    table: &ExpertTable,
    layer: usize,
    expert: usize,
) -> Result<(Vec<u8>, CopyDigest), ExpertError> {
    let loc = table.get(layer, expert)?;
    let path = table
        .files
        .get(loc.file)
        .ok_or_else(|| ExpertError::Unavailable {
            layer,
            expert,
            message: format!("file index {} is out of range", loc.file),
        })?;
    let io = |offset: u64, len: u64, source: std::io::Error| ExpertError::Io {
        layer,
        expert,
        path: path.clone(),
        offset,
        len,
        source,
    };
    let f = std::fs::File::open(path).map_err(|e| io(0, 0, e))?;
    let mut bytes = Vec::with_capacity(table.shape.expert_bytes() as usize);
    for &(off, len) in &loc.ranges {
        let at = bytes.len();
        bytes.resize(at + len as usize, 0);
        f.read_exact_at(&mut bytes[at..], off)
            .map_err(|e| io(off, len, e))?;
    }
    let digest = CopyDigest::of(&bytes);
    Ok((bytes, digest))
}

/// Read home `home`'s copy of `(layer, expert)` back from its drive (O_DIRECT where the
/// filesystem allows it, else after dropping the file's cached pages) and return its SHA-256.
pub fn read_copy_sha256(home: &Home, layer: usize, expert: usize) -> Result<[u8; 32], ExpertError> {
    let path = home.layer_path(layer);
    let loc = {
        let mut loc = home.model().slot_location();
        let base = home.slot_offset(expert);
        for r in &mut loc.ranges {
            r.0 += base;
        }
        loc
    };
    let io = |source: std::io::Error| ExpertError::Io {
        layer,
        expert,
        path: path.clone(),
        offset: home.slot_offset(expert),
        len: home.model().expert_bytes(),
        source,
    };
    drop_cached(&path, home.slot_offset(expert), home.model().slot_bytes());
    let file = SourceFile::open(&path, DirectIo::Auto).map_err(io)?;
    let plan = ReadPlan::new(&loc);
    let mut buf = ExpertBuffer::new(plan.buf_len);
    for r in &plan.regions {
        let dst = &mut buf.as_mut_bytes()[r.buf_offset as usize..(r.buf_offset + r.len) as usize];
        let region = crate::layout::Region {
            buf_offset: 0,
            ..*r
        };
        file.read_region(&region, dst).map_err(io)?;
    }
    let n = home.model().expert_bytes() as usize;
    let at = plan.tensor_at[0] as usize;
    Ok(Sha256::digest(&buf.as_mut_bytes()[at..at + n]).into())
}

/// Make one verified copy: write `bytes` (whose digests are `digest`) into the slot of
/// `(layer, expert)` in `home`'s layer file, padded to the slot, sync it, read it back from
/// the drive, and only when the read-back hashes to `sha` append the journal line. A copy
/// that reads back different is an error naming the home and the expert (nothing is
/// journaled, so it is never read).
pub fn place_copy(
    home: &mut Home,
    layer: usize,
    expert: usize,
    bytes: &[u8],
    digest: CopyDigest,
) -> Result<(), ExpertError> {
    let sha = digest.sha256;
    let want = home.model().expert_bytes();
    if bytes.len() as u64 != want {
        return Err(ExpertError::Unavailable {
            layer,
            expert,
            message: format!(
                "the source holds {} bytes, an expert is {want}",
                bytes.len()
            ),
        });
    }
    let path = home.layer_path(layer);
    let offset = home.slot_offset(expert);
    let io = |source: std::io::Error| ExpertError::Io {
        layer,
        expert,
        path: path.clone(),
        offset,
        len: want,
        source,
    };
    let created = !path.exists();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    let mut slot = bytes.to_vec();
    slot.resize(home.model().slot_bytes() as usize, 0);
    f.write_all_at(&slot, offset).map_err(io)?;
    f.sync_data().map_err(io)?;
    drop(f);
    if created && let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    let back = read_copy_sha256(home, layer, expert)?;
    if back != sha {
        return Err(ExpertError::Unavailable {
            layer,
            expert,
            message: format!(
                "expert home {}: the copy read back from {} hashes to {}, the source to {} (a failing drive?); it is not used",
                home.dir.display(),
                path.display(),
                hex::encode(back),
                hex::encode(sha)
            ),
        });
    }
    home.append(Record::Placed {
        layer,
        expert,
        digest,
    })
}

/// What [`check_home`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// Copies read back.
    pub checked: usize,
    /// `(layer, expert, why)` of the copies dropped.
    pub dropped: Vec<(usize, usize, String)>,
}

/// Read every copy `home`'s journal lists back and compare it with its journaled SHA-256;
/// a copy that differs or cannot be read gets a `drop` line (it is never read again).
pub fn check_home(home: &mut Home) -> Result<Checked, ExpertError> {
    let listed: Vec<((usize, usize), [u8; 32])> = home
        .journal()
        .copies
        .iter()
        .map(|(k, v)| (*k, v.sha256))
        .collect();
    let mut dropped = Vec::new();
    for &((layer, expert), sha) in &listed {
        let why = match read_copy_sha256(home, layer, expert) {
            Ok(got) if got == sha => continue,
            Ok(got) => format!(
                "reads back as {}, journaled {}",
                hex::encode(got),
                hex::encode(sha)
            ),
            Err(e) => e.detail(),
        };
        home.append(Record::Dropped { layer, expert })?;
        dropped.push((layer, expert, why));
    }
    Ok(Checked {
        checked: listed.len(),
        dropped,
    })
}

/// Free bytes for an unprivileged writer on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid NUL-terminated path and a zeroed out-parameter of the right type.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut s) != 0 {
            return None;
        }
        Some(s.f_bavail as u64 * s.f_frsize as u64)
    }
}

/// Drop the cached pages of `len` bytes at `offset` of `path`, so that a buffered read-back
/// comes from the drive (Linux; elsewhere the O_DIRECT / F_NOCACHE handle reads past the
/// cache).
fn drop_cached(path: &Path, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    if let Ok(f) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on a valid, owned descriptor; it changes no data.
        unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (path, offset, len);
}
