//! Expert homes: directories on other drives that hold verified copies of routed experts, so
//! that the reads of one token are spread over several drives (docs/K3.md §12.11).
//!
//! A home is a directory (a drive's mount point, or a folder on it) with one subdirectory,
//! [`HOME_SUBDIR`]:
//!
//! ```text
//! DIR/deltafin-experts/home.json      which model the copies are of (format, config sha256,
//!                                     expert and slot bytes, experts per layer, layers)
//! DIR/deltafin-experts/L{layer:03}.experts
//!                                     one file per MoE layer: expert e in the slot at byte
//!                                     e × slot_bytes (slot_bytes = the expert's bytes rounded
//!                                     up to 4096, so every copy is one aligned O_DIRECT read;
//!                                     17,547,264 B on K3, already a multiple); slots of
//!                                     experts a home does not hold are holes
//! DIR/deltafin-experts/placed.v1      the journal: a line per verified copy (and per copy
//!                                     taken back); only what it lists is ever read
//! ```
//!
//! A copy is listed only after its bytes were written, synced, read back from the drive and
//! found equal (SHA-256) to the source ([`place`]); its journal line also records the copy's
//! CRC-32, which every read of it is checked against, so a copy damaged later is never
//! used. Each journal line carries its own checksum, so a line a power loss cut off is
//! ignored, never misread. At run time
//! [`ExpertHomes::open`] refuses a home of another model or a damaged one with an error
//! naming it; the streaming source then reads each expert a home holds from the drive with the
//! fewest bytes outstanding and falls back to another copy (or the model root) when a read
//! fails ([`crate::StreamingExperts::with_homes`]).

pub mod place;

use crate::error::ExpertError;
use crate::layout::{ALIGN, ExpertLocation, ExpertShape};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The subdirectory of a home directory that holds its files.
pub const HOME_SUBDIR: &str = "deltafin-experts";
/// The home's description.
pub const HOME_FILE: &str = "home.json";
/// The journal of verified copies.
pub const JOURNAL_FILE: &str = "placed.v1";
/// `format` of [`HOME_FILE`].
pub const HOME_FORMAT: &str = "deltafin.expert_home.v1";
/// At most this many homes (a holder set is a 32-bit mask).
pub const MAX_HOMES: usize = 32;

/// The layer file of `layer` inside a home's [`HOME_SUBDIR`].
pub fn layer_file_name(layer: usize) -> String {
    format!("L{layer:03}.experts")
}

/// What the copies in a home must be copies of: the model's config digest and expert
/// geometry.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HomeModel {
    /// SHA-256 (hex) of the model's `config.json`.
    pub config_sha256: String,
    /// `moe_intermediate_size` F and `routed_expert_hidden_size` Lr.
    pub f: usize,
    pub lr: usize,
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Decoder layers (MoE and dense).
    pub layers: usize,
}

impl HomeModel {
    /// The expert shape.
    pub fn shape(&self) -> ExpertShape {
        ExpertShape {
            f: self.f,
            lr: self.lr,
        }
    }

    /// Bytes of one expert.
    pub fn expert_bytes(&self) -> u64 {
        self.shape().expert_bytes()
    }

    /// Bytes between the starts of two slots: the expert rounded up to [`ALIGN`].
    pub fn slot_bytes(&self) -> u64 {
        self.expert_bytes().div_ceil(ALIGN) * ALIGN
    }

    /// Where a home copy's six tensors lie in its slot (relative to the slot's start; one
    /// aligned, gap-free region).
    pub fn slot_location(&self) -> ExpertLocation {
        let mut ranges = [(0u64, 0u64); 6];
        let mut at = 0;
        for (r, len) in ranges.iter_mut().zip(self.shape().tensor_bytes()) {
            *r = (at, len);
            at += len;
        }
        ExpertLocation { file: 0, ranges }
    }
}

/// `home.json`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct HomeHeader {
    format: String,
    config_sha256: String,
    f: usize,
    lr: usize,
    num_experts: usize,
    layers: usize,
    expert_bytes: u64,
    slot_bytes: u64,
}

