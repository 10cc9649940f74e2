//! Opening an install for inference: whether a model root holds one, its checkpoint and
//! tokenizer, and the tokenizer/`config.json` vocabulary match. The part of loading shared by
//! the `deltafin` commands and the `deltafin-openai` server; each adds its own experts,
//! options and wording around it.

use crate::model::K3Model;
use crate::text::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, Layout};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// Why an install could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The checkpoint (config, index, shards or stream-install files) is invalid.
    #[error("the K3 checkpoint at {} is not usable", root.display())]
    Checkpoint {
        /// The model root.
        root: PathBuf,
        /// What is wrong with it.
        #[source]
        source: CheckpointError,
    },
    /// The tokenizer files are missing or invalid.
    #[error("cannot load the tokenizer from {}", root.display())]
    Tokenizer {
        /// The model root.
        root: PathBuf,
        /// What is wrong with them.
        #[source]
        source: TokenizerError,
    },
    /// The tokenizer and `config.json` disagree on the vocabulary size.
    #[error("tokenizer vocabulary ({tokenizer}) does not match config.json vocab_size ({config})")]
    VocabMismatch {
        /// Tokens of the tokenizer.
        tokenizer: usize,
        /// `vocab_size` of the config.
        config: usize,
    },
}

/// Open the checkpoint of the install at `root`.
pub fn open_checkpoint(root: &Path) -> Result<Checkpoint, InstallError> {
    Checkpoint::open(root).map_err(|source| InstallError::Checkpoint {
        root: root.to_path_buf(),
        source,
    })
}

/// Open the checkpoint and the tokenizer of the install at `root`.
pub fn open(root: &Path) -> Result<(Arc<Checkpoint>, Tokenizer), InstallError> {
    let checkpoint = open_checkpoint(root)?;
    let tokenizer = Tokenizer::from_dir(root).map_err(|source| InstallError::Tokenizer {
        root: root.to_path_buf(),
        source,
    })?;
    Ok((Arc::new(checkpoint), tokenizer))
}

/// Fail unless `tokenizer` has exactly the model's vocabulary size.
pub fn check_vocab(tokenizer: &Tokenizer, model: &K3Model) -> Result<(), InstallError> {
    if tokenizer.vocab_size() != model.dims.vocab_size {
        return Err(InstallError::VocabMismatch {
            tokenizer: tokenizer.vocab_size(),
            config: model.dims.vocab_size,
        });
    }
    Ok(())
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
        std::fs::write(
            dir.path().join(crate::weights::checkpoint::INDEX_FILE),
            "{}",
        )
        .unwrap();
        assert_eq!(missing(dir.path()), None);
        assert_eq!(Missing::Config.to_string(), "config.json is missing");
    }

    #[test]
    fn open_names_the_failing_part() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), "not json").unwrap();
        let err = open(dir.path()).err().unwrap();
        assert!(matches!(err, InstallError::Checkpoint { .. }), "{err}");
        assert!(err.to_string().contains("is not usable"), "{err}");
    }
}
