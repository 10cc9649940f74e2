//! The setup steps (product contract §5): K3 metadata and inventory → DSpark → optional Qwen
//! → weight plan and transfer; the disk the whole plan needs (the row-int8 spine conversion
//! the CLI runs last included) is checked against the free space before anything is written.
//!
//! Messages go through a `log` callback so the CLI decides where they are printed.

use crate::check::{self, CheckReport};
use crate::disk::free_bytes;
use crate::error::FetchError;
use crate::hub::HubClient;
use crate::inventory::{Inventory, write_atomic};
use crate::manifest::{Manifests, PinnedFile, RepoManifest};
use crate::plan::{FULL_HEADROOM, Mode, Plan, Selection, plan_setup, size_text, weight_jobs};
use crate::transfer::{Job, TransferOptions, TransferReport, run_jobs};
use std::path::{Path, PathBuf};

/// Where the chosen install mode is recorded (`full` or `stream`).
pub const MODE_FILE: &str = "k3-meta/install-mode";

/// Inputs shared by the steps. A caller that writes with these steps holds the root's install
/// lock for as long ([`crate::lock::lock_install`]), as the CLI's `setup*` and
/// `fetch-weights` do; the steps do not take it themselves, so that one holder can run several.
pub struct Setup<'a> {
    pub root: PathBuf,
    pub manifests: &'a Manifests,
    pub client: &'a HubClient,
    pub transfer: TransferOptions,
    /// The Hugging Face cache to install from (`setup --from-hf-cache`): set with
    /// [`Setup::with_hf_cache`], which also hands it to the transfers.
    pub hf_cache: Option<std::sync::Arc<crate::hf_cache::HfCache>>,
}

/// How the mode was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModeChoice {
    pub mode: Mode,
    /// Human-readable reason (flag, or free space versus need).
    pub reason: String,
}

/// Pick full or stream: a flag wins; otherwise full when the full plan's peak additional
/// disk use plus [`FULL_HEADROOM`] fits in the `free` bytes at the model root. `cache`: a
/// Hugging Face cache whose hard-linked files take no new disk.
pub fn choose_mode(
    root: &Path,
    ms: &Manifests,
    include_qwen: bool,
    flag: Option<Mode>,
    free: u64,
    cache: Option<&crate::hf_cache::HfCache>,
) -> ModeChoice {
    if let Some(m) = flag {
        return ModeChoice {
            mode: m,
            reason: format!("--{} given", m.as_str()),
        };
    }
    let plan = plan_setup(root, ms, Mode::Full, include_qwen);
    let linked = cache.map_or(0, |c| c.linkable_bytes(root, ms, &plan));
    let need = plan.peak_additional_bytes().saturating_sub(linked);
    let want = need.saturating_add(FULL_HEADROOM);
    let (free_t, need_t, room_t) = (size_text(free), size_text(need), size_text(FULL_HEADROOM));
    let linked_t = if linked > 0 {
        format!(
            " ({} hard-linked from the Hugging Face cache not counted)",
            size_text(linked)
        )
    } else {
        String::new()
    };
    if want <= free {
        ModeChoice {
            mode: Mode::Full,
            reason: format!("free {free_t} ≥ full need {need_t}{linked_t} + {room_t} headroom"),
        }
    } else {
        ModeChoice {
            mode: Mode::Stream,
            reason: format!(
                "free {free_t} < full need {need_t}{linked_t} + {room_t} headroom (full-mode shortfall {})",
                size_text(want - free)
            ),
        }
    }
}

/// A setup plan's peak additional disk use against the free space at the model root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCheck {
    pub mode: Mode,
    /// Bytes still to download.
    pub download: u64,
    /// Bytes the row-int8 spine conversion still writes.
    pub convert: u64,
    /// Free bytes at the model root (or its nearest existing ancestor).
    pub free: u64,
    /// Whether `download` and `convert` are exact (else estimated, `≈`).
    pub download_exact: bool,
    pub convert_exact: bool,
    /// For a full plan: the peak additional disk use of a stream install instead.
    pub stream_need: Option<u64>,
    /// Bytes of `download` that a Hugging Face cache on the same filesystem hard-links
    /// (`setup --from-hf-cache`): no new disk.
    pub linked: u64,
}

