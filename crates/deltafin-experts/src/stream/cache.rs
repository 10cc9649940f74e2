//! The expert cache: entries under a byte budget, eviction and admission by decayed heat,
//! the pinned tier, and the read-ahead window; the authoritative `expert` request.

use super::gate::{Prediction, RankCounter};
use super::options::{OPEN_FILE_CACHE, StreamOptions};
use super::pieces::{Filling, Job, Pending, ReadFrom, split_regions};
use crate::buffer::ExpertBuffer;
use crate::error::ExpertError;
use crate::io::{IoPath, SourceFile};
use crate::layout::{ExpertLocation, ExpertTable, ReadPlan};
use crate::policy::Heat;
use crate::source::ExpertWeights;
use crate::stats::LayerStats;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(super) enum Slot {
    Loading,
    Ready(ExpertWeights, Arc<ExpertBuffer>),
    Failed(ExpertError),
}

pub(super) struct Entry {
    pub(super) slot: Slot,
    pub(super) pinned: bool,
    /// Read for a use that has not happened yet (the admission test runs at that use).
    pub(super) fresh: bool,
    /// Failed the admission test: passes through, evicted before anything else.
    pub(super) transient: bool,
    /// Brought in by PILOT and not yet part of a route union.
    pub(super) pilot_unused: bool,
    /// In the pinned tier: never evicted.
    pub(super) sticky: bool,
    /// Bytes a PILOT read transferred for this entry (counted as wasted if the guess was
    /// wrong or the entry is evicted unused).
    pub(super) pilot_bytes: u64,
}

pub(super) enum Look {
    Ready(Box<ExpertWeights>, bool, bool),
    Loading,
    Failed,
    Absent,
}

pub(super) struct Window {
    pub(super) layer: usize,
    pub(super) order: Vec<usize>,
    pub(super) next: usize,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) entries: HashMap<(usize, usize), Entry>,
    /// Experts being read, by key.
    pub(super) pending: HashMap<(usize, usize), Pending>,
    /// Upper bound of one piece read (0: whole regions).
    pub(super) piece: u64,
    /// Decayed route heat of every expert ever requested (cached or not).
    pub(super) heat: HashMap<(usize, usize), Heat>,
    pub(super) demand: VecDeque<Job>,
    pub(super) pilot: VecDeque<Job>,
    pub(super) free: Vec<ExpertBuffer>,
    pub(super) allocated: u64,
    pub(super) peak: u64,
    pub(super) pinned: usize,
    pub(super) tick: u64,
    pub(super) window: Option<Window>,
    pub(super) predictions: Vec<Option<Prediction>>,
    /// PILOT precision per rank: one-row passes, then passes of several rows.
    pub(super) ranks: [Vec<RankCounter>; 2],
    pub(super) layers: Vec<LayerStats>,
    pub(super) reads: u64,
    pub(super) direct_reads: u64,
    pub(super) device_bytes: u64,
    /// Reads whose last piece has landed and left `pending`, but whose `finish` has not yet
    /// taken the lock to publish them (their bytes are not yet in the counters).
    pub(super) finishing: usize,
    pub(super) in_flight: usize,
    pub(super) busy_since: Option<Instant>,
    pub(super) busy: Duration,
    pub(super) wait: Duration,
    pub(super) shutdown: bool,
    /// Pinned-tier candidates (from the persisted heat) and the tier's size in buffers.
    pub(super) pin_candidates: std::collections::HashSet<(usize, usize)>,
    pub(super) pin_slots: usize,
    /// Sticky entries now.
    pub(super) sticky: usize,
    /// Per expert home: reads, bytes, failures.
    pub(super) home_stats: Vec<super::homes::HomeCounters>,
    /// Home copies whose read failed `(layer, expert, home)`: never read again.
    pub(super) bad_copies: std::collections::HashSet<(usize, usize, usize)>,
    /// Reads moved to another copy (or the model root) after a home's copy failed.
    pub(super) home_fallbacks: u64,
}

impl State {
    /// A wrong PILOT guess whose read has unstarted pieces (already taken off the queues):
    /// with pieces in flight it gives its buffer back when they land; otherwise it leaves the
    /// cache now.
    pub(super) fn cut_unstarted(&mut self, key: (usize, usize)) {
        let Some(p) = self.pending.get_mut(&key) else {
            return;
        };
        if p.started > p.done {
            p.expected = p.started;
            p.cancelled = true;
        } else if let Some(p) = self.pending.remove(&key) {
            self.entries.remove(&key);
            if let Some(l) = self.layers.get_mut(key.0) {
                l.prefetch_wasted_bytes += p.device;
            }
            if let Ok(f) = Arc::try_unwrap(p.fill) {
                self.free.push(f.into_inner());
            }
        }
    }

