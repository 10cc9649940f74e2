//! [`copy_to_anonymous`]: resident weights copied into one anonymous mapping advised for
//! transparent huge pages, read from their files with large explicit reads.
//!
//! A view of a [`FileMapping`] is not copied through the mapping (page faults, one 4 KiB page
//! at a time, readahead permitting) but read from its file with `pread` straight into its
//! place in the new mapping: 16 MiB reads, four in flight, each file's ranges in file order,
//! with O_DIRECT where the filesystem takes it (no page-cache copy, the device's full
//! sequential speed) and buffered reads where it does not or where the range is already in the
//! page cache. For that, a view read from a file sits at the same offset modulo 4 KiB in the
//! new mapping as in its file, and every run of views that follow each other in one file gets
//! whole 4 KiB blocks of its own: the reads then cover whole blocks, aligned in the file and in
//! memory, and fill nothing but padding around the run. Views over other owners are copied
//! from memory at [`ANON_ALIGN`] offsets.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::direct::{DIRECT_ALIGN, is_refusal, open_direct, read_full_at};
use super::{ByteOwner, Bytes, FileMapping};

/// Alignment of every view [`copy_to_anonymous`] copies from memory: a cache line, which
/// keeps 512-bit loads of a row start aligned wherever the source had them so. A view read
/// from its file keeps its file offset modulo 4 KiB, which is its alignment in the file
/// mapping, so it is aligned exactly as its source too.
pub const ANON_ALIGN: usize = 64;

/// Bytes of one read from a file (a multiple of [`DIRECT_ALIGN`]).
const READ_CHUNK: usize = 16 << 20;

/// Bytes of one piece copied from memory (its source is released after each).
const MEMORY_CHUNK: usize = 8 << 20;

/// Reads (or memory copies) in flight.
const WORKERS: usize = 4;

/// A file range at least this much in the page cache is read buffered (a memory copy by the
/// kernel) rather than with O_DIRECT (from the device again).
const CACHED_ENOUGH: f64 = 0.9;

/// One anonymous mapping holding copies of resident weights ([`copy_to_anonymous`]).
struct AnonArena(memmap2::MmapMut);

impl ByteOwner for AnonArena {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Copies made by [`copy_to_anonymous`].
#[derive(Debug)]
pub struct AnonCopies {
    /// One view per part, in order, each with the part's bytes.
    pub views: Vec<Bytes>,
    /// Size of the mapping (the parts and the padding that aligns them).
    pub mapped: usize,
    /// Whether the kernel accepted the transparent-huge-page advice for the mapping.
    pub huge_advised: bool,
    /// How the bytes arrived.
    pub stats: CopyStats,
}

/// How [`copy_to_anonymous`] filled its mapping.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CopyStats {
    /// Bytes read from files with O_DIRECT.
    pub direct_bytes: u64,
    /// Bytes read from files with buffered reads.
    pub buffered_bytes: u64,
    /// Bytes copied from memory (views not over a file mapping, or over a file replaced on
    /// disk since it was mapped).
    pub memory_bytes: u64,
    /// Seconds from mapping the memory to the last byte in place.
    pub seconds: f64,
    /// Why reads were buffered where O_DIRECT was wanted (the filesystem refused it).
    pub direct_refused: Option<String>,
    /// The file most of the read bytes came from, and how many.
    pub largest_file: Option<(PathBuf, u64)>,
}

impl CopyStats {
    /// Bytes read from files.
    pub fn read_bytes(&self) -> u64 {
        self.direct_bytes + self.buffered_bytes
    }

    /// All bytes placed.
    pub fn total_bytes(&self) -> u64 {
        self.read_bytes() + self.memory_bytes
    }

    /// `direct 1.234 GB, buffered 0.001 GB, memory 0.000 GB` (with the refusal, if any).
    pub fn describe(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let mut s = format!(
            "read {:.3} GB with O_DIRECT, {:.3} GB buffered, copied {:.3} GB from memory in {:.2} s",
            gb(self.direct_bytes),
            gb(self.buffered_bytes),
            gb(self.memory_bytes),
            self.seconds
        );
        if let Some(why) = &self.direct_refused {
            s.push_str(&format!(" (O_DIRECT refused: {why})"));
        }
        s
    }
}