impl HomeHeader {
    fn of(m: &HomeModel) -> HomeHeader {
        HomeHeader {
            format: HOME_FORMAT.into(),
            config_sha256: m.config_sha256.clone(),
            f: m.f,
            lr: m.lr,
            num_experts: m.num_experts,
            layers: m.layers,
            expert_bytes: m.expert_bytes(),
            slot_bytes: m.slot_bytes(),
        }
    }
}

/// The digests of one verified copy: SHA-256 (what placement verified against the source)
/// and CRC-32 (what every read of the copy is checked against, cheap enough for the read
/// path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyDigest {
    pub sha256: [u8; 32],
    pub crc32: u32,
}

impl CopyDigest {
    /// The digests of an expert's bytes.
    pub fn of(bytes: &[u8]) -> CopyDigest {
        CopyDigest {
            sha256: Sha256::digest(bytes).into(),
            crc32: crc32fast::hash(bytes),
        }
    }
}

/// One journal record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// A verified copy of `(layer, expert)` with these digests.
    Placed {
        layer: usize,
        expert: usize,
        digest: CopyDigest,
    },
    /// The copy of `(layer, expert)` is not to be used (found damaged by a check).
    Dropped { layer: usize, expert: usize },
}

impl Record {
    /// The journal line (with its newline): the fields, then the first 16 hex digits of the
    /// SHA-256 of the fields, so that a cut or garbled line never parses.
    pub fn line(&self) -> String {
        let body = match self {
            Record::Placed {
                layer,
                expert,
                digest,
            } => format!(
                "place {layer} {expert} {} {:08x}",
                hex::encode(digest.sha256),
                digest.crc32
            ),
            Record::Dropped { layer, expert } => format!("drop {layer} {expert}"),
        };
        format!("{body} {}\n", line_check(&body))
    }

    /// Parse one line (without its newline); `None` when it is not a whole, intact record.
    pub fn parse(line: &str) -> Option<Record> {
        let (body, check) = line.rsplit_once(' ')?;
        if check != line_check(body) {
            return None;
        }
        let f: Vec<&str> = body.split(' ').collect();
        let num = |s: &str| s.parse::<usize>().ok();
        match f.as_slice() {
            ["place", l, e, sha, crc] => {
                let mut sha256 = [0u8; 32];
                hex::decode_to_slice(sha, &mut sha256).ok()?;
                Some(Record::Placed {
                    layer: num(l)?,
                    expert: num(e)?,
                    digest: CopyDigest {
                        sha256,
                        crc32: u32::from_str_radix(crc, 16).ok()?,
                    },
                })
            }
            ["drop", l, e] => Some(Record::Dropped {
                layer: num(l)?,
                expert: num(e)?,
            }),
            _ => None,
        }
    }
}

fn line_check(body: &str) -> String {
    hex::encode(&Sha256::digest(body.as_bytes())[..8])
}

/// A home's journal, read: the copies it lists and the lines it had to skip.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Journal {
    /// `(layer, expert)` → the digests of the copy (the later record wins).
    pub copies: BTreeMap<(usize, usize), CopyDigest>,
    /// Lines that did not parse (cut off by a power loss, or damaged).
    pub skipped: usize,
}

impl Journal {
    /// Parse a journal's bytes.
    pub fn parse(bytes: &[u8]) -> Journal {
        let mut j = Journal::default();
        for raw in bytes.split(|&b| b == b'\n') {
            if raw.is_empty() {
                continue;
            }
            match std::str::from_utf8(raw).ok().and_then(Record::parse) {
                Some(Record::Placed {
                    layer,
                    expert,
                    digest,
                }) => {
                    j.copies.insert((layer, expert), digest);
                }
                Some(Record::Dropped { layer, expert }) => {
                    j.copies.remove(&(layer, expert));
                }
                None => j.skipped += 1,
            }
        }
        j
    }
}

