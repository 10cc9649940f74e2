//! What every model command shares around the library's engine builder: loading with the
//! CLI's startup lines on stderr (and the stream-install hub fetcher layered over the
//! experts), the memory-plan and expert-streaming reports, the backend line, and the Ctrl-C
//! flag.

use anyhow::{Result, anyhow};
use deltafin_k3::engine::{
    EngineBuilder, EngineConfig, EngineError, ExpertLayer, LoadProgress, LoadedEngine,
};
use deltafin_k3::model::K3Model;
use deltafin_k3::prefix::{CacheConfig, PrefixCache};
use deltafin_k3::weights::checkpoint::{Checkpoint, Layout};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The CLI's load progress: report lines and notes on stderr, huge-page copies as a byte
/// progress bar (hidden when stderr is not a terminal).
#[derive(Default)]
pub struct StderrProgress {
    bar: Mutex<Option<indicatif::ProgressBar>>,
}

impl LoadProgress for StderrProgress {
    fn info(&self, line: &str) {
        eprintln!("[deltafin] {line}");
    }
    fn note(&self, line: &str) {
        eprintln!("deltafin: note: {line}");
    }
    fn copy_started(&self, what: &str) {
        let bar = progress_bar(0);
        bar.set_message(format!("copying the {what} into huge-page memory"));
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }
    fn copy_advanced(&self, bytes: u64, total: u64) {
        if let Some(bar) = &*self.bar.lock().unwrap_or_else(|p| p.into_inner()) {
            bar.set_length(total);
            bar.inc(bytes);
        }
    }
    fn copy_finished(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// The stream-install hub fetcher as the engine's injected expert layer.
struct HubLayer {
    remote: deltafin_fetch::expert::RemoteExperts,
    root: std::path::PathBuf,
}

impl ExpertLayer for HubLayer {
    fn prepare(
        &mut self,
        checkpoint: &Checkpoint,
        opens_every_file: bool,
    ) -> std::result::Result<(), deltafin_k3::engine::BoxError> {
        // A table of few files opens every file up front: fetch the missing ones first.
        if opens_every_file {
            for (l, e) in deltafin_store::experts::stream_install_missing_experts(checkpoint) {
                deltafin_fetch::expert::ExpertFetch::fetch_expert(&self.remote, l, e).map_err(
                    |err| {
                        anyhow::Error::new(err)
                            .context(format!("stream install: fetching expert {e} of layer {l}"))
                    },
                )?;
            }
        }
        Ok(())
    }
    fn wrap(
        self: Box<Self>,
        inner: Box<dyn deltafin_experts::ExpertSource>,
    ) -> Box<dyn deltafin_experts::ExpertSource> {
        let HubLayer { remote, root } = *self;
        Box::new(crate::stream_install::FetchingExperts::new(
            &root,
            Box::new(remote),
            inner,
        ))
    }
}

/// The engine builder every command loads through: `config` at `root`, the CLI's progress,
/// and the hub fetcher over the experts of a stream install.
pub fn builder(root: &Path, config: &EngineConfig) -> EngineBuilder {
    EngineBuilder::new(root)
        .config(config.clone())
        .progress(Box::new(StderrProgress::default()))
        .expert_layer(Box::new(|checkpoint: &Checkpoint| {
            if checkpoint.layout() != Layout::StreamInstall {
                return Ok(None);
            }
            let remote = crate::stream_install::remote_experts(checkpoint.root())?;
            let root = checkpoint.root().to_path_buf();
            Ok(Some(
                Box::new(HubLayer { remote, root }) as Box<dyn ExpertLayer>
            ))
        }))
}

/// Why a model root cannot be loaded (`detail`), and what to do about it (`fix`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootProblem {
    pub detail: String,
    pub fix: String,
}

/// What keeps `root` from being loaded as a K3 install, before anything else is checked: a
/// path that does not exist, is not a directory or cannot be read, or a directory without
/// the files of an install (`None`: it has a config and a checkpoint layout).
pub fn root_problem(root: &Path) -> Option<RootProblem> {
    if let Some(p) = path_problem(root) {
        return Some(p);
    }
    let what = deltafin_k3::weights::install::missing(root)?;
    let r = root.display();
    Some(RootProblem {
        detail: format!("no K3 model installed at {r}: {what}"),
        fix: format!("install it with `deltafin setup --model-root {r}`, or {POINT}"),
    })
}

/// How to fix a wrong model root.
const POINT: &str = "point --model-root (or DELTAFIN_ROOT) at the directory of a K3 install";

/// What keeps `root` from being a model root at all, whatever it holds: a path that does not
/// exist, is not a directory or cannot be read (`None`: a readable directory).
pub fn path_problem(root: &Path) -> Option<RootProblem> {
    let r = root.display();
    let point = POINT;
    let (detail, fix) = match std::fs::metadata(root) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
            format!("model root {r} does not exist"),
            format!("check the path: {point} (`deltafin setup --model-root PATH` installs one)"),
        ),
        Err(e) => (
            format!("model root {r} cannot be read: {e}"),
            format!("check the path and its permissions, or {point}"),
        ),
        Ok(m) if !m.is_dir() => (
            format!("model root {r} is not a directory"),
            point.to_string(),
        ),
        Ok(_) => return None,
    };
    Some(RootProblem { detail, fix })
}