impl DiskCheck {
    /// The disk `plan` needs at `root` with `free` bytes free.
    pub fn new(root: &Path, ms: &Manifests, plan: &Plan, include_qwen: bool, free: u64) -> Self {
        DiskCheck {
            mode: plan.mode,
            download: plan.download_bytes(),
            convert: plan.convert_bytes(),
            free,
            download_exact: plan.download_exact(),
            convert_exact: plan.convert_exact(),
            stream_need: (plan.mode == Mode::Full)
                .then(|| plan_setup(root, ms, Mode::Stream, include_qwen).peak_additional_bytes()),
            linked: 0,
        }
    }

    /// The same check with `linked` bytes of the download hard-linked from a cache.
    pub fn with_linked(mut self, linked: u64) -> Self {
        self.linked = linked.min(self.download);
        self
    }

    /// The peak additional disk use.
    pub fn need(&self) -> u64 {
        (self.download - self.linked).saturating_add(self.convert)
    }

    /// Whether the plan fits the free space.
    pub fn fits(&self) -> bool {
        self.need() <= self.free
    }

    /// Why a setup that does not fit is refused, with both numbers and what would fit.
    pub fn refusal(&self, root: &Path) -> String {
        let approx = |exact: bool| if exact { "" } else { "≈" };
        let hint = match self.stream_need {
            Some(s) if s <= self.free => format!(
                "`deltafin setup --stream` needs {}: the spine only, routed experts fetched on demand",
                size_text(s)
            ),
            Some(s) => format!(
                "even `--stream` needs {}: free space or choose another --model-root",
                size_text(s)
            ),
            None => "free space or choose another --model-root".into(),
        };
        format!(
            "not enough disk at {}: a {} setup needs {}{} more ({}{} to download{} + {}{} for the row-int8 spine), only {} are free; {hint}",
            root.display(),
            self.mode.as_str(),
            approx(self.download_exact && self.convert_exact),
            size_text(self.need()),
            approx(self.download_exact),
            size_text(self.download),
            if self.linked > 0 {
                format!(
                    ", of which {} hard-linked from the Hugging Face cache",
                    size_text(self.linked)
                )
            } else {
                String::new()
            },
            approx(self.convert_exact),
            size_text(self.convert),
            size_text(self.free),
        )
    }
}

/// The recorded install mode, if any.
pub fn recorded_mode(root: &Path) -> Option<Mode> {
    match std::fs::read_to_string(root.join(MODE_FILE)).ok()?.trim() {
        "full" => Some(Mode::Full),
        "stream" => Some(Mode::Stream),
        _ => None,
    }
}

/// Record the install mode.
pub fn record_mode(root: &Path, mode: Mode) -> Result<(), FetchError> {
    write_atomic(
        &root.join(MODE_FILE),
        format!("{}\n", mode.as_str()).as_bytes(),
    )
}

/// `, N from the Hugging Face cache` when a run installed files from it.
fn from_cache(r: &TransferReport) -> String {
    if r.from_cache > 0 {
        format!(", {} from the Hugging Face cache", r.from_cache)
    } else {
        String::new()
    }
}

/// One whole-file job per pinned file of `repo@revision`, each installed under `dir`.
fn pinned_jobs(repo: &str, revision: &str, files: &[PinnedFile], dir: &Path) -> Vec<Job> {
    files
        .iter()
        .map(|f| Job {
            repo: repo.to_owned(),
            revision: revision.to_owned(),
            file: f.path.clone(),
            range: None,
            dest: dir.join(&f.path),
            size: f.size,
            sha256: f.sha256.clone(),
        })
        .collect()
}

