//! `setup`, `setup-k3`, `setup-dspark`, `setup-qwen` and `fetch-weights` (product contract
//! §1.3, §5; docs/SETUP.md). Model root: `--model-root`, else `DELTAFIN_ROOT`, else `.`.

use crate::RootArg;
use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args};
use deltafin_fetch::check::{CheckReport, check_k3, check_k3_meta, check_repo};
use deltafin_fetch::hf_cache::{HfCache, default_hub_dir};
use deltafin_fetch::hub::HubClient;
use deltafin_fetch::inventory::Inventory;
use deltafin_fetch::layers::{format_layers, parse_layers};
use deltafin_fetch::manifest::Manifests;
use deltafin_fetch::plan::{Mode, Selection, plan_setup, size_text, weight_items, weight_jobs};
use deltafin_fetch::setup::{
    self as fsetup, DiskCheck, Setup, check_setup, choose_mode, recorded_mode,
};
use deltafin_fetch::transfer::{TransferOptions, parse_workers};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// `deltafin setup`.
#[derive(Args, Debug, Clone)]
pub struct SetupArgs {
    /// Plan exact downloads and peak disk use; no network, no writes.
    #[arg(long, conflicts_with = "check")]
    pub dry_run: bool,
    /// Offline audit that the installation is complete.
    #[arg(long)]
    pub check: bool,
    /// Require the complete local expert pool (all release shards).
    #[arg(long, conflicts_with = "stream")]
    pub full: bool,
    /// Install the spine only; experts are fetched on demand.
    #[arg(long)]
    pub stream: bool,
    /// Also install (or check) the Qwen3 0.6B + 1.7B Base pair.
    #[arg(long)]
    pub include_qwen: bool,
    /// Parallel transfers, 1…16.
    #[arg(long, value_name = "N", default_value = "8", value_parser = parse_workers)]
    pub workers: usize,
    /// Use the files an earlier `hf download` (huggingface_hub) left in a Hugging Face
    /// cache: DIR is the hub cache (default `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`), one repository's `models--…` directory or its snapshot of
    /// the pinned revision. Each cached file is verified against the pins (and its blob's
    /// SHA-256 name), then hard-linked (copied across filesystems); the rest is fetched.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub from_hf_cache: Option<Option<PathBuf>>,
    /// Allow a plain http:// hub endpoint or redirect (a mirror you trust); downloads use
    /// https:// only otherwise [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long)]
    pub insecure_http: bool,
    #[command(flatten)]
    pub root: RootArg,
}

/// `deltafin setup-k3`.
#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("what").required(true).args(["meta_only", "check"])))]
pub struct SetupK3Args {
    /// Install the pinned metadata and build the tensor inventory from the shard headers.
    #[arg(long)]
    pub meta_only: bool,
    /// Verify the metadata and inventory offline.
    #[arg(long)]
    pub check: bool,
    /// Allow a plain http:// hub endpoint or redirect (a mirror you trust); downloads use
    /// https:// only otherwise [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long)]
    pub insecure_http: bool,
    #[command(flatten)]
    pub root: RootArg,
}

/// `deltafin setup-dspark`.
#[derive(Args, Debug, Clone)]
pub struct SetupDsparkArgs {
    /// Verify offline.
    #[arg(long, conflicts_with = "audit_only")]
    pub check: bool,
    /// Check remote metadata and the safetensors header only; no payload, no writes.
    #[arg(long)]
    pub audit_only: bool,
    /// Destination [default: <model root>/k3-draft-dspark].
    #[arg(long, value_name = "PATH")]
    pub destination: Option<PathBuf>,
    /// Allow a plain http:// hub endpoint or redirect (a mirror you trust); downloads use
    /// https:// only otherwise [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long)]
    pub insecure_http: bool,
    #[command(flatten)]
    pub root: RootArg,
}

/// `deltafin setup-qwen`.
#[derive(Args, Debug, Clone)]
pub struct SetupQwenArgs {
    /// Verify offline.
    #[arg(long)]
    pub check: bool,
    /// Allow a plain http:// hub endpoint or redirect (a mirror you trust); downloads use
    /// https:// only otherwise [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long)]
    pub insecure_http: bool,
    #[command(flatten)]
    pub root: RootArg,
}