/// Fail with [`root_problem`]'s words unless `root` holds an install.
pub fn check_root(root: &Path) -> Result<()> {
    match root_problem(root) {
        Some(p) => Err(anyhow!("{}; {}", p.detail, p.fix)),
        None => Ok(()),
    }
}

/// Load the install at `root` with `config`; the device line and the routed experts' words
/// (`expert_backend=… scale4=…`) go into [`backend_description`].
pub fn load(root: &Path, config: &EngineConfig) -> Result<LoadedEngine> {
    check_root(root)?;
    check_kernels()?;
    let loaded = builder(root, config).build().map_err(cli_error)?;
    *DEVICE_LINE.lock().unwrap_or_else(|p| p.into_inner()) =
        Some(format!("{} {}", loaded.device_line, loaded.experts_words()));
    Ok(loaded)
}

/// The prefix-state cache of a loaded engine under `settings` (`None` when off): the RAM
/// tier the memory plan reserved (or the setting's size without a plan), the disk tier in
/// `k3-meta/state-cache/` under the model root. A disk directory that cannot be made is a
/// warning, and the states stay in RAM.
pub fn state_cache(
    loaded: &LoadedEngine,
    settings: &crate::engine_config::StateCacheSettings,
) -> Option<PrefixCache> {
    if !settings.enabled {
        return None;
    }
    let ram_bytes = loaded
        .plan
        .as_ref()
        .map_or(settings.ram_bytes, |p| p.state_cache);
    let disk = (settings.disk_bytes > 0).then(|| {
        (
            loaded.checkpoint.root().join("k3-meta").join("state-cache"),
            settings.disk_bytes,
        )
    });
    let warn = || -> Box<dyn Fn(&str) + Send + Sync> {
        Box::new(|m: &str| eprintln!("deltafin: warning: {m}"))
    };
    let tag = loaded.state_tag();
    let config = CacheConfig { ram_bytes, disk };
    match PrefixCache::new(&loaded.model, tag.clone(), &config, warn()) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("deltafin: warning: {e}; prefix states stay in RAM only");
            let ram_only = CacheConfig {
                ram_bytes,
                disk: None,
            };
            PrefixCache::new(&loaded.model, tag, &ram_only, warn()).ok()
        }
    }
}

/// The startup line of a prefix-state cache.
pub fn describe_state_cache(
    cache: &PrefixCache,
    loaded: &LoadedEngine,
    settings: &crate::engine_config::StateCacheSettings,
) -> String {
    let ram = loaded
        .plan
        .as_ref()
        .map_or(settings.ram_bytes, |p| p.state_cache);
    let per_kda = loaded.model.dims.kda_state_bytes() as f64;
    let dir = loaded.checkpoint.root().join("k3-meta").join("state-cache");
    let disk = if cache.has_disk() {
        format!(
            "disk={:.3} GB in {}",
            settings.disk_bytes as f64 / 1e9,
            dir.display()
        )
    } else if settings.disk_bytes > 0 {
        format!(
            "disk=off ({} is not writable: states stay in RAM)",
            dir.display()
        )
    } else {
        "disk=off".to_string()
    };
    format!(
        "state_cache=on ram={:.3} GB {disk} (one state: {:.3} GB + {} B per token; key {})",
        ram as f64 / 1e9,
        per_kda / 1e9,
        loaded.model.dims.mla_cache_bytes_per_token(),
        &cache.tag()[..12],
    )
}

