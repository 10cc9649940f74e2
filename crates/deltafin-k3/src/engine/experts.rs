//! The routed-expert source stack, assembled in one place ([`assemble_expert_stack`]):
//! the base source (the shards' mmaps, or streaming reads under a memory budget with the
//! pinned tier and the learned heat), scale4 sidecars, a layer the caller injects (the hub
//! fetcher of a stream install), then the route observers (the heat histogram, the router
//! trace).

use crate::engine::config::{EngineConfig, Scale4Mode};
use crate::engine::error::{BoxError, EngineError};
use crate::engine::progress::{LoadProgress, with_copy_progress};
use crate::model::moe::ExpertSource;
use crate::weights::loader::{CheckpointExperts, streaming_experts_with_homes};
use crate::weights::resident::{HugePages, ResidentCopy};
use deltafin_experts::heat::{HeatRecorder, HeatTable};
use deltafin_experts::scale4::{SCALE4_DIR, Scale4Experts, Scale4Sidecars};
use deltafin_experts::{ExpertHomes, RouteObservers, RouterTrace, StreamOptions};
use deltafin_store::checkpoint::{Checkpoint, Layout};
use deltafin_store::config::K3Config;
use deltafin_store::experts::{config_sha256, expert_table, heat_dims, home_model, scale4_layout};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An expert source the caller layers over the engine's own, below the route observers
/// (the `deltafin` CLI's hub fetcher of a stream install, which lives in `deltafin-fetch`).
pub trait ExpertLayer: Send {
    /// Runs once before the engine's expert source opens its files. `opens_every_file`:
    /// the source is streaming and opens every file of its table up front (a table of at
    /// most `deltafin_experts::stream::MAX_OPEN_FILES` files), so each must exist now.
    fn prepare(
        &mut self,
        _checkpoint: &Checkpoint,
        _opens_every_file: bool,
    ) -> Result<(), BoxError> {
        Ok(())
    }
    /// `inner` with this layer over it.
    fn wrap(self: Box<Self>, inner: Box<dyn ExpertSource>) -> Box<dyn ExpertSource>;
}

/// Makes the caller's [`ExpertLayer`] for an opened checkpoint (`None`: no layer).
pub type ExpertLayerFactory =
    Box<dyn FnOnce(&Checkpoint) -> Result<Option<Box<dyn ExpertLayer>>, BoxError> + Send>;

/// Open the expert homes `dirs` for `checkpoint` (`None` without any): a home that is
/// missing, of another model or damaged is an error naming it.
pub fn open_expert_homes(
    checkpoint: &Checkpoint,
    dirs: &[PathBuf],
) -> Result<Option<ExpertHomes>, EngineError> {
    if dirs.is_empty() {
        return Ok(None);
    }
    let model = home_model(checkpoint)?;
    ExpertHomes::open(dirs, &model)
        .map(Some)
        .map_err(|e| EngineError::External(Box::new(e)))
}

/// `expert_homes=N (E routed experts held; DIR: C copies, G GB; …)`.
pub fn describe_homes(h: &ExpertHomes) -> String {
    let per: Vec<String> = h
        .homes()
        .iter()
        .map(|x| {
            format!(
                "{}: {} copies, {:.3} GB",
                x.dir.display(),
                x.journal().copies.len(),
                x.held_bytes() as f64 / 1e9
            )
        })
        .collect();
    format!(
        "expert_homes={} ({} routed experts held; {})",
        h.homes().len(),
        h.experts_held(),
        per.join("; ")
    )
}

