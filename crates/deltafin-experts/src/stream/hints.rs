//! The model's scheduling hints: the route union at a layer's start, the ready-first
//! request order, and PILOT's next-layer guesses.

use super::cache::{Shared, Slot, Window};
use super::gate::{MAX_PILOT_RANKS, PilotGate, Prediction, RankCounter};
use crate::source::PilotGuess;
use std::collections::VecDeque;
use std::time::Instant;

impl Shared {
    /// [`crate::ExpertSource::begin_layer`]: judge the layer's PILOT guess, settle its unstarted
    /// reads, pin the union's hits and start the read-ahead window over the union.
    pub(super) fn begin_layer(&self, layer: usize, experts: &[usize]) {
        let s = self;
        let mut st = s.lock();
        let st = &mut *st;
        // Recall of this layer's PILOT prediction, and precision per rank.
        let pred = st.predictions.get_mut(layer).and_then(Option::take);
        if let Some(pred) = &pred
            && let Some(l) = st.layers.get_mut(layer)
        {
            l.predictions += 1;
            l.predicted_total += experts.len() as u64;
            l.predicted_hits += pred
                .guesses
                .iter()
                .filter(|g| experts.binary_search(&g.expert).is_ok())
                .count() as u64;
            if let PilotGate::On { threshold, warmup } = s.opts.pilot {
                l.gated = l.predictions >= warmup && l.recall().unwrap_or(0.0) < threshold;
            }
        }
        if let Some(pred) = &pred {
            let table = &mut st.ranks[pred.class];
            for (g, &issued) in pred.guesses.iter().zip(&pred.issued) {
                let rank = g.rank.min(MAX_PILOT_RANKS - 1);
                if table.len() <= rank {
                    table.resize(rank + 1, RankCounter::default());
                }
                let right = experts.binary_search(&g.expert).is_ok();
                table[rank].judge(right, issued, s.opts.pilot);
            }
        }
        // Release the previous window's pins.
        for e in st.entries.values_mut() {
            e.pinned = false;
        }
        st.pinned = 0;
        // PILOT reads not started yet: promote right guesses, drop wrong ones (and stale
        // guesses of earlier layers).
        // A wrong guess loses its unstarted pieces; one with pieces in flight gives its
        // buffer back when they land.
        let mut keep = VecDeque::new();
        let mut dropped = std::collections::BTreeSet::new();
        for job in std::mem::take(&mut st.pilot) {
            let key = (job.layer, job.expert);
            let wanted = job.layer == layer && experts.binary_search(&job.expert).is_ok();
            if wanted {
                st.demand.push_back(job);
            } else if job.layer <= layer && st.pending.contains_key(&key) {
                dropped.insert(key);
            } else {
                keep.push_back(job);
            }
        }
        st.pilot = keep;
        for key in dropped {
            st.cut_unstarted(key);
        }
        // Judge the issued guesses still held: right ones are useful prefetches; wrong ones
        // waste what they transferred (now, or when their in-flight pieces land).
        if let Some(pred) = &pred {
            let (mut issued, mut right, mut wasted) = (0, 0, 0);
            let judged = pred
                .guesses
                .iter()
                .zip(&pred.issued)
                .filter(|(_, i)| **i)
                .map(|(g, _)| g.expert)
                .chain(pred.carried.iter().copied());
            for e in judged {
                issued += 1;
                let key = (layer, e);
                if experts.binary_search(&e).is_ok() {
                    right += u64::from(st.entries.contains_key(&key));
                } else {
                    wasted += st.judge_wrong(key);
                }
            }
            if let Some(l) = st.layers.get_mut(layer) {
                l.prefetch_issued += issued;
                l.prefetch_right += right;
                l.prefetch_wasted_bytes += wasted;
            }
        }
        let (mut hits, mut pf_hits, mut pin_hits) = (0, 0, 0);
        for &e in experts {
            if let Some(entry) = st.entries.get_mut(&(layer, e)) {
                hits += 1;
                if entry.sticky {
                    pin_hits += 1;
                }
                if entry.pilot_unused {
                    pf_hits += 1;
                    entry.pilot_unused = false;
                }
                entry.pinned = true;
                st.pinned += 1;
            }
        }
        if let Some(l) = st.layers.get_mut(layer) {
            l.hits += hits;
            l.prefetch_hits += pf_hits;
            l.pinned_hits += pin_hits;
            l.misses += experts.len() as u64 - hits;
        }
        st.window = Some(Window {
            layer,
            order: experts.to_vec(),
            next: 0,
        });
        s.pump_window(st);
    }

