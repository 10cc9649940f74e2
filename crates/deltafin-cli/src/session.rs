//! Loading what every model command needs: the checkpoint, the model, the tokenizer, the
//! Ctrl-C flag, and strict parsing of environment variables.

use anyhow::{Context, Result, bail};
use deltafin_k3::checkpoint::{CONFIG_FILE, Checkpoint};
use deltafin_k3::loader::{EngineOptions, load_model};
use deltafin_k3::model::K3Model;
use deltafin_k3::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A loaded model with its tokenizer.
pub struct Session {
    pub model: K3Model,
    pub tokenizer: Tokenizer,
    pub checkpoint: Arc<Checkpoint>,
    pub load_seconds: f64,
}

/// Open and validate the install at `root`. A missing install is reported with what is
/// missing and how to get it.
pub fn load(root: &Path) -> Result<Session> {
    check_kernels()?;
    if !root.join(CONFIG_FILE).is_file() {
        bail!(
            "no K3 model installed at {}: {} is missing.\n\
             Run `deltafin setup --model-root {}` to install Kimi K3, or pass --model-root PATH \
             pointing at an install (a synthesized test checkpoint: `cargo xtask synth --preset tiny --out DIR`).",
            root.display(),
            CONFIG_FILE,
            root.display()
        );
    }
    let t = Instant::now();
    let checkpoint = Arc::new(
        Checkpoint::open(root)
            .with_context(|| format!("the K3 checkpoint at {} is not usable", root.display()))?,
    );
    let model = load_model(checkpoint.clone(), &EngineOptions::default())
        .with_context(|| format!("cannot build the model from {}", root.display()))?;
    let tokenizer = Tokenizer::from_dir(root)
        .with_context(|| format!("cannot load the tokenizer from {}", root.display()))?;
    if tokenizer.vocab_size() != model.dims.vocab_size {
        bail!(
            "tokenizer vocabulary ({}) does not match config.json vocab_size ({})",
            tokenizer.vocab_size(),
            model.dims.vocab_size
        );
    }
    Ok(Session {
        model,
        tokenizer,
        checkpoint,
        load_seconds: t.elapsed().as_secs_f64(),
    })
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

/// Resolve the kernel path now (`DELTAFIN_KERNEL` is parsed strictly), so a bad value is a
/// clear startup error rather than a failure at the first product.
pub fn check_kernels() -> Result<()> {
    deltafin_kernels::select_backend()
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// The compute backend line shared by the startup echo and the events file.
pub fn backend_description() -> String {
    format!(
        "device=cpu threads={} kernels={}",
        rayon::current_num_threads(),
        deltafin_kernels::kernel_backend()
    )
}