impl Setup<'_> {
    /// Install from `cache` where it holds the pinned files (crate::hf_cache).
    pub fn with_hf_cache(
        mut self,
        cache: Option<std::sync::Arc<crate::hf_cache::HfCache>>,
    ) -> Self {
        self.transfer.local = cache
            .clone()
            .map(|c| c as std::sync::Arc<dyn crate::transfer::LocalSource>);
        self.hf_cache = cache;
        self
    }

    /// `setup-k3 --meta-only`: the pinned metadata files at the model root, then the
    /// inventory from the shard headers (skipped when the local one matches its pin).
    pub fn k3_meta(&self, log: &mut dyn FnMut(&str)) -> Result<Inventory, FetchError> {
        let m = &self.manifests.k3;
        let jobs = pinned_jobs(&m.repo, &m.revision, &m.metadata, &self.root);
        let r = run_jobs(self.client, &jobs, &self.transfer)?;
        log(&format!(
            "k3 metadata: {} files ({} fetched, {} already complete{}) from {}@{}",
            jobs.len(),
            r.fetched,
            r.skipped,
            from_cache(&r),
            m.repo,
            m.revision
        ));
        if let Ok(inv) = Inventory::load(&self.root, &m.inventory) {
            log("k3 inventory: present and matches its pin");
            return Ok(inv);
        }
        let (inv, whence) = match &self.hf_cache {
            Some(cache) => {
                // Headers of the shards in the cache are read there; the others are fetched.
                let mut headers = Vec::with_capacity(m.shards.len());
                let mut local = 0usize;
                for s in &m.shards {
                    headers.push(match cache.shard_header(self.manifests, &s.file) {
                        Some(h) => {
                            local += 1;
                            h?
                        }
                        None => crate::inventory::fetch_header(
                            self.client,
                            &m.repo,
                            &m.revision,
                            &s.file,
                        )?,
                    });
                }
                let snap = cache.snapshot_dir(&m.repo, &m.revision);
                let inv = Inventory::from_headers(m, &headers)
                    .and_then(|inv| inv.store(&self.root, &m.inventory).map(|_| inv))
                    .map_err(|e| {
                        FetchError::Cache(format!(
                            "the shard headers ({local} of {} from the Hugging Face cache {}) do not give the pinned inventory: {e}",
                            m.shards.len(),
                            snap.display()
                        ))
                    })?;
                (
                    inv,
                    format!("{local} cached and {} fetched", m.shards.len() - local),
                )
            }
            None => {
                let inv = Inventory::fetch(self.client, m, self.transfer.workers)?;
                inv.store(&self.root, &m.inventory)?;
                (inv, format!("{} fetched", m.shards.len()))
            }
        };
        let p = self.root.join(crate::inventory::INVENTORY_PATH);
        log(&format!(
            "k3 inventory: {} records from the shard headers ({whence}), sha256 {} (pinned) → {}",
            inv.records().len(),
            m.inventory.sha256,
            p.display()
        ));
        Ok(inv)
    }

    /// Install a file-by-file repository into `dir`.
    pub fn repo(
        &self,
        m: &RepoManifest,
        dir: &Path,
        log: &mut dyn FnMut(&str),
    ) -> Result<TransferReport, FetchError> {
        let jobs = pinned_jobs(&m.repo, &m.revision, &m.files, dir);
        let r = run_jobs(self.client, &jobs, &self.transfer)?;
        log(&format!(
            "{}@{}: {} files ({} fetched, {} already complete{}) in {}",
            m.repo,
            m.revision,
            jobs.len(),
            r.fetched,
            r.skipped,
            from_cache(&r),
            dir.display()
        ));
        Ok(r)
    }

    /// `setup-qwen`: 1.7B, then 0.6B.
    pub fn qwen(&self, log: &mut dyn FnMut(&str)) -> Result<(), FetchError> {
        for m in [&self.manifests.qwen_large, &self.manifests.qwen_small] {
            self.repo(m, &self.root.join(&m.install_dir), log)?;
        }
        log("qwen: installed; DSpark remains the default chat/server drafter");
        Ok(())
    }

    /// The weight phase for `sel` (needs the inventory).
    pub fn weights(
        &self,
        inv: &Inventory,
        sel: &Selection,
        log: &mut dyn FnMut(&str),
    ) -> Result<TransferReport, FetchError> {
        let jobs = weight_jobs(&self.root, &self.manifests.k3, inv, sel)?;
        let total: u64 = jobs.iter().map(|j| j.size).sum();
        log(&format!(
            "weights ({}): {} files, {}",
            match sel {
                Selection::Shards => "full: release shards".to_string(),
                Selection::Spine => "stream: spine tensors".to_string(),
                Selection::Experts(l) =>
                    format!("experts of layers {}", crate::layers::format_layers(l)),
            },
            jobs.len(),
            size_text(total)
        ));
        // Weight files have no pinned digest (the release pins none): each gets a receipt.
        let opts = TransferOptions {
            receipts: Some(self.root.clone()),
            ..self.transfer.clone()
        };
        let r = run_jobs(self.client, &jobs, &opts)?;
        log(&format!(
            "weights: {} fetched ({} received), {} already complete{}",
            r.fetched,
            size_text(r.bytes),
            r.skipped,
            from_cache(&r)
        ));
        Ok(r)
    }

    /// One-shot `setup` in `mode`.
    pub fn run(
        &self,
        mode: Mode,
        include_qwen: bool,
        log: &mut dyn FnMut(&str),
    ) -> Result<(), FetchError> {
        let inv = self.k3_meta(log)?;
        let d = &self.manifests.dspark;
        self.repo(d, &self.root.join(&d.install_dir), log)?;
        if include_qwen {
            self.qwen(log)?;
        }
        // Capacity recheck just before the weight phase (sizes are now exact). The plan
        // includes the int8 spine that `deltafin setup` converts after the weights.
        let plan = plan_setup(&self.root, self.manifests, mode, include_qwen);
        let free = free_bytes(&self.root)?;
        let linked = self
            .hf_cache
            .as_ref()
            .map_or(0, |c| c.linkable_bytes(&self.root, self.manifests, &plan));
        let disk = DiskCheck::new(&self.root, self.manifests, &plan, include_qwen, free)
            .with_linked(linked);
        if !disk.fits() {
            return Err(FetchError::Disk(disk.refusal(&self.root)));
        }
        record_mode(&self.root, mode)?;
        let sel = match mode {
            Mode::Full => Selection::Shards,
            Mode::Stream => Selection::Spine,
        };
        self.weights(&inv, &sel, log)?;
        log(&format!("weights installed ({} install)", mode.as_str()));
        Ok(())
    }
}