/// Where a run of parts comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Bytes `offset..offset + len` of the file that part `part` maps.
    File { part: usize, offset: u64 },
    /// Copied from the memory of part `part`.
    Memory { part: usize },
}

/// Parts placed back to back: one or more views that follow each other in one file, or one
/// view copied from memory.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Run {
    source: Source,
    /// Arena offset of the run's first byte.
    at: usize,
    /// Bytes of the run (its parts together).
    len: usize,
}

impl Run {
    /// The file offset of arena offset `arena_at` of a file run's footprint.
    fn file_at(&self, offset: u64, arena_at: usize) -> u64 {
        // `arena_at` ≥ the block start `at - at % 4096`, and `offset % 4096 == at % 4096`.
        offset + arena_at as u64 - self.at as u64
    }

    /// The arena range the run's reads fill: its bytes, widened to whole blocks for a file run.
    fn footprint(&self) -> Range<usize> {
        match self.source {
            Source::File { .. } => {
                let start = self.at / DIRECT_ALIGN * DIRECT_ALIGN;
                let end = (self.at + self.len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                start..end
            }
            Source::Memory { .. } => self.at..self.at + self.len,
        }
    }
}

/// Where every part goes.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    offsets: Vec<usize>,
    runs: Vec<Run>,
    total: usize,
}

fn too_large() -> io::Error {
    io::Error::other("weights too large to copy")
}

fn round_up(x: usize, to: usize) -> io::Result<usize> {
    x.checked_next_multiple_of(to).ok_or_else(too_large)
}

/// Place `parts` (see the module docs): a part that continues the previous file run goes
/// right after it; a part over another file range starts a run in a fresh block, at its
/// file offset modulo [`DIRECT_ALIGN`]; any other part goes at the next [`ANON_ALIGN`]
/// multiple.
fn layout(parts: &[Bytes]) -> io::Result<Layout> {
    let mut offsets = Vec::with_capacity(parts.len());
    let mut runs: Vec<Run> = Vec::new();
    let mut cursor = 0usize;
    for (i, p) in parts.iter().enumerate() {
        let len = p.len();
        match p.file_origin() {
            Some((_, off)) if len > 0 => {
                if let Some(r) = runs.last_mut()
                    && let Source::File { part, offset } = r.source
                    && parts[part].same_owner(p)
                    && offset.checked_add(r.len as u64) == Some(off)
                {
                    offsets.push(r.at + r.len);
                    r.len = r.len.checked_add(len).ok_or_else(too_large)?;
                    let end = r.at.checked_add(r.len).ok_or_else(too_large)?;
                    cursor = round_up(end, DIRECT_ALIGN)?;
                    continue;
                }
                let at = round_up(cursor, DIRECT_ALIGN)? + (off % DIRECT_ALIGN as u64) as usize;
                offsets.push(at);
                runs.push(Run {
                    source: Source::File {
                        part: i,
                        offset: off,
                    },
                    at,
                    len,
                });
                cursor = round_up(at.checked_add(len).ok_or_else(too_large)?, DIRECT_ALIGN)?;
            }
            _ => {
                let at = round_up(cursor, ANON_ALIGN)?;
                offsets.push(at);
                if len > 0 {
                    runs.push(Run {
                        source: Source::Memory { part: i },
                        at,
                        len,
                    });
                }
                cursor = round_up(at.checked_add(len).ok_or_else(too_large)?, ANON_ALIGN)?;
            }
        }
    }
    Ok(Layout {
        offsets,
        runs,
        total: cursor,
    })
}

/// One read or memory copy: fills `dest`, of which `useful` holds the run's bytes.
struct Job<'a> {
    run: usize,
    /// Arena offset of `dest`.
    at: usize,
    dest: &'a mut [u8],
    useful: Range<usize>,
    /// Whether the run is read with O_DIRECT (false: buffered).
    direct: bool,
}

