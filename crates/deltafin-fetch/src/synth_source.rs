//! A synthesized source for tests and demos: a small K3 checkpoint in the release layout
//! (`deltafin_k3::synth`), a DSpark-like and two Qwen-like repositories, and manifests that
//! pin all of them exactly (sizes, sha256, header lengths, inventory digest). Serve it with
//! [`SynthSource::serve`] on a [`MockHub`].

use crate::error::FetchError;
use crate::inventory::{Inventory, ShardHeader};
use crate::manifest::{InventoryPin, Manifests, PinnedFile, RepoManifest, k3_manifest_from_index};
use crate::mock_hub::MockHub;
use crate::transfer::sha256_file;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Pinned commit of the synthesized K3 repository.
pub const K3_COMMIT: &str = "1111111111111111111111111111111111111111";
const DSPARK_COMMIT: &str = "2222222222222222222222222222222222222222";
const QWEN_COMMIT: &str = "3333333333333333333333333333333333333333";

/// Files on disk and the manifests that pin them.
pub struct SynthSource {
    /// Directory of the synthesized K3 checkpoint.
    pub k3_dir: PathBuf,
    pub manifests: Manifests,
    /// (repo, file, path on disk) of every served file.
    pub files: Vec<(String, String, PathBuf)>,
}

/// Small dims: 6 layers, 16 experts, vocabulary 1024 (about 1 MB in all).
pub fn small_dims() -> SynthDims {
    let mut d = SynthDims::tiny();
    d.layers = 6;
    d.vocab = 1024;
    d.attn_res_block = 4;
    d
}

fn pin(dir: &Path, path: &str) -> Result<PinnedFile, FetchError> {
    let p = dir.join(path);
    Ok(PinnedFile {
        path: path.to_string(),
        size: std::fs::metadata(&p).map_err(FetchError::io(&p))?.len(),
        sha256: Some(sha256_file(&p)?),
    })
}

fn read_header(path: &Path) -> Result<Vec<u8>, FetchError> {
    let mut f = std::fs::File::open(path).map_err(FetchError::io(path))?;
    let mut le = [0u8; 8];
    f.read_exact(&mut le).map_err(FetchError::io(path))?;
    let mut json = vec![0u8; u64::from_le_bytes(le) as usize];
    f.read_exact(&mut json).map_err(FetchError::io(path))?;
    Ok(json)
}