/// Wrap `experts` per `mode`: with valid sidecars under `root/k3-experts-scale4` the scale
/// bytes come from them (the codes from `experts`), else `experts` unchanged (`auto`, `off`;
/// `auto` says why through `progress` when the directory exists) or an error (`require`).
/// Under `auto` an expert whose record turns out damaged keeps its raw scales (a warning
/// names the record); under `require` it is an error.
/// The flag says whether the sidecars are used.
pub fn wrap_scale4(
    checkpoint: &Checkpoint,
    experts: Box<dyn ExpertSource>,
    mode: Scale4Mode,
    progress: &dyn LoadProgress,
) -> Result<(Box<dyn ExpertSource>, bool), EngineError> {
    if mode == Scale4Mode::Off {
        return Ok((experts, false));
    }
    let root = checkpoint.root();
    let dir = root.join(SCALE4_DIR);
    let (layout, moe) = scale4_layout(checkpoint.config());
    let opened = config_sha256(root)
        .map_err(EngineError::from)
        .and_then(|sha| {
            Scale4Sidecars::open(&dir, layout, &moe, &sha)
                .map_err(|e| EngineError::External(Box::new(e)))
        });
    match (opened, mode) {
        (Ok(sidecars), Scale4Mode::Require) => {
            Ok((Box::new(Scale4Experts::new(experts, sidecars)), true))
        }
        // `auto`: the sidecars are optional and lossless, so a damaged record falls back to
        // the raw scales the expert was read with.
        (Ok(sidecars), _) => Ok((
            Box::new(Scale4Experts::with_fallback(experts, sidecars)),
            true,
        )),
        (Err(e), Scale4Mode::Require) => Err(EngineError::Context {
            context: format!(
                "K3_EXPERT_SCALE4=require but the scale4 sidecars in {} are not complete and valid (run `deltafin convert-experts-scale4 --model-root {}`)",
                dir.display(),
                root.display()
            ),
            source: Box::new(e),
        }),
        (Err(e), _) => {
            if dir.exists() {
                progress.info(&format!(
                    "scale4 sidecars in {} not used ({}); experts use their raw scales",
                    dir.display(),
                    chain(&e)
                ));
            }
            Ok((experts, false))
        }
    }
}

/// `e` and its sources, `: `-separated.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(src) = at {
        s += &format!(": {src}");
        at = src.source();
    }
    s
}

/// The learned route histogram of the install at `root` (empty when heat is off; a file
/// that cannot be used is a note through `progress`).
pub(crate) fn learned_heat(
    root: &Path,
    cfg: &K3Config,
    enabled: bool,
    progress: &dyn LoadProgress,
) -> (HeatTable, PathBuf) {
    let dims = heat_dims(cfg);
    let path = root.join(deltafin_experts::heat::HEAT_FILE);
    if !enabled {
        return (HeatTable::empty(dims), path);
    }
    let loaded = deltafin_experts::heat::load(&path, dims);
    if let Some(note) = &loaded.note {
        progress.note(note);
    }
    (loaded.table, path)
}

/// The base source the stack starts from.
pub(crate) enum Base {
    /// Every expert resident through the shard mmaps; copy them into huge-page memory when
    /// `copy` and they fit.
    Resident { copy: bool },
    /// Streaming reads under these options (the plan's cache size).
    Streaming(StreamOptions),
}

/// What [`assemble_expert_stack`] built.
pub(crate) struct ExpertStack {
    /// The source the model asks for experts.
    pub experts: Box<dyn ExpertSource>,
    /// The route observers the model notifies.
    pub observers: RouteObservers,
    /// The copy of the resident experts into huge-page memory, when one was made.
    pub copy: Option<ResidentCopy>,
    /// Whether the experts take their scales from the scale4 sidecars ([`wrap_scale4`]).
    pub scale4: bool,
}