/// An engine error in the CLI's words: a resident-layer cap beyond the model names the
/// variable it came from.
pub fn cli_error(e: EngineError) -> anyhow::Error {
    match e {
        EngineError::ResidentLayers { requested, layers } => anyhow!(
            "environment variable K3_PROVIDER_RESIDENT_LAYERS: \"{requested}\" is not an integer in 0…{layers}"
        ),
        e => anyhow::Error::new(e),
    }
}

/// The device and expert part of [`backend_description`], set once the model is placed.
static DEVICE_LINE: Mutex<Option<String>> = Mutex::new(None);

/// With a memory plan, say at startup how the budget is split and how experts are read.
pub fn report_memory_plan(model: &K3Model, plan: Option<&deltafin_k3::engine::MemoryPlan>) {
    if let Some(s) = deltafin_k3::weights::spine_stream::streamer(model) {
        eprintln!("[deltafin] {}", s.split().describe());
    }
    let Some(plan) = plan else { return };
    let (io, threads) = model
        .experts
        .stats()
        .map(|s| (s.io_path, s.read_threads))
        .unwrap_or_default();
    eprintln!(
        "[deltafin] {}",
        plan.describe(&io, threads, &pilot_gate_setting())
    );
}

/// `K3_PILOT_GATE` as set (`off` when unset), for the memory-plan line.
pub fn pilot_gate_setting() -> String {
    crate::env::env_var("K3_PILOT_GATE")
        .ok()
        .flatten()
        .unwrap_or_else(|| "off".into())
}

/// The expert-streaming summary (stderr): cache hits, prefetch recall, bytes read, achieved
/// GB/s, per-layer hit rates and recall, and the process memory (`/proc/self/status`:
/// peak RSS = anonymous + file-backed + shmem pages).
pub fn report_expert_stats(model: &K3Model) {
    if let Some(c) = &model.device_experts {
        eprintln!("[stats] {}", c.stats().describe(c.budget()));
    }
    if let Some(s) = deltafin_k3::weights::spine_stream::streamer(model) {
        let st = s.stats();
        eprintln!(
            "[stats] spine streamed_layers={} passes={} layer_reads={} bytes_read={} read_s={:.3} read_gbps={:.3} wait_s={:.3}",
            s.split().layers - s.split().resident,
            st.passes,
            st.layer_reads,
            st.bytes_read,
            st.read_seconds,
            st.read_gbps(),
            st.wait_seconds
        );
    }
    if let Some(st) = model.experts.stats() {
        eprintln!("[stats] experts {}", st.summary_line());
        eprintln!(
            "[stats] experts hit% by layer: {}",
            st.per_layer_hit_rates()
        );
        eprintln!(
            "[stats] experts recall% by layer: {}",
            st.per_layer_recall()
        );
        eprintln!(
            "[stats] experts PILOT precision% by rank (decode; decayed, off = gated): {}",
            st.per_rank_precision()
        );
        match model.provisional_head() {
            Some(Ok(h)) => {
                let (right, judged) = model.provisional_accuracy();
                eprintln!(
                    "[stats] experts PILOT next token (guessed from {} lm_head rows before lm_head): right {right} of {judged} ({:.1}%)",
                    h.len(),
                    100.0 * right as f64 / judged.max(1) as f64
                );
            }
            Some(Err(e)) => eprintln!("[stats] experts PILOT next token: off ({e})"),
            None => {}
        }
    }
    if let Some(c) = &model.resident_copy {
        eprintln!("[stats] {}", c.describe());
    }
    if let Some(m) = deltafin_k3::engine::host::proc_memory() {
        eprintln!(
            "[stats] memory peak_rss={} rss={} rss_anon={} rss_file={} anon_huge_pages={}",
            m.peak_rss, m.rss, m.rss_anon, m.rss_file, m.anon_huge
        );
    }
}

/// The sequential-read probe `--stats` compares the load with, taken before the load (so
/// that nothing else reads the disk meanwhile): the largest shard under `root`, up to 1 GB
/// ([`sequential_gbps`]). `(GB/s, read path, file)`; `None` without a shard.
pub fn load_probe(root: &Path) -> Option<(f64, String, std::path::PathBuf)> {
    let largest = std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|p| std::fs::metadata(&p).ok().map(|m| (m.len(), p)))
        .max()?
        .1;
    let (gbps, io) = sequential_gbps(&largest)?;
    Some((gbps, io, largest))
}

