//! `deltafin warm-expert-cache` (product contract §1.3; docs/CLI.md): rank routed experts by
//! how often router traces (§4.9) and the heat histogram (§4.8) saw them, show the best,
//! and with `--fetch N` make the N best-ranked experts missing from `k3-experts/` local.
//!
//! Sources for `--fetch`: a stream install (shards not local) fetches each expert's byte range
//! from the hub (`deltafin-fetch`'s expert fetch); a full install whose `k3-experts/` exists
//! writes the missing files from the local shards; a full install without `k3-experts/`
//! already reads every expert from its shards, so nothing is missing.
//!
//! `--convert-npz` migrates the original's legacy NPZ expert archives to raw files instead
//! (`crate::npz`).

use crate::RootArg;
use crate::npz;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use deltafin_experts::heat::{self, HeatDims};
use deltafin_experts::layout::ExpertShape;
use deltafin_experts::rank::{
    Ranked, RouteCounts, TraceSummary, looks_like_trace, rank, read_trace,
};
use deltafin_fetch::expert::{ExpertFetch, RemoteExperts};
use deltafin_fetch::transfer::parse_workers;
use deltafin_store::checkpoint::{CONFIG_FILE, Checkpoint, INDEX_FILE};
use deltafin_store::checkpoint::{EXPERT_DIR, expert_file_name};
use deltafin_store::config::K3Config;
use deltafin_store::install;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Schema name of `--json` output.
pub const SCHEMA: &str = "deltafin.warm_expert_cache.v1";

/// `deltafin warm-expert-cache`.
#[derive(Args, Debug, Clone)]
pub struct WarmArgs {
    /// Router trace JSONL (repeatable; a relative PATH is under the model root) [default:
    /// every router trace `k3-meta/*.jsonl`].
    #[arg(long = "trace", value_name = "PATH")]
    pub traces: Vec<PathBuf>,
    /// Make the N best-ranked experts missing from k3-experts/ local (without it: plan only).
    #[arg(long, value_name = "N", conflicts_with = "cache")]
    pub fetch: Option<usize>,
    /// With --fetch: allow a plain http:// hub endpoint or redirect (a mirror you trust)
    /// [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long, requires = "fetch")]
    pub insecure_http: bool,
    /// Rows of the ranking to print.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub show: usize,
    /// Print one JSON object (schema deltafin.warm_expert_cache.v1) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Inspect this directory of L{layer}-E{expert}.bin files instead of k3-experts/.
    #[arg(long, value_name = "PATH")]
    pub cache: Option<PathBuf>,
    /// Parallel expert fetches, 1…16.
    #[arg(long, value_name = "N", default_value = "4", value_parser = parse_workers)]
    pub workers: usize,
    /// Migrate legacy NPZ expert archives (`L{layer}-E{expert}.npz`: six uint8 arrays
    /// w1_p, w1_s, w2_p, w2_s, w3_p, w3_s) losslessly to raw `.bin` experts: from every
    /// `k3-cache*/` directory under the model root and from k3-experts/ into k3-experts/ (with
    /// --cache: from and into that directory). Each is CRC- and shape-checked, written,
    /// fsynced, read back and compared by SHA-256, published without replacing a file, and
    /// then its NPZ is deleted (unless --keep-npz).
    #[arg(long, conflicts_with_all = ["fetch", "json", "traces"])]
    pub convert_npz: bool,
    /// With --convert-npz: archives converted at once, 1…16.
    #[arg(long, value_name = "N", default_value = "4", value_parser = parse_workers, requires = "convert_npz")]
    pub convert_workers: usize,
    /// With --convert-npz: convert only the first N archives (by layer, then expert).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), requires = "convert_npz")]
    pub convert_limit: Option<u64>,
    /// With --convert-npz: pause this many milliseconds (0…60000) after each archive, per
    /// worker, to leave the disk to other work.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=60_000), requires = "convert_npz")]
    pub convert_throttle_ms: Option<u64>,
    /// With --convert-npz: keep each NPZ after its raw file is published.
    #[arg(long, requires = "convert_npz")]
    pub keep_npz: bool,
    #[command(flatten)]
    pub root: RootArg,
}

