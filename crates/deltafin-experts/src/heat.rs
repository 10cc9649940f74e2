//! The persistent expert heat histogram (docs/K3.md §12.8): `k3-meta/expert_heat.v1.bin`.
//!
//! ```text
//! per committed pass p with route sets U_l (the union of the pass's routes at MoE layer l):
//!     d = 2^(−1/8192)                                  half-life 8192 passes
//!     heat[l, e] ← d · heat[l, e] + [e ∈ U_l]          once per pass, not per row
//!     mass       ← d · mass + 1                        the decayed pass count
//! pin candidate: mass ≥ 256 and heat[l, e] / mass ≥ 2 · top_k / E   (twice the uniform rate)
//! ```
//!
//! File layout (little-endian): a 48-byte header
//!
//! | offset | field |
//! |---:|---|
//! | 0 | magic `K3HEATv1` |
//! | 8 | u32 version = 1 |
//! | 12 | u32 MoE layers `L` (config layers − 1) |
//! | 16 | u32 experts per layer `E` |
//! | 20 | u32 routed experts per token `k` |
//! | 24 | f64 decayed pass mass |
//! | 32 | u64 passes ever recorded |
//! | 40 | u32 half-life in passes (8192) |
//! | 44 | u32 reserved, 0 |
//!
//! then `L × E` f32 heats, layer-major, slot `(layer − 1) × E + expert`, then the SHA-256 of
//! everything before it (32 bytes). For K3 (92 × 896) the file is 329,808 bytes.
//!
//! Writers ([`HeatRecorder`]) keep only what they learned since their last flush and merge it
//! under an exclusive `flock` on `expert_heat.v1.bin.lock`: the file on disk is aged by the
//! writer's pass count, the writer's own decayed increments are added, and the result goes to
//! `expert_heat.v1.bin.tmp` and is renamed over the file. Concurrent processes therefore add
//! up instead of overwriting each other. Reading fails **open**: a missing, short, corrupt,
//! digest-mismatched or wrong-dimension file means "nothing learned" plus one warning line.

use crate::observe::{PassRoutes, RouteObserver};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The histogram's path under the model root.
pub const HEAT_FILE: &str = "k3-meta/expert_heat.v1.bin";
/// File magic.
pub const MAGIC: &[u8; 8] = b"K3HEATv1";
/// Format version.
pub const VERSION: u32 = 1;
/// Header bytes.
pub const HEADER_BYTES: usize = 48;
/// Digest bytes at the end.
pub const DIGEST_BYTES: usize = 32;
/// Half-life of a route's heat, in committed passes.
pub const HALF_LIFE_PASSES: u32 = 8192;
/// A recorder merges into the file after this many passes (and when it is dropped).
pub const FLUSH_EVERY_PASSES: u64 = 64;
/// No pin candidates before this much decayed pass mass.
pub const PIN_MIN_MASS: f64 = 256.0;
/// A pin candidate is routed at least this many times the uniform rate `k / E`.
pub const PIN_RATE_FACTOR: f64 = 2.0;

/// Per-pass decay factor `2^(−1/H)`.
pub fn decay_per_pass() -> f64 {
    (-1.0 / f64::from(HALF_LIFE_PASSES)).exp2()
}

/// The shape of a histogram: MoE layers `1..=layers`, `experts` per layer, top-`k` routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeatDims {
    /// MoE layers (the config's layer count − 1; layer 0 is the dense MLP).
    pub layers: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Routed experts per token.
    pub top_k: usize,
}

impl HeatDims {
    /// Heats in the table.
    pub fn slots(&self) -> usize {
        self.layers * self.experts
    }

    /// File size in bytes.
    pub fn file_bytes(&self) -> usize {
        HEADER_BYTES + 4 * self.slots() + DIGEST_BYTES
    }

