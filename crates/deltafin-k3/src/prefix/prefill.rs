//! The prompt's prefill in aligned passes, resumed from the longest stored prefix state and
//! leaving snapshots behind (docs/NUMERICS.md "Prefix-state reuse").
//!
//! Exactness rests on one property of the layer loop: a pass over rows `[a, b)` with `a` a
//! multiple of the KDA chunk length gives, for every row, the bits a single pass over
//! `[0, b)` gives. Matrix products, MLA, MoE and AttnRes are row-invariant, and chunked KDA
//! runs its chunks from the pass's first row, so passes that begin on chunk boundaries
//! split the work exactly where one long pass splits it. Two rules keep that true here:
//! every pass begins on a multiple of the chunk length (snapshots are taken only there),
//! and no pass of a multi-token prompt is a single row (a one-row pass takes the recurrent
//! form, which a long pass would not have used for that row): a one-row tail joins the
//! pass before it, and a stored prefix is reused only when at least two tokens follow it.

use crate::error::ModelError;
use crate::model::state::State;
use crate::model::taps::Taps;
use crate::model::{K3Model, LogitRows, Watch};
use crate::prefix::cache::PrefixCache;
use crate::prefix::snapshot::Snapshot;
use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;

/// Most prompt tokens one prefill pass takes: it bounds the activation memory of a pass
/// (a few rows of `hidden_size` f32 per token and layer) whatever the prompt's length.
pub const PREFILL_CHUNK: usize = 4096;

/// A snapshot is also left every this many tokens of a long prompt.
pub const SNAPSHOT_EVERY: usize = 8192;

/// How far a prefill has come, reported after every layer of every pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillProgress {
    /// Prompt positions done (reused ones included); fractional within a pass.
    pub done: f64,
    /// Prompt positions in all.
    pub total: usize,
    /// Positions restored from a stored prefix state.
    pub reused: usize,
}

/// What a prefill gave: the state after the prompt and the logits of its last position.
#[derive(Clone, Debug)]
pub struct Prefilled {
    pub state: State,
    pub logits: Vec<f32>,
    /// Prompt positions restored from a stored prefix state (0: a cold prefill).
    pub reused: usize,
    /// Snapshots stored by this prefill.
    pub stored: usize,
}

/// How a generation turns its prompt into a state. `taps`, when given, receives every
/// prompt position's taps (a restored prefix's included). `Ok(None)`: stopped by an
/// interrupt before the prompt was done.
pub trait Prefiller {
    fn prefill(
        &mut self,
        model: &K3Model,
        prompt: &[u32],
        taps: Option<&mut Taps>,
    ) -> Result<Option<Prefilled>, ModelError>;
}

/// The whole prompt in one pass on a fresh state, no cache: what
/// a plain `deltafin_spec::generation::Generation` does.
pub struct OnePass;

impl Prefiller for OnePass {
    fn prefill(
        &mut self,
        model: &K3Model,
        prompt: &[u32],
        taps: Option<&mut Taps>,
    ) -> Result<Option<Prefilled>, ModelError> {
        let mut state = model.new_state();
        let logits = match taps {
            Some(t) => model.forward_tapped(&mut state, prompt, LogitRows::Last, t)?,
            None => model.forward(&mut state, prompt, LogitRows::Last)?,
        };
        Ok(Some(Prefilled {
            state,
            logits: logits.values,
            reused: 0,
            stored: 0,
        }))
    }
}

/// The aligned, cancellable, cached prefill.
pub struct Chunked<'a> {
    /// Where prefix states are looked up and stored (`None`: neither).
    pub cache: Option<&'a PrefixCache>,
    /// Most tokens per pass (rounded up to a multiple of the KDA chunk length).
    pub chunk: usize,
    /// A snapshot every this many tokens (rounded likewise; 0: none besides the marks).
    pub every: usize,
    /// Positions worth a snapshot (message boundaries of a rendered chat): the last of them
    /// before the prompt's end, rounded down to the KDA chunk length, is stored.
    pub marks: Vec<usize>,
    /// Checked before every layer.
    pub interrupt: Option<&'a AtomicBool>,
    /// Told after every layer.
    pub progress: Option<&'a mut (dyn FnMut(PrefillProgress) + Send)>,
    /// Set by each prefill: the positions it restored from a stored prefix state.
    pub reused: usize,
}

