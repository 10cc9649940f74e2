//! Strict reading of environment variables, and the model root every command resolves the
//! same way.

use anyhow::{Result, anyhow, bail};
use deltafin_k3::text::chat::Thinking;
use deltafin_spec::dspark::SpecConfig;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

/// The model root of every command that takes `--model-root`: the flag, else
/// `DELTAFIN_ROOT` (when set and not empty; any path, UTF-8 or not), else the current
/// directory.
pub fn model_root(flag: Option<&Path>) -> PathBuf {
    match flag {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os("DELTAFIN_ROOT")
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from("."), PathBuf::from),
    }
}

/// Value of environment variable `name`, if set; a non-UTF-8 value is an error.
pub fn env_var(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            bail!("environment variable {name} is not valid UTF-8")
        }
    }
}

/// The speculative-decoding settings from `K3_DSPARK`, `K3_DSPARK_MAX_CONTEXT`,
/// `K3_SPEC_DEPTH`, `K3_UAG_DRAFT` and `K3_DSPARK_AUTO_MIN_SPEEDUP` (unset: defaults); a
/// value that is not UTF-8 is an error naming its variable, as for every other variable.
pub fn spec_config() -> Result<SpecConfig> {
    let not_utf8 = RefCell::new(None);
    let config = SpecConfig::from_lookup(|k| {
        env_var(k).unwrap_or_else(|e| {
            not_utf8.borrow_mut().get_or_insert(e);
            None
        })
    });
    if let Some(e) = not_utf8.into_inner() {
        return Err(e);
    }
    config.map_err(|e| anyhow!("{e}"))
}

/// `K3_REASONING_EFFORT` parsed with the server's spellings (`none`, `off`, `minimal`: no
/// thinking; `low` … `max`), `None` when unset.
pub fn env_thinking() -> Result<Option<Thinking>> {
    env_var("K3_REASONING_EFFORT")?
        .map(|v| {
            Thinking::parse(&v)
                .map_err(|e| anyhow!("environment variable K3_REASONING_EFFORT: {e}"))
        })
        .transpose()
}

/// `name` parsed by `parse`, else `default`; a value `parse` rejects is an error naming the
/// variable.
pub fn env_choice<T>(
    name: &str,
    default: T,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<T> {
    match env_var(name)? {
        None => Ok(default),
        Some(v) => parse(&v).map_err(|e| anyhow!("environment variable {name}: {e}")),
    }
}

/// A decimal GB value (`1e9` bytes): a positive finite number.
pub fn parse_gb(text: &str) -> std::result::Result<u64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of GB"))?;
    if !v.is_finite() || v <= 0.0 || v > 1e6 {
        return Err(format!(
            "{text:?} must be a positive number of GB (at most 1e6)"
        ));
    }
    Ok((v * 1e9) as u64)
}