/// `deltafin fetch-weights`.
#[derive(Args, Debug, Clone)]
pub struct FetchWeightsArgs {
    /// Print the work; no network, no writes.
    #[arg(long)]
    pub dry_run: bool,
    /// Only the spine (k3-resident/tensors/).
    #[arg(long, conflicts_with_all = ["experts_only", "layers"])]
    pub spine_only: bool,
    /// Only per-expert files (k3-experts/).
    #[arg(long)]
    pub experts_only: bool,
    /// MoE layers, canonical form such as 1-40,45,92 (implies --experts-only).
    #[arg(long, value_name = "SPEC")]
    pub layers: Option<String>,
    /// Parallel transfers, 1…16.
    #[arg(long, value_name = "N", default_value = "8", value_parser = parse_workers)]
    pub workers: usize,
    /// Use the files an earlier `hf download` (huggingface_hub) left in a Hugging Face
    /// cache: DIR is the hub cache (default `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`), one repository's `models--…` directory or its snapshot of
    /// the pinned revision. Each cached file is verified against the pins (and its blob's
    /// SHA-256 name), then hard-linked (copied across filesystems); the rest is fetched.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub from_hf_cache: Option<Option<PathBuf>>,
    /// Allow a plain http:// hub endpoint or redirect (a mirror you trust); downloads use
    /// https:// only otherwise [env: DELTAFIN_INSECURE_HTTP=1].
    #[arg(long)]
    pub insecure_http: bool,
    #[command(flatten)]
    pub root: RootArg,
}

fn manifests() -> Result<Manifests> {
    Manifests::from_env().context("loading the source manifests")
}

fn client(insecure_http: bool) -> Result<HubClient> {
    HubClient::from_env(insecure_http).context("hub endpoint")
}

/// The setup steps at `root` through `client` with `workers` parallel transfers.
fn setup_with<'a>(
    root: PathBuf,
    manifests: &'a Manifests,
    client: &'a HubClient,
    workers: usize,
) -> Setup<'a> {
    Setup {
        root,
        manifests,
        client,
        transfer: TransferOptions {
            workers,
            ..TransferOptions::default()
        },
        hf_cache: None,
    }
}

/// The Hugging Face cache of `--from-hf-cache [DIR]` (no DIR: the default cache), with a
/// line per pinned repository saying what it holds.
fn hf_cache(dir: Option<&Option<PathBuf>>, ms: &Manifests) -> Result<Option<Arc<HfCache>>> {
    let Some(dir) = dir else { return Ok(None) };
    let dir = match dir {
        Some(d) => d.clone(),
        None => default_hub_dir().context(
            "--from-hf-cache without DIR: none of HF_HUB_CACHE, HF_HOME and HOME is set; give the cache directory",
        )?,
    };
    let cache = HfCache::open(&dir, ms)?;
    let lines = cache.describe(ms);
    if lines.is_empty() {
        println!(
            "hf cache: {} holds no snapshot of a pinned revision; everything is fetched",
            cache.hub_dir().display()
        );
    }
    for l in lines {
        println!("{l}");
    }
    Ok(Some(Arc::new(cache)))
}

/// What a run took from the Hugging Face cache, and the cached files it could not verify.
fn cache_summary(cache: Option<&Arc<HfCache>>) {
    let Some(c) = cache else { return };
    let u = c.used();
    println!(
        "hf cache: {} files hard-linked, {} copied, {} in all (not downloaded)",
        u.linked,
        u.copied,
        size_text(u.bytes)
    );
    for f in c.unverifiable() {
        println!(
            "hf cache: {f}: neither pinned nor named by its SHA-256 in the cache, so fetched from the hub instead"
        );
    }
}

/// The whole install lock of `root` for the installer `what` (docs/SETUP.md, "The install
/// lock"): held until the returned value drops.
fn install_lock(root: &Path, what: &str) -> Result<deltafin_fetch::lock::InstallLock> {
    Ok(deltafin_fetch::lock::lock_install(
        root,
        what,
        deltafin_fetch::lock::INSTALLER_WAIT,
    )?)
}

fn log(s: &str) {
    println!("{s}");
}