/// Render a plan for `--dry-run`, with its disk check (sizes in decimal units, `≈` where
/// estimated).
pub fn render_plan(root: &Path, plan: &Plan, choice: &ModeChoice, disk: &DiskCheck) -> String {
    let approx = |exact: bool| if exact { "" } else { "≈" };
    let mut s = String::new();
    s.push_str("setup plan (dry run: no network, no writes)\n");
    s.push_str(&format!("model root: {}\n", root.display()));
    s.push_str(&format!(
        "mode: {} ({})\n",
        plan.mode.as_str(),
        choice.reason
    ));
    for it in &plan.items {
        s.push_str(&format!(
            "{:<9} {:<60} {}{}{}{}\n",
            it.step,
            it.dest,
            approx(it.exact),
            size_text(it.bytes),
            it.data_bytes
                .map(|d| format!(" data={}", size_text(d)))
                .unwrap_or_default(),
            if it.present { " (present)" } else { "" }
        ));
    }
    let (weights_exact, int8_exact) = (disk.download_exact, disk.convert_exact);
    s.push_str(&format!(
        "weight tensor data: {}\n",
        size_text(plan.weight_data_bytes())
    ));
    s.push_str(&format!(
        "download: {}{}\n",
        approx(weights_exact),
        size_text(plan.download_bytes())
    ));
    s.push_str(&format!(
        "row-int8 spine: {}{} written after the weights by `convert-spine-int8` (no network; the default --spine)\n",
        approx(int8_exact),
        size_text(plan.convert_bytes())
    ));
    if disk.linked > 0 {
        s.push_str(&format!(
            "hard-linked from the Hugging Face cache: {} of the download (no new disk)\n",
            size_text(disk.linked)
        ));
    }
    s.push_str(&format!(
        "peak additional disk: {}{}\nfree disk: {}\n",
        approx(plan.exact()),
        size_text(disk.need()),
        size_text(disk.free)
    ));
    if disk.fits() {
        s.push_str("disk: the plan fits\n");
    } else {
        s.push_str(&format!(
            "disk: setup would refuse: {}\n",
            disk.refusal(root)
        ));
    }
    if !weights_exact {
        s.push_str(
            "note: ≈ shard sizes add an estimated safetensors header per shard (header lengths are not pinned; exact after `setup-k3 --meta-only`)\n",
        );
    }
    if !int8_exact {
        s.push_str(
            "note: ≈ the row-int8 spine is estimated as half the BF16 spine (exact once config.json is installed)\n",
        );
    }
    if plan.mode == Mode::Stream {
        s.push_str("experts: fetched on demand by byte range into k3-experts/\n");
    }
    s
}