    /// Judge the PILOT read of `key` wrong: a read still in flight counts its bytes as wasted
    /// when it lands; a finished, still unused one returns its bytes (wasted now).
    pub(super) fn judge_wrong(&mut self, key: (usize, usize)) -> u64 {
        if let Some(p) = self.pending.get_mut(&key) {
            p.wrong |= p.pilot;
        } else if let Some(e) = self.entries.get_mut(&key)
            && e.pilot_unused
        {
            e.pilot_unused = false;
            return e.pilot_bytes;
        }
        0
    }

    /// A newer guess for `layer` replaced one that issued reads of `experts` it does not
    /// repeat: their unstarted pieces leave the queue now, so they do not hold up the newer
    /// guess's reads (what those reads transferred is wasted: their buffers go back). Returns
    /// the ones whose reads finished or have every piece in flight: they stay cached and are
    /// judged with the newer guess when the layer begins.
    pub(super) fn discard_superseded(&mut self, layer: usize, experts: &[usize]) -> Vec<usize> {
        let mut cut = std::collections::BTreeSet::new();
        self.pilot.retain(|job| {
            let gone = job.layer == layer && experts.contains(&job.expert);
            if gone {
                cut.insert((job.layer, job.expert));
            }
            !gone
        });
        let n_cut = cut.len() as u64;
        for key in cut {
            self.cut_unstarted(key);
        }
        if let Some(l) = self.layers.get_mut(layer) {
            l.prefetch_issued += n_cut;
        }
        experts
            .iter()
            .copied()
            .filter(|&e| {
                self.entries.contains_key(&(layer, e))
                    && self.pending.get(&(layer, e)).is_none_or(|p| !p.cancelled)
            })
            .collect()
    }
}

pub(super) struct Shared {
    pub(super) table: ExpertTable,
    /// Files opened once (tables of at most [`MAX_OPEN_FILES`] files); empty otherwise, and
    /// reads go through `recent`.
    pub(super) files: Vec<SourceFile>,
    /// The per-expert files read most recently, at most [`OPEN_FILE_CACHE`], most recent
    /// last (tables of more than [`MAX_OPEN_FILES`] files).
    pub(super) recent: Mutex<VecDeque<(usize, Arc<SourceFile>)>>,
    /// Files opened through `recent` so far.
    pub(super) opened: AtomicU64,
    /// How the last per-read-opened file was served (when `files` is empty).
    pub(super) last_path: Mutex<Option<(IoPath, Option<String>)>>,
    /// Expert homes (docs/K3.md §12.11): copies read before the model root's.
    pub(super) homes: Option<super::homes::HomeReaders>,
    pub(super) opts: StreamOptions,
    pub(super) buf_cap: u64,
    pub(super) window: usize,
    pub(super) half_life: f64,
    pub(super) st: Mutex<State>,
    pub(super) loaded: Condvar,
    pub(super) work: Condvar,
}