fn report(what: &str, r: &CheckReport) -> ExitCode {
    for p in &r.problems {
        println!("{p}");
    }
    if let Some(n) = r.lazy_missing {
        println!("lazy-missing={n} experts (fetched on demand)");
    }
    if r.is_ok() {
        println!("{what}: ok ({} files verified)", r.ok);
        ExitCode::SUCCESS
    } else {
        println!("{what}: {} problem(s)", r.problems.len());
        ExitCode::from(1)
    }
}

/// `deltafin setup`.
pub fn setup(a: &SetupArgs) -> Result<ExitCode> {
    let root = a.root.resolve();
    let ms = manifests()?;
    let flag = match (a.full, a.stream) {
        (true, _) => Some(Mode::Full),
        (_, true) => Some(Mode::Stream),
        _ => None,
    };
    if a.check && a.from_hf_cache.is_some() {
        bail!(
            "setup: --from-hf-cache installs from the cache; --check only audits the model root (give one of them)"
        );
    }
    if a.check {
        let mode = flag.or_else(|| recorded_mode(&root)).unwrap_or(Mode::Full);
        println!("checking a {} install at {}", mode.as_str(), root.display());
        return Ok(report(
            "setup --check",
            &check_setup(&root, &ms, mode, a.include_qwen),
        ));
    }
    // The disk the whole plan needs (weights, drafters, the int8 spine converted last)
    // against the free space, before anything is written.
    let free = deltafin_fetch::disk::free_bytes(&root)?;
    let cache = hf_cache(a.from_hf_cache.as_ref(), &ms)?;
    let choice = choose_mode(&root, &ms, a.include_qwen, flag, free, cache.as_deref());
    let plan = plan_setup(&root, &ms, choice.mode, a.include_qwen);
    let linked = cache
        .as_ref()
        .map_or(0, |c| c.linkable_bytes(&root, &ms, &plan));
    let disk = DiskCheck::new(&root, &ms, &plan, a.include_qwen, free).with_linked(linked);
    if a.dry_run {
        print!("{}", fsetup::render_plan(&root, &plan, &choice, &disk));
        return Ok(if disk.fits() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    if !disk.fits() {
        bail!("setup: {}", disk.refusal(&root));
    }
    let _lock = install_lock(&root, "deltafin setup")?;
    println!("mode: {} ({})", choice.mode.as_str(), choice.reason);
    let c = client(a.insecure_http)?;
    let s = setup_with(root.clone(), &ms, &c, a.workers).with_hf_cache(cache.clone());
    s.run(choice.mode, a.include_qwen, &mut log)?;
    cache_summary(cache.as_ref());
    // The last step of a one-shot setup (docs/SETUP.md): the int8 spine that `run`
    // and `serve` use by default. Resumable: an interrupted setup rerun continues it.
    println!(
        "converting the row-int8 spine (the default --spine; about half the BF16 spine's size)"
    );
    crate::convert::convert_spine_int8(&crate::convert::ConvertSpineInt8Args {
        root: RootArg::at(root),
        checkpoint_rows: deltafin_k3::weights::spine_int8::DEFAULT_CHECKPOINT_ROWS,
        no_resume: false,
        check: false,
    })
    .context("setup: the weights are installed, but converting the int8 spine failed (rerun `deltafin setup` or `deltafin convert-spine-int8`; `--spine bf16` runs without it)")?;
    println!("setup complete ({} install)", choice.mode.as_str());
    Ok(ExitCode::SUCCESS)
}

/// `deltafin setup-k3`.
pub fn setup_k3(a: &SetupK3Args) -> Result<ExitCode> {
    let root = a.root.resolve();
    let ms = manifests()?;
    if a.check {
        let (r, _) = check_k3_meta(&root, &ms.k3);
        return Ok(report("setup-k3 --check", &r));
    }
    let c = client(a.insecure_http)?;
    let _lock = install_lock(&root, "deltafin setup-k3")?;
    let s = setup_with(root, &ms, &c, 8);
    s.k3_meta(&mut log)?;
    Ok(ExitCode::SUCCESS)
}

/// `deltafin setup-dspark`.
pub fn setup_dspark(a: &SetupDsparkArgs) -> Result<ExitCode> {
    let root = a.root.resolve();
    let ms = manifests()?;
    let dest = a
        .destination
        .clone()
        .unwrap_or_else(|| root.join(&ms.dspark.install_dir));
    if a.check {
        return Ok(report(
            "setup-dspark --check",
            &check_repo(&dest, &ms.dspark),
        ));
    }
    let c = client(a.insecure_http)?;
    if a.audit_only {
        fsetup::audit_repo(&c, &ms.dspark, &mut log)?;
        println!("setup-dspark --audit-only: ok");
        return Ok(ExitCode::SUCCESS);
    }
    let _lock = install_lock(&root, "deltafin setup-dspark")?;
    let s = setup_with(root, &ms, &c, 8);
    s.repo(&ms.dspark, &dest, &mut log)?;
    Ok(ExitCode::SUCCESS)
}

/// `deltafin setup-qwen`.
pub fn setup_qwen(a: &SetupQwenArgs) -> Result<ExitCode> {
    let root = a.root.resolve();
    let ms = manifests()?;
    if a.check {
        let mut r = check_repo(&root.join(&ms.qwen_large.install_dir), &ms.qwen_large);
        let r2 = check_repo(&root.join(&ms.qwen_small.install_dir), &ms.qwen_small);
        deltafin_fetch::check::merge(&mut r, r2);
        return Ok(report("setup-qwen --check", &r));
    }
    let c = client(a.insecure_http)?;
    let _lock = install_lock(&root, "deltafin setup-qwen")?;
    let s = setup_with(root, &ms, &c, 8);
    s.qwen(&mut log)?;
    Ok(ExitCode::SUCCESS)
}

/// `deltafin fetch-weights`.
pub fn fetch_weights(a: &FetchWeightsArgs) -> Result<ExitCode> {
    let root = a.root.resolve();
    let ms = manifests()?;
    let m = &ms.k3;
    let moe = m.moe_layers();
    let (lo, hi) = match (moe.first(), moe.last()) {
        (Some(&lo), Some(&hi)) => (lo, hi),
        _ => bail!("the K3 manifest has no MoE layers"),
    };
    let sel = if let Some(spec) = &a.layers {
        Selection::Experts(parse_layers(spec, lo, hi)?)
    } else if a.experts_only {
        Selection::Experts(moe.clone())
    } else if a.spine_only {
        Selection::Spine
    } else {
        Selection::Shards
    };
    let inv = Inventory::load(&root, &m.inventory).ok();
    if a.dry_run {
        println!("fetch-weights plan (dry run: no network, no writes)");
        match (&sel, &inv) {
            (Selection::Experts(layers), _) => {
                let n = (layers.len() * m.experts_per_layer) as u64;
                println!(
                    "experts of layers {}: {n} files of {} = {}",
                    format_layers(layers),
                    size_text(m.expert_bytes),
                    size_text(n.saturating_mul(m.expert_bytes))
                );
            }
            (_, Some(inv)) => {
                let jobs = weight_jobs(&root, m, inv, &sel)?;
                let missing: u64 = jobs
                    .iter()
                    .filter(|j| !deltafin_fetch::transfer::is_complete(&j.dest, j.size))
                    .map(|j| j.size)
                    .sum();
                println!(
                    "{} files, {} still to fetch",
                    jobs.len(),
                    size_text(missing)
                );
            }
            (_, None) => {
                let mode = if sel == Selection::Spine {
                    Mode::Stream
                } else {
                    Mode::Full
                };
                let items = weight_items(&root, m, None, mode);
                let total: u64 = items.iter().map(|i| i.bytes).sum();
                println!(
                    "{} shard items, ≈{} (exact after `setup-k3 --meta-only`)",
                    items.len(),
                    size_text(total)
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(inv) = inv else {
        bail!(
            "no valid tensor inventory at {}: run `deltafin setup-k3 --meta-only` first",
            root.join(deltafin_fetch::inventory::INVENTORY_PATH)
                .display()
        );
    };
    let c = client(a.insecure_http)?;
    let _lock = install_lock(&root, "deltafin fetch-weights")?;
    let cache = hf_cache(a.from_hf_cache.as_ref(), &ms)?;
    let s = setup_with(root.clone(), &ms, &c, a.workers).with_hf_cache(cache.clone());
    s.weights(&inv, &sel, &mut log)?;
    cache_summary(cache.as_ref());
    if sel == Selection::Shards {
        let r = check_k3(&root, m, Mode::Full);
        return Ok(report("fetch-weights", &r));
    }
    Ok(ExitCode::SUCCESS)
}