/// The jobs of `runs` over `arena`, in the order to run them: each file's ranges in file
/// order (files in order of first use), then the memory copies.
fn jobs<'a>(
    arena: &'a mut [u8],
    parts: &[Bytes],
    runs: &[Run],
    direct: &[bool],
) -> Vec<Mutex<Option<Job<'a>>>> {
    // Pieces sorted by arena offset, so that the arena splits into them front to back.
    let mut pieces: Vec<(usize, Range<usize>, Range<usize>)> = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        let span = run.footprint();
        let chunk = match run.source {
            Source::File { .. } => READ_CHUNK,
            Source::Memory { .. } => MEMORY_CHUNK,
        };
        let mut s = span.start;
        while s < span.end {
            let e = (s + chunk).min(span.end);
            let useful = s.max(run.at) - s..e.min(run.at + run.len) - s;
            pieces.push((r, s..e, useful));
            s = e;
        }
    }
    pieces.sort_by_key(|p| p.1.start);
    let mut out: Vec<(u64, u64, Job<'a>)> = Vec::with_capacity(pieces.len());
    let mut rest = arena;
    let mut consumed = 0usize;
    // A file's key: its first run; a memory copy sorts after every file.
    let mut first_run: HashMap<usize, usize> = HashMap::new();
    for (r, run) in runs.iter().enumerate() {
        if let Source::File { part, .. } = run.source {
            let owner = parts[part]
                .file_origin()
                .map_or(0, |(m, _)| m as *const _ as usize);
            first_run.entry(owner).or_insert(r);
        }
    }
    for (r, span, useful) in pieces {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(span.start - consumed);
        let (dest, tail) = tail.split_at_mut(span.len());
        rest = tail;
        consumed = span.end;
        let run = &runs[r];
        let key = match run.source {
            Source::File { part, offset } => {
                let owner = parts[part]
                    .file_origin()
                    .map_or(0, |(m, _)| m as *const _ as usize);
                let file_pos = run.file_at(offset, span.start);
                (first_run.get(&owner).copied().unwrap_or(r) as u64, file_pos)
            }
            Source::Memory { .. } => (u64::MAX, span.start as u64),
        };
        out.push((
            key.0,
            key.1,
            Job {
                run: r,
                at: span.start,
                dest,
                useful,
                direct: direct[r],
            },
        ));
    }
    out.sort_by_key(|(a, b, _)| (*a, *b));
    out.into_iter()
        .map(|(_, _, j)| Mutex::new(Some(j)))
        .collect()
}

/// The open handles of the file a worker reads now.
struct Handles {
    key: usize,
    buffered: File,
    direct: Option<File>,
    /// The path now names another file than the one mapped: copy from the mapping.
    replaced: bool,
}

/// What the workers share.
struct Shared<'p> {
    parts: &'p [Bytes],
    runs: &'p [Run],
    direct_refused: Mutex<Option<String>>,
    refused: AtomicBool,
    failed: AtomicBool,
    direct_bytes: AtomicU64,
    buffered_bytes: AtomicU64,
    memory_bytes: AtomicU64,
    progress: &'p (dyn Fn(u64, u64) + Sync),
    to_copy: u64,
}

