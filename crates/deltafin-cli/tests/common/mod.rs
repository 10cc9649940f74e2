//! Helpers shared by the tests of the `deltafin` process: synthesized checkpoints, running the
//! binary, its output as text, the library's own greedy ids to compare a run with, JSON-lines
//! files (events files, `runs.jsonl`) and token-id arrays, and a `deltafin serve` process.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use deltafin_k3::generate::GenerateOptions;
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS, Tokenizer};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_k3::weights::spine_int8::SpineFormat;
use deltafin_spec::generate;
use serde_json::Value;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

/// A fresh synthesized checkpoint of `dims` from `seed`.
pub fn checkpoint(dims: SynthDims, seed: u64) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(dims, seed)).unwrap();
    d
}

/// A checkpoint of `dims` from `seed` synthesized into `root` (a directory of its own name,
/// for tests that spell, move or relate to its path).
pub fn checkpoint_in(root: &Path, dims: SynthDims, seed: u64) {
    synthesize(root, &SynthSpec::new(dims, seed)).unwrap();
}

/// Flip one byte in every expert record of `root`'s `k3-experts-scale4/L{layer}.sc4` (a
/// checkpoint of `experts` experts per layer after `convert-experts-scale4`); its path.
pub fn damage_scale4(root: &Path, layer: usize, experts: usize) -> std::path::PathBuf {
    // The file header; then one record per expert.
    const HEADER: usize = 8192;
    let p = root.join(format!("k3-experts-scale4/L{layer}.sc4"));
    let mut b = std::fs::read(&p).unwrap();
    let record = (b.len() - HEADER) / experts;
    for e in 0..experts {
        b[HEADER + e * record + record / 2] ^= 0x5a;
    }
    std::fs::write(&p, b).unwrap();
    p
}

/// The checkpoint kept in `cell`, synthesized on first use: one checkpoint shared by the
/// tests of a binary.
pub fn shared_checkpoint(
    cell: &'static OnceLock<tempfile::TempDir>,
    dims: SynthDims,
    seed: u64,
) -> &'static Path {
    cell.get_or_init(|| {
        let d = checkpoint(dims, seed);
        // A static is never dropped: remove the checkpoint when the binary exits.
        deltafin_k3::synth::remove_at_exit(d.path());
        d
    })
    .path()
}

/// Runs the `deltafin` binary with `args`: the variables `unset` are taken out of the
/// environment it inherits, then `env` is set in order (a later pair wins).
pub fn deltafin(args: &[&str], unset: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(args);
    for k in unset {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied()).output().unwrap()
}

/// [`deltafin`] on the model at `root` (`args --model-root root`) with the weight-exact bf16
/// spine pinned before `env` (which may override it): runs compared with the library's model.
pub fn deltafin_bf16(root: &Path, args: &[&str], unset: &[&str], env: &[(&str, &str)]) -> Output {
    let root = root.to_str().unwrap();
    let args = [args, &["--model-root", root]].concat();
    deltafin(&args, unset, &[&[("K3_SPINE", "bf16")], env].concat())
}

