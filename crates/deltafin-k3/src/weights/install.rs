//! Opening an install for inference: whether a model root holds one, its checkpoint and
//! tokenizer, and the tokenizer/`config.json` vocabulary match (what needs no tokenizer,
//! `missing`, `writable` and the checkpoint's opening, is `deltafin_store::install`). The part of loading shared by
//! the `deltafin` commands and the `deltafin-openai` server; each adds its own experts,
//! options and wording around it.

use crate::model::K3Model;
use crate::text::tokenizer::{Tokenizer, TokenizerError};
use deltafin_store::checkpoint::{Checkpoint, CheckpointError};
pub use deltafin_store::install::{Missing, missing, writable};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    deltafin_store::install::open_checkpoint(root).map_err(|e| InstallError::Checkpoint {
        root: e.root,
        source: e.source,
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

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_store::checkpoint::CONFIG_FILE;

    #[test]
    fn open_names_the_failing_part() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), "not json").unwrap();
        let err = open(dir.path()).err().unwrap();
        assert!(matches!(err, InstallError::Checkpoint { .. }), "{err}");
        assert!(err.to_string().contains("is not usable"), "{err}");
    }
}