impl Shared<'_> {
    fn refuse(&self, why: String) {
        self.refused.store(true, Ordering::Relaxed);
        if let Ok(mut g) = self.direct_refused.lock()
            && g.is_none()
        {
            *g = Some(why);
        }
    }

    fn open(&self, m: &FileMapping, key: usize, want_direct: bool) -> io::Result<Handles> {
        let path = m.path();
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
        let buffered = File::open(path).map_err(ctx)?;
        let replaced = !m.is_same_file(&buffered);
        let mut direct = None;
        if want_direct && !replaced && !self.refused.load(Ordering::Relaxed) {
            match open_direct(path) {
                Ok(f) if m.is_same_file(&f) => direct = Some(f),
                Ok(_) => {}
                Err(e) if is_refusal(&e) => {
                    self.refuse(format!("at open of {}: {e}", path.display()))
                }
                Err(e) => return Err(ctx(e)),
            }
        }
        Ok(Handles {
            key,
            buffered,
            direct,
            replaced,
        })
    }

    /// Run one job; `handles` caches the last file opened.
    fn run(&self, job: Job<'_>, handles: &mut Option<Handles>) -> io::Result<()> {
        let run = &self.runs[job.run];
        let useful = job.useful.clone();
        match run.source {
            Source::Memory { part } => {
                let p = &self.parts[part];
                let from = job.at + useful.start - run.at;
                let src = p
                    .slice(from..from + useful.len())
                    .ok_or_else(|| io::Error::other("a memory copy outside its source view"))?;
                job.dest[useful.clone()].copy_from_slice(src.as_slice());
                src.release();
                self.memory_bytes
                    .fetch_add(useful.len() as u64, Ordering::Relaxed);
            }
            Source::File { part, offset } => {
                let Some((m, _)) = self.parts[part].file_origin() else {
                    return Err(io::Error::other("a file run without its file"));
                };
                let key = m as *const FileMapping as usize;
                if handles.as_ref().is_none_or(|h| h.key != key) {
                    *handles = Some(self.open(m, key, job.direct)?);
                }
                let Some(h) = handles.as_mut() else {
                    return Err(io::Error::other("no file handle"));
                };
                // File offset of dest[0].
                let file_at = run.file_at(offset, job.at);
                let data = file_at + useful.start as u64..file_at + useful.end as u64;
                self.read(m, h, job.dest, file_at, useful.clone(), job.direct)?;
                m.release(data.start as usize..data.end as usize);
            }
        }
        (self.progress)(useful.len() as u64, self.to_copy);
        Ok(())
    }

    fn read(
        &self,
        m: &FileMapping,
        h: &mut Handles,
        dest: &mut [u8],
        file_at: u64,
        useful: Range<usize>,
        want_direct: bool,
    ) -> io::Result<()> {
        let n = useful.len() as u64;
        let data_at = file_at + useful.start as u64;
        let path = m.path();
        let short = |got: usize, want: usize, at: u64| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: the file ends {got} bytes into the {want}-byte read at offset {at} (truncated since it was opened?)",
                    path.display()
                ),
            )
        };
        if h.replaced {
            let src = m
                .bytes()
                .get(data_at as usize..(data_at + n) as usize)
                .ok_or_else(|| short(0, n as usize, data_at))?;
            dest[useful].copy_from_slice(src);
            self.memory_bytes.fetch_add(n, Ordering::Relaxed);
            return Ok(());
        }
        if want_direct
            && !self.refused.load(Ordering::Relaxed)
            && let Some(d) = &h.direct
        {
            match read_full_at(d, dest, file_at) {
                Ok(got) if got >= useful.end => {
                    self.direct_bytes.fetch_add(n, Ordering::Relaxed);
                    return Ok(());
                }
                Ok(got) => return Err(short(got, dest.len(), file_at)),
                Err(e) if is_refusal(&e) => {
                    self.refuse(format!("at a read of {}: {e}", path.display()));
                    h.direct = None;
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("{}: O_DIRECT read at offset {file_at}: {e}", path.display()),
                    ));
                }
            }
        }
        let want = useful.len();
        let got = read_full_at(&h.buffered, &mut dest[useful], data_at).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("{}: read at offset {data_at}: {e}", path.display()),
            )
        })?;
        if got < want {
            return Err(short(got, want, data_at));
        }
        self.buffered_bytes.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
}