impl Shared {
    /// File `file` of the table, open: from `recent` when it is there, else opened and put
    /// there (evicting the least recently used; a reader still holding an evicted file keeps
    /// it open until its read ends). The open happens under the lock, so the pieces of one
    /// expert read side by side share one open.
    pub(super) fn open_file(&self, file: usize) -> std::io::Result<Arc<SourceFile>> {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = r.iter().position(|(f, _)| *f == file)
            && let Some(hit) = r.remove(i)
        {
            let f = Arc::clone(&hit.1);
            r.push_back(hit);
            return Ok(f);
        }
        let path = self.table.files.get(file).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("internal: file {file} is not in the table"),
            )
        })?;
        let opened = Arc::new(SourceFile::open(path, self.opts.direct_io)?);
        self.opened.fetch_add(1, Ordering::Relaxed);
        while r.len() >= OPEN_FILE_CACHE {
            r.pop_front();
        }
        r.push_back((file, Arc::clone(&opened)));
        Ok(opened)
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A worker panicking mid-update leaves counters at worst stale; keep serving.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.loaded.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer for a new read: reuse a free one, allocate within budget, or evict the
    /// coldest unpinned resident expert. `None` when none is possible right now.
    pub(super) fn take_buffer(&self, st: &mut State, allow_pinned: bool) -> Option<ExpertBuffer> {
        if let Some(b) = st.free.pop() {
            return Some(b);
        }
        let cap = self.buf_cap;
        if st.allocated + cap <= self.opts.cache_bytes {
            st.allocated += cap;
            st.peak = st.peak.max(st.allocated);
            return Some(ExpertBuffer::new(cap));
        }
        let (now, hl) = (st.tick, self.half_life);
        let heat = &st.heat;
        let score = |k: &(usize, usize), e: &Entry| {
            (
                e.pinned,
                !e.transient,
                heat.get(k).map_or(0.0, |h| h.at(now, hl)),
            )
        };
        let victim = st
            .entries
            .iter()
            .filter(|(_, e)| {
                matches!(e.slot, Slot::Ready(..)) && !e.sticky && (allow_pinned || !e.pinned)
            })
            .map(|(k, e)| (score(k, e), *k))
            .min_by(|a, b| {
                a.0.partial_cmp(&b.0)
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then(a.1.cmp(&b.1))
            })
            .map(|(_, k)| k)?;
        let e = st.entries.remove(&victim)?;
        if e.pinned {
            st.pinned -= 1;
        }
        if e.pilot_unused
            && let Some(l) = st.layers.get_mut(victim.0)
        {
            // A guess evicted before its layer used it.
            l.prefetch_wasted_bytes += e.pilot_bytes;
        }
        match e.slot {
            Slot::Ready(w, buf) => {
                drop(w);
                match Arc::try_unwrap(buf) {
                    Ok(b) => Some(b),
                    // Still being multiplied: its bytes are freed when that ends.
                    Err(_) => Some(ExpertBuffer::new(cap)),
                }
            }
            _ => None,
        }
    }

    /// The read-ahead window with `pin_slots` buffers given to the pinned tier.
    pub(super) fn window_now(&self, pin_slots: usize) -> usize {
        let capacity = (self.opts.cache_bytes / self.buf_cap) as usize;
        self.window.min(capacity.saturating_sub(pin_slots + 1))
    }

    /// Issue window reads until `window` unconsumed entries are pinned.
    pub(super) fn pump_window(&self, st: &mut State) {
        let mut issued = false;
        while let Some(w) = st.window.as_mut() {
            if w.next >= w.order.len() || st.pinned >= self.window_now(st.pin_slots) {
                break;
            }
            let (layer, e) = (w.layer, w.order[w.next]);
            if st.entries.contains_key(&(layer, e)) {
                w.next += 1;
                continue;
            }
            let Some(buf) = self.take_buffer(st, false) else {
                break;
            };
            if let Some(w) = st.window.as_mut() {
                w.next += 1;
            }
            self.insert_loading(st, layer, e, buf, true, false);
            issued = true;
        }
        if issued {
            self.work.notify_all();
        }
    }

    pub(super) fn insert_loading(
        &self,
        st: &mut State,
        layer: usize,
        expert: usize,
        buf: ExpertBuffer,
        pinned: bool,
        pilot: bool,
    ) {
        if pinned {
            st.pinned += 1;
        }
        let located = self.locate(st, layer, expert, 0).map(|(from, loc)| {
            let plan = ReadPlan::new(&loc);
            let pieces = split_regions(&plan, st.piece);
            (from, loc.file, plan, pieces)
        });
        let slot = match located {
            Ok((from, file, plan, pieces)) => {
                if let ReadFrom::Home(h) = from
                    && let Some(c) = st.home_stats.get_mut(h)
                {
                    c.assigned += plan.buf_len;
                }
                let queue = if pilot { &mut st.pilot } else { &mut st.demand };
                queue.extend((0..pieces.len()).map(|piece| Job {
                    layer,
                    expert,
                    piece,
                }));
                st.pending.insert(
                    (layer, expert),
                    Pending {
                        fill: Arc::new(Filling::new(buf)),
                        plan,
                        file,
                        from,
                        tried: 0,
                        expected: pieces.len(),
                        cancelled: false,
                        pieces,
                        started: 0,
                        done: 0,
                        reads: 0,
                        direct: 0,
                        device: 0,
                        err: None,
                        pilot,
                        wrong: false,
                    },
                );
                Slot::Loading
            }
            Err(e) => {
                st.free.push(buf);
                Slot::Failed(e)
            }
        };
        st.entries.insert(
            (layer, expert),
            Entry {
                slot,
                pinned,
                fresh: true,
                transient: false,
                pilot_unused: pilot,
                sticky: false,
                pilot_bytes: 0,
            },
        );
    }

    /// Where a read of `(layer, expert)` goes: the home [`super::homes::HomeReaders::choose`]
    /// picks among the copies not in `tried`, else the model root's location.
    pub(super) fn locate(
        &self,
        st: &State,
        layer: usize,
        expert: usize,
        tried: u32,
    ) -> Result<(ReadFrom, ExpertLocation), ExpertError> {
        let root = self.table.get(layer, expert)?;
        if let Some(h) = &self.homes
            && h.homes.holders(layer, expert) & !tried != 0
            && let Some(home) = {
                let mut outstanding = vec![0u64; h.homes.homes().len()];
                for p in st.pending.values() {
                    if let ReadFrom::Home(i) = p.from
                        && !p.cancelled
                        && let Some(o) = outstanding.get_mut(i)
                    {
                        let left = p.expected.saturating_sub(p.done) as u64;
                        *o += left * p.plan.buf_len / p.pieces.len().max(1) as u64;
                    }
                }
                h.choose(layer, expert, tried, |i| {
                    (!st.bad_copies.contains(&(layer, expert, i))).then(|| {
                        (
                            outstanding.get(i).copied().unwrap_or(0),
                            st.home_stats.get(i).map_or(0, |c| c.assigned),
                        )
                    })
                })
            }
        {
            return Ok((ReadFrom::Home(home), h.location(home, layer, expert)));
        }
        Ok((ReadFrom::Root, root.clone()))
    }

    /// Expert `expert` of `layer`: from the cache, or read now (the authoritative request:
    /// heat, admission, the pinned tier).
    pub(super) fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        let s = self;
        s.table.get(layer, expert)?;
        let key = (layer, expert);
        let started = Instant::now();
        let mut st = s.lock();
        st.tick += 1;
        let tick = st.tick;
        let in_window = st
            .window
            .as_ref()
            .is_some_and(|w| w.layer == layer && w.order.binary_search(&expert).is_ok());
        let mut counted = in_window;
        let result = loop {
            let (now, hl) = (tick, s.half_life);
            let look = match st.entries.get_mut(&key) {
                Some(e) => match &e.slot {
                    Slot::Ready(w, _) => {
                        let w = Box::new(w.clone());
                        e.pilot_unused = false;
                        let fresh = std::mem::replace(&mut e.fresh, false);
                        Look::Ready(w, std::mem::replace(&mut e.pinned, false), fresh)
                    }
                    Slot::Loading => Look::Loading,
                    Slot::Failed(_) => Look::Failed,
                },
                None => Look::Absent,
            };
            if let Look::Ready(_, _, fresh) = &look {
                let before = st.heat.get(&key).map_or(0.0, |h| h.at(now, hl));
                st.heat
                    .entry(key)
                    .and_modify(|h| h.touch(now, hl))
                    .or_insert_with(|| Heat::new(now));
                // Admission: a freshly read expert stays only if it was hotter than the
                // coldest settled resident (checked when the cache is full).
                if *fresh && st.free.is_empty() && st.allocated + s.buf_cap > s.opts.cache_bytes {
                    let heat = &st.heat;
                    let coldest = st
                        .entries
                        .iter()
                        .filter(|(k, e)| {
                            **k != key
                                && !e.transient
                                && !e.sticky
                                && !e.fresh
                                && matches!(e.slot, Slot::Ready(..))
                        })
                        .map(|(k, _)| heat.get(k).map_or(0.0, |h| h.at(now, hl)))
                        .min_by(f64::total_cmp);
                    if let (Some(c), Some(e)) = (coldest, st.entries.get_mut(&key)) {
                        e.transient = before <= c;
                    }
                }
            }
            match look {
                Look::Ready(w, was_pinned, _) => {
                    if was_pinned {
                        st.pinned -= 1;
                    }
                    // Sticky, never speculative: promoted only here, when the route that
                    // needs this expert has read it.
                    if st.sticky < st.pin_slots && st.pin_candidates.contains(&key) {
                        let promoted = st.entries.get_mut(&key).is_some_and(|e| {
                            let was = std::mem::replace(&mut e.sticky, true);
                            e.transient = false;
                            !was
                        });
                        if promoted {
                            st.sticky += 1;
                        }
                    }
                    break Ok(*w);
                }
                Look::Loading => st = s.wait(st),
                Look::Failed => {
                    if let Some(Entry {
                        slot: Slot::Failed(err),
                        pinned,
                        ..
                    }) = st.entries.remove(&key)
                    {
                        if pinned {
                            st.pinned -= 1;
                        }
                        break Err(err);
                    }
                }
                Look::Absent => {
                    if !counted {
                        counted = true;
                        if let Some(l) = st.layers.get_mut(layer) {
                            l.misses += 1;
                        }
                    }
                    let idle = st.in_flight == 0 && st.demand.is_empty() && st.pilot.is_empty();
                    // Everything pinned and nothing in flight: give up a pinned expert (it
                    // is read again later) rather than wait forever.
                    let buf = s.take_buffer(&mut st, false).or_else(|| {
                        if idle {
                            s.take_buffer(&mut st, true)
                        } else {
                            None
                        }
                    });
                    match buf {
                        Some(b) => {
                            s.insert_loading(&mut st, layer, expert, b, true, false);
                            s.work.notify_all();
                        }
                        None if idle => {
                            break Err(ExpertError::Unavailable {
                                layer,
                                expert,
                                message: "the expert cache has no buffer to read into".into(),
                            });
                        }
                        None => st = s.wait(st),
                    }
                }
            }
        };
        s.pump_window(&mut st);
        st.wait += started.elapsed();
        result
    }
}
