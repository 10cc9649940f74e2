//! The fuzz harnesses of deltafin: one function per cargo-fuzz target (`fuzz/fuzz_targets/`),
//! each feeding arbitrary bytes to the product's own parsing and validation entry point, the
//! one the server, the loader or the CLI calls on the same bytes.
//!
//! A harness returns nothing and ignores the product's `Err`s: a refused input is a pass.
//! It never panics on its own and never catches a panic, so a panic, an overflow (the fuzz
//! builds keep overflow checks), a hang or an allocation beyond the limit is the product's.
//! Work per input is bounded: an input is cut to [`MAX_INPUT`] bytes ([`MAX_PACK_INPUT`] for
//! DFSP packs, whose smallest valid file is 64 KiB).
//!
//! Binary formats guarded by digests (DFSP packs, scale4 records, the heat histogram) are
//! run twice: as given, and with their digests recomputed over the mutated bytes, so that
//! the fuzzer reaches the checks behind the digest.
//!
//! `tests/corpus.rs` runs every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`
//! through [`TARGETS`]: the quick regression test CI runs (docs/OPERATIONS.md "Fuzzing").

// The fuzz targets touch no memory directly; neither do the harnesses.
#![forbid(unsafe_code)]

mod experts;
mod fetch;
mod files;
mod requests;
mod text;

use deltafin_k3::text::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use experts::{expert_heat, expert_trace, scale4_sidecar, scale4_valid_files};
pub use fetch::{content_range, fetch_manifest};
pub use files::{config_json, dfsp_header, safetensors_header};
pub use requests::{
    request_chat, request_completions, request_messages, request_ollama_chat,
    request_ollama_generate, request_responses, request_tokenize,
};
pub use text::{chat_render, tokenizer};

/// Longest input a harness looks at; the rest is cut off.
pub const MAX_INPUT: usize = 64 << 10;
/// Longest DFSP pack input (a valid pack is at least 64 KiB + 256 bytes).
pub const MAX_PACK_INPUT: usize = 256 << 10;

/// A harness: arbitrary bytes in, nothing out.
pub type Harness = fn(&[u8]);

/// Every target, by its cargo-fuzz name (`fuzz/fuzz_targets/<name>.rs`, corpus
/// `fuzz/corpus/<name>/`).
pub const TARGETS: &[(&str, Harness)] = &[
    ("request_chat", request_chat),
    ("request_completions", request_completions),
    ("request_responses", request_responses),
    ("request_messages", request_messages),
    ("request_ollama_chat", request_ollama_chat),
    ("request_ollama_generate", request_ollama_generate),
    ("request_tokenize", request_tokenize),
    ("chat_render", chat_render),
    ("tokenizer", tokenizer),
    ("safetensors_header", safetensors_header),
    ("config_json", config_json),
    ("dfsp_header", dfsp_header),
    ("scale4_sidecar", scale4_sidecar),
    ("fetch_manifest", fetch_manifest),
    ("expert_trace", expert_trace),
    ("expert_heat", expert_heat),
    ("content_range", content_range),
];

/// The first `max` bytes of `data`.
fn capped(data: &[u8], max: usize) -> &[u8] {
    &data[..data.len().min(max)]
}

/// The repository's `assets/kimi` (the real tokenizer and config files).
pub fn assets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/kimi")
}

/// The real K3 tokenizer, loaded once per process. A missing asset is a broken checkout,
/// not an input: the harness stops with the reason.
fn kimi_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::from_dir(&assets_dir())
            .unwrap_or_else(|e| panic!("fuzz harness setup: cannot load the K3 tokenizer: {e}"))
    })
}

thread_local! {
    /// A scratch directory per thread (the corpus test runs targets on several threads),
    /// on tmpfs where there is one: parsers that take a path read the input from here.
    static SCRATCH: tempfile::TempDir = scratch_dir();
}

fn scratch_dir() -> tempfile::TempDir {
    let mut b = tempfile::Builder::new();
    b.prefix("deltafin-fuzz-");
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(d) = b.tempdir_in(shm)
    {
        return d;
    }
    b.tempdir()
        .unwrap_or_else(|e| panic!("fuzz harness setup: no scratch directory: {e}"))
}

/// Runs `f` with this thread's scratch directory.
fn with_scratch<R>(f: impl FnOnce(&Path) -> R) -> R {
    SCRATCH.with(|d| f(d.path()))
}

/// `bytes` written to `name` in `dir`; `None` if the write failed (nothing to test then).
fn write_scratch(dir: &Path, name: &str, bytes: &[u8]) -> Option<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).ok()?;
    Some(path)
}

/// Little-endian `u32` at `at`, `None` past the end.
fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Little-endian `u64` at `at`, `None` past the end.
fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

/// SHA-256 of the concatenation of `parts`.
fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}