/// The library's greedy completion of the raw `prompt` on `spine` (at most `max_new` tokens,
/// stopping at K3's end ids): what `deltafin run` must emit.
pub fn library_greedy(root: &Path, spine: SpineFormat, prompt: &str, max_new: usize) -> Vec<u32> {
    let opts = EngineOptions {
        spine,
        ..Default::default()
    };
    let model = open_model(root, &opts).unwrap();
    let ids = Tokenizer::from_dir(root).unwrap().encode_ordinary(prompt);
    let opts = GenerateOptions {
        max_new: Some(max_new),
        stop_ids: vec![END_OF_MSG, EOS],
        max_context: 4096,
        top_logits: 0,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    generate(&model, &ids, &opts, &stop, |_| Ok(()))
        .unwrap()
        .ids
}

/// A finished process's stdout then stderr, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A finished process's stdout and stderr, apart.
pub fn stdout_stderr(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Asserts that the process exited with `code` (its output is the failure message); returns
/// its stdout then stderr.
#[track_caller]
pub fn exits(o: &Output, code: i32) -> String {
    let t = text(o);
    assert_eq!(o.status.code(), Some(code), "{t}");
    t
}

/// Asserts that the process failed and that its stderr names `needle`; returns the stderr.
#[track_caller]
pub fn fails_with(o: &Output, needle: &str) -> String {
    let (out, err) = stdout_stderr(o);
    assert!(
        !o.status.success() && err.contains(needle),
        "{:?} without {needle:?} in stderr: {out}{err}",
        o.status
    );
    err
}

/// Asserts that `text` contains each of `needles` (the text is the failure message).
#[track_caller]
pub fn assert_says(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "{n:?} is missing from: {text}");
    }
}

/// The values of a JSON-lines file, one a line.
pub fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A `deltafin serve` process (killed when dropped, if it still runs).
pub struct ServeProcess {
    pub child: Child,
    /// The address it printed (`listening on http://…`).
    pub addr: SocketAddr,
    /// Its stderr lines up to that one (the settings, the memory plan).
    pub startup: Vec<String>,
    /// Every stderr line after it (the request log, any panic), drained as it comes: a server
    /// blocked on a full pipe would look hung.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl ServeProcess {
    /// The stderr lines so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        let log = self.log.lock().unwrap();
        self.startup
            .iter()
            .chain(log.iter())
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `deltafin serve --port 0 ARGS` and returns once it prints its address. The
/// synthesized checkpoints have no int8 spine, so it runs the bf16 one, with small
/// prefix-state tiers; every other server variable is taken out of its environment (a test
/// passes the settings it relies on as flags).
pub fn serve_process<I, A>(args: I) -> ServeProcess
where
    I: IntoIterator<Item = A>,
    A: AsRef<OsStr>,
{
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.env("K3_SPINE", "bf16")
        .env("K3_STATE_CACHE_DISK_GB", "0.25")
        .env("K3_STATE_CACHE_RAM_GB", "0.05");
    for k in [
        "DELTAFIN_API_KEY",
        "K3_MEMORY_BUDGET_GB",
        "K3_SERVER_QUEUE",
        "K3_REASONING_EFFORT",
        "K3_STATE_CACHE",
        "K3_EXPERT_PIN_GB",
        "K3_PROVIDER_RESIDENT_LAYERS",
        "K3_DSPARK",
        "K3_UAG_DRAFT",
    ] {
        cmd.env_remove(k);
    }
    cmd.args(["serve", "--port", "0"])
        .args(args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut startup = Vec::new();
    let addr = loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "serve exited: {startup:?}"
        );
        startup.push(line.clone());
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    ServeProcess {
        child,
        addr,
        startup,
        log,
    }
}

/// Overwrite the bytes at `at` of tensor `name` in whichever shard of `root` holds it (a
/// damaged copy of an install).
pub fn poke_tensor(root: &Path, name: &str, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let f = deltafin_tensor::SafetensorsFile::open(&p).unwrap();
        if let Ok((start, len)) = f.absolute_range(name) {
            assert!(at + bytes.len() as u64 <= len);
            drop(f);
            let file = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            file.write_all_at(bytes, start + at).unwrap();
            return;
        }
    }
    panic!("no shard of {} holds {name}", root.display());
}

/// bf16 +infinity, little-endian.
pub const BF16_INF: [u8; 2] = [0x80, 0x7f];

/// Rename the chat marker `<|open|>` in `root`'s `tokenizer_config.json` (a damaged install).
pub fn rename_open_marker(root: &Path) {
    let cfg = root.join("tokenizer_config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(text.contains("\"<|open|>\""));
    std::fs::write(&cfg, text.replace("\"<|open|>\"", "\"<|opened|>\"")).unwrap();
}