impl SynthSource {
    /// Synthesize into `dir` with `dims` and `seed`.
    pub fn create(dir: &Path, dims: SynthDims, seed: u64) -> Result<SynthSource, FetchError> {
        let k3_dir = dir.join("k3");
        let report = synthesize(&k3_dir, &SynthSpec::new(dims, seed))
            .map_err(|e| FetchError::Invalid(format!("synthesis failed: {e}")))?;
        let idx_path = k3_dir.join("model.safetensors.index.json");
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&idx_path).map_err(FetchError::io(&idx_path))?,
        )
        .map_err(|e| FetchError::Invalid(e.to_string()))?;
        let meta_names = [
            "config.json",
            "generation_config.json",
            "tokenizer_config.json",
            "tiktoken.model",
            "model.safetensors.index.json",
        ];
        let metadata = meta_names
            .iter()
            .map(|n| pin(&k3_dir, n))
            .collect::<Result<Vec<_>, _>>()?;
        let pin_until_headers_are_read = InventoryPin {
            size: 0,
            sha256: "0".repeat(64),
            records: 0,
        };
        let repo = "synth/Kimi-K3";
        let mut k3 = k3_manifest_from_index(
            &report.config,
            &index,
            repo,
            K3_COMMIT,
            metadata,
            pin_until_headers_are_read,
        )?;
        let mut headers = Vec::new();
        for s in k3.shards.iter_mut() {
            let p = k3_dir.join(&s.file);
            let json = read_header(&p)?;
            s.header_len = Some(json.len() as u64);
            s.sha256 = Some(sha256_file(&p)?);
            headers.push(ShardHeader {
                file: s.file.clone(),
                json,
            });
        }
        k3.inventory = Inventory::from_headers(&k3, &headers)?.pin();
        let mut files: Vec<(String, String, PathBuf)> = Vec::new();
        for f in &k3.metadata {
            files.push((repo.into(), f.path.clone(), k3_dir.join(&f.path)));
        }
        for s in &k3.shards {
            files.push((repo.into(), s.file.clone(), k3_dir.join(&s.file)));
        }
        // Draft repositories: real config files plus a small valid safetensors file.
        let assets = deltafin_k3::synth::default_assets_dir();
        let drafts = dir.join("drafts");
        std::fs::create_dir_all(&drafts).map_err(FetchError::io(&drafts))?;
        let st = drafts.join("model.safetensors");
        std::fs::copy(k3_dir.join(&k3.shards[0].file), &st).map_err(FetchError::io(&st))?;
        let mut repo_manifest = |repo: &str, commit: &str, dir_name: &str, cfg: &str| {
            let c = drafts.join(format!("{dir_name}-config.json"));
            std::fs::copy(assets.join(cfg), &c).map_err(FetchError::io(&c))?;
            let mut m = RepoManifest {
                repo: repo.into(),
                revision: commit.into(),
                install_dir: dir_name.into(),
                files: vec![],
                safetensors_header_len: Some(read_header(&st)?.len() as u64),
                safetensors_tensors: None,
            };
            for (name, path) in [("config.json", c), ("model.safetensors", st.clone())] {
                let mut p = pin(
                    path.parent().unwrap_or(Path::new(".")),
                    &path.file_name().unwrap_or_default().to_string_lossy(),
                )?;
                p.path = name.into();
                files.push((repo.into(), name.into(), path));
                m.files.push(p);
            }
            Ok::<_, FetchError>(m)
        };
        let dspark = repo_manifest(
            "synth/K3-DSpark",
            DSPARK_COMMIT,
            "k3-draft-dspark",
            "dspark-config.json",
        )?;
        let qwen_small = repo_manifest(
            "synth/Qwen3-0.6B-Base",
            QWEN_COMMIT,
            "k3-draft-qwen3-0.6b-base",
            "qwen3-0.6b-base-config.json",
        )?;
        let qwen_large = repo_manifest(
            "synth/Qwen3-1.7B-Base",
            QWEN_COMMIT,
            "k3-draft-qwen3-1.7b-base",
            "qwen3-1.7b-base-config.json",
        )?;
        Ok(SynthSource {
            k3_dir,
            manifests: Manifests {
                k3,
                dspark,
                qwen_small,
                qwen_large,
            },
            files,
        })
    }

    /// The pinned commit of `repo`.
    fn commit_of(&self, repo: &str) -> &'static str {
        if repo == self.manifests.k3.repo {
            K3_COMMIT
        } else if repo == self.manifests.dspark.repo {
            DSPARK_COMMIT
        } else {
            QWEN_COMMIT
        }
    }

    /// Lay the files of `repos` (all served repositories when empty) out under `hub` as
    /// `huggingface_hub` does: `models--owner--name/blobs/<sha256>` holding the bytes,
    /// `snapshots/<pinned commit>/<file>` a relative symlink to its blob and `refs/main`
    /// naming the commit. Returns the snapshot directory of each repository written.
    pub fn hf_cache(&self, hub: &Path, repos: &[&str]) -> Result<Vec<PathBuf>, FetchError> {
        let mut snaps: Vec<PathBuf> = Vec::new();
        for (repo, file, path) in &self.files {
            if !repos.is_empty() && !repos.contains(&repo.as_str()) {
                continue;
            }
            let commit = self.commit_of(repo);
            let repo_dir = hub.join(crate::hf_cache::repo_dir_name(repo));
            let blobs = repo_dir.join("blobs");
            let snap = repo_dir.join("snapshots").join(commit);
            let refs = repo_dir.join("refs");
            for d in [&blobs, &snap, &refs] {
                std::fs::create_dir_all(d).map_err(FetchError::io(d))?;
            }
            crate::inventory::write_atomic(&refs.join("main"), commit.as_bytes())?;
            let sha = sha256_file(path)?;
            let blob = blobs.join(&sha);
            if !blob.exists() {
                std::fs::copy(path, &blob).map_err(FetchError::io(&blob))?;
            }
            let link = snap.join(file);
            let depth = Path::new(file).components().count();
            let mut target = PathBuf::new();
            for _ in 0..depth + 1 {
                target.push("..");
            }
            target.push("blobs");
            target.push(&sha);
            if let Some(d) = link.parent() {
                std::fs::create_dir_all(d).map_err(FetchError::io(d))?;
            }
            std::os::unix::fs::symlink(&target, &link).map_err(FetchError::io(&link))?;
            if !snaps.contains(&snap) {
                snaps.push(snap);
            }
        }
        Ok(snaps)
    }

    /// Register every file on `hub`.
    pub fn serve(&self, hub: &MockHub) -> Result<(), FetchError> {
        for (repo, file, path) in &self.files {
            hub.add_file(repo, self.commit_of(repo), file, path)
                .map_err(FetchError::io(path))?;
        }
        Ok(())
    }
}
