//! Several generations at once (docs/SERVER.md, "Several requests at once"): how many run
//! together, the state memory each reserves, and the [`Batcher`] their decode steps share.
//!
//! **The rule.** At most `parallel` generations run; each reserves, before it starts, the
//! state its context can reach — K3's KDA states plus the MLA cache of
//! `min(prompt + max_tokens, admitted context)` positions — from a reserve the memory plan
//! sets aside (under a budget: the plan's state reserve; with every expert resident: half the
//! memory available at load, the basis of the admitted context). Requests wait for a slot and
//! for their reserve in arrival order, so one that does not fit beside the running ones waits
//! for them, and a single request always fits (its context is at most the admitted context).
//! A generation's tokens never depend on what runs beside it ([`deltafin_spec::batch`]).

use deltafin_k3::engine::MemoryPlan;
use deltafin_k3::model::K3Model;
use deltafin_spec::Batcher;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Most generations `--parallel` may ask for.
pub const MAX_PARALLEL: usize = 16;

/// Most generations the default lets run together.
pub const DEFAULT_PARALLEL_CAP: usize = 4;

/// How generations share the engine.
pub struct Sharing {
    /// Generations that may run together.
    pub parallel: usize,
    /// Why that many (`--parallel`, `K3_SERVER_PARALLEL`, or the plan).
    pub source: &'static str,
    /// The scheduler their passes share (`None` when one runs at a time).
    pub batcher: Option<Batcher>,
    /// One permit per running generation.
    pub(crate) slots: Arc<Semaphore>,
    /// The state reserve, in units of `unit_bytes`.
    pub(crate) reserve: Arc<Semaphore>,
    /// Bytes of the reserve.
    pub reserve_bytes: u64,
    unit_bytes: u64,
    units: u32,
    kda_bytes: u64,
    position_bytes: u64,
    max_context: usize,
}

impl Sharing {
    /// The sharing the plan admits for `model` with `max_context` positions per generation
    /// (`parallel`: a requested count, else the default: as many full-context generations as
    /// the reserve holds, at least 2 where two of half the context fit, at most
    /// [`DEFAULT_PARALLEL_CAP`]).
    pub fn new(
        model: &K3Model,
        plan: Option<&MemoryPlan>,
        max_context: usize,
        parallel: Option<(usize, &'static str)>,
    ) -> Sharing {
        let kda_bytes = model.dims.kda_state_bytes() as u64;
        let position_bytes = (model.dims.mla_cache_bytes_per_token() as u64).max(1);
        let full = kda_bytes + max_context as u64 * position_bytes;
        let reserve_bytes = match plan {
            Some(p) => p.state,
            None => deltafin_k3::engine::host::meminfo()
                .map_or(full.saturating_mul(DEFAULT_PARALLEL_CAP as u64), |m| {
                    m.available / 2
                }),
        }
        .max(full);
        let (parallel, source) = parallel.unwrap_or_else(|| {
            let whole = usize::try_from(reserve_bytes / full.max(1)).unwrap_or(usize::MAX);
            let halves = 2 * kda_bytes + max_context as u64 * position_bytes;
            let n = if whole >= 2 {
                whole
            } else if reserve_bytes >= halves {
                2
            } else {
                1
            };
            (n.clamp(1, DEFAULT_PARALLEL_CAP), "memory plan")
        });
        let parallel = parallel.clamp(1, MAX_PARALLEL);
        // Units small enough to count the reserve in a u32.
        let scale = (reserve_bytes / position_bytes).div_ceil(1 << 30).max(1);
        let unit_bytes = position_bytes * scale;
        let units = u32::try_from(reserve_bytes / unit_bytes)
            .unwrap_or(u32::MAX)
            .max(1);
        Sharing {
            parallel,
            source,
            batcher: (parallel > 1).then(Batcher::new),
            slots: Arc::new(Semaphore::new(parallel)),
            reserve: Arc::new(Semaphore::new(units as usize)),
            reserve_bytes,
            unit_bytes,
            units,
            kda_bytes,
            position_bytes,
            max_context,
        }
    }

    /// The state a generation of `prompt` tokens and at most `max_new` new ones can reach.
    pub fn state_bytes(&self, prompt: usize, max_new: usize) -> u64 {
        let positions = prompt.saturating_add(max_new).min(self.max_context);
        self.kda_bytes + positions as u64 * self.position_bytes
    }

    /// [`Self::state_bytes`] in reserve units (at most the whole reserve).
    pub(crate) fn units_for(&self, prompt: usize, max_new: usize) -> u32 {
        let units = self.state_bytes(prompt, max_new).div_ceil(self.unit_bytes);
        u32::try_from(units)
            .unwrap_or(u32::MAX)
            .clamp(1, self.units)
    }

    /// Bytes of the reserve held by running generations now.
    pub fn reserved_bytes(&self) -> u64 {
        let free = self.reserve.available_permits() as u64;
        u64::from(self.units).saturating_sub(free) * self.unit_bytes
    }

    /// Generations running now.
    pub fn running(&self) -> usize {
        self.parallel.saturating_sub(self.slots.available_permits())
    }
}