    /// Slot of `(layer, expert)`: `(layer − 1) × E + expert`, `None` outside the table.
    pub fn slot(&self, layer: usize, expert: usize) -> Option<usize> {
        (layer >= 1 && layer <= self.layers && expert < self.experts)
            .then(|| (layer - 1) * self.experts + expert)
    }
}

/// A decayed route histogram.
#[derive(Clone, Debug, PartialEq)]
pub struct HeatTable {
    pub dims: HeatDims,
    /// Decayed count of committed passes.
    pub mass: f64,
    /// Passes ever recorded (not decayed).
    pub passes: u64,
    /// `heat[(layer − 1) × E + expert]`.
    pub heat: Vec<f64>,
}

impl HeatTable {
    /// Nothing learned.
    pub fn empty(dims: HeatDims) -> HeatTable {
        HeatTable {
            dims,
            mass: 0.0,
            passes: 0,
            heat: vec![0.0; dims.slots()],
        }
    }

    /// Heat of `(layer, expert)` (0 outside the table).
    pub fn get(&self, layer: usize, expert: usize) -> f64 {
        self.dims
            .slot(layer, expert)
            .and_then(|s| self.heat.get(s).copied())
            .unwrap_or(0.0)
    }

    /// Record one committed pass whose route set at MoE layer `l` is `sets[i] = (l, U_l)`.
    /// Each expert counts once per pass however many rows chose it.
    pub fn record_pass<'a>(&mut self, sets: impl IntoIterator<Item = (usize, &'a [usize])>) {
        self.age(1);
        self.mass += 1.0;
        // A count read from a file may be anywhere up to u64::MAX: it stops there.
        self.passes = self.passes.saturating_add(1);
        let mut seen = vec![false; self.heat.len()];
        for (layer, experts) in sets {
            for &e in experts {
                if let Some(s) = self.dims.slot(layer, e)
                    && !std::mem::replace(&mut seen[s], true)
                {
                    self.heat[s] += 1.0;
                }
            }
        }
    }

    /// Age the table by `passes` passes without recording anything.
    pub fn age(&mut self, passes: u64) {
        if passes == 0 {
            return;
        }
        let d = (-(passes as f64) / f64::from(HALF_LIFE_PASSES)).exp2();
        self.mass *= d;
        for h in &mut self.heat {
            *h *= d;
        }
    }

    /// Pin candidates, hottest first: none before [`PIN_MIN_MASS`], then every expert routed
    /// at least [`PIN_RATE_FACTOR`] × `k / E` of the passes. Ties break by (layer, expert).
    pub fn pin_candidates(&self) -> Vec<(usize, usize)> {
        if self.mass < PIN_MIN_MASS || self.dims.experts == 0 {
            return Vec::new();
        }
        let uniform = self.dims.top_k as f64 / self.dims.experts as f64;
        let floor = PIN_RATE_FACTOR * uniform * self.mass;
        let mut c: Vec<(f64, usize)> = self
            .heat
            .iter()
            .enumerate()
            .filter(|(_, h)| **h >= floor)
            .map(|(s, h)| (*h, s))
            .collect();
        c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        c.into_iter()
            .map(|(_, s)| (s / self.dims.experts + 1, s % self.dims.experts))
            .collect()
    }

    /// The file bytes (header, f32 heats, SHA-256).
    pub fn encode(&self) -> Vec<u8> {
        let d = self.dims;
        let mut b = Vec::with_capacity(d.file_bytes());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        for v in [d.layers, d.experts, d.top_k] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        b.extend_from_slice(&self.mass.to_le_bytes());
        b.extend_from_slice(&self.passes.to_le_bytes());
        b.extend_from_slice(&HALF_LIFE_PASSES.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for h in &self.heat {
            b.extend_from_slice(&(*h as f32).to_le_bytes());
        }
        let digest = Sha256::digest(&b);
        b.extend_from_slice(&digest);
        b
    }

    /// Parse file bytes for a model of shape `dims`; the error says what is wrong.
    pub fn decode(bytes: &[u8], dims: HeatDims) -> Result<HeatTable, String> {
        if bytes.len() < HEADER_BYTES + DIGEST_BYTES {
            return Err(format!(
                "{} bytes, shorter than a header and a digest",
                bytes.len()
            ));
        }
        if &bytes[..8] != MAGIC {
            return Err("bad magic (not a K3HEATv1 file)".into());
        }
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&bytes[o..o + 4]);
            u32::from_le_bytes(a)
        };
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let version = u32_at(8);
        if version != VERSION {
            return Err(format!("version {version}, expected {VERSION}"));
        }
        let (layers, experts, top_k) = (u32_at(12) as usize, u32_at(16) as usize, u32_at(20));
        if (layers, experts, top_k as usize) != (dims.layers, dims.experts, dims.top_k) {
            return Err(format!(
                "dimensions {layers} layers × {experts} experts, top-{top_k}; this model has {} × {}, top-{}",
                dims.layers, dims.experts, dims.top_k
            ));
        }
        if bytes.len() != dims.file_bytes() {
            return Err(format!(
                "{} bytes, expected {} for {layers} × {experts}",
                bytes.len(),
                dims.file_bytes()
            ));
        }
        let body = bytes.len() - DIGEST_BYTES;
        if Sha256::digest(&bytes[..body]).as_slice() != &bytes[body..] {
            return Err("SHA-256 digest mismatch (corrupt file)".into());
        }
        let half_life = u32_at(40);
        if half_life != HALF_LIFE_PASSES {
            return Err(format!(
                "half-life {half_life} passes, expected {HALF_LIFE_PASSES}"
            ));
        }
        let mass = f64::from_bits(u64_at(24));
        if !mass.is_finite() || mass < 0.0 {
            return Err(format!("pass mass {mass} is not a finite number ≥ 0"));
        }
        let mut heat = Vec::with_capacity(dims.slots());
        for (i, c) in bytes[HEADER_BYTES..body].chunks_exact(4).enumerate() {
            let h = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if !h.is_finite() || h < 0.0 || f64::from(h) > mass * (1.0 + 1e-5) + 1e-3 {
                return Err(format!(
                    "heat of layer {} expert {} is {h}, outside [0, pass mass {mass}]",
                    i / experts.max(1) + 1,
                    i % experts.max(1)
                ));
            }
            heat.push(f64::from(h));
        }
        Ok(HeatTable {
            dims,
            mass,
            passes: u64_at(32),
            heat,
        })
    }
}