/// One home, opened: its directory, the model it holds copies of, and its journal.
#[derive(Clone, Debug)]
pub struct Home {
    /// The directory the operator named.
    pub dir: PathBuf,
    model: HomeModel,
    journal: Journal,
}

fn home_err(dir: &Path, message: impl std::fmt::Display) -> ExpertError {
    ExpertError::Setup(format!("expert home {}: {message}", dir.display()))
}

impl Home {
    /// The files' directory, `dir/deltafin-experts`.
    pub fn files_dir(&self) -> PathBuf {
        self.dir.join(HOME_SUBDIR)
    }

    /// The layer file of `layer`.
    pub fn layer_path(&self, layer: usize) -> PathBuf {
        self.files_dir().join(layer_file_name(layer))
    }

    /// The journal's path.
    pub fn journal_path(&self) -> PathBuf {
        self.files_dir().join(JOURNAL_FILE)
    }

    /// Byte offset of `expert`'s slot in its layer file.
    pub fn slot_offset(&self, expert: usize) -> u64 {
        expert as u64 * self.model.slot_bytes()
    }

    /// The model the copies are of.
    pub fn model(&self) -> &HomeModel {
        &self.model
    }

    /// The journal as read at open (plus what this process appended).
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The digests of the copy of `(layer, expert)` the journal lists.
    pub fn digest(&self, layer: usize, expert: usize) -> Option<CopyDigest> {
        self.journal.copies.get(&(layer, expert)).copied()
    }