impl Chunked<'_> {
    /// Default passes and snapshot spacing over `cache`.
    pub fn new(cache: Option<&PrefixCache>) -> Chunked<'_> {
        Chunked {
            cache,
            chunk: PREFILL_CHUNK,
            every: SNAPSHOT_EVERY,
            marks: Vec::new(),
            interrupt: None,
            progress: None,
            reused: 0,
        }
    }
}

/// The positions right after each `end` token of `prompt` (a rendered chat's message
/// ends: the [`Chunked::marks`] of a chat prompt).
pub fn message_ends(prompt: &[u32], end: u32) -> Vec<usize> {
    prompt
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t == end)
        .map(|(i, _)| i + 1)
        .collect()
}

/// The largest snapshot position usable for a prompt of `n` tokens under KDA chunk length
/// `align`: a multiple of `align` with at least two tokens after it (0: none).
pub fn last_snapshot_position(n: usize, align: usize) -> usize {
    let align = align.max(1);
    if n < 2 { 0 } else { (n - 2) / align * align }
}

fn round_up(x: usize, align: usize) -> usize {
    x.div_ceil(align).max(1) * align
}

impl Prefiller for Chunked<'_> {
    fn prefill(
        &mut self,
        model: &K3Model,
        prompt: &[u32],
        mut taps: Option<&mut Taps>,
    ) -> Result<Option<Prefilled>, ModelError> {
        let n = prompt.len();
        if n == 0 {
            return Err(ModelError::EmptyInput);
        }
        let align = model.dims.kda_chunk.max(1);
        let chunk = round_up(self.chunk, align);
        let last = last_snapshot_position(n, align);
        let tap_layers: Option<Vec<usize>> = taps.as_deref().map(|t| t.layer_ids().to_vec());
        let hit = match self.cache {
            Some(c) if last > 0 => c.lookup(prompt, last, tap_layers.as_deref()),
            _ => None,
        };
        let (mut state, mut pos) = match hit {
            Some((p, snap)) => {
                let Snapshot {
                    state,
                    taps: stored,
                } = snap.as_ref().clone();
                if let (Some(t), Some(s)) = (taps.as_deref_mut(), stored) {
                    *t = s;
                }
                (state, p)
            }
            None => {
                if let Some(t) = taps.as_deref_mut() {
                    t.clear();
                }
                (model.new_state(), 0)
            }
        };
        let reused = pos;
        self.reused = reused;
        // Where snapshots are left: the prompt's last usable position, the last mark before
        // it, every `every` tokens; only past what was restored.
        let mut points = BTreeSet::new();
        if self.cache.is_some() && last > 0 {
            points.insert(last);
            if let Some(m) = self.marks.iter().copied().filter(|&m| m <= last).max() {
                points.insert(m / align * align);
            }
            if self.every > 0 {
                let every = round_up(self.every, align);
                points.extend((1..=last / every).map(|k| k * every));
            }
        }
        points.retain(|&p| p > pos && p > 0);
        let layers = model.layers.len().max(1);
        let mut stored = 0;
        loop {
            let mut end = (pos + chunk).min(n);
            if let Some(&q) = points.range(pos + 1..).next() {
                end = end.min(q);
            }
            if n - end == 1 {
                end = n;
            }
            let rows = end - pos;
            let want = if end == n {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let mut on_layer = |l: usize| {
                if let Some(p) = self.progress.as_mut() {
                    p(PrefillProgress {
                        done: pos as f64 + rows as f64 * (l + 1) as f64 / layers as f64,
                        total: n,
                        reused,
                    });
                }
            };
            let watch = Watch {
                interrupt: self.interrupt,
                on_layer: Some(&mut on_layer),
            };
            let logits = match model.forward_watched(
                &mut state,
                &prompt[pos..end],
                want,
                taps.as_deref_mut(),
                watch,
            ) {
                Ok(l) => l,
                Err(ModelError::Interrupted) => return Ok(None),
                Err(e) => return Err(e),
            };
            pos = end;
            if pos == n {
                return Ok(Some(Prefilled {
                    state,
                    logits: logits.values,
                    reused,
                    stored,
                }));
            }
            if let Some(cache) = self.cache
                && points.contains(&pos)
            {
                let snap = Snapshot {
                    state: state.clone(),
                    taps: taps.as_deref().cloned(),
                };
                stored += usize::from(cache.store(&prompt[..pos], snap));
            }
        }
    }
}
