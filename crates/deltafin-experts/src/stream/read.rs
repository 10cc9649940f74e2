//! The I/O threads: a piece read, the last piece's publication of the expert.

use super::cache::{Shared, Slot, State};
use super::pieces::{Filling, Job, Pending, ReadFrom, split_regions};
use crate::buffer::ExpertBuffer;
use crate::error::ExpertError;
use crate::io::IoPath;
use crate::layout::{ExpertShape, ReadPlan, Region};
use crate::source::ExpertWeights;
use deltafin_tensor::storage::ByteOwner;
use deltafin_tensor::{Bytes, Mxfp4Matrix};
use std::sync::Arc;
use std::time::Instant;

impl Shared {
    /// Read one piece into its range of the expert's buffer. Returns the path taken and the
    /// bytes transferred.
    pub(super) fn read_piece(
        &self,
        layer: usize,
        expert: usize,
        (from, file): (ReadFrom, usize),
        region: &Region,
        fill: &Filling,
    ) -> Result<(IoPath, u64), ExpertError> {
        let opened;
        let source = match from {
            ReadFrom::Home(h) => {
                let f = self
                    .homes
                    .as_ref()
                    .and_then(|r| r.files.get(h))
                    .and_then(|l| l.get(file))
                    .and_then(Option::as_ref);
                match f {
                    Some(f) => f,
                    None => {
                        return Err(ExpertError::Unavailable {
                            layer,
                            expert,
                            message: format!("internal: expert home {h} has no open layer file"),
                        });
                    }
                }
            }
            ReadFrom::Root => match self.files.get(file) {
                Some(f) => f,
                None => {
                    opened = self.open_file(file).map_err(|source| ExpertError::Io {
                        layer,
                        expert,
                        path: self.table.files.get(file).cloned().unwrap_or_default(),
                        offset: 0,
                        len: 0,
                        source,
                    })?;
                    &*opened
                }
            },
        };
        // SAFETY: the pieces of one expert cover disjoint buffer ranges and each piece is
        // read by exactly one job.
        let dst = unsafe { fill.piece(region.buf_offset as usize, region.len as usize) };
        let piece = Region {
            buf_offset: 0,
            ..*region
        };
        let out = source
            .read_region(&piece, dst)
            .map_err(|e| ExpertError::Io {
                layer,
                expert,
                path: source.path().to_path_buf(),
                offset: region.file_offset,
                len: region.need_to,
                source: e,
            })?;
        if from == ReadFrom::Root
            && self.files.is_empty()
            && let Ok(mut g) = self.last_path.lock()
        {
            *g = Some(source.io_path());
        }
        Ok(out)
    }
}

/// The three matrices over the tensors of `plan` inside `buf`.
pub(super) fn weights(
    buf: &Arc<ExpertBuffer>,
    plan: &ReadPlan,
    shape: ExpertShape,
    layer: usize,
    expert: usize,
) -> Result<ExpertWeights, ExpertError> {
    let owner: Arc<dyn ByteOwner> = buf.clone();
    let all = Bytes::from_owner(owner);
    let sizes = shape.tensor_bytes();
    let part = |k: usize| {
        let at = plan.tensor_at[k] as usize;
        all.slice(at..at + sizes[k] as usize)
            .ok_or_else(|| ExpertError::Unavailable {
                layer,
                expert,
                message: format!("internal: tensor {k} lies outside its read buffer"),
            })
    };
    let names = ["w1", "w2", "w3"];
    let mut mats = Vec::with_capacity(3);
    for (m, (rows, cols)) in shape.matrix_shapes().into_iter().enumerate() {
        let name = format!(
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.{}",
            names[m]
        );
        mats.push(
            Mxfp4Matrix::new(&name, part(2 * m)?, part(2 * m + 1)?, rows, cols).map_err(
                |source| ExpertError::Tensor {
                    layer,
                    expert,
                    source,
                },
            )?,
        );
    }
    let mut it = mats.into_iter();
    match (it.next(), it.next(), it.next()) {
        (Some(w1), Some(w2), Some(w3)) => Ok(ExpertWeights { w1, w2, w3 }),
        _ => Err(ExpertError::Unavailable {
            layer,
            expert,
            message: "internal: expected three matrices".into(),
        }),
    }
}

/// The next job of reader queue `drive` (0: the model root; 1 + h: home h): the first
/// demand job of that drive, else the first PILOT one. Jobs of reads no longer pending (or
/// of pieces out of range) are dropped on the way.
fn next_job(st: &mut State, drive: usize) -> Option<Job> {
    let State {
        demand,
        pilot,
        pending,
        ..
    } = st;
    for queue in [demand, pilot] {
        let mut i = 0;
        while i < queue.len() {
            let j = &queue[i];
            match pending.get(&(j.layer, j.expert)) {
                Some(p) if j.piece >= p.pieces.len() => {
                    queue.remove(i);
                }
                None => {
                    queue.remove(i);
                }
                Some(p) if p.from.drive() == drive => return queue.remove(i),
                Some(_) => i += 1,
            }
        }
    }
    None
}