    /// Whether the journal lists a copy of `(layer, expert)`.
    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        self.journal.copies.contains_key(&(layer, expert))
    }

    /// Bytes of the copies the journal lists.
    pub fn held_bytes(&self) -> u64 {
        self.journal.copies.len() as u64 * self.model.expert_bytes()
    }

    /// Open the home at `dir` for reading: its `home.json` must describe `model`, its journal
    /// is read, and every layer file it lists a copy in must be long enough for that copy.
    /// A directory without a home (a drive not mounted, a wrong path) is an error that says
    /// so.
    pub fn open(dir: &Path, model: &HomeModel) -> Result<Home, ExpertError> {
        let files = dir.join(HOME_SUBDIR);
        if !dir.is_dir() {
            return Err(home_err(
                dir,
                "does not exist or is not a directory (a drive not mounted?)",
            ));
        }
        let header_path = files.join(HOME_FILE);
        let text = match std::fs::read_to_string(&header_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(home_err(
                    dir,
                    format!(
                        "holds no experts ({} is missing: a drive not mounted, or `deltafin place-experts --homes {}` not run yet)",
                        header_path.display(),
                        dir.display()
                    ),
                ));
            }
            Err(e) => return Err(home_err(dir, format!("{}: {e}", header_path.display()))),
        };
        let header: HomeHeader = serde_json::from_str(&text)
            .map_err(|e| home_err(dir, format!("{} is damaged: {e}", header_path.display())))?;
        if header.format != HOME_FORMAT {
            return Err(home_err(
                dir,
                format!(
                    "{} has format {:?}, this build reads {HOME_FORMAT:?}",
                    header_path.display(),
                    header.format
                ),
            ));
        }
        if header != HomeHeader::of(model) {
            return Err(home_err(
                dir,
                format!(
                    "holds experts of another model (config sha256 {}, {} experts of F={} Lr={} per layer, {} layers; this model: {}, {} of F={} Lr={}, {} layers): place them again with `deltafin place-experts`",
                    header.config_sha256,
                    header.num_experts,
                    header.f,
                    header.lr,
                    header.layers,
                    model.config_sha256,
                    model.num_experts,
                    model.f,
                    model.lr,
                    model.layers
                ),
            ));
        }
        let jpath = files.join(JOURNAL_FILE);
        let journal = match std::fs::read(&jpath) {
            Ok(b) => Journal::parse(&b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Journal::default(),
            Err(e) => return Err(home_err(dir, format!("{}: {e}", jpath.display()))),
        };
        let home = Home {
            dir: dir.to_path_buf(),
            model: model.clone(),
            journal,
        };
        // Every listed copy must lie inside the model and inside its layer file.
        let mut last: BTreeMap<usize, usize> = BTreeMap::new();
        for &(l, e) in home.journal.copies.keys() {
            if l >= model.layers || e >= model.num_experts {
                return Err(home_err(
                    dir,
                    format!(
                        "{} lists expert {e} of layer {l}, outside the model ({} layers × {} experts)",
                        jpath.display(),
                        model.layers,
                        model.num_experts
                    ),
                ));
            }
            let m = last.entry(l).or_insert(e);
            *m = (*m).max(e);
        }
        for (&l, &e) in &last {
            let p = home.layer_path(l);
            let need = home.slot_offset(e) + model.expert_bytes();
            let len = std::fs::metadata(&p)
                .map_err(|err| {
                    home_err(
                        dir,
                        format!(
                            "{}: {err} (its journal lists copies in it: the drive is damaged, or the file was removed)",
                            p.display()
                        ),
                    )
                })?
                .len();
            if len < need {
                return Err(home_err(
                    dir,
                    format!(
                        "{} is {len} bytes, but expert {e} of layer {l} ends at byte {need} (the file was cut: check the drive, then `deltafin place-experts --check`)",
                        p.display()
                    ),
                ));
            }
        }
        Ok(home)
    }

    /// A home that holds nothing yet and is not created on disk (what a placement plan of a
    /// new home starts from).
    pub fn empty(dir: &Path, model: &HomeModel) -> Home {
        Home {
            dir: dir.to_path_buf(),
            model: model.clone(),
            journal: Journal::default(),
        }
    }

    /// Whether `dir` holds a home (its `home.json` exists).
    pub fn exists_at(dir: &Path) -> bool {
        dir.join(HOME_SUBDIR).join(HOME_FILE).exists()
    }

    /// Check that this home holds copies of the experts of `table` (the model root's), not
    /// of another checkpoint with the same `config.json`: the first copy whose source file is
    /// present is read from the root and its SHA-256 compared with the journaled one; a
    /// difference is an error naming the home. (Every copy was verified against its source
    /// when placed; this catches a home used with another model.)
    pub fn verify_sample(&self, table: &crate::ExpertTable) -> Result<(), ExpertError> {
        let sample = self.journal.copies.iter().find(|((l, e), _)| {
            table
                .get(*l, *e)
                .ok()
                .and_then(|loc| table.files.get(loc.file))
                .is_some_and(|p| p.is_file())
        });
        let Some((&(l, e), digest)) = sample else {
            return Ok(());
        };
        let (_, root) = place::read_source(table, l, e)?;
        if root.sha256 != digest.sha256 {
            return Err(home_err(
                &self.dir,
                format!(
                    "holds experts of another model: its copy of expert {e} of layer {l} has SHA-256 {}, the model root's {} (a checkpoint with the same config.json but other weights): place them again with `deltafin place-experts`",
                    hex::encode(digest.sha256),
                    hex::encode(root.sha256)
                ),
            ));
        }
        Ok(())
    }

    /// Open the home at `dir` for placing copies: create `deltafin-experts/home.json` for
    /// `model` when the directory holds no home yet (written to a temporary name, synced,
    /// renamed), else open it as [`Home::open`] does (a home of another model is refused).
    pub fn create_or_open(dir: &Path, model: &HomeModel) -> Result<Home, ExpertError> {
        let files = dir.join(HOME_SUBDIR);
        if !files.join(HOME_FILE).exists() {
            if !dir.is_dir() {
                return Err(home_err(
                    dir,
                    "does not exist or is not a directory (create it on the drive first)",
                ));
            }
            std::fs::create_dir_all(&files)
                .map_err(|e| home_err(dir, format!("cannot create {}: {e}", files.display())))?;
            let json = serde_json::to_string_pretty(&HomeHeader::of(model))
                .map_err(|e| home_err(dir, e))?;
            write_synced(&files.join(HOME_FILE), json.as_bytes())
                .map_err(|e| home_err(dir, format!("cannot write {HOME_FILE}: {e}")))?;
        }
        Home::open(dir, model)
    }

    /// Append `record` to the journal (one write, then `fsync`) and apply it.
    pub fn append(&mut self, record: Record) -> Result<(), ExpertError> {
        let path = self.journal_path();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| home_err(&self.dir, format!("{}: {e}", path.display())))?;
        f.write_all(record.line().as_bytes())
            .and_then(|()| f.sync_data())
            .map_err(|e| home_err(&self.dir, format!("{}: {e}", path.display())))?;
        match record {
            Record::Placed {
                layer,
                expert,
                digest,
            } => {
                self.journal.copies.insert((layer, expert), digest);
            }
            Record::Dropped { layer, expert } => {
                self.journal.copies.remove(&(layer, expert));
            }
        }
        Ok(())
    }
}

