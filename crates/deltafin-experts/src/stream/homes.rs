//! Reads from expert homes: the layer files of every home, open, and the choice of the copy
//! a read goes to (docs/K3.md §12.11).

use crate::error::ExpertError;
use crate::homes::ExpertHomes;
use crate::io::{DirectIo, SourceFile};
use crate::layout::{ExpertLocation, ExpertTable};

/// The homes of a streaming source: which home holds what, and its layer files, open.
pub(super) struct HomeReaders {
    pub(super) homes: ExpertHomes,
    /// Per home, per layer: the layer file (`None` where the home holds nothing of it).
    pub(super) files: Vec<Vec<Option<SourceFile>>>,
}

/// Read counters of one home.
#[derive(Clone, Debug, Default)]
pub(super) struct HomeCounters {
    pub(super) reads: u64,
    pub(super) bytes: u64,
    pub(super) failures: u64,
    /// Bytes ever sent to this home (the tie-break between idle homes).
    pub(super) assigned: u64,
}

impl HomeReaders {
    /// Check that `homes` hold copies of `table`'s experts (the same shape, layers and
    /// experts per layer; copies only in MoE layers) and open every layer file a home holds
    /// a copy in.
    pub(super) fn open(
        homes: ExpertHomes,
        table: &ExpertTable,
        direct: DirectIo,
    ) -> Result<HomeReaders, ExpertError> {
        let m = homes.model();
        if m.shape() != table.shape || m.layers != table.layers.len() {
            return Err(ExpertError::Setup(format!(
                "the expert homes hold experts of F={} Lr={} in {} layers, the model's are F={} Lr={} in {} layers",
                m.f,
                m.lr,
                m.layers,
                table.shape.f,
                table.shape.lr,
                table.layers.len()
            )));
        }
        homes.verify_sample(table)?;
        // Two descriptors per layer file and home (K3: 92 × 2 per home) beside the model
        // root's: raise the soft limit on open files to the hard one.
        raise_open_files_limit();
        let mut files = Vec::with_capacity(homes.homes().len());
        for home in homes.homes() {
            let mut per_layer: Vec<Option<SourceFile>> = (0..m.layers).map(|_| None).collect();
            for &(l, e) in home.journal().copies.keys() {
                match table.layers.get(l) {
                    Some(Some(locs)) if e < locs.len() => {}
                    _ => {
                        return Err(ExpertError::Setup(format!(
                            "expert home {}: its journal lists expert {e} of layer {l}, which this model does not have (not a MoE layer, or out of range)",
                            home.dir.display()
                        )));
                    }
                }
                if per_layer[l].is_none() {
                    let p = home.layer_path(l);
                    let f = SourceFile::open(&p, direct).map_err(|err| {
                        ExpertError::Setup(format!(
                            "expert home {}: cannot open {}: {err}",
                            home.dir.display(),
                            p.display()
                        ))
                    })?;
                    per_layer[l] = Some(f);
                }
            }
            files.push(per_layer);
        }
        Ok(HomeReaders { homes, files })
    }

    /// Where home `h`'s copy of `expert` lies in its layer file (`file` is the layer).
    pub(super) fn location(&self, h: usize, layer: usize, expert: usize) -> ExpertLocation {
        let home = &self.homes.homes()[h];
        let base = home.slot_offset(expert);
        let mut loc = home.model().slot_location();
        for r in &mut loc.ranges {
            r.0 += base;
        }
        loc.file = layer;
        loc
    }

    /// The home a read of `(layer, expert)` goes to: of the homes holding a copy that was not
    /// tried yet for this read (`tried`, a mask), the one with the lowest `rank` (bytes
    /// outstanding, then bytes ever sent to it; `None`: a copy found bad), ties to the first.
    /// `None`: no such home (read from the model root).
    pub(super) fn choose(
        &self,
        layer: usize,
        expert: usize,
        tried: u32,
        rank: impl Fn(usize) -> Option<(u64, u64)>,
    ) -> Option<usize> {
        let mask = self.homes.holders(layer, expert) & !tried;
        (0..self.homes.homes().len())
            .filter(|&h| mask & (1 << h) != 0)
            .filter_map(|h| rank(h).map(|r| (r, h)))
            .min()
            .map(|(_, h)| h)
    }
}

/// Raise the soft limit on open files to the hard limit (at most 2^20).
fn raise_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed; no other memory.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        let target = lim.rlim_max.min(1 << 20);
        if lim.rlim_cur < target {
            lim.rlim_cur = target;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}
