//! The I/O threads: a piece read, the last piece's publication of the expert.

use super::cache::{Shared, Slot};
use super::pieces::{Filling, Pending};
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
        file: usize,
        region: &Region,
        fill: &Filling,
    ) -> Result<(IoPath, u64), ExpertError> {
        let opened;
        let source = match self.files.get(file) {
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
        if self.files.is_empty()
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

pub(super) fn worker(s: &Shared) {
    loop {
        let (job, file, region, fill) = {
            let mut st = s.lock();
            loop {
                if st.shutdown {
                    return;
                }
                let Some(j) = st.demand.pop_front().or_else(|| st.pilot.pop_front()) else {
                    st = s.work.wait(st).unwrap_or_else(|p| p.into_inner());
                    continue;
                };
                // Pieces of a cancelled read are skipped.
                let Some(p) = st.pending.get_mut(&(j.layer, j.expert)) else {
                    continue;
                };
                let Some(region) = p.pieces.get(j.piece).copied() else {
                    continue;
                };
                p.started += 1;
                let (file, fill) = (p.file, p.fill.clone());
                st.in_flight += 1;
                if st.in_flight == 1 {
                    st.busy_since = Some(Instant::now());
                }
                break (j, file, region, fill);
            }
        };
        let key = (job.layer, job.expert);
        let outcome = s.read_piece(job.layer, job.expert, file, &region, &fill);
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
    let result = match (p.err, buf) {
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
        (None, Ok(b)) => {
            let buf = Arc::new(b);
            match weights(&buf, &p.plan, s.table.shape, layer, expert) {
                Ok(w) => Ok((w, buf)),
                Err(e) => Err((e, Arc::try_unwrap(buf).ok())),
            }
        }
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