/// `--stats`: the load against the sequential-read probe ([`load_probe`]). The bytes placed
/// in huge-page memory (read from their files or copied), the load's seconds and GB/s, the
/// copies' own GB/s, then the probe and the two ratios (load GB/s and copy GB/s over probe
/// GB/s; docs/PERFORMANCE.md, "Loading").
pub fn report_load(
    load_seconds: f64,
    copies: &[deltafin_k3::weights::resident::ResidentCopy],
    probe: Option<&(f64, String, std::path::PathBuf)>,
) {
    if copies.is_empty() {
        eprintln!(
            "[stats] load: {load_seconds:.2} s; nothing copied into huge-page memory (the weights stay mapped from their files)"
        );
        return;
    }
    let bytes: u64 = copies.iter().map(|c| c.stats.total_bytes()).sum();
    let (direct, buffered, memory) = copies.iter().fold((0, 0, 0), |a, c| {
        (
            a.0 + c.stats.direct_bytes,
            a.1 + c.stats.buffered_bytes,
            a.2 + c.stats.memory_bytes,
        )
    });
    let copy_seconds: f64 = copies.iter().map(|c| c.stats.seconds).sum();
    let gb = |b: u64| b as f64 / 1e9;
    let load_gbps = gb(bytes) / load_seconds.max(1e-9);
    let copy_gbps = gb(bytes) / copy_seconds.max(1e-9);
    eprintln!(
        "[stats] load: {:.3} GB placed in huge-page memory ({:.3} GB O_DIRECT, {:.3} GB buffered, {:.3} GB from memory) in {load_seconds:.2} s of load, {copy_seconds:.2} s of it copying: {load_gbps:.3} GB/s over the load, {copy_gbps:.3} GB/s over the copies",
        gb(bytes),
        gb(direct),
        gb(buffered),
        gb(memory)
    );
    for c in copies {
        if let Some(why) = &c.stats.direct_refused {
            eprintln!("[stats] load: {}: O_DIRECT refused ({why})", c.what);
        }
    }
    match probe {
        Some((gbps, io, file)) => eprintln!(
            "[stats] load: sequential-read probe {gbps:.3} GB/s ({io}, {}, before the load); ratio load/probe {:.2}, copies/probe {:.2}",
            file.display(),
            load_gbps / gbps.max(1e-9),
            copy_gbps / gbps.max(1e-9)
        ),
        None => eprintln!("[stats] load: no sequential-read probe (no shard to read)"),
    }
}

/// A flag raised by the first Ctrl-C; a second Ctrl-C exits at once with status 130.
pub fn interrupt_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let installed = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\ndeltafin: interrupt received, stopping after the current token (Ctrl-C again to quit now)"
        );
    });
    if let Err(e) = installed {
        eprintln!("deltafin: warning: Ctrl-C handler not installed: {e}");
    }
    flag
}

/// Install the kernel settings from the environment now (each parsed strictly), so a bad
/// value is a clear startup error rather than a failure at the first product.
pub fn check_kernels() -> Result<()> {
    crate::kernel_env::install().map_err(|e| anyhow!("{e}"))
}

/// The compute backend line shared by the startup echo and the events file.
pub fn backend_description() -> String {
    let device = DEVICE_LINE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "device=cpu".into());
    format!(
        "{device} threads={} kernels={} {}",
        rayon::current_num_threads(),
        deltafin_kernels::kernel_backend(),
        deltafin_kernels::pool_settings(),
    )
}

/// A byte progress bar on stderr, hidden when stderr is not a terminal.
pub(crate) fn progress_bar(total: u64) -> indicatif::ProgressBar {
    deltafin_fetch::progress::stderr_bar(total, deltafin_fetch::progress::BYTES, true)
}

/// The sequential-read probe of `path`: up to 1 GB from its start in 8 MiB reads, four in
/// flight, O_DIRECT where the filesystem takes it (the expert read path). GB/s and the read
/// path (`direct` or `buffered (why)`).
pub(crate) fn sequential_gbps(path: &std::path::Path) -> Option<(f64, String)> {
    let opts = deltafin_experts::probe::ProbeOptions {
        sequential_bytes: 1_000_000_000,
        sequential_chunk: 8 << 20,
        random_size: 1 << 20,
        random_count: 0,
        threads: 4,
        direct_io: deltafin_experts::DirectIo::Auto,
        seed: 1,
    };
    let r = deltafin_experts::probe::probe(path, &opts).ok()?;
    (r.sequential_bytes > 0).then_some((r.sequential_gbps, r.io_path))
}