/// Assemble the routed-expert source stack, bottom to top:
///
/// 1. the base: resident experts (optionally copied into huge-page memory), or streaming
///    reads with the pinned tier filled from the learned histogram's candidates and the
///    cache's heat seeded from its rates;
/// 2. scale4 sidecars ([`wrap_scale4`]);
/// 3. the caller's injected layer, prepared before the base opens its files;
/// 4. beside the stack, the route observers the model calls with every MoE pass's routes:
///    the heat recorder (when heat is on), then the router trace.
pub(crate) fn assemble_expert_stack(
    checkpoint: &Arc<Checkpoint>,
    config: &EngineConfig,
    base: Base,
    learned: &HeatTable,
    heat_path: PathBuf,
    layer: Option<ExpertLayerFactory>,
    progress: &dyn LoadProgress,
) -> Result<ExpertStack, EngineError> {
    let pin = config.heat.pin_bytes;
    let mut copy_report = None;
    let ((source, scale4), layer): ((Box<dyn ExpertSource>, bool), _) = match base {
        Base::Resident { copy } => {
            if pin > 0 {
                progress.note(
                    "K3_EXPERT_PIN_GB has no effect without a memory budget: every expert is resident",
                );
            }
            if !config.expert_homes.is_empty() {
                progress.note(
                    "expert homes are read only when experts stream (under a memory budget, --memory-budget-gb): every expert is resident, read from the model root",
                );
            }
            let resident = CheckpointExperts::new(checkpoint.clone());
            if copy && checkpoint.layout() == Layout::Shards {
                copy_report = copy_experts_if_they_fit(&resident, progress)?;
            }
            let experts = wrap_scale4(checkpoint, Box::new(resident), config.scale4, progress)?;
            let layer = match layer {
                Some(make) => make(checkpoint).map_err(EngineError::External)?,
                None => None,
            };
            (experts, layer)
        }
        Base::Streaming(opts) => {
            let mut layer = match layer {
                Some(make) => make(checkpoint).map_err(EngineError::External)?,
                None => None,
            };
            if let Some(l) = layer.as_mut() {
                let table = expert_table(checkpoint)
                    .map_err(EngineError::context("cannot locate the routed experts"))?;
                let opens_every_file =
                    table.files.len() <= deltafin_experts::stream::MAX_OPEN_FILES;
                l.prepare(checkpoint, opens_every_file)
                    .map_err(EngineError::External)?;
            }
            let homes = open_expert_homes(checkpoint, &config.expert_homes)?;
            if let Some(h) = &homes {
                progress.info(&describe_homes(h));
            }
            let src = streaming_experts_with_homes(checkpoint, opts, homes)
                .map_err(EngineError::context("cannot set up expert streaming"))?;
            src.set_pin_tier(&learned.pin_candidates(), pin)
                .map_err(EngineError::context("cannot set up the pinned expert tier"))?;
            if learned.mass > 0.0 {
                let d = learned.dims;
                let rates: Vec<((usize, usize), f64)> = (1..=d.layers)
                    .flat_map(|l| (0..d.experts).map(move |e| (l, e)))
                    .map(|(l, e)| ((l, e), learned.get(l, e) / learned.mass))
                    .filter(|(_, r)| *r > 0.0)
                    .collect();
                src.seed_heat(&rates, (d.layers * d.top_k) as f64);
            }
            let experts = wrap_scale4(checkpoint, Box::new(src), config.scale4, progress)?;
            (experts, layer)
        }
    };
    let experts = match layer {
        Some(l) => l.wrap(source),
        None => source,
    };
    let mut observers = RouteObservers::default();
    if config.heat.enabled {
        observers.push(Box::new(HeatRecorder::new(
            heat_path,
            heat_dims(checkpoint.config()),
        )));
    }
    if let Some(t) = &config.router_trace {
        let path = &t.path;
        // `k3-meta/` is deltafin's own directory under the root: a trace in it (the
        // documented place) creates it, as the heat histogram and the state cache do.
        let meta = checkpoint.root().join("k3-meta");
        if path.parent() == Some(meta.as_path()) {
            std::fs::create_dir_all(&meta).map_err(EngineError::context(format!(
                "router trace: cannot create {}",
                meta.display()
            )))?;
        }
        observers.push(Box::new(
            RouterTrace::create_with_mode(path, t.mode).map_err(EngineError::context(format!(
                "router trace: cannot open {}",
                path.display()
            )))?,
        ));
    }
    Ok(ExpertStack {
        experts,
        observers,
        copy: copy_report,
        scale4,
    })
}

/// With every expert resident, copy the experts into huge-page memory when they take at
/// most half of the memory available now (returning what was copied); otherwise they stay
/// mapped from the shards (paged in as used) and a note says why.
fn copy_experts_if_they_fit(
    experts: &CheckpointExperts,
    progress: &dyn LoadProgress,
) -> Result<Option<ResidentCopy>, EngineError> {
    let need = experts.total_bytes();
    let available = crate::engine::host::meminfo().map(|m| m.available);
    match available {
        Some(avail) if need.saturating_mul(2) <= avail => {
            let c = with_copy_progress(progress, "routed experts", |p| {
                experts.copy_to_huge_pages(p)
            })
            .map_err(EngineError::context(
                "copying the routed experts into huge-page memory",
            ))?;
            progress.info(&c.describe());
            Ok(Some(c))
        }
        _ => {
            progress.note(&format!(
            "routed experts stay mapped from the shards: {:.3} GB is more than half of the {} available ({}=off never copies them)",
            need as f64 / 1e9,
            available.map_or("(unknown) memory".into(), |a| format!(
                "{:.3} GB",
                a as f64 / 1e9
            )),
            HugePages::ENV
            ));
            Ok(None)
        }
    }
}