/// `setup --check`: metadata, inventory, DSpark, optional Qwen and the weights of `mode`.
pub fn check_setup(root: &Path, ms: &Manifests, mode: Mode, include_qwen: bool) -> CheckReport {
    let mut r = check::check_k3(root, &ms.k3, mode);
    let d = &ms.dspark;
    check::merge(&mut r, check::check_repo(&root.join(&d.install_dir), d));
    if include_qwen {
        for q in [&ms.qwen_large, &ms.qwen_small] {
            check::merge(&mut r, check::check_repo(&root.join(&q.install_dir), q));
        }
    }
    r
}

/// `setup-dspark --audit-only`: remote metadata only — every file's size (and etag when it
/// is a sha256) at the pinned commit, and the `model.safetensors` header (length, tensor
/// count). No payload is downloaded; nothing is written.
pub fn audit_repo(
    client: &HubClient,
    m: &RepoManifest,
    log: &mut dyn FnMut(&str),
) -> Result<(), FetchError> {
    for f in &m.files {
        let r = client.get(&m.repo, &m.revision, &f.path, Some((0, 0)))?;
        let size = r.file_size.ok_or_else(|| FetchError::Protocol {
            url: r.url.clone(),
            msg: "no X-Linked-Size or Content-Range total".into(),
        })?;
        if size != f.size {
            return Err(FetchError::Protocol {
                url: r.url,
                msg: format!("remote size {size}, pinned {}", f.size),
            });
        }
        let etag = r.etag.as_deref().map(|e| e.trim_matches('"').to_string());
        if let (Some(e), Some(want)) = (&etag, &f.sha256)
            && e.len() == 64
            && e != want
        {
            return Err(FetchError::Protocol {
                url: r.url,
                msg: format!("remote etag {e} differs from the pinned sha256 {want}"),
            });
        }
        log(&format!("{}: {size} B at {} ok", f.path, m.revision));
    }
    if m.files.iter().any(|f| f.path == "model.safetensors") {
        let h = crate::inventory::fetch_header(client, &m.repo, &m.revision, "model.safetensors")?;
        let v: serde_json::Value =
            serde_json::from_slice(&h.json).map_err(|e| FetchError::Protocol {
                url: client.resolve_url(&m.repo, &m.revision, "model.safetensors"),
                msg: format!("header: {e}"),
            })?;
        let n = v
            .as_object()
            .map(|o| o.keys().filter(|k| *k != "__metadata__").count() as u64)
            .unwrap_or(0);
        if let Some(want) = m.safetensors_header_len
            && want != h.json.len() as u64
        {
            return Err(FetchError::Invalid(format!(
                "model.safetensors header is {} B, pinned {want}",
                h.json.len()
            )));
        }
        if let Some(want) = m.safetensors_tensors
            && want != n
        {
            return Err(FetchError::Invalid(format!(
                "model.safetensors has {n} tensors, pinned {want}"
            )));
        }
        log(&format!(
            "model.safetensors: header {} B, {n} tensors ok",
            h.json.len()
        ));
    }
    Ok(())
}
