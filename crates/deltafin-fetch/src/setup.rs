//! The setup steps (product contract §5): K3 metadata and inventory → DSpark → optional Qwen
//! → weight plan and transfer → int8 spine conversion (not available yet: reported).
//!
//! Messages go through a `log` callback so the CLI decides where they are printed.

use crate::check::{self, CheckReport};
use crate::disk::free_bytes;
use crate::error::FetchError;
use crate::hub::HubClient;
use crate::inventory::{Inventory, write_atomic};
use crate::manifest::{Manifests, PinnedFile, RepoManifest};
use crate::plan::{FULL_HEADROOM, Mode, Plan, Selection, plan_setup, weight_jobs};
use crate::transfer::{Job, TransferOptions, TransferReport, run_jobs};
use std::path::{Path, PathBuf};

/// Where the chosen install mode is recorded (`full` or `stream`).
pub const MODE_FILE: &str = "k3-meta/install-mode";

/// Inputs shared by the steps.
pub struct Setup<'a> {
    pub root: PathBuf,
    pub manifests: &'a Manifests,
    pub client: &'a HubClient,
    pub transfer: TransferOptions,
}

/// How the mode was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModeChoice {
    pub mode: Mode,
    /// Human-readable reason (flag, or free space versus need).
    pub reason: String,
}

/// Pick full or stream: a flag wins; otherwise full when the full plan's peak additional
/// disk use plus [`FULL_HEADROOM`] fits in the free space.
pub fn choose_mode(
    root: &Path,
    ms: &Manifests,
    include_qwen: bool,
    flag: Option<Mode>,
) -> Result<ModeChoice, FetchError> {
    if let Some(m) = flag {
        return Ok(ModeChoice {
            mode: m,
            reason: format!("--{} given", m.as_str()),
        });
    }
    let need = plan_setup(root, ms, Mode::Full, include_qwen).peak_additional_bytes();
    let free = free_bytes(root)?;
    Ok(if need.saturating_add(FULL_HEADROOM) <= free {
        ModeChoice {
            mode: Mode::Full,
            reason: format!("free {free} B ≥ full need {need} B + {FULL_HEADROOM} B headroom"),
        }
    } else {
        ModeChoice {
            mode: Mode::Stream,
            reason: format!(
                "free {free} B < full need {need} B + {FULL_HEADROOM} B headroom (full-mode shortfall {} B)",
                need.saturating_add(FULL_HEADROOM) - free
            ),
        }
    })
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
    /// `setup-k3 --meta-only`: the pinned metadata files at the model root, then the
    /// inventory from the shard headers (skipped when the local one matches its pin).
    pub fn k3_meta(&self, log: &mut dyn FnMut(&str)) -> Result<Inventory, FetchError> {
        let m = &self.manifests.k3;
        let jobs = pinned_jobs(&m.repo, &m.revision, &m.metadata, &self.root);
        let r = run_jobs(self.client, &jobs, &self.transfer)?;
        log(&format!(
            "k3 metadata: {} files ({} fetched, {} already complete) from {}@{}",
            jobs.len(),
            r.fetched,
            r.skipped,
            m.repo,
            m.revision
        ));
        if let Ok(inv) = Inventory::load(&self.root, &m.inventory) {
            log("k3 inventory: present and matches its pin");
            return Ok(inv);
        }
        let inv = Inventory::fetch(self.client, m, self.transfer.workers)?;
        let p = inv.store(&self.root, &m.inventory)?;
        log(&format!(
            "k3 inventory: {} records from {} shard headers, sha256 {} (pinned) → {}",
            inv.records().len(),
            m.shards.len(),
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
            "{}@{}: {} files ({} fetched, {} already complete) in {}",
            m.repo,
            m.revision,
            jobs.len(),
            r.fetched,
            r.skipped,
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
            "weights ({}): {} files, {total} B",
            match sel {
                Selection::Shards => "full: release shards".to_string(),
                Selection::Spine => "stream: spine tensors".to_string(),
                Selection::Experts(l) =>
                    format!("experts of layers {}", crate::layers::format_layers(l)),
            },
            jobs.len()
        ));
        let r = run_jobs(self.client, &jobs, &self.transfer)?;
        log(&format!(
            "weights: {} fetched ({} B received), {} already complete",
            r.fetched, r.bytes, r.skipped
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
        // Capacity recheck just before the weight phase (sizes are now exact).
        let plan = plan_setup(&self.root, self.manifests, mode, include_qwen);
        let need = plan.peak_additional_bytes();
        let free = free_bytes(&self.root)?;
        if need > free {
            return Err(FetchError::Invalid(format!(
                "{} mode needs {need} B more disk, only {free} B are free at {}",
                mode.as_str(),
                self.root.display()
            )));
        }
        record_mode(&self.root, mode)?;
        let sel = match mode {
            Mode::Full => Selection::Shards,
            Mode::Stream => Selection::Spine,
        };
        self.weights(&inv, &sel, log)?;
        // The int8 spine is converted by the caller (`deltafin setup` runs the conversion
        // next, docs/SETUP.md).
        log(&format!(
            "weights installed ({} install); the BF16 spine is in place",
            mode.as_str()
        ));
        Ok(())
    }
}

/// Render a plan for `--dry-run`.
pub fn render_plan(root: &Path, plan: &Plan, choice: &ModeChoice, free: Option<u64>) -> String {
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
            "{:<9} {:<60} {}{} B{}{}\n",
            it.step,
            it.dest,
            if it.exact { "" } else { "≈" },
            it.bytes,
            it.data_bytes
                .map(|d| format!(" data={d}"))
                .unwrap_or_default(),
            if it.present { " (present)" } else { "" }
        ));
    }
    s.push_str(&format!(
        "weight tensor data: {} B\n",
        plan.weight_data_bytes()
    ));
    s.push_str(&format!(
        "download: {}{} B\npeak additional disk: {}{} B\n",
        if plan.exact() { "" } else { "≈" },
        plan.download_bytes(),
        if plan.exact() { "" } else { "≈" },
        plan.peak_additional_bytes()
    ));
    if !plan.exact() {
        s.push_str(
            "note: ≈ sizes add an estimated safetensors header per shard (header lengths are not pinned; exact after `setup-k3 --meta-only`)\n",
        );
    }
    if let Some(f) = free {
        s.push_str(&format!("free disk: {f} B\n"));
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