/// An I/O thread of reader queue `drive`.
pub(super) fn worker(s: &Shared, drive: usize) {
    loop {
        let (job, source, region, fill) = {
            let mut st = s.lock();
            loop {
                if st.shutdown {
                    return;
                }
                let Some(j) = next_job(&mut st, drive) else {
                    st = s.work.wait(st).unwrap_or_else(|p| p.into_inner());
                    continue;
                };
                let Some(p) = st.pending.get_mut(&(j.layer, j.expert)) else {
                    continue;
                };
                let Some(region) = p.pieces.get(j.piece).copied() else {
                    continue;
                };
                p.started += 1;
                let (source, fill) = ((p.from, p.file), p.fill.clone());
                st.in_flight += 1;
                if st.in_flight == 1 {
                    st.busy_since = Some(Instant::now());
                }
                break (j, source, region, fill);
            }
        };
        let key = (job.layer, job.expert);
        let outcome = s.read_piece(job.layer, job.expert, source, &region, &fill);
        // The last piece to land must find the buffer's only `Arc` in `pending`.
        drop(fill);
        let finished = {
            let mut st = s.lock();
            st.in_flight -= 1;
            if st.in_flight == 0
                && let Some(t) = st.busy_since.take()
            {
                st.busy += t.elapsed();
            }
            if let (ReadFrom::Home(h), Ok((_, n))) = (source.0, &outcome)
                && let Some(c) = st.home_stats.get_mut(h)
            {
                c.reads += 1;
                c.bytes += n;
            }
            let Some(p) = st.pending.get_mut(&key) else {
                continue;
            };
            p.done += 1;
            match outcome {
                Ok((path, n)) => {
                    p.reads += 1;
                    p.device += n;
                    if path == IoPath::Direct {
                        p.direct += 1;
                    }
                }
                Err(e) => {
                    p.err.get_or_insert(e);
                }
            }
            if p.done < p.expected {
                continue;
            }
            let done = st.pending.remove(&key);
            st.finishing += usize::from(done.is_some());
            done
        };
        if let Some(p) = finished {
            finish(s, key, p);
        }
    }
}

/// Every expected piece of `p` has landed: build the weights and publish the slot (or, for a
/// cancelled guess, give the buffer back).
pub(super) fn finish(s: &Shared, (layer, expert): (usize, usize), p: Pending) {
    if p.cancelled {
        let mut st = s.lock();
        st.finishing = st.finishing.saturating_sub(1);
        st.reads += p.reads;
        st.direct_reads += p.direct;
        st.device_bytes += p.device;
        if let Some(l) = st.layers.get_mut(layer) {
            l.prefetch_wasted_bytes += p.device;
        }
        if let Some(e) = st.entries.remove(&(layer, expert))
            && e.pinned
        {
            st.pinned -= 1;
        }
        if let Ok(f) = Arc::try_unwrap(p.fill) {
            st.free.push(f.into_inner());
        }
        drop(st);
        s.loaded.notify_all();
        return;
    }
    let buf = Arc::try_unwrap(p.fill).map(Filling::into_inner);
    let mut p = Pending {
        fill: Arc::new(Filling::new(ExpertBuffer::new(0))),
        ..p
    };
    // A home's copy that failed (a read error, a short file, bytes that are not valid MXFP4)
    // is never used: the read moves to the next copy, then to the model root.
    let result = match (p.err.take(), buf) {
        (None, Ok(mut b)) => match check_copy(s, &p, layer, expert, &mut b) {
            Err(e) => Err((e, Some(b))),
            Ok(()) => {
                let buf = Arc::new(b);
                match weights(&buf, &p.plan, s.table.shape, layer, expert) {
                    Ok(w) => Ok((w, buf)),
                    Err(e) => Err((e, Arc::try_unwrap(buf).ok())),
                }
            }
        },
        (Some(e), Ok(b)) => Err((e, Some(b))),
        (Some(e), Err(_)) => Err((e, None)),
        (None, Err(_)) => Err((
            ExpertError::Unavailable {
                layer,
                expert,
                message: "internal: a piece read still holds the buffer".into(),
            },
            None,
        )),
    };
    let result = match result {
        Err((e, Some(b))) => match p.from {
            ReadFrom::Home(h) => match retry_elsewhere(s, (layer, expert), p, h, e, b) {
                Ok(()) => return,
                Err(back) => {
                    let (back, e, b) = *back;
                    p = back;
                    Err((e, Some(b)))
                }
            },
            ReadFrom::Root => Err((e, Some(b))),
        },
        other => other,
    };
    let mut st = s.lock();
    st.finishing = st.finishing.saturating_sub(1);
    st.reads += p.reads;
    st.direct_reads += p.direct;
    st.device_bytes += p.device;
    let slot = match result {
        Ok((w, buf)) => {
            let eb = s.table.shape.expert_bytes();
            if let Some(l) = st.layers.get_mut(layer) {
                l.bytes_read += eb;
                if p.pilot {
                    l.prefetch_bytes += eb;
                }
                if p.wrong {
                    l.prefetch_wasted_bytes += p.device;
                }
            }
            Slot::Ready(w, buf)
        }
        Err((e, buf)) => {
            st.free.extend(buf);
            Slot::Failed(e)
        }
    };
    match st.entries.get_mut(&(layer, expert)) {
        Some(entry) => {
            entry.slot = slot;
            if p.wrong {
                entry.pilot_unused = false;
            } else if p.pilot {
                entry.pilot_bytes = p.device;
            }
        }
        None => {
            // Cancelled while in flight: keep the buffer for reuse.
            if let Slot::Ready(w, b) = slot {
                drop(w);
                if let Ok(b) = Arc::try_unwrap(b) {
                    st.free.push(b);
                }
            }
        }
    }
    drop(st);
    s.loaded.notify_all();
}