    /// [`crate::ExpertSource::next_ready`].
    pub(super) fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        let s = self;
        let started = Instant::now();
        let mut st = s.lock();
        let pick = loop {
            let mut loading = false;
            let mut ready = None;
            for (i, &e) in pending.iter().enumerate() {
                match st.entries.get(&(layer, e)).map(|en| &en.slot) {
                    Some(Slot::Ready(..) | Slot::Failed(_)) => {
                        ready = Some(i);
                        break;
                    }
                    Some(Slot::Loading) => loading = true,
                    None => {}
                }
            }
            match ready {
                Some(i) => break i,
                // Nothing in flight: the first one is read on request.
                None if !loading => break 0,
                None => st = s.wait(st),
            }
        };
        st.wait += started.elapsed();
        pick
    }

    /// [`crate::ExpertSource::predict`]: issue PILOT reads, most confident guess first, as the gate
    /// allows.
    pub(super) fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        let s = self;
        if !matches!(s.table.layers.get(layer), Some(Some(_))) {
            return;
        }
        let mut st = s.lock();
        let st = &mut *st;
        let class = usize::from(rows > 1);
        let mut issued = vec![false; guesses.len()];
        let gated = st.layers.get(layer).is_some_and(|l| l.gated);
        let read = match s.opts.pilot {
            PilotGate::Measure => false,
            PilotGate::On { .. } => !gated,
            PilotGate::Off | PilotGate::Ranked { .. } => true,
        };
        let cap = match s.opts.pilot {
            PilotGate::Ranked { max_guesses, .. } if max_guesses > 0 => max_guesses,
            _ => usize::MAX,
        };
        // An earlier guess for this layer that has not been judged yet (the next token's
        // first MoE layer is guessed at the end of a pass from a provisional token, then
        // again from the real one): the reads it issued that this guess repeats are judged
        // with this one; the others are wrong and discarded now.
        let earlier: Vec<usize> = st.predictions[layer]
            .take()
            .map(|p| {
                p.guesses
                    .iter()
                    .zip(&p.issued)
                    .filter(|(_, i)| **i)
                    .map(|(g, _)| g.expert)
                    .chain(p.carried)
                    .collect()
            })
            .unwrap_or_default();
        for (g, issued) in guesses.iter().zip(issued.iter_mut()) {
            *issued = earlier.contains(&g.expert) && st.entries.contains_key(&(layer, g.expert));
        }
        let superseded: Vec<usize> = earlier
            .iter()
            .copied()
            .filter(|e| !guesses.iter().any(|g| g.expert == *e))
            .collect();
        let carried = st.discard_superseded(layer, &superseded);
        let mut n = 0;
        // Most confident first: what is still unstarted when the layer begins is the least
        // likely to be needed.
        for (g, issued) in guesses.iter().zip(issued.iter_mut()) {
            if !read || n >= cap {
                break;
            }
            if st.entries.contains_key(&(layer, g.expert)) {
                continue;
            }
            let rank = g.rank.min(MAX_PILOT_RANKS - 1);
            if st.ranks[class]
                .get(rank)
                .is_some_and(|c| c.gated(s.opts.pilot))
            {
                continue;
            }
            let Some(buf) = s.take_buffer(st, false) else {
                break;
            };
            s.insert_loading(st, layer, g.expert, buf, false, true);
            *issued = true;
            n += 1;
        }
        st.predictions[layer] = Some(Prediction {
            class,
            guesses: guesses.to_vec(),
            issued,
            carried,
        });
        if n > 0 {
            s.work.notify_all();
        }
    }
}