/// `--convert-npz`: the legacy archives of every `k3-cache*/` directory under `root` and of
/// `dir` converted into raw-v1 files in `dir` (with `--cache`, `dir` alone).
fn convert_npz(
    a: &WarmArgs,
    root: &Path,
    cfg: &K3Config,
    shape: ExpertShape,
    dir: &Path,
) -> Result<ExitCode> {
    let mut sources = Vec::new();
    if a.cache.is_none() {
        let entries =
            std::fs::read_dir(root).with_context(|| format!("cannot list {}", root.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("cannot list {}", root.display()))?;
            let legacy = e
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("k3-cache"));
            if legacy && e.file_type().is_ok_and(|t| t.is_dir()) {
                sources.push(e.path());
            }
        }
        sources.sort();
    }
    sources.push(dir.to_path_buf());
    let found = npz::scan(
        &sources,
        |l| l < cfg.n_layers() && !cfg.is_dense(l),
        cfg.text.num_experts,
    )?;
    let limit = a.convert_limit.map_or(found.len(), |n| {
        usize::try_from(n).unwrap_or(usize::MAX).min(found.len())
    });
    let jobs = &found[..limit];
    let searched: Vec<String> = sources.iter().map(|p| p.display().to_string()).collect();
    if jobs.is_empty() {
        println!(
            "no legacy NPZ expert archives (L{{layer}}-E{{expert}}.npz) in {}",
            searched.join(", ")
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !dir.is_dir() {
        // A full install reads its experts from the shards until k3-experts/ exists, and
        // then only from it: a partial directory would stop it loading.
        if shards_local(root)? {
            bail!(
                "{} does not exist: this full install reads every expert from its shards, so the {} legacy archives are not needed (delete them), and a k3-experts/ holding only them would stop it loading; convert them elsewhere with --cache PATH",
                dir.display(),
                found.len()
            );
        }
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    println!(
        "converting {} of {} legacy NPZ expert archives from {} into {} ({} workers{})",
        jobs.len(),
        found.len(),
        searched.join(", "),
        dir.display(),
        a.convert_workers,
        if a.keep_npz {
            ", keeping the archives"
        } else {
            ""
        }
    );
    let bar = deltafin_fetch::progress::stderr_bar(
        jobs.len() as u64,
        "{bar:40} {pos}/{len} archives eta {eta}",
        true,
    );
    let opts = npz::Options {
        workers: a.convert_workers,
        throttle: std::time::Duration::from_millis(a.convert_throttle_ms.unwrap_or(0)),
        keep_npz: a.keep_npz,
    };
    // A file of the root's own k3-experts/ gets its receipt, as a fetched one does, so that
    // `setup --check` re-hashes it.
    let receipt = |_: &npz::Job, path: &Path, len: u64, sha: &str| -> Result<()> {
        if path.starts_with(root) {
            deltafin_fetch::receipts::record(root, path, len, sha)?;
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    let report = npz::convert(jobs, dir, shape, &opts, &receipt, &|| bar.inc(1));
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "converted {} archives ({:.1} MB, {:.1} MB/s), {} identical raw files already present, {} archives deleted, {} failed",
        report.converted,
        report.bytes as f64 / 1e6,
        report.bytes as f64 / 1e6 / secs.max(1e-9),
        report.reused,
        report.deleted,
        report.failed.len()
    );
    if let Some((path, why)) = report.failed.first() {
        bail!(
            "{} of {} legacy archives were not converted (their raw files are not published and the archives are kept; rerun to retry); first: {}: {why}",
            report.failed.len(),
            jobs.len(),
            path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `root` holds every shard named by its weight index.
fn shards_local(root: &Path) -> Result<bool> {
    let idx = root.join(INDEX_FILE);
    let Ok(text) = std::fs::read_to_string(&idx) else {
        return Ok(false);
    };
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", idx.display()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| anyhow!("{}: no \"weight_map\" object", idx.display()))?;
    let mut shards: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    shards.sort_unstable();
    shards.dedup();
    Ok(!shards.is_empty() && shards.iter().all(|s| root.join(s).is_file()))
}

fn is_cached(dir: &Path, layer: usize, expert: usize, bytes: u64) -> bool {
    std::fs::metadata(dir.join(expert_file_name(layer, expert))).is_ok_and(|m| m.len() == bytes)
}

/// Write `dir/L{l}-E{e}.bin` from the checkpoint's shards (`.tmp`, fsync, the receipt,
/// then rename).
fn write_from_shards(
    ckpt: &Checkpoint,
    (root, dir): (&Path, &Path),
    layer: usize,
    expert: usize,
) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let span = ckpt.expert_span(layer, expert)?;
    let f = std::fs::File::open(&span.shard_path)
        .with_context(|| format!("cannot open {}", span.shard_path.display()))?;
    let mut bytes = Vec::with_capacity(span.total_bytes() as usize);
    for &(off, len) in &span.ranges {
        let at = bytes.len();
        bytes.resize(at + len as usize, 0);
        f.read_exact_at(&mut bytes[at..], off).with_context(|| {
            format!(
                "reading expert {expert} of layer {layer} from {}",
                span.shard_path.display()
            )
        })?;
    }
    let path = dir.join(expert_file_name(layer, expert));
    let tmp = dir.join(format!("{}.tmp", expert_file_name(layer, expert)));
    // Durable before it is published: a power loss never leaves a file of the right size
    // with zeros in it.
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        std::io::Write::write_all(&mut f, &bytes)?;
        f.sync_all()
    });
    if let Err(e) = written {
        // A full disk: the partial temporary would only hold on to the space.
        let _ = std::fs::remove_file(&tmp);
        return Err(anyhow::Error::new(e).context(format!("cannot write {}", tmp.display())));
    }
    // Its fetch receipt, for `setup --check` (docs/SETUP.md), when it is the root's file.
    if path.starts_with(root) {
        use sha2::Digest;
        let sha = hex::encode(sha2::Sha256::digest(&bytes));
        deltafin_fetch::receipts::record(root, &path, bytes.len() as u64, &sha)?;
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot rename {}", tmp.display()))?;
    Ok(bytes.len() as u64)
}

/// Run `job` over `items` on `workers` threads; the first error wins.
fn parallel<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    job: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers.min(items.len()).max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = job(item);
                    let failed = r.is_err();
                    out.lock().unwrap_or_else(|p| p.into_inner()).push((i, r));
                    if failed {
                        next.store(items.len(), std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let mut v = out.into_inner().unwrap_or_else(|p| p.into_inner());
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, r)| r).collect()
}

/// `deltafin warm-expert-cache`.
pub fn warm_expert_cache(a: &WarmArgs) -> Result<ExitCode> {
    let root = a.root.resolve();
    // A metadata-only install is enough here, so only the path itself is checked first.
    if let Some(p) = crate::session::path_problem(&root) {
        bail!("{}; {}", p.detail, p.fix);
    }
    let cfg_path = root.join(CONFIG_FILE);
    if !cfg_path.is_file() {
        bail!(
            "no K3 install at {}: {CONFIG_FILE} is missing (run `deltafin setup-k3 --meta-only` or pass --model-root)",
            root.display()
        );
    }
    let cfg = K3Config::from_file(&cfg_path).map_err(|e| anyhow!("{e}"))?;
    let dims = deltafin_store::experts::heat_dims(&cfg);
    let shape = ExpertShape {
        f: cfg.text.moe_intermediate_size,
        lr: cfg.text.routed_expert_hidden_size,
    };
    let expert_bytes = shape.expert_bytes();
    let cache_dir = a.cache.clone().unwrap_or_else(|| root.join(EXPERT_DIR));
    if a.cache.is_some() && !cache_dir.is_dir() {
        bail!("--cache {}: not a directory", cache_dir.display());
    }
    if a.convert_npz {
        return convert_npz(a, &root, &cfg, shape, &cache_dir);
    }

    // Traces: the given ones, else every router trace in k3-meta/.
    let traces: Vec<PathBuf> = if a.traces.is_empty() {
        discover(&root)?
    } else {
        a.traces.iter().map(|p| root.join(p)).collect()
    };
    let mut counts = RouteCounts::default();
    let mut summaries: Vec<TraceSummary> = Vec::new();
    for t in &traces {
        summaries.push(read_trace(t, dims, &mut counts)?);
    }
    let heat_path = root.join(heat::HEAT_FILE);
    let loaded = heat::load(&heat_path, dims);
    let heat_status = match &loaded.note {
        None => "loaded",
        Some(_) if !heat_path.exists() => "absent",
        Some(note) => {
            eprintln!("deltafin: warning: {note}");
            "ignored"
        }
    };
    let heat_table = loaded.note.is_none().then_some(&loaded.table);
    let ranked = rank(&counts, heat_table);
    let total = dims.slots();
    let fetch = match a.fetch {
        None => None,
        Some(n) => Some(fetch(
            a,
            &root,
            &cache_dir,
            &ranked,
            n,
            (expert_bytes, dims.experts),
        )?),
    };
    let cached_total = count_cached(&cache_dir, dims, expert_bytes);

    if a.json {
        let rows: Vec<Value> = ranked
            .iter()
            .take(a.show)
            .enumerate()
            .map(|(i, r)| row_json(i, r, is_cached(&cache_dir, r.layer, r.expert, expert_bytes)))
            .collect();
        let out = json!({
            "schema": SCHEMA,
            "model_root": root.display().to_string(),
            "cache_dir": cache_dir.display().to_string(),
            "experts_total": total,
            "experts_cached": cached_total,
            "traces": summaries.iter().map(|s| json!({
                "path": s.path.display().to_string(), "lines": s.lines, "passes": s.passes,
                "torn_lines_skipped": s.torn,
            })).collect::<Vec<_>>(),
            "heat": {
                "path": heat_path.display().to_string(),
                "status": heat_status,
                "passes": heat_table.map_or(0, |t| t.passes),
                "mass": heat_table.map_or(0.0, |t| t.mass),
            },
            "ranked_total": ranked.len(),
            "ranked": rows,
            "fetch": fetch.as_ref().map(|f| f.json()),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "warm-expert-cache: model root {}; cache {} holds {cached_total} of {total} experts",
        root.display(),
        cache_dir.display()
    );
    for s in &summaries {
        println!(
            "trace {}: {} lines, {} passes{}",
            s.path.display(),
            s.lines,
            s.passes,
            if s.torn > 0 {
                format!(
                    "; {} torn line{} skipped (cut short by a crash or a full disk)",
                    s.torn,
                    if s.torn == 1 { "" } else { "s" }
                )
            } else {
                String::new()
            }
        );
    }
    match heat_table {
        Some(t) => println!(
            "heat {}: {} passes learned (decayed mass {:.1})",
            heat_path.display(),
            t.passes,
            t.mass
        ),
        None => println!("heat {}: {heat_status}", heat_path.display()),
    }
    if ranked.is_empty() {
        println!(
            "nothing to rank: no routes in traces and no learned heat (record a trace with `deltafin run --router-trace k3-meta/routes.jsonl`)"
        );
    } else {
        println!(
            "{:>5} {:>5} {:>6} {:>8} {:>10} {:>10} {:>10} {:>6}",
            "rank", "layer", "expert", "routes", "weight", "heat", "score", "cached"
        );
        for (i, r) in ranked.iter().take(a.show).enumerate() {
            println!(
                "{:>5} {:>5} {:>6} {:>8} {:>10.3} {:>10.2} {:>10.2} {:>6}",
                i + 1,
                r.layer,
                r.expert,
                r.routes,
                r.weight,
                r.heat,
                r.score,
                if is_cached(&cache_dir, r.layer, r.expert, expert_bytes) {
                    "yes"
                } else {
                    "no"
                }
            );
        }
        println!("{} experts ranked", ranked.len());
    }
    match &fetch {
        Some(f) => println!("{}", f.message),
        None if a.cache.is_none() && !cache_dir.is_dir() && shards_local(&root)? => {
            println!("full install: every expert is read from the local shards (plan only)")
        }
        None => {
            let missing = ranked
                .iter()
                .filter(|r| !is_cached(&cache_dir, r.layer, r.expert, expert_bytes))
                .count();
            println!(
                "{missing} ranked experts are not in the cache (plan only; --fetch N makes the N best local)"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn row_json(i: usize, r: &Ranked, cached: bool) -> Value {
    json!({
        "rank": i + 1, "layer": r.layer, "expert": r.expert, "routes": r.routes,
        "weight": r.weight, "heat": r.heat, "score": r.score, "cached": cached,
    })
}

fn count_cached(dir: &Path, dims: HeatDims, bytes: u64) -> usize {
    if !dir.is_dir() {
        return 0;
    }
    (1..=dims.layers)
        .flat_map(|l| (0..dims.experts).map(move |e| (l, e)))
        .filter(|&(l, e)| is_cached(dir, l, e, bytes))
        .count()
}

fn discover(root: &Path) -> Result<Vec<PathBuf>> {
    let meta = root.join("k3-meta");
    let Ok(rd) = std::fs::read_dir(&meta) else {
        return Ok(Vec::new());
    };
    let mut v = Vec::new();
    for entry in rd {
        let p = entry
            .with_context(|| format!("cannot list {}", meta.display()))?
            .path();
        if p.extension().is_some_and(|x| x == "jsonl") && p.is_file() {
            if looks_like_trace(&p) {
                v.push(p);
            } else {
                eprintln!(
                    "deltafin: note: {} is not a router trace; skipped",
                    p.display()
                );
            }
        }
    }
    v.sort();
    Ok(v)
}

struct Fetched {
    requested: usize,
    source: &'static str,
    done: Vec<(usize, usize, u64)>,
    message: String,
}

impl Fetched {
    fn json(&self) -> Value {
        json!({
            "requested": self.requested,
            "source": self.source,
            "fetched": self.done.iter().map(|(l, e, b)| json!({"layer": l, "expert": e, "bytes": b})).collect::<Vec<_>>(),
            "message": self.message,
        })
    }
}

fn fetch(
    a: &WarmArgs,
    root: &Path,
    dir: &Path,
    ranked: &[Ranked],
    n: usize,
    (expert_bytes, per_layer): (u64, usize),
) -> Result<Fetched> {
    let full = shards_local(root)?;
    if full && !dir.is_dir() {
        return Ok(Fetched {
            requested: n,
            source: "none",
            done: Vec::new(),
            message: format!(
                "full install: every expert is read from the local shards, none is missing (no {} directory)",
                EXPERT_DIR
            ),
        });
    }
    let todo: Vec<(usize, usize)> = ranked
        .iter()
        .filter(|r| !is_cached(dir, r.layer, r.expert, expert_bytes))
        .take(n)
        .map(|r| (r.layer, r.expert))
        .collect();
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (source, done) = if full {
        let ckpt = install::open_checkpoint(root)?;
        let done = parallel(&todo, a.workers, |&(l, e)| {
            // The expert's byte of the install lock, as the hub fetcher takes it.
            let index = deltafin_fetch::lock::expert_index(l, e, per_layer)?;
            let _lock =
                deltafin_fetch::lock::lock_expert(root, index, deltafin_fetch::lock::EXPERT_WAIT)?;
            if is_cached(dir, l, e, expert_bytes) {
                return Ok((l, e, expert_bytes));
            }
            write_from_shards(&ckpt, (root, dir), l, e).map(|b| (l, e, b))
        })?;
        ("shards", done)
    } else {
        let ms = deltafin_fetch::manifest::Manifests::from_env()
            .context("loading the source manifests")?;
        let client =
            deltafin_fetch::hub::HubClient::from_env(a.insecure_http).context("hub endpoint")?;
        let remote = RemoteExperts::open(root, &ms.k3, client).with_context(|| {
            format!(
                "stream install at {}: cannot fetch experts (run `deltafin setup --stream` first)",
                root.display()
            )
        })?;
        let done = parallel(&todo, a.workers, |&(l, e)| {
            let p = remote
                .fetch_expert(l, e)
                .with_context(|| format!("fetching expert {e} of layer {l}"))?;
            let b = std::fs::metadata(&p)
                .with_context(|| format!("cannot stat {}", p.display()))?
                .len();
            Ok((l, e, b))
        })?;
        ("hub", done)
    };
    let bytes: u64 = done.iter().map(|d| d.2).sum();
    Ok(Fetched {
        requested: n,
        source,
        message: format!(
            "fetched {} experts ({bytes} B) from the {source} into {}",
            done.len(),
            dir.display()
        ),
        done,
    })
}