/// Home `h`'s copy of `key` failed with `err`: mark the copy bad and issue the read again, into
/// the same buffer, from the next home holding a copy or else the model root. Gives `p`, the
/// error and the buffer back when the read was cancelled meanwhile (nothing to retry).
fn retry_elsewhere(
    s: &Shared,
    key: (usize, usize),
    mut p: Pending,
    h: usize,
    err: ExpertError,
    buf: ExpertBuffer,
) -> Result<(), Box<(Pending, ExpertError, ExpertBuffer)>> {
    let (layer, expert) = key;
    let mut st = s.lock();
    if !st.entries.contains_key(&key) {
        drop(st);
        return Err(Box::new((p, err, buf)));
    }
    let first = st.home_stats.get(h).is_some_and(|c| c.failures == 0);
    if let Some(c) = st.home_stats.get_mut(h) {
        c.failures += 1;
    }
    st.bad_copies.insert((layer, expert, h));
    st.home_fallbacks += 1;
    p.tried |= 1 << h;
    let (from, loc) = match s.locate(&st, layer, expert, p.tried) {
        Ok(x) => x,
        Err(e) => {
            drop(st);
            return Err(Box::new((p, e, buf)));
        }
    };
    if first && let Some(r) = &s.homes {
        let dir = r.homes.homes().get(h).map(|x| x.dir.display().to_string());
        eprintln!(
            "deltafin: warning: expert home {}: {err}; this copy is not used again, the expert is read from {}",
            dir.unwrap_or_default(),
            match from {
                ReadFrom::Root => "the model root".to_string(),
                ReadFrom::Home(o) => format!(
                    "expert home {}",
                    r.homes
                        .homes()
                        .get(o)
                        .map(|x| x.dir.display().to_string())
                        .unwrap_or_default()
                ),
            }
        );
    }
    let plan = ReadPlan::new(&loc);
    let pieces = split_regions(&plan, st.piece);
    let queue_pilot = p.pilot;
    let jobs = (0..pieces.len()).map(|piece| Job {
        layer,
        expert,
        piece,
    });
    if queue_pilot {
        st.pilot.extend(jobs);
    } else {
        st.demand.extend(jobs);
    }
    if let ReadFrom::Home(o) = from
        && let Some(c) = st.home_stats.get_mut(o)
    {
        c.assigned += plan.buf_len;
    }
    let pending = Pending {
        fill: Arc::new(Filling::new(buf)),
        plan,
        file: loc.file,
        from,
        expected: pieces.len(),
        pieces,
        started: 0,
        done: 0,
        err: None,
        ..p
    };
    st.pending.insert(key, pending);
    st.finishing = st.finishing.saturating_sub(1);
    drop(st);
    s.work.notify_all();
    Ok(())
}

/// A home's copy must hash (CRC-32) to what its journal recorded when placement verified it:
/// a copy damaged since is an error (and the read moves elsewhere), never a wrong expert.
fn check_copy(
    s: &Shared,
    p: &Pending,
    layer: usize,
    expert: usize,
    buf: &mut ExpertBuffer,
) -> Result<(), ExpertError> {
    let ReadFrom::Home(h) = p.from else {
        return Ok(());
    };
    let Some(home) = s.homes.as_ref().and_then(|r| r.homes.homes().get(h)) else {
        return Ok(());
    };
    let want = home.digest(layer, expert).map(|d| d.crc32);
    let at = p.plan.tensor_at[0] as usize;
    let n = s.table.shape.expert_bytes() as usize;
    let got = buf.as_mut_bytes().get(at..at + n).map(crc32fast::hash);
    if got.is_some() && got == want {
        return Ok(());
    }
    Err(ExpertError::Unavailable {
        layer,
        expert,
        message: format!(
            "the copy in {} fails its CRC-32 check (read {}, journaled {}): it was damaged after it was placed",
            home.layer_path(layer).display(),
            got.map_or("nothing".into(), |c| format!("{c:08x}")),
            want.map_or("nothing".into(), |c| format!("{c:08x}")),
        ),
    })
}