/// Write `bytes` to `path` durably: a temporary name, `fsync`, rename, `fsync` of the
/// directory.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(d) = path.parent() {
        std::fs::File::open(d)?.sync_all()?;
    }
    Ok(())
}

/// The homes of a run, opened: which home holds which expert.
#[derive(Clone, Debug)]
pub struct ExpertHomes {
    homes: Vec<Home>,
    model: HomeModel,
    /// Per layer, per expert: the mask of homes holding a copy.
    holders: Vec<Vec<u32>>,
}

impl ExpertHomes {
    /// Open every directory of `dirs` ([`Home::open`]); the same directory twice, or more
    /// than [`MAX_HOMES`], is an error.
    pub fn open(dirs: &[PathBuf], model: &HomeModel) -> Result<ExpertHomes, ExpertError> {
        if dirs.len() > MAX_HOMES {
            return Err(ExpertError::Setup(format!(
                "{} expert homes given, at most {MAX_HOMES} are supported",
                dirs.len()
            )));
        }
        let mut seen: Vec<PathBuf> = Vec::new();
        for d in dirs {
            let canon = d.canonicalize().unwrap_or_else(|_| d.clone());
            if seen.contains(&canon) {
                return Err(home_err(d, "is named twice"));
            }
            seen.push(canon);
        }
        let homes = dirs
            .iter()
            .map(|d| Home::open(d, model))
            .collect::<Result<Vec<_>, _>>()?;
        let mut holders = vec![vec![0u32; model.num_experts]; model.layers];
        for (h, home) in homes.iter().enumerate() {
            for &(l, e) in home.journal.copies.keys() {
                holders[l][e] |= 1 << h;
            }
        }
        Ok(ExpertHomes {
            homes,
            model: model.clone(),
            holders,
        })
    }

    /// The homes, in the order given.
    pub fn homes(&self) -> &[Home] {
        &self.homes
    }

    /// The model they hold copies of.
    pub fn model(&self) -> &HomeModel {
        &self.model
    }

    /// The mask of homes (bit `h` = `homes()[h]`) holding `(layer, expert)`; 0 for none.
    pub fn holders(&self, layer: usize, expert: usize) -> u32 {
        self.holders
            .get(layer)
            .and_then(|l| l.get(expert))
            .copied()
            .unwrap_or(0)
    }

    /// Whether some home holds `(layer, expert)`.
    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        self.holders(layer, expert) != 0
    }

    /// Check that the homes hold copies of the experts of `table` (the model root's), not of
    /// another checkpoint with the same `config.json` ([`Home::verify_sample`]).
    pub fn verify_sample(&self, table: &crate::ExpertTable) -> Result<(), ExpertError> {
        self.homes.iter().try_for_each(|h| h.verify_sample(table))
    }

    /// Copies over all homes.
    pub fn copies(&self) -> usize {
        self.homes.iter().map(|h| h.journal.copies.len()).sum()
    }

    /// Distinct experts held by at least one home.
    pub fn experts_held(&self) -> usize {
        self.holders.iter().flatten().filter(|m| **m != 0).count()
    }
}

#[cfg(test)]
mod tests;