/// What reading the histogram gave: always a table (empty when nothing could be read) and,
/// when the file was absent or unusable, one line saying why.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub table: HeatTable,
    /// `None` when the file was read; otherwise the reason it was not.
    pub note: Option<String>,
}

/// Read `path` for shape `dims`, failing open.
pub fn load(path: &Path, dims: HeatDims) -> Loaded {
    match std::fs::read(path) {
        Ok(bytes) => match HeatTable::decode(&bytes, dims) {
            Ok(table) => Loaded { table, note: None },
            Err(why) => Loaded {
                table: HeatTable::empty(dims),
                note: Some(format!(
                    "expert heat histogram {} ignored ({why}); starting with nothing learned",
                    path.display()
                )),
            },
        },
        Err(e) => Loaded {
            table: HeatTable::empty(dims),
            note: Some(if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "no expert heat histogram at {} yet; starting with nothing learned",
                    path.display()
                )
            } else {
                format!(
                    "expert heat histogram {} unreadable ({e}); starting with nothing learned",
                    path.display()
                )
            }),
        },
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// An exclusive `flock` held until dropped.
struct FileLock(File);

impl FileLock {
    fn acquire(path: &Path) -> std::io::Result<FileLock> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        use std::os::fd::AsRawFd;
        loop {
            // SAFETY: `flock` on a descriptor this function owns; no memory is passed.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(FileLock(f));
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking the descriptor locked in `acquire`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Merge `pending` (what one writer learned over `pending.passes` passes since its last
/// flush) into the file at `path` under its lock: the file is aged by those passes and the
/// pending heats are added; written to `.tmp` and renamed over the file. A file that cannot
/// be read counts as nothing learned.
pub fn merge_into_file(path: &Path, pending: &HeatTable) -> std::io::Result<()> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    let _lock = FileLock::acquire(&with_suffix(path, ".lock"))?;
    let mut table = match std::fs::read(path) {
        Ok(b) => {
            HeatTable::decode(&b, pending.dims).unwrap_or_else(|_| HeatTable::empty(pending.dims))
        }
        Err(_) => HeatTable::empty(pending.dims),
    };
    table.age(pending.passes);
    table.mass += pending.mass;
    table.passes = table.passes.saturating_add(pending.passes);
    for (h, p) in table.heat.iter_mut().zip(&pending.heat) {
        *h += p;
    }
    let tmp = with_suffix(path, ".tmp");
    let written = (|| {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // No fsync on the inference thread: a file torn by a crash fails its digest and
        // reads as nothing learned.
        f.write_all(&table.encode())
    })();
    if let Err(e) = written {
        // A full disk: the half-written temporary would only hold on to the space.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)
}

struct Recorder {
    /// Learned since the last flush (its `passes` = passes since then).
    pending: HeatTable,
    /// The pass being assembled: route sets per layer.
    current: Vec<(usize, Vec<usize>)>,
    last_layer: Option<usize>,
    failed: bool,
}

/// A [`RouteObserver`] that counts every pass's route sets (each layer's route union) into
/// the histogram file at `path` (flushing every [`FLUSH_EVERY_PASSES`] passes and when
/// dropped). Failures to write are one warning line, never an error.
pub struct HeatRecorder {
    path: PathBuf,
    rec: Mutex<Recorder>,
}

impl HeatRecorder {
    /// Record into `path` (created on the first flush).
    pub fn new(path: PathBuf, dims: HeatDims) -> HeatRecorder {
        HeatRecorder {
            path,
            rec: Mutex::new(Recorder {
                pending: HeatTable::empty(dims),
                current: Vec::new(),
                last_layer: None,
                failed: false,
            }),
        }
    }

    /// Commit the pass being assembled and merge everything pending into the file.
    pub fn flush(&self) {
        let mut r = self.rec.lock().unwrap_or_else(|p| p.into_inner());
        commit(&mut r);
        self.write(&mut r);
    }

    fn write(&self, r: &mut Recorder) {
        if r.pending.passes == 0 {
            return;
        }
        match merge_into_file(&self.path, &r.pending) {
            Ok(()) => {
                r.pending = HeatTable::empty(r.pending.dims);
            }
            Err(e) => {
                if !std::mem::replace(&mut r.failed, true) {
                    eprintln!(
                        "deltafin: warning: cannot update the expert heat histogram {}: {e}",
                        self.path.display()
                    );
                }
                // The file is unwritable: drop what is pending rather than grow it; the next
                // flush tries again with the passes after this one.
                r.pending = HeatTable::empty(r.pending.dims);
            }
        }
    }
}

fn commit(r: &mut Recorder) {
    if r.current.is_empty() {
        return;
    }
    let sets = std::mem::take(&mut r.current);
    r.pending
        .record_pass(sets.iter().map(|(l, u)| (*l, u.as_slice())));
    r.last_layer = None;
}

impl Drop for HeatRecorder {
    fn drop(&mut self) {
        self.flush();
    }
}

impl HeatRecorder {
    /// Count `union`, the route union of `layer` in the pass being assembled.
    pub fn record_layer(&self, layer: usize, union: &[usize]) {
        let mut r = self.rec.lock().unwrap_or_else(|p| p.into_inner());
        // A layer at or below the previous one starts a new pass.
        if r.last_layer.is_some_and(|prev| layer <= prev) {
            commit(&mut r);
            if r.pending.passes >= FLUSH_EVERY_PASSES {
                self.write(&mut r);
            }
        }
        r.last_layer = Some(layer);
        r.current.push((layer, union.to_vec()));
    }
}

impl RouteObserver for HeatRecorder {
    fn observe(&self, routes: &PassRoutes<'_>) {
        self.record_layer(routes.layer, routes.union);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_support::DIMS;

    #[test]
    fn k3_file_size_is_the_contract_size() {
        let k3 = HeatDims {
            layers: 92,
            experts: 896,
            top_k: 16,
        };
        assert_eq!(k3.file_bytes(), 329_808);
        assert_eq!(HeatTable::empty(k3).encode().len(), 329_808);
        assert_eq!(k3.slot(92, 895), Some(92 * 896 - 1));
        assert_eq!(
            (k3.slot(0, 0), k3.slot(93, 0), k3.slot(1, 896)),
            (None, None, None)
        );
    }

    #[test]
    fn round_trip_and_layout() {
        let mut t = HeatTable::empty(DIMS);
        t.record_pass([(1, &[0usize, 3][..]), (3, &[7][..])]);
        t.record_pass([(1, &[3usize, 3, 3][..])]);
        let b = t.encode();
        assert_eq!(b.len(), DIMS.file_bytes());
        assert_eq!(&b[..8], b"K3HEATv1");
        // Slot (layer − 1) × E + expert, layer-major f32.
        let at = |s: usize| {
            let o = HEADER_BYTES + 4 * s;
            f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
        };
        let d = decay_per_pass();
        assert_eq!(
            at(3),
            (d + 1.0) as f32,
            "counted once per pass, not per row"
        );
        assert_eq!(at(2 * 8 + 7), d as f32);
        let back = HeatTable::decode(&b, DIMS).unwrap();
        assert_eq!(back.passes, 2);
        assert_eq!(back.mass, t.mass);
        assert_eq!(back.get(1, 3), f64::from((d + 1.0) as f32));
    }

    #[test]
    fn decay_math() {
        let mut t = HeatTable::empty(DIMS);
        t.record_pass([(2, &[5usize][..])]);
        t.age(u64::from(HALF_LIFE_PASSES));
        assert!((t.get(2, 5) - 0.5).abs() < 1e-12);
        assert!((t.mass - 0.5).abs() < 1e-12);
        // The steady state of an expert routed every pass equals the mass: 1 / (1 − d).
        let mut t = HeatTable::empty(DIMS);
        for _ in 0..20_000 {
            t.record_pass([(1, &[1usize][..])]);
        }
        assert_eq!(t.get(1, 1), t.mass);
        let limit = 1.0 / (1.0 - decay_per_pass());
        let want = limit * (1.0 - decay_per_pass().powi(20_000));
        assert!((t.mass - want).abs() < 1e-6 * want, "{} vs {want}", t.mass);
    }

    #[test]
    fn pin_candidates_need_mass_and_twice_the_uniform_rate() {
        let mut t = HeatTable::empty(DIMS);
        // Uniform rate 2/8 = 25%: candidates need ≥ 50% of the passes.
        for p in 0..300usize {
            let mut l1 = vec![1usize];
            if p % 4 < 3 {
                l1.push(2); // 75%
            }
            if p % 5 < 2 {
                l1.push(4); // 40%: not a candidate
            }
            t.record_pass([(1, l1.as_slice()), (3, &[6usize][..])]);
            if p == 200 {
                assert!(t.pin_candidates().is_empty(), "before 256 passes of mass");
            }
        }
        assert_eq!(t.pin_candidates(), vec![(1, 1), (3, 6), (1, 2)]);
    }

    #[test]
    fn corruption_fails_open_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.bin");
        let l = load(&p, DIMS);
        assert_eq!(l.table, HeatTable::empty(DIMS));
        assert!(l.note.unwrap().contains("no expert heat histogram"));
        let mut t = HeatTable::empty(DIMS);
        t.record_pass([(1, &[1usize][..])]);
        let good = t.encode();
        std::fs::write(&p, &good).unwrap();
        let l = load(&p, DIMS);
        assert!(l.note.is_none());
        assert_eq!(l.table.passes, 1);
        let mut flipped = good.clone();
        flipped[HEADER_BYTES + 5] ^= 1;
        let other = HeatDims { experts: 9, ..DIMS };
        for (bytes, dims, why) in [
            (good[..40].to_vec(), DIMS, "shorter than a header"),
            (good[..good.len() - 1].to_vec(), DIMS, "bytes, expected"),
            (flipped, DIMS, "digest mismatch"),
            (good.clone(), other, "this model has 3 × 9"),
            ([b"K3HEATv2", &good[8..]].concat(), DIMS, "bad magic"),
        ] {
            std::fs::write(&p, &bytes).unwrap();
            let l = load(&p, dims);
            assert_eq!(l.table, HeatTable::empty(dims));
            let note = l.note.unwrap();
            assert!(
                note.contains(why) && note.contains("nothing learned"),
                "{note}"
            );
        }
        // A writer over a corrupt file starts from nothing.
        std::fs::write(&p, b"garbage").unwrap();
        merge_into_file(&p, &t).unwrap();
        assert_eq!(load(&p, DIMS).table.passes, 1);
    }

    #[test]
    fn recorder_counts_passes_and_flushes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k3-meta").join("expert_heat.v1.bin");
        let r = HeatRecorder::new(p.clone(), DIMS);
        for pass in 0..FLUSH_EVERY_PASSES + 1 {
            r.record_layer(1, &[0, 1]);
            r.record_layer(2, &[(pass % 8) as usize]);
        }
        // The 65th pass is still being assembled; the first 64 were flushed.
        assert_eq!(load(&p, DIMS).table.passes, FLUSH_EVERY_PASSES);
        drop(r);
        let t = load(&p, DIMS).table;
        assert_eq!(t.passes, FLUSH_EVERY_PASSES + 1);
        assert!((t.get(1, 0) - t.mass).abs() < 1e-3);
        assert!(t.get(2, 3) > 7.0 && t.get(2, 3) < 9.0);
        assert!(!dir.path().join("k3-meta/expert_heat.v1.bin.tmp").exists());
    }

    #[test]
    fn an_unwritable_histogram_is_a_warning_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("k3-meta");
        std::fs::write(&blocker, b"a file where the directory should be").unwrap();
        let r = HeatRecorder::new(blocker.join("expert_heat.v1.bin"), DIMS);
        for _ in 0..2 * FLUSH_EVERY_PASSES {
            r.record_layer(1, &[0]);
        }
        r.flush();
        drop(r);
        assert!(blocker.is_file());
    }

    #[test]
    fn concurrent_writers_add_up_without_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("expert_heat.v1.bin");
        let threads: Vec<_> = (0..4)
            .map(|w| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let r = HeatRecorder::new(p, DIMS);
                    for _ in 0..300 {
                        r.record_layer(1, &[w]);
                        r.record_layer(3, &[7]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let l = load(&p, DIMS);
        assert!(l.note.is_none(), "{:?}", l.note);
        let t = l.table;
        assert_eq!(t.passes, 1200);
        // Every pass routed (3, 7); each writer's expert got a quarter of them.
        assert!((t.get(3, 7) - t.mass).abs() < 1e-2 * t.mass);
        for w in 0..4 {
            let share = t.get(1, w) / t.mass;
            // Writers that finished early aged by up to 900 later passes (2^(−900/8192)).
            assert!((share - 0.25).abs() < 0.03, "writer {w}: {share}");
        }
    }
}
