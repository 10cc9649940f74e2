//! What a model root holds as an install, seen from storage: whether it has a config and a
//! [`Layout`], its checkpoint opened with the root named in the error, and whether this
//! process may write under it. `deltafin_k3::weights::install` adds the tokenizer and the
//! vocabulary check.

use crate::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, Layout};
use std::path::{Path, PathBuf};

/// What a model root lacks to be an install.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// No `config.json`.
    Config,
    /// A config but neither the shard index nor a stream install's spine directory.
    Layout,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missing::Config => write!(f, "{CONFIG_FILE} is missing"),
            Missing::Layout => f.write_str(
                "it has neither model.safetensors.index.json (shards) nor k3-resident/tensors/ (stream install)",
            ),
        }
    }
}

/// What `root` lacks to be an install (`None`: it has a config and a [`Layout`]).
pub fn missing(root: &Path) -> Option<Missing> {
    if !root.join(CONFIG_FILE).is_file() {
        Some(Missing::Config)
    } else if Layout::detect(root).is_none() {
        Some(Missing::Layout)
    } else {
        None
    }
}

/// The checkpoint of an install could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("the K3 checkpoint at {} is not usable", root.display())]
pub struct OpenError {
    /// The model root.
    pub root: PathBuf,
    /// What is wrong with its config, index, shards or stream-install files.
    #[source]
    pub source: CheckpointError,
}

/// Open the checkpoint of the install at `root`.
pub fn open_checkpoint(root: &Path) -> Result<Checkpoint, OpenError> {
    Checkpoint::open(root).map_err(|source| OpenError {
        root: root.to_path_buf(),
        source,
    })
}

/// `Ok` when this process may create files in the directory `dir` (`access(2)` with
/// `W_OK`): a read-only file system (`EROFS`) or missing permission is the error. What
/// deltafin keeps under `k3-meta/` (prefix states, expert heat, traces) needs it.
pub fn writable(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: access(2) reads the NUL-terminated path and nothing else.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_names_what_a_root_lacks() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(missing(dir.path()), Some(Missing::Config));
        std::fs::write(dir.path().join(CONFIG_FILE), "{}").unwrap();
        assert_eq!(missing(dir.path()), Some(Missing::Layout));
        std::fs::write(dir.path().join(crate::checkpoint::INDEX_FILE), "{}").unwrap();
        assert_eq!(missing(dir.path()), None);
        assert_eq!(Missing::Config.to_string(), "config.json is missing");
    }

    #[test]
    fn open_names_the_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), "not json").unwrap();
        let err = open_checkpoint(dir.path()).err().unwrap();
        assert!(err.to_string().contains("is not usable"), "{err}");
    }
}