/// Copy `parts` into one new anonymous memory mapping and return views of the copies, in
/// order (see the module docs for where each lands and how it is read). Each source view is
/// [released](Bytes::release) after its copy, so a file mapping's pages leave the process and
/// peak memory stays near one copy of the weights.
///
/// With `huge_pages` the mapping is advised for transparent huge pages before it is first
/// written, where the system supports them (Linux; otherwise the advice is skipped and
/// `huge_advised` is false). Weights read once per token from 2 MiB pages need 512 times fewer
/// page-table walks than from the 4 KiB pages of a file mapping; in a virtual machine each
/// walk is a nested one.
///
/// `progress(bytes, total)` is called (from the copying threads) after each piece of at most
/// 16 MiB, with the part bytes just placed and the total part bytes. A read that fails or
/// comes up short (a file truncated since it was mapped) is an error naming the file and the
/// offset.
pub fn copy_to_anonymous(
    parts: &[Bytes],
    huge_pages: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> io::Result<AnonCopies> {
    copy_with(parts, huge_pages, true, progress)
}

/// [`copy_to_anonymous`], with O_DIRECT allowed or not.
fn copy_with(
    parts: &[Bytes],
    huge_pages: bool,
    allow_direct: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> io::Result<AnonCopies> {
    let t0 = Instant::now();
    let plan = layout(parts)?;
    if plan.total == 0 {
        return Ok(AnonCopies {
            views: parts.iter().map(|_| Bytes::from_vec(Vec::new())).collect(),
            mapped: 0,
            huge_advised: false,
            stats: CopyStats::default(),
        });
    }
    let mut map = memmap2::MmapMut::map_anon(plan.total)?;
    #[cfg(target_os = "linux")]
    let huge_advised = huge_pages && map.advise(memmap2::Advice::HugePage).is_ok();
    #[cfg(not(target_os = "linux"))]
    let huge_advised = {
        let _ = huge_pages;
        false
    };
    // O_DIRECT for a file run unless most of it is in the page cache already.
    let direct: Vec<bool> = plan
        .runs
        .iter()
        .map(|r| match r.source {
            Source::File { part, offset } => {
                allow_direct
                    && parts[part].file_origin().is_some_and(|(m, _)| {
                        let o = offset as usize;
                        m.cached_fraction(o..o + r.len)
                            .is_none_or(|c| c < CACHED_ENOUGH)
                    })
            }
            Source::Memory { .. } => false,
        })
        .collect();
    let mut per_file: HashMap<usize, (PathBuf, u64)> = HashMap::new();
    for r in &plan.runs {
        if let Source::File { part, .. } = r.source
            && let Some((m, _)) = parts[part].file_origin()
        {
            let e = per_file
                .entry(m as *const FileMapping as usize)
                .or_insert_with(|| (m.path().to_path_buf(), 0));
            e.1 += r.len as u64;
        }
    }
    let shared = Shared {
        parts,
        runs: &plan.runs,
        direct_refused: Mutex::new(None),
        refused: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        direct_bytes: AtomicU64::new(0),
        buffered_bytes: AtomicU64::new(0),
        memory_bytes: AtomicU64::new(0),
        progress,
        to_copy: parts.iter().map(|p| p.len() as u64).sum(),
    };
    {
        let queue = jobs(&mut map, parts, &plan.runs, &direct);
        let next = AtomicUsize::new(0);
        let first_error: Mutex<Option<io::Error>> = Mutex::new(None);
        let work = || {
            let mut handles = None;
            loop {
                if shared.failed.load(Ordering::Relaxed) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(slot) = queue.get(i) else { return };
                let job = slot.lock().ok().and_then(|mut g| g.take());
                let Some(job) = job else { continue };
                if let Err(e) = shared.run(job, &mut handles) {
                    shared.failed.store(true, Ordering::Relaxed);
                    if let Ok(mut g) = first_error.lock()
                        && g.is_none()
                    {
                        *g = Some(e);
                    }
                    return;
                }
            }
        };
        let workers = WORKERS.min(queue.len()).max(1);
        std::thread::scope(|scope| {
            for _ in 1..workers {
                scope.spawn(work);
            }
            work();
        });
        if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
    }
    let arena = Bytes::from_owner(Arc::new(AnonArena(map)));
    let views = parts
        .iter()
        .zip(&plan.offsets)
        .map(|(p, &at)| {
            arena
                .slice(at..at + p.len())
                .ok_or_else(|| io::Error::other("copy outside its mapping"))
        })
        .collect::<io::Result<Vec<_>>>()?;
    let stats = CopyStats {
        direct_bytes: shared.direct_bytes.into_inner(),
        buffered_bytes: shared.buffered_bytes.into_inner(),
        memory_bytes: shared.memory_bytes.into_inner(),
        seconds: t0.elapsed().as_secs_f64(),
        direct_refused: shared
            .direct_refused
            .into_inner()
            .unwrap_or_else(|p| p.into_inner()),
        largest_file: per_file.into_values().max_by_key(|(_, b)| *b),
    };
    Ok(AnonCopies {
        views,
        mapped: plan.total,
        huge_advised,
        stats,
    })
}

#[cfg(test)]
mod tests;
